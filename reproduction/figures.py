"""Figures of docs/reproduction.md, drawn from the result files only (matplotlib, Agg).

Each plot function takes an optional ``ax``; :func:`save_figures` writes
``<img_dir>/reproduction-<model>-<name>.png`` for every figure a claim asked for.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from headlab.heads import axes_or_new, pyplot, write_figure
from reproduction.claims import POSITIONAL, Claim, _function_masks, _kept, _kept_by_function, _layer_rows, _rows, _shape
from reproduction.results import ModelResults

__all__ = ["save_figures"]


def plot_lrp_confidence(r: ModelResults, ax=None):
    ax = axes_or_new(ax)
    lrp_scores, conf_scores = r.importance("lrp"), r.importance("confidence")
    assert lrp_scores is not None and conf_scores is not None  # the claim that shows this figure had both
    lrp, conf = lrp_scores["enc_self"], conf_scores["enc_self"]
    for layer in range(lrp.shape[0]):
        ax.scatter(conf[layer], lrp[layer], label=f"layer {layer + 1}", s=18)
    ax.set(xlabel="confidence", ylabel="LRP relevance (normalised per layer)",
           title=f"Encoder heads: relevance against confidence ({r.name})")
    ax.legend(fontsize=7)
    return ax


def plot_fig7(r: ModelResults, ax=None):
    from headlab.pruning.sweep import plot_bleu_vs_heads

    sweep = r.sweep("enc")
    rows = [{"point": row["point"], "enc_self": row["enc_self"], "bleu": row["bleu"], "lam": row["lam"],
             "keep": row["keep"]} for row in _rows(sweep)]
    full = sweep["full"]
    rows.append({"point": "full", "enc_self": full["heads_kept"]["enc_self"], "bleu": full["metrics"]["bleu"]})
    ax = plot_bleu_vs_heads(rows, [b for b in r.baselines if not b.get("from_scratch")], ax=axes_or_new(ax))
    ax.set_title(f"BLEU against retained encoder heads ({r.name})")
    return ax


def plot_fig8(r: ModelResults, ax=None):
    ax = axes_or_new(ax)
    masks, shape = _function_masks(r), _shape(r, "enc_self")
    assert masks is not None and shape is not None  # the claim that shows this figure had both
    points = _kept_by_function(r.sweep("enc"), masks, shape)
    labels = [str(n_kept) for _, n_kept, _ in points]
    bottoms = np.zeros(len(labels))
    for f in ("positional", "syntactic", "rare", "other"):
        values = [counts[f] for _, _, counts in points]
        ax.bar(labels, values, bottom=bottoms, label=f)
        bottoms += np.array(values)
    ax.set(xlabel="encoder heads kept (sweep point)", ylabel="heads", title=f"Functions of the retained encoder heads ({r.name})")
    ax.legend(fontsize=8)
    return ax


def plot_fig9(r: ModelResults, ax=None):
    from headlab.pruning.sweep import plot_heads_per_kind

    rows = [row for row in _rows(r.sweep("all")) if row["series"] != "control"]  # the control prunes nothing
    ax = plot_heads_per_kind(rows, ax=axes_or_new(ax))
    ax.set_title(f"Heads kept per attention kind ({r.name})")
    return ax


def plot_fig10(r: ModelResults, ax=None):
    ax = axes_or_new(ax)
    sweep = r.sweep("all")
    rows = _layer_rows(r)  # the point Sec. 6.3.2's verdict reads: the sparsest with heads of both decoder kinds
    point = sweep["points"][rows[-1]["point"]]
    width = 0.4
    for i, kind in enumerate(("dec_self", "dec_cross")):
        mask = _kept(point, kind, _shape(r, kind))
        layers = np.arange(1, mask.shape[0] + 1)
        ax.bar(layers + (i - 0.5) * width, mask.sum(axis=1), width, label=kind)
    ax.set(xlabel="decoder layer", ylabel="heads kept", title=f"Decoder heads kept by layer at {rows[-1]['point']} ({r.name})")
    ax.legend(fontsize=8)
    return ax


def plot_specialisation(r: ModelResults, ax=None):
    ax = axes_or_new(ax, (9, 4))
    points = (r.specialisation or {})["checkpoints"]
    xs = list(range(len(points)))
    labels = [str(p["epoch"]) if p.get("epoch") is not None else p["checkpoint"] for p in points]
    get = lambda key, stat: [p["summary"][key][stat] for p in points]  # noqa: E731
    ax.plot(xs, get("token_share", "max"), "o-", label="positional share, max (tokens)")
    ax.plot(xs, get("token_share", "mean"), "o--", label="positional share, mean (tokens)")
    ax.plot(xs, get("word_share", "max"), "s-", label="positional share, max (words)")
    ax.plot(xs, get("confidence", "max"), "^-", label="confidence, max")
    ax.plot(xs, get("confidence", "mean"), "^--", label="confidence, mean")
    ax.axhline(POSITIONAL, color="gray", linestyle=":", label="90% positional threshold")
    ax.set_xticks(xs, labels)
    ax.set(ylim=(0, 1), xlabel="epoch (checkpoint)", title=f"Encoder heads over training ({r.name})")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return ax


FIGURES = {"lrp-confidence": plot_lrp_confidence, "fig7": plot_fig7, "fig8": plot_fig8, "fig9": plot_fig9,
           "fig10": plot_fig10, "specialisation": plot_specialisation}


def save_figures(claims: list[Claim], results: dict[str, ModelResults], img_dir: str | Path) -> list[Path]:
    plt = pyplot()
    written = []
    for claim in claims:
        for model, name in claim.figures.items():
            fig, ax = plt.subplots(figsize=(9, 4) if name == "specialisation" else (6, 4))
            FIGURES[name](results[model], ax=ax)
            fig.tight_layout()
            written.append(write_figure(fig, Path(img_dir) / f"reproduction-{model}-{name}.png", dpi=110))
    return written

