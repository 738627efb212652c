"""A triton that cannot compile the statistics kernel for a call must not end an analysis: the
call runs on the fused path, recorded as ``kernel_fallback``, and the results are the fused ones.
Seen with triton 3.6 (PyTorch 2.11's CUDA wheels): float64 ``tl.dot`` at d_head 32 and more stops
its compiler ("fp64 don't support largeK MMA"); triton 3.9 compiles it. Here the compiler's failure
is simulated: the interpreter compiles nothing."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from headlab.data import attention_kernel  # noqa: E402
from headlab.data.attention_kernel import attention_statistics, compile_failure, interpreted, kernel_launch  # noqa: E402
from support.models import tiny_model  # noqa: E402
from test_chunked_statistics import _assert_close, _written  # noqa: E402
from test_fused_statistics import _analyse, word_tokenizer  # noqa: E402
from test_kernel_confidence import _data  # noqa: E402

pytestmark = pytest.mark.unit

REASON = "triton 3.6.0 could not compile the kernel for torch.float64 at d_head 32 (RuntimeError: PassManager::run failed)"


class _Kernel:
    """A compiled kernel's stand-in whose compile fails as triton 3.6's did."""

    def __init__(self) -> None:
        self.warmups = 0

    def warmup(self, *args, grid, **meta):
        self.warmups += 1
        raise RuntimeError("PassManager::run failed\nmore of the log")


def test_a_failed_compile_is_said_and_not_retried(monkeypatch):
    monkeypatch.setattr(attention_kernel, "interpreted", lambda: False)
    monkeypatch.setattr(attention_kernel, "_failed", {})
    q = torch.zeros(1, 2, 5, 32, dtype=torch.float64)
    launch = kernel_launch(q, q, q, causal=True)
    kernel = _Kernel()
    first = compile_failure(kernel, launch)
    assert first is not None and first.startswith("triton ") and "torch.float64 at d_head 32" in first
    assert first.endswith("(RuntimeError: PassManager::run failed)")
    assert compile_failure(kernel, kernel_launch(q, q, q, causal=True)) == first and kernel.warmups == 1
    assert compile_failure(kernel, kernel_launch(q, q, q, causal=False)) == first and kernel.warmups == 2


@pytest.fixture
def uncompilable(monkeypatch):
    """Every launch's compile fails; the launches that ran anyway (none may)."""
    launched: list = []
    monkeypatch.setattr(attention_kernel, "compile_failure", lambda kernel, launch: REASON)

    def counted(*args, **kwargs):
        statistics = attention_statistics(*args, **kwargs)
        launched.append(args[0].shape)
        return statistics

    monkeypatch.setattr(attention_kernel, "attention_statistics", counted)
    return launched


@pytest.mark.skipif(not interpreted(), reason="runs in triton's interpreter (CPU)")
def test_functions_run_fused_where_the_kernel_does_not_compile(tmp_path, uncompilable):
    tokenizer = word_tokenizer()
    fused = _analyse("llama", tmp_path, tokenizer, "fused")
    kernel = _analyse("llama", tmp_path, tokenizer, "kernel")
    assert not uncompilable and kernel.report.kernel_fallback == {"model": REASON}
    assert kernel.report.to_json()["kernel_fallback"] == {"model": REASON}
    _assert_close(_written(kernel.results.values(), tmp_path / "kernel"),
                  _written(fused.results.values(), tmp_path / "fused"), atol=0.0)


@pytest.mark.skipif(not interpreted(), reason="runs in triton's interpreter (CPU)")
def test_confidence_runs_fused_where_the_kernel_does_not_compile(uncompilable):
    import numpy as np

    from headlab.importance import compute_confidence

    model = tiny_model("marian", attn_implementation="sdpa").double()
    data, info = _data(model)
    fused = compute_confidence(model, data, info, batch_size=3, engine="fused")
    kernel = compute_confidence(model, data, info, batch_size=3, engine="kernel")
    assert not uncompilable and kernel.signature["kernel_fallback"] == {"model": REASON}
    for kind in fused.kinds:
        np.testing.assert_array_equal(kernel[kind], fused[kind])


def test_kernel_calls_refuse_a_model_once_and_then_leave_every_call(monkeypatch):
    """The one refusal-and-fallback path of the kernel engines (functions and confidence): a call the
    kernel cannot compute exactly, or a compile failure, is recorded once under "model", and every
    later call goes to the caller's other path without another check or launch."""
    from headlab.attention import AttentionCall
    from headlab.data.attention_kernel import KernelCalls

    monkeypatch.setattr(attention_kernel, "compile_failure", lambda kernel, launch: REASON)
    recorded: list = []
    q = torch.zeros(1, 2, 5, 16)
    floats = AttentionCall(q, q, q, torch.zeros(1, 1, 5, 5), causal=False, scaling=0.25)
    plain = AttentionCall(q, q, q, None, causal=False, scaling=0.25)
    calls = KernelCalls(lambda name, reason: recorded.append((name, reason)))
    assert not calls.accepts(floats) and not calls.accepts(plain)
    assert recorded == [("model", "the kernel cannot compute this model's attention exactly: an additive float "
                                  "attention mask is not supported by the kernel (boolean masks only)")]
    recorded.clear()
    calls = KernelCalls(lambda name, reason: recorded.append((name, reason)))
    assert not calls.accepts(plain, lambda call: "a mask per head") and recorded[-1][1].endswith(": a mask per head")
    if interpreted():  # the compile failure: nothing launched, the model refused with triton's reason
        calls = KernelCalls(lambda name, reason: recorded.append((name, reason)))
        assert calls.accepts(plain) and calls.run(plain) is None
        assert calls.refused == REASON and recorded[-1] == ("model", REASON) and not calls.accepts(plain)


def test_the_scaling_tensor_is_made_once_per_value_dtype_and_device():
    """The kernel's scaling goes in as a one-element tensor, made once (on a GPU, not a copy per call)."""
    cpu = torch.device("cpu")
    assert attention_kernel._scale(0.25, torch.float32, cpu) is attention_kernel._scale(0.25, torch.float32, cpu)
