"""`headlab demo`: ``headlab analyze --prune`` on the bundled Multi30k EN-DE model and bundled data.

It scores every head (confidence, LRP, gradient importance) on 200 test_2016_flickr sentences,
finds positional, syntactic and rare-token heads and the Vig & Belinkov statistics on 400 UD
English EWT dev sentences, runs a short gate sweep (head budgets of 24, 12 and 6 of
the 48 encoder heads, fine-tuned on Multi30k training pairs), draws the figures and writes the
HTML report; it prints the report's path. Run it again and the finished stages are reused.
"""

from __future__ import annotations

from pathlib import Path

from headlab.errors import HeadlabError

BUNDLED_MODEL = Path("models/multi30k-en-de")
TEST_SOURCE = Path("data/multi30k/test_2016_flickr.en.gz")
TEST_REFERENCE = Path("data/multi30k/test_2016_flickr.de.gz")
TRAIN_SOURCE = Path("data/multi30k/train.en.gz")
TRAIN_TARGET = Path("data/multi30k/train.de.gz")
TREEBANK = Path("data/ud-english-ewt/en_ewt-ud-dev.conllu")


def register(subparsers) -> None:
    demo = subparsers.add_parser("demo", help="`headlab analyze --prune` on the bundled translation model and data")
    demo.add_argument("--model", default=str(BUNDLED_MODEL), help="translation model directory")
    demo.add_argument("--source", default=str(TEST_SOURCE), help="source sentences")
    demo.add_argument("--reference", default=str(TEST_REFERENCE), help="reference translations")
    demo.add_argument("--conllu", default=str(TREEBANK), help="treebank for the head functions")
    demo.add_argument("--train-source", default=str(TRAIN_SOURCE),
                      help="training sources (token frequencies; the gate sweep's fine-tuning)")
    demo.add_argument("--train-target", default=str(TRAIN_TARGET), help="training targets (the gate sweep)")
    demo.add_argument("--n-sentences", type=int, default=200,
                      help="test sentences to score heads on (and to score BLEU on in the sweep)")
    demo.add_argument("--treebank-sentences", type=int, default=400, help="treebank sentences to analyse")
    demo.add_argument("--prune-steps", type=int, default=20, help="fine-tuning steps per head budget")
    demo.add_argument("--prune-keeps", default=None, help="head budgets, comma list (default: 24,12,6 of 48)")
    demo.add_argument("--no-prune", action="store_true", help="leave the gate sweep out")
    demo.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    demo.add_argument("--force", action="store_true", help="run every stage again")
    demo.add_argument("--no-progress", action="store_true", help="no progress bars")
    demo.add_argument("--out", default="runs/demo", help="the analysis directory")
    demo.set_defaults(func=run_demo)


def demo_config(args):
    from headlab.analyze.cli import _ints
    from headlab.analyze.pipeline import AnalyzeConfig

    return AnalyzeConfig(
        model=args.model, source=args.source, target=args.reference, conllu=args.conllu, out=args.out,
        train_text=(args.train_source,), prune=not args.no_prune, limit=args.n_sentences,
        conllu_limit=args.treebank_sentences, threads=args.threads,
        prune_source=args.train_source, prune_target=args.train_target,
        prune_limit=max(2000, 4 * args.n_sentences), prune_steps=args.prune_steps,
        prune_keeps=_ints(args.prune_keeps) if args.prune_keeps else (),
        force=args.force, progress=not args.no_progress,
    )


def run_demo(args) -> int:
    from headlab.analyze.cli import print_summary
    from headlab.analyze.pipeline import run_analysis

    model_dir = Path(args.model)
    if not (model_dir / "config.json").is_file():
        raise HeadlabError(
            f"{model_dir}: no model there. Train it with the command in docs/nmt.md "
            "(headlab nmt train ...), or pass --model DIR."
        )
    run = run_analysis(demo_config(args))
    print_summary(run)
    if run.report is not None:
        print(f"\nOpen the report: {run.report}")
    return 1 if run.failed else 0
