"""Evaluate the bundled language model and write its eval_results.json (run once after export).

    .venv/bin/python experiments/evaluate_lm.py models/english-lm

Perplexity (per subword, `</s>` included) on held-out English: newstest2019 (test) and
newstest2020 (validation) when ../shared/data is there, and two sets bundled with headlab, UD
English EWT test (never trained on) and Multi30k test_2016_flickr. Every figure keeps its
command; the headline (EWT test) is reproduced by tests/test_lm_bundled.py.
"""

import argparse
import json
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = "../shared/data/wmt-news-en-de"
SETS = [
    ("ewt-test", "data/ud-english-ewt/en_ewt-ud-test.conllu"),
    ("test_2016_flickr", "data/multi30k/test_2016_flickr.en.gz"),
    ("newstest2019", f"{SHARED}/newstest2019.en.gz"),
    ("newstest2020", f"{SHARED}/newstest2020.en.gz"),
]

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("model")
args = parser.parse_args()

runs = []
for name, path in SETS:
    if not (ROOT / path).is_file():
        print(f"skipping {name}: {path} is not here")
        continue
    command = f"headlab lm evaluate --model {args.model} --text {path} --threads 1"
    start = time.time()
    out = subprocess.run([str(ROOT / ".venv/bin/headlab")] + command.split()[1:] + ["--json"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    scores = json.loads(out)
    scores.update(set=name, command=command, seconds=time.time() - start)
    runs.append(scores)
    print(f"{name}: perplexity {scores['perplexity']:.2f} ({scores['tokens']:,} tokens, {scores['seconds']:.0f} s)",
          flush=True)
headline = next(r for r in runs if r["set"] == "ewt-test")
results = {"headline": {k: headline[k] for k in ("command", "perplexity", "loss", "tokens")}, "runs": runs}
(ROOT / args.model / "eval_results.json").write_text(json.dumps(results, indent=2) + "\n")
print(json.dumps(results["headline"], indent=2))
