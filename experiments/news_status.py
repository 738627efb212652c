"""Regenerate the tables of docs/nmt.md's news-domain section from docs/results/news-en-de/.

    .venv/bin/python experiments/news_status.py

The folder holds what the refresh steps of that section wrote (training history, test scores,
the `python -m reproduction --config experiments/news-reproduce.json` results); this rewrites the
blocks ``news-curve``, ``news-scores``, ``news-specialisation`` and ``news-claims``.
"""

import sys
from pathlib import Path

from headlab.heads import atomic_write_text
from headlab.pipeline.profiles import replace_block

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the reproduction package of the checkout (not installed with headlab)
from reproduction.status import status_blocks  # noqa: E402

DOC = ROOT / "docs" / "nmt.md"

text = DOC.read_text(encoding="utf-8")
for name, body in status_blocks(ROOT / "docs" / "results" / "news-en-de", "news-en-de", prefix="news-").items():
    text = replace_block(text, name, body)
atomic_write_text(DOC, text)
print(f"updated {DOC}")
