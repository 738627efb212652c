"""Gates, masks and physical pruning: the invariants of DESIGN.md on every family."""

import json

import pytest
import torch

from headlab import (
    ConstantGates,
    HeadlabError,
    ScalarGates,
    attach_gates,
    attention_blocks,
    count_parameters,
    detach_gates,
    gates_attached,
    load_pruned,
    mask_heads,
    prune_heads,
    save_pruned,
)
from headlab.surgery import PRUNING_FILE, ZeroHeadAttention
from support.models import FAMILIES, logits, tiny_inputs, tiny_model


def _spec(model):
    """One head of the first block, all heads of the second, two of the last."""
    blocks = attention_blocks(model)
    spec = {blocks[0].key: [1], blocks[-1].key: [0, 2]}
    spec[blocks[1].key] = [0, 1, 2, 3]
    return spec


@pytest.mark.parametrize("family", FAMILIES)
def test_gates_at_one_and_detached_hooks_change_nothing(family):
    model, inputs = tiny_model(family), tiny_inputs(family)
    before = logits(model, inputs)
    gates = ScalarGates.for_model(model)
    with gates_attached(model, gates):
        assert any(name.startswith("headlab_gates.") for name, _ in model.named_parameters())
        assert any(key.startswith("headlab_gates.") for key in model.state_dict())
        assert torch.equal(logits(model, inputs), before)
    assert not any(key.startswith("headlab_gates.") for key in model.state_dict())
    assert all(not b.o._forward_pre_hooks for b in attention_blocks(model))
    assert torch.equal(logits(model, inputs), before)


@pytest.mark.parametrize("family", ["marian", "bert", "gpt2", "t5", "llama"])
def test_masking_equals_hand_computation(family):
    """Zero head h's slice of the output projection's input by hand, and compare."""
    model, inputs = tiny_model(family), tiny_inputs(family)
    block = attention_blocks(model)[1]
    head = 2
    d = block.d_head

    def zero_slice(module, args):
        x = args[0].clone()
        x[..., head * d:(head + 1) * d] = 0
        return (x,)

    handle = block.o.register_forward_pre_hook(zero_slice)
    expected = logits(model, inputs)
    handle.remove()
    with mask_heads(model, {block.key: [head]}):
        assert torch.equal(logits(model, inputs), expected)
    assert not torch.equal(logits(model, inputs), expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_pruning_equals_masking(family, tmp_path):
    model, inputs = tiny_model(family), tiny_inputs(family)
    spec = _spec(model)
    with mask_heads(model, spec):
        masked = logits(model, inputs)
    blocks = {b.key: b for b in attention_blocks(model)}
    before = count_parameters(model)
    prune_heads(model, spec)
    torch.testing.assert_close(logits(model, inputs), masked, atol=1e-5, rtol=0)

    # Parameters drop by exactly the removed slices (uniform GQA pruning keeps this exact too).
    removed = 0
    for key, heads in spec.items():
        block = blocks[key]
        width = block.q.in_features if block.q is not None else block.qkv.weight.shape[0]
        d, n = block.d_head, len(heads)
        q_bias = block.q.bias is not None if block.q is not None else True
        kv_heads = n if block.n_kv_heads == block.n_heads else None
        if kv_heads is None:  # GQA: which key/value heads went depends on the groups
            after = {b.key: b for b in attention_blocks(model)}[key]
            kv_heads = block.n_kv_heads - after.n_kv_heads
        removed += n * d * (width + q_bias)  # q rows
        removed += 2 * kv_heads * d * (width + q_bias)  # k and v rows
        removed += n * d * block.o.weight.shape[0 if hasattr(block.o, "in_features") else 1]  # o columns
    if family not in ("llama", "qwen2"):
        assert before - count_parameters(model) == removed
    after = {b.key: b for b in attention_blocks(model)}
    assert after[attention_blocks(model)[1].key].n_heads == 0
    assert isinstance(after[attention_blocks(model)[1].key].core, ZeroHeadAttention)

    save_pruned(model, tmp_path / "pruned")
    reloaded = load_pruned(tmp_path / "pruned")
    assert torch.equal(logits(reloaded, inputs), logits(model, inputs))
    assert [b.n_heads for b in attention_blocks(reloaded)] == [b.n_heads for b in attention_blocks(model)]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_gqa_kv_head_goes_only_with_its_whole_group(family):
    model, inputs = tiny_model(family), tiny_inputs(family)
    key = attention_blocks(model)[0].key  # 4 query heads over 2 key/value heads: groups {0,1}, {2,3}
    with mask_heads(model, {key: [0, 1]}):
        masked = logits(model, inputs)
    before = count_parameters(model)
    prune_heads(model, {key: [0, 1]})
    block = attention_blocks(model)[0]
    assert (block.n_heads, block.n_kv_heads) == (2, 1)
    assert block.core.num_key_value_groups == 2
    torch.testing.assert_close(logits(model, inputs), masked, atol=1e-5, rtol=0)
    d, width = 8, 32
    bias = 1 if family == "qwen2" else 0
    assert before - count_parameters(model) == 2 * d * (width + bias) + 2 * d * (width + bias) + 2 * d * width
    # Uneven groups: head 2 alone goes; group {3} keeps its key/value head, group {0,1} too.
    model = tiny_model(family)
    with mask_heads(model, {key: [2]}):
        masked = logits(model, inputs)
    prune_heads(model, {key: [2]})
    torch.testing.assert_close(logits(model, inputs), masked, atol=1e-5, rtol=0)


def _generate(model, inputs, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The generated ids and every step's scores [steps, batch x beams, vocab]."""
    out = model.generate(**inputs, **kwargs, output_scores=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.scores)


def _assert_same_generation(actual, expected) -> None:
    """Same ids and same scores at every step: a wrong position or position bias at a later step
    can shift the scores of a tiny random model without changing its greedy choice (a T5
    position bias computed without the cache's length did so under transformers 5.24)."""
    assert torch.equal(actual[0], expected[0])
    torch.testing.assert_close(actual[1], expected[1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["marian", "t5", "gpt2", "llama"])
def test_generation_after_pruning_matches_masked_generation(family):
    model, inputs = tiny_model(family), tiny_inputs(family, batch=1, pad=False)
    inputs.pop("decoder_input_ids", None)
    spec = _spec(model)
    kwargs = dict(max_new_tokens=6, min_new_tokens=6, num_beams=1, do_sample=False)
    with mask_heads(model, spec):
        expected = _generate(model, inputs, **kwargs)
    prune_heads(model, spec)
    _assert_same_generation(_generate(model, inputs, **kwargs), expected)


@pytest.mark.parametrize("family", ["marian", "t5", "gpt2", "llama"])
def test_generation_with_no_head_left_in_the_first_decoder_layer(family):
    """transformers reads the cache's length (the next position) from layer 0 and counts an empty
    cache as length 0: a first decoder layer with no head must still keep its cache in step
    (found when an all-kinds sweep point that emptied dec_self layer 0 translated with its
    positions stuck at the start)."""
    model, inputs = tiny_model(family), tiny_inputs(family, batch=2, pad=False)
    inputs.pop("decoder_input_ids", None)
    self_blocks = [b for b in attention_blocks(model) if b.kind in ("dec_self", "self")]
    first = min(self_blocks, key=lambda b: b.layer)
    spec = {first.key: list(range(first.n_heads))}
    kwargs = dict(max_new_tokens=8, min_new_tokens=8, num_beams=1, do_sample=False)
    with mask_heads(model, spec):
        expected = _generate(model, inputs, **kwargs)
    prune_heads(model, spec)
    assert isinstance({b.key: b for b in attention_blocks(model)}[first.key].core, ZeroHeadAttention)
    _assert_same_generation(_generate(model, inputs, **kwargs), expected)
    beams = dict(kwargs, num_beams=3)  # beam search reorders the cache, the empty layer's too
    model_masked = tiny_model(family)
    with mask_heads(model_masked, spec):
        expected = _generate(model_masked, inputs, **beams)
    _assert_same_generation(_generate(model, inputs, **beams), expected)


def test_pruning_twice_composes_and_records_original_numbering(tmp_path):
    model, inputs = tiny_model("marian"), tiny_inputs("marian")
    with mask_heads(model, {("enc_self", 0): [0, 2]}):
        masked = logits(model, inputs)
    kept = prune_heads(model, {("enc_self", 0): [0]})
    assert kept[("enc_self", 0)] == [1, 2, 3]
    kept = prune_heads(model, {("enc_self", 0): [1]})  # current head 1 = original head 2
    assert kept[("enc_self", 0)] == [1, 3]
    torch.testing.assert_close(logits(model, inputs), masked, atol=1e-5, rtol=0)
    save_pruned(model, tmp_path / "m")
    record = json.loads((tmp_path / "m" / PRUNING_FILE).read_text())
    assert record["blocks"]["enc_self"]["0"]["kept_heads"] == [1, 3]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_masks_and_pruning_in_half_precision(dtype):
    model, inputs = tiny_model("marian").to(dtype), tiny_inputs("marian")
    spec = {("enc_self", 1): [3], ("dec_cross", 0): [0, 1]}
    with mask_heads(model, spec):
        masked = logits(model, inputs)
    prune_heads(model, spec)
    pruned = logits(model, inputs)
    assert pruned.dtype == dtype
    torch.testing.assert_close(pruned, masked, atol=1e-2, rtol=1e-2)
    assert all(p.dtype == dtype for p in model.parameters())


def test_bad_specs_are_clear_errors_and_change_nothing():
    model, inputs = tiny_model("marian"), tiny_inputs("marian")
    before = logits(model, inputs)
    n_params = count_parameters(model)
    for spec, message in [
        ({("enc_self", 0): [4]}, "no head 4"),
        ({("enc_self", 9): [0]}, "no layer 9"),
        ({("encoder", 0): [0]}, "unknown attention kind"),
        ({"enc_self": [0]}, "keys must be"),
        ({("enc_self", 0): [0], ("enc_self", 1): [7]}, "no head 7"),
    ]:
        with pytest.raises(HeadlabError, match=message):
            prune_heads(model, spec)
        with pytest.raises(HeadlabError, match=message):
            with mask_heads(model, spec):
                pass
    assert count_parameters(model) == n_params
    assert torch.equal(logits(model, inputs), before)
    assert not hasattr(model, "headlab_gates")


def test_gates_of_the_wrong_shape_are_refused():
    model = tiny_model("marian")
    gates = ScalarGates({("enc_self", 0): 3})
    with pytest.raises(HeadlabError, match="have 3 heads; the model has 4"):
        attach_gates(model, gates)
    assert not hasattr(model, "headlab_gates")
    gates = ScalarGates({("dec_self", 5): 4})
    with pytest.raises(HeadlabError, match="no layer 5"):
        attach_gates(model, gates)


def test_gate_sets_stack_and_detach_one_at_a_time():
    model, inputs = tiny_model("marian"), tiny_inputs("marian")
    blocks = attention_blocks(model)
    half = ConstantGates.from_mask(blocks, {("enc_self", 0): [1]}, value=0.5)
    other = ConstantGates.from_mask(blocks, {("enc_self", 0): [1, 2]}, value=0.5)
    product = ConstantGates.from_mask(blocks, {("enc_self", 0): [1, 2]}, value=0.5)
    product.enc_self_0[1] = 0.25
    with gates_attached(model, product):
        both = logits(model, inputs)
    with gates_attached(model, other):
        alone = logits(model, inputs)
    hooks = sum(len(m._forward_pre_hooks) for m in model.modules())
    first = attach_gates(model, half)
    attach_gates(model, other)
    assert {"headlab_gates.enc_self_0", "headlab_gates_1.enc_self_0"} <= set(model.state_dict())
    assert sum(len(m._forward_pre_hooks) for m in model.modules()) == hooks + 1  # one hook for the block
    torch.testing.assert_close(logits(model, inputs), both)
    model.apply(lambda module: None)  # nn.Module.apply reaches the gate modules (not shadowed by them)
    with mask_heads(model, {("enc_self", 0): [3]}):  # a mask stacks on both and leaves with its block
        assert not torch.allclose(logits(model, inputs), both)
    torch.testing.assert_close(logits(model, inputs), both)
    assert first.remove() is half
    torch.testing.assert_close(logits(model, inputs), alone)
    assert detach_gates(model) is other
    assert not any(k.startswith("headlab_gates") for k in model.state_dict())
    assert sum(len(m._forward_pre_hooks) for m in model.modules()) == hooks


def test_per_example_gates_and_gradients_reach_the_gates():
    model, inputs = tiny_model("bart"), tiny_inputs("bart")
    gates = ScalarGates.for_model(model)
    with gates_attached(model, gates):
        model(**inputs).logits.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in gates.parameters())


def test_load_pruned_rejects_a_record_that_does_not_match(tmp_path):
    model = tiny_model("marian")
    prune_heads(model, {("enc_self", 0): [1, 2]})
    save_pruned(model, tmp_path / "m")
    path = tmp_path / "m" / PRUNING_FILE
    record = json.loads(path.read_text())
    record["blocks"]["enc_self"]["0"]["kept_heads"] = [0, 1, 2]
    record["blocks"]["enc_self"]["0"]["kept_kv_heads"] = [0, 1, 2]
    path.write_text(json.dumps(record))
    with pytest.raises(HeadlabError, match="weights do not match"):
        load_pruned(tmp_path / "m")
    record["blocks"]["enc_self"]["0"]["kept_heads"] = [0, 9]
    record["blocks"]["enc_self"]["0"]["kept_kv_heads"] = [0, 9]  # else: 2 heads do not group over 3
    path.write_text(json.dumps(record))
    with pytest.raises(HeadlabError, match="does not fit the model"):
        load_pruned(tmp_path / "m")
    path.write_text("{not json")
    with pytest.raises(HeadlabError, match="line 1"):
        load_pruned(tmp_path / "m")
    with pytest.raises(HeadlabError, match="no headlab_pruning.json"):
        load_pruned(tmp_path)


def test_masking_a_head_of_a_layer_pruned_to_no_head_says_so():
    """A layer pruned to zero heads: a mask naming one of its heads said "has heads 0..-1"."""
    model = tiny_model("gpt2")
    prune_heads(model, {("dec_self", 1): [0, 1, 2, 3]})
    with pytest.raises(HeadlabError, match=r"^dec_self layer 1 has no heads left \(pruned\); no head 0$"):
        with mask_heads(model, {("dec_self", 1): [0]}):
            pass
