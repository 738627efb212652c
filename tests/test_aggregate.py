"""Every Vig & Belinkov statistic against a direct computation written here, on a few sentences."""

import math

import numpy as np
import pytest
import torch

from headlab.aggregate import POS_TAGS, AggregateStats
from headlab.data.alignment import AttentionView
from support.treebank import FakeBlock, bpe_tokenizer, sample_sentences, side_batch

H = 3


def _random_probs(side, seed):
    """Random attention over each sentence's real tokens (EOS included), zero on padding."""
    g = torch.Generator().manual_seed(seed)
    B, T = side.token_ids.shape
    probs = torch.zeros(B, H, T, T)
    for b, n in enumerate(side.lengths):
        logits = torch.randn(H, n, n, generator=g) * 3  # peaked enough for varied maxima
        probs[b, :, :n, :n] = logits.softmax(-1)
    return probs


def _words_direct(probs, alignment, b, h):
    """Word attention by loops: mean over the query word's subwords of the sum over the key's."""
    owner = alignment.word_of_token.tolist()
    n = alignment.n_words
    out = np.zeros((n, n))
    for i in range(n):
        queries = [t for t, w in enumerate(owner) if w == i]
        for j in range(n):
            keys = [t for t, w in enumerate(owner) if w == j]
            out[i, j] = sum(float(probs[b, h, q, k]) for q in queries for k in keys) / len(queries)
    return out


@pytest.fixture
def setup(tmp_path):
    sentences = sample_sentences(tmp_path)
    tokenizer = bpe_tokenizer([" ".join(s.words) for s in sentences] * 3, vocab_size=45)
    batches = []
    for start, seed in ((0, 1), (2, 2)):
        side, alignments = side_batch(sentences[start:start + 2], tokenizer, start)
        batches.append((side, alignments, _random_probs(side, seed), sentences[start:start + 2]))
    return batches


def _run(batches, **options):
    stats = AggregateStats(**options)
    for side, _, probs, _ in batches:
        stats.update_side("enc_self", side)
        stats.update(AttentionView(FakeBlock("enc_self", 1, H), probs, side))
    result = stats.result()
    stats.close()
    return result


def _direct(batches, min_weight=0.0, window=7, top_k=3):
    per_head = []
    for h in range(H):
        mats = []  # (sentence index, words matrix, sentence)
        for side, alignments, probs, sentences in batches:
            for b, (alignment, sentence) in enumerate(zip(alignments, sentences)):
                mats.append((side.sentence_index[b], _words_direct(probs, alignment, b, h), sentence))
        weight = distance = arcs = 0.0
        pos = dict.fromkeys(POS_TAGS, 0.0)
        entropies = []
        for _, m, sentence in mats:
            n = m.shape[0]
            arc = {(g, d) for d, g in enumerate(sentence.heads) if g >= 0}
            for i in range(n):
                for j in range(n):
                    a = m[i, j]
                    if a > min_weight:
                        weight += a
                        distance += a * abs(i - j)
                        pos[sentence.upos[j]] += a
                        arcs += a if ((i, j) in arc or (j, i) in arc) else 0.0
                row = m[i]
                if row.sum() > 0:
                    p = row / row.sum()
                    entropies.append(-sum(x * math.log(x) for x in p if x > 0))
        # Variability over the first `window` words: mean of each cell over the sentences that have it.
        cells = {}
        for _, m, _ in mats:
            n = min(window, m.shape[0])
            for i in range(n):
                for j in range(n):
                    cells.setdefault((i, j), []).append(m[i, j])
        numerator = sum(abs(v - np.mean(vs)) for vs in cells.values() for v in vs)
        denominator = 2 * sum(v for vs in cells.values() for v in vs)
        everything = sorted(((m[i, j], s, i, j) for s, m, _ in mats
                             for i in range(m.shape[0]) for j in range(m.shape[0])), reverse=True)
        best_per_sentence, seen = [], set()
        for value, s, i, j in everything:  # each sentence's strongest weight
            if s not in seen:
                seen.add(s)
                best_per_sentence.append((value, s, i, j))
        per_head.append({
            "mean_distance": distance / weight,
            "dependency_alignment": arcs / weight,
            "mean_entropy": float(np.mean(entropies)),
            "variability": numerator / denominator,
            "pos": {tag: value / weight for tag, value in pos.items()},
            "exemplars": best_per_sentence[:top_k],
        })
    return per_head


@pytest.mark.parametrize("min_weight", [0.0, 0.2])
def test_every_statistic_matches_a_direct_computation(setup, min_weight):
    result = _run(setup, min_weight=min_weight, window=7, top_k=3)
    direct = _direct(setup, min_weight=min_weight, window=7, top_k=3)
    for name in ("mean_distance", "dependency_alignment", "mean_entropy", "variability"):
        scores = result.scores[name]["enc_self"]
        assert scores.shape == (2, H) and np.isnan(scores[0]).all()  # layer 0 not analysed
        assert np.allclose(scores[1], [d[name] for d in direct], rtol=1e-5, atol=1e-6), name
    for tag in POS_TAGS:
        assert np.allclose(result.pos[tag]["enc_self"][1], [d["pos"][tag] for d in direct], atol=1e-6), tag
    shares = sum(result.pos[tag]["enc_self"][1] for tag in POS_TAGS)
    assert np.allclose(shares, 1.0)
    for h in range(H):
        got = [(e.weight, e.sentence, e.query, e.key) for e in result.exemplars[("enc_self", 1)][h]]
        expected = direct[h]["exemplars"]
        assert [g[1:] for g in got] == [e[1:] for e in expected]
        assert np.allclose([g[0] for g in got], [e[0] for e in expected], atol=1e-6)


def test_exemplars_carry_words_and_where(setup):
    result = _run(setup, top_k=2)
    exemplar = result.exemplars[("enc_self", 1)][0][0]
    record = exemplar.to_json()
    assert record["text"] == " ".join(exemplar.words) and record["sent_id"].startswith("s")
    assert record["query_word"] == exemplar.words[exemplar.query]
    assert ":" in record["where"]


def test_pos_frequency_baseline_and_save(setup, tmp_path):
    result = _run(setup)
    words = [tag for _, _, _, sentences in setup for s in sentences for tag in s.upos]
    assert result.pos_frequency["enc_self"]["NOUN"] == pytest.approx(words.count("NOUN") / len(words))
    paths = result.save(tmp_path / "aggregate")
    names = {p.relative_to(tmp_path / "aggregate").as_posix() for p in paths}
    assert {"mean_distance.json", "variability.json", "pos/NOUN.json", "exemplars.json"} <= names
    from headlab.heads import HeadScores

    again = HeadScores.load(tmp_path / "aggregate" / "mean_entropy.json")
    assert np.allclose(again["enc_self"][1], result.scores["mean_entropy"]["enc_self"][1])
    assert "| mean_distance | enc_self |" in result.summary_markdown()


def test_state_does_not_grow_with_the_number_of_batches(setup):
    """Streaming: after the first batch, more batches add no state in memory (the variability
    window goes to a temporary file)."""

    def state_bytes(stats):
        total = 0
        for sums in stats.sums.values():
            total += sum(t.numel() * t.element_size() for t in sums.values())
        total += sum(len(heap) for heaps in stats.heaps.values() for heap in heaps)
        return total

    side, _, probs, _ = setup[0]
    stats = AggregateStats(top_k=2)
    sizes = []
    for _ in range(6):
        stats.update(AttentionView(FakeBlock("enc_self", 0, H), probs, side))
        sizes.append(state_bytes(stats))
    stats.close()
    assert len(set(sizes[1:])) == 1


def test_one_word_sentences_are_not_exemplars(tmp_path):
    from support.treebank import word_tokenizer
    class S:
        def __init__(self, words):
            self.words, self.heads = words, (-1,) + (0,) * (len(words) - 1)
            self.deprels, self.upos = ("root",) + ("dep",) * (len(words) - 1), ("X",) * len(words)
            self.sent_id, self.where = "-".join(words), ""

    sentences = [S(("hello",)), S(("good", "morning"))]
    tokenizer = word_tokenizer(["hello", "good", "morning"])
    side, _ = side_batch(sentences, tokenizer)
    stats = AggregateStats(top_k=2)
    stats.update(AttentionView(FakeBlock("enc_self", 0, H), _random_probs(side, 3), side))
    result = stats.result()
    stats.close()
    for heap in result.exemplars[("enc_self", 0)]:
        assert [e.sent_id for e in heap] == ["good-morning"]


def test_repr_counts_one_sentence_and_one_tag_in_the_singular():
    """Regression: the repr said "(enc_self 1 sentences)" and "POS shares of 1 tags"."""
    from headlab.aggregate import AggregateResult

    one = AggregateResult(scores={}, pos={"NOUN": None}, exemplars={}, pos_frequency={},  # type: ignore[dict-item]
                          n_sentences={"enc_self": 1, "dec_self": 2})
    assert repr(one).startswith("AggregateResult (enc_self 1 sentence, dec_self 2 sentences): ; POS shares of 1 tag")


def test_a_statistic_undefined_for_every_head_is_said_in_the_summary(setup):
    """--min-weight above every weight leaves distance, POS and dependency alignment with nothing to
    divide by (NaN, null in JSON): the summary said nothing of them, their rows simply gone (audit33)."""
    result = _run(setup, min_weight=0.9999999)
    assert np.isnan(result.scores["mean_distance"]["enc_self"]).all()
    summary = result.summary_markdown()
    row = next(line for line in summary.splitlines() if line.startswith("| mean_distance | enc_self |"))
    assert "undefined for every head" in row and "--min-weight" in row
    assert "| dependency_alignment | enc_self | undefined |" in summary
    # Layer 0 is not analysed here: the heads with a value are said to be only some of them.
    entropy = next(line for line in summary.splitlines() if line.startswith("| mean_entropy |"))
    assert f"({H} of {2 * H} heads without a value" in entropy


def test_entropy_renormalises_a_row_whatever_its_word_mass(tmp_path):
    """A peaked head can leave a word 1e-35 of its attention (the rest on special tokens): its entropy is still that
    of the renormalised row, on the chunked and on the fused path. Before, the chunked path floored the mass at
    1e-30 and summed an unnormalised row there (a tiny Gemma 4 unified model, fused against chunked, 5.6e-5)."""
    from headlab.data.fused import FusedView, word_offset
    from test_fused_statistics import word_tokenizer

    sentences = sample_sentences(tmp_path)[:3]
    side, alignments = side_batch(sentences, word_tokenizer())
    offset = word_offset(side)
    assert offset is not None
    g = torch.Generator().manual_seed(3)
    B, T = side.token_ids.shape
    probs = torch.zeros(B, H, T, T, dtype=torch.float64)
    for b, n in enumerate(side.lengths):
        logits = torch.randn(H, n, n, generator=g, dtype=torch.float64) * 3
        logits[0, :, :offset] += 80.0  # head 0: all but ~1e-35 of every row on the special token before the words
        probs[b, :, :n, :n] = logits.softmax(-1)
    words = [_words_direct(probs, a, b, 0) for b, a in enumerate(alignments)]
    smallest = min(row.sum() for m in words for row in m)
    assert 0 < smallest < 1e-30
    entropies = [-sum(x * math.log(x) for x in row / row.sum() if x > 0) for m in words for row in m]
    block = FakeBlock("enc_self", 1, H)
    for view in (AttentionView(block, probs, side), FusedView(block, probs, side, start=0, last=True)):
        stats = AggregateStats(window=4, top_k=0)
        stats.update_side("enc_self", side)
        stats.update_fused(view) if isinstance(view, FusedView) else stats.update(view)
        got = stats.result().scores["mean_entropy"]["enc_self"][1][0]
        stats.close()
        assert got == pytest.approx(float(np.mean(entropies)), rel=1e-10), type(view).__name__
