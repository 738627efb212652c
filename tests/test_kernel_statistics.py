"""The Triton attention-statistics kernel (headlab.data.attention_kernel) against an eager float64
reference: ``softmax(q k^T * scaling)`` materialised, every statistic taken from it.

Without a GPU the kernel runs in Triton's interpreter: ``TRITON_INTERPRET=1`` must be set before
triton is first imported (triton's own helpers, ``tl.max`` and the like, are defined for the
interpreter or for the compiler then), so it is set here when no CUDA device is present; with
one, the same checks run on the GPU. Shapes are tiny and blocks small so that partial blocks (37
and 130 rows of 16- and 32-row blocks) and several key blocks are covered."""

from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from headlab.data.attention_kernel import KernelUnavailable, attention_statistics, interpreted, refusal  # noqa: E402

TOL = 1e-10
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not interpreted(),
                                reason="no CUDA device, and triton was imported before TRITON_INTERPRET=1 could be set")


def _inputs(q_len, d, *, seed=0, dtype=torch.float64, B=2, H=4, Hkv=2):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, q_len, d, generator=g, dtype=dtype)
    k = torch.randn(B, Hkv, q_len, d, generator=g, dtype=dtype)
    v = torch.randn(B, Hkv, q_len, d, generator=g, dtype=dtype)
    keep = torch.ones(B, q_len, dtype=torch.bool)
    keep[1, q_len - 5:] = False  # right padding in sentence 1
    eligible = torch.rand(B, q_len, generator=g) > 0.3
    eligible[:, 0] = False  # a special token before the words
    features = torch.randn(B, q_len, 3, generator=g, dtype=dtype)
    return q, k, v, keep, eligible, features


def _on(*tensors):
    return [t.to(DEVICE) for t in tensors]


def _kernel(q, k, v, *, mask=None, eligible=None, features=None, **options):
    """The kernel on DEVICE, its results back on the CPU; skipped where the installed triton cannot
    compile the configuration (triton 3.6 and float64 at d_head 32: the engine then runs fused)."""
    q, k, v = _on(q, k, v)
    try:
        got = attention_statistics(q, k, v, mask=None if mask is None else mask.to(DEVICE),
                                   eligible=None if eligible is None else eligible.to(DEVICE),
                                   features=None if features is None else features.to(DEVICE), **options)
    except KernelUnavailable as error:
        pytest.skip(str(error))
    return type(got)(**{name: None if value is None else value.cpu() for name, value in vars(got).items()})


def _reference(q, k, v, keep, eligible, features, causal, scaling):
    """Everything from the materialised probabilities, in float64."""
    q, k, v, features = (x.double() for x in (q, k, v, features))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    Q, K = q.shape[2], k.shape[2]
    s = q @ k.transpose(-1, -2) * scaling
    seen = keep[:, None, None, :].expand(-1, 1, Q, K)
    if causal:
        seen = seen & torch.ones(Q, K, dtype=torch.bool).tril(K - Q)
    p = torch.softmax(s.masked_fill(~seen, float("-inf")), -1)
    pe = p * eligible[:, None, None, :]
    lower = torch.ones(Q, K, dtype=torch.float64).tril(K - Q)
    return {
        "out": p @ v, "lse": torch.logsumexp(s.masked_fill(~seen, float("-inf")), -1),
        "max_weight": pe.max(-1).values, "argmax": pe.argmax(-1),
        "linear": p @ features[:, None], "linear_lower": (p * lower) @ features[:, None],
        "score_dot": (pe * s.masked_fill(~seen, 0.0)).sum(-1),
    }


def _check(got, want, tol=TOL):
    for name in ("out", "lse", "max_weight", "linear", "linear_lower", "score_dot"):
        torch.testing.assert_close(getattr(got, name).double(), want[name], rtol=0, atol=tol, msg=name)
    some = want["max_weight"] > 0
    assert torch.equal(got.argmax[some], want["argmax"][some])
    assert bool((got.argmax[~some] == -1).all())


@pytest.mark.parametrize(("q_len", "d", "causal", "blocks", "mask4d"), [
    (37, 16, True, (16, 16), False),
    (37, 32, False, (16, 32), True),
    (37, 8, True, (16, 16), True),  # d_head 8 and 24: padded with zeros to 16 and 32
    (37, 24, False, (16, 16), False),
    (130, 16, True, (32, 32), True),
    (130, 16, False, (64, 32), False),
])
def test_float64_equals_the_materialised_reference(q_len, d, causal, blocks, mask4d):
    q, k, v, keep, eligible, features = _inputs(q_len, d)
    if mask4d:  # transformers' boolean [B, 1, Q, K] mask (padding only; causal from the flag)
        mask = keep[:, None, None, :].expand(-1, 1, q_len, -1)
    else:
        mask = keep[:, None, None, :]
    scaling = 0.3
    got = _kernel(q, k, v, scaling=scaling, causal=causal, mask=mask, eligible=eligible,
                               features=features, block_m=blocks[0], block_n=blocks[1])
    _check(got, _reference(q, k, v, keep, eligible, features, causal, scaling))
    assert got.out.dtype == torch.float64 and got.argmax.dtype == torch.int64


def test_a_boolean_mask_reaches_the_kernel_as_a_view_not_a_copy(monkeypatch):
    """Transformers' 4-d boolean mask is an expanded view of a [B, K] padding mask: the kernel reads
    its bytes as int8 through the same storage (``.to(int8)`` copied Q x K bytes per sentence on
    every call, 4 GiB at 64k tokens), with the results of the materialised reference."""
    from headlab.data import attention_kernel

    launched = []
    real = attention_kernel._kernel

    class Recording:  # _kernel(interpret)[grid](...), recording the mask argument
        def __init__(self, interpret):
            self.kernel = real(interpret)

        def warmup(self, *args, **kwargs):  # the compile check before each launch
            return self.kernel.warmup(*args, **kwargs)

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append(args[3])
                return self.kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(attention_kernel, "_kernel", Recording)
    q, k, v, keep, eligible, features = _inputs(37, 16)
    on = _on(q, k, v, keep, eligible, features)
    mask = on[3][:, None, None, :].expand(-1, 1, 37, -1)
    try:
        got = attention_statistics(*on[:3], scaling=0.3, causal=True, mask=mask, eligible=on[4], features=on[5],
                                   block_m=16, block_n=16)
    except KernelUnavailable as error:
        pytest.skip(str(error))
    (m,) = launched
    assert m.dtype == torch.int8 and m.data_ptr() == on[3].data_ptr() and 0 in m.stride()
    got = type(got)(**{name: None if value is None else value.cpu() for name, value in vars(got).items()})
    _check(got, _reference(q, k, v, keep, eligible, features, True, 0.3))


def test_exact_ties_go_to_the_first_position():
    """Keys 3, 9 and 20 are copies of one key that dominates every score: the rows that see them
    have exact ties (the same products in the same order), within a key block and across two."""
    q, k, v, keep, eligible, features = _inputs(37, 16, seed=1)
    q[..., 0] = q[..., 0].abs() + 10.0
    k[..., 0] = 0.0
    k[:, :, 3, 0] = 5.0
    for j in (9, 20):
        k[:, :, j] = k[:, :, 3]
    eligible[:, [3, 9, 20]] = True
    eligible[0, 3] = False  # sentence 0: the tie is between 9 and 20
    got = _kernel(q, k, v, scaling=1.0, causal=True, mask=keep[:, None, None, :],
                               eligible=eligible, features=features, block_m=16, block_n=16)
    want = _reference(q, k, v, keep, eligible, features, True, 1.0)
    _check(got, want)
    assert bool((got.argmax[1, :, 3:] == 3).all()) and bool((got.argmax[0, :, 20:] == 9).all())


# Triton 3.9's interpreter gets bfloat16 wrong (scores off by 1e9: numpy has no bfloat16), so on the
# CPU the 16-bit path is checked in float16; on a GPU in bfloat16, the dtype of the models.
HALF = torch.bfloat16 if DEVICE == "cuda" else torch.float16


def test_float32_and_16_bit_inputs_accumulate_in_float32():
    q, k, v, keep, eligible, features = _inputs(37, 16, seed=2)
    want = _reference(q, k, v, keep, eligible, features, True, 0.25)
    got = _kernel(q.float(), k.float(), v.float(), scaling=0.25, causal=True,
                               mask=keep[:, None, None, :], eligible=eligible, features=features.float(),
                               block_m=16, block_n=16)
    assert got.out.dtype == torch.float32 and got.lse.dtype == torch.float32
    _check(got, want, tol=1e-5)
    q16, k16, v16 = q.to(HALF), k.to(HALF), v.to(HALF)
    got = _kernel(q16, k16, v16, scaling=0.25, causal=True, mask=keep[:, None, None, :],
                               eligible=eligible, features=features, block_m=16, block_n=16)
    want = _reference(q16, k16, v16, keep, eligible, features, True, 0.25)  # exact scores of the 16-bit inputs
    assert got.out.dtype == HALF and got.lse.dtype == torch.float32
    for name in ("lse", "max_weight", "linear", "linear_lower", "score_dot"):  # float32 statistics
        torch.testing.assert_close(getattr(got, name).double(), want[name], rtol=0, atol=1e-5, msg=name)
    torch.testing.assert_close(got.out.double(), want["out"], rtol=0, atol=2e-2)  # P @ V in 16 bits


def test_a_row_that_sees_no_key():
    q, k, v, keep, eligible, features = _inputs(37, 16, seed=3)
    mask = torch.ones(2, 1, 37, 37, dtype=torch.bool)
    mask[0, 0, 5] = False
    got = _kernel(q, k, v, mask=mask, eligible=eligible, block_m=16, block_n=16)
    assert got.lse[0, :, 5].isneginf().all() and bool((got.argmax[0, :, 5] == -1).all())
    assert bool((got.out[0, :, 5] == 0).all()) and bool((got.max_weight[0, :, 5] == 0).all())
    assert got.linear is None and got.linear_lower is None


def test_what_it_cannot_compute_is_refused_with_the_reason():
    q, k, v = _on(*_inputs(37, 16)[:3])
    assert refusal(q, k, v) is None
    assert "softcap" in refusal(q, k, v, softcap=50.0)
    assert "position bias" in refusal(q, k, v, bias=True)
    assert "sinks" in refusal(q, k, v, sinks=True)
    assert "dropout" in refusal(q, k, v, dropout=0.1)
    wide = torch.zeros(1, 1, 3, 512, dtype=torch.float64, device=DEVICE)
    assert "d_head 512" in refusal(wide, wide, wide)
    assert "share" in refusal(q[:, :3], k, v)
    with pytest.raises(ValueError, match="float attention mask"):
        attention_statistics(q, k, v, mask=torch.zeros(2, 1, 37, 37, dtype=torch.float64, device=DEVICE))


@pytest.mark.skipif(DEVICE != "cpu", reason="checks the CPU refusal")
def test_outside_the_interpreter_a_cpu_tensor_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v, *_ = _inputs(37, 16)
    assert "CUDA" in refusal(q, k, v)


@pytest.mark.skipif(DEVICE != "cpu", reason="a sparse file mapped as the mask: CPU memory")
def test_offsets_past_2_to_the_31_do_not_wrap(tmp_path):
    """A mask row's offset ``row x stride`` past 2^31 (a [B, 1, Q, K] mask at 64k tokens has 2^32
    entries) is computed in 64 bits: in 32 bits it wrapped to a negative offset and the rows past
    it read other bytes (here: zeros, rows that saw no key). The mask is a view into a sparse
    file of 6.4 GB, only its 64 rows written, laid at 2^31 bytes into it so that a wrapped offset
    still reads mapped memory rather than crashing."""
    Q, stride, start = 64, 1 << 26, 1 << 31  # rows 32..63 start at 2^31 bytes and beyond
    path = tmp_path / "mask.bin"
    size = start + Q * stride
    with open(path, "wb") as file:
        file.truncate(size)  # sparse: no disk space but the pages written
    storage = torch.from_file(str(path), shared=True, size=size, dtype=torch.bool)
    q, k, v, _, eligible, features = (x[:1] for x in _inputs(Q, 16, H=2, Hkv=1))  # one sentence
    small = torch.rand(Q, Q, generator=torch.Generator().manual_seed(4)) > 0.2
    small.fill_diagonal_(True)
    mask = storage.as_strided((1, 1, Q, Q), (0, 0, stride, 1), start)
    mask[0, 0] = small
    got = _kernel(q, k, v, mask=mask, eligible=eligible, features=features, block_m=16, block_n=16)
    want = _kernel(q, k, v, mask=small[None, None], eligible=eligible, features=features, block_m=16, block_n=16)
    assert bool(got.lse.isfinite().all())
    for name in ("out", "lse", "max_score", "argmax", "linear", "linear_lower", "score_dot"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
