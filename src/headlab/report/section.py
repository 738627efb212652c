"""A report section's declaration (:class:`Section`): what a new section's module defines and
:data:`headlab.report.sections.SECTIONS` lists (CONTRIBUTING.md)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from headlab.report.collect import Collected

__all__ = ["Section", "MEASURE_STAGES", "REFERENCE_STAGE"]

MEASURE_STAGES = "*measures"
"""In :attr:`Section.stages`: the stage of every registered importance measure."""
REFERENCE_STAGE = "*reference"
"""In :attr:`Section.stages`: the stage of the measure the agreement table compares the others with."""


@dataclass(frozen=True)
class Section:
    """A report section's declaration, its registry entry."""

    id: str  # the HTML id, the navigation's anchor and the ``section`` of Collected's notes
    title: str
    nav: str  # the link text in the navigation
    render: Callable[[Collected], str]  # the section's HTML after its heading (escape what the directory gave)
    stages: tuple[str, ...] = ()  # manifest stages (name prefixes) whose skip/failure notes it shows; () = its id
    collect: Callable[[Path, Callable[[str], None]], Any] | None = None
    """What it reads from the analysis directory for itself: ``collect(directory, note)`` (``note(text)``
    shows a problem in the section; never raise); its result is ``Collected.sections[id]``."""
    embed: str | None = None
    """The key under which that result is also handed to the page's script."""
    parts: bool = False
    """It draws the :class:`~headlab.plugins.ReportPart` objects that plug-ins declare for it (its
    id is their ``section``): the sections of heatmaps do."""

    def stage_prefixes(self) -> tuple[str, ...]:
        if not self.stages:
            return (self.id,)
        from headlab.importance.registry import MEASURES, REFERENCE

        expand = {MEASURE_STAGES: tuple(MEASURES), REFERENCE_STAGE: (REFERENCE,)}
        return tuple(name for stage in self.stages for name in expand.get(stage, (stage,)))
