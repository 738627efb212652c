"""Attention kinds and HeadScores, the one table every analysis speaks.

A HeadScores holds one float array ``[n_layers, n_heads]`` per attention kind. NaN marks a
head that was not scored (or that a pruned layer no longer has). It never references a model,
so any analysis can be saved, reloaded and re-plotted without re-running it.
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import math
import numbers
import operator
import os
import shutil
import stat
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from headlab.errors import HeadlabError, counted
from headlab.numbers import number

KINDS = ("enc_self", "dec_self", "dec_cross")
"""Attention kinds, in the order the paper discusses them."""

CAUSAL_KINDS = frozenset({"dec_self"})
"""Kinds under a causal mask: a query sees only keys at or before its own position."""

BlockKey = tuple[str, int]
"""One attention block: ``(kind, layer)``."""

HeadSpec = Mapping[BlockKey, "list[int] | tuple[int, ...] | set[int]"]
"""Heads per block: ``{(kind, layer): [head, ...]}``."""

Numbering = Mapping[BlockKey, "tuple[list[int], int]"]
"""A physically pruned model's heads: ``{(kind, layer): (kept heads, original head count)}``, the
kept heads by their original index in the order the block runs them
(:func:`headlab.surgery.original_heads`)."""


def kv_heads_kept(keep: "list[int] | tuple[int, ...]", n_heads: int, n_kv_heads: int) -> tuple[list[int], int]:
    """Pruning's grouping rule: the key/value heads a layer of ``n_heads`` query heads over
    ``n_kv_heads`` key/value heads keeps when its query heads ``keep`` stay (in order, repeats
    allowed), and the new number of query heads per key/value head.

    Under grouped-query attention a key/value head goes only when all its query heads are gone.
    If the surviving groups have unequal sizes, the forward's ``repeat_kv`` cannot map them, so
    each kept query head gets its own copy of its key/value head (group size 1). The one rule that
    :func:`headlab.surgery.prune_heads` applies and :mod:`headlab.checkpoint` reads back from a
    re-saved directory's weights.
    """
    if n_kv_heads == n_heads:
        return list(keep), 1
    group = n_heads // n_kv_heads
    counts = Counter(h // group for h in keep)  # kept query heads per key/value head
    sizes = set(counts.values())
    if len(sizes) <= 1:
        return sorted(counts), (sizes.pop() if sizes else group)
    return [h // group for h in keep], 1


def reconstructed_blocks(signature: Mapping[str, object]) -> list[str]:
    """The blocks (``"dec_self:0"``) whose head numbers a table's signature declares reconstructed:
    the model was a pruned directory re-saved without its record, whose kept heads are numbered as
    its weights group them, not as in the model they were pruned from (``"numbering":
    {"reconstructed": [...]}``, :func:`headlab.surgery.declared_numbering`)."""
    numbering = signature.get("numbering")
    blocks = numbering.get("reconstructed") if isinstance(numbering, Mapping) else None
    return [str(block) for block in blocks] if isinstance(blocks, list) else []


def reconstructed_note(blocks: "list[str]") -> str:
    """One sentence for a reader of heads numbered by reconstruction (:func:`reconstructed_blocks`)."""
    blocks = sorted(blocks, key=lambda b: (KINDS.index(b.split(":")[0]) if b.split(":")[0] in KINDS else len(KINDS),
                                           int(b.split(":")[-1]) if b.split(":")[-1].isdigit() else 0, b))
    return (f"head numbers of {', '.join(blocks)} are reconstructed, not the original model's: the pruned model was "
            "re-saved without headlab_pruning.json, so its kept heads are numbered as its weights group them "
            "(docs/foundation.md, \"Re-saved by transformers\")")


DEFAULT_DTYPE = "float32"
"""The weights' dtype of a run without ``--dtype``: :func:`headlab.loading.load_model` widens every checkpoint to it.
A head-pass table (``functions``, ``aggregate``) records its dtype only when it is another one, so that a float32
run writes the files it always wrote."""


def weights_dtype(model: Any) -> str:
    """The dtype of ``model``'s floating-point weights (``--dtype``), as the tables record it: ``"float32"``,
    ``"bfloat16"``; several joined by commas (``"bfloat16,float32"``); ``"none"`` for none."""
    found = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.is_floating_point()})
    return ",".join(found) or "none"


def measured_dtype(signature: Mapping[str, object]) -> str | None:
    """The dtype of the weights a table was measured with, from its signature: ``dtype`` (a head-pass table,
    :mod:`headlab.functions`, written where not float32) or ``options.dtype`` (an importance table). A head-pass
    table without it (it has ``spacing``) is float32: files written before the key existed (every committed one ran
    without ``--dtype``; one run with another ``--dtype`` then reads as float32) and those written since in float32.
    None where unknown: an importance table written before ``options.dtype`` existed."""
    return _recorded_dtype(signature)[0]


UNRECORDED_DTYPE = "records none: float32, or a file from before the tables recorded it"
"""What a refusal of two dtypes says of a head-pass table whose signature has no ``dtype`` (:func:`measured_dtype`)."""


def dtype_recorded(signature: Mapping[str, object]) -> bool:
    """Whether a table's signature says its dtype (False: a head-pass table read as float32, or none known)."""
    return _recorded_dtype(signature)[1]


def _recorded_dtype(signature: Mapping[str, object]) -> tuple[str | None, bool]:
    """:func:`measured_dtype` and whether the signature says it (False: a head-pass table's float32 by default)."""
    if isinstance(signature.get("dtype"), str):
        return str(signature["dtype"]), True
    options = signature.get("options")
    if isinstance(options, Mapping) and isinstance(options.get("dtype"), str):
        return str(options["dtype"]), True
    return (DEFAULT_DTYPE, False) if "spacing" in signature else (None, False)


def one_dtype(tables: Iterable[tuple[str, Mapping[str, object]]], where: str) -> str | None:
    """The one dtype that ``tables`` (``(name, signature)`` pairs) were measured in (:func:`measured_dtype`; None:
    none known); tables of two dtypes are refused, naming a table of each: compared or read side by side, a bfloat16
    table and a float32 one are two other computations, head by head."""
    first: dict[str, tuple[str, bool]] = {}  # dtype -> the first table measured in it, and whether it says so
    for name, signature in tables:
        dtype, said = _recorded_dtype(signature)
        if dtype is not None and (dtype not in first or said and not first[dtype][1]):
            first[dtype] = (name, said)
    if len(first) > 1:
        (ours, (one, said)), (theirs, (other, also_said)) = list(first.items())[:2]
        unsaid = [name for name, known in ((one, said), (other, also_said)) if not known]
        note = f" ({unsaid[0]} {UNRECORDED_DTYPE})" if unsaid else ""
        raise HeadlabError(f"{where}: {one} was measured with the weights in {ours}, {other} in {theirs} (--dtype): "
                           f"tables of other precisions are other computations; measure them all in one dtype{note}")
    return next(iter(first), None)


def check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise HeadlabError(f"unknown attention kind {kind!r}; expected one of {', '.join(KINDS)}")
    return kind


def format_head(kind: str, layer: int, head: int) -> str:
    """Human-readable head name, 0-based like every headlab index: ``enc_self L2 H4``."""
    return f"{kind} L{layer} H{head}"


def shown_model_name(name: str) -> str:
    """A model's name as its results show it (the ``model`` of a score table, an Analysis): a local
    directory by its own name, a hub id ("org/model", no such directory here) whole. Its last part
    alone dropped the org: the caption read "opus-mt-en-de", two orgs' models of one name were one
    in ``to_pandas()``, and heads.csv (the run's model argument) named it otherwise."""
    import re

    if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", name) and not Path(name).exists():
        return name
    return Path(name).name


def read_json(path: str | os.PathLike, what: str) -> Any:
    """Parse a JSON file; a missing file or bad JSON is a HeadlabError naming the file (and line)."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as error:
        raise HeadlabError(f"{path}: no such {what}") from error
    except json.JSONDecodeError as error:
        raise HeadlabError(f"{path}: line {error.lineno}: invalid JSON ({error.msg})") from error
    except UnicodeDecodeError as error:
        raise HeadlabError(f"{path}: not valid UTF-8 ({error.reason} at byte {error.start})") from error
    except OSError as error:  # a directory, unreadable
        raise HeadlabError(f"{path}: cannot read the {what} ({error.strerror or error})") from error


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """:func:`atomic_write_bytes` of ``text`` in UTF-8."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` so that a reader sees the old file or the new one, never half of one."""
    if not os.fspath(path):  # Path("") is the current directory
        raise HeadlabError("cannot write a file at an empty path")
    path = Path(path)
    if path.is_dir():  # os.replace would fail naming its temporary file
        raise HeadlabError(f"{path}: a directory, not a file")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the mode a plain open() would
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_dir(final: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """Write a directory under a temporary name beside ``final`` (``write(tmp)``), then swap it in.

    The old directory is first moved aside and removed only after the new one is in place, so a
    kill at any moment leaves either the old or the new one complete, never a mix of the two; a
    ``write`` that fails leaves the old one as it was and removes its own files. Both temporary
    places are new directories made here (``.NAME.tmp-*/NAME``, ``.NAME.old-*/NAME``): a sibling
    the user made, ``NAME.old`` say, is never touched.
    """
    final = Path(os.path.abspath(final))  # "." has no name to put beside it
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp-"))
    tmp = staging / final.name
    try:
        write(tmp)
        readable_as_umask_allows(tmp)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    aside = None
    if final.exists():
        aside = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.old-"))
        os.replace(final, aside / final.name)
    os.replace(tmp, final)
    staging.rmdir()
    if aside is not None:
        shutil.rmtree(aside)


def moved_aside(final: str | os.PathLike) -> list[Path]:
    """The old copies of ``final`` that :func:`atomic_dir` moved aside and a kill kept it from
    removing (newest first): the only complete copy when the kill came between its two renames."""
    final = Path(os.path.abspath(final))
    found = [p / final.name for p in final.parent.glob(f".{final.name}.old-*") if (p / final.name).is_dir()]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def readable_as_umask_allows(directory: Path) -> None:
    """Add to each file under ``directory`` the permission bits a plain open() would have given:
    transformers' ``save_pretrained`` writes ``model.safetensors`` as 0600 (a temporary file
    renamed), which the other users of a shared model or results directory cannot read."""
    allowed = 0o666 & ~_umask()
    for path in directory.rglob("*"):
        if path.is_file() and not path.is_symlink():
            mode = stat.S_IMODE(path.stat().st_mode)
            if mode | allowed != mode:
                os.chmod(path, mode | allowed)


def write_json(path: str | os.PathLike, data: Any, **dumps_options: Any) -> Path:
    """``data`` as JSON indented by one space, written atomically; returns the path. A NaN (a value
    that is not defined: no case to count, a removed head) is written as null, as HeadScores files
    write it; an infinite value is refused (HeadlabError). NaN and Infinity are not JSON (RFC 8259,
    Sec. 6), and strict readers (JavaScript's JSON.parse, jq) reject the file."""
    path = Path(path)
    atomic_write_text(path, json_text(data, path.name, **{"indent": 1, **dumps_options}) + "\n")
    return path


def json_text(data: Any, where: str, **dumps_options: Any) -> str:
    """``json.dumps(data, **dumps_options)`` as :func:`write_json` writes it: NaN as null, an infinite
    value refused (HeadlabError naming ``where`` and the key), for writers that need their own file
    handling (a staging directory, an HTML page)."""
    try:
        return json.dumps(data, allow_nan=False, **dumps_options)
    except ValueError:  # a NaN or an infinity somewhere: the slow walk only then
        return json.dumps(_finite_or_null(data, where), allow_nan=False, **dumps_options)


def _finite_or_null(data: Any, where: str) -> Any:
    """``data`` with every NaN float made None; HeadlabError naming the first infinite one."""
    if isinstance(data, float):
        if math.isnan(data):
            return None
        if math.isinf(data):
            raise HeadlabError(f"{where}: {data} is infinite, which JSON cannot hold; nothing was written")
        return data
    if isinstance(data, dict):
        return {key: _finite_or_null(value, f"{where}[{key!r}]") for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [_finite_or_null(value, f"{where}[{i}]") for i, value in enumerate(data)]
    return data


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (no display needed), or a notebook's inline one."""
    import matplotlib

    if matplotlib.get_backend().lower() not in ("agg", "module://matplotlib_inline.backend_inline"):
        matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def panel_row(axes: Any, n: int, figsize: tuple[float, float]) -> tuple[Any, Any]:
    """``(figure, axes)``: the axes given, or a new row of ``n`` panels."""
    if axes is not None:
        axes = np.atleast_1d(axes)
        return axes[0].figure, axes
    fig, axes = pyplot().subplots(1, n, figsize=figsize, squeeze=False, layout="constrained")
    return fig, axes[0]


def axes_or_new(ax: Any = None, figsize: tuple[float, float] = (6, 4), **subplots_options: Any) -> Any:
    """``ax``, or the axes of a new figure of ``figsize`` (on the current backend)."""
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=figsize, **subplots_options)[1]


def write_figure(fig: Any, path: str | os.PathLike, close: bool = True, **savefig_options: Any) -> Path:
    """Save the matplotlib figure ``fig`` atomically (format from the suffix), then close it
    (unless ``close`` is False: another format of it follows)."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format=path.suffix[1:], **savefig_options)
    if close:
        plt.close(fig)
    os.replace(tmp, path)
    return path


def _index(value: Any, size: int, what: str) -> int:
    """``value`` as an index in ``0..size-1``: an int (numpy's too), never a bool, float, string or
    a negative number counting from the end."""
    try:
        index = operator.index(value) if not isinstance(value, bool) else None
    except TypeError:
        index = None
    if index is None or not 0 <= index < size:
        raise HeadlabError(f"{what} {value!r} is not one of 0..{size - 1}")
    return index


def cut_tie(values: Sequence[float], keep: int) -> dict | None:
    """Where a cut keeping the first ``keep`` of ``values`` (sorted best first, ties in their given order) falls among
    equal values, so that the order, not the values, chose which of them stay: ``{"tied": n, "kept": m, "score": s}``
    (m of the n heads scoring s kept); None where the values decide (or nothing is cut)."""
    if not 0 < keep < len(values) or values[keep] != values[keep - 1]:
        return None
    at_cut = values[keep - 1]
    return {"tied": values.count(at_cut), "kept": values[:keep].count(at_cut), "score": at_cut}


@dataclass(frozen=True)
class HeadScores:
    """One score per head, per attention kind.

    ``scores[kind]`` is a float array ``[n_layers, n_heads]`` (layer outer, head inner).
    ``signature`` records what produced the numbers (data, token count, options, version),
    in the spirit of sacreBLEU's signatures, so that a table can be reproduced.
    """

    scores: Mapping[str, np.ndarray]
    method: str
    model: str = ""
    signature: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        clean = {}
        for kind, values in self.scores.items():
            check_kind(kind)
            array = np.array(values, dtype=np.float64)
            if array.ndim != 2:
                raise HeadlabError(
                    f"HeadScores[{kind!r}] must be [n_layers, n_heads], got shape {array.shape}"
                )
            array.setflags(write=False)
            clean[kind] = array
        # Keep kinds in canonical order whatever order they came in.
        ordered = {kind: clean[kind] for kind in KINDS if kind in clean}
        object.__setattr__(self, "scores", ordered)
        object.__setattr__(self, "signature", dict(self.signature))

    # -- display --------------------------------------------------------------------------
    def __repr__(self) -> str:
        """Shape per kind and the top heads, not the arrays (a notebook prints this)."""
        shapes = ", ".join(f"{kind} {a.shape[0]}x{a.shape[1]}" for kind, a in self.scores.items())
        ranked = sorted(((v, k) for k, v in self.items() if not math.isnan(v)), reverse=True)[:3]
        top = ", ".join(f"{format_head(*key)} {number(value, '.3g')}" for value, key in ranked)
        model = f" of {self.model}" if self.model else ""
        return f"HeadScores({self.method}{model}: {shapes or 'no kind'}; top: {top or 'none scored'})"

    def _repr_html_(self) -> str:
        from headlab.display import heatmaps_html

        return heatmaps_html([(f"{self.method} {kind}", array, None) for kind, array in self.scores.items()],
                             caption=repr(self))

    # -- access ---------------------------------------------------------------------------
    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(self.scores)

    def __getitem__(self, kind: str) -> np.ndarray:
        if kind not in self.scores:
            raise HeadlabError(f"{self.method} scores have no kind {kind!r} (have {', '.join(self.kinds)})")
        return self.scores[kind]

    def items(self) -> Iterator[tuple[tuple[str, int, int], float]]:
        """Every scored head as ``((kind, layer, head), score)``, NaN heads skipped."""
        for kind, array in self.scores.items():
            for layer, head in zip(*np.nonzero(~np.isnan(array))):
                yield (kind, int(layer), int(head)), float(array[layer, head])

    def with_scores(self, scores: Mapping[str, np.ndarray], method: str | None = None) -> "HeadScores":
        return HeadScores(scores, method or self.method, self.model, self.signature)

    def without(self, heads: "HeadSpec") -> "HeadScores":
        """These scores with NaN for ``heads``: heads switched off or removed are not ranked."""
        arrays = {kind: array.copy() for kind, array in self.scores.items()}
        for (kind, layer), indices in heads.items():
            check_kind(kind)  # a misspelt kind was skipped as if not scored here
            if kind in arrays:
                # numpy would take -1 as the last head (or layer), 1.5 or True as another one
                n_layers, n_heads = arrays[kind].shape
                layer_at = _index(layer, n_layers, f"{self.method} scores: {kind} layer")
                arrays[kind][layer_at, [_index(h, n_heads, f"{self.method} scores: {kind} layer {layer_at}: head")
                                        for h in indices]] = np.nan
        return self.with_scores(arrays)

    def stderr(self) -> "HeadScores | None":
        """The standard error of every score, when the signature keeps one (``"bootstrap":
        {"stderr": {kind: [[...]]}, ...}``, as LRP writes it), as HeadScores ``<method>_stderr``."""
        bootstrap = self.signature.get("bootstrap")
        if not isinstance(bootstrap, dict) or not isinstance(bootstrap.get("stderr"), dict):
            return None
        errors: dict = bootstrap["stderr"]
        try:
            arrays = {kind: np.array([[np.nan if v is None else v for v in row] for row in rows], dtype=np.float64)
                      for kind, rows in errors.items()}
        except (TypeError, ValueError) as error:
            raise HeadlabError(f"{self.method} scores: an unreadable bootstrap standard error ({error})") from error
        meta = {key: value for key, value in bootstrap.items() if key != "stderr"}
        return HeadScores(arrays, f"{self.method}_stderr", self.model, {"of": self.method, **meta})

    # -- operations ------------------------------------------------------------------------
    def normalize_per_layer(self) -> "HeadScores":
        """Divide each layer's scores by their sum (Voita et al. 2019, Sec. 4: relevance is
        normalised over the heads of a layer). Layers summing to zero stay as they are."""
        out = {}
        for kind, array in self.scores.items():
            totals = np.nansum(array, axis=1, keepdims=True)
            safe = np.where(totals == 0, 1.0, totals)
            out[kind] = array / safe
        return self.with_scores(out)

    def rank(self, descending: bool = True) -> list[tuple[str, int, int]]:
        """All scored heads as ``(kind, layer, head)``, most important first."""
        ordered = sorted(self.items(), key=lambda item: item[1], reverse=descending)
        return [key for key, _ in ordered]

    def top_mask(self, keep: int, kinds: tuple[str, ...] | None = None) -> dict[tuple[str, int], list[int]]:
        """The heads to *remove* so that the ``keep`` best-scored heads (over ``kinds``) remain.

        The result is a head spec for :func:`headlab.mask_heads` / :func:`headlab.prune_heads`.
        """
        if isinstance(keep, bool) or not isinstance(keep, numbers.Integral):  # True was 1 head, 1.5 a TypeError
            raise HeadlabError(f"keep must be an integer number of heads, got {keep!r}")
        keep = int(keep)
        kinds = ((kinds,) if isinstance(kinds, str) else tuple(kinds)) if kinds else self.kinds  # "enc" was e, n, c
        for kind in kinds:
            check_kind(kind)
        scored = self._ranked_items(kinds)
        if not 0 <= keep <= len(scored):
            raise HeadlabError(f"cannot keep {counted(keep, 'head')}: {len(scored)} are scored in {', '.join(kinds)}")
        ranked = [key for key, _ in scored]
        tie = cut_tie([value for _, value in scored], keep)
        if tie is not None:  # position, not the scores, chose among them: said, never silent
            logging.getLogger(__name__).warning(
                "%s scores: keeping %s, the cut falls among %d heads of equal score (%s): %d of them kept by position "
                "(the order of kinds, layers and heads), not by their scores", self.method, counted(keep, "head"),
                tie["tied"], number(tie["score"], ".6g"), tie["kept"])
        removed: dict[tuple[str, int], list[int]] = {}
        for kind, layer, head in ranked[keep:]:
            removed.setdefault((kind, layer), []).append(head)
        return {block: sorted(heads) for block, heads in sorted(removed.items())}

    def _ranked_items(self, kinds: tuple[str, ...]) -> list[tuple[tuple[str, int, int], float]]:
        """The scored heads of ``kinds`` with their scores, best first (:meth:`rank`'s order: a stable sort)."""
        return [item for item in sorted(self.items(), key=lambda item: item[1], reverse=True) if item[0][0] in kinds]

    def tie_at_cut(self, keep: int, kinds: tuple[str, ...] | None = None) -> dict | None:
        """Where :meth:`top_mask`'s cut at ``keep`` falls among heads of equal score, so that their order (stable:
        kind, layer, head) chose which stay: :func:`cut_tie`'s ``{"tied": n, "kept": m, "score": s}``; None where the
        scores decide."""
        return cut_tie([value for _, value in self._ranked_items(kinds or self.kinds)], keep)

    # -- files -----------------------------------------------------------------------------
    def to_json(self) -> dict:
        def encode(value: float) -> float | None:
            return None if math.isnan(value) else float(value)

        for kind, array in self.scores.items():  # JSON has no infinity: json.dumps wrote `Infinity`, invalid JSON
            infinite = np.argwhere(np.isinf(array))
            if len(infinite):
                layer, head = map(int, infinite[0])
                raise HeadlabError(f"{self.method} scores: {kind} layer {layer} head {head} is infinite "
                                   f"({array[layer, head]}); JSON has no infinity, and a score has to be a number")

        return {
            "method": self.method,
            "model": self.model,
            "signature": self.signature,
            "scores": {
                kind: [[encode(v) for v in row] for row in array.tolist()]
                for kind, array in self.scores.items()
            },
        }

    def fingerprint(self) -> str:
        """SHA-256 of the method and the scores alone: the same scores give the same fingerprint
        wherever the file was written from (its ``model`` path and signature are left out)."""
        content = {k: v for k, v in self.to_json().items() if k in ("method", "scores")}
        return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()

    @classmethod
    def from_json(cls, data: Mapping, source: str = "<json>") -> "HeadScores":
        try:
            scores = {
                kind: np.array([[np.nan if v is None else v for v in row] for row in rows], dtype=np.float64)
                for kind, rows in data["scores"].items()
            }
            return cls(scores, data["method"], data.get("model", ""), data.get("signature", {}))
        except (KeyError, TypeError, ValueError) as error:
            raise HeadlabError(f"{source}: not a HeadScores file ({error})") from error

    def save(self, path: str | os.PathLike) -> Path:
        return write_json(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "HeadScores":
        return cls.from_json(read_json(path, "HeadScores file"), str(path))

    def save_csv(self, path: str | os.PathLike) -> Path:
        """One row per head: kind, layer, head, score (empty when not scored)."""
        path = Path(path)
        rows: list[list[object]] = [["kind", "layer", "head", self.method]]
        for kind, array in self.scores.items():
            for layer in range(array.shape[0]):
                for head in range(array.shape[1]):
                    value = array[layer, head]
                    rows.append([kind, layer, head, "" if math.isnan(value) else repr(float(value))])
        import io

        buffer = io.StringIO()
        csv.writer(buffer, lineterminator="\n").writerows(rows)
        atomic_write_text(path, buffer.getvalue())
        return path


def head_scores(
    per_block: Mapping[BlockKey, np.ndarray],
    method: str,
    model: str = "",
    signature: Mapping[str, object] | None = None,
) -> HeadScores:
    """Assemble ``{(kind, layer): values [n_heads]}`` into one HeadScores (NaN where a block has
    fewer heads or was not analysed)."""
    shapes: dict[str, tuple[int, int]] = {}
    for (kind, layer), values in per_block.items():
        n_layers, n_heads = shapes.get(kind, (0, 0))
        shapes[kind] = (max(n_layers, layer + 1), max(n_heads, len(values)))
    scores = {kind: np.full(shape, np.nan) for kind, shape in shapes.items()}
    for (kind, layer), values in per_block.items():
        scores[kind][layer, : len(values)] = np.asarray(values, dtype=np.float64)
    return HeadScores(scores, method, model, dict(signature or {}))


def renumbering_needed(numbering: Numbering) -> bool:
    """Whether some block's heads are not ``0..n-1`` of its original heads (a pruned model): its
    per-block results must then be scattered to the original numbering (:func:`to_original`)."""
    return any(list(kept) != list(range(n_original)) for kept, n_original in numbering.values())


def renumbered_blocks(numbering: Numbering) -> list[BlockKey]:
    """The blocks whose kept heads are not their first original ones (a pruned layer that kept
    heads 1-3): there a head's index as the model runs it is not its original index."""
    return [key for key, (kept, _) in numbering.items() if list(kept) != list(range(len(kept)))]


def to_original(per_block: Mapping[BlockKey, np.ndarray], numbering: Numbering, fill: float) -> dict[BlockKey, np.ndarray]:
    """Per-block arrays whose first axis is a block's heads as the model runs them, with that axis
    in the original numbering: each kept head at its original index, ``fill`` for a removed one
    (NaN, or 0 for counts: a removed head counted nothing). A block of ``numbering`` without an
    array (a layer with no head left) gets one of ``fill`` shaped like the others'."""
    template = next(iter(per_block.values()), None)
    if template is None:
        return {}
    out: dict[BlockKey, np.ndarray] = {}
    for key in [*per_block, *(key for key in numbering if key not in per_block)]:
        if key not in numbering:
            out[key] = per_block[key]
            continue
        kept, n_original = numbering[key]
        values = np.asarray(per_block.get(key, np.zeros((0, *template.shape[1:]), dtype=template.dtype)))
        array = np.full((n_original, *values.shape[1:]), fill, dtype=np.result_type(values.dtype, fill))
        array[list(kept)] = values
        out[key] = array
    return out


def scores_to_original(scores: HeadScores, numbering: Numbering) -> HeadScores:
    """``scores`` built from per-block values (:func:`head_scores`: a block's heads at ``0..n-1``)
    with each kept head at its original index, NaN for removed heads: as wide as the original
    layers, as deep as the blocks of ``numbering``."""
    arrays = {}
    for kind, array in scores.scores.items():
        blocks = {layer: entry for (k, layer), entry in numbering.items() if k == kind}
        n_layers = max([array.shape[0], *(layer + 1 for layer in blocks)])
        out = np.full((n_layers, max([array.shape[1], *(n for _, n in blocks.values())])), np.nan)
        for layer in range(array.shape[0]):
            if layer in blocks:
                kept = list(blocks[layer][0])
                out[layer, kept] = array[layer, :len(kept)]
            else:
                out[layer, :array.shape[1]] = array[layer]
        arrays[kind] = out
    return scores.with_scores(arrays)


def normalised_per_layer(signature: Mapping[str, object]) -> bool:
    """Whether a table's scores are normalised over the heads of each layer, from its signature:
    gradient importance's l2 norm (Michel et al. 2019) and LRP's sum of |relevance| (Voita et al. 2019)."""
    text = str(signature.get("normalisation", ""))
    return text == "l2 per layer" or "over the heads of a layer" in text


def not_comparable_across_layers(scores: Mapping[str, Any]) -> str:
    """Why scores normalised per layer (``{kind: [n_layers, n_heads]}``, NaN or None where a head
    was removed) cannot be ranked across layers: the layers (all kinds) keep different numbers of
    heads, or one head each (a layer's only head takes the whole layer's share, whatever it does);
    "" if they can."""
    counts = [sum(v is not None and not math.isnan(v) for v in row) for rows in scores.values() for row in rows]
    counts = [n for n in counts if n]
    if len(set(counts)) > 1:
        return "the layers keep different numbers of heads"
    if len(counts) > 1 and counts[0] == 1:
        return "every layer keeps one head"
    return ""
