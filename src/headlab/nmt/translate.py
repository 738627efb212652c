"""Batched translation with ``model.generate`` (beam search by default)."""

from __future__ import annotations

from typing import Sequence

import torch

from headlab.capture import eval_mode, float32_mask_floor
from headlab.data.batching import length_batches, with_progress

__all__ = ["translate", "source_limit"]


def source_limit(model, tokenizer) -> int:
    """The most source tokens the model is given: the tokenizer's and the model's maximum."""
    max_positions = getattr(model.config, "max_position_embeddings", 1024)
    return min(max(tokenizer.model_max_length, 1), max_positions)


def translate(
    model,
    tokenizer,
    sentences: Sequence[str],
    *,
    beam: int = 4,
    batch_size: int = 64,
    max_length_a: float = 1.5,
    max_length_b: int = 10,
    progress: bool = False,
    truncated: list[int] | None = None,
) -> list[str]:
    """Translate ``sentences``; one output per input, same order.

    Empty (or whitespace-only) inputs give empty outputs without running the model. Inputs
    are sorted by length into batches of ``batch_size`` sentences (little padding) and the
    outputs put back in input order. At most ``max_length_a * source_len + max_length_b``
    tokens are generated per batch (capped by the model's positions). ``beam=1`` is greedy.
    An input longer than :func:`source_limit` is cut to it; its index is appended to
    ``truncated`` when that list is given, so that the caller can say so.
    """
    if beam < 1:
        raise ValueError(f"beam must be at least 1, got {beam}")
    outputs = [""] * len(sentences)
    todo = [i for i, s in enumerate(sentences) if s.strip()]
    if not todo:
        return outputs
    max_positions = getattr(model.config, "max_position_embeddings", 1024)
    limit = source_limit(model, tokenizer)
    texts = [sentences[i].strip() for i in todo]
    if truncated is not None:
        full = tokenizer(texts, verbose=False)["input_ids"]
        truncated.extend(i for i, ids in zip(todo, full) if len(ids) > limit)
    encoded = tokenizer(texts, truncation=True, max_length=limit)["input_ids"]
    lengths = {i: len(ids) for i, ids in zip(todo, encoded)}
    by_index = dict(zip(todo, encoded))
    pad_id = tokenizer.pad_token_id
    device = next(model.parameters()).device
    batches = with_progress(length_batches(lengths, batch_size, todo), progress, "translate", unit="batch")
    # the floor: a float64 eager model's padding query that may attend to no key is NaN otherwise (capture's)
    with eval_mode(model), torch.inference_mode(), float32_mask_floor(model):
        for batch in batches:
            width = max(lengths[i] for i in batch)
            input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, i in enumerate(batch):
                ids = by_index[i]
                input_ids[row, : len(ids)] = torch.tensor(ids)
                attention_mask[row, : len(ids)] = 1
            # Decoder length includes the start token; Marian's positions cap it.
            max_length = min(int(max_length_a * width + max_length_b) + 1, max_positions)
            generated = model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                num_beams=beam,
                do_sample=False,
                max_length=max_length,
                early_stopping=True if beam > 1 else False,
            )
            texts = tokenizer.batch_decode(generated, skip_special_tokens=True)
            for i, text in zip(batch, texts):
                outputs[i] = text.strip()
    return outputs
