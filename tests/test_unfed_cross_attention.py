"""Table families' cross-attention that a model without an encoder never runs (session 26, idle16).

vis14 marked idle the blocks that discovery's probe forward did not run; a model with a family table runs no probe.
Built with cross-attention where the config allows it and no encoder, the table families' decoders are: BERT-style
decoders (BERT, RoBERTa, XLM-R, CamemBERT, ELECTRA with ``is_decoder`` and ``add_cross_attention``), the BART-like
causal LMs (BART, Marian, mBART, Pegasus, Blenderbot and Blenderbot-small ``...ForCausalLM``: every decoder layer
holds an ``encoder_attn``) and GPT-2 and GPT-BigCode with ``add_cross_attention`` (their ``crossattention``). Their
forward skips the cross-attention without ``encoder_hidden_states``, which headlab never passes. Before, gradient and
ablation scored those heads 0 as if measured, confidence failed ("no query token with an allowed key in dec_cross
layer 0"), LRP with a KeyError (GPT-2's and GPT-BigCode's, not listed at all, as a "token mixer named attention");
pruning them was refused only by the check, after its probe ran (GPT-2's: "the model has no dec_cross attention");
``headlab prune train --gates all`` gated them. Now they are idle blocks, as the vision towers: the measures leave
them out and say so, pruning them is refused before any work, the gates go to the kinds text runs.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf

import headlab
from headlab import HeadlabError, attention_blocks, prune_heads
from headlab.pruning.train import resolve_kinds
from support import models
from support.family_matrix import perturbed_model
from test_multimodal_towers import TEXTS, VOCAB, _tokenizer

_SPECIAL = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}


def _bert_like(cls, config_cls, **extra):
    return lambda: perturbed_model(cls, config_cls(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
        max_position_embeddings=70, is_decoder=True, add_cross_attention=True, **_SPECIAL, **extra))


def _bart_like(cls, config_cls):
    return lambda: perturbed_model(cls, config_cls(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=37, decoder_ffn_dim=37, max_position_embeddings=64,
        decoder_start_token_id=0, **_SPECIAL))


def _gpt2():
    return perturbed_model(tf.GPT2LMHeadModel, tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                                             n_positions=64, add_cross_attention=True, **_SPECIAL))


def _gpt_bigcode():  # multi_query: transformers refuses cross-attention with it
    return perturbed_model(tf.GPTBigCodeForCausalLM, tf.GPTBigCodeConfig(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, multi_query=False, add_cross_attention=True,
        **_SPECIAL))


DECODERS = {
    "gpt2": _gpt2,
    "gpt_bigcode": _gpt_bigcode,
    "bert": _bert_like(tf.BertLMHeadModel, tf.BertConfig),
    "roberta": _bert_like(tf.RobertaForCausalLM, tf.RobertaConfig),
    "xlm-roberta": _bert_like(tf.XLMRobertaForCausalLM, tf.XLMRobertaConfig),
    "camembert": _bert_like(tf.CamembertForCausalLM, tf.CamembertConfig),
    "electra": _bert_like(tf.ElectraForCausalLM, tf.ElectraConfig, embedding_size=32),
    "bart": _bart_like(tf.BartForCausalLM, tf.BartConfig),
    "marian": _bart_like(tf.MarianForCausalLM, tf.MarianConfig),
    "mbart": _bart_like(tf.MBartForCausalLM, tf.MBartConfig),
    "pegasus": _bart_like(tf.PegasusForCausalLM, tf.PegasusConfig),
    "blenderbot": _bart_like(tf.BlenderbotForCausalLM, tf.BlenderbotConfig),
    "blenderbot-small": _bart_like(tf.BlenderbotSmallForCausalLM, tf.BlenderbotSmallConfig),
}
CROSS_NAMES = ("crossattention", "encoder_attn")  # the modeling code's names of the decoder layers' cross-attention


def _unrun(model: torch.nn.Module, names: list[str], inputs: dict) -> set[str]:
    """The modules of ``names`` whose forward did not start in one forward pass on ``inputs``."""
    ran: set[str] = set()
    handles = [model.get_submodule(name).register_forward_pre_hook(lambda *a, name=name: ran.add(name))
               for name in names]
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    return set(names) - ran


@pytest.mark.parametrize("family", DECODERS)
def test_the_idle_blocks_are_the_cross_attention_a_forward_on_token_ids_skips(family):
    """Every cross-attention module of the model is a block (GPT-2's were not listed), and the idle blocks are
    exactly those that a forward on token ids does not run (before: none idle)."""
    model = DECODERS[family]()
    blocks = attention_blocks(model)
    cross = sorted(name for name, _ in model.named_modules() if name.rsplit(".", 1)[-1] in CROSS_NAMES)
    assert len(cross) == 2 and sorted(b.name for b in blocks if b.kind == "dec_cross") == cross
    unrun = _unrun(model, [b.name for b in blocks], {"input_ids": torch.tensor([[5, 6, 7, 8]])})
    assert {b.name for b in blocks if b.idle} == unrun == set(cross)


@pytest.mark.parametrize("family", sorted(models.SEQ2SEQ))
def test_an_encoder_decoder_feeds_its_cross_attention(family):
    model = models.tiny_model(family)
    blocks = attention_blocks(model)
    assert {b.kind for b in blocks} == {"enc_self", "dec_self", "dec_cross"} and not any(b.idle for b in blocks)
    assert not _unrun(model, [b.name for b in blocks], models.tiny_inputs(family))


@pytest.mark.parametrize("family", ["gpt2", "bert", "bart"])
def test_the_measures_leave_the_cross_attention_out_and_say_so(family):
    """Scores of the self-attention only, each measured (before: dec_cross 0 for gradient and ablation, confidence
    and LRP failing); asking for the cross-attention is refused."""
    model, tokenizer = DECODERS[family](), _tokenizer()
    result = headlab.importance(model, tokenizer, TEXTS, measures=("confidence", "gradient", "ablation", "lrp"))
    assert set(result.scores) >= {"confidence", "gradient", "ablation", "lrp"}
    for name, table in result.scores.items():
        assert list(table.scores) == ["dec_self"], name
        assert table.scores["dec_self"].shape == (2, 4) and not torch.tensor(table.scores["dec_self"]).isnan().any()
        assert table.signature["left_out"].startswith("dec_cross layers 0, 1 ("), name
        assert table.signature["left_out"].endswith("): not run by token ids, not scored"), name
    with pytest.raises(HeadlabError, match=r"kinds dec_cross: dec_cross layers 0, 1 \(.*which token ids do not run "
                                           r".*score the kinds text runs \(dec_self\)"):
        headlab.importance(model, tokenizer, TEXTS, measures="gradient", kinds="dec_cross")


@pytest.mark.parametrize("family", ["gpt2", "gpt_bigcode", "bert", "bart"])
def test_pruning_the_cross_attention_is_refused_before_any_work(family, monkeypatch):
    """Refused naming the blocks, before the check's probe runs (before: after it, or "no dec_cross attention" for
    GPT-2), the model untouched; the self-attention's heads are still pruned, and checked."""
    from headlab import prune_check

    model = DECODERS[family]()
    before = {name: p.clone() for name, p in model.state_dict().items()}
    probe = prune_check.run_probe

    def no_probe(*args, **kwargs):
        raise AssertionError("the check's probe ran")

    monkeypatch.setattr(prune_check, "run_probe", no_probe)
    message = (r"cannot check pruning the heads of dec_cross layer 1 \(.*\): headlab checks every prune against "
               r"masking on token ids .*a cross-attention given no encoder states.*nothing was pruned\. Remove heads "
               r"of the blocks text runs only \(dec_self layers 0-1\)")
    for spec in ({("dec_cross", 1): [1]}, {("dec_self", 0): [0], ("dec_cross", 1): [0, 1]}):
        with pytest.raises(HeadlabError, match=message):
            prune_heads(model, spec)
        after = model.state_dict()
        assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    monkeypatch.setattr(prune_check, "run_probe", probe)
    assert prune_heads(model, {("dec_self", 1): [0]}) == {("dec_self", 1): [1, 2, 3]}


def test_the_gates_go_to_the_self_attention():
    model = DECODERS["bert"]()
    assert resolve_kinds(model, "all") == ("dec_self",) and resolve_kinds(model, "auto") == ("dec_self",)
    with pytest.raises(HeadlabError, match=r"--gates dec_cross: the model's dec_cross attention is dec_cross layers "
                                           r"0, 1 \(bert\.encoder\.layer\.0\.crossattention.*gate the kinds text runs "
                                           r"\(dec_self\)"):
        resolve_kinds(model, "dec_cross")


@pytest.mark.parametrize("family", ["gpt2", "bart"])
def test_headlab_prune_refuses_them_before_reading_the_weights_and_heads_says_so(family, tmp_path, capsys,
                                                                                   monkeypatch):
    from headlab import loading
    from headlab.cli import main

    DECODERS[family]().save_pretrained(tmp_path / "model")
    assert main(["heads", str(tmp_path / "model")]) == 0
    listed = " ".join(capsys.readouterr().out.split())
    assert "not run by token ids: dec_cross layers 0, 1 (" in listed
    assert "the measures leave them out, pruning them is refused" in listed
    assert main(["heads", str(tmp_path / "model"), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {(row["kind"], row["layer"]) for row in rows if row["idle"]} == {("dec_cross", 0), ("dec_cross", 1)}
    assert all(not row["idle"] for row in rows if row["kind"] == "dec_self")
    load = loading.load_model

    def no_load(*args, **kwargs):
        raise AssertionError("the weights were read")

    monkeypatch.setattr(loading, "load_model", no_load)
    code = main(["prune", str(tmp_path / "model"), "--heads", "dec_cross:1:0", "--out", str(tmp_path / "out")])
    err = " ".join(capsys.readouterr().err.split())
    assert code != 0 and "cannot check pruning the heads of dec_cross layer 1 (" in err
    assert not (tmp_path / "out").exists()
    monkeypatch.setattr(loading, "load_model", load)  # the self-attention: pruned (GPT-2's idle blocks not in the way)
    assert main(["prune", str(tmp_path / "model"), "--heads", "dec_self:1:0", "--out", str(tmp_path / "out")]) == 0
