"""Do specialised heads do the heavy lifting in translation? Matched controls and a fair Table 2
on models/multi30k-en-de (issue 35, items 2 and 3).

The prediction and the decision rules, written before any run: experiments/heavy_lifting_nmt.md.

    python experiments/heavy_lifting_nmt.py labels FUNCTIONS_DIR --out labels.json
    python experiments/heavy_lifting_nmt.py plan --labels labels.json [--stage 2]
    python experiments/heavy_lifting_nmt.py run --root RUNS --labels labels.json [--data DIR] [--results DIR] \
        [--model DIR] [--stage 1|2] [--deadline 2026-11-27T06:00Z] [--only NAME,...]
    python experiments/heavy_lifting_nmt.py report --root RUNS --labels labels.json [--data DIR] [--results DIR] --out DIR

``labels`` turns the EN-DE functions results on EWT dev (not the fine-tuning data:
docs/results/reproduction/multi30k-en-de/functions, or a ``headlab functions`` output directory)
into one label per encoder head by Voita et al.'s criteria (the same as heavy_lifting_lm.py:
positional >= 90% of the maxima at one offset, Sec. 5.1; syntactic >= 10 points above the
offset baseline, Sec. 5.2.1; rare-token: the head with the largest share of maxima on the
rarest token, Sec. 5.3) and a specialisation score that ranks the least specialised heads.

``run`` works through the configurations of :func:`plan`, each in its own directory under
``--root`` with one ``headlab prune baseline`` command (its ``baseline/`` output, its log and,
when finished, ``eval.json``):

* controls of the gated encoder points: the model with all but k encoder heads removed (k random,
  seeds 1-3, or the k least specialised), fine-tuned with every decoder parameter frozen by the
  recipe of the fixed-lambda points (``prune baseline --freeze-decoder --finetune-steps 864``,
  lr 1e-4 constant, 2,048-token batches, bf16, the development curve every 108 updates);
  ``--stage 2`` continues them to 1,728 updates in the same directories;
* the fair Table 2: the pruned configurations of the reproduction's Table 2 points trained from
  scratch with the full model's recipe (lr 7e-4, 400 warm-up updates, 14 epochs = 3,024 updates,
  the mean of the last 4 epoch checkpoints), and the full architecture by the same command (the
  calibration: does this path reproduce the bundled model?).

A configuration with ``eval.json`` is skipped; one cut short resumes (``prune baseline`` continues
a fine-tuning or a from-scratch training from its last checkpoint, every 100 updates). At the
deadline the running command gets SIGINT (its checkpoint stays) and the driver stops; ``STATUS``
under ``--root`` says what is done and what runs. On a CUDA machine the trainer uses the GPU; give
every path explicitly (``--data``, ``--results``, ``--model``).

``archive`` copies each finished configuration's result files (its ``eval*.json``, log, rows,
development curve and translations; no weights, tokenizer or lock) into the repository,
``docs/results/heavy-lifting-nmt/finished/<configuration>/`` by default, in the same layout: a run
lives on a machine that a later session may not have, so what is finished is committed. A stage-2
continuation rewrites its translations, log and curve in the same run directory, so a run with
``eval-1728.json`` goes to ``<configuration>/stage-2/`` and the stage-1 copy stays as it was
scored. ``run`` skips a configuration archived there (``--archived``), and ``report --root`` reads
the archive as it reads a run directory.

``report`` reads the result files and applies the rules of heavy_lifting_nmt.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import shlex
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
KIND = "enc_self"
N_LAYERS, N_HEADS = 6, 8
KS = (8, 5, 2, 1)  # the encoder head counts of the reproduction's fixed-lambda points
GATED = {8: "lam-0.005", 5: "lam-0.01", 2: "lam-0.02", 1: "lam-0.05"}  # prune/enc/<point> keeping k heads
SEEDS = (1, 2, 3)
STEPS = {1: 864, 2: 1728}  # stage 1: the gated points' 4 epochs of 216 updates; stage 2: 8 epochs

# The fine-tuning of the fixed-lambda points (docs/reproduction.md, stage prune-enc), without gates.
CONTROL = ["--freeze-decoder", "--lr", "1e-4", "--max-tokens", "2048", "--mixed-precision", "bf16",
           "--eval-beam", "1", "--dev-every", "108", "--threads", "1"]
# The fixed-lambda points' own command (prune-enc), for their stage-2 continuation to 8 epochs.
GATED_RECIPE = ["--gates", "enc_self", "--max-tokens", "2048", "--epochs", "8", "--lr", "1e-4", "--gate-lr", "0.05",
                "--log-every", "20", "--eval-beam", "1", "--dev-every", "108", "--mixed-precision", "bf16",
                "--threads", "1", "--no-progress", "--resume"]
# The full model's recipe (models/multi30k-en-de/README.md): lr 7e-4 after 400 warm-up updates, then
# 1/sqrt(step); 14 epochs of 2,048-token batches; the mean of epochs 11-14; label smoothing 0.1; bf16.
SCRATCH = ["--from-scratch", "--scratch-epochs", "14", "--scratch-lr", "7e-4", "--scratch-warmup-steps", "400",
           "--scratch-average-last", "4", "--max-tokens", "2048", "--mixed-precision", "bf16", "--eval-beam", "1",
           "--threads", "1"]
# The Table 2 points of docs/reproduction.md (scratch and scratch-enc stages): name, point, kinds, heads.
# Left behind by ``archive``: weights, tokenizers, checkpoints and locks (the result files are small).
ARCHIVE_SKIP_DIRS = frozenset({"tokenizer", "last", "averaged", "epochs", ".headlab"})
ARCHIVE_SKIP_SUFFIXES = (".safetensors", ".pt", ".bin", ".tmp")
# what only loads the pruned weights, which are not archived (a gated point's prune/pruned/): the tokenizer and the
# loader code, a copy of headlab.portable_code
ARCHIVE_SKIP_FILES = frozenset({"tokenizer.json", "tokenizer_config.json", "pruned_heads.py"})
ARCHIVE = ROOT / "docs" / "results" / "heavy-lifting-nmt" / "finished"
TABLE2 = (("scratch-enc-5", "enc/lam-0.01", "enc_self", 5), ("scratch-84", "all/lam-0.005", "all", 84),
          ("scratch-30", "all/lam-0.02", "all", 30), ("scratch-full", None, "all", 144))


def heads() -> list[tuple[int, int]]:
    return [(layer, head) for layer in range(N_LAYERS) for head in range(N_HEADS)]


def atomic_json(path: Path, value) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # drivers side by side never share one
    tmp.write_text(json.dumps(value, indent=1) + "\n")
    os.replace(tmp, path)


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# ----------------------------------------------------------------------------- labels


def _table(functions_dir: Path, *names: str) -> dict:
    """A score table of the functions results: the flat names of docs/results or the layout of
    ``headlab functions`` (``positional/share.json``)."""
    for name in names:
        if (functions_dir / name).is_file():
            return json.loads((functions_dir / name).read_text())
    raise SystemExit(f"{functions_dir}: none of {', '.join(names)}")


def labels_from_functions(functions_dir: Path) -> dict:
    """One label per encoder head (see the module doc)."""
    tables = {"share": ("positional_share.json", "positional/share.json"),
              "offset": ("positional_offset.json", "positional/offset.json"),
              "margin": ("syntactic_margin.json", "syntactic/margin.json"),
              "rarest": ("rare_rarest.json", "rare_tokens/rarest.json")}
    files = {key: _table(functions_dir, *names) for key, names in tables.items()}
    share, offset, margin, rarest = (files[key]["scores"][KIND] for key in ("share", "offset", "margin", "rarest"))
    rows = label_rows(heads(), share, offset, margin, rarest)
    return {"kind": KIND, "source": str(functions_dir),
            "sha256": {key: sha256(functions_dir / next(n for n in names if (functions_dir / n).is_file()))
                       for key, names in tables.items()},
            "signature": files["share"].get("signature", {}),
            "criteria": {"positional": f"share of maxima at one offset >= {POSITIONAL_BAR} (word level)",
                         "syntactic": f"accuracy - offset baseline >= {SYNTACTIC_BAR} on a scored relation-direction",
                         "rare": "the head with the largest share of maxima on the sentence's rarest token",
                         "score": "max(positional share / 0.90, syntactic margin / 0.10, rarest share / largest)"},
            "heads": rows,
            "specialised": [[r["layer"], r["head"]] for r in rows if r["specialised"]],
            "least_specialised_8": [list(h) for h in least_specialised({"heads": rows}, 8)]}


def least_scores(labels: dict) -> list[list[float]]:
    """A HeadScores table whose k best heads are the k least specialised: minus the score, and a
    tie-break by (layer, head) well below the scores' spacing."""
    scores = [[0.0] * N_HEADS for _ in range(N_LAYERS)]
    for r in labels["heads"]:
        scores[r["layer"]][r["head"]] = -r["score"] - 1e-9 * (r["layer"] * N_HEADS + r["head"])
    return scores


# ----------------------------------------------------------------------------- the plan


def plan(labels: dict, stage: int = 1) -> list[dict]:
    """Every configuration, in run order: per k the trio (least specialised, random seed 1) from
    the sparsest, then no encoder head at all, the fair Table 2 (the encoder point first, the full
    architecture last), then the random seeds 2 and 3. ``stage`` 2: the controls only, continued
    to 1,728 updates (the from-scratch runs have no stage 2)."""
    out: list[dict] = []
    steps = STEPS[stage]

    def control(name, k, method, seed=None):
        c = {"name": name, "type": "control", "k": k, "method": method, "steps": steps}
        if seed is not None:
            c["seed"] = seed
        if method == "least":
            c["kept"] = [list(h) for h in least_specialised(labels, k)]
        return c

    for k in sorted(KS):
        out += [control(f"least-{k}", k, "least"), control(f"random-{k}-s1", k, "random", 1)]
    out.append(control("random-0", 0, "random", 1))
    if stage == 1:
        for name, point, kinds, n in TABLE2:
            out.append({"name": name, "type": "scratch", "point": point, "kinds": kinds, "k": n})
    for seed in SEEDS[1:]:
        out += [control(f"random-{k}-s{seed}", k, "random", seed) for k in sorted(KS)]
    if stage == 2:  # the gated points continued to 8 epochs (from their train/last when copied in, see the plan)
        out += [{"name": f"gated-{GATED[k]}", "type": "gated", "point": GATED[k], "k": k, "steps": steps}
                for k in sorted(KS)]
        out.append({"name": "gated-lam-0", "type": "gated", "point": "lam-0", "k": 48, "steps": steps})
    return out


def archive(root: Path, out: Path) -> list[str]:
    """Copy every finished configuration under ``root`` (one with an ``eval*.json``) to
    ``out/<configuration>`` without its weights, a stage-2 continuation to
    ``out/<configuration>/stage-2`` (:func:`archived_dir`); each copy is built beside and then
    swapped in, so an interrupted archive leaves the previous copy whole. A configuration whose
    archived ``eval*.json`` is the run's is left as it is. Returns the configurations copied
    (``name`` or ``name/stage-2``)."""
    import shutil

    def ignore(directory: str, names: list[str]) -> list[str]:
        return [n for n in names
                if n in ARCHIVE_SKIP_DIRS or n in ARCHIVE_SKIP_FILES or n.endswith(ARCHIVE_SKIP_SUFFIXES)]

    copied = []
    for run in sorted(p for p in root.iterdir() if p.is_dir() and any(p.glob("eval*.json"))):
        stage = 2 if (run / eval_file({"steps": STEPS[2]})).is_file() else 1
        target = archived_dir(out, run.name, stage)
        result = eval_file({"steps": STEPS[stage]})
        if (target / result).is_file() and (target / result).read_bytes() == (run / result).read_bytes():
            continue  # archived already; a stage-2 continuation under way may be changing its other files
        tmp, old = target.with_name(f".{target.name}.tmp"), target.with_name(f".{target.name}.old")
        for leftover in (tmp, old):
            shutil.rmtree(leftover, ignore_errors=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(run, tmp, ignore=ignore)
        if stage == 1 and (target / "stage-2").is_dir():  # a stage-1 copy made again keeps the continuation
            shutil.copytree(target / "stage-2", tmp / "stage-2")
        if target.exists():
            target.rename(old)
        tmp.rename(target)
        shutil.rmtree(old, ignore_errors=True)
        copied.append(str(target.relative_to(out)))
    return copied


def archived_dir(out: Path, name: str, stage: int) -> Path:
    """Where ``archive`` keeps a configuration: ``out/<name>`` for stage 1 (and the from-scratch
    runs), ``out/<name>/stage-2`` for a stage-2 continuation, whose translations, log and
    development curve replace stage 1's in its run directory."""
    return out / name / "stage-2" if stage == 2 else out / name


def eval_file(config: dict) -> str:
    """``eval.json`` of stage 1 (and of a from-scratch run); a stage-2 continuation of a control
    writes ``eval-1728.json`` beside it, so that the stage-1 result stays."""
    return "eval.json" if config.get("steps", STEPS[1]) == STEPS[1] else f"eval-{config['steps']}.json"


# ----------------------------------------------------------------------------- running


class Runner(heavy_lifting_runner.Runner):
    def __init__(self, args):
        super().__init__(args)
        self.data = Path(args.data).resolve()
        self.results = Path(args.results).resolve()
        self.stage = args.stage
        self.extra = shlex.split(args.extra_train_args or "")
        self.extra_control = shlex.split(args.extra_control_args or "")
        self.extra_scratch = shlex.split(args.extra_scratch_args or "")
        self.extra_gated = shlex.split(args.extra_gated_args or "")
        archived = getattr(args, "archived", None)  # a Namespace built by hand (tests) may lack it
        self.archived = Path(archived).resolve() if archived else None
        self._model = None

    def result_file(self, config: dict) -> str:
        return eval_file(config)

    def file(self, name: str) -> str:
        path = self.data / name
        if not path.is_file():
            raise SystemExit(f"--data {self.data}: no {name}")
        return str(path)

    def prepare(self) -> None:
        """The score file that ranks the least specialised heads first, checked against the labels."""
        import numpy as np

        from headlab.heads import HeadScores
        from headlab.pruning.baselines import scores_spec

        scores = HeadScores({KIND: np.array(least_scores(self.labels))}, "least_specialised", self.model,
                            {"labels": self.labels["source"], "rule": "minus the specialisation score"})
        path = self.root / "data" / "least_specialised.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        scores.save(path)
        for k in KS:
            removed = {(layer, h) for (kind, layer), hs in scores_spec(scores, k, (KIND,)).items() for h in hs}
            kept = sorted(set(heads()) - removed)
            if kept != least_specialised(self.labels, k):
                raise SystemExit(f"{path}: its {k} best heads {kept} are not the {k} least specialised")

    def loaded_model(self):
        if self._model is None:
            from headlab.loading import load_model

            self._model = load_model(self.model)
        return self._model

    def kept(self, config: dict, scores_file: str | None) -> list[list]:
        """[kind, layer, head] of every head of the pruned kinds that the configuration keeps."""
        from headlab.heads import HeadScores
        from headlab.pruning.baselines import _heads, random_spec, scores_spec
        from headlab.pruning.train import resolve_kinds

        model = self.loaded_model()
        kinds = (KIND,) if config["type"] == "control" or config["kinds"] == KIND else resolve_kinds(model, "all")
        if scores_file is None:
            spec = random_spec(model, config["k"], kinds, config.get("seed", 1))
        else:
            spec = scores_spec(HeadScores.load(scores_file), config["k"], kinds)
        removed = {(kind, layer, h) for (kind, layer), hs in spec.items() for h in hs}
        return [list(h) for h in _heads(model, kinds) if h not in removed]

    def command(self, config: dict, out: Path) -> tuple[list[str], str | None]:
        data = ["--train-src", self.file("train.en.gz"), "--train-tgt", self.file("train.de.gz"),
                "--valid-src", self.file("test_2016_flickr.en.gz"), "--valid-tgt", self.file("test_2016_flickr.de.gz")]
        if config["type"] == "gated":
            lam = config["point"].removeprefix("lam-")
            return ["prune", "train", self.model, *data, "--lam", lam, "--dev-src", self.file("val.en.gz"),
                    "--dev-tgt", self.file("val.de.gz"), *GATED_RECIPE, *self.extra, *self.extra_gated,
                    "--out", str(out.parent / "prune")], None
        if config["type"] == "control":
            scores = str(self.root / "data" / "least_specialised.json") if config["method"] == "least" else None
            method = ["--method", "scores", "--scores", scores] if scores else \
                ["--method", "random", "--seeds", str(config["seed"])]
            argv = ["prune", "baseline", self.model, *data, *method, "--keeps", str(config["k"]), "--kinds", KIND,
                    "--finetune-steps", str(config["steps"]), "--dev-src", self.file("val.en.gz"),
                    "--dev-tgt", self.file("val.de.gz"), *CONTROL, *self.extra, *self.extra_control, "--out", str(out)]
            return argv, scores
        if config["point"] is None:
            method, scores = ["--method", "random", "--seeds", "1"], None
        else:
            scores = str(self.results / "prune" / config["point"] / "gates.json")
            method = ["--method", "scores", "--scores", scores]
        argv = ["prune", "baseline", self.model, *data, *method, "--kinds", config["kinds"], "--keeps", str(config["k"]),
                *SCRATCH, *self.extra, *self.extra_scratch, "--out", str(out)]
        return argv, scores

    def evaluate(self, config: dict, run: Path, argv: list[str], scores: str | None, seconds: float) -> None:
        """eval.json: the row, BLEU and chrF recomputed from the kept translations (sacreBLEU), the
        heads kept, the training curve and the development plateau."""
        from headlab.data import read_lines
        from headlab.nmt.bleu import compute_scores

        rows = json.loads((run / "baseline" / "baselines.json").read_text())
        if len(rows) != 1 and config["type"] == "scratch":
            raise RuntimeError(f"{run}: {len(rows)} rows, expected one")
        steps = int(argv[len(argv) - 1 - argv[::-1].index("--finetune-steps") + 1]) if "--finetune-steps" in argv else 0
        row = rows[-1] if config["type"] == "scratch" else next(r for r in rows if r["finetune_steps"] == steps)
        method = "random" if scores is None else "scores"
        seed = config.get("seed", 1) if method == "random" else None
        prefix = "scratch" if config["type"] == "scratch" else "ft"
        train_dir = run / "baseline" / f"{prefix}-{method}-{config['k']}-{seed}"
        hypotheses = (train_dir / "hypotheses.txt").read_text(encoding="utf-8").splitlines()
        references = read_lines(self.file("test_2016_flickr.de.gz"))[: len(hypotheses)]
        measured = compute_scores(hypotheses, references)
        if abs(measured.bleu - row["bleu"]) > 1e-6:
            raise RuntimeError(f"{train_dir}/hypotheses.txt scores {measured.bleu} BLEU, the row {row['bleu']}")
        kept = self.kept(config, scores)
        if config["type"] == "scratch" and config["point"] is not None:  # the heads of the pruned point
            blocks = json.loads((self.results / "prune" / config["point"] / "kept.json").read_text())["blocks"]
            kinds = {kind for kind, _, _ in kept} | set(blocks)
            expected = [(kind, layer, h) for kind in kinds for layer in range(N_LAYERS)  # a layer not listed: whole
                        for h in (blocks.get(kind, {}).get(str(layer), {}).get("kept_heads", range(N_HEADS)))]
            if sorted(expected) != sorted(map(tuple, kept)):
                raise RuntimeError(f"{config['name']}: the heads trained are not those of {config['point']}")
        history_file = train_dir / "history.json"
        history = json.loads(history_file.read_text()) if history_file.is_file() else []
        atomic_json(run / eval_file(config), {
            "config": config, "row": row, "hypotheses": str(train_dir / "hypotheses.txt"),
            "hypotheses_sha256": sha256(train_dir / "hypotheses.txt"), "n_sentences": len(hypotheses),
            "bleu": measured.bleu, "chrf": measured.chrf, "bleu_signature": measured.bleu_signature,
            "kept": kept, "train_loss_by_epoch": [h["train_loss"] for h in history],
            "dev_plateau": row.get("dev_plateau"), "seconds_this_session": seconds,
            "command_extra": {"train": self.extra, "control": self.extra_control, "scratch": self.extra_scratch}})

    def evaluate_gated(self, config: dict, run: Path, seconds: float) -> None:
        """eval-1728.json of a continued gated point: its result.json, its translations' BLEU."""
        from headlab.data import read_lines
        from headlab.nmt.bleu import compute_scores

        result = json.loads((run / "prune" / "result.json").read_text())
        hypotheses = (run / "prune" / "hypotheses.txt").read_text(encoding="utf-8").splitlines()
        measured = compute_scores(hypotheses, read_lines(self.file("test_2016_flickr.de.gz"))[: len(hypotheses)])
        if abs(measured.bleu - result["metrics"]["bleu"]) > 1e-6:
            raise RuntimeError(f"{run}/prune/hypotheses.txt scores {measured.bleu} BLEU, result.json "
                               f"{result['metrics']['bleu']}")
        atomic_json(run / eval_file(config), {
            "config": config, "hypotheses": str(run / "prune" / "hypotheses.txt"), "n_sentences": len(hypotheses),
            "hypotheses_sha256": sha256(run / "prune" / "hypotheses.txt"), "bleu": measured.bleu,
            "chrf": measured.chrf, "heads_kept": result["heads_kept"], "steps": result["step"],
            "dev_plateau": (result.get("dev") or {}).get("plateau"), "seconds_this_session": seconds})

    def run_one(self, config: dict) -> None:
        run = self.root / config["name"]
        if (run / eval_file(config)).is_file():
            return
        stage = 1 if eval_file(config) == "eval.json" else 2
        if self.archived is not None and (archived_dir(self.archived, config["name"], stage) / eval_file(config)).is_file():
            self.status(f"{config['name']}: archived in {self.archived}, skipped")
            return
        self.status(f"running {config['name']}")
        argv, scores = self.command(config, run / "baseline")
        started = time.time()
        code = self.headlab(argv, run / "log.txt")
        if code:
            raise RuntimeError(f"{config['name']}: prune baseline exited {code}, see {run / 'log.txt'}")
        if config["type"] == "gated":
            self.evaluate_gated(config, run, time.time() - started)
        else:
            self.evaluate(config, run, argv, scores, time.time() - started)
        self.done.append(config["name"])

    def run(self) -> int:
        self.prepare()
        configs = [c for c in plan(self.labels, self.stage) if self.only is None or c["name"] in self.only]
        if self.only is not None and len(configs) != len(self.only):
            raise SystemExit(f"--only: no configuration named {sorted(self.only - {c['name'] for c in configs})}")
        return self.run_configs(configs)


# ----------------------------------------------------------------------------- speed


def measure_speed(model_dir: str, data: Path, which: str, updates: int) -> dict:
    """Seconds per update of one configuration's training, in this process's thread settings:
    ``control`` (8 random encoder heads, decoder frozen, the controls' recipe) or ``scratch`` (the
    full architecture from random weights, the full model's recipe). The first update (allocator
    warm-up) is left out; the load average says how busy the machine was."""
    import torch

    from headlab.data import read_parallel
    from headlab.loading import load_model, load_tokenizer
    from headlab.nmt.train import TrainConfig, train
    from headlab.pruning import baselines
    from headlab.pruning.train import _decoder_parameters
    from headlab.surgery import prune_heads

    tokenizer = load_tokenizer(model_dir)
    corpus = read_parallel(str(data / "train.en.gz"), str(data / "train.de.gz"), max_tokens=100)
    model = load_model(model_dir)
    trainable = None
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"heavy-lifting-nmt-speed-{which}"
    if which == "control":
        prune_heads(model, baselines.random_spec(model, 8, (KIND,), seed=1))
        frozen = _decoder_parameters(model)

        def trainable(name, parameter):
            return parameter.requires_grad and id(parameter) not in frozen
        config = TrainConfig(out_dir=str(out), max_tokens=2048, lr=1e-4, warmup_steps=0, schedule="constant",
                             max_epochs=10**6, max_steps=updates, validate=False, keep_epoch_checkpoints=False,
                             mixed_precision="bf16", overwrite=True, progress=False)
    else:
        torch.manual_seed(1)
        model = type(model)._from_config(model.config)  # type: ignore[attr-defined]  # a PreTrainedModel
        config = TrainConfig(out_dir=str(out), max_tokens=2048, lr=7e-4, warmup_steps=400, max_epochs=10**6,
                             max_steps=updates, validate=False, keep_epoch_checkpoints=False, mixed_precision="bf16",
                             overwrite=True, progress=False)
    stamps: list[tuple[int, float]] = []
    train(model, tokenizer, corpus, None, config, trainable=trainable, log=lambda message: None,
          callback=lambda m, step, info: stamps.append((step, time.perf_counter())), callback_every=1)
    seconds = [b[1] - a[1] for a, b in zip(stamps, stamps[1:])]
    device = next(model.parameters()).device
    return {"which": which, "device": str(device), "threads": torch.get_num_threads(), "updates_timed": len(seconds),
            "s_per_update_mean": sum(seconds) / len(seconds), "s_per_update_min": min(seconds),
            "s_per_update_max": max(seconds), "load_average": os.getloadavg(),
            "when": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}


# ----------------------------------------------------------------------------- main


def _when(text: str) -> dt.datetime:
    value = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    return value if value.tzinfo else value.replace(tzinfo=dt.timezone.utc)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("labels", help="labels per encoder head from the EN-DE functions results on EWT dev")
    p.add_argument("functions_dir")
    p.add_argument("--out", required=True)
    p = sub.add_parser("speed", help="seconds per update of a control and of a from-scratch training")
    p.add_argument("--model", default=str(ROOT / "models" / "multi30k-en-de"))
    p.add_argument("--data", default=str(ROOT / "data" / "multi30k"))
    p.add_argument("--updates", type=int, default=13)
    p.add_argument("--out", help="append the measurements (JSON lines) to this file")
    p = sub.add_parser("plan", help="print the configurations in run order")
    p.add_argument("--labels", required=True)
    p.add_argument("--stage", type=int, choices=(1, 2), default=1)
    for name in ("run", "report"):
        p = sub.add_parser(name, help={"run": "run every configuration not yet finished (resumable)",
                                       "report": "apply the decision rules to the finished configurations"}[name])
        p.add_argument("--root", required=True, help="run directory (one sub-directory per configuration)")
        p.add_argument("--labels", required=True)
        p.add_argument("--data", default=str(ROOT / "data" / "multi30k"), help="the Multi30k files (.gz)")
        p.add_argument("--results", default=str(ROOT / "docs" / "results" / "reproduction" / "multi30k-en-de"),
                       help="the reproduction's EN-DE results (gates.json and kept.json of the points, their "
                            "translations and development curves)")
        p.add_argument("--stage", type=int, choices=(1, 2), default=1)
    p = sub.choices["run"]
    p.add_argument("--model", default=str(ROOT / "models" / "multi30k-en-de"))
    p.add_argument("--deadline", type=_when, help="UTC time (ISO 8601) at which the running training is "
                                                 "interrupted and the driver stops")
    p.add_argument("--only", help="comma list of configuration names")
    p.add_argument("--archived", default=str(ARCHIVE), help="skip the configurations finished there (archive's "
                                                          "--out; '' for none)")
    p.add_argument("--extra-train-args", help="appended to every prune baseline command (testing: '--limit 40')")
    p.add_argument("--extra-control-args", help="appended to the controls' commands (testing: '--finetune-steps 2')")
    p.add_argument("--extra-scratch-args", help="appended to the from-scratch commands (testing: '--scratch-epochs 1')")
    p.add_argument("--extra-gated-args", help="appended to the stage-2 prune train commands (testing: '--max-steps 2')")
    sub.choices["report"].add_argument("--out", required=True)
    p = sub.add_parser("archive", help="copy the finished configurations' result files (no weights) into the repository")
    p.add_argument("--root", required=True, help="run directory of `run`")
    p.add_argument("--out", default=str(ARCHIVE))
    args = parser.parse_args(argv)
    if args.command == "labels":
        labels = labels_from_functions(Path(args.functions_dir))
        atomic_json(Path(args.out), labels)
        print(f"specialised: {labels['specialised']}; 8 least specialised: {labels['least_specialised_8']}")
        return 0
    if args.command == "speed":
        import torch

        torch.set_num_threads(1)
        for which in ("control", "scratch"):
            row = measure_speed(args.model, Path(args.data), which, args.updates)
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a") as out:
                    out.write(json.dumps(row) + "\n")
        return 0
    if args.command == "plan":
        for config in plan(json.loads(Path(args.labels).read_text()), args.stage):
            print(json.dumps(config))
        return 0
    if args.command == "run":
        return Runner(args).run()
    if args.command == "archive":
        copied = archive(Path(args.root), Path(args.out))
        print(f"archived {len(copied)} in {args.out}: {', '.join(copied) or 'none finished'}")
        return 0
    from heavy_lifting_nmt_report import write_report  # experiments/heavy_lifting_nmt_report.py

    write_report(Path(args.root), json.loads(Path(args.labels).read_text()), Path(args.data), Path(args.results),
                 Path(args.out), args.stage)
    return 0


if __name__ == "__main__":
    sys.exit(main())
