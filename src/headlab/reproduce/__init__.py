"""Reproduce the findings of Voita et al. 2019 on open models and data (``headlab reproduce``).

A staged, resumable pipeline (:mod:`headlab.reproduce.stages`, run by
:func:`headlab.reproduce.pipeline.run_pipeline`) runs headlab's own commands for every model of a
config file (``experiments/reproduce.json``); the small result files go to
``docs/results/reproduction/<model>/`` (:mod:`headlab.reproduce.results`); each claim of the
paper is computed from those files only (:mod:`headlab.reproduce.claims`) and written into
docs/reproduction.md between generated markers (:mod:`headlab.reproduce.render`).
"""

from headlab._lazy import lazy_exports

_EXPORTS = {
    "Cell": "headlab.reproduce.claims",
    "Check": "headlab.reproduce.claims",
    "Claim": "headlab.reproduce.claims",
    "compute_claims": "headlab.reproduce.claims",
    "ModelEntry": "headlab.reproduce.config",
    "ReproduceConfig": "headlab.reproduce.config",
    "load_config": "headlab.reproduce.config",
    "read_blocks": "headlab.reproduce.render",
    "render_blocks": "headlab.reproduce.render",
    "update_document": "headlab.reproduce.render",
    "load_results": "headlab.reproduce.report",
    "write_report": "headlab.reproduce.report",
    "ModelResults": "headlab.reproduce.results",
    "collect_results": "headlab.reproduce.results",
    "STAGES": "headlab.reproduce.stages",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
