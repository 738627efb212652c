"""LFM3-VL (``Lfm3VlForConditionalGeneration``, model type ``lfm3_vl``): its language model is LFM3 (``lfm3``:
short-convolution layers beside grouped-query attention with a per-head output gate ``sigmoid(g_proj(x))``,
``adapters.families.OUTPUT_GATES``). Found by the session-37 sweep of vision-language wrappers
(``experiments/family_sweep.py --multimodal``): discovery looked the gate up under the wrapper's type, not listed, and
refused the model before any work. Now a wrapper whose own type is not listed takes its attention module's config's
(``adapters._table_type``). Checked on a tiny float64 model, the vision tower idle: capture equals
output_attentions, masking equals zeroed value rows, gates at one change nothing, pruning slices the gate's rows and
equals masking, and LRP conserves (LFM3's rules)."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from headlab import attention_blocks, capture_attention, mask_heads, prune_heads
from support.family_matrix import check_gates_at_one_change_nothing, logits, perturbed_model, tiny_inputs
from support.lrp_families import assert_conserved

_TEXT = dict(vocab_size=99, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=2, bos_token_id=0,
             eos_token_id=1, layer_types=["conv", "full_attention"], sliding_window=4)
_VISION = dict(hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=4, image_size=16,
               patch_size=8)


def _model(implementation: str = "sdpa") -> torch.nn.Module:
    if not hasattr(tf, "Lfm3VlForConditionalGeneration"):
        pytest.skip("this transformers has no lfm3_vl")
    config = tf.Lfm3VlConfig(text_config=dict(_TEXT, model_type="lfm3"), vision_config=_VISION)
    model = perturbed_model(tf.Lfm3VlForConditionalGeneration, config, attn_implementation=implementation)
    with torch.no_grad():  # the gates spread
        for name, parameter in model.named_parameters():
            if name.endswith("self_attn.g_proj.weight"):
                parameter.mul_(8)
    return model.double()


def _attention(model):
    return model.model.language_model.layers[1].self_attn


def test_blocks_capture_masking_and_gates():
    model = _model()
    live = [b for b in attention_blocks(model) if not b.idle]
    assert [(b.kind, b.layer, b.n_heads) for b in live] == [("dec_self", 1, 4)]
    assert any(path.endswith("g_proj") for path, _ in live[0].family.head_rows)
    inputs = tiny_inputs()
    with torch.no_grad():
        expected = _model("eager")(**inputs, output_attentions=True).attentions
    with capture_attention(model) as record:
        logits(model, inputs)
    maps = [m for m in expected if m is not None]  # the attention layers' only
    torch.testing.assert_close(record[("dec_self", 1)], maps[-1], atol=1e-12, rtol=0)
    with mask_heads(model, {("dec_self", 1): [0, 1]}):  # key/value head 0's query heads
        masked = logits(model, inputs)
    zeroed = _model()
    with torch.no_grad():
        _attention(zeroed).v_proj.weight[:8] = 0
    torch.testing.assert_close(masked, logits(zeroed, inputs), atol=1e-12, rtol=0)
    check_gates_at_one_change_nothing(_model(), inputs)


def test_pruning_slices_the_gate_and_equals_masking():
    inputs = tiny_inputs()
    model = _model()
    spec = {("dec_self", 1): [2]}
    with mask_heads(model, spec):
        masked = logits(model, inputs)
    prune_heads(model, spec)
    assert _attention(model).g_proj.weight.shape[0] == 3
    keep = inputs["attention_mask"].bool()
    torch.testing.assert_close(logits(model, inputs)[keep], masked[keep], atol=1e-10, rtol=0)


def test_lrp_conserves():
    assert_conserved(_model(), 1e-10)
