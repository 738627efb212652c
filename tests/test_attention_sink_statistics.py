"""What headlab's attention maps and statistics mean on models with learned attention sinks.

One meaning for every sink family (docs/foundation.md, "Attention sinks"): a map holds the weights each head
applies to its values, the sink's share left out, so a row sums to less than 1. That is what GPT-OSS's, Flint's
and MiMo-V2-Flash's eager attention returns; Granite-SWA's and GraniteMoE-SWA's returns the softmax without the
sink and scales the head's output after, and headlab's capture returns that softmax times the scale (the one
documented difference from ``output_attentions``). Every engine (eager, chunked, fused; kernel, which refuses
sinks and leaves the calls to the fused path, recorded) and confidence give the same numbers on that meaning.

Before: the maps of Granite-SWA were the pre-sink softmax (not the weights its values got), and every engine but
eager stopped mid-forward with "headlab's chunked attention does not implement attention sinks".

Tiny sink models of tests/test_attention_sinks.py (sinks far from zero, different per head), in float64.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from headlab import capture_attention
from headlab.data.frequencies import TokenFrequencies
from headlab.functions import AnalysisConfig, analyze_heads
from headlab.functions.registry import STATISTICS
from headlab.importance import ImportanceData, compute_confidence, describe_model
from support.family_matrix import check_confidence_on_every_engine, tiny_inputs
from support.treebank import SAMPLE_CONLLU
from test_attention_sinks import SINK_FAMILIES, SINKS, _has_sinks, _layers, sink_model
from test_chunked_statistics import _assert_close, _written
from test_fused_statistics import word_tokenizer

pytestmark = pytest.mark.unit

SCALED_AFTER = ("granite_swa", "granitemoe_swa")
# Their eager softmax (and sink scale) is taken in float32 whatever the model's dtype: eager agrees to that.
FLOAT32_EAGER = {*SCALED_AFTER, "flint"}


def _model(family: str) -> torch.nn.Module:
    model = sink_model(family).double()
    if hasattr(model, "set_experts_implementation"):  # grouped_mm takes no float64
        model.set_experts_implementation("eager")
    return model


@pytest.mark.parametrize("family", SINK_FAMILIES)
def test_maps_are_the_weights_each_head_applies_to_its_values(family):
    """Captured map @ the head's values == the head's output (the output projection's input), for every family;
    the rows of a layer with sinks sum to less than 1. GPT-OSS-style families: the map is output_attentions;
    Granite-SWA's: output_attentions (rows of 1) times sigmoid(lse - sink), checked against the scale worked out
    here from the head's output. Before: Granite-SWA's map was the pre-sink softmax, whose product is not the
    output."""
    model = _model(family)
    inputs = tiny_inputs()
    values, outputs, hooks = {}, {}, []
    for i, layer in enumerate(_layers(model)):
        attention = layer.self_attn
        hooks.append(attention.v_proj.register_forward_hook(lambda m, a, out, i=i: values.__setitem__(i, out)))
        hooks.append(attention.o_proj.register_forward_pre_hook(lambda m, a, i=i: outputs.__setitem__(i, a[0])))
    with capture_attention(model) as record, torch.no_grad():
        model(**inputs, use_cache=False)
    for hook in hooks:
        hook.remove()
    with torch.no_grad():
        reference = model(**inputs, output_attentions=True, use_cache=False).attentions
    for (_, layer), probs in record.items():
        B, H, T, _ = probs.shape
        v = values[layer].view(B, T, -1, 8).transpose(1, 2) * getattr(_layers(model)[layer].self_attn, "v_scale", 1.0)
        v = v.repeat_interleave(H // v.shape[1], dim=1)
        applied = outputs[layer].view(B, T, H, -1).transpose(1, 2)
        torch.testing.assert_close(probs @ v, applied, atol=1e-10, rtol=1e-10)
        rows = probs[0].sum(-1)  # the unpadded row
        if _has_sinks(family, layer):
            assert (rows < 1 - 1e-3).all()
        else:
            torch.testing.assert_close(rows, torch.ones_like(rows))
        if family in SCALED_AFTER:  # the documented exception: output_attentions is the softmax before the sink
            pre = reference[layer]
            torch.testing.assert_close(pre[0].sum(-1), torch.ones_like(rows))
            scale = probs.sum(-1, keepdim=True) / pre.sum(-1, keepdim=True)  # sigmoid(lse - sink) per row
            torch.testing.assert_close(probs, pre * scale, atol=1e-12, rtol=0)
            # independently: the share left to the sink is exp(sink) / (sum_j exp(s_ij) + exp(sink))
            assert float(scale[0, int(SINKS[layer].argmax())].mean()) < float(scale[0, int(SINKS[layer].argmin())].mean())
        else:
            assert torch.equal(probs, reference[layer])


def _analyse(model, tmp_path, engine, query_chunk=None):
    path = tmp_path / "tb.conllu"
    path.write_text(SAMPLE_CONLLU, encoding="utf-8")
    tokenizer = word_tokenizer()
    counts = np.arange(tokenizer.vocab_size, dtype=np.int64) % 5 + 1
    config = AnalysisConfig(batch_size=3, top_frequent=3, window=4, top_k=3, engine=engine, query_chunk=query_chunk,
                            sensitivity=True)
    return analyze_heads(model, tokenizer, path, config=config, frequencies=TokenFrequencies(counts, "hand-set"))


@pytest.mark.parametrize("family", SINK_FAMILIES)
def test_every_engine_gives_the_eager_statistics(tmp_path, family, caplog):
    """functions + aggregate under eager, chunked, fused and the default (fused: headlab's attention function
    takes the sinks) agree in float64; the fused entropy, read from the scores and the row's largest weight, holds
    with rows below 1. Before: chunked and fused stopped mid-forward (NotImplementedError, s_aux)."""
    model = _model(family)
    eager = _written(_analyse(model, tmp_path, "eager").results.values(), tmp_path / "eager")
    chunked = _written(_analyse(model, tmp_path, "chunked", query_chunk=3).results.values(), tmp_path / "chunked")
    fused = _analyse(model, tmp_path, "fused", query_chunk=3)
    assert set(fused.results) == set(STATISTICS)
    got = _written(fused.results.values(), tmp_path / "fused")
    assert len(got) > 10
    _assert_close(got, chunked, atol=1e-8)
    rtol = 1e-6 if family in FLOAT32_EAGER else 0.0
    _assert_close(chunked, eager, atol=1e-8, rtol=rtol)
    _assert_close(got, eager, atol=1e-8, rtol=rtol)
    with caplog.at_level(logging.INFO, logger="headlab.functions.analysis"):
        default = _written(_analyse(model, tmp_path, None).results.values(), tmp_path / "default")
    assert "not the fused engine" not in caplog.text  # the sinks no longer send the default to eager
    _assert_close(default, eager, atol=1e-8, rtol=rtol)


def test_kernel_refuses_the_sinks_and_the_fused_path_gives_the_eager_statistics(tmp_path):
    """The kernel computes no sink: each call goes to the fused path, recorded (kernel_fallback names the sinks),
    and the files are the fused engine's. Before: the call reached the kernel marked sink-free (sinks=False) and
    the forward stopped on s_aux."""
    pytest.importorskip("triton")
    from headlab.data.attention_kernel import interpreted

    if not interpreted():
        pytest.skip("runs in triton's interpreter (CPU)")
    model = _model("gpt_oss")
    fused = _written(_analyse(model, tmp_path, "fused", query_chunk=3).results.values(), tmp_path / "fused")
    kernel = _analyse(model, tmp_path, "kernel")
    assert "sinks" in str(kernel.report.kernel_fallback)
    _assert_close(_written(kernel.results.values(), tmp_path / "kernel"), fused, atol=1e-8)


def _confidence_data(model):
    info = describe_model(model)
    data = ImportanceData.from_ids([[5, 17, 33, 41, 8, 1], [9, 60, 22, 1], [70, 12, 45, 31, 28, 90, 3, 1]])
    return data, info


@pytest.mark.parametrize("family", SINK_FAMILIES)
def test_confidence_is_the_same_on_every_engine(family):
    """Confidence (the largest weight a query gives an allowed key, the sink's share left out) under eager, fused
    (default) and chunked query rows: the same scores. Before: fused and chunked stopped mid-forward; and on
    Granite-SWA the eager maxima were of the pre-sink softmax."""
    model = _model(family)
    data, info = _confidence_data(model)
    rtol = 1e-6 if family in FLOAT32_EAGER else 1e-12
    eager = check_confidence_on_every_engine(model, data, info, rtol=rtol)
    # the maxima of weights below 1 in every row of a sink layer: every head's confidence below the sink-free one
    with torch.no_grad():
        for attention in (a.self_attn for a in _layers(model)):
            if attention.sinks is not None:
                attention.sinks.fill_(-1e4)
    free = compute_confidence(model, data, info, batch_size=2, engine="eager")
    for kind in eager.kinds:
        for layer in range(2):
            if _has_sinks(family, layer):
                assert (eager[kind][layer] < free[kind][layer]).all()
