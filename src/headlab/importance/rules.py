"""The LRP rules of Voita et al. 2019 (Appendix A), as a modified backward pass.

Appendix A of Voita et al. 2019 propagates relevance with the rules of Ding et al. 2017
(Sec. 3.2), the LRP variant used for neural machine translation. For a neuron ``v`` and its
incoming neurons ``u in IN(v)`` the *weight ratio* ``w_{u->v}`` is the share of ``v`` that
``u`` contributed, and relevance is redistributed as ``r_{u<-z} = sum_{v in OUT(u)} w_{u->v}
r_{v<-z}`` (Voita et al. 2019, App. A.2). The ratios are

* weighted sum ``v = sum_u W_uv u``:        ``w_{u->v} = W_uv u / v``;
* element-wise product ``v = prod_u u``:    ``w_{u->v} = u / sum_{u'} u'``;
* non-linear activation ``v = f(u)``:       ``w_{u->v} = 1`` (activations are ignored).

Each ratio family sums to one over ``IN(v)``, so relevance is conserved from layer to layer
(the sum of relevances at any cut through the network equals the explained logit), except for
what bias terms keep: a bias is an incoming neuron of its own (a constant), so it keeps its
share ``b / v``. On a bias-free model conservation is exact.

Gradient x input. Write every tensor's relevance as ``R(x) = x * g(x)``. For a weighted sum,
``R(u) = u * sum_v W_uv R(v) / v = u * sum_v W_uv g(v)``: the ordinary backward of a linear map.
The other rules become ordinary backward passes once the right factors are detached:

* activation ``y = f(x)``:       forward ``x * stop(f(x) / x)``, so ``R(x) = R(y)``;
* layer norm ``y = (x - mean(x)) * gamma / std(x) + beta``: ``gamma / std`` is detached, so the
  division by the standard deviation is a weight, not a neuron (the mean subtraction is a
  weighted sum and keeps its ordinary backward); RMS norms likewise detach ``gamma / rms``,
  with ``gamma`` the weight, one plus it (Gemma) or one (no weight, nor in OLMo's parameter-free
  layer norm); a family's own layer norm (Cohere's, in float32) gets the factor it really applied.
  This is AttnLRP's identity rule on normalisations (LXT, lxt/efficient/patches.py,
  ``layer_norm_forward``: ``(x - mean) / stop_gradient(std)``). An element-wise ``x * w + b`` named
  a norm (MobileBERT's ``NoNorm``) is a weighted sum: its ordinary backward. :func:`norm_rule` finds
  them by class (and, for a family's own classes, a probe of what they compute); any other
  normalisation is refused;
* a gated norm ``y * sigmoid(mlp(y))`` with ``y = norm(x)`` (A.X-K2's ``AXK2GatedRMSNorm``): the gate
  ``sigmoid(mlp(y))`` is held constant, ``mlp``'s output detached, so it is a per-feature weight of ``y``,
  as the attention's output gates and the routing weights below are (LXT's CP-LRP, after Ali et al. 2022,
  holds a gate constant likewise), and all of ``R`` reaches ``y``, whose norm has its rule (:class:`_GatedNorm`);
* element-wise product ``v = a * b`` of two neurons (gated MLPs): forward
  ``(a + b) * stop(a b / (a + b))``, so ``R(a) = a / (a + b) R(v)`` and ``R(b) = b / (a + b) R(v)``
  (LFM2's ``w2(silu(w1 x) * w3 x)``, SiLU a function call, gets the activation rule in a hook on ``w1``);
* per-layer inputs (Gemma 3n, Gemma 4: ``h + norm(W_p (act(W_g h) * p))``, ``p`` from the input embeddings and a
  per-layer token embedding): the product rule above, as for a gated MLP, ``R(p)`` reaching the input embeddings
  through ``per_layer_model_projection`` and the per-layer token embedding, an input of its own that lrp.py counts
  with them (:class:`_PerLayerInputProduct`, where the choice of rule is argued);
* alternating updates (Gemma 3n's AltUp: several residual streams mixed by coefficients its router computes from
  them): the router's output detached, so predict and correct are weighted sums of the streams, and the magnitude
  ratios that make and put back the streams held constant as an RMS norm's (:class:`_AltUpStreams`); Gemma 3n's
  activation sparsity ``relu(x - mean(x) - z std(x))`` keeps its ordinary backward, exact by Euler's theorem as it is
  positively homogeneous of degree one (:func:`_sparsity_is_homogeneous`);
* GPT-OSS's clamped SwiGLU ``(clamp(up) + 1) * glu(clamp(gate))`` (its experts, MiniMax-M3's experts
  and dense MLPs): the activation rule through the clamps and ``glu``, the product as ``u * glu + glu``
  (weighted sum, then the product rule), so the ``+ 1`` keeps no relevance (:func:`_clamped_swiglu`);
* clamps without GPT-OSS's alpha and ``+ 1``, ``act(clamp(gate, max=l)) * clamp(up, -l, l)`` (HY-V4's, GLM-5-Next's,
  DeepSeek-V4's experts and MLPs) or ``clamp(act(gate), max=l) * clamp(up, -l, l)`` (Step-3.7's): the identity
  rule at each clamp (:class:`_ClampIdentity`), the activation and product rules (:func:`_clamped_gate_rule`,
  :func:`_dense_clamp`);
* Inkling2's softcapped SwiGLU ``softcap(gate) sigmoid(gate) * softcap(up)`` (``softcap(x) = c tanh(x / c)``, its
  experts' ``Inkling2SoftcappedSwiGLU``): the activation rule on each factor, a function of one neuron, and the product
  rule (:func:`_softcapped_rule`);
* mixture of experts ``sum_k w_k E_k(x)`` (transformers' experts held as 3-d weights: Mixtral, Qwen-MoE,
  DeepSeek-V3, GPT-OSS, Aria, MiniMax-M3, Llama 4, LFM2-MoE (SiLU a function call, probed: :class:`_CalledSilu`); DBRX's
  in three 2-d matrices): each expert is a gated MLP
  with the rules above (or LongCat-Flash's identity experts, ``E_k(x) = x``), and the routing weights ``w_k`` are
  detached (Llama 4's router scores, which scale the experts' input, likewise), constants as the attention weights
  below are (:func:`_experts_rule`); Nemotron-H's non-gated experts ``E_k(x) = down_k(act(up_k x))`` get the
  activation rule on ``act`` and weighted sums otherwise (:func:`_non_gated_rule`); Inkling's shared experts
  ``sum_e gamma_e E_e(x)`` (stacked ``gate_proj``, ``up_proj``, ``down_proj``) each a gated MLP, the router's ``gammas``
  detached (:mod:`headlab.importance.mixer_rules.inkling`);
* attention: the output of a head is ``sum_k p_qk v_k``, a weighted sum of the value vectors
  with the attention weights ``p`` as its weights (the attention weights are weights of the
  weighted sum, as Ding et al. treat the attention of RNNsearch). Query and key projections are
  detached, so ``p`` is a constant of the backward pass and all relevance flows through values
  and residual connections. (The original TF code calls this mode ``consider_attn_constant``.)
  A gate on the heads' outputs projected with the queries (Qwen3-Next's and Qwen3.5's
  ``attn_output * sigmoid(gate)``, ``gate`` from q_proj beside the query) is held constant with
  them: a per-feature weight of the heads' outputs, so all of ``R(v)`` flows back through the values
  (as LXT's CP-LRP variant, after Ali et al. 2022, holds a gate constant: its ``cp_gated_mlp_forward``
  stops the gradient through it; AttnLRP's uniform product rule would send half of ``R`` to the gate,
  which headlab detaches with the query, and lose it). Beam's gate from a projection of its own
  (``sigmoid(gate_proj(x) + gate_bias)``, ``adapters.families.QKV_OUTPUT_GATES``) is held constant
  likewise: ``gate_proj``'s output is detached (AFMoE's ``gate_proj``, Laguna's and LFM3's ``g_proj`` too).
  Multi-head latent attention (DeepSeek-V2/V3 and the types of ``adapters.families.LATENT_ATTENTION``) has no key
  projection of its own: its queries' projection, the rotary columns of ``kv_a_proj_with_mqa`` (one rotary key for
  all heads) and the ``k_nope`` columns of ``kv_b_proj`` (per head ``[k_nope | v]``) are detached, so ``p`` is a
  constant there too and relevance flows through ``v`` (:func:`_latent_attention_hooks`).
  Zamba 2's attention adapters (``q = q_proj(x) + A_q(x)``, ``k`` and ``v`` alike: ``adapters.families.QKV_ADAPTERS``)
  are head rows: the query and key adapters are detached with ``q_proj`` and ``k_proj``, the value adapters are values
  (``Family.head_row_values``), so ``v_proj(x) + A_v(x)``, linear in ``x``, passes relevance through both.
  A fused projection's query and key columns are detached wherever its layout puts them. DBRX and MPT clamp its
  output to ``clip_qkv``, OLMo and OLMoE each projection's (``adapters.families.CLIPPED_QKV``), an element-wise
  function of each value: the activation rule, ``R(v) = R(clamp(v))`` (:class:`_ClampIdentity`; the clamp's own
  gradient, 0 where it clips, lost that relevance), the model's own clamp after it passing the gradient on its closed
  interval (:class:`_ClosedClamps`: torch 2.14 made it 0 at the bounds). ZAYA's compressed convolutional attention
  (queries and keys convolved over time and mixed across a group, values ``[v_proj_current(x_t) |
  v_proj_delayed(x_{t-1})]``): its projection's query and key outputs detached, the values a linear path
  (:mod:`headlab.importance.cca_rule`).
  Inkling's relative-position logits, a bias of the scores computed from the layer's input (``rel_logits_proj``), are
  detached with the queries and keys; its residual short convolutions ``u + conv(u)`` are linear
  (:mod:`headlab.importance.mixer_rules.inkling`). Inkling2's sinks, relative position bias and output gate, head rows
  of its attention, are detached with the queries; its block attention residuals (attention over depth), dynamic
  key/value convolutions and Inkling2-Loop's message gates hold their weights, taps and gates constant
  (:mod:`headlab.importance.mixer_rules.inkling2`).

* a map of each head's output between the attention function and the output projection
  (``adapters.families.HEAD_MAPS``: NeoMME's exclusive self-attention, ``y_i = o_i - tanh(alpha_h) (o_i . v^_i) v^_i``
  with ``v^_i`` the unit vector of position i's own value): ``v^`` is held constant, as the attention weights and the
  output gates are, so ``y_i = (I - tanh(alpha_h) v^_i v^_i^T) o_i`` is a weighted sum of the head's output and all
  of its relevance reaches ``o`` (:mod:`headlab.importance.head_map_rule`); a map without a rule is refused before any
  work. NeoMME's value embeddings, added to some layers' values, are an input of their own, counted with the input
  embeddings (:func:`per_layer_embeddings`).

* token mixers beside the attention (state-space models, delta rules, gated convolutions of hybrid models): the
  rules of :mod:`headlab.importance.mixer_rules`, one plugin per kind of mixer, which hold the factors a mixer
  computes from its input constant as the attention weights are; a mixer none of them matches is refused.

* DeepSeek-V4's attention (one key-value head that is both key and value; compressed entries appended to the keys; an
  indexer; each head's output rotated back): queries detached, keys held constant inside its eager attention, the
  values not, the compressor's softmax weights held constant (:mod:`headlab.importance.shared_kv_rule`).

* several residual streams mixed by weights computed from them (hyper-connections: HY-V4, Qwen4-Exp, GLM-5-Next,
  DeepSeek-V4; Qwen4-Exp's n-gram embeddings added to them): their weights held constant
  (:mod:`headlab.importance.mixer_rules.hyper_connection`); others refused before any work, naming them
  (:mod:`headlab.importance.residual_streams`).

:func:`lrp_rules` installs these rules as forward hooks that leave every forward value
bit-for-bit unchanged (``y.detach() + (z - z.detach())``) and only reshape the backward. Inside
it, ``torch.autograd.grad`` returns the modified gradient ``g``, and ``x * g`` is the relevance
of ``x``. All hooks are removed in ``finally``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from headlab.adapters import AttentionBlock, attention_blocks, out_features
from headlab.adapters.families import CLIPPED_QKV, FUSED_REFUSED, OUTPUT_GATES, VALUE_EMBEDDINGS
from headlab.capture import HookHandles
from headlab.compiled import recompiling
from headlab.errors import HeadlabError
from headlab.importance import cca_rule, mixer_rules, shared_kv_rule
from headlab.importance.head_map_rule import head_map_hooks, head_map_problem
from headlab.importance.residual_streams import residual_stream_problem
from headlab.stored_weights import HINT, describe, stored_elsewhere_modules
from headlab.surgery import head_row_modules

__all__ = ["adapted_gated_mlps", "altup_inputs", "altup_models", "called_gated_mlps", "check_rules", "clamped_gated_mlps",
           "expert_bias_probes", "fused_gated_mlps", "gated_mlps",
           "lrp_rules", "never_run", "norm_rule", "per_layer_embeddings", "per_layer_input_layers", "register_hooks",
           "relevance", "routed_expert_rows", "routed_experts"]


def _activation_classes() -> tuple[type, ...]:
    from transformers.activations import ACT2CLS

    classes: set[type] = {
        nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Mish, nn.ELU, nn.LeakyReLU, nn.Sigmoid,
        nn.Hardswish, nn.ReLU6, nn.Softplus, nn.SELU, nn.CELU, nn.Hardtanh,
    }
    for value in ACT2CLS.values():
        classes.add(cast(type, value[0] if isinstance(value, tuple) else value))
    return tuple(classes)


_ACTIVATIONS = _activation_classes()
# Element-wise activations a family defines as its own module class, outside ACT2CLS.
_NAMED_ACTIVATIONS = ("BloomGelu",)


def _is_activation(module: nn.Module) -> bool:
    return isinstance(module, _ACTIVATIONS) or type(module).__name__ in _NAMED_ACTIVATIONS


def relevance(tensor: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Relevance of each neuron of ``tensor`` given its modified gradient: ``x * g``."""
    return tensor.detach() * grad


def _swap_backward(output: torch.Tensor, surrogate: torch.Tensor) -> torch.Tensor:
    """``output``'s value with ``surrogate``'s backward (``surrogate`` equals ``output``)."""
    return output.detach() + (surrogate - surrogate.detach())


# -- the rules, one hook each ---------------------------------------------------------------
def _activation_rule(module: nn.Module | None, args, output):
    """Non-linear activations are ignored: R(x) = R(f(x)) (Ding et al. 2017; Voita et al. 2019, App. A.2)."""
    x = args[0]
    if not isinstance(output, torch.Tensor) or output.shape != x.shape:
        raise HeadlabError(f"LRP: activation {type(module).__name__} changes its input's shape")
    with torch.no_grad():
        ratio = torch.where(x != 0, output / torch.where(x != 0, x, torch.ones_like(x)), torch.zeros_like(x))
    return _swap_backward(output, x * ratio)


def _layer_norm_rule(module: nn.LayerNorm, args, output):
    """(x - mean) is a weighted sum; gamma / std is a detached weight (so the norm passes
    relevance through unchanged on a bias-free model)."""
    x = args[0]
    if len(module.normalized_shape) != 1:
        raise HeadlabError("LRP: layer norms over more than the last dimension are not supported")
    # x - mean(x), written so that its backward is one reduction and one add (no full-size
    # negation or division): the mean is a small [..., 1] tensor until it is broadcast.
    centered = x + x.sum(-1, keepdim=True) * (-1.0 / x.shape[-1])
    with torch.no_grad():
        scale = torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + module.eps)
        if module.weight is not None:
            own = type(module).forward is not nn.LayerNorm.forward
            scale = scale * (_applied_weight(module, centered, scale, output) if own else module.weight)
    return _swap_backward(output, centered * scale)


def _applied_weight(module: nn.LayerNorm, centered: torch.Tensor, scale: torch.Tensor,
                    output: torch.Tensor) -> torch.Tensor:
    """The gamma a LayerNorm subclass with a forward of its own really applied: its weight, or one
    plus it (Nemotron's ``LayerNorm1P``); any other formula is refused (its factor is not known)."""
    _check_finite(module, centered)
    bias = 0 if module.bias is None else module.bias
    for gamma in (module.weight, 1 + module.weight):
        if torch.allclose(centered * scale * gamma + bias, output, rtol=1e-3, atol=1e-5):
            return gamma
    raise HeadlabError(f"LRP: {type(module).__name__} is not (x - mean(x)) / std(x) times its weight (or one plus "
                       "it) plus its bias; headlab has no LRP rule for it")


def _own_layer_norm_rule(module: nn.Module, args, output):
    """A layer norm of a family's own class (OLMo's ``OlmoLayerNorm`` without parameters, Cohere's
    ``CohereLayerNorm``: a weight, no bias, computed in float32): as :func:`_layer_norm_rule`, the
    identity rule of AttnLRP (``1 / std`` held constant: LXT's ``layer_norm_forward``,
    lxt/efficient/patches.py), with the factor the module really applied (its own eps and precision),
    so that ``centered * factor`` is its output less its bias."""
    x = args[0]
    centered = x + x.sum(-1, keepdim=True) * (-1.0 / x.shape[-1])
    with torch.no_grad():
        _check_finite(module, x)
        gamma = _layer_norm_gamma(module, x, output)
        if gamma is False:
            raise HeadlabError(f"LRP: {type(module).__name__} is not (x - mean(x)) / std(x) times its weight (or one "
                               "plus it) plus its bias; headlab has no LRP rule for it")
        bias = getattr(module, "bias", None)
        unbiased = output if bias is None else output - bias.to(output.dtype)
        wide = torch.promote_types(x.dtype, torch.float32)
        scale = torch.rsqrt(centered.to(wide).pow(2).mean(-1, keepdim=True) + _norm_eps(module, 1e-5))
        scale = (scale if gamma is None else scale * gamma).to(output.dtype).expand_as(output)
        nonzero = centered != 0
        scale = torch.where(nonzero, unbiased / torch.where(nonzero, centered, torch.ones_like(centered)), scale)
    return _swap_backward(output, centered * scale)


def _norm_eps(module: nn.Module, default: float) -> float:
    return getattr(module, "variance_epsilon", getattr(module, "eps", default))


def _layer_norm_gamma(module: nn.Module, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor | None | bool:
    """The gamma with which ``module`` computed ``output = (x - mean(x)) / std(x) * gamma + bias`` from
    ``x`` (in at least float32, as Cohere's norm does): its weight, one plus it, or None (no weight);
    False when it computed something else."""
    wide = torch.promote_types(x.dtype, torch.float32)
    centered = x.to(wide) - x.to(wide).mean(-1, keepdim=True)
    normed = centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + _norm_eps(module, 1e-5))
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    shift = 0 if not isinstance(bias, torch.Tensor) else bias.to(wide)
    gammas = [None] if not isinstance(weight, torch.Tensor) else [weight.to(wide), 1 + weight.to(wide)]
    for gamma in gammas:
        expected = (normed if gamma is None else normed * gamma) + shift
        if expected.shape == output.shape and torch.allclose(expected.to(output.dtype), output, rtol=1e-3, atol=1e-5):
            return gamma
    return False


def _affine_rule(module: nn.Module, args, output):
    """An element-wise affine map ``x * w + b`` named a norm (MobileBERT's ``NoNorm``: no statistics): a
    weighted sum of one input per output, whose ordinary backward is the linear rule (Voita et al. 2019,
    App. A.2; the bias keeps its share). Checked on every call; the output is left as it is."""
    x = args[0]
    with torch.no_grad():
        _check_finite(module, x)
        if not _is_affine_output(module, x, output):
            raise HeadlabError(f"LRP: {type(module).__name__} is not x * weight + bias; headlab has no LRP rule for it")


def _is_affine_output(module: nn.Module, x: torch.Tensor, output: torch.Tensor) -> bool:
    weight, bias = cast(torch.Tensor, module.weight), cast(torch.Tensor, module.bias)
    expected = x * weight + bias
    return isinstance(output, torch.Tensor) and expected.shape == output.shape \
        and torch.allclose(expected, output, rtol=1e-3, atol=1e-5)


def _check_finite(module: nn.Module, x: torch.Tensor) -> None:
    """A norm's check of its formula fails on NaN: say so, rather than that the formula differs."""
    if not bool(torch.isfinite(x).all()):
        raise HeadlabError(f"LRP: the model's forward is not finite in {str(x.dtype).removeprefix('torch.')}: "
                           f"NaN or infinity reached {type(module).__name__}")


def _rms_norm_rule(module: nn.Module, args, output):
    """RMS norms: x times a detached gamma / rms(x), with gamma the weight (T5, mT5, Llama, Qwen),
    one plus the weight (Gemma's ``x * (1 + w)``) or one (no weight); or scaled first, x times a detached
    gamma / rms(gamma x) (Muse Spark's ``MuseSparkTextInputScaledRMSNorm``: ``norm(x * (1 + w))``)."""
    x = args[0]
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))
    weight = getattr(module, "weight", None)
    with torch.no_grad():
        _check_finite(module, x)
        wide = torch.promote_types(x.dtype, torch.float32)  # as the norms compute it: at least fp32
        rms = torch.rsqrt(x.to(wide).pow(2).mean(-1, keepdim=True) + eps)
        gammas = [None] if not isinstance(weight, torch.Tensor) else [weight.to(wide), 1 + weight.to(wide)]
        factors = [rms if gamma is None else rms * gamma for gamma in gammas]
        factors += [gamma * torch.rsqrt((x.to(wide) * gamma).pow(2).mean(-1, keepdim=True) + eps)
                    for gamma in gammas if gamma is not None]
        for factor in factors:
            factor = factor.to(output.dtype).expand_as(output)
            if torch.allclose(x * factor, output, rtol=1e-3, atol=1e-5):
                break
        else:
            raise HeadlabError(
                f"LRP: {type(module).__name__} is not x / rms(x) times its weight (or one plus it), nor that of x "
                "scaled by it first; "
                "headlab has no LRP rule for it"
            )
        # The factor the module really applied (its own precision), so that x * factor == output.
        nonzero = x != 0
        factor = torch.where(nonzero, output / torch.where(nonzero, x, torch.ones_like(x)), factor)
    return _swap_backward(output, x * factor)


def _is_rms_norm(module: nn.Module) -> bool:
    """RMS norms by class: torch's, transformers' ``...RMSNorm``, the T5 family's ``...T5LayerNorm`` and Llama 4's
    query/key ``Llama4TextL2Norm`` (``x * rsqrt(mean(x^2) + eps)``, no weight: RMS norms under other names), and a
    ``...LayerNorm`` that a probe shows to be one (:func:`_probes_as_rms_norm`); :func:`_rms_norm_rule` checks the
    formula on every call."""
    name = type(module).__name__
    if next(module.children(), None) is not None and next(module.parameters(recurse=False), None) is None:
        return False  # a module around other modules (a gated norm, _is_gated_norm): judged by what it holds
    return isinstance(module, getattr(nn, "RMSNorm", ())) or name.endswith(("RMSNorm", "T5LayerNorm", "TextL2Norm")) \
        or _probes_as_rms_norm(module)


def _probes_as_rms_norm(module: nn.Module) -> bool:
    """T5's RMS norm copied under a ``...LayerNorm`` name (transformers 5.24: Switch Transformers', Pop2Piano's,
    Pix2Struct's, UDOP's ``x * rsqrt(mean(x^2) + eps)`` times ``weight``, no mean subtracted, no bias): a weight of
    its own and nothing else, and, on a probe, that formula. Switch Transformers' LRP was refused ("no rule for the
    normalisation module SwitchTransformersLayerNorm") until session 41."""
    if not type(module).__name__.endswith("LayerNorm") or _own_parameters(module) != {"weight"}:
        return False
    probe = _probe(module)
    if probe is None:
        return False  # the meta device: the layer-norm rule's own check on every call decides
    x, output = probe
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))
    weight = cast(torch.Tensor, module.weight)
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.to(x.dtype)
    return isinstance(output, torch.Tensor) and output.shape == expected.shape \
        and torch.allclose(output.to(x.dtype), expected, rtol=1e-3, atol=1e-5)


_NORMED_SUBLAYERS = frozenset({"ConvDropoutLayerNorm"})
"""Classes named a norm that are a sublayer ending in one, no gated norm: SqueezeBERT's ``ConvDropoutLayerNorm``
(transformers 5.24: ``layernorm(dropout(conv1d(x)) + input_tensor)``, a 1x1 convolution, the residual and its
``SqueezeBertLayerNorm``), each part under its own rule (the convolution a weighted sum, the norm's rule)."""


def _is_gated_norm(module: nn.Module) -> bool:
    """A normalisation by name, with no parameters of its own, that holds a norm and a module that is none (A.X-K2's
    ``AXK2GatedRMSNorm``: ``norm`` and ``mlp``, ``y * sigmoid(mlp(y))`` with ``y = norm(x)``). The family's name is
    no part of it, as in :func:`_looks_like_norm` (``RobertaPreLayerNormModel`` holds a LayerNorm and its layers)."""
    name = type(module).__name__.lower().removeprefix(_family_prefix(module))
    if "norm" not in name or next(module.parameters(recurse=False), None) is not None \
            or type(module).__name__ in _NORMED_SUBLAYERS:
        return False
    children = list(module.children())
    norms = [child for child in children if _is_rms_norm(child) or isinstance(child, nn.LayerNorm)]
    return bool(norms) and len(norms) < len(children)


def _gated_norm_parts(module: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """``(norm, mlp)`` of a gated norm laid out as A.X-K2's (children ``norm``, a norm with a rule, and ``mlp``),
    None for any other module (another gated norm is refused: :func:`_module_problem`)."""
    if not _is_gated_norm(module):
        return None
    norm, mlp = getattr(module, "norm", None), getattr(module, "mlp", None)
    if not isinstance(mlp, nn.Module) or not isinstance(norm, nn.Module) \
            or not (_is_rms_norm(norm) or isinstance(norm, nn.LayerNorm)):
        return None
    return norm, mlp


def _gated(y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``AXK2GatedRMSNorm.forward``'s product (transformers 5.24): ``y * sigmoid(gate)``, the gate in float32."""
    return (y * torch.sigmoid(gate.float())).to(y.dtype)


def _computes_gated_norm(module: nn.Module) -> bool:
    """Whether ``module``'s own forward is ``y * sigmoid(mlp(y))`` with ``y = norm(x)`` on a random input (under
    no_grad), so that another formula is refused before any work; True where it cannot run (weights on the meta
    device): :class:`_GatedNorm` checks the product on every call."""
    parts = _gated_norm_parts(module)
    assert parts is not None
    norm, mlp = parts
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.is_meta or not weight.is_floating_point():
        return True
    g = torch.Generator().manual_seed(0)
    x = torch.randn((2, 3, *weight.shape), generator=g, dtype=torch.float64).to(weight.device, weight.dtype)
    with torch.no_grad():
        try:
            output = type(module).forward(module, x)
            y = norm(x)
            expected = _gated(y, mlp(y))
        except Exception:  # noqa: BLE001  # any failure: not the gated norm the rule assumes
            return False
    return isinstance(output, torch.Tensor) and output.shape == expected.shape \
        and torch.allclose(output, expected, rtol=1e-3, atol=1e-5)


class _GatedNorm:
    """The rule for a gated norm ``y * sigmoid(mlp(y))``, ``y = norm(x)`` (A.X-K2's ``AXK2GatedRMSNorm``): ``mlp``'s
    output is detached, so the gate is a constant weight of ``y`` (as the output gates and routing weights are,
    this module's docstring) and ``R(y) = R(output)``; ``norm`` has its own rule. The output is checked, on every
    call, to be that product of the ``y`` and gate it kept (a module found by names other norms might use too)."""

    def __init__(self) -> None:
        self.y: torch.Tensor | None = None
        self.gate: torch.Tensor | None = None

    def keep_y(self, module, args, output):
        self.y = output

    def keep_gate(self, module, args, output):
        self.gate = output.detach()
        return self.gate

    def after(self, module, args, output):
        y, gate = self.y, self.gate
        self.y = self.gate = None
        with torch.no_grad():
            if y is None or gate is None or not isinstance(output, torch.Tensor) or y.shape != output.shape \
                    or not torch.allclose(_gated(y, gate), output, rtol=1e-3, atol=1e-5):
                raise HeadlabError(f"LRP: the output of {type(module).__name__} is not y * sigmoid(mlp(y)) with "
                                   "y = norm(x); headlab has no LRP rule for this gated normalisation")


def _is_parameter_free_layer_norm(module: nn.Module) -> bool:
    return (type(module).__name__.endswith("LayerNorm") and hasattr(module, "normalized_shape")
            and next(module.parameters(), None) is None)


def _own_parameters(module: nn.Module) -> set[str] | None:
    """The names of a leaf module's own parameters (None: it holds other modules)."""
    if next(module.children(), None) is not None:
        return None
    return {name for name, _ in module.named_parameters(recurse=False)}


def _probe(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(x, module(x))`` on a random ``x`` shaped ``[2, *weight.shape]`` (the module's own forward, no hooks,
    under no_grad), so that what a norm computes is known before any work; None where it cannot run (weights on
    the meta device, no weight): its rule then checks the formula on every call."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.is_meta or not weight.is_floating_point():
        return None
    g = torch.Generator().manual_seed(0)
    # at least float32: a bfloat16 model's norm computing in float32 (Cohere's) would round apart from the formula
    wide = torch.promote_types(weight.dtype, torch.float32)
    x = (torch.randn((2, *weight.shape), generator=g, dtype=torch.float64) * 2 + 0.5).to(weight.device, wide)
    try:
        with torch.no_grad():
            output = type(module).forward(module, x)
    except Exception:  # noqa: BLE001  # any failure: not the element-wise module the rules assume
        return x, torch.full_like(x, torch.nan)
    return x, output


def _is_own_layer_norm(module: nn.Module) -> bool:
    """A family's layer norm of its own class (Cohere's ``CohereLayerNorm``: ``(x - mean) / std * weight``
    in float32, no bias): named ``...LayerNorm``, a weight (and a bias) of its own and nothing else, and, on a
    probe, that formula (with its weight or one plus it). A class so named that computes something else (T5's
    copies, RMS norms under that name) is not one: refused as a normalisation without a rule."""
    names = _own_parameters(module)
    if not type(module).__name__.endswith("LayerNorm") or names is None or not {"weight"} <= names <= {"weight", "bias"}:
        return False
    probe = _probe(module)
    if probe is None:
        return True
    x, output = probe
    return _layer_norm_gamma(module, x, output) is not False


def _is_affine_norm(module: nn.Module) -> bool:
    """An element-wise affine map named a norm (MobileBERT's ``NoNorm``: ``x * weight + bias``, no
    statistics): a weight and a bias of its own and, on a probe, that formula."""
    if _own_parameters(module) != {"weight", "bias"} or not _looks_like_norm(module):
        return False
    probe = _probe(module)
    return probe is None or _is_affine_output(module, *probe)


def _family_prefix(module: nn.Module) -> str:
    """The lower-cased family name transformers' classes of ``module``'s module start with
    (``robertaprelayernorm`` for ``transformers.models.roberta_prelayernorm``), '' elsewhere."""
    parts = type(module).__module__.split(".")
    return parts[2].replace("_", "") if len(parts) > 3 and parts[:2] == ["transformers", "models"] else ""


def _looks_like_norm(module: nn.Module) -> bool:
    """A normalisation by its class name, with or without parameters (OLMo's has none); a
    module that only holds other modules (StableLM's per-head norms) is judged by its children.
    The family's name is no part of it (RoBERTa-PreLayerNorm's ``RobertaPreLayerNormLMHead``). An embedding is none
    (Inkling's ``InklingNormedEmbedding``, an RMS norm after the lookup, which has its rule): it reads token ids, and
    relevance is counted at or after its output (lrp.py's cut, the first layer's input), never inside it."""
    if isinstance(module, nn.Embedding):
        return False
    name = type(module).__name__.lower()
    name = name.removeprefix(_family_prefix(module))
    if "norm" not in name:
        return False
    holds_only_modules = next(module.children(), None) is not None and next(module.parameters(recurse=False), None) is None
    return not holds_only_modules


CHANNELS_FIRST_NORMS = frozenset({"SqueezeBertLayerNorm"})
"""Layer norms over dimension 1 of ``[batch, channels, seq]``: SqueezeBERT's ``SqueezeBertLayerNorm`` (transformers
5.24: an ``nn.LayerNorm`` whose forward permutes to ``[batch, seq, channels]``, normalises and permutes back)."""


def _channels_first_layer_norm_rule(module: nn.Module, args, output):
    """:func:`_layer_norm_rule` on the channels-last view of a :data:`CHANNELS_FIRST_NORMS` norm's input and output."""
    x = args[0]
    if not isinstance(output, torch.Tensor) or x.dim() != 3 or output.shape != x.shape:
        raise HeadlabError(f"LRP: {type(module).__name__} is not a layer norm over dimension 1 of [batch, channels, seq]")
    return _layer_norm_rule(cast(nn.LayerNorm, module), (x.transpose(1, 2),), output.transpose(1, 2)).transpose(1, 2)


def is_paired_layer_norm(module: nn.Module) -> bool:
    """I-BERT's ``IntLayerNorm`` with quant_mode=False (transformers 5.24, ibert/quant_modules.py): a layer norm over
    the last axis of a 3-d input, ``(x - mean) / sqrt(eps + var) * weight + bias``, returned as ``(output, None)``."""
    return type(module).__name__ == "IntLayerNorm" and getattr(module, "quant_mode", None) is False \
        and isinstance(getattr(module, "weight", None), torch.Tensor) and isinstance(getattr(module, "eps", None), float)


def _paired_layer_norm_rule(module: nn.Module, args, output):
    """:func:`_own_layer_norm_rule` on the value of I-BERT's ``(output, scaling factor)`` pair (the factor None)."""
    if not isinstance(output, tuple) or not isinstance(output[0], torch.Tensor) or output[1] is not None:
        raise HeadlabError(f"LRP: {type(module).__name__} returned no (output, None) pair; headlab has no LRP rule "
                           "for it")
    return (_own_layer_norm_rule(module, args, output[0]), *output[1:])


def norm_rule(module: nn.Module):
    """The forward hook that applies ``module``'s LRP rule when it is a normalisation; None when
    it is none. A normalisation without a rule raises :class:`HeadlabError` naming its class."""
    if isinstance(module, nn.LayerNorm) and type(module).__name__ in CHANNELS_FIRST_NORMS:
        return _channels_first_layer_norm_rule
    if isinstance(module, nn.LayerNorm):
        return _layer_norm_rule
    if is_paired_layer_norm(module):
        return _paired_layer_norm_rule
    if _is_rms_norm(module):
        return _rms_norm_rule
    if _is_parameter_free_layer_norm(module) or _is_own_layer_norm(module):
        return _own_layer_norm_rule
    if _is_affine_norm(module):
        return _affine_rule
    if _looks_like_norm(module):
        raise HeadlabError(f"LRP: no rule for the normalisation module {type(module).__name__}")
    return None


def check_rules(model: nn.Module) -> None:
    """Raise :class:`HeadlabError` before any work when a module of ``model`` that LRP's forward may run has no
    LRP rule: a normalisation headlab does not know (named by its class and path), an in-place activation, or a
    token mixer or MLP that none of the rules covers (:func:`_no_rule`). Modules it never runs need none
    (:func:`never_run`)."""
    _check_rules(model)


def _check_rules(model: nn.Module) -> dict[str, tuple[str, str | None]]:
    """:func:`check_rules`; what no rule covers, all of it never run (:func:`_unruled`'s form), back."""
    if found := stored_elsewhere_modules(model):  # LRP widens the weights in place: not stored values, not copies
        raise HeadlabError(
            f"LRP is refused on a model whose weights are stored quantized or offloaded ({describe(found)}): LRP "
            "computes in float32 or float64 with the module's own weights widened in place, which reads stored values "
            "as if they were the weights (a float8 weight without its scales, a packed integer one not at all) or "
            f"widens none (an offloaded weight, loaded from its copy at each forward); {HINT}")
    blocks = attention_blocks(model)
    for block in blocks:
        if block.idle:  # never run on token ids (GPT-2's cross-attention without encoder states): no relevance reaches it
            continue
        if block.n_heads and _is_latent(block):
            _latent_attention_hooks(block)  # refuses, naming what, a latent attention the rule does not fit
            continue
        score = mixer_rules.score_bias_rule_for(block.core)  # Inkling's relative-position logits
        if block.n_heads and score is not None and (problem := score.problem(block, _attention_hooks(block))):
            raise HeadlabError(f"LRP: no rule for the attention of {block.name} ({block.family.name}): {problem}")
        if block.n_heads and block.q is None and block.qkv is None and cca_rule.is_cca(block):  # ZAYA's own rule
            if (problem := cca_rule.cca_problem(block)) is not None:
                raise HeadlabError(f"LRP: no rule for the attention of {block.name} ({block.family.name}): {problem}")
            continue
        if block.n_heads and shared_kv_rule.is_shared_kv(block):  # DeepSeek-V4's: its own rule
            if (problem := shared_kv_rule.problem(block)) is not None:
                raise HeadlabError(f"LRP: no rule for the attention of {block.name} ({block.family.name}): {problem}")
            continue
        # a layout read with no rule (Zamba 2's attention adapters laid out otherwise: Family.refused), or a table's
        # reason whatever its projections
        untied = block.q is None and block.qkv is None
        refused = block.family.lrp_refused or block.family.refused or \
            (FUSED_REFUSED.get(type(block.core).__name__) if untied else None)
        if block.n_heads and refused:
            raise HeadlabError(f"LRP: no rule for the attention of {block.name} ({block.family.name}): {refused}")
        if block.n_heads and block.columns_after and mixer_rules.rule_for(block.core) is None:
            raise HeadlabError(
                f"LRP: no rule for the attention of {block.name} ({block.family.name}): its output projection reads "
                f"{block.columns_after} columns after its heads' ({block.family.columns_after_heads}) that no LRP rule "
                "covers (ConvBERT's convolution heads have one: headlab.importance.mixer_rules.convbert)")
        if block.n_heads and (problem := head_map_problem(block)):  # a per-head map before o_proj without a rule
            raise HeadlabError(f"LRP: no rule for the attention of {block.name} ({block.family.name}): {problem}")
        if block.n_heads and block.q is None and block.qkv is None:  # found at run time, projections not tied
            raise HeadlabError(
                f"LRP: no rule for the attention of {block.name} ({block.family.name}): its query and key projections "
                "are unknown (no family table, and discovery did not tie one projection to each of the attention "
                "function's queries, keys and values), so the attention weights cannot be held constant")
        if block.n_heads and block.k is not None and block.k is block.v and _keys_only(block) is None:
            raise HeadlabError(
                f"LRP: no rule for the attention of {block.name} ({block.family.name}): its values are its keys' "
                f"projection ({block.family.k}, attention_k_eq_v: value_states = key_states before the key norm and "
                "rotary), so holding the keys constant there would hold the values constant too and lose their "
                "relevance")
    if per_layer_input_layers(model) and not per_layer_embeddings(model):
        raise HeadlabError("LRP: no rule for this model's per-layer inputs: its layers multiply by a per-layer input "
                           "(per_layer_input_gate, per_layer_projection), but it has no per-layer token embedding "
                           "(embed_tokens_per_layer) where the relevance sent into them could be counted")
    streams = residual_stream_problem(model)  # hyper-connections, n-gram injections (HY-V4, Qwen4-Exp)
    if streams:
        raise HeadlabError(streams)
    ruled = {id(layer.altup) for text in altup_models(model) for layer in cast(nn.ModuleList, text.layers)}
    for path, module in model.named_modules():
        if _is_altup(module) and id(module) not in ruled:
            raise HeadlabError(
                f"LRP: no rule for the alternating updates {type(module).__name__} ({path}): headlab's rule is for "
                "Gemma 3n's text model (every layer's altup, the streams made by altup_projections and put back by "
                "altup_unembed_projections before its norm, per_layer_model_projection reading the input "
                "embeddings), and this one is not laid out so; the other measures work on the attention layers")
    unruled = _unruled(model, blocks)
    if not unruled:
        return unruled
    try:  # what the explained forward never runs needs no rule (lrp_rules refuses it should it run after all)
        skipped = never_run(model)
    except HeadlabError:  # the probe forward failed: nothing is known not to run
        skipped = set()
    left = {path: why for path, why in unruled.items() if path not in skipped}
    for _, problem in left.values():
        if problem is not None:
            raise HeadlabError(problem)
    unknown: dict[str, list[str]] = {}
    for path, (name, _) in left.items():
        unknown.setdefault(name, []).append(path)
    if unknown:
        listed = "; ".join(f"{name} (at {paths[0]}" + (f" and {len(paths) - 1} more)" if len(paths) > 1 else ")")
                           for name, paths in unknown.items())
        raise HeadlabError(f"LRP: no rule for the normalisation module {listed}: {_KNOWN_NORMS}")
    return unruled


def _unruled(model: nn.Module, blocks: list[AttentionBlock]) -> dict[str, tuple[str, str | None]]:
    """Path -> (class name, why no rule covers it) of every module none of the rules covers, in module order;
    why is None for a normalisation without a rule (:func:`check_rules` names them all at once)."""
    inside = _inside(model, blocks)
    holders = _holders(model, blocks)
    found: dict[str, tuple[str, str | None]] = {}
    for path, module in _unowned_modules(model):  # a mixer's own parts (a gated norm) are under its rule
        problem = _module_problem(module, path, inside, _parent(model, path), id(module) in holders)
        if problem is not None or _unknown_norm(module):
            found[path] = (type(module).__name__, problem)
    return found


_KNOWN_NORMS = ("headlab knows LayerNorm (with or without parameters, a family's own class that computes it), RMS norms "
                "(weight, 1 + weight, or none) and element-wise x * weight + bias")


def _inside(model: nn.Module, blocks: list[AttentionBlock]) -> set[int]:
    """The blocks, what they hold and what holds them (T5's T5LayerSelfAttention around its SelfAttention)."""
    inside = {id(m) for block in blocks for m in block.module.modules()}
    return inside | _holders(model, blocks)


def _holders(model: nn.Module, blocks: list[AttentionBlock]) -> set[int]:
    """The modules that hold a block (T5's T5LayerSelfAttention, DBRX's DbrxNormAttentionNorm)."""
    return {id(m) for path, m in model.named_modules() if any(b.name.startswith(path + ".") for b in blocks)}


def _unknown_norm(module: nn.Module) -> bool:
    try:
        norm_rule(module)
    except HeadlabError:
        return True
    return False


def _parent(model: nn.Module, path: str) -> nn.Module | None:
    return model.get_submodule(path.rpartition(".")[0]) if path else None


def _module_problem(module: nn.Module, path: str, inside: set[int], parent: nn.Module | None = None,
                    holds_block: bool = False) -> str | None:
    """Why no LRP rule covers ``module`` itself, as the refusal says it (None: one does); a normalisation
    without a rule aside (:func:`check_rules` names them all at once). ``parent``: the module holding it;
    ``holds_block``: an attention block lies inside it (then it is no gated norm, whatever its name)."""
    if _is_expert_list(module, path) and (problem := _routed_biases_problem(module)) is not None:
        return f"LRP: no rule for the experts {type(module).__name__} ({path}): {problem}"
    if _is_experts(module) and (problem := _moe_layout_problem(module, parent)) is not None:
        return (f"LRP: no rule for the mixture-of-experts module {type(module).__name__} ({path}): "
                f"{problem}; headlab knows transformers' gated experts held as 3-d weights (Mixtral, Qwen-MoE, "
                "GPT-OSS, Llama 4, Aria, MiniMax-M3, LFM2-MoE), DBRX's (w1, v1, w2), Nemotron-H's non-gated ones "
                "(up_proj, down_proj), Inkling's shared experts (gate_proj, up_proj, down_proj, scaled by gammas) and "
                "Switch Transformers' and NLLB-MoE's experts held as modules")
    # A.X-K2's AXK2GatedRMSNorm (transformers 5.24); DBRX's DbrxNormAttentionNorm (norm_1, attn, norm_2: a pre-norm
    # attention and the MLP's norm, by its name and children one) holds an attention block and is none
    if not holds_block and _is_gated_norm(module) and \
            (_gated_norm_parts(module) is None or not _computes_gated_norm(module)):
        return (f"LRP: no rule for the gated normalisation {type(module).__name__} ({path}): headlab's rule is for "
                "y * sigmoid(mlp(y)) with y = norm(x) (A.X-K2's AXK2GatedRMSNorm: children norm, a norm with a rule, "
                "and mlp), the gate held constant; on a probe this module is not laid out or does not compute so, "
                "so relevance would not be conserved; the other measures work on the model's attention layers")
    if _is_activation(module) and getattr(module, "inplace", False):
        return f"LRP: in-place activation {type(module).__name__} ({path}) is not supported"
    if (problem := _no_rule(module, path, inside)) is not None:
        return f"LRP: no rule for {type(module).__name__} ({path}): {problem}"
    return None


def never_run(model: nn.Module) -> set[str]:
    """The paths of the modules that LRP's forward never runs, so that no relevance reaches them and they need no
    rule: every subtree none of whose modules ran in discovery's probe forward (a multimodal model's vision or
    speech tower, its projector; GPT-2's cross-attention without encoder states). A container (a ModuleList) runs
    no forward of its own: it is skipped only when none of its modules ran either.

    The probe runs token ids and a mask, as LRP's batches do (input_ids, attention_mask, the decoder's and
    token_type_ids, data.inputs.make_batches): no pixel or audio input ever, so a tower never runs. What else the
    probe left out (an expert its tokens were not routed to) may still run on other tokens: :func:`lrp_rules`
    refuses, when it runs, any such module that has no rule."""
    from headlab.adapters.discovery import ran

    ran_paths = ran(model)  # the probe forward attention_blocks ran (cached)
    touched = {""}
    for path in ran_paths:
        parts = path.split(".")
        touched.update(".".join(parts[:depth]) for depth in range(1, len(parts) + 1))
    return {path for path, _ in model.named_modules() if path not in touched}


def _ran_after_all(problem: str):
    """A pre-hook for a module :func:`check_rules` skipped (the probe never ran it) that has no rule: refused if
    LRP's forward runs it after all, before relevance passes through it unruled."""

    def hook(module, args):
        raise HeadlabError(f"{problem} (it ran in LRP's forward, though discovery's probe forward on token ids did "
                           f"not run it, so it was not checked before the work began)")

    return hook


def _no_rule(module: nn.Module, path: str, inside: set[int]) -> str | None:
    """Why none of the rules covers ``module`` (None: they do, or it is none of these), found by
    the family sweep of session 22 (experiments/family_sweep.py), where relevance was not conserved."""
    name = type(module).__name__
    if (mixer := mixer_rules.rule_for(module)) is not None:  # a mixer with a rule of its own: does it fit?
        problem = mixer.problem(module, path)
        return None if problem is None else f"{mixer.name}: {problem}"
    # Mamba's, Mamba-2's and gated delta nets' decay; RecurrentGemma's RG-LRU's (Griffin)
    if any(isinstance(getattr(module, decay, None), torch.Tensor) for decay in ("A_log", "recurrent_param")):
        return ("a state-space (or linear recurrent) token mixer beside the attention: its recurrence multiplies "
                "values computed from its input, which none of headlab's rules splits, so relevance would not be "
                "conserved; the other measures work on the model's attention layers")
    if name.endswith("Attention") and id(module) not in inside:
        return ("a token mixer named attention that is none of the attention blocks headlab found (MiniMax's "
                "lightning attention: linear attention, no per-head probabilities), and none of its rules covers "
                "it, so relevance would not be conserved; the other measures work on the attention blocks")
    act = getattr(module, "act_fn", None)
    if _has_per_layer_input(module) and not (isinstance(act, nn.Module) and _is_activation(act)):
        return ("per-layer inputs (Gemma 3n's, Gemma 4's) without an activation module act_fn: the rule splits "
                "act(per_layer_input_gate(h)) * per_layer_input with the activation rule on act's output, which "
                "cannot be applied to an activation called as a function, so relevance would not be conserved; the "
                "other measures work on the attention layers")
    if callable(getattr(module, "_gaussian_topk", None)) and (getattr(module, "activation_sparsity", 0) or 0) > 0 \
            and not _sparsity_is_homogeneous(module):
        return ("activation sparsity (a _gaussian_topk before the MLP's activation) that is not positively "
                "homogeneous of degree one on a probe (Gemma 3n's relu(x - mean(x) - z * std(x)) is: f(2x) = 2 f(x), "
                "so its ordinary backward conserves relevance), so relevance would not be conserved; the other "
                "measures work on the attention layers")
    if isinstance(clamp := _dense_clamp(module), str):
        return clamp
    if _clamped_gated_parts(module) is not None and _clamped_gate(module) is None:
        return ("a gated MLP down(gate(gate_up x)) with a clamp limit and no activation module whose forward is not "
                "GPT-OSS's clamped SwiGLU (clamp(up) + 1) * g * sigmoid(alpha * g) on a probe (MiniMax-M3's is), so "
                "the activation and product rules cannot be applied to it and relevance would not be conserved")
    if _called_gated_parts(module) is not None and not _computes_called_gated(module):
        return ("a gated MLP w2(act(w1 x) * w3 x) whose activation is a function call, not a module, and not "
                "SiLU (LFM2's, the one headlab knows): on a probe its output is not w2(silu(w1 x) * w3 x), so the "
                "activation and product rules cannot be applied to it and relevance would not be conserved")
    return None


def _called_gated_parts(module: nn.Module) -> tuple[nn.Linear, nn.Linear, nn.Linear] | None:
    """``(w1, w3, w2)`` of a gated MLP ``w2(act(w1 x) * w3 x)`` whose activation is a function call, not a
    module (LFM2's ``Lfm2MLP``, LFM2-MoE's and LFM3's: ``F.silu``), None for any other module."""
    children = dict(module.named_children())
    parts = [children.get(name) for name in ("w1", "w3", "w2")]
    if not all(isinstance(part, nn.Linear) for part in parts) or any(_is_activation(c) for c in children.values()):
        return None
    return cast(tuple[nn.Linear, nn.Linear, nn.Linear], tuple(parts))


def called_gated_mlps(model: nn.Module) -> list[tuple[nn.Linear, nn.Linear, nn.Linear]]:
    """``(w1, w3, w2)`` of every gated MLP of ``model`` whose activation (SiLU) is a function call."""
    return [parts for module in model.modules() if (parts := _called_gated_parts(module)) is not None]


def _called_gated(x: torch.Tensor, w1: nn.Linear, w3: nn.Linear, w2: nn.Linear) -> torch.Tensor:
    return w2(nn.functional.silu(w1(x)) * w3(x))


def _computes_called_gated(module: nn.Module) -> bool:
    """Whether ``module``'s own forward is ``w2(silu(w1 x) * w3 x)`` on a random input (under no_grad), so that
    another activation or formula is refused before any work; True where it cannot run (weights on the meta
    device): :class:`_CalledGatedProduct` checks the product on every call."""
    parts = _called_gated_parts(module)
    assert parts is not None
    weight = parts[0].weight
    if weight.is_meta or not weight.is_floating_point():
        return True
    g = torch.Generator().manual_seed(0)
    x = torch.randn((2, 3, parts[0].in_features), generator=g, dtype=torch.float64).to(weight.device, weight.dtype)
    with torch.no_grad():
        try:
            output = type(module).forward(module, x)
        except Exception:  # noqa: BLE001  # any failure: not the MLP the rule assumes
            return False
        expected = _called_gated(x, *parts)
    return isinstance(output, torch.Tensor) and output.shape == expected.shape \
        and torch.allclose(output, expected, rtol=1e-3, atol=1e-5)


def _is_latent(block: AttentionBlock) -> bool:
    """Multi-head latent attention: a ``kv_b_proj`` in the block's head rows or on its attention module."""
    return any(path.endswith("kv_b_proj") for path, _ in block.family.head_rows) or \
        getattr(block.core, "kv_b_proj", None) is not None


def _latent_attention_hooks(block: AttentionBlock) -> list[tuple[nn.Module, Any]]:
    """(module, forward hook) that hold the attention weights of a multi-head latent attention constant.

    transformers' MLA (``DeepseekV3Attention.forward`` and the types of
    :data:`headlab.adapters.families.LATENT_ATTENTION`, read in transformers 5.24): the queries are the output of
    the query projection (``q_b_proj``, ``q_proj``, A.X-K2's ``q_gate_proj``: per head ``[query | gate]``);
    ``kv_a_proj_with_mqa`` emits ``[latent (kv_lora_rank) | rotary key (qk_rope_head_dim)]``, the latent goes
    through ``kv_a_layernorm`` to ``kv_b_proj``, viewed per head ``[k_nope (qk_nope_head_dim) | v (v_head_dim)]``;
    the key is ``[k_nope | rotated rotary key]``. So the query projection's output, ``kv_a_proj_with_mqa``'s rotary
    columns and ``kv_b_proj``'s ``k_nope`` columns are detached, as the query and key projections are for other
    attention: ``p`` is a constant, and relevance reaches the layer's input through ``v``, ``kv_b_proj``, the
    latent's RMS norm (its rule) and ``kv_a_proj_with_mqa``'s latent columns. An output gate's projection (``g_proj``,
    :data:`~headlab.adapters.families.OUTPUT_GATES`) is detached, the gate held constant as Qwen3-Next's is. What
    only selects keys (DeepSeek-V3.2's and GLM-MoE-DSA's indexer: integer top-k indices, folded into the mask) has
    no gradient. A layer without ``kv_a_proj_with_mqa`` (Mistral Large 4's 'reuse' layers) reads the normed latent
    and the rotated rotary key an earlier layer stored, whose rotary columns that layer's hook detaches.

    Raises :class:`HeadlabError`, naming what, where the block is not laid out so (a type not in the table, or
    widths that are not those views)."""
    core = block.core
    rows = dict(block.family.head_rows)
    names = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank")
    sizes = {name: getattr(core, name, None) for name in names}
    nope, rope, v, rank = (value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else -1
                           for value in sizes.values())
    kv_b = block.module.get_submodule("kv_b_proj") if "kv_b_proj" in rows else None
    kv_a = getattr(core, "kv_a_proj_with_mqa", None)
    if rows.get("kv_b_proj") != ("qk_nope_head_dim", "v_head_dim"):
        problem = ("its layout is not one headlab read (the model types of headlab.adapters.families.LATENT_ATTENTION: "
                   "DeepSeek-V3's views and splits)")
    elif min(nope, rope, v, rank) < 0:
        problem = f"its sizes are not all numbers ({', '.join(f'{name}={value!r}' for name, value in sizes.items())})"
    elif not isinstance(kv_b, nn.Linear) or kv_b.out_features != block.n_heads * (nope + v):
        problem = f"its kv_b_proj is not a linear map to {block.n_heads} heads x (k_nope {nope} + v {v})"
    elif kv_a is not None and (not isinstance(kv_a, nn.Linear) or kv_a.out_features != rank + rope):
        problem = f"its kv_a_proj_with_mqa is not a linear map to the latent ({rank}) and the rotary key ({rope})"
    else:
        is_key = torch.arange(kv_b.out_features) % (nope + v) < nope  # per head [k_nope | v]
        hooks: list[tuple[nn.Module, Any]] = [(kv_b, _detach_where(is_key))]
        if kv_a is not None:
            hooks.append((kv_a, _detach_where(torch.arange(rank + rope) >= rank)))  # [latent | rotary key]
        # the query projection, an output gate's projection (both head rows): constants
        hooks.extend((block.module.get_submodule(path), _detach_output) for path in rows if path != "kv_b_proj")
        return hooks
    gates = OUTPUT_GATES.get(block.family.name.split(":", 1)[-1], ())
    raise HeadlabError(
        f"LRP: no rule for the attention of {block.name} ({block.family.name}): multi-head latent attention, "
        f"but {problem}, so the attention weights cannot be held constant by detaching the queries and keys" + (
            f"; its output gate from {', '.join(gates)} (computed from the layer's input) would have to be held "
            "constant as well" if gates else ""))


def _detach_where(columns: torch.Tensor):
    """Detach the output features where ``columns`` (bool, one per feature) is true, keep the others'."""

    def hook(module, args, output):
        return torch.where(columns.to(output.device), output.detach(), output)

    return hook


def _detach_output(module, args, output):
    if isinstance(output, tuple):  # I-BERT's QuantLinear: (output, scaling factor), the factor None
        return (output[0].detach(), *output[1:])
    return output.detach()


class _ClampIdentity(torch.autograd.Function):
    """``clamp(x, low, high)`` (``low`` None: no lower bound) with the identity rule of element-wise functions,
    ``R(x) = R(clamp(x))`` (Voita et al. 2019, App. A.2; AttnLRP, Achtibat et al. 2024, Sec. 3.3): the gradient scaled
    by ``clamp(x) / x`` (1 where ``x`` is 0), so that gradient x input at ``x`` is the output's. The value is the
    clamp's, exactly: the forward's own clamp after it leaves it unchanged, and passes its gradient, the clipped values
    lying on its bounds (:class:`_ClosedClamps`)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, low: float | None, high: float) -> torch.Tensor:
        ctx.save_for_backward(x)  # not the output: OLMo clamps it again in place
        ctx.low, ctx.high = low, high
        return x.clamp(min=low, max=high)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        x, = ctx.saved_tensors
        one = torch.ones_like(x)
        ratio = torch.where(x == 0, one, x.clamp(min=ctx.low, max=ctx.high) / torch.where(x == 0, one, x))
        return grads[0] * ratio, None, None


class _ClosedClamp(torch.autograd.Function):
    """``clamp(x, low, high)`` (a bound None: none) whose gradient is 1 on the closed interval ``[low, high]`` and 0
    outside it: torch's up to 2.13 (``clamp_backward``: ``self >= min && self <= max``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, low: float | None, high: float | None) -> torch.Tensor:
        inside = torch.ones_like(x, dtype=torch.bool)
        if low is not None:
            inside &= x >= low
        if high is not None:
            inside &= x <= high
        ctx.save_for_backward(inside)  # not x: OLMo clamps it in place
        return x.clamp(min=low, max=high)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        inside, = ctx.saved_tensors
        return torch.where(inside, grads[0], torch.zeros_like(grads[0])), None, None


# function -> the names of its bounds after the input: clamp and clip (min, max), clamp_min (min), clamp_max (max)
_CLAMPS: dict[Any, tuple[str, ...]] = {
    **{f: ("min", "max") for f in (torch.clamp, torch.clip, torch.Tensor.clamp, torch.Tensor.clip,
                                   torch.Tensor.clamp_, torch.Tensor.clip_)},
    **{f: ("min",) for f in (torch.clamp_min, torch.Tensor.clamp_min, torch.Tensor.clamp_min_)},
    **{f: ("max",) for f in (torch.clamp_max, torch.Tensor.clamp_max, torch.Tensor.clamp_max_)},
}
_IN_PLACE = (torch.Tensor.clamp_, torch.Tensor.clip_, torch.Tensor.clamp_min_, torch.Tensor.clamp_max_)


class _ClosedClamps(TorchFunctionMode):
    """Every clamp with number bounds that the code asks for under :func:`lrp_rules` passes the gradient on the closed
    interval of its bounds (:class:`_ClosedClamp`), as torch did up to 2.13.

    The identity rule (:class:`_ClampIdentity`) clamps a projection's output, clipped values onto the bounds, before
    the model's own clamp (``clip_qkv``, a gated MLP's ``swiglu_limit``), which must then pass their gradient. torch
    2.14 gives a clamp the gradient 0 at its bounds (the minimum-norm subgradient; pytorch issue #195931), which lost
    every clipped value's relevance. Tensor bounds and ``out=`` are left to torch."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        bounds = _number_bounds(func, args, kwargs)
        if bounds is None or not torch.is_grad_enabled() or not args[0].requires_grad:
            return func(*args, **kwargs)
        clamped = _ClosedClamp.apply(args[0], bounds.get("min"), bounds.get("max"))
        return args[0].copy_(clamped) if func in _IN_PLACE else clamped


def _number_bounds(func: Any, args: tuple, kwargs: dict) -> dict[str, Any] | None:
    """The bounds by name of a call of one of :data:`_CLAMPS` on a tensor, each a number or None; None for any other
    call (another function, a tensor bound, ``out=``)."""
    names = _CLAMPS.get(func)
    if names is None or not args or not isinstance(args[0], torch.Tensor) or len(args) > 1 + len(names):
        return None
    bounds = {**dict(zip(names, args[1:])), **kwargs}
    if set(bounds) - set(names) or not all(b is None or isinstance(b, (int, float)) for b in bounds.values()):
        return None
    return bounds


def _clip(block: AttentionBlock) -> float | None:
    """The bound the block's forward clamps its projections' outputs to (:data:`CLIPPED_QKV`), if any (0 is none:
    MPT clamps only where it is truthy, and a clamp to 0 leaves the values no relevance either way)."""
    path = CLIPPED_QKV.get(type(block.core).__name__)
    bound: Any = block.core
    for part in path.split(".") if path else ("",):
        bound = getattr(bound, part, None) if part else None
    return float(bound) if isinstance(bound, (int, float)) and not isinstance(bound, bool) and bound else None


def _clamp_identity(clip: float):
    """The value projection's output clamped to ``clip`` by the activation rule (:class:`_ClampIdentity`): the
    forward's own clamp after it (OLMo's, in place) then changes nothing and passes the gradient."""

    def hook(module, args, output):
        return _ClampIdentity.apply(output, -clip, clip)

    return hook


def _one_sided_clamp(bound: float):
    """A module's output clamped to at most ``bound`` by the identity rule (:class:`_ClampIdentity`): a gated MLP's
    gate before or after its activation (:data:`_CLAMPED`), the forward's own clamp after it then changing nothing."""

    def hook(module, args, output):
        return _ClampIdentity.apply(output, None, bound)

    return hook


def _detach_qk_columns(width_qk: int, clip: float | None = None):
    """For a fused [q | k | v] projection: detach the q and k columns, keep v (through the forward's clamp to
    ``clip``, where it has one, by the identity rule: :class:`_ClampIdentity`)."""

    def hook(module, args, output):
        values = output[..., width_qk:]
        if clip is not None:
            values = cast(torch.Tensor, _ClampIdentity.apply(values, -clip, clip))
        return torch.cat([output[..., :width_qk].detach(), values], dim=-1)

    return hook


def _detach_columns(block: AttentionBlock):
    """For a fused projection in any other layout (per head, grouped, CodeGen's groups): detach the q and k columns
    wherever the layout puts them, keep the values'."""
    q, k, _ = block.qkv_columns()
    assert block.qkv is not None  # called for fused projections only
    is_qk = torch.zeros(out_features(block.qkv), dtype=torch.bool)
    is_qk[torch.cat([q, k])] = True
    clip = _clip(block)

    def hook(module, args, output):
        if clip is not None:
            output = _ClampIdentity.apply(output, -clip, clip)
        return torch.where(is_qk.to(output.device), output.detach(), output)

    return hook


class _GatedProduct:
    """Ding et al.'s element-wise product rule for gated MLPs: ``down(act(gate(x)) * up(x))``.

    The two factors are recorded on their way out of ``act`` and ``up``; the pre-hook of
    ``down`` gives their product the backward of ``(a + b) * stop(a b / (a + b))``.
    """

    def __init__(self) -> None:
        self.a: torch.Tensor | None = None
        self.b: torch.Tensor | None = None

    def keep_a(self, module, args, output):
        self.a = output

    def keep_b(self, module, args, output):
        self.b = output

    def pre_down(self, module, args):
        v, a, b = args[0], self.a, self.b
        self.a = self.b = None
        if a is None or b is None or a.shape != v.shape or b.shape != v.shape:
            raise HeadlabError(f"LRP: cannot find the two factors of the gated MLP before {type(module).__name__}")
        return (_swap_backward(v, _as_computed(_product(a, b).to(v.dtype), v)), *args[1:])


class _CheckedGatedProduct(_GatedProduct):
    """:class:`_GatedProduct` that checks, on every call, that ``down``'s input is the product of the two
    factors it kept before its backward is swapped (a gated MLP found by names other MLPs might use too)."""

    formula = "act(gate x) * up x"

    def pre_down(self, module, args):
        v, a, b = args[0], self.a, self.b
        if a is not None and b is not None and a.shape == v.shape == b.shape:
            with torch.no_grad():
                if not torch.allclose(a * b, v, rtol=1e-3, atol=1e-5):
                    self.a = self.b = None
                    raise HeadlabError(f"LRP: the input of {type(module).__name__} is not {self.formula}; "
                                       "headlab has no LRP rule for this gated MLP")
        return super().pre_down(module, args)


class _CalledGatedProduct(_CheckedGatedProduct):
    """:class:`_GatedProduct` for ``w2(silu(w1 x) * w3 x)`` with SiLU a function call (LFM2's ``Lfm2MLP``):
    ``w1``'s output gets the activation rule here (LXT's ``gated_mlp_forward`` applies the identity rule to
    ``act_fn(gate_proj(x))`` likewise: lxt/efficient/patches.py), and ``w2``'s input is checked to be the
    product of the two factors before its backward is swapped, on every call."""

    formula = "silu(w1 x) * w3 x"

    def keep_activated(self, module, args, output):
        self.a = _activation_rule(module, (output,), nn.functional.silu(output))


_PER_LAYER_PARTS = ("per_layer_input_gate", "per_layer_projection")


def _has_per_layer_input(module: nn.Module) -> bool:
    """A decoder layer with per-layer inputs (Gemma 3n's, Gemma 4's): ``per_layer_input_gate`` and
    ``per_layer_projection``, both linear maps."""
    return all(isinstance(getattr(module, name, None), nn.Linear) for name in _PER_LAYER_PARTS)


def per_layer_input_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of ``model`` with per-layer inputs (:class:`_PerLayerInputProduct`)."""
    return [module for module in model.modules() if _has_per_layer_input(module)]


def per_layer_embeddings(model: nn.Module) -> list[nn.Module]:
    """The per-layer token embeddings of ``model`` (Gemma 3n's and Gemma 4's ``embed_tokens_per_layer``): an input
    of their own, whose output is where relevance sent into the per-layer inputs ends beside the input embeddings
    (lrp.py counts it in the input relevance); and, likewise, the value embeddings of a model type of
    :data:`~headlab.adapters.families.VALUE_EMBEDDINGS` (NeoMME's ``value_embeddings``, a token embedding added to
    some layers' values: the relevance of those values that is the embedding's ends there)."""
    names = ("embed_tokens_per_layer", *(entry[0] for entry in VALUE_EMBEDDINGS.values()))
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    found: list[nn.Module] = []
    for module in model.modules():
        for name in names:
            embedding = getattr(module, name, None)
            if isinstance(embedding, nn.Embedding) and (name == names[0] or model_type in VALUE_EMBEDDINGS):
                found.append(embedding)
    return found


class _PerLayerInputProduct:
    """Ding et al.'s product rule for the per-layer inputs of Gemma 3n and Gemma 4.

    Each such decoder layer computes ``h + norm(W_p (act(W_g h) * p))`` (transformers 5.24,
    ``Gemma4TextDecoderLayer.forward``, ``Gemma3nTextDecoderLayer.forward`` on the active AltUp stream), where
    ``p`` (``per_layer_input``) is the layer's slice of ``(norm(W_m e * s) + T(ids)) / sqrt(2)``
    (``project_per_layer_inputs``): ``e`` the input embeddings, ``T`` the per-layer token embedding
    ``embed_tokens_per_layer``. ``act(W_g h) * p`` is a product of two neurons, as a gated MLP's
    ``act(gate x) * up x`` is, and gets its rule (Voita et al. 2019, App. A.2; Ding et al. 2017, Sec. 3.2):
    ``R(a) = a / (a + p) R(v)``, ``R(p) = p / (a + p) R(v)`` (Ding's split, headlab's one product rule, not
    AttnLRP's uniform ``R(v) / 2`` each), the activation with the activation rule. Neither
    factor is a gate in the sense of the ones held constant (Qwen3-Next's sigmoid output gate, the routing weights:
    weights in (0, 1) of a weighted sum, constants as the attention weights are): ``act`` is GELU of a projection,
    unbounded, and ``p`` is no weight but a signal from the input; holding either constant would give all of the
    product's relevance to the other (CP-LRP, Ali et al. 2022) and break the convention of the gated MLPs that
    this product copies. ``R(p)`` flows on through linear maps and the RMS norm's rule to the input embeddings
    ``e`` (through ``per_layer_model_projection``) and to ``T``'s output, an input of its own that keeps its share
    as a bias keeps its own (lrp.py records it with the input embeddings and reports it apart), so relevance is
    conserved. The pre-hook of the layer keeps ``p``, the forward hook of ``act_fn`` (after its activation rule)
    ``a``; the pre-hook of ``per_layer_projection`` checks that its input is ``a * p``, on every call, before
    swapping its backward."""

    formula = "act_fn(per_layer_input_gate(h)) * per_layer_input"

    def __init__(self) -> None:
        self.a: torch.Tensor | None = None
        self.p: torch.Tensor | None = None

    def keep_input(self, module, args, kwargs):
        import inspect

        try:
            bound = inspect.signature(type(module).forward).bind(module, *args, **kwargs).arguments
        except TypeError:
            bound = {}
        self.p = bound.get("per_layer_input")

    def keep_gate(self, module, args, output):
        self.a = output

    def pre_projection(self, module, args):
        v, a, p = args[0], self.a, self.p
        self.a = self.p = None
        if not isinstance(a, torch.Tensor) or not isinstance(p, torch.Tensor) or a.shape != v.shape \
                or p.shape != v.shape:
            raise HeadlabError(f"LRP: cannot find the two factors of the per-layer input before {type(module).__name__} "
                               f"({self.formula})")
        with torch.no_grad():
            if not torch.allclose(a * p, v, rtol=1e-3, atol=1e-5):
                raise HeadlabError(f"LRP: the input of {type(module).__name__} is not {self.formula}; headlab has no "
                                   "LRP rule for these per-layer inputs")
        return (_swap_backward(v, _product(a, p).to(v.dtype)), *args[1:])


_ALTUP_PARTS = ("prediction_coefs", "correction_coefs", "modality_router")


def _is_altup(module: nn.Module | None) -> bool:
    """Gemma 3n's alternating updates (``Gemma3nTextAltUp``): ``prediction_coefs``, ``correction_coefs`` and
    ``modality_router``, linear maps."""
    return module is not None and all(isinstance(getattr(module, name, None), nn.Linear) for name in _ALTUP_PARTS)


def altup_models(model: nn.Module) -> list[nn.Module]:
    """The text models of ``model`` with alternating updates laid out as Gemma 3n's (``Gemma3nTextModel``, transformers
    5.24): ``layers`` whose ``altup`` is an AltUp module, the streams made from the input embeddings by
    ``altup_projections`` and put back by ``altup_unembed_projections`` before ``norm``, and
    ``per_layer_model_projection`` reading the input embeddings (:class:`_AltUpStreams`)."""
    found = []
    for module in model.modules():
        layers: Any = getattr(module, "layers", None)
        if all(isinstance(getattr(module, name, None), nn.ModuleList)
               for name in ("layers", "altup_projections", "altup_unembed_projections")) \
                and isinstance(getattr(module, "per_layer_model_projection", None), nn.Linear) \
                and isinstance(getattr(module, "norm", None), nn.Module) and len(layers) > 0 \
                and all(_is_altup(getattr(layer, "altup", None)) for layer in layers):
            found.append(module)
    return found


def altup_inputs(model: nn.Module) -> list[nn.Module]:
    """The ``per_layer_model_projection`` of each of :func:`altup_models`: its input is the text model's input
    embeddings, the tensor the AltUp streams are made from and the per-layer inputs projected from. LRP's input
    relevance is measured there, not at the first layer's input (the stack of streams, a copy), so that the share
    the per-layer inputs send through ``per_layer_model_projection`` is counted with the rest."""
    return [cast(nn.Module, text.per_layer_model_projection) for text in altup_models(model)]


def _held_magnitude(target: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x * stop(rms(target) / rms(x))``, Gemma 3n's rescaling of an AltUp stream to the magnitude of the first
    (``Gemma3nTextModel.forward``: ``x * target_magnitude / new_magnitude``, the mean square of ``x`` clamped at
    1e-5), the ratio held constant as the RMS norms' ``1 / rms`` is."""
    with torch.no_grad():
        target_magnitude = torch.mean(target ** 2, dim=-1, keepdim=True) ** 0.5
        new_magnitude = torch.sqrt(torch.mean(x ** 2, dim=-1, keepdim=True).clamp(min=1e-5))
        ratio = target_magnitude / new_magnitude
    return x * ratio


class _AltUpStreams:
    """The rules for Gemma 3n's alternating updates (AltUp, Baykal et al. 2023), around its text model.

    The residual stream is ``K`` streams ``s_0..s_{K-1}`` (transformers 5.24, ``Gemma3nTextModel.forward``,
    ``Gemma3nTextAltUp``, ``Gemma3nTextDecoderLayer.forward``):

    * made from the input embeddings ``e``: ``s_0 = e``, ``s_i = P_i e * rms(e) / rms(P_i e)``;
    * each layer predicts ``s'_j = s_j + sum_i c_ij s_i`` and corrects ``s''_j = s'_j + (1 + d_j) (y - s'_a)``
      (``a`` the active stream, ``y`` the layer's output on it), the coefficients ``c = prediction_coefs(r)`` and
      ``d = correction_coefs(r)`` computed by the router ``r = tanh(modality_router(norm(x) / D))`` from the stream
      (``x = s_a``, then ``y``);
    * put back: ``norm(mean_i u_i)``, ``u_0 = s_0``, ``u_i = U_i s_i * rms(s_0) / rms(U_i s_i)``.

    The router's output is detached, so ``c`` and ``d`` are constants of the backward pass, as the attention
    weights and the routing weights of the experts are (LXT's CP-LRP, after Ali et al. 2022, holds such a
    coefficient constant): predict and correct are then weighted sums of the streams, whose ordinary backward
    conserves relevance; the router's own input path gets none. The magnitude ratios ``rms(e) / rms(P_i e)`` and
    ``rms(s_0) / rms(U_i s_i)`` are held constant as the RMS norms' ``1 / rms`` is (AttnLRP's identity rule on
    normalisations), so ``s_i`` and ``u_i`` are linear maps of ``e`` and of ``s_i``. Their plain gradient would
    conserve too (each is homogeneous of degree one, Euler's theorem) but would send the share of ``u_i`` to
    ``s_0`` through its magnitude. Both ends are pre-hooks that swap the backward of the tensor the model computed
    (the first layer's input, the final norm's), after checking, on every call, that it equals the rule's
    recomputation; ``e`` is where lrp.py measures input relevance (:func:`altup_inputs`)."""

    def __init__(self, text: nn.Module) -> None:
        self.name = type(text).__name__
        self.first = next(iter(cast(nn.ModuleList, text.altup_projections)), None)
        self.projected: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.unembedded: list[torch.Tensor] = []
        self.last: torch.Tensor | None = None

    def keep_projected(self, module, args, output):
        if module is self.first:  # a new forward (an earlier one may have stopped before the first layer)
            self.projected = []
        self.projected.append((args[0], output))

    def keep_last(self, module, args, output):
        self.last = output if isinstance(output, torch.Tensor) else None
        self.unembedded = []

    def keep_unembedded(self, module, args, output):
        self.unembedded.append(output)

    def _refuse(self, where: str) -> HeadlabError:
        return HeadlabError(f"LRP: {where} of {self.name} is not what Gemma 3n's alternating updates compute "
                            "(transformers 5.24, Gemma3nTextModel.forward); headlab has no LRP rule for these streams")

    def pre_first(self, module, args, kwargs):
        projected, self.projected = self.projected, []
        stack = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(stack, torch.Tensor) or stack.dim() != 4 or stack.shape[0] != len(projected) + 1 \
                or any(x is not projected[0][0] for x, _ in projected[1:]):
            raise self._refuse("the input of the first layer")
        if not projected:  # one stream: the input embeddings themselves, stacked
            return None
        e = projected[0][0]
        surrogate = torch.stack([e, *(_held_magnitude(e, p) for _, p in projected)])
        with torch.no_grad():
            if surrogate.shape != stack.shape or not torch.allclose(surrogate, stack, rtol=1e-3, atol=1e-5):
                raise self._refuse("the input of the first layer")
        swapped = _swap_backward(stack, surrogate.to(stack.dtype))
        if args:
            return (swapped, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": swapped}

    def pre_norm(self, module, args):
        last, unembedded = self.last, self.unembedded
        self.last, self.unembedded = None, []
        v = args[0]
        if last is None or last.dim() != 4 or last.shape[0] != len(unembedded) + 1 or last.shape[1:] != v.shape:
            raise self._refuse("the input of the final norm")
        surrogate = torch.stack([last[0], *(_held_magnitude(last[0], u) for u in unembedded)]).mean(dim=0)
        with torch.no_grad():
            if not torch.allclose(surrogate, v, rtol=1e-3, atol=1e-5):
                raise self._refuse("the input of the final norm")
        return (_swap_backward(v, surrogate.to(v.dtype)), *args[1:])


def _altup_hooks(text: nn.Module) -> list[tuple[nn.Module, str, Any]]:
    """(module, kind, hook) of :class:`_AltUpStreams` and the routers' detaches for one of :func:`altup_models`."""
    streams = _AltUpStreams(text)
    layers = cast(nn.ModuleList, text.layers)
    hooks: list[tuple[nn.Module, str, Any]] = [(p, "forward", streams.keep_projected)
                                               for p in cast(nn.ModuleList, text.altup_projections)]
    hooks.append((layers[0], "pre_kwargs", streams.pre_first))
    hooks.append((layers[-1], "forward", streams.keep_last))
    hooks += [(u, "forward", streams.keep_unembedded) for u in cast(nn.ModuleList, text.altup_unembed_projections)]
    hooks.append((cast(nn.Module, text.norm), "pre", streams.pre_norm))
    # the coefficients of predict and correct: constants of the backward pass
    hooks += [(cast(nn.Module, cast(nn.Module, layer.altup).modality_router), "forward", _detach_output)
              for layer in layers]
    return hooks


def _register_altup(text: nn.Module, handles: HookHandles) -> None:
    for module, kind, hook in _altup_hooks(text):
        if kind == "forward":
            handles.append(module.register_forward_hook(hook))
        elif kind == "pre_kwargs":
            handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
        else:
            handles.append(module.register_forward_pre_hook(hook))


def _sparsity_is_homogeneous(module: nn.Module) -> bool:
    """Whether ``module._gaussian_topk`` (Gemma 3n's activation sparsity, ``relu(x - mean(x) - z * std(x))`` over
    the gate's neurons) is positively homogeneous of degree one on a probe: ``f(2 x) == 2 f(x)``, what makes its
    ordinary backward conserve relevance (Euler: ``sum_i x_i df/dx_i = f(x)``)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn((2, 3, 64), generator=g, dtype=torch.float64)
    try:
        with torch.no_grad():
            topk: Any = module._gaussian_topk
            once, twice = topk(x), topk(2 * x)
    except Exception:  # noqa: BLE001  # any failure: not the function the rule assumes
        return False
    # all zeros (a sparsity near one on a small probe) is homogeneous too, and conserves
    return isinstance(once, torch.Tensor) and once.shape == x.shape \
        and torch.allclose(twice, 2 * once, rtol=1e-9, atol=1e-12)


def _as_computed(surrogate: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``surrogate`` scaled by a detached ``v / surrogate``, so that its value is the product the MLP really computed
    (Beam's in float32 within a float64 model, session 39): all of ``v``'s relevance passes to the two factors, as the
    norms' rules pass the factor the module applied. Before, the rounding's share was lost, which relevances that
    cancel across a layer (Beam's sandwich norms: shares of +-2000 summing to 2.5) made 5e-4 of the logit."""
    with torch.no_grad():
        nonzero = surrogate != 0
        ratio = torch.where(nonzero, v / torch.where(nonzero, surrogate, torch.ones_like(surrogate)),
                            torch.ones_like(surrogate))
    return surrogate * ratio


def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a * b`` with the backward of Ding et al.'s product rule: ``(a + b) * stop(a b / (a + b))``."""
    with torch.no_grad():
        total = a + b
        safe = torch.where(total == 0, torch.ones_like(total), total)
        # w_{a->v} = a / (a + b), w_{b->v} = b / (a + b); a + b == 0: split equally.
        share = torch.where(total == 0, 0.5 * b, a * b / safe)
        share_b = torch.where(total == 0, 0.5 * a, share)
    return a * share + b * share_b


def _halves(gate_up: torch.Tensor, concatenated: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gate, up)`` of a fused projection: [gate; up] (``chunk``) or interleaved [g0, u0, g1, u1, ...] (GPT-OSS)."""
    if concatenated:
        gate, up = gate_up.chunk(2, dim=-1)
        return gate, up
    return gate_up[..., ::2], gate_up[..., 1::2]


def _limits(module: nn.Module) -> tuple[float, float] | None:
    """``(alpha, limit)`` of GPT-OSS's clamped SwiGLU (``alpha``/``limit``; MiniMax-M3's ``swiglu_alpha``/
    ``swiglu_limit``), None where ``module`` has neither."""
    for alpha, limit in (("alpha", "limit"), ("swiglu_alpha", "swiglu_limit")):
        a, b = getattr(module, alpha, None), getattr(module, limit, None)
        if isinstance(a, (int, float)) and isinstance(b, (int, float)):
            return float(a), float(b)
    return None


class _Gate:
    """What a gated expert computes between its two projections, from ``gate_up`` ([gate | up] or interleaved):
    ``act(gate) * up`` (Mixtral, Qwen-MoE, Llama 4, Aria), GPT-OSS's clamped SwiGLU ``(clamp(up, -l, l) + 1) *
    glu`` with ``glu = g * sigmoid(alpha * g)``, ``g = clamp(gate, max=l)`` (GPT-OSS, MiniMax-M3), or ``act`` and
    ``up`` clamped without GPT-OSS's alpha and ``+ 1`` (``clamp``: the bound and where the gate's clamp is,
    :data:`_CLAMPED`: HY-V4, GLM-5-Next, DeepSeek-V4, Step-3.7).
    :meth:`plain` computes it; calling it computes it with the backward of the LRP rules."""

    def __init__(self, concatenated: bool, act: nn.Module | None = None,
                 limits: tuple[float, float] | None = None, clamp: tuple[float, str] | None = None,
                 softcaps: tuple[float, float] | None = None) -> None:
        self.concatenated, self.act, self.limits, self.clamp = concatenated, act, limits, clamp
        self.softcaps = softcaps

    def describe(self) -> str:
        layout = "[gate; up]" if self.concatenated else "interleaved gate and up columns"
        formula = _CLAMPED[self.clamp[1]] if self.clamp is not None else _SOFTCAPPED if self.softcaps is not None \
            else "act(gate) * up" if self.limits is None else "clamped (up + 1) * swiglu(gate)"
        return f"{formula} ({layout})"

    def plain(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = _halves(gate_up, self.concatenated)
        if self.softcaps is not None:
            return _softcapped_gate(gate, up, *self.softcaps)
        if self.clamp is not None:
            assert self.act is not None
            return _clamped_gate_value(gate, up, self.act.forward, *self.clamp)  # forward: not the rule's hook
        if self.limits is None:
            assert self.act is not None
            return self.act.forward(gate) * up  # forward: not the activation rule's hook
        alpha, limit = self.limits
        gate = gate.clamp(max=limit)
        return (up.clamp(min=-limit, max=limit) + 1) * (gate * torch.sigmoid(gate * alpha))

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = _halves(gate_up, self.concatenated)
        if self.softcaps is not None:
            return _softcapped_rule(gate, up, *self.softcaps)
        if self.clamp is not None:
            assert self.act is not None
            return _clamped_gate_rule(gate, up, self.act, *self.clamp)
        if self.limits is None:
            assert self.act is not None
            return _product(self.act(gate), up)  # act carries the activation rule's hook (_CalledSilu its own)
        return _clamped_swiglu(gate, up, *self.limits)


# Where a gated MLP without GPT-OSS's alpha clamps its gate (its up always to [-l, l]): before the activation (HY-V4's
# and GLM-5-Next's experts and MLPs, DeepSeek-V4's; transformers 5.24) or after it (Step-3.7's ``Step3p7MLP`` and
# ``Step3p7Experts``).
_CLAMPED = {"gate": "act(clamp(gate, max=l)) * clamp(up, -l, l)", "act": "clamp(act(gate), max=l) * clamp(up, -l, l)"}


def _clamp_bound(module: nn.Module) -> float | None:
    """The bound ``l`` of a gated MLP's (or experts') clamps of :data:`_CLAMPED`: its ``swiglu_limit`` (HY-V4,
    GLM-5-Next) or ``limit`` (DeepSeek-V4, Step-3.7), finite; None where it has none, where it is infinite (Step-3.7's
    layers without a clamp: ``float("inf")``), or where it has GPT-OSS's alpha too (:func:`_limits`)."""
    if _limits(module) is not None:
        return None
    for name in ("swiglu_limit", "limit"):
        bound = getattr(module, name, None)
        if isinstance(bound, (int, float)) and not isinstance(bound, bool):
            return float(bound) if math.isfinite(bound) else None
    return None


def _clamped_gate_value(gate: torch.Tensor, up: torch.Tensor, act, bound: float, where: str) -> torch.Tensor:
    """:data:`_CLAMPED`'s formula ``where`` with the activation ``act`` (a function), the forward only."""
    a = act(gate.clamp(max=bound) if where == "gate" else gate)
    return (a.clamp(max=bound) if where == "act" else a) * up.clamp(min=-bound, max=bound)


def _clamped_gate_rule(gate: torch.Tensor, up: torch.Tensor, act: nn.Module, bound: float, where: str) -> torch.Tensor:
    """:data:`_CLAMPED`'s formula ``where`` with the backward of the LRP rules. Each clamp is an element-wise function
    of one neuron: the identity rule, ``R(x) = R(clamp(x))`` (:class:`_ClampIdentity`), as the activation has
    (``act``'s hook; :class:`_CalledSilu` its own); the product, Ding et al.'s rule (:func:`_product`). With no
    ``+ 1`` (GPT-OSS's, :func:`_clamped_swiglu`), nothing keeps relevance."""
    if where == "gate":
        gate = cast(torch.Tensor, _ClampIdentity.apply(gate, None, bound))
    a = act(gate)
    if where == "act":
        a = cast(torch.Tensor, _ClampIdentity.apply(a, None, bound))
    return _product(a, cast(torch.Tensor, _ClampIdentity.apply(up, -bound, bound)))


_SOFTCAPPED = "softcap(gate) * sigmoid(gate) * softcap(up)"
"""Inkling2's ``Inkling2SoftcappedSwiGLU`` (its experts' ``act_fn``, transformers 5.24), ``softcap(x) = c tanh(x / c)``
with a bound ``c`` of its own for the gate and for ``up`` (``gate_softcap``, ``up_softcap``)."""


def _softcaps(act: Any) -> tuple[float, float] | None:
    """``(gate bound, up bound)`` of an ``act_fn`` computing :data:`_SOFTCAPPED` from ``(gate, up)`` (children
    ``gate_softcap`` and ``up_softcap``, each with a float ``softcap``), None for any other; the probe of
    :func:`_probe_gate` checks that it computes that."""
    bounds = [getattr(getattr(act, name, None), "softcap", None) for name in ("gate_softcap", "up_softcap")]
    numbers = [float(b) for b in bounds if isinstance(b, (int, float)) and not isinstance(b, bool) and b > 0]
    if not isinstance(act, nn.Module) or len(numbers) != 2:
        return None
    return numbers[0], numbers[1]


def _softcapped_gate(gate: torch.Tensor, up: torch.Tensor, gate_cap: float, up_cap: float) -> torch.Tensor:
    """:data:`_SOFTCAPPED`, the forward only, computed as the module computes it: in at least float32, returned in the
    inputs' type (a half-precision model's probe: :func:`_probe_gate`)."""
    wide = torch.promote_types(gate.dtype, torch.float32)
    g, u = gate.to(wide), up.to(wide)
    return (gate_cap * torch.tanh(g / gate_cap) * torch.sigmoid(g) * (up_cap * torch.tanh(u / up_cap))).to(gate.dtype)


def _softcapped_rule(gate: torch.Tensor, up: torch.Tensor, gate_cap: float, up_cap: float) -> torch.Tensor:
    """:data:`_SOFTCAPPED` with the backward of the LRP rules: ``softcap(gate) * sigmoid(gate)`` and ``softcap(up)``
    are each an element-wise function of one neuron, so the activation (identity) rule passes their relevance to
    ``gate`` and ``up`` unchanged (Voita et al. 2019, App. A.2; AttnLRP's identity rule, Achtibat et al. 2024,
    Sec. 3.3.1), and their product gets Ding et al.'s product rule (:func:`_product`), as every gated MLP's."""
    with torch.no_grad():
        a = gate_cap * torch.tanh(gate / gate_cap) * torch.sigmoid(gate)
        b = up_cap * torch.tanh(up / up_cap)
    return _product(_activation_rule(None, (gate,), a), _activation_rule(None, (up,), b))


class _CalledSilu(nn.Module):
    """SiLU called as a function (LFM2-MoE's ``Lfm2MoeExperts.act_fn = F.silu``) with the activation rule in its
    forward, ``R(gate) = R(silu(gate))``: no hook reaches a function call, so :class:`_Gate` uses this in its place.
    :meth:`_Gate.plain` calls :meth:`forward`, so this class's forward is the plain SiLU and ``__call__`` adds the
    rule."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.silu(x)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            y = nn.functional.silu(x)
        return _activation_rule(None, (x,), y)


def _computes_silu(act: Any) -> bool:
    """Whether ``act``, a function (not a module), computes SiLU on a float64 probe wide enough to tell it from GELU
    and the others; any other function is refused."""
    g = torch.Generator().manual_seed(0)
    x = 10 * torch.randn(256, generator=g, dtype=torch.float64)
    try:
        with torch.no_grad():
            y = act(x)
    except Exception:  # noqa: BLE001  # any failure: not the SiLU the rule assumes
        return False
    return isinstance(y, torch.Tensor) and y.shape == x.shape \
        and torch.allclose(y, nn.functional.silu(x), rtol=1e-9, atol=1e-12)


def _clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's ``(clamp(up, -l, l) + 1) * glu``, ``glu = g * sigmoid(alpha * g)``, ``g = clamp(gate, max=l)``
    (transformers' ``GptOssExperts._apply_gate``; MiniMax-M3's), with the backward of the LRP rules.

    The clamps and ``g * sigmoid(alpha * g)`` are element-wise functions of one neuron each: the activation
    rule (identity rule), ``R(gate) = R(glu)``, ``R(up) = R(clamp(up))`` (Voita et al. 2019, App. A.2; AttnLRP's
    identity rule, Achtibat et al. 2024, Sec. 3.3.1). The product is written as the sum ``u * glu + glu``
    (``u = clamp(up)``): the weighted-sum rule splits ``R`` between the two terms in proportion to them, and
    Ding et al.'s product rule splits ``u * glu`` between ``u`` and ``glu``, so all relevance reaches ``gate`` and
    ``up`` and none is kept by the ``+ 1``. (Read as a bias ``(u + 1) * glu``, the constant would keep a share
    ``1 / (u + 1)`` of the first factor's relevance, though it only lets ``glu`` through unscaled.)"""
    with torch.no_grad():
        g = gate.clamp(max=limit)
        glu = g * torch.sigmoid(g * alpha)
        u = up.clamp(min=-limit, max=limit)
    glu = _activation_rule(None, (gate,), glu)
    u = _activation_rule(None, (up,), u)
    return _product(u, glu) + glu


def _probe_gate(module: nn.Module, candidates: list[_Gate], compute) -> _Gate | None:
    """The first of ``candidates`` that ``compute`` (the module's own gate, on [tokens, 2 * inner] under no_grad)
    reproduces on a random input wide enough to reach the clamps; None where none does."""
    weight = next(module.parameters(), None)
    if weight is None or weight.is_meta or not weight.is_floating_point():
        return candidates[0] if candidates else None  # cannot run: the rule's check on every call decides
    g = torch.Generator().manual_seed(0)
    width = 2 * _inner(module)
    scale = max([10.0] + [3 * gate.clamp[0] for gate in candidates if gate.clamp is not None])  # past every clamp
    x = (scale * torch.randn((5, width), generator=g, dtype=torch.float64)).to(weight.device, weight.dtype)
    with torch.no_grad():
        try:
            output = compute(x)
        except Exception:  # noqa: BLE001  # any failure: not a gate the rules know
            return None
        for gate in candidates:
            expected = gate.plain(x)
            if isinstance(output, torch.Tensor) and output.shape == expected.shape \
                    and torch.allclose(output, expected, rtol=1e-4, atol=1e-6):
                return gate
    return None


def _inner(module: nn.Module) -> int:
    """The width of the experts' (or MLP's) inner layer: ``down_proj``'s input."""
    down = cast(Any, module).down_proj  # a Linear or the experts' [experts, ., .] weight
    if isinstance(down, nn.Linear):
        return down.in_features
    return int(down.shape[1] if _transposed(module) else down.shape[2])


def _gate_candidates(module: nn.Module, concatenated: bool) -> list[_Gate]:
    act = getattr(module, "act_fn", None)
    limits, bound = _limits(module), _clamp_bound(module)
    found = []
    softcaps = _softcaps(act)
    for layout in (concatenated, not concatenated):  # the layout the module says it has first
        if softcaps is not None:  # Inkling2's softcapped SwiGLU, act_fn(gate, up)
            found.append(_Gate(layout, softcaps=softcaps))
            continue
        if limits is not None:
            found.append(_Gate(layout, limits=limits))
        if bound is not None:  # its act_fn, or SiLU called as a function (HY-V4's and GLM-5-Next's experts: F.silu)
            clamped_act = act if isinstance(act, nn.Module) and _is_activation(act) else _CalledSilu() \
                if act is None or (not isinstance(act, nn.Module) and callable(act) and _computes_silu(act)) else None
            if clamped_act is not None:
                found.extend(_Gate(layout, act=clamped_act, clamp=(bound, where)) for where in _CLAMPED)
        if isinstance(act, nn.Module) and _is_activation(act):
            found.append(_Gate(layout, act=act))
        elif act is not None and not isinstance(act, nn.Module) and callable(act) and _computes_silu(act):
            found.append(_Gate(layout, act=_CalledSilu()))  # LFM2-MoE: act_fn = F.silu, a function
    return found


def _transposed(module: nn.Module) -> bool | None:
    """Whether the experts' weights are stored [experts, in, out] (GPT-OSS, Llama 4, Aria), from their shapes:
    ``gate_up_proj`` [experts, 2 x inner, hidden] and ``down_proj`` [experts, hidden, inner], or transposed
    [experts, hidden, 2 x inner] and [experts, inner, hidden] (never both: that needs inner 0); None: neither.
    LongCat-Flash's ``gate_up_proj`` has rows for its identity experts too (:func:`_identity_experts`)."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor) or gate_up.dim() != 3 \
            or down.dim() != 3 or gate_up.shape[0] != down.shape[0] + _identity_experts(module):
        return None
    if gate_up.shape[1] == 2 * down.shape[2] and gate_up.shape[2] == down.shape[1]:
        return False
    if gate_up.shape[2] == 2 * down.shape[1] and gate_up.shape[1] == down.shape[2]:
        return True
    return None


def _dense_experts(module: nn.Module) -> bool:
    """Whether ``module``'s forward takes the hidden states alone (Llama 4's ``Llama4TextExperts``): every expert
    runs on its own slice of rows, the routing weights applied to its input before (:func:`_experts_rule`)."""
    import inspect

    try:
        parameters = list(inspect.signature(type(module).forward).parameters)
    except (TypeError, ValueError):
        return False
    return len(parameters) == 2  # self, hidden_states


def _router(parent: nn.Module | None) -> nn.Module | None:
    """The router beside dense experts (Llama 4's ``Llama4TextMoe.router``), whose scores scale their input."""
    router = getattr(parent, "router", None) if parent is not None else None
    return router if isinstance(router, nn.Module) else None


def _glu_experts(module: nn.Module) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], nn.Module] | None:
    """DBRX's experts (``DbrxExperts``, transformers 5.24): ``mlp.w1``, ``mlp.v1`` and ``mlp.w2``, each ``[experts *
    ffn, hidden]``, viewed ``[experts, ffn, hidden]``; expert e computes ``(act(x w1_e^T) * x v1_e^T) w2_e``
    (``DbrxExpertGLU.forward``), ``act`` its ``activation_fn``. ``((w1, w2, v1) viewed, act)``, or None where the
    module is not laid out so."""
    mlp = getattr(module, "mlp", None)
    n, ffn = getattr(module, "num_experts", None), getattr(module, "ffn_hidden_size", None)
    weights = [getattr(mlp, name, None) for name in ("w1", "v1", "w2")]
    act = getattr(mlp, "activation_fn", None)
    if not isinstance(n, int) or not isinstance(ffn, int) or n <= 0 or ffn <= 0 or not isinstance(act, nn.Module) \
            or not _is_activation(act) or any(not isinstance(w, torch.Tensor) or w.dim() != 2 for w in weights):
        return None
    tensors = cast(list[torch.Tensor], weights)
    if any(w.shape != tensors[0].shape or w.shape[0] != n * ffn for w in tensors):
        return None
    w1, v1, w2 = (w.view(n, ffn, -1) for w in tensors)
    return (w1, v1, w2), act


def _flags_other_than(module: nn.Module, flags: dict[str, Any]) -> str:
    """The experts' layout flags (transformers' ``has_gate``, ``is_transposed`` ...) that ``module`` sets to another
    value than ``flags`` gives, as ``name=value, ...``; '' where none (a flag it lacks has the expected value)."""
    return ", ".join(f"{name}={getattr(module, name)}" for name, value in flags.items()
                     if getattr(module, name, value) != value)


def _experts_layout(module: nn.Module) -> tuple[bool, bool, _Gate] | str:
    """``(transposed, biases, gate)`` of a mixture-of-experts module, or why headlab has no rule for it.

    The rule (:func:`_experts_rule`) is for transformers' gated experts held as 3-d weights: ``gate_up_proj``
    ``[experts, 2 * inner, hidden]`` and ``down_proj`` ``[experts, hidden, inner]`` (Mixtral, Qwen-MoE,
    MiniMax-M3; LongCat-Flash with its identity experts after the gated ones, :func:`_identity_experts`) or
    transposed, ``[experts, hidden, 2 * inner]`` and ``[experts, inner, hidden]`` (GPT-OSS, Aria, Llama 4),
    with biases ``gate_up_proj_bias`` and ``down_proj_bias`` or none, no norm after the experts or an RMS norm
    (:func:`_post_expert_norm`), and a gate
    :class:`_Gate` knows (``act_fn(gate) * up``, or GPT-OSS's clamped SwiGLU), found by running the module's
    ``_apply_gate`` on a probe. Called as ``experts(hidden_states, top_k_index, top_k_weights)``,
    or as ``experts(hidden_states)`` with a ``router`` beside it (Llama 4, :func:`_moe_layout_problem`). DBRX's
    experts hold theirs in three 2-d matrices (:func:`_glu_experts`): ``act(gate) * up`` with ``[gate | up]``
    computed from them."""
    glu = _glu_experts(module)
    if glu is not None:
        return False, False, _Gate(True, act=glu[1])
    transposed = _transposed(module)
    if transposed is None:
        return ("its expert weights are not gate_up_proj [experts, 2 x inner, hidden] and down_proj "
                "[experts, hidden, inner], nor those transposed")
    if wrong := _flags_other_than(module, {"has_gate": True, "has_post_expert_norm": _post_expert_norm(module) is not None,
                                           "is_transposed": transposed}):
        return f"its layout differs ({wrong}{'' if _post_expert_norm(module) else ', no RMS norm post_expert_norm'})"
    biases = bool(getattr(module, "has_bias", False))
    if biases:
        gate_up, down = cast(Any, module).gate_up_proj, cast(Any, module).down_proj  # 3-d: _transposed
        experts, hidden, inner = down.shape[0], gate_up.shape[1 if transposed else 2], down.shape[1 if transposed else 2]
        shapes = {"gate_up_proj_bias": (experts, 2 * inner), "down_proj_bias": (experts, hidden)}
        if any(not isinstance(b := getattr(module, name, None), torch.Tensor) or tuple(b.shape) != shape
               for name, shape in shapes.items()):
            return "it says it has biases (has_bias) but not gate_up_proj_bias [experts, 2 x inner] and down_proj_bias"
    candidates = _gate_candidates(module, bool(getattr(module, "is_concatenated", True)))
    if not candidates:
        return ("it has no act_fn module nor an act_fn function computing SiLU, nor GPT-OSS's clamped SwiGLU "
                "(alpha and limit), nor a clamp bound (swiglu_limit or limit) without an act_fn")
    apply_gate = getattr(module, "_apply_gate", None)
    if apply_gate is None:  # its forward computes the gate inline: the rule checks the result on every call
        return transposed, biases, candidates[0]
    gate = _probe_gate(module, candidates, apply_gate)
    if gate is None:
        return ("it applies its own gate (_apply_gate), which computes none of act_fn(gate) * up, GPT-OSS's "
                f"clamped (up + 1) * gate * sigmoid(alpha * gate), {', '.join(_CLAMPED.values())}, {_SOFTCAPPED} on a probe")
    return transposed, biases, gate


def _post_expert_norm(module: nn.Module) -> nn.Module | None:
    """The RMS norm each expert's output passes through before its routing weight (transformers'
    ``has_post_expert_norm``: Muse Spark's ``post_expert_norm``), which :func:`_expert` calls as a module, so that
    its own rule (:func:`_rms_norm_rule`) holds its factor constant; None without one."""
    norm = getattr(module, "post_expert_norm", None)
    return norm if isinstance(norm, nn.Module) and _is_rms_norm(norm) else None


MODULE_EXPERTS = {"SwitchTransformersExperts": 2, "NllbMoeExperts": 2}
"""Experts held as child modules (an ``nn.ModuleDict`` of MLPs, read in transformers 5.24) -> the position of the
routing weights among their forward's arguments (Switch Transformers' ``routing_weights``, NLLB-MoE's
``router_probs``): the output is ``sum_k w_k E_k(x)`` over each token's routed experts (``index_add``; NLLB-MoE's
times the constant ``1 - moe_token_dropout`` in evaluation mode), each expert an MLP with rules of its own
(``wi``/``fc1``, the activation, ``wo``/``fc2``). The routing weights held constant (:func:`_detach_routing_weights`),
as the attention weights are, it is a weighted sum of the experts' outputs. Before session 41, refused; experts with
biases are explained where headlab knows which batch rows each expert runs on (:data:`ROUTED_ROWS`, NLLB-MoE's since
session 42), refused otherwise (:func:`_module_experts_problem`)."""


def _nllb_moe_rows(module: nn.Module, hidden_states: torch.Tensor, router_mask: torch.Tensor,
                   *_: Any) -> dict[str, torch.Tensor]:
    """The batch rows (of the flattened ``[tokens, d]`` hidden states) each expert of ``NllbMoeExperts`` runs on, in
    its order, as its forward gathers them (read in transformers 5.24, models/nllb_moe, ``NllbMoeExperts.forward``:
    ``expert_mask = one_hot(router_mask, num_experts).permute(2, 1, 0)``, then for every expert ``e`` with a row,
    ``idx, top_x = where(expert_mask[e])`` and ``expert_e(hidden_states[top_x])``: a token may come more than once)."""
    mask = nn.functional.one_hot(router_mask, num_classes=int(cast(Any, module).num_experts)).permute(2, 1, 0)
    return {f"expert_{e}": torch.where(mask[e])[1] for e in range(mask.shape[0]) if bool(mask[e].any())}


ROUTED_ROWS: dict[str, Callable[..., dict[str, torch.Tensor]]] = {"NllbMoeExperts": _nllb_moe_rows}
""":data:`MODULE_EXPERTS` classes whose experts have biases -> ``rows(module, *args)``: the batch rows each expert (by
child name) runs on, from the arguments of the module's forward. lrp.py's bias probes give those biases the probe of
each row's token (``s[rows]`` of a per-token ``s``), so that their share goes to the sentence the token is in
(:func:`routed_expert_rows`); before session 42, NLLB-MoE's were refused (:func:`_routed_biases_problem`)."""


def routed_expert_rows(module: nn.Module, args: tuple) -> dict[str, torch.Tensor] | None:
    """:data:`ROUTED_ROWS`' rows of ``module`` called with ``args`` (None: not such a module)."""
    rows = ROUTED_ROWS.get(type(module).__name__)
    return None if rows is None else rows(module, *args)


def _module_experts_problem(module: nn.Module) -> str | None:
    """Why :data:`MODULE_EXPERTS`' rule does not fit ``module`` (None: it does): its experts must be child modules
    and its own parameters none; their biases need the rows each expert runs on (:data:`ROUTED_ROWS`)."""
    if next(module.parameters(recurse=False), None) is not None or not len(list(module.children())):
        return "its experts are not child modules without parameters of its own beside them"
    return None if type(module).__name__ in ROUTED_ROWS else _routed_biases_problem(module)


def _routed_biases_problem(module: nn.Module) -> str | None:
    """Why the biases of experts held as modules cannot be measured (None: they have none), unless their rows are
    known (:data:`ROUTED_ROWS`). Each expert runs on the rows of the tokens routed to it, gathered in whatever order
    its layer chooses (NLLB-MoE's by expert mask; a grouped implementation's sorted by score), where the bias probes
    (lrp.py) give a module one probe per row and read the rows batch-major: a count of rows that is a multiple of the
    batch size would send a bias's share to the wrong sentences, within the conservation check's tolerance when the
    biases are small."""
    biased = sorted({name.rpartition(".")[0].rpartition(".")[2] for name, p in module.named_parameters()
                     if name.endswith("bias") and p is not None})
    if not biased:
        return None
    return (f"its experts' biases ({', '.join(biased)}) apply to the tokens routed to each expert only, a subset "
            "of the batch's rows in the order its layer gathers them, where headlab's bias probes measure a bias's "
            "share per token of the batch, read batch-major (Switch Transformers' experts, without biases, are "
            "explained, and NLLB-MoE's, whose rows headlab computes from its router mask)")


def _is_expert_list(module: nn.Module, path: str) -> bool:
    """Experts held as a list or dict of modules under the name ``experts`` (a model's own MoE layer, remote code's),
    whose layer runs each on the rows routed to it; transformers' own are :data:`MODULE_EXPERTS` classes."""
    return isinstance(module, (nn.ModuleList, nn.ModuleDict)) and path.rpartition(".")[2] == "experts" \
        and type(module).__name__ not in MODULE_EXPERTS


def _detach_routing_weights(module, args, kwargs):
    """:data:`MODULE_EXPERTS`' routing weights held constant (positional, as their layer passes them)."""
    position = MODULE_EXPERTS[type(module).__name__]
    if len(args) <= position or not isinstance(args[position], torch.Tensor):
        raise HeadlabError(f"LRP: {type(module).__name__} is not called with its routing weights as argument "
                           f"{position + 1}; headlab has no LRP rule for it")
    return (*args[:position], args[position].detach(), *args[position + 1:]), kwargs


def _moe_layout_problem(module: nn.Module, parent: nn.Module | None = None) -> str | None:
    """Why headlab has no rule for a mixture-of-experts module (None: it has one): :func:`_experts_layout`, and
    experts called on the hidden states alone need a ``router`` beside them (in ``parent``) to hold constant;
    non-gated experts (Nemotron-H): :func:`_non_gated_problem`."""
    if type(module).__name__ in MODULE_EXPERTS:
        return _module_experts_problem(module)
    if _is_non_gated(module):
        return _non_gated_problem(module)
    if (experts := mixer_rules.experts_rule_for(module)) is not None:  # Inkling's shared experts
        return experts.problem(module)
    layout = _experts_layout(module)
    if isinstance(layout, str):
        return layout
    if _dense_experts(module) and _router(parent) is None:
        return ("it is called on the hidden states alone, its routing weights applied outside it, and there is no "
                "router module beside it to hold them constant")
    return None


def _identity_experts(module: nn.Module) -> int:
    """How many identity ("zero computation") experts follow the gated ones: LongCat-Flash's ``zero_expert_num``,
    whose forward routes expert ``e >= n_routed_experts`` to ``identity_expert`` (an ``nn.Identity``); 0 for others."""
    count = getattr(module, "zero_expert_num", 0)
    if isinstance(count, int) and count > 0 and isinstance(getattr(module, "identity_expert", None), nn.Identity):
        return count
    return 0


def _is_experts(module: nn.Module) -> bool:
    """A module holding the weights of several experts (3-d ``...proj`` parameters, or an ``...Experts`` class)."""
    three_d = any(p.dim() == 3 and name.endswith("proj") for name, p in module.named_parameters(recurse=False))
    return three_d or type(module).__name__.endswith("Experts")


def routed_experts(model: nn.Module) -> list[nn.Module]:
    """The mixture-of-experts modules of ``model`` (each a set of gated MLPs, see :func:`_experts_rule`, or of
    Nemotron-H's non-gated ones, :func:`_non_gated_rule`)."""
    return [module for module in model.modules() if _is_experts(module)]


_EXPERT_BIAS_PROBES: dict[int, Any] = {}  # id(experts module) -> probe(x): see expert_bias_probes


@contextmanager
def expert_bias_probes(model: nn.Module, probe) -> Iterator[None]:
    """Inside, the experts of ``model`` with biases (GPT-OSS's ``gate_up_proj_bias`` and ``down_proj_bias``, which
    no module's ``bias`` holds) measure the relevance their biases keep: ``probe(x)`` (``x`` the experts' input,
    ``[tokens, hidden]``) gives ``s``, ones ``[tokens, 1]`` that require grad, or None, and each expert's biases
    are added as ``b + (b * s - stop(b * s))``, so that ``s * dy/ds`` is their relevance per token
    (lrp.py's bias probes, which do the same for every module's ``bias``)."""
    ids = [id(module) for module in routed_experts(model) if getattr(module, "has_bias", False)]
    try:
        for key in ids:
            _EXPERT_BIAS_PROBES[key] = probe
        yield
    finally:
        for key in ids:
            _EXPERT_BIAS_PROBES.pop(key, None)


def _expert(module: Any, x: torch.Tensor, expert: int, transposed: bool, biases: bool, gate: _Gate,
            probe: torch.Tensor | None = None) -> torch.Tensor:
    """One expert on its rows ``x``: ``down(gate(gate_up x + b) ) + b'`` with the rules' backward; ``probe``
    (``[rows, 1]`` ones) measures what the biases keep (:func:`expert_bias_probes`)."""
    glu = _glu_experts(module)
    if glu is not None:  # DBRX: [x w1_e^T | x v1_e^T], then (act(gate) * up) w2_e
        (w1, v1, w2), _ = glu
        return gate(torch.cat([nn.functional.linear(x, w1[expert]), nn.functional.linear(x, v1[expert])], -1)) \
            @ w2[expert]

    def project(h, weight, bias):
        out = h @ weight if transposed else nn.functional.linear(h, weight)
        if bias is None:
            return out
        kept = bias * probe if probe is not None else None
        return out + bias if kept is None else out + bias + (kept - kept.detach())

    gate_up = project(x, module.gate_up_proj[expert], module.gate_up_proj_bias[expert] if biases else None)
    out = project(gate(gate_up), module.down_proj[expert], module.down_proj_bias[expert] if biases else None)
    norm = _post_expert_norm(module) if getattr(module, "has_post_expert_norm", False) else None
    return out if norm is None else norm(out)


_EXPERTS_ARGUMENTS = {"hidden_states": "hidden_states", "top_k_index": "top_k_index", "top_k_weights": "top_k_weights",
                      "router_indices": "top_k_index", "routing_weights": "top_k_weights"}  # GPT-OSS's names


def _experts_rule(module: Any, args, kwargs, output):  # Any: transformers' experts module, its weights by name
    """Routed gated experts: ``sum_k w_k down_e(act(gate_e x) * up_e x)`` over each token's top-k
    experts ``e`` with routing weights ``w_k``. Each expert gets the rules of a gated MLP (the
    activation rule and Ding et al.'s product rule; GPT-OSS's gate those of :func:`_clamped_swiglu`);
    the routing weights are constants of the backward pass, as the attention weights are (Voita et al.
    2019, App. A: the weights of a weighted sum), so all relevance flows through the experts; a bias keeps
    its share, as every bias does; an identity expert (LongCat-Flash's :func:`_identity_experts`) is
    ``w_k x``. Llama 4's experts take their input already scaled by the routing weights (``x * w_e``, the
    router's output held constant by :func:`lrp_rules`) and run every expert on its own slice of rows.
    The output is recomputed so, checked against the module's own (any implementation), and only its
    backward is used. Non-gated experts (Nemotron-H) have a rule of their own, :func:`_non_gated_rule`."""
    if _is_non_gated(module):
        return _non_gated_rule(module, args, kwargs, output)
    if (experts := mixer_rules.experts_rule_for(module)) is not None:  # Inkling's, scaled by the router's gammas
        return experts.rule(module, args, kwargs, output)
    layout = _experts_layout(module)
    if isinstance(layout, str):
        raise HeadlabError(f"LRP: no rule for the mixture-of-experts module {type(module).__name__}: {layout}")
    transposed, biases, gate = layout
    names = list(_EXPERTS_ARGUMENTS)
    given = {_EXPERTS_ARGUMENTS[name]: value for name, value in
             [*zip(("hidden_states", "top_k_index", "top_k_weights"), args), *kwargs.items()] if name in names}
    dense = _dense_experts(module)
    if len(given) != (1 if dense else 3) or not isinstance(output, torch.Tensor):
        raise HeadlabError(f"LRP: {type(module).__name__} is not called as experts(hidden_states, top_k_index, "
                           "top_k_weights); headlab has no LRP rule for it")
    x = given["hidden_states"]
    _check_finite(module, x)  # NaN fails allclose below: say so, not that the experts compute something else
    glu = _glu_experts(module)
    if glu is not None:  # DBRX's experts take [batch, seq, hidden] and route its rows flattened
        x = x.reshape(-1, x.shape[-1])
    # the gated ones: LongCat-Flash's identity experts follow
    n_experts = glu[0][0].shape[0] if glu is not None else module.down_proj.shape[0]
    if dense:  # Llama 4: rows [expert 0's tokens; expert 1's; ...], each already scaled by its routing weight
        rows = x.view(n_experts, -1, x.shape[-1])
        surrogate = torch.cat([_expert(module, rows[e], e, transposed, biases, gate) for e in range(n_experts)])
    else:
        index, weights = given["top_k_index"], given["top_k_weights"].detach()
        probe = _EXPERT_BIAS_PROBES.get(id(module))
        s = probe(x) if probe is not None and biases else None
        surrogate = torch.zeros_like(x)
        for expert in range(n_experts + _identity_experts(module)):
            token, slot = torch.where(index == expert)
            if not len(token):
                continue
            if expert >= n_experts:  # an identity expert (LongCat-Flash): w_k x, linear once w_k is a constant
                routed = x[token] * weights[token, slot, None]
                surrogate = surrogate.index_add(0, token, routed.to(surrogate.dtype))
                continue
            routed = _expert(module, x[token], expert, transposed, biases, gate, None if s is None else s[token]) \
                * weights[token, slot, None]
            surrogate = surrogate.index_add(0, token, routed.to(surrogate.dtype))
    if glu is not None and isinstance(output, torch.Tensor) and surrogate.numel() == output.numel():
        surrogate = surrogate.view(output.shape)
    with torch.no_grad():
        if surrogate.shape != output.shape or not torch.allclose(surrogate, output, rtol=1e-3, atol=1e-5):
            raise HeadlabError(f"LRP: {type(module).__name__} is not a sum of routed gated experts "
                               f"(w_k down({gate.describe()})); headlab has no LRP rule for it")
    return _swap_backward(output, surrogate)


# -- non-gated experts (Nemotron-H's NemotronHExperts): E_k(x) = down_k(act(up_k x)) ---------------------------
def _is_non_gated(module: nn.Module) -> bool:
    """Experts that say they have no gate (transformers' ``has_gate=False``: Nemotron-H), or hold an ``up_proj``
    tensor and neither ``gate_up_proj`` nor ``gate_proj`` (Inkling's shared experts hold ``gate_proj``, ``up_proj``
    and ``down_proj``, gated): :func:`_non_gated_problem` and :func:`_non_gated_rule` are theirs."""
    return getattr(module, "has_gate", True) is False or (
        isinstance(getattr(module, "up_proj", None), torch.Tensor)
        and all(getattr(module, name, None) is None for name in ("gate_up_proj", "gate_proj")))


def _non_gated_expert(module: Any, x: torch.Tensor, expert: int, act) -> torch.Tensor:
    """Expert ``expert`` on its rows ``x``: ``down_e(act(up_e x))`` (``act`` the module's ``act_fn``: called as a
    module it carries the activation rule's hook, its ``forward`` the plain function)."""
    return nn.functional.linear(act(nn.functional.linear(x, module.up_proj[expert])), module.down_proj[expert])


def _non_gated_sum(module: Any, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, act) -> torch.Tensor:
    """``sum_k w_k down_e(act(up_e x))`` over each row's experts ``e = index[:, k]``, in ``x``'s type."""
    out = torch.zeros_like(x)
    for expert in range(module.up_proj.shape[0]):
        token, slot = torch.where(index == expert)
        if len(token):
            routed = _non_gated_expert(module, x[token], expert, act) * weights[token, slot, None].to(x.dtype)
            out = out.index_add(0, token, routed)
    return out


def _non_gated_problem(module: nn.Module) -> str | None:
    """Why headlab has no rule for non-gated experts (None: it has one). The rule (:func:`_non_gated_rule`) is for
    ``up_proj`` ``[experts, inner, in]`` and ``down_proj`` ``[experts, in, inner]`` (transformers 5.24's
    ``NemotronHExperts``, ``is_transposed`` False), no biases, no norm after the experts, an activation module
    ``act_fn``, and a forward that computes ``sum_k w_k down_e(act_fn(up_e x))``: probed on a random input."""
    up, down = getattr(module, "up_proj", None), getattr(module, "down_proj", None)
    if not isinstance(up, torch.Tensor) or not isinstance(down, torch.Tensor) or up.dim() != 3 or down.dim() != 3 \
            or down.shape[0] != up.shape[0] or down.shape[1] != up.shape[2] or down.shape[2] != up.shape[1]:
        return ("headlab's rule for non-gated experts is for up_proj [experts, inner, in] and down_proj "
                "[experts, in, inner] (Nemotron-H); this module's expert weights are not laid out so")
    if wrong := _flags_other_than(module, {"has_bias": False, "has_post_expert_norm": False, "is_transposed": False}):
        return f"its non-gated layout differs ({wrong})"
    act = getattr(module, "act_fn", None)
    if not isinstance(act, nn.Module) or not _is_activation(act):
        return "its non-gated experts have no act_fn activation module for the activation rule"
    if not _computes_non_gated(module, act):
        return ("its forward does not compute sum_k w_k down_e(act_fn(up_e x)) on a probe (non-gated experts, "
                "Nemotron-H's), so relevance would not be conserved")
    return None


def _computes_non_gated(module: Any, act: nn.Module) -> bool:
    """Whether ``module``'s own forward (transformers' reference loop, which LRP runs: :func:`lrp_rules`) is
    ``sum_k w_k down_e(act(up_e x))`` on a random input routed to two experts a row; True where it cannot run
    (weights on the meta device): :func:`_non_gated_rule` checks its result on every call."""
    weight = module.up_proj
    if weight.is_meta or not weight.is_floating_point():
        return True
    g = torch.Generator().manual_seed(0)
    n, width = weight.shape[0], weight.shape[2]
    x = torch.randn((6, width), generator=g, dtype=torch.float64).to(weight.device, weight.dtype)
    index = torch.stack([torch.arange(6) % n, (torch.arange(6) + 1) % n], -1).to(weight.device)
    weights = torch.rand((6, 2), generator=g, dtype=torch.float64).to(weight.device, weight.dtype)
    forward = getattr(type(module).forward, "__wrapped__", type(module).forward)  # not the kernels' dispatch
    with torch.no_grad():
        try:
            output = forward(module, x, index, weights)
        except Exception:  # noqa: BLE001  # any failure: not the experts the rule assumes
            return False
        expected = _non_gated_sum(module, x, index, weights, act.forward)
    return isinstance(output, torch.Tensor) and output.shape == expected.shape \
        and torch.allclose(output, expected, rtol=1e-3, atol=1e-5)


def _non_gated_rule(module: Any, args, kwargs, output):
    """Routed non-gated experts (Nemotron-H): ``sum_k w_k down_e(act(up_e x))``. ``act`` (relu^2 in Nemotron-H,
    not positively homogeneous of degree one) gets the activation rule, ``R(u) = R(act(u))`` (Voita et al. 2019,
    App. A.2), as every activation does; the routing weights ``w_k`` are detached, constants as for the gated
    experts (:func:`_experts_rule`); the rest is weighted sums. No product of two neurons appears. The output is
    recomputed so, checked against the module's own, and only its backward is used."""
    names = list(_EXPERTS_ARGUMENTS)
    given = {_EXPERTS_ARGUMENTS[name]: value for name, value in
             [*zip(("hidden_states", "top_k_index", "top_k_weights"), args), *kwargs.items()] if name in names}
    if len(given) != 3 or not isinstance(output, torch.Tensor):
        raise HeadlabError(f"LRP: {type(module).__name__} is not called as experts(hidden_states, top_k_index, "
                           "top_k_weights); headlab has no LRP rule for it")
    x = given["hidden_states"]
    _check_finite(module, x)
    surrogate = _non_gated_sum(module, x, given["top_k_index"], given["top_k_weights"].detach(), module.act_fn)
    with torch.no_grad():
        if surrogate.shape != output.shape or not torch.allclose(surrogate, output, rtol=1e-3, atol=1e-5):
            raise HeadlabError(f"LRP: {type(module).__name__} is not a sum of routed non-gated experts "
                               "(w_k down(act_fn(up x))); headlab has no LRP rule for it")
    return _swap_backward(output, surrogate)


def _detach_outputs(module, args, output):
    """A router's outputs (a tuple: scores and logits) held constant, as routing weights are."""
    if isinstance(output, tuple):
        return tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in output)
    return output.detach()


class _ActivationBetween:
    """An activation called as a function between two modules (RoBERTa's LM head:
    ``layer_norm(gelu(dense(x)))``): the same rule as :func:`_activation_rule`, applied in the
    pre-hook of the module that receives the activation's output."""

    def __init__(self) -> None:
        self.x: torch.Tensor | None = None

    def keep(self, module, args, output):
        self.x = output

    def pre(self, module, args):
        u, x = args[0], self.x
        self.x = None
        if x is None or x.shape != u.shape:
            raise HeadlabError(f"LRP: cannot find the input of the activation before {type(module).__name__}")
        return (_activation_rule(None, (x,), u), *args[1:])


class _ActivationAfter:
    """An activation called as a function on a module's only child's output (ESM's
    ``EsmIntermediate``: ``gelu(dense(x))``): the rule of :func:`_activation_rule`, applied in the
    module's forward hook to the child's output it kept."""

    def __init__(self) -> None:
        self.x: torch.Tensor | None = None

    def keep(self, module, args, output):
        self.x = output

    def after(self, module, args, output):
        x, self.x = self.x, None
        if x is None or not isinstance(output, torch.Tensor) or x.shape != output.shape:
            raise HeadlabError(f"LRP: cannot find the input of the activation in {type(module).__name__}")
        return _activation_rule(module, (x,), output)


def _intermediate_activations(model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """``(module, child)`` of BERT-style ``...Intermediate`` modules that hold one Linear and no
    activation module: their forward applies the activation as a function (ESM)."""
    found: list[tuple[nn.Module, nn.Module]] = []
    for module in model.modules():
        children = list(module.children())
        if type(module).__name__.endswith("Intermediate") and len(children) == 1 \
                and isinstance(children[0], nn.Linear) and next(module.parameters(recurse=False), None) is None:
            found.append((module, children[0]))
        # DeBERTa's (v1, v2) ContextPooler: ACT2FN[pooler_hidden_act](dense(dropout(x[:, 0]))), the activation
        # built anew in its forward (no module of the model to hook): without the rule, a classifier's LRP did not
        # conserve (ratios 0.99-1.03, refused after the work)
        elif type(module).__name__ == "ContextPooler" and isinstance(getattr(module, "dense", None), nn.Linear):
            found.append((module, cast(nn.Module, module.dense)))
    return found


# Modules whose forward applies an activation function (not a module) between two children.
_FUNCTIONAL_ACTIVATIONS = (("dense", "layer_norm", "decoder"),)


def _functional_activations(model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    found = []
    for module in model.modules():
        # RoBERTa's classification head and its copies (I-BERT's, XLM-R's...: transformers 5.24):
        # out_proj(dropout(torch.tanh(dense(dropout(x[:, 0]))))), tanh a function (ELECTRA's holds an activation module)
        head = [getattr(module, name, None) for name in ("dense", "out_proj")]
        if type(module).__name__.endswith("ClassificationHead") and all(isinstance(p, nn.Linear) for p in head) \
                and {name for name, _ in module.named_children()} <= {"dense", "dropout", "out_proj"} \
                and all(isinstance(child, (nn.Linear, nn.Dropout)) for child in module.children()):
            found.append((cast(nn.Module, head[0]), cast(nn.Module, head[1])))
            continue
        if not type(module).__name__.endswith("LMHead"):
            continue
        for before, after, _ in _FUNCTIONAL_ACTIVATIONS:
            parts: list = [getattr(module, name, None) for name in (before, after)]
            has_act_module = any(_is_activation(child) for child in module.children())
            if all(isinstance(p, nn.Module) for p in parts) and not has_act_module:
                found.append((parts[0], parts[1]))
    return found


# Gates that scale a shared expert's output (Qwen2-MoE: ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``).
_EXPERT_GATES = ("shared_expert_gate",)

_GATED_NAMES = (("gate_proj", "up_proj", "down_proj", "act_fn"), ("wi_0", "wi_1", "wo", "act"),
                ("gate_proj", "up_proj", "down_proj", "activation_fn"))
# Norms a gated MLP applies to its product before down (BitNet's BitNetMLP, transformers 5.24:
# ``down_proj(ffn_sub_norm(act_fn(gate_proj(x)) * up_proj(x)))``): the product rule acts at the norm's input.
_PRODUCT_NORMS = ("ffn_sub_norm",)
# Names that are new to the rule (Llama 4's Llama4TextMLP): down's input is checked to be act(gate x) * up x.
_CHECKED_GATED_NAMES = {"activation_fn"}
# One projection computing [gate | up]: ``down(up * act(gate))``, its two halves by chunk(2) (Phi-3;
# ModernBERT's ``Wo(act(input) * gate)`` with ``input, gate = Wi(x).chunk(2)``; the Granite MoE families' shared MLP,
# ``output_linear(activation(h[0]) * h[1])`` with ``h = input_linear(x).chunk(2)``).
_FUSED_GATED_NAMES = (("gate_up_proj", "down_proj", "activation_fn"), ("Wi", "Wo", "act"),
                      ("input_linear", "output_linear", "activation"))


# The same under names that ungated MLPs use too (Moshi's ``fc2(act(h[..., 0, :]) * h[..., 1, :])`` with
# ``h = fc1(x).view(..., 2, -1)``): gated only where fc1 is twice as wide as fc2's input.
_HALVED_GATED_NAMES = (("fc1", "fc2", "activation_fn"),)


def fused_gated_mlps(model: nn.Module) -> list[tuple[nn.Module, nn.Module, nn.Module]]:
    found = []
    for module in model.modules():
        for gate_up, down, act in _FUSED_GATED_NAMES:
            parts: list = [getattr(module, name, None) for name in (act, gate_up, down)]
            if all(isinstance(p, nn.Module) for p in parts):
                found.append((parts[0], parts[1], parts[2]))
        for gate_up, down, act in _HALVED_GATED_NAMES:
            parts = [getattr(module, name, None) for name in (act, gate_up, down)]
            if isinstance(parts[0], nn.Module) and all(isinstance(p, nn.Linear) for p in parts[1:]) \
                    and parts[1].out_features == 2 * parts[2].in_features:
                found.append((parts[0], parts[1], parts[2]))
    return found


def adapted_gated_mlps(model: nn.Module) -> list[tuple[nn.Module, nn.Module, list[nn.Module], nn.Module]]:
    """``(act_fn, gate_up_proj, adapters, down_proj)`` of every gated MLP whose ``[gate | up]`` is ``gate_up_proj``'s
    output plus a LoRA adapter's, one adapter per depth (Zamba 2's ``Zamba2MLP``, transformers 5.24:
    ``down_proj(act_fn(h[0]) * h[1])``, ``h = (gate_up_proj(x) + gate_up_proj_adapter_list[i](x)).chunk(2)``)."""
    found = []
    for module in model.modules():
        parts: list = [getattr(module, name, None) for name in ("act_fn", "gate_up_proj", "down_proj")]
        adapters = getattr(module, "gate_up_proj_adapter_list", None)
        if all(isinstance(p, nn.Module) for p in parts) and isinstance(adapters, nn.ModuleList):
            found.append((parts[0], parts[1], list(adapters), parts[2]))
    return found


class _AdaptedGatedProduct(_CheckedGatedProduct):
    """:class:`_CheckedGatedProduct` for :func:`adapted_gated_mlps`: ``up`` is the second half of ``gate_up_proj``'s
    output plus that of the adapter that ran, both weighted sums, whose sum ``b`` is the product's factor."""

    formula = "act(h0) * h1 with h = gate_up_proj(x) + adapter(x)"

    def keep_up(self, module, args, output):
        self.b = output.chunk(2, dim=-1)[1]

    def add_adapter(self, module, args, output):
        if self.b is None:
            raise HeadlabError(f"LRP: an adapter {type(module).__name__} ran before its gate_up_proj")
        self.b = self.b + output.chunk(2, dim=-1)[1]


def _register_adapted(model: nn.Module, handles: HookHandles) -> None:
    """The hooks of :class:`_AdaptedGatedProduct`. (Zamba 2's attention adapters, ``use_shared_attention_adapter``,
    are the attention's head rows, ``adapters.families.QKV_ADAPTERS``: :func:`_attention_hooks`.)"""
    for act, gate_up, adapters, down in adapted_gated_mlps(model):
        product = _AdaptedGatedProduct()
        # after the activation rule (hooked before), so that it keeps the rule's output
        handles.append(act.register_forward_hook(product.keep_a))
        handles.append(gate_up.register_forward_hook(product.keep_up))
        handles.extend(adapter.register_forward_hook(product.add_adapter) for adapter in adapters)
        handles.append(down.register_forward_pre_hook(product.pre_down))


def gated_mlps(model: nn.Module) -> list[tuple[nn.Module, nn.Module, nn.Module]]:
    return [(act, up, down) for act, up, down, _ in _gated_mlps(model)]


def _gated_mlps(model: nn.Module) -> list[tuple[nn.Module, nn.Module, nn.Module, bool]]:
    """``(act, up, down, checked)`` of every gated MLP found by its modules' names (``down``: the module that reads the
    product, its norm where it has one, :data:`_PRODUCT_NORMS`); ``checked``: its product is
    checked on every call (:class:`_CheckedGatedProduct`)."""
    found = []
    for module in model.modules():
        for gate, up, down, act in _GATED_NAMES:
            parts: list = [getattr(module, name, None) for name in (gate, up, down, act)]
            if all(isinstance(p, nn.Module) for p in parts):
                # a norm over the product before down (BitNet's ffn_sub_norm): the product is its input, and the
                # norm keeps its own rule on its output (checked on every call: the name is the only evidence)
                norm = next((n for name in _PRODUCT_NORMS if isinstance(n := getattr(module, name, None), nn.Module)
                             and norm_rule(n) is not None), None)
                found.append((parts[3], parts[1], norm if norm is not None else parts[2],
                              norm is not None or act in _CHECKED_GATED_NAMES or _clamp_bound(module) is not None))
                break
    return found


def _dense_clamp(module: nn.Module) -> tuple[float, str] | str | None:
    """Where a gated MLP ``down_proj(act_fn(gate_proj x) * up_proj x)`` with a clamp bound (:func:`_clamp_bound`)
    clamps: ``(bound, where)`` of :data:`_CLAMPED` that its own forward computes on a probe past the bound (GLM-5-Next's
    and DeepSeek-V4's MLPs clamp the gate before act_fn, Step-3.7's after); None where it has no bound, or no clamp
    acts on the probe (the plain rule fits); otherwise why no rule fits."""
    parts = [getattr(module, name, None) for name in ("gate_proj", "up_proj", "down_proj", "act_fn")]
    bound = _clamp_bound(module)
    if bound is None or not all(isinstance(p, nn.Module) for p in parts):
        return None
    gate, up, down, act = cast(list[nn.Module], parts)
    if not _is_activation(act):
        return None
    weight = next(gate.parameters(), None)
    if weight is None or weight.is_meta or not weight.is_floating_point():
        return None  # cannot run: the plain rule's product is checked on every call (_gated_mlps)
    g = torch.Generator().manual_seed(0)
    x = torch.randn((2, 3, weight.shape[1]), generator=g, dtype=torch.float64).to(weight)
    with torch.no_grad():
        reach = gate.forward(x).abs().amax().clamp(min=1e-12)
        x = x * max(1.0, 3 * bound / float(reach))  # past the bound (the biases are not scaled: some reach it)
        try:
            output = type(module).forward(module, x)
        except Exception as error:  # noqa: BLE001  # any failure: not the MLP the rule assumes
            return f"its forward failed on a probe ({type(error).__name__}: {error})"
        g_x, u_x = gate.forward(x), up.forward(x)
        for where in _CLAMPED:
            expected = down.forward(_clamped_gate_value(g_x, u_x, act.forward, bound, where))
            if output.shape == expected.shape and torch.allclose(output, expected, rtol=1e-4, atol=1e-6):
                return bound, where
        if torch.allclose(output, down.forward(act.forward(g_x) * u_x), rtol=1e-4, atol=1e-6):
            return None
    return (f"a gated MLP with a clamp bound ({bound:g}) whose forward computes neither down(act(gate x) * up x) "
            f"nor down of {' nor '.join(_CLAMPED.values())} on a probe, so the activation and product rules cannot "
            "be applied to it and relevance would not be conserved")


def clamped_dense_mlps(model: nn.Module) -> list[tuple[nn.Module, nn.Module, nn.Module, float, str]]:
    """``(gate_proj, act_fn, up_proj, bound, where)`` of every gated MLP whose forward clamps (:func:`_dense_clamp`);
    :func:`lrp_rules` gives each clamp the identity rule (:class:`_ClampIdentity`) on the output of the module before
    it, so that the forward's own clamp after it changes nothing."""
    found = []
    for module in model.modules():
        if isinstance(clamp := _dense_clamp(module), tuple):
            parts = [cast(nn.Module, getattr(module, name)) for name in ("gate_proj", "act_fn", "up_proj")]
            found.append((parts[0], parts[1], parts[2], *clamp))
    return found


def _clamped_gated_parts(module: nn.Module) -> tuple[nn.Linear, nn.Linear] | None:
    """``(gate_up_proj, down_proj)`` of a dense MLP with GPT-OSS's clamped SwiGLU computed in its forward, no
    activation module (MiniMax-M3's ``MiniMaxM3VLDenseMLP``, its shared experts), None for any other module."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not isinstance(gate_up, nn.Linear) or not isinstance(down, nn.Linear) or _limits(module) is None \
            or gate_up.out_features != 2 * down.in_features or any(_is_activation(c) for c in module.children()):
        return None
    return gate_up, down


def _clamped_gate(module: nn.Module) -> _Gate | None:
    """The :class:`_Gate` whose formula ``module``'s own forward computes, ``down(gate(gate_up x))``, on a random
    input (under no_grad), [gate; up] or interleaved; None: neither. Weights on the meta device: [gate; up],
    checked on every call by the rule."""
    parts = _clamped_gated_parts(module)
    assert parts is not None
    gate_up, down = parts
    candidates = [_Gate(layout, limits=_limits(module)) for layout in (True, False)]
    if gate_up.weight.is_meta or not gate_up.weight.is_floating_point():
        return candidates[0]
    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn((2, 3, gate_up.in_features), generator=g, dtype=torch.float64)).to(gate_up.weight)
    with torch.no_grad():
        try:
            output = type(module).forward(module, x)
        except Exception:  # noqa: BLE001  # any failure: not the MLP the rule assumes
            return None
        for gate in candidates:
            expected = down.forward(gate.plain(gate_up.forward(x)))
            if isinstance(output, torch.Tensor) and output.shape == expected.shape \
                    and torch.allclose(output, expected, rtol=1e-4, atol=1e-6):
                return gate
    return None


def clamped_gated_mlps(model: nn.Module) -> list[tuple[nn.Linear, nn.Linear, _Gate]]:
    """``(gate_up_proj, down_proj, gate)`` of every dense MLP of ``model`` with GPT-OSS's clamped SwiGLU
    (:func:`_clamped_gated_parts`) whose forward computes it (the others are refused, :func:`_no_rule`)."""
    found = []
    for module in model.modules():
        if (parts := _clamped_gated_parts(module)) is not None and (gate := _clamped_gate(module)) is not None:
            found.append((*parts, gate))
    return found


class _ClampedGatedProduct:
    """The rules of :func:`_clamped_swiglu` for a dense MLP ``down(gate(gate_up x))``: ``gate_up``'s output is
    kept, and the pre-hook of ``down`` checks that its input is the gate of it and gives it the rules' backward."""

    def __init__(self, gate: _Gate) -> None:
        self.gate = gate
        self.gate_up: torch.Tensor | None = None

    def keep(self, module, args, output):
        self.gate_up = output

    def pre_down(self, module, args):
        v, gate_up = args[0], self.gate_up
        self.gate_up = None
        if gate_up is None or gate_up.shape[:-1] != v.shape[:-1]:
            raise HeadlabError(f"LRP: cannot find the gate and up projections before {type(module).__name__}")
        with torch.no_grad():
            if not torch.allclose(self.gate.plain(gate_up), v, rtol=1e-3, atol=1e-5):
                raise HeadlabError(f"LRP: the input of {type(module).__name__} is not {self.gate.describe()} of the "
                                   "gate and up projection; headlab has no LRP rule for this gated MLP")
        return (_swap_backward(v, self.gate(gate_up).to(v.dtype)), *args[1:])


def register_hooks(hooks: list[mixer_rules.Hook]) -> list[Any]:
    """Register a rule's hooks (:data:`mixer_rules.Hook`: ``(module, kind, hook)``), their handles back."""
    handles = []
    for module, kind, hook in hooks:
        if kind == "forward":
            handles.append(module.register_forward_hook(hook))
        elif kind == "forward_kwargs":
            handles.append(module.register_forward_hook(hook, with_kwargs=True))
        elif kind == "pre":
            handles.append(module.register_forward_pre_hook(hook))
        elif kind == "pre_kwargs":
            handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
        else:
            raise AssertionError(f"unknown hook kind {kind!r}")
    return handles


def _unowned_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``model.named_modules()`` but the parts a mixer rule applies the rule of (:attr:`mixer_rules.MixerRule.owns`)
    and ZAYA's query/key norms, which see only the query and key its rule holds constant (:mod:`.cca_rule`)."""
    owned = mixer_rules.owned(model) | {id(norm) for norm in cca_rule.qk_norms(model)}
    return [(path, module) for path, module in model.named_modules() if id(module) not in owned]


KEYS_ONLY = {"Gemma4TextAttention": "k_norm"}
"""Attention classes whose values may be their key projection's output (Gemma 4's ``attention_k_eq_v``:
``value_states = key_states`` before the key norm) -> the child the keys alone pass through, whose output LRP
detaches instead of the projection's, so that the values keep their relevance (transformers 5.24)."""


def _keys_only(block: AttentionBlock) -> nn.Module | None:
    """Where ``block``'s keys, and not its values, pass (:data:`KEYS_ONLY`), else None."""
    path = KEYS_ONLY.get(type(block.core).__name__)
    return getattr(block.core, path, None) if path else None


def _attention_hooks(block: AttentionBlock) -> list[tuple[nn.Module, Any]]:
    """(module, forward hook) pairs that hold ``block``'s queries and keys constant (attention weights are weights of
    the weighted sum) and pass its values' relevance through a ``clip_qkv`` clamp (:data:`CLIPPED_QKV`)."""
    if _is_latent(block):  # multi-head latent attention (check_rules refused any other layout)
        return list(_latent_attention_hooks(block))
    if block.q is None and block.qkv is None and cca_rule.is_cca(block):  # ZAYA's (check_rules checked it)
        return cca_rule.cca_hooks(block)
    if shared_kv_rule.is_shared_kv(block):  # DeepSeek-V4's (check_rules checked it)
        return shared_kv_rule.hooks(block)
    if block.qkv is not None and block.family.qkv_layout != "q|k|v":
        # DeBERTa v1's position projections (head rows: the relative embeddings' keys and queries) with them
        return [(block.qkv, _detach_columns(block)), *((module, _detach_output) for module in head_row_modules(block))]
    if block.qkv is not None:
        width = (block.n_heads + block.n_kv_heads) * block.d_head
        return [(block.qkv, _detach_qk_columns(width, _clip(block)))]
    assert block.q is not None  # unfused projections
    # with a query gate (family.query_gate) the gate is q's output too: held constant with it
    hooks: list[tuple[nn.Module, Any]] = [(block.q, _detach_output)]
    # keys from another layer (family.kv_from, Gemma 4's key/value sharing): detached there, by that layer's own
    # hook; the shared values carry this layer's relevance back into that layer's value projection
    if block.k is not None:  # values from the key projection too (attention_k_eq_v): the keys held after it
        hooks.append((block.k if block.k is not block.v else cast(nn.Module, _keys_only(block)), _detach_output))
    if (clip := _clip(block)) is not None and block.v is not None:  # OLMo's clip_qkv: the values' clamp
        hooks.append((block.v, _clamp_identity(clip)))
    # an output gate's projection (Beam's gate_proj, QKV_OUTPUT_GATES): held constant as the query gate, and so
    # Longformer's query_global and key_global; not its value_global (values: relevance passes through them, as v's)
    # Inkling's r_proj (Family.bias_rows): left to the score bias's rule below, which detaches rel_logits_proj's output
    values = {id(block.module.get_submodule(path)) for path in (*block.family.head_row_values, *block.family.bias_rows)}
    hooks += [(module, _detach_output) for module in head_row_modules(block) if id(module) not in values]
    # Inkling's relative-position logits, a bias of the scores from the layer's input: constant with the queries
    score = mixer_rules.score_bias_rule_for(block.core)
    return hooks + (score.hooks(block.core) if score is not None else [])


def _register_gated_mlps(model: nn.Module, gated: list[tuple[nn.Module, nn.Module, nn.Module, bool]],
                         handles: HookHandles) -> None:
    """The gated MLPs' rules (:func:`_gated_mlps` ``gated``, their clamps, fused, clamped and called ones), after
    the activation rule's hooks, so that the products keep the rule's outputs."""
    for gate_proj, act, up, bound, where in clamped_dense_mlps(model):  # before the products keep their factors
        handles.append((gate_proj if where == "gate" else act).register_forward_hook(_one_sided_clamp(bound)))
        handles.append(up.register_forward_hook(_clamp_identity(bound)))
    for act, up, down, checked in gated:
        product = _CheckedGatedProduct() if checked else _GatedProduct()
        # after the activation rule (hooked above), so it sees the rule's output
        handles.append(act.register_forward_hook(product.keep_a))
        handles.append(up.register_forward_hook(product.keep_b))
        handles.append(down.register_forward_pre_hook(product.pre_down))
    for act, gate_up, down in fused_gated_mlps(model):
        product = _GatedProduct()
        handles.append(act.register_forward_hook(product.keep_a))
        handles.append(gate_up.register_forward_hook(
            lambda module, args, output, keep=product.keep_b: keep(module, args, output.chunk(2, dim=-1)[1])))
        handles.append(down.register_forward_pre_hook(product.pre_down))
    for gate_up, down, gate in clamped_gated_mlps(model):
        clamped = _ClampedGatedProduct(gate)
        handles.append(gate_up.register_forward_hook(clamped.keep))
        handles.append(down.register_forward_pre_hook(clamped.pre_down))
    for w1, w3, w2 in called_gated_mlps(model):
        called = _CalledGatedProduct()
        handles.append(w1.register_forward_hook(called.keep_activated))
        handles.append(w3.register_forward_hook(called.keep_b))
        handles.append(w2.register_forward_pre_hook(called.pre_down))


@recompiling("switched on the LRP rules' hooks (lrp_rules)")
@contextmanager
def lrp_rules(model: nn.Module, *, blocks: list[AttentionBlock] | None = None) -> Iterator[None]:
    """Switch on the modified backward pass that turns gradient x input into LRP relevance.

    Inside the block, for any tensor ``x`` on the path to an output ``y``,
    ``x * torch.autograd.grad(y, x)`` is the LRP relevance of ``x``'s neurons for ``y`` under
    the rules of this module's docstring. Forward values are unchanged. Hooks go on the
    model's activations, normalisations, query/key projections and gated-MLP products, and
    all come off on exit, also on error. A normalisation module without a rule is an error.
    """
    blocks = attention_blocks(model) if blocks is None else blocks
    handles = HookHandles()
    restore: list[tuple[object, str]] = []
    try:
        gated = _gated_mlps(model)
        # what no rule covers, now that the check passed, lies where the probe never went: refused if it runs
        unruled = _check_rules(model)
        for path, module in _unowned_modules(model):  # a mixer's own parts have the mixer rule's hooks
            if path in unruled:
                name, problem = unruled[path]
                problem = problem or f"LRP: no rule for the normalisation module {name} ({path}): {_KNOWN_NORMS}"
                handles.append(module.register_forward_pre_hook(_ran_after_all(problem), prepend=True))
                continue
            rule = norm_rule(module)
            if rule is not None:  # first: the norm's own output, before a pruned OLMo 2's selection narrows it
                handles.append(module.register_forward_hook(rule, prepend=True))
            elif (parts := _gated_norm_parts(module)) is not None:  # the gate a constant: _GatedNorm
                gated_norm = _GatedNorm()
                handles.append(parts[0].register_forward_hook(gated_norm.keep_y))
                handles.append(parts[1].register_forward_hook(gated_norm.keep_gate))
                handles.append(module.register_forward_hook(gated_norm.after))
            elif _is_activation(module):
                handles.append(module.register_forward_hook(_activation_rule))
        _register_gated_mlps(model, gated, handles)
        for layer in per_layer_input_layers(model):
            per_layer = _PerLayerInputProduct()
            handles.append(layer.register_forward_pre_hook(per_layer.keep_input, with_kwargs=True))
            # after the activation rule (hooked above), so it keeps the rule's output
            handles.append(cast(nn.Module, layer.act_fn).register_forward_hook(per_layer.keep_gate))
            handles.append(cast(nn.Module, layer.per_layer_projection).register_forward_pre_hook(per_layer.pre_projection))
        for text in altup_models(model):
            _register_altup(text, handles)
        _register_adapted(model, handles)
        for path, module in model.named_modules():
            if type(module).__name__ in MODULE_EXPERTS:  # each expert a module with rules of its own
                handles.append(module.register_forward_pre_hook(_detach_routing_weights, with_kwargs=True))
            elif _is_experts(module):
                handles.append(module.register_forward_hook(_experts_rule, with_kwargs=True))
                if _dense_experts(module) and (router := _router(_parent(model, path))) is not None:
                    # Llama 4: the router's scores scale the experts' input, constants as routing weights are
                    handles.append(router.register_forward_hook(_detach_outputs))
                config: Any = getattr(module, "config", None)
                if getattr(config, "_experts_implementation", "eager") != "eager":
                    # transformers' grouped and batched matmuls take no float64: its reference loop
                    restore.append((config, config._experts_implementation))
                    config._experts_implementation = "eager"
            elif path.rpartition(".")[2] in _EXPERT_GATES:  # a gate is a constant, as routing weights are
                handles.append(module.register_forward_hook(_detach_output))
        for module, child in _intermediate_activations(model):
            applied = _ActivationAfter()
            handles.append(child.register_forward_hook(applied.keep))
            handles.append(module.register_forward_hook(applied.after))
        for before, after in _functional_activations(model):
            between = _ActivationBetween()
            handles.append(before.register_forward_hook(between.keep))
            handles.append(after.register_forward_pre_hook(between.pre))
        for block in blocks:
            if block.n_heads == 0 or block.idle:  # idle: never runs (check_rules)
                continue
            # NeoMME's exclusive map (HEAD_MAPS): v^ held constant, :mod:`headlab.importance.head_map_rule`
            for module, hook in (*_attention_hooks(block), *head_map_hooks(block)):
                handles.append(module.register_forward_hook(hook))
        for path, module in model.named_modules():
            if path not in unruled and (mixer := mixer_rules.rule_for(module)) is not None:
                handles.extend(register_hooks(mixer.hooks(module)))
        # DeepSeek-V4's keys, which are its values: held in its attention; the clamps' gradient torch's up to 2.13
        with shared_kv_rule.keys_held(blocks), _ClosedClamps():
            yield
    finally:
        handles.remove()
        for config, implementation in reversed(restore):
            config._experts_implementation = implementation
