"""`headlab functions` and `headlab aggregate`: parse, call :func:`analyze_heads`, print."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from headlab.device_options import add_device_options, device_options, set_threads
from headlab.errors import HeadlabError, RunFailed, counted
from headlab.functions.config import AnalysisConfig
from headlab.options import HelpFormatter, add_options, from_args, renamed
from headlab.outdir import check_output, results_lock
from headlab.plugins import add_plugin_options, defer, values_from_args
from headlab.shard import add_process_options


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="local model directory (or hub id in the cache)")
    parser.add_argument("--conllu", help="CoNLL-U treebank (source side for a translation model)")
    parser.add_argument("--out", required=True, help="output directory (HeadScores JSON, tables, figures)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the results of an earlier run in --out (only the files it wrote)")
    parser.add_argument("--tokenizer", help="tokenizer directory (default: the model's)")
    parser.add_argument("--target-conllu", help="target-side parses: also analyse decoder self-attention")
    renamed(parser, "--source", "--source-text", help="source sentences for --target-conllu, one per line "
                                                          "(when the source side has no CoNLL-U)")
    add_options(parser, AnalysisConfig, ("batch_size", "max_sentences", "max_length", "spacing", "word_pooling",
                                         "engine", "query_chunk"))
    parser.add_argument("--threads", type=int, help="torch CPU threads")
    parser.add_argument("--no-figures", action="store_true", help="write no PNG figures")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--trust-remote-code", action="store_true")
    add_device_options(parser)
    add_process_options(parser)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "functions", formatter_class=HelpFormatter,
        help="positional, syntactic and rare-token heads over a treebank (Voita et al. 2019, Sec. 5)")
    _common(p)
    p.add_argument("--train-text", action="append",
                   help="training text for token frequencies (rare-token heads); repeatable")
    p.add_argument("--frequencies", help="token<TAB>count file instead of --train-text")
    p.add_argument("--aggregate", action="store_true",
                   help="also compute the aggregate statistics in the same pass")
    defer(p, _statistic_options(None))
    p.set_defaults(func=run_functions)

    p = subparsers.add_parser(
        "aggregate", formatter_class=HelpFormatter,
        help="attention distance, entropy, variability, exemplars, POS and dependency shares (Vig & Belinkov 2019)")
    _common(p)
    defer(p, _statistic_options("aggregate"))
    p.set_defaults(func=run_aggregate)


def _statistic_options(stage: str | None):
    """The flags of the options that the statistics (of the pass ``stage``) declare: added when
    the command is used (declaring them imports the statistics, and with them torch)."""
    def add(parser) -> None:
        from headlab.functions.registry import option_specs

        add_plugin_options(parser, option_specs(stage))

    return add


def _sentences(args) -> tuple[int, str, str]:
    """The sentences a sharded run splits (for the check of --num-processes)."""
    from headlab.data.treebank import count_sentences

    path = args.target_conllu or args.conllu
    n = count_sentences(path)
    if args.limit is not None:
        n = min(n, args.limit)
    return n, "sentence", f"of {path}" + (f" (--limit {args.limit})" if args.limit else "")


def _check_aggregate_options(args, aggregate: bool) -> None:
    """The aggregate statistics' own options (``--window``, ``--top-k``, ...) given to ``functions``
    without ``--aggregate``: that pass does not run, and they were taken and ignored."""
    if aggregate:
        return
    from headlab.functions.registry import option_specs

    own = {s.dest for s in option_specs("functions")}  # a flag shared with a functions statistic acts there
    given = sorted(dict.fromkeys(f"--{s.dest.replace('_', '-')}" for s in option_specs("aggregate")
                                 if s.dest not in own and getattr(args, s.dest, s.default) != s.default))
    if given:
        raise HeadlabError(f"{', '.join(given)}: {'options' if len(given) > 1 else 'an option'} of the aggregate "
                           "statistics, which run with --aggregate (or headlab aggregate); add --aggregate, or leave "
                           f"{'them' if len(given) > 1 else 'it'} out")


def _run(args, functions: bool, aggregate: bool) -> int:
    from headlab import shard

    _check_aggregate_options(args, aggregate)
    _check(args)
    launched = shard.start(args, lambda: _sentences(args))
    if launched is not None:
        return launched
    with shard.joined(args.device) as part, results_lock(args.out, args.overwrite, part.main, command=args.command):
        return _analyse(args, functions, aggregate, part)


def _analyse(args, functions: bool, aggregate: bool, part) -> int:

    from headlab.data.frequencies import TokenFrequencies
    from headlab.functions.analysis import analyze_heads, describe_heads
    from headlab.functions.registry import STATISTICS
    from headlab.heads import shown_model_name
    from headlab.loading import check_given_tokenizer, load_model, load_tokenizer
    from headlab.outdir import write_results, written_note
    from headlab.shard import rank_device

    set_threads(args.threads)
    config = _config(args, functions, aggregate)
    placement = device_options(args)
    placement["device"] = rank_device(placement["device"], part)
    # The tokenizer and the token frequencies first: a directory without a tokenizer or a bad line of
    # --frequencies is refused before the weights load (minutes for a large model).
    tokenizer = load_tokenizer(args.tokenizer or args.model, trust_remote_code=args.trust_remote_code)
    # another model's --tokenizer: a larger vocabulary, or one whose ids are other tokens to the model
    check_given_tokenizer(tokenizer, args.tokenizer, args.model, shown_model_name(args.model), args.trust_remote_code)
    frequencies = None
    if functions and getattr(args, "frequencies", None):
        frequencies = TokenFrequencies.from_file(tokenizer, args.frequencies)
    elif functions and getattr(args, "train_text", None):
        frequencies = TokenFrequencies.from_corpus(tokenizer, args.train_text)
    model = load_model(args.model, trust_remote_code=args.trust_remote_code, **placement)
    analysis = analyze_heads(
        model, tokenizer, args.conllu, target_conllu=args.target_conllu, source_text=args.source,
        frequencies=frequencies, config=config, model_name=shown_model_name(args.model), progress=not args.no_progress,
    )
    if analysis.report.n_sentences == 0:  # tables of NaN would look like results
        raise RunFailed(f"no sentence could be analysed; nothing written\n{analysis.report.describe()}")
    if not part.main:  # the main process writes and prints the whole corpus's results
        return 0
    out = Path(args.out)
    write_results(out, lambda directory: analysis.save(directory, figures=not args.no_figures),
                  command=args.command, model=args.model, overwrite=args.overwrite)
    args.interrupted = written_note(out)
    print(analysis.report.describe())
    for result in analysis.results.values():  # options the data could not honour
        for warning in getattr(result, "warnings", list)():
            print(warning, file=sys.stderr)
    if functions:
        lines = describe_heads(analysis)
        print("\n".join(lines) if lines else "no head passes the positional or syntactic test")
        for name, result in analysis.results.items():  # the functions pass's tables (Table 1)
            if STATISTICS[name].stage == "functions" and hasattr(result, "summary_markdown"):
                print(result.summary_markdown())
        if frequencies is None:
            for statistic in STATISTICS.values():
                if "frequencies" in statistic.needs and statistic.title:
                    print(f"{statistic.title} skipped: give --train-text FILE or --frequencies FILE")
    for name, result in analysis.results.items():  # the aggregate pass's summaries
        if STATISTICS[name].stage == "aggregate" and hasattr(result, "summary_markdown"):
            print(result.summary_markdown())
    print(f"wrote {out}/")
    return 0


def _config(args, functions: bool, aggregate: bool) -> AnalysisConfig:
    """The pass's config from the parsed flags (the statistics' options checked)."""
    return from_args(args, AnalysisConfig, functions=functions, aggregate=aggregate,
                     options=values_from_args(args, AnalysisConfig.plugin_specs()))


def _check(args) -> None:
    """Inputs, output directory and options, before the model loads (docs/cli.md: exit 2)."""
    from headlab import preflight

    if args.conllu is None and args.target_conllu is None:
        raise HeadlabError("give --conllu FILE (and/or --target-conllu FILE)")
    for flag in ("conllu", "target_conllu", "source", "frequencies"):
        if getattr(args, flag, None) is not None:
            preflight.input_file(getattr(args, flag), "--" + flag.replace("_", "-"))
    from headlab.data.treebank import check_has_sentence

    for flag in ("conllu", "target_conllu"):
        if getattr(args, flag) is not None:
            check_has_sentence(getattr(args, flag), "--" + flag.replace("_", "-"))
    _check_pairing(args)
    for path in getattr(args, "train_text", None) or ():
        preflight.input_file(path, "--train-text")
    if args.tokenizer is not None and not Path(args.tokenizer).is_dir():
        raise HeadlabError(f"--tokenizer {args.tokenizer}: no such directory")
    preflight.model_dir(args.model)
    from headlab.loading import check_supported

    check_supported(args.model, args.trust_remote_code)
    preflight.at_least(args.threads, 1, "--threads")  # the declared options' ranges: checked when parsed
    _config(args, True, True)  # the statistics' options: an unknown --relations
    preflight.output_dir(args.out)
    check_output(args.out, args.overwrite, command=args.command)


def _check_pairing(args) -> None:
    """The source side of --target-conllu: given once, and sentence for sentence as long as the target
    side. Before, --source without --target-conllu (or beside --conllu) was ignored, a missing source
    side was found after the weights loaded, and sides of other lengths were analysed pair by pair up
    to the shorter one, every pair after an extra line a wrong one, with a note."""
    from headlab.data.parallel import read_lines
    from headlab.data.treebank import count_sentences

    if args.target_conllu is None:
        if args.source is not None:
            raise HeadlabError(f"--source {args.source}: the source sentences of --target-conllu, which is not given; "
                               "the treebank of --conllu is analysed alone (leave --source out)")
        return
    if args.conllu is not None and args.source is not None:
        raise HeadlabError(f"--conllu {args.conllu} and --source {args.source} both give the source side of "
                           "--target-conllu; give one of them")
    from headlab.loading import load_config

    if not getattr(load_config(args.model, args.trust_remote_code), "is_encoder_decoder", False):
        # as analyze_heads says it, before the weights load
        raise HeadlabError(f"--target-conllu {args.target_conllu}: target-side parses need an encoder-decoder model; "
                           f"{args.model} has one stack")
    if args.conllu is None and args.source is None:
        raise HeadlabError(f"--target-conllu {args.target_conllu}: decoder analysis needs the source sentences: give "
                           "--conllu (source parses) or --source (one sentence per line), aligned with the target parses")
    n_target = count_sentences(args.target_conllu)
    if args.conllu is not None:
        flag, source, n_source = "--conllu", args.conllu, count_sentences(args.conllu)
        unit = "sentence"
    else:
        lines = read_lines(args.source)
        while lines and not lines[-1].strip():  # blank lines after the last sentence pair with nothing
            lines.pop()
        flag, source, n_source, unit = "--source", args.source, len(lines), "line"
    if n_source != n_target:
        raise HeadlabError(f"--target-conllu {args.target_conllu} has {counted(n_target, 'sentence')} but {flag} "
                           f"{source} has {counted(n_source, unit)}: the source and target sides must match sentence "
                           "for sentence")


def run_functions(args) -> int:
    return _run(args, functions=True, aggregate=args.aggregate)


def run_aggregate(args) -> int:
    return _run(args, functions=False, aggregate=True)
