"""Per-head norm tables: Chameleon's and Cohere's (``use_qk_norm``, Command R+) query and key LayerNorms hold a row
of weight and bias per head. Pruning slices those rows with the heads (``surgery._per_head_tables``); before session
38 they were left whole and pruning was refused by its check (tests/test_prune_verify.py keeps that refusal tested).

Chameleon (``ChameleonForConditionalGeneration``, model type ``chameleon``; transformers 5.24): its attention
normalises each head's queries and keys with a LayerNorm whose weight and bias hold one row per head
(``ChameleonLayerNorm((num_heads, head_dim))``: statistics over a head's features, then that head's own scale and
shift). Found by the session-38 sweep of vision-language
wrappers (``experiments/family_sweep.py --multimodal``, which skipped Chameleon: its config needs a vocabulary map).
Checked on a tiny float64 model on token ids (its VQ-VAE idle): capture equals output_attentions, masking equals
zeroed value rows, gates at one change nothing, pruning equals masking, the saved directory reloads with headlab and
with plain transformers, and LRP conserves."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf

from headlab import attention_blocks, load_pruned, mask_heads, prune_heads, save_pruned
from support.family_matrix import (
    VOCAB,
    check_capture_equals_output_attentions,
    check_gates_at_one_change_nothing,
    check_pruned_generates_as_masked,
    check_pruned_reloads,
    logits,
    padded_inputs,
    perturbed_model,
    tiny_inputs,
)
from support.lrp_families import assert_conserved

_VQ = dict(embed_dim=8, num_embeddings=16, latent_channels=32, base_channels=32, channel_multiplier=[1, 1],
           num_res_blocks=1, resolution=16)


def _model(implementation: str = "sdpa") -> torch.nn.Module:
    if not hasattr(tf, "ChameleonForConditionalGeneration"):
        pytest.skip("this transformers has no chameleon")
    config = tf.ChameleonConfig(vocab_size=99, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                pad_token_id=2, vq_config=_VQ,
                                vocabulary_map={"<image>": 98, "IMGIMG0Z": 97, "IMGIMG1Z": 96})
    return perturbed_model(tf.ChameleonForConditionalGeneration, config, attn_implementation=implementation).double()


def _attention(model, layer: int):
    return model.model.layers[layer].self_attn


def test_blocks_capture_masking_and_gates():
    model = _model()
    live = [b for b in attention_blocks(model) if not b.idle]
    assert [(b.kind, b.layer, b.n_heads, b.n_kv_heads) for b in live] == [("dec_self", 0, 4, 2), ("dec_self", 1, 4, 2)]
    assert _attention(model, 0).q_norm.weight.shape == (4, 8)  # a row per head, as released
    inputs = tiny_inputs()
    check_capture_equals_output_attentions(lambda attn_implementation="sdpa": _model(attn_implementation), "dec_self",
                                           inputs)
    with mask_heads(model, {("dec_self", 1): [2, 3]}):  # key/value head 1's query heads
        masked = logits(model, inputs)
    zeroed = _model()
    with torch.no_grad():
        _attention(zeroed, 1).v_proj.weight[8:16] = 0
    torch.testing.assert_close(masked, logits(zeroed, inputs), atol=1e-12, rtol=0)
    check_gates_at_one_change_nothing(_model(), inputs)


def test_pruning_slices_the_per_head_norms_equals_masking_and_reloads(tmp_path):
    inputs = tiny_inputs()
    model = _model()
    spec = {("dec_self", 0): [0, 1], ("dec_self", 1): [1, 2]}  # layer 0: key/value head 0 goes; layer 1: one of each
    with mask_heads(model, spec):
        masked = logits(model, inputs)
    original = _attention(model, 1).q_norm.weight.detach().clone()
    prune_heads(model, spec)
    attention = _attention(model, 1)
    assert attention.q_norm.weight.shape == (2, 8) and attention.k_norm.weight.shape == (2, 8)
    assert torch.equal(attention.q_norm.weight, original[[0, 3]])
    assert _attention(model, 0).k_norm.bias.shape == (1, 8)
    keep = inputs["attention_mask"].bool()
    pruned = logits(model, inputs)
    torch.testing.assert_close(pruned[keep], masked[keep], atol=1e-10, rtol=0)

    save_pruned(model, tmp_path)
    record = json.loads((tmp_path / "headlab_pruning.json").read_text())
    assert record["portable"]["how"] == "remote code"
    reloaded = load_pruned(tmp_path).double()
    assert [b.n_heads for b in attention_blocks(reloaded) if not b.idle] == [2, 2]
    torch.testing.assert_close(logits(reloaded, inputs), pruned, atol=1e-12, rtol=0)
    plain, info = tf.AutoModelForImageTextToText.from_pretrained(tmp_path, trust_remote_code=True,
                                                                  output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    torch.testing.assert_close(logits(plain.eval().double(), inputs), pruned, atol=1e-12, rtol=0)


def test_lrp_conserves():
    assert_conserved(_model(), 1e-10)


def test_cohere_qk_norm_prunes_generates_as_masked_and_reloads(tmp_path):
    config = tf.CohereConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             use_qk_norm=True, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    model = perturbed_model(tf.CohereForCausalLM, config)
    assert model.model.layers[0].self_attn.q_norm.weight.shape == (4, 8)
    ids, mask = padded_inputs()
    spec = {("dec_self", 0): [0, 1, 2, 3], ("dec_self", 1): [0, 3]}  # layer 0 emptied; layer 1: one of each group
    expected, tokens = check_pruned_generates_as_masked(model, spec, [0, 2], ids, mask)
    assert model.model.layers[1].self_attn.k_norm.weight.shape == (2, 8)
    check_pruned_reloads(model, tmp_path, [0, 2], ids, mask, expected, tokens)
