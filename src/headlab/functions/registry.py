"""The registry of head statistics, in the order they are computed, written and described.

:func:`headlab.functions.analyze_heads` builds each one from its ``AnalysisConfig`` (a factory
returns None when the configuration does not ask for that statistic), streams the treebank
through the model once and feeds them all. A new statistic is a module with a class following
:class:`~headlab.functions.statistic.HeadStatistic` and one entry here; its result is then
``analysis.<name>``.
"""

from __future__ import annotations

from typing import Callable

from headlab.aggregate import AggregateStats
from headlab.functions.positional import PositionalStats
from headlab.functions.rare_tokens import RareTokenStats
from headlab.functions.statistic import HeadStatistic
from headlab.functions.syntactic import SyntacticStats

__all__ = ["STATISTICS"]

STATISTICS: dict[str, Callable[..., HeadStatistic | None]] = {
    "positional": PositionalStats.from_config,  # Voita et al. 2019, Sec. 5.1, over words
    "positional_tokens": PositionalStats.tokens_from_config,  # the same over subword tokens
    "positional_interior": PositionalStats.interior_from_config,  # words with both neighbours (--sensitivity)
    "syntactic": SyntacticStats.from_config,  # Sec. 5.2
    "rare": RareTokenStats.from_config,  # Sec. 5.3 (needs token frequencies)
    "aggregate": AggregateStats.from_config,  # Vig & Belinkov 2019
}
"""name -> factory ``(config: AnalysisConfig, frequencies: TokenFrequencies | None)``."""
