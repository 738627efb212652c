"""An alignment oracle for the tokenizer zoo, written without headlab's alignment code (no tests in here).

:func:`random_sentence` draws CoNLL-U-like word lists (Unicode that normalisers change, words that
normalise to nothing, internal spaces, ``SpaceAfter=No`` runs). :func:`check_sentence` aligns one
with :func:`headlab.data.alignment.align_sentences` and compares it with :func:`reference_alignment`:
a per-token walk over the character offsets whose result is then verified on the tokens' own content
(each word's decoded tokens must spell the word as normalised), so a tokenizer's misleading offsets
show up too. headlab must give the reference's alignment, or refuse the sentence (AlignmentError).
"""

from __future__ import annotations

import random
import re
import unicodedata
from dataclasses import dataclass, field

import torch

from headlab.data.alignment import POOLINGS, Alignment, AlignmentError, align_sentences, build_side_batch, word_attention
from support.tokenizers_zoo import normalized, token_bytes, zoo_tokenizer

# Pieces of words, by what they do to a tokenizer pipeline.
PLAIN = ["the", "dog", "Cats", "sleep", "quickly", "HELLO", "e-mail", "U.S.A.", "x=y+z", "#tag", "@user"]
ACCENTED = ["Café", "naïve", "résumé", "über", "Straße", "Ärger", "Œuvre", "façade", "ß", "ẞ"]
LENGTH_CHANGING = ["ﬁne", "ﬂ", "Ａpple", "ＡＢＣ", "İstanbul", "İ", "ǅ", "½", "ﬃx", "㎏", "Ⅻ", "ı"]
COMBINING = ["e\u0301", "a\u0308b", "n\u0303o", "\u0301", "\u0301\u0302", "o\u0308\u0301"]
INVISIBLE = ["\u200d", "\u200b", "\u200c", "\ufeff", "\u00ad", "\u2060"]  # zero-width, BOM, soft hyphen
EMOJI = ["😀", "👨\u200d👩\u200d👧", "👍🏽", "🇫🇷", "❤\ufe0f"]
SCRIPTS = ["我们喜欢学习", "中文", "ภาษาไทยง่าย", "ไทย", "Ο", "σκύλος", "ΣΑΣ", "Собака", "한국어", "عربي"]
DIGITS = ["1", "12", "12345", "3.50", "2026-11-30", "400 000", "１２３", "٣"]
PUNCTUATION = [".", ",", "!", "?", "'", "\"", "(", ")", "...", "--", "“", "”", "«", "»", "n't", "'s", "'ll", "-"]
# CoNLL-U 2 allows spaces in FORM ("400 000" in French treebanks, often with a no-break space)
INTERNAL_SPACE = ["400 000", "New York", "a  b", "de la", "400\u00a0000", "a\u2009b", "中\u3000文"]
HANGUL_JAMO = ["\u1100\u1161", "\u1161", "\u11a8", "한"]  # a leading vowel or final composes with what precedes
MARKERS = ["▁", "▁▁", "##", "Ġ", "<0x41>", "<s>", "</s>", "[SEP]", "<unk>", "<|endoftext|>"]  # a tokenizer's own syntax
KINDS = [PLAIN, ACCENTED, LENGTH_CHANGING, COMBINING, INVISIBLE, EMOJI, SCRIPTS, DIGITS, PUNCTUATION,
         INTERNAL_SPACE, HANGUL_JAMO, MARKERS]


def random_word(rng: random.Random) -> str:
    """One word: one to three pieces of random kinds, glued."""
    return "".join(rng.choice(rng.choice(KINDS)) for _ in range(rng.choice((1, 1, 1, 2, 3))))


def random_sentence(rng: random.Random, max_words: int = 12) -> tuple[list[str], list[bool] | None]:
    """Words and their SpaceAfter flags (None: "words" spacing, one space between words)."""
    words = [random_word(rng) for _ in range(rng.randint(1, max_words))]
    if rng.random() < 0.3:
        return words, None
    return words, [rng.random() < 0.6 for _ in words]


def joined(words, space_after) -> tuple[str, list[tuple[int, int]]]:
    """The sentence's text and word spans, as the treebank spaces it (written here, not headlab's)."""
    text, spans = "", []
    for i, word in enumerate(words):
        spans.append((len(text), len(text) + len(word)))
        text += word
        if i + 1 < len(words) and (space_after is None or space_after[i]):
            text += " "
    return text, spans


METASPACE = ("llama2", "mistral-metaspace", "t5", "xlmr", "lossy-nfkd")


def _spelling(name: str, text: str) -> str:
    """``text`` without white space and, for SentencePiece-style pipelines, "▁" (the mark of a
    space there, indistinguishable from a literal one): what a word's tokens must spell."""
    return "".join(c for c in text if not c.isspace() and not (c == "▁" and name in METASPACE))


def expected_spelling(name: str, word: str) -> str:
    """The word as its tokens spell it: normalised, except the texts of added tokens ("[SEP]",
    "</s>"), which the tokenizer matches in the raw text before normalising the rest."""
    tokenizer = zoo_tokenizer(name)
    added = sorted(tokenizer.get_added_vocab(), key=len, reverse=True)
    parts = re.split("(" + "|".join(map(re.escape, added)) + ")", word) if added else [word]
    return _spelling(name, "".join(part if part in added else normalized(tokenizer, part) for part in parts))


@dataclass
class Reference:
    """The oracle's alignment of one sentence: ``owner[t]`` per token (-1 special) or why none exists."""

    ids: list[int]
    owner: list[int] = field(default_factory=list)
    special: list[bool] = field(default_factory=list)
    refusal: str | None = None  # the sentence cannot be aligned: why
    unverified: set[int] = field(default_factory=set)  # words with an unknown token (content unchecked)


def reference_alignment(name: str, words, space_after) -> Reference:
    """Owner of every token from its offsets, one token at a time; then each word's tokens decoded
    and compared with the word as the pipeline normalises it."""
    tokenizer = zoo_tokenizer(name)
    text, spans = joined(words, space_after)
    encoded = tokenizer(text, return_offsets_mapping=True, return_special_tokens_mask=True)
    ids = list(encoded["input_ids"])
    pieces = tokenizer.convert_ids_to_tokens(ids)
    ref = Reference(ids, special=[bool(s) for s in encoded["special_tokens_mask"]])
    word_at = {c: w for w, (a, b) in enumerate(spans) for c in range(a, b)}
    raw: list[int | None] = []  # owner from offsets; None: the token covers no word's character
    for t, (start, end) in enumerate(encoded["offset_mapping"]):
        if ref.special[t]:
            raw.append(-1)
            continue
        owners = sorted({word_at[c] for c in range(start, end) if c in word_at})
        if len(owners) > 1:
            ref.refusal = f"token {t} {pieces[t]!r} covers words {owners}"
            return ref
        raw.append(owners[0] if owners else None)
    # A token that covers no word's character must be a boundary mark alone: it opens the next word.
    for t, owner in enumerate(raw):
        if owner is None:
            content = token_bytes(name, pieces[t])
            if content is None or _spelling(name, content.decode("utf-8", "replace")):
                ref.refusal = f"token {t} {pieces[t]!r} has content but covers no word"
                return ref
            later = [o for o in raw[t + 1:] if o is not None and o >= 0]
            earlier = [o for o in raw[:t] if o is not None and o >= 0]
            raw[t] = later[0] if later else (earlier[-1] if earlier else -1)
    ref.owner = [int(o) for o in raw]  # type: ignore[arg-type]
    content_of: dict[int, bytes] = {w: b"" for w in range(len(words))}
    for t, owner in enumerate(ref.owner):
        if owner >= 0:
            content = token_bytes(name, pieces[t])
            if content is None:
                ref.unverified.add(owner)
            else:
                content_of[owner] += content
    for w, word in enumerate(words):
        if w not in ref.owner:
            # a word that normalises to nothing has no token: the sentence cannot be aligned
            ref.refusal = f"word {w} {word!r} has no token"
            return ref
        if w in ref.unverified:
            continue
        spelled = content_of[w].decode("utf-8", "replace")
        expected = expected_spelling(name, word)
        if _spelling(name, spelled) != expected:
            ref.refusal = f"word {w} {word!r}: its tokens spell {spelled!r}, the word normalises to {expected!r}"
            return ref
    return ref


class Failure(AssertionError):
    """headlab's alignment differs from the oracle's (a wrong alignment, not a refusal)."""


@dataclass
class Sentence:
    """What build_side_batch reads from a treebank sentence."""

    words: tuple[str, ...]
    heads: list[int]
    deprels: tuple[str, ...]
    upos: tuple[str, ...]
    sent_id: str = "fuzz"
    where: str = "fuzz"


def _direct_word_attention(probs: torch.Tensor, owner: list[int], n_words: int, pooling: str) -> torch.Tensor:
    """[H, W, W] word attention by loops over the oracle's owners (Clark et al. 2019, Sec. 4.1 for sum)."""
    H = probs.shape[0]
    tokens = [[t for t, o in enumerate(owner) if o == w] for w in range(n_words)]
    out = torch.zeros(H, n_words, n_words, dtype=probs.dtype)
    for i in range(n_words):
        for j in range(n_words):
            if pooling == "sum":
                out[:, i, j] = probs[:, tokens[i]][:, :, tokens[j]].sum(2).mean(1)
            elif pooling == "first":
                out[:, i, j] = probs[:, tokens[i][0], tokens[j][0]]
            else:
                out[:, i, j] = probs[:, tokens[i]][:, :, tokens[j]].amax((1, 2))
    return out


def check_sentence(name: str, words, space_after, max_length: int | None, rng: random.Random) -> str:
    """Align one sentence with headlab and with the oracle; raise :class:`Failure` on a wrong
    alignment. Returns the outcome: "aligned", "truncated", "refused" (both refuse),
    "over-refused" (headlab refuses what the oracle aligns)."""
    tokenizer = zoo_tokenizer(name)
    ref = reference_alignment(name, words, space_after)
    got = align_sentences(tokenizer, [list(words)], space_after=None if space_after is None else [space_after],
                          max_length=max_length)[0]
    if isinstance(got, AlignmentError):
        if ref.refusal is not None:
            return "refused"
        if max_length is not None and _first_word_too_long(ref, max_length):
            return "refused"  # "no word fits in the model's maximum length"
        if ref.unverified:
            return "refused"  # an unknown token's content is unknown: the oracle cannot vouch for the sentence
        return "over-refused"
    assert isinstance(got, Alignment)
    if ref.refusal is not None:
        raise Failure(f"headlab aligned a sentence the oracle refuses ({ref.refusal})")
    owners = got.word_of_token.tolist()
    if not got.truncated:
        if list(got.input_ids) != ref.ids or owners != ref.owner or got.n_words != len(words):
            raise Failure(f"owners {owners} != oracle {ref.owner}")
    else:
        _check_truncation(tokenizer, words, space_after, max_length, got, ref)
    _check_word_attention(got, words, rng)
    return "truncated" if got.truncated else "aligned"


def _first_word_too_long(ref: Reference, max_length: int) -> bool:
    """Whether the special tokens and the first word's tokens exceed ``max_length``."""
    last = max(t for t, o in enumerate(ref.owner) if o == 0)
    content_before = sum(1 for t in range(last + 1) if not ref.special[t])
    return content_before + sum(ref.special) > max_length


def _check_truncation(tokenizer, words, space_after, max_length, got: Alignment, ref: Reference) -> None:
    """The tokenizer's own truncation keeps the same ids; whole words are kept, the rest counted lost."""
    text, _ = joined(words, space_after)
    cut = tokenizer(text, truncation=True, max_length=max_length)["input_ids"]
    if list(got.input_ids) != list(cut):
        raise Failure(f"truncated ids {list(got.input_ids)} != the tokenizer's {list(cut)}")
    content = [t for t, s in enumerate(ref.special) if not s]
    budget = len(cut) - (len(ref.ids) - len(content))
    kept_tokens = set(content[:budget])
    whole = 0  # leading words all of whose tokens are kept
    while whole < len(words) and all(t in kept_tokens for t, o in enumerate(ref.owner) if o == whole):
        whole += 1
    if got.n_words != whole:
        raise Failure(f"truncation keeps {got.n_words} words, {whole} are whole")
    expected = [o if o < whole else -1 for t, o in enumerate(ref.owner) if ref.special[t] or t in kept_tokens]
    if got.word_of_token.tolist() != expected:
        raise Failure(f"truncated owners {got.word_of_token.tolist()} != {expected}")


def _check_word_attention(got: Alignment, words, rng: random.Random) -> None:
    """word_attention of a random attention matrix equals the loops over the alignment, every pooling."""
    owner = got.word_of_token.tolist()
    T, W = len(owner), got.n_words
    generator = torch.Generator().manual_seed(rng.randrange(2**31))
    probs = torch.rand(1, 2, T, T, generator=generator, dtype=torch.float64).softmax(-1)
    sentence = Sentence(tuple(words), [-1] * len(words), ("dep",) * len(words), ("X",) * len(words))
    for pooling in POOLINGS:
        side = build_side_batch([(sentence, got, 0)], pad_id=0, pooling=pooling)
        fast = word_attention(probs, side)[0].double()
        direct = _direct_word_attention(probs[0], owner, W, pooling)
        if not torch.allclose(fast, direct, atol=1e-6):
            raise Failure(f"word_attention ({pooling}) differs from the direct computation by "
                          f"{(fast - direct).abs().max().item():.3g}")


def describe(words, space_after) -> str:
    """A replayable description of a sentence (Python literals)."""
    return f"words={list(words)!r} space_after={space_after!r} nfc={[unicodedata.is_normalized('NFC', w) for w in words]}"
