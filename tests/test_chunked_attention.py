"""headlab's registered attention function: the model's output is eager's, and the chunks it
hands over are eager's probabilities, on every tiny family (padding, causal, cross, GQA)."""

from __future__ import annotations

import logging

import pytest
import torch

from headlab.adapters import attention_blocks
from headlab.attention import NAME
from headlab.capture import capture_attention, stream_attention
from headlab.errors import HeadlabError
from support.models import FAMILIES, logits, tiny_inputs, tiny_model

pytestmark = pytest.mark.unit


def _collect(model, inputs, query_chunk):
    chunks: dict = {}

    def on_chunk(block, chunk):
        chunks.setdefault(block.key, []).append(chunk)

    with stream_attention(model, on_chunk, query_chunk=query_chunk) as record:
        out = logits(model, inputs)
    return out, chunks, record


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("query_chunk", [1, 3, 64])
def test_output_and_probabilities_equal_eager(family, query_chunk):
    model = tiny_model(family, attn_implementation="eager")
    inputs = tiny_inputs(family, src_len=8, tgt_len=6)  # padding in the second sentence
    reference = logits(model, inputs)
    with capture_attention(model) as record:
        logits(model, inputs)
    eager = dict(record)
    out, chunks, seen = _collect(model, inputs, query_chunk)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=0)
    assert set(chunks) == set(eager)  # every block: self-, causal and cross-attention
    for key, probs in eager.items():
        parts = chunks[key]
        assert [c.start for c in parts] == list(range(0, probs.shape[2], query_chunk))
        assert parts[-1].last and not any(c.last for c in parts[:-1])
        assert max(c.probs.shape[2] for c in parts) <= query_chunk
        torch.testing.assert_close(torch.cat([c.probs for c in parts], 2), probs.float(), atol=1e-6, rtol=0)
        assert seen.calls[key] == 1
    assert model.config._attn_implementation == "eager"  # restored


def test_grouped_query_attention_and_left_padding():
    model = tiny_model("llama", attn_implementation="sdpa")
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    inputs = tiny_inputs("llama", src_len=9)
    inputs["attention_mask"] = inputs["attention_mask"].flip(1)  # left padding: fully hidden query rows
    sdpa = logits(model, inputs)
    out, chunks, _ = _collect(model, inputs, 2)
    real = inputs["attention_mask"].bool()
    torch.testing.assert_close(out[real], sdpa[real], atol=1e-5, rtol=0)
    model.config._attn_implementation = "eager"  # eager everywhere, the padded rows included
    torch.testing.assert_close(out, logits(model, inputs), atol=1e-5, rtol=0)
    model.config._attn_implementation = "sdpa"
    probs = torch.cat([c.probs for c in chunks[("dec_self", 0)]], 2)
    assert torch.all(probs[0].triu(1) == 0)  # causal
    assert torch.all(probs[1, :, 2:, 2:].triu(1) == 0) and torch.all(probs[1, :, 2:, :2] == 0)  # padded keys: 0
    torch.testing.assert_close(probs[1, :, :2], torch.full_like(probs[1, :, :2], 1 / 9))  # hidden rows: as eager
    assert model.config._attn_implementation == "sdpa"


def test_restored_after_an_error():
    model = tiny_model("bert", attn_implementation="sdpa")

    def fail(block, chunk):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        with stream_attention(model, fail, query_chunk=2):
            logits(model, tiny_inputs("bert"))
    assert model.config._attn_implementation == "sdpa"
    assert not any(hasattr(b.core, "_headlab_chunk_sink") for b in attention_blocks(model))
    torch.testing.assert_close(logits(model, tiny_inputs("bert")),
                               logits(tiny_model("bert", attn_implementation="sdpa"), tiny_inputs("bert")))


@pytest.mark.parametrize("bad", [0, -3])
def test_bad_chunk_size(bad):
    model = tiny_model("gpt2")
    with pytest.raises(HeadlabError, match="query chunk"):
        with stream_attention(model, lambda b, c: None, query_chunk=bad):
            pass


def test_fallback_when_attention_does_not_dispatch(monkeypatch, caplog):
    import headlab.capture as capture

    model = tiny_model("gpt2", attn_implementation="eager")
    inputs = tiny_inputs("gpt2", src_len=7)
    with capture_attention(model) as record:
        logits(model, inputs)
    eager = dict(record)
    monkeypatch.setattr(capture, "dispatches", lambda module: False)
    with caplog.at_level(logging.WARNING, logger="headlab.capture"):
        out, chunks, _ = _collect(model, inputs, 3)
    assert "falling back to eager capture" in caplog.text
    torch.testing.assert_close(out, logits(model, inputs))
    for key, probs in eager.items():
        assert [c.start for c in chunks[key]] == [0, 3, 6]
        torch.testing.assert_close(torch.cat([c.probs for c in chunks[key]], 2), probs)


def test_a_forward_that_bypasses_the_registry_is_an_error(monkeypatch):
    model = tiny_model("gpt2")
    block = attention_blocks(model)[0]
    original = block.core.forward

    def bypass(*args, **kwargs):
        implementation = block.core.config._attn_implementation
        block.core.config._attn_implementation = "eager"
        try:
            return original(*args, **kwargs)
        finally:
            block.core.config._attn_implementation = implementation

    monkeypatch.setattr(block.core, "forward", bypass)
    with pytest.raises(HeadlabError, match="did not call the registered attention function"):
        _collect(model, tiny_inputs("gpt2"), 2)
    assert model.config._attn_implementation != NAME
