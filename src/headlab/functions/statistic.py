"""The extension point of head functions and aggregate statistics: :class:`HeadStatistic`.

A statistic is fed every analysed block's attention, one :class:`~headlab.data.alignment.AttentionView`
at a time (``[batch, n_heads, q_len, k_len]`` with its word alignment; under ``query_chunk``
several views per block, each with some query rows, in order, the last with ``view.last``, and
under a causal mask only the keys those rows can see: key-indexed tensors may be narrower than
the sentence, the weights left out being 0, see :class:`~headlab.data.alignment.AttentionView`),
keeps small per-head tensors, and ends as a :class:`StatisticResult` that writes its own files, its section of the
functions README and its Figure 1 labels. A view's tensors, and its batch's (``view.side``, a copy made once per batch:
:meth:`~headlab.data.alignment.SideBatch.copy_to`), are on the statistics' device
(:func:`headlab.functions.analysis.statistics_device`: a CUDA GPU's when the model runs there, else the CPU's): a
statistic makes its tensors there (``device=``), keeps its state there, and brings it to the CPU in ``result``. The registry
(:data:`headlab.functions.registry.STATISTICS`) lists each one's :class:`Statistic` declaration (its
factory, the pass that feeds it, its label group, its output files with titles);
:func:`headlab.functions.analyze_heads`, ``headlab functions``, ``headlab analyze``, ``heads.csv``,
Figure 1 and the report take them from it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from headlab.data.alignment import AttentionView
from headlab.heads import HeadScores
from headlab.options import option
from headlab.plugins import PASSES, WRITTEN_UNDER, LabelReader, Output, Statistic

__all__ = ["HeadStatistic", "FusedStatistic", "StatisticResult", "Statistic", "Labels", "LabelReader",
           "Output", "empty_labels", "sensitivity_option", "PASSES", "WRITTEN_UNDER"]

Labels = dict[tuple[str, int, int], list[str]]
"""``{(kind, layer, head): [label, ...]}``; an analysed head without a function has ``[]``."""


def sensitivity_option() -> Any:
    """``--sensitivity``: a field of the options of each statistic with a sensitivity reading (the
    positional and the rare-token statistics). Declared alike by each, it is one flag and one value
    (:func:`headlab.plugins.option_table`); left out of ``summary.json`` at its default (it came
    after results were published)."""
    return option(False, "also the sensitivity readings: positional share over words with both neighbours; "
                  "rare-token share per sentence", flag="sensitivity", omit_default=True)


class StatisticResult(Protocol):
    def write(self, directory: Path) -> list[Path]:
        """Write its files under ``directory`` (the analysis directory; each result uses its own
        sub-directory) and return their paths."""

    def markdown(self) -> list[str]:
        """Its lines of the functions README (a section, or part of one)."""

    def labels(self) -> Labels:
        """Function labels per head for Figure 1 and the report (``{}``: it labels nothing)."""

    def describe_heads(self) -> list[str]:
        """One line per head with a function, for the command line.

        A result may also define ``summary_markdown() -> str``, its summary table, which ``headlab
        functions`` and ``aggregate`` print (after the heads' lines) and, for a result of the
        ``aggregate`` pass, ``headlab analyze`` writes as ``summary.md`` in the result's folder; and
        ``warnings() -> list[str]``: what its options asked for that the data could not give, which
        ``headlab functions`` and ``aggregate`` print to stderr."""


class HeadStatistic(Protocol):
    """A streaming per-head statistic. It may also define ``update_side(kind, side)`` (called
    once per batch and analysed kind, before the forward pass, with the batch on the CPU), ``reduce(shard)`` (called in every
    process of a sharded run after the last batch: combine the processes' states so that
    ``result`` is the whole corpus's, to the bit: counts added, float sums kept per batch in a
    :class:`~headlab.shard.Ledger` and added in batch order; :mod:`headlab.shard`) and
    ``close()`` (called at the end, also after an error). The registry builds it from an ``AnalysisConfig`` through a
    factory that returns None when the configuration does not ask for it."""

    def update(self, view: AttentionView) -> None: ...

    def result(self, *, model: str = "", signature: dict[str, object] | None = None) -> StatisticResult: ...


class FusedStatistic(Protocol):
    """A :class:`HeadStatistic` that the fused engine (``engine="fused"``, :mod:`headlab.data.fused`)
    can feed without word rows: it declares the passes it reads (names of
    :data:`headlab.data.fused.PASSES`; None: none will do, it takes the chunked path) and takes
    :class:`~headlab.data.fused.FusedView` s in ``update_fused``, in the order and with the
    ``last`` flag of ``update``'s views. Where one of its passes does not apply to a batch it is fed
    that batch's chunked views through ``update`` instead. A statistic without ``fused_passes``
    always takes the chunked path. One that declares ``word_linear`` may also define
    ``fused_features(side, causal, dtype) -> tuple[Tensor, ...]``: the key features it will pass to
    ``word_linear`` on a view of a whole block, which the kernel engine (``engine="kernel"``,
    :class:`~headlab.data.fused.KernelView`) needs before its pass; without it that engine runs the
    fused engine for the call."""

    @property
    def fused_passes(self) -> tuple[str, ...] | None: ...

    def update_fused(self, view: AttentionView) -> None: ...


def empty_labels(scores: HeadScores) -> Labels:
    """``[]`` for every head of ``scores``' arrays: each analysed head gets a key."""
    return {(kind, layer, head): [] for kind in scores.kinds
            for layer in range(scores[kind].shape[0]) for head in range(scores[kind].shape[1])}

