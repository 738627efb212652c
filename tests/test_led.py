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

import pytest
import torch

from headlab import HeadlabError, attention_blocks, prune_heads
from headlab.adapters import families
from support.family_matrix import check_gates_at_one_change_nothing, logits
from support.longformer import dense_maps, global_token_0
from support.models import LED_WINDOWS, tiny_led
from support.seq2seq_families import (
    KINDS,
    check_analyze_end_to_end,
    check_captured_probabilities,
    check_masking_equals_zeroed,
    check_pruned_equals_masked,
    check_pruned_reloads,
    check_translated_lrp_conserves,
)

SPECS = {  # tests/support/seq2seq_families.py's, the encoder's layer 1 pruned too in "no head left"
    "partial": {("enc_self", 0): [1], ("enc_self", 1): [0, 2], ("dec_self", 0): [3], ("dec_cross", 1): [0, 1, 2]},
    "no head left": {("enc_self", 0): [0, 1, 2, 3], ("enc_self", 1): [2], ("dec_self", 1): [0, 1, 2, 3],
                     ("dec_cross", 0): [0, 1, 2, 3], ("dec_cross", 1): [2]},
}
STEPS = 5  # tokens generated


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


def test_led_blocks_are_the_two_layouts():
    model = tiny_led()
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
    inputs = _inputs(globals_)
    chosen = inputs.get("global_attention_mask")
    record = check_captured_probabilities(tiny_led(), inputs, encoder=lambda out: dense_maps(
        out.encoder_attentions, out.encoder_global_attentions,
        None if chosen is None else chosen * inputs["attention_mask"], LED_WINDOWS))
    for layer in (0, 1):
        assert record[("enc_self", layer)].shape == (3, 4, 9, 9)


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
    check_masking_equals_zeroed(tiny_led(), kind, _inputs(True), _zero_head)


def test_led_gates_at_one_change_nothing():
    check_gates_at_one_change_nothing(tiny_led(), _inputs(True))


@pytest.mark.parametrize("globals_", [False, True], ids=["local", "global"])
@pytest.mark.parametrize("spec_name", SPECS)
def test_led_pruned_equals_masked_and_generates_so(spec_name, globals_):
    """Pruned (the encoder's six projections and the decoder's four sliced, their forwards merging the kept heads; a
    layer with none left: the output projection's bias) equals masked in float64: the logits of the padded batch and
    greedy generation with the cache, step by step."""
    model = tiny_led()
    counts = check_pruned_equals_masked(model, SPECS[spec_name], _inputs(globals_), STEPS)
    core = model.led.encoder.layers[1].self_attn.longformer_self_attn
    for name in ("query", "key", "value", "query_global", "key_global", "value_global"):
        assert getattr(core, name).weight.shape == (8 * counts[("enc_self", 1)], 32), name


@pytest.mark.parametrize("spec_name", SPECS)
def test_led_pruned_reloads(spec_name, tmp_path):
    """save_pruned, load_pruned and plain transformers (pruned_heads.py, trust_remote_code): every weight loaded, the
    pruned layers' forwards those that merge their heads; logits and cached generation equal the masked model's."""
    check_pruned_reloads(tiny_led(), SPECS[spec_name], _inputs(True), tmp_path, {"longformer", "led-decoder"}, STEPS)


def test_led_decoder_pruning_needs_its_forward(monkeypatch):
    """The regression PRUNED_FORWARDS["led-decoder"] fixes: LEDDecoderAttention's own forward reshapes the heads'
    output to the hidden states' width and fails on a pruned layer; pruning then refuses, the model left whole."""
    monkeypatch.setitem(families.FAMILIES, "led", dataclasses.replace(
        families.LED, parts=(dataclasses.replace(families.LED_DECODER, pruned_forward=""),)))
    model = tiny_led()
    before = logits(model, _inputs(False))
    with pytest.raises(HeadlabError):
        prune_heads(model, {("dec_self", 0): [3]})
    assert torch.equal(logits(model, _inputs(False)), before)
    assert [b.n_heads for b in attention_blocks(model)] == [4] * 6


def _check_lrp_conserves(model, global_token: bool, bar: float) -> None:
    """compute_lrp on the model's own translations (eos 2) conserves to ``bar``; with ``global_token``, every encoder
    pass attends globally from token 0."""
    if global_token:
        model.led.encoder.register_forward_pre_hook(global_token_0, with_kwargs=True)
    check_translated_lrp_conserves(model, eos=2, bar=bar)


@pytest.mark.parametrize("globals_", [False, True], ids=["local", "global"])
@pytest.mark.parametrize("spec_name", [None, *SPECS])
def test_led_lrp_conserves_in_float64(spec_name, globals_):
    """compute_lrp on the model's own translations (biases on, sources of three lengths around the window) conserves
    every sentence's logit to 1e-9 in float64, pruned too (the bar of tests/test_importance_lrp_conservation.py is 1e-6
    in float32)."""
    model = tiny_led()
    if spec_name:
        prune_heads(model, SPECS[spec_name])
    _check_lrp_conserves(model, globals_, 1e-9)


@pytest.mark.parametrize("spec_name", [None, "no head left"])
def test_led_lrp_conserves_in_float32_to_the_bar(spec_name):
    """In float32, with global attention, to tests/test_importance_lrp_conservation.py's bar (1e-6), pruned too."""
    model = tiny_led().float()
    if spec_name:
        prune_heads(model, SPECS[spec_name])
    _check_lrp_conserves(model, True, 1e-6)


def test_led_windows_that_do_not_divide_the_largest_are_refused():
    with pytest.raises(HeadlabError, match=r"LED's per-layer attention windows \[4, 6\] do not all divide"):
        attention_blocks(tiny_led(attention_window=[4, 6]))


def test_led_analyze_end_to_end(tmp_path, capsys):
    """Every stage of ``headlab analyze --ablation`` on a saved LED (a word tokenizer with Marian's special ids): the
    encoder's maps from its band, the decoder's and the cross-attention's, LRP's too; the examples' decoder
    self-attention causal."""
    model = tiny_led(pad_token_id=0, eos_token_id=1, bos_token_id=2, decoder_start_token_id=1).float()
    with torch.no_grad():  # (drawn at random, it ends every translation at once: no decoder map to read)
        model.final_logits_bias[0, 1] = -5
    check_analyze_end_to_end(model, tmp_path, capsys)
