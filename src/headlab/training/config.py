"""The options of the training loop (:func:`headlab.training.loop.train`), shared by ``headlab nmt
train``, ``headlab lm train`` and ``headlab prune``. Plain values; importing this module costs no
torch (the commands generate their flags from them, :mod:`headlab.options`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from headlab.options import option

__all__ = ["TrainConfig"]


@dataclass
class TrainConfig:
    """Options of the training loop. ``headlab nmt train`` maps its flags onto these fields."""

    out_dir: str = option("runs/nmt", "output directory (checkpoints, best/, tokenizer/)", flag="out",
                          required=True)
    max_tokens: int = option(4096, "target tokens per batch and process (padding not counted)", range="[1, inf)")
    lr: float = option(1e-3, "peak learning rate (of the model's parameters), reached after --warmup-steps", range="(0, inf)")
    # Vaswani et al. 2017 use 4000 for WMT; scaled to the data size
    warmup_steps: int = option(400, "updates of linear learning-rate warm-up", range="[0, inf)")
    schedule: str = "inverse_sqrt"  # or "constant" (after the same linear warm-up)
    adam_betas: tuple[float, float] = (0.9, 0.98)
    adam_eps: float = 1e-9
    weight_decay: float = 0.0
    label_smoothing: float = option(0.1, "label smoothing of the cross-entropy", range="[0, 1)")
    mixed_precision: str = option("no", "bf16: autocast the forward and backward (about 1.7x faster on CPUs with "
                                  "AVX512-BF16/AMX; weights and Adam stay fp32)", choices=("no", "bf16"))
    clip_norm: float = option(1.0, "gradient-norm clipping; 0 turns it off", range="[0, inf)")
    max_epochs: int = option(12, "maximum number of epochs", flag="epochs", range="[1, inf)")
    max_steps: int | None = option(None, "stop after this many updates (all epochs together)", range="[1, inf)")
    max_time_minutes: float | None = option(None, "stop (with a resumable checkpoint) after this many minutes",
                                            flag="max-time", range="(0, inf)")
    save_every_steps: int | None = option(None, "also write a resume checkpoint every N steps", flag="save-every",
                                          range="[1, inf)")
    validate: bool = True  # validation after each epoch (needs validation data)
    # greedy validation is ~4x faster than beam 4 and ranks epochs alike
    valid_beam: int = option(1, "beam of the validation BLEU (1: greedy)", range="[1, inf)")
    valid_batch_size: int = 100
    average_last: int = option(0, "average the last N epoch checkpoints at the end (0: off)", range="[0, inf)")
    # Early stopping: stop ("converged") once `patience` epochs in a row have not raised the
    # validation score by at least `min_improvement` over the best so far (0: off).
    patience: int = option(0, "stop after this many epochs without a validation gain of --min-improvement (0: off); "
                           "epochs that end inside the warm-up do not count", range="[0, inf)")
    min_improvement: float = option(0.0, "smallest validation gain over the best so far that counts as progress "
                                    "(BLEU points; for a language model or --patience-metric loss, nats per token "
                                    "of loss below the lowest so far)")
    # What the patience rule reads: the validation score (BLEU for translation, the negated loss
    # for a language model) or the validation loss. The best checkpoint is always the best score.
    patience_metric: str = option("score", "what the patience rule reads: the validation score (BLEU for "
                                  "translation) or the validation loss (mean cross-entropy, lower is better)",
                                  choices=("score", "loss"))
    keep_epoch_checkpoints: bool = True
    seed: int = option(1, "random seed of the initialisation and the batch order", range="[0, inf)")
    resume: bool = option(False, "continue from the last checkpoint in --out")
    overwrite: bool = option(False, "replace a model already in --out")
    progress: bool = True

    def to_dict(self) -> dict:
        return asdict(self)
