"""The part of the heavy-lifting drivers (heavy_lifting_lm.py, heavy_lifting_nmt.py) that runs
``headlab`` commands: one configuration after another, each in its own directory under
``--root``, a ``STATUS`` file saying what is done and what runs, and a deadline at which the
running command gets SIGINT (a training stops at its checkpoint) and the driver stops; rerunning
the same command resumes. A driver's ``Runner`` subclasses :class:`Runner` with what its
configurations are and how one runs (``run_one``).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class Deadline(Exception):
    pass


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Runner:
    def __init__(self, args):
        self.root = Path(args.root).resolve()
        self.model = str(Path(args.model).resolve())
        self.deadline = args.deadline
        self.python = sys.executable
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                    "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.labels = json.loads(Path(args.labels).read_text())
        self.done: list[str] = []
        self.only = set(args.only.split(",")) if args.only else None

    def status_name(self) -> str:
        return "STATUS"

    def status(self, line: str) -> None:
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        text = f"{stamp} {line}\nfinished: {len(self.done)}: {', '.join(self.done)}\npid {os.getpid()}\n"
        self.root.mkdir(parents=True, exist_ok=True)
        name = self.status_name()
        tmp = self.root / f".{name}.{os.getpid()}.tmp"  # several drivers (--only) may share a root
        tmp.write_text(text)
        os.replace(tmp, self.root / name)
        print(f"{stamp} {line}", flush=True)

    def seconds_left(self) -> float:
        if self.deadline is None:
            return float("inf")
        return (self.deadline - dt.datetime.now(dt.timezone.utc)).total_seconds()

    def headlab(self, argv: list[str], log: Path) -> int:
        """Run ``headlab ARGV`` with its output in ``log``; SIGINT at the deadline (checkpoint kept)."""
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a") as out:
            out.write(f"\n$ headlab {shlex.join(argv)}\n")
            out.flush()
            # SIGINT restored in the child: a driver started in the background (`... &`) inherits it
            # ignored, and the deadline's SIGINT would then not stop the training at a checkpoint.
            proc = subprocess.Popen([self.python, "-m", "headlab", *argv], stdout=out, stderr=subprocess.STDOUT,
                                    env=self.env, cwd=ROOT, preexec_fn=_default_sigint)
            while True:
                try:
                    return proc.wait(timeout=min(30.0, max(self.seconds_left(), 1.0)))
                except KeyboardInterrupt:  # the driver stopped by hand: the training too, at its checkpoint
                    proc.send_signal(signal.SIGINT)
                    proc.wait()
                    raise
                except subprocess.TimeoutExpired:
                    if self.seconds_left() > 0:
                        continue
                    proc.send_signal(signal.SIGINT)
                    try:
                        proc.wait(timeout=120)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
                    raise Deadline(f"deadline reached during headlab {' '.join(argv[:2])}") from None

    def result_file(self, config: dict) -> str:
        """The file whose presence says that ``config`` is finished (it is then skipped)."""
        return "eval.json"

    def run_one(self, config: dict) -> None:
        raise NotImplementedError

    def run_configs(self, configs: list[dict]) -> int:
        """Every configuration not yet finished, in order; one that fails does not stop the rest.
        0 when all are finished or the deadline stopped the driver, else 1."""
        self.done = [c["name"] for c in configs if (self.root / c["name"] / self.result_file(c)).is_file()]
        for config in configs:
            try:
                self.run_one(config)
            except Deadline as stop:
                self.status(f"stopped: {stop}; rerun the same command to resume")
                return 0
            except Exception as error:  # noqa: BLE001 - one failed configuration must not stop the rest
                self.status(f"FAILED {config['name']}: {error}")
                continue
            if self.seconds_left() < 60:
                self.status("stopped: deadline; rerun the same command to resume")
                return 0
        left = [c["name"] for c in configs if not (self.root / c["name"] / self.result_file(c)).is_file()]
        self.status("all configurations finished" if not left else f"finished with failures: {', '.join(left)}")
        return 0 if not left else 1
