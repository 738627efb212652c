"""The scripts of experiments/ (not a package: each is run as a file) loaded as modules for tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"


def load_experiment(name: str):
    """experiments/NAME.py as module ``name`` (in sys.modules, as the drivers' own imports find it)."""
    spec = importlib.util.spec_from_file_location(name, EXPERIMENTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
