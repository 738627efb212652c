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
    batch, n_heads, q_len, d_head = query.shape
    kv_heads = key.shape[1]
    groups = n_heads // kv_heads  # grouped-query attention: query head h reads key/value head h // groups
    if scaling is None:
        scaling = d_head ** -0.5
    softcap = kwargs.get("softcap")
    position_bias = kwargs.get("position_bias")
    k_len = key.shape[2]
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
    # Written chunk by chunk in the layout the caller gets, [batch, q_len, n_heads, d_head]: no list
    # of chunk outputs to concatenate and transpose at the end (each a copy of the whole output).
    output = value.new_empty(batch, q_len, n_heads, value.shape[-1])
    # Key/value heads are not repeated (as transformers' repeat_kv does, a copy of both per group):
    # each key/value head multiplies its group's query rows, [batch, kv_heads, groups * rows, ...].
    key_t = key.transpose(2, 3)  # [batch, kv_heads, d_head, k_len]
    for start in range(0, q_len, step):
        stop = min(start + step, q_len)
        rows = stop - start
        grouped = query[:, :, start:stop].reshape(batch, kv_heads, groups * rows, d_head)
        scores = torch.matmul(grouped, key_t).view(batch, n_heads, rows, k_len)
        scores.mul_(scaling)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if position_bias is not None:
            scores = scores + (position_bias[:, :, start:stop] if position_bias.shape[2] > 1 else position_bias)
        mask = _scores_mask(attention_mask, start, stop, k_len)
        if mask is not None:
            if mask.dtype == torch.bool:
                scores.masked_fill_(mask, fill)
            else:
                scores = scores + mask
        elif causal:
            hidden = torch.arange(start, stop, device=scores.device)[:, None] < torch.arange(k_len, device=scores.device)
            scores.masked_fill_(hidden, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
        del scores
        if sink is not None and sink.callback is not None:
            sink.callback(AttentionChunk(probs.detach(), start, stop, q_len))
        weights = probs.to(value.dtype)
        if dropout and module.training:
            weights = nn.functional.dropout(weights, p=dropout, training=True)
        chunk = torch.matmul(weights.view(batch, kv_heads, groups * rows, k_len), value)
        output[:, start:stop] = chunk.view(batch, n_heads, rows, -1).transpose(1, 2)
        del probs, weights, chunk
    if sink is not None:
        sink.calls += 1
    return output, None


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
