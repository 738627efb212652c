"""Function labels per head, as in Voita et al. 2019, Fig. 1: ``positional -1``, ``s->v``, ``rare``.

:func:`head_labels` gathers what each result of a :class:`~headlab.functions.analysis.HeadAnalysis`
says about each head (through the functions package's own tests: positional threshold, syntactic
margin, rare-token head); it decides nothing itself.
"""

from __future__ import annotations

from pathlib import Path

from headlab.errors import HeadlabError
from headlab.heads import KINDS, read_json, write_json

__all__ = ["head_labels", "save_labels", "load_labels", "label_key", "function_groups", "label_group", "label_cell"]


def function_groups() -> tuple[str, ...]:
    """The rows of Figure 1's function grid and the label columns of ``heads.csv``: the label
    groups the statistics declare (:func:`headlab.functions.registry.label_groups`)."""
    from headlab.functions.registry import label_groups

    return label_groups()


def label_key(kind: str, layer: int, head: int) -> str:
    return f"{kind}:{layer}:{head}"


def label_group(label: str) -> str | None:
    """Which row of the function grid a label belongs to: the group of the statistic that declares
    it (None: no registered statistic does; the label is still in the ``functions`` column)."""
    from headlab.functions.registry import label_group as group_of

    return group_of(label)


def label_cell(label: str) -> str:
    """A label as a cell of Figure 1's grid writes it: as the statistic that declares it says
    (``positional -1`` -> ``-1``); as it is when none says."""
    from headlab.functions.registry import STATISTICS

    owner = next((s for s in STATISTICS.values() if s.owns(label)), None)
    return label if owner is None or owner.label_cell is None else owner.label_cell(label)


def head_labels(analysis) -> dict[str, list[str]]:
    """``{"kind:layer:head": [label, ...]}`` for every analysed head (an empty list: no function),
    from each result's own labels (:meth:`~headlab.functions.statistic.StatisticResult.labels`):
    ``positional +1`` / ``positional -1`` (Sec. 5.1), ``s->v``, ``v->o``, ``adj->noun``, ...
    (Sec. 5.2.1) and ``rare`` (Sec. 5.3)."""
    labels: dict[str, list[str]] = {}
    numbering = getattr(analysis, "numbering", None) or {}
    for result in analysis.results.values():
        for (kind, layer, head), names in result.labels().items():
            if (kind, layer) in numbering and head not in numbering[(kind, layer)][0]:
                continue  # removed by pruning: not analysed
            bucket = labels.setdefault(label_key(kind, layer, head), [])
            bucket += [name for name in names if name not in bucket]
    return dict(sorted(labels.items(), key=lambda item: _sort_key(item[0])))


def _sort_key(key: str) -> tuple:
    kind, layer, head = key.split(":")
    return (KINDS.index(kind) if kind in KINDS else len(KINDS), int(layer), int(head))


def save_labels(labels: dict[str, list[str]], path: str | Path) -> Path:
    return write_json(path, labels, ensure_ascii=False)


def load_labels(path: str | Path) -> dict[str, list[str]]:
    path = Path(path)
    data = read_json(path, "labels file")
    if not isinstance(data, dict) or not all(isinstance(v, list) for v in data.values()):
        raise HeadlabError(f"{path}: expected {{\"kind:layer:head\": [label, ...]}}")
    return data
