"""Latency of physically pruned translation models against the full one (issue 6), in one run.

Each model (the full model first, then every pruned model given) is loaded once; then, for
``--repeats`` rounds, every model in turn (the order rotates each round, so no model always
runs first) times

* the encoder forward alone over ``--sentences`` test sentences (batches of 32), and
* end-to-end greedy translation of the same sentences,

with :func:`headlab.pruning.train.measure_latency` (one repeat per round). The figure reported
per model is the median over rounds, and the ratio against the full model is the median of the
per-round ratios, which is robust to other jobs on a shared machine. Translation time also
depends on how long the outputs are, so the mean output length is printed beside it.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_pruned_models.py models/multi30k-en-de \
        models/multi30k-en-de-pruned-enc models/multi30k-en-de-pruned-all --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from pathlib import Path

import torch

from headlab import count_parameters
from headlab.data import read_lines
from headlab.loading import load_model, load_tokenizer
from headlab.nmt.translate import translate
from headlab.pruning.train import measure_latency

DATA = Path(__file__).resolve().parents[1] / "data" / "multi30k"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("full", help="the unpruned model directory")
    parser.add_argument("pruned", nargs="+", help="pruned model directories (save_pruned)")
    parser.add_argument("--source", default=str(DATA / "test_2016_flickr.en.gz"))
    parser.add_argument("--sentences", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    sentences = read_lines(args.source)[: args.sentences]
    names = [args.full, *args.pruned]
    models = {name: load_model(name).eval() for name in names}
    tokenizers = {name: load_tokenizer(name) for name in names}
    rounds: dict[str, list[dict]] = {name: [] for name in names}
    load_before = os.getloadavg()[0]
    for r in range(args.repeats):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            rounds[name].append(measure_latency(models[name], tokenizers[name], sentences, beam=1, repeats=1))
    load_after = os.getloadavg()[0]

    results = []
    for name in names:
        enc = [x["encoder_s"] for x in rounds[name]]
        tra = [x["translate_s"] for x in rounds[name]]
        enc_ratio = [a["encoder_s"] / b["encoder_s"] for a, b in zip(rounds[name], rounds[args.full])]
        tra_ratio = [a["translate_s"] / b["translate_s"] for a, b in zip(rounds[name], rounds[args.full])]
        outputs = translate(models[name], tokenizers[name], sentences, beam=1)
        out_len = statistics.mean(len(tokenizers[name](o)["input_ids"]) for o in outputs)
        results.append({
            "model": name, "parameters": count_parameters(models[name]),
            "encoder_s": statistics.median(enc), "translate_s": statistics.median(tra),
            "encoder_ratio": statistics.median(enc_ratio), "translate_ratio": statistics.median(tra_ratio),
            "mean_output_tokens": out_len,
        })

    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} thread(s), "
          f"{len(sentences)} sentences, greedy, {args.repeats} rounds, load {load_before:.1f} -> {load_after:.1f}")
    print("| model | parameters | encoder s | ÷ full | translate s | ÷ full | output tokens |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for row in results:
        print(f"| {row['model']} | {row['parameters']:,} | {row['encoder_s']:.3f} | {row['encoder_ratio']:.2f} | "
              f"{row['translate_s']:.2f} | {row['translate_ratio']:.2f} | {row['mean_output_tokens']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
