"""The training losses, each ``(model, batch, config) -> (loss summed over tokens, number of tokens)``,
all one cross-entropy (:func:`token_loss`) on what differs: which logits predict which labels.

* :func:`label_smoothed_loss` - an encoder-decoder model's, teacher-forced (the translation recipe);
* :func:`causal_lm_loss` - a decoder-only model's next-token loss: position ``i`` predicts
  ``labels[i]``, the inputs shifted by one (``headlab lm train``'s ``collate_lm``, or
  :func:`next_token_labels` of a batch that holds only the text, as ``prune train --loss causal_lm``'s);
* :func:`masked_lm_loss` - a masked LM's (Devlin et al. 2019).

:func:`evaluate_loss` is the mean loss per target token of a model over a corpus (no smoothing).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from headlab.capture import eval_mode, float32_mask_floor
from headlab.training.config import TrainConfig
from headlab.training.corpus import scoring_batches

__all__ = ["token_loss", "label_smoothed_loss", "causal_lm_loss", "next_token_labels", "masked_lm_loss",
           "evaluate_loss"]


def token_loss(logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0) -> tuple[torch.Tensor, int]:
    """The one cross-entropy of every loss here: summed over the tokens whose label is not -100
    (in fp32), and their number. ``logits`` ``[..., vocab]``, ``labels`` the same shape less the last axis."""
    loss_sum = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1),
                               ignore_index=-100, label_smoothing=label_smoothing, reduction="sum")
    return loss_sum, int((labels != -100).sum())


def label_smoothed_loss(model, batch: dict, config: TrainConfig) -> tuple[torch.Tensor, int]:
    """Sum of label-smoothed cross-entropy over target tokens, and their number.

    Label smoothing as in Szegedy et al. 2016 / Vaswani et al. 2017, Sec. 5.4 (epsilon 0.1).
    Swap this function (``train(..., compute_loss=...)``) for another kind of model.
    """
    outputs = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        decoder_input_ids=batch["decoder_input_ids"],
        use_cache=False,
    )
    # logits [batch, tgt_len, vocab], labels [batch, tgt_len]
    return token_loss(outputs.logits, batch["labels"], config.label_smoothing)


@torch.no_grad()
def evaluate_loss(model, tokenizer, data, batch_tokens: int = 2000, compute_loss: Callable | None = None) -> float:
    """Mean cross-entropy per target token (no label smoothing), model in eval mode."""
    config = TrainConfig(label_smoothing=0.0)
    compute_loss = compute_loss or label_smoothed_loss
    total, count = 0.0, 0
    with eval_mode(model), float32_mask_floor(model):  # a float64 eager model's padding rows: as in training
        for batch in scoring_batches(model, tokenizer, data, batch_tokens):
            loss_sum, n = compute_loss(model, batch, config)
            total += loss_sum.item()
            count += n
    return total / max(count, 1)


def causal_lm_loss(model, batch: dict, config: TrainConfig) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy of a decoder-only model (label-smoothed by
    ``config.label_smoothing``) and the number of predicted tokens: the logits at position ``i`` of
    ``input_ids`` predict ``labels[:, i]`` (-100: nothing). ``labels`` may be narrower than the
    inputs (:func:`next_token_labels`: the last position has no next token); the positions past
    its width are left out."""
    labels = batch["labels"]  # [batch, width <= len]
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    return token_loss(logits[:, : labels.shape[1]], labels, config.label_smoothing)  # [batch, width, vocab]


def next_token_labels(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The labels of :func:`causal_lm_loss` for a batch that holds only the text: each position's
    next token, padding -100; ``[batch, len - 1]`` for inputs ``[batch, len]``."""
    return input_ids[:, 1:].masked_fill(attention_mask[:, 1:] == 0, -100)


def masked_lm_loss(mask_token_id: int, probability: float = 0.15, special_ids: tuple[int, ...] = ()):
    """A masked-LM loss (Devlin et al. 2019, Sec. 3.1: 15% of tokens, replaced by [MASK])."""

    def loss(model, batch: dict, config: TrainConfig) -> tuple[torch.Tensor, int]:
        ids, mask = batch["input_ids"], batch["attention_mask"]
        chosen = (torch.rand(ids.shape, device=ids.device) < probability) & (mask == 1)
        for special in special_ids:
            chosen &= ids != special
        if not chosen.any():  # always predict at least one token
            chosen[0, 0] = True
        inputs = ids.masked_fill(chosen, mask_token_id)
        labels = ids.masked_fill(~chosen, -100)
        logits = model(input_ids=inputs, attention_mask=mask).logits  # [batch, len, vocab]
        return token_loss(logits, labels)  # the chosen tokens: the ids are never -100

    return loss
