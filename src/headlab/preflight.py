"""Checks a command makes before any work starts (docs/cli.md): inputs readable and not empty,
output places writable, options in range. Each failure is a :class:`HeadlabError` (exit 2)
naming the option and the path, so that no model is loaded and nothing is computed for a run
that could not have finished.
"""

from __future__ import annotations

import gzip
import os
import tempfile
from pathlib import Path

from headlab.errors import HeadlabError

__all__ = ["input_file", "output_dir", "output_file", "at_least", "model_dir"]


def input_file(path: str | os.PathLike, flag: str, *, allow_empty: bool = False) -> Path:
    """``path`` is a readable file (plain or ``.gz``) holding at least one non-blank character."""
    path = Path(path)
    if not path.exists():
        raise HeadlabError(f"{flag} {path}: no such file")
    if path.is_dir():
        raise HeadlabError(f"{flag} {path}: a directory, not a file")
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rb") as handle:
            while True:
                chunk = handle.read(1 << 16)
                if not chunk or chunk.strip():
                    break
    except (OSError, EOFError) as error:  # unreadable, or a .gz that is not gzip
        raise HeadlabError(f"{flag} {path}: cannot read it ({getattr(error, 'strerror', None) or error})") from None
    if not chunk and not allow_empty:
        raise HeadlabError(f"{flag} {path}: the file is empty")
    return path


def _probe(directory: Path, flag: str, shown: Path) -> None:
    """Create and remove a file in ``directory``: the only test that holds for root, ACLs and
    read-only file systems alike."""
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".headlab-probe-"):
            pass
    except OSError as error:
        raise HeadlabError(f"{flag} {shown}: cannot write in {directory} ({error.strerror or error})") from None


def _existing_parent(path: Path, flag: str) -> Path:
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise HeadlabError(f"{flag} {path}: {parent} is a file, not a directory")
    return parent


def output_dir(path: str | os.PathLike, flag: str = "--out") -> Path:
    """``path`` is a writable directory, or can be created as one. Nothing is created here."""
    path = Path(path)
    if path.exists():
        if not path.is_dir():
            raise HeadlabError(f"{flag} {path}: exists and is not a directory")
        _probe(path, flag, path)
    else:
        _probe(_existing_parent(path, flag), flag, path)
    return path


def output_file(path: str | os.PathLike, flag: str = "--output") -> Path:
    """``path`` is a file that can be (over)written, in a directory that exists or can be made."""
    path = Path(path)
    if path.is_dir():
        raise HeadlabError(f"{flag} {path}: a directory, not a file")
    if path.exists() and not os.access(path, os.W_OK):
        raise HeadlabError(f"{flag} {path}: the file is read-only")
    _probe(path.parent if path.parent.exists() else _existing_parent(path, flag), flag, path)
    return path


def at_least(value: int | float | None, minimum: int | float, flag: str) -> None:
    """An option that must be at least ``minimum`` (``None``: not given, fine)."""
    if value is not None and value < minimum:
        raise HeadlabError(f"{flag} must be at least {minimum}, got {value}")


def model_dir(name: str, flag: str = "model") -> None:
    """A local model path exists and is a directory (a hub id is left to the loader)."""
    path = Path(name)
    if path.exists() and not path.is_dir():
        raise HeadlabError(f"{flag} {name}: a file, not a model directory")
    if not path.exists() and (name.startswith((".", "/", "~")) or name.count("/") > 1):  # not a hub id
        raise HeadlabError(f"{flag} {name}: no such directory")
