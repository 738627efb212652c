"""Token frequencies of a training corpus, in the model's own vocabulary.

Rare-token heads (Voita et al. 2019, Sec. 5.3) are defined by how often each *token* (subword)
occurs in the training data. Counting goes through the model's tokenizer, so a frequency is
exactly that of an id the model sees. A frequency file holds one ``token<TAB>count`` per line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from headlab.data.parallel import numbered_lines
from headlab.errors import HeadlabError
from headlab.heads import atomic_write_text

__all__ = ["TokenFrequencies"]


def _lines(path: Path) -> Iterable[tuple[int, str]]:
    for number, raw in numbered_lines(path):
        try:
            yield number, raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError as error:
            raise HeadlabError(f"{path}:{number}: not valid UTF-8 ({error.reason})") from None


@dataclass(frozen=True)
class TokenFrequencies:
    """``counts[id]``: how often token ``id`` occurs in ``source`` (special tokens not counted)."""

    counts: np.ndarray
    source: str = ""
    n_lines: int = 0

    def __post_init__(self) -> None:
        counts = np.asarray(self.counts, dtype=np.int64)
        if counts.ndim != 1:
            raise HeadlabError("token counts must be a vector over the vocabulary")
        counts.setflags(write=False)
        object.__setattr__(self, "counts", counts)

    @property
    def vocab_size(self) -> int:
        return int(self.counts.shape[0])

    @property
    def n_tokens(self) -> int:
        return int(self.counts.sum())

    def top_mask(self, k: int) -> np.ndarray:
        """Boolean ``[vocab]``: the ``k`` most frequent ids (ties broken by lower id)."""
        order = np.lexsort((np.arange(self.vocab_size), -self.counts))
        mask = np.zeros(self.vocab_size, dtype=bool)
        mask[order[:k]] = True
        return mask

    @classmethod
    def from_corpus(
        cls, tokenizer, paths: str | Path | Iterable[str | Path], *, max_lines: int | None = None,
        batch_size: int = 1000,
    ) -> "TokenFrequencies":
        """Count the tokenizer's ids over text files (one sentence per line, plain or ``.gz``)."""
        if isinstance(paths, (str, Path)):
            paths = [paths]
        for path in (paths := [Path(path) for path in paths]):
            if not path.exists() or path.is_dir():
                raise HeadlabError(f"training text not found: {path}")

        def sentences() -> Iterator[str]:
            for path in paths:
                for _, line in _lines(Path(path)):
                    if line.strip():
                        yield line.strip()

        return cls.from_texts(tokenizer, sentences(), ",".join(map(str, paths)), max_lines=max_lines,
                              batch_size=batch_size)

    @classmethod
    def from_texts(cls, tokenizer, texts: Iterable[str], source: str = "", *, max_lines: int | None = None,
                   batch_size: int = 1000) -> "TokenFrequencies":
        """Count the tokenizer's ids over sentences (blank ones skipped): the lines of a corpus, or
        the text fields of a classifier's labelled TSV without its labels."""
        counts = np.zeros(len(tokenizer), dtype=np.int64)
        n_lines = 0
        batch: list[str] = []

        def flush() -> None:
            if batch:
                ids = tokenizer(batch, add_special_tokens=False)["input_ids"]
                flat = np.fromiter((i for row in ids for i in row), dtype=np.int64)
                np.add.at(counts, flat[flat < counts.size], 1)
                batch.clear()

        for text in texts:
            if max_lines is not None and n_lines >= max_lines:
                break
            if text.strip():
                batch.append(text.strip())
                n_lines += 1
            if len(batch) >= batch_size:
                flush()
        flush()
        if n_lines == 0:
            raise HeadlabError(f"no text to count tokens in: {source}")
        return cls(counts, source, n_lines)

    @classmethod
    def from_file(cls, tokenizer, path: str | Path) -> "TokenFrequencies":
        """Read ``token<TAB>count`` lines; tokens missing from the file count 0. A line starting
        with ``#`` and holding no tab is a comment (WordPiece's ``##s`` and the token ``#`` are counted)."""
        path = Path(path)
        if not path.exists() or path.is_dir():
            raise HeadlabError(f"frequency file not found: {path}")
        vocab = tokenizer.get_vocab()
        counts = np.zeros(len(tokenizer), dtype=np.int64)
        seen: dict[str, int] = {}
        for number, line in _lines(path):
            if not line.strip() or (line.startswith("#") and "\t" not in line):
                continue
            parts = line.split("\t")
            if len(parts) != 2:
                raise HeadlabError(f"{path}:{number}: expected 'token<TAB>count', got {line!r}")
            token, count = parts
            if token not in vocab:
                raise HeadlabError(f"{path}:{number}: token {token!r} is not in the tokenizer's vocabulary")
            try:
                value = int(count)
            except ValueError:
                raise HeadlabError(f"{path}:{number}: count {count!r} is not an integer") from None
            if value < 0:
                raise HeadlabError(f"{path}:{number}: negative count {value}")
            if token in seen:  # the last count would win over the first
                raise HeadlabError(f"{path}:{number}: token {token!r} is counted twice (also on line {seen[token]})")
            seen[token] = number
            counts[vocab[token]] = value
        return cls(counts, str(path))

    def save(self, path: str | Path, tokenizer) -> Path:
        """Write ``token<TAB>count`` lines, most frequent first (zero counts left out)."""
        tokens = tokenizer.convert_ids_to_tokens(list(range(self.vocab_size)))
        order = np.lexsort((np.arange(self.vocab_size), -self.counts))
        lines = [f"# token counts from {self.source}"]
        lines += [f"{tokens[i]}\t{int(self.counts[i])}" for i in order if self.counts[i] > 0]
        atomic_write_text(path, "\n".join(lines) + "\n")
        return Path(path)
