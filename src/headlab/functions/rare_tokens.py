"""Rare-token heads (Voita et al. 2019, Sec. 5.3).

The paper finds one head in the first encoder layer that points to the least frequent tokens.
Over the sentences whose least frequent token is not among the 500 most frequent, it reports
how often that head's maximum attention goes to the rarest token, and how often to one of the
two rarest (Sec. 5.3; see the paper for its figures). We measure the same for every head.

This works on subword *tokens*, as the paper does, with the frequencies of the model's own
vocabulary in its training data (:class:`~headlab.data.frequencies.TokenFrequencies`). Word
level would bias the test: attention *to* a word sums over its subwords, and rare words are
split into more subwords. Special tokens are excluded as queries, as keys and as candidates,
and so is a query token that can reach fewer than two word tokens (the first token under a
causal mask: its maximum is forced).

Two readings of "how often": per query token (the default: every query token of every eligible
sentence counts once, so long sentences weigh more) and per sentence (``per_sentence``, from
``headlab functions --sensitivity``: each eligible sentence's share of its query tokens, averaged
over the sentences, with the standard deviation across sentences for an interval).

Ties: the "rarest token" is every position whose count equals the sentence's minimum; "one of
the two rarest" is every position whose count is at most the second smallest count in the
sentence (positions sorted by count, then taken in order). A sentence whose tokens all share one
count is left out like a sentence of frequent tokens: each of its tokens is the rarest, so every
head's maximum would land on "the rarest token".
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from headlab.data.alignment import AttentionView, SideBatch
from headlab.data.frequencies import TokenFrequencies
from headlab.errors import counted
from headlab.functions.statistic import LabelReader, Labels, Statistic, empty_labels, sensitivity_option
from headlab.heads import BlockKey, HeadScores, Numbering, format_head, head_scores, to_original, write_json
from headlab.markup import head_cell, percent
from headlab.numbers import number
from headlab.options import option
from headlab.plugins import Output, ProfilePart, read_result
from headlab.shard import Ledger, active

__all__ = ["RareTokenStats", "RareTokenResult", "RareOptions", "rare_token_masks"]


def rare_token_masks(side: SideBatch, counts: torch.Tensor, top: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(eligible [B], rarest [B, T], two_rarest [B, T])`` for one batch.

    ``counts[id]`` is the training count of token ``id``; ``top[id]`` marks the most frequent ids
    (both on the CPU). A batch copied to a device (:meth:`SideBatch.to`) gets the CPU batch's
    masks, moved there.
    """
    cache = side.__dict__.setdefault("_rare_masks", {})
    key = id(counts)
    if key in cache:
        return cache[key]
    if side.host is not side:
        cache[key] = tuple(mask.to(side.device) for mask in rare_token_masks(side.host, counts, top))
        return cache[key]
    ids = side.token_ids.clamp(0, counts.numel() - 1)
    token_counts = counts[ids].double().masked_fill(~side.token_mask, float("inf"))  # [B, T]
    sorted_counts, order = token_counts.sort(dim=1, stable=True)
    first = sorted_counts[:, :1]
    second = sorted_counts[:, 1:2] if token_counts.shape[1] > 1 else first
    second = torch.where(torch.isinf(second), first, second)  # one-token sentence
    rarest = side.token_mask & (token_counts == first)
    two_rarest = side.token_mask & (token_counts <= second)
    least = side.token_ids.gather(1, order[:, :1]).squeeze(1).clamp(0, counts.numel() - 1)
    # A sentence whose tokens all tie at the least count has every token "rarest": any maximum lands on one, so a
    # head would score 100% whatever it does (all tokens equally frequent: every head a rare-token head). Left out.
    distinct = (side.token_mask & ~rarest).any(1)
    eligible = side.token_mask.any(1) & ~top[least] & distinct
    cache[key] = (eligible, rarest, two_rarest)
    return cache[key]


@dataclass(frozen=True)
class RareOptions:
    """The options of the rare-token statistic."""

    top_frequent: int = option(500, "rare-token sentences: least frequent token outside the N most frequent",
                               range="[1, inf)", flag="top_frequent")
    sensitivity: bool = sensitivity_option()  # the share per sentence too


class RareTokenStats:
    """Streaming: how often each head's maximum attention lands on the rarest token(s)."""

    def __init__(self, frequencies: TokenFrequencies, top_k: int = 500, per_sentence: bool = False) -> None:
        self.frequencies = frequencies
        self.top_k = int(top_k)
        self.per_sentence = per_sentence
        # per sentence: block -> [n sentences, sum of shares, sum of squares] x (rarest, two) per head,
        # [5, n_heads]: n, rarest sum, sq, two sum, sq; fed a batch at a time (a Ledger: a sharded
        # run adds the batches' sums in batch order, as one process does)
        self._sentences = Ledger(active(), {})
        self._open: dict[BlockKey, torch.Tensor] = {}  # [3, B, H]: this batch's hits, two, queries so far
        self.counts = torch.from_numpy(np.array(frequencies.counts, dtype=np.int64))
        self.top = torch.from_numpy(frequencies.top_mask(self.top_k))
        self.n_sentences: dict[str, int] = {}
        self.n_eligible: dict[str, int] = {}
        self.first: dict[BlockKey, torch.Tensor] = {}  # [n_heads]
        self.two: dict[BlockKey, torch.Tensor] = {}
        self.queries: dict[BlockKey, torch.Tensor] = {}

    @classmethod
    def from_config(cls, config, frequencies: TokenFrequencies | None = None,
                    options: RareOptions | None = None) -> "RareTokenStats | None":
        """When ``config.functions`` and token frequencies are given (registry entry ``rare``)."""
        if not (config.functions and frequencies):
            return None
        options = options or RareOptions()
        return cls(frequencies, options.top_frequent, per_sentence=options.sensitivity)

    def update_side(self, kind: str, side: SideBatch) -> None:
        eligible, _, _ = rare_token_masks(side, self.counts, self.top)
        self.n_sentences[kind] = self.n_sentences.get(kind, 0) + side.batch_size
        self.n_eligible[kind] = self.n_eligible.get(kind, 0) + int(eligible.sum())

    fused_passes = ("token_max",)
    """The passes :meth:`update` reads from a :class:`~headlab.data.fused.FusedView`: the token maxima."""

    def update_fused(self, view: AttentionView) -> None:
        self.update(view)

    def update(self, view: AttentionView) -> None:
        eligible, rarest, two_rarest = rare_token_masks(view.side, self.counts, self.top)
        argmax = view.token_argmax  # [B, H, rows]
        B, H, _ = argmax.shape
        valid = view.ranked_token_query_valid & eligible[:, None, None]  # [B, H, rows]
        on_rarest = rarest[:, None, :].expand(B, H, -1).gather(2, argmax) & valid
        on_two = two_rarest[:, None, :].expand(B, H, -1).gather(2, argmax) & valid
        key = view.block.key
        for table, value in ((self.first, on_rarest), (self.two, on_two), (self.queries, valid)):
            counts = value.sum((0, 2))
            if key in table:
                table[key] += counts
            else:
                table[key] = counts.clone()
        if self.per_sentence:
            # A sentence's query rows may come in several views (query chunks): sum them until the last.
            counts = torch.stack([on_rarest.sum(2), on_two.sum(2), valid.sum(2)]).double()  # [3, B, H]
            self._open[key] = self._open[key] + counts if key in self._open else counts
            if view.last:
                self._close_sentences(key, self._open.pop(key), view.side.sentence_index[0])

    @property
    def sentences(self) -> dict[BlockKey, torch.Tensor]:
        return self._sentences.total()

    def _close_sentences(self, key: BlockKey, counts: torch.Tensor, order: int) -> None:
        hits, two, n = counts
        seen = n > 0  # [B, H]: eligible sentences with a counted query
        share = torch.where(seen, hits / n.clamp(min=1), torch.zeros_like(hits))
        share_two = torch.where(seen, two / n.clamp(min=1), torch.zeros_like(two))
        rows = torch.stack([seen.sum(0).double(), share.sum(0), (share ** 2).sum(0), share_two.sum(0),
                            (share_two ** 2).sum(0)])
        self._sentences.add(order, {key: rows})

    def reduce(self, shard) -> None:
        """Add the other processes' counts, and their batches' per-sentence sums in batch order
        (:mod:`headlab.shard`)."""
        self.n_sentences, self.n_eligible, self.first, self.two, self.queries = shard.sum(
            (self.n_sentences, self.n_eligible, self.first, self.two, self.queries))
        self._sentences.total()

    def result(self, model: str = "", signature: dict | None = None) -> "RareTokenResult":
        return RareTokenResult(
            first={k: v.cpu().numpy().astype(np.int64) for k, v in self.first.items()},
            two={k: v.cpu().numpy().astype(np.int64) for k, v in self.two.items()},
            queries={k: v.cpu().numpy().astype(np.int64) for k, v in self.queries.items()},
            sentences={k: v.cpu().numpy() for k, v in self.sentences.items()} if self.per_sentence else None,
            n_sentences=dict(self.n_sentences),
            n_eligible=dict(self.n_eligible),
            top_k=self.top_k,
            frequency_source=self.frequencies.source,
            model=model,
            signature=dict(signature or {}),
        )


@dataclass(frozen=True)
class RareTokenResult:
    first: dict[BlockKey, np.ndarray]
    two: dict[BlockKey, np.ndarray]
    queries: dict[BlockKey, np.ndarray]
    sentences: dict[BlockKey, np.ndarray] | None  # [5, n_heads] per block (see RareTokenStats), or None
    n_sentences: dict[str, int]
    n_eligible: dict[str, int]
    top_k: int = 500
    frequency_source: str = ""
    model: str = ""
    signature: dict = field(default_factory=dict)

    def renumbered(self, numbering: Numbering) -> "RareTokenResult":
        """A pruned model's heads by their original index (a removed head counted no query: no share)."""
        sentences = None if self.sentences is None else {  # [5, n_heads]: heads on the second axis
            key: value.T for key, value in to_original({k: v.T for k, v in self.sentences.items()}, numbering, 0).items()}
        return replace(self, first=to_original(self.first, numbering, 0), two=to_original(self.two, numbering, 0),
                       queries=to_original(self.queries, numbering, 0), sentences=sentences)

    def _share(self, table: dict[BlockKey, np.ndarray], method: str) -> HeadScores:
        values = {}
        for key, hits in table.items():
            n = self.queries[key].astype(np.float64)
            values[key] = np.divide(hits, n, out=np.full(len(hits), np.nan), where=n > 0)
        return head_scores(values, method, self.model, {**self.signature, "top_k": self.top_k,
                                                        "frequencies": self.frequency_source})

    @property
    def rarest(self) -> HeadScores:
        """Share of queries whose maximum lands on the sentence's rarest token."""
        return self._share(self.first, "rare_token_rarest")

    @property
    def two_rarest(self) -> HeadScores:
        """Share of queries whose maximum lands on one of the two rarest tokens."""
        return self._share(self.two, "rare_token_two_rarest")

    def _per_sentence(self, row: int, method: str) -> HeadScores:
        values = {}
        for key, table in (self.sentences or {}).items():
            n = table[0]
            values[key] = np.divide(table[row], n, out=np.full(len(n), np.nan), where=n > 0)
        return head_scores(values, method, self.model, {**self.signature, "top_k": self.top_k,
                                                        "frequencies": self.frequency_source, "reading": "per sentence"})

    @property
    def rarest_per_sentence(self) -> HeadScores:
        """Mean over eligible sentences of the share of their queries whose maximum lands on the rarest token."""
        return self._per_sentence(1, "rare_token_rarest_per_sentence")

    def per_sentence_json(self) -> dict:
        """``{"kind:layer": {"sentences", "query_tokens", "rarest_mean", "rarest_sd", "two_rarest_mean",
        "two_rarest_sd"}}``: per head, the eligible sentences and query tokens counted, and the mean
        and standard deviation of the per-sentence shares (for an interval of the mean)."""
        out = {}
        for (kind, layer), table in sorted((self.sentences or {}).items()):
            n = table[0]
            entry: dict[str, list] = {"sentences": n.astype(np.int64).tolist(),
                                      "query_tokens": self.queries[(kind, layer)].astype(np.int64).tolist()}
            for name, row in (("rarest", 1), ("two_rarest", 3)):
                mean = np.divide(table[row], n, out=np.full(len(n), np.nan), where=n > 0)
                second = np.divide(table[row + 1], n, out=np.full(len(n), np.nan), where=n > 0)
                var = np.clip(second - mean ** 2, 0, None) * np.divide(n, n - 1, out=np.full(len(n), np.nan),
                                                                         where=n > 1)
                entry[f"{name}_mean"] = [None if np.isnan(x) else float(x) for x in mean]
                entry[f"{name}_sd"] = [None if np.isnan(x) else float(x) for x in np.sqrt(var)]
            out[f"{kind}:{layer}"] = entry
        return out

    def top(self, n: int = 3) -> list[tuple[str, int, int, float, float]]:
        """The ``n`` heads that point to the rarest token most: ``(kind, layer, head, rarest, two)``."""
        two = self.two_rarest
        ranked = sorted(self.rarest.items(), key=lambda item: -item[1])[:n]
        return [(k, l, h, share, float(two[k][l, h])) for (k, l, h), share in ranked]

    def rare_heads(self, tolerance: float = 0.0) -> list[tuple[str, int, int]]:
        """The head(s) with the highest rarest-token share (within ``tolerance`` of the best)."""
        items = list(self.rarest.items())
        if not items:
            return []
        best = max(share for _, share in items)
        return [key for key, share in items if share >= best - tolerance]

    def describe(self) -> str:
        lines = [f"{kind}: {self.n_eligible.get(kind, 0)} of {counted(n, 'sentence')} have a least frequent token outside the "
                 f"top {self.top_k} and a more frequent one" for kind, n in self.n_sentences.items()]
        lines += [f"{format_head(kind, layer, head)}: rarest token {number(share, '.1%')}, one of two rarest {number(two, '.1%')}"
                  for kind, layer, head, share, two in self.top()]
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "top_k": self.top_k,
            "frequencies": self.frequency_source,
            "n_sentences": self.n_sentences,
            "n_eligible": self.n_eligible,
            "top_heads": [dict(zip(("kind", "layer", "head", "rarest", "two_rarest"), t)) for t in self.top(5)],
        }

    # -- the HeadStatistic result protocol (headlab.functions.statistic) ------------------------
    def write(self, directory: str | Path) -> list[Path]:
        folder = Path(directory) / "rare_tokens"
        paths = [self.rarest.save(folder / "rarest.json"), self.two_rarest.save(folder / "two_rarest.json"),
                 write_json(folder / "summary.json", self.to_json(), ensure_ascii=False)]
        if self.sentences is not None:
            paths += [self.rarest_per_sentence.save(folder / "rarest_per_sentence.json"),
                      write_json(folder / "per_sentence.json", self.per_sentence_json())]
        return paths

    def markdown(self) -> list[str]:
        return ["## Rare-token heads (Sec. 5.3)", "", "```", self.describe(), "```", ""]

    def labels(self) -> Labels:
        """``rare``: the head whose maximum lands on the rarest token most often (Sec. 5.3)."""
        labels = empty_labels(self.rarest)
        for key in self.rare_heads():
            labels[key].append("rare")
        return labels

    def describe_heads(self) -> list[str]:
        top = self.top(1)
        if not top:  # no qualifying sentence: said, rather than no line at all
            return [f"rare-token  undefined: {line}" for line in self.describe().splitlines()]
        return [f"rare-token  {format_head(kind, layer, head)}: rarest {number(share, '.1%')}, two rarest {number(two, '.1%')}"
                for kind, layer, head, share, two in top]


def _read_labels(directory: Path, read: LabelReader) -> dict[str, list[str]]:
    """``rare`` from ``rare_tokens/summary.json`` (a directory without labels.json)."""
    labels: dict[str, list[str]] = {}
    for head in ((read(directory / "rare_tokens" / "summary.json") or {}).get("top_heads") or [])[:1]:
        labels.setdefault(f"{head['kind']}:{head['layer']}:{head['head']}", []).append("rare")
    return labels


def _profile(functions: Path, kind: str) -> dict:
    """A model profile's rare-token head of ``kind``: the one that points to the rarest token most."""
    rare = read_result(functions / "rare_tokens" / "summary.json")
    top = next((row for row in rare.get("top_heads", []) if row["kind"] == kind), None)
    return {"rare_token": None if top is None else {"head": [top["layer"], top["head"]], "rarest": top["rarest"],
                                                    "two_rarest": top["two_rarest"]}}


def _profile_cells(kind: str, entries: dict) -> list[str]:
    rare = entries["rare_token"]
    return ["-" if rare is None else f"{head_cell(kind, rare['head'])}: {percent(rare['rarest'])}"]


RARE = Statistic(
    RareTokenStats.from_config, original_numbering=True,
    title="rare-token heads", needs=("frequencies",), label_group="rare", label_pattern="rare",
    label_caption="rare-token",
    outputs=(Output("rare_tokens/rarest.json", "Rare-token share",
                    "how often the head's maximum lands on the rarest token (Sec. 5.3)"),),
    read_labels=_read_labels, Options=RareOptions,
    profile=ProfilePart(_profile, ("rarest-token head",), _profile_cells))
"""Voita et al. 2019, Sec. 5.3 (needs token frequencies)."""
