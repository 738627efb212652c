"""The LRP rule for ConvBERT's span-based dynamic convolution heads (``ConvBertSelfAttention``, model type ``convbert``).

transformers 5.24 (models/convbert/modeling_convbert.py, ``ConvBertSelfAttention.forward``), read: beside its ``H``
softmax heads of width ``d`` (``attention_head_size``) the module computes, for the layer's input ``x`` ``[batch, seq,
hidden]`` and ``K = conv_kernel_size``, ``P = (K - 1) // 2``, as many convolution heads::

    taps_t = softmax_k(conv_kernel_layer(query(x_t) * key_conv_attn_layer(x)_t) viewed [H, K])   # per position, head
    u = conv_out_layer(x)                                                                       # [batch, seq, H x d]
    conv_{t,h,c} = sum_{k < K} taps_{t,h,k} u_{t + k - P, h d + c}      (u zero outside the sentence: unfold's padding)

and returns ``[attention heads' outputs | conv]`` (``H x d`` columns each), which ``output.dense`` reads. A layer
pruned by headlab (:data:`headlab.portable_code.PRUNED_FORWARDS` ``"convbert"``) keeps ``n <= H`` attention heads
(``num_attention_heads``, ``n`` may be 0) reading the first ``n x d`` rows of its whole query, the kept heads' first,
and all ``H`` convolution heads: ``[n x d | H x d]`` columns.
``key_conv_attn_layer`` (``SeparableConv1D``: a depthwise ``Conv1d`` of ``K`` taps with ``K // 2`` zeros each side, a
pointwise ``Conv1d``, a bias) reads ``x`` transposed; its output feeds the taps only.

The rule: the taps are weights the module computes from its input to mix the values ``u`` over a span, as the
attention weights weigh the values over the sentence: held constant in the backward pass (the attention rule, rules.py's
docstring; Ali et al. 2022's CP-LRP and AttnLRP, Achtibat et al. 2024, hold the softmax weights constant; Inkling2's
dynamic convolution taps, :mod:`.inkling2`, and MambaLRP's input-dependent matrices, Jafari et al. 2024, Sec. 4,
likewise). ``key_conv_attn_layer``'s and ``conv_kernel_layer``'s outputs are detached (``query``'s already is, by the
attention rule), so ``conv`` is linear in ``u`` and its ordinary backward the linear rule (Voita et al. 2019,
App. A.2): the relevance of the convolution heads' outputs reaches ``x`` through ``conv_out_layer``, whose bias keeps
its share (counted by lrp.py's probes), and none reaches the taps' inputs.

headlab's padding mask (:mod:`headlab.adapters.convbert`) zeroes ``conv_out_layer``'s output on a padded batch's
padding inside its forward, so ``u`` is zero there, a constant; lrp.py's bias probe, a forward hook that runs after
that forward, would put its bias back into those rows' gradient path (not their values), counting a share no
relevance reaches. The rule's hook on ``conv_out_layer`` zeroes those rows again after the probe: their gradient is
zero, as their value is.

Refused before any work (the rule's ``problem``, naming the module): a module not laid out so (its parts, their
widths, an even ``K``, with which transformers' unfold returns one position fewer than the sentence has), or whose
forward, on a float64 probe, is not the formula above and the attention heads' ``softmax(q k^T / sqrt(d)) v`` beside it,
or whose relevance with the rule's hooks (and the attention rule's on ``query`` and ``key``) is not that of the formula
with the attention weights and the taps held constant.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from headlab.importance.mixer_rules import Hook, MixerRule, register

__all__ = ["ATTENTION_CLASS", "RULE", "conv_heads", "self_attention"]

ATTENTION_CLASS = "ConvBertSelfAttention"
_LINEARS = ("query", "key", "value", "conv_kernel_layer", "conv_out_layer")
_HELD = ("query", "key", "key_conv_attn_layer", "conv_kernel_layer")
"""What the attention rule and this rule hold constant: the attention weights' queries and keys, the taps' inputs."""


def _matches(module: nn.Module) -> bool:
    return type(module).__name__ == ATTENTION_CLASS


def taps(core: Any, x: torch.Tensor) -> torch.Tensor:
    """The convolution heads' taps ``[batch, seq, H, K]``: the softmax over the span of ``conv_kernel_layer(query(x) *
    key_conv_attn_layer(x))`` (every query row, a pruned layer's too)."""
    kernel = core.conv_kernel_size
    key_conv = core.key_conv_attn_layer(x.transpose(1, 2)).transpose(1, 2)
    logits = core.conv_kernel_layer(core.query(x) * key_conv)
    return torch.softmax(logits.view(*x.shape[:2], -1, kernel), dim=-1)


def conv_heads(core: Any, u: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The module docstring's ``conv`` ``[batch, seq, H x d]`` of ``u`` ``[batch, seq, H x d]`` with ``weights`` the
    taps ``[batch, seq, H, K]``, written apart from transformers' unfold: one shifted copy of ``u`` per tap."""
    batch, seq, _ = u.shape
    heads, kernel = weights.shape[-2:]
    pad = (kernel - 1) // 2
    spread = F.pad(u.view(batch, seq, heads, -1), (0, 0, 0, 0, pad, pad))  # zeros P positions beyond each end
    out = torch.zeros_like(spread[:, :seq])
    for k in range(kernel):
        out = out + weights[..., k, None] * spread[:, k:k + seq]
    return out.reshape(batch, seq, -1)


def self_attention(core: Any, x: torch.Tensor, *, held: bool = False) -> torch.Tensor:
    """What the module returns first, ``[attention heads | convolution heads]`` ``[batch, seq, n x d + H x d]`` on
    ``x`` without a mask, from its parts: ``n`` attention heads (``num_attention_heads``; fewer than ``H`` in a pruned
    layer, whose query is whole, the kept heads' rows first), reading the first ``n x d`` query rows; ``held``: the
    attention weights and the taps computed without a gradient (the rule)."""
    batch, seq, _ = x.shape
    heads, d = core.num_attention_heads, core.attention_head_size
    with torch.set_grad_enabled(torch.is_grad_enabled() and not held):
        q = core.query(x)[..., :heads * d].reshape(batch, seq, heads, d).transpose(1, 2)
        k = core.key(x).view(batch, seq, heads, d).transpose(1, 2)
        probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d), dim=-1)
        weights = taps(core, x)
    v = core.value(x).view(batch, seq, heads, d).transpose(1, 2)
    context = (probs @ v).transpose(1, 2).reshape(batch, seq, heads * d)
    return torch.cat([context, conv_heads(core, core.conv_out_layer(x), weights)], dim=-1)


def _sizes(core: Any) -> tuple[int, int, int] | None:
    """``(n, d, K)`` of the module, None where one is not an int, ``d`` and ``K`` positive."""
    sizes = [getattr(core, name, None) for name in ("num_attention_heads", "attention_head_size", "conv_kernel_size")]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in sizes) or not all(sizes[1:]):
        return None
    heads, d, kernel = sizes
    return heads, d, kernel  # type: ignore[return-value]  # ints, checked above


def _layout_problem(core: Any) -> str | None:
    if (sizes := _sizes(core)) is None:
        return ("its num_attention_heads (0 in a layer pruned to none), attention_head_size and conv_kernel_size are "
                "not numbers")
    heads, d, kernel = sizes
    if kernel % 2 == 0:
        return (f"its conv_kernel_size {kernel} is even: transformers' unfold then gives one position fewer than the "
                "sentence has")
    conv_out = getattr(core, "conv_out_layer", None)
    convs = conv_out.out_features // d if isinstance(conv_out, nn.Linear) else 0  # its convolution heads: H >= n
    linears = [getattr(core, name, None) for name in _LINEARS]
    widths = (convs * d, heads * d, heads * d, convs * kernel, convs * d)
    if not convs or convs < heads or not all(isinstance(p, nn.Linear) and p.out_features == w
                                             for p, w in zip(linears, widths)) \
            or not isinstance(getattr(core, "key_conv_attn_layer", None), nn.Module):
        return ("its parts are not query and conv_out_layer (Linear, to H x d), key and value (Linear, to its "
                "num_attention_heads x d, at most H), conv_kernel_layer (Linear, to H x conv_kernel_size) and "
                "key_conv_attn_layer")
    return None


def _probe_problem(core: nn.Module, query: nn.Linear) -> str | None:
    """Why, on a float64 probe, the module's forward or its relevance under the rule is not the formula's."""
    from headlab.importance.mixer_rules.inkling2 import _float64_copy
    from headlab.importance.rules import _detach_output

    g = torch.Generator().manual_seed(0)
    x = torch.randn((2, 6, query.in_features), generator=g, dtype=torch.float64).to(query.weight.device)
    with _float64_copy(core) as wide:
        try:
            output = wide(x)[0]
            expected = self_attention(wide, x)
        except Exception as error:  # noqa: BLE001  # any failure: not the module the rule assumes
            return f"its forward failed on a probe ({type(error).__name__}: {error})"
        if not isinstance(output, torch.Tensor) or output.shape != expected.shape \
                or not torch.allclose(output, expected, rtol=1e-9, atol=1e-12):
            return ("on a probe its forward is not [softmax(q k^T / sqrt(d)) v | sum_k taps_k conv_out_layer(x) over "
                    "the span], taps = softmax(conv_kernel_layer(query(x) * key_conv_attn_layer(x)))")
        handles = [wide.get_submodule(name).register_forward_hook(_detach_output) for name in _HELD]
        try:  # its relevance under the hooks is the formula's with the weights and taps held (the rule)
            with torch.enable_grad():
                x_rule, x_held = (x.clone().requires_grad_(True) for _ in range(2))
                w = torch.randn(output.shape, generator=g, dtype=torch.float64).to(x.device)
                grad_rule, = torch.autograd.grad((wide(x_rule)[0] * w).sum(), x_rule)
                grad_held, = torch.autograd.grad((self_attention(wide, x_held, held=True) * w).sum(), x_held)
        finally:
            for handle in handles:
                handle.remove()
    if not torch.allclose(x * grad_rule, x * grad_held, rtol=1e-9, atol=1e-12):
        return ("on a probe its relevance with query, key, key_conv_attn_layer and conv_kernel_layer detached is not "
                "the formula's with the attention weights and the taps held constant")
    return None


def problem(module: nn.Module, path: str = "") -> str | None:
    """Why the rule does not fit this self-attention (None: it does): its parts, then its forward on a probe."""
    layout = _layout_problem(module)
    query = getattr(module, "query", None)
    if layout is not None or not isinstance(query, nn.Linear) or query.weight.is_meta:  # meta: cannot run
        return layout
    return _probe_problem(module, query)


def _padding_zeroed(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """``conv_out_layer``'s output with headlab's padding mask applied again, after lrp.py's bias probe."""
    from headlab.adapters.convbert import _zero_padded_rows

    return _zero_padded_rows(module, output)


def _hooks(module: nn.Module) -> list[Hook]:
    from headlab.importance.rules import _detach_output

    return [(module.get_submodule("key_conv_attn_layer"), "forward", _detach_output),
            (module.get_submodule("conv_kernel_layer"), "forward", _detach_output),
            (module.get_submodule("conv_out_layer"), "forward", _padding_zeroed)]


RULE = register(MixerRule(
    name="ConvBERT's span-based dynamic convolution heads (taps held constant)",
    matches=_matches, problem=problem, hooks=_hooks))
