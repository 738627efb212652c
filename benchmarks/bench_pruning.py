"""Pruning benchmark (issue 6): the step time of gated fine-tuning against plain fine-tuning,
and the latency of the pruned model against the full one.

A Marian model (d_model 128, FFN 512, 3+3 layers x 8 heads = 72 heads, BPE vocabulary of 2000
trained on the data) is fine-tuned for one epoch on Multi30k pairs, alternately

* plainly (``headlab.nmt.train.train``), and
* with Hard Concrete gates on all 72 heads and the L0 penalty (``headlab.pruning.train.prune_train``,
  diagnostics every 50 steps, as a user would run it),

``--repeats`` times each, interleaved. The trainer's own epoch timer (``history.json``; it
excludes checkpointing and evaluation) gives the time per step; the ratio of medians is
reported (and the ratio of minima, less sensitive to other jobs on a shared machine). Because
whole epochs on a shared machine are noisy, the same comparison is also made step by step:
two copies of the model, one gated, take alternating training steps (forward, loss, penalty,
backward, Adam) on the same batches, and the median of the per-pair ratios is reported. Then a
budget run (``keep=24`` of 72 heads, 60 steps) is exported and its pruned model timed against
the full one: encoder forward and greedy translation of ``--sentences`` sentences. (These
models are barely trained, so their translations differ in length; the encoder figure is the
like-for-like one, and the foundation benchmark times fixed-shape decoding.)

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_pruning.py [--pairs 1500] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
from pathlib import Path

import torch

from headlab import count_parameters, load_pruned
from headlab.data import read_parallel
from headlab.nmt.model import ModelConfig, build_marian_config, create_model
from headlab.nmt.tokenizer import train_tokenizer
from headlab.nmt.train import train
from headlab.pruning.train import PruneConfig, measure_latency, prune_train
from headlab.training.config import TrainConfig

DATA = Path(__file__).resolve().parents[1] / "data" / "multi30k"
SHAPE = ModelConfig(d_model=128, ffn_dim=512, encoder_layers=3, decoder_layers=3, n_heads=8, max_positions=128)


def interleaved_steps(config, tokenizer, corpus, max_tokens: int, n_pairs: int) -> list[float]:
    """Per-pair ratios gated/plain of one training step each, alternating which goes first."""
    import time

    from headlab import attach_gates
    from headlab.data.batching import token_budget_batches
    from headlab.pruning import HardConcreteGates
    from headlab.training.corpus import collate, encode_corpus
    from headlab.training.losses import label_smoothed_loss

    data = encode_corpus(tokenizer, corpus, 128)
    batches = token_budget_batches(data, max_tokens, seed=1, epoch=0)
    plain, gated = create_model(config, seed=0).train(), create_model(config, seed=0).train()
    gates = HardConcreteGates.for_model(gated)
    attach_gates(gated, gates)
    optimizers = {id(m): torch.optim.Adam(m.parameters(), lr=1e-4) for m in (plain, gated)}
    cfg = TrainConfig()

    def step(model, batch) -> float:
        start = time.perf_counter()
        loss_sum, n = label_smoothed_loss(model, batch, cfg)
        loss = loss_sum / n
        if model is gated:
            loss = loss + 0.1 * gates.l0_penalty()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizers[id(model)].step()
        optimizers[id(model)].zero_grad(set_to_none=True)
        return time.perf_counter() - start

    ratios = []
    for i in range(n_pairs + 2):
        batch = collate(data, batches[i % len(batches)], tokenizer.pad_token_id, tokenizer.pad_token_id)
        if i % 2:
            t_gated, t_plain = step(gated, batch), step(plain, batch)
        else:
            t_plain, t_gated = step(plain, batch), step(gated, batch)
        if i >= 2:  # warm-up pairs left out
            ratios.append(t_gated / t_plain)
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=3000)
    parser.add_argument("--max-tokens", type=int, default=1500)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sentences", type=int, default=200)
    parser.add_argument("--lam", type=float, default=0.5)
    parser.add_argument("--step-pairs", type=int, default=60)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    corpus = read_parallel(DATA / "train.en.gz", DATA / "train.de.gz", max_tokens=40).subset(args.pairs)
    tokenizer = train_tokenizer(corpus.sources + corpus.targets, vocab_size=2000)
    config = build_marian_config(SHAPE, tokenizer)

    def train_config(out: Path) -> TrainConfig:
        return TrainConfig(out_dir=str(out), max_tokens=args.max_tokens, lr=5e-4, warmup_steps=0, schedule="constant",
                           max_epochs=1, validate=False, keep_epoch_checkpoints=False, progress=False, seed=1)

    ratios = interleaved_steps(config, tokenizer, corpus, args.max_tokens, args.step_pairs)
    print(f"interleaved steps: median ratio {statistics.median(ratios):.3f} over {len(ratios)} pairs", flush=True)
    plain_s, gated_s, steps = [], [], None
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for r in range(args.repeats):
            out = tmp / f"plain-{r}"
            result = train(create_model(config, seed=0), tokenizer, corpus, None, train_config(out), log=lambda m: None)
            record = result.history[-1]
            plain_s.append(record["epoch_minutes"] * 60 / record["step"])
            steps = record["step"]

            out = tmp / f"gated-{r}"
            prune = PruneConfig(gates="all", lam=args.lam, gate_lr=0.05, log_every=50, eval_beam=1,
                                train=train_config(out))
            prune_train(create_model(config, seed=0), tokenizer, corpus, None, prune, log=lambda m: None)
            record = json.loads((out / "train" / "history.json").read_text())[-1]
            gated_s.append(record["epoch_minutes"] * 60 / record["step"])
            print(f"repeat {r + 1}: plain {plain_s[-1] * 1e3:.1f} ms/step, gated {gated_s[-1] * 1e3:.1f} ms/step",
                  flush=True)
        out = tmp / "budget"
        budget = PruneConfig(gates="all", keep=24, gate_lr=0.1, multiplier_lr=0.5, log_every=1000, eval_beam=1,
                             train=train_config(out))
        budget.train.max_epochs, budget.train.max_steps = 100, 60
        prune_train(create_model(config, seed=0), tokenizer, corpus, None, budget, log=lambda m: None)
        full = create_model(config, seed=0).eval()
        pruned = load_pruned(out / "pruned")
        kept = json.loads((out / "result.json").read_text())["heads_kept"]
        sentences = corpus.sources[: args.sentences]
        lat_full = measure_latency(full, tokenizer, sentences, beam=1)
        lat_pruned = measure_latency(pruned, tokenizer, sentences, beam=1)

    ratio = statistics.median(gated_s) / statistics.median(plain_s)
    print()
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{args.threads} thread(s); {args.pairs} pairs, {steps} steps/epoch, {args.repeats} repeats")
    print(f"step time, plain fine-tuning : {statistics.median(plain_s) * 1e3:.1f} ms (median)")
    print(f"step time, gated fine-tuning : {statistics.median(gated_s) * 1e3:.1f} ms (median)")
    print(f"ratio gated / plain          : {ratio:.3f} (medians), {min(gated_s) / min(plain_s):.3f} (minima)"
          "  (target <= 1.10)")
    quartiles = statistics.quantiles(ratios, n=4)
    print(f"interleaved single steps     : median ratio {statistics.median(ratios):.3f} "
          f"(quartiles {quartiles[0]:.3f}-{quartiles[2]:.3f}, {len(ratios)} pairs)")
    print(f"pruned export: heads kept {kept}; parameters {count_parameters(full):,} -> {count_parameters(pruned):,}")
    print(f"encoder latency ({len(sentences)} sentences): full {lat_full['encoder_s'] * 1e3:.0f} ms, "
          f"pruned {lat_pruned['encoder_s'] * 1e3:.0f} ms, ratio {lat_pruned['encoder_s'] / lat_full['encoder_s']:.2f}")
    print(f"greedy translation latency   : full {lat_full['translate_s']:.2f} s, pruned {lat_pruned['translate_s']:.2f} s, "
          f"ratio {lat_pruned['translate_s'] / lat_full['translate_s']:.2f}")


if __name__ == "__main__":
    main()
