"""The small result files of the reproduction: copied from the work dirs, read back for the claims.

Layout of ``<results_dir>/<model>/`` (every file is a stage's own output, copied unchanged but for
paths under the repository root, which are written relative to it):

```
importance/{confidence,lrp,gradient,gradient_raw,ablation}.json   HeadScores (headlab importance)
importance/agreement.json                                          Spearman with ablation
functions/positional_share.json, positional_offset.json            word level (headlab functions)
functions/token_share.json, token_offset.json                      subword-token level
functions/table1.json, syntactic_margin.json                       Table 1 analogue, best margin per head
functions/rare_rarest.json, rare_two_rarest.json, rare_summary.json
functions/interior_share.json                                      positional share, words with both neighbours
functions/rare_rarest_per_sentence.json, rare_per_sentence.json    the rare-token shares per sentence
functions/summary.json                                             what the pass read
functions-parsed/table1.json, summary.json, positional_share.json, interior_share.json
                                                                   the same on the parsed validation text
functions-<first|max>/table1.json, positional_share.json, summary.json
                                                                   under another word pooling (stage pooling)
functions-parsed/parser.json                                       the parser's scores on EWT test (its card's file)
prune/<enc|all>/full.json                                          the unpruned model's evaluation
prune/<enc|all>/<point>/result.json, gates.json, kept.json,        one sweep point (kept.json: headlab_pruning.json;
                       prune_config.json                           result.json holds its development curve, "dev")
baselines/<name>.json                                              baselines.json of prune/base-<name>
scratch.json, scratch-enc.json                                     baselines.json of prune/scratch, prune/scratch-enc
specialisation.json                                                checkpoints (reproduction.specialisation)
hypotheses/<full|sweep-point>.txt                                  greedy test-set translations (a point's own
                                                                   hypotheses.txt, else stage hypotheses)
hypotheses/scratch[-enc]-<heads>.txt                               those of the from-scratch run at that many heads
timings.json                                                       wall time of every stage run by the pipeline
```
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Callable

import numpy as np

from headlab import HeadScores
from headlab.heads import atomic_write_text
from headlab.importance.registry import tables
from headlab.resume import weights_fingerprint
from reproduction.config import ModelEntry, ReproduceConfig

__all__ = ["collect_results", "ModelResults", "kept_mask"]

_FUNCTIONS = {
    "positional/share.json": "positional_share.json",
    "positional/offset.json": "positional_offset.json",
    "positional/token_share.json": "token_share.json",
    "positional/token_offset.json": "token_offset.json",
    "syntactic/table1.json": "table1.json",
    "syntactic/margin.json": "syntactic_margin.json",
    "rare_tokens/rarest.json": "rare_rarest.json",
    "rare_tokens/two_rarest.json": "rare_two_rarest.json",
    "rare_tokens/summary.json": "rare_summary.json",
    "positional/interior_share.json": "interior_share.json",
    "rare_tokens/rarest_per_sentence.json": "rare_rarest_per_sentence.json",
    "rare_tokens/per_sentence.json": "rare_per_sentence.json",
    "summary.json": "summary.json",
}


def _flat(name: str) -> str:
    """``positional/share.json`` -> ``positional_share.json`` (the names of the functions/ copies)."""
    return _FUNCTIONS.get(name, Path(name).name)


def _copy(src: Path, dst: Path, written: list[Path], root: str = "") -> None:
    """Copy a result file; paths under the repository ``root`` are written relative to it (as run from the root)."""
    if src.is_file():
        text = src.read_text(encoding="utf-8")
        if root:
            text = text.replace(root, "")
        if not dst.is_file() or dst.read_text(encoding="utf-8") != text:
            atomic_write_text(dst, text)
            written.append(dst)


def collect_results(config: ReproduceConfig, model: ModelEntry, log: Callable[[str], None] = print) -> list[Path]:
    """Copy the small outputs of every stage that has them into ``<results_dir>/<model>/``.

    A result whose source is missing (e.g. checkpoints that are not on this machine) keeps its
    committed copy. The one exception is a sweep point made from other weights than the work
    dir's ``full.json`` records (the bundled model was retrained): its copy and its translations
    are removed, as the sweep itself set the point aside (:func:`_drop_stale_points`)."""
    work, res = config.work(model), config.results(model)
    written: list[Path] = []
    root = str(Path(config.root).resolve()) + "/"

    def copy(src: Path, dst: Path) -> None:
        _copy(src, dst, written, root)

    for name in (*tables(), "agreement"):
        copy(work / "importance" / f"{name}.json", res / "importance" / f"{name}.json")
    for src, dst in _FUNCTIONS.items():
        copy(work / "functions" / src, res / "functions" / dst)
    for name in ("syntactic/table1.json", "summary.json", "positional/share.json", "positional/interior_share.json"):
        copy(work / "functions-parsed" / name, res / "functions-parsed" / _flat(name))
    for pooling in config.pooling:
        for name in ("syntactic/table1.json", "positional/share.json", "summary.json"):
            copy(work / f"functions-{pooling}" / name, res / f"functions-{pooling}" / _flat(name))
    if config.parse.get("model") and (work / "functions-parsed" / "summary.json").is_file():
        copy(config.path(config.parse["model"]) / "eval_results.json", res / "functions-parsed" / "parser.json")
    own_hypotheses: set[str] = set()
    for sweep in ("enc", "all"):
        directory = work / "prune" / sweep
        copy(directory / "full.json", res / "prune" / sweep / "full.json")
        written += _drop_stale_points(res, sweep, log)
        if directory.is_dir():
            for point in sorted(directory.iterdir()):
                if (point / "result.json").is_file():
                    copy(point / "result.json", res / "prune" / sweep / point.name / "result.json")
                    copy(point / "gates.json", res / "prune" / sweep / point.name / "gates.json")
                    copy(point / "pruned" / "headlab_pruning.json", res / "prune" / sweep / point.name / "kept.json")
                    copy(point / "prune_config.json", res / "prune" / sweep / point.name / "prune_config.json")
                    if (point / "hypotheses.txt").is_file():
                        own_hypotheses.add(f"{sweep}-{point.name}")
                        copy(point / "hypotheses.txt", res / "hypotheses" / f"{sweep}-{point.name}.txt")
    prune = work / "prune"
    for base in sorted(prune.glob("base-*")):
        copy(base / "baselines.json", res / "baselines" / f"{base.name[len('base-'):]}.json")
    for table in ("scratch", "scratch-enc"):
        copy(prune / table / "baselines.json", res / f"{table}.json")
        for run in sorted((prune / table).glob("scratch-*")) if (prune / table).is_dir() else []:
            keep = run.name.split("-")[-2]  # scratch-<method>-<keep>-<seed>: the heads kept (in its kinds)
            copy(run / "hypotheses.txt", res / "hypotheses" / f"{table}-{keep}.txt")
    written += _drop_stale_rows(res, log)
    copy(work / "specialisation" / "specialisation.json", res / "specialisation.json")
    for path in sorted((work / "hypotheses").glob("*.txt")) if (work / "hypotheses").is_dir() else []:
        if path.stem not in own_hypotheses:  # the translations a point's BLEU was computed from win
            copy(path, res / "hypotheses" / path.name)
    timings_file = res / "timings.json"
    timings = json.loads(timings_file.read_text(encoding="utf-8")) if timings_file.is_file() else {}
    changed = False
    for marker in sorted((work / "stages").glob("*.json")) if (work / "stages").is_dir() else []:
        record = json.loads(marker.read_text(encoding="utf-8"))
        entry = {k: record.get(k) for k in ("seconds", "finished", "commands")}
        if record.get("model_sha256"):  # the weights it ran on: restore_importance reads it
            entry["model_sha256"] = record["model_sha256"]
        entry["commands"] = [c.replace(root, "") for c in entry["commands"] or []]  # as run from the root
        if timings.get(record["stage"]) != entry:
            timings[record["stage"]] = entry
            changed = True
    if changed:
        atomic_write_text(timings_file, json.dumps(timings, indent=1, sort_keys=True) + "\n")
        written.append(timings_file)
    if written:
        log(f"{model.name}: {len(written)} result files updated in {res}")
    return written


def _drop_stale_rows(res: Path, log: Callable[[str], None]) -> list[Path]:
    """Remove the committed baseline and from-scratch tables none of whose rows are of the weights
    of their sweep's full.json (the bundled model was retrained since they ran)."""
    view = ModelResults(res, res.name)
    tables = [(path, "enc") for path in sorted((res / "baselines").glob("*.json"))]
    tables += [(res / "scratch.json", "all"), (res / "scratch-enc.json", "enc")]
    removed = []
    for path, sweep in tables:
        weights = view.sweep_weights(sweep)
        rows = _json(path)
        if weights is not None and rows and not _same_weights(rows, weights):
            path.unlink()
            removed.append(path)
            log(f"{res.name}: removed {path.relative_to(res)}, made from other weights than prune/{sweep}/full.json")
    return removed


def _drop_stale_points(res: Path, sweep: str, log: Callable[[str], None]) -> list[Path]:
    """Remove the committed copies of ``sweep``'s points made from other weights than its full.json."""
    import shutil

    removed = []
    for name in ModelResults(res, res.name).sweep(sweep)["stale"]:
        point = res / "prune" / sweep / name
        shutil.rmtree(point)
        removed.append(point)
        hypotheses = res / "hypotheses" / f"{sweep}-{name}.txt"
        if hypotheses.is_file():
            hypotheses.unlink()
        log(f"{res.name}: removed {sweep} {name}, made from other weights than {sweep}/full.json")
    return removed


def _same_weights(rows: list[dict], weights: str | None) -> list[dict]:
    """The rows made from ``weights``; a row that records none (an older run) cannot be shown to
    be, so it is left out too. All rows when ``weights`` is None (nothing to compare with)."""
    return rows if weights is None else [row for row in rows if row.get("model_sha256") == weights]


def _json(path: Path):
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def _scores(path: Path) -> HeadScores | None:
    return HeadScores.load(path) if path.is_file() else None


class ModelResults:
    """Read-only view of one model's result files; every accessor returns None when missing."""

    def __init__(self, directory: str | Path, name: str, references: Path | None = None,
                 train_history: Path | None = None, model_dir: Path | None = None, parsed_text: str | None = None):
        self.dir = Path(directory)
        self.name = name
        self.parsed_text = parsed_text  # the source file that stage functions-parsed parses, as the document names it
        self._references = references  # the test set's target side, for paired bootstrap
        self._train_history = train_history
        self._model_dir = model_dir  # the bundled model, whose weights the results should be of

    @cached_property
    def bundled_weights(self) -> str | None:
        """model_sha256 of the bundled model now (None when no model directory is known)."""
        return None if self._model_dir is None else weights_fingerprint(self._model_dir)

    def sweep_weights(self, name: str) -> str | None:
        """model_sha256 that sweep ``name``'s full.json records (None: no full.json or not recorded)."""
        return (_json(self.dir / "prune" / name / "full.json") or {}).get("model_sha256")

    @cached_property
    def references(self) -> list[str] | None:
        if self._references is None or not self._references.is_file():
            return None
        from headlab.data.parallel import read_lines

        return [line.strip() for line in read_lines(self._references)]

    @cached_property
    def train_history(self) -> list[dict] | None:
        """The bundled model's train_history.json (epochs, updates, tokens per second)."""
        return None if self._train_history is None else _json(self._train_history)

    @cached_property
    def exported_epoch(self) -> int | None:
        """The epoch of the training run that the model's weights are (None when not recorded)."""
        from headlab.nmt.export import exported_epoch

        return None if self._model_dir is None else exported_epoch(self._model_dir)

    def hypotheses(self, name: str) -> list[str] | None:
        """Greedy test-set translations of ``full`` or ``<sweep>-<point>``; None when not made."""
        path = self.dir / "hypotheses" / f"{name}.txt"
        return path.read_text(encoding="utf-8").splitlines() if path.is_file() else None

    def importance(self, method: str) -> HeadScores | None:
        return _scores(self.dir / "importance" / f"{method}.json")

    @cached_property
    def agreement(self) -> dict | None:
        return _json(self.dir / "importance" / "agreement.json")

    def functions_scores(self, name: str, run: str = "functions") -> HeadScores | None:
        """A HeadScores file of a functions pass: ``functions`` (UD EWT dev), ``functions-parsed``
        (the parsed validation text) or ``functions-<pooling>`` (another word pooling)."""
        return _scores(self.dir / run / f"{name}.json")

    def functions_json(self, name: str, run: str = "functions"):
        """``table1``, ``summary`` (or ``parser`` of ``functions-parsed``) of a functions pass."""
        return _json(self.dir / run / f"{name}.json")

    def sweep(self, name: str) -> dict:
        """``{"full": full.json or None, "points": {point: {"result", "gates", "kept"}}, "stale": [point]}``.

        A point made from other weights than full.json records (``model_sha256``) is stale: it is
        listed under ``stale``, not under ``points``. Files that record no weights (older runs)
        are taken to belong together."""
        directory = self.dir / "prune" / name
        full = _json(directory / "full.json")
        weights = (full or {}).get("model_sha256")
        points, stale = {}, []
        if directory.is_dir():
            for point in sorted(directory.iterdir()):
                if (point / "result.json").is_file():
                    result = _json(point / "result.json")
                    if weights is not None and result.get("model_sha256") != weights:
                        stale.append(point.name)
                        continue
                    points[point.name] = {"result": result, "gates": _scores(point / "gates.json"),
                                          "kept": _json(point / "kept.json")}
        return {"full": full, "points": points, "stale": stale}

    @cached_property
    def baselines(self) -> list[dict]:
        """Baseline rows of the encoder sweep's weights (all rows when its full.json records none)."""
        return [{**row, "baseline": path.stem} for path in sorted((self.dir / "baselines").glob("*.json"))
                for row in _same_weights(_json(path) or [], self.sweep_weights("enc"))]

    @cached_property
    def scratch(self) -> list[dict]:
        """From-scratch rows of the all-kinds sweep's weights (all when its full.json records none)."""
        return _same_weights(_json(self.dir / "scratch.json") or [], self.sweep_weights("all"))

    @cached_property
    def scratch_enc(self) -> list[dict]:
        """From-scratch rows of encoder points' heads (decoder whole), of the encoder sweep's weights."""
        return _same_weights(_json(self.dir / "scratch-enc.json") or [], self.sweep_weights("enc"))

    @cached_property
    def specialisation(self) -> dict | None:
        return _json(self.dir / "specialisation.json")

    @cached_property
    def timings(self) -> dict:
        return _json(self.dir / "timings.json") or {}


def kept_mask(point: dict, kind: str, shape: tuple[int, int]) -> np.ndarray | None:
    """Boolean ``[n_layers, n_heads]``: the heads of ``kind`` a sweep point kept (from kept.json).

    A layer the record does not list lost no head."""
    record = point.get("kept")
    if record is None:
        return None
    mask = np.ones(shape, dtype=bool)
    for layer, block in record.get("blocks", {}).get(kind, {}).items():
        mask[int(layer)] = False
        mask[int(layer), block["kept_heads"]] = True
    return mask
