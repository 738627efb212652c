"""Gradient importance (Michel et al. 2019, Sec. 4.1): I_h = E_x |dL(x) / d g_h| at g = 1.

A gate ``g_h`` multiplies head ``h``'s output before the output projection (Michel et al.'s
``xi_h``; headlab's gate seam). The importance of a head is the expected absolute derivative
of the loss with respect to its gate, the expectation over examples ``x`` (sentences): the
absolute value is taken per sentence, then averaged, as in the paper. Per-sentence
derivatives come from one backward pass per batch: every sentence gets its own row of gates
(``[batch, n_heads]``), and the loss of a sentence depends only on its own row.

The loss of a sentence is its mean token negative log-likelihood: against the reference when
the data set has references, else against the model's own translation (translation models),
the next token (causal LMs), or the masked tokens (masked LMs; the unmasked input when the
tokenizer has no mask token). A fine-tuned classifier's is its task loss, the cross-entropy
of the text's gold label (Michel et al.'s own setting).

Michel et al. normalise importance per layer with the l2 norm (following Molchanov et al.
2017); :func:`compute_gradient` returns the scores with ``normalize=True`` (method
``"gradient"``) or as they are (method ``"gradient_raw"``).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from torch import nn

from headlab.adapters import attention_blocks, flex_without_backward
from headlab.capture import eval_mode, float32_mask_floor
from headlab.data.batching import with_progress
from headlab.data.inputs import ImportanceData, count_batches, make_batches
from headlab.errors import HeadlabError
from headlab.gates import gates_attached, measures_heads
from headlab.heads import HeadScores, HeadSpec
from headlab.importance.common import (
    ExampleGates,
    block_scores,
    check_finite_loss,
    forward_logits,
    masked_signature,
    original_mask,
    sequence_nll,
)
from headlab.importance.measure import ImportanceMeasure
from headlab.model_description import ModelInfo, describe_model
from headlab.shard import SINGLE, Ledger, Shard, active

__all__ = ["Gradient", "compute_gradient", "gate_gradients", "l2_normalize_per_layer"]


def l2_normalize_per_layer(scores: HeadScores, method: str | None = None) -> HeadScores:
    """Each layer's scores divided by their l2 norm (Michel et al. 2019, after Molchanov et al. 2017)."""
    out = {}
    for kind, array in scores.scores.items():
        norm = np.sqrt(np.nansum(array**2, axis=1, keepdims=True))
        out[kind] = array / np.where(norm == 0, 1.0, norm)
    signature = {**scores.signature, "normalisation": "l2 per layer"}
    return HeadScores(out, method or scores.method, scores.model, signature)


@measures_heads("gradient importance", instead="give mask= (gate_gradients')")
def gate_gradients(model: nn.Module, batches: Iterable[tuple[dict, torch.Tensor]], info: ModelInfo, *,
                   kinds: tuple[str, ...] | None = None, mask: HeadSpec | None = None,
                   shard: Shard = SINGLE) -> tuple[dict, int, int]:
    """E_x |dL(x)/dg_h| per head (Michel et al. 2019, Eq. 4) over ``batches`` of ``(inputs, labels)``.

    Gates are at 1, or at 0 for the heads of ``mask``: the importance at the current mask, as in
    the iterative pruning of Michel et al. (Sec. 5). Returns ``{kind: [n_layers, n_heads]}`` and
    the numbers of sentences and tokens scored. With ``shard``, ``batches`` are this process's
    share (:meth:`Shard.take`), and the sums are added over the processes in batch order, as
    one process adds them.
    """
    if (problem := flex_without_backward(model)) is not None:
        raise HeadlabError(f"gradient importance differentiates the model's own forward: {problem}")
    blocks = [b for b in attention_blocks(model) if b.n_heads > 0 and not b.idle and (kinds is None or b.kind in kinds)]
    keep = {b.key: torch.ones(b.n_heads) for b in blocks}
    for key, heads in (mask or {}).items():
        if key in keep:
            keep[key][list(heads)] = 0.0
    # Per batch: each head's summed |gradient|, added in batch order (this process's batch number
    # ``mine`` is the run's batch rank + mine * world).
    sums = Ledger(shard, {b.key: torch.zeros(b.n_heads, dtype=torch.float64) for b in blocks})
    n_examples = n_tokens = 0
    # The floor: a float64 eager model's padding query that may attend to no key (a sliding window, left padding)
    # is NaN otherwise, and its NaN reaches every gradient through the softmax's backward (NaN * 0), and through
    # the next layer's real rows in a bidirectional model; no other value changes (capture.float32_mask_floor)
    with eval_mode(model), float32_mask_floor(model):
        for mine, (inputs, labels) in enumerate(batches):
            device, size = labels.device, labels.shape[0]
            gates = {key: (torch.ones(size, len(k), device=device) * k.to(device)).requires_grad_(True)
                     for key, k in keep.items()}  # one row per sentence: [batch, n_heads]
            with torch.enable_grad(), gates_attached(model, ExampleGates(gates)):
                nll, count = sequence_nll(forward_logits(model, inputs, info), labels)
                scored = count > 0
                loss = (nll[scored] / count[scored]).sum()  # sum of per-sentence mean losses
                check_finite_loss("gradient importance", loss.detach(), f"in its loss on batch {mine + 1}")
                grads = torch.autograd.grad(loss, list(gates.values()), allow_unused=True)
            for grad in grads:
                if grad is not None:
                    check_finite_loss("gradient importance", grad[scored], f"in the gradient of batch {mine + 1}")
            sums.add(shard.rank + mine * shard.world, {key: grad[scored].abs().double().sum(0).cpu()
                                                       for key, grad in zip(gates, grads) if grad is not None})
            n_examples += int(scored.sum())
            n_tokens += int(count.sum())
    sums = sums.total()
    n_examples, n_tokens = shard.sum((n_examples, n_tokens))
    if n_examples == 0:
        raise HeadlabError("gradient importance: no sentence has a token to score")
    scores = block_scores(attention_blocks(model), {key: (v / n_examples).numpy() for key, v in sums.items()}, kinds)
    return scores, n_examples, n_tokens


@measures_heads("gradient importance", instead="give mask= (compute_gradient's)")
def compute_gradient(
    model: nn.Module,
    data: ImportanceData,
    info: ModelInfo | None = None,
    *,
    batch_size: int = 32,
    normalize: bool = True,
    kinds: tuple[str, ...] | None = None,
    mask: HeadSpec | None = None,
    progress: bool = False,
) -> HeadScores:
    """Gradient importance of every head over ``data`` (Michel et al. 2019).

    Returns method ``"gradient"`` (l2-normalised per layer) or, with ``normalize=False``,
    ``"gradient_raw"``. Use :func:`l2_normalize_per_layer` to get one from the other. The heads of
    ``mask`` (current numbering, as :func:`~headlab.gates.mask_heads` takes it) are switched off
    (their gates at 0) and get NaN at their original index; they take no part in their layer's
    norm, so the tables are those of ``Gradient().run(mask=...)`` and of the model with the
    masked heads removed. (Michel et al.'s iterative pruning, ``headlab prune baseline --method
    michel``, keeps their gradient in the norm: :func:`headlab.pruning.baselines.gradient_importance`.)
    """
    info = info or describe_model(model)
    if not info.has_lm_head:
        raise HeadlabError("gradient importance needs a loss, hence a language-model head; this model has none")
    if info.is_seq2seq and data.references is None and data.translations is None:
        raise HeadlabError("gradient importance on a translation model needs references or the model's translations")
    if info.arch == "classifier" and data.classes is None:
        raise HeadlabError("gradient importance of a classifier needs the texts' labels (a labelled TSV)")
    device = next(model.parameters()).device
    shard = active()  # several processes: each its own batches, the sums added in gate_gradients
    batches: Iterable = shard.take(make_batches(data, info, batch_size=batch_size, side="reference", device=device,
                                      mask_tokens=True))
    batches = with_progress(batches, progress, "gradient", total=shard.count(count_batches(data, batch_size)),
                            unit="batch")
    scores, n_examples, n_tokens = gate_gradients(model, ((b.inputs, b.labels) for b in batches), info,
                                                  kinds=kinds, mask=mask, shard=shard)
    signature = {
        **data.signature(),
        "n_scored_sentences": n_examples,
        "n_scored_tokens": n_tokens,
        "loss": _loss_name(info, data),
        "normalisation": "none",
    }
    raw = HeadScores(scores, "gradient_raw", info.name, signature)
    # Blanked before the norm: a switched-off head's gradient at gate 0 is no part of its layer's
    # norm (l2_normalize_per_layer skips NaN), as under run(mask=) and on the pruned model.
    raw = masked_signature(raw, original_mask(model, mask)) if mask else raw  # the signature records the mask
    return l2_normalize_per_layer(raw, "gradient") if normalize else raw


def _loss_name(info: ModelInfo, data: ImportanceData) -> str:
    if info.arch == "classifier":
        return "task loss: cross-entropy of each text's gold label"
    if info.is_seq2seq:
        return "mean token NLL of the " + ("reference" if data.references is not None else "model's own translation")
    if info.arch == "causal":
        return "mean next-token NLL of the text"
    return "mean NLL of masked tokens" if info.mask_id is not None else "mean NLL of reconstructing the (unmasked) tokens"


class Gradient(ImportanceMeasure):
    """:func:`compute_gradient` as a registered measure: the l2-normalised table and the raw one."""

    name = "gradient"
    tables = {"gradient": ("Gradient importance", "E|dL/dg_h| for a gate on the head, l2-normalised per layer "
                                                  "(Michel et al. 2019)"),
              "gradient_raw": ("Gradient importance (raw)", "E|dL/dg_h|, not normalised")}
    needs_lm_head = True
    uses_loss = True

    def unsupported(self, model: nn.Module) -> str | None:
        """Flex attention on a CPU, which has no backward pass (found before any measure runs)."""
        problem = flex_without_backward(model)
        return f"it differentiates the model's own forward: {problem}" if problem is not None else None

    def score_tables(self, model, data, info, *, batch_size=32, kinds=None, progress=False,  # type: ignore[override]
                     tokenizer=None) -> list[HeadScores]:  # (the keywords the callers pass, named)
        raw = compute_gradient(model, data, info, batch_size=batch_size, normalize=False, kinds=kinds,
                               progress=progress)
        return [l2_normalize_per_layer(raw, "gradient"), raw]
