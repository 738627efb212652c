"""`headlab parse`: raw text, one sentence per line, to CoNLL-U with a spaCy UD pipeline."""

from __future__ import annotations

from headlab.options import HelpFormatter, renamed


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "parse", formatter_class=HelpFormatter,
        help="parse raw text (one sentence per line) into CoNLL-U for `headlab functions --conllu` "
             "(a spaCy UD pipeline such as models/ewt-parser; needs the `parse` extra)")
    p.add_argument("--model", required=True, help="spaCy pipeline directory with a parser and a morphologizer or tagger")
    renamed(p, "--source", "--input", required=True, help="UTF-8 text, plain or .gz, one sentence per line (blank lines skipped)")
    p.add_argument("--out", required=True, help="CoNLL-U file to write (gzip when it ends in .gz)")
    p.add_argument("--batch-size", type=int, default=64, help="sentences per spaCy batch")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_parse)


def run_parse(args) -> int:
    from headlab import preflight
    from headlab.parse.core import check_pipeline_dir, import_spacy, parse_text_file

    preflight.input_file(args.source, "--source")
    preflight.output_file(args.out, "--out", {"--source": args.source})
    preflight.at_least(args.batch_size, 1, "--batch-size")
    model = check_pipeline_dir(args.model)
    import_spacy()  # a missing spaCy is reported before the input is read
    report = parse_text_file(model, args.source, args.out, batch_size=args.batch_size, progress=not args.no_progress)
    print(report.describe())
    print(f"wrote {args.out}")
    return 0
