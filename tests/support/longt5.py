"""LongT5's dense [batch, heads, n, n] maps worked out, one entry at a time, from what its ``output_attentions``
returns for the local encoder (transformers 5.24, LongT5LocalAttention): ``encoder_attentions[l]``
``[batch, blocks, heads, block_len, 3 * block_len]``, the tokens in blocks of ``block_len = local_radius + 1`` (the
last padded), block ``b``'s queries over the keys of blocks ``b - 1, b, b + 1`` (zero blocks padding both ends).
Written apart from ``headlab.adapters.families.longt5_local_probs`` (which reads the attention module's own output) to
check it.
"""

from __future__ import annotations

import torch


def dense_maps(attentions: tuple, n: int, attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """One dense map per layer, cut to the ``n`` input tokens. Of a real query (``attention_mask`` 1; None: every
    token) it asserts that nothing falls outside ``local_radius`` or off the tokens, so that its row sums to one."""
    maps = []
    for blocked in attentions:
        batch, blocks, heads, block_len, width = blocked.shape
        assert width == 3 * block_len and blocks * block_len >= n
        dense = torch.zeros(batch, heads, n, n, dtype=blocked.dtype)
        for b in range(batch):
            for q in range(n):
                block, row = divmod(q, block_len)
                real = attention_mask is None or bool(attention_mask[b, q])
                for column in range(width):
                    key = (block - 1) * block_len + column
                    if 0 <= key < n:
                        dense[b, :, q, key] = blocked[b, block, :, row, column]
                    if real and not (0 <= key < n and abs(key - q) < block_len):
                        assert bool((blocked[b, block, :, row, column] == 0).all()), (b, q, column)
        maps.append(dense)
    return tuple(maps)
