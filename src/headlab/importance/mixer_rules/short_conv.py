"""The LRP rule for LFM2's gated short convolution (``Lfm2ShortConv``, LFM2-MoE's ``Lfm2MoeShortConv``, LFM3's
``Lfm3ShortConv``).

transformers 5.24 (``Lfm2ShortConv.forward``, the same in lfm2_moe and lfm3) computes, for the layer's normed input
``h`` (padding positions zeroed by the attention mask)::

    B, C, x = in_proj(h)              # one projection, its output features [B | C | x]
    y = out_proj(C * conv(B * x))     # conv: depthwise and causal (conv.weight, conv.bias), on [batch, ch, seq]

the convolution called as ``causal_conv1d_fn`` on ``conv.weight`` (the module ``conv`` itself is never called; on
the CPU that is ``F.conv1d`` with left padding, no activation, in the weight's dtype, no float32 cast).

The rule: ``B`` and ``C`` are gates computed from the layer's own input, held constant in the backward pass as the
attention weights are (headlab's CP-LRP convention, rules.py's docstring: a gate is a per-feature weight, all of the
product's relevance flows through the signal). ``in_proj``'s ``B`` and ``C`` columns are detached, so the mixer is
``x -> out_proj(C * conv(B * x))``, linear in ``x``, and gradient x input is the linear rule (Voita et al. 2019,
App. A.2) through it: relevance reaches ``h`` through ``x``'s columns of ``in_proj`` only, conserved on a bias-free
model (``in_proj``'s ``x`` bias and ``out_proj``'s bias keep their shares, counted by lrp.py's probes).

This is MambaLRP's treatment of what a selective mixer computes from its input (Jafari, Montavon, Müller, Eberle,
NeurIPS 2024, "MambaLRP: Explaining Selective State Space Sequence Models", Sec. 4; github.com/FarnoushRJ/MambaLRP,
``mamba_lrp/lrp/utils.py``: ``params_to_detach=['A', 'B', 'C', 'z']``): the input-dependent matrices ``B`` and ``C``
detached. Where MambaLRP splits the multiplicative gate ``y * silu(z)`` in halves (its "half" rule in the language
model code), headlab holds every multiplicative gate constant (CP-LRP, Ali et al. 2022; LXT's ``cp_gated_mlp_forward``),
as its output gates and routing weights are; LFM2's ``B * x`` and ``C * conv(...)`` are gates of that kind (a
projection of the input scaling a signal feature by feature), so they are held constant.

Refused (before any work, naming the module): a layout other than ``in_proj`` (hidden -> 3 x hidden), a depthwise
``conv`` and ``out_proj`` (hidden -> hidden); a convolution with a bias (``conv_bias=True``: added inside
``causal_conv1d_fn``, where no module call lets lrp.py's probes count the relevance it keeps, and no released LFM2 has
one); and a forward that, on a probe, is not ``out_proj(C * conv(B * x))`` of ``in_proj``'s ``[B | C | x]``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from headlab.importance.mixer_rules import Hook, MixerRule, register
from headlab.importance.mixer_rules.probe import probing

__all__ = ["RULE", "gated_short_conv"]


def _matches(module: nn.Module) -> bool:
    return type(module).__name__.endswith("ShortConv")


def gated_short_conv(h: torch.Tensor, in_proj: nn.Module, conv: nn.Conv1d, out_proj: nn.Module) -> torch.Tensor:
    """``out_proj(C * conv(B * x))`` with ``[B | C | x] = in_proj(h)`` and ``conv`` depthwise and causal: what LFM2's
    convolution layer computes (its reference, written apart from transformers' code)."""
    b, c, x = in_proj(h).chunk(3, dim=-1)
    u = (b * x).transpose(1, 2)
    width = conv.weight.shape[-1]
    mixed = F.conv1d(F.pad(u, (width - 1, 0)), conv.weight, conv.bias, groups=u.shape[1])
    return out_proj(c * mixed.transpose(1, 2))


def _parts(module: nn.Module) -> tuple[nn.Linear, nn.Conv1d, nn.Linear] | None:
    """``(in_proj, conv, out_proj)``: two linear maps and a 1-d convolution; None where the module has no such."""
    in_proj, conv, out_proj = (getattr(module, name, None) for name in ("in_proj", "conv", "out_proj"))
    if not isinstance(in_proj, nn.Linear) or not isinstance(out_proj, nn.Linear) or not isinstance(conv, nn.Conv1d):
        return None
    return in_proj, conv, out_proj


def _layout_problem(module: nn.Module) -> str | None:
    parts = _parts(module)
    if parts is None:
        return "it has no in_proj and out_proj (linear maps) and conv (a 1-d convolution)"
    in_proj, conv, out_proj = parts
    width = out_proj.in_features
    if in_proj.out_features != 3 * width or conv.in_channels != width or conv.out_channels != width \
            or conv.groups != width or conv.weight.shape[1] != 1:
        return (f"its in_proj is not a map to [B | C | x] of {width} features each, or its conv is not depthwise over "
                f"{width} channels")
    if conv.bias is not None:
        return ("its convolution has a bias (conv_bias), added inside causal_conv1d_fn where the module conv is never "
                "called, so the relevance the bias keeps cannot be counted and conservation cannot be checked")
    return None


def _forward_problem(module: nn.Module) -> str | None:
    """Whether ``module``'s own forward computes :func:`gated_short_conv` on a random input (under no_grad); None
    where it cannot run (weights on the meta device: the hooks check the layout they need on every call)."""
    parts = _parts(module)
    assert parts is not None  # _layout_problem checked it
    in_proj, conv, out_proj = parts
    weight = in_proj.weight
    if weight.is_meta or not weight.is_floating_point():
        return None

    g = torch.Generator().manual_seed(0)
    with probing(module):
        h = torch.randn((2, 5, in_proj.in_features), generator=g, dtype=torch.float64).to(weight.device, weight.dtype)
        try:
            output = type(module).forward(module, h)
            expected = gated_short_conv(h, in_proj, conv, out_proj)
        except Exception as error:  # noqa: BLE001  # any failure: not the forward the rule was written for
            return f"its forward failed on a probe ({type(error).__name__}: {error})"
    if not isinstance(output, torch.Tensor) or output.shape != expected.shape \
            or not torch.allclose(output, expected, rtol=1e-4, atol=1e-6):
        return ("on a probe its forward is not out_proj(C * conv(B * x)) with [B | C | x] = in_proj(h) and conv "
                "depthwise and causal, the forward the rule was written for")
    return None


def _problem(module: nn.Module, path: str) -> str | None:
    return _layout_problem(module) or _forward_problem(module)


def _hold_gates(width: int):
    """``in_proj``'s forward hook: its ``B`` and ``C`` columns (the first ``2 * width`` features) detached, its ``x``
    columns kept, the values unchanged."""

    def hook(module, args, output):
        return torch.cat([output[..., :2 * width].detach(), output[..., 2 * width:]], dim=-1)

    return hook


def _hooks(module: nn.Module) -> list[Hook]:
    parts = _parts(module)
    assert parts is not None  # _problem checked the layout
    in_proj, _, out_proj = parts
    return [(in_proj, "forward", _hold_gates(out_proj.in_features))]


RULE = register(MixerRule(
    name="gated short convolution (LFM2, LFM2-MoE, LFM3: out_proj(C * conv(B * x)), B and C held constant)",
    matches=_matches, problem=_problem, hooks=_hooks))
