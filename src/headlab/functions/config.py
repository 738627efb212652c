"""Options of a head-function and aggregate-statistics pass. Plain values; importing this module
costs no torch (``headlab functions`` and ``aggregate`` generate their flags from them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from headlab import preflight
from headlab.errors import HeadlabError
from headlab.options import option
from headlab.plugins import OptionSpec, PluginOptions, check_values, plugin_options

__all__ = ["AnalysisConfig", "ENGINES", "FUSED_QUERY_CHUNK", "WORD_POOLINGS"]

WORD_POOLINGS = ("sum", "first", "max")
ENGINES = ("eager", "chunked", "fused")
"""Where the statistics of ``functions``/``aggregate`` run (``--engine``): see :mod:`headlab.data.fused`."""
FUSED_QUERY_CHUNK = 128
"""Query rows per chunk of the fused and chunked engines when ``--query-chunk`` is not given."""
"""Subword-to-word mappings (:data:`headlab.data.alignment.POOLINGS`, named here without importing torch)."""


@plugin_options
@dataclass
class AnalysisConfig(PluginOptions):
    """What to compute and how. Each field maps one to one onto a CLI flag; the options that a
    registered statistic declares itself (``Statistic.Options``: ``relations``, ``positional_threshold``,
    ``sensitivity``, ``max_offset``, ``top_frequent``, ``min_weight``, ...) are keywords and attributes
    too, kept in ``options``."""

    functions: bool = True  # positional, syntactic and rare-token heads
    aggregate: bool = True  # Vig & Belinkov statistics
    batch_size: int = option(32, "sentences per forward pass", range="[1, inf)")
    max_sentences: int | None = option(None, "analyse only the first N sentences", range="[1, inf)",
                                       flag="limit", old_names=("--max-sentences",))
    spacing: str = option("words", "words: join the treebank's words by spaces; text: keep its SpaceAfter=No",
                          choices=("words", "text"))
    max_length: int | None = option(None, "tokens per sentence (default: the model's maximum)", range="[2, inf)")
    query_chunk: int | None = option(None, "run headlab's own attention function and feed the statistics N query "
                                     "rows at a time: memory linear in the length (default: eager capture, whole maps)",
                                     metavar="N", range="[1, inf)")
    engine: str | None = option(None, "where the statistics run: eager (each block's whole attention map), "
                                "chunked (--query-chunk rows of probabilities at a time, statistics over word rows) or "
                                "fused (the same chunks, statistics from a few passes over each: maxima, products with "
                                "key features; word rows where words have several subwords); default: fused with "
                                "--query-chunk, else eager", choices=ENGINES)
    word_pooling: str = option("sum", "subword attention to word attention: sum (to a word: the sum over its "
                               "subwords; from a word: their mean), first (a word is its first subword), max (the "
                               "largest weight)", choices=WORD_POOLINGS)
    options: dict[str, object] = field(default_factory=dict, metadata={
        "help": "the options the statistics declare, by flag name"})

    @classmethod
    def plugin_specs(cls) -> list[OptionSpec]:
        from headlab.functions.registry import option_specs

        return option_specs()

    def __post_init__(self) -> None:
        if self.spacing not in ("words", "text"):
            raise HeadlabError(f"spacing must be 'words' or 'text', got {self.spacing!r}")
        if self.word_pooling not in WORD_POOLINGS:
            raise HeadlabError(f"word pooling must be one of {', '.join(WORD_POOLINGS)}, got {self.word_pooling!r}")
        if self.batch_size < 1:
            raise HeadlabError(f"batch size must be at least 1, got {self.batch_size}")
        if self.engine is not None and self.engine not in ENGINES:
            raise HeadlabError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        preflight.query_chunk(self.query_chunk)
        if self.engine == "eager" and self.query_chunk is not None:
            raise HeadlabError("--query-chunk runs headlab's own attention function: not with --engine eager")
        if self.options:
            from headlab.functions.registry import check_options

            check_values(self.plugin_specs(), self.options)
            check_options(self.options)

    @property
    def resolved_engine(self) -> str:
        """The engine that runs: :attr:`engine`, or by default fused with ``query_chunk``, else eager.
        (Fused writes the chunked path's files to the bit wherever a word has several subwords, as on
        every bundled model: it feeds the word statistics the same word rows there.)"""
        if self.engine is not None:
            return self.engine
        return "fused" if self.query_chunk is not None else "eager"

    @property
    def chunk_rows(self) -> int:
        """Query rows per chunk of the chunked and fused engines."""
        return self.query_chunk if self.query_chunk is not None else FUSED_QUERY_CHUNK
