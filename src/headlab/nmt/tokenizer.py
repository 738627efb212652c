"""A joint source+target subword vocabulary trained with HF ``tokenizers``.

BPE over a Metaspace pre-tokenizer (SentencePiece-style "▁" word boundaries), so that
``encoding.word_ids()`` maps each subword back to its whitespace word and ``decode`` gives
detokenized text. ``</s>`` is appended to every sequence (source and target) by the
post-processor; ``<pad>`` doubles as Marian's decoder start token. A language model's
vocabulary (``bos=True``) also opens every sequence with ``<s>``, so that the first word has a
token before it to predict from and to attend to.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from headlab.errors import HeadlabError

__all__ = ["PAD", "EOS", "UNK", "train_tokenizer", "load_tokenizer", "run_tokenizer"]

PAD, EOS, UNK, BOS = "<pad>", "</s>", "<unk>", "<s>"
SPECIAL_TOKENS = [PAD, EOS, UNK]  # ids 0, 1, 2 (and BOS 3 with bos=True)


def train_tokenizer(
    texts: Iterable[str],
    vocab_size: int = 8000,
    *,
    min_frequency: int = 2,
    save_dir: str | Path | None = None,
    bos: bool = False,
    model_max_length: int = 256,
) -> PreTrainedTokenizerFast:
    """Train a joint BPE vocabulary on ``texts`` (give it source and target sentences).

    Returns a fast tokenizer with pad/eos/unk set; with ``save_dir`` it is also saved there so
    that ``AutoTokenizer.from_pretrained(save_dir)`` loads it.
    """
    if vocab_size < len(SPECIAL_TOKENS) + 10:
        raise HeadlabError(f"vocab_size {vocab_size} is too small")
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS + ([BOS] if bos else []),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    eos_id = tok.token_to_id(EOS)
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A {EOS}", pair=f"{BOS} $A {EOS} $B {EOS}",
            special_tokens=[(BOS, tok.token_to_id(BOS)), (EOS, eos_id)],
        )
    else:
        tok.post_processor = processors.TemplateProcessing(
            single=f"$A {EOS}", pair=f"$A {EOS} $B {EOS}", special_tokens=[(EOS, eos_id)]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        model_max_length=model_max_length,
        **({"bos_token": BOS} if bos else {}),
    )
    if save_dir is not None:
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        fast.save_pretrained(str(save_dir))
    return fast


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """Load a tokenizer saved by :func:`train_tokenizer` (or any fast HF tokenizer)."""
    path = Path(path)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise HeadlabError(f"no tokenizer in {path} (expected tokenizer.json)")
    serialized = path / "tokenizer.json"
    if serialized.is_file():  # empty or cut short: transformers' JSONDecodeError would be a traceback
        try:
            Tokenizer.from_file(str(serialized))
        except Exception as error:  # noqa: BLE001 - tokenizers raises its own exception types
            reason = "the file is empty" if serialized.stat().st_size == 0 else f"not a tokenizer ({error})"
            raise HeadlabError(f"{serialized}: {reason}; copy it again from the model it came with") from error
    try:
        # A vocabulary headlab trained (or any fast tokenizer): never code from the directory, never a prompt.
        # the ignore below: AutoTokenizer may give the SentencePiece backend; callers use only the API both share
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)  # type: ignore[return-value]
    except (ValueError, OSError) as error:
        if serialized.is_file():
            raise
        # Only tokenizer_config.json: transformers would build the vocabulary from a slow
        # tokenizer's files, and there are none (or no converter is installed).
        raise HeadlabError(f"no usable tokenizer in {path}: {serialized.name} is missing and the "
                           "other tokenizer files there cannot make one") from error


def run_tokenizer(out_dir: str | Path, given: str | None, resume: bool, train_new) -> tuple[PreTrainedTokenizerFast, bool]:
    """A training run's vocabulary: ``given`` (``--tokenizer``), else the one the run saved (on
    ``--resume``), else ``train_new()``. Returns it and whether it was trained here."""
    saved = Path(out_dir) / "tokenizer"
    if given:
        return load_tokenizer(given), False
    if resume and (saved / "tokenizer.json").is_file():
        return load_tokenizer(saved), False
    return train_new(), True
