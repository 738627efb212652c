"""Intervals behind docs/reproduction.md's verdicts, and Vig and Belinkov's layer criteria (the BLEU
bootstrap itself, headlab.nmt.bleu, is tested in tests/test_significance.py)."""

import json

import numpy as np
import pytest
from sacrebleu.metrics import BLEU

from headlab.heads import HeadScores
from reproduction.claims import _within
from reproduction.significance import spearman_interval
from reproduction.vig import _middle, claim_vig

REFS = [f"a man rides a {c} horse near the {d} river" for c in ("red", "brown", "white", "black", "grey")
        for d in ("old", "wide", "quiet", "cold")]


def _worse(refs, every=2):
    """Drop a word from every ``every``-th reference: a system measurably below the references."""
    return [" ".join(r.split()[:-2]) if i % every == 0 else r for i, r in enumerate(refs)]


def test_spearman_interval_of_a_monotone_relation_is_one():
    x = np.arange(20.0)
    assert spearman_interval(x, x**3, n_samples=100) == (pytest.approx(1.0), pytest.approx(1.0), pytest.approx(1.0))
    rho, low, high = spearman_interval(x, -x, n_samples=100)
    assert rho == pytest.approx(-1.0) and high == pytest.approx(-1.0)


def _point(delta, half):
    return {"delta": delta, "low": delta - half, "high": delta + half, "kind": "paired"}


def test_within_follows_the_interval():
    # A point at <= 10 heads whose whole interval is above -0.15: holds.
    assert _within([(12, _point(-1.0, 0.1)), (8, _point(-0.05, 0.05))], 10, 0.15) == "holds"
    # The next larger point already loses significantly more, and so does the smaller one.
    assert _within([(12, _point(-1.0, 0.2)), (4, _point(-2.0, 0.2))], 10, 0.15) == "does not hold"
    # The interval straddles the bar: inconclusive, never holds.
    assert _within([(12, _point(-0.7, 0.7))], 10, 0.15).startswith("inconclusive")
    # Nothing between 10 heads and the full model: inconclusive.
    assert _within([(4, _point(-2.0, 0.2))], 10, 0.15).startswith("inconclusive: no point between")
    # The reason names what keeps it open: a small point's interval first, then the next larger point.
    assert _within([(12, _point(-2.0, 0.2)), (4, _point(-0.3, 0.5))], 10, 0.15) == \
        "inconclusive: an interval reaches below -0.15"
    assert _within([(4, _point(-0.3, 0.5))], 10, 0.15) == "inconclusive: an interval reaches below -0.15"
    assert _within([(12, _point(-0.1, 0.5)), (4, _point(-2.0, 0.2))], 10, 0.15) == \
        "inconclusive: the next larger point (12 heads) does not lie below -0.15"
    # A point without an interval cannot decide.
    assert _within([(12, {"delta": -3.0, "kind": "none"})], 10, 0.15).startswith("inconclusive")


def _write(directory, name, values):
    HeadScores({"enc_self": np.asarray(values, dtype=float)}, name).save(directory / f"{name}.json")


def test_vig_criteria_on_forced_statistics(tmp_path):
    rng = np.random.default_rng(0)
    layers, heads = 6, 8
    depth = np.repeat(np.arange(layers)[:, None], heads, axis=1).astype(float)
    distance = depth + 0.1 * rng.random((layers, heads))  # grows with depth, deepest longest
    bump = -((depth - 2.5) ** 2)  # alignment peaks in layers 3-4 (1-based)
    alignment = 0.2 + 0.01 * bump + 0.001 * rng.random((layers, heads))
    model = tmp_path / "m"
    (model / "pos").mkdir(parents=True)
    _write(model, "mean_distance", distance)
    _write(model, "dependency_alignment", alignment)
    _write(model, "variability", np.full((layers, heads), 0.3))
    _write(model / "pos", "NOUN", np.full((layers, heads), 0.4))
    _write(model / "pos", "DET", np.full((layers, heads), 0.1))
    (model / "pos_frequency.json").write_text(json.dumps({"enc_self": {"NOUN": 0.2, "DET": 0.1}}))
    claim = claim_vig({"m": model})
    verdicts = {check.label.split(";")[0]: check.cells["m"].verdict for check in claim.checks}
    assert verdicts["mean attention distance by layer (layer 1 .. last)"] == "holds"
    assert verdicts["dependency alignment by layer"] == "holds"
    by_label = {check.label: check for check in claim.checks}

    def row(start: str):
        return next(check for label, check in by_label.items() if label.startswith(start))

    assert row("part of speech attended most").cells["m"].value.startswith("L1 NOUN 2.0x")
    # Alignment against distance: the bump is not monotone in depth, so the data decide, not us.
    rho, low, high = spearman_interval(alignment, distance)
    assert row("Spearman of dependency alignment with mean distance over heads, all weights").cells["m"].value == \
        f"{rho:+.2f} [{low:+.2f}, {high:+.2f}]"
    assert list(_middle(6)) == [2, 3] and list(_middle(12)) == [4, 5, 6, 7]


def test_delta_uses_translations_only_when_they_give_the_recorded_bleu(tmp_path):
    from reproduction.claims import _delta
    from reproduction.results import ModelResults

    (tmp_path / "hypotheses").mkdir()
    (tmp_path / "refs.txt").write_text("\n".join(REFS) + "\n")
    (tmp_path / "hypotheses" / "full.txt").write_text("\n".join(REFS) + "\n")
    (tmp_path / "hypotheses" / "enc-p.txt").write_text("\n".join(_worse(REFS)) + "\n")
    r = ModelResults(tmp_path, "m", references=tmp_path / "refs.txt")
    full, pruned = BLEU().corpus_score(REFS, [REFS]).score, BLEU().corpus_score(_worse(REFS), [REFS]).score
    paired = _delta(r, "enc", {"point": "p", "bleu": pruned}, full)
    assert paired["kind"] == "paired" and paired["delta"] == pytest.approx(pruned - full) and paired["high"] < 0
    # The result file says another BLEU: these translations are not that point's; fall back to the bound.
    assert _delta(r, "enc", {"point": "p", "bleu": pruned + 1}, full)["kind"] == "bound"
    assert _delta(r, "enc", {"point": "missing", "bleu": pruned}, full)["kind"] == "bound"


def test_pruned_models_finds_bundled_and_work_dir_points(tmp_path):
    from headlab.resume import weights_fingerprint
    from reproduction.config import ModelEntry, ReproduceConfig
    from reproduction.significance import pruned_models

    config = ReproduceConfig(models=[ModelEntry("m", "models/m", "en", "de")], data={}, root=str(tmp_path))
    (tmp_path / "models" / "m").mkdir(parents=True)
    (tmp_path / "models" / "m" / "config.json").write_text("{}")
    weights = weights_fingerprint(tmp_path / "models" / "m")
    bundled = tmp_path / "models" / "m-pruned-enc"
    bundled.mkdir(parents=True)
    (bundled / "prune_result.json").write_text(json.dumps({"out_dir": "runs/reproduce/m/prune/enc/keep-3",
                                                           "model_sha256": weights}))
    other = tmp_path / "models" / "n-pruned-enc"  # another model's point: not this one's
    other.mkdir()
    (other / "prune_result.json").write_text(json.dumps({"out_dir": "runs/reproduce/n/prune/enc/keep-3",
                                                         "model_sha256": weights}))
    for name, recorded in (("m-pruned-old", "0" * 64), ("m-pruned-unknown", None)):  # of other or unknown weights
        (tmp_path / "models" / name).mkdir()
        (tmp_path / "models" / name / "prune_result.json").write_text(json.dumps(
            {"out_dir": f"runs/reproduce/m/prune/enc/{name}", "model_sha256": recorded}))
    work = tmp_path / "runs" / "reproduce" / "m" / "prune" / "all" / "keep-9" / "pruned"
    work.mkdir(parents=True)
    (work / "config.json").write_text("{}")
    (work.parent.parent / "lam-1" / "pruned").mkdir(parents=True)  # no weights: skipped
    assert pruned_models(config, config.models[0]) == {"enc-keep-3": bundled, "all-keep-9": work}
