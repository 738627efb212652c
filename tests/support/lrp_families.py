"""Tiny random models of the families LRP's normalisation rules were written for, beyond
tests/support/models.py: OLMo's parameter-free LayerNorm, Gemma's ``x * (1 + w)`` RMS norms,
mT5's LayerNorm (an RMS norm), and families whose norms are plain (Mistral, OLMo2, Qwen3,
StableLM, GPT-J, OPT), and mixtures of experts (Mixtral, Qwen2-MoE with its gated shared expert,
Qwen3-MoE). Built from configs (hidden 32, 2 layers, 4 heads, vocab 99): no downloads."""

from __future__ import annotations

import torch
import transformers as tf

from support.models import VOCAB

_DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=64, bos_token_id=0, eos_token_id=1, pad_token_id=2)

CONFIGS = {
    "olmo": lambda: (tf.OlmoForCausalLM, tf.OlmoConfig(**_DECODER, num_key_value_heads=4)),
    "olmo2": lambda: (tf.Olmo2ForCausalLM, tf.Olmo2Config(**_DECODER, num_key_value_heads=2)),
    "mistral": lambda: (tf.MistralForCausalLM, tf.MistralConfig(**_DECODER, num_key_value_heads=2)),
    "qwen3": lambda: (tf.Qwen3ForCausalLM, tf.Qwen3Config(**_DECODER, num_key_value_heads=2, head_dim=8)),
    "gemma": lambda: (tf.GemmaForCausalLM, tf.GemmaConfig(**_DECODER, num_key_value_heads=2, head_dim=8)),
    "gemma2": lambda: (tf.Gemma2ForCausalLM, tf.Gemma2Config(**_DECODER, num_key_value_heads=2, head_dim=8)),
    "gemma3": lambda: (tf.Gemma3ForCausalLM, tf.Gemma3TextConfig(**_DECODER, num_key_value_heads=2, head_dim=8)),
    "stablelm": lambda: (tf.StableLmForCausalLM, tf.StableLmConfig(**_DECODER, num_key_value_heads=4,
                                                                  use_qkv_bias=True)),
    "gptj": lambda: (tf.GPTJForCausalLM, tf.GPTJConfig(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                                       rotary_dim=4, bos_token_id=0, eos_token_id=1)),
    "opt": lambda: (tf.OPTForCausalLM, tf.OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=37, num_hidden_layers=2,
                                                    num_attention_heads=4, max_position_embeddings=64,
                                                    word_embed_proj_dim=32, pad_token_id=2)),
    # mixtures of experts (intermediate 40: torch's grouped matmul wants rows of a multiple of 16 bytes)
    "mixtral": lambda: (tf.MixtralForCausalLM, tf.MixtralConfig(**{**_DECODER, "intermediate_size": 40},
                                                                 num_key_value_heads=2, num_local_experts=3,
                                                                 num_experts_per_tok=2)),
    "qwen2_moe": lambda: (tf.Qwen2MoeForCausalLM, tf.Qwen2MoeConfig(
        **_DECODER, num_key_value_heads=2, num_experts=3, num_experts_per_tok=2, moe_intermediate_size=40,
        shared_expert_intermediate_size=40)),
    "qwen3_moe": lambda: (tf.Qwen3MoeForCausalLM, tf.Qwen3MoeConfig(
        **_DECODER, num_key_value_heads=2, head_dim=8, num_experts=3, num_experts_per_tok=2,
        moe_intermediate_size=40, norm_topk_prob=True)),
    "mt5": lambda: (tf.MT5ForConditionalGeneration, tf.MT5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4, pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0)),
}
FAMILIES = tuple(CONFIGS)


def tiny_lrp_model(family: str, seed: int = 0, *, biases: bool = True, dtype: torch.dtype = torch.float32,
                   **config_values):
    """A tiny random ``family`` model in eval mode. transformers initialises norm weights to one
    (zero for Gemma's ``1 + w``) and biases to zero: both are drawn at random here, so that a rule
    that ignores a weight or a bias is visible. ``config_values`` override the config's."""
    cls, config = CONFIGS[family]()
    for name, value in config_values.items():
        setattr(config, name, value)
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 0.1) if biases else parameter.zero_()
            elif "norm" in name and name.endswith("weight"):
                parameter.uniform_(0.5, 1.5)
    return model.to(dtype)
