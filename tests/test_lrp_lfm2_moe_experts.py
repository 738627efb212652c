"""LRP through LFM2-MoE's experts (``Lfm2MoeExperts``, session 35, branch lfm2moe35; importance/rules.py,
``_experts_rule`` with :class:`_CalledSilu`): ``sum_k w_k down_k(silu(gate_k x) * up_k x)``, ``gate_up_proj``
``[experts, 2 x inner, hidden]`` as Mixtral's, but SiLU a function call (``act_fn = F.silu``), not a module. Before:
refused before any work ("it has no act_fn module, nor GPT-OSS's clamped SwiGLU"). Now, on tiny models (a
convolution layer, an attention layer, sparse layers): relevance is conserved in float32 runs and to float64
rounding, the forward is unchanged, an expert layer's input relevance is gradient x input of an independent float64
re-implementation with the routing weights as constants, and another activation function or an output the rule
does not reproduce is refused."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from torch.nn import functional as F

from headlab import HeadlabError
from headlab.importance import lrp_rules
from headlab.importance.rules import check_rules
from support.family_matrix import check_lrp_conserves
from support.lrp_families import (
    assert_conserved,
    check_lrp_refused_before_any_work,
    check_rules_leave_the_forward_unchanged,
    offset_biases_and_norms,
)


def _model(dtype=torch.float32, seed: int = 0) -> torch.nn.Module:
    config = tf.Lfm2MoeConfig(vocab_size=99, hidden_size=32, intermediate_size=40, num_hidden_layers=3,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                              bos_token_id=0, eos_token_id=1, pad_token_id=2,
                              layer_types=["conv", "full_attention", "conv"], num_dense_layers=1, num_experts=4,
                              num_experts_per_tok=2, moe_intermediate_size=16)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = tf.Lfm2MoeForCausalLM(config).eval()
    with torch.no_grad():  # transformers leaves the experts' weights empty
        for name, parameter in model.named_parameters():
            if name.endswith("_proj") and parameter.dim() == 3:
                parameter.normal_(0, parameter.shape[2] ** -0.5)
            elif name.endswith("gate.weight"):
                parameter.normal_(0, 1)
    offset_biases_and_norms(model)
    return model.to(dtype)


def _experts(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__ == "Lfm2MoeExperts"]


def test_the_pipeline_record_conserves():
    """Before: refused (no act_fn module). The embeddings plus the biases' shares are the explained logit."""
    model = _model()
    assert len(_experts(model)) == 2
    check_rules(model)
    assert_conserved(model, 1e-6)


def test_a_float64_model_conserves_to_float64_rounding():
    model = _model(torch.float64)
    assert_conserved(model, 5e-14)


def test_relevance_crossing_every_layer_from_the_first_is_conserved():
    model = _model(torch.float64)
    check_lrp_conserves(model, model.model.layers[0], rtol=1e-11, atol=1e-12)


def test_the_rule_leaves_the_forward_unchanged():
    check_rules_leave_the_forward_unchanged(_model())


def test_each_experts_relevance_is_gradient_x_input_of_the_reference_with_constant_routing_weights():
    """The experts' input relevance under lrp_rules equals that of an independent float64 re-implementation in
    which the product silu(g) * u gets Ding's rule (R split in proportion to silu(g) and u, silu's identity rule)
    and the routing weights are constants, per expert (one expert's tokens at a time), to 1e-10."""
    model = _model(torch.float64)
    experts = _experts(model)[0]
    kept: dict = {}
    handle = experts.register_forward_pre_hook(lambda module, args: kept.update(args=args))
    with torch.no_grad():
        model(input_ids=torch.arange(4, 40).unsqueeze(0))
    handle.remove()
    x0, index, weights = (a.detach() for a in kept["args"])
    inner = experts.down_proj.shape[2]
    for expert in range(experts.num_experts):
        token, slot = torch.where(index == expert)
        if not len(token):
            continue
        x = x0.clone().requires_grad_(True)
        only = torch.where(index == expert, index, torch.full_like(index, experts.num_experts))  # the others skipped
        w = torch.randn(x.shape, generator=torch.Generator().manual_seed(expert), dtype=torch.float64)
        with torch.enable_grad(), lrp_rules(model):
            output = experts(x, only, weights)
            grad, = torch.autograd.grad((w * output).sum(), x)
        # the reference: R(out) = out * w; per token the expert's hidden h = silu(g) * u, R(h) = h * (down^T w) * c
        gate_up = x0[token] @ experts.gate_up_proj.detach()[expert].T
        g, u = gate_up[:, :inner], gate_up[:, inner:]
        s = F.silu(g)
        h = s * u
        c = weights[token, slot, None]
        torch.testing.assert_close(output.detach()[token], (h @ experts.down_proj.detach()[expert].T) * c,
                                   rtol=1e-12, atol=1e-12)
        r_h = h * ((w[token] * c) @ experts.down_proj.detach()[expert])  # weighted-sum rule through down and w_k
        total = s + u
        r_g, r_u = r_h * s / total, r_h * u / total  # Ding's product rule; SiLU's identity rule: R(g) = R(silu(g))
        # back to x through gate_up, a weighted sum: x * (W_g^T (R_g / g) + W_u^T (R_u / u))
        weight = experts.gate_up_proj.detach()[expert]
        expected = torch.zeros_like(x0)
        expected[token] = x0[token] * ((r_g / g) @ weight[:inner] + (r_u / u) @ weight[inner:])
        torch.testing.assert_close(x0 * grad, expected, rtol=0, atol=1e-10)
        assert abs(float((x0 * grad).sum() - (w * output.detach()).sum())) < 1e-10  # bias-free: conserved
    assert len(torch.unique(index)) == experts.num_experts  # every expert checked


def test_another_activation_function_is_refused_before_any_work():
    """act_fn a function that is not SiLU (GELU): no rule names it, refused naming the module and why."""
    model = _model()
    _experts(model)[0].act_fn = F.gelu
    check_lrp_refused_before_any_work(
        model, r"no rule for the mixture-of-experts module Lfm2MoeExperts \(model.layers.1.feed_forward.experts\):"
               r" it has no act_fn module nor an act_fn function computing SiLU")


def test_experts_laid_out_otherwise_are_refused_at_run_time():
    """[up; gate] read as [gate; up] (a forward computing up's SiLU): the rule's recomputation differs, refused."""
    model = _model()
    experts = _experts(model)[0]
    original = type(experts).forward

    def swapped(self, hidden_states, top_k_index, top_k_weights):
        inner = self.down_proj.shape[2]
        flipped = torch.cat([self.gate_up_proj[:, inner:], self.gate_up_proj[:, :inner]], 1)
        saved = self.gate_up_proj.data
        self.gate_up_proj.data = flipped.detach()
        try:
            return original(self, hidden_states, top_k_index, top_k_weights)
        finally:
            self.gate_up_proj.data = saved

    experts.forward = swapped.__get__(experts)
    with lrp_rules(model), pytest.raises(HeadlabError, match="Lfm2MoeExperts is not a sum of routed gated experts"):
        model(input_ids=torch.tensor([[5, 17, 33, 8]]))
