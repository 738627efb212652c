"""A sweep over lambda (or head budgets): one gated fine-tuning per point, resumable, one table.

Each point runs in ``OUT/lam-<value>/`` (or ``OUT/keep-<N>/``) as :func:`prune_train` does. A
point with a ``result.json`` is finished and skipped; a point with a ``train/last`` checkpoint
is resumed. Either is reused only if it was made from the same weights (``model_sha256``, the starting
model's :func:`~headlab.resume.weights_fingerprint`) with the same options (its
``prune_config.json``): a point made otherwise is *stale*, moved to ``OUT/stale/`` (nothing is
deleted) and run again, and so is a ``full.json`` of other weights (a point that records no
``model_sha256``, made before headlab recorded it, counts as made from other weights). After
every point the table is rewritten atomically as ``sweep.json``, ``sweep.csv`` and ``sweep.md``:
lambda, heads kept per kind, BLEU, chrF, loss (the data of Voita et al. 2019, Fig. 7 and Fig. 9).
"""

from __future__ import annotations

import copy
import csv
import io
import json
from dataclasses import replace
from pathlib import Path
from typing import Callable, Sequence

from headlab.errors import HeadlabError, counted
from headlab.heads import KINDS, atomic_write_text, axes_or_new, pyplot, write_figure, write_json
from headlab.pruning.train import (
    CONFIG_FILE,
    RESULT_FILE,
    PruneConfig,
    evaluate_point,
    heads_per_kind,
    prune_train,
    with_gates_resolved,
)
from headlab.resume import set_aside

__all__ = ["sweep_points", "run_sweep", "write_table", "point_name"]

TABLE_COLUMNS = ("point", "lam", "keep", "enc_self", "dec_self", "dec_cross", "heads", "bleu", "chrf", "loss",
                 "parameters", "encoder_s", "translate_s", "status")


def point_name(point: dict) -> str:
    return f"keep-{point['keep']}" if point.get("keep") is not None else f"lam-{point['lam']:g}"


def sweep_points(lams=(), keeps=()) -> list[dict]:
    """Validated sweep points: ``{"lam": x}`` for each lambda, ``{"keep": n}`` for each budget."""
    points = []
    # Checked here, before the model loads and the full model is evaluated, not when a point starts.
    for lam in lams:
        if not 0 <= lam < float("inf"):
            raise HeadlabError(f"lambda must be a finite number >= 0, got {lam}")
        points.append({"lam": float(lam) + 0.0, "keep": None})  # + 0.0: -0.0 is 0.0, not a point "lam--0"
    for keep in keeps:
        if keep < 1:  # 0 closes every gated head: the gates have nothing to choose
            raise HeadlabError(f"--keeps {keep}: a head budget must be >= 1, as prune train --keep (a budget of 0 "
                               "closes every gated head, leaving the gates nothing to choose)")
        points.append({"lam": 0.0, "keep": int(keep)})
    if not points:
        raise HeadlabError("a sweep needs --lams or --keeps")
    names = [point_name(p) for p in points]
    if len(set(names)) != len(names):
        raise HeadlabError(f"repeated sweep points: {names}")
    return points


# Options that do not change what a point computes (where it runs, how it logs, what it times).
_NOT_RESULT = {"command", "log_every", "latency_sentences", "eval_batch_size", "model_fingerprint", "lam", "keep",
               "eval_data_sha256", "train_data_sha256", "dev_data_sha256"}  # the data: compared by _other_data
_NOT_RESULT_TRAIN = {"out_dir", "resume", "overwrite", "progress", "save_every_steps"}


def _result_options(config: dict) -> dict:
    """The options of a point (a PruneConfig as a dict) that its result depends on."""
    out = {k: v for k, v in config.items() if k not in _NOT_RESULT and k != "train"}
    out["train"] = {k: v for k, v in config.get("train", {}).items() if k not in _NOT_RESULT_TRAIN}
    return json.loads(json.dumps(out))  # tuples as lists, as read back from a file


def _other_weights(weights: str | None, base: PruneConfig) -> str | None:
    """Why a file that records ``weights`` (model_sha256) was not made from ``base``'s weights; None
    when it was, or when ``base`` records none."""
    if base.model_fingerprint and weights != base.model_fingerprint:
        return f"made from other weights (model_sha256 {(weights or 'not recorded')[:12]}, now {base.model_fingerprint[:12]})"
    return None


_DATA_KEYS = ("eval_data_sha256", "train_data_sha256", "dev_data_sha256")
_DATA_WHAT = {"eval_data_sha256": "evaluated", "train_data_sha256": "trained",
              "dev_data_sha256": "its development curve made"}


def _other_data(recorded: dict, base: PruneConfig, keys: Sequence[str] = _DATA_KEYS) -> str | None:
    """Why a point or full.json (``recorded``) was not made on ``base``'s evaluation, training or
    development set; None when it was, or when either side records none (a point made before they
    were recorded; no curve: --dev-every 0 is compared as an option)."""
    for key in keys:
        old, new = recorded.get(key), getattr(base, key)
        if old and new and old != new:
            return f"{_DATA_WHAT[key]} on other data ({key} {old[:12]}, now {new[:12]})"
    return None


def stale_reason(point_dir: Path, base: PruneConfig) -> str | None:
    """Why the run in ``point_dir`` (finished or not) was not made by ``base``'s weights and options;
    None when it was (or when nothing there records either: no run yet)."""
    config_file = point_dir / CONFIG_FILE
    if not config_file.is_file():
        return None
    try:
        recorded = json.loads(config_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return f"{config_file} is not readable"
    result_file = point_dir / RESULT_FILE
    if result_file.is_file():
        weights = json.loads(result_file.read_text(encoding="utf-8")).get("model_sha256")
    else:
        weights = recorded.get("model_fingerprint") or None
    if other := _other_weights(weights, base):
        return other
    if other := _other_data(recorded, base):
        return other
    defaults = PruneConfig().to_dict()  # an option added since the point ran had its default then
    recorded = {**defaults, **recorded, "train": {**defaults["train"], **recorded.get("train", {})}}
    old, new = _result_options(recorded), _result_options(base.to_dict())
    changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k) and k != "train")
    changed += sorted(f"train.{k}" for k in set(old["train"]) | set(new["train"])
                      if old["train"].get(k) != new["train"].get(k))
    if changed:
        return "made with other options: " + ", ".join(
            f"{k} {_option(old, k)} -> {_option(new, k)}" for k in changed)
    return None


def _option(options: dict, key: str):
    if key.startswith("train."):
        return options["train"].get(key[len("train."):])
    return options.get(key)


def _set_aside(path: Path, out_dir: Path, log: Callable[[str], None], reason: str) -> None:
    """Move a stale point (or full.json) to ``out_dir/stale/`` under a name not taken yet."""
    target = set_aside(path, out_dir)
    log(f"{path.name}: {reason}; moved to {target} and run again")


def _row(name: str, point: dict, result: dict) -> dict:
    metrics = result.get("metrics", {})
    kept = result.get("heads_kept", {})
    latency = metrics.get("latency", {})
    budget = point.get("keep") is not None  # no fixed lambda: the Lagrangian multipliers are learnt (budget.py)
    return {
        "point": name, "lam": None if budget else point.get("lam"), "keep": point.get("keep"),
        **{kind: kept.get(kind) for kind in KINDS},
        "heads": sum(kept.values()) if kept else None,
        "bleu": metrics.get("bleu"), "chrf": metrics.get("chrf"), "loss": metrics.get("loss"),
        "parameters": metrics.get("parameters_after", metrics.get("parameters")),
        "encoder_s": latency.get("encoder_s"), "translate_s": latency.get("translate_s"),
        "status": result.get("stopped", ""),
    }


def write_table(rows: list[dict], out_dir: Path) -> None:
    write_json(out_dir / "sweep.json", rows)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=TABLE_COLUMNS, lineterminator="\n", extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(out_dir / "sweep.csv", buffer.getvalue())

    def fmt(value):
        if value is None:
            return ""
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    lines += ["| " + " | ".join(fmt(row.get(c)) for c in TABLE_COLUMNS) + " |" for row in rows]
    atomic_write_text(out_dir / "sweep.md", "\n".join(lines) + "\n")


def run_sweep(load: Callable[[], tuple], train_data, eval_data, base: PruneConfig, points: list[dict],
              out_dir: str | Path, *, reference: bool = True, dev_data=None,
              log: Callable[[str], None] = print) -> list[dict]:
    """Run (or resume) every point; ``load()`` returns a fresh ``(model, tokenizer)`` each time.

    With ``reference`` the unpruned model is evaluated once (``full.json``) and heads the table.
    ``dev_data``: the development set of every point's curve (``base.dev_every``). A point or
    ``full.json`` made from other weights or options is moved to ``out_dir/stale/`` and redone.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if base.gates == "auto":  # the points record the kinds chosen, so their options are compared with those
        base = with_gates_resolved(base, load()[0])
    from headlab.pruning.baselines import _data_fingerprint

    # a rerun on another test, training or development set into the same --out redoes its points, never mixes them
    base = replace(base, eval_data_sha256=_data_fingerprint(eval_data) or "",
                   train_data_sha256=_data_fingerprint(train_data) or "", dev_data_sha256=_data_fingerprint(dev_data) or "")
    rows: list[dict] = []
    if reference and eval_data is not None:
        full_file = out_dir / "full.json"
        if full_file.is_file():
            full = json.loads(full_file.read_text())
            if other := _other_weights(full.get("model_sha256"), base):
                _set_aside(full_file, out_dir, log, other)
            elif full.get("metrics", {}).get("beam", base.eval_beam) != base.eval_beam:
                _set_aside(full_file, out_dir, log, f"evaluated with beam {full['metrics']['beam']}, now {base.eval_beam}")
            elif other := _other_data(full, base, ("eval_data_sha256",)):
                _set_aside(full_file, out_dir, log, other)
        if full_file.is_file():
            full = json.loads(full_file.read_text())
        else:
            model, tokenizer = load()
            from headlab.surgery import count_parameters

            metrics = {**evaluate_point(model, tokenizer, eval_data, base), "parameters": count_parameters(model)}
            full = {"heads_kept": heads_per_kind(model), "metrics": metrics, "stopped": "reference",
                    "model_sha256": base.model_fingerprint or None, "eval_data_sha256": base.eval_data_sha256 or None}
            write_json(full_file, full, indent=2)
        rows.append(_row("full", {"lam": None, "keep": None}, full))
    for point in points:
        name = point_name(point)
        point_dir = out_dir / name
        result_file = point_dir / RESULT_FILE
        reason = stale_reason(point_dir, replace(base, lam=point["lam"], keep=point["keep"]))
        if reason is not None:
            _set_aside(point_dir, out_dir, log, reason)
        if result_file.is_file():
            log(f"{name}: finished earlier, skipped")
            rows.append(_row(name, point, json.loads(result_file.read_text())))
            continue
        resume = (point_dir / "train" / "last").is_dir()
        log(f"{name}: {'resuming' if resume else 'starting'}")
        config = copy.deepcopy(base)
        config.lam, config.keep = point["lam"], point["keep"]
        config.train = replace(config.train, out_dir=str(point_dir), resume=resume, overwrite=not resume)
        model, tokenizer = load()
        result = prune_train(model, tokenizer, train_data, eval_data, config, dev_data=dev_data, log=log)
        row = _row(name, point, result.to_dict())
        rows.append(row)
        write_table(rows, out_dir)
        if result.stopped == "diverged":
            log(f"{name}: {result.message}")
    write_table(rows, out_dir)
    return rows


# ----------------------------------------------------------------------------- figures and tables


def read_rows(sweep_dir: str | Path) -> list[dict]:
    path = Path(sweep_dir) / "sweep.json"
    if not path.is_file():
        raise HeadlabError(f"{sweep_dir}: no sweep.json; run `headlab prune sweep` first")
    return json.loads(path.read_text())


def _baseline_groups(rows: list[dict], kind: str = "enc_self") -> dict[str, list[tuple[int, float, float]]]:
    """``{label: [(heads kept, mean BLEU, std BLEU), ...]}`` from baselines.json rows."""
    import numpy as np

    groups: dict[tuple[str, int], list[float]] = {}
    for row in rows:
        if row.get("bleu") is None:
            continue
        label = row["method"]
        if row.get("from_scratch"):
            label += " (from scratch)"
        elif row.get("finetune_steps"):
            label += " + fine-tuning"
        kept = row.get("heads_kept", {}).get(kind, row["keep"])
        groups.setdefault((label, kept), []).append(row["bleu"])
    out: dict[str, list[tuple[int, float, float]]] = {}
    for (label, kept), values in sorted(groups.items()):
        array = np.array(values)
        out.setdefault(label, []).append((kept, float(array.mean()), float(array.std(ddof=1)) if len(array) > 1 else 0.0))
    return out


def _series(row: dict) -> str:
    """``budget`` (``keep``), ``control`` (lambda 0) or ``fixed`` (lambda > 0, the paper's mode);
    from the point's name when the row has neither field."""
    if "keep" not in row and "lam" not in row:
        name = row.get("point", "")
        return "budget" if name.startswith("keep-") else "control" if name == "lam-0" else "fixed"
    if row.get("keep") is not None:
        return "budget"
    return "control" if row.get("lam") == 0 else "fixed"


SERIES_STYLE = {"fixed": ("o-", "Hard Concrete gates, fixed lambda (the paper's mode)"),
                "budget": ("D--", "Hard Concrete gates, head budget (Lagrangian)"),
                "control": ("*", "lambda = 0 control (fine-tuning alone)")}


def plot_bleu_vs_heads(sweep_rows: list[dict], baseline_rows: Sequence[dict] = (), kind: str = "enc_self", ax=None):
    """Voita et al. 2019, Fig. 7: BLEU against the number of retained ``kind`` heads, gated
    pruning (the sweep: fixed-lambda points, budget points and the lambda = 0 control as separate
    series) next to the baselines (mean +- std over seeds as error bars)."""
    ax = axes_or_new(ax)
    done = [r for r in sweep_rows if r.get(kind) is not None and r.get("bleu") is not None and r["point"] != "full"]
    full = [r for r in sweep_rows if r["point"] == "full" and r.get("bleu") is not None]
    for series, (style, label) in SERIES_STYLE.items():
        points = sorted(((r[kind], r["bleu"], r.get("lam")) for r in done if _series(r) == series),
                        key=lambda p: p[:2])
        if not points:
            continue
        xs, ys, lams = zip(*points)
        ax.plot(xs, ys, style, label=label, markersize=12 if series == "control" else 6, zorder=3)  # over baselines
        if series == "fixed":
            for x, y, lam in (p for p in points if p[2] is not None):
                ax.annotate(f"{lam:g}", (x, y), textcoords="offset points", xytext=(3, 4), fontsize=7)
    for label, baseline in _baseline_groups(list(baseline_rows), kind).items():
        xs, ys, es = zip(*baseline)
        ax.errorbar(xs, ys, yerr=es, marker="s", capsize=3, label=label)
    if full:
        ax.axhline(full[0]["bleu"], color="gray", linestyle="--", label=f"full model ({counted(full[0][kind], 'head')})")
    ax.set(xlabel=f"retained {kind} heads (fixed-lambda points labelled with lambda)", ylabel="BLEU")
    ax.legend(fontsize=7)
    return ax


def plot_heads_per_kind(sweep_rows: list[dict], ax=None):
    """Voita et al. 2019, Fig. 9: heads kept per kind at each sparsity (sweep point)."""
    ax = axes_or_new(ax)
    rows = sorted((r for r in sweep_rows if r.get("heads")), key=lambda r: -r["heads"])
    labels = [f"{r['heads']}\n{r['point']}" for r in rows]  # two points may keep as many heads
    bottom = [0] * len(rows)
    for kind in KINDS:
        values = [r.get(kind) or 0 for r in rows]
        if any(values):
            ax.bar(labels, values, bottom=bottom, label=kind)
            bottom = [b + v for b, v in zip(bottom, values)]
    ax.set(xlabel="heads kept in total, sweep point", ylabel="heads kept")
    if ax.get_legend_handles_labels()[0]:  # no bars (no point kept a head count yet): no legend
        ax.legend(fontsize=8)
    return ax


def heads_table(sweep_rows: list[dict], scratch_rows: Sequence[dict] = ()) -> str:
    """Voita et al. 2019, Table 2: heads per kind and BLEU, pruned against from scratch."""
    scratch = {sum(row["heads_kept"].values()): row["bleu"] for row in scratch_rows
               if row.get("from_scratch") and row.get("bleu") is not None}
    lines = ["| attention heads (enc_self/dec_self/dec_cross) | total | BLEU pruned | BLEU from scratch |",
             "|---|---|---|---|"]
    for row in sweep_rows:
        if row.get("heads") is None:
            continue
        kinds = "/".join(str(row.get(k) if row.get(k) is not None else "-") for k in KINDS)
        bleu = f"{row['bleu']:.2f}" if row.get("bleu") is not None else ""
        other = scratch.get(row["heads"])
        lines.append(f"| {kinds} | {row['heads']} | {bleu} | {'' if other is None else f'{other:.2f}'} |")
    return "\n".join(lines) + "\n"


def _check_comparable(sweep_dir: str | Path, baseline_rows: list[dict]) -> None:
    """Refuse baselines scored with another beam or test set, or made from other weights, than the
    sweep's full model (its full.json): drawn on one figure, their BLEU would not be comparable (a greedy
    baseline plotted against beam-4 points and the beam-4 full model)."""
    full_file = Path(sweep_dir) / "full.json"
    if full_file.is_file():
        full = json.loads(full_file.read_text(encoding="utf-8"))
        beam, weights, data = full.get("metrics", {}).get("beam"), full.get("model_sha256"), full.get("eval_data_sha256")
    else:  # --no-reference: a point's options say the same (nothing was compared without them)
        configs = sorted(Path(sweep_dir).glob(f"*/{CONFIG_FILE}"))
        if not configs:
            return
        point = json.loads(configs[0].read_text(encoding="utf-8"))
        beam, weights, data = point.get("eval_beam"), point.get("model_fingerprint"), point.get("eval_data_sha256")
    for row in baseline_rows:
        if beam is not None and row.get("eval_beam") is not None and row["eval_beam"] != beam:
            raise HeadlabError(f"--baselines {row['_dir']}: its rows were scored with beam {row['eval_beam']}, the "
                               f"sweep {sweep_dir} with beam {beam}; their BLEU is not comparable (run prune "
                               f"baseline again with --eval-beam {beam})")
        if weights and row.get("model_sha256") and row["model_sha256"] != weights:
            raise HeadlabError(f"--baselines {row['_dir']}: its rows were made from other weights than the sweep "
                               f"{sweep_dir} (model_sha256 {row['model_sha256'][:12]}, the sweep's {weights[:12]})")
        if data and row.get("eval_data_sha256") and row["eval_data_sha256"] != data:
            raise HeadlabError(f"--baselines {row['_dir']}: its rows were scored on another test set than the sweep "
                               f"{sweep_dir} (eval_data_sha256 {row['eval_data_sha256'][:12]}, the sweep's {data[:12]}); "
                               "give both the same --valid-src, --valid-tgt and --eval-limit")


def write_report(sweep_dirs: list[str | Path], baseline_dirs: list[str | Path], out_dir: str | Path) -> list[Path]:
    """Figure 7 (per sweep of enc_self gates), Figure 9 and Table 2 into ``out_dir``."""
    pyplot()  # the Agg backend, unless a notebook's inline one is active
    out_dir = Path(out_dir)
    baseline_rows = []
    for directory in baseline_dirs:
        path = Path(directory) / "baselines.json"
        if not path.is_file():
            raise HeadlabError(f"{directory}: no baselines.json; run `headlab prune baseline` first")
        baseline_rows += [{**row, "_dir": str(directory)} for row in json.loads(path.read_text())]
    sweeps = {directory: read_rows(directory) for directory in sweep_dirs}  # all read before anything is written
    for directory in sweep_dirs:
        _check_comparable(directory, baseline_rows)
    baseline_rows = [{k: v for k, v in row.items() if k != "_dir"} for row in baseline_rows]
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for directory, rows in sweeps.items():
        name = Path(directory).name
        ax = plot_bleu_vs_heads(rows, [r for r in baseline_rows if not r.get("from_scratch")])
        ax.set_title(f"BLEU against retained encoder heads ({name})")
        ax.figure.tight_layout()
        written.append(write_figure(ax.figure, out_dir / f"{name}-bleu-vs-heads.png", dpi=120))
        ax = plot_heads_per_kind(rows)
        ax.set_title(f"Heads kept per kind ({name})")
        ax.figure.tight_layout()
        written.append(write_figure(ax.figure, out_dir / f"{name}-heads-per-kind.png", dpi=120))
        atomic_write_text(out_dir / f"{name}-table.md", heads_table(rows, baseline_rows))
        written.append(out_dir / f"{name}-table.md")
    return written
