"""Kimi Linear as released: Kimi Delta Attention (KDA) linear-attention layers between multi-head latent attention
layers (``layer_types`` ["linear_attention", "full_attention"], transformers 5.24). A KDA layer
(``KimiLinearDeltaAttention``) holds q/k/v/o projections but keeps a delta-rule recurrent state per head, no attention
map: a hybrid's other mixer, as Qwen3-Next's Gated DeltaNet (``adapters.families.LINEAR_MIXERS``). Before session 38
its names made it look like attention that skipped the interface and the model was refused; now its attention
layers are analysed, masked and pruned exactly (their latent attention: tests/test_mla_pruning.py), the KDA layers
left as they are; LRP through them has a rule since session 38 too (tests/test_lrp_kda.py)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from headlab import attention_blocks, capture_attention, mask_heads
from headlab.checkpoint import model_class_for
from support.family_matrix import (
    check_pruned_generates_as_masked,
    check_pruned_reloads,
    logits,
    padded_inputs,
    perturbed_model,
    tiny_inputs,
)

_KIMI = dict(vocab_size=99, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=64, bos_token_id=0, eos_token_id=1, pad_token_id=2,
             q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=8,
             moe_intermediate_size=40, num_local_experts=4, num_experts_per_tok=2, linear_head_dim=8,
             linear_num_heads=4, layer_types=["linear_attention", "full_attention"])


def _kimi(implementation: str = "sdpa") -> torch.nn.Module:
    if "kimi_linear" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no kimi_linear")
    config = CONFIG_MAPPING["kimi_linear"](**_KIMI)
    return perturbed_model(model_class_for(config), config, attn_implementation=implementation)


def test_its_attention_layers_are_the_blocks_captured_and_masked_exactly():
    model = _kimi()
    assert type(model.model.layers[0].self_attn).__name__ == "KimiLinearDeltaAttention"
    assert [(b.kind, b.layer, b.name, b.n_heads) for b in attention_blocks(model)] == [
        ("dec_self", 1, "model.layers.1.self_attn", 4)]
    inputs = tiny_inputs()
    with torch.no_grad():
        reference = _kimi("eager")(**inputs, output_attentions=True).attentions
    with capture_attention(model) as record:
        logits(model, inputs)
    assert sorted(record) == [("dec_self", 1)]
    assert torch.equal(record[("dec_self", 1)], next(a for a in reference if a is not None))
    with mask_heads(model, {("dec_self", 1): [2]}):
        masked = logits(model, inputs)
    zeroed = _kimi()
    with torch.no_grad():  # head 2's values: its [k_nope 4 | v 8] rows of kv_b_proj, the last 8
        zeroed.model.layers[1].self_attn.kv_b_proj.weight[2 * 12 + 4:3 * 12] = 0
    torch.testing.assert_close(masked, logits(zeroed, inputs), atol=1e-6, rtol=0)
    assert not torch.allclose(masked, logits(model, inputs))


def test_pruning_equals_masking_in_cached_generation_and_reloads(tmp_path):
    model = _kimi()
    ids, mask = padded_inputs(pad_id=2)
    expected, tokens = check_pruned_generates_as_masked(model, {("dec_self", 1): [0, 3]}, [2], ids, mask)
    assert model.model.layers[1].self_attn.kv_b_proj.weight.shape[0] == 2 * 12
    check_pruned_reloads(model, tmp_path, [2], ids, mask, expected, tokens)




def test_headlab_heads_lists_the_attention_layer_of_a_saved_directory(tmp_path, capsys):
    from headlab.cli import main
    from headlab.loading import check_supported

    _kimi().save_pretrained(tmp_path)
    check_supported(str(tmp_path), prune=True)
    assert main(["heads", str(tmp_path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["module"], r["n_heads"]) for r in rows] == [("model.layers.1.self_attn", 4)]
