"""When do the language model's heads specialise? Positional share and confidence per epoch.

    .venv/bin/python experiments/lm_specialisation.py --run /work/runs/english-lm \
        --out docs/results/english-lm/specialisation.json

For every epoch checkpoint of a `headlab lm train` run (``epochs/epoch-NNN``): `headlab
functions` on the first 500 sentences of UD English EWT dev (the most positional head at word
and subword level, and the best previous-word head, Voita et al. 2019 Sec. 5.1) and `headlab
importance --method confidence` on the first 200 sentences of newstest2019 (Sec. 4). Each
epoch's analysis is kept in ``<run>/specialisation/epoch-NNN`` and skipped when present, so a
rerun after more epochs only analyses the new ones.
"""

import argparse
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np

from headlab.functions.positional import positional_summary  # the same numbers as the model profiles

ROOT = Path(__file__).resolve().parents[1]
HEADLAB = str(ROOT / ".venv" / "bin" / "headlab")

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--run", required=True, help="the lm train output directory")
parser.add_argument("--out", required=True, help="JSON file to write")
parser.add_argument("--conllu", default=str(ROOT / "data/ud-english-ewt/en_ewt-ud-dev.conllu"))
parser.add_argument("--text", default=str(ROOT.parent / "shared/data/wmt-news-en-de/newstest2019.en.gz"))
args = parser.parse_args()

run = Path(args.run)
rows = []
history = {row["epoch"]: row for row in json.loads((run / "history.json").read_text())}
for checkpoint in sorted((run / "epochs").glob("epoch-*")):
    epoch = int(checkpoint.name.split("-")[1])
    if not (checkpoint / "tokenizer.json").is_file():  # epoch checkpoints hold weights only
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (run / "tokenizer" / name).is_file():
                shutil.copyfile(run / "tokenizer" / name, checkpoint / name)
    work = run / "specialisation" / checkpoint.name
    if not (work / "functions" / "summary.json").is_file():
        subprocess.run([HEADLAB, "functions", str(checkpoint), "--conllu", args.conllu, "--max-sentences", "500",
                        "--out", str(work / "functions"), "--no-figures", "--no-progress", "--threads", "1"],
                       check=True, capture_output=True)
    if not (work / "importance" / "confidence.json").is_file():
        subprocess.run([HEADLAB, "importance", str(checkpoint), "--data", args.text, "--n-sentences", "200",
                        "--method", "confidence", "--out", str(work / "importance"), "--threads", "1"],
                       check=True, capture_output=True)
    positional = positional_summary(work / "functions", "dec_self")
    confidence = np.asarray(json.loads((work / "importance" / "confidence.json").read_text())["scores"]["dec_self"])
    rows.append({
        "epoch": epoch, "step": history.get(epoch, {}).get("step"),
        "valid_perplexity": history.get(epoch, {}).get("valid_perplexity"),
        "positional": positional,
        "confidence_max": float(np.nanmax(confidence)), "confidence_mean": float(np.nanmean(confidence)),
    })
    print(f"epoch {epoch}: word {positional['word']['share']:.3f} at {positional['word']['offset']:+d}, "
          f"previous word {positional['previous_word']['share']:.3f}, confidence max {rows[-1]['confidence_max']:.3f}")
Path(args.out).parent.mkdir(parents=True, exist_ok=True)
Path(args.out).write_text(json.dumps({"run": str(run), "epochs": rows}, indent=1) + "\n")
