"""The fused engine's per-batch caches (issue 34: host work per chunk) equal what they replace.

What a chunk's statistics decide from the batch alone (the words' extremes, the kept key ranges,
the keys each query can reach, the token columns of the arcs' key words, the related words) is
made once per batch and reused by every layer and chunk: each cached structure is checked here
against the per-chunk computation it replaced, and the chunks after the first layer are checked
to ask the tensors nothing (on a GPU each such question, ``.item()``, ``bool(t)``, ``nonzero``,
``bincount``, waits for the device).
"""

from __future__ import annotations

import collections
from dataclasses import replace

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from headlab.aggregate import _related_words
from headlab.data.alignment import AttentionView, _masked_max, first_max, kept_range, key_range, reachable_keys
from headlab.data.frequencies import TokenFrequencies
from headlab.data.fused import FusedView
from headlab.functions import AnalysisConfig, analyze_heads
from headlab.functions import analysis as analysis_module
from support.models import tiny_model
from support.treebank import SAMPLE_CONLLU, FakeBlock, sample_sentences, side_batch
from test_chunked_statistics import _assert_close, _written
from test_fused_statistics import word_tokenizer

pytestmark = pytest.mark.unit


def _side(tmp_path):
    """Three sentences of different lengths, one word per token after a BOS (the fused word passes apply)."""
    side, _ = side_batch(sample_sentences(tmp_path)[:3], word_tokenizer())
    assert side.min_words < side.max_words  # padding words: the masked branches run too
    return side


def _related_by_loop(heads: torch.Tensor) -> torch.Tensor:
    """The per-word loop that :func:`headlab.aggregate._related_words` replaced (its output, to the bit,
    on a tree; on a malformed one with a 2-cycle the loop sized its rows before removing the repeat,
    and failed)."""
    B, W = heads.shape
    related: list[list[list[int]]] = [[[] for _ in range(W)] for _ in range(B)]
    for b in range(B):
        for d, g in enumerate(heads[b].tolist()):
            if g >= 0 and g != d:
                related[b][d].append(g)
                related[b][g].append(d)
    related = [[sorted(set(r)) for r in rows] for rows in related]  # a 2-cycle names a word twice
    A = max([len(r) for rows in related for r in rows] + [1])
    out = torch.full((B, W, A), -1, dtype=torch.long)
    for b in range(B):
        for i, keys in enumerate(related[b]):
            if keys:
                out[b, i, :len(keys)] = torch.tensor(keys, dtype=torch.long)
    return out


def test_related_words_equal_the_loop(tmp_path):
    side = _side(tmp_path)
    assert torch.equal(_related_words(side), _related_by_loop(side.heads))
    g = torch.Generator().manual_seed(0)
    for trial in range(20):  # random governors: repeats, 2-cycles, self-loops, roots and padding
        B, W = 1 + trial % 3, 1 + trial % 7 * 3
        heads = torch.randint(-1, W, (B, W), generator=g)
        other = replace(side, heads=heads)  # a fresh batch: nothing cached
        assert torch.equal(_related_words(other), _related_by_loop(heads)), heads
    empty = replace(side, heads=torch.full((2, 4), -1))
    assert torch.equal(_related_words(empty), torch.full((2, 4, 1), -1))


def test_cached_batch_decisions_equal_fresh_ones(tmp_path):
    side = _side(tmp_path)
    W, T = side.max_words, side.token_word.shape[1]
    assert (side.min_words, side.max_words) == (int(side.n_words.min()), int(side.n_words.max()))
    for start in range(W + 2):
        for stop in range(start, W + 3):
            assert side.words_real(start, stop) == bool(side.word_mask[:, start:stop].all()), (start, stop)
    g = torch.Generator().manual_seed(1)
    for level, mask, width in (("token", side.token_mask, T), ("word", side.word_mask, W)):
        for n in range(width + 1):
            keep = mask[:, :n]
            assert key_range(side, level, n) == kept_range(keep)
            x = torch.rand(len(keep), 2, 3, n, generator=g)
            x[..., n // 2:] = x[..., :1]  # ties: the first position wins
            if n:
                best, where = _masked_max(x, keep, key_range(side, level, n))
                reference = first_max(x.masked_fill(~keep[:, None, None, :], -1.0))
                assert torch.equal(best, reference[0]) and torch.equal(where, reference[1])
    # the keys each query reaches: once per batch, as each view computed them
    positions = torch.arange(W)
    for causal in (False, True):
        words = (positions[None, :] + 1).clamp(max=side.n_words[:, None]) if causal else \
            side.n_words[:, None].expand(-1, W)
        words = words * side.word_mask
        mask = side.token_mask.long()
        tokens = (mask.cumsum(1) if causal else mask.sum(1, keepdim=True).expand_as(mask)) * mask
        for level, expected in (("word", words), ("token", tokens)):
            visible, two = reachable_keys(side, level, causal)
            assert torch.equal(visible, expected) and torch.equal(two, expected >= 2)


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_word_pairs_from_the_cache_equal_the_word_rows(tmp_path, rows):
    """Every layer of a batch reads the same cached arc columns: with other probabilities each time
    (several layers), in chunks of ``rows`` query rows, under a causal mask's key prefixes too,
    the pairs' weights are those of the word rows."""
    side = _side(tmp_path)
    B, T = side.token_ids.shape
    related = _related_words(side)
    g = torch.Generator().manual_seed(2)
    for layer in range(3):
        block = FakeBlock("enc_self", layer, 2)
        probs = torch.randn(B, 2, T, T, generator=g, dtype=torch.float64).softmax(-1)
        whole = AttentionView(block, probs, side)
        held = related >= 0
        expected = whole.words.gather(3, related.clamp(min=0)[:, None].expand(-1, 2, -1, -1)) * held[:, None]
        for start in range(0, T, rows):
            for keys in sorted({T, min(T, start + rows + 1)}):  # all keys; a causal chunk's prefix
                chunk = probs[:, :, start:start + rows, :keys].clone()
                if keys < T:  # the weights beyond the prefix are 0 (as the chunked attention holds them)
                    chunk = chunk / chunk.sum(-1, keepdim=True)
                view = FusedView(block, chunk, side, start=start, last=start + rows >= T)
                got = view.word_pairs(related)
                rows_held = slice(view.word_start, view.word_stop)
                if keys == T:
                    assert torch.equal(got, expected[:, :, rows_held]), (layer, start)
                else:
                    o = view.offset
                    K = view._word_columns
                    index = related[:, rows_held]
                    inside = (index >= 0) & (index < K)
                    columns = (index.clamp(0, max(K - 1, 0)) + o).clamp(max=keys - 1)
                    block_rows = chunk[:, :, view._rows]
                    fresh = block_rows.gather(3, columns[:, None].expand(-1, 2, -1, -1)) * inside[:, None]
                    assert torch.equal(got, fresh), (layer, start, keys)


class _Asked(TorchDispatchMode):
    """Counts the operators that read a tensor's value on the host (a wait for a GPU)."""

    READS = {"item", "_local_scalar_dense", "is_nonzero", "nonzero", "bincount", "unique", "equal"}

    def __init__(self) -> None:
        super().__init__()
        self.reads: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.READS:
            self.reads[name] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_chunks_after_the_first_layer_ask_the_tensors_nothing(tmp_path, monkeypatch, family):
    """What a chunk's statistics decide from the batch is decided once (the first layer's chunks):
    every later layer's chunks make no host read of a tensor, and the results are the chunked
    reference's, at several chunk sizes."""
    path = tmp_path / "tb.conllu"
    path.write_text(SAMPLE_CONLLU, encoding="utf-8")
    tokenizer = word_tokenizer()
    later: collections.Counter = collections.Counter()
    chunks = collections.Counter()
    feed = analysis_module._Feeder.on_fused_chunk

    def watched(self, block, chunk):
        if block.layer == 0:
            return feed(self, block, chunk)
        with _Asked() as asked:
            feed(self, block, chunk)
        later.update(asked.reads)
        chunks[block.layer] += 1

    monkeypatch.setattr(analysis_module._Feeder, "on_fused_chunk", watched)
    counts = np.arange(tokenizer.vocab_size, dtype=np.int64) % 5 + 1
    for rows in (1, 4):
        results = {}
        for engine in ("fused", "chunked"):
            model = tiny_model(family, attn_implementation="sdpa").double()
            config = AnalysisConfig(batch_size=2, top_frequent=3, window=4, top_k=3, engine=engine, query_chunk=rows,
                                    sensitivity=True)
            analysis = analyze_heads(model, tokenizer, path, config=config,
                                     frequencies=TokenFrequencies(counts, "hand-set"))
            results[engine] = _written(analysis.results.values(), tmp_path / f"{engine}{rows}")
        _assert_close(results["fused"], results["chunked"], atol=1e-8)
    assert chunks and sum(chunks.values()) > 8  # later layers were watched
    assert not later, dict(later)


def test_fused_chunks_on_a_cuda_gpu_default_to_more_rows(monkeypatch):
    """Without ``--query-chunk`` the fused engine takes FUSED_CUDA_QUERY_CHUNK rows on a CUDA GPU (fewer
    chunks: each costs the host a fixed number of kernel launches); elsewhere, with ``--query-chunk``
    and under the chunked engine, the rows are those of before."""
    from headlab.adapters import attention_blocks
    from headlab.functions.config import FUSED_CUDA_QUERY_CHUNK, FUSED_QUERY_CHUNK

    assert FUSED_CUDA_QUERY_CHUNK == 2 * FUSED_QUERY_CHUNK
    assert AnalysisConfig().chunk_rows_on("cuda") == FUSED_CUDA_QUERY_CHUNK
    assert AnalysisConfig().chunk_rows_on("cpu") == FUSED_QUERY_CHUNK == AnalysisConfig().chunk_rows
    assert AnalysisConfig(query_chunk=64).chunk_rows_on("cuda") == 64
    assert AnalysisConfig(engine="chunked").chunk_rows_on("cuda") == FUSED_QUERY_CHUNK
    model = tiny_model("llama")
    asked = {}
    monkeypatch.setattr(analysis_module, "stream_attention", lambda model, callback, **kwargs: asked.update(kwargs))
    for device, engine, rows in (("cuda", None, FUSED_CUDA_QUERY_CHUNK), ("cpu", None, FUSED_QUERY_CHUNK),
                                 ("cuda", "chunked", FUSED_QUERY_CHUNK)):
        feeder = analysis_module._Feeder({}, {}, analysis_module.RunReport(), torch.device(device))
        feeder.capture(model, AnalysisConfig(engine=engine), attention_blocks(model))
        assert asked["query_chunk"] == rows, (device, engine)
