"""Gemma 4 with ``attention_k_eq_v=True`` (session 39, keqv).

Its full-attention layers have no value projection: transformers' ``Gemma4TextAttention`` sets ``v_proj = None`` and
takes ``value_states = key_states`` from ``k_proj`` before ``k_norm`` and rotary (then ``v_norm``). Discovery ties the
query projection and ``k_proj`` as both the key and the value projection, so physical pruning slices a removed
key/value head's rows of ``k_proj`` once (its keys and its values); the sliding layers keep their ``v_proj``. Before,
these layers had no projections tied and pruning was refused ("this family's projection layout is unknown"), and so was
LRP. LRP's rule holds the keys constant at ``k_norm``'s output here (``rules.KEYS_ONLY``), not at ``k_proj``'s, whose
output the values are too.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from headlab import HeadlabError, attention_blocks, prune_heads
from headlab.importance.rules import check_rules
from support.family_matrix import (
    check_capture_equals_output_attentions,
    check_lrp_conserves,
    check_masking_equals_zeroed_values,
    check_pruned_generates_as_masked,
    check_pruned_reloads,
    padded_inputs,
    perturbed_model,
    tiny_inputs,
)
from support.lrp_families import assert_conserved


def _model(attn_implementation: str = "eager", full: int = 1) -> torch.nn.Module:
    """A sliding layer (own v_proj) and ``full`` full ones (values from k_proj); 4 heads of 8 over 2."""
    config = tf.Gemma4TextConfig(
        vocab_size=99, bos_token_id=0, eos_token_id=1, pad_token_id=2, hidden_size=32, intermediate_size=37,
        num_hidden_layers=1 + full, num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        layer_types=["sliding_attention"] + ["full_attention"] * full, sliding_window=4, global_head_dim=8,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=99, attention_k_eq_v=True)
    return perturbed_model(tf.Gemma4ForCausalLM, config, attn_implementation=attn_implementation).double()


def _state(model) -> dict:
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def test_the_full_layer_ties_its_key_projection_as_the_values_too():
    """Before, the full layer had no projection tied (q, k and v None), as the sweep showed."""
    model = _model()
    sliding, full = (layer.self_attn for layer in model.model.layers)
    assert full.v_proj is None
    blocks = attention_blocks(model)
    assert (blocks[0].q, blocks[0].k, blocks[0].v) == (sliding.q_proj, sliding.k_proj, sliding.v_proj)
    assert (blocks[1].q, blocks[1].k, blocks[1].v) == (full.q_proj, full.k_proj, full.k_proj)
    assert (blocks[1].family.k, blocks[1].family.v) == ("k_proj", "k_proj")
    assert [(b.n_heads, b.n_kv_heads, b.d_head) for b in blocks] == [(4, 2, 8), (4, 2, 8)]


def test_capture_equals_eager_output_attentions():
    check_capture_equals_output_attentions(lambda attn_implementation="sdpa": _model(attn_implementation), "dec_self",
                                           tiny_inputs())


def test_masking_equals_zeroing_a_key_value_heads_rows_of_the_key_projection():
    """Key/value head j's rows of k_proj zeroed: its values are 0 (v_norm of 0 is 0), so its query heads output 0."""
    values = (lambda model, layer: model.model.layers[layer].self_attn.k_proj, lambda j: range(8 * j, 8 * j + 8), 2)
    check_masking_equals_zeroed_values(_model, "dec_self", values, tiny_inputs())


@pytest.mark.parametrize("spec, left, kv_rows", [
    ({("dec_self", 0): [1], ("dec_self", 1): [2, 3]}, [3, 2], 8),  # key/value head 1 of the full layer goes
    ({("dec_self", 1): [0, 3]}, [4, 2], 16),  # one query head per key/value head stays: k_proj whole
    ({("dec_self", 1): [0, 1]}, [4, 2], 8),  # key/value head 0 goes: rows 8..15 kept (sliced twice: out of range)
])
def test_pruning_equals_masking_on_a_padded_batch_and_in_cached_generation(spec, left, kv_rows, tmp_path):
    """The full layer's k_proj loses a removed key/value head's rows once (sliced twice, it would lose twice as many or
    fail); it reloads with load_pruned and with plain transformers. Before, pruning was refused."""
    model = _model("sdpa")  # eager: the left-padded row's rows fully masked give NaN (the unpruned model's too)
    ids, mask = padded_inputs(pad_id=2)
    expected, tokens = check_pruned_generates_as_masked(model, spec, left, ids, mask, atol=1e-10)
    full = model.model.layers[1].self_attn
    assert full.v_proj is None
    assert (full.q_proj.out_features, full.k_proj.out_features, full.o_proj.in_features) == (8 * left[1], kv_rows,
                                                                                          8 * left[1])
    assert attention_blocks(model)[1].k is full.k_proj and attention_blocks(model)[1].v is full.k_proj
    check_pruned_reloads(model.float(), tmp_path, left, ids, mask, expected.float(), tokens)


def test_a_full_layer_pruned_to_no_head_equals_masking(tmp_path):
    """Layer 1 of three (the last layer of each type stores its keys and values, store_full_length_kv, whose emptying
    is refused on its own)."""
    model = _model("sdpa", full=2)
    ids, mask = padded_inputs(pad_id=2)
    expected, tokens = check_pruned_generates_as_masked(model, {("dec_self", 1): [0, 1, 2, 3]}, [4, 0, 4], ids, mask,
                                                        atol=1e-10)
    check_pruned_reloads(model.float(), tmp_path, [4, 0, 4], ids, mask, expected.float(), tokens)


def test_lrp_holds_the_keys_constant_after_the_key_projection_and_passes_relevance_through_the_values():
    """The rule detaches k_norm's output (the keys alone: KEYS_ONLY), not k_proj's, which the values are too. Before,
    LRP was refused (its query and key projections unknown); with k_proj detached as for other layers the values lost
    their relevance (measured by the sweep: 2.096 at the first layer for a logit of 2.601)."""
    from headlab.importance.rules import lrp_rules

    model = _model(full=2)
    check_rules(model)
    seen: dict[str, bool] = {}
    full = model.model.layers[1].self_attn
    with torch.enable_grad(), lrp_rules(model):
        handles = [module.register_forward_hook(lambda m, a, out, name=name: seen.__setitem__(name, out.requires_grad))
                   for name, module in (("keys", full.k_norm), ("values", full.v_norm), ("queries", full.q_norm))]
        # the relevance's source: the token embeddings, as a leaf of the graph
        handles.append(model.get_input_embeddings().register_forward_hook(
            lambda m, a, out: out.detach().requires_grad_()))
        model(**tiny_inputs())
        for handle in handles:
            handle.remove()
    assert seen == {"keys": False, "values": True, "queries": False}
    check_lrp_conserves(model, model.model.layers[0], rtol=1e-10, atol=1e-12)


def test_compute_lrp_conserves_relevance_on_every_sentence():
    model = _model(full=2)
    assert_conserved(model, 1e-10)


def test_pruning_an_uneven_group_copies_the_key_projections_rows_and_equals_masking():
    """Head 0 of the full layer goes: key/value head 0 keeps one query head and head 1 two, so each kept query head
    gets its own copy of its key/value head's k_proj rows (keys and values both), as for any grouped layer."""
    model = _model("sdpa")  # eager: the left-padded row's rows fully masked give NaN (the unpruned model's too)
    ids, mask = padded_inputs(pad_id=2)
    check_pruned_generates_as_masked(model, {("dec_self", 1): [0]}, [4, 3], ids, mask, atol=1e-10)
    block = attention_blocks(model)[1]
    assert block.k is block.v and block.k.out_features == 8 * block.n_kv_heads


def test_lrp_is_refused_naming_the_layout_where_no_key_only_module_is_known(monkeypatch):
    """A class whose values are its key projection's output and whose keys-only module headlab does not know
    (KEYS_ONLY): refused, naming the layout, before any work (its rule would detach the values with the keys)."""
    from headlab.importance import rules

    monkeypatch.setattr(rules, "KEYS_ONLY", {})
    with pytest.raises(HeadlabError, match=r"model.layers.1.self_attn .*its values are its keys' projection \(k_proj, "
                                           r"attention_k_eq_v"):
        check_rules(_model())


def _shared_model() -> torch.nn.Module:
    """Four layers, sliding and full in turn, the last (full) one reading layer 1's keys and values (num_kv_shared_layers
    1), which are both k_proj's."""
    config = tf.Gemma4TextConfig(
        vocab_size=99, bos_token_id=0, eos_token_id=1, pad_token_id=2, hidden_size=32, intermediate_size=37,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=4, global_head_dim=8,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=99, num_kv_shared_layers=1, attention_k_eq_v=True)
    return perturbed_model(tf.Gemma4ForCausalLM, config, attn_implementation="sdpa").double()


def test_a_layer_sharing_keys_that_are_values_ties_its_query_and_names_the_key_projection():
    """Before, discovery named no source (its keys and values came from one module, not a key and a value projection),
    so LRP and pruning refused the model."""
    model = _shared_model()
    blocks = attention_blocks(model)
    assert blocks[3].q is model.model.layers[3].self_attn.q_proj and blocks[3].k is None and blocks[3].v is None
    assert blocks[3].family.kv_from == "model.layers.1.self_attn.k_proj"
    assert blocks[1].k is blocks[1].v is model.model.layers[1].self_attn.k_proj


def test_lrp_conserves_with_a_layer_sharing_keys_that_are_values():
    model = _shared_model()
    check_rules(model)
    check_lrp_conserves(model, model.model.layers[0], rtol=1e-10, atol=1e-12)


def test_pruning_with_a_layer_sharing_keys_that_are_values_equals_masking():
    """Layer 3 keeps heads [0, 3] (one per shared key/value head); layer 1, which it reads, keeps both key/value heads
    (heads 1 and 3 go)."""
    model = _shared_model()
    ids, mask = padded_inputs(pad_id=2)
    check_pruned_generates_as_masked(model, {("dec_self", 3): [1, 2], ("dec_self", 1): [1, 3]}, [4, 2, 4, 2], ids,
                                     mask, atol=1e-10)
    with pytest.raises(HeadlabError, match=r"dec_self:1 .*but layer\(s\) dec_self:3 attend with them too"):
        prune_heads(_shared_model(), {("dec_self", 1): [2, 3]})
