"""The decision rules of experiments/heavy_lifting_lm.md, applied to the finished configurations.

    python experiments/heavy_lifting_lm.py report --root /work/runs/heavy-lifting \
        --labels docs/results/heavy-lifting/labels.json --out docs/results/heavy-lifting

Reads ``<root>/<configuration>/eval.json`` (per-sentence losses) and the gated runs'
``prune/trajectory.jsonl``; writes ``results.json`` (every number) and ``results.md`` (the tables
and verdicts) under ``--out``. A rule whose runs are not all finished says which are missing.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import overload

import numpy as np

KEEPS = (24, 12, 6)
SEEDS = (1, 2, 3)
N_HEADS = 48
RESAMPLES = 10_000
ALPHA = 0.05
DELTA = 0.05  # non-inferiority bound, nats per subword (heavy_lifting_lm.md)
SETTLE = 0.02  # a run still falling by more than this (nats per token) between the epoch's third and last quarter
SETS = ("newstest2019", "ewt-test")


# ----------------------------------------------------------------------------- statistics


def resample_indices(n: int, resamples: int = RESAMPLES, seed: int = 12345) -> np.ndarray:
    """[resamples, n] sentence indices drawn with replacement (one fixed draw for every comparison)."""
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n), dtype=np.int32)


@overload
def loss_of(run: dict, name: str, idx: None = None) -> float: ...
@overload
def loss_of(run: dict, name: str, idx: np.ndarray) -> np.ndarray: ...
def loss_of(run: dict, name: str, idx: np.ndarray | None = None) -> np.ndarray | float:
    """Nats per subword of ``run`` on set ``name``: over all sentences, or per resample of ``idx``."""
    nll = np.asarray(run["sets"][name]["sentence_nll"], dtype=float)
    tok = np.asarray(run["sets"][name]["sentence_tokens"], dtype=float)
    if idx is None:
        return float(nll.sum() / tok.sum())
    return nll[idx].sum(axis=1) / tok[idx].sum(axis=1)


def paired_difference(a: list[dict], b: list[dict], name: str, idx: np.ndarray) -> dict:
    """mean loss of runs ``a`` minus mean loss of runs ``b`` (each a mean over its runs, e.g. the
    random seeds), on the same resampled sentences: the difference, its 95% percentile interval,
    and one-sided p-values for "below 0" and "above 0" ((1 + resamples on the other side) / (1 + R))."""
    point = float(np.mean([loss_of(r, name) for r in a]) - np.mean([loss_of(r, name) for r in b]))
    boot = np.mean([loss_of(r, name, idx) for r in a], axis=0) - np.mean([loss_of(r, name, idx) for r in b], axis=0)
    low, high = np.quantile(boot, [0.025, 0.975])
    n = len(boot)
    return {"difference": point, "low": float(low), "high": float(high),
            "p_below": float((1 + (boot >= 0).sum()) / (1 + n)), "p_above": float((1 + (boot <= 0).sum()) / (1 + n))}


def holm(pvalues: list[float], alpha: float = ALPHA) -> list[bool]:
    """Holm's step-down: which of ``pvalues`` are significant at family-wise ``alpha``."""
    order = sorted(range(len(pvalues)), key=lambda i: pvalues[i])
    significant = [False] * len(pvalues)
    for rank, i in enumerate(order):
        if pvalues[i] > alpha / (len(pvalues) - rank):
            break
        significant[i] = True
    return significant


def hypergeometric_tail(x: int, population: int, labelled: int, drawn: int) -> float:
    """P(X >= x), X the labelled heads among ``drawn`` heads chosen uniformly from ``population``."""
    total = math.comb(population, drawn)
    return sum(math.comb(labelled, i) * math.comb(population - labelled, drawn - i)
               for i in range(x, min(labelled, drawn) + 1)) / total


def still_falling(trajectory: list[dict], settle: float = SETTLE) -> float | None:
    """How much lower the logged batch loss is in the last quarter of the updates than in the third
    (positive = still falling), or None with too few records to tell (fewer than 2 per quarter)."""
    records = sorted((r["step"], r["loss"]) for r in trajectory if r.get("loss") is not None and r.get("step"))
    if not records:
        return None
    last = records[-1][0]
    third = [loss for step, loss in records if last / 2 < step <= 3 * last / 4]
    fourth = [loss for step, loss in records if 3 * last / 4 < step]
    if len(third) < 2 or len(fourth) < 2:
        return None
    return float(np.mean(third) - np.mean(fourth))


def settled(trajectory: list[dict]) -> bool | None:
    drop = still_falling(trajectory)
    return None if drop is None else drop <= SETTLE


def non_inferiority(d: dict, delta: float = DELTA) -> str:
    if d["high"] < delta:
        return "non-inferior"
    if d["low"] > delta:
        return "inferior"
    return "undecided"


# ----------------------------------------------------------------------------- rules


def rule_h1(runs: dict, idx: dict, unsettled: set[str]) -> dict:
    """Gates against k random heads (mean of the seeds) and the k least specialised, at each k."""
    needed = [f"gates-keep{k}" for k in KEEPS] + [f"least-{k}" for k in KEEPS] + \
        [f"random-{k}-s{s}" for k in KEEPS for s in SEEDS]
    missing = [name for name in needed if name not in runs]
    out: dict = {"comparisons": [], "missing": missing, "unsettled": sorted(unsettled & set(needed))}
    for k in KEEPS:
        gated = runs.get(f"gates-keep{k}")
        controls = {"random": [runs[f"random-{k}-s{s}"] for s in SEEDS if f"random-{k}-s{s}" in runs],
                    "least specialised": [runs[f"least-{k}"]] if f"least-{k}" in runs else []}
        for control, group in controls.items():
            if gated is None or not group:
                continue
            row = {"k": k, "control": control, "control_runs": len(group)}
            for name in SETS:
                row[name] = paired_difference([gated], group, name, idx[name])
            out["comparisons"].append(row)
    verdicts = {}
    for name in SETS:
        rows = out["comparisons"]
        below = holm([r[name]["p_below"] for r in rows]) if rows else []
        above = holm([r[name]["p_above"] for r in rows]) if rows else []
        for r, b, a in zip(rows, below, above):
            r[name]["gates_better"], r[name]["control_better"] = b, a
        # The plan's text: a missing or unsettled run means a second epoch, "not a verdict", even
        # when a control is already ahead (the amendment of 2026-11-26 09:40 UTC).
        if missing:
            verdicts[name] = "inconclusive: not all runs finished"
        elif out["unsettled"]:
            verdicts[name] = "inconclusive: a run has not settled (" + ", ".join(out["unsettled"]) + ")"
        elif any(above):
            verdicts[name] = "does not hold: a control is better than the gates"
        elif all(below):
            verdicts[name] = "holds"
        elif any(below):
            verdicts[name] = "partly"
        else:
            verdicts[name] = "does not hold"
    out["verdict_by_set"] = verdicts
    values = list(verdicts.values())
    if any(v.startswith("inconclusive") for v in values):
        out["verdict"] = next(v for v in values if v.startswith("inconclusive"))
    elif all(v == "holds" for v in values):
        out["verdict"] = "holds"
    elif any(v in ("holds", "partly") for v in values):
        out["verdict"] = "partly"
    else:
        out["verdict"] = "does not hold"
    return out


def rule_h2(runs: dict, labels: dict) -> dict:
    """Do the gates keep the labelled heads more often than chance? (hypergeometric, Holm over k)"""
    primary = {tuple(h) for h in labels["specialised"]}
    secondary = primary | {(0, 7), (4, 1)}
    rows = []
    for name in sorted(runs):
        if not name.startswith("gates-") or name == "gates-lam0":
            continue
        kept = {tuple(h) for h in runs[name]["kept"]}
        row = {"run": name, "kept": len(kept)}
        for label, heads in (("primary", primary), ("secondary", secondary)):
            x = len(kept & heads)
            row[label] = {"labelled_kept": x, "labelled": len(heads),
                          "expected": len(kept) * len(heads) / N_HEADS,
                          "p": hypergeometric_tail(x, N_HEADS, len(heads), len(kept))}
        rows.append(row)
    budget = [r for r in rows if r["run"] in {f"gates-keep{k}" for k in KEEPS}]
    missing = [f"gates-keep{k}" for k in KEEPS if f"gates-keep{k}" not in runs]
    significant = holm([r["primary"]["p"] for r in budget]) if budget else []
    if missing:
        verdict = "inconclusive: not all runs finished"
    elif all(significant):
        verdict = "holds"
    elif any(significant):
        verdict = "partly"
    else:
        verdict = "does not hold"
    return {"rows": rows, "missing": missing, "verdict": verdict}


def rule_h3(runs: dict) -> dict:
    full = runs.get("full")
    labelled = runs.get("ablation-labelled")
    random = [runs[n] for n in sorted(runs) if n.startswith("ablation-random-")]
    out: dict = {"random_sets": len(random)}
    if labelled is None and not random:  # a run directory of trainings only (the second epoch)
        out["verdict"] = "not in this run directory (no ablation: its result does not depend on the epochs)"
        return out
    if full is None or labelled is None or len(random) < 39:
        out["verdict"] = f"inconclusive: not all runs finished ({len(random)} of 39 random sets)"
        return out
    verdicts = {}
    for name in SETS:
        base = loss_of(full, name)
        delta = loss_of(labelled, name) - base
        deltas = [loss_of(r, name) - base for r in random]
        p = (1 + sum(d >= delta for d in deltas)) / (1 + len(deltas))
        out[name] = {"labelled": delta, "random_median": float(np.median(deltas)), "random_max": float(max(deltas)),
                     "p": p}
        verdicts[name] = p < ALPHA
    out["verdict"] = "holds" if all(verdicts.values()) else "partly" if any(verdicts.values()) else "does not hold"
    return out


def rule_noninferiority(runs: dict, idx: dict) -> list[dict]:
    control = runs.get("gates-lam0")
    out = []
    for k in KEEPS:
        gated = runs.get(f"gates-keep{k}")
        if gated is None or control is None:
            continue
        row: dict = {"k": k}
        for name in SETS:
            d = paired_difference([gated], [control], name, idx[name])
            row[name] = {**d, "call": non_inferiority(d)}
        out.append(row)
    return out


# ----------------------------------------------------------------------------- files


def read_runs(root: Path) -> dict[str, dict]:
    runs = {}
    for path in sorted(root.glob("*/eval.json")):
        runs[path.parent.name] = json.loads(path.read_text())
    return runs


def read_trajectory(run_dir: Path) -> list[dict]:
    path = run_dir / "prune" / "trajectory.jsonl"
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:  # a torn last line from a kill
            continue
    return records


def write_report(root: Path, labels: dict, out: Path, previous: Path | None = None) -> dict:
    """The rules on the runs under ``root``; with ``previous`` (the run directory of the epoch
    before), each run's held-out change since then is reported beside its loss (no rule uses it)."""
    runs = read_runs(root)
    if "full" not in runs:
        raise SystemExit(f"{root}: no full/eval.json yet")
    idx = {name: resample_indices(runs["full"]["sets"][name]["sentences"]) for name in SETS}
    falling = {name: still_falling(read_trajectory(root / name)) for name in runs
               if name.startswith(("gates-", "least-", "random-"))}
    unsettled = {name for name, drop in falling.items() if drop is None or drop > SETTLE}
    result: dict = {"losses": {name: {s: loss_of(run, s) for s in SETS} for name, run in runs.items()},
              "still_falling": falling, "h1": rule_h1(runs, idx, unsettled), "h2": rule_h2(runs, labels),
              "h3": rule_h3(runs), "noninferiority": rule_noninferiority(runs, idx)}
    if result["h1"]["unsettled"]:
        # Not a verdict: what the comparison part of H1 gives with every run taken as settled (the
        # rule above makes H1 inconclusive; this only says which way the numbers point).
        reading = rule_h1(runs, idx, set())
        result["h1_without_settling"] = {"verdict": reading["verdict"], "verdict_by_set": reading["verdict_by_set"]}
    if previous is not None:
        before = read_runs(previous)
        result["previous"] = previous.name  # the directory's name: the same wherever the runs are unpacked
        result["change_from_previous"] = {name: {s: loss_of(run, s) - loss_of(before[name], s) for s in SETS}
                                          for name, run in runs.items() if name in before and name != "full"}
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "results.md").write_text(markdown(result))
    print(markdown(result))
    return result


def markdown(result: dict) -> str:
    lines = ["# Heavy-lifting test on english-lm: results so far", "",
             "Generated by `experiments/heavy_lifting_lm.py report` from the run directory; rules in "
             "experiments/heavy_lifting_lm.md.", "",
             "| configuration | newstest2019 loss (perplexity) | EWT test loss (perplexity) | still falling (nats) |"
             + (" held-out change since the previous epoch (newstest2019 / EWT test) |" if "previous" in result else ""),
             "|---|---:|---:|---:|" + ("---:|" if "previous" in result else "")]
    for name, losses in result["losses"].items():
        if name.startswith("ablation-random-"):
            continue
        drop = result["still_falling"].get(name)
        cells = " | ".join(f"{losses[s]:.4f} ({math.exp(losses[s]):.2f})" for s in SETS)
        line = f"| {name} | {cells} | {'' if drop is None else f'{drop:+.3f}'} |"
        if "previous" in result:
            change = result["change_from_previous"].get(name)
            line += " " + (" / ".join(f"{change[s]:+.4f}" for s in SETS) if change else "") + " |"
        lines.append(line)
    h1 = result["h1"]
    lines += ["", f"**H1 (gates beat both controls at equal heads): {h1['verdict']}**"
              + (f" (missing: {', '.join(h1['missing'])})" if h1["missing"] else ""), ""]
    if "h1_without_settling" in result:
        lines += ["Not the verdict (a reading the rules do not make): with every run taken as settled, the same "
                  f"comparisons would give **{result['h1_without_settling']['verdict']}**.", ""]
    if h1["comparisons"]:
        lines += ["| k | control | runs | " + " | ".join(f"{s}: gates - control [95%], p" for s in SETS) + " |",
                  "|---:|---|---:|" + "---:|" * len(SETS)]
        for r in h1["comparisons"]:
            cells = " | ".join(f"{r[s]['difference']:+.4f} [{r[s]['low']:+.4f}, {r[s]['high']:+.4f}], "
                               f"{r[s]['p_below']:.4f}" for s in SETS)
            lines.append(f"| {r['k']} | {r['control']} | {r['control_runs']} | {cells} |")
    h2 = result["h2"]
    lines += ["", f"**H2 (gates keep the labelled heads more often than chance): {h2['verdict']}**", "",
              "| run | heads kept | labelled kept (of 6), expected, p | secondary set (of 8), expected, p |",
              "|---|---:|---:|---:|"]
    for r in h2["rows"]:
        cells = " | ".join(f"{r[x]['labelled_kept']}, {r[x]['expected']:.2f}, {r[x]['p']:.4f}"
                           for x in ("primary", "secondary"))
        lines.append(f"| {r['run']} | {r['kept']} | {cells} |")
    h3 = result["h3"]
    lines += ["", f"**H3 (removing the labelled heads costs more than as many random heads): {h3['verdict']}**"]
    for s in SETS:
        if s in h3:
            lines.append(f"- {s}: labelled {h3[s]['labelled']:+.4f} nats; random median {h3[s]['random_median']:+.4f}, "
                         f"max {h3[s]['random_max']:+.4f}; p = {h3[s]['p']:.3f}")
    if result["noninferiority"]:
        lines += ["", f"**Non-inferiority against the lambda = 0 control (bound {DELTA} nats per subword)**", ""]
        for r in result["noninferiority"]:
            lines.append(f"- {r['k']} heads: " + "; ".join(
                f"{s} {r[s]['difference']:+.4f} [{r[s]['low']:+.4f}, {r[s]['high']:+.4f}] {r[s]['call']}" for s in SETS))
    return "\n".join(lines) + "\n"
