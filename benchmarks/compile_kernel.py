"""Compile the statistics kernel (headlab.data.attention_kernel) for NVIDIA GPUs ahead of time, on a CPU.

The kernel has to compile, fit in shared memory and not spill much before a lent GPU's minutes are
spent on it. Triton compiles without a GPU when given the target (``GPUTarget("cuda", 90, 32)``:
sm_90, H100/H200; 80: A100) and the bundled ``ptxas``. Each configuration is specialised exactly as
a launch on the GPU would be: :func:`headlab.data.attention_kernel.kernel_launch` builds the
arguments :func:`attention_statistics` passes (CPU tensors of the same dtypes, layouts and strides),
and triton's own binder (the one ``JITFunction.run`` calls) turns them into the signature, the
constexprs and the divisibility hints, as in ``triton/tools/compile.py``.

Reported per configuration: the blocks and launch options the launcher picks, the shared memory
(``metadata.shared``) against the target's limit per block, and the registers, stack frame and
spill bytes from ``ptxas -v`` (the log of the compile itself). Exit status 1 when a configuration
fails to compile or does not fit.

    python benchmarks/compile_kernel.py                      # every configuration the engine launches, sm_90/80/89/86
    python benchmarks/compile_kernel.py --targets 90 --quick # the heaviest configuration per dtype and d_head
    python benchmarks/compile_kernel.py --json out.json

Triton must not be in interpreter mode (``TRITON_INTERPRET=1``): its own library functions are then
defined for the interpreter and nothing compiles; run this in a process of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

DTYPE_NAMES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
               "float64": torch.float64}

SHARED_LIMIT = {90: 227 * 1024, 80: 163 * 1024, 89: 99 * 1024, 86: 99 * 1024}
"""Bytes of shared memory one block may use (the opt-in maximum, ``sharedMemPerBlockOptin``, which
triton's launcher checks ``metadata.shared`` against): 227 KB on compute capability 9.0 (H100,
H200), 163 KB on 8.0 (A100), 99 KB on 8.6 and 8.9 (A10, RTX 30xx/40xx, L4, L40S) (CUDA C++
Programming Guide, "Technical Specifications per Compute Capability")."""

FEATURES = (0, 2, 22)
"""Key-feature columns the engine passes (``AttentionStatistics.kernel_features``): none; the two
of ``word_distance`` alone (NF 16); those of the aggregate statistics (1 + 18 tags, + 1 under a
causal mask) and ``word_distance`` (NF 32)."""


@dataclass(frozen=True)
class Config:
    dtype: str
    d_head: int
    causal: bool
    mask: bool
    features: int


@dataclass
class Result:
    target: int
    config: Config
    block_m: int = 0
    block_n: int = 0
    num_warps: int = 0
    num_stages: int = 0
    shared: int = 0
    shared_limit: int = 0
    registers: int | None = None
    stack: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    seconds: float = 0.0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.shared <= self.shared_limit


def engine_configs(dtypes: list[str], d_heads: list[int]) -> list[Config]:
    """Every combination the engine launches for these dtypes and head sizes."""
    return [Config(dtype, d, causal, mask, f) for dtype, d, causal, mask, f
            in itertools.product(dtypes, d_heads, (False, True), (False, True), FEATURES)]


def quick_configs(dtypes: list[str], d_heads: list[int]) -> list[Config]:
    """The heaviest configuration per dtype and head size (causal, masked, 22 feature columns: the
    most registers and shared memory), and the lightest (none of them) at the smallest head size:
    each constexpr branch of the kernel compiled at least once."""
    heavy = [Config(dtype, d, True, True, 22) for dtype in dtypes for d in d_heads]
    return heavy + [Config(dtype, min(d_heads), False, False, 0) for dtype in dtypes]


def _arguments(config: Config, *, batch: int = 2, heads: int = 32, kv_heads: int = 8, length: int = 256,
               blocks: tuple[int, int] | None = None, arch: int | None = None) -> Any:
    """The launch the engine makes for ``config`` (CPU tensors laid out as a model's attention call
    passes them: ``[B, T, H, d]`` projections transposed to ``[B, H, T, d]``)."""
    from headlab.data.attention_kernel import kernel_launch

    dtype = DTYPE_NAMES[config.dtype]
    q = torch.zeros(batch, length, heads, config.d_head, dtype=dtype).transpose(1, 2)
    k = torch.zeros(batch, length, kv_heads, config.d_head, dtype=dtype).transpose(1, 2)
    v = torch.zeros_like(k)
    mask = torch.ones(batch, 1, length, length, dtype=torch.bool) if config.mask else None
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    features = torch.zeros(batch, length, config.features, dtype=wide) if config.features else None
    eligible = torch.ones(batch, length, dtype=torch.bool)
    block_m, block_n = blocks or (None, None)
    return kernel_launch(q, k, v, causal=config.causal, mask=mask, eligible=eligible, features=features,
                         block_m=block_m, block_n=block_n, capability=None if arch is None else divmod(arch, 10))


_PTXAS = {
    "registers": re.compile(r"Used (\d+) registers"),
    "stack": re.compile(r"(\d+) bytes stack frame"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
}


def compile_config(config: Config, arch: int, blocks: tuple[int, int] | None = None) -> Result:
    """Compile ``config`` for ``sm_<arch>`` (with the launcher's blocks, or ``blocks`` as
    ``attention_statistics(block_m=, block_n=)`` takes them); a failure is recorded in ``error``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    from headlab.data.attention_kernel import _kernel

    result = Result(target=arch, config=config, shared_limit=SHARED_LIMIT[arch])
    launch = _arguments(config, blocks=blocks, arch=arch)
    result.block_m, result.block_n = launch.meta["BLOCK_M"], launch.meta["BLOCK_N"]
    result.num_warps, result.num_stages = launch.meta["num_warps"], launch.meta["num_stages"]
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    jit = _kernel(False)
    binder = create_function_from_signature(jit.signature, jit.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.meta)
    options, signature, constexprs, attrs = jit._pack_args(backend, launch.meta, bound, specialization, options)
    log = io.StringIO()
    start = time.perf_counter()
    try:
        with triton.knobs.nvidia.scope(), triton.knobs.compilation.scope(), contextlib.redirect_stdout(log):
            triton.knobs.nvidia.dump_ptxas_log = True  # ptxas -v's report, printed by the compile
            triton.knobs.compilation.always_compile = True  # a cached kernel would print no report
            compiled = triton.compile(ASTSource(jit, signature, constexprs, attrs), target=target,
                                      options=options.__dict__)
    except Exception as error:  # noqa: BLE001 - every failure is a result of the tool, reported per config
        result.error = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
        result.seconds = time.perf_counter() - start
        return result
    result.seconds = time.perf_counter() - start
    result.shared = int(compiled.metadata.shared)
    for name, pattern in _PTXAS.items():
        found = pattern.search(log.getvalue())
        setattr(result, name, int(found.group(1)) if found else None)
    return result


def ptxas_missing() -> str | None:
    """Why nothing can compile here: no triton, triton in interpreter mode, or no ptxas."""
    try:
        import triton
    except ImportError:
        return "triton is not installed"
    if triton.knobs.runtime.interpret:
        return "triton runs in interpreter mode (TRITON_INTERPRET=1): its library is not compiled"
    for arch in (80, 90):
        try:
            from triton.backends.nvidia.compiler import get_ptxas
            path = get_ptxas(arch).path
        except Exception as error:  # noqa: BLE001 - no NVIDIA backend or no ptxas: the reason is reported
            return f"no ptxas for sm_{arch}: {error}"
        if not path or not os.path.exists(path):
            return f"no ptxas for sm_{arch}"
    return None


def table(results: list[Result]) -> str:
    """A markdown table, one row per configuration and target."""
    lines = ["| target | dtype | d_head | causal | mask | F | blocks | warps/stages | shared KiB (limit) "
             "| registers | stack / spill st / ld B | compile s | |",
             "|---|---|---:|---|---|---:|---|---|---:|---:|---|---:|---|"]
    for r in results:
        c = r.config
        status = "ok" if r.ok else (r.error or "shared memory over the limit")
        lines.append(f"| sm_{r.target} | {c.dtype} | {c.d_head} | {'yes' if c.causal else 'no'} | "
                     f"{'yes' if c.mask else 'no'} | {c.features} | {r.block_m}x{r.block_n} | "
                     f"{r.num_warps}/{r.num_stages} | {r.shared / 1024:.1f} ({r.shared_limit // 1024}) | "
                     f"{r.registers} | {r.stack} / {r.spill_stores} / {r.spill_loads} | {r.seconds:.1f} | {status} |")
    return "\n".join(lines)


def summary(results: list[Result]) -> str:
    """One row per dtype and d_head: the worst over its configurations (causal or not, masked or
    not, each number of feature columns) on each target, for docs/benchmarks.md."""
    groups: dict[tuple[str, int], list[Result]] = {}
    for r in results:
        groups.setdefault((r.config.dtype, r.config.d_head), []).append(r)
    targets = sorted({r.target for r in results}, reverse=True)
    head = " | ".join(f"sm_{t}: shared KiB / registers / spill B" for t in targets)
    lines = [f"| dtype | d_head | configs | blocks, warps/stages | {head} | compiled |",
             "|---|---:|---:|---|" + "---|" * len(targets) + "---|"]
    for (dtype, d), group in groups.items():
        cells = []
        for t in targets:
            on = [r for r in group if r.target == t]
            cells.append(f"{max(r.shared for r in on) / 1024:.1f} / {max(r.registers or 0 for r in on)} / "
                         f"{max(r.spill_stores or 0 for r in on)}")
        first = group[0]
        ok = sum(r.ok for r in group)
        lines.append(f"| {dtype} | {d} | {len(group) // len(targets)} | {first.block_m}x{first.block_n}, "
                     f"{first.num_warps}/{first.num_stages} | {' | '.join(cells)} | {ok}/{len(group)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", type=int, nargs="+", default=[90, 80, 89, 86], choices=sorted(SHARED_LIMIT),
                        help="compute capabilities")
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPE_NAMES), choices=list(DTYPE_NAMES))
    parser.add_argument("--d-heads", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    parser.add_argument("--quick", action="store_true", help="the heaviest configuration per dtype and d_head only")
    parser.add_argument("--blocks", type=int, nargs=2, metavar=("BLOCK_M", "BLOCK_N"),
                        help="these blocks instead of the launcher's (as attention_statistics(block_m=, block_n=))")
    parser.add_argument("--json", type=Path, help="also write the results here (JSON)")
    args = parser.parse_args(argv)
    reason = ptxas_missing()
    if reason is not None:
        print(f"compile_kernel: cannot compile: {reason}", file=sys.stderr)
        return 2
    configs = (quick_configs if args.quick else engine_configs)(args.dtypes, args.d_heads)
    results = []
    for arch in args.targets:
        for config in configs:
            results.append(compile_config(config, arch, tuple(args.blocks) if args.blocks else None))
            print(table(results[-1:]).splitlines()[-1], flush=True)
    print(table(results))
    print(summary(results))
    if args.json is not None:
        rows = [dict(asdict(r), ok=r.ok) for r in results]
        partial = args.json.with_name(args.json.name + ".partial")
        partial.write_text(json.dumps(rows, indent=1))
        partial.replace(args.json)  # atomic: a reader never sees half a file
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
