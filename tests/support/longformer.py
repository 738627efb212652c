"""Longformer's dense [batch, heads, seq, seq] maps worked out, one entry at a time, from what its
``output_attentions`` returns (transformers 5.24, LongformerEncoder): ``attentions[l]``
``[batch, heads, seq, G + 2w + 1]`` (cut back to the input's length: the probabilities over the batch's G global
key slots, then over keys ``q - w .. q + w``) and, where some token attends globally, ``global_attentions[l]``
``[batch, heads, padded seq, G]`` (the global queries' rows, transposed, not cut). Written apart from
``headlab.adapters.families.longformer_probs`` (which reads the attention module's own output) to check it.
"""

from __future__ import annotations

import torch


def dense_maps(attentions: tuple, global_attentions: tuple | None, global_mask: torch.Tensor | None,
               window: int | list[int]) -> tuple[torch.Tensor, ...]:
    """One dense map per layer; ``global_mask`` ``[batch, seq]``: the tokens attending globally (None: none);
    ``window``: the config's attention_window, one for all layers or one per layer (a query sees ``window // 2``
    keys each side)."""
    maps = []
    for layer, band in enumerate(attentions):
        side = (window[layer] if isinstance(window, list) else window) // 2
        batch, heads, seq, width = band.shape
        slots = width - (2 * side + 1)
        dense = torch.zeros(batch, heads, seq, seq, dtype=band.dtype)
        for b in range(batch):
            positions = [] if global_mask is None else torch.nonzero(global_mask[b]).flatten().tolist()
            assert slots >= len(positions)
            for q in range(seq):
                for j in range(2 * side + 1):
                    key = q - side + j
                    if 0 <= key < seq:
                        dense[b, :, q, key] += band[b, :, q, slots + j]
                    else:  # before the first token or in the padding: nothing may fall there
                        assert bool((band[b, :, q, slots + j] == 0).all()), (layer, b, q, j)
                for g, position in enumerate(positions):
                    dense[b, :, q, position] += band[b, :, q, g]
                for g in range(len(positions), slots):  # a slot this sequence does not fill
                    assert bool((band[b, :, q, g] == 0).all())
            for g, position in enumerate(positions):
                assert global_attentions is not None
                rows = global_attentions[layer][b, :, :, g]  # [heads, padded seq]: the global query's row
                assert bool((rows[:, seq:] == 0).all())  # nothing on the padding
                dense[b, :, position] = rows[:, :seq]
        maps.append(dense)
    return tuple(maps)


def global_token_0(module, args, kwargs):
    """A forward pre-hook (``with_kwargs=True``) that hands a Longformer (or LED's encoder) a global attention mask
    choosing token 0 of every row: every forward attends globally from it, whoever made the inputs."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    chosen = torch.zeros_like(ids)
    chosen[:, 0] = 1
    return args, {**kwargs, "global_attention_mask": chosen}
