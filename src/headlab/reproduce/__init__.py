"""Reproduce the findings of Voita et al. 2019 on open models and data (``headlab reproduce``).

A staged, resumable pipeline (:mod:`headlab.reproduce.stages`, run by
:func:`headlab.reproduce.pipeline.run_pipeline`) runs headlab's own commands for every model of a
config file (``experiments/reproduce.json``); the small result files go to
``docs/results/reproduction/<model>/`` (:mod:`headlab.reproduce.results`); each claim of the
paper is computed from those files only (:mod:`headlab.reproduce.claims`) and written into
docs/reproduction.md between generated markers (:mod:`headlab.reproduce.render`).
:mod:`headlab.reproduce.status` renders where a run that is still training stands (docs/nmt.md).
"""

from headlab._lazy import lazy_exports

_EXPORTS = {  # module -> the names it exports
    "headlab.reproduce.claims": ("Cell", "Check", "Claim", "compute_claims"),
    "headlab.reproduce.config": ("ModelEntry", "ReproduceConfig", "load_config"),
    "headlab.reproduce.render": ("read_blocks", "render_blocks", "update_document"),
    "headlab.reproduce.report": ("load_results", "write_report"),
    "headlab.reproduce.results": ("ModelResults", "collect_results"),
    "headlab.reproduce.stages": ("STAGES",),
    "headlab.reproduce.status": ("status_blocks",),
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
