"""Which sentences go into one batch: the trainers' token-budget batches and the analyses'
length-sorted batches of a fixed number of sentences. Every grouping of sentences into batches
is here (the padded tensors of the importance measures' batches: :mod:`headlab.data.inputs`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from headlab.errors import HeadlabError, counted

__all__ = ["token_budget_batches", "length_batches", "with_progress"]


def token_budget_batches(
    corpus: Any,
    max_tokens: int,
    *,
    seed: int,
    epoch: int,
    rank: int = 0,
    world_size: int = 1,
) -> list[list[int]]:
    """This rank's batches (lists of pair indices) of ``corpus`` (an encoded corpus: ``sources``
    and ``targets``, token ids) for one epoch; deterministic in (seed, epoch).

    Pairs are sorted by (target length, source length, random tie-break), cut into batches of
    at most ``max_tokens`` target tokens, and the batch order shuffled. The batch list is cut
    to a multiple of ``world_size`` and dealt out round-robin, so every rank runs the same
    number of steps on different data.
    """
    n = len(corpus)
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    noise = torch.rand(n, generator=generator).tolist()
    order = sorted(range(n), key=lambda i: (len(corpus.targets[i]), len(corpus.sources[i]), noise[i]))
    batches: list[list[int]] = []
    batch: list[int] = []
    tokens = 0
    for i in order:
        size = len(corpus.targets[i])
        if batch and tokens + size > max_tokens:
            batches.append(batch)
            batch, tokens = [], 0
        batch.append(i)
        tokens += size
    if batch:
        batches.append(batch)
    permutation = torch.randperm(len(batches), generator=generator).tolist()
    batches = [batches[j] for j in permutation]
    usable = len(batches) // world_size * world_size
    if usable == 0:
        raise HeadlabError(
            f"too little data for {world_size} processes: {counted(len(batches), 'batch', 'batches')} of {max_tokens} tokens"
        )
    return batches[:usable][rank::world_size]


def with_progress(batches: Iterable, enabled: bool, desc: str, **bar: Any) -> Iterable:
    """``batches`` behind a progress bar named ``desc`` when ``enabled`` (tqdm's keywords in ``bar``)."""
    if not enabled:
        return batches
    from tqdm.auto import tqdm

    return tqdm(batches, desc=desc, **bar)


def length_batches(lengths: Sequence | Mapping[int, Any], batch_size: int,
                   indices: Sequence[int] | None = None) -> list[list[int]]:
    """``indices`` (default: all) longest first, in batches of ``batch_size``: little padding.

    A length is a number or a tuple of them, compared in order; equal ones keep their order."""
    order = sorted(range(len(lengths)) if indices is None else indices, key=lambda i: lengths[i], reverse=True)
    return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]
