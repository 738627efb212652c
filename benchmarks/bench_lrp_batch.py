"""LRP's time and memory against the batch size, for a translation model on long sentences.

LRP costs one backward pass per generation step of a batch's longest translation, over the whole
padded batch, and the autograd graph of that batch stays alive through all of them. A batch of
long news sentences, sorted by source length, is padded to the longest (possibly runaway)
translation among them, so the batch size sets both the peak memory and the padding.

Each batch size runs in its own process (so that each peak resident set size is its own): the
model translates the first ``--sentences`` lines of ``--data`` greedily (batch 32 whatever the
size measured, so every process explains the same translations), then
:func:`headlab.importance.compute_lrp` runs over them with that batch size. Reported per batch
size: wall and CPU seconds of ``compute_lrp``, the process's peak RSS, the longest translation,
and the largest absolute difference of its head scores from the first size's (the per-target
relevances do not depend on the other rows of a batch, so only float rounding may differ).

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python benchmarks/bench_lrp_batch.py runs/news-en-de-model \\
        --data runs/news-en-de-data/valid.en.gz --sentences 64 --batch-sizes 32,8
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

    from headlab.importance import compute_lrp, describe_model, read_data
    from headlab.importance.data import translate_data
    from headlab.loading import load_model, load_tokenizer

    torch.set_num_threads(args.threads)
    model = load_model(args.model, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(args.model)
    info = describe_model(model, tokenizer)
    data = read_data(args.data, tokenizer, info, n_sentences=args.sentences)
    data = translate_data(model, data, info, batch_size=32)
    start_wall, start_cpu = time.perf_counter(), _cpu()
    scores = compute_lrp(model, data, info, batch_size=args.one, bootstrap=0)
    return {
        "batch_size": args.one,
        "wall_s": time.perf_counter() - start_wall,
        "cpu_s": _cpu() - start_cpu,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # KiB on Linux
        "targets": scores.signature["n_steps"],
        "longest_translation": max(len(t) for t in data.translations),
        "scores": {kind: array.tolist() for kind, array in scores.scores.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a translation model directory (with its tokenizer)")
    parser.add_argument("--data", required=True, help="source sentences, one per line (plain or .gz)")
    parser.add_argument("--sentences", type=int, default=64)
    parser.add_argument("--batch-sizes", default="32,8")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # the child's batch size
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure_one(args)))
        return

    import numpy as np

    sizes = [int(s) for s in args.batch_sizes.split(",")]
    rows = []
    for size in sizes:
        command = [sys.executable, __file__, args.model, "--data", args.data, "--sentences", str(args.sentences),
                   "--threads", str(args.threads), "--one", str(size)]
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    first = rows[0]["scores"]
    print(f"model {args.model}; {args.sentences} sentences of {args.data}; {args.threads} thread(s); "
          f"torch on {platform.machine()}, {os.cpu_count()} CPUs")
    print("| batch size | targets | longest translation | compute_lrp wall s | CPU s | peak RSS (MB) "
          "| max abs score difference from batch " + str(sizes[0]) + " |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        diff = max(float(np.nanmax(np.abs(np.array(row["scores"][k], dtype=float) - np.array(first[k], dtype=float))))
                   for k in first)
        print(f"| {row['batch_size']} | {row['targets']} | {row['longest_translation']} | {row['wall_s']:.1f} "
              f"| {row['cpu_s']:.1f} | {row['peak_rss_mb']:.0f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
