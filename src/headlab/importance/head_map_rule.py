"""The LRP rule for a per-head map between the attention function and the output projection
(:data:`headlab.adapters.families.HEAD_MAPS`): NeoMME's ``exclusive_self_attention``.

``NeoMMEExclusiveSelfAttention.forward(o, v)`` (transformers 5.24) computes, for query head h and position i,

    y_i = o_i - tanh(alpha_h) (o_i . v^_i) v^_i,      v^_i = v_i / ||v_i||,

``o_i`` the head's output at i and ``v_i`` position i's own value in the head's key/value group
(``repeat_kv(value_states, num_key_value_groups)``). The rule holds ``v^`` constant, as the attention weights and the
output gates are held constant (rules.py: the query and key projections and a gate's projection detached): then
``y_i = M_i o_i`` with ``M_i = I - tanh(alpha_h) v^_i v^_i^T`` a fixed matrix per head and position, a weighted sum
whose ordinary backward is Ding et al.'s rule for it, ``R(o_i) = o_i * M_i^T g(y_i)``. So
``sum R(o_i) = sum (M_i o_i) g(y_i) = sum R(y_i)``: the map keeps all the relevance it receives and sends it to the
heads' outputs, none to the values through ``v^`` (which reach the relevance through the heads' outputs, as values).
Forward values are unchanged: the hook returns the module's own output with the surrogate's backward, and checks,
on every call, that the surrogate recomputed from the module's inputs is that output (refused otherwise: a forward
other than the one read)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from headlab.adapters import AttentionBlock
from headlab.adapters.families import HEAD_MAPS
from headlab.errors import HeadlabError

__all__ = ["head_map_hooks", "head_map_problem", "head_maps"]


def head_maps(block: AttentionBlock) -> list[nn.Module]:
    """The modules of :data:`~headlab.adapters.families.HEAD_MAPS` inside ``block``'s attention."""
    return [module for module in block.core.modules() if type(module).__name__ in HEAD_MAPS]


def head_map_problem(block: AttentionBlock) -> str | None:
    """Why no LRP rule covers a per-head map of ``block`` (None: the rule below does, or it has none)."""
    for module in head_maps(block):
        if type(module).__name__ not in _RULES:
            return (f"its heads' outputs pass through {type(module).__name__}, a per-head map "
                    "(headlab.adapters.families.HEAD_MAPS) that headlab has no LRP rule for")
    return None


def _exclusive_rule(module: nn.Module, args: tuple, output: Any) -> torch.Tensor:
    """NeoMME's exclusive map with ``v^`` held constant (the module docstring's equation)."""
    if len(args) != 2 or not all(isinstance(a, torch.Tensor) for a in args) or not isinstance(output, torch.Tensor):
        raise HeadlabError(f"LRP: {type(module).__name__} was called other than with (heads' outputs, values), which "
                           "its rule reads")
    heads, values = args
    groups = getattr(module, "num_key_value_groups", None)
    alpha = getattr(module, "alpha", None)
    if not isinstance(groups, int) or not isinstance(alpha, torch.Tensor) or values.dim() != 4 \
            or values.shape[1] * groups != heads.shape[2] or alpha.shape != (heads.shape[2],):
        raise HeadlabError(f"LRP: {type(module).__name__}'s values {list(values.shape)}, num_key_value_groups {groups} "
                           f"and alpha do not fit its heads' outputs {list(heads.shape)}: no rule for this layout")
    repeated = values.repeat_interleave(groups, dim=1).transpose(1, 2)
    unit = F.normalize(repeated.float(), dim=-1).to(heads.dtype).detach()  # v^: a constant of the backward
    scale = torch.tanh(alpha).to(heads.dtype).view(1, 1, -1, 1)
    surrogate = heads - (scale * (heads * unit).sum(-1, keepdim=True)) * unit
    eps = torch.finfo(heads.dtype).eps
    if surrogate.shape != output.shape or not torch.allclose(surrogate, output, rtol=16 * eps, atol=16 * eps):
        raise HeadlabError(f"LRP: {type(module).__name__} computed something other than o - tanh(alpha) (o . v^) v^, "
                           "the exclusive map its rule holds v^ constant in: no rule for this forward")
    return output.detach() + (surrogate - surrogate.detach())


_RULES = {"NeoMMEExclusiveSelfAttention": _exclusive_rule}
"""The rule of each class of :data:`~headlab.adapters.families.HEAD_MAPS` (a forward hook)."""


def head_map_hooks(block: AttentionBlock) -> list[tuple[nn.Module, Any]]:
    """(module, forward hook) pairs of the rules of ``block``'s per-head maps (:func:`head_map_problem` first)."""
    return [(module, _RULES[type(module).__name__]) for module in head_maps(block)]
