"""Training a translation model: the engine's loop (:func:`headlab.training.loop.train`) validated
by BLEU.

What is the translation's own is here: after each epoch the development set is translated
(beam ``valid_beam``) and scored by BLEU (the score the best checkpoint and the patience rule
follow) and chrF, beside the teacher-forced loss. Everything else (batches, loss, checkpoints,
resume) is the engine's.
"""

from __future__ import annotations

from typing import Any, Callable, Collection, Sequence

import torch

from headlab.training.config import TrainConfig
from headlab.training.corpus import EncodedCorpus
from headlab.training.loop import TrainResult
from headlab.training.loop import train as train_loop
from headlab.training.losses import evaluate_loss, label_smoothed_loss

__all__ = ["TrainConfig", "train", "validate_translation"]


def validate_translation(model, tokenizer, valid, config: TrainConfig) -> dict:
    """BLEU (the score) and chrF of ``model``'s translations of ``valid`` (a ParallelCorpus), and
    its loss."""
    from headlab.nmt.bleu import compute_scores
    from headlab.nmt.translate import translate

    hypotheses = translate(model, tokenizer, valid.sources, beam=config.valid_beam, batch_size=config.valid_batch_size)
    scores = compute_scores(hypotheses, valid.targets)
    # The loss (teacher-forced, no label smoothing) is smoother than BLEU: a curve to read beside it.
    loss = evaluate_loss(model, tokenizer, valid, batch_tokens=config.max_tokens)
    return {"score": scores.bleu, "bleu": scores.bleu, "chrf": scores.chrf, "beam": config.valid_beam, "loss": loss}


def train(
    model,
    tokenizer,
    train_data,
    valid_data=None,
    config: TrainConfig | None = None,
    *,
    compute_loss: Callable[[Any, dict, TrainConfig], tuple[torch.Tensor, int]] = label_smoothed_loss,
    collate_fn: Callable[[EncodedCorpus, Sequence[int]], dict] | None = None,
    extra_loss: Callable[[Any, dict, int], torch.Tensor] | None = None,
    trainable: Callable[[str, torch.nn.Parameter], bool] | Collection[str] | None = None,
    callback: Callable[[Any, int, dict], None] | None = None,
    callback_every: int = 100,
    validate_fn: Callable[[Any, Any, Any, TrainConfig], dict] | None = None,
    optimizer_factory: Callable[[list[torch.nn.Parameter], TrainConfig], torch.optim.Optimizer] | None = None,
    accelerator=None,
    log: Callable[[str], None] | None = None,
) -> TrainResult:
    """Train a translation model: :func:`headlab.training.loop.train` (see it for the hooks) with
    ``validate_fn`` :func:`validate_translation` unless given. ``valid_data``: a ParallelCorpus
    (raw references for BLEU) or None."""
    return train_loop(model, tokenizer, train_data, valid_data, config, compute_loss=compute_loss,
                      collate_fn=collate_fn, extra_loss=extra_loss, trainable=trainable, callback=callback,
                      callback_every=callback_every, validate_fn=validate_fn or validate_translation,
                      optimizer_factory=optimizer_factory, accelerator=accelerator, log=log)
