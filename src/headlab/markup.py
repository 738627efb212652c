"""The HTML pieces that the report and the plug-ins' own report parts share (:class:`headlab.plugins.ReportPart`):
number formatting, tables, inline SVG line charts, per-layer means and the reading of a JSON file
that notes its problems; and the markdown cells of the statistics' parts of the model profiles
(:class:`headlab.plugins.ProfilePart`). Below the features, so that a statistic's module can draw its own part of
the report without importing the report; the report's sections use the same pieces."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from html import escape
from pathlib import Path
from typing import Any

from headlab.heads import KINDS
from headlab.numbers import number

__all__ = ["KIND_COLOURS", "fmt", "table", "ticks", "tick_label", "line_chart", "layer_means", "shade", "finite",
           "read_json_noted", "percent", "head_cell"]

KIND_COLOURS = {"enc_self": "#2b6cb0", "dec_self": "#2f855a", "dec_cross": "#c05621"}


def fmt(value, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        return "–" if math.isnan(value) else number(value, f".{digits}g" if abs(value) >= 1000 else f".{digits}f")
    return str(value)


def table(header: list[str], rows: list[list[str]], cls: str = "") -> str:
    """Rows are already-escaped HTML cells."""
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table class="{escape(cls)}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 5, 10) if raw <= m * step)
    first = math.ceil(lo / step) * step
    digits = max(0, -math.floor(math.log10(step)))  # as many decimals as the step needs: no two labels alike
    return [round(first + i * step, digits) for i in range(int((hi - first) / step + 1e-9) + 1)]


def tick_label(t: float) -> str:
    return number(t, ".10g")


def line_chart(series: Mapping[str, Sequence[tuple[float, float | None]]], xlabel: str, ylabel: str, cls: str,
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
    if x1 == x0:  # one x: integer axes by half a step, else a one-layer model's ticks read -1, 0, 1
        d = 0.5 if integer_x else 1
        x0, x1 = x0 - d, x1 + d
    sx = lambda x: left + (x - x0) / (x1 - x0) * (w - left - right)  # noqa: E731
    sy = lambda y: top + (y1 - y) / (y1 - y0) * (h - top - bottom)  # noqa: E731
    parts = [f'<svg class="chart {escape(cls)}" width="{w}" height="{h}" viewBox="0 0 {w} {h}" role="img" '
             f'aria-label="{escape(title, quote=True)}"><text class="chart-title" x="{left}" y="14">{escape(title)}</text>']
    xt = ticks(x0, x1, 6)
    if integer_x:
        xt = sorted({round(t) for t in xt if abs(t - round(t)) < 1e-9})
    for t in xt:
        parts.append(f'<line class="grid" x1="{sx(t):.1f}" x2="{sx(t):.1f}" y1="{top}" y2="{h - bottom}"/>'
                     f'<text x="{sx(t):.1f}" y="{h - bottom + 13}" text-anchor="middle">{escape(tick_label(t))}</text>')
    for t in ticks(y0, y1, 4):
        parts.append(f'<line class="grid" x1="{left}" x2="{w - right}" y1="{sy(t):.1f}" y2="{sy(t):.1f}"/>'
                     f'<text x="{left - 4}" y="{sy(t) + 3:.1f}" text-anchor="end">{escape(tick_label(t))}</text>')
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
                         f'{escape(name)}: {escape(xlabel)} {escape(number(x, "g"))}, '
                         f'{escape(number(y, ".4g"))}</title></circle>')
        if len(series) > 1:
            parts.append(f'<text x="{legend_x}" y="{top + 10}" fill="{colour}" class="legend">{escape(name)}</text>')
            legend_x += 8 + 7 * len(name)
    return "".join(parts) + "</svg>"


def layer_means(heatmap: dict) -> dict[str, list[tuple[float, float | None]]]:
    """Per kind, the mean over the heads of each layer of a report heatmap (heads not scored left out)."""
    out: dict[str, list[tuple[float, float | None]]] = {}
    for kind in KINDS:
        rows = heatmap["scores"].get(kind)
        if rows:
            out[kind] = [(layer, (sum(v for v in row if v is not None) / n) if (n := sum(v is not None for v in row))
                          else None) for layer, row in enumerate(rows)]
    return out


def shade(value: float | None, hi: float) -> str:
    """A table cell's style: white to blue with ``value / hi``, grey when there is no value."""
    if value is None:
        return "background:#eee"
    t = 0.0 if hi <= 0 else max(0.0, min(1.0, value / hi))
    r, g, b = (round(255 - t * (255 - c)) for c in (43, 108, 176))
    return f"background:rgb({r},{g},{b});color:{'#fff' if t > 0.6 else '#1d2330'}"


def finite(value):
    """A number as the report's JSON holds it: rounded to 6 decimals; None when missing or not finite."""
    return None if value is None or not math.isfinite(value) else round(float(value), 6)


def read_json_noted(path: Path, directory: Path, note: Callable[[str], None]) -> Any:
    """The file's JSON; None when it is missing (silently) or unreadable (``note``d, with its path
    relative to the analysis ``directory``)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        pass
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        note(f"{path.relative_to(directory)}: unreadable ({error})")
    return None


def percent(value) -> str:
    """A share as a model profile writes it: ``84.9%``; ``n/a`` when missing or NaN."""
    return "n/a" if value is None or value != value else number(100 * value, ".1f") + "%"


def head_cell(kind: str, head) -> str:
    """``[layer, head]`` as a model profile writes it: ``enc_self L4 H6``; ``-`` for none."""
    return "-" if head is None or head[0] < 0 else f"{kind} L{head[0]} H{head[1]}"
