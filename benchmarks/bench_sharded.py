"""Sharded corpora: wall time of ``headlab functions`` in N processes against one, and the results.

Runs ``headlab functions MODEL --conllu TREEBANK --aggregate`` (head functions and the aggregate
statistics, no figures) as a user would, each run a fresh ``python -m headlab`` subprocess:
in one process with ``--threads T`` (all the cores it is given), in one process with
``--threads T/N`` (one process's share), and with ``--num-processes N --threads T/N`` (the same
cores, split), in turn, ``--repeats`` times. Printed: the wall time of each (the command as a
whole: starting Python and torch, loading the model in each process, reading the treebank, the
analysis, writing) and the analysis loop's time
from ``summary.json`` (``report.seconds``, the main process's, combining included), their ratios
against one process, and how the written files compare with the one-process run's: JSON values
(integers and strings exactly, how many floats differ and by how much), bytes, and bytes apart
from the fields that time the run (``seconds``, the README's "analysed in 0.1 s").

    python benchmarks/bench_sharded.py                           # bundled model, EWT dev, 2 processes
    python benchmarks/bench_sharded.py --processes 2 4 --threads 4 --repeats 3

On a machine with few cores shared with other work expect little: the processes compete for the
same cores, and each pays Python's, torch's and the model's start-up.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO / "models" / "multi30k-en-de"
DEFAULT_CONLLU = REPO / "data" / "ud-english-ewt" / "en_ewt-ud-dev.conllu"
TIMING = {"seconds", "created", "finished", "started"}
TIMED = re.compile(rb'(?P<field>"(?:seconds|created|finished|started)": )(?:"[^"]*"|[-+.\deE]+)|(?P<line>analysed in )[\d.]+ s')


def run(args, out: Path, processes: int, threads: int) -> dict:
    command = [sys.executable, "-m", "headlab", "functions", str(args.model), "--conllu", str(args.conllu),
               "--out", str(out), "--aggregate", "--no-figures", "--no-progress", "--batch-size", str(args.batch_size),
               "--threads", str(threads)]
    if args.max_sentences:
        command += ["--max-sentences", str(args.max_sentences)]
    if processes > 1:
        command += ["--num-processes", str(processes)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH")) if p))
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    report = json.loads((out / "summary.json").read_text())["report"]
    return {"wall_s": wall, "analysis_s": report["seconds"], "sentences": report["n_sentences"]}


def _walk(a, b, where, worst: list) -> None:
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            raise AssertionError(f"{where}: different keys")
        for key in a.keys() - TIMING:
            _walk(a[key], b[key], f"{where}.{key}", worst)
    elif isinstance(a, list):
        if not isinstance(b, list) or len(a) != len(b):
            raise AssertionError(f"{where}: different lengths")
        for i, (x, y) in enumerate(zip(a, b)):
            _walk(x, y, f"{where}[{i}]", worst)
    elif isinstance(a, float) or isinstance(b, float):
        if math.isnan(a) and math.isnan(b):
            return
        scale = max(abs(a), abs(b))
        worst.append(0.0 if a == b else abs(a - b) / scale)
    elif a != b:
        raise AssertionError(f"{where}: {a!r} != {b!r}")


def compare(one: Path, two: Path) -> dict:
    files = sorted(p.relative_to(one) for p in one.rglob("*") if p.is_file())
    if files != sorted(p.relative_to(two) for p in two.rglob("*") if p.is_file()):
        return {"same_files": False}
    worst: list[float] = []
    n_json = same_bytes = same_but_timings = 0
    for rel in files:
        data = [(d / rel).read_bytes() for d in (one, two)]
        same_bytes += data[0] == data[1]
        same_but_timings += len({TIMED.sub(lambda m: (m["field"] or m["line"]) + b"_", d) for d in data}) == 1
        if rel.suffix == ".json":
            _walk(json.loads((one / rel).read_text()), json.loads((two / rel).read_text()), str(rel), worst)
            n_json += 1
    return {"same_files": True, "files": len(files), "byte_identical": same_bytes,
            "byte_identical_but_timings": same_but_timings, "json_files": n_json,
            "floats": len(worst), "floats_differing": sum(1 for w in worst if w), "max_rel_diff": max(worst, default=0.0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--conllu", type=Path, default=DEFAULT_CONLLU)
    parser.add_argument("--max-sentences", type=int, help="default: the whole treebank")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--processes", type=int, nargs="+", default=[2])
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the one process, split among N")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args()

    setups = [(1, args.threads)]  # (processes, threads of each)
    for n in args.processes:
        setups += [(1, max(1, args.threads // n)), (n, max(1, args.threads // n))]
    setups = list(dict.fromkeys(setups))
    times: dict[tuple[int, int], list[dict]] = {setup: [] for setup in setups}
    checks = {}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for n, threads in setups:
                out = Path(tmp) / f"r{repeat}-p{n}-t{threads}"
                times[(n, threads)].append(run(args, out, n, threads))
                print(f"repeat {repeat + 1}, {n} process(es) x {threads} thread(s): {times[(n, threads)][-1]}",
                      file=sys.stderr, flush=True)
        for n, threads in setups[1:]:
            checks[f"{n}x{threads}"] = compare(Path(tmp) / f"r0-p1-t{args.threads}", Path(tmp) / f"r0-p{n}-t{threads}")

    best = {setup: {key: min(t[key] for t in runs) for key in ("wall_s", "analysis_s")} for setup, runs in times.items()}
    one = best[setups[0]]
    sentences = times[setups[0]][0]["sentences"]
    print(f"\n`headlab functions --aggregate`, {args.model.name} over {sentences} sentences of {args.conllu.name}, "
          f"batch {args.batch_size}, {args.threads} torch threads in all; best of {args.repeats}; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores\n")
    print(f"| processes | threads each | wall (s) | x 1 x {args.threads} | analysis loop (s) | x 1 x {args.threads} |")
    print("|---:|---:|---:|---:|---:|---:|")
    for (n, threads), b in best.items():
        print(f"| {n} | {threads} | {b['wall_s']:.1f} | {b['wall_s'] / one['wall_s']:.2f} "
              f"| {b['analysis_s']:.1f} | {b['analysis_s'] / one['analysis_s']:.2f} |")
    for setup, check in checks.items():
        print(f"\n{setup} against 1x{args.threads}: {json.dumps(check)}")
    if args.json:
        args.json.write_text(json.dumps({"best": {f"{n}x{t}": b for (n, t), b in best.items()},
                                         "runs": {f"{n}x{t}": r for (n, t), r in times.items()}, "checks": checks,
                                         "sentences": sentences, "threads": args.threads}, indent=1) + "\n")


if __name__ == "__main__":
    main()
