"""Tiny random models (hidden 32, 2 layers, 4 query heads of 8, vocab 99) of transformers v5
text families that headlab has no table entry for: found at run time (headlab.adapters.discovery).

``DISCOVERED[family]`` builds ``(model class, config)``; ``VALUE_ROWS[family]`` is ``(path of the
projection holding layer i's values, rows(kv_head) -> its value rows, key/value heads)``, read off
the modeling code by hand (not from headlab), for the zeroed-value reference of masking.
``TIED`` are the families whose query, key and value each come from one projection (discovery
names them: pruning and LRP allowed, verified); Persimmon's fused per-head ``query_key_value`` is
tied by its class's layout (``headlab.adapters.families.FUSED_ATTENTION_CLASSES``: pruned and
explained in tests/test_fused_codegen_persimmon_dbrx.py). ``ENCODERS`` have ``enc_self`` blocks.
"""

from __future__ import annotations

import torch
import transformers as tf

from support.family_matrix import perturbed_model
from support.models import VOCAB

D = 8
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=2, max_position_embeddings=64,
               bos_token_id=0, eos_token_id=1, pad_token_id=2)


def _gqa(**extra):
    """4 query heads over 2 key/value heads (groups of 2), head size 8."""
    return {**_COMMON, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": D, **extra}


DISCOVERED = {
    # Granite with these multipliers is Llama (tests/test_discovered_families.py compares the two)
    "granite": lambda: (tf.GraniteForCausalLM, tf.GraniteConfig(
        **_gqa(), attention_multiplier=D ** -0.5, embedding_multiplier=1.0, residual_multiplier=1.0,
        logits_scaling=1.0)),
    "cohere": lambda: (tf.CohereForCausalLM, tf.CohereConfig(**_gqa())),  # parallel attention and MLP
    "starcoder2": lambda: (tf.Starcoder2ForCausalLM, tf.Starcoder2Config(**_gqa(), use_bias=True)),
    "glm": lambda: (tf.GlmForCausalLM, tf.GlmConfig(**_gqa(), attention_bias=True)),  # partial rotary
    "exaone4": lambda: (tf.Exaone4ForCausalLM, tf.Exaone4Config(**_gqa())),  # q/k norms after the projections
    "persimmon": lambda: (tf.PersimmonForCausalLM, tf.PersimmonConfig(  # fused per-head query_key_value
        **{**_COMMON, "num_attention_heads": 4}, qk_layernorm=True)),
    # BERT-style, pre-layer-norm: the output projection (attention.output.dense) lies outside the
    # module that calls the attention function (attention.self)
    "roberta-prelayernorm": lambda: (tf.RobertaPreLayerNormForMaskedLM, tf.RobertaPreLayerNormConfig(
        **{**_COMMON, "num_attention_heads": 4, "max_position_embeddings": 70, "pad_token_id": 1})),
}
FAMILIES = tuple(DISCOVERED)
TIED = ("granite", "cohere", "starcoder2", "glm", "exaone4", "roberta-prelayernorm")
ENCODERS = ("roberta-prelayernorm",)


def _rows(j: int) -> range:
    return range(j * D, (j + 1) * D)


def _per_head(h: int) -> range:
    """Persimmon's view(batch, seq, heads, 3, d): [q_h | k_h | v_h] for each head h."""
    return range(3 * h * D + 2 * D, 3 * h * D + 3 * D)


VALUE_ROWS = {
    **{family: (lambda m, i: m.model.layers[i].self_attn.v_proj, _rows, 2) for family in TIED},
    "roberta-prelayernorm": (lambda m, i: m.roberta_prelayernorm.encoder.layer[i].attention.self.value, _rows, 4),
    "persimmon": (lambda m, i: m.model.layers[i].self_attn.query_key_value, _per_head, 4),
}


def tiny_model(family: str, seed: int = 0, attn_implementation: str = "sdpa") -> torch.nn.Module:
    cls, config = DISCOVERED[family]()
    return perturbed_model(cls, config, seed, attn_implementation)
