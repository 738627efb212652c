"""Bundle a finished pruning point as models/NAME: its pruned model in float16, its result and
gates, and a card whose numbers this script measures.

    python experiments/bundle_pruned.py runs/reproduce/multi30k-en-de/prune/enc/lam-0.01 \
        models/multi30k-en-de-pruned-enc --full models/multi30k-en-de \
        --src data/multi30k/test_2016_flickr.en.gz --tgt data/multi30k/test_2016_flickr.de.gz

The weights are stored in float16 (issue 12: bundled weights in fp16), and headlab loads them
back into float32. The card gives greedy test BLEU of the float16 weights beside the point's own
(float32, from its result.json), which must agree within 0.1 BLEU, and the unpruned model's.
The directory is replaced atomically.
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

from headlab.data import read_parallel
from headlab.errors import HeadlabError
from headlab.heads import atomic_dir, atomic_write_text
from headlab.loading import load_model
from headlab.pruning.train import evaluate_model
from headlab.surgery import count_parameters, load_pruned, save_pruned

TOLERANCE = 0.1  # BLEU: what storing in float16 may move the score by (issue 12)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "source.spm", "target.spm")


def _row(label: str, values: list[str]) -> str:
    return f"| {label} | " + " | ".join(values) + " |"


def card(name: str, point: Path, result: dict, full_dir: Path, scores: dict, repo_point: str) -> str:
    kept, total = result["heads_kept"], result["heads_total"]
    mode = (f"fixed lambda {result['lam']:g}" if result.get("keep") is None
            else f"budget of {result['keep']} heads (Lagrangian)")
    gates = "encoder self-attention only (decoder frozen, Sec. 6.2)" if result["gates"] in ("enc", "enc_self") \
        else "every attention kind, all parameters trained (Sec. 6.3)"
    lines = [
        f"# {name}: models/{full_dir.name} with attention heads physically removed",
        "",
        f"[models/{full_dir.name}](../{full_dir.name}/README.md) (weights `model_sha256` "
        f"{result['model_sha256'][:12]}…) after {result['step']} updates of gated fine-tuning with Hard Concrete "
        f"gates on {gates}, L0 penalty with {mode} (Voita et al. 2019, Sec. 6), then physical removal of the "
        f"closed heads. It is the point `{repo_point}` of the reproduction's sweep "
        f"([docs/reproduction.md](../../docs/reproduction.md)); its gates were "
        f"{100 * result['metrics']['polarized']:.1f}% polarised at the end.",
        "",
        "Attention heads kept per kind:",
        "",
        "| kind | heads kept | of |",
        "|---|---:|---:|",
        *[f"| {kind} | {kept[kind]} | {total[kind]} |" for kind in total],
        "",
        "| | this model (float16 weights) | the point (float32) | unpruned |",
        "|---|---:|---:|---:|",
        _row("parameters", [f"{scores['parameters']:,}", f"{result['metrics']['parameters_after']:,}",
                            f"{scores['full_parameters']:,}"]),
        _row("BLEU, test_2016_flickr, greedy", [f"{scores['bleu']:.2f}", f"{result['metrics']['bleu']:.2f}",
                                                f"{scores['full_bleu']:.2f}"]),
        _row("chrF2, test_2016_flickr, greedy", [f"{scores['chrf']:.2f}", f"{result['metrics']['chrf']:.2f}",
                                                 f"{scores['full_chrf']:.2f}"]),
        "",
        f"BLEU signature `{scores['bleu_signature']}`. The point's change against the unpruned model, with "
        "its paired bootstrap interval, and the same against the lambda = 0 control (fine-tuning alone), "
        "are in docs/reproduction.md (Sections 6.2 and 6.3).",
        "",
        "## How it was made",
        "",
        "```bash",
        result["command"],
        f"python experiments/bundle_pruned.py {point} models/{name} --full {full_dir} ...",
        "```",
        "",
        "`prune_result.json` is the point's `result.json`, `gates.json` the final P(open) of every gate "
        "(HeadScores), `headlab_pruning.json` the record of which original heads remain.",
        "",
        "## Use",
        "",
        "```python",
        "import headlab",
        f'model = headlab.load_pruned("models/{name}")  # float32, fewer heads',
        "```",
        "",
        f"or any `headlab` command with `models/{name}` as the model. Without headlab, transformers loads it "
        "through the small module `pruned_heads.py` beside the weights (it imports only torch and transformers "
        "and resizes the pruned layers before the weights are read):",
        "",
        "```python",
        "from transformers import AutoModelForSeq2SeqLM",
        f'model = AutoModelForSeq2SeqLM.from_pretrained("models/{name}", trust_remote_code=True)',
        "```",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("point", type=Path, help="a finished sweep point (result.json, gates.json, pruned/)")
    p.add_argument("out", type=Path, help="the bundled directory, models/NAME (replaced)")
    p.add_argument("--full", type=Path, required=True, help="the unpruned model")
    p.add_argument("--src", required=True)
    p.add_argument("--tgt", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    result = json.loads((args.point / "result.json").read_text(encoding="utf-8"))
    if result.get("stopped") != "finished":
        raise HeadlabError(f"{args.point}: not a finished point ({result.get('stopped')})")
    data = read_parallel(args.src, args.tgt)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.point / "pruned"))
    model = load_pruned(args.point / "pruned").half()

    stage = args.out.parent / f".{args.out.name}.stage"  # measured here before it replaces args.out
    shutil.rmtree(stage, ignore_errors=True)
    save_pruned(model, stage)
    for name in TOKENIZER_FILES:
        if (args.point / "pruned" / name).is_file():
            shutil.copyfile(args.point / "pruned" / name, stage / name)
    shutil.copyfile(args.point / "result.json", stage / "prune_result.json")
    shutil.copyfile(args.point / "gates.json", stage / "gates.json")
    bundled = load_pruned(stage).float().eval()
    scores = evaluate_model(bundled, tokenizer, data, beam=1)
    scores["parameters"] = count_parameters(bundled)
    full = load_model(str(args.full)).eval()
    full_scores = evaluate_model(full, AutoTokenizer.from_pretrained(str(args.full)), data, beam=1)
    scores.update(full_bleu=full_scores["bleu"], full_chrf=full_scores["chrf"], full_parameters=count_parameters(full))
    moved = scores["bleu"] - result["metrics"]["bleu"]
    print(json.dumps({"bleu_fp16": scores["bleu"], "bleu_point": result["metrics"]["bleu"], "moved": moved,
                      "full": scores["full_bleu"]}))
    if abs(moved) >= TOLERANCE:
        raise HeadlabError(f"{args.out}: float16 weights moved greedy BLEU by {moved:+.2f} (>= {TOLERANCE}); "
                           f"left in {stage}")
    repo_point = "/".join(args.point.parts[-2:])
    atomic_write_text(stage / "README.md", card(args.out.name, args.point, result, args.full, scores, repo_point))

    def copy_stage(tmp: Path) -> None:
        shutil.copytree(stage, tmp, dirs_exist_ok=True)

    atomic_dir(args.out, copy_stage)
    shutil.rmtree(stage)
    return 0


if __name__ == "__main__":
    sys.exit(main())
