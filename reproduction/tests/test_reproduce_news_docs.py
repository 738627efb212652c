"""docs/results/news-en-de/reproduction.md and its claims.json must be what the committed result files give.

The news model's report is written by `python -m reproduction --config experiments/news-reproduce.json`
into runs/ and copied into docs/results/news-en-de/ by hand (docs/nmt.md), so nothing regenerated it
when the verdict rules changed. Here the same command, with --docs-only, renders it again from the
committed results in a temporary directory (no model run, no run directory), and the output must equal
the committed files. On a mismatch: regenerate as docs/nmt.md ("To analyse it again") says.
"""

import json
import shutil
from pathlib import Path

import pytest

from reproduction.cli import main

REPO = Path(__file__).resolve().parents[2]
COMMITTED = REPO / "docs" / "results" / "news-en-de"
MODEL = "news-en-de"


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory):
    """The folder the command wrote to: reproduction.md, results/claims.json, img/."""
    out = tmp_path_factory.mktemp("news-report")
    config = json.loads((REPO / "experiments" / "news-reproduce.json").read_text(encoding="utf-8"))
    # The committed copies stand where the config's runs/ paths would be; everything else (the model,
    # work_dir, the commands) stays the repository's.
    config.update(root=str(REPO), results_dir=str(out / "results"), doc=str(out / "reproduction.md"),
                  img_dir=str(out / "img"))
    (out / "news-reproduce.json").write_text(json.dumps(config), encoding="utf-8")
    shutil.copytree(COMMITTED / "reproduction", out / "results" / MODEL)
    (out / "results" / MODEL / "claims.json").unlink()  # the command writes results/claims.json afresh
    shutil.copy(COMMITTED / "reproduction.md", out / "reproduction.md")
    assert main(["--config", str(out / "news-reproduce.json"), "--docs-only"]) == 0
    return out


def test_news_report_matches_the_result_files(regenerated):
    committed = (COMMITTED / "reproduction.md").read_text(encoding="utf-8")
    assert (regenerated / "reproduction.md").read_text(encoding="utf-8") == committed, (
        "docs/results/news-en-de/reproduction.md differs from what its result files give: regenerate it "
        "(python -m reproduction --config experiments/news-reproduce.json --docs-only; docs/nmt.md)")


def test_news_claims_json_matches_the_result_files(regenerated):
    committed = (COMMITTED / "reproduction" / "claims.json").read_text(encoding="utf-8")
    assert (regenerated / "results" / "claims.json").read_text(encoding="utf-8") == committed, (
        "docs/results/news-en-de/reproduction/claims.json differs from what the result files give")


def test_news_report_figures_are_committed(regenerated):
    """Every figure the report links is committed beside it (the PNG bytes depend on matplotlib)."""
    text = (COMMITTED / "reproduction.md").read_text(encoding="utf-8")
    linked = {line.split("](img/")[1].rstrip(")") for line in text.splitlines() if "](img/" in line}
    assert linked, "the news report links no figure"
    assert linked == {p.name for p in (regenerated / "img").glob("*.png")}
    for name in linked:
        assert (COMMITTED / "img" / name).is_file(), name


def test_news_report_leaves_out_the_main_reproductions_title_rows(regenerated):
    """The title's claim rows test english-lm and multi30k-en-de and link relative to docs/: they belong
    to docs/reproduction.md only (in docs/results/news-en-de/ their links would be broken)."""
    text = (regenerated / "reproduction.md").read_text(encoding="utf-8")
    assert "The title's claim" not in text and "heavy_lifting" not in text
    main_doc = (REPO / "docs" / "reproduction.md").read_text(encoding="utf-8")
    assert "The title's claim" in main_doc
