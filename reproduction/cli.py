"""`python -m reproduction`: parse, check (:mod:`reproduction.preflight`), lock the report, call
:func:`reproduction.pipeline.run_pipeline`, print.

The exit codes are headlab's (docs/cli.md): 0 done, 1 a failure while running, 2 bad input or
usage found before work starts, 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys
import traceback

from headlab import HeadlabError
from headlab.options import HelpFormatter

PROG = "python -m reproduction"


def build_parser() -> argparse.ArgumentParser:
    from reproduction.stages import STAGES

    p = argparse.ArgumentParser(
        prog=PROG, formatter_class=HelpFormatter,
        description="Reproduce Voita et al. 2019 on the bundled models: staged, resumable; writes docs/reproduction.md. "
                    "Run it from the root of a headlab checkout.")
    p.add_argument("--config", default="experiments/reproduce.json", help="the reproduction's config (JSON)")
    p.add_argument("--models", help="comma-separated model names of the config (none: all)")
    p.add_argument("--stages", help=f"comma-separated stages (none: all): {', '.join(STAGES)}")
    p.add_argument("--force", action="store_true",
                   help="rerun stages that have finished (pruning points and baseline rows already done are "
                        "still kept by the tools' own resume: delete them to redo them)")
    p.add_argument("--docs-only", action="store_true",
                   help="only regenerate docs/reproduction.md, claims.json and figures from the committed results")
    p.add_argument("--dry-run", action="store_true", help="print each stage's commands; run nothing")
    p.add_argument("--device", help="where importance and functions run (cpu, cuda, cuda:N), for every model; "
                                    "replaces the config's device entries (none: as the config says)")
    p.add_argument("--threads", type=int, help="torch CPU threads of every stage (none: the config's threads)")
    p.add_argument("--debug", action="store_true", help="print the full traceback of any error")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # usage errors: argparse exits with 2
    try:
        return run_reproduce(args)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; finished stages keep their markers, run it again to go on", file=sys.stderr)
        return 130
    except HeadlabError as error:  # bad input (2) or a stage that failed (1): one line
        if args.debug:
            traceback.print_exc()
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return error.exit_code
    except OSError as error:  # the user's paths: unreadable, unwritable, disk full
        if args.debug:
            traceback.print_exc()
        where = f"{error.filename}: " if error.filename else ""
        print(f"{PROG}: error: {where}{error.strerror or error}", file=sys.stderr)
        return 1


def run_reproduce(args) -> int:
    from contextlib import nullcontext

    from headlab.lock import locked_output
    from reproduction import preflight
    from reproduction.config import load_config
    from reproduction.pipeline import run_pipeline

    config = load_config(args.config)
    _override(config, device=args.device, threads=args.threads)
    from headlab.options import comma_list

    # `--stages ,` is an error, not every stage (None: the option not given)
    models = list(comma_list(args.models, "--models")) if args.models is not None else None
    stages = list(comma_list(args.stages, "--stages")) if args.stages is not None else None
    preflight.check_names(config, models, stages)  # before any work (docs/cli.md): exit 2
    stages_run = not args.dry_run and not args.docs_only and stages != ["report"]
    if stages_run:
        preflight.check_inputs(config, models, stages, force=args.force)
    if not args.dry_run:
        preflight.check_outputs(config, stages_run=stages_run, report=args.docs_only or not stages or "report" in stages)
    # Each stage locks its own directory while it runs (pipeline); the report, which rewrites the
    # results and the document, one at a time per work directory.
    lock = locked_output(config.path(config.work_dir) / "locks" / "report", "work_dir") \
        if stages_run and (not stages or "report" in stages) else nullcontext()
    log = lambda message: print(f"reproduction: {message}", file=sys.stderr, flush=True)  # noqa: E731
    with lock:
        outcomes = run_pipeline(config, models=models, stages=stages, force=args.force, dry_run=args.dry_run,
                                docs_only=args.docs_only, log=log)
    for outcome in outcomes:
        extra = f" ({outcome.seconds / 60:.1f} min)" if outcome.status == "done" and outcome.seconds else ""
        reason = f": {outcome.reason}" if outcome.reason else ""
        print(f"{outcome.model} {outcome.stage}: {outcome.status}{extra}{reason}")
    return 0


def _override(config, device: str | None, threads: int | None) -> None:
    """The machine's settings from the command line, over the config's: one config serves a laptop
    and a GPU machine. The trainers (prune, baselines) pick the GPU themselves (Accelerate)."""
    if threads is not None:
        if threads < 1:
            raise HeadlabError(f"--threads must be a positive integer, got {threads}")
        config.threads = threads
    if device is not None:
        for options in (config.importance, config.functions):
            options["device"] = device
