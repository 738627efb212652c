"""Muse Glimmer (``MuseGlimmerForConditionalGeneration``, model types ``muse_glimmer`` / ``muse_glimmer_text``): its
language model's attention (``MuseGlimmerTextAttention``, transformers 5.24) multiplies the attention function's output
``[batch, seq, heads * head_dim]`` by ``sigmoid(gate_proj(hidden_states))`` (hidden -> heads x head_dim), AFMoE's gate
(``adapters.families.OUTPUT_GATES``, ``afmoe_gate``: head h's rows ``h * head_dim ...``). Found by the session-37 sweep
of vision-language wrappers (refused before any work for the gate). Checked on a tiny float64 model, the vision tower
idle: capture equals output_attentions, masking equals zeroed value rows, gates at one change nothing, pruning slices
the gate's rows and equals masking, and LRP conserves."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from headlab import attention_blocks, mask_heads, prune_heads
from support.family_matrix import (
    check_capture_equals_output_attentions,
    check_gates_at_one_change_nothing,
    logits,
    perturbed_model,
    tiny_inputs,
)
from support.lrp_families import assert_conserved

_TEXT = dict(vocab_size=99, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=2, bos_token_id=0,
             eos_token_id=1, layer_types=["sliding_attention", "full_attention"], sliding_window=4)
_VISION = dict(hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=4, patch_size=4)


def _model(implementation: str = "sdpa") -> torch.nn.Module:
    if not hasattr(tf, "MuseGlimmerForConditionalGeneration"):
        pytest.skip("this transformers has no muse_glimmer")
    config = tf.MuseGlimmerConfig(text_config=_TEXT, vision_config=_VISION, out_hidden_size=32,
                                  projector_hidden_size=40, image_token_id=98, video_token_id=97)
    model = perturbed_model(tf.MuseGlimmerForConditionalGeneration, config, attn_implementation=implementation)
    with torch.no_grad():  # the gates spread
        for name, parameter in model.named_parameters():
            if name.endswith("self_attn.gate_proj.weight"):
                parameter.mul_(8)
    return model.double()


def _attention(model, layer: int):
    return model.model.language_model.layers[layer].self_attn


def test_blocks_capture_masking_and_gates():
    model = _model()
    live = [b for b in attention_blocks(model) if not b.idle]
    assert [(b.kind, b.layer, b.n_heads) for b in live] == [("dec_self", 0, 4), ("dec_self", 1, 4)]
    assert any(path.endswith("gate_proj") for path, _ in live[0].family.head_rows)
    inputs = tiny_inputs()
    check_capture_equals_output_attentions(lambda attn_implementation="sdpa": _model(attn_implementation), "dec_self",
                                           inputs)
    with mask_heads(model, {("dec_self", 1): [0, 1]}):  # key/value head 0's query heads
        masked = logits(model, inputs)
    zeroed = _model()
    with torch.no_grad():
        _attention(zeroed, 1).v_proj.weight[:8] = 0
    torch.testing.assert_close(masked, logits(zeroed, inputs), atol=1e-12, rtol=0)
    check_gates_at_one_change_nothing(_model(), inputs)


def test_pruning_slices_the_gate_and_equals_masking():
    inputs = tiny_inputs()
    model = _model()
    spec = {("dec_self", 0): [0, 1, 2, 3], ("dec_self", 1): [2]}
    with mask_heads(model, spec):
        masked = logits(model, inputs)
    prune_heads(model, spec)
    assert _attention(model, 1).gate_proj.weight.shape[0] == 3 * 8
    keep = inputs["attention_mask"].bool()
    torch.testing.assert_close(logits(model, inputs)[keep], masked[keep], atol=1e-10, rtol=0)


def test_lrp_conserves():
    assert_conserved(_model(), 1e-10)
