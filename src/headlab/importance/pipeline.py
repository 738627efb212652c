"""All importance measures in one run: what ``headlab importance`` calls.

:func:`run_importance` prepares the data once (tokens, the model's own translations), runs
the chosen measures, and compares each with ablation. Measures that cannot run on a model
(LRP, gradient importance and ablation need a language-model head) are skipped with a reason
when the user asked for ``all``, and are an error when asked for by name.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from headlab._version import __version__
from headlab.errors import HeadlabError
from headlab.heads import HeadScores
from headlab.importance.ablation import compute_ablation_tables
from headlab.importance.agreement import AgreementTable, compute_agreement
from headlab.importance.config import ImportanceConfig
from headlab.importance.confidence import compute_confidence
from headlab.importance.data import ImportanceData, ModelInfo, translate_data
from headlab.importance.gradient import compute_gradient, l2_normalize_per_layer
from headlab.importance.lrp import compute_lrp

__all__ = ["METHODS", "ImportanceConfig", "ImportanceResult", "run_importance", "save_results"]

NEEDS_LM_HEAD = ("lrp", "gradient", "ablation")


def _confidence(model, data, info, config, tokenizer):
    return [compute_confidence(model, data, info, batch_size=config.batch_size, kinds=config.kinds, progress=config.progress)]


def _lrp(model, data, info, config, tokenizer):
    return [compute_lrp(model, data, info, batch_size=config.batch_size, strategy=config.lrp_strategy,
                        kinds=config.kinds, progress=config.progress)]


def _gradient(model, data, info, config, tokenizer):
    raw = compute_gradient(model, data, info, batch_size=config.batch_size, normalize=False,
                           kinds=config.kinds, progress=config.progress)
    return [l2_normalize_per_layer(raw, "gradient"), raw]


def _ablation(model, data, info, config, tokenizer):
    # A classifier's ablation gives the task loss and the accuracy from the same passes.
    metrics = (config.metric, "accuracy") if info.arch == "classifier" and config.metric == "loss" else (config.metric,)
    return compute_ablation_tables(model, data, info, metrics=metrics, batch_size=config.batch_size,
                                   max_rows=config.ablation_rows, kinds=config.kinds, beam=config.beam,
                                   tokenizer=tokenizer, progress=config.progress)


METHODS: dict[str, Callable] = {
    "confidence": _confidence,
    "lrp": _lrp,
    "gradient": _gradient,
    "ablation": _ablation,
}
"""Registry: method name -> runner returning one or more HeadScores."""


@dataclass
class ImportanceResult:
    scores: dict[str, HeadScores]
    agreement: AgreementTable | None
    skipped: dict[str, str]
    data: ImportanceData


def run_importance(
    model: nn.Module,
    data: ImportanceData,
    info: ModelInfo,
    config: ImportanceConfig | None = None,
    *,
    tokenizer=None,
    log: Callable[[str], None] = lambda message: None,
) -> ImportanceResult:
    """Run the configured measures over ``data`` and compare them with ablation."""
    config = config or ImportanceConfig()
    methods = config.resolved_methods()
    asked_all = "all" in config.methods
    skipped: dict[str, str] = {}
    if not info.has_lm_head:
        blocked = [m for m in methods if m in NEEDS_LM_HEAD]
        reason = "the model has no language-model head (no logits to explain, no loss to differentiate)"
        if blocked and not asked_all:
            raise HeadlabError(f"cannot run {', '.join(blocked)}: {reason}")
        for m in blocked:
            skipped[m] = reason
            log(f"skipping {m}: {reason}")
        methods = [m for m in methods if m not in blocked]
    if config.metric == "bleu" and "ablation" in methods:
        if not info.is_seq2seq or data.references is None:
            reason = "BLEU needs a translation model and reference translations (--target)"
            if not asked_all:
                raise HeadlabError(f"cannot run ablation with --metric bleu: {reason}")
            skipped["ablation"] = reason
            log(f"skipping ablation: {reason}")
            methods.remove("ablation")
    if not methods:
        raise HeadlabError("no importance measure can run on this model: " + "; ".join(f"{m}: {r}" for m, r in skipped.items()))
    needs_translation = info.is_seq2seq and data.translations is None and (
        any(m in methods for m in ("confidence", "lrp")) or data.references is None
    )
    if needs_translation:
        log("translating the data with the model (its own output is what confidence and LRP score)")
        data = translate_data(model, data, info, batch_size=config.batch_size, beam=config.beam, progress=config.progress)
    options = {
        "batch_size": config.batch_size, "beam": config.beam, "lrp_strategy": config.lrp_strategy,
        "metric": config.metric, "kinds": list(config.kinds) if config.kinds else None,
    }
    scores: dict[str, HeadScores] = {}
    for name in methods:
        log(f"computing {name}")
        for table in METHODS[name](model, data, info, config, tokenizer):
            scores[table.method] = _with_versions(table, options)
    agreement = None
    if "ablation" in scores and len(scores) > 1:
        agreement = compute_agreement({k: v for k, v in scores.items() if k != "ablation"}, scores["ablation"])
    return ImportanceResult(scores, agreement, skipped, data)


def _with_versions(table: HeadScores, options: dict) -> HeadScores:
    import torch
    import transformers

    signature = {
        **table.signature,
        "options": options,
        "versions": {"headlab": __version__, "torch": torch.__version__, "transformers": transformers.__version__},
    }
    return HeadScores(table.scores, table.method, table.model, signature)


def save_results(result: ImportanceResult, directory: str | os.PathLike) -> list[Path]:
    """One HeadScores JSON per method, plus agreement.json / agreement.md when there is ablation."""
    directory = Path(directory)
    written = [table.save(directory / f"{name}.json") for name, table in result.scores.items()]
    if result.agreement is not None:
        written.extend(result.agreement.save(directory))
    return written
