"""Head importance throughput, measured side by side in one run (issue 4).

LRP head relevance, three ways that compute the same numbers (equality asserted):

* ``vmap``     - headlab's path: batched backward passes over the generation steps of a batch
                 (steps per call chosen by headlab: a few on one CPU thread, else usually all;
                 ``vmap-all``: all steps of the batch in one call);
* ``loop``     - a Python loop of one backward per generation step (each covering the step in
                 all sentences of the batch);
* ``jacobian`` - the full Jacobian of every target, one backward per output element, as the
                 original TF code builds its Jacobians (timed on the first sentences' targets
                 of the same batch, since it costs one backward of the whole batch per target).

Confidence, gradient importance and ablation against a plain forward pass, and batched
ablation against one masked pass per head.

Model: the bundled Multi30k model when it exists (models/multi30k-en-de), else a random
MarianMT of the same shape (6+6 layers, 8 heads, d_model 256, FFN 1024, vocabulary 8000).
Data: random token ids, ``--length`` tokens per sentence on both sides (the decoder is
teacher-forced on them; LRP's targets are the top-1 logits at each step).

    python benchmarks/bench_importance.py                  # batch 32, 20 tokens
    python benchmarks/bench_importance.py --threads 1 --repeats 5

Every LRP way prints wall-clock seconds and this process's CPU seconds: on a shared machine the
wall clock includes waiting for the cores, so the CPU-time ratio is the steadier comparison.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from headlab import attention_blocks, mask_heads  # noqa: E402
from headlab.importance import (  # noqa: E402
    ImportanceData,
    compute_ablation,
    compute_confidence,
    compute_gradient,
    describe_model,
    head_relevance,
    make_batches,
)

BUNDLED = ROOT / "models" / "multi30k-en-de"


def build_model(use_bundled: bool):
    if use_bundled and (BUNDLED / "config.json").is_file():
        from headlab.loading import load_model

        return load_model(str(BUNDLED)), f"bundled {BUNDLED.relative_to(ROOT)}"
    import transformers as tf

    config = tf.MarianConfig(
        vocab_size=8000, d_model=256, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
        decoder_attention_heads=8, encoder_ffn_dim=1024, decoder_ffn_dim=1024, pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0, max_position_embeddings=256,
    )
    torch.manual_seed(0)
    return tf.MarianMTModel(config).eval(), "random MarianMT 6+6 x 8 heads, d_model 256, FFN 1024, vocab 8000"


def make_data(info, vocab: int, n: int, length: int, seed: int = 0) -> ImportanceData:
    g = torch.Generator().manual_seed(seed)
    eos = min(info.eos_ids)
    low = max(info.special_ids) + 1 if max(info.special_ids) < vocab // 2 else 3
    rows = lambda: [torch.randint(low, vocab, (length - 1,), generator=g).tolist() + [eos] for _ in range(n)]  # noqa: E731
    data = ImportanceData.from_ids(rows())
    data.translations = rows() if info.is_seq2seq else None
    return data


def timed(fn, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def interleaved(fns: dict, repeats: int, cpu: dict | None = None) -> dict[str, tuple[float, object]]:
    """Run each function ``repeats`` times, alternating, so that load changes hit all alike.

    Returns the median wall-clock seconds and the last result of each; ``cpu``, when given,
    receives the median CPU seconds of this process (all its threads) for each.
    """
    times = {name: [] for name in fns}
    cpu_times = {name: [] for name in fns}
    results = {}
    for _ in range(repeats):
        for name, fn in fns.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            results[name] = fn()
            times[name].append(time.perf_counter() - start)
            cpu_times[name].append(time.process_time() - start_cpu)
    if cpu is not None:
        cpu.update({name: statistics.median(cpu_times[name]) for name in fns})
    return {name: (statistics.median(times[name]), results[name]) for name in fns}


def load() -> str:
    """The machine's 1-minute load average (other jobs compete for the cores)."""
    return f"{os.getloadavg()[0]:.1f}"


def assert_equal(a, b, what: str) -> None:
    assert torch.equal(a.steps, b.steps), f"{what}: different targets"
    for key in a.relevance:
        torch.testing.assert_close(a.relevance[key], b.relevance[key], rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{what}, {key}: {m}")  # noqa: B023 (called in this iteration)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=20, help="tokens per sentence, source and target")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--chunk-size", type=int, default=None,
                        help="steps per batched backward of the vmap way (default: headlab's automatic choice)")
    parser.add_argument("--jacobian-sentences", type=int, default=2,
                        help="sentences whose targets the full-Jacobian way is timed on (its cost is per target)")
    parser.add_argument("--ablation-heads", type=int, default=16,
                        help="heads (spread over all kinds) timed for one-pass-per-head ablation")
    parser.add_argument("--skip-lrp", action="store_true", help="only the other measures")
    parser.add_argument("--skip-others", action="store_true", help="only LRP")
    parser.add_argument("--random-model", action="store_true", help="ignore the bundled model")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    model, description = build_model(not args.random_model)
    info = describe_model(model)
    vocab = model.config.vocab_size
    data = make_data(info, vocab, args.batch, args.length)
    batch = next(make_batches(data, info, batch_size=args.batch))
    n_targets = int(batch.steps.sum())
    n_heads = sum(b.n_heads for b in attention_blocks(model))
    print(f"model: {description} ({n_heads} heads)")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{args.threads} threads; batch {args.batch} x {args.length} tokens, {n_targets} targets; "
          f"median of {args.repeats}")

    # -- LRP: vmap vs loop (whole batch), vmap vs jacobian (the first sentences' targets) -------
    if not args.skip_lrp:
        bench_lrp(model, info, data, batch, n_targets, args)
    if not args.skip_others:
        bench_others(model, info, data, batch, n_heads, args)


def bench_lrp(model, info, data, batch, n_targets, args) -> None:
    steps = int(batch.steps.any(0).sum())
    cpu: dict[str, float] = {}
    load_before = load()
    runs = interleaved({
        "vmap": lambda: head_relevance(model, batch, strategy="vmap", chunk_size=args.chunk_size),
        "loop": lambda: head_relevance(model, batch, strategy="loop"),
        "vmap-all": lambda: head_relevance(model, batch, strategy="vmap", chunk_size=steps),
    }, args.repeats, cpu)
    assert_equal(runs["vmap"][1], runs["loop"][1], "vmap vs loop")
    assert_equal(runs["vmap-all"][1], runs["loop"][1], "vmap (all steps at once) vs loop")
    subset = make_batches(data, info, batch_size=args.batch).__next__()
    subset.steps[args.jacobian_sentences:] = False
    n_subset = int(subset.steps.sum())
    jac_time, jac = timed(lambda: head_relevance(model, subset, strategy="jacobian"), 1)
    full = runs["vmap"][1]
    picked = full.steps[:, 0] < args.jacobian_sentences
    for key in full.relevance:
        torch.testing.assert_close(jac.relevance[key], full.relevance[key][picked], rtol=1e-4, atol=1e-5)
    rate = {name: n_targets / runs[name][0] for name in runs}
    rate["jacobian"] = n_subset / jac_time
    print(f"\nLRP head relevance (equal results asserted); load average {load_before} -> {load()}")
    print("vmap: automatic steps per batched backward; vmap-all: all steps of the batch in one")
    print(f"{'way':<10}{'seconds':>10}{'CPU s':>8}{'targets':>9}{'targets/s':>12}{'vmap is':>10}{'(CPU)':>8}")
    for name, seconds, count in (("vmap", runs["vmap"][0], n_targets), ("loop", runs["loop"][0], n_targets),
                                 ("vmap-all", runs["vmap-all"][0], n_targets), ("jacobian", jac_time, n_subset)):
        cpu_ratio = f"{cpu[name] / cpu['vmap']:>7.2f}x" if name in cpu else f"{'':>8}"
        cpu_s = f"{cpu[name]:>8.2f}" if name in cpu else f"{'':>8}"
        print(f"{name:<10}{seconds:>10.2f}{cpu_s}{count:>9}{rate[name]:>12.1f}{rate['vmap'] / rate[name]:>9.2f}x"
              f"{cpu_ratio}")

    print(f"LRP summary: vmap {rate['vmap']:.0f} targets/s = {rate['vmap'] / rate['loop']:.2f}x the per-step "
          f"loop (CPU time: {cpu['loop'] / cpu['vmap']:.2f}x), {rate['vmap'] / rate['jacobian']:.0f}x full-Jacobian")


def bench_others(model, info, data, batch, n_heads, args) -> None:
    """Confidence, gradient importance and ablation against a plain forward pass."""

    def forward():
        with torch.no_grad():
            model(**batch.inputs, use_cache=False) if info.is_seq2seq else model(**batch.inputs)

    one = ImportanceData.from_ids(data.sources, data.translations if info.is_seq2seq else None)
    one.translations = data.translations
    all_heads = [(b, h) for b in attention_blocks(model) for h in range(b.n_heads)]
    heads_subset = all_heads[:: max(1, len(all_heads) // args.ablation_heads)][: args.ablation_heads]  # all kinds

    def naive_ablation():
        out = []
        for block, head in heads_subset:
            with mask_heads(model, {block.key: [head]}), torch.no_grad():
                out.append(model(**batch.inputs, use_cache=False).logits.sum() if info.is_seq2seq else
                           model(**batch.inputs).logits.sum())
        return out

    runs = interleaved({
        "forward": forward,
        "confidence": lambda: compute_confidence(model, one, info, batch_size=args.batch),
        "gradient": lambda: compute_gradient(model, one, info, batch_size=args.batch),
    }, args.repeats)
    abl_time, ablation = timed(lambda: compute_ablation(model, one, info, batch_size=args.batch, max_rows=8 * args.batch), 1)
    naive_time, _ = timed(naive_ablation, 1)
    tokens = args.batch * args.length * (2 if info.is_seq2seq else 1)
    print("\nOther measures, per batch (tokens = source + target)")
    print(f"{'measure':<34}{'seconds':>10}{'tokens/s':>11}{'x forward':>11}")
    base = runs["forward"][0]
    for name in ("forward", "confidence", "gradient"):
        seconds = runs[name][0]
        print(f"{name:<34}{seconds:>10.3f}{tokens / seconds:>11.0f}{seconds / base:>11.2f}")
    per_head = abl_time / n_heads
    print(f"{'ablation, batched (per head)':<34}{per_head:>10.3f}{tokens / per_head:>11.0f}{per_head / base:>11.2f}")
    naive_per_head = naive_time / len(heads_subset)
    print(f"{'ablation, one pass per head':<34}{naive_per_head:>10.3f}{tokens / naive_per_head:>11.0f}"
          f"{naive_per_head / base:>11.2f}")
    print(f"batched ablation: {naive_per_head / per_head:.2f}x faster per head than one masked pass per head "
          f"({n_heads} heads in {abl_time:.1f}s incl. the unmasked pass)")
    del ablation


if __name__ == "__main__":
    main()
