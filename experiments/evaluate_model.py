"""Evaluate a bundled translation model and write its eval_results.json (run once after export).

    .venv/bin/python experiments/evaluate_model.py models/multi30k-en-fr --tgt fr
    .venv/bin/python experiments/evaluate_model.py models/news-en-de --tgt de \
        --set test_2016_flickr data/multi30k/test_2016_flickr --set newstest2019 runs/news-en-de-data/test

Each set (by default Multi30k's test_2016_flickr and val) with beam 4 and greedy, one CPU thread
(--device cuda: on the GPU); the headline is the first set with beam 4; every figure keeps its command.
"""

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADLAB = os.environ.get("HEADLAB") or str(ROOT / ".venv/bin/headlab")  # HEADLAB=headlab: the one on PATH

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("model")
parser.add_argument("--src", default="en")
parser.add_argument("--tgt", required=True)
parser.add_argument("--set", nargs=2, action="append", metavar=("NAME", "PREFIX"), dest="sets",
                    help="a test set: files PREFIX.SRC.gz and PREFIX.TGT.gz (repeatable; the first is the headline)")
parser.add_argument("--device", help="where the model runs (headlab nmt evaluate --device); none: one CPU thread")
args = parser.parse_args()
sets = args.sets or [("test_2016_flickr", "data/multi30k/test_2016_flickr"), ("val", "data/multi30k/val")]

runs = []
for split, prefix in sets:
    for beam in (4, 1):
        command = (f"headlab nmt evaluate --model {args.model} --src {prefix}.{args.src}.gz "
                   f"--ref {prefix}.{args.tgt}.gz --beam {beam} "
                   + (f"--device {args.device}" if args.device else "--threads 1"))
        start = time.time()
        out = subprocess.run([HEADLAB] + command.split()[1:] + ["--json"],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout
        scores = json.loads(out)
        scores.update(split=split, command=command)
        runs.append(scores)
        print(f"{split} beam {beam}: BLEU {scores['bleu']:.2f} chrF {scores['chrf']:.2f} ({scores['seconds']:.0f} s)",
              flush=True)
headline = next(r for r in runs if r["split"] == sets[0][0] and r["beam"] == 4)
results = {"headline": {k: headline[k] for k in ("command", "bleu", "chrf", "bleu_signature", "chrf_signature")},
           "runs": runs}
(ROOT / args.model / "eval_results.json").write_text(json.dumps(results, indent=2) + "\n")
print(json.dumps(results["headline"], indent=2))
