"""Lazy package exports (PEP 562) and registries, so that ``import headlab`` and
``headlab --help`` do not import torch and transformers: a name is imported from its module on
first use."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from contextlib import contextmanager
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


class LazyRegistry(MutableMapping[str, Any]):
    """``{name: object}`` whose keys are known at once and whose objects are imported on first
    access, from their full path ``"package.module.Name"`` (never evaluated as code). An entry may
    also be the object itself; :meth:`registered` adds one for the length of a ``with`` block (a
    test's plug-in, :mod:`headlab.plugins`)."""

    def __init__(self, paths: Mapping[str, object]) -> None:
        self._paths: dict[str, object] = dict(paths)
        self._loaded: dict[str, object] = {}

    def __getitem__(self, name: str) -> Any:
        if name not in self._loaded:
            entry = self._paths[name]
            if isinstance(entry, str):
                module, _, attribute = entry.rpartition(".")
                entry = getattr(import_module(module), attribute)
            self._loaded[name] = entry
        return self._loaded[name]

    def __setitem__(self, name: str, entry: object) -> None:
        self._paths[name] = entry
        self._loaded.pop(name, None)

    def __delitem__(self, name: str) -> None:
        del self._paths[name]
        self._loaded.pop(name, None)

    def __iter__(self) -> Iterator[str]:
        return iter(self._paths)

    def __len__(self) -> int:
        return len(self._paths)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self._paths)})"

    @contextmanager
    def registered(self, name: str, entry: object) -> Iterator[object]:
        """``self[name] = entry`` inside the block (the last entry), removed after it, also after an error."""
        if name in self._paths:
            raise KeyError(f"{name!r} is registered already")
        self[name] = entry
        try:
            yield entry
        finally:
            del self[name]


class LiveNames(Sequence[str]):
    """A tuple of names made from a registry at each use: an entry registered after the module that
    holds it was imported (a test's plug-in) is among them too."""

    def __init__(self, make: Callable[[], tuple[str, ...]]) -> None:
        self._make = make

    def __getitem__(self, index: Any) -> Any:  # an int gives a name, a slice a tuple of them
        return self._make()[index]

    def __len__(self) -> int:
        return len(self._make())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, (tuple, list, LiveNames)) and tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash(self._make())

    def __repr__(self) -> str:
        return repr(self._make())


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

        @property  # inspect.signature(headlab.importance): the target's, not (*args, **kwargs)
        def __signature__(self) -> inspect.Signature:
            return inspect.signature(getattr(import_module(path), attribute))

    CallableModule.__call__.__doc__ = f"Calls {target}."
    module.__class__ = CallableModule
