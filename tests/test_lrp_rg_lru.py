"""LRP through RecurrentGemma's recurrent blocks (Griffin's RG-LRU: session 35, branch lrpconv35;
headlab.importance.mixer_rules.rg_lru). The RG-LRU's decay ``a_t``, input gate ``i_t`` and normaliser
``sqrt(1 - a_t^2)`` held constant (MambaLRP's principle), the GeLU branch a gate held constant (CP-LRP), so the block
is linear in its recurrent branch. Before: refused before any work ("a state-space (or linear recurrent) token
mixer"). Now, on a tiny hybrid RecurrentGemma (recurrent and attention layers, random biases and norm weights):
relevance is conserved, in float32 runs and to float64 rounding; the relevance of a block's input is gradient x input
of an independent float64 re-implementation whose factors are plain constants; the forward is unchanged bit for bit;
a block or RG-LRU computing otherwise, or a recurrence starting from a carried state, is refused naming it."""

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
    check_probed_widened_and_left_as_it_was,
    check_rules_leave_the_forward_unchanged,
    check_strategies_agree,
    lrp_data,
    offset_biases_and_norms,
)

_CONFIG = dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=1, head_dim=8, max_position_embeddings=64, bos_token_id=0, eos_token_id=1,
               pad_token_id=2, block_types=["recurrent", "attention"], attention_window_size=16, lru_width=32)


def _model(dtype=torch.float32) -> torch.nn.Module:
    """Recurrent blocks at layers 0 and 2, a local attention block at 1."""
    config = tf.RecurrentGemmaConfig(**_CONFIG)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tf.RecurrentGemmaForCausalLM(config).eval()
    offset_biases_and_norms(model)  # so that a rule ignoring them shows
    return model.to(dtype)


def test_lrp_conserves_through_the_recurrent_and_the_attention_blocks():
    model = _model()
    check_rules(model)
    assert_conserved(model, 1e-6)


def test_a_float64_model_conserves_to_float64_rounding():
    model = _model(torch.float64)
    assert_conserved(model, 5e-14)


def test_relevance_crossing_every_layer_from_the_first_is_conserved():
    """Measured at the first layer's input (a mixer layer, below the first attention layer, where compute_lrp's record
    starts), bias-free, float64 (the model's own float32 casts not widened here: to 1e-6): every mixer is crossed."""
    model = _model(torch.float64)
    check_lrp_conserves(model, model.model.layers[0], rtol=1e-6, atol=1e-8)


def test_a_half_precision_model_is_probed_widened_and_left_as_it_was():
    """A bfloat16 model: the probe runs its mixers widened to float32 (in place, put back exactly), LRP conserves. Before, the
    probe compared the half-precision forward with the formula and refused a released (bfloat16) model."""
    model = _model(torch.bfloat16)
    check_probed_widened_and_left_as_it_was(model)


@pytest.mark.parametrize("strategy", ["loop", "jacobian"])
def test_every_strategy_gives_the_same_shares(strategy):
    model = _model(torch.float64)
    check_strategies_agree(model, *lrp_data(model, n=2), strategy)


def test_the_rule_leaves_the_forward_unchanged():
    check_rules_leave_the_forward_unchanged(_model())


def _reference(block, h: torch.Tensor) -> torch.Tensor:
    """The recurrent block in float64 with every factor it computes from its input to weigh its values (the GeLU
    branch y, the RG-LRU's a_t, i_t and sqrt(1 - a_t^2)) computed once, under no_grad, as plain constants; the
    rest (linear_x, the causal depthwise convolution written out tap by tap, the scan, linear_out) differentiable."""
    lru = block.rg_lru
    seq, width = h.shape[1], lru.recurrent_param.shape[0]
    heads = lru.input_gate_weight.shape[0]
    x = h @ block.linear_x.weight.T + block.linear_x.bias
    taps, bias = block.conv_1d.weight[:, 0, :], block.conv_1d.bias  # tap k reads position t - (kernel - 1 - k)
    kernel = taps.shape[1]
    x = sum(F.pad(x, (0, 0, kernel - 1 - k, 0))[:, :seq] * taps[:, k] for k in range(kernel)) + bias
    with torch.no_grad():
        y = F.gelu(h @ block.linear_y.weight.T + block.linear_y.bias, approximate="tanh")
        blocks = x.reshape(*x.shape[:2], heads, width // heads)
        i = torch.sigmoid(torch.einsum("bshi,hij->bshj", blocks, lru.input_gate_weight)
                          + lru.input_gate_bias).reshape(x.shape)
        r = torch.sigmoid(torch.einsum("bshi,hij->bshj", blocks, lru.recurrent_gate_weight)
                          + lru.recurrent_gate_bias).reshape(x.shape)
        a = torch.exp(-8 * r * F.softplus(lru.recurrent_param))
        a[:, 0] = 0  # the reset at position 0
        m = torch.sqrt(1 - a ** 2)
    states, state = [], torch.zeros_like(x[:, 0])
    for t in range(seq):
        state = a[:, t] * state + m[:, t] * i[:, t] * x[:, t]
        states.append(state)
    return (torch.stack(states, 1) * y) @ block.linear_out.weight.T + block.linear_out.bias


def test_the_relevance_is_gradient_x_input_of_the_reference_with_the_gates_constant():
    """A recurrent block's input relevance under lrp_rules equals h * d(w . reference)/dh to 1e-10: the rule is the
    stated rule (the gates and decays constants, the rest linear), not merely one that conserves."""
    model = _model(torch.float64)
    block = model.model.layers[2].temporal_block
    kept: dict[str, torch.Tensor] = {}
    handle = block.register_forward_pre_hook(lambda module, args: kept.update(h=args[0]))
    with torch.no_grad():  # the block's input on a sentence: its pre-norm's output
        model(input_ids=torch.tensor([[5, 17, 33, 8, 61, 4, 1]]))
    handle.remove()
    h = kept["h"].detach().requires_grad_(True)
    positions = torch.arange(h.shape[1])[None]
    with torch.enable_grad(), lrp_rules(model):
        output, _ = block(h, position_ids=positions, attention_mask=None, use_cache=False)
        w = torch.randn(output.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        grad, = torch.autograd.grad((w * output).sum(), h)
    reference = _reference(block, h)
    torch.testing.assert_close(output.detach(), reference.detach(), rtol=1e-6, atol=1e-6)  # its scan in float32
    expected, = torch.autograd.grad((w * reference).sum(), h)
    torch.testing.assert_close(h.detach() * grad, h.detach() * expected, rtol=0, atol=1e-10)


def test_an_rg_lru_that_computes_otherwise_is_refused_before_any_work(monkeypatch):
    """Here without the normaliser sqrt(1 - a_t^2): the probe finds it."""
    from transformers.models.recurrent_gemma import modeling_recurrent_gemma as rg

    plain = rg.SqrtBoundDerivative.apply
    model = _model()
    monkeypatch.setattr(rg.SqrtBoundDerivative, "apply", lambda x: plain(x) * 0 + 1)
    # the block holding it is the first module checked: its probe runs the RG-LRU
    check_lrp_refused_before_any_work(
        model, r"no rule for RecurrentGemmaRecurrentBlock \(model\.layers\.0\.temporal_block\): RG-LRU .*on a "
               r"probe its forward is not linear_out\(rg_lru")
    from headlab.importance.mixer_rules.rg_lru import RULE

    lru = model.model.layers[0].temporal_block.rg_lru
    assert "on a probe its forward is not the RG-LRU" in RULE.problem(lru, "model.layers.0.temporal_block.rg_lru")


def test_a_block_that_computes_otherwise_is_refused_before_any_work(monkeypatch):
    """Here the branches added, not multiplied: the probe of the block finds it."""
    from transformers.models.recurrent_gemma import modeling_recurrent_gemma as rg

    forward = rg.RecurrentGemmaRecurrentBlock.forward

    def added(self, input_states, position_ids, attention_mask, use_cache=True, **kwargs):
        out, _ = forward(self, input_states, position_ids, attention_mask, use_cache, **kwargs)
        return out + self.linear_out(self.act_fn(self.linear_y(input_states))), None

    model = _model()
    monkeypatch.setattr(rg.RecurrentGemmaRecurrentBlock, "forward", added)
    check_lrp_refused_before_any_work(
        model, r"no rule for RecurrentGemmaRecurrentBlock \(model\.layers\.0\.temporal_block\): RG-LRU .*on a "
               r"probe its forward is not linear_out\(rg_lru")


def test_a_recurrence_from_a_carried_state_is_refused():
    """A call that continues a cached recurrence (no reset at its first position) would leave the carried state's
    share of the output to no input."""
    model = _model(torch.float64)
    lru = model.model.layers[0].temporal_block.rg_lru
    x = torch.randn(1, 3, 32, dtype=torch.float64, requires_grad=True)
    with torch.enable_grad(), lrp_rules(model):
        lru.recurrent_states = torch.ones(1, 32, dtype=torch.float64)
        with pytest.raises(HeadlabError, match=r"RecurrentGemmaRglru starts its recurrence from a state carried"):
            lru(x, torch.arange(4, 7)[None])
