"""Sharded corpora: two CPU processes (gloo) write what one process writes.

The four commands (importance, functions with aggregate, aggregate, analyze, and analyze again,
resumed) run in one pair of processes started by the launcher of ``--num-processes``
(:func:`headlab.shard.launch`) with this file as their script, as ``accelerate launch`` or
``torchrun`` would start them (one pair for all: starting Python with torch costs seconds). Every
file must be the one-process run's, byte for byte, apart from the fields that time the run
(:data:`TIMED`); every JSON and CSV value is also compared on its own (floats with ==) for a
message that names it. Run as a script, it is one process's worker.
"""

import csv
import json
import math
import os
import re
import sys
from pathlib import Path

import pytest

SOURCE = ["the old dog chased a red ball .", "a dog sleep here .", "the red ball chased the old dog .",
          "", "old dog .", "the dog chased a ball here .", "a red dog sleep .", "the ball ."]
# JSON fields that differ between any two runs: wall times, clock times, and in analyze's stage
# markers (.headlab/stages) the key, which for agreement and table hashes the upstream stages' finish times.
TIMING = {"seconds", "created", "finished"}
MARKER_TIMING = TIMING | {"key", "marker_id"}  # a marker's id is new on every write
# The same, in the files' bytes: those JSON fields' values, and the READMEs' "analysed in 0.1 s".
TIMED = re.compile(rb'(?P<field>"(?:seconds|created|finished)": )(?:"[^"]*"|[-+.\deE]+)|(?P<line>analysed in )[\d.]+ s')
MARKER_KEY = re.compile(rb'(?P<field>"(?:key|marker_id)": )"[^"]*"')
# Sentences with one prefix: a causal model gives their first words the same attention, so the
# exemplars' top k has ties of equal weights to break as one process breaks them.
PREFIXED = ["the old dog sleeps here", "the old dog chased a ball", "the old cat sleeps", "the old ball",
            "the old cat chased the dog", "the old dog sleeps", "the old red ball", "the old cat here"]


def _commands(base: Path, out: str) -> dict[str, list[str]]:
    model, conllu, source = str(base / "model"), str(base / "corpus.conllu"), str(base / "source.txt")
    common = ["--no-progress", "--batch-size", "2"]
    return {
        "importance": ["importance", model, "--data", source, "--out", f"{out}/importance", "--lrp-bootstrap", "20",
                       *common],
        "aggregate": ["aggregate", model, "--conllu", conllu, "--out", f"{out}/aggregate", "--no-figures", *common],
        "aggregate_lm": ["aggregate", str(base / "lm"), "--conllu", str(base / "prefixed.conllu"), "--out",
                         f"{out}/aggregate_lm", "--no-figures", "--top-k", "3", "--query-chunk", "2", *common],
        "analyze": ["analyze", model, "--source", source, "--conllu", conllu, "--out", f"{out}/analyze",
                    "--skip", "attention", "figures", "report", *common],
        "functions": ["functions", model, "--conllu", conllu, "--out", f"{out}/functions", "--aggregate",
                      "--no-figures", "--train-text", source, "--top-frequent", "3", "--sensitivity", *common],
    }


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A tiny Marian model, a treebank with a malformed, an unalignable and an over-long sentence
    (problems to merge), and a source text with an empty line."""
    from tokenizers import normalizers

    from support.models import tiny_model
    from support.treebank import SAMPLE_CONLLU, word_tokenizer
    from test_functions_cli import BAD_LINE, UNALIGNABLE, _long_sentence

    base = tmp_path_factory.mktemp("sharded")
    words = [line.split("\t")[1] for line in SAMPLE_CONLLU.splitlines() if line and not line.startswith("#")]
    tokenizer = word_tokenizer(words + ["#"])
    tokenizer.backend_tokenizer.normalizer = normalizers.Replace("#", "")
    tiny_model("marian").save_pretrained(base / "model")
    tokenizer.save_pretrained(base / "model")
    text = SAMPLE_CONLLU.replace("3\tdog\tdog\tNOUN\tNN\t_\t5\tnsubj\t_\t_", BAD_LINE, 1)
    (base / "corpus.conllu").write_text(text + "\n" + UNALIGNABLE + "\n" + _long_sentence() + "\n" + SAMPLE_CONLLU,
                                        encoding="utf-8")
    (base / "source.txt").write_text("\n".join(SOURCE) + "\n", encoding="utf-8")
    tiny_model("gpt2").save_pretrained(base / "lm")
    word_tokenizer(" ".join(PREFIXED).split(), style="gpt2").save_pretrained(base / "lm")
    blocks = []
    for n, sentence in enumerate(PREFIXED, start=1):
        rows = [f"{i}\t{w}\t{w}\tNOUN\tNN\t_\t{0 if i == 1 else 1}\t{'root' if i == 1 else 'dep'}\t_\t_"
                for i, w in enumerate(sentence.split(), start=1)]
        blocks.append(f"# sent_id = p{n}\n# text = {sentence}\n" + "\n".join(rows) + "\n")
    (base / "prefixed.conllu").write_text("\n".join(blocks), encoding="utf-8")
    return base


def _same(a, b, where: str, timing=TIMING) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), where
        for key in a.keys() - timing:
            _same(a[key], b[key], f"{where}.{key}", timing)
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]", timing)
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), (where, a, b)
    else:
        assert type(a) is type(b) and a == b, (where, a, b)  # floats too: the same bits


def _cell(text: str):
    try:
        return float(text)
    except ValueError:
        return text


def assert_same_results(one: Path, two: Path) -> int:
    """The same files, with the same bytes but for the timings; JSON and CSV files with the same
    values. Returns how many floats were compared."""
    files = sorted(p.relative_to(one) for p in one.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(two) for p in two.rglob("*") if p.is_file())
    floats = []
    for rel in files:
        marker = rel.parts[:2] == (".headlab", "stages")
        if rel.suffix == ".json":
            _same(*(json.loads((d / rel).read_text(), parse_float=lambda t: floats.append(t) or float(t))
                    for d in (one, two)), str(rel), MARKER_TIMING if marker else TIMING)
        elif rel.suffix == ".csv":
            rows = [[[_cell(c) for c in row] for row in csv.reader((d / rel).open())] for d in (one, two)]
            _same(*rows, str(rel))
        texts = [TIMED.sub(lambda m: (m["field"] or m["line"]) + b"_", (d / rel).read_bytes()) for d in (one, two)]
        if marker:
            texts = [MARKER_KEY.sub(rb"\g<field>_", text) for text in texts]
        assert texts[0] == texts[1], rel  # every other byte
    return len(floats) // 2


def _markers(directory: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in (directory / ".headlab" / "stages").iterdir()}


def test_two_processes_write_what_one_process_writes(tmp_path, corpus, monkeypatch):
    from headlab import shard
    from headlab.cli import main

    for name, argv in _commands(corpus, str(tmp_path / "one")).items():
        assert main(argv) == 0, name
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert shard.launch([], 2, command=[sys.executable, __file__, str(corpus), str(tmp_path / "two")]) == 0
    weights = [e["weight"] for heads in json.loads((tmp_path / "one" / "aggregate_lm" / "aggregate" / "exemplars.json")
                                                   .read_text()).values() for heap in heads for e in heap]
    assert len(set(weights)) < len(weights)  # ties among the exemplars kept
    for name in ("importance", "aggregate", "aggregate_lm", "analyze", "functions"):
        assert assert_same_results(tmp_path / "one" / name, tmp_path / "two" / name) >= 50, name
    signature = json.loads((tmp_path / "two" / "importance" / "lrp.json").read_text())["signature"]
    assert signature["bootstrap"]["resamples"] == 20  # the bootstrap's standard errors were compared above
    summary = json.loads((tmp_path / "two" / "functions" / "summary.json").read_text())["report"]
    assert summary["problems"]["counts"] == {"malformed": 1, "unaligned": 1, "truncated": 1}
    resumed = json.loads((tmp_path / "two" / "resumed.json").read_text())
    assert resumed["before"] == resumed["after"]  # the second analyze reused every stage
    assert resumed["lock_left"] is False
    assert resumed["group_threads_left"] == []  # the process group was freed, not only deregistered


def test_num_processes_runs_the_same_command_in_that_many_processes(tmp_path, corpus, monkeypatch):
    from headlab import shard
    from headlab.cli import main

    started = []
    monkeypatch.setattr(shard, "launch", lambda argv, n: started.append((argv, n)) or 7)
    argv = _commands(corpus, str(tmp_path))["functions"] + ["--num-processes", "2"]
    assert main(argv) == 7  # the processes' exit status
    assert started == [(argv, 2)]  # each process runs the command as given (and checks it is one of 2)


def test_a_joined_process_destroys_its_process_group_once_before_exit(tmp_path, monkeypatch):
    # Left to the C++ static destructors, gloo aborted about 1 two-process run in 15 to 60 at exit
    # ("terminate called without an active exception", status -6); the group is now destroyed first
    # (that it is then gone, threads and all, is checked in the two processes' worker).
    import atexit

    import torch.distributed as dist

    from headlab import shard

    handlers = []
    monkeypatch.setattr(atexit, "register", handlers.append)
    monkeypatch.setattr(atexit, "unregister", lambda f: handlers.remove(f) if f in handlers else None)
    shard.before_joining()
    shard.before_joining()  # a second command in the same process
    assert len(handlers) == 1
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    handlers[0]()
    assert not dist.is_initialized()
    handlers[0]()  # nothing left to destroy: no error


def test_sum_adds_every_kind_of_partial_result_in_rank_order(monkeypatch):
    from collections import Counter

    import torch

    from headlab.shard import SINGLE, Shard

    parts = [{"hits": {("enc_self", 0): torch.tensor([1, 2])}, "offsets": Counter({-1: 2}), "n": 3, "x": (0.5, [1.0])},
             {"hits": {("enc_self", 0): torch.tensor([3, 4]), ("enc_self", 1): torch.tensor([5])},
              "offsets": Counter({-1: 1, 2: 0}), "n": 4, "x": (0.25, [2.0])}]
    monkeypatch.setattr(Shard, "gather", lambda self, value: parts)
    total = Shard(0, 2).sum(parts[0])
    assert total["hits"][("enc_self", 0)].tolist() == [4, 6] and total["hits"][("enc_self", 1)].tolist() == [5]
    assert total["offsets"] == Counter({-1: 3, 2: 0}) and 2 in total["offsets"]  # a zero count is kept
    assert total["n"] == 7 and total["x"] == (0.75, [3.0])
    assert SINGLE.sum(parts[1]) is parts[1]  # one process: nothing to add
    assert [i for i in range(7) if Shard(1, 3).owns(i)] == [1, 4] and Shard(1, 3).count(7) == 2


def test_a_ledger_adds_the_batches_parts_in_batch_order_as_one_process_does(monkeypatch):
    import torch

    from headlab.shard import SINGLE, Ledger, Shard

    # Batch i's part; float addition is not associative: 1 + 1e16 is 1e16.
    parts = [{"x": torch.tensor([1.0], dtype=torch.float64)}, {"x": torch.tensor([1e16], dtype=torch.float64)},
             {"x": torch.tensor([1.0], dtype=torch.float64), "y": 0.25}, {"x": torch.tensor([-1e16], dtype=torch.float64)}]
    start = {"x": torch.zeros(1, dtype=torch.float64)}
    one = Ledger(SINGLE, start)
    for number, part in enumerate(parts):
        one.add(number, part)
    assert one.total()["x"].item() == 0.0 and one.total()["y"] == 0.25
    ledgers = [Ledger(Shard(rank, 2), start) for rank in range(2)]
    for number, part in reversed(list(enumerate(parts))):  # added in any order: the order key counts
        ledgers[number % 2].add(number, part)
    kept = [ledger._parts for ledger in ledgers]  # what each process keeps, and gathers
    monkeypatch.setattr(Shard, "gather", lambda self, value: kept)
    totals = [ledger.total() for ledger in ledgers]
    assert all(total["x"].item() == 0.0 and total["y"] == 0.25 for total in totals)  # the same bits
    assert (1.0 + 1.0) + (1e16 + -1e16) == 2.0  # the processes' subtotals (batches 0, 2 and 1, 3), added
    with pytest.raises(RuntimeError, match="gathered"):
        ledgers[0].add(4, parts[0])


def test_a_failing_process_stops_the_others_and_gives_its_status():
    import time

    from headlab import shard

    script = "import os, sys, time\nif os.environ['RANK'] == '1': sys.exit(3)\ntime.sleep(60)"
    start = time.perf_counter()
    assert shard.launch([], 2, command=[sys.executable, "-c", script]) == 3
    assert time.perf_counter() - start < 30  # rank 0 was stopped, not waited for


@pytest.mark.parametrize("command", ["importance", "functions", "aggregate", "analyze"])
def test_bad_process_counts_fail_before_any_work(tmp_path, corpus, command, monkeypatch, capsys):
    from headlab import shard
    from headlab.cli import main

    def refuse(*args, **kwargs):
        raise AssertionError("no process may start")

    monkeypatch.setattr(shard, "launch", refuse)
    argv = _commands(corpus, str(tmp_path))[command]
    for n in ("0", "-1"):
        assert main(argv + ["--num-processes", n]) == 2
        assert f"--num-processes must be at least 1, got {n}" in capsys.readouterr().err
    assert main(argv + ["--num-processes", "99"]) == 2
    err = capsys.readouterr().err
    assert "--num-processes 99: more processes than the" in err
    monkeypatch.setenv("WORLD_SIZE", "2")  # under a launcher of 2 processes
    assert main(argv + ["--num-processes", "3"]) == 2
    assert "--num-processes 3, but the launcher started 2 processes" in capsys.readouterr().err
    assert not (tmp_path / command).exists()


def test_analyze_refuses_prune_in_several_processes(tmp_path, corpus, monkeypatch, capsys):
    from headlab import shard
    from headlab.cli import main

    monkeypatch.setattr(shard, "launch", lambda *args: pytest.fail("no process may start"))
    assert main(_commands(corpus, str(tmp_path))["analyze"] + ["--prune", "--num-processes", "2"]) == 2
    assert "--prune trains in processes of its own" in capsys.readouterr().err


def _worker(base: str, out: str) -> None:
    import torch

    from headlab import shard
    from headlab.cli import main
    from headlab.lock import LOCK_FILE

    torch.set_num_threads(1)
    commands = _commands(Path(base), out)
    for name in ("importance", "functions", "aggregate", "aggregate_lm", "analyze"):
        assert main(commands[name]) == 0, name
    analysis = Path(out) / "analyze"
    before = _markers(analysis) if int(os.environ["RANK"]) == 0 else {}
    assert main(commands["analyze"]) == 0  # resumed: every stage is reused
    # The exit handler, then the group's threads must be gone: loading models after joining once
    # kept the group alive, and its gloo threads aborted the process at exit.
    shard._leave_process_group()
    threads = [(task / "comm").read_text().strip() for task in Path("/proc/self/task").iterdir()] \
        if Path("/proc/self/task").is_dir() else []
    if int(os.environ["RANK"]) == 0:
        (Path(out) / "resumed.json").write_text(json.dumps(
            {"before": before, "after": _markers(analysis), "lock_left": (analysis / LOCK_FILE).exists(),
             "group_threads_left": [name for name in threads if "gloo" in name or "tcpstore" in name]}))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    _worker(sys.argv[1], sys.argv[2])
