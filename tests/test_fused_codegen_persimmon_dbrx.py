"""Fused q/k/v layouts of CodeGen, Persimmon, Fuyu and DBRX (session 29, fused29), and Zaya's refusal.

These families have no table entry: run-time discovery found their blocks but tied no projection (one fused projection
feeds the queries, keys and values), so the value reference was missing, physical pruning refused ("this family's
projection layout is unknown") and LRP too ("its query and key projections are unknown"). Their layouts, read off
transformers 5.24's forwards, are now the entries of ``headlab.adapters.families.FUSED_ATTENTION_CLASSES``:

* CodeGen: ``qkv_proj`` viewed ``(..., mp_num, 3 * embed_dim // mp_num)``, split (query, value, key): ``mp_num`` (4)
  groups of consecutive heads, each ``[q | v | k]`` of its heads (layout "mp-groups"); a pruned layer's groups are
  ``gcd(kept, mp_num)``, its ``mp_num`` and ``embed_dim`` set to match. Partial rotary.
* Persimmon, and Fuyu's language model (a Persimmon): ``query_key_value`` viewed ``(..., heads, 3, head_dim)``
  (Bloom's per-head layout); q/k LayerNorms per head.
* DBRX: ``Wqkv`` = ``[q | k | v]`` with grouped key/value heads, clamped to ``clip_qkv`` element by element (so
  slicing heads stays exact; LRP passes the values' relevance through the clamp by the identity rule).
* Zaya: its CCA projection mixes each key with its group's queries and convolves them over time: pruning and LRP
  refused before any work, naming that.

The references are read off the modeling code by hand (the rows of each head's values below), not from headlab.
Tiny models built from configs, float64, no download.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from headlab import HeadlabError, attention_blocks, mask_heads, prune_heads
from support.family_matrix import (
    check_gates_at_one_change_nothing,
    check_lrp_conserves,
    check_pruned_generates_as_masked,
    check_pruned_reloads,
    padded_inputs,
    padded_logits,
    perturbed_model,
    tiny_inputs,
)
from support.models import VOCAB

_SPECIAL = dict(bos_token_id=0, eos_token_id=1, pad_token_id=2)
_PERSIMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64, qk_layernorm=True, partial_rotary_factor=0.5, **_SPECIAL)


def codegen() -> torch.nn.Module:
    """8 heads of 4 in mp_num=4 groups of 2 heads (a group of one head would not tell the groups from per-head
    [q | v | k]); rotary on 2 of each head's 4 dimensions."""
    config = tf.CodeGenConfig(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=8, rotary_dim=2, n_inner=37,
                              **_SPECIAL)
    return perturbed_model(tf.CodeGenForCausalLM, config).double()


def persimmon() -> torch.nn.Module:
    return perturbed_model(tf.PersimmonForCausalLM, tf.PersimmonConfig(**_PERSIMMON)).double()


def fuyu() -> torch.nn.Module:
    """Fuyu: its language model a Persimmon built from text_config (AutoModel), beside a patch embedding."""
    config = tf.FuyuConfig(vocab_size=VOCAB, hidden_size=32, patch_size=4, num_channels=3,
                           text_config=dict(_PERSIMMON, model_type="persimmon"), **_SPECIAL)
    return perturbed_model(tf.FuyuForCausalLM, config).double()


CLIP = 0.5


def dbrx(clip: float | None = CLIP) -> torch.nn.Module:
    """4 query heads over 2 key/value heads; clip_qkv small enough that the tiny model's projections reach it.
    (DbrxAttention reads rope_theta from attn_config in transformers 5.24.)"""
    config = tf.DbrxConfig(vocab_size=VOCAB, d_model=32, n_heads=4, n_layers=2, max_seq_len=64,
                           attn_config=dict(kv_n_heads=2, clip_qkv=clip, rope_theta=10000.0),
                           ffn_config=dict(hidden_size=32, ffn_hidden_size=40, moe_num_experts=3, moe_top_k=2),
                           **_SPECIAL)
    return perturbed_model(tf.DbrxForCausalLM, config).double()


def zaya() -> torch.nn.Module:
    config = tf.ZayaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                           max_position_embeddings=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                           num_experts_per_tok=1, moe_intermediate_size=40, router_hidden_size=16, **_SPECIAL)
    return perturbed_model(tf.ZayaForCausalLM, config)  # float32: its experts' grouped matmul takes no float64


def _codegen_values(h: int) -> range:
    """CodeGen: group g = h // 2 of the 8 heads is columns g * 24 .. g * 24 + 23 = [q (8) | v (8) | k (8)], head h the
    (h % 2)-th 4 of each."""
    start = (h // 2) * 24 + 8 + (h % 2) * 4
    return range(start, start + 4)


def _per_head_values(h: int) -> range:
    """Persimmon's view(batch, seq, heads, 3, 8): [q_h | k_h | v_h]."""
    return range(24 * h + 16, 24 * h + 24)


def _dbrx_values(j: int) -> range:
    """DBRX's split [hidden (32) | kv heads x 8 (16) | kv heads x 8 (16)]: key/value head j's values."""
    return range(48 + 8 * j, 56 + 8 * j)


# builder, its layers' attention modules, the fused projection's name, value rows of a key/value head, key/value heads
FUSED = {
    "codegen": (codegen, lambda m: [layer.attn for layer in m.transformer.h], "qkv_proj", _codegen_values, 8),
    "persimmon": (persimmon, lambda m: [layer.self_attn for layer in m.model.layers], "query_key_value",
                  _per_head_values, 4),
    "fuyu": (fuyu, lambda m: [layer.self_attn for layer in m.model.language_model.layers], "query_key_value",
             _per_head_values, 4),
    "dbrx": (dbrx, lambda m: [block.norm_attn_norm.attn for block in m.transformer.blocks], "Wqkv", _dbrx_values, 2),
}


def _logits(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


@pytest.mark.parametrize("family", FUSED)
def test_the_blocks_take_their_classs_fused_layout(family):
    """Before: qkv None, no value reference. The fused projection is tied, its value columns those read by hand."""
    build, attentions, fused, values, n_kv = FUSED[family]
    model = build()
    blocks = attention_blocks(model)
    assert [b.key for b in blocks] == [("dec_self", 0), ("dec_self", 1)]
    for block, attention in zip(blocks, attentions(model)):
        assert block.module is attention and block.qkv is getattr(attention, fused) and block.q is None
        assert block.n_kv_heads == n_kv and block.family.name == f"discovered:{model.config.model_type}"
        _, _, v = block.qkv_columns()
        assert v.tolist() == [row for j in range(n_kv) for row in values(j)]


@pytest.mark.parametrize("family", FUSED)
def test_masking_equals_zeroed_values(family):
    """Masking the query heads of key/value head j (layer 1) equals zeroing j's value rows by hand."""
    build, attentions, fused, values, n_kv = FUSED[family]
    inputs = tiny_inputs()
    for j in range(n_kv):
        model = build()
        n_heads = attention_blocks(model)[1].n_heads
        group = n_heads // n_kv
        with mask_heads(model, {("dec_self", 1): list(range(j * group, (j + 1) * group))}):
            masked = _logits(model, inputs)
        projection = getattr(attentions(model)[1], fused)
        with torch.no_grad():
            projection.weight[list(values(j))] = 0
            if projection.bias is not None:
                projection.bias[list(values(j))] = 0
        torch.testing.assert_close(masked, _logits(model, inputs), rtol=0, atol=1e-12)


@pytest.mark.parametrize("family", FUSED)
def test_gates_at_one_change_nothing(family):
    check_gates_at_one_change_nothing(FUSED[family][0](), tiny_inputs())


# heads removed per layer, heads left: CodeGen's 7 and 6 leave groups of gcd(7, 4) = 1 and gcd(6, 4) = 2
SPECS = {"codegen": ({("dec_self", 0): [1], ("dec_self", 1): [0, 5]}, [7, 6]),
         "persimmon": ({("dec_self", 0): [1], ("dec_self", 1): [0, 2]}, [3, 2]),
         "fuyu": ({("dec_self", 0): [1], ("dec_self", 1): [0, 2]}, [3, 2]),
         "dbrx": ({("dec_self", 0): [1], ("dec_self", 1): [2, 3]}, [3, 2])}


@pytest.mark.parametrize("family", ["codegen", "persimmon", "dbrx"])
def test_pruning_equals_masking_and_reloads(family, tmp_path):
    """Before: refused ("this family's projection layout is unknown"). Pruned (in float32, as saved; float64: the
    test below) it gives the masked model's logits on a padded batch and in cached generation (prune_heads checks
    itself too), and saved, it loads back by headlab and by plain transformers (pruned_heads.py) with the same
    logits and tokens."""
    model = FUSED[family][0]().float()
    spec, left = SPECS[family]
    ids, mask = padded_inputs(pad_id=2)
    full = padded_logits(model, ids, mask)
    expected, tokens = check_pruned_generates_as_masked(model, spec, left, ids, mask)
    assert not torch.allclose(expected, full)  # the heads removed mattered
    check_pruned_reloads(model, tmp_path, left, ids, mask, expected, tokens)


def test_a_pruned_codegen_layer_is_laid_out_in_groups_of_its_kept_heads():
    """CodeGen's forward splits qkv_proj into mp_num groups of embed_dim // mp_num columns: a layer left with 7 heads
    is one group, with 6 two (gcd with the 4 it had), with 4 its own 4; the kept heads keep their order."""
    model = codegen()
    prune_heads(model, {("dec_self", 0): [1], ("dec_self", 1): [0, 5]})
    first, second = attention_blocks(model)
    assert (first.core.mp_num, first.core.embed_dim, second.core.mp_num, second.core.embed_dim) == (1, 28, 2, 24)
    prune_heads(model, {("dec_self", 1): [0, 1]})  # heads 1 and 2 of the original 8 now: 4 left, 2 groups of 2
    assert (attention_blocks(model)[1].core.mp_num, attention_blocks(model)[1].n_heads) == (2, 4)


@pytest.mark.parametrize("family", ["codegen", "persimmon", "dbrx"])
def test_a_layer_pruned_to_no_head_equals_masking_it_and_reloads(family, tmp_path):
    """Its stand-in records the class it replaced (stands_for), whose layout the loaded model's blocks take again."""
    from headlab import load_pruned, save_pruned

    model, inputs = FUSED[family][0](), tiny_inputs()
    n = attention_blocks(model)[0].n_heads
    spec = {("dec_self", 0): list(range(n)), ("dec_self", 1): [1]}
    with mask_heads(model, spec):
        masked = _logits(model, inputs)
    prune_heads(model, spec)
    heads = [(("dec_self", 0), 0), (("dec_self", 1), n - 1)]
    assert [(b.key, b.n_heads) for b in attention_blocks(model)] == heads
    torch.testing.assert_close(_logits(model, inputs), masked, rtol=0, atol=1e-12)
    save_pruned(model, tmp_path)
    loaded = load_pruned(tmp_path).to(torch.float64)
    blocks = attention_blocks(loaded)
    assert [(b.key, b.n_heads) for b in blocks] == heads and blocks[1].qkv is not None
    torch.testing.assert_close(_logits(loaded, inputs), masked, rtol=0, atol=1e-12)


@pytest.mark.parametrize("family", FUSED)
def test_pruning_equals_masking_in_float64(family):
    """Pruned in float64, the logits of the masked model to 1e-12 (Fuyu: its language model, a Persimmon discovered
    inside the wrapper; DBRX: layer 1 loses a whole key/value group)."""
    model, inputs = FUSED[family][0](), tiny_inputs()
    spec, left = SPECS[family]
    with mask_heads(model, spec):
        masked = _logits(model, inputs)
    prune_heads(model, spec)
    assert [b.n_heads for b in attention_blocks(model)] == left
    torch.testing.assert_close(_logits(model, inputs), masked, rtol=0, atol=1e-12)


LRP = {"codegen": (codegen, lambda m: m.transformer.h[0]),
       "persimmon": (persimmon, lambda m: m.model.layers[0]),
       "fuyu": (fuyu, lambda m: m.model.language_model.layers[0]),
       "dbrx": (dbrx, lambda m: m.transformer.blocks[0])}


@pytest.mark.parametrize("family", LRP)
def test_lrp_conserves_relevance(family):
    """Before: refused ("its query and key projections are unknown"). The fused projection's query and key columns
    held constant, relevance is conserved to float64 rounding on a bias-free copy."""
    from headlab.importance.rules import check_rules

    build, first = LRP[family]
    model = build()
    check_rules(model)
    check_lrp_conserves(model, first(model), rtol=1e-10, atol=1e-10)


def test_dbrx_lrp_conserves_through_its_norms_and_experts():
    """Before, past its attention, DBRX's LRP was refused twice: DbrxNormAttentionNorm (norm_1, attn, norm_2) was
    taken for a gated norm by its name and children (it holds an attention block and is none), and DbrxExperts (w1, v1,
    w2: [experts x ffn, hidden] each) matched no experts layout. compute_lrp on it conserves, every sentence, in
    float64."""
    from headlab.importance import ImportanceData, compute_lrp, describe_model
    from headlab.importance.rules import check_rules

    model = dbrx()
    check_rules(model)
    data = ImportanceData.from_ids([[5, 6, 7, 8, 1], [9, 10, 11, 1], [12, 13, 14, 15, 16, 1]])
    record = compute_lrp(model, data, describe_model(model), batch_size=2, bootstrap=0).signature["conservation"]
    assert record["n_sentences"] == 3 and record["n_outside"] == 0
    assert abs(record["with_biases"]["min"] - 1) < 1e-9 and abs(record["with_biases"]["max"] - 1) < 1e-9


def test_zaya_pruning_is_refused_before_any_work_naming_its_projection():
    """Zaya's CCA projection mixes each key with its group's queries: pruning one query head changes the others',
    which masking does not. Pruning is refused before anything changes, naming it (before: "this family's projection
    layout is unknown"). LRP has a rule since session 36 (its query and key held constant: tests/test_lrp_zaya.py):
    the check that refused it ("LRP: no rule for the attention of model.layers.0.self_attn (discovered:zaya)") passes."""
    from headlab.importance.rules import check_rules

    model, inputs = zaya(), tiny_inputs()
    before = _logits(model, inputs)
    with pytest.raises(HeadlabError, match=r"physical pruning is refused: its queries, keys and values come from "
                                           r"ZAYA's compressed convolutional attention \(qkv_proj, ZayaCCAProjection\)"):
        prune_heads(model, {("dec_self", 0): [1]})
    assert torch.equal(_logits(model, inputs), before)
    check_rules(model)


def test_a_class_of_the_same_name_outside_transformers_keeps_the_generic_refusal(monkeypatch):
    """The layouts are read off transformers' own classes: a CodeGenAttention from elsewhere (remote code) gets none."""
    model = codegen()
    monkeypatch.setattr(type(model.transformer.h[0].attn), "__module__", "remote_code.modeling_codegen")
    assert all(b.qkv is None for b in attention_blocks(model))
    with pytest.raises(HeadlabError, match=r"this family's projection layout is unknown"):
        prune_heads(model, {("dec_self", 0): [1]})


def test_an_mp_groups_layout_refuses_groups_that_split_a_head():
    """Groups that do not divide the heads (3 of 8; CodeGen's own forward fails on them) are refused, not sliced."""
    from headlab.adapters import qkv_columns

    with pytest.raises(HeadlabError, match=r"an mp-groups fused projection needs .* 8 query, 8 key/value heads, 3 groups"):
        qkv_columns("mp-groups", 8, 8, 4, groups=3)
    q, k, v = qkv_columns("mp-groups", 8, 8, 4, groups=4)
    assert v.tolist() == [row for h in range(8) for row in _codegen_values(h)]
    assert q.tolist()[:8] == [0, 1, 2, 3, 4, 5, 6, 7] and k.tolist()[:8] == [16, 17, 18, 19, 20, 21, 22, 23]


# -- clip_qkv beyond DBRX: MPT clamps its fused Wqkv, OLMo and OLMoE each projection's output in place
def _olmo() -> torch.nn.Module:
    config = tf.OlmoConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, clip_qkv=CLIP,
                           **_SPECIAL)
    return perturbed_model(tf.OlmoForCausalLM, config).double()


def _olmoe() -> torch.nn.Module:
    config = tf.OlmoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, clip_qkv=CLIP,
                            num_experts=3, num_experts_per_tok=2, **_SPECIAL)
    return perturbed_model(tf.OlmoeForCausalLM, config).double()


def _mpt() -> torch.nn.Module:
    config = tf.MptConfig(vocab_size=VOCAB, d_model=32, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=64,
                          attn_config=dict(clip_qkv=CLIP), **_SPECIAL)
    return perturbed_model(tf.MptForCausalLM, config, attn_implementation="eager").double()  # no SDPA in MPT


CLIPPED = {"dbrx": (dbrx, lambda m: m.transformer.blocks[0], lambda m: m.transformer.blocks[0].norm_attn_norm.attn.Wqkv),
           "mpt": (_mpt, lambda m: m.transformer.blocks[0], lambda m: m.transformer.blocks[0].attn.Wqkv),
           "olmo": (_olmo, lambda m: m.model.layers[0], lambda m: m.model.layers[0].self_attn.v_proj),
           "olmoe": (_olmoe, lambda m: m.model.layers[0], lambda m: m.model.layers[0].self_attn.v_proj)}


@pytest.mark.parametrize("family", CLIPPED)
def test_lrp_passes_relevance_through_clip_qkv(family):
    """The forward clamps the projections' outputs to clip_qkv: where a value is clipped its gradient is 0, and
    gradient x input lost that value's relevance (this failed on every family before the activation rule,
    adapters.families.CLIPPED_QKV). The tiny models' projections do reach the bound."""
    build, first, projection = CLIPPED[family]
    model = build()
    reached = []
    handle = projection(model).register_forward_hook(
        lambda module, args, output: reached.append(bool((output.detach().abs() > CLIP).any())))
    check_lrp_conserves(model, first(model), rtol=1e-10, atol=1e-10)
    handle.remove()
    assert reached and all(reached)


@pytest.mark.parametrize("family", ["olmo", "mpt"])
def test_the_clamp_rule_leaves_the_forward_as_it_was(family):
    """The rule changes the backward only: under lrp_rules the logits are the model's own, bit for bit."""
    from headlab.importance.rules import lrp_rules

    model, inputs = CLIPPED[family][0](), tiny_inputs()
    before = _logits(model, inputs)
    with lrp_rules(model):
        assert torch.equal(_logits(model, inputs), before)
