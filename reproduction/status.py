"""Where a training run stands, as generated blocks of a document (docs/nmt.md's news-domain run).

A run that is analysed while it trains is documented from a folder of the files its commands
wrote (see docs/nmt.md, "Where the CPU run stands", for the commands that fill it)::

    train_history.json                 headlab nmt train: the run's history.json, one row per epoch
    epoch_losses.json                  experiments/checkpoint_losses.py: the validation loss of the
                                       epochs recorded before the trainer kept it
    eval_results.json                  experiments/evaluate_model.py: test BLEU and chrF2
    export.json                        headlab nmt export: which checkpoint was exported
    reproduction/specialisation.json   python -m reproduction, stage specialisation
    reproduction/claims.json           python -m reproduction, stage report

:func:`status_blocks` renders each present file into one block, so the document's numbers are
never typed by hand; reproduction/tests/test_reproduce_docs.py renders them again and compares.
"""

from __future__ import annotations

import json
from pathlib import Path

from headlab.nmt.card import curve_table, render_blocks, scores_table

__all__ = ["STATUS_CLAIMS", "claims_table", "specialisation_table", "status_blocks", "with_checkpoint_losses"]

# What the model was trained on and the claims that describe its heads (pruning needs a pruning run).
STATUS_CLAIMS = ("setting", "sec4", "sec5.1", "sec5.2", "sec5.3", "beyond", "specialisation")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def specialisation_table(record: dict) -> str:
    """One row per measured checkpoint of the specialisation stage (``specialisation.json``)."""
    threshold = record.get("positional_threshold", 0.9)
    lines = [f"| checkpoint | largest positional share, subword tokens | largest positional share, words "
             f"| encoder heads >= {threshold:.0%} (tokens / words) | largest confidence | mean confidence |",
             "|---|---:|---:|---:|---:|---:|"]
    for point in record["checkpoints"]:
        s = point["summary"]
        lines.append(f"| {point['checkpoint']} | {s['token_share']['max']:.1%} | {s['word_share']['max']:.1%} "
                     f"| {s['n_positional_token']} / {s['n_positional_word']} | {s['confidence']['max']:.2f} "
                     f"| {s['confidence']['mean']:.3f} |")
    return "\n".join(lines) + "\n"


def claims_table(claims: dict, model: str, keys: tuple[str, ...] = STATUS_CLAIMS) -> str:
    """``model``'s measured checks of the claims ``keys`` from ``claims.json``: value and verdict.
    A check with no value and no verdict for the model (a stage not run) is left out."""
    lines = ["| section | check | value | verdict |", "|---|---|---|---|"]
    for claim in claims["claims"]:
        if claim["key"] not in keys:
            continue
        for check in claim["checks"]:
            cell = check["models"].get(model)
            if not cell or not cell["value"] or cell["verdict"].startswith("not run"):
                continue
            verdict = "" if cell["verdict"] == "-" else cell["verdict"]
            lines.append(f"| {claim['key']} | {_cell(check['label'])} | {_cell(cell['value'])} | {_cell(verdict)} |")
    return "\n".join(lines) + "\n"


def with_checkpoint_losses(history: list[dict], measured: dict) -> list[dict]:
    """``history`` with ``valid_loss`` filled, where a record lacks it, from ``measured`` (the
    same loss of the same epoch's weights, computed afterwards from its checkpoint)."""
    by_epoch = {row["epoch"]: row["valid_loss"] for row in measured["epochs"]}
    return [{**row, "valid_loss": by_epoch[row["epoch"]]} if "valid_loss" not in row and row["epoch"] in by_epoch
            else row for row in history]


def status_blocks(folder: str | Path, model: str, prefix: str) -> dict[str, str]:
    """``{prefix + block: markdown}`` for the files present in ``folder``: ``curve`` (training
    history, with the checkpoints' validation losses), ``scores`` (test sets), ``specialisation``
    and ``claims`` (of ``model``)."""
    folder = Path(folder)
    losses_file = folder / "epoch_losses.json"
    losses = json.loads(losses_file.read_text(encoding="utf-8")) if losses_file.is_file() else None
    blocks = render_blocks(folder, {
        "curve": ("train_history.json",
                  lambda history: curve_table(with_checkpoint_losses(history, losses) if losses else history)),
        "scores": ("eval_results.json", scores_table),
        "specialisation": ("reproduction/specialisation.json", specialisation_table),
        "claims": ("reproduction/claims.json", lambda claims: claims_table(claims, model)),
    })
    return {prefix + name: body for name, body in blocks.items()}
