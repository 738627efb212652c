"""Statistics inside attention: peak memory and time per sentence of ``functions`` + ``aggregate``.

Three ways to run one long sentence through a randomly initialised Llama-like model (default
4 layers x 16 heads, 4 key/value heads (grouped-query), d_model 1024), each in a fresh
subprocess so that peak memory is its own:

* ``sdpa``: a plain forward pass with PyTorch's SDPA attention (what the model does anyway);
* ``eager``: ``analyze_heads`` with positional, syntactic, rare-token and aggregate statistics
  over today's eager capture (each block's whole ``[1, heads, n, n]`` map);
* ``chunked``: the same analysis with ``query_chunk`` (headlab's registered attention function,
  ``--query-chunk`` rows at a time).

The sentence is synthetic (random words of a word-level vocabulary, one token per word, a
random projective-ish tree: each word's governor is one of the five words before it), so the
statistics do their full work at any length. Memory: peak RSS growth over the loaded model and
data (VmHWM after resetting it, Linux; after a short warm-up run of the same mode, so that imports
and first allocations are not counted), and the total peak. Time: wall time per sentence, and the
process's CPU time (with one thread, the work done, which other jobs on a shared machine disturb
far less than the wall time).

    python benchmarks/bench_chunked_attention.py --lengths 512 2048 --threads 1
    python benchmarks/bench_chunked_attention.py --lengths 8192 --modes sdpa chunked   # eager: ~4 GB per map
    python benchmarks/bench_chunked_attention.py --lengths 2048 --modes chunked --profile 15   # where the time goes
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
UPOS = ("NOUN", "VERB", "ADJ", "ADV", "DET", "ADP", "PRON", "PUNCT")
DEPRELS = ("nsubj", "obj", "amod", "advmod", "det", "case")


def _status(field: str) -> int:
    """A ``VmRSS``/``VmHWM`` line of /proc/self/status, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


def model_and_tokenizer(args, length: int):
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {token: i for i, token in enumerate(specials)}
    for i in range(args.vocab - len(specials)):
        vocab[f"w{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.d_model, intermediate_size=args.ffn, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, max_position_embeddings=length + 8,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval(), tokenizer


def write_conllu(path: Path, length: int, sentences: int, vocab: int, seed: int = 0) -> None:
    import random

    rng = random.Random(seed)
    lines = []
    for s in range(sentences):
        lines.append(f"# sent_id = s{s}")
        for i in range(1, length + 1):
            head = 0 if i == 1 else rng.randint(max(1, i - 5), i - 1)
            lines.append(f"{i}\tw{rng.randrange(vocab - 4)}\t_\t{rng.choice(UPOS)}\t_\t_\t{head}\t"
                         f"{'root' if head == 0 else rng.choice(DEPRELS)}\t_\t_")
        lines.append("")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def child(args) -> dict:
    """One mode at one length, in this process: time per sentence and peak memory."""
    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    length = args.child_length
    model, tokenizer = model_and_tokenizer(args, length)
    with tempfile.TemporaryDirectory() as tmp:
        conllu, warm = Path(tmp) / "long.conllu", Path(tmp) / "warm.conllu"
        write_conllu(conllu, length, args.sentences, args.vocab)
        write_conllu(warm, 32, 1, args.vocab, seed=1)  # a short warm-up run: imports, first allocations
        if args.child_mode == "sdpa":
            from headlab.data.treebank import read_conllu

            inputs = [tokenizer(" ".join(s.words), return_tensors="pt") for s in read_conllu(conllu)]
            with torch.inference_mode():
                model(**tokenizer(" ".join(next(iter(read_conllu(warm))).words), return_tensors="pt"))
            base = _status("VmRSS")
            _reset_peak()
            started, cpu_started = time.perf_counter(), time.process_time()
            with torch.inference_mode():
                for batch in inputs:
                    model(**batch)
            seconds, cpu = time.perf_counter() - started, time.process_time() - cpu_started
        else:
            from headlab.data.frequencies import TokenFrequencies
            from headlab.functions import AnalysisConfig, analyze_heads

            counts = np.random.default_rng(0).integers(1, 1000, args.vocab)
            frequencies = TokenFrequencies(counts, "random")
            config = AnalysisConfig(functions=True, aggregate=True, batch_size=1, top_frequent=50,
                                    query_chunk=args.query_chunk if args.child_mode == "chunked" else None)
            analyze_heads(model, tokenizer, warm, frequencies=frequencies, config=config)
            base = _status("VmRSS")
            _reset_peak()
            started, cpu_started = time.perf_counter(), time.process_time()
            if args.profile:  # where the CPU time goes (the time above then includes cProfile's overhead)
                import cProfile
                import pstats

                profile = cProfile.Profile(time.process_time)
                analysis = profile.runcall(analyze_heads, model, tokenizer, conllu, frequencies=frequencies,
                                           config=config)
                pstats.Stats(profile, stream=sys.stderr).sort_stats("tottime").print_stats(args.profile)
            else:
                analysis = analyze_heads(model, tokenizer, conllu, frequencies=frequencies, config=config)
            seconds, cpu = time.perf_counter() - started, time.process_time() - cpu_started
            assert analysis.report.n_sentences == args.sentences and analysis.report.n_truncated == 0
        peak = _status("VmHWM")
    return {"mode": args.child_mode, "length": length, "seconds_per_sentence": seconds / args.sentences,
            "cpu_seconds_per_sentence": cpu / args.sentences,
            "peak_growth_mb": (peak - base) / 2**20, "peak_total_mb": peak / 2**20, "base_mb": base / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--modes", nargs="+", default=["sdpa", "chunked", "eager"],
                        choices=["sdpa", "chunked", "eager"])
    parser.add_argument("--query-chunk", type=int, default=128)
    parser.add_argument("--sentences", type=int, default=1, help="sentences per run (time is per sentence)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--malloc-threshold", type=int, default=131072,
                        help="MALLOC_MMAP_THRESHOLD_ for glibc in the runs, so that RSS follows live memory "
                             "(0: leave malloc's dynamic threshold, under which RSS drifts)")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="print the N functions with the most CPU time of each analysis run (cProfile)")
    parser.add_argument("--child-mode", help=argparse.SUPPRESS)
    parser.add_argument("--child-length", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_mode:
        print(json.dumps(child(args)))
        return
    rows = []
    passed = [a for a in sys.argv[1:]]
    for length in args.lengths:
        for mode in args.modes:
            command = [sys.executable, __file__, *passed, "--child-mode", mode, "--child-length", str(length)]
            env = {**os.environ, "PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   "OMP_NUM_THREADS": str(args.threads)}
            if args.malloc_threshold:
                env["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_threshold)
            done = subprocess.run(command, capture_output=True, text=True, env=env)
            if args.profile and not done.returncode:
                print(f"{mode} at {length}:\n{done.stderr}", flush=True)
            if done.returncode:
                print(f"{mode} at {length}: failed\n{done.stderr[-2000:]}", file=sys.stderr)
                continue
            row = json.loads(done.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(f"{length:>6} {mode:>8}: {row['seconds_per_sentence']:8.2f} s/sentence "
                  f"({row['cpu_seconds_per_sentence']:.2f} s CPU), "
                  f"peak growth {row['peak_growth_mb']:8.0f} MB, peak {row['peak_total_mb']:8.0f} MB", flush=True)
    print()
    print(f"model: Llama {args.layers} layers x {args.heads} heads ({args.kv_heads} key/value heads), "
          f"d_model {args.d_model}, FFN {args.ffn}, vocabulary {args.vocab}; query chunk {args.query_chunk}; "
          f"{args.threads} thread(s); mmap threshold {args.malloc_threshold}; {platform.machine()}, {platform.python_version()}")
    print("| length | mode | s / sentence | x SDPA | CPU s / sentence | x SDPA | peak growth (MB) | x SDPA "
          "| peak total (MB) | x SDPA |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        ref = next((r for r in rows if r["length"] == row["length"] and r["mode"] == "sdpa"), None)

        def ratio(key):
            return f"{row[key] / ref[key]:.2f}" if ref and ref[key] > 0 else "-"

        print(f"| {row['length']} | {row['mode']} | {row['seconds_per_sentence']:.2f} | {ratio('seconds_per_sentence')} "
              f"| {row['cpu_seconds_per_sentence']:.2f} | {ratio('cpu_seconds_per_sentence')} "
              f"| {row['peak_growth_mb']:.0f} | {ratio('peak_growth_mb')} | {row['peak_total_mb']:.0f} "
              f"| {ratio('peak_total_mb')} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
