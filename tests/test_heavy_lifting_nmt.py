"""The translation heavy-lifting experiment (experiments/heavy_lifting_nmt.md): its labels, plan and
decision rules on constructed numbers, and the bootstrap on constructed translations; no model
is trained here (the driver was run end to end with --extra-*-args, docs/results/heavy-lifting-nmt)."""

import argparse
import json
import math
from pathlib import Path

import pytest

from support.experiments import load_experiment

REPO = Path(__file__).resolve().parents[1]


driver, report = load_experiment("heavy_lifting_nmt"), load_experiment("heavy_lifting_nmt_report")
FUNCTIONS = REPO / "docs" / "results" / "reproduction" / "multi30k-en-de" / "functions"


def test_the_committed_labels_are_those_of_the_functions_results():
    labels = driver.labels_from_functions(FUNCTIONS)
    committed = json.loads((REPO / "docs" / "results" / "heavy-lifting-nmt" / "labels.json").read_text())
    assert labels["heads"] == committed["heads"] and labels["sha256"] == committed["sha256"]
    assert labels["specialised"] == [[2, 5]]  # the rare-token head; no positional or syntactic head reaches its bar
    assert driver.least_specialised(labels, 2) == [(0, 4), (0, 5)]
    # The score file's k best heads are the k least specialised, for every k of the plan.
    ranked = sorted(((v, layer, h) for layer, row in enumerate(driver.least_scores(labels)) for h, v in enumerate(row)),
                    reverse=True)
    for k in driver.KS:
        assert sorted((layer, h) for _, layer, h in ranked[:k]) == driver.least_specialised(labels, k)


def test_the_plan_runs_every_control_and_the_fair_table_2_once():
    labels = json.loads((REPO / "docs" / "results" / "heavy-lifting-nmt" / "labels.json").read_text())
    stage1, stage2 = driver.plan(labels, 1), driver.plan(labels, 2)
    names = [c["name"] for c in stage1]
    assert len(names) == len(set(names)) == 4 + 12 + 1 + 4
    assert {c["steps"] for c in stage1 if c["type"] == "control"} == {864}
    assert {c["steps"] for c in stage2} == {1728} and not any(c["type"] == "scratch" for c in stage2)
    assert [driver.eval_file(c) for c in (stage1[0], stage2[0])] == ["eval.json", "eval-1728.json"]
    assert {c["name"] for c in stage2 if c["type"] == "gated"} == {f"gated-{p}" for p in driver.GATED.values()} | \
        {"gated-lam-0"}


def test_non_inferiority_never_calls_an_interval_containing_0_but_crossing_the_bound_no_loss():
    assert report.non_inferiority(-0.5, 0.8) == "non-inferior"
    assert report.non_inferiority(-1.6, 0.25) == "undecided"  # contains 0, reaches below -1
    assert report.non_inferiority(-2.5, -1.2) == "inferior"
    assert report.non_inferiority(float("nan"), 0.3) == "undecided"


def _row(k, above, below=0.5, settled=True, heads=None):
    comparison = {"difference": 1.0, "low": 0.1, "high": 2.0, "p_above": above, "p_below": below}
    return {"k": k, "equal_heads": heads is None or heads == k, "vs_random": comparison, "vs_least": comparison,
            "settled": {"gated": settled, "controls": True}}


def test_h1_rules():
    significant = [_row(k, 0.0001) for k in driver.KS]
    assert report._h1_verdict(significant)[0] == "holds"
    assert report._h1_verdict([_row(8, 0.3)] + significant[1:])[0] == "partly"
    assert report._h1_verdict([_row(k, 0.3) for k in driver.KS])[0] == "does not hold"
    control_better = [_row(8, 0.9, below=0.0001)] + significant[1:]
    assert report._h1_verdict(control_better)[0] == "does not hold"
    verdict, why = report._h1_verdict([_row(8, 0.0001, settled=False)] + significant[1:])
    assert verdict == "inconclusive" and "not settled at k = [8]" in why and "8 of 8" in why
    assert report._h1_verdict([_row(8, 0.0001, heads=9)] + significant[1:])[0] == "inconclusive"
    assert report._h1_verdict([{"k": 8, "missing": True}] + significant[1:])[0] == "inconclusive"
    # every ground is named (stage 2: points that closed a head and runs not settled), with the equal-budget reading
    verdict, why = report._h1_verdict([_row(8, 0.0001, heads=7, settled=False), _row(5, 0.0001, settled=False)]
                                      + significant[2:])
    assert verdict == "inconclusive"
    assert "does not keep k encoder heads at k = [8]" in why and "not settled at k = [8, 5]" in why and "8 of 8" in why


def _h3(low, high, settled=True, heads_match=True):
    return {"point": "p", "difference": {"difference": (low + high) / 2, "low": low, "high": high},
            "pruned_settled": settled, "heads_match": heads_match}


def test_h3_rules():
    calibrated = {"difference": -0.2, "low": -0.8, "high": 0.4, "call": "non-inferior"}
    assert report._h3_verdict([_h3(0.2, 1.5)] * 3, calibrated)[0] == "holds"
    assert report._h3_verdict([_h3(-0.6, 0.7)] * 3, calibrated)[0] == "does not hold"  # all within +-1
    assert report._h3_verdict([_h3(0.2, 1.5), _h3(-2.0, -0.1), _h3(0.2, 1.5)], calibrated)[0] == "does not hold"
    assert report._h3_verdict([_h3(0.2, 1.5), _h3(-0.5, 1.5), _h3(0.2, 1.5)], calibrated)[0] == "inconclusive"
    assert report._h3_verdict([_h3(0.2, 1.5, settled=False)] * 3, calibrated)[0] == "inconclusive"
    handicapped = {**calibrated, "low": -2.0, "call": "undecided"}
    verdict, why = report._h3_verdict([_h3(0.2, 1.5)] * 3, handicapped)
    assert verdict == "inconclusive" and "does not reproduce the bundled model" in why
    assert report._h3_verdict([_h3(0.2, 1.5)] * 3, None)[0] == "inconclusive"
    # a pruned point continued at stage 2 that closed a head is not the architecture trained from scratch
    verdict, why = report._h3_verdict([_h3(0.2, 1.5, heads_match=False)] + [_h3(0.2, 1.5)] * 2, calibrated)
    assert verdict == "inconclusive" and "no longer has the heads trained from scratch: p" in why
    assert report._h3_verdict([{k: v for k, v in _h3(0.2, 1.5).items() if k != "heads_match"}] * 3,
                              calibrated)[0] == "holds"  # a results.json of before the check: matched, as evaluated


def test_the_summary_rows_read_stage_2_where_it_exists(tmp_path):
    """docs/reproduction.md's title rows: stage 1's verdicts, superseded by stage-2/results.json beside them."""
    from reproduction.render import _nmt_rows

    def result(h1, h3):
        return json.dumps({"h1_verdict": {"verdict": "inconclusive", "why": h1}, "h3": [{}] * 3,
                           "h3_verdict": {"verdict": "inconclusive", "why": h3}})

    (tmp_path / "results.json").write_text(result("first h1", "first h3"))
    rows = _nmt_rows(tmp_path / "results.json")
    assert "(first h1)" in rows[0] and "(first h3)" in rows[1] and "stage-2" not in rows[0]
    (tmp_path / "stage-2").mkdir()
    (tmp_path / "stage-2" / "results.json").write_text(result("second h1", "second h3"))
    rows = _nmt_rows(tmp_path / "results.json")
    assert "(stage 2: second h1)" in rows[0] and "(stage 2: second h3)" in rows[1]
    assert "[stage-2/results.md](results/heavy-lifting-nmt/stage-2/results.md)" in rows[0]


def test_holm_and_the_hypergeometric_tail():
    assert report.holm([0.01, 0.04, 0.03]) == [True, False, False]
    assert report.hypergeometric_tail(0, 48, 1, 8) == 1.0
    assert math.isclose(report.hypergeometric_tail(1, 48, 1, 8), 8 / 48)


def test_the_bootstrap_difference_of_identical_systems_is_zero_and_of_a_better_one_positive():
    references = [f"a small dog runs on the green grass number {i}" for i in range(40)]
    worse = [f"a dog runs on grass number {i}" for i in range(40)]
    boot = report.Bootstrap(references, resamples=200)
    same = boot.difference([boot.stats(worse)], [boot.stats(worse)])
    assert same["difference"] == same["low"] == same["high"] == 0.0
    better = boot.difference([boot.stats(references)], [boot.stats(worse)])
    assert better["low"] > 0 and better["p_above"] == pytest.approx(1 / 201)
    # The random control is the mean of its seeds, resample by resample.
    mean = boot.difference([boot.stats(references), boot.stats(worse)], [boot.stats(worse)])
    assert mean["difference"] == pytest.approx(better["difference"] / 2)


def test_archive_keeps_the_result_files_not_the_weights_and_the_report_reads_the_copy(tmp_path):
    runs, archived = tmp_path / "runs", tmp_path / "archive"
    train = runs / "least-1" / "baseline" / "ft-scores-1-None"
    for directory in ("last", "tokenizer", "dev"):
        (train / directory).mkdir(parents=True)
    (train / "last" / "model.safetensors").write_bytes(b"weights")
    (train / "tokenizer" / "tokenizer.json").write_text("{}")
    (train / "dev" / "step-108.txt").write_text("ein Hund\n")
    (train / "hypotheses.txt").write_text("ein Hund\nzwei Katzen\n", encoding="utf-8")
    (runs / "least-1" / "baseline" / ".headlab").mkdir()
    (runs / "least-1" / "baseline" / ".headlab" / "lock").write_text("")
    pruned = runs / "least-1" / "prune" / "pruned"  # a gated point's pruned model: its record stays, the rest loads it
    pruned.mkdir(parents=True)
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "pruned_heads.py",
                 "headlab_pruning.json"):
        (pruned / name).write_text("{}")
    (runs / "least-2" / "baseline").mkdir(parents=True)  # not finished: no eval.json
    evaluation = {"config": {"name": "least-1"}, "hypotheses": str(train / "hypotheses.txt"),
                  "hypotheses_sha256": driver.sha256(train / "hypotheses.txt")}
    (runs / "least-1" / "eval.json").write_text(json.dumps(evaluation))

    assert driver.archive(runs, archived) == ["least-1"]
    kept = sorted(str(p.relative_to(archived)) for p in archived.rglob("*") if p.is_file())
    assert kept == ["least-1/baseline/ft-scores-1-None/dev/step-108.txt",
                    "least-1/baseline/ft-scores-1-None/hypotheses.txt", "least-1/eval.json",
                    "least-1/prune/pruned/headlab_pruning.json"]
    assert driver.archive(runs, archived) == []  # archived already
    evaluation["seconds_this_session"] = 1.0  # run again: the copy replaced, nothing left beside it
    (runs / "least-1" / "eval.json").write_text(json.dumps(evaluation))
    assert driver.archive(runs, archived) == ["least-1"]
    assert sorted(p.name for p in archived.iterdir()) == ["least-1"]

    # The report reads the archived copy, not the path written at the run (gone on another machine).
    (train / "hypotheses.txt").unlink()
    copy = archived / "least-1" / "baseline" / "ft-scores-1-None" / "hypotheses.txt"
    assert report.hypotheses_file(archived / "least-1", evaluation) == copy
    copy.write_text("ein Hund\ndrei Katzen\n", encoding="utf-8")  # not the translations that were scored
    with pytest.raises(SystemExit, match="SHA-256"):
        report.hypotheses_file(archived / "least-1", evaluation)
    copy.unlink()
    with pytest.raises(SystemExit, match="neither at"):
        report.hypotheses_file(archived / "least-1", evaluation)


def test_a_stage_2_continuation_is_archived_beside_stage_1_which_stays_as_scored(tmp_path):
    runs, archived = tmp_path / "runs", tmp_path / "archive"
    train = runs / "least-1" / "baseline" / "ft-scores-1-None"
    train.mkdir(parents=True)
    (train / "hypotheses.txt").write_text("ein Hund\n", encoding="utf-8")
    stage1 = {"config": {"name": "least-1", "steps": 864}, "hypotheses": str(train / "hypotheses.txt"),
              "hypotheses_sha256": driver.sha256(train / "hypotheses.txt")}
    (runs / "least-1" / "eval.json").write_text(json.dumps(stage1))
    assert driver.archive(runs, archived) == ["least-1"]

    # Stage 2 rewrites the translations in the same run directory and writes eval-1728.json.
    (train / "hypotheses.txt").write_text("ein kleiner Hund\n", encoding="utf-8")
    stage2 = {"config": {"name": "least-1", "steps": 1728}, "hypotheses": str(train / "hypotheses.txt"),
              "hypotheses_sha256": driver.sha256(train / "hypotheses.txt")}
    (runs / "least-1" / "eval-1728.json").write_text(json.dumps(stage2))
    assert driver.archive(runs, archived) == ["least-1/stage-2"]
    first = archived / "least-1" / "baseline" / "ft-scores-1-None" / "hypotheses.txt"
    assert first.read_text(encoding="utf-8") == "ein Hund\n"  # stage 1's copy as it was scored
    assert not (archived / "least-1" / "eval-1728.json").exists()
    second = archived / "least-1" / "stage-2" / "baseline" / "ft-scores-1-None" / "hypotheses.txt"
    assert second.read_text(encoding="utf-8") == "ein kleiner Hund\n"

    # The report reads each stage from its own copy, the run directory gone.
    import shutil

    shutil.rmtree(runs)
    for stage, evaluation, copy in ((1, stage1, first), (2, stage2, second)):
        runs_read = report.Runs(archived, tmp_path, stage)
        assert runs_read.control("least-1") == evaluation
        assert report.hypotheses_file(runs_read.directories["least-1"], evaluation) == copy
    assert report.Runs(archived, tmp_path, 2).scratch("least-1") == stage1  # from-scratch runs have no stage 2

    # A stage-1 copy made again (another machine's run directory) keeps the archived continuation.
    train.mkdir(parents=True)
    (train / "hypotheses.txt").write_text("ein Hund\n", encoding="utf-8")
    (runs / "least-1" / "eval.json").write_text(json.dumps({**stage1, "seconds_this_session": 1.0}))
    assert driver.archive(runs, archived) == ["least-1"]
    assert second.read_text(encoding="utf-8") == "ein kleiner Hund\n"


@pytest.mark.parametrize("stage", [1, 2])
def test_run_skips_a_configuration_finished_in_the_archive_at_its_stage(tmp_path, stage):
    labels = REPO / "docs" / "results" / "heavy-lifting-nmt" / "labels.json"
    copy = driver.archived_dir(tmp_path / "archive", "least-1", stage)
    copy.mkdir(parents=True)
    (copy / ("eval.json" if stage == 1 else "eval-1728.json")).write_text("{}")
    args = argparse.Namespace(
        root=str(tmp_path / "runs"), model=str(REPO / "models" / "multi30k-en-de"), deadline=None,
        labels=str(labels), only="least-1", data=str(REPO / "data" / "multi30k"),
        results=str(REPO / "docs" / "results" / "reproduction" / "multi30k-en-de"), stage=stage,
        extra_train_args=None, extra_control_args=None, extra_scratch_args=None, extra_gated_args=None,
        archived=str(tmp_path / "archive"))
    runner = driver.Runner(args)
    runner.headlab = lambda argv, log: pytest.fail(f"ran {argv}")  # type: ignore[method-assign]
    config = next(c for c in driver.plan(json.loads(labels.read_text()), stage) if c["name"] == "least-1")
    runner.run_one(config)
    assert "archived" in (tmp_path / "runs" / "STATUS").read_text()

