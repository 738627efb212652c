"""BLEU's bootstrap intervals (headlab.nmt.bleu): the paired difference of two systems and the
interval of one (Koehn 2004), against sacreBLEU's corpus score."""

import pytest
from sacrebleu.metrics import BLEU

from headlab.nmt.bleu import bleu_interval, paired_bootstrap

REFS = [f"a man rides a {c} horse near the {d} river" for c in ("red", "brown", "white", "black", "grey")
        for d in ("old", "wide", "quiet", "cold")]


def _worse(refs, every=2):
    """Drop a word from every ``every``-th reference: a system measurably below the references."""
    return [" ".join(r.split()[:-2]) if i % every == 0 else r for i, r in enumerate(refs)]


def test_paired_bootstrap_difference_matches_corpus_bleu_and_brackets_it():
    base, system = _worse(REFS), REFS
    out = paired_bootstrap(base, system, REFS, n_samples=200)
    expected = BLEU().corpus_score(system, [REFS]).score - BLEU().corpus_score(base, [REFS]).score
    assert out["delta"] == pytest.approx(expected)
    assert 0 < out["low"] <= out["delta"] <= out["high"]
    assert 0 <= out["p"] <= 1


def test_identical_systems_differ_by_exactly_zero():
    hyps = _worse(REFS, 3)
    out = paired_bootstrap(hyps, hyps, REFS, n_samples=100)
    assert out["delta"] == out["low"] == out["high"] == 0


def test_bleu_interval_contains_the_corpus_score():
    score, low, high = bleu_interval(_worse(REFS), REFS, n_samples=200)
    assert score == pytest.approx(BLEU().corpus_score(_worse(REFS), [REFS]).score)
    assert low <= score <= high and low < high
