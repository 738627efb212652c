"""The host's work per long sentence before any attention: reading, aligning, side tensors.

For one N-word sentence (default 16,384), the GPU bench's input (``bench_chunked_attention.py``'s
``write_conllu`` file and word-level tokenizer, one token per word), times in one process, one
thread, each the best of ``--repeat`` rounds (the items alternate within a round, so that a
change of load touches them alike):

* ``conllu.parse_incr``: the ``conllu`` package reading the same file with its default parsers,
  the library reference the others are divided by (a loaded machine slows both alike, so the
  ratio stays comparable between runs where the seconds do not);
* ``read_conllu``: headlab's reader (parse, check, the Sentence);
* ``align_sentences``: joining the words, tokenizing with offsets, words to tokens, as
  ``functions`` does it (``--spacing words``, the model's maximum length the sentence's + 8, as
  the GPU bench's model);
* ``build_side_batch``: the batch's tensors (``sum`` pooling);
* the host total, the last three added (their best times, not one round's).

    python benchmarks/bench_host_reading.py                       # 16,384 words, best of 5
    python benchmarks/bench_host_reading.py --words 4096 16384 --repeat 7 --json host.json
    python benchmarks/bench_host_reading.py --profile 25           # where the time goes (cProfile, once)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "src"))

import bench_chunked_attention as bench  # noqa: E402  (the GPU bench's CoNLL-U writer and tokenizer)

ITEMS = ("conllu.parse_incr", "read_conllu", "align_sentences", "build_side_batch")
HOST = ITEMS[1:]  # what headlab does per sentence on the host before its forward


def _clock():
    return time.perf_counter(), time.process_time()


def steps(path: Path, tokenizer, max_length: int) -> tuple[dict, dict]:
    """``({item: callable}, made)``: each callable does its item once; later ones take what earlier
    ones left in ``made`` (``sentences``, ``alignments``, ``side``)."""
    from conllu import parse_incr

    from headlab.data.alignment import align_sentences, build_side_batch
    from headlab.data.treebank import read_conllu

    made: dict = {}

    def reference():
        with open(path, encoding="utf-8") as handle:
            return sum(1 for _ in parse_incr(handle))

    def reading():
        made["sentences"] = list(read_conllu(path))

    def aligning():
        made["alignments"] = align_sentences(tokenizer, [s.words for s in made["sentences"]], max_length=max_length)

    def side():
        items = [(s, a, i) for i, (s, a) in enumerate(zip(made["sentences"], made["alignments"]))]
        made["side"] = build_side_batch(items, tokenizer.pad_token_id, pooling="sum")

    return dict(zip(ITEMS, (reference, reading, aligning, side))), made


def measure(words: int, repeat: int, vocab: int, profile: int = 0) -> dict:
    """One sentence of ``words`` words: the best wall and CPU seconds of each item over ``repeat`` rounds."""
    import torch

    torch.set_num_threads(1)
    tokenizer = bench.word_tokenizer(vocab)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "long.conllu"
        bench.write_conllu(path, words, 1, vocab)
        run, _ = steps(path, tokenizer, words + 8)
        for call in run.values():  # imports and first calls outside the timing
            call()
        best = {item: [float("inf"), float("inf")] for item in ITEMS}
        for _ in range(repeat):
            for item, call in run.items():
                wall, cpu = _clock()
                call()
                wall_end, cpu_end = _clock()
                best[item][0] = min(best[item][0], wall_end - wall)
                best[item][1] = min(best[item][1], cpu_end - cpu)
        if profile:
            import cProfile
            import pstats

            profiler = cProfile.Profile()
            profiler.enable()
            for item in HOST:
                run[item]()
            profiler.disable()
            pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(profile)
    row = {"words": words, "repeat": repeat, **{item: {"seconds": w, "cpu_seconds": c} for item, (w, c) in best.items()}}
    row["host total"] = {key: sum(row[item][key] for item in HOST) for key in ("seconds", "cpu_seconds")}
    return row


def print_table(rows: list[dict]) -> None:
    reference = ITEMS[0]
    print(f"| words | item | s (best) | x {reference} | CPU s (best) | x {reference} |")
    print("|---:|---|---:|---:|---:|---:|")
    for row in rows:
        for item in (*ITEMS, "host total"):
            cells = [f"{row[item][key]:.4f} | {row[item][key] / row[reference][key]:.2f}"
                     for key in ("seconds", "cpu_seconds")]
            print(f"| {row['words']:,} | {item} | " + " | ".join(cells) + " |")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--words", type=int, nargs="+", default=[16384], help="words of the sentence (one run each)")
    parser.add_argument("--repeat", type=int, default=5, help="rounds; each item's best is kept")
    parser.add_argument("--vocab", type=int, default=bench.SHAPES["small"]["vocab_size"],
                        help="the tokenizer's vocabulary (the bench's small shape's by default)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after the timing, profile one round of headlab's items; print the N costliest functions")
    parser.add_argument("--json", help="also write the rows here")
    return parser


def main(argv: list[str] | None = None) -> list[dict]:
    args = build_parser().parse_args(argv)
    if min(args.words) < 1 or args.repeat < 1:
        raise SystemExit("--words and --repeat must be at least 1")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{platform.machine()}, Python {platform.python_version()}, {os.cpu_count()} CPUs, load {load:.1f}, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}; best of {args.repeat}", flush=True)
    rows = [measure(words, args.repeat, args.vocab, args.profile) for words in args.words]
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
