"""The LRP rule for Kimi Delta Attention (KDA) token mixers: Kimi Linear's ``KimiLinearDeltaAttention`` and GLM-5-Next's
``Glm5NextTextLinearAttention`` (transformers 5.24, the same forward line for line; read in their modeling files).

What they compute, from the layer's input ``x`` (the padding positions zeroed):

* ``[q | k | v] = silu(conv([q_proj x | k_proj x | v_proj x]))``: one depthwise causal convolution over the three
  projections' channels (``causal_conv1d_fn``); ``q`` and ``k`` are l2-normalised per head, ``q`` scaled by
  ``1 / sqrt(d)`` (inside the recurrence);
* ``beta = sigmoid(b_proj x)`` (one per head), ``g = forget_gate(x)`` (a decay per head and channel: KDA's difference
  from the Gated DeltaNet, whose decay is one per head), the gate ``z = g_b_proj(g_a_proj(x))``;
* the delta rule with per-channel decay, per head: ``S_t = diag(exp(g_t)) S_{t-1} (I - beta_t k_t k_t^T) + beta_t k_t
  v_t^T`` in its chunked form (``chunk_kimi_delta_attention``) from a zero state, ``o_t = S_t^T q_t``;
* ``out = o_proj(rmsnorm(o) * w * sigmoid(z))`` (``o_norm``, a gated RMS norm).

The rule is the Gated DeltaNet's (:mod:`~headlab.importance.mixer_rules.gated_delta`, MambaLRP's principle): ``q``,
``k``, ``beta`` and ``g``, computed from the input to weigh the values, are held constant, so ``o`` is a linear map of
``v`` and all of ``R(o)`` reaches ``v``; the SiLU after the convolution gets the identity rule, the convolution and the
value projection pass ``R(v)`` on by their ordinary backward; the norm's factor ``w / rms(o) * sigmoid(z)`` is held
constant (the gate as every gate in headlab). How: forward hooks keep the projections' and the forget gate's outputs;
the norm's pre-hook recomputes ``o`` from them with the modeling module's own ``chunk_kimi_delta_attention`` (the
function the forward called), checks on every call that it equals the ``o`` the forward computed, and gives ``o`` that
recomputation's backward; the norm's forward hook holds its factor constant. A cached state from earlier tokens fails
the check and is refused. Refused, naming why, before any work (:func:`_problem`): parts of other sizes, a
convolution other than read, and a forward that, on a probe, does not compute what this docstring says.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from headlab.importance.mixer_rules import Hook, MixerRule, register
from headlab.importance.mixer_rules.gated_delta import DeltaRule, Recurrence
from headlab.importance.rules import _activation_rule

__all__ = ["CLASSES", "RULE", "recompute"]

CLASSES = ("KimiLinearDeltaAttention", "Glm5NextTextLinearAttention")
"""The KDA classes the rule was written for (adapters.families.LINEAR_MIXERS)."""
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "b_proj", "forget_gate", "g_b_proj")
"""The parts whose outputs the rule keeps: the query, key and value projections, ``beta``'s projection, the forget
gate's decay and the output gate's projection."""
_NAME = "Kimi Delta Attention (Kimi Linear, GLM-5-Next)"


def _matches(module: nn.Module) -> bool:
    return type(module).__name__ in CLASSES


def recompute(module: Any, kept: list[torch.Tensor], rule: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, z)`` from the kept outputs (the order of :data:`_PROJECTIONS`), ``[batch, seq, heads, head_dim]`` each:
    ``o`` recomputed with the module's own recurrence from a zero state. ``rule``: ``q``, ``k``, ``beta`` and ``g``
    without a gradient and the activation rule on the convolution's output (the LRP rule's backward); otherwise
    plainly (the probe's reference)."""
    q, k, v, b, g, z = kept
    batch, seq = q.shape[:2]
    width, heads, d = module.qkv_dim, module.num_heads, module.head_dim
    conv = cast(nn.Conv1d, module.conv1d)
    qkv = torch.cat([q, k, v], dim=-1).transpose(1, 2)
    pre = F.conv1d(qkv.to(conv.weight.dtype), conv.weight, conv.bias, padding=module.conv_kernel_size - 1,
                   groups=3 * width)[:, :, :seq]
    act = _activation(module)
    post = (_activation_rule(None, (pre,), act(pre)) if rule else act(pre)).to(qkv.dtype).transpose(1, 2)
    with torch.no_grad() if rule else nullcontext():
        query, key = post[..., :width], post[..., width:2 * width]
        beta = torch.sigmoid(b)
    value = post[..., 2 * width:]
    if rule:
        query, key, beta, g = (t.detach() for t in (query, key, beta, g))
    shape = (batch, seq, heads, d)
    o, _ = _recurrence(module)(query.reshape(shape), key.reshape(shape), value.reshape(shape), g=g, beta=beta,
                               initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True)
    return o, z.reshape(shape)


def _activation(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    from transformers.activations import ACT2FN

    return ACT2FN[module.activation]


def _recurrence(module: nn.Module) -> Callable[..., Any]:
    return sys.modules[type(module).__module__].chunk_kimi_delta_attention


def _norm_factor(norm: Any, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """What the gated norm multiplies ``o`` by, ``w / rms(o) * sigmoid(z)``, in at least float32 as it computes."""
    wide = torch.promote_types(o.dtype, torch.float32)
    x = o.to(wide)
    return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) * norm.weight.to(wide) \
        * torch.sigmoid(z.to(wide))


def _problem(module: nn.Module, path: str) -> str | None:
    core: Any = module
    sizes: dict[str, Any] = {n: getattr(core, n, None) for n in ("num_heads", "head_dim", "qkv_dim", "conv_kernel_size")}
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in sizes.values()) \
            or sizes["qkv_dim"] != sizes["num_heads"] * sizes["head_dim"]:
        return f"its sizes are not heads x head_dim ({', '.join(f'{n}={v!r}' for n, v in sizes.items())})"
    parts = [getattr(core, n, None) for n in ("q_proj", "k_proj", "v_proj", "b_proj", "g_a_proj", "g_b_proj", "o_proj")]
    if not all(isinstance(p, nn.Linear) for p in parts) or not isinstance(getattr(core, "forget_gate", None), nn.Module):
        return "its q/k/v/b/g_a/g_b/o projections are not all linear maps beside a forget_gate"
    conv, width = getattr(core, "conv1d", None), 3 * sizes["qkv_dim"]
    if not isinstance(conv, nn.Conv1d) or conv.groups != width or conv.in_channels != width \
            or conv.out_channels != width or conv.kernel_size != (sizes["conv_kernel_size"],) or conv.bias is not None:
        return f"its conv1d is not a bias-free depthwise convolution over the {width} query, key and value channels"
    norm = getattr(core, "o_norm", None)
    if not isinstance(getattr(norm, "weight", None), torch.Tensor) or getattr(norm, "activation", None) != "sigmoid" \
            or not isinstance(getattr(norm, "variance_epsilon", None), float):
        return "its o_norm is not a gated RMS norm rmsnorm(o) * w * sigmoid(z)"
    if not callable(getattr(sys.modules[type(module).__module__], "chunk_kimi_delta_attention", None)):
        return "its modeling module has no chunk_kimi_delta_attention (the recurrence its forward calls)"
    if not _computes(core):
        return ("on a probe its forward does not compute o_proj(rmsnorm(o) * w * sigmoid(z)) with o the KDA delta rule "
                "of silu(conv(q, k, v)) read in transformers 5.24")
    return None


def _computes(module: Any) -> bool:
    """Whether the module's own forward (no grad, no cache) on a random input equals the recomputation; True where
    its weights are on the meta device (the rule checks ``o`` on every call)."""
    weight = module.o_proj.weight
    if weight.is_meta or not weight.is_floating_point():
        return True
    g = torch.Generator().manual_seed(0)
    x = torch.randn((2, 5, module.hidden_size), generator=g, dtype=torch.float64).to(weight.device, weight.dtype)
    try:
        with torch.no_grad():
            output = type(module).forward(module, x)
            kept = [module.q_proj(x), module.k_proj(x), module.v_proj(x), module.b_proj(x), module.forget_gate(x),
                    module.g_b_proj(module.g_a_proj(x))]
            o, z = recompute(module, kept, rule=False)
            expected = module.o_proj((o * _norm_factor(module.o_norm, o, z)).to(o.dtype).reshape(2, 5, -1))
    except Exception:  # noqa: BLE001  # any failure: not the mixer the rule assumes
        return False
    if not isinstance(output, torch.Tensor) or output.shape != expected.shape:
        return False
    tolerance = max(1e-3, 16 * torch.finfo(output.dtype).eps)
    return torch.allclose(output, expected, rtol=tolerance, atol=tolerance * float(expected.abs().mean()))


def _hooks(module: nn.Module) -> list[Hook]:
    return DeltaRule(module, Recurrence(_NAME, _PROJECTIONS, "o_norm", recompute, _norm_factor,
                                        "KDA delta rule")).hooks()


def _owns(module: nn.Module) -> list[nn.Module]:
    """The gated norm and the forget gate: their parts are this rule's (the gate's decay is held constant)."""
    return [m for m in (getattr(module, "o_norm", None), getattr(module, "forget_gate", None))
            if isinstance(m, nn.Module)]


RULE = register(MixerRule(name=_NAME, matches=_matches, problem=_problem, hooks=_hooks, owns=_owns))
