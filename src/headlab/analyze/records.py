"""Stage records, done markers and the manifest of an analysis directory.

A stage is *done* when its marker ``DIR/.headlab/stages/<name>.json`` exists, the marker's
``key`` equals the key of the current run (a hash of the inputs and options that stage
depends on), and every output it lists exists. Markers are written atomically, after the
outputs, so a stage killed half-way is simply run again.

``DIR/manifest.json`` (the contract with :mod:`headlab.report`; schema in docs/analyze.md)::

    {"headlab_version", "model", "source", "target", "conllu", "created",
     "stages": [{"name", "status": "done"|"skipped"|"failed", "reason", "seconds", "outputs"}],
     "figures": [{"name", "title", "caption", "png", "svg"}]}
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from headlab.heads import atomic_write_text

__all__ = ["StageRecord", "file_fingerprint", "stage_key", "read_marker", "raw_marker", "write_marker",
           "remove_marker", "write_manifest", "now_iso", "MARKER_DIR", "MANIFEST"]

MARKER_DIR = Path(".headlab") / "stages"
MANIFEST = "manifest.json"
STATUSES = ("done", "skipped", "failed")
_HASH_LIMIT = 256 * 1024 * 1024  # files larger than this are fingerprinted by size and mtime


@dataclass
class StageRecord:
    """One line of the manifest's ``stages`` list (``reason`` is also a note on a done stage)."""

    name: str
    status: str
    reason: str | None = None
    seconds: float | None = None
    outputs: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"stage status must be one of {STATUSES}, got {self.status!r}")

    def to_json(self) -> dict:
        return asdict(self)


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


def stage_key(payload: dict) -> str:
    """A short hash of what a stage's result depends on."""
    text = json.dumps(payload, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _marker_path(out_dir: Path, name: str) -> Path:
    return out_dir / MARKER_DIR / f"{name}.json"


def read_marker(out_dir: Path, name: str, key: str) -> dict | None:
    """The stored marker of a finished stage, or None when it must run (again)."""
    path = _marker_path(out_dir, name)
    try:
        marker = json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    if marker.get("key") != key or marker.get("record", {}).get("status") != "done":
        return None
    if not all((out_dir / rel).exists() for rel in marker["record"].get("outputs", [])):
        return None
    return marker


def raw_marker(out_dir: Path, name: str) -> dict | None:
    """The stored marker whatever its key (None when absent or unreadable)."""
    try:
        return json.loads(_marker_path(out_dir, name).read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def write_marker(out_dir: Path, name: str, key: str, record: StageRecord, extra: dict | None = None) -> dict:
    """Record a finished stage (after its outputs are written); returns the marker."""
    marker = {"key": key, "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "record": record.to_json(), **(extra or {})}
    atomic_write_text(_marker_path(out_dir, name), json.dumps(marker, indent=1) + "\n")
    return marker


def remove_marker(out_dir: Path, name: str) -> None:
    path = _marker_path(out_dir, name)
    if path.is_file():
        path.unlink()


def write_manifest(out_dir: Path, header: dict, records: list[StageRecord], figures: list[dict]) -> Path:
    """Write ``DIR/manifest.json`` atomically (rewritten after every stage)."""
    manifest = {**header, "stages": [r.to_json() for r in records], "figures": list(figures)}
    path = out_dir / MANIFEST
    atomic_write_text(path, json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
    return path


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
