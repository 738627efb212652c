"""Step-3.7 (``Step3p7ForConditionalGeneration``, model type ``step3p7``; its text model's ``step3p5``): GQA attention
with query/key norms and a per-head output gate, ``attn_output * sigmoid(g_proj(x))`` per head (``gate_per_head``:
config ``gating`` True, its default), clamped SwiGLU MLPs and experts (``clamp(act(gate), max=l) * clamp(up, -l, l)``,
``swiglu_limits`` / ``swiglu_limits_shared``). Before (session 37), discovery refused it as an output gate of a type
headlab had not checked; now ``adapters.families`` lists it (OUTPUT_GATES, ``step3p7_gate``: head h's gate is row h of
``g_proj``) and LRP has a rule for its clamps (tests/test_lrp_clamped_mlps.py).

Checked on a tiny float64 model, the vision tower idle: capture equals transformers' eager output_attentions, masking
equals zeroing a head's value rows by hand (its gate makes no difference to a zero), gates at one change nothing,
pruning equals masking on a padded batch with a layer left with no head (its gate rows sliced), reloaded by
load_pruned and by plain transformers with remote code, and LRP conserves relevance through clamps that act.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from headlab import attention_blocks, capture_attention, load_pruned, mask_heads, prune_heads, save_pruned
from support.family_matrix import check_gates_at_one_change_nothing, logits, tiny_inputs
from support.lrp_families import assert_conserved

D = 8
_TEXT = dict(vocab_size=99, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=D, max_position_embeddings=64, sliding_window=4, pad_token_id=2,
             bos_token_id=0, eos_token_id=1, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
             share_expert_dim=16, mlp_layer_types=["dense", "sparse"],
             layer_types=["sliding_attention", "full_attention"])
_VISION = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=4, image_size=16,
               patch_size=8)


def _model(limit: float = 4.0, seed: int = 0) -> torch.nn.Module:
    if not hasattr(tf, "Step3p7ForConditionalGeneration"):
        pytest.skip("this transformers has no step3p7")
    text = dict(_TEXT, swiglu_limits=[limit] * 2, swiglu_limits_shared=[limit] * 2)
    config = tf.Step3p7Config(text_config=text, vision_config=_VISION, image_token_id=98)
    config.text_config._experts_implementation = "eager"  # grouped matmuls take no float64
    torch.manual_seed(seed)
    model = tf.Step3p7ForConditionalGeneration(config).eval()
    with torch.no_grad():  # biases and norms off their initial values, the gates spread, the experts initialised
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                parameter.add_(torch.randn_like(parameter) * 0.1)
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                parameter.normal_(0, 0.2)
            if name.endswith("self_attn.g_proj.weight"):
                parameter.mul_(8)
    return model.double()


def _attention(model, layer: int):
    return model.model.language_model.layers[layer].self_attn


def test_blocks_have_their_gate_rows_the_vision_tower_idle():
    blocks = attention_blocks(_model())
    assert [(b.kind, b.layer, b.n_heads, b.n_kv_heads, b.d_head, b.idle) for b in blocks] == [
        ("enc_self", 0, 4, 4, 8, True), ("dec_self", 0, 4, 2, D, False), ("dec_self", 1, 4, 2, D, False)]
    assert ("g_proj", (1,)) in blocks[1].family.head_rows


def test_capture_equals_output_attentions():
    inputs = tiny_inputs()
    model = _model()
    with torch.no_grad():
        reference = _model()  # eager, for transformers' output_attentions
        reference.config.text_config._attn_implementation = "eager"
        expected = reference(**inputs, output_attentions=True).attentions
    with capture_attention(model) as record:
        logits(model, inputs)
    assert sorted(record) == [("dec_self", 0), ("dec_self", 1)]
    for (_, layer), probs in record.items():
        torch.testing.assert_close(probs, expected[layer], atol=1e-12, rtol=0)


def test_masking_equals_zeroed_values_and_gates_at_one_change_nothing():
    inputs = tiny_inputs()
    model = _model()
    before = logits(model, inputs)
    with mask_heads(model, {("dec_self", 1): [0, 1]}):  # the query heads of key/value head 0
        masked = logits(model, inputs)
    with torch.no_grad():
        _attention(model, 1).v_proj.weight[:D] = 0
    reference = logits(model, inputs)
    assert not torch.allclose(reference, before)
    torch.testing.assert_close(masked, reference, atol=1e-12, rtol=0)
    check_gates_at_one_change_nothing(_model(), inputs)


def test_pruning_equals_masking_a_layer_emptied_and_reloads(tmp_path):
    inputs = tiny_inputs()
    spec = {("dec_self", 0): [0, 1, 2, 3], ("dec_self", 1): [1]}
    model = _model()
    with mask_heads(model, spec):
        masked = logits(model, inputs)
    prune_heads(model, spec)
    assert _attention(model, 1).g_proj.weight.shape[0] == 3
    keep = inputs["attention_mask"].bool()
    torch.testing.assert_close(logits(model, inputs)[keep], masked[keep], atol=1e-10, rtol=0)
    save_pruned(model, tmp_path / "pruned")
    reloaded = load_pruned(tmp_path / "pruned")
    assert [b.n_heads for b in attention_blocks(reloaded) if not b.idle] == [0, 3]
    reloaded.config.text_config._experts_implementation = "eager"
    torch.testing.assert_close(logits(reloaded.double(), inputs)[keep], masked[keep], atol=1e-10, rtol=0)
    plain = tf.AutoModelForImageTextToText.from_pretrained(tmp_path / "pruned", trust_remote_code=True)
    plain.config.text_config._experts_implementation = "eager"
    torch.testing.assert_close(logits(plain.eval().double(), inputs)[keep], masked[keep], atol=1e-10, rtol=0)


def test_lrp_conserves_through_the_gate_and_the_clamps():
    """The clamps act (bound 0.05 on projections of ~0.2): conserved to float64 rounding."""
    assert_conserved(_model(limit=0.05), 1e-10)
