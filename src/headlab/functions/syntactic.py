"""Syntactic heads (Voita et al. 2019, Sec. 5.2.1 and Table 1).

For a dependency relation and a direction, a head's accuracy is how often its maximum
attention *from* one word of an arc lands on the other word: from the governor to the
dependent ("v -> s" for nsubj) or from the dependent to the governor ("s -> v"). EOS and other
special tokens are excluded from the maximum. The baseline is the most frequent relative
position of the relation in that direction ("the most frequent relative position of the
dependent/governor", Sec. 5.2.1): always guessing that offset. A head is syntactic for a
relation when its accuracy beats the baseline by at least ``margin`` (10 points in the paper).

Every arc whose two words survive alignment and truncation counts, for heads and baseline
alike. A relation with no arc in the data gets a row that says so.

Under a causal mask (:data:`headlab.heads.CAUSAL_KINDS`) a word sees only itself and earlier
words, so an arc whose target comes after its source is out of every head's reach. There, only
the reachable arcs count (for heads and baseline alike: the baseline is the most frequent
backward offset), and a direction most of whose arcs point forward is marked unreachable and
not scored.
"""

from __future__ import annotations

import argparse
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from html import escape
from pathlib import Path
from typing import Any

import numpy as np
import torch

from headlab.data.alignment import AttentionView, SideBatch
from headlab.data.treebank import PAPER_RELATIONS, relation_matcher
from headlab.errors import HeadlabError
from headlab.functions.statistic import LabelReader, Labels, Statistic, empty_labels
from headlab.heads import (
    CAUSAL_KINDS,
    BlockKey,
    HeadScores,
    Numbering,
    atomic_write_text,
    format_head,
    head_scores,
    to_original,
    write_json,
)
from headlab.markup import head_cell, percent, read_json_noted
from headlab.markup import table as html_table
from headlab.numbers import number
from headlab.options import comma_list, option
from headlab.plugins import Output, ProfilePart, ReportPart, read_result

__all__ = ["DIRECTIONS", "SyntacticStats", "SyntacticResult", "Table1Row", "relation_arcs", "direction_label"]

DIRECTIONS = ("gov->dep", "dep->gov")

# The paper's names for the directions of its four relations (Voita et al. 2019, Table 1).
_PAPER_ARROWS = {
    "nsubj": ("v -> s", "s -> v"),
    "dobj": ("v -> o", "o -> v"),
    "amod": ("noun -> adj", "adj -> noun"),
    "advmod": ("v -> adv", "adv -> v"),
}


def direction_label(relation: str, direction: str) -> str:
    arrows = _PAPER_ARROWS.get(relation)
    if arrows:
        return arrows[DIRECTIONS.index(direction)]
    return "gov -> dep" if direction == "gov->dep" else "dep -> gov"


def relation_arcs(side: SideBatch, relation: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(batch index, governor, dependent)`` of every analysable arc of ``relation`` in ``side``.

    Cached on the batch, so that every block reuses it; a batch copied to a device
    (:meth:`SideBatch.to`) gets the CPU batch's arcs, moved there.
    """
    cache = side.__dict__.setdefault("_relation_arcs", {})
    if relation not in cache and side.host is not side:
        cache[relation] = tuple(x.to(side.device) for x in relation_arcs(side.host, relation))
    if relation not in cache:
        match = relation_matcher(relation)
        heads = side.heads.tolist()
        b_idx, gov, dep = [], [], []
        for b, labels in enumerate(side.deprels):
            for d, label in enumerate(labels):
                g = heads[b][d]
                if g >= 0 and match(label):
                    b_idx.append(b)
                    gov.append(g)
                    dep.append(d)
        cache[relation] = tuple(torch.tensor(x, dtype=torch.long) for x in (b_idx, gov, dep))
    return cache[relation]


def arcs_by_source(side: SideBatch, relations: tuple[str, ...]) -> tuple[list[tuple[str, str]], torch.Tensor,
                                                                          torch.Tensor, torch.Tensor, torch.Tensor,
                                                                          torch.Tensor, list[int]]:
    """Every arc of :func:`relation_arcs` for each of ``relations`` in both directions (``gov->dep``,
    ``dep->gov``), ordered by source word (stably), so that the arcs from a range of word rows are one
    slice (:func:`bisect.bisect_left` on the list of sources): ``(pairs, pair index, batch index,
    source word, target word, backward, sources)``, ``pairs`` the ``(relation, direction)`` of each
    pair index, ``backward`` whether the target comes before the source. Cached on the batch."""
    cache = side.__dict__.setdefault("_arcs_by_source", {})
    if relations not in cache:
        pairs: list[tuple[str, str]] = []
        parts: list[tuple[torch.Tensor, ...]] = []
        for relation in relations:
            arcs_b, gov, dep = relation_arcs(side, relation)
            for direction, source, target in (("gov->dep", gov, dep), ("dep->gov", dep, gov)):
                parts.append((torch.full_like(arcs_b, len(pairs)), arcs_b, source, target))
                pairs.append((relation, direction))
        if not parts:  # no relation: no arc
            parts.append(tuple(torch.zeros(0, dtype=torch.long, device=side.device) for _ in range(4)))
        pair, arcs_b, source, target = (torch.cat(x) for x in zip(*parts, strict=True))
        order = torch.sort(source, stable=True).indices
        pair, arcs_b, source, target = pair[order], arcs_b[order], source[order], target[order]
        cache[relations] = (pairs, pair, arcs_b, source, target, target < source, source.tolist())
    return cache[relations]


def relation_list(text: str) -> tuple[str, ...]:
    """``--relations``: a comma list of relations; an empty one (``","``) is a usage error, not
    the paper's four (the default is what the option's absence gives)."""
    try:
        return comma_list(text, "--relations")
    except HeadlabError:  # argparse's usage error (exit 2, "argument --relations: ...") for what its type refuses
        raise argparse.ArgumentTypeError(f"an empty list ({text!r}); give one or more comma-separated relations") \
            from None


@dataclass(frozen=True)
class SyntacticOptions:
    """The options of the syntactic statistic; an unknown relation is refused when they are made
    (:func:`headlab.functions.registry.check_options`: before any work)."""

    relations: tuple[str, ...] = option(PAPER_RELATIONS, "comma-separated dependency relations (dobj = UD obj; X:* = X "
                                        "and its subtypes; default: nsubj,dobj,amod,advmod)", type=relation_list,
                                        flag="relations")
    margin: float = option(0.10, "accuracy over the offset baseline for a syntactic head", range="[0, 1]",
                           flag="syntactic_margin")

    def __post_init__(self) -> None:
        for relation in self.relations:
            try:
                relation_matcher(relation)
            except HeadlabError as error:
                raise HeadlabError(f"--relations: {error}") from None


class SyntacticStats:
    """Streaming arc accuracies per head and relative-offset baselines per relation."""

    def __init__(self, relations=PAPER_RELATIONS, margin: float = 0.10) -> None:
        self.margin = margin
        self.relations = tuple(dict.fromkeys(relations))
        for relation in self.relations:
            relation_matcher(relation)  # fail early on a bad name
        # kind -> (relation, direction) -> Counter of offsets (model independent)
        self.offsets: dict[str, dict[tuple[str, str], Counter]] = {}
        # block -> (relation, direction) -> hits [n_heads]
        self.hits: dict[BlockKey, dict[tuple[str, str], torch.Tensor]] = {}
        self._totals: dict[BlockKey, torch.Tensor] = {}  # block -> [pairs, H], whose rows are hits[block]'s values

    @classmethod
    def from_config(cls, config, frequencies=None, options: SyntacticOptions | None = None) -> "SyntacticStats | None":
        """When ``config.functions`` (registry entry ``syntactic``)."""
        options = options or SyntacticOptions()
        return cls(options.relations, options.margin) if config.functions else None

    def update_side(self, kind: str, side: SideBatch) -> None:
        """Baseline counts; call once per batch for each analysed kind."""
        table = self.offsets.setdefault(kind, {})
        for relation in self.relations:
            _, gov, dep = relation_arcs(side, relation)
            forward = (dep - gov).tolist()
            table.setdefault((relation, "gov->dep"), Counter()).update(forward)
            table.setdefault((relation, "dep->gov"), Counter()).update(-x for x in forward)

    fused_passes = ("word_max",)
    """The passes :meth:`update` reads from a :class:`~headlab.data.fused.FusedView`: the word maxima."""

    def update_fused(self, view: AttentionView) -> None:
        self.update(view)

    def update(self, view: AttentionView) -> None:
        argmax = view.word_argmax  # [B, H, word rows]
        first, stop = view.word_start, view.word_stop
        table = self.hits.setdefault(view.block.key, {})
        pairs, pair, arcs_b, arcs_source, arcs_target, backward, sources = arcs_by_source(view.side, self.relations)
        # the arcs from this view's word rows, every relation and direction: a slice of the arcs ordered by source
        rows = slice(bisect_left(sources, first), bisect_left(sources, stop))
        b, source, target = arcs_b[rows], arcs_source[rows], arcs_target[rows]
        hit = argmax[b, :, source - first] == target[:, None]  # [n_arcs, H]
        if view.causal:  # only backward arcs are reachable (and scored)
            hit &= backward[rows, None]
        # [pairs, H]: the block's hits of each (relation, direction), whose rows are the table's entries
        # (one addition per chunk, not one per pair)
        total = self._totals.get(view.block.key)
        if total is None:
            H = argmax.shape[1]
            total = torch.stack([table[k] if k in table else argmax.new_zeros(H, dtype=torch.long) for k in pairs]) \
                if pairs else argmax.new_zeros(0, H, dtype=torch.long)
            self._totals[view.block.key] = total
            table.update(zip(pairs, total, strict=True))
        total.index_add_(0, pair[rows], hit.long())

    def reduce(self, shard) -> None:
        """Add the other processes' offset counts and hits (:mod:`headlab.shard`)."""
        self.offsets, self.hits = shard.sum((self.offsets, self.hits))
        self._totals = {}  # the sums are new tensors: a later update starts from them

    def result(self, margin: float | None = None, model: str = "", signature: dict | None = None) -> "SyntacticResult":
        return SyntacticResult(
            relations=self.relations,
            offsets={kind: {k: dict(c) for k, c in t.items()} for kind, t in self.offsets.items()},
            hits={key: {k: v.cpu().numpy().astype(np.int64) for k, v in t.items()} for key, t in self.hits.items()},
            margin=self.margin if margin is None else margin,
            model=model,
            signature=dict(signature or {}),
        )


@dataclass(frozen=True)
class Table1Row:
    """One row of the Table 1 analogue: a relation in one direction, for one attention kind."""

    kind: str
    relation: str
    direction: str
    n_arcs: int
    baseline_offset: int | None
    baseline: float | None
    best_head: tuple[int, int] | None  # (layer, head)
    best_accuracy: float | None
    n_syntactic: int
    n_scored: int | None = None
    """Arcs scored: the reachable ones under a causal mask, else all ``n_arcs``."""
    unreachable: bool = False
    """Causal attention, most arcs point forward: not scored."""

    @property
    def label(self) -> str:
        return direction_label(self.relation, self.direction)

    @property
    def absent(self) -> bool:
        return self.n_arcs == 0

    @property
    def status(self) -> str:
        if self.absent:
            return "absent from the data"
        return "unreachable under causal attention" if self.unreachable else "ok"

    @property
    def arcs_text(self) -> str:
        """``n`` arcs, or ``reachable / all`` where a causal mask hides some."""
        scored = self.n_arcs if self.n_scored is None else self.n_scored
        return str(self.n_arcs) if scored == self.n_arcs else f"{scored} / {self.n_arcs}"

    def to_json(self) -> dict:
        data = dict(self.__dict__)
        data["label"] = self.label
        data["status"] = self.status
        data["arcs"] = self.arcs_text
        return data


@dataclass(frozen=True)
class SyntacticResult:
    relations: tuple[str, ...]
    offsets: dict[str, dict[tuple[str, str], dict[int, int]]]
    hits: dict[BlockKey, dict[tuple[str, str], np.ndarray]]
    margin: float = 0.10
    model: str = ""
    signature: dict = field(default_factory=dict)

    def renumbered(self, numbering: Numbering) -> "SyntacticResult":
        """A pruned model's heads by their original index; a removed head's hits are NaN (no accuracy)."""
        pairs = list(dict.fromkeys(pair for table in self.hits.values() for pair in table))
        by_pair = {pair: to_original({key: table[pair].astype(np.float64) for key, table in self.hits.items()
                                      if pair in table}, numbering, np.nan) for pair in pairs}
        keys = list(dict.fromkeys(key for values in by_pair.values() for key in values))
        return replace(self, hits={key: {pair: by_pair[pair][key] for pair in pairs if key in by_pair[pair]}
                                   for key in keys})

    def all_arcs(self, kind: str, relation: str, direction: str) -> int:
        """Every arc of the relation in the data, reachable or not."""
        return int(sum(self.offsets.get(kind, {}).get((relation, direction), {}).values()))

    def _scored_offsets(self, kind: str, relation: str, direction: str) -> dict[int, int]:
        counts = self.offsets.get(kind, {}).get((relation, direction), {})
        if kind in CAUSAL_KINDS:  # offset = target - source: only backward targets are visible
            return {offset: n for offset, n in counts.items() if offset < 0}
        return counts

    def unreachable(self, kind: str, relation: str, direction: str) -> bool:
        """Causal attention and most of the direction's arcs point forward (out of reach)."""
        total = self.all_arcs(kind, relation, direction)
        reachable = sum(self._scored_offsets(kind, relation, direction).values())
        return kind in CAUSAL_KINDS and total > 0 and 2 * reachable < total

    def n_arcs(self, kind: str, relation: str, direction: str) -> int:
        """The arcs scored: all of them, or under a causal mask the reachable ones (0 for an
        unreachable direction)."""
        if self.unreachable(kind, relation, direction):
            return 0
        return int(sum(self._scored_offsets(kind, relation, direction).values()))

    def baseline(self, kind: str, relation: str, direction: str) -> tuple[int | None, float | None]:
        """The relation's most frequent (reachable) relative offset and the accuracy of always
        guessing it; ``(None, None)`` when nothing is scored."""
        counts = self._scored_offsets(kind, relation, direction)
        total = self.n_arcs(kind, relation, direction)
        if not total:
            return None, None
        offset = max(sorted(counts), key=lambda o: counts[o])  # ties: the leftmost offset
        return int(offset), counts[offset] / total

    def accuracy(self, relation: str, direction: str) -> HeadScores:
        """Per head: share of the relation's arcs where its maximum lands on the other word."""
        values = {}
        for (kind, layer), table in self.hits.items():
            n = self.n_arcs(kind, relation, direction)
            hits = table.get((relation, direction))
            if hits is not None:
                values[(kind, layer)] = hits / n if n else np.full(len(hits), np.nan)
        return head_scores(values, f"syntactic_{relation}_{direction}", self.model,
                           {**self.signature, "relation": relation, "direction": direction})

    def margin_over_baseline(self) -> HeadScores:
        """Per head: the largest accuracy - baseline over all relations and directions."""
        best: dict[BlockKey, np.ndarray] = {}
        for relation in self.relations:
            for direction in DIRECTIONS:
                scores = self.accuracy(relation, direction)
                for kind in scores.kinds:
                    _, base = self.baseline(kind, relation, direction)
                    if base is None:
                        continue
                    for layer, row in enumerate(scores[kind]):
                        gain = row - base
                        key = (kind, layer)
                        best[key] = gain if key not in best else np.fmax(best[key], gain)
        return head_scores(best, "syntactic_margin", self.model, self.signature)

    def table(self) -> list[Table1Row]:
        """The Table 1 analogue: best head and baseline per kind, relation and direction."""
        rows = []
        kinds = sorted({kind for kind, _ in self.hits} | set(self.offsets))
        for kind in kinds:
            for relation in self.relations:
                for direction in DIRECTIONS:
                    n_all = self.all_arcs(kind, relation, direction)
                    n = self.n_arcs(kind, relation, direction)
                    offset, base = self.baseline(kind, relation, direction)
                    best_head, best_acc, n_syn = None, None, 0
                    if n:
                        scores = self.accuracy(relation, direction)
                        if kind in scores.kinds:
                            array = scores[kind]
                            flat = np.nan_to_num(array, nan=-1.0)
                            layer, head = np.unravel_index(int(flat.argmax()), flat.shape)
                            best_head, best_acc = (int(layer), int(head)), float(array[layer, head])
                            assert base is not None  # n arcs scored
                            n_syn = int(np.sum(flat >= base + self.margin - 1e-12))
                    rows.append(Table1Row(kind, relation, direction, n_all, offset, base, best_head, best_acc, n_syn,
                                          n, self.unreachable(kind, relation, direction)))
        return rows

    def syntactic_heads(self) -> list[tuple[str, int, int, str, str, float, float]]:
        """``(kind, layer, head, relation, direction, accuracy, baseline)`` for every head that
        beats the baseline by at least ``margin``."""
        found = []
        for relation in self.relations:
            for direction in DIRECTIONS:
                scores = self.accuracy(relation, direction)
                for (kind, layer, head), accuracy in scores.items():
                    _, base = self.baseline(kind, relation, direction)
                    if base is not None and accuracy >= base + self.margin - 1e-12:
                        found.append((kind, layer, head, relation, direction, accuracy, base))
        return found

    def table_markdown(self) -> str:
        lines = [
            "| kind | relation | direction | arcs | best head | accuracy | baseline (offset) | syntactic heads |",
            "|---|---|---|---:|---|---:|---:|---:|",
        ]
        for row in self.table():
            if row.absent or row.unreachable:
                lines.append(f"| {row.kind} | {row.relation} | {row.label} | {row.arcs_text} | {row.status} | | | |")
                continue
            head = format_head(row.kind, *row.best_head) if row.best_head else "-"
            accuracy = number(row.best_accuracy, ".1%") if row.best_accuracy is not None else "-"
            lines.append(
                f"| {row.kind} | {row.relation} | {row.label} | {row.arcs_text} | {head} | {accuracy} "
                f"| {number(row.baseline, '.1%')} ({row.baseline_offset:+d}) | {row.n_syntactic} |"
            )
        if any(row.kind in CAUSAL_KINDS for row in self.table()):
            lines += ["", "Causal attention (a word sees only itself and earlier words): arcs reads "
                          "\"reachable / all\"; a direction most of whose arcs point forward is unreachable and "
                          "not scored; baselines use backward offsets only."]
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "relations": list(self.relations),
            "margin": self.margin,
            "table": [row.to_json() for row in self.table()],
            "offsets": {
                kind: {f"{r}:{d}": {str(o): c for o, c in sorted(counts.items())} for (r, d), counts in t.items()}
                for kind, t in self.offsets.items()
            },
            "syntactic_heads": [
                dict(zip(("kind", "layer", "head", "relation", "direction", "accuracy", "baseline"), h))
                for h in self.syntactic_heads()
            ],
        }

    # -- the HeadStatistic result protocol (headlab.functions.statistic) ------------------------
    def write(self, directory: str | Path) -> list[Path]:
        folder = Path(directory) / "syntactic"
        paths = []
        for relation in self.relations:
            for direction in ("gov->dep", "dep->gov"):
                name = f"{relation.replace(':', '_').replace('*', 'any')}.{direction.replace('->', '-')}.json"
                paths.append(self.accuracy(relation, direction).save(folder / name))
        paths.append(self.margin_over_baseline().save(folder / "margin.json"))
        paths.append(write_json(folder / "table1.json", self.to_json(), ensure_ascii=False))
        atomic_write_text(folder / "table1.md", self.table_markdown() + "\n")
        return [*paths, folder / "table1.md"]

    def markdown(self) -> list[str]:
        return [f"## Syntactic heads (Sec. 5.2.1, Table 1 analogue), margin {self.margin:.0%} over the offset "
                "baseline", "", self.table_markdown(), ""]

    def labels(self) -> Labels:
        """``s->v``, ``v->o``, ``adj->noun``, ...: the head beats the relation's offset baseline by the
        margin (the paper's arrows for its four relations, ``rel:gov->dep`` or ``rel:dep->gov`` else)."""
        labels = empty_labels(self.margin_over_baseline())
        for kind, layer, head, relation, direction, _accuracy, _base in self.syntactic_heads():
            label = direction_label(relation, direction).replace(" ", "")
            if label in ("gov->dep", "dep->gov"):
                label = f"{relation}:{label}"
            bucket = labels.setdefault((kind, layer, head), [])
            if label not in bucket:
                bucket.append(label)
        return labels

    def summary_markdown(self) -> str:
        return self.table_markdown()

    def warnings(self) -> list[str]:
        """A relation asked for with no arc in the data: its rows of Table 1 are empty for that reason."""
        return [f"--relations {relation}: no arc of it in the data" for relation in self.relations
                if not any(sum(table.get((relation, "gov->dep"), {}).values()) for table in self.offsets.values())]

    def describe_heads(self) -> list[str]:
        return [f"syntactic   {format_head(kind, layer, head)}: {relation} {direction} {number(accuracy, '.1%')} "
                f"(baseline {number(base, '.1%')})"
                for kind, layer, head, relation, direction, accuracy, base in self.syntactic_heads()]


def _read_labels(directory: Path, read: LabelReader) -> dict[str, list[str]]:
    """``relation direction`` from ``syntactic/table1.json`` (a directory without labels.json)."""
    labels: dict[str, list[str]] = {}
    for head in (read(directory / "syntactic" / "table1.json") or {}).get("syntactic_heads", []) or []:
        labels.setdefault(f"{head['kind']}:{head['layer']}:{head['head']}", []).append(
            f"{head['relation']} {head['direction']}")
    return labels


def _read_table1(directory: Path, note: Callable[[str], None]) -> list[dict]:
    """The report's Table 1: the rows of ``functions/syntactic/table1.json``."""
    table1 = read_json_noted(directory / "functions" / "syntactic" / "table1.json", directory, note)
    return [row for row in table1.get("table", []) if isinstance(row, dict)] if isinstance(table1, dict) else []


def _table1(c: Any) -> str:
    """Table 1 in the report's functions section, its best heads linked to the viewer."""
    table1 = c.sections.get("table1") or []
    if not table1:
        return ""
    rows = []
    for r in table1:
        best = r.get("best_head")
        arcs = str(r.get("arcs", r.get("n_arcs")))  # "reachable / all" under a causal mask
        if r.get("n_arcs", 0) == 0 or r.get("unreachable"):
            rows.append([escape(str(r.get("kind"))), escape(str(r.get("relation"))), escape(str(r.get("label", ""))),
                         escape(arcs), escape(str(r.get("status") or "absent from the data")), "", "", ""])
            continue
        head = (f'<a href="#viewer" class="head-link" data-kind="{escape(str(r.get("kind")))}" data-layer="{int(best[0])}" '
                f'data-head="{int(best[1])}">L{int(best[0])} H{int(best[1])}</a>') if best else "–"
        acc, base = r.get("best_accuracy"), r.get("baseline")
        offset = r.get("baseline_offset")
        baseline = (f"{number(base, '.1%')} ({offset:+d})" if isinstance(base, (int, float)) and isinstance(offset, int)
                    else "–")
        rows.append([escape(str(r.get("kind"))), escape(str(r.get("relation"))), escape(str(r.get("label", ""))),
                     escape(arcs), head, escape(number(acc, ".1%") if isinstance(acc, (int, float)) else "–"),
                     escape(baseline),
                     escape(str(r.get("n_syntactic", "")))])
    return ('<h3>Syntactic heads (Table 1 analogue)</h3><p class="caption">Accuracy of the best head per dependency '
            'relation and direction, against the baseline of always guessing the most frequent relative offset '
            '(Voita et al. 2019, Sec. 5.2, Table 1).'
            + (' Causal attention (decoder self-attention) sees only earlier words: its arcs read "reachable / all", '
               'a direction most of whose arcs point forward is unreachable and not scored, and its baselines use '
               'backward offsets only.' if any(r.get("kind") in CAUSAL_KINDS for r in table1) else '') + '</p>'
            + html_table(["kind", "relation", "direction", "arcs", "best head", "accuracy", "baseline (offset)",
                          "syntactic heads"], rows, "table1"))


_PROFILE_KEYS = ("relation", "label", "n_arcs", "arcs", "best_head", "best_accuracy", "baseline", "baseline_offset",
                 "n_syntactic", "status")


def _profile(functions: Path, kind: str) -> dict[str, Any]:
    """A model profile's Table 1 rows of ``kind`` and the margin they were judged with."""
    table1 = read_result(functions / "syntactic" / "table1.json")
    return {"syntactic": [{key: row.get(key) for key in _PROFILE_KEYS} for row in table1["table"] if row["kind"] == kind],
            "syntactic_margin": table1["margin"]}


def _profile_cells(kind: str, entries: dict) -> list[str]:
    scored = [row for row in entries["syntactic"] if row.get("status", "ok") == "ok"]
    n_syntactic = sum(1 for row in scored if (row["n_syntactic"] or 0) > 0)
    return [f"{n_syntactic} of {len(scored)}"]


def _profile_table(kinds: Mapping[str, dict]) -> list[str]:
    """A model's Table 1 in docs/functions.md: the best head per relation and direction against its baseline."""
    lines = ["| kind | relation | direction | arcs | best head | accuracy | baseline (offset) | margin |",
             "|---|---|---|---:|---|---:|---:|---:|"]
    for kind, body in kinds.items():
        for row in body["syntactic"]:
            status, arcs = row.get("status", "ok"), row.get("arcs") or row["n_arcs"]  # "reachable / all" if causal
            if status != "ok":
                lines.append(f"| {kind} | {row['relation']} | {row['label']} | {arcs} | {status} | | | |")
                continue
            margin = row["best_accuracy"] - row["baseline"]
            lines.append(
                f"| {kind} | {row['relation']} | {row['label']} | {arcs} | {head_cell(kind, row['best_head'])} "
                f"| {percent(row['best_accuracy'])} | {percent(row['baseline'])} ({row['baseline_offset']:+d}) "
                f"| {number(100 * margin, '+.1f')} |"
            )
    return lines


SYNTACTIC = Statistic(
    SyntacticStats.from_config, original_numbering=True,
    title="syntactic", label_group="syntactic", label_pattern=r".+->.+",
    label_caption="syntactic (relation direction, e.g. s->v: from subject to verb)",
    outputs=(Output("syntactic/margin.json", "Syntactic margin",
                    "best accuracy over the relations minus the offset baseline (Sec. 5.2)"),),
    read_labels=_read_labels, report=(ReportPart("table1", "functions", _table1, collect=_read_table1),),
    Options=SyntacticOptions,
    profile=ProfilePart(_profile, ("syntactic heads (of relation-directions scored)",), _profile_cells, _profile_table))
"""Voita et al. 2019, Sec. 5.2."""
