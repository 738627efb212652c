"""How far each importance measure predicts ablation: Spearman rank correlation per kind.

Ablation is the ground truth (what really happens when a head is removed). For every other
measure and every attention kind, the table holds Spearman's rho between the measure's
scores and the ablation scores over the heads of that kind, plus a pooled row over all
heads. Ties get average ranks; heads that either table leaves NaN are skipped.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from headlab.errors import HeadlabError, counted
from headlab.heads import (
    KINDS,
    UNRECORDED_DTYPE,
    HeadScores,
    atomic_write_text,
    dtype_recorded,
    measured_dtype,
    write_json,
)
from headlab.numbers import number

__all__ = ["AgreementTable", "compute_agreement", "spearman", "top_share"]


def spearman(a, b) -> float:
    """Spearman's rho of two equally long vectors (NaN pairs dropped; NaN if undefined): the
    Pearson correlation of their ranks, ties averaged (scipy.stats.spearmanr)."""
    a, b = np.asarray(a, dtype=np.float64).ravel(), np.asarray(b, dtype=np.float64).ravel()
    if a.shape != b.shape:
        raise HeadlabError(f"cannot correlate {a.size} scores with {b.size}")
    keep = ~(np.isnan(a) | np.isnan(b))
    a, b = a[keep], b[keep]
    if a.size < 2 or (a == a[0]).all() or (b == b[0]).all():
        return math.nan  # undefined; spearmanr would say so with a warning
    from scipy.stats import spearmanr  # lazy: scipy.stats takes ~0.7 s to import

    return float(spearmanr(a, b).statistic)


@dataclass(frozen=True)
class AgreementTable:
    """``rho[method][column]`` with columns the attention kinds plus ``"all"``."""

    rho: Mapping[str, Mapping[str, float]]
    n_heads: Mapping[str, int]
    reference: str = "ablation"
    metric: str = ""

    @property
    def columns(self) -> list[str]:
        return list(self.n_heads)

    def __repr__(self) -> str:
        rows = ", ".join(f"{m} {number(row.get('all', math.nan), '+.2f')}" for m, row in self.rho.items())
        return f"AgreementTable(Spearman with {self.reference} ({self.metric}) over all heads: {rows})"

    def to_json(self) -> dict:
        clean = lambda v: None if v is None or math.isnan(v) else round(float(v), 6)  # noqa: E731
        return {
            "reference": self.reference,
            "metric": self.metric,
            "n_heads": dict(self.n_heads),
            "spearman": {m: {c: clean(v) for c, v in row.items()} for m, row in self.rho.items()},
        }

    def to_markdown(self) -> str:
        header = "| measure | " + " | ".join(f"{c} ({counted(self.n_heads[c], 'head')})" for c in self.columns) + " |"
        lines = [header, "|---|" + "---:|" * len(self.columns)]
        for method, row in self.rho.items():
            cells = ["n/a" if math.isnan(row.get(c, math.nan)) else number(row[c], "+.2f") for c in self.columns]
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
        return "\n".join(lines) + "\n"

    def best(self, column: str = "all") -> str | None:
        """The measure that agrees best with the ground truth in ``column``; None when none agrees
        (no correlation above 0: the least negative one predicts nothing)."""
        candidates = [(row.get(column, math.nan), m) for m, row in self.rho.items()]
        candidates = [(v, m) for v, m in candidates if not math.isnan(v) and v > 0]
        return max(candidates)[1] if candidates else None

    def save(self, directory: str | os.PathLike) -> tuple[Path, Path]:
        directory = Path(directory)
        json_path, md_path = directory / "agreement.json", directory / "agreement.md"
        write_json(json_path, self.to_json())
        text = (
            f"Spearman rank correlation with {self.reference}"
            + (f" ({self.metric})" if self.metric else "")
            + ", per attention kind\n\n" + self.to_markdown()
        )
        atomic_write_text(md_path, text)
        return json_path, md_path


# What a table's signature says about the sentences it was measured on: two tables that differ in one of these were
# measured on other data (other sentences, or cut at another length), and their correlation is no agreement.
_SAME_DATA = {"n_sentences": "sentences", "n_source_tokens": "source tokens", "max_length": "max_length"}


_UNKNOWN = object()


def _mask(signature) -> object:
    """The heads masked while a table was measured: its ``options.mask`` (an importance table; none: the whole
    model); a head-pass table (``spacing``): none, the head functions refuse a gated model; else unknown."""
    options = signature.get("options")
    if isinstance(options, dict):
        return options.get("mask") or None
    return None if "spacing" in signature else _UNKNOWN


def _other_data(name: str, scores: HeadScores, reference: HeadScores) -> None:
    differ = [f"{what} {scores.signature[key]} (the reference's: {reference.signature[key]})"
              for key, what in _SAME_DATA.items()
              if key in scores.signature and key in reference.signature and scores.signature[key] != reference.signature[key]]
    if differ:
        raise HeadlabError(f"agreement: {name} and {reference.method} were measured on other data ({'; '.join(differ)}): "
                           "compute the measures on the same sentences")
    # The weights' dtype (--dtype) and the heads masked while measuring (signature options, headlab.importance's
    # pipeline): a bfloat16 table against a float32 one, or a masked model's against the whole model's, compares
    # two other computations head by head.
    # A head-pass table (functions, aggregate) says its dtype too (measured_dtype; an older importance table: none).
    dtype, reference_dtype = measured_dtype(scores.signature), measured_dtype(reference.signature)
    other = []
    if dtype is not None and reference_dtype is not None and dtype != reference_dtype:
        # a side whose signature has no dtype is read as float32 (a head-pass table): said, as one_dtype says it
        unsaid = [side for side, signature in ((name, scores.signature), (reference.method, reference.signature))
                  if not dtype_recorded(signature)]
        note = f"; {unsaid[0]} {UNRECORDED_DTYPE}" if unsaid else ""
        other.append(f"weights' dtype {dtype} (the reference's: {reference_dtype}{note})")
    ours, theirs = _mask(scores.signature), _mask(reference.signature)
    if ours is not _UNKNOWN and theirs is not _UNKNOWN and ours != theirs:
        other.append(f"heads masked {ours or 'none'} (the reference's: {theirs or 'none'})")
    if other:
        raise HeadlabError(f"agreement: {name} and {reference.method} were measured on other weights "
                           f"({'; '.join(other)}): compute the measures in one run")


def _other_model(name: str, scores: HeadScores, reference: HeadScores) -> None:
    """Tables of two models correlate heads that are not the same heads (head h of layer l is another head in each):
    refused when their models are local directories with other weights, and where their head grids differ; a
    warning where only their names differ (the weights of either cannot be read: :func:`headlab.resume.other_model`)."""
    from headlab.resume import other_model

    other = other_model(scores.model, reference.model)
    grids = [kind for kind in scores.scores if kind in reference.scores and scores[kind].shape != reference[kind].shape]
    if other is None and not grids:
        return
    models = f"{name} was measured on {scores.model or 'an unnamed model'} and {reference.method} on " \
             f"{reference.model or 'an unnamed model'}"
    if other == "":
        raise HeadlabError(f"agreement: {models}, models whose weights differ: their heads are not the same heads; "
                           "compute the measures on the same model")
    if grids:
        kind = grids[0]
        raise HeadlabError(f"agreement: {models}, tables of other head grids: {name} scores {kind} as "
                           f"{scores[kind].shape}, {reference.method} as {reference[kind].shape}; compute the measures "
                           "on the same model")
    import warnings

    warnings.warn(f"agreement: {models} ({other}): if they are other models, their heads are "
                  "not the same heads and the correlation is no agreement", UserWarning, stacklevel=3)


def compute_agreement(measures: Mapping[str, HeadScores], reference: HeadScores) -> AgreementTable:
    """Spearman's rho of each measure against ``reference`` (ablation), per kind and pooled. Tables measured on other
    data (their signatures' sentence or token counts or max_length differ) are refused, and so are tables of other
    models (the tables' ``model``: local directories with other weights, or other head grids), naming both; tables
    whose models are only named differently (a hub name, a directory moved since: the weights cannot be compared) give
    a warning."""
    for name, scores in measures.items():
        _other_data(name, scores, reference)
        _other_model(name, scores, reference)
    kinds = [k for k in KINDS if k in reference.scores]
    rho: dict[str, dict[str, float]] = {}
    n_heads = {kind: int((~np.isnan(reference[kind])).sum()) for kind in kinds}
    n_heads["all"] = sum(n_heads.values())
    for name, scores in measures.items():
        row: dict[str, float] = {}
        pooled_a, pooled_b = [], []
        for kind in kinds:
            if kind not in scores.scores:
                row[kind] = math.nan
                continue
            a, b = scores[kind], reference[kind]  # of one grid: _other_model
            row[kind] = spearman(a, b)
            pooled_a.append(a.ravel())
            pooled_b.append(b.ravel())
        row["all"] = spearman(np.concatenate(pooled_a), np.concatenate(pooled_b)) if pooled_a else math.nan
        rho[name] = row
    return AgreementTable(rho, n_heads, reference.method, str(reference.signature.get("metric", "")))


def top_share(scores: HeadScores, top: int = 1) -> dict[str, np.ndarray]:
    """Per kind and layer, the share of the ``top`` largest |scores| in the layer's sum of |scores|.

    With ``n`` heads, heads of equal weight give ``top / n``; a value near 1 means that a few
    heads dominate the layer (Voita et al. 2019, Sec. 4, on LRP).
    """
    out = {}
    for kind, array in scores.scores.items():
        magnitude = np.abs(np.nan_to_num(array))
        total = magnitude.sum(axis=1)
        largest = -np.sort(-magnitude, axis=1)[:, :top].sum(axis=1)
        out[kind] = np.where(total == 0, np.nan, largest / np.where(total == 0, 1, total))
    return out
