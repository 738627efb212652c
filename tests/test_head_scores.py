"""HeadScores: the table every analysis writes and every figure reads."""

import csv
import re

import numpy as np
import pytest

from headlab import HeadlabError, HeadScores


def _scores():
    enc = np.array([[0.1, 0.5, np.nan], [0.2, 0.2, 0.6]])
    return HeadScores({"enc_self": enc, "dec_cross": np.ones((1, 3))}, "confidence", "tiny", {"tokens": 12})


def test_json_round_trip_keeps_nan_and_order(tmp_path):
    scores = _scores()
    assert scores.kinds == ("enc_self", "dec_cross")
    path = scores.save(tmp_path / "s.json")
    text = path.read_text()
    assert "null" in text and "NaN" not in text  # strict JSON
    again = HeadScores.load(path)
    np.testing.assert_array_equal(again["enc_self"], scores["enc_self"])
    assert again.signature == {"tokens": 12} and again.method == "confidence"


def test_save_to_a_directory_or_an_empty_path_says_so(tmp_path, monkeypatch):
    """Regression: an IsADirectoryError naming a temporary file, and for "" an OSError that left
    a temporary file in the working directory."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(HeadlabError, match=f"{tmp_path}: a directory, not a file"):
        _scores().save(tmp_path)
    with pytest.raises(HeadlabError, match=r"empty path|^\.: a directory, not a file"):
        _scores().save("")
    assert list(tmp_path.iterdir()) == []


def test_top_mask_refuses_a_keep_that_is_not_an_integer():
    """Regression: keep=True kept one head (bool is an int), 1.5 and "2" were TypeError tracebacks."""
    scores = _scores()
    for keep in (True, 1.5, "2"):
        with pytest.raises(HeadlabError, match="keep must be an integer number of heads"):
            scores.top_mask(keep)
    assert scores.top_mask(np.int64(6)) == scores.top_mask(6)


def test_normalise_rank_and_mask():
    scores = _scores()
    normal = scores.normalize_per_layer()
    np.testing.assert_allclose(np.nansum(normal["enc_self"], axis=1), [1.0, 1.0])
    assert scores.rank()[0] == ("dec_cross", 0, 0)
    assert scores.rank(descending=False)[0] == ("enc_self", 0, 0)
    removed = scores.top_mask(keep=2, kinds=("enc_self",))
    assert removed == {("enc_self", 0): [0], ("enc_self", 1): [0, 1]}
    with pytest.raises(HeadlabError, match="cannot keep 9 heads"):
        scores.top_mask(keep=9, kinds=("enc_self",))


def test_csv_and_bad_input(tmp_path):
    with _scores().save_csv(tmp_path / "s.csv").open() as handle:
        rows = list(csv.reader(handle))
    assert rows[0] == ["kind", "layer", "head", "confidence"]
    assert rows[3] == ["enc_self", "0", "2", ""]
    with pytest.raises(HeadlabError, match="must be \\[n_layers, n_heads\\]"):
        HeadScores({"enc_self": np.ones(3)}, "x")
    with pytest.raises(HeadlabError, match="unknown attention kind"):
        HeadScores({"encoder": np.ones((1, 1))}, "x")
    bad = tmp_path / "bad.json"
    bad.write_text('{"method": "x",\n "scores": }')
    with pytest.raises(HeadlabError, match="line 2"):
        HeadScores.load(bad)


def test_fingerprint_is_of_the_scores_not_of_where_the_file_was_written():
    scores = {"enc_self": np.array([[0.5, np.nan], [0.25, 1.0]])}
    here = HeadScores(scores, "lrp", "/work/main/models/m", {"data": "/work/main/data/x"})
    there = HeadScores(scores, "lrp", "models/m", {"data": "data/x"})
    assert here.fingerprint() == there.fingerprint()
    assert HeadScores.from_json(here.to_json()).fingerprint() == here.fingerprint()
    changed = HeadScores({"enc_self": np.array([[0.5, np.nan], [0.25, 0.75]])}, "lrp", "models/m")
    assert changed.fingerprint() != here.fingerprint()
    assert HeadScores(scores, "confidence", "models/m").fingerprint() != here.fingerprint()


@pytest.mark.parametrize("value", [np.inf, -np.inf])
def test_an_infinite_score_is_refused_not_written_as_invalid_json(value, tmp_path):
    """Regression: save() wrote an infinite score as `Infinity`, which JSON does not have (a
    browser's or jq's parser rejects the file; NaN is written as null and read back as NaN)."""
    scores = HeadScores({"enc_self": np.array([[0.5, value], [0.1, 0.2]])}, "mine")
    with pytest.raises(HeadlabError, match="mine scores: enc_self layer 0 head 1 is infinite"):
        scores.save(tmp_path / "s.json")
    assert not (tmp_path / "s.json").exists()


def test_write_json_writes_nan_as_null_and_refuses_infinity(tmp_path):
    """Regression: the general JSON writer wrote NaN (aggregate's pos_frequency.json of a kind with
    no word, a statistic with no case) as the bare token NaN, which is not JSON (RFC 8259, Sec. 6):
    strict readers (JavaScript's JSON.parse, jq) refused the file. NaN is null; infinity is refused."""
    import json

    from headlab.heads import write_json

    def strict(path):
        return json.loads(path.read_text(), parse_constant=lambda token: pytest.fail(f"{token} in {path}"))

    path = write_json(tmp_path / "a.json", {"enc_self": {"NOUN": float("nan"), "VERB": 0.5}, "rows": [(1.0, float("nan"))]})
    assert strict(path) == {"enc_self": {"NOUN": None, "VERB": 0.5}, "rows": [[1.0, None]]}
    with pytest.raises(HeadlabError, match=r"^b\.json\['x'\]\[1\]: -inf is infinite, which JSON cannot hold"):
        write_json(tmp_path / "b.json", {"x": [0.0, float("-inf")]})
    assert not (tmp_path / "b.json").exists()
    assert strict(write_json(tmp_path / "c.json", {"x": [1, "a", None]})) == {"x": [1, "a", None]}


def test_result_writers_write_nan_as_null(tmp_path):
    """Regression: the prune sweep's table (a BLEU or a loss that is NaN) went through a bare
    json.dumps and held the token NaN, which is not JSON (RFC 8259, Sec. 6); now it goes through
    write_json, so NaN is null and infinity is refused."""
    import json

    from headlab.pruning.sweep import write_table

    write_table([{"keep": 4, "bleu": float("nan"), "loss": 1.5}], tmp_path)
    text = (tmp_path / "sweep.json").read_text()
    assert json.loads(text, parse_constant=lambda token: pytest.fail(f"{token} in sweep.json")) == [
        {"keep": 4, "bleu": None, "loss": 1.5}]
    with pytest.raises(HeadlabError, match=r"sweep\.json\[0\]\['loss'\]: inf is infinite"):
        write_table([{"keep": 4, "loss": float("inf")}], tmp_path)


def test_without_refuses_heads_it_would_blank_wrongly():
    """Regression: ``HeadScores.without`` indexed numpy with the spec as given: head -1 blanked the
    last head, layer True layer 1, a misspelt kind was skipped as if not scored; each without a word."""
    scores = HeadScores({"enc_self": np.arange(8.0).reshape(2, 4)}, "m")
    assert np.isnan(scores.without({("enc_self", 1): [3], ("dec_self", 0): [0]})["enc_self"][1, 3])  # dec_self: not scored
    for spec, expected in (({("enc_self", 0): [-1]}, "m scores: enc_self layer 0: head -1 is not one of 0..3"),
                           ({("enc_self", 0): [4]}, "m scores: enc_self layer 0: head 4 is not one of 0..3"),
                           ({("enc_self", True): [1]}, "m scores: enc_self layer True is not one of 0..1"),
                           ({("enc_self", 0): [1.0]}, "m scores: enc_self layer 0: head 1.0 is not one of 0..3"),
                           ({("enc-self", 0): [1]}, "unknown attention kind 'enc-self'")):
        with pytest.raises(HeadlabError, match=re.escape(expected)):
            scores.without(spec)


def test_top_mask_reads_a_kind_given_as_a_string_whole():
    """Regression: ``top_mask(3, "enc")`` (a misspelt kind, one string) was taken letter by letter:
    "cannot keep 3 heads: 0 are scored in e, n, c"."""
    scores = HeadScores({"enc_self": np.arange(8.0).reshape(2, 4), "dec_self": np.zeros((2, 4))}, "m")
    assert scores.top_mask(3, "enc_self") == scores.top_mask(3, ("enc_self",)) == {("enc_self", 0): [0, 1, 2, 3],
                                                                                   ("enc_self", 1): [0]}
    with pytest.raises(HeadlabError, match="unknown attention kind 'enc'"):
        scores.top_mask(3, "enc")


def test_a_cut_among_equal_scores_is_said_not_silent(caplog):
    """top_mask keeps the best-scored heads, the order of kinds, layers and heads deciding between equal scores: where
    the cut falls among them (float32 P(open) of closed gates, heads that score 0), position chose, and a warning
    says so (session 45; before, silently)."""
    scores = _scores()  # enc_self 0.1 0.5 nan / 0.2 0.2 0.6; dec_cross 1 1 1
    assert scores.tie_at_cut(2, ("enc_self",)) is None and scores.tie_at_cut(3, ("enc_self",)) == {
        "tied": 2, "kept": 1, "score": 0.2}
    assert scores.tie_at_cut(2, ("dec_cross",)) == {"tied": 3, "kept": 2, "score": 1.0}
    assert scores.tie_at_cut(3, ("dec_cross",)) is None and scores.tie_at_cut(0, ("dec_cross",)) is None
    with caplog.at_level("WARNING", logger="headlab"):
        assert scores.top_mask(2, ("enc_self",)) == {("enc_self", 0): [0], ("enc_self", 1): [0, 1]}
        assert not caplog.records
        assert scores.top_mask(3, ("enc_self",)) == {("enc_self", 0): [0], ("enc_self", 1): [1]}
    message = caplog.records[-1].getMessage()
    assert message == ("confidence scores: keeping 3 heads, the cut falls among 2 heads of equal score (0.2): 1 of "
                       "them kept by position (the order of kinds, layers and heads), not by their scores")
