"""`headlab nmt ...` subcommands: thin wrappers over headlab.nmt (parse, call, print)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from headlab.device_options import add_device_options, device_options
from headlab.errors import HeadlabError


def register(subparsers) -> None:
    nmt = subparsers.add_parser("nmt", help="train, translate with and score translation models")
    commands = nmt.add_subparsers(dest="nmt_command", metavar="NMT_COMMAND")
    commands.required = True

    p = commands.add_parser("train", help="train a Transformer (MarianMTModel) on parallel text",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--train-src", required=True, help="training source file (plain or .gz)")
    p.add_argument("--train-tgt", required=True, help="training target file")
    p.add_argument("--valid-src", help="validation source file (BLEU after each epoch)")
    p.add_argument("--valid-tgt", help="validation target file")
    p.add_argument("--out", required=True, help="output directory (checkpoints, best/, tokenizer/)")
    p.add_argument("--tokenizer", help="use this saved tokenizer instead of training one")
    p.add_argument("--vocab-size", type=int, default=8000, help="joint BPE vocabulary size")
    p.add_argument("--max-sentence-tokens", type=int, default=100,
                   help="cut longer training sentences to this many whitespace tokens")
    p.add_argument("--limit", type=int, help="use only the first N training pairs")
    p.add_argument("--d-model", type=int, default=256, help="model width (paper's base: 512)")
    p.add_argument("--ffn", type=int, default=1024, help="feed-forward width (paper's base: 2048)")
    p.add_argument("--layers", type=int, default=6, help="encoder and decoder layers")
    p.add_argument("--heads", type=int, default=8, help="attention heads per block")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--attention-dropout", type=float, default=0.1)
    p.add_argument("--max-positions", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=4096, help="target tokens per batch and process")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--warmup-steps", type=int, default=400)
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--mixed-precision", choices=["no", "bf16"], default="no",
                   help="bf16 autocast (about 1.7x faster on CPUs with AVX512-BF16/AMX; weights stay fp32)")
    p.add_argument("--clip-norm", type=float, default=1.0, help="0 turns clipping off")
    p.add_argument("--epochs", type=int, default=12, help="maximum number of epochs")
    p.add_argument("--patience", type=int, default=0,
                   help="stop after this many epochs without a validation BLEU gain of --min-improvement (0: off)")
    p.add_argument("--min-improvement", type=float, default=0.0, help="smallest BLEU gain that counts as progress")
    p.add_argument("--max-steps", type=int, help="stop after this many updates")
    p.add_argument("--max-time", type=float, help="stop (with a resumable checkpoint) after this many minutes")
    p.add_argument("--save-every", type=int, help="also write a resume checkpoint every N steps")
    p.add_argument("--valid-beam", type=int, default=1, help="beam for validation BLEU (1: greedy)")
    p.add_argument("--average-last", type=int, default=0, help="average the last N epoch checkpoints at the end")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", help="torch CPU threads per process, or 'auto': measure 1 and all cores "
                   "while training and keep the faster (useful on a shared CPU)")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    p.add_argument("--overwrite", action="store_true", help="replace a model already in --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_train, interrupted="the last checkpoint in {out} is kept; add --resume to the same "
                                            "command to continue from it")

    p = commands.add_parser("translate", help="translate a file, one output line per input line",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, help="model directory (config, safetensors, tokenizer)")
    p.add_argument("--input", default="-", help="source file (plain or .gz); - for stdin")
    p.add_argument("--output", default="-", help="output file; - for stdout")
    p.add_argument("--beam", type=int, default=4, help="beam size (1: greedy)")
    p.add_argument("--batch-size", type=int, default=64, help="sentences per batch")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    add_device_options(p)
    p.set_defaults(func=_translate)

    p = commands.add_parser("bleu", help="BLEU and chrF (sacreBLEU) of detokenized output against references")
    p.add_argument("--hyp", required=True, help="system output, one sentence per line")
    p.add_argument("--ref", required=True, help="references (plain or .gz)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_bleu)

    p = commands.add_parser("evaluate", help="translate a test set and score it (translate + bleu)",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--src", required=True, help="test source file")
    p.add_argument("--ref", required=True, help="test reference file")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--threads", type=int)
    p.add_argument("--output", help="also write the translations here")
    p.add_argument("--json", action="store_true", help="print JSON")
    add_device_options(p)
    p.set_defaults(func=_evaluate)

    p = commands.add_parser("export", help="copy one checkpoint of a training run into a model directory",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--run", required=True, help="training output directory (--out of nmt train)")
    p.add_argument("--to", required=True, help="model directory to write")
    p.add_argument("--checkpoint", default="best", help="best, averaged, averaged-lastN, last or epoch-N")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=_export)

    p = commands.add_parser("average", help="average the last N epoch checkpoints of a run (after a time limit)")
    p.add_argument("--run", required=True, help="training output directory (--out of nmt train)")
    p.add_argument("--last", type=int, required=True, help="how many of the last epoch checkpoints")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=_average)


def _set_threads(threads: int | None) -> None:
    if threads:
        import torch

        torch.set_num_threads(threads)


def _train(args) -> int:
    from headlab import preflight
    from headlab.lock import training_lock
    from headlab.nmt.model import ModelConfig
    from headlab.nmt.recipe import TrainRecipe, run_recipe
    from headlab.nmt.train import TrainConfig

    if (args.valid_src is None) != (args.valid_tgt is None):
        raise HeadlabError("give both --valid-src and --valid-tgt, or neither")
    for flag in ("--train-src", "--train-tgt", "--valid-src", "--valid-tgt"):
        path = getattr(args, flag[2:].replace("-", "_"))
        if path is not None:
            preflight.input_file(path, flag)
    preflight.output_dir(args.out)
    hooks = {}
    if args.threads == "auto":

        from headlab.nmt.threads import AdaptiveThreads

        hooks = {"callback": AdaptiveThreads(log=lambda text: print(text, file=sys.stderr, flush=True)),
                 "callback_every": 1}
    elif args.threads is not None:
        try:
            _set_threads(int(args.threads))
        except ValueError:
            raise HeadlabError(f"--threads must be a number or 'auto', got {args.threads!r}") from None
    recipe = TrainRecipe(
        train_src=args.train_src, train_tgt=args.train_tgt, valid_src=args.valid_src, valid_tgt=args.valid_tgt,
        tokenizer=args.tokenizer, vocab_size=args.vocab_size, max_sentence_tokens=args.max_sentence_tokens,
        limit=args.limit,
        model=ModelConfig(d_model=args.d_model, ffn_dim=args.ffn, encoder_layers=args.layers,
                          decoder_layers=args.layers, n_heads=args.heads, dropout=args.dropout,
                          attention_dropout=args.attention_dropout, max_positions=args.max_positions),
        train=TrainConfig(out_dir=args.out, max_tokens=args.max_tokens, lr=args.lr, warmup_steps=args.warmup_steps,
                          label_smoothing=args.label_smoothing,
                          mixed_precision=args.mixed_precision, clip_norm=args.clip_norm, max_epochs=args.epochs,
                          patience=args.patience, min_improvement=args.min_improvement,
                          max_steps=args.max_steps, max_time_minutes=args.max_time, save_every_steps=args.save_every,
                          valid_beam=args.valid_beam, average_last=args.average_last, seed=args.seed,
                          resume=args.resume, overwrite=args.overwrite, progress=not args.no_progress),
    )
    with training_lock(args.out):  # a second run on the same directory refuses
        result = run_recipe(recipe, **hooks)
    if result.stopped == "diverged":
        print(f"headlab nmt train: {result.message}", file=sys.stderr)
        return 1
    return 0


def _read_input(path: str) -> list[str]:
    from headlab.data import read_lines

    if path == "-":
        return [line.rstrip("\r\n") for line in sys.stdin]
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
    preflight.model_dir(args.model, "--model")
    if args.output not in (None, "-"):
        preflight.output_file(args.output, "--output")
    device_options(args)  # a GPU that is not there: before any work


def _load(model_dir: str, args=None):
    from headlab.nmt.model import load_model
    from headlab.nmt.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_dir)  # first: a directory without one fails before the weights load
    placement = device_options(args) if args is not None else {}
    return load_model(model_dir, **placement), tokenizer


def _report_truncated(command: str, truncated: list[int], n: int, limit: int) -> None:
    if truncated:
        lines = ", ".join(str(i + 1) for i in sorted(truncated)[:10]) + (", ..." if len(truncated) > 10 else "")
        print(f"headlab nmt {command}: {len(truncated)} of {n} inputs are longer than {limit} tokens and were cut "
              f"to {limit} (lines {lines}); only their first {limit} tokens are translated", file=sys.stderr)


def _translate(args) -> int:
    from headlab import preflight
    from headlab.nmt.translate import source_limit, translate

    _check_translation_options(args)
    if args.input != "-":
        preflight.input_file(args.input, "--input")
    _set_threads(args.threads)
    sentences = _read_input(args.input)
    model, tokenizer = _load(args.model, args)
    start = time.time()
    truncated: list[int] = []
    outputs = translate(model, tokenizer, sentences, beam=args.beam, batch_size=args.batch_size,
                        progress=sys.stderr.isatty(), truncated=truncated)
    _write_output(args.output, outputs)
    _report_truncated("translate", truncated, len(sentences), source_limit(model, tokenizer))
    print(f"translated {len(sentences)} lines in {time.time() - start:.1f} s (beam {args.beam})", file=sys.stderr)
    return 0


def _bleu(args) -> int:
    from headlab.data import read_lines
    from headlab.nmt.bleu import compute_scores

    scores = compute_scores(read_lines(args.hyp), read_lines(args.ref))
    print(json.dumps(scores.to_dict(), indent=2) if args.json else scores.format())
    return 0


def _evaluate(args) -> int:
    from headlab import preflight
    from headlab.data import read_lines
    from headlab.nmt.bleu import compute_scores
    from headlab.nmt.translate import source_limit, translate

    _check_translation_options(args)
    preflight.input_file(args.src, "--src")
    preflight.input_file(args.ref, "--ref")
    sources, references = read_lines(args.src), read_lines(args.ref)
    if len(sources) != len(references):
        raise HeadlabError(f"--src {args.src} has {len(sources)} lines, --ref {args.ref} has {len(references)} lines: "
                           "they must match line for line")
    _set_threads(args.threads)
    model, tokenizer = _load(args.model, args)
    start = time.time()
    truncated: list[int] = []
    outputs = translate(model, tokenizer, sources, beam=args.beam, batch_size=args.batch_size, truncated=truncated)
    seconds = time.time() - start
    _report_truncated("evaluate", truncated, len(sources), source_limit(model, tokenizer))
    if args.output:
        _write_output(args.output, outputs)
    scores = compute_scores(outputs, references)
    if args.json:
        print(json.dumps({**scores.to_dict(), "beam": args.beam, "seconds": seconds}, indent=2))
    else:
        print(f"{scores.format()}\n(beam {args.beam}, {len(sources)} sentences in {seconds:.1f} s)")
    return 0


def _average(args) -> int:
    from headlab.nmt.export import average_last_epochs

    out = average_last_epochs(args.run, args.last, overwrite=args.overwrite)
    print(f"averaged the last {args.last} epochs of {args.run} into {out} (export it with --checkpoint {out.name})")
    return 0


def _export(args) -> int:
    from headlab.nmt.export import export_model

    out = export_model(args.run, args.to, which=args.checkpoint, dtype=args.dtype, overwrite=args.overwrite)
    print(f"exported {args.checkpoint} of {args.run} to {out}")
    return 0
