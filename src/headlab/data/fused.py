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

__all__ = ["PASSES", "WORD_PASSES", "KERNEL_PASSES", "FusedView", "KernelView", "word_offset", "unavailable_passes"]

WORD_PASSES = ("word_max", "word_linear", "word_dot", "word_distance", "word_xlogx", "word_pairs", "word_block")
PASSES = ("token_max",) + WORD_PASSES
"""The passes a statistic may declare: ``token_max`` (each token row's largest weight on a word
token and where: :attr:`AttentionView.token_argmax`), ``word_max`` (the same over words:
:attr:`AttentionView.word_argmax`, ``word_max``, ``query_valid``), ``word_linear``
(:meth:`FusedView.word_linear`), ``word_dot`` (:meth:`FusedView.word_dot`), ``word_distance``
(:meth:`FusedView.word_distance`), ``word_xlogx``
(:meth:`FusedView.word_xlogx`), ``word_pairs`` (:meth:`FusedView.word_pairs`) and ``word_block``
(:meth:`FusedView.word_block`)."""

KERNEL_PASSES = tuple(name for name in PASSES if name != "word_dot")
"""The passes a :class:`KernelView` offers: all but ``word_dot`` (a sum with arbitrary weights
``g(i, j)`` needs the weights themselves)."""


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

    def word_distance(self) -> torch.Tensor:
        """``[B, H, word rows]``: ``sum_j alpha_ij |i - j|`` over the words (attention distance, Vig &
        Belinkov 2019): :meth:`word_dot` with the weights ``|i - j|`` (0 on padding words)."""
        positions = torch.arange(self.side.max_words, dtype=self.probs.dtype, device=self.probs.device)
        distance = (positions[self.word_start:self.word_stop, None] - positions[None, :]).abs()  # [R, W] |i - j|
        distance = distance[None] * self.side.word_mask[:, None, :].to(distance.dtype)  # padding words: 0
        return self.word_dot(distance)

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


class KernelView(FusedView):
    """A whole block's (``start`` 0, ``last``) passes of :data:`PASSES` from one fused attention
    kernel pass (:mod:`headlab.data.attention_kernel`, ``engine="kernel"``) instead of the
    probabilities: the token maxima from the kernel's eligible maximum (the word tokens), sums
    linear in the weights from its ``P @ F`` with the features declared before the pass
    (:meth:`headlab.functions.statistic.FusedStatistic.fused_features`), attention distance from
    ``P @ [1, j]`` split at the diagonal, ``sum p log p`` from its ``sum_j p_ij s_ij``, and the few
    weights of :meth:`word_pairs` and :meth:`word_block` as ``exp(s_ij - lse_i)`` from the dot
    products of their queries and keys. ``probs`` is a stand-in with the shape, dtype and device of
    the probabilities; none is held.

    ``stats``: the kernel's :class:`~headlab.data.attention_kernel.KernelStatistics` over the
    block's ``[B, H, T]`` token rows; ``linear``: ``{id(features): columns}`` of the declared
    features in ``stats.linear``, with the last two columns (word mask, word index) for the
    distance; ``query``/``key`` ``[B, H | Hkv, T, d]``, ``scaling`` and ``seen(rows, columns)``
    (whether query token ``rows`` sees key token ``columns``, ``[B, ...]`` long indices) for the
    gathered weights."""

    def __init__(self, block, stats, side: SideBatch, *, linear: dict, query: torch.Tensor, key: torch.Tensor,
                 scaling: float, seen) -> None:
        B, H, T = stats.lse.shape
        self.block = block
        self.scores = None
        self.side = side
        self.stats = stats
        self.linear_columns = linear
        self.query, self.key, self.scaling, self.seen = query, key, scaling, seen
        # the probabilities' shape, dtype and device, without them (a value read from it is a defect)
        self.probs = stats.lse[..., None].expand(B, H, T, T)
        self.keys = T
        self.start, self.stop, self.last = 0, T, True
        offset = word_offset(side)
        if offset is None:
            raise ValueError("a kernel view needs words of one token each (headlab.data.fused.word_offset)")
        self.offset = offset
        W = side.max_words
        self.word_start, self.word_stop = 0, min(max(T - offset, 0), W)
        self._rows = slice(offset, offset + self.word_stop)

    @cached_property
    def words(self) -> torch.Tensor:
        raise NotImplementedError("a kernel view holds no weights: declare the passes that need none")

    @cached_property
    def _token_max(self) -> tuple[torch.Tensor, torch.Tensor]:
        # The largest weight on a word token and its first position (the kernel's, on the scores:
        # exp is monotonic). A row that sees no word token gets 0 at position 0: it is not a valid
        # query (its largest weight is not > 0) on either path.
        found = self.stats.argmax >= 0
        return self.stats.max_weight, torch.where(found, self.stats.argmax, 0)

    def _columns(self, features: torch.Tensor) -> slice:
        columns = self.linear_columns.get(id(features))
        if columns is None:
            raise ValueError("word_linear on features that were not declared before the pass (fused_features)")
        return columns

    def word_linear(self, features: torch.Tensor) -> torch.Tensor:
        linear = self.stats.linear
        return self._real_rows(linear[:, :, self._rows, self._columns(features)])

    def word_distance(self) -> torch.Tensor:
        """``sum_j alpha_ij |i - j|`` over the words: with ``m`` the mass and ``p`` the sum of
        ``alpha_ij j``, over all words and over the words ``j <= i`` (``_low``), it is
        ``i (2 m_low - m) + p - 2 p_low``."""
        all_, low = self.stats.linear[:, :, self._rows, -2:], self.stats.linear_lower[:, :, self._rows, -2:]
        i = torch.arange(self.word_start, self.word_stop, dtype=all_.dtype, device=all_.device)
        m, p, m_low, p_low = all_[..., 0], all_[..., 1], low[..., 0], low[..., 1]
        return self._real_rows(i * (2 * m_low - m) + p - 2 * p_low)

    def word_dot(self, weights: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("a kernel view has no word_dot (arbitrary weights need the probabilities)")

    def word_xlogx(self, mass: torch.Tensor | None = None) -> torch.Tensor:
        """As :meth:`FusedView.word_xlogx`: ``sum_j p_j s_j - m lse`` from the kernel's ``sum_j p_j s_j``
        over the word tokens; 0 where the row has no word attention."""
        best = self._word_max[0]
        dot = self.stats.score_dot[:, :, self._rows]
        lse = self.stats.lse[:, :, self._rows]
        if mass is None:
            raise ValueError("a kernel view's word_xlogx needs the mass (word_linear with a column of 1 on words)")
        return self._real_rows(torch.where(best > 0, dot - mass.to(dot.dtype) * lse, 0.0))

    def _weights(self, rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        """``[B, H, R, A]``: ``exp(s_ij - lse_i)`` for query tokens ``rows`` ``[B, R]`` and key tokens
        ``columns`` ``[B, R, A]`` (0 where the key is hidden from the query)."""
        B, H, _ = self.stats.lse.shape
        group = H // self.key.shape[1]
        dtype = self.stats.lse.dtype
        R, A = columns.shape[1], columns.shape[2]
        d = self.query.shape[3]
        q = self.query.gather(2, rows[:, None, :, None].expand(B, H, R, d)).to(dtype)  # [B, H, R, d]
        k = self.key.gather(2, columns.reshape(B, 1, R * A, 1).expand(B, self.key.shape[1], R * A, d)).to(dtype)
        k = k.view(B, -1, R, A, d).repeat_interleave(group, 1)  # [B, H, R, A, d]
        s = torch.einsum("bhrd,bhrad->bhra", q, k) * self.scaling
        lse = self.stats.lse.gather(2, rows[:, None, :].expand(B, H, R))[..., None]
        weights = torch.exp(s - lse) * self.seen(rows, columns)[:, None].to(dtype)
        # A row that sees no key (lse = -inf, a pad row past a sliding window): exp(+inf) * 0 would be
        # NaN in every sum; eager's softmax of the float minimum is uniform over every key instead.
        return torch.where(lse.isneginf(), 1.0 / self.key.shape[2], weights)

    def word_pairs(self, keys: torch.Tensor) -> torch.Tensor:
        B, H = self.stats.lse.shape[:2]
        R = self.word_stop - self.word_start
        if R == 0 or self._word_columns == 0:
            return self.stats.lse.new_zeros(B, H, R, keys.shape[2])
        columns, held = self._pair_columns(keys, self.stats.lse.dtype)
        rows = torch.arange(self._rows.start, self._rows.stop, device=columns.device).expand(B, R)
        return self._weights(rows, columns) * held[:, None]

    def word_block(self, n: int) -> torch.Tensor:
        B, H = self.stats.lse.shape[:2]
        o, K = self._o, self._word_columns
        end = max(min(self.word_stop, n) - self.word_start, 0)
        m = min(n, K)
        device = self.stats.lse.device
        rows = torch.arange(o, o + end, device=device).expand(B, end)
        columns = torch.arange(o, o + m, device=device).expand(B, end, m)
        block = self._weights(rows, columns)
        if m < n:
            block = torch.nn.functional.pad(block, (0, n - m))
        return block
