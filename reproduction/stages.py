"""The stages of ``python -m reproduction``, in order, each resumable: what each one runs.

Every stage of a model works in ``<work_dir>/<model>/<stage dir>/`` and, when it has finished,
writes a marker ``<work_dir>/<model>/stages/<stage>.json`` (atomically, last) with its commands
and wall time. A stage whose marker exists is skipped unless ``--force``. The heavy stages call
the ``headlab`` command line in-process (``headlab.cli.main``), so that each step is exactly the
command printed in docs/reproduction.md; the tools' own resume (sweep points with a
``result.json``, baseline rows already in ``baselines.json``) still applies under ``--force``,
so finished pruning runs are never thrown away. The last stage, ``report``, has no marker: it
copies the small result files into ``<results_dir>/<model>/`` and regenerates the document.
The pruning sweeps first restore the finished points of those committed results into the work
dir (:func:`restore_points`), and the baselines and from-scratch stages their finished rows
(:func:`restore_rows`): a sweep of many hours goes on from a fresh checkout, which has no
``runs/``, instead of starting again.
Running them is :mod:`reproduction.pipeline`'s job; this module only builds the commands.
"""

from __future__ import annotations

import json
import shlex
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np

from headlab.heads import atomic_write_text
from headlab.importance.registry import MEASURES, REFERENCE, tables
from headlab.lock import DirectoryLock
from headlab.resume import SkipStage, weights_fingerprint
from reproduction.config import ModelEntry, ReproduceConfig, flags
from reproduction.results import kept_mask
from reproduction.significance import run_hypotheses
from reproduction.specialisation import run_specialisation

__all__ = ["STAGES", "Context", "Stage", "StageOutcome", "stage_commands", "stage_settings", "current_names",
           "marker_path", "command_text"]


@dataclass
class Context:
    config: ReproduceConfig
    model: ModelEntry
    force: bool = False
    dry_run: bool = False
    log: Callable[[str], None] = print
    from_results: bool = False  # read finished sweep points from the results dir (the document's commands)


@dataclass
class StageOutcome:
    model: str
    stage: str
    status: str  # "done", "skipped", "not run", "dry run"
    seconds: float = 0.0
    reason: str = ""
    commands: list[str] = field(default_factory=list)


def marker_path(config: ReproduceConfig, model: ModelEntry, stage: str) -> Path:
    return config.work(model, "stages", f"{stage}.json")


def command_text(argv: list[str]) -> str:
    return "headlab " + " ".join(shlex.quote(str(a)) for a in argv)


# ----------------------------------------------------------------------------- commands


def _p(ctx: Context, path) -> str:
    """A path as a command gets it: absolute when run; relative to the root when printed (document, dry run)."""
    return ctx.config.rel(path) if ctx.from_results or ctx.dry_run else str(path)


def _threads(ctx: Context) -> list[str]:
    return ["--threads", str(ctx.config.threads)]


def _data(ctx: Context, split: str) -> tuple[str, str]:
    c, m = ctx.config, ctx.model
    return _p(ctx, c.data_file(split, m.src)), _p(ctx, c.data_file(split, m.tgt))


def _prune_data(ctx: Context) -> list[str]:
    """The data options of ``headlab prune``: train on the train split, evaluate on ``prune.eval_split``."""
    train_src, train_tgt = _data(ctx, "train")
    test_src, test_tgt = _data(ctx, ctx.config.prune.get("eval_split", "test"))
    return ["--train-src", train_src, "--train-tgt", train_tgt, "--valid-src", test_src, "--valid-tgt", test_tgt]


def _require_model(ctx: Context) -> str:
    path = ctx.config.path(ctx.model.path)
    if not ctx.dry_run and not (path / "config.json").is_file():
        raise SkipStage(f"model {ctx.config.rel(path)} does not exist yet (no config.json)")
    return _p(ctx, path)


def importance_commands(ctx: Context) -> list[list[str]]:
    options = dict(ctx.config.importance)
    model = _require_model(ctx)
    src, tgt = _data(ctx, options.pop("split", "valid"))
    out = ctx.config.work(ctx.model, "importance")
    argv = ["importance", model, "--source", src, "--target", tgt, "--out", _p(ctx, out), "--no-progress"]
    return [argv + flags(options) + _threads(ctx)]


def _functions_argv(ctx: Context, model: str, conllu: Path, stage_dir: str, *extra: str,
                    drop: tuple[str, ...] = ()) -> list[str]:
    """``headlab functions`` on ``conllu`` into the model's ``stage_dir``, with the config's
    functions options (less ``conllu`` and ``drop``); ``extra`` goes before ``--no-progress``."""
    options = {k: v for k, v in ctx.config.functions.items() if k not in ("conllu", *drop)}
    out = ctx.config.work(ctx.model, stage_dir)
    argv = ["functions", model, "--conllu", _p(ctx, conllu), "--out", _p(ctx, out), *extra, "--no-progress"]
    return argv + flags(options) + _threads(ctx)


def _ewt_dev(ctx: Context) -> Path:
    return ctx.config.path(ctx.config.functions.get("conllu", "data/ud-english-ewt/en_ewt-ud-dev.conllu"))


def functions_commands(ctx: Context) -> list[list[str]]:
    model = _require_model(ctx)
    train_src, _ = _data(ctx, "train")
    return [_functions_argv(ctx, model, _ewt_dev(ctx), "functions", "--train-text", train_src)]


def parsed_commands(ctx: Context) -> list[list[str]]:
    """Parse the model's own source text (``parse.split``) with ``parse.model``, then the functions
    pass on those trees: the paper's setting (parser output on in-domain text)."""
    cfg = ctx.config.parse
    if not cfg.get("model"):
        raise SkipStage("the config has no parse.model (a spaCy UD pipeline)")
    parser = ctx.config.path(cfg["model"])
    if not ctx.dry_run and not (parser / "config.cfg").is_file():
        raise SkipStage(f"parser {ctx.config.rel(parser)} does not exist: build it with experiments/parser/train.sh")
    model = _require_model(ctx)
    split = ctx.config.parse_split
    text, _ = _data(ctx, split)
    conllu = ctx.config.work(ctx.model, "parsed", f"{split}.{ctx.model.src}.conllu")
    parse = ["parse", "--model", _p(ctx, parser), "--source", text, "--out", _p(ctx, conllu), "--no-progress"]
    train_src, _ = _data(ctx, "train")
    return [parse, _functions_argv(ctx, model, conllu, "functions-parsed", "--train-text", train_src)]


def pooling_commands(ctx: Context) -> list[list[str]]:
    """The functions pass on UD EWT dev again under each other subword-to-word mapping (``pooling``)."""
    if not ctx.config.pooling:
        raise SkipStage("the config lists no other word pooling (pooling: [\"first\", \"max\"])")
    model = _require_model(ctx)
    return [_functions_argv(ctx, model, _ewt_dev(ctx), f"functions-{pooling}", "--word-pooling", pooling,
                            "--no-figures", drop=("sensitivity",))
            for pooling in ctx.config.pooling]


def _sweep_dir(ctx: Context, sweep: str) -> Path:
    return ctx.config.work(ctx.model, "prune", sweep)


def _check_idle(directories: list[Path]) -> None:
    """Refuse to write into a sweep or baseline directory whose lock another live run holds
    (``prune sweep`` and ``prune baseline`` hold it while they work). A run that was killed left
    a stale lock, which the next run takes over: its points resume."""
    for directory in directories:
        holder = DirectoryLock(directory).held_elsewhere()
        if holder is not None:
            raise SkipStage(f"{directory} is in use by another headlab run (pid {holder.get('pid', '?')} on "
                            f"{holder.get('host', '?')}, since {holder.get('started', '?')}); run this stage when it "
                            f"has finished")


def sweep_commands(ctx: Context, sweep: str) -> list[list[str]]:
    spec = ctx.config.prune.get(sweep)
    if not spec:
        raise SkipStage(f"the config has no prune.{sweep} sweep")
    spec = {**spec, **ctx.model.prune.get(sweep, {})}
    argv = ["prune", "sweep", _require_model(ctx), *_prune_data(ctx), "--gates", spec["gates"]]
    if ctx.config.prune.get("dev_split"):  # the development curve: another split than the evaluation's
        dev_src, dev_tgt = _data(ctx, ctx.config.prune["dev_split"])
        argv += ["--dev-src", dev_src, "--dev-tgt", dev_tgt]
    argv += flags(ctx.config.prune.get("options", {})) + _threads(ctx)
    if spec.get("keeps"):
        argv += ["--keeps", ",".join(str(k) for k in spec["keeps"])]
    if spec.get("lams"):
        argv += ["--lams", ",".join(f"{lam:g}" for lam in spec["lams"])]
    argv += ["--no-progress", "--out", _p(ctx, _sweep_dir(ctx, sweep))]
    return [argv]


def restore_points(ctx: Context, sweep: str) -> list[str]:
    """Copy the finished points of ``sweep`` from the results dir into the work dir where it lacks them.

    Only points of the bundled weights (``model_sha256``) whose options were recorded
    (``prune_config.json``) come back, with what the results keep of them: result, gates, kept
    heads, test translations. The sweep then checks their options as it checks its own points and
    skips them; their pruned weights are not in the results, so nothing translates them again."""
    from headlab.pruning.train import CONFIG_FILE, HYPOTHESES_FILE, RESULT_FILE  # (torch: not at CLI start-up)
    from headlab.surgery import PRUNING_FILE

    weights = weights_fingerprint(ctx.config.path(ctx.model.path))
    results, work = ctx.config.results(ctx.model), _sweep_dir(ctx, sweep)
    directory = results / "prune" / sweep
    restored = []
    full = directory / "full.json"
    if full.is_file() and not (work / "full.json").is_file() and \
            json.loads(full.read_text(encoding="utf-8")).get("model_sha256") == weights:
        work.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(full, work / "full.json")
    for point in sorted(directory.iterdir()) if directory.is_dir() else []:
        result, target = point / RESULT_FILE, work / point.name
        if target.exists() or not (result.is_file() and (point / CONFIG_FILE).is_file()):
            continue
        if weights is None or json.loads(result.read_text(encoding="utf-8")).get("model_sha256") != weights:
            continue
        staging = work / f".{point.name}.restoring"  # renamed into place whole: a restore cut short leaves no half point
        shutil.rmtree(staging, ignore_errors=True)
        (staging / "pruned").mkdir(parents=True)
        for name in (CONFIG_FILE, "gates.json", RESULT_FILE):
            if (point / name).is_file():
                shutil.copyfile(point / name, staging / name)
        if (point / "kept.json").is_file():
            shutil.copyfile(point / "kept.json", staging / "pruned" / PRUNING_FILE)
        hypotheses = results / "hypotheses" / f"{sweep}-{point.name}.txt"
        if hypotheses.is_file():
            shutil.copyfile(hypotheses, staging / HYPOTHESES_FILE)
        try:
            staging.rename(target)
        except OSError:  # the sweep began this point meanwhile: its own run stands
            shutil.rmtree(staging, ignore_errors=True)
            continue
        restored.append(point.name)
    if restored:
        ctx.log(f"{ctx.model.name} prune-{sweep}: restored {len(restored)} finished points from "
                f"{ctx.config.rel(directory)}: {', '.join(restored)}")
    return restored


def restore_rows(ctx: Context, table: str, weights: str | None) -> None:
    """Copy into the work dir the committed rows of the bundled weights (``weights``, their
    fingerprint) that a table lacks: a baseline method's (``table`` = its name) or a from-scratch
    table's (``"scratch"``, ``"scratch-enc"``). The tool then runs only the rows still missing, as
    it does after an interruption."""
    if weights is None:
        return
    results = ctx.config.results(ctx.model)
    scratch = table.startswith("scratch")
    committed = results / f"{table}.json" if scratch else results / "baselines" / f"{table}.json"
    work = ctx.config.work(ctx.model, "prune", table if scratch else f"base-{table}") / "baselines.json"
    if committed.is_file() and not work.exists():
        rows = [row for row in json.loads(committed.read_text(encoding="utf-8")) if row.get("model_sha256") == weights]
        if rows:
            work.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(work, json.dumps(rows, indent=1) + "\n")
            ctx.log(f"{ctx.model.name} {table}: restored {len(rows)} finished rows from {ctx.config.rel(committed)}")


def restore_importance(ctx: Context, weights: str | None) -> None:
    """The committed importance scores into the work dir, where it has none and the importance stage
    recorded (timings.json) that it ran on the bundled weights (``weights``, their fingerprint)."""
    results = ctx.config.results(ctx.model)
    timings = results / "timings.json"
    ran = json.loads(timings.read_text(encoding="utf-8")).get("importance", {}) if timings.is_file() else {}
    work = ctx.config.work(ctx.model, "importance")
    if weights is None or ran.get("model_sha256") != weights or work.is_dir():
        return
    work.mkdir(parents=True)
    for path in sorted((results / "importance").glob("*.json")):
        shutil.copyfile(path, work / path.name)
    ctx.log(f"{ctx.model.name} importance: restored the scores of these weights from {ctx.config.rel(results)}")


def _prepare_baselines(ctx: Context) -> None:
    restore_points(ctx, "enc")  # their head counts: the sweep's
    weights = weights_fingerprint(ctx.config.path(ctx.model.path))
    restore_importance(ctx, weights)
    for name in ctx.config.baselines.get("methods", {}):
        restore_rows(ctx, name, weights)


def _prepare_scratch(ctx: Context) -> None:
    weights = weights_fingerprint(ctx.config.path(ctx.model.path))
    for sweep in ("all", "enc"):  # the gates of its points
        restore_points(ctx, sweep)
        restore_rows(ctx, "scratch" if sweep == "all" else "scratch-enc", weights)


def _points_dir(ctx: Context, sweep: str) -> Path:
    return ctx.config.results(ctx.model, "prune", sweep) if ctx.from_results else _sweep_dir(ctx, sweep)


def finished_points(directory: Path) -> dict[str, dict]:
    """``{point name: result.json}`` of a sweep directory's finished points."""
    out = {}
    if directory.is_dir():
        for point in sorted(directory.iterdir()):
            result = point / "result.json"
            if result.is_file():
                out[point.name] = json.loads(result.read_text(encoding="utf-8"))
    return out


def baseline_keeps(ctx: Context) -> list[int]:
    keeps = set(int(k) for k in ctx.model.baselines.get("keeps", ctx.config.baselines.get("keeps", [])))
    if ctx.config.baselines.get("add_sweep_counts", False):
        for result in finished_points(_points_dir(ctx, "enc")).values():
            kept = result.get("heads_kept", {}).get("enc_self")
            if kept is not None and (result.get("keep") is not None or result.get("lam")):  # not the control
                keeps.add(int(kept))
    return sorted(keeps)


def baselines_commands(ctx: Context) -> list[list[str]]:
    cfg = ctx.config.baselines
    methods = cfg.get("methods", {})
    if "methods" in ctx.model.baselines:
        methods = {name: methods[name] for name in ctx.model.baselines["methods"] if name in methods}
    if not methods:
        raise SkipStage("the config lists no baseline methods")
    model = _require_model(ctx)
    keeps = baseline_keeps(ctx)
    if not keeps:
        raise SkipStage("no head counts: baselines.keeps is empty and the encoder sweep has no finished point")
    commands = []
    for name, options in methods.items():
        options = dict(options)
        method = options.pop("method", name)
        # A costly method (fine-tuning) may run at fewer head counts than the others.
        method_keeps = [int(k) for k in options.pop("keeps", keeps)]
        argv = ["prune", "baseline", model, *_prune_data(ctx)]
        if method in tables() and method not in MEASURES[REFERENCE].tables:  # keep the best heads of a measure
            scores = ctx.config.work(ctx.model, "importance", f"{method}.json")
            if not scores.is_file() and not ctx.dry_run:
                raise SkipStage(f"{scores} is missing: run the importance stage first")
            argv += ["--method", "scores", "--scores", _p(ctx, scores)]
        else:
            argv += ["--method", method]
        argv += ["--keeps", ",".join(map(str, method_keeps))]
        argv += flags({**cfg.get("options", {}), **options}) + _threads(ctx)
        argv += ["--out", _p(ctx, ctx.config.work(ctx.model, "prune", f"base-{name}"))]
        commands.append(argv)
    return commands


def scratch_commands(ctx: Context) -> list[list[str]]:
    cfg = ctx.config.scratch
    if not cfg.get("enabled", False):
        raise SkipStage("disabled in the config (scratch.enabled: false); each point costs a full training")
    model = _require_model(ctx)
    points = finished_points(_points_dir(ctx, "all"))
    commands = []
    for name in cfg.get("points", []):
        if name not in points:
            raise SkipStage(f"all-kinds point {name} has not finished (no result.json)")
        total = sum(points[name]["heads_kept"].values())
        commands.append(_scratch_argv(ctx, model, "all", name, "all", total, "scratch"))
    # The encoder points' heads from scratch, the decoder whole (Sec. 6.2, footnote 8).
    enc_points = finished_points(_points_dir(ctx, "enc")) if cfg.get("enc_points") else {}
    for name in cfg.get("enc_points", []):
        if name not in enc_points:
            raise SkipStage(f"encoder point {name} has not finished (no result.json)")
        keep = enc_points[name]["heads_kept"]["enc_self"]
        commands.append(_scratch_argv(ctx, model, "enc", name, "enc_self", keep, "scratch-enc"))
    return commands


def _scratch_argv(ctx: Context, model: str, sweep: str, point: str, kinds: str, keep: int, out: str) -> list[str]:
    """``prune baseline --from-scratch`` of the heads a sweep point's gates keep (``keep`` of ``kinds``)."""
    gates = _sweep_dir(ctx, sweep) / point / "gates.json"
    _check_scratch_heads(_points_dir(ctx, sweep) / point, ("enc_self",) if kinds == "enc_self" else None, keep)
    argv = ["prune", "baseline", model, *_prune_data(ctx), "--method", "scores", "--scores", _p(ctx, gates),
            "--kinds", kinds, "--keeps", str(keep), "--from-scratch"]
    return argv + flags(ctx.config.scratch.get("options", {})) + _threads(ctx) + \
        ["--out", _p(ctx, ctx.config.work(ctx.model, "prune", out))]


def _check_scratch_heads(point: Path, kinds: tuple[str, ...] | None, keep: int) -> None:
    """The run from scratch keeps the top ``keep`` heads of the ``point``'s gates.json by P(open) (a row so trained
    stays valid while that file does); Table 2 and footnote 8 compare it with the point as the same heads. Refused
    when the point kept others (its pruned model's record; kept.json among the results): P(open) tied where the
    point's log_alpha was not (P(open) in float32, before session 44), or gates tied across depths."""
    from headlab.heads import HeadScores
    from headlab.surgery import PRUNING_FILE

    path = next((path for path in (point / "pruned" / PRUNING_FILE, point / "kept.json") if path.is_file()), None)
    if path is None:
        raise SkipStage(f"point {point.name} has no {PRUNING_FILE} (the heads it kept) to check its run from scratch "
                        "against")
    scores = HeadScores.load(point / "gates.json")
    point_record = {"kept": json.loads(path.read_text(encoding="utf-8"))}
    expected = {kind: np.ones(scores[kind].shape, dtype=bool) for kind in kinds or scores.kinds}
    for (kind, layer), heads in scores.top_mask(keep, tuple(expected)).items():
        expected[kind][layer, heads] = False
    differ = []
    for kind, mask in expected.items():
        n_layers, n_heads = scores[kind].shape
        kept = kept_mask(point_record, kind, (n_layers, n_heads))
        differ += [(kind, int(layer)) for layer in np.flatnonzero(np.any(kept != mask, axis=1))]
    if differ:
        raise SkipStage(f"point {point.name} kept other heads than the top {keep} of its gates.json by P(open) "
                        f"(they differ in {', '.join(f'{kind} layer {layer}' for kind, layer in differ)}): a run "
                        "from scratch of those would be another configuration than the point's")


@dataclass(frozen=True)
class Stage:
    name: str
    description: str
    commands: Callable[[Context], list[list[str]]] | None = None
    python: Callable[..., list[str]] | None = None  # (config, model, *, force, log) -> what it ran, as text
    check: Callable[[Context], None] | None = None
    prepare: Callable[[Context], object] | None = None  # before the commands run (not in a dry run)
    # The commands follow from the config alone (not from what earlier stages or runs left), so a
    # finished stage whose recorded settings differ from them is stale (stage_settings).
    settled_by_config: bool = False


STAGES: dict[str, Stage] = {
    "importance": Stage("importance", "confidence, LRP, gradient, ablation (Sec. 4)", importance_commands,
                        settled_by_config=True),
    "functions": Stage("functions", "positional, syntactic, rare-token heads on UD EWT (Sec. 5)", functions_commands,
                       settled_by_config=True),
    "functions-parsed": Stage("functions-parsed", "the same on the model's own validation text, parsed by the EWT "
                                                  "parser (Sec. 5.2 in domain)", parsed_commands, settled_by_config=True),
    "pooling": Stage("pooling", "the functions pass under the other subword-to-word mappings (sensitivity)",
                     pooling_commands, settled_by_config=True),
    "prune-enc": Stage("prune-enc", "encoder-only pruning sweep (Sec. 6.2)", lambda ctx: sweep_commands(ctx, "enc"),
                       check=lambda ctx: _check_idle([_sweep_dir(ctx, "enc")]),
                       prepare=lambda ctx: restore_points(ctx, "enc"), settled_by_config=True),
    "prune-all": Stage("prune-all", "all-kinds pruning sweep (Sec. 6.3)", lambda ctx: sweep_commands(ctx, "all"),
                       check=lambda ctx: _check_idle([_sweep_dir(ctx, "all")]),
                       prepare=lambda ctx: restore_points(ctx, "all"), settled_by_config=True),
    "baselines": Stage("baselines", "random, Michel, confidence, LRP at equal head counts", baselines_commands,
                       check=lambda ctx: _check_idle([ctx.config.work(ctx.model, "prune", f"base-{name}")
                                                          for name in ctx.config.baselines.get("methods", {})]),
                       prepare=_prepare_baselines),
    "scratch": Stage("scratch", "the pruned configurations trained from scratch (Table 2)", scratch_commands,
                     check=lambda ctx: _check_idle([ctx.config.work(ctx.model, "prune", name)
                                                    for name in ("scratch", "scratch-enc")]),
                     prepare=_prepare_scratch),
    "hypotheses": Stage("hypotheses", "greedy test-set translations of the full and every pruned model kept "
                                      "(paired bootstrap)", python=run_hypotheses),
    "specialisation": Stage("specialisation", "confidence and positional share over training checkpoints",
                            python=run_specialisation),
    "report": Stage("report", "copy the small results, compute the claims, write docs/reproduction.md"),
}
"""Registry, in the order the stages run."""


# Options that say where and how fast a command runs, not what it computes.
MACHINE_OPTIONS = {"--threads": 1, "--device": 1, "--no-progress": 0}


# The options headlab renamed (docs/cli.md: the old names still work for one release); the
# stages used the old names before: a marker that records them records the same settings.
RENAMED_OPTIONS = {"--data": "--source", "--input": "--source", "--source-text": "--source", "--n-sentences": "--limit",
                   "--max-sentences": "--limit"}


def current_names(settings: list[str]) -> list[str]:
    """``settings`` (:func:`stage_settings`) with each renamed option under its current name."""
    return ["headlab " + " ".join(shlex.quote(RENAMED_OPTIONS.get(a, a)) for a in shlex.split(text)[1:])
            for text in settings]


def stage_settings(ctx: Context, spec: Stage) -> list[str] | None:
    """What a stage settled by the config computes: its commands with the paths relative to the
    root (as the document prints them) and without :data:`MACHINE_OPTIONS`. None for the other
    stages, and for one that cannot build its commands yet."""
    if not spec.settled_by_config or spec.commands is None:
        return None
    try:
        commands = spec.commands(replace(ctx, dry_run=True))
    except SkipStage:
        return None
    settings = []
    for argv in commands:
        kept, skip = [], 0
        for arg in map(str, argv):
            if skip:
                skip -= 1
            elif arg in MACHINE_OPTIONS:
                skip = MACHINE_OPTIONS[arg]
            else:
                kept.append(arg)
        settings.append(command_text(kept))
    return settings


def stage_commands(ctx: Context, stage: str) -> list[str]:
    """The commands a stage runs, as text (``[]`` for a Python stage)."""
    spec = STAGES[stage]
    return [command_text(argv) for argv in spec.commands(ctx)] if spec.commands else []
