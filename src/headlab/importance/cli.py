"""`headlab importance MODEL --source FILE --method ... --out DIR`: parse, call the library, print."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

from headlab.device_options import add_device_options, device_options, set_threads
from headlab.errors import HeadlabError, counted
from headlab.importance.config import ImportanceConfig
from headlab.importance.registry import MEASURES
from headlab.options import HelpFormatter, add_options, from_args, help_of, renamed
from headlab.outdir import check_output, results_lock
from headlab.plugins import add_plugin_options, defer, values_from_args
from headlab.shard import add_process_options


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "importance",
        help=f"score every head: {', '.join(MEASURES)}, and their agreement",
        formatter_class=HelpFormatter,
    )
    p.add_argument("model", help="local model directory or hub id (hub ids need the network or a cache)")
    renamed(p, "--source", "--data", required=True,
            help="text file, one sentence per line (plain or .gz): a translation model's source side, "
                        "otherwise the text itself; for a sequence classifier a labelled TSV "
                        "(text<TAB>label or text_a<TAB>text_b<TAB>label)")
    p.add_argument("--target", help="reference translations, line-aligned with --source (loss and BLEU use them)")
    p.add_argument("--method", default="all", help=help_of(ImportanceConfig, "methods") + " (several: comma-separated)")
    p.add_argument("--out", required=True, help="output directory: one HeadScores JSON per method + agreement table")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the results of an earlier run in --out (only the files it wrote)")
    renamed(p, "--limit", "--n-sentences", type=int, help="use the first N sentences of --source (blank lines not counted)")
    p.add_argument("--max-length", type=int, help="truncate inputs to this many tokens; None: the model's maximum")
    add_options(p, ImportanceConfig, ("batch_size", "beam"))
    defer(p, _measure_options)  # declared by the measures: importing them imports torch, so not for --help
    p.add_argument("--kinds", help="comma-separated attention kinds to score (enc_self, dec_self, dec_cross)")
    p.add_argument("--plots", action="store_true", help="also write a heatmap PNG per method")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--trust-remote-code", action="store_true", help="allow code from the model repository to run")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_device_options(p)
    add_process_options(p)
    p.set_defaults(func=run_importance_command)


def _measure_options(parser) -> None:
    from headlab.importance.registry import option_specs

    add_plugin_options(parser, option_specs(), skip=ImportanceConfig.BASE)


def _check(args) -> None:
    """Inputs, output directory and options, before the model loads (docs/cli.md: exit 2)."""
    from headlab import preflight

    preflight.input_file(args.source, "--source")
    if args.target is not None:
        preflight.input_file(args.target, "--target")
    preflight.model_dir(args.model)
    from headlab.loading import check_supported

    check_supported(args.model, args.trust_remote_code)
    _check_translation_options(args)
    _check_padded_targets(args)
    for flag, minimum in (("limit", 1), ("max_length", 2), ("threads", 1)):  # the others' ranges: checked when parsed
        preflight.at_least(getattr(args, flag), minimum, "--" + flag.replace("_", "-"))
    preflight.output_dir(args.out)
    check_output(args.out, args.overwrite, command="importance")


def _sentences(args) -> tuple[int, str, str]:
    """The sentences a sharded run splits (for the check of --num-processes): non-empty lines."""
    from headlab.data.parallel import first_sentences, read_lines

    lines = read_lines(args.source)
    lines = lines[: first_sentences(lines, args.limit)]
    return sum(1 for line in lines if line.strip()), "non-empty line", f"of --source {args.source}"


def _check_translation_options(args) -> None:
    """--target and --beam of a model that does not translate (its config: one stack, or a sequence classifier),
    refused before the weights load, as analyze refuses them (before, once the model had loaded)."""
    metric = getattr(args, "metric", "loss")
    if args.target is None and args.beam == 1 and metric == "loss":
        return
    from headlab.checkpoint import model_class_for
    from headlab.importance.config import check_beam
    from headlab.loading import load_config

    config = load_config(args.model, args.trust_remote_code)
    classifier = model_class_for(config, f"{args.model}/config.json").__name__.endswith("ForSequenceClassification")
    translates = bool(getattr(config, "is_encoder_decoder", False)) and not classifier
    if args.target is not None and not translates:  # as read_data says it
        raise HeadlabError(f"--target {args.target}: references are only used with translation (encoder-decoder) "
                           f"models; {args.model} " + ("is a sequence classifier" if classifier else "has one stack"))
    _check_ablation_metric(args, translates, classifier, config.model_type)
    check_beam(args.beam, translates=translates, classifier=classifier, arch=config.model_type, model=args.model,
               option="--beam")


def _check_padded_targets(args) -> None:
    """ProphetNet's decoder refuses padded target batches (headlab.adapters.prophetnet), which --batch-size over 1
    builds: refused from its config before the weights load, as analyze refuses it (before, at the first such batch)."""
    from headlab.adapters.prophetnet import batch_size_problem
    from headlab.loading import load_config

    if args.batch_size > 1 and Path(args.model).is_dir():
        model_type = getattr(load_config(args.model, args.trust_remote_code), "model_type", None)
        if problem := batch_size_problem(model_type, args.batch_size):
            raise HeadlabError(problem)


def _check_ablation_metric(args, translates: bool, classifier: bool, arch: str) -> None:
    """--metric of an ablation asked for by name (--method naming it; with "all" an ablation the metric does not fit is
    skipped, as run_importance skips it), refused from the config before the weights load by analyze's own check
    (before, once the model had loaded)."""
    from headlab.importance.config import check_ablation_metric

    if "ablation" in {m.strip() for m in str(args.method).split(",")}:
        check_ablation_metric(getattr(args, "metric", "loss"), translates=translates, classifier=classifier,
                              has_target=args.target is not None, arch=arch, model=args.model)


def _check_kinds_in_structure(args, kinds: tuple[str, ...]) -> None:
    """A --kinds kind the model has no block of, refused from its structure (the meta device, no weights read);
    before, after the weights loaded. A kind whose every head was pruned is found once they have."""
    from headlab.adapters import attention_blocks
    from headlab.loading import config_structure

    if not Path(args.model).is_dir():
        return  # a hub id: the loader (and the check after it) says what is wrong
    have = {b.kind for b in attention_blocks(config_structure(args.model, args.trust_remote_code))}
    for kind in kinds:
        if kind not in have:
            raise HeadlabError(f"--kinds {kind}: the model has no {kind} heads (it has {', '.join(sorted(have))})")


def _check_beam(args, info) -> None:
    from headlab.importance.config import check_beam

    check_beam(args.beam, translates=info.is_seq2seq, classifier=info.arch == "classifier", arch=info.arch,
               model=args.model, option="--beam")


def run_importance_command(args) -> int:
    from headlab import shard

    _check(args)
    launched = shard.start(args, lambda: _sentences(args))
    if launched is not None:
        return launched
    with shard.joined(args.device) as part, results_lock(args.out, args.overwrite, part.main, command="importance"):
        return _run(args, part)


def _run(args, part) -> int:

    from headlab.data.inputs import read_data
    from headlab.importance.pipeline import MeasuresFailed, run_importance, save_results
    from headlab.importance.registry import REFERENCE
    from headlab.loading import load_model, load_tokenizer
    from headlab.model_description import model_info
    from headlab.outdir import write_results, written_note
    from headlab.shard import rank_device

    set_threads(args.threads)
    kinds = tuple(dict.fromkeys(k.strip() for k in args.kinds.split(",") if k.strip())) if args.kinds is not None \
        else None
    if kinds == ():  # scored nothing and wrote an empty table, exit 0
        raise HeadlabError(f"--kinds {args.kinds!r}: no kind named; expected a comma list of enc_self, dec_self, dec_cross")
    config = from_args(args, ImportanceConfig, methods=tuple(m.strip() for m in args.method.split(",") if m.strip()),
                       kinds=kinds, progress=not args.no_progress and part.main,
                       options=values_from_args(args, ImportanceConfig.plugin_specs()))
    config.resolved_methods()  # fail on a bad --method before loading anything
    config.check_options_act(lambda dest: "--" + dest.replace("_", "-"), f"--method {args.method}")
    placement = device_options(args)
    placement["device"] = rank_device(placement["device"], part)
    if config.option_values().get("engine") == "kernel" and "confidence" in config.resolved_methods():
        import torch

        from headlab.functions.analysis import check_kernel

        # refused before the model loads, as analyze --engine kernel (--device-map auto: the first block on a GPU)
        gpu = placement["device_map"] is not None and torch.cuda.is_available()
        check_kernel(torch.device("cuda" if gpu else placement["device"] or "cpu"))
    if kinds:
        from headlab.heads import KINDS

        for kind in kinds:  # named after the option, where check_kind's message names no option
            if kind not in KINDS:
                raise HeadlabError(f"--kinds {args.kinds}: unknown attention kind {kind!r}; "
                                   f"expected a comma list of {', '.join(KINDS)}")
        _check_kinds_in_structure(args, kinds)
    def log(message: str) -> None:
        if part.main:
            print(f"headlab importance: {message}", file=sys.stderr)

    start = time.perf_counter()
    # the tokenizer first: a directory without one is refused before the weights load
    tokenizer = load_tokenizer(args.model, trust_remote_code=args.trust_remote_code)
    model = load_model(args.model, trust_remote_code=args.trust_remote_code, **placement)
    from headlab.adapters import attention_blocks

    present = {b.kind for b in attention_blocks(model) if b.n_heads > 0}
    if not present:  # every head pruned: no gate to take a gradient for, nothing to score
        raise HeadlabError(f"{args.model}: every attention head of the model was pruned; there is no head to score")
    for kind in kinds or ():
        if kind not in present:
            raise HeadlabError(f"--kinds {kind}: the model has no {kind} heads (it has {', '.join(sorted(present))})")
    info = model_info(model, tokenizer, args.max_length, log=log)
    _check_beam(args, info)
    data = read_data(args.source, tokenizer, info, target_path=args.target, n_sentences=args.limit)
    log(data.summary())
    failed = None
    try:
        result = run_importance(model, data, info, config, tokenizer=tokenizer, log=log)
    except MeasuresFailed as error:  # the other measures' scores are still written
        failed, result = error, error.result
    if not part.main:  # the main process writes and prints the whole corpus's results
        if failed is not None:
            raise failed
        return 0
    out = Path(args.out)

    def write(directory: Path) -> list[Path]:
        written = save_results(result, directory)
        if args.plots:
            from headlab.importance.plots import save_heatmap

            written += [save_heatmap(t, directory / f"{name}.png") for name, t in result.scores.items()]
        return written

    written = write_results(out, write, command="importance", model=args.model, overwrite=args.overwrite)
    args.interrupted = written_note(out)
    for method, reason in result.skipped.items():
        print(f"skipped {method}: {reason}")
    for path in written:
        print(f"wrote {path}")
    for name, table in result.scores.items():
        errors = table.stderr()
        if errors is not None:
            import numpy as np

            values = np.concatenate([a[~np.isnan(a)] for a in errors.scores.values()])
            n = table.signature.get("n_sentences")
            over = counted(n, "sentence") if isinstance(n, int) else f"{n} sentences"
            if len(values):
                print(f"{name}: bootstrap standard error over {over} "
                      f"({errors.signature.get('resamples')} resamples): median {np.median(values):.4f}, "
                      f"max {values.max():.4f}")
            else:  # written as null: said, not left out (resampling one sentence gives no spread to measure)
                print(f"{name}: bootstrap standard error undefined over {over} (null in the file): resampling needs "
                      f"at least two sentences")
    if result.agreement is not None:
        print(f"\nSpearman correlation with {REFERENCE} ({result.agreement.metric}):")
        print(result.agreement.to_markdown(), end="")
        best = result.agreement.best()
        if best:
            print(f"best predictor of {REFERENCE} over all heads: {best}")
        elif all(math.isnan(row.get("all", math.nan)) for row in result.agreement.rho.values()):
            # NaN everywhere: nothing was compared (a pruned model with one head left, or constant scores)
            print(f"no measure can be compared with {REFERENCE} over all heads: Spearman's rho is undefined over "
                  f"{counted(result.agreement.n_heads.get('all', 0), 'head')} (or scores that do not vary)")
        else:
            print(f"no measure predicts {REFERENCE} over all heads (no correlation above 0)")
    if failed is not None:
        raise failed
    log(f"done in {time.perf_counter() - start:.0f}s")
    return 0
