"""`headlab lm ...` subcommands: train and score decoder-only language models (thin wrappers)."""

from __future__ import annotations

import argparse
import json
import sys

from headlab.device_options import add_device_options, device_options
from headlab.errors import HeadlabError


def register(subparsers) -> None:
    from headlab.lm.model import ARCHITECTURES, LMConfig

    lm = subparsers.add_parser("lm", help="train and score decoder-only language models")
    commands = lm.add_subparsers(dest="lm_command", metavar="LM_COMMAND")
    commands.required = True
    size = LMConfig()  # defaults written once, in the dataclass

    p = commands.add_parser("train", help="train a causal language model (Llama-style or GPT-2) on English text",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--train", nargs="+", required=True, metavar="FILE",
                   help="training text: one sentence a line (plain or .gz), or CoNLL-U treebanks (.conllu[.gz])")
    p.add_argument("--valid", nargs="+", metavar="FILE", help="validation text (perplexity after each epoch)")
    p.add_argument("--out", required=True, help="output directory (checkpoints, best/, tokenizer/)")
    p.add_argument("--tokenizer", help="use this saved tokenizer (with a BOS token) instead of training one")
    p.add_argument("--vocab-size", type=int, default=8000, help="BPE vocabulary size")
    p.add_argument("--arch", choices=ARCHITECTURES, default=size.arch,
                   help="llama: rotary positions, RMSNorm, SwiGLU; gpt2: learned positions (Vig & Belinkov's)")
    p.add_argument("--d-model", type=int, default=size.d_model)
    p.add_argument("--ffn", type=int, default=size.ffn_dim, help="MLP inner width")
    p.add_argument("--layers", type=int, default=size.layers)
    p.add_argument("--heads", type=int, default=size.n_heads)
    p.add_argument("--dropout", type=float, default=size.dropout, help="residual and embedding dropout (gpt2)")
    p.add_argument("--attention-dropout", type=float, default=size.attention_dropout)
    p.add_argument("--max-positions", type=int, default=size.max_positions,
                   help="longest input; longer sentences are cut (and counted in the log)")
    p.add_argument("--max-tokens", type=int, default=4096, help="tokens per batch and process")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--warmup-steps", type=int, default=400)
    p.add_argument("--label-smoothing", type=float, default=0.0)
    p.add_argument("--mixed-precision", choices=["no", "bf16"], default="no", help="bf16 autocast")
    p.add_argument("--clip-norm", type=float, default=1.0, help="0 turns clipping off")
    p.add_argument("--epochs", type=int, default=100, help="maximum number of epochs")
    p.add_argument("--patience", type=int, default=2,
                   help="stop after this many epochs without a validation-loss gain of --min-improvement (0: off)")
    p.add_argument("--min-improvement", type=float, default=0.01,
                   help="smallest drop in validation loss (nats per token) that counts as progress")
    p.add_argument("--max-steps", type=int, help="stop after this many updates")
    p.add_argument("--max-time", type=float, help="stop (with a resumable checkpoint) after this many minutes")
    p.add_argument("--save-every", type=int, help="also write a resume checkpoint every N steps")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, help="torch CPU threads per process")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    p.add_argument("--overwrite", action="store_true", help="replace a model already in --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_train, interrupted="the last checkpoint in {out} is kept; add --resume to the same "
                                            "command to continue from it")

    p = commands.add_parser("evaluate", help="perplexity of a language model on text",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, help="model directory (config, safetensors, tokenizer)")
    p.add_argument("--text", nargs="+", required=True, metavar="FILE", help="one sentence a line, or CoNLL-U")
    p.add_argument("--max-tokens", type=int, default=4096, help="tokens per batch")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--json", action="store_true", help="print JSON")
    add_device_options(p)
    p.set_defaults(func=_evaluate)

    p = commands.add_parser("export", help="copy one checkpoint of a training run into a model directory",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--run", required=True, help="training output directory (--out of lm train)")
    p.add_argument("--to", required=True, help="model directory to write")
    p.add_argument("--checkpoint", default="best", help="best, last or epoch-N")
    p.add_argument("--dtype", default="float16", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=_export)


def _set_threads(threads: int | None) -> None:
    if threads is not None:
        if threads < 1:
            raise HeadlabError(f"--threads must be at least 1, got {threads}")
        import torch

        torch.set_num_threads(threads)


def _train(args) -> int:
    from headlab import preflight
    from headlab.lm.model import LMConfig
    from headlab.lm.train import LMRecipe, run_lm_recipe
    from headlab.lock import training_lock
    from headlab.nmt.train import TrainConfig

    _set_threads(args.threads)
    if args.patience and not args.valid:
        raise HeadlabError("--patience needs --valid (early stopping watches the validation loss); "
                           "pass --patience 0 to train without validation")
    for flag, paths in (("--train", args.train), ("--valid", args.valid or [])):
        for path in paths:
            preflight.input_file(path, flag)
    preflight.output_dir(args.out)
    recipe = LMRecipe(
        train_files=args.train, valid_files=args.valid or [], tokenizer=args.tokenizer, vocab_size=args.vocab_size,
        model=LMConfig(arch=args.arch, d_model=args.d_model, ffn_dim=args.ffn, layers=args.layers,
                       n_heads=args.heads, dropout=args.dropout, attention_dropout=args.attention_dropout,
                       max_positions=args.max_positions),
        train=TrainConfig(out_dir=args.out, max_tokens=args.max_tokens, lr=args.lr, warmup_steps=args.warmup_steps,
                          label_smoothing=args.label_smoothing, mixed_precision=args.mixed_precision,
                          clip_norm=args.clip_norm, max_epochs=args.epochs, patience=args.patience,
                          min_improvement=args.min_improvement, max_steps=args.max_steps,
                          max_time_minutes=args.max_time, save_every_steps=args.save_every, seed=args.seed,
                          resume=args.resume, overwrite=args.overwrite, progress=not args.no_progress),
    )
    with training_lock(args.out):  # a second run on the same directory refuses
        result = run_lm_recipe(recipe)
    if result.stopped == "diverged":
        print(f"headlab lm train: {result.message}", file=sys.stderr)
        return 1
    return 0


def _evaluate(args) -> int:
    from headlab.lm.data import encode_lm_corpus, read_text_corpus
    from headlab.lm.train import perplexity
    from headlab.loading import load_model, load_tokenizer

    _set_threads(args.threads)
    placement = device_options(args)  # a GPU that is not there fails before any work
    text = read_text_corpus(args.text)  # read before loading: a bad file fails fast
    model = load_model(args.model, **{**placement, "dtype": placement["dtype"] or "float32"})
    tokenizer = load_tokenizer(args.model)
    if tokenizer.bos_token_id is None:
        raise HeadlabError(f"{args.model}: the tokenizer has no BOS token (not a headlab language model)")
    corpus = encode_lm_corpus(tokenizer, text.sentences, model.config.max_position_embeddings)
    result = perplexity(model, corpus, tokenizer.pad_token_id, max_tokens=args.max_tokens)
    result.update({"sentences": len(text), "files": list(text.per_file)})
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"perplexity {result['perplexity']:.2f} (loss {result['loss']:.4f} nats per subword, "
              f"{result['tokens']:,} tokens in {len(text):,} sentences)")
    return 0


def _export(args) -> int:
    from headlab.nmt.export import export_model

    out = export_model(args.run, args.to, which=args.checkpoint, dtype=args.dtype, overwrite=args.overwrite)
    print(f"exported {args.checkpoint} of {args.run} to {out} ({args.dtype})")
    return 0
