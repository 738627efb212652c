"""``headlab analyze``: importance, head functions, aggregate statistics, pruning, figures and
the HTML report of one model, in one resumable run (:func:`run_analysis`).

See docs/analyze.md for the stages, the directory layout and the manifest.
"""

from headlab._lazy import lazy_exports

_EXPORTS = {  # module -> the names it exports
    "headlab.pipeline.labels": ("head_labels", "load_labels", "save_labels"),
    "headlab.pipeline.pipeline": ("STAGE_GROUPS", "STAGES", "AnalysisRun", "AnalyzeConfig", "SkipStage",
                                 "run_analysis"),
    "headlab.pipeline.records": ("StageRecord",),
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
