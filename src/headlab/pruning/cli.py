"""``headlab prune``: a command group.

- ``headlab prune apply MODEL --heads SPEC --out DIR``: physical removal (the foundation command);
- ``headlab prune train MODEL ...``: gated fine-tuning (Voita et al. 2019, Sec. 6) and export;
- ``headlab prune sweep MODEL --lams ... | --keeps ...``: resumable sweep and its table;
- ``headlab prune baseline MODEL --method random|michel|scores --keeps N,... ...``: baselines;
- ``headlab prune report SWEEP... --baselines DIR... --out DIR``: Fig. 7, Fig. 9, Table 2.

The older form ``headlab prune MODEL --heads SPEC --out DIR`` still works: :func:`rewrite_argv`
turns ``prune X ...`` into ``prune apply X ...`` whenever X is not a sub-command name or an
option, before argparse sees it.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any

from headlab.device_options import set_threads
from headlab.errors import HeadlabError, counted
from headlab.nmt.cli import resumes_from_last
from headlab.options import HelpFormatter as DEFAULTS
from headlab.options import add_options, from_args, numbers
from headlab.pruning.config import BaselineConfig, PruneConfig
from headlab.resume import file_fingerprint, other_model_note, weights_fingerprint

SUBCOMMANDS = ("apply", "train", "sweep", "baseline", "report")


def rewrite_argv(argv: list[str]) -> list[str]:
    """``prune MODEL ...`` -> ``prune apply MODEL ...`` (the pre-group form of the command)."""
    if len(argv) >= 2 and argv[0] == "prune" and argv[1] not in SUBCOMMANDS and not argv[1].startswith("-"):
        return [argv[0], "apply", *argv[1:]]
    return argv


def _add_data_options(p) -> None:
    p.add_argument("model", help="the converged model: a local directory (safetensors)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the model directory)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow code from the model directory to run (off by default)")
    p.add_argument("--train-src", help="training source file (translation)")
    p.add_argument("--train-tgt", help="training target file (translation)")
    p.add_argument("--train-text", help="training text, one sentence per line (encoder-/decoder-only LM loss)")
    p.add_argument("--valid-src", help="evaluation source file (BLEU, chrF, loss of the pruned model)")
    p.add_argument("--valid-tgt", help="evaluation reference file")
    p.add_argument("--limit", type=int,
                   help="use the first N training pairs (or sentences of --train-text, blank lines not counted)")
    p.add_argument("--eval-limit", type=int, help="evaluate on the first N pairs")
    p.add_argument("--max-sentence-tokens", type=int, default=100, help="cut longer sentences (whitespace tokens)")
    p.add_argument("--threads", type=int, help="torch CPU threads")


def _add_train_options(p) -> None:
    add_options(p, PruneConfig, ("gates",))
    p.add_argument("--freeze-decoder", choices=("auto", "yes", "no"), default="auto",
                   help="auto: frozen iff --gates enc_self on an encoder-decoder model")
    add_options(p, PruneConfig, ("loss", "beta", "init_log_alpha", "gate_lr", "multiplier_lr", "budget_warmup"))
    add_options(p, PruneConfig().train, ("lr", "warmup_steps", "max_tokens", "label_smoothing", "max_epochs",
                                         "max_steps", "save_every_steps", "mixed_precision"))
    add_options(p, PruneConfig, ("log_every", "eval_beam", "latency_sentences"))
    p.add_argument("--dev-src", help="development source file for the curve of --dev-every (not the evaluation set)")
    p.add_argument("--dev-tgt", help="development reference file")
    add_options(p, PruneConfig, ("dev_every", "dev_sentences"))
    add_options(p, PruneConfig().train, ("seed",))
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def register(subparsers) -> None:
    from headlab.commands import add_prune_arguments, run_prune

    group = subparsers.add_parser("prune", help="remove heads: apply a spec, or learn which with Hard Concrete gates")
    sub = group.add_subparsers(dest="prune_command", metavar="SUBCOMMAND")
    sub.required = True

    apply = sub.add_parser("apply", help="physically remove the heads of a spec and save the smaller model "
                                         "(also: headlab prune MODEL --heads ... --out ...)")
    add_prune_arguments(apply)
    apply.set_defaults(func=run_prune)

    tr = sub.add_parser("train", formatter_class=DEFAULTS,
                        help="gated fine-tuning with Hard Concrete gates and L0 (Voita et al. 2019, Sec. 6)")
    _add_data_options(tr)
    _add_train_options(tr)
    add_options(tr.add_mutually_exclusive_group(), PruneConfig, ("lam", "keep"))
    tr.add_argument("--out", required=True, help="output directory (train/, trajectory.jsonl, pruned/, result.json)")
    add_options(tr, PruneConfig().train, ("resume", "overwrite"))
    tr.set_defaults(func=run_train, **resumes_from_last("{out}/train"))

    sw = sub.add_parser("sweep", formatter_class=DEFAULTS,
                        help="gated fine-tuning for several lambdas or budgets; resumable; one table")
    _add_data_options(sw)
    _add_train_options(sw)
    sw.add_argument("--lams", help="comma list of lambdas, e.g. 0.01,0.02,0.05,0.1")
    sw.add_argument("--keeps", help="comma list of head budgets, e.g. 12,24")
    sw.add_argument("--no-reference", action="store_true", help="do not evaluate the unpruned model")
    sw.add_argument("--out", required=True, help="sweep directory (one sub-directory per point, sweep.md/csv/json)")
    sw.set_defaults(func=run_sweep_command, interrupted="the finished points and the current point's last "
                                                        "checkpoint are kept in {out}; the same command resumes",
                    interrupted_if=("{out}/*/train/last", "{out}/*/train/.last.old-*/last", "{out}/*/result.json"))

    bl = sub.add_parser("baseline", help="random / Michel / score-ranked pruning at equal head counts", formatter_class=DEFAULTS)
    _add_data_options(bl)
    bl.add_argument("--method", required=True, choices=("random", "michel", "scores"))
    bl.add_argument("--scores", help="HeadScores JSON (confidence, LRP, ...) for --method scores")
    bl.add_argument("--keeps", required=True, help="comma list of head counts to keep")
    bl.add_argument("--kinds", default="auto",
                    help="kinds to prune: auto (enc_self on a model with an encoder, dec_self on a decoder-only "
                         "model), all, or a comma list")
    bl.add_argument("--seeds", default="1,2,3", help="seeds of --method random")
    add_options(bl, BaselineConfig, ("finetune_steps", "freeze_decoder", "from_scratch", "scratch_epochs",
                                     "scratch_lr", "scratch_warmup_steps", "scratch_average_last", "lr", "max_tokens",
                                     "mixed_precision", "eval_beam", "importance_batches"))
    bl.add_argument("--dev-src", help="development source file for the curve of --dev-every (not the evaluation set)")
    bl.add_argument("--dev-tgt", help="development reference file")
    add_options(bl, BaselineConfig, ("dev_every", "dev_sentences"))
    bl.add_argument("--no-progress", action="store_true", help="no progress bar")
    bl.add_argument("--out", required=True, help="directory for baselines.json / baselines.md")
    bl.set_defaults(func=run_baseline, interrupted="the finished rows of {out}/baselines.json and the running "
                                                   "training's last checkpoint are kept; the same command resumes",
                    interrupted_if=("{out}/baselines.json", "{out}/*/last", "{out}/*/last.old"))

    rp = sub.add_parser("report", help="Fig. 7 (BLEU vs retained heads, with baselines), Fig. 9 and Table 2",
                        formatter_class=DEFAULTS)
    rp.add_argument("sweeps", nargs="+", help="sweep directories")
    rp.add_argument("--baselines", nargs="*", default=[], help="baseline directories (baselines.json)")
    rp.add_argument("--out", required=True, help="directory for the figures (PNG) and tables (Markdown)")
    rp.set_defaults(func=run_report)


# ----------------------------------------------------------------------------- helpers


def _log():
    """Progress to stderr (stdout carries the result), from the main process only."""
    from accelerate import PartialState

    main = PartialState().is_main_process

    def log(message: str) -> None:
        if main:
            print(message, file=sys.stderr, flush=True)

    return log


def _check_inputs(args, needs_training: str | None = "gated fine-tuning trains on it") -> None:
    """Before any model is loaded (docs/cli.md, exit 2): the data files readable and not empty,
    the model and tokenizer directories there, the options in range, ``--out`` writable.
    ``needs_training``: why training data is needed (None: it is not, as for a baseline that
    neither estimates importance nor trains)."""
    from headlab import preflight

    if (args.train_src is None) != (args.train_tgt is None):
        raise HeadlabError("give both --train-src and --train-tgt, or neither")
    if args.train_text and args.train_src:  # one would be read, the other silently not
        raise HeadlabError("give --train-text (language model) or --train-src/--train-tgt (translation), not both")
    if not args.train_text and not args.train_src:
        if needs_training:
            raise HeadlabError("give --train-src and --train-tgt (translation) or --train-text (language model): "
                               + needs_training)
        if args.limit is not None:
            raise HeadlabError("--limit N counts training sentences: it needs --train-src/--train-tgt or --train-text")
    if (args.valid_src is None) != (args.valid_tgt is None):
        raise HeadlabError("give both --valid-src and --valid-tgt, or neither")
    for flag in ("--train-text", "--train-src", "--train-tgt", "--valid-src", "--valid-tgt", "--dev-src", "--dev-tgt"):
        path = getattr(args, flag[2:].replace("-", "_"), None)
        if path is not None:
            preflight.input_file(path, flag)
    _check_dev(args)
    preflight.model_dir(args.model)
    from headlab.loading import check_supported

    check_supported(args.model, getattr(args, "trust_remote_code", False), prune=True)
    if args.tokenizer is not None:
        preflight.model_dir(args.tokenizer, "--tokenizer")
    for name in ("limit", "eval_limit", "max_sentence_tokens", "threads"):
        preflight.at_least(getattr(args, name), 1, "--" + name.replace("_", "-"))
    preflight.output_dir(args.out)


def _check_dev(args) -> None:
    """The development curve: both files and --dev-every, and not the evaluation set."""
    dev_src, dev_tgt = getattr(args, "dev_src", None), getattr(args, "dev_tgt", None)
    every = getattr(args, "dev_every", 0) or 0
    if (dev_src is None) != (dev_tgt is None):
        raise HeadlabError("give both --dev-src and --dev-tgt, or neither")
    if every < 0:
        raise HeadlabError(f"--dev-every must be >= 0, got {every}")
    if (dev_src is not None) != (every > 0):
        raise HeadlabError("--dev-src/--dev-tgt and --dev-every N go together (the curve needs both)")
    if dev_src is not None and args.valid_src is not None and Path(dev_src).resolve() == Path(args.valid_src).resolve():
        raise HeadlabError(f"--dev-src {dev_src} is the evaluation set (--valid-src): the development curve decides how "
                           "long to fine-tune, so it must use other sentences (e.g. the validation split)")
    if getattr(args, "dev_sentences", None) is not None and args.dev_sentences < 1:
        raise HeadlabError(f"--dev-sentences must be >= 1, got {args.dev_sentences}")


def _dev_data(args):
    """The development set of --dev-src/--dev-tgt (its first --dev-sentences pairs), or None."""
    from headlab.data import read_parallel

    if getattr(args, "dev_src", None) is None:
        return None
    data = read_parallel(args.dev_src, args.dev_tgt)
    return data.subset(args.dev_sentences) if args.dev_sentences else data


def _load(args):
    from headlab.loading import check_given_tokenizer, check_tokenizer_fits, load_model, load_tokenizer

    trust = args.trust_remote_code
    tokenizer = load_tokenizer(args.tokenizer or args.model, trust_remote_code=trust)  # first: before the weights
    # as the analyses do, before any work: another model's --tokenizer (ids beyond the embeddings failed in the
    # first batch, an IndexError; another vocabulary of the same size computed on other tokens), a TAPAS one
    check_given_tokenizer(tokenizer, args.tokenizer, args.model, args.model, trust)
    model = load_model(args.model, trust_remote_code=trust)
    check_tokenizer_fits(tokenizer, model, args.model)  # the embeddings' rows themselves
    return model, tokenizer


def _data(args, tokenizer, model):
    from headlab.data import read_lines, read_parallel
    from headlab.data.parallel import first_sentences
    from headlab.model_description import model_max_length
    from headlab.pruning.train import encode_monolingual_corpus

    if args.train_text:
        lines = read_lines(args.train_text)
        lines = lines[: first_sentences(lines, args.limit)]  # --limit N: N sentences, blank lines not counted
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        train_data: Any = encode_monolingual_corpus(tokenizer, lines, model_max_length(model, tokenizer))
    elif args.train_src and args.train_tgt:
        train_data = read_parallel(args.train_src, args.train_tgt, max_tokens=args.max_sentence_tokens)
        if args.limit:
            train_data = train_data.subset(args.limit)
    else:  # a baseline that neither estimates importance nor trains (_check_inputs refused the others)
        train_data = None
    eval_data = None
    if args.valid_src:
        eval_data = read_parallel(args.valid_src, args.valid_tgt)
        if args.eval_limit:
            eval_data = eval_data.subset(args.eval_limit)
    return train_data, eval_data


def _config(args) -> PruneConfig:
    """The config of ``prune train`` and ``prune sweep``, made and checked before anything heavy loads."""
    from headlab.pruning.train import named_kinds

    named_kinds(args.gates)  # an empty list (--gates ,) or an unknown kind: exit 2 before the model loads
    keep = getattr(args, "keep", None)
    config = from_args(
        args, PruneConfig, keep=keep, lam=0.0 if keep is not None else (getattr(args, "lam", 0.0) or 0.0),
        freeze_decoder={"auto": None, "yes": True, "no": False}[args.freeze_decoder],
        command="headlab " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:] else "",
        train=from_args(args, PruneConfig().train, out_dir=args.out, progress=not args.no_progress),
    )
    _check_inputs(args)
    config.model_fingerprint = weights_fingerprint(args.model) or ""
    set_threads(args.threads)
    return config


# ----------------------------------------------------------------------------- commands


def run_train(args) -> int:
    from headlab.lock import training_lock
    from headlab.pruning.train import prune_train

    if args.lam is not None and args.lam < 0:
        raise HeadlabError(f"--lam must be >= 0, got {args.lam}")
    config = _config(args)
    with training_lock(args.out):  # a second run on the same directory refuses (main process only)
        model, tokenizer = _load(args)
        train_data, eval_data = _data(args, tokenizer, model)
        result = prune_train(model, tokenizer, train_data, eval_data, config, dev_data=_dev_data(args), log=_log())
    if result.stopped == "diverged":
        print(f"headlab prune train: {result.message}", file=sys.stderr)
        return 1
    metrics = result.metrics
    summary = {k: metrics[k] for k in ("bleu", "chrf", "loss", "parameters_before", "parameters_after") if k in metrics}
    print(json.dumps({"heads_kept": result.heads_kept, "heads_total": result.heads_total, **summary,
                      "pruned": result.pruned_dir}, indent=1))
    return 0


def _check_budgets(model, config, points: list[dict]) -> None:
    """Each budget of a sweep against the gated heads, before the full model is evaluated (a
    point refused its budget only when it started)."""
    from headlab.pruning.hard_concrete import gate_count
    from headlab.pruning.train import resolve_kinds

    kinds = resolve_kinds(model, config.gates)
    gated = gate_count(model, kinds)  # a head of weights shared by several depths once, as its gate
    for point in points:
        if point["keep"] is not None and point["keep"] > gated:
            raise HeadlabError(f"--keeps {point['keep']} is larger than the {counted(gated, 'gated head')} ({', '.join(kinds)})")


def run_sweep_command(args) -> int:
    from headlab.lock import training_lock
    from headlab.pruning.sweep import run_sweep, sweep_points

    points = sweep_points(numbers(args.lams, float, "--lams") if args.lams is not None else (),
                          numbers(args.keeps, flag="--keeps") if args.keeps is not None else ())
    args.lam, args.keep = 0.0, None
    config = _config(args)
    with training_lock(args.out):  # a second sweep on the same directory refuses (main process only)
        model, tokenizer = _load(args)
        _check_budgets(model, config, points)
        train_data, eval_data = _data(args, tokenizer, model)
        del model
        rows = run_sweep(lambda: _load(args), train_data, eval_data, config, points, args.out,
                         reference=not args.no_reference, dev_data=_dev_data(args), log=_log())
    print((Path(args.out) / "sweep.md").read_text(), end="")
    return 1 if any(row.get("status") == "diverged" for row in rows) else 0


def run_baseline(args) -> int:
    from headlab import preflight
    from headlab.heads import KINDS, HeadScores
    from headlab.lock import locked_output
    from headlab.pruning.baselines import read_rows, run_baselines
    from headlab.pruning.train import heads_per_kind, resolve_kinds

    keeps = numbers(args.keeps, flag="--keeps")
    if not keeps or min(keeps) < 0:
        raise HeadlabError(f"--keeps {args.keeps}: give one or more head counts >= 0")
    seeds = numbers(args.seeds, flag="--seeds") if args.method == "random" else (None,)
    if not seeds:
        raise HeadlabError("--seeds is empty: give one or more seeds for --method random")
    named = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if args.kinds not in ("all", "auto") and (not named or any(k not in KINDS for k in named)):
        raise HeadlabError(f"--kinds {args.kinds}: expected auto, all or a comma list of {', '.join(KINDS)}")
    if args.method == "scores" and not args.scores:
        raise HeadlabError("--method scores needs --scores FILE (a HeadScores JSON)")
    if args.valid_src is None and args.valid_tgt is None:
        raise HeadlabError("baselines need --valid-src and --valid-tgt to evaluate on")
    _check_inputs(args, _training_use(args))
    scores = None
    if args.scores:
        preflight.input_file(args.scores, "--scores")
        try:
            scores = HeadScores.load(args.scores)
        except HeadlabError as error:
            raise HeadlabError(f"--scores {error}") from None
    _check_baseline_recipe(args)
    if scores is not None and (other := _scores_of_other_weights(scores, args.model)):
        print(f"headlab prune baseline: note: --scores {args.scores} {other}", file=sys.stderr)
    out = Path(args.out)
    read_rows(out)  # a baselines.json that is not one refuses here, not after the first row
    set_threads(args.threads)
    with locked_output(out, "--out"):  # a second run on the same directory refuses
        model, tokenizer = _load(args)
        if not getattr(model.config, "is_encoder_decoder", False):
            # rows are scored by translating --valid-src: a decoder-only model's continuation would
            # be scored with its prompt (BLEU 100 with --valid-src = --valid-tgt), a classifier has none
            raise HeadlabError(f"prune baseline scores translations (BLEU of --valid-src against --valid-tgt): "
                               f"{args.model} ({type(model).__name__}) is not an encoder-decoder model")
        kinds = resolve_kinds(model, args.kinds)
        available = sum(n for kind, n in heads_per_kind(model).items() if kind in kinds)
        if max(keeps) > available:
            raise HeadlabError(f"--keeps {args.keeps}: the model has {counted(available, 'head')} of {', '.join(kinds)}")
        train_data, eval_data = _data(args, tokenizer, model)
        config = from_args(args, BaselineConfig, keeps=tuple(keeps), kinds=kinds, scores=scores, seeds=seeds,
                           model_fingerprint=weights_fingerprint(args.model) or "",
                           scores_fingerprint=scores.fingerprint() if scores is not None else "",
                           scores_file_fingerprint=file_fingerprint(args.scores) if args.scores else "")
        print(run_baselines(lambda: _load(args), train_data, eval_data, config, out, dev_data=_dev_data(args),
                            log=_log(), progress=not args.no_progress), end="")
    return 0


def _scores_of_other_weights(scores, model: str) -> str | None:
    """What to say when a score table names another model than ``model`` (the rows prune by another model's ranking;
    a pruned copy's scores included): :func:`headlab.resume.other_model_note`; None when it is the same model."""
    return other_model_note(scores.model, model, "the rows prune this model by that model's ranking of its heads")


def _training_use(args) -> str | None:
    """What a baseline reads its training data for (None: nothing; random and score-ranked rows
    without fine-tuning only remove heads and evaluate)."""
    if args.from_scratch:
        return "--from-scratch trains on it"
    if args.finetune_steps:
        return "--finetune-steps fine-tunes on it"
    if args.method == "michel":
        return "--method michel estimates head importance on it"
    return None


def _check_baseline_recipe(args) -> None:
    """Options of one training recipe that do nothing for the other are refused, not ignored."""
    if args.dev_every and (args.from_scratch or not args.finetune_steps):
        raise HeadlabError("--dev-every N: the development curve is of the fine-tuning of --finetune-steps N > 0")
    if args.freeze_decoder and (args.from_scratch or not args.finetune_steps):
        raise HeadlabError("--freeze-decoder freezes the decoder during the fine-tuning of --finetune-steps N > 0; "
                           "it does not apply to " + ("--from-scratch" if args.from_scratch else "rows without fine-tuning"))
    if not args.from_scratch:
        given = [flag for flag, name in (("--scratch-lr", "scratch_lr"), ("--scratch-warmup-steps", "scratch_warmup_steps"),
                                         ("--scratch-average-last", "scratch_average_last"))
                 if getattr(args, name) != BaselineConfig.__dataclass_fields__[name].default]
        if given:
            raise HeadlabError(f"{', '.join(given)} set the recipe of --from-scratch; add --from-scratch or drop them")
    elif args.scratch_average_last > args.scratch_epochs:
        raise HeadlabError(f"--scratch-average-last {args.scratch_average_last}: a run of --scratch-epochs "
                           f"{args.scratch_epochs} has only {counted(args.scratch_epochs, 'epoch checkpoint')}")


def run_report(args) -> int:
    from headlab.pruning.sweep import write_report

    for path in write_report(args.sweeps, args.baselines, args.out):
        print(path)
    return 0
