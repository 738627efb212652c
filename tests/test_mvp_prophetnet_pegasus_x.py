"""MVP (RUCAIBox/mvp, BART with optional layer-wise prompts) as a table family; ProphetNet and PEGASUS-X refused before
any work, naming what headlab cannot read exactly (session 31, fam31b; before, all three were refused by discovery
with its generic reason: no attention interface, no table).

MVP without prompts is BART with BART's old attention (``MvpAttention``, outside the attention interface: its
probabilities only with ``output_attentions``), which merges the heads to the hidden states' width: a pruned layer takes
``portable_code.PRUNED_FORWARDS["mvp"]``, in headlab and in the directory's pruned_heads.py. On a tiny MVP in float64:
capture equals transformers' ``output_attentions`` for the three kinds, masking a head equals zeroing its values, gates
at one change nothing, pruning (a head, a whole layer) equals masking on a padded batch and in greedy cached generation,
and so does the saved directory (load_pruned and plain transformers); LRP conserves relevance, pruned too. MVP with
prompts (``use_prompt``: prompt keys and values prepended to every head's) is refused per config.
"""

from __future__ import annotations

import json

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
from headlab.cli import main
from headlab.importance import ImportanceData, compute_lrp, describe_model, translate_data
from support.family_matrix import check_pruned_generates_as_masked, padded_inputs

KINDS = ("enc_self", "dec_self", "dec_cross")
PAD = 2
SPECS = {
    "partial": {("enc_self", 0): [1], ("enc_self", 1): [0, 2], ("dec_self", 0): [3], ("dec_cross", 1): [0, 1, 2]},
    "no head left": {("enc_self", 0): [0, 1, 2, 3], ("dec_self", 1): [0, 1, 2, 3], ("dec_cross", 0): [0, 1, 2, 3],
                     ("dec_cross", 1): [2]},
}


def _config(**extra) -> tf.MvpConfig:
    return tf.MvpConfig(vocab_size=99, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=37, decoder_ffn_dim=37, max_position_embeddings=64,
                        pad_token_id=PAD, bos_token_id=0, eos_token_id=1, decoder_start_token_id=1, **extra)


def _mvp(cls=tf.MvpForConditionalGeneration, seed: int = 0, **extra) -> torch.nn.Module:
    """A tiny MVP (2 + 2 layers, 4 heads of 8), biases and norm weights moved off their initial values, float64."""
    torch.manual_seed(seed)
    model = cls(_config(**extra)).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 0.1)
            elif "layer_norm" in name or "layernorm" in name:
                parameter.normal_(1, 0.1)
    return model.double()


def _inputs() -> dict:
    """Two sources, the second padded at the end, and two target prefixes."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 99, (2, 7), generator=g)
    mask = torch.ones_like(ids)
    ids[1, 5:], mask[1, 5:] = PAD, 0
    return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": torch.randint(3, 99, (2, 5), generator=g)}


def _logits(model, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


def _generate(model, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy generation with the cache (EncoderDecoderCache: the decoder's keys and values, the encoder's once)."""
    with torch.no_grad():
        out = model.generate(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], max_new_tokens=6,
                             min_new_tokens=6, do_sample=False, num_beams=1, use_cache=True, output_scores=True,
                             return_dict_in_generate=True)
    return out.sequences, torch.stack(out.scores)


def test_mvp_blocks_are_the_table():
    blocks = attention_blocks(_mvp())
    assert sorted((b.kind, b.layer, b.n_heads, b.d_head, b.family.name, b.idle) for b in blocks) == \
        sorted((kind, layer, 4, 8, "mvp", False) for kind in KINDS for layer in (0, 1))
    assert {b.name for b in blocks} == {f"model.encoder.layers.{i}.self_attn" for i in (0, 1)} | \
        {f"model.decoder.layers.{i}.{n}" for i in (0, 1) for n in ("self_attn", "encoder_attn")}


def test_mvp_captured_probabilities_are_the_models_own():
    """What capture reads (asking each MvpAttention for its probabilities) is transformers' output_attentions, bit
    for bit, for the encoder's, the decoder's and the decoder-encoder attention, on a padded batch."""
    model = _mvp()
    with torch.no_grad():
        reference = model(**_inputs(), output_attentions=True)
    with torch.no_grad(), capture_attention(model) as record:
        model(**_inputs())
    assert sorted(record) == sorted((kind, layer) for kind in KINDS for layer in (0, 1))
    for layer in (0, 1):
        for kind, theirs in zip(KINDS, (reference.encoder_attentions, reference.decoder_attentions,
                                        reference.cross_attentions)):
            assert torch.equal(record[(kind, layer)], theirs[layer]), (kind, layer)


@pytest.mark.parametrize("kind", KINDS)
def test_mvp_masking_equals_zeroed_values(kind):
    """Masking head 2 of layer 1 equals zeroing its rows of v_proj (weights and bias): its output is then 0."""
    model = _mvp()
    before = _logits(model, _inputs())
    with mask_heads(model, {(kind, 1): [2]}):
        masked = _logits(model, _inputs())
    assert torch.equal(_logits(model, _inputs()), before)
    layer = model.model.encoder.layers[1] if kind == "enc_self" else model.model.decoder.layers[1]
    v = (layer.encoder_attn if kind == "dec_cross" else layer.self_attn).v_proj
    with torch.no_grad():
        v.weight[16:24] = 0
        v.bias[16:24] = 0
    reference = _logits(model, _inputs())
    assert not torch.allclose(reference, before)
    torch.testing.assert_close(masked, reference, atol=1e-12, rtol=0)


def test_mvp_gates_at_one_change_nothing():
    model = _mvp()
    before = _logits(model, _inputs())
    with gates_attached(model, ScalarGates.for_model(model)):
        assert torch.equal(_logits(model, _inputs()), before)
    for module in model.modules():
        assert not module._forward_pre_hooks and not module._forward_hooks, module


@pytest.mark.parametrize("spec_name", SPECS)
def test_mvp_pruned_equals_masked_and_generates_so(spec_name):
    """Pruned (its forward merging the kept heads; a layer with none left: the output projection's bias) equals
    masked in float64: the logits of a padded batch and greedy generation with the cache, step by step. Before the
    pruned forward, MvpAttention's own failed on a pruned layer (its reshape to the hidden states' width)."""
    model, spec = _mvp(), SPECS[spec_name]
    with mask_heads(model, spec):
        expected = _logits(model, _inputs())
        tokens, scores = _generate(model, _inputs())
    prune_heads(model, spec)
    counts = {b.key: b.n_heads for b in attention_blocks(model)}
    assert counts == {(kind, layer): 4 - len(spec.get((kind, layer), [])) for kind in KINDS for layer in (0, 1)}
    torch.testing.assert_close(_logits(model, _inputs()), expected, atol=1e-12, rtol=0)
    pruned_tokens, pruned_scores = _generate(model, _inputs())
    assert torch.equal(pruned_tokens, tokens)
    torch.testing.assert_close(pruned_scores, scores, atol=1e-12, rtol=0)


@pytest.mark.parametrize("spec_name", SPECS)
def test_mvp_pruned_reloads(spec_name, tmp_path):
    """save_pruned, load_pruned and plain transformers (pruned_heads.py, trust_remote_code): every weight loaded, the
    pruned layers' forward the one that merges their heads; logits and cached generation equal the masked model's."""
    model, spec = _mvp(), SPECS[spec_name]
    with mask_heads(model, spec):
        expected = _logits(model, _inputs())
        tokens, _ = _generate(model, _inputs())
    prune_heads(model, spec)
    heads_left = {b.key: b.n_heads for b in attention_blocks(model)}
    save_pruned(model, tmp_path)
    record = json.loads((tmp_path / "headlab_pruning.json").read_text())
    assert record["portable"]["how"] == "remote code"
    plan = json.loads((tmp_path / "config.json").read_text())["headlab_pruned"]
    assert set(plan["classes"].values()) == {"mvp"}
    reloaded = load_pruned(tmp_path)
    assert {b.key: b.n_heads for b in attention_blocks(reloaded)} == heads_left
    torch.testing.assert_close(_logits(reloaded.double(), _inputs()), expected, atol=1e-12, rtol=0)
    assert torch.equal(_generate(reloaded, _inputs())[0], tokens)
    plain, info = tf.AutoModelForSeq2SeqLM.from_pretrained(tmp_path, trust_remote_code=True, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    plain = plain.eval().double()
    torch.testing.assert_close(_logits(plain, _inputs()), expected, atol=1e-12, rtol=0)
    assert torch.equal(_generate(plain, _inputs())[0], tokens)


def test_mvp_causal_lm_prunes_as_masked():
    """MvpForCausalLM (its decoder alone): the cross-attention it builds is never fed (idle), and its self-attention
    pruned (a layer left with no head) equals masked on a padded batch and in greedy cached generation."""
    model = _mvp(tf.MvpForCausalLM)
    assert [(b.kind, b.layer, b.idle) for b in attention_blocks(model)] == \
        [("dec_self", 0, False), ("dec_cross", 0, True), ("dec_self", 1, False), ("dec_cross", 1, True)]
    ids, mask = padded_inputs(pad_id=PAD)
    spec = {("dec_self", 0): [0, 1, 2, 3], ("dec_self", 1): [2]}
    check_pruned_generates_as_masked(model, spec, [0, 3], ids, mask, atol=1e-12)


def _lrp_record(model) -> dict:
    info = describe_model(model)
    g = torch.Generator().manual_seed(0)
    data = ImportanceData.from_ids([torch.randint(3, 99, (k,), generator=g).tolist() + [1] for k in (3, 6, 9)])
    data = translate_data(model, data, info, max_length_a=0, max_length_b=6)
    return compute_lrp(model, data, info, bootstrap=0).signature["conservation"]


@pytest.mark.parametrize(("dtype", "bar"), [(torch.float64, 1e-9), (torch.float32, 1e-6)], ids=["float64", "float32"])
@pytest.mark.parametrize("spec_name", [None, *SPECS])
def test_mvp_lrp_conserves(spec_name, dtype, bar):
    """compute_lrp on the model's own outputs (biases on, sources of three lengths) conserves every sentence's logit
    to 1e-9 in float64, and to the bar of tests/test_importance_lrp_conservation.py (1e-6) in float32, pruned too."""
    model = _mvp().to(dtype)
    if spec_name:
        prune_heads(model, SPECS[spec_name])
    record = _lrp_record(model)
    assert record["n_sentences"] > 0 and record["n_outside"] == 0, record
    assert abs(record["with_biases"]["min"] - 1) < bar and abs(record["with_biases"]["max"] - 1) < bar, record


def test_mvp_with_prompts_is_refused_before_any_work(tmp_path, capsys):
    """use_prompt=True: prompt keys and values prepended to every head's (a map over [prompt | tokens]; the prompt
    projection holding every layer's heads) is refused, naming why, by attention_blocks and by the command line."""
    model = _mvp(use_prompt=True, prompt_length=3, prompt_mid_dim=16)
    with pytest.raises(HeadlabError, match="is not supported") as caught:
        attention_blocks(model)
    assert "use_prompt=True" in str(caught.value) and "[prompt | tokens]" in str(caught.value)
    model.save_pretrained(tmp_path / "mvp")
    assert main(["heads", str(tmp_path / "mvp")]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("is not supported") == 1 and "use_prompt=True" in captured.err and captured.out == ""


def test_mvp_pruned_forward_refuses_a_prompt():
    """A pruned layer's forward (pruned_heads.py's too) refuses a prompt rather than attend with every head's."""
    model = _mvp()
    prune_heads(model, {("enc_self", 0): [1]})
    attention = model.model.encoder.layers[0].self_attn
    hidden = torch.zeros(1, 3, 32, dtype=torch.float64)
    with pytest.raises(ValueError, match="cannot be pruned"):
        attention(hidden, attn_prompt=torch.zeros(2, 4, 3, 8, dtype=torch.float64))


# -- ProphetNet and PEGASUS-X: refused before any work, naming why --------------------------------------------------

def _prophetnet() -> torch.nn.Module:
    return tf.ProphetNetForConditionalGeneration(tf.ProphetNetConfig(
        vocab_size=99, hidden_size=32, encoder_ffn_dim=37, decoder_ffn_dim=37, num_encoder_layers=2,
        num_decoder_layers=2, num_encoder_attention_heads=4, num_decoder_attention_heads=4,
        max_position_embeddings=64, ngram=2, num_buckets=8, relative_max_distance=16, pad_token_id=PAD,
        bos_token_id=0, eos_token_id=1, decoder_start_token_id=0)).eval()


def _pegasus_x() -> torch.nn.Module:
    return tf.PegasusXForConditionalGeneration(tf.PegasusXConfig(
        vocab_size=99, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=37, decoder_ffn_dim=37, max_position_embeddings=64,
        num_global_tokens=4, block_size=4, pad_token_id=PAD, eos_token_id=1, decoder_start_token_id=PAD)).eval()


@pytest.mark.parametrize(("build", "words"), [
    (_prophetnet, ("predicting streams", "2 x length keys", "relative-position")),
    (_pegasus_x, ("global tokens", "block_size", "do not sum to one"))], ids=["prophetnet", "pegasus_x"])
def test_refused_before_any_work_naming_why(build, words, tmp_path, capsys):
    """attention_blocks and the command line refuse them once, with the family's reason (before: discovery's
    generic "found no attention block" / "did not call transformers' attention interface")."""
    model = build()
    with pytest.raises(HeadlabError, match="is not supported") as caught:
        attention_blocks(model)
    for word in words:
        assert word in str(caught.value)
    model.save_pretrained(tmp_path / "model")
    assert main(["heads", str(tmp_path / "model")]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("is not supported") == 1 and words[0] in captured.err and captured.out == ""


def test_mvp_analyze_end_to_end(tmp_path):
    """Every stage of ``headlab analyze`` on a saved MVP (a word tokenizer with Marian's special ids: pad 0, eos 1)
    runs, LRP and ablation included, and the attention examples hold causal decoder self-attention."""
    import numpy as np

    from headlab.report.examples import load_example
    from support.family_matrix import analyze, treebank_files
    from support.treebank import word_tokenizer

    torch.manual_seed(0)
    model = tf.MvpForConditionalGeneration(tf.MvpConfig(
        vocab_size=99, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=37, decoder_ffn_dim=37, max_position_embeddings=64, pad_token_id=0,
        bos_token_id=1, eos_token_id=1, decoder_start_token_id=1, forced_eos_token_id=None)).eval()
    with torch.no_grad():  # (drawn at random, it ends every translation at once: no decoder map to read)
        model.final_logits_bias[0, 1] = -5
    word_tokenizer(treebank_files(tmp_path), style="marian").save_pretrained(tmp_path / "mvp")
    model.save_pretrained(tmp_path / "mvp")
    code, stages = analyze(tmp_path / "mvp", tmp_path)
    assert code == 0
    assert {name for name, stage in stages.items() if stage["status"] != "done"} <= {"prune", "figures"}, stages
    assert stages["lrp"]["status"] == "done" and stages["ablation"]["status"] == "done"
    examples = sorted((tmp_path / "out").rglob("sentence-*.json"))
    assert examples
    for path in examples:
        _, attention = load_example(path)
        for (kind, _), maps in attention.items():
            if kind == "dec_self":
                assert maps.shape[-1] > 1 and np.triu(maps.sum(0), k=1).sum() == 0
