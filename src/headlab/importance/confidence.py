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

import torch
from torch import nn

from headlab.adapters import AttentionBlock, attention_blocks
from headlab.capture import capture_attention, eval_mode
from headlab.data.batching import with_progress
from headlab.errors import HeadlabError
from headlab.heads import HeadScores
from headlab.importance.data import (
    ImportanceData,
    ModelInfo,
    block_scores,
    count_batches,
    describe_model,
    make_batches,
)
from headlab.importance.measure import ImportanceMeasure

__all__ = ["Confidence", "compute_confidence", "max_attention"]


def max_attention(probs: torch.Tensor, queries: torch.Tensor, keys: torch.Tensor,
                  causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head, the sum over allowed queries of the largest weight on an allowed key, and the
    number of queries counted.

    ``probs`` ``[batch, n_heads, q_len, k_len]``; ``queries`` ``[batch, q_len]`` and ``keys``
    ``[batch, k_len]`` mark allowed positions. With ``causal``, query ``i`` only sees keys
    ``<= i``, so a query counts only if one of those is allowed.
    """
    allowed = keys[:, None, :].expand(-1, probs.shape[2], -1)  # [batch, q_len, k_len]
    if causal:
        allowed = allowed & torch.ones(probs.shape[2], probs.shape[3], dtype=torch.bool, device=probs.device).tril()
    counted = queries & allowed.any(-1)  # [batch, q_len]
    masked = probs.float().masked_fill(~allowed[:, None], -1.0)
    best = masked.amax(-1)  # [batch, n_heads, q_len]
    best = best * counted[:, None].to(best.dtype)
    return best.sum(dim=(0, 2)).double(), counted.sum().double()


def compute_confidence(
    model: nn.Module,
    data: ImportanceData,
    info: ModelInfo | None = None,
    *,
    batch_size: int = 32,
    kinds: tuple[str, ...] | None = None,
    progress: bool = False,
) -> HeadScores:
    """Confidence of every head over ``data`` (Voita et al. 2019, Sec. 4)."""
    info = info or describe_model(model)
    if info.is_seq2seq and data.translations is None:
        raise HeadlabError("confidence reads the decoder on the model's own translation: run translate_data first")
    blocks = [b for b in attention_blocks(model) if b.n_heads > 0 and (kinds is None or b.kind in kinds)]
    sums = {b.key: torch.zeros(b.n_heads, dtype=torch.float64) for b in blocks}
    counts = {b.key: torch.zeros((), dtype=torch.float64) for b in blocks}
    current: dict = {}

    def on_probs(block: AttentionBlock, probs: torch.Tensor) -> None:
        queries, keys = current["batch"].valid[block.kind]
        if probs.shape[2] != queries.shape[1] or probs.shape[3] != keys.shape[1]:
            raise HeadlabError(
                f"{block.kind} layer {block.layer}: attention of shape {tuple(probs.shape)} does not match "
                f"the batch ({queries.shape[1]} queries, {keys.shape[1]} keys)"
            )
        total, n = max_attention(probs, queries, keys, causal=block.kind == "dec_self")
        sums[block.key] += total.cpu()
        counts[block.key] += n.cpu()

    batches = make_batches(data, info, batch_size=batch_size, side="translation", device=next(model.parameters()).device)
    batches = with_progress(batches, progress, "confidence", total=count_batches(data, batch_size), unit="batch")
    with eval_mode(model), torch.no_grad(), capture_attention(model, on_probs, blocks=blocks):
        for batch in batches:
            current["batch"] = batch
            kwargs = {"use_cache": False} if info.is_seq2seq else {}
            model(**batch.inputs, **kwargs)
    values = {}
    for key in sums:
        if counts[key] == 0:
            raise HeadlabError(f"confidence: no query token with an allowed key in {key[0]} layer {key[1]}")
        values[key] = (sums[key] / counts[key]).numpy()
    scores = block_scores(attention_blocks(model), values, kinds)
    signature = {
        **data.signature(),
        "queries_counted": {f"{k[0]}:{k[1]}": int(v) for k, v in counts.items()},
        "excluded": "EOS/special tokens and padding as keys; special tokens and padding as queries",
        "decoder_side": "model's own translation" if info.is_seq2seq else None,
    }
    return HeadScores(scores, "confidence", info.name, signature)


class Confidence(ImportanceMeasure):
    """:func:`compute_confidence` as a registered measure."""

    name = "confidence"
    tables = {"confidence": ("Confidence", "mean maximum attention weight, special tokens left out "
                                           "(Voita et al. 2019, Sec. 4.1)")}
    reads_translation = True

    def score(self, model, data, info, *, batch_size=32, kinds=None, progress=False, tokenizer=None) -> HeadScores:
        return compute_confidence(model, data, info, batch_size=batch_size, kinds=kinds, progress=progress)
