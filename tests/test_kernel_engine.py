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


@pytest.mark.parametrize(("family", "words", "fallback"), [
    ("t5", "word", "model"),  # T5's position bias: the kernel refuses the model, once
    ("bert", "bpe", "word statistics"),  # words of several subwords: no word passes in any batch
])
def test_what_the_kernel_cannot_serve_runs_fused_and_says_so(tmp_path, family, words, fallback):
    from support.treebank import bpe_tokenizer
    from test_chunked_statistics import TOKENIZER_TEXTS

    tokenizer = word_tokenizer() if words == "word" else bpe_tokenizer(TOKENIZER_TEXTS * 3, vocab_size=45)
    fused = _analyse(family, tmp_path, tokenizer, "fused")
    kernel = _analyse(family, tmp_path, tokenizer, "kernel")
    assert list(kernel.report.kernel_fallback) == [fallback]
    assert "instead of the kernel" in kernel.report.describe()
    assert kernel.report.to_json()["kernel_fallback"] == kernel.report.kernel_fallback
    assert "kernel_fallback" not in fused.report.to_json()
    _assert_close(_written(kernel.results.values(), tmp_path / "kernel"),
                  _written(fused.results.values(), tmp_path / "fused"), atol=0.0)


def test_bfloat16_under_the_interpreter_runs_fused_and_says_so(tmp_path):
    """Regression: triton's interpreter multiplies bfloat16's bit patterns in ``tl.dot``
    (triton-lang/triton#11584), so a bfloat16 model's kernel statistics were garbage on the CPU
    (offsets, counts, entropies all wrong, silently). The kernel now refuses bfloat16 there: the
    fused engine runs, recorded, and the files are its own."""
    import torch

    path = tmp_path / "tb.conllu"
    path.write_text(SAMPLE_CONLLU, encoding="utf-8")
    model = tiny_model("bert", attn_implementation="sdpa").to(torch.bfloat16)
    written, reports = {}, {}
    for engine in ("fused", "kernel"):
        config = AnalysisConfig(batch_size=3, window=4, top_k=3, engine=engine)
        analysis = analyze_heads(model, word_tokenizer(), path, config=config)
        written[engine], reports[engine] = _written(analysis.results.values(), tmp_path / engine), analysis.report
    assert list(reports["kernel"].kernel_fallback) == ["model"]
    assert "bfloat16 under triton's interpreter" in reports["kernel"].kernel_fallback["model"]
    _assert_close(written["kernel"], written["fused"], atol=0.0)


def test_a_statistic_without_the_kernel_passes_sends_the_call_to_fused(tmp_path):
    """``--min-weight`` > 0: the aggregate statistics declare no fused passes (a threshold on each
    weight is no sum linear in the weights), so every call runs fused, named by the statistic."""
    path = tmp_path / "tb.conllu"
    path.write_text(SAMPLE_CONLLU, encoding="utf-8")
    model = tiny_model("bert", attn_implementation="sdpa").double()
    written = {}
    for engine in ("fused", "kernel"):
        config = AnalysisConfig(batch_size=3, window=4, top_k=3, engine=engine, functions=False, min_weight=0.1)
        analysis = analyze_heads(model, word_tokenizer(), path, config=config)
        written[engine] = _written(analysis.results.values(), tmp_path / engine)
    assert analysis.report.kernel_fallback == {"aggregate": "it declares no fused passes"}
    _assert_close(written["kernel"], written["fused"], atol=0.0)


def test_the_kernel_engine_is_refused_where_it_cannot_run(tmp_path, monkeypatch):
    import importlib.util

    from headlab.errors import HeadlabError

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # a CPU outside the interpreter
    path = tmp_path / "tb.conllu"
    path.write_text(SAMPLE_CONLLU, encoding="utf-8")
    with pytest.raises(HeadlabError, match="runs on a CUDA GPU; the model is on cpu"):
        analyze_heads(tiny_model("bert"), word_tokenizer(), path, config=AnalysisConfig(engine="kernel"))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else object())
    with pytest.raises(HeadlabError, match="needs triton"):
        AnalysisConfig(engine="kernel")


@pytest.mark.parametrize("command", ["functions", "aggregate"])
def test_cli_engine_kernel_writes_the_fused_files(tmp_path, command, monkeypatch):
    """``headlab functions|aggregate --engine kernel`` on a tiny saved Marian model (word-level
    tokenizer: every statistic from the kernel) writes the files ``--engine fused`` writes."""
    import json

    from headlab.cli import main
    from support.treebank import word_tokenizer as saved_word_tokenizer

    words = [line.split("\t")[1] for line in SAMPLE_CONLLU.splitlines() if line and not line.startswith("#")]
    model_dir = tmp_path / "tiny-marian"
    tiny_model("marian").save_pretrained(model_dir)
    saved_word_tokenizer(words).save_pretrained(model_dir)
    conllu = tmp_path / "tb.conllu"
    conllu.write_text(SAMPLE_CONLLU, encoding="utf-8")
    launches = []

    def counted(*args, **kwargs):
        launches.append(args[0].shape)
        return attention_statistics(*args, **kwargs)

    monkeypatch.setattr(attention_kernel, "attention_statistics", counted)
    files = {}
    for engine in ("fused", "kernel"):
        assert not launches  # none before the kernel run
        out = tmp_path / engine
        assert main([command, str(model_dir), "--conllu", str(conllu), "--out", str(out), "--no-progress",
                     "--batch-size", "2", "--engine", engine, "--no-figures"]) == 0
        summary = json.loads((out / "summary.json").read_text())
        assert summary["config"]["engine"] == engine and "kernel_fallback" not in summary["report"]
        files[engine] = {str(p.relative_to(out)): json.loads(p.read_text()) for p in sorted(out.rglob("*.json"))
                         if p.name != "summary.json" and ".headlab" not in p.parts}  # not the run's own records
    assert len(files["kernel"]) > 3 and launches
    # float32: the same decisions, the sums to float32 rounding
    _assert_close(files["kernel"], files["fused"], atol=1e-6, rtol=1e-5)


def test_rows_that_see_no_key_get_the_eager_uniform_row(tmp_path, monkeypatch):
    """A sliding window of 2 on a causal model: transformers' 4-d mask hides every key from a pad
    row two or more past its sentence's end (the keys in its window are pads; headlab pads on the
    right, so this is where such rows occur in an analysis). The kernel returns lse = -inf and 0 there; the
    engine (``_Feeder.on_kernel``) puts eager's row back, the softmax of the float minimum over
    every key: the mean of the values. Each output equals eager attention on its call, rows that see
    no key included, and the files equal the fused engine's."""
    import torch

    from headlab.functions import analysis as analysis_module

    calls = []
    on_kernel = analysis_module._Feeder.on_kernel

    def recorded(self, block, call):
        output = on_kernel(self, block, call)
        if output is not None:
            calls.append((call, output))
        return output

    monkeypatch.setattr(analysis_module._Feeder, "on_kernel", recorded)
    path = tmp_path / "tb.conllu"
    path.write_text(SAMPLE_CONLLU, encoding="utf-8")
    model = _sliding_mistral()
    tokenizer = word_tokenizer()
    written = {}
    for engine in ("fused", "kernel"):
        config = AnalysisConfig(batch_size=3, window=4, top_k=3, engine=engine, functions=False)
        analysis = analyze_heads(model, tokenizer, path, config=config)
        assert analysis.report.kernel_fallback == {}
        written[engine] = _written(analysis.results.values(), tmp_path / engine)
    _assert_close(written["kernel"], written["fused"], atol=1e-8)
    hidden_rows = 0
    for call, output in calls:
        q, k, v, mask = call.query, call.key, call.value, call.mask
        if mask is None:  # a batch without padding: the kernel's causal flag
            assert call.causal
            mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()[None, None]
        assert mask.dim() == 4 and mask.dtype == torch.bool
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        scores = (q @ k.transpose(-1, -2) * call.scaling).masked_fill(~mask, torch.finfo(q.dtype).min)
        eager = (scores.softmax(-1) @ v).transpose(1, 2)  # transformers' eager attention
        torch.testing.assert_close(output, eager, atol=1e-10, rtol=1e-10)
        hidden_rows += int((~mask.any(-1)).sum())
    assert calls and hidden_rows  # some rows saw no key: the fix-up ran


def _sliding_mistral():
    """Tiny Mistral (llama's tiny config) whose layers attend through a sliding window of 2."""
    import torch
    import transformers as tf

    config = tf.MistralConfig(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                              bos_token_id=0, eos_token_id=1, pad_token_id=2, sliding_window=2)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return tf.MistralForCausalLM(config).eval().double()


def test_analyze_engine_kernel_writes_the_fused_files(tmp_path, monkeypatch, capsys):
    """``headlab analyze --engine kernel`` (confidence, functions and aggregate in the kernel) writes
    the files ``--engine fused`` writes; outside the interpreter on the CPU it is refused before the
    first stage, as ``functions --engine kernel`` is."""
    import json

    from headlab.cli import main
    from test_kernel_confidence import _saved_marian

    model_dir = _saved_marian(tmp_path)
    launches = []

    def counted(*args, **kwargs):
        launches.append(args[0].shape)
        return attention_statistics(*args, **kwargs)

    monkeypatch.setattr(attention_kernel, "attention_statistics", counted)

    def analyze(out: str, engine: str | None = None) -> int:
        return main(["analyze", str(model_dir), "--source", str(tmp_path / "src.txt"), "--conllu",
                     str(tmp_path / "tb.conllu"), "--out", str(tmp_path / out), "--no-progress", "--batch-size",
                     "2", "--engine", engine or out, "--skip", "lrp", "gradient", "prune", "figures", "attention",
                     "report"])

    files = {}
    for engine in ("fused", "kernel"):
        assert not launches  # none before the kernel run
        assert analyze(engine) == 0
        out = tmp_path / engine
        summary = json.loads((out / "functions" / "summary.json").read_text())
        assert summary["config"]["engine"] == engine and "kernel_fallback" not in summary["report"]
        assert "instead of the kernel" not in capsys.readouterr().err  # aggregate's fallbacks are logged
        files[engine] = {str(p.relative_to(out)): json.loads(p.read_text()) for p in sorted(out.rglob("*.json"))
                         if p.name not in ("summary.json", "manifest.json") and ".headlab" not in p.parts}
    assert launches and {"importance/confidence.json", "aggregate/dependency_alignment.json"} <= set(files["kernel"])
    assert files["kernel"].keys() == files["fused"].keys()
    _assert_close(files["kernel"], files["fused"], atol=1e-6, rtol=1e-5)  # float32: sums to rounding

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # a CPU outside the interpreter
    capsys.readouterr()
    assert analyze("refused", "kernel") == 2
    assert "--engine kernel runs on a CUDA GPU; the model is on cpu" in capsys.readouterr().err
    assert not (tmp_path / "refused" / "importance").exists()


def test_eager_attention_that_returns_nan_is_refused_not_averaged(tmp_path):
    """Transformers' eager attention on a padded batch under a sliding window gives this float64 model's
    pad rows that see no key NaN weights (float64's lowest mask value is -inf in its float32 softmax; in
    float32 the same model is finite), and the next layer's real rows read their NaN values: the eager
    engine wrote NaN statistics for layer 1 (dependency alignment None) where fused and kernel agree.
    Refused, naming the float64 mask (session 27: it named the sliding window alone)."""
    from headlab.errors import HeadlabError

    path = tmp_path / "tb.conllu"
    path.write_text(SAMPLE_CONLLU, encoding="utf-8")
    config = AnalysisConfig(batch_size=3, window=4, top_k=3, engine="eager", functions=False)
    with pytest.raises(HeadlabError, match="NaN weights for queries that may attend to no key .*float64 attention mask"):
        analyze_heads(_sliding_mistral(), word_tokenizer(), path, config=config)
