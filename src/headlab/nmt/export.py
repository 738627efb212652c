"""Export a trained model from a training run into a self-contained model directory.

Works for any run of headlab's trainer (``headlab nmt train``, ``headlab lm train``): the
checkpoint's own config names its model class.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from headlab.errors import HeadlabError, counted
from headlab.heads import readable_as_umask_allows
from headlab.loading import load_model
from headlab.nmt.tokenizer import load_tokenizer
from headlab.outdir import check_output, results_lock, write_results


def _load_checkpoint(path: str | Path):
    # A checkpoint of a training run in fp32, whatever its architecture (its config names its class).
    return load_model(str(path), dtype=torch.float32, attn_implementation="sdpa")

__all__ = ["export_model", "checkpoint_dir", "average_last_epochs", "exported_epoch"]


def checkpoint_dir(run_dir: str | Path, which: str = "best") -> Path:
    """``best``, ``averaged``, ``averaged-lastN``, ``last`` or ``epoch-N`` of a run made by
    ``headlab nmt train`` or ``headlab lm train``: a checkpoint *of the run*, named, never a path
    (``../x`` or an absolute path would export another run's weights under this run's name)."""
    run_dir = Path(run_dir)
    if which.startswith("epoch-"):
        number = which.split("-", 1)[1]
        if not (number.isascii() and number.isdigit() and int(number) >= 1):  # int() took "-1", "x" raised
            raise HeadlabError(f"--checkpoint {which}: not an epoch number; expected epoch-N with N >= 1")
        path = run_dir / "epochs" / f"epoch-{int(number):03d}"
    elif not which or which in (".", "..") or Path(which).name != which:
        raise HeadlabError(f"--checkpoint {which}: not the name of a checkpoint of the run ({_named(run_dir)}); "
                           f"a path, inside {run_dir} or not, is not one")
    else:
        path = run_dir / which
    if not (path / "model.safetensors").is_file():
        raise HeadlabError(f"--checkpoint {which}: no checkpoint {which!r} in {run_dir} (looked for "
                           f"{path / 'model.safetensors'}; the run has {_named(run_dir)})")
    if not path.resolve().is_relative_to(run_dir.resolve()):  # a link out of the run
        raise HeadlabError(f"--checkpoint {which}: {path} leads out of the run directory {run_dir} (to "
                           f"{path.resolve()}); export from the run that holds it")
    return path


def _named(run_dir: Path) -> str:
    """The checkpoints of a run, by the names --checkpoint takes."""
    inside = run_dir.resolve()
    names = sorted(p.parent.name for p in run_dir.glob("*/model.safetensors")
                   if not p.parent.name.startswith(".") and p.parent.resolve().is_relative_to(inside))
    epochs = sorted(int(p.parent.name.split("-")[1]) for p in run_dir.glob("epochs/epoch-*/model.safetensors")
                    if p.parent.name.split("-")[1].isdigit())
    if epochs:
        names.append(f"epoch-{epochs[0]}" if len(epochs) == 1 else f"epoch-{epochs[0]}..epoch-{epochs[-1]}")
    return ", ".join(names) if names else "none"


def export_model(
    run_dir: str | Path,
    out_dir: str | Path,
    *,
    which: str = "best",
    dtype: str = "float32",
    overwrite: bool = False,
) -> Path:
    """Write ``config.json``, ``generation_config.json``, ``model.safetensors`` and the tokenizer
    of one checkpoint of ``run_dir`` to ``out_dir`` (loadable with ``from_pretrained``).

    Holds the run's lock (:mod:`headlab.lock`) while it reads the run, as ``average`` does: a
    training still writing the checkpoint is refused instead of copied half-written."""
    from headlab.lock import DirectoryLock

    checkpoint_dir(run_dir, which)  # before the lock: no .headlab/ made in a wrong --run
    with DirectoryLock(run_dir, "--run"):
        return _export_model(Path(run_dir), Path(out_dir), which, dtype, overwrite)


def _export_model(run_dir: Path, out_dir: Path, which: str, dtype: str, overwrite: bool) -> Path:
    source = checkpoint_dir(run_dir, which)  # again under the lock: what is read is what no run is writing
    if dtype not in ("float32", "float16", "bfloat16"):
        raise HeadlabError(f"dtype must be float32, float16 or bfloat16, got {dtype!r}")
    # Like functions' --out (headlab.outdir): one run at a time, a directory of the user's files or
    # of an export older than the manifest refused, written whole and listed, --overwrite replacing
    # only what an earlier export wrote.
    check_output(out_dir, overwrite, "--to", command="export")
    tokenizer_dir = source if (source / "tokenizer.json").is_file() else run_dir / "tokenizer"
    tokenizer = load_tokenizer(tokenizer_dir)
    model = _load_checkpoint(source).to(getattr(torch, dtype))

    def write(directory: Path) -> None:
        model.save_pretrained(str(directory), safe_serialization=True)
        tokenizer.save_pretrained(str(directory))
        readable_as_umask_allows(directory)
        copies = {source / "metrics.json": "train_metrics.json", run_dir / "history.json": "train_history.json"}
        for kept, name in copies.items():
            if kept.is_file():
                shutil.copyfile(kept, directory / name)
        (directory / "export.json").write_text(
            json.dumps({"run": str(run_dir), "checkpoint": which, "dtype": dtype}, indent=2) + "\n")

    with results_lock(out_dir, overwrite, True, "--to", command="export"):
        write_results(out_dir, write, command="export", model=str(source), overwrite=overwrite, flag="--to")
    return out_dir


def exported_epoch(model_dir: str | Path) -> int | None:
    """The epoch of its training run that an exported model's weights are: from the
    ``train_metrics.json`` that :func:`export_model` copies (the best epoch's record, or the
    epochs an average was made of, the last counted); None when it is not there."""
    path = Path(model_dir) / "train_metrics.json"
    if not path.is_file():
        return None
    metrics = json.loads(path.read_text(encoding="utf-8"))
    if metrics.get("averaged_epochs"):
        return max(metrics["averaged_epochs"])
    return metrics.get("epoch")


def average_last_epochs(run_dir: str | Path, last: int, *, overwrite: bool = False) -> Path:
    """Average the weights of the last ``last`` epoch checkpoints of a run into
    ``run_dir/averaged-lastN`` (Vaswani et al. 2017, Sec. 6.1), with the run's tokenizer.

    The trainer does this itself when it reaches ``--epochs``; this is for runs that a time
    or step limit stopped earlier. Written to a temporary directory, then renamed into place,
    holding the run's lock (:mod:`headlab.lock`): a training still writing the run, or a second
    average, is refused instead of interleaving its writes with this one's.
    """
    from headlab.lock import DirectoryLock

    run_dir = Path(run_dir)
    if last < 1 or len(_epochs(run_dir)) < last:  # before the lock: no .headlab/ made in a wrong --run
        raise HeadlabError(f"{run_dir}/epochs holds {counted(len(_epochs(run_dir)), 'epoch checkpoint')}; cannot "
                           f"average the last {last}")
    with DirectoryLock(run_dir, "--run"):
        return _average_last_epochs(run_dir, last, overwrite)


def _epochs(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "epochs").glob("epoch-*"))


def _average_last_epochs(run_dir: Path, last: int, overwrite: bool) -> Path:
    from headlab.training.loop import average_checkpoints

    epochs = _epochs(run_dir)  # read again under the lock: what is averaged is what no run is writing
    chosen = epochs[-last:]
    out = run_dir / f"averaged-last{last}"
    if out.exists() and not overwrite:
        raise HeadlabError(f"{out} exists; pass --overwrite to replace it")
    model = _load_checkpoint(chosen[-1])
    result = model.load_state_dict(average_checkpoints(chosen), strict=False)
    if result.unexpected_keys:
        raise HeadlabError(f"{chosen[-1]}: checkpoints hold unexpected weights {result.unexpected_keys[:3]}")
    tmp = run_dir / f".averaged-last{last}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    load_tokenizer(run_dir / "tokenizer").save_pretrained(str(tmp))
    names = [int(path.name.split("-")[1]) for path in chosen]
    (tmp / "metrics.json").write_text(json.dumps({"averaged_epochs": names}, indent=2) + "\n")
    readable_as_umask_allows(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
