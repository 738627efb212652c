"""What heads do: positional, syntactic and rare-token heads (Voita et al. 2019, Sec. 5).

:func:`analyze_heads` streams a CoNLL-U treebank through a model once and computes these
functions together with the aggregate statistics of Vig & Belinkov 2019
(:mod:`headlab.aggregate`); each statistic is also usable on its own as a streaming
accumulator fed with :class:`~headlab.data.alignment.AttentionView` objects.

Names are imported on first use, so that :mod:`headlab.aggregate` can share
:mod:`headlab.functions.common` without an import cycle.
"""

from importlib import import_module

_EXPORTS = {
    "AnalysisConfig": "analysis",
    "HeadAnalysis": "analysis",
    "analyze_heads": "analysis",
    "describe_heads": "analysis",
    "PositionalHead": "positional",
    "PositionalResult": "positional",
    "PositionalStats": "positional",
    "RareTokenResult": "rare_tokens",
    "RareTokenStats": "rare_tokens",
    "SyntacticResult": "syntactic",
    "SyntacticStats": "syntactic",
    "Table1Row": "syntactic",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(f"headlab.functions.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'headlab.functions' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_EXPORTS))
