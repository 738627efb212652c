"""Head confidence (Voita et al. 2019, Sec. 4).

"We define the confidence of a head as the average of its maximum attention weight
excluding the end of sentence symbol, where average is taken over tokens in a set of
sentences used for evaluation." For every head and every query token, take the largest
attention weight the query puts on a single allowed key; average over all allowed queries of
the data set.

What is left out, and why:

* **EOS as a key.** Many heads park their attention on the end-of-sentence token when they
  have nothing to do, which would make an idle head look confident; this is the paper's
  exclusion. The weight is *not* renormalised: a head that puts 0.9 on EOS and spreads 0.1
  has confidence at most 0.1.
* **Other special tokens as keys** (BOS/CLS/SEP, the decoder start token, a language tag): they
  play the same sink role as EOS in models that have them.
* **Padding**, as key or query: it is masked out and is not data.
* **Special tokens as queries** (EOS, CLS, SEP, BOS): their rows are not the attention of a
  word. In the decoder, the query at the start token is kept for cross-attention (it predicts
  the first word), but a query with no allowed key (the start token in decoder
  self-attention, whose only key is itself) is skipped.

For a translation model the decoder runs teacher-forced on the model's own translation, as
for LRP, so that both measures look at the same attention maps.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from headlab.adapters import AttentionBlock, attention_blocks
from headlab.attention import AttentionCall, AttentionChunk
from headlab.capture import capture_attention, eval_mode, not_streamable, stream_attention
from headlab.data.attention_kernel import KernelCalls, KernelStatistics
from headlab.data.batching import with_progress
from headlab.data.inputs import ImportanceData, count_batches, make_batches
from headlab.errors import HeadlabError
from headlab.functions.config import FUSED_QUERY_CHUNK
from headlab.gates import measures_heads
from headlab.heads import HeadScores
from headlab.importance.common import block_scores
from headlab.importance.measure import MASK_INSTEAD, ImportanceMeasure
from headlab.importance.measure_options import ConfidenceOptions
from headlab.model_description import ModelInfo, describe_model
from headlab.shard import Ledger, active

__all__ = ["Confidence", "ConfidenceOptions", "compute_confidence", "counted_queries", "kernel_maxima", "max_attention",
           "row_maxima", "sum_maxima"]

logger = logging.getLogger(__name__)


def row_maxima(probs: torch.Tensor, queries: torch.Tensor, keys: torch.Tensor, causal: bool,
               start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head and query row, the largest weight on an allowed key, and whether the row counts.

    ``probs`` ``[batch, n_heads, rows, k_len]`` holds query rows ``start:start + rows`` (all of
    them by default); ``queries`` ``[batch, q_len]`` and ``keys`` ``[batch, k_len]`` mark allowed
    positions. With ``causal``, query ``i`` only sees keys ``<= i``, so a query counts only if one
    of those is allowed. Returns ``(best [batch, n_heads, rows], counted [batch, rows])``, ``best``
    in :func:`maxima_dtype`.
    """
    rows = probs.shape[2]
    allowed = keys[:, None, :].expand(-1, rows, -1)  # [batch, rows, k_len]
    if causal:
        seen = torch.arange(start, start + rows, device=probs.device)[:, None] >= \
            torch.arange(probs.shape[3], device=probs.device)[None, :]
        allowed = allowed & seen
    counted = queries[:, start:start + rows] & allowed.any(-1)  # [batch, rows]
    masked = probs.to(maxima_dtype(probs.dtype)).masked_fill(~allowed[:, None], -1.0)
    return masked.amax(-1), counted


def maxima_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the maxima are taken and summed in: float64 for a float64 model (its weights'
    precision, not float32's), float32 for any other (as always: the same scores to the bit)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def sum_maxima(best: torch.Tensor, counted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head, the sum of ``best`` ``[batch, n_heads, q_len]`` over the counted queries, and their number."""
    best = best * counted[:, None].to(best.dtype)
    return best.sum(dim=(0, 2)).double(), counted.sum().double()


def max_attention(probs: torch.Tensor, queries: torch.Tensor, keys: torch.Tensor,
                  causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head, the sum over allowed queries of the largest weight on an allowed key, and the
    number of queries counted (:func:`row_maxima` over all rows, then :func:`sum_maxima`)."""
    return sum_maxima(*row_maxima(probs, queries, keys, causal))


def counted_queries(queries: torch.Tensor, keys: torch.Tensor, causal: bool) -> torch.Tensor:
    """``[batch, q_len]``: the queries :func:`row_maxima` counts, from the masks alone: an allowed
    query that sees an allowed key (with ``causal``, one at a position ``<= i``: a running "any")."""
    if not causal:
        return queries & keys.any(-1, keepdim=True)
    seen_before = keys.to(torch.uint8).cummax(-1).values.bool()  # [batch, k_len]: an allowed key at <= j
    index = torch.arange(queries.shape[1], device=keys.device).clamp(max=keys.shape[1] - 1)
    return queries & seen_before[:, index]


def kernel_maxima(stats, queries: torch.Tensor, keys: torch.Tensor,
                  causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`row_maxima` from one kernel pass whose eligible keys were ``keys``
    (:class:`~headlab.data.attention_kernel.KernelStatistics`): the largest allowed weight is
    ``exp(max allowed score - lse)`` (0 where the row sees no allowed key, as the masked-out weights
    are 0); a row that sees no key at all is uniform over every key, as the softmax of the float
    minimum on the other paths. In the kernel's statistics' dtype (float64 for float64 inputs)."""
    best = torch.where(stats.lse.isneginf(), 1.0 / keys.shape[1], stats.max_weight)
    return best, counted_queries(queries, keys, causal)


@measures_heads("confidence", instead=MASK_INSTEAD)
def compute_confidence(
    model: nn.Module,
    data: ImportanceData,
    info: ModelInfo | None = None,
    *,
    batch_size: int = 32,
    kinds: tuple[str, ...] | None = None,
    progress: bool = False,
    query_chunk: int | None = None,
    engine: str | None = None,
) -> HeadScores:
    """Confidence of every head over ``data`` (Voita et al. 2019, Sec. 4).

    By default (``engine`` None, "fused" or "chunked": one path here) the model runs headlab's own
    attention function (:func:`headlab.capture.stream_attention`), ``query_chunk`` query rows at a
    time (default :data:`FUSED_QUERY_CHUNK`): each chunk's row maxima (the largest allowed weight,
    ``exp(max s - lse)``, read off the probabilities the chunk's softmax made: one reduction) go into a
    ``[batch, n_heads, q_len]`` buffer, summed as the eager path sums them once the block's last chunk
    has arrived, so the scores are the eager ones (to rounding: the last bit of some maxima, as the
    chunk's products round) and no block's whole map exists. ``engine="eager"``, the reference,
    captures each block's whole map; it is also the default for a model whose attention cannot go
    through headlab's function (:func:`headlab.capture.not_streamable`, logged).

    ``engine="kernel"`` (a CUDA GPU with triton; Triton's interpreter on the CPU in the tests) computes
    each attention call in one pass of :mod:`headlab.data.attention_kernel` with the allowed keys as its
    eligible set (:func:`kernel_maxima`): the maxima without the probabilities. A call the kernel cannot
    compute exactly runs on the fused path instead: logged once per reason and recorded in the
    scores' signature (``kernel_fallback``), as ``functions --engine kernel`` records it in summary.json.
    """
    info = info or describe_model(model)
    if info.is_seq2seq and data.translations is None:
        raise HeadlabError("confidence reads the decoder on the model's own translation: run translate_data first")
    ConfidenceOptions(query_chunk=query_chunk, engine=engine)  # the options' checks, as the command line's
    kernel_fallback: dict[str, str] = {}  # under engine="kernel": why some calls ran on the fused path
    kernel_asked = engine == "kernel"

    def fall_back(name: str, reason: str, path: str = "the fused engine") -> None:
        if name not in kernel_fallback:
            logger.warning("confidence: %s: %s instead of the kernel for some batches: %s", name, path, reason)
            kernel_fallback[name] = reason

    if kernel_asked:
        from headlab.functions.analysis import check_kernel

        check_kernel(next(model.parameters()).device)  # no triton, or not on a CUDA GPU: refused before any work
    if engine in (None, "kernel") and (why := not_streamable(model)):
        if engine == "kernel":  # the kernel too runs inside headlab's attention function
            fall_back("model", f"{why}: the eager path (whole maps)", "the eager path")
        else:
            logger.info("confidence: %s: %s; the row maxima are taken on the eager path (whole maps)",
                        type(model).__name__, why)
        engine = "eager"
    streamed = engine != "eager"
    blocks = [b for b in attention_blocks(model) if b.n_heads > 0 and not b.idle and (kinds is None or b.kind in kinds)]
    shard = active()  # several processes: each its own batches, the sums added in batch order below
    # Per batch and block: the sum of the heads' maxima and the number of queries counted.
    ledger = Ledger(shard, {b.key: (torch.zeros(b.n_heads, dtype=torch.float64), torch.zeros((), dtype=torch.float64))
                            for b in blocks})
    current: dict = {}

    def allowed(block: AttentionBlock, q_len: int, k_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        queries, keys = current["batch"].valid[block.kind]
        if q_len != queries.shape[1] or k_len != keys.shape[1]:
            raise HeadlabError(
                f"{block.kind} layer {block.layer}: attention of {q_len} queries x {k_len} keys does not match "
                f"the batch ({queries.shape[1]} queries, {keys.shape[1]} keys)"
            )
        return queries, keys

    def add(block: AttentionBlock, total: torch.Tensor, n: torch.Tensor) -> None:
        ledger.add(current["number"], {block.key: (total.cpu(), n.cpu())})

    def on_probs(block: AttentionBlock, probs: torch.Tensor) -> None:
        queries, keys = allowed(block, probs.shape[2], probs.shape[3])
        add(block, *max_attention(probs, queries, keys, causal=block.kind == "dec_self"))

    buffers: dict = {}  # block key -> (best [batch, n_heads, q_len], counted [batch, q_len]) of its current call

    def on_chunk(block: AttentionBlock, chunk: AttentionChunk) -> None:
        queries, keys = allowed(block, chunk.q_len, chunk.k_len)
        best, counted = row_maxima(chunk.full(), queries, keys, block.kind == "dec_self", chunk.start)
        if chunk.start == 0:
            B, H = best.shape[:2]
            buffers[block.key] = (best.new_empty(B, H, chunk.q_len), counted.new_empty(B, chunk.q_len))
        all_best, all_counted = buffers[block.key]
        all_best[:, :, chunk.start:chunk.stop] = best
        all_counted[:, chunk.start:chunk.stop] = counted
        if chunk.last:
            add(block, *sum_maxima(*buffers.pop(block.key)))

    kernel_calls = KernelCalls(fall_back)  # the kernel's refusal of this model's attention, once

    def on_kernel(block: AttentionBlock, call: AttentionCall) -> torch.Tensor | None:
        """One attention call in the kernel, its row maxima added; its output returned (None: the
        call goes to the chunks, :func:`on_chunk`, and, for the model's reasons, every later one)."""
        if kernel_calls.refused is not None:
            return None
        q, k, v, mask = call.query, call.key, call.value, call.mask
        queries, keys = allowed(block, q.shape[2], k.shape[2])
        causal = block.kind == "dec_self"
        stats = _kernel_pass(kernel_calls, call, keys, causal)
        if stats is None:  # the fused path runs this call
            return None
        best, counted = kernel_maxima(stats, queries, keys, causal)
        add(block, *sum_maxima(best.to(maxima_dtype(best.dtype)), counted))  # in row_maxima's dtype
        output = stats.out
        if mask is not None:  # a row that sees no key: uniform over every key, as the softmax of the float minimum
            uniform = v.mean(2, keepdim=True).repeat_interleave(q.shape[1] // k.shape[1], 1)
            output = torch.where(stats.lse.isneginf()[..., None], uniform.to(output.dtype), output)
        return output.transpose(1, 2).contiguous()

    if not streamed:
        capture = capture_attention(model, on_probs, blocks=blocks)
    else:
        # on_chunk keeps nothing of a chunk (its maxima are fresh tensors, copied into the buffers)
        capture = stream_attention(model, on_chunk, query_chunk=query_chunk or FUSED_QUERY_CHUNK, blocks=blocks,
                                   reuse=True, kernel=on_kernel if engine == "kernel" else None)
    batches: Iterable = shard.numbered(make_batches(data, info, batch_size=batch_size, side="translation",
                                          device=next(model.parameters()).device))
    batches = with_progress(batches, progress, "confidence", total=shard.count(count_batches(data, batch_size)),
                            unit="batch")
    with eval_mode(model), torch.no_grad(), capture:
        for number, batch in batches:
            current["batch"], current["number"] = batch, number
            kwargs = {"use_cache": False} if info.is_seq2seq else {}
            model(**batch.inputs, **kwargs)
    totals = ledger.total()
    if kernel_asked:  # another process's batches may have fallen back where this one's did not
        kernel_fallback = _every_process(shard, kernel_fallback)
    counts = {key: n for key, (_, n) in totals.items()}
    values = {}
    for key, (total, n) in totals.items():
        if n == 0:
            raise HeadlabError(f"confidence: no query token with an allowed key in {key[0]} layer {key[1]}")
        values[key] = (total / n).numpy()
    scores = block_scores(attention_blocks(model), values, kinds)
    signature = {
        **data.signature(),
        "queries_counted": {f"{k[0]}:{k[1]}": int(v) for k, v in counts.items()},
        "excluded": "EOS/special tokens and padding as keys; special tokens and padding as queries",
        "decoder_side": "model's own translation" if info.is_seq2seq else None,
    }
    if kernel_fallback:  # only then: where the kernel served every call, the signature is the fused path's
        signature["kernel_fallback"] = kernel_fallback
    return HeadScores(scores, "confidence", info.name, signature)


def _every_process(shard, reasons: dict[str, str]) -> dict[str, str]:
    """``reasons`` of every process (called in each), the main process's first, each name once."""
    merged = dict(reasons)
    for part in shard.gather(reasons)[1:] if shard.split else ():
        for name, reason in part.items():
            merged.setdefault(name, reason)
    return merged


def _kernel_pass(kernel_calls: KernelCalls, call: AttentionCall, keys: torch.Tensor,
                 causal: bool) -> KernelStatistics | None:
    """The kernel's statistics of one call (its allowed ``keys`` eligible), or None where it cannot
    run it (nothing ran; the reason goes to ``kernel_calls.fall_back``: ``"model"`` for the whole
    model, ``"dec_self"`` for this call)."""
    if not kernel_calls.accepts(call, _causal_refusal):
        return None
    if causal and not _hides_later_keys(call):
        # row_maxima takes keys j <= i only; the kernel's maximum is over the keys the call sees
        kernel_calls.fall_back("dec_self", "decoder self-attention that does not hide later keys")
        return None
    return kernel_calls.run(call, eligible=keys)  # None: the installed triton could not compile it


def _causal_refusal(call: AttentionCall) -> str | None:
    """Beyond :func:`headlab.data.attention_kernel.refusal`: a causal call with fewer keys than
    queries (the attention function's causal mask is aligned top-left there, the kernel's bottom-right)."""
    if call.causal and call.key.shape[2] != call.query.shape[2]:
        return "causal attention with fewer keys than queries"
    return None


def _hides_later_keys(call: AttentionCall, rows: int = 1024) -> bool:
    """Whether query ``i`` of a self-attention call sees no key ``j > i`` (a causal flag, or a mask
    that hides every key above the diagonal). The mask is read ``rows`` query rows at a time: no
    second ``[q_len, k_len]`` tensor beside it (4 GiB at 64k tokens)."""
    q_len, k_len = call.query.shape[2], call.key.shape[2]
    if call.causal or k_len == 1:  # one key: none after any query (transformers flags no causal there)
        return True
    mask = call.mask
    if mask is None:
        return False
    keys = torch.arange(k_len, device=mask.device)
    for start in range(0, q_len, rows):
        stop = min(start + rows, q_len)
        later = keys[None, :] > torch.arange(start, stop, device=mask.device)[:, None]  # [rows, k_len]
        piece = mask if mask.shape[-2] == 1 else mask[..., start:stop, :]
        if bool((piece & later).any()):
            return False
    return True


class Confidence(ImportanceMeasure):
    """:func:`compute_confidence` as a registered measure."""

    name = "confidence"
    tables = {"confidence": ("Confidence", "mean maximum attention weight, special tokens left out "
                                           "(Voita et al. 2019, Sec. 4.1)")}
    reads_translation = True
    Options = ConfidenceOptions

    def score(self, model, data, info, *, batch_size=32, kinds=None, progress=False, tokenizer=None) -> HeadScores:
        return compute_confidence(model, data, info, batch_size=batch_size, kinds=kinds, progress=progress,
                                  query_chunk=self.options.query_chunk, engine=self.options.engine)
