"""Words to subwords, for any fast tokenizer, and attention between words.

A sentence's words are joined into a text (by single spaces, or with the treebank's own
spacing) and tokenized with character offsets. Every subword belongs to the word whose
characters it covers; a token made only of a word-boundary marker (SentencePiece's lone "▁")
belongs to the word it opens. Special tokens (EOS, BOS, CLS, SEP) belong to no word. A sentence
that cannot be aligned exactly is an :class:`AlignmentError` (the caller skips and counts it): a
subword over two words, a word with no subword, a combining mark glued to the word before it under
a normalizer that would merge them, a subword whose offsets miss its own text.

Attention between words follows Clark et al. 2019 (Sec. 4.1, "What Does BERT Look At?"):
attention *to* a word is the sum of the attention to its subwords, attention *from* a word is
the mean of the attention from its subwords. Attention to special tokens and to padding is
dropped, so a word's row sums to the share of its attention that reaches words (< 1 when EOS
takes some). Two other mappings (``pooling``, ``headlab functions --word-pooling``) test how
much a result depends on that choice: ``first``, a word is its first subword, as query and as
key (attention to its other subwords is dropped); ``max``, the largest weight from any of its
subwords to any of the key word's subwords.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass, replace
from functools import cached_property
from itertools import accumulate, chain
from operator import add
from typing import Callable, Sequence

import numpy as np
import torch

from headlab.attention import KEY_BLOCK
from headlab.errors import HeadlabError

__all__ = [
    "Alignment",
    "AlignmentError",
    "AttentionView",
    "POOLINGS",
    "WordRows",
    "SideBatch",
    "align_sentences",
    "join_words",
    "word_attention",
    "word_keys",
]

POOLINGS = ("sum", "first", "max")
"""Subword-to-word mappings: ``sum`` (to a word: sum over its subwords; from a word: their mean),
``first`` (a word is its first subword), ``max`` (the largest weight over the subwords)."""


class AlignmentError(HeadlabError):
    """A sentence whose subwords cannot be mapped onto its words."""


@dataclass(frozen=True)
class Alignment:
    """One tokenized sentence.

    ``input_ids`` is the model input (special tokens included). ``word_of_token[t]`` is the
    word of token ``t``, or -1 for special tokens and for the tokens of words cut off by
    truncation. Words ``0 .. n_words-1`` are kept; with ``truncated`` the rest did not fit.
    """

    input_ids: tuple[int, ...]
    word_of_token: np.ndarray
    n_words: int
    truncated: bool

    def __len__(self) -> int:
        return len(self.input_ids)


# From this many words on, join_words and _align_one use whole-array operations instead of a loop
# per word: the same result, less time on long sentences (~7 ms at 16k words), more on short ones
# (~10 us at 20 words, the loops' fixed cost being lower).
_MANY_WORDS = 64


def join_words(words: Sequence[str], space_after: Sequence[bool] | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The text of ``words`` and each word's character span ``[start, end)``.

    Without ``space_after`` words are separated by one space ("words" spacing); with it a
    space follows word ``i`` only when ``space_after[i]`` (CoNLL-U ``SpaceAfter=No``).
    """
    n = len(words)
    if n < _MANY_WORDS:
        parts: list[str] = []
        spans: list[tuple[int, int]] = []
        position = 0
        for index, word in enumerate(words):
            spans.append((position, position + len(word)))
            parts.append(word)
            position += len(word)
            if index + 1 < n and (space_after is None or space_after[index]):
                parts.append(" ")
                position += 1
        return "".join(parts), spans
    # the same in whole-list operations (the loop was ~4 ms at 16k words)
    gaps = [1] * (n - 1) if space_after is None else [1 if space_after[i] else 0 for i in range(n - 1)]
    gaps.append(0)
    if space_after is None:
        text = " ".join(words)
    else:
        text = "".join([word + " " if gap else word for word, gap in zip(words, gaps)])
    lengths = list(map(len, words))
    starts = list(accumulate(map(add, lengths, gaps), initial=0))
    return text, list(zip(starts, map(add, starts, lengths)))


def _align_one(
    words: Sequence[str],
    spans: list[tuple[int, int]],
    text: str,
    input_ids: list[int],
    offsets: list[tuple[int, int]],
    special: list[int],
    token_text: Callable[[int], str],
    max_length: int | None,
    carries_text: Callable[[int], bool] | None = None,
) -> Alignment:
    char_word = np.full(len(text) + 1, -1, dtype=np.int64)
    if len(spans) < _MANY_WORDS:
        for index, (start, end) in enumerate(spans):
            char_word[start:end] = index
    else:  # the same without a loop per word (join_words's spans: in order, apart)
        word_bounds = np.fromiter(chain.from_iterable(spans), dtype=np.int64, count=2 * len(spans)).reshape(-1, 2)
        word_lengths = word_bounds[:, 1] - word_bounds[:, 0]
        before = np.cumsum(word_lengths) - word_lengths  # characters of the words before each word
        characters = np.arange(int(word_lengths.sum()), dtype=np.int64) + np.repeat(word_bounds[:, 0] - before,
                                                                                    word_lengths)
        char_word[characters] = np.repeat(np.arange(len(spans), dtype=np.int64), word_lengths)
    n_tokens = len(input_ids)
    # Whole-array form of a per-token walk (a Python loop was ~50 ms at 16k tokens): a token's
    # owners are the words of its characters; its first and last owned characters come from
    # running minima / maxima of the owned positions.
    n_chars = len(char_word)
    position = np.arange(n_chars, dtype=np.int64)
    owned = char_word >= 0
    next_owned = np.minimum.accumulate(np.where(owned, position, n_chars)[::-1])[::-1]
    previous_owned = np.maximum.accumulate(np.where(owned, position, -1))
    bounds = np.fromiter(chain.from_iterable(offsets), dtype=np.int64, count=2 * n_tokens).reshape(n_tokens, 2)
    bounds = bounds.clip(0, n_chars)
    starts, ends = bounds[:, 0], bounds[:, 1]
    is_special = np.asarray(special, dtype=bool).reshape(n_tokens)
    first_char = next_owned[np.minimum(starts, n_chars - 1)]
    has_owner = ~is_special & (starts < ends) & (first_char < ends)
    first = np.where(has_owner, char_word[np.minimum(first_char, n_chars - 1)], -1)
    last = np.where(has_owner, char_word[previous_owned[np.maximum(ends - 1, 0)]], -1)
    spanning = np.nonzero(first != last)[0]
    if spanning.size:
        t = int(spanning[0])
        raise AlignmentError(
            f"subword {token_text(t)!r} spans the words {words[int(first[t])]!r} and {words[int(last[t])]!r}"
        )
    word_of_token = first
    # A boundary-only token (no owned character) belongs to the word the next owned token opens;
    # those after the last owned token, to the word before them.
    pending = ~is_special & ~has_owner
    if pending.any() and carries_text is not None:
        _refuse_misplaced_text(np.nonzero(pending)[0], input_ids, bounds, carries_text, token_text)
    if pending.any():
        token_position = np.arange(n_tokens, dtype=np.int64)
        next_token = np.minimum.accumulate(np.where(has_owner, token_position, n_tokens)[::-1])[::-1]
        owners = np.nonzero(has_owner)[0]
        trailing = int(word_of_token[owners[-1]]) if owners.size else -1
        filled = np.where(next_token < n_tokens, word_of_token[np.minimum(next_token, n_tokens - 1)], trailing)
        word_of_token = np.where(pending, filled, word_of_token)
    n_words = len(words)
    has_token = np.zeros(n_words, dtype=bool)
    has_token[word_of_token[word_of_token >= 0]] = True
    missing = np.nonzero(~has_token)[0]
    if missing.size:
        i = int(missing[0])
        raise AlignmentError(f"word {i + 1} {words[i]!r} gets no subword from the tokenizer")
    kept = n_words
    truncated = max_length is not None and n_tokens > max_length
    if truncated:
        # Cut like the tokenizer does for one sequence: keep the special tokens before and after
        # the content, and as much content as fits. A word that loses any subword is left out.
        content = [t for t in range(n_tokens) if not special[t]]
        head = [t for t in range(n_tokens) if special[t] and (not content or t < content[0])]
        tail = [t for t in range(n_tokens) if special[t] and content and t > content[-1]]
        assert max_length is not None  # truncated
        budget = max(max_length - len(head) - len(tail), 0)
        keep = content[:budget]
        # Words come in order: the word of the first token cut is the first word lost (whole
        # or in part). The tokens of a partly cut word stay in the input, as the tokenizer
        # leaves them, but belong to no word.
        lost = word_of_token[content[budget:]]
        lost = lost[lost >= 0]
        kept = int(lost.min()) if lost.size else n_words
        positions = head + keep + tail
        input_ids = [input_ids[t] for t in positions]
        word_of_token = np.array([w if 0 <= w < kept else -1 for w in word_of_token[positions].tolist()],
                                 dtype=np.int64)
    if kept == 0:
        raise AlignmentError("no word fits in the model's maximum length")
    return Alignment(tuple(input_ids), word_of_token, kept, truncated)


def _glued_across(words: Sequence[str], space_after: Sequence[bool], forms: tuple[str, ...]) -> int | None:
    """The first word (index) that the Unicode normalization ``forms`` would merge with the word
    before it, joined without a space (``SpaceAfter=No``); None when there is none.

    A word that begins with a combining mark ("\u0301") or a conjoining Hangul vowel, glued to the
    word before it, composes with that word's last character under NFC/NFKC ("e" + "\u0301" ->
    "é"), and canonical reordering can move marks across the boundary under any form. The
    tokenizer then gives the merged character the offsets of one original character only
    (tokenizers' alignment tracking), so the other word's part of it goes silently to the wrong
    word, or that word gets no token at all.
    """
    for index in range(1, len(words)):
        left, right = words[index - 1], words[index]
        # below U+0300 no character combines with the one before it (canonical class 0, NFC_QC Yes)
        if space_after[index - 1] or not left or not right or right[0] < "\u0300":
            continue
        if any(unicodedata.normalize(form, left + right)  # type: ignore[arg-type]
               != unicodedata.normalize(form, left) + unicodedata.normalize(form, right)  # type: ignore[arg-type]
               for form in forms):
            return index
    return None


def _unicode_forms(tokenizer) -> tuple[str, ...]:
    """The Unicode normalizations the tokenizer's normalizer applies, probed on "é" and "e" + "\u0301"
    (spelled alike by any of them): ("NFC", "NFKC") where it composes, ("NFD", "NFKD") where it
    decomposes (BERT's accent stripping does), none without one (then offsets are exact)."""
    normalizer = getattr(getattr(tokenizer, "backend_tokenizer", None), "normalizer", None)
    if normalizer is None:
        return ()
    composed = normalizer.normalize_str("\u00e9")
    if composed != normalizer.normalize_str("e\u0301"):
        return ()
    return ("NFC", "NFKC") if "\u00e9" in composed else ("NFD", "NFKD")


def _refuse_misplaced_text(tokens: np.ndarray, input_ids: list[int], bounds: np.ndarray,
                           carries_text: Callable[[int], bool], token_text: Callable[[int], str]) -> None:
    """Raise for a token (of ``tokens``, those that cover no word's character) that stands for text:
    its offsets are off (RoBERTa's ``trim_offsets`` after an added token typed in the text, "<s>f":
    "Ġf" at (4, 4)), so the rule for boundary marks ("▁", "Ġ": the word they open) would hand its
    text to another word. Checked per distinct id (a sentence's boundary tokens are a few ids)."""
    ids = np.asarray(input_ids, dtype=np.int64)[tokens]
    wrong = [token_id for token_id in np.unique(ids).tolist() if carries_text(token_id)]
    if wrong:
        t = int(tokens[np.isin(ids, wrong)][0])
        start, end = (int(x) for x in bounds[t])
        raise AlignmentError(f"subword {token_text(t)!r} stands for text but its offsets ({start}, {end}) "
                             "cover no word's character: the tokenizer's offsets are off")


def _text_carrier(tokenizer) -> Callable[[int], bool]:
    """Whether a token id, decoded alone, leaves any character besides white space and "▁" (once per id)."""
    known: dict[int, bool] = {}

    def carries_text(token_id: int) -> bool:
        if token_id not in known:
            text = tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            known[token_id] = any(not c.isspace() and c != "\u2581" for c in text)
        return known[token_id]

    return carries_text


def align_sentences(
    tokenizer,
    sentences: Sequence[Sequence[str]],
    *,
    space_after: Sequence[Sequence[bool]] | None = None,
    max_length: int | None = None,
) -> list[Alignment | AlignmentError]:
    """Tokenize a batch of word sequences and map subwords to words.

    Returns one :class:`Alignment` per sentence, or the :class:`AlignmentError` that says why
    it could not be aligned (the caller reports it and goes on). ``max_length`` truncates,
    keeping the tokenizer's special tokens.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise HeadlabError(
            f"{type(tokenizer).__name__} is not a fast tokenizer: word alignment needs character offsets"
        )
    texts, all_spans = [], []
    for index, words in enumerate(sentences):
        text, spans = join_words(words, None if space_after is None else space_after[index])
        texts.append(text)
        all_spans.append(spans)
    # Tokenized whole, then cut here: the cut must know which words it loses.
    encoded = tokenizer(
        texts,
        add_special_tokens=True,
        truncation=False,
        return_offsets_mapping=True,
        return_special_tokens_mask=True,
    )
    forms = _unicode_forms(tokenizer)
    carries_text = _text_carrier(tokenizer)
    results: list[Alignment | AlignmentError] = []
    for index, words in enumerate(sentences):
        glued = None if space_after is None or not forms else _glued_across(words, space_after[index], forms)
        if glued is not None:
            results.append(AlignmentError(
                f"word {glued + 1} {words[glued]!r} follows {words[glued - 1]!r} without a space and the "
                "tokenizer's Unicode normalization merges their characters: no subword boundary separates them"))
            continue
        ids = list(encoded["input_ids"][index])

        # A token's text is wanted only for an error: made then, not for every token (16k ids ~10 ms).
        def token_text(t: int, ids: list[int] = ids) -> str:
            return tokenizer.convert_ids_to_tokens([ids[t]])[0]

        try:
            results.append(
                _align_one(
                    words, all_spans[index], texts[index], ids,
                    encoded["offset_mapping"][index],
                    list(encoded["special_tokens_mask"][index]),
                    token_text,
                    max_length,
                    carries_text,
                )
            )
        except AlignmentError as error:
            results.append(error)
    return results


# -- batches of aligned sentences, as tensors ----------------------------------------------
@dataclass
class SideBatch:
    """One analysed sequence per example of a batch (the encoder side or the decoder side).

    Shapes: ``B`` sentences, ``T`` tokens (padded), ``W`` words (padded). Built on the CPU; the
    statistics of attention on a GPU take its copy there (:meth:`to`), whose derived tensors are
    made on that device.
    """

    token_word: torch.Tensor  # [B, T] long, -1 = special token, padding or cut word
    token_mask: torch.Tensor  # [B, T] bool, tokens that belong to a kept word
    n_words: torch.Tensor  # [B] long
    heads: torch.Tensor  # [B, W] long, governor index, -1 root / cut / padding
    deprels: list[tuple[str, ...]]  # per sentence, kept words only
    upos: list[tuple[str, ...]]
    words: list[tuple[str, ...]]
    token_ids: torch.Tensor  # [B, T] long (padding = pad id)
    sentence_index: list[int]  # position of each sentence in the corpus
    sent_ids: list[str]
    where: list[str]
    pooling: str = "sum"  # subword-to-word mapping, one of POOLINGS

    @property
    def batch_size(self) -> int:
        return self.token_word.shape[0]

    @property
    def max_words(self) -> int:
        return self._word_extremes()[1]

    @property
    def min_words(self) -> int:
        """The fewest words of a sentence of the batch (0 for no sentence)."""
        return self._word_extremes()[0]

    def _word_extremes(self) -> tuple[int, int]:
        # read on the CPU batch once: every chunk of every block asks (no wait for a device, no tiny
        # reduction per chunk)
        host = self.host
        extremes = host.__dict__.get("_extremes")
        if extremes is None:
            n_words = host.n_words
            extremes = (int(n_words.min()), int(n_words.max())) if n_words.numel() else (0, 0)
            host.__dict__["_extremes"] = extremes
        return extremes

    def words_real(self, start: int, stop: int) -> bool:
        """Whether words ``start:stop`` (cut at :attr:`max_words`) are real words of every sentence,
        ``word_mask[:, start:stop].all()`` decided on the CPU (no wait for a device)."""
        stop = min(stop, self.max_words)
        return start >= stop or self.min_words >= stop

    @property
    def device(self) -> torch.device:
        return self.token_word.device

    @property
    def host(self) -> "SideBatch":
        """The batch on the CPU that this one was copied from (itself when it is that batch)."""
        return self.__dict__.get("_host", self)

    def to(self, device: torch.device | str) -> "SideBatch":
        """This batch with its tensors on ``device``: itself when they are there, else its
        :meth:`copy_to` that device."""
        return self if self.device == torch.device(device) else self.copy_to(device)

    def copy_to(self, device: torch.device | str) -> "SideBatch":
        """A copy of the CPU batch (:attr:`host`) with its tensors on ``device``. Make it once per
        batch and device and give it to every block and chunk there: it caches the tensors derived
        from it. What a copy derives from Python lists or decides from its tensors' values (arcs,
        tags, rare-token masks, word spans, the longest sentence) is taken from the CPU batch, where
        reading a value does not wait for the device."""
        host = self.host
        copy = replace(host, token_word=host.token_word.to(device), token_mask=host.token_mask.to(device),
                       n_words=host.n_words.to(device), heads=host.heads.to(device),
                       token_ids=host.token_ids.to(device))
        copy.__dict__["_host"] = host
        return copy

    @cached_property
    def word_mask(self) -> torch.Tensor:  # [B, W] bool
        return torch.arange(self.max_words, device=self.device)[None, :] < self.n_words[:, None]

    @cached_property
    def word_index(self) -> torch.Tensor:
        """``[B, T]`` long: each token's word, or ``W`` (one past the last word) for none."""
        return torch.where(self.token_mask, self.token_word, torch.full_like(self.token_word, self.max_words))

    @cached_property
    def first_word_index(self) -> torch.Tensor:
        """``[B, T]`` long: like :attr:`word_index`, but only a word's first subword has it (the
        others, like tokens of no word, get ``W``)."""
        W = self.max_words
        positions = torch.arange(self.word_index.shape[1], device=self.device)[None, :].expand_as(self.word_index)
        first = torch.full((self.batch_size, W + 1), self.word_index.shape[1], dtype=torch.long, device=self.device)
        first.scatter_reduce_(1, self.word_index, positions, reduce="amin")
        is_first = (first.gather(1, self.word_index) == positions) & (self.word_index < W)
        return torch.where(is_first, self.word_index, torch.full_like(self.word_index, W))

    @cached_property
    def word_sizes(self) -> torch.Tensor:
        """``[B, W]`` float: subwords per word (1 for padding words, to divide safely)."""
        sizes = torch.zeros(self.batch_size, self.max_words + 1, device=self.device)
        sizes.scatter_add_(1, self.word_index, torch.ones(self.word_index.shape, device=self.device))
        return sizes[:, : self.max_words].clamp(min=1)

    @cached_property
    def upos_index(self) -> torch.Tensor:
        """``[B, W]`` long index into :data:`headlab.data.treebank.UPOS_TAGS` + ["_"], -1 padding."""
        if self.host is not self:
            return self.host.upos_index.to(self.device)
        from headlab.data.treebank import UPOS_TAGS

        table = {tag: i for i, tag in enumerate(UPOS_TAGS)}
        out = torch.full((self.batch_size, self.max_words), -1, dtype=torch.long)
        for b, tags in enumerate(self.upos):
            out[b, : len(tags)] = torch.tensor([table.get(tag, len(UPOS_TAGS)) for tag in tags], dtype=torch.long)
        return out


def build_side_batch(items: Sequence[tuple], pad_id: int, *, shift: int = 0, start_id: int | None = None,
                     pooling: str = "sum") -> SideBatch:
    """Tensors for a batch of ``(sentence, alignment, corpus index)``; ``pooling`` (one of
    :data:`POOLINGS`) is how its views turn subword attention into word attention.

    With ``shift=1`` the tokens move one place right behind ``start_id`` (teacher-forced
    decoder input): the last special token (EOS) is dropped and the start token belongs to no
    word.
    """
    rows: list[tuple[torch.Tensor, torch.Tensor]] = []
    for _sentence, alignment, _ in items:
        if shift:
            ids: list = list(alignment.input_ids)
            word: list = alignment.word_of_token.tolist()
            if ids and word[-1] < 0:
                ids, word = ids[:-1], word[:-1]
            ids, word = [start_id] + ids, [-1] + word
            rows.append((torch.tensor(ids, dtype=torch.long), torch.tensor(word, dtype=torch.long)))
        else:  # the array as it is, not through a list
            rows.append((torch.tensor(alignment.input_ids, dtype=torch.long),
                         torch.as_tensor(alignment.word_of_token, dtype=torch.long)))
    B = len(items)
    T = max(len(id_row) for id_row, _ in rows)
    token_ids = torch.full((B, T), pad_id, dtype=torch.long)
    token_word = torch.full((B, T), -1, dtype=torch.long)
    for b, (id_row, word_row) in enumerate(rows):
        token_ids[b, : len(id_row)] = id_row
        token_word[b, : len(word_row)] = word_row
    n_words = torch.tensor([alignment.n_words for _, alignment, _ in items], dtype=torch.long)
    W = int(n_words.max())
    heads = torch.full((B, W), -1, dtype=torch.long)
    for b, (sentence, alignment, _) in enumerate(items):
        n = alignment.n_words
        governors = torch.tensor(sentence.heads[:n], dtype=torch.long)
        governors[governors >= n] = -1  # governor cut by truncation: arc not analysed
        heads[b, :n] = governors
    return SideBatch(
        token_word=token_word,
        token_mask=token_word >= 0,
        n_words=n_words,
        heads=heads,
        deprels=[s.deprels[: a.n_words] for s, a, _ in items],
        upos=[s.upos[: a.n_words] for s, a, _ in items],
        words=[s.words[: a.n_words] for s, a, _ in items],
        token_ids=token_ids,
        sentence_index=[index for _, _, index in items],
        sent_ids=[s.sent_id for s, _, _ in items],
        where=[s.where for s, _, _ in items],
        pooling=pooling,
    )


def _segment_sum(x: torch.Tensor, dim: int, first: torch.Tensor, count: torch.Tensor,
                 initial: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` summed along ``dim`` (2 or 3) over runs of consecutive positions: output position ``s``
    of sentence ``b`` is ``x[first[b, s]] + x[first[b, s] + 1] + ...`` (``count[b, s]`` terms, 0 for
    none), added in that order, after ``initial`` (partial sums of the first segments, carried from
    an earlier chunk) where given. ``first`` and ``count`` are ``[B, S]`` long.

    The order of additions is a scatter-add's into zeros (``0 + x1 = x1`` exactly, then each next
    term), so the result is the same to the bit, at the cost of one gather per subword rank: a
    word's ``k``-th subwords are gathered together and added, which is cheaper than a scatter-add
    while words have few subwords. With one position per segment and the segments a contiguous
    range shared by the batch it is a view of ``x``, no copy.
    """
    B, S = first.shape
    size = x.shape[dim]
    shape = list(x.shape)
    shape[dim] = S
    if S == 0 or size == 0:
        out = x.new_zeros(shape)
        if initial is not None:
            out.narrow(dim, 0, initial.shape[dim]).copy_(initial)
        return out
    if initial is None and bool((count == 1).all()):
        start = int(first[0, 0])
        if bool((first == torch.arange(start, start + S, device=first.device)[None, :]).all()):
            return x.narrow(dim, start, S)

    def expand(index: torch.Tensor) -> torch.Tensor:
        view = [B, 1, 1, 1]
        view[dim] = S
        return index.view(view).expand(shape)

    out = x.gather(dim, expand(first.clamp(0, size - 1)))
    empty = count < 1
    if bool(empty.any()):
        out.masked_fill_(expand(empty), 0.0)
    if initial is not None:
        out.narrow(dim, 0, initial.shape[dim]).add_(initial)  # initial + first term (+ 0 where none)
    for k in range(1, int(count.max())):
        more = count > k  # segments with a (k+1)-th position add it, the others add 0
        out += x.gather(dim, expand((first + k).clamp(0, size - 1))).masked_fill_(expand(~more), 0.0)
    return out


def _word_spans(side: SideBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(first token [B, W], subwords [B, W])`` of every word (padding words: none), or None
    where some word's subwords are not consecutive tokens (then sums go through a scatter-add)."""
    if "_word_spans" not in side.__dict__ and side.host is not side:
        spans = _word_spans(side.host)  # decided on the CPU, moved
        side.__dict__["_word_spans"] = None if spans is None else tuple(x.to(side.device) for x in spans)
    if "_word_spans" not in side.__dict__:
        W, T = side.max_words, side.token_word.shape[1]
        device = side.device
        positions = torch.arange(T, device=device).expand_as(side.word_index)
        first = torch.full((side.batch_size, W + 1), T, dtype=torch.long, device=device)
        first.scatter_reduce_(1, side.word_index, positions, reduce="amin")
        last = torch.full((side.batch_size, W + 1), -1, dtype=torch.long, device=device)
        last.scatter_reduce_(1, side.word_index, positions, reduce="amax")
        sizes = torch.zeros(side.batch_size, W + 1, dtype=torch.long, device=device)
        sizes.scatter_add_(1, side.word_index, torch.ones_like(side.word_index))
        first, last, sizes = first[:, :W], last[:, :W], sizes[:, :W]
        consecutive = bool(((last - first + 1 == sizes) | (sizes == 0)).all())
        side.__dict__["_word_spans"] = (first, sizes) if consecutive else None
    return side.__dict__["_word_spans"]


def word_keys(side: SideBatch, keys: int) -> int:
    """How many leading key words attention over the first ``keys`` tokens reaches: every word
    with a token among them (at least one word where the sentence has any); ``W`` for every token.
    A word beyond them gets exactly 0 from such attention, and is left out of its word tensors."""
    W, T = side.max_words, side.token_word.shape[1]
    if keys >= T:
        return W
    index = side.host.word_index[:, :keys]  # on the CPU: no wait for a device
    reached = index[index < W]
    return max(int(reached.max()) + 1 if reached.numel() else 0, min(1, W))


def _row_sums(x: torch.Tensor, full: int) -> torch.Tensor:
    """``x.sum(-1)`` of rows ``x`` ``[..., C]`` that stand for rows of ``full`` columns, zero from ``C``
    on, to the bit of the whole rows' sums: summed over a zero-padded copy of a multiple of
    :data:`~headlab.attention.KEY_BLOCK` columns where ``C`` is not one (see there)."""
    C = x.shape[-1]
    if C == full or C % KEY_BLOCK == 0:
        return x.sum(-1)
    return torch.nn.functional.pad(x, (0, min(full, -(-C // KEY_BLOCK) * KEY_BLOCK) - C)).sum(-1)


def _token_to_words(probs: torch.Tensor, side: SideBatch) -> torch.Tensor:
    """``[B, H, rows, K]``: each query token's attention summed over each word's subwords, in token
    order (special tokens and padding drop out), for the first ``K =`` :func:`word_keys` words of
    the tokens ``probs`` holds (all ``W`` for all tokens; a word's subwords beyond them hold 0)."""
    spans = _word_spans(side)
    B, H, rows, T = probs.shape
    K = word_keys(side, T)
    if spans is None:
        out = probs.new_zeros(B, H, rows, K + 1)
        index = side.word_index[:, :T].clamp(max=K)  # no token of a word from K on is held
        out.scatter_add_(3, index[:, None, None, :].expand(B, H, rows, T), probs)
        return out[..., :-1]
    first, sizes = spans
    if K < side.max_words:
        first, sizes = first[:, :K], torch.minimum(sizes[:, :K], (T - first[:, :K]).clamp(min=0))
    return _segment_sum(probs, 3, first, sizes)


def _key_words(probs: torch.Tensor, side: SideBatch, summed: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, H, rows, K]``: each query token's attention to each of the first ``K =`` :func:`word_keys`
    words under ``side.pooling`` (``summed``: :func:`_token_to_words` of ``probs``, when already computed)."""
    if side.pooling == "sum":
        return _token_to_words(probs, side) if summed is None else summed
    B, H, rows, T = probs.shape
    K = word_keys(side, T)
    out = probs.new_zeros(B, H, rows, K + 1)  # the last column takes tokens of no word
    index = (side.first_word_index if side.pooling == "first" else side.word_index)[:, :T].clamp(max=K)
    if side.pooling == "first":
        out.scatter_add_(3, index[:, None, None, :].expand(B, H, rows, T), probs)
    else:  # max: weights are >= 0, so the zeros the maxima start from change nothing
        out.scatter_reduce_(3, index[:, None, None, :].expand(B, H, rows, T), probs, reduce="amax")
    return out[..., :-1]


def _pool_rows(out: torch.Tensor, rows_at: torch.Tensor, key_words: torch.Tensor, pooling: str) -> torch.Tensor:
    """Add (``sum``, ``first``) or take the maximum of (``max``) query rows ``key_words``
    ``[B, H, rows, K]`` into the rows ``rows_at`` ``[B, rows]`` of ``out`` (in place)."""
    B, H, rows, K = key_words.shape
    index = rows_at[:, None, :, None].expand(B, H, rows, K)
    if pooling == "max":
        return out.scatter_reduce_(2, index, key_words, reduce="amax")
    return out.scatter_add_(2, index, key_words)


def _query_index(side: SideBatch) -> torch.Tensor:
    """``[B, T]``: the word row each query token feeds (``W``: none)."""
    return side.first_word_index if side.pooling == "first" else side.word_index


def _words_from(to_words: torch.Tensor, side: SideBatch) -> torch.Tensor:
    spans = _word_spans(side)
    if side.pooling == "sum" and spans is not None:
        first, sizes = spans
        return _divide_by_sizes(_segment_sum(to_words, 2, first, sizes), sizes)  # sum over query subwords: the mean
    B, H, T, W = to_words.shape
    words = _pool_rows(to_words.new_zeros(B, H, W + 1, W), _query_index(side), to_words, side.pooling)[:, :, :W]
    if side.pooling == "sum":
        return words / side.word_sizes[:, None, :, None]  # summed over query subwords: the mean
    return words


def _divide_by_sizes(words: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """Word rows ``[B, H, n, W]`` divided by their words' subword counts ``[B, n]`` (a count of 0
    divides by 1); with every count 1 there is nothing to divide (``x / 1 == x``)."""
    if bool((sizes <= 1).all()):
        return words
    return words / sizes.clamp(min=1).to(words.dtype)[:, None, :, None]


def word_attention(probs: torch.Tensor, side: SideBatch) -> torch.Tensor:
    """Word-to-word attention ``[B, H, W, W]`` from token attention ``[B, H, T, T]``.

    Under the default pooling (``sum``) row ``i`` is the mean over word ``i``'s subwords, column
    ``j`` the sum over word ``j``'s subwords (Clark et al. 2019, Sec. 4.1); see :data:`POOLINGS`
    for the others. Special tokens and padding drop out. Sums over consecutive subwords (keys,
    then queries) or scatters, not matrix products: each token belongs to one word, so they cost
    O(T^2) per head rather than O(T^2 W).
    """
    return _words_from(_key_words(probs.float(), side), side)


MAX_BLOCK = 64
"""Columns per block of :func:`first_max`."""


def first_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x.max(-1)``: each row's largest value and its first position, the same values and
    positions (a NaN wins, as there). On the CPU ``max`` with positions compares column by column
    (about 1.1 ns a value here), while ``amax`` runs vectorised (0.15 to 0.35 ns): so the maxima of
    blocks of :data:`MAX_BLOCK` columns come from ``amax``, the first block holding the row's
    maximum from a ``max`` over them, and the position from a ``max`` over that block's columns
    (about half the time over long rows). The first block with the largest maximum holds the first
    column with the largest value; the columns after the last whole block are compared apart, and
    win only with a larger value (or a NaN where the blocks have none)."""
    C = x.shape[-1]
    n = C // MAX_BLOCK
    if x.device.type != "cpu" or n < 4 or x.numel() == 0:
        return x.max(-1)
    whole = x[..., :n * MAX_BLOCK]
    best, block = whole.unflatten(-1, (n, MAX_BLOCK)).amax(-1).max(-1)
    columns = block[..., None] * MAX_BLOCK + torch.arange(MAX_BLOCK, device=x.device)
    _, within = whole.gather(-1, columns).max(-1)
    where = block * MAX_BLOCK + within
    if n * MAX_BLOCK < C:
        tail_best, tail_where = x[..., n * MAX_BLOCK:].max(-1)
        later = (tail_best > best) | (tail_best.isnan() & ~best.isnan())
        best = torch.where(later, tail_best, best)
        where = torch.where(later, tail_where + n * MAX_BLOCK, where)
    return best, where


def kept_range(keep: torch.Tensor) -> tuple[int, int] | None:
    """``[a, e)`` where the columns ``keep`` ``[B, C]`` keeps are that one range in every row of the
    batch, else None (see :func:`_masked_max`)."""
    kept = keep.any(0)
    if bool(kept.any()) and bool((keep == kept[None]).all()):
        columns = torch.nonzero(kept)[:, 0]
        a, e = int(columns[0]), int(columns[-1]) + 1
        if e - a == columns.numel():
            return a, e
    return None


def key_range(side: SideBatch, level: str, width: int) -> tuple[int, int] | None:
    """:func:`kept_range` of the first ``width`` key columns of ``side``'s tokens that belong to a word
    (``level`` "token": ``token_mask``) or of its real words ("word": ``word_mask``). Decided once per
    batch and width on the CPU batch: every chunk of every block with those keys reuses it (on a GPU,
    without the waits for the device that deciding it from the device's tensors costs)."""
    host = side.host
    cache = host.__dict__.setdefault("_key_ranges", {})
    if (level, width) not in cache:
        mask = host.token_mask if level == "token" else host.word_mask
        cache[(level, width)] = kept_range(mask[:, :width])
    return cache[(level, width)]


_UNDECIDED = (-1, -1)


def _masked_max(x: torch.Tensor, keep: torch.Tensor,
                columns: tuple[int, int] | None = _UNDECIDED) -> tuple[torch.Tensor, torch.Tensor]:
    """``(max, index)`` over the last dimension of ``x`` ``[B, H, rows, C]`` (values >= 0) among
    the columns ``keep`` ``[B, C]``, the others counted as -1; the first maximum on ties, as
    ``argmax``. Without a copy where the kept columns are one range shared by the batch
    (``columns``: that range, or None for none, where the caller knows it: :func:`key_range`)."""
    C = x.shape[-1]
    if columns == _UNDECIDED:
        columns = kept_range(keep)
    if columns is not None:  # one range [a, e): the max over it, where nothing is -1
        a, e = columns
        if a == 0 and e == C:
            return first_max(x)
        best, index = first_max(x[..., a:e])
        return best, index + a
    return first_max(x.masked_fill(~keep[:, None, None, :], -1.0))


def reachable_keys(side: SideBatch, level: str, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(visible [B, n], at least two [B, n])`` for every word (``level`` "word", ``n = W``) or token
    ("token", ``n = T``) of ``side``: how many words (word tokens) its attention can reach, all of
    the sentence's or under a causal mask those up to itself, 0 for padding (and tokens of no
    word); and whether that is two or more. Made once per batch, device and mask: each view takes
    its rows' slice (:attr:`AttentionView.word_visible_keys`, :attr:`AttentionView.token_visible_keys`)."""
    cache = side.__dict__.setdefault("_visible_keys", {})
    if (level, causal) not in cache:
        if level == "word":
            W = side.max_words
            if causal:
                positions = torch.arange(W, device=side.device)
                visible = (positions[None, :] + 1).clamp(max=side.n_words[:, None]) * side.word_mask
            else:
                visible = side.n_words[:, None].expand(-1, W) * side.word_mask
        else:
            mask = side.token_mask.long()
            counts = mask.cumsum(1) if causal else mask.sum(1, keepdim=True).expand_as(mask)
            visible = counts * mask
        cache[(level, causal)] = (visible, visible >= 2)
    return cache[(level, causal)]


class AttentionView:
    """One block's attention on one batch, with the derived tensors every statistic shares.

    A view holds some query rows of the block: token rows ``start:stop`` of the probabilities
    (``probs``, ``[B, H, stop - start, T]``) and word rows ``word_start:word_stop`` of the
    word-to-word attention (``words``, ``[B, H, word_stop - word_start, W]``). The whole block
    is one view (the default: all rows of both); a chunked capture (:class:`WordRows`) gives a
    block as several views, in order, the last with ``last=True`` (after which a statistic that
    keeps per-block state, such as a running maximum, settles it). Row-indexed tensors below
    cover the view's rows. Key-indexed ones cover the keys the view holds: ``probs`` the first
    ``keys`` tokens (all ``T``, or under a causal or padding mask the prefix its rows can see, see
    :mod:`headlab.attention`), the word tensors the first ``words.shape[3]`` words (all ``W``, or at
    least every word with a token among those keys): the weights on the keys left out are exactly
    0, so sums, maxima and their positions over the held keys are the whole rows'. Each derived
    tensor is computed once, on first use, whichever statistics ask for it.
    """

    def __init__(self, block, probs: torch.Tensor, side: SideBatch, *, start: int = 0,
                 words: torch.Tensor | None = None, word_start: int = 0, last: bool = True) -> None:
        self.block = block
        self.side = side
        # Keys beyond the side's length (e.g. a longer padded query) never happen for self-attention.
        # float64 probabilities (a float64 model) stay float64: the reference for the fused passes
        self.probs = probs if probs.dtype == torch.float64 else probs.float()  # [B, H, rows, keys]
        self.keys = probs.shape[3]
        self.start, self.stop = start, start + probs.shape[2]
        self.last = last
        if words is None:
            if start != 0 or self.stop != side.token_word.shape[1]:
                raise ValueError("a view of some token rows needs its word rows (see WordRows)")
            self.word_start, self.word_stop = 0, side.max_words
        else:
            self.__dict__["words"] = words
            self.word_start, self.word_stop = word_start, word_start + words.shape[2]

    @cached_property
    def token_to_words(self) -> torch.Tensor:
        """``[B, H, rows, W]``: token attention summed per key word (special tokens and padding drop out)."""
        return _token_to_words(self.probs, self.side)

    @cached_property
    def key_words(self) -> torch.Tensor:
        """``[B, H, rows, W]``: token attention to each key word under the side's pooling
        (:attr:`token_to_words` itself for ``sum``)."""
        return _key_words(self.probs, self.side, self.token_to_words if self.side.pooling == "sum" else None)

    @cached_property
    def words(self) -> torch.Tensor:
        """``[B, H, word rows, W]`` word-to-word attention (see :func:`word_attention`)."""
        return _words_from(self.key_words, self.side)

    @cached_property
    def row_mass(self) -> torch.Tensor:
        """``[B, H, word rows]``: the share of each word's attention that reaches words."""
        return _row_sums(self.words, self.side.max_words)

    @cached_property
    def query_valid(self) -> torch.Tensor:
        """``[B, H, word rows]`` bool: real words whose attention reaches some word (EOS excluded)."""
        # a sum of weights >= 0 is > 0 exactly when one of them is, so the row's maximum says it
        return self.side.word_mask[:, None, self.word_start:self.word_stop] & (self._word_max[0] > 0)

    @property
    def causal(self) -> bool:
        """Whether a query sees only keys at or before itself (decoder self-attention)."""
        from headlab.heads import CAUSAL_KINDS

        return self.block.kind in CAUSAL_KINDS

    @cached_property
    def word_visible_keys(self) -> torch.Tensor:
        """``[B, word rows]`` long: how many words each word's attention can reach (all of the
        sentence's words, or under a causal mask the words up to and including itself)."""
        return reachable_keys(self.side, "word", self.causal)[0][:, self.word_start:self.word_stop]

    @cached_property
    def token_visible_keys(self) -> torch.Tensor:
        """``[B, rows]`` long: how many word tokens each token's attention can reach."""
        return reachable_keys(self.side, "token", self.causal)[0][:, self.start:self.stop]

    @cached_property
    def ranked_query_valid(self) -> torch.Tensor:
        """``[B, H, word rows]`` bool: :attr:`query_valid` words that can reach at least two words. A word
        with one reachable word (the first word under a causal mask, a one-word sentence) puts
        its largest weight there whatever the head does, so statistics that rank single
        weights (maxima, exemplars) leave it out."""
        two = reachable_keys(self.side, "word", self.causal)[1][:, self.word_start:self.word_stop]
        return self.query_valid & two[:, None, :]

    @cached_property
    def ranked_token_query_valid(self) -> torch.Tensor:
        """``[B, H, rows]`` bool: :attr:`token_query_valid` tokens that can reach two word tokens."""
        return self.token_query_valid & reachable_keys(self.side, "token", self.causal)[1][:, None, self.start:self.stop]

    @cached_property
    def _word_max(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each word row's largest weight on a word and where (padding words count as -1)."""
        K = self.words.shape[3]
        return _masked_max(self.words, self.side.word_mask[:, :K], key_range(self.side, "word", K))

    @property
    def word_max(self) -> torch.Tensor:
        """``[B, H, word rows]``: the largest weight of each word row on a word (-1: no word)."""
        return self._word_max[0]

    @property
    def word_argmax(self) -> torch.Tensor:
        """``[B, H, word rows]``: the word each word attends to most, EOS and padding excluded."""
        return self._word_max[1]

    @cached_property
    def _token_max(self) -> tuple[torch.Tensor, torch.Tensor]:
        return _masked_max(self.probs, self.side.token_mask[:, :self.keys], key_range(self.side, "token", self.keys))

    @property
    def token_argmax(self) -> torch.Tensor:
        """``[B, H, rows]``: the token each token attends to most, special tokens excluded."""
        return self._token_max[1]

    @cached_property
    def token_query_valid(self) -> torch.Tensor:
        """``[B, H, rows]`` bool: word tokens whose attention reaches some word token."""
        return self.side.token_mask[:, None, self.start:self.stop] & (self._token_max[0] > 0)


class WordRows:
    """Turns one block's token-row chunks into views with whole word rows.

    A word's row is the mean of its subwords' rows (or their maximum, or its first subword's row:
    the side's pooling), so it is complete once the chunk holding its last subword has arrived.
    Under ``sum`` each chunk's rows are summed per key word, then per query word, in token order,
    onto the partial sum of a word begun in an earlier chunk; under ``first`` and ``max`` they are
    pooled into a small buffer of the word rows not yet complete. Either way the order of the
    operations is :func:`word_attention`'s, so the result is the same to the bit. Word rows
    complete in every sentence of the batch go out with the chunk's view. With one sentence per
    batch at most a chunk's words plus one wait; sentences of a batch whose subwords are spread
    very differently keep more rows waiting.
    """

    def __init__(self, block, side: SideBatch) -> None:
        self.block = block
        self.side = side
        spans = _word_spans(side)
        if spans is None:
            raise RuntimeError(f"{block.name}: a word's subwords are not consecutive tokens; cannot stream word rows")
        self.first, self.sizes = spans  # [B, W]
        # The same on the CPU, where the word rows a chunk completes or touches are decided (no
        # wait for a device): a copy's spans are its CPU batch's, moved.
        host_spans = _word_spans(side.host)
        assert host_spans is not None
        self.host_first, self.host_sizes = host_spans
        self.last_token = torch.where(self.host_sizes > 0, self.host_first + self.host_sizes - 1, -1)  # [B, W]
        self.done = 0  # word rows handed out
        self.pending: torch.Tensor | None = None  # [B, H, rows, key words]: word rows from `done` on, not yet complete

    def view(self, probs: torch.Tensor, start: int, last: bool) -> AttentionView:
        """The view of token rows ``start:start + rows`` (``probs`` ``[B, H, rows, keys]``: all keys,
        or a prefix beyond which every weight of these rows is 0, see :class:`AttentionView`)."""
        side = self.side
        B, H, rows, _ = probs.shape
        W = side.max_words
        chunk = AttentionView(self.block, probs, side, start=start, words=probs.new_zeros(B, H, 0, W), last=False)
        stop = start + rows
        if last:
            ready = W
        else:
            complete = self.last_token < stop  # [B, W]
            ready = int(complete.long().cumprod(1).sum(1).min()) if W else 0
        n = max(ready - self.done, 0)
        if side.pooling == "sum":
            words = self._summed(chunk, start, rows, n)
        else:
            words = self._pooled(chunk, start, rows, n)
        view = AttentionView(self.block, probs, side, start=start, words=words, word_start=self.done, last=last)
        view.__dict__["token_to_words"] = chunk.token_to_words
        view.__dict__["key_words"] = chunk.key_words
        self.done += n
        return view

    def _key_words(self, chunk: AttentionView) -> torch.Tensor:
        """The chunk's key words, as wide as the pending rows (a word row begun in an earlier chunk
        that held more or fewer keys): the narrower of the two gets its zeros back, so that each
        word row is added up as over all keys."""
        key_words = chunk.key_words
        if self.pending is not None:
            have, width = self.pending.shape[3], key_words.shape[3]
            if have < width:
                self.pending = torch.nn.functional.pad(self.pending, (0, width - have))
            elif have > width:
                key_words = torch.nn.functional.pad(key_words, (0, have - width))
        return key_words

    def _summed(self, chunk: AttentionView, start: int, rows: int, n: int) -> torch.Tensor:
        """The next ``n`` word rows under ``sum``: per word, its subwords' rows in this chunk added
        onto its partial sum from earlier chunks, divided by its subword count."""
        stop = start + rows
        # The word rows this chunk touches, completes or carries: from `done` on.
        first, sizes = self.host_first, self.host_sizes
        touched = (first < stop) & (first + sizes > start) & (sizes > 0)  # [B, W]
        if bool(touched[:, :self.done].any()):
            raise RuntimeError(f"{self.block.name}: subwords out of word order; cannot stream word rows")
        columns = torch.nonzero(touched.any(0))
        top = int(columns[-1, 0]) + 1 if columns.numel() else self.done
        have = 0 if self.pending is None else self.pending.shape[2]
        need = max(top, self.done + n, self.done + have) - self.done
        first = self.first[:, self.done:self.done + need]
        sizes = self.sizes[:, self.done:self.done + need]
        lo = (first - start).clamp(0, rows)  # each word row's query tokens in this chunk: rows lo:hi
        hi = (first + sizes - start).clamp(0, rows)
        summed = _segment_sum(self._key_words(chunk), 2, lo, hi - lo, initial=self.pending)
        self.pending = summed[:, :, n:].clone() if need > n else None
        return _divide_by_sizes(summed[:, :, :n], sizes[:, :n])

    def _pooled(self, chunk: AttentionView, start: int, rows: int, n: int) -> torch.Tensor:
        """The next ``n`` word rows under ``first`` or ``max``, through a buffer of pooled rows."""
        side = self.side
        key_words = self._key_words(chunk)
        B, H, _, K = key_words.shape
        W = side.max_words
        index = _query_index(side)[:, start:start + rows]  # [B, rows], W for no word
        real = index < W
        if real.any():
            top = int(index[real].max()) + 1 - self.done
            if int(index[real].min()) < self.done:
                raise RuntimeError(f"{self.block.name}: subwords out of word order; cannot stream word rows")
        else:
            top = 0
        have = 0 if self.pending is None else self.pending.shape[2]
        need = max(have, top, n)
        pending = key_words.new_zeros(B, H, need + 1, K)  # the extra row takes tokens of no word
        if have:
            assert self.pending is not None
            pending[:, :, :have] = self.pending
        rows_at = torch.where(real, index - self.done, torch.full_like(index, need))
        _pool_rows(pending, rows_at, key_words, side.pooling)
        self.pending = pending[:, :, n:need] if need > n else None
        return pending[:, :, :n]
