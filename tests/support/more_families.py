"""Tiny random models of families whose physical pruning needs care (partial rotary, per-head and
whole-width query/key norms, grouped key/value heads, MoE feed-forward layers), built from
configs: hidden 32, 2 layers, vocab 99, no downloads. Used by tests/test_prune_verify.py."""

from __future__ import annotations

import torch
import transformers as tf

VOCAB = 99
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
               max_position_embeddings=64, bos_token_id=0, eos_token_id=1, pad_token_id=2)


def _gqa(**extra):
    """4 query heads over 2 key/value heads (groups of 2), head size 8."""
    return {**_COMMON, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, **extra}


CONFIGS = {
    "olmo2": lambda: (tf.Olmo2ForCausalLM, tf.Olmo2Config(**_gqa())),
    "stablelm": lambda: (tf.StableLmForCausalLM, tf.StableLmConfig(
        **{**_COMMON, "num_attention_heads": 4, "num_key_value_heads": 4}, partial_rotary_factor=0.5)),
    "stablelm-qk-norm": lambda: (tf.StableLmForCausalLM, tf.StableLmConfig(
        **{**_COMMON, "num_attention_heads": 4, "num_key_value_heads": 2}, partial_rotary_factor=0.25,
        qk_layernorm=True)),
    "opt": lambda: (tf.OPTForCausalLM, tf.OPTConfig(
        vocab_size=VOCAB, hidden_size=32, ffn_dim=37, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, word_embed_proj_dim=32, bos_token_id=0, eos_token_id=1, pad_token_id=2)),
    "gemma": lambda: (tf.GemmaForCausalLM, tf.GemmaConfig(**_gqa())),
    "gemma2": lambda: (tf.Gemma2ForCausalLM, tf.Gemma2Config(**_gqa(), sliding_window=4)),
    "gemma3": lambda: (tf.Gemma3ForCausalLM, tf.Gemma3TextConfig(**_gqa(), sliding_window=4)),
    "olmo": lambda: (tf.OlmoForCausalLM, tf.OlmoConfig(**_gqa())),
    # intermediate 40: torch's grouped matmul of the experts needs rows of a multiple of 16 bytes
    "mixtral": lambda: (tf.MixtralForCausalLM, tf.MixtralConfig(**{**_gqa(), "intermediate_size": 40},
                                                                 num_local_experts=3, num_experts_per_tok=2)),
    "llama": lambda: (tf.LlamaForCausalLM, tf.LlamaConfig(**_gqa())),
    "qwen2": lambda: (tf.Qwen2ForCausalLM, tf.Qwen2Config(**_gqa())),
    "qwen3": lambda: (tf.Qwen3ForCausalLM, tf.Qwen3Config(**_gqa())),
}
FAMILIES = tuple(CONFIGS)
EAGER_ONLY = {"gemma2"}  # transformers refuses sdpa for Gemma2 (its logit soft-capping)


def tiny_model(family: str, seed: int = 0, attn_implementation: str = "sdpa") -> torch.nn.Module:
    cls, config = CONFIGS[family]()
    config._attn_implementation = "eager" if family in EAGER_ONLY else attn_implementation
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():  # non-zero biases and norm weights, so that slicing them is exercised
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                parameter.add_(torch.randn_like(parameter) * 0.1)
    return model
