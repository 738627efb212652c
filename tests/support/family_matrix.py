"""The family matrix beyond tests/support/models.py: tiny random models (hidden 32, 2 layers,
4 heads of 8, vocab 99) built from configs, no downloads.

* ``ANALYSED`` (``ANALYSIS_FAMILIES``): the families headlab analyses and masks with layouts of
  their own (fused q/k/v projections, ALiBi, disentangled attention): GPT-NeoX, Phi-3, Phi-2,
  Falcon (grouped, multi-query, per head with ALiBi), GPT-BigCode (multi-query, per head), Bloom, MPT,
  DeBERTa-v2, ModernBERT, and the gated attention of Qwen3-Next, Qwen3.5 and Qwen3.5-MoE ([query |
  gate] per head). Each names, besides the model, how its value heads sit in the weights
  (``VALUES``), read off the modeling code by hand (not from headlab's adapter tables), so that the
  zeroed-value reference of tests/test_more_families.py is independent of what it checks:
  ``VALUES[family] = (module(model, layer), rows(kv_head) -> weight rows of that key/value head's
  values, n_kv_heads)``. Physical pruning of their fused layouts: tests/test_prune_fused.py.
* ``PRUNING`` (``PRUNING_FAMILIES``): families whose physical pruning needs care (partial rotary,
  per-head and whole-width query/key norms, grouped key/value heads, MoE feed-forward layers),
  used by tests/test_prune_verify.py.
* ``SHARED``: shared layers (ALBERT: one attention module run at several depths; a block is one
  depth), checked by tests/test_shared_layers.py.
* ``HYBRID``: attention beside other token mixers (LFM2's gated short convolutions), checked by
  tests/test_hybrid_families.py; Qwen3-Next's and Qwen3.5's Gated DeltaNet layers beside their gated
  attention, checked by tests/test_gated_attention.py.
* ``REFUSED``: families headlab refuses before any work.

:func:`tiny_model` builds any of them; biases (and, for ``PRUNING``, norm weights) are made
non-zero, so that slicing them is exercised.

The checks the family test files share (test_more_families.py, test_discovered_families.py,
test_shared_layers.py) follow at the end: ``check_*`` take a family's model (or its builder) and
its own references.
"""

from __future__ import annotations

import torch
import transformers as tf

from headlab.portable_code import install_tie_rule
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


def qwen3_next(model_type: str, layer_types: list[str]):
    """A tiny Qwen3-Next / Qwen3.5 / Qwen3.5-MoE (``model_type``) with these layer types (Gated
    DeltaNet layers at "linear_attention"), its attention's projections with biases."""
    cls, config_cls = {"qwen3_next": (tf.Qwen3NextForCausalLM, tf.Qwen3NextConfig),
                       "qwen3_5_text": (tf.Qwen3_5ForCausalLM, tf.Qwen3_5TextConfig),
                       "qwen3_5_moe_text": (tf.Qwen3_5MoeForCausalLM, tf.Qwen3_5MoeTextConfig)}[model_type]
    moe = dict(moe_intermediate_size=40, num_experts=3, num_experts_per_tok=2, shared_expert_intermediate_size=40)
    return cls, config_cls(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=len(layer_types),
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64, attention_bias=True,
        layer_types=layer_types, linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, **(moe if model_type != "qwen3_5_text" else {}), **_SPECIAL)


ANALYSED = {
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
    "mpt": lambda: (tf.MptForCausalLM, tf.MptConfig(  # ALiBi (built for 8 heads' slopes at most: 4 here)
        vocab_size=VOCAB, d_model=32, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=64, **_SPECIAL)),
    "deberta-v2": lambda: (tf.DebertaV2ForMaskedLM, tf.DebertaV2Config(  # DeBERTa-v3's relative attention
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
        max_position_embeddings=64, relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=8,
        max_relative_positions=16, share_att_key=True, norm_rel_ebd="layer_norm", pad_token_id=2)),
    "modernbert": lambda: (tf.ModernBertForMaskedLM, tf.ModernBertConfig(  # layer 1 local: 2 keys either side
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
        max_position_embeddings=64, global_attn_every_n_layers=2, local_attention=4, pad_token_id=2,
        bos_token_id=0, eos_token_id=1, cls_token_id=0, sep_token_id=1)),
    # GPT-Neo (TinyStories, GPT-Neo 125M): global attention at layer 0, a window of 3 keys at layer 1; no 1/sqrt(d)
    "gpt_neo": lambda: (tf.GPTNeoForCausalLM, tf.GPTNeoConfig(
        vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=37, max_position_embeddings=64,
        attention_types=[[["global", "local"], 1]], window_size=3, **_SPECIAL)),
    # Megatron-BERT: BERT's attention after a pre-norm (attention.ln), no norm in its output
    "megatron-bert": lambda: (tf.MegatronBertForMaskedLM, tf.MegatronBertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
        max_position_embeddings=64, pad_token_id=2)),
    # GIT: BERT's post-norm layers, causal over text; its CLIP image encoder (idle for token ids) at its smallest
    "git": lambda: (tf.GitForCausalLM, tf.GitConfig(
        vision_config=dict(hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=4,
                           image_size=16, patch_size=8),
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
        max_position_embeddings=64, **_SPECIAL)),
    # RemBERT: BERT's attention; its input embeddings (16) narrower than the layers, projected up
    "rembert": lambda: (tf.RemBertForMaskedLM, tf.RemBertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
        input_embedding_size=16, output_embedding_size=16, max_position_embeddings=64, **_SPECIAL)),
    # RoFormer: BERT's attention with rotary positions on q and k inside it; embeddings of 16 projected up
    "roformer": lambda: (tf.RoFormerForMaskedLM, tf.RoFormerConfig(
        vocab_size=VOCAB, hidden_size=32, embedding_size=16, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=37, max_position_embeddings=64, pad_token_id=2)),
    # XGLM: BART-style attention (q scaled before q k^T), pre-norm, sinusoidal positions, causal
    "xglm": lambda: (tf.XGLMForCausalLM, tf.XGLMConfig(
        vocab_size=VOCAB, d_model=32, num_layers=2, attention_heads=4, ffn_dim=37, max_position_embeddings=64,
        **_SPECIAL)),
    # MPNet: BERT-like post-norm layers, q/k/v/o inside its self-attention, a relative position bias (32 buckets x
    # heads) computed once in the encoder and added in every layer
    "mpnet": lambda: (tf.MPNetForMaskedLM, tf.MPNetConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
        max_position_embeddings=64, **_SPECIAL)),
    # I-BERT with quant_mode=False: BERT's layers of QuantLinear/IntLayerNorm/IntGELU/QuantAct, every module taking and
    # returning (value, scaling factor) pairs (tests/test_squeezebert_ibert.py)
    "ibert": lambda: (tf.IBertForMaskedLM, tf.IBertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
        max_position_embeddings=64, **_SPECIAL)),
    # OpenAI GPT (GPT-1): Conv1D c_attn [q | k | v], post-norm blocks, its own causal buffer
    "openai-gpt": lambda: (tf.OpenAIGPTLMHeadModel, tf.OpenAIGPTConfig(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, **_SPECIAL)),
    # LUKE: RoBERTa's post-norm layers over [words | entities] (headlab's text inputs give no entity: words only),
    # its own softmax outside the interface, entity-aware query projections beside query (tests/test_luke.py)
    "luke": lambda: (tf.LukeForMaskedLM, tf.LukeConfig(
        vocab_size=VOCAB, entity_vocab_size=20, entity_emb_size=8, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=37, max_position_embeddings=64, **_SPECIAL)),
    # TrOCR's text decoder (TrOCRForCausalLM): BART's old attention outside the interface, learned positions, an
    # embedding layer norm; its encoder_attn (is_decoder) never fed: idle
    "trocr": lambda: (tf.TrOCRForCausalLM, tf.TrOCRConfig(
        vocab_size=VOCAB, d_model=32, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=37,
        max_position_embeddings=64, **_SPECIAL)),
    # GPT-NeoX-Japanese: GPT-NeoX's per-head [q | k | v] in query_key_value, rotary on half of each head, outside the
    # interface; no bias but dense_bias, returned by the last layer's attention and added by the layer
    # (tests/test_gpt_neox_japanese_cpmant.py)
    "gpt_neox_japanese": lambda: (tf.GPTNeoXJapaneseForCausalLM, tf.GPTNeoXJapaneseConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_multiple_size=2,
        max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                     "partial_rotary_factor": 0.5}, **_SPECIAL)),
    # Qwen3-Next, Qwen3.5 and Qwen3.5-MoE with full attention at both layers (their hybrids: HYBRID):
    # q_proj emits per head [query | gate], o_proj(attn_output * sigmoid(gate)); biases on
    **{t: (lambda t=t: qwen3_next(t, ["full_attention"] * 2)) for t in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")},
}
ANALYSIS_FAMILIES = tuple(ANALYSED)
"""Families whose analysis and masking tests/test_more_families.py checks against references of its own."""

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
    "mpt": (lambda m, i: m.transformer.blocks[i].attn.Wqkv, _qkv(4, 4), 4),  # Wqkv(x).chunk(3)
    "modernbert": (lambda m, i: m.model.layers[i].attn.Wqkv, _qkv(4, 4), 4),  # view(..., 3, heads, d)
    "deberta-v2": (lambda m, i: m.deberta.encoder.layer[i].attention.self.value_proj,
                   lambda j: range(j * D, (j + 1) * D), 4),
    "gpt_neo": (lambda m, i: m.transformer.h[i].attn.attention.v_proj, lambda j: range(j * D, (j + 1) * D), 4),
    "megatron-bert": (lambda m, i: m.bert.encoder.layer[i].attention.self.value, lambda j: range(j * D, (j + 1) * D), 4),
    "git": (lambda m, i: m.git.encoder.layer[i].attention.self.value, lambda j: range(j * D, (j + 1) * D), 4),
    "rembert": (lambda m, i: m.rembert.encoder.layer[i].attention.self.value, lambda j: range(j * D, (j + 1) * D), 4),
    "roformer": (lambda m, i: m.roformer.encoder.layer[i].attention.self.value, lambda j: range(j * D, (j + 1) * D),
                 4),
    "xglm": (lambda m, i: m.model.layers[i].self_attn.v_proj, lambda j: range(j * D, (j + 1) * D), 4),
    "mpnet": (lambda m, i: m.mpnet.encoder.layer[i].attention.attn.v, lambda j: range(j * D, (j + 1) * D), 4),
    "ibert": (lambda m, i: m.ibert.encoder.layer[i].attention.self.value, lambda j: range(j * D, (j + 1) * D), 4),
    "openai-gpt": (lambda m, i: m.transformer.h[i].attn.c_attn, _qkv(4, 4), 4),  # c_attn(x).split(split_size)
    "luke": (lambda m, i: m.luke.encoder.layer[i].attention.self.value, lambda j: range(j * D, (j + 1) * D), 4),
    "trocr": (lambda m, i: m.model.decoder.layers[i].self_attn.v_proj, lambda j: range(j * D, (j + 1) * D), 4),
    "gpt_neox_japanese": (lambda m, i: m.gpt_neox_japanese.layers[i].attention.query_key_value, _per_head, 4),
    **dict.fromkeys(("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"),
                    (lambda m, i: m.model.layers[i].self_attn.v_proj, lambda j: range(j * D, (j + 1) * D), 2)),
}
ENCODERS = {"modernbert", "deberta-v2", "megatron-bert", "rembert", "roformer", "mpnet", "ibert", "luke"}

# Families headlab refuses, before any work.
REFUSED = {
    # DeBERTa (v1) with talking heads (its heads mixed); without them a table family (tests/test_deberta_ibert_convbert.py)
    "deberta": lambda: (tf.DebertaForMaskedLM, tf.DebertaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
        max_position_embeddings=64, talking_head=True)),
    "whisper": lambda: (tf.WhisperForConditionalGeneration, tf.WhisperConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=37, decoder_ffn_dim=37, num_mel_bins=8,
        max_source_positions=16, max_target_positions=32, pad_token_id=2, bos_token_id=0, eos_token_id=1,
        decoder_start_token_id=0)),
}


def _albert(**extra):
    return lambda: (tf.AlbertForMaskedLM, tf.AlbertConfig(
        vocab_size=VOCAB, embedding_size=16, hidden_size=32, num_attention_heads=4, intermediate_size=37,
        max_position_embeddings=64, pad_token_id=2, bos_token_id=0, eos_token_id=1, **extra))


SHARED = {
    "albert": _albert(num_hidden_layers=3),  # one module at depths 0, 1, 2
    # two groups of two layers each, over 4 depths: groups 0, 0, 1, 1, each running its 2 layers (8 maps)
    "albert-groups": _albert(num_hidden_layers=4, num_hidden_groups=2, inner_group_num=2),
}
"""Shared layers: ``(depth -> (group, layer in group))`` as transformers' AlbertTransformer runs them."""


HYBRID = {
    # attention at layers 1 and 3, gated short convolutions at 0 and 2
    "lfm2": lambda: (tf.Lfm2ForCausalLM, tf.Lfm2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, layer_types=["conv", "full_attention"] * 2,
        **_SPECIAL)),
    # a Gated DeltaNet layer (linear attention, no heads) at 0, gated attention at 1
    **{f"{t}-hybrid": (lambda t=t: qwen3_next(t, ["linear_attention", "full_attention"]))
       for t in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")},
}


_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
               max_position_embeddings=64, bos_token_id=0, eos_token_id=1, pad_token_id=2)


def _gqa(**extra):
    """4 query heads over 2 key/value heads (groups of 2), head size 8."""
    return {**_COMMON, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, **extra}


PRUNING = {
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
    # q_norm and k_norm over the whole query and key projections (every head's features at once), as OLMo 2's:
    # pruning keeps both whole and selects the kept heads after the norm
    "olmo3": lambda: (tf.Olmo3ForCausalLM, tf.Olmo3Config(**_gqa())),
    "olmoe": lambda: (tf.OlmoeForCausalLM, tf.OlmoeConfig(**{**_gqa(), "intermediate_size": 40}, num_experts=4,
                                                          num_experts_per_tok=2)),
    "flex_olmo": lambda: (tf.FlexOlmoForCausalLM, tf.FlexOlmoConfig(**{**_gqa(), "intermediate_size": 40},
                                                                    num_experts=4, num_experts_per_tok=2)),
    "minimax_m2": lambda: (tf.MiniMaxM2ForCausalLM, tf.MiniMaxM2Config(**{**_gqa(), "intermediate_size": 40},
                                                                       num_local_experts=4, num_experts_per_tok=2)),
    # a LayerNorm (mean and variance) over the whole projection; no grouped-query attention
    "esmc": lambda: (tf.EsmcForMaskedLM, tf.EsmcConfig(**{**_gqa(), "num_key_value_heads": 4})),
    # its attention layer beside a Gated DeltaNet layer
    "olmo_hybrid": lambda: (tf.OlmoHybridForCausalLM, tf.OlmoHybridConfig(
        **_gqa(), layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
        linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)),
}
WHOLE_WIDTH_NORMS = ("olmo2", "olmo3", "olmoe", "flex_olmo", "minimax_m2", "esmc", "olmo_hybrid")
"""Families whose query/key norm spans the whole projection (tests/test_prune_verify.py)."""
PRUNING_FAMILIES = tuple(PRUNING)
"""Families whose physical pruning needs care, checked by tests/test_prune_verify.py."""
EAGER_ONLY = {"gemma2"}  # transformers refuses sdpa for Gemma2 (its logit soft-capping)


CONFIGS = {**ANALYSED, **PRUNING}
FAMILIES = ANALYSIS_FAMILIES + PRUNING_FAMILIES
"""Every family of the matrix that headlab supports."""


def perturbed_model(cls, config, seed: int = 0, attn_implementation: str = "sdpa") -> torch.nn.Module:
    """``cls(config)`` in eval mode from ``seed``, its biases and norm weights moved off their initial
    values (zeros and ones would hide a bias or norm that pruning or masking mishandles)."""
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                parameter.add_(torch.randn_like(parameter) * 0.1)
    install_tie_rule(model)  # as headlab runs it from its first block on (tied top-k keys: the lowest index)
    return model


def tiny_model(family: str, seed: int = 0, attn_implementation: str = "sdpa") -> torch.nn.Module:
    cls, config = {**CONFIGS, **SHARED, **HYBRID, **REFUSED}[family]()
    if family in EAGER_ONLY or (attn_implementation == "sdpa" and not cls._supports_sdpa):  # Bloom, DeBERTa-v2
        attn_implementation = "eager"
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if family in PRUNING:  # biases and norm weights moved off their initial values
                if name.endswith("bias") or "norm" in name:
                    parameter.add_(torch.randn_like(parameter) * 0.1)
            elif name.endswith("bias"):
                parameter.normal_(0, 0.1)
    install_tie_rule(model)
    return model


def tiny_inputs(batch: int = 2, length: int = 7, seed: int = 1, pad: bool = True) -> dict:
    """Random token ids; the second sequence has two padded positions at the end."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    if pad and batch > 1:
        mask[1, -2:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def padded_inputs(seed: int = 3, pad_id: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows of 7 random ids: one full, one padded on the right, one on the left (their
    padded positions set to ``pad_id`` when given), with the attention mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (3, 7), generator=g)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, -2:] = 0  # right padding
    mask[2, :3] = 0  # left padding
    if pad_id is not None:
        ids = ids.masked_fill(mask == 0, pad_id)
    return ids, mask


def padded_logits(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The logits of the positions the mask keeps."""
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits[mask.bool()]


def greedy_generation(model, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy cached generation on the rows moved to left padding: tokens and per-step scores."""
    left = torch.stack([torch.cat([r[~m.bool()], r[m.bool()]]) for r, m in zip(ids, mask)])
    left_mask = torch.stack([torch.cat([m[~m.bool()], m[m.bool()]]) for m in mask])
    with torch.no_grad():
        out = model.generate(input_ids=left, attention_mask=left_mask, max_new_tokens=4, do_sample=False,
                             output_scores=True, return_dict_in_generate=True, pad_token_id=2)
    return out.sequences, torch.stack(out.scores)


def check_pruned_generates_as_masked(model, spec: dict, heads_left: list[int], ids: torch.Tensor, mask: torch.Tensor,
                                     atol: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """Prunes ``model`` by ``spec``: the blocks keep ``heads_left`` heads, and the pruned model equals the
    masked one on the padded batch (logits of the kept positions) and in greedy cached generation (same
    tokens, scores within ``atol``). The masked model's logits and generated tokens back, for the
    caller's checks of the saved directory."""
    from headlab import attention_blocks, mask_heads, prune_heads

    with mask_heads(model, spec):
        expected = padded_logits(model, ids, mask)
        expected_tokens, expected_scores = greedy_generation(model, ids, mask)
    prune_heads(model, spec)  # checks itself against masking (padded probe, cached generation)
    counts = [b.n_heads for b in attention_blocks(model) if not b.idle]  # GIT's image encoder: idle
    assert counts == heads_left, f"{counts} heads left, expected {heads_left}"
    torch.testing.assert_close(padded_logits(model, ids, mask), expected, atol=atol, rtol=0)
    tokens, scores = greedy_generation(model, ids, mask)
    assert torch.equal(tokens, expected_tokens), f"generated {tokens.tolist()}, masked {expected_tokens.tolist()}"
    torch.testing.assert_close(scores, expected_scores, atol=atol, rtol=0)
    return expected, expected_tokens


def check_pruned_reloads(model, directory, heads_left: list[int], ids: torch.Tensor, mask: torch.Tensor,
                         expected: torch.Tensor, expected_tokens: torch.Tensor) -> dict:
    """Saves the pruned ``model`` to ``directory`` (portable by remote code), and checks that ``load_pruned``
    gives its logits and plain transformers (``trust_remote_code``, every weight loaded, none reshaped) the
    masked model's logits and generated tokens (:func:`check_pruned_generates_as_masked`'s). The record back."""
    import json

    import transformers as tf

    from headlab import attention_blocks, load_pruned, save_pruned

    save_pruned(model, directory)
    record = json.loads((directory / "headlab_pruning.json").read_text())
    assert record["portable"]["how"] == "remote code"
    reloaded = load_pruned(directory)
    assert [b.n_heads for b in attention_blocks(reloaded) if not b.idle] == heads_left
    assert torch.equal(padded_logits(reloaded, ids, mask), padded_logits(model, ids, mask))
    plain, info = tf.AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    plain.eval()
    torch.testing.assert_close(padded_logits(plain, ids, mask), expected, atol=1e-5, rtol=0)
    assert torch.equal(greedy_generation(plain, ids, mask)[0], expected_tokens)
    return record


# -- checks the family test files share (tests/test_more_families.py, test_discovered_families.py,
# test_shared_layers.py); each takes the model builder or model and the family's own references.

ANALYZE_STAGES = ("confidence", "gradient", "ablation", "agreement", "functions", "aggregate", "table", "attention",
                  "report")
"""The stages ``headlab analyze --ablation`` runs on every supported family (LRP besides, where it can)."""


def logits(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


def check_head_counts(model, kind: str, n_kv: int, n_layers: int = 2) -> list:
    """The blocks token ids run have the config's head counts (4 heads of 8, ``n_kv`` key/value heads); the blocks
    back (idle ones too: GIT's image encoder)."""
    from headlab import attention_blocks

    blocks = attention_blocks(model)
    assert [(b.kind, b.layer, b.n_heads, b.n_kv_heads, b.d_head) for b in blocks if not b.idle] == \
        [(kind, layer, 4, n_kv, 8) for layer in range(n_layers)]
    return blocks


def check_capture_equals_output_attentions(build, kind: str, inputs: dict, n_layers: int = 2):
    """capture_attention on ``build()`` (SDPA where the family has it) equals transformers' own
    ``output_attentions`` of ``build(attn_implementation="eager")``, map for map, and the model's
    implementation is restored; the model and the record back."""
    from headlab import capture_attention

    eager = build(attn_implementation="eager")
    with torch.no_grad():
        reference = eager(**inputs, output_attentions=True).attentions
    assert len(reference) == n_layers
    model = build()
    implementation = model.config._attn_implementation
    with capture_attention(model) as record:
        logits(model, inputs)
    assert sorted(record) == [(kind, layer) for layer in range(n_layers)]
    for (_, layer), probs in record.items():
        assert torch.equal(probs, reference[layer]), layer
    assert model.config._attn_implementation == implementation  # restored
    return model, record


SINK_LSE = "family_matrix_sink_lse"
_ROW_LSE: list = []  # (attention module, each row's log-sum-exp of its logits) per call of _lse_recording_eager


def _lse_recording_eager(module, query, key, value, attention_mask, **kwargs):
    """The module's own eager attention (its modeling module's eager_attention_forward), its output untouched, and
    each row's log-sum-exp of the logits it is handed, recorded in float64 (keys repeated over their query heads)."""
    import sys

    output = sys.modules[type(module).__module__].eager_attention_forward(
        module, query, key, value, attention_mask, **kwargs)
    keys = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    scores = query.double() @ keys.double().transpose(2, 3) * kwargs["scaling"]
    if attention_mask is not None:
        scores = scores.masked_fill(~attention_mask, float("-inf")) if attention_mask.dtype == torch.bool \
            else scores + attention_mask.double()
    _ROW_LSE.append((module, torch.logsumexp(scores, dim=-1)))
    return output


def attentions_applied_to_values(model, inputs: dict) -> tuple[tuple, set[int]]:
    """transformers' own eager ``output_attentions`` of a decoder-only ``model`` (eager), with the map of each
    attention module that has learned sinks and whose rows sum to 1 (Granite-SWA, GraniteMoE-SWA: the softmax
    before the sink, the head's output scaled after) replaced by the weights its values get, with the sink one
    more logit of the softmax (transformers 5.24, granite_swa eager_attention_forward's comment):
    ``exp(s_ij) / (sum_j exp(s_ij) + exp(sink_h)) = p_ij / (1 + exp(sink_h - lse_i))``, ``p`` the map,
    ``lse_i`` the row's log-sum-exp of its logits ``s``, recomputed from the query and key eager is handed. Read
    from the model alone, never from headlab's capture. Maps whose rows sum to less than 1 (GPT-OSS: the sink's
    column dropped after the softmax) are already those weights, and are returned as they are. Also the indices of
    the maps replaced: worked out in float64, against the model's own weights good to float32's precision (1e-6),
    Granite-SWA's eager taking its softmax and sink scale in float32 whatever the model's dtype."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(SINK_LSE, _lse_recording_eager)
    AttentionMaskInterface.register(SINK_LSE, eager_mask)
    configs = {id(m.config): m.config for m in model.modules() if hasattr(getattr(m, "config", None),
                                                                           "_attn_implementation")}.values()
    previous = [config._attn_implementation for config in configs]
    assert set(previous) == {"eager"}, previous
    _ROW_LSE.clear()
    try:
        for config in configs:
            config._attn_implementation = SINK_LSE
        with torch.no_grad():
            maps = model(**inputs, output_attentions=True, use_cache=False).attentions
    finally:
        for config, name in zip(configs, previous):
            config._attn_implementation = name
    calls = list(_ROW_LSE)
    _ROW_LSE.clear()
    present = [i for i, m in enumerate(maps) if m is not None]
    assert len(calls) == len(present), (len(calls), len(present))  # one call per map, in layer order
    applied, derived = list(maps), set()
    for i, (module, lse) in zip(present, calls):
        sinks = getattr(module, "sinks", None)
        rows = maps[i][0].double().sum(-1)  # the first row of the batch, unpadded
        atol = max(1e-5, 4 * torch.finfo(maps[i].dtype).eps)  # bfloat16's weights, each rounded: a row off 1 by 2^-8
        if sinks is None or not torch.allclose(rows, torch.ones_like(rows), atol=atol, rtol=0):
            continue
        share = 1 / (1 + torch.exp(sinks.detach().double().view(1, -1, 1) - lse))
        applied[i] = (maps[i].double() * share.unsqueeze(-1)).to(maps[i].dtype)
        derived.add(i)
    return tuple(applied), derived


def check_streamed_chunks_equal_capture(model, inputs: dict, record) -> torch.Tensor:
    """stream_attention's chunks, put together, equal the captured maps ``record``; the logits back."""
    from headlab.capture import stream_attention

    chunks: dict = {}
    with stream_attention(model, lambda block, chunk: chunks.setdefault(block.key, []).append(chunk), query_chunk=3):
        out = logits(model, inputs)
    for key, probs in record.items():
        torch.testing.assert_close(torch.cat([c.full() for c in chunks[key]], 2), probs.float(), atol=1e-6, rtol=0)
    return out


def check_confidence_on_every_engine(model, data, info, rtol: float = 1e-6):
    """compute_confidence under the fused (default) and chunked engines, and the default with query chunks of 3, equal
    to eager's on every kind, within ``rtol`` (atol 1e-12); eager's scores back."""
    import numpy as np

    from headlab.importance import compute_confidence

    eager = compute_confidence(model, data, info, batch_size=2, engine="eager")
    for engine, query_chunk in (("fused", None), ("chunked", 2), (None, 3)):
        streamed = compute_confidence(model, data, info, batch_size=2, engine=engine, query_chunk=query_chunk)
        for kind in eager.kinds:
            np.testing.assert_allclose(streamed[kind], eager[kind], rtol=rtol, atol=1e-12)
    return eager


def zero_values(model, values, layer: int, kv_head: int) -> None:
    """Zero key/value head ``kv_head``'s value weights and biases in place (``values``: the family's
    ``(module(model, layer), rows(kv_head), n_kv_heads)``, read off the modeling code): its heads then output 0."""
    from transformers.pytorch_utils import Conv1D

    module_of, rows, _ = values
    module = module_of(model, layer)
    index = torch.tensor(list(rows(kv_head)))
    with torch.no_grad():
        if isinstance(module, Conv1D):  # GPT-1's c_attn: weight [in, out], an output is a column
            module.weight[:, index] = 0
        else:
            module.weight[index] = 0
        if module.bias is not None:
            module.bias[index] = 0


def check_masking_equals_zeroed_values(build, kind: str, values, inputs: dict) -> None:
    """Masking every query head of layer 1 that reads key/value head j equals zeroing j's values by hand."""
    from headlab import mask_heads

    n_kv = values[2]
    group = 4 // n_kv
    for kv_head in range(n_kv):
        model = build()
        before = logits(model, inputs)
        heads = list(range(kv_head * group, (kv_head + 1) * group))
        with mask_heads(model, {(kind, 1): heads}):
            masked = logits(model, inputs)
        assert torch.equal(logits(model, inputs), before)  # the mask came off
        zero_values(model, values, 1, kv_head)
        reference = logits(model, inputs)
        assert not torch.allclose(reference, before)
        torch.testing.assert_close(masked, reference, atol=1e-6, rtol=0)


def check_gates_at_one_change_nothing(model, inputs: dict) -> None:
    """Scalar gates at one leave the logits as they are, and their hooks come off."""
    from headlab import ScalarGates, gates_attached

    before = logits(model, inputs)
    with gates_attached(model, ScalarGates.for_model(model)):
        assert torch.equal(logits(model, inputs), before)
    for module in model.modules():
        assert not module._forward_pre_hooks and not module._forward_hooks, module


def check_gates_draw_once_per_call(model, inputs: dict) -> None:
    """In training, each Hard Concrete gate is drawn once per call of its attention (a family whose output projection
    runs several times per call, ``Family.output_calls``: PEGASUS-X's global tokens and tokens, ProphetNet's streams,
    takes that one sample in every run), and some draw is not all ones: the pass equals one with constant gates at
    the drawn values. ``model``: built without dropout."""
    from headlab import ConstantGates, attention_blocks, gates_attached
    from headlab.pruning import HardConcreteGates

    gates = HardConcreteGates.for_model(model)
    drawn: dict = {}
    own = gates.gate

    def recorded(key):
        value = own(key)
        drawn.setdefault(key, []).append(value.detach().clone())
        return value

    gates.gate = recorded
    torch.manual_seed(5)
    with gates_attached(model, gates):
        model.train()
        with torch.no_grad():
            trained = logits(model, inputs)
        model.eval()
    assert {key: len(values) for key, values in drawn.items()} == {b.key: 1 for b in attention_blocks(model)}
    assert any(bool(((v[0] > 0) & (v[0] < 1)).any() or (v[0] == 0).any()) for v in drawn.values())  # not all ones
    with gates_attached(model, ConstantGates({key: values[0] for key, values in drawn.items()})):
        torch.testing.assert_close(logits(model, inputs), trained, atol=1e-12, rtol=0)


def check_pruning_equals_masking(model, kind: str, inputs: dict, atol: float = 1e-6) -> None:
    """Head 1 of layer 0 and heads 0 and 2 of layer 1 pruned: the logits of the masked model."""
    from headlab import attention_blocks, mask_heads, prune_heads

    spec = {(kind, 0): [1], (kind, 1): [0, 2]}
    with mask_heads(model, spec):
        masked = logits(model, inputs)
    prune_heads(model, spec)
    assert [b.n_heads for b in attention_blocks(model) if not b.idle] == [3, 2]
    torch.testing.assert_close(logits(model, inputs), masked, atol=atol, rtol=0)


def check_lrp_conserves(model, first_layer: torch.nn.Module, unit_gain: bool = True, rtol: float = 1e-4,
                        atol: float = 1e-5) -> int:
    """On a bias-free copy (``unit_gain``: Linear weights redrawn at unit gain, so that no branch is
    too small to count) the LRP rules conserve relevance exactly (importance/rules.py): what reaches
    ``first_layer``'s input sums to the explained logit ``z``, the LM head's output (what
    compute_lrp explains). With final logit soft-capping (``y = cap * tanh(z / cap)``: Gemma 2,
    Beam) the capped logit's relevance is checked too: the chain rule scales every share of ``z`` by
    ``dy/dz = 1 - tanh(z / cap) ** 2``, so it sums to ``z * (1 - tanh(z / cap) ** 2)``, neither ``z``
    nor ``y``. An LM head that never calls its output layer (MobileBERT's multiplies the weights itself)
    explains the logit. ``rtol``/``atol``: the tolerance (1e-12 in float64 shows a rule that is only
    close). A model with per-layer inputs (Gemma 3n, Gemma 4) sends relevance to its per-layer token embeddings
    too, an input of their own: theirs is added (what compute_lrp counts as input relevance). Gemma 3n's relevance
    is measured at its input embeddings (the input of per_layer_model_projection), from which the AltUp streams that
    ``first_layer`` reads are made. The number of calls of ``first_layer`` (or that cut) back."""
    from headlab.capture import eager_attention
    from headlab.importance.rules import altup_inputs, lrp_rules, per_layer_embeddings

    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.zero_()
        if unit_gain:
            for module in model.modules():
                if isinstance(module, torch.nn.Linear):
                    module.weight.normal_(0, module.in_features ** -0.5)
    seen: list[torch.Tensor] = []
    heads: list[torch.Tensor] = []
    per_layer: list[torch.Tensor] = []
    handles = []
    cap = getattr(model.config, "final_logit_softcapping", None)
    try:
        with torch.enable_grad(), eager_attention(model), lrp_rules(model):
            # Recorded from here only: entering lrp_rules reads the blocks, which on a model whose blocks were
            # never read runs discovery's probe forward (under no_grad): its first call is not the one explained.
            # Gemma 3n: its input embeddings, which its AltUp streams (the first layer's input) are made from
            cut = next(iter(altup_inputs(model)), first_layer)
            handles = [cut.register_forward_pre_hook(
                lambda module, args, kwargs: seen.append(args[0] if args else kwargs["hidden_states"]),
                with_kwargs=True),
                model.get_output_embeddings().register_forward_hook(lambda module, args, output: heads.append(output))]
            handles += [embedding.register_forward_hook(lambda module, args, output: per_layer.append(output))
                        for embedding in per_layer_embeddings(model)]
            out = model(**tiny_inputs(batch=1)).logits
            target = out[0, -1].argmax()
            z = heads[0][0, -1, target] if heads else out[0, -1, target]
            grad, *at_per_layer = torch.autograd.grad(z, [seen[0], *per_layer], retain_graph=bool(cap))
            capped, *capped_per_layer = torch.autograd.grad(out[0, -1, target], [seen[0], *per_layer]) if cap \
                else (None,)
    finally:
        for handle in handles:
            handle.remove()
    total = (seen[0].detach() * grad).sum() + sum((e.detach() * g).sum() for e, g in zip(per_layer, at_per_layer))
    torch.testing.assert_close(total, z.detach(), rtol=rtol, atol=atol)
    if cap:
        z = z.detach().double()
        torch.testing.assert_close((seen[0].detach() * capped).sum().double() + sum(
                                       (e.detach() * g).sum().double() for e, g in zip(per_layer, capped_per_layer)),
                                   z * (1 - torch.tanh(z / cap) ** 2), rtol=1e-4, atol=1e-5)
    return len(seen)


def save_tiny(model, path, words, style: str = "gpt2") -> None:
    """``model`` and a word tokenizer of ``words`` saved to ``path``, the config's special ids the tokenizer's."""
    from support.treebank import word_tokenizer

    tokenizer = word_tokenizer(list(words), style=style)
    for name in ("pad", "bos", "eos", "cls", "sep"):
        if getattr(model.config, f"{name}_token_id", None) is not None:
            setattr(model.config, f"{name}_token_id", getattr(tokenizer, f"{name}_token_id", None) or 0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def treebank_files(tmp_path) -> list[str]:
    """text.txt (the sample treebank's sentences) and tb.conllu in ``tmp_path``; their words back."""
    from support.treebank import SAMPLE_CONLLU

    texts = [line[len("# text = "):] for line in SAMPLE_CONLLU.splitlines() if line.startswith("# text = ")]
    words = [w for text in texts for w in text.split()]
    words += [line.split("\t")[1] for line in SAMPLE_CONLLU.splitlines() if line and line[0].isdigit()]
    (tmp_path / "text.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
    (tmp_path / "tb.conllu").write_text(SAMPLE_CONLLU, encoding="utf-8")
    return words


def analyze(model_dir, tmp_path, *extra: str) -> tuple[int, dict]:
    """``headlab analyze`` with every stage but the figures on the files of :func:`treebank_files` (and the options
    ``extra``): the exit code and the manifest's stages by name."""
    import json

    from headlab.cli import main

    out = tmp_path / "out"
    code = main(["analyze", str(model_dir), "--source", str(tmp_path / "text.txt"), "--conllu",
                 str(tmp_path / "tb.conllu"), "--out", str(out), "--skip", "figures", "--no-progress",
                 "--attention-sentences", "2", "--ablation", *extra])
    return code, {s["name"]: s for s in json.loads((out / "manifest.json").read_text())["stages"]}
