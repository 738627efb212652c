"""Foundation benchmark (issue 2): what physical pruning buys, and what capture costs.

A Marian-shaped model (6+6 layers, 8 heads, d_model 512, FFN 2048, random weights) loses 36 of
its 48 encoder heads (2 kept in each layer). Pruned and unpruned copies
are timed side by side, interleaved, in one run:

* encoder forward latency, with the ideal ratio from counted FLOPs beside it;
* full greedy translation latency (encoder + decoder steps);
* capture_attention's overhead over a plain forward pass (eager with capture vs SDPA plain,
  and vs eager plain, since capture must run eager).

    .venv/bin/python benchmarks/bench_foundation.py [--repeats 20] [--batch 16] [--src-len 24]
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import time

import torch
import transformers as tf

from headlab import attention_blocks, capture_attention, count_parameters, prune_heads


def marian(d_model=512, ffn=2048, layers=6, heads=8, vocab=8000):
    config = tf.MarianConfig(
        vocab_size=vocab, d_model=d_model, encoder_layers=layers, decoder_layers=layers,
        encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=ffn,
        decoder_ffn_dim=ffn, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
        max_position_embeddings=256,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return tf.MarianMTModel(config).eval()


def encoder_flops(model, src_len: int) -> float:
    """Multiply-adds of one encoder pass per sequence, counted from the weight shapes."""
    total = 0
    for block in attention_blocks(model):
        if block.kind != "enc_self":
            continue
        d_model = block.o.out_features
        width = block.n_heads * block.d_head
        total += src_len * d_model * width * 3  # q, k, v projections
        total += 2 * src_len * src_len * width  # scores and weighted sum
        total += src_len * width * d_model  # output projection
    layer = model.model.encoder.layers[0]
    total += len(model.model.encoder.layers) * 2 * src_len * layer.fc1.in_features * layer.fc1.out_features
    return float(total)


def translation_flops(model, src_len: int, new_tokens: int) -> float:
    """Multiply-adds of a greedy translation per sequence: one encoder pass, then one decoder
    step per new token with cached keys and values (cross-attention keys/values once)."""
    total = encoder_flops(model, src_len)
    d_model = model.config.d_model
    ffn = model.config.decoder_ffn_dim
    vocab = model.config.vocab_size
    for block in attention_blocks(model):
        width = block.n_heads * block.d_head
        if block.kind == "dec_self":
            for t in range(1, new_tokens + 1):
                total += 4 * d_model * width + 2 * t * width
        elif block.kind == "dec_cross":
            total += 2 * src_len * d_model * width  # keys and values of the source, cached
            total += new_tokens * (2 * d_model * width + 2 * src_len * width)
    total += new_tokens * model.config.decoder_layers * 2 * d_model * ffn
    total += new_tokens * d_model * vocab  # output projection onto the vocabulary
    return float(total)


def timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def interleaved(fns: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each function, run in turn so that load affects all alike."""
    for fn in fns.values():
        fn()  # warm-up
    samples = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            samples[name] += timed(fn, 1)
    return {name: statistics.median(values) for name, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--src-len", type=int, default=24)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    full = marian()
    pruned = copy.deepcopy(full)
    # Keep heads 0 and 1 of every encoder layer: 36 of 48 encoder heads go.
    prune_heads(pruned, {("enc_self", layer): list(range(2, 8)) for layer in range(6)})
    kept = sum(b.n_heads for b in attention_blocks(pruned) if b.kind == "enc_self")
    assert kept == 12

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 8000, (args.batch, args.src_len), generator=g)
    mask = torch.ones_like(ids)

    with torch.inference_mode():
        enc = interleaved({
            "full": lambda: full.get_encoder()(input_ids=ids, attention_mask=mask),
            "pruned": lambda: pruned.get_encoder()(input_ids=ids, attention_mask=mask),
        }, args.repeats)
        gen_kwargs = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, num_beams=1, do_sample=False)
        gen = interleaved({
            "full": lambda: full.generate(input_ids=ids, attention_mask=mask, **gen_kwargs),
            "pruned": lambda: pruned.generate(input_ids=ids, attention_mask=mask, **gen_kwargs),
        }, max(3, args.repeats // 4))

        decoder_ids = torch.randint(2, 8000, (args.batch, args.src_len), generator=g)
        batch = dict(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids)
        eager = copy.deepcopy(full)
        eager.config._attn_implementation = "eager"

        def with_capture():
            with capture_attention(full):
                full(**batch)

        cap = interleaved({"sdpa": lambda: full(**batch), "eager": lambda: eager(**batch), "capture": with_capture},
                          args.repeats)

    flops_ratio = encoder_flops(pruned, args.src_len) / encoder_flops(full, args.src_len)
    gen_flops_ratio = (translation_flops(pruned, args.src_len, args.new_tokens)
                       / translation_flops(full, args.src_len, args.new_tokens))
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"threads {args.threads}, batch {args.batch}, source length {args.src_len}")
    print(f"parameters: full {count_parameters(full):,}, pruned {count_parameters(pruned):,}")
    print("| measure | full (ms) | pruned (ms) | pruned / full | ideal (FLOPs) |")
    print("|---|---|---|---|---|")
    print(f"| encoder forward | {enc['full'] * 1e3:.1f} | {enc['pruned'] * 1e3:.1f} | "
          f"{enc['pruned'] / enc['full']:.2f} | {flops_ratio:.2f} |")
    print(f"| greedy translation ({args.new_tokens} tokens) | {gen['full'] * 1e3:.0f} | {gen['pruned'] * 1e3:.0f} | "
          f"{gen['pruned'] / gen['full']:.2f} | {gen_flops_ratio:.2f} |")
    print()
    print("| forward pass (enc+dec) | ms | / plain SDPA |")
    print("|---|---|---|")
    for name in ("sdpa", "eager", "capture"):
        print(f"| {name} | {cap[name] * 1e3:.1f} | {cap[name] / cap['sdpa']:.2f} |")
    print(f"capture over plain eager: {cap['capture'] / cap['eager']:.2f}x")


if __name__ == "__main__":
    main()
