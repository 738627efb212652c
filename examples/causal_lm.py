"""Which heads of a causal language model matter, and what do they do?

    python examples/causal_lm.py --text my_text.txt --conllu data/ud-english-ewt/en_ewt-ud-dev.conllu --out runs/lm

MODEL is a local directory (default: the bundled models/english-lm, which works offline) or a hub
id such as gpt2 (needs the network once, then the cache). Runs every
stage of `headlab analyze` (importance, head functions on the treebank, aggregate statistics,
figures, the HTML report), then reads the one long table `heads.csv` and prints the heads LRP
finds most important, with what they do.
"""

import argparse
import csv
from pathlib import Path

from headlab.pipeline import AnalyzeConfig, run_analysis

BUNDLED_LM = Path(__file__).resolve().parents[1] / "models" / "english-lm"  # in a checkout of headlab


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=str(BUNDLED_LM))
    parser.add_argument("--text", required=True, help="one text per line")
    parser.add_argument("--conllu", help="a parsed treebank for the head functions (optional)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--limit", type=int, default=200, help="sentences to use")
    parser.add_argument("--skip", nargs="*", default=[], help="stages not to run (e.g. figures)")
    args = parser.parse_args(argv)

    run = run_analysis(AnalyzeConfig(model=args.model, source=args.text, conllu=args.conllu, out=args.out,
                                     limit=args.limit, skip=tuple(args.skip), progress=False))
    with open(Path(args.out) / "heads.csv", newline="", encoding="utf-8") as handle:
        heads = list(csv.DictReader(handle))
    heads.sort(key=lambda row: -float(row["lrp"] or "nan"))
    print("most important heads by LRP:")
    for row in heads[:5]:
        print(f"  layer {row['layer']} head {row['head']}: lrp {float(row['lrp']):.3f}, "
              f"confidence {float(row['confidence']):.3f}, functions: {row.get('functions') or '-'}")
    print(f"report: {run.report}")


if __name__ == "__main__":
    main()
