"""The development curve of gated fine-tuning: has the fine-tuning stopped moving?

With ``--dev-src/--dev-tgt`` and ``--dev-every N``, :func:`~headlab.pruning.train.prune_train`
translates the development set greedily every N updates (and once before the first update), with
the gates at their test-time values (footnote 7 of Voita et al. 2019: the model that would be
exported at that step). The development set must not be the final evaluation set (``--valid-src``):
the curve is read to decide whether to fine-tune longer, so it must not be the set the result is
reported on.

Files in the point's directory (the layout of :mod:`headlab.pruning.train`)::

    dev_curve.jsonl        one record per evaluation: step, BLEU with its 95% bootstrap interval
                           over the development sentences, chrF, heads open per kind (appended, fsync'ed);
                           ``tied_at_cut`` where a budget's cut fell among gates of equal log alpha
                           (HardConcreteGates.budget_tie: every gate at a budget run's step 0)
    dev/step-NNNNNN.txt    the greedy translations of that evaluation (for paired comparisons)

A resumed run appends; a step evaluated twice (after a kill) keeps its newer record. At the end,
:func:`plateau` compares the last evaluation with the one at half the run's updates (paired
bootstrap over the development sentences) and the point's ``result.json`` holds the curve and
that comparison (``dev``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from headlab.errors import counted
from headlab.heads import atomic_write_text
from headlab.nmt.bleu import bleu_interval, compute_scores, paired_bootstrap
from headlab.resume import append_record, read_step_records

__all__ = ["DEV_CURVE_FILE", "DEV_DIR", "DevCurve", "read_dev_curve", "plateau", "FLAT_BLEU", "tie_note"]

DEV_CURVE_FILE = "dev_curve.jsonl"
DEV_DIR = "dev"
FLAT_BLEU = 0.5
"""A curve counts as flat when a further gain of this much BLEU over its second half is excluded."""


def read_dev_curve(path: str | os.PathLike) -> list[dict]:
    """The records of ``dev_curve.jsonl`` (or of a point directory), by step; torn lines skipped."""
    path = Path(path)
    if path.is_dir():
        path = path / DEV_CURVE_FILE
    return read_step_records(path)


def tie_note(tie: dict) -> str:
    """What a record's ``tied_at_cut`` means, in words."""
    return (f"the budget's cut falls among {tie['tied']} gates of equal log alpha: {tie['kept']} of those heads kept by "
            "position, not by the gates")


def _hypotheses_file(out_dir: Path, step: int) -> Path:
    return out_dir / DEV_DIR / f"step-{step:06d}.txt"


class DevCurve:
    """Evaluates the development set at a step and records it; ``open_heads()`` gives the heads
    whose test-time gate is open, per kind."""

    def __init__(self, data, out_dir: str | os.PathLike, every: int, *, tokenizer, open_heads: Callable[[], dict],
                 batch_size: int = 64, log: Callable[[str], None] = print,
                 budget_tie: Callable[[], dict | None] = lambda: None):
        self.data, self.out_dir, self.every = data, Path(out_dir), every
        self.tokenizer, self.open_heads, self.batch_size, self.log = tokenizer, open_heads, batch_size, log
        self.budget_tie = budget_tie
        self.path = self.out_dir / DEV_CURVE_FILE

    def done(self, step: int) -> bool:
        return any(r["step"] == step for r in read_dev_curve(self.path)) and _hypotheses_file(self.out_dir, step).is_file()

    def evaluate(self, model, step: int) -> dict:
        """Greedy translations of the development set by ``model`` as it is now (eval mode)."""
        from headlab.nmt.translate import translate

        hypotheses = translate(model, self.tokenizer, list(self.data.sources), beam=1, batch_size=self.batch_size)
        references = list(self.data.targets)
        scores = compute_scores(hypotheses, references)
        _, low, high = bleu_interval(hypotheses, references)
        atomic_write_text(_hypotheses_file(self.out_dir, step), "".join(h.replace("\n", " ") + "\n" for h in hypotheses))
        record = {"step": step, "bleu": scores.bleu, "low": low, "high": high, "chrf": scores.chrf, "beam": 1,
                  "n_sentences": len(references), "heads_open": self.open_heads()}
        tie = self.budget_tie()
        if tie is not None:  # the heads evaluated were chosen by position among tied gates, not by the gates
            record["tied_at_cut"] = tie
        append_record(self.path, record)
        self.log(f"step {step}: dev BLEU {scores.bleu:.2f} [{low:.2f}, {high:.2f}] "
                 f"(greedy, {counted(len(references), 'sentence')})" + (f"; {tie_note(tie)}" if tie else ""))
        return record

    def callback(self, model, step: int, info: dict) -> None:
        if info.get("is_main_process", True) and self.every > 0 and step % self.every == 0:
            self.evaluate(model, step)

    def summary(self) -> dict:
        """The curve and :func:`plateau`'s comparison (what ``result.json`` stores as ``dev``)."""
        curve = read_dev_curve(self.path)
        return {"every": self.every, "n_sentences": len(self.data.targets), "curve": curve,
                "plateau": plateau(curve, self.out_dir, list(self.data.targets))}


def plateau(curve: list[dict], out_dir: Path, references: list[str]) -> dict | None:
    """The last evaluation against the last one at or before half its step: the change in BLEU
    with its 95% paired bootstrap interval over the development sentences, and the call:

    ``flat`` when the interval's upper end is below :data:`FLAT_BLEU` (a gain of that much over
    the second half is excluded; a decline counts as flat: more of the same fine-tuning would not
    help), ``rising`` when the interval lies above 0, ``undecided`` otherwise. None with fewer than
    two evaluations or without their translations."""
    if len(curve) < 2:
        return None
    last = curve[-1]
    earlier = [r for r in curve[:-1] if r["step"] <= last["step"] / 2] or curve[:1]
    first = earlier[-1]
    files = [_hypotheses_file(out_dir, r["step"]) for r in (first, last)]
    if not all(f.is_file() for f in files):
        return None
    a, b = (f.read_text(encoding="utf-8").splitlines() for f in files)
    if not len(a) == len(b) == len(references):
        return None
    out = paired_bootstrap(a, b, references)
    call = "flat" if out["high"] < FLAT_BLEU else "rising" if out["low"] > 0 else "undecided"
    return {"from_step": first["step"], "to_step": last["step"], "delta": out["delta"], "low": out["low"],
            "high": out["high"], "p": out["p"], "call": call, "tolerance": FLAT_BLEU}
