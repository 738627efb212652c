"""PEGASUS-X's dense [batch, heads, n, n] encoder maps worked out, one entry at a time, from what its
``output_attentions`` returns (transformers 5.24, PegasusXGlobalLocalAttention): ``encoder_attentions[l]`` is a dict
whose ``"local"`` is ``[batch, heads, blocks, block_size, num_global_tokens + block_size]``, each token of the layer's
padded input over [the global tokens | its block]. The layer's input is the encoder's tokens padded to a multiple of
block_size, with block_size / 2 slots more before and after them in a staggered layer. Written apart from
``headlab.adapters.families.pegasus_x_probs`` (which reads the attention module's own output) to check it.
"""

from __future__ import annotations

import torch


def dense_maps(attentions: tuple, n: int, block_size: int, staggered: list[bool],
               attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """One dense map per layer, cut to the ``n`` input tokens, the global tokens' columns left out. Of a real query
    (``attention_mask`` 1; None: every token) it asserts that no key of its block outside the input's tokens has
    probability, so that its row plus its global share sums to one."""
    maps = []
    for layer, probs in enumerate(attentions):
        local = probs["local"]
        batch, heads, blocks, size, width = local.shape
        assert size == block_size
        shift = block_size // 2 if staggered[layer] else 0
        n_global = width - size
        dense = torch.zeros(batch, heads, n, n, dtype=local.dtype)
        for b in range(batch):
            for q in range(n):
                block, row = divmod(q + shift, size)
                real = attention_mask is None or bool(attention_mask[b, q])
                for column in range(size):
                    key = block * size + column - shift
                    if 0 <= key < n:
                        dense[b, :, q, key] = local[b, :, block, row, n_global + column]
                    if real and not (0 <= key < n and (attention_mask is None or bool(attention_mask[b, key]))):
                        assert bool((local[b, :, block, row, n_global + column] == 0).all()), (b, q, column)
        maps.append(dense)
    return tuple(maps)
