"""The statistics kernel alone (headlab.data.attention_kernel) against PyTorch's SDPA, on a CUDA GPU.

One attention call of one layer of a Llama-like shape (default Llama-3-8B's: 32 query heads, 8
key/value heads, d_head 128), causal, bfloat16, one sentence of each length, every key a word
(eligible), and the key features of functions + aggregate: 22 columns (the engine pads them to
32) whose last two are ``[word, j]`` (the distance split), as ``engine="kernel"`` passes them.
Rows, each timed with ``triton.testing.do_bench`` (median ms of its own repetitions):

* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` (the model's own attention);
* ``kernel, no features``: the kernel with the maximum, lse and ``score_dot`` only (confidence's call);
* ``kernel, features ieee`` / ``tf32x3``: with ``P @ F`` in triton's ``input_precision``
  (the engine's is ieee).

Accuracy: the largest difference of ``linear`` and ``linear_lower`` between the two precisions,
relative to the largest value (ieee is the reference), and the output against SDPA's.

    python benchmarks/bench_kernel.py --lengths 4096 16384 65536 --json out.json
    python benchmarks/bench_kernel.py --lengths 16384 --configs 64x32x8x2 128x64x8x3   # launch configurations
"""

from __future__ import annotations

import argparse
import functools
import json
import math

import torch


def inputs(length: int, heads: int, kv_heads: int, d_head: int, features: int, dtype: torch.dtype,
           seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, heads, length, d_head, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(1, kv_heads, length, d_head, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(1, kv_heads, length, d_head, device="cuda", dtype=dtype, generator=g)
    tags = (torch.rand(1, length, features - 2, device="cuda", generator=g) < 0.1).float()
    words = torch.ones(1, length, 1, device="cuda")
    positions = torch.arange(length, device="cuda", dtype=torch.float32).view(1, length, 1)
    return q, k, v, torch.cat([tags, words, positions], -1)


def measure(length: int, args: argparse.Namespace, dtype: torch.dtype) -> list[dict]:
    """The rows of one length: each run's median time, then the accuracy row."""
    import triton.testing

    from headlab.data.attention_kernel import attention_statistics

    q, k, v, features = inputs(length, args.heads, args.kv_heads, args.d_head, args.features, dtype)
    eligible = torch.ones(1, length, dtype=torch.bool, device="cuda")
    scaling = 1 / math.sqrt(args.d_head)

    def kernel(features: torch.Tensor | None = None, precision: str | None = None):
        return attention_statistics(q, k, v, scaling=scaling, causal=True, eligible=eligible, features=features,
                                    features_precision=precision)

    runs = {
        "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scaling, enable_gqa=True),
        "kernel, no features": kernel,
        "kernel, features ieee": lambda: kernel(features, "ieee"),
        "kernel, features tf32x3": lambda: kernel(features, "tf32x3"),
    }
    times = {}
    for name, run in runs.items():
        run()  # compile
        torch.cuda.synchronize()
        times[name] = triton.testing.do_bench(run, warmup=50, rep=300)
    exact, fast = kernel(features, "ieee"), kernel(features, "tf32x3")
    accuracy = {}
    for part in ("linear", "linear_lower"):
        a, b = getattr(exact, part).double(), getattr(fast, part).double()
        accuracy[part] = float((a - b).abs().max() / a.abs().max())
    output = float((exact.out.double() - runs["sdpa"]().double()).abs().max())
    rows: list[dict] = []
    for name, ms in times.items():
        rows.append({"length": length, "run": name, "ms": ms, "x_sdpa": ms / times["sdpa"]})
        print(f"{length:>7} {name:<24} {ms:9.2f} ms  {ms / times['sdpa']:6.2f} x SDPA", flush=True)
    print(f"{length:>7} tf32x3 vs ieee: linear {accuracy['linear']:.2e}, linear_lower "
          f"{accuracy['linear_lower']:.2e} (relative to the largest); output vs SDPA {output:.2e}", flush=True)
    rows.append({"length": length, "accuracy_tf32x3_vs_ieee": accuracy, "output_vs_sdpa": output})
    return rows


def sweep(length: int, args: argparse.Namespace, dtype: torch.dtype) -> list[dict]:
    """``--configs``: the kernel (no features; features in ieee) under each launch configuration
    ``BLOCK_MxBLOCK_NxWARPSxSTAGES``, its time and its largest difference from the first one's results."""
    import triton.testing

    from headlab.data.attention_kernel import attention_statistics

    q, k, v, features = inputs(length, args.heads, args.kv_heads, args.d_head, args.features, dtype)
    eligible = torch.ones(1, length, dtype=torch.bool, device="cuda")
    scaling = 1 / math.sqrt(args.d_head)
    sdpa = triton.testing.do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=scaling, enable_gqa=True), warmup=50, rep=300)
    print(f"{length:>7} sdpa {sdpa:9.2f} ms", flush=True)
    rows: list[dict] = [{"length": length, "run": "sdpa", "ms": sdpa}]
    first: dict[str, object] = {}
    for config in args.configs:
        block_m, block_n, warps, stages = (int(x) for x in config.split("x"))
        for name, feats in (("no features", None), ("features", features)):
            run = functools.partial(attention_statistics, q, k, v, scaling=scaling, causal=True, eligible=eligible,
                                    features=feats, block_m=block_m, block_n=block_n, num_warps=warps,
                                    num_stages=stages)
            try:
                got = run()
                torch.cuda.synchronize()
                ms = triton.testing.do_bench(run, warmup=50, rep=300)
            except Exception as error:  # out of shared memory, a failed compile: a row that says so
                print(f"{length:>7} {config:<14} {name:<12} failed: {type(error).__name__}: {str(error)[:120]}", flush=True)
                rows.append({"length": length, "config": config, "run": name, "failed": str(error)[:300]})
                continue
            parts = [p for p in ("out", "lse", "max_score", "linear", "linear_lower", "score_dot")
                     if getattr(got, p) is not None]
            reference = first.setdefault(name, got)
            diff = max(float((getattr(got, p).double() - getattr(reference, p).double()).abs().max()) for p in parts)
            same_argmax = bool(torch.equal(got.argmax, reference.argmax))  # type: ignore[attr-defined]
            print(f"{length:>7} {config:<14} {name:<12} {ms:9.2f} ms {ms / sdpa:6.2f} x SDPA; largest difference from "
                  f"{args.configs[0]} {diff:.1e}, argmax {'equal' if same_argmax else 'DIFFERS'}", flush=True)
            rows.append({"length": length, "config": config, "run": name, "ms": ms, "x_sdpa": ms / sdpa,
                         "difference": diff, "argmax_equal": same_argmax})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--d-head", type=int, default=128)
    parser.add_argument("--features", type=int, default=22)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--configs", nargs="+", metavar="MxNxWxS",
                        help="instead: sweep launch configurations (BLOCK_M x BLOCK_N x warps x stages; the first is "
                             "the reference of the differences), e.g. 64x32x8x2 128x64x8x3")
    args = parser.parse_args()
    import triton.testing

    dtype = getattr(torch, args.dtype)
    print(f"{torch.cuda.get_device_name(0)}; torch {torch.__version__}, triton {triton.__version__}; "
          f"{args.heads} heads ({args.kv_heads} key/value), d_head {args.d_head}, {args.dtype}, causal, "
          f"{args.features} feature columns", flush=True)
    rows = []
    for length in args.lengths:
        rows += sweep(length, args, dtype) if args.configs else measure(length, args, dtype)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"device": torch.cuda.get_device_name(0), "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
