"""Tiny models of the families whose checkpoints transformers converts when it loads them and converts
back when it saves them (``transformers.conversion_mapping``: renamed weights, the experts of a mixture
of experts fused into one tensor): every text model type of transformers 5.24 with a conversion that
headlab prunes (found by building each type tiny, as experiments/family_sweep.py does, and asking
``get_model_conversion_mapping``). Hidden 32, 2 layers, 4 query heads over 2 key/value heads of 8, vocab
99, built from configs (no download); biases and norm weights moved off their initial values, so that
one left newly initialised changes the logits.

Types with a conversion that headlab refuses to prune or cannot build tiny are left out (bailing_hybrid...: their
attention refused), as are the multimodal wrappers. OLMoE, FlexOlmo, MiniMax-M2 and OLMo-hybrid (a query norm over the
whole projection, refused until session 29) are in: the projection stays whole, its heads selected after the norm.
Beam, AFMoE, Laguna and LFM3 (an output gate per head from a projection of its own,
``adapters.families.QKV_OUTPUT_GATES``) are in: the gate's projection is sliced with the heads (session 28).
"""

from __future__ import annotations

import torch
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_MASKED_LM_MAPPING

_SIZES = dict(
    vocab_size=99, hidden_size=32, intermediate_size=40, num_hidden_layers=2, max_position_embeddings=64,
    bos_token_id=0, eos_token_id=1, pad_token_id=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    # mixtures of experts, latent attention, partial rotary, linear attention and state-space layers
    moe_intermediate_size=40, num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
    n_shared_experts=1, shared_expert_intermediate_size=40, first_k_dense_replace=1, n_group=1, topk_group=1,
    kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, rotary_dim=4,
    linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
    mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_chunk_size=4, mamba_expand=1,
    mamba_head_dim=8, ssm_state_size=8, window_size=4, attention_types=[[["global", "local"], 1]], num_layers=2)
_MLA = dict(num_key_value_heads=4)  # latent attention: keys and values per query head
_HYBRID = ["linear_attention", "full_attention"]
_OVERRIDES: dict[str, dict] = {  # the sizes each type needs besides (experiments/family_sweep.py's OVERRIDES)
    **{t: _MLA for t in ("deepseek_v2", "glm4_moe_lite", "sarvam_mla")},
    **{t: {**_MLA, "index_topk": 3, "index_n_heads": 2, "index_head_dim": 8} for t in ("deepseek_v32", "glm_moe_dsa")},
    **{t: {**_MLA, "head_dim": 4} for t in ("deepseek_v3", "axk1")},  # head_dim: the rotary part
    "longcat_flash": {**_MLA, "head_dim": 4, "num_hidden_layers": 4},  # two attentions per decoder layer
    **{t: dict(layer_types=_HYBRID) for t in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")},
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, use_mamba_kernels=False),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"]),
    "gemma3n_text": dict(layer_types=["sliding_attention", "full_attention"], num_kv_shared_layers=0, laurel_rank=4,
                         altup_num_inputs=2, hidden_size_per_layer_input=8, vocab_size_per_layer_input=99,
                         intermediate_size=[40, 40], activation_sparsity_pattern=[0.0, 0.0]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "lfm3": dict(layer_types=["conv", "full_attention"]),  # its default for 2 layers: convolutions only
    "afmoe": dict(num_dense_layers=1, sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
    "laguna": dict(num_attention_heads_per_layer=[4, 6], mlp_layer_types=["dense", "sparse"], sliding_window=4,
                   layer_types=["sliding_attention", "full_attention"]),
    "beam": dict(mlp_layer_types=["dense", "sparse"]),
}

CONVERTED = (
    "afmoe", "apertus1p5_text", "aria_text", "axk1", "beam", "cohere2_moe", "deepseek_v2", "deepseek_v3",
    "deepseek_v32", "dots1", "ernie4_5_moe", "esm", "exaone", "exaone_moe", "flex_olmo", "gemma3n_text", "glm4_moe",
    "glm4_moe_lite", "glm_moe_dsa", "gpt_neox", "granitemoe", "granitemoehybrid", "granitemoeshared", "gte",
    "hunyuan_v1_moe", "hy_v3", "jamba", "jina_embeddings_v3", "kolibri1", "laguna", "lara_mini", "lfm2_moe", "lfm3",
    "longcat_flash", "mellum", "minimax", "minimax_m2", "mixtral", "nemotron_h", "nomic_bert", "olmo_hybrid", "olmoe",
    "phimoe", "qwen2_moe", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_moe", "qwen3_next", "sarvam_mla", "sarvam_moe",
    "solar_open", "ultrabert",
)
"""Model types whose tiny model transformers converts on loading (checked by tests/test_portable_conversions.py)."""


def model_class(config) -> type:
    """The causal-LM class of ``config``, else the masked-LM one (ESM, GTE, NomicBERT...)."""
    for mapping in (MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_MASKED_LM_MAPPING):
        if type(config) in mapping:
            return mapping[type(config)]
    raise KeyError(f"{config.model_type}: no causal-LM or masked-LM class")


def tiny_config(model_type: str):
    config = CONFIG_MAPPING[model_type](**{**_SIZES, **_OVERRIDES.get(model_type, {})})
    config._attn_implementation = "eager"
    return config


def tiny_model(model_type: str, seed: int = 0) -> torch.nn.Module:
    config = tiny_config(model_type)
    torch.manual_seed(seed)
    model = model_class(config)(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or "norm" in name.lower():
                parameter.add_(torch.randn_like(parameter) * 0.1)
    return model
