"""Parallel text: two line-aligned files (plain or gzipped), one sentence per line.

Errors are :class:`~headlab.errors.HeadlabError` with the file (and line) to fix, because a
corpus that loads wrongly would silently spoil every statistic computed from it.
"""

from __future__ import annotations

import gzip
import io
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from headlab.errors import HeadlabError, counted
from headlab.preflight import HEAD, stream_bytes, text_problem

__all__ = ["ParallelCorpus", "first_sentences", "read_lines", "read_parallel"]


@dataclass(frozen=True)
class ParallelCorpus:
    """Sentence pairs with what loading did to them.

    ``n_empty`` counts the pairs dropped because either side was empty (after stripping);
    ``n_truncated`` counts the pairs in which at least one side was cut to ``max_tokens``
    whitespace-separated tokens.
    """

    sources: list[str]
    targets: list[str]
    source_path: str = ""
    target_path: str = ""
    n_empty: int = 0
    n_truncated: int = 0
    max_tokens: int | None = None
    line_numbers: list[int] = field(default_factory=list, repr=False)

    def __len__(self) -> int:
        return len(self.sources)

    def __iter__(self):
        return iter(zip(self.sources, self.targets))

    def subset(self, n: int) -> "ParallelCorpus":
        """The first ``n`` pairs (for tests and quick runs)."""
        return ParallelCorpus(
            self.sources[:n], self.targets[:n], self.source_path, self.target_path,
            self.n_empty, self.n_truncated, self.max_tokens, self.line_numbers[:n],
        )

    def summary(self) -> str:
        text = f"{counted(len(self), 'sentence pair')} from {self.source_path} / {self.target_path}"
        if self.n_empty:
            text += f"; {counted(self.n_empty, 'pair')} with an empty side skipped"
        if self.n_truncated:
            text += f"; {counted(self.n_truncated, 'pair')} truncated to {counted(self.max_tokens or 0, 'token')}"
        return text


def open_binary(path: Path):
    """``path`` (plain or ``.gz``) opened in binary mode: the readers decode each line themselves,
    so that an error can name the line with the bad bytes. A pipe (``/dev/stdin``, ``<(cmd)``) is
    read once, whole (:func:`headlab.preflight.stream_bytes`)."""
    stream = stream_bytes(path)
    if stream is not None:
        return io.BytesIO(stream)
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def stdin_lines() -> list[str]:
    """The lines of standard input, read as bytes and checked like a file's (``<stdin>`` in errors)."""
    import sys

    buffer = getattr(sys.stdin, "buffer", None)
    if buffer is None:  # replaced by a text stream (tests, notebooks): already decoded
        return [line.rstrip("\r\n") for line in sys.stdin]
    return _decoded(_split(io.BytesIO(buffer.read()), Path("<stdin>")), Path("<stdin>"))


def _split(handle, path: Path) -> Iterator[tuple[int, bytes]]:
    problem = text_problem(handle.read(HEAD))
    if problem is not None:
        raise HeadlabError(f"{path}: {problem}")
    handle.seek(0)
    for number, raw in enumerate(handle, start=1):
        yield number, raw[3:] if number == 1 and raw.startswith(b"\xef\xbb\xbf") else raw


def numbered_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """``(1-based line number, raw line)`` of a text file, a UTF-8 byte order mark dropped (it is
    not part of the first sentence); an unreadable file (or a ``.gz`` that is not gzip), one in
    UTF-16 or UTF-32, or one whose lines end in a CR alone is an error naming the file."""
    try:
        with open_binary(path) as handle:
            yield from _split(handle, path)
    except gzip.BadGzipFile:
        raise HeadlabError(f"cannot read {path}: its name ends in .gz, yet it is not gzip-compressed; rename it "
                           "without .gz, or compress it") from None
    except (OSError, EOFError) as error:
        raise HeadlabError(f"cannot read {path}: {error}") from None


def read_lines(path: str | Path) -> list[str]:
    """All lines of a UTF-8 text file (plain or ``.gz``), without line ends.

    CRLF line ends and a UTF-8 byte order mark are dropped. Raises HeadlabError naming the
    file if it is missing, and the file and 1-based line number if a line is not valid UTF-8.
    """
    path = Path(path)
    if not path.exists():  # a pipe or /dev/stdin is not a regular file, and is read all the same
        raise HeadlabError(f"file not found: {path}")
    if path.is_dir():
        raise HeadlabError(f"{path}: a directory, not a file")
    return _decoded(numbered_lines(path), path)


def first_sentences(lines: Sequence[str], n: int | None, aligned: Sequence[str] | None = None) -> int:
    """How many of ``lines`` hold their first ``n`` sentences (``--limit N``; all of them when
    ``n`` is None): a blank line is no sentence, nor is a line whose ``aligned`` line (the
    reference translation) is blank, so ``--limit N`` counts sentences, not lines."""
    if n is None:
        return len(lines)
    found = 0
    for end, line in enumerate(lines, start=1):
        if line.strip() and (aligned is None or aligned[end - 1].strip()):
            found += 1
            if found == n:
                return end
    return len(lines)


def _decoded(numbered: Iterator[tuple[int, bytes]], path: Path) -> list[str]:
    lines: list[str] = []
    for number, raw in numbered:
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise HeadlabError(
                f"{path}, line {number}: not valid UTF-8 ({error.reason} at byte {error.start})"
            ) from None
        lines.append(line.rstrip("\r\n"))
    return lines


def _truncate(sentence: str, max_tokens: int | None) -> tuple[str, bool]:
    if max_tokens is None:
        return sentence, False
    tokens = sentence.split()
    if len(tokens) <= max_tokens:
        return sentence, False
    return " ".join(tokens[:max_tokens]), True


def read_parallel(
    source_path: str | Path,
    target_path: str | Path,
    *,
    max_tokens: int | None = None,
    allow_empty: bool = False,
) -> ParallelCorpus:
    """Read a line-aligned parallel corpus.

    Pairs where either side is empty (or only whitespace) are skipped and counted. With
    ``max_tokens`` each side is cut to that many whitespace-separated tokens and the number of
    pairs cut is counted. Differing line counts, a missing file, a non-UTF-8 line and (unless
    ``allow_empty``) a corpus with no pair left are errors.
    """
    if max_tokens is not None and max_tokens < 1:
        raise HeadlabError(f"max_tokens must be at least 1, got {max_tokens}")
    source_path, target_path = Path(source_path), Path(target_path)
    source_lines = read_lines(source_path)
    target_lines = read_lines(target_path)
    if len(source_lines) != len(target_lines):
        raise HeadlabError(
            f"parallel files differ in length: {source_path} has {counted(len(source_lines), 'line')}, "
            f"{target_path} has {counted(len(target_lines), 'line')}"
        )
    sources: list[str] = []
    targets: list[str] = []
    numbers: list[int] = []
    n_empty = n_truncated = 0
    for number, (source, target) in enumerate(zip(source_lines, target_lines), start=1):
        source, target = source.strip(), target.strip()
        if not source or not target:
            n_empty += 1
            continue
        source, cut_source = _truncate(source, max_tokens)
        target, cut_target = _truncate(target, max_tokens)
        n_truncated += cut_source or cut_target
        sources.append(source)
        targets.append(target)
        numbers.append(number)
    if not sources and not allow_empty:
        raise HeadlabError(
            f"empty corpus: no sentence pair in {source_path} / {target_path}"
            + (f" ({counted(n_empty, 'pair')} with an empty side)" if n_empty else "")
        )
    return ParallelCorpus(
        sources, targets, str(source_path), str(target_path),
        n_empty, n_truncated, max_tokens, numbers,
    )
