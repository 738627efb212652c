"""Which result files of an analysis directory its ``manifest.json`` vouches for.

``headlab analyze`` writes a stage's files, then its done marker, then rewrites ``manifest.json``
with the stage's row, after every stage. A run killed in a stage leaves that stage's files (and
an earlier run's files of the stages after it) with no row; a stage that failed or was skipped
has a row that says so. Read as results, such files would join this run's tables, maps and
labels without a word (a killed run's partial functions beside this run's importance). So the
readers of the directory (the report, :meth:`headlab.Analysis.load`, ``heads.csv``, the
figures) read a stage's files only when ``manifest.json`` lists the stage as done (or lists
the file among a done stage's outputs) and say which they left out; the model profiles
(:func:`headlab.pipeline.profiles.collect_profile`), which need the whole stage, refuse.

A directory whose manifest records no stage (the standalone commands' ``functions --out``,
``importance --out``, which write no manifest; an :class:`~headlab.Analysis` saved from one, whose
manifest ``Analysis.save`` wrote) is read whole: nothing there says a stage did not finish. Not so one whose manifest ``headlab
analyze`` wrote (``"written_by": "headlab analyze"``, :data:`ANALYZE`): it writes one with no
stage at the start of a run and drops a stage's row before the stage writes again, so there a
stage not listed has not finished, none listed included. Markers are not read: a copied or saved
directory has none, and a done row is only written after its stage's marker.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from headlab.errors import counted

__all__ = ["LeftOut", "Vouched", "read_manifest", "stage_rows", "stage_of", "vouched", "AREAS", "ANALYZE"]

AREAS = ("functions", "aggregate", "prune", "attention", "figures")
"""The folders of DIR that a stage of its name owns (``headlab.pipeline.pipeline.STAGE_DIRS``, which
tests/test_report.py compares: the report may not import the pipeline)."""

ANALYZE = "headlab analyze"
"""``written_by`` of the manifest ``headlab analyze`` writes: it lists a stage only once the stage
finished (the Python API's ``headlab.analyze`` writes every row at once, and ``Analysis.save`` the
rows of the stages whose files it writes; each names itself, so that one with no row is read whole)."""


def read_manifest(directory: Path) -> dict | None:
    """``DIR/manifest.json`` when it is a readable JSON object, else None."""
    try:
        manifest = json.loads((Path(directory) / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def stage_rows(manifest: object) -> list[dict]:
    """The rows of ``manifest``'s ``stages`` that name a stage (none: not a dict, no list)."""
    rows = manifest.get("stages") if isinstance(manifest, dict) else None
    return [row for row in rows if isinstance(row, dict) and isinstance(row.get("name"), str)] \
        if isinstance(rows, list) else []


def _declared_folders() -> dict[str, str]:
    """Top folders of DIR that a statistic's declared outputs live in, and the stage that writes them
    (an aggregate statistic writes at the top: ``aggregate/``, or a folder of its own)."""
    from headlab.functions.registry import STATISTICS
    from headlab.plugins import WRITTEN_UNDER

    return {Path(WRITTEN_UNDER[statistic.stage], output.path).parts[0]: statistic.stage
            for statistic in STATISTICS.values() for output in statistic.outputs}


def stage_of(relative: str) -> str | None:
    """The analyze stage that writes the result file ``relative`` (posix, relative to DIR):
    ``importance/lrp.json`` -> ``lrp``, ``importance/gradient_raw.json`` -> ``gradient`` (a table of
    that measure), ``importance/agreement.md`` -> ``agreement``, ``functions/...`` -> ``functions``;
    None for a file no stage's reader reads (heads.csv, index.html, the manifest)."""
    from headlab.importance.registry import MEASURES

    top, _, rest = relative.partition("/")
    if not rest:
        return None
    if top == "importance":
        stem = rest.split("/")[0].split(".")[0]
        if stem == "agreement":
            return "agreement"
        return next((m.name for m in MEASURES.values() if stem == m.name or stem in m.tables), stem)
    if top in AREAS:
        return top
    return _declared_folders().get(top)


@dataclass(frozen=True)
class LeftOut:
    """Files of ``stage`` that the manifest does not vouch for: ``status`` is the stage's in the
    manifest (``failed``, ``skipped``), None when the manifest lacks the stage."""

    stage: str
    status: str | None
    files: tuple[str, ...]

    def text(self) -> str:
        shown = ", ".join(self.files[:3]) + (f" (+{len(self.files) - 3} more)" if len(self.files) > 3 else "")
        files = f"stage {self.stage}: {counted(len(self.files), 'file')} ({shown}) left out"
        if self.status is None:
            return (f"{files}, from a run that did not finish the stage (manifest.json does not list it: the run was "
                    "killed or stopped in it or before it, or is still running); the same headlab analyze command run "
                    "again finishes it")
        return f"{files}, not results of this run (manifest.json records the stage as {self.status})"


@dataclass(frozen=True)
class Vouched:
    """What the readers of an analysis directory may read (:func:`vouched`)."""

    left_out: tuple[LeftOut, ...] = ()
    _excluded: frozenset[str] = field(default=frozenset(), repr=False)

    def reads(self, relative: str | Path) -> bool:
        """Whether a reader may read ``relative`` (a path relative to DIR)."""
        return Path(relative).as_posix() not in self._excluded

    def reads_under(self, directory: Path, path: Path) -> bool:
        """:meth:`reads` for ``path`` inside ``directory`` (True for one outside it)."""
        try:
            return self.reads(path.relative_to(directory))
        except ValueError:
            return True

    def stage_left_out(self, stage: str) -> bool:
        """Whether files of ``stage`` were left out (its report parts are not read either)."""
        return any(group.stage == stage for group in self.left_out)

    def under(self, *tops: str) -> list[LeftOut]:
        """The groups with files under the top folders ``tops`` (what one reader reads)."""
        return [group for group in self.left_out if any(f.split("/", 1)[0] in tops for f in group.files)]


def _result_files(directory: Path) -> list[str]:
    """The files of DIR that a reader may take for a stage's results (hidden ones, the stage folders'
    ``.headlab-key``, are no one's results), relative and sorted."""
    tops = {"importance", *AREAS, *_declared_folders()}
    found = []
    for top in sorted(tops):
        root = directory / top
        if not root.is_dir() or root.is_symlink():
            continue
        for path in sorted(root.rglob("*")):
            inside = path.relative_to(directory)
            if not any(part.startswith(".") for part in inside.parts) and (path.is_file() or path.is_symlink()):
                found.append(inside.as_posix())
    return found


def vouched(directory: str | Path, manifest: object = None) -> Vouched:
    """What ``manifest`` (DIR's parsed manifest.json; None: none) vouches for in ``directory``: each
    result file of a stage that it does not list as done, and that no done stage lists among its
    outputs, is left out. A manifest with no stage row vouches for everything, unless ``headlab
    analyze`` wrote it (a run killed before its first stage finished): then for nothing."""
    directory = Path(directory)
    rows = stage_rows(manifest)
    if not rows and not (isinstance(manifest, dict) and manifest.get("written_by") == ANALYZE):
        return Vouched()
    status = {row["name"]: str(row.get("status")) for row in rows}
    listed = {str(path) for row in rows if row.get("status") == "done" and isinstance(row.get("outputs"), list)
              for path in row["outputs"]}
    groups: dict[str, list[str]] = {}
    for relative in _result_files(directory):
        stage = stage_of(relative)
        if stage is not None and status.get(stage) != "done" and relative not in listed:
            groups.setdefault(stage, []).append(relative)
    left_out = tuple(LeftOut(stage, status.get(stage), tuple(files)) for stage, files in groups.items())
    return Vouched(left_out, frozenset(f for group in left_out for f in group.files))
