"""LRP rules for the selective state-space mixers of hybrid models: Mamba (Jamba's ``JambaMambaMixer``, Zamba's
``ZambaMambaMixer``) and Mamba-2 (Bamba's ``BambaMixer``, Falcon-H1's ``FalconH1Mixer``, Nemotron-H's
``NemotronHMamba2Mixer``, Zamba 2's ``Zamba2MambaMixer``, Granite-MoE-hybrid's ``GraniteMoeHybridMambaLayer``).

The rule is MambaLRP's (Jafari, Montavon, Müller, Eberle 2024, "MambaLRP: Explaining Selective State Space
Sequence Models", NeurIPS; code: github.com/FarnoushRJ/MambaLRP, ``mamba_lrp/model/mamba_huggingface.py``,
``ModifiedMambaMixer.slow_forward``), in headlab's gradient x input form (rules.py's docstring):

* the selective SSM ``h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t``, ``y_t = C_t h_t + D x_t``: the discretised decay
  ``exp(dt_t A)``, input matrix ``dt_t B_t`` and output matrix ``C_t`` are computed from the mixer's input (``dt``,
  ``B``, ``C`` from ``x_proj``, or from the in-projection's ``B``, ``C`` and ``dt`` columns in Mamba-2) and are held
  constant, as the attention weights are, so ``y`` is a weighted sum of the values ``x`` (MambaLRP detaches
  ``discrete_A``, ``discrete_B`` and ``C`` likewise). In Mamba-2 the weights are those of a causal attention:
  ``y_t = sum_{s<=t} (C_t . B_s) exp(sum_{s<r<=t} dt_r A) dt_s x_s + D x_t`` (the SSD form, Dao and Gu 2024),
  which :func:`_mamba2_scan` computes by chunks of at most 64 positions (SSD's chunked form, its factors constants),
  so that what the backward pass keeps grows with ``T``, not ``T^2`` (benchmarks/bench_mamba2_lrp.py). What
  computes them (``x_proj``, ``dt_proj``, Jamba's ``dt/b/c_layernorm``, the conv channels of ``B`` and ``C``,
  ``dt_bias``, ``A_log``) lies on the held-constant path: no relevance reaches it. The skip ``D x`` is linear;
* SiLU (the activation after the depthwise convolution): the activation rule ``R(x) = R(silu(x))``, MambaLRP's
  ``ModifiedAct(transform='identity')``; the convolution is a weighted sum over a short window of its channel, its
  bias keeps its share as any bias does. Mamba-2's convolution runs over ``[x | B | C]``: only ``x``'s channels
  carry relevance (``B``'s and ``C``'s are detached after it);
* the gate ``y * silu(z)``: ``z`` held constant (CP-LRP, headlab's convention for gates, rules.py's docstring), so
  all of ``R`` reaches ``y``. MambaLRP differs here: its half-propagation rule (``(y / 2) + (y / 2).detach()`` after
  the gate, with ``silu(z)`` under the activation rule) sends half of ``R`` to ``y`` and half to ``z``; headlab
  detaches ``z`` as it detaches every gate;
* Mamba-2's gated RMS norm ``norm(y * silu(z))`` (``BambaRMSNormGated`` and its family copies; Falcon-H1's
  ``norm(y) * silu(z)`` where ``norm_before_gate``, and ``y * silu(z)`` without the norm): ``z`` constant, the norm's
  scale ``weight / rms`` (per group of channels) detached, headlab's and AttnLRP's norm rule;
* Falcon-H1's multipliers (``ssm_in_multiplier`` on the input, the ``mup_vector`` on the in-projection's output,
  from ``ssm_multipliers``): constants, weights of a weighted sum.

How: transformers 5.24's mixers compute the scan, the convolution's activation and the gate inside function calls
(``mamba_selective_scan``, ``mamba2_chunk_scan``, ``causal_conv1d_fn``) that no module hook reaches. So one forward
hook on the mixer recomputes its output from its input here (:func:`mamba1_output` and :func:`mamba2_output`, each
factor the rule holds constant computed under ``no_grad``) and gives the mixer's output that recomputation's backward
(``output.detach() + (s - s.detach())``): forward values stay bit for bit, and the recomputation is checked to
equal the output on every call, so a forward that computes something else is refused, not explained wrongly
(:func:`_mismatch`). The in- and out-projections and the convolution are called as modules there, so that lrp.py's
probes of their biases see them (a bias keeps its share). Before any work, the rule's ``problem`` runs the mixer's
own forward on a random input and compares (:func:`_probe`). No rule is installed inside the mixer
(:attr:`MixerRule.owns`: all of it): its norms and projections are part of this rule. The recomputation runs in the
model's precision, float64 staying float64 where transformers' code asks for float32 (lrp.py's ``_KeptWide``).

Not covered, refused by name: any other class with this layout (pure Mamba, Mamba-2 and Falcon-Mamba models have no
attention and are refused by discovery before this), a cache holding a previous state (LRP runs without one: the
check on every call would refuse it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from headlab.errors import HeadlabError
from headlab.importance.mixer_rules import Hook, MixerRule, register
from headlab.importance.mixer_rules.probe import probing
from headlab.importance.rules import _swap_backward

__all__ = ["MAMBA1_MIXERS", "MAMBA2_MIXERS", "mamba1_output", "mamba2_output"]

MAMBA1_MIXERS = ("JambaMambaMixer", "ZambaMambaMixer")
"""Mamba mixers (one decay per channel and state, ``x_proj``/``dt_proj``) the rule was checked against."""
MAMBA2_MIXERS = ("BambaMixer", "FalconH1Mixer", "NemotronHMamba2Mixer", "Zamba2MambaMixer",
                 "GraniteMoeHybridMambaLayer")
"""Mamba-2 mixers (one decay per head, ``[z | x B C | dt]`` from ``in_proj``) the rule was checked against."""


# -- the rules' pieces -------------------------------------------------------------------------------------------
def _activated(module: Any, conv: torch.Tensor) -> torch.Tensor:
    """The conv's activation (``module.activation``, SiLU in every family) under the activation rule."""
    from transformers.activations import ACT2FN

    act = ACT2FN[module.activation]
    with torch.no_grad():
        value = act(conv)
        ratio = torch.where(conv != 0, value / torch.where(conv != 0, conv, torch.ones_like(conv)),
                            torch.zeros_like(conv))
    return _swap_backward(value, conv * ratio)


def _causal_conv(module: Any, x: torch.Tensor) -> torch.Tensor:
    """The depthwise causal convolution of ``x`` ``[b, channels, T]`` (a weighted sum; its bias a bias), called as
    the module (padded by ``kernel - 1`` on both sides, the first ``T`` outputs kept), so that lrp.py's probe of its
    bias sees it."""
    conv = module.conv1d
    if conv.padding != (conv.kernel_size[0] - 1,) or conv.groups != x.shape[1] or conv.stride != (1,) \
            or conv.dilation != (1,):
        raise HeadlabError(f"LRP: the convolution of {type(module).__name__} is not depthwise and causal "
                           "(padding kernel - 1, stride and dilation 1)")
    return conv(x)[..., :x.shape[-1]]


def _masked(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """transformers' ``apply_mask_to_padding_states``: padding positions zeroed (``x [b, T, d]``)."""
    return x if mask is None else (x * mask[:, :, None]).to(x.dtype)


def _constant_silu(z: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return F.silu(z)


# -- Mamba ------------------------------------------------------------------------------------------------------
def _mamba1_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                 D: torch.Tensor) -> torch.Tensor:
    """``y`` ``[b, d, T]`` of the selective scan over the values ``x`` ``[b, d, T]``, every other argument a constant
    (``dt`` ``[b, d, T]`` after softplus, ``A`` ``[d, n]``, ``B`` and ``C`` ``[b, T, n]``, ``D`` ``[d]``)."""
    with torch.no_grad():
        decay = torch.exp(A[None, :, None, :] * dt[..., None])  # [b, d, T, n]
        into = dt[..., None] * B[:, None, :, :]
    state = x.new_zeros(*x.shape[:2], A.shape[-1])
    ys = []
    for t in range(x.shape[-1]):
        state = decay[:, :, t] * state + into[:, :, t] * x[:, :, t, None]
        ys.append((state * C[:, None, t, :]).sum(-1))
    return torch.stack(ys, dim=-1) + x * D[None, :, None]


def _jamba(module: Any, h: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``JambaMambaMixer.forward`` (transformers 5.24) under the rule: scan output ``[b, d, T]``, before out_proj."""
    projected = module.in_proj(_masked(h, mask)).transpose(1, 2)
    x, gate = projected.chunk(2, dim=1)
    x = _masked(_activated(module, _causal_conv(module, x)).transpose(1, 2), mask)  # [b, T, d]
    with torch.no_grad():
        rank, n = module.time_step_rank, module.ssm_state_size
        step, B, C = torch.split(F.linear(x, module.x_proj.weight, module.x_proj.bias), [rank, n, n], dim=-1)
        step, B, C = (type(norm).forward(norm, v) for norm, v in
                      ((module.dt_layernorm, step), (module.b_layernorm, B), (module.c_layernorm, C)))
        dt = module.dt_proj.weight @ step.transpose(1, 2)
        if module.dt_proj.bias is not None:
            dt = dt + module.dt_proj.bias[:, None]
        dt = F.softplus(dt)
        A = -torch.exp(module.A_log)
    y = _mamba1_scan(x.transpose(1, 2), dt, A, B, C, module.D.detach())
    return y * _constant_silu(gate)


def _zamba(module: Any, h: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``ZambaMambaMixer.forward`` (transformers 5.24) under the rule: per Mamba head, ``x`` and the gate
    interleaved in in_proj's output (even and odd channels), ``x_proj`` and ``dt_proj`` weights per head."""
    batch, seq, _ = h.shape
    heads, width = module.n_mamba_heads, module.mamba_head_dim
    projected = module.in_proj(_masked(h, mask)).transpose(1, 2)
    x, gate = projected.reshape(batch, -1, 2, seq).unbind(dim=2)
    x = _masked(_activated(module, _causal_conv(module, x)).transpose(1, 2), mask).transpose(1, 2)
    x = x.reshape(batch, heads, width, seq)
    gate = gate.reshape(batch, heads, width, seq)
    rank, n = module.time_step_rank, module.ssm_state_size
    ys = []
    for head in range(heads):
        with torch.no_grad():
            params = (module.x_proj_weight[head] @ x[:, head]).transpose(1, 2)  # [b, T, rank + 2n]
            step, B, C = torch.split(params, [rank, n, n], dim=-1)
            dt = F.softplus(module.dt_proj_weight[head] @ step.transpose(1, 2) + module.dt_proj_bias[head][:, None])
            A = -torch.exp(module.A_log[head])
        y = _mamba1_scan(x[:, head], dt, A, B, C, module.D[head].detach())
        ys.append(y * _constant_silu(gate[:, head]))
    return torch.cat(ys, dim=1)


def mamba1_output(module: Any, h: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The output of a :data:`MAMBA1_MIXERS` mixer on ``h`` ``[b, T, hidden]`` whose backward is the rule's."""
    scan = _zamba if type(module).__name__ == "ZambaMambaMixer" else _jamba
    y = scan(module, h, mask)
    return module.out_proj(y.transpose(1, 2))


# -- Mamba-2 ----------------------------------------------------------------------------------------------------
_CHUNK = 64
"""Longest chunk of :func:`_mamba2_scan` (the mixer's own ``chunk_size`` where shorter): the constant weights it keeps
for the backward pass are ``[b, h, T, chunk]``, not ``[b, h, T, T]``."""


def _segment_sums(steps: torch.Tensor) -> torch.Tensor:
    """``S[..., t, s] = sum_{s<r<=t} steps[..., r]`` for ``s <= t``, ``-inf`` above the diagonal (``steps``
    ``[..., Q]``): a cumulative sum of the masked steps, as transformers' ``segment_sum``, no differences of sums."""
    length = steps.shape[-1]
    below = torch.tril(torch.ones(length, length, dtype=torch.bool, device=steps.device), diagonal=-1)
    summed = torch.cumsum(steps[..., None].expand(*steps.shape, length).masked_fill(~below, 0), dim=-2)
    return summed.masked_fill(~torch.tril(torch.ones_like(below)), -torch.inf)


def _mamba2_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                 D: torch.Tensor, chunk: int = _CHUNK) -> torch.Tensor:
    """``y`` ``[b, T, h, p]`` of Mamba-2's scan over the values ``x`` ``[b, T, h, p]``: ``y = M x + D x`` with the
    constant ``M[b, h, t, s] = (C_t . B_s) exp(sum_{s<r<=t} dt_r A) dt_s`` for ``s <= t`` (``dt`` ``[b, T, h]``,
    ``A`` and ``D`` ``[h]``, ``B`` and ``C`` ``[b, T, h, n]``).

    ``M x`` is computed by chunks of ``chunk`` positions (the SSD algorithm, Dao and Gu 2024, Sec. 6): ``M``'s blocks
    inside a chunk, and the state ``E_c`` entering chunk ``c``, ``E_{c+1} = exp(sum of chunk c's dt A) E_c + S_c``
    with ``S_c = sum_{s in c} exp(sum_{s<r<=end of c} dt_r A) dt_s B_s x_s``, read at ``t`` as
    ``C_t exp(sum_{start of c<=r<=t} dt_r A) E_c``. Every factor of ``x`` is a constant computed under no_grad, so
    the backward is that of ``M x`` whichever the chunks; the exponents are sums, never differences of sums."""
    batch, seq, heads, width = x.shape
    chunk = max(min(chunk, seq), 1)  # a text shorter than a chunk: one chunk of its length, M whole
    pad = -seq % chunk
    count = (seq + pad) // chunk

    def chunked(v: torch.Tensor) -> torch.Tensor:  # [b, T, ...] -> [b, chunks, Q, ...], zeros after the end
        v = F.pad(v, (0, 0) * (v.dim() - 2) + (0, pad))
        return v.reshape(batch, count, chunk, *v.shape[2:])

    with torch.no_grad():
        # padded positions have dt = 0: no input to the state, no decay; their outputs are dropped
        dt, B, C = chunked(dt), chunked(B), chunked(C)  # [b, c, Q, h], [b, c, Q, h, n]
        steps = (dt * A).permute(0, 1, 3, 2)  # [b, c, h, Q]
        segments = _segment_sums(steps)  # [b, c, h, Q, Q]
        inside = torch.einsum("bcthn,bcshn->bchts", C, B) * torch.exp(segments) * dt.permute(0, 1, 3, 2)[:, :, :, None]
    values = chunked(x)  # [b, c, Q, h, p]
    y = torch.einsum("bchts,bcshp->bcthp", inside, values)
    if count == 1:  # no state enters the only chunk
        return y.reshape(batch, chunk, heads, width)[:, :seq] + x * D[:, None]
    with torch.no_grad():
        to_end = torch.exp(segments[..., -1, :]).permute(0, 1, 3, 2)  # [b, c, Q, h]: sum_{s<r<=end}
        into_state = B * (to_end * dt)[..., None]  # [b, c, Q, h, n]
        from_start = C * torch.exp(torch.cumsum(steps, dim=-1)).permute(0, 1, 3, 2)[..., None]  # [b, c, Q, h, n]
        across = torch.exp(steps.sum(-1))  # [b, c, h]
    states = torch.einsum("bcshn,bcshp->bchpn", into_state, values)
    entering = [torch.zeros_like(states[:, 0])]
    for c in range(count - 1):
        entering.append(across[:, c, :, None, None] * entering[-1] + states[:, c])
    y = y + torch.einsum("bcthn,bchpn->bcthp", from_start, torch.stack(entering, dim=1))
    return y.reshape(batch, count * chunk, heads, width)[:, :seq] + x * D[:, None]


def _gated_norm(module: Any, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The gate and gated RMS norm after the scan (``y``, ``gate`` ``[b, T, d]``): the gate held constant, the norm's
    ``weight / rms`` (per group) detached. Falcon-H1 without ``mamba_rms_norm``: ``y * silu(gate)``."""
    silu = _constant_silu(gate)
    norm = module.norm
    if getattr(module, "mamba_rms_norm", True) is False:
        return y * silu
    before_gate = getattr(norm, "norm_before_gate", False)
    groups = getattr(norm, "n_groups", None) or y.shape[-1] // norm.group_size
    v = y if before_gate else y * silu
    grouped = v.reshape(*v.shape[:-1], groups, -1)
    with torch.no_grad():
        scale = torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
        scale = scale * norm.weight.reshape(groups, -1)
    out = (grouped * scale).reshape(v.shape)
    return out * silu if before_gate else out


def mamba2_output(module: Any, h: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The output of a :data:`MAMBA2_MIXERS` mixer on ``h`` ``[b, T, hidden]`` whose backward is the rule's
    (``BambaMixer.forward``'s torch path, transformers 5.24, and its copies; Falcon-H1's multipliers)."""
    batch, seq, _ = h.shape
    h = _masked(h, mask)
    if (multiplier := getattr(module, "ssm_in_multiplier", None)) is not None:
        h = h * multiplier
    projected = module.in_proj(h)
    if (mup := getattr(module, "mup_vector", None)) is not None:
        projected = projected * mup.detach()
    inner, heads, n = module.intermediate_size, module.num_heads, module.n_groups * module.ssm_state_size
    gate, xbc, dt = projected.split([inner, module.conv_dim, heads], dim=-1)
    xbc = _masked(_activated(module, _causal_conv(module, xbc.transpose(1, 2))).transpose(1, 2), mask)
    x, B, C = torch.split(xbc, [inner, n, n], dim=-1)
    with torch.no_grad():
        low, high = module.time_step_limit
        dt = torch.clamp(F.softplus(dt + module.dt_bias), min=low, max=high)
        A = -torch.exp(module.A_log)
        repeat = heads // module.n_groups
        B, C = (v.reshape(batch, seq, module.n_groups, -1).repeat_interleave(repeat, dim=2) for v in (B, C))
    chunk = min(int(getattr(module, "chunk_size", _CHUNK) or _CHUNK), _CHUNK)
    y = _mamba2_scan(x.reshape(batch, seq, heads, -1), dt, A, B, C, module.D.detach(), chunk).reshape(batch, seq, -1)
    return module.out_proj(_gated_norm(module, y, gate.detach()))


# -- the hook and the checks -------------------------------------------------------------------------------------
def _arguments(module: nn.Module, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
    """``(hidden_states, attention_mask, cache)`` of a call ``forward(hidden_states, cache, attention_mask)``."""
    h = args[0] if args else kwargs["hidden_states"]
    cache = args[1] if len(args) > 1 else kwargs.get("cache", kwargs.get("cache_params"))
    mask = args[2] if len(args) > 2 else kwargs.get("attention_mask")
    return h, mask, cache


def _tolerance(dtype: torch.dtype) -> float:
    """How far the recomputation may lie from the module's output, relative to its largest value: rounding only
    (in float64 float32's: transformers' code computes parts in float32 outside LRP's widening). Another formula
    (a term left out, another gate) lies orders of magnitude further; what the rounding costs is measured by
    compute_lrp's conservation check."""
    return 1e-6 if dtype == torch.float64 else 1e-4


def _mismatch(output: Any, expected: torch.Tensor) -> str | None:
    """Why ``output`` is not ``expected`` (the rule's recomputation), None where it is (to rounding)."""
    if not isinstance(output, torch.Tensor) or output.shape != expected.shape:
        return f"its output is not a tensor shaped {tuple(expected.shape)}"
    with torch.no_grad():
        scale = float(expected.abs().max()) or 1.0
        error = float((output.to(expected.dtype) - expected).abs().max()) / scale
    if not error <= _tolerance(expected.dtype):  # NaN too
        return f"its output differs from the rule's recomputation by {error:.1e} of its largest value"
    return None


def _hook(compute: Callable[..., torch.Tensor], name: str):
    def hook(module, args, kwargs, output):
        h, mask, _ = _arguments(module, args, kwargs)
        surrogate = compute(module, h, mask)
        if (problem := _mismatch(output, surrogate)) is not None:
            raise HeadlabError(f"LRP: {type(module).__name__} is not the {name} its rule recomputes: {problem} (a "
                               "cache holding a previous state, or a forward headlab's rule does not know)")
        return _swap_backward(output, surrogate.to(output.dtype))

    return hook


def _probe(module: Any, compute: Callable[..., torch.Tensor]) -> str | None:
    """Why ``module``'s own forward, on a random input without cache or mask, is not what ``compute`` recomputes;
    None where it is, or where it cannot run (weights on the meta device: the hook checks every call)."""
    weight = module.in_proj.weight
    if weight.is_meta or not weight.is_floating_point():
        return None

    g = torch.Generator().manual_seed(0)
    try:
        with probing(module):
            h = torch.randn((2, 7, weight.shape[1]), generator=g, dtype=torch.float64).to(weight.device, weight.dtype)
            output = module(h)
            expected = compute(module, h, None)
    except Exception as error:  # noqa: BLE001  # any failure: not the mixer the rule was written for
        return f"on a probe its forward or the rule's recomputation failed ({type(error).__name__}: {error})"
    return _mismatch(output, expected)


def _matches(module: nn.Module, per_channel: bool) -> bool:
    """A selective SSM's layout: a decay ``A_log`` (per channel and state in Mamba, per head in Mamba-2, beside a
    ``dt_bias``), an in-projection, a depthwise convolution and an out-projection."""
    A_log = getattr(module, "A_log", None)
    if not isinstance(A_log, torch.Tensor) or not all(
            isinstance(getattr(module, name, None), kind)
            for name, kind in (("in_proj", nn.Linear), ("conv1d", nn.Conv1d), ("out_proj", nn.Linear))):
        return False
    if per_channel:
        return A_log.dim() >= 2
    return A_log.dim() == 1 and isinstance(getattr(module, "dt_bias", None), torch.Tensor)


def _problem(known: tuple[str, ...], compute: Callable[..., torch.Tensor]):
    def problem(module: nn.Module, path: str) -> str | None:
        name = type(module).__name__
        if name not in known:
            return (f"{name} is laid out as one of these mixers, but its forward is none the rule was checked against "
                    f"({', '.join(known)}), so its recomputation may not be what it computes")
        if (found := _probe(module, compute)) is not None:
            return f"{found}; headlab's rule recomputes transformers 5.24's torch forward of {name}"
        return None

    return problem


def _hooks(compute: Callable[..., torch.Tensor], name: str) -> Callable[[nn.Module], list[Hook]]:
    return lambda module: [(module, "forward_kwargs", _hook(compute, name))]


def _inside(module: nn.Module) -> list[nn.Module]:
    """Every module inside the mixer: the rule's hook gives the mixer its whole backward (its norms, projections and
    convolution are part of the rule; their bias probes are lrp.py's)."""
    return [part for part in module.modules() if part is not module]


MAMBA1 = register(MixerRule(
    name="Mamba selective SSM (Jamba, Zamba)",
    matches=lambda module: _matches(module, per_channel=True),
    problem=_problem(MAMBA1_MIXERS, mamba1_output),
    hooks=_hooks(mamba1_output, "Mamba mixer"),
    owns=_inside,
))

MAMBA2 = register(MixerRule(
    name="Mamba-2 selective SSM (Bamba, Falcon-H1, Nemotron-H, Zamba 2, Granite-MoE-hybrid)",
    matches=lambda module: _matches(module, per_channel=False),
    problem=_problem(MAMBA2_MIXERS, mamba2_output),
    hooks=_hooks(mamba2_output, "Mamba-2 mixer"),
    owns=_inside,
))
