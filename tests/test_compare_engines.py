"""experiments/compare_engines.py (issue 34): the engines compared value by value on a tiny shape,
and its pre-registered rule (experiments/kernel_default.md) on constructed comparisons."""

from __future__ import annotations

import json

import pytest
import torch

from support.experiments import load_experiment

ce = load_experiment("compare_engines")


def test_the_script_compares_the_cpu_engines_on_a_tiny_shape(tmp_path, capsys):
    from headlab.data.alignment import AttentionView

    views = dict(AttentionView.__dict__)
    out = tmp_path / "compare.json"
    code = ce.main(["--shape", "tiny", "--layers", "1", "--lengths", "24", "--short", "5", "--short-batch", "3",
                    "--dtypes", "float64", "--engines", "chunked", "fused", "--json", str(out)])
    summary = json.loads(out.read_text())
    assert all(AttentionView.__dict__[name] is views[name] for name in ("token_argmax", "word_argmax"))  # restored
    assert code == 3 and summary["verdict"]["kernel_default"] == "undecided"  # no GPU, no kernel, no bfloat16
    assert all(check["passed"] for check in summary["checks"]), summary["checks"]
    assert [(r["engine"], r["dtype"]) for r in summary["runs"]] == [("chunked", "float64"), ("fused", "float64")]
    for run in summary["runs"]:
        names = {name.split("/", 1)[1] for name in run["files"]}
        assert {"aggregate/mean_entropy.json", "positional/share.json", "syntactic/margin.json",
                "rare_tokens/rarest.json", "aggregate/exemplars.json", "importance/confidence"} <= names
        # every query row of both treebanks: the long sentence (24 words) and the short ones, per head
        assert run["decisions"]["token"]["compared"] > 24 and run["decisions"]["word"]["missing_batches"] == 0
        assert run["exemplars"]["compared"] > 0
    assert "verdict: the kernel as the default on CUDA: undecided" in capsys.readouterr().out


def test_decisions_differing_at_a_near_tie_and_beyond(monkeypatch):
    """The near-tie rule on one row: the reference's weights 0.50 (key 2), 0.49 (key 0), 0.01 (key 1)."""
    probs = torch.tensor([[[[0.49, 0.01, 0.50]]]])
    reference = {("dec_self", 0, "token"): [(torch.tensor([[[2]]]), torch.tensor([[[True]]]),
                                             *probs.topk(3, dim=-1))]}

    def engine(choice: int) -> dict:
        return {("dec_self", 0, "token"): [(torch.tensor([[[choice]]]), None, None, None)]}

    same, tie, far = (ce.compare_decisions(engine(c), reference, tau=0.05)["token"] for c in (2, 0, 1))
    assert (same["compared"], same["differing"]) == (1, 0)
    assert (tie["differing"], tie["near_ties"]) == (1, 1)  # 0.49 >= 0.95 x 0.50
    assert tie["largest_gap"] == pytest.approx(0.02)
    assert (far["differing"], far["near_ties"]) == (1, 0)
    assert ce.compare_decisions(engine(0), reference, tau=0.01)["token"]["near_ties"] == 0  # 0.49 < 0.99 x 0.50


def _run(engine, dtype, rel=0.0, differing=0, ties=0, seconds=None, fallback=None):
    row = {"engine": engine, "dtype": dtype, "tie_margin": ce.TIE[dtype], "kernel_fallback": fallback or {},
           "files": {"long-4096/aggregate/mean_entropy.json": {"values": 64, "differing": 1, "max_abs": rel,
                                                               "max_rel": rel, "n_mismatched": 0, "mismatched": []},
                     "long-4096/positional/share.json": {"values": 64, "differing": 3, "max_abs": 0.1,
                                                         "max_rel": 0.5, "n_mismatched": 0, "mismatched": []}},
           "decisions": {level: {"compared": 10000, "differing": differing, "near_ties": ties, "missing_batches": 0,
                                 "largest_gap": 0.0}
                         for level in ("token", "word")},
           "exemplars": {"compared": 100, "differing": 0, "near_ties": 0}}
    if seconds is not None:
        row["seconds"] = seconds
    return row


def _runs(**kernel16):
    fused16 = _run("fused", "bfloat16", rel=4e-3, differing=40, ties=38, seconds=2.0)
    args = {"rel": 4e-3, "differing": 40, "ties": 38, "seconds": 1.0, **kernel16}
    return [fused16, _run("kernel", "bfloat16", **args), _run("fused", "float32", rel=1e-7, differing=2, ties=2),
            _run("kernel", "float32", rel=2e-7, differing=1, ties=1)]


@pytest.mark.parametrize(("kernel16", "expected", "failed"), [
    ({}, "yes", None),  # as good as fused, faster
    ({"rel": 6e-3}, "yes", None),  # worse, within 1.5 x 4e-3 + 2^-10
    ({"rel": 8e-3}, "no", "non-inferior to fused's"),  # a too-large error: 8e-3 > 6e-3 + 2^-10
    ({"differing": 44, "ties": 40}, "no", "token decisions"),  # 4 changes that are not near ties, fused 2 x 1.5 = 3
    ({"differing": 70, "ties": 70}, "yes", None),  # more changes, all near ties: within 1.5 x 40 + 0.1% of 10,000
    ({"seconds": 2.5}, "no", "speed"),
    ({"fallback": {"long-4096": {"model": "could not compile"}}}, "no", "no fallback"),
])
def test_the_rule_on_constructed_comparisons(kernel16, expected, failed):
    checks, verdict = ce.verdict(_runs(**kernel16), on_cuda=True)
    assert verdict["kernel_default"] == expected, checks
    assert verdict["exit"] == {"yes": 0, "no": 1}[expected]
    bad = [c["check"] for c in checks if not c["passed"]]
    assert (failed is None and not bad) or (failed is not None and any(failed in name for name in bad)), bad


def test_the_rule_in_float32_wants_near_ties_and_1e_5():
    runs = _runs()
    runs[3] = _run("kernel", "float32", rel=2e-5)  # sums beyond 1e-5
    assert ce.verdict(runs, on_cuda=True)[1]["kernel_default"] == "no"
    runs[3] = _run("kernel", "float32", rel=1e-6, differing=3, ties=2)  # one decision changed beyond a near tie
    assert ce.verdict(runs, on_cuda=True)[1]["kernel_default"] == "no"
    runs[3] = _run("kernel", "float32", rel=1e-6, differing=3, ties=3)  # only near ties
    assert ce.verdict(runs, on_cuda=True)[1]["kernel_default"] == "yes"


def test_the_rule_is_undecided_without_what_it_needs():
    runs = _runs()
    assert ce.verdict(runs, on_cuda=False)[1] == {"kernel_default": "undecided", "exit": 3, "needs": ["a CUDA GPU"]}
    assert ce.verdict(runs[2:], on_cuda=True)[1]["needs"] == ["kernel in bfloat16", "fused in bfloat16"]
    untimed = [{k: v for k, v in r.items() if k != "seconds"} for r in runs]
    assert ce.verdict(untimed, on_cuda=True)[1]["needs"] == ["the timing (--time)"]


def test_values_relative_to_the_scores_and_the_signature_held_equal():
    expected = {"signature": {"words": 1000, "window": 10}, "scores": {"enc_self": [[1.0, 2.5], [None, 0.5]]}}
    got = {"signature": {"words": 1000, "window": 10}, "scores": {"enc_self": [[1.0, 2.0], [None, 0.5]]}}
    out = ce.compare_values(got, expected)
    assert (out["values"], out["differing"], out["n_mismatched"]) == (6, 1, 0)
    assert out["max_abs"] == 0.5 and out["max_rel"] == 0.2  # over the scores' largest value, not the word count
    got["signature"]["words"], got["scores"]["enc_self"][1][0] = 999, 0.1
    out = ce.compare_values(got, expected)
    assert out["n_mismatched"] == 2 and out["max_abs"] == 0.5  # a count of the data, a null against a number


@pytest.mark.parametrize("argv", [["--dtypes", "float64", "--reference-dtype", "float32"], ["--lengths", "--short", "0"],
                                  ["--engines", "kernel", "--device", "cpu"]])
def test_bad_options_exit_2_before_any_work(argv, monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(SystemExit) as exit_:
        ce.main(argv)
    assert exit_.value.code == 2 and "error:" in capsys.readouterr().err
