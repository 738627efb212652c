"""A discovered layer pruned to no head keeps its place among the blocks (session 28, vanish28).

Its stand-in (:class:`headlab.surgery.ZeroHeadAttention`) calls no attention function, so the probe forward that
finds a discovered model's blocks cannot see it. Where the name-based schemes did not know its projections either
(CTRL's ``Wq``/``Wk``/``Wv``/``dense``, ModernBERT-decoder's ``Wo``), the layer silently left the block list: the
pruning record lost its entry, tables their row, and a second pruning mapped heads to the wrong layers. A BERT-style
layer (the stand-in at ``attention.self``, the output projection outside it) was refused as an attention that does
not call the interface. Now each is listed with its original number and no head, before and after save/load.

Tiny models built from their configs (hidden 32, 2 layers, 4 heads of 8, vocab 99); no download.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from headlab import HeadlabError, attention_blocks, load_pruned, prune_heads, save_pruned
from support.discovered import tiny_model as discovered_model
from support.family_matrix import perturbed_model

_SIZES = dict(vocab_size=99, bos_token_id=0, eos_token_id=1, pad_token_id=2)

AFFECTED = {
    "ctrl": lambda: perturbed_model(tf.CTRLLMHeadModel, tf.CTRLConfig(
        **_SIZES, n_embd=32, n_layer=2, n_head=4, dff=37, n_positions=64), attn_implementation="eager"),
    "modernbert-decoder": lambda: perturbed_model(tf.ModernBertDecoderForCausalLM, tf.ModernBertDecoderConfig(
        **_SIZES, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, global_attn_every_n_layers=1), attn_implementation="eager"),
    "roberta-prelayernorm": lambda: discovered_model("roberta-prelayernorm", attn_implementation="eager"),
}


def _layout(model) -> list[tuple[str, int, int]]:
    return [(b.kind, b.layer, b.n_heads) for b in attention_blocks(model)]


@pytest.mark.parametrize("family", AFFECTED)
@pytest.mark.parametrize("emptied", [0, 1])
def test_a_discovered_layer_pruned_to_no_head_keeps_its_number(family, emptied, tmp_path):
    model = AFFECTED[family]()
    before = _layout(model)
    assert [layer for _, layer, _ in before] == [0, 1] and all(b.family.name.startswith("discovered:")
                                                               for b in attention_blocks(model))
    kind = before[0][0]
    prune_heads(model, {(kind, emptied): [0, 1, 2, 3], (kind, 1 - emptied): [2]})
    expected = [(kind, layer, 0 if layer == emptied else 3) for layer in (0, 1)]
    assert _layout(model) == expected

    save_pruned(model, tmp_path / "pruned")
    loaded = load_pruned(tmp_path / "pruned")
    assert _layout(loaded) == expected
    ids = torch.tensor([[3, 5, 7, 9, 11]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5, rtol=0)
    # a second pruning of the saved model names the heads of the layer it meant (original numbering: 0, 1, 3 kept)
    prune_heads(loaded, {(kind, 1 - emptied): [0]})
    assert _layout(loaded) == [(kind, layer, 0 if layer == emptied else 2) for layer in (0, 1)]


@pytest.mark.parametrize("family", AFFECTED)
def test_loaded_by_transformers_alone_the_emptied_layer_is_refused_not_left_out(family, tmp_path):
    """Through the directory's pruned_heads.py the stand-in knows no original numbering: refused, naming the loader
    that does, not left out of the blocks; the model computes what the pruned one does."""
    model = AFFECTED[family]()
    kind = attention_blocks(model)[0].kind
    prune_heads(model, {(kind, 0): [0, 1, 2, 3]})
    save_pruned(model, tmp_path)
    auto = tf.AutoModelForMaskedLM if family == "roberta-prelayernorm" else tf.AutoModelForCausalLM
    plain = auto.from_pretrained(tmp_path, trust_remote_code=True, attn_implementation="eager").eval()
    ids = torch.tensor([[3, 5, 7, 9, 11]])
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5, rtol=0)
    with pytest.raises(HeadlabError, match=r"\.0\.\S* \(discovered:.*loaded without headlab; load the pruned "
                                           r"directory with headlab.load_pruned"):
        attention_blocks(plain)


@pytest.mark.parametrize("family", ["granite", "ctrl"])
def test_every_layer_of_a_discovered_model_pruned_to_no_head_keeps_them_all(family, tmp_path):
    """No module calls the attention interface any more (a hybrid's only attention layer, or all of them): the
    stand-ins are the blocks. Before, pruning was refused, the stand-in taken for an attention that returns no
    weights (granite), or the model had no block at all (CTRL)."""
    model = AFFECTED[family]() if family in AFFECTED else discovered_model(family, attn_implementation="eager")
    kind = attention_blocks(model)[0].kind
    prune_heads(model, {(kind, 0): [0, 1, 2, 3], (kind, 1): [0, 1, 2, 3]})
    assert _layout(model) == [(kind, 0, 0), (kind, 1, 0)]
    save_pruned(model, tmp_path)
    loaded = load_pruned(tmp_path)
    assert _layout(loaded) == [(kind, 0, 0), (kind, 1, 0)]
    ids = torch.tensor([[3, 5, 7, 9, 11]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5, rtol=0)


def test_emptying_a_gemma4_layer_that_stores_shared_keys_and_values_is_refused_before_any_work():
    """Gemma 4's layers store their keys and values for the layers that reuse them (``store_full_length_kv``); the
    stand-in stores Mistral Large 4's latents only: before, it crashed building (no ``kv_lora_rank``)."""
    config = tf.Gemma4TextConfig(
        **_SIZES, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, layer_types=["sliding_attention",
                                                                                  "full_attention"],
        sliding_window=4, global_head_dim=8, hidden_size_per_layer_input=8, vocab_size_per_layer_input=99)
    model = perturbed_model(tf.Gemma4ForCausalLM, config, attn_implementation="eager")
    assert model.model.layers[0].self_attn.store_full_length_kv is True
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(HeadlabError, match=r"dec_self:0 \(model.layers.0.self_attn, Gemma4TextAttention\): removing "
                                           r"every head of a layer that stores its keys and values"):
        prune_heads(model, {("dec_self", 0): [0, 1, 2, 3]})
    assert _layout(model) == [("dec_self", 0, 4), ("dec_self", 1, 4)]
    assert all(torch.equal(state[name], tensor) for name, tensor in model.state_dict().items())
