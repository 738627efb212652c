"""Aggregate attention statistics per head (Vig & Belinkov 2019), streamed over a treebank.

All statistics are computed on word-to-word attention ``alpha[i, j]`` (attention *from* word
``i`` is the mean over its subwords, *to* word ``j`` the sum over its subwords, Clark et al.
2019); attention to EOS and other special tokens and to padding is left out, so a row sums to
the share of attention that reaches words. Per head, over all sentences ``x``:

* **mean distance**: ``sum alpha_ij(x) |i - j| / sum alpha_ij(x)`` (Vig & Belinkov 2019,
  "attention distance": attention-weighted distance between words);
* **mean entropy**: the entropy (nats) of each word's attention over words, renormalised to sum
  to 1, averaged over words (a word whose attention all goes to EOS is left out);
* **variability**: ``sum_x sum_ij |alpha_ij(x) - mean_x alpha_ij| / (2 sum_x sum_ij alpha_ij(x))``
  over the first ``window`` words of each sentence (Vig & Belinkov 2019, "attention
  variability"; 0 = the same pattern for every sentence, 1 = maximal change), the mean taken
  over the sentences that have cell ``(i, j)``;
* **exemplars**: the ``top_k`` sentences with the largest single weight ``alpha_ij``, with
  ``(i, j)``, over the queries ``i`` that can reach at least two words (a query with one
  reachable word, the first word under a causal mask or the word of a one-word sentence, puts
  its largest weight there trivially);
* **POS share**: ``sum alpha_ij [upos_j = t] / sum alpha_ij`` for each UPOS tag ``t`` (the
  attention proportion of Vig & Belinkov 2019 with ``f(i, j) = [upos_j = t]``);
* **dependency alignment**: ``sum alpha_ij [i, j joined by an arc] / sum alpha_ij``, either
  direction of the arc (the attention proportion with the dependency property).

For distance, POS and dependency alignment, ``min_weight`` > 0 keeps only weights above it
(Vig & Belinkov restrict these proportions to high-confidence weights; the default, 0, keeps
all). Memory stays constant: sums per head, a bounded heap per head, and for variability the
window's cells are spooled to a temporary file and read back once at the end, a batch at a time.
The sums are added once per batch (a block's views, under ``query_chunk``, are summed first), so
that a sharded run, which keeps each batch's sums (:class:`headlab.shard.Ledger`: per head, about
``8 x window^2`` bytes per batch and block), adds them in the same order as one process.
"""

from __future__ import annotations

import heapq
import math
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from html import escape
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from headlab._lazy import callable_module
from headlab.attention import KEY_BLOCK
from headlab.data.alignment import AttentionView, SideBatch
from headlab.data.fused import FusedView
from headlab.data.treebank import UPOS_TAGS
from headlab.heads import KINDS, BlockKey, HeadScores, Numbering, format_head, head_scores, scores_to_original, write_json
from headlab.markup import finite, fmt, layer_means, line_chart, read_json_noted, shade
from headlab.numbers import number
from headlab.options import option
from headlab.plugins import Figure, Output, ProfilePart, ReportPart, Statistic, read_result
from headlab.shard import Ledger, active

# Why a statistic is NaN for a head: the denominator of its ratio is 0 (see the module docstring).
_UNDEFINED = "nothing to divide by: no attention weight above --min-weight, or no word it counts; or no head analysed"

__all__ = ["AggregateStats", "AggregateResult", "AggregateOptions", "Exemplar", "STATISTICS", "POS_TAGS"]

POS_TAGS = UPOS_TAGS + ("_",)
"""UPOS tags; "_" collects a missing or non-standard tag."""

STATISTICS = ("mean_distance", "mean_entropy", "variability", "dependency_alignment")


@dataclass(frozen=True, order=True)
class Exemplar:
    """One strongly excited position: ``weight`` of word ``query`` on word ``key``."""

    weight: float
    sentence: int
    query: int
    key: int
    sent_id: str = field(default="", compare=False)
    where: str = field(default="", compare=False)
    words: tuple[str, ...] = field(default=(), compare=False)

    def to_json(self) -> dict:
        return {
            "weight": self.weight, "sentence": self.sentence, "sent_id": self.sent_id, "where": self.where,
            "query": self.query, "key": self.key,
            "query_word": self.words[self.query] if self.query < len(self.words) else None,
            "key_word": self.words[self.key] if self.key < len(self.words) else None,
            "text": " ".join(self.words),
        }


def arc_rows(side: SideBatch, first: int, stop: int, width: int | None = None) -> torch.Tensor:
    """``[B, stop - first, width]`` float: 1 where word ``i`` (a row from ``first`` on) and word ``j``
    (one of the first ``width``, default all ``W``) are joined by an arc, either way. Built per row
    range: the whole ``[B, W, W]`` matrix would be quadratic in the length."""
    W = side.heads.shape[1] if width is None else width
    rows = torch.arange(first, stop, device=side.heads.device)
    governor_of_row = side.heads[:, first:stop]  # [B, R], -1 for root, cut and padding
    row_governs = side.heads[:, None, :W] == rows[None, :, None]  # [B, R, W]: j's governor is i
    keys = torch.arange(W, device=side.heads.device)
    row_governed = governor_of_row[:, :, None] == keys[None, None, :]  # [B, R, W]: i's governor is j
    return (row_governs | row_governed).float()


def _tag_onehot(side: SideBatch) -> torch.Tensor:
    """``[B, W, n_tags]`` float64: each word's UPOS tag, one-hot (padding words as tag 0: they
    receive no attention). Cached on the batch: every block and chunk reuses it."""
    if "_tag_onehot" not in side.__dict__:
        tags = side.upos_index.clamp(min=0)
        side.__dict__["_tag_onehot"] = torch.nn.functional.one_hot(tags, len(POS_TAGS)).to(torch.float64)
    return side.__dict__["_tag_onehot"]


def _mass_and_tags(side: SideBatch) -> torch.Tensor:
    """``[B, W, 1 + n_tags]`` float64: 1 and each word's UPOS tag one-hot, 0 for padding words (the
    values of :meth:`~headlab.data.fused.FusedView.word_linear` for mass and POS). Cached on the batch."""
    if "_mass_and_tags" not in side.__dict__:
        mask = side.word_mask[..., None].to(torch.float64)
        side.__dict__["_mass_and_tags"] = torch.cat([mask, _tag_onehot(side) * mask], -1)
    return side.__dict__["_mass_and_tags"]


def _linear_features(side: SideBatch, dtype: torch.dtype, causal: bool, c: int) -> torch.Tensor:
    """``[B, W, 1 + n_tags (+ 1)]`` in ``dtype`` (the probabilities'): :func:`_mass_and_tags`, and
    under a causal mask a last column ``(j - c)`` on words (0 on padding). Small integers and 0/1, the
    same values in any float dtype: one tensor per batch and dtype, its last column rewritten in
    place for each ``c`` (no concatenation and conversion of ``[B, W, F]`` per chunk)."""
    cache = side.__dict__.setdefault("_linear_features", {})
    key = (dtype, causal)
    if key not in cache:
        base = _mass_and_tags(side)
        if causal:
            base = torch.cat([base, base.new_zeros(*base.shape[:2], 1)], -1)
        cache[key] = base.to(dtype)
    features = cache[key]
    if causal:
        W = side.max_words
        offsets = torch.arange(-c, W - c, dtype=dtype, device=features.device)
        torch.mul(offsets, side.word_mask, out=features[..., -1])
    return features


def _related_words(side: SideBatch) -> torch.Tensor:
    """``[B, W, A]`` long: the words joined to each word by an arc (its governor, its dependents),
    -1 for none: the key words of :func:`arc_rows`. Cached on the batch."""
    if "_related_words" not in side.__dict__:
        if side.host is not side:
            side.__dict__["_related_words"] = _related_words(side.host).to(side.device)
            return side.__dict__["_related_words"]
        heads = side.heads.numpy()
        B, W = heads.shape
        # every arc both ways, (b, word, related word), sorted and without repeats (a word may be
        # both governor and dependent of another in a malformed tree): vectorised, as the words of
        # a long sentence are many
        b, d = np.nonzero((heads >= 0) & (heads != np.arange(W)[None, :]))
        g = heads[b, d]
        pairs = np.unique(np.concatenate([(b * W + d) * W + g, (b * W + g) * W + d]))
        rows, keys = pairs // W, pairs % W  # row: b * W + word
        starts = np.searchsorted(rows, rows, side="left")  # each row's first pair
        rank = np.arange(len(pairs)) - starts
        A = int(rank.max()) + 1 if len(pairs) else 1
        out = np.full((B * W, A), -1, dtype=np.int64)
        out[rows, rank] = keys
        side.__dict__["_related_words"] = torch.from_numpy(out.reshape(B, W, A))
    return side.__dict__["_related_words"]


class _Scratch(dict):
    """Work buffers reused from one view of a block to the next: a fresh tensor of megabytes per
    view would take fresh pages from the OS each time where the C allocator maps large blocks
    (glibc above its mmap threshold), which costs about as much as the arithmetic on it."""

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,  # type: ignore[override]
            device: torch.device | None = None) -> torch.Tensor:  # (a dict of buffers; its own get, by design)
        size = math.prod(shape)
        buffer = dict.get(self, name)
        if buffer is None or buffer.numel() < size or buffer.dtype != dtype \
                or (device is not None and buffer.device != device):
            buffer = self[name] = torch.empty(size, dtype=dtype, device=device)
        return buffer[:size].view(shape)


class _Spool:
    """A temporary file of float32 rows ``[H, N, N]`` (NaN = absent cell), written a batch at a
    time and read back once, a batch at a time."""

    def __init__(self, shape: tuple[int, int, int], directory: str | None) -> None:
        self.shape = shape
        self.file = tempfile.TemporaryFile(dir=directory)
        self.batches: list[tuple[int, int]] = []  # (order, rows) of each batch written

    def write(self, values: np.ndarray, order: int) -> None:
        self.file.write(np.ascontiguousarray(values, dtype=np.float32).tobytes())
        self.batches.append((order, values.shape[0]))

    def read(self):
        """``(order, [rows, H, N, N])`` of each batch, in the order written."""
        self.file.flush()
        self.file.seek(0)
        size = int(np.prod(self.shape))
        for order, rows in self.batches:
            data = np.frombuffer(self.file.read(rows * size * 4), dtype=np.float32)
            yield order, data.reshape(rows, *self.shape)

    def close(self) -> None:
        self.file.close()


@dataclass(frozen=True)
class AggregateOptions:
    """The options of the aggregate statistics (the flags keep their names: no prefix)."""

    min_weight: float = option(0.0, "distance/POS/dependency proportions over weights above this only", range="[0, 1)",
                               flag="min_weight")
    window: int = option(10, "variability over the first N words", range="[1, inf)", flag="window")
    top_k: int = option(5, "exemplars per head", range="[0, inf)", flag="top_k")


class AggregateStats:
    """Streaming accumulator of the Vig & Belinkov statistics for every analysed block."""

    def __init__(self, *, min_weight: float = 0.0, window: int = 10, top_k: int = 5,
                 spool_dir: str | None = None) -> None:
        if window < 1 or top_k < 0:
            raise ValueError("window must be >= 1 and top_k >= 0")
        self.min_weight = float(min_weight)
        self.window = int(window)
        self.top_k = int(top_k)
        self.spool_dir = spool_dir
        # block -> statistic -> per-head sums, fed a batch at a time (a Ledger: a sharded run adds
        # the batches' sums in batch order, as one process does)
        self._sums = Ledger(active(), {})
        self._open: dict[BlockKey, dict[str, torch.Tensor]] = {}  # a block's sums over this batch's views
        self.heaps: dict[BlockKey, list[list[Exemplar]]] = {}
        self.spools: dict[BlockKey, _Spool] = {}
        self.pos_words: dict[str, torch.Tensor] = {}  # kind -> word count per tag (baseline)
        self.n_sentences: dict[str, int] = {}
        # a block's state between its views of one batch (chunked capture)
        self._cells: dict[BlockKey, torch.Tensor] = {}  # [B, H, window, window]
        self._best: dict[BlockKey, tuple[torch.Tensor, torch.Tensor]] = {}  # running maximum, its flat index
        self._scratch = _Scratch()  # work buffers shared by a block's views
        # Variability's deviations, once computed; a sharded run (headlab.shard): every exemplar
        # candidate that may end in the top k, replayed in batch order at the end.
        self._spread: dict[BlockKey, tuple[np.ndarray, np.ndarray]] | None = None
        self._candidates: dict[BlockKey, list[list[tuple]]] | None = {} if active().split else None

    @classmethod
    def from_config(cls, config, frequencies=None, options: AggregateOptions | None = None) -> "AggregateStats | None":
        """When ``config.aggregate`` (registry entry ``aggregate``)."""
        if not config.aggregate:
            return None
        options = options or AggregateOptions()
        return cls(min_weight=options.min_weight, window=options.window, top_k=options.top_k)

    @property
    def sums(self) -> dict[BlockKey, dict[str, torch.Tensor]]:
        """Per block, the statistics' sums over the batches settled so far (in a sharded run, the
        whole corpus's once :meth:`reduce` has run)."""
        return self._sums.total()

    def update_side(self, kind: str, side: SideBatch) -> None:
        tags = side.upos_index[side.word_mask]
        counts = torch.bincount(tags, minlength=len(POS_TAGS)).double()
        self.pos_words[kind] = self.pos_words.get(kind, 0) + counts
        self.n_sentences[kind] = self.n_sentences.get(kind, 0) + side.batch_size

    def update(self, view: AttentionView) -> None:
        """Sums over the view's word rows; a block's variability cells and exemplars settle on its last view."""
        side = view.side
        # [B, H, rows, K] float32 word rows over the first K key words (all W, or those the rows can
        # reach under a causal mask: the others' weights are exactly 0); padding rows and columns are 0
        alpha = view.words
        B, H, R, K = alpha.shape
        W = side.max_words
        first = view.word_start
        key = view.block.key
        sums = self._open.setdefault(key, {})  # added to the totals once per batch, in _settle
        f64 = torch.float64
        device = alpha.device  # the sums stay there (a GPU's) until a result is read

        def add(name: str, value: torch.Tensor) -> None:
            sums[name] = sums[name] + value if name in sums else value.clone()

        # Proportions over (optionally high-confidence) weights (Vig & Belinkov 2019, Eq. 1 style).
        # Sums in float64 of the float32 weights. ``x.double().sum(d)`` is ``x.sum(d, dtype=float64)``
        # to the bit (the same reduction of the same values) and several times faster; the cast is
        # made once and shared. Products with 0/1 masks are exact in either precision.
        # A block seen in several views (chunks) reuses its work buffers; a whole view gets its own.
        scratch = _Scratch() if view.last and key not in self._cells else self._scratch
        kept = alpha if self.min_weight <= 0 else alpha * (alpha > self.min_weight)
        kept64 = scratch.get("f64", alpha.shape, f64, device).copy_(kept)  # contiguous, as kept.double()
        add("weight", kept64.sum((0, 2, 3)))
        positions = torch.arange(max(W, first + R), dtype=alpha.dtype, device=device)
        distance = (positions[first:first + R, None] - positions[None, :K]).abs()  # [rows, K] |i - j|
        product = torch.mul(kept, distance, out=scratch.get("f32", alpha.shape, alpha.dtype, device))  # float32
        add("distance", scratch.get("f64 product", alpha.shape, f64, device).copy_(product).sum((0, 2, 3)))
        to_word = kept64.sum(2)  # [B, H, K] attention received by each key word
        add("pos", torch.einsum("bhw,bwt->ht", to_word, _tag_onehot(side)[:, :K]))
        kept64 *= arc_rows(side, first, first + R, K)[:, None].to(f64)
        add("arcs", kept64.sum((0, 2, 3)))

        # Entropy of each word's attention over words, renormalised (nats); 0 log 0 = 0. Rows of
        # some key words are summed with zeros up to a multiple of KEY_BLOCK columns, as whole rows
        # are summed (headlab.attention.KEY_BLOCK): the same bits. A row is divided by its mass
        # however small (a peaked head can leave a word 1e-35 of its attention: a floor would leave
        # that row unnormalised); a row of mass 0 is no valid row and is divided by 1.
        valid = view.query_valid  # [B, H, rows]
        row_mass = view.row_mass
        padded = K if K == W or K % KEY_BLOCK == 0 else min(W, -(-K // KEY_BLOCK) * KEY_BLOCK)
        p = scratch.get("f32", (B, H, R, padded), alpha.dtype, device)  # the product's buffer: it is summed
        p[..., K:] = 0
        torch.div(alpha, torch.where(row_mass > 0, row_mass, 1.0)[..., None], out=p[..., :K] if padded > K else p)
        entropy = -torch.special.xlogy(p, p, out=p).sum(-1)  # [B, H, rows]
        if view.last:
            self._scratch.clear()
        add("entropy", (entropy * valid).double().sum((0, 2)))
        add("entropy_n", valid.sum((0, 2)).to(f64))

        # Variability: cells of the first `window` words, gathered over the block's views; NaN
        # marks a cell the sentence lacks.
        n = min(self.window, W)
        cells = self._window_cells(key, B, H, device)
        end = min(first + R, n)
        if end > first:
            m = min(n, K)
            cells[:, :, first:end, :m] = alpha[:, :, :end - first, :m]
            cells[:, :, first:end, m:n] = 0.0  # key words beyond K: weight 0

        # Exemplars: each sentence's strongest single weight, per head, among the queries that
        # can reach at least two words (the first word under a causal mask, or the word of a
        # one-word sentence, puts its largest weight on its only word whatever the head does).
        # Other rows are -1 and padding keys 0, while a ranked row holds a positive weight, so the
        # maximum is a real (query, key) pair; a sentence with no ranked query is left out. Over
        # several views the earlier position wins a tie, as in one flattened maximum.
        if self.top_k and R:
            self._keep_best(key, view, first, W)
        if view.last:
            self._settle(key, side, B, H, n, W)

    @property
    def fused_passes(self) -> tuple[str, ...] | None:
        """The passes :meth:`update_fused` uses (:mod:`headlab.data.fused`); None with ``min_weight``
        > 0, which keeps the weights above it only: not a sum linear in the weights."""
        if self.min_weight > 0:
            return None
        return ("word_max", "word_linear", "word_distance", "word_xlogx", "word_pairs", "word_block")

    def fused_features(self, side: SideBatch, causal: bool, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """The features :meth:`update_fused` passes to ``word_linear`` on a view of a whole block
        (its first row 0), for an engine that needs them before the pass (``engine="kernel"``)."""
        return (_linear_features(side, dtype, causal, 0),)

    def update_fused(self, view: FusedView) -> None:
        """:meth:`update` from the passes of a :class:`~headlab.data.fused.FusedView`, without the word
        rows: mass and parts of speech ``alpha @ [1, one-hot(tag)]``, distance ``sum_j alpha_ij |i - j|``,
        the arcs' weights gathered, entropy ``log m_i - (1 / m_i) sum_j alpha_ij log alpha_ij``
        (the row renormalised to its mass ``m_i``)."""
        side = view.side
        B, H = view.probs.shape[:2]
        W = side.max_words
        first, R = view.word_start, view.word_stop - view.word_start
        key = view.block.key
        sums = self._open.setdefault(key, {})
        f64 = torch.float64
        device = view.probs.device

        def add(name: str, value: torch.Tensor) -> None:
            sums[name] = sums[name] + value if name in sums else value.clone()

        if R:
            # Under a causal mask every key word a row sees is at or before it: |i - j| = i - j, and
            # sum_j alpha_ij (i - j) = (i - c) m_i - sum_j alpha_ij (j - c), a last column of the same
            # product. c (the piece's first row) keeps the two terms near the distance itself.
            c = first
            features = _linear_features(side, view.probs.dtype, view.causal, c)  # [B, W, 1 + tags (+ 1)]
            products = view.word_linear(features)  # [B, H, R, 1 + tags (+ 1)]
            linear = products.to(f64)
            mass = linear[..., 0]
            add("weight", mass.sum((0, 2)))
            if view.causal:
                rows = torch.arange(R, dtype=f64, device=device) + (first - c)
                add("distance", (rows * mass - linear[..., -1]).sum((0, 2)))
                linear = linear[..., :-1]
            else:
                add("distance", view.word_distance().to(f64).sum((0, 2)))
            add("pos", linear[..., 1:].sum((0, 2)))
            add("arcs", view.word_pairs(_related_words(side)).to(f64).sum((0, 2, 3)))
            valid = view.query_valid  # [B, H, R]
            m = torch.where(mass > 0, mass, 1.0)  # the mass however small, as update's division
            entropy = m.log() - view.word_xlogx(products[..., 0]).to(f64) / m  # the mass: no second row sum
            add("entropy", torch.where(valid, entropy, 0.0).sum((0, 2)))
            add("entropy_n", valid.sum((0, 2)).to(f64))
        else:
            zeros = torch.zeros(H, dtype=f64, device=device)
            for name in ("weight", "distance", "arcs", "entropy", "entropy_n"):
                add(name, zeros)
            add("pos", torch.zeros(H, len(POS_TAGS), dtype=f64, device=device))

        n = min(self.window, W)
        cells = self._window_cells(key, B, H, device)
        end = min(first + R, n)
        if end > first:
            cells[:, :, first:end, :n] = view.word_block(n)
        if self.top_k and R:
            self._keep_best(key, view, first, W)
        if view.last:
            self._settle(key, side, B, H, n, W)

    def _window_cells(self, key: BlockKey, B: int, H: int, device: torch.device) -> torch.Tensor:
        """The block's variability cells over the first ``window`` words, [B, H, window, window],
        made on its first view; NaN marks a cell the sentence lacks."""
        cells = self._cells.get(key)
        if cells is None:
            N = self.window
            cells = self._cells[key] = torch.full((B, H, N, N), float("nan"), device=device)
        return cells

    def _keep_best(self, key: BlockKey, view: AttentionView | FusedView, first: int, W: int) -> None:
        """The running maximum weight of each sentence and head over the block's views, and its flat
        (query word, key word) index. A ranked row's maximum is positive, so it is its maximum over
        words (view.word_max, padding words -1) at the same first position; the earliest row with
        the largest wins, within a view and across views."""
        ranked = view.ranked_query_valid
        row_best = view.word_max.masked_fill(~ranked, -1.0)  # [B, H, rows]
        row_where = view.word_argmax.masked_fill(~ranked, 0)
        best, row = row_best.max(-1)  # [B, H]
        where = row * W + row_where.gather(2, row[..., None])[..., 0] + first * W
        if key in self._best:
            old_best, old_where = self._best[key]
            better = best > old_best
            best, where = torch.where(better, best, old_best), torch.where(better, where, old_where)
        self._best[key] = (best, where)

    def _settle(self, key: BlockKey, side: SideBatch, B: int, H: int, n: int, W: int) -> None:
        """A block's variability cells and exemplars for the batch, once all its rows were seen."""
        N = self.window
        cells = self._cells.pop(key)
        sums = self._open.pop(key)
        f64 = torch.float64
        present = side.word_mask[:, :n]
        cell_mask = torch.zeros(B, N, N, dtype=torch.bool, device=cells.device)
        cell_mask[:, :n, :n] = present[:, :, None] & present[:, None, :]
        cells.masked_fill_(~cell_mask[:, None], float("nan"))
        sums["cell_sum"] = torch.nan_to_num(cells).sum(0, dtype=f64)  # [H, N, N]
        sums["cell_n"] = cell_mask.sum(0).to(f64)[None].expand(H, N, N)
        order = side.sentence_index[0]  # the batches' order: their first sentence
        self._sums.add(order, {key: sums})
        if key not in self.spools:
            self.spools[key] = _Spool((H, N, N), self.spool_dir)
        self.spools[key].write(cells.cpu().numpy(), order)  # [B, H, window, window]: small
        if not self.top_k or key not in self._best:
            return
        best, where = self._best.pop(key)
        best = best.masked_fill(best <= 0, -1.0)
        heaps = self.heaps.setdefault(key, [[] for _ in range(H)])
        k = min(self.top_k, B)
        values, rows = best.topk(k, dim=0)  # [k, H]
        # The heaps are Python objects: only the top k per head and their positions come to the CPU.
        values, rows, where = values.cpu(), rows.cpu(), where.cpu()
        for h in range(H):
            heap = heaps[h]
            candidates = [(value, b) for value, b in zip(values[:, h].tolist(), rows[:, h].tolist()) if value >= 0]
            if self._candidates is not None:
                self._keep_candidates(key, h, H, heap, candidates, side, where, W, order)
            _offer(heap, self.top_k, candidates, side, where[:, h], W)

    def _keep_candidates(self, key, h, H, heap, candidates, side, where, W, order) -> None:
        """A sharded run: keep the batch's candidates, in order, that may still end in the top k
        (below this process's k-th weight now, a candidate is below the whole corpus's at the end)."""
        floor = heap[0].weight if len(heap) == self.top_k else -math.inf
        kept = [(value, b) for value, b in candidates if value >= floor]
        if kept:
            assert self._candidates is not None  # a sharded run keeps them
            per_head = self._candidates.setdefault(key, [[] for _ in range(H)])
            per_head[h].append((order, [_exemplar(value, b, side, int(where[b, h]), W) for value, b in kept]))

    def reduce(self, shard) -> None:
        """Combine the processes' states (:mod:`headlab.shard`), to the bit as one process would:
        the batches' sums added in batch order; the exemplars of one process, replaying every
        process's candidates through the heaps in batch order; and variability in two passes: the
        cell means from the sums, then each batch's deviations from them, added in batch order.
        The words per tag and the sentences are counts, added."""
        self._sums.total()
        self.pos_words, self.n_sentences = shard.sum((self.pos_words, self.n_sentences))
        kept = {}  # candidates at or above this process's final k-th weight: the others cannot get in
        for key, per_head in (self._candidates or {}).items():
            floors = [heap[0].weight if len(heap) == self.top_k else -math.inf for heap in self.heaps[key]]
            kept[key] = [[(order, [e for e in batch if e.weight >= floors[h]]) for order, batch in batches]
                         for h, batches in enumerate(per_head)]
        replayed: dict[BlockKey, list[list[Exemplar]]] = {}
        merged: dict[BlockKey, list[list[tuple]]] = {}
        for part in shard.gather(kept):
            for key, per_head in part.items():
                into = merged.setdefault(key, [[] for _ in per_head])
                for h, batches in enumerate(per_head):
                    into[h].extend(batches)
        for key, per_head in merged.items():
            replayed[key] = []
            for batches in per_head:
                heap: list[Exemplar] = []
                for _, batch in sorted(batches, key=lambda item: item[0]):
                    _offer(heap, self.top_k, batch)
                replayed[key].append(heap)
        self.heaps, self._candidates = replayed, None
        self._spread = self._deviations(shard)

    def result(self, model: str = "", signature: dict | None = None) -> "AggregateResult":
        per: dict[str, dict[BlockKey, np.ndarray]] = {name: {} for name in STATISTICS}
        pos: dict[str, dict[BlockKey, np.ndarray]] = {tag: {} for tag in POS_TAGS}
        for key, sums in self.sums.items():
            sums = {name: value.cpu() for name, value in sums.items()}
            weight = sums["weight"].numpy()
            safe = np.where(weight > 0, weight, np.nan)
            per["mean_distance"][key] = sums["distance"].numpy() / safe
            per["dependency_alignment"][key] = sums["arcs"].numpy() / safe
            n = sums["entropy_n"].numpy()
            per["mean_entropy"][key] = sums["entropy"].numpy() / np.where(n > 0, n, np.nan)
            shares = sums["pos"].numpy() / safe[:, None]
            for t, tag in enumerate(POS_TAGS):
                pos[tag][key] = shares[:, t]
            per["variability"][key] = self._variability(key, sums)
        signature = {**(signature or {}), "min_weight": self.min_weight, "window": self.window}
        scores = {name: head_scores(values, name, model, signature) for name, values in per.items()}
        pos_scores = {tag: head_scores(values, f"pos_share_{tag}", model, signature)
                      for tag, values in pos.items() if values}
        exemplars = {key: [sorted(heap, reverse=True) for heap in heaps] for key, heaps in self.heaps.items()}
        pos_frequency = {}
        for kind, counts in self.pos_words.items():
            total = float(counts.sum())
            pos_frequency[kind] = {tag: float(counts[t]) / total if total else math.nan
                                   for t, tag in enumerate(POS_TAGS)}
        return AggregateResult(scores, pos_scores, exemplars, pos_frequency, dict(self.n_sentences), signature)

    def _variability(self, key: BlockKey, sums: dict[str, torch.Tensor]) -> np.ndarray:
        if self._spread is None:
            self._spread = self._deviations(active())
        zeros = np.zeros(sums["weight"].shape[0])
        deviation, total = self._spread.get(key, (zeros, zeros))
        return deviation / np.where(total > 0, 2 * total, np.nan)

    def _deviations(self, shard) -> dict[BlockKey, tuple[np.ndarray, np.ndarray]]:
        """Per block and head, ``sum |alpha - mean|`` and ``sum alpha`` over the spooled cells: the
        sums of each batch, added in batch order (of every process's batches, with ``shard``)."""
        ledger = Ledger(shard, {})
        sums = self.sums
        for key, spool in self.spools.items():
            count = sums[key]["cell_n"].cpu().numpy()
            mean = np.divide(sums[key]["cell_sum"].cpu().numpy(), count, out=np.zeros_like(count), where=count > 0)
            for order, cells in spool.read():  # [batch, H, N, N]
                values = cells.astype(np.float64)
                present = ~np.isnan(values)
                ledger.add(order, {key: (np.where(present, np.abs(values - mean[None]), 0.0).sum((0, 2, 3)),
                                         np.where(present, values, 0.0).sum((0, 2, 3)))})
        return ledger.total()

    def close(self) -> None:
        for spool in self.spools.values():
            spool.close()
        self.spools.clear()


def _exemplar(value: float, b: int, side: SideBatch, flat: int, W: int) -> Exemplar:
    return Exemplar(float(value), side.sentence_index[b], flat // W, flat % W, side.sent_ids[b], side.where[b],
                    side.words[b])


def _offer(heap: list[Exemplar], top_k: int, candidates: list, side: SideBatch | None = None,
           where: torch.Tensor | None = None, W: int = 0) -> None:
    """A batch's candidates for one head's top ``top_k``, strongest first: ``(weight, row)`` pairs
    (made into exemplars with ``side``) or exemplars. A candidate gets in while the heap has room
    or when it beats the weakest (a tie does not); the weakest leaves."""
    for candidate in candidates:
        value = candidate.weight if isinstance(candidate, Exemplar) else candidate[0]
        if len(heap) == top_k and value <= heap[0].weight:
            break  # values are sorted: nothing further gets in
        # (weight, row) pairs come with their side and where
        item = candidate if isinstance(candidate, Exemplar) else _exemplar(value, candidate[1], cast(SideBatch, side),
                                                                           int(cast(torch.Tensor, where)[candidate[1]]), W)
        if len(heap) < top_k:
            heapq.heappush(heap, item)
        else:
            heapq.heapreplace(heap, item)


@dataclass(frozen=True)
class AggregateResult:
    """Per-head statistics as HeadScores, plus exemplars and the POS baseline."""

    scores: dict[str, HeadScores]  # STATISTICS -> HeadScores
    pos: dict[str, HeadScores]  # UPOS tag -> share of attention on words with that tag
    exemplars: dict[BlockKey, list[list[Exemplar]]]  # block -> per head, strongest first
    pos_frequency: dict[str, dict[str, float]]  # kind -> tag -> share of words with that tag
    n_sentences: dict[str, int]
    signature: dict = field(default_factory=dict)

    def __getitem__(self, name: str) -> HeadScores:
        if name in self.scores:
            return self.scores[name]
        if name.startswith("pos_share_") and name[len("pos_share_"):] in self.pos:
            return self.pos[name[len("pos_share_"):]]
        raise KeyError(name)

    def __repr__(self) -> str:
        from headlab.errors import counted

        sentences = ", ".join(f"{kind} {counted(n, 'sentence')}" for kind, n in self.n_sentences.items())
        lines = [f"AggregateResult ({sentences}): {', '.join(self.scores)}; POS shares of {counted(len(self.pos), 'tag')}"]
        lines += [f"  {scores!r}" for scores in self.scores.values()]
        return "\n".join(lines)

    def renumbered(self, numbering: Numbering) -> "AggregateResult":
        """A pruned model's heads by their original index: NaN and no exemplar for a removed head."""
        exemplars: dict[BlockKey, list[list[Exemplar]]] = {}
        for key in [*self.exemplars, *(key for key in numbering if key not in self.exemplars)]:
            heaps = self.exemplars.get(key, [])
            if key not in numbering:
                exemplars[key] = heaps
                continue
            kept, n_original = numbering[key]
            exemplars[key] = [[] for _ in range(n_original)]
            for heap, original in zip(heaps, kept):
                exemplars[key][original] = heap
        return replace(self, scores={name: scores_to_original(s, numbering) for name, s in self.scores.items()},
                       pos={tag: scores_to_original(s, numbering) for tag, s in self.pos.items()}, exemplars=exemplars)

    def exemplars_json(self) -> dict:
        return {
            f"{kind}:{layer}": [[e.to_json() for e in heap] for heap in heaps]
            for (kind, layer), heaps in sorted(self.exemplars.items())
        }

    def summary_markdown(self) -> str:
        lines = ["| statistic | kind | min | mean | max | head with max |", "|---|---|---:|---:|---:|---|"]
        for name, scores in self.scores.items():
            for kind in scores.kinds:
                array = scores[kind]
                undefined = int(np.isnan(array).sum())
                # A head whose denominator is 0 (no weight above --min-weight, no word to count) is NaN: said as
                # undefined, never left out of the table nor folded into the others' min/mean/max unsaid.
                if undefined == array.size:
                    lines.append(f"| {name} | {kind} | undefined | undefined | undefined | undefined for every head "
                                 f"({_UNDEFINED}) |")
                    continue
                layer, head = np.unravel_index(int(np.nanargmax(array)), array.shape)
                note = (f" ({undefined} of {array.size} heads without a value: undefined, removed or not analysed)"
                        if undefined else "")
                lines.append(f"| {name} | {kind} | {number(np.nanmin(array), '.3f')} | {number(np.nanmean(array), '.3f')} "
                             f"| {number(np.nanmax(array), '.3f')} | {format_head(kind, int(layer), int(head))}{note} |")
        return "\n".join(lines)

    def save(self, directory: str | Path) -> list[Path]:
        directory = Path(directory)
        paths = [scores.save(directory / f"{name}.json") for name, scores in self.scores.items()]
        paths += [scores.save(directory / "pos" / f"{tag}.json") for tag, scores in self.pos.items()]
        paths.append(write_json(directory / "exemplars.json", self.exemplars_json(), ensure_ascii=False))
        paths.append(write_json(directory / "pos_frequency.json", self.pos_frequency))
        return paths

    # -- the HeadStatistic result protocol (headlab.functions.statistic) ------------------------
    def write(self, directory: str | Path) -> list[Path]:
        return self.save(Path(directory) / "aggregate")

    def markdown(self) -> list[str]:
        return ["## Aggregate statistics (Vig & Belinkov 2019)", "", self.summary_markdown(), ""]

    def labels(self) -> dict:
        return {}

    def describe_heads(self) -> list[str]:
        return []


# -- what the report shows of them beside their heatmaps -------------------------------------------

def _layer_curves(c: Any) -> str:
    """Vig & Belinkov's per-layer curves: the mean over heads of each statistic, per layer."""
    charts = []
    for name, ylabel in (("mean_distance", "words"), ("dependency_alignment", "share"), ("mean_entropy", "nats")):
        h = next((h for h in c.heatmaps if h["group"] == "aggregate" and h["name"] == name), None)
        if h is not None:
            charts.append(line_chart(layer_means(h), "layer", ylabel, f"layer-curve {name}",
                                     f"{h['title']} by layer", integer_x=True))
    if not any(charts):
        return ""
    return ('<h3>By layer</h3><p class="caption">Mean over the heads of each layer (Vig &amp; Belinkov 2019, '
            'Figs. 2-4): attention distance, dependency alignment and entropy.</p><div class="charts">'
            + "".join(charts) + "</div>")


def _pos_grid(c: Any) -> str:
    """Tags (rows) by layers (columns): the share of attention on words of the tag, mean over heads."""
    maps = [h for h in c.heatmaps if h["group"] == "pos"]
    if not maps:
        return ""
    html = ('<h3>Attention by part of speech, all tags</h3><p class="caption">Share of attention on words of each '
            'UPOS tag (rows), mean over the heads of each layer (columns), per attention kind; darker = more. '
            'Pick a tag below for its heads.</p>')
    for kind in KINDS:
        table = {h["name"]: dict(layer_means(h)).get(kind) or [] for h in maps}
        table = {tag: line for tag, line in table.items() if line}
        if not table:
            continue
        n_layers = max(len(line) for line in table.values())
        hi = max((v for line in table.values() for _, v in line if v is not None), default=0.0)
        step = 1 if n_layers <= 16 else 2
        head = "".join(f"<th>{layer if layer % step == 0 else ''}</th>" for layer in range(n_layers))
        body = "".join(
            f"<tr><th>{escape(tag)}</th>" + "".join(
                f'<td style="{shade(v, hi)}" title="{escape(f"{tag}, layer {x}: " + fmt(v), quote=True)}"></td>'
                for x, v in line) + "</tr>"
            for tag, line in table.items())
        html += (f'<div class="pos-grid-wrap"><div class="hm-kind-title">{escape(kind)} (layer →)</div>'
                 f'<table class="pos-grid" data-kind="{escape(kind)}"><thead><tr><th>tag</th>{head}</tr></thead>'
                 f'<tbody>{body}</tbody></table></div>')
    return html


EXEMPLARS_SHOWN = 3
"""Exemplars per head the report embeds (``aggregate/exemplars.json`` keeps ``top_k``)."""


def _read_exemplars(directory: Path, note: Callable[[str], None]) -> dict | None:
    """``aggregate/exemplars.json`` (``{"kind:layer": [[exemplar, ...] per head]}``; under
    ``functions/`` from ``headlab functions --aggregate``) made compact for the report's script:
    each sentence's words once, each exemplar ``[weight, sentence, query, key]``, the first
    :data:`EXEMPLARS_SHOWN` per head."""
    folder = next((directory / c for c in ("aggregate", "functions/aggregate") if (directory / c).is_dir()), None)
    if folder is None:
        return None
    path = folder / "exemplars.json"
    raw = read_json_noted(path, directory, note)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        note(f"{path.relative_to(directory)}: not a JSON object")
        return None
    sentences: list[list[str]] = []
    slots: dict[tuple[int, str], int] = {}
    heads: dict[str, list[list[list]]] = {}
    for block, per_head in raw.items():
        if not isinstance(per_head, list):
            continue
        rows = []
        for items in per_head:
            kept = []
            for e in (items if isinstance(items, list) else [])[:EXEMPLARS_SHOWN]:
                if not isinstance(e, dict) or not isinstance(e.get("text"), str):
                    continue
                try:
                    key = (int(e.get("sentence", -1)), e["text"])
                    item = [finite(float(e.get("weight", math.nan))), int(e.get("query", 0)), int(e.get("key", 0))]
                except (TypeError, ValueError):
                    continue
                if key not in slots:
                    slots[key] = len(sentences)
                    sentences.append(e["text"].split(" "))
                kept.append([item[0], slots[key], item[1], item[2]])
            rows.append(kept)
        heads[str(block)] = rows
    return {"sentences": sentences, "heads": heads} if heads else None


def _exemplars(c: Any) -> str:
    """The exemplars' panel, filled by the report's script for the selected head."""
    if not c.sections.get("exemplars"):
        return ""
    return ('<h3>Exemplars</h3><p class="caption">The sentences in which the selected head puts its largest single '
            'weight (query word → key word), from aggregate/exemplars.json. Select a head in any heatmap.</p>'
            '<div id="exemplars" class="exemplars"></div>')


_FIGURE = Figure("aggregate_{stem}", "Aggregate statistic: {label}",
                 "{label} per head over the treebank (Vig & Belinkov 2019), layers down, heads across.")
"""The figure of each of the four per-head statistics (``headlab analyze``'s figures stage)."""

LAYER_PROFILES = ("mean_distance", "dependency_alignment", "mean_entropy")
"""Vig & Belinkov's layer profiles in a model's profile: each the mean over the layer's heads."""


def _profile(directory: Path, kind: str) -> dict:
    profiles = {}
    for name in LAYER_PROFILES:
        table = np.asarray(read_result(directory / "aggregate" / f"{name}.json")["scores"][kind], dtype=float)
        # a layer without heads (a hybrid's convolution, a layer pruned to none) is NaN, without numpy's warning
        profiles[name] = [float(np.nanmean(row)) if not np.isnan(row).all() else float("nan") for row in table]
    return {"layers": profiles}


def _profile_table(kinds: Mapping[str, dict]) -> list[str]:
    """A model's layer profile in docs/functions.md."""
    lines = ["| kind | layer | mean attention distance (words) | dependency alignment | entropy (nats) |",
             "|---|---:|---:|---:|---:|"]
    for kind, body in kinds.items():
        layers = body["layers"]
        for layer, (distance, alignment, entropy) in enumerate(zip(*(layers[name] for name in LAYER_PROFILES))):
            cells = (number(distance, ".2f"), number(alignment, ".3f"), number(entropy, ".3f"))
            lines.append(f"| {kind} | {layer} | " + " | ".join(cells) + " |")
    return lines


AGGREGATE = Statistic(
    AggregateStats.from_config, original_numbering=True,
    stage="aggregate", title="the aggregate statistics",
    outputs=(Output("aggregate/mean_distance.json", "Mean attention distance",
                    "attention-weighted distance between words (Vig & Belinkov 2019)", figure=_FIGURE),
             Output("aggregate/mean_entropy.json", "Mean attention entropy",
                    "entropy (nats) of each word's attention over words, averaged", figure=_FIGURE),
             Output("aggregate/variability.json", "Attention variability",
                    "how much the pattern changes between sentences, 0 to 1 (Vig & Belinkov 2019)", figure=_FIGURE),
             Output("aggregate/dependency_alignment.json", "Dependency alignment",
                    "share of attention between words joined by a dependency arc", figure=_FIGURE),
             Output("aggregate/pos/*.json", "Attention to {stem}",
                    "share of attention on words tagged {stem} (Vig & Belinkov 2019)", group="pos")),
    Options=AggregateOptions, report=(ReportPart("layer_curves", "aggregate", _layer_curves, before=True),
            ReportPart("pos_grid", "aggregate", _pos_grid),
            ReportPart("exemplars", "aggregate", _exemplars, collect=_read_exemplars, embed="exemplars")),
    profile=ProfilePart(_profile, table=_profile_table))
"""Vig & Belinkov 2019."""

# headlab.aggregate(model, tokenizer, treebank) is the API's headlab.api.aggregate
callable_module(__name__, "headlab.api.aggregate")
