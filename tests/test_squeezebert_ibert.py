"""I-BERT (quant_mode=False) as a table family, I-BERT with quant_mode=True refused; SqueezeBERT.

I-BERT's modeling code (transformers 5.24, models/ibert) is BERT's layout, outside transformers' attention interface,
with every module taking and returning (value, scaling factor) pairs: ``IBertSelfAttention`` returns ``((context,
probs), (factors))``, its projections are ``QuantLinear`` (weight ``[out, in]`` beside integer-weight buffers), its
norms ``IntLayerNorm``. With quant_mode=False the arithmetic is BERT's and every factor None. In float64: capture
equals ``output_attentions``, masking a head equals zeroing its value rows and bias by hand, gates at one change
nothing, pruning (a head, and a whole layer) equals masking on a padded batch, and so does the directory save_pruned
writes (QuantLinear's integer buffers sliced with its weight), loaded by load_pruned and by plain transformers (the
portable pruned_heads.py: a QuantLinear rebuilt as one, a layer with no head returning I-BERT's pair); the LRP rules
conserve relevance (IntLayerNorm's layer-norm rule read through its pair), and compute_lrp with biases counts
QuantLinear's and IntLayerNorm's biases. quant_mode=True (integer arithmetic, scaling factors from the whole layer's
values) is refused before any work.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from headlab import attention_blocks, mask_heads, prune_heads
from headlab.errors import HeadlabError
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


# -- I-BERT ------------------------------------------------------------------------------------------------------------
def _ibert(**extra) -> torch.nn.Module:
    return perturbed_model(tf.IBertForMaskedLM, tf.IBertConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
        max_position_embeddings=64, pad_token_id=2, **extra), attn_implementation="eager")


def _zero_ibert_value_head(model, layer: int, head: int) -> None:
    """Head ``head``'s values at 0, by hand: IBertSelfAttention views value(x) [batch, seq, -1, d], so head h's
    values are rows hd .. hd + d of ``value`` (a QuantLinear: weight [out, in], F.linear with quant_mode=False)."""
    value = model.ibert.encoder.layer[layer].attention.self.value
    with torch.no_grad():
        value.weight[head * D:(head + 1) * D] = 0
        value.bias[head * D:(head + 1) * D] = 0


def test_ibert_blocks_are_the_table():
    model = _ibert()
    blocks = attention_blocks(model)
    assert [(b.kind, b.layer, b.n_heads, b.d_head, b.family.name) for b in blocks] == \
        [("enc_self", layer, 4, D, "ibert") for layer in (0, 1)]
    assert blocks[0].v is model.ibert.encoder.layer[0].attention.self.value
    assert blocks[0].o is model.ibert.encoder.layer[0].attention.output.dense


def test_ibert_captured_probabilities_are_the_models_own():
    """Capture asks IBertSelfAttention for its probabilities and reads them out of its ((context, probs), factors)
    pair: bit for bit transformers' output_attentions."""
    check_captured_probabilities(_ibert().double(), "enc_self")


def test_ibert_masking_equals_zeroed_values():
    check_masking_equals_zeroed(lambda: _ibert().double(), "enc_self", _zero_ibert_value_head, padded_logits)


def test_ibert_gates_at_one_change_nothing():
    ids, mask = padded_inputs(pad_id=2)
    check_gates_at_one_change_nothing(_ibert(), {"input_ids": ids, "attention_mask": mask})


@pytest.mark.parametrize("spec_name", SPECS)
def test_ibert_pruned_equals_masked_in_float64(spec_name):
    model = _ibert().double()
    spec, heads_left = table_spec("enc_self", spec_name)
    check_pruned_equals_masked(model, spec, heads_left)
    query = model.ibert.encoder.layer[1].attention.self.query
    # the integer copies (unread with quant_mode=False, saved with the weights) sliced with the weight
    assert query.weight_integer.shape == query.weight.shape == (heads_left[1] * D, 32)
    assert query.bias_integer.shape == query.fc_scaling_factor.shape == (heads_left[1] * D,)
    assert model.ibert.encoder.layer[1].attention.output.dense.weight_integer.shape == (32, heads_left[1] * D)


@pytest.mark.parametrize("spec_name", SPECS)
def test_ibert_pruned_reloads(spec_name, tmp_path):
    """save_pruned, load_pruned and plain transformers (pruned_heads.py, which rebuilds a QuantLinear as a QuantLinear
    and a layer with no head returning ((output,), (None,))): every tensor loaded, the masked model's logits."""
    check_pruned_reloads_as_masked(_ibert(), *table_spec("enc_self", spec_name), tmp_path)


def test_ibert_lrp_conserves_in_float64():
    model = _ibert().double()
    check_lrp_conserves(model, model.ibert.encoder.layer[0], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("spec_name", [None, *SPECS])
def test_ibert_compute_lrp_conserves_with_biases_and_padding(spec_name):
    """compute_lrp with biases (QuantLinear's and IntLayerNorm's, each returning (output, None)), unpruned and pruned
    (a layer with no head: its output projection adds its bias alone), conserves to 1e-9 in float64."""
    model = _ibert().double()
    if spec_name is not None:
        prune_heads(model, table_spec("enc_self", spec_name)[0])
    check_compute_lrp_conserves(model)


def test_ibert_quant_mode_refused_before_any_work():
    model = _ibert(quant_mode=True)
    before = {name: p.clone() for name, p in model.named_parameters()}
    for action in (lambda: attention_blocks(model), lambda: mask_heads(model, {("enc_self", 0): [1]}).__enter__(),
                   lambda: prune_heads(model, {("enc_self", 0): [1]})):
        with pytest.raises(HeadlabError, match=r"I-BERT with quant_mode=True runs integer-only arithmetic"):
            action()
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())


def test_ibert_quant_mode_refused_by_the_command_line_once(tmp_path, capsys):
    """The saved config's quant_mode is read before the model is built: exit 2, one message, nothing written."""
    from headlab.cli import main
    from support.family_matrix import save_tiny

    save_tiny(_ibert(quant_mode=True), tmp_path / "ibert", ("the", "a", "cat", "dog"), "bert")
    (tmp_path / "text.txt").write_text("the cat\n", encoding="utf-8")
    code = main(["analyze", str(tmp_path / "ibert"), "--source", str(tmp_path / "text.txt"),
                 "--out", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("is not supported") == 1 and "quant_mode=True" in err, err
    assert not (tmp_path / "out").exists()


# -- SqueezeBERT -------------------------------------------------------------------------------------------------------
GROUPS = {
    "default": {},  # q/k/v grouped by 4 (each head's channels one group), post_attention ungrouped
    "grouped-post": {"q_groups": 2, "k_groups": 2, "v_groups": 2, "post_attention_groups": 2},
}


def _squeezebert(groups: str = "default", layers: int = 2) -> torch.nn.Module:
    return perturbed_model(tf.SqueezeBertForMaskedLM, tf.SqueezeBertConfig(
        vocab_size=99, hidden_size=32, embedding_size=32, num_hidden_layers=layers, num_attention_heads=4,
        intermediate_size=40, max_position_embeddings=64, pad_token_id=2, **GROUPS[groups]),
        attn_implementation="eager")


def _zero_squeezebert_value_head(model, layer: int, head: int) -> None:
    """Head ``head``'s values at 0, by hand: SqueezeBertSelfAttention views value(x) [batch, C, seq] as [batch,
    heads, d, seq], so head h's values are output channels hd .. hd + d of the 1x1 convolution ``value`` (weight
    [out, in / groups, 1]: an output channel's row, whatever its group)."""
    value = model.transformer.encoder.layers[layer].attention.value
    with torch.no_grad():
        value.weight[head * D:(head + 1) * D] = 0
        value.bias[head * D:(head + 1) * D] = 0


@pytest.mark.parametrize("groups", GROUPS)
def test_squeezebert_blocks_are_the_table(groups):
    model = _squeezebert(groups)
    blocks = attention_blocks(model)
    assert [(b.kind, b.layer, b.n_heads, b.d_head, b.family.name) for b in blocks] == \
        [("enc_self", layer, 4, D, "squeezebert") for layer in (0, 1)]
    layer = model.transformer.encoder.layers[0]
    assert (blocks[0].q, blocks[0].v, blocks[0].o) == (layer.attention.query, layer.attention.value,
                                                       layer.post_attention.conv1d)


@pytest.mark.parametrize("groups", GROUPS)
def test_squeezebert_captured_probabilities_are_the_softmax_of_its_attentions(groups):
    """transformers' SqueezeBERT hands out its attention SCORES as ``attentions`` (q k^T / sqrt(d) + mask, before
    self.softmax); capture records the probabilities its values are weighed by: bit for bit the softmax of them."""
    model = _squeezebert(groups).double()
    ids, mask = padded_inputs(pad_id=2)
    with torch.no_grad():
        scores = model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    from headlab import capture_attention

    with torch.no_grad(), capture_attention(model) as record:
        model(input_ids=ids, attention_mask=mask)
    assert sorted(record) == [("enc_self", 0), ("enc_self", 1)]
    for layer in (0, 1):
        assert torch.equal(record[("enc_self", layer)], torch.softmax(scores[layer], dim=-1)), layer
        torch.testing.assert_close(record[("enc_self", layer)].sum(-1), torch.ones(3, 4, 7, dtype=torch.float64))


@pytest.mark.parametrize("groups", GROUPS)
def test_squeezebert_masking_equals_zeroed_values(groups):
    """The heads' outputs reach post_attention.conv1d channels-first ([batch, heads x d, seq]): masking a head zeroes
    its channels there, which equals zeroing its value channels by hand."""
    check_masking_equals_zeroed(lambda: _squeezebert(groups).double(), "enc_self", _zero_squeezebert_value_head,
                                padded_logits)


def test_squeezebert_gates_at_one_change_nothing():
    ids, mask = padded_inputs(pad_id=2)
    check_gates_at_one_change_nothing(_squeezebert(), {"input_ids": ids, "attention_mask": mask})


@pytest.mark.parametrize("groups", GROUPS)
def test_squeezebert_lrp_conserves_in_float64(groups):
    """The rules (SqueezeBertLayerNorm's over channels, the 1x1 convolutions' weighted sums) conserve relevance from
    the logit to the encoder's input (its layers are called by .forward, past any hook on them)."""
    model = _squeezebert(groups).double()
    check_lrp_conserves(model, model.transformer.encoder, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("groups", GROUPS)
def test_squeezebert_compute_lrp_conserves_with_biases_and_padding(groups):
    """compute_lrp with biases: the convolutions' and the channels-first norms' biases probed per channel."""
    check_compute_lrp_conserves(_squeezebert(groups).double())


def test_squeezebert_analyze_end_to_end(tmp_path, capsys):
    from support.family_matrix import ANALYZE_STAGES, analyze, save_tiny, treebank_files

    save_tiny(_squeezebert(), tmp_path / "squeezebert", treebank_files(tmp_path), "bert")
    code, stages = analyze(tmp_path / "squeezebert", tmp_path)
    assert code == 0, capsys.readouterr().err
    for name in (*ANALYZE_STAGES, "lrp"):
        assert stages[name]["status"] == "done", stages[name]


# (layer 0's q/k/v groups, post_attention groups and output class; layer 1's) after each plan: a grouped convolution
# keeps its groups where every group keeps as many channels, and becomes ungrouped (zero blocks) otherwise
PRUNED_GROUPS = {
    ("default", "partial"): [(1, 1, "Conv1d"), (1, 1, "Conv1d")],  # 4 groups of one head each: unequal
    ("default", "no head left"): [(4, 1, "NoInputConv1d"), (1, 1, "Conv1d")],
    ("grouped-post", "partial"): [(1, 1, "Conv1d"), (2, 2, "Conv1d")],  # layer 1 loses heads 0 and 2: one per group
    ("grouped-post", "no head left"): [(2, 2, "NoInputConv1d"), (1, 1, "Conv1d")],
}


@pytest.mark.parametrize("spec_name", SPECS)
@pytest.mark.parametrize("groups", GROUPS)
def test_squeezebert_pruned_equals_masked_in_float64(groups, spec_name):
    """q/k/v lose the removed heads' output channels, post_attention.conv1d their input channels; a grouped convolution
    stays grouped only where every group keeps as many channels (else its weight is made dense, zero outside each
    output channel's group: the same products summed with exact zeros); a layer with no head left adds its output
    convolution's bias alone (NoInputConv1d: torch's convolution refuses an empty input)."""
    model = _squeezebert(groups).double()
    check_pruned_equals_masked(model, *table_spec("enc_self", spec_name))
    assert [(layer.attention.query.groups, layer.post_attention.conv1d.groups,
             type(layer.post_attention.conv1d).__name__) for layer in model.transformer.encoder.layers] == \
        PRUNED_GROUPS[(groups, spec_name)]


@pytest.mark.parametrize("spec_name", SPECS)
@pytest.mark.parametrize("groups", GROUPS)
def test_squeezebert_pruned_reloads(groups, spec_name, tmp_path):
    """save_pruned, load_pruned and plain transformers (pruned_heads.py rebuilds each convolution with its pruned
    channels and groups, NoInputConv1d where no head is left, and a no-head layer's stand-in returns SqueezeBERT's
    dict): every tensor loaded, the masked model's logits."""
    check_pruned_reloads_as_masked(_squeezebert(groups), *table_spec("enc_self", spec_name), tmp_path)


@pytest.mark.parametrize("spec_name", SPECS)
def test_squeezebert_pruned_keeps_its_measures(spec_name):
    """After pruning: capture has the kept heads' maps (a layer with no head none, and transformers' own attentions
    None there), compute_lrp conserves with biases, gates at one change nothing."""
    from headlab import capture_attention

    model = _squeezebert().double()
    spec, heads_left = table_spec("enc_self", spec_name)
    prune_heads(model, spec)
    ids, mask = padded_inputs(pad_id=2)
    with torch.no_grad(), capture_attention(model) as record:
        model(input_ids=ids, attention_mask=mask)
    assert {key: probs.shape[1] for key, probs in record.items()} == \
        {("enc_self", layer): n for layer, n in enumerate(heads_left) if n}
    with torch.no_grad():
        attentions = model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    assert [None if a is None else a.shape[1] for a in attentions] == [n or None for n in heads_left]
    check_compute_lrp_conserves(model)
    check_gates_at_one_change_nothing(model, {"input_ids": ids, "attention_mask": mask})


def test_squeezebert_pruning_check_traces_every_layer():
    """Pruning's own check compares every block's output (its post_attention's, [batch, channels, seq] read per
    position): SqueezeBertEncoder calls layer.forward, past any hook on the layer, so the layer itself is not traced."""
    from headlab.prune_check import probe_inputs, run_probe

    model = _squeezebert()
    trace = run_probe(model, probe_inputs(model))
    assert trace.error is None and trace.ran == {("enc_self", 0), ("enc_self", 1)}
    assert [what for _, what, _ in trace.entries] == [("enc_self", 0), ("enc_self", 1), "logits"]


@pytest.mark.parametrize("spec_name", SPECS)
@pytest.mark.parametrize("build", ["ibert", "squeezebert", "squeezebert-grouped-post"])
def test_pruned_directory_resaved_by_transformers_loads(build, spec_name, tmp_path):
    """A pruned directory loaded by plain transformers and saved again (save_pretrained: no headlab_pruning.json, the
    kept heads read off the weights' shapes) loads through headlab as the masked model: the heads counted off
    QuantLinear's [out, in] weights (not as a Conv1D's [in, out]) and off SqueezeBERT's value convolution's output
    channels (its groups may have been made dense). Before: refused, "the weights do not match it"."""
    from headlab import save_pruned
    from headlab.loading import load_model

    model = _ibert() if build == "ibert" else _squeezebert("grouped-post" if build.endswith("post") else "default")
    spec, heads_left = table_spec("enc_self", spec_name)
    ids, mask = padded_inputs(pad_id=2)
    with mask_heads(model, spec):
        expected = padded_logits(model, ids, mask)
    prune_heads(model, spec)
    save_pruned(model, tmp_path / "pruned")
    tf.AutoModelForMaskedLM.from_pretrained(tmp_path / "pruned", trust_remote_code=True).save_pretrained(
        tmp_path / "resaved")
    loaded = load_model(str(tmp_path / "resaved"))
    assert [b.n_heads for b in attention_blocks(loaded)] == heads_left
    torch.testing.assert_close(padded_logits(loaded, ids, mask), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("build", ["ibert", "squeezebert"])
def test_prune_command_writes_a_directory_that_loads_as_masked(build, tmp_path):
    """`headlab prune` on a saved model: exit 0, and its directory loads through headlab with the kept heads, giving
    the saved model's masked logits (the saved one's: save_tiny gives it the tokenizer's padding id, which I-BERT's
    position ids read)."""
    from headlab.cli import main
    from headlab.loading import load_model
    from support.family_matrix import save_tiny

    save_tiny(_ibert() if build == "ibert" else _squeezebert(), tmp_path / build,
              ("the", "a", "cat", "dog", "sat", "on", "mat", "ran"), "bert")
    model = load_model(str(tmp_path / build))
    ids, mask = padded_inputs(pad_id=2)
    spec = {("enc_self", 0): [1], ("enc_self", 1): [0, 3]}
    with mask_heads(model, spec):
        expected = padded_logits(model, ids, mask)
    code = main(["prune", str(tmp_path / build), "--heads", "enc_self:0:1 enc_self:1:0,3", "--out", str(tmp_path / "out")])
    assert code == 0
    loaded = load_model(str(tmp_path / "out"))
    assert [b.n_heads for b in attention_blocks(loaded)] == [3, 2]
    torch.testing.assert_close(padded_logits(loaded, ids, mask), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("build", [
    lambda: perturbed_model(tf.IBertForSequenceClassification, tf.IBertConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
        max_position_embeddings=64, pad_token_id=2, num_labels=3), attn_implementation="eager"),
    lambda: perturbed_model(tf.RobertaForSequenceClassification, tf.RobertaConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
        max_position_embeddings=64, pad_token_id=2, num_labels=3), attn_implementation="eager"),
    lambda: perturbed_model(tf.SqueezeBertForSequenceClassification, tf.SqueezeBertConfig(
        vocab_size=99, hidden_size=32, embedding_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=40, max_position_embeddings=64, pad_token_id=2, num_labels=3), attn_implementation="eager"),
], ids=["ibert", "roberta", "squeezebert"])
def test_classifiers_conserve(build):
    """compute_lrp on a sequence classifier conserves with biases, to 1e-9. I-BERT's classification head is RoBERTa's,
    out_proj(torch.tanh(dense(x[:, 0]))), tanh a function between two Linears: it gets the activation rule (before,
    both were refused after the work: ratios 0.98-1.003, "LRP did not conserve relevance"); SqueezeBERT's reads its
    pooler (dense, nn.Tanh)."""
    check_compute_lrp_conserves(build().double())
