"""The sections of the report, in order: one :class:`Section` each, one registry (:data:`SECTIONS`).

The report's body and its navigation are both generated from :data:`SECTIONS`. Every string that
comes from the analysis directory goes through :func:`html.escape`; heatmap sections only hold a
placeholder that ``templates/report.js`` fills from the embedded data. A new section is a
function ``(Collected) -> HTML`` and one entry in :data:`SECTIONS`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape
from importlib import resources
from typing import Callable, Mapping, Sequence

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
    return resources.files("headlab.report").joinpath("templates").joinpath(name).read_text(encoding="utf-8")


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
    """The matplotlib figures, linked, not embedded: each draws a statistic that the page already
    shows interactively (one rendering per statistic); the files are for papers."""
    rows = []
    for f in c.figures:
        links = [f'<a href="{escape(str(f[ext]), quote=True)}">{ext.upper()}</a>'
                 for ext in ("png", "svg") if f.get(ext) and (c.directory / str(f[ext])).is_file()]
        rows.append([f'<b>{escape(str(f.get("title") or f.get("name", "")))}</b>', escape(str(f.get("caption") or "")),
                     " ".join(links)])
    html = ('<p class="caption">The same statistics drawn with matplotlib, as files for papers (not repeated on '
            'this page).</p>' + _table(["figure", "caption", "files"], rows, "figures")) if rows else ""
    return html + _notes(c, "figures", not rows)


# ---- charts drawn here, as inline SVG (no script needed) -------------------------------------------

KIND_COLOURS = {"enc_self": "#2b6cb0", "dec_self": "#2f855a", "dec_cross": "#c05621"}
TOP_N = 10
"""Heads listed per importance measure on the overview."""


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 5, 10) if raw <= m * step)
    first = math.ceil(lo / step) * step
    digits = max(0, -math.floor(math.log10(step)))  # as many decimals as the step needs: no two labels alike
    return [round(first + i * step, digits) for i in range(int((hi - first) / step + 1e-9) + 1)]


def _tick_label(t: float) -> str:
    return f"{t:.10g}"



def _line_chart(series: Mapping[str, Sequence[tuple[float, float | None]]], xlabel: str, ylabel: str, cls: str,
                title: str, integer_x: bool = False, reference: float | None = None) -> str:
    """A small line chart: one line per series (kinds take their colours), axes with ticks that
    never crowd (at most ~6 per axis), a ``<title>`` per point for its value."""
    points = [(x, y) for line in series.values() for x, y in line if y is not None and math.isfinite(y)]
    if not points:
        return ""
    w, h, left, bottom, top, right = 380, 210, 52, 38, 22, 12
    xs, ys = [p[0] for p in points], [p[1] for p in points] + ([reference] if reference is not None else [])
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if y1 == y0:
        y0, y1 = y0 - 0.5, y1 + 0.5
    pad = (y1 - y0) * 0.06
    y0, y1 = y0 - pad, y1 + pad
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    sx = lambda x: left + (x - x0) / (x1 - x0) * (w - left - right)  # noqa: E731
    sy = lambda y: top + (y1 - y) / (y1 - y0) * (h - top - bottom)  # noqa: E731
    parts = [f'<svg class="chart {escape(cls)}" width="{w}" height="{h}" viewBox="0 0 {w} {h}" role="img" '
             f'aria-label="{escape(title, quote=True)}"><text class="chart-title" x="{left}" y="14">{escape(title)}</text>']
    xt = _ticks(x0, x1, 6)
    if integer_x:
        xt = sorted({round(t) for t in xt if abs(t - round(t)) < 1e-9})
    for t in xt:
        parts.append(f'<line class="grid" x1="{sx(t):.1f}" x2="{sx(t):.1f}" y1="{top}" y2="{h - bottom}"/>'
                     f'<text x="{sx(t):.1f}" y="{h - bottom + 13}" text-anchor="middle">{escape(_tick_label(t))}</text>')
    for t in _ticks(y0, y1, 4):
        parts.append(f'<line class="grid" x1="{left}" x2="{w - right}" y1="{sy(t):.1f}" y2="{sy(t):.1f}"/>'
                     f'<text x="{left - 4}" y="{sy(t) + 3:.1f}" text-anchor="end">{escape(_tick_label(t))}</text>')
    parts.append(f'<text x="{(left + w - right) / 2:.0f}" y="{h - 6}" text-anchor="middle">{escape(xlabel)}</text>'
                 f'<text x="12" y="{(top + h - bottom) / 2:.0f}" text-anchor="middle" '
                 f'transform="rotate(-90 12 {(top + h - bottom) / 2:.0f})">{escape(ylabel)}</text>')
    if reference is not None:
        parts.append(f'<line class="reference" x1="{left}" x2="{w - right}" y1="{sy(reference):.1f}" '
                     f'y2="{sy(reference):.1f}"/>')
    legend_x = left + 6
    for i, (name, line) in enumerate(series.items()):
        colour = KIND_COLOURS.get(name, ("#553c9a", "#b7791f", "#4a5568")[i % 3])
        line = [(x, y) for x, y in line if y is not None and math.isfinite(y)]
        if not line:
            continue
        path = " ".join(f"{'M' if j == 0 else 'L'}{sx(x):.1f},{sy(y):.1f}" for j, (x, y) in enumerate(line))
        parts.append(f'<path class="series" data-series="{escape(name, quote=True)}" d="{path}" stroke="{colour}"/>')
        for x, y in line:
            parts.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{colour}"><title>'
                         f'{escape(name)}: {escape(xlabel)} {escape(f"{x:g}")}, {escape(f"{y:.4g}")}</title></circle>')
        if len(series) > 1:
            parts.append(f'<text x="{legend_x}" y="{top + 10}" fill="{colour}" class="legend">{escape(name)}</text>')
            legend_x += 8 + 7 * len(name)
    return "".join(parts) + "</svg>"


def _layer_means(heatmap: dict) -> dict[str, list[tuple[float, float | None]]]:
    """Per kind, the mean over the heads of each layer (heads not scored left out)."""
    out: dict[str, list[tuple[float, float | None]]] = {}
    for kind in KINDS:
        rows = heatmap["scores"].get(kind)
        if rows:
            out[kind] = [(layer, (sum(v for v in row if v is not None) / n) if (n := sum(v is not None for v in row))
                          else None) for layer, row in enumerate(rows)]
    return out


def _head_link(kind: str, layer: int, head: int, text: str | None = None) -> str:
    return (f'<a href="#viewer" class="head-link" data-kind="{escape(kind)}" data-layer="{layer}" data-head="{head}">'
            f'{escape(text or f"{kind} L{layer} H{head}")}</a>')


def _top_heads(c: Collected) -> str:
    """The top :data:`TOP_N` heads of each importance measure (all kinds pooled), with labels."""
    maps = [h for h in c.heatmaps if h["group"] == "importance" and not h["name"].endswith("_stderr")]
    if not maps:
        return ""
    columns = []
    for h in maps:
        cells = [(v, kind, layer, head) for kind in KINDS for layer, row in enumerate(h["scores"].get(kind) or [])
                 for head, v in enumerate(row) if v is not None]
        cells.sort(key=lambda t: (-t[0], KINDS.index(t[1]), t[2], t[3]))
        columns.append(cells[:TOP_N])
    rows = []
    for rank in range(max(len(col) for col in columns)):
        row = [str(rank + 1)]
        for col in columns:
            if rank >= len(col):
                row.append("")
                continue
            v, kind, layer, head = col[rank]
            labels = c.labels.get(f"{kind}:{layer}:{head}", [])
            row.append(_head_link(kind, layer, head) + f' <span class="num">{escape(f"{v:.3g}")}</span>'
                       + (f'<br><span class="fn">{escape(", ".join(labels))}</span>' if labels else ""))
        rows.append(row)
    total = max(sum(sum(len(r) for r in rows_) for rows_ in h["scores"].values()) for h in maps)
    return (f'<h3>Which heads matter</h3><p class="caption">The {TOP_N} most important heads by each measure, out of '
            f'{total} (all attention kinds pooled; higher = more important), with the functions they pass. '
            'Click a head to open it in the viewer.</p>'
            + _table(["rank"] + [h["title"] for h in maps], rows, "top-heads"))


def _agreement_line(c: Collected) -> str:
    """Each pair of measures once: from the measure-by-measure matrix, else the table against
    the reference (``analyze --ablation`` writes both, the pairs with ablation in each)."""
    a = c.agreement or {}
    pairs: dict[frozenset, str] = {}
    names = [str(m) for m in a.get("measures") or []]
    matrix = (a.get("matrix") or {}).get("all") if isinstance(a.get("matrix"), dict) else None
    if isinstance(matrix, list):
        for i, row in enumerate(matrix[:len(names)]):
            for j in range(i + 1, len(names)):
                v = row[j] if isinstance(row, list) and j < len(row) else None
                pairs.setdefault(frozenset((names[i], names[j])), f"{escape(names[i])} / {escape(names[j])} {_num(v)}")
    spearman = a.get("spearman") if isinstance(a.get("spearman"), dict) else {}
    if spearman and a.get("reference"):
        reference = str(a["reference"])
        for method, row in spearman.items():
            v = row.get("all") if isinstance(row, dict) else None
            pairs.setdefault(frozenset((str(method), reference)),
                             f"{escape(str(method))} / {escape(reference)} {_num(v)}")
    if not pairs:
        return ""
    return ('<h3>Agreement between measures</h3><p class="caption">Spearman rank correlation over all heads '
            '(<a href="#agreement">per kind</a>).</p><p class="agreement-pairs">' + " · ".join(pairs.values()) + "</p>")


def _pruning_chart(c: Collected) -> str:
    rows = [r for r in c.sweep or [] if isinstance(r.get("heads"), (int, float))]
    metric = next((m for m in ("bleu", "chrf", "loss") if any(isinstance(r.get(m), (int, float)) for r in rows)), None)
    if not rows or metric is None:
        return ""
    full = next((r.get(metric) for r in rows if r.get("point") == "full"), None)
    line = sorted((float(r["heads"]), float(r[metric])) for r in rows
                  if isinstance(r.get(metric), (int, float)) and r.get("point") != "full")
    if not line:
        line = [(float(r["heads"]), float(r[metric])) for r in rows if isinstance(r.get(metric), (int, float))]
    chart = _line_chart({metric: line}, "heads kept", metric.upper() if metric != "loss" else "loss", "pruning-curve",
                        f"Pruning: {metric} against heads kept", integer_x=True,
                        reference=float(full) if isinstance(full, (int, float)) else None)
    return ('<h3>Pruning curve</h3><p class="caption">Quality of the pruned model at each head budget (Voita et al. '
            '2019, Fig. 7); dashed: the full model. <a href="#pruning">The sweep</a>.</p>' + chart)


def _overview(c: Collected) -> str:
    n_labelled = len(c.labels)
    html = _top_heads(c)
    if n_labelled:
        html += (f'<p class="caption">{n_labelled} head{"s" if n_labelled != 1 else ""} pass a function test: '
                 '<a href="#functions">the list</a>.</p>')
    html += _agreement_line(c) + _pruning_chart(c)
    return html or '<p class="note">No importance, agreement or pruning results in the analysis directory.</p>'


def _layer_curves(c: Collected) -> str:
    """Vig & Belinkov's per-layer curves: the mean over heads of each statistic, per layer."""
    charts = []
    for name, ylabel in (("mean_distance", "words"), ("dependency_alignment", "share"), ("mean_entropy", "nats")):
        h = next((h for h in c.heatmaps if h["group"] == "aggregate" and h["name"] == name), None)
        if h is not None:
            charts.append(_line_chart(_layer_means(h), "layer", ylabel, f"layer-curve {name}",
                                      f"{h['title']} by layer", integer_x=True))
    if not any(charts):
        return ""
    return ('<h3>By layer</h3><p class="caption">Mean over the heads of each layer (Vig &amp; Belinkov 2019, '
            'Figs. 2-4): attention distance, dependency alignment and entropy.</p><div class="charts">'
            + "".join(charts) + "</div>")


def _shade(value: float | None, hi: float) -> str:
    if value is None:
        return "background:#eee"
    t = 0.0 if hi <= 0 else max(0.0, min(1.0, value / hi))
    r, g, b = (round(255 - t * (255 - c)) for c in (43, 108, 176))
    return f"background:rgb({r},{g},{b});color:{'#fff' if t > 0.6 else '#1d2330'}"


def _pos_grid(c: Collected) -> str:
    """Tags (rows) by layers (columns): the share of attention on words of the tag, mean over heads."""
    maps = [h for h in c.heatmaps if h["group"] == "pos"]
    if not maps:
        return ""
    html = ('<h3>Attention by part of speech, all tags</h3><p class="caption">Share of attention on words of each '
            'UPOS tag (rows), mean over the heads of each layer (columns), per attention kind; darker = more. '
            'Pick a tag below for its heads.</p>')
    for kind in KINDS:
        table = {h["name"]: dict(_layer_means(h)).get(kind) or [] for h in maps}
        table = {tag: line for tag, line in table.items() if line}
        if not table:
            continue
        n_layers = max(len(line) for line in table.values())
        hi = max((v for line in table.values() for _, v in line if v is not None), default=0.0)
        step = 1 if n_layers <= 16 else 2
        head = "".join(f"<th>{layer if layer % step == 0 else ''}</th>" for layer in range(n_layers))
        body = "".join(
            f"<tr><th>{escape(tag)}</th>" + "".join(
                f'<td style="{_shade(v, hi)}" title="{escape(f"{tag}, layer {x}: " + _fmt(v), quote=True)}"></td>'
                for x, v in line) + "</tr>"
            for tag, line in table.items())
        html += (f'<div class="pos-grid-wrap"><div class="hm-kind-title">{escape(kind)} (layer →)</div>'
                 f'<table class="pos-grid" data-kind="{escape(kind)}"><thead><tr><th>tag</th>{head}</tr></thead>'
                 f'<tbody>{body}</tbody></table></div>')
    return html


def _exemplars(c: Collected) -> str:
    if not c.exemplars:
        return ""
    return ('<h3>Exemplars</h3><p class="caption">The sentences in which the selected head puts its largest single '
            'weight (query word → key word), from aggregate/exemplars.json. Select a head in any heatmap.</p>'
            '<div id="exemplars" class="exemplars"></div>')


def _heatmaps(group: str, caption: str, also: tuple[str, ...] = (), extra: Callable[[Collected], str] | None = None,
              before: Callable[[Collected], str] | None = None):
    """A section of heatmaps of ``group`` (and of ``also``, behind a selector) drawn by report.js,
    with ``before`` above them and ``extra`` below."""
    def render(c: Collected) -> str:
        html = extra(c) if extra is not None else ""
        top = before(c) if before is not None else ""
        has = any(h["group"] in (group, *also) for h in c.heatmaps)
        return (f'<p class="caption">{escape(caption)}</p>{_notes(c, group, not has and not html)}{top}'
                f'<div class="heatmaps" data-group="{group}"></div>'
                + "".join(f'<div class="heatmaps" data-group="{g}" data-select="1"></div>' for g in also) + html)

    return render


def _viewer(c: Collected) -> str:
    return _notes(c, "viewer", not c.viewer.get("sentences")) + template("viewer.html")


SECTIONS: tuple[Section, ...] = (
    Section("overview", "Which heads matter and what they do", "Overview", _overview,
            ("importance", "confidence", "lrp", "gradient", "ablation")),
    Section("summary", "Run summary", "Summary", _summary),
    Section("importance", "Head importance", "Importance", _heatmaps(
        "importance", "Layers (rows) by heads (columns), one map per measure and attention kind. "
                      "Click a cell to open the head in the attention viewer."),
            ("importance", "confidence", "lrp", "gradient", "ablation")),
    Section("functions", "Head functions", "Functions", _heatmaps(
        "functions", "Positional, syntactic and rare-token heads (Voita et al. 2019, Sec. 5).",
        extra=lambda c: _function_table(c) + _table1(c)), ("functions", "positional", "syntactic", "rare")),
    Section("aggregate", "Aggregate attention statistics", "Aggregate", _heatmaps(
        "aggregate", "Per-head statistics over the treebank (Vig & Belinkov 2019).", also=("pos",),
        before=_layer_curves, extra=lambda c: _pos_grid(c) + _exemplars(c))),
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
