"""Lazy package exports (PEP 562) and registries, so that ``import headlab`` and
``headlab --help`` do not import torch and transformers: a name is imported from its module on
first use."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping
from importlib import import_module
from typing import Any


def lazy_exports(package: str, exports: dict[str, tuple[str, ...]],
                 also: tuple[str, ...] = ()) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """``(__getattr__, __dir__, __all__)`` for ``package`` whose public names are
    ``exports[module]`` for each module (a full module path); ``also``: names it defines itself."""
    namespace = import_module(package).__dict__
    where = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str) -> Any:
        if name in where:
            value = getattr(import_module(where[name]), name)
            namespace[name] = value  # later look-ups skip this function
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(where))

    return __getattr__, __dir__, [*sorted(where), *also]


class LazyRegistry(Mapping):
    """``{name: object}`` whose keys are known at once and whose objects are imported on first
    access, from their full path ``"package.module.Name"`` (never evaluated as code)."""

    def __init__(self, paths: dict[str, str]) -> None:
        self._paths = dict(paths)
        self._loaded: dict[str, object] = {}

    def __getitem__(self, name: str) -> Any:
        if name not in self._loaded:
            module, _, attribute = self._paths[name].rpartition(".")
            self._loaded[name] = getattr(import_module(module), attribute)
        return self._loaded[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._paths)

    def __len__(self) -> int:
        return len(self._paths)


def callable_module(name: str, target: str) -> None:
    """Make the module ``name`` callable: ``headlab.importance(model, ...)`` calls ``target``
    (``"package.module.function"``, imported on the first call), while ``headlab.importance.X``
    stays the package's ``X``. The API's verbs are the names of the packages that do the work;
    a callable module lets both spellings hold whichever was imported first."""
    module = sys.modules[name]
    path, _, attribute = target.rpartition(".")

    class CallableModule(type(module)):  # type: ignore[misc]
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return getattr(import_module(path), attribute)(*args, **kwargs)

    CallableModule.__call__.__doc__ = f"Calls {target}."
    module.__class__ = CallableModule
