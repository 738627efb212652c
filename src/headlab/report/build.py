"""Write ``ANALYSIS_DIR/index.html``: one file that opens offline, with no network access.

Static parts (run summary, stage table, tables, figures) are rendered here with every
string passed through :func:`html.escape`. Heatmaps and the attention viewer are drawn by
vanilla JavaScript (``templates/report.js``) from JSON embedded in ``<script
type="application/json">`` blocks, where ``<``, ``>`` and ``&`` are written as ``\\u003c``
and so on, so that no corpus text can close the block. The JavaScript writes text only
through ``textContent``. A Content-Security-Policy allows only the report's own script (by
its hash), so even markup that slipped through could not run.

Attention data: sentences are inlined in order while they fit ``inline_limit`` bytes (one
self-contained file that can be emailed when all fit); each further sentence goes to
``attention/sentence-NNN.js``, loaded on demand by a ``<script src>`` tag (works from
``file://``, where ``fetch`` is blocked).
"""

from __future__ import annotations

import base64
import hashlib
import json
from datetime import datetime, timezone
from html import escape
from pathlib import Path

from headlab.errors import HeadlabError
from headlab.heads import KINDS, atomic_write_text, json_text
from headlab.report.collect import Collected, collect
from headlab.report.sections import collect_sections, embedded, render_body, render_navigation, template

__all__ = ["build_report", "json_for_script", "INLINE_LIMIT"]

INLINE_LIMIT = 1_400_000
"""Attention data (bytes) inlined into index.html: the first sentences that fit; the others are
loaded on demand from ``attention/sentence-NNN.js``. 1.4 MB keeps the page under 2 MB at 32
layers x 32 heads (docs/benchmarks.md) and the bundled model's 20 demo sentences (1.2 MB) in
one file."""


def json_for_script(data) -> str:
    """JSON that is safe inside ``<script type="application/json">``."""
    text = json_text(data, "the report's data", ensure_ascii=False, separators=(",", ":"))
    for char, code in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"),
                       ("\u2029", "\\u2029")):
        text = text.replace(char, code)
    return text


def _attention(c: Collected, inline_limit: int) -> tuple[str, dict]:
    """The attention data blocks (inlined) or sidecar .js files, and the viewer's index."""
    index = c.attention
    if not index:
        return "", {"sentences": [], "mode": "none"}
    directory = c.directory / "attention"
    sentences: list[dict] = []
    payloads: list = []
    for entry in index["sentences"]:
        if not isinstance(entry, dict) or not isinstance(entry.get("file"), str):
            continue
        path = directory / Path(entry["file"]).name
        try:
            text = path.read_text(encoding="utf-8")
            json.loads(text)
        except (OSError, ValueError) as error:
            c.note("viewer", f"attention/{path.name}: unreadable ({error.__class__.__name__})")
            continue
        keep = {k: entry.get(k) for k in ("id", "line", "source", "target", "target_from", "n_tokens", "blocks")}
        if isinstance(entry.get("treebank"), str):  # a treebank sentence: its payload holds the gold parse
            keep["treebank"] = entry["treebank"]
        keep["slot"] = len(sentences)
        sentences.append(keep)
        payloads.append((path, text))
    not_shown = index.get("not_shown")  # a notebook's page (headlab.api): sentences it could not hold, and why
    if isinstance(not_shown, str) and not_shown:
        c.note("viewer", not_shown)
    skipped = index.get("skipped")
    if isinstance(skipped, list) and skipped:
        first = skipped[0] if isinstance(skipped[0], dict) else {}
        c.note("viewer", f"{len(skipped)} treebank sentence(s) could not be aligned to the tokenizer's tokens and are "
                         f"not shown (first: {first.get('where')}: {first.get('reason')})")
    # Inline sentences in order while they fit the budget; the rest go to script files.
    blocks, used, n_inline = [], 0, 0
    for slot, (path, text) in enumerate(payloads):
        data = json_for_script(json.loads(text))
        if n_inline == slot and used + len(data) <= inline_limit:
            blocks.append(f'<script type="application/json" id="headlab-attention-{slot}">{data}</script>')
            used += len(data)
            n_inline += 1
        else:
            js = path.with_suffix(".js")
            atomic_write_text(js, f"window.headlabAttention({slot},{data});\n")
            sentences[slot]["script"] = f"attention/{js.name}"
    mode = "inline" if n_inline == len(payloads) else "script" if n_inline == 0 else "mixed"
    viewer = {"sentences": sentences, "mode": mode, "model": index.get("model", "")}
    if isinstance(not_shown, str) and not_shown:
        viewer["not_shown"] = not_shown
    return "\n".join(blocks), viewer


def build_report(analysis_dir: Path, inline_limit: int = INLINE_LIMIT) -> Path:
    """Write ``analysis_dir/index.html`` from whatever the directory holds; return its path."""
    directory = Path(analysis_dir)
    if not directory.is_dir():
        raise HeadlabError(f"{directory}: not an analysis directory (no such directory)")
    c = collect(directory)
    collect_sections(c)
    attention_blocks, attention = _attention(c, inline_limit)
    data = {
        "heatmaps": c.heatmaps,
        "labels": c.labels,
        **embedded(c),  # for report.js
        "attention": attention,
        "kinds": list(KINDS),
    }
    script = template("report.js")
    digest = base64.b64encode(hashlib.sha256(script.encode("utf-8")).digest()).decode("ascii")
    csp = (f"default-src 'none'; script-src 'sha256-{digest}' 'self' file:; style-src 'unsafe-inline'; "
           "img-src data: 'self' file:; base-uri 'none'; form-action 'none'")
    model = c.manifest.get("model") or attention.get("model") or directory.name
    c.viewer = attention
    generated = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    html = f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{escape(csp, quote=True)}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<title>headlab report: {escape(str(model))}</title>
<style>{template("report.css")}</style>
</head>
<body>
<header><h1>headlab report: <span class="model">{escape(str(model))}</span></h1>
<p class="generated">generated {escape(generated)} from {escape(str(directory))}</p>
<nav>{render_navigation()}</nav></header>
<noscript><p class="note">The heatmaps and the attention viewer need JavaScript; the tables and figures do not.</p></noscript>
<main>
{render_body(c)}
</main>
<div id="tooltip" role="tooltip" hidden></div>
<script type="application/json" id="headlab-data">{json_for_script(data)}</script>
{attention_blocks}
<script>{script}</script>
</body>
</html>
"""
    path = directory / "index.html"
    atomic_write_text(path, html)
    return path
