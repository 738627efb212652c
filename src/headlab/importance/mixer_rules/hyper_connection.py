"""The LRP rule for HY-V4's hyper-connections (``HYV4HyperConnection`` and ``HYV4HyperHead``, HY-V4-VL's
``HYV4VL...`` the same line for line), GLM-5-Next's (``Glm5NextTextHyperConnection``, :data:`COMBED`; its final
collapse is a plain mean, linear), DeepSeek-V4's (``DeepseekV4HyperConnection`` as GLM-5-Next's, ``DeepseekV4HyperHead``
as HY-V4's head; session 40) and Qwen4-Exp's (``Qwen4ExpTextGatedResidual``; transformers 5.24).

Hyper-connections (Zhu et al. 2024, "Hyper-Connections", arXiv:2409.19606) keep ``N`` residual streams ``s_1..s_N``.
Before each attention and MLP, HY-V4's connection computes from the streams, in float32 (its forward)::

    mixes = F.linear(flat(s), fn) * rsqrt(mean(flat(s)^2) + eps)       # input_norm: the inverse RMS
    pre   = sigmoid(mixes[:N] * scale_0 + base[:N]) + hc_eps
    post  = magnitude * sigmoid(mixes[N:] * scale_1 + base[N:]) + hc_eps
    x     = sum_n pre_n s_n                                            # the layer's input

and returns ``(post, x)``; the decoder layer writes ``s_n + post_n * layer(x)`` back into each stream. The final
``HYV4HyperHead`` collapses the streams once more, ``sum_n pre_n s_n`` with its own ``pre``.

The rule. ``pre`` and ``post`` are weights the module computes from its input to mix its values, as attention weights
are: held constant in the backward pass (the attention rule, rules.py's docstring; MambaLRP's principle for the
factors a mixer computes from its input, Jafari et al. 2024), so ``x`` is a weighted sum of the streams and the
written-back streams a weighted sum of the residual and the layer's output, whose ordinary backward is the linear rule
(Voita et al. 2019, App. A.2): relevance is conserved across them. How: a forward hook recomputes ``pre`` from the
module's parameters and input without a gradient (the formula above), checks that ``sum_n pre_n s_n`` is the ``x`` the
forward returned (on every call: a forward other than the one read is refused there), gives ``x`` that sum's backward
(values bit for bit the forward's) and detaches ``post``. The inverse RMS norm inside (``input_norm``) feeds only the
weights: the rule owns it. The forward computes in float32 whatever the model's dtype, so a float64 run conserves to
float32's rounding there.

Qwen4-Exp's gated residual (``hc_count`` streams concatenated on the feature axis, ``x``) computes::

    y = hc_norm(x)                                   # an RMS norm per stream, times (1 + w)
    m = sigmoid(up(silu(down(y) / N)))               # a weight per stream and feature
    mixed = mean_n(m_n * y_n)                        # the layer's input
    inject = 2 * sigmoid(block_inject_weight(y) / N) # the write-back weights (absent in the final mixer)

and returns ``(mixed, x, inject)``; the layer writes ``x + inject_n * layer(mixed)`` back. The rule holds ``m``,
``inject`` and the norm's factor ``y / x`` constant (the norm rule of rules.py: its scale a constant), so ``mixed`` is a
weighted sum of ``x``: recomputed without a gradient, checked against the forward, and given that sum's backward.

Qwen4-Exp's PLE layers (``Qwen4ExpTextPLELayer``) add to the streams, before the layer's gated residual, hashed n-gram
embeddings ``e`` (from the token ids, not the streams) gated by the streams (``Qwen4ExpTextPLELayer.forward``)::

    g = sigmoid(signed_sqrt(<norm_key(key_proj(e)), norm_query(x)> / sqrt(d)))   # one gate per stream
    v = g * value_proj(e);   out = v + silu(conv(norm_conv(v)))                  # conv: dilated, depthwise

The streams reach ``out`` through the gate only, a multiplicative factor held constant (CP-LRP, as every gate in
headlab), so ``out`` is a function of the n-gram embeddings alone: a source beside the token input, whose relevance
headlab counts as kept, as a bias's (Voita et al. 2019, App. A.2: a bias is a neuron of its own). The rule detaches
``out`` (no relevance flows into the layer), and lrp.py multiplies it by a probe of ones per token
(:func:`injection_probe_hooks`) whose gradient measures that share for the conservation check.

Refused before any work (:func:`_problem`): a hyper-connection class other than the ones read, parts of other shapes,
and a forward that, on a probe, is not the formula above.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from headlab.errors import HeadlabError
from headlab.importance.mixer_rules import Hook, MixerRule, register
from headlab.importance.rules import _swap_backward

__all__ = ["RULE", "CONNECTIONS", "HEADS", "GATED", "INJECTIONS", "injection_probe_hooks"]

COMBED = ("Glm5NextTextHyperConnection", "DeepseekV4HyperConnection")
"""GLM-5-Next's connection (manifold-constrained, Xie et al. 2026): ``fn`` ``[(2 + N) N, N d]``, ``base`` ``[(2 + N) N]``,
``scale`` ``[3]``; ``pre`` as HY-V4's (without a magnitude), ``post = 2 sigmoid(...)`` and a Sinkhorn-normalised
``comb`` ``[N, N]`` that mixes the streams into the write-back, ``comb^T s + post * layer(x)``; it returns
``(post, comb, x)``. ``post`` and ``comb`` are mixing weights computed from the streams: held constant, as HY-V4's.
DeepSeek-V4's connection is the same (transformers 5.24: ``DeepseekV4HyperConnection.forward``, read)."""
CONNECTIONS = ("HYV4HyperConnection", "HYV4VLHyperConnection", *COMBED)
"""Classes of the connection before each layer: ``fn`` ``[2N, N d]``, ``base`` ``[2N]``, ``scale`` ``[2]`` (GLM-5-Next's:
:data:`COMBED`)."""
HEADS = ("HYV4HyperHead", "HYV4VLHyperHead", "DeepseekV4HyperHead")
"""Classes of the final collapse: ``hc_fn`` ``[N, N d]``, ``hc_base`` ``[N]``, ``hc_scale`` ``[1]``."""
INJECTIONS = ("Qwen4ExpTextPLELayer",)
"""Qwen4-Exp's n-gram injection: ``ple_embedding``, ``key_proj``, ``value_proj``, ``norm_query``, ``conv1d``."""
GATED = ("Qwen4ExpTextGatedResidual",)
"""Qwen4-Exp's gated residual: ``hc_norm``, ``input_mix_weight_down``/``_up`` and ``block_inject_weight`` (or None)."""
_NAME = "hyper-connections (HY-V4, HY-V4-VL, Qwen4-Exp, GLM-5-Next, DeepSeek-V4) and n-gram injections (Qwen4-Exp)"


def _matches(module: nn.Module) -> bool:
    """A hyper-connection by its class name and its stream count (``hc_mult``); one this rule was not written for is
    refused by :func:`_problem`, naming it."""
    name = type(module).__name__
    return name.endswith(("HyperConnection", "HyperHead")) and isinstance(getattr(module, "hc_mult", None), int) \
        or name in GATED and isinstance(getattr(module, "hc_count", None), int) \
        or name in INJECTIONS and isinstance(getattr(module, "ple_embedding", None), nn.Module)


def _weights(module: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if type(module).__name__ in HEADS:
        return module.hc_fn, module.hc_base, module.hc_scale
    return module.fn, module.base, module.scale


def _pre(module: Any, streams: torch.Tensor) -> torch.Tensor:
    """The collapse weights ``pre`` ``[batch, seq, N]`` of the module's forward, without a gradient, in float32 at
    least (the forward's float32; float64 kept in a float64 run)."""
    fn, base, scale = _weights(module)
    wide = torch.promote_types(streams.dtype, torch.float32)
    with torch.no_grad():
        flat = streams.flatten(2).to(wide)
        mixes = F.linear(flat, fn.to(wide)) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + module.input_norm.eps)
        n = module.hc_mult
        if type(module).__name__ in HEADS:
            return torch.sigmoid(mixes * scale.to(wide) + base.to(wide)) + module.eps
        return torch.sigmoid(mixes[..., :n] * scale[0].to(wide) + base[:n].to(wide)) + module.hc_eps


def _collapse(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    return (pre.unsqueeze(-1) * streams.to(pre.dtype)).sum(dim=2)


def _gated_mix(module: Any, x: torch.Tensor) -> torch.Tensor:
    """Qwen4-Exp's ``mean_n(m_n * y_n)`` with ``m`` and the norm's factor ``y / x`` held constant (recomputed without a
    gradient, in at least float32 as the norm computes)."""
    n, width = module.hc_count, module.hidden_size
    with torch.no_grad():
        y = module.hc_norm.forward(x)  # forward: not a hook's
        weights = torch.sigmoid(module.input_mix_weight_up.forward(
            F.silu(module.input_mix_weight_down.forward(y) / n))).unflatten(-1, (n, width))
        factor = torch.where(x != 0, y.to(x.dtype) / torch.where(x != 0, x, torch.ones_like(x)), torch.zeros_like(x))
    return (weights * (factor * x).unflatten(-1, (n, width))).mean(dim=-2)


def _gated_problem(module: Any) -> str | None:
    parts = [getattr(module, name, None) for name in ("hc_norm", "input_mix_weight_down", "input_mix_weight_up")]
    inject = getattr(module, "block_inject_weight", None)
    if not all(isinstance(p, nn.Module) for p in parts) or not isinstance(getattr(module, "hidden_size", None), int) \
            or not (inject is None or isinstance(inject, nn.Linear)):
        return "its parts are not hc_norm, input_mix_weight_down, input_mix_weight_up and block_inject_weight (or none)"
    weight = module.input_mix_weight_down.weight
    if weight.is_meta:
        return None
    g = torch.Generator().manual_seed(0)
    x = torch.randn((2, 3, module.hc_count * module.hidden_size), generator=g, dtype=torch.float64).to(weight)
    try:
        with torch.no_grad():
            output = module(x)
    except Exception as error:  # noqa: BLE001  # any failure: not the module the rule assumes
        return f"its forward failed on a probe ({type(error).__name__}: {error})"
    mixed = output[0] if isinstance(output, tuple) else output
    expected = _gated_mix(module, x)
    if mixed.shape != expected.shape or not torch.allclose(mixed.to(expected.dtype), expected, rtol=1e-4, atol=1e-5):
        return "on a probe its forward is not mean_n(m_n * hc_norm(x)_n) with m = sigmoid(up(silu(down(hc_norm(x)) / N)))"
    return None


def _injection(module: Any, streams: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The formula of the module docstring, from its parts, without a gradient: the streams enter through the gate."""
    with torch.no_grad():
        e = module.ple_embedding(ids, None)
        n, d = module.hc_count, module.hidden_size
        key = module.norm_key(module.key_proj(e)).unflatten(-1, (n, d))
        query = module.norm_query(streams).unflatten(-1, (n, d))
        gate = (key * query).sum(dim=-1, keepdim=True) / math.sqrt(d)
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
        value = (torch.sigmoid(gate) * module.value_proj(e).unsqueeze(-2)).flatten(-2)
        return value + module._short_conv(module.norm_conv(value), None)


def _injection_problem(module: Any) -> str | None:
    parts = ("ple_embedding", "key_proj", "value_proj", "norm_key", "norm_query", "norm_conv", "conv1d")
    if not all(isinstance(getattr(module, part, None), nn.Module) for part in parts) \
            or not callable(getattr(module, "_short_conv", None)):
        return f"its parts are not {', '.join(parts)} and a _short_conv"
    weight = module.key_proj.weight
    if weight.is_meta:
        return None
    g = torch.Generator().manual_seed(0)
    streams = torch.randn((2, 5, module.hc_count * module.hidden_size), generator=g, dtype=torch.float64).to(weight)
    ids = torch.randint(3, int(module.ple_embedding.unigram_vocab_size), (2, 5), generator=g).to(weight.device)
    try:
        with torch.no_grad():
            output = module(streams, ids, None)
            expected = _injection(module, streams, ids)
    except Exception as error:  # noqa: BLE001  # any failure: not the module the rule assumes
        return f"its forward failed on a probe ({type(error).__name__}: {error})"
    if output.shape != expected.shape or not torch.allclose(output, expected, rtol=1e-4, atol=1e-6):
        return ("on a probe its forward is not g * value_proj(e) + silu(conv(norm_conv(...))) with the streams in the "
                "gate g only, so its output is not a function of the n-gram embeddings once g is held constant")
    return None


def _problem(mixer: nn.Module, path: str) -> str | None:
    module: Any = mixer
    name = type(module).__name__
    if name in GATED:
        return _gated_problem(module)
    if name in INJECTIONS:
        return _injection_problem(module)
    if name not in CONNECTIONS + HEADS:
        return (f"{name} is a hyper-connection this rule was not written for (it knows "
                f"{', '.join(CONNECTIONS + HEADS + GATED)}, "
                "read in transformers 5.24), so how it computes its mixing weights is unknown")
    n = module.hc_mult
    fn, base, scale = _weights(module)
    rows = n if name in HEADS else (2 + n) * n if name in COMBED else 2 * n
    norm = getattr(module, "input_norm", None)
    if not all(isinstance(t, torch.Tensor) for t in (fn, base, scale)) or fn.dim() != 2 or fn.shape[0] != rows \
            or fn.shape[1] % n or tuple(base.shape) != (rows,) or not isinstance(norm, nn.Module) \
            or not isinstance(getattr(norm, "eps", None), float):
        return f"its weights are not fn [{rows}, N x hidden], base [{rows}] and scale, beside an inverse RMS input_norm"
    if fn.is_meta:
        return None  # cannot run: checked on every call
    g = torch.Generator().manual_seed(0)
    streams = torch.randn((2, 3, n, fn.shape[1] // n), generator=g, dtype=torch.float64).to(fn.device, fn.dtype)
    try:
        with torch.no_grad():
            output = module(streams)
    except Exception as error:  # noqa: BLE001  # any failure: not the module the rule assumes
        return f"its forward failed on a probe ({type(error).__name__}: {error})"
    collapsed = output if name in HEADS else output[-1]
    expected = _collapse(_pre(module, streams), streams)
    if not isinstance(collapsed, torch.Tensor) or collapsed.shape != expected.shape \
            or not torch.allclose(collapsed.to(expected.dtype), expected, rtol=1e-4, atol=1e-5):
        return "on a probe its forward is not sum_n pre_n s_n with pre = sigmoid(linear(s) / rms(s) * scale + base) + eps"
    return None


def _kept(module: nn.Module, value: torch.Tensor, rule: torch.Tensor, formula: str) -> torch.Tensor:
    """``value`` (what the forward returned) with the backward of ``rule``, its recomputation with the weights held
    constant, checked to be the same value on every call (a forward other than the one read is refused here)."""
    with torch.no_grad():
        if not torch.allclose(rule.to(value.dtype), value, rtol=1e-4, atol=1e-5):
            raise HeadlabError(f"LRP: {_NAME}: {type(module).__name__}'s output is not {formula} of its input with the "
                               "weights its parameters give; headlab has no rule for it")
    return _swap_backward(value, rule.to(value.dtype))


def _gated_rule(module: nn.Module, args: tuple, output: Any) -> Any:
    mixed = output[0] if isinstance(output, tuple) else output
    kept = _kept(module, mixed, _gated_mix(module, args[0]), "mean_n(m_n * hc_norm(x)_n)")
    if not isinstance(output, tuple):  # the final mixer
        return kept
    return (kept, output[1], *(t.detach() for t in output[2:]))


def _rule(module: nn.Module, args: tuple, output: Any) -> Any:
    streams = args[0]
    head = type(module).__name__ in HEADS
    collapsed = output if head else output[-1]
    kept = _kept(module, collapsed, _collapse(_pre(module, streams), streams), "sum_n pre_n s_n")
    return kept if head else (*(t.detach() for t in output[:-1]), kept)  # post (and GLM-5-Next's comb) held constant


def _detach_injection(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    return output.detach()  # a source of its own: lrp.py's probe (injection_probe_hooks) measures its share


def injection_probe_hooks(model: nn.Module, ones) -> list[Hook]:
    """``(module, kind, hook)`` that measure the relevance Qwen4-Exp's n-gram injections keep: their (detached) output
    times ``ones(output)``, lrp.py's probe of ones per token that require grad (or None under no_grad), so that
    ``s * dy/ds`` is their share."""

    def probe(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        s = ones(output)
        return None if s is None else output * s

    return [(module, "forward", probe) for module in model.modules() if type(module).__name__ in INJECTIONS]


def _hooks(module: nn.Module) -> list[Hook]:
    name = type(module).__name__
    return [(module, "forward", _gated_rule if name in GATED else _detach_injection if name in INJECTIONS else _rule)]


def _owns(module: nn.Module) -> list[nn.Module]:
    """The inverse RMS norm that feeds only the mixing weights (held constant by the rule); every part of an n-gram
    injection (its output detached)."""
    if type(module).__name__ in INJECTIONS:
        return list(module.modules())[1:]
    norm = getattr(module, "hc_norm", getattr(module, "input_norm", None))
    return [norm] if isinstance(norm, nn.Module) else []


RULE = register(MixerRule(name=_NAME, matches=_matches, problem=_problem, hooks=_hooks, owns=_owns))
