"""The LRP rule for MiniMax's lightning attention (``MiniMaxLightningAttention``, model type ``minimax``).

transformers 5.24 (``modeling_minimax.py``) computes, for the layer's normed input ``h`` (padding positions zeroed by
the attention mask after the activation)::

    q, k, v = act_fn(qkv_proj(h))              # SiLU; qkv_proj's output per head [q | k | v], head_dim each
    o_t = sum_{s <= t} exp(-lambda (t - s)) (q_t . k_s) v_s      # per head, lambda = slope_rate[head]
    out = out_proj(sigmoid(output_gate(h)) * norm(o))             # norm: an RMS norm over all heads' features

``o`` computed block by block (``block_size`` positions: within a block ``(Q K^T * diagonal_decay) V``, across
blocks through the decayed state ``sum_s exp(-lambda ...) k_s^T v_s`` that a cache keeps); the decays are buffers
fixed at construction (``slope_rate``, ``query_decay``, ``key_decay``, ``diagonal_decay``), no float32 cast but the
norm's (which LRP's float64 runs widen, lrp.py's ``_KeptWide``).

The rule: ``q_t . k_s`` and the decay are the weights of the weighted sum of the values, held constant in the
backward pass as the attention weights of softmax attention are (rules.py's docstring; Voita et al. 2019, App. A.2;
the principle MambaLRP states for selective state-space models, Jafari, Montavon, Müller, Eberle, NeurIPS 2024,
"MambaLRP: Explaining Selective State Space Sequence Models", Sec. 4, github.com/FarnoushRJ/MambaLRP
``mamba_lrp/lrp/utils.py``: ``params_to_detach=['A', 'B', 'C', 'z']``). ``qkv_proj``'s query and key columns are
detached (after them the activation, whose rule rules.py installs on ``act_fn``, has no gradient to pass), so ``o`` is
linear in ``v``, whose activation gets the activation rule ``R(z_v) = R(silu(z_v))``. The output gate
``sigmoid(output_gate(h))`` is held constant as the other gates are (``output_gate``'s output detached; CP-LRP, Ali et
al. 2022, LXT's ``cp_gated_mlp_forward``; MambaLRP splits a gate in halves where headlab holds it constant), and the
norm has its RMS rule (``gamma / rms`` held constant). Relevance so flows through the values and the residual stream,
conserved.

Refused (before any work, naming the module): a layout other than that (``qkv_proj`` to heads x 3 x head_dim,
``output_gate`` and ``out_proj``, ``act_fn`` an activation module, ``norm`` a norm with a rule, the decay buffers), a
forward that, on a probe longer than a block where the block size allows, is not the sum above; and, on the call, a
cache that already holds this layer's state (the recurrent decode path: relevance of earlier calls in it).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from headlab.errors import HeadlabError
from headlab.importance.mixer_rules import Hook, MixerRule, register
from headlab.importance.mixer_rules.probe import probing

__all__ = ["RULE", "lightning_attention"]

_BUFFERS = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")
_LINEARS = ("qkv_proj", "output_gate", "out_proj")


def _matches(module: nn.Module) -> bool:
    return all(isinstance(getattr(module, name, None), torch.Tensor) for name in _BUFFERS) \
        and all(isinstance(getattr(module, name, None), nn.Module) for name in (*_LINEARS, "norm", "act_fn"))


def lightning_attention(module: Any, h: torch.Tensor) -> torch.Tensor:
    """``out_proj(sigmoid(output_gate(h)) * norm(o))`` with ``o_t = sum_{s <= t} exp(-lambda (t - s)) (q_t . k_s) v_s``
    per head, computed whole (no blocks): the lightning attention's reference, written apart from transformers'."""
    heads, d = module.num_attention_heads, module.head_dim
    batch, seq, _ = h.shape
    q, k, v = module.act_fn(module.qkv_proj(h)).reshape(batch, seq, heads, 3 * d).split(d, dim=-1)
    positions = torch.arange(seq, device=h.device)
    lag = (positions[:, None] - positions[None, :]).to(h.dtype)  # t - s
    decay = torch.where(lag >= 0, torch.exp(-module.slope_rate.reshape(heads, 1, 1).to(h.dtype) * lag.clamp(min=0)),
                        torch.zeros_like(lag))  # [heads, t, s]
    o = torch.einsum("bthd,bshd,hts,bshe->bthe", q, k, decay, v).reshape(batch, seq, heads * d)
    return module.out_proj(torch.sigmoid(module.output_gate(h)) * module.norm(o))


def _layout_problem(module: Any) -> str | None:
    from headlab.importance.rules import _is_activation, norm_rule

    heads, d = getattr(module, "num_attention_heads", None), getattr(module, "head_dim", None)
    if not isinstance(heads, int) or not isinstance(d, int):
        return "it has no num_attention_heads and head_dim"
    parts = [getattr(module, name) for name in _LINEARS]
    if not all(isinstance(part, nn.Linear) for part in parts) or parts[0].out_features != 3 * heads * d \
            or parts[1].out_features != heads * d or parts[2].in_features != heads * d:
        return (f"it is not qkv_proj to {heads} heads x [q | k | v] of {d} each, output_gate to {heads * d} features "
                "and out_proj from them")
    if not _is_activation(module.act_fn):
        return f"its act_fn ({type(module.act_fn).__name__}) is not an element-wise activation module"
    try:
        ruled = norm_rule(module.norm) is not None
    except HeadlabError:
        ruled = False
    if not ruled:
        return f"its norm ({type(module.norm).__name__}) has no LRP rule"
    if tuple(module.slope_rate.shape) != (heads, 1, 1):
        return f"its slope_rate is not one decay rate per head ({tuple(module.slope_rate.shape)})"
    return None


def _forward_problem(module: Any) -> str | None:
    """Whether the module's own forward is :func:`lightning_attention` on a random input (under no_grad), longer than a
    block where its block size is small (so the state across blocks is checked too); None where it cannot run."""
    weight = module.qkv_proj.weight
    if weight.is_meta or not weight.is_floating_point():
        return None
    block = getattr(module, "block_size", 0)
    seq = block + 3 if isinstance(block, int) and 0 < block <= 32 else 8

    g = torch.Generator().manual_seed(0)
    stored = {name: getattr(module, name) for name in _BUFFERS[1:]}
    try:
        with probing(module):
            if callable(getattr(module, "decay_factors", None)):
                # the decays as the class computes them from its rates, in float32: a half-precision model stores
                # them rounded (exp(-a) exp(-b) then exp(-(a + b)) to 3 digits only), what the rule holds constant
                # whatever their values; the probe checks the formula
                module.query_decay, module.key_decay, module.diagonal_decay = module.decay_factors(module.slope_rate)
            h = torch.randn((2, seq, module.qkv_proj.in_features), generator=g, dtype=torch.float64).to(
                weight.device, module.qkv_proj.weight.dtype)
            output = type(module).forward(module, h, position_embeddings=None, attention_mask=None)
            output = output[0] if isinstance(output, tuple) else output
            expected = lightning_attention(module, h)
    except Exception as error:  # noqa: BLE001  # any failure: not the forward the rule was written for
        return f"its forward failed on a probe ({type(error).__name__}: {error})"
    finally:
        for name, buffer in stored.items():
            setattr(module, name, buffer)
    if not isinstance(output, torch.Tensor) or output.shape != expected.shape \
            or not torch.allclose(output, expected, rtol=1e-4, atol=1e-5):
        return ("on a probe its forward is not out_proj(sigmoid(output_gate(h)) * norm(o)) with o_t = sum_(s <= t) "
                "exp(-slope_rate (t - s)) (q_t . k_s) v_s per head, the forward the rule was written for")
    return None


def _problem(module: nn.Module, path: str) -> str | None:
    return _layout_problem(module) or _forward_problem(module)


def _hold_queries_and_keys(heads: int, d: int):
    """``qkv_proj``'s forward hook: per head ``[q | k | v]``, the q and k columns detached, v kept."""
    is_qk = (torch.arange(heads * 3 * d) % (3 * d)) < 2 * d

    def hook(module, args, output):
        return torch.where(is_qk.to(output.device), output.detach(), output)

    return hook


def _detach_output(module, args, output):
    return output.detach()


def _no_carried_state(module, args, kwargs):
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    getter = getattr(cache, "get_linear_cache", None)
    try:  # MiniMaxCache's: a tensor once a call stored the layer's state ([] or an IndexError for other layers)
        state = getter(module.layer_idx) if callable(getter) and torch.is_grad_enabled() else None
    except Exception:  # noqa: BLE001  # no state of this layer: the forward starts from zeros
        state = None
    if isinstance(state, torch.Tensor):
        raise HeadlabError(f"LRP: {type(module).__name__} continues from a state its cache carries from an earlier "
                           "call, whose relevance no input of this call keeps; explain whole sequences")


def _hooks(module: Any) -> list[Hook]:
    return [(module.qkv_proj, "forward", _hold_queries_and_keys(module.num_attention_heads, module.head_dim)),
            (module.output_gate, "forward", _detach_output),
            (module, "pre_kwargs", _no_carried_state)]


RULE = register(MixerRule(
    name="lightning attention (MiniMax: q . k and the decay held constant, the output gate held constant)",
    matches=_matches, problem=_problem, hooks=_hooks))
