"""Read an analysis directory into plain data for the report, tolerating any missing file.

Nothing here raises on a missing or unreadable file: each problem becomes a note
(``{"section", "text"}``) that the report shows where the data would have been.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from headlab.errors import HeadlabError, counted
from headlab.heads import (
    DEFAULT_DTYPE,
    HeadScores,
    measured_dtype,
    normalised_per_layer,
    one_dtype,
    reconstructed_blocks,
    reconstructed_note,
)
from headlab.importance.registry import MEASURES, tables
from headlab.markup import finite, read_json_noted
from headlab.plugins import Output
from headlab.report.vouched import Vouched, vouched

__all__ = ["Collected", "collect", "statistic_maps", "read_json_noted"]


@dataclass
class Collected:
    directory: Path
    manifest: dict = field(default_factory=dict)
    heatmaps: list[dict] = field(default_factory=list)
    labels: dict[str, list[str]] = field(default_factory=dict)
    agreement: dict | None = None
    sweep: list[dict] | None = None
    figures: list[dict] = field(default_factory=list)
    attention: dict | None = None
    notes: list[dict] = field(default_factory=list)
    viewer: dict = field(default_factory=dict)  # the viewer's index as the report embeds it (set by build)
    sections: dict = field(default_factory=dict)  # what each section's (by id) and report part's (by name) ``collect`` read
    per_layer: set[str] = field(default_factory=set)  # ids of the maps normalised per layer (not in the page's data)
    vouched: Vouched = field(default_factory=Vouched)  # the stages' files that manifest.json vouches for
    reconstructed: set[str] = field(default_factory=set)  # blocks whose head numbers a map's signature says are reconstructed
    signatures: list[tuple[str, Mapping]] = field(default_factory=list)  # (file, signature) of each map: their dtypes

    def reads(self, path: Path) -> bool:
        """Whether ``path`` (in the directory) is read: not a file of a stage the manifest says did not finish."""
        return self.vouched.reads_under(self.directory, path)

    def note(self, section: str, text: str) -> None:
        self.notes.append({"section": section, "text": text})

    def stages_for(self, prefixes: tuple[str, ...]) -> list[dict]:
        """The manifest's stages whose name starts with one of ``prefixes``."""
        return [s for s in self.manifest.get("stages", []) or []
                if isinstance(s, dict) and str(s.get("name", "")).lower().startswith(prefixes)]


def _read_json(path: Path, section: str, out: Collected) -> Any:
    return read_json_noted(path, out.directory, lambda text: out.note(section, text))


def _caption_notes(signature: Mapping[str, Any]) -> str:
    """What the measures add to a map's caption from its signature (``ImportanceMeasure.caption_note``)."""
    return "".join(measure.caption_note(signature) for measure in MEASURES.values())


def _heatmap(out: Collected, path: Path, group: str, name: str, title: str, caption: str,
             categorical: bool = False) -> None:
    if not path.is_file():
        return
    try:
        scores = HeadScores.load(path)
    except HeadlabError as error:
        out.note(group, str(error).replace(str(out.directory) + "/", ""))
        return
    data = {kind: [[finite(v) for v in row] for row in array.tolist()] for kind, array in scores.scores.items()}
    if not data:
        out.note(group, f"{path.relative_to(out.directory)}: no attention kind scored")
        return
    reconstructed = reconstructed_blocks(scores.signature)
    out.reconstructed.update(reconstructed)
    relative = str(path.relative_to(out.directory))
    out.signatures.append((relative, scores.signature))
    dtype = measured_dtype(scores.signature)
    if dtype not in (None, DEFAULT_DTYPE):  # float32 (no --dtype) leaves the caption as it was
        caption += f"; measured with the weights in {dtype} (--dtype)"
    out.heatmaps.append({
        "id": f"{group}/{name}", "group": group, "name": name, "title": title,
        "caption": caption + _caption_notes(scores.signature)
        + (f"; head numbers of {', '.join(reconstructed)} reconstructed, not the original model's (run summary)"
           if reconstructed else ""), "method": scores.method,
        "file": relative, "scores": data,
        "categorical": categorical,
    })
    if normalised_per_layer(scores.signature):  # gradient importance, LRP
        out.per_layer.add(f"{group}/{name}")
    try:
        errors = scores.stderr()
    except HeadlabError as error:
        out.note(group, f"{path.relative_to(out.directory)}: {error}")
        return
    if errors is not None:  # the sampling error, drawn beside the scores
        resamples = errors.signature.get("resamples", "?")
        out.heatmaps.append({
            "id": f"{group}/{name}_stderr", "group": group, "name": f"{name}_stderr",
            "title": f"{title}: standard error",
            "caption": f"bootstrap standard error of each score ({resamples} resamples of the sentences)",
            "method": errors.method, "file": str(path.relative_to(out.directory)),
            "scores": {kind: [[finite(v) for v in row] for row in array.tolist()]
                       for kind, array in errors.scores.items()},
        })


def statistic_maps(directory: Path) -> list[tuple[Path, str, str, Output]]:
    """``(file, group, name, output)`` of every HeadScores file that a registered statistic declares
    (:attr:`~headlab.functions.statistic.Statistic.outputs`) and ``directory`` holds, in registry
    order: ``functions/positional/share.json`` is group ``functions``, name ``positional/share``;
    ``aggregate/mean_distance.json`` group ``aggregate``; a family (``aggregate/pos/*.json``) its
    declared group, one map per file named by its stem. A run of ``headlab functions --aggregate``
    wrote its aggregate statistics under ``functions/``: read there when not at the top."""
    from headlab.functions.registry import STATISTICS
    from headlab.plugins import WRITTEN_UNDER

    found = []
    for statistic in STATISTICS.values():
        for output in statistic.outputs:
            relative = Path(WRITTEN_UNDER[statistic.stage], output.path)  # where analyze wrote it
            folder = directory
            if statistic.stage == "aggregate" and not (directory / relative.parts[0]).is_dir():
                folder = directory / "functions"  # headlab functions --aggregate
            if "*" in output.path:
                found += [(path, output.group or relative.parts[0], path.stem, output)
                          for path in sorted(folder.glob(relative.as_posix()))]
            else:
                found.append((folder / relative, output.group or relative.parts[0],
                              "/".join(relative.with_suffix("").parts[1:]), output))
    return found


def _labels_from_results(functions: Path, out: Collected) -> dict[str, list[str]]:
    """Head labels read back by each statistic from its files when functions/labels.json is absent."""
    from headlab.functions.registry import STATISTICS

    labels: dict[str, list[str]] = {}
    read = lambda path: _read_json(path, "functions", out) if out.reads(path) else None  # noqa: E731
    for statistic in STATISTICS.values():
        if statistic.read_labels is None or statistic.stage != "functions":
            continue
        for key, names in statistic.read_labels(functions, read).items():
            labels.setdefault(str(key), []).extend(names)
    return labels


PARTIAL = "held_files_only"
"""A manifest key: the directory holds only its stages' files under these folders (``["importance/",
...]``: the notebook page of an :class:`headlab.Analysis`, which holds no figures, heads.csv or
pruning results, and some of the attention sentences), so that an output elsewhere is not missing."""


def _output_section(relative: str) -> str | None:
    """The section that shows a stage's output file (None: one that notes its own, or the report)."""
    top = relative.split("/", 1)[0]
    if relative.startswith("importance/agreement."):
        return "agreement"
    if top in ("figures", "index.html"):  # the figures section notes its missing files; the report is this page
        return None
    return {"importance": "importance", "functions": "functions", "aggregate": "aggregate", "attention": "viewer",
            "prune": "pruning"}.get(top, "summary")


def _left_out_section(stage: str, files: tuple[str, ...]) -> str:
    """The section that says a stage's files were left out: the one that would have shown them."""
    if stage == "figures":
        return "figures"
    return _output_section(files[0]) or "summary"


def _note_left_out(out: Collected) -> None:
    """Each stage whose files the manifest does not vouch for (:mod:`headlab.report.vouched`): read,
    a killed run's partial outputs would be shown as this run's results."""
    for group in out.vouched.left_out:
        out.note(_left_out_section(group.stage, group.files), group.text())


def _note_missing_outputs(out: Collected) -> None:
    """Each file that the manifest lists as an output of a done stage and the directory lacks
    (deleted, or the directory copied in part): a missing file is otherwise read as "not
    computed", and its heatmap left out of a section that shows the others without a word."""
    held = out.manifest.get(PARTIAL)
    held = tuple(str(folder) for folder in held) if isinstance(held, list) else None
    for stage in out.stages_for(("",)):
        outputs = stage.get("outputs")
        if stage.get("status") != "done" or not isinstance(outputs, list):
            continue
        missing: dict[str, list[str]] = {}
        for relative in outputs:
            section = _output_section(relative) if isinstance(relative, str) else None
            if held is not None and not str(relative).startswith(held):
                continue
            if section is not None and not (out.directory / relative).exists():
                missing.setdefault(section, []).append(relative)
        for section, files in missing.items():
            shown = ", ".join(files[:4]) + (f" (+{len(files) - 4} more)" if len(files) > 4 else "")
            out.note(section, f"stage {stage.get('name')} is recorded as done, but {counted(len(files), 'file')} it "
                              f"wrote {'is' if len(files) == 1 else 'are'} missing from the directory: {shown}")


def collect(directory: Path) -> Collected:
    out = Collected(Path(directory))
    d = out.directory
    manifest = _read_json(d / "manifest.json", "summary", out)
    if isinstance(manifest, dict):
        out.manifest = manifest
    elif manifest is not None:
        out.note("summary", "manifest.json: not a JSON object")
    else:
        out.note("summary", "manifest.json: not found; the run summary is unknown")
    _note_missing_outputs(out)
    out.vouched = vouched(d, out.manifest)
    _note_left_out(out)

    # Importance: the registry's tables first, in its order, then any other HeadScores file.
    importance = d / "importance"
    titles = tables()
    known = [n for n in titles if (importance / f"{n}.json").is_file() and out.reads(importance / f"{n}.json")]
    others = sorted(p.stem for p in importance.glob("*.json")
                    if p.stem not in titles and p.stem != "agreement" and out.reads(p)) if importance.is_dir() else []
    for name in known + others:
        title, caption = titles.get(name, (name, ""))
        _heatmap(out, importance / f"{name}.json", "importance", name, title, caption)
    agreement = _read_json(importance / "agreement.json", "agreement", out) \
        if out.reads(importance / "agreement.json") else None
    if isinstance(agreement, dict) and (isinstance(agreement.get("spearman"), dict)
                                        or isinstance(agreement.get("matrix"), dict)):
        out.agreement = agreement
    elif agreement is not None:
        out.note("agreement", "importance/agreement.json: no 'spearman' or 'matrix' table")

    functions = d / "functions"
    maps = [found for found in statistic_maps(d) if out.reads(found[0])]
    for path, group, name, output in maps:
        if group == "functions":
            _heatmap(out, path, group, name, output.title.format(stem=name), output.caption.format(stem=name),
                     output.categorical)
    labels = _read_json(functions / "labels.json", "functions", out) if out.reads(functions / "labels.json") else None
    if isinstance(labels, dict):
        # labels.json lists every analysed head, most with no function: keep the labelled ones.
        out.labels = {str(k): [str(x) for x in (v if isinstance(v, list) else [v])] for k, v in labels.items()
                      if v not in (None, "", [])}
    elif functions.is_dir():
        out.labels = _labels_from_results(functions, out)

    for path, group, name, output in maps:
        if group != "functions":
            _heatmap(out, path, group, name, output.title.format(stem=name), output.caption.format(stem=name),
                     output.categorical)

    sweep = _read_json(d / "prune" / "sweep.json", "pruning", out) if out.reads(d / "prune" / "sweep.json") else None
    if isinstance(sweep, list):
        out.sweep = [row for row in sweep if isinstance(row, dict)]

    figures = out.manifest.get("figures") if isinstance(out.manifest.get("figures"), list) else None
    if figures is None:
        figures = [{"name": p.stem, "title": p.stem.replace("_", " "), "caption": "", "png": str(p.relative_to(d)),
                    "svg": str(p.with_suffix(".svg").relative_to(d)) if p.with_suffix(".svg").is_file() else None}
                   for p in sorted((d / "figures").glob("*.png")) if out.reads(p)]
    for figure in figures:
        if not isinstance(figure, dict):
            continue
        png = figure.get("png")
        if png and not out.reads(d / png):
            continue  # noted with its stage
        if png and (d / png).is_file():
            out.figures.append(figure)
        elif png or figure.get("svg"):
            out.note("figures", f"{figure.get('name', '?')}: {png or figure.get('svg')} not found")

    index = _read_json(d / "attention" / "index.json", "viewer", out) if out.reads(d / "attention" / "index.json") else None
    if isinstance(index, dict) and isinstance(index.get("sentences"), list):
        out.attention = index
    if out.reconstructed:  # every map, the labels and the viewer name these heads so: said once at the top
        out.note("summary", reconstructed_note(sorted(out.reconstructed)))
    try:  # maps of two precisions side by side (a directory assembled from runs with other --dtype): said at the top
        one_dtype(out.signatures, "the maps")
    except HeadlabError as error:
        out.note("summary", str(error))
    return out
