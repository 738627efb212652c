"""`headlab reproduce`: parse, check (:mod:`headlab.reproduce.preflight`), lock the report, call
:func:`headlab.reproduce.pipeline.run_pipeline`, print."""

from __future__ import annotations

import sys

from headlab.options import HelpFormatter


def register(subparsers) -> None:
    from headlab.reproduce.stages import STAGES

    p = subparsers.add_parser(
        "reproduce", formatter_class=HelpFormatter,
        help="reproduce Voita et al. 2019 on the bundled models: staged, resumable; writes docs/reproduction.md")
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
    p.set_defaults(func=run_reproduce)


def run_reproduce(args) -> int:
    from contextlib import nullcontext

    from headlab.lock import locked_output
    from headlab.reproduce import preflight
    from headlab.reproduce.config import load_config
    from headlab.reproduce.pipeline import run_pipeline

    config = load_config(args.config)
    _override(config, device=args.device, threads=args.threads)
    split = lambda text: [x.strip() for x in text.split(",") if x.strip()] if text else None  # noqa: E731
    models, stages = split(args.models), split(args.stages)
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
    log = lambda message: print(f"headlab reproduce: {message}", file=sys.stderr, flush=True)  # noqa: E731
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
    from headlab.errors import HeadlabError

    if threads is not None:
        if threads < 1:
            raise HeadlabError(f"--threads must be a positive integer, got {threads}")
        config.threads = threads
    if device is not None:
        for options in (config.importance, config.functions):
            options["device"] = device
