"""`headlab analyze MODEL --source FILE [--target FILE] [--conllu FILE] --out DIR`: parse, run, print."""

from __future__ import annotations

from headlab.device_options import add_device_options
from headlab.options import HelpFormatter, add_options, comma_list, from_args, help_of, numbers
from headlab.pipeline.pipeline import STAGES, AnalyzeConfig
from headlab.plugins import add_plugin_options, defer, values_from_args
from headlab.shard import add_process_options


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "analyze", formatter_class=HelpFormatter,
        help="everything in one resumable run: importance, head functions, aggregate statistics, "
             "(pruning), figures and an HTML report")
    add_options(p, AnalyzeConfig, ("model", "source", "target", "conllu", "conllu_is_source"))
    p.add_argument("--train-text", action="append", default=[],
                   help=help_of(AnalyzeConfig, "train_text") + "; repeatable")
    add_options(p, AnalyzeConfig, ("out", "prune", "force"))
    p.add_argument("--skip", nargs="+", action="extend", default=[], metavar="STAGE",
                   help=f"stages not to run (space- or comma-separated): {', '.join(STAGES)}, "
                        "or importance (the measures' stages and agreement)")
    add_options(p, AnalyzeConfig, ("limit", "conllu_limit", "threads", "batch_size", "max_length", "query_chunk",
                                   "engine", "prune_source", "prune_target", "prune_limit"))
    p.add_argument("--prune-keeps", help=help_of(AnalyzeConfig, "prune_keeps") + "; comma list")
    add_options(p, AnalyzeConfig, ("prune_gates", "prune_steps", "prune_max_tokens", "prune_eval_beam", "prune_gate_lr",
                                   "prune_init_log_alpha", "attention_sentences"))
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_options(p, AnalyzeConfig, ("trust_remote_code",))
    add_device_options(p)
    add_process_options(p)
    # The measures' options and --<measure> for those run only when asked (--ablation): declared by
    # the measures, added when the command is used (importing them imports torch).
    defer(p, lambda parser: add_plugin_options(parser, AnalyzeConfig.plugin_specs()))
    p.set_defaults(func=run_analyze_command,
                   interrupted="the finished stages are kept in {out}; the same command resumes from them",
                   interrupted_if=("{out}/.headlab/stages/*",))


def config_from_args(args) -> AnalyzeConfig:
    return from_args(
        args, AnalyzeConfig, train_text=tuple(args.train_text),
        skip=comma_list(",".join(args.skip), "--skip") if args.skip else (),
        prune_keeps=numbers(args.prune_keeps, flag="--prune-keeps") if args.prune_keeps is not None else (),
        progress=not args.no_progress,
        options=values_from_args(args, AnalyzeConfig.plugin_specs()))


def print_summary(run) -> None:
    width = max(len(r.name) for r in run.records)
    for record in run.records:
        seconds = f"{record.seconds:7.1f} s" if record.seconds is not None else " " * 9
        reason = f"  {record.reason}" if record.reason else ""
        print(f"{record.name:<{width}}  {record.status:<7}  {seconds}{reason}")
    print(f"manifest: {run.manifest}")
    if run.report is not None:
        print(f"report: {run.report}")


def _sentences(config) -> tuple[int, str, str]:
    """The sentences a sharded run splits (for the check of --num-processes): the fewer of --source's
    non-empty lines and --conllu's sentences."""
    from headlab.data.parallel import read_lines

    lines = [line for line in read_lines(config.source) if line.strip()]
    counts = [(len(lines[: config.limit] if config.limit else lines), "non-empty line", f"of --source {config.source}")]
    if config.conllu is not None:
        from headlab.data.treebank import count_sentences

        n = count_sentences(config.conllu)
        limit = config.treebank_limit
        counts.append((min(n, limit) if limit else n, "sentence", f"of --conllu {config.conllu}"))
    return min(counts)


def run_analyze_command(args) -> int:
    from headlab import shard
    from headlab.pipeline.pipeline import check_processes, run_analysis, validate

    config = config_from_args(args)
    if (args.num_processes or 1) > 1 and shard.world_size() == 1:
        validate(config)  # bad input fails here, before the processes start
        check_processes(config, args.num_processes)
    launched = shard.start(args, lambda: _sentences(config))
    if launched is not None:
        return launched
    with shard.joined(config.device) as part:
        run = run_analysis(config, shard=part)
    if part.main:
        print_summary(run)
    return 1 if run.failed else 0
