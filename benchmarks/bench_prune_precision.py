"""Gated fine-tuning in bf16 autocast against fp32 (issue 17's sweeps): the step time of the
bundled EN-DE model with Hard Concrete gates on every head and the L0 penalty, as
``headlab prune sweep --mixed-precision bf16`` trains it.

Two copies of ``models/multi30k-en-de`` take alternating training steps (forward and
label-smoothed loss under ``torch.autocast(bfloat16)`` or not, penalty, backward, clipping,
Adam) on the same Multi30k batches of ``--max-tokens`` target tokens, which one goes first
alternating; the median of the per-pair ratios is reported, so that other jobs on a shared
machine slow both sides alike. The losses of the first steps are printed too: the copies start
from the same weights and draw the same gate samples and dropout, so the first step's
difference is bf16's alone.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_prune_precision.py [--pairs 30] [--threads 1]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from headlab import attach_gates
from headlab.data import read_parallel
from headlab.data.batching import token_budget_batches
from headlab.loading import load_model, load_tokenizer
from headlab.pruning import HardConcreteGates
from headlab.training.config import TrainConfig
from headlab.training.corpus import collate, encode_corpus
from headlab.training.losses import label_smoothed_loss

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "multi30k-en-de"))
    parser.add_argument("--pairs", type=int, default=30, help="step pairs timed (after 2 warm-up pairs)")
    parser.add_argument("--max-tokens", type=int, default=2048, help="target tokens per batch (the sweeps')")
    parser.add_argument("--lam", type=float, default=0.01)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    tokenizer = load_tokenizer(args.model)
    corpus = read_parallel(ROOT / "data/multi30k/train.en.gz", ROOT / "data/multi30k/train.de.gz").subset(3000)
    data = encode_corpus(tokenizer, corpus, 128)
    batches = token_budget_batches(data, args.max_tokens, seed=1, epoch=0)
    copies = {}
    for precision in ("fp32", "bf16"):
        model = load_model(args.model).float().train()
        gates = HardConcreteGates.for_model(model)
        attach_gates(model, gates)
        copies[precision] = (model, gates, torch.optim.Adam(model.parameters(), lr=1e-4))
    cfg = TrainConfig()

    def step(precision: str, batch, seed: int) -> tuple[float, float]:
        model, gates, optimizer = copies[precision]
        torch.manual_seed(seed)  # the same gate samples (and dropout) for both copies
        start = time.perf_counter()
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else nullcontext()
        with autocast:
            loss_sum, n = label_smoothed_loss(model, batch, cfg)
            loss = loss_sum / n
        loss_value = loss.detach()
        (loss + args.lam * gates.l0_penalty()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start, loss_value.item()

    times: dict[str, list[float]] = {"fp32": [], "bf16": []}
    ratios, tokens = [], []
    for i in range(args.pairs + 2):
        batch = collate(data, batches[i % len(batches)], tokenizer.pad_token_id, tokenizer.pad_token_id)
        order = ("fp32", "bf16") if i % 2 == 0 else ("bf16", "fp32")
        result = {p: step(p, batch, seed=i) for p in order}
        if i < 3:
            print(f"step {i}: loss fp32 {result['fp32'][1]:.4f}, bf16 {result['bf16'][1]:.4f}")
        if i >= 2:
            for p in order:
                times[p].append(result[p][0])
            ratios.append(result["fp32"][0] / result["bf16"][0])
            tokens.append(int((batch["labels"] != -100).sum()))
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} thread(s), "
          f"{args.pairs} step pairs of about {statistics.median(tokens)} target tokens")
    for p in ("fp32", "bf16"):
        median = statistics.median(times[p])
        print(f"{p}: median {median:.2f} s/step, {statistics.median(tokens) / median:,.0f} target tokens/s")
    print(f"fp32 / bf16 step time, median of per-pair ratios: {statistics.median(ratios):.2f}x "
          f"(quartiles {statistics.quantiles(ratios, n=4)[0]:.2f}-{statistics.quantiles(ratios, n=4)[2]:.2f})")


if __name__ == "__main__":
    main()
