"""LED (Longformer Encoder-Decoder, allenai/led-*) as a table family of two layouts (refused before any work until
session 31: the table held one projection layout per model type).

Its encoder's attention is Longformer's (``LEDEncoderAttention``: ``longformer_self_attn``, a copy of
LongformerSelfAttention, with the global attention's own projections, and the output projection ``output``), its
decoder's self- and cross-attention BART's old one (``LEDDecoderAttention``: q_proj/k_proj/v_proj/out_proj, outside
the attention interface, returning (output, probabilities, cache)). ``Family.parts`` gives the decoder's kinds their own
entry. On tiny float64 models, with per-layer windows, a padded batch whose length is not a multiple of the window (the
encoder pads it) and global attention on some tokens:

* capture equals transformers' own ``output_attentions`` for the three kinds (the encoder's band scattered into the
  [query, key] map entry by entry, tests/support/longformer.py);
* masking a head equals zeroing its value rows (the encoder's: value and value_global); gates at one change nothing;
* physical pruning of the three kinds (a layer with no head left too) equals masking on the padded batch, with
  global tokens, and in cached greedy generation; so does the directory save_pruned writes, loaded by load_pruned and
  by plain transformers (pruned_heads.py: PRUNED_FORWARDS["longformer"] and ["led-decoder"]);
* compute_lrp conserves relevance on the model's own translations to 1e-9 in float64 (1e-6 in float32, the bar of
  tests/test_importance_lrp_conservation.py), before and after pruning, with global attention too;
* ``headlab analyze --ablation`` runs every stage on a saved tiny LED.
"""

from __future__ import annotations

import dataclasses
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
from headlab.adapters import families
from headlab.importance import ImportanceData, compute_lrp, describe_model, translate_data
from support.family_matrix import perturbed_model
from support.longformer import dense_maps

KINDS = ("enc_self", "dec_self", "dec_cross")
WINDOWS = [4, 8]  # a query sees 2 and 4 keys each side (each divides the largest: the encoder pads to 8's multiple)
SPECS = {
    "partial": {("enc_self", 0): [1], ("enc_self", 1): [0, 2], ("dec_self", 0): [3], ("dec_cross", 1): [0, 1, 2]},
    "no head left": {("enc_self", 0): [0, 1, 2, 3], ("enc_self", 1): [2], ("dec_self", 1): [0, 1, 2, 3],
                     ("dec_cross", 0): [0, 1, 2, 3], ("dec_cross", 1): [2]},
}


def _config(**extra) -> tf.LEDConfig:
    return tf.LEDConfig(**{**dict(
        vocab_size=99, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=37, decoder_ffn_dim=37, max_encoder_position_embeddings=64,
        max_decoder_position_embeddings=64, attention_window=WINDOWS, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        decoder_start_token_id=2), **extra})


def _led(**extra) -> torch.nn.Module:
    """A tiny LEDForConditionalGeneration (2 + 2 layers, 4 heads of 8), biases and norms moved off their initial
    values, float64."""
    return perturbed_model(tf.LEDForConditionalGeneration, _config(**extra), attn_implementation="eager").double()


def _inputs(globals_: bool) -> dict:
    """Three sources of 9 tokens (the encoder pads them to 16): one full, one padded on the right, one on the left;
    with ``globals_``, global attention on token 0 of the first two, on tokens 4 of the first and 5 of the second,
    and on the third's first real token (slot counts that differ per row). Three target prefixes of 5."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 99, (3, 9), generator=g)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, -2:] = 0
    mask[2, :3] = 0
    inputs = {"input_ids": ids.masked_fill(mask == 0, 1), "attention_mask": mask,
              "decoder_input_ids": torch.randint(3, 99, (3, 5), generator=g)}
    if globals_:
        chosen = torch.zeros(3, 9, dtype=torch.long)
        chosen[:2, 0] = 1
        chosen[0, 4] = 1
        chosen[1, 5] = 1
        chosen[2, 3] = 1
        inputs["global_attention_mask"] = chosen
    return inputs


def _logits(model, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


def _generate(model, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy generation with the cache (the decoder's keys and values, the encoder's once), global attention too."""
    extra = {"global_attention_mask": inputs["global_attention_mask"]} if "global_attention_mask" in inputs else {}
    with torch.no_grad():
        out = model.generate(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], max_new_tokens=5,
                             min_new_tokens=5, do_sample=False, num_beams=1, use_cache=True, output_scores=True,
                             return_dict_in_generate=True, **extra)
    return out.sequences, torch.stack(out.scores)


def test_led_blocks_are_the_two_layouts():
    model = _led()
    blocks = attention_blocks(model)
    assert [(b.kind, b.layer, b.n_heads, b.d_head, b.family.name) for b in blocks] == [
        ("enc_self", 0, 4, 8, "led"), ("enc_self", 1, 4, 8, "led"),
        ("dec_self", 0, 4, 8, "led-decoder"), ("dec_cross", 0, 4, 8, "led-decoder"),
        ("dec_self", 1, 4, 8, "led-decoder"), ("dec_cross", 1, 4, 8, "led-decoder")]
    assert type(blocks[0].core).__name__ == "LEDEncoderSelfAttention"
    assert blocks[0].o is model.led.encoder.layers[0].self_attn.output
    assert {type(b.core).__name__ for b in blocks[2:]} == {"LEDDecoderAttention"}


@pytest.mark.parametrize("globals_", [False, True], ids=["local", "global"])
def test_led_captured_probabilities_are_the_models_own(globals_):
    """The encoder's dense maps equal its band (and global rows) scattered by hand from output_attentions, bit for bit,
    cut back to the 9 input tokens; the decoder's and the cross-attention's equal output_attentions."""
    model, inputs = _led(), _inputs(globals_)
    with torch.no_grad():
        out = model(**inputs, output_attentions=True)
    chosen = inputs.get("global_attention_mask")
    encoder = dense_maps(out.encoder_attentions, out.encoder_global_attentions,
                         None if chosen is None else chosen * inputs["attention_mask"], WINDOWS)
    with torch.no_grad(), capture_attention(model) as record:
        model(**inputs)
    assert sorted(record) == sorted((kind, layer) for kind in KINDS for layer in (0, 1))
    for layer in (0, 1):
        assert record[("enc_self", layer)].shape == (3, 4, 9, 9)
        assert torch.equal(record[("enc_self", layer)], encoder[layer])
        assert torch.equal(record[("dec_self", layer)], out.decoder_attentions[layer])
        assert torch.equal(record[("dec_cross", layer)], out.cross_attentions[layer])


def _zero_head(model, kind: str, layer: int, head: int) -> None:
    rows = slice(head * 8, (head + 1) * 8)
    if kind == "enc_self":  # its local and its global queries' values
        core = model.led.encoder.layers[layer].self_attn.longformer_self_attn
        projections = (core.value, core.value_global)
    else:
        block = model.led.decoder.layers[layer]
        projections = ((block.encoder_attn if kind == "dec_cross" else block.self_attn).v_proj,)
    with torch.no_grad():
        for projection in projections:
            projection.weight[rows] = 0
            projection.bias[rows] = 0


@pytest.mark.parametrize("kind", KINDS)
def test_led_masking_equals_zeroed_values(kind):
    """Masking head 2 of layer 1 equals zeroing its value rows (the encoder's: value and value_global), with global
    tokens; the mask comes off."""
    model, inputs = _led(), _inputs(True)
    before = _logits(model, inputs)
    with mask_heads(model, {(kind, 1): [2]}):
        masked = _logits(model, inputs)
    assert torch.equal(_logits(model, inputs), before)
    _zero_head(model, kind, 1, 2)
    reference = _logits(model, inputs)
    assert not torch.allclose(reference, before)
    torch.testing.assert_close(masked, reference, atol=1e-12, rtol=0)


def test_led_gates_at_one_change_nothing():
    model, inputs = _led(), _inputs(True)
    before = _logits(model, inputs)
    with gates_attached(model, ScalarGates.for_model(model)):
        assert torch.equal(_logits(model, inputs), before)
    for module in model.modules():
        assert not module._forward_pre_hooks and not module._forward_hooks, module


@pytest.mark.parametrize("globals_", [False, True], ids=["local", "global"])
@pytest.mark.parametrize("spec_name", SPECS)
def test_led_pruned_equals_masked_and_generates_so(spec_name, globals_):
    """Pruned (the encoder's six projections and the decoder's four sliced, their forwards merging the kept heads; a
    layer with none left: the output projection's bias) equals masked in float64: the logits of the padded batch and
    greedy generation with the cache, step by step."""
    model, spec, inputs = _led(), SPECS[spec_name], _inputs(globals_)
    with mask_heads(model, spec):
        expected = _logits(model, inputs)
        tokens, scores = _generate(model, inputs)
    prune_heads(model, spec)
    counts = {b.key: b.n_heads for b in attention_blocks(model)}
    assert counts == {(kind, layer): 4 - len(spec.get((kind, layer), [])) for kind in KINDS for layer in (0, 1)}
    core = model.led.encoder.layers[1].self_attn.longformer_self_attn
    for name in ("query", "key", "value", "query_global", "key_global", "value_global"):
        assert getattr(core, name).weight.shape == (8 * counts[("enc_self", 1)], 32), name
    torch.testing.assert_close(_logits(model, inputs), expected, atol=1e-12, rtol=0)
    pruned_tokens, pruned_scores = _generate(model, inputs)
    assert torch.equal(pruned_tokens, tokens)
    torch.testing.assert_close(pruned_scores, scores, atol=1e-12, rtol=0)


@pytest.mark.parametrize("spec_name", SPECS)
def test_led_pruned_reloads(spec_name, tmp_path):
    """save_pruned, load_pruned and plain transformers (pruned_heads.py, trust_remote_code): every weight loaded, the
    pruned layers' forwards those that merge their heads; logits and cached generation equal the masked model's."""
    model, spec, inputs = _led(), SPECS[spec_name], _inputs(True)
    with mask_heads(model, spec):
        expected = _logits(model, inputs)
        tokens, _ = _generate(model, inputs)
    prune_heads(model, spec)
    heads_left = {b.key: b.n_heads for b in attention_blocks(model)}
    save_pruned(model, tmp_path)
    record = json.loads((tmp_path / "headlab_pruning.json").read_text())
    assert record["portable"]["how"] == "remote code"
    reloaded = load_pruned(tmp_path).double()
    assert {b.key: b.n_heads for b in attention_blocks(reloaded)} == heads_left
    torch.testing.assert_close(_logits(reloaded, inputs), expected, atol=1e-12, rtol=0)
    assert torch.equal(_generate(reloaded, inputs)[0], tokens)
    plain, info = tf.AutoModelForSeq2SeqLM.from_pretrained(tmp_path, trust_remote_code=True, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    plain = plain.eval().double()
    torch.testing.assert_close(_logits(plain, inputs), expected, atol=1e-12, rtol=0)
    assert torch.equal(_generate(plain, inputs)[0], tokens)


def test_led_decoder_pruning_needs_its_forward(monkeypatch):
    """The regression PRUNED_FORWARDS["led-decoder"] fixes: LEDDecoderAttention's own forward reshapes the heads'
    output to the hidden states' width and fails on a pruned layer; pruning then refuses, the model left whole."""
    monkeypatch.setitem(families.FAMILIES, "led", dataclasses.replace(
        families.LED, parts=(dataclasses.replace(families.LED_DECODER, pruned_forward=""),)))
    model = _led()
    before = _logits(model, _inputs(False))
    with pytest.raises(HeadlabError):
        prune_heads(model, {("dec_self", 0): [3]})
    assert torch.equal(_logits(model, _inputs(False)), before)
    assert [b.n_heads for b in attention_blocks(model)] == [4] * 6


def _lrp_record(model, global_token_0: bool = False) -> dict:
    if global_token_0:  # every encoder pass attends globally from token 0
        model.led.encoder.register_forward_pre_hook(_global_token_0, with_kwargs=True)
    info = describe_model(model)
    g = torch.Generator().manual_seed(0)
    data = ImportanceData.from_ids([torch.randint(3, 99, (k,), generator=g).tolist() + [2] for k in (3, 6, 9)])
    data = translate_data(model, data, info, max_length_a=0, max_length_b=6)
    return compute_lrp(model, data, info, bootstrap=0).signature["conservation"]


def _global_token_0(module, args, kwargs):
    ids = kwargs.get("input_ids", args[0] if args else None)
    chosen = torch.zeros_like(ids)
    chosen[:, 0] = 1
    return args, {**kwargs, "global_attention_mask": chosen}


@pytest.mark.parametrize("globals_", [False, True], ids=["local", "global"])
@pytest.mark.parametrize("spec_name", [None, *SPECS])
def test_led_lrp_conserves_in_float64(spec_name, globals_):
    """compute_lrp on the model's own translations (biases on, sources of three lengths around the window) conserves
    every sentence's logit to 1e-9 in float64, pruned too (the bar of tests/test_importance_lrp_conservation.py is 1e-6
    in float32)."""
    model = _led()
    if spec_name:
        prune_heads(model, SPECS[spec_name])
    record = _lrp_record(model, globals_)
    assert record["n_sentences"] > 0 and record["n_outside"] == 0, record
    assert abs(record["with_biases"]["min"] - 1) < 1e-9 and abs(record["with_biases"]["max"] - 1) < 1e-9, record


@pytest.mark.parametrize("spec_name", [None, "no head left"])
def test_led_lrp_conserves_in_float32_to_the_bar(spec_name):
    """In float32, with global attention, to tests/test_importance_lrp_conservation.py's bar (1e-6), pruned too."""
    model = _led().float()
    if spec_name:
        prune_heads(model, SPECS[spec_name])
    record = _lrp_record(model, True)
    assert record["n_sentences"] > 0 and record["n_outside"] == 0, record
    assert abs(record["with_biases"]["min"] - 1) < 1e-6 and abs(record["with_biases"]["max"] - 1) < 1e-6, record


def test_led_windows_that_do_not_divide_the_largest_are_refused():
    with pytest.raises(HeadlabError, match=r"LED's per-layer attention windows \[4, 6\] do not all divide"):
        attention_blocks(_led(attention_window=[4, 6]))


def test_led_analyze_end_to_end(tmp_path, capsys):
    """Every stage of ``headlab analyze --ablation`` on a saved LED (a word tokenizer with Marian's special ids): the
    encoder's maps from its band, the decoder's and the cross-attention's, LRP's too."""
    from support.family_matrix import analyze, treebank_files
    from support.treebank import word_tokenizer

    model = _led(pad_token_id=0, eos_token_id=1, bos_token_id=2, decoder_start_token_id=1).float()
    word_tokenizer(treebank_files(tmp_path), style="marian").save_pretrained(tmp_path / "led")
    model.save_pretrained(tmp_path / "led")
    code, stages = analyze(tmp_path / "led", tmp_path)
    assert code == 0, capsys.readouterr().err
    assert {name for name, stage in stages.items() if stage["status"] != "done"} <= {"prune", "figures"}, stages
    assert stages["lrp"]["status"] == "done"
