"""Evaluate a finished pruning point's exported model again, in place (its result.json metrics
and hypotheses.txt), after a fix to the evaluation path; the previous metrics stay in the record.

    python experiments/reevaluate_point.py --src TEST.en.gz --tgt TEST.de.gz --reason "..." POINT_DIR...

Made for the points an all-kinds sweep pruned down to no head in decoder self-attention layer 0:
before the fix (headlab commit f4c18d7) their pruned models generated with the positions stuck
at the start, so their test BLEU was wrong, while their gates, weights and development curve
(read with masked heads) were right. Beam, batch size and latency sentences are the point's own
(prune_config.json).
"""

import argparse
import json
import sys
import time
from pathlib import Path

from headlab.data import read_parallel
from headlab.errors import HeadlabError
from headlab.heads import atomic_write_text
from headlab.pruning.train import HYPOTHESES_FILE, RESULT_FILE, PruneConfig, evaluate_point
from headlab.surgery import load_pruned


def reevaluate(point: Path, data, reason: str) -> dict:
    result_file, pruned = point / RESULT_FILE, point / "pruned"
    if not result_file.is_file() or not (pruned / "config.json").is_file():
        raise HeadlabError(f"{point}: no finished point with its pruned model ({RESULT_FILE}, pruned/)")
    record = json.loads(result_file.read_text(encoding="utf-8"))
    options = json.loads((point / "prune_config.json").read_text(encoding="utf-8"))
    config = PruneConfig(eval_beam=options["eval_beam"], eval_batch_size=options["eval_batch_size"],
                         latency_sentences=options["latency_sentences"])
    from transformers import AutoTokenizer

    model, tokenizer = load_pruned(pruned).eval(), AutoTokenizer.from_pretrained(str(pruned))
    hypotheses = point / (HYPOTHESES_FILE + ".tmp")
    metrics = evaluate_point(model, tokenizer, data, config, hypotheses_file=hypotheses)
    hypotheses.replace(point / HYPOTHESES_FILE)
    kept = {k: record["metrics"][k] for k in ("expected_l0", "polarized", "deterministic_open",
                                              "parameters_before", "parameters_after") if k in record["metrics"]}
    previous = {k: record["metrics"].get(k) for k in ("bleu", "chrf", "loss")}
    record["metrics"] = {**kept, **metrics}
    record.setdefault("reevaluated", []).append({"when": time.strftime("%Y-%m-%d"), "reason": reason,
                                                 "previous": previous})
    atomic_write_text(result_file, json.dumps(record, indent=2) + "\n")
    return {"point": str(point), "previous": previous["bleu"], "now": metrics["bleu"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("points", nargs="+", type=Path)
    p.add_argument("--src", required=True, help="the sweep's evaluation sources")
    p.add_argument("--tgt", required=True, help="its references")
    p.add_argument("--reason", required=True, help="why, kept in result.json")
    args = p.parse_args(argv)
    data = read_parallel(args.src, args.tgt)
    for point in args.points:
        print(json.dumps(reevaluate(point, data, args.reason)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
