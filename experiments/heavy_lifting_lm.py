"""Do specialised heads do the heavy lifting? The test on models/english-lm (issue 35, item 1).

The prediction and the decision rules, written before any run: experiments/heavy_lifting_lm.md.

    python experiments/heavy_lifting_lm.py labels FUNCTIONS_DIR --out labels.json
    python experiments/heavy_lifting_lm.py run --root RUNS --labels labels.json \
        --train FILE [FILE ...] --eval NAME=FILE [NAME=FILE ...] [--deadline 2026-11-26T09:10Z]
    python experiments/heavy_lifting_lm.py report --root RUNS --labels labels.json --out DIR [--previous RUNS_EPOCH1]

``labels`` turns a ``headlab functions`` run on EWT dev (not the fine-tuning data) into one label
per head by Voita et al.'s criteria (positional: one offset holds >= 90% of the maxima, Sec. 5.1;
syntactic: >= 10 points above the offset baseline on a scored relation-direction, Sec. 5.2.1;
rare-token: the head whose maxima land most often on the rarest token, Sec. 5.3) and a
specialisation score (the largest of the three, each as a fraction of its bar) that ranks the
least specialised heads.

``run`` works through the configurations of :func:`plan` in order, each in its own directory
under ``--root``: gated fine-tuning (``headlab prune train``, Hard Concrete gates on all 48 heads,
budget points keep 24/12/6 and fixed lambdas, lambda = 0 the control), and the controls with the
*same command* on a model whose other heads were removed first (``headlab prune apply``, then
``prune train --lam 0``): k random heads (seeds 1-3) and the k least specialised. Ablation
without fine-tuning removes the labelled heads, or as many random heads (39 draws). Every
finished model is scored sentence by sentence (nats per subword, the sums ``headlab lm
evaluate`` reports) into ``eval.json``. A configuration with ``eval.json`` is skipped; one cut
short resumes from its last checkpoint (``--resume``, a checkpoint every 25 updates). At the
deadline the running training gets SIGINT (its checkpoint stays) and the driver stops.
``STATUS`` under ``--root`` says what is done and what runs.

``report`` reads the result files and applies the rules of heavy_lifting_lm.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the experiments beside this one
import heavy_lifting_runner  # noqa: E402  experiments/heavy_lifting_runner.py
from heavy_lifting_labels import (  # noqa: E402  experiments/heavy_lifting_labels.py
    POSITIONAL_BAR,
    SYNTACTIC_BAR,
    label_rows,
    least_specialised,
)

ROOT = Path(__file__).resolve().parents[1]
KIND = "dec_self"
N_LAYERS, N_HEADS = 6, 8
KEEPS = (6, 12, 24)  # the head counts of the comparison (issue 35: about 24, 12 and 6)
SEEDS = (1, 2, 3)
LAMS = (0.01, 0.02, 0.05, 0.1)  # the fixed-lambda series besides lambda = 0
N_RANDOM_ABLATIONS = 39  # smallest p of the ablation test: 1/40

# The fine-tuning recipe every trained configuration shares (gated and controls alike).
RECIPE = ["--gates", "all", "--loss", "causal_lm", "--label-smoothing", "0", "--max-tokens", "4096",
          "--epochs", "1", "--lr", "1e-4", "--gate-lr", "0.05", "--init-log-alpha", "3", "--beta", "0.33",
          "--mixed-precision", "bf16", "--seed", "1", "--save-every", "25", "--log-every", "25",
          "--threads", "1", "--no-progress"]


def heads() -> list[tuple[int, int]]:
    return [(layer, head) for layer in range(N_LAYERS) for head in range(N_HEADS)]


def atomic_json(path: Path, value) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1) + "\n")
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- labels


def labels_from_functions(functions_dir: Path) -> dict:
    """One label per head from a ``headlab functions`` directory (see the module doc)."""
    def table(name):
        return json.loads((functions_dir / name).read_text())["scores"][KIND]

    share, offset = table("positional/share.json"), table("positional/offset.json")
    margin, rarest = table("syntactic/margin.json"), table("rare_tokens/rarest.json")
    rows = label_rows(heads(), share, offset, margin, rarest)
    signature = json.loads((functions_dir / "positional/share.json").read_text()).get("signature", {})
    return {"kind": KIND, "source": str(functions_dir), "signature": signature,
            "criteria": {"positional": f"share of maxima at one offset >= {POSITIONAL_BAR}",
                         "syntactic": f"accuracy - offset baseline >= {SYNTACTIC_BAR} on a scored relation-direction",
                         "rare": "the head with the largest share of maxima on the sentence's rarest token",
                         "score": "max(positional share / 0.90, syntactic margin / 0.10, rarest share / largest)"},
            "heads": rows,
            "specialised": [[r["layer"], r["head"]] for r in rows if r["specialised"]]}


def random_heads(k: int, seed: int) -> list[tuple[int, int]]:
    """``k`` uniformly chosen heads (torch's generator, as headlab.pruning.baselines.random_spec)."""
    import torch

    order = torch.randperm(N_LAYERS * N_HEADS, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(heads()[i] for i in order[:k])


def removal_spec(kept: list[tuple[int, int]]) -> str:
    """The typed head spec (headlab.headspec) removing every head not in ``kept``."""
    keep = set(kept)
    items = []
    for layer in range(N_LAYERS):
        gone = [h for h in range(N_HEADS) if (layer, h) not in keep]
        if gone:
            items.append(f"{KIND}:{layer}:{','.join(map(str, gone))}")
    return ";".join(items)


# ----------------------------------------------------------------------------- the plan


def plan(labels: dict) -> list[dict]:
    """Every configuration, in the order they run: the reference, then the k = 6 trio (gates,
    least specialised, random seed 1), the ablation, the lambda = 0 control, the k = 12 and 24
    trios, the other random seeds, the fixed-lambda series."""
    specialised = [tuple(h) for h in labels["specialised"]]
    out: list[dict] = [{"name": "full", "type": "reference"}]

    def trio(k):
        return [{"name": f"gates-keep{k}", "type": "gated", "args": ["--keep", str(k)], "k": k},
                {"name": f"least-{k}", "type": "control", "kept": least_specialised(labels, k), "k": k},
                {"name": f"random-{k}-s1", "type": "control", "kept": random_heads(k, 1), "k": k, "seed": 1}]

    out += trio(6)
    out.append({"name": "ablation-labelled", "type": "ablation", "kept": sorted(set(heads()) - set(specialised))})
    n = len(specialised)
    for seed in range(1, N_RANDOM_ABLATIONS + 1):
        out.append({"name": f"ablation-random-{seed:02d}", "type": "ablation",
                    "kept": random_heads(N_LAYERS * N_HEADS - n, 1000 + seed), "seed": 1000 + seed})
    out.append({"name": "gates-lam0", "type": "gated", "args": ["--lam", "0"]})
    out += trio(12) + trio(24)
    for seed in SEEDS[1:]:
        for k in KEEPS:
            out.append({"name": f"random-{k}-s{seed}", "type": "control", "kept": random_heads(k, seed), "k": k,
                        "seed": seed})
    for lam in LAMS:
        out.append({"name": f"gates-lam{lam:g}", "type": "gated", "args": ["--lam", f"{lam:g}"]})
    return out


# ----------------------------------------------------------------------------- evaluation


def sentence_losses(model_dir: Path, path: str) -> dict:
    """Per-sentence next-token loss sums and token counts (``headlab lm evaluate``'s text reading,
    encoding and loss: ``</s>`` predicted, ``<s>`` never), in text order."""
    import torch
    import torch.nn.functional as F

    from headlab.lm.data import collate_lm, encode_lm_corpus, read_text_corpus
    from headlab.loading import load_model, load_tokenizer

    text = read_text_corpus([path])
    # float32 on the GPU when there is one (the amendment of 2026-11-26), else on the CPU
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_model(str(model_dir)).eval().to(device)
    tokenizer = load_tokenizer(str(model_dir))
    max_positions: int = model.config.max_position_embeddings  # type: ignore[union-attr, assignment]  # a PreTrainedModel
    corpus = encode_lm_corpus(tokenizer, text.sentences, max_positions)
    order = sorted(range(len(corpus.targets)), key=lambda i: len(corpus.targets[i]))
    nll = [0.0] * len(order)
    count = [0] * len(order)
    batch: list[int] = []
    batches = []
    for i in order:  # batches of at most 4,096 tokens, as headlab lm evaluate
        if batch and (len(batch) + 1) * len(corpus.targets[i]) > 4096:
            batches.append(batch)
            batch = []
        batch.append(i)
    batches.append(batch)
    with torch.inference_mode():
        for indices in batches:
            b = {key: value.to(device) for key, value in collate_lm(corpus, indices, tokenizer.pad_token_id).items()}
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False).logits
            loss = F.cross_entropy(logits.float().transpose(1, 2), b["labels"], ignore_index=-100, reduction="none")
            for row, i in enumerate(indices):
                nll[i] = float(loss[row].sum())
                count[i] = int((b["labels"][row] != -100).sum())
    total, tokens = sum(nll), sum(count)
    return {"file": path, "device": str(device), "sha256": hashlib.sha256(Path(path).read_bytes()).hexdigest(),
            "sentences": len(nll), "tokens": tokens, "loss": total / tokens, "perplexity": math.exp(total / tokens),
            "sentence_nll": [round(x, 5) for x in nll], "sentence_tokens": count}


def kept_heads(model_dir: Path) -> list[tuple[int, int]]:
    """The original (layer, head) of every head a (pruned) model directory still has."""
    record = model_dir / "headlab_pruning.json"
    if not record.is_file():
        return heads()
    blocks = json.loads(record.read_text())["blocks"].get(KIND, {})
    return [(layer, head) for layer in range(N_LAYERS)
            for head in (blocks[str(layer)]["kept_heads"] if str(layer) in blocks else range(N_HEADS))]


# ----------------------------------------------------------------------------- running


class Runner(heavy_lifting_runner.Runner):
    def __init__(self, args):
        super().__init__(args)
        self.evals = dict(item.split("=", 1) for item in args.eval)
        self.train_file = self.root / "data" / "train.txt"
        self.train_files = args.train
        self.extra = args.extra_train_args.split() if args.extra_train_args else []
        self.recipe = [str(args.epochs) if i and RECIPE[i - 1] == "--epochs" else item for i, item in enumerate(RECIPE)]

    def status_name(self) -> str:
        return "STATUS" if self.only is None else f"STATUS-{os.getpid()}"  # drivers side by side (--only)

    def prepare(self) -> None:
        """The fine-tuning text: the LM's own training files, one sentence a line (CoNLL-U read
        with its spacing, as headlab lm train reads it)."""
        if self.train_file.is_file():
            return
        from headlab.lm.data import read_text_corpus

        text = read_text_corpus(self.train_files)
        tmp = self.train_file.with_name("train.txt.tmp")
        tmp.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text("".join(s.replace("\n", " ") + "\n" for s in text.sentences))
        os.replace(tmp, self.train_file)
        atomic_json(self.root / "data" / "train.json", {"files": self.train_files, "sentences": len(text.sentences),
                                                        "sha256": hashlib.sha256(self.train_file.read_bytes()).hexdigest()})

    def evaluate(self, model_dir: Path, out: Path, extra: dict) -> None:
        result = {"model": str(model_dir), "kept": [list(h) for h in kept_heads(model_dir)], **extra, "sets": {}}
        for name, path in self.evals.items():
            result["sets"][name] = sentence_losses(model_dir, path)
        atomic_json(out, result)

    def run_one(self, config: dict) -> None:
        run = self.root / config["name"]
        if (run / "eval.json").is_file():
            return
        self.status(f"running {config['name']}")
        run.mkdir(parents=True, exist_ok=True)
        log = run / "log.txt"
        kind = config["type"]
        if kind == "reference":
            self.evaluate(Path(self.model), run / "eval.json", {"config": config})
        elif kind == "ablation":
            start = run / "model"
            if not (start / "headlab_pruning.json").is_file():
                self.headlab(["prune", "apply", self.model, "--heads", removal_spec(config["kept"]),
                              "--out", str(start)], log)
            self.evaluate(start, run / "eval.json", {"config": config})
        else:
            model = self.model
            args = list(config.get("args", []))
            if kind == "control":
                model = str(run / "start")
                if not (run / "start" / "headlab_pruning.json").is_file():
                    if self.headlab(["prune", "apply", self.model, "--heads", removal_spec(config["kept"]),
                                     "--out", model], log):
                        raise RuntimeError(f"{config['name']}: prune apply failed, see {log}")
                args = ["--lam", "0"]
            started = time.time()
            code = self.headlab(["prune", "train", model, "--train-text", str(self.train_file), *self.recipe, *self.extra, *args,
                                 "--out", str(run / "prune"), "--resume"], log)
            if code:
                raise RuntimeError(f"{config['name']}: prune train exited {code}, see {log}")
            self.evaluate(run / "prune" / "pruned", run / "eval.json",
                          {"config": config, "train_seconds_this_session": time.time() - started})
        self.done.append(config["name"])

    def run(self) -> int:
        self.prepare()
        return self.run_configs([c for c in plan(self.labels) if self.only is None or c["name"] in self.only])


# ----------------------------------------------------------------------------- main


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("labels", help="labels per head from a headlab functions run on EWT dev")
    p.add_argument("functions_dir")
    p.add_argument("--out", required=True)
    p = sub.add_parser("plan", help="print the configurations in run order")
    p.add_argument("--labels", required=True)
    p = sub.add_parser("run", help="run every configuration not yet finished (resumable)")
    p.add_argument("--root", required=True, help="run directory (one sub-directory per configuration)")
    p.add_argument("--labels", required=True)
    p.add_argument("--model", default=str(ROOT / "models" / "english-lm"))
    p.add_argument("--train", nargs="+", required=True, help="the fine-tuning text (the LM's training files)")
    p.add_argument("--eval", nargs="+", required=True, metavar="NAME=FILE", help="evaluation texts")
    p.add_argument("--deadline", type=lambda s: dt.datetime.fromisoformat(s.replace("Z", "+00:00")),
                   help="UTC time (ISO 8601) at which the running training is interrupted and the driver stops")
    p.add_argument("--only", help="comma list of configuration names (testing the driver)")
    p.add_argument("--extra-train-args", help="appended to every prune train command (testing: '--max-steps 2')")
    p.add_argument("--epochs", type=int, default=1,
                   help="epochs of every trained configuration (the plan's second-epoch step: 2, in a new --root)")
    p = sub.add_parser("report", help="apply the decision rules to the finished configurations")
    p.add_argument("--root", required=True)
    p.add_argument("--labels", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--previous", help="the run directory of the epoch before: each run's held-out change since then")
    args = parser.parse_args(argv)
    if args.command == "labels":
        atomic_json(Path(args.out), labels_from_functions(Path(args.functions_dir)))
        labels = json.loads(Path(args.out).read_text())
        print(f"specialised: {labels['specialised']}")
        return 0
    if args.command == "plan":
        for config in plan(json.loads(Path(args.labels).read_text())):
            print(json.dumps(config))
        return 0
    if args.command == "run":
        return Runner(args).run()
    from heavy_lifting_report import write_report  # experiments/heavy_lifting_report.py

    write_report(Path(args.root), json.loads(Path(args.labels).read_text()), Path(args.out),
                 Path(args.previous) if args.previous else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
