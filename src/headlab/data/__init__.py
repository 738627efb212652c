"""Corpora: parallel text (and, in later issues, CoNLL-U treebanks and token frequencies)."""

from headlab.data.parallel import ParallelCorpus, read_lines, read_parallel

__all__ = ["ParallelCorpus", "read_lines", "read_parallel"]
