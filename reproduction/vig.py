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
  Vig and Belinkov count only high-confidence weights (above a threshold, ``MIN_WEIGHT`` = 0.4)
  in their proportions; the same rule is applied to the statistics recomputed that way
  (``headlab functions --aggregate --min-weight 0.4``), read from ``<model>/min-weight-0.4/``.
  The row over all weights stays beside it. The threshold is the paper's, never tuned here.
* attention targets different parts of speech at different depths: for every tag with a corpus
  frequency of at least 1%, Spearman of layer with a head's share of attention to the tag over
  heads, with a bootstrap interval widened for the number of tags (Bonferroni: level
  1 - 0.05 / tags); holds if some tag's interval excludes 0, inconclusive otherwise (no trend
  found is not evidence of none).
* entropy by layer: the paper shows it (heatmaps) without stating a direction, so the row
  reports the layer means and the trend (Spearman of layer with entropy, 95% interval) and is
  not judged.
* exemplars: the strongest single weights (``exemplars.json``) of the most dependency-aligned,
  the longest-range and the lowest-entropy head, shown; qualitative, not judged.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from headlab import HeadScores
from reproduction.claims import Cell, Check, Claim, _fill, _pct
from reproduction.significance import spearman_interval

__all__ = ["FILES", "vig_models", "claim_vig", "VIG_DIR", "MIN_WEIGHT", "HIGH_CONFIDENCE_DIR"]

VIG_DIR = "vig-belinkov"
FILES = ("mean_distance", "dependency_alignment", "mean_entropy", "variability")
N_RESAMPLES = 2000
# Vig and Belinkov 2019 count only attention weights above this in their proportions (their
# high-confidence threshold); the value the issue 35 referee re-measured with.
MIN_WEIGHT = 0.4
HIGH_CONFIDENCE_DIR = f"min-weight-{MIN_WEIGHT}"
MIN_FREQUENCY = 0.01  # rarer tags: shares of noise


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


def _min_weights(directory: Path) -> set[float]:
    """The ``min_weight`` each distance/alignment file in ``directory`` records in its signature."""
    return {float(HeadScores.load(p).signature.get("min_weight", 0.0))
            for p in (directory / "mean_distance.json", directory / "dependency_alignment.json") if p.is_file()}


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


def _inverse_verdict(rho: float, low: float, high: float) -> str:
    """Alignment falls with distance: the interval below 0 holds, above 0 does not; NaN is no test."""
    if math.isnan(low) or math.isnan(high):
        return "inconclusive: no interval (constant scores)"
    return "holds" if high < 0 else "does not hold" if low > 0 else "inconclusive: the interval contains 0"


def _pos_depth(shares: dict[str, np.ndarray], n_samples: int = N_RESAMPLES) -> tuple[str, str]:
    """Per tag, Spearman of layer with the per-head share (Bonferroni-widened interval); the cell
    lists the tags whose interval excludes 0 (or the strongest one) and the verdict."""
    if not shares:
        return "", "not run: no tag with a frequency of at least 1%"
    level = 1 - 0.05 / len(shares)
    trends = {t: spearman_interval(_layers(v), v, n_samples=n_samples, level=level) for t, v in sorted(shares.items())}
    moving = [t for t, (_, low, high) in trends.items() if low > 0 or high < 0]
    shown = moving or [max(trends, key=lambda t: abs(trends[t][0]) if not math.isnan(trends[t][0]) else -1)]
    text = ", ".join(f"{t} {trends[t][0]:+.2f} [{trends[t][1]:+.2f}, {trends[t][2]:+.2f}]" for t in shown)
    text = f"{len(moving)} of {len(trends)} tags ({_pct(level)} intervals): " + text
    return text, "holds" if moving else "inconclusive: no tag's share moves with depth beyond chance"


def _exemplar_lines(directory: Path, align: np.ndarray | None, dist: np.ndarray | None,
                    entropy: np.ndarray | None, top: int = 3) -> list[str]:
    """Markdown: the ``top`` exemplars of the heads that the statistics single out."""
    path = directory / "exemplars.json"
    if not path.is_file():
        return []
    exemplars = json.loads(path.read_text(encoding="utf-8"))
    picks = [(why, values, pick) for why, values, pick in (
        ("most dependency-aligned", align, np.nanargmax), ("longest range", dist, np.nanargmax),
        ("lowest entropy", entropy, np.nanargmin)) if values is not None and not np.all(np.isnan(values))]
    lines = ["| head | why shown | weight | query word -> key word | sentence |", "|---|---|---:|---|---|"]
    for why, values, pick in picks:
        layer, head = np.unravel_index(int(pick(values)), values.shape)
        heaps = next((v for k, v in exemplars.items() if k.endswith(f":{layer}")), None)
        for e in (heaps[head] if heaps and head < len(heaps) else [])[:top]:
            text = e.get("text", "").replace("|", "\\|")
            lines.append(f"| L{layer + 1} H{head + 1} | {why} | {e['weight']:.3f} | {e.get('query_word')} -> "
                         f"{e.get('key_word')} | {text} |")
    return ["Exemplars (the strongest single weights, `exemplars.json`):", ""] + lines if len(lines) > 2 else []


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
    inverse = Check("Spearman of dependency alignment with mean distance over heads, all weights [95% interval]",
                    "inversely related to attention distance (over high-confidence weights only)",
                    criterion="holds if the interval lies below 0, does not hold above 0, inconclusive if it "
                              "contains 0")
    confident = Check(f"Spearman of dependency alignment with mean distance over heads, weights > {MIN_WEIGHT} only "
                      "[95% interval]",
                      f"inversely related to attention distance, counting weights above {MIN_WEIGHT} only "
                      "(Vig and Belinkov's high-confidence threshold)",
                      criterion="the same rule, on the statistics recomputed over weights above the paper's threshold")
    pos = Check("share of attention to a part of speech changes with depth: per tag (frequency >= 1%), Spearman "
                "of layer with the share over heads [Bonferroni-widened interval]",
                "attention targets different parts of speech at different layer depths (heatmaps)",
                criterion="holds if some tag's interval (level 1 - 0.05 / tags) excludes 0; inconclusive otherwise")
    pos_top = Check("part of speech attended most, relative to its frequency, per layer",
                    "share of attention to each part of speech, per layer and head (heatmaps; no number in the paper)",
                    criterion="descriptive in the paper: not a testable claim")
    entropy = Check("mean attention entropy by layer (layer 1 .. last); Spearman of layer with entropy over heads "
                    "[95% interval]", "entropy per head (heatmaps; no direction stated)",
                    criterion="descriptive: the paper states no direction, so the trend is reported, not judged")
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
            inverse.cells[name] = Cell(f"{rho:+.2f} [{low:+.2f}, {high:+.2f}]", _inverse_verdict(rho, low, high))
        strict = directory / HIGH_CONFIDENCE_DIR
        s_dist, s_align = _scores(strict, "mean_distance"), _scores(strict, "dependency_alignment")
        used = _min_weights(strict)
        if used and used != {MIN_WEIGHT}:  # files made with another threshold: never judged as the paper's
            confident.cells[name] = Cell("", f"not run: `{HIGH_CONFIDENCE_DIR}/` holds statistics over weights above "
                                         f"{', '.join(map(str, sorted(used)))}, not {MIN_WEIGHT}")
        elif s_dist is None or s_align is None:
            confident.cells[name] = Cell("", f"not run yet: `headlab functions models/{name} --conllu "
                                         "data/ud-english-ewt/en_ewt-ud-dev.conllu --aggregate --min-weight "
                                         f"{MIN_WEIGHT} --out <dir>`, then copy `<dir>/aggregate/` to "
                                         f"`{VIG_DIR}/{name}/{HIGH_CONFIDENCE_DIR}/`")
        else:
            rho, low, high = spearman_interval(s_align, s_dist)
            confident.cells[name] = Cell(f"{rho:+.2f} [{low:+.2f}, {high:+.2f}]", _inverse_verdict(rho, low, high))
        ent = _scores(directory, "mean_entropy")
        if ent is None:
            entropy.cells[name] = Cell("", "not run: no mean_entropy.json")
        else:
            rho, low, high = spearman_interval(_layers(ent), ent)
            trend = "rises with depth" if low > 0 else "falls with depth" if high < 0 else "no monotone trend"
            entropy.cells[name] = Cell(" / ".join(f"{m:.2f}" for m in np.nanmean(ent, axis=1)) +
                                       f"; rho {rho:+.2f} [{low:+.2f}, {high:+.2f}]: {trend}",
                                       "not testable: the paper states no direction")
        lines = _exemplar_lines(directory, align, dist, ent)
        if lines:
            c.details[name] = lines
        freq_path = directory / "pos_frequency.json"
        tags = sorted(p.stem for p in (directory / "pos").glob("*.json")) if (directory / "pos").is_dir() else []
        if freq_path.is_file() and tags:
            freq = json.loads(freq_path.read_text(encoding="utf-8"))
            freq = freq.get("enc_self") or next(iter(freq.values()))
            shares = {t: s for t in tags if freq.get(t, 0) >= MIN_FREQUENCY
                      and (s := _scores(directory / "pos", t)) is not None}  # (each file was globbed: never None)
            per_layer = []
            for layer in range(dist.shape[0] if dist is not None else 0):
                ratios = {t: float(np.nanmean(v[layer])) / freq[t] for t, v in shares.items()}
                best = max(ratios, key=lambda t: ratios[t])
                per_layer.append(f"L{layer + 1} {best} {ratios[best]:.1f}x")
            pos_top.cells[name] = Cell(", ".join(per_layer), "not testable: descriptive")
            pos.cells[name] = Cell(*_pos_depth({t: v for t, v in shares.items() if v is not None}))
        else:
            _fill((pos, pos_top), name, Cell("", "not run: no pos/*.json"))
        var = _scores(directory, "variability")
        variability.cells[name] = Cell(" / ".join(f"{m:.3f}" for m in np.nanmean(var, axis=1)),
                                       "not testable: descriptive") if var is not None else \
            Cell("", "not run: no variability.json")
        exemplars.cells[name] = Cell("shown below the table", "not testable: qualitative") if name in c.details \
            else Cell("", "not run: no exemplars.json")
    c.checks = [distance, peak, inverse, confident, pos, pos_top, entropy, variability, exemplars]
    return c
