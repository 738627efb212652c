"""One long table per run: ``heads.csv`` (and ``heads.parquet`` when pyarrow is installed).

One row per head (``model``, ``run``, ``kind``, ``layer``, ``head``: the model argument of the run
and the name of its directory, so that the tables of several runs stack with ``pandas.concat``;
``dtype`` after them where the tables were measured with the weights in another dtype than float32),
one column per measure or statistic that the run wrote as a HeadScores file, then the head's
function labels: ``functions`` (all of them, ``; ``-separated) and one column per group
that the statistics declare (``positional``, ``syntactic``, ``rare``:
:func:`~headlab.pipeline.labels.function_groups`). Column names are Python identifiers
(``syntactic_advmod_dep_gov``; the POS tag ``_`` of words without one is ``pos_none``). Read it
with ``pandas.read_csv(DIR / "heads.csv")``. Everything comes from the files of the analysis
directory, so the table can be rebuilt from them at any time (:func:`write_heads_table`).

A model whose head numbers were reconstructed (a pruned directory re-saved without its record: its
tables' signatures say ``"numbering": {"reconstructed": [...]}``) gets a ``numbering`` column after
``head``: ``reconstructed`` in those layers, whose head numbers are not the original model's, else
``original``.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from pathlib import Path

from headlab.errors import HeadlabError
from headlab.heads import DEFAULT_DTYPE, KINDS, HeadScores, atomic_write_text, one_dtype, reconstructed_blocks
from headlab.pipeline.labels import function_groups, label_group

__all__ = ["heads_table", "score_columns", "table_dtype", "table_rows", "write_heads_table", "KEY_COLUMNS",
           "TABLE_FORMAT"]

KEY_COLUMNS = ("model", "run", "kind", "layer", "head")

TABLE_FORMAT = 3
"""2: ``model`` and ``run`` columns, identifier-safe names; 3: the ``numbering`` column of a model whose head
numbers were reconstructed (part of the table stage's key). The ``dtype`` column (session 34) needed none: only
tables measured since, in another dtype than float32, have it, and their stages ran again (their keys, ``analyze``)."""

def _sources() -> tuple[str, ...]:
    """Directories of DIR whose HeadScores files become columns: the measures', the functions pass's
    and the folders the aggregate pass's statistics declare (``aggregate``)."""
    from headlab.functions.registry import STATISTICS
    from headlab.plugins import WRITTEN_UNDER

    folders = ["importance", "functions"]
    for statistic in STATISTICS.values():
        for output in statistic.outputs:
            folder = Path(WRITTEN_UNDER[statistic.stage], output.path).parts[0]
            if folder not in folders:
                folders.append(folder)
    return tuple(folders)


def pass_folders() -> tuple[str, ...]:
    """The folders of DIR that the functions and aggregate passes write their HeadScores files in."""
    return tuple(folder for folder in _sources() if folder != "importance")


def _column(relative: Path) -> str:
    """``importance/lrp.json`` -> ``lrp``; ``functions/positional/share.json`` -> ``positional_share``;
    ``aggregate/pos/NOUN.json`` -> ``pos_NOUN``; ``functions/syntactic/advmod.dep-gov.json`` ->
    ``syntactic_advmod_dep_gov``; ``aggregate/pos/_.json`` (words without a tag) -> ``pos_none``:
    identifiers, for ``df.column`` and formulas."""
    parts = ("none" if part == "_" else re.sub(r"[^0-9A-Za-z_]", "_", part) for part in relative.with_suffix("").parts)
    return "_".join(parts)


def _model_of(manifest: dict | None, scores: list[HeadScores]) -> str:
    """The model argument of the run: its manifest's (``analyze``), else the one its score files
    name (``importance``, ``functions``), else empty."""
    model = (manifest or {}).get("model")
    if isinstance(model, str) and model:
        return model
    named = {s.model for s in scores if isinstance(s.model, str) and s.model}
    return named.pop() if len(named) == 1 else ""


def _documents(out_dir: Path, vouched):
    """``(path relative to DIR, JSON)`` of the JSON files of the score directories, in column order,
    less those of a stage that the manifest says did not finish (``vouched``)."""
    for directory in _sources():
        root = out_dir / directory
        if not root.is_dir():
            continue
        for path in sorted(root.rglob("*.json")):
            if not vouched.reads_under(out_dir, path):
                continue
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue  # not ours to judge here: the report notes unreadable files
            yield path.relative_to(out_dir).as_posix(), data


def score_columns(documents, where: str | Path = ""):
    """``(column, HeadScores)`` of the HeadScores among ``documents`` (``(path relative to DIR,
    JSON)``, as the files of DIR or a :class:`headlab.api.Analysis` hold them)."""
    for relative, data in documents:
        if isinstance(data, dict) and isinstance(data.get("scores"), dict) and "method" in data:
            inner = Path(*Path(relative).parts[1:])  # the path within importance/, functions/, aggregate/
            scores = HeadScores.from_json(data, str(Path(where) / relative) if where else relative)
            yield _column(inner), scores
            errors = scores.stderr()  # LRP's bootstrap standard errors: a column beside its scores
            if errors is not None:
                yield _column(inner) + "_stderr", errors


def _score_files(out_dir: Path, vouched):
    return score_columns(_documents(out_dir, vouched), out_dir)


def heads_table(out_dir: str | Path, model: str | None = None) -> tuple[list[str], list[list]]:
    """``(columns, rows)`` of the run in ``out_dir``: one row per head any file scores. ``model``:
    the model column (default: read from the directory, :func:`_model_of`). The files of a stage
    that ``manifest.json`` says did not finish (a run killed in it) are left out, with a warning
    (:mod:`headlab.report.vouched`)."""
    return _heads_table(Path(out_dir), model, stacklevel=3)


def _heads_table(out_dir: Path, model: str | None, stacklevel: int) -> tuple[list[str], list[list]]:
    """:func:`heads_table`; its warnings point ``stacklevel`` frames up (the caller of the public function)."""
    import warnings

    from headlab.report.vouched import read_manifest, vouched

    manifest = read_manifest(out_dir)
    readable = vouched(out_dir, manifest)
    for group in readable.under(*_sources()):
        warnings.warn(f"{out_dir}: heads table: {group.text()}", UserWarning, stacklevel=stacklevel)
    columns_scores = list(_score_files(out_dir, readable))
    if model is None:
        model = _model_of(manifest, [scores for _, scores in columns_scores])
    labels: dict[str, list[str]] = {}
    labels_path = out_dir / "functions" / "labels.json"
    if labels_path.is_file() and readable.reads("functions/labels.json"):
        from headlab.pipeline.labels import load_labels

        labels = load_labels(labels_path)
    return table_rows(columns_scores, labels, out_dir, model=model, run=out_dir.resolve().name)


def table_dtype(columns_scores, where: str) -> str | None:
    """The dtype of the ``dtype`` column of a table of ``(column, HeadScores)`` pairs (heads.csv,
    :meth:`headlab.api.Analysis.records`): the one the tables were measured in, None for float32 (or none known), which
    has no such column. One row per head holds them side by side: tables of two precisions are refused
    (:func:`headlab.heads.one_dtype`; a missing dtype: :func:`headlab.heads.measured_dtype`)."""
    dtype = one_dtype(((f"column {name}", scores.signature) for name, scores in columns_scores), where)
    return dtype if dtype not in (None, DEFAULT_DTYPE) else None


def table_rows(columns_scores, labels: dict[str, list[str]], where: str | Path = "", *, model: str = "",
               run: str = "") -> tuple[list[str], list[list]]:
    """``(columns, rows)`` of ``(column, HeadScores)`` pairs and function labels (``"kind:layer:head"``);
    ``model`` and ``run`` fill the columns of those names."""
    columns_scores = list(columns_scores)
    dtype = table_dtype(columns_scores, str(where) or "heads table")
    precision = [dtype] if dtype is not None else []  # float32: the columns they always were
    values: dict[str, dict[tuple[str, int, int], float]] = {}
    reconstructed: set[str] = set()
    for name, scores in columns_scores:
        if name in values:
            raise HeadlabError(f"{where}: two score files give the column {name!r}")
        values[name] = dict(scores.items())
        reconstructed.update(reconstructed_blocks(scores.signature))
    heads = {key for column in values.values() for key in column}
    for key in labels:
        kind, layer_s, head_s = key.split(":")
        heads.add((kind, int(layer_s), int(head_s)))
    order = {kind: i for i, kind in enumerate(KINDS)}
    heads_sorted = sorted(heads, key=lambda h: (order.get(h[0], len(KINDS)), h[1], h[2]))
    measures = list(values)
    # where head numbers are reconstructed, each row says whether its head's number is the original model's
    columns = [*KEY_COLUMNS, *(["numbering"] if reconstructed else []), *(["dtype"] if precision else []), *measures]
    groups = function_groups()
    if labels:
        columns += ["functions", *groups]
    rows = []
    for kind, layer, head in heads_sorted:
        row: list = [model, run, kind, layer, head]
        if reconstructed:
            row.append("reconstructed" if f"{kind}:{layer}" in reconstructed else "original")
        row += precision
        for name in measures:
            value = values[name].get((kind, layer, head), math.nan)
            row.append(None if value is None or math.isnan(value) else float(value))
        if labels:
            found = labels.get(f"{kind}:{layer}:{head}", [])
            row.append("; ".join(found))
            row += ["; ".join(x for x in found if label_group(x) == group) for group in groups]
        rows.append(row)
    return columns, rows


def write_heads_table(out_dir: str | Path, model: str | None = None) -> list[Path]:
    """Write ``heads.csv`` (empty cells: not scored) and, with pyarrow, ``heads.parquet``; the files of
    a stage that ``manifest.json`` says did not finish are left out, with a warning (:func:`heads_table`)."""
    out_dir = Path(out_dir)
    columns, rows = _heads_table(out_dir, model, stacklevel=3)
    if not rows:
        return []
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(columns)
    writer.writerows(["" if v is None else repr(v) if isinstance(v, float) else v for v in row] for row in rows)
    path = out_dir / "heads.csv"
    atomic_write_text(path, buffer.getvalue())
    written = [path]
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        return written
    table = pa.table({name: [row[i] for row in rows] for i, name in enumerate(columns)})
    parquet = out_dir / "heads.parquet"
    partial = parquet.with_name(parquet.name + ".partial")
    pq.write_table(table, partial)
    partial.replace(parquet)  # atomic, like every other result file
    written.append(parquet)
    return written
