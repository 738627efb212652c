"""All importance measures in one run: what ``headlab importance`` calls.

:func:`run_importance` prepares the data once (tokens, the model's own translations), runs
the chosen measures, and compares each with ablation. Measures that cannot run on a model
(LRP, gradient importance and ablation need a language-model head; LRP a rule for every
normalisation) are skipped with a reason when the user asked for ``all``, and are an error when
asked for by name. A measure that fails while running does not lose the others: they run on, and
:class:`MeasuresFailed` carries their result (``headlab importance`` writes it, then exits 1).
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from headlab._version import __version__
from headlab.adapters import attention_blocks, idle_blocks
from headlab.compiled import model_entry
from headlab.data.inputs import ImportanceData, translate_data
from headlab.errors import HeadlabError, RunFailed
from headlab.heads import HeadScores, HeadSpec
from headlab.importance.agreement import AgreementTable, compute_agreement
from headlab.importance.common import original_mask
from headlab.importance.config import ImportanceConfig
from headlab.importance.registry import MEASURES, REFERENCE
from headlab.model_description import ModelInfo
from headlab.shard import active
from headlab.surgery import declared_numbering

__all__ = ["ImportanceConfig", "ImportanceResult", "MeasuresFailed", "run_importance", "save_results"]


@dataclass
class ImportanceResult:
    scores: dict[str, HeadScores]
    agreement: AgreementTable | None
    skipped: dict[str, str]
    data: ImportanceData

    def __repr__(self) -> str:
        lines = [f"ImportanceResult on {self.data.summary()}"]
        lines += [f"  {table!r}" for table in self.scores.values()]
        lines += [f"  skipped {name}: {reason}" for name, reason in self.skipped.items()]
        if self.agreement is not None:
            lines.append(f"  {self.agreement!r}")
        return "\n".join(lines)


class MeasuresFailed(RunFailed):
    """Some measures failed while running; ``result`` holds the scores of those that did not."""

    def __init__(self, failures: dict[str, str], result: ImportanceResult) -> None:
        super().__init__("; ".join(f"{name} failed: {message}" for name, message in failures.items()))
        self.failures = failures
        self.result = result


@model_entry  # torch.compile's wrapper: its model, run eagerly (headlab.compiled)
def run_importance(
    model: nn.Module,
    data: ImportanceData,
    info: ModelInfo,
    config: ImportanceConfig | None = None,
    *,
    tokenizer=None,
    mask: HeadSpec | None = None,
    log: Callable[[str], None] = lambda message: None,
) -> ImportanceResult:
    """Run the configured measures over ``data`` and compare them with ablation; with ``mask``,
    on the model with those heads switched off (:meth:`ImportanceMeasure.run`). ``mask`` is in
    the current numbering (as :func:`~headlab.gates.mask_heads` takes it); the tables, and the
    mask their signature records, name a pruned model's heads by their original index."""
    config = config or ImportanceConfig()
    from headlab.gates import refuse_gated

    refuse_gated(model, "importance", instead="give mask= (run_importance's), which the tables record")
    kinds, left_out = _text_kinds(model, config.kinds)
    if left_out:
        log(f"leaving out {left_out}: token ids do not run them, so no measure can score them from text")
    asked_all = "all" in config.methods
    measures = {name: MEASURES[name](MEASURES[name].options_from(config)) for name in config.resolved_methods()}
    skipped = {name: reason for name, m in measures.items()
               if (reason := m.unavailable(info, data) or m.unsupported(model)) is not None}
    if skipped and not asked_all:
        reasons: dict[str, list[str]] = {}
        for name, reason in skipped.items():
            reasons.setdefault(reason, []).append(name)
        raise HeadlabError("cannot run " + "; ".join(f"{', '.join(names)}: {r}" for r, names in reasons.items()))
    for name, reason in skipped.items():
        log(f"skipping {name}: {reason}")
        del measures[name]
    if not measures:
        raise HeadlabError("no importance measure can run on this model: " + "; ".join(f"{m}: {r}" for m, r in skipped.items()))
    needs_translation = info.is_seq2seq and data.translations is None and (
        any(m.reads_translation for m in measures.values()) or data.references is None
    )
    if needs_translation:
        log("translating the data with the model (its own output is what confidence and LRP score)")
        data = translate_data(model, data, info, batch_size=config.batch_size, beam=config.beam, progress=config.progress)
    options = config.signature_options()  # every measure's options that change the numbers
    if mask:
        options["mask"] = {f"{kind}:{layer}": heads for (kind, layer), heads in original_mask(model, mask).items()}
    scores: dict[str, HeadScores] = {}
    failures: dict[str, str] = {}
    for name, measure in measures.items():
        log(f"computing {name}")
        try:
            tables = measure.run(model, data, info, mask=mask, batch_size=config.batch_size, kinds=kinds,
                                 progress=config.progress, tokenizer=tokenizer)
        except Exception as error:  # the measures already computed, and those to come, are kept
            # One measure alone has nothing to keep; processes of a sharded run must stop together.
            if len(measures) == 1 or active().split:
                raise
            if not isinstance(error, HeadlabError):
                traceback.print_exc(file=sys.stderr)
            failures[name] = str(error) if isinstance(error, HeadlabError) else f"{type(error).__name__}: {error}"
            log(f"{name} failed: {failures[name]}")
            continue
        for table in tables:
            scores[table.method] = _with_versions(table, {**options, "dtype": _weights_dtype(model)}, left_out,
                                                  declared_numbering(model))
    agreement = None
    if REFERENCE in scores and len(scores) > 1:
        agreement = compute_agreement({k: v for k, v in scores.items() if k != REFERENCE}, scores[REFERENCE])
    result = ImportanceResult(scores, agreement, skipped, data)
    if failures:
        raise MeasuresFailed(failures, result)
    return result


def _text_kinds(model: nn.Module, kinds: tuple[str, ...] | None) -> tuple[tuple[str, ...] | None, str | None]:
    """The kinds to score and what is left out: a multimodal wrapper's vision or audio tower
    (:attr:`~headlab.adapters.AttentionBlock.idle`) never runs on token ids, where every measure would
    score its heads 0 (gradient, ablation) or fail; its kind is left out, never scored, and where its blocks are
    numbered after those text runs of their kind (:func:`headlab.adapters.attention_blocks`: ModernVBERT's tower
    beside its text encoder) the kind is scored without them. Asking for a kind text does not run, or one with such
    a block among the layers text runs, is refused before any work."""
    blocks = attention_blocks(model)
    left_out = idle_blocks(blocks, None if kinds is None else {b.key for b in blocks if b.kind in kinds})
    if left_out is None:
        return kinds, None
    asked = kinds if kinds is not None else tuple(dict.fromkeys(b.kind for b in blocks))
    runs = [k for k in asked if any(b.kind == k and not b.idle and b.n_heads for b in blocks)]
    # a kind whose idle blocks follow its text's (a tower numbered after them: ModernVBERT's) is scored without them,
    # its table the text's (block_scores); one with an idle block among the text's layers cannot be
    last = {k: max(b.layer for b in blocks if b.kind == k and not b.idle) for k in runs}
    mixed = [k for k in runs if any(b.kind == k and b.idle and b.layer < last[k] for b in blocks)]
    unrun = [k for k in asked if k not in runs]
    why = f"{left_out}, which token ids do not run (a vision or audio tower, a cross-attention given no encoder states)"
    if mixed:
        raise HeadlabError(f"{mixed[0]} holds blocks that text runs beside {why}; no measure can score the latter "
                           "from text, and headlab cannot leave a layer out of a kind's table")
    if kinds is not None and unrun or not runs:
        have = sorted({b.kind for b in blocks if not b.idle and b.n_heads})
        raise HeadlabError(f"kinds {','.join(unrun)}: {why}, so no measure can score them from text; "
                           f"score the kinds text runs ({', '.join(have) or 'none'})")
    return tuple(runs), left_out


def _weights_dtype(model) -> str:
    """The dtype of the model's floating-point weights (--dtype): the numbers differ by it (bfloat16 keeps 8 bits of
    mantissa), and a table of a bfloat16 run read like one of a float32 run (:func:`headlab.heads.weights_dtype`)."""
    from headlab.heads import weights_dtype

    return weights_dtype(model)


def _with_versions(table: HeadScores, options: dict, left_out: str | None = None, numbering: dict | None = None) -> HeadScores:
    """``table`` signed: options, versions, kinds left out, and ``numbering`` (a pruned model whose head numbers
    were reconstructed says so in every table computed on it: :func:`headlab.surgery.declared_numbering`)."""
    import torch
    import transformers

    signature = {
        **table.signature,
        "options": options,
        "versions": {"headlab": __version__, "torch": torch.__version__, "transformers": transformers.__version__},
        **(numbering or {}),
    }
    if left_out:  # the kinds of the tables are what was scored; this says what was not, and why
        signature["left_out"] = f"{left_out}: not run by token ids, not scored"
    return HeadScores(table.scores, table.method, table.model, signature)


def save_results(result: ImportanceResult, directory: str | os.PathLike) -> list[Path]:
    """One HeadScores JSON per method, plus agreement.json / agreement.md when there is ablation."""
    directory = Path(directory)
    written = [table.save(directory / f"{name}.json") for name, table in result.scores.items()]
    if result.agreement is not None:
        written.extend(result.agreement.save(directory))
    return written
