"""Block-sparse BigBird's dense [batch, heads, q, k] maps worked out by hand from each layer's queries and keys
(transformers 5.24, BigBirdBlockSparseAttention in evaluation mode), written apart from
``headlab.adapters.big_bird.sparse_probs`` (which reads the module's own dense map) to check it. Blocks of
``block_size`` tokens: the first and the last block's queries attend over every key; block 1 over blocks 0, 1, 2, the
last and ``num_random_blocks`` random ones; block n-2 over 0, n-3, n-2, n-1 and the random ones; a middle block i over
0, i-1, i, i+1, n-1 and the random ones. In evaluation mode every random block is block 0 (its keys enter the softmax
again: repeats add up). Masked keys get -10000 as transformers' (exp underflows to 0 in float64); a padded query's
row is zero (its output is).
"""

from __future__ import annotations

import math

import torch


def by_hand(core, hidden: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """The map of ``core`` (a ``BigBirdBlockSparseAttention``) on ``hidden`` ``[batch, padded seq, d]``, ``real``
    ``[batch, padded seq]`` its attention mask (from_mask)."""
    batch, length, _ = hidden.shape
    heads, d, r, size = core.num_attention_heads, core.attention_head_size, core.num_random_blocks, core.block_size
    q = core.query(hidden).view(batch, length, heads, d).transpose(1, 2)
    k = core.key(hidden).view(batch, length, heads, d).transpose(1, 2)
    n = length // size
    dense = torch.zeros(batch, heads, length, length, dtype=hidden.dtype)
    for block in range(n):
        keys = list(range(n)) if block in (0, n - 1) else \
            [0, 1, 2, n - 1] if block == 1 else [0, n - 3, n - 2, n - 1] if block == n - 2 else \
            [0, block - 1, block, block + 1, n - 1]
        keys += [0] * r * (block not in (0, n - 1))
        columns = torch.cat([torch.arange(b * size, (b + 1) * size) for b in keys])
        rows = slice(block * size, (block + 1) * size)
        scores = q[:, :, rows] @ k[:, :, columns].transpose(-1, -2) / math.sqrt(d)
        scores = scores + (1 - real[:, None, None, columns]) * -10000.0
        dense[:, :, rows].index_add_(-1, columns, scores.softmax(-1))
    return dense * real[:, None, :, None]


def dense_maps(model, inputs: dict) -> tuple[torch.Tensor, ...]:
    """One map per (encoder) layer of ``model`` on ``inputs`` (a forward of its own), cut back to the input's
    length."""
    cores = [m for m in model.modules()
             if type(m).__name__ in ("BigBirdBlockSparseAttention", "BigBirdPegasusBlockSparseAttention")]
    seen: dict[int, tuple] = {}
    handles = [core.register_forward_hook(lambda module, args, output, i=i: seen.__setitem__(i, (args[0], args[2])))
               for i, core in enumerate(cores)]
    try:
        with torch.no_grad():
            model(**inputs)
            length = inputs["input_ids"].shape[1]
            return tuple(by_hand(core, seen[i][0], seen[i][1][:, 0, :, 0])[:, :, :length, :length]
                         for i, core in enumerate(cores))
    finally:
        for handle in handles:
            handle.remove()


def long_treebank(path, sentences: int = 4, words: int = 18) -> None:
    """A CoNLL-U file of ``sentences`` sentences of ``words`` words drawn from the sample treebank's (a flat tree, word 1
    the root): with a word tokenizer's two special tokens, ``words + 2`` tokens each, one block count for every batch
    (block-sparse BigBird refuses the sample's short sentences)."""
    from support.treebank import SAMPLE_CONLLU

    vocabulary = sorted({line.split("\t")[1] for line in SAMPLE_CONLLU.splitlines() if line and line[0].isdigit()})
    g = torch.Generator().manual_seed(0)
    blocks = []
    for n in range(1, sentences + 1):
        chosen = [vocabulary[i] for i in torch.randint(0, len(vocabulary), (words,), generator=g).tolist()]
        rows = [f"{i}\t{w}\t{w}\tX\tX\t_\t{0 if i == 1 else 1}\t{'root' if i == 1 else 'dep'}\t_\t_"
                for i, w in enumerate(chosen, start=1)]
        blocks.append("\n".join([f"# sent_id = s{n}", "# text = " + " ".join(chosen), *rows]) + "\n")
    path.write_text("\n".join(blocks), encoding="utf-8")
