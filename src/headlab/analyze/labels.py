"""Function labels per head, as in Voita et al. 2019, Fig. 1: ``positional -1``, ``s->v``, ``rare``.

:func:`head_labels` reads a :class:`~headlab.functions.analysis.HeadAnalysis` through the
functions package's own tests (positional threshold, syntactic margin, rare-token head) and
names what each head does; it decides nothing itself.
"""

from __future__ import annotations

import json
from pathlib import Path

from headlab.errors import HeadlabError
from headlab.functions.syntactic import direction_label
from headlab.heads import atomic_write_text, read_json

__all__ = ["head_labels", "save_labels", "load_labels", "label_key", "FUNCTION_GROUPS", "label_group"]

FUNCTION_GROUPS = ("positional", "syntactic", "rare")
"""The rows of Figure 1's function grid."""


def label_key(kind: str, layer: int, head: int) -> str:
    return f"{kind}:{layer}:{head}"


def label_group(label: str) -> str:
    """Which row of the function grid a label belongs to."""
    if label.startswith("positional"):
        return "positional"
    if label == "rare":
        return "rare"
    return "syntactic"


def head_labels(analysis) -> dict[str, list[str]]:
    """``{"kind:layer:head": [label, ...]}`` for every analysed head (an empty list: no function).

    * ``positional +1`` / ``positional -1``: one offset holds at least the positional threshold
      of the head's maxima (Sec. 5.1); the number is the offset;
    * ``s->v``, ``v->o``, ``adj->noun``, ...: the head beats the relation's offset baseline by the
      syntactic margin (Sec. 5.2.1; the paper's arrows for its four relations, ``rel:gov->dep``
      or ``rel:dep->gov`` for others);
    * ``rare``: the head whose maximum lands on the rarest token most often (Sec. 5.3).
    """
    labels: dict[str, list[str]] = {}
    sources = [r for r in (analysis.positional, analysis.syntactic, analysis.rare) if r is not None]
    for result in sources:  # every analysed head gets a key
        scores = result.share if result is analysis.positional else (
            result.margin_over_baseline() if result is analysis.syntactic else result.rarest)
        for kind in scores.kinds:
            n_layers, n_heads = scores[kind].shape
            for layer in range(n_layers):
                for head in range(n_heads):
                    labels.setdefault(label_key(kind, layer, head), [])
    if analysis.positional is not None:
        for h in analysis.positional.heads():
            labels.setdefault(label_key(h.kind, h.layer, h.head), []).append(f"positional {h.offset:+d}")
    if analysis.syntactic is not None:
        for kind, layer, head, relation, direction, _accuracy, _base in analysis.syntactic.syntactic_heads():
            label = direction_label(relation, direction).replace(" ", "")
            if label in ("gov->dep", "dep->gov"):
                label = f"{relation}:{label}"
            bucket = labels.setdefault(label_key(kind, layer, head), [])
            if label not in bucket:
                bucket.append(label)
    if analysis.rare is not None:
        for kind, layer, head in analysis.rare.rare_heads():
            labels.setdefault(label_key(kind, layer, head), []).append("rare")
    return dict(sorted(labels.items(), key=lambda item: _sort_key(item[0])))


def _sort_key(key: str) -> tuple:
    from headlab.heads import KINDS

    kind, layer, head = key.split(":")
    return (KINDS.index(kind) if kind in KINDS else len(KINDS), int(layer), int(head))


def save_labels(labels: dict[str, list[str]], path: str | Path) -> Path:
    path = Path(path)
    atomic_write_text(path, json.dumps(labels, indent=1, ensure_ascii=False) + "\n")
    return path


def load_labels(path: str | Path) -> dict[str, list[str]]:
    path = Path(path)
    data = read_json(path, "labels file")
    if not isinstance(data, dict) or not all(isinstance(v, list) for v in data.values()):
        raise HeadlabError(f"{path}: expected {{\"kind:layer:head\": [label, ...]}}")
    return data
