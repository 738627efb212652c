"""Small self-contained HTML for notebooks (``_repr_html_``): inline SVG heatmaps, no script, no
network, no plotting library, so that a result displays in Jupyter as it does in a report
opened offline. A ``[n_layers, n_heads]`` array becomes a grid of cells (layers down, heads
across), a cell's tooltip naming the head and its value; NaN cells (not scored) stay blank.
"""

from __future__ import annotations

import math
from html import escape
from typing import Mapping, Sequence

import numpy as np

from headlab.numbers import number

__all__ = ["heatmap_svg", "heatmaps_html", "table_html"]

CELL = 14  # pixels per head: a 32 x 32 model stays under 500 px


def _colour(t: float) -> str:
    """White to dark blue for t in [0, 1] (one hue: magnitudes, not signs)."""
    t = min(1.0, max(0.0, t))
    r, g, b = (int(round(255 + (end - 255) * t)) for end in (8, 48, 107))
    return f"#{r:02x}{g:02x}{b:02x}"


def heatmap_svg(array: np.ndarray, title: str = "", labels: Mapping[tuple[int, int], str] | None = None) -> str:
    """One ``[n_layers, n_heads]`` array as an SVG heatmap scaled to its finite range; ``labels``
    (``{(layer, head): text}``) mark a head with a dot and add the text to its tooltip."""
    array = np.asarray(array, dtype=np.float64)
    n_layers, n_heads = array.shape
    finite = array[np.isfinite(array)]
    low, high = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    span = high - low or 1.0
    left, top = 26, 16 if title else 4
    width, height = left + n_heads * CELL + 4, top + n_layers * CELL + 14
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'style="font:9px sans-serif" role="img" aria-label="{escape(title, quote=True)}">'
             '<g stroke="#ddd" stroke-width="0.5">']
    if title:
        parts.append(f'<text x="{left}" y="11">{escape(title)}</text>')
    for layer in range(n_layers):
        if n_layers <= 12 or layer % 2 == 0:  # every other tick at depth: labels must not run together
            parts.append(f'<text x="{left - 3}" y="{top + layer * CELL + 10}" text-anchor="end">{layer}</text>')
        for head in range(n_heads):
            value = float(array[layer, head])
            note = (labels or {}).get((layer, head), "")
            shown = "not scored" if math.isnan(value) else number(value, ".4g")
            fill = "#fff" if math.isnan(value) else _colour((value - low) / span)
            x, y = left + head * CELL, top + layer * CELL
            parts.append(f'<rect x="{x}" y="{y}" width="{CELL - 1}" height="{CELL - 1}" fill="{fill}"><title>'
                         f'L{layer} H{head}: {shown}{escape(" - " + note) if note else ""}</title></rect>')
            if note:
                parts.append(f'<circle cx="{x + CELL / 2 - 0.5}" cy="{y + CELL / 2 - 0.5}" r="2.5" fill="#e6550d"/>')
    parts.append("</g>")
    for head in range(0, n_heads, 1 if n_heads <= 16 else 4):
        parts.append(f'<text x="{left + head * CELL + CELL / 2}" y="{top + n_layers * CELL + 10}" '
                     f'text-anchor="middle">{head}</text>')
    parts.append("</svg>")
    return "".join(parts)


def heatmaps_html(maps: Sequence[tuple[str, np.ndarray, Mapping[tuple[int, int], str] | None]], caption: str = "") -> str:
    """Several heatmaps side by side, wrapping; ``maps``: ``(title, array, labels)``."""
    cells = "".join(f'<div style="display:inline-block;margin:0 8px 6px 0;vertical-align:top">'
                    f'{heatmap_svg(array, title, labels)}</div>' for title, array, labels in maps)
    note = f'<div style="font-size:11px;color:#555">{escape(caption)}</div>' if caption else ""
    return f"<div>{note}{cells}</div>"


def table_html(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain small HTML table (values escaped)."""
    head = "".join(f"<th>{escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{escape(str(v))}</td>" for v in row) + "</tr>" for row in rows)
    return f'<table style="font-size:11px"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'
