"""Physical pruning of Doge (``DogeAttention``, transformers 5.24): exact while every key/value head stays.

Doge adds a dynamic mask to each head's attention logits: ``dt = exp(A * softplus(dt_proj(values)))``, one value per
key/value head and key position, ``dt_proj`` reading the values of every key/value head of the layer (concatenated),
``A`` one entry per key/value head; the mask ``[batch, kv heads, q, k]`` (its top ``keep_window_size`` keys kept per
row when the row is longer) is repeated over each group's query heads (``repeat_kv``). So:

* removing query heads while each key/value head keeps one (or removing all of a layer's) leaves every mask as it
  was: pruning keeps ``A`` and ``dt_proj`` (its rows and columns per key/value head); where groups become uneven and
  headlab repeats key/value heads (group size 1), ``A`` and ``dt_proj``'s rows are repeated with them and
  ``dt_proj``'s columns of a head are kept once, at its first copy (the copies read the same values; zeros at the
  others), so the masks are the same numbers;
* removing a whole group removes a key/value head's values from ``dt_proj``'s input, which changes the masks of
  the kept heads: refused before any work, naming why.

Session 26 refused Doge's pruning altogether (``A``: "per-head parameters of its own").

Tiny models (hidden 32, 2 layers, 4 query heads over 2 key/value heads of 8), ``A`` set far from zero and
different per key/value head (at its initial zeros the mask is the constant 1, which changes no softmax),
``keep_window_size`` 4 so that the top-k of the mask runs on the 7-token probe and in generation.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from headlab import attention_blocks, mask_heads, prune_heads
from headlab.errors import PruningNotExact
from support.family_matrix import (
    check_pruned_generates_as_masked,
    check_pruned_reloads,
    padded_inputs,
    padded_logits,
    perturbed_model,
)

_CONFIG = dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, max_position_embeddings=64, bos_token_id=0, eos_token_id=1,
               pad_token_id=2, keep_window_size=4, attention_bias=True)
A = torch.tensor([[-1.5, 0.8], [0.7, -2.0]])  # per layer, per key/value head
ALL = [0, 1, 2, 3]
SPECS = {  # removed heads -> heads left per layer
    # layer 0 emptied; layer 1 loses head 1: uneven groups, its key/value heads repeated (group size 1)
    "emptied": ({("dec_self", 0): ALL, ("dec_self", 1): [1]}, [0, 3]),
    "one per group": ({("dec_self", 0): [0, 3], ("dec_self", 1): [2]}, [2, 3]),
}


def doge(attn_implementation: str = "eager") -> torch.nn.Module:
    model = perturbed_model(tf.DogeForCausalLM, tf.DogeConfig(**_CONFIG), attn_implementation=attn_implementation)
    with torch.no_grad():
        for layer, values in zip(model.model.layers, A):
            layer.self_attn.A.copy_(values)
    return model


def _attention(model, layer: int) -> torch.nn.Module:
    return model.model.layers[layer].self_attn


def test_the_dynamic_mask_matters_and_its_slices_follow_the_key_value_heads():
    """``A`` and ``dt_proj`` change the output. Layer 1 pruned to heads 0, 2 and 3 (uneven groups: key/value heads
    0, 1, 1): ``A`` is [A0, A1, A1], ``dt_proj``'s rows 0, 1, 1 and its columns head 0's, head 1's, then zeros;
    pruned again in the current numbering (original head 2), the copies' columns are summed into the one kept."""
    ids, mask = padded_inputs(pad_id=2)
    model = doge()
    before = padded_logits(model, ids, mask)
    with torch.no_grad():
        _attention(model, 1).A.zero_()
    assert not torch.allclose(padded_logits(model, ids, mask), before, atol=1e-3)

    model = doge()
    weight, bias = (p.detach().clone() for p in (_attention(model, 1).dt_proj.weight, _attention(model, 1).dt_proj.bias))
    spec = {("dec_self", 1): [1]}
    with mask_heads(model, spec):
        expected = padded_logits(model, ids, mask)
    prune_heads(model, spec)
    attention = _attention(model, 1)
    assert torch.equal(attention.A.detach(), A[1, [0, 1, 1]])
    assert torch.equal(attention.dt_proj.bias.detach(), bias[[0, 1, 1]])
    assert torch.equal(attention.dt_proj.weight.detach(),
                       torch.cat([weight[[0, 1, 1]], torch.zeros(3, 8)], dim=1))
    torch.testing.assert_close(padded_logits(model, ids, mask), expected, atol=1e-5, rtol=0)

    with mask_heads(model, {("dec_self", 1): [1]}):
        expected = padded_logits(model, ids, mask)
    prune_heads(model, {("dec_self", 1): [1]})  # original head 2: key/value head 1's first copy goes
    assert [b.n_heads for b in attention_blocks(model)] == [4, 2]
    attention = _attention(model, 1)
    assert torch.equal(attention.A.detach(), A[1])
    assert torch.equal(attention.dt_proj.weight.detach(), weight)  # the one copy left holds head 1's columns
    torch.testing.assert_close(padded_logits(model, ids, mask), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("spec_name", SPECS)
def test_doge_pruned_equals_masking_generates_and_reloads(spec_name, attn_implementation, tmp_path):
    """Pruning that keeps every key/value head equals masking on padded rows and in cached generation (eager and
    SDPA attention, both handed the dynamic mask), and reloads with load_pruned and with plain transformers (remote
    code), every weight loaded (SDPA: what both load, so that load_pruned's logits are the pruned model's bit for
    bit). Before: refused."""
    spec, heads_left = SPECS[spec_name]
    model = doge(attn_implementation)
    ids, mask = padded_inputs(pad_id=2)
    expected, expected_tokens = check_pruned_generates_as_masked(model, spec, heads_left, ids, mask, atol=1e-5)
    if attn_implementation == "sdpa":
        check_pruned_reloads(model, tmp_path, heads_left, ids, mask, expected, expected_tokens)


def test_doge_passes_check_prunable_and_is_left_as_it_was():
    """A long run that ends in pruning (prune train, sweeps) is not refused: its sample (a layer emptied, one head
    of the next removed) keeps every key/value head."""
    from headlab.surgery import check_prunable

    model = doge()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    check_prunable(model)
    assert {n: p.shape for n, p in model.named_parameters()} == {n: w.shape for n, w in weights.items()}
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("first", [None, {("dec_self", 1): [1]}])
def test_removing_a_whole_key_value_group_is_refused_before_any_work_naming_why(first):
    """Query heads 0 and 1 of layer 1 are key/value head 0's group: without its values ``dt_proj`` gives key/value
    head 1 another mask (unrefused, headlab's check finds the pruned model off the masked one). Refused before
    anything runs, the model left as it was; also after an earlier prune that left layer 1 heads 0, 2 and 3 over
    key/value heads 0, 1, 1, where removing current head 0 alone takes key/value head 0."""
    model = doge()
    if first is not None:
        prune_heads(model, first)
    removed = [0] if first is not None else [0, 1]
    attention_blocks(model)  # discovery's probe pass (once, cached): not the pruning's work
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    calls: list = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    pattern = (r"doge: dec_self layer 1: removing query heads .* removes key/value head 0 \(its whole group\).*"
               r"dt_proj computes each key/value head's dynamic mask .* from the values of every key/value head")
    with pytest.raises(PruningNotExact, match=pattern):
        prune_heads(model, {("dec_self", 1): removed})
    assert not calls
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())


def test_a_doge_with_one_query_head_per_key_value_head_refuses_check_prunable():
    """Without grouping every removed head takes its key/value head along: check_prunable (head 0 of layer 1)
    refuses, naming why, before a long run."""
    from headlab.surgery import check_prunable

    model = perturbed_model(tf.DogeForCausalLM, tf.DogeConfig(**{**_CONFIG, "num_key_value_heads": 4}),
                            attn_implementation="eager")
    with pytest.raises(PruningNotExact, match=r"removes key/value head 0 \(its whole group\)"):
        check_prunable(model)
