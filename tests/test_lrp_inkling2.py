"""LRP on Inkling2 and Inkling2-Loop (``inkling2_text``, ``inkling2``, ``inkling2_loop_text``, ``inkling2_loop``),
session 42; before, refused before any work (adapters.families.LRP_REFUSED: "no rule checked for ... its block attention
residuals ... and its full-attention layers' dynamic key/value short convolutions"), every test here failing with it.

The rules (headlab.importance.mixer_rules.inkling2): the block attention residuals' weights over depth and their norm's
``1 / rms`` held constant, the dynamic convolutions' taps from ``weight_proj`` held constant, Inkling2-Loop's message
gates held constant; beside them the experts' softcapped SwiGLU gets the activation and product rules (rules.py's
``_softcapped_rule``) and the static short convolutions, ``(u + conv(u)) / sqrt(kernel + 1)``, their ordinary
backward (mixer_rules/inkling.py). Tiny models from tests/test_inkling2.py's builder, in float64 (loaded with
``dtype=``, its float32 modules kept: LRP widens them)."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from headlab import HeadlabError, prune_heads
from headlab.importance import lrp_rules
from headlab.importance.lrp import _KeptWide, _widened
from headlab.importance.rules import check_rules
from support.lrp_families import assert_conserved, check_lrp_refused_before_any_work, check_rules_leave_the_forward_unchanged
from test_inkling2 import CONFIG_MAPPING, LOOP_PRUNINGS, PRUNINGS, build, config

TYPES = ("inkling2_text", "inkling2", "inkling2_loop_text", "inkling2_loop")
TEXT = {"inkling2": "inkling2_text", "inkling2_loop": "inkling2_loop_text"}
PRUNED = {"inkling2_text": PRUNINGS["partial"][0], "inkling2_loop_text": LOOP_PRUNINGS["same heads at each depth"][0]}
EMPTIED = {"inkling2_text": PRUNINGS["full layer emptied"][0],
           "inkling2_loop_text": LOOP_PRUNINGS["full loop layer emptied"][0]}


def _offset(model: torch.nn.Module) -> torch.nn.Module:
    """test_inkling2.build's offsets (queries, static taps, scales off their initial zeros and ones; gates far apart)."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("query", "static_weight", "scale")) or "norm" in name:
                parameter.add_(torch.randn_like(parameter) * 0.3)
            if name.endswith("gate_proj.weight"):
                parameter.mul_(8)
    return model


def _model(model_type: str, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    """The tiny text model, or the multimodal one (a tiny vision tower, idle on token ids, around it)."""
    if model_type not in TEXT:
        return build(model_type=model_type, dtype=dtype)
    from transformers import AutoModelForImageTextToText

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {model_type}")
    vision = dict(text_hidden_size=32, hidden_size=16, intermediate_size=20, num_hidden_layers=1, num_attention_heads=2)
    cfg = CONFIG_MAPPING[model_type](text_config=config(TEXT[model_type]).to_dict(), vision_config=vision)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(cfg, dtype=dtype).eval()
    model.set_experts_implementation("eager")
    return _offset(model)


@pytest.mark.parametrize("model_type", TYPES)
def test_the_old_refusal_is_gone(model_type):
    from headlab.adapters.families import LRP_REFUSED

    assert LRP_REFUSED == {}
    check_rules(_model(model_type))  # before: "LRP: no rule for the attention of model.layers.0.self_attn ..."


@pytest.mark.parametrize("model_type", TYPES)
def test_lrp_conserves_in_float64(model_type):
    """The relevance reaching the first layer's input is the explained logit to float64 rounding (measured: 2e-13)."""
    record = assert_conserved(_model(model_type), 1e-8)
    assert record["embeddings"]["min"] != record["embeddings"]["max"]


@pytest.mark.parametrize("emptied", [False, True], ids=["heads removed", "a full layer emptied"])
@pytest.mark.parametrize("model_type", TYPES)
def test_lrp_conserves_in_float64_after_physical_pruning(model_type, emptied):
    """Pruned (a loop layer: the same heads at each of its depths), its kept heads scored, its removed ones not."""
    import numpy as np

    from headlab.importance import compute_lrp
    from support.lrp_families import lrp_data

    model = _model(model_type)
    spec = (EMPTIED if emptied else PRUNED)[TEXT.get(model_type, model_type)]
    prune_heads(model, spec)
    assert_conserved(model, 1e-8)
    scores = compute_lrp(model, *lrp_data(model), bootstrap=0)
    for (kind, depth), heads in spec.items():
        assert np.isnan(scores[kind][depth, heads]).all()
        kept = [h for h in range(4) if h not in heads]
        assert not np.isnan(scores[kind][depth, kept]).any()


@pytest.mark.parametrize("model_type", ["inkling2_text", "inkling2_loop_text"])
def test_in_bfloat16_the_probes_leave_it_as_it_was_and_lrp_conserves(model_type):
    """The experts' gate probe compares the softcapped SwiGLU as the module computes it (in float32, returned in
    bfloat16); before, computed in bfloat16 it rounded apart and the experts were refused ("computes none of ...")."""
    from support.lrp_families import check_probed_widened_and_left_as_it_was

    check_probed_widened_and_left_as_it_was(build(model_type=model_type, dtype=torch.bfloat16))


@pytest.mark.parametrize("model_type", ["inkling2_text", "inkling2_loop_text"])
def test_the_rules_leave_the_forward_unchanged(model_type):
    check_rules_leave_the_forward_unchanged(_model(model_type), padded=True)


def _run_recording(model, module) -> dict:
    """One sentence under lrp_rules as head_relevance runs it (its float32 parts widened to float64, and its casts);
    ``module``'s inputs and output recorded."""
    seen: dict = {}

    def leaves(m, args, kwargs):  # its tensor inputs cut from what made them: gradients of its own forward only
        args = tuple(a.detach().requires_grad_(True) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                     for a in args)
        return args, kwargs

    def record(m, args, kwargs, output):
        seen.update(args=args, kwargs=kwargs, output=output)

    check_rules(model)  # as compute_lrp, before widening the model (discovery's probe runs it as built, then cached)
    handles = [module.register_forward_pre_hook(leaves, with_kwargs=True, prepend=True)]
    try:
        with _widened(model, torch.float64), torch.enable_grad(), lrp_rules(model), _KeptWide(torch.float64):
            handles.append(module.register_forward_hook(record, with_kwargs=True))  # after the rule's: its output
            model(input_ids=torch.tensor([[5, 17, 33, 8, 61, 4, 9, 12, 40]]), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def _depth_reference(query: torch.Tensor, block_states: torch.Tensor, partial: torch.Tensor) -> torch.Tensor:
    """A block attention residual written apart from headlab's code, in float64: the states stacked over depth,
    each divided by its RMS, weighted by the softmax of the learned queries' scores; the RMS and the softmax
    weights (what LRP holds constant) taken as plain numbers under no_grad."""
    states = torch.cat([block_states, partial[..., None, :]], dim=-2)  # [batch, seq, depth, hidden]
    hidden = states.shape[-1]
    with torch.no_grad():
        rms = states.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
        logits = (states / rms) @ query.reshape(-1, hidden).T / math.sqrt(hidden)  # [batch, seq, depth, queries]
        weights = logits.softmax(dim=-2)
    return torch.einsum("bsdq,bsdh->bsqh", weights, states / rms)


@pytest.mark.parametrize("path", ["model.layers.1.attention_input", "model.layers.1.mlp_input", "model.final_input"])
def test_a_block_residuals_relevance_is_that_of_the_reference_with_its_weights_constant(path):
    """The relevance its inputs (the states at the block boundaries and the partial state) get for a random weighting
    of its outputs is x * grad of the reference, to 1e-10, and sums to the weighted output (the rule is bias-free)."""
    model = _model("inkling2_text")
    module = model.get_submodule(path)
    seen = _run_recording(model, module)
    block_states, partial = seen["args"][:2]
    outputs = torch.stack(seen["output"], dim=-2)  # [batch, seq, queries, hidden]
    w = torch.randn(outputs.shape, generator=torch.Generator().manual_seed(3), dtype=outputs.dtype)
    grads = torch.autograd.grad((outputs * w).sum(), (block_states, partial), allow_unused=True)
    relevance = [x.detach() * (torch.zeros_like(x) if g is None else g) for x, g in zip((block_states, partial), grads)]
    inputs = [x.detach().clone().requires_grad_(True) for x in (block_states, partial)]
    with torch.enable_grad():
        reference = _depth_reference(module.query.detach().double(), *inputs)
        reference_grads = torch.autograd.grad((reference * w).sum(), inputs)
    torch.testing.assert_close(reference.detach(), outputs.detach(), rtol=1e-10, atol=1e-12)
    for got, x, g in zip(relevance, inputs, reference_grads):
        torch.testing.assert_close(got, x.detach() * g, rtol=1e-10, atol=1e-12)
    total = sum(float(r.sum()) for r in relevance)
    assert abs(total - float((outputs.detach() * w).sum())) < 1e-9
    assert float(relevance[0].abs().sum()) > 0  # the earlier blocks' states get relevance, not only the partial one


def _dynamic_reference(static: torch.Tensor, taps: torch.Tensor, u: torch.Tensor, heads: int) -> torch.Tensor:
    """Inkling2's dynamic convolution written apart, as a loop over positions and lags: channel c of key/value head
    h at position t, ``(sum_l (static[l, c] + taps[t, h, l]) u[t - l, c] + u[t, c]) / sqrt(2 K + 1)``, with ``taps``
    (weight_proj's output, ``[batch, seq, heads * K]``) a plain number (held constant)."""
    kernel, width = static.shape
    taps = taps.detach().view(*taps.shape[:2], heads, kernel)
    per_head = width // heads
    rows = []
    for t in range(u.shape[1]):
        out = u[:, t].clone()
        for lag in range(min(kernel, t + 1)):
            tap = static[lag] + taps[:, t].repeat_interleave(per_head, dim=1)[:, :, lag]
            out = out + tap * u[:, t - lag]
        rows.append(out / math.sqrt(2 * kernel + 1))
    return torch.stack(rows, dim=1)


@pytest.mark.parametrize("projection", ["k_proj", "v_proj"])
def test_a_dynamic_convolutions_relevance_is_that_of_the_reference_with_its_taps_constant(projection):
    """Layer 1 (full attention): its u's relevance is that of the reference to 1e-10, and none reaches the taps' input
    (the layer's input, through weight_proj): before this rule, the taps took a share and relevance was not conserved."""
    model = _model("inkling2_text")
    module = model.get_submodule(f"model.layers.1.self_attn.{projection}.sconv")
    taps: dict = {}
    handle = module.weight_proj.register_forward_hook(lambda m, args, output: taps.update(value=output))
    try:
        seen = _run_recording(model, module)
    finally:
        handle.remove()
    u, x = seen["args"][:2]
    y = seen["output"]
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(3), dtype=y.dtype)
    grad_u, grad_x = torch.autograd.grad((y * w).sum(), (u, x), allow_unused=True)
    u_ref = u.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        reference = _dynamic_reference(module.static_weight.detach().double(), taps["value"], u_ref, module.num_heads)
        grad_ref, = torch.autograd.grad((reference * w).sum(), u_ref)
    torch.testing.assert_close(reference.detach(), y.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(u.detach() * grad_u, u_ref.detach() * grad_ref, rtol=1e-10, atol=1e-12)
    assert grad_x is None or not grad_x.any()  # the taps' input gets no relevance through them
    assert abs(float((u.detach() * grad_u).sum() - (y.detach() * w).sum())) < 1e-9


def test_a_message_gates_relevance_splits_between_the_state_and_the_message_with_its_gates_constant():
    """Inkling2-Loop's q_message_gate of layer 1 (pass 1): (1 - f) h + g m with f, g plain numbers, to 1e-10."""
    model = _model("inkling2_loop_text")
    module = model.get_submodule("model.layers.1.q_message_gate")
    gates: dict = {}
    handles = [getattr(module, name).register_forward_hook(lambda m, args, output, name=name: gates.update({
        name: output})) for name in ("forget_gate_proj", "message_gate_proj")]
    try:
        seen = _run_recording(model, module)
    finally:
        for handle in handles:
            handle.remove()
    h, m = seen["args"][:2]
    y = seen["output"]
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(3), dtype=y.dtype)
    grad_h, grad_m = torch.autograd.grad((y * w).sum(), (h, m))
    forget, gate = (torch.tanh(gates[name].detach()) for name in ("forget_gate_proj", "message_gate_proj"))
    torch.testing.assert_close((1 - forget) * h.detach() + gate * m.detach(), y.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(h.detach() * grad_h, (1 - forget) * h.detach() * w, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(m.detach() * grad_m, gate * m.detach() * w, rtol=1e-10, atol=1e-12)


def test_the_softcapped_swiglu_gets_the_activation_and_product_rules():
    """softcap(g) sigmoid(g) and softcap(u) pass their relevance to g and u unchanged (activation rule), their product
    splits a b as a / (a + b) and b / (a + b) (Ding et al.'s rule); before, the experts were refused ("no act_fn")."""
    from headlab.importance.rules import _experts_layout, _softcapped_rule

    model = _model("inkling2_text")
    experts = model.model.layers[0].mlp.experts
    layout = _experts_layout(experts)
    assert not isinstance(layout, str) and layout[2].softcaps == (experts.act_fn.gate_softcap.softcap,
                                                                  experts.act_fn.up_softcap.softcap)
    g = torch.Generator().manual_seed(0)
    gate, up = (10 * torch.randn(64, generator=g, dtype=torch.float64)).requires_grad_(True), \
        (10 * torch.randn(64, generator=g, dtype=torch.float64)).requires_grad_(True)
    caps = layout[2].softcaps
    out = _softcapped_rule(gate, up, *caps)
    with _KeptWide(torch.float64):  # its float32 casts widened, as in LRP
        torch.testing.assert_close(out.detach(), experts.act_fn(gate.detach(), up.detach()), rtol=1e-12, atol=1e-12)
    grad_gate, grad_up = torch.autograd.grad(out.sum(), (gate, up))
    with torch.no_grad():
        a = caps[0] * torch.tanh(gate / caps[0]) * torch.sigmoid(gate)
        b = caps[1] * torch.tanh(up / caps[1])
    torch.testing.assert_close(gate.detach() * grad_gate, a / (a + b) * a * b, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(up.detach() * grad_up, b / (a + b) * a * b, rtol=1e-9, atol=1e-12)


def _then_tanh(forward):
    """``forward`` with tanh applied to its output(s): the same signature, no longer the formula a rule was written for."""

    @functools.wraps(forward)
    def changed(*args, **kwargs):
        output = forward(*args, **kwargs)
        return tuple(map(torch.tanh, output)) if isinstance(output, tuple) else torch.tanh(output)

    return changed


@pytest.mark.parametrize("cls, match", [
    ("Inkling2BlockAttentionResidual", r"Inkling2's block attention residuals .*: on a probe its forward is not "
                                       r"sum_d softmax_d"),
    ("Inkling2DynamicShortConvolution", r"Inkling2's dynamic key/value short convolutions .*: on a probe its forward "
                                        r"is not \(sum_l"),
    ("Inkling2ShortConvolution", r"Inkling's residual short convolution: on a probe its forward is not "
                                 r"\(u \+ conv\(u\)\) / sqrt\(kernel \+ 1\)"),
])
def test_a_part_computing_otherwise_is_refused_before_any_work(monkeypatch, cls, match):
    """A forward other than the one the rule was written for (here: tanh of its output) is refused, naming the rule."""
    from transformers.models.inkling2 import modeling_inkling2

    model = _model("inkling2_text")
    monkeypatch.setattr(getattr(modeling_inkling2, cls), "forward", _then_tanh(getattr(modeling_inkling2, cls).forward))
    check_lrp_refused_before_any_work(model, match)


def test_a_message_gate_computing_otherwise_is_refused_before_any_work(monkeypatch):
    from transformers.models.inkling2_loop import modeling_inkling2_loop

    model = _model("inkling2_loop_text")
    monkeypatch.setattr(modeling_inkling2_loop.Inkling2LoopMessageGate, "forward",
                        lambda module, h, m: h * torch.sigmoid(m))
    with pytest.raises(HeadlabError, match=r"Inkling2-Loop's message gates .*: on a probe its forward is not "
                                           r"\(1 - tanh\(forget_gate_proj\(z\)\)\) h"):
        check_rules(model)


def test_the_block_residuals_probe_is_the_models_forward():
    """The probe the rule compares (depth_mix) reproduces the module's own forward on the model's states, exactly
    enough for the check on every call (1e-12 in float64)."""
    from headlab.importance.mixer_rules.inkling2 import depth_mix

    model = _model("inkling2_loop_text")
    module = model.model.message_input
    g = torch.Generator().manual_seed(1)
    states, partial = torch.randn((2, 4, 3, 32), generator=g, dtype=torch.float64), \
        torch.randn((2, 4, 32), generator=g, dtype=torch.float64)
    with torch.no_grad(), _KeptWide(torch.float64):
        for loop_layer in range(module.query.shape[0]):
            torch.testing.assert_close(depth_mix(module, states, partial, loop_layer),
                                       module(states, partial, loop_layer).double(), rtol=1e-12, atol=1e-12)
