"""LRP's time and memory against the batch size, for a translation model on long sentences.

LRP costs one backward pass per generation step of a batch's longest translation, over the whole
padded batch, and the autograd graph of that batch stays alive through all of them. A batch of
long news sentences, sorted by source length, is padded to the longest (possibly runaway)
translation among them, so the batch size sets both the peak memory and the padding.

``--orders`` compares how sentences are grouped into batches: ``decoder`` (headlab's order: by
the length of the translation, then of the source; :func:`headlab.data.inputs.batch_lengths`)
against ``source`` (by the source's length alone, headlab's order before 2026-11-24).

Each (order, batch size) runs in its own process (so that each peak resident set size is its
own): the model translates the first ``--sentences`` lines of ``--data`` greedily (batch 32
whatever is measured, so every process explains the same translations), then
:func:`headlab.importance.compute_lrp` runs over them. Reported per run: wall and CPU seconds of
``compute_lrp``, the process's peak RSS, the longest translation, the padded work (the sum over
batches of rows x longest translation x (longest source + longest translation), relative to
that sum without padding), and the largest absolute difference of its head scores from the
first run's (the per-target relevances do not depend on the other rows of a batch, so only
float rounding may differ).

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python benchmarks/bench_lrp_batch.py runs/news-en-de-model \\
        --data runs/news-en-de-data/valid.en.gz --sentences 128 --batch-sizes 32,8 --orders decoder,source
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure_one(args) -> dict:
    """In a child process: translate, then LRP at ``args.one`` sentences per batch."""
    import torch

    from headlab.data.inputs import translate_data
    from headlab.importance import compute_lrp, describe_model, read_data
    from headlab.loading import load_model, load_tokenizer

    torch.set_num_threads(args.threads)
    if args.order == "source":  # the earlier grouping, by the source's length alone
        import headlab.data.inputs as importance_data

        importance_data.batch_lengths = lambda data, decoder_side=None: [len(ids) for ids in data.sources]
    model = load_model(args.model, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(args.model)
    info = describe_model(model, tokenizer)
    data = read_data(args.data, tokenizer, info, n_sentences=args.sentences)
    data = translate_data(model, data, info, batch_size=32)
    start_wall, start_cpu = time.perf_counter(), _cpu()
    scores = compute_lrp(model, data, info, batch_size=args.one, bootstrap=0)
    return {
        "order": args.order,
        "batch_size": args.one,
        "wall_s": time.perf_counter() - start_wall,
        "cpu_s": _cpu() - start_cpu,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # KiB on Linux
        "targets": scores.signature["n_steps"],
        "longest_translation": max(len(t) for t in data.translations),
        "padded_work": _padded_work(data, info, args.one),
        "scores": {kind: array.tolist() for kind, array in scores.scores.items()},
    }


def _padded_work(data, info, batch_size: int) -> float:
    """LRP's work with padding over its work without: each batch runs one backward per step of
    its longest translation, each over all its rows at the batch's padded length."""
    from headlab.importance import make_batches

    work = 0
    for batch in make_batches(data, info, batch_size=batch_size):
        steps, sources = batch.inputs["decoder_input_ids"].shape[1], batch.inputs["input_ids"].shape[1]
        work += batch.size * steps * (sources + steps)
    ideal = sum(len(t) * (len(s) + len(t)) for s, t in zip(data.sources, data.translations))
    return work / ideal


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a translation model directory (with its tokenizer)")
    parser.add_argument("--data", required=True, help="source sentences, one per line (plain or .gz)")
    parser.add_argument("--sentences", type=int, default=64)
    parser.add_argument("--batch-sizes", default="32,8")
    parser.add_argument("--orders", default="decoder", help="comma-separated: decoder, source")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--order", default="decoder", choices=("decoder", "source"), help=argparse.SUPPRESS)
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # the child's batch size
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure_one(args)))
        return

    import numpy as np

    sizes = [int(s) for s in args.batch_sizes.split(",")]
    orders = [o.strip() for o in args.orders.split(",")]
    if not set(orders) <= {"decoder", "source"}:
        parser.error(f"--orders: expected decoder and/or source, got {args.orders!r}")
    rows = []
    for size in sizes:
        for order in orders:
            command = [sys.executable, __file__, args.model, "--data", args.data, "--sentences",
                       str(args.sentences), "--threads", str(args.threads), "--one", str(size), "--order", order]
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
    first = rows[0]["scores"]
    print(f"model {args.model}; {args.sentences} sentences of {args.data}; {args.threads} thread(s); "
          f"torch on {platform.machine()}, {os.cpu_count()} CPUs")
    print("| batch size | order | targets | longest translation | padded work | compute_lrp wall s | CPU s "
          f"| peak RSS (MB) | max abs score difference from batch {sizes[0]}, {orders[0]} |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        diff = max(float(np.nanmax(np.abs(np.array(row["scores"][k], dtype=float) - np.array(first[k], dtype=float))))
                   for k in first)
        print(f"| {row['batch_size']} | {row['order']} | {row['targets']} | {row['longest_translation']} "
              f"| {row['padded_work']:.2f} | {row['wall_s']:.1f} | {row['cpu_s']:.1f} | {row['peak_rss_mb']:.0f} "
              f"| {diff:.1e} |")


if __name__ == "__main__":
    main()
