"""XLM, FlauBERT and TAPAS: table families whose attention computes its own softmax (outside transformers'
attention interface) and returns its probabilities only with ``output_attentions`` (refused before session 30).

XLM's ``MultiHeadAttention`` (FlauBERT's is a copy) sits in parallel module lists (``transformer.attentions.N``,
beside ``layer_norm1``, ``ffns``, ``layer_norm2``), its output projection ``out_lin`` inside it; with ``causal`` it
attends through a triangular mask (a decoder). TAPAS is BERT's post-norm attention (``self.query/key/value``,
``output.dense``). On each, in float64: capture equals transformers' own ``output_attentions``, masking equals
zeroed value weights, gates at one change nothing, pruning (a head, and a whole layer) equals masking on a padded
batch, and so does the directory save_pruned writes, loaded by load_pruned and by plain transformers (the portable
pruned_heads.py); the LRP rules conserve relevance to 1e-10, compute_lrp with biases to 1e-9. What headlab cannot
feed is refused before any work: FlauBERT's ``pre_norm`` (its forward fails in transformers 5.24) and XLM's
language embeddings (``langs``, which headlab's text inputs do not carry).
"""

from __future__ import annotations

import json
import sys

import pytest
import torch
import transformers as tf

from headlab import (
    HeadlabError,
    ScalarGates,
    attention_blocks,
    capture_attention,
    gates_attached,
    load_pruned,
    mask_heads,
    prune_heads,
    save_pruned,
)
from headlab.data.inputs import ImportanceData
from headlab.importance.lrp import compute_lrp
from headlab.model_description import describe_model
from support.family_matrix import (
    ANALYZE_STAGES,
    analyze,
    check_lrp_conserves,
    check_pruned_generates_as_masked,
    check_pruned_reloads,
    padded_inputs,
    padded_logits,
    perturbed_model,
    save_tiny,
    treebank_files,
)

VOCAB = 99
_XLM = dict(vocab_size=VOCAB, emb_dim=32, n_layers=2, n_heads=4, max_position_embeddings=64,
            bos_token_id=0, eos_token_id=1, pad_token_id=2)


def build(family: str, **config) -> torch.nn.Module:
    """A tiny model of ``family`` (xlm, xlm-causal, flaubert, tapas), eager, biases and norms moved off their
    initial values; ``config`` overrides."""
    if family in ("xlm", "xlm-causal"):
        cls, made = tf.XLMWithLMHeadModel, tf.XLMConfig(**{**_XLM, "causal": family == "xlm-causal", **config})
    elif family == "flaubert":
        cls, made = tf.FlaubertWithLMHeadModel, tf.FlaubertConfig(**{**_XLM, **config})
    else:
        cls, made = tf.TapasForMaskedLM, tf.TapasConfig(**{
            "vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 37, "max_position_embeddings": 64, "pad_token_id": 2, **config})
    return perturbed_model(cls, made, attn_implementation="eager")


FAMILIES = ["xlm", "xlm-causal", "flaubert", "tapas"]
KIND = {"xlm": "enc_self", "xlm-causal": "dec_self", "flaubert": "enc_self", "tapas": "enc_self"}
BLOCK = {"xlm": "transformer.attentions.{}", "xlm-causal": "transformer.attentions.{}",
         "flaubert": "transformer.attentions.{}", "tapas": "tapas.encoder.layer.{}.attention"}
# where each family's value heads sit, read off the modeling code (not headlab's tables): rows j*8..(j+1)*8
VALUES = {"xlm": lambda m, i: m.transformer.attentions[i].v_lin,
          "xlm-causal": lambda m, i: m.transformer.attentions[i].v_lin,
          "flaubert": lambda m, i: m.transformer.attentions[i].v_lin,
          "tapas": lambda m, i: m.tapas.encoder.layer[i].attention.self.value}
SPECS = {
    "partial": ({0: [1], 1: [0, 2]}, [3, 2]),
    "no head left": ({0: [0, 1, 2, 3], 1: [2]}, [0, 3]),
}
AUTO = {"xlm": tf.AutoModelForMaskedLM, "xlm-causal": tf.AutoModelForMaskedLM, "flaubert": tf.AutoModelForMaskedLM,
        "tapas": tf.AutoModelForMaskedLM}


def _spec(family: str, spec_name: str) -> dict:
    return {(KIND[family], layer): heads for layer, heads in SPECS[spec_name][0].items()}


def _logits(model, ids, mask) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_blocks_are_the_tables(family):
    blocks = attention_blocks(build(family))
    name = {"xlm-causal": "xlm-causal", "flaubert": "xlm"}.get(family, family)
    assert [(b.kind, b.layer, b.n_heads, b.d_head, b.family.name, b.name) for b in blocks] == \
        [(KIND[family], layer, 4, 8, name, BLOCK[family].format(layer)) for layer in (0, 1)]
    assert describe_model(build(family)).arch == ("causal" if family == "xlm-causal" else "masked")


@pytest.mark.parametrize("family", FAMILIES)
def test_captured_probabilities_are_the_models_own(family):
    """What capture reads (it asks the core for them: output_attentions) equals transformers' own output_attentions."""
    model = build(family).double()
    ids, mask = padded_inputs(pad_id=2)
    with torch.no_grad():
        reference = model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    with torch.no_grad(), capture_attention(model) as record:
        model(input_ids=ids, attention_mask=mask)
    assert sorted(record) == [(KIND[family], 0), (KIND[family], 1)]
    for layer in (0, 1):
        assert torch.equal(record[(KIND[family], layer)], reference[layer]), layer


@pytest.mark.parametrize("family", FAMILIES)
def test_masking_equals_zeroed_values_and_gates_at_one_change_nothing(family):
    ids, mask = padded_inputs(pad_id=2)
    for head in range(4):
        model = build(family).double()
        before = _logits(model, ids, mask)
        with mask_heads(model, {(KIND[family], 1): [head]}):
            masked = _logits(model, ids, mask)
        assert torch.equal(_logits(model, ids, mask), before)  # the mask came off
        value = VALUES[family](model, 1)
        with torch.no_grad():
            value.weight[head * 8:(head + 1) * 8] = 0
            value.bias[head * 8:(head + 1) * 8] = 0
        reference = _logits(model, ids, mask)
        assert not torch.allclose(reference, before)
        torch.testing.assert_close(masked, reference, atol=1e-12, rtol=0)
    model = build(family).double()
    before = _logits(model, ids, mask)
    with gates_attached(model, ScalarGates.for_model(model)):
        assert torch.equal(_logits(model, ids, mask), before)
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


@pytest.mark.parametrize("spec_name", SPECS)
@pytest.mark.parametrize("family", FAMILIES)
def test_pruned_equals_masked_in_float64(family, spec_name):
    model = build(family).double()
    spec = _spec(family, spec_name)
    ids, mask = padded_inputs(pad_id=2)
    with mask_heads(model, spec):
        expected = padded_logits(model, ids, mask)
    prune_heads(model, spec)
    assert [b.n_heads for b in attention_blocks(model)] == SPECS[spec_name][1]
    torch.testing.assert_close(padded_logits(model, ids, mask), expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("spec_name", SPECS)
@pytest.mark.parametrize("family", FAMILIES)
def test_pruned_reloads(family, spec_name, tmp_path):
    """save_pruned, load_pruned and plain transformers (trust_remote_code: pruned_heads.py), every weight loaded."""
    spec, heads_left = _spec(family, spec_name), SPECS[spec_name][1]
    model = build(family)
    ids, mask = padded_inputs(pad_id=2)
    with mask_heads(model, spec):
        expected = padded_logits(model, ids, mask)
    prune_heads(model, spec)
    save_pruned(model, tmp_path)
    assert json.loads((tmp_path / "headlab_pruning.json").read_text())["portable"]["how"] == "remote code"
    reloaded = load_pruned(tmp_path)
    assert [b.n_heads for b in attention_blocks(reloaded)] == heads_left
    torch.testing.assert_close(padded_logits(reloaded, ids, mask), expected, atol=1e-5, rtol=0)
    plain, info = AUTO[family].from_pretrained(tmp_path, trust_remote_code=True, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    torch.testing.assert_close(padded_logits(plain.eval(), ids, mask), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("spec_name", SPECS)
def test_causal_xlm_pruned_generates_as_masked_and_reloads(spec_name, tmp_path):
    """A causal XLM (XLM's CLM checkpoints): greedy generation as XLMWithLMHeadModel runs it (its own
    prepare_inputs_for_generation, no cache), and plain transformers' AutoModelForCausalLM on the saved directory."""
    spec, heads_left = _spec("xlm-causal", spec_name), SPECS[spec_name][1]
    model = build("xlm-causal")
    ids, mask = padded_inputs(pad_id=2)
    expected, tokens = check_pruned_generates_as_masked(model, spec, heads_left, ids, mask)
    check_pruned_reloads(model, tmp_path, heads_left, ids, mask, expected, tokens)


@pytest.mark.parametrize("family", FAMILIES)
def test_lrp_conserves_in_float64(family):
    model = build(family).double()
    check_lrp_conserves(model, model.get_submodule(BLOCK[family].format(0)), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("family", FAMILIES)
def test_compute_lrp_conserves_with_biases_and_padding(family):
    """compute_lrp (biases on, padded sentences) conserves every sentence's logit to 1e-9 in float64."""
    model = build(family).double()
    g = torch.Generator().manual_seed(0)
    data = ImportanceData.from_ids([torch.randint(3, VOCAB, (k,), generator=g).tolist() for k in (3, 6, 9)])
    record = compute_lrp(model, data, describe_model(model), bootstrap=0).signature["conservation"]
    assert record["n_outside"] == 0, record
    assert abs(record["with_biases"]["min"] - 1) < 1e-9 and abs(record["with_biases"]["max"] - 1) < 1e-9, record


def test_flaubert_layerdrop_leaves_capture_whole():
    """FlauBERT's layerdrop skips whole layers at random in training mode only; capture runs the model in eval mode
    (each module's mode back after), so even a layerdrop of 1 in a model left training drops no layer."""
    model = build("flaubert", layerdrop=1.0).double()
    ids, mask = padded_inputs(pad_id=2)
    with torch.no_grad():
        reference = model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    model.train()
    with torch.no_grad(), capture_attention(model) as record:
        model(input_ids=ids, attention_mask=mask)
    assert model.training
    for layer in (0, 1):
        assert torch.equal(record[("enc_self", layer)], reference[layer]), layer


@pytest.mark.parametrize("config, words", [
    (dict(pre_norm=True), ["pre_norm", "not subscriptable"]),
    (dict(n_langs=2, use_lang_emb=True), ["language embeddings", "langs"]),
    (dict(asm=True, asm_cutoffs=[20, 50], asm_div_value=4.0), ["adaptive softmax", "asm=True"]),
])
def test_flaubert_refused_before_any_work(config, words):
    """pre_norm: transformers' own forward fails; language embeddings: an input headlab does not feed; an adaptive
    softmax LM head: log-probabilities, no output layer of logits (LRP crashed in its target's expand)."""
    model = build("flaubert", **config)
    with pytest.raises(HeadlabError, match="is not supported") as caught:
        attention_blocks(model)
    assert all(word in str(caught.value) for word in words), caught.value


def test_xlm_with_language_embeddings_refused_before_any_work(tmp_path, capsys):
    """A bilingual XLM (n_langs 2, use_lang_emb) reads the language of every token (langs): refused, named, before
    any work; without language embeddings (use_lang_emb False, as XLM-17 and XLM-100) it is analysed."""
    from headlab.cli import main

    model = build("xlm", n_langs=2, use_lang_emb=True)
    with pytest.raises(HeadlabError, match="language embeddings"):
        attention_blocks(model)
    model.save_pretrained(tmp_path / "xlm")
    assert main(["heads", str(tmp_path / "xlm")]) == 2
    err = capsys.readouterr().err
    assert err.count("is not supported") == 1 and "langs" in err
    assert len(attention_blocks(build("xlm", n_langs=2, use_lang_emb=False))) == 2


def test_tapas_cross_attention_is_idle():
    """TAPAS with is_decoder and add_cross_attention: its crossattention (fed encoder_hidden_states only) is idle;
    its self-attention stays an encoder's (TapasModel's mask is bidirectional whatever is_decoder says)."""
    model = build("tapas", is_decoder=True, add_cross_attention=True)
    blocks = attention_blocks(model)
    assert [(b.kind, b.layer) for b in blocks if b.idle] == [("dec_cross", 0), ("dec_cross", 1)]
    assert [(b.kind, b.layer) for b in blocks if not b.idle] == [("enc_self", 0), ("enc_self", 1)]


@pytest.mark.parametrize("family", ["xlm", "xlm-causal", "tapas"])
def test_analyze_end_to_end(family, tmp_path, capsys):
    """Every stage, LRP included (a causal XLM as a causal LM; TAPAS with a BERT tokenizer)."""
    model = build(family)
    save_tiny(model, tmp_path / family, treebank_files(tmp_path), "gpt2" if family == "xlm-causal" else "bert")
    code, stages = analyze(tmp_path / family, tmp_path)
    assert code == 0, capsys.readouterr().err
    for name in (*ANALYZE_STAGES, "lrp"):
        assert stages[name]["status"] == "done", stages[name]


def _tapas_tokenizer(path):
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[EMPTY]", "the", "cat", "sat", "on", "mat", "a", "dog"]
    (path / "vocab.txt").write_text("\n".join(words) + "\n", encoding="utf-8")
    return tf.TapasTokenizer(vocab_file=str(path / "vocab.txt"))


def test_tapas_tokenizer_refused_before_any_work(tmp_path, capsys):
    """TapasTokenizer takes (table, queries): headlab's tokenizer(text=...) failed with a raw TypeError. Refused,
    naming what to use instead; a BERT tokenizer of the same vocabulary gives what TapasTokenizer gives a query with
    an empty table, and describe_model takes it."""
    from headlab.cli import main

    tokenizer = _tapas_tokenizer(tmp_path)
    bert = tf.BertTokenizer(vocab=str(tmp_path / "vocab.txt"))
    assert bert(["the cat sat", "a dog"])["input_ids"] == tokenizer(["the cat sat", "a dog"])["input_ids"]
    model = build("tapas")
    with pytest.raises(HeadlabError, match="TapasTokenizer encodes questions about a table"):
        describe_model(model, tokenizer)
    assert describe_model(model, bert).arch == "masked"
    model.save_pretrained(tmp_path / "tapas")
    tokenizer.save_pretrained(tmp_path / "tapas")
    (tmp_path / "text.txt").write_text("the cat sat\n", encoding="utf-8")
    code = main(["analyze", str(tmp_path / "tapas"), "--source", str(tmp_path / "text.txt"), "--out",
                 str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("TapasTokenizer encodes") == 1, err
    assert not (tmp_path / "out").exists()


def test_tokenizer_missing_its_package_refused_before_any_work(tmp_path, capsys, monkeypatch):
    """XLMTokenizer (and FlauBERT's) import sacremoses when built: without it, loading the tokenizer raised an
    ImportError that headlab reported as an internal error, traceback and all. Now one error naming it, exit 2."""
    from headlab.cli import main

    monkeypatch.setitem(sys.modules, "sacremoses", None)  # import sacremoses raises ImportError, installed or not
    path = tmp_path / "xlm"
    build("xlm").save_pretrained(path)
    words = ["<s>", "</s>", "<pad>", "<unk>", "<special0>", "the</w>", "cat</w>", "sat</w>"]
    (path / "vocab.json").write_text(json.dumps({w: i for i, w in enumerate(words)}), encoding="utf-8")
    (path / "merges.txt").write_text("#version: 0.2\nt h\n", encoding="utf-8")
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "XLMTokenizer"}), encoding="utf-8")
    (tmp_path / "text.txt").write_text("the cat sat\n", encoding="utf-8")
    code = main(["analyze", str(path), "--source", str(tmp_path / "text.txt"), "--out", str(tmp_path / "out"),
                 "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "cannot load a tokenizer" in err and "sacremoses" in err, err
    assert "internal error" not in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_prune_train_refuses_the_tapas_tokenizer_before_any_work(tmp_path, capsys):
    """prune train/sweep/baseline now check the tokenizer as the analyses do (loading.check_tokenizer_fits): a
    TapasTokenizer is refused naming it, with no --out written (before: it tokenized the lines as queries, and a line
    over its maximum length raised TAPAS's own ValueError mid-run)."""
    from headlab.cli import main

    tokenizer = _tapas_tokenizer(tmp_path)
    build("tapas").save_pretrained(tmp_path / "tapas")
    tokenizer.save_pretrained(tmp_path / "tapas")
    (tmp_path / "train.txt").write_text("the cat sat\na dog sat on the mat\n", encoding="utf-8")
    code = main(["prune", "train", str(tmp_path / "tapas"), "--train-text", str(tmp_path / "train.txt"), "--gates",
                 "all", "--lam", "0.1", "--max-steps", "1", "--no-progress", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("TapasTokenizer encodes") == 1, err
    assert not any((tmp_path / "out").glob("**/*.json"))


def test_layer_path_of_a_block_held_by_its_module_list_only_where_no_layer_holds_it():
    from headlab.importance.lrp import _layer_path

    assert _layer_path("transformer.attentions.0") == "transformer.attentions.0"  # XLM: no layer module
    assert _layer_path("model.layers.0.self_attn.0") == "model.layers.0"  # LongCat-Flash: two attentions a layer
    assert _layer_path("model.layers.3.self_attn") == "model.layers.3"
    assert _layer_path("transformer.h.0.attn.attention") == "transformer.h.0"  # GPT-Neo
