"""Statistics inside attention: peak memory and time per sentence of ``functions`` + ``aggregate``.

Five ways to run one long sentence through a randomly initialised Llama-like model (default
4 layers x 16 heads, 4 key/value heads (grouped-query), d_model 1024), each in a fresh
subprocess so that peak memory is its own:

* ``sdpa``: a plain forward pass with PyTorch's SDPA attention (what the model does anyway);
* ``eager``: ``analyze_heads`` with positional, syntactic, rare-token and aggregate statistics
  over the eager capture (``engine="eager"``, the reference: each block's whole ``[1, heads, n, n]`` map);
* ``chunked``: the same analysis with ``query_chunk`` (headlab's registered attention function,
  ``--query-chunk`` rows at a time, statistics over word rows);
* ``fused``: the same analysis under the fused engine (``engine="fused"``, the default of ``functions``,
  ``aggregate`` and ``analyze`` since issue 34, :mod:`headlab.data.fused`:
  the same chunks of rows, the statistics from a few passes over each: maxima, products with key
  features, row-wise dot products; every word of the synthetic sentence is one token, so every
  statistic runs fused);
* ``kernel`` (CUDA only: ``--device cuda``): the same analysis under ``engine="kernel"``
  (:mod:`headlab.data.attention_kernel`): one Triton flash-attention pass per block gives the
  model's output and every statistic's passes, no probabilities.

The sentence is synthetic (random words of a word-level vocabulary, one token per word, a
random projective-ish tree: each word's governor is one of the five words before it), so the
statistics do their full work at any length. Memory: peak RSS growth over the loaded model and
data (VmHWM after resetting it, Linux; after a short warm-up run of the same mode, so that imports
and first allocations are not counted), and the total peak. Time: wall time per sentence, and the
process's CPU time (with one thread, the work done, which other jobs on a shared machine disturb
far less than the wall time).

On a CUDA GPU (``--device cuda``) the model and inputs live on the GPU, in ``--dtype``; the time
is taken between ``torch.cuda.synchronize()`` calls after the warm-up run, and the memory is the
GPU's peak allocation (``torch.cuda.max_memory_allocated``) over what the weights and inputs hold
before the timed region, with the weights' own bytes reported beside it. The host RSS is still
reported: headlab's statistics now run on the GPU (their work buffers count in its peak), but keep
their exemplar heaps and variability spool on the host (they ran there, on each attention chunk
copied to the host, in the first GPU measurement of docs/benchmarks.md). ``--shape``
picks the model: ``small`` (the default above), ``llama3-8b`` (Llama-3-8B's configuration; with
``--layers`` to keep part of its depth) or ``tiny`` (a smoke test). A run that fails is a row
too: out of memory, a crash, past ``--budget-s``, or eager beyond ``--eager-max-length``.

    python benchmarks/bench_chunked_attention.py --lengths 512 2048 --threads 1
    python benchmarks/bench_chunked_attention.py --lengths 8192 --modes sdpa chunked   # eager: ~4 GB per map
    python benchmarks/bench_chunked_attention.py --lengths 2048 --modes chunked --profile 15   # where the time goes
    python benchmarks/bench_chunked_attention.py --device cuda --dtype bfloat16 --shape llama3-8b --layers 8 \
        --lengths 1024 4096 16384 --eager-max-length 4096 --eager-last --json rows.json   # device.sh bench-gpu
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
# Model shapes (LlamaConfig fields). llama3-8b: meta-llama/Meta-Llama-3-8B's config.json (rope
# theta 500000, no rope scaling, RMS norm epsilon 1e-5, untied embeddings), randomly initialised.
SHAPES: dict[str, dict] = {
    "small": dict(num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4, hidden_size=1024,
                  intermediate_size=2816, vocab_size=4096),
    "llama3-8b": dict(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_size=4096,
                      intermediate_size=14336, vocab_size=128256, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    "tiny": dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                 intermediate_size=128, vocab_size=512),
}
# --layers etc. override the preset's field.
OVERRIDES = {"layers": "num_hidden_layers", "heads": "num_attention_heads", "kv_heads": "num_key_value_heads",
             "d_model": "hidden_size", "ffn": "intermediate_size", "vocab": "vocab_size"}
OOM_MARKERS = ("OutOfMemoryError", "CUDA out of memory", "Cannot allocate memory")


def model_fields(args) -> dict:
    """The LlamaConfig fields of ``--shape`` with the command line's overrides."""
    fields = dict(SHAPES[args.shape])
    for option, field in OVERRIDES.items():
        if getattr(args, option) is not None:
            fields[field] = getattr(args, option)
    return fields


def _status(field: str) -> int:
    """A ``VmRSS``/``VmHWM`` line of /proc/self/status, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


def word_tokenizer(vocab_size: int):
    """The word-level tokenizer of the runs: ``w0``, ``w1``, ... each one token (``write_conllu``'s words)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {token: i for i, token in enumerate(specials)}
    for i in range(vocab_size - len(specials)):
        vocab[f"w{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def model_and_tokenizer(args, length: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = model_fields(args)
    tokenizer = word_tokenizer(fields["vocab_size"])
    config = LlamaConfig(**fields, max_position_embeddings=length + 8, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    # Built on the device in its dtype: an 8B model's float32 weights would not be made on the host first.
    with torch.device(args.device):
        model = LlamaForCausalLM._from_config(config, dtype=getattr(torch, args.dtype))
    return model.eval(), tokenizer


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


class Meter:
    """Wall time, CPU time, host peak RSS and (on CUDA) GPU peak allocation of one timed region."""

    def __init__(self, cuda: bool):
        import torch

        self.torch, self.cuda = torch, cuda

    def __enter__(self):
        if self.cuda:
            self.torch.cuda.synchronize()
            self.torch.cuda.reset_peak_memory_stats()
            self.gpu_base = self.torch.cuda.memory_allocated()
        self.base = _status("VmRSS")
        _reset_peak()
        self.started, self.cpu_started = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.torch.cuda.synchronize()  # the queued kernels are part of the time
        self.seconds = time.perf_counter() - self.started
        self.cpu = time.process_time() - self.cpu_started
        self.peak = _status("VmHWM")
        if self.cuda:
            self.gpu_peak = self.torch.cuda.max_memory_allocated()
        return False


def child(args) -> dict:
    """One mode at one length, in this process: time per sentence and peak memory."""
    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    length = args.child_length
    vocab = model_fields(args)["vocab_size"]
    model, tokenizer = model_and_tokenizer(args, length)
    meter = Meter(args.device.startswith("cuda"))
    with tempfile.TemporaryDirectory() as tmp:
        conllu, warm = Path(tmp) / "long.conllu", Path(tmp) / "warm.conllu"
        write_conllu(conllu, length, args.sentences, vocab)
        # A warm-up run: imports, first allocations, on a GPU its kernels and cuBLAS.
        write_conllu(warm, min(args.warmup_words, length), 1, vocab, seed=1)
        # The CoNLL-U is read (parsed, checked) once, before the timed region, and timed on its own:
        # the analysis then streams the parsed sentences (the public API's InMemoryTreebank), as the
        # SDPA row runs on inputs made before its timer. What the analysis still does inside its
        # time is its own: tokenizing, aligning words to tokens, the forward and the statistics.
        from headlab.data.treebank import InMemoryTreebank, read_conllu

        list(read_conllu(warm))  # the reader's imports and first calls
        reading = Meter(args.device.startswith("cuda"))
        with reading:
            sentences = list(read_conllu(conllu))
        if args.child_mode == "sdpa":
            def encode(sentence):
                return tokenizer(" ".join(sentence.words), return_tensors="pt").to(args.device)

            inputs = [encode(s) for s in sentences]
            with torch.inference_mode():
                model(**encode(next(iter(read_conllu(warm)))))
            with meter, torch.inference_mode():
                for batch in inputs:
                    model(**batch)
        else:
            from headlab.data.frequencies import TokenFrequencies
            from headlab.functions import AnalysisConfig, analyze_heads

            counts = np.random.default_rng(0).integers(1, 1000, vocab)
            frequencies = TokenFrequencies(counts, "random")
            config = AnalysisConfig(functions=True, aggregate=True, batch_size=1, top_frequent=50,
                                    engine=args.child_mode,
                                    query_chunk=args.query_chunk if args.child_mode != "eager" else None)
            analyze_heads(model, tokenizer, warm, frequencies=frequencies, config=config)
            treebank = InMemoryTreebank(sentences, name=str(conllu))
            with meter:
                if args.profile:  # where the CPU time goes (the time above then includes cProfile's overhead)
                    import cProfile
                    import pstats

                    profile = cProfile.Profile(time.process_time)
                    analysis = profile.runcall(analyze_heads, model, tokenizer, treebank, frequencies=frequencies,
                                               config=config)
                    pstats.Stats(profile, stream=sys.stderr).sort_stats("tottime").print_stats(args.profile)
                else:
                    analysis = analyze_heads(model, tokenizer, treebank, frequencies=frequencies, config=config)
            assert analysis.report.n_sentences == args.sentences and analysis.report.n_truncated == 0
    # seconds_per_sentence: as before the reading was timed apart, the analysis including its reading
    # (for sdpa the forward alone); statistics_*: the timed region alone; read_*: reading the CoNLL-U.
    read_in = 0 if args.child_mode == "sdpa" else 1
    row = {"mode": args.child_mode, "length": length, "status": "ok",
           "seconds_per_sentence": (meter.seconds + read_in * reading.seconds) / args.sentences,
           "cpu_seconds_per_sentence": (meter.cpu + read_in * reading.cpu) / args.sentences,
           "statistics_seconds_per_sentence": meter.seconds / args.sentences,
           "statistics_cpu_seconds_per_sentence": meter.cpu / args.sentences,
           "read_seconds_per_sentence": reading.seconds / args.sentences,
           "read_cpu_seconds_per_sentence": reading.cpu / args.sentences,
           "peak_growth_mb": (meter.peak - meter.base) / 2**20, "peak_total_mb": meter.peak / 2**20,
           "base_mb": meter.base / 2**20}
    if meter.cuda:
        weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
        row.update(gpu=torch.cuda.get_device_name(), gpu_weights_mb=weights / 2**20,
                   gpu_base_mb=meter.gpu_base / 2**20, gpu_peak_growth_mb=(meter.gpu_peak - meter.gpu_base) / 2**20,
                   gpu_peak_total_mb=meter.gpu_peak / 2**20)
    return row


def eager_map_bytes(args, length: int) -> int:
    """One layer's whole attention map, ``[1, heads, n, n]``, in the model's dtype (what eager capture holds)."""
    import torch

    return model_fields(args)["num_attention_heads"] * length * length * getattr(torch, args.dtype).itemsize


def run_one(args, mode: str, length: int, deadline: float | None) -> dict:
    """``mode`` at ``length`` in a fresh subprocess; a failure is a row with its status."""
    setup = {"mode": mode, "length": length, "device": args.device, "dtype": args.dtype, "shape": args.shape,
             "model": model_fields(args), "query_chunk": args.query_chunk, "threads": args.threads}
    if mode == "eager" and args.eager_max_length is not None and length > args.eager_max_length:
        return {**setup, "status": "skipped", "detail": f"eager beyond --eager-max-length {args.eager_max_length}: "
                f"one layer's map alone is {eager_map_bytes(args, length) / 2**20:,.0f} MiB in {args.dtype}"}
    timeout = None if deadline is None else deadline - time.monotonic()
    if timeout is not None and timeout <= 0:
        return {**setup, "status": "timeout", "detail": f"not started: --budget-s {args.budget_s:g} spent"}
    command = [sys.executable, __file__, *sys.argv[1:], "--child-mode", mode, "--child-length", str(length)]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": str(args.threads)}
    if args.malloc_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_threshold)
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**setup, "status": "timeout", "detail": f"stopped after {timeout:.0f} s: --budget-s {args.budget_s:g}"}
    if args.profile and not done.returncode:
        print(f"{mode} at {length}:\n{done.stderr}", flush=True)
    if done.returncode:
        print(f"{mode} at {length}: failed\n{done.stderr[-2000:]}", file=sys.stderr)
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        if done.returncode < 0:  # SIGKILL without a traceback: the host's out-of-memory killer, most often
            last = f"killed by signal {-done.returncode}; {last}"
        status = "out of memory" if any(m in done.stderr for m in OOM_MARKERS) else "failed"
        return {**setup, "status": status, "detail": last[-300:]}
    return {**setup, **json.loads(done.stdout.strip().splitlines()[-1])}


def write_rows(path: str, rows: list[dict]) -> None:
    """Atomically, after every run: a run cut short by the caller's time limit keeps the rows before it."""
    target = Path(path)
    partial = target.with_name(target.name + ".partial")
    partial.write_text(json.dumps(rows, indent=1) + "\n")
    os.replace(partial, target)


def row_line(row: dict) -> str:
    head = f"{row['length']:>6} {row['mode']:>8}: "
    if row["status"] != "ok":
        return head + f"{row['status']} ({row['detail']})"
    line = (head + f"{row['seconds_per_sentence']:8.2f} s/sentence ({row['cpu_seconds_per_sentence']:.2f} s CPU), "
            f"peak growth {row['peak_growth_mb']:8.0f} MB, peak {row['peak_total_mb']:8.0f} MB")
    if "read_seconds_per_sentence" in row:
        line += (f"; reading the CoNLL-U {row['read_seconds_per_sentence']:.2f} s "
                 f"({row['read_cpu_seconds_per_sentence']:.2f} s CPU)"
                 + (", included" if row["mode"] != "sdpa" else ", apart"))
    if "gpu_peak_total_mb" in row:
        line += (f"; GPU peak growth {row['gpu_peak_growth_mb']:8.0f} MB, peak {row['gpu_peak_total_mb']:8.0f} MB "
                 f"(weights {row['gpu_weights_mb']:.0f} MB)")
    return line


def print_table(rows: list[dict], cuda: bool) -> None:
    # (title, key, digits, the SDPA row's key the ratio divides by): the reading and the analysis without
    # it are each set against the SDPA forward's time, so that both ratios show
    columns = [("s / sentence", "seconds_per_sentence", 2, "seconds_per_sentence"),
               ("without reading", "statistics_seconds_per_sentence", 2, "seconds_per_sentence"),
               ("reading", "read_seconds_per_sentence", 2, "seconds_per_sentence"),
               ("CPU s / sentence", "cpu_seconds_per_sentence", 2, "cpu_seconds_per_sentence")]
    if cuda:  # the GPU's memory (the statistics' work buffers too); the host's: exemplars, spool, bookkeeping
        columns += [(title, key, 0, key) for title, key in (
            ("GPU peak growth (MB)", "gpu_peak_growth_mb"), ("GPU peak (MB)", "gpu_peak_total_mb"),
            ("host RSS growth (MB)", "peak_growth_mb"))]
    else:
        columns += [(title, key, 0, key) for title, key in (
            ("peak growth (MB)", "peak_growth_mb"), ("peak total (MB)", "peak_total_mb"))]
    print("| length | mode | " + " | ".join(f"{title} | x SDPA" for title, *_ in columns) + " |")
    print("|---:|---|" + "---:|---:|" * len(columns))
    for row in rows:
        if row["status"] != "ok":
            print(f"| {row['length']} | {row['mode']} | {row['status']}: {row['detail']} |")
            continue
        ref = next((r for r in rows if r["length"] == row["length"] and r["mode"] == "sdpa" and r["status"] == "ok"),
                   None)
        cells = []
        for _, key, digits, ref_key in columns:
            if key not in row:  # a row of an older run (--json) without the reading apart
                cells.append("- | -")
                continue
            ratio = f"{row[key] / ref[ref_key]:.2f}" if ref and ref.get(ref_key, 0) > 0 else "-"
            cells.append(f"{row[key]:.{digits}f} | {ratio}")
        print(f"| {row['length']} | {row['mode']} | " + " | ".join(cells) + " |")


MODES = ["sdpa", "fused", "chunked", "eager", "kernel"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--modes", nargs="+", default=["sdpa", "fused", "chunked", "eager"],
                        choices=MODES)
    parser.add_argument("--query-chunk", type=int, default=None,
                        help="query rows per chunk (default: the analysis's, 128; 256 for fused on a CUDA GPU)")
    parser.add_argument("--sentences", type=int, default=1, help="sentences per run (time is per sentence)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small",
                        help="the model's preset shape; the options below override its fields")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--kv-heads", type=int)
    parser.add_argument("--d-model", type=int)
    parser.add_argument("--ffn", type=int)
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (cuda:N) for the GPU's timing and memory")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--warmup-words", type=int, default=32,
                        help="length of the warm-up sentence run before the timed one (at most the length)")
    parser.add_argument("--eager-max-length", type=int,
                        help="record eager runs longer than this as skipped (their maps would not fit)")
    parser.add_argument("--eager-last", action="store_true",
                        help="run the eager rows after all the others (under --budget-s the others come first)")
    parser.add_argument("--last", nargs="+", default=[], choices=MODES,
                        metavar="MODE", help="run these modes' rows after all the others, in this order "
                                             "(after them --eager-last's eager rows)")
    parser.add_argument("--budget-s", type=float,
                        help="stop the runs after this many seconds in all; the one running and the rest are "
                             "recorded as timeouts")
    parser.add_argument("--malloc-threshold", type=int, default=131072,
                        help="MALLOC_MMAP_THRESHOLD_ for glibc in the runs, so that RSS follows live memory "
                             "(0: leave malloc's dynamic threshold, under which RSS drifts)")
    parser.add_argument("--json", help="also write the rows here (after every run)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="print the N functions with the most CPU time of each analysis run (cProfile)")
    parser.add_argument("--child-mode", help=argparse.SUPPRESS)
    parser.add_argument("--child-length", type=int, help=argparse.SUPPRESS)
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    if args.child_mode:
        print(json.dumps(child(args)))
        return
    if args.device != "cpu" and not args.device.startswith("cuda"):
        parser.error(f"--device {args.device}: cpu or cuda[:N]")
    if "kernel" in args.modes and not args.device.startswith("cuda"):
        parser.error("--modes kernel: the Triton kernel runs on a CUDA GPU (--device cuda); on the CPU only "
                     "under Triton's interpreter, for tests, not for timing")
    fields = model_fields(args)
    print(f"model: Llama ({args.shape}) {fields['num_hidden_layers']} layers x {fields['num_attention_heads']} heads "
          f"({fields['num_key_value_heads']} key/value heads), d_model {fields['hidden_size']}, "
          f"FFN {fields['intermediate_size']}, vocabulary {fields['vocab_size']}; {args.device}, {args.dtype}; "
          f"query chunk {args.query_chunk or 'default'}; {args.threads} thread(s); mmap threshold {args.malloc_threshold}; "
          f"{platform.machine()}, {platform.python_version()}", flush=True)
    deadline = None if args.budget_s is None else time.monotonic() + args.budget_s
    runs = [(length, mode) for length in args.lengths for mode in args.modes]
    late = list(args.last) + (["eager"] if args.eager_last and "eager" not in args.last else [])
    # stable: the other rows keep their order, the late ones come after them in the order given
    runs.sort(key=lambda run: late.index(run[1]) + 1 if run[1] in late else 0)
    rows = []
    for length, mode in runs:
        row = run_one(args, mode, length, deadline)
        rows.append(row)
        print(row_line(row), flush=True)
        if args.json:
            write_rows(args.json, rows)
    print()
    if any("gpu" in row for row in rows):
        print(f"GPU: {next(row['gpu'] for row in rows if 'gpu' in row)}")
    order = {(length, mode): i for i, (length, mode) in
             enumerate((length, mode) for length in args.lengths for mode in args.modes)}
    print_table(sorted(rows, key=lambda row: order[row["length"], row["mode"]]), cuda=args.device.startswith("cuda"))
    if any(row["status"] == "failed" for row in rows):  # a crash, not a measured limit (memory, budget)
        sys.exit(1)


if __name__ == "__main__":
    main()
