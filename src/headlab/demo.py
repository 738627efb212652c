"""`headlab demo`: ``headlab analyze`` on the bundled translation model and language model.

The translation model (Multi30k EN-DE, Voita et al.'s setting): every head scored (confidence,
LRP, gradient importance) on 200 test_2016_flickr sentences; positional, syntactic and
rare-token heads and the Vig & Belinkov statistics on 400 UD English EWT dev sentences; a short
gate sweep (head budgets of 24, 12 and 6 of the 48 encoder heads, fine-tuned on Multi30k
training pairs). The English language model (Vig & Belinkov's setting): importance on 100
English test_2016_flickr sentences, functions and statistics on the same 400 EWT sentences.
Each gets its own report, whose path is printed. Run it again and finished stages are reused.
"""

from __future__ import annotations

from pathlib import Path

from headlab.errors import HeadlabError
from headlab.options import HelpFormatter, renamed

BUNDLED_MODEL = Path("models/multi30k-en-de")
BUNDLED_LM = Path("models/english-lm")
TEST_SOURCE = Path("data/multi30k/test_2016_flickr.en.gz")
TEST_REFERENCE = Path("data/multi30k/test_2016_flickr.de.gz")
TRAIN_SOURCE = Path("data/multi30k/train.en.gz")
TRAIN_TARGET = Path("data/multi30k/train.de.gz")
TREEBANK = Path("data/ud-english-ewt/en_ewt-ud-dev.conllu")


def register(subparsers) -> None:
    demo = subparsers.add_parser("demo", help="`headlab analyze --prune` on the bundled translation model and data",
                                 formatter_class=HelpFormatter)
    demo.add_argument("--model", default=str(BUNDLED_MODEL), help="translation model directory")
    demo.add_argument("--source", default=str(TEST_SOURCE), help="source sentences")
    renamed(demo, "--target", "--reference", default=str(TEST_REFERENCE), help="reference translations")
    demo.add_argument("--conllu", default=str(TREEBANK), help="treebank for the head functions")
    demo.add_argument("--train-source", default=str(TRAIN_SOURCE),
                      help="training sources (token frequencies; the gate sweep's fine-tuning)")
    demo.add_argument("--train-target", default=str(TRAIN_TARGET), help="training targets (the gate sweep)")
    renamed(demo, "--limit", "--n-sentences", type=int, default=200,
            help="test sentences to score heads on (and to score BLEU on in the sweep)")
    renamed(demo, "--conllu-limit", "--treebank-sentences", type=int, default=400, help="treebank sentences to analyse")
    demo.add_argument("--prune-steps", type=int, default=20, help="fine-tuning steps per head budget")
    demo.add_argument("--prune-keeps", default=None, help="head budgets, comma list (default: 24,12,6 of 48)")
    demo.add_argument("--no-prune", action="store_true", help="leave the gate sweep out")
    demo.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    demo.add_argument("--force", action="store_true", help="run every stage again")
    demo.add_argument("--no-progress", action="store_true", help="no progress bars")
    demo.add_argument("--out", default="runs/demo", help="the analysis directory")
    demo.add_argument("--lm", default=str(BUNDLED_LM), help="language model directory (analysed after the translation model)")
    demo.add_argument("--lm-sentences", type=int, default=100, help="sentences of --source to score the LM's heads on")
    demo.add_argument("--lm-out", default="runs/demo-lm", help="the language model's analysis directory")
    demo.add_argument("--no-lm", action="store_true", help="leave the language model out")
    demo.set_defaults(func=run_demo)


def demo_config(args):
    from headlab.options import numbers
    from headlab.pipeline.pipeline import AnalyzeConfig

    return AnalyzeConfig(
        model=args.model, source=args.source, target=args.target, conllu=args.conllu, out=args.out,
        train_text=(args.train_source,), prune=not args.no_prune, limit=args.limit,
        conllu_limit=args.conllu_limit, threads=args.threads,
        prune_source=args.train_source, prune_target=args.train_target,
        prune_limit=max(2000, 4 * args.limit), prune_steps=args.prune_steps,
        prune_keeps=numbers(args.prune_keeps, flag="--prune-keeps") if args.prune_keeps is not None else (),
        force=args.force, progress=not args.no_progress,
    )


def lm_demo_config(args):
    """The language model reads the source side's English (and its training text's frequencies)."""
    from headlab.pipeline.pipeline import AnalyzeConfig

    return AnalyzeConfig(
        model=args.lm, source=args.source, conllu=args.conllu, out=args.lm_out, train_text=(args.train_source,),
        limit=args.lm_sentences, conllu_limit=args.conllu_limit, threads=args.threads,
        force=args.force, progress=not args.no_progress,
    )


def run_demo(args) -> int:
    from headlab.pipeline.cli import print_summary
    from headlab.pipeline.pipeline import run_analysis

    model_dir, lm_dir = Path(args.model), Path(args.lm)
    if not (model_dir / "config.json").is_file() and model_dir == BUNDLED_MODEL:
        # An installed wheel holds the library only: the models and data are files of the repository.
        raise HeadlabError(
            f"{model_dir}: not found under {Path.cwd()}. The demo's models and data come with a checkout of "
            "headlab's repository, not with the installed package: run `headlab demo` (or `make demo`) in the "
            "repository's root, or pass --model DIR and the data options (headlab demo --help)."
        )
    if not (model_dir / "config.json").is_file():
        raise HeadlabError(
            f"{model_dir}: no model there. Train it with the command in docs/nmt.md "
            "(headlab nmt train ...), or pass --model DIR."
        )
    with_lm = not args.no_lm
    if with_lm and not (lm_dir / "config.json").is_file() and lm_dir == BUNDLED_LM:
        print(f"{lm_dir}: no bundled language model in this checkout; analysing the translation model only")
        with_lm = False
    if with_lm and not (lm_dir / "config.json").is_file():
        raise HeadlabError(f"{lm_dir}: no language model there. Train it with the command in its card "
                           "(headlab lm train ...), pass --lm DIR, or --no-lm to leave it out.")
    runs = [("translation model", run_analysis(demo_config(args)))]
    print_summary(runs[0][1])
    if with_lm:
        print(f"\nThe language model {lm_dir}:")
        runs.append(("language model", run_analysis(lm_demo_config(args))))
        print_summary(runs[1][1])
    for name, run in runs:
        if run.report is not None:
            print(f"\nOpen the report of the {name}: {run.report}")
    return 1 if any(run.failed for _, run in runs) else 0
