"""Numbers as headlab writes them in tables, reports and summaries: a zero never carries a sign.

``f"{x:.3f}"`` writes ``-0.000`` for ``-0.0`` and for any small negative value that rounds to zero (an entropy or a
correlation of ``-4e-10``, a float sum's rounding), and ``f"{x:+.2f}"`` writes ``+0.00``: a sign on a zero that
says nothing and reads as a difference. :func:`number` is the one place every writer formats a float through.
"""

from __future__ import annotations

import re

__all__ = ["number"]

_SIGNED_ZERO = re.compile(r"[+-]0*\.?0*(?:e[+-]?\d+)?%?")
"""A formatted number whose digits are all zeros, behind a sign (``-0.000``, ``+0.0%``, ``-0``, ``-0e+00``)."""


def number(value: object, spec: str) -> str:
    """``format(value, spec)``, without the sign of a value that is written as zero (``0.000``, not ``-0.000``
    nor ``+0.000``); every other value as ``format`` writes it (``-0.001``, ``+0.25``, ``nan``)."""
    text = format(value, spec)
    stripped = text.strip()
    if not _SIGNED_ZERO.fullmatch(stripped):
        return text
    unsigned = text.replace(stripped, stripped[1:])
    if text == stripped:
        return unsigned
    return unsigned.rjust(len(text)) if text.endswith(stripped) else unsigned.ljust(len(text))  # a width kept
