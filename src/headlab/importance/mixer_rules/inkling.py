"""The LRP rules for the parts of Inkling (``InklingForCausalLM``, model type ``inkling_text``) that rules.py's general
rules do not cover: its shared experts, the relative-position logits in its attention scores and its residual short
convolutions, declared as plugins of :mod:`headlab.importance.mixer_rules` (an :class:`~.ExpertsRule`, a
:class:`~.ScoreBiasRule` and a :class:`~.MixerRule`, at the end of this module).

transformers 5.24 (models/inkling/modeling_inkling.py) computes, in each decoder layer, for the stream ``h``::

    a = attn_sconv(attn(norm(h)))                      # sconv(u) = u + conv(u): depthwise, causal, in float32
    h = h + a
    m = mlp_sconv(moe(norm(h)))  (or a dense gated MLP)
    h = h + m
    attn(x):  scores = q k^T / d + rel_logits_proj(r_proj(x))  (+ mask), p = softmax(scores),
              out = o_proj(p @ v_sconv(v_proj(x))),  k = k_norm(k_sconv(k_proj(x))), q = q_norm(q_proj(x))
    moe(x):   experts(x, top-k, w) + shared_experts(x, gammas)     # w and gammas from the router InklingTopkRouter
    shared_experts(x, gammas) = sum_e gammas_e * down_e(act(gate_e x) * up_e x)   (bmm over stacked weights, the sum
                                                                                  over e in float32)

The rules, headlab's conventions (rules.py's docstring):

* the shared experts (``InklingSharedExperts``): each is a gated MLP with the activation rule on ``act`` and Ding et
  al.'s product rule on ``act(gate x) * up x`` (Voita et al. 2019, App. A.2); the router's ``gammas`` are held
  constant, as the routed experts' weights are (:func:`rules._experts_rule`) and as the attention weights are (the
  weights of a weighted sum, Voita et al. 2019, App. A); so all of the module's relevance reaches ``x``
  (:func:`shared_rule`). This is also MambaLRP's treatment of what a block computes from its input to weigh its
  values (Jafari, Montavon, Müller, Eberle, NeurIPS 2024, "MambaLRP: Explaining Selective State Space Sequence
  Models", Sec. 4; github.com/FarnoushRJ/MambaLRP, ``mamba_lrp/lrp/utils.py``: ``params_to_detach``), and LXT's CP-LRP
  (after Ali et al. 2022) for a multiplicative gate: detached, not split. The routed experts (``InklingExperts``,
  ``gate_up_proj`` and ``down_proj`` stacked) are transformers' usual layout: :func:`rules._experts_rule`'s;
* the relative-position logits (``InklingRelativeLogits``, ``rel_logits_proj``): a bias of the attention scores
  computed from the layer's input (``r_proj``), a factor of the attention weights like the queries and keys, so its
  output is detached with them (:func:`score_bias_hooks`); the log scaling ``tau`` depends on positions only. The
  attention is then ``o_proj(P @ values)`` with ``P`` constant, and its value path (``v_proj``, then ``v_sconv``) is
  linear: :func:`attention_problem` checks on a probe that the attention's backward under these hooks conserves;
* the short convolutions (``InklingShortConvolution``: ``attn_sconv``, ``mlp_sconv``, ``k_sconv``, ``v_sconv``)
  compute ``u + conv(u)``, depthwise, causal, no bias, padding positions of ``conv``'s input zeroed by a constant mask:
  linear in ``u``, so their ordinary backward is the linear rule and conserves; they need no hook, only a check that
  they compute that (:func:`short_conv_problem`; a convolution with a bias, added inside ``causal_conv1d_fn`` where
  lrp.py's probes cannot count what it keeps, is refused). Their float32 casts are widened in float64 runs by lrp.py's
  ``_KeptWide``, as the shared experts' float32 sum is;
* the normed embedding (``InklingNormedEmbedding``: RMS norm after the lookup) lies before the first layer, where
  relevance is counted (lrp.py's cut, the first layer's input): it needs no rule (rules.py's ``_looks_like_norm``
  does not take an embedding for a normalisation).

Refused before any work, naming the module and why: shared experts laid out otherwise (not ``gate_proj``/``up_proj``
``[experts, inner, hidden]`` and ``down_proj`` ``[experts, hidden, inner]``, no ``act_fn`` activation module) or whose
forward, on a probe, is not ``sum_e gammas_e down_e(act(gate_e x) * up_e x)``; a short convolution with a bias or
whose forward is not ``u + conv(u)``; an Inkling attention whose backward, under the rule's hooks, does not conserve on
a probe (its output reached through a factor of the scores that is not held constant).
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from headlab.errors import HeadlabError
from headlab.importance.mixer_rules import ExpertsRule, MixerRule, ScoreBiasRule, register

__all__ = ["attention_problem", "is_inkling_attention", "is_shared_experts", "is_short_conv", "score_bias_hooks",
           "shared_problem", "shared_rule", "shared_sum", "short_conv_problem"]

_STACKED = ("gate_proj", "up_proj", "down_proj")
_SCORE_BIASES = ("rel_logits_proj",)  # Inkling's relative-position logits, added to the attention scores
_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
               "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")


# -- the shared experts: sum_e gammas_e down_e(act(gate_e x) * up_e x), gammas held constant ---------------------------
def is_shared_experts(module: nn.Module) -> bool:
    """Experts held as three stacked 3-d weights ``gate_proj``, ``up_proj`` and ``down_proj`` and no ``gate_up_proj``,
    called with per-expert scales ``gammas`` (Inkling's ``InklingSharedExperts``); :func:`shared_problem` checks the
    rest."""
    return all(isinstance(getattr(module, name, None), torch.Tensor) and getattr(module, name).dim() == 3
               for name in _STACKED) and getattr(module, "gate_up_proj", None) is None \
        and "gammas" in _parameters(module)


def _parameters(module: nn.Module) -> list[str]:
    try:
        return list(inspect.signature(type(module).forward).parameters)
    except (TypeError, ValueError):
        return []


def shared_sum(module: Any, x: torch.Tensor, gammas: torch.Tensor, act, product) -> torch.Tensor:
    """``sum_e gammas_e down_e(product(act(gate_e x), up_e x))`` on ``x`` ``[..., hidden]``, ``gammas`` ``[..., n]``,
    in ``x``'s type: ``product`` ``a * b`` (plain) or Ding et al.'s rule, ``act`` the activation (with its rule's hook,
    or its plain ``forward``)."""
    flat, scales = x.reshape(-1, x.shape[-1]), gammas.reshape(-1, module.gate_proj.shape[0])
    out = torch.zeros_like(flat)
    for e in range(module.gate_proj.shape[0]):
        inner = product(act(F.linear(flat, module.gate_proj[e])), F.linear(flat, module.up_proj[e]))
        out = out + F.linear(inner * scales[:, e:e + 1].to(flat.dtype), module.down_proj[e])
    return out.view(x.shape)


def shared_problem(module: nn.Module) -> str | None:
    """Why the rule does not fit these shared experts (None: it does): the layout, the activation module and, on a
    random input, the forward."""
    from headlab.importance.rules import _is_activation

    gate, up, down = (getattr(module, name) for name in _STACKED)
    n, inner, hidden = gate.shape
    if tuple(up.shape) != (n, inner, hidden) or tuple(down.shape) != (n, hidden, inner):
        return ("headlab's rule for shared experts is for gate_proj and up_proj [experts, inner, hidden] and down_proj "
                "[experts, hidden, inner] (Inkling's); this module's stacked weights are not laid out so")
    act = getattr(module, "act_fn", None)
    if not isinstance(act, nn.Module) or not _is_activation(act):
        return "its shared experts have no act_fn activation module for the activation rule"
    if not _computes_shared(module, act):
        return ("its forward does not compute sum_e gammas_e down_e(act_fn(gate_e x) * up_e x) on a probe (Inkling's "
                "shared experts), so relevance would not be conserved")
    return None


def _computes_shared(module: Any, act: nn.Module) -> bool:
    """Whether ``module``'s own forward is :func:`shared_sum` on a random input and random gammas (widened to at least
    float32, as LRP computes it); True where it cannot run (weights on the meta device): :func:`shared_rule` checks
    its result on every call."""
    from headlab.importance.mixer_rules.probe import probing

    weight = module.gate_proj
    if weight.is_meta or not weight.is_floating_point():
        return True
    g = torch.Generator().manual_seed(0)
    n, _, hidden = weight.shape
    with probing(module):
        dtype = module.gate_proj.dtype
        x = torch.randn((2, 3, hidden), generator=g, dtype=torch.float64).to(weight.device, dtype)
        gammas = torch.rand((2, 3, n), generator=g, dtype=torch.float64).to(weight.device, dtype) + 0.5
        try:
            output = type(module).forward(module, x, gammas=gammas)
        except Exception:  # noqa: BLE001  # any failure: not the experts the rule assumes
            return False
        expected = shared_sum(module, x, gammas, act.forward, torch.mul)
    return isinstance(output, torch.Tensor) and output.shape == expected.shape \
        and torch.allclose(output, expected, rtol=1e-4, atol=1e-6)


def shared_rule(module: Any, args, kwargs, output):
    """The forward hook (with kwargs) of Inkling's shared experts: the output recomputed as :func:`shared_sum` with the
    activation rule (``act_fn``'s hook), the product rule and the gammas detached, checked against the module's own,
    and only its backward used."""
    from headlab.importance.rules import _check_finite, _product, _swap_backward

    given = dict(zip(("hidden_states", "gammas"), args)) | {k: v for k, v in kwargs.items()
                                                           if k in ("hidden_states", "gammas")}
    x, gammas = given.get("hidden_states"), given.get("gammas")
    if not isinstance(x, torch.Tensor) or not isinstance(gammas, torch.Tensor) or not isinstance(output, torch.Tensor):
        raise HeadlabError(f"LRP: {type(module).__name__} is not called as shared_experts(hidden_states, gammas); "
                           "headlab has no LRP rule for it")
    _check_finite(module, x)
    surrogate = shared_sum(module, x, gammas.detach(), module.act_fn, _product)
    with torch.no_grad():
        if surrogate.shape != output.shape or not torch.allclose(surrogate, output, rtol=1e-3, atol=1e-5):
            raise HeadlabError(f"LRP: {type(module).__name__} is not a sum of gated shared experts scaled by their "
                               "gammas (gammas_e down_e(act_fn(gate_e x) * up_e x)); headlab has no LRP rule for it")
    return _swap_backward(output, surrogate)


# -- the attention: the relative-position logits held constant with the queries and keys --------------------------------
def is_inkling_attention(core: nn.Module) -> bool:
    """An attention with relative-position logits added to its scores (Inkling's ``InklingAttention``)."""
    return any(isinstance(getattr(core, name, None), nn.Module) for name in _SCORE_BIASES)


def score_bias_hooks(core: nn.Module) -> list[tuple[nn.Module, Any]]:
    """(module, forward hook) pairs that detach the score biases of ``core`` (Inkling's ``rel_logits_proj``)."""
    from headlab.importance.rules import _detach_output

    return [(module, _detach_output) for name in _SCORE_BIASES
            if isinstance(module := getattr(core, name, None), nn.Module)]


def attention_problem(block: Any, hooks: list[tuple[nn.Module, Any]]) -> str | None:
    """Why the attention rule does not fit an Inkling attention (None: it does): on a random input, with the rule's
    ``hooks`` (queries, keys and score biases detached) on a float64 copy of the attention, its backward must conserve,
    ``sum(x * g) == sum(out * r)`` for ``g`` the gradient of ``sum(out * r)``: the attention is then linear in its
    input along the paths the backward takes, the attention weights constants. A factor of the scores left to the
    backward (a score bias computed from the input elsewhere) breaks it. None where it cannot run (meta weights)."""
    from headlab.capture import eager_attention
    from headlab.importance.lrp import _KeptWide

    core = block.core
    weight = next(core.parameters(), None)
    if weight is None or weight.is_meta:
        return None
    index = {id(module): name for name, module in core.named_modules()}
    wide = copy.deepcopy(core).to(torch.float64)  # one layer: its own rounding does not blur the check
    modules = dict(wide.named_modules())
    for module in modules.values():  # the copy runs none of the hooks the model's modules carry (a recorder's)
        for name in _HOOK_DICTS:
            getattr(module, name).clear()
    handles = [modules[index[id(module)]].register_forward_hook(hook) for module, hook in hooks if id(module) in index]
    g = torch.Generator().manual_seed(0)
    hidden = weight.shape[-1] if block.q is None else block.q.in_features
    x = (10 * torch.randn((1, 6, hidden), generator=g, dtype=torch.float64)).to(weight.device).requires_grad_(True)
    r = torch.randn((1, 6, hidden), generator=g, dtype=torch.float64).to(weight.device)
    try:
        with eager_attention(wide), torch.enable_grad(), _KeptWide(torch.float64):  # its float32 casts widened
            out = type(wide).forward(wide, x, attention_mask=None)
            out = out[0] if isinstance(out, tuple) else out
            target = (out * r).sum()
            (grad,) = torch.autograd.grad(target, x)
    except Exception as error:  # noqa: BLE001  # any failure: not the forward the rule was written for
        return f"its forward failed on a probe ({type(error).__name__}: {error})"
    finally:
        for handle in handles:
            handle.remove()
    reached, want = float((x.detach() * grad).sum()), float(target.detach())
    if abs(reached - want) > 1e-9 * max(1.0, abs(want)):
        return (f"on a probe, with its queries, keys and {', '.join(_SCORE_BIASES)} held constant, its backward does "
                f"not conserve ({reached:.6g} of {want:.6g} reached its input): its output depends on its input "
                "through another factor of the attention weights, or not linearly through its values")
    return None


# -- the short convolutions: u + conv(u), linear ------------------------------------------------------------------------
def is_short_conv(module: nn.Module) -> bool:
    """Inkling's ``InklingShortConvolution`` (a ``conv1d`` child and a forward taking ``conv_mask``; not Qwen4-Exp's PLE
    layer, which has them too beside its n-gram embedding: mixer_rules/hyper_connection.py)."""
    return isinstance(getattr(module, "conv1d", None), nn.Conv1d) and "conv_mask" in _parameters(module) \
        and not isinstance(getattr(module, "ple_embedding", None), nn.Module)


def short_conv_problem(module: nn.Module) -> str | None:
    """Why an Inkling short convolution is not ``u + conv(u)`` with ``conv`` depthwise, causal and bias-free, as the
    refusal says it; None where it is (checked on a random input; meta weights, no channel: None)."""
    from headlab.importance.mixer_rules.probe import probing

    conv = module.conv1d
    assert isinstance(conv, nn.Conv1d)
    width = conv.in_channels
    if conv.bias is not None:
        return ("its convolution has a bias, added inside causal_conv1d_fn where the module conv1d is never called, so "
                "the relevance the bias keeps cannot be counted and conservation cannot be checked")
    if conv.out_channels != width or conv.groups != width or conv.weight.shape[1] != 1:
        return f"its conv1d is not depthwise over {width} channels"
    if conv.weight.is_meta or not width:  # a layer pruned to no head keeps its k_sconv/v_sconv with no channel, unused
        return None
    g = torch.Generator().manual_seed(0)
    with probing(module):
        u = torch.randn((2, 5, width), generator=g, dtype=torch.float64).to(conv.weight.device, conv.weight.dtype)
        try:
            output = type(module).forward(module, u, cache=None, conv_mask=None)
        except Exception:  # noqa: BLE001  # any failure: not the convolution the rule assumes
            output = None
        kernel = conv.weight.shape[-1]
        expected = u + F.conv1d(F.pad(u.transpose(1, 2), (kernel - 1, 0)), conv.weight, groups=width).transpose(1, 2)
        expected = expected * _output_scale(module, kernel)
    if not isinstance(output, torch.Tensor) or output.shape != expected.shape \
            or not torch.allclose(output, expected.to(output.dtype), rtol=1e-4, atol=1e-6):
        formula = "(u + conv(u)) / sqrt(kernel + 1)" if type(module).__name__ in SCALED_SHORT_CONVS else "u + conv(u)"
        return (f"on a probe its forward is not {formula} (a depthwise causal convolution added to its input), the "
                "linear map whose ordinary backward conserves relevance")
    return None


SCALED_SHORT_CONVS = frozenset({"Inkling2ShortConvolution", "Inkling2LoopShortConvolution"})
"""Inkling2's (and Inkling2-Loop's) static short convolutions: Inkling's ``u + conv(u)`` divided by
``sqrt(kernel + 1)`` (transformers 5.24, ``Inkling2ShortConvolution.forward``), still linear in ``u``."""


def _output_scale(module: nn.Module, kernel: int) -> float:
    return (kernel + 1) ** -0.5 if type(module).__name__ in SCALED_SHORT_CONVS else 1.0


# The module-level functions are looked up at call time, so that a test may replace one.
SHARED_EXPERTS = register(ExpertsRule(
    name="Inkling's shared experts (gammas held constant, each expert a gated MLP)",
    matches=is_shared_experts, problem=lambda module: shared_problem(module),
    rule=lambda module, args, kwargs, output: shared_rule(module, args, kwargs, output)))

SCORE_BIASES = register(ScoreBiasRule(
    name="Inkling's relative-position logits (held constant with the queries and keys)",
    matches=is_inkling_attention, hooks=lambda core: score_bias_hooks(core),
    problem=lambda block, hooks: attention_problem(block, hooks)))

SHORT_CONVOLUTIONS = register(MixerRule(
    name="Inkling's residual short convolution", matches=is_short_conv,
    problem=lambda module, path: short_conv_problem(module), hooks=lambda module: []))
