"""The head statistics inside one flash-attention pass (a Triton kernel), never the probabilities.

:mod:`headlab.data.fused` takes every statistic from a few passes over each query chunk's
probabilities ``P``: fast on a CPU, but on a GPU each of the thousand chunks of a long sequence
costs milliseconds of host work. Every pass it makes is either a reduction along a row or a
product of ``P`` with a small key-side matrix, and both fit the online softmax of FlashAttention
(Dao 2023, Alg. 1): a running maximum ``m``, a running sum ``l`` and accumulators rescaled by
``exp(m_old - m_new)`` whenever the maximum grows. One pass over the keys, in key blocks, gives
for each query row ``i`` (scores ``s_ij = scaling * q_i . k_j``, hidden keys excluded):

* the attention output ``sum_j p_ij v_j`` and ``lse_i = log sum_j exp(s_ij)`` (``p_ij = exp(s_ij - lse_i)``);
* over the eligible keys (a per-key boolean, e.g. the word tokens): the largest score and its
  first position (ties to the smallest key index, as ``torch.argmax``); its weight is
  ``exp(s_max - lse)``;
* ``P @ F`` for key features ``F`` ``[B, K, f]``, over all keys and over the keys ``j <= i`` only
  (the split at the diagonal: ``sum_j p_ij |i - j|`` from the key positions as features);
* ``sum_j p_ij s_ij`` over the eligible keys (entropy: ``sum_j p log p = sum_j p s - m lse`` with
  ``m`` the mass, as in :meth:`headlab.data.fused.FusedView.word_xlogx`).

The maxima are taken on scores, not on weights: ``exp(s - lse)`` is monotonic, so the position
is the weights' one except where two different scores round to the same weight (then the
weights' first position may be an earlier one; in float64 this does not happen on the test
models). The statistics accumulate in float32 for 16- and 32-bit inputs (``tl.dot`` with
``input_precision="ieee"``: a GPU's default for float32 is TF32, 10 bits of mantissa) and in
float64 for float64 inputs; the output's ``P @ V`` is in ``V``'s dtype for 16-bit inputs, as
FlashAttention does, and exact otherwise.

:func:`refusal` says why a call cannot run here (the caller then keeps the materialising path);
:class:`KernelCalls` is how the kernel engines (head functions, confidence) refuse, run and fall back.
Triton is imported on first use: this module imports without it. On a CPU the kernel runs only
under Triton's interpreter (``TRITON_INTERPRET=1``, set before triton is first imported), which
the tests use; benchmarks/compile_kernel.py compiles it for NVIDIA GPUs on a CPU, ahead of time
(the launch it compiles is :func:`kernel_launch`'s, the blocks :func:`launch_blocks`').
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from headlab.attention import AttentionCall

__all__ = ["KernelStatistics", "attention_statistics", "refusal", "interpreted", "DTYPES", "Blocks", "launch_blocks",
           "Launch", "kernel_launch", "KernelUnavailable", "KernelCalls"]

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class KernelUnavailable(ValueError):
    """The installed triton could not compile the kernel for a call (nothing was launched): the
    caller computes the call on another path and records why."""


@dataclass(frozen=True)
class KernelStatistics:
    """What one pass returns, per (batch, head, query row) ``[B, H, Q, ...]``."""

    out: torch.Tensor  # [B, H, Q, D], q's dtype
    lse: torch.Tensor  # [B, H, Q]; -inf on a row that sees no key
    max_score: torch.Tensor  # [B, H, Q]: the largest eligible score; -inf where none
    argmax: torch.Tensor  # [B, H, Q] int64: its first key position; -1 where none
    linear: torch.Tensor | None  # [B, H, Q, f]: sum_j p_ij F[b, j] over all keys
    linear_lower: torch.Tensor | None  # [B, H, Q, f]: the same over keys j <= i (+ the causal offset)
    score_dot: torch.Tensor  # [B, H, Q]: sum_j p_ij s_ij over the eligible keys

    @property
    def max_weight(self) -> torch.Tensor:
        """``[B, H, Q]``: the largest eligible weight, ``exp(s_max - lse)`` (0 where none)."""
        weight = torch.exp(self.max_score - self.lse)
        return torch.where(self.argmax >= 0, weight, torch.zeros_like(weight))


def triton_refusal() -> str | None:
    """Why the kernel cannot run on this Python's triton (none, or older than the floor), or None."""
    from headlab._version import triton_problem

    try:
        import triton
    except ImportError:
        return triton_problem(None)
    return triton_problem(str(triton.__version__))


def interpreted() -> bool:
    """Whether triton runs kernels in its interpreter (on the CPU): ``TRITON_INTERPRET=1``, read
    by triton each time a kernel is defined (:func:`_kernel` defines one per setting). False with
    no triton the kernel runs on (:func:`triton_refusal`: before 3.4 there is no ``triton.knobs``)."""
    if triton_refusal():
        return False
    import triton

    return bool(triton.knobs.runtime.interpret)


def refusal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, softcap: float | None = None,
            bias: bool = False, float_mask: bool = False, sinks: bool = False, dropout: float = 0.0) -> str | None:
    """Why :func:`attention_statistics` cannot compute this attention exactly, or None.

    ``bias``: an additive position bias (T5, ALiBi); ``float_mask``: an additive float mask (only
    boolean masks are supported); ``sinks``: learned attention sinks (extra logits in the softmax);
    ``dropout``: attention dropout in training."""
    problem = triton_refusal()
    if problem:
        return problem
    if softcap:
        return "soft-capped scores (softcap) are not supported by the kernel"
    if bias:
        return "an additive position bias is not supported by the kernel"
    if float_mask:
        return "an additive float attention mask is not supported by the kernel (boolean masks only)"
    if sinks:
        return "attention sinks are not supported by the kernel"
    if dropout:
        return "attention dropout is not supported by the kernel"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "q, k and v must be [batch, heads, length, d_head]"
    if q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtype {q.dtype} (k {k.dtype}, v {v.dtype}) is not one of {', '.join(map(str, DTYPES))}"
    d = q.shape[3]
    if d > 256 or k.shape[3] != d or v.shape[3] != d:
        return f"d_head {d} (k {k.shape[3]}, v {v.shape[3]}): the kernel takes one d_head of at most 256"
    if q.shape[1] % k.shape[1] or k.shape[1] != v.shape[1]:
        return f"{q.shape[1]} query heads do not share {k.shape[1]} key/value heads evenly"
    if q.device.type != "cuda" and not interpreted():
        return "the kernel runs on CUDA (on the CPU only under TRITON_INTERPRET=1, for tests)"
    if q.dtype == torch.bfloat16 and interpreted():
        # its tl.dot multiplies bfloat16's bit patterns (triton-lang/triton#11584): scores near 1e9
        return "bfloat16 under triton's interpreter (TRITON_INTERPRET=1), which computes its dots wrongly"
    return None


@lru_cache(maxsize=2)
def _kernel(interpret: bool) -> Any:
    """The kernel, defined (``triton.jit``) on first use, for the interpreter or the compiler."""
    import triton
    import triton.language as tl

    @triton.jit
    def _attention_statistics(
        Q, K, V, M, E, F, O, LSE, SMAX, ARG, PF, PFL, PS, SCALE,
        n_heads, group, q_len, k_len, causal_offset,
        sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
        smb, smh, smm, smn, seb, sen, sfb, sfn, sff,
        sob, soh, som, sod, srb, srh, srm, spb, sph, spm, spf,
        D: tl.constexpr, NF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, HAS_F: tl.constexpr,
        ACC: tl.constexpr, PV_LOW: tl.constexpr, QK_PRECISION: tl.constexpr, F_PRECISION: tl.constexpr,
    ):
        sm_scale = tl.load(SCALE)  # in the accumulator's dtype (a float argument would be float32)
        pid_m = tl.program_id(0)
        bh = tl.program_id(1)
        # offsets in 64 bits: a mask [B, 1, Q, K] has 2^32 entries at 64k tokens, and 32-bit
        # products of a row (or sentence, head) and its stride wrap past 2^31
        b = (bh // n_heads).to(tl.int64)
        h = (bh % n_heads).to(tl.int64)
        hk = h // group  # GQA: query head h reads key/value head h // (H / Hkv)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rows64 = rows.to(tl.int64)
        dims = tl.arange(0, D)
        row_ok = rows < q_len
        q = tl.load(Q + b * sqb + h * sqh + rows64[:, None] * sqm + dims[None, :] * sqd,
                    mask=row_ok[:, None], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), ACC)
        l_i = tl.zeros([BLOCK_M], ACC)
        acc = tl.zeros([BLOCK_M, D], ACC)
        ps = tl.zeros([BLOCK_M], ACC)
        best = tl.full([BLOCK_M], float("-inf"), ACC)
        where = tl.full([BLOCK_M], -1, tl.int64)
        if HAS_F:
            fdims = tl.arange(0, NF)
            pf = tl.zeros([BLOCK_M, NF], ACC)
            pfl = tl.zeros([BLOCK_M, NF], ACC)
        diag = rows + causal_offset  # the last key a causal row sees (bottom-right aligned)
        hi = k_len
        if CAUSAL:
            hi = tl.minimum(k_len, (pid_m + 1) * BLOCK_M + causal_offset)
        for start in range(0, hi, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_ok = cols < k_len
            k = tl.load(K + b * skb + hk * skh + cols[None, :] * skn + dims[:, None] * skd,
                        mask=col_ok[None, :], other=0.0)
            s = tl.dot(q, k, out_dtype=ACC, input_precision=QK_PRECISION) * sm_scale  # [BM, BN]
            seen = row_ok[:, None] & col_ok[None, :]
            if CAUSAL:
                seen = seen & (cols[None, :] <= diag[:, None])
            if HAS_MASK:
                keep = tl.load(M + b * smb + h * smh + rows64[:, None] * smm + cols[None, :] * smn,
                               mask=seen, other=0)
                seen = seen & (keep != 0)
            s = tl.where(seen, s, float("-inf"))
            eligible = tl.load(E + b * seb + cols * sen, mask=col_ok, other=0) != 0
            chosen = seen & eligible[None, :]
            # the eligible maximum and its first position: a later block replaces it only if larger
            se = tl.where(chosen, s, float("-inf"))
            block_best = tl.max(se, 1)
            first = tl.min(tl.where((se == block_best[:, None]) & chosen, cols[None, :], 2147483647), 1)
            better = block_best > best
            where = tl.where(better, first.to(tl.int64), where)
            best = tl.where(better, block_best, best)
            # the online softmax (FlashAttention-2): rescale what was summed when the maximum grows
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])  # hidden keys: exp(-inf) = 0
            l_i = l_i * alpha + tl.sum(p, 1)
            ps = ps * alpha + tl.sum(p * tl.where(chosen, s, 0.0), 1)
            v = tl.load(V + b * svb + hk * svh + cols[:, None] * svn + dims[None, :] * svd,
                        mask=col_ok[:, None], other=0.0)
            if PV_LOW:  # 16-bit inputs: P @ V in V's dtype, accumulated in float32 (as FlashAttention)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, out_dtype=ACC)
            else:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(ACC), out_dtype=ACC, input_precision="ieee")
            if HAS_F:
                f = tl.load(F + b * sfb + cols[:, None] * sfn + fdims[None, :] * sff,
                            mask=col_ok[:, None], other=0.0).to(ACC)
                pf_block = tl.dot(p, f, out_dtype=ACC, input_precision=F_PRECISION)
                pf = pf * alpha[:, None] + pf_block
                if not CAUSAL:  # causal: every seen key is at or below the diagonal, P @ F's lower part is P @ F
                    top = pid_m * BLOCK_M + causal_offset  # the first row's diagonal
                    if start + BLOCK_N <= top + 1:  # every key of the block at or below every row's diagonal
                        pfl_block = pf_block
                    elif start > top + BLOCK_M - 1:  # every key above: nothing of the lower part
                        pfl_block = tl.zeros([BLOCK_M, NF], ACC)
                    else:
                        low = tl.where(cols[None, :] <= diag[:, None], p, 0.0)
                        pfl_block = tl.dot(low, f, out_dtype=ACC, input_precision=F_PRECISION)
                    pfl = pfl * alpha[:, None] + pfl_block
            m_i = m_new
        some = l_i > 0
        inv = tl.where(some, 1.0 / tl.where(some, l_i, 1.0), 0.0)
        lse = tl.where(some, m_i + tl.log(tl.where(some, l_i, 1.0)), float("-inf"))
        tl.store(O + b * sob + h * soh + rows64[:, None] * som + dims[None, :] * sod,
                 (acc * inv[:, None]).to(O.dtype.element_ty), mask=row_ok[:, None])
        r = b * srb + h * srh + rows64 * srm
        tl.store(LSE + r, lse, mask=row_ok)
        tl.store(SMAX + r, best, mask=row_ok)
        tl.store(ARG + r, where, mask=row_ok)
        tl.store(PS + r, ps * inv, mask=row_ok)
        if HAS_F:
            pr = b * spb + h * sph + rows64[:, None] * spm + fdims[None, :] * spf
            tl.store(PF + pr, pf * inv[:, None], mask=row_ok[:, None])
            if CAUSAL:
                tl.store(PFL + pr, pf * inv[:, None], mask=row_ok[:, None])
            else:
                tl.store(PFL + pr, pfl * inv[:, None], mask=row_ok[:, None])

    return _attention_statistics


@dataclass(frozen=True)
class Blocks:
    """The tile sizes and launch options :func:`attention_statistics` picks for a dtype and padded d_head."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def launch_blocks(dtype: torch.dtype, D: int, capability: tuple[int, int] | None = None) -> Blocks:
    """The blocks for inputs of ``dtype`` and padded d_head ``D`` (a power of two, at least 16) on a
    GPU of compute ``capability`` (``(9, 0)``: H100/H200; None: unknown, as under the interpreter).

    Chosen by compiling each for sm_90, sm_80, sm_89 and sm_86 on a CPU (benchmarks/compile_kernel.py;
    figures in docs/benchmarks.md), not by timing: large tiles that fit the 99 KB of shared memory
    per block of an sm_86/sm_89 GPU (an H100 has 227 KB, an A100 163 KB) and spill (almost) no
    registers. The statistics keep several ``[BLOCK_M, BLOCK_N]`` tiles alive beside
    FlashAttention's (the eligible scores, the first argmax, ``p`` below the diagonal) and ``P @ F``
    runs on CUDA cores in float32, so FlashAttention-2's 64 x 64 blocks of 4 warps spilled 1.3-2.5
    KB per thread (21 KB in float32 at d_head 64), and float64 at d_head 256 needed 344 KB of shared
    memory in 32 x 32 blocks of 3 stages. Float64 is for exactness, not speed: its smallest tiles.
    The 16-bit tiles up to d_head 128 were then timed on an H200 (benchmarks/bench_kernel.py
    --configs, 16k tokens, Llama-3-8B's heads): 64 x 32 in 4 warps took 10.7 ms where 8 warps took
    27.3 (with the aggregate's key features 25.7 and 43.8), with the same results to the bit,
    although they spill up to 788 bytes per thread there: sm_90 takes 4 warps. Elsewhere they spill
    up to 1.3 KB (sm_80) and are not timed: 8 warps, which spill nothing."""
    if dtype in (torch.float16, torch.bfloat16):
        warps = 4 if capability == (9, 0) else 8
        return Blocks(64, 32, warps, 2) if D <= 128 else Blocks(32, 32, 8, 2)
    if dtype == torch.float32:
        return Blocks(32, 32, 4, 3) if D <= 64 else Blocks(32, 32, 8, 2) if D <= 128 else Blocks(16, 32, 4, 2)
    if D <= 32:
        return Blocks(32, 32, 4, 3)
    return Blocks(32, 32, 4, 2) if D <= 64 else Blocks(16, 32, 4, 2) if D <= 128 else Blocks(16, 16, 4, 1)


class KernelCalls:
    """One pass's attention calls on the kernel engine: each call checked (:func:`refusal`, and the
    caller's own conditions), then run; where the kernel cannot serve the model (a refusal, or the
    installed triton cannot compile it: :class:`KernelUnavailable`) the reason is handed once to
    ``fall_back("model", reason)`` and every later call is left to the caller's other path."""

    def __init__(self, fall_back: Callable[[str, str], None]) -> None:
        self.fall_back = fall_back  # records (name, reason): the caller's log and kernel_fallback
        self.refused: str | None = None  # why this model's attention cannot run in the kernel

    def accepts(self, call: AttentionCall, more: Callable[[AttentionCall], str | None] | None = None) -> bool:
        """Whether the kernel can compute ``call`` exactly: :func:`refusal`, then ``more`` (the
        caller's conditions, a reason or None); False from the first refusal on (the model's)."""
        if self.refused is not None:
            return False
        q, k, v, mask = call.query, call.key, call.value, call.mask
        reason = refusal(q, k, v, softcap=call.softcap, bias=call.position_bias, sinks=call.sinks,
                         dropout=call.dropout, float_mask=mask is not None and mask.dtype != torch.bool)
        if reason is None and more is not None:
            reason = more(call)
        if reason is not None:
            self._refuse(f"the kernel cannot compute this model's attention exactly: {reason}")
            return False
        return True

    def run(self, call: AttentionCall, *, eligible: torch.Tensor | None = None,
            features: torch.Tensor | None = None) -> KernelStatistics | None:
        """:func:`attention_statistics` of ``call``; None where triton could not compile it
        (nothing ran: this call and the rest go to the caller's other path)."""
        try:
            return attention_statistics(call.query, call.key, call.value, scaling=call.scaling, causal=call.causal,
                                        mask=call.mask, eligible=eligible, features=features)
        except KernelUnavailable as error:
            self._refuse(str(error))
            return None

    def _refuse(self, reason: str) -> None:
        self.refused = reason
        self.fall_back("model", reason)


@lru_cache(maxsize=16)
def _scale(scaling: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``scaling`` as a one-element tensor on ``device``: made once, not copied to a GPU per call."""
    return torch.tensor([scaling], dtype=dtype, device=device)


def attention_statistics(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scaling: float | None = None,
                         causal: bool = False, mask: torch.Tensor | None = None,
                         eligible: torch.Tensor | None = None, features: torch.Tensor | None = None,
                         block_m: int | None = None, block_n: int | None = None, num_warps: int | None = None,
                         num_stages: int | None = None, features_precision: str | None = None) -> KernelStatistics:
    """One flash-attention pass over ``q`` ``[B, H, Q, D]``, ``k``/``v`` ``[B, Hkv, K, D]`` with the
    statistics of :class:`KernelStatistics`.

    ``causal``: key ``j`` is seen by query ``i`` when ``j <= i + K - Q`` (bottom-right aligned; the
    diagonal of the split is the same line). ``mask``: boolean, True where a key is seen,
    broadcastable to ``[B, H, Q, K]`` (a padding mask ``[B, 1, 1, K]`` or transformers' 4-d mask).
    ``eligible``: boolean ``[B, K]``, the keys the maximum and ``score_dot`` range over (None: all).
    ``features``: ``[B, K, f]`` key features (padded here to a power of two of at least 16 columns).
    ``block_m``, ``block_n``, ``num_warps``, ``num_stages``: the launch's (None: :func:`launch_blocks`').
    ``features_precision``: triton's ``input_precision`` of the float32 ``P @ F`` (None: ``"ieee"``, on
    CUDA cores; ``"tf32x3"``, three tensor-core products, was 5% slower on an H200: docs/benchmarks.md).
    Raises ValueError with :func:`refusal`'s reason where the call is not supported."""
    reason = refusal(q, k, v)
    if reason is not None:
        raise ValueError(reason)
    if mask is not None and mask.dtype != torch.bool:
        raise ValueError(refusal(q, k, v, float_mask=True) or "the mask must be boolean")
    launch = kernel_launch(q, k, v, scaling=scaling, causal=causal, mask=mask, eligible=eligible,
                           features=features, block_m=block_m, block_n=block_n, num_warps=num_warps,
                           num_stages=num_stages, features_precision=features_precision)
    kernel = _kernel(interpreted())
    failure = compile_failure(kernel, launch)
    if failure is not None:
        raise KernelUnavailable(failure)
    kernel[launch.grid](*launch.args, **launch.meta)
    return launch.statistics


_failed: dict[tuple[Any, ...], str] = {}
"""Why a specialisation did not compile, by :func:`_specialisation`: a failed compile is not cached
by triton, and each retry costs seconds."""


def _specialisation(launch: Launch) -> tuple[Any, ...]:
    q = launch.args[0]
    return (q.device, q.dtype, *sorted((k, str(v)) for k, v in launch.meta.items()))


def compile_failure(kernel: Any, launch: Launch) -> str | None:
    """Why triton cannot compile ``launch``, or None, before anything runs: ``JITFunction.warmup``
    compiles (or finds in triton's cache) the launch's specialisation without launching it.

    A compiler that fails on a configuration must not end the analysis: triton 3.6 (the one of
    PyTorch 2.11's CUDA wheels) stops on float64 ``tl.dot`` at d_head 32 and more ("fp64 don't
    support largeK MMA"), where triton 3.9 compiles every configuration (benchmarks/compile_kernel.py)."""
    if interpreted():  # the interpreter compiles nothing
        return None
    key = _specialisation(launch)
    if key in _failed:
        return _failed[key]
    try:
        kernel.warmup(*launch.args, grid=launch.grid, **launch.meta)
    except Exception as error:  # triton's CompilationError, MLIR's RuntimeError, ptxas's errors
        import triton

        first = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
        _failed[key] = (f"triton {triton.__version__} could not compile the kernel for {launch.args[0].dtype} "
                        f"at d_head {launch.meta['D']} ({type(error).__name__}: {first[:200]})")
        return _failed[key]
    return None


@dataclass(frozen=True)
class Launch:
    """One launch of the kernel: its grid, arguments and compile-time parameters (``meta``: the
    constexprs, ``num_warps``, ``num_stages``), and the statistics its outputs will hold."""

    grid: tuple[int, int]
    args: tuple[Any, ...]
    meta: dict[str, Any]
    statistics: KernelStatistics


def kernel_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scaling: float | None = None,
                  causal: bool = False, mask: torch.Tensor | None = None, eligible: torch.Tensor | None = None,
                  features: torch.Tensor | None = None, block_m: int | None = None,
                  block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                  features_precision: str | None = None, capability: tuple[int, int] | None = None) -> Launch:
    """What :func:`attention_statistics` launches (its outputs allocated, not yet written), on any
    device: ahead-of-time compilation (benchmarks/compile_kernel.py) specialises the kernel on
    exactly these arguments without a GPU."""
    import triton

    B, H, Q, d = q.shape
    Hkv, K = k.shape[1], k.shape[2]
    scaling = 1.0 / math.sqrt(d) if scaling is None else float(scaling)
    # tl.dot's dimensions are powers of two of at least 16: zeros after d change no dot product
    D = max(16, 1 << (d - 1).bit_length())
    if D != d:
        q, k, v = (torch.nn.functional.pad(x, (0, D - d)) for x in (q, k, v))
    wide = q.dtype == torch.float64
    acc = torch.float64 if wide else torch.float32
    device = q.device
    out = torch.empty_like(q)
    lse = torch.empty(B, H, Q, dtype=acc, device=device)
    smax = torch.empty_like(lse)
    arg = torch.empty(B, H, Q, dtype=torch.int64, device=device)
    ps = torch.empty_like(lse)
    if eligible is None:
        eligible = torch.ones(B, K, dtype=torch.bool, device=device)
    elig = eligible.to(device=device, dtype=torch.int8).expand(B, K)
    if mask is not None:
        # the bool's bytes read as int8 (same size: any strides, an expanded mask stays a view);
        # .to(int8) copied the whole [B, 1, Q, K] mask on every call, 4 GiB at 64k tokens
        m = mask.to(device=device).view(torch.int8)
        while m.dim() < 4:
            m = m[None]
        m = m.expand(B, H, Q, K)
        mask_strides = m.stride()
    else:
        m, mask_strides = elig, (0, 0, 0, 0)  # not read
    has_f = features is not None
    if features is not None:
        f = features.shape[2]
        nf = max(16, 1 << max(f - 1, 0).bit_length())
        feats = torch.zeros(B, K, nf, dtype=acc, device=device)
        feats[:, :, :f] = features.to(device=device, dtype=acc)
        pf = torch.empty(B, H, Q, nf, dtype=acc, device=device)
        pfl = torch.empty_like(pf)
    else:
        f, nf = 0, 16
        feats = pf = pfl = lse  # not read or written
    if capability is None and q.device.type == "cuda":  # ``capability``: the target of an ahead-of-time compile
        capability = torch.cuda.get_device_capability(q.device)
    blocks = launch_blocks(q.dtype, D, capability)
    block_m = blocks.block_m if block_m is None else block_m
    block_n = blocks.block_n if block_n is None else block_n
    grid = (triton.cdiv(Q, block_m), B * H)
    pf_strides = pf.stride() if has_f else (0, 0, 0, 0)
    args = (
        q, k, v, m, elig, feats, out, lse, smax, arg, pf, pfl, ps,
        _scale(scaling, acc, device), H, H // Hkv, Q, K, K - Q,
        *q.stride(), *k.stride(), *v.stride(),
        *mask_strides, *elig.stride(), *(feats.stride() if has_f else (0, 0, 0)),
        *out.stride(), *lse.stride(), *pf_strides,
    )
    meta = dict(
        D=D, NF=nf, BLOCK_M=block_m, BLOCK_N=block_n,
        CAUSAL=causal, HAS_MASK=mask is not None, HAS_F=has_f,
        ACC=triton.language.float64 if wide else triton.language.float32,
        PV_LOW=q.dtype in (torch.float16, torch.bfloat16),
        # 16-bit products are exact in float32 whatever the setting; float32 ones only under "ieee"
        QK_PRECISION="tf32" if q.dtype in (torch.float16, torch.bfloat16) else "ieee",
        F_PRECISION=features_precision or "ieee",
        num_warps=num_warps or blocks.num_warps, num_stages=num_stages or blocks.num_stages,
    )
    statistics = KernelStatistics(out=out[..., :d], lse=lse, max_score=smax, argmax=arg,
                                  linear=pf[..., :f] if has_f else None,
                                  linear_lower=pfl[..., :f] if has_f else None, score_dot=ps)
    return Launch(grid=grid, args=args, meta=meta, statistics=statistics)
