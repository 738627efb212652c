"""The version of headlab: the one place it is written (pyproject.toml reads it from here), the range of
transformers it runs on and the oldest Python (pyproject.toml's dependency and requires-python say the same:
tests/test_requirements.py checks them)."""

import re
import sys

from headlab.errors import HeadlabError, UnsupportedVersion

__version__ = "0.1.0"

TRANSFORMERS_FLOOR = (5, 24, 0)
"""The oldest transformers that headlab's tests pass on (docs/benchmarks.md, "Which transformers and torch headlab runs
on"). Its adapters are written against 5.24's modeling code, in which 521 attention modules take their cache as
``cache=`` (``past_key_values=`` before): on 5.22 and 5.23 a pruned TrOCR's attention gets no cache and its check
refuses the pruning; on 5.18 the adapters crash on an EncoderDecoderModel; on 5.12 T5 cannot run SDPA."""

TRANSFORMERS_CEILING = (6,)
"""The first transformers headlab does not run on: a major release may rewrite any modeling code."""

PYTHON_FLOOR = (3, 11)
"""The oldest Python headlab runs on: transformers declares ``Requires-Python >=3.11.0`` from 5.21 on, so pip finds no
transformers >= 5.24 (TRANSFORMERS_FLOOR) for Python 3.10, and 5.24 forced onto 3.10 raises ImportError when imported
(docs/benchmarks.md, "Which transformers and torch headlab runs on", "Python versions")."""


TRITON_FLOOR = (3, 4, 0)
"""The oldest triton ``--engine kernel`` runs on (pyproject's kernel extra says the same): the kernel is run on 3.6 (the
GPU image) and 3.9 (its interpreter here); 3.2, which torch 2.6's CUDA wheels ship, has no ``triton.knobs``, where
headlab reads whether the interpreter is on, and was never run."""

KERNEL_NEEDS_TRITON = "--engine kernel needs triton (pip install triton; PyTorch's CUDA wheels ship it)"


def _release(version: str) -> tuple[int, ...]:
    """``"5.22.2"`` -> ``(5, 22, 2)``, ``"5.24"`` -> ``(5, 24, 0)`` (PEP 440: the same release); a pre-release or local
    tail (``5.23.0.dev0``, ``5.24.0+cu``) is dropped."""
    numbers = tuple(int(part) for part in re.findall(r"\d+", re.split(r"[^\d.]", version, maxsplit=1)[0]))
    return numbers + (0,) * (3 - len(numbers))


def _spelled(release: tuple[int, ...]) -> str:
    return ".".join(map(str, release))


def python_problem(version_info: tuple) -> str | None:
    """Why headlab cannot run on the Python whose ``sys.version_info`` is ``version_info``, or None."""
    if tuple(version_info[:2]) >= PYTHON_FLOOR:
        return None
    return (f"headlab {__version__} needs Python >= {_spelled(PYTHON_FLOOR)}, and this is Python "
            f"{_spelled(tuple(version_info[:3]))}: transformers >= {_spelled(TRANSFORMERS_FLOOR)}, through which headlab "
            f"reads every model, runs on Python {_spelled(PYTHON_FLOOR)} and later only. Run headlab under Python "
            f"{_spelled(PYTHON_FLOOR)} or later.")


def require_python() -> None:
    """Raise :class:`~headlab.errors.UnsupportedVersion` (an ImportError) on a Python older than :data:`PYTHON_FLOOR`.

    Called by ``import headlab``, so every command and the API refuse before any work; pip's own check
    (requires-python) is skipped by a source checkout on PYTHONPATH and by ``pip install --ignore-requires-python``,
    and there transformers' ImportError came out of the command line as "internal error ... a bug in headlab"."""
    problem = python_problem(sys.version_info)
    if problem:
        raise UnsupportedVersion(problem)


def transformers_problem(installed: str) -> str | None:
    """Why headlab cannot run on transformers ``installed`` (its ``__version__``), or None when it is in range (a
    pre-release of the floor itself, ``5.24.0.dev0``, is not: it may predate what the floor's release changed)."""
    release = _release(installed)
    floor_before_release = release == TRANSFORMERS_FLOOR and re.search(r"\d(a|b|rc|\.?dev)", installed.split("+")[0])
    if TRANSFORMERS_FLOOR <= release < TRANSFORMERS_CEILING and not floor_before_release:
        return None
    wanted = f"transformers>={_spelled(TRANSFORMERS_FLOOR)},<{_spelled(TRANSFORMERS_CEILING)}"
    return (f"headlab {__version__} needs transformers >= {_spelled(TRANSFORMERS_FLOOR)}, < "
            f"{_spelled(TRANSFORMERS_CEILING)}, and this Python imports transformers {installed}: on another release "
            "a family's modeling code may differ from what headlab's adapters read, and its results would be wrong "
            f"without an error. Install one in range: pip install \"{wanted}\"")


def triton_problem(installed: str | None) -> str | None:
    """Why ``--engine kernel`` cannot run on triton ``installed`` (its version; None: not installed), or None."""
    if installed is None:
        return KERNEL_NEEDS_TRITON
    if _release(installed) >= TRITON_FLOOR:
        return None
    return (f"--engine kernel needs triton >= {_spelled(TRITON_FLOOR)}, and this Python imports triton {installed}, "
            f"on which the kernel was never run: pip install \"triton>={_spelled(TRITON_FLOOR)}\" (headlab's kernel "
            "extra), or use the default fused engine")


def installed_triton() -> str | None:
    """The version of the triton this Python would import, read from its metadata without importing it (the options'
    check runs before the model loads); None when there is none. A triton found without metadata (a source tree on
    the path) passes as the floor: importing it says the rest."""
    import importlib.metadata
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return None
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return _spelled(TRITON_FLOOR)


def require_kernel_triton() -> None:
    """Refuse ``--engine kernel`` (a HeadlabError naming the triton found) before the model loads: the options of
    ``functions``/``aggregate`` and of confidence check it so."""
    problem = triton_problem(installed_triton())  # found, not imported
    if problem:
        raise HeadlabError(problem)


def require_transformers() -> None:
    """Raise :class:`~headlab.errors.UnsupportedVersion` (an ImportError) naming both versions when the transformers
    that Python imports is out of range.

    Called where headlab first reads a model (:mod:`headlab.adapters`), not by ``import headlab``, which stays light.
    pip checks the range at install, but not under ``pip install --no-deps``, with a source checkout on PYTHONPATH or
    with a transformers installed after headlab."""
    import transformers

    problem = transformers_problem(str(transformers.__version__))
    if problem:
        raise UnsupportedVersion(problem)
