"""headlab's own attention function, registered with transformers' ``AttentionInterface``.

It computes what the eager path computes (scores ``q k^T * scaling``, T5's position bias,
Gemma-style soft-capping, the mask, learned attention sinks (``s_aux``: one more logit per head in the
softmax, dropped after), a softmax in float32 (or wider), ``probs @ v``) a few query rows at a
time: at most ``query_chunk`` rows of every head, ``[batch, n_heads, query_chunk, k_len]``, exist
at once, and each chunk of probabilities is handed to the module's sink (see
:func:`headlab.capture.stream_attention`) before it is dropped. Peak memory grows linearly in
the length, not with its square, and the model's output is the eager one.

A chunk computes scores, softmax and output over the keys its rows can see only: the prefix up to
the last key column that some query of the chunk sees (under a causal mask, the chunk's own last
position; with a mask, read from the mask), rounded up to :data:`KEY_BLOCK` columns. Every weight
beyond it is exactly 0 in eager's map too (a hidden key's score is the float minimum, whose
exponential underflows to 0 beside a visible key), so the chunk carries the prefix
(``chunk.probs``, ``[batch, n_heads, rows, chunk.keys]``) and the full width (``chunk.k_len``);
:meth:`AttentionChunk.full` puts the zeros back. A chunk with a fully hidden query row (left
padding: eager gives it a uniform row over every key) keeps every key.

The mask comes from transformers' SDPA mask builder (registered under the same name): a boolean
``[batch, 1, q, k]`` mask, or None where the pattern is plain causal or full, which is then
applied here chunk by chunk as SDPA would (``is_causal``, upper-left aligned). Sparse attention's
``indices`` (the keys a DeepSeek Sparse Attention indexer picked, which transformers folds into the
mask for eager and SDPA only) are folded into it first (:func:`selected_keys_mask`).

A model uses this only when its attention classes dispatch through ``ALL_ATTENTION_FUNCTIONS``
(:func:`dispatches`); others keep the eager capture.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from headlab.adapters.families import ATTENTION_SINKS

__all__ = ["NAME", "EAGER_MASKS_NAME", "KEY_BLOCK", "AttentionChunk", "AttentionCall", "ChunkSink", "SINK_ATTRIBUTE",
           "attention_forward", "dispatches", "chunk_rows", "register", "selected_keys_mask", "visible_keys"]

NAME = "headlab_chunked"
"""The name under which the function (and its mask builder) is registered."""

SINK_ATTRIBUTE = "_headlab_chunk_sink"
"""Attribute of an attention module holding its :class:`ChunkSink` while a capture is active."""

KEY_BLOCK = 64
"""A chunk's key prefix is rounded up to a multiple of this many columns (or to all keys). PyTorch's
vectorised CPU reductions along a row (the softmax's sum, the statistics' row sums) add each
column into an accumulator chosen by its position modulo a block (32 float32 or 16 float64
values on an AVX-512 CPU), so a row cut after a multiple of 64 columns, the rest being zeros, is
reduced in the same order as the whole row: the same bits (tests/test_chunked_attention.py and
tests/test_chunked_statistics.py check it)."""


@dataclass(frozen=True)
class AttentionChunk:
    """Query rows ``start:stop`` of one block's probabilities over the first ``keys`` keys,
    ``[batch, n_heads, stop - start, keys]`` (float32, or float64 for a float64 model); the weights
    on keys ``keys:k_len`` are exactly 0 (hidden from every row of the chunk) and not held."""

    probs: torch.Tensor
    start: int
    stop: int
    q_len: int
    k_len: int = -1  # all keys of the block; -1: the probabilities' width (no key left out)
    scores: torch.Tensor | None = None
    """The scores the probabilities are the softmax of (``[batch, n_heads, rows, keys]``, the model's
    dtype: scaled, biased, capped and masked, hidden keys at the dtype's minimum), where the chunk has
    them and every one is finite: ``log p = s - lse`` (:mod:`headlab.data.fused` takes entropies from
    them). None from the eager capture."""

    def __post_init__(self) -> None:
        if self.k_len < 0:
            object.__setattr__(self, "k_len", self.probs.shape[3])

    @property
    def last(self) -> bool:
        return self.stop == self.q_len

    @property
    def keys(self) -> int:
        """The keys held, ``probs.shape[3]`` (at most ``k_len``)."""
        return self.probs.shape[3]

    def full(self) -> torch.Tensor:
        """``[batch, n_heads, rows, k_len]``: the probabilities with the hidden keys' zeros put back."""
        if self.keys == self.k_len:
            return self.probs
        return nn.functional.pad(self.probs, (0, self.k_len - self.keys))


@dataclass(frozen=True)
class AttentionCall:
    """One call of the attention function, before any score is computed, for a :attr:`ChunkSink.kernel`:
    ``query`` ``[batch, n_heads, q_len, d]``, ``key``/``value`` ``[batch, kv_heads, k_len, d]``,
    ``mask`` as the model gave it (boolean True where a key is seen, an additive float mask, or
    None), ``causal`` (upper-left aligned, with no mask) and what else changes the scores."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    mask: torch.Tensor | None
    causal: bool
    scaling: float
    softcap: float | None = None
    position_bias: bool = False
    sinks: bool = False
    dropout: float = 0.0


@dataclass
class ChunkSink:
    """Where one attention module's chunks go: ``callback(chunk)`` (None: compute only)."""

    query_chunk: int
    callback: Callable[[AttentionChunk], None] | None = None
    calls: int = 0
    scores: bool = False  # hand each chunk's scores over too (AttentionChunk.scores)
    reuse: bool = False
    """The callback keeps no chunk's tensors past its return (it copies what it keeps): every chunk
    of a call may then be written into the same work buffers (:class:`_Buffers`)."""
    kernel: Callable[[AttentionCall], torch.Tensor | None] | None = None
    """Computes the whole call itself where it can (a fused kernel with the statistics,
    :mod:`headlab.data.attention_kernel`): the output ``[batch, q_len, n_heads, d]``, or None to
    leave the call to the chunks and ``callback``."""
    causal: bool | None = None
    """Whether the module's block attends causally (a ``dec_self`` block): what the attention function assumes where
    the model hands it no mask and no ``is_causal``. transformers' SDPA mask builder, which headlab's is, skips an
    all-visible causal mask and leaves causality to the module's ``is_causal``; NLLB-MoE's decoder self-attention
    says ``is_causal=False`` (its own eager mask makes it causal: it has no SDPA path), so the module's flag alone
    made its decoder bidirectional under headlab's engines (session 38's fused sweep)."""
    chunk_elements: int = 0
    """Where positive, on the CPU: fewer rows per chunk where ``query_chunk`` rows of every head of a
    sentence over all keys would hold more weights than this (:func:`chunk_rows`): the passes over a
    chunk then find it in the cache. ``query_chunk`` stays the most rows of a chunk."""


class _Buffers:
    """Work buffers of one call, reused by every chunk: a chunk's scores, probabilities and output
    rows are written into the leading part of a buffer sized for the largest chunk, not into fresh
    tensors. A fresh tensor of a few MB costs the first touch of its pages wherever the allocator
    maps large blocks anew (glibc above its mmap threshold): about as long again as the softmax or
    the matrix product that fills it, on the CPU. The largest chunk's tensors existed before too:
    the peak is the same."""

    def __init__(self) -> None:
        self.flat: dict[str, torch.Tensor] = {}

    def take(self, name: str, like: torch.Tensor, size: int, *shape: int) -> torch.Tensor:
        """A ``shape`` tensor of ``like``'s dtype and device in buffer ``name`` (``size`` elements: its largest use)."""
        flat = self.flat.get(name)
        if flat is None or flat.dtype != like.dtype:
            flat = self.flat[name] = like.new_empty(size)
        n = 1
        for extent in shape:
            n *= extent
        return flat[:n].view(shape)


def _scores_mask(attention_mask, start: int, stop: int, k_len: int) -> torch.Tensor | None:
    if attention_mask is None:
        return None
    mask = attention_mask[:, :, start:stop] if attention_mask.shape[2] > 1 else attention_mask
    return mask[..., :k_len]


def visible_keys(mask: torch.Tensor | None, causal: bool, stop: int, k_len: int) -> int:
    """How many leading keys query rows ``...:stop`` need: every key from the last one that some
    row sees on is hidden from all of them, rounded up to :data:`KEY_BLOCK` (at most ``k_len``).

    ``mask`` is the chunk's ``[batch, 1 | heads, rows, k_len]`` mask: boolean, True where a key is
    hidden, or additive (a key is hidden where it holds the dtype's minimum or -inf, whose
    weight underflows to exactly 0); None with ``causal``: upper-left aligned, row ``i`` sees keys
    ``0..i``; None otherwise: every key. A row that sees no key at all keeps every key, as eager's
    softmax spreads it uniformly over all of them."""
    if mask is None:
        needed = min(stop, k_len) if causal else k_len
    else:
        hidden = mask if mask.dtype == torch.bool else mask <= torch.finfo(mask.dtype).min
        seen = ~hidden
        if not bool(seen.any(-1).all()):
            return k_len
        columns = seen.flatten(0, -2).any(0).nonzero()
        needed = int(columns[-1, 0]) + 1
    return min(k_len, -(-needed // KEY_BLOCK) * KEY_BLOCK)


MIN_CHUNK_ROWS = 16
"""The fewest rows :func:`chunk_rows` gives a chunk (fewer would cost more in per-chunk overhead than the cache saves)."""


def chunk_rows(query_chunk: int, elements: int, n_heads: int, k_len: int) -> int:
    """Rows per chunk: ``query_chunk``, or fewer (down to :data:`MIN_CHUNK_ROWS`) where ``elements``
    is positive and one sentence's ``n_heads * rows * k_len`` weights would exceed it. Per sentence,
    not per batch: only long inputs get fewer rows (a batch of short sentences keeps its chunks,
    and the bits they give)."""
    if elements <= 0:
        return query_chunk
    fit = elements // max(1, n_heads * k_len)
    return max(1, min(query_chunk, max(MIN_CHUNK_ROWS, fit)))


PRESCALE_FLOOR = 2.0 ** -36
"""The smallest nonzero magnitude of a query or key component under which :func:`exact_prescale` says no."""


def exact_prescale(query: torch.Tensor, key: torch.Tensor, scaling: float) -> bool:
    """Whether ``(q * scaling) k^T`` is, to the bit, ``(q k^T) * scaling`` (eager's order), so that
    the scaling costs a pass over the query rows instead of one over the scores.

    It is where ``scaling`` is a power of two in ``[2^-8, 1)`` and the dtype float32 or float64,
    as long as no value of either computation leaves the normal range: multiplying by ``2^-e`` is
    then exact, and every rounding of the product's sums (in whatever order and with fused
    multiply-adds) commutes with it. With every nonzero component of ``q`` and ``k`` at least
    :data:`PRESCALE_FLOOR` (2^-36) in magnitude, every exact product and partial sum is a multiple
    of ``(2^-36 * 2^-23)^2 = 2^-118`` (float32: 24-bit significands; float64 finer), so any nonzero
    one, scaled by ``2^-8`` at least, stays at or above ``2^-126``, float32's smallest normal; and
    with ``max |q| max |k| d_head`` far below the dtype's largest value, no sum overflows.
    NaN and infinite components fail the last test."""
    if query.dtype not in (torch.float32, torch.float64) or key.dtype != query.dtype:
        return False
    mantissa, _ = math.frexp(scaling)
    if mantissa != 0.5 or not 2.0 ** -8 <= scaling < 1:
        return False
    largest = []
    for x in (query, key):
        magnitude = x.abs()
        if bool(((magnitude < PRESCALE_FLOOR) & (magnitude > 0)).any()):
            return False
        largest.append(float(magnitude.amax()) if magnitude.numel() else 0.0)
    # no sum near the dtype's largest value either (unscaled, it could overflow where the scaled one does not)
    return largest[0] * largest[1] * query.shape[-1] < torch.finfo(query.dtype).max / 4


def selected_keys_mask(attention_mask: torch.Tensor | None, indices: torch.Tensor, k_len: int,
                       dtype: torch.dtype) -> torch.Tensor:
    """``attention_mask`` with every key outside ``indices`` hidden too.

    DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-MoE-DSA and the like in transformers): an indexer
    picks the top-k keys of each query, ``indices [batch, q_len, topk]``; the attention modules fold
    them into the mask for eager and SDPA only and hand any other function the indices instead
    (``indices=``, for the flash-MLA kernel). Folded here as transformers folds them
    (``DeepseekV32Attention.forward``): a boolean mask (True where a key is seen) loses the keys not
    picked, an additive one gets ``dtype``'s minimum there, so that this function computes SDPA's
    (eager's) attention."""
    if attention_mask is None:  # the modules read the mask before attention (their indexer does): always built
        raise NotImplementedError("headlab's chunked attention got sparse attention indices without a mask")
    hidden = torch.ones(*indices.shape[:2], k_len, dtype=torch.bool, device=indices.device)
    hidden = hidden.scatter(-1, indices.long(), False).unsqueeze(1)  # [batch, 1, q_len, k_len]
    if attention_mask.dtype == torch.bool:
        return attention_mask & ~hidden
    return attention_mask.masked_fill(hidden, torch.finfo(dtype).min)


def _as_boolean(mask: torch.Tensor | None) -> torch.Tensor | None:
    """An eager additive mask that only hides keys (0 where seen, the dtype's minimum where hidden: what
    :data:`EAGER_MASKS_NAME`'s builder gives) as SDPA's boolean one, True where seen, which the kernel takes; any
    other mask as it is."""
    if mask is None or mask.dtype == torch.bool or not mask.is_floating_point():
        return mask
    hidden = mask <= torch.finfo(mask.dtype).min / 2
    return ~hidden if bool(((mask == 0) | hidden).all()) else mask


def _is_causal(module: nn.Module, sink: ChunkSink | None, given: bool | None) -> bool:
    """Whether a call without a mask attends causally: as the model says (``is_causal=``), else the block's kind where
    the sink says it (NLLB-MoE's decoder: :attr:`ChunkSink.causal`), else the module's flag (SDPA's default)."""
    if given is not None:
        return bool(given)
    if sink is not None and sink.causal is not None:
        return sink.causal
    return bool(getattr(module, "is_causal", True))


def _sink_logits(module: nn.Module, query: torch.Tensor, kwargs: dict) -> torch.Tensor | None:
    """The learned sinks (``s_aux``) a call hands the function, one logit per query head as it takes them (None where
    there are none); any other sinks refused mid-forward (before any statistic of that call)."""
    if kwargs.get("sinks") is not None:  # Inkling2's: a logit per head and query, from the layer's input
        raise NotImplementedError(f"headlab's attention function: attention sinks handed as sinks= "
                                  f"({type(module).__name__}), which it does not implement; run with --engine eager")
    sink_logits = kwargs.get("s_aux")
    if sink_logits is not None and getattr(getattr(module, "config", None), "model_type", None) not in ATTENTION_SINKS:
        raise NotImplementedError(f"headlab's attention function: attention sinks (s_aux) of {type(module).__name__}, "
                                  "whose use of them headlab has not read; run with --engine eager")
    if sink_logits is not None and tuple(sink_logits.shape) != (query.shape[1],):
        raise NotImplementedError(f"headlab's attention function: attention sinks (s_aux) of shape "
                                  f"{tuple(sink_logits.shape)}, "
                                  f"not one logit per query head ({query.shape[1]})")
    return sink_logits


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
    sink_logits = _sink_logits(module, query, kwargs)
    if kwargs.get("indices") is not None:
        attention_mask = selected_keys_mask(attention_mask, kwargs["indices"], key.shape[2], query.dtype)
    sink: ChunkSink | None = getattr(module, SINK_ATTRIBUTE, None)
    batch, n_heads, q_len, d_head = query.shape
    kv_heads = key.shape[1]
    groups = n_heads // kv_heads  # grouped-query attention: query head h reads key/value head h // groups
    if scaling is None:
        scaling = d_head ** -0.5
    softcap = kwargs.get("softcap")
    position_bias = kwargs.get("position_bias")
    k_len = key.shape[2]
    is_causal = _is_causal(module, sink, kwargs.get("is_causal"))
    causal = bool(q_len > 1 and attention_mask is None and is_causal)
    if causal and k_len > q_len:  # as SDPA: an empty static cache's extra keys are dropped
        key, value, k_len = key[:, :, :q_len], value[:, :, :q_len], q_len
        if position_bias is not None:
            position_bias = position_bias[..., :q_len]
    if sink is not None and sink.kernel is not None:
        done = sink.kernel(AttentionCall(query, key, value, _as_boolean(attention_mask), causal, scaling, softcap,
                                         position_bias is not None, sink_logits is not None,
                                         dropout if module.training else 0.0))
        if done is not None:
            sink.calls += 1
            return done, None
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        attention_mask = ~attention_mask  # True where a key is hidden
        fill = torch.finfo(torch.float32).min  # as eager's additive minimum: a fully hidden row is uniform
    step = sink.query_chunk if sink is not None and sink.query_chunk > 0 else q_len
    if sink is not None and sink.chunk_elements > 0 and query.device.type == "cpu":
        step = chunk_rows(step, sink.chunk_elements, n_heads, k_len)
    # work buffers (`out=`) where no chunk outlives the callback and no gradient is asked for
    buffers = _Buffers() if (sink is None or sink.callback is None or sink.reuse) and not (
        torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)) else None
    most = batch * n_heads * min(step, q_len)  # the largest chunk's rows, over every head
    own_softmax = query.dtype in (torch.float32, torch.float64)  # its softmax is in its own dtype
    # The scaling on the query rows where that gives the same scores. Only on the CPU: the check's
    # answer picks a branch here, so on a GPU it would wait for the queued work (a host sync per
    # tensor test, per layer); there the scaling stays on the scores, one more elementwise pass on the
    # device, in eager's order: the scores are the same bits either way (exact_prescale's claim).
    prescale = query.device.type == "cpu" and exact_prescale(query, key, scaling)
    # Written chunk by chunk in the layout the caller gets, [batch, q_len, n_heads, d_head]: no list
    # of chunk outputs to concatenate and transpose at the end (each a copy of the whole output).
    output = value.new_empty(batch, q_len, n_heads, value.shape[-1])
    # Key/value heads are not repeated (as transformers' repeat_kv does, a copy of both per group):
    # each key/value head multiplies its group's query rows, [batch, kv_heads, groups * rows, ...].
    key_t = key.transpose(2, 3)  # [batch, kv_heads, d_head, k_len]
    for start in range(0, q_len, step):
        stop = min(start + step, q_len)
        rows = stop - start
        mask = _scores_mask(attention_mask, start, stop, k_len)
        keys = visible_keys(mask, causal, stop, k_len)  # keys from `keys` on: hidden from every row here
        grouped = query[:, :, start:stop].reshape(batch, kv_heads, groups * rows, d_head)
        if prescale:
            grouped = grouped * scaling  # a copy: never the caller's query
        if buffers is not None:
            scores = torch.matmul(grouped, key_t[..., :keys], out=buffers.take(
                "scores", query, most * k_len, batch, kv_heads, groups * rows, keys))
            scores = scores.view(batch, n_heads, rows, keys)
        else:
            scores = torch.matmul(grouped, key_t[..., :keys]).view(batch, n_heads, rows, keys)
        if not prescale:
            scores.mul_(scaling)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if position_bias is not None:
            bias = position_bias[:, :, start:stop] if position_bias.shape[2] > 1 else position_bias
            scores = scores + bias[..., :keys]
        if mask is not None:
            mask = mask[..., :keys]
            if mask.dtype == torch.bool:
                # bfloat16 and float16 cannot hold float32's minimum (masked_fill_ refuses it): their own
                # minimum there, as eager's additive mask of the model's dtype has
                scores.masked_fill_(mask, fill if scores.dtype in (torch.float32, torch.float64)
                                    else torch.finfo(scores.dtype).min)
            else:
                scores = scores + mask
        elif causal and keys > start + 1:  # only keys from start + 1 on can be hidden from these rows
            corner = scores[..., start + 1:keys]
            hidden = torch.arange(start, stop, device=scores.device)[:, None] < \
                torch.arange(start + 1, keys, device=scores.device)
            corner.masked_fill_(hidden, torch.finfo(scores.dtype).min)
        if sink_logits is not None:
            # A learned sink per head: one more logit in each row's softmax, its column dropped after
            # (transformers' GPT-OSS eager_attention_forward; Granite-SWA's sigmoid(lse - sink) scaling of
            # the output is the same weights): the weights the values get, a row's sum below 1.
            column = sink_logits.to(scores.dtype).reshape(1, n_heads, 1, 1).expand(batch, n_heads, rows, 1)
            probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1,
                                  dtype=torch.promote_types(scores.dtype, torch.float32))[..., :keys].contiguous()
        elif buffers is not None and own_softmax and scores.dtype == query.dtype:
            # the kernel torch.softmax(scores, -1, dtype=scores.dtype) runs, into a buffer
            probs = torch.ops.aten._softmax.out(scores, -1, False, out=buffers.take(
                "probs", scores, most * k_len, batch, n_heads, rows, keys))
        else:
            probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
        if sink is not None and sink.callback is not None:
            # an additive mask of -inf would make p * s = 0 * -inf: no scores then
            finite = mask is None or mask.dtype == torch.bool or not bool(torch.isinf(mask).any())
            sink.callback(AttentionChunk(probs.detach(), start, stop, q_len, k_len,
                                         scores.detach() if finite and sink.scores else None))
        del scores
        weights = probs.to(value.dtype)
        if dropout and module.training:
            weights = nn.functional.dropout(weights, p=dropout, training=True)
        out = None if buffers is None or weights.dtype != value.dtype else \
            buffers.take("output", value, most * value.shape[-1], batch, kv_heads, groups * rows, value.shape[-1])
        chunk = torch.matmul(weights.view(batch, kv_heads, groups * rows, keys), value[:, :, :keys], out=out)
        output[:, start:stop] = chunk.view(batch, n_heads, rows, -1).transpose(1, 2)
        del probs, weights, chunk
    if sink is not None:
        sink.calls += 1
    return output, None


_registered = False


EAGER_MASKS_NAME = NAME + "_eager_masks"
"""The same function under another name, registered with transformers' eager mask builder: for a model with no SDPA
path (``_supports_sdpa`` False), whose own code may read the masks as eager builds them. NLLB-MoE's experts read the
layer's mask to find padding (an additive float mask, 0 where a token is seen): given SDPA's boolean mask (True where
seen) they routed the tokens otherwise, its encoder's output and so its cross-attention maps changed under headlab's
engines (session 38's fused sweep)."""


def register(eager_masks: bool = False) -> str:
    """Register the function and its mask builders with transformers (once); returns :data:`NAME`, or
    :data:`EAGER_MASKS_NAME` with ``eager_masks`` (a model without an SDPA path)."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

        AttentionInterface.register(NAME, attention_forward)
        AttentionMaskInterface.register(NAME, sdpa_mask)
        AttentionInterface.register(EAGER_MASKS_NAME, attention_forward)
        AttentionMaskInterface.register(EAGER_MASKS_NAME, eager_mask)
        _registered = True
    return EAGER_MASKS_NAME if eager_masks else NAME


def dispatches(module: nn.Module) -> bool:
    """Whether ``module``'s forward picks its attention function from transformers' registry
    (``ALL_ATTENTION_FUNCTIONS``), so that setting the implementation to :data:`NAME` reaches it."""
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return False
    return "ALL_ATTENTION_FUNCTIONS" in source and hasattr(getattr(module, "config", None), "_attn_implementation")
