"""Kimi-K2.5 (``Kimi_K25ForConditionalGeneration``, model type ``kimi_k25``): a vision tower around DeepSeek-V3's
language model (multi-head latent attention, ``deepseek_v3``). Found by the session-37 sweep of vision-language wrappers
(``experiments/family_sweep.py --multimodal``): discovery read its tables under the wrapper's type, which none lists, so
its latent attention's per-head rows were unknown: pruning and LRP were refused. Now a wrapper whose own type no table
lists takes its attention module's config's (``adapters._table_type``): DeepSeek-V3's rows. Checked on a tiny
float64 model: the blocks' latent rows, capture equals output_attentions, pruning equals masking with a layer emptied,
and LRP conserves."""

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

_TEXT = dict(model_type="deepseek_v3", vocab_size=99, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, head_dim=4, max_position_embeddings=64, pad_token_id=2,
             bos_token_id=0, eos_token_id=1, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
             n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=16,
             qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)
_VISION = dict(hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=4, patch_size=4,
               pos_emb_height=8, pos_emb_width=8)


def _model(implementation: str = "sdpa") -> torch.nn.Module:
    if not hasattr(tf, "Kimi_K25ForConditionalGeneration"):
        pytest.skip("this transformers has no kimi_k25")
    config = tf.Kimi_K25Config(text_config=_TEXT, vision_config=_VISION)
    config.get_text_config()._experts_implementation = "eager"  # grouped matmuls take no float64
    return perturbed_model(tf.Kimi_K25ForConditionalGeneration, config, attn_implementation=implementation).double()


def test_blocks_have_deepseek_v3s_latent_rows():
    live = [b for b in attention_blocks(_model()) if not b.idle]
    assert [(b.kind, b.layer, b.n_heads, b.d_head) for b in live] == [("dec_self", 0, 4, 8), ("dec_self", 1, 4, 8)]
    assert [path for path, _ in live[0].family.head_rows] == ["q_b_proj", "kv_b_proj"]


def test_capture_masking_pruning_and_gates():
    inputs = tiny_inputs()
    model = _model()
    check_capture_equals_output_attentions(lambda attn_implementation="sdpa": _model(attn_implementation), "dec_self",
                                           inputs)
    spec = {("dec_self", 0): [0, 1, 2, 3], ("dec_self", 1): [2]}
    with mask_heads(model, spec):
        masked = logits(model, inputs)
    prune_heads(model, spec)
    assert [b.n_heads for b in attention_blocks(model) if not b.idle] == [0, 3]
    keep = inputs["attention_mask"].bool()
    torch.testing.assert_close(logits(model, inputs)[keep], masked[keep], atol=1e-10, rtol=0)
    check_gates_at_one_change_nothing(_model(), inputs)


def test_lrp_conserves():
    assert_conserved(_model(), 1e-10)
