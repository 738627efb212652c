"""Options of an importance run, apart from the measures themselves: importing this module
costs no torch (the command line reads its help texts at start-up). The fields that fill a
measure's options take their defaults from its ``Options`` (:mod:`.measure_options`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from headlab.errors import HeadlabError
from headlab.importance.measure_options import METRICS, STRATEGIES, AblationOptions, ConfidenceOptions, LRPOptions
from headlab.importance.registry import MEASURES


@dataclass
class ImportanceConfig:
    """Options of an importance run (``headlab importance`` maps its flags onto these)."""

    methods: tuple[str, ...] = field(default=("all",), metadata={"help": f"measures to run: {', '.join(MEASURES)} or all"})
    batch_size: int = field(default=32, metadata={"help": "sentences per batch", "range": "[1, inf)"})
    metric: str = field(default=AblationOptions.metric, metadata={
        "help": "ablation metric: loss, bleu (translation models with --target) or accuracy (classifiers; "
                "with loss they get both)", "choices": METRICS})
    beam: int = field(default=AblationOptions.beam, metadata={
        "help": "beam size of the model's translations (1 = greedy)", "range": "[1, inf)"})
    lrp_strategy: str = field(default=LRPOptions.strategy, metadata={
        "help": "how LRP's backward passes run: vmap (fast), loop or jacobian", "choices": STRATEGIES})
    lrp_targets: int | None = field(default=LRPOptions.targets, metadata={
        "help": "LRP: explain a seeded sample of K positions per sentence (the top-1 logit at each), not every "
                "position; 0 or absent: all", "metavar": "K", "range": "[0, inf)"})
    lrp_seed: int = field(default=LRPOptions.seed, metadata={
        "help": "LRP: seed of the target sample and of the bootstrap", "range": "[0, inf)"})
    lrp_bootstrap: int = field(default=LRPOptions.bootstrap, metadata={
        "help": "LRP: resamples of the sentences for each score's standard error (0: none)", "metavar": "N", "range": "[0, inf)"})
    ablation_rows: int = field(default=AblationOptions.rows, metadata={
        "help": "rows per ablation forward call (masked copies x batch)", "range": "[1, inf)"})
    query_chunk: int | None = field(default=ConfidenceOptions.query_chunk, metadata={
        "help": "confidence: headlab's own attention function, N query rows at a time (memory linear in the "
                "length; default: eager capture, whole maps)", "metavar": "N", "range": "[1, inf)"})
    kinds: tuple[str, ...] | None = field(default=None, metadata={"help": "attention kinds to score (default: all)"})
    progress: bool = field(default=True, metadata={"help": "show progress bars"})

    def resolved_methods(self) -> list[str]:
        chosen: list[str] = []
        for name in self.methods:
            names = list(MEASURES) if name == "all" else [name]
            for n in names:
                if n not in MEASURES:
                    raise HeadlabError(f"unknown importance method {n!r}; expected one of {', '.join(MEASURES)} or all")
                if n not in chosen:
                    chosen.append(n)
        for measure in MEASURES.values():
            measure.options_from(self)  # each measure checks its own options
        if self.batch_size < 1 or self.beam < 1 or self.ablation_rows < 1:
            raise HeadlabError("batch size, beam and ablation rows must be at least 1")
        return chosen
