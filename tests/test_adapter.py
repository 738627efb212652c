"""The adapter finds every attention block, right or with a clear error, never silently wrong."""

import pytest
import torch
import transformers as tf
from torch import nn

from headlab import HeadlabError, attention_blocks
from headlab.adapters import find_block, n_layers_per_kind
from support.models import FAMILIES, SEQ2SEQ, tiny_model

EXPECTED_KINDS = {
    "marian": ["enc_self", "enc_self", "dec_self", "dec_cross", "dec_self", "dec_cross"],
    "bart": ["enc_self", "enc_self", "dec_self", "dec_cross", "dec_self", "dec_cross"],
    "t5": ["enc_self", "enc_self", "dec_self", "dec_cross", "dec_self", "dec_cross"],
    "bert": ["enc_self"] * 2, "roberta": ["enc_self"] * 2, "distilbert": ["enc_self"] * 2,
    "gpt2": ["dec_self"] * 2, "llama": ["dec_self"] * 2, "qwen2": ["dec_self"] * 2,
}


@pytest.mark.parametrize("family", FAMILIES)
def test_blocks_in_forward_order(family):
    model = tiny_model(family)
    blocks = attention_blocks(model)
    assert [b.kind for b in blocks] == EXPECTED_KINDS[family]
    assert all(b.n_heads == 4 and b.d_head == 8 for b in blocks)
    expected_kv = 2 if family in ("llama", "qwen2") else 4
    assert all(b.n_kv_heads == expected_kv for b in blocks)
    # Forward order: the order in which the cores actually run.
    order = []
    handles = [b.core.register_forward_hook(lambda m, a, o, b=b: order.append(b.key)) for b in blocks]
    from support.models import tiny_inputs
    with torch.no_grad():
        model(**tiny_inputs(family))
    for handle in handles:
        handle.remove()
    assert order == [b.key for b in blocks]


def test_generic_discovery_matches_table():
    """A model type without a table entry is found by the generic path with the same answer."""
    from headlab.adapters import FAMILIES as TABLE

    model = tiny_model("marian")
    expected = [(b.kind, b.layer, b.name, b.n_heads) for b in attention_blocks(model)]
    saved = TABLE.pop("marian")
    try:
        found = [(b.kind, b.layer, b.name, b.n_heads) for b in attention_blocks(model)]
    finally:
        TABLE["marian"] = saved
    assert found == expected


def test_generic_discovery_beyond_the_table():
    """Families tried beyond the table: mBART-like m2m is in the table; these go through discovery."""
    config = tf.PegasusConfig(vocab_size=99, d_model=32, encoder_layers=1, decoder_layers=1,
                              encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=16,
                              decoder_ffn_dim=16, max_position_embeddings=32)
    model = tf.PegasusForConditionalGeneration(config)
    assert [b.kind for b in attention_blocks(model)] == ["enc_self", "dec_self", "dec_cross"]
    config = tf.ElectraConfig(vocab_size=99, embedding_size=16, hidden_size=32, num_hidden_layers=2,
                              num_attention_heads=4, intermediate_size=37)
    assert len(attention_blocks(tf.ElectraModel(config))) == 2


def test_model_without_attention_is_a_clear_error():
    with pytest.raises(HeadlabError, match="found no attention block"):
        attention_blocks(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))


def test_inconsistent_shapes_are_an_error_not_a_guess():
    model = tiny_model("marian")
    block = attention_blocks(model)[0]
    block.core.head_dim = 5  # 32 features do not split into heads of 5
    with pytest.raises(HeadlabError, match="do not split into heads of size 5"):
        attention_blocks(model)


def test_find_block_errors_name_what_exists():
    blocks = attention_blocks(tiny_model("gpt2"))
    with pytest.raises(HeadlabError, match="no enc_self attention"):
        find_block(blocks, "enc_self", 0)
    with pytest.raises(HeadlabError, match="no layer 7"):
        find_block(blocks, "dec_self", 7)
    with pytest.raises(HeadlabError, match="unknown attention kind"):
        find_block(blocks, "cross", 0)
    assert n_layers_per_kind(blocks) == {"dec_self": 2}


@pytest.mark.parametrize("family", sorted(SEQ2SEQ))
def test_seq2seq_has_three_kinds(family):
    assert n_layers_per_kind(attention_blocks(tiny_model(family))) == {"enc_self": 2, "dec_self": 2, "dec_cross": 2}
