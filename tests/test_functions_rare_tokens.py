"""Rare-token heads (Voita et al. 2019, Sec. 5.3) and token frequencies."""

import gzip

import numpy as np
import pytest
import torch

from headlab.adapters import attention_blocks
from headlab.data.alignment import AttentionView
from headlab.data.frequencies import TokenFrequencies
from headlab.errors import HeadlabError
from headlab.functions import AnalysisConfig, RareTokenStats, analyze_heads
from support.models import tiny_model
from support.treebank import (
    FakeBlock,
    ForcedAttention,
    sample_sentences,
    side_batch,
    token_pattern,
    uniform_probs,
    word_tokenizer,
)


def _frequencies(tokenizer):
    """Distinct counts: higher ids are rarer; special tokens count 0 (never in the top)."""
    n = len(tokenizer)
    counts = np.array([0 if i < 3 else 1000 - i for i in range(n)])
    return TokenFrequencies(counts, "hand-set")


def _probs_onto(side, probs, head, choose):
    """Every real token of each sentence attends to ``choose(b)`` (a token position)."""
    probs = probs.clone()
    for b, n in enumerate(side.lengths):
        probs[b, head, :n, :] = 0
        probs[b, head, :n, choose(b)] = 1.0
    return probs


def _positions_by_rarity(side, frequencies):
    out = []
    for b, n in enumerate(side.lengths):
        real = [t for t in range(n) if side.token_word[b, t] >= 0]
        out.append(sorted(real, key=lambda t: frequencies.counts[int(side.token_ids[b, t])]))
    return out


def test_head_on_the_rarest_token_is_found(tmp_path):
    sentences = sample_sentences(tmp_path)
    tokenizer = word_tokenizer([w for s in sentences for w in s.words])
    frequencies = _frequencies(tokenizer)
    side, _ = side_batch(sentences, tokenizer)
    order = _positions_by_rarity(side, frequencies)
    probs = uniform_probs(side, 3)
    probs = _probs_onto(side, probs, 1, lambda b: order[b][0])  # the rarest
    probs = _probs_onto(side, probs, 2, lambda b: order[b][1])  # the second rarest
    stats = RareTokenStats(frequencies, top_k=3)
    stats.update_side("enc_self", side)
    stats.update(AttentionView(FakeBlock("enc_self", 0, 3), probs, side))
    result = stats.result()
    assert result.rare_heads() == [("enc_self", 0, 1)]
    assert result.rarest["enc_self"][0].tolist()[1:] == [1.0, 0.0]
    assert result.two_rarest["enc_self"][0].tolist()[1:] == [1.0, 1.0]
    assert result.n_eligible["enc_self"] == 4
    assert result.top(1)[0][:3] == ("enc_self", 0, 1)


def test_sentences_with_only_frequent_tokens_are_left_out(tmp_path):
    sentences = sample_sentences(tmp_path)
    tokenizer = word_tokenizer([w for s in sentences for w in s.words])
    frequencies = _frequencies(tokenizer)
    side, _ = side_batch(sentences, tokenizer)
    # With the top 1000 every token is frequent: no sentence qualifies, no score.
    stats = RareTokenStats(frequencies, top_k=1000)
    stats.update_side("enc_self", side)
    stats.update(AttentionView(FakeBlock("enc_self", 0, 2), uniform_probs(side, 2), side))
    result = stats.result()
    assert result.n_eligible["enc_self"] == 0
    assert np.isnan(result.rarest["enc_self"]).all()
    # Exactly: sentence b qualifies when its least frequent token is outside the top k.
    top = frequencies.top_mask(12)
    expected = 0
    for b, n in enumerate(side.lengths):
        ids = [int(side.token_ids[b, t]) for t in range(n) if side.token_word[b, t] >= 0]
        least = min(ids, key=lambda i: (frequencies.counts[i], i))
        expected += not top[least]
    stats = RareTokenStats(frequencies, top_k=12)
    stats.update_side("enc_self", side)
    assert stats.n_eligible["enc_self"] == expected and 0 < expected < 4


def test_forced_rare_head_in_a_real_model(sample_path):
    sentences = sample_sentences(sample_path.parent)
    tokenizer = word_tokenizer([w for s in sentences for w in s.words])
    frequencies = _frequencies(tokenizer)

    def rarest(row, t):
        words = row[:-1]  # EOS last
        return max(range(len(words)), key=lambda i: words[i])  # highest id = rarest

    model = tiny_model("marian")
    block = [b for b in attention_blocks(model) if b.kind == "enc_self"][1]
    pattern = lambda ids, T: token_pattern(ids, T, tokenizer.pad_token_id, rarest)  # noqa: E731
    with ForcedAttention(model, block, 0, pattern):
        analysis = analyze_heads(model, tokenizer, sample_path, frequencies=frequencies,
                                 config=AnalysisConfig(aggregate=False, top_frequent=3, engine="eager"))
    assert analysis.rare.rare_heads() == [("enc_self", 1, 0)]
    assert analysis.rare.rarest["enc_self"][1, 0] == 1.0
    assert "enc_self L1 H0: rarest token 100.0%" in analysis.rare.describe()


def test_frequencies_from_corpus_file_and_back(tmp_path):
    tokenizer = word_tokenizer("the cat sat on a mat".split())
    corpus = tmp_path / "train.txt.gz"
    with gzip.open(corpus, "wt", encoding="utf-8") as handle:
        handle.write("the cat sat\n\nthe mat\nthe cat\n")
    frequencies = TokenFrequencies.from_corpus(tokenizer, corpus)
    vocab = tokenizer.get_vocab()
    assert frequencies.counts[vocab["the"]] == 3 and frequencies.counts[vocab["cat"]] == 2
    assert frequencies.counts[vocab["</s>"]] == 0  # special tokens are not counted
    assert frequencies.n_lines == 3
    path = frequencies.save(tmp_path / "freq.tsv", tokenizer)
    again = TokenFrequencies.from_file(tokenizer, path)
    assert np.array_equal(again.counts, frequencies.counts)
    top = frequencies.top_mask(2)
    assert top[vocab["the"]] and top[vocab["cat"]] and top.sum() == 2


@pytest.mark.parametrize("line,message", [
    ("the 3", "expected 'token<TAB>count'"),
    ("dog\t3", "not in the tokenizer's vocabulary"),
    ("the\tmany", "not an integer"),
])
def test_bad_frequency_file_names_the_line(tmp_path, line, message):
    tokenizer = word_tokenizer("the cat".split())
    path = tmp_path / "freq.tsv"
    path.write_text(f"# counts\ncat\t2\n{line}\n", encoding="utf-8")
    with pytest.raises(HeadlabError, match=f"{path}:3: .*{message}"):
        TokenFrequencies.from_file(tokenizer, path)


def test_rare_masks_handle_ties(tmp_path):
    sentences = sample_sentences(tmp_path)[:1]
    tokenizer = word_tokenizer([w for s in sentences for w in s.words])
    counts = np.full(len(tokenizer), 50)
    vocab = tokenizer.get_vocab()
    counts[vocab["old"]] = counts[vocab["red"]] = 1  # two rarest, tied
    counts[vocab["ball"]] = 2
    side, _ = side_batch(sentences, tokenizer)
    from headlab.functions.rare_tokens import rare_token_masks

    eligible, rarest, two = rare_token_masks(side, torch.tensor(counts), torch.zeros(len(counts), dtype=torch.bool))
    words = sentences[0].words
    assert [words[t] for t in torch.nonzero(rarest[0]).flatten().tolist()] == ["old", "red"]
    # The second smallest count is also 1 (the tie), so "one of the two rarest" is the same set.
    assert torch.equal(rarest, two) and bool(eligible[0])


def test_per_sentence_reading_weighs_each_sentence_once(tmp_path):
    """A head on the rarest token in the first sentence only: per query token its share is that
    sentence's share of the queries, per sentence it is 1 / (number of sentences)."""
    sentences = sample_sentences(tmp_path)
    tokenizer = word_tokenizer([w for s in sentences for w in s.words])
    frequencies = _frequencies(tokenizer)
    side, _ = side_batch(sentences, tokenizer)
    order = _positions_by_rarity(side, frequencies)
    probs = _probs_onto(side, uniform_probs(side, 1), 0, lambda b: order[b][0] if b == 0 else order[b][-1])
    stats = RareTokenStats(frequencies, top_k=3, per_sentence=True)
    stats.update_side("enc_self", side)
    stats.update(AttentionView(FakeBlock("enc_self", 0, 1), probs, side))
    result = stats.result()
    real = [int(side.token_mask[b].sum()) for b in range(side.batch_size)]
    assert np.isclose(result.rarest["enc_self"][0, 0], real[0] / sum(real))
    assert np.isclose(result.rarest_per_sentence["enc_self"][0, 0], 1 / len(real))
    entry = result.per_sentence_json()["enc_self:0"]
    assert entry["sentences"] == [len(real)]
    assert np.isclose(entry["rarest_sd"][0], np.std([1.0] + [0.0] * (len(real) - 1), ddof=1))
    written = {p.name for p in result.write(tmp_path / "out")}
    assert {"rarest_per_sentence.json", "per_sentence.json"} <= written
    plain = RareTokenStats(frequencies, top_k=3)  # without the sensitivity reading: the files of before
    plain.update_side("enc_self", side)
    plain.update(AttentionView(FakeBlock("enc_self", 0, 1), probs, side))
    assert {p.name for p in plain.result().write(tmp_path / "plain")} == {"rarest.json", "two_rarest.json",
                                                                          "summary.json"}


def test_frequency_file_keeps_tokens_that_start_with_a_hash(tmp_path):
    """Regression: from_file took every line starting with "#" for a comment, so WordPiece's
    continuation tokens ("##s") and the token "#" that save() wrote were read back as count 0:
    common subwords became the rarest tokens, without a word."""
    tokenizer = word_tokenizer(["the", "cat", "##s", "#"], style="bert")
    vocab = tokenizer.get_vocab()
    counts = np.zeros(len(tokenizer), dtype=np.int64)
    counts[vocab["the"]], counts[vocab["##s"]], counts[vocab["#"]], counts[vocab["cat"]] = 9, 7, 5, 1
    path = TokenFrequencies(counts, "corpus").save(tmp_path / "freq.tsv", tokenizer)
    assert np.array_equal(TokenFrequencies.from_file(tokenizer, path).counts, counts)


def test_frequency_file_with_a_token_twice_is_refused(tmp_path):
    """Regression: a token listed twice (two count files joined) kept its last count, silently."""
    tokenizer = word_tokenizer("the cat".split())
    path = tmp_path / "freq.tsv"
    path.write_text("the\t5\ncat\t2\nthe\t3\n", encoding="utf-8")
    with pytest.raises(HeadlabError, match=f"{path}:3: token 'the' is counted twice .*line 1"):
        TokenFrequencies.from_file(tokenizer, path)


def test_a_sentence_of_equally_frequent_tokens_is_not_eligible(tmp_path):
    """Every token of a sentence at one count is "the rarest": any maximum lands on one. With all tokens equally
    frequent (a --train-text with each word once) every head scored 100% and was labelled rare (audit33)."""
    sentences = sample_sentences(tmp_path)
    tokenizer = word_tokenizer([w for s in sentences for w in s.words])
    counts = np.full(len(tokenizer), 1)
    side, _ = side_batch(sentences, tokenizer)
    stats = RareTokenStats(TokenFrequencies(counts, "each word once"), top_k=1)
    stats.update_side("enc_self", side)
    stats.update(AttentionView(FakeBlock("enc_self", 0, 2), uniform_probs(side, 2), side))
    result = stats.result()
    assert result.n_eligible["enc_self"] == 0
    assert np.isnan(result.rarest["enc_self"]).all() and result.top(1) == []
    assert "0 of 4 sentences" in result.describe() and "and a more frequent one" in result.describe()
    assert result.describe_heads() == [f"rare-token  undefined: {result.describe()}"]
    # One token more frequent than the rest: the others are the rarest, and the sentence counts.
    counts = np.full(len(tokenizer), 1)
    counts[tokenizer.get_vocab()[sentences[0].words[0]]] = 5
    stats = RareTokenStats(TokenFrequencies(counts, "one word more often"), top_k=1)
    stats.update_side("enc_self", side)
    assert stats.n_eligible["enc_self"] >= 1
