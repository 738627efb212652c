"""Query/key heads wider than value heads: MiMo-V2-Flash as released (head_dim 192, v_head_dim 128).

Of transformers 5.24's model types, MiMo-V2-Flash is the one whose separate q/k/v projections give the values
another head size than the queries and keys (``MiMoV2FlashAttention``: ``q_proj`` and ``k_proj`` emit heads of
``head_dim``, ``v_proj`` heads of ``v_head_dim``, ``o_proj`` reads ``num_attention_heads * v_head_dim``; the
multi-head latent attention types, also with a ``v_head_dim``, are ``Family.head_rows``'). The block's ``d_head``
is the value heads' size (the output projection's input, where masks, gates and per-head outputs act) and
``d_qk`` the queries' and keys'; pruning slices q and k rows by ``d_qk``, v rows and o columns by ``d_head``.
Before (session 26): q/k/v not tied to the heads, pruning and LRP refused ("projection layout is unknown").

Tiny model, the released ratio 3:2 (query/key heads of 12, value heads of 8), hidden 32, 2 layers, 4 query heads
over 2 key/value heads in the full-attention layer (0) and 4 in the sliding-window layer (1), which has sinks set
far from zero and different per head. Eager attention (the class has no SDPA).
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf

from headlab import attention_blocks, capture_attention, save_pruned
from support.family_matrix import (
    check_gates_at_one_change_nothing,
    check_lrp_conserves,
    check_masking_equals_zeroed_values,
    check_pruned_generates_as_masked,
    check_pruned_reloads,
    padded_inputs,
    padded_logits,
    perturbed_model,
    tiny_inputs,
)

QK, V = 12, 8
SINKS = torch.tensor([3.0, -2.0, 1.5, 0.5])  # layer 1's, per query head
ALL = [0, 1, 2, 3]
SPECS = {  # removed heads -> heads left per layer
    "emptied": ({("dec_self", 0): ALL, ("dec_self", 1): [1]}, [0, 3]),
    "one per group": ({("dec_self", 0): [0, 3], ("dec_self", 1): [2]}, [2, 3]),
}


def mimo() -> torch.nn.Module:
    config = tf.MiMoV2FlashConfig(
        vocab_size=99, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=QK, v_head_dim=V, max_position_embeddings=64, bos_token_id=0,
        eos_token_id=1, pad_token_id=2, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    model = perturbed_model(tf.MiMoV2FlashForCausalLM, config, attn_implementation="eager")
    with torch.no_grad():
        model.model.layers[1].self_attn.sinks.copy_(SINKS)
    return model


def test_blocks_count_heads_by_each_projection_size():
    model = mimo()
    blocks = attention_blocks(model)
    assert [(b.n_heads, b.n_kv_heads, b.d_head, b.d_qk) for b in blocks] == [(4, 2, V, QK), (4, 4, V, QK)]
    assert all(b.q is not None and b.k is not None and b.v is not None for b in blocks)
    assert "d_head=8, d_qk=12" in repr(blocks[0])


def test_capture_equals_output_attentions():
    inputs = tiny_inputs()
    model = mimo()
    with torch.no_grad():
        reference = model(**inputs, output_attentions=True).attentions
    with capture_attention(model) as record:
        with torch.no_grad():
            model(**inputs)
    assert sorted(record) == [("dec_self", 0), ("dec_self", 1)]
    for (_, layer), probs in record.items():
        assert torch.equal(probs, reference[layer]), layer


def test_masking_equals_zeroed_value_rows_and_gates_at_one_change_nothing():
    """Head h's output is o_proj's input columns h*8 .. h*8+7 (value-sized): masking the query heads of a key/value
    head equals zeroing that head's 8 value rows (layer 1: 4 key/value heads, one query head each)."""
    values = (lambda model, layer: model.model.layers[layer].self_attn.v_proj, lambda j: range(j * V, (j + 1) * V), 4)
    check_masking_equals_zeroed_values(mimo, "dec_self", values, tiny_inputs())
    check_gates_at_one_change_nothing(mimo(), tiny_inputs())


@pytest.mark.parametrize("spec_name", SPECS)
def test_pruned_equals_masked_generates_and_reloads(spec_name, tmp_path):
    """q and k lose 12 rows per head, v 8 and o_proj 8 columns; the kept heads keep their sinks. The pruned model
    equals the masked one on padded rows and in cached generation, reloads with load_pruned and with plain
    transformers (remote code), every weight loaded. Before: refused, "projection layout is unknown"."""
    spec, heads_left = SPECS[spec_name]
    model = mimo()
    ids, mask = padded_inputs(pad_id=2)
    expected, expected_tokens = check_pruned_generates_as_masked(model, spec, heads_left, ids, mask, atol=1e-5)
    # an emptied layer's stand-in keeps the original's head_dim (12): its heads' size is still the values' 8
    assert [b.d_head for b in attention_blocks(model)] == [V, V]
    for (_, layer), removed in spec.items():
        kept = [h for h in ALL if h not in removed]
        attention = model.model.layers[layer].self_attn
        if not kept:
            continue
        n_kv = len(kept) if layer == 1 else 2  # layer 1: a key/value head per query head; layer 0: both groups kept
        assert attention.q_proj.weight.shape[0] == len(kept) * QK
        assert attention.k_proj.weight.shape[0] == n_kv * QK
        assert attention.v_proj.weight.shape[0] == n_kv * V
        assert attention.o_proj.weight.shape[1] == len(kept) * V
        if layer == 1:
            assert torch.equal(attention.sinks.detach(), SINKS[kept])

    check_pruned_reloads(model, tmp_path, heads_left, ids, mask, expected, expected_tokens)


def test_resaved_by_transformers_without_record_reads_the_heads_off_the_weights(tmp_path):
    """A pruned directory re-saved by plain transformers (no headlab_pruning.json): the key/value heads are read off
    k_proj's rows in heads of 12 (layer 1: 36 rows, 3 heads), not 8 (4.5 heads: the layer was taken for unpruned,
    and loading refused its weights' shapes)."""
    from headlab.loading import load_model

    model = mimo()
    ids, mask = padded_inputs(pad_id=2)
    check_pruned_generates_as_masked(model, *SPECS["emptied"], ids, mask)
    save_pruned(model, tmp_path / "pruned")
    tf.AutoModelForCausalLM.from_pretrained(tmp_path / "pruned", trust_remote_code=True).save_pretrained(
        tmp_path / "resaved")
    loaded = load_model(str(tmp_path / "resaved"))
    assert [(b.n_heads, b.n_kv_heads) for b in attention_blocks(loaded)] == [(0, 0), (3, 3)]
    torch.testing.assert_close(padded_logits(loaded, ids, mask), padded_logits(model, ids, mask), atol=1e-6, rtol=0)


def test_lrp_conserves():
    """LRP detaches q_proj and k_proj (now tied to the heads): relevance is conserved. Before: refused."""
    from headlab.importance.rules import check_rules

    model = mimo()
    check_rules(model)
    check_lrp_conserves(model, model.model.layers[0])


def test_heads_table_names_both_sizes():
    from headlab.commands import heads_table

    table = heads_table(attention_blocks(mimo()))
    assert "model.layers.0.self_attn (query/key heads of 12)" in table


def test_every_engine_and_confidence_agree_with_eager(tmp_path):
    """Head statistics under eager, chunked and fused (headlab's attention function: values of 8 read by queries
    and keys of 12) agree in float64, as does confidence."""
    import numpy as np

    from headlab.importance import compute_confidence
    from test_attention_sink_statistics import _analyse, _confidence_data
    from test_chunked_statistics import _assert_close, _written

    model = mimo().double()
    model.set_experts_implementation("eager")  # grouped_mm takes no float64
    eager = _written(_analyse(model, tmp_path, "eager").results.values(), tmp_path / "eager")
    chunked = _written(_analyse(model, tmp_path, "chunked", query_chunk=3).results.values(), tmp_path / "chunked")
    fused = _written(_analyse(model, tmp_path, "fused", query_chunk=3).results.values(), tmp_path / "fused")
    assert len(fused) > 10
    _assert_close(chunked, eager, atol=1e-8)
    _assert_close(fused, eager, atol=1e-8)
    data, info = _confidence_data(model)
    reference = compute_confidence(model, data, info, batch_size=2, engine="eager")
    for engine, query_chunk in (("fused", None), ("chunked", 2)):
        streamed = compute_confidence(model, data, info, batch_size=2, engine=engine, query_chunk=query_chunk)
        for kind in reference.kinds:
            np.testing.assert_allclose(streamed[kind], reference[kind], rtol=1e-12, atol=1e-12)


def test_prune_command_and_heads_listing(tmp_path, capsys):
    """``headlab prune`` (its check before loading, on the config's model) and ``headlab heads`` on a saved model."""
    from headlab.cli import main
    from support.family_matrix import save_tiny

    save_tiny(mimo(), tmp_path / "mimo", ["the", "cat", "sat"])
    assert main(["prune", str(tmp_path / "mimo"), "--heads", "dec_self:1:1", "--out", str(tmp_path / "out")]) == 0
    capsys.readouterr()
    assert main(["heads", str(tmp_path / "out"), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["n_heads"], r["n_kv_heads"], r["d_head"], r["d_qk"]) for r in rows] == [(4, 2, V, QK), (3, 3, V, QK)]
