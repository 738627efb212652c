"""Options of an importance run, apart from the measures themselves: importing this module
costs no torch (the command line reads its help texts at start-up)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from headlab.errors import HeadlabError


@dataclass
class ImportanceConfig:
    """Options of an importance run (``headlab importance`` maps its flags onto these)."""

    methods: tuple[str, ...] = field(default=("all",), metadata={"help": "measures to run: confidence, lrp, gradient, ablation or all"})
    batch_size: int = field(default=32, metadata={"help": "sentences per batch"})
    metric: str = field(default="loss", metadata={"help": "ablation metric: loss, bleu (translation models with --target) or accuracy (classifiers; with loss they get both)"})
    beam: int = field(default=1, metadata={"help": "beam size of the model's translations (1 = greedy)"})
    lrp_strategy: str = field(default="vmap", metadata={"help": "how LRP's backward passes run: vmap (fast), loop or jacobian"})
    ablation_rows: int = field(default=256, metadata={"help": "rows per ablation forward call (masked copies x batch)"})
    kinds: tuple[str, ...] | None = field(default=None, metadata={"help": "attention kinds to score (default: all)"})
    progress: bool = field(default=True, metadata={"help": "show progress bars"})

    def resolved_methods(self) -> list[str]:
        from headlab.importance.ablation import METRICS
        from headlab.importance.lrp import STRATEGIES
        from headlab.importance.pipeline import METHODS

        chosen: list[str] = []
        for name in self.methods:
            names = list(METHODS) if name == "all" else [name]
            for n in names:
                if n not in METHODS:
                    raise HeadlabError(f"unknown importance method {n!r}; expected one of {', '.join(METHODS)} or all")
                if n not in chosen:
                    chosen.append(n)
        if self.metric not in METRICS:
            raise HeadlabError(f"unknown ablation metric {self.metric!r}; expected one of {', '.join(METRICS)}")
        if self.lrp_strategy not in STRATEGIES:
            raise HeadlabError(f"unknown LRP strategy {self.lrp_strategy!r}; expected one of {', '.join(STRATEGIES)}")
        if self.batch_size < 1 or self.beam < 1 or self.ablation_rows < 1:
            raise HeadlabError("batch size, beam and ablation rows must be at least 1")
        return chosen

    @classmethod
    def help(cls, name: str) -> str:
        return next(f.metadata.get("help", "") for f in fields(cls) if f.name == name)
