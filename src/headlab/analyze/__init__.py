"""``headlab analyze``: importance, head functions, aggregate statistics, pruning, figures and
the HTML report of one model, in one resumable run (:func:`run_analysis`).

See docs/analyze.md for the stages, the directory layout and the manifest.
"""

from headlab.analyze.labels import head_labels, load_labels, save_labels
from headlab.analyze.pipeline import STAGE_GROUPS, STAGES, AnalysisRun, AnalyzeConfig, SkipStage, run_analysis
from headlab.analyze.records import StageRecord

__all__ = [
    "STAGES",
    "STAGE_GROUPS",
    "AnalysisRun",
    "AnalyzeConfig",
    "SkipStage",
    "StageRecord",
    "head_labels",
    "load_labels",
    "run_analysis",
    "save_labels",
]
