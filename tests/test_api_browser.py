"""``Analysis._repr_html_`` in a real browser, as Jupyter shows it: the report in a frame (a
base64 data: URL) inside a host page. Headless Chromium through Playwright, with the same
executable and skip rules as tests/test_report_browser.py."""

from __future__ import annotations

import time
from pathlib import Path

import headlab
from support.report import build_analysis_dir, build_large_dir
from test_report_browser import browser_context  # noqa: F401 (the module's Chromium, a fixture)


def _host(tmp_path: Path, analysis, name: str) -> Path:
    """A page holding the notebook output, as JupyterLab inserts it into the notebook's page."""
    path = tmp_path / f"{name}.html"
    path.write_text(f"<!DOCTYPE html><html><body><h1>notebook</h1>{analysis._repr_html_()}</body></html>",
                    encoding="utf-8")
    return path


def _frame(context, path: Path):
    page = context.new_page()
    errors: list[str] = []
    page.on("console", lambda m: errors.append(f"console.{m.type}: {m.text}") if m.type in ("error", "warning") else None)
    page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
    page.on("request", lambda r: None if r.url.startswith(("file://", "data:")) else errors.append(f"network: {r.url}"))
    page.goto(path.resolve().as_uri())
    deadline = time.monotonic() + 15
    while len(page.frames) < 2 or not page.frames[1].evaluate("document.body && document.body.dataset.rendered === '1'"):
        if time.monotonic() > deadline:
            raise AssertionError(f"the report frame did not render: {errors}")
        time.sleep(0.05)
    return page, page.frames[1], errors


def test_notebook_output_shows_the_report_with_its_viewer(browser_context, tmp_path):  # noqa: F811
    """Heatmaps drawn, function labels listed, the viewer on every held sentence with hostile
    text shown as text (no script of it runs), links inside the frame stay inside it."""
    from support.report import SCRIPT_SENTENCE

    analysis = headlab.Analysis.load(build_analysis_dir(tmp_path / "hostile", long=False))
    page, frame, errors = _frame(browser_context, _host(tmp_path, analysis, "hostile"))
    try:
        assert frame.url.startswith("data:text/html;base64,")
        assert frame.evaluate("document.querySelectorAll('.heatmaps svg, .heatmaps canvas').length") >= 4
        labelled = sum(1 for found in analysis.labels.values() if found)
        assert labelled and frame.evaluate("document.querySelectorAll('table.functions tbody tr').length") == labelled
        assert frame.evaluate("document.getElementById('v-sentence').options.length") == 4
        frame.select_option("#v-sentence", "1")
        deadline = time.monotonic() + 10
        while "window.__pwned" not in (frame.evaluate("document.getElementById('v-source').textContent") or ""):
            assert time.monotonic() < deadline, "the viewer did not show the sentence"
            time.sleep(0.05)
        assert frame.evaluate("document.getElementById('v-source').textContent") == SCRIPT_SENTENCE
        assert frame.evaluate("window.__pwned") is None and page.evaluate("window.__pwned") is None
        frame.click('nav a[href="#viewer"]')  # in a srcdoc frame this would load the notebook's address
        time.sleep(0.3)
        assert page.frames[1].url.startswith("data:text/html;base64,") and page.frames[1].evaluate("location.hash") == "#viewer"
        assert not errors, errors
    finally:
        page.close()


def test_notebook_output_at_32_by_32_heads_loads(browser_context, tmp_path):  # noqa: F811
    """The largest page a notebook output embeds (32 x 32 heads, one 20-token sentence: 1.04 MB,
    a 1.39 MB data: URL) loads in Chromium and draws the model view."""
    analysis = headlab.Analysis.load(build_large_dir(tmp_path / "large", 32, 32, sentences=3, n_tokens=20))
    page, frame, errors = _frame(browser_context, _host(tmp_path, analysis, "large"))
    try:
        assert frame.evaluate("document.getElementById('v-sentence').options.length") == 1
        assert frame.evaluate("document.querySelectorAll('.heatmaps svg, .heatmaps canvas').length") >= 4
        frame.check('input[name="v-view"][value="model"]')
        assert frame.evaluate("!document.getElementById('v-model').hidden")
        assert not errors, errors
    finally:
        page.close()


def test_notebook_output_says_why_a_long_sentence_is_not_shown(browser_context, tmp_path):  # noqa: F811
    """32 x 32 heads and 30-token sentences (1.2 MB each): none fits the notebook's viewer, and the
    viewer's status line says so and why (not "no example attention")."""
    analysis = headlab.Analysis.load(build_large_dir(tmp_path / "long", 32, 32, sentences=2, n_tokens=30))
    page, frame, errors = _frame(browser_context, _host(tmp_path, analysis, "long"))
    try:
        status = frame.evaluate("document.getElementById('v-status').textContent")
        assert status.startswith("2 of the 2 example sentences of this analysis are not shown in this notebook view")
        assert "takes 1.23 MB of attention data" in status
        assert not errors, errors
    finally:
        page.close()
