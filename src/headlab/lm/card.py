"""The generated tables of a language model's card: training curve, perplexities, specialisation.

Each renders one block of the card from a result file that a command wrote
(``train_history.json`` from ``headlab lm train``, ``eval_results.json`` from
experiments/evaluate_lm.py, ``specialisation.json`` from experiments/lm_specialisation.py), so
the card's numbers are never typed by hand; tests/test_lm_bundled.py re-renders and compares.
"""

from __future__ import annotations

from pathlib import Path

from headlab.nmt.card import number, render_blocks

__all__ = ["render_card_blocks", "CARD_BLOCKS"]

CARD_BLOCKS = ("curve", "scores", "specialisation")


def _curve(history: list[dict]) -> str:
    lines = ["| epoch | updates | train loss | valid loss | valid perplexity | tokens/s | minutes |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for row in history:
        lines.append(f"| {row['epoch']} | {row['step']:,} | {number(row['train_loss'], '.3f')} "
                     f"| {number(row['valid_loss'], '.4f')} | {number(row['valid_perplexity'], '.2f')} "
                     f"| {row['tokens_per_s']:,.0f} | {row['epoch_minutes']:.1f} |")
    return "\n".join(lines) + "\n"


def _scores(results: dict) -> str:
    lines = ["| text | tokens | perplexity | loss (nats/subword) | command |", "|---|---:|---:|---:|---|"]
    for run in results["runs"]:
        lines.append(f"| {run['set']} | {run['tokens']:,} | {number(run['perplexity'], '.2f')} | {run['loss']:.4f} "
                     f"| `{run['command']}` |")
    return "\n".join(lines) + "\n"


def _specialisation(spec: dict) -> str:
    lines = ["| epoch | valid perplexity | most positional head, words | subwords | best previous-word head "
             "| max confidence | mean confidence |", "|---:|---:|---|---|---|---:|---:|"]
    for row in spec["epochs"]:
        pos = row["positional"]
        word, token, prev = pos["word"], pos["token"], pos["previous_word"]
        ppl = row.get("valid_perplexity")
        lines.append(
            f"| {row['epoch']} | {'' if ppl is None else f'{ppl:.2f}'} "
            f"| L{word['head'][0]} H{word['head'][1]} {100 * word['share']:.1f}% at {word['offset']:+d} "
            f"| L{token['head'][0]} H{token['head'][1]} {100 * token['share']:.1f}% at {token['offset']:+d} "
            f"| L{prev['head'][0]} H{prev['head'][1]} {100 * prev['share']:.1f}% "
            f"| {row['confidence_max']:.3f} | {row['confidence_mean']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def render_card_blocks(model_dir: str | Path) -> dict[str, str]:
    """``{block name: markdown}`` for the result files present in ``model_dir``."""
    return render_blocks(model_dir, {"curve": ("train_history.json", _curve), "scores": ("eval_results.json", _scores),
                                     "specialisation": ("specialisation.json", _specialisation)})
