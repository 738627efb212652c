"""Statistics fed in query chunks equal the same statistics fed whole maps.

Two levels: every registered statistic fed the same probabilities as one view and as
:class:`WordRows` views of a few rows (exact), and ``analyze_heads`` with ``query_chunk``
(headlab's registered attention) against the eager capture on tiny models (to 1e-8, in float64).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from headlab.data.alignment import AttentionView, WordRows, word_keys
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


def _assert_close(a, b, path="", rtol=0.0, atol=1e-8):
    """Equal structure, equal counts and positions, floats within ``atol`` + ``rtol`` relative."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            _assert_close(a[key], b[key], f"{path}/{key}", rtol, atol)
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_close(x, y, f"{path}/{i}", rtol, atol)
    elif isinstance(a, float):
        assert (np.isnan(a) and np.isnan(b)) or abs(a - b) <= atol + rtol * abs(b), (path, a, b)
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
    config = AnalysisConfig(batch_size=3, top_frequent=3, window=4, top_k=3, query_chunk=query_chunk, sensitivity=True,
                            engine="eager" if query_chunk is None else None)
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


# -- causal maps cut to the keys a chunk can see ---------------------------------------------
UPOS = ("NOUN", "VERB", "ADJ", "ADV", "DET", "ADP", "PRON", "PUNCT")
DEPRELS = ("nsubj", "obj", "amod", "advmod", "det", "case", "obl")
WORDS = ("the", "cat", "sat", "quietly", "on", "a", "warm", "mat", "while", "dogs", "barked", "outside",
         "and", "birds", "sang", "songs", "near", "trees")


def long_conllu(lengths, seed=0) -> str:
    """Sentences of the given word counts, random words and a random tree (each word governed by
    one of the five words before it): every statistic has arcs, tags and long rows to work on."""
    rng = np.random.default_rng(seed)
    lines = []
    for s, n in enumerate(lengths):
        lines += [f"# sent_id = long{s}", f"# text = {' '.join(['x'] * n)}"]
        for i in range(1, n + 1):
            head = 0 if i == 1 else int(rng.integers(max(1, i - 5), i))
            deprel = "root" if head == 0 else DEPRELS[int(rng.integers(len(DEPRELS)))]
            lines.append(f"{i}\t{WORDS[int(rng.integers(len(WORDS)))]}\t_\t{UPOS[int(rng.integers(len(UPOS)))]}"
                         f"\t_\t_\t{head}\t{deprel}\t_\t_")
        lines.append("")
    return "\n".join(lines) + "\n"


def _causal_probs(side, seed):
    """Causal softmax maps, right padding: a padding query row sees the sentence's tokens (as
    transformers' causal + padding mask gives it); returns ``(probs, hidden [B, 1, T, T])``."""
    g = torch.Generator().manual_seed(seed)
    B, T = side.token_ids.shape
    position = torch.arange(T)
    hidden = torch.stack([(position[None, :] > position[:, None]) | (position[None, :] >= n)
                          for n in side.lengths])[:, None]
    logits = (torch.randn(B, H, T, T, generator=g) * 3).masked_fill(hidden, torch.finfo(torch.float32).min)
    return logits.softmax(-1), hidden


@pytest.mark.parametrize("pooling, query_chunk, whole_first", [
    ("sum", 37, False), ("sum", 64, False), ("first", 37, False), ("max", 50, False), ("sum", 37, True),
    ("max", 37, True)])
def test_views_cut_to_the_visible_keys_equal_the_whole_view(tmp_path, pooling, query_chunk, whole_first):
    """Causal chunks hold only the keys their rows see (headlab.attention.visible_keys); fed as
    WordRows views, every statistic writes what the whole, uncut view gives: counts, offsets
    and argmax decisions identical, float64 sums to 1e-12 (they add the same float32 weights
    in another order). With ``whole_first`` the first chunk holds every key (as one with a
    fully hidden row does), so a word row it begins is wider than the next chunk's."""
    from headlab.attention import KEY_BLOCK, visible_keys
    from headlab.data.treebank import read_conllu

    path = tmp_path / "long.conllu"
    path.write_text(long_conllu([150, 97, 121, 40]), encoding="utf-8")
    sentences = list(read_conllu(path))
    tokenizer = bpe_tokenizer([" ".join(s.words) for s in sentences], vocab_size=40)
    batches = []
    for start, seed in ((0, 1), (2, 2)):
        side, _ = side_batch(sentences[start:start + 2], tokenizer, start)
        side.pooling = pooling
        assert side.word_sizes.max() > 1 and side.token_ids.shape[1] > 2 * KEY_BLOCK
        batches.append((side, *_causal_probs(side, seed)))
    whole, cut = _statistics(tokenizer, pooling), _statistics(tokenizer, pooling)
    narrowed = wider = 0
    for layer in range(2):
        block = FakeBlock("dec_self", layer, H)
        for side, probs, hidden in batches:
            for stats in (whole, cut):
                for stat in stats.values():
                    if hasattr(stat, "update_side") and layer == 0:
                        stat.update_side("dec_self", side)
            view = AttentionView(block, probs, side)
            for stat in whole.values():
                stat.update(view)
            T = probs.shape[2]
            words = WordRows(block, side)
            for start in range(0, T, query_chunk):
                stop = min(start + query_chunk, T)
                keys = T if whole_first and start == 0 else visible_keys(hidden[:, :, start:stop], False, stop, T)
                assert torch.all(probs[:, :, start:stop, keys:] == 0)
                narrowed += keys < T
                carried = words.pending is not None and words.pending.shape[3] > word_keys(side, keys)
                wider += carried
                part = words.view(probs[:, :, start:stop, :keys], start, stop == T)
                assert part.words.shape[3] <= side.max_words
                for stat in cut.values():
                    stat.update(part)
    assert narrowed >= 4 and (wider > 0) == whole_first
    files = {}
    for name, stats in (("whole", whole), ("cut", cut)):
        files[name] = _written([stat.result() for stat in stats.values()], tmp_path / name)
        stats["aggregate"].close()
    assert len(files["whole"]) > 10 and files["cut"].keys() == files["whole"].keys()
    for name, written in files["whole"].items():
        if name in REORDERED_SUMS or name.startswith("aggregate/pos/"):
            _assert_close(files["cut"][name], written, name, rtol=1e-12, atol=0.0)  # no absolute slack
        else:
            assert files["cut"][name] == written, name  # to the bit


REORDERED_SUMS = ("aggregate/mean_distance.json", "aggregate/dependency_alignment.json")
"""Aggregate statistics whose float64 totals sum each view's weights over (sentence, row, key)
at once: over fewer keys the same float32 weights are added in another order."""


def test_analyze_long_causal_sentences_with_query_chunks_equals_eager(tmp_path):
    """``analyze_heads`` on a decoder-only model (grouped-query Llama, float64) over sentences of
    several KEY_BLOCKs of tokens, batched (right padding), with chunks of 48 rows (a divisor of
    no length): every chunk but the last ones of a sentence is cut to its visible keys, and the
    results are eager's (to float32 rounding: Llama's eager softmax runs in float32)."""
    import transformers as tf

    from support.models import VOCAB

    path = tmp_path / "long.conllu"
    path.write_text(long_conllu([150, 97, 121], seed=4), encoding="utf-8")
    tokenizer = bpe_tokenizer([line for line in long_conllu([150, 97, 121], seed=4).splitlines()], vocab_size=45)
    config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                            bos_token_id=0, eos_token_id=1, pad_token_id=2)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(config).eval().double()
    counts = np.arange(tokenizer.vocab_size, dtype=np.int64) % 5 + 1
    written = {}
    for query_chunk in (None, 48):
        analysis = analyze_heads(model, tokenizer, path, frequencies=TokenFrequencies(counts, "hand-set"),
                                 config=AnalysisConfig(batch_size=2, top_frequent=3, window=4, top_k=3,
                                                       query_chunk=query_chunk, sensitivity=True,
                                                       engine="eager" if query_chunk is None else None))
        assert analysis.report.n_tokens > 3 * 128 and analysis.report.n_truncated == 0
        written[query_chunk] = _written(analysis.results.values(), tmp_path / str(query_chunk))
    _assert_close(written[48], written[None], rtol=1e-6)
