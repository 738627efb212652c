"""The measures' own options (``ImportanceMeasure.Options``), each default and check written once
here: the measures and the command line's :class:`~headlab.importance.config.ImportanceConfig`
read them. Importing this module costs no torch."""

from __future__ import annotations

from dataclasses import dataclass

from headlab import preflight
from headlab.errors import HeadlabError

__all__ = ["STRATEGIES", "METRICS", "LRPOptions", "AblationOptions", "ConfidenceOptions"]

STRATEGIES = ("vmap", "loop", "jacobian")  # how LRP's backward passes run
METRICS = ("loss", "bleu", "accuracy")  # what ablation measures


@dataclass(frozen=True)
class LRPOptions:
    strategy: str = "vmap"  # how the backward passes run: vmap (fast), loop or jacobian
    targets: int | None = None  # steps explained per sentence, a seeded sample; None or 0: all
    seed: int = 0  # of the target sample and of the bootstrap
    bootstrap: int = 200  # resamples of the sentences for the standard errors; 0: none

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise HeadlabError(f"unknown LRP strategy {self.strategy!r}; expected one of {', '.join(STRATEGIES)}")
        if self.targets is not None and self.targets < 0:
            raise HeadlabError(f"--lrp-targets must be at least 0 (0: every position), got {self.targets}")
        if self.bootstrap < 0:
            raise HeadlabError(f"--lrp-bootstrap must be at least 0 (0: no standard errors), got {self.bootstrap}")


@dataclass(frozen=True)
class AblationOptions:
    metric: str = "loss"  # loss, bleu (translation models with references) or accuracy (classifiers)
    rows: int = 256  # rows per forward call (masked copies x batch)
    beam: int = 1  # beam of the translations BLEU scores

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise HeadlabError(f"unknown ablation metric {self.metric!r}; expected one of {', '.join(METRICS)}")


@dataclass(frozen=True)
class ConfidenceOptions:
    query_chunk: int | None = None  # None: eager capture, whole maps; N: headlab's attention, N query rows at a time

    def __post_init__(self) -> None:
        preflight.query_chunk(self.query_chunk)
