"""The generated tables of a translation model's card: training curve, scores, and the curve under the loss rule.

Each renders one block of the card from a result file that a command wrote
(``train_history.json`` from ``headlab nmt train``/``nmt export``, ``eval_results.json`` from
experiments/evaluate_model.py), so the card's numbers are never typed by hand;
tests/test_nmt_bundled.py re-renders and compares.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

__all__ = ["render_card_blocks", "render_blocks", "curve_table", "scores_table", "CARD_BLOCKS"]

CARD_BLOCKS = ("curve", "scores", "loss-rule-curve")


def _covered(history: list[dict]) -> list[float | None]:
    """The share of each epoch's target tokens that its record's minutes and speed cover.

    Below 1 where a trainer older than 2026-11-24 resumed the run inside the epoch: its record
    (train loss, minutes, speed) covered only the part after the resume. None where the record
    has no ``tokens_seen`` to tell.
    """
    shares: list[float | None] = []
    before: int | None = 0
    for row in history:
        seen = row.get("tokens_seen")
        if seen is None or before is None or seen <= before:
            shares.append(None)
        else:
            shares.append(row["tokens_per_s"] * row["epoch_minutes"] * 60 / (seen - before))
        before = seen
    return shares


def number(value: float | None, spec: str) -> str:
    """``value`` in ``spec``; "n/a" for null (a NaN that the training wrote as null) and for NaN
    (a file written before that)."""
    return "n/a" if value is None or value != value else format(value, spec)


def curve_table(history: list[dict]) -> str:
    """The training curve: one row per epoch record of ``train_history.json``."""
    losses = any("valid_loss" in row for row in history)  # validation losses are recorded since 2026-11-24
    lines = ["| epoch | updates | target tokens seen | train loss (label-smoothed) | val BLEU | val chrF2 "
             + ("| val loss " if losses else "") + "| minutes | target tok/s |",
             "|---:|---:|---:|---:|---:|---:|" + ("---:|" if losses else "") + "---:|---:|"]
    partial = []
    for row, share in zip(history, _covered(history)):
        # records written before the trainer kept the count have no tokens_seen
        seen = f"{row['tokens_seen']:,}" if "tokens_seen" in row else "n/a"
        mark = ""
        if share is not None and share < 0.99:
            mark = "*"
            partial.append(f"{row['epoch']} ({share:.0%})")
        loss = (f"| {number(row['valid_loss'], '.4f')} " if "valid_loss" in row else "| ") if losses else ""
        lines.append(f"| {row['epoch']} | {row['step']:,} | {seen} | {number(row['train_loss'], '.3f')}{mark} "
                     f"| {number(row['valid_bleu'], '.2f')} | {number(row['valid_chrf'], '.2f')} {loss}"
                     f"| {row['epoch_minutes']:.1f}{mark} | {row['tokens_per_s']:,.0f}{mark} |")
    if partial:
        lines += ["", f"\\* Resumed inside the epoch by a trainer older than 2026-11-24, whose record covers only "
                      f"the part after the resume (its share of the epoch's tokens): epoch{'s' * (len(partial) > 1)} "
                      f"{', '.join(partial)}."]
    return "\n".join(lines) + "\n"


def scores_table(results: dict) -> str:
    """The test scores: one row per run of ``eval_results.json``."""
    lines = ["| set | sentences | decoding | BLEU | chrF2 | command |", "|---|---:|---|---:|---:|---|"]
    for run in results["runs"]:
        decoding = "greedy" if run["beam"] == 1 else f"beam {run['beam']}"
        lines.append(f"| {run['split']} | {run['n_sentences']:,} | {decoding} | {run['bleu']:.2f} "
                     f"| {run['chrf']:.2f} | `{run['command']}` |")
    return "\n".join(lines) + "\n"


def render_blocks(model_dir: str | Path, sources: dict[str, tuple[str, Callable[[Any], str]]]) -> dict[str, str]:
    """``{block name: markdown}``: each source ``(result file, renderer)`` whose file is in ``model_dir``."""
    blocks = {}
    for name, (file, render) in sources.items():
        path = Path(model_dir) / file
        if path.is_file():
            blocks[name] = render(json.loads(path.read_text(encoding="utf-8")))
    return blocks


def render_card_blocks(model_dir: str | Path) -> dict[str, str]:
    """``{block name: markdown}`` for the result files present in ``model_dir``.

    ``loss_rule_history.json``, where a card has one: the same recipe trained again under the
    validation-loss patience rule (``RULE=loss experiments/train_translation.sh``).
    """
    return render_blocks(model_dir, {"curve": ("train_history.json", curve_table),
                                     "scores": ("eval_results.json", scores_table),
                                     "loss-rule-curve": ("loss_rule_history.json", curve_table)})
