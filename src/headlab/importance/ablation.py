"""Ablation, the ground truth: what happens to a metric when one head alone is switched off.

For every head ``h`` the score is the degradation of the metric when ``h`` is masked (its
output multiplied by 0 before the output projection; Voita et al. 2019, Sec. 6.1) and every
other head is kept:

* ``metric="loss"`` (default): ``L(mask h) - L(model)``, the mean token negative
  log-likelihood of the data set (against the references when given, else against the
  model's own translation, the next token, or the masked tokens, as for gradient importance);
* ``metric="bleu"`` (translation models with references): ``BLEU(model) - BLEU(mask h)``,
  corpus BLEU of greedy (or beam) translations, sacreBLEU defaults;
* ``metric="accuracy"`` (fine-tuned classifiers with labels): ``acc(model) - acc(mask h)``,
  the share of texts whose predicted class is the gold label. For a classifier the loss is the
  task loss (cross-entropy of the gold label), and :func:`compute_ablation_tables` gives loss
  and accuracy from the same passes.

Higher means more important in both cases.

Batching. Masking one head is a different model, so 144 heads naively cost 144 passes over
the data, each a separate forward call. Here one forward call evaluates several masked
variants at once: the batch is repeated ``K`` times along the batch dimension and each copy
gets its own gate row (``[K * batch, n_heads]`` gates), so the ``K`` variants share every
kernel call. And masking a head changes nothing below its layer: the unmasked pass records
the output of every layer, and a masked pass starts at the masked head's layer, the layers
below replaced by their recorded outputs (for an encoder-decoder, a decoder head reuses the
whole encoder). On a 6+6-layer translation model this halves the work of 144 naive passes.
Layers whose output is not a single tensor (T5 passes position biases along) are recomputed.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from typing import cast

import torch
from torch import nn

from headlab.adapters import AttentionBlock, attention_blocks
from headlab.capture import eval_mode, float32_mask_floor, spans
from headlab.data.inputs import Batch, ImportanceData, generated_tokens, make_batches
from headlab.errors import HeadlabError
from headlab.gates import gates_attached, measures_heads
from headlab.heads import HeadScores
from headlab.importance.common import ExampleGates, block_scores, check_finite_loss, expand_batch, forward_logits, sequence_nll
from headlab.importance.measure import MASK_INSTEAD, ImportanceMeasure
from headlab.importance.measure_options import METRICS, AblationOptions
from headlab.model_description import ModelInfo, describe_model, generation_cache_problem
from headlab.shard import Ledger, active

__all__ = ["Ablation", "AblationOptions", "METRICS", "compute_ablation", "compute_ablation_tables"]

Variant = tuple[AttentionBlock, int]


def _variant_gates(group: list[Variant], rows: int, device) -> ExampleGates:
    """Gates for ``len(group)`` copies of a batch of ``rows``; copy j switches off head group[j]."""
    values: dict[tuple[str, int], torch.Tensor] = {}
    for j, (block, head) in enumerate(group):
        gate = values.setdefault(block.key, torch.ones(len(group) * rows, block.n_heads, device=device))
        gate[j * rows : (j + 1) * rows, head] = 0.0
    return ExampleGates(values)


def _groups(variants: list[Variant], size: int) -> list[list[Variant]]:
    """Chunks of at most ``size`` variants, never mixing blocks (a group shares one starting layer)."""
    groups: list[list[Variant]] = []
    for variant in variants:
        if groups and len(groups[-1]) < size and groups[-1][0][0].key == variant[0].key:
            groups[-1].append(variant)
        else:
            groups.append([variant])
    return groups


class _Recorded(nn.Module):
    """Stands in for a layer below the masked one: returns that layer's recorded output.

    Other attributes are the layer's own (not a sub-module: its weights stay out of this one), as
    a model's forward may read them from its layers (ModernBERT's ``attention_type``)."""

    def __init__(self, output: torch.Tensor, layer: nn.Module | None = None):
        super().__init__()
        self.output = output
        self.__dict__["_layer"] = layer

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            layer = self.__dict__.get("_layer")
            if layer is None:
                raise
            return getattr(layer, name)

    def forward(self, *args, **kwargs):
        return self.output


def _layer_slot(model: nn.Module, block: AttentionBlock) -> tuple[nn.ModuleList, int] | None:
    """The layer list holding ``block``'s layer, and the layer's index in it (None for a shared
    module's depth, ALBERT's: its layer list is not a list of depths)."""
    if block.shared:
        return None
    parts = block.name.split(".")
    for end in range(1, len(parts)):
        if parts[end].isdigit() and int(parts[end]) == block.layer:
            container = model.get_submodule(".".join(parts[:end])) if end else model
            if isinstance(container, nn.ModuleList):
                return container, block.layer
    return None


class _LayerRecorder:
    """Records every layer's output during the unmasked pass of a batch."""

    def __init__(self, model: nn.Module, blocks: list[AttentionBlock]):
        self.slots = {b.key: _layer_slot(model, b) for b in blocks}
        self.outputs: dict[tuple[int, int], torch.Tensor | None] = {}
        self.handles = []
        # keys and values a later layer reads (Gemma 4's key/value sharing, family.kv_from) are stored by the layer
        # that computes them as it runs: a layer replayed from its output stores none (the reader's KeyError), so the
        # replay stops below the first such layer of each container
        shared = {id(model.get_submodule(b.family.kv_from)) for b in attention_blocks(model) if b.family.kv_from}
        self.replayable: dict[int, int] = {}
        seen = set()
        for slot in self.slots.values():
            if slot is None or id(slot[0]) in seen:
                continue
            seen.add(id(slot[0]))
            self.replayable[id(slot[0])] = next((i for i, layer in enumerate(slot[0])
                                                 if any(id(m) in shared for m in layer.modules())), len(slot[0]))
            for index, layer in enumerate(slot[0]):
                self.handles.append(layer.register_forward_hook(self._keep(id(slot[0]), index)))

    def _keep(self, container: int, index: int):
        def hook(module, args, output):
            self.outputs[(container, index)] = output if isinstance(output, torch.Tensor) else None

        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    @contextmanager
    def start_at(self, block: AttentionBlock, copies: int):
        """Run the layers below ``block``'s as their recorded outputs, repeated ``copies`` times."""
        slot = self.slots.get(block.key)
        replaced: list[tuple[nn.ModuleList, int, nn.Module]] = []
        try:
            if slot is not None:
                container, layer = slot
                recorded = [self.outputs.get((id(container), i))
                            for i in range(min(layer, self.replayable[id(container)]))]
                if all(r is not None for r in recorded):
                    for i, output in enumerate(cast(list[torch.Tensor], recorded)):
                        replaced.append((container, i, container[i]))
                        container[i] = _Recorded(output.repeat(copies, *([1] * (output.dim() - 1))), container[i])
            yield
        finally:
            for container, i, original in replaced:
                container[i] = original


def compute_ablation(
    model: nn.Module,
    data: ImportanceData,
    info: ModelInfo | None = None,
    *,
    metric: str = "loss",
    batch_size: int = 32,
    max_rows: int = 256,
    kinds: tuple[str, ...] | None = None,
    beam: int = 1,
    tokenizer=None,
    progress: bool = False,
) -> HeadScores:
    """The change in ``metric`` when each head alone is masked (higher = more important).

    ``max_rows`` bounds the rows of one forward call (copies x batch), so
    ``max_rows // batch_size`` masked variants run together.
    """
    return compute_ablation_tables(model, data, info, metrics=(metric,), batch_size=batch_size, max_rows=max_rows,
                                   kinds=kinds, beam=beam, tokenizer=tokenizer, progress=progress)[0]


@measures_heads("ablation", instead=MASK_INSTEAD)
def compute_ablation_tables(
    model: nn.Module,
    data: ImportanceData,
    info: ModelInfo | None = None,
    *,
    metrics: tuple[str, ...] = ("loss",),
    batch_size: int = 32,
    max_rows: int = 256,
    kinds: tuple[str, ...] | None = None,
    beam: int = 1,
    tokenizer=None,
    progress: bool = False,
) -> list[HeadScores]:
    """Ablation under each of ``metrics`` from the same masked passes: method ``"ablation"`` for
    the first, ``"ablation_<metric>"`` for the others (a classifier's loss and accuracy)."""
    info = info or describe_model(model)
    for metric in metrics:
        if metric not in METRICS:
            raise HeadlabError(f"unknown ablation metric {metric!r}; expected one of {', '.join(METRICS)}")
    if not info.has_lm_head:
        raise HeadlabError("ablation measures a loss or BLEU, so it needs a language-model head; this model has none")
    if "accuracy" in metrics and info.arch != "classifier":
        raise HeadlabError("ablation accuracy is for classifiers (a labelled TSV); use --metric loss or bleu")
    if info.arch == "classifier" and data.classes is None:
        raise HeadlabError("ablation of a classifier needs the texts' labels (a labelled TSV)")
    if "bleu" in metrics and len(metrics) > 1:
        raise HeadlabError("BLEU ablation runs alone")
    blocks = [b for b in attention_blocks(model) if b.n_heads > 0 and not b.idle and (kinds is None or b.kind in kinds)]
    variants = [(block, head) for block in blocks for head in range(block.n_heads)]
    if metrics == ("bleu",):
        results = {"bleu": _ablate_bleu(model, data, info, variants, batch_size, max_rows, beam, tokenizer, progress)}
    else:
        results = _ablate_loss(model, data, info, variants, batch_size, max_rows, progress, metrics)
    tables = []
    for i, metric in enumerate(metrics):
        values, signature = results[metric]
        scores = block_scores(attention_blocks(model), values, kinds)
        method = "ablation" if i == 0 else f"ablation_{metric}"
        tables.append(HeadScores(scores, method, info.name, {**data.signature(), **signature, "metric": metric}))
    return tables


def _n_passes(n_sentences: int, batch_size: int, variants: list[Variant], max_rows: int, shard=None) -> int:
    """Forward calls of one ablation run: per batch, the unmasked pass and the variant groups
    (of this process's batches, with ``shard``)."""
    total = 0
    for number, start in enumerate(range(0, n_sentences, batch_size)):
        if shard is not None and not shard.owns(number):
            continue
        rows = min(batch_size, n_sentences - start)
        total += 1 + len(_groups(variants, max(1, max_rows // rows)))
    return total


def _progress(total: int, desc: str, enabled: bool) -> Callable[[int], None]:
    if not enabled:
        return lambda n: None
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc=desc, unit="pass")

    def step(n: int) -> None:
        bar.update(n)
        if bar.n >= total:
            bar.close()

    return step


def _correct(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per example: how many of its scored steps predict their label (a classifier: 0 or 1)."""
    return ((logits.argmax(-1) == labels) & (labels != -100)).sum(-1).float()


_MEASURES = {"loss": lambda logits, labels: sequence_nll(logits, labels)[0], "accuracy": _correct}


def _encoded(hidden: torch.Tensor) -> object:
    """The encoder's output as a seq2seq model's forward takes it back: transformers' ``BaseModelOutput``, which reads
    as the 1-tuple older forwards index (``encoder_outputs[0]``) and has the ``last_hidden_state`` newer ones read
    (T5Gemma 2's; a bare tuple there raises)."""
    from transformers.modeling_outputs import BaseModelOutput

    return BaseModelOutput(last_hidden_state=hidden)


def _ablate_loss(model, data, info, variants, batch_size, max_rows, progress, metrics=("loss",)):
    """Loss (and, for a classifier, accuracy) of every variant: ``{metric: (values, signature)}``."""
    if info.is_seq2seq and data.references is None and data.translations is None:
        raise HeadlabError("ablation with the loss needs references or the model's translations")
    device = next(model.parameters()).device
    measures = {m: _MEASURES[m] for m in metrics}
    shard = active()  # several processes: each its own batches
    # Per batch: each metric's total under each variant and unmasked, added in batch order (a
    # Ledger: in several processes, the one-process sums to the bit).
    ledger = Ledger(shard, ({m: {(b.key, h): 0.0 for b, h in variants} for m in metrics}, dict.fromkeys(metrics, 0.0)))
    n_tokens = 0.0
    tick = _progress(_n_passes(len(data), batch_size, variants, max_rows, shard), "ablation", progress)
    # the floor: a float64 eager model's padding query that sees no key (a sliding window) is NaN otherwise, and a
    # bidirectional model's next layer reads it into real rows; no other value changes (capture.float32_mask_floor)
    with eval_mode(model), torch.no_grad(), float32_mask_floor(model):
        for number, batch in shard.numbered(make_batches(data, info, batch_size=batch_size, side="reference",
                                                         device=device, mask_tokens=True)):
            encoder_out = None
            recorder = _LayerRecorder(model, [b for b, _ in variants])
            try:
                if info.is_seq2seq:
                    encoder_out = model.get_encoder()(
                        input_ids=batch.inputs["input_ids"], attention_mask=batch.inputs["attention_mask"]
                    ).last_hidden_state
                    logits = model(encoder_outputs=_encoded(encoder_out), **batch.inputs, use_cache=False).logits
                else:
                    logits = forward_logits(model, batch.inputs, info)
            finally:
                recorder.remove()
            nll, count = sequence_nll(logits, batch.labels)
            check_finite_loss("ablation", nll, f"in its loss on sentences {_sentences(batch.index)}")
            base = {m: float(measure(logits, batch.labels).sum()) for m, measure in measures.items()}
            n_tokens += float(count.sum())  # an integer: exact in any order
            tick(1)
            copies = max(1, max_rows // batch.size)
            masked: dict = {m: {} for m in metrics}
            for group in _groups(variants, copies):
                per_metric = _loss_group(model, info, batch, group, encoder_out, recorder, measures)
                for m, totals_group in per_metric.items():
                    for (block, head), value in zip(group, totals_group):
                        masked[m][(block.key, head)] = value
                tick(1)
            ledger.add(number, (masked, base))
    totals, base_totals = ledger.total()
    n_tokens = shard.sum(n_tokens)
    if n_tokens == 0:
        raise HeadlabError("ablation: no token to score in the data")
    out = {}
    for m in metrics:
        base = base_totals[m] / n_tokens
        sign = -1.0 if m == "accuracy" else 1.0  # higher = more important: a loss rise, an accuracy drop
        values: dict[str, list[float]] = {}
        for (key, head), total in totals[m].items():
            values.setdefault(key, [0.0] * _n_heads(variants, key))[head] = sign * (total / n_tokens - base)
        score = "accuracy - accuracy(masked)" if m == "accuracy" else "loss(masked) - loss"
        out[m] = (values, {f"base_{m}": base, "n_scored_tokens": int(n_tokens), "score": score})
    return out


def _n_heads(variants: list[Variant], key) -> int:
    return next(b.n_heads for b, _ in variants if b.key == key)


def _loss_group(model, info: ModelInfo, batch: Batch, group: list[Variant], encoder_out,
                recorder: _LayerRecorder, measures=None) -> dict[str, list[float]]:
    """Per measure (summed token NLL, correct predictions), the batch's total under each variant
    of ``group`` (one block), in one forward call."""
    measures = measures or {"loss": _MEASURES["loss"]}
    rows, copies = batch.size, len(group)
    inputs = expand_batch(batch, copies)
    labels = batch.labels.repeat(copies, 1)
    gates = _variant_gates(group, rows, labels.device)
    decoder_only = encoder_out is not None and all(block.kind != "enc_self" for block, _ in group)
    with gates_attached(model, gates), recorder.start_at(group[0][0], copies):
        if decoder_only:  # the encoder is unchanged by decoder heads: reuse its output
            logits = model(encoder_outputs=_encoded(encoder_out.repeat(copies, 1, 1)), **inputs,
                           use_cache=False).logits
        else:
            logits = forward_logits(model, inputs, info)
    totals = {m: measure(logits, labels).view(copies, rows).sum(-1) for m, measure in measures.items()}
    losses = totals["loss"] if "loss" in totals else sequence_nll(logits, labels)[0].view(copies, rows).sum(-1)
    for (block, head), loss in zip(group, losses):  # a NaN logit makes its loss NaN: accuracy's argmax would hide it
        check_finite_loss("ablation", loss, f"with {block.kind} layer {block.layer} head {head} masked, in its loss on "
                          f"sentences {_sentences(batch.index)}")
    return {m: total.tolist() for m, total in totals.items()}


def _sentences(index: list[int]) -> str:
    """The batch's sentences, numbered from 1 in the data's order (empty lines skipped)."""
    return spans(sorted(i + 1 for i in index))


def _ablate_bleu(model, data, info, variants, batch_size, max_rows, beam, tokenizer, progress):
    if not info.is_seq2seq:
        raise HeadlabError("BLEU ablation needs a translation (encoder-decoder) model; use --metric loss")
    if data.references is None or not data.reference_texts:
        raise HeadlabError("BLEU ablation needs reference translations (--target)")
    if tokenizer is None:
        raise HeadlabError("BLEU ablation needs the model's tokenizer to turn translations into text")
    if problem := generation_cache_problem(model):  # transformers' generate would fail at the first batch
        raise HeadlabError(f"BLEU ablation: {problem}")
    from sacrebleu.metrics import BLEU

    device = next(model.parameters()).device
    base_hyps = [""] * len(data)
    hyps = {(b.key, h): [""] * len(data) for b, h in variants}
    shard = active()  # several processes: each translates its own batches, gathered below
    tick = _progress(_n_passes(len(data), batch_size, variants, max_rows // beam, shard), "ablation (bleu)", progress)

    def generate(inputs: dict[str, torch.Tensor]) -> list[str]:
        ids = inputs["input_ids"]
        limit = min(int(1.5 * ids.shape[1] + 10), info.max_length - 1)
        out = model.generate(
            input_ids=ids, attention_mask=inputs["attention_mask"], num_beams=beam, do_sample=False,
            max_new_tokens=max(limit, 1), max_length=None,  # None: no warning about the config's max_length
        )
        return tokenizer.batch_decode([generated_tokens(row, info) for row in out.tolist()], skip_special_tokens=True)

    owned: list[int] = []  # the sentences this process translates
    with eval_mode(model), torch.no_grad(), float32_mask_floor(model):  # as in _ablate_loss
        for batch in shard.take(make_batches(data, info, batch_size=batch_size, side="reference", device=device)):
            encoder_inputs = {k: batch.inputs[k] for k in ("input_ids", "attention_mask")}
            owned += batch.index
            for i, text in zip(batch.index, generate(encoder_inputs)):
                base_hyps[i] = text
            tick(1)
            copies = max(1, max_rows // (batch.size * beam))
            for group in _groups(variants, copies):
                expanded = {k: v.repeat(len(group), 1) for k, v in encoder_inputs.items()}
                with gates_attached(model, _variant_gates(group, batch.size, device)):
                    texts = generate(expanded)
                for j, (block, head) in enumerate(group):
                    for i, text in zip(batch.index, texts[j * batch.size : (j + 1) * batch.size]):
                        hyps[(block.key, head)][i] = text
                tick(1)
    if shard.split:  # each sentence was translated by one process: take its texts
        parts = shard.gather(([base_hyps[i] for i in owned], {v: [t[i] for i in owned] for v, t in hyps.items()}, owned))
        for base_part, hyp_part, indices in parts:
            for j, i in enumerate(indices):
                base_hyps[i] = base_part[j]
                for variant, texts in hyp_part.items():
                    hyps[variant][i] = texts[j]
    refs = [data.reference_texts]
    bleu = BLEU()
    base = bleu.corpus_score(base_hyps, refs).score
    values: dict[str, list[float]] = {}
    for (key, head), texts in hyps.items():
        values.setdefault(key, [0.0] * _n_heads(variants, key))[head] = base - BLEU().corpus_score(texts, refs).score
    signature = {"base_bleu": base, "beam": beam, "score": "BLEU - BLEU(masked)", "bleu_signature": str(bleu.get_signature())}
    return values, signature


class Ablation(ImportanceMeasure):
    """:func:`compute_ablation_tables` as a registered measure: the ground truth of the agreement
    table. A classifier scored by its loss also gets ``ablation_accuracy`` from the same passes."""

    name = "ablation"
    tables = {"ablation": ("Ablation", "change of the metric when the head alone is masked (the ground truth of "
                                       "the agreement table)")}
    needs_lm_head = True
    uses_loss = True
    on_request = "also score heads by ablation (slow) and compare every measure with it"
    Options = AblationOptions

    def unavailable(self, info, data) -> str | None:
        reason = super().unavailable(info, data)
        if reason is None and self.options.metric == "bleu" and (not info.is_seq2seq or data.references is None):
            return "BLEU needs a translation model and reference translations (--target)"
        if reason is None and self.options.metric == "accuracy" and info.arch != "classifier":
            return "--metric accuracy is for classifiers (a labelled TSV); use --metric loss or bleu"
        return reason

    def score_tables(self, model, data, info, *, batch_size=32, kinds=None, progress=False,  # type: ignore[override]
                     tokenizer=None) -> list[HeadScores]:  # (the keywords the callers pass, named)
        o = self.options
        metrics = (o.metric, "accuracy") if info.arch == "classifier" and o.metric == "loss" else (o.metric,)
        return compute_ablation_tables(model, data, info, metrics=metrics, batch_size=batch_size, max_rows=o.rows,
                                       kinds=kinds, beam=o.beam, tokenizer=tokenizer, progress=progress)
