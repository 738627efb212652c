"""The verdict rules of docs/reproduction.md on constructed numbers (issue 35, item 4).

One rule per test: one non-inferiority bound for "no (noticeable) loss"; no verdict resting on a
pruning point whose fine-tuning has not settled; NaN never "does not hold"; a zero count never
"partly"; Sec. 4's criteria able to pass by the paper's own standard, and the dominance share
taken of magnitudes, not of signed relevances. Hand-made result files, no model: seconds.
"""

import json
import math

import numpy as np

from headlab.heads import HeadScores
from reproduction import compute_claims
from reproduction.claims import (
    NOTICEABLE_BLEU,
    _dominance,
    _dominance_verdict,
    _low_confidence_verdict,
    _non_inferior,
    _readings_verdict,
    _table1_cells,
    _unsettled,
    _within,
)
from reproduction.results import ModelResults


def _change(delta, low, high):
    return {"delta": delta, "low": low, "high": high, "kind": "paired"}


def _dev(call, delta=0.0, low=-0.2, high=0.2):
    return {"n_sentences": 30, "curve": [], "plateau": {"from_step": 5, "to_step": 10, "delta": delta, "low": low,
                                                         "high": high, "call": call, "tolerance": 0.5}}


def _row(point, call="flat"):
    return {"point": point, "dev": _dev(call) if call else None}


# ----------------------------------------------------------------------------- non-inferiority


def test_an_interval_containing_0_but_crossing_the_bound_is_not_no_loss():
    """EN-DE 1/10/19 heads: -0.63 [-1.60, +0.25] contains 0 but reaches far below -0.15: undecided,
    where the old rule for "no noticeable loss" called it "no difference"."""
    crossing = [(_change(-0.63, -1.60, 0.25), _row("lam-0.01"))]
    assert _non_inferior(crossing, None, NOTICEABLE_BLEU, "19 heads") == "inconclusive: an interval reaches below -0.15"
    inside = [(_change(-0.05, -0.12, 0.03), _row("lam-0.01"))]
    assert _non_inferior(inside, None, NOTICEABLE_BLEU, "19 heads") == "holds"
    below = [(_change(-1.77, -2.78, -0.84), _row("lam-0.05"))]
    assert _non_inferior(below, None, 0.15, "13 heads") == "inconclusive: no point between 13 heads and the full model"
    larger = (30, _change(-1.11, -1.96, -0.20), _row("lam-0.01"))
    assert _non_inferior(below, larger, 0.15, "13 heads") == "does not hold"


def test_within_is_the_same_rule_at_a_head_count():
    points = [(2, _change(-0.10, -0.14, -0.05), _row("lam-0.02")), (6, _change(-0.3, -0.5, -0.2), _row("lam-0.01"))]
    assert _within(points, 4, 0.15) == "holds"
    assert _within(points, 4, 0.04) == "does not hold"  # 2 heads below -0.04, and the next larger (6) too
    assert _within(points, 4, 0.1) == "inconclusive: an interval reaches below -0.1"
    # Points given without their rows (older callers) count as settled.
    assert _within([(k, x) for k, x, _ in points], 4, 0.15) == "holds"


# ----------------------------------------------------------------------------- convergence


def test_no_verdict_rests_on_a_point_that_has_not_settled():
    """A point whose development BLEU may still rise (or has no curve) leaves its verdict
    inconclusive, for "holds" and for "does not hold" alike; a flat one decides."""
    assert _unsettled(_row("p", "flat")) is None
    assert _unsettled(_row("p", None)) == "no development curve"
    assert _unsettled({"point": "p", "dev": _dev("rising", 3.35, 2.50, 4.25)}) == \
        "still rising, +3.35 [+2.50, +4.25] over its second half"
    assert _unsettled(_row("p", "undecided")).startswith("may still rise")
    within = [(_change(-0.05, -0.12, 0.03), {"point": "lam-0.05", "dev": _dev("rising", 3.35, 2.50, 4.25)})]
    assert _non_inferior(within, None, 0.15, "1 head") == \
        "inconclusive: lam-0.05 has not settled (still rising, +3.35 [+2.50, +4.25] over its second half)"
    # Another witness that has settled decides.
    assert _non_inferior(within + [(_change(-0.1, -0.14, 0.0), _row("lam-0.02"))], None, 0.15, "1 head") == "holds"
    below = [(_change(-1.0, -1.5, -0.5), _row("lam-0.05"))]
    assert _non_inferior(below, (9, _change(-1.0, -1.5, -0.5), _row("lam-0.01", None)), 0.15, "1 head") == \
        "inconclusive: lam-0.01 has not settled (no development curve)"


def test_the_encoder_pruning_claim_waits_for_its_points_to_settle(tmp_path):
    """Claim level (Sec. 6.2): a point within the bound whose BLEU still rises is not yet a verdict."""
    res = tmp_path / "m"
    enc = res / "prune" / "enc"
    enc.mkdir(parents=True)
    (res / "hypotheses").mkdir()
    refs = [f"sentence number {i} is here" for i in range(30)]
    (tmp_path / "refs.txt").write_text("\n".join(refs) + "\n")
    (res / "hypotheses" / "full.txt").write_text("\n".join(refs) + "\n")  # zero-width bounds
    total = {"enc_self": 8, "dec_self": 8, "dec_cross": 8}
    (enc / "full.json").write_text(json.dumps({"heads_kept": total, "metrics": {"bleu": 30.0}, "model_sha256": "a"}))

    def point(name, lam, enc_self, bleu, call):
        (enc / name).mkdir(exist_ok=True)
        (enc / name / "result.json").write_text(json.dumps(
            {"heads_total": total, "heads_kept": {**total, "enc_self": enc_self}, "lam": lam, "keep": None,
             "step": 10, "metrics": {"bleu": bleu, "polarized": 1.0}, "model_sha256": "a", "dev": _dev(call)}))

    def verdict():
        results = {"m": ModelResults(res, "m", references=tmp_path / "refs.txt")}
        claim = {c.key: c for c in compute_claims(results)}["sec6.2"]
        return next(ch for ch in claim.checks if ch.label.startswith("4 or fewer")).cells["m"].verdict

    point("lam-0.05", 0.05, 3, 29.9, "rising")
    assert verdict().startswith("inconclusive: lam-0.05 has not settled (still rising")
    point("lam-0.05", 0.05, 3, 29.9, "flat")
    assert verdict() == "holds"


# ----------------------------------------------------------------------------- NaN


def test_nan_never_makes_a_claim_fail():
    assert _dominance_verdict([0.5, math.nan], 8) == "inconclusive: a layer has no relevance to share"
    assert _dominance_verdict([0.5, math.nan, 0.1], 8) == "does not hold"  # a defined share below the bar decides
    share, _, _, _ = _dominance(np.zeros(8))
    assert math.isnan(share)
    assert _low_confidence_verdict(math.nan, np.full((2, 8), 0.3))[0] == "inconclusive: a confidence is undefined"


def _decoder_sweep(tmp_path, points):
    """A model with 4 decoder layers x 2 heads per kind and hand-made prune/all points:
    ``points`` = {name: (lam, heads_kept, kept dec_self layers, kept dec_cross layers)}."""
    res = tmp_path / "m"
    shape = (4, 2)
    HeadScores({k: np.full(shape, 0.3) for k in ("enc_self", "dec_self", "dec_cross")}, "confidence").save(
        res / "importance" / "confidence.json")
    sweep = res / "prune" / "all"
    sweep.mkdir(parents=True)
    total = {"enc_self": 8, "dec_self": 8, "dec_cross": 8}
    (sweep / "full.json").write_text(json.dumps({"heads_kept": total, "metrics": {"bleu": 30.0}, "model_sha256": "a"}))
    for name, (lam, kept, self_layers, cross_layers) in points.items():
        (sweep / name).mkdir()
        (sweep / name / "result.json").write_text(json.dumps(
            {"heads_total": total, "heads_kept": kept, "lam": lam, "keep": None, "step": 10,
             "metrics": {"bleu": 29.0, "polarized": 1.0}, "model_sha256": "a", "dev": _dev("flat")}))
        blocks = {kind: {str(layer): {"n_heads": 2, "kept_heads": [0] if layer in layers else [], "kept_kv_heads": []}
                         for layer in range(4)}
                  for kind, layers in (("dec_self", self_layers), ("dec_cross", cross_layers))}
        (sweep / name / "kept.json").write_text(json.dumps({"blocks": blocks}))
    claim = {c.key: c for c in compute_claims({"m": ModelResults(res, "m")})}["sec6.3.2"]
    return claim.checks[0].cells["m"]


def test_a_kind_with_no_head_left_is_not_a_failure_of_the_layer_claim(tmp_path):
    """Regression (EN-FR Sec. 6.3.2): the sparsest point kept no decoder self-attention head, its
    mean layer was NaN and the claim "did not hold". The sparsest point with heads of both kinds
    decides; with none, the claim is not testable."""
    cell = _decoder_sweep(tmp_path, {
        "lam-0.05": (0.05, {"enc_self": 1, "dec_self": 0, "dec_cross": 2}, [], [2, 3]),
        "lam-0.01": (0.01, {"enc_self": 2, "dec_self": 2, "dec_cross": 2}, [0, 1], [2, 3])})
    assert cell.verdict == "holds"
    assert cell.value.startswith("lam-0.01, fixed lambda 0.01: 1.5 / 3.5 (middle 2.5)")
    assert cell.value.endswith("sparser, with a kind at 0 heads: lam-0.05")
    alone = _decoder_sweep(tmp_path / "b", {"lam-0.05": (0.05, {"enc_self": 1, "dec_self": 0, "dec_cross": 2}, [], [2, 3])})
    assert alone.verdict == "not testable: no point keeps heads of both kinds"


# ----------------------------------------------------------------------------- zero counts


def test_a_zero_count_is_never_partly():
    """Regression (Sec. 5.2, EN-FR in domain; the news model on EWT): 0 of 8 relation-directions
    met the bar under both readings, and the verdict read "partly"."""
    assert _readings_verdict([0, 0], ["does not hold", "inconclusive: a best head's interval contains the bar"]) == \
        "does not hold: no relation-direction meets the bar under either reading (does not hold under the points " \
        "reading, inconclusive under the relative)"
    assert _readings_verdict([0, 1], ["does not hold", "inconclusive: x"]).startswith("inconclusive: ")
    assert _readings_verdict([1, 2], ["holds", "does not hold"]).startswith("partly: ")
    assert _readings_verdict([2, 2], ["holds", "holds"]) == "holds"


def test_table1_with_no_syntactic_head_does_not_hold():
    """Claim level: the best head's accuracy is under both bars, but its interval reaches the
    relative bar (1.1 x baseline): the zero count decides."""
    table = {"table": [{"relation": "nsubj", "label": "v -> s", "status": "ok", "best_head": [0, 1],
                        "best_accuracy": 0.43, "baseline": 0.40, "baseline_offset": -1, "n_arcs": 300,
                        "n_syntactic": 0}]}
    cell, _ = _table1_cells(table)
    assert cell.value == "0 / 0 of 1" and cell.verdict.startswith("does not hold")


# ----------------------------------------------------------------------------- Sec. 4


def _sec4(tmp_path, lrp, conf):
    res = tmp_path / "m"
    HeadScores({"enc_self": lrp}, "lrp").save(res / "importance" / "lrp.json")
    HeadScores({"enc_self": conf}, "confidence").save(res / "importance" / "confidence.json")
    return {c.key: c for c in compute_claims({"m": ModelResults(res, "m")})}["sec4"].checks


def test_the_layer1_criterion_can_pass_with_8_heads(tmp_path):
    """Regression: with 8 heads a layer's chance share is at least 1/8, so the old "random
    layer-1 head, p < 0.05" criterion could never hold. The head among the least confident
    quarter of the encoder holds; one at or above the median does not; in between, inconclusive."""
    lrp = np.full((6, 8), 0.1)
    lrp[:, 0] = 0.9
    conf = np.linspace(0.2, 0.7, 48).reshape(6, 8)
    conf[0, 0] = 0.1  # the most relevant head of layer 1, the least confident of all
    checks = _sec4(tmp_path / "a", lrp, conf)
    assert checks[2].cells["m"].verdict == "holds"
    assert checks[2].cells["m"].value.startswith("L0 H0: 0.10 (encoder lower quartile")
    conf[0, 0] = 0.69
    assert _sec4(tmp_path / "b", lrp, conf)[2].cells["m"].verdict == "does not hold"
    conf[0, 0] = float(np.quantile(conf, 0.4))
    assert _sec4(tmp_path / "c", lrp, conf)[2].cells["m"].verdict.startswith("inconclusive: below the encoder median")


def test_the_dominance_share_is_of_magnitudes_not_signed_relevances(tmp_path):
    """Regression (EN-DE's last layer: all eight heads negative): the top head's share was a
    signed value over the sum of magnitudes (-3.4%), so a layer dominated by one head failed."""
    row = np.array([-0.80, -0.05, -0.05, -0.02, -0.02, -0.02, -0.02, -0.02])
    share, ratio, head, sign = _dominance(row)
    assert head == 0 and sign == -0.80 and math.isclose(share, 0.80 / 1.0) and math.isclose(ratio, 16.0)
    lrp = np.tile(np.array([0.9, 0.02, 0.02, 0.02, 0.01, 0.01, 0.01, 0.01]), (6, 1))
    lrp[5] = row
    cell = _sec4(tmp_path, lrp, np.full((6, 8), 0.3))[0].cells["m"]
    assert cell.verdict == "holds"
    assert "L5 H0 80.0% (16.0x, negative)" in cell.value
    even = np.full((6, 8), 0.1)
    assert _sec4(tmp_path / "even", even, np.full((6, 8), 0.3))[0].cells["m"].verdict == "does not hold"


def test_the_summary_opens_with_the_titles_claim_from_its_result_file(tmp_path):
    """Issue 35, item 5: the first rows are the heavy-lifting tests, read from their result file."""
    import json

    from reproduction.render import _title_rows

    assert _title_rows(tmp_path / "absent.json")[-1].endswith("not run (no results.json) |")
    cmp = {"newstest2019": {"difference": 0.05}}
    result = {"h1": {"verdict": "holds", "comparisons": [cmp, {"newstest2019": {"difference": -0.02}}]},
              "h2": {"verdict": "partly", "rows": [{"run": "gates-keep6", "kept": 6, "primary": {"labelled_kept": 3}},
                                                   {"run": "gates-lam0.1", "kept": 7, "primary": {"labelled_kept": 1}}]},
              "h3": {"verdict": "does not hold", "newstest2019": {"p": 0.5}, "ewt-test": {"p": 0.25}}}
    (tmp_path / "results.json").write_text(json.dumps(result))
    nmt = {"h1_verdict": {"verdict": "inconclusive", "why": "not settled at k = [8]"}, "h3": [{}, {}],
           "h3_verdict": {"verdict": "inconclusive", "why": "runs missing"}, "missing": ["scratch-full"]}
    (tmp_path / "nmt.json").write_text(json.dumps(nmt))
    rows = _title_rows(tmp_path / "results.json", tmp_path / "no-second-epoch.json", tmp_path / "nmt.json")
    assert "| holds (gates - control on newstest2019 from -0.020 to +0.050 nats) |" in rows[4]
    assert rows[5].endswith("| partly (3 of 6 kept at 6 heads) |")  # budget points only
    assert rows[6].endswith("| does not hold (p = 0.50 / 0.25) |")
    # the translation rows (issue 35), read from the NMT report's verdicts; without it: not run
    assert rows[7].endswith("| inconclusive (not settled at k = [8]) |")
    assert rows[8].endswith("| from scratch, 2 points | inconclusive (runs missing: scratch-full) |")
    assert _title_rows(tmp_path / "results.json", tmp_path / "no-second-epoch.json",
                       tmp_path / "none.json")[7].endswith("| not run (no results.json) |")
    # A second epoch's results replace H1 (only): the plan's step after an inconclusive first epoch
    second = {"h1": {"verdict": "inconclusive: a run has not settled (least-6)", "comparisons": [cmp]},
              "h1_without_settling": {"verdict": "does not hold"}, "h2": {"verdict": "holds", "rows": []}}
    (tmp_path / "epoch2.json").write_text(json.dumps(second))
    rows = _title_rows(tmp_path / "results.json", tmp_path / "epoch2.json")
    assert "(two epochs, the plan's step after one)" in rows[4]
    assert rows[4].endswith("| inconclusive: a run has not settled (least-6) (gates - control on newstest2019 from "
                            "+0.050 to +0.050 nats; with every run taken as settled: does not hold) |")
    assert rows[5].endswith("| partly (3 of 6 kept at 6 heads) |")  # H2 stays the first epoch's
