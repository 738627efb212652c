"""What a model reads when headlab scores its heads: token ids, batches, and its own translations.

The importance measures share one preparation step so that they score the same tokens; it
reads the model through :func:`headlab.model_description.describe_model`.

* :class:`ImportanceData` holds the tokenized data set: source sentences (for a
  decoder-only or encoder-only model, the text itself), optional references, and the model's
  own translations once :func:`translate_data` has made them. It counts what loading did:
  empty lines skipped, inputs truncated to the model's maximum length.
* :func:`read_labelled_data` reads a classifier's labelled TSV (``text<TAB>label`` or
  ``text_a<TAB>text_b<TAB>label``).
* :func:`make_batches` pads a data set into :class:`Batch` es. For a translation model the
  decoder side is either the model's translation (``side="translation"``, used by confidence
  and LRP: Voita et al. 2019, Sec. 4, score the model's own output) or the reference
  (``side="reference"``, used by the loss of gradient importance and ablation when
  references are given). (The trainers' batches are another thing:
  :func:`headlab.data.batching.token_budget_batches`.)
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from headlab.capture import eval_mode, float32_mask_floor
from headlab.data.batching import length_batches, with_progress
from headlab.errors import HeadlabError, counted
from headlab.model_description import ModelInfo, generation_cache_problem
from headlab.shard import active

__all__ = [
    "Batch",
    "ImportanceData",
    "batch_lengths",
    "count_batches",
    "encode_texts",
    "generated_tokens",
    "labelled_lines_data",
    "labelled_texts",
    "make_batches",
    "read_data",
    "read_labelled_data",
    "texts_data",
    "translate_data",
]


@dataclass
class ImportanceData:
    """A tokenized data set: ``sources`` (encoder input, or the text of a decoder-only or
    encoder-only model), optional ``references`` and, once made, the model's ``translations``
    (token ids without the decoder start token, ending with EOS when the model produced one).
    """

    sources: list[list[int]]
    references: list[list[int]] | None = None
    translations: list[list[int]] | None = None
    source_path: str = ""
    target_path: str = ""
    n_lines: int = 0
    n_empty: int = 0
    n_truncated: int = 0
    max_length: int | None = None
    source_texts: list[str] = field(default_factory=list, repr=False)
    reference_texts: list[str] = field(default_factory=list, repr=False)
    classes: list[int] | None = None
    """A classifier's gold label (class index) of each text."""
    segments: list[list[int]] | None = None
    """Token type ids of text pairs (``text_a<TAB>text_b``), when the tokenizer makes them."""

    def __post_init__(self) -> None:
        if not self.sources:
            where = f" in {self.source_path}" if self.source_path else ""
            raise HeadlabError(
                f"empty data set: no non-empty sentence{where}"
                + (f" ({counted(self.n_empty, 'empty line')} skipped)" if self.n_empty else "")
            )
        if self.references is not None and len(self.references) != len(self.sources):
            raise HeadlabError(f"{counted(len(self.sources), 'source')} but {counted(len(self.references), 'reference')}")
        if self.classes is not None and len(self.classes) != len(self.sources):
            raise HeadlabError(f"{counted(len(self.sources), 'text')} but {counted(len(self.classes), 'label')}")
        if not self.n_lines:
            self.n_lines = len(self.sources) + self.n_empty

    def __len__(self) -> int:
        return len(self.sources)

    @classmethod
    def from_ids(cls, sources: Sequence[Sequence[int]], references: Sequence[Sequence[int]] | None = None) -> "ImportanceData":
        return cls([list(map(int, s)) for s in sources], None if references is None else [list(map(int, r)) for r in references])

    @property
    def n_source_tokens(self) -> int:
        return sum(len(s) for s in self.sources)

    def __repr__(self) -> str:
        return f"ImportanceData({self.summary()})"

    def summary(self) -> str:
        text = f"{counted(len(self), 'sentence')} ({counted(self.n_source_tokens, 'source token')})"
        if self.source_path:
            text += f" from {self.source_path}"
        if self.n_empty:
            text += f"; {counted(self.n_empty, 'empty line')} skipped"
        if self.n_truncated:
            text += (f"; {counted(self.n_truncated, 'input')} longer than {counted(self.max_length or 0, 'token')} "
                     f"{'was' if self.n_truncated == 1 else 'were'} truncated")
        return text

    def signature(self) -> dict:
        """The data part of a HeadScores signature."""
        return {
            "data": self.source_path or "<ids>",
            "target": self.target_path or None,
            "n_sentences": len(self),
            "n_source_tokens": self.n_source_tokens,
            "n_truncated": self.n_truncated,
            "n_empty_skipped": self.n_empty,
            "max_length": self.max_length,
        }


def _check_cut(cut: Sequence[Sequence[int]], max_length: int) -> None:
    """A tokenizer asked to cut below its own special tokens returns the input whole (with a
    warning): the numbers would be of the full inputs, recorded as cut to ``max_length``."""
    longest = max((len(ids) for ids in cut), default=0)
    if longest > max_length:
        raise HeadlabError(f"--max-length {max_length}: too short for the tokenizer, which cannot cut an input "
                           f"below its special tokens (an input kept {counted(longest, 'token')}); give a larger max length")


def _encode(tokenizer, texts: list[str], max_length: int, target: bool = False) -> tuple[list[list[int]], int]:
    """Token ids of ``texts`` cut to ``max_length`` tokens, and how many had to be cut."""
    key = "text_target" if target else "text"
    full = tokenizer(**{key: texts}, truncation=False)["input_ids"]
    cut = [i for i, ids in enumerate(full) if len(ids) > max_length]
    if cut:
        short = tokenizer(**{key: [texts[i] for i in cut]}, truncation=True, max_length=max_length)["input_ids"]
        _check_cut(short, max_length)
        for i, ids in zip(cut, short):
            full[i] = ids
    return [list(ids) for ids in full], len(cut)


def encode_texts(
    tokenizer,
    info: ModelInfo,
    sources: Sequence[str],
    references: Sequence[str] | None = None,
    *,
    source_path: str = "",
    target_path: str = "",
    n_empty: int = 0,
) -> ImportanceData:
    """Tokenize sentences (and references) for ``info``'s model, truncating over-long ones.

    Inputs longer than the model accepts are cut to ``info.max_length`` tokens (special tokens
    such as EOS are kept by the tokenizer) and counted in ``n_truncated``.
    """
    keep = [i for i, text in enumerate(sources) if text.strip()]
    if references is not None:
        keep = [i for i in keep if references[i].strip()]
    n_empty += len(sources) - len(keep)
    texts = [sources[i].strip() for i in keep]
    if not texts:
        where = f" in {source_path}" if source_path else ""
        raise HeadlabError(f"empty data set: no non-empty sentence{where}")
    ids, n_cut = _encode(tokenizer, texts, info.max_length)
    refs = ref_texts = None
    if references is not None:
        if not info.is_seq2seq:
            raise HeadlabError("--target references are only used with translation (encoder-decoder) models")
        ref_texts = [references[i].strip() for i in keep]
        refs, n_cut_ref = _encode(tokenizer, ref_texts, info.max_length, target=True)
        n_cut += n_cut_ref
    return ImportanceData(
        ids, refs, None, source_path, target_path, len(sources), n_empty, n_cut, info.max_length,
        source_texts=texts, reference_texts=ref_texts or [],
    )


def read_data(
    path: str | Path,
    tokenizer,
    info: ModelInfo,
    *,
    target_path: str | Path | None = None,
    n_sentences: int | None = None,
) -> ImportanceData:
    """Read a text file (plain or ``.gz``, one sentence per line) and tokenize it.

    With ``target_path`` the two files are a line-aligned parallel corpus (references).
    ``n_sentences`` keeps the first N sentences. Empty lines (either side) are skipped and counted.
    """
    from headlab.data.parallel import read_lines

    if info.arch == "classifier":
        if target_path is not None:
            raise HeadlabError("--target is for translation models; a classifier reads its labels from the TSV")
        return read_labelled_data(path, tokenizer, info, n_sentences=n_sentences)
    return texts_data(read_lines(path), tokenizer, info,
                      targets=None if target_path is None else read_lines(target_path),
                      n_sentences=n_sentences, name=str(path),
                      target_name="" if target_path is None else str(target_path))


def texts_data(
    texts: Sequence[str],
    tokenizer,
    info: ModelInfo,
    *,
    targets: Sequence[str] | None = None,
    labels: Sequence[int | str] | None = None,
    n_sentences: int | None = None,
    name: str = "",
    target_name: str = "",
) -> ImportanceData:
    """:func:`read_data` of sentences held in memory (what the file's lines would be): the same
    checks, counts and tokens. A classifier's ``texts`` are its inputs (a string, or a pair of
    strings for a sentence-pair task) with one class (index or label name) each in ``labels``."""
    where = name or "the texts"
    if isinstance(texts, str):
        raise HeadlabError("texts must be a list of sentences, not one string")
    if info.arch == "classifier":
        if targets is not None:
            raise HeadlabError("targets are for translation models; a classifier takes labels")
        if labels is None or len(labels) != len(texts):
            raise HeadlabError(f"a classifier needs one label per text: {counted(len(texts), 'text')}, "
                               f"{'no labels' if labels is None else counted(len(labels), 'label')}")
        lines = []
        for number, (text, label) in enumerate(zip(texts, labels), start=1):
            fields = [text] if isinstance(text, str) else list(text)
            if any("\t" in f or "\n" in f for f in fields):
                raise HeadlabError(f"{where}: text {number} holds a tab or a line break")
            lines.append("\t".join([*fields, str(label)]))
        # labels given as integers are class indices, whatever the model's label names read as
        indices = all(isinstance(label, numbers.Integral) and not isinstance(label, bool) for label in labels)
        return labelled_lines_data(lines, tokenizer, info, n_sentences=n_sentences, name=name or "<texts>",
                                   names=False if indices else None)
    if labels is not None:
        raise HeadlabError("labels are for sequence classifiers; this model is not one")
    sources = list(texts)
    references = None if targets is None else list(targets)
    for number, text in enumerate(sources, start=1):
        if not isinstance(text, str):  # a pair: sequence classifiers only (it failed as an AttributeError)
            raise HeadlabError(f"{where}: text {number} is a {type(text).__name__}, not a string "
                               "(pairs of texts are for sequence classifiers)")
    if references is not None and len(references) != len(sources):
        raise HeadlabError(
            f"{where} has {counted(len(sources), 'line')} but {target_name or 'the targets'} has {len(references)}: "
            "source and reference files must match line for line"
        )
    if n_sentences is not None:
        from headlab.data.parallel import first_sentences

        if n_sentences < 1:
            raise HeadlabError(f"--limit must be at least 1, got {n_sentences}")
        end = first_sentences(sources, n_sentences, references)  # N sentences: blank lines are not counted
        sources = sources[:end]
        references = None if references is None else references[:end]
    if not any(line.strip() for line in sources):
        raise HeadlabError(f"empty data set: {where} has no non-empty line")
    return encode_texts(tokenizer, info, sources, references, source_path=name, target_path=target_name)


def _label_reading(labels: Sequence[tuple[str, str]], info: ModelInfo) -> bool:
    """Whether the label fields (``(value, where)``) of one file are read as label names first (else
    as class indices). A model whose labels are named by numbers that are not their indices ("1".."5"
    for classes 0..4) reads "1" either way: one file is read one way, told by a value that reads
    only one way ("0": an index; "5": a name), never line by line, which merged classes 0 and 1."""
    named = not all(n.startswith("LABEL_") for n in info.label_names)
    only_index = only_name = None
    for value, where in labels:
        value = value.strip()
        as_name = named and value in info.label_names
        as_index = value.isascii() and value.isdigit() and int(value) < info.n_labels
        if as_index and not as_name:
            only_index = only_index or (value, where)
        elif as_name and not as_index:
            only_name = only_name or (value, where)
    differ = named and any(name != str(i) and name.isascii() and name.isdigit() and int(name) < info.n_labels
                           for i, name in enumerate(info.label_names))
    if not differ or only_index is None:
        return named
    if only_name is not None:
        raise HeadlabError(f"{only_index[1]}: label {only_index[0]!r} is a class index, but {only_name[1]}: label "
                           f"{only_name[0]!r} is one of the model's label names ({', '.join(info.label_names)} for classes "
                           f"0..{info.n_labels - 1}); write every label one way")
    return False


def _label_index(value: str, info: ModelInfo, where: str, names: bool = True) -> int:
    """A label field: one of the model's label names (with ``names``), or a class index."""
    value = value.strip()
    if names and value in info.label_names and not all(n.startswith("LABEL_") for n in info.label_names):
        return info.label_names.index(value)
    try:
        index = int(value)
    except ValueError:
        raise HeadlabError(f"{where}: label {value!r} is neither a class index (0..{info.n_labels - 1}) nor one "
                           f"of the model's labels ({', '.join(info.label_names)})") from None
    if not 0 <= index < info.n_labels:
        raise HeadlabError(f"{where}: label {index} is outside the model's {info.n_labels} classes "
                           f"(0..{info.n_labels - 1})")
    return index


def labelled_texts(path: str | Path) -> list[str]:
    """The text fields of a classifier's labelled TSV (the format of :func:`read_labelled_data`),
    each its own sentence, without the label column and the header: what the token frequencies
    of rare-token heads count when no training text is given."""
    from headlab.data.parallel import read_lines

    texts = []
    for number, line in enumerate(read_lines(path), start=1):
        fields = line.split("\t")
        if len(fields) < 2 or (number == 1 and fields[-1].strip().lower() == "label"):
            continue  # blank, or the header
        texts += [field.strip() for field in fields[:-1] if field.strip()]
    return texts


def read_labelled_data(
    path: str | Path, tokenizer, info: ModelInfo, *, n_sentences: int | None = None
) -> ImportanceData:
    """A classifier's data: a TSV of ``text<TAB>label`` or ``text_a<TAB>text_b<TAB>label`` lines
    (a GLUE-style header line whose last field is ``label`` is skipped). The label is a class
    index or one of the model's label names (``config.id2label``). Every line must have the
    same number of fields; a bad line is an error naming the file and line."""
    from headlab.data.parallel import read_lines

    return labelled_lines_data(read_lines(path), tokenizer, info, n_sentences=n_sentences, name=str(path))


def labelled_lines_data(
    lines: Sequence[str], tokenizer, info: ModelInfo, *, n_sentences: int | None = None, name: str = "<texts>",
    names: bool | None = None,
) -> ImportanceData:
    """:func:`read_labelled_data` of the TSV's lines held in memory (``name`` in messages). ``names``:
    False reads every label as a class index; None tells from the labels (:func:`_label_reading`)."""
    path = name
    if n_sentences is not None and n_sentences < 1:
        raise HeadlabError(f"--limit must be at least 1, got {n_sentences}")
    rows, n_empty, width = [], 0, None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            n_empty += 1
            continue
        fields = line.rstrip("\r\n").split("\t")
        where = f"{path}:{number}"
        if number == 1 and fields[-1].strip().lower() == "label":
            continue  # header
        if len(fields) not in (2, 3):
            raise HeadlabError(f"{where}: expected text<TAB>label or text_a<TAB>text_b<TAB>label, got "
                               f"{len(fields)} tab-separated field(s)")
        if width is not None and len(fields) != width:
            raise HeadlabError(f"{where}: {counted(len(fields), 'field')}, but earlier lines have {width}")
        width = len(fields)
        if not all(f.strip() for f in fields[:-1]):
            raise HeadlabError(f"{where}: empty text")
        rows.append(([f.strip() for f in fields[:-1]], (fields[-1], where)))
        if n_sentences is not None and len(rows) == n_sentences:
            break
    if not rows:
        raise HeadlabError(f"empty data set: {path} has no labelled line")
    if names is None:
        names = _label_reading([label for _, label in rows], info)
    classes = [_label_index(value, info, where, names) for _, (value, where) in rows]
    texts = [fields for fields, _ in rows]
    firsts = [t[0] for t in texts]
    seconds = [t[1] for t in texts] if width == 3 else None
    encoded = tokenizer(firsts, seconds, truncation=False)
    too_long = [i for i, ids in enumerate(encoded["input_ids"]) if len(ids) > info.max_length]
    if too_long:
        short = tokenizer([firsts[i] for i in too_long], None if seconds is None else [seconds[i] for i in too_long],
                          truncation=True, max_length=info.max_length)
        _check_cut(short["input_ids"], info.max_length)
        for key in encoded:
            for i, value in zip(too_long, short[key]):
                encoded[key][i] = value
    segments = [list(map(int, x)) for x in encoded["token_type_ids"]] if width == 3 and "token_type_ids" in encoded \
        else None
    return ImportanceData(
        [list(map(int, ids)) for ids in encoded["input_ids"]], None, None, str(path), "", len(lines), n_empty,
        len(too_long), info.max_length, source_texts=[" ".join(t) for t in texts],
        classes=classes, segments=segments,
    )


# -- translations --------------------------------------------------------------------------
def generated_tokens(row: list[int], info: ModelInfo) -> list[int]:
    """Generated ids without the decoder start token, cut after the first EOS."""
    out: list[int] = []
    for token in row[1:]:
        out.append(token)
        if token in info.eos_ids:
            break
    # trailing padding of a sequence that never produced EOS
    while out and out[-1] == info.pad_id and info.pad_id not in info.eos_ids:
        out.pop()
    return out


@torch.no_grad()
def translate_data(
    model: nn.Module,
    data: ImportanceData,
    info: ModelInfo,
    *,
    batch_size: int = 32,
    beam: int = 1,
    max_length_a: float = 1.5,
    max_length_b: int = 10,
    progress: bool = False,
) -> ImportanceData:
    """The model's own translation of every source sentence (greedy with ``beam=1``).

    Returns a copy of ``data`` with ``translations`` filled. Each translation gets at most
    ``max_length_a * source_len + max_length_b`` tokens, capped by the model's positions.
    """
    if not info.is_seq2seq:
        raise HeadlabError("translations exist only for encoder-decoder models")
    problem = generation_cache_problem(model)
    if problem:  # before any batch: transformers' own generate would fail with an IndexError
        raise HeadlabError(problem)
    device = next(model.parameters()).device
    outputs: list[list[int] | None] = [None] * len(data)
    shard = active()  # several processes: each translates its own batches, gathered below
    chunks = with_progress(list(shard.take(length_batches([len(ids) for ids in data.sources], batch_size))),
                           progress, "translate", unit="batch")
    # the floor: a float64 eager model's padding query that may attend to no key is NaN otherwise (capture's)
    with eval_mode(model), float32_mask_floor(model):
        for chunk in chunks:
            ids, mask = _pad([data.sources[i] for i in chunk], info.pad_id, device)
            limit = min(int(max_length_a * ids.shape[1] + max_length_b), info.max_length - 1)
            generated = cast(Any, model).generate(
                input_ids=ids, attention_mask=mask, num_beams=beam, do_sample=False,
                max_new_tokens=max(limit, 1), min_new_tokens=1,
                max_length=None,  # the limit is max_new_tokens: no warning about the config's max_length
            )
            for i, row in zip(chunk, generated.tolist()):
                outputs[i] = generated_tokens(row, info)
    if shard.split:
        for part in shard.gather({i: o for i, o in enumerate(outputs) if o is not None}):
            for i, tokens in part.items():
                outputs[i] = tokens
    return replace(data, translations=[o or [] for o in outputs])


# -- batches -------------------------------------------------------------------------------
@dataclass
class Batch:
    """One padded batch and the masks every measure needs.

    ``inputs`` are the model's keyword arguments. ``steps`` ``[batch, t_len]`` marks the
    positions whose prediction is a generation step (LRP targets): every decoder position up
    to the one predicting EOS for a translation model, every token for a causal LM, every
    non-special token for a masked LM. ``labels`` ``[batch, t_len]`` hold the token to predict
    there (-100 elsewhere) for the loss. ``valid[kind]`` ``(queries [batch, q_len], keys
    [batch, k_len])`` mark real, non-special tokens for confidence. ``index`` gives each row's
    sentence number in the data set.
    """

    inputs: dict[str, torch.Tensor]
    steps: torch.Tensor
    labels: torch.Tensor
    valid: dict[str, tuple[torch.Tensor, torch.Tensor]]
    index: list[int]

    @property
    def size(self) -> int:
        return len(self.index)

    @property
    def n_steps(self) -> int:
        return int(self.steps.sum())


def _pad(rows: list[list[int]], pad_id: int, device, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    width = width or max(1, max(len(r) for r in rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, : len(row)] = 1
    return ids.to(device), mask.to(device)


def _not_special(ids: torch.Tensor, mask: torch.Tensor, special: frozenset[int]) -> torch.Tensor:
    keep = mask.bool()
    for token in special:
        keep &= ids != token
    return keep


def _mask_positions(ids: torch.Tensor, keep: torch.Tensor, seed: int, rate: float = 0.15) -> torch.Tensor:
    """Deterministic choice of the tokens to mask for a masked-LM loss (at least one per row)."""
    g = torch.Generator().manual_seed(seed)
    chosen = (torch.rand(ids.shape, generator=g) < rate).to(ids.device) & keep
    for row in range(ids.shape[0]):
        if keep[row].any() and not chosen[row].any():
            chosen[row, int(keep[row].nonzero()[0])] = True
    return chosen


def batch_lengths(data: ImportanceData, decoder_side: list[list[int]] | None = None) -> list:
    """The length that orders ``data`` into batches: the source's, or for a translation model
    (decoder side given) its decoder side's, then its source's.

    LRP runs one backward pass per step of a batch's longest decoder side, over every row, and
    a translation's length does not follow its source's closely (a runaway one can be twice
    as long): grouped by the decoder side, fewer rows wait through steps they do not have
    (docs/benchmarks.md, "LRP: sentences per batch").
    """
    if decoder_side is None:
        return [len(ids) for ids in data.sources]
    return [(len(target), len(source)) for target, source in zip(decoder_side, data.sources)]


def make_batches(
    data: ImportanceData,
    info: ModelInfo,
    *,
    batch_size: int = 32,
    side: str = "translation",
    device: torch.device | str = "cpu",
    mask_tokens: bool = False,
    seed: int = 0,
) -> Iterator[Batch]:
    """Padded batches of ``data``, sentences sorted by length (little padding): a translation
    model's by the length of the decoder side, then of the source (:func:`batch_lengths`).

    ``side`` picks the decoder input of a translation model: ``"translation"`` (the model's
    own output, which :func:`translate_data` must have made) or ``"reference"`` (falls back
    to the translation when the data has no references). ``mask_tokens`` replaces the
    loss-bearing tokens of a masked LM by its mask token (15 %, fixed seed); without a mask
    token the loss is on reconstructing the unmasked input.
    """
    if batch_size < 1:
        raise HeadlabError(f"batch size must be at least 1, got {batch_size}")
    decoder_side: list[list[int]] | None = None
    if info.is_seq2seq:
        if side == "reference" and data.references is not None:
            decoder_side = data.references
        elif data.translations is not None:
            decoder_side = data.translations
        else:
            raise HeadlabError("translate the data first (translate_data) or give references")
    for number, chunk in enumerate(length_batches(batch_lengths(data, decoder_side), batch_size)):
        ids, mask = _pad([data.sources[i] for i in chunk], info.pad_id, device)
        src_valid = _not_special(ids, mask, info.special_ids)
        if info.is_seq2seq:
            assert decoder_side is not None  # set above for seq2seq
            targets = [decoder_side[i] for i in chunk]
            start_id = info.decoder_start_id if info.decoder_start_id is not None else info.pad_id
            width = max(1, max(len(t) for t in targets))
            dec_ids, dec_mask = _pad([[start_id] + t[:-1] if t else [start_id] for t in targets], info.pad_id, device, width)
            dec_mask[:, 0] = 1  # the start token is real even when it shares the pad id
            labels, label_mask = _pad(targets, info.pad_id, device, width)
            steps = label_mask.bool()
            labels = labels.masked_fill(~steps, -100)
            dec_valid = _not_special(dec_ids, dec_mask, info.special_ids)
            inputs = {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": dec_ids, "decoder_attention_mask": dec_mask}
            valid = {
                "enc_self": (src_valid, src_valid),
                "dec_self": (dec_mask.bool(), dec_valid),
                "dec_cross": (dec_mask.bool(), src_valid),
            }
        elif info.arch == "classifier":
            # One prediction per text: logits [batch, 1, classes] (forward_logits), label [batch, 1].
            inputs = {"input_ids": ids, "attention_mask": mask}
            if data.segments is not None:
                inputs["token_type_ids"], _ = _pad([data.segments[i] for i in chunk], 0, device, ids.shape[1])
            steps = torch.ones(len(chunk), 1, dtype=torch.bool, device=device)
            gold = [data.classes[i] if data.classes is not None else -100 for i in chunk]
            labels = torch.tensor(gold, dtype=torch.long, device=device)[:, None]
            valid = {"enc_self": (src_valid, src_valid), "dec_self": (src_valid, src_valid)}
        else:
            inputs = {"input_ids": ids, "attention_mask": mask}
            if info.arch == "causal":
                steps = mask.bool()
                labels = torch.full_like(ids, -100)
                labels[:, :-1] = ids[:, 1:].masked_fill(~mask[:, 1:].bool(), -100)
                valid = {"dec_self": (src_valid, src_valid)}
            else:
                steps = src_valid
                labels = ids.masked_fill(~src_valid, -100)
                if mask_tokens and info.mask_id is not None:
                    chosen = _mask_positions(ids, src_valid, seed + number * batch_size)
                    labels = ids.masked_fill(~chosen, -100)
                    inputs["input_ids"] = ids.masked_fill(chosen, info.mask_id)
                valid = {"enc_self": (src_valid, src_valid)}
        yield Batch(inputs, steps, labels, valid, chunk)


def count_batches(data: ImportanceData, batch_size: int) -> int:
    return (len(data) + batch_size - 1) // batch_size

