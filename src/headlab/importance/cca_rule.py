"""The LRP rule for ZAYA's compressed convolutional attention (``ZayaAttention`` with ``ZayaCCAProjection``).

transformers 5.24 (models/zaya/modeling_zaya.py, ``ZayaCCAProjection.forward`` and ``ZayaAttention.forward``; the
CCA of arXiv 2510.04476) computes, for the layer's normed input ``x`` (padding positions zeroed by the conv mask)::

    q, k = q_proj(x), k_proj(x)
    query = convs([q | k])_q + (q_h + k_g(h)) / 2                  # two causal 1-d convolutions over time
    key   = convs([q | k])_k + mean over g's query heads of (q_h + k_g) / 2
    value = [v_proj_current(x_t) | v_proj_delayed(x_{t-1})]         # v_proj_delayed(0) at t = 0: its bias, if any
    out   = o_proj(softmax(rope(qk_norm(query, key))) @ value)

The rule is headlab's attention rule (rules.py's docstring; Voita et al. 2019, App. A: the attention weights are the
weights of a weighted sum, held constant, the TF code's ``consider_attn_constant``; AttnLRP, Achtibat et al. 2024,
likewise): everything that makes the attention weights (``q_proj``, ``k_proj``, both convolutions, the residual means,
``qk_norm``, the rotary embedding) is held constant by detaching the query and key that ``qkv_proj`` returns, so the
layer is ``o_proj(P @ value)`` with ``P`` a constant. The value path is linear in ``x`` at ``t`` and ``t - 1`` (a shift
in time, as a causal convolution's taps are), so gradient x input through it is the linear rule (Voita et al. 2019,
App. A.2): relevance reaches ``x`` through ``v_proj_current`` and ``v_proj_delayed`` only, conserved on a bias-free
model; their biases (the one at ``t = 0`` too, a call of ``v_proj_delayed`` of its own) keep their shares, counted by
lrp.py's probes. This is also MambaLRP's treatment of what a mixer computes from its input to weigh its values
(Jafari, Montavon, Müller, Eberle, NeurIPS 2024, "MambaLRP: Explaining Selective State Space Sequence Models",
Sec. 4; github.com/FarnoushRJ/MambaLRP, ``mamba_lrp/lrp/utils.py``: ``params_to_detach``): here the convolutions
only make queries and keys, factors of the weights, so they are held constant with them, where Mamba's convolution,
on its values' path, keeps its ordinary (linear) backward.

The rest of a ZAYA layer has headlab's existing rules: its RMS norms (in float32, the factor they applied), the
routed experts (routing weights constant; the router's hidden states, which the next layer's router reads, reach
only routers), and ``ZayaResidualScaling``'s ``(h + b_h) * s_h + (r + b_r) * s_r``, a weighted sum whose two biases
keep ``b_h * s_h`` and ``b_r * s_r`` of the gradient, as does the model's input ``(e + b) * s``
(:func:`bias_probe_hooks`, which lrp.py's probes install, as no module's ``bias`` holds them).

Refused before any work, naming the module and why (:func:`cca_problem`): a ``ZayaAttention`` that is not
transformers' own class; a projection without ``q_proj``, ``k_proj``, ``v_proj_current`` and ``v_proj_delayed``
(linear maps from the hidden size, the two value halves of ``kv heads x head_dim / 2`` each) or without ``o_proj``;
a projection whose values, on a probe, are not ``[v_proj_current(x_t) | v_proj_delayed(x_{t-1})]``; and an attention
whose output, on a probe with the query and key held fixed, depends on its input other than through those values or
is not affine in them. Physical pruning stays refused (:data:`headlab.adapters.families.FUSED_REFUSED`).
"""

from __future__ import annotations

import copy
from typing import Any, cast

import torch
from torch import nn

from headlab.adapters import AttentionBlock
from headlab.capture import eager_attention
from headlab.errors import HeadlabError

__all__ = ["bias_probe_hooks", "cca_hooks", "cca_problem", "is_cca", "qk_norms", "value_path"]

_PROJECTIONS = ("q_proj", "k_proj", "v_proj_current", "v_proj_delayed")


def is_cca(block: AttentionBlock) -> bool:
    """Whether ``block`` is ZAYA's compressed convolutional attention (by its class name: :func:`cca_problem` checks
    that it is transformers' own and laid out and computing as the rule assumes)."""
    return type(block.core).__name__ == "ZayaAttention"


def qk_norms(model: nn.Module) -> list[nn.Module]:
    """The ``qk_norm`` of every ZAYA attention of ``model``: it normalises only the query and key, held constant by
    the rule (it sees them detached), so it needs no rule of its own."""
    norms = (getattr(module, "qk_norm", None) for module in model.modules() if type(module).__name__ == "ZayaAttention")
    return [norm for norm in norms if isinstance(norm, nn.Module)]


def value_path(projection: Any, x: torch.Tensor, conv_mask: torch.Tensor | None, d_head: int) -> torch.Tensor:
    """``[v_proj_current(x_t) | v_proj_delayed(x_{t-1})]`` per head, ``v_proj_delayed(0)`` at ``t = 0``, ``x`` zeroed
    where ``conv_mask`` is 0: the values ZAYA's projection returns (written apart from transformers' code)."""
    if conv_mask is not None:
        x = x * conv_mask[:, :, None].to(x.dtype)
    current = projection.v_proj_current(x)
    first = projection.v_proj_delayed(x.new_zeros(x.shape[0], 1, x.shape[-1]))
    delayed = torch.cat([first, projection.v_proj_delayed(x)[:, :-1]], dim=1)
    return torch.cat([current, delayed], dim=-1).view(*x.shape[:-1], -1, d_head)


def _layout_problem(block: AttentionBlock) -> str | None:
    core: Any = block.core
    if not type(core).__module__.startswith("transformers.models.zaya."):
        return (f"its class comes from {type(core).__module__}, not transformers' ZAYA (transformers.models.zaya), "
                "whose forward the rule was read off")
    projection = getattr(core, "qkv_proj", None)
    parts = [getattr(projection, name, None) for name in _PROJECTIONS]
    if projection is None or not all(isinstance(part, nn.Linear) for part in parts) \
            or not isinstance(getattr(core, "o_proj", None), nn.Linear):
        return ("it has no qkv_proj with q_proj, k_proj, v_proj_current and v_proj_delayed (linear maps) or no "
                "o_proj (a linear map)")
    current, delayed = cast(nn.Linear, parts[2]), cast(nn.Linear, parts[3])
    half = block.n_kv_heads * block.d_head // 2
    if current.out_features != half or delayed.out_features != half or current.in_features != delayed.in_features \
            or 2 * half != block.n_kv_heads * block.d_head:
        return (f"its v_proj_current and v_proj_delayed are not two halves of {block.n_kv_heads} key/value heads of "
                f"{block.d_head} features ({half} each) read from one input")
    return None


class _Fixed:
    """A forward hook on ``qkv_proj`` that returns fixed queries and keys and the given values (a probe)."""

    def __init__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        self.query, self.key, self.value = query, key, value

    def __call__(self, module, args, output):
        return self.query, self.key, self.value


def _attention_output(core: Any, x: torch.Tensor, fixed: _Fixed, d_head: int) -> torch.Tensor:
    handle = core.qkv_proj.register_forward_hook(fixed)
    try:
        cos = torch.ones(*x.shape[:-1], d_head, dtype=x.dtype, device=x.device)
        with eager_attention(core):  # the attention LRP runs (flash attention would take no float32 probe)
            output = type(core).forward(core, x, attention_mask=None, cache=None,
                                        position_embeddings=(cos, torch.zeros_like(cos)))
    finally:
        handle.remove()
    return output[0] if isinstance(output, tuple) else output


def _forward_problem(block: AttentionBlock) -> str | None:
    """Whether the projection's values are :func:`value_path` and the attention's output, its query and key fixed,
    reads its input only through them, affinely, on a random input (under no_grad); None where it cannot run
    (weights on the meta device: the hook checks the values on every call)."""
    core: Any = block.core
    weight = core.qkv_proj.v_proj_current.weight
    if weight.is_meta or not weight.is_floating_point():
        return None
    if torch.finfo(weight.dtype).bits < 32:  # a half-precision model's own rounding would set the two apart
        core = copy.deepcopy(core).to(torch.float32)  # one layer (mixer_rules.probe's widening imports lrp.py)
    projection = core.qkv_proj
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        dtype = projection.v_proj_current.weight.dtype
        x, other = (torch.randn((2, 5, projection.v_proj_current.in_features), generator=g, dtype=torch.float64)
                    .to(weight.device, dtype) for _ in range(2))
        try:
            query, key, value = projection(x, None)
            expected = value_path(projection, x, None, block.d_head)
            if value.shape != expected.shape or not torch.allclose(value, expected, rtol=1e-4, atol=1e-6):
                return ("on a probe its qkv_proj's values are not [v_proj_current(x_t) | v_proj_delayed(x_{t-1})] per "
                        "head (v_proj_delayed(0) at t = 0), the values the rule was written for")
            outputs = [_attention_output(core, inputs, _Fixed(query, key, scale * value), block.d_head)
                       for inputs, scale in ((x, 1.0), (other, 1.0), (x, 2.0), (x, 0.0))]
        except Exception as error:  # noqa: BLE001  # any failure: not the forward the rule was written for
            return f"its forward failed on a probe ({type(error).__name__}: {error})"
    once, elsewhere, twice, none = outputs
    if not torch.allclose(once, elsewhere, rtol=1e-4, atol=1e-6) \
            or not torch.allclose(twice - once, once - none, rtol=1e-4, atol=1e-6):
        return ("on a probe, its query and key held fixed, its output depends on its input other than through "
                "qkv_proj's values, or is not affine in them, so holding the query and key constant would not make "
                "it a weighted sum of its values")
    return None


def cca_problem(block: AttentionBlock) -> str | None:
    """Why the rule does not fit ``block`` (a :func:`is_cca` block), as the refusal says it; None where it fits."""
    problem = _layout_problem(block) or _forward_problem(block)
    return None if problem is None else f"ZAYA's compressed convolutional attention: {problem}"


def _hold_query_and_key(block: AttentionBlock):
    """``qkv_proj``'s forward hook: its query and key detached (the attention weights constant), its values checked
    against :func:`value_path` and kept."""
    d_head = block.d_head

    def hook(module, args, output):
        if len(args) != 3 or not isinstance(output, tuple) or len(output) != 3:
            raise HeadlabError(f"LRP: {block.name}'s qkv_proj is not called as qkv_proj(hidden_states, cache, "
                               "conv_mask) returning (query, key, value); headlab has no LRP rule for it")
        # a cache's state, if it held one, would be the value at t = 0, a constant no probe counts: the check refuses it
        x, _, conv_mask = args
        query, key, value = output
        with torch.no_grad():
            expected = value_path(module, x, conv_mask, d_head)
            if value.shape != expected.shape or not torch.allclose(value, expected, rtol=1e-4, atol=1e-6):
                raise HeadlabError(f"LRP: {block.name}'s values are not [v_proj_current(x_t) | "
                                   "v_proj_delayed(x_{t-1})] per head; headlab has no LRP rule for them")
        return query.detach(), key.detach(), value

    return hook


def cca_hooks(block: AttentionBlock) -> list[tuple[nn.Module, Any]]:
    """(module, forward hook) pairs of the rule: ``qkv_proj``'s query and key held constant."""
    return [(cast(nn.Module, block.core.qkv_proj), _hold_query_and_key(block))]


def _residual_scaling_probe(ones):
    def hook(module, args, output):
        s = ones(output)
        if s is None:
            return None
        kept = (module.hidden_states_bias * module.hidden_states_scale
                + module.residual_bias * module.residual_scale).detach().to(output.dtype) * s
        return output + (kept - kept.detach())

    return hook


def _input_bias_probe(model: Any, ones):
    def hook(module, args):
        x = args[0]
        s = ones(x)
        if s is None:
            return None
        kept = (model.input_hidden_states_bias * model.input_hidden_states_scale).detach().to(x.dtype) * s
        return (x + (kept - kept.detach()), *args[1:])

    return hook


def bias_probe_hooks(model: nn.Module, ones) -> list[tuple[nn.Module, str, Any]]:
    """``(module, kind, hook)`` that measure the relevance ZAYA's biases outside any module's ``bias`` keep:
    ``ZayaResidualScaling``'s ``b_h * s_h + b_r * s_r`` at its output and ``ZayaModel``'s input
    ``input_hidden_states_bias * input_hidden_states_scale`` at its first layer's input. ``ones(t)``: lrp.py's probe,
    ones ``[..., 1]`` per token of ``t`` that require grad (or None), so that ``s * dy/ds`` is their relevance."""
    hooks: list[tuple[nn.Module, str, Any]] = []
    for module in model.modules():
        name = type(module).__name__
        if name == "ZayaResidualScaling":
            hooks.append((module, "forward", _residual_scaling_probe(ones)))
        elif name == "ZayaModel" and isinstance(getattr(module, "input_hidden_states_bias", None), torch.Tensor) \
                and isinstance(layers := getattr(module, "layers", None), nn.ModuleList) and len(layers):
            hooks.append((layers[0], "pre", _input_bias_probe(module, ones)))
    return hooks
