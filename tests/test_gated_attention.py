"""Gated attention (Qwen3-Next, Qwen3.5, Qwen3.5-MoE; transformers' ``qwen3_next``, ``qwen3_5_text``,
``qwen3_5_moe_text``): q_proj emits per head ``[query | gate]`` and the layer outputs
``o_proj(attn_output * sigmoid(gate))``; Gated DeltaNet layers (linear attention, no heads) sit beside
the attention layers. Session 22's family sweep refused them ("a gate on the attention output").

On the tiny hybrids of tests/support/family_matrix.py (a Gated DeltaNet layer at 0, attention at 1):
only the attention layer is a block; capture equals ``output_attentions``; masking a key/value group
equals zeroing its value rows by hand (the gate multiplies a zero), a head gate of 0.5 halving them;
physical pruning slices q_proj's interleaved [query | gate] rows per head and equals masking, in
cached generation too, and reloads with load_pruned and plain transformers; LRP conserves through the
Gated DeltaNet layer (its rule: importance/mixer_rules/gated_delta.py, tests/test_lrp_gated_delta.py; refused
before session 35); `analyze` runs end to end, LRP included; the released checkpoints' multimodal
config (qwen3_5, qwen3_5_moe) loads as its text model. The all-attention variants run the family
matrix of tests/test_more_families.py (LRP conserved there: the gate is held constant with the query
it is projected with, importance/rules.py).
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf

from headlab import HeadlabError, attention_blocks, capture_attention, load_pruned, mask_heads, prune_heads, save_pruned
from support.family_matrix import (
    check_pruned_generates_as_masked,
    padded_inputs,
    padded_logits,
    qwen3_next,
    tiny_inputs,
    tiny_model,
)

HYBRIDS = ["qwen3_next-hybrid", "qwen3_5_text-hybrid", "qwen3_5_moe_text-hybrid"]
D = 8


def _logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits


@pytest.mark.parametrize("family", HYBRIDS)
def test_only_the_attention_layer_is_a_block(family):
    model = tiny_model(family)
    assert [(b.kind, b.layer, b.n_heads, b.n_kv_heads, b.d_head, b.name) for b in attention_blocks(model)] == \
        [("dec_self", 1, 4, 2, 8, "model.layers.1.self_attn")]


@pytest.mark.parametrize("family", HYBRIDS)
def test_capture_equals_output_attentions(family):
    inputs = tiny_inputs()  # the second sequence padded
    eager = tiny_model(family, attn_implementation="eager")
    with torch.no_grad():
        reference = eager(**inputs, output_attentions=True).attentions
    model = tiny_model(family)  # sdpa
    with capture_attention(model) as record:
        _logits(model, inputs)
    assert list(record) == [("dec_self", 1)] and len(reference) == 1  # transformers lists attention layers only
    assert torch.equal(record[("dec_self", 1)], reference[0])
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("family", HYBRIDS)
def test_masking_equals_zeroed_values(family):
    """Query heads 2 and 3 read key/value head 1: masking them equals zeroing its value rows; the
    head's output, times its sigmoid gate, is zero either way."""
    inputs = tiny_inputs()
    model = tiny_model(family)
    before = _logits(model, inputs)
    with mask_heads(model, {("dec_self", 1): [2, 3]}):
        masked = _logits(model, inputs)
    assert torch.equal(_logits(model, inputs), before)
    v = model.model.layers[1].self_attn.v_proj
    with torch.no_grad():
        v.weight[D:2 * D] = 0
        v.bias[D:2 * D] = 0
    reference = _logits(model, inputs)
    assert not torch.allclose(reference, before)
    torch.testing.assert_close(masked, reference, atol=1e-6, rtol=0)


@pytest.mark.parametrize("family", HYBRIDS)
def test_pruning_slices_query_and_gate_per_head(family):
    """Heads 0 and 2 pruned (one of each key/value group): q_proj keeps rows [query | gate] of heads 1
    and 3 as they were (rows 2hd .. 2hd + 2d), o_proj the columns of those heads."""
    model = tiny_model(family)
    attention = model.model.layers[1].self_attn
    q_weight, q_bias, o_weight = (t.detach().clone() for t in (attention.q_proj.weight, attention.q_proj.bias,
                                                               attention.o_proj.weight))
    prune_heads(model, {("dec_self", 1): [0, 2]})
    rows = [r for h in (1, 3) for r in range(2 * h * D, 2 * (h + 1) * D)]
    assert torch.equal(attention.q_proj.weight, q_weight[rows])
    assert torch.equal(attention.q_proj.bias, q_bias[rows])
    assert torch.equal(attention.o_proj.weight, o_weight[:, [c for h in (1, 3) for c in range(h * D, (h + 1) * D)]])
    assert (attention.k_proj.out_features, attention.v_proj.out_features) == (2 * D, 2 * D)  # both groups used


@pytest.mark.parametrize("family", HYBRIDS)
def test_gates_scale_a_head_as_its_values_scaled(family):
    """Scalar gates at one change nothing; a gate of 0.5 on the heads of key/value head 1 equals its value
    rows halved by hand (a head's output is linear in its values; its sigmoid gate multiplies either)."""
    from headlab import ConstantGates, gates_attached
    from support.family_matrix import check_gates_at_one_change_nothing

    inputs = tiny_inputs()
    check_gates_at_one_change_nothing(tiny_model(family), inputs)
    model = tiny_model(family)
    before = _logits(model, inputs)
    with gates_attached(model, ConstantGates.from_mask(attention_blocks(model), {("dec_self", 1): [2, 3]}, 0.5)):
        gated = _logits(model, inputs)
    v = model.model.layers[1].self_attn.v_proj
    with torch.no_grad():
        v.weight[D:2 * D] *= 0.5
        v.bias[D:2 * D] *= 0.5
    reference = _logits(model, inputs)
    assert not torch.allclose(reference, before)
    torch.testing.assert_close(gated, reference, atol=1e-6, rtol=0)


SPECS = {
    "partial group": ({("dec_self", 1): [0]}, 3),  # groups of 1 and 2: each kept head its own key/value copy
    "whole group": ({("dec_self", 1): [2, 3]}, 2),
    "no head left": ({("dec_self", 1): [0, 1, 2, 3]}, 0),
}


@pytest.mark.parametrize("spec_name", SPECS)
@pytest.mark.parametrize("family", HYBRIDS)
def test_pruning_equals_masking_generates_and_reloads(family, spec_name, tmp_path):
    spec, heads_left = SPECS[spec_name]
    model = tiny_model(family)
    ids, mask = padded_inputs(pad_id=2)
    expected, _ = check_pruned_generates_as_masked(model, spec, [heads_left], ids, mask, atol=1e-5)

    save_pruned(model, tmp_path)
    reloaded = load_pruned(tmp_path)
    assert torch.equal(padded_logits(reloaded, ids, mask), padded_logits(model, ids, mask))
    assert json.loads((tmp_path / "headlab_pruning.json").read_text())["portable"]["how"] == "remote code"
    plain = tf.AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True).eval()
    torch.testing.assert_close(padded_logits(plain, ids, mask), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", HYBRIDS)
def test_lrp_conserves_through_the_gated_delta_net(family):
    """The Gated DeltaNet had no rule and LRP was refused before any work ("no rule for ...GatedDeltaNet
    (model.layers.0.linear_attn): a state-space (or linear recurrent) token mixer"). Now its rule holds q, k, beta,
    g and the gate constant, and relevance is conserved from the logits to the input embeddings, below layer 0."""
    from headlab.importance import ImportanceData, compute_lrp, describe_model

    model = tiny_model(family)
    record = compute_lrp(model, ImportanceData.from_ids([[5, 6, 7, 1], [9, 10, 11, 12, 13, 1]]), describe_model(model),
                         bootstrap=0).signature["conservation"]
    assert record["n_sentences"] == 2 and record["n_outside"] == 0
    assert abs(record["with_biases"]["min"] - 1) < 1e-12 and abs(record["with_biases"]["max"] - 1) < 1e-12


def test_a_query_projection_not_split_into_query_and_gate_is_refused():
    """A q_proj whose width is not heads x [query | gate] (a model edited by hand) is refused, naming it."""
    model = tiny_model("qwen3_5_text-hybrid")
    model.model.layers[1].self_attn.q_proj = torch.nn.Linear(32, 3 * D)
    with pytest.raises(HeadlabError, match=r"query projection width 24 is not heads x \[query \| gate\] of size 8"):
        attention_blocks(model)


def test_analyze_end_to_end(tmp_path):
    """`headlab analyze --ablation` on a hybrid: every stage done, LRP too (refused before session 35: the Gated
    DeltaNet had no rule), the Gated DeltaNet layer's row of each score table empty."""
    from support.family_matrix import ANALYZE_STAGES, analyze, save_tiny, treebank_files

    save_tiny(tiny_model("qwen3_5_moe_text-hybrid"), tmp_path / "model", treebank_files(tmp_path))
    code, stages = analyze(tmp_path / "model", tmp_path)
    for name in ANALYZE_STAGES:
        assert stages[name]["status"] == "done", stages[name]
    assert stages["lrp"]["status"] == "done" and code == 0, stages["lrp"]
    for measure in ("confidence", "gradient", "ablation", "lrp"):
        rows = json.loads((tmp_path / "out" / "importance" / f"{measure}.json").read_text())["scores"]["dec_self"]
        assert [all(v is None for v in row) for row in rows] == [True, False], measure


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_5_moe"])
def test_a_multimodal_checkpoint_loads_as_its_text_model(model_type, tmp_path):
    """Qwen3.5's released checkpoints are the vision-language model (model_type qwen3_5 around a
    qwen3_5_text). transformers loads their causal LM on the text config; headlab built its structure
    check from the whole config and refused ("does not describe a Qwen3_5ForCausalLM")."""
    from headlab.loading import build_from_config, check_supported, load_model

    _, text = qwen3_next(f"{model_type}_text", ["linear_attention", "full_attention"])
    config_cls, cls = {"qwen3_5": (tf.Qwen3_5Config, tf.Qwen3_5ForConditionalGeneration),
                       "qwen3_5_moe": (tf.Qwen3_5MoeConfig, tf.Qwen3_5MoeForConditionalGeneration)}[model_type]
    config = config_cls(text_config=text.to_dict(), vision_config=dict(depth=1, hidden_size=16, num_heads=2,
                                                                       intermediate_size=16, out_hidden_size=32))
    torch.manual_seed(0)
    full = cls(config).eval()
    full.save_pretrained(tmp_path)
    check_supported(str(tmp_path))
    assert [b.name for b in attention_blocks(build_from_config(str(tmp_path)))] == ["model.layers.1.self_attn"]
    model = load_model(str(tmp_path))
    assert model.config.model_type == f"{model_type}_text"
    assert [b.name for b in attention_blocks(model)] == ["model.layers.1.self_attn"]
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    assert torch.equal(_logits(model, {"input_ids": ids}), _logits(full, {"input_ids": ids}))


def test_the_multimodal_model_object_is_refused_naming_the_language_model_to_pass():
    """The Python API given the vision-language wrapper itself (not a checkpoint path, which loads as
    its text model) refuses, saying which model to pass instead: the generic discovery alone said
    only that its attention output passes through a gate."""
    _, text = qwen3_next("qwen3_5_text", ["linear_attention", "full_attention"])
    config = tf.Qwen3_5Config(text_config=text.to_dict(), vision_config=dict(depth=1, hidden_size=16, num_heads=2,
                                                                            intermediate_size=16, out_hidden_size=32))
    with pytest.raises(HeadlabError, match=r"multimodal model around a 'qwen3_5_text' language model, which headlab "
                                           r"supports on its own: pass that causal LM"):
        attention_blocks(tf.Qwen3_5ForConditionalGeneration(config))


def test_a_model_of_linear_attention_layers_only_is_refused_naming_its_layer_types():
    cls, config = qwen3_next("qwen3_5_text", ["linear_attention", "linear_attention"])
    with pytest.raises(HeadlabError, match=r"found no attention block matching its table entry \(its config's "
                                           r"layer_types, \['linear_attention'\], hold no attention layer\)"):
        attention_blocks(cls(config))
