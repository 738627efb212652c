"""The report's overview on a pruned model's results: layers with different head counts (a layer
with none, a layer with one), where a measure normalised per layer cannot be ranked across layers."""

from __future__ import annotations

import re

import numpy as np
import pytest

from headlab import Analysis
from headlab.heads import HeadScores
from headlab.report import build_report
from support.report import build_analysis_dir

NAN = np.nan
PER_LAYER = {"data": "fixture", "normalisation": "l2 per layer"}  # as headlab.importance.gradient writes it


def _overview(directory) -> str:
    html = build_report(directory).read_text(encoding="utf-8")
    section = html[html.index('<section id="overview">'):]
    return section[:section.index("</section>")]


def _columns(overview: str) -> list[str]:
    header = re.search(r'<table class="top-heads"><thead><tr>(.*?)</tr>', overview).group(1)
    return re.findall(r"<th>(.*?)</th>", header)


def _write(directory, gradient: np.ndarray, raw: np.ndarray) -> None:
    """Gradient importance of a decoder-only model's ``dec_self`` (removed heads NaN) in place of the fixture's."""
    for method, array, signature in (("gradient", gradient, PER_LAYER), ("gradient_raw", raw, {"data": "fixture"})):
        scores = {"enc_self": np.full((2, 4), NAN), "dec_self": array, "dec_cross": np.full((2, 4), NAN)}
        HeadScores(scores, method, "tiny", signature).save(directory / "importance" / f"{method}.json")


@pytest.fixture
def analysis_dir(tmp_path):
    return build_analysis_dir(tmp_path / "analysis", long=False, attention=False)


def test_gradient_of_uneven_layers_is_not_ranked_across_them(analysis_dir):
    # layer 0 keeps one head (original head 2), layer 1 three: l2 per layer gives layer 0's head 1
    # whatever its gradient, so a pooled ranking would put it first although its raw gradient is lower
    _write(analysis_dir, np.array([[NAN, NAN, 1.0, NAN], [0.54, 0.44, NAN, 0.72]]),
           np.array([[NAN, NAN, 4e-4, NAN], [4e-4, 3e-4, NAN, 5e-4]]))
    overview = _overview(analysis_dir)
    columns = _columns(overview)
    assert "Gradient importance" not in columns and "Gradient importance (raw)" in columns
    assert ("Gradient importance is not ranked here: it is normalised per layer and the layers keep different "
            "numbers of heads") in overview
    assert "the unnormalised gradients in Gradient importance (raw)" in overview
    # the other measures are still ranked, out of the heads that have a score (the fixture's 23)
    assert "Confidence" in columns and "out of 23 (" in overview


def test_gradient_of_one_head_per_layer_is_not_a_ranking_of_ties(analysis_dir):
    _write(analysis_dir, np.array([[NAN, 1.0, NAN, NAN], [NAN, NAN, NAN, 1.0]]),
           np.array([[NAN, 2e-4, NAN, NAN], [NAN, NAN, NAN, 5e-4]]))
    overview = _overview(analysis_dir)
    assert "Gradient importance" not in _columns(overview)
    assert "it is normalised per layer and every layer keeps one head" in overview


def test_gradient_of_even_layers_and_of_a_single_scored_layer_is_ranked(analysis_dir):
    # every layer keeps all its heads (an unpruned model): ranked as before
    _write(analysis_dir, np.array([[0.1, 0.9, 0.3, 0.2], [0.5, 0.5, 0.5, 0.5]]), np.full((2, 4), 1e-4))
    overview = _overview(analysis_dir)
    assert "Gradient importance" in _columns(overview) and "not ranked here" not in overview
    # one layer left with heads, the other with none: one scale, ranked
    _write(analysis_dir, np.array([[NAN] * 4, [0.6, NAN, 0.8, NAN]]), np.array([[NAN] * 4, [3e-4, NAN, 4e-4, NAN]]))
    overview = _overview(analysis_dir)
    assert "Gradient importance" in _columns(overview) and "not ranked here" not in overview


def test_notebook_analysis_does_not_rank_gradient_of_uneven_layers(analysis_dir):
    _write(analysis_dir, np.array([[NAN, NAN, 1.0, NAN], [0.54, 0.44, NAN, 0.72]]),
           np.array([[NAN, NAN, 4e-4, NAN], [4e-4, 3e-4, NAN, 5e-4]]))
    text = repr(Analysis.load(analysis_dir))
    assert ("top by gradient: not ranked (normalised per layer and the layers keep different numbers of heads; "
            "see gradient_raw)") in text
    assert "top by lrp: enc_self L0 H2 0.997" in text  # the others still ranked
    _write(analysis_dir, np.array([[0.1, 0.9, 0.3, 0.2], [0.5, 0.5, 0.5, 0.5]]), np.full((2, 4), 1e-4))
    assert "top by gradient: dec_self L0 H1 0.9" in repr(Analysis.load(analysis_dir))


def test_lrp_of_uneven_layers_is_not_ranked_across_them(analysis_dir):
    # LRP's shares of a layer sum to one in absolute value: a layer's only head takes all of it
    lrp = {"enc_self": np.array([[NAN, 0.9, NAN, NAN], [0.3, 0.2, 0.1, 0.4]]), "dec_self": np.full((2, 4), NAN),
           "dec_cross": np.full((2, 4), NAN)}
    signature = {"data": "fixture", "normalisation": "per target, over the heads of a layer (sum of |relevance|)"}
    HeadScores(lrp, "lrp", "tiny", signature).save(analysis_dir / "importance" / "lrp.json")
    overview = _overview(analysis_dir)
    assert "LRP relevance" not in _columns(overview) and "Confidence" in _columns(overview)
    assert "LRP relevance is not ranked here: it is normalised per layer and the layers keep different" in overview
    assert "top by lrp: not ranked (normalised per layer and the layers keep different numbers of heads)" in repr(
        Analysis.load(analysis_dir))
