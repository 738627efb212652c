"""LRP through LFM2's gated short convolutions (``Lfm2ShortConv``, ``Lfm2MoeShortConv``, ``Lfm3ShortConv``: session 35,
branch lrpconv35; headlab.importance.mixer_rules.short_conv). ``out_proj(C * conv(B * x))`` with ``[B | C | x] =
in_proj(h)``: ``B`` and ``C`` held constant (gates, CP-LRP), so the mixer is linear in ``x``. Before: refused before
any work ("no rule for the gated short convolution ..."). Now, on tiny hybrid models (convolution layers and attention
layers in one model, random biases and norm weights): relevance is conserved, in float32 runs and to float64
rounding; the relevance of a convolution layer's input is gradient x input of an independent float64 re-implementation
whose ``B`` and ``C`` are plain constants; the forward is unchanged bit for bit; a convolution laid out or computing
otherwise, or with a bias, is refused before any work, naming the module and why."""

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

_BASE = dict(vocab_size=99, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=1, pad_token_id=2)
# convolution layers at 0 and 2, attention at 1 (LFM3: a sliding and a full attention layer after its convolution)
HYBRIDS = {
    "lfm2": lambda: (tf.Lfm2ForCausalLM, tf.Lfm2Config(**_BASE, layer_types=["conv", "full_attention", "conv"])),
    # every layer dense: LFM2-MoE's experts (Lfm2MoeExperts) are tested in test_lrp_lfm2_moe_experts.py
    "lfm2_moe": lambda: (tf.Lfm2MoeForCausalLM, tf.Lfm2MoeConfig(
        **_BASE, layer_types=["conv", "full_attention", "conv"], num_dense_layers=3, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16)),
    "lfm3": lambda: (tf.Lfm3ForCausalLM, tf.Lfm3Config(
        **_BASE, layer_types=["conv", "sliding_attention", "full_attention"], head_dim=8, sliding_window=4)),
}


def _model(family: str, dtype=torch.float32, **values) -> torch.nn.Module:
    cls, config = HYBRIDS[family]()
    for name, value in values.items():
        setattr(config, name, value)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(config).eval()
    offset_biases_and_norms(model)  # so that a rule ignoring them shows
    return model.to(dtype)


@pytest.mark.parametrize("family", HYBRIDS)
def test_lrp_conserves_through_the_convolutions_and_the_attention(family):
    """Before: refused. The pipeline's record: the embeddings plus the biases' shares are the explained logit."""
    model = _model(family)
    check_rules(model)
    assert_conserved(model, 1e-6)


@pytest.mark.parametrize("family", HYBRIDS)
def test_a_float64_model_conserves_to_float64_rounding(family):
    model = _model(family, torch.float64)
    assert_conserved(model, 5e-14)


@pytest.mark.parametrize("family", HYBRIDS)
def test_relevance_crossing_every_layer_from_the_first_is_conserved(family):
    """Measured at the first layer's input (a convolution layer, below the first attention layer, where compute_lrp's
    record starts), bias-free, float64: every mixer is crossed."""
    model = _model(family, torch.float64)
    check_lrp_conserves(model, model.model.layers[0], rtol=1e-10, atol=1e-10)


def test_a_half_precision_model_is_probed_widened_and_left_as_it_was():
    """A bfloat16 model: the probe runs its mixers widened to float32 (in place, put back exactly), LRP conserves."""
    model = _model("lfm3", torch.bfloat16)
    check_probed_widened_and_left_as_it_was(model)


@pytest.mark.parametrize("strategy", ["loop", "jacobian"])
def test_every_strategy_gives_the_same_shares(strategy):
    model = _model("lfm2", torch.float64)
    check_strategies_agree(model, *lrp_data(model, n=2), strategy)


@pytest.mark.parametrize("family", HYBRIDS)
def test_the_rule_leaves_the_forward_unchanged(family):
    check_rules_leave_the_forward_unchanged(_model(family))


def _reference(h: torch.Tensor, conv_layer) -> torch.Tensor:
    """The convolution layer re-implemented in float64, ``B`` and ``C`` computed once as plain constants (no
    graph): ``out_proj(C * conv(B * x))``, the convolution a causal depthwise sum written out tap by tap."""
    weight_in = conv_layer.in_proj.weight.detach()
    width = weight_in.shape[0] // 3
    with torch.no_grad():
        b, c = (h @ weight_in[:width].T), (h @ weight_in[width:2 * width].T)
    x = h @ weight_in[2 * width:].T
    u = b * x  # [batch, seq, ch]
    taps = conv_layer.conv.weight.detach()[:, 0, :]  # [ch, kernel]: tap k reads position t - (kernel - 1 - k)
    kernel = taps.shape[1]
    mixed = sum(F.pad(u, (0, 0, kernel - 1 - k, 0))[:, :u.shape[1]] * taps[:, k] for k in range(kernel))
    return (c * mixed) @ conv_layer.out_proj.weight.detach().T


def test_the_relevance_is_gradient_x_input_of_the_reference_with_b_and_c_constant():
    """The convolution layer's input relevance under lrp_rules equals h * d(w . reference)/dh to 1e-10: the rule
    is the stated rule (B and C constants, the rest linear), not merely one that conserves."""
    model = _model("lfm2", torch.float64, conv_bias=False)
    layer = model.model.layers[0].conv
    kept: dict[str, torch.Tensor] = {}
    handle = layer.register_forward_pre_hook(lambda module, args, kwargs: kept.update(h=kwargs["hidden_states"]),
                                             with_kwargs=True)
    with torch.no_grad():  # the layer's input on a sentence: its operator norm's output
        model(input_ids=torch.tensor([[5, 17, 33, 8, 61, 4, 1]]))
    handle.remove()
    h = kept["h"].detach().requires_grad_(True)
    with torch.enable_grad(), lrp_rules(model):
        output = layer(h)
        w = torch.randn(output.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        grad, = torch.autograd.grad((w * output).sum(), h)
    reference = _reference(h, layer)
    torch.testing.assert_close(output.detach(), reference.detach(), rtol=1e-12, atol=1e-12)
    expected, = torch.autograd.grad((w * reference).sum(), h)
    torch.testing.assert_close(h.detach() * grad, h.detach() * expected, rtol=0, atol=1e-10)
    # conservation inside the layer (no bias): the input relevance sums to the output's
    assert abs(float((h.detach() * grad).sum() - (w * output.detach()).sum())) < 1e-10


def test_a_convolution_with_a_bias_is_refused_before_any_work():
    """conv_bias: added inside causal_conv1d_fn (the module conv never called), where its relevance cannot be counted."""
    check_lrp_refused_before_any_work(
        _model("lfm2", conv_bias=True),
        r"no rule for Lfm2ShortConv \(model\.layers\.0\.conv\): gated short convolution .*its convolution has a "
        r"bias \(conv_bias\)")


def test_a_convolution_that_computes_otherwise_is_refused_before_any_work(monkeypatch):
    """A forward that is not out_proj(C * conv(B * x)) (here: C * conv(x), no B) is found by the probe."""
    from transformers.models.lfm2 import modeling_lfm2

    def without_b(self, hidden_states, cache=None, attention_mask=None, **kwargs):
        b, c, x = self.in_proj(hidden_states).transpose(-1, -2).chunk(3, dim=-2)
        mixed = modeling_lfm2.causal_conv1d_fn(x, self.conv.weight.squeeze(1), self.conv.bias)
        return self.out_proj((c * mixed).transpose(-1, -2).contiguous())

    model = _model("lfm2")
    monkeypatch.setattr(modeling_lfm2.Lfm2ShortConv, "forward", without_b)
    check_lrp_refused_before_any_work(
        model, r"no rule for Lfm2ShortConv \(model\.layers\.0\.conv\): gated short convolution .*on a probe its "
               r"forward is not out_proj\(C \* conv\(B \* x\)\)")


def test_a_convolution_laid_out_otherwise_is_refused_before_any_work():
    """in_proj not hidden -> [B | C | x] (here: 4 x hidden)."""
    model = _model("lfm2")
    layer = model.model.layers[2].conv
    layer.in_proj = torch.nn.Linear(32, 128, bias=False)
    with pytest.raises(HeadlabError, match=r"no rule for Lfm2ShortConv \(model\.layers\.2\.conv\): .*its in_proj is "
                                           r"not a map to \[B \| C \| x\]"):
        check_rules(model)
