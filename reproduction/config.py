"""The reproduction's configuration: every model, data file, hyper-parameter, lambda and budget.

One JSON file (``experiments/reproduce.json``) holds everything the stages need, so that the
numbers in docs/reproduction.md follow from the file and the committed models and data alone.
Relative paths are relative to ``root``, itself relative to the config file's directory (default:
that directory; ``experiments/reproduce.json`` says ``".."``, the repository root).

Lists of command-line options (``prune.options``, ``baselines.options``) are JSON objects
``{"flag": value}`` turned into ``--flag value`` in their order (``true`` gives the bare flag);
they are passed unchanged to ``headlab prune sweep`` / ``headlab prune baseline``.
``prune.eval_split`` is the split every pruning point is scored on (the document's numbers);
``prune.dev_split`` the split of the sweeps' development curves (``--dev-src/--dev-tgt``), which
must be another one.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from headlab import HeadlabError
from headlab.heads import read_json

__all__ = ["ModelEntry", "ReproduceConfig", "load_config", "flags"]


def flags(options: dict) -> list[str]:
    """``{"max-tokens": 2048, "no-progress": true}`` -> ``["--max-tokens", "2048", "--no-progress"]``."""
    out: list[str] = []
    for name, value in options.items():
        if value is None or value is False:
            continue
        out.append(f"--{name}")
        if value is not True:
            out.append(",".join(str(v) for v in value) if isinstance(value, (list, tuple)) else str(value))
    return out


@dataclass
class ModelEntry:
    """One model of the reproduction and where its data and training checkpoints are."""

    name: str
    path: str
    src: str
    tgt: str
    checkpoints: str | None = None  # directory holding epoch-NNN checkpoint directories
    checkpoint_pattern: str = "epoch-*"
    tokenizer: str | None = None  # tokenizer of the checkpoints (they are saved without one)
    # Per-model overrides, for a model given less compute than the others:
    # {"enc": {"keeps": [...], "lams": [...]}, "all": {...}} replaces those entries of prune.<sweep>;
    # {"keeps": [...], "methods": ["random", ...]} narrows the baselines.
    prune: dict = field(default_factory=dict)
    baselines: dict = field(default_factory=dict)


@dataclass
class ReproduceConfig:
    """All settings of ``python -m reproduction`` (see ``experiments/reproduce.json`` for the values used)."""

    models: list[ModelEntry]
    data: dict[str, str]  # train / valid / test: path templates with {lang}
    work_dir: str = "runs/reproduce"
    results_dir: str = "docs/results/reproduction"
    doc: str = "docs/reproduction.md"
    img_dir: str = "docs/img"
    threads: int = 1
    importance: dict = field(default_factory=dict)
    functions: dict = field(default_factory=dict)
    parse: dict = field(default_factory=dict)  # {"model": spaCy UD pipeline, "split": text to parse}
    pooling: list = field(default_factory=list)  # other subword-to-word mappings for the functions pass
    prune: dict = field(default_factory=dict)
    baselines: dict = field(default_factory=dict)
    scratch: dict = field(default_factory=dict)
    specialisation: dict = field(default_factory=dict)
    claims: dict = field(default_factory=dict)
    root: str = "."
    source: str = ""

    # -- paths --------------------------------------------------------------------------
    def path(self, value: str | os.PathLike) -> Path:
        value = Path(value)
        return value if value.is_absolute() else Path(self.root) / value

    def rel(self, value: str | os.PathLike) -> str:
        """``value`` relative to the root when it lies under it (how the document prints paths).

        Checked on the path as written first, so that a work directory linked to another disk
        still prints as ``runs/...``, then with links resolved."""
        for path, root in ((os.path.abspath(value), os.path.abspath(self.root)),
                           (Path(value).resolve(), Path(self.root).resolve())):
            try:
                return str(Path(path).relative_to(root))
            except ValueError:
                continue
        return str(value)

    # -- which text each stage reads (one default for every reader) ----------------------------
    @property
    def parse_split(self) -> str:
        """The data split that functions-parsed parses: the models' own validation text by default."""
        return self.parse.get("split", "valid")

    @property
    def specialisation_split(self) -> str:
        return self.specialisation.get("split", "valid")

    def data_file(self, split: str, lang: str) -> Path:
        if split not in self.data:
            raise HeadlabError(f"{self.source}: data has no {split!r} entry (have {', '.join(self.data)})")
        return self.path(self.data[split].format(lang=lang))

    def work(self, model: ModelEntry, *parts: str) -> Path:
        return self.path(self.work_dir).joinpath(model.name, *parts)

    def results(self, model: ModelEntry | None = None, *parts: str) -> Path:
        base = self.path(self.results_dir)
        return base if model is None else base.joinpath(model.name, *parts)

    def model(self, name: str) -> ModelEntry:
        for entry in self.models:
            if entry.name == name:
                return entry
        raise HeadlabError(f"{self.source}: no model named {name!r} (have {', '.join(m.name for m in self.models)})")


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")
_TOP_KEYS = {"models", "data", "work_dir", "results_dir", "doc", "img_dir", "threads", "importance", "functions",
             "parse", "pooling", "prune", "baselines", "scratch", "specialisation", "claims", "root", "comment"}
_MODEL_KEYS = {"name", "path", "src", "tgt", "checkpoints", "checkpoint_pattern", "tokenizer", "comment", "prune", "baselines"}


def load_config(path: str | os.PathLike, root: str | os.PathLike | None = None) -> ReproduceConfig:
    """Read and check a reproduction config; errors name the file and the entry."""
    path = Path(path)
    raw = read_json(path, "config file")
    if not isinstance(raw, dict):
        raise HeadlabError(f"{path}: the config must be a JSON object")
    unknown = set(raw) - _TOP_KEYS
    if unknown:
        raise HeadlabError(f"{path}: unknown entries {', '.join(sorted(unknown))}")
    for key in ("models", "data"):
        if key not in raw:
            raise HeadlabError(f"{path}: missing {key!r}")
    models = []
    for i, entry in enumerate(raw["models"]):
        if not isinstance(entry, dict):
            raise HeadlabError(f"{path}: models[{i}] must be an object")
        missing = {"name", "path", "src", "tgt"} - set(entry)
        if missing:
            raise HeadlabError(f"{path}: models[{i}] lacks {', '.join(sorted(missing))}")
        extra = set(entry) - _MODEL_KEYS
        if extra:
            raise HeadlabError(f"{path}: models[{i}] has unknown entries {', '.join(sorted(extra))}")
        models.append(ModelEntry(**{k: v for k, v in entry.items() if k != "comment"}))
    for i, model in enumerate(models):
        # The name is a directory under work_dir and results_dir: "../x" or "a/b" would write elsewhere.
        if not isinstance(model.name, str) or not _NAME.fullmatch(model.name):
            raise HeadlabError(f"{path}: models[{i}].name {model.name!r}: not a plain name (letters, digits, '.', "
                               "'_', '-', '+'; no '/' and not '.' or '..'): it names the model's directories under "
                               "work_dir and results_dir")
    names = [m.name for m in models]
    if len(set(names)) != len(names):
        raise HeadlabError(f"{path}: repeated model names {names}")
    for split in ("train", "valid", "test"):
        if split not in raw["data"]:
            raise HeadlabError(f"{path}: data lacks {split!r} (a path template with {{lang}})")
    values = {k: v for k, v in raw.items() if k not in ("models", "comment")}
    configured = values.pop("root", ".")
    if root is None:
        root = (path.resolve().parent / configured).resolve()
    config = ReproduceConfig(models=models, root=str(root), source=str(path), **values)
    if not isinstance(config.threads, int) or config.threads < 1:
        raise HeadlabError(f"{path}: threads must be a positive integer")
    # The claims read the importance, functions and specialisation tables of a model side by side; the specialisation
    # stage loads the models itself, in float32: another dtype in one section would compare two precisions head by head.
    for section in ("importance", "functions"):
        dtype = getattr(config, section).get("dtype")
        if dtype not in (None, "float32"):
            raise HeadlabError(f"{path}: {section}.dtype {dtype!r}: the claims read the {section} tables beside the other "
                               "stages', measured in float32 (the specialisation stage loads the models in float32); "
                               "leave dtype out")
    dev, final = config.prune.get("dev_split"), config.prune.get("eval_split", "test")
    if dev is not None and (dev not in config.data or dev == final):
        raise HeadlabError(f"{path}: prune.dev_split must name a data split other than the evaluation's "
                           f"({final!r}); got {dev!r}")
    for sweep in ("enc", "all"):
        spec = config.prune.get(sweep)
        if spec is not None and not (spec.get("keeps") or spec.get("lams")):
            raise HeadlabError(f"{path}: prune.{sweep} needs keeps and/or lams")
    return config
