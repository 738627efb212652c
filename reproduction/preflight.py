"""What ``python -m reproduction`` checks before its first stage runs (docs/cli.md, exit 2).

A reproduction runs for hours; a data file missing for its fifth stage, or a document it
cannot write at the end, must refuse it in a second instead. For each stage that will run (no
marker, or ``--force``) the inputs are read off the very commands the stage would run (their
data flags), so the two never disagree; the two Python stages name theirs here. A stage whose
model does not exist yet is left to the pipeline, which reports it as not run. Files the stages
write for later commands (a parsed treebank, importance scores, gates: all under ``work_dir``)
are not inputs of the run.
"""

from __future__ import annotations

from pathlib import Path

from headlab import HeadlabError, preflight
from headlab.resume import SkipStage
from reproduction.config import ModelEntry, ReproduceConfig
from reproduction.stages import STAGES, Context, marker_path

__all__ = ["check_names", "check_inputs", "check_outputs"]

DATA_FLAGS = ("--source", "--target", "--conllu", "--train-text", "--train-src", "--train-tgt",
              "--valid-src", "--valid-tgt")
"""The flags of a stage's commands that name data (those under ``work_dir`` are made by the stages)."""


def check_names(config: ReproduceConfig, models: list[str] | None, stages: list[str] | None) -> None:
    """``--stages`` and ``--models`` name stages and models that exist."""
    for stage in stages or ():
        if stage not in STAGES:
            raise HeadlabError(f"--stages: unknown stage {stage!r}; expected one of {', '.join(STAGES)}")
    for name in models or ():
        if name not in {m.name for m in config.models}:
            raise HeadlabError(f"--models: {config.source} has no model named {name!r} "
                               f"(it has {', '.join(m.name for m in config.models)})")


def _python_inputs(config: ReproduceConfig, model: ModelEntry, stage: str) -> list[tuple[str, Path]]:
    if not (config.path(model.path) / "config.json").is_file():
        return []  # not run: the pipeline says so
    if stage == "hypotheses":
        split = config.prune.get("eval_split", "test")
    elif stage == "specialisation":
        split = config.specialisation_split
    else:
        return []
    return [(f"data.{split}", config.data_file(split, lang)) for lang in (model.src, model.tgt)]


def stage_inputs(config: ReproduceConfig, model: ModelEntry, stage: str) -> list[tuple[str, Path]]:
    """``(flag, path)`` of every data file ``stage`` reads for ``model``."""
    spec = STAGES[stage]
    if spec.commands is None:
        return _python_inputs(config, model, stage)
    try:
        commands = spec.commands(Context(config, model, log=lambda message: None))
    except SkipStage:
        return []  # the pipeline reports why it does not run
    work = config.path(config.work_dir).resolve()
    inputs = []
    for argv in commands:
        argv = [str(a) for a in argv]
        for flag, value in zip(argv, argv[1:]):
            if flag in DATA_FLAGS and not Path(value).resolve().is_relative_to(work):  # not made by a stage
                inputs.append((flag, Path(value)))
    return inputs


def check_inputs(config: ReproduceConfig, models: list[str] | None, stages: list[str] | None,
                 force: bool = False) -> None:
    """Every data file of every stage that will run is readable and not empty."""
    chosen = stages or list(STAGES)
    entries = [config.model(name) for name in models] if models else config.models
    checked: set[Path] = set()
    for entry in entries:
        for stage in STAGES:
            if stage not in chosen or stage == "report":
                continue
            if marker_path(config, entry, stage).is_file() and not force:
                continue  # finished earlier: skipped
            for flag, path in stage_inputs(config, entry, stage):
                if path not in checked:
                    preflight.input_file(path, f"{config.source}: model {entry.name}, stage {stage}: {flag}")
                    checked.add(path)


def check_outputs(config: ReproduceConfig, *, stages_run: bool, report: bool) -> None:
    """The work directory (when stages run) and the document, results and figures (when the
    report is written) can be written."""
    if stages_run:
        preflight.output_dir(config.path(config.work_dir), f"{config.source}: work_dir")
    if report:
        preflight.output_dir(config.path(config.results_dir), f"{config.source}: results_dir")
        preflight.output_dir(config.path(config.img_dir), f"{config.source}: img_dir")
        preflight.output_file(config.path(config.doc), f"{config.source}: doc")
