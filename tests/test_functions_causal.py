"""Causal attention (decoder self-attention, GPT-2, Llama): statistics that rank single weights
leave out queries with fewer than two reachable words, and the Table 1 analogue scores only
reachable arcs (issue 15, defects 1 and 2)."""

from collections import Counter

import numpy as np
import torch

from headlab.aggregate import AggregateStats
from headlab.data.alignment import AttentionView
from headlab.data.treebank import relation_matcher
from headlab.functions import AnalysisConfig, PositionalStats, SyntacticStats, analyze_heads
from support.models import tiny_model
from support.treebank import FakeBlock, sample_sentences, side_batch, word_tokenizer

H = 3


def _causal_probs(side, seed=0):
    """Random causal attention over each sentence's real tokens (row t sees tokens 0..t)."""
    g = torch.Generator().manual_seed(seed)
    B, T = side.token_ids.shape
    probs = torch.zeros(B, H, T, T)
    for b, n in enumerate(side.lengths):
        logits = torch.randn(H, n, n, generator=g) * 3
        logits = logits.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        probs[b, :, :n, :n] = logits.softmax(-1)
    return probs


def _setup(tmp_path):
    sentences = sample_sentences(tmp_path)
    tokenizer = word_tokenizer([w for s in sentences for w in s.words], style="gpt2")  # nothing added
    side, _ = side_batch(sentences, tokenizer)
    return sentences, side


def test_exemplars_of_causal_attention_skip_the_first_word(tmp_path):
    sentences, side = _setup(tmp_path)
    probs = _causal_probs(side)
    view = AttentionView(FakeBlock("dec_self", 0, H), probs, side)
    assert view.causal and bool((view.words[:, :, 0, 0][side.n_words > 0] > 0.999).all())  # the trap
    stats = AggregateStats(top_k=2)
    stats.update(view)
    result = stats.result()
    stats.close()
    words = view.words
    for h, heap in enumerate(result.exemplars[("dec_self", 0)]):
        # Direct: per sentence, the largest weight over queries 1.. (query 0 sees only itself).
        best = sorted(((float(words[b, h, 1:, :].max()), b) for b in range(len(sentences))), reverse=True)[:2]
        assert [(e.sentence, round(e.weight, 6)) for e in heap] == [(b, round(w, 6)) for w, b in best]
        assert all(e.query >= 1 and e.key <= e.query for e in heap)
    # The same attention read as an encoder keeps query 0 (it could have looked anywhere).
    encoder = AggregateStats(top_k=1)
    encoder.update(AttentionView(FakeBlock("enc_self", 0, H), probs, side))
    assert any(heap[0].query == 0 for heap in encoder.result().exemplars[("enc_self", 0)])
    encoder.close()


def test_positional_maxima_of_causal_attention_skip_the_first_word(tmp_path):
    sentences, side = _setup(tmp_path)
    probs = _causal_probs(side, seed=1)
    stats = PositionalStats(max_offset=8)
    stats.update(AttentionView(FakeBlock("dec_self", 0, H), probs, side))
    counted = stats.counts[("dec_self", 0)].sum(1)
    assert counted.tolist() == [sum(len(s) - 1 for s in sentences)] * H  # every word but the first
    tokens = PositionalStats(max_offset=8, level="token")
    tokens.update(AttentionView(FakeBlock("dec_self", 0, H), probs, side))
    assert tokens.counts[("dec_self", 0)].sum(1).tolist() == [sum(len(s) - 1 for s in sentences)] * H


def _offsets(sentences, relation, direction):
    match = relation_matcher(relation)
    offsets = Counter()
    for s in sentences:
        for governor, dependent, label in s.arcs():
            if match(label):
                offsets[dependent - governor if direction == "gov->dep" else governor - dependent] += 1
    return offsets


def test_syntactic_table_of_causal_attention_scores_reachable_arcs_only(tmp_path):
    sentences, side = _setup(tmp_path)
    # Head 0 attends from every word to its governor when the governor is earlier, head 1 to its
    # closest earlier dependent; otherwise (and head 2 always) a word attends to itself.
    B, T = side.token_ids.shape
    probs = torch.zeros(B, H, T, T)
    for b, s in enumerate(sentences):
        for i in range(len(s)):
            probs[b, :, i, i] = 1.0
            governor = s.heads[i]
            dependents = [d for d in range(i) if s.heads[d] == i]
            for head, target in ((0, governor if 0 <= governor < i else None),
                                 (1, dependents[-1] if dependents else None)):
                if target is not None:
                    probs[b, head, i] = 0.0
                    probs[b, head, i, target] = 1.0
    stats = SyntacticStats(("nsubj", "dobj", "amod", "advmod"))
    stats.update_side("dec_self", side)
    stats.update(AttentionView(FakeBlock("dec_self", 0, H), probs, side))
    result = stats.result()
    rows = {(r.relation, r.direction): r for r in result.table()}
    for relation in ("nsubj", "amod", "advmod"):
        for direction in ("gov->dep", "dep->gov"):
            offsets = _offsets(sentences, relation, direction)
            reachable = {o: n for o, n in offsets.items() if o < 0}
            row = rows[(relation, direction)]
            assert row.n_arcs == sum(offsets.values())
            if 2 * sum(reachable.values()) < sum(offsets.values()):
                assert row.unreachable and row.best_head is None and row.status.startswith("unreachable")
                assert np.isnan(result.accuracy(relation, direction)["dec_self"]).all()
                continue
            assert row.n_scored == sum(reachable.values())
            offset = max(sorted(reachable), key=lambda o: reachable[o])
            assert (row.baseline_offset, row.baseline) == (offset, reachable[offset] / row.n_scored)
            assert row.baseline_offset < 0
    # In this sample subjects and adjectives precede their governors: s -> v and adj -> noun
    # point forward (unreachable), v -> s and noun -> adj backward (scored).
    assert rows[("nsubj", "dep->gov")].unreachable and rows[("amod", "dep->gov")].unreachable
    assert not rows[("nsubj", "gov->dep")].unreachable
    # obj follows its verb: o -> v is reachable everywhere, and head 0 finds every governor.
    assert rows[("dobj", "dep->gov")].best_head == (0, 0) and rows[("dobj", "dep->gov")].best_accuracy == 1.0
    assert rows[("amod", "gov->dep")].best_head == (0, 1) and rows[("amod", "gov->dep")].best_accuracy == 1.0
    # advmod goes both ways: v -> adv is scored on its 3 reachable arcs of 5.
    advmod = rows[("advmod", "gov->dep")]
    assert not advmod.unreachable and (advmod.n_scored, advmod.n_arcs) == (3, 5)
    markdown = result.table_markdown()
    assert f"| {advmod.n_scored} / {advmod.n_arcs} |" in markdown
    assert "unreachable under causal attention" in markdown and "backward offsets only" in markdown
    # The same data read as an encoder: everything scored on every arc.
    encoder = SyntacticStats(("nsubj",))
    encoder.update_side("enc_self", side)
    encoder.update(AttentionView(FakeBlock("enc_self", 0, H), probs, side))
    assert not any(r.unreachable for r in encoder.result().table())


def test_a_real_causal_model_has_no_trivial_exemplars(sample_path):
    sentences = sample_sentences(sample_path.parent)
    tokenizer = word_tokenizer([w for s in sentences for w in s.words], style="gpt2")
    model = tiny_model("gpt2", attn_implementation="eager")
    analysis = analyze_heads(model, tokenizer, sample_path, config=AnalysisConfig(batch_size=4))
    for heaps in analysis.aggregate.exemplars.values():
        for heap in heaps:
            assert heap and all(e.query >= 1 for e in heap)
    table = analysis.syntactic.to_json()["table"]
    assert any(row["status"] == "unreachable under causal attention" for row in table)
