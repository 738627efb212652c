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

from headlab import attention_blocks, capture_attention, mask_heads, prune_heads
from headlab.importance import compute_lrp
from support.family_matrix import (
    CONFIGS,
    check_gates_at_one_change_nothing,
    check_lrp_conserves,
    check_pruned_generates_as_masked,
    logits,
    padded_inputs,
    perturbed_model,
)
from support.models import tiny_fsmt
from support.seq2seq_families import (
    KINDS,
    SPECS,
    check_analyze_end_to_end,
    check_blocks_are_bart_layout,
    check_captured_probabilities,
    check_masking_equals_zeroed,
    check_pruned_equals_masked,
    check_pruned_reloads,
    check_translated_lrp_conserves,
    seq2seq_inputs,
    translated_data,
)
from support.table_families import SPECS as TABLE_SPECS
from support.table_families import check_compute_lrp_conserves, check_pruned_generates_and_reloads, table_spec

PAD = 2


def _inputs() -> dict:
    return seq2seq_inputs(PAD)


def test_fsmt_blocks_are_the_table():
    check_blocks_are_bart_layout(tiny_fsmt(), "fsmt")


def test_fsmt_captured_probabilities_are_the_models_own():
    """What capture reads (asking each Attention for its probabilities) equals transformers' output_attentions, for
    the encoder's, the decoder's and the decoder-encoder attention, on a padded batch."""
    check_captured_probabilities(tiny_fsmt(), _inputs(), atol=1e-12)


def test_fsmt_streamed_chunks_equal_capture():
    """stream_attention (the statistics engine's source: chunks of query rows) gives the captured maps, and leaves
    the logits as they are."""
    from headlab.capture import stream_attention

    model = tiny_fsmt()
    with torch.no_grad(), capture_attention(model) as record:
        before = logits(model, _inputs())
    chunks: dict = {}
    with stream_attention(model, lambda block, chunk: chunks.setdefault(block.key, []).append(chunk), query_chunk=3):
        assert torch.equal(logits(model, _inputs()), before)
    assert sorted(chunks) == sorted(record)
    for key, probs in record.items():
        torch.testing.assert_close(torch.cat([c.full() for c in chunks[key]], 2).double(), probs.double(), atol=1e-6,
                                   rtol=0)


@pytest.mark.parametrize("kind", KINDS)
def test_fsmt_masking_equals_zeroed_values(kind):
    """Masking head 2 of layer 1 equals zeroing its rows of v_proj (weights and bias): its output is then 0."""
    check_masking_equals_zeroed(tiny_fsmt(), kind, _inputs())


def test_fsmt_gates_at_one_change_nothing():
    check_gates_at_one_change_nothing(tiny_fsmt(), _inputs())


@pytest.mark.parametrize("spec_name", SPECS)
def test_fsmt_pruned_equals_masked_and_generates_so(spec_name):
    """Pruned (its forward merging the kept heads; a layer with none left: the output projection's bias) equals
    masked in float64: the logits of a padded batch and greedy generation with the cache, step by step. Before the
    pruned forward, FSMT's own failed on a pruned layer (its view to the query's width)."""
    check_pruned_equals_masked(tiny_fsmt(), SPECS[spec_name], _inputs())


@pytest.mark.parametrize("spec_name", SPECS)
def test_fsmt_pruned_reloads(spec_name, tmp_path):
    """save_pruned, load_pruned and plain transformers (pruned_heads.py, trust_remote_code): every weight loaded, the
    pruned layers' forward the one that merges their heads; logits and cached generation equal the masked model's."""
    check_pruned_reloads(tiny_fsmt(), SPECS[spec_name], _inputs(), tmp_path, {"fsmt"})


def test_fsmt_with_a_larger_source_vocabulary_prunes():
    """wmt19 ru-en and en-ru have a source vocabulary other than the target's: pruning's check draws the decoder's
    tokens from the target's (before: refused, "the model itself fails on headlab's probe batch: IndexError")."""
    model, spec = tiny_fsmt(src_vocab=4000), SPECS["partial"]
    inputs = {**_inputs(), "input_ids": _inputs()["input_ids"] + 3900 * _inputs()["attention_mask"]}
    with mask_heads(model, spec):
        expected = logits(model, inputs)
    prune_heads(model, spec)
    torch.testing.assert_close(logits(model, inputs), expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("spec_name", [None, *SPECS])
def test_fsmt_lrp_conserves_in_float64(spec_name):
    """compute_lrp on the model's own translations (biases on, sources of three lengths) conserves every sentence's
    logit to 1e-9 in float64 (the bar of tests/test_importance_lrp_conservation.py is 1e-6 in float32), pruned too."""
    model = tiny_fsmt()
    if spec_name:
        prune_heads(model, SPECS[spec_name])
    check_translated_lrp_conserves(model, eos=1)


def test_fsmt_lrp_head_scores_are_per_sentence():
    """The heads' relevance is read batch-first though FSMT's layers are time-first ([T, B, C]): each sentence's
    scores are the same in a padded batch of three as alone (before Family.time_first, positions and sentences
    were mixed, and conservation failed: ratios 0.87 to 1.21)."""
    model = tiny_fsmt()
    data, info = translated_data(model, eos=1)
    together = compute_lrp(model, data, info, bootstrap=0, batch_size=3)
    alone = compute_lrp(model, data, info, bootstrap=0, batch_size=1)
    for kind in KINDS:
        assert together.scores[kind].shape == (2, 4)
        np.testing.assert_allclose(together.scores[kind], alone.scores[kind], atol=1e-10, rtol=0)


# -- TrOCR: its text decoder (TrOCRForCausalLM), what the family sweep builds ----------------------------------------
# (capture, masking equal to zeroed values and gates at one: tests/test_more_families.py, its family matrix entry;
# the pruning plans: tests/support/table_families.py's)


def _trocr() -> torch.nn.Module:
    """The family matrix's tiny TrOCR (pad 2, bos 0, eos 1), eager, biases and norm weights moved off their initial
    values."""
    return perturbed_model(*CONFIGS["trocr"](), attn_implementation="eager")


def test_trocr_blocks_are_the_table():
    """Its decoder's self-attention, and the cross-attention TrOCRForCausalLM builds (is_decoder) but that nothing
    headlab passes feeds (encoder_hidden_states): idle."""
    blocks = attention_blocks(_trocr())
    assert [(b.kind, b.layer, b.n_heads, b.d_head, b.idle) for b in blocks] == \
        [("dec_self", 0, 4, 8, False), ("dec_cross", 0, 4, 8, True), ("dec_self", 1, 4, 8, False),
         ("dec_cross", 1, 4, 8, True)]


@pytest.mark.parametrize("spec_name", TABLE_SPECS)
def test_trocr_pruned_equals_masked_generates_so_and_reloads(spec_name, tmp_path):
    """In float64: pruned (its forward merging the kept heads; a layer with none left) equals masked on a padded
    batch and in greedy cached generation; save_pruned, load_pruned and plain transformers (pruned_heads.py)."""
    spec, heads_left = table_spec("dec_self", spec_name)
    ids, mask = padded_inputs(pad_id=PAD)
    check_pruned_generates_as_masked(_trocr().double(), spec, heads_left, ids, mask, atol=1e-12)
    # saved and reloaded in float32, as transformers builds it
    check_pruned_generates_and_reloads(_trocr(), spec, heads_left, tmp_path)
    # the plan names the forward of each layer that kept heads but not all (pruned_heads.py gives it them)
    plan = json.loads((tmp_path / "config.json").read_text())["headlab_pruned"]
    assert plan["classes"] == {f"model.decoder.layers.{i}.self_attn": "trocr" for i in (0, 1) if 0 < heads_left[i] < 4}


@pytest.mark.parametrize("spec_name", [None, *TABLE_SPECS])
def test_trocr_lrp_conserves_in_float64(spec_name):
    """The rules conserve relevance exactly on a bias-free copy, and compute_lrp (biases on, padded sentences) every
    sentence's logit to 1e-9, pruned too."""
    model = _trocr().double()
    if spec_name:
        prune_heads(model, table_spec("dec_self", spec_name)[0])
    check_compute_lrp_conserves(model)
    if spec_name is None:  # (its weights redrawn at unit gain: a layer with no head has an output projection of none)
        check_lrp_conserves(model, model.model.decoder.layers[0], rtol=1e-10, atol=1e-10)


def test_fsmt_analyze_end_to_end_reads_a_causal_decoder(tmp_path, capsys):
    """Every stage of ``headlab analyze`` on a saved FSMT (a word tokenizer with Marian's special ids), and the
    attention examples it writes hold causal decoder self-attention: FSMT's forward builds its decoder's causal mask
    only without a cache (transformers 5.24: with use_cache, its config's default, every target token attends to the
    later ones), so headlab's teacher-forced passes ask for none (before, the examples and the functions' statistics
    read the decoder's attention to later tokens)."""
    model = tiny_fsmt(pad=0, eos=1).float()
    with torch.no_grad():  # transformers' own quirk, which headlab works around: a cached pass is not causal
        attentions = model(**_inputs(), output_attentions=True).decoder_attentions
    assert torch.triu(attentions[0][0].sum(0), diagonal=1).sum() > 0
    check_analyze_end_to_end(model, tmp_path, capsys)
