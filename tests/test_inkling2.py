"""Inkling2 (``Inkling2ForCausalLM``, model type ``inkling2_text``; its vision-language model ``inkling2``), session 40.

transformers 5.24's forward (models/inkling2/modeling_inkling2.py), read: each decoder layer's attention
(``Inkling2SlidingAttention`` in the ``hybrid_sliding`` layers, ``Inkling2FullAttention`` in the ``hybrid`` ones) calls
the attention interface with ``position_bias`` (``relative_position_bias``: per head, computed from the layer's input,
added to the scores) and ``sinks`` (``sink_proj(hidden_states)``: one logit per head and query, a softmax column that
is dropped): its eager returns the weights each head applies to its values, the sink's share left out (rows sum to less
than 1). ``o_proj`` multiplies the heads' outputs by ``sigmoid(gate_proj(hidden_states))``, head h by its own rows.
Its keys and values pass short convolutions over their channels (static in the sliding layers, with taps from the input
in the full ones), channel by channel within a key/value head. The layers' inputs come from block attention residuals
(``Inkling2BlockAttentionResidual``): at each position, learned queries attend over that position's states at earlier
block boundaries (a mix over depth, not over tokens): they have no heads and are left out of the blocks.

Before: refused before any work (adapters.families.OUTPUT_GATES_REFUSED), every test here failing with the refusal.
Now: analysed (capture equals output_attentions and a by-hand softmax with the bias and the sinks, in float64) and
masked (equal to zeroing a key/value head's values; gates at one change nothing). Physical pruning and LRP are refused
before any work, naming the parts they do not cover (families.PRUNING_REFUSED, LRP_REFUSED). Inkling2-Loop stays
refused (its loop layers run several times per forward): tests/test_output_gates.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from headlab import HeadlabError, attention_blocks, capture_attention, mask_heads, prune_heads
from headlab.checkpoint import model_class_for
from support.family_matrix import (
    check_capture_equals_output_attentions,
    check_gates_at_one_change_nothing,
    check_masking_equals_zeroed_values,
    logits,
    tiny_inputs,
)

if "inkling2_text" not in CONFIG_MAPPING:
    pytest.skip("this transformers has no inkling2", allow_module_level=True)

SIZES = dict(vocab_size=99, unpadded_vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8,
             sliding_window_size=4, d_rel=4, rel_extent=8, n_layers_per_attn_res_block=1, moe_intermediate_size=40,
             n_routed_experts=4, num_experts_per_tok=2, bos_token_id=0, eos_token_id=1, pad_token_id=2,
             layer_types=["hybrid_sliding", "hybrid"])  # layer 0: sliding window, static convolutions; 1: full, dynamic


def config(**extra):
    return CONFIG_MAPPING["inkling2_text"](**{**SIZES, **extra})


def build(attn_implementation: str = "eager", seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The tiny model, its parameters off their initial values (zeros, ones) so that each part counts: the block
    residuals' queries, the dynamic convolutions' static taps, the norms' scales. In float64 through transformers'
    dtype=, which keeps its float32 modules (the model converted whole fails: a float32 product inside)."""
    cfg = config()
    cfg._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = model_class_for(cfg)._from_config(cfg, dtype=dtype).eval()
    model.set_experts_implementation("eager")  # transformers' grouped matmul takes no float64
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("query", "static_weight", "scale")) or "norm" in name:
                parameter.add_(torch.randn_like(parameter) * 0.3)
            if name.endswith("gate_proj.weight"):  # gates far from one another and from 1/2
                parameter.mul_(8)
    return model


def test_blocks_are_its_attention_layers_not_its_block_residuals():
    """Two blocks, one per decoder layer, numbered as transformers numbers them (before: refused); the block attention
    residuals (attention_input, mlp_input, final_input), which call the attention interface over depth, are none."""
    blocks = attention_blocks(build())
    assert [(b.kind, b.layer, b.name, b.n_heads, b.n_kv_heads, b.d_head) for b in blocks] == [
        ("dec_self", i, f"model.layers.{i}.self_attn", 4, 2, 8) for i in range(2)]
    assert blocks[0].family.head_rows == (("o_proj.gate_proj", ("head_dim",)),)


def test_capture_equals_output_attentions():
    """Padded batch: the maps are transformers' own output_attentions (the sink's share left out)."""
    model, record = check_capture_equals_output_attentions(build, "dec_self", tiny_inputs())
    for probs in record.values():
        assert bool((probs.sum(-1) < 1).all())  # the sinks take a share of every row


def _recorded_calls(monkeypatch) -> list[dict]:
    """Every call of Inkling2's eager attention function, with what it was handed."""
    from transformers.models.inkling2 import modeling_inkling2 as modeling

    calls: list[dict] = []
    eager = modeling.eager_attention_forward

    def recording(module, query, key, value, attention_mask, **kwargs):
        if isinstance(module, (modeling.Inkling2SlidingAttention, modeling.Inkling2FullAttention)):
            calls.append(dict(query=query, key=key, mask=attention_mask, **kwargs))
        return eager(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setattr(modeling, "eager_attention_forward", recording)
    return calls


def test_capture_is_the_softmax_with_the_position_bias_and_the_sinks_by_hand(monkeypatch):
    """In float64, padded: each map is softmax([q k^T * scale + relative bias + mask | sink]) without the sink's
    column, computed here from what the attention function was handed, to 1e-12. Inkling2's eager takes that softmax
    in float32 (``torch.cat([...]).float()``) whatever the model's dtype, so the reference does too (and is float64's
    to float32's rounding); the bias and the sinks matter."""
    model = build(dtype=torch.float64)
    inputs = tiny_inputs()
    calls = _recorded_calls(monkeypatch)
    with capture_attention(model) as record:
        logits(model, inputs)
    assert len(calls) == 2
    for layer, call in enumerate(calls):
        groups = call["query"].shape[1] // call["key"].shape[1]
        keys = call["key"].repeat_interleave(groups, dim=1)
        scores = call["query"] @ keys.transpose(2, 3) * call["scaling"] + call["mask"]
        biased = scores + call["position_bias"]
        exact = torch.cat([biased, call["sinks"]], dim=-1).softmax(-1)[..., :-1]
        by_hand = torch.cat([biased, call["sinks"]], dim=-1).float().softmax(-1)[..., :-1].double()
        probs = record[("dec_self", layer)]
        assert probs.dtype == torch.float64
        torch.testing.assert_close(probs, by_hand, rtol=0, atol=1e-12)
        torch.testing.assert_close(probs, exact, rtol=0, atol=1e-6)
        assert not torch.allclose(probs, torch.cat([scores, call["sinks"]], -1).softmax(-1)[..., :-1], atol=1e-6)
        assert not torch.allclose(probs, biased.softmax(-1), atol=1e-6)


def test_masking_equals_zeroed_values_and_gates_at_one_change_nothing():
    """Masking the query heads of key/value head j in layer 1 (masked at o_proj's input, after the gate) equals
    zeroing j's rows of v_proj.linear: its convolution and norm map zeros to zeros, so its heads output 0, times
    any gate. Scalar gates at one leave the logits as they are."""
    values = (lambda model, layer: model.model.layers[layer].self_attn.v_proj.linear, lambda j: range(j * 8, j * 8 + 8),
              2)
    check_masking_equals_zeroed_values(build, "dec_self", values, tiny_inputs())
    check_gates_at_one_change_nothing(build(), tiny_inputs())


@pytest.mark.parametrize("kv_head", [0, 1])
def test_masking_in_the_sliding_layer_equals_zeroed_values(kv_head):
    """Layer 0 (sliding window, its key/value convolutions a static depthwise Conv1d in float32): masking the query
    heads of key/value head j equals zeroing j's rows of v_proj.linear, to float32's rounding."""
    inputs = tiny_inputs()
    model = build()
    heads = [2 * kv_head, 2 * kv_head + 1]
    with mask_heads(model, {("dec_self", 0): heads}):
        masked = logits(model, inputs)
    with torch.no_grad():
        model.model.layers[0].self_attn.v_proj.linear.weight[kv_head * 8:kv_head * 8 + 8] = 0
    reference = logits(model, inputs)
    torch.testing.assert_close(masked, reference, atol=1e-6, rtol=0)


@pytest.mark.parametrize("layer", [0, 1])
def test_each_heads_gate_multiplies_that_head_only(layer):
    """Head 1's gate rows changed: the logits change, unless head 1 is masked (then nothing changes)."""
    inputs = tiny_inputs()
    model = build()
    before = logits(model, inputs)
    with mask_heads(model, {("dec_self", layer): [1]}):
        masked = logits(model, inputs)
    with torch.no_grad():
        model.model.layers[layer].self_attn.o_proj.gate_proj.weight[8:16] *= -3
    assert not torch.allclose(logits(model, inputs), before)
    with mask_heads(model, {("dec_self", layer): [1]}):
        assert torch.equal(logits(model, inputs), masked)


def test_the_multimodal_model_is_analysed_as_its_language_model():
    """Inkling2ForConditionalGeneration (a tiny vision tower around the text model): its language model's blocks."""
    from transformers import AutoModelForImageTextToText

    vision = dict(text_hidden_size=32, hidden_size=16, intermediate_size=20, num_hidden_layers=1, num_attention_heads=2)
    cfg = CONFIG_MAPPING["inkling2"](text_config=config().to_dict(), vision_config=vision)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(cfg).eval()
    blocks = [b for b in attention_blocks(model) if b.name.startswith("model.language_model.")]
    assert [(b.layer, b.n_heads, b.n_kv_heads) for b in blocks] == [(0, 4, 2), (1, 4, 2)]


@pytest.mark.parametrize("layer", [0, 1])
def test_pruning_is_refused_before_any_work_naming_what_it_does_not_slice(layer):
    """The sinks', relative bias's and query norm's per-head rows and the key/value convolutions' channels are not
    sliced (Inkling's k_sconv/v_sconv are refused so too): refused, the model unchanged."""
    model = build()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with pytest.raises(HeadlabError, match=rf"model\.layers\.{layer}\.self_attn .*physical pruning is refused: .*"
                                           r"q_proj\.norm\.scale.*sink_proj.*relative_position_bias.*k_proj\.sconv"):
        prune_heads(model, {("dec_self", 0): [1], ("dec_self", 1): [0]} if layer == 0 else {("dec_self", 1): [0]})
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())


def test_lrp_is_refused_before_any_work_naming_the_parts_without_a_rule():
    from headlab.importance.rules import check_rules

    with pytest.raises(HeadlabError, match=r"LRP: no rule for the attention of model\.layers\.0\.self_attn .*block "
                                           r"attention residuals.*dynamic key/value short convolutions"):
        check_rules(build())


def test_converted_whole_to_float64_it_is_refused_saying_why():
    """model.double() makes its float32 router weights float64, and its forward's float32 product then fails: refused
    naming that (before: "cannot read the output width of Inkling2QueryProjection", from the name-based fallback)."""
    with pytest.raises(HeadlabError, match=r"model_type 'inkling2_text'\): the probe forward pass .* failed .*"
                                           r"Inkling2 keeps modules in float32"):
        attention_blocks(build().double())


def test_headlabs_attention_function_is_not_used_for_its_sinks():
    """Its sinks (sinks=, a logit per head and query) are not headlab's function's: the streaming engines take the
    eager maps, and the function itself refuses them rather than leave them out."""
    from headlab.attention import attention_forward
    from headlab.capture import not_streamable

    model = build()
    assert not_streamable(model) == ("its attention has sinks (sinks=), which headlab's attention function does not "
                                     "implement (model.layers.0.self_attn)")
    query = torch.zeros(1, 4, 3, 8)
    with pytest.raises(NotImplementedError, match="attention sinks handed as sinks="):
        attention_forward(model.model.layers[0].self_attn, query, query, query, None, sinks=torch.zeros(1, 4, 3, 1))


def test_confidence_is_the_same_on_every_engine():
    """The fused, chunked and default engines cannot run headlab's attention function on it (its sinks): they take
    the eager maps (stream_attention's fallback) and give eager's scores (before this session's fix of unregistrable:
    the fused engine crashed mid-forward on the sinks, experiments/fused_sweep.py)."""
    import numpy as np

    from headlab.importance import ImportanceData, compute_confidence, describe_model

    model = build()
    info = describe_model(model)
    data = ImportanceData.from_ids([[5, 17, 33, 41, 8, 1], [9, 60, 22, 1], [70, 12, 45, 31, 28, 90, 3, 1]])
    eager = compute_confidence(model, data, info, batch_size=2, engine="eager")
    for engine, query_chunk in (("fused", None), ("chunked", 2), (None, 3)):
        streamed = compute_confidence(model, data, info, batch_size=2, engine=engine, query_chunk=query_chunk)
        for kind in eager.kinds:
            np.testing.assert_allclose(streamed[kind], eager[kind], rtol=1e-6, atol=1e-12)


def test_analyze_end_to_end(tmp_path):
    """`headlab analyze --ablation` on a saved tiny model: every stage but LRP done (LRP refused, naming the parts),
    a score row per layer (before: every stage refused with the model)."""
    import json

    from support.family_matrix import ANALYZE_STAGES, analyze, save_tiny, treebank_files

    model = build()
    save_tiny(model, tmp_path / "model", treebank_files(tmp_path))
    code, stages = analyze(tmp_path / "model", tmp_path)
    for name in ANALYZE_STAGES:
        if name != "lrp":
            assert stages[name]["status"] == "done", stages[name]
    assert "block attention residuals" in json.dumps(stages["lrp"]), stages["lrp"]
    rows = json.loads((tmp_path / "out" / "importance" / "confidence.json").read_text())["scores"]["dec_self"]
    assert [all(v is None for v in row) for row in rows] == [False] * 2
