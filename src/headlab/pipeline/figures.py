"""The figures of an analysis: the paper's Figure 1, heatmaps, the pruning curve, gate trajectories.

Every ``plot_*`` function takes an optional ``ax`` / ``axes`` (so figures compose) and returns
``(figure, data)``: ``data`` is the plain-Python content drawn (lists and floats, NaN as None),
so that tests compare data, not pixels. Nothing here is random: the same files give the same
data and byte-identical SVG (``Date`` metadata removed, a fixed ``svg.hashsalt``).

:func:`write_figures` reads an analysis directory (HeadScores files, ``functions/labels.json``,
``prune/sweep.json`` and the sweep points' ``trajectory.jsonl``), so any analysis can be
re-plotted without re-running it, and writes ``figures/<name>.png`` and ``.svg``.
"""

from __future__ import annotations

import json
import math
import warnings
from functools import partial
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from headlab.data.batching import with_progress
from headlab.functions.registry import STATISTICS
from headlab.heads import KINDS, HeadScores, axes_or_new, panel_row, pyplot, write_figure, write_json
from headlab.importance.registry import MEASURES
from headlab.pipeline.labels import function_groups, label_cell, label_group, label_key, load_labels
from headlab.plugins import WRITTEN_UNDER

__all__ = [
    "figure1_data",
    "plot_figure1",
    "plot_scores_heatmap",
    "plot_pruning_curve",
    "plot_heads_kept",
    "plot_gate_trajectories",
    "save_figure",
    "write_figures",
]

_SVG_SALT = "headlab"


def _clean(value: float) -> float | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)


# ----------------------------------------------------------------------------- Figure 1

FIGURE1_COLUMNS = 8  # layers per band of Figure 1: more wrap into further bands


def figure1_data(relevance: HeadScores | None, confidence: HeadScores | None,
                 labels: Mapping[str, list[str]], kind: str = "enc_self") -> dict:
    """Per layer: heads sorted by LRP relevance (descending; by confidence without LRP), their
    relevance, confidence and function labels (Voita et al. 2019, Fig. 1)."""
    order_by = relevance if relevance is not None and kind in relevance.kinds else confidence
    if order_by is None or kind not in order_by.kinds:
        raise ValueError(f"Figure 1 needs LRP relevance or confidence for {kind}")
    n_layers, n_heads = order_by[kind].shape
    layers = []
    for layer in range(n_layers):
        key = np.nan_to_num(order_by[kind][layer], nan=-np.inf)
        heads = [int(h) for h in np.argsort(-key, kind="stable")]

        def values(scores):
            if scores is None or kind not in scores.kinds:
                return None
            return [_clean(float(scores[kind][layer, h])) for h in heads]  # noqa: B023 (called in this iteration)

        layers.append({
            "layer": layer,
            "heads": heads,
            "relevance": values(relevance),
            "confidence": values(confidence),
            "labels": [list(labels.get(label_key(kind, layer, h), [])) for h in heads],
        })
    return {"kind": kind, "sorted_by": "lrp" if order_by is relevance else "confidence",
            "n_heads": n_heads, "layers": layers, "groups": list(function_groups())}


def plot_figure1(relevance: HeadScores | None, confidence: HeadScores | None,
                 labels: Mapping[str, list[str]], kind: str = "enc_self", axes=None):
    """Voita et al. 2019, Fig. 1: for each layer (columns), LRP relevance and confidence of its
    heads (bars, heads sorted by relevance within the layer) and the function grid below (a row
    per label group the statistics declare), each function named in its cell as its statistic writes it.

    ``axes``: a ``[3, n_layers]`` array of axes (created when None: more than
    :data:`FIGURE1_COLUMNS` layers wrap into bands of at most that many, so that 24 or 32 layers
    stay readable). Returns ``(figure, data)``.
    """
    plt = pyplot()
    data = figure1_data(relevance, confidence, labels, kind)
    n_layers, n_heads = len(data["layers"]), data["n_heads"]
    if axes is None:
        bands = -(-n_layers // FIGURE1_COLUMNS)
        columns = -(-n_layers // bands)  # the layers spread evenly over the bands
        fig, grid = plt.subplots(3 * bands, columns, figsize=(max(2.1 * columns, 6), 5.2 * bands), squeeze=False,
                                 gridspec_kw={"height_ratios": [1.0, 1.0, 0.9] * bands}, layout="constrained")
        axes = np.empty((3, n_layers), dtype=object)
        for layer in range(n_layers):
            band, column = divmod(layer, columns)
            axes[:, layer] = grid[3 * band:3 * band + 3, column]
        for cell in range(n_layers, bands * columns):  # the last band's empty places
            band, column = divmod(cell, columns)
            for ax in grid[3 * band:3 * band + 3, column]:
                ax.set_axis_off()
    else:
        axes = np.asarray(axes).reshape(3, n_layers)
        fig = axes[0, 0].figure
        columns = n_layers
    def limits(field: str) -> tuple[float, float]:
        # One scale per row, so layers compare; relevance can be negative (normalised by |sum|).
        values = [v for ly in data["layers"] for v in (ly[field] or []) if v is not None] or [0.0]
        low, high = min(min(values), 0.0), max(max(values), 0.0)
        pad = 0.08 * ((high - low) or 1.0)
        return low - (pad if low < 0 else 0.0), high + pad

    x = np.arange(n_heads)
    for column, layer in enumerate(data["layers"]):
        ax_r, ax_c, ax_f = axes[0, column], axes[1, column], axes[2, column]
        for ax, field, color, name in ((ax_r, "relevance", "tab:red", "LRP relevance"),
                                       (ax_c, "confidence", "tab:blue", "confidence")):
            values = layer[field]
            if values is None:
                ax.text(0.5, 0.5, "not computed", ha="center", va="center", transform=ax.transAxes, fontsize=7)
            else:
                ax.bar(x, [np.nan if v is None else v for v in values], color=color, width=0.8)
                ax.axhline(0, color="black", linewidth=0.5)
            ax.set_ylim(*limits(field))
            ax.set_xticks(x, [str(h) for h in layer["heads"]], fontsize=6)
            ax.tick_params(axis="y", labelsize=6)
            if column % columns == 0:  # the first layer of each band
                ax.set_ylabel(name, fontsize=7)
        ax_r.set_title(f"layer {layer['layer']}", fontsize=8)
        groups = list(data["groups"])
        grid = np.zeros((len(groups), n_heads))
        for i, head_labels in enumerate(layer["labels"]):
            texts: dict[str, list[str]] = {}
            for label in head_labels:
                group = label_group(label)
                if group is not None and group in groups:  # else no statistic declares it: heads.csv only
                    texts.setdefault(group, []).append(label_cell(label))
            for group, names in texts.items():
                row = groups.index(group)
                grid[row, i] = 1.0
                ax_f.text(i, row, "\n".join(names), ha="center", va="center", fontsize=5, rotation=90
                          if max(len(n) for n in names) > 4 else 0)
        ax_f.imshow(grid, cmap="Greens", vmin=0, vmax=2.2, aspect="auto")
        ax_f.set_xticks(x, [str(h) for h in layer["heads"]], fontsize=6)
        ax_f.set_yticks(range(len(groups)), groups if column % columns == 0 else [""] * len(groups), fontsize=7)
        ax_f.set_xlabel("head", fontsize=7)
    fig.suptitle(f"{kind}: heads per layer sorted by {'LRP relevance' if data['sorted_by'] == 'lrp' else 'confidence'}"
                 " (Voita et al. 2019, Fig. 1)", fontsize=9)
    return fig, data


# ----------------------------------------------------------------------------- heatmaps


def plot_scores_heatmap(scores: HeadScores, axes=None, *, title: str | None = None):
    """A Vig & Belinkov-style layer x head heatmap per attention kind (one panel per kind);
    drawn by :func:`headlab.importance.plots.plot_heatmap`. Returns ``(figure, data)``."""
    pyplot()
    from headlab.importance.plots import plot_heatmap

    fig = plot_heatmap(scores, axes, title=title)
    data = {"method": scores.method,
            "scores": {kind: [[_clean(v) for v in row] for row in scores[kind].tolist()] for kind in scores.kinds}}
    return fig, data


# ----------------------------------------------------------------------------- pruning


def _pruned_kind(rows: list[dict]) -> str:
    """The kind whose head count changes along the sweep (the gated kind)."""
    present = [k for k in KINDS if any(r.get(k) is not None for r in rows)]
    for kind in present:
        if len({r.get(kind) for r in rows if r.get(kind) is not None}) > 1:
            return kind
    return present[0] if present else "enc_self"


def plot_pruning_curve(rows: list[dict], kind: str | None = None, ax=None):
    """BLEU against the number of retained heads of ``kind`` (Voita et al. 2019, Fig. 7), drawn
    by :func:`headlab.pruning.sweep.plot_bleu_vs_heads`. Returns ``(figure, data)``."""
    pyplot()
    from headlab.pruning.sweep import plot_bleu_vs_heads

    kind = kind or _pruned_kind(rows)
    ax = axes_or_new(ax, layout="constrained")
    plot_bleu_vs_heads(rows, kind=kind, ax=ax)
    ax.set_title(f"BLEU against retained {kind} heads (short gate sweep)", fontsize=9)
    points = sorted((r[kind], r["bleu"]) for r in rows
                    if r.get(kind) is not None and r.get("bleu") is not None and r["point"] != "full")
    full = next((r for r in rows if r["point"] == "full"), None)
    data = {"kind": kind, "points": [[int(h), float(b)] for h, b in points],
            "full": None if full is None or full.get("bleu") is None else [full.get(kind), float(full["bleu"])]}
    return ax.figure, data


def plot_heads_kept(rows: list[dict], ax=None):
    """Heads kept per kind at each sweep point (Voita et al. 2019, Fig. 9), drawn by
    :func:`headlab.pruning.sweep.plot_heads_per_kind`. Returns ``(figure, data)``."""
    pyplot()
    from headlab.pruning.sweep import plot_heads_per_kind

    ax = axes_or_new(ax, layout="constrained")
    plot_heads_per_kind(rows, ax=ax)
    ax.set_title("Heads kept per kind", fontsize=9)
    ordered = sorted((r for r in rows if r.get("heads")), key=lambda r: -r["heads"])
    data = {"points": [{"point": r["point"], "heads": r["heads"], **{k: r.get(k) for k in KINDS}} for r in ordered]}
    return ax.figure, data


def plot_gate_trajectories(trajectories: Mapping[str, list[dict]], axes=None):
    """P(open) of every gate against the training step, one panel per sweep point, one line per
    head (from ``trajectory.jsonl``; Louizos et al. 2018 / Voita et al. 2019, Sec. 6).
    Returns ``(figure, data)``."""
    plt = pyplot()
    names = [name for name, records in trajectories.items() if records]
    fig, axes = panel_row(axes, max(len(names), 1), (3.6 * max(len(names), 1) + 0.6, 3.4))
    data: dict = {}
    cmap = plt.get_cmap("viridis")
    for ax, name in zip(axes, names):
        records = trajectories[name]
        steps = [int(r["step"]) for r in records]
        heads: dict[str, list[float]] = {}
        for record in records:
            # [layer][original head], null where no gate is (gates.json's numbering); older files
            # list a pruned model's gates by position, which is the same on an unpruned model.
            for kind, layers in (record.get("p_open") or {}).items():
                for layer, row in enumerate(layers):
                    for head, value in enumerate(row):
                        if value is not None:
                            heads.setdefault(label_key(kind, layer, head), []).append(float(value))
        n_layers = 1 + max((int(k.split(":")[1]) for k in heads), default=0)
        for key, values in heads.items():
            layer = int(key.split(":")[1])
            ax.plot(steps[: len(values)], values, color=cmap(layer / max(n_layers - 1, 1)), linewidth=0.7, alpha=0.8)
        ax.set(ylim=(-0.03, 1.03), xlabel="step", ylabel="P(gate open)")
        ax.set_title(name, fontsize=9)
        data[name] = {"steps": steps, "p_open": heads}
    if not names:
        axes[0].text(0.5, 0.5, "no trajectory recorded", ha="center", va="center", transform=axes[0].transAxes)
    fig.suptitle("Gate trajectories (colour: layer)", fontsize=9)
    return fig, data


# ----------------------------------------------------------------------------- files


def save_figure(fig, directory: str | Path, name: str) -> tuple[Path, Path]:
    """``directory/name.png`` and ``.svg`` (SVG without a date and with fixed ids: reproducible)."""
    import matplotlib

    with matplotlib.rc_context({"svg.hashsalt": _SVG_SALT}):
        png = write_figure(fig, Path(directory) / f"{name}.png", close=False, bbox_inches="tight", dpi=110,
                           metadata={"Software": None})
        svg = write_figure(fig, Path(directory) / f"{name}.svg", bbox_inches="tight", metadata={"Date": None})
    return png, svg


def _label_words() -> str:
    """``: positional (offset), syntactic (...) and rare-token``: the statistics' ``label_caption``s."""
    words = [s.label_caption for s in STATISTICS.values() if s.label_group is not None and s.label_caption]
    if not words:
        return ""
    return ": " + (words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1])


def figure_specs(analysis_dir: str | Path) -> list[tuple[str, str, str, Callable[[], tuple]]]:
    """``(name, title, caption, draw)`` of every figure the files in ``analysis_dir`` allow, less
    the files of a stage that its manifest says did not finish (:mod:`headlab.report.vouched`)."""
    from headlab.report.vouched import read_manifest, vouched

    root = Path(analysis_dir)
    readable = vouched(root, read_manifest(root))
    for group in readable.left_out:
        if group.stage not in ("attention", "figures"):  # the files figures are drawn from
            warnings.warn(f"{root}: figures: {group.text()}", UserWarning, stacklevel=2)

    def _load(path: Path) -> HeadScores | None:
        return HeadScores.load(path) if path.is_file() and readable.reads_under(root, path) else None

    specs: list[tuple[str, str, str, Callable[[], tuple]]] = []
    lrp, confidence = _load(root / "importance" / "lrp.json"), _load(root / "importance" / "confidence.json")
    labels_file = root / "functions" / "labels.json"
    labels = load_labels(labels_file) if labels_file.is_file() and readable.reads("functions/labels.json") else {}
    if lrp is not None or confidence is not None:
        have = set(lrp.kinds if lrp is not None else ()) | set(confidence.kinds if confidence is not None else ())
        labelled = {key.split(":")[0] for key in labels}
        kinds = [k for k in KINDS if k in have and (k in labelled or not labelled)]
        for kind in kinds:
            sorted_by = "LRP relevance" if lrp is not None and kind in lrp.kinds else "confidence"
            caption = (f"Each column is a layer of {kind} attention; its heads are sorted by {sorted_by}. "
                       "Bars: LRP relevance (normalised per layer) and confidence (mean maximum attention, "
                       f"EOS excluded). Below: the head's function{_label_words()}.")
            if not labels:
                caption += " The function analysis did not run (no --conllu), so the grid is empty."
            specs.append((f"figure1_{kind}", f"Figure 1 ({kind}): importance and function of each head", caption,
                          partial(plot_figure1, lrp, confidence, labels, kind)))
    for measure in MEASURES:
        scores = _load(root / "importance" / f"{measure}.json")
        if scores is not None:
            specs.append((f"importance_{measure}", f"Head importance: {measure}",
                          f"{measure} of every head, layers down, heads across, one panel per attention kind.",
                          partial(plot_scores_heatmap, scores, title=measure)))
    for statistic in STATISTICS.values():  # the statistics' files declared with a figure of their own
        for output in statistic.outputs:
            if output.figure is None:
                continue
            relative = Path(WRITTEN_UNDER[statistic.stage], output.path)
            for path in sorted(root.glob(relative.as_posix())) if "*" in output.path else [root / relative]:
                scores = _load(path)
                if scores is not None:
                    name, title, caption, heading = output.figure.texts(path.stem)
                    specs.append((name, title, caption, partial(plot_scores_heatmap, scores, title=heading)))
    sweep = root / "prune" / "sweep.json"
    if sweep.is_file() and readable.reads("prune/sweep.json"):
        rows = json.loads(sweep.read_text(encoding="utf-8"))
        if any(r.get("bleu") is not None for r in rows):
            specs.append(("pruning_curve", "Pruning: BLEU against heads kept",
                          "BLEU of the pruned model after a short gated fine-tuning at each head budget "
                          "(Voita et al. 2019, Fig. 7); dashed: the full model.",
                          lambda: plot_pruning_curve(rows)))
        specs.append(("pruning_heads_per_kind", "Pruning: heads kept per kind",
                      "Heads kept in each attention kind at each sweep point (Voita et al. 2019, Fig. 9).",
                      lambda: plot_heads_kept(rows)))
        from headlab.pruning.train import read_trajectory

        trajectories = {r["point"]: read_trajectory(root / "prune" / r["point"]) for r in rows if r["point"] != "full"}
        if any(trajectories.values()):
            specs.append(("gate_trajectories", "Pruning: gate trajectories",
                          "P(gate open) of every gated head over the fine-tuning steps, one panel per sweep "
                          "point, colour by layer.", lambda: plot_gate_trajectories(trajectories)))
    return specs


def write_figures(analysis_dir: str | Path, *, progress: bool = False) -> list[dict]:
    """Draw every figure the directory's files allow into ``figures/``; returns the manifest's
    ``figures`` entries (paths relative to ``analysis_dir``), each figure's data in
    ``figures/<name>.json``."""
    root = Path(analysis_dir)
    specs = figure_specs(root)
    entries = []
    for name, title, caption, draw in with_progress(specs, progress, "figures", unit="fig", leave=False):
        fig, data = draw()
        png, svg = save_figure(fig, root / "figures", name)
        write_json(root / "figures" / f"{name}.json", data, ensure_ascii=False)
        entries.append({"name": name, "title": title, "caption": caption,
                        "png": png.relative_to(root).as_posix(), "svg": svg.relative_to(root).as_posix()})
    return entries
