"""LRP through MiniMax's lightning attention (``MiniMaxLightningAttention``: session 35, branch lrpconv35;
headlab.importance.mixer_rules.lightning): linear attention with a per-head decay, ``o_t = sum_{s <= t}
exp(-lambda (t - s)) (q_t . k_s) v_s``, computed block by block. ``q . k`` and the decay held constant (the weights
of the weighted sum of the values, as softmax attention's are), the output gate held constant, the norm's and the
activation's rules. Before: refused before any work ("a token mixer named attention that is none of the attention
blocks"). Now, on a tiny hybrid MiniMax (lightning layers beside a softmax attention layer, blocks of 3 positions so
that the state across blocks is used): relevance is conserved, in float32 runs and to float64 rounding; the relevance
of a lightning layer's input is gradient x input of an independent float64 re-implementation whose ``q . k``, decay,
gate and norm scale are plain constants; the forward is unchanged bit for bit; a layer computing otherwise, or
continuing from a cached state, is refused naming it."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from torch.nn import functional as F

from headlab import HeadlabError
from headlab.importance import lrp_rules
from headlab.importance.lrp import _KeptWide
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

_CONFIG = dict(vocab_size=99, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, max_position_embeddings=64, bos_token_id=0, eos_token_id=1,
               pad_token_id=2, num_local_experts=2, num_experts_per_tok=1, block_size=3,
               layer_types=["linear_attention", "full_attention", "linear_attention"])


def _model(dtype=torch.float32) -> torch.nn.Module:
    config = tf.MiniMaxConfig(**_CONFIG)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tf.MiniMaxForCausalLM(config).eval()
    offset_biases_and_norms(model, biases=False)  # so that a rule ignoring them shows
    return model.to(dtype)


def test_lrp_conserves_through_the_lightning_and_the_softmax_attention():
    model = _model()
    check_rules(model)
    assert_conserved(model, 1e-6, longest=10)


def test_a_float64_model_conserves_to_float64_rounding():
    model = _model(torch.float64)
    assert_conserved(model, 5e-14, longest=10)


def test_relevance_crossing_every_layer_from_the_first_is_conserved():
    """Measured at the first layer's input (a mixer layer, below the first attention layer, where compute_lrp's record
    starts), bias-free, float64 (the model's own float32 casts not widened here: to 1e-6): every mixer is crossed."""
    model = _model(torch.float64)
    check_lrp_conserves(model, model.model.layers[0], rtol=1e-6, atol=1e-8)


def test_a_half_precision_model_is_probed_widened_and_left_as_it_was():
    """A bfloat16 model: the probe runs its mixers widened to float32 (in place, put back exactly), LRP conserves. Before, the
    probe compared the half-precision forward (its decays stored rounded) with the formula and refused a released
    (bfloat16) model."""
    model = _model(torch.bfloat16)
    check_probed_widened_and_left_as_it_was(model)


@pytest.mark.parametrize("strategy", ["loop", "jacobian"])
def test_every_strategy_gives_the_same_shares(strategy):
    model = _model(torch.float64)
    check_strategies_agree(model, *lrp_data(model, n=2), strategy)


def test_the_rule_leaves_the_forward_unchanged():
    check_rules_leave_the_forward_unchanged(_model())


def _reference(layer, h: torch.Tensor) -> torch.Tensor:
    """The lightning layer in float64, whole (no blocks), the decayed q_t . k_s, the output gate, the RMS norm's
    scale and SiLU's ratio silu(z) / z on the values computed once as plain constants; the rest differentiable."""
    heads, d = layer.num_attention_heads, layer.head_dim
    batch, seq, _ = h.shape
    z = (h @ layer.qkv_proj.weight.T).reshape(batch, seq, heads, 3 * d)
    lam = layer.slope_rate.reshape(heads)
    with torch.no_grad():
        q, k = F.silu(z[..., :d]), F.silu(z[..., d:2 * d])
        lag = torch.arange(seq)[:, None] - torch.arange(seq)[None, :]
        decay = torch.exp(-lam[:, None, None] * lag.clamp(min=0)) * (lag >= 0)
        weights = torch.einsum("bthd,bshd->bhts", q, k) * decay  # [batch, head, t, s]
        ratio = F.silu(z[..., 2 * d:]) / z[..., 2 * d:]
        gate = torch.sigmoid(h @ layer.output_gate.weight.T)
    v = z[..., 2 * d:] * ratio
    o = torch.einsum("bhts,bshe->bthe", weights, v).reshape(batch, seq, heads * d)
    with torch.no_grad():
        scale = layer.norm.weight * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + layer.norm.variance_epsilon)
    return (gate * (o * scale)) @ layer.out_proj.weight.T


def test_the_relevance_is_gradient_x_input_of_the_reference_with_the_weights_constant():
    """A lightning layer's input relevance under lrp_rules equals h * d(w . reference)/dh to 1e-10, over three blocks:
    the rule is the stated rule, not merely one that conserves."""
    model = _model(torch.float64)
    layer = model.model.layers[2].self_attn
    # its decay buffers recomputed in float64 from its rates (built in float32, then widened: exp(-a) exp(-b) would
    # be exp(-(a + b)) to float32 rounding only), so that the reference's exp(-lambda (t - s)) is the forward's
    layer.query_decay, layer.key_decay, layer.diagonal_decay = layer.decay_factors(layer.slope_rate)
    kept: dict[str, torch.Tensor] = {}
    handle = layer.register_forward_pre_hook(lambda module, args, kwargs: kept.update(h=kwargs["hidden_states"]),
                                             with_kwargs=True)
    with torch.enable_grad(), lrp_rules(model):  # (its experts eager there: the grouped matmul takes no float64)
        with torch.no_grad():  # the layer's input on a sentence of 8 positions: its input norm's output
            model(input_ids=torch.tensor([[5, 17, 33, 8, 61, 4, 9, 1]]))
        handle.remove()
        h = kept["h"].detach().requires_grad_(True)
        with _KeptWide(torch.float64):  # as compute_lrp runs it: the norm's float32 cast widened
            output, _ = layer(h, position_embeddings=None, attention_mask=None)
        w = torch.randn(output.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        grad, = torch.autograd.grad((w * output).sum(), h)
    reference = _reference(layer, h)
    torch.testing.assert_close(output.detach(), reference.detach(), rtol=1e-12, atol=1e-12)
    expected, = torch.autograd.grad((w * reference).sum(), h)
    torch.testing.assert_close(h.detach() * grad, h.detach() * expected, rtol=0, atol=1e-10)


def test_a_lightning_attention_that_computes_otherwise_is_refused_before_any_work(monkeypatch):
    """Here without the decay across blocks (each block's state started afresh): the probe, longer than a block, finds
    it."""
    from transformers.models.minimax import modeling_minimax as mm

    model = _model()
    forward = mm.MiniMaxLightningAttention.forward

    def blockwise_only(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
        parts = [forward(self, hidden_states[:, i:i + self.block_size], position_embeddings, None)[0]
                 for i in range(0, hidden_states.shape[1], self.block_size)]
        return torch.cat(parts, dim=1), None

    monkeypatch.setattr(mm.MiniMaxLightningAttention, "forward", blockwise_only)
    check_lrp_refused_before_any_work(
        model, r"no rule for MiniMaxLightningAttention \(model\.layers\.0\.self_attn\): "
               r"lightning attention .*on a probe its forward is not", longest=10)


def test_a_lightning_attention_without_a_norm_rule_is_refused():
    model = _model()
    model.model.layers[0].self_attn.norm = torch.nn.GroupNorm(4, 32)
    with pytest.raises(HeadlabError, match=r"no rule for MiniMaxLightningAttention \(model\.layers\.0\.self_attn\): "
                                           r".*its norm \(GroupNorm\) has no LRP rule"):
        check_rules(model)


def test_a_call_continuing_a_cached_state_is_refused():
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    model = _model(torch.float64)
    layer = model.model.layers[0].self_attn
    cache = MiniMaxCache()
    cache.set_linear_cache(0, torch.ones(1, 4, 8, 8, dtype=torch.float64))
    h = torch.randn(1, 1, 32, dtype=torch.float64, requires_grad=True)
    with torch.enable_grad(), lrp_rules(model):
        with pytest.raises(HeadlabError, match=r"MiniMaxLightningAttention continues from a state its cache carries"):
            layer(h, position_embeddings=None, attention_mask=None, cache=cache)
