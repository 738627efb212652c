"""The transformers range headlab declares is the one it runs on, and it is checked where pip does not (session 43).

pyproject.toml said ``transformers>=5,<6`` while everything was tested on 5.24: on 5.22 and 5.23 a pruned TrOCR gets
no cache in generation (5.24 renamed the argument) and its check refuses the pruning; on 5.18 the adapters crash on an
EncoderDecoderModel; on 5.12 T5 cannot be built for SDPA and a pruned Switch Transformers fails in its forward
(docs/benchmarks.md, "Which transformers and torch headlab runs on"). The floor is now the oldest release the tests pass
on, and :mod:`headlab.adapters` (where headlab first reads a model) refuses a transformers out of range, naming both
versions: pip's own check is skipped by ``pip install --no-deps``, a source checkout on PYTHONPATH or a transformers
upgraded or downgraded after headlab. ``import headlab`` stays light (tests/test_layers.py).

The same for Python (session 44): pyproject.toml said ``requires-python = ">=3.10"``, but transformers declares
``Requires-Python >=3.11.0`` from 5.21 on, so on 3.10 pip finds no transformers in range, and 5.24 forced onto 3.10
raises ImportError when imported, which the command line reported as a bug in headlab. The floor is now 3.11, and
``import headlab`` refuses an older Python naming both versions."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from importlib.metadata import metadata
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from headlab import HeadlabError
from headlab._version import (
    PYTHON_FLOOR,
    TRANSFORMERS_CEILING,
    TRANSFORMERS_FLOOR,
    TRITON_FLOOR,
    python_problem,
    transformers_problem,
    triton_problem,
)
from headlab.errors import UnsupportedVersion

ROOT = Path(__file__).resolve().parents[1]
FLOOR = ".".join(map(str, TRANSFORMERS_FLOOR))
PYTHON = ".".join(map(str, PYTHON_FLOOR))


@pytest.mark.parametrize("version", [FLOOR, "5.24", "5.24.1", "5.30.1", "5.99.0.dev0", "5.24.0+local"])
def test_a_transformers_in_range_is_accepted(version):
    assert transformers_problem(version) is None


@pytest.mark.parametrize("version", ["5.0.0", "5.12.1", "5.18.0", "5.22.2", "5.23.0", "5.23.9.dev0", f"{FLOOR}.dev0",
                                     f"{FLOOR}rc1", "4.57.6", "6.0.0", "6.0.0.dev0"])
def test_a_transformers_out_of_range_is_refused_naming_both_versions(version):
    problem = transformers_problem(version)
    assert problem is not None
    assert f"transformers {version}" in problem and f">= {FLOOR}, < 6" in problem
    assert f'pip install "transformers>={FLOOR},<6"' in problem


def test_pyproject_declares_the_range_headlab_checks():
    """pip's range (pyproject.toml) and the run-time check (headlab._version) say the same."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    declared = re.findall(r'^\s*"transformers([^"]*)",', text, re.M)
    assert declared == [f">={FLOOR},<{'.'.join(map(str, TRANSFORMERS_CEILING))}"]


def test_pyproject_requires_the_python_transformers_needs():
    """requires-python is headlab's floor, at least the one the installed transformers declares (5.24.0's is 3.11.0:
    ">=3.10" failed here), and mypy checks against the same Python."""
    with open(ROOT / "pyproject.toml", "rb") as file:
        pyproject = tomllib.load(file)
    assert pyproject["project"]["requires-python"] == f">={PYTHON}"
    assert pyproject["tool"]["mypy"]["python_version"] == PYTHON
    assert SpecifierSet(metadata("transformers")["Requires-Python"]).contains(f"{PYTHON}.0")


@pytest.mark.parametrize("version_info", [(3, 11, 0, "final", 0), (3, 12, 1), (3, 13, 0, "final", 0), (4, 0, 0)])
def test_a_python_from_the_floor_on_is_accepted(version_info):
    assert python_problem(version_info) is None


@pytest.mark.parametrize("version_info", [(3, 10, 13, "final", 0), (3, 9, 18), (2, 7, 18)])
def test_an_older_python_is_refused_naming_both_versions(version_info):
    problem = python_problem(version_info)
    assert problem is not None
    assert f"needs Python >= {PYTHON}" in problem and f"this is Python {'.'.join(map(str, version_info[:3]))}" in problem


def test_import_headlab_under_python_3_10_is_refused_before_any_work():
    """``import headlab`` raises UnsupportedVersion (an ImportError and a HeadlabError) with both versions, before
    transformers, torch or any module of headlab beyond three light ones is imported."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    code = ("import sys\n"
            "sys.version_info = (3, 10, 13, 'final', 0)\n"
            "try:\n"
            "    import headlab\n"
            "except ImportError as error:\n"
            "    loaded = sorted(m for m in sys.modules if m.startswith(('headlab', 'transformers', 'torch')))\n"
            "    print(type(error).__name__, 'HeadlabError' in [c.__name__ for c in type(error).__mro__], loaded)\n"
            "    print(error)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    first, message = out.stdout.splitlines()[:2]
    assert first == "UnsupportedVersion True ['headlab._lazy', 'headlab._version', 'headlab.errors']"
    assert f"needs Python >= {PYTHON}" in message and "this is Python 3.10.13" in message


def _run(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh Python whose transformers says it is 5.18.0 (its modules are the installed ones)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    prelude = "import transformers\ntransformers.__version__ = '5.18.0'\n"
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, env=env, timeout=300)


def test_reading_a_model_under_an_old_transformers_is_refused_before_any_work():
    """``import headlab`` works (it reads no model); the first import that reads one raises UnsupportedVersion, an
    ImportError and a HeadlabError, with both versions; nothing of headlab's adapters is left half imported."""
    out = _run("import sys, headlab\n"
               "try:\n"
               "    from headlab import attention_blocks\n"
               "except ImportError as error:\n"
               "    from headlab.errors import HeadlabError\n"
               "    print(type(error).__name__, isinstance(error, HeadlabError), 'headlab.adapters' in sys.modules)\n"
               "    print(error)\n")
    assert out.returncode == 0, out.stderr
    first, message = out.stdout.splitlines()[:2]
    assert first == "UnsupportedVersion True False"
    assert "transformers 5.18.0" in message and f">= {FLOOR}" in message


def test_the_command_line_under_an_old_transformers_says_so_and_exits_2(tmp_path):
    out = _run(f"from headlab.cli import main\nraise SystemExit(main(['heads', {str(tmp_path)!r}]))")
    assert out.returncode == 2, out.stderr
    assert "headlab heads: error: headlab" in out.stderr and "transformers 5.18.0" in out.stderr
    assert "internal error" not in out.stderr and "Traceback" not in out.stderr


def test_unsupported_version_is_both_errors():
    assert issubclass(UnsupportedVersion, ImportError) and issubclass(UnsupportedVersion, HeadlabError)
    assert UnsupportedVersion.exit_code == 2


def test_pyproject_declares_the_triton_floor_headlab_checks():
    """The kernel extra (and the test extra, whose kernel tests run in triton's interpreter) ask for the triton the
    run-time check accepts."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    declared = re.findall(r'"triton([^";]*);', text)
    assert declared and set(declared) == {f">={'.'.join(map(str, TRITON_FLOOR[:2]))}"}


@pytest.mark.parametrize("version", ["3.4.0", "3.6.0", "3.9.0", "3.5.0+git1234"])
def test_a_triton_from_the_floor_on_runs_the_kernel(version):
    assert triton_problem(version) is None


@pytest.mark.parametrize("version", ["3.2.0", "3.3.1", "2.1.0"])
def test_an_older_triton_is_refused_naming_its_version(version):
    assert f"needs triton >= 3.4.0, and this Python imports triton {version}" in triton_problem(version)
    assert "needs triton (pip install triton" in triton_problem(None)


def test_the_kernel_is_refused_under_an_old_triton_not_crashed(monkeypatch):
    """torch 2.6's CUDA wheels ship triton 3.2, which has no ``triton.knobs``: ``interpreted()`` raised AttributeError
    from --engine kernel's check and from every kernel call in bfloat16 (session 44, run on triton 3.2.0)."""
    import importlib.machinery
    import importlib.metadata
    import types

    import torch

    from headlab.data import attention_kernel
    from headlab.functions.analysis import check_kernel
    from headlab.functions.config import AnalysisConfig

    old = types.ModuleType("triton")
    old.__version__ = "3.2.0"  # and no knobs
    old.__spec__ = importlib.machinery.ModuleSpec("triton", None)
    monkeypatch.setitem(sys.modules, "triton", old)
    assert attention_kernel.interpreted() is False
    q = torch.zeros(1, 2, 4, 8, dtype=torch.bfloat16)
    assert "this Python imports triton 3.2.0" in attention_kernel.refusal(q, q, q)
    with pytest.raises(HeadlabError, match="needs triton >= 3.4.0, and this Python imports triton 3.2.0"):
        check_kernel(torch.device("cuda"))
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "3.2.0" if name == "triton" else "0")
    with pytest.raises(HeadlabError, match="imports triton 3.2.0"):  # before the model loads
        AnalysisConfig(engine="kernel")
