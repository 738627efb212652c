"""The LRP rules for the parts of Inkling2 and Inkling2-Loop (model types ``inkling2_text``, ``inkling2``,
``inkling2_loop_text``, ``inkling2_loop``) that rules.py's general rules and Inkling's (:mod:`.inkling`) do not cover:
its block attention residuals, its full-attention layers' dynamic key/value short convolutions and Inkling2-Loop's
message gates, declared as :class:`~.MixerRule` plugins at the end of this module.

transformers 5.24 (models/inkling2/modeling_inkling2.py, models/inkling2_loop/modeling_inkling2_loop.py), read:

* the block attention residuals (``Inkling2BlockAttentionResidual``: a decoder layer's ``attention_input`` and
  ``mlp_input``, the text model's ``final_input``; Inkling2-Loop's ``Inkling2LoopBlockAttentionResidual`` and its
  ``message_input``, ``Inkling2LoopMessageAttentionResidual``, whose queries are ``query[loop_layer_idx]``), for the
  states ``s_1 .. s_D`` of one position at the earlier block boundaries and its partial state ``s_{D+1}``::

      n_d = s_d / rms(s_d)                                       # norm: Inkling2UnweightedRMSNorm, eps 1e-6
      p_{i,d} = softmax_d(q_i . n_d / sqrt(hidden))             # q_i: a learned query, the same at every position
      out_i = sum_d p_{i,d} n_d

  (the attention interface called with the positions as its "heads" and the depths as its keys, in float32).
  ``p`` and ``1 / rms`` are factors the module computes from its input to weigh it: held constant in the backward
  pass, as the attention weights are (the attention rule, rules.py's docstring; Ali et al. 2022's CP-LRP, AttnLRP's
  identity rule on the norm, Achtibat et al. 2024), so ``out_i`` is a weighted sum of the states and all of its
  relevance reaches them, conserved. How: a forward hook recomputes ``out`` with those factors computed under
  ``no_grad`` (:func:`depth_mix`), checks it is the forward's output (on every call), and gives the output that
  sum's backward (values bit for bit the forward's, :func:`rules._swap_backward`). The rule owns the norm.
* the dynamic short convolutions (``Inkling2DynamicShortConvolution``, the full-attention layers' ``k_proj.sconv`` and
  ``v_proj.sconv``), for ``u`` the key (value) projection's output and ``x`` the projection's input::

      taps_{t,c,l} = static_weight[l, c] + weight_proj(x_t)[head(c), l]
      out_{t,c} = (sum_{l < K} taps_{t,c,l} u_{t-l,c} + u_{t,c}) / sqrt(2 K + 1)

  (in float32, the padded positions of ``u`` zeroed by a constant mask). The taps are weights computed from the
  layer's input, as a gated convolution's gates or Mamba's input-dependent matrices are (MambaLRP, Jafari et al.
  2024, Sec. 4: held constant): ``weight_proj``'s output is detached, so the convolution is linear in ``u`` and its
  ordinary backward the linear rule, conserving (:func:`dynamic_conv_problem` checks the forward on a probe). On the
  keys' side this also keeps the attention weights constant, ``k_proj.linear`` detached by the attention rule.
* Inkling2-Loop's message gates (``Inkling2LoopMessageGate``), mixing a loop layer's input ``h`` with the message
  ``m`` of the previous pass::

      z = down_proj([norm(h), norm(m)]);  f = tanh(forget_gate_proj(z));  g = tanh(message_gate_proj(z))
      out = (1 - f) * h + g * m

  ``f`` and ``g`` are gates computed from the input, held constant (CP-LRP, as every gate in headlab): both
  projections' outputs detached, so ``out`` is a weighted sum of ``h`` and ``m`` (:func:`message_gate_problem`
  checks the forward on a probe). The rule owns the gates' norm.

Refused before any work (the ``problem`` of each rule), naming the module and why: a module of these classes laid out
otherwise, or whose forward, on a probe, is not the formula above.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from headlab.errors import HeadlabError
from headlab.importance.mixer_rules import Hook, MixerRule, register

__all__ = ["DEPTH_MIXERS", "DYNAMIC_CONVS", "MESSAGE_GATES", "depth_mix", "dynamic_conv", "dynamic_conv_problem",
           "message_gate", "message_gate_problem"]

DEPTH_MIXERS = ("Inkling2BlockAttentionResidual", "Inkling2LoopBlockAttentionResidual")
"""Block attention residuals: ``forward(block_states, partial_block_states)``, ``query`` ``[hidden]`` or ``[n, hidden]``,
the outputs unbound over the queries (a tuple)."""
MESSAGE_MIXERS = ("Inkling2LoopMessageAttentionResidual",)
"""Inkling2-Loop's: ``forward(block_states, partial_block_states, loop_layer_idx)``, ``query`` ``[loop layers, 4,
hidden]``, one output ``[batch, seq, 4, hidden]``."""
DYNAMIC_CONVS = ("Inkling2DynamicShortConvolution", "Inkling2LoopDynamicShortConvolution")
MESSAGE_GATES = ("Inkling2LoopMessageGate",)
_GATE_PROJECTIONS = ("forget_gate_proj", "message_gate_proj")


@contextmanager
def _float64_copy(module: nn.Module) -> Iterator[Any]:
    """A float64 copy of ``module`` without the hooks its original carries, computed in float64 whatever casts its
    forward makes (lrp.py's ``_KeptWide``), under no_grad: what a probe compares with the rule's formula. (A model's
    keeps float32 parts beside its dtype's, Inkling2-Loop's gate projections, which LRP widens: a copy runs alike
    before and during LRP.)"""
    from headlab.importance.lrp import _KeptWide
    from headlab.importance.mixer_rules.inkling import _HOOK_DICTS

    wide = copy.deepcopy(module).to(torch.float64)
    for part in wide.modules():
        for name in _HOOK_DICTS:
            getattr(part, name).clear()
    with torch.no_grad(), _KeptWide(torch.float64):
        yield wide


# -- the block attention residuals: sum_d p_d s_d / rms(s_d), p and rms held constant -----------------------------------
def _is_depth_mixer(module: nn.Module) -> bool:
    return type(module).__name__ in DEPTH_MIXERS + MESSAGE_MIXERS


def _queries(module: Any, hidden: int, loop_layer: int | None) -> torch.Tensor:
    """The learned queries ``[n, hidden]`` the module's forward uses."""
    query = module.query if loop_layer is None else module.query[loop_layer]
    return query.reshape(-1, hidden)


def depth_mix(module: Any, block_states: torch.Tensor, partial: torch.Tensor,
              loop_layer: int | None = None) -> torch.Tensor:
    """``out_i = sum_d p_{i,d} s_d / rms(s_d)`` ``[batch, seq, n, hidden]`` with ``p`` and ``1 / rms`` computed without
    a gradient (the rule), in at least float32 as the module computes."""
    stacked = torch.cat([block_states, partial.unsqueeze(-2)], dim=-2)
    stacked = stacked.to(torch.promote_types(stacked.dtype, torch.float32))
    hidden = stacked.shape[-1]
    with torch.no_grad():
        inverse_rms = torch.rsqrt(stacked.square().mean(-1, keepdim=True) + module.norm.eps)
        query = _queries(module, hidden, loop_layer).to(stacked.dtype)
        scores = torch.einsum("...dh,nh->...nd", stacked * inverse_rms, query) * hidden ** -0.5
        weights = torch.softmax(scores, dim=-1)
    return torch.einsum("...nd,...dh->...nh", weights, stacked * inverse_rms)


def _depth_arguments(module: nn.Module, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, int | None]:
    names = ("block_states", "partial_block_states", "loop_layer_idx")
    given = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
    loop_layer = given.get("loop_layer_idx") if type(module).__name__ in MESSAGE_MIXERS else None
    return given["block_states"], given["partial_block_states"], loop_layer


def _depth_output(module: nn.Module, mixed: torch.Tensor) -> Any:
    """``mixed`` ``[batch, seq, n, hidden]`` as the module returns it: unbound over the queries, or whole."""
    return mixed if type(module).__name__ in MESSAGE_MIXERS else mixed.unbind(-2)


def _depth_problem(mixer: nn.Module, path: str) -> str | None:
    module: Any = mixer
    query, norm = getattr(module, "query", None), getattr(module, "norm", None)
    rows = 3 if type(module).__name__ in MESSAGE_MIXERS else None
    if not isinstance(query, torch.Tensor) or not isinstance(norm, nn.Module) \
            or not isinstance(getattr(norm, "eps", None), float) or (rows is not None and query.dim() != rows):
        return "its parts are not a learned query and an unweighted RMS norm (norm, with eps)"
    if query.is_meta:
        return None  # cannot run: checked on every call
    g = torch.Generator().manual_seed(0)
    hidden = query.shape[-1]
    block_states = torch.randn((2, 3, 2, hidden), generator=g, dtype=torch.float64).to(query.device)
    partial = torch.randn((2, 3, hidden), generator=g, dtype=torch.float64).to(query.device)
    loop = None if rows is None else query.shape[0] - 1
    try:
        with _float64_copy(module) as wide:
            output = wide(block_states, partial, *(() if loop is None else (loop,)))
            expected = _depth_output(wide, depth_mix(wide, block_states, partial, loop))
    except Exception as error:  # noqa: BLE001  # any failure: not the module the rule assumes
        return f"its forward failed on a probe ({type(error).__name__}: {error})"
    if not _same(output, expected, rtol=1e-4, atol=1e-5):
        return ("on a probe its forward is not sum_d softmax_d(q . n_d / sqrt(hidden)) n_d with n_d = s_d / rms(s_d), "
                "the learned queries attending over the states at the block boundaries")
    return None


def _same(output: Any, expected: Any, *, rtol: float, atol: float) -> bool:
    outputs = output if isinstance(output, tuple) else (output,)
    wanted = expected if isinstance(expected, tuple) else (expected,)
    return len(outputs) == len(wanted) and all(
        isinstance(o, torch.Tensor) and o.shape == e.shape and torch.allclose(o.to(e.dtype), e, rtol=rtol, atol=atol)
        for o, e in zip(outputs, wanted))


def _depth_rule(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    """The forward hook (with kwargs): the output with :func:`depth_mix`'s backward, checked against the forward."""
    from headlab.importance.rules import _swap_backward

    block_states, partial, loop_layer = _depth_arguments(module, args, kwargs)
    expected = _depth_output(module, depth_mix(module, block_states, partial, loop_layer))
    if not _same(output, expected, rtol=1e-4, atol=1e-5):
        raise HeadlabError(f"LRP: {type(module).__name__}'s output is not sum_d p_d s_d / rms(s_d) with p the softmax "
                           "of its queries' scores over the states at the block boundaries; headlab has no rule for it")
    if isinstance(output, tuple):
        return tuple(_swap_backward(o, e.to(o.dtype)) for o, e in zip(output, expected))
    return _swap_backward(output, expected.to(output.dtype))


# -- the dynamic short convolutions: taps from the layer's input held constant ------------------------------------------
def _is_dynamic_conv(module: nn.Module) -> bool:
    return type(module).__name__ in DYNAMIC_CONVS


def dynamic_conv(module: Any, u: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The module docstring's ``out`` on ``u`` ``[batch, seq, channels]`` (no cache, no padding), written apart from
    transformers' unfolded windows: one shifted copy of ``u`` per lag."""
    batch, seq, width = u.shape
    kernel, heads = module.conv_kernel_size, module.num_heads
    dynamic = module.weight_proj(x).view(batch, seq, heads, 1, kernel).expand(-1, -1, -1, width // heads, -1)
    taps = module.static_weight.to(u.dtype).view(kernel, 1, 1, width) + \
        dynamic.reshape(batch, seq, width, kernel).permute(3, 0, 1, 2).to(u.dtype)
    out = u.clone()
    for lag in range(kernel):
        out = out + taps[lag] * F.pad(u, (0, 0, lag, 0))[:, :seq]
    return out / (2 * kernel + 1) ** 0.5


def dynamic_conv_problem(module: nn.Module, path: str = "") -> str | None:
    """Why the rule does not fit this dynamic convolution (None: it does): its parts, and its forward on a probe."""
    conv: Any = module
    weight, projection = getattr(conv, "static_weight", None), getattr(conv, "weight_proj", None)
    kernel, heads = getattr(conv, "conv_kernel_size", None), getattr(conv, "num_heads", None)
    if not isinstance(weight, torch.Tensor) or not isinstance(projection, nn.Linear) or not isinstance(kernel, int) \
            or not isinstance(heads, int) or weight.dim() != 2 or weight.shape[0] != kernel \
            or projection.out_features != heads * kernel or projection.bias is not None \
            or (heads and weight.shape[1] % heads):
        return ("its parts are not static_weight [kernel, channels] and a bias-free weight_proj giving kernel taps per "
                "key/value head")
    if weight.is_meta or not heads:  # a layer pruned to no head keeps its convolutions with no channel, unused
        return None
    g = torch.Generator().manual_seed(0)
    u = torch.randn((2, 5, weight.shape[1]), generator=g, dtype=torch.float64).to(weight.device)
    x = torch.randn((2, 5, projection.in_features), generator=g, dtype=torch.float64).to(weight.device)
    try:
        with _float64_copy(conv) as wide:
            output = wide(u, x, cache=None, conv_mask=None)
            expected = dynamic_conv(wide, u, x)
    except Exception as error:  # noqa: BLE001  # any failure: not the convolution the rule assumes
        return f"its forward failed on a probe ({type(error).__name__}: {error})"
    if not _same(output, expected.to(output.dtype) if isinstance(output, torch.Tensor) else expected,
                 rtol=1e-4, atol=1e-5):
        return ("on a probe its forward is not (sum_l (static_weight + weight_proj(x))_l u_{t-l} + u_t) / "
                "sqrt(2 kernel + 1), a convolution whose taps, once held constant, make it linear in u")
    return None


def _dynamic_hooks(module: nn.Module) -> list[Hook]:
    from headlab.importance.rules import _detach_output

    return [(module.weight_proj, "forward", _detach_output)]  # type: ignore[list-item]


# -- Inkling2-Loop's message gates: (1 - f) h + g m, f and g held constant ---------------------------------------------
def _is_message_gate(module: nn.Module) -> bool:
    return type(module).__name__ in MESSAGE_GATES


def message_gate(module: Any, h: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The module docstring's ``out``, its gates computed from its parts (the plain forward, with a gradient)."""
    wide = torch.promote_types(h.dtype, torch.float32)
    h, m = h.to(wide), m.to(wide)
    z = module.down_proj(torch.cat([module.norm(h), module.norm(m)], dim=-1).to(module.down_proj.weight.dtype))
    z = z.to(module.forget_gate_proj.weight.dtype)
    forget, gate = (torch.tanh(getattr(module, name)(z)).to(wide) for name in _GATE_PROJECTIONS)
    return (1 - forget) * h + gate * m


def message_gate_problem(module: nn.Module, path: str = "") -> str | None:
    parts = [getattr(module, name, None) for name in ("down_proj", *_GATE_PROJECTIONS)]
    if not all(isinstance(p, nn.Linear) and p.bias is None for p in parts) \
            or not isinstance(getattr(module, "norm", None), nn.Module):
        return "its parts are not norm, down_proj, forget_gate_proj and message_gate_proj (bias-free)"
    weight = parts[0].weight  # type: ignore[union-attr]
    if weight.is_meta:
        return None
    g = torch.Generator().manual_seed(0)
    h, m = (torch.randn((2, 3, weight.shape[1] // 2), generator=g, dtype=torch.float64).to(weight.device)
            for _ in range(2))
    try:
        with _float64_copy(module) as wide:
            output, expected = wide(h, m), message_gate(wide, h, m)
    except Exception as error:  # noqa: BLE001  # any failure: not the gate the rule assumes
        return f"its forward failed on a probe ({type(error).__name__}: {error})"
    if not _same(output, expected, rtol=1e-4, atol=1e-5):
        return "on a probe its forward is not (1 - tanh(forget_gate_proj(z))) h + tanh(message_gate_proj(z)) m"
    return None


def _message_hooks(module: nn.Module) -> list[Hook]:
    from headlab.importance.rules import _detach_output

    return [(getattr(module, name), "forward", _detach_output) for name in _GATE_PROJECTIONS]


def _owned_norm(module: nn.Module) -> list[nn.Module]:
    """The norm whose factor the rule holds (a block residual's) or that feeds only the gates (a message gate's)."""
    norm = getattr(module, "norm", None)
    return [norm] if isinstance(norm, nn.Module) else []


DEPTH = register(MixerRule(
    name="Inkling2's block attention residuals (attention weights and norms over depth held constant)",
    matches=_is_depth_mixer, problem=lambda module, path: _depth_problem(module, path),
    hooks=lambda module: [(module, "forward_kwargs", _depth_rule)], owns=_owned_norm))

DYNAMIC = register(MixerRule(
    name="Inkling2's dynamic key/value short convolutions (taps from the input held constant)",
    matches=_is_dynamic_conv, problem=lambda module, path: dynamic_conv_problem(module, path),
    hooks=lambda module: _dynamic_hooks(module)))

MESSAGES = register(MixerRule(
    name="Inkling2-Loop's message gates (gates held constant)",
    matches=_is_message_gate, problem=lambda module, path: message_gate_problem(module, path),
    hooks=lambda module: _message_hooks(module), owns=_owned_norm))
