"""Multimodal wrappers whose language model's attention is a tabled family's fused one (session 28, fused28).

ModernVBERT's text encoder is a ModernBERT (``AutoModel.from_config(text_config)``: ``ModernBertAttention``, one
``Wqkv``) and Phi-4-multimodal's language model is Phi-3's (``Phi4MultimodalAttention``: Phi3Attention copied line
for line, one ``qkv_proj`` split at ``config.num_attention_heads * head_dim``). headlab knows both layouts from its
family table (``modernbert``, ``phi3``), but the wrappers have no entry of their own: run-time discovery found their
blocks, tied no projection to the queries, keys and values (one fused projection feeds all three), and physical
pruning and LRP were refused ("this family's projection layout is unknown", "its query and key projections are
unknown"). Now a discovered block of such a class takes the table's layout
(``headlab.adapters.families.FUSED_ATTENTION_CLASSES``): pruning passes headlab's own check, equals masking and
slices what the text model alone pruned slices; a layer pruned to no head stays a block; LRP conserves relevance and
equals the text model's alone, with the same weights. The towers stay idle, numbered after the text's blocks.

Tiny models built from their configs, no download.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as tf

from headlab import attention_blocks, mask_heads, prune_heads
from headlab.adapters.families import FAMILIES
from headlab.model_description import describe_model
from support.family_matrix import check_lrp_conserves
from test_tower_numbering import _TEXT, _batch, _text_alone, modernvbert, phi4_multimodal


def _phi3_alone(wrapper: torch.nn.Module) -> torch.nn.Module:
    """Phi-4-multimodal's language model as a Phi3ForCausalLM with the wrapper's weights (all but the towers')."""
    config = tf.Phi3Config(**_TEXT)
    config._attn_implementation = wrapper.config._attn_implementation
    text = tf.Phi3ForCausalLM(config).to(wrapper.dtype).eval()
    text.load_state_dict({k: v for k, v in wrapper.state_dict().items()
                          if not k.startswith("model.embed_tokens_extend.")}, strict=True)
    return text


def _sdpa(build):
    """The wrapper in float64 with SDPA: eager attention in float64 gives a row padded on the left NaN (its mask's
    float64 lowest value, -inf in the float32 softmax), which pruning's check refuses to compare."""
    def built() -> torch.nn.Module:
        model = build()
        model.set_attn_implementation("sdpa")
        return model
    return built


# builder, the text model alone, its kind, the table entry, the fused projection, the text model's first layer
WRAPPERS = {
    "modernvbert": (_sdpa(modernvbert), _text_alone, "enc_self", "modernbert", "Wqkv",
                    lambda m: m.model.text_model.layers[0]),
    "phi4_multimodal": (_sdpa(phi4_multimodal), _phi3_alone, "dec_self", "phi3", "qkv_proj",
                        lambda m: m.model.layers[0]),
}


def _text_blocks(model: torch.nn.Module) -> list:
    return [b for b in attention_blocks(model) if not b.idle]


def _logits(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch).logits


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_the_text_blocks_take_the_tables_fused_layout(wrapper):
    """Before: no projection tied (qkv None), and the towers' blocks idle; the towers' stay so."""
    build, alone, kind, entry, fused, _ = WRAPPERS[wrapper]
    model = build()
    blocks = _text_blocks(model)
    want = attention_blocks(alone(model))
    assert [b.key for b in blocks] == [b.key for b in want] == [(kind, 0), (kind, 1)]
    table = FAMILIES[entry]
    for block, reference in zip(blocks, want):
        assert block.qkv is block.module.get_submodule(fused) and block.q is None
        assert block.family.name == f"discovered:{wrapper}" and reference.family.name == table.name
        for field in ("qkv", "qkv_layout", "o", "config_head_count_attrs", "kv_groups_attr", "head_count_attrs"):
            assert getattr(block.family, field) == getattr(table, field), field
        assert (block.n_heads, block.n_kv_heads, block.d_head) == (reference.n_heads, reference.n_kv_heads,
                                                                   reference.d_head)
        for got, expected in zip(block.qkv_columns(), reference.qkv_columns()):
            assert torch.equal(got, expected)
    assert any(b.idle for b in attention_blocks(model))  # the towers, still listed


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_pruning_equals_masking_and_the_text_model_alone_pruned(wrapper):
    """Before: refused ("this family's projection layout is unknown"). prune_heads checks itself against masking on
    its padded probe; the pruned wrapper gives the masked one's logits, and its fused projections are what the text
    model alone (a table family) keeps, to the bit."""
    build, alone, kind, _, fused, _ = WRAPPERS[wrapper]
    model, batch = build(), _batch()
    text = alone(model)
    spec = {(kind, 0): [1], (kind, 1): [0, 2]}
    with mask_heads(model, spec):
        masked = _logits(model, batch)
    assert not torch.equal(masked, _logits(model, batch))
    prune_heads(model, spec)
    prune_heads(text, spec)
    assert [b.n_heads for b in _text_blocks(model)] == [3, 2]
    torch.testing.assert_close(_logits(model, batch), masked, rtol=0, atol=1e-12)
    torch.testing.assert_close(_logits(model, batch), _logits(text, batch), rtol=0, atol=1e-12)
    for block, reference in zip(_text_blocks(model), attention_blocks(text)):
        assert torch.equal(block.module.get_submodule(fused).weight, reference.module.get_submodule(fused).weight)
        assert (block.n_heads, block.n_kv_heads) == (reference.n_heads, reference.n_kv_heads)


def test_a_pruned_phi4_layer_reads_its_own_head_count():
    """Phi-3's forward splits the fused projection at config.num_attention_heads * head_dim, the config every layer
    shares: the pruned layer gets its own view (the table's config_head_count_attrs), the other keeps the model's."""
    from headlab.portable_code import LayerConfig

    model = WRAPPERS["phi4_multimodal"][0]()
    prune_heads(model, {("dec_self", 0): [1]})
    first, second = _text_blocks(model)
    assert isinstance(first.core.config, LayerConfig) and first.core.config.num_attention_heads == 3
    assert second.core.config is model.config and model.config.num_attention_heads == 4


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_a_layer_pruned_to_no_head_stays_a_block(wrapper, tmp_path):
    """A layer with no head left is a stand-in that calls no attention function and has no projection discovery
    knows: it stays the text model's layer 0 (with no head), equal to masking all its heads, saved and loaded back.
    Loaded by plain transformers (the stand-in records no layout), it is refused naming headlab's loader (before,
    it vanished from the blocks and ModernVBERT's tower took its number)."""
    from headlab import HeadlabError, load_pruned, save_pruned

    build, _, kind, _, _, _ = WRAPPERS[wrapper]
    model, batch = build(), _batch()
    spec = {(kind, 0): [0, 1, 2, 3], (kind, 1): [2]}
    with mask_heads(model, spec):
        masked = _logits(model, batch)
    prune_heads(model, spec)
    assert [(b.key, b.n_heads) for b in _text_blocks(model)] == [((kind, 0), 0), ((kind, 1), 3)]
    assert [b.layer for b in attention_blocks(model) if b.idle][0] == 2  # the towers still after the text's
    torch.testing.assert_close(_logits(model, batch), masked, rtol=0, atol=1e-12)
    save_pruned(model, tmp_path)
    loaded = load_pruned(tmp_path).to(torch.float64)
    assert [(b.key, b.n_heads) for b in _text_blocks(loaded)] == [((kind, 0), 0), ((kind, 1), 3)]
    torch.testing.assert_close(_logits(loaded, batch), masked, rtol=0, atol=1e-12)
    auto = tf.AutoModelForMaskedLM if kind == "enc_self" else tf.AutoModelForCausalLM
    plain = auto.from_pretrained(tmp_path, trust_remote_code=True)
    with pytest.raises(HeadlabError, match=r"layers\.0\.[a-z_]*attn \(discovered:[a-z0-9_]*\): a layer pruned by "
                                           r"headlab, loaded without headlab; load the pruned directory with headlab"):
        attention_blocks(plain)


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_lrp_conserves_relevance(wrapper):
    """Before: refused ("its query and key projections are unknown"); the fused projection's query and key columns
    held constant, relevance is conserved on a bias-free copy."""
    from headlab.importance.rules import check_rules

    build, *_, first = WRAPPERS[wrapper]
    model = build()
    check_rules(model)
    check_lrp_conserves(model, first(model))


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_lrp_on_the_wrapper_is_its_text_models(wrapper):
    """The wrapper's head relevance is that of its text model alone (a table family), with the same weights. Both
    are described as the text model alone is (its special tokens: ModernVBERT's own config has none, describe_model
    reads them from its text_config: the wrapper's description equals this one, tests/test_wrapper_text_config.py)."""
    from headlab.importance import ImportanceData, compute_lrp

    build, alone, kind, *_ = WRAPPERS[wrapper]
    model = build()
    text = alone(model)
    data = ImportanceData.from_ids([[5, 6, 7, 8, 1], [9, 10, 11, 1], [12, 13, 14, 15, 16, 1]])
    info = describe_model(text)
    got, want = (compute_lrp(m, data, info, batch_size=2, bootstrap=0) for m in (model, text))
    assert list(got.scores) == list(want.scores) == [kind]
    assert got.scores[kind].shape == (2, 4)
    np.testing.assert_allclose(got.scores[kind], want.scores[kind], rtol=1e-9, atol=1e-12)
    for part in ("embeddings", "with_biases"):
        assert got.signature["conservation"][part] == pytest.approx(want.signature["conservation"][part], rel=1e-9)


def test_a_class_transformers_does_not_ship_keeps_discoverys_refusal(monkeypatch):
    """The layout is read off the attention class's forward, transformers' own: a class of the same name from
    elsewhere (a hub repository's) gets none, and pruning stays refused before any work."""
    from headlab import HeadlabError

    model = WRAPPERS["phi4_multimodal"][0]()
    monkeypatch.setattr(type(model.model.layers[0].self_attn), "__module__", "remote_code.modeling_phi4")
    assert all(b.qkv is None for b in _text_blocks(model))
    with pytest.raises(HeadlabError, match=r"this family's projection layout is unknown"):
        prune_heads(model, {("dec_self", 0): [1]})


@pytest.mark.parametrize("entry", ["phi3", "modernbert"])
def test_the_tabled_class_itself_found_by_discovery_takes_its_entrys_layout(entry, monkeypatch):
    """Phi3Attention and ModernBertAttention wherever discovery finds them (a wrapper built around Phi-3 or ModernBERT
    from its text config): a tabled model with its entry taken out gives the blocks and the pruning the entry gives."""
    from headlab.adapters import families
    from support.family_matrix import tiny_inputs, tiny_model

    kind = "enc_self" if entry == "modernbert" else "dec_self"
    want = [(b.key, b.n_heads, b.n_kv_heads, b.d_head, b.qkv is not None) for b in attention_blocks(tiny_model(entry))]
    monkeypatch.delitem(families.FAMILIES, entry)
    model, batch = tiny_model(entry), tiny_inputs()
    blocks = attention_blocks(model)
    assert [b.family.name for b in blocks] == [f"discovered:{entry}"] * 2
    assert [(b.key, b.n_heads, b.n_kv_heads, b.d_head, b.qkv is not None) for b in blocks] == want
    spec = {(kind, 0): [1], (kind, 1): [0, 1, 2, 3]}
    with mask_heads(model, spec):
        masked = _logits(model, batch)
    prune_heads(model, spec)
    assert [b.n_heads for b in attention_blocks(model)] == [3, 0]
    torch.testing.assert_close(_logits(model, batch), masked, rtol=0, atol=1e-5)
