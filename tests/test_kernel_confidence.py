"""Confidence on the kernel engine (``engine="kernel"``: one pass of headlab.data.attention_kernel per
attention call, the allowed keys as its eligible set, the largest allowed weight ``exp(max score - lse)``)
equals the fused and eager confidence; and ``analyze`` runs a stage again when ``--engine`` changes.
Float64 tiny models, Triton's interpreter on the CPU (tests/conftest.py sets ``TRITON_INTERPRET=1``);
the kernel's tests are skipped without triton."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from headlab.attention import AttentionCall  # noqa: E402
from headlab.data import attention_kernel  # noqa: E402
from headlab.data.attention_kernel import attention_statistics, interpreted  # noqa: E402
from headlab.errors import HeadlabError  # noqa: E402
from headlab.importance import ImportanceData, compute_confidence, describe_model, translate_data  # noqa: E402
from headlab.importance.confidence import _hides_later_keys, kernel_maxima, row_maxima  # noqa: E402
from support.models import tiny_model  # noqa: E402
from support.treebank import SAMPLE_CONLLU  # noqa: E402
from test_importance_confidence import SEP, _by_hand, _sentences  # noqa: E402

pytestmark = pytest.mark.unit
needs_kernel = pytest.mark.skipif(not interpreted(), reason="runs in triton's interpreter (CPU)")


@pytest.fixture
def launches(monkeypatch):
    """Every kernel launch (the query's shape), wherever headlab makes it."""
    made: list = []

    def counted(*args, **kwargs):
        made.append(args[0].shape)
        return attention_statistics(*args, **kwargs)

    monkeypatch.setattr(attention_kernel, "attention_statistics", counted)
    return made


def _data(model):
    info = describe_model(model)
    eos = min(info.eos_ids) if info.eos_ids else 1
    info = replace(info, special_ids=info.special_ids | {SEP, eos})
    data = ImportanceData.from_ids(_sentences(eos))  # 4 sentences of 5 to 8 tokens: padded batches of 3
    if info.is_seq2seq:
        data = translate_data(model, data, info, max_length_a=0, max_length_b=5)
    return data, info


# Llama's eager softmax runs in float32 whatever the model's dtype: eager agrees to float32 rounding there.
@needs_kernel
@pytest.mark.parametrize("family, blocks, eager_rtol", [("llama", 2, 1e-6), ("bert", 2, 0), ("marian", 6, 0)])
def test_kernel_confidence_equals_fused_and_eager(family, blocks, eager_rtol, launches):
    model = tiny_model(family, attn_implementation="sdpa").double()
    data, info = _data(model)
    fused = compute_confidence(model, data, info, batch_size=3, engine="fused")
    eager = compute_confidence(model, data, info, batch_size=3, engine="eager")
    assert not launches
    kernel = compute_confidence(model, data, info, batch_size=3, engine="kernel")
    assert len(launches) == 2 * blocks  # every block of both batches (padded: a mask) in the kernel
    assert "kernel_fallback" not in kernel.signature and kernel.signature == fused.signature
    assert kernel.kinds == fused.kinds
    for kind in fused.kinds:
        np.testing.assert_allclose(kernel[kind], fused[kind], rtol=0, atol=1e-8)
        np.testing.assert_allclose(kernel[kind], eager[kind], rtol=eager_rtol, atol=1e-8)


# Regression: row_maxima took the weights to float32 (and the kernel's maxima were summed in float32),
# so a float64 model's confidence was float32-accurate (~1e-8) on every engine.
@pytest.mark.parametrize("engine", ["eager", "fused", pytest.param("kernel", marks=needs_kernel)])
@pytest.mark.parametrize("family", ["bert", "marian", "gpt2"])
def test_float64_confidence_is_float64_accurate(family, engine, launches):
    """Against the hand computation (one sentence at a time, Python loops) on transformers' own
    float64 eager weights (these families' eager softmax keeps the model's dtype)."""
    model = tiny_model(family, attn_implementation="sdpa").double()
    data, info = _data(model)
    scores = compute_confidence(model, data, info, batch_size=3, engine=engine)
    assert bool(launches) == (engine == "kernel") and "kernel_fallback" not in scores.signature
    expected = _by_hand(tiny_model(family, attn_implementation="eager").double(), info, data, family)
    assert set(scores.kinds) == {kind for kind, _ in expected}
    for (kind, layer), values in expected.items():
        np.testing.assert_allclose(scores[kind][layer], values, rtol=0, atol=1e-12)


@needs_kernel
def test_bfloat16_under_the_interpreter_runs_fused_and_is_recorded(launches):
    """Regression: triton's interpreter multiplies bfloat16's bit patterns in ``tl.dot``
    (triton-lang/triton#11584): a bfloat16 Marian's kernel confidence was 0.12 where the fused
    engine's is 0.85, silently. The kernel refuses bfloat16 there: the fused path runs, recorded."""
    model = tiny_model("marian", attn_implementation="sdpa").to(torch.bfloat16)
    data, info = _data(model)
    fused = compute_confidence(model, data, info, batch_size=3, engine="fused")
    kernel = compute_confidence(model, data, info, batch_size=3, engine="kernel")
    assert not launches
    assert "bfloat16 under triton's interpreter" in kernel.signature["kernel_fallback"]["model"]
    for kind in fused.kinds:
        np.testing.assert_array_equal(kernel[kind], fused[kind])


def _eager_probs(q, k, v, mask):
    """Transformers' eager attention weights: a hidden key's score is the float minimum (a row that
    sees no key is uniform), as headlab's attention function fills it."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    scores = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(~mask, torch.finfo(torch.float32).min)
    return scores.softmax(-1)


@needs_kernel
@pytest.mark.parametrize("case", ["causal", "padding", "causal_mask", "cross"])
def test_kernel_maxima_are_the_row_maxima_in_float64(case):
    """:func:`kernel_maxima` against :func:`row_maxima`'s masked maximum taken in float64 (row_maxima
    rounds to float32): the queries counted are the same, and on them the maxima agree to 1e-12,
    including rows that see no allowed key (0), rows that see no key at all (uniform: 1 / keys), a
    sentence with no allowed key, and queries past the causal diagonal of every allowed key."""
    g = torch.Generator().manual_seed(5)
    B, H, Hkv, d = 3, 4, 2, 8
    Q, K = (5, 7) if case == "cross" else (7, 7)
    q = torch.randn(B, H, Q, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, Hkv, K, d, generator=g, dtype=torch.float64) for _ in range(2))
    keys = torch.rand(B, K, generator=g) > 0.4
    keys[0, :2] = False  # the first queries of sentence 0 see no allowed key (causal)
    keys[2] = False  # sentence 2: no allowed key at all
    queries = torch.rand(B, Q, generator=g) > 0.2
    lengths = torch.tensor([K, K - 2, 0 if case == "padding" else K - 3])  # sentence 2 padded away under "padding"
    padding = torch.arange(K)[None, :] < lengths[:, None]  # [B, K]
    causal = case in ("causal", "causal_mask")
    mask = None
    if case in ("padding", "cross"):
        mask = padding[:, None, None, :]
    elif case == "causal_mask":  # a causal window of 2 keys with padding: late pad rows see no key
        window = torch.ones(Q, K, dtype=torch.bool).tril() & ~torch.ones(Q, K, dtype=torch.bool).tril(-2)
        mask = (window[None] & padding[:, None, :])[:, None]
    stats = attention_statistics(q, k, v, causal=case == "causal", mask=mask, eligible=keys)
    best, counted = kernel_maxima(stats, queries, keys, causal)
    seen = torch.ones(Q, K, dtype=torch.bool).tril()[None, None] if case == "causal" else mask
    probs = _eager_probs(q, k, v, seen.expand(B, H, Q, K))
    allowed = keys[:, None, :].expand(-1, Q, -1)
    if causal:
        allowed = allowed & torch.ones(Q, K, dtype=torch.bool).tril()
    reference = probs.masked_fill(~allowed[:, None], -1.0).amax(-1)  # row_maxima's maximum, in float64
    assert torch.equal(counted, row_maxima(probs, queries, keys, causal)[1])
    assert counted.any() and (~counted & queries).any()
    assert best.dtype == torch.float64 and best.isfinite().all()
    rows = counted[:, None].expand_as(best)
    torch.testing.assert_close(best[rows], reference[rows], atol=1e-12, rtol=0)
    if case == "causal_mask":  # some counted rows saw no key: uniform over every key
        assert (stats.lse.isneginf() & rows).any()
    if case == "padding":  # sentence 2's rows see no key (and have no allowed key: not counted, but finite)
        assert stats.lse[2].isneginf().all()


def test_hides_later_keys():
    q = torch.zeros(1, 1, 3, 4)
    kv = torch.zeros(1, 1, 3, 4)
    call = lambda mask, causal=False: AttentionCall(q, kv, kv, mask, causal, 1.0)  # noqa: E731
    lower = torch.ones(3, 3, dtype=torch.bool).tril()[None, None]
    assert _hides_later_keys(call(None, causal=True)) and _hides_later_keys(call(lower))
    assert _hides_later_keys(call(lower), rows=2)  # read two rows at a time
    late = lower.clone()
    late[..., 2, :] = True  # the last row is causal anyway; a key after row 1:
    late[..., 1, 2] = True
    assert not _hides_later_keys(call(late), rows=1) and not _hides_later_keys(call(late), rows=2)
    assert not _hides_later_keys(call(None)) and not _hides_later_keys(call(torch.ones_like(lower)))
    padding = torch.tensor([True, True, False])[None, None, None]  # [1, 1, 1, keys]: no causal mask
    assert not _hides_later_keys(call(padding), rows=1)
    one = torch.zeros(1, 1, 1, 4)
    assert _hides_later_keys(AttentionCall(one, one, one, None, False, 1.0))  # one key: none later


@needs_kernel
def test_a_batch_of_one_token_sentences_runs_in_the_kernel(launches):
    """Regression: a batch of one-token sentences in a causal LM (no padding: transformers passes
    neither a mask nor the causal flag for one query) fell back to the fused path as "decoder
    self-attention that does not hide later keys", though one key has none after it."""
    model = tiny_model("gpt2", attn_implementation="sdpa").double()
    info = describe_model(model)
    data = ImportanceData.from_ids([[43], [15], [77]])
    fused = compute_confidence(model, data, info, batch_size=3, engine="fused")
    kernel = compute_confidence(model, data, info, batch_size=3, engine="kernel")
    assert launches and "kernel_fallback" not in kernel.signature and kernel.signature == fused.signature
    for kind in fused.kinds:
        np.testing.assert_array_equal(kernel[kind], fused[kind])


@needs_kernel
def test_what_the_kernel_cannot_compute_runs_fused_and_is_recorded(launches, caplog):
    """T5's position bias: the kernel refuses the model once (logged once), every call runs on the
    fused path (the same scores to the bit) and the signature says why."""
    model = tiny_model("t5", attn_implementation="sdpa").double()
    data, info = _data(model)
    fused = compute_confidence(model, data, info, batch_size=3, engine="fused")
    with caplog.at_level("WARNING", logger="headlab.importance.confidence"):
        kernel = compute_confidence(model, data, info, batch_size=3, engine="kernel")
    assert not launches
    assert list(kernel.signature["kernel_fallback"]) == ["model"]
    assert "position bias" in kernel.signature["kernel_fallback"]["model"]
    assert sum("instead of the kernel" in r.message for r in caplog.records) == 1
    for kind in fused.kinds:
        np.testing.assert_array_equal(kernel[kind], fused[kind])


@needs_kernel
def test_a_model_outside_the_attention_function_runs_eager_and_is_recorded(launches, monkeypatch, caplog):
    """A model whose attention does not dispatch through transformers' attention interface cannot
    reach the kernel (nor the fused path): the eager reference, said once and in the signature."""
    import headlab.capture

    model = tiny_model("bert", attn_implementation="sdpa").double()
    data, info = _data(model)
    eager = compute_confidence(model, data, info, batch_size=3, engine="eager")
    monkeypatch.setattr(headlab.capture, "unregistrable", lambda blocks: blocks[:1])
    with caplog.at_level("WARNING", logger="headlab.importance.confidence"):
        kernel = compute_confidence(model, data, info, batch_size=3, engine="kernel")
    assert not launches and list(kernel.signature["kernel_fallback"]) == ["model"]
    assert "AttentionInterface" in kernel.signature["kernel_fallback"]["model"]
    assert sum("the eager path instead of the kernel" in r.message for r in caplog.records) == 1
    for kind in eager.kinds:
        np.testing.assert_array_equal(kernel[kind], eager[kind])


@needs_kernel
def test_a_sharded_run_records_every_process_fallback(monkeypatch):
    """Several processes: the reasons another process recorded reach the signature the main one writes."""
    from headlab import shard as shard_module
    from headlab.importance import confidence

    class TwoProcesses(shard_module.Shard):  # the main process of two; process 1 ran no batch here
        def gather(self, value):
            if isinstance(value, dict):  # the fallback reasons
                return [value, {"dec_self": "decoder self-attention that does not hide later keys"}]
            return [value, []]  # the ledger's parts

    monkeypatch.setattr(confidence, "active", lambda: TwoProcesses(rank=0, world=2))
    model = tiny_model("llama", attn_implementation="sdpa").double()
    data, info = _data(model)
    scores = compute_confidence(model, data, info, batch_size=3, engine="kernel")
    assert scores.signature["kernel_fallback"] == {"dec_self": "decoder self-attention that does not hide later keys"}


@needs_kernel
def test_the_kernel_engine_is_refused_where_it_cannot_run(monkeypatch):
    import importlib.util

    from headlab.importance.measure_options import ConfidenceOptions

    model = tiny_model("bert")
    data, info = _data(model)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # a CPU outside the interpreter
    with pytest.raises(HeadlabError, match="runs on a CUDA GPU; the model is on cpu"):
        compute_confidence(model, data, info, engine="kernel")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else object())
    with pytest.raises(HeadlabError, match="needs triton"):
        ConfidenceOptions(engine="kernel")


def _saved_marian(tmp_path):
    """A tiny saved Marian model with a word-level tokenizer, and the sample treebank's sentences."""
    from support.treebank import word_tokenizer as saved_word_tokenizer

    sentences = [" ".join(line.split("\t")[1] for line in block.splitlines() if line and not line.startswith("#")
                          and line.split("\t")[0].isdigit()) for block in SAMPLE_CONLLU.strip().split("\n\n")]
    model_dir = tmp_path / "tiny-marian"
    tiny_model("marian").save_pretrained(model_dir)
    saved_word_tokenizer(" ".join(sentences).split()).save_pretrained(model_dir)
    (tmp_path / "tb.conllu").write_text(SAMPLE_CONLLU, encoding="utf-8")
    (tmp_path / "src.txt").write_text("\n".join(sentences) + "\n", encoding="utf-8")
    return model_dir


@needs_kernel
def test_cli_importance_engine_kernel(tmp_path, launches, monkeypatch, capsys):
    """``headlab importance --method confidence --engine kernel`` writes the confidence of ``--engine
    fused`` (float32: to rounding); outside the interpreter on a CPU it is refused before the model loads."""
    from headlab.cli import main

    model_dir = _saved_marian(tmp_path)

    def importance(engine: str, out: str | None = None) -> int:
        return main(["importance", str(model_dir), "--source", str(tmp_path / "src.txt"), "--method", "confidence",
                     "--out", str(tmp_path / (out or engine)), "--no-progress", "--batch-size", "2", "--engine", engine])

    scores = {}
    for engine in ("fused", "kernel"):
        assert importance(engine) == 0
        scores[engine] = json.loads((tmp_path / engine / "confidence.json").read_text())
    assert len(launches) == 2 * 6  # 2 batches x (2 encoder, 2 decoder, 2 cross-attention layers)
    assert scores["kernel"].keys() == scores["fused"].keys()
    assert scores["kernel"]["signature"] == scores["fused"]["signature"]
    for kind, rows in scores["fused"]["scores"].items():
        np.testing.assert_allclose(scores["kernel"]["scores"][kind], rows, rtol=1e-5, atol=1e-6)

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # a CPU outside the interpreter
    capsys.readouterr()
    assert importance("kernel", "refused") == 2
    assert "--engine kernel runs on a CUDA GPU; the model is on cpu" in capsys.readouterr().err
    assert not (tmp_path / "refused" / "confidence.json").exists()


@pytest.mark.parametrize("engine", [pytest.param("kernel", marks=needs_kernel), "eager"])
def test_a_resumed_analyze_runs_the_stages_again_under_another_engine(tmp_path, launches, engine):
    """The engine is part of the keys of the stages it runs (confidence, functions): ``analyze --engine
    kernel`` (or ``eager``) into a directory of ``--engine fused`` computes them again (their files
    then are that engine's, and functions/summary.json says so), and a second run with the same
    engine reuses them. Before, both were reused, summary.json saying fused."""
    from headlab.cli import main

    model_dir = _saved_marian(tmp_path)
    out = tmp_path / "out"

    def analyze(engine: str) -> int:
        return main(["analyze", str(model_dir), "--source", str(tmp_path / "src.txt"), "--conllu",
                     str(tmp_path / "tb.conllu"), "--out", str(out), "--no-progress", "--batch-size", "2",
                     "--engine", engine, "--skip", "lrp", "gradient", "aggregate", "prune", "figures", "attention",
                     "report"])

    def written() -> dict:
        return {p.name: p.stat().st_mtime_ns for p in (out / "importance" / "confidence.json",
                                                        out / "functions" / "summary.json")}

    assert analyze("fused") == 0 and not launches
    before = written()
    assert analyze(engine) == 0
    assert bool(launches) == (engine == "kernel")  # the stages in the kernel
    after = written()
    assert all(after[name] != before[name] for name in before)  # both stages ran again
    assert json.loads((out / "functions" / "summary.json").read_text())["config"]["engine"] == engine
    launches.clear()
    assert analyze(engine) == 0
    assert not launches and written() == after  # the same engine: reused


@needs_kernel
def test_api_analyze_engine_kernel_runs_confidence_in_the_kernel(tmp_path, launches, monkeypatch):
    """``headlab.analyze(..., engine="kernel")``: confidence in the kernel (every call: no fallback),
    the default engine's scores to 1e-8 in float64; refused before any work where it cannot run."""
    import headlab
    from headlab.loading import load_tokenizer

    model_dir = _saved_marian(tmp_path)
    model, tokenizer = tiny_model("marian").double(), load_tokenizer(str(model_dir))
    texts = (tmp_path / "src.txt").read_text(encoding="utf-8").splitlines()
    run = lambda engine: headlab.analyze(model, tokenizer, texts, measures=["confidence"], batch_size=2,  # noqa: E731
                                         engine=engine, attention_sentences=0)["confidence"]
    fused = run(None)
    assert not launches
    kernel = run("kernel")
    assert len(launches) == 2 * 6 and kernel.signature == fused.signature
    for kind in fused.kinds:
        np.testing.assert_allclose(kernel[kind], fused[kind], rtol=0, atol=1e-8)
    launches.clear()
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # a CPU outside the interpreter
    with pytest.raises(HeadlabError, match="runs on a CUDA GPU; the model is on cpu"):
        run("kernel")
    assert not launches
