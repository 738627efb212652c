"""Corpora split over processes: ``--num-processes N`` and ``accelerate launch``.

``headlab importance``, ``functions``, ``aggregate`` and ``analyze`` run in several processes
(local CPU processes, GPUs, machines) when started by ``accelerate launch`` or ``torchrun``, or
with ``--num-processes N``, which starts N local processes itself (:func:`launch`: the same
command, with the environment torchrun sets). Every process reads the whole corpus and forms the
same batches as a one-process run; batch ``i`` is computed by process ``i % N``
(:meth:`Shard.take`). Only the main process writes.

The results are identical to a one-process run's, to the bit. Float addition is not
associative, so per-process subtotals added at the end would differ from the one-process sums in
their last bits; instead a float sum is a :class:`Ledger`: a one-process run adds each batch's
part to the running total as the batch is done, and a sharded run keeps its batches' parts
(per-head sums, small), gathers them and adds them in batch order, the same additions from the
same start. Integer counts (and sums that are exact, such as a table whose rows each come from
one process) are added over the processes in rank order (:meth:`Shard.sum`); what is not a sum
(exemplars, translations, problems) is gathered and merged by sentence (:meth:`Shard.gather`).

A computation opts in by reading :func:`active` (set by the commands with :func:`sharding`);
everything else runs whole in every process, as before.
"""

from __future__ import annotations

import atexit
import gc
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from headlab.errors import HeadlabError, RunFailed, Terminated, counted

__all__ = ["Ledger", "Shard", "SINGLE", "active", "add_process_options", "before_joining", "check_processes", "launch",
           "leave_process_group_at_exit", "new_accelerator", "sharding", "start", "watch_launcher", "world_size"]

FLAG = "--num-processes"
LAUNCHER = "HEADLAB_LAUNCHER_PID"  # set by launch() in each process it starts: the pid to outlive no longer


@dataclass(frozen=True)
class Shard:
    """This process's place among ``world`` processes (``rank`` 0 is the main one)."""

    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def split(self) -> bool:
        return self.world > 1

    def owns(self, index: int) -> bool:
        """Batch ``index`` is computed here."""
        return index % self.world == self.rank

    def take(self, items: Iterable) -> Iterator:
        """This process's items (batches) of ``items``: every ``world``-th from ``rank`` on."""
        for _, item in self.numbered(items):
            yield item

    def numbered(self, items: Iterable) -> Iterator[tuple[int, Any]]:
        """:meth:`take` with each item's number among all of ``items`` (its batch number)."""
        for index, item in enumerate(items):
            if self.owns(index):
                yield index, item

    def count(self, n: int) -> int:
        """How many of ``n`` batches :meth:`take` gives this process."""
        return len(range(self.rank, n, self.world))

    def gather(self, value) -> list:
        """Every process's ``value``, in rank order (on every process)."""
        if not self.split:
            return [value]
        import torch.distributed as dist

        values = [None] * self.world
        dist.all_gather_object(values, value)
        return values

    def sum(self, value):
        """``value`` (tensors, arrays, numbers, Counters, nested in dicts, lists and tuples) added
        over the processes in rank order; a dict key one process lacks counts as zero. Exact for
        counts, not for float sums that several processes add to (a :class:`Ledger` is)."""
        if not self.split:
            return value
        parts = self.gather(_to_cpu(value))
        total = parts[0]
        for part in parts[1:]:
            total = _add(total, part)
        return _like(total, value)

    def broadcast(self, value):
        """The main process's ``value``, on every process."""
        return self.gather(value)[0] if self.split else value

    def barrier(self) -> None:
        if self.split:
            import torch.distributed as dist

            dist.barrier()


SINGLE = Shard()
_active = SINGLE


class Ledger:
    """A running sum fed one part per batch (and block), that a sharded run adds as one process does.

    ``start`` is the total before the first batch (zeros, an empty dict); :meth:`add` gives a
    batch's part (tensors, arrays, numbers, nested in dicts, lists and tuples; a dict key the
    total lacks starts at the part) with its ``order``, the batch's place in the one-process run
    (its number, or its first sentence's). In one process each part is added at once, ``total =
    total + part``; in a sharded run the parts are kept (on the CPU) and :meth:`total` (called in
    every process) gathers them and adds them in ``order`` from ``start``: the same additions of
    the same numbers in the same order, so the same bits. Parts of one order (a batch's blocks)
    keep the order they were added in. What is kept: one part per batch of this process; parts
    should be per-head sums, never anything as large as a batch's attention."""

    def __init__(self, shard: Shard, start) -> None:
        self._start = start  # its tensors' devices are where the gathered total goes back to
        self._total = _to_cpu(start) if shard.split else start
        self._parts: list[tuple] | None = [] if shard.split else None  # None: added as they come
        self._shard = shard
        self._gathered = False

    def add(self, order, part) -> None:
        if self._gathered:
            raise RuntimeError("a part added to a ledger whose total was gathered")
        if self._parts is None:
            self._total = _add(self._total, part)
        else:
            self._parts.append((order, _to_cpu(part)))

    def total(self):
        """The sum over every batch; in a sharded run the first call (made in every process)
        gathers and adds every process's parts, and a ledger so totalled takes no more parts."""
        if self._parts is not None:
            parts = [item for items in self._shard.gather(self._parts) for item in items]
            for _, part in sorted(parts, key=lambda item: item[0]):  # stable: a batch's blocks keep their order
                self._total = _add(self._total, part)
            self._total = _like(self._total, self._start)
            self._parts, self._gathered = None, True
        return self._total


def active() -> Shard:
    """The shard set by :func:`sharding` (one process when none is)."""
    return _active


@contextmanager
def sharding(shard: Shard):
    """Within the block, the computations that support it split their batches by ``shard``."""
    global _active
    previous, _active = _active, shard
    try:
        yield shard
    finally:
        _active = previous


def _to_cpu(value):
    """``value`` with its tensors on the CPU (gloo and the sums below work there)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, Counter):
        return value
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _add(a, b):
    """``a + b`` through dicts (a key only one has counts as zero), lists and tuples."""
    if isinstance(a, Counter):
        total = Counter(a)
        total.update(b)  # keeps counts that add to zero, unlike Counter + Counter
        return total
    if isinstance(a, dict):
        out = dict(a)
        for key, value in b.items():
            out[key] = _add(out[key], value) if key in out else value
        return out
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            raise ValueError(f"cannot add sequences of lengths {len(a)} and {len(b)} across processes")
        return type(a)(_add(x, y) for x, y in zip(a, b))
    return a + b


def _like(total, value):
    """``total`` with its tensors back on the devices of ``value``'s."""
    import torch

    if isinstance(value, torch.Tensor):
        return total.to(value.device)
    if isinstance(value, dict) and not isinstance(value, Counter):
        return {k: _like(v, value[k]) if k in value else v for k, v in total.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_like(t, v) for t, v in zip(total, value))
    return total


# ----------------------------------------------------------------------------- the commands


def add_process_options(parser) -> None:
    """``--num-processes N`` of the commands that shard their corpus."""
    parser.add_argument(FLAG, type=int, metavar="N",
                        help="split the corpus over N local processes, started here (results equal one "
                             "process's); on several GPUs or machines use `accelerate launch` instead "
                             "(docs/cli.md)")


def world_size() -> int:
    """The number of processes a launcher (``accelerate launch``, ``torchrun``) started, 1 if none."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def check_processes(args, count: Callable[[], tuple[int, str, str]]) -> int:
    """The number of processes the command runs in, checked before any work: ``--num-processes``
    at least 1, agreeing with a launcher's, and not more than ``count()`` (the sentences, what one
    is and where they are, e.g. ``(3, "sentence", "of --conllu FILE")``)."""
    asked = getattr(args, "num_processes", None)
    launched = world_size()
    if asked is not None and asked < 1:
        raise HeadlabError(f"{FLAG} must be at least 1, got {asked}")
    if asked is not None and launched > 1 and asked != launched:
        raise HeadlabError(f"{FLAG} {asked}, but the launcher started {counted(launched, 'process', 'processes')}: "
                           "give one or the other")
    n = max(asked or 1, launched)
    if n > 1 and getattr(args, "device_map", None):
        raise HeadlabError(f"--device-map spreads one model over the devices; with several processes give "
                           f"--device cuda instead (each process its own GPU), or drop {FLAG}")
    if n > 1:
        sentences, noun, where = count()
        if n > sentences:
            flag = FLAG if asked else "the launcher's --num_processes"
            raise HeadlabError(f"{flag} {n}: more processes than the {counted(sentences, noun)} {where}; "
                               "use at most one process per sentence")
    return n


def start(args, count: Callable[[], tuple[int, str, str]]) -> int | None:
    """Before any work: check the processes (:func:`check_processes`); with ``--num-processes N > 1``
    outside a launcher, run the command in N processes and return its exit status; None when this
    process is to do the work (one process, or one of a launcher's)."""
    n = check_processes(args, count)
    if n > 1 and world_size() == 1:
        return launch(getattr(args, "argv", None) or sys.argv[1:], n)
    return None


@contextmanager
def joined(device: str | None = None):
    """This process's :class:`Shard` while the block runs, active for the computations
    (:func:`sharding`); under a launcher it joins the process group first (gloo on the CPU,
    nccl on GPUs) through Accelerate."""
    if world_size() == 1:
        yield SINGLE
        return
    from accelerate import PartialState

    before_joining()
    state = PartialState(cpu=device is None or str(device).startswith("cpu"))
    if not state.is_main_process:  # one progress bar per run, the main process's
        from transformers.utils import logging

        logging.disable_progress_bar()
    with sharding(Shard(state.process_index, state.num_processes)) as shard:
        yield shard


def before_joining() -> None:
    """What a launched process does before it joins the process group (the CPU's gloo or the
    GPUs' nccl), so that the group is gone before the interpreter exits:

    * import ``torch.distributed.nn`` now: its collectives take ``group=group.WORLD`` as a default
      argument, evaluated at import. Imported after the group was made (``from_pretrained``
      imports it), those ten defaults kept the group alive past ``destroy_process_group``;
    * destroy the group at exit (registered once per process, however many commands it runs).

    Left alive, the group's gloo threads were torn down by the C++ static destructors while
    joinable: about 1 two-process run in 15 to 60 aborted at its end ("terminate called without
    an active exception", exit status -6), after writing its results."""
    import torch.distributed.nn  # noqa: F401

    leave_process_group_at_exit()


def leave_process_group_at_exit() -> None:
    """Destroy the process group before the interpreter exits (registered once per process)."""
    atexit.unregister(_leave_process_group)
    atexit.register(_leave_process_group)


def new_accelerator():
    """``accelerate.Accelerator()`` for the trainers, made after :func:`before_joining` in a
    launched process."""
    from accelerate import Accelerator

    if world_size() > 1:
        before_joining()
    return Accelerator()


def _leave_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        gc.collect()  # a reference cycle that holds the group frees it now, not in the interpreter's teardown


def rank_device(device: str | None, shard: Shard) -> str | None:
    """``--device cuda`` in a launched process: this process's own GPU (``cuda:LOCAL_RANK``)."""
    if shard.split and device == "cuda":
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0') or 0)}"
    return device


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(argv: list[str], n: int, command: list[str] | None = None) -> int:
    """Run ``headlab ARGV`` (or ``command``) in ``n`` local processes, as torchrun would (``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), and return the first failing
    exit status (0 when all succeed). When one process fails, the others are stopped: they would
    wait for it."""
    port = _free_port()
    # The processes run this headlab (not another one on the path), and share the cores.
    source = str(Path(__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (source, os.environ.get("PYTHONPATH")) if p)
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // n))
    children = []
    for rank in range(n):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n),
                   GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=path,
                   OMP_NUM_THREADS=threads, **{LAUNCHER: str(os.getpid())})
        children.append(subprocess.Popen(command or [sys.executable, "-m", "headlab", *argv], env=env))
    status, failure = 0, None
    try:
        while True:
            codes = [child.poll() for child in children]
            failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                failure = failed[0]
                status = failure[1]
                break
            if None not in codes:
                break
            time.sleep(0.1)
    except KeyboardInterrupt as interrupt:  # SIGTERM (headlab.cli's handler) exits 143, as one process does
        status = 143 if isinstance(interrupt, Terminated) else 130
    finally:
        for child in children:
            if child.poll() is None:
                child.terminate()
        for child in children:
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
    if status == 0:
        failure = next(((rank, child.returncode) for rank, child in enumerate(children) if child.returncode), None)
        status = failure[1] if failure else 0
    if failure is not None:
        rank, code = failure
        if code < 0:  # killed by a signal: it could say nothing itself (and -9 would be exit 247)
            raise RunFailed(f"process rank {rank} of {n} was killed by {_signal_name(-code)}; the others were "
                            "stopped and nothing was kept")
        print(f"headlab: process rank {rank} of {n} failed (exit {code}, its message is above); "
              "the others were stopped", file=sys.stderr)
    return status


def _signal_name(number: int) -> str:
    try:
        return f"{signal.Signals(number).name} (signal {number})"
    except ValueError:
        return f"signal {number}"


def watch_launcher(interval: float = 0.2) -> None:
    """In a process started by :func:`launch`: end it when the launcher is gone (killed with -9,
    say), rather than computing on for nobody. A daemon thread watches the parent pid; when it
    changes (the process was handed to init or a subreaper), the process exits at once, status 1.
    Nothing is lost: only the launcher's main process writes, and only at the end."""
    launcher = os.environ.get(LAUNCHER)
    if not launcher or not launcher.isdigit():
        return

    def watch() -> None:
        while os.getppid() == int(launcher):
            time.sleep(interval)
        rank = os.environ.get("RANK", "?")
        try:
            print(f"headlab: process rank {rank}: its launcher (pid {launcher}) is gone; stopping", file=sys.stderr)
        finally:
            os._exit(1)

    threading.Thread(target=watch, name="headlab-launcher-watch", daemon=True).start()
