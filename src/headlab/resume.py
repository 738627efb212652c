"""What the resumable stages of ``headlab analyze`` and the paper's reproduction (``python -m reproduction``) share.

A stage is finished when its *marker*, a small JSON file, exists (and, for ``analyze``, records
the same key: a hash of the inputs and options the stage depends on). Markers are written last
and atomically, after the stage's outputs, so a stage killed half-way simply runs again. A stage
that cannot run on its input raises :class:`SkipStage` with the reason.
"""

from __future__ import annotations

import hashlib
import json
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from headlab.heads import atomic_write_text, json_text

__all__ = ["SkipStage", "read_marker", "write_marker", "file_fingerprint", "weights_fingerprint", "other_model",
           "other_model_note", "pairs_fingerprint", "stage_key", "now_iso", "append_record", "read_step_records", "set_aside"]

_HASH_LIMIT = 256 * 1024 * 1024  # files larger than this are fingerprinted by size and mtime


class SkipStage(Exception):
    """A stage cannot run on this model or input (yet); the message is the reason.

    ``headlab analyze`` records the stage as skipped, the reproduction as not run.
    """


def read_marker(path: str | os.PathLike) -> dict | None:
    """The marker at ``path``; None when it is absent or unreadable (the stage runs again)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def write_marker(path: str | os.PathLike, marker: dict) -> dict:
    """Write a finished stage's marker atomically (after its outputs); returns it."""
    atomic_write_text(path, json.dumps(marker, indent=1) + "\n")
    return marker


def file_fingerprint(path: str | os.PathLike | None) -> str | None:
    """SHA-256 of a file's bytes (size and mtime for very large files); a directory: of its
    small files' names and fingerprints (a model directory: config, tokenizer, weights)."""
    if path is None:
        return None
    path = Path(path)
    if path.is_dir():
        parts = [f"{p.relative_to(path)}={file_fingerprint(p)}" for p in sorted(path.iterdir()) if p.is_file()]
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()
    if not path.is_file():
        return f"missing:{path}"
    stat = path.stat()
    if stat.st_size > _HASH_LIMIT:
        return f"size={stat.st_size},mtime={stat.st_mtime_ns}"
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def weights_fingerprint(model_dir: str | os.PathLike) -> str | None:
    """SHA-256 of what a model computes: its config.json, its safetensors weights and, for a pruned
    model, headlab_pruning.json. A new card or tokenizer file leaves it unchanged; retrained weights
    change it. None when ``model_dir`` is not a local directory with a config (a hub name)."""
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        return None
    files = [path / "config.json", *sorted(path.glob("*.safetensors")), path / "headlab_pruning.json"]
    parts = [f"{f.name}={file_fingerprint(f)}" for f in files if f.is_file()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def other_model(measured_on: str, model: str) -> str | None:
    """How a score table's model, ``measured_on`` (its ``model`` field: the path or hub name it was computed on),
    stands to ``model``: None when they are the same model (the same name, or local model directories with the
    same weights: :func:`weights_fingerprint`) or either is unnamed; ``""`` when both are local model directories
    whose weights differ; else the names differ and the weights of either cannot be read (a hub name, a class name, a
    directory moved since), and it says which: ``"weights not compared: no model directory at NAME"``."""
    if not measured_on or not model or measured_on == model:
        return None
    theirs, ours = weights_fingerprint(measured_on), weights_fingerprint(model)
    if theirs is not None and ours is not None:
        return None if theirs == ours else ""
    unread = " and ".join(name for name, found in ((measured_on, theirs), (model, ours)) if found is None)
    return f"weights not compared: no model directory at {unread}"


def other_model_note(measured_on: str, model: str, use: str) -> str | None:
    """What ``prune baseline --method scores`` and :func:`headlab.prune` say of scores measured on another model
    (:func:`other_model`), ``use`` being what they do with them; None for the same model."""
    other = other_model(measured_on, model)
    if other is None:
        return None
    if not other:
        return f"were measured on {measured_on} (the table's model), whose weights differ from {model}'s: {use}"
    return f"were measured on {measured_on} (the table's model), not {model} ({other}): if they are other weights, {use}"


def pairs_fingerprint(data: Any) -> str | None:
    """SHA-256 of a corpus's sentence pairs (text, or token ids of an encoded corpus); None for no corpus."""
    if data is None:
        return None
    digest = hashlib.sha256()
    for side in (data.sources, data.targets):
        for item in side:
            digest.update((item if isinstance(item, str) else " ".join(map(str, item))).encode() + b"\n")
        digest.update(b"\0")
    return digest.hexdigest()


def stage_key(payload: dict) -> str:
    """A short hash of what a stage's result depends on."""
    text = json.dumps(payload, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def append_record(path: str | os.PathLike, record: dict) -> None:
    """Append ``record`` as one JSON line with a single write, then fsync: a kill leaves at most a
    torn last line, which :func:`read_step_records` skips. A NaN (the trajectory's loss before the
    first step reports one) is written as null: a bare NaN is not JSON."""
    line = json_text(record, Path(path).name, separators=(",", ":")) + "\n"
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(line)
        handle.flush()
        os.fsync(handle.fileno())


def read_step_records(path: str | os.PathLike) -> list[dict]:
    """The records of a JSON-lines journal by their ``step``, in step order; a step written twice (a
    resumed run's repeat) keeps the newer record, a torn line from a kill is skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    by_step: dict[int, dict] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        by_step[int(record["step"])] = record
    return [by_step[s] for s in sorted(by_step)]


def set_aside(path: Path, out_dir: Path, name: str | None = None) -> Path:
    """Move a stale result (a file or a directory made with other inputs or options) to
    ``out_dir/stale/`` under a name not taken yet (``name``, default its own), rather than delete
    what may have cost hours; return where it went. ``prune sweep``'s points and ``analyze --skip``'s stages."""
    stale = out_dir / "stale"
    stale.mkdir(exist_ok=True)
    name = name or path.name
    target, i = stale / name, 1
    while target.exists() or target.is_symlink():
        i += 1
        target = stale / f"{name}.old{i}"
    path.rename(target)
    return target
