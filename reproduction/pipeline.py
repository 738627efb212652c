"""Run the stages of ``python -m reproduction``: the one part of reproduce that calls the command line.

Each stage of :data:`reproduction.stages.STAGES` is skipped when its marker
``<work_dir>/<model>/stages/<stage>.json`` exists and records the weights the model directory
holds now (``model_sha256``, :func:`headlab.resume.weights_fingerprint`) and, for a stage whose
commands follow from the config alone, the settings they had then
(:func:`reproduction.stages.stage_settings`), unless ``force``: a marker of other weights (the
bundled model was retrained since) or of none (an older marker), or of other settings (the config
changed), does not count, and the stage runs again (the pruning tools then set their own stale points
and rows aside, :mod:`headlab.pruning.sweep`). Otherwise its commands run
in-process through :func:`headlab.cli.main`, so that each step is exactly the command printed
in docs/reproduction.md, and the marker is written last, atomically. A stage holds the lock of
``<work_dir>/<model>/locks/<stage>`` while it runs, so that different stages (the two pruning
sweeps, say) can run side by side in separate processes, but one stage only once. This module
sits with the command line in the import layers (it imports :mod:`headlab.cli`); nothing below
imports it.
"""

from __future__ import annotations

import time
from typing import Callable

import headlab
from headlab import HeadlabError
from headlab.cli import main  # the `headlab` console script's entry point (pyproject [project.scripts])
from headlab.lock import locked_output
from headlab.resume import SkipStage, now_iso, read_marker, weights_fingerprint, write_marker
from reproduction.config import ReproduceConfig
from reproduction.report import write_report
from reproduction.stages import (
    STAGES,
    Context,
    Stage,
    StageOutcome,
    command_text,
    current_names,
    marker_path,
    stage_settings,
)

__all__ = ["run_pipeline"]


# Commands that refuse an --out holding an earlier run's results without --overwrite: a stage that
# runs again (--force, other settings or weights) replaces its own earlier results.
_REPLACES_ITS_OUT = ("functions", "aggregate", "importance")


def _run_cli(argv: list[str]) -> None:
    argv = [str(a) for a in argv]
    rc = main(argv + ["--overwrite"] if argv[0] in _REPLACES_ITS_OUT else argv)
    if rc:
        raise HeadlabError(f"`{command_text(argv)}` exited with status {rc}")


def _run_stage(ctx: Context, spec: Stage) -> StageOutcome:
    if ctx.dry_run:
        return _run_stage_unlocked(ctx, spec)
    # One run of a stage of a model at a time (two would train the same points); other stages,
    # the two pruning sweeps say, may run beside it in another process.
    with locked_output(ctx.config.work(ctx.model, "locks", spec.name), "work_dir"):
        return _run_stage_unlocked(ctx, spec)


def _run_stage_unlocked(ctx: Context, spec: Stage) -> StageOutcome:
    name, model = spec.name, ctx.model.name
    marker = marker_path(ctx.config, ctx.model, name)
    weights = weights_fingerprint(ctx.config.path(ctx.model.path))
    earlier = read_marker(marker)
    settings = stage_settings(ctx, spec)
    if earlier is not None and not ctx.force:
        recorded = earlier.get("model_sha256")
        if weights is not None and recorded != weights:
            ctx.log(f"{model} {name}: finished earlier on other weights (model_sha256 "
                    f"{(recorded or 'not recorded')[:12]}, now {weights[:12]}): run again")
        elif settings is not None and earlier.get("settings") is not None and \
                current_names(earlier["settings"]) != current_names(settings):  # None: not recorded
            changed = next((now for before, now in zip(current_names(earlier["settings"]), current_names(settings))
                            if before != now), f"{len(settings)} commands, {len(earlier['settings'])} then")
            ctx.log(f"{model} {name}: finished earlier with other settings (the config changed; now `{changed}`): "
                    f"run again")
        else:
            ctx.log(f"{model} {name}: finished earlier ({marker}), skipped")
            return StageOutcome(model, name, "skipped", reason=f"finished earlier ({marker})")
    try:  # a stage that cannot run yet (SkipStage) says so while checking, building its commands or running
        if not ctx.dry_run:
            if spec.check is not None:
                spec.check(ctx)
            if spec.prepare is not None:
                spec.prepare(ctx)
        commands = spec.commands(ctx) if spec.commands else []
        texts = [command_text(argv) for argv in commands]
        if ctx.dry_run:
            for text in texts or [f"(Python) reproduction {name}"]:
                ctx.log(f"{model} {name}: {text}")
            return StageOutcome(model, name, "dry run", commands=texts)
        ctx.log(f"{model} {name}: running")
        started = time.perf_counter()
        for argv, text in zip(commands, texts):
            ctx.log(f"  {text}")
            _run_cli(argv)
        if spec.python is not None:
            texts += spec.python(ctx.config, ctx.model, force=ctx.force, log=ctx.log)
    except SkipStage as reason:
        ctx.log(f"{model} {name}: not run: {reason}")
        return StageOutcome(model, name, "not run", reason=str(reason))
    seconds = time.perf_counter() - started
    write_marker(marker, {"stage": name, "model": model, "commands": texts, "settings": settings,
                          "seconds": round(seconds, 1), "finished": now_iso(), "headlab": headlab.__version__,
                          "model_sha256": weights})
    ctx.log(f"{model} {name}: done in {seconds:.0f} s")
    return StageOutcome(model, name, "done", seconds, commands=texts)


def run_pipeline(config: ReproduceConfig, *, models: list[str] | None = None, stages: list[str] | None = None,
                 force: bool = False, dry_run: bool = False, docs_only: bool = False,
                 log: Callable[[str], None] = print) -> list[StageOutcome]:
    """Run the chosen stages for the chosen models, in registry order; then the report."""
    chosen = list(STAGES) if not stages else stages
    for stage in chosen:
        if stage not in STAGES:
            raise HeadlabError(f"unknown stage {stage!r}; expected one of {', '.join(STAGES)}")
    entries = [config.model(name) for name in models] if models else list(config.models)
    outcomes: list[StageOutcome] = []
    if not docs_only:
        for entry in entries:
            ctx = Context(config, entry, force=force, dry_run=dry_run, log=log)
            for stage in STAGES:
                if stage in chosen and stage != "report":
                    outcomes.append(_run_stage(ctx, STAGES[stage]))
    if docs_only or ("report" in chosen and not dry_run):
        written = write_report(config, [e.name for e in entries], collect=not docs_only, log=log)
        outcomes.append(StageOutcome(",".join(e.name for e in entries), "report", "done",
                                     commands=[str(p) for p in written]))
    return outcomes
