"""Checks a command makes before any work starts (docs/cli.md): inputs readable and not empty,
output places writable, options in range. Each failure is a :class:`HeadlabError` (exit 2)
naming the option and the path, so that no model is loaded and nothing is computed for a run
that could not have finished.
"""

from __future__ import annotations

import gzip
import os
import re
import stat
import tempfile
from pathlib import Path

from headlab.errors import HeadlabError

__all__ = ["input_file", "output_dir", "output_file", "at_least", "query_chunk", "model_dir", "stream_bytes",
           "text_problem"]

HEAD = 1 << 16
"""How much of a text file the checks look at (its encoding and line ends)."""

_STREAMS: dict[str, bytes] = {}

# Byte order marks of the encodings headlab does not read (longest first: UTF-32LE's starts with UTF-16LE's).
_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32LE"), (b"\x00\x00\xfe\xff", "UTF-32BE"), (b"\xff\xfe", "UTF-16LE"),
         (b"\xfe\xff", "UTF-16BE"))


def stream_bytes(path: str | os.PathLike) -> bytes | None:
    """The whole content of an input that is a pipe or a device (``/dev/stdin``, ``<(cmd)``,
    ``/dev/null``), read once and kept, so that the check before work and the reader after it see
    the same bytes (a pipe cannot be read twice); decompressed for a ``.gz`` name. None for a
    regular file (read from disk as usual) or a path that is not there."""
    key = os.fspath(path)
    if key in _STREAMS:
        return _STREAMS[key]
    try:
        mode = os.stat(key).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    with open(key, "rb") as handle:
        data = handle.read()
    if key.endswith(".gz"):
        data = gzip.decompress(data)
    _STREAMS[key] = data
    return data


GZIP_MAGIC = b"\x1f\x8b"  # RFC 1952, 2.3.1: ID1, ID2


def text_problem(head: bytes) -> str | None:
    """What makes the start of a text file unreadable as UTF-8 lines, or None: another Unicode
    encoding (its byte order mark, or the NUL bytes UTF-16/32 put beside ASCII characters) or
    line ends that are a CR alone (classic Mac OS), which would make the whole file one line."""
    if head.startswith(GZIP_MAGIC):  # else "NUL bytes: not a UTF-8 text file" or a bad byte, which hid the cause
        return "the file is gzip-compressed, yet its name does not end in .gz (only those are decompressed); " \
               "rename it to end in .gz, or decompress it"
    for bom, name in _BOMS:
        if head.startswith(bom):
            return f"the file is {name} (it starts with that byte order mark), not UTF-8; convert it first, e.g. " \
                   f"`iconv -f {name} -t UTF-8 FILE > FILE.utf8`"
    nuls = head.count(b"\x00")
    if nuls:
        guess = _unicode_without_bom(head)
        if guess is None:
            line = head.count(b"\n", 0, head.index(b"\x00")) + 1
            return f"the file holds NUL bytes ({nuls} in its first {len(head)} bytes, the first on line {line}): " \
                   "not a UTF-8 text file"
        return f"the file looks like {guess} without a byte order mark (NUL bytes beside its characters), not " \
               f"UTF-8; convert it first, e.g. `iconv -f {guess} -t UTF-8 FILE > FILE.utf8`"
    if b"\r" in head and b"\n" not in head:
        return "its lines end in a CR alone (classic Mac OS line ends), which would read the whole file as one " \
               "line; convert them first, e.g. `tr '\\r' '\\n' < FILE > FILE.unix`"
    return None


# A line end in each encoding headlab names: the evidence, beside the NULs' places, that a file is in it.
_NEWLINES = {"UTF-32LE": b"\n\x00\x00\x00", "UTF-32BE": b"\x00\x00\x00\n", "UTF-16LE": b"\n\x00",
             "UTF-16BE": b"\x00\n"}


def _unicode_without_bom(head: bytes) -> str | None:
    """The UTF-16 or UTF-32 encoding ``head`` is in, or None: its NULs all where that encoding puts them
    beside a character, and a line end of that encoding in its place. The places alone named a UTF-8 file
    with one stray NUL "UTF-16LE", and iconv from UTF-16 would have turned it into garbage."""
    at = [bool(head[i::4].count(b"\x00")) for i in range(4)]  # NULs at offsets 0..3 mod 4
    if at == [False, True, True, True]:
        guess = "UTF-32LE"
    elif at == [True, True, True, False]:
        guess = "UTF-32BE"
    elif not at[0] and not at[2]:
        guess = "UTF-16LE"
    elif not at[1] and not at[3]:
        guess = "UTF-16BE"
    else:
        return None
    newline = _NEWLINES[guess]
    aligned = (match.start() % len(newline) == 0 for match in re.finditer(re.escape(newline), head))
    return guess if any(aligned) else None


def input_file(path: str | os.PathLike, flag: str, *, allow_empty: bool = False) -> Path:
    """``path`` is a readable file (plain or ``.gz``), or a pipe (``/dev/stdin``, ``<(cmd)``),
    holding at least one non-blank character, in UTF-8 with LF or CRLF line ends."""
    if not os.fspath(path):  # Path("") is the current directory
        raise HeadlabError(f"{flag}: the path is empty")
    path = Path(path)
    if not path.exists():
        raise HeadlabError(f"{flag} {path}: no such file")
    if path.is_dir():
        raise HeadlabError(f"{flag} {path}: a directory, not a file")
    try:
        stream = stream_bytes(path)
        if stream is not None:
            head, chunk = stream[:HEAD], stream.strip()[:1]
        else:
            opener = gzip.open if path.suffix == ".gz" else open
            with opener(path, "rb") as handle:
                head = chunk = handle.read(HEAD)
                while chunk and not chunk.strip():
                    chunk = handle.read(HEAD)
    except gzip.BadGzipFile:  # "Not a gzipped file (b'Th')" did not say what to do
        raise HeadlabError(f"{flag} {path}: its name ends in .gz, yet it is not gzip-compressed; rename it without "
                           ".gz, or compress it") from None
    except (OSError, EOFError) as error:  # unreadable, or a truncated .gz
        raise HeadlabError(f"{flag} {path}: cannot read it ({getattr(error, 'strerror', None) or error})") from None
    problem = text_problem(head)
    if problem is not None:
        raise HeadlabError(f"{flag} {path}: {problem}")
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


def output_file(path: str | os.PathLike, flag: str = "--output",
                inputs: "dict[str, str | os.PathLike] | None" = None) -> Path:
    """``path`` is a file that can be (over)written, in a directory that exists or can be made,
    and none of ``inputs`` (``{flag: path}``): writing an input would destroy it."""
    path = Path(path)
    if path.is_dir():
        raise HeadlabError(f"{flag} {path}: a directory, not a file")
    for input_flag, input_path in (inputs or {}).items():
        if path.exists() and Path(input_path).exists() and os.path.samefile(path, input_path):
            raise HeadlabError(f"{flag} {path}: the same file as {input_flag} {input_path}; writing it would "
                               "destroy the input")
    if path.exists() and not os.access(path, os.W_OK):
        raise HeadlabError(f"{flag} {path}: the file is read-only")
    _probe(path.parent if path.parent.exists() else _existing_parent(path, flag), flag, path)
    return path


def at_least(value: int | float | None, minimum: int | float, flag: str) -> None:
    """An option that must be at least ``minimum`` (``None``: not given, fine)."""
    if value is not None and value < minimum:
        raise HeadlabError(f"{flag} must be at least {minimum}, got {value}")


def query_chunk(value: int | None) -> None:
    """``--query-chunk``: None (whole attention maps) or at least one query row per chunk; every
    command and option class that takes it checks it here."""
    if value is not None and value < 1:
        raise HeadlabError(f"--query-chunk must be at least 1 (query rows per chunk), got {value}")


def model_dir(name: str, flag: str = "model") -> None:
    """A local model path exists and is a directory (a hub id is left to the loader)."""
    path = Path(name)
    if path.exists() and not path.is_dir():
        raise HeadlabError(f"{flag} {name}: a file, not a model directory")
    if not path.exists() and (name.startswith((".", "/", "~")) or name.count("/") > 1):  # not a hub id
        raise HeadlabError(f"{flag} {name}: no such directory")
