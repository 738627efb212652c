"""LRP through the mixtures of experts it refused before session 28 (importance/rules.py, _experts_rule):
GPT-OSS (transposed expert weights with biases, interleaved [gate, up] columns, a clamped SwiGLU gate), Llama 4
(transposed weights, every expert on its input scaled by the router's scores outside it, an activation_fn shared
expert, an L2 query/key norm), Aria (transposed weights) and MiniMax-M3 (GPT-OSS's gate on [gate; up], a dense
clamped SwiGLU shared expert). Bias-free in float64 the relevance reaching every layer sums to the explained
logit; the rules leave every forward value as it was; what the rules do not reproduce is refused."""

import pytest
import torch
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from headlab.errors import HeadlabError
from headlab.importance.rules import _clamped_swiglu, check_rules, lrp_rules
from support.converted import _SIZES, model_class
from support.family_matrix import check_lrp_conserves

_OVERRIDES = {
    "gpt_oss": {},
    # layer 0 dense (Llama4TextMLP, its activation named activation_fn), layer 1 experts beside a shared one
    "llama4_text": dict(interleave_moe_layer_step=2, intermediate_size_mlp=48),
    "aria_text": dict(moe_num_experts=4, moe_topk=2),
    "minimax_m3_vl_text": dict(shared_intermediate_size=40, dense_intermediate_size=40),
}
TYPES = tuple(_OVERRIDES)


def _tiny(model_type: str, dtype=torch.float64, seed: int = 0):
    config = CONFIG_MAPPING[model_type](**{**_SIZES, **_OVERRIDES[model_type]})
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # the loop LRP runs (grouped matmuls take no float64)
    torch.manual_seed(seed)
    model = model_class(config)(config).eval().to(dtype)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("_proj") and parameter.dim() == 3:  # transformers leaves some experts' weights empty
                parameter.normal_(0, parameter.shape[1] ** -0.5)
            elif name.endswith(("router.weight", "gate.weight")):  # GPT-OSS's starts at zero: every token alike
                parameter.normal_(0, 1)
            elif name.endswith("bias") or "norm" in name.lower():
                parameter.add_(torch.randn_like(parameter) * 0.1)
    return model


def _experts_used(model) -> set[tuple[str, int]]:
    """(path, expert) of every expert that a token of check_lrp_conserves's batch is routed to (records hooks)."""
    used: set[tuple[str, int]] = set()
    for path, module in model.named_modules():
        name = type(module).__name__
        if name in ("GptOssTopKRouter", "AriaTextTopKRouter", "MiniMaxM3VLTopKRouter"):
            module.register_forward_hook(lambda m, a, out, path=path: used.update((path, int(e)) for e in out[-1].flatten()))
        elif name == "Llama4Router":  # scores: sigmoid of the top-k logits, zero elsewhere
            module.register_forward_hook(lambda m, a, out, path=path: used.update(
                (path, int(e)) for e in (out[0] > 0).nonzero()[:, 1]))
    return used


@pytest.mark.parametrize("model_type", TYPES)
def test_mixtures_of_experts_conserve_in_float64(model_type):
    """Refused before (GPT-OSS, Llama 4, Aria: their expert weights not [experts, 2 x inner, hidden]; MiniMax-M3:
    no act_fn module). Bias-free in float64, every expert used, the relevance at the first layer's input is the
    explained logit to float64 rounding."""
    model = _tiny(model_type, seed=7)  # a seed whose 7 tokens reach every expert of every layer (asserted)
    used = _experts_used(model)
    check_lrp_conserves(model, model.model.layers[0], rtol=1e-11, atol=1e-12)
    n_experts = model.config.num_local_experts if model_type != "aria_text" else model.config.moe_num_experts
    routers = {path for path, _ in used}
    assert routers and all(len({e for p, e in used if p == path}) == n_experts for path in routers)


@pytest.mark.parametrize("model_type", TYPES)
def test_every_layer_holds_the_whole_logit_and_the_forward_is_unchanged(model_type):
    """Per layer (not only at the first one), and the logits under the rules are the model's, bit for bit."""
    model = _tiny(model_type)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.zero_()
    ids = torch.tensor([[5, 17, 33, 8, 61, 4, 90, 12]])
    with torch.no_grad():
        plain = model(input_ids=ids).logits
    with torch.enable_grad(), lrp_rules(model):
        out = model(input_ids=ids, output_hidden_states=True)
        y = out.logits[0, -1].max()
        grads = torch.autograd.grad(y, list(out.hidden_states))
    assert torch.equal(out.logits.detach(), plain)
    totals = torch.stack([(h.detach() * g).sum() for h, g in zip(out.hidden_states, grads)])
    torch.testing.assert_close(totals, y.detach().expand_as(totals), rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("model_type", ["gpt_oss", "aria_text"])
def test_float32_forward_is_unchanged_with_biases(model_type):
    """In the model's own float32, with its biases (GPT-OSS's expert biases), the rules change no forward value."""
    model = _tiny(model_type, dtype=torch.float32)
    ids = torch.tensor([[5, 17, 33, 8, 61, 4]])
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with lrp_rules(model):
            ruled = model(input_ids=ids).logits
    assert torch.equal(ruled, plain)


def test_the_clamped_swiglu_rule_sends_all_relevance_to_gate_and_up():
    """GPT-OSS's (clamp(up) + 1) * glu(clamp(gate)): identity rule through the clamps and g * sigmoid(alpha g),
    u * glu + glu split by the weighted-sum and product rules, so R(gate) + R(up) = R(output) exactly, also where
    the clamps are reached (|x| up to 30, limit 7); the forward value is the formula's."""
    g = torch.Generator().manual_seed(0)
    gate = (10 * torch.randn(64, generator=g, dtype=torch.float64)).requires_grad_()
    up = (10 * torch.randn(64, generator=g, dtype=torch.float64)).requires_grad_()
    alpha, limit = 1.702, 7.0
    v = _clamped_swiglu(gate, up, alpha, limit)
    c = gate.detach().clamp(max=limit)
    torch.testing.assert_close(v.detach(), (up.detach().clamp(-limit, limit) + 1) * c * torch.sigmoid(alpha * c))
    weights = torch.randn(64, generator=g, dtype=torch.float64)  # relevance R(v) = v * weights
    d_gate, d_up = torch.autograd.grad(v, (gate, up), weights)
    # per neuron; Ding's share a * b / (a + b) grows where a + b nears zero, and float64 rounding with it
    torch.testing.assert_close((gate * d_gate + up * d_up).detach(), v.detach() * weights, rtol=1e-10, atol=1e-12)
    assert (up.abs() > limit).any() and (gate > limit).any()


def test_experts_with_a_gate_the_rules_do_not_know_are_refused_before_any_work():
    """A custom _apply_gate that is neither act(gate) * up nor the clamped SwiGLU (here: the + 1 left out)."""
    model = _tiny("gpt_oss")
    experts = model.model.layers[1].mlp.experts

    def other_gate(gate_up):
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        return up * gate * torch.sigmoid(gate * 1.702)

    experts._apply_gate = other_gate
    with pytest.raises(HeadlabError, match=r"no rule for the mixture-of-experts module GptOssExperts "
                                           r"\(model.layers.1.mlp.experts\): it applies its own gate"):
        check_rules(model)


def test_experts_that_compute_something_else_are_refused_at_run_time():
    """The rule recomputes GPT-OSS's experts: an output it does not reproduce is refused, not explained."""
    model = _tiny("gpt_oss")
    model.model.layers[0].mlp.experts.register_forward_hook(lambda module, args, output: 2 * output)
    with lrp_rules(model), pytest.raises(HeadlabError, match="GptOssExperts is not a sum of routed gated experts"):
        model(input_ids=torch.tensor([[5, 17, 33]]))


def test_dense_experts_without_a_router_beside_them_are_refused():
    """Llama 4's experts take their input already scaled by the router's scores: without a router beside them to
    hold constant, relevance would flow into the routing, so they are refused."""
    from headlab.importance.rules import _moe_layout_problem

    moe = _tiny("llama4_text").model.layers[1].feed_forward
    assert _moe_layout_problem(moe.experts, moe) is None
    assert _moe_layout_problem(moe.experts, torch.nn.Module()).startswith("it is called on the hidden states alone")


def test_a_dense_clamped_mlp_computing_something_else_is_refused_before_any_work(monkeypatch):
    """MiniMax-M3's dense MLP has no activation module: its forward is probed; another formula is refused."""
    model = _tiny("minimax_m3_vl_text")
    cls = type(model.model.layers[0].mlp.shared_experts)
    monkeypatch.setattr(cls, "forward", lambda self, x: self.down_proj(
        torch.nn.functional.silu(self.gate_up_proj(x).chunk(2, -1)[0])))
    with pytest.raises(HeadlabError, match="no rule for MiniMaxM3VLDenseMLP .*clamped SwiGLU"):
        check_rules(model)


@pytest.mark.parametrize("model_type", TYPES)
def test_a_run_records_conservation_with_the_experts_biases(model_type):
    """compute_lrp on the model as it is (float32, random biases: GPT-OSS's experts hold theirs in 3-d parameters
    gate_up_proj_bias and down_proj_bias, which no module's bias is): embeddings plus the biases' shares are the
    explained logits, every sentence within the tolerance. Before the experts' biases were probed, GPT-OSS's run
    failed its conservation check."""
    from headlab.importance import ImportanceData, compute_lrp, describe_model

    model = _tiny(model_type, dtype=torch.float32)
    info = describe_model(model)
    g = torch.Generator().manual_seed(0)
    data = ImportanceData.from_ids([torch.randint(3, 99, (k,), generator=g).tolist() + [1] for k in (4, 7, 5)])
    record = compute_lrp(model, data, info, bootstrap=0).signature["conservation"]
    assert record["n_sentences"] == 3 and record["n_outside"] == 0
    total = record["with_biases"]
    assert abs(total["min"] - 1) < 1e-6 and abs(total["max"] - 1) < 1e-6
