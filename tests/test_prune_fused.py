"""Physical pruning of fused q/k/v projections (issue 31, item 2): GPT-NeoX (per head, partial
rotary), Phi-3 ([q | k | v] of grouped widths), Falcon (grouped, multi-query, per head with ALiBi),
GPT-BigCode (multi-query and per head), Bloom (per head, ALiBi, the residual added inside its
attention), MPT ([q | k | v], ALiBi handed as position_bias) and Phi-2's partial rotary (separate projections).

On each: the pruned model equals the masked one on a batch padded left and right and in greedy
cached generation, and so does the directory save_pruned writes, loaded by load_pruned and by plain
transformers (remote code). Two specs: one query head of a key/value group in layer 0 and a whole
group in layer 1; a layer left with no head (layer 0) beside a layer losing one head.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers as tf

from headlab import attention_blocks, capture_attention, load_pruned, mask_heads, prune_heads, save_pruned
from headlab.cli import main
from support.family_matrix import check_pruned_generates_as_masked, greedy_generation, padded_inputs, padded_logits, tiny_model

FUSED = ["gpt_neox", "phi3", "falcon", "falcon_mq", "falcon_alibi", "gpt_bigcode", "gpt_bigcode_mha", "bloom", "mpt", "phi"]
SPECS = {
    "partial group": ({("dec_self", 0): [1], ("dec_self", 1): [0, 1]}, [3, 2]),
    "no head left": ({("dec_self", 0): [0, 1, 2, 3], ("dec_self", 1): [2]}, [0, 3]),
}
ATOL = 1e-5  # measured: 0 on these logits; over the check's probe at most 3e-8 (Phi-3)


@pytest.mark.parametrize("spec_name", SPECS)
@pytest.mark.parametrize("family", FUSED)
def test_fused_prune_equals_mask_generates_and_reloads(family, spec_name, tmp_path):
    spec, heads_left = SPECS[spec_name]
    model = tiny_model(family)
    ids, mask = padded_inputs(pad_id=2)
    expected, expected_tokens = check_pruned_generates_as_masked(model, spec, heads_left, ids, mask, atol=ATOL)

    save_pruned(model, tmp_path)
    torch.testing.assert_close(padded_logits(load_pruned(tmp_path), ids, mask), expected, atol=ATOL, rtol=0)
    record = json.loads((tmp_path / "headlab_pruning.json").read_text())
    assert record["portable"]["how"] == "remote code"
    plain = tf.AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True).eval()
    torch.testing.assert_close(padded_logits(plain, ids, mask), expected, atol=ATOL, rtol=0)
    assert torch.equal(greedy_generation(plain, ids, mask)[0], expected_tokens)


def test_grouped_falcon_keeps_the_key_value_heads_its_query_heads_use():
    """Falcon's new decoder architecture, 4 query heads over 2 key/value heads: removing one query
    head of group 0 leaves groups of 1 and 2, which its view(..., group + 2, d) cannot hold, so
    each kept query head gets its own copy of its key/value head; removing all of group 0 drops
    its key/value head."""
    model = tiny_model("falcon")
    prune_heads(model, SPECS["partial group"][0])
    first, second = attention_blocks(model)
    assert (first.n_heads, first.n_kv_heads, second.n_heads, second.n_kv_heads) == (3, 3, 2, 1)
    assert first.core._headlab_kept_kv_heads == [0, 1, 1] and second.core._headlab_kept_kv_heads == [1]
    assert (first.core.num_heads, first.core.num_kv_heads) == (3, 3)


@pytest.mark.parametrize("family", ["bloom", "mpt"])
def test_alibi_layers_keep_their_heads_slopes(family):
    """Bloom's and MPT's ALiBi slopes depend on a head's index among the config's heads: a pruned layer
    reads the kept heads' rows (MPT's ``position_bias``, [heads, 1, keys]). Removing head 0 must keep heads
    1-3's slopes, not heads 0-2's: the check measures it, and a layer whose rows were not selected fails it."""
    import headlab.surgery as surgery

    spec = {("dec_self", 0): [0]}
    model = tiny_model(family)
    ids, mask = padded_inputs(pad_id=2)
    with mask_heads(model, spec):
        expected = padded_logits(model, ids, mask)
    prune_heads(model, spec)
    torch.testing.assert_close(padded_logits(model, ids, mask), expected, atol=ATOL, rtol=0)

    unhooked = tiny_model(family)
    real = surgery._install_alibi_hooks
    try:
        surgery._install_alibi_hooks = lambda blocks, journal: None
        with pytest.raises(surgery.PruningNotExact, match=f"{family}: the pruned model fails in dec_self layer 0"):
            prune_heads(unhooked, spec)
    finally:
        surgery._install_alibi_hooks = real


def test_pruned_phi3_layer_reads_its_own_head_count_and_follows_the_model():
    """Phi-3 splits its fused projection at config.num_attention_heads * head_dim, a config all
    layers share: a pruned layer gets its own view (LayerConfig) whose count is its own while
    everything else (the attention implementation that capture switches) is the model's."""
    from headlab.portable_code import LayerConfig

    model = tiny_model("phi3")
    prune_heads(model, {("dec_self", 0): [1]})
    first, second = attention_blocks(model)
    assert isinstance(first.core.config, LayerConfig) and first.core.config.num_attention_heads == 3
    assert second.core.config is model.config and model.config.num_attention_heads == 4
    ids, mask = padded_inputs(pad_id=2)
    with capture_attention(model) as record:
        model(input_ids=ids, attention_mask=mask)
    assert [record[("dec_self", i)].shape[1] for i in (0, 1)] == [3, 4]
    assert first.core.config._attn_implementation == model.config._attn_implementation == "sdpa"
    twin = copy.deepcopy(model)  # the view copies with its model
    assert twin.model.layers[0].self_attn.config.base is twin.config
    torch.testing.assert_close(padded_logits(twin, ids, mask), padded_logits(model, ids, mask), atol=0, rtol=0)


def test_cli_prunes_a_fused_family(tmp_path, capsys):
    """`headlab prune` on GPT-NeoX (refused before this change) writes a checked pruned model."""
    ids, mask = padded_inputs(pad_id=2)
    model = tiny_model("gpt_neox")
    model.save_pretrained(tmp_path / "neox")
    with mask_heads(model, {("dec_self", 0): [1]}):
        expected = padded_logits(model, ids, mask)
    code = main(["prune", str(tmp_path / "neox"), "--heads", "dec_self:0:1", "--out", str(tmp_path / "out")])
    assert code == 0, capsys.readouterr().err
    loaded = load_pruned(tmp_path / "out")
    assert [b.n_heads for b in attention_blocks(loaded)] == [3, 4]
    torch.testing.assert_close(padded_logits(loaded, ids, mask), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", ["falcon", "phi3", "bloom", "mpt"])
def test_pruning_twice_composes(family, tmp_path):
    """A second prune of pruned layers (Falcon's copied key/value heads, Phi-3's config view,
    Bloom's and MPT's ALiBi hook, which reads what the layer keeps when called) equals masking the union."""
    model = tiny_model(family)
    ids, mask = padded_inputs(pad_id=2)
    with mask_heads(model, {("dec_self", 0): [1, 2], ("dec_self", 1): [0, 3]}):
        expected = padded_logits(model, ids, mask)
    prune_heads(model, {("dec_self", 0): [1], ("dec_self", 1): [0]})
    prune_heads(model, {("dec_self", 0): [1], ("dec_self", 1): [2]})  # current numbering: original 2 and 3
    torch.testing.assert_close(padded_logits(model, ids, mask), expected, atol=ATOL, rtol=0)
    save_pruned(model, tmp_path)
    torch.testing.assert_close(padded_logits(load_pruned(tmp_path), ids, mask), expected, atol=ATOL, rtol=0)
