"""FSMT (fairseq's WMT19 translation Transformers, facebook/wmt19-en-de ...) as a table family: before its entry it
was refused before any work (its attention, outside transformers' attention interface, returns its probabilities only
with ``output_attentions``).

FSMT is the paper's setting (Voita et al. 2019): encoder self-attention, decoder self-attention and decoder-encoder
attention, each ``Attention`` of modeling_fsmt, time-first ([T, B, C]). Its forward merges the heads into the query's
width (``view(tgt_len, bsz, embed_dim)``), which a pruned layer's heads no longer fill: a pruned layer takes
``portable_code.PRUNED_FORWARDS["fsmt"]`` (the same forward, merging ``num_heads * head_dim``), in headlab and in the
directory's pruned_heads.py. On a tiny FSMT, in float64: capture equals transformers' ``output_attentions`` for the three
kinds, masking a head equals zeroing its value weights, gates at one change nothing, pruning (a head, a whole layer) equals
masking on a padded batch and in greedy generation with the cache, and so does the directory save_pruned writes, loaded by
load_pruned and by plain transformers (pruned_heads.py, trust_remote_code); LRP conserves relevance (compute_lrp, on
the model's own translations) before and after pruning.
"""

from __future__ import annotations

import json

import numpy as np
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
from headlab.importance import ImportanceData, compute_lrp, describe_model, translate_data
from support.family_matrix import (
    check_lrp_conserves,
    check_pruned_generates_as_masked,
    check_pruned_reloads,
    padded_inputs,
    perturbed_model,
)

KINDS = ("enc_self", "dec_self", "dec_cross")
PAD = 2
SPECS = {
    "partial": {("enc_self", 0): [1], ("enc_self", 1): [0, 2], ("dec_self", 0): [3], ("dec_cross", 1): [0, 1, 2]},
    "no head left": {("enc_self", 0): [0, 1, 2, 3], ("dec_self", 1): [0, 1, 2, 3], ("dec_cross", 0): [0, 1, 2, 3],
                     ("dec_cross", 1): [2]},
}


def _fsmt(seed: int = 0, pad: int = PAD, eos: int = 1, src_vocab: int = 99) -> torch.nn.Module:
    """A tiny FSMT (2 + 2 layers, 4 heads of 8), biases and norm weights moved off their initial values, float64.
    (Its position tables' size depends on the padding id: a tokenizer's ids are given here, not set after.)"""
    config = tf.FSMTConfig(
        langs=["en", "de"], src_vocab_size=src_vocab, tgt_vocab_size=99, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=37, decoder_ffn_dim=37,
        max_position_embeddings=64, pad_token_id=pad, bos_token_id=0 if eos else 1, eos_token_id=eos,
        decoder_start_token_id=eos, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = tf.FSMTForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 0.1)
            elif "layer_norm" in name:
                parameter.normal_(1, 0.1)
    return model.double()


def _inputs() -> dict:
    """Two sources, the second padded (FSMT pads at the end), and two target prefixes."""
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


def test_fsmt_blocks_are_the_table():
    blocks = attention_blocks(_fsmt())
    assert sorted((b.kind, b.layer, b.n_heads, b.d_head, b.family.name) for b in blocks) == \
        sorted((kind, layer, 4, 8, "fsmt") for kind in KINDS for layer in (0, 1))
    assert {b.name for b in blocks} == {f"model.encoder.layers.{i}.self_attn" for i in (0, 1)} | \
        {f"model.decoder.layers.{i}.{n}" for i in (0, 1) for n in ("self_attn", "encoder_attn")}


def test_fsmt_captured_probabilities_are_the_models_own():
    """What capture reads (asking each Attention for its probabilities) equals transformers' output_attentions, for
    the encoder's, the decoder's and the decoder-encoder attention, on a padded batch."""
    model = _fsmt()
    with torch.no_grad():
        reference = model(**_inputs(), output_attentions=True)
    with torch.no_grad(), capture_attention(model) as record:
        model(**_inputs())
    for layer in (0, 1):
        for kind, theirs in zip(KINDS, (reference.encoder_attentions, reference.decoder_attentions,
                                        reference.cross_attentions)):
            torch.testing.assert_close(record[(kind, layer)].double(), theirs[layer], atol=1e-12, rtol=0)


def test_fsmt_streamed_chunks_equal_capture():
    """stream_attention (the statistics engine's source: chunks of query rows) gives the captured maps, and leaves
    the logits as they are."""
    from headlab.capture import stream_attention

    model = _fsmt()
    with torch.no_grad(), capture_attention(model) as record:
        before = _logits(model, _inputs())
    chunks: dict = {}
    with stream_attention(model, lambda block, chunk: chunks.setdefault(block.key, []).append(chunk), query_chunk=3):
        assert torch.equal(_logits(model, _inputs()), before)
    assert sorted(chunks) == sorted(record)
    for key, probs in record.items():
        torch.testing.assert_close(torch.cat([c.full() for c in chunks[key]], 2).double(), probs.double(), atol=1e-6,
                                   rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_fsmt_masking_equals_zeroed_values(kind):
    """Masking head 2 of layer 1 equals zeroing its rows of v_proj (weights and bias): its output is then 0."""
    model = _fsmt()
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


def test_fsmt_gates_at_one_change_nothing():
    model = _fsmt()
    before = _logits(model, _inputs())
    with gates_attached(model, ScalarGates.for_model(model)):
        assert torch.equal(_logits(model, _inputs()), before)
    for module in model.modules():
        assert not module._forward_pre_hooks and not module._forward_hooks, module


@pytest.mark.parametrize("spec_name", SPECS)
def test_fsmt_pruned_equals_masked_and_generates_so(spec_name):
    """Pruned (its forward merging the kept heads; a layer with none left: the output projection's bias) equals
    masked in float64: the logits of a padded batch and greedy generation with the cache, step by step. Before the
    pruned forward, FSMT's own failed on a pruned layer (its view to the query's width)."""
    model, spec = _fsmt(), SPECS[spec_name]
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
def test_fsmt_pruned_reloads(spec_name, tmp_path):
    """save_pruned, load_pruned and plain transformers (pruned_heads.py, trust_remote_code): every weight loaded, the
    pruned layers' forward the one that merges their heads; logits and cached generation equal the masked model's."""
    model, spec = _fsmt(), SPECS[spec_name]
    with mask_heads(model, spec):
        expected = _logits(model, _inputs())
        tokens, _ = _generate(model, _inputs())
    prune_heads(model, spec)
    heads_left = {b.key: b.n_heads for b in attention_blocks(model)}
    save_pruned(model, tmp_path)
    record = json.loads((tmp_path / "headlab_pruning.json").read_text())
    assert record["portable"]["how"] == "remote code"
    reloaded = load_pruned(tmp_path, dtype=torch.float64) if False else load_pruned(tmp_path)
    assert {b.key: b.n_heads for b in attention_blocks(reloaded)} == heads_left
    torch.testing.assert_close(_logits(reloaded.double(), _inputs()), expected, atol=1e-12, rtol=0)
    assert torch.equal(_generate(reloaded, _inputs())[0], tokens)
    plain, info = tf.AutoModelForSeq2SeqLM.from_pretrained(tmp_path, trust_remote_code=True, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    plain = plain.eval().double()
    torch.testing.assert_close(_logits(plain, _inputs()), expected, atol=1e-12, rtol=0)
    assert torch.equal(_generate(plain, _inputs())[0], tokens)


def test_fsmt_with_a_larger_source_vocabulary_prunes():
    """wmt19 ru-en and en-ru have a source vocabulary other than the target's: pruning's check draws the decoder's
    tokens from the target's (before: refused, "the model itself fails on headlab's probe batch: IndexError")."""
    model, spec = _fsmt(src_vocab=4000), SPECS["partial"]
    inputs = {**_inputs(), "input_ids": _inputs()["input_ids"] + 3900 * _inputs()["attention_mask"]}
    with mask_heads(model, spec):
        expected = _logits(model, inputs)
    prune_heads(model, spec)
    torch.testing.assert_close(_logits(model, inputs), expected, atol=1e-12, rtol=0)


def _lrp_record(model) -> dict:
    info = describe_model(model)
    g = torch.Generator().manual_seed(0)
    data = ImportanceData.from_ids([torch.randint(3, 99, (k,), generator=g).tolist() + [1] for k in (3, 6, 9)])
    data = translate_data(model, data, info, max_length_a=0, max_length_b=6)
    return compute_lrp(model, data, info, bootstrap=0).signature["conservation"]


@pytest.mark.parametrize("spec_name", [None, *SPECS])
def test_fsmt_lrp_conserves_in_float64(spec_name):
    """compute_lrp on the model's own translations (biases on, sources of three lengths) conserves every sentence's
    logit to 1e-9 in float64 (the bar of tests/test_importance_lrp_conservation.py is 1e-6 in float32), pruned too."""
    model = _fsmt()
    if spec_name:
        prune_heads(model, SPECS[spec_name])
    record = _lrp_record(model)
    assert record["n_sentences"] > 0 and record["n_outside"] == 0, record
    assert abs(record["with_biases"]["min"] - 1) < 1e-9 and abs(record["with_biases"]["max"] - 1) < 1e-9, record


def test_fsmt_lrp_head_scores_are_per_sentence():
    """The heads' relevance is read batch-first though FSMT's layers are time-first ([T, B, C]): each sentence's
    scores are the same in a padded batch of three as alone (before Family.time_first, positions and sentences
    were mixed, and conservation failed: ratios 0.87 to 1.21)."""
    model = _fsmt()
    info = describe_model(model)
    g = torch.Generator().manual_seed(0)
    data = ImportanceData.from_ids([torch.randint(3, 99, (k,), generator=g).tolist() + [1] for k in (3, 6, 9)])
    data = translate_data(model, data, info, max_length_a=0, max_length_b=6)
    together = compute_lrp(model, data, info, bootstrap=0, batch_size=3)
    alone = compute_lrp(model, data, info, bootstrap=0, batch_size=1)
    for kind in KINDS:
        assert together.scores[kind].shape == (2, 4)
        np.testing.assert_allclose(together.scores[kind], alone.scores[kind], atol=1e-10, rtol=0)


# -- TrOCR: its text decoder (TrOCRForCausalLM), what the family sweep builds ----------------------------------------
# (capture, masking equal to zeroed values and gates at one: tests/test_more_families.py, its family matrix entry)

TROCR_SPECS = {"partial": ({("dec_self", 0): [1], ("dec_self", 1): [0, 2]}, [3, 2]),
               "no head left": ({("dec_self", 0): [0, 1, 2, 3], ("dec_self", 1): [2]}, [0, 3])}


def _trocr() -> torch.nn.Module:
    return perturbed_model(tf.TrOCRForCausalLM, tf.TrOCRConfig(
        vocab_size=99, d_model=32, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=37,
        max_position_embeddings=64, pad_token_id=PAD, bos_token_id=0, eos_token_id=1), attn_implementation="eager")


def test_trocr_blocks_are_the_table():
    """Its decoder's self-attention, and the cross-attention TrOCRForCausalLM builds (is_decoder) but that nothing
    headlab passes feeds (encoder_hidden_states): idle."""
    blocks = attention_blocks(_trocr())
    assert [(b.kind, b.layer, b.n_heads, b.d_head, b.idle) for b in blocks] == \
        [("dec_self", 0, 4, 8, False), ("dec_cross", 0, 4, 8, True), ("dec_self", 1, 4, 8, False),
         ("dec_cross", 1, 4, 8, True)]


@pytest.mark.parametrize("spec_name", TROCR_SPECS)
def test_trocr_pruned_equals_masked_generates_so_and_reloads(spec_name, tmp_path):
    """In float64: pruned (its forward merging the kept heads; a layer with none left) equals masked on a padded
    batch and in greedy cached generation; save_pruned, load_pruned and plain transformers (pruned_heads.py)."""
    spec, heads_left = TROCR_SPECS[spec_name]
    ids, mask = padded_inputs(pad_id=PAD)
    check_pruned_generates_as_masked(_trocr().double(), spec, heads_left, ids, mask, atol=1e-12)
    model = _trocr()  # saved and reloaded in float32, as transformers builds it
    expected, tokens = check_pruned_generates_as_masked(model, spec, heads_left, ids, mask)
    check_pruned_reloads(model, tmp_path, heads_left, ids, mask, expected, tokens)
    # the plan names the forward of each layer that kept heads but not all (pruned_heads.py gives it them)
    plan = json.loads((tmp_path / "config.json").read_text())["headlab_pruned"]
    assert plan["classes"] == {f"model.decoder.layers.{i}.self_attn": "trocr" for i in (0, 1) if 0 < heads_left[i] < 4}


@pytest.mark.parametrize("spec_name", [None, *TROCR_SPECS])
def test_trocr_lrp_conserves_in_float64(spec_name):
    """The rules conserve relevance exactly on a bias-free copy, and compute_lrp (biases on, padded sentences) every
    sentence's logit to 1e-9, pruned too."""
    model = _trocr().double()
    if spec_name:
        prune_heads(model, TROCR_SPECS[spec_name][0])
    g = torch.Generator().manual_seed(0)
    data = ImportanceData.from_ids([torch.randint(3, 99, (k,), generator=g).tolist() for k in (3, 6, 9)])
    record = compute_lrp(model, data, describe_model(model), bootstrap=0).signature["conservation"]
    assert record["n_outside"] == 0, record
    assert abs(record["with_biases"]["min"] - 1) < 1e-9 and abs(record["with_biases"]["max"] - 1) < 1e-9, record
    if spec_name is None:  # (its weights redrawn at unit gain: a layer with no head has an output projection of none)
        check_lrp_conserves(model, model.model.decoder.layers[0], rtol=1e-10, atol=1e-10)


def test_fsmt_analyze_end_to_end_reads_a_causal_decoder(tmp_path):
    """Every stage of ``headlab analyze`` on a saved FSMT (a word tokenizer with Marian's special ids), and the
    attention examples it writes hold causal decoder self-attention: FSMT's forward builds its decoder's causal mask
    only without a cache (transformers 5.24: with use_cache, its config's default, every target token attends to the
    later ones), so headlab's teacher-forced passes ask for none (before, the examples and the functions' statistics
    read the decoder's attention to later tokens)."""
    from headlab.report.examples import load_example
    from support.family_matrix import analyze, treebank_files
    from support.treebank import word_tokenizer

    model = _fsmt(pad=0, eos=1).float()
    with torch.no_grad():  # transformers' own quirk, which headlab works around: a cached pass is not causal
        attentions = model(**_inputs(), output_attentions=True).decoder_attentions
    assert torch.triu(attentions[0][0].sum(0), diagonal=1).sum() > 0
    word_tokenizer(treebank_files(tmp_path), style="marian").save_pretrained(tmp_path / "fsmt")
    model.save_pretrained(tmp_path / "fsmt")
    code, stages = analyze(tmp_path / "fsmt", tmp_path)
    assert code == 0
    assert {name for name, stage in stages.items() if stage["status"] != "done"} <= {"prune", "figures"}, stages
    assert stages["lrp"]["status"] == "done"
    examples = sorted((tmp_path / "out").rglob("sentence-*.json"))
    assert examples
    for path in examples:
        _, attention = load_example(path)
        for (kind, _), maps in attention.items():
            if kind == "dec_self":
                assert maps.shape[-1] > 1 and np.triu(maps.sum(0), k=1).sum() == 0
