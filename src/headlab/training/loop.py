"""The training loop: Accelerate, token-based batches, checkpoints that survive a kill.

One loop serves every trainer of headlab: the translation recipe (``headlab nmt train``,
:mod:`headlab.nmt.train`), language models (``headlab lm train``) and pruning with Hard
Concrete gates (``headlab prune train``), through these seams:

- ``compute_loss(model, batch, config) -> (loss_sum, n_tokens)``: the loss
  (:mod:`headlab.training.losses`; the default is label-smoothed cross-entropy of a seq2seq model),
  and ``collate_fn(corpus, indices) -> batch``, the batches it reads;
- ``extra_loss(model, batch, step) -> tensor``: added to the loss (e.g. the L0 penalty);
- ``trainable``: a predicate ``(name, param) -> bool`` or a collection of parameter names;
  everything else is frozen (``requires_grad=False``) and left out of the optimizer;
- ``callback(model, step, info)`` every ``callback_every`` steps, for diagnostics;
- ``validate_fn(model, tokenizer, valid_data, config) -> {"score": ...}`` after each epoch
  (translation: BLEU; a language model: perplexity).

Recipe (Vaswani et al. 2017, Sec. 5.3-5.4): Adam with beta=(0.9, 0.98), eps=1e-9; learning
rate rising linearly for ``warmup_steps`` then decaying with the inverse square root of the
step; label smoothing 0.1; batches of about ``max_tokens`` target tokens grouped by length.

Checkpoints (all written to a temporary directory first, then renamed into place):

- ``last/``: everything to resume, none of it a pickle: the weights (``model.safetensors``), the
  optimizer state (``optimizer.safetensors``) and each rank's RNG states (``rng-<rank>.safetensors``:
  torch's CPU generator, on a GPU the GPU's, numpy's and python's), the tensors in safetensors and
  the rest as JSON in its header (:mod:`headlab.training.state_files`), and the loop's position
  (``trainer_state.json``). A ``last/`` written before that format (``optimizer.pt``,
  ``rng-<rank>.pt``: ``torch.save`` of tensors and numbers) is still resumed, read with
  ``torch.load(weights_only=True)``;
- ``epochs/epoch-NNN/``: the weights after each epoch (loadable with ``from_pretrained``);
- ``best/``: the weights with the best validation score, plus the tokenizer.

A validation that is not finite stops the run as diverged and writes none of them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection, Sequence, cast

import torch
from safetensors.torch import load_file

from headlab.capture import float32_mask_floor
from headlab.data.batching import token_budget_batches
from headlab.errors import HeadlabError, counted
from headlab.heads import atomic_dir, atomic_write_text, json_text, moved_aside
from headlab.model_description import position_limit
from headlab.shard import leave_process_group_at_exit, new_accelerator
from headlab.training.config import TrainConfig
from headlab.training.corpus import EncodedCorpus, collate_for, encode_corpus
from headlab.training.losses import label_smoothed_loss
from headlab.training.state_files import (
    OPTIMIZER_FILE,
    load_optimizer,
    load_rng,
    optimizer_record,
    read_record,
    rng_file,
    save_optimizer,
    save_rng,
    set_rng,
)

__all__ = [
    "TrainResult",
    "inverse_sqrt_lr",
    "train",
    "average_checkpoints",
    "load_weights",
    "has_model",
    "check_resume_point",
    "refuse_occupied_output",
]

STATE_FILE = "trainer_state.json"
WEIGHTS_FILE = "model.safetensors"
# What the current epoch had done when `last/` was written (a fresh epoch: nothing yet).
_NO_PROGRESS: dict[str, Any] = {"seconds": 0.0, "tokens": 0, "loss": 0.0, "loss_tokens": 0}


@dataclass
class TrainResult:
    step: int
    epoch: int  # epochs completed
    best_score: float | None
    best_epoch: int | None
    history: list[dict]
    stopped: str  # "finished", "converged", "max_steps", "max_time", "diverged"
    out_dir: str
    message: str = ""
    averaged_score: float | None = None


# ----------------------------------------------------------------------------- schedule


def inverse_sqrt_lr(step: int, peak: float, warmup_steps: int, schedule: str = "inverse_sqrt") -> float:
    """Learning rate at update ``step`` (1-based): linear warm-up to ``peak``, then
    ``peak * sqrt(warmup / step)`` (Vaswani et al. 2017, Eq. 3, written with the peak rate)."""
    step = max(step, 1)
    if warmup_steps > 0 and step < warmup_steps:
        return peak * step / warmup_steps
    if schedule == "constant":
        return peak
    if schedule != "inverse_sqrt":
        raise HeadlabError(f"unknown schedule {schedule!r} (inverse_sqrt, constant)")
    return peak * math.sqrt(max(warmup_steps, 1) / step)


# ----------------------------------------------------------------------------- checkpoints


def has_model(path: str | Path) -> bool:
    """Whether ``path`` already holds a trained model or a training run."""
    path = Path(path)
    return any((path / name).exists() for name in ("last", "best", WEIGHTS_FILE, STATE_FILE))


def refuse_occupied_output(config: TrainConfig) -> None:
    """Before any work: an output directory holding a model is refused unless ``--overwrite`` or
    ``--resume`` says what to do with it (the recipes call this before reading their data)."""
    if has_model(config.out_dir) and not (config.overwrite or config.resume):
        raise HeadlabError(f"{config.out_dir} already holds a model or a training run; pass --overwrite to replace it "
                           "or --resume to continue it")


def _save_weights(model, directory: Path) -> None:
    # save_pretrained handles tied weights and writes config.json + generation_config.json.
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Writing model shards" bar inside the training bar
    try:
        model.save_pretrained(str(directory), safe_serialization=True)
    finally:
        if bars:
            hf_logging.enable_progress_bar()


# Options that change how long or how verbosely a run goes, not what it learns.
_RUN_ONLY_OPTIONS = frozenset({"max_time_minutes", "resume", "overwrite", "progress"})
CONFIG_CHANGES_FILE = "train_config_changes.json"
_MISSING = object()


# The options that make the batch list of an epoch, or its order (token_budget_batches: the seed shuffles, max_tokens
# cuts); the number of processes is checked beside them (it deals the batches out).
_BATCHING_OPTIONS = {"seed": "--seed", "max_tokens": "--max-tokens"}


def _options_in_force(out_dir: Path) -> dict | None:
    """The options the run in ``out_dir`` last ran with: train_config.json with each recorded change applied
    (None without train_config.json; an unreadable file is left to the caller's own reads)."""
    first_file, changes_file = out_dir / "train_config.json", out_dir / CONFIG_CHANGES_FILE
    try:
        in_force = json.loads(first_file.read_text(encoding="utf-8")) if first_file.is_file() else None
        changes = json.loads(changes_file.read_text(encoding="utf-8")) if changes_file.is_file() else []
        if not isinstance(in_force, dict):
            return None
        for change in changes:
            in_force.update(change["changed"])
    except (OSError, UnicodeDecodeError, ValueError, TypeError, KeyError):
        return None
    return in_force


def check_same_batches(out_dir: Path, config: TrainConfig, saved: dict) -> None:
    """Refuse a resume inside an epoch (``saved``: its trainer_state) with another --seed or --max-tokens than
    the run last ran with: the saved batch position indexes the batches those options made, so other ones
    would skip some pairs of the epoch and repeat others. At an epoch boundary (batch 0) the next epoch's
    batches are made afresh and every pair is seen once in it: allowed, and train_config_changes.json records it."""
    position = saved.get("batch_in_epoch")
    if not isinstance(position, int) or position == 0:
        return
    in_force = _options_in_force(out_dir)
    if in_force is None:
        return
    now = config.to_dict()
    changed = [f"{flag} {in_force[key]} (now {now[key]})" for key, flag in _BATCHING_OPTIONS.items()
               if key in in_force and in_force[key] != now[key]]
    if changed:
        raise HeadlabError(
            f"--resume: {out_dir} stopped inside epoch {saved.get('epoch', 0) + 1} (at batch {position}), whose batches "
            f"were made with other options: {'; '.join(changed)}; the position indexes those batches, so some pairs "
            "would be skipped and others seen twice; nothing was changed: resume with the same options (another "
            "order may start at an epoch boundary), or start again with --overwrite")


def _record_config_changes(out_dir: Path, config: TrainConfig, state: dict) -> None:
    """A resume may change options (a longer warm-up, another patience rule): train_config.json
    keeps the first start's, and each resume that changes any appends its step and the new values
    to train_config_changes.json, so that a run's record says what every part of it ran with."""
    first_file, changes_file = out_dir / "train_config.json", out_dir / CONFIG_CHANGES_FILE
    if not first_file.is_file():
        return
    in_force = json.loads(first_file.read_text(encoding="utf-8"))
    changes = json.loads(changes_file.read_text(encoding="utf-8")) if changes_file.is_file() else []
    for change in changes:
        in_force.update(change["changed"])
    now = json.loads(json.dumps(config.to_dict()))  # as train_config.json holds it (tuples as lists)
    changed = {key: value for key, value in now.items()
               if key not in _RUN_ONLY_OPTIONS and in_force.get(key, _MISSING) != value}
    if changed:
        changes.append({"step": state["step"], "epoch": state["epoch"] + 1, "batch_in_epoch": state["batch_in_epoch"],
                        "changed": changed})
        atomic_write_text(changes_file, _json(changes, CONFIG_CHANGES_FILE))


def _json(data: Any, where: str) -> str:
    """A training file's text: a NaN (a validation loss beside a finite BLEU, a record's train loss) as
    null, not the bare ``NaN`` token that is not JSON (heads.json_text); the readers take null as no
    number, and files written before with NaN tokens still read (Python's json takes them)."""
    return json_text(data, where, indent=2) + "\n"


def _save_scored(model, tokenizer, record: dict, directory: Path) -> None:
    """A checkpoint with its tokenizer and ``metrics.json`` (the best and the averaged one), atomically."""
    def write(tmp: Path) -> None:
        _save_weights(model, tmp)
        tokenizer.save_pretrained(str(tmp))
        (tmp / "metrics.json").write_text(_json(record, "metrics.json"))
    atomic_dir(directory, write)


def load_weights(model, path: str | Path) -> None:
    """Load safetensors weights saved by the trainer into ``model`` (no pickle involved).

    Keys left out of the file must be tied to a key present in it (shared embeddings) or be
    ones the model never saves (``_keys_to_ignore_on_save``, e.g. Marian's sinusoidal positions,
    which are recomputed at construction).
    """
    path = Path(path)
    if path.is_dir():
        path = path / WEIGHTS_FILE
    if not path.is_file():
        raise HeadlabError(f"no weights at {path}")
    state = load_file(str(path))
    result = model.load_state_dict(state, strict=False)
    if result.unexpected_keys:
        raise HeadlabError(f"{path} does not fit the model: unexpected keys {result.unexpected_keys[:5]}")
    current = model.state_dict()
    loaded_ptrs = {current[k].data_ptr() for k in state if k in current}
    untied = [k for k in result.missing_keys if current[k].data_ptr() not in loaded_ptrs and not _never_saved(model, k)]
    if untied:
        raise HeadlabError(f"{path} does not fit the model: missing keys {untied[:5]}")


def _damaged(path: Path, reason: str) -> str:
    return (f"--resume: {path} is damaged or not this run's ({reason}); nothing was changed: restore it, "
            "or start again without --resume and with --overwrite")


def _resume_file(path: Path, load: Callable[[Path], Any]) -> Any:
    """``load(path)`` for one file of the checkpoint resumed from; a truncated or corrupt file (a
    JSONDecodeError, safetensors' or torch's zip reader's error) is the user's exit 2 naming it,
    found before any step or any write."""
    try:
        return load(path)
    except HeadlabError:
        raise
    except FileNotFoundError as error:
        raise HeadlabError(_damaged(path, "the file is missing")) from error
    except Exception as error:  # noqa: BLE001 - json, safetensors, torch's zip reader, load_state_dict
        reason = str(error).splitlines()[0].split(". ")[0] if str(error) else type(error).__name__
        raise HeadlabError(_damaged(path, reason[:200])) from error


def check_resume_point(out_dir: str | Path, config: TrainConfig | None = None) -> None:
    """Refuse (exit 2, naming the file) a resume point whose files are damaged, before a caller
    writes anything: trainer_state.json parsed, the safetensors headers read (the optimizer's and
    the RNG's records parsed), a legacy ``.pt`` file's zip directory read (a truncated one has none).
    With ``config``, also a resume inside an epoch with other batches (:func:`check_same_batches`).
    Cheap: no tensor is loaded; the trainer's loads check the rest."""
    directory = _resume_dir(Path(out_dir))
    if directory is None:
        return
    saved = _resume_file(directory / STATE_FILE, lambda path: json.loads(path.read_text(encoding="utf-8")))
    if config is not None and isinstance(saved, dict):
        check_same_batches(Path(out_dir), config, saved)

    def header(path: Path) -> None:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as weights:
            weights.keys()

    _resume_file(directory / WEIGHTS_FILE, header)
    _resume_file(_optimizer_file(directory), _check_state_file)
    for path in sorted(directory.glob("rng-*.safetensors")) + sorted(directory.glob("rng-*.pt")):
        _resume_file(path, _check_state_file)


def _optimizer_file(directory: Path) -> Path:
    """``optimizer.safetensors``, or a legacy checkpoint's ``optimizer.pt`` when only that is there."""
    legacy = directory / "optimizer.pt"
    return legacy if legacy.is_file() and not (directory / OPTIMIZER_FILE).exists() else directory / OPTIMIZER_FILE


def _rng_file(directory: Path, rank: int) -> Path | None:
    """This rank's RNG states: ``rng-<rank>.safetensors``, a legacy ``rng-<rank>.pt``, or None."""
    for path in (directory / rng_file(rank), directory / f"rng-{rank}.pt"):
        if path.is_file():
            return path
    return None


def _check_state_file(path: Path) -> None:
    if path.suffix == ".pt":
        zipfile.ZipFile(path).close()
    else:
        read_record(path)


def _load_legacy(path: Path) -> Any:
    """A checkpoint written before the safetensors format: ``torch.save`` of tensors and numbers,
    read with torch's restricted unpickler (``weights_only=True``), the only unpickling left."""
    return torch.load(path, weights_only=True)


def _resume_dir(out_dir: Path) -> Path | None:
    # last.old: where atomic_dir moved the old copy before it used new directories of its own
    for candidate in (out_dir / "last", out_dir / "last.old", *moved_aside(out_dir / "last")):
        if (candidate / STATE_FILE).is_file() and (candidate / WEIGHTS_FILE).is_file():
            return candidate
    return None


def average_checkpoints(paths: Sequence[str | Path]) -> dict[str, torch.Tensor]:
    """The element-wise mean of the weights in ``paths`` (Vaswani et al. 2017, Sec. 6.1)."""
    if not paths:
        raise HeadlabError("no checkpoints to average")
    total: dict[str, torch.Tensor] = {}
    for path in paths:
        path = Path(path)
        state = load_file(str(path / WEIGHTS_FILE if path.is_dir() else path))
        for key, value in state.items():
            total[key] = total.get(key, 0) + value.double()
    return {key: (value / len(paths)).to(torch.float32) for key, value in total.items()}


# ----------------------------------------------------------------------------- the loop


def _never_saved(model, name: str) -> bool:
    """Whether ``save_pretrained`` leaves the tensor ``name`` out (``_keys_to_ignore_on_save``, e.g.
    Marian's sinusoidal positions, which are recomputed at construction)."""
    return any(re.search(pattern, name) for pattern in (getattr(model, "_keys_to_ignore_on_save", None) or ()))


def _select_trainable(model, trainable) -> list[torch.nn.Parameter]:
    """Set ``requires_grad`` by ``trainable`` and return the trained parameters.

    A parameter the model never saves is frozen whatever ``trainable`` says: no checkpoint could
    hold its updates, so a resumed run and the saved model would silently get the values it had at
    construction. (transformers v5's ``from_pretrained`` leaves Marian's sinusoidal positions
    trainable: fine-tuning a loaded model moved them and ``--resume`` reset them, issue 32.)"""
    if trainable is None:
        keep = lambda name, param: param.requires_grad  # noqa: E731
    elif callable(trainable):
        keep = trainable
    else:
        names = set(trainable)
        unknown = names - {name for name, _ in model.named_parameters()}
        if unknown:
            raise HeadlabError(f"unknown parameter names in trainable: {sorted(unknown)[:5]}")
        unsaved = sorted(name for name in names if _never_saved(model, name))
        if unsaved:
            raise HeadlabError(f"trainable names parameters the model never saves (so no checkpoint could hold "
                               f"their updates): {unsaved[:5]}")
        keep = lambda name, param: name in names  # noqa: E731
    for name, param in model.named_parameters():
        param.requires_grad_(bool(keep(name, param)) and not _never_saved(model, name))
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise HeadlabError("no trainable parameters selected")
    return params


def _epochs_without_improvement(state: dict) -> int:
    """Epochs validated since the last one that raised the best score by ``min_improvement``."""
    improved = state.get("improved_epoch")
    return 0 if improved is None else state["epoch"] - improved


def train(
    model,
    tokenizer,
    train_data,
    valid_data=None,
    config: TrainConfig | None = None,
    *,
    compute_loss: Callable[[Any, dict, TrainConfig], tuple[torch.Tensor, int]] = label_smoothed_loss,
    collate_fn: Callable[[EncodedCorpus, Sequence[int]], dict] | None = None,
    extra_loss: Callable[[Any, dict, int], torch.Tensor] | None = None,
    trainable: Callable[[str, torch.nn.Parameter], bool] | Collection[str] | None = None,
    callback: Callable[[Any, int, dict], None] | None = None,
    callback_every: int = 100,
    validate_fn: Callable[[Any, Any, Any, TrainConfig], dict] | None = None,
    optimizer_factory: Callable[[list[torch.nn.Parameter], TrainConfig], torch.optim.Optimizer] | None = None,
    accelerator=None,
    log: Callable[[str], None] | None = None,
) -> TrainResult:
    """Train ``model`` on ``train_data`` with Accelerate; checkpoint into ``config.out_dir``.

    ``train_data`` is a :class:`~headlab.data.ParallelCorpus` or an :class:`EncodedCorpus`;
    ``valid_data`` what ``validate_fn`` reads (required with it), or None. Runs unchanged under
    ``accelerate launch`` / ``torchrun``: each rank gets its own share of the batches.

    Hooks (see the module docstring): ``compute_loss``, ``collate_fn(corpus, indices) -> batch``
    (default: :func:`~headlab.training.corpus.collate` for a seq2seq model), ``extra_loss``,
    ``trainable``, ``callback``/``callback_every``, ``validate_fn(model, tokenizer, valid_data,
    config) -> {"score": higher-is-better, ...}`` and ``optimizer_factory(params, config)``. Models
    are passed to hooks unwrapped (not the DDP wrapper). The stages: the output directory
    (:func:`_prepare_output`), the data, the trained parameters and their optimizer, a fresh start
    or the resume point (:func:`_start` / :func:`_resume`), then the epochs (:class:`_Run`).
    """
    config = config or TrainConfig()
    if valid_data is not None and config.validate and validate_fn is None:
        raise HeadlabError("validation data needs a validate_fn(model, tokenizer, valid_data, config) -> {'score': ...}")
    accelerator = accelerator or new_accelerator()
    if accelerator.num_processes > 1:
        leave_process_group_at_exit()  # a caller's Accelerator too
    log = log or accelerator.print
    resume_from = _prepare_output(config, accelerator, log)

    if not isinstance(train_data, EncodedCorpus):
        train_data = encode_corpus(tokenizer, train_data, position_limit(model))
        if train_data.n_truncated:
            log(f"{train_data.n_truncated} training sequences cut to the model's "
                f"{position_limit(model)} positions")
    hooks = _Hooks(compute_loss, collate_fn or collate_for(model, tokenizer), extra_loss, callback, callback_every,
                   validate_fn)

    params = _select_trainable(model, trainable)
    if optimizer_factory is not None:
        optimizer = optimizer_factory(params, config)
    else:
        optimizer = torch.optim.Adam(
            params, lr=config.lr, betas=cast(tuple[float, float], tuple(config.adam_betas)), eps=config.adam_eps,
            weight_decay=config.weight_decay
        )
    optimizer_record(optimizer.state_dict())  # an optimizer_factory's groups that last/ cannot hold: refused now

    state = {"epoch": 0, "batch_in_epoch": 0, "step": 0, "best_score": None, "best_epoch": None,
             "improved_epoch": None, "history": [], "tokens": 0, "world_size": accelerator.num_processes,
             "elapsed_s": 0.0, "train_data_sha256": corpus_fingerprint(train_data)}
    if resume_from is not None:
        _resume(resume_from, model, optimizer, state, config, accelerator, log)
    else:
        _start(config, tokenizer, accelerator)
    run = _Run(model, tokenizer, optimizer, params, state, config, hooks, accelerator, log)
    # The floor: in a float64 model, transformers' eager attention gives NaN at a padding query that may attend to no
    # key (a sliding window past a right-padded row's end), which reaches the real rows (0 * NaN in the weighted sum
    # of values) and every gradient (the softmax's backward); float32 and bfloat16 masks are left as they are
    # (capture.float32_mask_floor). Validation runs under it too.
    with float32_mask_floor(model):
        return run.epochs(train_data, valid_data)


@dataclass
class _Hooks:
    """What a caller plugs into the loop (see :func:`train`)."""

    compute_loss: Callable[[Any, dict, TrainConfig], tuple[torch.Tensor, int]]
    collate_fn: Callable[[EncodedCorpus, Sequence[int]], dict]
    extra_loss: Callable[[Any, dict, int], torch.Tensor] | None
    callback: Callable[[Any, int, dict], None] | None
    callback_every: int
    validate_fn: Callable[[Any, Any, Any, TrainConfig], dict] | None


def _prepare_output(config: TrainConfig, accelerator, log: Callable[[str], None]) -> Path | None:
    """The resume point, or None: an occupied output directory is refused unless ``--overwrite``
    (which clears the old run's files) or ``--resume`` says what to do with it."""
    out_dir = Path(config.out_dir)
    resume_from = _resume_dir(out_dir) if config.resume else None
    if resume_from is None and has_model(out_dir) and not config.overwrite:
        raise HeadlabError(
            f"{out_dir} already holds a model or a training run; pass --overwrite to replace it"
            + ("" if config.resume else " or --resume to continue it")
        )
    if config.resume and resume_from is None:
        log(f"nothing to resume in {out_dir}; starting from scratch")
    if resume_from is None and config.overwrite and accelerator.is_main_process:
        for target in (*(out_dir / name for name in ("last", "last.old", "best", "epochs", "averaged", STATE_FILE,
                                                     "history.json")), *(p.parent for p in moved_aside(out_dir / "last"))):
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
    accelerator.wait_for_everyone()
    return resume_from


def corpus_fingerprint(corpus: EncodedCorpus) -> str:
    """SHA-256 of a training corpus's token ids (sources, then targets), in order."""
    from itertools import chain

    import numpy as np

    digest = hashlib.sha256()
    for side in (corpus.sources, corpus.targets):
        for start in range(0, len(side), 65536):  # in chunks: whole arrays are fast (a small share of the
            chunk = side[start:start + 65536]      # tokenization's time), and bounded in memory
            digest.update(np.fromiter(map(len, chunk), dtype=np.int64).tobytes())  # where each sequence ends
            digest.update(np.fromiter(chain.from_iterable(chunk), dtype=np.int64).tobytes())
        digest.update(b"\xff" * 8)
    return digest.hexdigest()


def _resume(resume_from: Path, model, optimizer, state: dict, config: TrainConfig, accelerator,
            log: Callable[[str], None]) -> None:
    """Load the loop's position, the weights, the optimizer and this rank's RNG from ``resume_from``
    into ``state``, ``model`` and ``optimizer``; a damaged file is refused naming it."""
    world_size = accelerator.num_processes
    saved = _resume_file(resume_from / STATE_FILE, lambda path: json.loads(path.read_text(encoding="utf-8")))
    if not isinstance(saved, dict) or not all(key in saved for key in ("epoch", "batch_in_epoch", "step")):
        raise HeadlabError(_damaged(resume_from / STATE_FILE, "not a training state"))
    recorded, now = saved.get("train_data_sha256"), state["train_data_sha256"]
    if recorded and recorded != now:  # a state written before it was recorded: not compared
        # the position (epoch, batch) indexes this run's batches: other data would mix two trainings, some pairs
        # skipped and others seen twice, under one record
        raise HeadlabError(
            f"--resume: {resume_from} was trained on other training pairs (SHA-256 of their token ids "
            f"{recorded[:12]}, now {now[:12]}); nothing was changed: resume with the same training data "
            "(--train-src/--train-tgt or --train-text, --limit, the same tokenizer), or start again with --overwrite")
    check_same_batches(Path(config.out_dir), config, saved)
    if saved.get("world_size", 1) != world_size:
        raise HeadlabError(
            f"{resume_from} was written by {counted(saved.get('world_size', 1), 'process', 'processes')}; resume with "
            f"the same number (now {world_size}) so the data order is the same"
        )
    state.update(saved)
    _resume_file(resume_from / WEIGHTS_FILE, lambda path: load_weights(model, path))
    optimizer_file = _optimizer_file(resume_from)
    _resume_file(optimizer_file, lambda path: optimizer.load_state_dict(
        _load_legacy(path) if path.suffix == ".pt" else load_optimizer(path)))
    rng_path = _rng_file(resume_from, accelerator.process_index)
    if rng_path is not None:
        _resume_file(rng_path, lambda path: set_rng(_load_legacy(path) if path.suffix == ".pt" else load_rng(path),
                                                    accelerator.device))
    else:  # a process killed between the new last/ and its own file's rename: resumable, but say what it costs
        log(f"{resume_from}: no random-generator state of process {accelerator.process_index} "
            f"({rng_file(accelerator.process_index)}: the run was stopped before it was written); this process "
            "draws from its generators as they are now, so its dropout and gate noise differ from an "
            "uninterrupted run's")
    legacy = [path.name for path in (optimizer_file, rng_path) if path is not None and path.suffix == ".pt"]
    if legacy:
        log(f"{resume_from}: {' and '.join(legacy)} {'is' if len(legacy) == 1 else 'are'} in the legacy torch.save "
            "format (read with torch.load(weights_only=True)); the checkpoints this run writes are safetensors")
    log(f"resuming from {resume_from}: epoch {state['epoch'] + 1}, batch {state['batch_in_epoch']}, step {state['step']}")
    if accelerator.is_main_process:
        _record_config_changes(Path(config.out_dir), config, state)


def _start(config: TrainConfig, tokenizer, accelerator) -> None:
    """A fresh run: seed this rank's dropout; the main rank writes the options and the tokenizer."""
    torch.manual_seed(config.seed + accelerator.process_index)  # dropout differs per rank; weights come from rank 0
    if accelerator.is_main_process:
        out_dir = Path(config.out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "train_config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
        tokenizer.save_pretrained(str(out_dir / "tokenizer"))


@dataclass
class _EpochProgress:
    """What the current epoch has done: an epoch resumed in its middle goes on from what its first
    part did, so that its record (minutes, speed, train loss) covers the whole epoch."""

    start: float
    tokens: int
    loss: float
    loss_tokens: int

    @classmethod
    def of(cls, state: dict) -> _EpochProgress:
        done = (state.get("epoch_progress") if state["batch_in_epoch"] else None) or _NO_PROGRESS
        loss = float("nan") if done["loss"] is None else done["loss"]  # null: a NaN written as JSON
        return cls(time.time() - done["seconds"], done["tokens"], loss, done["loss_tokens"])

    def saved(self) -> dict:
        return {"seconds": time.time() - self.start, "tokens": self.tokens, "loss": self.loss,
                "loss_tokens": self.loss_tokens}


class _Run:
    """The epochs of one run: the prepared model and optimizer, the state ``last/`` saves, the hooks."""

    def __init__(self, model, tokenizer, optimizer, params, state: dict, config: TrainConfig, hooks: _Hooks,
                 accelerator, log: Callable[[str], None]) -> None:
        self.tokenizer, self.params, self.state, self.config, self.hooks = tokenizer, params, state, config, hooks
        self.accelerator, self.log = accelerator, log
        self.out_dir = Path(config.out_dir)
        self.main = accelerator.is_main_process
        self.rank, self.world_size = accelerator.process_index, accelerator.num_processes
        self.model, self.optimizer = accelerator.prepare(model, optimizer)
        self.raw_model = accelerator.unwrap_model(self.model)
        self.model.train()
        if config.patience_metric not in ("score", "loss"):
            raise HeadlabError(f"patience_metric must be 'score' or 'loss', got {config.patience_metric!r}")
        if config.mixed_precision not in ("no", "bf16"):
            raise HeadlabError(f"mixed_precision must be 'no' or 'bf16', got {config.mixed_precision!r}")
        self.start_time = time.time()
        self.elapsed_before = state["elapsed_s"]
        self.ema_loss: float | None = None
        self.diverged = ""  # why the run diverged: what was not finite
        self.diverged_at = ""  # where, when not at the next update: a validation

    # -- the run
    def epochs(self, train_data: EncodedCorpus, valid_data) -> TrainResult:
        config, state = self.config, self.state
        stopped = "converged" if self._patience_spent() else "finished"
        if stopped == "finished" and state["epoch"] >= config.max_epochs:  # a finished run resumed: say so
            self.log(f"nothing to train: the run had done its {counted(state['epoch'], 'epoch')} (step {state['step']}; "
                     f"max_epochs {config.max_epochs}); give more epochs (--epochs) to go on")
        while state["epoch"] < config.max_epochs and stopped == "finished":
            epoch = state["epoch"]
            stopped, progress, n_batches = self._train_epoch(train_data)
            if stopped == "diverged":
                break
            if state["batch_in_epoch"] < n_batches:
                break  # stopped inside the epoch; `last/` holds the position
            if self._end_epoch(epoch, progress, valid_data) == "diverged":
                stopped = "diverged"
                break
            if self._patience_spent():
                stopped = "converged"

        message, shown = _stop_message(stopped, state, config, self.out_dir, self.diverged, self.diverged_at)
        if shown:
            self.log(message)
        averaged_score, bad_average = None, ""
        if config.average_last and stopped in ("finished", "converged") and config.keep_epoch_checkpoints:
            averaged_score, bad_average = _average_and_validate(
                self.raw_model, self.tokenizer, valid_data, config, state, self.out_dir, self.hooks.validate_fn,
                self.accelerator, self.log)
            if self.world_size > 1:  # only the main rank validates: every rank raises, none waits for it
                from accelerate.utils import broadcast_object_list

                averaged_score, bad_average = broadcast_object_list([averaged_score, bad_average])
        self.accelerator.wait_for_everyone()
        if bad_average:
            raise HeadlabError(bad_average)
        return TrainResult(
            step=state["step"], epoch=state["epoch"], best_score=state["best_score"], best_epoch=state["best_epoch"],
            history=state["history"], stopped=stopped, out_dir=str(self.out_dir), message=message,
            averaged_score=averaged_score,
        )

    def _patience_spent(self) -> bool:
        return self.config.patience > 0 and _epochs_without_improvement(self.state) >= self.config.patience

    # -- one epoch
    def _train_epoch(self, train_data: EncodedCorpus) -> tuple[str, _EpochProgress, int]:
        """The rest of the current epoch, batch by batch: why it stopped (``"finished"``: not
        stopped), what it did and its number of batches."""
        config, state, device = self.config, self.state, self.accelerator.device
        epoch = state["epoch"]
        batches = token_budget_batches(train_data, config.max_tokens, seed=config.seed, epoch=epoch, rank=self.rank,
                                       world_size=self.world_size)
        progress = _EpochProgress.of(state)
        bar = self._bar(len(batches), epoch)
        stopped = "finished"
        while state["batch_in_epoch"] < len(batches):
            if config.max_steps is not None and state["step"] >= config.max_steps:  # resumed at the limit: no update
                stopped = "max_steps"
                break
            batch = self.hooks.collate_fn(train_data, batches[state["batch_in_epoch"]])
            batch = {key: value.to(device) for key, value in batch.items()}
            step = state["step"] + 1
            lr = inverse_sqrt_lr(step, config.lr, config.warmup_steps, config.schedule)
            for group in self.optimizer.param_groups:
                group["lr"] = lr * group.get("lr_scale", 1.0)
            update = self._update(batch, step)
            if isinstance(update, str):
                self.diverged = update
                stopped = "diverged"
                break
            loss_value = self._count(step, *update, progress)
            speed = progress.tokens / max(time.time() - progress.start, 1e-9)
            bar.set_postfix(loss=f"{self.ema_loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{speed:.0f}", refresh=False)
            bar.update(1)
            hooks = self.hooks
            if hooks.callback is not None and hooks.callback_every > 0 and step % hooks.callback_every == 0:
                hooks.callback(self.raw_model, step, {"loss": loss_value, "lr": lr, "epoch": epoch, "tokens": state["tokens"],
                                                      "is_main_process": self.main, "accelerator": self.accelerator})
            stopped = self._limit_reached(step)
            if stopped != "finished" or (config.save_every_steps and step % config.save_every_steps == 0):
                state["elapsed_s"] = self.elapsed_before + time.time() - self.start_time
                state["epoch_progress"] = progress.saved()
                if state["batch_in_epoch"] < len(batches):
                    self._save_last()
                if stopped != "finished":
                    break
        bar.close()
        return stopped, progress, len(batches)

    def _bar(self, total: int, epoch: int):
        from tqdm.auto import tqdm

        interactive = sys.stderr.isatty()
        return tqdm(
            total=total, initial=self.state["batch_in_epoch"], desc=f"epoch {epoch + 1}/{self.config.max_epochs}",
            unit="step", disable=not (self.main and self.config.progress), mininterval=1.0 if interactive else 30.0,
            file=sys.stderr, dynamic_ncols=True,
        )

    def _update(self, batch: dict, step: int) -> tuple[torch.Tensor, int] | str:
        """One optimizer step on ``batch``: ``(loss_sum, n_tokens)``, or what was not finite on some
        rank: the loss or the gradient (the weights are left as they were), or the weights the update
        made (the loop stops before any checkpoint holds them)."""
        config, accelerator = self.config, self.accelerator
        # bf16 autocast needs no loss scaling; validation and saved weights stay fp32.
        extra = None
        with torch.autocast(device_type=accelerator.device.type, dtype=torch.bfloat16,
                            enabled=config.mixed_precision == "bf16"):
            loss_sum, n_tokens = self.hooks.compute_loss(self.model, batch, config)
            loss = loss_sum.float() / max(n_tokens, 1)
            if self.hooks.extra_loss is not None:
                extra = self.hooks.extra_loss(self.raw_model, batch, step)
                loss = loss + extra
        if self._any_rank(not torch.isfinite(loss).item()):
            if not torch.isfinite(loss_sum).item():
                return f"the loss of its batch is {loss_sum.item()} (the weights were not updated)"
            if extra is not None and not torch.isfinite(extra).item():
                return f"the term added to the loss (the penalty) is {extra.item()} (the weights were not updated)"
            return "the loss is not finite on another process (the weights were not updated)"
        accelerator.backward(loss)
        if config.clip_norm and config.clip_norm > 0:
            grad_norm = torch.as_tensor(accelerator.clip_grad_norm_(self.params, config.clip_norm))
        else:  # unclipped: still read, or a NaN gradient would reach the weights and the next checkpoint
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None])
        if self._any_rank(not torch.isfinite(grad_norm).item()):
            detail = "not finite on another process"
            if not torch.isfinite(grad_norm).item():
                name = self._first_nonfinite(grad=True)  # "?" after clipping by NaN: it made every gradient NaN
                where = f"parameter {name}" if name != "?" else \
                    "in every parameter: clipping scaled them by it; with clip_norm 0 the first one is named"
                detail = f"{grad_norm.item()} ({where})"
            self.optimizer.zero_grad(set_to_none=True)
            return f"the gradient's norm is {detail}, with a finite loss of {loss.item():.6g} (the weights were not updated)"
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        # The optimizer can make weights non-finite from finite gradients (float16 Adam's eps underflows to 0, a
        # huge learning rate): refused here, before a checkpoint could hold them. One norm over the weights: NaN or
        # inf exactly where some weight is (or their norm leaves the dtype's range, a divergence too).
        weights = torch.nn.utils.get_total_norm(self.params)
        if self._any_rank(not torch.isfinite(weights).item()):
            where = f"parameter {self._first_nonfinite(grad=False)}" if not torch.isfinite(weights).item() \
                else "on another process"  # "parameter ?": every one
            return (f"the optimizer's update made weights not finite ({where}) from a finite loss and gradient; "
                    "the weights in memory are those, and no checkpoint was written from them")
        return loss_sum, n_tokens

    def _first_nonfinite(self, grad: bool) -> str:
        """The name of the first trained parameter whose gradient (or value) holds a NaN or inf; "?" when every
        one does (clipping by a NaN norm) or none."""
        named = [(name, param.grad if grad else param) for name, param in self.raw_model.named_parameters()
                 if param.requires_grad]
        bad = [name for name, tensor in named if tensor is not None and not bool(tensor.isfinite().all())]
        return bad[0] if bad and len(bad) < len([t for _, t in named if t is not None]) else "?"

    def _count(self, step: int, loss_sum: torch.Tensor, n_tokens: int, progress: _EpochProgress) -> float:
        """Advance the loop's position by one update and count its tokens and loss; its mean loss."""
        state = self.state
        state["step"] = step
        state["batch_in_epoch"] += 1
        state["tokens"] += n_tokens * self.world_size
        progress.tokens += n_tokens * self.world_size
        loss_value = loss_sum.item() / max(n_tokens, 1)
        progress.loss += loss_sum.item()
        progress.loss_tokens += n_tokens
        self.ema_loss = loss_value if self.ema_loss is None else 0.98 * self.ema_loss + 0.02 * loss_value
        return loss_value

    def _limit_reached(self, step: int) -> str:
        config = self.config
        if config.max_steps is not None and step >= config.max_steps:
            return "max_steps"
        if config.max_time_minutes is not None and self._any_rank(time.time() - self.start_time > 60 * config.max_time_minutes):
            return "max_time"
        return "finished"

    def _any_rank(self, flag: bool) -> bool:
        if self.world_size == 1:
            return flag
        value = torch.tensor([1.0 if flag else 0.0], device=self.accelerator.device)
        return bool(self.accelerator.reduce(value, reduction="sum").item() > 0)

    def _save_last(self) -> None:
        """The resume point ``last/``: every rank writes its own RNG state; rank 0 writes the rest."""
        accelerator, out_dir = self.accelerator, self.out_dir
        accelerator.wait_for_everyone()
        if self.main:
            def write(tmp: Path) -> None:
                _save_weights(self.raw_model, tmp)
                save_optimizer(self.optimizer.state_dict(), tmp / OPTIMIZER_FILE)
                (tmp / STATE_FILE).write_text(_json(self.state, STATE_FILE))
                save_rng(accelerator.device, tmp / rng_file(0))
            atomic_dir(out_dir / "last", write)
        accelerator.wait_for_everyone()
        if not self.main:  # its one file written beside, then renamed into the new last/
            rng_tmp = out_dir / "last" / f".{rng_file(self.rank)}.tmp"
            save_rng(accelerator.device, rng_tmp)
            os.replace(rng_tmp, out_dir / "last" / rng_file(self.rank))
        accelerator.wait_for_everyone()

    # -- end of an epoch: weights, validation, best, resume point
    def _end_epoch(self, epoch: int, progress: _EpochProgress, valid_data) -> str:
        """Close the epoch: ``"diverged"`` where its validation is not finite (nothing saved), else ``""``."""
        state, config, accelerator = self.state, self.config, self.accelerator
        epoch_seconds = time.time() - progress.start  # read once: speed x minutes = the epoch's tokens
        record = {
            "epoch": epoch + 1,
            "step": state["step"],
            "train_loss": progress.loss / max(progress.loss_tokens, 1),
            "epoch_minutes": epoch_seconds / 60,
            "tokens_per_s": progress.tokens / max(epoch_seconds, 1e-9),
            "tokens_seen": state["tokens"],  # target tokens of every update so far, all processes
        }
        accelerator.wait_for_everyone()
        bad_validation = ""
        if self.main:
            # Validated before the epoch's checkpoint is written: weights whose validation is not
            # finite reach no checkpoint.
            if valid_data is not None and config.validate:
                bad_validation = self._validate(epoch, record, valid_data)
            if config.keep_epoch_checkpoints and not bad_validation:
                atomic_dir(self.out_dir / "epochs" / f"epoch-{epoch + 1:03d}",
                           lambda tmp: _save_weights(self.raw_model, tmp))
        accelerator.wait_for_everyone()
        if self.world_size > 1:  # only the main rank validates; every rank must agree on stopping
            from accelerate.utils import broadcast_object_list

            shared = [state["improved_epoch"], state["best_score"], state["best_epoch"], state.get("patience_best"),
                      bad_validation]
            state["improved_epoch"], state["best_score"], state["best_epoch"], state["patience_best"], \
                bad_validation = broadcast_object_list(shared)
        if bad_validation:  # stopped as a diverged update is: no history, `last/` and `best/` as they were
            self.diverged = bad_validation
            self.diverged_at = f"the validation of epoch {epoch + 1} (after step {state['step']})"
            return "diverged"
        state["history"].append(record)
        state["epoch"] = epoch + 1
        state["batch_in_epoch"] = 0
        state["epoch_progress"] = _NO_PROGRESS
        state["elapsed_s"] = self.elapsed_before + time.time() - self.start_time
        self._save_last()
        if self.main:
            atomic_write_text(self.out_dir / "history.json", _json(state["history"], "history.json"))
            self.log(_epoch_line(record, state))
        return ""

    def _validate(self, epoch: int, record: dict, valid_data) -> str:
        """Validate the epoch's weights into ``record``; move the patience rule and ``best/``.
        Returns what was not finite (nothing moved), or ``""``."""
        state, config = self.state, self.config
        assert self.hooks.validate_fn is not None  # train() refuses validation data without one
        valid_start = time.time()
        metrics = self.hooks.validate_fn(self.raw_model, self.tokenizer, valid_data, config)
        self.raw_model.train()
        # NaN compares false with everything: taken as the first best, and never beaten after it.
        watched = ["score"] + (["loss"] if config.patience_metric == "loss" and "loss" in metrics else [])
        bad = [name for name in watched if not math.isfinite(metrics[name])]
        if bad:
            shown = ", ".join(f"{name} {value:.6g}" if isinstance(value, float) else f"{name} {value}"
                              for name, value in metrics.items())
            return (f"the validation {' and '.join(bad)} {'is' if len(bad) == 1 else 'are'} not finite ({shown}); "
                    f"best/ (epoch {state['best_epoch'] or 'none'}) and the history were left as they were")
        record.update({f"valid_{k}": v for k, v in metrics.items()})
        record["valid_minutes"] = (time.time() - valid_start) / 60
        score = metrics["score"]
        # An epoch that ends inside the warm-up does not count against the patience: with the
        # learning rate still rising, a model may not improve yet (a 16k-token news run stopped
        # at 448 updates of 1,500 warm-up, BLEU 0.09, by this rule).
        warming_up = state["step"] < config.warmup_steps
        if config.patience_metric == "loss":  # lower is better: compared negated
            if "loss" not in metrics:
                raise HeadlabError("--patience-metric loss: the validation reports no loss")
            value, reference = -metrics["loss"], state.get("patience_best")
            state["patience_best"] = value if reference is None else max(reference, value)
        else:
            value, reference = score, state["best_score"]
        if warming_up or reference is None or value >= reference + config.min_improvement:
            state["improved_epoch"] = epoch + 1
        if state["best_score"] is None or score > state["best_score"]:
            state["best_score"], state["best_epoch"] = score, epoch + 1
            _save_scored(self.raw_model, self.tokenizer, record, self.out_dir / "best")
        return ""


def _epoch_line(record: dict, state: dict) -> str:
    """The log line of a finished epoch."""
    valid_text = ""
    if "valid_score" in record:
        if "valid_bleu" in record:
            valid_text = f", valid BLEU {record['valid_bleu']:.2f} (beam {record.get('valid_beam', '?')})"
            if "valid_loss" in record:
                valid_text += f", loss {record['valid_loss']:.4f}"
        elif "valid_perplexity" in record:
            ppl = record["valid_perplexity"]  # None: past a float's range (headlab.lm.train.json_perplexity)
            valid_text = f", valid loss {record['valid_loss']:.4f} (perplexity {'inf' if ppl is None else f'{ppl:.2f}'})"
        else:
            valid_text = f", valid score {record['valid_score']:.4g}"
        best = state["best_score"]  # a perplexity run's score is the negated loss: show the loss
        best_text = f"loss {-best:.4f}" if "valid_perplexity" in record else f"{best:.4g}"
        valid_text += f", best {best_text} at epoch {state['best_epoch']}"
    return (f"epoch {record['epoch']}: step {state['step']}, train loss {record['train_loss']:.3f}, "
            f"{record['tokens_per_s']:.0f} target tok/s, {record['epoch_minutes']:.1f} min{valid_text}")


def _stop_message(stopped: str, state: dict, config: TrainConfig, out_dir: Path, cause: str = "",
                  where: str = "") -> tuple[str, bool]:
    """Why the run stopped, in words, and whether it is logged (``max_steps`` is asked for: not logged).
    ``cause``: what was not finite when it diverged; ``where``: at what, when not the next update."""
    if stopped == "diverged":
        last = _resume_dir(out_dir)
        where = where or f"step {state['step'] + 1}"
        return (f"training diverged at {where}: {cause or 'the loss or the gradient is not finite'}. "
                f"Last good checkpoint: {last if last else 'none written yet'}"), True
    if stopped == "max_time":
        return (f"stopped after the time limit of {config.max_time_minutes} min at step {state['step']}; "
                "continue with --resume"), True
    if stopped == "max_steps":
        return f"stopped at max_steps={config.max_steps}", False
    if stopped == "converged":
        perplexity_run = bool(state["history"]) and "valid_perplexity" in state["history"][-1]
        best = f"loss {-state['best_score']:.4f}" if perplexity_run else f"{state['best_score']:.4g}"
        if config.patience_metric == "loss" and not perplexity_run:  # the rule watched the loss, not the score
            return (f"converged: {counted(config.patience, 'epoch')} without lowering the validation loss by "
                    f"{config.min_improvement} (lowest {-state['patience_best']:.4f}, last lowered so at epoch "
                    f"{state['improved_epoch']}; best score {best} at epoch {state['best_epoch']}, "
                    f"{counted(state['epoch'], 'epoch')})"), True
        return (f"converged: {counted(config.patience, 'epoch')} without a validation gain of {config.min_improvement} "
                f"(best {best} at epoch {state['best_epoch']}, {counted(state['epoch'], 'epoch')})"), True
    return "", False


def _average_and_validate(raw_model, tokenizer, valid_data, config, state, out_dir, validate_fn, accelerator,
                          log) -> tuple[float | None, str]:
    """Average the last N epoch checkpoints into ``averaged/`` and validate it (main rank): its score, and what was
    not finite in its validation (then nothing is written, and an earlier ``averaged/`` removed), or ``""``."""
    epochs = sorted((out_dir / "epochs").glob("epoch-*"))[-config.average_last:]
    score = None
    if accelerator.is_main_process and epochs:
        import copy

        model = copy.deepcopy(raw_model)
        averaged = average_checkpoints(epochs)
        result = model.load_state_dict(averaged, strict=False)
        if result.unexpected_keys:
            raise HeadlabError(f"checkpoints do not fit the model: {result.unexpected_keys[:5]}")
        record = {"averaged_epochs": [int(p.name.split("-")[1]) for p in epochs]}
        if valid_data is not None and config.validate:
            metrics = validate_fn(model, tokenizer, valid_data, config)
            # as _validate: a NaN score would be returned and saved as the run's averaged result
            bad = [name for name in ("score", "loss") if name in metrics and not math.isfinite(metrics[name])]
            if bad:
                if (out_dir / "averaged").is_dir():  # an earlier average of this run: not this one
                    shutil.rmtree(out_dir / "averaged")
                shown = ", ".join(f"{name} {value:.6g}" if isinstance(value, float) else f"{name} {value}"
                                  for name, value in metrics.items())
                return None, (f"the averaged model of epochs {record['averaged_epochs']} validates to a "
                              f"{' and '.join(bad)} that {'is' if len(bad) == 1 else 'are'} not finite ({shown}): "
                              f"not written to {out_dir / 'averaged'}; best/ (epoch {state['best_epoch'] or 'none'}) "
                              "and the history are the run's")
            record.update({f"valid_{k}": v for k, v in metrics.items()})
            score = metrics["score"]
        _save_scored(model, tokenizer, record, out_dir / "averaged")
        log(f"averaged epochs {record['averaged_epochs']} into {out_dir / 'averaged'}"
            + (f": valid score {score:.2f} (best single epoch {state['best_score']:.2f})" if score is not None else ""))
    return score, ""
