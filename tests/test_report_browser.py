"""The report in a real browser: headless Chromium (Debian's ``chromium``) driven by Playwright.

Playwright's own browser download is not used: Chromium is started from ``executable_path``
(``HEADLAB_CHROMIUM`` or ``chromium`` on PATH or /usr/bin/chromium). Without Chromium or
Playwright these tests skip with the reason; with ``HEADLAB_REQUIRE_BROWSER=1`` (set by
.ci/run) the skip becomes a failure. Screenshots go to the test's tmp dir, and also to
``HEADLAB_ARTIFACTS`` when that is set.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from support.report import IMG_SENTENCE, SCRIPT_SENTENCE, SOURCES, build_analysis_dir

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def chromium_path() -> str | None:
    for candidate in (os.environ.get("HEADLAB_CHROMIUM"), shutil.which("chromium"), "/usr/bin/chromium"):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def _unavailable() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install -e '.[test]')"
    if chromium_path() is None:
        return "no Chromium executable (apt-get install chromium, or set HEADLAB_CHROMIUM)"
    return None


def require_browser() -> str:
    reason = _unavailable()
    if reason:
        if os.environ.get("HEADLAB_REQUIRE_BROWSER") == "1":
            pytest.fail(f"HEADLAB_REQUIRE_BROWSER=1 but {reason}")
        pytest.skip(f"browser tests skipped: {reason}")
    return chromium_path()


@pytest.fixture(scope="module")
def browser_context(tmp_path_factory):
    executable = require_browser()
    from playwright.sync_api import sync_playwright

    profile = tmp_path_factory.mktemp("chromium-profile")
    with sync_playwright() as playwright:
        # Playwright passes --user-data-dir itself for a persistent context: a fresh tmp dir.
        context = playwright.chromium.launch_persistent_context(
            str(profile), executable_path=executable, headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1280, "height": 900})
        try:
            yield context
        finally:
            context.close()


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    from headlab.report import build_report

    directory = build_analysis_dir(tmp_path_factory.mktemp("browser") / "analysis")
    return build_report(directory)


class Page:
    """A page with its console errors and uncaught exceptions collected."""

    def __init__(self, context, path: Path):
        self.errors: list[str] = []
        self.page = context.new_page()
        self.page.on("console", lambda m: self.errors.append(f"console.{m.type}: {m.text}")
                     if m.type in ("error", "warning") else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        self.page.on("request", lambda r: None if r.url.startswith(("file://", "data:"))
                     else self.errors.append(f"network: {r.url}"))
        self.page.goto(path.resolve().as_uri())
        self.page.wait_for_selector("body[data-rendered='1']", timeout=10_000)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.page.close()


def _wait_until(page, expression: str, timeout: float = 15.0) -> None:
    """Poll ``expression`` until it is true. Not ``page.wait_for_function``: its polling evaluates
    a string inside the page, which the report's Content-Security-Policy (rightly) forbids, so it
    fails whenever the condition is not already true on the first try. ``page.evaluate`` runs
    through the DevTools protocol, outside the page's CSP."""
    deadline = time.monotonic() + timeout
    while not page.evaluate(expression):
        if time.monotonic() > deadline:
            raise AssertionError(f"still false after {timeout} s: {expression}")
        time.sleep(0.05)


def _artifact(page, tmp_path: Path, name: str, **options) -> Path:
    path = tmp_path / name
    page.screenshot(path=str(path), **options)
    if os.environ.get("HEADLAB_ARTIFACTS"):
        target = Path(os.environ["HEADLAB_ARTIFACTS"])
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, target / name)
    print(f"screenshot: {path}")
    return path


def test_report_loads_without_errors_and_every_section_has_content(browser_context, report, tmp_path):
    with Page(browser_context, report) as p:
        page = p.page
        assert page.locator("#importance svg.hm").count() == 4 * 3
        assert page.locator("#functions svg.hm").count() == 2 * 3
        assert page.locator("#aggregate svg.hm").count() == 5 * 3  # 4 statistics + the POS selection
        assert page.locator("#agreement table tbody tr").count() == 3
        assert page.locator("#figures img").count() == 1
        assert page.evaluate("document.querySelector('#figures img').naturalWidth") > 0
        assert page.locator("#v-left span").count() == len("the cat sat on the mat".split()) + 1
        assert page.locator("#viewer").get_attribute("data-kind") == "enc_self"
        _artifact(page, tmp_path, "report-screenshot.png", full_page=True)
        assert p.errors == []


def test_clicking_a_heatmap_cell_opens_that_head(browser_context, report):
    with Page(browser_context, report) as p:
        page = p.page
        page.locator('#importance svg.hm rect.cell[data-kind="dec_cross"][data-layer="1"][data-head="2"]').first.click()
        viewer = page.locator("#viewer")
        assert (viewer.get_attribute("data-kind"), viewer.get_attribute("data-layer"), viewer.get_attribute("data-head")) \
            == ("dec_cross", "1", "2")
        assert page.locator("#v-head-label").text_content() == "dec_cross L1 H2 — rare"
        assert page.locator("#v-kind").input_value() == "dec_cross"
        assert page.locator("#v-head").input_value() == "2"
        # cross-attention: target (decoder input) tokens on the left, source on the right
        assert page.locator("#v-left span").first.text_content() == "<pad>"
        assert page.locator("#v-right span").last.text_content() == "</s>"
        assert page.locator("svg.hm rect.cell.selected").count() >= 4
        # the function table's rows open their head too
        page.locator('#functions tr.head-link[data-kind="enc_self"][data-layer="1"]').click()
        assert page.locator("#v-head-label").text_content() == "enc_self L1 H2 — nsubj v→s, positional +1"
        page.locator("input[name=v-view][value=matrix]").check()
        assert page.locator("#v-matrix").is_visible() and not page.locator("#v-lines").is_visible()
        assert p.errors == []


def test_injected_markup_in_the_corpus_is_shown_not_run(browser_context, report):
    with Page(browser_context, report) as p:
        page = p.page
        for sentence in (SCRIPT_SENTENCE, IMG_SENTENCE):
            page.select_option("#v-sentence", str(SOURCES.index(sentence)))
            _wait_until(page, f"document.querySelector('#viewer').dataset.sentence === '{SOURCES.index(sentence)}'")
            assert page.locator("#v-source").text_content() == sentence
            assert page.locator("#v-source script, #v-source img, #v-left img, #v-left script").count() == 0
        page.select_option("#v-sentence", str(SOURCES.index(SCRIPT_SENTENCE)))
        assert page.locator("#v-left span").nth(2).text_content() == "<script>window.__pwned=1</script>"
        assert page.locator("#v-sentence option").nth(1).text_content().endswith(SCRIPT_SENTENCE)
        assert page.locator("#v-target").text_content().startswith("le chat <b>bold</b> est")
        assert page.evaluate("window.__pwned") is None
        assert page.locator("img[src=x]").count() == 0
        assert p.errors == []


def test_a_200_token_sentence_stays_usable(browser_context, report, tmp_path):
    with Page(browser_context, report) as p:
        page = p.page
        slot = str(len(SOURCES))
        start = time.perf_counter()
        page.select_option("#v-sentence", slot)
        _wait_until(page, f"document.querySelector('#viewer').dataset.sentence === '{slot}'")
        assert page.locator("#v-left span").count() == 200
        lines_s = time.perf_counter() - start
        page.locator("#v-left span").nth(100).hover()
        start = time.perf_counter()
        page.locator("input[name=v-view][value=matrix]").check()
        width = page.evaluate("document.getElementById('v-matrix-canvas').width")
        matrix_s = time.perf_counter() - start
        assert width > 0
        page.locator("input[name=v-view][value=lines]").check()
        page.fill("#v-threshold", "0.2")
        _artifact(page.locator("#viewer"), tmp_path, "report-viewer-200.png")
        print(f"200 tokens: lines view {lines_s * 1000:.0f} ms, matrix view {matrix_s * 1000:.0f} ms")
        assert lines_s < 5 and matrix_s < 5
        assert p.errors == []


def test_attention_loaded_from_script_files(browser_context, report, tmp_path):
    from headlab.report.build import build_report

    copy = tmp_path / "copy"
    shutil.copytree(report.parent, copy)
    path = build_report(copy, inline_limit=0)
    with Page(browser_context, path) as p:
        page = p.page
        assert page.locator("#v-left span").count() == 7
        page.select_option("#v-sentence", "3")
        _wait_until(page, "document.querySelector('#v-left').childElementCount === 8")
        assert page.locator("#v-source").text_content() == SOURCES[3]
        assert p.errors == []


def test_report_with_missing_stages(browser_context, tmp_path):
    from headlab.report import build_report

    path = build_report(build_analysis_dir(tmp_path / "a", long=False, stages_missing=True))
    with Page(browser_context, path) as p:
        page = p.page
        assert "model has no LM head <needs one>" in page.locator("#importance").text_content()
        assert "no --conllu given" in page.locator("#aggregate").text_content()
        assert page.locator("svg.hm").count() == 0
        # a click on the viewer still works without heatmaps
        assert page.locator("#v-left span").count() == 7
        assert p.errors == []
