"""The measures' own options (``ImportanceMeasure.Options``), each default, help, range and check
written once here: the command lines of ``importance`` and ``analyze``, the configs, the scores'
signature and the stage keys are generated from them (:mod:`headlab.plugins`). A field's flag is
``--<measure>-<field>`` unless its metadata names another (``flag``); ``signed=False``: it changes
no number (not in the signature or the stage key). Importing this module costs no torch."""

from __future__ import annotations

from dataclasses import dataclass

from headlab import preflight
from headlab.errors import HeadlabError
from headlab.options import option

__all__ = ["STRATEGIES", "METRICS", "LRPOptions", "AblationOptions", "ConfidenceOptions"]

STRATEGIES = ("vmap", "loop", "jacobian")  # how LRP's backward passes run
METRICS = ("loss", "bleu", "accuracy")  # what ablation measures


@dataclass(frozen=True)
class LRPOptions:
    strategy: str = option("vmap", "how LRP's backward passes run: vmap (fast), loop or jacobian", choices=STRATEGIES)
    targets: int | None = option(None, "LRP: explain a seeded sample of K positions per sentence (the top-1 logit at "
                                 "each), not every position; 0 or absent: all", metavar="K", range="[0, inf)")
    seed: int = option(0, "LRP: seed of the target sample and of the bootstrap", range="[0, inf)")
    bootstrap: int = option(200, "LRP: resamples of the sentences for each score's standard error (0: none)",
                            metavar="N", range="[0, inf)")

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise HeadlabError(f"unknown LRP strategy {self.strategy!r}; expected one of {', '.join(STRATEGIES)}")
        if self.targets is not None and self.targets < 0:
            raise HeadlabError(f"--lrp-targets must be at least 0 (0: every position), got {self.targets}")
        if self.bootstrap < 0:
            raise HeadlabError(f"--lrp-bootstrap must be at least 0 (0: no standard errors), got {self.bootstrap}")


@dataclass(frozen=True)
class AblationOptions:
    metric: str = option("loss", "ablation metric: loss, bleu (translation models with --target) or accuracy "
                         "(classifiers; with loss they get both)", choices=METRICS, flag="metric")
    rows: int = option(256, "rows per ablation forward call (masked copies x batch)", range="[1, inf)", signed=False)
    beam: int = option(1, "beam size of the model's translations (1 = greedy)", range="[1, inf)", flag="beam")

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise HeadlabError(f"unknown ablation metric {self.metric!r}; expected one of {', '.join(METRICS)}")


@dataclass(frozen=True)
class ConfidenceOptions:
    query_chunk: int | None = option(None, "confidence: headlab's own attention function, N query rows at a time "
                                     "(memory linear in the length; default: eager capture, whole maps)",
                                     metavar="N", range="[1, inf)", flag="query_chunk", signed=False)

    def __post_init__(self) -> None:
        preflight.query_chunk(self.query_chunk)
