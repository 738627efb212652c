"""The LRP rule for RecurrentGemma's recurrent block (Griffin's, De et al. 2024: ``RecurrentGemmaRecurrentBlock``
with its ``RecurrentGemmaRglru``).

transformers 5.24 (``modeling_recurrent_gemma.py``) computes, for the block's normed input ``h``::

    y = act_fn(linear_y(h))                       # GeLU (tanh approximation) branch
    x = conv_1d(linear_x(h))[..., :seq]           # depthwise causal convolution (the module called), with a bias
    r_t = sigmoid(x_t W_a + b_a), i_t = sigmoid(x_t W_x + b_x)      # per head, block-diagonal W
    a_t = exp(-8 r_t softplus(recurrent_param))                      # 0 where the position id is 0 (a reset)
    h_t = a_t h_{t-1} + m_t (i_t x_t),  m_t = sqrt(1 - a_t^2)        # m_t = 1 at a reset
    out = linear_out(h * y)

the scan accumulated in float32 (``_rnn_scan``'s ``acc_dtype``; LRP's float64 runs widen it with the rest of the
model's float32 casts, lrp.py's ``_KeptWide``).

The rule (MambaLRP's principle, Jafari, Montavon, Müller, Eberle, NeurIPS 2024, "MambaLRP: Explaining Selective
State Space Sequence Models", Sec. 4; github.com/FarnoushRJ/MambaLRP, ``mamba_lrp/lrp/utils.py``:
``params_to_detach=['A', 'B', 'C', 'z']``): what the recurrence computes from its own input to weigh its values, the
decay ``a_t``, the input gate ``i_t`` and the normaliser ``m_t``, is held constant in the backward pass, as the
attention weights are. The RG-LRU is then ``x -> h``, ``h_t = sum_{s <= t} (prod_{s < k <= t} a_k) m_s i_s x_s``,
a weighted sum of its values ``x_s`` with constant weights, and gradient x input is the linear rule (Voita et al.
2019, App. A.2) through it: relevance is conserved. It is applied in the RG-LRU's forward hook, whose output keeps
its value and takes the backward of that sum recomputed from the input with the factors computed under no_grad
(checked, on every call, to equal the output).

The GeLU branch ``y`` multiplies the recurrent branch feature by feature: a gate computed from the block's input, held
constant (``linear_y``'s output detached), so all of the product's relevance flows through the recurrence, as for
the attention's output gates, the routing weights and LFM2's convolution gates (headlab's CP-LRP convention,
rules.py's docstring; Ali et al. 2022; LXT's ``cp_gated_mlp_forward``). Not the product rule of the gated MLPs
(``R(a) = a / (a + b) R``): that rule is for two signals of one MLP; ``y`` has the role Griffin gives it (the
"gating branch" of its recurrent block, the counterpart of Mamba's ``silu(z)``, which MambaLRP's code detaches as
``z``), and splitting would send relevance into a branch that, from the GeLU on, carries none of the sequence: it
is the recurrent branch that mixes tokens. MambaLRP splits its gate in halves where headlab holds gates constant.

``conv_1d`` is linear (its bias keeps its share, counted by lrp.py's probe of 1-d convolutions); ``linear_x``'s and
``linear_out``'s biases likewise; the gates' biases are inside the constants.

Refused (before any work, naming the module): a block or RG-LRU not laid out so, or whose forward, on a probe, is
not the one above; and, on the call, a recurrence that starts from a state carried from an earlier call (a cache,
no reset at its first position), whose relevance no input would keep.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from headlab.errors import HeadlabError
from headlab.importance.mixer_rules import Hook, MixerRule, register
from headlab.importance.mixer_rules.probe import probing

__all__ = ["RULE", "rg_lru"]

_LRU_PARTS = ("recurrent_param", "input_gate_weight", "input_gate_bias", "recurrent_gate_weight",
              "recurrent_gate_bias")
_BLOCK_PARTS = ("linear_x", "linear_y", "linear_out", "conv_1d", "rg_lru", "act_fn")


def _is_lru(module: nn.Module) -> bool:
    return all(isinstance(getattr(module, name, None), torch.Tensor) for name in _LRU_PARTS)


def _is_block(module: nn.Module) -> bool:
    return all(isinstance(getattr(module, name, None), nn.Module) for name in _BLOCK_PARTS) \
        and _is_lru(module.get_submodule("rg_lru"))


def _matches(module: nn.Module) -> bool:
    return _is_lru(module) or _is_block(module)


def _gates(lru: Any, x: torch.Tensor, position_ids: torch.Tensor):
    """``(i, a, m)``: the input gate, the decay (0 at a reset) and the normaliser (1 at a reset) of the RG-LRU
    ``lru`` on its input ``x`` ``[batch, seq, width]``, as Griffin defines them."""
    heads, width = lru.input_gate_weight.shape[0], x.shape[-1]
    per_head = x.reshape(*x.shape[:2], heads, width // heads)

    def gate(weight, bias):
        return torch.sigmoid(torch.einsum("bshi,hij->bshj", per_head, weight) + bias).reshape(x.shape)

    i, r = gate(lru.input_gate_weight, lru.input_gate_bias), gate(lru.recurrent_gate_weight, lru.recurrent_gate_bias)
    log_a = -8.0 * r * F.softplus(lru.recurrent_param)
    reset = (position_ids == 0)[:, :, None]
    a = torch.where(reset, torch.zeros_like(log_a), torch.exp(log_a))
    m = torch.where(reset, torch.ones_like(log_a), torch.sqrt(1 - torch.exp(2 * log_a)))
    return i, a, m


def _scan(u: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``h_t = a_t h_{t-1} + u_t`` from ``h_{-1} = 0``, accumulated in at least float32 (as ``_rnn_scan``)."""
    wide = torch.promote_types(u.dtype, torch.float32)
    state = torch.zeros_like(u[:, 0], dtype=wide)
    steps = []
    for t in range(u.shape[1]):
        state = a[:, t].to(wide) * state + u[:, t].to(wide)
        steps.append(state.to(u.dtype))
    return torch.stack(steps, dim=1)


def rg_lru(lru: nn.Module, x: torch.Tensor, position_ids: torch.Tensor, *, held: bool = False) -> torch.Tensor:
    """The RG-LRU ``lru`` on ``x`` (its reference, written apart from transformers' code); ``held``: its gates
    computed under no_grad, constants of the backward (the rule)."""
    with torch.set_grad_enabled(torch.is_grad_enabled() and not held):
        i, a, m = _gates(lru, x.detach() if held else x, position_ids)
    return _scan(x * i * m, a)


def recurrent_block(block: Any, h: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """``linear_out(rg_lru(conv(linear_x h)) * act_fn(linear_y h))``: Griffin's recurrent block (its reference)."""
    y = block.act_fn(block.linear_y(h))
    x = block.conv_1d(block.linear_x(h).transpose(1, 2))[..., :h.shape[1]].transpose(1, 2)
    return block.linear_out(rg_lru(block.rg_lru, x, position_ids) * y)


def _layout_problem(module: nn.Module) -> str | None:
    lru: Any = module.get_submodule("rg_lru") if _is_block(module) else module  # its parameters by name
    heads, width = lru.input_gate_weight.shape[0], lru.recurrent_param.shape[0]
    shapes = {"input_gate_weight": (heads, width // heads, width // heads), "input_gate_bias": (heads, width // heads)}
    shapes.update({name.replace("input", "recurrent"): shape for name, shape in shapes.items()})
    if width % heads or any(tuple(getattr(lru, name).shape) != shape for name, shape in shapes.items()):
        return (f"its RG-LRU's gate weights are not {heads} heads' blocks over a width of {width} "
                f"(input_gate_weight {tuple(lru.input_gate_weight.shape)})")
    if module is lru:
        return None
    parts = {name: getattr(module, name) for name in _BLOCK_PARTS}
    conv = parts["conv_1d"]
    if not all(isinstance(parts[name], nn.Linear) for name in ("linear_x", "linear_y", "linear_out")) \
            or not isinstance(conv, nn.Conv1d) or conv.groups != width or conv.in_channels != width \
            or conv.out_channels != width or parts["linear_x"].out_features != width \
            or parts["linear_y"].out_features != width or parts["linear_out"].in_features != width:
        return (f"it is not linear_x and linear_y to {width} features, a depthwise conv_1d over them and linear_out "
                "back")
    return None


def _probe_input(weight: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn((2, 5, width), generator=g, dtype=torch.float64).to(weight.device, weight.dtype)
    return x, torch.arange(5, device=weight.device)[None].expand(2, 5)


def _forward_problem(module: Any) -> str | None:
    """Whether ``module``'s own forward is :func:`recurrent_block` (or :func:`rg_lru`) on a random input, under
    no_grad, its recurrent and convolution states put back after; None where it cannot run (meta weights)."""
    lru = module.rg_lru if module is not None and _is_block(module) else module
    weight = lru.recurrent_param
    if weight.is_meta or not weight.is_floating_point():
        return None

    states = [(owner, name, getattr(owner, name, None)) for owner, name in ((lru, "recurrent_states"),
                                                                             (module, "conv1d_state"))]
    try:
        lru.recurrent_states = None
        with probing(module):
            x, position_ids = _probe_input(lru.recurrent_param,
                                           module.linear_x.in_features if module is not lru else weight.shape[0])
            if module is lru:
                output, expected = type(lru).forward(lru, x, position_ids), rg_lru(lru, x, position_ids)
            else:
                output = type(module).forward(module, x, position_ids=position_ids, attention_mask=None,
                                              use_cache=False)
                output = output[0] if isinstance(output, tuple) else output
                expected = recurrent_block(module, x, position_ids)
    except Exception as error:  # noqa: BLE001  # any failure: not the forward the rule was written for
        return f"its forward failed on a probe ({type(error).__name__}: {error})"
    finally:
        for owner, name, value in states:
            if hasattr(owner, name):
                setattr(owner, name, value)
    if not isinstance(output, torch.Tensor) or output.shape != expected.shape \
            or not torch.allclose(output, expected, rtol=1e-4, atol=1e-6):
        what = "the RG-LRU" if module is lru else "linear_out(rg_lru(conv_1d(linear_x h)) * act_fn(linear_y h))"
        return f"on a probe its forward is not {what}, the forward the rule was written for"
    return None


def _problem(module: nn.Module, path: str) -> str | None:
    return _layout_problem(module) or _forward_problem(module)


def _detach_output(module, args, output):
    return output.detach()


class _HeldRecurrence:
    """The RG-LRU's hooks: the pre-hook sees whether the recurrence starts from a carried state; the forward hook
    gives the output the backward of :func:`rg_lru` with its gates held constant, checked to equal the output."""

    def __init__(self) -> None:
        self.carried: torch.Tensor | None = None

    def before(self, module, args, kwargs):
        state = getattr(module, "recurrent_states", None)
        self.carried = state if isinstance(state, torch.Tensor) else None

    def after(self, module, args, kwargs, output):
        bound = inspect.signature(type(module).forward).bind(module, *args, **kwargs).arguments
        x, position_ids = bound["activations"], bound["position_ids"]
        carried, self.carried = self.carried, None
        if not torch.is_grad_enabled():
            return None
        if carried is not None and bool((carried != 0).any()) and not bool((position_ids[:, 0] == 0).all()):
            raise HeadlabError(f"LRP: {type(module).__name__} starts its recurrence from a state carried from an "
                               "earlier call (a cache, no reset at its first position), whose relevance no input "
                               "of this call keeps; explain whole sequences")
        surrogate = rg_lru(module, x, position_ids, held=True)
        with torch.no_grad():
            if surrogate.shape != output.shape or not torch.allclose(surrogate, output, rtol=1e-3, atol=1e-5):
                raise HeadlabError(f"LRP: the output of {type(module).__name__} is not the RG-LRU the rule was "
                                   "written for (h_t = a_t h_(t-1) + sqrt(1 - a_t^2) i_t x_t); headlab has no LRP "
                                   "rule for it")
        return output.detach() + (surrogate - surrogate.detach())


def _hooks(module: nn.Module) -> list[Hook]:
    if _is_block(module):  # the GeLU branch: a gate, held constant
        return [(module.get_submodule("linear_y"), "forward", _detach_output)]
    held = _HeldRecurrence()
    return [(module, "pre_kwargs", held.before), (module, "forward_kwargs", held.after)]


RULE = register(MixerRule(
    name="RG-LRU recurrent block (RecurrentGemma: a_t, i_t and sqrt(1 - a_t^2) held constant, the GeLU branch a "
         "gate held constant)",
    matches=_matches, problem=_problem, hooks=_hooks))
