"""docs/reproduction.md must hold exactly what the committed result files give.

The generated blocks are rendered again from docs/results/reproduction/ and
experiments/reproduce.json (no model, no run directory needed) and compared with the
document; claims.json likewise. On a mismatch: `python -m reproduction --docs-only`.
"""

import json
from pathlib import Path

import pytest

from reproduction import compute_claims, load_config, load_results, read_blocks, render_blocks
from reproduction.render import vig_claim
from reproduction.report import claims_json

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def rendered():
    """(config, claims, blocks), rendered once for the module: the claims' bootstraps take seconds."""
    config = load_config(REPO / "experiments" / "reproduce.json", root=REPO)
    results = load_results(config)
    claims = compute_claims(results)
    return config, claims, render_blocks(config, claims, results)


def test_document_matches_the_result_files(rendered):
    config, _, blocks = rendered
    document = read_blocks((REPO / config.doc).read_text(encoding="utf-8"))
    assert set(document) == set(blocks), "generated blocks missing from or extra in docs/reproduction.md"
    for name, body in blocks.items():
        assert document[name] == body, (
            f"docs/reproduction.md block {name!r} differs from the result files; run `python -m reproduction --docs-only`")


def test_claims_json_matches_the_result_files(rendered):
    config, claims, _ = rendered
    path = REPO / config.results_dir / "claims.json"
    assert json.loads(path.read_text(encoding="utf-8")) == claims_json([*claims, vig_claim(config)[0]])


def test_every_figure_the_document_shows_exists(rendered):
    config, claims, _ = rendered
    for claim in claims:
        for model, name in claim.figures.items():
            assert (REPO / config.img_dir / f"reproduction-{model}-{name}.png").is_file(), (claim.key, model, name)


def test_the_news_runs_tables_in_nmt_md_match_its_result_files():
    """docs/nmt.md's news-domain section: its tables are rendered from docs/results/news-en-de/."""
    from headlab.pipeline.profiles import read_block
    from reproduction.status import status_blocks

    blocks = status_blocks(REPO / "docs" / "results" / "news-en-de", "news-en-de", prefix="news-")
    assert set(blocks) == {"news-curve", "news-scores", "news-specialisation", "news-claims"}
    document = (REPO / "docs" / "nmt.md").read_text(encoding="utf-8")
    for name, body in blocks.items():
        assert read_block(document, name) == body, f"docs/nmt.md block {name!r}: run experiments/news_status.py"
    assert "| sec5.1 |" in blocks["news-claims"] and "not run" not in blocks["news-claims"]


def test_checkpoint_losses_fill_only_the_records_without_one():
    from reproduction.status import with_checkpoint_losses

    history = [{"epoch": 1}, {"epoch": 2, "valid_loss": 2.0}, {"epoch": 3}]
    measured = {"epochs": [{"epoch": 1, "valid_loss": 3.0}, {"epoch": 2, "valid_loss": 9.9}]}
    assert with_checkpoint_losses(history, measured) == [{"epoch": 1, "valid_loss": 3.0}, {"epoch": 2, "valid_loss": 2.0},
                                                         {"epoch": 3}]
