"""Layer x head heatmaps of head functions and aggregate statistics (matplotlib).

Each plotting function takes an optional ``ax`` (or ``axes``) so that figures compose; the
``save_figures`` helper writes the standard ones for a :class:`HeadAnalysis`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from headlab.heads import HeadScores, axes_or_new, pyplot, write_figure
from headlab.numbers import number

__all__ = ["plot_head_scores", "plot_function_grid", "plot_aggregate_grid", "save_figures"]


def _cell(fmt: str, value: float) -> str:
    """A cell's value written by ``fmt`` (a ``"{:SPEC}"`` template: a zero without a sign, :func:`number`)."""
    if fmt.startswith("{:") and fmt.endswith("}") and fmt.count("{") == 1:
        return number(value, fmt[2:-1])
    return fmt.format(value)


def plot_head_scores(scores: HeadScores, kind: str, ax=None, *, title: str | None = None, vmin=None, vmax=None,
                     cmap: str = "viridis", fmt: str = "{:.2f}", marks: np.ndarray | None = None):
    """One ``[n_layers, n_heads]`` heatmap, values written in the cells; ``marks`` outlines cells."""
    plt = pyplot()
    ax = axes_or_new(ax, (4, 3))
    array = scores[kind]
    image = ax.imshow(np.ma.masked_invalid(array), cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto")
    n_layers, n_heads = array.shape
    if n_layers * n_heads <= 400:
        for layer in range(n_layers):
            for head in range(n_heads):
                value = array[layer, head]
                if not np.isnan(value):
                    ax.text(head, layer, _cell(fmt, value), ha="center", va="center", fontsize=6,
                            color="white" if image.norm(value) < 0.5 else "black")
    if np.isnan(array).all():
        ax.text((n_heads - 1) / 2, (n_layers - 1) / 2, "no data", ha="center", va="center", fontsize=9)
    if marks is not None:
        for layer, head in zip(*np.nonzero(marks)):
            ax.add_patch(plt.Rectangle((head - 0.5, layer - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=1.5))
    ax.set_xticks(range(n_heads))
    ax.set_yticks(range(n_layers))
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(title or f"{scores.method} ({kind})", fontsize=8)
    ax.figure.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    return ax


def plot_function_grid(analysis, kind: str, axes=None):
    """Positional share, best syntactic margin and rare-token share side by side.

    Red outlines: heads that pass the positional threshold / the syntactic margin / the
    rare-token head(s).
    """
    plt = pyplot()
    panels: list[tuple] = []
    if analysis.positional is not None:
        share = analysis.positional.share
        if kind in share.kinds:
            panels.append((share, "max share at one offset (positional)", 0, 1,
                           share[kind] >= analysis.config.positional_threshold))
    if analysis.syntactic is not None:
        margin = analysis.syntactic.margin_over_baseline()
        if kind in margin.kinds:
            panels.append((margin, "best accuracy - baseline (syntactic)", -0.5, 0.5,
                           margin[kind] >= analysis.config.syntactic_margin, "coolwarm"))
    if analysis.rare is not None:
        rarest = analysis.rare.rarest
        if kind in rarest.kinds:
            marks = np.zeros(rarest[kind].shape, dtype=bool)
            for k, layer, head in analysis.rare.rare_heads():
                if k == kind:
                    marks[layer, head] = True
            panels.append((rarest, "max on the rarest token", 0, 1, marks))
    if axes is None:
        fig, axes = plt.subplots(1, max(len(panels), 1), figsize=(4.2 * max(len(panels), 1), 3.4), squeeze=False)
        axes = axes[0]
    if not panels:
        _no_heads(axes[0], kind)
    for ax, panel in zip(axes, panels):
        scores, title, vmin, vmax, marks = panel[:5]
        cmap = panel[5] if len(panel) > 5 else "viridis"
        plot_head_scores(scores, kind, ax, title=f"{kind}: {title}", vmin=vmin, vmax=vmax, cmap=cmap, marks=marks)
    return axes


def plot_aggregate_grid(aggregate, kind: str, axes=None, tags: tuple[str, ...] = ("NOUN", "VERB", "DET", "PUNCT")):
    """Distance, entropy, variability, dependency alignment and a few POS shares."""
    plt = pyplot()
    panels = [(aggregate.scores[name], name) for name in ("mean_distance", "mean_entropy", "variability",
                                                          "dependency_alignment")]
    panels += [(aggregate.pos[tag], f"attention on {tag}") for tag in tags if tag in aggregate.pos]
    panels = [(s, t) for s, t in panels if kind in s.kinds]
    if axes is None:
        columns = 4
        rows = max(1, (len(panels) + columns - 1) // columns)  # one row saying so when the kind has no heads
        fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.4 * rows), squeeze=False)
        axes = axes.ravel()
        for ax in axes[len(panels):]:
            ax.set_visible(False)
    for ax, (scores, title) in zip(axes, panels):
        plot_head_scores(scores, kind, ax, title=f"{kind}: {title}")
    if not panels:
        axes[0].set_visible(True)
        _no_heads(axes[0], kind)
    return axes


def _no_heads(ax, kind: str) -> None:
    """The panel of a kind whose every layer was pruned to zero heads: nothing to draw, said so."""
    ax.text(0.5, 0.5, f"{kind}: no heads (all pruned)", ha="center", va="center", fontsize=9)
    ax.set_axis_off()


def save_figures(analysis, directory: str | Path) -> list[Path]:
    """Write ``functions_<kind>.png`` and ``aggregate_<kind>.png`` for each analysed kind."""
    paths = []
    for kind in analysis.report.analysed:
        if any(r is not None for r in (analysis.positional, analysis.syntactic, analysis.rare)):
            figure = plot_function_grid(analysis, kind)[0].figure
            figure.tight_layout()
            paths.append(write_figure(figure, Path(directory) / f"functions_{kind}.png", dpi=110))
        if analysis.aggregate is not None:
            figure = plot_aggregate_grid(analysis.aggregate, kind)[0].figure
            figure.tight_layout()
            paths.append(write_figure(figure, Path(directory) / f"aggregate_{kind}.png", dpi=110))
    return paths
