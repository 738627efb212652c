"""RemBERT, RoFormer and XGLM: table families whose attention computes its own softmax (outside transformers'
attention interface; the generic path refused to prune them).

RemBERT is BERT's attention over layers wider than its embeddings; RoFormer is BERT's attention with rotary
positions applied per head to q and k (and v, with ``rotary_value``) inside its self-attention; XGLM is BART's
attention (q scaled before q k^T) in a pre-norm causal decoder that reshapes its merged heads to ``embed_dim``.
On each, in float64: pruning (a head, and a whole layer) equals masking, and so does the directory save_pruned
writes, loaded by load_pruned and by plain transformers (the portable pruned_heads.py); XGLM's cached generation
too; the LRP rules conserve relevance to 1e-10. The analysis and masking checks of the matrix
(tests/test_more_families.py) run on them too.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import transformers as tf

from headlab import attention_blocks
from support.family_matrix import check_lrp_conserves, perturbed_model, tiny_model
from support.table_families import (
    SPECS,
    check_captured_probabilities,
    check_compute_lrp_conserves,
    check_decoder_prunes_and_conserves,
    check_pruned_equals_masked,
    check_pruned_generates_and_reloads,
    check_pruned_reloads_as_masked,
    table_spec,
)

FAMILIES = ["rembert", "roformer", "xglm"]
ENCODERS = {"rembert", "roformer"}
LAYER = {"rembert": "rembert.encoder.layer.0", "roformer": "roformer.encoder.layer.0", "xglm": "model.layers.0"}


@pytest.fixture
def float64_default() -> Iterator[None]:
    """XGLMAttention clamps its masked logits with ``torch.full((), finfo(logits.dtype).min)``, built in torch's
    default dtype: float64's minimum overflows a float32 default (transformers 5.24 raises), so the float64 checks
    run with a float64 default."""
    with _default_dtype(torch.float64):
        yield


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _kind(family: str) -> str:
    return "enc_self" if family in ENCODERS else "dec_self"


def _rotary_value_roformer(**config) -> torch.nn.Module:
    return perturbed_model(tf.RoFormerForMaskedLM, tf.RoFormerConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
        max_position_embeddings=64, pad_token_id=2, rotary_value=True, **config), attn_implementation="eager")


@pytest.mark.parametrize("family", FAMILIES)
def test_blocks_are_the_tables(family):
    blocks = attention_blocks(tiny_model(family, attn_implementation="eager"))
    assert [(b.kind, b.layer, b.n_heads, b.d_head, b.family.name) for b in blocks] == \
        [(_kind(family), layer, 4, 8, "xglm" if family == "xglm" else "bert-like") for layer in (0, 1)]


@pytest.mark.parametrize("spec_name", SPECS)
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.usefixtures("float64_default")
def test_pruned_equals_masked_in_float64(family, spec_name):
    model = tiny_model(family, attn_implementation="eager").double()
    check_pruned_equals_masked(model, *table_spec(_kind(family), spec_name))


@pytest.mark.parametrize("spec_name", SPECS)
def test_roformer_with_rotary_values_pruned_equals_masked(spec_name):
    """With rotary_value the values are rotated too, per head and position: still each head's own."""
    spec, _ = table_spec("enc_self", spec_name)
    check_pruned_equals_masked(_rotary_value_roformer().double(), spec, None)


def test_roformer_with_rotary_values_conserves_in_float64():
    model = _rotary_value_roformer().double()
    check_lrp_conserves(model, model.roformer.encoder.layer[0], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("spec_name", SPECS)
def test_xglm_pruned_generates_as_masked_and_reloads(spec_name, tmp_path):
    """Cached greedy generation, save_pruned, load_pruned and plain transformers (pruned_heads.py)."""
    check_pruned_generates_and_reloads(tiny_model("xglm"), *table_spec("dec_self", spec_name), tmp_path)


@pytest.mark.parametrize("spec_name", SPECS)
@pytest.mark.parametrize("family", sorted(ENCODERS))
def test_encoder_pruned_reloads(family, spec_name, tmp_path):
    check_pruned_reloads_as_masked(tiny_model(family), *table_spec(_kind(family), spec_name), tmp_path)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.usefixtures("float64_default")
def test_lrp_conserves_in_float64(family):
    model = tiny_model(family, attn_implementation="eager").double()
    check_lrp_conserves(model, model.get_submodule(LAYER[family]), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.usefixtures("float64_default")
def test_compute_lrp_conserves_with_biases_and_padding(family):
    """compute_lrp (biases on, padded sentences) conserves every sentence's logit to 1e-9 in float64."""
    check_compute_lrp_conserves(tiny_model(family, attn_implementation="eager").double())


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.usefixtures("float64_default")
def test_captured_probabilities_are_the_models_own(family):
    """What capture reads equals transformers' own output_attentions (RoFormer's rotary positions included)."""
    check_captured_probabilities(tiny_model(family, attn_implementation="eager").double(), _kind(family), atol=1e-12)


@pytest.mark.parametrize("family", ["rembert", "roformer"])
def test_as_a_decoder_prunes_and_conserves(family):
    """RemBertForCausalLM / RoFormerForCausalLM with is_decoder: dec_self blocks (bert_like's decoder entry), pruned
    equal to masked in cached generation (a layer with no head left too), LRP conserving in float64."""
    common = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                  max_position_embeddings=64, pad_token_id=2, is_decoder=True)
    cls, config = {"rembert": (tf.RemBertForCausalLM, tf.RemBertConfig),
                   "roformer": (tf.RoFormerForCausalLM, tf.RoFormerConfig)}[family]
    check_decoder_prunes_and_conserves(lambda: perturbed_model(cls, config(**common), attn_implementation="eager"),
                                       LAYER[family])


def test_xglm_cross_attention_is_idle():
    """XGLM with add_cross_attention: its encoder_attn (fed encoder_hidden_states only) is listed idle, not tied."""
    model = perturbed_model(tf.XGLMForCausalLM, tf.XGLMConfig(
        vocab_size=99, d_model=32, num_layers=2, attention_heads=4, ffn_dim=37, max_position_embeddings=64,
        pad_token_id=2, add_cross_attention=True), attn_implementation="eager")
    blocks = attention_blocks(model)
    assert [(b.kind, b.layer, b.idle) for b in blocks if b.idle] == [("dec_cross", 0, True), ("dec_cross", 1, True)]
    assert [(b.kind, b.layer) for b in blocks if not b.idle] == [("dec_self", 0), ("dec_self", 1)]
