"""Reproduce the findings of Voita et al. 2019 on open models and data (``headlab reproduce``).

A staged, resumable pipeline (:mod:`headlab.reproduce.stages`) runs headlab's own commands for
every model of a config file (``experiments/reproduce.json``); the small result files go to
``docs/results/reproduction/<model>/`` (:mod:`headlab.reproduce.results`); each claim of the
paper is computed from those files only (:mod:`headlab.reproduce.claims`) and written into
docs/reproduction.md between generated markers (:mod:`headlab.reproduce.render`).
"""

from headlab.reproduce.claims import Cell, Check, Claim, compute_claims
from headlab.reproduce.config import ModelEntry, ReproduceConfig, load_config
from headlab.reproduce.render import read_blocks, render_blocks, update_document
from headlab.reproduce.report import load_results, write_report
from headlab.reproduce.results import ModelResults, collect_results
from headlab.reproduce.stages import STAGES, run_pipeline

__all__ = [
    "STAGES",
    "Cell",
    "Check",
    "Claim",
    "ModelEntry",
    "ModelResults",
    "ReproduceConfig",
    "collect_results",
    "compute_claims",
    "load_config",
    "load_results",
    "read_blocks",
    "render_blocks",
    "run_pipeline",
    "update_document",
    "write_report",
]
