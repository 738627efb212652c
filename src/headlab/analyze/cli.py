"""`headlab analyze MODEL --source FILE [--target FILE] [--conllu FILE] --out DIR`: parse, run, print."""

from __future__ import annotations

import argparse

from headlab.analyze.pipeline import STAGES, AnalyzeConfig
from headlab.device_options import add_device_options
from headlab.options import add_options, from_args, help_of, numbers


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "analyze", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="everything in one resumable run: importance, head functions, aggregate statistics, "
             "(pruning), figures and an HTML report")
    add_options(p, AnalyzeConfig, ("model", "source", "target", "conllu", "conllu_is_source"))
    p.add_argument("--train-text", action="append", default=[],
                   help=help_of(AnalyzeConfig, "train_text") + "; repeatable")
    add_options(p, AnalyzeConfig, ("out", "prune", "ablation", "force"))
    p.add_argument("--skip", nargs="+", default=[], metavar="STAGE",
                   help=f"stages not to run (space- or comma-separated): {', '.join(STAGES)}, "
                        "or importance (its five stages)")
    add_options(p, AnalyzeConfig, ("limit", "conllu_limit", "threads", "batch_size", "max_length", "lrp_targets",
                                   "lrp_seed", "query_chunk", "prune_source", "prune_target", "prune_limit"))
    p.add_argument("--prune-keeps", help=help_of(AnalyzeConfig, "prune_keeps") + "; comma list")
    add_options(p, AnalyzeConfig, ("prune_gates", "prune_steps", "prune_max_tokens", "prune_eval_beam", "prune_gate_lr",
                                   "prune_init_log_alpha", "attention_sentences"))
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_options(p, AnalyzeConfig, ("trust_remote_code",))
    add_device_options(p)
    p.set_defaults(func=run_analyze_command,
                   interrupted="the finished stages are kept in {out}; the same command resumes from them")


def config_from_args(args) -> AnalyzeConfig:
    return from_args(
        args, AnalyzeConfig, train_text=tuple(args.train_text),
        skip=tuple(name.strip() for item in args.skip for name in item.split(",") if name.strip()),
        prune_keeps=numbers(args.prune_keeps) if args.prune_keeps else (), progress=not args.no_progress)


def print_summary(run) -> None:
    width = max(len(r.name) for r in run.records)
    for record in run.records:
        seconds = f"{record.seconds:7.1f} s" if record.seconds is not None else " " * 9
        reason = f"  {record.reason}" if record.reason else ""
        print(f"{record.name:<{width}}  {record.status:<7}  {seconds}{reason}")
    print(f"manifest: {run.manifest}")
    if run.report is not None:
        print(f"report: {run.report}")


def run_analyze_command(args) -> int:
    from headlab.analyze.pipeline import run_analysis

    run = run_analysis(config_from_args(args))
    print_summary(run)
    return 1 if run.failed else 0
