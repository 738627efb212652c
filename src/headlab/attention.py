"""headlab's own attention function, registered with transformers' ``AttentionInterface``.

It computes what the eager path computes (scores ``q k^T * scaling``, T5's position bias,
Gemma-style soft-capping, the mask, a softmax in float32 (or wider), ``probs @ v``) a few query rows at a
time: at most ``query_chunk`` rows of every head, ``[batch, n_heads, query_chunk, k_len]``, exist
at once, and each chunk of probabilities is handed to the module's sink (see
:func:`headlab.capture.stream_attention`) before it is dropped. Peak memory grows linearly in
the length, not with its square, and the model's output is the eager one.

The mask comes from transformers' SDPA mask builder (registered under the same name): a boolean
``[batch, 1, q, k]`` mask, or None where the pattern is plain causal or full, which is then
applied here chunk by chunk as SDPA would (``is_causal``, upper-left aligned).

A model uses this only when its attention classes dispatch through ``ALL_ATTENTION_FUNCTIONS``
(:func:`dispatches`); others keep the eager capture.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["NAME", "AttentionChunk", "ChunkSink", "SINK_ATTRIBUTE", "attention_forward", "dispatches", "register"]

NAME = "headlab_chunked"
"""The name under which the function (and its mask builder) is registered."""

SINK_ATTRIBUTE = "_headlab_chunk_sink"
"""Attribute of an attention module holding its :class:`ChunkSink` while a capture is active."""


@dataclass(frozen=True)
class AttentionChunk:
    """Query rows ``start:stop`` of one block's probabilities, ``[batch, n_heads, stop - start, k_len]``
    (float32, or float64 for a float64 model)."""

    probs: torch.Tensor
    start: int
    stop: int
    q_len: int

    @property
    def last(self) -> bool:
        return self.stop == self.q_len


@dataclass
class ChunkSink:
    """Where one attention module's chunks go: ``callback(chunk)`` (None: compute only)."""

    query_chunk: int
    callback: Callable[[AttentionChunk], None] | None = None
    calls: int = 0


def _scores_mask(attention_mask, start: int, stop: int, k_len: int) -> torch.Tensor | None:
    if attention_mask is None:
        return None
    mask = attention_mask[:, :, start:stop] if attention_mask.shape[2] > 1 else attention_mask
    return mask[..., :k_len]


def attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """``(output [batch, q_len, n_heads, d_head], None)``, as transformers' attention functions return."""
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("headlab's chunked attention does not implement attention sinks (s_aux); "
                                  "run without --query-chunk (eager capture)")
    sink: ChunkSink | None = getattr(module, SINK_ATTRIBUTE, None)
    groups = getattr(module, "num_key_value_groups", 1) or 1
    if query.shape[1] != key.shape[1]:
        groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: as transformers' repeat_kv
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    softcap = kwargs.get("softcap")
    position_bias = kwargs.get("position_bias")
    q_len, k_len = query.shape[2], key.shape[2]
    is_causal = kwargs.get("is_causal")
    is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    causal = bool(q_len > 1 and attention_mask is None and is_causal)
    if causal and k_len > q_len:  # as SDPA: an empty static cache's extra keys are dropped
        key, value, k_len = key[:, :, :q_len], value[:, :, :q_len], q_len
        if position_bias is not None:
            position_bias = position_bias[..., :q_len]
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        attention_mask = ~attention_mask  # True where a key is hidden
        fill = torch.finfo(torch.float32).min  # as eager's additive minimum: a fully hidden row is uniform
    step = sink.query_chunk if sink is not None and sink.query_chunk > 0 else q_len
    outputs = []
    key_t = key.transpose(2, 3)
    for start in range(0, q_len, step):
        stop = min(start + step, q_len)
        scores = torch.matmul(query[:, :, start:stop], key_t) * scaling
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if position_bias is not None:
            scores = scores + (position_bias[:, :, start:stop] if position_bias.shape[2] > 1 else position_bias)
        mask = _scores_mask(attention_mask, start, stop, k_len)
        if mask is not None:
            scores = scores.masked_fill(mask, fill) if mask.dtype == torch.bool else scores + mask
        elif causal:
            hidden = torch.arange(start, stop, device=scores.device)[:, None] < torch.arange(k_len, device=scores.device)
            scores = scores.masked_fill(hidden, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
        del scores
        if sink is not None and sink.callback is not None:
            sink.callback(AttentionChunk(probs.detach(), start, stop, q_len))
        weights = probs.to(value.dtype)
        if dropout and module.training:
            weights = nn.functional.dropout(weights, p=dropout, training=True)
        outputs.append(torch.matmul(weights, value))
        del probs, weights
    if sink is not None:
        sink.calls += 1
    output = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)
    return output.transpose(1, 2).contiguous(), None


_registered = False


def register() -> str:
    """Register the function and its mask builder with transformers (once); returns :data:`NAME`."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(NAME, attention_forward)
        AttentionMaskInterface.register(NAME, sdpa_mask)
        _registered = True
    return NAME


def dispatches(module: nn.Module) -> bool:
    """Whether ``module``'s forward picks its attention function from transformers' registry
    (``ALL_ATTENTION_FUNCTIONS``), so that setting the implementation to :data:`NAME` reaches it."""
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return False
    return "ALL_ATTENTION_FUNCTIONS" in source and hasattr(getattr(module, "config", None), "_attn_implementation")
