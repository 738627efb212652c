"""Pieces shared by the measures: per-example gates and the loss (gradient importance and
ablation), and the per-head score tables every measure fills (:func:`block_scores`), and the
heads of a mask as those tables name them (:func:`original_mask`)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from headlab.adapters import AttentionBlock, attention_blocks
from headlab.data.inputs import Batch
from headlab.errors import HeadlabError
from headlab.gates import HeadGates, validate_heads
from headlab.heads import KINDS, HeadScores, HeadSpec
from headlab.model_description import ModelInfo
from headlab.surgery import original_heads

__all__ = ["ExampleGates", "block_scores", "check_finite_loss", "forward_logits", "original_heads", "original_mask",
           "masked_signature",
           "sequence_nll"]


class ExampleGates(HeadGates):
    """One gate row per example: ``values[(kind, layer)]`` is ``[rows, n_heads]``.

    Different rows of a batch can switch off different heads, so one forward pass evaluates
    many masked variants (ablation) or yields per-example gate gradients (gradient
    importance). When a block sees a batch that is a multiple of ``rows`` (beam search
    expands every example into consecutive beams), each row is repeated to match.
    """

    def __init__(self, values: Mapping[tuple[str, int], torch.Tensor]):
        super().__init__({key: int(v.shape[-1]) for key, v in values.items()})
        self.rows = dict(values)

    def gate(self, key: tuple[str, int]) -> torch.Tensor:
        return self.rows[key]

    def gate_heads(self, block: AttentionBlock, heads: torch.Tensor) -> torch.Tensor:
        if block.key not in self.rows:
            return heads
        g = self.rows[block.key].to(device=heads.device, dtype=heads.dtype)  # [rows, n_heads]
        if g.shape[0] != heads.shape[0]:
            if heads.shape[0] % g.shape[0]:
                raise HeadlabError(f"gates for {g.shape[0]} examples cannot cover a batch of {heads.shape[0]}")
            g = g.repeat_interleave(heads.shape[0] // g.shape[0], dim=0)
        return heads * g[:, None, :, None]  # [batch, 1, n_heads, 1]


def forward_logits(model: nn.Module, inputs: Mapping[str, torch.Tensor], info: ModelInfo, **extra) -> torch.Tensor:
    """``[batch, t_len, vocab]`` logits; a classifier's ``[batch, classes]`` as ``[batch, 1, classes]``
    (one step per text, so that the task loss is :func:`sequence_nll` of its label)."""
    kwargs = {"use_cache": False} if info.is_seq2seq else {}
    logits = model(**inputs, **kwargs, **extra).logits
    return logits[:, None, :] if info.arch == "classifier" else logits


def sequence_nll(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per example: summed token negative log-likelihood and number of scored tokens.

    ``logits`` ``[batch, t_len, vocab]``, ``labels`` ``[batch, t_len]`` with -100 for tokens
    that are not scored.
    """
    scored = labels != -100
    nll = torch.nn.functional.cross_entropy(
        logits.float().flatten(0, 1), labels.clamp(min=0).flatten(), reduction="none"
    ).view(labels.shape)
    # where, not * scored: a padding position's logits may be NaN (a float64 eager model's query that sees no key),
    # and NaN * 0 is NaN
    return torch.where(scored, nll, 0.0).sum(-1), scored.sum(-1)


def check_finite_loss(measure: str, values: torch.Tensor, where: str) -> None:
    """Refuse a NaN or inf in ``values`` (losses of the scored tokens, gradients): a score made of it would be
    NaN, or, through argmax (a NaN logit makes the loss NaN too) or a NaN-skipping sum, silently wrong. The measures run under
    :func:`headlab.capture.float32_mask_floor`, so it is not a float64 eager model's padding query that sees no
    key (the NaN :func:`headlab.prune_check.own_nan_cause` names)."""
    if not bool(values.isfinite().all()):
        raise HeadlabError(
            f"{measure}: the model computes NaN or inf {where}, at tokens that are scored (not padding; float64 "
            "attention masks were already floored at float32's lowest value, so it is not a padding query that may "
            "attend to no key): in its weights, or an overflow in its dtype; load it in float32 or check its weights; "
            "nothing was scored")


def expand_batch(batch: Batch, copies: int) -> dict[str, torch.Tensor]:
    """The batch's inputs repeated ``copies`` times along the batch dimension (copy-major)."""
    return {key: value.repeat(copies, *([1] * (value.dim() - 1))) for key, value in batch.inputs.items()}


def block_scores(blocks: list[AttentionBlock], values: dict[tuple[str, int], np.ndarray],
                 kinds: tuple[str, ...] | None = None) -> dict[str, np.ndarray]:
    """``{kind: [n_layers, n_heads]}`` from per-block vectors (only ``kinds``, when given); heads
    without a value are NaN. Idle blocks (towers token ids never run) are left out: a kind whose idle blocks are
    numbered after the text's (ModernVBERT's tower) gets the text model's table, as the text model alone would."""
    blocks = [block for block in blocks if not block.idle]
    shapes: dict[str, tuple[int, int]] = {}
    for block in blocks:
        _, n_original = original_heads(block)
        layers, heads = shapes.get(block.kind, (0, 0))
        shapes[block.kind] = (max(layers, block.layer + 1), max(heads, n_original))
    out = {kind: np.full(shape, np.nan) for kind, shape in shapes.items()}
    for block in blocks:
        if block.key not in values:
            continue
        numbering, _ = original_heads(block)
        vector = np.asarray(values[block.key], dtype=np.float64)
        for h, original in enumerate(numbering):
            out[block.kind][block.layer, original] = vector[h]
    return {kind: out[kind] for kind in KINDS if kind in out and (kinds is None or kind in kinds)}


def original_mask(model: nn.Module, mask: HeadSpec) -> dict[tuple[str, int], list[int]]:
    """``mask`` in the current numbering (as :func:`~headlab.gates.mask_heads` takes it: a pruned
    layer's kept heads are ``0..n-1``) with each head at its original index, as :func:`block_scores`
    names it: a layer that kept heads 1 and 3 calls head 3 its head 1. Checked as ``mask_heads``
    checks it (:class:`HeadlabError` for an unknown block or head); its keys and sorted lists are
    kept as given (an unpruned model's mask comes back as it was)."""
    blocks = attention_blocks(model)
    validate_heads(blocks, mask)
    numbering = {block.key: original_heads(block)[0] for block in blocks}
    return {key: sorted(numbering[key[0], int(key[1])][h] for h in heads) for key, heads in mask.items()}


def masked_signature(table: HeadScores, removed: Mapping[tuple[str, int], list[int]]) -> HeadScores:
    """``table`` with NaN for the ``removed`` heads (:func:`original_mask`'s numbering) and its signature's options
    recording them (``"mask": {"kind:layer": [head, ...]}``, as :func:`~headlab.importance.run_importance` writes it),
    so that a table measured with heads switched off says which."""
    blanked = table.without(removed)
    recorded = table.signature.get("options")
    options = {**(recorded if isinstance(recorded, Mapping) else {}),
               "mask": {f"{kind}:{layer}": list(heads) for (kind, layer), heads in removed.items()}}
    return HeadScores(blanked.scores, blanked.method, blanked.model, {**blanked.signature, "options": options})
