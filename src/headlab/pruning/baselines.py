"""Baselines at equal head counts, same data, same evaluation (Voita et al. 2019, Fig. 7, Table 2).

Each baseline gives a head spec of heads to *remove* (the format of :func:`headlab.prune_heads`)
leaving ``keep`` heads of the chosen kinds:

- ``random``: a uniformly random subset (report mean +- std over several seeds);
- ``michel``: iterative pruning by gradient importance (Michel et al. 2019, Sec. 4-5): the
  importance of head h is I_h = E_x |dL(x)/dg_h| over sentences x at the current mask (Eq. 4;
  one gate row per sentence), normalised per layer by its l2 norm (Sec. 4.1); the
  least important ``step_fraction`` of all heads go, importance is recomputed, and so on;
- ``scores``: the ``keep`` best heads of a HeadScores file (confidence, LRP, ...).

:func:`evaluate_baseline` removes the heads physically, optionally fine-tunes with the same
budget as gated fine-tuning (the spec fixed; with ``freeze_decoder`` every decoder parameter
frozen, as gated fine-tuning of encoder heads, Sec. 6.2), and scores with
:func:`headlab.pruning.train.evaluate_model`. :func:`train_from_scratch` is the paper's "from
scratch" column: the pruned configuration trained from random initialisation (optionally scored
as the mean of its last epoch checkpoints, as the full model was made).

Each row records the weights it started from (``model_sha256``), the precision of its training
if it trains (``mixed_precision``) and, for ``scores``, the score file's fingerprint
(``scores_sha256``), and what else its numbers depend on (:func:`_settings`: the test set, the
beam, the training data and settings). A row of other weights, or of the same method and head
count trained in another precision, from another score file or with other settings, is stale:
:func:`run_baselines` moves it to ``baselines.stale.json`` and runs it again. A from-scratch
training or a fine-tuning cut short goes on from its last checkpoint when it was started for the
same heads and settings (``scratch_run.json``, ``finetune_run.json``).
"""

from __future__ import annotations

import json
import math
from itertools import islice
from pathlib import Path
from typing import Any, Callable, cast

import numpy as np
import torch

from headlab.adapters import attention_blocks
from headlab.errors import HeadlabError, counted
from headlab.heads import KINDS, HeadScores, atomic_write_text, read_json, write_json
from headlab.importance.gradient import gate_gradients, l2_normalize_per_layer
from headlab.model_description import describe_model
from headlab.nmt.train import TrainConfig, train
from headlab.pruning.config import BaselineConfig
from headlab.pruning.dev import DEV_CURVE_FILE
from headlab.resume import pairs_fingerprint
from headlab.training.corpus import scoring_batches
from headlab.training.loop import STATE_FILE, load_weights

__all__ = ["random_spec", "scores_spec", "gradient_importance", "michel_spec", "evaluate_baseline",
           "train_from_scratch", "METHODS", "BaselineConfig", "run_baselines", "read_rows", "baselines_markdown"]

Spec = dict[tuple[str, int], list[int]]


def _heads(model, kinds) -> list[tuple[str, int, int]]:
    # not an idle block's (a tower token ids never run, its pruning refused) in a kind text runs (ModernVBERT's)
    return [(b.kind, b.layer, h) for b in attention_blocks(model) if b.kind in kinds and not b.idle
            for h in range(b.n_heads)]


def _check_keep(keep: int, n: int, kinds) -> None:
    if not 0 <= keep <= n:
        raise HeadlabError(f"cannot keep {counted(keep, 'head')}: the model has {counted(n, 'head')} of {', '.join(kinds)}")


def _spec(removed) -> Spec:
    spec: Spec = {}
    for kind, layer, head in removed:
        spec.setdefault((kind, layer), []).append(head)
    return {key: sorted(v) for key, v in sorted(spec.items(), key=lambda kv: (KINDS.index(kv[0][0]), kv[0][1]))}


def random_spec(model, keep: int, kinds=("enc_self",), seed: int = 0) -> Spec:
    """Remove all but ``keep`` uniformly chosen heads of ``kinds``."""
    heads = _heads(model, kinds)
    _check_keep(keep, len(heads), kinds)
    order = torch.randperm(len(heads), generator=torch.Generator().manual_seed(seed)).tolist()
    return _spec(heads[i] for i in order[keep:])


def scores_spec(scores: HeadScores, keep: int, kinds=("enc_self",), model=None) -> Spec:
    """Keep the ``keep`` best-scored heads (e.g. confidence or LRP, Voita et al. 2019, Sec. 4);
    with ``model``, in its current numbering (a pruned model's scores number its heads as before)."""
    if model is not None:
        from headlab.surgery import removal_by_scores

        return removal_by_scores(model, scores, keep, tuple(kinds))
    return scores.top_mask(keep, tuple(kinds))


def gradient_importance(model, tokenizer, data, kinds=("enc_self",), removed: Spec | None = None, *,
                        batch_tokens: int = 2000, max_batches: int | None = None) -> HeadScores:
    """Michel et al. 2019, Eq. 4: I_h = E_x |dL(x)/dg_h| over sentences x, gates at 1 (0 for heads
    already removed), then divided per layer by its l2 norm (Sec. 4.1). Removed heads get NaN, after
    the norm: their gradient at gate 0 counts in their layer's norm, as in the BERTology pruning
    script (transformers' research examples, ``run_bertology.py``); ``compute_gradient(mask=)``
    leaves them out of it, as a model without them would.

    :func:`headlab.importance.gradient.gate_gradients` on the training batches (token budget,
    the loss against the reference) instead of the importance data."""
    batches = (({k: b[k] for k in ("input_ids", "attention_mask", "decoder_input_ids")}, b["labels"])
               for b in islice(scoring_batches(model, tokenizer, data, batch_tokens), max_batches))
    removed = removed or {}
    scores, n_sentences, _ = gate_gradients(model, batches, describe_model(model, tokenizer), kinds=tuple(kinds),
                                            mask=removed)
    raw = HeadScores(scores, "gradient_importance", getattr(model.config, "name_or_path", ""),
                     {"method": "Michel et al. 2019, Eq. 4", "n_sentences": n_sentences})
    return l2_normalize_per_layer(raw).without(removed)


def michel_spec(model, tokenizer, data, keep: int, kinds=("enc_self",), *, step_fraction: float = 0.1,
                max_batches: int | None = None, on_step: Callable[[Spec], None] | None = None) -> Spec:
    """Michel et al. 2019, Sec. 5: repeatedly remove the ``step_fraction`` least important heads
    (of all heads of ``kinds``), recomputing importance each time, until ``keep`` remain.
    ``on_step(spec)`` sees every intermediate mask (one point of a pruning curve each)."""
    from headlab.heads import renumbered_blocks
    from headlab.surgery import original_heads

    # Its gradient scores name a pruned model's heads by their original index (block_scores), its
    # masks and the spec it returns by the current one: where they differ the ranked head would not
    # be the one removed. Refused, as a silent wrong result would be.
    moved = [f"{kind}:{layer}" for kind, layer in renumbered_blocks(
        {b.key: original_heads(b) for b in attention_blocks(model) if b.kind in kinds})]
    if moved:
        raise HeadlabError(f"--method michel on a pruned model whose kept heads are not each layer's first ones "
                           f"({', '.join(moved)}): its importance names heads by their original index and its masks by "
                           "the current one; run it on the unpruned model, or use --method random or scores")
    heads = _heads(model, kinds)
    _check_keep(keep, len(heads), kinds)
    step = max(1, math.ceil(step_fraction * len(heads)))
    removed: Spec = {}
    remaining = len(heads)
    while remaining > keep:
        scores = gradient_importance(model, tokenizer, data, kinds, removed, max_batches=max_batches)
        ranked = [h for h in scores.rank(descending=False)]  # least important first; removed are NaN
        n = min(step, remaining - keep)
        already = [(k, l, h) for (k, l), hs in removed.items() for h in hs]
        removed = _spec(already + list(ranked[:n]))  # a new dict: earlier ones given to on_step stay as they were
        remaining -= n
        if on_step is not None:
            on_step(removed)
    return removed


def evaluate_baseline(model, tokenizer, spec: Spec, eval_data, *, train_data=None,
                      finetune: TrainConfig | None = None, beam: int = 4, batch_size: int = 64,
                      freeze_decoder: bool = False, hypotheses_file=None, dev=None) -> dict:
    """Remove ``spec`` physically, optionally fine-tune (``finetune`` with the spec fixed: the
    removed heads no longer exist; ``freeze_decoder``: the decoder's parameters, the output
    embeddings and everything tied to them get no gradient and are not in the optimizer), and
    score on ``eval_data`` (its translations to ``hypotheses_file`` when given). ``dev``: a
    :class:`headlab.pruning.dev.DevCurve` evaluated before the first update, every ``dev.every``
    updates and after the last, as in gated fine-tuning; the row's ``dev_plateau`` is its
    second-half comparison."""
    from headlab.pruning.train import _decoder_parameters, evaluate_model, heads_per_kind
    from headlab.surgery import prune_heads

    prune_heads(model, spec)
    result: dict[str, Any] = {"heads_kept": heads_per_kind(model)}
    if finetune is not None:
        if train_data is None:
            raise HeadlabError("fine-tuning a baseline needs training data")
        trainable = None
        if freeze_decoder:
            if not getattr(model.config, "is_encoder_decoder", False):
                raise HeadlabError(f"--freeze-decoder: {type(model).__name__} has no decoder to freeze")
            frozen = _decoder_parameters(model)  # after the pruning: the parameters that train

            def trainable(name, parameter):
                return parameter.requires_grad and id(parameter) not in frozen
        done = _finished_steps(finetune)
        hooks = {}
        if dev is not None:
            if not dev.done(0):
                dev.evaluate(model, 0)  # the starting point (on resume, train() loads the later weights)
            hooks = {"callback": dev.callback, "callback_every": dev.every}
        if done is None:
            outcome = train(model, tokenizer, train_data, None, finetune, trainable=trainable, **hooks)
            result["finetune_steps"] = outcome.step
            if outcome.stopped == "diverged":
                result["status"] = "diverged"
        else:  # stopped after its last update, before its row: another update would be one too many
            from headlab.shard import new_accelerator

            load_weights(model, Path(finetune.out_dir) / "last")
            model.to(new_accelerator().device)  # translated where the trainer would have left it
            result["finetune_steps"] = done
        if freeze_decoder:
            result["freeze_decoder"] = True
        if dev is not None:
            if not dev.done(result["finetune_steps"]):
                dev.evaluate(model, result["finetune_steps"])
            result["dev_plateau"] = dev.summary()["plateau"]
    result.update(evaluate_model(model, tokenizer, eval_data, beam=beam, batch_size=batch_size,
                                 hypotheses_file=hypotheses_file))
    return result


def _finished_steps(config: TrainConfig) -> int | None:
    """The updates of a resumable run in ``config.out_dir`` that already made its ``max_steps``
    (its ``last/`` holds the final weights), else None. The trainer, resumed there, would start
    another epoch and make one more update before it saw the limit."""
    if not config.resume or config.max_steps is None:
        return None
    try:
        step = json.loads((Path(config.out_dir) / "last" / STATE_FILE).read_text())["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return step if isinstance(step, int) and step >= config.max_steps else None


def train_from_scratch(model, tokenizer, spec: Spec, train_data, eval_data, config: TrainConfig, *,
                       seed: int = 1, beam: int = 4, valid_data=None) -> dict:
    """The paper's "from scratch" column (Voita et al. 2019, Table 2): the pruned configuration
    trained from random initialisation. Costs a full training; ``model`` gives the architecture.
    The translations it is scored by go to ``hypotheses.txt`` in the run's directory (for a paired
    comparison with the pruned model)."""
    from headlab.pruning.train import HYPOTHESES_FILE, evaluate_model, heads_per_kind
    from headlab.surgery import prune_heads

    torch.manual_seed(seed)
    fresh = type(model)._from_config(model.config)
    if getattr(model, "generation_config", None) is not None:
        fresh.generation_config = model.generation_config
    prune_heads(fresh, spec)
    outcome = train(fresh, tokenizer, train_data, valid_data, config)
    result = {"heads_kept": heads_per_kind(fresh), "train_steps": outcome.step, "status": outcome.stopped}
    averaged = Path(config.out_dir) / "averaged"
    if config.average_last and outcome.stopped in ("finished", "converged"):
        # The trainer wrote the mean of the last epoch checkpoints there (Vaswani et al. 2017,
        # Sec. 6.1); the full model was made so, so the from-scratch column is scored so too.
        load_weights(fresh, averaged)
        result["averaged_epochs"] = json.loads((averaged / "metrics.json").read_text())["averaged_epochs"]
    result.update(evaluate_model(fresh.eval(), tokenizer, eval_data, beam=beam,
                                 hypotheses_file=Path(config.out_dir) / HYPOTHESES_FILE))
    return result


METHODS = {"random": random_spec, "michel": michel_spec, "scores": scores_spec}


def read_rows(out_dir) -> list[dict]:
    """The rows already in ``out_dir/baselines.json`` (none when there is no such file); a file
    that is not such a table is an error naming it."""
    table_file = Path(out_dir) / "baselines.json"
    if not table_file.is_file():
        return []
    rows = read_json(table_file, "baselines table")
    keys = ("method", "keep", "finetune_steps")
    if not isinstance(rows, list) or not all(isinstance(r, dict) and all(k in r for k in keys) for r in rows):
        raise HeadlabError(f"{table_file}: not a baselines table (a JSON list of rows with {', '.join(keys)}); "
                           "move it away or choose another --out")
    return rows


def run_baselines(load: Callable[[], tuple], train_data, eval_data, config: BaselineConfig, out_dir, *,
                  dev_data=None, log: Callable[[str], None] = print, progress: bool = True) -> str:
    """Run every (keep, seed) point of ``config`` not yet in ``out_dir/baselines.json`` (resumable:
    each row is written as soon as it is known) on a fresh model from ``load()``; write and return
    the table ``baselines.md`` (mean +- std over seeds). ``dev_data`` with ``config.dev_every``:
    the development curve of each fine-tuning (:mod:`headlab.pruning.dev`). ``progress``: the
    progress bar of a --from-scratch training (the fine-tuning shows none)."""
    out = Path(out_dir)
    table_file = out / "baselines.json"
    settings = _settings(config, train_data, eval_data, dev_data)
    rows = _set_aside_stale(read_rows(out), config, out, settings)
    done = {(r["method"], r["keep"], r.get("seed"), r["finetune_steps"], r.get("from_scratch", False),
             bool(r.get("freeze_decoder"))) for r in rows}
    c = config
    method = _row_method(c)
    for keep in c.keeps:
        for seed in c.seeds:
            row_key = (method, keep, seed, c.finetune_steps, c.from_scratch, c.freeze_decoder and bool(c.finetune_steps))
            if row_key in done:
                continue
            done.add(row_key)  # a keep or seed given twice is one run, not two runs with no spread
            model, tokenizer = load()
            if c.method == "random":
                assert seed is not None  # --method random has seeds (the CLI refuses none)
                spec = random_spec(model, keep, c.kinds, seed)
            elif c.method == "scores":
                assert c.scores is not None  # --method scores reads a score file
                spec = scores_spec(c.scores, keep, c.kinds, model)
            else:
                spec = michel_spec(model, tokenizer, train_data, keep, c.kinds, max_batches=c.importance_batches)
            if c.from_scratch:
                run_dir = out / f"scratch-{c.method}-{keep}-{seed}"
                train_config = TrainConfig(out_dir=str(run_dir), max_tokens=c.max_tokens, max_epochs=c.scratch_epochs,
                                           lr=c.scratch_lr, warmup_steps=c.scratch_warmup_steps,
                                           average_last=c.scratch_average_last,
                                           validate=False, mixed_precision=c.mixed_precision, save_every_steps=100,
                                           overwrite=True, resume=_resumable_scratch(run_dir, spec, c, settings, log=log),
                                           progress=progress)
                result = train_from_scratch(model, tokenizer, spec, train_data, eval_data, train_config,
                                            beam=c.eval_beam)
            else:
                finetune, hypotheses = None, None
                if c.finetune_steps:
                    ft_dir = out / f"ft-{c.method}-{keep}-{seed}"
                    finetune = TrainConfig(out_dir=str(ft_dir), max_tokens=c.max_tokens,
                                           lr=c.lr, warmup_steps=0, schedule="constant", max_epochs=10**6,
                                           max_steps=c.finetune_steps, validate=False, keep_epoch_checkpoints=False,
                                           mixed_precision=c.mixed_precision, overwrite=True, progress=False,
                                           save_every_steps=100,
                                           resume=_resumable_scratch(ft_dir, spec, c, settings, FINETUNE_RUN_FILE,
                                                                     log=log))
                    hypotheses = ft_dir / "hypotheses.txt"  # for a paired comparison with other systems
                dev = _dev_curve(c, dev_data, finetune, tokenizer, model, log)
                result = evaluate_baseline(model, tokenizer, spec, eval_data, train_data=train_data,
                                           finetune=finetune, beam=c.eval_beam, freeze_decoder=c.freeze_decoder,
                                           hypotheses_file=hypotheses, dev=dev)
            rows.append({"method": method,
                         "keep": keep, "seed": seed, "finetune_steps": c.finetune_steps,
                         "from_scratch": c.from_scratch, **result, **_source(c), **settings})
            write_json(table_file, rows)
    text = baselines_markdown(rows)
    atomic_write_text(out / "baselines.md", text)
    return text


def _dev_curve(config: BaselineConfig, dev_data, finetune: TrainConfig | None, tokenizer, model, log):
    """The development curve of a fine-tuning, in its directory (None without one)."""
    from headlab.pruning.dev import DevCurve
    from headlab.pruning.train import heads_per_kind

    if finetune is None or dev_data is None or not config.dev_every:
        return None
    if config.dev_sentences:
        dev_data = dev_data.subset(config.dev_sentences)
    return DevCurve(dev_data, finetune.out_dir, config.dev_every, tokenizer=tokenizer,
                    open_heads=lambda: heads_per_kind(model), log=log)


SCRATCH_RUN_FILE = "scratch_run.json"
FINETUNE_RUN_FILE = "finetune_run.json"
_DEV_SETTINGS = ("dev_every", "dev_data_sha256")  # recorded in the run files since 2026-11-28


def _resumable_scratch(run_dir: Path, spec: Spec, config: BaselineConfig, settings: dict,
                       run_file_name: str = SCRATCH_RUN_FILE, *, log: Callable[[str], None] = print) -> bool:
    """Whether the from-scratch training (or the fine-tuning) in ``run_dir`` may be continued: only
    when it was started for the same heads, starting weights, training data and settings (the
    row's, without those of the evaluation; ``run_file_name``, written here before the training
    starts). Otherwise the run starts over (the trainer clears the directory), and says why when
    it had a checkpoint."""
    training = {name: value for name, value in settings.items() if not name.startswith("eval_")}
    run = {"spec": sorted([kind, layer, sorted(int(h) for h in heads)] for (kind, layer), heads in spec.items()),
           **_source(config), **training}
    run_file = run_dir / run_file_name
    try:
        recorded = json.loads(run_file.read_text())
    except (OSError, ValueError):
        recorded = None
    compared = run
    if isinstance(recorded, dict) and not any(name in recorded for name in _DEV_SETTINGS) and \
            (run_dir / DEV_CURVE_FILE).is_file() == ("dev_every" in run):
        # A run started before its development set was recorded (2026-11-28), with a curve as
        # this one has: its set taken as this one's, as rows of that time are kept (_set_aside_stale).
        compared = {name: value for name, value in run.items() if name not in _DEV_SETTINGS}
    same = recorded == compared
    if not same and isinstance(recorded, dict) and (run_dir / "last").is_dir():
        differing = sorted(name for name in {*recorded, *compared} if recorded.get(name) != compared.get(name))
        log(f"{run_dir}: its checkpoint was trained with other {', '.join(differing)} ({run_file_name}); "
            "starting over")
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_file, json.dumps(run) + "\n")
    return same


def _trains(config: BaselineConfig) -> bool:
    return bool(config.finetune_steps or config.from_scratch)


def _row_method(config: BaselineConfig) -> str:
    """The method a row names: ``scores:<measure>`` for heads ranked by a score file."""
    return config.method if config.method != "scores" else f"scores:{cast(HeadScores, config.scores).method}"


def _source(config: BaselineConfig) -> dict:
    """What a row was made from: the starting weights, the precision of its training (if it
    trains) and, for ``scores``, the score file."""
    out = {"model_sha256": config.model_fingerprint or None}
    if _trains(config):
        out["mixed_precision"] = config.mixed_precision
    if config.method == "scores":
        out["scores_sha256"] = config.scores_fingerprint or None
    return out


def _settings(config: BaselineConfig, train_data, eval_data, dev_data=None) -> dict:
    """What else a row's numbers depend on, recorded in the row: the test set and beam, for a
    row that trains, its data and the settings of its training, and for a fine-tuning with a
    development curve, that curve's set and interval."""
    out: dict[str, Any] = {"eval_beam": config.eval_beam, "eval_data_sha256": _data_fingerprint(eval_data)}
    if config.method == "michel":
        out["importance_batches"] = config.importance_batches
    if config.finetune_steps and not config.from_scratch:
        out.update(lr=config.lr, max_tokens=config.max_tokens)
        if config.freeze_decoder:
            out["freeze_decoder"] = True
        if config.dev_every and dev_data is not None:  # the row's dev_plateau: another set's curve is another row
            dev = dev_data.subset(config.dev_sentences) if config.dev_sentences else dev_data
            out.update(dev_every=config.dev_every, dev_data_sha256=_data_fingerprint(dev))
    if config.from_scratch:
        out.update(max_tokens=config.max_tokens, scratch_epochs=config.scratch_epochs)
        # Recorded when not what every earlier row trained with (_IMPLICIT), so that their
        # rows and interrupted runs stay valid.
        out.update({name: getattr(config, name) for name in ("scratch_lr", "scratch_warmup_steps", "scratch_average_last")
                    if getattr(config, name) != _IMPLICIT[name]})
    if config.method == "michel" or _trains(config):  # importance or training reads the training data
        out["train_data_sha256"] = _data_fingerprint(train_data)
    return out


def _data_fingerprint(data) -> str | None:
    """SHA-256 of a corpus's sentence pairs (:func:`headlab.resume.pairs_fingerprint`)."""
    return pairs_fingerprint(data)


_IMPLICIT = {"freeze_decoder": False, "scratch_lr": 1e-3, "scratch_warmup_steps": 400, "scratch_average_last": 0}
"""Settings a row records only when they differ from these values (what rows trained with before
the options existed): a row without one of them was trained with this value."""


def _set_aside_stale(rows: list[dict], config: BaselineConfig, out: Path, settings: dict | None = None) -> list[dict]:
    """Rows of other weights, or of this method and head count trained in another precision, from
    another score file or with other recorded ``settings`` (test set, beam, data, training
    options), move to ``baselines.stale.json`` (appended); the rest are returned. A setting a row
    does not record (rows of earlier versions) counts as the same."""
    if not config.model_fingerprint:
        return rows
    method = _row_method(config)

    def stale(row: dict) -> bool:
        if row.get("model_sha256") != config.model_fingerprint:
            return True
        same = row["method"] == method and row["keep"] in config.keeps and \
            bool(row.get("from_scratch")) == config.from_scratch and row["finetune_steps"] == config.finetune_steps
        if same and _trains(config) and row.get("mixed_precision", "no") != config.mixed_precision:
            return True
        if same and any(name in row and row[name] != value for name, value in (settings or {}).items()):
            return True
        if same and any(row.get(name, default) != (settings or {}).get(name, default)
                        for name, default in _IMPLICIT.items()):
            return True
        # Rows record the scores' content fingerprint; older rows the file's bytes, which the
        # report's copy (paths made relative) changes, so a restored score file no longer matched.
        accepted = {config.scores_fingerprint or None, config.scores_file_fingerprint or None}
        return same and config.method == "scores" and row.get("scores_sha256") not in accepted

    old = [row for row in rows if stale(row)]
    if not old:
        return rows
    stale_file = out / "baselines.stale.json"
    earlier = read_json(stale_file, "stale baselines") if stale_file.is_file() else []
    write_json(stale_file, earlier + old)
    kept = [row for row in rows if not stale(row)]
    write_json(out / "baselines.json", kept)
    return kept


def baselines_markdown(rows: list[dict]) -> str:
    """The baselines table: mean +- std over seeds per (method, keep, fine-tuning, from scratch)."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        method = row["method"] + (", decoder frozen" if row.get("freeze_decoder") else "")
        groups.setdefault((method, row["keep"], row["finetune_steps"], row.get("from_scratch", False)), []).append(row)
    lines = ["| method | keep | fine-tune steps | from scratch | runs | BLEU | chrF | loss |",
             "|---|---|---|---|---|---|---|---|"]
    for (method, keep, steps, scratch), group in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        def stat(name):
            values = np.array([r[name] for r in group if r.get(name) is not None], dtype=float)  # noqa: B023 (called in this iteration)
            if not len(values):
                return ""
            return f"{values.mean():.2f} ± {values.std(ddof=1):.2f}" if len(values) > 1 else f"{values.mean():.2f}"
        lines.append(f"| {method} | {keep} | {steps} | {'yes' if scratch else 'no'} | {len(group)} | "
                     f"{stat('bleu')} | {stat('chrf')} | {stat('loss')} |")
    return "\n".join(lines) + "\n"
