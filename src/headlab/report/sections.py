"""The sections of the report, in order: one :class:`Section` each, one registry (:data:`SECTIONS`).

The report's body and its navigation are both generated from :data:`SECTIONS`. Every string that
comes from the analysis directory goes through :func:`html.escape`; heatmap sections only hold a
placeholder that ``templates/report.js`` fills from the embedded data. A new section is a module
with its :class:`Section` (its ``render(Collected) -> HTML`` and, for files no other section
reads, its own ``collect(directory, note)``) and one entry in :data:`SECTIONS` (CONTRIBUTING.md).
"""

from __future__ import annotations

import functools
from html import escape
from importlib import resources
from typing import Callable

from headlab._lazy import LazyRegistry
from headlab.errors import counted
from headlab.heads import KINDS, not_comparable_across_layers
from headlab.markup import fmt as _fmt
from headlab.markup import line_chart as _line_chart
from headlab.markup import table as _table
from headlab.numbers import number
from headlab.plugins import ReportPart
from headlab.report.collect import Collected
from headlab.report.section import MEASURE_STAGES, REFERENCE_STAGE, Section

__all__ = ["Section", "SECTIONS", "render_body", "render_navigation", "template", "report_parts", "embedded"]


def template(name: str) -> str:
    return resources.files("headlab.report").joinpath("templates").joinpath(name).read_text(encoding="utf-8")


def _notes(c: Collected, section: str, empty: bool) -> str:
    """What the section lacks and why: stage status from the manifest, then file notes."""
    parts = []
    declared = SECTIONS.get(section)
    for stage in c.stages_for(declared.stage_prefixes() if declared is not None else (section,)):
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


def report_parts(section: str | None = None) -> list[ReportPart]:
    """The report parts that the registered measures and statistics declare (of ``section``; None:
    all), in registry order."""
    return [part for _, part in _parts_by_stage() if section in (None, part.section)]


def _parts_by_stage() -> list[tuple[str, ReportPart]]:
    """``(stage, part)``: each report part with the analyze stage that writes its files."""
    from headlab.functions.registry import STATISTICS
    from headlab.importance.registry import MEASURES

    return [(stage, part) for stage, plugin in (*((m.name, m) for m in MEASURES.values()),
                                               *((s.stage, s) for s in STATISTICS.values()))
            for part in plugin.report]


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


def _num(v) -> str:
    return f'<span class="num">{escape(number(v, "+.2f"))}</span>' if isinstance(v, (int, float)) else "n/a"


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
            title += f" ({counted(n_heads[col], 'head')})"
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
        header = ["measure"] + [f"{col} ({counted(n_heads[col], 'head')})" if col in n_heads else col for col in columns]
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

TOP_N = 10
"""Heads listed per importance measure on the overview."""


def _head_link(kind: str, layer: int, head: int, text: str | None = None) -> str:
    return (f'<a href="#viewer" class="head-link" data-kind="{escape(kind)}" data-layer="{layer}" data-head="{head}">'
            f'{escape(text or f"{kind} L{layer} H{head}")}</a>')


def _top_heads(c: Collected) -> str:
    """The top :data:`TOP_N` heads of each importance measure (all kinds pooled), with labels.

    A measure normalised per layer (gradient importance, LRP) is left out where the layers keep
    different numbers of heads or one each: its values are then on different scales (a layer's only
    head scores 1 in gradient importance, so a model with one head per layer showed a ranking of ties)."""
    maps = [h for h in c.heatmaps if h["group"] == "importance" and not h["name"].endswith("_stderr")]
    why = {h["id"]: not_comparable_across_layers(h["scores"]) for h in maps if h["id"] in c.per_layer}
    left_out = [h for h in maps if why.get(h["id"])]
    maps = [h for h in maps if h not in left_out]
    note = "".join(f" {escape(h['title'])} is not ranked here: it is normalised per layer and {why[h['id']]}, so "
                   "its values are not comparable across layers (the fewer heads a layer keeps, the larger their "
                   "shares; a layer's only head takes all of it); see its heatmap"
                   + (", and the unnormalised gradients in Gradient importance (raw)." if h["name"] == "gradient"
                      and any(m["name"] == "gradient_raw" for m in maps) else ".") for h in left_out)
    if not maps:
        return (f'<h3>Which heads matter</h3><p class="caption">{note.strip()}</p>') if note else ""
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
            row.append(_head_link(kind, layer, head) + f' <span class="num">{escape(number(v, ".3g"))}</span>'
                       + (f'<br><span class="fn">{escape(", ".join(labels))}</span>' if labels else ""))
        rows.append(row)
    # heads with a score: a pruned model's removed heads are empty cells of its maps
    total = max(sum(v is not None for rows_ in h["scores"].values() for r in rows_ for v in r) for h in maps)
    return (f'<h3>Which heads matter</h3><p class="caption">The {TOP_N} most important heads by each measure, out of '
            f'{total} (all attention kinds pooled; higher = more important), with the functions they pass. '
            f'Click a head to open it in the viewer.{note}</p>'
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


def _heatmaps(group: str, caption: str, also: tuple[str, ...] = (), extra: Callable[[Collected], str] | None = None):
    """A section of heatmaps of ``group`` (and of ``also``, behind a selector) drawn by report.js,
    with ``extra`` below them, and the plug-ins' report parts of ``group`` above (``before``) or below."""
    def render(c: Collected) -> str:
        parts = report_parts(group)
        html = (extra(c) if extra is not None else "") + "".join(p.render(c) for p in parts if not p.before)
        top = "".join(p.render(c) for p in parts if p.before)
        has = any(h["group"] in (group, *also) for h in c.heatmaps)
        return (f'<p class="caption">{escape(caption)}</p>{_notes(c, group, not has and not html)}{top}'
                f'<div class="heatmaps" data-group="{group}"></div>'
                + "".join(f'<div class="heatmaps" data-group="{g}" data-select="1"></div>' for g in also) + html)

    return render


def _viewer(c: Collected) -> str:
    return _notes(c, "viewer", not c.viewer.get("sentences")) + template("viewer.html")


SECTIONS = LazyRegistry({**{s.id: s for s in (
    Section("overview", "Which heads matter and what they do", "Overview", _overview,
            ("importance", MEASURE_STAGES)),
    Section("summary", "Run summary", "Summary", _summary),
    Section("importance", "Head importance", "Importance", _heatmaps(
        "importance", "Layers (rows) by heads (columns), one map per measure and attention kind. "
                      "Click a cell to open the head in the attention viewer."),
            ("importance", MEASURE_STAGES), parts=True),
    Section("functions", "Head functions", "Functions", _heatmaps(
        "functions", "Positional, syntactic and rare-token heads (Voita et al. 2019, Sec. 5).",
        extra=_function_table), ("functions",), parts=True),
    Section("aggregate", "Aggregate attention statistics", "Aggregate", _heatmaps(
        "aggregate", "Per-head statistics over the treebank (Vig & Belinkov 2019).", also=("pos",)), parts=True),
    Section("agreement", "Measure agreement", "Agreement", _agreement, ("agreement", REFERENCE_STAGE, "importance")),
    Section("pruning", "Pruning", "Pruning", _sweep, ("prune", "pruning", "sweep")),
    Section("figures", "Figures", "Figures", _figures),
    Section("viewer", "Attention viewer", "Viewer", _viewer, ("attention", "examples", "viewer")),
)},
    # A section in a module of its own: "id": "headlab.report.<module>.<SECTION>",
})
"""The registry, id -> :class:`Section` (or its full path), in page order."""


def collect_sections(c: Collected) -> None:
    """Each section's and each report part's own reading of the directory, into ``c.sections``
    (its problems: its section's notes)."""
    for section in SECTIONS.values():
        if section.collect is not None:
            c.sections[section.id] = section.collect(c.directory, lambda text, s=section.id: c.note(s, text))
    for stage, part in _parts_by_stage():
        host = SECTIONS.get(part.section)
        if host is None or not host.parts:
            raise ValueError(f"report part {part.name!r}: {part.section!r} is no section that draws parts "
                             f"({', '.join(s.id for s in SECTIONS.values() if s.parts)})")
        # its files are of a stage the manifest says did not finish (noted with the stage's files)
        if part.collect is not None and not c.vouched.stage_left_out(stage):
            c.sections[part.name] = part.collect(c.directory, functools.partial(c.note, part.section))


def embedded(c: Collected) -> dict:
    """What the sections and the report parts hand to the page's script, by their ``embed`` key."""
    return {**{s.embed: c.sections.get(s.id) for s in SECTIONS.values() if s.embed},
            **{p.embed: c.sections.get(p.name) for p in report_parts() if p.embed}}


def render_body(c: Collected) -> str:
    return "".join(f'<section id="{escape(s.id)}"><h2>{escape(s.title)}</h2>{s.render(c)}</section>'
                   for s in SECTIONS.values())


def render_navigation() -> str:
    return "".join(f'<a href="#{escape(s.id)}">{escape(s.nav)}</a>' for s in SECTIONS.values())
