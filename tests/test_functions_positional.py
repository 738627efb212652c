"""Positional heads (Voita et al. 2019, Sec. 5.1) on hand-set attention patterns."""

import numpy as np
import torch

from headlab.adapters import attention_blocks
from headlab.data.alignment import AttentionView
from headlab.functions import AnalysisConfig, PositionalStats, analyze_heads
from headlab.functions.positional import POSITIONAL_INTERIOR
from support.models import tiny_model
from support.treebank import (
    FakeBlock,
    ForcedAttention,
    bpe_tokenizer,
    force_word_targets,
    sample_sentences,
    side_batch,
    token_pattern,
    uniform_probs,
    word_tokenizer,
)


def _offset_targets(side, offset):
    return [[(i + offset) if 0 <= i + offset < n else None for i in range(n)] for n in side.n_words.tolist()]


def test_previous_word_head_is_positional_at_minus_one(tmp_path):
    sentences = sample_sentences(tmp_path)
    tokenizer = word_tokenizer([w for s in sentences for w in s.words])
    side, _ = side_batch(sentences, tokenizer)
    probs = uniform_probs(side, 4)
    probs = force_word_targets(probs, side, 0, _offset_targets(side, -1))  # i-1; first word -> EOS
    probs = force_word_targets(probs, side, 1, _offset_targets(side, +1))  # i+1; last word -> EOS
    probs = force_word_targets(probs, side, 3, [[i for i in range(n)] for n in side.n_words.tolist()])  # self
    stats = PositionalStats(max_offset=4)
    stats.update(AttentionView(FakeBlock("enc_self", 0, 4), probs, side))
    result = stats.result(threshold=0.9)
    heads = {(h.head): (h.offset, h.share) for h in result.heads()}
    assert heads == {0: (-1, 1.0), 1: (1, 1.0), 3: (0, 1.0)}  # uniform head 2 is not positional
    assert result.offset["enc_self"][0].tolist()[:2] == [-1.0, 1.0]
    # Words whose attention goes all to EOS have no maximum among words and are not counted.
    n_words = int(side.n_words.sum())
    assert result.counts[("enc_self", 0)][0].sum() == n_words - len(sentences)
    assert result.counts[("enc_self", 0)][2].sum() == n_words


def test_threshold_is_configurable_and_share_is_exact(tmp_path):
    sentences = sample_sentences(tmp_path)
    tokenizer = word_tokenizer([w for s in sentences for w in s.words])
    side, _ = side_batch(sentences, tokenizer)
    targets = _offset_targets(side, -1)
    targets[0][3] = 0  # one word of 26 counted ones breaks the pattern
    probs = force_word_targets(uniform_probs(side, 1), side, 0, targets)
    stats = PositionalStats()
    stats.update(AttentionView(FakeBlock("enc_self", 0, 1), probs, side))
    counted = int(side.n_words.sum()) - len(sentences)
    expected = (counted - 1) / counted
    assert np.isclose(stats.result(0.9).share["enc_self"][0, 0], expected)
    assert len(stats.result(0.9).heads()) == 1
    assert stats.result(0.99).heads() == []


def test_subword_tokens_collapse_to_words(tmp_path):
    sentences = sample_sentences(tmp_path)
    tokenizer = bpe_tokenizer([" ".join(s.words) for s in sentences] * 3, vocab_size=45)
    side, alignments = side_batch(sentences, tokenizer)
    assert any(len(a.input_ids) > a.n_words + 1 for a in alignments)  # some words have several subwords
    probs = force_word_targets(uniform_probs(side, 2), side, 0, _offset_targets(side, -1))
    words, tokens = PositionalStats(level="word"), PositionalStats(level="token")
    view = AttentionView(FakeBlock("enc_self", 2, 2), probs, side)
    words.update(view)
    tokens.update(view)
    (head,) = words.result(0.9).heads()
    assert (head.layer, head.head, head.offset, head.share) == (2, 0, -1, 1.0)
    assert tokens.result(0.9).heads() == []  # at token level the jumps differ in length


def test_streams_over_batches_and_blocks(tmp_path):
    sentences = sample_sentences(tmp_path)
    tokenizer = word_tokenizer([w for s in sentences for w in s.words])
    stats = PositionalStats()
    for start in (0, 2):
        side, _ = side_batch(sentences[start:start + 2], tokenizer, start)
        probs = force_word_targets(uniform_probs(side, 2), side, 1, _offset_targets(side, +1))
        for layer in range(3):
            stats.update(AttentionView(FakeBlock("enc_self", layer, 2), probs, side))
    result = stats.result()
    assert result.share["enc_self"].shape == (3, 2)
    assert {(h.layer, h.head, h.offset) for h in result.heads()} == {(0, 1, 1), (1, 1, 1), (2, 1, 1)}


def test_forced_head_in_a_real_model_is_found(sample_path):
    sentences = sample_sentences(sample_path.parent)
    tokenizer = word_tokenizer([w for s in sentences for w in s.words])
    model = tiny_model("marian")
    block = [b for b in attention_blocks(model) if b.kind == "enc_self"][1]

    def previous(row, t):  # i-1; the first word and EOS attend to EOS
        return t - 1 if 0 < t < len(row) - 1 else len(row) - 1

    pattern = lambda ids, T: token_pattern(ids, T, tokenizer.pad_token_id, previous)  # noqa: E731
    model.train()  # the analysis runs in eval mode (no attention dropout) and gives the mode back
    with ForcedAttention(model, block, 2, pattern):
        analysis = analyze_heads(model, tokenizer, sample_path,
                                 config=AnalysisConfig(aggregate=False, batch_size=3, engine="eager"))
    assert model.training
    found = [(h.kind, h.layer, h.head, h.offset, h.share) for h in analysis.positional.heads()]
    assert found == [("enc_self", 1, 2, -1, 1.0)]
    assert analysis.report.n_sentences == 4
    assert set(analysis.positional.share.kinds) == {"enc_self"}
    assert torch.isfinite(torch.tensor(analysis.positional.share["enc_self"])).all()


def test_interior_reading_counts_only_words_with_both_neighbours(tmp_path):
    """A previous-word head whose first word looks at itself: 1 - 1/n of all words at -1, every
    word with both neighbours at -1 (the sensitivity reading of --sensitivity)."""
    sentences = sample_sentences(tmp_path)
    tokenizer = word_tokenizer([w for s in sentences for w in s.words])
    side, _ = side_batch(sentences, tokenizer)
    targets = [[max(i - 1, 0) if i != 0 else 0 for i in range(n)] for n in side.n_words.tolist()]
    probs = force_word_targets(uniform_probs(side, 1), side, 0, targets)
    every, interior = PositionalStats(max_offset=4), PositionalStats(max_offset=4, level="interior")
    for stats in (every, interior):
        stats.update(AttentionView(FakeBlock("enc_self", 0, 1), probs, side))
    n_words = side.n_words.tolist()
    assert np.isclose(every.result().share["enc_self"][0, 0], 1 - len(n_words) / sum(n_words))
    assert interior.result().share["enc_self"][0, 0] == 1.0
    assert interior.counts[("enc_self", 0)].sum() == sum(n - 2 for n in n_words)
    assert interior.result().labels() == {} and interior.result().describe_heads() == []
    assert POSITIONAL_INTERIOR(AnalysisConfig()) is None  # only with sensitivity (its own option)
    assert POSITIONAL_INTERIOR(AnalysisConfig(sensitivity=True)).level == "interior"


def test_no_query_counted_is_said_undefined_not_no_positional_head():
    """One-word sentences: no query is counted, every share NaN (null). The summary said "No head reaches the
    threshold." over an empty closest list, and the command printed no positional line (audit33)."""
    from headlab.functions.positional import PositionalResult

    result = PositionalResult(counts={("enc_self", 0): np.zeros((4, 2 * 3 + 3), dtype=np.int64)}, max_offset=3,
                              threshold=0.9)
    assert np.isnan(result.share["enc_self"]).all() and result.heads() == []
    text = "\n".join(result.markdown())
    assert "No head reaches the threshold" not in text and "Every head undefined: no query was counted" in text
    assert result.describe_heads() == [f"positional  {PositionalResult.UNDEFINED}"]
