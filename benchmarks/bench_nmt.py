"""Translation benchmark (issue 3): training and translation throughput on this machine.

Measured side by side in one run, interleaved round by round so that a change in machine load
hits every variant alike:

* training: target tokens per second of the training step of ``headlab nmt train`` (forward,
  label-smoothed loss, backward, Adam) on real Multi30k batches of ``--max-tokens`` target tokens,
  fp32 and bf16 autocast, for each thread count;
* translation: sentences per second of :func:`headlab.nmt.translate.translate`, greedy and
  beam 4, on the first ``--sentences`` of Multi30k val (bundled model if present).

    .venv/bin/python benchmarks/bench_nmt.py [--rounds 3] [--steps 3] [--sentences 200]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch

from headlab.data import read_parallel
from headlab.data.batching import token_budget_batches
from headlab.nmt.model import ModelConfig, build_marian_config, create_model, load_translation_model
from headlab.nmt.tokenizer import load_tokenizer, train_tokenizer
from headlab.nmt.translate import translate
from headlab.training.config import TrainConfig
from headlab.training.corpus import collate, encode_corpus
from headlab.training.loop import inverse_sqrt_lr
from headlab.training.losses import label_smoothed_loss

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "multi30k"
BUNDLED = ROOT / "models" / "multi30k-en-de"


def training_rate(model, optimizer, corpus, batches, precision: str, threads: int, pad_id: int) -> float:
    """Target tokens per second over ``batches`` (one optimizer step each)."""
    torch.set_num_threads(threads)
    config = TrainConfig()
    model.train()
    tokens, seconds = 0, 0.0
    for step, indices in enumerate(batches, start=1):
        batch = collate(corpus, indices, pad_id, pad_id)
        start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = inverse_sqrt_lr(step, 1e-4, 400)  # small: the weights barely move between variants
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss_sum, n = label_smoothed_loss(model, batch, config)
        (loss_sum.float() / n).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds += time.perf_counter() - start
        tokens += n
    return tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="training steps per variant and round")
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--sentences", type=int, default=200, help="val sentences to translate per variant and round")
    parser.add_argument("--threads", default="1,2", help="thread counts to compare")
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--skip-translation", action="store_true")
    args = parser.parse_args()
    thread_counts = [int(t) for t in args.threads.split(",")]

    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads available, "
          f"torch {torch.__version__}")
    corpus = read_parallel(DATA / "train.en.gz", DATA / "train.de.gz")
    if BUNDLED.is_dir():
        tokenizer = load_tokenizer(BUNDLED)
    else:
        tokenizer = train_tokenizer(corpus.sources + corpus.targets, 8000)

    if not args.skip_training:
        encoded = encode_corpus(tokenizer, corpus)
        all_batches = token_budget_batches(encoded, args.max_tokens, seed=1, epoch=0)
        model = create_model(build_marian_config(ModelConfig(), tokenizer), seed=1)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
        variants = [(p, t) for p in ("fp32", "bf16") for t in thread_counts]
        rates: dict[tuple[str, int], list[float]] = {v: [] for v in variants}
        cursor = 0
        training_rate(model, optimizer, encoded, all_batches[:1], "fp32", thread_counts[-1], tokenizer.pad_token_id)
        for _ in range(args.rounds):
            for variant in variants:
                batches = all_batches[cursor : cursor + args.steps]
                cursor += args.steps
                rates[variant].append(training_rate(model, optimizer, encoded, batches, *variant, tokenizer.pad_token_id))
        n_params = sum(p.numel() for p in model.parameters())
        print(f"\ntraining step, MarianMTModel d_model 256 / FFN 1024 / 6+6 layers x 8 heads ({n_params / 1e6:.1f}M), "
              f"batches of {args.max_tokens} target tokens, median of {args.rounds} rounds x {args.steps} steps:")
        base = statistics.median(rates[("fp32", thread_counts[-1])])
        for variant in variants:
            rate = statistics.median(rates[variant])
            print(f"  {variant[0]:5s} {variant[1]} thread(s): {rate:7.0f} target tok/s  ({rate / base:.2f}x)")

    if not args.skip_translation:
        if BUNDLED.is_dir():
            model = load_translation_model(BUNDLED)
            source = "bundled models/multi30k-en-de"
        else:
            model = create_model(build_marian_config(ModelConfig(), tokenizer), seed=1)
            source = "untrained model (outputs run to the length limit: not representative)"
        valid = read_parallel(DATA / "val.en.gz", DATA / "val.de.gz").subset(args.sentences)
        threads = thread_counts[-1]
        torch.set_num_threads(threads)
        variants = [1, 4]
        seconds: dict[int, list[float]] = {b: [] for b in variants}
        translate(model, tokenizer, valid.sources[:8], beam=1)  # warm-up
        for _ in range(args.rounds):
            for beam in variants:
                start = time.perf_counter()
                translate(model, tokenizer, valid.sources, beam=beam, batch_size=64)
                seconds[beam].append(time.perf_counter() - start)
        print(f"\ntranslation of {len(valid)} val sentences ({source}), {threads} thread(s), batches of 64, "
              f"median of {args.rounds} rounds:")
        greedy = len(valid) / statistics.median(seconds[1])
        for beam in variants:
            rate = len(valid) / statistics.median(seconds[beam])
            name = "greedy" if beam == 1 else f"beam {beam}"
            print(f"  {name:7s}: {rate:6.1f} sentences/s  ({rate / greedy:.2f}x greedy)")


if __name__ == "__main__":
    main()
