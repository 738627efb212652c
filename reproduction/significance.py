"""Uncertainty for docs/reproduction.md: test-set translations and paired bootstrap intervals.

BLEU differences between two configurations are judged with a paired bootstrap over the test
sentences (Koehn 2004, as sacreBLEU implements it): the same resampled sentence indices score
both systems, and the 2.5th and 97.5th percentiles of the resampled differences give a 95%
interval. The p-value is sacreBLEU's own (``PairedTest``, ``test_type="bs"``). Correlations over
heads get a bootstrap interval over heads.

Per-sentence translations exist where a sweep point kept the ones its BLEU was computed from
(``hypotheses.txt``, written by the sweep; they travel with the committed results, so a point
needs no weights afterwards), or where the translated weights still exist: the full model, and
a point whose pruned model is on the machine (its ``pruned/`` directory in the work dir, or a
bundled model in ``models/`` whose ``prune_result.json`` names that point). The ``hypotheses``
stage translates the latter greedily (beam 1, batch 64, as the sweeps evaluate) and writes
``<work>/hypotheses/<name>.txt``, and the weights each came from in
``<work>/hypotheses/sources.json`` (a file whose weights have changed since is made again); the
report copies the translations to the results dir. A point without them has no interval, and
its verdict says so.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import numpy as np

from headlab.heads import atomic_write_text
from headlab.nmt.bleu import N_SAMPLES, SEED, bleu_interval, paired_bootstrap
from headlab.resume import SkipStage, weights_fingerprint
from reproduction.config import ModelEntry, ReproduceConfig

__all__ = ["paired_bootstrap", "bleu_interval", "spearman_interval", "pruned_models", "run_hypotheses", "N_SAMPLES", "SEED"]


def spearman_interval(a, b, *, n_samples: int = 2000, seed: int = 0, level: float = 0.95) -> tuple[float, float, float]:
    """Spearman's rho over the finite pairs of ``a``, ``b`` and its bootstrap interval over heads
    (95% unless ``level`` says otherwise, e.g. a Bonferroni-widened one)."""
    from headlab.importance import spearman

    x, y = np.ravel(np.asarray(a, dtype=float)), np.ravel(np.asarray(b, dtype=float))
    ok = np.isfinite(x) & np.isfinite(y)
    x, y = x[ok], y[ok]
    rng = np.random.default_rng(seed)
    samples = [spearman(x[i], y[i]) for i in (rng.integers(0, len(x), len(x)) for _ in range(n_samples))]
    samples = [v for v in samples if not math.isnan(v)]  # a resample with one distinct value has no rho
    if not samples:  # constant scores: no correlation to bound
        return spearman(x, y), math.nan, math.nan
    tail = round((1 - level) / 2 * 100, 9)  # 95% -> exactly 2.5, as before
    low, high = np.percentile(samples, [tail, 100 - tail])
    return spearman(x, y), float(low), float(high)


def pruned_models(config: ReproduceConfig, model: ModelEntry) -> dict[str, Path]:
    """``{"<sweep>-<point>": directory}`` of every sweep point of the bundled weights whose pruned
    weights exist here: a bundled pruned model whose ``prune_result.json`` records those weights
    (``model_sha256``) and names the point, or a point's ``pruned/`` in the work dir."""
    found: dict[str, Path] = {}
    model_dir = config.path(model.path)
    weights = weights_fingerprint(model_dir)
    for card in sorted(model_dir.parent.glob("*/prune_result.json")):
        record = json.loads(card.read_text(encoding="utf-8"))
        out_dir = Path(record.get("out_dir", ""))
        # Only a model pruned from the weights bundled now (an older card records none: unknown).
        if record.get("model_sha256") != weights or weights is None:
            continue
        if len(out_dir.parts) >= 4 and out_dir.parts[-4:-2] == (model.name, "prune"):
            found[f"{out_dir.parts[-2]}-{out_dir.parts[-1]}"] = card.parent
    for sweep in ("enc", "all"):
        directory = config.work(model, "prune", sweep)
        for pruned in sorted(directory.glob("*/pruned")) if directory.is_dir() else []:
            if (pruned / "config.json").is_file():
                found[f"{sweep}-{pruned.parent.name}"] = pruned
    return found


def run_hypotheses(config: ReproduceConfig, model: ModelEntry, *, force: bool = False,
                   log: Callable[[str], None] = print) -> list[str]:
    """Translate the test set with the full model and every pruned model found (resumable)."""
    import time

    import torch

    from headlab.data.parallel import read_lines
    from headlab.loading import load_model, load_tokenizer
    from headlab.nmt.bleu import compute_scores
    from headlab.nmt.translate import translate

    if not (config.path(model.path) / "config.json").is_file():
        raise SkipStage(f"no model at {model.path}")
    torch.set_num_threads(config.threads)
    split = config.prune.get("eval_split", "test")
    sources = [s.strip() for s in read_lines(config.data_file(split, model.src))]
    references = [t.strip() for t in read_lines(config.data_file(split, model.tgt))]
    work = config.work(model, "hypotheses")
    made_from_file = work / "sources.json"  # {name: weights_fingerprint of the directory translated}
    made_from = json.loads(made_from_file.read_text(encoding="utf-8")) if made_from_file.is_file() else {}
    done = []
    for name, directory in {"full": config.path(model.path), **pruned_models(config, model)}.items():
        if (directory.parent / "hypotheses.txt").is_file() and directory.name == "pruned":
            continue  # a sweep point that wrote its own translations (the ones its BLEU scores)
        path = work / f"{name}.txt"
        weights = weights_fingerprint(directory)
        if path.is_file() and not force and made_from.get(name) == weights:
            continue
        started = time.perf_counter()
        net, tokenizer = load_model(str(directory)), load_tokenizer(str(directory))
        hypotheses = translate(net, tokenizer, sources, beam=1, batch_size=64)
        atomic_write_text(path, "".join(h.replace("\n", " ") + "\n" for h in hypotheses))
        made_from[name] = weights
        atomic_write_text(made_from_file, json.dumps(made_from, indent=1, sort_keys=True) + "\n")
        bleu = compute_scores(hypotheses, references).bleu
        log(f"  {model.name} {name}: BLEU {bleu:.2f} on {len(sources)} sentences ({time.perf_counter() - started:.0f} s)")
        done.append(f"(Python) translate {config.rel(config.data_file(split, model.src))} with {config.rel(directory)} "
                    f"(greedy) -> hypotheses/{name}.txt")
    return done
