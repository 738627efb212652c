"""Resumable stages: what ``headlab analyze`` and ``headlab reproduce`` share."""

from __future__ import annotations

__all__ = ["SkipStage"]


class SkipStage(Exception):
    """A stage cannot run on this model or input (yet); the message is the reason.

    ``headlab analyze`` records the stage as skipped, ``headlab reproduce`` as not run.
    """
