"""Head functions + aggregate statistics: throughput against a plain forward pass, and memory.

1. Throughput. Over a treebank (default: UD English EWT dev), the full analysis of
   ``headlab functions --aggregate`` (reading, alignment, forward, every statistic) against a
   plain batched forward pass with ``output_attentions=True`` (eager attention) on the same
   batches, built beforehand. Both run in this process, alternately; the ratio of the best of
   ``--repeats`` runs of each is printed. Target: at most 2x.
2. Memory. The analysis over 200 and over 2,000 sentences, each in a fresh subprocess: peak
   RSS growth during the analysis (VmHWM after resetting it) and the peak of Python
   allocations (tracemalloc), plus the RSS after 200 and after 2,000 sentences of the larger
   run. Streaming means they are about equal. Attention is quadratic in sentence length, so
   the longest batch sets the working memory: by default the 2,000 are the first 200
   sentences repeated ten times, in batches of 40, so that the larger run is the smaller one's
   five batches ten times over and only the number of sentences differs
   (``--memory-source prefix`` takes the first 2,000 instead; ``--memory-max-length`` cuts
   every sentence to a fixed budget). The subprocesses run with a fixed glibc mmap threshold
   (``--malloc-threshold``; 0 keeps glibc's dynamic one, under which RSS drifts with heap
   fragmentation, for a plain forward loop as much as for the analysis).

    python benchmarks/bench_functions.py                         # the bundled model
    python benchmarks/bench_functions.py --engine eager          # the eager reference (the default before issue 34)
    python benchmarks/bench_functions.py --model DIR --train-text data/multi30k/train.en.gz

Without a trained model (``--random``) a randomly initialised Marian of the bundled model's
size (6+6 layers, 8 heads, d_model 256) and the tokenizer given by ``--tokenizer`` are used:
the work per sentence is the same.
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

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO / "models" / "multi30k-en-de"
DEFAULT_CONLLU = REPO / "data" / "ud-english-ewt" / "en_ewt-ud-dev.conllu"
DEFAULT_TRAIN = REPO / "data" / "multi30k" / "train.en.gz"


def load(args):
    from headlab.loading import load_model, load_tokenizer

    if args.random:
        from transformers import MarianConfig, MarianMTModel

        tokenizer = load_tokenizer(args.tokenizer)
        config = MarianConfig(
            vocab_size=len(tokenizer), decoder_vocab_size=len(tokenizer), d_model=256, encoder_layers=6,
            decoder_layers=6, encoder_attention_heads=8, decoder_attention_heads=8, encoder_ffn_dim=1024,
            decoder_ffn_dim=1024, max_position_embeddings=256, pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id,
            share_encoder_decoder_embeddings=True, scale_embedding=True,
        )
        torch.manual_seed(0)
        return MarianMTModel(config).eval(), tokenizer, "random Marian 6+6x8, d_model 256"
    model = load_model(str(args.model))
    return model, load_tokenizer(args.tokenizer or str(args.model)), Path(args.model).name


def frequencies_for(args, tokenizer):
    from headlab.data.frequencies import TokenFrequencies

    if args.train_text and Path(args.train_text).is_file():
        return TokenFrequencies.from_corpus(tokenizer, args.train_text)
    return None


def plain_batches(args, model, tokenizer):
    """The batches the analysis feeds the model, as plain model inputs."""
    from headlab.data.alignment import AlignmentError, align_sentences
    from headlab.data.treebank import read_conllu
    from headlab.functions.analysis import model_max_length

    max_length = model_max_length(model, tokenizer)
    sentences = list(read_conllu(args.conllu, limit=args.sentences))
    batches = []
    start_id = model.config.decoder_start_token_id
    for i in range(0, len(sentences), args.batch_size):
        chunk = sentences[i:i + args.batch_size]
        aligned = [a for a in align_sentences(tokenizer, [s.words for s in chunk], max_length=max_length)
                   if not isinstance(a, AlignmentError)]
        T = max(len(a) for a in aligned)
        ids = torch.full((len(aligned), T), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(aligned), T, dtype=torch.long)
        for b, a in enumerate(aligned):
            ids[b, :len(a)] = torch.tensor(a.input_ids)
            mask[b, :len(a)] = 1
        batches.append({"input_ids": ids, "attention_mask": mask,
                        "decoder_input_ids": torch.full((len(aligned), 1), start_id, dtype=torch.long)})
    return batches, len(sentences)


def time_forward(model, batches) -> float:
    from headlab.capture import eager_attention

    started = time.perf_counter()
    with eager_attention(model), torch.inference_mode():
        for inputs in batches:
            model(**inputs, output_attentions=True)
    return time.perf_counter() - started


def time_analysis(args, model, tokenizer, frequencies, on_batch=None):
    from headlab.functions.analysis import AnalysisConfig, analyze_heads

    config = AnalysisConfig(batch_size=args.batch_size, max_sentences=args.sentences,
                            max_length=getattr(args, "max_length", None), engine=args.engine)
    started = time.perf_counter()
    analysis = analyze_heads(model, tokenizer, args.conllu, frequencies=frequencies, config=config,
                             on_batch=on_batch)
    return time.perf_counter() - started, analysis


def throughput(args) -> dict:
    model, tokenizer, name = load(args)
    frequencies = frequencies_for(args, tokenizer)
    batches, n = plain_batches(args, model, tokenizer)
    time_forward(model, batches[:2])  # warm-up
    forward, analysis_times = [], []
    analysis = None
    for _ in range(args.repeats):
        forward.append(time_forward(model, batches))
        seconds, analysis = time_analysis(args, model, tokenizer, frequencies)
        analysis_times.append(seconds)
    best_forward, best_analysis = min(forward), min(analysis_times)
    return {
        "model": name,
        "sentences": n,
        "analysed": analysis.report.n_sentences,
        "batch_size": args.batch_size,
        "threads": torch.get_num_threads(),
        "rare_tokens": frequencies is not None,
        "forward_s": forward,
        "analysis_s": analysis_times,
        "forward_sent_per_s": n / best_forward,
        "analysis_sent_per_s": n / best_analysis,
        "ratio": best_analysis / best_forward,
    }


def _status_kb(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    """Linux: writing 5 to clear_refs resets the peak RSS (VmHWM) to the current RSS."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def control_child(args) -> dict:
    """The same batches through a plain forward loop: how RSS moves without any analysis."""
    from headlab.capture import eager_attention

    model, tokenizer, _ = load(args)
    batches, n = plain_batches(args, model, tokenizer)
    trajectory = {}
    with eager_attention(model), torch.inference_mode():
        for i, inputs in enumerate(batches):
            model(**inputs, output_attentions=True)
            trajectory[min((i + 1) * args.batch_size, n)] = (_status_kb("VmRSS") or 0) / 1024
    return {"sentences": n, "rss_after": trajectory}


def memory_child(args) -> dict:
    import gc
    import tracemalloc

    if args.control:
        return control_child(args)
    model, tokenizer, _ = load(args)
    frequencies = frequencies_for(args, tokenizer)
    # Warm-up on 2 sentences: imports, first-use allocations and torch's allocator pools.
    from headlab.functions.analysis import AnalysisConfig, analyze_heads

    analyze_heads(model, tokenizer, args.conllu, frequencies=frequencies,
                  config=AnalysisConfig(batch_size=args.batch_size, max_sentences=2, engine=args.engine))
    gc.collect()
    exact = _reset_peak_rss()
    before = _status_kb("VmRSS") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    trajectory = {}  # sentences read -> current RSS (MB), after each batch

    def on_batch(n: int) -> None:
        trajectory[n] = (_status_kb("VmRSS") or 0) / 1024

    tracemalloc.start()
    seconds, analysis = time_analysis(args, model, tokenizer, frequencies, on_batch)
    _, python_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    after = _status_kb("VmHWM") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"sentences": analysis.report.n_sentences, "rss_growth_mb": (after - before) / 1024,
            "peak_rss_mb": after / 1024, "python_peak_mb": python_peak / 2**20, "seconds": seconds,
            "peak_rss_reset": exact, "rss_after": trajectory}


def _repeated_treebank(path: str, n_first: int, total: int, directory: str) -> str:
    """The first ``n_first`` sentence blocks of ``path`` repeated up to ``total`` sentences."""
    blocks, block = [], []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                block.append(line)
            elif block:
                blocks.append("".join(block))
                block = []
                if len(blocks) == n_first:
                    break
    out = Path(directory) / f"repeated-{total}.conllu"
    with open(out, "w", encoding="utf-8") as handle:
        for i in range(total):
            handle.write(blocks[i % len(blocks)] + "\n")
    return str(out)


def memory(args) -> list[dict]:
    import tempfile

    rows = []
    scratch = tempfile.mkdtemp(prefix="bench_functions_")
    runs = [(n, False) for n in args.memory_sizes] + [(max(args.memory_sizes), True)]
    for n, control in runs:
        conllu = args.conllu
        if args.memory_source == "repeat":  # same sentences, same lengths: only the count differs
            conllu = _repeated_treebank(args.conllu, min(args.memory_sizes), n, scratch)
        command = [sys.executable, __file__, "--memory-child", "--sentences", str(n), "--batch-size",
                   str(args.memory_batch_size), "--threads", str(args.threads), "--conllu", str(conllu)]
        if args.memory_max_length:
            command += ["--max-length", str(args.memory_max_length)]
        if args.engine:
            command += ["--engine", args.engine]
        if control:
            command.append("--control")
        if args.random:
            command += ["--random", "--tokenizer", str(args.tokenizer)]
        else:
            command += ["--model", str(args.model)] + (["--tokenizer", str(args.tokenizer)] if args.tokenizer else [])
        if args.train_text:
            command += ["--train-text", str(args.train_text)]
        env = dict(os.environ)
        if args.malloc_threshold:
            # glibc raises its mmap threshold as large blocks are freed, after which big tensors
            # come from the heap and RSS drifts with fragmentation (a plain forward loop drifts the
            # same way). A fixed threshold returns freed tensors to the OS, so RSS shows what is
            # really held.
            env["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_threshold)
        output = subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout
        rows.append(json.loads(output.strip().splitlines()[-1]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--tokenizer", help="tokenizer directory (default: the model's)")
    parser.add_argument("--random", action="store_true", help="random Marian of the bundled size")
    parser.add_argument("--conllu", default=str(DEFAULT_CONLLU))
    parser.add_argument("--train-text", default=str(DEFAULT_TRAIN), help="token frequencies (rare-token heads)")
    parser.add_argument("--sentences", type=int, help="throughput over the first N sentences (default: all)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--engine", choices=("eager", "chunked", "fused"),
                        help="where the statistics run (default: the fused engine, as headlab functions)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the bench machine is shared)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--memory-sizes", type=int, nargs="*", default=[200, 2000])
    parser.add_argument("--memory-source", choices=("repeat", "prefix"), default="repeat",
                        help="repeat: the larger runs repeat the smallest run's sentences (same lengths); "
                             "prefix: the first N sentences of --conllu")
    parser.add_argument("--memory-batch-size", type=int, default=40,
                        help="memory runs: sentences per batch; 40 divides 200, so that every batch of the "
                             "repeated 2,000 is one of the 200-sentence run's batches")
    parser.add_argument("--malloc-threshold", type=int, default=131072,
                        help="memory runs: MALLOC_MMAP_THRESHOLD_ for glibc (0: leave malloc's default)")
    parser.add_argument("--memory-max-length", type=int, default=0,
                        help="memory runs: cut sentences to this many tokens, so that the longest batch "
                             "(attention is quadratic in length) does not decide the peak (0: no cut)")
    parser.add_argument("--max-length", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--control", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory_child:
        print(json.dumps(memory_child(args)))
        return
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, {args.threads} thread(s)")
    if not args.skip_throughput:
        result = throughput(args)
        print(f"model: {result['model']}; {result['sentences']} sentences of {args.conllu}, "
              f"batch {args.batch_size}; rare-token heads: {'yes' if result['rare_tokens'] else 'no'}")
        print(f"plain forward (output_attentions=True): {result['forward_sent_per_s']:.1f} sent/s "
              f"(runs: {', '.join(f'{s:.2f} s' for s in result['forward_s'])})")
        print(f"functions + aggregate, one pass:        {result['analysis_sent_per_s']:.1f} sent/s "
              f"(runs: {', '.join(f'{s:.2f} s' for s in result['analysis_s'])})")
        print(f"ratio analysis / forward: {result['ratio']:.2f}x (target <= 2x)")
    if not args.skip_memory:
        rows = memory(args)
        control = rows.pop()
        if args.memory_source == "repeat":
            print(f"memory runs: the first {min(args.memory_sizes)} sentences of {Path(args.conllu).name}, "
                  f"repeated to each size, batches of {args.memory_batch_size}")
        if args.memory_max_length:
            print(f"memory runs cut every sentence to {args.memory_max_length} tokens")
        print("glibc malloc: " + (f"MALLOC_MMAP_THRESHOLD_={args.malloc_threshold}" if args.malloc_threshold
                                  else "default (dynamic mmap threshold)"))
        for row in rows:
            print(f"memory, {row['sentences']:>5} sentences: peak RSS growth {row['rss_growth_mb']:.1f} MB "
                  f"(peak RSS {row['peak_rss_mb']:.0f} MB), Python peak {row['python_peak_mb']:.2f} MB, "
                  f"{row['seconds']:.1f} s")
        for label, row in (("analysis", rows[-1]), ("plain forward loop, same batches (control)", control)):
            trajectory = {int(k): v for k, v in row["rss_after"].items()}
            if trajectory:
                wanted = (args.memory_sizes[0], max(trajectory) // 2, max(trajectory))
                marks = sorted({min(trajectory, key=lambda k: abs(k - m)) for m in wanted})
                print(f"RSS during the largest {label}, after " + ", ".join(
                    f"{k} sentences: {trajectory[k]:.0f} MB" for k in marks))


if __name__ == "__main__":
    main()
