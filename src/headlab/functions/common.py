"""Helpers shared by the streaming statistics: per-block counters and HeadScores assembly.

Every statistic keeps, per attention block ``(kind, layer)``, small tensors indexed by head
(``[n_heads, ...]``) that grow with the number of heads and bins, never with the number of
sentences. At the end they become :class:`~headlab.heads.HeadScores` (``[n_layers, n_heads]``
per kind; NaN where a block has fewer heads or was not analysed).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from headlab.heads import KINDS, HeadScores

__all__ = ["BlockKey", "head_scores", "format_head"]

BlockKey = tuple[str, int]


def head_scores(
    per_block: Mapping[BlockKey, np.ndarray],
    method: str,
    model: str = "",
    signature: Mapping[str, object] | None = None,
) -> HeadScores:
    """Assemble ``{(kind, layer): values [n_heads]}`` into one HeadScores."""
    shapes: dict[str, tuple[int, int]] = {}
    for (kind, layer), values in per_block.items():
        n_layers, n_heads = shapes.get(kind, (0, 0))
        shapes[kind] = (max(n_layers, layer + 1), max(n_heads, len(values)))
    scores = {}
    for kind in KINDS:
        if kind not in shapes:
            continue
        array = np.full(shapes[kind], np.nan)
        for (k, layer), values in per_block.items():
            if k == kind:
                array[layer, : len(values)] = np.asarray(values, dtype=np.float64)
        scores[kind] = array
    return HeadScores(scores, method, model, dict(signature or {}))


def format_head(kind: str, layer: int, head: int) -> str:
    """Human-readable head name, 0-based like every headlab index: ``enc_self L2 H4``."""
    return f"{kind} L{layer} H{head}"
