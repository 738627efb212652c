"""The foundation on CUDA, half precision and Accelerate's big-model dispatch.

Skipped (with the reason shown) on machines without a GPU; CI has none, so these run on a
lent GPU machine: `pytest tests/test_cuda.py`.
"""

import pytest
import torch

from headlab import attention_blocks, capture_attention, load_pruned, mask_heads, prune_heads, save_pruned
from support.models import FAMILIES, logits, tiny_inputs, tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _to(inputs, device):
    return {k: v.to(device) for k, v in inputs.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_pruning_equals_masking_on_cuda(family, dtype, tmp_path):
    model = tiny_model(family).to("cuda", dtype)
    inputs = _to(tiny_inputs(family), "cuda")
    spec = {attention_blocks(model)[0].key: [1], attention_blocks(model)[1].key: [0, 1, 2, 3]}
    with mask_heads(model, spec):
        masked = logits(model, inputs)
    rtol = 1e-5 if dtype == torch.float32 else 0.0
    if dtype == torch.float32:
        tol = 1e-5
    else:
        # Half precision: the pruned model's smaller matrix products round differently, so it may
        # differ from masking by as much as the masked model itself differs from float32 (on the
        # H100, bf16 t5: 0.028 in 1 of 990 logits). Tolerance: twice that rounding error.
        with mask_heads(model.float(), spec):
            exact = logits(model, inputs)
        model.to(dtype)
        tol = 2 * (masked.float() - exact).abs().max().item() + 1e-3
    prune_heads(model, spec)
    torch.testing.assert_close(logits(model, inputs).float(), masked.float(), atol=tol, rtol=rtol)
    save_pruned(model, tmp_path / "m")
    reloaded = load_pruned(tmp_path / "m").to("cuda", dtype)
    torch.testing.assert_close(logits(reloaded, inputs).float(), logits(model, inputs).float(), atol=tol, rtol=rtol)


def test_device_map_auto(tmp_path):
    """A model dispatched by Accelerate (device_map="auto") is masked, captured and pruned alike."""
    import transformers

    tiny_model("marian").save_pretrained(tmp_path / "m")
    model = transformers.MarianMTModel.from_pretrained(tmp_path / "m", device_map="auto").eval()
    inputs = _to(tiny_inputs("marian"), next(model.parameters()).device)
    with capture_attention(model) as record:
        logits(model, inputs)
    assert record[("dec_cross", 1)].shape == (2, 4, 5, 7)
    spec = {("enc_self", 1): [0, 3]}
    with mask_heads(model, spec):
        masked = logits(model, inputs)
    prune_heads(model, spec)
    torch.testing.assert_close(logits(model, inputs), masked, atol=1e-5, rtol=1e-5)


# -- head statistics on the GPU (issue 16) ----------------------------------------------------
def _close(a, b, path="", rtol=1e-6):
    """Equal structure; integers, strings and booleans equal; floats within ``rtol`` relative
    (and 1e-12 absolute, for zeros)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            _close(a[key], b[key], f"{path}/{key}", rtol)
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{path}/{i}", rtol)
    elif isinstance(a, float) and isinstance(b, float):
        # Variability, sum |alpha - mean alpha| / (2 sum alpha), subtracts nearly equal weights: its
        # change is bounded by the weights' relative change (sum |d alpha| / sum alpha), not by its
        # own size, so it is held to that bound absolutely (on an H200 the fused engine's small
        # values moved by 3e-9 to 6e-9 absolute, 3e-5 relative).
        atol = 1e-12 + (rtol if "/variability" in path else 0.0)
        assert (a != a and b != b) or abs(a - b) <= atol + rtol * abs(b), (path, a, b)
    else:
        assert type(a) is type(b) and a == b, (path, a, b)


def _written(results, directory) -> dict:
    import json

    for result in results:
        result.write(directory)
    return {str(path.relative_to(directory)): json.loads(path.read_text(encoding="utf-8"))
            for path in sorted(directory.rglob("*.json"))}


def test_statistics_of_the_same_probabilities_on_cuda_equal_the_cpu(tmp_path):
    """Every registered statistic fed the same float32 probabilities on the GPU (a whole view, and
    WordRows views of 2 rows) and on the CPU: its sums stay on the GPU during the run, and it writes
    the CPU's files, counts and positions identical, floats within 1e-6 relative (the GPU adds
    float32 rows, such as a word's attention mass for its entropy, in another order)."""
    pytest.importorskip("conllu")
    import numpy as np

    from headlab.data.alignment import AttentionView, WordRows
    from headlab.data.frequencies import TokenFrequencies
    from headlab.functions import AnalysisConfig
    from headlab.functions.registry import STATISTICS
    from support.treebank import FakeBlock, bpe_tokenizer, sample_sentences, side_batch

    sentences = sample_sentences(tmp_path)
    tokenizer = bpe_tokenizer([" ".join(s.words) for s in sentences] * 3, vocab_size=45)
    counts = np.arange(tokenizer.vocab_size, dtype=np.int64) % 7 + 1
    config = AnalysisConfig(top_frequent=3, window=4, top_k=3, sensitivity=True)
    stats = {device: {name: make(config, TokenFrequencies(counts, "hand-set")) for name, make in STATISTICS.items()}
             for device in ("cpu", "cuda")}
    g = torch.Generator().manual_seed(0)
    H = 3
    for layer, kind in enumerate(("enc_self", "dec_self")):
        block = FakeBlock(kind, layer, H)
        for start in (0, 2):
            side, _ = side_batch(sentences[start:start + 2], tokenizer, start)
            B, T = side.token_ids.shape
            probs = torch.zeros(B, H, T, T)
            for b, n in enumerate(side.lengths):
                logits = torch.randn(H, n, n, generator=g) * 3
                if kind == "dec_self":
                    logits = logits.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
                probs[b, :, :n, :n] = logits.softmax(-1)
            for device, by_name in stats.items():
                on = side.to(device)
                for stat in by_name.values():
                    if hasattr(stat, "update_side"):
                        stat.update_side(kind, side)
                    stat.update(AttentionView(block, probs.to(device), on))
                words = WordRows(block, on)
                for row in range(0, T, 2):
                    view = words.view(probs[:, :, row:row + 2].to(device), row, row + 2 >= T)
                    for stat in by_name.values():
                        stat.update(view)
    gpu = stats["cuda"]
    assert all(t.is_cuda for t in gpu["positional"].counts.values())
    assert all(t.is_cuda for table in gpu["syntactic"].hits.values() for t in table.values())
    assert all(t.is_cuda for t in gpu["rare"].first.values())
    assert all(t.is_cuda for sums in gpu["aggregate"].sums.values() for t in sums.values())
    files = {device: _written([stat.result() for stat in by_name.values()], tmp_path / device)
             for device, by_name in stats.items()}
    for by_name in stats.values():
        by_name["aggregate"].close()
    assert len(files["cpu"]) > 10
    _close(files["cuda"], files["cpu"])


@pytest.mark.parametrize("family, target, query_chunk, engine", [
    ("marian", True, None, "eager"), ("marian", True, 2, None), ("bert", False, None, "eager"),
    ("bert", False, None, None), ("gpt2", False, 3, None), ("llama", False, 2, None)])
def test_analyze_heads_on_cuda_equals_the_cpu(tmp_path, family, target, query_chunk, engine):
    """``analyze_heads`` of one float32 tiny model on the CPU and on the GPU, where the statistics
    now run: every written statistic agrees, counts, offsets, argmax decisions and exemplar
    positions identical, float totals within 1e-6 relative. Not to the bit: the GPU's attention
    probabilities themselves differ from the CPU's in the last bits (other kernels, other orders
    of addition), and so do the float sums made of them. No decision here sits on a near-tie:
    on the CPU the same comparison of these float32 models against their float64 copies (whose
    probabilities differ by float32 rounding) finds every count and decision identical and
    every float within 1e-6 (beyond 1e-7 only single float32 exemplar weights)."""
    pytest.importorskip("conllu")
    import numpy as np

    from headlab.data.frequencies import TokenFrequencies
    from headlab.functions import AnalysisConfig, analyze_heads
    from support.treebank import SAMPLE_CONLLU, bpe_tokenizer

    texts = [line[len("# text = "):] for line in SAMPLE_CONLLU.splitlines() if line.startswith("# text = ")]
    tokenizer = bpe_tokenizer(texts * 3, vocab_size=45)
    path = tmp_path / "tb.conllu"
    path.write_text(SAMPLE_CONLLU, encoding="utf-8")
    counts = np.arange(tokenizer.vocab_size, dtype=np.int64) % 5 + 1
    config = AnalysisConfig(batch_size=3, top_frequent=3, window=4, top_k=3, query_chunk=query_chunk, sensitivity=True,
                            engine=engine)  # None: the default, the fused engine
    model = tiny_model(family)  # float32
    files = {}
    for device in ("cpu", "cuda"):
        analysis = analyze_heads(model.to(device), tokenizer, path, target_conllu=path if target else None,
                                 config=config, frequencies=TokenFrequencies(counts, "hand-set"))
        files[device] = _written(analysis.results.values(), tmp_path / device)
    assert len(files["cpu"]) > 20
    _close(files["cuda"], files["cpu"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family, target", [("marian", True), ("gpt2", False), ("llama", False)])
def test_default_fused_engine_on_cuda_agrees_with_the_references(tmp_path, family, target, dtype):
    """On the GPU, the default (the fused engine, issue 34) against the references on the same GPU,
    with a word-level tokenizer (every statistic fused). float32: against ``engine="eager"``, counts,
    offsets, decisions and exemplar positions identical, floats within 1e-5 relative (other
    products, other orders of addition). bfloat16: eager's probabilities are rounded to bfloat16
    (transformers' eager softmax casts back to the model's dtype) and the chunked attention's are
    float32, so decisions may differ from eager's at near-ties; against ``engine="chunked"`` (the
    same float32 probabilities) they are identical, floats within 1e-5 relative."""
    pytest.importorskip("conllu")
    import numpy as np

    from headlab.data.frequencies import TokenFrequencies
    from headlab.functions import AnalysisConfig, analyze_heads
    from support.treebank import SAMPLE_CONLLU
    from test_fused_statistics import word_tokenizer

    tokenizer = word_tokenizer()
    path = tmp_path / "tb.conllu"
    path.write_text(SAMPLE_CONLLU, encoding="utf-8")
    counts = np.arange(tokenizer.vocab_size, dtype=np.int64) % 5 + 1
    model = tiny_model(family).to("cuda", dtype)
    reference = "eager" if dtype == torch.float32 else "chunked"
    files = {}
    for engine in (None, reference):
        config = AnalysisConfig(batch_size=3, top_frequent=3, window=4, top_k=3, engine=engine, sensitivity=True)
        analysis = analyze_heads(model, tokenizer, path, target_conllu=path if target else None,
                                 config=config, frequencies=TokenFrequencies(counts, "hand-set"))
        assert analysis.config.resolved_engine == (engine or "fused")
        files[engine] = _written(analysis.results.values(), tmp_path / str(engine))
    assert len(files[None]) > 20
    _close(files[None], files[reference], rtol=1e-5)


@pytest.mark.parametrize("family, target", [("marian", True), ("gpt2", False), ("llama", False)])
def test_fused_engine_on_cuda_equals_the_cpu(tmp_path, family, target):
    """The fused engine (``engine="fused"``) on the GPU and on the CPU, with a word-level tokenizer
    (every statistic fused): the same agreement as above (tests/test_fused_statistics.py checks the
    CPU's against the eager reference)."""
    pytest.importorskip("conllu")
    import numpy as np

    from headlab.data.frequencies import TokenFrequencies
    from headlab.functions import AnalysisConfig, analyze_heads
    from support.treebank import SAMPLE_CONLLU
    from test_fused_statistics import word_tokenizer

    tokenizer = word_tokenizer()
    path = tmp_path / "tb.conllu"
    path.write_text(SAMPLE_CONLLU, encoding="utf-8")
    counts = np.arange(tokenizer.vocab_size, dtype=np.int64) % 5 + 1
    model = tiny_model(family)  # float32
    files = {}
    for device in ("cpu", "cuda"):
        config = AnalysisConfig(batch_size=3, top_frequent=3, window=4, top_k=3, engine="fused", query_chunk=3,
                                sensitivity=True)
        analysis = analyze_heads(model.to(device), tokenizer, path, target_conllu=path if target else None,
                                 config=config, frequencies=TokenFrequencies(counts, "hand-set"))
        assert analysis.report.chunked_statistics == {}
        files[device] = _written(analysis.results.values(), tmp_path / device)
    assert len(files["cpu"]) > 20
    _close(files["cuda"], files["cpu"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family, target", [("marian", True), ("bert", False), ("llama", False)])
def test_kernel_engine_on_cuda_agrees_with_the_fused_engine(tmp_path, family, target, dtype):
    """``engine="kernel"`` (one Triton pass per block, headlab.data.attention_kernel) against the fused
    engine on the same GPU, word-level tokenizer (every statistic from the kernel: no fallback).
    float32: the kernel's statistics accumulate in float32 with IEEE products (no TF32), the
    decisions identical, floats within 1e-5 relative. bfloat16: the kernel's output is a bfloat16
    ``P @ V`` as FlashAttention's, so the later layers' inputs differ from the fused engine's in
    bfloat16 rounding and counts may move at near-ties: the same files, every statistic from the
    kernel (a smoke test of the bfloat16 path, which Triton's interpreter cannot run on the CPU)."""
    pytest.importorskip("conllu")
    pytest.importorskip("triton")
    import numpy as np

    from headlab.data.frequencies import TokenFrequencies
    from headlab.functions import AnalysisConfig, analyze_heads
    from support.treebank import SAMPLE_CONLLU
    from test_fused_statistics import word_tokenizer

    tokenizer = word_tokenizer()
    path = tmp_path / "tb.conllu"
    path.write_text(SAMPLE_CONLLU, encoding="utf-8")
    counts = np.arange(tokenizer.vocab_size, dtype=np.int64) % 5 + 1
    model = tiny_model(family).to("cuda", dtype)
    files = {}
    for engine in ("fused", "kernel"):
        config = AnalysisConfig(batch_size=3, top_frequent=3, window=4, top_k=3, engine=engine, sensitivity=True)
        analysis = analyze_heads(model, tokenizer, path, target_conllu=path if target else None,
                                 config=config, frequencies=TokenFrequencies(counts, "hand-set"))
        assert analysis.report.kernel_fallback == {}
        files[engine] = _written(analysis.results.values(), tmp_path / engine)
    assert len(files["kernel"]) > 20
    if dtype == torch.float32:
        _close(files["kernel"], files["fused"], rtol=1e-5)
    else:
        assert files["kernel"].keys() == files["fused"].keys()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["marian", "llama"])
def test_kernel_confidence_on_cuda_agrees_with_the_fused_engine(family, dtype):
    """Confidence with ``engine="kernel"`` (the allowed keys eligible, the largest weight from the
    kernel's maximum score and lse) against the fused engine on the same GPU. float64: equal to
    1e-10, or, where the installed triton cannot compile float64 (triton 3.6), the fused numbers
    exactly with the reason recorded. float32: within 1e-5. bfloat16: the kernel's ``P @ V`` is in
    bfloat16, so later layers' inputs differ by rounding: within 0.05 (a smoke test)."""
    pytest.importorskip("triton")
    import numpy as np

    from headlab.importance import compute_confidence
    from test_kernel_confidence import _data

    model = tiny_model(family, attn_implementation="sdpa").to("cuda", dtype)
    data, info = _data(model)
    fused = compute_confidence(model, data, info, batch_size=3, engine="fused")
    kernel = compute_confidence(model, data, info, batch_size=3, engine="kernel")
    fallback = kernel.signature.get("kernel_fallback", {})
    uncompiled = dtype == torch.float64 and "could not compile" in fallback.get("model", "")
    assert not fallback or uncompiled, fallback
    atol = {torch.float64: 0.0 if uncompiled else 1e-10, torch.float32: 1e-5, torch.bfloat16: 0.05}[dtype]
    for kind in fused.kinds:
        np.testing.assert_allclose(kernel[kind], fused[kind], rtol=0, atol=atol)


def _split_map(model, first, rest) -> dict:
    """A device_map with each stack's first block (its position bias table) on ``first`` and its other blocks on
    ``rest``; the embeddings, norms and head on ``first``."""
    device_map = {}
    for name, child in model.named_children():
        if name not in ("encoder", "decoder"):
            device_map[name] = first
            continue
        for sub, grandchild in child.named_children():
            if sub == "block":
                device_map.update({f"{name}.block.{i}": first if i == 0 else rest for i in range(len(grandchild))})
            else:
                device_map[f"{name}.{sub}"] = first
    return device_map


@pytest.mark.parametrize("split", ["two GPUs", "first layers offloaded to the CPU"])
@pytest.mark.parametrize("family", ["t5", "longt5", "longt5-tglobal"])
def test_a_pruned_t5_split_over_devices_equals_it_on_the_cpu(family, split, tmp_path):
    """A pruned T5 / local or transient-global LongT5 dispatched by a device_map that puts each stack's first layer (its
    position bias tables) apart from the later layers, loaded by headlab (load_model) and by plain transformers (pruned_heads.py):
    each pruned layer's hook computes the bias where the table is and hands it over on its own layer's device
    (portable_code.StackBiasHook; until session 34 it computed it on the layer's device, an index into a table on
    another device). Logits and cached greedy generation equal the pruned model's on the CPU, in float64.
    "two GPUs": cuda:0 and cuda:1; "offloaded": the first layers on the CPU beside cuda:0 (accelerate keeps their
    weights on the meta device outside their forward)."""
    import transformers

    from headlab.loading import load_model
    from support.seq2seq_families import cached_generation
    from test_t5_bias_hooks_travel import SPEC, _inputs, _model

    if split == "two GPUs" and torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    first, rest = (0, 1) if split == "two GPUs" else ("cpu", 0)
    model, inputs = _model(family), _inputs()
    prune_heads(model, SPEC)
    expected = logits(model, inputs)
    tokens, scores = cached_generation(model, inputs)
    save_pruned(model, tmp_path)
    device_map = _split_map(model, first, rest)
    plain = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path, trust_remote_code=True, dtype=torch.float64,
                                                               device_map=device_map)
    for loaded in (load_model(str(tmp_path), dtype=torch.float64, device_map=device_map), plain):
        loaded.config._attn_implementation = "eager"
        on_gpu = _to(inputs, "cuda:0")
        torch.testing.assert_close(logits(loaded, on_gpu).cpu(), expected, atol=1e-10, rtol=0)
        loaded_tokens, loaded_scores = cached_generation(loaded, on_gpu)
        assert torch.equal(loaded_tokens.cpu(), tokens)
        torch.testing.assert_close(loaded_scores.cpu(), scores, atol=1e-10, rtol=0)
