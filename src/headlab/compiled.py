"""A model compiled with ``torch.compile``: headlab runs it eagerly, and compiled code never ignores headlab's hooks.

Dynamo does not guard on a module's hooks (``torch._dynamo.config.skip_nnmodule_hook_guards``, True by default):
code it compiled before headlab registered a hook (a mask, a gate, a capture) runs without it, and code compiled while
a hook was on keeps its effect after the hook comes off, silently. So every headlab context that changes how a module
computes (hooks, an attention function switched) discards the process's compiled code on entering and on leaving
(:func:`recompiled`, ``torch._dynamo.reset()``): a compiled wrapper of the same modules compiles again with headlab's
change in it, and again without it afterwards. headlab's own runs (the measures, statistics and pruning checks) run
eagerly (:func:`running_eagerly`): nothing is compiled for them, so their own hooks, added and removed many times, are
always seen. An ``OptimizedModule`` handed to headlab is replaced by the model it wraps (:func:`uncompiled`): the
wrapper's ``_orig_mod``, whose modules the wrapper runs, so a mask or a pruning reaches both.

Every check is O(1): whether dynamo holds compiled code is one set's emptiness (:func:`compiled_code_exists`), so a
process that never compiles never resets anything (transformers' modelling code imports dynamo, ``import torch``
does not). A reset discards every compiled function of the process, not only the model's: the price of exactness,
paid only where something was compiled since the last reset, and said once (logger ``headlab.compiled``).
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, TypeVar, cast

LOGGER = logging.getLogger("headlab.compiled")
_Function = TypeVar("_Function", bound=Callable[..., Any])
_Context = TypeVar("_Context", bound=Callable[..., AbstractContextManager[Any]])
_warned = False  # the first discard is a WARNING (what and why), later ones are INFO


def _dynamo() -> Any:
    """``torch._dynamo`` where something imported it (``torch.compile`` does), else None: nothing was compiled."""
    return sys.modules.get("torch._dynamo")


def compiled_code_exists() -> bool:
    """Whether dynamo has seen a frame to compile since the process started or since its last reset: the code
    objects it tracks (``convert_frame.input_codes``), which ``torch._dynamo.reset()`` clears. Where that private
    tracker is missing (another torch), True whenever dynamo is imported: a reset too many costs a recompilation, a
    reset too few a silent wrong result."""
    dynamo = _dynamo()
    if dynamo is None:
        return False
    convert_frame = sys.modules.get("torch._dynamo.convert_frame")
    seen = getattr(getattr(convert_frame, "input_codes", None), "seen_ids", None)
    return True if seen is None else bool(seen)


def discard_compiled_code(why: str) -> None:
    """``torch._dynamo.reset()`` where dynamo holds compiled code: it was compiled with or without hooks that
    headlab has just changed (``why``: what headlab does), which dynamo does not guard on."""
    global _warned
    if not compiled_code_exists():
        return
    _dynamo().reset()
    level = logging.INFO if _warned else logging.WARNING
    _warned = True
    LOGGER.log(level, "headlab discarded the code torch.compile compiled in this process (torch._dynamo.reset()): "
                      "it %s, and compiled code does not see hooks added or removed after it was compiled "
                      "(torch._dynamo.config.skip_nnmodule_hook_guards); compiled models compile again on their "
                      "next call", why)


@contextmanager
def recompiled(why: str) -> Iterator[None]:
    """:func:`discard_compiled_code` on entering and on leaving: a compiled wrapper run inside the block compiles
    with headlab's change in it, and one run after it without it."""
    discard_compiled_code(why)
    try:
        yield
    finally:
        discard_compiled_code(why)


def recompiling(why: str) -> Callable[[_Context], _Context]:
    """Decorator of a function that returns a context manager (``@contextmanager``): its block is :func:`recompiled`
    around it, the compiled code discarded before it changes the model and after it restores it."""
    def wrap(context: _Context) -> _Context:
        @functools.wraps(context)
        @contextmanager
        def wrapped(*args: Any, **kwargs: Any) -> Iterator[Any]:
            with recompiled(why), context(*args, **kwargs) as value:
                yield value
        return cast(_Context, wrapped)
    return wrap


@contextmanager
def running_eagerly() -> Iterator[None]:
    """headlab's own forward passes run eagerly inside, also those of a model compiled in place
    (``model.compile()``) or of compiled sub-modules: ``torch.compiler.set_stance("force_eager")``. A measurement
    adds and removes hooks many times (ablation: one mask per head), which compiled code would not see."""
    if _dynamo() is None:
        yield
        return
    import torch

    with torch.compiler.set_stance("force_eager"):
        yield


def uncompiled(model: Any) -> Any:
    """The model an ``OptimizedModule`` (``torch.compile(model)``) wraps, else ``model`` itself."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(eval_frame, "OptimizedModule", None)
    while optimized is not None and isinstance(model, optimized):
        model = model._orig_mod
    return model


def model_entry(function: _Function) -> _Function:
    """Decorator of a public function with a ``model`` argument: torch.compile's wrapper there becomes the model it
    wraps (:func:`uncompiled`: block names without ``_orig_mod.``, gates and masks on the modules the wrapper runs),
    and the call runs eagerly (:func:`running_eagerly`). :func:`headlab.options.checked_keywords` applies it."""
    parameters = inspect.signature(function).parameters
    if "model" not in parameters:
        return function
    positional = parameters["model"].kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    at = list(parameters).index("model") if positional else sys.maxsize

    @functools.wraps(function)
    def entry(*args: Any, **keywords: Any) -> Any:
        if at < len(args):
            args = (*args[:at], uncompiled(args[at]), *args[at + 1:])
        elif "model" in keywords:
            keywords["model"] = uncompiled(keywords["model"])
        with running_eagerly():
            return function(*args, **keywords)
    return cast(_Function, entry)
