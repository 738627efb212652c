"""Options of a head-function and aggregate-statistics pass. Plain values; importing this module
costs no torch (``headlab functions`` and ``aggregate`` generate their flags from them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from headlab import preflight
from headlab.errors import HeadlabError
from headlab.options import option
from headlab.plugins import OptionSpec, PluginOptions, check_values, plugin_options

__all__ = ["AnalysisConfig", "ENGINES", "FUSED_CUDA_QUERY_CHUNK", "FUSED_QUERY_CHUNK", "WORD_POOLINGS"]

WORD_POOLINGS = ("sum", "first", "max")
ENGINES = ("eager", "chunked", "fused", "kernel")
"""Where the statistics of ``functions``/``aggregate`` run (``--engine``): see :mod:`headlab.data.fused`."""
FUSED_QUERY_CHUNK = 128
"""Query rows per chunk of the fused and chunked engines when ``--query-chunk`` is not given, on
the CPU and on a GPU. On the CPU the fused engine's chunks get fewer rows where 128 rows of every
head of a sentence would hold more than 2^22 weights (``analysis.FUSED_CHUNK_ELEMENTS``). On a GPU
(H200, Llama-3-8B shape, docs/benchmarks.md) 128 rows kept the memory at the SDPA forward's (1.00x
at 4k-64k tokens); 1024 rows were 1.3-1.7x faster at 1.87x the memory (``--query-chunk 1024``).
The fused engine on a CUDA GPU takes :data:`FUSED_CUDA_QUERY_CHUNK` rows instead."""
FUSED_CUDA_QUERY_CHUNK = 256
"""Query rows per chunk of the fused engine on a CUDA GPU when ``--query-chunk`` is not given. Each
chunk costs the host a fixed number of kernel launches whatever its size, which dominated the
first GPU measurement (H100, Llama-3-8B shape, 1,024 chunks at 16k tokens: docs/benchmarks.md,
issue 34): twice the rows halve them. Memory: at 128 rows the fused engine's GPU peak growth was
0.50x the SDPA forward's at 4k, 16k and 64k tokens; only the chunk's part of it grows with the rows,
so at 256 rows it is at most 1.00x (within issue 34's 1.2x)."""
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
    query_chunk: int | None = option(None, "query rows per chunk of headlab's own attention function, which feeds "
                                     "the statistics (fused and chunked engines): memory linear in the length "
                                     f"(default: {FUSED_QUERY_CHUNK}, fewer on the CPU for long inputs, "
                                     f"{FUSED_CUDA_QUERY_CHUNK} for the fused engine on a CUDA GPU)",
                                     metavar="N", range="[1, inf)")
    engine: str | None = option(None, "where the statistics run: fused (the default: headlab's attention function "
                                "in query chunks, statistics from a few passes over each: maxima, products with key "
                                "features; a statistic that cannot, such as the word statistics where words have "
                                "several subwords, takes the chunked path, equal to it to the bit), chunked (the reference: "
                                "statistics over word rows of each chunk) or eager (the reference: each block's "
                                "whole attention map, as output_attentions; also the default for a model whose "
                                "attention does not dispatch through transformers' attention interface), or kernel "
                                "(opt-in, CUDA with triton: one Triton flash-attention pass per block computes the "
                                "output and every statistic's passes, never the weights; the fused engine for a "
                                "model or batch it cannot serve, said in the summary)",
                                choices=ENGINES)
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
        # the ranges the command line checks, for the API (limit=0 was "no sentence could be analysed")
        preflight.at_least(self.max_sentences, 1, "--limit")
        preflight.at_least(self.max_length, 2, "--max-length")
        if self.engine is not None and self.engine not in ENGINES:
            raise HeadlabError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        preflight.query_chunk(self.query_chunk)
        if self.engine == "kernel":
            from headlab._version import require_kernel_triton

            require_kernel_triton()
        if self.engine == "eager" and self.query_chunk is not None:
            raise HeadlabError("--query-chunk runs headlab's own attention function: not with --engine eager")
        if self.options:
            from headlab.functions.registry import check_options

            check_values(self.plugin_specs(), self.options)
            check_options(self.options)

    @property
    def resolved_engine(self) -> str:
        """The engine asked for: :attr:`engine`, by default fused (issue 34; the analysis runs eager
        instead where the model's attention cannot go through headlab's attention function). Fused
        writes the chunked path's files to the bit wherever a word has several subwords, as on every
        bundled model: it feeds the word statistics the same word rows there. Against eager, those
        agree to rounding (the last bit of a few sums: the chunked attention's products)."""
        return self.engine if self.engine is not None else "fused"

    @property
    def chunk_rows(self) -> int:
        """Query rows per chunk of the chunked and fused engines."""
        return self.query_chunk if self.query_chunk is not None else FUSED_QUERY_CHUNK

    def chunk_rows_on(self, device_type: str) -> int:
        """:attr:`chunk_rows` for a model on a device of ``device_type`` ("cpu", "cuda", ...): by default the
        fused engine takes :data:`FUSED_CUDA_QUERY_CHUNK` rows on a CUDA GPU."""
        if self.query_chunk is None and self.resolved_engine in ("fused", "kernel") and device_type == "cuda":
            return FUSED_CUDA_QUERY_CHUNK
        return self.chunk_rows
