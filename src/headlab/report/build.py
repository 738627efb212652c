"""Write ``ANALYSIS_DIR/index.html``: one file that opens offline, with no network access.

Static parts (run summary, stage table, tables, figures) are rendered here with every
string passed through :func:`html.escape`. Heatmaps and the attention viewer are drawn by
vanilla JavaScript (``templates/report.js``) from JSON embedded in ``<script
type="application/json">`` blocks, where ``<``, ``>`` and ``&`` are written as ``\\u003c``
and so on, so that no corpus text can close the block. The JavaScript writes text only
through ``textContent``. A Content-Security-Policy allows only the report's own script (by
its hash), so even markup that slipped through could not run.

Attention data: up to ``inline_limit`` bytes it is inlined (one self-contained file that can
be emailed); above, each sentence goes to ``attention/sentence-NNN.js``, loaded on demand by
a ``<script src>`` tag (works from ``file://``, where ``fetch`` is blocked).
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
from datetime import datetime, timezone
from html import escape
from importlib import resources
from pathlib import Path

from headlab.errors import HeadlabError
from headlab.heads import CAUSAL_KINDS, KINDS, atomic_write_text
from headlab.report.collect import Collected, collect

__all__ = ["build_report", "json_for_script", "INLINE_LIMIT"]

INLINE_LIMIT = 24 * 1024 * 1024
"""Attention data (bytes) up to which it is inlined into index.html."""


def json_for_script(data) -> str:
    """JSON that is safe inside ``<script type="application/json">``."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    for char, code in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"),
                       ("\u2029", "\\u2029")):
        text = text.replace(char, code)
    return text


def _template(name: str) -> str:
    return resources.files("headlab.report").joinpath("templates", name).read_text(encoding="utf-8")


def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        return "–" if math.isnan(value) else f"{value:.{digits}g}" if abs(value) >= 1000 else f"{value:.{digits}f}"
    return str(value)


def _table(header: list[str], rows: list[list[str]], cls: str = "") -> str:
    """Rows are already-escaped HTML cells."""
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table class="{escape(cls)}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _notes(c: Collected, section: str, empty: bool) -> str:
    """What the section lacks and why: stage status from the manifest, then file notes."""
    parts = []
    for stage in c.stages_for(section):
        status = str(stage.get("status", ""))
        if status in ("skipped", "failed"):
            reason = stage.get("reason") or "no reason given"
            parts.append(f'<p class="note {escape(status)}">Stage <b>{escape(str(stage.get("name")))}</b> '
                         f'{escape(status)}: {escape(str(reason))}</p>')
    for note in c.notes:
        if note["section"] == section:
            parts.append(f'<p class="note">{escape(note["text"])}</p>')
    if empty and not parts:
        parts.append('<p class="note">No data for this section in the analysis directory.</p>')
    return "".join(parts)


def _summary(c: Collected) -> str:
    m = c.manifest
    fields = [("model", m.get("model")), ("source", m.get("source")), ("target", m.get("target")),
              ("CoNLL-U", m.get("conllu")), ("created", m.get("created")),
              ("headlab", m.get("headlab_version")), ("directory", str(c.directory))]
    dl = "".join(f"<dt>{escape(k)}</dt><dd>{escape(_fmt(v))}</dd>" for k, v in fields if v not in (None, ""))
    html = f'<dl class="summary">{dl}</dl>'
    stages = [s for s in m.get("stages", []) or [] if isinstance(s, dict)]
    if stages:
        rows = []
        for s in stages:
            status = str(s.get("status", "?"))
            outputs = s.get("outputs") or []
            outputs = outputs if isinstance(outputs, list) else [outputs]
            shown = ", ".join(str(o) for o in outputs[:4]) + (f" (+{len(outputs) - 4} more)" if len(outputs) > 4 else "")
            seconds = s.get("seconds")
            rows.append([escape(str(s.get("name", "?"))), f'<span class="status {escape(status)}">{escape(status)}</span>',
                         escape(str(s.get("reason") or "")),
                         escape(f"{seconds:.1f}") if isinstance(seconds, (int, float)) else "–", escape(shown)])
        html += _table(["stage", "status", "reason", "seconds", "outputs"], rows, "stages")
    return html + _notes(c, "summary", False)


def _function_table(c: Collected) -> str:
    if not c.labels:
        return ""
    def order(key: str):
        kind, layer, head = (key.split(":") + ["", "", ""])[:3]
        return (KINDS.index(kind) if kind in KINDS else 9, int(layer) if layer.isdigit() else 0,
                int(head) if head.isdigit() else 0)
    rows = []
    for key in sorted(c.labels, key=order):
        kind, layer, head = (key.split(":") + ["", "", ""])[:3]
        rows.append(f'<tr class="head-link" tabindex="0" data-kind="{escape(kind)}" data-layer="{escape(layer)}" '
                    f'data-head="{escape(head)}"><td>{escape(kind)}</td><td>{escape(layer)}</td><td>{escape(head)}</td>'
                    f'<td>{escape(", ".join(c.labels[key]))}</td></tr>')
    return ('<h3>Head functions</h3><p class="caption">Heads that pass a function test (click a row to see the '
            'head in the viewer).</p><table class="functions"><thead><tr><th>kind</th><th>layer</th><th>head</th>'
            f'<th>functions</th></tr></thead><tbody>{"".join(rows)}</tbody></table>')


def _table1(c: Collected) -> str:
    if not c.table1:
        return ""
    rows = []
    for r in c.table1:
        best = r.get("best_head")
        arcs = str(r.get("arcs", r.get("n_arcs")))  # "reachable / all" under a causal mask
        if r.get("n_arcs", 0) == 0 or r.get("unreachable"):
            rows.append([escape(str(r.get("kind"))), escape(str(r.get("relation"))), escape(str(r.get("label", ""))),
                         escape(arcs), escape(str(r.get("status") or "absent from the data")), "", "", ""])
            continue
        head = (f'<a href="#viewer" class="head-link" data-kind="{escape(str(r.get("kind")))}" data-layer="{int(best[0])}" '
                f'data-head="{int(best[1])}">L{int(best[0])} H{int(best[1])}</a>') if best else "–"
        acc, base = r.get("best_accuracy"), r.get("baseline")
        offset = r.get("baseline_offset")
        rows.append([escape(str(r.get("kind"))), escape(str(r.get("relation"))), escape(str(r.get("label", ""))),
                     escape(arcs), head, escape(f"{acc:.1%}" if isinstance(acc, (int, float)) else "–"),
                     escape(f"{base:.1%} ({offset:+d})" if isinstance(base, (int, float)) and isinstance(offset, int) else "–"),
                     escape(str(r.get("n_syntactic", "")))])
    return ('<h3>Syntactic heads (Table 1 analogue)</h3><p class="caption">Accuracy of the best head per dependency '
            'relation and direction, against the baseline of always guessing the most frequent relative offset '
            '(Voita et al. 2019, Sec. 5.2, Table 1).'
            + (' Causal attention (decoder self-attention) sees only earlier words: its arcs read "reachable / all", '
               'a direction most of whose arcs point forward is unreachable and not scored, and its baselines use '
               'backward offsets only.' if any(r.get("kind") in CAUSAL_KINDS for r in c.table1) else '') + '</p>'
            + _table(["kind", "relation", "direction", "arcs", "best head", "accuracy", "baseline (offset)",
                      "syntactic heads"], rows, "table1"))


def _num(v) -> str:
    return f'<span class="num">{escape(f"{v:+.2f}")}</span>' if isinstance(v, (int, float)) else "n/a"


def _agreement_matrix(a: dict) -> str:
    """The measure-by-measure Spearman matrix that ``headlab analyze`` writes, per column."""
    names = [str(m) for m in a.get("measures") or []]
    matrix = a.get("matrix") or {}
    n_heads = a.get("n_heads") or {}
    html = ""
    columns = [col for col in a.get("columns") or list(matrix) if isinstance(matrix.get(col), list)]
    for col in sorted(columns, key=lambda col: col != "all"):  # all heads first, then each kind
        rows = [[escape(m)] + [_num(v) for v in (row if isinstance(row, list) else [])]
                for m, row in zip(names, matrix[col])]
        title = "all heads" if col == "all" else col
        if col in n_heads:
            title += f" ({n_heads[col]} heads)"
        html += f"<h3>{escape(title)}</h3>" + _table(["measure"] + names, rows, "agreement")
    return html


def _agreement(c: Collected) -> str:
    a = c.agreement
    if not a:
        return _notes(c, "agreement", True)
    html = ""
    if isinstance(a.get("matrix"), dict) and a.get("measures"):
        html += ('<p class="caption">Spearman rank correlation between every pair of importance measures, over '
                 'the heads both score.</p>' + _agreement_matrix(a))
    spearman = a.get("spearman") if isinstance(a.get("spearman"), dict) else {}
    if spearman and a.get("reference"):
        n_heads = a.get("n_heads") or {}
        columns = list(n_heads) or sorted({col for row in spearman.values() for col in row})
        rows = []
        for method, row in spearman.items():
            rows.append([escape(str(method))] + [_num(row.get(col) if isinstance(row, dict) else None)
                                                 for col in columns])
        header = ["measure"] + [f"{col} ({n_heads[col]} heads)" if col in n_heads else col for col in columns]
        metric = f" ({a.get('metric')})" if a.get("metric") else ""
        html += (f'<p class="caption">Spearman rank correlation of each measure with {escape(str(a["reference"]))}'
                 f'{escape(metric)}, per attention kind and over all heads.</p>' + _table(header, rows, "agreement"))
    if not html:
        return _notes(c, "agreement", True)
    return html + _notes(c, "agreement", False)


def _sweep(c: Collected) -> str:
    if not c.sweep:
        return _notes(c, "pruning", True)
    columns = [k for k in ("point", "lam", "keep", "enc_self", "dec_self", "dec_cross", "heads", "bleu", "chrf", "loss",
                           "status") if any(k in row for row in c.sweep)]
    rows = [[escape(_fmt(row.get(k))) for k in columns] for row in c.sweep]
    return ('<p class="caption">Gated pruning sweep (Voita et al. 2019, Sec. 6): heads kept per kind and '
            'translation quality at each point.</p>' + _table(columns, rows, "sweep") + _notes(c, "pruning", False))


def _figures(c: Collected) -> str:
    parts = []
    for f in c.figures:
        png = c.directory / f["png"]
        data = base64.b64encode(png.read_bytes()).decode("ascii")
        svg = f.get("svg")
        link = (f' <a href="{escape(str(svg), quote=True)}">SVG</a>' if svg and (c.directory / svg).is_file() else "")
        parts.append(f'<figure><img alt="{escape(str(f.get("title") or f.get("name", "")), quote=True)}" '
                     f'src="data:image/png;base64,{data}"><figcaption><b>{escape(str(f.get("title") or f.get("name", "")))}'
                     f'</b> {escape(str(f.get("caption") or ""))}{link}</figcaption></figure>')
    return "".join(parts) + _notes(c, "figures", not parts)


def _attention(c: Collected, inline_limit: int) -> tuple[str, dict]:
    """The attention data blocks (inlined) or sidecar .js files, and the viewer's index."""
    index = c.attention
    if not index:
        return "", {"sentences": [], "mode": "none"}
    directory = c.directory / "attention"
    sentences, payloads, total = [], [], 0
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
        keep["slot"] = len(sentences)
        sentences.append(keep)
        payloads.append((path, text))
        total += len(text)
    inline = total <= inline_limit
    blocks = []
    for slot, (path, text) in enumerate(payloads):
        data = json_for_script(json.loads(text))
        if inline:
            blocks.append(f'<script type="application/json" id="headlab-attention-{slot}">{data}</script>')
        else:
            js = path.with_suffix(".js")
            atomic_write_text(js, f"window.headlabAttention({slot},{data});\n")
            sentences[slot]["script"] = f"attention/{js.name}"
    return "\n".join(blocks), {"sentences": sentences, "mode": "inline" if inline else "script",
                               "model": index.get("model", "")}


def build_report(analysis_dir: Path, inline_limit: int = INLINE_LIMIT) -> Path:
    """Write ``analysis_dir/index.html`` from whatever the directory holds; return its path."""
    directory = Path(analysis_dir)
    if not directory.is_dir():
        raise HeadlabError(f"{directory}: not an analysis directory (no such directory)")
    c = collect(directory)
    attention_blocks, attention = _attention(c, inline_limit)
    data = {
        "heatmaps": c.heatmaps,
        "labels": c.labels,
        "attention": attention,
        "kinds": list(KINDS),
    }
    script = _template("report.js")
    digest = base64.b64encode(hashlib.sha256(script.encode("utf-8")).digest()).decode("ascii")
    csp = (f"default-src 'none'; script-src 'sha256-{digest}' 'self' file:; style-src 'unsafe-inline'; "
           "img-src data: 'self' file:; base-uri 'none'; form-action 'none'")
    model = c.manifest.get("model") or attention.get("model") or directory.name
    viewer_note = _notes(c, "viewer", not attention["sentences"])
    sections = {
        "importance": ("Head importance", "Layers (rows) by heads (columns), one map per measure and attention kind. "
                       "Click a cell to open the head in the attention viewer."),
        "functions": ("Head functions", "Positional, syntactic and rare-token heads (Voita et al. 2019, Sec. 5)."),
        "aggregate": ("Aggregate attention statistics", "Per-head statistics over the treebank (Vig & Belinkov 2019)."),
    }
    body = [f'<section id="summary"><h2>Run summary</h2>{_summary(c)}</section>']
    for name, (title, caption) in sections.items():
        has = any(h["group"] == name or (name == "aggregate" and h["group"] == "pos") for h in c.heatmaps)
        extra = (_function_table(c) + _table1(c)) if name == "functions" else ""
        body.append(f'<section id="{name}"><h2>{escape(title)}</h2><p class="caption">{escape(caption)}</p>'
                    f'{_notes(c, name, not has and not extra)}<div class="heatmaps" data-group="{name}"></div>'
                    + ('<div class="heatmaps" data-group="pos" data-select="1"></div>' if name == "aggregate" else "")
                    + f"{extra}</section>")
    body.append(f'<section id="agreement"><h2>Measure agreement</h2>{_agreement(c)}</section>')
    body.append(f'<section id="pruning"><h2>Pruning</h2>{_sweep(c)}</section>')
    body.append(f'<section id="figures"><h2>Figures</h2>{_figures(c)}</section>')
    body.append(f'<section id="viewer"><h2>Attention viewer</h2>{viewer_note}{_template("viewer.html")}</section>')
    nav = "".join(f'<a href="#{s}">{escape(t)}</a>' for s, t in (
        ("summary", "Summary"), ("importance", "Importance"), ("functions", "Functions"), ("aggregate", "Aggregate"),
        ("agreement", "Agreement"), ("pruning", "Pruning"), ("figures", "Figures"), ("viewer", "Viewer")))
    generated = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    html = f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{escape(csp, quote=True)}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<title>headlab report: {escape(str(model))}</title>
<style>{_template("report.css")}</style>
</head>
<body>
<header><h1>headlab report: <span class="model">{escape(str(model))}</span></h1>
<p class="generated">generated {escape(generated)} from {escape(str(directory))}</p>
<nav>{nav}</nav></header>
<noscript><p class="note">The heatmaps and the attention viewer need JavaScript; the tables and figures do not.</p></noscript>
<main>
{"".join(body)}
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
