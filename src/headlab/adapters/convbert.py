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

What headlab does: :func:`install_padding_mask` records the ``attention_mask`` each ``ConvBertModel`` call is given,
and zeroes the padded positions where the convolutions read them: the padded columns of ``key_conv_attn_layer``'s
input, and the padded rows of ``conv_out_layer``'s output. A row then reads zeros beyond its ends, as alone: each row
of a padded batch is the row alone (float64, to rounding), whatever pads it. headlab's ConvBERT on a padded batch is
thus the per-sentence model, not transformers' padded computation (which the hooks change on the padding's
neighbours only). A padded batch's positions are still absolute (``position_ids`` count from the batch's first
column): headlab's batchers pad on the right, where a row's positions are its own.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from headlab.errors import HeadlabError

MODEL_CLASS = "ConvBertModel"
ATTENTION_CLASS = "ConvBertSelfAttention"
_INSTALLED = "_headlab_padding_mask"
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
            for part in (core.key_conv_attn_layer, core.conv_out_layer)]


def _record(module: nn.Module, args: tuple, kwargs: dict) -> None:
    keep = _mask_of(module, args, kwargs)
    for part in _convolutions(module):
        setattr(part, _KEEP, keep)


def _forget(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    checkpointing = getattr(module, "is_activation_checkpointing", None)  # transformers 5.24's name
    if checkpointing is None:
        checkpointing = getattr(module, "is_gradient_checkpointing", False)
    if checkpointing and module.training:
        return  # the backward pass reruns the layers, after this call: the next call overwrites it
    for part in _convolutions(module):
        setattr(part, _KEEP, None)


def _real(part: nn.Module, length: int, where: str) -> torch.Tensor | None:
    keep = getattr(part, _KEEP, None)
    if keep is not None and keep.shape[-1] != length:
        raise HeadlabError(f"ConvBERT's {where} read {length} positions where its model's attention_mask has "
                           f"{keep.shape[-1]}: headlab cannot tell the padding it zeroes there")
    return keep


def _zero_padded_columns(part: nn.Module, args: tuple) -> tuple | None:
    """Before ``key_conv_attn_layer``: its input ``[batch, d, seq]`` zero on the padded columns."""
    states = args[0]
    keep = _real(part, states.shape[-1], "key_conv_attn_layer")
    if keep is None:
        return None
    return (torch.where(keep[:, None, :].to(states.device), states, torch.zeros((), dtype=states.dtype,
                                                                                 device=states.device)), *args[1:])


def _zero_padded_rows(part: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
    """After ``conv_out_layer``: its output ``[batch, seq, all_head_size]`` (bias included) zero on the padded rows,
    before transformers unfolds it."""
    keep = _real(part, output.shape[-2], "conv_out_layer")
    if keep is None:
        return None
    return torch.where(keep[..., None].to(output.device), output, torch.zeros((), dtype=output.dtype,
                                                                               device=output.device))


def install_padding_mask(model: nn.Module) -> None:
    """Give every ``ConvBertModel`` of ``model`` (once) the hooks that keep its convolutions off the padding (see the
    module's docstring): a pre-hook recording the call's ``attention_mask``, a pre-hook on each
    ``key_conv_attn_layer`` and a hook on each ``conv_out_layer`` zeroing the padded positions. On an unpadded batch
    (or none given) nothing changes."""
    for module in model.modules():
        if type(module).__name__ != MODEL_CLASS or getattr(module, _INSTALLED, False):
            continue
        module.register_forward_pre_hook(_record, with_kwargs=True)
        module.register_forward_hook(_forget, with_kwargs=True, always_call=True)
        for part in _convolutions(module):
            setattr(part, _KEEP, None)
            if isinstance(part, nn.Linear):
                part.register_forward_hook(_zero_padded_rows)
            else:
                part.register_forward_pre_hook(_zero_padded_columns)
        setattr(module, _INSTALLED, True)
