"""XLNet: refused before any work, naming what is missing (session 31, fam31d).

XLNet's ``XLNetRelativeAttention`` (transformers 5.24) keeps q, k, v, o and r as bare parameters of shape
``(d_model, n_head, d_head)`` applied by ``torch.einsum``, with per-head biases (``r_w_bias``, ``r_r_bias``,
``r_s_bias``, ``[n_head, d_head]``) and ``seg_embed`` (``[2, n_head, d_head]``). Headlab masks, gates, reads and
prunes heads at projection modules, and its LRP detaches queries and keys there, so it has no hook point and no
slicing rule here: every entry point refuses it before any work
(:data:`headlab.adapters.families.UNSUPPORTED`). The first tests pin the layout the refusal describes, read off the
modeling code, so that a transformers that changes it fails here and the refusal is read again; they also record
what a future table entry could rely on: the probabilities ``output_attentions`` returns, heads independent (zeroing a
head's value slice changes that head's output only), and slicing dim 1 of every per-head parameter (a layer left with
no head too) equal to zeroing those heads' outputs in float64 on a padded batch.
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
from support.family_matrix import perturbed_model, save_tiny

H, D = 4, 8  # heads, head size: d_model 32
REASON = r"XLNet's attention \(XLNetRelativeAttention\) keeps its projections q, k, v, o and r as bare parameters"


def _xlnet(cls=tf.XLNetLMHeadModel, **extra) -> torch.nn.Module:
    config = tf.XLNetConfig(vocab_size=99, d_model=H * D, n_layer=2, n_head=H, d_inner=37, pad_token_id=2,
                            bos_token_id=0, eos_token_id=1, **extra)
    return perturbed_model(cls, config, attn_implementation="eager").double()


def _inputs() -> dict[str, torch.Tensor]:
    """A batch padded on the left, as XLNet's tokenizer pads, with two segments."""
    ids = torch.tensor([[2, 2, 5, 6, 7, 8], [5, 9, 10, 11, 12, 13]])
    return dict(input_ids=ids, attention_mask=(ids != 2).long(),
                token_type_ids=torch.tensor([[0, 0, 0, 0, 1, 1], [0, 0, 0, 1, 1, 1]]))


def test_the_layout_the_refusal_names():
    """Bare per-head parameters, no projection module: what headlab would hook or slice is not there."""
    attention = _xlnet().transformer.layer[0].rel_attn
    assert type(attention).__name__ == "XLNetRelativeAttention"
    params = dict(attention.named_parameters(recurse=False))
    for name in ("q", "k", "v", "o", "r"):
        assert params[name].shape == (H * D, H, D), name
    for name in ("r_w_bias", "r_r_bias", "r_s_bias"):
        assert params[name].shape == (H, D), name
    assert params["seg_embed"].shape == (2, H, D)
    assert [type(m).__name__ for m in attention.children()] == ["LayerNorm", "Dropout"]


def test_probabilities_and_independent_heads():
    """What a table entry could build on: output_attentions gives [batch, heads, q, k] rows summing to one (the
    content stream), and zeroing head 1's value slice v[:, 1, :] changes head 1's output alone (read at o's input,
    attn_vec [q, batch, heads, d], by wrapping post_attention, which no module hook reaches)."""
    model = _xlnet()
    attention = model.transformer.layer[1].rel_attn
    seen = []
    post = attention.post_attention
    attention.post_attention = lambda h, attn_vec, residual=True: (seen.append(attn_vec), post(h, attn_vec, residual))[1]
    out = model(**_inputs(), output_attentions=True)
    assert len(out.attentions) == 2 and out.attentions[1].shape == (2, H, 6, 6)
    assert torch.allclose(out.attentions[1].sum(-1), torch.ones(2, H, 6, dtype=torch.float64))
    with torch.no_grad():
        attention.v[:, 1, :] = 0
    model(**_inputs())
    before, after = seen
    assert torch.equal(after[:, :, 1], torch.zeros_like(after[:, :, 1]))
    others = [0, 2, 3]
    assert torch.equal(after[:, :, others], before[:, :, others])


@pytest.mark.parametrize("cls", [tf.XLNetLMHeadModel, tf.XLNetForSequenceClassification, tf.XLNetModel],
                         ids=["lm", "classifier", "model"])
def test_refused_before_any_work(cls):
    model = _xlnet(cls)
    before = {name: p.clone() for name, p in model.named_parameters()}
    heads = {("enc_self", 0): [1]}
    for action in (lambda: attention_blocks(model), lambda: mask_heads(model, heads).__enter__(),
                   lambda: prune_heads(model, heads)):
        with pytest.raises(HeadlabError, match=REASON) as caught:
            action()
        # each part named: hooks, slicing, the pruned config, LRP's detached queries/keys, the streams left out
        for part in ("post_attention", "dim 1 of q, k, v, o, r and seg_embed", "r_w_bias", "n_head one number",
                     "detaching the query and key", "relative-position and segment scores", "mems",
                     "target_mapping and perm_mask"):
            assert part in str(caught.value), part
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())


def test_lrp_refused_before_any_work():
    model = _xlnet()
    data = ImportanceData.from_ids([[5, 6, 7, 8], [9, 10, 11]])
    before = {name: p.clone() for name, p in model.named_parameters()}
    with pytest.raises(HeadlabError, match=REASON):
        compute_lrp(model, data, describe_model(model), bootstrap=0)
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())


def test_analyze_refused_once_before_any_work(tmp_path, capsys):
    """The saved config's model type is read before the model is built: exit 2, one message, nothing written."""
    from headlab.cli import main

    save_tiny(_xlnet().float(), tmp_path / "xlnet", ("the", "a", "cat", "dog"), "bert")
    (tmp_path / "text.txt").write_text("the cat\n", encoding="utf-8")
    code = main(["analyze", str(tmp_path / "xlnet"), "--source", str(tmp_path / "text.txt"),
                 "--out", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("is not supported") == 1 and "XLNetRelativeAttention" in err, err
    assert not (tmp_path / "out").exists()


def _slice_heads(attention, keep: list[int]) -> None:
    """Every per-head parameter cut to the heads in ``keep`` (dim 1 of q, k, v, o, r and seg_embed; dim 0 of the
    biases): what a pruning rule for this layout would do."""
    for name in ("q", "k", "v", "o", "r", "seg_embed"):
        setattr(attention, name, torch.nn.Parameter(getattr(attention, name).data[:, keep].clone()))
    for name in ("r_w_bias", "r_r_bias", "r_s_bias"):
        setattr(attention, name, torch.nn.Parameter(getattr(attention, name).data[keep].clone()))
    attention.n_head = len(keep)


def test_slicing_the_heads_equals_masking_them():
    """The exactness the foundation row claims for a future entry: in float64 on a padded two-segment batch,
    slicing heads 0 and 2 out of layer 0 and every head out of layer 1 gives the logits that zeroing those heads'
    outputs (attn_vec at o's input) gives."""
    removed = {0: [0, 2], 1: [0, 1, 2, 3]}
    masked, pruned = _xlnet(), _xlnet()
    for layer, heads in removed.items():
        attention = masked.transformer.layer[layer].rel_attn
        post = attention.post_attention

        def zeroed(h, attn_vec, residual=True, post=post, heads=heads):
            attn_vec = attn_vec.clone()
            attn_vec[:, :, heads] = 0
            return post(h, attn_vec, residual)

        attention.post_attention = zeroed
        _slice_heads(pruned.transformer.layer[layer].rel_attn, [h for h in range(H) if h not in heads])
    inputs = _inputs()
    expected, got = masked(**inputs).logits, pruned(**inputs).logits
    assert torch.allclose(got, expected, atol=1e-12, rtol=0)  # the padding too (a padded query attends itself)
    assert not torch.allclose(expected, _xlnet()(**inputs).logits)  # the removal changes something
