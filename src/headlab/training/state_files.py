"""The resume point's optimizer and RNG states as safetensors, never a pickle.

Each is one ``.safetensors`` file: its tensors (optimizer moments, generator states), and in its
header's metadata (``__metadata__["headlab"]``, JSON) everything else, with each tensor's place
named. One file, so a rank's ``rng-<rank>.safetensors`` is replaced by one ``os.replace``.

- ``optimizer.safetensors``: ``Optimizer.state_dict()``, tensors named ``state.<param>.<key>`` (and
  ``param_groups.<group>.<key>`` for a tensor there); the JSON holds ``param_groups`` and the rest
  of ``state`` (a python-number ``step``), tuples marked as tuples, so ``load_state_dict`` gets back
  the same values of the same types. safetensors keeps each tensor's dtype and shape.
- ``rng-<rank>.safetensors``: torch's CPU generator (and on a GPU the GPU's), uint8 tensors;
  numpy's global ``get_state()`` and python ``random.getstate()`` as JSON lists.

Checkpoints written before this format (``optimizer.pt``, ``rng-<rank>.pt``: ``torch.save`` of
tensors and numbers) are still read, with ``torch.load(weights_only=True)``: see
:mod:`headlab.training.loop`.
"""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from headlab.errors import HeadlabError

__all__ = ["OPTIMIZER_FILE", "rng_file", "save_optimizer", "load_optimizer", "save_rng", "load_rng", "set_rng",
           "optimizer_record", "optimizer_state", "rng_record", "read_record"]

OPTIMIZER_FILE = "optimizer.safetensors"
FORMAT = "headlab-state-1"
_TENSOR, _TUPLE = "__tensor__", "__tuple__"  # the JSON's markers (a dict holding either key is refused)


def rng_file(rank: int) -> str:
    return f"rng-{rank}.safetensors"


# ----------------------------------------------------------------------------- writing


def _encode(value: Any, name: str, tensors: dict[str, torch.Tensor]) -> Any:
    """``value`` as JSON, its tensors moved to ``tensors`` under their path ``name``; a value JSON
    cannot give back with its type (a numpy scalar, a set, an object) is refused, not approximated."""
    kind = type(value)
    if isinstance(value, torch.Tensor):
        if name in tensors:
            raise HeadlabError(f"cannot save the optimizer state: two tensors would be named {name!r}")
        tensors[name] = value.detach()
        return {_TENSOR: name}
    if value is None or kind in (bool, int, float, str):  # exact types: json gives back these, not subclasses
        return value
    if kind is tuple:
        return {_TUPLE: [_encode(item, f"{name}.{i}", tensors) for i, item in enumerate(value)]}
    if kind is list:
        return [_encode(item, f"{name}.{i}", tensors) for i, item in enumerate(value)]
    if kind is dict and all(type(key) is str for key in value) and not {_TENSOR, _TUPLE} & value.keys():
        return {key: _encode(item, f"{name}.{key}", tensors) for key, item in value.items()}
    raise HeadlabError(f"cannot save the optimizer state without pickle: {name} is a {kind.__name__} "
                       "(tensors, numbers, strings, None, lists, tuples and dicts with string keys are saved)")


def optimizer_record(state_dict: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """``Optimizer.state_dict()`` as (tensors, JSON-able record); nothing is copied."""
    tensors: dict[str, torch.Tensor] = {}
    state = state_dict.get("state", {})
    if not all(type(index) is int for index in state):
        raise HeadlabError("cannot save the optimizer state without pickle: its state is not keyed by parameter index")
    record = {
        "format": FORMAT,
        "state": {str(index): _encode(entry, f"state.{index}", tensors) for index, entry in state.items()},
        "param_groups": _encode(state_dict.get("param_groups", []), "param_groups", tensors),
    }
    extra = set(state_dict) - {"state", "param_groups"}
    if extra:
        raise HeadlabError(f"cannot save the optimizer state without pickle: unknown entries {sorted(extra)}")
    return tensors, record


def _write(tensors: dict[str, torch.Tensor], record: dict, path: Path) -> None:
    """One safetensors file, the record in its header; a refused write (a full disk: safetensors'
    ``SafetensorError ... (os error 28)``) is the OSError it is, naming the file."""
    ready, storages = {}, set()
    for name, tensor in tensors.items():
        tensor = tensor.contiguous()
        if tensor.numel():  # safetensors refuses tensors sharing memory: such a view is written as a copy
            storage = (tensor.device, tensor.untyped_storage().data_ptr())
            if storage in storages:
                tensor = tensor.clone()
            storages.add(storage)
        ready[name] = tensor
    try:
        save_file(ready, str(path), metadata={"headlab": json.dumps(record)})
    except SafetensorError as error:
        code = re.search(r"\(os error (\d+)\)", str(error))
        if code:
            raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from error
        raise


def save_optimizer(state_dict: dict, path: Path) -> None:
    _write(*optimizer_record(state_dict), path)


def rng_record(device: torch.device) -> tuple[dict[str, torch.Tensor], dict]:
    """The generators a step may draw from: torch's CPU one (dropout, Hard Concrete noise) and on a
    GPU that device's; numpy's and python's global ones, for hooks that draw from them."""
    tensors = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        tensors["cuda"] = torch.cuda.get_rng_state(device)
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # the MT19937 tuple
    version, internal, gauss_next = random.getstate()
    record = {"format": FORMAT, "numpy": [name, [int(key) for key in keys], int(pos), int(has_gauss), float(cached)],
              "python": [version, list(internal), gauss_next]}
    return tensors, record


def save_rng(device: torch.device, path: Path) -> None:
    _write(*rng_record(device), path)


# ----------------------------------------------------------------------------- reading


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    if "headlab" not in metadata:
        raise HeadlabError(f"{path} has no headlab record in its header")
    record = json.loads(metadata["headlab"])
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise HeadlabError(f"{path} is not a {FORMAT} file")
    return tensors, record


def read_record(path: Path) -> dict:
    """The header's record alone (no tensor read): the cheap check of a resume point."""
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
    record = json.loads(metadata.get("headlab", "null"))
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise HeadlabError(f"{path} is not a {FORMAT} file")
    return record


def _decode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(item, tensors) for item in value]
    if isinstance(value, dict):
        if set(value) == {_TENSOR}:
            if value[_TENSOR] not in tensors:
                raise HeadlabError(f"the tensor {value[_TENSOR]} is missing")
            return tensors[value[_TENSOR]]
        if set(value) == {_TUPLE}:
            return tuple(_decode(item, tensors) for item in value[_TUPLE])
        return {key: _decode(item, tensors) for key, item in value.items()}
    return value


def optimizer_state(tensors: dict[str, torch.Tensor], record: dict) -> dict:
    """The ``state_dict`` that :func:`optimizer_record` was given."""
    return {"state": {int(index): _decode(entry, tensors) for index, entry in record["state"].items()},
            "param_groups": _decode(record["param_groups"], tensors)}


def load_optimizer(path: Path) -> dict:
    return optimizer_state(*_read(path))


def load_rng(path: Path) -> dict[str, Any]:
    """``{"torch": tensor, "cuda": tensor (a GPU run), "numpy": tuple, "python": tuple}``, each as its
    ``set_state`` takes it."""
    tensors, record = _read(path)
    if "torch" not in tensors:
        raise HeadlabError("no torch generator state")
    state: dict[str, Any] = dict(tensors)
    name, keys, pos, has_gauss, cached = record["numpy"]
    state["numpy"] = (name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached)
    version, internal, gauss_next = record["python"]
    state["python"] = (version, tuple(internal), gauss_next)
    return state


def set_rng(state: dict[str, Any], device: torch.device) -> None:
    """Set the generators of :func:`load_rng` (or of a legacy ``rng-<rank>.pt``: torch's only)."""
    torch.set_rng_state(state["torch"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
    if "numpy" in state:
        np.random.set_state(state["numpy"])
    if "python" in state:
        random.setstate(state["python"])
