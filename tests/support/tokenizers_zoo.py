"""Tiny offline copies of the tokenizer pipelines real models use (no tests in here).

Each pipeline is built with ``tokenizers`` the way the original's ``tokenizer.json`` builds it
(normalizer, pre-tokenizer, model, post-processor, decoder), trained on :data:`CORPUS`, and
wrapped in transformers' ``PreTrainedTokenizerFast`` with the original's special tokens. The
vocabularies are small on purpose: words split into several subwords, and characters the
corpus lacks reach the unknown token or (``byte_fallback``) ``<0xNN>`` byte tokens.

:func:`token_bytes` turns one token back into the bytes of the normalised text it stands for,
the decoding each pipeline's own decoder does, so that a test can check a token's content
independently of its character offsets.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

# Latin, accents, digits, punctuation, some Greek, Cyrillic, CJK and Thai; no emoji, no ligatures:
# those reach the unknown token or the byte fallback.
CORPUS = [
    "The old dog quickly chased a red ball. Cats don't sleep here, they're awake!",
    "Birds sing and fish swim; 12345 apples cost 3.50 dollars (or 400 000 cents).",
    "Café naïve résumé über Straße İstanbul Ärger Œuvre façade coöperate.",
    "Ο σκύλος τρέχει. Собака бежит быстро. 我们喜欢学习中文。 ภาษาไทยง่าย",
    "I'll we've she'd it's HELLO World e-mail U.S.A. 2026-11-30 x=y+z #tag @user",
]

SPECIALS = {
    "bert": ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
    "gpt2": ["<|endoftext|>"],
    "roberta": ["<s>", "<pad>", "</s>", "<unk>"],
    "llama3": ["<|begin_of_text|>", "<|end_of_text|>"],
    "sentencepiece": ["<unk>", "<s>", "</s>", "<pad>"],
    "t5": ["<pad>", "</s>", "<unk>"],
}

# Llama-3's pre-tokenizer regex (tokenizer.json of meta-llama/Meta-Llama-3-8B): contractions,
# letters with one leading non-letter, digits in groups of 1-3, punctuation runs, spaces.
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")

BYTE_TOKEN = re.compile(r"^<0x([0-9A-F]{2})>$")


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte-to-character table, inverted (the characters ByteLevel writes for each byte)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    characters = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            characters.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, characters)}


BYTE_OF_CHARACTER = _bytes_to_unicode()


def _wrap(tok: Tokenizer, **specials) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tok, **specials)


def _bert(cased: bool) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]", continuing_subword_prefix="##"))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                                strip_accents=not cased, lowercase=not cased)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=150, special_tokens=SPECIALS["bert"],
                                                              show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                       special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return _wrap(tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
                 mask_token="[MASK]")


def _byte_level_bpe(specials: list[str], pre_tokenizer) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def _gpt2() -> PreTrainedTokenizerFast:
    tok = _byte_level_bpe(SPECIALS["gpt2"], pre_tokenizers.ByteLevel(add_prefix_space=False))
    tok.post_processor = processors.ByteLevel(trim_offsets=False)  # GPT-2's tokenizer.json
    return _wrap(tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>", unk_token="<|endoftext|>",
                 pad_token="<|endoftext|>")


def _roberta() -> PreTrainedTokenizerFast:
    tok = _byte_level_bpe(SPECIALS["roberta"], pre_tokenizers.ByteLevel(add_prefix_space=True))
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0), trim_offsets=True,
                                                      add_prefix_space=True)
    return _wrap(tok, bos_token="<s>", eos_token="</s>", sep_token="</s>", cls_token="<s>", pad_token="<pad>",
                 unk_token="<unk>")


def _llama3() -> PreTrainedTokenizerFast:
    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok = _byte_level_bpe(SPECIALS["llama3"], pre)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)]),
    ])
    return _wrap(tok, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>", pad_token="<|end_of_text|>")


def _with_byte_fallback(tok: Tokenizer) -> Tokenizer:
    """The trained BPE again with ``<0x00>`` .. ``<0xFF>`` in its vocabulary and ``byte_fallback``
    (SentencePiece's ``byte_fallback=True``: a character out of the vocabulary becomes its UTF-8 bytes)."""
    data = tok.to_str()
    import json

    spec = json.loads(data)
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    spec["model"]["fuse_unk"] = True
    return Tokenizer.from_str(json.dumps(spec))


def _sentencepiece_bpe(style: str) -> PreTrainedTokenizerFast:
    """Llama-2 / Mistral (``style="llama2"``: normalizer Prepend("▁") + Replace(" ", "▁"), no
    pre-tokenizer) or the Metaspace form of the same (``"metaspace"``), BPE with byte fallback, BOS."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    if style == "llama2":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(replacement="▁",
                                                                                      prepend_scheme="first")])
    # a limited alphabet: rarer characters are left to the byte fallback
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=200, special_tokens=SPECIALS["sentencepiece"],
                                                        limit_alphabet=60, show_progress=False))
    tok = _with_byte_fallback(tok)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return _wrap(tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>")


def _unigram(style: str) -> PreTrainedTokenizerFast:
    """T5 (``"t5"``: NFKC and runs of spaces made one, ``$A </s>``) or XLM-R (``"xlmr"``: NFKC,
    ``<s> $A </s>``), a Unigram model with Metaspace."""
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(Regex(" {2,}"), " ")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    specials = SPECIALS["t5"] if style == "t5" else SPECIALS["roberta"]
    unk = "<unk>"
    tok.train_from_iterator(CORPUS, trainers.UnigramTrainer(vocab_size=180, special_tokens=specials, unk_token=unk,
                                                            show_progress=False))
    if style == "t5":
        tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
        return _wrap(tok, eos_token="</s>", unk_token=unk, pad_token="<pad>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 0),
                                                                                               ("</s>", 2)])
    return _wrap(tok, bos_token="<s>", eos_token="</s>", unk_token=unk, pad_token="<pad>")


def _lossy() -> PreTrainedTokenizerFast:
    """A normalizer that changes the text's length: Strip, NFKD, accents stripped, lowercase
    ("ﬁ" -> "fi", "Ａ" -> "a", "İ" -> "i̇" -> "i", "ß" stays), Metaspace BPE, EOS."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Strip(), normalizers.NFKD(), normalizers.StripAccents(),
                                           normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=150, special_tokens=SPECIALS["t5"],
                                                        show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return _wrap(tok, eos_token="</s>", unk_token="<unk>", pad_token="<pad>")


BUILDERS = {
    "bert-uncased": lambda: _bert(cased=False),
    "bert-cased": lambda: _bert(cased=True),
    "gpt2": _gpt2,
    "roberta": _roberta,
    "llama3": _llama3,
    "llama2": lambda: _sentencepiece_bpe("llama2"),
    "mistral-metaspace": lambda: _sentencepiece_bpe("metaspace"),
    "t5": lambda: _unigram("t5"),
    "xlmr": lambda: _unigram("xlmr"),
    "lossy-nfkd": _lossy,
}
PIPELINES = tuple(BUILDERS)


# The trained pipelines, frozen: tokenizers' trainers break ties between equally frequent pairs in
# hash-map order, which differs between processes, so a retrained vocabulary (and a fuzz
# campaign's counts) would too. `python tests/support/tokenizers_zoo.py` writes them again.
FROZEN = Path(__file__).with_name("tokenizers_zoo_frozen")


@lru_cache(maxsize=None)
def zoo_tokenizer(name: str) -> PreTrainedTokenizerFast:
    """The pipeline ``name`` (one of :data:`PIPELINES`): its frozen tokenizer.json with the special
    tokens of its builder, once per process."""
    built = BUILDERS[name]()
    path = FROZEN / f"{name}.json"
    if not path.exists():
        return built
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(path)), **built.special_tokens_map)


def freeze() -> None:
    FROZEN.mkdir(exist_ok=True)
    for name, build in BUILDERS.items():
        build().backend_tokenizer.save(str(FROZEN / f"{name}.json"))


def normalized(tokenizer: PreTrainedTokenizerFast, text: str) -> str:
    """``text`` through the pipeline's normalizer (itself where there is none)."""
    normalizer = tokenizer.backend_tokenizer.normalizer
    return text if normalizer is None else normalizer.normalize_str(text)


def token_bytes(name: str, piece: str) -> bytes | None:
    """The UTF-8 bytes of the normalised text that token string ``piece`` of pipeline ``name``
    stands for, word-boundary markers ("▁", "##", a ByteLevel space) left in; None for an unknown token."""
    if piece in ("[UNK]", "<unk>"):
        return None
    if name in ("gpt2", "roberta", "llama3"):
        return bytes(BYTE_OF_CHARACTER[c] for c in piece)
    match = BYTE_TOKEN.match(piece)
    if match and name in ("llama2", "mistral-metaspace"):
        return bytes([int(match.group(1), 16)])
    if name.startswith("bert") and piece.startswith("##"):
        piece = piece[2:]
    return piece.encode("utf-8")


if __name__ == "__main__":
    freeze()
