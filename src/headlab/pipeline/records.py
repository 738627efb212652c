"""Stage records, done markers and the manifest of an analysis directory.

A stage is *done* when its marker ``DIR/.headlab/stages/<name>.json`` exists, the marker's
``key`` equals the key of the current run (a hash of the inputs and options that stage
depends on), and every output it lists exists (markers, keys and fingerprints:
:mod:`headlab.resume`).

``DIR/manifest.json`` (the contract with :mod:`headlab.report`; schema in docs/analyze.md)::

    {"headlab_version", "model", "source", "target", "conllu", "created", "written_by",
     "stages": [{"name", "status": "done"|"skipped"|"failed", "reason", "seconds", "outputs"}],
     "figures": [{"name", "title", "caption", "png", "svg"}]}
"""

from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from headlab import resume
from headlab.heads import write_json
from headlab.resume import now_iso

__all__ = ["StageRecord", "read_marker", "raw_marker", "write_marker", "remove_marker", "write_manifest",
           "MARKER_DIR", "MANIFEST"]

MARKER_DIR = Path(".headlab") / "stages"
MANIFEST = "manifest.json"
STATUSES = ("done", "skipped", "failed")


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


def _marker_path(out_dir: Path, name: str) -> Path:
    return out_dir / MARKER_DIR / f"{name}.json"


def read_marker(out_dir: Path, name: str, key: str) -> dict | None:
    """The stored marker of a finished stage, or None when it must run (again)."""
    marker = raw_marker(out_dir, name)
    if marker is None or marker.get("key") != key or marker.get("record", {}).get("status") != "done":
        return None
    return marker if all((out_dir / rel).exists() for rel in marker["record"].get("outputs", [])) else None


def raw_marker(out_dir: Path, name: str) -> dict | None:
    """The stored marker whatever its key (None when absent or unreadable)."""
    return resume.read_marker(_marker_path(out_dir, name))


def write_marker(out_dir: Path, name: str, key: str, record: StageRecord, extra: dict | None = None) -> dict:
    """Record a finished stage (after its outputs are written); returns the marker. Its ``marker_id`` is
    new on every write: the stages after it key on it, as ``finished`` (in seconds) cannot tell
    two runs of the stage within one second apart."""
    marker = {"key": key, "finished": now_iso(), "marker_id": uuid.uuid4().hex, "record": record.to_json(),
              **(extra or {})}
    return resume.write_marker(_marker_path(out_dir, name), marker)


def remove_marker(out_dir: Path, name: str) -> None:
    _marker_path(out_dir, name).unlink(missing_ok=True)


def write_manifest(out_dir: Path, header: dict, records: list[StageRecord], figures: list[dict]) -> Path:
    """Write ``DIR/manifest.json`` atomically (rewritten after every stage)."""
    manifest = {**header, "stages": [r.to_json() for r in records], "figures": list(figures)}
    return write_json(out_dir / MANIFEST, manifest, ensure_ascii=False)
