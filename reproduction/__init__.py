"""Reproduce the findings of Voita et al. 2019 on open models and data (``python -m reproduction``).

The paper's reproduction, kept beside headlab in its repository (not in the package users
install): it uses headlab as a user would, through its command line and its functions.
A staged, resumable pipeline (:mod:`reproduction.stages`, run by
:func:`reproduction.pipeline.run_pipeline`) runs headlab's commands for every model of a
config file (``experiments/reproduce.json``); the small result files go to
``docs/results/reproduction/<model>/`` (:mod:`reproduction.results`); each claim of the
paper is computed from those files only (:mod:`reproduction.claims`) and written into
docs/reproduction.md between generated markers (:mod:`reproduction.render`).
:mod:`reproduction.status` renders where a run that is still training stands (docs/nmt.md).
"""

from importlib import import_module

_EXPORTS = {  # module -> the names it exports (imported on first use: numpy and torch load lazily)
    "reproduction.claims": ("Cell", "Check", "Claim", "compute_claims"),
    "reproduction.config": ("ModelEntry", "ReproduceConfig", "load_config"),
    "reproduction.render": ("read_blocks", "render_blocks", "update_document"),
    "reproduction.report": ("load_results", "write_report"),
    "reproduction.results": ("ModelResults", "collect_results"),
    "reproduction.stages": ("STAGES",),
    "reproduction.status": ("status_blocks",),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_WHERE[name]), name)


def __dir__():
    return sorted({*globals(), *__all__})
