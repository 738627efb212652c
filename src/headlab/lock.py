"""One run at a time per output directory: ``DIR/.headlab/lock``.

A second ``analyze`` or ``prune sweep`` pointed at a directory another one is writing would
interleave its files with the first one's; it refuses instead, naming the run that holds the
lock. The lock file records the holder's host, pid and (on Linux) the pid's start time, so a
lock left behind by a run that crashed or was killed is recognised as stale and taken over.
"""

from __future__ import annotations

import json
import os
import socket
from contextlib import contextmanager, nullcontext
from datetime import datetime, timezone
from pathlib import Path
from typing import ContextManager, Iterator

from headlab.errors import HeadlabError

__all__ = ["DirectoryLock", "LOCK_FILE", "locked_output", "training_lock"]

LOCK_FILE = Path(".headlab") / "lock"


def _start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (tells a live holder from a new process with its pid)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22 of proc(5), counted after the comm field


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


class DirectoryLock:
    """``with DirectoryLock(out, "--out"):`` holds ``out`` for this process; re-entrant per process."""

    def __init__(self, directory: str | os.PathLike, flag: str = "--out") -> None:
        self.directory, self.flag = Path(directory), flag
        self.path = self.directory / LOCK_FILE
        self._held = False

    def _holder(self) -> dict | None:
        try:
            holder = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # being written right now, or garbage: treat as held unless old (below)
        valid = isinstance(holder, dict) and type(holder.get("pid")) is int
        return holder if valid else {}

    def _stale(self, holder: dict) -> bool:
        if not holder:  # unreadable: stale once it is older than a writer could take
            try:
                return datetime.now().timestamp() - self.path.stat().st_mtime > 60
            except FileNotFoundError:
                return True
        if holder.get("host") != socket.gethostname():
            return False  # cannot tell for another machine: the user decides
        pid = holder["pid"]
        if pid == os.getpid():
            return False
        if pid <= 0 or not _alive(pid):
            return True
        started = holder.get("pid_start")
        return started is not None and _start_time(pid) not in (None, started)

    def held_elsewhere(self) -> dict | None:
        """The holder's record when another live run (or a run on another machine) holds the
        lock; None when it is free, stale (its run crashed or was killed) or this process's."""
        holder = self._holder()
        if holder is None or (holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname()):
            return None
        return None if self._stale(holder) else holder

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = {"pid": os.getpid(), "host": socket.gethostname(), "pid_start": _start_time(os.getpid()),
                  "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is None:
                    continue  # released between our two looks
                if holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
                    return  # this process holds it already (a command calling another)
                if not self._stale(holder):
                    raise HeadlabError(
                        f"{self.flag} {self.directory} is in use by another headlab run (pid {holder.get('pid', '?')} "
                        f"on {holder.get('host', '?')}, since {holder.get('started', '?')}); wait for it to finish "
                        f"or choose another {self.flag}. If no such run is going, delete {self.path}") from None
                if self._holder() == holder:  # still the crashed run's lock (not a newer run's): take it over
                    self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                json.dump(record, handle)
            self._held = True
            return
        raise HeadlabError(f"{self.flag} {self.directory}: cannot take the lock {self.path}; try again")

    def release(self) -> None:
        if self._held:
            self._held = False
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> "DirectoryLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


@contextmanager
def locked_output(directory: str | os.PathLike, flag: str = "--out") -> Iterator[None]:
    """Create ``directory`` if need be and hold its lock. A run refused after that (a check that
    needs the model, say) leaves no empty directory behind that it created: neither ``directory``
    nor, in a ``directory`` that existed, its ``.headlab/``."""
    directory = Path(directory)
    # made here (an existing .headlab/ holds an earlier run's manifest, or another run's lock)
    created = [path for path in (directory / LOCK_FILE.parent, directory) if not path.exists()]
    directory.mkdir(parents=True, exist_ok=True)
    try:
        with DirectoryLock(directory, flag):
            yield
    finally:
        for empty in created:
            try:
                empty.rmdir()  # only if empty: a run that wrote anything keeps it
            except OSError:
                break


def training_lock(directory: str | os.PathLike, flag: str = "--out") -> ContextManager[None]:
    """The lock of a training run's output directory, held by the main process only: under
    ``accelerate launch``/``torchrun`` every rank runs the command, and the other ranks (``RANK``
    > 0) write only through the main one."""
    if int(os.environ.get("RANK", "0") or 0) > 0:
        return nullcontext()
    return locked_output(directory, flag)
