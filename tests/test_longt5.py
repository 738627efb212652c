"""LongT5 (google/long-t5-local-*) with local attention as a table family of two layouts (refused before any work
until session 32: its encoder's LongT5LocalAttention calls no attention interface and no table described it);
transient-global LongT5 (refused before any work until session 41) is tests/test_longt5_transient_global.py's.

The encoder's ``LocalSelfAttention`` is T5's q/k/v/o computed block-wise: blocks of ``block_len = local_radius + 1``
tokens, each attending over three blocks masked to ``local_radius`` keys each side, the probabilities handed out
blocked. The decoder is T5's (``Family.parts``). On tiny float64 models (local_radius 2: blocks of 3), a padded batch of
10 tokens (the last block padded), padded on the right and on the left:

* capture equals transformers' own ``output_attentions`` rearranged into the [query, key] map entry by entry
  (tests/support/longt5.py), every real query's row summing to one; the decoder's and cross-attention's equal theirs;
* masking a head equals zeroing its value rows; gates at one change nothing;
* physical pruning of the three kinds (the encoder's first layer, which computes the shared position bias, and a
  layer with no head left too) equals masking on the padded batch and in cached greedy generation; so does the
  directory save_pruned writes, loaded by load_pruned and by plain transformers (pruned_heads.py: the position bias
  table stays whole, each pruned layer handed its kept heads' columns, as by headlab's hooks);
* compute_lrp conserves relevance on the model's own translations to 1e-9 in float64, before and after pruning;
* transient-global LongT5 is no longer refused; ``headlab analyze --ablation`` runs every stage on a saved tiny
  local LongT5.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers as tf

from headlab import (
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
from headlab.errors import PruningNotExact
from headlab.importance import ImportanceData, compute_lrp, describe_model, translate_data
from support.family_matrix import perturbed_model
from support.longt5 import dense_maps
from support.seq2seq_families import check_masking_equals_zeroed

KINDS = ("enc_self", "dec_self", "dec_cross")
SPECS = {
    "partial": {("enc_self", 0): [1], ("enc_self", 1): [0, 2], ("dec_self", 0): [3], ("dec_cross", 1): [0, 1, 2]},
    "no head left": {("enc_self", 0): [0, 1, 2, 3], ("enc_self", 1): [2], ("dec_self", 0): [0, 1, 2, 3],
                     ("dec_cross", 0): [0, 1, 2, 3], ("dec_cross", 1): [2]},
}


def _config(**extra) -> tf.LongT5Config:
    return tf.LongT5Config(**{**dict(
        vocab_size=99, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_decoder_layers=2, num_heads=4, local_radius=2,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, encoder_attention_type="local",
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0), **extra})


def _longt5(**extra) -> torch.nn.Module:
    """A tiny LongT5ForConditionalGeneration (2 + 2 layers, 4 heads of 8, local_radius 2), norms moved off their
    initial values, float64 (seed 4: its greedy translations are not empty, for LRP)."""
    return perturbed_model(tf.LongT5ForConditionalGeneration, _config(**extra), seed=4,
                           attn_implementation="eager").double()


def _inputs() -> dict:
    """Three sources of 10 tokens (4 blocks of 3, the last padded): one full, one padded on the right, one on the
    left; three target prefixes of 5."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 99, (3, 10), generator=g)
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1, -3:] = 0
    mask[2, :2] = 0
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask,
            "decoder_input_ids": torch.randint(3, 99, (3, 5), generator=g)}


def _logits(model, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


def _generate(model, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        out = model.generate(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], max_new_tokens=5,
                             min_new_tokens=5, do_sample=False, num_beams=1, use_cache=True, output_scores=True,
                             return_dict_in_generate=True)
    return out.sequences, torch.stack(out.scores)


def test_longt5_blocks_are_the_two_layouts():
    model = _longt5()
    blocks = attention_blocks(model)
    assert [(b.kind, b.layer, b.n_heads, b.d_head, b.family.name) for b in blocks] == [
        ("enc_self", 0, 4, 8, "longt5"), ("enc_self", 1, 4, 8, "longt5"),
        ("dec_self", 0, 4, 8, "longt5-decoder"), ("dec_cross", 0, 4, 8, "longt5-decoder"),
        ("dec_self", 1, 4, 8, "longt5-decoder"), ("dec_cross", 1, 4, 8, "longt5-decoder")]
    assert {type(b.core).__name__ for b in blocks[:2]} == {"LongT5LocalAttention"}
    assert {type(b.core).__name__ for b in blocks[2:]} == {"LongT5Attention"}
    assert blocks[0].o is model.encoder.block[0].layer[0].LocalSelfAttention.o


def test_longt5_captured_probabilities_are_the_models_own():
    """The encoder's dense maps equal its blocked output_attentions put in place by hand, bit for bit, cut to the 10
    tokens; every real query's row sums to one (float32's softmax); the decoder's and the cross-attention's equal
    output_attentions."""
    model, inputs = _longt5(), _inputs()
    with torch.no_grad():
        out = model(**inputs, output_attentions=True)
    assert out.encoder_attentions[0].shape == (3, 4, 4, 3, 9)  # [batch, blocks, heads, block_len, 3 * block_len]
    encoder = dense_maps(out.encoder_attentions, 10, inputs["attention_mask"])
    with torch.no_grad(), capture_attention(model) as record:
        model(**inputs)
    assert sorted(record) == sorted((kind, layer) for kind in KINDS for layer in (0, 1))
    real = inputs["attention_mask"].bool()
    for layer in (0, 1):
        probs = record[("enc_self", layer)]
        assert probs.shape == (3, 4, 10, 10)
        assert torch.equal(probs, encoder[layer])
        rows = probs.sum(-1).permute(0, 2, 1)[real]  # [real queries, heads]
        # LongT5LocalAttention's softmax is float32 whatever the model's dtype: one to float32's precision
        torch.testing.assert_close(rows, torch.ones_like(rows), atol=1e-6, rtol=0)
        far = (torch.arange(10)[:, None] - torch.arange(10)[None, :]).abs() > 2  # beyond local_radius
        for b in range(3):  # a real query attends to no padded key and to none beyond local_radius
            rows = probs[b][:, real[b]]
            assert bool((rows[:, :, ~real[b]] == 0).all()) and bool((rows[:, far[real[b]]] == 0).all())
        assert torch.equal(record[("dec_self", layer)], out.decoder_attentions[layer])
        assert torch.equal(record[("dec_cross", layer)], out.cross_attentions[layer])


def _zero_head(model, kind: str, layer: int, head: int) -> None:
    rows = slice(head * 8, (head + 1) * 8)
    block = (model.encoder if kind == "enc_self" else model.decoder).block[layer]
    core = {"enc_self": lambda: block.layer[0].LocalSelfAttention, "dec_self": lambda: block.layer[0].SelfAttention,
            "dec_cross": lambda: block.layer[1].EncDecAttention}[kind]()
    with torch.no_grad():
        core.v.weight[rows] = 0


@pytest.mark.parametrize("kind", KINDS)
def test_longt5_masking_equals_zeroed_values(kind):
    """Masking head 2 of layer 1 equals zeroing its value rows; the mask comes off."""
    check_masking_equals_zeroed(_longt5(), kind, _inputs(), zero_head=_zero_head)


def test_longt5_gates_at_one_change_nothing():
    model, inputs = _longt5(), _inputs()
    before = _logits(model, inputs)
    with gates_attached(model, ScalarGates.for_model(model)):
        assert torch.equal(_logits(model, inputs), before)
    for module in model.modules():
        assert not module._forward_pre_hooks and not module._forward_hooks, module


@pytest.mark.parametrize("spec_name", SPECS)
def test_longt5_pruned_equals_masked_and_generates_so(spec_name):
    """Pruned (q/k/v rows and o columns sliced, the relative position bias table kept whole and each pruned layer
    handed its kept heads' columns, the encoder's with the mask folded in; a layer with none left: zeros) equals
    masked in float64: the logits of the padded batch and greedy generation with the cache, step by step."""
    model, spec, inputs = _longt5(), SPECS[spec_name], _inputs()
    with mask_heads(model, spec):
        expected = _logits(model, inputs)
        tokens, scores = _generate(model, inputs)
    prune_heads(model, spec)
    counts = {b.key: b.n_heads for b in attention_blocks(model)}
    assert counts == {(kind, layer): 4 - len(spec.get((kind, layer), [])) for kind in KINDS for layer in (0, 1)}
    core = model.encoder.block[1].layer[0].LocalSelfAttention
    kept = counts[("enc_self", 1)]
    assert (core.n_heads, core.inner_dim, core.q.weight.shape, core.o.weight.shape) == (
        kept, 8 * kept, (8 * kept, 32), (32, 8 * kept))
    assert model.encoder.block[0].layer[0].LocalSelfAttention.relative_attention_bias.weight.shape == (8, 4)
    torch.testing.assert_close(_logits(model, inputs), expected, atol=1e-12, rtol=0)
    pruned_tokens, pruned_scores = _generate(model, inputs)
    assert torch.equal(pruned_tokens, tokens)
    torch.testing.assert_close(pruned_scores, scores, atol=1e-12, rtol=0)


@pytest.mark.parametrize("local", [False, True], ids=["no hook", "unmasked"])
def test_longt5_encoder_pruning_needs_its_local_bias(monkeypatch, local):
    """The regression the local bias hook fixes: without it (the stack handing on layer 0's bias of every head), or
    with the bias handed on without the mask folded in, a pruned encoder does not compute the masked model's outputs;
    pruning refuses, the model left whole."""
    from headlab import surgery

    if local:
        def unmasked(source):
            def hook(module, args, kwargs):
                kept = getattr(module, surgery.KEPT_ATTR)
                return args, {**kwargs, "position_bias": source.compute_bias(module.block_len)[:, :, kept]}
            return hook
        monkeypatch.setattr(surgery, "_local_bias_hook", unmasked)
    else:
        monkeypatch.setitem(families.FAMILIES, "longt5", dataclasses.replace(families.LONGT5, shared_bias=""))
    model, inputs = _longt5(), _inputs()
    before = _logits(model, inputs)
    why = "differs from the masked one in enc_self layer 0" if local else "fails in enc_self layer 0"
    with pytest.raises(PruningNotExact, match=why):
        prune_heads(model, {("enc_self", 0): [1], ("enc_self", 1): [0, 2]})
    assert torch.equal(_logits(model, inputs), before)
    assert [b.n_heads for b in attention_blocks(model)] == [4] * 6


@pytest.mark.parametrize("spec_name", SPECS)
def test_longt5_pruned_reloads(spec_name, tmp_path):
    """save_pruned, then load_pruned and plain transformers (pruned_heads.py, trust_remote_code; every weight loaded):
    logits and generate()'s cached greedy steps (tokens and scores) equal the masked model's in float64 to 1e-12.
    pruned_heads.py hands each pruned layer its kept heads' columns of the bias of the stack's first layer (the
    encoder's blocked, with the mask folded in), as headlab's hooks do; without trust_remote_code transformers refuses
    the pruned shapes rather than load another model."""
    model, spec, inputs = _longt5(), SPECS[spec_name], _inputs()
    with mask_heads(model, spec):
        expected = _logits(model, inputs)
        tokens, scores = _generate(model, inputs)
    prune_heads(model, spec)
    heads_left = {b.key: b.n_heads for b in attention_blocks(model)}
    save_pruned(model, tmp_path)
    record = json.loads((tmp_path / "headlab_pruning.json").read_text())
    assert record["portable"]["how"] == "remote code"
    plan = json.loads((tmp_path / "config.json").read_text())["headlab_pruned"]["shared_bias"]
    assert {kind for path, (_, _, kind) in plan.items() if path.startswith("encoder.")} == {"local"}
    assert {kind for path, (_, _, kind) in plan.items() if path.startswith("decoder.")} == {"t5"}
    reloaded = load_pruned(tmp_path).double()
    assert {b.key: b.n_heads for b in attention_blocks(reloaded)} == heads_left
    plain, info = tf.AutoModelForSeq2SeqLM.from_pretrained(tmp_path, trust_remote_code=True, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert type(plain).__name__ == "PrunedModel"
    for loaded in (reloaded, plain.eval().double()):
        torch.testing.assert_close(_logits(loaded, inputs), expected, atol=1e-12, rtol=0)
        loaded_tokens, loaded_scores = _generate(loaded, inputs)
        assert torch.equal(loaded_tokens, tokens)
        torch.testing.assert_close(loaded_scores, scores, atol=1e-12, rtol=0)
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):  # the pruned shapes refused, no wrong model
        tf.AutoModelForSeq2SeqLM.from_pretrained(tmp_path, trust_remote_code=False)


def _lrp_record(model) -> dict:
    info = describe_model(model)
    g = torch.Generator().manual_seed(0)
    data = ImportanceData.from_ids([torch.randint(3, 99, (k,), generator=g).tolist() + [1] for k in (3, 6, 9)])
    data = translate_data(model, data, info, max_length_a=0, max_length_b=6)
    return compute_lrp(model, data, info, bootstrap=0).signature["conservation"]


@pytest.mark.parametrize("spec_name", [None, *SPECS])
def test_longt5_lrp_conserves_in_float64(spec_name):
    """compute_lrp on the model's own translations (sources of three lengths around the block length) conserves every
    sentence's logit to 1e-9 in float64, pruned too (the bar of tests/test_importance_lrp_conservation.py is 1e-6 in
    float32)."""
    model = _longt5()
    if spec_name:
        prune_heads(model, SPECS[spec_name])
    record = _lrp_record(model)
    assert record["n_sentences"] > 0 and record["n_outside"] == 0, record
    assert abs(record["with_biases"]["min"] - 1) < 1e-9 and abs(record["with_biases"]["max"] - 1) < 1e-9, record


@pytest.mark.parametrize("cls", [tf.LongT5ForConditionalGeneration, tf.LongT5EncoderModel])
def test_longt5_transient_global_is_no_longer_refused(cls):
    """Transient-global LongT5, refused per config until session 41 (its side keys are aggregates of blocks of
    tokens), is analysed: its encoder's blocks are its own entry's (tests/test_longt5_transient_global.py)."""
    model = perturbed_model(cls, _config(encoder_attention_type="transient-global", global_block_size=4),
                            attn_implementation="eager")
    blocks = attention_blocks(model)
    assert {b.family.name for b in blocks if b.kind == "enc_self"} == {"longt5-transient-global"}
    assert {b.kind for b in blocks} == ({"enc_self"} if cls is tf.LongT5EncoderModel else set(KINDS))


def test_longt5_analyze_end_to_end(tmp_path, capsys):
    """Every stage of ``headlab analyze --ablation`` on a saved local LongT5 (a word tokenizer with Marian's special
    ids): the encoder's maps rebuilt from its blocks, the decoder's and the cross-attention's, LRP's too."""
    from support.family_matrix import analyze, treebank_files
    from support.treebank import word_tokenizer

    model = _longt5(pad_token_id=0, eos_token_id=1, decoder_start_token_id=0).float()
    word_tokenizer(treebank_files(tmp_path), style="marian").save_pretrained(tmp_path / "longt5")
    model.save_pretrained(tmp_path / "longt5")
    code, stages = analyze(tmp_path / "longt5", tmp_path)
    assert code == 0, capsys.readouterr().err
    assert {name for name, stage in stages.items() if stage["status"] != "done"} <= {"prune", "figures"}, stages
    assert stages["lrp"]["status"] == "done"
