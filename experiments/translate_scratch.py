"""Write the test-set translations of a finished from-scratch run (``prune baseline --from-scratch``)
that was made before the runs kept them (headlab commit 03af430), for the paired comparison
of Table 2: the pruned configuration is rebuilt from the full model and the score file, the run's
final weights (``last/``) are loaded into it, and the test set is translated as the run scored it.

    python experiments/translate_scratch.py --model models/multi30k-en-de \\
        --scores runs/reproduce/multi30k-en-de/prune/all/lam-0.005/gates.json --keep 84 \\
        --src TEST.en.gz --tgt TEST.de.gz runs/reproduce/multi30k-en-de/prune/scratch/scratch-scores-84-None

It writes RUN/hypotheses.txt only when their BLEU equals the row's in RUN/../baselines.json.
"""

import argparse
import json
from pathlib import Path

from safetensors.torch import load_file

from headlab.data import read_parallel
from headlab.errors import HeadlabError
from headlab.heads import HeadScores
from headlab.loading import load_model, load_tokenizer
from headlab.pruning.baselines import scores_spec
from headlab.pruning.train import HYPOTHESES_FILE, evaluate_model
from headlab.surgery import prune_heads


def translate_run(run: Path, model_dir: str, scores: HeadScores, keep: int, data) -> dict:
    rows = [r for r in json.loads((run.parent / "baselines.json").read_text(encoding="utf-8"))
            if r.get("from_scratch") and r["keep"] == keep]
    if len(rows) != 1:
        raise HeadlabError(f"{run.parent / 'baselines.json'}: {len(rows)} from-scratch rows at keep {keep}, not 1")
    full = load_model(model_dir)
    net = type(full)._from_config(full.config)  # type: ignore[attr-defined]  # a PreTrainedModel
    prune_heads(net, scores_spec(scores, keep, ("enc_self", "dec_self", "dec_cross")))
    # The file leaves out what transformers ties or computes (embeddings shared with the output
    # layer, sinusoidal positions); the BLEU check below says whether the weights are the run's.
    loaded = net.load_state_dict(load_file(str(run / "last" / "model.safetensors")), strict=False)
    if loaded.unexpected_keys or not all("embed" in k or k == "lm_head.weight" for k in loaded.missing_keys):
        raise HeadlabError(f"{run}/last: not this configuration's weights ({loaded})")
    net.tie_weights()
    if getattr(full, "generation_config", None) is not None:
        net.generation_config = full.generation_config
    tokenizer = load_tokenizer(str(run / "tokenizer"))
    staged = run / (HYPOTHESES_FILE + ".tmp")
    metrics = evaluate_model(net.eval(), tokenizer, data, beam=rows[0]["beam"], hypotheses_file=staged)
    if abs(metrics["bleu"] - rows[0]["bleu"]) >= 0.01:
        staged.unlink()
        raise HeadlabError(f"{run}: BLEU {metrics['bleu']:.2f} against the row's {rows[0]['bleu']:.2f}: not its weights")
    staged.replace(run / HYPOTHESES_FILE)
    return {"run": str(run), "bleu": metrics["bleu"], "row": rows[0]["bleu"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path)
    p.add_argument("--model", required=True, help="the full model the run's configuration was pruned from")
    p.add_argument("--scores", required=True, help="the score (gates) file the run's heads were chosen by")
    p.add_argument("--keep", required=True, type=int, help="heads kept in all kinds")
    p.add_argument("--src", required=True)
    p.add_argument("--tgt", required=True)
    args = p.parse_args(argv)
    print(json.dumps(translate_run(args.run, args.model, HeadScores.load(args.scores), args.keep,
                                   read_parallel(args.src, args.tgt))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
