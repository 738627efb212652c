"""Sequence pairs as token ids, and their padded training batches.

:class:`EncodedCorpus` is what the trainer batches (by target length,
:func:`headlab.data.batching.token_budget_batches`): pairs of a translation corpus, or a language
model's sentences (its targets are its inputs). :func:`collate` pads a batch of pairs for an
encoder-decoder model (teacher forcing); a language model brings its own (``headlab.lm.data``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from headlab.data.batching import token_budget_batches
from headlab.model_description import position_limit

__all__ = ["EncodedCorpus", "encode_corpus", "collate", "collate_for", "scoring_batches"]


@dataclass
class EncodedCorpus:
    """Token ids of sentence pairs (each ending in ``</s>``)."""

    sources: list[list[int]]
    targets: list[list[int]]
    n_truncated: int = 0

    def __len__(self) -> int:
        return len(self.sources)


def encode_corpus(tokenizer, corpus, max_positions: int = 256) -> EncodedCorpus:
    """Tokenize a :class:`~headlab.data.ParallelCorpus`; sequences longer than the model's
    positions are cut (keeping ``</s>``) and counted."""
    sources = tokenizer(list(corpus.sources), add_special_tokens=True)["input_ids"]
    targets = tokenizer(list(corpus.targets), add_special_tokens=True)["input_ids"]
    eos = tokenizer.eos_token_id
    n_truncated = 0
    for seqs in (sources, targets):
        for i, ids in enumerate(seqs):
            if len(ids) > max_positions:
                seqs[i] = ids[: max_positions - 1] + [eos]
                n_truncated += 1
    return EncodedCorpus(sources, targets, n_truncated)


def collate(corpus: EncodedCorpus, indices: Sequence[int], pad_id: int, decoder_start_id: int) -> dict:
    """Padded tensors for a batch: encoder input, decoder input (targets shifted right,
    starting with ``decoder_start_id``) and labels (padding as -100)."""
    n = len(indices)
    src_width = max(len(corpus.sources[i]) for i in indices)
    tgt_width = max(len(corpus.targets[i]) for i in indices)
    input_ids = torch.full((n, src_width), pad_id, dtype=torch.long)  # [batch, src_len]
    attention_mask = torch.zeros((n, src_width), dtype=torch.long)
    labels = torch.full((n, tgt_width), -100, dtype=torch.long)  # [batch, tgt_len]
    decoder_input_ids = torch.full((n, tgt_width), pad_id, dtype=torch.long)
    for row, i in enumerate(indices):
        src, tgt = corpus.sources[i], corpus.targets[i]
        input_ids[row, : len(src)] = torch.tensor(src)
        attention_mask[row, : len(src)] = 1
        labels[row, : len(tgt)] = torch.tensor(tgt)
        decoder_input_ids[row, 0] = decoder_start_id
        decoder_input_ids[row, 1 : len(tgt)] = torch.tensor(tgt[:-1])
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "decoder_input_ids": decoder_input_ids,
        "labels": labels,
    }


def collate_for(model, tokenizer) -> Callable[[EncodedCorpus, Sequence[int]], dict]:
    """:func:`collate` with the tokenizer's padding and the model's decoder start (``<pad>`` when
    the model names none)."""
    pad_id = tokenizer.pad_token_id
    start = getattr(model.config, "decoder_start_token_id", None)
    start = pad_id if start is None else start
    return lambda corpus, indices: collate(corpus, indices, pad_id, start)


def scoring_batches(model, tokenizer, data, batch_tokens: int) -> Iterator[dict]:
    """``data`` (parallel text or an :class:`EncodedCorpus`) in batches of ``batch_tokens`` target
    tokens in a fixed order, collated onto the model's device: for scoring, not for training."""
    if not isinstance(data, EncodedCorpus):
        data = encode_corpus(tokenizer, data, position_limit(model))
    collate_fn = collate_for(model, tokenizer)
    device = next(model.parameters()).device
    for indices in token_budget_batches(data, batch_tokens, seed=0, epoch=0):
        yield {k: v.to(device) for k, v in collate_fn(data, indices).items()}
