"""The sections of the report, in order: one :class:`Section` each, one registry (:data:`SECTIONS`).

The report's body and its navigation are both generated from :data:`SECTIONS`. Every string that
comes from the analysis directory goes through :func:`html.escape`; heatmap sections only hold a
placeholder that ``templates/report.js`` fills from the embedded data. A new section is a
function ``(Collected) -> HTML`` and one entry in :data:`SECTIONS`.
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass
from html import escape
from importlib import resources
from typing import Callable

from headlab.heads import CAUSAL_KINDS, KINDS
from headlab.report.collect import Collected

__all__ = ["Section", "SECTIONS", "render_body", "render_navigation", "template"]


@dataclass(frozen=True)
class Section:
    id: str  # the HTML id, the navigation's anchor and the ``section`` of Collected's notes
    title: str
    nav: str  # the link text in the navigation
    render: Callable[[Collected], str]  # the section's HTML after its heading
    stages: tuple[str, ...] = ()  # manifest stages (name prefixes) whose skip/failure notes it shows; () = its id


def template(name: str) -> str:
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
    for stage in c.stages_for(STAGES.get(section, (section,))):
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
        rows = [[escape(str(method))] + [_num(row.get(col) if isinstance(row, dict) else None) for col in columns]
                for method, row in spearman.items()]
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


def _heatmaps(group: str, caption: str, also: tuple[str, ...] = (), extra: Callable[[Collected], str] | None = None):
    """A section of heatmaps of ``group`` (and of ``also``, behind a selector) drawn by report.js."""
    def render(c: Collected) -> str:
        html = extra(c) if extra is not None else ""
        has = any(h["group"] in (group, *also) for h in c.heatmaps)
        return (f'<p class="caption">{escape(caption)}</p>{_notes(c, group, not has and not html)}'
                f'<div class="heatmaps" data-group="{group}"></div>'
                + "".join(f'<div class="heatmaps" data-group="{g}" data-select="1"></div>' for g in also) + html)

    return render


def _viewer(c: Collected) -> str:
    return _notes(c, "viewer", not c.viewer.get("sentences")) + template("viewer.html")


SECTIONS: tuple[Section, ...] = (
    Section("summary", "Run summary", "Summary", _summary),
    Section("importance", "Head importance", "Importance", _heatmaps(
        "importance", "Layers (rows) by heads (columns), one map per measure and attention kind. "
                      "Click a cell to open the head in the attention viewer."),
            ("importance", "confidence", "lrp", "gradient", "ablation")),
    Section("functions", "Head functions", "Functions", _heatmaps(
        "functions", "Positional, syntactic and rare-token heads (Voita et al. 2019, Sec. 5).",
        extra=lambda c: _function_table(c) + _table1(c)), ("functions", "positional", "syntactic", "rare")),
    Section("aggregate", "Aggregate attention statistics", "Aggregate", _heatmaps(
        "aggregate", "Per-head statistics over the treebank (Vig & Belinkov 2019).", also=("pos",))),
    Section("agreement", "Measure agreement", "Agreement", _agreement, ("agreement", "ablation", "importance")),
    Section("pruning", "Pruning", "Pruning", _sweep, ("prune", "pruning", "sweep")),
    Section("figures", "Figures", "Figures", _figures),
    Section("viewer", "Attention viewer", "Viewer", _viewer, ("attention", "examples", "viewer")),
)
"""The registry, in page order."""

STAGES = {s.id: s.stages or (s.id,) for s in SECTIONS}


def render_body(c: Collected) -> str:
    return "".join(f'<section id="{s.id}"><h2>{escape(s.title)}</h2>{s.render(c)}</section>' for s in SECTIONS)


def render_navigation() -> str:
    return "".join(f'<a href="#{s.id}">{escape(s.nav)}</a>' for s in SECTIONS)
