"""ConvBERT's convolutions made blind to the padding (transformers 5.24, models/convbert/modeling_convbert.py), so that
a sentence's results do not depend on the batch it ran in.

What transformers does: ``ConvBertSelfAttention`` runs two convolutions over the tokens beside its softmax heads, with
no padding mask. ``key_conv_attn_layer`` (``SeparableConv1D``: a depthwise ``Conv1d`` of ``conv_kernel_size`` with
``kernel_size // 2`` zeros on each side, a pointwise ``Conv1d`` of width 1 and a per-channel bias) reads the hidden
states transposed to ``[batch, d, seq]``; ``conv_out_layer`` (a ``Linear``, bias included) is unfolded over
``conv_kernel_size`` positions with ``(conv_kernel_size - 1) // 2`` zeros on each side. Everything else in the layer
is per position, or the softmax heads, which the mask keeps off the padding. So in a padded batch a row's tokens
within ``conv_kernel_size // 2`` of its padding read the padding's hidden states (and ``conv_out_layer``'s output
there, bias included) where the row alone reads the convolutions' zeros.

What headlab does: :func:`install_padding_mask` (called whenever headlab makes the model's blocks, so capture,
masking, gates, the importance measures and the statistics engines all run it) swaps three classes for subclasses of
the same names, no hook (as :func:`headlab.adapters.big_bird.install_guard`): ``ConvBertModel``'s forward records the
``[batch, seq]`` ``attention_mask`` it is given on the convolutions for the call, ``key_conv_attn_layer``'s zeroes
its input's padded columns, ``conv_out_layer``'s its output's padded rows (bias included, before the unfold). A row
then reads zeros beyond its ends, as alone: each row of a right-padded batch is the row alone (float64, to 1e-12).
headlab's ConvBERT on a padded batch is thus the per-sentence model, not transformers' padded computation (it
differs on the padding's neighbours only); on an unpadded batch nothing changes, bit for bit. Any padding is zeroed
(left, or gaps, too), but a left-padded row's absolute positions (``position_ids`` count from the batch's first
column) are not its own, as in any BERT: headlab's batchers pad on the right.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from headlab.errors import HeadlabError

MODEL_CLASS = "ConvBertModel"
ATTENTION_CLASS = "ConvBertSelfAttention"
_INSTALLED = "_headlab_padding_blind"
_KEEP = "_headlab_real_tokens"
"""Set, during a ``ConvBertModel`` call on a padded batch, on each convolution's module: ``[batch, seq]`` booleans,
True on the real tokens."""


def _mask_of(module: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor | None:
    mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    if mask is None:
        return None
    if mask.dim() != 2:
        raise HeadlabError(f"{type(module).__name__} given a {mask.dim()}-d attention_mask: headlab zeroes the padding "
                           "where ConvBERT's convolutions read it from a [batch, seq] mask only (1 on the tokens, 0 on "
                           "the padding)")
    keep = mask.to(torch.bool) if mask.dtype != torch.bool else mask
    return None if bool(keep.all()) else keep


def _convolutions(model: nn.Module) -> list[nn.Module]:
    return [part for core in model.modules() if type(core).__name__ == ATTENTION_CLASS
            for part in (core.get_submodule("key_conv_attn_layer"), core.get_submodule("conv_out_layer"))]


def _checkpointing(model: nn.Module) -> bool:
    flag = getattr(model, "is_activation_checkpointing", None)  # transformers 5.24's name
    if flag is None:
        flag = getattr(model, "is_gradient_checkpointing", False)
    return bool(flag) and model.training


def _recording(model: nn.Module, forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``forward`` (the model's own) with the call's real tokens set on its convolutions for the call."""
    keep = _mask_of(model, args, kwargs)
    parts = _convolutions(model)
    for part in parts:
        setattr(part, _KEEP, keep)
    try:
        return forward(*args, **kwargs)
    finally:
        if not _checkpointing(model):  # else the backward pass reruns the layers after this call: the next overwrites
            for part in parts:
                setattr(part, _KEEP, None)


def _real(part: nn.Module, length: int, where: str) -> torch.Tensor | None:
    keep = getattr(part, _KEEP, None)
    if keep is not None and keep.shape[-1] != length:
        raise HeadlabError(f"ConvBERT's {where} read {length} positions where its model's attention_mask has "
                           f"{keep.shape[-1]}: headlab cannot tell the padding it zeroes there")
    return keep


def _zero_padded_columns(part: nn.Module, states: torch.Tensor) -> torch.Tensor:
    """``key_conv_attn_layer``'s input ``[batch, d, seq]`` zero on the padded columns."""
    keep = _real(part, states.shape[-1], "key_conv_attn_layer")
    if keep is None:
        return states
    return torch.where(keep[:, None, :].to(states.device), states, torch.zeros((), dtype=states.dtype,
                                                                                device=states.device))


def _zero_padded_rows(part: nn.Module, output: torch.Tensor) -> torch.Tensor:
    """``conv_out_layer``'s output ``[batch, seq, all_head_size]`` (bias included) zero on the padded rows, before
    transformers unfolds it."""
    keep = _real(part, output.shape[-2], "conv_out_layer")
    if keep is None:
        return output
    return torch.where(keep[..., None].to(output.device), output, torch.zeros((), dtype=output.dtype,
                                                                              device=output.device))


def _model_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
    return _recording(self, self._headlab_plain_forward, args, kwargs)


def _columns_forward(self: Any, states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    return self._headlab_plain_forward(_zero_padded_columns(self, states), *args, **kwargs)


def _rows_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
    return _zero_padded_rows(self, self._headlab_plain_forward(*args, **kwargs))


def _instance_forward(module: nn.Module, role: str, forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward``, a module's own (an instance attribute: accelerate's hooks replace ``module.forward`` so, calling
    the class's forward bound before), doing what the role's class forward does around it."""
    @functools.wraps(forward)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if role == "model":
            return _recording(module, forward, args, kwargs)
        if role == "columns":
            return forward(_zero_padded_columns(module, args[0]), *args[1:], **kwargs)
        return _zero_padded_rows(module, forward(*args, **kwargs))

    setattr(wrapped, _INSTALLED, True)
    return wrapped


_FORWARDS = {"model": _model_forward, "columns": _columns_forward, "rows": _rows_forward}
_CLASSES: dict[tuple[type, str], type] = {}


def _swap(module: nn.Module, role: str) -> None:
    """``module``'s class made a subclass of the same name whose forward does the role's (as
    :func:`headlab.adapters.big_bird.install_guard`: no hook, so that headlab's hooks come off as they went on)."""
    cls = type(module)
    if not getattr(cls, _INSTALLED, False):
        if (cls, role) not in _CLASSES:
            _CLASSES[(cls, role)] = type(cls.__name__, (cls,), {
                "forward": _FORWARDS[role], "_headlab_plain_forward": getattr(cls, "forward"),  # noqa: B009
                _INSTALLED: True, "__module__": cls.__module__, "__qualname__": cls.__qualname__})
        module.__class__ = _CLASSES[(cls, role)]
    own = vars(module).get("forward")  # a forward set on the instance (accelerate's) would skip the class's
    if own is not None and not getattr(own, _INSTALLED, False):
        module.forward = _instance_forward(module, role, own)  # type: ignore[method-assign]


def install_padding_mask(model: nn.Module) -> None:
    """Make every ``ConvBertModel`` of ``model`` (once) keep its convolutions off the padding (see the module's
    docstring): its forward records the call's ``attention_mask`` on its convolutions, ``key_conv_attn_layer``'s
    zeroes its input's padded columns, ``conv_out_layer``'s its output's padded rows (each class becomes a subclass
    of the same name). On an unpadded batch (or none given) nothing changes."""
    for module in model.modules():
        if type(module).__name__ != MODEL_CLASS:
            continue
        for part in _convolutions(module):
            if not hasattr(part, _KEEP):
                setattr(part, _KEEP, None)
            _swap(part, "rows" if isinstance(part, nn.Linear) else "columns")
        _swap(module, "model")
