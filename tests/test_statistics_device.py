"""Where the head statistics run: on the probabilities' device, with the batch's side tensors
copied there once per batch (:meth:`SideBatch.copy_to`).

Without a GPU the copies are made on the CPU itself: a copy takes what it derives from Python
lists or decides from values (arcs, tags, rare-token masks, word spans) from the CPU batch, and
the statistics fed views of copies must write what they write from the batch itself, to the
bit. A stand-in device (:mod:`support.fake_device`) then checks, still on the CPU, that nothing
the statistics make from a batch on a device is made on the host instead. tests/test_cuda.py
runs the same analysis on a GPU.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import headlab.functions.analysis as analysis
from headlab.data.alignment import AttentionView, SideBatch
from headlab.data.frequencies import TokenFrequencies
from headlab.functions import AnalysisConfig, analyze_heads
from headlab.functions.analysis import PIECE_ELEMENTS, piece_rows, statistics_device
from support.fake_device import DEVICE, FakeDevice, OnDevice
from support.models import tiny_model
from support.treebank import SAMPLE_CONLLU, bpe_tokenizer, sample_sentences, side_batch

pytestmark = pytest.mark.unit

TEXTS = [line[len("# text = "):] for line in SAMPLE_CONLLU.splitlines() if line.startswith("# text = ")]


def test_statistics_run_on_cuda_and_else_on_the_cpu():
    assert statistics_device(torch.device("cpu")) == torch.device("cpu")
    assert statistics_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert statistics_device(torch.device("mps")) == torch.device("cpu")  # no float64 there
    assert statistics_device(torch.device("meta")) == torch.device("cpu")


def test_pieces_are_cache_sized_on_the_cpu_and_whole_chunks_elsewhere():
    B, H, rows, T = 2, 8, 512, 1024
    assert piece_rows(torch.zeros(B, H, rows, T)) == PIECE_ELEMENTS // (B * H * T) == 32
    assert piece_rows(torch.zeros(B, H, 3, 10)) == PIECE_ELEMENTS // (B * H * 10)  # a few rows: one piece anyway
    assert piece_rows(torch.zeros(B, 64, 16, 16384)) == 1  # a row of more weights than a piece
    assert piece_rows(torch.empty(B, H, rows, T, device="meta")) == rows  # not the CPU: the whole chunk


def test_a_copy_keeps_its_values_and_takes_derived_ones_from_the_batch(tmp_path):
    sentences = sample_sentences(tmp_path)
    tokenizer = bpe_tokenizer([" ".join(s.words) for s in sentences] * 3, vocab_size=45)
    side, _ = side_batch(sentences, tokenizer)
    assert side.host is side and side.to("cpu") is side  # already there: no copy
    copy = side.copy_to("cpu")
    assert copy is not side and copy.host is side and copy.copy_to("cpu").host is side
    assert copy.device == torch.device("cpu") and copy.max_words == side.max_words
    for name in ("token_word", "token_mask", "n_words", "heads", "token_ids", "word_mask", "word_index",
                 "first_word_index", "word_sizes", "upos_index"):
        assert torch.equal(getattr(copy, name), getattr(side, name)), name
    assert (copy.deprels, copy.words, copy.sentence_index, copy.pooling) == \
        (side.deprels, side.words, side.sentence_index, side.pooling)


def _analyse(family, tmp_path, query_chunk, target, pooling="sum"):
    tokenizer = bpe_tokenizer(TEXTS * 3, vocab_size=45)
    path = tmp_path / "tb.conllu"
    path.write_text(SAMPLE_CONLLU, encoding="utf-8")
    counts = np.arange(tokenizer.vocab_size, dtype=np.int64) % 5 + 1
    config = AnalysisConfig(batch_size=3, top_frequent=3, window=4, top_k=3, query_chunk=query_chunk,
                            sensitivity=True, word_pooling=pooling)
    return analyze_heads(tiny_model(family), tokenizer, path, target_conllu=path if target else None, config=config,
                         frequencies=TokenFrequencies(counts, "hand-set"))


def _files(analysis, directory) -> dict[str, bytes]:
    for result in analysis.results.values():
        result.write(directory)
    return {str(path.relative_to(directory)): path.read_bytes() for path in sorted(directory.rglob("*")) if path.is_file()}


@pytest.mark.parametrize("family, target, query_chunk, pooling", [
    ("marian", True, None, "sum"), ("marian", True, 2, "sum"), ("gpt2", False, 3, "sum"), ("gpt2", False, 2, "max"),
    ("bert", False, 2, "first")])
def test_statistics_fed_copies_of_the_batch_write_the_same_files(tmp_path, monkeypatch, family, target, query_chunk,
                                                                  pooling):
    """``analyze_heads`` with every batch side copied (as it is to a GPU) writes the files it writes
    without copies, byte for byte; one copy per batch and analysed side, shared by its blocks."""
    expected = _files(_analyse(family, tmp_path, query_chunk, target, pooling), tmp_path / "plain")
    copies = []
    original = SideBatch.copy_to

    def always_copy(self, device):
        copies.append(original(self, device))
        return copies[-1]

    monkeypatch.setattr(SideBatch, "to", always_copy)
    analysis = _analyse(family, tmp_path, query_chunk, target, pooling)
    written = _files(analysis, tmp_path / "copied")
    n_sides = 2 if target else 1  # marian: the source for the encoder, the target for the decoder
    assert len(copies) == n_sides * 2  # 4 sentences in batches of 3: 2 batches
    assert all(copy.host is not copy for copy in copies)
    assert len(written) > 20 and written.keys() == expected.keys()
    for name, data in expected.items():
        assert written[name] == data, name
    exemplars = json.loads(written["aggregate/exemplars.json"])
    assert any(heap for heaps in exemplars.values() for heap in heaps)  # the exemplars were compared, not empty


@pytest.mark.parametrize("family, target, query_chunk, pooling", [
    ("marian", True, 2, "sum"), ("gpt2", False, None, "max"), ("bert", False, 3, "first")])
def test_statistics_on_a_device_make_nothing_on_the_host(tmp_path, monkeypatch, family, target, query_chunk, pooling):
    """With the statistics sent to a stand-in device (:mod:`support.fake_device`), every view's
    probabilities and batch tensors are there, no operation of the statistics mixes them with a
    tensor made on the host (which on a GPU fails, or copies it there), and the files are the
    CPU's, byte for byte."""
    expected = _files(_analyse(family, tmp_path, query_chunk, target, pooling), tmp_path / "plain")
    monkeypatch.setattr(analysis, "statistics_device", lambda device: DEVICE)
    monkeypatch.setattr(SideBatch, "to", lambda self, device: self.copy_to(device))
    views = []
    original = AttentionView.__init__

    def record(self, block, probs, side, **kwargs):
        views.append((type(probs), type(side.token_word), type(side.heads), side.device is DEVICE))
        original(self, block, probs, side, **kwargs)

    monkeypatch.setattr(AttentionView, "__init__", record)
    with FakeDevice() as device:
        analysis_on_device = _analyse(family, tmp_path, query_chunk, target, pooling)
        written = _files(analysis_on_device, tmp_path / "device")
    assert views and set(views) == {(OnDevice, OnDevice, OnDevice, True)}
    assert not device.mixed, "\n".join(device.mixed[:3])
    assert written == expected
