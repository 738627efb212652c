"""The decision rules of the heavy-lifting experiment (experiments/heavy_lifting_lm.md) on
constructed numbers: no model, no run."""

import importlib.util
import math
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("heavy_lifting_report", REPO / "experiments" / "heavy_lifting_report.py")
report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(report)


def _run(losses_per_sentence, tokens=10, kept=None):
    """A run whose every sentence has the given mean loss per token, on both evaluation sets."""
    nll = [float(x) * tokens for x in losses_per_sentence]
    sets = {name: {"sentence_nll": nll, "sentence_tokens": [tokens] * len(nll), "sentences": len(nll)}
            for name in report.SETS}
    return {"sets": sets, "kept": kept or []}


def test_holm_and_the_hypergeometric_tail():
    assert report.holm([0.01, 0.04, 0.03]) == [True, False, False]  # 0.01 <= 0.05/3; 0.03 > 0.05/2 stops
    assert report.holm([0.001, 0.02, 0.04]) == [True, True, True]
    # 6 labelled of 48, 6 drawn: all six kept by chance is 1 / C(48, 6)
    assert math.isclose(report.hypergeometric_tail(6, 48, 6, 6), 1 / math.comb(48, 6))
    assert report.hypergeometric_tail(0, 48, 6, 6) == 1.0
    assert math.isclose(sum(report.hypergeometric_tail(x, 48, 6, 12) - report.hypergeometric_tail(x + 1, 48, 6, 12)
                            for x in range(7)), 1.0)


def test_paired_difference_and_non_inferiority():
    rng = np.random.default_rng(0)
    base = rng.uniform(4, 6, size=300)
    idx = {name: report.resample_indices(300, 2000) for name in report.SETS}
    better = report.paired_difference([_run(base - 0.1)], [_run(base)], "newstest2019", idx["newstest2019"])
    assert math.isclose(better["difference"], -0.1) and better["high"] < 0 and better["p_below"] < 0.001
    noisy = base + rng.normal(0, 1.0, size=300)  # same mean: an interval around 0
    d = report.paired_difference([_run(noisy)], [_run(base)], "newstest2019", idx["newstest2019"])
    assert d["low"] < 0 < d["high"]
    # An interval that contains 0 but crosses the bound is undecided, not "no loss".
    assert report.non_inferiority({"low": -0.02, "high": 0.08}) == "undecided"
    assert report.non_inferiority({"low": -0.02, "high": 0.03}) == "non-inferior"
    assert report.non_inferiority({"low": 0.06, "high": 0.09}) == "inferior"


def test_a_run_still_falling_has_not_settled():
    flat = [{"step": s, "loss": 4.0} for s in range(25, 476, 25)]
    falling = [{"step": s, "loss": 5.0 - s / 400} for s in range(25, 476, 25)]
    assert report.settled(flat) is True and report.settled(falling) is False
    assert report.settled(flat[:3]) is None  # too few records to tell


def test_h1_verdicts_on_constructed_runs():
    base = np.random.default_rng(1).uniform(4, 6, size=200)
    idx = {name: report.resample_indices(200, 2000) for name in report.SETS}
    runs = {}
    for k in report.KEEPS:
        runs[f"gates-keep{k}"] = _run(base)
        runs[f"least-{k}"] = _run(base + 0.3)
        for s in report.SEEDS:
            runs[f"random-{k}-s{s}"] = _run(base + 0.2)
    assert report.rule_h1(runs, idx, set())["verdict"] == "holds"
    assert report.rule_h1(runs, idx, {"least-6"})["verdict"].startswith("inconclusive: a run has not settled")
    runs["least-24"] = _run(base - 0.3)  # a control better than the gates
    assert report.rule_h1(runs, idx, set())["verdict"] == "does not hold"
    # ... but while a run it uses still falls, the plan asks for a second epoch, not a verdict
    assert report.rule_h1(runs, idx, {"gates-keep24"})["verdict"].startswith("inconclusive: a run has not settled")
    del runs["least-24"]
    assert report.rule_h1(runs, idx, set())["verdict"] == "inconclusive: not all runs finished"


def test_h2_counts_labelled_heads_among_the_kept():
    labels = {"specialised": [[1, 2], [1, 7], [3, 1], [3, 2], [4, 7], [5, 7]]}
    runs = {f"gates-keep{k}": {"kept": [[1, 2], [1, 7], [3, 1], [3, 2], [4, 7], [5, 7]]
                               + [[0, h] for h in range(k - 6)]} for k in report.KEEPS}
    out = report.rule_h2(runs, labels)
    assert out["verdict"] == "holds"
    assert all(row["primary"]["labelled_kept"] == 6 for row in out["rows"])
    runs = {f"gates-keep{k}": {"kept": [[0, h] for h in range(8)][:k] + [[2, h] for h in range(8)][: max(0, k - 8)]
                               + [[5, h] for h in range(7)][: max(0, k - 16)]} for k in report.KEEPS}
    assert report.rule_h2(runs, labels)["verdict"] == "does not hold"


def test_the_committed_results_are_what_the_committed_runs_give(tmp_path):
    """docs/results/heavy-lifting/results.{md,json} come from runs.tar.gz (every configuration's
    eval.json and training trajectory, no weights): the page cannot drift from its result files."""
    import tarfile

    results = REPO / "docs" / "results" / "heavy-lifting"
    with tarfile.open(results / "runs.tar.gz") as archive:
        archive.extractall(tmp_path, filter="data")
    labels = __import__("json").loads((results / "labels.json").read_text())
    report.write_report(tmp_path / "heavy-lifting-gpu", labels, tmp_path / "out")
    assert (tmp_path / "out" / "results.md").read_text() == (results / "results.md").read_text()
    assert (tmp_path / "out" / "results.json").read_text() == (results / "results.json").read_text()


def test_the_second_epochs_results_are_what_its_runs_give(tmp_path):
    """docs/results/heavy-lifting/epoch2/results.{md,json} come from runs-epoch2.tar.gz (the 15 runs
    at k = 24, 12, 6 for two epochs), with the first epoch's runs.tar.gz as --previous."""
    import tarfile

    results = REPO / "docs" / "results" / "heavy-lifting"
    for name in ("runs.tar.gz", "runs-epoch2.tar.gz"):
        with tarfile.open(results / name) as archive:
            archive.extractall(tmp_path, filter="data")
    labels = __import__("json").loads((results / "labels.json").read_text())
    out = report.write_report(tmp_path / "heavy-lifting-e2", labels, tmp_path / "out", previous=tmp_path / "heavy-lifting-gpu")
    assert (tmp_path / "out" / "results.md").read_text() == (results / "epoch2" / "results.md").read_text()
    assert (tmp_path / "out" / "results.json").read_text() == (results / "epoch2" / "results.json").read_text()
    assert out["h3"]["verdict"].startswith("not in this run directory")  # no ablation in a second epoch


def test_a_reading_without_settling_is_given_beside_an_inconclusive_h1_never_as_its_verdict(tmp_path):
    import json

    base = np.random.default_rng(2).uniform(4, 6, size=60)
    root = tmp_path / "runs"
    falling = "".join(json.dumps({"step": s, "loss": 5.0 - s / 400}) + "\n" for s in range(25, 476, 25))
    names = {f"gates-keep{k}": base for k in report.KEEPS}
    names |= {f"least-{k}": base - 0.3 for k in report.KEEPS}
    names |= {f"random-{k}-s{s}": base - 0.3 for k in report.KEEPS for s in report.SEEDS}
    for name, losses in {"full": base, **names}.items():
        (root / name / "prune").mkdir(parents=True)
        (root / name / "eval.json").write_text(json.dumps(_run(losses)))
        (root / name / "prune" / "trajectory.jsonl").write_text(falling)
    labels = {"specialised": [[1, 2]], "secondary": [[1, 2]]}
    out = report.write_report(root, labels, tmp_path / "out")
    assert out["h1"]["verdict"].startswith("inconclusive: a run has not settled")
    assert out["h1_without_settling"]["verdict"] == "does not hold"  # the controls are better
    text = (tmp_path / "out" / "results.md").read_text()
    assert "Not the verdict" in text and "**H1 (gates beat both controls at equal heads): inconclusive" in text
