"""A zero is written without a sign in every table and report (fixes35).

A head that puts all its weight on one key has entropy ``-(1 * log 1) = -0.0``, and float sums leave statistics and
correlations of ``-1e-10``: written with ``f"{x:.3f}"`` they read ``-0.000`` (the aggregate summary's min, a model
profile's layer table), and ``f"{x:+.2f}"`` writes ``+0.00`` / ``-0.00`` (agreement tables, the report). Every writer
formats through :func:`headlab.numbers.number` now; each check below failed before.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from headlab import HeadScores
from headlab.aggregate import AggregateResult, _profile_table
from headlab.display import heatmap_svg
from headlab.importance.agreement import AgreementTable
from headlab.markup import fmt, line_chart, percent, tick_label
from headlab.numbers import number
from headlab.report.sections import _num

SIGNED_ZERO = re.compile(r"(?<![\w.])[+-]0(?:\.0+)?(?![\d.e])")
"""-0, +0, -0.000, +0.00, -0.0% in a text (a sign before an all-zero number)."""

ENTROPY_OF_ONE_KEY = -(1.0 * math.log(1.0))  # -0.0


@pytest.mark.parametrize(("value", "spec", "written"), [
    (-0.0, ".3f", "0.000"), (-4e-10, ".3f", "0.000"), (0.0, "+.2f", "0.00"), (-0.004, "+.2f", "0.00"),
    (-0.0, ".3g", "0"), (-0.0, ".1%", "0.0%"), (-0.0, "8.3f", "   0.000"), (-0.0, "<8.3f", "0.000   "),
    (-0.001, ".3f", "-0.001"), (0.25, "+.2f", "+0.25"), (-1e-12, ".3g", "-1e-12"), (math.nan, ".3f", "nan"),
    (-7.0, ".1f", "-7.0"), (3, "d", "3"),
])
def test_number_writes_a_zero_without_a_sign(value, spec, written):
    assert number(value, spec) == written


def _scores(array: np.ndarray, method: str = "entropy") -> HeadScores:
    return HeadScores({"enc_self": array}, method)


def test_the_aggregate_summary_writes_no_signed_zero():
    entropy = np.array([[ENTROPY_OF_ONE_KEY, -4e-10], [0.7, 1.2]])
    distance = np.array([[-0.0, 0.0], [-1e-9, -0.0]])
    result = AggregateResult({"entropy": _scores(entropy), "mean_distance": _scores(distance, "mean_distance")},
                             {}, {}, {}, {})
    summary = result.summary_markdown()
    assert "| entropy | enc_self | 0.000 |" in summary and "| mean_distance | enc_self | 0.000 | 0.000 | 0.000 |" in summary
    assert not SIGNED_ZERO.search(summary), summary


def test_a_model_profile_s_layer_table_writes_no_signed_zero():
    lines = _profile_table({"enc_self": {"layers": {"mean_distance": [-0.0, 1.5], "dependency_alignment": [-1e-9, 0.2],
                                                    "mean_entropy": [ENTROPY_OF_ONE_KEY, 0.9]}}})
    assert "| enc_self | 0 | 0.00 | 0.000 | 0.000 |" in lines
    assert not SIGNED_ZERO.search("\n".join(lines))


def test_agreement_tables_write_no_signed_zero():
    table = AgreementTable({"confidence": {"enc_self": -0.0, "all": -0.001}, "lrp": {"enc_self": 0.0, "all": 0.5}},
                           {"enc_self": 4, "all": 4})
    text = table.to_markdown() + repr(table)
    assert "| confidence | 0.00 | 0.00 |" in text and "+0.50" in text
    assert not SIGNED_ZERO.search(text), text


def test_the_report_s_html_pieces_write_no_signed_zero():
    pieces = [_num(-0.0), _num(0.0), _num(-0.003), fmt(-0.0), fmt(-1e-10), percent(-0.0), tick_label(-0.0),
              line_chart({"enc_self": [(-0.0, -0.0), (1.0, 0.5)]}, "layer", "value", "chart", "t"),
              heatmap_svg(np.array([[-0.0, 1.0]])), repr(_scores(np.array([[-0.0, -1e-9]])))]
    for piece in pieces:
        assert not SIGNED_ZERO.search(re.sub(r'="[^"]*"', "", piece)), piece  # the text, not SVG coordinates
    assert _num(0.25).endswith(">+0.25</span>")
