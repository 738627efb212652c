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

Inkling2-Loop (``inkling2_loop_text``, ``inkling2_loop``; transformers 5.24's models/inkling2_loop) runs its loop
layers ``loop_num_passes`` times per forward, each pass from the pre-loop states with messages of the previous pass
mixed into its inputs through gates: each run of a loop layer's attention is a block of its own depth (ALBERT's shared
module: ``block.application``), numbered as output_attentions lists the calls (adapters.families.LOOPED_LAYERS).

Before: both refused before any work (adapters.families.OUTPUT_GATES_REFUSED), every test here failing with the
refusal. Now: analysed (capture equals output_attentions and a by-hand softmax with the bias and the sinks, in float64)
and masked (equal to zeroing a key/value head's values, at one run of a loop layer only; gates at one change nothing).
LRP (session 42; refused before any work in sessions 40 and 41, families.LRP_REFUSED): tests/test_lrp_inkling2.py.
Physical pruning (session 41; before, refused before any work: families.PRUNING_REFUSED) slices each head's rows of q,
the gate, ``sink_proj``, ``relative_position_bias.linear`` and both norms' scales, and each key/value head's channels
of the key/value short convolutions (static: the depthwise Conv1d's kernels; dynamic: ``static_weight``'s columns and
``weight_proj``'s kernel rows), setting the sub-modules' ``num_heads``; a loop layer's module is pruned as ALBERT's
shared module, the same heads at each of its depths.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from headlab import HeadlabError, attention_blocks, capture_attention, mask_heads, prune_heads
from headlab.checkpoint import model_class_for
from support.family_matrix import (
    check_capture_equals_output_attentions,
    check_confidence_on_every_engine,
    check_gates_at_one_change_nothing,
    check_masking_equals_zeroed_values,
    check_pruned_generates_as_masked,
    check_pruned_reloads,
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
# Inkling2-Loop: four decoder layers, 1 and 2 looped twice: depths 0 (layer 0), 1, 2 (pass 0), 3, 4 (pass 1), 5 (layer 3)
LOOP = dict(num_hidden_layers=4, layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"],
            loop_layer_index_start=1, loop_layer_index_end=3, loop_num_passes=2, loop_gate_rank=8)
DEPTHS = {"inkling2_text": [0, 1], "inkling2_loop_text": [0, 1, 2, 1, 2, 3]}  # the decoder layer run at each depth
TYPES = tuple(DEPTHS)


def config(model_type: str = "inkling2_text", **extra):
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {model_type}")
    return CONFIG_MAPPING[model_type](**{**SIZES, **(LOOP if "loop" in model_type else {}), **extra})


def build(attn_implementation: str = "eager", seed: int = 0, dtype: torch.dtype = torch.float32,
          model_type: str = "inkling2_text") -> torch.nn.Module:
    """The tiny model, its parameters off their initial values (zeros, ones) so that each part counts: the block
    residuals' queries, the dynamic convolutions' static taps, the norms' scales. In float64 through transformers'
    dtype=, which keeps its float32 modules (the model converted whole fails: a float32 product inside)."""
    cfg = config(model_type)
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


@pytest.mark.parametrize("model_type", TYPES)
def test_blocks_are_its_attention_layers_not_its_block_residuals(model_type):
    """One block per depth, numbered as transformers' output_attentions lists the calls (before: refused); Inkling2-Loop's
    loop layers are a block at each pass (ALBERT's shared module: its application-th call of a pass of the text
    model). The block attention residuals (attention_input, mlp_input, final_input), which call the attention
    interface over depth, are none."""
    model = build(model_type=model_type)
    blocks = attention_blocks(model)
    depths = DEPTHS[model_type]
    assert [(b.kind, b.layer, b.name, b.n_heads, b.n_kv_heads, b.d_head) for b in blocks] == [
        ("dec_self", depth, f"model.layers.{layer}.self_attn", 4, 2, 8) for depth, layer in enumerate(depths)]
    assert [(b.application, b.applications) for b in blocks] == [
        (depths[:depth].count(layer), depths.count(layer)) for depth, layer in enumerate(depths)]
    assert all(b.scope is model.model for b in blocks if b.shared)
    # q/k/v tied in the full-attention layers too (families.QKV_APART: their inputs differ); the rows per head
    assert [(b.family.q, b.family.k, b.family.v) for b in blocks] == [
        ("q_proj.linear", "k_proj.linear", "v_proj.linear")] * len(blocks)
    assert blocks[0].family.head_rows == (("o_proj.gate_proj", ("head_dim",)), ("sink_proj", (1,)),
                                          ("relative_position_bias.linear", (4,)))


@pytest.mark.parametrize("model_type", TYPES)
def test_capture_equals_output_attentions(model_type):
    """Padded batch: the maps are transformers' own output_attentions, depth by depth (the sink's share left out)."""
    model, record = check_capture_equals_output_attentions(lambda **kw: build(model_type=model_type, **kw), "dec_self",
                                                           tiny_inputs(), n_layers=len(DEPTHS[model_type]))
    for probs in record.values():
        assert bool((probs.sum(-1) < 1).all())  # the sinks take a share of every row


def _recorded_calls(monkeypatch, model_type: str) -> list[dict]:
    """Every call of Inkling2's (Inkling2-Loop's) eager attention function by an attention layer, with what it was
    handed."""
    import importlib

    name = model_type.removesuffix("_text")
    modeling = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    prefix = "Inkling2Loop" if "loop" in name else "Inkling2"
    layers = (getattr(modeling, f"{prefix}SlidingAttention"), getattr(modeling, f"{prefix}FullAttention"))
    calls: list[dict] = []
    eager = modeling.eager_attention_forward

    def recording(module, query, key, value, attention_mask, **kwargs):
        if isinstance(module, layers):
            calls.append(dict(query=query, key=key, mask=attention_mask, **kwargs))
        return eager(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setattr(modeling, "eager_attention_forward", recording)
    return calls


@pytest.mark.parametrize("model_type", TYPES)
def test_capture_is_the_softmax_with_the_position_bias_and_the_sinks_by_hand(monkeypatch, model_type):
    """In float64, padded: each map is softmax([q k^T * scale + relative bias + mask | sink]) without the sink's
    column, computed here from what the attention function was handed, to 1e-12. Inkling2's eager takes that softmax
    in float32 (``torch.cat([...]).float()``) whatever the model's dtype, so the reference does too (and is float64's
    to float32's rounding); the bias and the sinks matter."""
    model = build(dtype=torch.float64, model_type=model_type)
    inputs = tiny_inputs()
    calls = _recorded_calls(monkeypatch, model_type)
    with capture_attention(model) as record:
        logits(model, inputs)
    assert len(calls) == len(DEPTHS[model_type])
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
    check_gates_at_one_change_nothing(build(model_type="inkling2_loop_text"), tiny_inputs())


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
@pytest.mark.parametrize("kv_head", [0, 1])
def test_masking_a_loop_depth_equals_zeroed_values_at_that_run_only(depth, kv_head):
    """Inkling2-Loop: masking the query heads of key/value head j at one depth of a loop layer equals zeroing j's value
    channels in that run of the layer only (a hook on v_proj.linear's output at that call; the module's weights serve
    both passes). The same heads masked at the other pass give other logits."""
    inputs = tiny_inputs()
    model = build(model_type="inkling2_loop_text")
    layer = DEPTHS["inkling2_loop_text"][depth]
    run = DEPTHS["inkling2_loop_text"][:depth].count(layer)
    heads = [2 * kv_head, 2 * kv_head + 1]
    with mask_heads(model, {("dec_self", depth): heads}):
        masked = logits(model, inputs)
    other = depth + 2 if depth < 3 else depth - 2
    with mask_heads(model, {("dec_self", other): heads}):
        assert not torch.allclose(logits(model, inputs), masked)
    calls = [0]

    def zeroed_at_that_run(module, args, output):
        calls[0] += 1
        if calls[0] - 1 == run:
            output = output.clone()
            output[..., kv_head * 8:kv_head * 8 + 8] = 0
        return output

    handle = model.model.layers[layer].self_attn.v_proj.linear.register_forward_hook(zeroed_at_that_run)
    try:
        reference = logits(model, inputs)
    finally:
        handle.remove()
    assert calls[0] == 2
    torch.testing.assert_close(masked, reference, atol=1e-6, rtol=0)


def test_a_loop_module_run_more_often_than_its_config_says_is_refused(monkeypatch):
    """Where the config's loop (LOOPED_LAYERS) does not account for a module's runs, it stays refused as a module run
    several times (before: every Inkling2-Loop module so, with the model type)."""
    from headlab import adapters

    monkeypatch.setitem(adapters.LOOPED_LAYERS, "inkling2_loop_text", lambda config: [0, 1, 2, 3])
    with pytest.raises(HeadlabError, match=r"model\.layers\.1\.self_attn: its forward ran the attention function 2 "
                                           "times in one pass"):
        attention_blocks(build(model_type="inkling2_loop_text"))


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


@pytest.mark.parametrize("model_type", TYPES)
def test_the_multimodal_model_is_analysed_as_its_language_model(model_type):
    """Inkling2ForConditionalGeneration, Inkling2LoopForConditionalGeneration (a tiny vision tower around the text
    model): its language model's blocks, numbered by depth (before: refused)."""
    from transformers import AutoModelForImageTextToText

    vision = dict(text_hidden_size=32, hidden_size=16, intermediate_size=20, num_hidden_layers=1, num_attention_heads=2)
    cfg = CONFIG_MAPPING[model_type.removesuffix("_text")](text_config=config(model_type).to_dict(),
                                                           vision_config=vision)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(cfg).eval()
    blocks = [b for b in attention_blocks(model) if b.name.startswith("model.language_model.")]
    assert [(b.layer, b.name, b.n_heads, b.n_kv_heads) for b in blocks] == [
        (depth, f"model.language_model.layers.{layer}.self_attn", 4, 2)
        for depth, layer in enumerate(DEPTHS[model_type])]
    assert all(b.scope is model.model.language_model for b in blocks if b.shared)


def _padded_ids() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 99, (2, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left-padded: the convolutions' conv_mask zeroes those positions
    return ids, mask


PRUNINGS = {  # name -> (removed heads per depth, heads left)
    # layer 0 (sliding, static convolutions) loses key/value head 0; layer 1 (full, dynamic) keeps both, a head each
    "partial": ({("dec_self", 0): [0, 1], ("dec_self", 1): [1, 2]}, [2, 2]),
    "uneven groups": ({("dec_self", 0): [0], ("dec_self", 1): [3]}, [3, 3]),  # a key/value head repeated
    "full layer emptied": ({("dec_self", 0): [1], ("dec_self", 1): [0, 1, 2, 3]}, [3, 0]),
    "sliding layer emptied": ({("dec_self", 0): [0, 1, 2, 3], ("dec_self", 1): [2, 3]}, [0, 2]),
}


@pytest.mark.parametrize("case", PRUNINGS)
def test_pruning_equals_masking_on_padded_rows_and_in_cached_generation_and_reloads(tmp_path, case):
    """Before (session 40): refused before any work (families.PRUNING_REFUSED)."""
    spec, left = PRUNINGS[case]
    model = build()
    ids, mask = _padded_ids()
    expected, tokens = check_pruned_generates_as_masked(model, spec, left, ids, mask)
    check_pruned_reloads(model, tmp_path, left, ids, mask, expected, tokens)


def test_pruning_keeps_each_parts_rows_of_the_kept_heads():
    """Query heads 2, 3 kept in both layers (key/value head 1): the rows of q, the gate, sink_proj, the relative bias's
    linear map and both norms' scales of heads 2, 3, its num_heads 2; key/value head 1's channels of the static
    convolutions (sliding layer) and of the dynamic ones' static taps, its kernel rows of weight_proj and num_heads 1
    (full layer)."""
    model = build()
    layers = [model.model.layers[i].self_attn for i in (0, 1)]
    before = [{n: p.detach().clone() for n, p in attention.named_parameters()} for attention in layers]
    prune_heads(model, {("dec_self", 0): [0, 1], ("dec_self", 1): [0, 1]})
    for attention, old in zip(layers, before):
        new = dict(attention.named_parameters())
        for name in ("q_proj.linear.weight", "o_proj.gate_proj.weight"):
            assert torch.equal(new[name], old[name][16:32])
        assert torch.equal(new["sink_proj.weight"], old["sink_proj.weight"][2:4])
        assert torch.equal(new["relative_position_bias.linear.weight"], old["relative_position_bias.linear.weight"][8:16])
        for name in ("q_proj.norm.scale", "relative_position_bias.norm.scale"):
            assert torch.equal(new[name], old[name][2:4])
        assert torch.equal(new["relative_position_bias.proj"], old["relative_position_bias.proj"])  # shared
        assert torch.equal(new["o_proj.linear.weight"], old["o_proj.linear.weight"][:, 16:32])
        assert attention.relative_position_bias.num_heads == 2
        for part in ("k_proj", "v_proj"):
            assert torch.equal(new[f"{part}.linear.weight"], old[f"{part}.linear.weight"][8:16])
    sliding, full = before
    for part in ("k_proj", "v_proj"):
        assert torch.equal(layers[0].get_parameter(f"{part}.sconv.conv1d.weight"), sliding[f"{part}.sconv.conv1d.weight"][8:16])
        assert torch.equal(layers[1].get_parameter(f"{part}.sconv.static_weight"), full[f"{part}.sconv.static_weight"][:, 8:16])
        kernel = full[f"{part}.sconv.static_weight"].shape[0]
        assert torch.equal(layers[1].get_parameter(f"{part}.sconv.weight_proj.weight"),
                           full[f"{part}.sconv.weight_proj.weight"][kernel:2 * kernel])
        assert layers[1].get_submodule(f"{part}.sconv").num_heads == 1


def test_a_part_not_one_row_per_head_is_refused_before_any_work():
    """A query norm's scale shared by the heads ([1, size], which the forward broadcasts) is not the table of rows per
    head that pruning slices: refused, naming it, the model unchanged."""
    model = build()
    norm = model.model.layers[0].self_attn.q_proj.norm
    norm.scale = torch.nn.Parameter(norm.scale.detach()[:1].clone())
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with pytest.raises(HeadlabError, match=r"model\.layers\.0\.self_attn .*physical pruning is refused: its "
                                           r"q_proj\.norm\.scale \[1, 8\] is not one row per query head of the 4"):
        prune_heads(model, {("dec_self", 0): [1]})
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())


@pytest.mark.parametrize("model_type", TYPES)
def test_in_float64_with_its_float32_convolutions_it_is_pruned(model_type):
    """Loaded in float64 (dtype=, its short convolutions kept in float32, computing in float32 whatever the dtype), a
    convolution over fewer channels rounds apart by float32's precision: the pruning check compares at float32's
    tolerance there (unpadded: in float64 eager its own padded rows are NaN, which the check names and works around)."""
    model = build(model_type=model_type, dtype=torch.float64)
    ids, _ = _padded_ids()
    if model_type == "inkling2_text":
        spec, left = {("dec_self", 0): [0, 1], ("dec_self", 1): [0, 1, 2, 3]}, [2, 0]
    else:
        spec, left = {("dec_self", 0): [1], ("dec_self", 1): [0, 1, 2, 3], ("dec_self", 3): [0, 1, 2, 3]}, [3, 0, 4, 0, 4, 4]
    check_pruned_generates_as_masked(model, spec, left, ids, torch.ones_like(ids))


LOOP_PRUNINGS = {  # depths 1, 3: layer 1 (full); 2, 4: layer 2 (sliding), each at passes 0 and 1
    "same heads at each depth": ({("dec_self", 1): [0], ("dec_self", 3): [0], ("dec_self", 5): [1, 2]},
                                 [4, 3, 4, 3, 4, 2]),
    # before the stand-in kept its cache at layer_idx + cache_offset, pass 1's placeholders went to pass 0's cache
    # layer: its keys twice as long, and the full-attention mask with them ("size of tensor a (7) must match (13)")
    "full loop layer emptied": ({("dec_self", 1): [0, 1, 2, 3], ("dec_self", 3): [0, 1, 2, 3]}, [4, 0, 4, 0, 4, 4]),
    "sliding loop layer emptied": ({("dec_self", 2): [0, 1, 2, 3], ("dec_self", 4): [0, 1, 2, 3],
                                    ("dec_self", 1): [3], ("dec_self", 3): [3]}, [4, 3, 0, 3, 0, 4]),
}


@pytest.mark.parametrize("case", LOOP_PRUNINGS)
def test_a_loop_layer_pruned_alike_at_each_depth_equals_masking_and_reloads(tmp_path, case):
    """A loop layer's attention is one module run at a depth per pass (ALBERT's shared module): removing the same
    heads at each of its depths prunes it, equal to masking them at every depth. Before: refused before any work."""
    spec, left = LOOP_PRUNINGS[case]
    model = build(model_type="inkling2_loop_text")
    ids, mask = _padded_ids()
    expected, tokens = check_pruned_generates_as_masked(model, spec, left, ids, mask)
    check_pruned_reloads(model, tmp_path, left, ids, mask, expected, tokens)


def test_a_loop_layer_pruned_otherwise_at_its_depths_is_refused_before_any_work():
    model = build(model_type="inkling2_loop_text")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with pytest.raises(HeadlabError, match=r"dec_self layers 1,3: their attention weights are shared by 2 depths "
                                           r"\(ALBERT's shared layers: one module, model\.layers\.1\.self_attn"):
        prune_heads(model, {("dec_self", 1): [0], ("dec_self", 3): [1]})
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())


@pytest.mark.parametrize("model_type", TYPES)
def test_converted_whole_to_float64_it_is_refused_saying_why(model_type):
    """model.double() makes its float32 router weights float64, and its forward's float32 product then fails: refused
    naming that (before: "cannot read the output width of Inkling2QueryProjection", from the name-based fallback)."""
    with pytest.raises(HeadlabError, match=rf"model_type '{model_type}'\): the probe forward pass .* failed .*"
                                           r"Inkling2 keeps modules in float32"):
        attention_blocks(build(model_type=model_type).double())


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


@pytest.mark.parametrize("model_type", TYPES)
def test_confidence_is_the_same_on_every_engine(model_type):
    """The fused, chunked and default engines cannot run headlab's attention function on it (its sinks): they take
    the eager maps (stream_attention's fallback) and give eager's scores (before this session's fix of unregistrable:
    the fused engine crashed mid-forward on the sinks, experiments/fused_sweep.py)."""

    from headlab.importance import ImportanceData, describe_model

    model = build(model_type=model_type)
    info = describe_model(model)
    data = ImportanceData.from_ids([[5, 17, 33, 41, 8, 1], [9, 60, 22, 1], [70, 12, 45, 31, 28, 90, 3, 1]])
    check_confidence_on_every_engine(model, data, info)


@pytest.mark.parametrize("model_type", TYPES)
def test_analyze_end_to_end(tmp_path, model_type):
    """`headlab analyze --ablation` on a saved tiny model: every stage done, LRP too (sessions 40 and 41: refused,
    naming the block attention residuals), a score row per depth (before: every stage refused with the model)."""
    import json

    from support.family_matrix import ANALYZE_STAGES, analyze, save_tiny, treebank_files

    model = build(model_type=model_type)
    save_tiny(model, tmp_path / "model", treebank_files(tmp_path))
    code, stages = analyze(tmp_path / "model", tmp_path)
    for name in ANALYZE_STAGES:
        assert stages[name]["status"] == "done", stages[name]
    for measure in ("confidence", "lrp"):
        rows = json.loads((tmp_path / "out" / "importance" / f"{measure}.json").read_text())["scores"]["dec_self"]
        assert [all(v is None for v in row) for row in rows] == [False] * len(DEPTHS[model_type])


@pytest.mark.parametrize("case", ["partial", "full layer emptied"])
def test_a_pruned_directory_re_saved_by_transformers_loads_as_saved(tmp_path, case):
    """A user loads headlab's directory with plain transformers (pruned_heads.py) and saves it again: the weights
    are stored under Inkling2's checkpoint names (transformers converts ``model.layers.N.self_attn.q_proj.linear`` to
    ``model.llm.layers.N.attn.wq_du`` on saving), where no head can be read off a module's shape, and there is no
    headlab_pruning.json; config.json keeps the plan (``headlab_pruned``), which names the kept heads, and the weights
    must fit it. Before (session 42): refused, "the weights do not match its config.json ... if it is a pruned model
    re-saved by transformers under the original checkpoint's tensor names, headlab cannot read its heads back"."""
    import transformers as tf

    from headlab import load_pruned, save_pruned
    from headlab.loading import load_model
    from support.family_matrix import padded_logits

    spec, left = PRUNINGS[case]
    model = build()
    prune_heads(model, spec)
    save_pruned(model, tmp_path / "pruned")
    tf.AutoModelForCausalLM.from_pretrained(tmp_path / "pruned", trust_remote_code=True).save_pretrained(
        tmp_path / "resaved")
    assert not (tmp_path / "resaved" / "headlab_pruning.json").exists()
    loaded = load_model(str(tmp_path / "resaved"))
    assert [b.n_heads for b in attention_blocks(loaded)] == left
    ids, mask = _padded_ids()
    assert torch.equal(padded_logits(loaded, ids, mask), padded_logits(model, ids, mask))
    with pytest.raises(HeadlabError, match=r"no headlab_pruning.json; its config.json holds a pruned model's plan "
                                           r"\(headlab_pruned\): a directory headlab saved, re-saved by transformers .* "
                                           r"load it with headlab.load_model"):
        load_pruned(tmp_path / "resaved")


def test_a_re_saved_directory_whose_plan_does_not_fit_its_weights_is_refused(tmp_path):
    """The plan names three heads kept in layer 0 where the weights hold two: refused, naming the tensors."""
    import json

    import transformers as tf

    from headlab import save_pruned
    from headlab.loading import load_model

    model = build()
    prune_heads(model, PRUNINGS["partial"][0])
    save_pruned(model, tmp_path / "pruned")
    tf.AutoModelForCausalLM.from_pretrained(tmp_path / "pruned", trust_remote_code=True).save_pretrained(
        tmp_path / "resaved")
    config_path = tmp_path / "resaved" / "config.json"
    config = json.loads(config_path.read_text())
    config["headlab_pruned"]["kept"]["model.layers.0.self_attn"] = [[1, 2, 3], [0, 1], 4]
    config_path.write_text(json.dumps(config))
    with pytest.raises(HeadlabError, match=r"weights do not match the heads its config.json's headlab_pruned or the "
                                           r"weights' shapes name \(no headlab_pruning.json\): .*k_proj.linear.weight"):
        load_model(str(tmp_path / "resaved"))
