"""Confidence: the mean of each head's maximum attention weight, special tokens and padding excluded."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from headlab.importance import ImportanceData, compute_confidence, describe_model, translate_data
from headlab.importance.confidence import max_attention
from support.models import tiny_model

SEP = 5  # an extra "special" token for the tests


def _sentences(eos):
    g = torch.Generator().manual_seed(3)
    rows = []
    for length in (6, 3, 5, 4):
        row = torch.randint(6, 99, (length,), generator=g).tolist()
        row.insert(1, SEP)  # a special token inside the sentence
        rows.append(row + [eos])
    return rows


def _by_hand(model, info, data, family):
    """Independent computation, one sentence at a time (no padding), with Python loops."""
    special = info.special_ids
    sums, counts = {}, {}

    def add(kind, layer, probs, q_tokens, k_tokens, causal, skip_special_queries):
        for h in range(probs.shape[0]):
            for q in range(probs.shape[1]):
                if skip_special_queries and q_tokens[q] in special:
                    continue
                keys = [k for k in range(probs.shape[2]) if k_tokens[k] not in special and (not causal or k <= q)]
                if not keys:
                    continue
                sums.setdefault((kind, layer), np.zeros(probs.shape[0]))[h] += max(float(probs[h, q, k]) for k in keys)
                if h == 0:
                    counts[(kind, layer)] = counts.get((kind, layer), 0) + 1

    for i, src in enumerate(data.sources):
        ids = torch.tensor([src])
        with torch.no_grad():
            if info.is_seq2seq:
                dec = [info.decoder_start_id] + data.translations[i][:-1]
                out = model(input_ids=ids, decoder_input_ids=torch.tensor([dec]), output_attentions=True)
                for layer, probs in enumerate(out.encoder_attentions):
                    add("enc_self", layer, probs[0], src, src, False, True)
                for layer, probs in enumerate(out.decoder_attentions):
                    add("dec_self", layer, probs[0], dec, dec, True, False)
                for layer, probs in enumerate(out.cross_attentions):
                    add("dec_cross", layer, probs[0], dec, src, False, False)
            else:
                out = model(input_ids=ids, output_attentions=True)
                kind = "dec_self" if family == "gpt2" else "enc_self"
                for layer, probs in enumerate(out.attentions):
                    add(kind, layer, probs[0], src, src, family == "gpt2", True)
    return {key: sums[key] / counts[key] for key in sums}


@pytest.mark.parametrize("family", ["marian", "bart", "bert", "gpt2"])
def test_confidence_equals_a_hand_computation(family):
    model = tiny_model(family, attn_implementation="eager")
    info = describe_model(model)
    eos = min(info.eos_ids) if info.eos_ids else 1
    info = replace(info, special_ids=info.special_ids | {SEP, eos})
    data = ImportanceData.from_ids(_sentences(eos))
    if info.is_seq2seq:
        data = translate_data(model, data, info, max_length_a=0, max_length_b=5)
    scores = compute_confidence(model, data, info, batch_size=3)  # padded batches
    expected = _by_hand(model, info, data, family)
    assert scores.method == "confidence"
    for (kind, layer), values in expected.items():
        np.testing.assert_allclose(scores[kind][layer], values, rtol=1e-5)
    assert set(scores.kinds) == {k for k, _ in expected}


def test_eos_keys_are_excluded_and_not_renormalised():
    # One head, one query: 0.7 on EOS (key 2), 0.2 and 0.1 on words.
    probs = torch.tensor([[[[0.2, 0.1, 0.7]]]])
    queries = torch.tensor([[True]])
    keys = torch.tensor([[True, True, False]])
    total, count = max_attention(probs, queries, keys, causal=False)
    assert float(total[0]) == pytest.approx(0.2) and int(count) == 1
    # A query whose only visible key is excluded does not count.
    probs = torch.tensor([[[[1.0, 0.0], [0.4, 0.6]]]])
    total, count = max_attention(probs, torch.tensor([[True, True]]), torch.tensor([[False, True]]), causal=True)
    assert float(total[0]) == pytest.approx(0.6) and int(count) == 1


def test_confidence_needs_no_lm_head():
    import transformers as tf

    bare = tf.BertModel(tiny_model("bert").config).eval()
    info = describe_model(bare)
    assert not info.has_lm_head
    scores = compute_confidence(bare, ImportanceData.from_ids(_sentences(2)), info)
    assert scores["enc_self"].shape == (2, 4)
    assert ((scores["enc_self"] > 0) & (scores["enc_self"] <= 1)).all()


# Llama's eager softmax runs in float32 whatever the model's dtype (the chunked one in float64 here):
# its scores agree to float32 rounding, the others' to 1e-8.
@pytest.mark.parametrize("family, rtol", [("marian", 0), ("bert", 0), ("gpt2", 0), ("llama", 1e-6)])
def test_confidence_from_query_chunks_equals_eager(family, rtol):
    """Under ``query_chunk`` (headlab's registered attention, a few query rows at a time) the row
    maxima are gathered per block and summed as the eager path sums them: the same scores."""
    model = tiny_model(family, attn_implementation="sdpa").double()
    info = describe_model(model)
    eos = min(info.eos_ids) if info.eos_ids else 1
    info = replace(info, special_ids=info.special_ids | {SEP, eos})
    data = ImportanceData.from_ids(_sentences(eos))
    if info.is_seq2seq:
        data = translate_data(model, data, info, max_length_a=0, max_length_b=5)
    eager = compute_confidence(model, data, info, batch_size=3, engine="eager")  # padded batches
    assert model.config._attn_implementation == "sdpa"  # restored after the eager capture
    for query_chunk in (1, 2, 5, None):  # None: the default chunk (128 rows), fused/chunked by default
        chunked = compute_confidence(model, data, info, batch_size=3, query_chunk=query_chunk)
        assert chunked.kinds == eager.kinds
        for kind in eager.kinds:
            np.testing.assert_allclose(chunked[kind], eager[kind], rtol=rtol, atol=1e-8)
        assert chunked.signature["queries_counted"] == eager.signature["queries_counted"]


def test_confidence_query_chunk_must_be_positive():
    from headlab.errors import HeadlabError
    from headlab.importance.confidence import ConfidenceOptions

    model = tiny_model("bert")
    for bad in (0, -2):
        with pytest.raises(HeadlabError, match="--query-chunk must be at least 1"):
            compute_confidence(model, ImportanceData.from_ids(_sentences(2)), query_chunk=bad)
        with pytest.raises(HeadlabError, match="--query-chunk must be at least 1"):
            ConfidenceOptions(query_chunk=bad)


@pytest.mark.parametrize("family", ["bert", "llama"])
def test_confidence_reuses_the_chunk_buffers(monkeypatch, family):
    """Under ``query_chunk`` the chunks are written into reused work buffers (``reuse=True``: the
    callback keeps only copies): the same scores, to the bit, as fresh tensors per chunk."""
    import headlab.importance.confidence as confidence

    model = tiny_model(family, attn_implementation="sdpa")
    info = describe_model(model)
    eos = min(info.eos_ids) if info.eos_ids else 1
    info = replace(info, special_ids=info.special_ids | {SEP, eos})
    data = ImportanceData.from_ids(_sentences(eos))
    real = confidence.stream_attention
    runs = []
    for forced in (None, False):
        asked = []

        def spy(*args, forced=forced, asked=asked, **kwargs):
            asked.append(kwargs.get("reuse", False))
            if forced is not None:
                kwargs["reuse"] = forced
            return real(*args, **kwargs)

        monkeypatch.setattr(confidence, "stream_attention", spy)
        runs.append((compute_confidence(model, data, info, batch_size=3, query_chunk=2), asked))
    (reused, asked), (fresh, _) = runs
    assert asked == [True]
    for kind in fresh.kinds:
        np.testing.assert_array_equal(reused[kind], fresh[kind])


def test_confidence_streams_by_default_and_eager_stays_the_reference(monkeypatch, caplog):
    """Issue 34: by default confidence reads the chunks of headlab's attention function (128 rows),
    ``engine="eager"`` the whole maps; a model whose attention cannot go through that function gets
    the eager path by default, said once; ``--engine eager`` with ``--query-chunk`` is refused."""
    import logging

    import headlab.capture
    import headlab.importance.confidence as confidence
    from headlab.errors import HeadlabError
    from headlab.importance.confidence import ConfidenceOptions

    model = tiny_model("gpt2", attn_implementation="sdpa").double()
    info = describe_model(model)
    data = ImportanceData.from_ids(_sentences(min(info.eos_ids) if info.eos_ids else 1))
    streamed, captured = [], []
    stream, capture = confidence.stream_attention, confidence.capture_attention
    monkeypatch.setattr(confidence, "stream_attention",
                        lambda *a, **k: streamed.append(k["query_chunk"]) or stream(*a, **k))
    monkeypatch.setattr(confidence, "capture_attention", lambda *a, **k: captured.append(1) or capture(*a, **k))
    default = compute_confidence(model, data, info, batch_size=3)
    assert streamed == [128] and not captured
    eager = compute_confidence(model, data, info, batch_size=3, engine="eager")
    assert streamed == [128] and captured == [1]
    for kind in eager.kinds:
        np.testing.assert_allclose(default[kind], eager[kind], rtol=0, atol=1e-8)
    monkeypatch.setattr(headlab.capture, "unregistrable", lambda blocks: blocks[:1])
    with caplog.at_level(logging.INFO, logger="headlab.importance.confidence"):
        fallback = compute_confidence(model, data, info, batch_size=3)
    assert streamed == [128] and captured == [1, 1] and caplog.text.count("on the eager path") == 1
    for kind in eager.kinds:
        np.testing.assert_array_equal(fallback[kind], eager[kind])
    for bad in (lambda: ConfidenceOptions(engine="eager", query_chunk=4),
                lambda: compute_confidence(model, data, info, engine="eager", query_chunk=4)):
        with pytest.raises(HeadlabError, match="not with --engine eager"):
            bad()
    with pytest.raises(HeadlabError, match="engine must be one of"):
        ConfidenceOptions(engine="flash")
