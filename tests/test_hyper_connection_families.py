"""HY-V4 and Qwen4-Exp: gated attention between hyper-connections (session 36, branch hyper36).

Before, both were refused before any work (``adapters.families.OUTPUT_GATES_REFUSED``: "... headlab has not checked
either / these"). Read in transformers 5.24 and checked here, on tiny float64 models:

* HY-V4 (``HYV4Attention``): DeepSeek-V3's multi-head latent attention (``q_b_proj`` viewed ``[.., -1, nope + rope]``,
  ``kv_b_proj`` ``[.., -1, nope + v]``), a DSA indexer whose top-k picks (under ``no_grad``, from the layer's input;
  a "shared" layer reuses the previous layer's) are folded into the mask, learned sinks (``sinks``, one logit per
  head, ``s_aux``), and ``attn_output * sigmoid(gate_proj(x).view(b, s, -1, v_head_dim))``: head h's gate is rows
  ``h * v ..`` of ``gate_proj``. Its layers sit between hyper-connections (``HYV4HyperConnection``: several residual
  streams mixed into the layer's input and its output written back into each, with weights from the streams).
* Qwen4-Exp's text model (``Qwen4ExpTextAttention``): Qwen3-Next's attention (``q_proj`` per head ``[query | gate]``,
  per-head q/k norms, ``o_proj(attn_output * sigmoid(gate))``) behind a QSA indexer of its own (``index_qk_proj`` on
  the layer's input; a boolean key selection folded into the mask), between hyper-connections
  (``Qwen4ExpTextGatedResidual``), hashed n-gram embeddings (PLE) added to the streams in its linear-attention layers.

What acts around a layer (hyper-connections, n-gram embeddings, the indexers' selections from the layer's input) acts
on the layer's input and output, never on one head apart from the others: capture equals transformers' eager
``output_attentions`` (with sinks, the weights the values get: what HY-V4's eager returns), masking equals zeroing
the head's value rows by hand, a head's gate multiplies that head only, gates at one change nothing, pruning equals
masking on padded batches and in cached generation (a layer left with no head too) and reloads. LRP, refused before
session 37 naming the hyper-connections and n-gram embeddings, holds their mixing weights constant and counts the n-gram
embeddings' share as kept (tests/test_lrp_hyper_connections.py).
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from headlab import HeadlabError, attention_blocks, capture_attention, mask_heads, prune_heads
from headlab.checkpoint import model_class_for
from headlab.portable_code import install_tie_rule
from support.family_matrix import (
    check_confidence_on_every_engine,
    check_gates_at_one_change_nothing,
    check_pruned_generates_as_masked,
    check_pruned_reloads,
    logits,
    padded_inputs,
    tiny_inputs,
)

NOPE, ROPE, V = 4, 4, 8
_HY_V4 = dict(vocab_size=99, hidden_size=32, intermediate_size=40, moe_intermediate_size=40, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=4, head_dim=ROPE, max_position_embeddings=64, bos_token_id=0,
              eos_token_id=1, pad_token_id=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=NOPE,
              qk_rope_head_dim=ROPE, v_head_dim=V, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
              # DSA: 3 keys of up to 7 picked per query by layer 0's indexer, reused by layer 1 ("shared")
              index_topk=3, index_n_heads=2, index_head_dim=8, indexer_types=["full", "shared"],
              mlp_layer_types=["dense", "sparse"], hc_mult=3)
_QWEN4 = dict(vocab_size=99, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=64, bos_token_id=0, eos_token_id=1,
              pad_token_id=2, moe_intermediate_size=40, shared_expert_intermediate_size=40, num_experts=4,
              num_experts_per_tok=2, linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8,
              linear_value_head_dim=8, hc_count=3, hc_lowrank=8,
              # QSA: 2 index heads, blocks of 2 tokens, 1 block (and the incomplete tail) kept per query
              indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=2, indexer_compress_ratio=2,
              # a Gated DeltaNet layer with n-gram embeddings (PLE, one-indexed layer ids), then two attention layers
              layer_types=["linear_attention", "indexed_attention", "indexed_attention"], ple_layer_ids=[1],
              ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=50, make_ngram_vocab_size_divisible_by=4)
LAYERS = {"hy_v4": [0, 1], "qwen4_exp_text": [1, 2]}  # the attention layers
FAMILIES = tuple(LAYERS)


def build(family: str, attn_implementation: str | None = None, seed: int = 0, **sizes) -> torch.nn.Module:
    """The tiny model in float64 (the experts' eager loop: grouped matmuls take no float64), its biases, norms and
    sinks moved off their initial values, the gates spread (far from one another and from 1/2)."""
    if family not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {family}")
    config = CONFIG_MAPPING[family](**{**(_HY_V4 if family == "hy_v4" else _QWEN4), **sizes})
    # HY-V4 has eager attention only (sinks and DSA); Qwen4-Exp SDPA too
    config._attn_implementation = attn_implementation or ("eager" if family == "hy_v4" else "sdpa")
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = model_class_for(config)(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or "norm" in name or name.endswith(".sinks") or "conv1d" in name:
                parameter.add_(torch.randn_like(parameter) * (1.0 if name.endswith(".sinks") else 0.1))
            if name.endswith("self_attn.gate_proj.weight"):
                parameter.mul_(8)
    install_tie_rule(model)  # as headlab runs it (tied top-k keys: the lowest index)
    return model.double()


def _attention(model, layer: int):
    return model.model.layers[layer].self_attn


def _value_rows(family: str, kv_head: int) -> tuple[str, range]:
    """The weight rows of a key/value head's values, read off the modeling code (not headlab's tables)."""
    if family == "hy_v4":  # kv_b_proj viewed [.., -1, nope + v], split [k_nope | v]
        return "kv_b_proj", range(kv_head * (NOPE + V) + NOPE, (kv_head + 1) * (NOPE + V))
    return "v_proj", range(kv_head * 8, (kv_head + 1) * 8)  # v_proj viewed [.., -1, head_dim]


def _gate_rows(family: str, head: int) -> tuple[str, range]:
    if family == "hy_v4":  # gate_proj viewed [.., -1, v_head_dim]
        return "gate_proj", range(head * V, (head + 1) * V)
    return "q_proj", range(head * 16 + 8, (head + 1) * 16)  # q_proj viewed [.., -1, 2 x head_dim], [query | gate]


def test_blocks_are_found_with_their_gates_and_sinks():
    """Before: refused before any work (OUTPUT_GATES_REFUSED). HY-V4: discovered, its latent rows, gate rows and
    sinks sliced per head; Qwen4-Exp: its table entry (Qwen3-Next's [query | gate] rows), the indexer left whole."""
    hy = attention_blocks(build("hy_v4"))
    assert [(b.kind, b.layer, b.n_heads, b.n_kv_heads, b.d_head, b.idle) for b in hy] == \
        [("dec_self", layer, 4, 4, V, False) for layer in (0, 1)]
    assert hy[0].family.head_rows == (("q_b_proj", ("qk_nope_head_dim", "qk_rope_head_dim")),
                                      ("kv_b_proj", ("qk_nope_head_dim", "v_head_dim")), ("gate_proj", ("v_head_dim",)))
    assert hy[0].family.head_vectors == ("sinks",) and hy[0].family.selection_argument == "prev_topk_indices"
    qwen = attention_blocks(build("qwen4_exp_text"))
    assert [(b.kind, b.layer, b.n_heads, b.n_kv_heads, b.d_head, b.idle) for b in qwen] == \
        [("dec_self", layer, 4, 2, 8, False) for layer in (1, 2)]
    assert qwen[0].family.query_gate and qwen[0].family.input_readers == ("indexer",)


@pytest.mark.parametrize("family", FAMILIES)
def test_capture_equals_output_attentions(family):
    """On a padded batch: headlab's capture (SDPA where the model has it) equals transformers' eager output_attentions,
    map for map (HY-V4's: the softmax over [logits | sink] without the sink's column, the weights the values get),
    and the indexers' selections show (keys the indexer dropped get no weight)."""
    inputs = tiny_inputs()
    with torch.no_grad():
        reference = build(family, "eager")(**inputs, output_attentions=True).attentions
    model = build(family)
    implementation = model.config._attn_implementation
    with capture_attention(model) as record:
        logits(model, inputs)
    assert sorted(record) == [("dec_self", layer) for layer in LAYERS[family]]
    assert len(reference) == len(LAYERS[family])  # one map per attention layer (Qwen4-Exp's Gated DeltaNet has none)
    for (_, layer), probs in record.items():
        torch.testing.assert_close(probs, reference[LAYERS[family].index(layer)], atol=1e-12, rtol=0)
        # every query past the selection's size attends to fewer keys than causality allows (row 0: no padding)
        allowed = torch.tril(torch.ones(7, 7, dtype=torch.bool))
        assert ((probs[0] > 0) & ~allowed).sum() == 0 and ((probs[0] == 0) & allowed).any()
    if family == "hy_v4":  # the sinks take a share: rows sum to less than one
        assert (record[("dec_self", 0)][0].sum(-1) < 1 - 1e-3).all()
    assert model.config._attn_implementation == implementation


@pytest.mark.parametrize("family", FAMILIES)
def test_masking_equals_zeroed_values(family):
    """Masking the query heads of each key/value head of the last attention layer equals zeroing that key/value
    head's value rows by hand (its output, times its gate, is zero either way), on a padded batch, whatever the
    hyper-connections do around the layer."""
    inputs = tiny_inputs()
    layer = LAYERS[family][-1]
    n_kv = 4 if family == "hy_v4" else 2
    for kv_head in range(n_kv):
        heads = list(range(kv_head * 4 // n_kv, (kv_head + 1) * 4 // n_kv))
        model = build(family)
        before = logits(model, inputs)
        with mask_heads(model, {("dec_self", layer): heads}):
            masked = logits(model, inputs)
        assert torch.equal(logits(model, inputs), before)  # the mask came off
        path, rows = _value_rows(family, kv_head)
        with torch.no_grad():
            _attention(model, layer).get_submodule(path).weight[list(rows)] = 0
        reference = logits(model, inputs)
        assert not torch.allclose(reference, before)
        torch.testing.assert_close(masked, reference, atol=1e-12, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_heads_gate_multiplies_that_head_only_and_gates_at_one_change_nothing(family):
    """Head 1's gate rows changed: the logits change, unless head 1 is masked (then not at all: its gate multiplies
    no other head's output). Scalar gates at one change nothing."""
    inputs = tiny_inputs()
    layer = LAYERS[family][-1]
    model = build(family)
    before = logits(model, inputs)
    with mask_heads(model, {("dec_self", layer): [1]}):
        masked = logits(model, inputs)
    path, rows = _gate_rows(family, 1)
    with torch.no_grad():
        _attention(model, layer).get_submodule(path).weight[list(rows)] *= -3
    assert not torch.allclose(logits(model, inputs), before)
    with mask_heads(model, {("dec_self", layer): [1]}):
        assert torch.equal(logits(model, inputs), masked)
    check_gates_at_one_change_nothing(build(family), inputs)


def test_hy_v4_pruning_slices_each_heads_rows_and_sinks():
    """Heads 0 and 2 of layer 1 pruned: q_b_proj keeps heads 1 and 3's [nope | rope] rows, kv_b_proj their
    [k_nope | v] rows, gate_proj their v rows, sinks their entries, o_proj their columns; what all heads share (the
    latents, their norms, the indexer of layer 0, the hyper-connections) is untouched."""
    model = build("hy_v4")
    attention = _attention(model, 1)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    assert prune_heads(model, {("dec_self", 1): [0, 2]}) == {("dec_self", 1): [1, 3]}
    rows = lambda size: [r for h in (1, 3) for r in range(h * size, (h + 1) * size)]  # noqa: E731
    prefix = "model.layers.1.self_attn."
    expected = {"q_b_proj.weight": before[prefix + "q_b_proj.weight"][rows(NOPE + ROPE)],
                "kv_b_proj.weight": before[prefix + "kv_b_proj.weight"][rows(NOPE + V)],
                "gate_proj.weight": before[prefix + "gate_proj.weight"][rows(V)],
                "sinks": before[prefix + "sinks"][[1, 3]], "o_proj.weight": before[prefix + "o_proj.weight"][:, rows(V)]}
    for name, value in expected.items():
        assert torch.equal(attention.get_parameter(name), value), name
    for name, parameter in model.named_parameters():
        if name.removeprefix(prefix) not in expected:
            assert torch.equal(parameter, before[name]), name


def test_qwen4_exp_pruning_slices_the_query_gate_rows_and_leaves_the_indexer():
    """Head 1 of layer 2 pruned: q_proj keeps the other heads' [query | gate] rows, o_proj their columns, the
    indexer (from the layer's input) stays whole. Before the indexer was listed (Family.input_readers), pruning was
    refused as "modules whose weights span the heads' channels": index_qk_proj reads the hidden size, here 4 x 8."""
    model = build("qwen4_exp_text")
    attention = _attention(model, 2)
    before = {name: p.detach().clone() for name, p in attention.named_parameters()}
    assert prune_heads(model, {("dec_self", 2): [1]}) == {("dec_self", 2): [0, 2, 3]}
    rows = [r for h in (0, 2, 3) for r in range(h * 16, (h + 1) * 16)]
    assert torch.equal(attention.q_proj.weight, before["q_proj.weight"][rows])
    assert torch.equal(attention.o_proj.weight, before["o_proj.weight"][:, [c for h in (0, 2, 3)
                                                                             for c in range(h * 8, h * 8 + 8)]])
    for name, parameter in attention.indexer.named_parameters():
        assert torch.equal(parameter, before[f"indexer.{name}"]), name


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("family", FAMILIES)
def test_pruning_equals_masking_in_generation_empties_a_layer_and_reloads(family, dtype, tmp_path):
    """The first attention layer emptied, one head of the second removed: the pruned model equals the masked one on
    right- and left-padded rows and in greedy cached generation (HY-V4's emptied layer 0 still hands layer 1 its
    indexer's picks; Qwen4-Exp's emptied layer stores no keys, which nothing reads), in float64 to 1e-10. In float32,
    as saved and reloaded (its config's dtype; the experts' grouped matmuls take no float64), the saved directory
    reloads with load_pruned and with plain transformers (remote code). Before: HY-V4's emptied layer was refused on
    re-reading its blocks ("sinks (none) is not one entry per head of the output projection's 0")."""
    first, second = LAYERS[family]
    ids, mask = padded_inputs()
    model = build(family).to(dtype)
    spec = {("dec_self", first): [0, 1, 2, 3], ("dec_self", second): [2]}
    atol = 1e-10 if dtype == torch.float64 else 1e-5
    expected, tokens = check_pruned_generates_as_masked(model, spec, [0, 3], ids, mask, atol=atol)
    if dtype == torch.float32:
        model.set_experts_implementation("grouped_mm")  # as a plain load runs them
        check_pruned_reloads(model, tmp_path, [0, 3], ids, mask, expected, tokens)


def test_the_multimodal_qwen4_exp_is_refused_naming_its_language_model_and_its_checkpoint_loads_as_it(tmp_path):
    """Qwen4ExpForConditionalGeneration itself: refused naming the text model to pass, as Qwen3.5's wrapper (before:
    refused for the text model's unchecked parts). Its saved checkpoint loads as that causal LM (headlab's loader, as
    Qwen3.5's), whose blocks are found and whose logits on text are the multimodal model's (before, check_supported refused
    it: "model.layers.1.self_attn (generic:qwen4_exp_text): projection widths do not split into heads of size 8 (q 64,
    k/v 16, output input 32)", the name-based fallback reading q_proj's [query | gate] rows as queries)."""
    from headlab.loading import check_supported, load_model

    if "qwen4_exp" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no qwen4_exp")
    text = CONFIG_MAPPING["qwen4_exp_text"](**_QWEN4)
    vision = dict(hidden_size=16, intermediate_size=20, depth=1, num_heads=2, out_hidden_size=32)
    config = CONFIG_MAPPING["qwen4_exp"](text_config=text.to_dict(), vision_config=vision)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tf.AutoModelForImageTextToText.from_config(config).eval()
    with pytest.raises(HeadlabError, match=r"Qwen4ExpForConditionalGeneration is a multimodal model around a "
                                           r"'qwen4_exp_text' language model, which headlab supports on its own"):
        attention_blocks(model)
    model.save_pretrained(tmp_path)
    check_supported(str(tmp_path))
    loaded = load_model(str(tmp_path))
    assert type(loaded).__name__ == "Qwen4ExpForCausalLM"
    assert [b.name for b in attention_blocks(loaded)] == ["model.layers.1.self_attn", "model.layers.2.self_attn"]
    # float32, the loaded model on SDPA (the multimodal one on eager): to float32's rounding
    torch.testing.assert_close(logits(loaded, tiny_inputs()), logits(model, tiny_inputs()), atol=1e-6, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_confidence_is_the_same_on_every_engine(family):
    """HY-V4 is a sink type now (adapters.families.ATTENTION_SINKS): the default engine runs headlab's own attention
    function on it, which takes the sinks as one more logit and folds the indexer's picks (handed as ``indices=`` to
    any function but eager and SDPA) into the mask; Qwen4-Exp folds its selection before any function. Confidence
    under eager, fused (default) and chunked query rows: the same scores. Before this session HY-V4 ran eager
    only (a type handing s_aux that headlab had not read). Qwen4-Exp's eager softmax is taken in float32 whatever the
    model's dtype (``softmax(.., dtype=torch.float32)``): eager agrees to that."""

    from headlab.importance import ImportanceData, describe_model

    model = build(family)
    info = describe_model(model)
    data = ImportanceData.from_ids([[5, 17, 33, 41, 8, 1], [9, 60, 22, 1], [70, 12, 45, 31, 28, 90, 3, 1]])
    rtol = 1e-12 if family == "hy_v4" else 1e-6
    check_confidence_on_every_engine(model, data, info, rtol=rtol)


@pytest.mark.parametrize("family", FAMILIES)
def test_analyze_end_to_end(family, tmp_path):
    """`headlab analyze --ablation` on a saved tiny model: every stage done, LRP too since session 37 (before, failed
    with the refusal naming the hyper-connections); the score tables have a row per attention layer (Qwen4-Exp's Gated
    DeltaNet layer empty).
    Before: every stage refused with the model."""
    import json

    from support.family_matrix import ANALYZE_STAGES, analyze, save_tiny, treebank_files

    model = build(family).float()
    model.set_experts_implementation("grouped_mm")  # as a plain load runs them
    save_tiny(model, tmp_path / "model", treebank_files(tmp_path))
    code, stages = analyze(tmp_path / "model", tmp_path)
    for name in ANALYZE_STAGES:
        assert stages[name]["status"] == "done", stages[name]
    assert stages["lrp"]["status"] == "done" and code == 0, stages["lrp"]
    rows = json.loads((tmp_path / "out" / "importance" / "confidence.json").read_text())["scores"]["dec_self"]
    empty = [all(v is None for v in row) for row in rows]
    assert empty == ([False, False] if family == "hy_v4" else [True, False, False])


def test_hy_v4_gate_the_tables_do_not_know_is_refused(monkeypatch):
    """Without hy_v4 in OUTPUT_GATES its gate is refused before any work, naming gate_proj (pruning would not know its
    rows); a gate_proj whose per-head size is not v_head_dim (a forward headlab did not read) gets no rows."""
    from headlab.adapters import families

    monkeypatch.delitem(families.OUTPUT_GATES, "hy_v4")
    with pytest.raises(HeadlabError, match=r"self_attn\.o_proj multiplied, elementwise, by a gate computed from "
                                           r"gate_proj \(an output gate"):
        attention_blocks(build("hy_v4"))
    attention = build("hy_v4").model.layers[0].self_attn
    assert families.hy_v4_rows(attention)[-1] == ("gate_proj", ("v_head_dim",))
    attention.gate_projection_size = V + 1
    assert families.hy_v4_rows(attention) == ()
