"""Longformer: sliding-window and global attention as a table family (refused before any work until session 30).

Its attention (LongformerSelfAttention, transformers 5.24) computes, per query, probabilities over a band of
``2w + 1`` keys and over the batch's global tokens, and each global token's own row over every key with projections
of its own (query_global, key_global, value_global). Outside the band and the global tokens a query's probability
is exactly 0, so the band scattered into place is the whole [query, key] map. On tiny float64 models, with windows
that differ per layer, padded batches, lengths that are not a multiple of the window (the model pads them) and
global attention on some tokens:

* capture equals the dense map worked out, entry by entry, from transformers' own ``output_attentions`` (the band
  and ``global_attentions``: tests/support/longformer.py), cut back to the input's length;
* masking a head equals zeroing its value rows AND its value_global rows (its global queries' outputs), and
  zeroing the value rows alone does not (the global rows matter);
* LRP conserves relevance, the global queries' and keys' projections held constant with the local ones
  (``Family.head_rows``) and relevance passed through value_global (``Family.head_row_values``); without either it
  does not;
* physical pruning (refused until session 31) slices the six projections with the heads and gives a pruned layer
  PRUNED_FORWARDS["longformer"] (transformers' own forward reshapes the heads' output to the input's width): it
  equals masking in float64 on the padded batch (the window padding too), with global tokens, and with a layer left
  with no head; so does the directory save_pruned writes, loaded by load_pruned and by plain transformers
  (pruned_heads.py, trust_remote_code), and LRP conserves on the pruned model.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers as tf

from headlab import HeadlabError, attention_blocks, capture_attention, load_pruned, mask_heads, prune_heads, save_pruned
from headlab.adapters import families
from headlab.data.inputs import ImportanceData
from headlab.importance.lrp import compute_lrp
from headlab.model_description import describe_model
from headlab.surgery import check_prunable
from support.family_matrix import ANALYZE_STAGES, analyze, check_lrp_conserves, perturbed_model, save_tiny, treebank_files
from support.longformer import dense_maps, global_token_0
from support.table_families import check_compute_lrp_conserves

# per layer: a query sees 2 and 4 keys each side. (transformers pads to a multiple of the largest window only: windows
# [4, 6] fail its own assertion on a length of 6)
WINDOWS = [4, 8]


def _config(**extra) -> tf.LongformerConfig:
    return tf.LongformerConfig(**{**dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                                         num_attention_heads=4, max_position_embeddings=64, attention_window=WINDOWS,
                                         pad_token_id=1, bos_token_id=0, eos_token_id=2), **extra})


def _model(cls=tf.LongformerForMaskedLM, **extra) -> torch.nn.Module:
    return perturbed_model(cls, _config(**extra), attn_implementation="eager").double()


def _inputs(globals_: bool) -> dict:
    """Three rows of 9 tokens (padded by the model to 16, the larger window's multiple): one full, one padded on
    the right, one on the left; with ``globals_``, global attention on token 0 of every row, on token 4 of the
    first, on tokens 5 and 7 of the second (7 is padding: the model drops it, global_attention_mask times
    attention_mask) and on the third's first real token (slot counts that differ per row)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 99, (3, 9), generator=g)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, -2:] = 0
    mask[2, :3] = 0
    inputs = {"input_ids": ids.masked_fill(mask == 0, 1), "attention_mask": mask}
    if globals_:
        chosen = torch.zeros(3, 9, dtype=torch.long)
        chosen[:, 0] = 1
        chosen[0, 4] = 1
        chosen[1, [5, 7]] = 1
        chosen[2, 0] = 0
        chosen[2, 3] = 1  # the left-padded row's first real token
        inputs["global_attention_mask"] = chosen
    return inputs


@pytest.mark.parametrize("globals_", [False, True], ids=["local", "global"])
def test_capture_equals_the_band_scattered_from_output_attentions(globals_):
    model = _model()
    inputs = _inputs(globals_)
    with torch.no_grad():
        out = model(**inputs, output_attentions=True)
    chosen = inputs.get("global_attention_mask")
    reference = dense_maps(out.attentions, out.global_attentions,
                           None if chosen is None else chosen * inputs["attention_mask"], WINDOWS)
    with capture_attention(model) as record:
        with torch.no_grad():
            model(**inputs)
    assert sorted(record) == [("enc_self", 0), ("enc_self", 1)]
    for layer in range(2):
        captured = record[("enc_self", layer)]
        assert captured.shape == (3, 4, 9, 9)  # cut back from the padded 16
        assert torch.equal(captured, reference[layer])
        real = inputs["attention_mask"].bool()
        sums = captured.sum(-1).permute(0, 2, 1)[real]  # [real queries, heads]
        torch.testing.assert_close(sums, torch.ones_like(sums))
        assert bool((captured.permute(0, 2, 1, 3)[~real] == 0).all())  # a padding query's row is empty
        # a local query sees its band (and the global tokens) only
        offsets = (torch.arange(9)[None, :] - torch.arange(9)[:, None]).abs()
        outside = (offsets > WINDOWS[layer] // 2)[None, None].expand_as(captured).clone()
        if globals_:
            chosen = (inputs["global_attention_mask"] * inputs["attention_mask"]).bool()
            outside &= ~chosen[:, None, None, :]  # any query may attend to a global key
            outside &= ~chosen[:, None, :, None]  # a global query attends to every key
        assert bool((captured[outside] == 0).all())


def test_capture_with_the_classifiers_own_global_token():
    """LongformerForSequenceClassification puts global attention on token 0 itself: its row is the whole sequence."""
    model = _model(tf.LongformerForSequenceClassification, num_labels=3)
    inputs = _inputs(False)
    with torch.no_grad():
        out = model(**inputs, output_attentions=True)
    chosen = torch.zeros_like(inputs["attention_mask"])
    chosen[:, 0] = 1
    chosen *= inputs["attention_mask"]  # the left-padded row's token 0 is padding: no global token there
    reference = dense_maps(out.attentions, out.global_attentions, chosen, WINDOWS)
    with capture_attention(model) as record, torch.no_grad():
        model(**inputs)
    for layer in range(2):
        assert torch.equal(record[("enc_self", layer)], reference[layer])
        assert bool((record[("enc_self", layer)][0, :, 0] > 0).all())  # token 0 attends to all 9 tokens
        assert bool((record[("enc_self", layer)][0, :, 1:, 0] > 0).all())  # and all 9 to it


def _zero_rows(model, layer: int, head: int, names: tuple[str, ...]) -> None:
    core = model.longformer.encoder.layer[layer].attention.self
    rows = slice(head * core.head_dim, (head + 1) * core.head_dim)
    with torch.no_grad():
        for name in names:
            getattr(core, name).weight[rows] = 0
            getattr(core, name).bias[rows] = 0


@pytest.mark.parametrize("globals_", [False, True], ids=["local", "global"])
def test_masking_equals_zeroed_values_and_global_values(globals_):
    model = _model()
    inputs = _inputs(globals_)
    with torch.no_grad():
        before = model(**inputs).logits
        with mask_heads(model, {("enc_self", 0): [2]}):
            masked = model(**inputs).logits
        assert not torch.equal(masked, before)
        assert torch.equal(model(**inputs).logits, before)  # the mask came off
        values_only = _model()
        _zero_rows(values_only, 0, 2, ("value",))
        zeroed = _model()
        _zero_rows(zeroed, 0, 2, ("value", "value_global"))
        torch.testing.assert_close(masked, zeroed(**inputs).logits, rtol=0, atol=1e-12)
        # with global tokens, the head's global queries read value_global: zeroing value alone leaves them
        assert torch.equal(values_only(**inputs).logits, zeroed(**inputs).logits) is not globals_


SPECS = {
    "partial": ({("enc_self", 0): [1], ("enc_self", 1): [0, 2]}, [3, 2]),
    "no head left": ({("enc_self", 0): [0, 1, 2, 3], ("enc_self", 1): [2]}, [0, 3]),
}


@pytest.mark.parametrize("globals_", [False, True], ids=["local", "global"])
@pytest.mark.parametrize("spec_name", SPECS)
def test_pruned_equals_masked(spec_name, globals_):
    """query/key/value and their _global twins lose the removed heads' rows, output.dense their columns; the logits of
    the padded batch (9 tokens the model pads to 16) equal the masked model's to 1e-12 in float64."""
    model, inputs = _model(), _inputs(globals_)
    spec, heads_left = SPECS[spec_name]
    with torch.no_grad(), mask_heads(model, spec):
        expected = model(**inputs).logits
    prune_heads(model, spec)
    assert [block.n_heads for block in attention_blocks(model)] == heads_left
    core = model.longformer.encoder.layer[1].attention.self
    for name in ("query", "key", "value", "query_global", "key_global", "value_global"):
        assert getattr(core, name).weight.shape == (8 * heads_left[1], 32), name
    assert model.longformer.encoder.layer[1].attention.output.dense.weight.shape == (32, 8 * heads_left[1])
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, expected, atol=1e-12, rtol=0)
    check_prunable(model)  # prune train's check passes too


def test_pruned_layer_captures_its_kept_heads():
    """Capture on the pruned model (its band and global rows read with 3 heads): layer 0's maps are the unpruned
    model's of heads 0, 2 and 3 (layer 0's input is the same; layer 1's is not)."""
    model, inputs = _model(), _inputs(True)
    with capture_attention(model) as full, torch.no_grad():
        model(**inputs)
    prune_heads(model, SPECS["partial"][0])
    with capture_attention(model) as pruned, torch.no_grad():
        model(**inputs)
    assert pruned[("enc_self", 0)].shape == (3, 3, 9, 9) and pruned[("enc_self", 1)].shape == (3, 2, 9, 9)
    torch.testing.assert_close(pruned[("enc_self", 0)], full[("enc_self", 0)][:, [0, 2, 3]], atol=1e-12, rtol=0)


def test_pruning_needs_its_forward(monkeypatch):
    """The regression PRUNED_FORWARDS["longformer"] fixes: LongformerSelfAttention's own forward reshapes the heads'
    output to its input's width and fails on a pruned layer; pruning then refuses, the model left as it was."""
    monkeypatch.setitem(families.FAMILIES, "longformer", dataclasses.replace(families.LONGFORMER, pruned_forward=""))
    model = _model()
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(HeadlabError, match="the pruned model fails"):
        prune_heads(model, {("enc_self", 0): [1]})
    assert all(torch.equal(tensor, state[name]) for name, tensor in model.state_dict().items())
    assert [block.n_heads for block in attention_blocks(model)] == [4, 4]


@pytest.mark.parametrize("spec_name", SPECS)
def test_pruned_reloads(spec_name, tmp_path):
    """save_pruned, then load_pruned and plain transformers (pruned_heads.py, trust_remote_code: every weight loaded,
    none left out) give the masked model's logits on the padded batch with global tokens."""
    import json

    model, inputs = _model(), _inputs(True)
    spec, heads_left = SPECS[spec_name]
    with torch.no_grad(), mask_heads(model, spec):
        expected = model(**inputs).logits
    prune_heads(model, spec)
    save_pruned(model, tmp_path)
    assert json.loads((tmp_path / "headlab_pruning.json").read_text())["portable"]["how"] == "remote code"
    reloaded = load_pruned(tmp_path).double()
    assert [block.n_heads for block in attention_blocks(reloaded)] == heads_left
    plain, info = tf.AutoModelForMaskedLM.from_pretrained(tmp_path, trust_remote_code=True, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**inputs).logits, expected, atol=1e-12, rtol=0)
        torch.testing.assert_close(plain.eval().double()(**inputs).logits, expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("globals_", [False, True], ids=["local", "global"])
def test_lrp_conserves_with_the_global_projections_held(globals_):
    """What reaches layer 0's input sums to the explained logit to 1e-10; with ``globals_`` every forward attends
    globally from token 0 (a pre-hook hands the model a global_attention_mask: check_lrp_conserves makes its own
    inputs)."""
    model = _model(tf.LongformerForMaskedLM)
    if globals_:  # every forward of this model attends globally from token 0 (a hook adds global_attention_mask)
        model.longformer.register_forward_pre_hook(global_token_0, with_kwargs=True)
    check_lrp_conserves(model, model.longformer.encoder.layer[0], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("globals_", [False, True], ids=["local", "global"])
@pytest.mark.parametrize("spec_name", [None, *SPECS])
def test_compute_lrp_conserves_with_biases_and_padding(spec_name, globals_):
    """compute_lrp (biases on, padded sentences of lengths around the window) conserves every logit to 1e-9, pruned
    too."""
    model = _model(tf.LongformerForMaskedLM)
    if spec_name:
        prune_heads(model, SPECS[spec_name][0])
    if globals_:
        model.longformer.register_forward_pre_hook(global_token_0, with_kwargs=True)
    check_compute_lrp_conserves(model)


def test_compute_lrp_counts_the_seq_major_biases_per_sentence(monkeypatch):
    """The regression Family.seq_major fixes: LongformerSelfAttention calls its projections on [seq, batch, d], and
    the bias probes, read batch-major, gave value's bias relevance to the wrong sentences of a padded batch (until
    session 42 found by the conservation check after the work; now by the check of the rows' sentences, lrp._check_rows,
    at the first batch, naming the projection)."""
    monkeypatch.setitem(families.FAMILIES, "longformer", dataclasses.replace(families.LONGFORMER, seq_major=()))
    model = _model(tf.LongformerForMaskedLM)
    g = torch.Generator().manual_seed(0)
    data = ImportanceData.from_ids([torch.randint(3, 99, (k,), generator=g).tolist() for k in (3, 6, 9)])
    with pytest.raises(HeadlabError, match=r"the bias of longformer.encoder.layer.0.attention.self.value: its \d+ "
                                           r"rows are not the batch's tokens in batch order"):
        compute_lrp(model, data, describe_model(model), bootstrap=0)


def test_lrp_without_the_global_hold_does_not_conserve(monkeypatch):
    """The regression the hold fixes: with query_global and key_global not held constant, relevance leaks."""
    unheld = tuple(path for path, _ in families.LONGFORMER.head_rows)
    monkeypatch.setitem(families.FAMILIES, "longformer", dataclasses.replace(families.LONGFORMER,
                                                                            head_row_values=unheld))
    model = _model(tf.LongformerForMaskedLM)
    model.longformer.register_forward_pre_hook(global_token_0, with_kwargs=True)
    with pytest.raises(AssertionError):
        check_lrp_conserves(model, model.longformer.encoder.layer[0], rtol=1e-10, atol=1e-10)


def test_lrp_with_value_global_held_does_not_conserve(monkeypatch):
    """The regression Family.head_row_values fixes: value_global among the head rows held constant (as the global
    queries and keys), its values' relevance is lost."""
    monkeypatch.setitem(families.FAMILIES, "longformer", dataclasses.replace(families.LONGFORMER, head_row_values=()))
    model = _model(tf.LongformerForMaskedLM)
    model.longformer.register_forward_pre_hook(global_token_0, with_kwargs=True)
    with pytest.raises(AssertionError):
        check_lrp_conserves(model, model.longformer.encoder.layer[0], rtol=1e-10, atol=1e-10)


def test_analyze_end_to_end(tmp_path, capsys):
    """headlab analyze --ablation (confidence, LRP, gradient, ablation, functions, aggregate, the report) on a saved
    tiny Longformer: every stage done, LRP's too."""
    model = _model().float()
    save_tiny(model, tmp_path / "longformer", treebank_files(tmp_path), "bert")
    code, stages = analyze(tmp_path / "longformer", tmp_path)
    assert code == 0, capsys.readouterr().err
    for name in (*ANALYZE_STAGES, "lrp"):
        assert stages[name]["status"] == "done", stages[name]


def test_prune_command_writes_the_pruned_model(tmp_path, capsys):
    """`headlab prune` on a saved Longformer (refused until session 31): exit 0, a directory plain transformers
    loads with one head fewer in layer 0."""
    from headlab.cli import main

    _model().float().save_pretrained(tmp_path / "longformer")
    code = main(["prune", str(tmp_path / "longformer"), "--heads", "enc_self:0:1", "--out", str(tmp_path / "out")])
    assert code == 0, capsys.readouterr().err
    plain = tf.AutoModelForMaskedLM.from_pretrained(tmp_path / "out", trust_remote_code=True)
    assert plain.longformer.encoder.layer[0].attention.self.value_global.weight.shape == (24, 32)


def test_windows_that_do_not_divide_the_largest_are_refused_before_any_work():
    """transformers pads to a multiple of the largest window only: with windows [4, 6] a 6-token input fails layer 0's
    own assertion inside transformers; headlab refuses the config, naming why."""
    model = _model(attention_window=[4, 6])
    with pytest.raises(Exception, match="multiple of 4"):  # what transformers itself does on 6 tokens
        model(input_ids=torch.randint(3, 99, (1, 6)))
    with pytest.raises(HeadlabError, match=r"windows \[4, 6\] do not all divide the largest"):
        attention_blocks(model)
