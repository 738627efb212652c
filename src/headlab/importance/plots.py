"""Heatmaps of HeadScores: one panel per attention kind, layers down, heads across."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from headlab.heads import HeadScores, panel_row, write_figure

__all__ = ["plot_heatmap", "save_heatmap"]


def plot_heatmap(scores: HeadScores, axes=None, *, title: str | None = None, cmap: str | None = None):
    """Draw ``scores`` on ``axes`` (one per kind; created when None). Returns the figure."""
    kinds = scores.kinds
    fig, axes = panel_row(axes, len(kinds), (3.4 * len(kinds) + 1.0, 3.6))
    finite = np.concatenate([a[~np.isnan(a)].ravel() for a in scores.scores.values()] or [np.zeros(1)])
    signed = finite.size and finite.min() < 0 < finite.max()
    if signed:
        bound = float(np.abs(finite).max()) or 1.0
        vmin, vmax, cmap = -bound, bound, cmap or "RdBu_r"
    else:
        vmin, vmax, cmap = float(finite.min()), float(finite.max()), cmap or "Blues"
    image = None
    for i, (ax, kind) in enumerate(zip(axes, kinds)):
        array = scores[kind]
        image = ax.imshow(array, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto")
        ax.set_title(kind)
        ax.set_xlabel("head")
        if i == 0:
            ax.set_ylabel("layer")
        ax.set_xticks(range(array.shape[1]))
        ax.set_yticks(range(array.shape[0]))
    if image is not None:
        fig.colorbar(image, ax=list(axes), shrink=0.85)
    fig.suptitle(title or scores.method)
    return fig


def save_heatmap(scores: HeadScores, path: str | os.PathLike, **kwargs) -> Path:
    return write_figure(plot_heatmap(scores, **kwargs), path, dpi=110, bbox_inches="tight")
