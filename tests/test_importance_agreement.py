"""Agreement: Spearman correlation of each measure with ablation, per kind and pooled."""

import json
import math

import numpy as np
import pytest

from headlab import HeadScores
from headlab.errors import HeadlabError
from headlab.importance import compute_agreement, spearman, top_share


def test_spearman_matches_known_values():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ties get average ranks: ranks a = [1.5, 1.5, 3, 4], b = [1, 2, 3, 4]
    a, b = np.array([1.5, 1.5, 3, 4]), np.array([1, 2, 3, 4.0])
    expected = np.corrcoef(a, b)[0, 1]
    assert spearman([5, 5, 7, 9], [0.1, 0.2, 0.3, 0.4]) == pytest.approx(expected)
    # monotone transforms do not matter; NaN pairs are dropped; constants give NaN
    x = np.array([0.3, -1.0, 2.0, 0.5, 7.0])
    assert spearman(x, np.exp(x)) == pytest.approx(1.0)
    assert spearman([1, np.nan, 2, 3], [1, 5, 2, 3]) == pytest.approx(1.0)
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))



def _hand_written_spearman(a, b) -> float:
    """headlab's Spearman before scipy (commit 8b48774): average ranks by a merge sort, then
    sum(ra * rb) / sqrt(sum(ra^2) sum(rb^2)) of the centred ranks. The oracle of the test below."""
    a, b = np.asarray(a, dtype=np.float64).ravel(), np.asarray(b, dtype=np.float64).ravel()
    keep = ~(np.isnan(a) | np.isnan(b))
    a, b = a[keep], b[keep]
    if a.size < 2:
        return math.nan

    def ranks(values):
        order = np.argsort(values, kind="mergesort")
        out, ordered, start = np.empty(len(values)), values[order], 0
        while start < len(values):
            end = start
            while end + 1 < len(values) and ordered[end + 1] == ordered[start]:
                end += 1
            out[order[start : end + 1]] = (start + end) / 2.0 + 1.0
            start = end + 1
        return out

    ra, rb = ranks(a) - (a.size + 1) / 2.0, ranks(b) - (b.size + 1) / 2.0
    denominator = math.sqrt(float((ra**2).sum() * (rb**2).sum()))
    return math.nan if denominator == 0 else float((ra * rb).sum() / denominator)


@pytest.mark.parametrize("seed", range(20))
def test_spearman_from_scipy_equals_the_hand_written_one(seed):
    """scipy.stats.spearmanr replaced the hand-written ranks: the same rho to 1e-12 on head-sized
    vectors with ties, NaNs, infinities, constants and two-element inputs."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 1100))  # up to 32 x 32 heads and more
    a = rng.normal(size=n)
    b = a * rng.normal() + rng.normal(size=n) * rng.uniform(0, 3)
    cases = [(a, b), (np.round(a, 1), np.round(b, 0)), (np.floor(a * 2), b)]  # ties in one or both
    holes = a.copy()
    holes[rng.random(n) < 0.2] = np.nan
    cases += [(holes, b), (np.where(rng.random(n) < 0.1, np.inf, a), b), (np.ones(n), b), (a[:2], b[:2])]
    for x, y in cases:
        new, old = spearman(x, y), _hand_written_spearman(x, y)
        assert (math.isnan(new) and math.isnan(old)) or abs(new - old) <= 1e-12, (new, old)


def _table(method, enc, dec):
    return HeadScores({"enc_self": np.array(enc, float), "dec_self": np.array(dec, float)}, method)


def test_agreement_table_per_kind_and_pooled(tmp_path):
    ablation = _table("ablation", [[1, 2], [3, 4]], [[4, 3], [2, 1]])
    same = _table("lrp", [[10, 20], [30, 40]], [[4, 3], [2, 1]])
    flipped = _table("confidence", [[4, 3], [2, 1]], [[1, 2], [np.nan, 4]])
    table = compute_agreement({"lrp": same, "confidence": flipped}, ablation)
    assert table.rho["lrp"]["enc_self"] == pytest.approx(1.0)
    assert table.rho["lrp"]["dec_self"] == pytest.approx(1.0)
    assert table.rho["confidence"]["enc_self"] == pytest.approx(-1.0)
    assert table.rho["confidence"]["dec_self"] == pytest.approx(-1.0)  # NaN head skipped
    assert table.n_heads == {"enc_self": 4, "dec_self": 4, "all": 8}
    assert table.best() == "lrp"
    markdown = table.to_markdown()
    assert "| lrp | +1.00 | +1.00 |" in markdown and "enc_self (4 heads)" in markdown
    json_path, md_path = table.save(tmp_path)
    assert json.loads(json_path.read_text())["spearman"]["confidence"]["enc_self"] == pytest.approx(-1.0)
    assert "Spearman" in md_path.read_text()


def test_no_best_predictor_when_no_measure_agrees():
    """Regression: with every correlation negative, `headlab importance` printed "best predictor
    of ablation over all heads: X" for the measure that disagreed least, a claim its numbers do
    not support."""
    ablation = _table("ablation", [[1, 2], [3, 4]], [[4, 3], [2, 1]])
    flipped = _table("confidence", [[4, 3], [2, 1]], [[1, 2], [3, 4]])
    worse = _table("lrp", [[4, 3], [1, 2]], [[1, 2], [4, 3]])
    table = compute_agreement({"confidence": flipped, "lrp": worse}, ablation)
    assert table.rho["lrp"]["all"] < 0 and table.rho["confidence"]["all"] < 0
    assert table.best() is None


def test_top_share_shows_dominant_heads():
    scores = HeadScores({"enc_self": np.array([[0.7, 0.1, 0.1, 0.1], [0.25, -0.25, 0.25, 0.25]])}, "lrp")
    shares = top_share(scores, top=1)["enc_self"]
    np.testing.assert_allclose(shares, [0.7, 0.25])
    np.testing.assert_allclose(top_share(scores, top=2)["enc_self"], [0.8, 0.5])


def test_agreement_across_dtypes_or_masks_is_refused():
    """A bfloat16 run's table against a float32 run's (or a masked model's against the whole model's) was
    correlated head by head without a word, though their signatures say so (options.dtype, options.mask) (audit33)."""
    def signed(table, **options):
        return HeadScores(table.scores, table.method, table.model, {"options": options})

    ablation = _table("ablation", [[1, 2], [3, 4]], [[4, 3], [2, 1]])
    lrp = _table("lrp", [[10, 20], [30, 40]], [[4, 3], [2, 1]])
    with pytest.raises(HeadlabError, match=r"other weights \(weights' dtype bfloat16 \(the reference's: float32\)"):
        compute_agreement({"lrp": signed(lrp, dtype="bfloat16")}, signed(ablation, dtype="float32"))
    with pytest.raises(HeadlabError, match=r"heads masked \{'enc_self:0': \[1\]\} \(the reference's: none\)"):
        compute_agreement({"lrp": signed(lrp, dtype="float32", mask={"enc_self:0": [1]})},
                          signed(ablation, dtype="float32"))
    same = compute_agreement({"lrp": signed(lrp, dtype="float32")}, signed(ablation, dtype="float32"))
    assert same.rho["lrp"]["enc_self"] == pytest.approx(1.0)
    assert compute_agreement({"lrp": signed(lrp)}, signed(ablation, dtype="float32")).rho["lrp"]["enc_self"] == 1.0
