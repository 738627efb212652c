"""The registry of head statistics, in the order they are computed, written and described.

:func:`headlab.functions.analyze_heads` builds each one from its ``AnalysisConfig`` (its
:class:`~headlab.functions.statistic.Statistic` declaration returns None when the configuration
does not ask for it), streams the treebank through the model once and feeds them all. A new
statistic is a module with a class following :class:`~headlab.functions.statistic.HeadStatistic`
and its ``Statistic`` declaration, and one entry here; its result is then ``analysis.<name>``,
``headlab analyze`` writes it in its pass's stage, and ``heads.csv``, Figure 1 and the report show
its labels and files (CONTRIBUTING.md). Entries are imported on first use.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from headlab._lazy import LazyRegistry
from headlab.plugins import OptionSpec

__all__ = ["STATISTICS", "label_groups", "label_group", "option_specs", "check_options"]

STATISTICS = LazyRegistry({
    "positional": "headlab.functions.positional.POSITIONAL",  # Voita et al. 2019, Sec. 5.1, over words
    "positional_tokens": "headlab.functions.positional.POSITIONAL_TOKENS",  # the same over subword tokens
    "positional_interior": "headlab.functions.positional.POSITIONAL_INTERIOR",  # words with both neighbours
    "syntactic": "headlab.functions.syntactic.SYNTACTIC",  # Sec. 5.2
    "rare": "headlab.functions.rare_tokens.RARE",  # Sec. 5.3 (needs token frequencies)
    "aggregate": "headlab.aggregate.AGGREGATE",  # Vig & Belinkov 2019
})
"""name -> :class:`~headlab.functions.statistic.Statistic`."""


def label_groups() -> tuple[str, ...]:
    """The label groups of the statistics, in registry order: the rows of Figure 1's function
    grid and the label columns of ``heads.csv``."""
    groups: list[str] = []
    for statistic in STATISTICS.values():
        if statistic.label_group is not None and statistic.label_group not in groups:
            groups.append(statistic.label_group)
    return tuple(groups)


def label_group(label: str) -> str | None:
    """The group of the first statistic that owns ``label`` (None: no registered statistic does)."""
    return next((s.label_group for s in STATISTICS.values() if s.owns(label)), None)


def option_specs(stage: str | None = None) -> list[OptionSpec]:
    """The options that the statistics (of the pass ``stage``; None: all) declare, in registry order,
    each owned by its statistic's registry name (what names it when two declare a flag otherwise)."""
    return [replace(spec, owner=name) for name, statistic in STATISTICS.items() if stage in (None, statistic.stage)
            for spec in statistic.option_specs()]


def check_options(values: Mapping[str, object]) -> None:
    """Each statistic's options made from ``{dest: value}``: the checks of their ``__post_init__``
    (an unknown ``--relations``) before any work, as the ranges are."""
    for statistic in STATISTICS.values():
        statistic.options_from(values)
