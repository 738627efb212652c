"""The options of gated fine-tuning and of the baselines. Plain values; importing this module
costs no torch (``headlab prune`` generates its flags from them, :mod:`headlab.options`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from headlab.options import option
from headlab.training.config import TrainConfig

if TYPE_CHECKING:
    from headlab.heads import HeadScores

__all__ = ["PruneConfig", "BaselineConfig", "DEFAULT_BETA", "DEFAULT_GAMMA", "DEFAULT_ZETA"]

DEFAULT_BETA = 0.33  # the authors' code (Voita et al. 2019); 2/3 in Louizos et al. 2018
DEFAULT_GAMMA = -0.1
DEFAULT_ZETA = 1.1


@dataclass
class PruneConfig:
    """Options of gated fine-tuning; ``headlab prune train`` maps its flags onto these fields."""

    gates: str = option("auto", "auto (enc_self on a model with an encoder, dec_self on a decoder-only model), "
                        "enc_self (decoder frozen, Sec. 6.2), all (all parameters trained, Sec. 6.3) "
                        "or a comma list of kinds")
    lam: float = option(0.05, "weight of the L0 penalty (lambda)")  # ignored with keep
    keep: int | None = option(None, "reach exactly N open heads (Lagrangian budget, CoFi)", range="[1, inf)")
    freeze_decoder: bool | None = None  # None: frozen iff gates == "enc_self" and there is a decoder
    beta: float = option(DEFAULT_BETA, "Hard Concrete temperature (the authors' 0.33; 2/3 in Louizos et al.)", range="(0, inf)")
    gamma: float = DEFAULT_GAMMA
    zeta: float = DEFAULT_ZETA
    init_log_alpha: float = option(3.0, "initial log alpha (3: P(g=0) ~ 0.02)")
    # the model's learning rate is train.lr
    gate_lr: float = option(0.02, "learning rate of log alpha", range="(0, inf)")
    multiplier_lr: float = option(0.05, "learning rate of the Lagrange multipliers (budget mode)", range="(0, inf)")
    budget_warmup: float = option(0.5, "fraction of the run's steps over which the budget target moves to --keep", range="[0, 1]")
    log_every: int = option(50, "diagnostics every N steps (trajectory.jsonl); 0: off", range="[0, inf)")
    loss: str = option("auto", "the training loss (auto: from the model)",
                       choices=("auto", "seq2seq", "causal_lm", "masked_lm"))
    eval_beam: int = option(4, "beam of the evaluation's translations", range="[1, inf)")
    eval_batch_size: int = 64
    latency_sentences: int = option(0, "time encoder and translation on N evaluation sentences (0: off)",
                                    flag="latency", metavar="N", range="[0, inf)")
    dev_every: int = option(0, "translate the development set (--dev-src/--dev-tgt) greedily every N updates and "
                            "before the first; the curve shows whether fine-tuning has stopped moving (0: off)",
                            metavar="N", range="[0, inf)")
    dev_sentences: int | None = option(None, "use the first N sentences of the development set (default: all)",
                                       metavar="N", range="[1, inf)")
    command: str = ""  # the command line, for the model card
    model_fingerprint: str = ""  # SHA-256 of the starting weights (headlab.resume.weights_fingerprint)
    # SHA-256 of the evaluation and training pairs (a sweep's run_sweep sets them): a point made on others is redone
    eval_data_sha256: str = ""
    train_data_sha256: str = ""
    dev_data_sha256: str = ""  # the development set of the curve (--dev-src/--dev-tgt), when there is one
    train: TrainConfig = field(default_factory=lambda: TrainConfig(
        out_dir="runs/prune", lr=1e-4, warmup_steps=0, schedule="constant", max_epochs=1,
        validate=False, keep_epoch_checkpoints=False, save_every_steps=200))

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class BaselineConfig:
    """One baseline method at several head counts (``headlab prune baseline`` maps onto it)."""

    method: str  # random, michel or scores
    keeps: tuple[int, ...]
    kinds: tuple[str, ...] = ("enc_self",)
    scores: HeadScores | None = None  # method "scores": the table whose best heads are kept
    seeds: tuple[int | None, ...] = (None,)  # method "random": one run per seed
    finetune_steps: int = option(0, "fine-tune each pruned model this many steps (same budget as gated fine-tuning)",
                                 range="[0, inf)")
    from_scratch: bool = option(False, "train the pruned configuration from random init instead "
                                "(costs a full training)")
    dev_every: int = option(0, "with --finetune-steps: translate the development set (--dev-src/--dev-tgt) greedily "
                            "every N updates and before the first, as prune train does; the row's dev_plateau says "
                            "whether the fine-tuning had stopped moving (0: off)", metavar="N", range="[0, inf)")
    dev_sentences: int | None = option(None, "use the first N sentences of the development set (default: all)",
                                       metavar="N", range="[1, inf)")
    scratch_epochs: int = option(12, "epochs of --from-scratch", range="[1, inf)")
    # The from-scratch recipe; the defaults are the trainer's (what earlier rows trained with).
    # The bundled Multi30k models' recipe: --scratch-lr 7e-4 --scratch-epochs 14 --scratch-average-last 4.
    scratch_lr: float = option(1e-3, "peak learning rate of --from-scratch", range="(0, inf)")
    scratch_warmup_steps: int = option(400, "updates of linear warm-up of --from-scratch", range="[0, inf)")
    scratch_average_last: int = option(0, "score the mean of the last N epoch checkpoints of --from-scratch, as the "
                                       "full model was made (0: the last checkpoint)", range="[0, inf)")
    freeze_decoder: bool = option(False, "fine-tune (--finetune-steps) with every decoder parameter frozen, the "
                                  "embeddings it shares included, as gated fine-tuning of encoder heads does "
                                  "(Sec. 6.2)")
    lr: float = option(1e-4, "learning rate of the fine-tuning", range="(0, inf)")
    max_tokens: int = option(4096, "target tokens per batch", range="[1, inf)")
    mixed_precision: str = option("no", "bf16: autocast the fine-tuning's or the from-scratch training's forward "
                                  "and backward (weights and Adam stay fp32)", choices=("no", "bf16"))
    eval_beam: int = option(4, "beam of the evaluation's translations", range="[1, inf)")
    importance_batches: int | None = option(None, "batches per Michel importance pass (default: all)", range="[1, inf)")
    model_fingerprint: str = ""  # SHA-256 of the starting weights (headlab.resume.weights_fingerprint)
    scores_fingerprint: str = ""  # HeadScores.fingerprint() of the --scores file (method scores)
    scores_file_fingerprint: str = ""  # SHA-256 of its bytes, what rows recorded before (still accepted)
