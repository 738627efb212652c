"""DeBERTa (v1) as a table family, and the DeBERTa configurations headlab refuses.

DeBERTa v1's ``DisentangledSelfAttention`` (transformers 5.24) computes its own softmax outside transformers'
attention interface: a bias-free fused ``in_proj`` viewed per head as ``[q | k | v]``, ``q_bias`` and ``v_bias``
(head-major) added after it, and with ``relative_attention`` the relative embeddings projected per head by
``pos_proj`` (c2p) and ``pos_q_proj`` (p2c, with a bias). On each of its layouts (no relative attention, c2p, p2c,
both), in float64: capture equals ``output_attentions``, masking a head equals zeroing its value rows and its
``v_bias`` entries by hand (read off the modeling code here, not from headlab's table), gates at one change nothing,
pruning (a head, and a whole layer) equals masking on a padded batch, and so does the directory save_pruned writes,
loaded by load_pruned and by plain transformers (the portable pruned_heads.py); the LRP rules conserve relevance on
a bias-free copy, and compute_lrp with the biases on counts what ``v_bias`` keeps. With ``talking_head`` (the heads'
logits and weights mixed) it is refused before any work.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from headlab import attention_blocks, mask_heads, prune_heads
from headlab.data.inputs import ImportanceData
from headlab.errors import HeadlabError
from headlab.importance.lrp import compute_lrp
from headlab.model_description import describe_model
from support.family_matrix import (
    check_gates_at_one_change_nothing,
    check_lrp_conserves,
    padded_inputs,
    padded_logits,
    perturbed_model,
)
from support.table_families import (
    SPECS,
    check_captured_probabilities,
    check_compute_lrp_conserves,
    check_masking_equals_zeroed,
    check_pruned_equals_masked,
    check_pruned_reloads_as_masked,
    table_spec,
)

D = 8  # head size: hidden 32 over 4 heads
LAYOUTS = {
    "absolute": {},  # DebertaConfig's defaults: no relative attention, absolute positions
    "c2p": {"relative_attention": True, "pos_att_type": ["c2p"], "max_relative_positions": 16},
    "p2c": {"relative_attention": True, "pos_att_type": ["p2c"]},  # max_relative_positions: max_position_embeddings
    # deberta-base's: both, absolute positions added to the input too
    "c2p|p2c": {"relative_attention": True, "pos_att_type": ["c2p", "p2c"], "max_relative_positions": 16},
}


def _deberta(layout: str = "c2p|p2c", **extra) -> torch.nn.Module:
    """A tiny DebertaForMaskedLM, its biases (q_bias, v_bias, pos_q_proj's...) moved off zero."""
    config = tf.DebertaConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                              intermediate_size=37, max_position_embeddings=64, pad_token_id=2,
                              **LAYOUTS[layout], **extra)
    return perturbed_model(tf.DebertaForMaskedLM, config, attn_implementation="eager")


def _zero_value_head(model, layer: int, head: int) -> None:
    """Head ``head``'s values at 0, by hand: DisentangledSelfAttention views in_proj's output [.., heads, 3 * d] and
    chunks it, so head h's values are rows 3hd + 2d .. 3hd + 3d of in_proj; v_bias (heads * d) adds hd .. hd + d."""
    attention = model.deberta.encoder.layer[layer].attention.self
    with torch.no_grad():
        attention.in_proj.weight[3 * head * D + 2 * D: 3 * head * D + 3 * D] = 0
        attention.v_bias[head * D: (head + 1) * D] = 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_blocks_are_the_table(layout):
    model = _deberta(layout)
    blocks = attention_blocks(model)
    assert [(b.kind, b.layer, b.n_heads, b.n_kv_heads, b.d_head, b.family.name) for b in blocks] == \
        [("enc_self", layer, 4, 4, D, "deberta") for layer in (0, 1)]
    assert blocks[0].qkv is model.deberta.encoder.layer[0].attention.self.in_proj
    rows = {"absolute": [], "c2p": ["self.pos_proj"], "p2c": ["self.pos_q_proj"],
            "c2p|p2c": ["self.pos_proj", "self.pos_q_proj"]}[layout]
    assert [path for path, _ in blocks[0].family.head_rows] == rows


@pytest.mark.parametrize("layout", LAYOUTS)
def test_captured_probabilities_are_the_models_own(layout):
    """What capture reads (it asks the core for them: output_attentions) equals transformers' own
    output_attentions, on a padded batch."""
    check_captured_probabilities(_deberta(layout).double(), "enc_self")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_masking_equals_zeroed_values(layout):
    check_masking_equals_zeroed(lambda: _deberta(layout).double(), "enc_self", _zero_value_head, padded_logits)


def test_gates_at_one_change_nothing():
    model = _deberta()
    ids, mask = padded_inputs(pad_id=2)
    check_gates_at_one_change_nothing(model, {"input_ids": ids, "attention_mask": mask})


@pytest.mark.parametrize("spec_name", SPECS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_pruned_equals_masked_in_float64(layout, spec_name):
    """in_proj's per-head [q | k | v] rows, q_bias and v_bias, and pos_proj's / pos_q_proj's rows of the kept heads:
    the pruned model's logits are the masked model's (a layer with no head left too)."""
    model = _deberta(layout).double()
    spec, heads_left = table_spec("enc_self", spec_name)
    check_pruned_equals_masked(model, spec, heads_left)
    attention = model.deberta.encoder.layer[1].attention.self
    assert attention.q_bias.shape == attention.v_bias.shape == (heads_left[1] * D,)


@pytest.mark.parametrize("spec_name", SPECS)
def test_pruned_reloads(spec_name, tmp_path):
    """save_pruned, then load_pruned and plain transformers (trust_remote_code: pruned_heads.py) give the masked
    model's logits, every tensor loaded."""
    check_pruned_reloads_as_masked(_deberta(), *table_spec("enc_self", spec_name), tmp_path)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_lrp_conserves_in_float64(layout):
    model = _deberta(layout).double()
    check_lrp_conserves(model, model.deberta.encoder.layer[0], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_compute_lrp_conserves_with_biases_and_padding(layout):
    """compute_lrp with the biases on (padded sentences) conserves every sentence's logit to 1e-9 in float64: what
    v_bias keeps is counted (a probe at in_proj's value columns), and pos_q_proj's bias, which only moves the
    attention weights (held constant), keeps nothing."""
    check_compute_lrp_conserves(_deberta(layout).double())


def test_talking_heads_are_refused_before_any_work():
    """talking_head=True: head_logits_proj and head_weights_proj mix the heads, refused naming them."""
    model = _deberta(talking_head=True)
    for action in (lambda: attention_blocks(model), lambda: mask_heads(model, {("enc_self", 0): [1]}).__enter__(),
                   lambda: prune_heads(model, {("enc_self", 0): [1]})):
        with pytest.raises(HeadlabError, match=r"DeBERTa \(v1\) with talking_head=True mixes its heads"):
            action()
    assert model.deberta.encoder.layer[0].attention.self.in_proj.weight.shape == (3 * 32, 32)  # untouched


def test_deberta_analyze_end_to_end(tmp_path, capsys):
    """headlab analyze on a saved DeBERTa v1 with both position terms: every stage runs (LRP's conservation check
    included)."""
    from support.family_matrix import ANALYZE_STAGES, analyze, save_tiny, treebank_files

    save_tiny(_deberta(), tmp_path / "deberta", treebank_files(tmp_path), "bert")
    code, stages = analyze(tmp_path / "deberta", tmp_path)
    assert code == 0, capsys.readouterr().err
    for name in (*ANALYZE_STAGES, "lrp"):
        assert stages[name]["status"] == "done", stages[name]


# -- ConvBERT: analysed, masked and gated since session 40, LRP since session 43, its pruning refused --------------------
# (tests/test_convbert.py, tests/test_lrp_convbert.py)


def _deberta_v2(cls=tf.DebertaV2ForMaskedLM, **extra) -> torch.nn.Module:
    return perturbed_model(cls, tf.DebertaV2Config(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
        max_position_embeddings=64, relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=8,
        max_relative_positions=16, share_att_key=True, norm_rel_ebd="layer_norm", pad_token_id=2, **extra),
        attn_implementation="eager")


@pytest.mark.parametrize("build", [
    lambda: _deberta(legacy=False), lambda: _deberta_v2(legacy=False),
    # ContextPooler: ACT2FN[pooler_hidden_act](dense(x[:, 0])), its activation built in the forward
    lambda: perturbed_model(tf.DebertaForSequenceClassification, tf.DebertaConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
        max_position_embeddings=64, pad_token_id=2, num_labels=3, **LAYOUTS["c2p|p2c"]), attn_implementation="eager"),
    lambda: _deberta_v2(tf.DebertaV2ForSequenceClassification, num_labels=3),
], ids=["v1-lm-head", "v2-lm-head", "v1-classifier", "v2-classifier"])
def test_compute_lrp_explains_the_heads_deberta_computes_itself(build):
    """With legacy=False DeBERTa's LM head multiplies LayerNorm(act(dense(x))) by the word embeddings itself, and
    get_output_embeddings names its dense (hidden to hidden): LRP explains the real logit (compute_lrp read dense
    as the output layer and failed with a raw IndexError before). A classifier's pooler applies its activation as
    a module built in its forward: it gets the activation rule (before, relevance was not conserved: ratios
    0.99-1.03, refused after the work). Each conserves to 1e-9 with biases on."""
    check_compute_lrp_conserves(build().double())


def test_a_non_legacy_lm_head_computing_something_else_is_refused():
    """The rebuilt logit is checked against the model's: a head of that class computing anything else is refused."""
    model = _deberta(legacy=False)
    head = model.lm_predictions.lm_head
    original = type(head).forward
    head.__class__ = type("DebertaLMPredictionHead", (type(head),),
                          {"forward": lambda self, h, embeddings: original(self, h, embeddings) * 2})
    data = ImportanceData.from_ids([[5, 6, 7, 8], [9, 10, 11]])
    with pytest.raises(HeadlabError, match=r"DeBERTa's LM head \(legacy=False\) does not compute its logits"):
        compute_lrp(model, data, describe_model(model), bootstrap=0)
