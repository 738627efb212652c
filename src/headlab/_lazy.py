"""Lazy package exports (PEP 562), so that ``import headlab`` and ``headlab --help`` do not
import torch and transformers: a name is imported from its module on first use."""

from __future__ import annotations

from importlib import import_module


def lazy_exports(package: str, exports: dict[str, str]):
    """``(__getattr__, __dir__)`` for ``package`` whose public ``name`` lives in
    ``exports[name]`` (a full module path)."""
    namespace = import_module(package).__dict__

    def __getattr__(name: str):
        if name in exports:
            value = getattr(import_module(exports[name]), name)
            namespace[name] = value  # later look-ups skip this function
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__():
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
