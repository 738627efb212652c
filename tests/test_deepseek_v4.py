"""DeepSeek-V4: analysed, masked and pruned (session 39, branch dsv4); LRP since session 40 (tests/test_lrp_deepseek_v4.py).

Before, refused before any work (``adapters.families.UNSUPPORTED["deepseek_v4"]``: "attends over [the tokens' keys |
compressed key-value entries] ..."; tests/test_deepseek_v4_refused.py). Read in transformers 5.24
(models/deepseek_v4, ``DeepseekV4Attention``) and checked here, on tiny float64 models with the three layer types:

* the queries: ``q_b_proj`` (after the query latent ``q_a_proj``/``q_a_norm``) viewed ``[.., -1, head_dim]``, each head
  RMS-normed on its own (``q_b_norm``, no weight) and rotated on its trailing rope slice; one key-value head
  (``kv_proj``), both key and value for every head; learned sinks (``sinks``, one logit per head, eager's extra column);
* in ``compressed_sparse_attention`` and ``heavily_compressed_attention`` layers a compressor pools windows of
  ``compress_rates[type]`` tokens of the layer's input into entries appended after the tokens' keys (the sparse
  layers' picked per query by an indexer, the others causally), their columns masked by the compressor's block bias;
  ``sliding_attention`` layers have none;
* each head's output rotated back per query (the conjugate rotation, on its own rope slice), then reshaped
  ``[batch, seq, o_groups, heads / o_groups x head_dim]`` into the grouped ``o_a_proj`` and ``o_b_proj``; the layers
  joined by hyper-connections.

So: capture is the map over the input's tokens (eager's ``output_attentions`` cut to the tokens' columns); what a row
lacks to one is the mass on the compressed entries and the sink, as any sink type's rows (the sinks' share left out).
Masking a head zeroes its output at ``o_a_proj``'s input, which equals zeroing its output before the inverse rotation
(a rotation of its own features) by hand. Physical pruning slices each group of ``o_a_proj`` where every group keeps as
many heads (or the layer none): the groups have one width, so any other plan (and prune train's free gates) is refused
before any work. LRP was refused (no rule for the compressor, the indexer or the inverse rotation) until session 40:
its rule is importance/shared_kv_rule.py, checked in tests/test_lrp_deepseek_v4.py.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from headlab import HeadlabError, attention_blocks, capture_attention, mask_heads, prune_heads
from support.family_matrix import check_confidence_on_every_engine, check_gates_at_one_change_nothing, logits, tiny_inputs

HEADS, D, GROUPS = 4, 16, 2
LAYER_TYPES = ["compressed_sparse_attention", "sliding_attention", "heavily_compressed_attention"]
RATES = {"compressed_sparse_attention": 2, "heavily_compressed_attention": 3}
_CONFIG = dict(vocab_size=99, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3,
               num_attention_heads=HEADS, head_dim=D, qk_rope_head_dim=4, q_lora_rank=16, o_groups=GROUPS,
               o_lora_rank=8, n_routed_experts=4, num_experts_per_tok=2, index_n_heads=2, index_head_dim=8,
               # the indexer keeps 2 of the sparse layer's up to 3 entries per query of 7 tokens; a window of 5 keys
               index_topk=2, sliding_window=5, hc_mult=2, num_nextn_predict_layers=0, max_position_embeddings=64,
               compress_rates=RATES, layer_types=LAYER_TYPES, mlp_layer_types=["moe"] * 3, bos_token_id=0,
               eos_token_id=1, pad_token_id=2)


def build(seed: int = 0, **sizes) -> torch.nn.Module:
    """The tiny model in float64 (the experts' eager loop), eager attention (its only one), its sinks, norms, the
    compressors' position biases and the hyper-connections' biases moved off their initial values."""
    if "deepseek_v4" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no deepseek_v4")
    config = tf.DeepseekV4Config(**{**_CONFIG, **sizes})
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = tf.DeepseekV4ForCausalLM(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("sinks", "position_bias", "base")) or "norm" in name:
                parameter.add_(torch.randn_like(parameter) * (1.0 if name.endswith("sinks") else 0.5))
    return model.double()


def _eager(model, inputs: dict) -> tuple:
    with torch.no_grad():
        return model(**inputs, output_attentions=True, use_cache=False).attentions


def test_blocks_are_found_with_one_shared_key_value_head_and_their_sinks():
    """Before: refused before any work. Now one block per layer, each of every type: 4 heads of 16 over one
    key-value head; q_b_proj's rows and the sinks are per head, o_a_proj reads 4 x 16 (2 groups of 32)."""
    model = build()
    blocks = attention_blocks(model)
    assert [(b.kind, b.layer, b.n_heads, b.n_kv_heads, b.d_head, b.idle) for b in blocks] == \
        [("dec_self", layer, HEADS, 1, D, False) for layer in range(3)]
    for block, layer in zip(blocks, model.model.layers):
        assert block.o is layer.self_attn.o_a_proj and block.family.head_rows == (("q_b_proj", ("head_dim",)),)
        assert block.family.head_vectors == ("sinks",)


def test_capture_is_eager_output_attentions_over_the_tokens():
    """On a padded batch (right and left), float64: capture equals transformers' eager output_attentions cut to the
    tokens' columns, map for map, to 1e-12 (with the model's cache too, as a plain forward builds one); the compressed
    layers' eager maps have more columns (the entries), the sliding layer's none; the tokens' rows, the entries' and
    the sink's shares sum to one, and with the sinks switched off (-1e4: a share of exactly 0) the mass on the
    compressed entries is exactly 1 - the rows' sums. Before: refused."""
    from support.family_matrix import padded_inputs

    ids, mask = padded_inputs()
    inputs = {"input_ids": ids, "attention_mask": mask}
    model = build()
    reference = _eager(model, inputs)
    assert [a.shape[-1] for a in reference] == [7 + 7 // 2, 7, 7 + 7 // 3]  # tokens, then the entries
    with capture_attention(model) as record:
        logits(model, inputs)  # a plain forward: use_cache (the config's), a DynamicCache built
    assert sorted(record) == [("dec_self", layer) for layer in range(3)]
    for layer in range(3):
        torch.testing.assert_close(record[("dec_self", layer)], reference[layer][..., :7], atol=1e-12, rtol=0)
    entries = reference[0][..., 7:].sum(-1)
    assert (entries[0, :, 1:] > 1e-3).all() and (entries[0, :, 0] == 0).all()  # query t sees entries w < (t + 1) // 2
    sink = 1 - record[("dec_self", 0)].sum(-1) - entries  # the sink's share: the rest
    assert (sink[0] > 1e-3).all()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
    reference = _eager(model, inputs)
    with capture_attention(model) as record:
        logits(model, inputs)
    real = mask.bool()[:, None, :].expand(-1, HEADS, -1)  # the tokens' queries (a padded one sees no token)
    for layer in range(3):
        rows = record[("dec_self", layer)].sum(-1)
        torch.testing.assert_close(reference[layer][..., 7:].sum(-1)[real], (1 - rows)[real], atol=1e-12, rtol=0)
    # the sliding layer: rows of one (no entries, no sink)
    torch.testing.assert_close(record[("dec_self", 1)].sum(-1)[real], torch.ones(int(real.sum()), dtype=torch.float64),
                               atol=1e-12, rtol=0)


def test_a_right_padded_rows_maps_are_its_own():
    """A sentence's maps in a right-padded batch are those it gets alone (its compressed entries pool its own windows:
    an entry whose window holds padding is visible to padded queries only), to 1e-12."""
    inputs = tiny_inputs()  # row 1: 5 tokens, 2 padded
    model = build()
    with capture_attention(model) as record:
        logits(model, inputs)
    batch = {key: value[1] for key, value in record.items()}
    with capture_attention(model) as record:
        logits(model, {name: value[1:, :5] for name, value in inputs.items()})
    for key, probs in record.items():
        torch.testing.assert_close(batch[key][:, :5, :5], probs[0], atol=1e-12, rtol=0)


def test_capture_over_a_cache_of_earlier_tokens_is_refused():
    """A decoding step (one query over the cached tokens' keys) is no map over one pass's tokens: refused, naming it,
    not cut to the wrong columns."""
    model = build()
    inputs = tiny_inputs(batch=1)
    with torch.no_grad():
        cache = model(**inputs, use_cache=True).cache
    step = {"input_ids": torch.tensor([[5]]), "attention_mask": torch.ones(1, 8, dtype=torch.long), "cache": cache}
    with pytest.raises(HeadlabError, match=r"1 queries over \d+ token keys \(a cache of earlier tokens\)"):
        with capture_attention(model):
            logits(model, step)


def test_a_map_without_a_tensor_mask_is_refused():
    """Without a tensor mask the tokens' keys cannot be told from the entries (and transformers' forward masks no entry
    then): refused, not guessed."""
    from headlab.adapters.families import deepseek_v4_probs

    attention = build().model.layers[0].self_attn
    with pytest.raises(HeadlabError, match="called without a tensor attention mask"):
        deepseek_v4_probs(attention, (), {"attention_mask": None}, (None, torch.zeros(1, HEADS, 7, 10)))


_ZEROED = "headlab_test_zeroed_heads"


def _zeroing_eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """transformers' eager of DeepSeek-V4, then the heads of ``module.zeroed`` scaled (their rows of the output
    ``[batch, seq, heads, head_dim]``, before the inverse rotation): the reference by hand."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import eager_attention_forward

    output, weights = eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    output = output.clone()
    for head, factor in getattr(module, "zeroed", {}).items():
        output[:, :, head] = output[:, :, head] * factor
    return output, weights


def _by_hand(model, inputs: dict, layer: int, factors: dict[int, float]) -> torch.Tensor:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(_ZEROED, _zeroing_eager)
    AttentionMaskInterface.register(_ZEROED, eager_mask)  # eager's masks, as for "eager"
    attention = model.model.layers[layer].self_attn
    attention.zeroed = factors
    model.config._attn_implementation = _ZEROED
    try:
        return logits(model, inputs)
    finally:
        model.config._attn_implementation = "eager"
        del attention.zeroed


@pytest.mark.parametrize("layer", [0, 1, 2])
@pytest.mark.parametrize("heads", [[1], [0, 3], [2, 3]])
def test_masking_equals_zeroed_head_outputs(layer, heads):
    """Masking heads (of one group, of both, a whole group) of a layer of each type equals zeroing their rows of the
    attention output by hand, before the inverse rotation and the grouped o_a_proj, on a padded batch, to 1e-12;
    the mask comes off. Before: refused."""
    inputs = tiny_inputs()
    model = build()
    before = logits(model, inputs)
    with mask_heads(model, {("dec_self", layer): heads}):
        masked = logits(model, inputs)
    assert torch.equal(logits(model, inputs), before)
    reference = _by_hand(model, inputs, layer, dict.fromkeys(heads, 0.0))
    assert not torch.allclose(reference, before)
    torch.testing.assert_close(masked, reference, atol=1e-12, rtol=0)


def test_masking_in_cached_generation_equals_zeroed_head_outputs():
    """Greedy cached generation (left-padded rows, each step one query over the cache and the compressor's running
    entries) with heads 0 and 3 of every layer masked equals generation with their outputs zeroed by hand, scores to
    1e-12, the same tokens."""
    from support.family_matrix import greedy_generation, padded_inputs

    ids, mask = padded_inputs()
    model = build()
    with mask_heads(model, {("dec_self", layer): [0, 3] for layer in range(3)}):
        tokens, scores = greedy_generation(model, ids, mask)
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(_ZEROED, _zeroing_eager)
    AttentionMaskInterface.register(_ZEROED, eager_mask)
    for layer in model.model.layers:
        layer.self_attn.zeroed = {0: 0.0, 3: 0.0}
    model.config._attn_implementation = _ZEROED
    reference_tokens, reference_scores = greedy_generation(model, ids, mask)
    assert torch.equal(tokens, reference_tokens)
    torch.testing.assert_close(scores, reference_scores, atol=1e-12, rtol=0)
    model.config._attn_implementation = "eager"
    for layer in model.model.layers:
        del layer.self_attn.zeroed
    _, unmasked = greedy_generation(model, ids, mask)
    assert not torch.allclose(unmasked, scores)  # the masking did something


def test_a_heads_gate_scales_that_head_only_and_gates_at_one_change_nothing():
    """A constant gate of 0.25 on head 2 of the compressed sparse layer equals scaling its output rows by it by hand
    (the grouped input read per head, not per group); scalar gates at one change nothing."""
    from headlab import ConstantGates, gates_attached

    inputs = tiny_inputs()
    model = build()
    gates = ConstantGates({("dec_self", 0): torch.tensor([1.0, 1.0, 0.25, 1.0])})
    with gates_attached(model, gates):
        gated = logits(model, inputs)
    torch.testing.assert_close(gated, _by_hand(model, inputs, 0, {2: 0.25}), atol=1e-12, rtol=0)
    check_gates_at_one_change_nothing(build(), inputs)


def test_pruning_slices_each_heads_rows_and_sinks_and_each_groups_columns():
    """Heads 1 and 2 of the sliding layer pruned (one from each group): q_b_proj keeps heads 0 and 3's rows, sinks
    their entries, o_a_proj group 0's rows head 0's columns and group 1's rows head 3's (its second head there); what
    all heads share (the query latent, kv_proj, the compressors, the hyper-connections, o_b_proj) is untouched. Before:
    refused (session 39's first commit: "physical pruning is refused: ... o_a_proj ...")."""
    model = build()
    attention = model.model.layers[1].self_attn
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    assert prune_heads(model, {("dec_self", 1): [1, 2]}) == {("dec_self", 1): [0, 3]}
    rows = [r for h in (0, 3) for r in range(h * D, (h + 1) * D)]
    prefix = "model.layers.1.self_attn."
    o = before[prefix + "o_a_proj.weight"]  # [2 groups x 8, 2 heads x 16]
    expected = {"q_b_proj.weight": before[prefix + "q_b_proj.weight"][rows], "sinks": before[prefix + "sinks"][[0, 3]],
                "o_a_proj.weight": torch.cat([o[:8, :D], o[8:, D:]])}
    for name, value in expected.items():
        assert torch.equal(attention.get_parameter(name), value), name
    for name, parameter in model.named_parameters():
        if name.removeprefix(prefix) not in expected:
            assert torch.equal(parameter, before[name]), name
    assert (attention.num_heads, attention.num_key_value_groups, attention.o_a_proj.in_features) == (2, 2, D)
    assert [(b.n_heads, b.n_kv_heads) for b in attention_blocks(model)] == [(HEADS, 1), (2, 1), (HEADS, 1)]


def test_uneven_groups_are_refused_before_any_work_and_gates_over_them_too():
    """Heads 0 and 1 (all of group 0) pruned from a layer: its groups would keep 0 and 2 heads, which o_a_proj (one
    width per group) cannot take; refused before any change, naming the counts. The gates of `headlab prune train`
    (free picks) are refused before its training (check_prunable, which it runs first, and check_gates_free, which
    `analyze --prune` runs), as Gemma 4's key/value-sharing layers are."""
    from headlab.surgery import check_gates_free, check_prunable

    model = build()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with pytest.raises(HeadlabError, match=r"dec_self layer 2: pruning heads \[0, 1\] would leave \[0, 2\] heads in "
                                           r"the 2 groups of its grouped output projection "
                                           r"\(model\.layers\.2\.self_attn\.o_a_proj"):
        prune_heads(model, {("dec_self", 2): [0, 1]})
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter, before[name]), name
    assert [b.n_heads for b in attention_blocks(model)] == [HEADS] * 3
    for check in (lambda: check_prunable(model), lambda: check_gates_free(attention_blocks(model))):
        with pytest.raises(HeadlabError, match=r"dec_self:0, dec_self:1, dec_self:2: their heads meet a grouped output "
                                               r"projection"):
            check()


def test_heads_spanning_groups_are_masked_and_their_pruning_refused():
    """With 8 groups for 4 heads (each head's output read by two groups of o_a_proj) masking a head still equals
    zeroing its output by hand (the grouped input read in head order), and pruning one is refused before any work:
    removing it would take whole groups away (transformers reads their count from the config). Found by the family
    sweep's tiny model (o_groups 8 by default): the pruning divided by zero heads per group."""
    inputs = tiny_inputs()
    model = build(o_groups=8, o_lora_rank=4)
    with mask_heads(model, {("dec_self", 2): [1]}):
        masked = logits(model, inputs)
    torch.testing.assert_close(masked, _by_hand(model, inputs, 2, {1: 0.0}), atol=1e-12, rtol=0)
    with pytest.raises(HeadlabError, match=r"its 4 heads do not split into the 8 groups of its grouped output "
                                           r"projection \(model\.layers\.2\.self_attn\.o_a_proj\)"):
        prune_heads(model, {("dec_self", 2): [1]})
    assert [b.n_heads for b in attention_blocks(model)] == [HEADS] * 3


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_pruning_equals_masking_in_generation_empties_a_layer_and_reloads(dtype, tmp_path):
    """The compressed sparse layer emptied, heads 1 and 2 of the sliding layer and 0 and 3 of the heavily compressed
    one removed: the pruned model equals the masked one on right- and left-padded rows and in greedy cached generation
    (the emptied layer keeps its cache in step, so positions still count; its compressor, which only its heads read,
    runs no more), in float64 to 1e-10. In float32, as saved and reloaded, the directory reloads with load_pruned and
    with plain transformers (remote code: o_a_proj rebuilt as a DeepseekV4GroupedLinear of the kept width)."""
    from support.family_matrix import check_pruned_generates_as_masked, check_pruned_reloads, padded_inputs

    ids, mask = padded_inputs()
    model = build().to(dtype)
    spec = {("dec_self", 0): [0, 1, 2, 3], ("dec_self", 1): [1, 2], ("dec_self", 2): [0, 3]}
    atol = 1e-10 if dtype == torch.float64 else 1e-5
    expected, tokens = check_pruned_generates_as_masked(model, spec, [0, 2, 2], ids, mask, atol=atol)
    if dtype == torch.float32:
        model.set_experts_implementation("grouped_mm")  # as a plain load runs them
        record = check_pruned_reloads(model, tmp_path, [0, 2, 2], ids, mask, expected, tokens)
        assert {layer: entry["kept_heads"] for layer, entry in record["blocks"]["dec_self"].items()} == \
            {"0": [], "1": [0, 3], "2": [1, 2]}
        import json

        plan = json.loads((tmp_path / "config.json").read_text())["headlab_pruned"]
        assert plan["projections"]["model.layers.1.self_attn.o_a_proj"] == ["grouped_linear", D, 16, 2]


def test_lrp_rules_cover_every_part():
    """LRP's rule check passes (before: refused, "no rule for the attention of model.layers.0.self_attn (deepseek-v4):
    ... no LRP rule for the compressor, the indexer or the inverse rotation")."""
    from headlab.importance.rules import check_rules

    check_rules(build())


def test_confidence_is_the_same_on_every_engine():
    """The default and chunked engines cannot run headlab's attention function on it (it would count the compressed
    entries as keys): they take the eager maps, cut to the tokens (stream_attention's fallback, which hands them on in
    float32), and give eager's scores to float32's rounding."""

    from headlab.capture import not_streamable
    from headlab.importance import ImportanceData, describe_model

    model = build()
    assert "appends compressed key-value entries" in not_streamable(model)
    info = describe_model(model)
    data = ImportanceData.from_ids([[5, 17, 33, 41, 8, 1], [9, 60, 22, 1], [70, 12, 45, 31, 28, 90, 3, 1]])
    check_confidence_on_every_engine(model, data, info)


def test_analyze_end_to_end(tmp_path):
    """`headlab analyze --ablation` on a saved tiny model: every stage done, LRP too (before session 40: failed with
    the refusal naming the compressor), a score row per layer. Before session 39: every stage refused with the model."""
    import json

    from support.family_matrix import ANALYZE_STAGES, analyze, save_tiny, treebank_files

    model = build().float()
    model.set_experts_implementation("grouped_mm")  # as a plain load runs them
    save_tiny(model, tmp_path / "model", treebank_files(tmp_path))
    code, stages = analyze(tmp_path / "model", tmp_path)
    for name in ANALYZE_STAGES:
        assert stages[name]["status"] == "done", stages[name]
    assert stages["lrp"]["status"] == "done" and code == 0, stages["lrp"]
    for measure in ("confidence", "lrp"):
        rows = json.loads((tmp_path / "out" / "importance" / f"{measure}.json").read_text())["scores"]["dec_self"]
        assert [all(v is None for v in row) for row in rows] == [False] * 3, measure


def test_a_pruned_model_resaved_under_the_checkpoints_names_loads_from_its_plan(tmp_path):
    """transformers saves DeepSeek-V4 under its checkpoint's tensor names (attn.wo_a, ...): a pruned model reloaded with
    plain transformers and re-saved has weights whose names headlab cannot read its kept heads from. The config's plan
    (headlab_pruned, which the re-save through pruned_heads.py keeps) names them, the weights must fit it: the saved
    model (checkpoint.record_from_plan; before session 42, refused as weights not matching the config).
    Without the plan, load_model names the tensors whose shapes differ (before: transformers' RuntimeError pointing to
    a report headlab had filtered)."""
    import json

    from headlab import save_pruned
    from headlab.loading import load_model

    model = build().float()
    prune_heads(model, {("dec_self", 1): [1, 2], ("dec_self", 2): [0, 3]})
    save_pruned(model, tmp_path / "pruned")
    tf.AutoModelForCausalLM.from_pretrained(tmp_path / "pruned", trust_remote_code=True).save_pretrained(
        tmp_path / "resaved")
    loaded = load_model(str(tmp_path / "resaved"))
    assert [b.n_heads for b in attention_blocks(loaded)] == [HEADS, HEADS - 2, HEADS - 2]
    inputs = tiny_inputs()
    # as headlab's own directory loads, to the bit (the model in memory, built in float64, differs by float32's rounding)
    assert torch.equal(logits(loaded, inputs), logits(load_model(str(tmp_path / "pruned")), inputs))
    torch.testing.assert_close(logits(loaded, inputs), logits(model, inputs), atol=1e-6, rtol=0)
    config_path = tmp_path / "resaved" / "config.json"
    config = json.loads(config_path.read_text())
    del config["headlab_pruned"], config["auto_map"]
    config["architectures"] = ["DeepseekV4ForCausalLM"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(HeadlabError, match=r"resaved: the weights do not match its config\.json: .*"
                                           r"self_attn\.q_b_proj\.weight: weights \[32, 16\], model \[64, 16\].* "
                                           r"\(if it is a pruned model re-saved by transformers"):
        load_model(str(tmp_path / "resaved"))
