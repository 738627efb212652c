"""The findings of Vig and Belinkov 2019 (a 12-layer GPT-2), from per-head aggregate statistics.

Reads, for every model that has them, the HeadScores files that ``headlab analyze`` writes to
``<analysis>/aggregate/`` (mean_distance, dependency_alignment, mean_entropy, variability,
pos_frequency and pos/<TAG>.json), copied to ``<results_dir>/vig-belinkov/<model>/``. Any
model can be added by copying its files there; the section renders whichever models have them.
A sequence-to-sequence model is read on its encoder self-attention, a language model on its one
attention kind.

Criteria (fixed here, with intervals from resampling heads):

* mean distance grows with depth: Spearman's rho of layer index with a head's mean distance
  over all heads, 95% bootstrap interval over heads; holds if the interval lies above 0 and the
  deepest layer has the largest mean (partly if only the first), does not hold if it lies below
  0, inconclusive otherwise.
* dependency alignment peaks in the middle layers: the layer with the largest mean alignment
  lies in the middle third of the layers; heads are resampled within each layer, and the share
  of resamples whose peak is in the middle third decides: holds at >= 95%, does not hold at
  <= 5%, inconclusive between.
* alignment inversely related to distance: Spearman over heads with its bootstrap interval;
  holds if the interval lies below 0, does not hold if above, inconclusive if it contains 0.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from headlab.heads import HeadScores
from headlab.reproduce.claims import Cell, Check, Claim, _fill, _pct
from headlab.reproduce.significance import spearman_interval

__all__ = ["FILES", "vig_models", "claim_vig", "VIG_DIR"]

VIG_DIR = "vig-belinkov"
FILES = ("mean_distance", "dependency_alignment", "mean_entropy", "variability")
N_RESAMPLES = 2000


def vig_models(results_dir: Path) -> dict[str, Path]:
    """``{model: directory}`` of every model with aggregate files, sorted by name."""
    base = Path(results_dir) / VIG_DIR
    if not base.is_dir():
        return {}
    return {d.name: d for d in sorted(base.iterdir()) if d.is_dir() and (d / "mean_distance.json").is_file()}


def _scores(directory: Path, name: str) -> np.ndarray | None:
    path = directory / f"{name}.json"
    if not path.is_file():
        return None
    scores = HeadScores.load(path)
    kind = "enc_self" if "enc_self" in scores.scores else next(iter(scores.scores))
    return np.asarray(scores[kind], dtype=float)


def _layers(values: np.ndarray) -> np.ndarray:
    return np.repeat(np.arange(values.shape[0])[:, None], values.shape[1], axis=1).astype(float)


def _middle(n_layers: int) -> range:
    """The middle third of ``n_layers`` layers (0-based): 6 layers -> 2, 3; 12 layers -> 4..7."""
    return range(n_layers // 3, n_layers - n_layers // 3)


def _peak_share(values: np.ndarray, seed: int = 0) -> float:
    """Share of within-layer resamples of heads whose layer of largest mean is in the middle third."""
    rng = np.random.default_rng(seed)
    middle = set(_middle(values.shape[0]))
    hits = 0
    for _ in range(N_RESAMPLES):
        idx = rng.integers(0, values.shape[1], values.shape)
        means = np.nanmean(np.take_along_axis(values, idx, axis=1), axis=1)
        hits += int(np.nanargmax(means)) in middle
    return hits / N_RESAMPLES


def claim_vig(directories: dict[str, Path]) -> Claim:
    c = Claim("vig", "Vig and Belinkov 2019: attention statistics by layer",
              "In GPT-2 small, the deepest layers attend over the longest distances; attention aligns with "
              "dependency relations most in the middle layers, and less in heads that attend far.", [])
    distance = Check("mean attention distance by layer (layer 1 .. last); Spearman of layer with distance over "
                     "heads [95% interval]", "grows with depth; the deepest layers attend over the longest range",
                     criterion="holds if the interval lies above 0 and the deepest layer has the largest mean; partly "
                               "if only the first; does not hold below 0; inconclusive if it contains 0")
    peak = Check("dependency alignment by layer; share of head resamples peaking in the middle third",
                 "strongest in the middle layers",
                 criterion="holds if >= 95% of resamples peak in the middle third of the layers, does not hold at "
                           "<= 5%, inconclusive between")
    inverse = Check("Spearman of dependency alignment with mean distance over heads [95% interval]",
                    "inversely related to attention distance",
                    criterion="holds if the interval lies below 0, does not hold above 0, inconclusive if it "
                              "contains 0")
    pos = Check("part of speech attended most, relative to its frequency, per layer",
                "share of attention to each part of speech, per layer and head (heatmaps; no number in the paper)",
                criterion="descriptive in the paper: not a testable claim")
    variability = Check("mean variability by layer (high: content-dependent, low: position-dependent)",
                        "entropy and variability per head (heatmaps; no number in the paper)",
                        criterion="descriptive in the paper: not a testable claim")
    exemplars = Check("exemplar sentences per head", "e.g. layer 10 head 10 links an acronym to its phrase "
                      "(qualitative)", criterion="qualitative in the paper: not a testable claim")
    for name, directory in directories.items():
        dist, align = _scores(directory, "mean_distance"), _scores(directory, "dependency_alignment")
        if dist is None or align is None:
            _fill((distance, peak, inverse), name, Cell("", "not run: no mean_distance.json or dependency_alignment.json"))
        else:
            means = np.nanmean(dist, axis=1)
            rho, low, high = spearman_interval(_layers(dist), dist)
            deepest = int(np.nanargmax(means)) == len(means) - 1
            verdict = ("holds" if deepest else "partly") if low > 0 else "does not hold" if high < 0 else \
                "inconclusive: the interval contains 0"
            distance.cells[name] = Cell(" / ".join(f"{m:.2f}" for m in means) +
                                        f"; rho {rho:+.2f} [{low:+.2f}, {high:+.2f}]", verdict)
            layer_means = np.nanmean(align, axis=1)
            share = _peak_share(align)
            middle = _middle(align.shape[0])
            verdict = "holds" if share >= 0.95 else "does not hold" if share <= 0.05 else \
                "inconclusive: the peak moves with the heads sampled"
            peak.cells[name] = Cell(" / ".join(f"{m:.3f}" for m in layer_means) +
                                    f"; peak at layer {int(np.nanargmax(layer_means)) + 1}, middle third = layers "
                                    f"{middle.start + 1}-{middle.stop}; {_pct(share)} of resamples", verdict)
            rho, low, high = spearman_interval(align, dist)
            verdict = "holds" if high < 0 else "does not hold" if low > 0 else "inconclusive: the interval contains 0"
            inverse.cells[name] = Cell(f"{rho:+.2f} [{low:+.2f}, {high:+.2f}]", verdict)
        freq_path = directory / "pos_frequency.json"
        tags = sorted(p.stem for p in (directory / "pos").glob("*.json")) if (directory / "pos").is_dir() else []
        if freq_path.is_file() and tags:
            freq = json.loads(freq_path.read_text(encoding="utf-8"))
            freq = freq.get("enc_self") or next(iter(freq.values()))
            per_layer = []
            for layer in range(dist.shape[0] if dist is not None else 0):
                ratios = {t: float(np.nanmean(_scores(directory / "pos", t)[layer])) / freq[t]
                          for t in tags if freq.get(t, 0) >= 0.01}  # rarer tags: ratios of noise
                best = max(ratios, key=ratios.get)
                per_layer.append(f"L{layer + 1} {best} {ratios[best]:.1f}x")
            pos.cells[name] = Cell(", ".join(per_layer), "not testable: descriptive")
        else:
            pos.cells[name] = Cell("", "not run: no pos/*.json")
        var = _scores(directory, "variability")
        variability.cells[name] = Cell(" / ".join(f"{m:.3f}" for m in np.nanmean(var, axis=1)),
                                       "not testable: descriptive") if var is not None else \
            Cell("", "not run: no variability.json")
        exemplars.cells[name] = Cell("not compared", "not testable: qualitative")
    c.checks = [distance, peak, inverse, pos, variability, exemplars]
    return c
