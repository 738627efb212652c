"""How a model's weights are stored, where that is not as the numbers its modules compute with, in the module.

* **Quantized.** transformers' quantizers replace a checkpoint's linear layers by their own (FP8's ``FP8Linear``:
  float8 weights with block scales, ``weight_scale_inv``; bitsandbytes' 4-bit and 8-bit layers: packed or int8
  weights with their scales; GPTQ's and AWQ's packed int32 ``qweight``; HQQ; compressed-tensors; torchao's and
  quanto's tensor subclasses), whose forward dequantizes (or computes in its own kernel) on every call.
* **Offloaded.** accelerate's offloading (a ``device_map`` that puts modules on the CPU or disk beside a GPU,
  ``cpu_offload``) leaves a module's parameters on the meta device and an ``AlignDevicesHook`` loads them from its
  weights map for each forward.

headlab runs such a model as it is for capture, masking, gates, gradients and ablation. Two things work on the
module's own tensors, and are refused on them before any work, naming the modules:

* LRP widens every floating parameter to float32 or float64 in place (``importance.lrp._widened``): a float8 weight
  becomes its stored values without their scales, and ``FP8Linear`` then computes ``F.linear`` with them, a different
  model whose relevance would still be conserved (it is the widened model's own); integer weights do not widen; an
  offloaded weight is on the meta device, and the hook loads the unwidened copy.
* Physical pruning slices a projection's rows and columns (``surgery``): packed rows and block scales are not one
  head's weights, and an offloaded module's weights map would stay whole.

The quantized rule is read off the tensors, not a list of classes: a module whose own parameter is not a float16,
bfloat16, float32 or float64 tensor (float8, int8, uint8, int32: packed or quantized values), whose own buffer holds
8-bit or packed int32 values, or whose parameter is a tensor subclass (torchao, quanto; also a tensor-parallel
``DTensor``, whose local shard is not the whole weight either).
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import torch
from torch import nn

PLAIN_FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
"""The dtypes of weights stored as the numbers they compute with."""

_PACKED_BUFFER_DTYPES = frozenset({torch.int8, torch.uint8, torch.int32})
"""Buffers of these dtypes hold quantized or packed weights (GPTQ's and AWQ's ``qweight``/``qzeros`` and ``g_idx``,
bitsandbytes' int8 state); an int64 buffer is an index (``position_ids``) and a bool one a mask, both left alone."""

HINT = ("load the checkpoint unquantized, or dequantized (transformers: model.dequantize(), or a quantization config "
        "with dequantize=True where the method has one, such as FineGrainedFP8Config), and on devices that hold it "
        "whole (a device_map without offloading)")
"""What to do instead, in every refusal."""


def stored_quantized(module: nn.Module) -> str | None:
    """How ``module``'s own weights (not its children's) are stored quantized, as ``"weight float8_e4m3fn"`` or
    ``"weight Params4bit"``, or None where they are plain floating-point numbers."""
    found = []
    for name, tensor in chain(module.named_parameters(recurse=False), module.named_buffers(recurse=False)):
        if tensor is None:
            continue
        parameter = isinstance(tensor, nn.Parameter)
        data = tensor.data if parameter else tensor
        if type(data) is not torch.Tensor and not data.is_meta:  # a tensor subclass holds the values its own way
            found.append(f"{name} {type(data).__name__}")
        elif parameter and tensor.dtype not in PLAIN_FLOATS:
            found.append(f"{name} {str(tensor.dtype).removeprefix('torch.')}")
        elif not parameter and (tensor.dtype in _PACKED_BUFFER_DTYPES or
                                (tensor.is_floating_point() and tensor.dtype not in PLAIN_FLOATS)):
            found.append(f"{name} {str(tensor.dtype).removeprefix('torch.')}")
    return ", ".join(found) or None


def _offloads(hook: Any) -> bool:
    """Whether an accelerate hook (or a ``SequentialHook`` of them) loads its module's weights at each forward."""
    return any(_offloads(h) for h in hook.hooks) if hasattr(hook, "hooks") else bool(getattr(hook, "offload", False))


def stored_offloaded(module: nn.Module) -> str | None:
    """``"offloaded (accelerate)"`` where ``module``'s own parameters are on the meta device and an accelerate hook
    loads them for each forward, else None (a model built on the meta device, with no hook, holds no weights yet:
    :func:`headlab.loading.check_supported` reads its structure so)."""
    hook = getattr(module, "_hf_hook", None)
    if hook is None or not _offloads(hook):
        return None
    meta = [name for name, p in module.named_parameters(recurse=False) if p.is_meta]
    return f"{', '.join(meta)} offloaded (accelerate)" if meta else None


def stored_elsewhere(module: nn.Module) -> str | None:
    """:func:`stored_quantized` or :func:`stored_offloaded`, joined; None where neither."""
    return "; ".join(found for found in (stored_quantized(module), stored_offloaded(module)) if found) or None


def stored_elsewhere_modules(model: nn.Module, prefix: str = "") -> list[tuple[str, str, str]]:
    """``(path, class name, how)`` of every module of ``model`` (``model`` itself included) whose own weights are
    stored quantized or offloaded (:func:`stored_elsewhere`), in module order; paths below ``prefix`` (``model``'s
    own path)."""
    return [(name, type(module).__name__, found) for name, module in model.named_modules(prefix=prefix)
            if (found := stored_elsewhere(module)) is not None]


def describe(found: list[tuple[str, str, str]], most: int = 3) -> str:
    """The first ``most`` modules of :func:`stored_elsewhere_modules`'s list, and how many more."""
    named = "; ".join(f"{path or 'the model'} ({cls}: {how})" for path, cls, how in found[:most])
    return named + (f"; and {len(found) - most} more" if len(found) > most else "")
