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

__all__ = ["STRATEGIES", "METRICS", "CONFIDENCE_ENGINES", "LRPOptions", "AblationOptions", "ConfidenceOptions",
           "confidence_engine"]

STRATEGIES = ("vmap", "loop", "jacobian")  # how LRP's backward passes run
METRICS = ("loss", "bleu", "accuracy")  # what ablation measures


@dataclass(frozen=True)
class LRPOptions:
    strategy: str = option("vmap", "how LRP's backward passes run: vmap (fast), loop or jacobian", choices=STRATEGIES)
    targets: int | None = option(None, "LRP: explain a seeded sample of K positions per sentence (the top-1 logit at "
                                 "each), not every position; 0 or absent: all", metavar="K", range="[0, inf)")
    seed: int = option(0, "LRP: seed of the target sample and of the bootstrap", range="[0, inf)")
    bootstrap: int = option(200, "LRP: resamples of the sentences for each score's standard error (0: none; "
                            "else at least 2)",
                            metavar="N", range="[0, inf)")

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise HeadlabError(f"unknown LRP strategy {self.strategy!r}; expected one of {', '.join(STRATEGIES)}")
        if self.targets is not None and self.targets < 0:
            raise HeadlabError(f"--lrp-targets must be at least 0 (0: every position), got {self.targets}")
        if self.bootstrap < 0:
            raise HeadlabError(f"--lrp-bootstrap must be at least 0 (0: no standard errors), got {self.bootstrap}")
        if self.bootstrap == 1:  # the standard deviation (ddof 1) of one resample is undefined: every error null
            raise HeadlabError("--lrp-bootstrap 1: a standard error needs at least 2 resamples; give 0 (none) or 2 or "
                               "more (default 200)")


@dataclass(frozen=True)
class AblationOptions:
    metric: str = option("loss", "ablation metric: loss, bleu (translation models with --target) or accuracy "
                         "(classifiers; with loss they get both)", choices=METRICS, flag="metric")
    rows: int = option(256, "rows per ablation forward call (masked copies x batch)", range="[1, inf)", signed=False)
    beam: int = option(1, "beam size of the model's translations (1 = greedy)", range="[1, inf)", flag="beam")

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise HeadlabError(f"unknown ablation metric {self.metric!r}; expected one of {', '.join(METRICS)}")


CONFIDENCE_ENGINES = ("eager", "chunked", "fused", "kernel")
"""Where confidence's row maxima are taken (``--engine``, as the statistics' engines are named)."""


def confidence_engine(engine: str | None, query_chunk: int | None) -> str | None:
    """The engine confidence runs on under ``analyze --engine engine`` (and ``headlab.analyze``):
    eager only where ``--query-chunk`` does not chunk it (with it, eager is the statistics' engine
    alone), the kernel with the statistics' kernel, the default (fused) otherwise."""
    if engine == "eager":
        return "eager" if query_chunk is None else None
    return "kernel" if engine == "kernel" else None


@dataclass(frozen=True)
class ConfidenceOptions:
    query_chunk: int | None = option(None, "confidence: query rows per chunk of headlab's own attention function "
                                     "(memory linear in the length; default: 128)",
                                     metavar="N", range="[1, inf)", flag="query_chunk", signed=False)
    engine: str | None = option(None, "confidence: fused or chunked (the default; the same path here: headlab's "
                                "attention function in query chunks, each chunk's largest allowed weight per row, "
                                "one reduction), eager (the reference: each block's whole map; also the default "
                                "for a model whose attention cannot go through that function) or kernel (opt-in, "
                                "CUDA with triton: one Triton flash-attention pass per attention call, the largest "
                                "allowed weight exp(max score - lse), never the weights; the fused path for a call it "
                                "cannot compute exactly, said in the scores' signature)",
                                choices=CONFIDENCE_ENGINES, flag="engine", signed=False)

    def __post_init__(self) -> None:
        preflight.query_chunk(self.query_chunk)
        if self.engine is not None and self.engine not in CONFIDENCE_ENGINES:
            raise HeadlabError(f"engine must be one of {', '.join(CONFIDENCE_ENGINES)}, got {self.engine!r}")
        if self.engine == "kernel":
            from headlab._version import require_kernel_triton

            require_kernel_triton()
        if self.engine == "eager" and self.query_chunk is not None:
            raise HeadlabError("--query-chunk runs headlab's own attention function: not with --engine eager")
