"""Positional heads (Voita et al. 2019, Sec. 5.1).

For each head: over every word (query) of every sentence, where does its maximum attention
land, relative to itself? "We refer to a head as positional if at least 90% of the time its
maximum attention weight is assigned to a specific relative position" (Sec. 5.1). EOS and other
special tokens are excluded from the maximum, as in the paper.

Counted: every kept word whose attention reaches at least one word (a word that gives all of
its attention to EOS has no maximum among words and is left out) and that can reach at least
two words: under a causal mask the first word sees only itself, so its maximum says nothing
about the head and is left out (as is the word of a one-word sentence). Offsets beyond
``+-max_offset`` are pooled into two overflow bins, which can never be a head's offset.
``level="token"`` does the same over subword tokens instead of words. ``level="interior"``
(a sensitivity reading, ``headlab functions --sensitivity``) counts only the words that have both
neighbours in the sentence (neither the first word nor the last), for which offsets -1 and +1
are both possible.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from headlab.data.alignment import AttentionView
from headlab.functions.statistic import LabelReader, Labels, Statistic, empty_labels, sensitivity_option
from headlab.heads import BlockKey, HeadScores, Numbering, format_head, head_scores, to_original, write_json
from headlab.markup import head_cell, percent
from headlab.numbers import number
from headlab.options import option
from headlab.plugins import Output, ProfilePart, read_result

__all__ = ["PositionalStats", "PositionalResult", "PositionalHead", "PositionalOptions", "positional_summary"]


@dataclass(frozen=True)
class PositionalOptions:
    """The options of the positional statistics (words, tokens, interior words alike)."""

    sensitivity: bool = sensitivity_option()  # interior words too; first: summary.json's order of before
    threshold: float = option(0.90, "share of maxima at one offset for a positional head (Sec. 5.1)", range="(0, 1]",
                              flag="positional_threshold")
    # Offsets tracked in [-max_offset, max_offset], the rest pooled into two overflow bins: a keyword of
    # AnalysisConfig and part of summary.json, never a flag.
    max_offset: int = option(32, "relative offsets tracked each way; farther ones are pooled", command_line=False)


class PositionalStats:
    """Streaming counts of relative offsets of each head's maximum attention."""

    def __init__(self, max_offset: int = 32, level: str = "word", threshold: float = 0.9) -> None:
        if level not in ("word", "token", "interior"):
            raise ValueError(f"level must be 'word', 'token' or 'interior', got {level!r}")
        self.max_offset = int(max_offset)
        self.level = level
        self.threshold = threshold
        self.counts: dict[BlockKey, torch.Tensor] = {}  # [n_heads, 2 * max_offset + 3]
        self._aranges: dict[torch.device, torch.Tensor] = {}  # query positions (_positions)
        self._bins: dict[tuple[int, torch.device], torch.Tensor] = {}  # _head_bins

    @classmethod
    def from_config(cls, config, frequencies=None, options: PositionalOptions | None = None) -> "PositionalStats | None":
        """Word level, when ``config.functions`` (registry entry ``positional``)."""
        options = options or PositionalOptions()
        return cls(options.max_offset, "word", options.threshold) if config.functions else None

    @classmethod
    def tokens_from_config(cls, config, frequencies=None,
                           options: PositionalOptions | None = None) -> "PositionalStats | None":
        """Subword-token level, when ``config.functions`` (registry entry ``positional_tokens``)."""
        options = options or PositionalOptions()
        return cls(options.max_offset, "token", options.threshold) if config.functions else None

    @classmethod
    def interior_from_config(cls, config, frequencies=None,
                             options: PositionalOptions | None = None) -> "PositionalStats | None":
        """Words with both neighbours, when ``config.functions`` and ``options.sensitivity``
        (registry entry ``positional_interior``)."""
        options = options or PositionalOptions()
        return cls(options.max_offset, "interior", options.threshold) if config.functions and options.sensitivity else None

    @property
    def fused_passes(self) -> tuple[str, ...]:
        """The passes :meth:`update` reads from a :class:`~headlab.data.fused.FusedView`: the maxima."""
        return ("token_max",) if self.level == "token" else ("word_max",)

    def update_fused(self, view: AttentionView) -> None:
        self.update(view)  # it reads the maxima only, which a FusedView has

    def _positions(self, n: int, device: torch.device) -> torch.Tensor:
        """``arange(m)`` on ``device``, ``m >= n``: made once (grown by doubling), sliced by every view."""
        positions = self._aranges.get(device)
        if positions is None or positions.numel() < n:
            positions = self._aranges[device] = torch.arange(max(n, 2 * (0 if positions is None else positions.numel())),
                                                             device=device)
        return positions[:n]

    def _head_bins(self, H: int, device: torch.device) -> torch.Tensor:
        """``[H]``: each head's first bin in the flat counts, plus ``max_offset + 1`` (offset 0's bin)."""
        if (H, device) not in self._bins:
            self._bins[(H, device)] = torch.arange(H, device=device) * self.n_bins + self.max_offset + 1
        return self._bins[(H, device)]

    @property
    def n_bins(self) -> int:
        return 2 * self.max_offset + 3

    def update(self, view: AttentionView) -> None:
        if self.level == "token":
            argmax, valid, first = view.token_argmax, view.ranked_token_query_valid, view.start  # [B, H, rows]
        else:
            argmax, valid, first = view.word_argmax, view.ranked_query_valid, view.word_start  # [B, H, word rows]
        B, H, Q = argmax.shape
        device = argmax.device  # the counts stay there (a GPU's) until the result is read
        if self.level == "interior":
            position = first + torch.arange(Q, device=device)[None, :]  # [1, word rows]
            valid = valid & ((position >= 1) & (position < view.side.n_words[:, None] - 1))[:, None, :]
        offsets = argmax - self._positions(first + Q, device)[None, None, first:]  # key - query
        bins = offsets.clamp_(-self.max_offset - 1, self.max_offset + 1)
        bins += self._head_bins(H, device)[None, :, None]  # each head's own bins
        # the valid queries counted (an index_add of 0/1: no selection of them, which would wait for
        # a GPU to say how many there are, nor a bincount, which waits for its largest value)
        key = view.block.key
        counts = self.counts.get(key)
        if counts is None:
            counts = self.counts[key] = torch.zeros(H, self.n_bins, dtype=torch.long, device=device)
        counts.view(-1).index_add_(0, bins.reshape(-1), valid.reshape(-1).long())

    def reduce(self, shard) -> None:
        """Add the other processes' counts (:mod:`headlab.shard`)."""
        self.counts = shard.sum(self.counts)

    def result(self, threshold: float | None = None, model: str = "", signature: dict | None = None) -> "PositionalResult":
        return PositionalResult(
            {key: value.cpu().numpy().astype(np.int64) for key, value in self.counts.items()},
            self.max_offset, self.threshold if threshold is None else threshold, self.level, model,
            dict(signature or {}),
        )


@dataclass(frozen=True)
class PositionalHead:
    kind: str
    layer: int
    head: int
    offset: int
    share: float

    def __str__(self) -> str:
        return f"{format_head(self.kind, self.layer, self.head)}: {number(self.share, '.1%')} at offset {self.offset:+d}"


@dataclass(frozen=True)
class PositionalResult:
    """Offset histograms per head, and what they say."""

    counts: dict[BlockKey, np.ndarray]  # [n_heads, 2 * max_offset + 3]
    max_offset: int
    threshold: float
    level: str = "word"
    model: str = ""
    signature: dict = field(default_factory=dict)

    def renumbered(self, numbering: Numbering) -> "PositionalResult":
        """A pruned model's heads by their original index (a removed head counted nothing: no share)."""
        return replace(self, counts=to_original(self.counts, numbering, 0))

    def offsets(self) -> np.ndarray:
        """The offset of each histogram bin (overflow bins as -(max+1) and +(max+1))."""
        return np.arange(-self.max_offset - 1, self.max_offset + 2)

    def shares(self, key: BlockKey) -> np.ndarray:
        counts = self.counts[key].astype(np.float64)
        total = counts.sum(1, keepdims=True)
        return np.divide(counts, total, out=np.full_like(counts, np.nan), where=total > 0)

    def best(self, key: BlockKey) -> tuple[np.ndarray, np.ndarray]:
        """Per head: the most frequent in-range offset and its share."""
        shares = self.shares(key)[:, 1:-1]  # overflow bins excluded
        index = np.nan_to_num(shares, nan=-1).argmax(1)
        best_share = shares[np.arange(len(index)), index]
        return index - self.max_offset, best_share

    @property
    def share(self) -> HeadScores:
        """Share of queries whose maximum lands on the head's most frequent offset."""
        return head_scores({k: self.best(k)[1] for k in self.counts}, f"positional_share_{self.level}",
                           self.model, self._signature())

    @property
    def offset(self) -> HeadScores:
        """Each head's most frequent offset (as a float)."""
        values = {}
        for key in self.counts:
            offset, share = self.best(key)
            values[key] = np.where(np.isnan(share), np.nan, offset.astype(np.float64))
        return head_scores(values, f"positional_offset_{self.level}", self.model, self._signature())

    def _scored(self) -> list[PositionalHead]:
        """Every head with a share (one that saw a query), block by block."""
        every = []
        for (kind, layer) in sorted(self.counts):
            offset, share = self.best((kind, layer))
            every += [PositionalHead(kind, layer, head, int(offset[head]), float(share[head]))
                      for head in range(len(share)) if not np.isnan(share[head])]
        return every

    def heads(self) -> list[PositionalHead]:
        """The positional heads: one offset holds at least ``threshold`` of the maxima."""
        return [h for h in self._scored() if h.share >= self.threshold]

    def top(self, n: int = 5) -> list[PositionalHead]:
        """The ``n`` heads closest to positional, whatever the threshold."""
        return sorted(self._scored(), key=lambda h: -h.share)[:n]

    def _signature(self) -> dict:
        return {**self.signature, "level": self.level, "threshold": self.threshold}

    def to_json(self) -> dict:
        return {
            "level": self.level,
            "threshold": self.threshold,
            "max_offset": self.max_offset,
            "offsets": self.offsets().tolist(),
            "counts": {f"{kind}:{layer}": counts.tolist() for (kind, layer), counts in sorted(self.counts.items())},
            "positional_heads": [h.__dict__ for h in self.heads()],
        }

    # -- the HeadStatistic result protocol (headlab.functions.statistic) ------------------------
    def write(self, directory: str | Path) -> list[Path]:
        folder = Path(directory) / "positional"
        if self.level in ("token", "interior"):
            return [self.share.save(folder / f"{self.level}_share.json"),
                    self.offset.save(folder / f"{self.level}_offset.json")]
        return [self.share.save(folder / "share.json"), self.offset.save(folder / "offset.json"),
                write_json(folder / "offsets.json", self.to_json(), ensure_ascii=False)]

    # No head saw a query that can reach another word (one-word sentences): every share is NaN, null in the
    # files. Said so, never "no head reaches the threshold" (a verdict) over an empty list.
    UNDEFINED = "undefined: no query was counted (sentences too short: one word each?)"

    def markdown(self) -> list[str]:
        closest = [f"- {h}" for h in self.top(5)] or [f"- {self.UNDEFINED}"]
        if self.level == "token":
            return ["Subword-token level, closest to positional:", "", *closest, ""]
        if self.level == "interior":
            return ["Word level, only words with both neighbours (sensitivity), closest to positional:", "",
                    *closest, ""]
        return [f"## Positional heads (Voita et al. 2019, Sec. 5.1), word level, threshold {self.threshold:.0%}", "",
                *([f"- {h}" for h in self.heads()] or
                  ["No head reaches the threshold." if self._scored() else f"Every head {self.UNDEFINED}"]),
                "", "Closest to positional:", "", *closest, ""]

    def labels(self) -> Labels:
        """``positional +1``, ``positional -1``, ...: one offset holds ``threshold`` of the maxima (word level)."""
        if self.level != "word":
            return {}
        labels = empty_labels(self.share)
        for h in self.heads():
            labels[(h.kind, h.layer, h.head)].append(f"positional {h.offset:+d}")
        return labels

    def describe_heads(self) -> list[str]:
        if self.level != "word":
            return []
        heads = self.heads()
        if heads:
            return [f"positional  {h}" for h in heads]
        if not self._scored():
            return [f"positional  {self.UNDEFINED}"]
        return [f"positional  none at {self.threshold:.0%}; closest: {h}" for h in self.top(1)]


def _read_labels(directory: Path, read: LabelReader) -> dict[str, list[str]]:
    """``positional +1``, ... from ``positional/offsets.json`` (a directory without labels.json)."""
    labels: dict[str, list[str]] = {}
    for head in (read(directory / "positional" / "offsets.json") or {}).get("positional_heads", []) or []:
        labels.setdefault(f"{head['kind']}:{head['layer']}:{head['head']}", []).append(f"positional {int(head['offset']):+d}")
    return labels


def _best(scores: dict, kind: str) -> tuple[float, int, int]:
    table = np.asarray(scores[kind], dtype=float)
    if np.all(np.isnan(table)):
        return float("nan"), -1, -1
    layer, head = np.unravel_index(np.nanargmax(table), table.shape)
    return float(table[layer, head]), int(layer), int(head)


def positional_summary(functions: Path, kind: str) -> dict:
    """The most positional head of ``kind`` at word and subword level and the best previous-word
    head, from a ``functions/`` result directory (its part of a model's profile)."""
    read = read_result
    share, offset = read(functions / "positional" / "share.json"), read(functions / "positional" / "offset.json")
    token_share = read(functions / "positional" / "token_share.json")
    token_offset = read(functions / "positional" / "token_offset.json")
    offsets = read(functions / "positional" / "offsets.json")
    threshold = offsets["threshold"]
    word, layer, head = _best(share["scores"], kind)
    token, t_layer, t_head = _best(token_share["scores"], kind)
    # The share of each head's maxima at offset -1 (a previous-word head, Vig & Belinkov's "attends
    # to the previous token"), from the counts of every offset.
    column = offsets["offsets"].index(-1)
    previous = []
    for layer_index, row in enumerate(share["scores"][kind]):
        # [heads, offsets]; none for a layer without attention (a hybrid's convolution) or without heads
        counts = np.asarray(offsets["counts"].get(f"{kind}:{layer_index}", []), dtype=float)
        if counts.ndim != 2:
            previous.append(np.full(len(row), np.nan))
            continue
        totals = counts.sum(axis=1)
        previous.append(np.where(totals > 0, counts[:, column] / np.maximum(totals, 1), np.nan))
    prev, p_layer, p_head = _best({kind: previous}, kind)
    n_word = int(np.sum(np.asarray(share["scores"][kind], dtype=float) >= threshold))
    n_token = int(np.sum(np.asarray(token_share["scores"][kind], dtype=float) >= threshold))
    return {
        "threshold": threshold,
        "word": {"share": word, "offset": int(offset["scores"][kind][layer][head]), "head": [layer, head],
                 "n_positional": n_word},
        "token": {"share": token, "offset": int(token_offset["scores"][kind][t_layer][t_head]),
                  "head": [t_layer, t_head], "n_positional": n_token},
        "previous_word": {"share": prev, "head": [p_layer, p_head]},
    }


def _profile_cells(kind: str, entries: dict) -> list[str]:
    pos = entries["positional"]
    word, token, prev = pos["word"], pos["token"], pos["previous_word"]
    return [f"{head_cell(kind, word['head'])}: {percent(word['share'])} at {word['offset']:+d}",
            f"{head_cell(kind, token['head'])}: {percent(token['share'])} at {token['offset']:+d}",
            f"{head_cell(kind, prev['head'])}: {percent(prev['share'])}"]


POSITIONAL = Statistic(
    PositionalStats.from_config, original_numbering=True,
    title="positional", label_group="positional", label_pattern=r"positional [+-]\d+",
    label_caption="positional (offset)", label_cell=lambda label: label.split(" ", 1)[1],
    outputs=(Output("positional/share.json", "Positional share",
                    "share of a head's maxima at its most frequent relative offset (Sec. 5.1)"),
             Output("positional/offset.json", "Positional offset",
                    "that most frequent offset (-1 = previous word, +1 = next word)", categorical=True)),
    read_labels=_read_labels, Options=PositionalOptions,
    profile=ProfilePart(lambda directory, kind: {"positional": positional_summary(directory, kind)},
                        ("most positional head (word level)", "subword level", "best previous-word head"),
                        _profile_cells))
"""Voita et al. 2019, Sec. 5.1, over words."""
POSITIONAL_TOKENS = Statistic(PositionalStats.tokens_from_config, Options=PositionalOptions, original_numbering=True)
"""The same over subword tokens."""
POSITIONAL_INTERIOR = Statistic(PositionalStats.interior_from_config, Options=PositionalOptions,
                                original_numbering=True)
"""Words with both neighbours (``--sensitivity``)."""
