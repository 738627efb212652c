"""What each model's heads do, in one table per model: the summary behind docs/functions.md.

:func:`collect_profile` reads the result files that ``headlab analyze`` (or ``headlab
functions`` + ``headlab aggregate``) wrote for one model and keeps the few numbers a reader
compares across models: what each registered statistic declares in its
:class:`~headlab.plugins.ProfilePart` (the built-in ones: the most positional head and the best
previous-word head, Voita et al. 2019 Sec. 5.1; the best head per relation and direction against
its offset baseline, Sec. 5.2, Table 1; the head that points to the rarest token most, Sec. 5.3;
Vig & Belinkov's layer profiles). :func:`render_profiles` turns a list of profiles into markdown:
one overview table whose columns the parts declare, then each model's own tables. Both read only
JSON, so the document can be re-rendered and checked without a model; neither names a statistic.
The parts read their files by path; :func:`collect_profile` first refuses a directory whose
``manifest.json`` does not vouch for the functions or aggregate files it holds
(:mod:`headlab.report.vouched`), as the report and the table leave them out.
"""

from __future__ import annotations

from pathlib import Path

from headlab.errors import HeadlabError
from headlab.heads import DEFAULT_DTYPE, one_dtype
from headlab.pipeline.table import pass_folders
from headlab.plugins import WRITTEN_UNDER, ProfilePart, read_result

__all__ = ["collect_profile", "render_profiles", "replace_block", "read_block", "PROFILE_VERSION"]

PROFILE_VERSION = 1


def _parts() -> list[tuple[str, ProfilePart]]:
    """``(pass, part)`` of every registered statistic that declares a profile part, in registry order."""
    from headlab.functions.registry import STATISTICS

    return [(statistic.stage, statistic.profile) for statistic in STATISTICS.values() if statistic.profile is not None]


def _refuse_unvouched(root: Path, parts: list[tuple[str, ProfilePart]]) -> None:
    """Refuse a directory whose manifest.json does not vouch for the files of a pass the profile reads
    (:mod:`headlab.report.vouched`: a run killed in the stage, or one that skipped or failed it with
    an earlier run's files still there): the parts read files by path, so this is the one place that
    keeps them from taking such files for the model's results."""
    from headlab.report.vouched import read_manifest, vouched

    passes = {"functions", *(stage for stage, _ in parts)}  # functions/summary.json: the functions pass
    groups = [group for group in vouched(root, read_manifest(root)).left_out if group.stage in passes]
    if groups:
        raise HeadlabError(f"{root}: no profile from this directory: " + "; ".join(g.text() for g in groups))


def _measured_dtype(root: Path) -> str:
    """The one dtype that the tables of the functions and aggregate passes in ``root`` were measured in
    (:func:`headlab.heads.one_dtype`): ``functions`` and ``aggregate`` run apart into one directory with other
    ``--dtype`` are refused, naming a table of each; float32 where none says (files from before the key existed)."""
    import json

    tables = []
    for folder in pass_folders():
        for path in sorted((root / folder).rglob("*.json")) if (root / folder).is_dir() else ():
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue  # not a table: the parts read (and name) the files they need
            if isinstance(data, dict) and isinstance(data.get("signature"), dict) and "scores" in data:
                tables.append((path.relative_to(root).as_posix(), data["signature"]))
    return one_dtype(tables, f"{root}: no profile from this directory") or DEFAULT_DTYPE


def collect_profile(analysis_dir: str | Path, name: str, description: str = "") -> dict:
    """The profile of the model analysed into ``analysis_dir`` (an ``analyze --out`` directory,
    or any directory holding ``functions/`` and ``aggregate/``). A directory whose manifest.json
    does not list the functions or aggregate stage as done while it holds their files is refused."""
    root = Path(analysis_dir)
    parts = _parts()
    _refuse_unvouched(root, parts)
    summary = read_result(root / "functions" / "summary.json")
    dtype = _measured_dtype(root)
    profile = {"version": PROFILE_VERSION, "name": name, "description": description,
               "data": summary["report"].get("treebanks", {}), "n_sentences": summary["report"]["n_sentences"],
               **({"dtype": dtype} if dtype != DEFAULT_DTYPE else {}), "kinds": {}}
    for kind in summary["report"]["analysed"]:
        entries: dict = {}
        for stage, part in parts:
            entries.update(part.collect(root / WRITTEN_UNDER[stage], kind))
        profile["kinds"][kind] = entries
    return profile


def _shown_name(profile: dict) -> str:
    """The model's name, with the dtype of a profile not measured in float32 (a profile without one was)."""
    return profile["name"] + (f" ({profile['dtype']})" if profile.get("dtype") else "")


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _overview(profiles: list[dict], parts: list[ProfilePart]) -> list[str]:
    columns = ["model", "kind"] + [column for part in parts for column in part.columns]
    lines = [_row(columns), "|" + "---|" * len(columns)]
    for profile in profiles:
        for kind, entries in profile["kinds"].items():
            lines.append(_row([_shown_name(profile), kind] + [cell for part in parts if part.cells is not None
                                                         for cell in part.cells(kind, entries)]))
    return lines


def render_profiles(profiles: list[dict]) -> str:
    """Markdown: one overview table over all models, then each model's tables (Table 1 and the
    layer profile, for the built-in statistics), a blank line between them."""
    parts = [part for _, part in _parts()]
    lines = _overview(profiles, parts)
    for profile in profiles:
        lines += ["", f"#### {_shown_name(profile)}", ""]
        if profile["description"]:
            lines += [profile["description"], ""]
        if profile.get("dtype"):
            lines += [f"Measured with the weights in {profile['dtype']} (--dtype), not float32.", ""]
        tables = [part.table(profile["kinds"]) for part in parts if part.table is not None]
        for index, table in enumerate(tables):
            lines += ([""] if index else []) + table
    return "\n".join(lines) + "\n"


def replace_block(document: str, name: str, body: str) -> str:
    """``document`` with the text between ``<!-- BEGIN generated:NAME -->`` and its END marker
    replaced by ``body`` (the convention of docs/reproduction.md)."""
    begin, end = f"<!-- BEGIN generated:{name} -->\n", f"<!-- END generated:{name} -->"
    start, stop = document.find(begin), document.find(end)
    if start < 0 or stop < start:
        raise HeadlabError(f"no block {name!r} in the document (add '{begin.strip()}' and '{end}')")
    return document[: start + len(begin)] + body + document[stop:]


def read_block(document: str, name: str) -> str:
    begin, end = f"<!-- BEGIN generated:{name} -->\n", f"<!-- END generated:{name} -->"
    start, stop = document.find(begin), document.find(end)
    if start < 0 or stop < start:
        raise HeadlabError(f"no block {name!r} in the document")
    return document[start + len(begin): stop]
