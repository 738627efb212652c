"""The output directory of a command that writes its results once, at the end (``functions``,
``aggregate``, ``importance``): refused when it holds anything but an earlier headlab run's
results, written all at once, and listed in a manifest so that ``--overwrite`` removes only the
files headlab wrote.

``DIR/.headlab/files.json`` lists, relative to ``DIR``, every file the last run wrote. A
directory is taken when it is new or empty; one holding the files of that list only is taken
with ``--overwrite`` (the old files are removed once the new ones are in place, those the new run
writes again replaced); anything else in it (a file the user put there, a symlink, another
command's results) is refused, with or without ``--overwrite``, naming the files.

The results are first written whole into ``DIR/.headlab/incoming-*/`` (a full disk, a failure
or Ctrl-C there leaves ``DIR`` as it was), then renamed into place with Ctrl-C held back for the
few milliseconds of the renames, so an interrupted run keeps all of its results or none of them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import threading
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator

from headlab._version import __version__
from headlab.errors import HeadlabError, RunFailed
from headlab.heads import atomic_write_text, readable_as_umask_allows
from headlab.lock import LOCK_FILE, DirectoryLock, locked_output

__all__ = ["FILES", "check_output", "check_results_dir", "other_commands_results", "results_lock", "write_results",
           "written_note"]

FILES = Path(".headlab") / "files.json"


def _listed(directory: Path) -> dict | None:
    """The manifest of the run that wrote ``directory`` (None: none, or not one headlab wrote)."""
    try:
        record = json.loads((directory / FILES).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    files = record.get("files") if isinstance(record, dict) else None
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        return None
    return record


def _entries(directory: Path) -> list[str]:
    """Every file, symlink and other non-directory under ``directory`` (relative, sorted), less
    headlab's own ``.headlab/``; symlinks are not followed (a symlink is an entry itself)."""
    found = []
    for root, dirs, files in os.walk(directory):
        here = Path(root)
        if here == directory:
            dirs[:] = [d for d in dirs if d != LOCK_FILE.parent.name]
        for name in [d for d in dirs if (here / d).is_symlink()]:
            dirs.remove(name)
            files.append(name)
        found += [str((here / name).relative_to(directory)) for name in files]
    return sorted(found)


# Commands whose results may replace each other's under --overwrite (functions --aggregate writes
# what aggregate writes); any other pair is refused, so that --overwrite never removes a pruned
# model or importance scores to put another command's results in their place.
_SAME_RESULTS = ({"functions", "aggregate"},)


def _replaceable(recorded: str, command: str) -> bool:
    if recorded == command:
        return True
    return any({recorded, command} <= group for group in _SAME_RESULTS)


def other_commands_results(directory: str | os.PathLike, command: str, flag: str, where: str = "--out") -> str | None:
    """Why ``command`` may not write into ``directory`` (``where``: the option naming it, "" for
    none), or None: it holds the results of another command, listed in its manifest, which no
    flag of ``command`` (``flag``: ``--overwrite``, analyze's ``--force``, ``overwrite=True``)
    replaces. Shared by the commands of this module and by analyze and ``Analysis.save``."""
    directory = Path(directory)
    return _other_commands(directory, _listed(directory), command, flag, where)


def _other_commands(directory: Path, record: dict | None, command: str, flag: str, where: str) -> str | None:
    """:func:`other_commands_results` on the manifest ``record`` already read from ``directory``."""
    if record is None:
        return None
    recorded = record.get("command")
    if recorded is not None and _replaceable(recorded, command):
        return None
    files = record["files"]
    if not any(os.path.lexists(directory / name) for name in files):
        return None
    shown = ", ".join(files[:3]) + (", ..." if len(files) > 3 else "")
    return (f"{where + ' ' if where else ''}{directory}: holds the results of `headlab {recorded or '?'}` of "
            f"{record.get('model', '?')} ({shown}), not of `headlab {command}`; {flag} does not replace another "
            f"command's results: choose a new or empty directory")


def check_results_dir(directory: str | os.PathLike, overwrite: bool, flag: str = "--out",
                      command: str | None = None) -> None:
    """Refuse ``directory`` before any work (exit 2) unless it is new, empty, or (with
    ``overwrite``) holds an earlier headlab run's files only, of ``command`` (or one writing the
    same results) when it is given."""
    directory = Path(directory)
    if not directory.is_dir():
        return
    record = _listed(directory)  # read once: both checks below judge the same manifest
    # Another command's results first, with or without --overwrite: a hint to pass it would be refused.
    if command is not None and (why := _other_commands(directory, record, command, "--overwrite", flag)):
        raise HeadlabError(why)
    ours = set(record["files"]) if record else set()
    present = _entries(directory)
    foreign = [name for name in present if name not in ours]
    if foreign:
        shown = ", ".join(foreign[:5]) + (f", ... ({len(foreign)} in all)" if len(foreign) > 5 else "")
        raise HeadlabError(f"{flag} {directory}: holds files headlab did not write ({shown}); choose a new or "
                           f"empty directory (--overwrite replaces only the files of an earlier headlab run, "
                           f"listed in {FILES})")
    if present and not overwrite:
        assert record is not None  # present and none foreign: the manifest lists them
        raise HeadlabError(f"{flag} {directory}: holds the results of an earlier run ({record.get('command', '?')} "
                           f"of {record.get('model', '?')}, {record.get('created', '?')}); pass --overwrite to "
                           f"replace them, or choose another directory")


def check_output(directory: str | os.PathLike, overwrite: bool, flag: str = "--out", command: str | None = None) -> None:
    """Before any work (exit 2): no run is writing ``directory`` and it holds nothing but an
    earlier run's results (with ``overwrite``)."""
    # Under a launcher the main process (RANK 0) holds the lock for all: the others do not look.
    holder = DirectoryLock(directory, flag).held_elsewhere() if int(os.environ.get("RANK", "0") or 0) == 0 else None
    if holder is not None:
        raise HeadlabError(f"{flag} {directory} is in use by another headlab run (pid {holder.get('pid', '?')} on "
                           f"{holder.get('host', '?')}, since {holder.get('started', '?')}); wait for it to finish "
                           f"or choose another {flag}")
    check_results_dir(directory, overwrite, flag, command)


@contextmanager
def results_lock(directory: str | os.PathLike, overwrite: bool, main: bool, flag: str = "--out",
                 command: str | None = None) -> Iterator[None]:
    """The lock of ``directory``, held by the main process (the one that writes), with the check of
    what it holds made again under it (another run may have finished into it since)."""
    if not main:
        yield
        return
    with locked_output(directory, flag):
        check_results_dir(directory, overwrite, flag, command)
        yield


@contextmanager
def _interrupts_held() -> Iterator[None]:
    """Ctrl-C (and SIGTERM, where headlab.cli turned it into one) waits until the block is done (then
    raises as usual): renames are not cut halfway."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list = []
    previous = signal.signal(signal.SIGINT, lambda *_: caught.append(None))
    term = signal.getsignal(signal.SIGTERM)
    held_term = callable(term)  # a handler of headlab's (Python's default would end the process at once)
    if held_term:
        signal.signal(signal.SIGTERM, lambda *args: caught.append(args))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held_term:
            signal.signal(signal.SIGTERM, term)
    for args in caught:
        if args is not None and callable(term):
            term(*args)  # a SIGTERM, handed to its handler (headlab.cli's raises KeyboardInterrupt)
    if None in caught:
        raise KeyboardInterrupt


def _remove_empty_parents(path: Path, top: Path) -> None:
    parent = path.parent
    while parent != top:
        try:
            parent.rmdir()
        except OSError:
            return
        parent = parent.parent


def write_results(directory: str | os.PathLike, write: Callable[[Path], object], *, command: str, model: str,
                  overwrite: bool, flag: str = "--out") -> list[Path]:
    """``write(staging)`` writes every result file under a new directory; they are then moved
    into ``directory`` and listed in its manifest. Returns the files, as paths under ``directory``."""
    directory = Path(directory)
    meta = directory / FILES.parent
    meta.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=meta, prefix="incoming-"))
    try:
        returned = write(staging)
        readable_as_umask_allows(staging)
        new = _entries(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    record = _listed(directory)
    old = set(record["files"]) if record else set()
    # The directory was checked before the work; a run that finished into it since, or a file the
    # user put there meanwhile, is not replaced: the new results stay in the staging directory.
    clash = [name for name in new if name not in old and os.path.lexists(directory / name)]
    if other := _other_commands(directory, record, command, "--overwrite", flag):
        raise RunFailed(f"{other}; nothing was replaced, this run's results are kept in {staging}")
    if (old and not overwrite) or clash:
        raise RunFailed(f"{flag} {directory}: "
                        + (f"now holds {', '.join(clash[:5])}, not written by headlab" if clash
                           else "another run wrote its results there meanwhile (pass --overwrite to replace them)")
                        + f"; nothing was replaced, this run's results are kept in {staging}")
    header = {"headlab_version": __version__, "command": command, "model": model,
              "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    with _interrupts_held():
        # Listed before they are moved: a kill now leaves every file headlab may have written listed.
        atomic_write_text(directory / FILES, json.dumps({**header, "complete": False, "files": sorted(old | set(new))},
                                                        indent=1) + "\n")
        for name in new:
            target = directory / name
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(staging / name, target)
        for name in sorted(old - set(new)):
            path = directory / name
            if path.is_file() or path.is_symlink():
                path.unlink()
                _remove_empty_parents(path, directory)
        atomic_write_text(directory / FILES, json.dumps({**header, "complete": True, "files": new}, indent=1) + "\n")
        shutil.rmtree(staging, ignore_errors=True)
    # In the order ``write`` returned its paths, if it did (what the command prints).
    order = [str(Path(p).relative_to(staging)) for p in returned] if isinstance(returned, list) else []
    return [directory / name for name in dict.fromkeys([*(n for n in order if n in new), *new])]


def written_note(directory: str | os.PathLike) -> str:
    """What an interruption after :func:`write_results` kept, as the CLI's ``interrupted`` note
    (a format string over the arguments: braces of the path doubled)."""
    text = f"the results were written to {directory} in full before the interruption"
    return text.replace("{", "{{").replace("}", "}}")
