"""English text for a language model: plain files (one sentence a line) and CoNLL-U treebanks.

A treebank contributes each sentence's words joined with the treebank's own spacing
(``SpaceAfter=No``), so its text reads like the plain files. Every error names the file (and
line): an unreadable, empty or all-blank file is refused before training starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from headlab.data import read_lines
from headlab.data.alignment import join_words
from headlab.data.treebank import read_conllu
from headlab.errors import HeadlabError, counted
from headlab.training.corpus import EncodedCorpus

__all__ = ["TextCorpus", "read_text_corpus", "encode_lm_corpus", "collate_lm", "is_conllu"]


@dataclass
class TextCorpus:
    """Sentences and where they came from (for the model card and the log)."""

    sentences: list[str] = field(default_factory=list)
    per_file: dict[str, int] = field(default_factory=dict)
    n_blank: int = 0

    def __len__(self) -> int:
        return len(self.sentences)

    def summary(self) -> str:
        files = ", ".join(f"{Path(path).name} {count:,}" for path, count in self.per_file.items())
        blank = f"; {counted(self.n_blank, 'blank line', spec=',')} skipped" if self.n_blank else ""
        return f"{counted(len(self), 'sentence', spec=',')} ({files}){blank}"


def is_conllu(path: str | Path) -> bool:
    name = Path(path).name
    return name.endswith(".conllu") or name.endswith(".conllu.gz")


def _read_file(path: str) -> tuple[list[str], int]:
    if is_conllu(path):
        sentences = [join_words(s.words, s.space_after)[0] for s in read_conllu(path) if s is not None]
        return sentences, 0
    lines = [line.strip() for line in read_lines(path)]
    sentences = [line for line in lines if line]
    return sentences, len(lines) - len(sentences)


def read_text_corpus(paths: Sequence[str | Path]) -> TextCorpus:
    """All sentences of ``paths`` in order; a file with no sentence is an error naming it."""
    if not paths:
        raise HeadlabError("no text files given")
    corpus = TextCorpus()
    for path in map(str, paths):
        if Path(path).is_dir():
            raise HeadlabError(f"{path} is a directory, not a text file")
        sentences, n_blank = _read_file(path)
        if not sentences:
            raise HeadlabError(f"{path} holds no sentence (empty or only blank lines)")
        corpus.sentences.extend(sentences)
        corpus.per_file[path] = len(sentences)
        corpus.n_blank += n_blank
    return corpus


def encode_lm_corpus(tokenizer, sentences: Sequence[str], max_positions: int) -> EncodedCorpus:
    """Token ids ``<s> ... </s>`` per sentence; longer ones are cut to ``max_positions + 1``
    tokens (the model sees all but the last), keeping ``</s>``, and counted."""
    # verbose=False: not transformers' "longer than the specified maximum" warning; the cut is counted and said here
    ids = tokenizer(list(sentences), add_special_tokens=True, verbose=False)["input_ids"]
    eos, limit, n_truncated = tokenizer.eos_token_id, max_positions + 1, 0
    for i, seq in enumerate(ids):
        if len(seq) > limit:
            ids[i] = seq[: limit - 1] + [eos]
            n_truncated += 1
    # The trainer batches by target length; a language model's targets are its inputs.
    return EncodedCorpus(sources=ids, targets=ids, n_truncated=n_truncated)


def collate_lm(corpus: EncodedCorpus, indices: Sequence[int], pad_id: int) -> dict:
    """Next-token batches: inputs are tokens ``0..n-2``, labels tokens ``1..n-1`` (padding -100)."""
    width = max(len(corpus.targets[i]) for i in indices) - 1
    input_ids = torch.full((len(indices), width), pad_id, dtype=torch.long)  # [batch, len]
    attention_mask = torch.zeros((len(indices), width), dtype=torch.long)
    labels = torch.full((len(indices), width), -100, dtype=torch.long)
    for row, i in enumerate(indices):
        seq = torch.tensor(corpus.targets[i])
        n = len(seq) - 1
        input_ids[row, :n] = seq[:-1]
        attention_mask[row, :n] = 1
        labels[row, :n] = seq[1:]
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
