"""`headlab lm ...` subcommands: train and score decoder-only language models (thin wrappers)."""

from __future__ import annotations

import json
import sys
from dataclasses import fields
from typing import Any, cast

from headlab.device_options import add_device_options, device_options, set_threads
from headlab.errors import HeadlabError, counted
from headlab.lm.model import LMConfig, LMRecipe, lm_training
from headlab.nmt.cli import TRAIN_OPTIONS, add_export_command, check_shape, resumes_from_last
from headlab.options import HelpFormatter, add_options, from_args, model_flag_to_positional


def rewrite_argv(argv: list[str]) -> list[str]:
    """``lm evaluate --model DIR ...`` (the older form) -> ``lm evaluate DIR ...``."""
    return model_flag_to_positional(argv, ("lm", "evaluate"))


def register(subparsers) -> None:
    lm = subparsers.add_parser("lm", help="train and score decoder-only language models")
    commands = lm.add_subparsers(dest="lm_command", metavar="LM_COMMAND")
    commands.required = True

    p = commands.add_parser("train", help="train a causal language model (Llama-style or GPT-2) on English text",
                            formatter_class=HelpFormatter)
    add_options(p, LMRecipe, ("train_files", "valid_files", "tokenizer", "vocab_size"))
    add_options(p, LMConfig, [f.name for f in fields(LMConfig)])
    add_options(p, lm_training(), TRAIN_OPTIONS + ("resume", "overwrite"))
    p.add_argument("--threads", type=int, help="torch CPU threads per process")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_train, **resumes_from_last())

    p = commands.add_parser("evaluate", help="perplexity of a language model on text",
                            formatter_class=HelpFormatter)
    p.add_argument("model", help="model directory (config, safetensors, tokenizer); --model DIR, the older form, "
                                 "works too")
    p.add_argument("--text", nargs="+", required=True, metavar="FILE",
                   help="one sentence a line, or CoNLL-U (after MODEL: FILE ... takes what follows it)")
    p.add_argument("--max-tokens", type=int, default=4096, help="tokens per batch")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--json", action="store_true", help="print JSON")
    add_device_options(p)
    p.set_defaults(func=_evaluate)

    add_export_command(commands, "lm", "best, last or epoch-N", "float16")


def _train(args) -> int:
    from headlab import preflight
    from headlab.lm.train import run_lm_recipe
    from headlab.lock import training_lock

    set_threads(args.threads)
    if args.patience and not args.valid:
        raise HeadlabError("--patience needs --valid (early stopping watches the validation loss); "
                           "pass --patience 0 to train without validation")
    for flag, paths in (("--train", args.train), ("--valid", args.valid or [])):
        for path in paths:
            preflight.input_file(path, flag)
    preflight.output_dir(args.out)
    recipe = from_args(args, LMRecipe, model=from_args(args, LMConfig),
                       train=from_args(args, lm_training(), progress=not args.no_progress))
    check_shape(recipe)  # before the text is read and a vocabulary trained
    with training_lock(args.out):  # a second run on the same directory refuses
        result = run_lm_recipe(recipe)
    if result.stopped == "diverged":
        print(f"headlab lm train: {result.message}", file=sys.stderr)
        return 1
    return 0


def _evaluate(args) -> int:
    from headlab.lm.data import encode_lm_corpus, read_text_corpus
    from headlab.lm.train import json_perplexity, perplexity
    from headlab.loading import check_tokenizer_fits, load_model, load_tokenizer
    from headlab.preflight import at_least, input_file

    set_threads(args.threads)
    at_least(args.max_tokens, 1, "--max-tokens")  # 0 or less was taken, as one sentence a batch
    placement = device_options(args)  # a GPU that is not there fails before any work
    for path in args.text:
        input_file(path, "--text")  # missing, a directory, empty, not UTF-8: named as lm train names --train
    text = read_text_corpus(args.text)  # read before loading: a bad file fails fast
    tokenizer = load_tokenizer(args.model)  # first: a directory without one is refused before the weights load
    if tokenizer.bos_token_id is None:  # before the weights load too (a translation model's directory, say)
        raise HeadlabError(f"{args.model}: the tokenizer has no BOS token (not a headlab language model)")
    model = load_model(args.model, **{**placement, "dtype": placement["dtype"] or "float32"})
    check_tokenizer_fits(tokenizer, model, args.model)  # another model's: an IndexError in the first batch
    positions = cast(Any, model.config).max_position_embeddings
    corpus = encode_lm_corpus(tokenizer, text.sentences, positions)
    result = perplexity(model, corpus, tokenizer.pad_token_id, max_tokens=args.max_tokens)
    # a sentence longer than the model's positions is scored on its first ones only: said, not hidden
    result.update({"sentences": len(text), "files": list(text.per_file), "truncated": corpus.n_truncated})
    if args.json:
        print(json.dumps(json_perplexity(result), indent=2))  # an overflowed perplexity: null, not Infinity
    else:
        cut = corpus.n_truncated
        print(f"perplexity {result['perplexity']:.2f} (loss {result['loss']:.4f} nats per subword, "
              f"{counted(result['tokens'], 'token', spec=',')} in {counted(len(text), 'sentence', spec=',')})"
              + (f"; {cut:,} of the {len(text):,} sentences {'was' if cut == 1 else 'were'} longer than the model's "
                 f"{positions} positions and cut" if cut else ""))
    return 0
