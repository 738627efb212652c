"""The Vig and Belinkov rows of docs/reproduction.md (reproduction.vig), judged on constructed
numbers: entropy by layer, parts of speech by depth, alignment with distance over high-confidence
weights only, and the exemplars shown."""

from __future__ import annotations

import json
import math

import numpy as np

from headlab.heads import HeadScores
from reproduction.significance import spearman_interval
from reproduction.vig import HIGH_CONFIDENCE_DIR, MIN_WEIGHT, _inverse_verdict, _pos_depth, claim_vig

LAYERS, HEADS = 6, 8


def _save(path, values, method="x", min_weight=0.0):
    path.parent.mkdir(parents=True, exist_ok=True)
    HeadScores(scores={"dec_self": np.asarray(values, dtype=float)}, method=method,
               signature={"min_weight": min_weight}).save(path)


def _rising(rng, slope=1.0):
    """Layer index * slope plus small noise: a clear monotone trend with depth."""
    return np.arange(LAYERS)[:, None] * slope + rng.normal(0, 0.05, (LAYERS, HEADS))


def _model(tmp_path, *, strict=True, exemplars=True, strict_weight=MIN_WEIGHT):
    """A model directory with every file; alignment falls with distance over all weights, but not
    over weights above the threshold; entropy falls with depth; NOUN's share rises with depth."""
    rng = np.random.default_rng(0)
    d = tmp_path / "vig-belinkov" / "lm"
    dist = _rising(rng) + 3
    _save(d / "mean_distance.json", dist)
    _save(d / "dependency_alignment.json", 1.0 / dist)
    _save(d / "mean_entropy.json", 2 - _rising(rng, 0.2))
    _save(d / "variability.json", rng.uniform(0.2, 0.4, (LAYERS, HEADS)))
    (d / "pos_frequency.json").write_text(json.dumps({"dec_self": {"NOUN": 0.3, "DET": 0.2, "X": 0.001}}))
    _save(d / "pos" / "NOUN.json", 0.2 + _rising(rng, 0.02))
    _save(d / "pos" / "DET.json", rng.uniform(0.1, 0.3, (LAYERS, HEADS)))
    _save(d / "pos" / "X.json", np.arange(LAYERS)[:, None] * np.ones((1, HEADS)))  # rare: ignored
    if strict:
        _save(d / HIGH_CONFIDENCE_DIR / "mean_distance.json", dist, min_weight=strict_weight)
        _save(d / HIGH_CONFIDENCE_DIR / "dependency_alignment.json", rng.uniform(0, 1, (LAYERS, HEADS)),
              min_weight=strict_weight)
    if exemplars:
        heaps = {f"dec_self:{layer}": [[{"weight": 0.5 + layer / 100 + head / 1000, "query_word": f"q{layer}{head}",
                                         "key_word": "k", "text": "a | b"}] for head in range(HEADS)]
                 for layer in range(LAYERS)}
        (d / "exemplars.json").write_text(json.dumps(heaps))
    return {"lm": d}


def _row(claim, start):
    return next(c for c in claim.checks if c.label.startswith(start)).cells["lm"]


def test_the_threshold_is_the_papers():
    assert MIN_WEIGHT == 0.4 and HIGH_CONFIDENCE_DIR == "min-weight-0.4"


def test_alignment_with_distance_is_judged_over_high_confidence_weights(tmp_path):
    claim = claim_vig(_model(tmp_path))
    everything = _row(claim, "Spearman of dependency alignment with mean distance over heads, all weights")
    confident = _row(claim, f"Spearman of dependency alignment with mean distance over heads, weights > {MIN_WEIGHT}")
    assert everything.verdict == "holds"
    assert confident.verdict.startswith("inconclusive: the interval contains 0"), confident


def test_without_the_high_confidence_files_the_row_says_how_to_make_them(tmp_path):
    cell = _row(claim_vig(_model(tmp_path, strict=False)), "Spearman of dependency alignment with mean distance "
                                                          f"over heads, weights > {MIN_WEIGHT}")
    assert cell.verdict.startswith("not run yet:") and f"--min-weight {MIN_WEIGHT}" in cell.verdict
    assert "headlab functions models/lm" in cell.verdict and HIGH_CONFIDENCE_DIR in cell.verdict


def test_files_made_with_another_threshold_are_never_judged_as_the_papers(tmp_path):
    cell = _row(claim_vig(_model(tmp_path, strict_weight=0.0)), "Spearman of dependency alignment with mean "
                                                                f"distance over heads, weights > {MIN_WEIGHT}")
    assert cell.verdict == f"not run: `{HIGH_CONFIDENCE_DIR}/` holds statistics over weights above 0.0, not 0.4"


def test_the_inverse_rule_and_nan():
    assert _inverse_verdict(-0.5, -0.8, -0.1) == "holds"
    assert _inverse_verdict(0.5, 0.1, 0.8) == "does not hold"
    assert _inverse_verdict(-0.06, -0.45, 0.30).startswith("inconclusive: the interval contains 0")
    assert _inverse_verdict(math.nan, math.nan, math.nan).startswith("inconclusive")  # never "does not hold"


def test_entropy_by_layer_is_reported_with_its_trend_and_not_judged(tmp_path):
    cell = _row(claim_vig(_model(tmp_path)), "mean attention entropy by layer")
    entropy = HeadScores.load(tmp_path / "vig-belinkov" / "lm" / "mean_entropy.json")["dec_self"]
    means = entropy.mean(axis=1)
    assert np.all(np.abs(means - (2 - 0.2 * np.arange(LAYERS))) < 0.05)  # the constructed trend
    assert cell.value.startswith(" / ".join(f"{m:.2f}" for m in means) + "; rho -")
    assert cell.value.endswith("falls with depth") and cell.verdict.startswith("not testable")


def test_pos_by_depth_holds_when_a_tags_share_moves_with_depth(tmp_path):
    cell = _row(claim_vig(_model(tmp_path)), "share of attention to a part of speech changes with depth")
    assert cell.verdict == "holds"
    assert cell.value.startswith("1 of 2 tags (97.5% intervals): NOUN +")  # X is too rare to count


def test_pos_by_depth_is_inconclusive_without_a_trend_and_widens_for_the_tags():
    rng = np.random.default_rng(1)
    flat = {t: rng.uniform(0.1, 0.3, (LAYERS, HEADS)) for t in ("A", "B", "C", "D", "E")}
    text, verdict = _pos_depth(flat, n_samples=300)
    assert verdict.startswith("inconclusive") and text.startswith("0 of 5 tags (99.0% intervals): ")
    assert _pos_depth({}) == ("", "not run: no tag with a frequency of at least 1%")


def test_exemplars_of_the_heads_the_statistics_single_out_are_shown(tmp_path):
    claim = claim_vig(_model(tmp_path))
    assert _row(claim, "exemplar sentences per head").value == "shown below the table"
    table = "\n".join(claim.details["lm"])
    # Distance rises with layer, so the longest-range head is in layer 6 and the most aligned in layer 1.
    dist = HeadScores.load(tmp_path / "vig-belinkov" / "lm" / "mean_distance.json")["dec_self"]
    layer, head = np.unravel_index(int(np.argmax(dist)), dist.shape)
    assert layer == 5 and f"| L6 H{head + 1} | longest range | {0.55 + head / 1000:.3f} | q5{head} -> k | a \\| b |" in table
    assert "most dependency-aligned" in table and "lowest entropy" in table


def test_without_exemplars_json_the_row_says_not_run(tmp_path):
    claim = claim_vig(_model(tmp_path, exemplars=False))
    assert _row(claim, "exemplar sentences per head").verdict == "not run: no exemplars.json"
    assert "lm" not in claim.details


def test_the_default_interval_is_the_95_percent_one_it_always_was():
    rng = np.random.default_rng(2)
    a, b = rng.normal(size=48), rng.normal(size=48)
    assert spearman_interval(a, b, n_samples=300) == spearman_interval(a, b, n_samples=300, level=0.95)
    wide = spearman_interval(a, b, n_samples=300, level=0.99)
    narrow = spearman_interval(a, b, n_samples=300)
    assert wide[1] <= narrow[1] and wide[2] >= narrow[2]
