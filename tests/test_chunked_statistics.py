"""Statistics fed in query chunks equal the same statistics fed whole maps.

Two levels: every registered statistic fed the same probabilities as one view and as
:class:`WordRows` views of a few rows (exact), and ``analyze_heads`` with ``query_chunk``
(headlab's registered attention) against the eager capture on tiny models (to 1e-8, in float64).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from headlab.data.alignment import AttentionView, WordRows
from headlab.data.frequencies import TokenFrequencies
from headlab.errors import HeadlabError
from headlab.functions import AnalysisConfig, analyze_heads
from headlab.functions.registry import STATISTICS
from support.models import tiny_model
from support.treebank import SAMPLE_CONLLU, FakeBlock, bpe_tokenizer, sample_sentences, side_batch

pytestmark = pytest.mark.unit

H = 3


def _random_probs(side, seed, causal):
    g = torch.Generator().manual_seed(seed)
    B, T = side.token_ids.shape
    probs = torch.zeros(B, H, T, T)
    for b, n in enumerate(side.lengths):
        logits = torch.randn(H, n, n, generator=g) * 3
        if causal:
            logits = logits.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        probs[b, :, :n, :n] = logits.softmax(-1)
    return probs


def _statistics(tokenizer, pooling="sum"):
    counts = np.arange(tokenizer.vocab_size, dtype=np.int64) % 7 + 1
    config = AnalysisConfig(top_frequent=3, window=4, top_k=3, sensitivity=True, word_pooling=pooling)
    frequencies = TokenFrequencies(counts, "hand-set")
    return {name: make(config, frequencies) for name, make in STATISTICS.items()}


def _written(results, directory):
    """Every file the results write (any registered statistic), parsed: ``{relative path: JSON}``."""
    import json

    for result in results:
        result.write(directory)
    return {str(path.relative_to(directory)): json.loads(path.read_text(encoding="utf-8"))
            for path in sorted(directory.rglob("*.json"))}


def _assert_close(a, b, path="", rtol=0.0):
    """Equal structure, equal counts and positions, floats to 1e-8 (and ``rtol``)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            _assert_close(a[key], b[key], f"{path}/{key}", rtol)
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_close(x, y, f"{path}/{i}", rtol)
    elif isinstance(a, float):
        assert (np.isnan(a) and np.isnan(b)) or abs(a - b) <= 1e-8 + rtol * abs(b), (path, a, b)
    else:
        assert a == b, (path, a, b)


@pytest.mark.parametrize("kind", ["enc_self", "dec_self"])
@pytest.mark.parametrize("rows, pooling", [(1, "sum"), (2, "sum"), (5, "sum"), (2, "first"), (2, "max"), (5, "max")])
def test_views_of_chunks_equal_the_whole_view(tmp_path, kind, rows, pooling):
    sentences = sample_sentences(tmp_path)
    tokenizer = bpe_tokenizer([" ".join(s.words) for s in sentences] * 3, vocab_size=45)
    batches = []
    for start, seed in ((0, 1), (2, 2), (1, 3)):
        side, _ = side_batch(sentences[start:start + 2], tokenizer, start)
        side.pooling = pooling
        batches.append((side, _random_probs(side, seed, kind == "dec_self")))
    assert any(side.word_sizes.max() > 1 for side, _ in batches)  # words of several subwords
    whole, chunked = _statistics(tokenizer, pooling), _statistics(tokenizer, pooling)
    for layer in range(2):
        block = FakeBlock(kind, layer, H)
        for side, probs in batches:
            for stats in (whole, chunked):
                for stat in stats.values():
                    if hasattr(stat, "update_side") and layer == 0:
                        stat.update_side(kind, side)
            view = AttentionView(block, probs, side)
            for stat in whole.values():
                stat.update(view)
            T = probs.shape[2]
            words = WordRows(block, side)
            handed = []
            for start in range(0, T, rows):
                part = words.view(probs[:, :, start:start + rows], start, start + rows >= T)
                handed.append((part.word_start, part.word_stop))
                for stat in chunked.values():
                    stat.update(part)
            assert handed[0][0] == 0 and handed[-1][1] == side.max_words
            assert all(a[1] == b[0] for a, b in zip(handed, handed[1:]))  # each word row once, in order
            torch.testing.assert_close(view.words, torch.cat([
                WordRows(block, side).view(probs, 0, True).words]), atol=0, rtol=0)
    files = {}
    for name, stats in (("whole", whole), ("chunked", chunked)):
        files[name] = _written([stat.result() for stat in stats.values()], tmp_path / name)
        stats["aggregate"].close()
    assert len(files["whole"]) > 10 and files["chunked"] == files["whole"]  # to the bit


TOKENIZER_TEXTS = [line[len("# text = "):] for line in SAMPLE_CONLLU.splitlines() if line.startswith("# text = ")]


def _analyse(family, tmp_path, query_chunk, target):
    tokenizer = bpe_tokenizer(TOKENIZER_TEXTS * 3, vocab_size=45)
    model = tiny_model(family, attn_implementation="sdpa").double()
    path = tmp_path / "tb.conllu"
    path.write_text(SAMPLE_CONLLU, encoding="utf-8")
    counts = np.arange(tokenizer.vocab_size, dtype=np.int64) % 5 + 1
    config = AnalysisConfig(batch_size=3, top_frequent=3, window=4, top_k=3, query_chunk=query_chunk, sensitivity=True)
    return analyze_heads(model, tokenizer, path, target_conllu=path if target else None, config=config,
                         frequencies=TokenFrequencies(counts, "hand-set"))


# Llama's eager softmax runs in float32 whatever the model's dtype (the chunked one in float64 here):
# its statistics agree to float32 rounding, the others' to 1e-8.
@pytest.mark.parametrize("family, target, rtol", [("marian", True, 0), ("bert", False, 0), ("gpt2", False, 0),
                                                  ("llama", False, 1e-6)])
def test_analyze_with_query_chunks_equals_eager(tmp_path, family, target, rtol):
    eager = _analyse(family, tmp_path, None, target)
    assert set(eager.results) == set(STATISTICS)
    expected = _written(eager.results.values(), tmp_path / "eager")
    for query_chunk in (2, 3):
        chunked = _analyse(family, tmp_path, query_chunk, target)
        _assert_close(_written(chunked.results.values(), tmp_path / f"chunked{query_chunk}"), expected, rtol=rtol)


def test_query_chunk_must_be_positive():
    for bad in (0, -1):
        with pytest.raises(HeadlabError, match="--query-chunk must be at least 1"):
            AnalysisConfig(query_chunk=bad)
