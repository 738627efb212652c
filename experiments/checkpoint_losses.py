"""Validation loss of every epoch checkpoint of a translation run, for the epochs whose history
records predate the trainer's ``valid_loss`` (2026-11-24).

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 .venv/bin/python experiments/checkpoint_losses.py runs/news-en-de \\
        --src runs/news-en-de-data/valid.en.gz --tgt runs/news-en-de-data/valid.de.gz \\
        --out docs/results/news-en-de/epoch_losses.json

The loss is the trainer's (`headlab.nmt.train.evaluate_loss`: mean cross-entropy per reference
token, teacher-forced, no label smoothing, the run's `--max-tokens` per batch), of the fp32
weights saved after each epoch (`<run>/epochs/epoch-NNN`). Written atomically; a checkpoint
already in `--out` with the same weights (sha256) is not measured again.
"""

import argparse
import json
import time
from pathlib import Path

import torch

from headlab.data.parallel import read_parallel
from headlab.heads import atomic_write_text
from headlab.loading import load_model, load_tokenizer
from headlab.nmt.train import evaluate_loss
from headlab.resume import weights_fingerprint

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("run", type=Path, help="a headlab nmt train output directory")
parser.add_argument("--src", required=True)
parser.add_argument("--tgt", required=True)
parser.add_argument("--out", type=Path, required=True)
args = parser.parse_args()

torch.set_num_threads(1)
config = json.loads((args.run / "train_config.json").read_text(encoding="utf-8"))
tokenizer = load_tokenizer(str(args.run / "tokenizer"))
valid = read_parallel(args.src, args.tgt)
done = {row["epoch"]: row for row in json.loads(args.out.read_text(encoding="utf-8"))["epochs"]} if args.out.is_file() else {}
for checkpoint in sorted((args.run / "epochs").glob("epoch-[0-9][0-9][0-9]")):
    epoch = int(checkpoint.name.split("-")[1])
    sha = weights_fingerprint(checkpoint)
    if done.get(epoch, {}).get("model_sha256") == sha:
        continue
    start = time.perf_counter()
    model = load_model(str(checkpoint), dtype=torch.float32).eval()
    loss = evaluate_loss(model, tokenizer, valid, batch_tokens=config["max_tokens"])
    done[epoch] = {"epoch": epoch, "valid_loss": loss, "model_sha256": sha}
    print(f"epoch {epoch}: valid loss {loss:.4f} ({time.perf_counter() - start:.0f} s)", flush=True)
    atomic_write_text(args.out, json.dumps({
        "run": str(args.run), "valid": [args.src, args.tgt], "n_pairs": len(valid.sources),
        "loss": "mean cross-entropy per reference token, teacher-forced, no label smoothing",
        "batch_tokens": config["max_tokens"], "epochs": [done[e] for e in sorted(done)]}, indent=1) + "\n")
