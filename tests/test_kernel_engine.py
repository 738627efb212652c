"""The kernel engine (``engine="kernel"``: headlab.data.attention_kernel, one Triton pass per block
fed to the statistics as a :class:`~headlab.data.fused.KernelView`) writes what the fused engine
writes: float64 tiny models, a word-level tokenizer (the word passes apply), Triton's interpreter
on the CPU (tests/conftest.py sets ``TRITON_INTERPRET=1`` without a GPU)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from headlab.data import attention_kernel  # noqa: E402
from headlab.data.attention_kernel import attention_statistics, interpreted  # noqa: E402
from headlab.functions import AnalysisConfig, analyze_heads  # noqa: E402
from headlab.functions.registry import STATISTICS  # noqa: E402
from support.models import tiny_model  # noqa: E402
from support.treebank import SAMPLE_CONLLU  # noqa: E402
from test_chunked_statistics import _assert_close, _written  # noqa: E402
from test_fused_statistics import _analyse, word_tokenizer  # noqa: E402

pytestmark = [pytest.mark.unit, pytest.mark.skipif(not interpreted(), reason="runs in triton's interpreter (CPU)")]


@pytest.mark.parametrize("family", ["llama", "bert", "marian"])
def test_kernel_writes_what_fused_writes(tmp_path, family, monkeypatch):
    launches = []

    def counted(*args, **kwargs):
        launches.append(args[0].shape)
        return attention_statistics(*args, **kwargs)

    monkeypatch.setattr(attention_kernel, "attention_statistics", counted)
    tokenizer = word_tokenizer()
    fused = _analyse(family, tmp_path, tokenizer, "fused", query_chunk=3)
    assert not launches
    kernel = _analyse(family, tmp_path, tokenizer, "kernel")
    assert set(kernel.results) == set(STATISTICS)
    assert kernel.report.kernel_fallback == {} and launches  # every block of every batch in the kernel
    got = _written(kernel.results.values(), tmp_path / "kernel")
    expected = _written(fused.results.values(), tmp_path / "fused")
    assert len(got) > 10
    _assert_close(got, expected, atol=1e-8)


def test_one_sentence_per_batch_runs_the_causal_kernel_without_a_mask(tmp_path, monkeypatch):
    """One sentence per batch: no padding, so transformers gives no mask and the kernel's causal
    flag (and the arcs' causal visibility) does the masking."""
    causal = []

    def recorded(*args, **kwargs):
        causal.append((kwargs["causal"], kwargs["mask"] is None))
        return attention_statistics(*args, **kwargs)

    monkeypatch.setattr(attention_kernel, "attention_statistics", recorded)
    path = tmp_path / "tb.conllu"
    path.write_text(SAMPLE_CONLLU, encoding="utf-8")
    model = tiny_model("llama", attn_implementation="sdpa").double()
    written = {}
    for engine in ("fused", "kernel"):
        config = AnalysisConfig(batch_size=1, window=4, top_k=3, engine=engine, functions=False)
        analysis = analyze_heads(model, word_tokenizer(), path, config=config)
        written[engine] = _written(analysis.results.values(), tmp_path / engine)
    assert causal and all(flag and unmasked for flag, unmasked in causal)
    _assert_close(written["kernel"], written["fused"], atol=1e-8)
