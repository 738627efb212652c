"""headlab's attention function (the chunked and fused engines, the default of ``functions``, ``aggregate`` and
``analyze``) on a decoder whose self-attention module says ``is_causal=False``: NLLB-MoE (``NllbMoeAttention``,
transformers 5.24: its decoder layers build their self-attention without ``is_causal``; its eager mask makes them
causal, and it has no SDPA path). headlab registers transformers' SDPA mask builder, which skips an all-visible causal
mask and leaves causality to the module's flag: on an unpadded batch the decoder attended bidirectionally under
headlab's engines, a silent wrong result (session 38's experiments/fused_sweep.py: query 0 put 0.2 on key 0 where
eager puts 1). Now a ``dec_self`` block's chunks are causal where the model hands no mask (``ChunkSink.causal``).
Beside it: NLLB-MoE's experts read the layer's mask to find padding as eager builds it (additive floats); given SDPA's
boolean mask they routed the padded rows' tokens otherwise, and its cross-attention maps changed. A model without an
SDPA path now gets eager's masks under headlab's engines (``attention.EAGER_MASKS_NAME``). Streamed maps equal the eager
capture bit for bit, padded or not, and the fused and chunked engines' files equal the eager engine's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as tf

from headlab import capture_attention
from headlab.capture import stream_attention
from headlab.data.frequencies import TokenFrequencies
from headlab.functions import AnalysisConfig, analyze_heads
from support.family_matrix import perturbed_model
from support.treebank import SAMPLE_CONLLU
from test_chunked_statistics import _assert_close, _written
from test_fused_statistics import word_tokenizer


def _nllb_moe() -> torch.nn.Module:
    config = tf.NllbMoeConfig(vocab_size=99, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                              decoder_attention_heads=4, encoder_ffn_dim=40, decoder_ffn_dim=40, num_experts=4,
                              expert_capacity=16, encoder_sparse_step=2, decoder_sparse_step=2,
                              max_position_embeddings=64, pad_token_id=0, decoder_start_token_id=2)
    model = perturbed_model(tf.NllbMoeForConditionalGeneration, config, attn_implementation="eager").double()
    assert model.model.decoder.layers[0].self_attn.is_causal is False  # as transformers builds it
    return model


@pytest.mark.parametrize("padded", [False, True])
def test_streamed_maps_equal_the_capture(padded):
    """Unpadded: no decoder mask is built (the causal one); padded: the masks its experts read for padding."""
    model = _nllb_moe()
    g = torch.Generator().manual_seed(1)
    inputs = {"input_ids": torch.randint(3, 99, (2, 7), generator=g), "attention_mask": torch.ones(2, 7, dtype=torch.long),
              "decoder_input_ids": torch.randint(3, 99, (2, 5), generator=g)}
    if padded:
        inputs["attention_mask"][1, -2:] = 0
        inputs["decoder_attention_mask"] = torch.ones(2, 5, dtype=torch.long)
        inputs["decoder_attention_mask"][1, -1] = 0
    with torch.no_grad():
        model(**inputs)  # its router casts its own weights to float32 in its first forward (router_dtype)
    with torch.no_grad(), capture_attention(model) as record:
        model(**inputs)
    chunks: dict = {}
    with torch.no_grad(), stream_attention(model, lambda block, chunk: chunks.setdefault(block.key, []).append(chunk),
                                           query_chunk=3):
        model(**inputs)
    assert sorted(chunks) == sorted(record)
    for key, probs in record.items():
        streamed = torch.cat([c.full() for c in chunks[key]], 2)
        assert torch.equal(streamed, probs), key
    assert torch.equal(record[("dec_self", 0)][..., 0, 1:], torch.zeros_like(record[("dec_self", 0)][..., 0, 1:]))


@pytest.mark.parametrize("engine", ["fused", "chunked"])
def test_the_default_engines_write_what_eager_writes(engine, tmp_path):
    tokenizer = word_tokenizer()
    path = tmp_path / "tb.conllu"
    path.write_text(SAMPLE_CONLLU, encoding="utf-8")
    counts = np.arange(tokenizer.vocab_size, dtype=np.int64) % 5 + 1

    def run(engine_name: str, query_chunk):
        config = AnalysisConfig(batch_size=3, top_frequent=3, window=4, top_k=3, engine=engine_name,
                                query_chunk=query_chunk, sensitivity=True)
        # a fresh model for each run: its router casts its own weights to float32 in its first forward (router_dtype)
        return analyze_heads(_nllb_moe(), tokenizer, path, target_conllu=path, config=config,
                             frequencies=TokenFrequencies(counts, "hand-set"))

    expected = _written(run("eager", None).results.values(), tmp_path / "eager")
    got = _written(run(engine, 3).results.values(), tmp_path / engine)
    assert len(got) > 10
    _assert_close(got, expected, atol=1e-8)


def test_the_kernel_takes_its_eager_masks_and_writes_what_eager_writes(tmp_path, monkeypatch):
    """The kernel engine (triton's interpreter on the CPU) on NLLB-MoE: its eager masks, which only hide keys, reach the
    kernel as boolean masks (``attention._as_boolean``), every block of every batch runs in the kernel (no fallback
    for a float mask), and the files equal the eager engine's."""
    pytest.importorskip("triton")
    from headlab.data import attention_kernel
    from headlab.data.attention_kernel import interpreted

    if not interpreted():
        pytest.skip("runs in triton's interpreter (CPU)")
    launches = []
    real = attention_kernel.attention_statistics

    def counted(*args, **kwargs):
        launches.append(kwargs.get("mask") is None or kwargs["mask"].dtype == torch.bool)
        return real(*args, **kwargs)

    monkeypatch.setattr(attention_kernel, "attention_statistics", counted)
    tokenizer = word_tokenizer()
    path = tmp_path / "tb.conllu"
    path.write_text(SAMPLE_CONLLU, encoding="utf-8")
    counts = np.arange(tokenizer.vocab_size, dtype=np.int64) % 5 + 1
    written, reports = {}, {}
    for engine in ("eager", "kernel"):
        config = AnalysisConfig(batch_size=3, top_frequent=3, window=4, top_k=3, engine=engine, sensitivity=True)
        analysis = analyze_heads(_nllb_moe(), tokenizer, path, target_conllu=path, config=config,
                                 frequencies=TokenFrequencies(counts, "hand-set"))
        written[engine], reports[engine] = _written(analysis.results.values(), tmp_path / engine), analysis.report
    assert launches and all(launches)
    assert "additive float" not in str(reports["kernel"].kernel_fallback)
    _assert_close(written["kernel"], written["eager"], atol=1e-8)
