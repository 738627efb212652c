"""The LRP rule for Gated DeltaNet token mixers (Yang, Kautz and Hatamizadeh 2025, "Gated Delta Networks: Improving
Mamba2 with Delta Rule", ICLR): Qwen3-Next's ``Qwen3NextGatedDeltaNet``, Qwen3.5's ``Qwen3_5GatedDeltaNet``, Qwen3.5-MoE's
``Qwen3_5MoeGatedDeltaNet``, OLMo-hybrid's ``OlmoHybridGatedDeltaNet``, LaraMini's ``LaraMiniGatedDeltaNet`` and
Qwen4-Exp's ``Qwen4ExpTextGatedDeltaNet`` (transformers 5.24, read in their modeling files).

What they compute, from the layer's input ``x`` (the padding positions zeroed):

* ``[q | k | v] = silu(conv(P_qkv x))``: one depthwise causal convolution over the three projections' channels;
  ``q`` and ``k`` are l2-normalised per head, ``q`` scaled by ``1 / sqrt(d_k)`` (inside the recurrence);
* ``beta = sigmoid(P_b x)`` (OLMo-hybrid: twice it, ``linear_allow_neg_eigval``), ``g = -exp(A_log) softplus(P_a x +
  dt_bias)``, the gate ``z = P_z x``;
* the gated delta rule, per value head: ``S_t = S_{t-1} exp(g_t) (I - beta_t k_t k_t^T) + beta_t v_t k_t^T``,
  ``o_t = S_t q_t`` (transformers' ``torch_chunk_gated_delta_rule``, its chunked form, from a zero state);
* ``out = W_o (rmsnorm(o) * w * silu(z))`` (the gated RMS norm, ``norm`` or ``o_norm``; Qwen4-Exp's
  ``Qwen4ExpTextGatedDeltaNet`` the same with ``sigmoid(z)`` where its config's ``output_gate_type`` says so).

The rule. What the mixer computes from its input to weigh its values, ``q``, ``k``, ``beta`` and ``g``, is held
constant in the backward pass, as the attention weights are (rules.py): ``o`` is then a linear map of ``v`` (``S_t``
is linear in ``v_1..v_t`` once the others are numbers), a weighted sum whose ordinary backward is the linear rule
(Voita et al. 2019, App. A.2), and all of ``R(o)`` reaches ``v``. This is MambaLRP's principle (Jafari, Montavon,
Müller and Eberle 2024, "MambaLRP: Explaining Selective State Space Sequence Models", NeurIPS; its code,
github.com/FarnoushRJ/MambaLRP, ``mamba_lrp/model/mamba_huggingface.py``, detaches ``discrete_A``, ``discrete_B`` and
``C`` of Mamba's selective scan, the factors that weigh its input): the delta rule's decay ``exp(g)``, its
``beta``, keys and queries are the same kind of factor. Further, as MambaLRP: the SiLU after the convolution gets the
activation (identity) rule ``R(pre) = R(silu(pre))`` (its ``ModifiedAct(..., transform='identity')``), so the
convolution, a per-channel weighted sum over positions, and the value columns of the input projection pass ``R(v)``
on to ``x`` by their ordinary backward; the norm's ``w / rms(o)`` is held constant (its ``ModifiedMambaRMSNorm``,
AttnLRP's identity rule on normalisations). Where headlab differs: the multiplicative gate ``silu(z)`` is held
constant (LXT's CP-LRP, after Ali et al. 2022, as headlab holds the attention's output gates and the routing weights:
rules.py's docstring), so all of ``R(out)`` flows through ``o``; MambaLRP splits its gate's product half and half
(``(y / 2) + (y / 2).detach()``) and lets the gate's half flow on. The queries' and keys' channels of the shared
convolution carry no relevance (they are constants), and ``beta``'s and ``g``'s projections none either.

How. transformers calls the convolution and the recurrence as functions, not modules, so no hook can reach the
tensors between them. The rule keeps the projections' outputs (forward hooks) and, in the pre-hook of the gated norm,
recomputes ``o`` from them with the family's own recurrence (the modeling module's ``torch_chunk_gated_delta_rule``,
the function its forward called) on ``q``, ``k``, ``beta`` and ``g`` computed without a gradient and on ``v`` after the
activation rule; it checks, on every call, that this equals the ``o`` the forward computed, and gives ``o`` its
backward (``o.detach() + (o' - o'.detach())``: values bit for bit the forward's). The norm's forward hook holds its
factor ``output / o`` constant. A cached recurrent or convolution state from earlier tokens (``o`` is then no longer
the zero-state recurrence of this pass) fails the check and is refused. The forward's own graph from ``o`` back to the
projections is dropped (relevance flows through the recomputation only), at the cost of computing the recurrence twice.

Refused, naming why, before any work (:func:`_problem`): a class of this kind that is not one of the five read
(another layout), parts of other sizes, an activation or a convolution other than read, and a forward that, on a
probe, does not compute what this docstring says.

Precision: the recurrence and the norm compute in float32 (``.to(torch.float32)``); inside ``compute_lrp`` headlab's
``_KeptWide`` keeps a float64 model in float64 there too, so relevance is conserved to float64 rounding (``lrp_rules``
alone on a float64 model keeps those float32 steps: conserved to float32's). With flash-linear-attention installed,
transformers puts its kernel in ``torch_chunk_gated_delta_rule``'s place and the rule recomputes ``o`` with that
kernel, as the forward did (not tested here: no GPU, no such kernel).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from headlab.errors import HeadlabError
from headlab.importance.mixer_rules import Hook, MixerRule, register
from headlab.importance.rules import _activation_rule, _swap_backward

__all__ = ["LAYOUTS", "RULE", "DeltaRule", "Layout", "Recurrence", "delta_rule", "recompute"]


@dataclass(frozen=True)
class Layout:
    """Where one class of Gated DeltaNet keeps its parts (transformers 5.24)."""

    projections: tuple[str, ...]
    """Its input projections, in the order :func:`_split` reads their outputs."""
    norm: str
    """The gated RMS norm, called as ``norm(o, z)`` on ``[tokens x value heads, d_v]``."""
    out: str
    split: str
    """How the projections' outputs give ``(qkv, z, b, a)``: "qkvz" (Qwen3-Next's grouped ``in_proj_qkvz`` and
    ``in_proj_ba``, through its ``fix_query_key_value_ordering``), "qkv" (``in_proj_qkv``, ``in_proj_z``,
    ``in_proj_b``, ``in_proj_a``) or "separate" (OLMo-hybrid's q, k, v, g, b, a projections)."""


_QKV = Layout(("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"), "norm", "out_proj", "qkv")
LAYOUTS: dict[str, Layout] = {
    "Qwen3NextGatedDeltaNet": Layout(("in_proj_qkvz", "in_proj_ba"), "norm", "out_proj", "qkvz"),
    "Qwen3_5GatedDeltaNet": _QKV,
    "Qwen3_5MoeGatedDeltaNet": _QKV,
    "LaraMiniGatedDeltaNet": _QKV,
    "Qwen4ExpTextGatedDeltaNet": _QKV,  # its gated norm's activation silu or sigmoid (output_gate_type): _GATES
    "OlmoHybridGatedDeltaNet": Layout(("q_proj", "k_proj", "v_proj", "g_proj", "b_proj", "a_proj"), "o_norm",
                                      "o_proj", "separate"),
}
"""The Gated DeltaNet classes the rule was written for, by class name."""

_NAME = "Gated DeltaNet (Qwen3-Next, Qwen3.5, Qwen3.5-MoE, OLMo-hybrid, LaraMini, Qwen4-Exp)"
_SIZES = ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "key_dim", "value_dim", "conv_kernel_size")


def _matches(module: nn.Module) -> bool:
    """A Gated DeltaNet by its class: named ``...GatedDeltaNet``, with a decay ``A_log`` (any family's: one this rule
    was not written for is refused by :func:`_problem`, naming it)."""
    return type(module).__name__.endswith("GatedDeltaNet") and isinstance(getattr(module, "A_log", None), torch.Tensor)


def _split(module: nn.Module, kept: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                   torch.Tensor]:
    """``(qkv [batch, seq, 2 key_dim + value_dim], z [batch, seq, value_dim], b, a)`` from the projections' outputs,
    as the class's forward arranges them."""
    layout = LAYOUTS[type(module).__name__]
    if layout.split == "qkvz":
        query, key, value, z, b, a = module.fix_query_key_value_ordering(*kept)  # type: ignore[operator]
        batch, seq = kept[0].shape[:2]
        qkv = torch.cat([t.reshape(batch, seq, -1) for t in (query, key, value)], dim=-1)
        return qkv, z.reshape(batch, seq, -1), b, a
    if layout.split == "qkv":
        qkv, z, b, a = kept
        return qkv, z, b, a
    q, k, v, z, b, a = kept
    return torch.cat([q, k, v], dim=-1), z, b, a


def _sizes(module: nn.Module) -> dict[str, int]:
    return {name: getattr(module, name) for name in _SIZES}


def recompute(module: nn.Module, kept: list[torch.Tensor], rule: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, z)`` of ``module`` from its projections' outputs ``kept``: ``o`` as ``[batch x seq x value heads, d_v]``
    (what its forward hands the gated norm), recomputed with its own recurrence from a zero state. ``rule``: ``q``,
    ``k``, ``beta`` and ``g`` without a gradient and the activation rule on ``v`` (the LRP rule's backward);
    otherwise plainly (the probe's reference)."""
    qkv, z, b, a = _split(module, kept)
    s = _sizes(module)
    batch, seq = qkv.shape[:2]
    conv = cast(nn.Conv1d, module.conv1d)
    decay: Any = module  # A_log and dt_bias: parameters
    weight = conv.weight
    # transformers' causal_conv1d_fn (torch path): a depthwise convolution padded on both sides, cut to seq_len
    pre = F.conv1d(qkv.transpose(1, 2).to(weight.dtype), weight, conv.bias, padding=s["conv_kernel_size"] - 1,
                   groups=qkv.shape[-1])[:, :, :seq]
    act = _activation(module)
    post = _activation_rule(None, (pre,), act(pre)) if rule else act(pre)
    post = post.to(qkv.dtype).transpose(1, 2)
    width = 2 * s["key_dim"]
    with torch.no_grad() if rule else nullcontext():
        query, key = post[..., :s["key_dim"]], post[..., s["key_dim"]:width]
        beta = b.sigmoid()
        if getattr(module, "allow_neg_eigval", False):
            beta = beta * 2.0
        g = -decay.A_log.float().exp() * F.softplus(a.float() + decay.dt_bias)
    value = post[..., width:]
    if rule:
        query, key, beta, g = (t.detach() for t in (query, key, beta, g))
    delta_rule = _recurrence(module)
    o, _ = delta_rule(query.reshape(batch, seq, -1, s["head_k_dim"]), key.reshape(batch, seq, -1, s["head_k_dim"]),
                      value.reshape(batch, seq, -1, s["head_v_dim"]), g=g, beta=beta, initial_state=None,
                      output_final_state=False, use_qk_l2norm_in_kernel=True)
    return o.reshape(-1, s["head_v_dim"]), z.reshape(-1, s["head_v_dim"])


def _activation(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    from transformers.activations import ACT2FN

    return ACT2FN[module.activation]


def _recurrence(module: nn.Module) -> Callable[..., Any]:
    """The chunked gated delta rule the class's forward calls: its modeling module's ``torch_chunk_gated_delta_rule``
    (transformers' torch reference, or the kernel transformers put in its place)."""
    return sys.modules[type(module).__module__].torch_chunk_gated_delta_rule


# The gated norms' gate activations (``norm.activation``): SiLU in every family read, sigmoid too in Qwen4-Exp's
# (``output_gate_type``). Either is a constant factor of the rule, as the gate is held constant.
_GATES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": F.silu, "sigmoid": torch.sigmoid}


def _norm_factor(norm: Any, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """What the gated RMS norm multiplies ``o`` by: ``w / rms(o) * act(z)``, ``act`` its activation of :data:`_GATES`
    (in at least float32, as it computes)."""
    wide = torch.promote_types(o.dtype, torch.float32)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
    x = o.to(wide)
    return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm.weight.to(wide) * _GATES[norm.activation](z.to(wide))


# -- the check before any work ------------------------------------------------------------------------------------


def _problem(module: nn.Module, path: str) -> str | None:
    name = type(module).__name__
    layout = LAYOUTS.get(name)
    if layout is None:
        return (f"{name} is a Gated DeltaNet this rule was not written for (it knows {', '.join(LAYOUTS)}, read in "
                "transformers 5.24), so its layout and forward are unknown")
    sizes: dict[str, Any] = {n: getattr(module, n, None) for n in _SIZES}
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in sizes.values()):
        return f"its sizes are not all positive numbers ({', '.join(f'{n}={v!r}' for n, v in sizes.items())})"
    parts = [getattr(module, n, None) for n in (*layout.projections, layout.out)]
    if not all(isinstance(p, nn.Linear) for p in parts):
        return f"its {', '.join(layout.projections)} and {layout.out} are not all linear maps"
    conv, norm = getattr(module, "conv1d", None), getattr(module, layout.norm, None)
    width = 2 * sizes["key_dim"] + sizes["value_dim"]
    if not isinstance(conv, nn.Conv1d) or conv.groups != width or conv.in_channels != width \
            or conv.out_channels != width or conv.kernel_size != (sizes["conv_kernel_size"],):
        return f"its conv1d is not a depthwise convolution over the {width} query, key and value channels"
    if conv.bias is not None:  # none in the five classes read: its share would be kept by no measured bias probe
        return "its conv1d has a bias, whose share of the relevance headlab would not measure"
    if not isinstance(norm, nn.Module) or not isinstance(getattr(norm, "weight", None), torch.Tensor) \
            or getattr(norm, "activation", None) not in _GATES:
        return f"its {layout.norm} is not a gated RMS norm rmsnorm(o) * w * act(z), act one of {', '.join(_GATES)}"
    from transformers.activations import ACT2FN

    if getattr(module, "activation", None) not in ACT2FN:
        return f"its activation {getattr(module, 'activation', None)!r} is not one of transformers' activations"
    if not callable(getattr(sys.modules[type(module).__module__], "torch_chunk_gated_delta_rule", None)):
        return "its modeling module has no torch_chunk_gated_delta_rule (the recurrence its forward calls)"
    if not _computes(module, layout):
        return ("on a probe its forward does not compute out_proj(rmsnorm(o) * w * act(z)) with o the gated delta rule "
                "of silu(conv(q, k, v)) read in transformers 5.24, so the rule's recomputation would not be what "
                "it explains")
    return None


def _computes(module: nn.Module, layout: Layout) -> bool:
    """Whether ``module``'s own forward (under no_grad, no cache) on a random input equals the rule's recomputation
    (:func:`recompute`, the gated norm and the output projection); True where its weights are on the meta device
    (the rule checks ``o`` on every call)."""
    out = getattr(module, layout.out)
    weight = out.weight
    if weight.is_meta or not weight.is_floating_point():
        return True
    g = torch.Generator().manual_seed(0)
    hidden = getattr(module, "hidden_size", out.out_features)
    x = torch.randn((2, 5, hidden), generator=g, dtype=torch.float64).to(weight.device, weight.dtype)
    try:
        with torch.no_grad():
            output = type(module).forward(module, x)
            o, z = recompute(module, [getattr(module, n)(x) for n in layout.projections], rule=False)
            norm = getattr(module, layout.norm)
            expected = out((o * _norm_factor(norm, o, z)).to(o.dtype).reshape(2, 5, -1))
    except Exception:  # noqa: BLE001  # any failure: not the mixer the rule assumes
        return False
    if not isinstance(output, torch.Tensor) or output.shape != expected.shape:
        return False
    # a half-precision module rounds its steps apart from the formula's (bfloat16 keeps 3 digits): a tolerance of
    # 16 of its roundings, 1e-3 at least; a doubled output, another gate or norm are far outside either
    tolerance = max(1e-3, 16 * torch.finfo(output.dtype).eps)
    return torch.allclose(output, expected, rtol=tolerance, atol=tolerance * float(expected.abs().mean()))


# -- the hooks ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Recurrence:
    """What :class:`DeltaRule` needs of one kind of delta-rule mixer: its rule's ``name``, the ``projections`` whose
    outputs it keeps (in ``recompute``'s order), its gated ``norm``'s name, ``recompute(module, kept, rule)`` giving
    ``(o, z)`` as the forward hands them to the norm, ``norm_factor(norm, o, z)`` what the norm multiplies ``o`` by,
    and ``what`` the recurrence's name in a refusal."""

    name: str
    projections: tuple[str, ...]
    norm: str
    recompute: Callable[[nn.Module, list[torch.Tensor], bool], tuple[torch.Tensor, torch.Tensor]]
    norm_factor: Callable[[Any, torch.Tensor, torch.Tensor], torch.Tensor]
    what: str


class DeltaRule:
    """The hooks of one mixer: the projections' outputs kept, ``o``'s backward swapped in the gated norm's pre-hook,
    the norm's factor held constant in its forward hook (the Gated DeltaNet's, and KDA's: mixer_rules/kda.py)."""

    def __init__(self, module: nn.Module, recurrence: Recurrence) -> None:
        self.module = module
        self.recurrence = recurrence
        self.kept: dict[str, torch.Tensor] = {}
        self.o: torch.Tensor | None = None
        self.z: torch.Tensor | None = None

    def start(self, module, args):
        self.kept, self.o, self.z = {}, None, None

    def keeper(self, name: str):
        def keep(module, args, output):
            self.kept[name] = output

        return keep

    def _refuse(self, why: str) -> HeadlabError:
        return HeadlabError(f"LRP: {self.recurrence.name}: {type(self.module).__name__}: {why}; headlab's rule "
                            "recomputes o from the projections from a zero state (no cached state from earlier tokens)")

    def pre_norm(self, norm, args):
        o, z = args[0], args[1] if len(args) > 1 else None
        names, norm_name = self.recurrence.projections, self.recurrence.norm
        missing = [n for n in names if n not in self.kept]
        self.kept, kept = {}, [self.kept.get(n) for n in names]
        if missing or not isinstance(o, torch.Tensor) or not isinstance(z, torch.Tensor):
            raise self._refuse(f"its {norm_name} ran without its input projections' outputs "
                               f"{', '.join(missing) or ''} (or without o and the gate z)")
        recomputed, gate = self.recurrence.recompute(self.module, [t for t in kept if t is not None], True)
        with torch.no_grad():
            if recomputed.shape != o.shape or gate.shape != z.shape or not bool(torch.isfinite(o).all()) \
                    or not torch.allclose(recomputed.to(o.dtype), o, rtol=1e-4, atol=1e-6) \
                    or not torch.equal(gate.to(z.dtype), z):
                raise self._refuse(f"the o (or the gate z) its forward handed the gated norm is not the "
                                   f"{self.recurrence.what} of its projections")
        self.o, self.z = _swap_backward(o, recomputed.to(o.dtype)), z.detach()
        return (self.o, self.z, *args[2:])

    def after_norm(self, norm, args, output):
        o, z = self.o, self.z
        self.o = self.z = None
        norm_name = self.recurrence.norm
        if o is None or z is None or not isinstance(output, torch.Tensor) or output.shape != o.shape:
            raise self._refuse(f"cannot find the input of its {norm_name}")
        with torch.no_grad():
            factor = self.recurrence.norm_factor(norm, o, z)
            if not torch.allclose((o * factor).to(output.dtype), output, rtol=1e-3, atol=1e-5):
                raise self._refuse(f"its {norm_name} is not rmsnorm(o) * w * {norm.activation}(z)")
            # the factor the norm really applied (its own precision), so that o * factor == output
            nonzero = o != 0
            factor = torch.where(nonzero, output / torch.where(nonzero, o, torch.ones_like(o)), factor.to(output.dtype))
        return _swap_backward(output, o * factor)

    def hooks(self) -> list[Hook]:
        hooks: list[Hook] = [(self.module, "pre", self.start)]
        hooks += [(getattr(self.module, n), "forward", self.keeper(n)) for n in self.recurrence.projections]
        norm = getattr(self.module, self.recurrence.norm)
        return hooks + [(norm, "pre", self.pre_norm), (norm, "forward", self.after_norm)]


def delta_rule(module: nn.Module) -> DeltaRule:
    """The rule of one Gated DeltaNet (its class's :data:`LAYOUTS` entry)."""
    layout = LAYOUTS[type(module).__name__]
    return DeltaRule(module, Recurrence(_NAME, layout.projections, layout.norm, recompute, _norm_factor,
                                        "gated delta rule"))


def _hooks(module: nn.Module) -> list[Hook]:
    return delta_rule(module).hooks()


def _owns(module: nn.Module) -> list[nn.Module]:
    """The gated norm: its rule is this rule's (rules.py has none for a norm with a gate input)."""
    layout = LAYOUTS.get(type(module).__name__)
    norm = getattr(module, layout.norm, None) if layout is not None else None
    return [norm] if isinstance(norm, nn.Module) else []


RULE = register(MixerRule(name=_NAME, matches=_matches, problem=_problem, hooks=_hooks, owns=_owns))
