"""What heads do: positional, syntactic and rare-token heads (Voita et al. 2019, Sec. 5).

:func:`analyze_heads` streams a CoNLL-U treebank through a model once and computes these
functions together with the aggregate statistics of Vig & Belinkov 2019
(:mod:`headlab.aggregate`); each statistic is also usable on its own as a streaming
accumulator fed with :class:`~headlab.data.alignment.AttentionView` objects. Names are
imported on first use (:mod:`headlab._lazy`), so that ``headlab --help`` loads no torch.
"""

from headlab._lazy import callable_module, lazy_exports

_EXPORTS = {  # module -> the names it exports
    "headlab.functions.config": ("AnalysisConfig",),
    "headlab.functions.analysis": ("HeadAnalysis", "analyze_heads", "describe_heads"),
    "headlab.functions.positional": ("PositionalHead", "PositionalResult", "PositionalStats"),
    "headlab.functions.rare_tokens": ("RareTokenResult", "RareTokenStats"),
    "headlab.functions.syntactic": ("SyntacticResult", "SyntacticStats", "Table1Row"),
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)

# headlab.functions(model, ...) is the API's headlab.api.functions
callable_module(__name__, "headlab.api.functions")
