"""One streaming pass over a treebank: head functions and aggregate statistics together.

Sentences are read, aligned and batched a batch at a time; one forward pass per batch feeds
every statistic through :func:`headlab.capture_attention`'s callback, block by block, and the
attention is dropped as soon as the statistics have seen it. Memory does not grow with the
number of sentences. By default (the fused engine, :mod:`headlab.data.fused`) and under
``engine="chunked"`` the model runs headlab's own attention function
(:func:`headlab.capture.stream_attention`) and the statistics are fed ``query_chunk`` query rows at
a time (``--query-chunk N``, default :data:`~headlab.functions.config.FUSED_QUERY_CHUNK`), so no
block's whole ``[batch, heads, n, n]`` map exists: memory grows linearly in the length. The eager
reference (``engine="eager"``) hands the statistics each block's whole map; it is also what a
model gets by default whose attention cannot go through headlab's attention function (logged).

Which attention is analysed:

* an encoder-decoder model: the encoder self-attention over the ``conllu`` sentences (the
  decoder gets only its start token), and the decoder self-attention over ``target_conllu``
  sentences when target-side parses are given (teacher-forced, with the source sentence from
  ``conllu`` or ``source_text``). Cross-attention is not analysed.
* an encoder-only or decoder-only model: its self-attention over the ``conllu`` sentences.

In a sharded run (:mod:`headlab.shard`) every process reads the whole treebank and forms the
same batches; batch ``i`` is computed by process ``i % N``, and the statistics, counts and
problems are combined at the end (:meth:`HeadStatistic.reduce`) into the one-process results, to
the bit.

Bad input never stops the run: a malformed CoNLL-U sentence, a sentence the tokenizer cannot
align (both reported with file and line, and skipped) and a sentence longer than the model's
maximum length (truncated to it, counted, and analysed on the words that fit).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from itertools import islice, zip_longest
from pathlib import Path
from typing import Callable, Iterator, Sequence, cast

import torch

from headlab._version import __version__
from headlab.adapters import attention_blocks
from headlab.attention import AttentionCall, AttentionChunk
from headlab.capture import capture_attention, eval_mode, not_streamable, stream_attention, unregistrable
from headlab.compiled import model_entry
from headlab.data.alignment import (
    AlignmentError,
    AttentionView,
    SideBatch,
    WordRows,
    align_sentences,
    build_side_batch,
)
from headlab.data.attention_kernel import KernelCalls
from headlab.data.frequencies import TokenFrequencies
from headlab.data.fused import KERNEL_PASSES, FusedView, KernelView, unavailable_passes, word_offset
from headlab.data.parallel import read_lines
from headlab.data.treebank import (
    InMemoryTreebank,
    Problem,
    ProblemLog,
    Sentence,
    TreebankCounts,
    count_sentences,
    read_conllu,
)
from headlab.errors import HeadlabError, counted
from headlab.functions.config import AnalysisConfig
from headlab.functions.registry import STATISTICS
from headlab.functions.statistic import StatisticResult
from headlab.gates import refuse_gated
from headlab.heads import (
    CAUSAL_KINDS,
    DEFAULT_DTYPE,
    Numbering,
    atomic_write_text,
    reconstructed_blocks,
    reconstructed_note,
    renumbered_blocks,
    renumbering_needed,
    weights_dtype,
    write_json,
)
from headlab.loading import check_tokenizer_fits
from headlab.model_description import length_lowered, model_max_length
from headlab.shard import Shard, active
from headlab.surgery import declared_numbering, original_heads

__all__ = ["AnalysisConfig", "HeadAnalysis", "analyze_heads", "describe_heads"]

logger = logging.getLogger(__name__)

PIECE_ELEMENTS = 1 << 19
"""Under ``query_chunk`` on the CPU the statistics take each chunk of probabilities a few query
rows at a time, about this many weights (2 MB in float32): their dozen elementwise passes and
reductions then run on data that stays in the CPU cache, several times faster than over a whole
chunk. On a GPU the cache argument does not apply: a chunk is one piece (:func:`piece_rows`)."""


def statistics_device(device: torch.device) -> torch.device:
    """Where the statistics of attention probabilities on ``device`` run: on that device when it
    is a CUDA GPU (the probabilities stay there, the statistics' sums are kept there in float64
    and int64 and come to the CPU when a result is read), else on the CPU (a device without
    float64, such as Apple's MPS, gives its probabilities to the CPU, as every device did before)."""
    return device if device.type == "cuda" else torch.device("cpu")


FUSED_PIECE_ELEMENTS = 1 << 30
"""The same for the fused engine: in practice a whole chunk. Its passes read each weight once or
twice (no cache to stay in), and its batched products (entropy's ``sum_j p_j s_j``) read a whole
chunk's ``[batch, heads, rows, keys]`` as one matrix of rows; a piece of some rows would be copied first."""


FUSED_CHUNK_ELEMENTS = 1 << 22
"""The fused engine's chunks on the CPU: at most this many weights per sentence (16 MiB of float32),
fewer rows than ``--query-chunk`` where needed (:attr:`headlab.attention.ChunkSink.chunk_elements`;
with 16 heads, beyond 2048 keys at 128 rows). The scores, the softmax, the output product and the
statistics' passes each read or write a whole chunk; past the cache (64 MiB for 128 rows of 16
heads at 8k keys) each goes through memory. Measured at 8k tokens: 32 rows instead of 128 take
about a sixth less time for those passes (docs/benchmarks.md, issue 34)."""


def piece_rows(probs: torch.Tensor, elements: int = PIECE_ELEMENTS) -> int:
    """How many query rows of a chunk ``probs`` ``[B, H, rows, T]`` the statistics take at a time:
    about ``elements`` weights on the CPU, the whole chunk elsewhere."""
    B, H, rows, T = probs.shape
    if probs.device.type == "cpu":
        return max(1, elements // max(1, B * H * T))
    return max(1, rows)


# Options added after results were published, left out of summary.json at their defaults so that
# a default run writes the files it always wrote (a statistic's: ``omit_default`` in its metadata).
_LATER_DEFAULTS = {"word_pooling": "sum", "engine": None}


@dataclass
class RunReport:
    """What the run read, skipped, truncated; problems with file and line."""

    n_sentences: int = 0
    n_words: int = 0
    n_tokens: int = 0
    n_truncated: int = 0
    n_unaligned: int = 0
    seconds: float = 0.0
    treebanks: dict[str, dict] = field(default_factory=dict)
    problems: ProblemLog = field(default_factory=ProblemLog)
    analysed: list[str] = field(default_factory=list)
    max_length: int = 0
    length_lowered: str = ""
    """Set when the max_length asked for was above the model's longest input: what it was lowered to."""
    chunked_statistics: dict[str, str] = field(default_factory=dict)
    """Under the fused engine: the statistics fed the chunked path's word rows (for some batch), and why."""
    kernel_fallback: dict[str, str] = field(default_factory=dict)
    """Under the kernel engine: why some attention calls ran on the fused engine instead, by statistic
    (its declaration) or ``"model"`` (an attention the kernel cannot compute exactly)."""
    reconstructed_numbering: list[str] = field(default_factory=list)
    """The blocks whose head numbers were reconstructed (a pruned directory re-saved without its record), which
    the README and summary.json say, as the tables' signatures do (:func:`headlab.surgery.declared_numbering`)."""

    def to_json(self) -> dict:
        # chunked_statistics only when some statistic fell back: a run without it writes what it always wrote
        data = {k: v for k, v in self.__dict__.items()
                if k != "problems" and (k not in ("chunked_statistics", "kernel_fallback", "reconstructed_numbering",
                                                  "length_lowered") or v)}
        data["problems"] = self.problems.to_json()
        return data

    def describe(self) -> str:
        text = (f"{counted(self.n_sentences, 'sentence')} ({counted(self.n_words, 'word')}, "
                f"{counted(self.n_tokens, 'token')}) analysed "
                f"in {self.seconds:.1f} s for {', '.join(self.analysed) or 'nothing'}")
        if self.reconstructed_numbering:
            text += f"\n{reconstructed_note(self.reconstructed_numbering)}"
        for name, counts in self.treebanks.items():
            extras = [f"{counts[k]} {label}" for k, label in (
                ("n_multiword_tokens", "multiword-token lines skipped"),
                ("n_empty_nodes", "empty nodes skipped"),
                ("n_malformed", "malformed sentences skipped"),
            ) if counts.get(k)]
            if extras:
                text += f"\n{name}: " + ", ".join(extras)
        if self.length_lowered:
            text += f"\n{self.length_lowered}"
        if self.n_truncated:
            text += f"\n{counted(self.n_truncated, 'sentence')} truncated to {self.max_length} tokens"
        for name, reason in self.chunked_statistics.items():
            text += f"\n{name}: computed over word rows (chunked path) for some batches: {reason}"
        for name, reason in self.kernel_fallback.items():
            text += f"\n{name}: the fused engine instead of the kernel for some batches: {reason}"
        if self.n_unaligned:
            text += (f"\n{counted(self.n_unaligned, 'sentence')} could not be aligned to subwords and "
                     f"{'was' if self.n_unaligned == 1 else 'were'} skipped")
        for problem in self.problems.problems[:10]:
            text += f"\n  {problem}"
        if self.problems.total > 10:
            text += f"\n  ... {self.problems.total - 10} more (see summary.json)"
        return text


@dataclass
class HeadAnalysis:
    """Everything one pass computed: ``results`` by statistic name (the registry's order), also
    reachable as attributes (``analysis.positional``; None when that statistic did not run)."""

    config: AnalysisConfig
    report: RunReport
    model: str = ""
    results: dict[str, StatisticResult] = field(default_factory=dict)
    numbering: Numbering | None = None
    """A physically pruned model's heads (:data:`headlab.heads.Numbering`), which ``results`` name by
    their original index; None: the model's heads are its original ones."""
    dtype: str = DEFAULT_DTYPE
    """The dtype of the model's weights (:func:`headlab.heads.weights_dtype`), in summary.json where not float32."""

    def __getattr__(self, name: str):
        if name in STATISTICS:
            return self.__dict__.get("results", {}).get(name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __repr__(self) -> str:
        found = describe_heads(self)
        labelled = {head for result in self.results.values() for head, names in result.labels().items() if names}
        lines = [f"HeadAnalysis of {self.model or 'a model'}: {counted(self.report.n_sentences, 'sentence')}, "
                 f"{', '.join(self.results) or 'no statistic'}; {counted(len(labelled), 'head')} with a function"]
        lines += [f"  {line}" for line in found[:8]] + ([f"  ... {len(found) - 8} more"] if len(found) > 8 else [])
        return "\n".join(lines)

    def functions_markdown(self) -> str:
        lines = [f"# Head functions of {self.model or 'the model'}", "", "```", self.report.describe(), "```", ""]
        for result in self.results.values():
            lines += result.markdown()
        return "\n".join(lines)

    def save(self, directory: str | Path, figures: bool = True) -> list[Path]:
        """Each result's files, ``summary.json`` and ``README.md`` (and the figures) under ``directory``."""
        directory = Path(directory)
        paths = [path for result in self.results.values() for path in result.write(directory)]
        # the pass's own settings (AnalysisConfig's order), then every statistic's options (given or default)
        # by flag name, in registry order (docs/functions.md, "One pass, constant memory")
        config = {**{k: v for k, v in asdict(self.config).items() if k != "options"}, **self.config.option_values()}
        later = {**_LATER_DEFAULTS, **{s.dest: s.default for s in self.config.plugin_specs()
                                        if s.field.metadata.get("omit_default")}}
        config = {k: v for k, v in config.items() if later.get(k, object()) != v}
        summary = {"model": self.model, **({"dtype": self.dtype} if self.dtype != DEFAULT_DTYPE else {}),
                   "config": config, "report": self.report.to_json()}
        paths.append(write_json(directory / "summary.json", summary, ensure_ascii=False))
        path = directory / "README.md"
        atomic_write_text(path, self.functions_markdown())
        paths.append(path)
        if figures:
            from headlab.functions.figures import save_figures

            paths += save_figures(self, directory)
        return paths


def _batched(iterator: Iterator, size: int) -> Iterator[list]:
    while True:
        batch = list(islice(iterator, size))
        if not batch:
            return
        yield batch


_END = object()


@model_entry  # torch.compile's wrapper: its model, run eagerly (headlab.compiled)
def analyze_heads(
    model,
    tokenizer,
    conllu: str | Path | InMemoryTreebank | None = None,
    *,
    target_conllu: str | Path | InMemoryTreebank | None = None,
    source_text: str | Path | None = None,
    frequencies: TokenFrequencies | None = None,
    config: AnalysisConfig | None = None,
    model_name: str = "",
    progress: bool = False,
    on_batch: Callable[[int], None] | None = None,
) -> HeadAnalysis:
    """Stream a treebank through ``model`` once and compute head functions and statistics.

    ``frequencies`` enables rare-token heads. ``on_batch(n)`` is called after each batch with
    the number of sentences read so far. See the module docstring for what is analysed. The
    stages: which attention is analysed on which side (:func:`_analysed_sides`), the statistics
    (:func:`_statistics`), the example stream (:func:`_examples`), the batches through the model
    with the statistics fed by a :class:`_Feeder`, and the results with their signature.
    """
    config = config or AnalysisConfig()
    seq2seq = bool(getattr(model.config, "is_encoder_decoder", False))
    if conllu is None and target_conllu is None:
        raise HeadlabError("nothing to analyse: give a CoNLL-U file (and/or target-side parses)")
    if target_conllu is not None and not seq2seq:
        raise HeadlabError("target-side parses need an encoder-decoder model; this model has one stack")
    if target_conllu is not None and conllu is None and source_text is None:
        raise HeadlabError("decoder analysis needs the source sentences: give the source CoNLL-U or a "
                           "source text file, one sentence per line, aligned with the target parses")
    check_tokenizer_fits(tokenizer, model, model_name or type(model).__name__)
    refuse_gated(model, "the head functions and aggregate statistics")
    dtype = _one_precision(model, active())
    sides, blocks = _analysed_sides(model, seq2seq, conllu is not None, target_conllu is not None)
    # a --max-length above the model's positions is lowered (longer inputs would index past its position table)
    max_length = model_max_length(model, tokenizer, config.max_length)
    report = RunReport(analysed=sorted(set(sides), key=lambda k: ("enc_self", "dec_self").index(k)),
                       max_length=max_length, length_lowered=length_lowered(model, tokenizer, config.max_length) or "",
                       reconstructed_numbering=reconstructed_blocks(declared_numbering(model)))
    heads = {block.key: original_heads(block) for block in blocks}
    moved = bool(renumbered_blocks(heads))
    numbering = heads if renumbering_needed(heads) else None
    shard = active()
    stats = _statistics(config, frequencies, shard, report, moved)

    counts = {name: TreebankCounts() for name in ("source", "target")}
    bar = _progress_bar(config, conllu, target_conllu) if progress and shard.main else None
    feeder = _Feeder(sides, stats, report, next(model.parameters()).device)
    capture = feeder.capture(model, config, blocks)
    started = time.perf_counter()
    stream = _examples(conllu, target_conllu, source_text, report.problems, counts)
    if config.max_sentences is not None:
        stream = islice(stream, config.max_sentences)
    try:
        # eval mode: attention dropout would blur the probabilities
        with eval_mode(model), capture, torch.inference_mode():
            _run_batches(model, tokenizer, stream, feeder, config, max_length, target_conllu is not None, shard, bar,
                         on_batch)
        if shard.split:
            _combine(shard, report, stats, feeder.noted)
        report.seconds = time.perf_counter() - started
        if config.engine is None:  # fused by default: the files the eager and chunked runs always wrote; logged
            report.chunked_statistics = {}
        report.treebanks = {
            str(path): counts[name].to_json()
            for name, path in (("source", conllu), ("target", target_conllu)) if path is not None
        }
        signature = {**_signature(report, config, target_conllu or conllu, max_length, dtype), **declared_numbering(model)}
        results = {name: stat.result(model=model_name, signature=signature) for name, stat in stats.items()}
        if numbering is not None:  # a pruned model: its heads by their original index, as the importance scores
            # (a statistic without renumbered was refused unless each layer kept its first heads: then its indices hold)
            results = {name: result.renumbered(numbering) if STATISTICS[name].original_numbering else result  # type: ignore[attr-defined]
                       for name, result in results.items()}
        return HeadAnalysis(config=config, report=report, model=model_name, results=results, numbering=numbering,
                            dtype=dtype)
    finally:
        if bar is not None:
            bar.close()
        for stat in stats.values():
            if hasattr(stat, "close"):
                stat.close()


def _analysed_sides(model, seq2seq: bool, source: bool, target: bool) -> tuple[dict[str, str], list]:
    """Which attention kind is analysed on which side (``{kind: "source" | "target"}``) and its
    blocks: an encoder-decoder's encoder self-attention on the source parses, its decoder
    self-attention on the target parses; a single stack's self-attention on the parses."""
    all_blocks = attention_blocks(model)
    sides: dict[str, str] = {}  # kind -> "source" | "target"
    for block in all_blocks:
        if seq2seq:
            if block.kind == "enc_self" and source:
                sides[block.kind] = "source"
            elif block.kind == "dec_self" and target:
                sides[block.kind] = "target"
        elif block.kind in ("enc_self", "dec_self") and source:
            sides[block.kind] = "source"
    blocks = [b for b in all_blocks if b.kind in sides]
    if not blocks:
        raise HeadlabError("the model has no self-attention to analyse on the given data")
    if not any(b.n_heads for b in blocks):  # every analysed layer pruned to zero heads: all tables would be empty
        raise HeadlabError(f"every {' and '.join(sorted(sides))} head of the model was pruned; there is no head "
                           "to analyse on the given data")
    return sides, blocks


def _statistics(config: AnalysisConfig, frequencies: TokenFrequencies | None, shard: Shard, report: RunReport,
                moved: bool = False) -> dict:
    """The registry's statistics this run computes; a sharded run needs each to combine over
    processes, and keeps every problem event (``report.problems`` becomes a :class:`_ProblemEvents`);
    on a pruned model whose kept heads are not the first ones of some layer (``moved``) each must name
    them by their original index (:attr:`~headlab.plugins.Statistic.original_numbering`)."""
    stats = {name: stat for name, make in STATISTICS.items() if (stat := make(config, frequencies)) is not None}
    if moved:
        for name in stats:
            if not STATISTICS[name].original_numbering:
                raise HeadlabError(f"the statistic {name} cannot name a pruned model's heads by their original index "
                                   "(its Statistic declares no original_numbering), so its table would name other heads "
                                   "than the importance scores; run it on the unpruned model, or leave it out")
    if shard.split:
        for name, stat in stats.items():
            if not hasattr(stat, "reduce"):
                raise HeadlabError(f"the statistic {name} cannot be combined over processes (it has no reduce); "
                                   "run it in one process")
        report.problems = _ProblemEvents()
    return stats


def _examples(conllu, target_conllu, source_text, problems: ProblemLog,
              counts: dict[str, TreebankCounts]) -> Iterator[tuple[Sentence | str | None, Sentence | None]]:
    """The example stream: (source sentence | text, target sentence | None)."""
    if target_conllu is None:
        assert conllu is not None  # one of the two is given (checked by analyze_heads)
        yield from ((s, None) for s in read_conllu(conllu, problems=problems, counts=counts["source"]))
        return
    # Paired: sentence n of the target goes with sentence (or line) n of the source; a
    # malformed sentence on either side drops the pair, not the pairing.
    target = read_conllu(target_conllu, problems=problems, counts=counts["target"], keep_place=True)
    if conllu is not None:
        source: Iterator[Sentence | str | None] = read_conllu(conllu, problems=problems, counts=counts["source"],
                                                              keep_place=True)
        source_name = str(conllu)
    else:
        assert source_text is not None  # paired with a target: a source treebank or text (checked by analyze_heads)
        source = (line.strip() or None for line in read_lines(source_text))
        source_name = str(source_text)
    for number, (src, tgt) in enumerate(zip_longest(source, target, fillvalue=_END), start=1):
        if tgt is _END and src is None and conllu is None:
            continue  # a blank line of the text after the last target sentence: no sentence left unpaired
        if src is _END or tgt is _END:
            longer, shorter = (source_name, target_conllu) if tgt is _END else (target_conllu, source_name)
            problems.add("unpaired", Problem(str(longer), 0, f"has more sentences than {shorter} "
                                             f"(from sentence {number} on); the extra ones are ignored"))
            return
        if src is None or tgt is None:
            if src is None and conllu is None:
                problems.add("malformed", Problem(source_name, number, "empty source line; pair skipped"))
            continue
        yield cast("Sentence | str", src), cast(Sentence, tgt)


def _progress_bar(config: AnalysisConfig, conllu, target_conllu):
    from tqdm.auto import tqdm

    total = count_sentences(cast("str | Path | InMemoryTreebank", target_conllu or conllu))
    if config.max_sentences is not None:
        total = min(total, config.max_sentences)
    return tqdm(total=total, unit="sent", desc="heads", leave=False)


def _run_batches(model, tokenizer, stream: Iterator, feeder: _Feeder, config: AnalysisConfig, max_length: int,
                 paired: bool, shard: Shard, bar, on_batch: Callable[[int], None] | None) -> None:
    """Every batch of ``stream`` this process owns, aligned, through the model (the feeder's
    capture gives the statistics its attention), and counted in the report."""
    report = feeder.report
    seq2seq = bool(getattr(model.config, "is_encoder_decoder", False))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    start_id = getattr(model.config, "decoder_start_token_id", None)
    if seq2seq and start_id is None:
        start_id = pad_id
    index = 0
    for number, raw in enumerate(_batched(stream, config.batch_size)):
        mine = shard.owns(number)
        items = _prepare(raw, index, tokenizer, config, max_length, report) if mine else []
        index += len(raw)
        if shard.split:
            assert isinstance(report.problems, _ProblemEvents)  # a split run's log (set by _statistics)
            report.problems.marks.append(len(report.problems.events))
        if bar is not None:
            bar.update(len(raw))
        if not items:
            continue
        feeder.new_batch()
        feeder.batch = number
        inputs = _model_inputs(items, tokenizer, pad_id, start_id, seq2seq, max_length, feeder.current, feeder.device,
                               config.word_pooling)
        feeder.update_sides()
        try:
            # a teacher-forced pass: no cache (FSMT's forward with use_cache, its config's default, builds no causal
            # mask for the decoder: every target token then attends to the later ones)
            model(**inputs, **({"use_cache": False} if seq2seq else {}))
        except _ForwardDone:
            pass  # every analysed block has reported: the rest of the forward (later layers, logits) feeds nothing
        main = feeder.current.get("target" if paired else "source")
        assert main is not None  # the batch has the side read
        report.n_sentences += main.batch_size
        report.n_words += int(main.n_words.sum())
        report.n_tokens += int(main.token_mask.sum())
        feeder.new_batch()
        if on_batch is not None:
            on_batch(index)


def _one_precision(model, shard: Shard) -> str:
    """The dtype of the model's weights (:func:`headlab.heads.weights_dtype`); in a sharded run, the same in every
    process, checked before any work: the processes' sums are added into one table, which would mix precisions."""
    dtype = weights_dtype(model)
    if shard.split:
        found = shard.gather(dtype)
        other = next(((rank, theirs) for rank, theirs in enumerate(found) if theirs != found[0]), None)
        if other is not None:
            raise HeadlabError(f"process rank {other[0]} holds the model in {other[1]}, rank 0 in {found[0]} (--dtype): "
                               "their sums would be added into one table of mixed precisions; load it in one dtype")
    return dtype


def _signature(report: RunReport, config: AnalysisConfig, data, max_length: int, dtype: str = DEFAULT_DTYPE) -> dict:
    signature = {
        "data": str(data),
        "sentences": report.n_sentences,
        "words": report.n_words,
        "tokens": report.n_tokens,
        "spacing": config.spacing,
        "max_length": max_length,
    }
    if config.word_pooling != "sum":  # the default leaves the signature (and older result files) as they were
        signature["word_pooling"] = config.word_pooling
    if dtype != DEFAULT_DTYPE:  # float32 (no --dtype) leaves the signature (and older result files) as they were
        signature["dtype"] = dtype
    signature["version"] = __version__
    return signature


class _ForwardDone(Exception):
    """Raised by the feeder once every analysed block of a batch has handed over its last chunk:
    nothing after it in the forward pass (later layers' MLPs, an encoder-only analysis's decoder, the
    logits) feeds a statistic, so the model need not compute it."""


class _Feeder:
    """The current batch's analysed sides and the capture callbacks that feed them, with the
    attention, to the statistics: whole maps (eager), word rows of query chunks (chunked) or
    the fused engine's views (:mod:`headlab.data.fused`)."""

    def __init__(self, sides: dict[str, str], stats: dict, report: RunReport, device: torch.device) -> None:
        self.sides, self.stats, self.report, self.device = sides, stats, report, device
        self.side_stats = [s for s in stats.values() if hasattr(s, "update_side")]
        self.block_stats = list(stats.values())
        self.current: dict[str, SideBatch] = {}
        self.placed: dict[tuple[str, torch.device], SideBatch] = {}  # (side, device) -> the batch's copy there
        self.assemblers: dict = {}  # block key -> WordRows of the block's current forward call
        # The fused engine: per block and batch, the statistics whose declared passes apply get
        # FusedViews; the others the chunked path's word-row views, for that batch.
        self.fused_plan: dict = {}  # block key -> (fused statistics, chunked statistics, WordRows | None)
        # Under headlab's attention function (every block dispatching): stop the forward pass once
        # every analysed block of the batch has reported (_ForwardDone).
        self.stop_early = False
        self.blocks: list = []
        self.reported: set = set()
        self.kernel_calls = KernelCalls(self._kernel_fallback)  # the kernel engine: its refusal, once per model
        # The batch now through the model, and the batch that first noted each reason (``(field, name)``:
        # chunked_statistics or kernel_fallback): a sharded run merges the reasons in the one-process order.
        self.batch = 0
        self.noted: dict[tuple[str, str], int] = {}

    def capture(self, model, config: AnalysisConfig, blocks: list):
        engine = config.resolved_engine
        if config.engine is None and (why := not_streamable(model)):
            # The default engine (fused) needs headlab's attention function; without it the chunks would
            # be cut from the whole map anyway (stream_attention's fallback): the eager reference runs.
            logger.info("%s: %s; the statistics run on the eager path (whole maps), not the fused engine",
                        type(model).__name__, why)
            engine = "eager"
        if engine == "eager":
            return capture_attention(model, self.on_probs, blocks=blocks)
        if engine == "kernel":
            check_kernel(self.device)
        self.blocks = [block for block in blocks if block.n_heads > 0]
        self.stop_early = not unregistrable(attention_blocks(model))  # not the eager fallback
        fused = engine in ("fused", "kernel")  # the kernel engine: the fused engine where it cannot run
        return stream_attention(model, self.on_fused_chunk if fused else self.on_chunk,
                                query_chunk=config.chunk_rows_on(self.device.type), blocks=blocks, scores=fused,
                                reuse=True, chunk_elements=FUSED_CHUNK_ELEMENTS if fused else 0,
                                kernel=self.on_kernel if engine == "kernel" else None)

    def new_batch(self) -> None:
        self.current.clear()
        self.placed.clear()
        self.reported.clear()

    def block_done(self, block) -> None:
        """``block`` has handed over its last chunk of the batch: the forward stops (:class:`_ForwardDone`)
        once every analysed block with heads has, where :attr:`stop_early`. Raised from the attention
        function, after the chunk's statistics: the block's own output is not needed either."""
        if not self.stop_early:
            return
        self.reported.add(block.key)
        if all(b.key in self.reported for b in self.blocks if self.sides.get(b.kind, "") in self.current):
            raise _ForwardDone

    def update_sides(self) -> None:
        for kind, name in self.sides.items():
            if name in self.current:
                for stat in self.side_stats:
                    stat.update_side(kind, self.current[name])

    def side_on(self, name: str, device: torch.device) -> SideBatch:
        """The batch's side ``name`` on ``device``: copied there once per batch, shared by every
        block and chunk on it (with the tensors they derive from it)."""
        if (name, device) not in self.placed:
            self.placed[(name, device)] = self.current[name].to(device)
        return self.placed[(name, device)]

    def on_probs(self, block, probs: torch.Tensor) -> None:
        name = self.sides.get(block.kind, "")
        if name not in self.current:
            return
        probs = probs.to(statistics_device(probs.device))
        view = AttentionView(block, probs, self.side_on(name, probs.device))
        for stat in self.block_stats:
            stat.update(view)

    def on_chunk(self, block, chunk: AttentionChunk) -> None:
        name = self.sides.get(block.kind, "")
        if name not in self.current:
            return
        probs = chunk.probs.to(statistics_device(chunk.probs.device))
        if chunk.start == 0:
            self.assemblers[block.key] = WordRows(block, self.side_on(name, probs.device))
        rows = probs.shape[2]
        step = piece_rows(probs)
        for first in range(0, rows, step):
            piece = probs[:, :, first:first + step]
            last = chunk.last and first + step >= rows
            view = self.assemblers[block.key].view(piece, chunk.start + first, last)
            for stat in self.block_stats:
                stat.update(view)
        if chunk.last:
            del self.assemblers[block.key]
            self.block_done(block)

    def plan(self, block, side: SideBatch) -> tuple:
        missing = set(unavailable_passes(side))
        fused, chunked = [], []
        for name, stat in self.stats.items():
            passes = getattr(stat, "fused_passes", None)
            if passes is not None and not missing.intersection(passes):
                fused.append(stat)
            else:
                chunked.append(stat)
                reason = "it declares no fused passes" if passes is None else \
                    "the words of a batch are not single tokens"
                if name not in self.report.chunked_statistics:
                    # The documented path of word statistics over multi-subword words, equal to the chunked
                    # reference to the bit: a debug note (summary.json records it under --engine fused).
                    logger.debug("%s: computed over word rows (the chunked path) for some batches: %s", name, reason)
                    self.report.chunked_statistics[name] = reason
                    self.noted["chunked_statistics", name] = self.batch
        return fused, chunked, WordRows(block, side) if chunked else None

    def on_fused_chunk(self, block, chunk: AttentionChunk) -> None:
        name = self.sides.get(block.kind, "")
        if name not in self.current:
            return
        probs = chunk.probs.to(statistics_device(chunk.probs.device))
        side = self.side_on(name, probs.device)
        if chunk.start == 0:
            self.fused_plan[block.key] = self.plan(block, side)
        fused, chunked, words = self.fused_plan[block.key]
        rows = probs.shape[2]
        step = piece_rows(probs, PIECE_ELEMENTS if chunked else FUSED_PIECE_ELEMENTS)
        for first in range(0, rows, step):
            piece = probs[:, :, first:first + step]
            last = chunk.last and first + step >= rows
            if fused:
                scores = None if chunk.scores is None else \
                    chunk.scores[:, :, first:first + step].to(statistics_device(chunk.scores.device))
                view = FusedView(block, piece, side, start=chunk.start + first, last=last, scores=scores)
                for stat in fused:
                    stat.update_fused(view)
            if chunked:
                word_view = words.view(piece, chunk.start + first, last)
                for stat in chunked:
                    stat.update(word_view)
        if chunk.last:
            del self.fused_plan[block.key]
            self.block_done(block)


    # -- the kernel engine (engine="kernel", headlab.data.attention_kernel) -----------------------------
    def kernel_plan(self, side: SideBatch) -> bool:
        """Whether every statistic can take this batch's block from the kernel's outputs (a
        :class:`KernelView`); where one cannot, the call runs on the fused engine (said in the report)."""
        if unavailable_passes(side):
            self._kernel_fallback("word statistics", "the words of a batch are not single tokens")
            return False
        for name, stat in self.stats.items():
            passes = getattr(stat, "fused_passes", None)
            reason = None
            if passes is None:
                reason = "it declares no fused passes"
            elif set(passes) - set(KERNEL_PASSES):
                reason = f"it reads passes the kernel does not offer ({', '.join(sorted(set(passes) - set(KERNEL_PASSES)))})"
            elif "word_linear" in passes and not hasattr(stat, "fused_features"):
                reason = "it declares no fused_features for word_linear"
            if reason is not None:
                self._kernel_fallback(name, reason)
                return False
        return True

    def kernel_features(self, side: SideBatch, causal: bool, dtype: torch.dtype, T: int,
                        offset: int) -> tuple[dict[int, slice], torch.Tensor | None]:
        """The key features ``[B, T, f]`` on the token columns of the words (0 elsewhere): those the
        statistics declared for ``word_linear`` (``fused_features``; their columns by ``id``), then
        ``[word, j]`` for ``word_distance``. Made once per batch, kind and dtype: every layer reuses them."""
        cache = side.__dict__.setdefault("_kernel_features", {})
        key = (causal, dtype, T)
        if key in cache:
            return cache[key][1:]
        parts: list[torch.Tensor] = []
        columns: dict[int, slice] = {}
        at = 0
        for stat in self.stats.values():
            for features in getattr(stat, "fused_features", lambda *_: ())(side, causal, dtype):
                if id(features) not in columns:
                    columns[id(features)] = slice(at, at + features.shape[2])
                    at += features.shape[2]
                    parts.append(features)
        W = max(0, min(side.max_words, T - offset))
        if any("word_distance" in (getattr(stat, "fused_passes", None) or ()) for stat in self.stats.values()):
            words = side.word_mask[:, :W].to(dtype)
            parts.append(torch.stack([words, words * torch.arange(W, dtype=dtype, device=words.device)], -1))
        features = None
        if parts:
            word_features = torch.cat([part[:, :W].to(dtype) for part in parts], -1)
            features = word_features.new_zeros(word_features.shape[0], T, word_features.shape[2])
            features[:, offset:offset + W] = word_features
        cache[key] = (parts, columns, features)  # the parts: their ids stay theirs while cached
        return columns, features

    def _kernel_fallback(self, name: str, reason: str) -> None:
        if name not in self.report.kernel_fallback:
            logger.warning("%s: the fused engine instead of the kernel for some batches: %s", name, reason)
            self.report.kernel_fallback[name] = reason
            self.noted["kernel_fallback", name] = self.batch

    def on_kernel(self, block, call: AttentionCall) -> torch.Tensor | None:
        """One attention call computed by the kernel with the statistics' passes (one
        :class:`KernelView` of the whole block fed to every statistic), its output returned; None
        (the call goes to the chunks, :meth:`on_fused_chunk`) where the kernel cannot serve it."""
        name = self.sides.get(block.kind, "")
        if name not in self.current or not self.kernel_calls.accepts(call, _kernel_refusal):
            return None
        q, k, v, mask = call.query, call.key, call.value, call.mask
        side = self.side_on(name, statistics_device(q.device))
        B, H, T, _ = q.shape
        if side.token_mask.shape[1] != T or not self.kernel_plan(side):
            return None
        offset = word_offset(side)
        assert offset is not None  # kernel_plan: the word passes apply
        dtype = torch.float64 if q.dtype == torch.float64 else torch.float32  # the probabilities' dtype
        causal = block.kind in CAUSAL_KINDS
        columns, features = self.kernel_features(side, causal, dtype, T, offset)
        stats = self.kernel_calls.run(call, eligible=side.token_mask, features=features)
        if stats is None:  # nothing ran: this call and the rest go to the fused engine
            return None
        output = stats.out
        if mask is not None:  # a row that sees no key: uniform over every key, as the eager softmax of the float minimum
            uniform = v.mean(2, keepdim=True).repeat_interleave(H // k.shape[1], 1)
            output = torch.where(stats.lse.isneginf()[..., None], uniform.to(output.dtype), output)
        seen_mask = None if mask is None else mask[:, 0].expand(B, T, T)

        def seen(rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
            visible = keys <= rows[..., None] if call.causal else torch.ones_like(keys, dtype=torch.bool)
            if seen_mask is not None:  # the few (row, key) entries, not the rows' whole mask
                sentence = torch.arange(B, device=keys.device).view(B, *([1] * (keys.dim() - 1)))
                visible = visible & seen_mask[sentence, rows[..., None], keys]
            return visible

        view = KernelView(block, stats, side, linear=columns, query=q, key=k, scaling=call.scaling, seen=seen)
        for stat in self.stats.values():
            stat.update_fused(view)
        self.block_done(block)
        return output.transpose(1, 2).contiguous()


def _kernel_refusal(call: AttentionCall) -> str | None:
    """Why the kernel's one view of a call cannot feed the statistics, beyond :func:`refusal`'s reasons."""
    if call.mask is not None and call.mask.shape[1] != 1:
        return "a mask per head"
    if call.query.shape[2] != call.key.shape[2]:
        return "queries and keys of different lengths (not self-attention)"
    return None


def check_kernel(device: torch.device) -> None:
    """Refuse the kernel engine before any work where it cannot run at all: no triton, or a device
    other than a CUDA GPU (Triton's interpreter, ``TRITON_INTERPRET=1``, runs it on the CPU for tests)."""
    from headlab.data import attention_kernel

    problem = attention_kernel.triton_refusal()
    if problem:
        raise HeadlabError(problem)
    if device.type != "cuda" and not attention_kernel.interpreted():
        raise HeadlabError(f"--engine kernel runs on a CUDA GPU; the model is on {device.type} "
                           "(use the default fused engine there)")


class _ProblemEvents(ProblemLog):
    """A problem log that also keeps every event, and where each batch's events end (``marks``):
    a sharded run rebuilds the one-process log from them."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, Problem]] = []
        self.marks: list[int] = [0]

    def add(self, kind: str, problem: Problem) -> None:
        super().add(kind, problem)
        self.events.append((kind, problem))


def _combine(shard: Shard, report: RunReport, stats: dict, noted: dict[tuple[str, str], int]) -> None:
    """The processes' counts added, their statistics reduced, the problem log rebuilt in the
    one-process order: batch ``i``'s events (reading and aligning it) from the process that
    aligned it, then what reading found after the last batch (the same in every process); and
    the reasons some statistic took the chunked path or the fused engine merged (:func:`_merge_reasons`)."""
    for name in ("n_sentences", "n_words", "n_tokens", "n_truncated", "n_unaligned"):
        setattr(report, name, shard.sum(getattr(report, name)))
    log = report.problems
    assert isinstance(log, _ProblemEvents)  # analyze_heads gives a split run one
    parts = shard.gather((log.events, log.marks))
    merged = ProblemLog(keep=log.keep)
    n_batches = len(log.marks) - 1
    for number in range(n_batches):
        events, marks = parts[number % shard.world]
        for kind, problem in events[marks[number]:marks[number + 1]]:
            merged.add(kind, problem)
    for kind, problem in log.events[log.marks[-1]:]:
        merged.add(kind, problem)
    report.problems = merged
    _merge_reasons(shard, report, noted)
    for stat in stats.values():
        stat.reduce(shard)


def _merge_reasons(shard: Shard, report: RunReport, noted: dict[tuple[str, str], int]) -> None:
    """Every process's ``chunked_statistics`` and ``kernel_fallback`` in the report, in the order one
    process notes them: by the batch that first noted each name (``noted``), then the order within
    that batch (one process ran it)."""
    parts = shard.gather((report.chunked_statistics, report.kernel_fallback, noted))
    for index, reasons in enumerate(("chunked_statistics", "kernel_fallback")):
        first: dict[str, tuple[int, int, str]] = {}  # name -> (batch, place in that batch's process, reason)
        for part in parts:
            for place, (name, reason) in enumerate(part[index].items()):
                at = (part[2][reasons, name], place, reason)
                if name not in first or at < first[name]:
                    first[name] = at
        setattr(report, reasons, {name: at[2] for name, at in sorted(first.items(), key=lambda item: item[1][:2])})


def _prepare(raw, index, tokenizer, config, max_length, report):
    """Align a batch of examples; report and drop the ones that cannot be aligned."""
    problems = report.problems
    sources = [s for s, _ in raw]
    targets = [t for _, t in raw]
    ok = [True] * len(raw)
    source_alignments: list = [None] * len(raw)
    target_alignments: list = [None] * len(raw)
    for _which, sentences, store in (("source", sources, source_alignments), ("target", targets, target_alignments)):
        parsed = [(i, s) for i, s in enumerate(sentences) if isinstance(s, Sentence)]
        if not parsed:
            continue
        words = [s.words for _, s in parsed]
        spaces = [s.space_after for _, s in parsed] if config.spacing == "text" else None
        results = align_sentences(tokenizer, words, space_after=spaces, max_length=max_length)
        for (i, sentence), result in zip(parsed, results):
            if isinstance(result, AlignmentError):
                ok[i] = False
                report.n_unaligned += 1
                problems.add("unaligned", Problem(sentence.path, sentence.line,
                                                  f"sentence {sentence.sent_id or '?'}: {result}; skipped"))
            else:
                store[i] = result
    items = []
    for i, (source, target) in enumerate(raw):
        if not ok[i]:
            continue
        truncated = False
        for sentence, alignment in ((source, source_alignments[i]), (target, target_alignments[i])):
            if alignment is not None and alignment.truncated:
                truncated = True
                problems.add("truncated", Problem(
                    sentence.path, sentence.line,
                    f"sentence {sentence.sent_id or '?'}: {counted(len(sentence), 'word')}, cut to the first "
                    f"{alignment.n_words} to fit {max_length} tokens"))
        report.n_truncated += truncated
        items.append((index + i, source, source_alignments[i], target, target_alignments[i]))
    return items


def _model_inputs(items, tokenizer, pad_id, start_id, seq2seq, max_length, current, device, pooling="sum") -> dict:
    """Model inputs for a batch; fills ``current`` with the analysed sides' SideBatches."""
    inputs: dict[str, torch.Tensor] = {}
    if items[0][2] is not None:  # parsed source
        side = build_side_batch([(s, a, i) for i, s, a, _, _ in items], pad_id, pooling=pooling)
        current["source"] = side
        inputs["input_ids"] = side.token_ids
        inputs["attention_mask"] = _lengths_mask(side, [len(a) for _, _, a, _, _ in items])
    else:  # plain source text (decoder analysis only)
        encoded = tokenizer([s for _, s, _, _, _ in items], padding=True, truncation=True,
                            max_length=max_length, return_tensors="pt")
        inputs["input_ids"], inputs["attention_mask"] = encoded["input_ids"], encoded["attention_mask"]
    if seq2seq:
        if items[0][4] is not None:
            side = build_side_batch([(t, a, i) for i, _, _, t, a in items], pad_id, shift=1, start_id=start_id,
                                    pooling=pooling)
            current["target"] = side
            lengths = [len(a) - (1 if a.word_of_token[-1] < 0 else 0) + 1 for _, _, _, _, a in items]
            inputs["decoder_input_ids"] = side.token_ids
            inputs["decoder_attention_mask"] = _lengths_mask(side, lengths)
        else:
            inputs["decoder_input_ids"] = torch.full((len(items), 1), start_id, dtype=torch.long)
    return {k: v.to(device) for k, v in inputs.items()}


def _lengths_mask(side: SideBatch, lengths: Sequence[int]) -> torch.Tensor:
    T = side.token_ids.shape[1]
    return (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).long()


def describe_heads(analysis: HeadAnalysis) -> list[str]:
    """One line per head with a function: positional, syntactic, rare-token."""
    return [line for result in analysis.results.values() for line in result.describe_heads()]
