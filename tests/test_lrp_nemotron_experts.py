"""LRP through Nemotron-H's non-gated experts (transformers 5.24's ``NemotronHExperts``, Nemotron 3's MoE layers;
importance/rules.py, ``_non_gated_rule``; refused until session 35 as "its expert weights are not gate_up_proj"):
``sum_k w_k down_e(act(up_e x))``, relu^2 given the activation rule, the routing weights (sigmoid scores with a
correction bias, normalised and scaled by ``routed_scaling_factor``) held constant.

On tiny Nemotron-H models with attention, Mamba-2, MoE and MLP layers (built from configs, the router's weight and
correction bias drawn at random, with and without the latent projection): relevance is conserved in the pipeline's
record and to float64 rounding in float64, the forward is bit for bit unchanged, the relevance of the experts'
input through each expert is that of an independent float64 re-implementation whose routing weights are constants,
and non-gated experts laid out otherwise, or whose forward computes something else, are refused before any work.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from headlab import HeadlabError, attention_blocks
from headlab.importance import ImportanceData, compute_lrp, describe_model, lrp_rules
from headlab.importance.rules import check_rules

_CONFIG = dict(vocab_size=99, hidden_size=32, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=64, bos_token_id=0, eos_token_id=1, pad_token_id=2,
               layers_block_type=["attention", "moe", "mamba", "moe", "mlp"], mamba_num_heads=4, mamba_head_dim=8,
               ssm_state_size=8, n_groups=2, chunk_size=4, use_bias=True, use_conv_bias=True,
               n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
               moe_shared_expert_intermediate_size=40, n_group=1, topk_group=1, routed_scaling_factor=2.5)
EXPERTS = "model.layers.1.mixer.experts"


def nemotron_moe(dtype: torch.dtype = torch.float32, seed: int = 0, **extra) -> torch.nn.Module:
    """A tiny Nemotron-H with MoE layers in eval mode; the router's weight (zero at init: every score equal) and
    correction bias, the biases and the norm weights drawn at random."""
    config = tf.NemotronHConfig(**{**_CONFIG, **extra})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = tf.NemotronHForCausalLM(config).eval()
    with torch.no_grad():
        for path, parameter in model.named_parameters():
            last = path.rpartition(".")[2]
            if last.endswith("bias") or "norm" in path or last == "D" or path.endswith("gate.weight"):
                parameter.add_(torch.randn_like(parameter) * 0.3)
            elif last == "A_log":
                parameter.copy_(torch.rand_like(parameter) * 2 - 1)
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.copy_(torch.randn_like(module.e_score_correction_bias) * 0.1)
    return model.to(dtype)


def _data(model, n=4, seed=0):
    info = describe_model(model)
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 9, (n,), generator=g).tolist()
    return ImportanceData.from_ids([torch.randint(3, 99, (k,), generator=g).tolist() + [1] for k in lengths]), info


LAYOUTS = {"plain": {}, "latent": dict(moe_latent_size=16)}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_lrp_conserves_relevance(layout):
    """Embeddings plus the biases' shares are the explained logit, per sentence, in the pipeline's record of a float32
    model (computed widened: lrp_precision) and to float64 rounding in a float64 one. Before: refused."""
    for dtype, tolerance in ((torch.float32, 1e-6), (torch.float64, 5e-14)):
        model = nemotron_moe(dtype, **LAYOUTS[layout])
        data, info = _data(model)
        record = compute_lrp(model, data, info, bootstrap=0).signature["conservation"]
        assert record["n_sentences"] == 4 and record["n_outside"] == 0, record
        total = record["with_biases"]
        assert abs(total["min"] - 1) < tolerance and abs(total["max"] - 1) < tolerance, (dtype, total)


def test_the_forward_is_unchanged():
    model = nemotron_moe()
    ids = torch.tensor([[5, 17, 33, 8, 61, 4], [9, 12, 40, 3, 77, 6]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
    with torch.enable_grad(), lrp_rules(model):
        during = model(input_ids=ids).logits
    assert torch.equal(before, during)


def _reference(experts, x, index, weights):
    """``sum_k w_k down_e(act(up_e x))`` in float64 written out: the routing weights plain constants, relu^2 as
    ``u * c`` with ``c = relu(u)`` a constant (the activation rule: R(u) = R(relu(u)^2)); one output per expert."""
    up, down = experts.up_proj.detach(), experts.down_proj.detach()
    per_expert = []
    for e in range(up.shape[0]):
        token, slot = torch.where(index == e)
        u = x[token] @ up[e].T
        activated = u * torch.relu(u).detach()
        routed = (activated @ down[e].T) * weights[token, slot, None]
        per_expert.append(torch.zeros_like(x).index_add(0, token, routed))
    return per_expert


def test_the_relevance_through_each_expert_is_that_of_the_sum_with_routing_weights_constant():
    """x * grad of the experts' output under lrp_rules, through one expert at a time (the other experts' routing
    weights zero), equals x * grad of the reference, to 1e-10; the routing weights get no gradient."""
    model = nemotron_moe(torch.float64)
    experts = model.get_submodule(EXPERTS)
    g = torch.Generator().manual_seed(1)
    x = 5 * torch.randn((7, 32), generator=g, dtype=torch.float64)  # tiny init weights: relevance well above 1e-10
    index = torch.stack([torch.arange(7) % 4, (torch.arange(7) + 1) % 4], -1)
    scores = torch.rand((7, 2), generator=g, dtype=torch.float64) * 2.5
    c = torch.randn((7, 32), generator=g, dtype=torch.float64)
    references = _reference(experts, x, index, scores)
    for e in range(4):
        weights = torch.where(index == e, scores, torch.zeros_like(scores)).requires_grad_(True)
        h = x.clone().requires_grad_(True)
        with torch.enable_grad(), lrp_rules(model):
            out = experts(h, index, weights)
            grad, weights_grad = torch.autograd.grad((out * c).sum(), [h, weights], allow_unused=True)
        expected_in = x.clone().requires_grad_(True)
        expected = _reference(experts, expected_in, index, weights.detach())[e]
        (expected_grad,) = torch.autograd.grad((expected * c).sum(), [expected_in])
        torch.testing.assert_close(out.detach(), references[e], rtol=0, atol=1e-10)
        torch.testing.assert_close(x * grad, x * expected_grad, rtol=0, atol=1e-10)
        assert (x * grad).abs().max() > 1e-2  # relevance there to compare
        assert weights_grad is None or not weights_grad.any()
        # conservation within the experts: relu^2's ratio rule and constant weights give all of R(out) to x
        torch.testing.assert_close((x * grad).sum(), (out * c).sum().detach(), rtol=1e-12, atol=0)


# -- refusals -----------------------------------------------------------------------------------------------------
def _refused_before_any_work(model, message: str) -> None:
    attention_blocks(model)  # discovery's probe pass (once, cached): not the measure's work
    calls: list = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    data, info = _data(model)
    with pytest.raises(HeadlabError, match=r"no rule for the mixture-of-experts module .*"
                                           r"\(model\.layers\.1\.mixer\.experts\): " + message):
        compute_lrp(model, data, info, bootstrap=0)
    assert not calls


@pytest.mark.parametrize(("flag", "refusal"), [
    ("is_transposed", r"its non-gated layout differs \(is_transposed=True\)"),
    ("has_bias", r"its non-gated layout differs \(has_bias=True\)"),
    ("has_post_expert_norm", r"its non-gated layout differs \(has_post_expert_norm=True\)"),
])
def test_non_gated_experts_laid_out_otherwise_are_refused(flag, refusal):
    model = nemotron_moe()
    setattr(model.get_submodule(EXPERTS), flag, True)
    _refused_before_any_work(model, refusal)


def test_non_gated_experts_with_weights_of_another_shape_are_refused():
    model = nemotron_moe()
    experts = model.get_submodule(EXPERTS)
    experts.down_proj = torch.nn.Parameter(experts.down_proj.detach().transpose(1, 2).contiguous())
    _refused_before_any_work(model, r"headlab.s rule for non-gated experts is for up_proj \[experts, inner, in\] "
                                    r"and down_proj .*not laid out")


def test_non_gated_experts_whose_forward_computes_something_else_are_refused():
    """A class of that layout whose forward squares after the down projection: the probe catches it."""
    model = nemotron_moe()
    experts = model.get_submodule(EXPERTS)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            token, slot = torch.where(top_k_index == e)
            h = torch.nn.functional.linear(torch.nn.functional.linear(hidden_states[token], self.up_proj[e]),
                                           self.down_proj[e])
            out = out.index_add(0, token, self.act_fn(h) * top_k_weights[token, slot, None])
        return out

    experts.__class__ = type("OtherExperts", (type(experts),), {"forward": forward})
    _refused_before_any_work(model, r"its forward does not compute sum_k w_k down_e\(act_fn\(up_e x\)\)")


def test_non_gated_experts_without_an_activation_module_are_refused():
    model = nemotron_moe()
    experts = model.get_submodule(EXPERTS)
    experts.act_fn = torch.nn.Identity()
    with pytest.raises(HeadlabError, match="no act_fn activation module"):
        check_rules(model)


def test_a_hook_that_changes_the_output_fails_the_rule_check():
    """The rule recomputes the experts' output on every call: one it does not reproduce is refused, not explained."""
    model = nemotron_moe()
    model.get_submodule(EXPERTS).register_forward_hook(lambda module, args, output: 2 * output)
    data, info = _data(model)
    with pytest.raises(HeadlabError, match="NemotronHExperts is not a sum of routed non-gated experts"):
        compute_lrp(model, data, info, bootstrap=0)


def test_experts_with_a_gate_proj_beside_up_proj_are_not_taken_for_non_gated():
    """Inkling's shared experts hold 3-d ``gate_proj``, ``up_proj`` and ``down_proj`` (gated): not probed as non-gated
    ones. Without a forward taking ``gammas`` (Inkling's own have a rule since session 36, tests/test_lrp_inkling.py)
    refused as gated experts of another layout."""
    from headlab.importance.rules import _moe_layout_problem

    class SharedExperts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj = torch.nn.Parameter(torch.zeros(2, 8, 4))
            self.up_proj = torch.nn.Parameter(torch.zeros(2, 8, 4))
            self.down_proj = torch.nn.Parameter(torch.zeros(2, 4, 8))
            self.act_fn = torch.nn.SiLU()

    assert _moe_layout_problem(SharedExperts()).startswith("its expert weights are not gate_up_proj")


def test_a_bfloat16_model_is_probed_and_explained():
    """The probe runs in the model's own type (bfloat16 here) before LRP widens it: no false refusal."""
    model = nemotron_moe(torch.bfloat16)
    data, info = _data(model)
    total = compute_lrp(model, data, info, bootstrap=0).signature["conservation"]["with_biases"]
    assert abs(total["min"] - 1) < 5e-14 and abs(total["max"] - 1) < 5e-14, total
