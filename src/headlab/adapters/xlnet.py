"""XLNet's attention given module points headlab can hook (transformers 5.24, models/xlnet/modeling_xlnet.py).

``XLNetRelativeAttention`` keeps q, k, v, o and r as bare parameters ``(d_model, n_head, d_head)`` applied by
``torch.einsum``, so no module sees the queries, the keys or the heads' outputs. :func:`install_points` gives each
attention module identity modules (:class:`HeadPoint`) at those places and a forward that calls them: the same
einsums, in the same order, on the same tensors (a point returns its input), for the content stream (no ``g``: no
``target_mapping``, and no ``mems``). Masking, gates and per-head outputs hook ``headlab_o`` (the heads' outputs,
``[q, batch, heads x d_head]``, time-first, before the ``o`` einsum), capture reads ``output_attentions``'
``[q, k, batch, heads]``, and LRP detaches ``headlab_q`` and ``headlab_k``. Physical pruning slices the bare
parameters per head (``Family.head_parameters``); the original forward is shape-driven (it never reads ``n_head``),
so a pruned layer, one with no head left too, runs it unchanged, in headlab and in plain transformers.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn
from transformers.models.xlnet.modeling_xlnet import XLNetRelativeAttention

from headlab.errors import HeadlabError

POINTS = ("headlab_q", "headlab_k", "headlab_v", "headlab_o")


class HeadPoint(nn.Module):
    """The identity, where XLNet's forward has the heads' queries, keys, values (``[seq, batch, heads x d]``) or
    outputs: a module for headlab's hooks, of the width of the heads the layer holds (``in_features`` =
    ``out_features``, kept in step by pruning). It holds no parameter: the state dict is the original's."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.in_features = self.out_features = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def extra_repr(self) -> str:
        return f"width={self.in_features}"


def _hooked(module: nn.Module) -> bool:
    """A hook sits on ``module`` (capture's, reading its probabilities) or on one of its points (masking, gates,
    per-head outputs, LRP): headlab is reading or changing it."""
    points = [module, *(getattr(module, name, None) for name in POINTS)]
    return any(p is not None and (p._forward_hooks or p._forward_pre_hooks) for p in points)


def _through(point: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[seq, batch, heads, d]`` through ``point`` as ``[seq, batch, heads x d]``."""
    return point(x.flatten(2)).reshape(x.shape)


def _forward(self: Any, h: torch.Tensor, g: torch.Tensor | None, attn_mask_h: torch.Tensor | None,
             attn_mask_g: torch.Tensor | None, r: torch.Tensor, seg_mat: torch.Tensor | None,
             mems: torch.Tensor | None = None, target_mapping: torch.Tensor | None = None,
             output_attentions: bool = False) -> tuple:
    """``XLNetRelativeAttention.forward``'s content stream (its ``else`` branch, transformers 5.24) with the points;
    the two-stream pass (``g``: target_mapping/perm_mask pretraining) and a memory go to the original forward, and
    are refused while a hook is on the module or its points (masking would not reach them, capture would read a map
    over the memory's keys too, or the query stream's)."""
    if g is not None or (mems is not None and mems.dim() > 1):
        if _hooked(self):
            raise HeadlabError(
                "XLNet: headlab reads, masks and attributes the content stream only; this call runs "
                + ("the query stream (target_mapping or perm_mask with a query stream)" if g is not None else
                   "with a memory (mems)") + ", where headlab's hooks do not reach: call the model without it")
        return self._headlab_original_forward(h, g, attn_mask_h, attn_mask_g, r, seg_mat, mems=mems,
                                              target_mapping=target_mapping, output_attentions=output_attentions)
    q_head_h = _through(self.headlab_q, torch.einsum("ibh,hnd->ibnd", h, self.q))
    k_head_h = _through(self.headlab_k, torch.einsum("ibh,hnd->ibnd", h, self.k))
    v_head_h = _through(self.headlab_v, torch.einsum("ibh,hnd->ibnd", h, self.v))
    # the relative positions' keys: from the sinusoid position embeddings, which no token changes
    k_head_r = torch.einsum("ibh,hnd->ibnd", r.type(self.r.dtype), self.r)
    attn_vec = self.rel_attn_core(q_head_h, k_head_h, v_head_h, k_head_r, seg_mat=seg_mat, attn_mask=attn_mask_h,
                                  output_attentions=output_attentions)
    if output_attentions:
        attn_vec, attn_prob = attn_vec
    output_h = self.post_attention(h, _through(self.headlab_o, attn_vec))
    if output_attentions:
        return output_h, None, attn_prob
    return output_h, None


class XLNetRelativeAttentionWithPoints(XLNetRelativeAttention):
    """transformers' XLNetRelativeAttention with :func:`_forward`: a class of this module, so that a model headlab
    gave points to still pickles (``torch.save(model)``; a class made at run time does not), named as the original
    (headlab and transformers read the name)."""

    forward = _forward
    _headlab_original_forward = XLNetRelativeAttention.forward
    _headlab_points = True


XLNetRelativeAttentionWithPoints.__name__ = "XLNetRelativeAttention"
_CLASSES: dict[type, type] = {XLNetRelativeAttention: XLNetRelativeAttentionWithPoints}


def _with_points(cls: type) -> type:
    """``cls`` with :func:`_forward` (one class per original, named as it); transformers' own class gets
    :class:`XLNetRelativeAttentionWithPoints`."""
    if getattr(cls, "_headlab_points", False):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (cls,), {
            "forward": _forward, "_headlab_original_forward": getattr(cls, "forward"),  # noqa: B009 (mypy: type)
            "_headlab_points": True,
            "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    return _CLASSES[cls]


def install_points(model: nn.Module) -> None:
    """Give every ``XLNetRelativeAttention`` of ``model`` its points and :func:`_forward` (once; a point's width
    follows the parameters, pruned or loaded pruned). Nothing the model computes changes."""
    for module in model.modules():
        if type(module).__name__ != "XLNetRelativeAttention" or not isinstance(getattr(module, "q", None),
                                                                                nn.Parameter):
            continue
        q = cast(torch.Tensor, module.q)
        width = int(q.shape[1] * q.shape[2])
        for name in POINTS:
            point = getattr(module, name, None)
            if not isinstance(point, HeadPoint):
                module.add_module(name, HeadPoint(width))
            elif point.in_features != width:  # pruned or loaded pruned since
                point.in_features = point.out_features = width
        module.__class__ = _with_points(type(module))

