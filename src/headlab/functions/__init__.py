"""What heads do: positional, syntactic and rare-token heads (Voita et al. 2019, Sec. 5).

:func:`analyze_heads` streams a CoNLL-U treebank through a model once and computes these
functions together with the aggregate statistics of Vig & Belinkov 2019
(:mod:`headlab.aggregate`); each statistic is also usable on its own as a streaming
accumulator fed with :class:`~headlab.data.alignment.AttentionView` objects. Names are
imported on first use (:mod:`headlab._lazy`), so that ``headlab --help`` loads no torch.
"""

from headlab._lazy import lazy_exports

_EXPORTS = {
    "AnalysisConfig": "headlab.functions.config",
    "HeadAnalysis": "headlab.functions.analysis",
    "analyze_heads": "headlab.functions.analysis",
    "describe_heads": "headlab.functions.analysis",
    "PositionalHead": "headlab.functions.positional",
    "PositionalResult": "headlab.functions.positional",
    "PositionalStats": "headlab.functions.positional",
    "RareTokenResult": "headlab.functions.rare_tokens",
    "RareTokenStats": "headlab.functions.rare_tokens",
    "SyntacticResult": "headlab.functions.syntactic",
    "SyntacticStats": "headlab.functions.syntactic",
    "Table1Row": "headlab.functions.syntactic",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
