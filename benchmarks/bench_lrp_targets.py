"""LRP on a sample of target positions against all positions, for a language model (issue 16).

For each way, :func:`headlab.importance.compute_lrp` runs over the same sentences in one
process, interleaved over ``--repeats``: ``all`` explains the top-1 logit at every position,
``K=k`` a seeded sample of ``k`` positions per sentence (``--lrp-targets k``). Reported: LRP
targets per second (wall clock and this process's CPU time), sentences per second, and how far
the sampled head scores are from the all-positions ones: Spearman's rho over all heads, the
largest absolute difference, and that difference against the bootstrap standard error of the
sampled scores (``|difference| / stderr``: mostly below 2 when the error is honest).

Model: ``--model DIR`` (a causal LM directory with its tokenizer; it is copied to a temporary
directory before loading), else a random tiny Llama-style model (6 layers x 8 heads, d_model
256) on random token ids, said in the output. Data: the first ``--sentences`` lines of
``--data`` (default: Multi30k's English test_2016_flickr).

    python benchmarks/bench_lrp_targets.py --model /work/runs/english-lm/best --targets 4
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from headlab.importance import ImportanceData, compute_lrp, describe_model, read_data  # noqa: E402
from headlab.importance.agreement import spearman  # noqa: E402

DATA = ROOT / "data" / "multi30k" / "test_2016_flickr.en.gz"


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def load(args):
    if args.model and Path(args.model, "config.json").is_file():
        from headlab.loading import load_model, load_tokenizer

        with tempfile.TemporaryDirectory() as tmp:
            local = Path(tmp) / "model"
            shutil.copytree(args.model, local)
            if args.tokenizer:
                for path in Path(args.tokenizer).iterdir():
                    if path.is_file() and not (local / path.name).exists():
                        shutil.copy(path, local / path.name)
            model, tokenizer = load_model(str(local)), load_tokenizer(str(local))
        info = describe_model(model, tokenizer)
        data = read_data(str(args.data), tokenizer, info, n_sentences=args.sentences)
        return model, info, data, f"{args.model} (trained)"
    import transformers

    config = transformers.LlamaConfig(vocab_size=8000, hidden_size=256, intermediate_size=1024, num_hidden_layers=6,
                                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(8, 20, (args.sentences,), generator=g).tolist()
    data = ImportanceData.from_ids([torch.randint(3, 8000, (n,), generator=g).tolist() for n in lengths])
    return model, describe_model(model), data, "a random tiny Llama (6x8, d_model 256): --model not found"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="causal LM directory (default: a random tiny Llama)")
    parser.add_argument("--tokenizer", help="directory with tokenizer files to add to the model's copy")
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--sentences", type=int, default=50)
    parser.add_argument("--targets", type=int, default=4, help="K of the sampled way")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, info, data, described = load(args)
    print(f"model: {described}; {len(data)} sentences, {sum(len(s) for s in data.sources)} tokens; "
          f"batch {args.batch_size}, {args.threads} thread(s); torch {torch.__version__}, {platform.machine()}")
    ways = {"all": None, f"K={args.targets}": args.targets}
    times: dict[str, list[tuple[float, float]]] = {w: [] for w in ways}
    results = {}
    for _ in range(args.repeats):
        for way, k in ways.items():
            load_before = os.getloadavg()[0]
            wall, cpu = time.perf_counter(), _cpu()
            results[way] = compute_lrp(model, data, info, batch_size=args.batch_size, targets=k, seed=args.seed)
            times[way].append((time.perf_counter() - wall, _cpu() - cpu))
            print(f"  {way}: {times[way][-1][0]:.2f} s wall, {times[way][-1][1]:.2f} s CPU (load {load_before:.1f})")
    print()
    print("| way | targets | wall s | CPU s | targets/s (wall) | targets/s (CPU) | sentences/s (wall) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for way in ways:
        n = results[way].signature["n_steps"]
        wall = statistics.median(t[0] for t in times[way])
        cpu = statistics.median(t[1] for t in times[way])
        print(f"| {way} | {n} | {wall:.2f} | {cpu:.2f} | {n / wall:.1f} | {n / cpu:.1f} | {len(data) / wall:.2f} |")
    full, sampled = results["all"], results[f"K={args.targets}"]
    a = np.concatenate([full[k].ravel() for k in full.kinds])
    b = np.concatenate([sampled[k].ravel() for k in full.kinds])
    se = sampled.stderr()
    se_all = full.stderr()
    errors = np.concatenate([se[k].ravel() for k in full.kinds])
    errors_all = np.concatenate([se_all[k].ravel() for k in full.kinds])
    z = np.abs(a - b) / np.where(errors > 0, errors, np.nan)
    print()
    print(f"head scores, K={args.targets} against all positions, over {len(a)} heads: Spearman {spearman(a, b):+.3f}; "
          f"max |difference| {np.abs(a - b).max():.4f} (mean {np.abs(a - b).mean():.4f}; scores range "
          f"{a.min():.3f} to {a.max():.3f})")
    print(f"bootstrap standard error (200 resamples of the sentences): all positions median {np.median(errors_all):.4f} "
          f"max {errors_all.max():.4f}; K={args.targets} median {np.median(errors):.4f} max {errors.max():.4f}")
    print(f"|difference| / stderr(K={args.targets}): median {np.nanmedian(z):.2f}, max {np.nanmax(z):.2f}, "
          f"share below 2: {np.mean(z[~np.isnan(z)] < 2):.2f}")


if __name__ == "__main__":
    main()
