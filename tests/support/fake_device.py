"""A stand-in for a GPU on the CPU, to test where tensors are made without one (no tests in here).

:data:`DEVICE` is a ``torch.device("cpu")`` object that stands for "the device": a tensor moved
there (``.to(DEVICE)``) or made with ``device=DEVICE`` is an :class:`OnDevice` tensor, whose
``.device`` is :data:`DEVICE` again, and whatever an operation makes from one is one too, until
``.cpu()``, ``.numpy()``, ``.tolist()`` or ``.item()`` bring it back. Inside :class:`FakeDevice`,
an operation that mixes an ``OnDevice`` tensor with a plain CPU tensor of one dimension or more
(which on a GPU fails, or copies the CPU tensor there) is recorded in ``mixed``, with where it
happened. The arithmetic is the CPU's own, so the results are the CPU's to the bit.
"""

from __future__ import annotations

import traceback

import torch
from torch.overrides import TorchFunctionMode

DEVICE = torch.device("cpu")
"""The stand-in device: known by its identity (``is``), equal to any CPU device."""

_TO_HOST = {torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.tolist, torch.Tensor.item}
_MAY_MIX = {torch.Tensor.to, torch.Tensor.copy_}  # moving or copying between devices is allowed


class OnDevice(torch.Tensor):
    """A CPU tensor that stands for one on :data:`DEVICE`."""


def _leaves(value):
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _leaves(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)
    else:
        yield value


def _map(function, value):
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)([_map(function, item) for item in value])
    if isinstance(value, dict):
        return {key: _map(function, item) for key, item in value.items()}
    return function(value)


def _plain(value):
    return value.as_subclass(torch.Tensor) if isinstance(value, OnDevice) else value


def _on_device(value):
    return value.as_subclass(OnDevice) if type(value) is torch.Tensor else value


class FakeDevice(TorchFunctionMode):
    """Within the block, tensors on :data:`DEVICE` are tracked (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.mixed: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = list(_leaves((args, kwargs)))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        on_device = any(isinstance(x, OnDevice) for x in tensors)
        if on_device and getattr(getattr(func, "__self__", None), "__name__", "") == "device":
            return DEVICE  # the `.device` of an OnDevice tensor
        host = [tuple(x.shape) for x in tensors if not isinstance(x, OnDevice) and x.dim() > 0]
        if on_device and host and func not in _MAY_MIX:
            where = "".join(traceback.format_stack(limit=4)[:-1])
            self.mixed.append(f"{getattr(func, '__name__', func)} with CPU tensors {host}:\n{where}")
        out = func(*_map(_plain, args), **_map(_plain, kwargs))
        if func in _TO_HOST:
            return out
        named = any(x is DEVICE for x in leaves)
        if func is torch.Tensor.to and not named:
            moved = any(isinstance(x, (torch.device, str)) for x in leaves)  # .to("cpu"): back on the host
            return _map(_on_device, out) if on_device and not moved else out
        return _map(_on_device, out) if on_device or named else out
