"""Statistics from a few fused passes over a chunk of attention, never the word-to-word map.

The chunked path (:class:`~headlab.data.alignment.WordRows`) turns every chunk of token
probabilities into word rows ``alpha`` and lets each statistic make its own elementwise passes
over them (a dozen in all). Most statistics need far less than ``alpha`` itself:

* a maximum and where it is (positional, syntactic, rare-token heads, exemplars): one reduction;
* sums linear in the weights, ``sum_j alpha_ij f(j)`` with key-side features ``f`` (attention
  mass, the share of each part of speech): one matrix product ``P @ F`` with the features as
  values, an attention pass with another value matrix;
* a sum with a weight that depends on the query too, ``sum_j alpha_ij g(i, j)`` (attention
  distance ``|i - j|``): one row-wise dot product;
* ``sum_j alpha_ij log alpha_ij`` (entropy: ``H_i = log m_i - (1 / m_i) sum_j alpha_ij log alpha_ij``
  with ``m_i`` the row's mass, the entropy of the row renormalised to sum to 1);
* the weights of a few (query, key) pairs (dependency arcs): a gather.

:class:`FusedView` offers these passes (:data:`PASSES`) on one piece of query rows. A statistic
declares the passes it uses (``fused_passes``, see :class:`headlab.functions.statistic.FusedStatistic`)
and is fed :class:`FusedView` s through ``update_fused``; the engine
(:mod:`headlab.functions.analysis`, ``engine="fused"``) knows no statistic by name. Where a pass
does not apply to a batch (:func:`unavailable_passes`), the statistics that declare it get the
chunked path's :class:`~headlab.data.alignment.AttentionView` s for that batch, and the run says
which.

The word-level passes apply where a word is one token: every kept word of every sentence of the
batch is a single subword, at the same token offset ``o`` in every sentence (word ``j`` is token
``o + j``; special tokens before, after, and padding are no word). Then ``alpha`` is a block of
the probabilities themselves (``alpha[i, j] = P[o + i, o + j]`` on the sentence's words, 0 on
padding words) whatever the pooling, and :class:`FusedView` is an exact
:class:`~headlab.data.alignment.AttentionView` of it: the same weights, maxima and positions (ties
to the first position, as ``argmax``, on both paths). With words of several subwords a word's
weight is a sum over its key subwords and a mean over its query subwords: maxima and entropies
of those sums need the word rows, and the word-level statistics take the chunked path.
"""

from __future__ import annotations

from functools import cached_property

import torch

from headlab.data.alignment import AttentionView, SideBatch, _word_spans

__all__ = ["PASSES", "WORD_PASSES", "FusedView", "word_offset", "unavailable_passes"]

WORD_PASSES = ("word_max", "word_linear", "word_dot", "word_xlogx", "word_pairs", "word_block")
PASSES = ("token_max",) + WORD_PASSES
"""The passes a statistic may declare: ``token_max`` (each token row's largest weight on a word
token and where: :attr:`AttentionView.token_argmax`), ``word_max`` (the same over words:
:attr:`AttentionView.word_argmax`, ``word_max``, ``query_valid``), ``word_linear``
(:meth:`FusedView.word_linear`), ``word_dot`` (:meth:`FusedView.word_dot`), ``word_xlogx``
(:meth:`FusedView.word_xlogx`), ``word_pairs`` (:meth:`FusedView.word_pairs`) and ``word_block``
(:meth:`FusedView.word_block`)."""


def word_offset(side: SideBatch) -> int | None:
    """The token position ``o`` of word 0 where every kept word of the batch is one token and word
    ``j`` is token ``o + j`` in every sentence; None otherwise. Decided once per batch, on the CPU."""
    host = side.host
    if "_word_offset" in host.__dict__:
        return host.__dict__["_word_offset"]
    offset = None
    spans = _word_spans(host)
    if spans is not None and host.max_words:
        first, sizes = spans
        mask = host.word_mask
        if bool((sizes[mask] == 1).all()) and bool((sizes[~mask] == 0).all()):
            o = int(first[0, 0])
            expected = o + torch.arange(host.max_words)[None, :].expand_as(first)
            if bool((first[mask] == expected[mask]).all()):
                offset = o
    host.__dict__["_word_offset"] = offset
    return offset


def unavailable_passes(side: SideBatch) -> tuple[str, ...]:
    """The passes of :data:`PASSES` that do not apply to ``side``'s batch (see the module docstring)."""
    return () if word_offset(side) is not None else WORD_PASSES


class FusedView(AttentionView):
    """Token query rows ``start:stop`` of one block's probabilities (``[B, H, rows, keys]``), with
    the passes of :data:`PASSES`. Its word rows are the words of those tokens (where the batch has a
    :func:`word_offset`); ``words`` (the word-to-word block) is only made when asked for."""

    def __init__(self, block, probs: torch.Tensor, side: SideBatch, *, start: int, last: bool,
                 scores: torch.Tensor | None = None) -> None:
        self.block = block
        self.scores = scores  # what the probabilities are the softmax of, where the chunk has them
        self.side = side
        self.probs = probs if probs.dtype == torch.float64 else probs.float()
        self.keys = probs.shape[3]
        self.start, self.stop = start, start + probs.shape[2]
        self.last = last
        offset = word_offset(side)
        self.offset = offset
        W = side.max_words
        if offset is None:  # token passes only
            self.word_start = self.word_stop = min(max(start, 0), W)
            self._rows = slice(0, 0)
            return
        self.word_start = min(max(start - offset, 0), W)
        self.word_stop = min(max(self.stop - offset, 0), W)
        # the piece's rows of those words
        self._rows = slice(self.word_start + offset - start, self.word_stop + offset - start)

    # -- word rows as a block of the probabilities ---------------------------------------------
    @property
    def _o(self) -> int:
        """The word offset: the word passes run only where the side has one (:func:`unavailable_passes`)."""
        assert self.offset is not None
        return self.offset

    @cached_property
    def _word_columns(self) -> int:
        """How many key words the piece holds (word ``j`` is column ``o + j``)."""
        return max(0, min(self.side.max_words, self.keys - self._o))

    @cached_property
    def words(self) -> torch.Tensor:
        """``[B, H, word rows, K]``: the word-to-word weights (0 on padding words), as the chunked path makes them."""
        o, K = self._o, self._word_columns
        block = self.probs[:, :, self._rows, o:o + K]
        if not self.side.words_real(0, K):  # decided on the CPU batch: no wait for a device
            block = block * self.side.word_mask[:, None, None, :K].to(block.dtype)
        return self._real_rows(block)

    @cached_property
    def _word_max(self) -> tuple[torch.Tensor, torch.Tensor]:
        # A word's token is the word: the largest weight on a word token, and where, is the word
        # row's (the same values in the same order; padding keys count as -1 on both paths).
        best, where = self._token_max
        best, where = best[:, :, self._rows], where[:, :, self._rows] - self._o
        if self.side.words_real(self.word_start, self.word_stop):
            return best, where
        # a padding word's row is all 0 on the chunked path: its maximum is 0, at word 0
        real = self.side.word_mask[:, None, self.word_start:self.word_stop]
        return best.masked_fill(~real, 0.0), where.masked_fill(~real, 0)

    # -- the passes ------------------------------------------------------------------------------
    def word_linear(self, features: torch.Tensor) -> torch.Tensor:
        """``[B, H, word rows, F]``: ``sum_j alpha_ij features[b, j]`` for key-word features
        ``[B, W, F]`` (one matrix product with the features as values; padding words' rows of
        ``features`` must be 0)."""
        o, K = self._o, self._word_columns
        block = self.probs[:, :, self._rows, o:o + K]
        return self._real_rows(torch.matmul(block, features[:, None, :K].to(block.dtype)))

    def word_dot(self, weights: torch.Tensor) -> torch.Tensor:
        """``[B, H, word rows]``: ``sum_j alpha_ij weights[b, i, j]`` for weights ``[B | 1, word rows, W]``
        (0 on padding words), a row-wise dot product."""
        o, K = self._o, self._word_columns
        block = self.probs[:, :, self._rows, o:o + K]
        return self._real_rows(torch.linalg.vecdot(block, weights[:, None, :, :K].to(block.dtype)))

    def _real_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, H, word rows, ...]`` with the rows of padding words 0 (their token rows are a
        special token's or padding's, not a word's: the word rows hold 0 there)."""
        if self.side.words_real(self.word_start, self.word_stop):  # on the CPU batch: no wait for a device
            return x
        real = self.side.word_mask[:, self.word_start:self.word_stop]
        return x * real.view(real.shape[0], 1, real.shape[1], *([1] * (x.dim() - 3))).to(x.dtype)

    def word_xlogx(self, mass: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, H, word rows]``: ``sum_j alpha_ij log alpha_ij`` over the words (``0 log 0 = 0``).
        ``mass``: each row's weight on words where the caller has it (``word_linear`` with a column
        that is 1 on the words), else a row sum makes it.

        With the scores ``s`` the probabilities are the softmax of, ``log p = s - lse`` and the sum is
        ``sum_j p_j s_j - m lse`` (``m = sum_j p_j``): one row-wise dot product and no logarithm per
        weight. ``lse`` is read off the row's largest word weight ``p_a``: ``lse = s_a - log p_a``
        (a row whose largest word weight is 0 has no word attention, and is not counted; one whose
        largest word weight is below the dtype's normal range, a score gap of more than 87 nats in
        float32, gets ``lse`` to fewer digits)."""
        if self.scores is not None:
            return self._xlogx_from_scores(self.scores, mass)
        words = self.words  # padding words' rows: over their tokens' weights (their rows are not counted)
        # log of the smallest positive value instead of log 0: a 0 weight adds 0 * finite = 0
        logs = words.clamp(min=torch.finfo(words.dtype).tiny).log_()
        return torch.linalg.vecdot(words, logs)

    def _xlogx_from_scores(self, scores: torch.Tensor, mass: torch.Tensor | None) -> torch.Tensor:
        o, K = self._o, self._word_columns
        dtype = self.probs.dtype
        best, where = self._word_max  # over the word columns, where = word index
        real = best > 0
        where = where.clamp(0, max(K - 1, 0)) + o
        s_best = scores[:, :, self._rows].gather(3, where[..., None])[..., 0].to(dtype)
        words = self.words  # padding words and rows: 0
        scores = scores[:, :, self._rows, o:o + K]
        # sum_j p_j s_j as one batched product, [.., 1, K] @ [.., K, 1] (einsum's plan): no tensor of
        # the products p_j s_j, and no copy where (batch, head, row) merge into one dimension (a whole chunk)
        dot = torch.einsum("bhrk,bhrk->bhr", words, scores.to(dtype) if scores.dtype != dtype else scores)
        mass = words.sum(-1) if mass is None else mass.to(dtype)
        lse = s_best - best.clamp(min=torch.finfo(dtype).tiny).log()
        return torch.where(real, dot - mass * lse, 0.0)

    def word_pairs(self, keys: torch.Tensor) -> torch.Tensor:
        """``[B, H, word rows, A]``: ``alpha_ij`` for the key words ``keys[b, i, a]`` ``[B, W, A]`` of
        each word row (-1: none, weight 0)."""
        block = self.probs[:, :, self._rows]
        B, H, R, _ = block.shape
        if R == 0 or self._word_columns == 0:
            return block.new_zeros(B, H, R, keys.shape[2])
        columns, held = self._pair_columns(keys, block.dtype)
        picked = block.gather(3, columns[:, None].expand(B, H, R, keys.shape[2]))
        return picked * held[:, None]

    def _pair_columns(self, keys: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The token columns ``[B, R, A]`` of :meth:`word_pairs`' key words for this piece's word rows,
        and 1 where a pair is held (0: none, or a key word beyond the held keys). They depend on the
        rows and the keys held only, not on the block: made once per batch for each piece position
        and reused by every layer (kept on the side with ``keys``: linear in the words in all)."""
        o, K = self._o, self._word_columns
        cache = self.side.__dict__.setdefault("_pair_columns", {})
        position = (id(keys), self.word_start, self.word_stop, K, self.keys, dtype)
        if position not in cache:
            index = keys[:, self.word_start:self.word_stop]  # [B, R, A]
            held = (index >= 0) & (index < K)
            columns = (index.clamp(0, max(K - 1, 0)) + o).clamp(max=self.keys - 1)
            cache[position] = (keys, columns, held.to(dtype))  # keys: its id stays its own
        _, columns, held = cache[position]
        return columns, held

    def word_block(self, n: int) -> torch.Tensor:
        """``[B, H, word rows below n, n]``: the weights among the first ``n`` words (0 beyond the held keys)."""
        o, K = self._o, self._word_columns
        end = max(min(self.word_stop, n) - self.word_start, 0)
        rows = slice(self._rows.start, self._rows.start + end)
        m = min(n, K)
        block = self.probs[:, :, rows, o:o + m]
        if m < n:
            block = torch.nn.functional.pad(block, (0, n - m))
        return block
