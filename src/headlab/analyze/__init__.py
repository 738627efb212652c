"""``headlab analyze``: importance, head functions, aggregate statistics, pruning, figures and
the HTML report of one model, in one resumable run (:func:`run_analysis`).

See docs/analyze.md for the stages, the directory layout and the manifest.
"""

from headlab._lazy import lazy_exports

_EXPORTS = {
    "head_labels": "headlab.analyze.labels",
    "load_labels": "headlab.analyze.labels",
    "save_labels": "headlab.analyze.labels",
    "STAGE_GROUPS": "headlab.analyze.pipeline",
    "STAGES": "headlab.analyze.pipeline",
    "AnalysisRun": "headlab.analyze.pipeline",
    "AnalyzeConfig": "headlab.analyze.pipeline",
    "SkipStage": "headlab.analyze.pipeline",
    "run_analysis": "headlab.analyze.pipeline",
    "StageRecord": "headlab.analyze.records",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
