"""The registry of importance measures, in the order they run and are shown.

``headlab importance --method``, the stages of ``headlab analyze``, the report's importance maps
and the baselines of ``headlab reproduce`` all come from :data:`MEASURES`. A new measure is a
module with an :class:`~headlab.importance.measure.ImportanceMeasure` subclass and one entry here.
The names are known without importing torch (``headlab --help`` lists them); a class is imported
when it is first used.
"""

from __future__ import annotations

from headlab._lazy import LazyRegistry, LiveNames
from headlab.plugins import OptionSpec

__all__ = ["MEASURES", "DEFAULT_MEASURES", "REFERENCE", "tables", "option_specs"]

MEASURES = LazyRegistry({
    "confidence": "headlab.importance.confidence.Confidence",
    "lrp": "headlab.importance.lrp.LRP",
    "gradient": "headlab.importance.gradient.Gradient",
    "ablation": "headlab.importance.ablation.Ablation",
})
"""name -> :class:`~headlab.importance.measure.ImportanceMeasure` subclass (or its full path)."""

DEFAULT_MEASURES = LiveNames(lambda: tuple(name for name, measure in MEASURES.items() if not measure.on_request))
"""The measures ``headlab analyze`` runs unasked, in registry order: every one not ``on_request``
(read from the registry at each use, so a measure registered later is among them)."""

REFERENCE = "ablation"
"""The ground truth that the agreement table compares every other measure with."""


def tables() -> dict[str, tuple[str, str]]:
    """Every HeadScores table the measures write: name -> (title, caption), in registry order."""
    return {name: text for measure in MEASURES.values() for name, text in measure.tables.items()}


def option_specs() -> list[OptionSpec]:
    """Every measure's options, in registry order: the flags of ``importance`` and ``analyze``."""
    return [spec for measure in MEASURES.values() for spec in measure.option_specs()]
