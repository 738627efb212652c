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


# -- a chunk holds only the keys its rows can see ------------------------------------------------
def _long_model(family: str, positions: int = 256):
    """A tiny model of ``family`` whose position table takes long inputs (several KEY_BLOCKs)."""
    import transformers as tf

    from support.models import VOCAB

    small = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=positions)
    causal = dict(small, num_key_value_heads=2, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    cls, config = {
        "llama": lambda: (tf.LlamaForCausalLM, tf.LlamaConfig(**causal)),
        "mistral": lambda: (tf.MistralForCausalLM, tf.MistralConfig(**causal, sliding_window=40)),
        "bert": lambda: (tf.BertForMaskedLM, tf.BertConfig(**small)),
        "marian": lambda: (tf.MarianMTModel, tf.MarianConfig(
            vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=37, decoder_ffn_dim=37, pad_token_id=0, eos_token_id=1,
            decoder_start_token_id=0, max_position_embeddings=positions)),
    }[family]()
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return cls(config).eval()


def _long_inputs(family: str, length: int, padding: str | None):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 99, (2, length), generator=g)
    mask = torch.ones(2, length, dtype=torch.long)
    if padding is not None:
        mask[1, -length // 3:] = 0  # the second sentence a third shorter
        if padding == "left":
            mask = mask.flip(1)
    inputs = {"input_ids": ids, "attention_mask": mask}
    if family == "marian":
        inputs["decoder_input_ids"] = torch.randint(3, 99, (2, length - 20), generator=g)
    return inputs


def _eager_probs(model, inputs):
    with capture_attention(model) as record:
        out = logits(model, inputs)
    return out, dict(record)


@pytest.mark.parametrize("family, padding", [("llama", None), ("llama", "right"), ("llama", "left"),
                                             ("mistral", "right")])
def test_causal_chunks_hold_the_visible_keys_only(monkeypatch, family, padding):
    """Causal self-attention (grouped-query; Mistral with a sliding window in the mask), chunks
    of 48 rows (not a divisor of 200): each chunk holds the keys up to the last one a row of it
    sees, rounded up to KEY_BLOCK; the weights it leaves out are 0 in eager's map; the weights it
    holds are, to the bit, those of the same chunk computed over every key; the output is eager's."""
    import headlab.attention as attention

    model = _long_model(family)
    inputs = _long_inputs(family, 200, padding)
    reference, eager = _eager_probs(model, inputs)
    out, chunks, _ = _collect(model, inputs, 48)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=0)
    monkeypatch.setattr(attention, "visible_keys", lambda mask, causal, stop, k_len: k_len)
    _, wide, _ = _collect(model, inputs, 48)
    cut = 0
    for key, probs in eager.items():
        parts = chunks[key]
        assert [c.start for c in parts] == list(range(0, 200, 48))
        for chunk in parts:
            assert chunk.k_len == 200 and (chunk.keys == 200 or chunk.keys % attention.KEY_BLOCK == 0)
            assert torch.all(probs[:, :, chunk.start:chunk.stop, chunk.keys:] == 0)  # nothing left out but zeros
            cut += chunk.keys < chunk.k_len
        torch.testing.assert_close(torch.cat([c.full() for c in parts], 2), probs, atol=1e-6, rtol=0)
        if key[1] == 0:  # the first layer's inputs are the same in both runs: the same bits
            for chunk, whole in zip(parts, wide[key]):
                assert whole.keys == 200 and torch.equal(chunk.full(), whole.probs)
    assert cut >= 4  # the early chunks of every layer hold fewer keys
    if padding == "left":  # rows of padding see no key: eager spreads them over every key, so does the chunk
        first = chunks[("dec_self", 0)][0]
        assert first.keys == first.k_len
        torch.testing.assert_close(first.probs[1, :, 0], torch.full_like(first.probs[1, :, 0], 1 / 200))


@pytest.mark.parametrize("padding", [None, "right"])
def test_non_causal_attention_keeps_every_key(padding):
    """Encoder self-attention and cross-attention are not cut (with padding in the second sentence
    only, the first one's rows see every key); the decoder's causal self-attention is; the output
    and the probabilities are eager's."""
    for family in ("bert", "marian"):
        model = _long_model(family)
        inputs = _long_inputs(family, 200, padding)
        reference, eager = _eager_probs(model, inputs)
        out, chunks, _ = _collect(model, inputs, 48)
        torch.testing.assert_close(out, reference, atol=1e-5, rtol=0)
        for key, probs in eager.items():
            held = {c.keys == c.k_len for c in chunks[key]}
            assert held == ({True, False} if key[0] == "dec_self" else {True}), key
            torch.testing.assert_close(torch.cat([c.full() for c in chunks[key]], 2), probs, atol=1e-6, rtol=0)


def test_visible_keys_from_the_mask():
    from headlab.attention import KEY_BLOCK, visible_keys

    hidden = torch.ones(2, 1, 3, 300, dtype=torch.bool)
    hidden[:, 0, :, :10] = False
    hidden[1, 0, 2, 70] = False  # the last key any row sees
    assert visible_keys(hidden, False, 3, 300) == 2 * KEY_BLOCK
    hidden[1, 0, 0] = True  # a row that sees nothing: uniform over every key, as eager
    assert visible_keys(hidden, False, 3, 300) == 300
    additive = torch.zeros(1, 1, 2, 300).masked_fill(torch.arange(300) >= 20, torch.finfo(torch.float32).min)
    assert visible_keys(additive, False, 2, 300) == KEY_BLOCK
    assert visible_keys(None, True, 130, 300) == 3 * KEY_BLOCK
    assert visible_keys(None, True, 290, 300) == 300
    assert visible_keys(None, False, 10, 300) == 300


@pytest.mark.parametrize("family", FAMILIES)
def test_reused_buffers_give_the_same_bits(family):
    """``reuse=True`` (the callback copies what it keeps): each call's chunks are written into the
    same work buffers, and the chunks, their scores and the model's output are, to the bit, those
    of fresh tensors per chunk."""
    model = tiny_model(family, attn_implementation="eager")
    inputs = tiny_inputs(family, src_len=8, tgt_len=6)
    runs = []
    for reuse in (False, True):
        chunks: dict = {}
        pointers: dict = {}

        def on_chunk(block, chunk, chunks=chunks, pointers=pointers):
            pointers.setdefault(block.key, set()).add(chunk.probs.data_ptr())
            chunks.setdefault(block.key, []).append((chunk.probs.clone(), chunk.scores.clone()))

        with stream_attention(model, on_chunk, query_chunk=3, scores=True, reuse=reuse):
            out = logits(model, inputs)
        runs.append((out, chunks, pointers))
    (fresh, fresh_chunks, _), (reused, reused_chunks, reused_pointers) = runs
    assert torch.equal(fresh, reused)
    assert set(fresh_chunks) == set(reused_chunks)
    for key, parts in fresh_chunks.items():
        for (probs, scores), (probs2, scores2) in zip(parts, reused_chunks[key], strict=True):
            assert torch.equal(probs, probs2) and torch.equal(scores, scores2)
        if len(parts) > 1:  # several chunks of one call: one buffer (fresh tensors may land there too)
            assert len(reused_pointers[key]) == 1


def test_reused_buffers_not_under_autograd():
    """A chunked forward that autograd records keeps fresh tensors (``out=`` has no gradient)."""
    from headlab.attention import SINK_ATTRIBUTE, ChunkSink, attention_forward

    module = torch.nn.Module()
    setattr(module, SINK_ATTRIBUTE, ChunkSink(2, lambda chunk: None, reuse=True))
    query = torch.randn(1, 2, 5, 4, requires_grad=True)
    key, value = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    out, _ = attention_forward(module, query, key, value, None, is_causal=True)
    out.sum().backward()
    assert query.grad is not None and torch.isfinite(query.grad).all()


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_prescaled_query_gives_the_same_bits(monkeypatch, family):
    """Where the scaling is a power of two, the query rows are scaled instead of the scores: the
    chunks' scores and probabilities and the model's output are, to the bit, those of scaling the
    scores (eager's order)."""
    import headlab.attention as attention
    from support.models import CONFIGS

    cls, config = CONFIGS[family]()
    config.num_attention_heads = config.num_key_value_heads = 2  # heads of 16: scaling 1/4
    if hasattr(config, "head_dim"):
        config.head_dim = config.hidden_size // 2
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(config).eval()
    inputs = tiny_inputs(family, src_len=8, tgt_len=6)
    runs = []
    for allowed in (True, False):
        seen = []
        real = attention.exact_prescale
        monkeypatch.setattr(attention, "exact_prescale",
                            lambda q, k, s, real=real, allowed=allowed, seen=seen: seen.append(real(q, k, s)) or
                            (allowed and seen[-1]))
        chunks: list = []
        with stream_attention(model, lambda block, chunk, chunks=chunks: chunks.append(
                (chunk.probs.clone(), chunk.scores.clone())), query_chunk=3, scores=True):
            out = logits(model, inputs)
        runs.append((out, chunks, seen))
    (out, chunks, seen), (reference, reference_chunks, _) = runs
    assert all(seen) and seen  # every call prescaled
    assert torch.equal(out, reference)
    for (probs, scores), (probs2, scores2) in zip(chunks, reference_chunks, strict=True):
        assert torch.equal(probs, probs2) and torch.equal(scores, scores2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_exact_prescale(dtype):
    """(q * 2^-e) k^T equals (q k^T) * 2^-e bit for bit on ordinary values; tiny or huge components,
    scalings that are no power of two, and half precision keep eager's order."""
    from headlab.attention import PRESCALE_FLOOR, exact_prescale

    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 300, 64, dtype=dtype) * 3, torch.randn(2, 4, 300, 64, dtype=dtype) * 3
    for scaling in (0.5, 0.125, 2.0 ** -8):
        assert exact_prescale(q, k, scaling)
        assert torch.equal(torch.matmul(q * scaling, k.transpose(2, 3)), torch.matmul(q, k.transpose(2, 3)) * scaling)
    assert not exact_prescale(q, k, 64 ** -0.5 * 1.0001) and not exact_prescale(q, k, 1.0)
    assert not exact_prescale(q, k, 2.0 ** -9)
    assert not exact_prescale(q.bfloat16(), k.bfloat16(), 0.125)
    tiny = q.clone()
    tiny[0, 0, 0, 0] = PRESCALE_FLOOR / 2
    assert not exact_prescale(tiny, k, 0.125)
    tiny[0, 0, 0, 0] = 0.0  # zeros are exact
    assert exact_prescale(tiny, k, 0.125)
    huge = k.clone()
    huge[1, 1, 1, 1] = torch.finfo(dtype).max / 1e3
    assert not exact_prescale(q, huge, 0.125)
    huge[1, 1, 1, 1] = float("nan")
    assert not exact_prescale(q, huge, 0.125)


def test_no_prescale_check_off_the_cpu(monkeypatch):
    """Off the CPU the prescale check is not made (its bool() and float() of device tensors would
    each be a host sync per layer on a GPU); the scaling stays on the scores, eager's order. A meta
    tensor stands in for a GPU one: reading any of its values raises, as exact_prescale does."""
    import headlab.attention as attention

    query, key, value = (torch.randn(1, 2, 6, 16, dtype=torch.float32) for _ in range(3))
    with pytest.raises((RuntimeError, NotImplementedError)):
        attention.exact_prescale(query.to("meta"), key.to("meta"), 0.25)
    seen = []
    real = attention.exact_prescale
    monkeypatch.setattr(attention, "exact_prescale", lambda q, k, s: seen.append(q.device.type) or real(q, k, s))
    module = torch.nn.Module()
    out, _ = attention.attention_forward(module, query.to("meta"), key.to("meta"), value.to("meta"), None,
                                         scaling=0.25, is_causal=True)
    assert out.device.type == "meta" and out.shape == (1, 6, 2, 16) and seen == []
    attention.attention_forward(module, query, key, value, None, scaling=0.25, is_causal=True)
    assert seen == ["cpu"]  # the CPU still checks (and prescales: 0.25 is a power of two)


def test_chunk_rows():
    from headlab.attention import MIN_CHUNK_ROWS, chunk_rows

    assert chunk_rows(128, 0, 16, 8192) == 128  # no budget: the query chunk
    assert chunk_rows(128, 1 << 22, 16, 2048) == 128  # fits
    assert chunk_rows(128, 1 << 22, 16, 8192) == 32
    assert chunk_rows(128, 1 << 22, 16, 1 << 20) == MIN_CHUNK_ROWS  # never fewer
    assert chunk_rows(4, 1 << 22, 16, 1 << 20) == 4  # never more than the query chunk


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_chunk_elements_gives_fewer_rows_and_the_same_attention(monkeypatch, family):
    """``chunk_elements`` (the fused engine's cache budget): chunks of fewer rows than the query
    chunk, in order, holding the same probabilities; the model's output is the same (to rounding)."""
    import headlab.attention as attention

    monkeypatch.setattr(attention, "MIN_CHUNK_ROWS", 1)
    model = tiny_model(family, attn_implementation="eager")
    inputs = tiny_inputs(family, src_len=8, tgt_len=6)
    runs = []
    for elements in (0, 4 * 8):  # 4 heads x 8 keys: one row per chunk
        chunks: dict = {}
        with stream_attention(model, lambda block, chunk, chunks=chunks: chunks.setdefault(block.key, []).append(
                (chunk.start, chunk.stop, chunk.full().clone())), query_chunk=4, reuse=True, chunk_elements=elements):
            out = logits(model, inputs)
        runs.append((out, chunks))
    (out, chunks), (small_out, small_chunks) = runs
    torch.testing.assert_close(small_out, out, atol=1e-6, rtol=0)
    for key, parts in chunks.items():
        small = small_chunks[key]
        assert max(stop - start for start, stop, _ in small) < max(stop - start for start, stop, _ in parts)
        assert [start for start, _, _ in small] == sorted(start for start, _, _ in small)
        # to rounding: products of fewer rows may differ in the last bits, as with any other query chunk
        torch.testing.assert_close(torch.cat([p for _, _, p in small], 2), torch.cat([p for _, _, p in parts], 2),
                                   atol=1e-6, rtol=0)
