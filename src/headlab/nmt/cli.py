"""`headlab nmt ...` subcommands: thin wrappers over headlab.nmt (parse, call, print)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from headlab.device_options import add_device_options, device_options, set_threads
from headlab.errors import HeadlabError, counted
from headlab.nmt.config import ModelConfig, TrainRecipe
from headlab.options import HelpFormatter, add_options, from_args, model_flag_to_positional
from headlab.training.config import TrainConfig

# The training loop's options that `nmt train` and `lm train` share.
TRAIN_OPTIONS = ("out_dir", "max_tokens", "lr", "warmup_steps", "label_smoothing", "mixed_precision", "clip_norm",
                 "max_epochs", "patience", "patience_metric", "min_improvement", "max_steps", "max_time_minutes",
                 "save_every_steps", "seed")


def resumes_from_last(out: str = "{out}") -> dict:
    """``set_defaults`` of a command that runs the training loop into ``out`` (a format string over the
    arguments, as cli.py reads them): the note after an interrupt, given where the loop's checkpoint is
    (last, last.old, or a copy atomic_dir moved aside: training.loop._resume_dir)."""
    return dict(interrupted=f"the last checkpoint in {out} is kept; add --resume to the same command to continue "
                            "from it",
                interrupted_if=(f"{out}/last", f"{out}/last.old", f"{out}/.last.old-*/last"))


def register(subparsers) -> None:
    nmt = subparsers.add_parser("nmt", help="train, translate with and score translation models")
    commands = nmt.add_subparsers(dest="nmt_command", metavar="NMT_COMMAND")
    commands.required = True

    p = commands.add_parser("train", help="train a Transformer (MarianMTModel) on parallel text",
                            formatter_class=HelpFormatter)
    add_options(p, TrainRecipe, ("train_src", "train_tgt", "valid_src", "valid_tgt", "tokenizer", "vocab_size",
                                 "max_sentence_tokens", "limit"))
    add_options(p, ModelConfig, ("d_model", "ffn_dim"))
    p.add_argument("--layers", type=int, default=ModelConfig.encoder_layers, help="encoder and decoder layers")
    add_options(p, ModelConfig, ("n_heads", "dropout", "attention_dropout", "max_positions"))
    add_options(p, TrainConfig, TRAIN_OPTIONS + ("valid_beam", "average_last", "resume", "overwrite"))
    p.add_argument("--threads", help="torch CPU threads per process, or 'auto': measure 1 and all cores "
                   "while training and keep the faster (useful on a shared CPU)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_train, **resumes_from_last())

    p = commands.add_parser("translate", help="translate a file, one output line per input line",
                            formatter_class=HelpFormatter)
    _add_translation_options(p)
    p.add_argument("--input", default="-", help="source file (plain or .gz); - for stdin")
    p.add_argument("--output", default="-", help="output file; - for stdout")
    p.set_defaults(func=_translate)

    p = commands.add_parser("bleu", help="BLEU and chrF (sacreBLEU) of detokenized output against references")
    p.add_argument("--hyp", required=True, help="system output, one sentence per line")
    p.add_argument("--ref", required=True, help="references (plain or .gz)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_bleu)

    p = commands.add_parser("evaluate", help="translate a test set and score it (translate + bleu)",
                            formatter_class=HelpFormatter)
    _add_translation_options(p)
    p.add_argument("--src", required=True, help="test source file")
    p.add_argument("--ref", required=True, help="test reference file")
    p.add_argument("--output", help="also write the translations here")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_evaluate)

    add_export_command(commands, "nmt", "best, averaged, averaged-lastN, last or epoch-N", "float32")

    p = commands.add_parser("average", help="average the last N epoch checkpoints of a run (after a time limit)")
    p.add_argument("--run", required=True, help="training output directory (--out of nmt train)")
    p.add_argument("--last", type=int, required=True, help="how many of the last epoch checkpoints")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=_average)


def _train(args) -> int:
    from headlab import preflight
    from headlab.lock import training_lock
    from headlab.nmt.recipe import run_recipe

    if (args.valid_src is None) != (args.valid_tgt is None):
        raise HeadlabError("give both --valid-src and --valid-tgt, or neither")
    for flag in ("--train-src", "--train-tgt", "--valid-src", "--valid-tgt"):
        path = getattr(args, flag[2:].replace("-", "_"))
        if path is not None:
            preflight.input_file(path, flag)
    if args.valid_src is not None:  # small: checked before the training data are read and encoded
        from headlab.data.parallel import read_parallel

        try:
            read_parallel(args.valid_src, args.valid_tgt)
        except HeadlabError as error:
            raise HeadlabError(f"--valid-src/--valid-tgt: {error}") from None
    preflight.output_dir(args.out)
    hooks = {}
    if args.threads == "auto":

        from headlab.nmt.threads import AdaptiveThreads

        hooks = {"callback": AdaptiveThreads(log=lambda text: print(text, file=sys.stderr, flush=True)),
                 "callback_every": 1}
    elif args.threads is not None:
        try:
            set_threads(int(args.threads))
        except ValueError:
            raise HeadlabError(f"--threads must be a number or 'auto', got {args.threads!r}") from None
    layers = {"encoder_layers": args.layers, "decoder_layers": args.layers}
    recipe = from_args(args, TrainRecipe, model=from_args(args, ModelConfig, **layers),
                       train=from_args(args, TrainConfig, progress=not args.no_progress))
    check_shape(recipe)  # before the data are read and a vocabulary trained
    with training_lock(args.out):  # a second run on the same directory refuses
        result = run_recipe(recipe, **hooks)
    if result.stopped == "diverged":
        print(f"headlab nmt train: {result.message}", file=sys.stderr)
        return 1
    return 0


def check_shape(recipe) -> None:
    """The model's shape and the vocabulary's size of a training recipe (``nmt train``, ``lm train``),
    checked before its data are read and a vocabulary trained."""
    from headlab.nmt.tokenizer import SPECIAL_TOKENS

    if recipe.model.d_model % recipe.model.n_heads:
        raise HeadlabError(f"--d-model {recipe.model.d_model} is not divisible by --heads {recipe.model.n_heads}")
    if recipe.tokenizer is None and recipe.vocab_size < len(SPECIAL_TOKENS) + 10:
        raise HeadlabError(f"--vocab-size {recipe.vocab_size} is too small (at least {len(SPECIAL_TOKENS) + 10})")


def rewrite_argv(argv: list[str]) -> list[str]:
    """``nmt translate --model DIR ...`` (the older form) -> ``nmt translate DIR ...``; evaluate alike."""
    for command in ("translate", "evaluate"):
        argv = model_flag_to_positional(argv, ("nmt", command))
    return argv


def _add_translation_options(p) -> None:
    p.add_argument("model", help="model directory (config, safetensors, tokenizer); --model DIR, the older form, "
                                 "works too")
    p.add_argument("--beam", type=int, default=4, help="beam size (1: greedy)")
    p.add_argument("--batch-size", type=int, default=64, help="sentences per batch")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    add_device_options(p)


def _read_input(path: str) -> list[str]:
    from headlab.data import read_lines
    from headlab.data.parallel import stdin_lines

    if path == "-":
        return stdin_lines()
    return read_lines(path)


def _write_output(path: str, lines: list[str]) -> None:
    from headlab.heads import atomic_write_text

    text = "".join(line.replace("\n", " ") + "\n" for line in lines)
    if path == "-":
        sys.stdout.write(text)
    else:
        atomic_write_text(Path(path), text)  # never a half-written file


def _check_translation_options(args) -> None:
    """Everything that can be checked before the model is loaded (exit 2, docs/cli.md)."""
    from headlab import preflight

    preflight.at_least(args.beam, 1, "--beam")
    preflight.at_least(args.batch_size, 1, "--batch-size")
    preflight.at_least(args.threads, 1, "--threads")
    preflight.model_dir(args.model)
    if args.output not in (None, "-"):
        inputs = {flag: getattr(args, flag[2:]) for flag in ("--input", "--src", "--ref")
                  if getattr(args, flag[2:], None) not in (None, "-")}
        preflight.output_file(args.output, "--output", inputs)
    device_options(args)  # a GPU that is not there: before any work


def _load(model_dir: str, args=None):
    from headlab.loading import check_tokenizer_fits
    from headlab.nmt.model import load_translation_model
    from headlab.nmt.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)  # first: a directory without one fails before the weights load
    placement = device_options(args) if args is not None else {}
    model = load_translation_model(model_dir, **placement)
    check_tokenizer_fits(tokenizer, model, model_dir)  # another model's: an IndexError in the first batch
    return model, tokenizer


def _translate_lines(args, command: str, sentences: list[str], progress: bool = False) -> tuple[list[str], float]:
    """``sentences`` translated by ``--model``, and the seconds it took; inputs cut to the
    model's limit are reported on stderr."""
    from headlab.nmt.translate import source_limit, translate

    set_threads(args.threads)
    model, tokenizer = _load(args.model, args)
    start = time.time()
    truncated: list[int] = []
    outputs = translate(model, tokenizer, sentences, beam=args.beam, batch_size=args.batch_size, progress=progress,
                        truncated=truncated)
    seconds = time.time() - start
    if truncated:
        limit = source_limit(model, tokenizer)
        lines = ", ".join(str(i + 1) for i in sorted(truncated)[:10]) + (", ..." if len(truncated) > 10 else "")
        one = len(truncated) == 1
        print(f"headlab nmt {command}: {len(truncated)} of {counted(len(sentences), 'input')} "
              f"{'is' if one else 'are'} longer than {counted(limit, 'token')} and {'was' if one else 'were'} cut "
              f"to {limit} ({'line' if one else 'lines'} {lines}); only {'its' if one else 'their'} first "
              f"{counted(limit, 'token')} {'is' if limit == 1 else 'are'} translated", file=sys.stderr)
    return outputs, seconds


def _translate(args) -> int:
    from headlab import preflight

    _check_translation_options(args)
    if args.input != "-":
        preflight.input_file(args.input, "--input")
    sentences = _read_input(args.input)
    if args.input == "-" and not any(line.strip() for line in sentences):  # as an empty --input file (docs/cli.md)
        raise HeadlabError("--input -: standard input is empty")
    outputs, seconds = _translate_lines(args, "translate", sentences, progress=sys.stderr.isatty())
    _write_output(args.output, outputs)
    print(f"translated {counted(len(sentences), 'line')} in {seconds:.1f} s (beam {args.beam})", file=sys.stderr)
    return 0


def _bleu(args) -> int:
    from headlab import preflight
    from headlab.data import read_lines
    from headlab.nmt.bleu import compute_scores

    preflight.input_file(args.hyp, "--hyp")
    preflight.input_file(args.ref, "--ref")
    scores = compute_scores(read_lines(args.hyp), read_lines(args.ref))
    print(json.dumps(scores.to_dict(), indent=2) if args.json else scores.format())
    return 0


def _evaluate(args) -> int:
    from headlab import preflight
    from headlab.data import read_lines
    from headlab.nmt.bleu import compute_scores

    _check_translation_options(args)
    preflight.input_file(args.src, "--src")
    preflight.input_file(args.ref, "--ref")
    sources, references = read_lines(args.src), read_lines(args.ref)
    if len(sources) != len(references):
        raise HeadlabError(f"--src {args.src} has {counted(len(sources), 'line')}, --ref {args.ref} has "
                           f"{counted(len(references), 'line')}: "
                           "they must match line for line")
    outputs, seconds = _translate_lines(args, "evaluate", sources)
    if args.output:
        _write_output(args.output, outputs)
    scores = compute_scores(outputs, references)
    if args.json:
        print(json.dumps({**scores.to_dict(), "beam": args.beam, "seconds": seconds}, indent=2))
    else:
        print(f"{scores.format()}\n(beam {args.beam}, {counted(len(sources), 'sentence')} in {seconds:.1f} s)")
    return 0


def _average(args) -> int:
    from headlab import preflight
    from headlab.nmt.export import average_last_epochs

    preflight.at_least(args.last, 1, "--last")
    out = average_last_epochs(args.run, args.last, overwrite=args.overwrite)
    print(f"averaged the last {counted(args.last, 'epoch')} of {args.run} into {out} (export it with --checkpoint {out.name})")
    return 0


def add_export_command(commands, trainer: str, checkpoints: str, dtype: str) -> None:
    """``headlab nmt export`` and ``headlab lm export``: one checkpoint of a run as a model directory."""
    p = commands.add_parser("export", help="copy one checkpoint of a training run into a model directory",
                            formatter_class=HelpFormatter)
    p.add_argument("--run", required=True, help=f"training output directory (--out of {trainer} train)")
    p.add_argument("--to", required=True, help="model directory to write")
    p.add_argument("--checkpoint", default="best", help=checkpoints)
    p.add_argument("--dtype", default=dtype, choices=["float32", "float16", "bfloat16"],
                   help="the exported weights' dtype")  # lm and nmt differ: say the default
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=_export)


def _export(args) -> int:
    from headlab.nmt.export import export_model

    out = export_model(args.run, args.to, which=args.checkpoint, dtype=args.dtype, overwrite=args.overwrite)
    print(f"exported {args.checkpoint} of {args.run} to {out} ({args.dtype})")
    return 0
