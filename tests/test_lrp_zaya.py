"""LRP on ZAYA (``ZayaForCausalLM``): its compressed convolutional attention's query and key held constant, the values
``[v_proj_current(x_t) | v_proj_delayed(x_{t-1})]`` a linear path (headlab.importance.cca_rule), the residual
scaling's and the input's biases counted. Before session 36 LRP was refused on ZAYA ("no rule for the attention of
model.layers.0.self_attn (discovered:zaya): its queries, keys and values come from ZAYA's compressed convolutional
attention ..."), so every test here but the refusals failed then."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from headlab import HeadlabError, prune_heads
from headlab.capture import eager_attention
from headlab.importance import compute_lrp
from headlab.importance.lrp import _KeptWide
from headlab.importance.rules import check_rules, lrp_rules
from support.family_matrix import check_lrp_conserves, perturbed_model, tiny_inputs
from support.lrp_families import (
    check_lrp_refused_before_any_work,
    check_probed_widened_and_left_as_it_was,
    check_strategies_agree,
    lrp_data,
)
from support.models import VOCAB


def zaya(attention_bias: bool = True, dtype: torch.dtype = torch.float32, **config_values) -> torch.nn.Module:
    """As experiments/family_sweep.py builds it (hidden 32, 2 layers, 4 query heads over 2 key/value heads of 8), its
    biases, norm weights and residual scales moved off their initial zeros and ones; ``config_values`` added."""
    config = tf.ZayaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                           max_position_embeddings=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                           num_experts_per_tok=1, moe_intermediate_size=40, router_hidden_size=16,
                           attention_bias=attention_bias, bos_token_id=0, eos_token_id=1, pad_token_id=2,
                           **config_values)
    model = perturbed_model(tf.ZayaForCausalLM, config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("scale"):
                parameter.add_(torch.randn_like(parameter) * 0.1)
    if dtype == torch.float64:  # torch's grouped matmul of the experts takes no float64: transformers' loop
        model.config._experts_implementation = "eager"
    return model.to(dtype)


SLIDING = dict(layer_types=["hybrid_sliding", "hybrid"], sliding_window=3)


@pytest.mark.parametrize("attention_bias, config_values", [(True, {}), (False, {}), (True, SLIDING)],
                         ids=["biases", "no-biases", "sliding-window-layer"])
def test_the_pipeline_conserves_relevance_to_float64_rounding(attention_bias, config_values):
    """compute_lrp's record: embeddings plus biases (v_proj_delayed's at t = 0, the residual scaling's and the input's
    among them) over the explained logits is 1 to float64 rounding (ZAYA's LRP runs in float64: routed experts), a
    sliding-window layer (its window shorter than the sentences) included."""
    model = zaya(attention_bias, **config_values)
    record = compute_lrp(model, *lrp_data(model), bootstrap=0).signature["conservation"]
    assert record["n_sentences"] == 4 and record["n_outside"] == 0
    assert abs(record["with_biases"]["min"] - 1) < 5e-14 and abs(record["with_biases"]["max"] - 1) < 5e-14


def test_relevance_is_conserved_from_the_first_layer():
    """On a bias-free copy, what reaches the first layer's input sums to the logit: float64 to 1e-12 (the model's own
    float32 casts widened as compute_lrp widens them), float32 to 1e-6."""
    model = zaya(dtype=torch.float64)
    with _KeptWide(torch.float64):
        check_lrp_conserves(model, model.model.layers[0], rtol=1e-12, atol=1e-12)
    model = zaya()
    check_lrp_conserves(model, model.model.layers[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_forward_is_unchanged_bit_for_bit(dtype):
    model, inputs = zaya(dtype=dtype), tiny_inputs()
    with torch.no_grad(), eager_attention(model):
        before = model(**inputs).logits
    with torch.enable_grad(), eager_attention(model), lrp_rules(model):
        during = model(**inputs).logits
    assert torch.equal(before, during.detach())


def _reference_attention(attention, x, mask, probs):
    """One ZAYA attention's output in float64, written apart from transformers' code: the attention weights
    ``probs`` a plain constant, the values ``[x_t Wc^T + bc | x_{t-1} Wd^T + bd]`` per key/value head (``bd`` at
    t = 0), repeated over each group's query heads, then ``o_proj``."""
    projection = attention.qkv_proj
    wc, wd, wo = projection.v_proj_current.weight, projection.v_proj_delayed.weight, attention.o_proj.weight
    bc, bd, bo = projection.v_proj_current.bias, projection.v_proj_delayed.bias, attention.o_proj.bias
    x = x * mask[:, :, None]
    current = x @ wc.T + bc
    delayed = x @ wd.T + bd
    delayed = torch.cat([bd.expand(x.shape[0], 1, -1), delayed[:, :-1]], dim=1)
    batch, length = x.shape[:2]
    values = torch.cat([current, delayed], dim=-1).view(batch, length, 2, 8).transpose(1, 2)
    values = values.repeat_interleave(2, dim=1)  # 4 query heads over 2 key/value heads
    heads = (probs @ values).transpose(1, 2).reshape(batch, length, 32)
    return heads @ wo.T + (0 if bo is None else bo)


def test_the_value_path_relevance_equals_an_independent_reference():
    """The relevance of the first attention's input (x * grad of a random projection of its output) under lrp_rules
    equals x * grad of :func:`_reference_attention`, whose attention weights are constants: to 1e-10 (with biases and
    a padded row)."""
    model, inputs = zaya(dtype=torch.float64), tiny_inputs()
    attention = model.model.layers[0].self_attn
    kept: dict = {}

    def keep(module, args, kwargs, output):
        kept["x"], kept["out"], kept["probs"] = kwargs["hidden_states"], output[0], output[1]

    handle = attention.register_forward_hook(keep, with_kwargs=True)
    try:
        with torch.enable_grad(), eager_attention(model), lrp_rules(model):
            model(**inputs)
            direction = torch.randn(kept["out"].shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
            grad, = torch.autograd.grad((kept["out"] * direction).sum(), kept["x"])
    finally:
        handle.remove()
    x = kept["x"].detach().clone().requires_grad_(True)
    mask = inputs["attention_mask"].to(torch.float64)
    reference = _reference_attention(attention, x, mask, kept["probs"].detach())
    torch.testing.assert_close(reference, kept["out"].detach(), rtol=1e-12, atol=1e-12)
    reference_grad, = torch.autograd.grad((reference * direction).sum(), x)
    assert (x.detach() * reference_grad).abs().max() > 1e-3  # relevance reaches it
    torch.testing.assert_close(kept["x"].detach() * grad, x.detach() * reference_grad, rtol=0, atol=1e-10)


def test_pruning_stays_refused_naming_the_grouped_keys():
    """Removing a query head changes its group's keys (each key residual is a mean over the group's query heads),
    which masking it does not: physical pruning is refused before anything changes, naming it; LRP's check passes."""
    model, inputs = zaya(), tiny_inputs()
    with torch.no_grad():
        before = model(**inputs).logits
    with pytest.raises(HeadlabError, match=r"physical pruning is refused: its queries, keys and values come from "
                                           r"ZAYA's compressed convolutional attention \(qkv_proj, ZayaCCAProjection\)"
                                           r".*removing a query head changes the keys of its group"):
        prune_heads(model, {("dec_self", 0): [1]})
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, before)
    check_rules(model)


def test_a_zaya_attention_from_elsewhere_is_refused(monkeypatch):
    model = zaya()
    monkeypatch.setattr(type(model.model.layers[0].self_attn), "__module__", "remote_code.modeling_zaya")
    check_lrp_refused_before_any_work(model, r"LRP: no rule for the attention of model\.layers\.0\.self_attn "
                                             r"\(discovered:zaya\): ZAYA's compressed convolutional attention: its "
                                             r"class comes from remote_code\.modeling_zaya")


def test_values_from_the_current_token_only_are_refused(monkeypatch):
    """A projection whose delayed half reads x_t, not x_{t-1}: not the value path the rule was written for."""
    from transformers.models.zaya import modeling_zaya

    model = zaya()
    forward = modeling_zaya.ZayaCCAProjection.forward

    def undelayed(self, hidden_states, cache=None, conv_mask=None):
        query, key, _ = forward(self, hidden_states, cache, conv_mask)
        value = torch.cat([self.v_proj_current(hidden_states), self.v_proj_delayed(hidden_states)], dim=-1)
        return query, key, value.view(*hidden_states.shape[:-1], -1, self.head_dim)

    monkeypatch.setattr(modeling_zaya.ZayaCCAProjection, "forward", undelayed)
    check_lrp_refused_before_any_work(model, r"ZAYA's compressed convolutional attention: on a probe its qkv_proj's "
                                             r"values are not \[v_proj_current\(x_t\) \| v_proj_delayed\(x_\{t-1\}\)\]")


def test_an_attention_that_reads_its_input_besides_the_values_is_refused(monkeypatch):
    """An output gated by the layer's input (a gate the rule does not hold constant) is refused by the probe."""
    from transformers.models.zaya import modeling_zaya

    model = zaya()
    forward = modeling_zaya.ZayaAttention.forward

    def gated(self, hidden_states, *args, **kwargs):
        output, weights = forward(self, hidden_states, *args, **kwargs)
        return output * torch.sigmoid(hidden_states), weights

    monkeypatch.setattr(modeling_zaya.ZayaAttention, "forward", gated)
    check_lrp_refused_before_any_work(model, r"ZAYA's compressed convolutional attention: on a probe, its query and "
                                             r"key held fixed, its output depends on its input other than through "
                                             r"qkv_proj's values")


def test_a_projection_laid_out_otherwise_is_refused():
    """v_proj_delayed not a linear map (a layout the rule was not written for)."""
    model = zaya()
    projection = model.model.layers[1].self_attn.qkv_proj
    projection.v_proj_delayed = torch.nn.Sequential(projection.v_proj_delayed)
    check_lrp_refused_before_any_work(model, r"model\.layers\.1\.self_attn \(discovered:zaya\): ZAYA's compressed "
                                             r"convolutional attention: it has no qkv_proj with q_proj, k_proj, "
                                             r"v_proj_current and v_proj_delayed")


def test_a_bfloat16_model_passes_the_probes_and_conserves():
    """The probes compare in float32 (a copy of the layer), not in the model's own bfloat16 rounding, which would set
    the values apart from the rule's value path; compute_lrp widens the model and conserves to float64 rounding."""
    model = zaya().to(torch.bfloat16)
    check_probed_widened_and_left_as_it_was(model)  # check_rules leaves it as it was, bit for bit
    record = compute_lrp(model, *lrp_data(model), bootstrap=0).signature["conservation"]
    assert abs(record["with_biases"]["min"] - 1) < 5e-14 and abs(record["with_biases"]["max"] - 1) < 5e-14


@pytest.mark.parametrize("strategy", ["loop", "jacobian"])
def test_every_strategy_gives_the_same_relevance(strategy):
    model = zaya(dtype=torch.float64)
    check_strategies_agree(model, *lrp_data(model), strategy)


def test_the_probe_runs_eager_attention_whatever_the_model_was_loaded_with():
    """A model loaded for flash attention (which takes no float32, and no CPU) is probed with eager attention, as LRP
    runs it: not refused because the probe's forward failed; its implementation is put back."""
    model = zaya()
    model.config._attn_implementation = "flash_attention_2"
    check_rules(model)
    assert model.config._attn_implementation == "flash_attention_2"
