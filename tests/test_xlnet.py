"""XLNet as a family, the content stream (session 32, xlnet32; refused before, fam31d).

XLNet's ``XLNetRelativeAttention`` (transformers 5.24) keeps q, k, v, o and r as bare parameters of shape
``(d_model, n_head, d_head)`` applied by ``torch.einsum``, with per-head biases (``r_w_bias``, ``r_r_bias``,
``r_s_bias``, ``[n_head, d_head]``) and ``seg_embed`` (``[2, n_head, d_head]``). headlab gives each attention module
identity points at its queries, keys, values and heads' outputs (:mod:`headlab.adapters.xlnet`) and slices the bare
parameters per head (``Family.head_parameters``). The references here are written from the modeling code, not from
headlab's table: the probabilities ``output_attentions`` returns, a head's value slice ``v[:, h, :]`` zeroed by hand,
and every per-head parameter sliced by hand (:func:`_slice_heads`); on a batch padded on the left, as XLNet's
tokenizer pads, with two segments, in float64.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf

from headlab import attention_blocks, capture_attention, load_pruned, mask_heads, prune_heads, save_pruned
from headlab.errors import HeadlabError
from headlab.gates import ScalarGates, gates_attached
from support.family_matrix import check_lrp_conserves, perturbed_model, save_tiny
from support.table_families import SPECS, check_compute_lrp_conserves, table_spec

H, D = 4, 8  # heads, head size: d_model 32
CLASSES = {"lm": (tf.XLNetLMHeadModel, tf.AutoModelForCausalLM),
           "classifier": (tf.XLNetForSequenceClassification, tf.AutoModelForSequenceClassification)}
PER_HEAD = {"q": 1, "k": 1, "v": 1, "o": 1, "r": 1, "seg_embed": 1, "r_w_bias": 0, "r_r_bias": 0, "r_s_bias": 0}
"""Every per-head parameter of XLNetRelativeAttention and the dimension of its heads, read off its __init__ and
einsums ("ibh,hnd->ibnd", "snd", "ibnd" + bias[n, d])."""


def _xlnet(cls=tf.XLNetLMHeadModel, **extra) -> torch.nn.Module:
    config = tf.XLNetConfig(vocab_size=99, d_model=H * D, n_layer=2, n_head=H, d_inner=37, pad_token_id=2,
                            bos_token_id=0, eos_token_id=1, **extra)
    return perturbed_model(cls, config, attn_implementation="eager").double()


def _inputs() -> dict[str, torch.Tensor]:
    """A batch padded on the left, as XLNet's tokenizer pads, with two segments."""
    ids = torch.tensor([[2, 2, 5, 6, 7, 8], [5, 9, 10, 11, 12, 13]])
    return dict(input_ids=ids, attention_mask=(ids != 2).long(),
                token_type_ids=torch.tensor([[0, 0, 0, 0, 1, 1], [0, 0, 0, 1, 1, 1]]))


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(**_inputs()).logits


def _slice_heads(attention, keep: list[int]) -> None:
    """Every per-head parameter cut to the heads in ``keep`` by hand (:data:`PER_HEAD`)."""
    for name, dim in PER_HEAD.items():
        kept = getattr(attention, name).data.index_select(dim, torch.tensor(keep, dtype=torch.long))
        setattr(attention, name, torch.nn.Parameter(kept.clone()))


def test_the_layout_headlab_reads():
    """The bare per-head parameters the table slices, and the points headlab installs: no parameter of their own
    (the state dict is the original's), the forward's output bit for bit the original's."""
    model = _xlnet()
    reference = _logits(model)
    attention = model.transformer.layer[0].rel_attn
    assert type(attention).__name__ == "XLNetRelativeAttention"
    params = dict(attention.named_parameters(recurse=False))
    for name, dim in PER_HEAD.items():
        assert params[name].shape[dim] == H, name
    keys = list(model.state_dict())
    blocks = attention_blocks(model)
    assert [(b.kind, b.layer, b.n_heads, b.d_head) for b in blocks] == [("enc_self", 0, H, D), ("enc_self", 1, H, D)]
    assert isinstance(attention, tf.models.xlnet.modeling_xlnet.XLNetRelativeAttention)
    assert [type(m).__name__ for m in (blocks[0].q, blocks[0].k, blocks[0].v, blocks[0].o)] == ["HeadPoint"] * 4
    assert list(model.state_dict()) == keys
    assert torch.equal(_logits(model), reference)
    attention_blocks(model)  # installed once
    assert sum(type(m).__name__ == "HeadPoint" for m in model.modules()) == 8


@pytest.mark.parametrize("name", CLASSES)
def test_capture_equals_output_attentions(name):
    model = _xlnet(CLASSES[name][0])
    with torch.no_grad():
        reference = model(**_inputs(), output_attentions=True).attentions
    with torch.no_grad(), capture_attention(model) as record:
        model(**_inputs())
    assert sorted(record) == [("enc_self", 0), ("enc_self", 1)]
    for layer in (0, 1):
        assert torch.equal(record[("enc_self", layer)], reference[layer]), layer


@pytest.mark.parametrize("head", range(H))
def test_masking_equals_zeroed_values(head):
    """Masking head ``head`` of layer 1 equals zeroing its value slice v[:, head, :] (softmax rows sum to one, so
    its output is 0), and the mask comes off."""
    model = _xlnet()
    before = _logits(model)
    with mask_heads(model, {("enc_self", 1): [head]}):
        masked = _logits(model)
    assert torch.equal(_logits(model), before)
    with torch.no_grad():
        model.transformer.layer[1].rel_attn.v[:, head] = 0
    reference = _logits(model)
    assert not torch.allclose(reference, before)
    torch.testing.assert_close(masked, reference, atol=1e-12, rtol=0)


def test_gates_at_one_change_nothing():
    model = _xlnet()
    before = _logits(model)
    with gates_attached(model, ScalarGates.for_model(model)):
        assert torch.equal(_logits(model), before)
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


@pytest.mark.parametrize("spec_name", SPECS)
@pytest.mark.parametrize("name", CLASSES)
def test_pruning_equals_masking_and_slicing_by_hand(name, spec_name):
    """In float64 on the padded two-segment batch, pruning equals masking, and the parameters are the hand-sliced
    ones (a layer with no head left too: its parameters of zero heads, its own forward)."""
    cls = CLASSES[name][0]
    spec, heads_left = table_spec("enc_self", spec_name)
    model, by_hand = _xlnet(cls), _xlnet(cls)
    with mask_heads(model, spec):
        expected = _logits(model)
    prune_heads(model, spec)
    assert [b.n_heads for b in attention_blocks(model)] == heads_left
    torch.testing.assert_close(_logits(model), expected, atol=1e-12, rtol=0)
    for (_, layer), removed in spec.items():
        _slice_heads(by_hand.transformer.layer[layer].rel_attn, [h for h in range(H) if h not in removed])
        for parameter in PER_HEAD:
            assert torch.equal(getattr(model.transformer.layer[layer].rel_attn, parameter),
                               getattr(by_hand.transformer.layer[layer].rel_attn, parameter)), (layer, parameter)
    assert torch.equal(_logits(by_hand), _logits(model))
    assert model.transformer.layer[0].rel_attn.n_head == heads_left[0]


@pytest.mark.parametrize("spec_name", SPECS)
@pytest.mark.parametrize("name", CLASSES)
def test_pruned_reloads(name, spec_name, tmp_path):
    """save_pruned, then load_pruned (the kept heads' original numbering) and plain transformers through
    pruned_heads.py (every weight loaded, none reshaped): the masked model's logits."""
    cls, auto = CLASSES[name]
    spec, heads_left = table_spec("enc_self", spec_name)
    model = _xlnet(cls)
    with mask_heads(model, spec):
        expected = _logits(model)
    prune_heads(model, spec)
    save_pruned(model, tmp_path / "pruned")
    record = json.loads((tmp_path / "pruned" / "headlab_pruning.json").read_text())
    assert record["portable"]["how"] == "remote code"
    reloaded = load_pruned(tmp_path / "pruned").double()
    assert [b.n_heads for b in attention_blocks(reloaded)] == heads_left
    torch.testing.assert_close(_logits(reloaded), expected, atol=1e-12, rtol=0)
    with mask_heads(reloaded, {("enc_self", 1): [h for h in range(H) if h not in spec[("enc_self", 1)]][:1]}):
        _logits(reloaded)  # masked by the original numbering, as load_pruned gives it
    plain, info = auto.from_pretrained(tmp_path / "pruned", trust_remote_code=True, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    torch.testing.assert_close(_logits(plain.double().eval()), expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("name", CLASSES)
def test_compute_lrp_conserves(name):
    check_compute_lrp_conserves(_xlnet(CLASSES[name][0]))


def test_lrp_rules_conserve_at_the_first_layer():
    """The rules on a bias-free copy: the first layer's input (time-first [seq, batch, d]) gets the logit."""
    model = _xlnet()
    assert check_lrp_conserves(model, model.transformer.layer[0], rtol=1e-10, atol=1e-10) == 1


def test_the_query_stream_and_memory_refused_under_hooks_only():
    """target_mapping/perm_mask (the query stream g) and mems run the original forward, where headlab's points are
    not called: refused while a headlab hook is on, before any output; without one the model computes what the
    original class computes."""
    model, plain = _xlnet().float(), _xlnet().float()  # (transformers' query stream mixes dtypes in float64)
    attention_blocks(model)
    ids = _inputs()["input_ids"]
    perm = torch.zeros(2, 6, 6)
    perm[:, :, -1] = 1
    target = torch.zeros(2, 1, 6)
    target[:, 0, -1] = 1
    mems = [torch.randn(3, 2, H * D) for _ in range(2)]
    for extra in (dict(perm_mask=perm, target_mapping=target), dict(mems=mems)):
        with torch.no_grad():
            assert torch.equal(model(input_ids=ids, **extra).logits, plain(input_ids=ids, **extra).logits)
        with mask_heads(model, {("enc_self", 0): [1]}), pytest.raises(HeadlabError, match="content stream only"):
            model(input_ids=ids, **extra)
    with pytest.raises(HeadlabError, match="content stream only"), capture_attention(model):
        model(input_ids=ids, mems=mems)


def test_heads_on_the_command_line(tmp_path, capsys):
    from headlab.cli import main

    save_tiny(_xlnet().float(), tmp_path / "xlnet", ("the", "a", "cat", "dog"), "bert")
    assert main(["heads", str(tmp_path / "xlnet"), "--json"]) == 0
    out = capsys.readouterr().out
    assert "rel_attn" in out and "enc_self" in out


def test_a_pruned_directory_resaved_by_transformers(tmp_path, capsys):
    """Re-saved by plain transformers (no headlab_pruning.json): the kept heads read from the weights' shapes and the
    config's plan, by headlab's loader and by ``headlab heads``."""
    from headlab.cli import main
    from headlab.loading import load_model

    model = _xlnet()
    spec, heads_left = table_spec("enc_self", "partial")
    prune_heads(model, spec)
    expected = _logits(model)
    save_pruned(model, tmp_path / "pruned")
    plain = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "pruned", trust_remote_code=True)
    plain.save_pretrained(tmp_path / "resaved")
    assert not (tmp_path / "resaved" / "headlab_pruning.json").exists()
    reloaded = load_model(str(tmp_path / "resaved")).double()
    assert [b.n_heads for b in attention_blocks(reloaded)] == heads_left
    assert [list(b.core._headlab_kept_heads) for b in attention_blocks(reloaded)] == [[0, 2, 3], [1, 3]]
    torch.testing.assert_close(_logits(reloaded), expected, atol=1e-6, rtol=0)
    assert main(["heads", str(tmp_path / "resaved")]) == 0
    assert "rel_attn" in capsys.readouterr().out


def test_analyze_end_to_end(tmp_path):
    """``headlab analyze`` runs its stages on a tiny XLNet, LRP included (fam31d refused it, exit 2)."""
    from headlab.cli import main
    from support.treebank import SAMPLE_CONLLU

    words = sorted({line.split("\t")[1] for line in SAMPLE_CONLLU.splitlines() if line and line[0].isdigit()})
    save_tiny(_xlnet().float(), tmp_path / "xlnet", words, "bert")
    (tmp_path / "tb.conllu").write_text(SAMPLE_CONLLU, encoding="utf-8")
    (tmp_path / "text.txt").write_text(" ".join(words[:6]) + "\n" + " ".join(words[6:10]) + "\n", encoding="utf-8")
    code = main(["analyze", str(tmp_path / "xlnet"), "--source", str(tmp_path / "text.txt"), "--conllu",
                 str(tmp_path / "tb.conllu"), "--out", str(tmp_path / "out"), "--no-progress", "--skip", "figures"])
    assert code == 0
    stages = {s["name"]: s["status"] for s in json.loads((tmp_path / "out" / "manifest.json").read_text())["stages"]}
    assert all(stages[name] == "done" for name in ("confidence", "lrp", "gradient", "functions", "aggregate",
                                                     "table", "report")), stages


def test_a_model_with_points_pickles():
    """The points' class is a class of headlab's module: ``torch.save(model)`` and a deepcopy still work (a class made
    at run time under transformers' name did not pickle)."""
    import copy
    import io

    model = _xlnet()
    prune_heads(model, {("enc_self", 0): [1]})
    expected = _logits(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for copied in (torch.load(buffer, weights_only=False), copy.deepcopy(model)):
        assert torch.equal(_logits(copied), expected)
        assert [b.n_heads for b in attention_blocks(copied)] == [3, 4]
        with mask_heads(copied, {("enc_self", 1): [0]}):
            assert not torch.equal(_logits(copied), expected)



# -- attn_type="uni" (xlnetuni34): causal, and failing in transformers on padded batches: refused -----------------------

@pytest.mark.parametrize("same_length", [False, True])
@pytest.mark.parametrize("name", CLASSES)
def test_uni_refused_before_any_work(name, same_length):
    """attn_type="uni": XLNetModel's causal mask (on one sentence, the probabilities 0 above the diagonal and the
    first query's weight forced to 1; with same_length, every query's) makes the layers a decoder's, which headlab
    labelled enc_self; and transformers 5.24's forward fails on two padded sentences. Refused before any point or
    hook is installed; "bi" (with same_length too: no effect without a causal mask) stays supported."""
    cls = CLASSES[name][0]
    model = _xlnet(cls, attn_type="uni", same_length=same_length)
    ids = _inputs()["input_ids"]
    with torch.no_grad():
        maps = model(input_ids=ids[1:], attention_mask=torch.ones_like(ids[1:]), output_attentions=True).attentions
    assert all(torch.equal(m.triu(1), torch.zeros_like(m)) for m in maps)
    assert torch.equal(maps[0][:, :, 0, 0], torch.ones(1, H, dtype=maps[0].dtype))
    if same_length:
        assert torch.equal(maps[0][0, 0], torch.eye(6, dtype=maps[0].dtype))
    with pytest.raises(RuntimeError, match="broadcast shape"), torch.no_grad():
        model(input_ids=ids, attention_mask=_inputs()["attention_mask"])  # transformers' own failure
    with pytest.raises(HeadlabError, match="is not supported") as caught:
        attention_blocks(model)
    assert "attn_type='uni'" in str(caught.value) and "causal" in str(caught.value)
    assert ("same_length=True" in str(caught.value)) == same_length
    assert not any(type(m).__name__ == "HeadPoint" for m in model.modules())
    with pytest.raises(HeadlabError, match="attn_type='uni'"), capture_attention(model):
        pass
    assert [b.kind for b in attention_blocks(_xlnet(cls, same_length=same_length))] == ["enc_self"] * 2


def test_uni_refused_on_the_command_line(tmp_path, capsys):
    from headlab.cli import main

    save_tiny(_xlnet(attn_type="uni").float(), tmp_path / "xlnet", ("the", "a", "cat", "dog"), "bert")
    assert main(["heads", str(tmp_path / "xlnet")]) == 2
    assert "attn_type='uni'" in capsys.readouterr().err
