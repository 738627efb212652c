"""Tiny random models of the families headlab analyses and masks beyond tests/support/models.py
(hidden 32, 2 layers, 4 heads of 8, vocab 99), built from configs: no downloads.

Each entry names, besides the model, how its value heads sit in the weights, read off the
modeling code by hand (not from headlab's adapter tables), so that the zeroed-value reference
of tests/test_more_families.py is independent of what it checks: ``values(model, layer)`` is
``(module, rows(kv_head) -> weight rows of that key/value head's values, n_kv_heads)``.
"""

from __future__ import annotations

import torch
import transformers as tf

from support.models import VOCAB

_SPECIAL = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
D = 8  # head size


def _per_head(h: int) -> range:
    """[q_h | k_h | v_h] for each head h: GPT-NeoX's view(..., heads, 3 * d).chunk(3), Bloom's
    and Falcon's view(..., heads, 3, d)."""
    return range(3 * h * D + 2 * D, 3 * h * D + 3 * D)


def _qkv(n_heads: int, n_kv: int):
    """[all q | all k | all v] (Phi-3's slices, GPT-BigCode's and Falcon's multi-query split)."""
    return lambda j: range((n_heads + n_kv) * D + j * D, (n_heads + n_kv) * D + (j + 1) * D)


def _grouped(group: int):
    """Falcon's new decoder architecture: view(..., kv_heads, group + 2, d), value last."""
    return lambda j: range(j * (group + 2) * D + (group + 1) * D, j * (group + 2) * D + (group + 2) * D)


CONFIGS = {
    "gpt_neox": lambda: (tf.GPTNeoXForCausalLM, tf.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
        max_position_embeddings=64, attention_bias=True, **_SPECIAL)),
    "phi3": lambda: (tf.Phi3ForCausalLM, tf.Phi3Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=37, max_position_embeddings=64, original_max_position_embeddings=64, **_SPECIAL)),
    "phi": lambda: (tf.PhiForCausalLM, tf.PhiConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
        max_position_embeddings=64, **_SPECIAL)),
    "falcon": lambda: (tf.FalconForCausalLM, tf.FalconConfig(  # the new decoder architecture: grouped
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
        new_decoder_architecture=True, bias=True, **_SPECIAL)),
    "falcon_mq": lambda: (tf.FalconForCausalLM, tf.FalconConfig(  # Falcon-7B's multi-query layout, rotary
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, multi_query=True,
        bias=True, **_SPECIAL)),
    "falcon_alibi": lambda: (tf.FalconForCausalLM, tf.FalconConfig(  # one key/value per head, ALiBi
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, multi_query=False,
        alibi=True, parallel_attn=False, bias=True, **_SPECIAL)),
    "gpt_bigcode": lambda: (tf.GPTBigCodeForCausalLM, tf.GPTBigCodeConfig(  # StarCoder: multi-query
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, multi_query=True, **_SPECIAL)),
    "gpt_bigcode_mha": lambda: (tf.GPTBigCodeForCausalLM, tf.GPTBigCodeConfig(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, multi_query=False, **_SPECIAL)),
    "bloom": lambda: (tf.BloomForCausalLM, tf.BloomConfig(
        vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, **_SPECIAL)),
    "deberta-v2": lambda: (tf.DebertaV2ForMaskedLM, tf.DebertaV2Config(  # DeBERTa-v3's relative attention
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
        max_position_embeddings=64, relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=8,
        max_relative_positions=16, share_att_key=True, norm_rel_ebd="layer_norm", pad_token_id=2)),
    "modernbert": lambda: (tf.ModernBertForMaskedLM, tf.ModernBertConfig(  # layer 1 local: 2 keys either side
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
        max_position_embeddings=64, global_attn_every_n_layers=2, local_attention=4, pad_token_id=2,
        bos_token_id=0, eos_token_id=1, cls_token_id=0, sep_token_id=1)),
}
FAMILIES = tuple(CONFIGS)

# (path of the fused or value projection of layer i, rows of key/value head j's values, key/value heads)
VALUES = {
    "gpt_neox": (lambda m, i: m.gpt_neox.layers[i].attention.query_key_value, _per_head, 4),
    "phi3": (lambda m, i: m.model.layers[i].self_attn.qkv_proj, _qkv(4, 2), 2),
    "phi": (lambda m, i: m.model.layers[i].self_attn.v_proj, lambda j: range(j * D, (j + 1) * D), 4),
    "falcon": (lambda m, i: m.transformer.h[i].self_attention.query_key_value, _grouped(2), 2),
    "falcon_mq": (lambda m, i: m.transformer.h[i].self_attention.query_key_value, _qkv(4, 1), 1),
    "falcon_alibi": (lambda m, i: m.transformer.h[i].self_attention.query_key_value, _per_head, 4),
    "gpt_bigcode": (lambda m, i: m.transformer.h[i].attn.c_attn, _qkv(4, 1), 1),
    "gpt_bigcode_mha": (lambda m, i: m.transformer.h[i].attn.c_attn, _per_head, 4),
    "bloom": (lambda m, i: m.transformer.h[i].self_attention.query_key_value, _per_head, 4),
    "modernbert": (lambda m, i: m.model.layers[i].attn.Wqkv, _qkv(4, 4), 4),  # view(..., 3, heads, d)
    "deberta-v2": (lambda m, i: m.deberta.encoder.layer[i].attention.self.value_proj,
                   lambda j: range(j * D, (j + 1) * D), 4),
}
ENCODERS = {"modernbert", "deberta-v2"}

# Families headlab refuses, before any work.
REFUSED = {
    "deberta": lambda: (tf.DebertaForMaskedLM, tf.DebertaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
        max_position_embeddings=64)),
    "albert": lambda: (tf.AlbertForMaskedLM, tf.AlbertConfig(
        vocab_size=VOCAB, embedding_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=37, max_position_embeddings=64)),
    "whisper": lambda: (tf.WhisperForConditionalGeneration, tf.WhisperConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=37, decoder_ffn_dim=37, num_mel_bins=8,
        max_source_positions=16, max_target_positions=32, pad_token_id=2, bos_token_id=0, eos_token_id=1,
        decoder_start_token_id=0)),
}


def tiny_model(family: str, seed: int = 0, attn_implementation: str = "sdpa") -> torch.nn.Module:
    cls, config = {**CONFIGS, **REFUSED}[family]()
    if attn_implementation == "sdpa" and not cls._supports_sdpa:  # Bloom, DeBERTa-v2: eager only
        attn_implementation = "eager"
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():  # non-zero biases, so that bias handling is exercised
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 0.1)
    return model


def tiny_inputs(batch: int = 2, length: int = 7, seed: int = 1, pad: bool = True) -> dict:
    """Random token ids; the second sequence has two padded positions at the end."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    if pad and batch > 1:
        mask[1, -2:] = 0
    return {"input_ids": ids, "attention_mask": mask}
