"""``headlab analyze``: every analysis of one model in one resumable run, into one directory.

The stages, in order (:data:`STAGES`), each a thin call into the package that owns the work. The
measures, statistics and their options, files and labels come from their declarations
(:mod:`headlab.plugins`); nothing here names one:

=============  ==========================================================================
<measure>      one stage per registered measure (:data:`headlab.importance.registry.MEASURES`:
               confidence, lrp, gradient; ablation, ``on_request``, only with ``--ablation``):
               :func:`headlab.importance.run_importance` -> importance/<table>.json
agreement      Spearman tables between the measures (:func:`headlab.importance.compute_agreement`)
functions      :func:`headlab.functions.analyze_heads`: the statistics of the ``functions`` pass
               (positional, syntactic, rare-token heads) -> functions/, labels.json
aggregate      the same for the ``aggregate`` pass (the Vig & Belinkov statistics) -> aggregate/
prune          only with ``--prune``: a short :func:`headlab.pruning.sweep.run_sweep` of head budgets
table          :func:`headlab.pipeline.table.write_heads_table`: heads.csv (+ heads.parquet), one row per head
attention      :func:`headlab.report.write_attention_examples` (attention of a few sentences)
figures        :func:`headlab.pipeline.figures.write_figures` (PNG + SVG, from the files above)
report         :func:`headlab.report.build_report` -> index.html
=============  ==========================================================================

Several processes (``--num-processes N`` or ``accelerate launch``, :mod:`headlab.shard`): the
importance measures, functions and aggregate split their batches over the processes and combine
them into the one-process results, to the bit; the main process decides which stages run
(markers, ``--skip``), holds the lock, writes every file and runs the other stages alone while
the rest wait. A stage that fails with an error that is not headlab's stops the run (the others
cannot go on without its share); the finished stages are kept and the same command resumes.

Resuming: a stage whose marker, inputs and outputs are all in place is reused (see
:mod:`headlab.pipeline.records`); ``force`` runs everything again. ``manifest.json`` vouches only
for stages a run finished (:mod:`headlab.report.vouched`): a run writes one listing no stage when
it starts (unless an earlier run's lists some), and a stage about to run drops its row and marker. A stage that cannot run
(missing input, a model without the capability) is recorded as skipped with the reason, a
stage that raises as failed with the error; the other stages still run.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
import traceback
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

from headlab._lazy import LiveNames as _Live
from headlab._version import __version__
from headlab.errors import HeadlabError, RunFailed, counted
from headlab.heads import DEFAULT_DTYPE
from headlab.importance.measure_options import confidence_engine
from headlab.importance.registry import MEASURES, REFERENCE
from headlab.lock import LOCK_FILE, DirectoryLock
from headlab.pipeline.records import MARKER_DIR, StageRecord, raw_marker, read_marker, remove_marker, write_manifest, write_marker
from headlab.plugins import OptionSpec, PluginOptions, check_values, option_specs, plugin_options
from headlab.report.vouched import ANALYZE, read_manifest, stage_rows
from headlab.resume import SkipStage, file_fingerprint, now_iso, set_aside, stage_key, weights_fingerprint
from headlab.shard import SINGLE, Shard, sharding

__all__ = ["AnalyzeConfig", "AnalysisRun", "STAGES", "STAGE_GROUPS", "SkipStage", "run_analysis",
           "check_conllu_matches_source"]


IMPORTANCE_STAGES = _Live(lambda: tuple(MEASURES))
STAGES = _Live(lambda: (*MEASURES, "agreement", "functions", "aggregate", "prune", "table", "attention", "figures",
                        "report"))
STAGE_GROUPS = {"importance": _Live(lambda: (*MEASURES, "agreement"))}
# Stages that own a directory of DIR: cleared before they run again with other inputs, or with force.
STAGE_DIRS = {"functions": "functions", "aggregate": "aggregate", "prune": "prune", "attention": "attention",
              "figures": "figures"}
KEY_FILE = ".headlab-key"
# What analyze writes directly under DIR (the stages' folders, the table, the manifest and the report).
WRITTEN_AT_TOP = ("index.html", "manifest.json", "heads.csv", "heads.parquet", "importance", *STAGE_DIRS.values())
# Stages whose batches are split over the processes of a sharded run; the others run in the main one.
SHARDED_STAGES = _Live(lambda: (*MEASURES, "functions", "aggregate"))
# How the functions stage counts token frequencies on --source, part of its key: 2 since a
# classifier's labelled TSV is counted by its text columns only (its labels were counted before).
SOURCE_COUNTING = 2


def _requests() -> list[OptionSpec]:
    """``--<measure>`` for each measure that runs only when asked (``on_request``: ``--ablation``)."""
    from dataclasses import make_dataclass

    specs = []
    for name, measure in MEASURES.items():
        if measure.on_request:
            flag = make_dataclass("Request", [(name, bool, field(default=False, metadata={
                "help": measure.on_request if isinstance(measure.on_request, str) else f"also run {name} (slow)",
                "signed": False}))])
            specs += option_specs(name, flag)
    return specs


@plugin_options
@dataclass
class AnalyzeConfig(PluginOptions):
    """Options of ``headlab analyze``; the command's flags map onto these fields one to one, and
    onto the measures' options (``lrp_targets``, ``--ablation``, ...: keywords kept in ``options``)."""

    model: str = field(metadata={"help": "model directory (or hub id in the cache)", "positional": True})
    source: str = field(metadata={
        "help": "source sentences (or the text of an encoder-/decoder-only model), one per line (plain or .gz)"})
    out: str = field(metadata={"help": "output directory"})
    target: str | None = field(default=None, metadata={"help": "reference translations, line-aligned with --source"})
    conllu: str | None = field(default=None, metadata={
        "help": "CoNLL-U treebank for the head functions and aggregate statistics (its own sentences are analysed)"})
    conllu_is_source: bool = field(default=False, metadata={
        "help": "the treebank is the parse of --source: sentence i must be line i (checked)"})
    train_text: tuple[str, ...] = field(default=(), metadata={
        "help": "training text for token frequencies (rare-token heads); default: --source"})
    prune: bool = field(default=False, metadata={"help": "also run a short gate sweep (needs a translation model and --target)"})
    force: bool = field(default=False, metadata={
        "help": "run every stage again, even if its results are in --out; also lets analyze write into a directory "
                "holding files it did not write"})
    skip: tuple[str, ...] = field(default=(), metadata={"help": "stages not to run"})
    limit: int | None = field(default=None, metadata={
        "help": "use the first N sentences of --source/--target (and of --conllu)", "range": "[1, inf)"})
    conllu_limit: int | None = field(default=None, metadata={
        "help": "use the first N sentences of --conllu (default: --limit)", "range": "[1, inf)"})
    threads: int | None = field(default=None, metadata={"help": "torch CPU threads", "range": "[1, inf)"})
    batch_size: int = field(default=32, metadata={"help": "sentences per batch", "range": "[1, inf)"})
    max_length: int | None = field(default=None, metadata={
        "help": "tokens per sentence (default: the model's maximum)", "range": "[2, inf)"})
    query_chunk: int | None = field(default=None, metadata={
        "help": "confidence, functions, aggregate: query rows per chunk of headlab's own attention function (memory "
                "linear in the length; default: 128); the attention viewer: read through that function N rows at a "
                "time (default: eager capture)", "metavar": "N", "range": "[1, inf)"})
    engine: str | None = field(default=None, metadata={
        "help": "confidence, functions and aggregate: where the maxima and statistics run (fused, the default; "
                "chunked or eager, the references; kernel, all three in the Triton kernel on a CUDA GPU; see "
                "headlab functions --engine). With --engine eager, --query-chunk chunks confidence alone. A "
                "resumed run computes these stages again where --engine changed",
                "choices": ("eager", "chunked", "fused", "kernel")})
    prune_source: str | None = field(default=None, metadata={"help": "training sources of the gate sweep (default: --source)"})
    prune_target: str | None = field(default=None, metadata={"help": "training targets of the gate sweep (default: --target)"})
    prune_limit: int | None = field(default=None, metadata={
        "help": "use the first N training pairs of the sweep", "range": "[1, inf)"})
    prune_keeps: tuple[int, ...] = field(default=(), metadata={
        "help": "head budgets of the sweep (default: 1/2, 1/4, 1/8 of the gated heads)"})
    prune_gates: str = field(default="enc_self", metadata={
        "help": "gated kinds: enc_self (decoder frozen), all, or a comma list"})
    prune_steps: int = field(default=20, metadata={"help": "fine-tuning steps per sweep point", "range": "[1, inf)"})
    prune_max_tokens: int = field(default=1024, metadata={"help": "target tokens per fine-tuning batch", "range": "[1, inf)"})
    prune_eval_beam: int = field(default=1, metadata={
        "help": "beam of the sweep's BLEU evaluation (1 = greedy)", "range": "[1, inf)"})
    prune_gate_lr: float = field(default=0.1, metadata={"help": "learning rate of the gates' log alpha (higher than "
                                                                 "prune train's 0.02: the sweep is short)", "range": "(0, inf)"})
    prune_init_log_alpha: float = field(default=1.0, metadata={"help": "initial log alpha of the gates (prune train: 3)"})
    attention_sentences: int = field(default=20, metadata={
        "help": "sentences stored for the attention viewer: the first of --conllu (with their gold arcs) when given, "
                "else of --source", "range": "[0, inf)"})
    progress: bool = field(default=True, metadata={"help": "progress bars"})
    trust_remote_code: bool = field(default=False, metadata={"help": "allow code from the model repository to run"})
    device: str | None = field(default=None, metadata={"help": "where the model runs: cpu, cuda or cuda:N"})
    dtype: str | None = field(default=None, metadata={"help": "the weights' dtype: float32, bfloat16 or float16"})
    device_map: str | None = field(default=None, metadata={"help": "auto: spread the model over the devices"})
    options: dict[str, object] = field(default_factory=dict, metadata={
        "help": "the measures' options by flag name (lrp_targets, ablation, ...)"})

    @classmethod
    def plugin_specs(cls) -> list[OptionSpec]:
        """The measures' and the statistics' options that analyze does not declare itself
        (``--query-chunk`` and ``--batch-size`` are its own, shared by the stages), and
        ``--<measure>`` of each measure that runs only when asked."""
        from dataclasses import fields

        from headlab.functions.registry import option_specs as statistic_options
        from headlab.importance.registry import option_specs as measure_options

        own = {f.name for f in fields(cls)}
        return [s for s in measure_options() + statistic_options() if s.dest not in own] + _requests()

    @property
    def placement(self) -> dict:
        """The keyword arguments of :func:`headlab.loading.load_model` that place the weights."""
        return {"device": self.device, "dtype": self.dtype, "device_map": self.device_map}

    @property
    def treebank_limit(self) -> int | None:
        return self.conllu_limit if self.conllu_limit is not None else self.limit


@dataclass
class AnalysisRun:
    out_dir: Path
    records: list[StageRecord]
    figures: list[dict]
    manifest: Path
    report: Path | None

    @property
    def failed(self) -> list[StageRecord]:
        return [r for r in self.records if r.status == "failed"]


# ----------------------------------------------------------------------------- input checks


def _normalise(text: str) -> str:
    return "".join(text.split())


def check_conllu_matches_source(conllu: str | Path, source: str | Path, limit: int | None = None) -> int:
    """Check that sentence i of the treebank is line i of ``source`` (whitespace ignored, so that
    ``ball.`` and ``ball .`` match); return the number of sentences. A mismatch is an error
    naming both places and both texts."""
    from headlab.data.parallel import read_lines
    from headlab.data.treebank import read_conllu

    lines = [line.strip() for line in read_lines(source)]
    lines = [line for line in lines if line]
    if limit is not None:
        lines = lines[:limit]
    n = 0
    for n, sentence in enumerate(read_conllu(conllu, limit=limit), start=1):
        assert sentence is not None  # None only with keep_place=True
        text = sentence.text if sentence.text else " ".join(sentence.words)
        if n > len(lines):
            raise HeadlabError(f"--conllu {conllu} has more sentences than --source {source} has lines "
                               f"({len(lines)}): sentence {n} at {sentence.where} has no source line")
        if _normalise(text) != _normalise(lines[n - 1]) and _normalise(" ".join(sentence.words)) != _normalise(lines[n - 1]):
            raise HeadlabError(
                f"--conllu {conllu} does not match --source {source}: sentence {n} ({sentence.where}) is "
                f"{text[:80]!r} but line {n} of the source is {lines[n - 1][:80]!r}. Without --conllu-is-source "
                "the treebank is analysed as a corpus of its own")
    if n < len(lines):
        raise HeadlabError(f"--conllu {conllu} has {counted(n, 'sentence')} but --source {source} has "
                           f"{counted(len(lines), 'non-empty line')}: with --conllu-is-source they must match one to one")
    return n


class _Refused(HeadlabError):
    """The user's input cannot be analysed, found once the model is loaded (exit 2): the run stops
    at the first stage that needs it instead of failing that stage and every later one."""


class _ModelNotLoadable(_Refused):
    """The model cannot be loaded (the user's input, exit 2)."""


def _foreign_files(out: Path) -> list[str]:
    """Files in ``out`` that a headlab run did not write: ``out`` is headlab's when it holds the
    stage markers (``.headlab/``) or a manifest that names a headlab version."""
    if not out.is_dir() or (out / ".headlab").is_dir():
        return []
    try:
        manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
        if isinstance(manifest, dict) and "headlab_version" in manifest:
            return []
    except (OSError, ValueError):
        pass
    return sorted(p.name for p in out.iterdir())


def validate(config: AnalyzeConfig) -> Path:
    """Every check that needs no model: paths, flags, the CoNLL-U/source contract."""
    from headlab import preflight
    from headlab.options import check_ranges

    check_ranges(config)  # also for a config built in Python (the command line checked its flags already)
    check_values(config.plugin_specs(), config.options)
    from headlab.functions.registry import check_options

    check_options(config.options)  # each statistic's own checks (an unknown --relations)
    check_treebank_options(config)
    for keep in config.prune_keeps:
        preflight.at_least(keep, 1, "--prune-keeps")
    # Its form, with or without --prune: the sweep's options are in its stage key, so a run without
    # --prune keeps an earlier sweep made with the same ones and sets aside another's (docs/analyze.md);
    # a malformed --prune-gates (",") would have set it aside.
    from headlab.pruning.train import named_kinds

    try:
        named_kinds(config.prune_gates)
    except HeadlabError as error:
        raise HeadlabError(str(error).replace("--gates", "--prune-gates", 1)) from None
    out = preflight.output_dir(config.out)
    from headlab.outdir import other_commands_results

    if other := other_commands_results(out, "analyze", "--force"):  # its .headlab/ would pass it for analyze's own
        raise HeadlabError(other)
    foreign = _foreign_files(out)
    # --force writes beside the user's files, never over them: a stage clears its own folder first.
    clash = [name for name in foreign if name in WRITTEN_AT_TOP]
    if foreign and not config.force:
        shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        # --force is suggested only where it would be taken (docs/cli.md), not over the user's index.html
        way = (f"or move {', '.join(clash)} away: --force writes beside files headlab did not write, not over them"
               if clash else "or pass --force to write into it anyway")
        raise HeadlabError(f"--out {out}: the directory holds files headlab did not write ({shown}); analyze would "
                           f"write index.html, manifest.json and its folders among them. Choose a new or empty "
                           f"directory, {way}")
    if clash:
        raise HeadlabError(f"--out {out}: holds {', '.join(clash)} of your own, which analyze would replace; "
                           "--force writes beside files headlab did not write, not over them. Move them away or "
                           "choose another directory")
    preflight.model_dir(config.model)
    from headlab.loading import check_supported, check_tokenizer_fits, load_config, load_tokenizer

    try:  # an unreadable model or a tokenizer that does not fit it fails here, not in every stage
        model_config = load_config(config.model, config.trust_remote_code)
    except (OSError, ValueError) as error:
        raise HeadlabError(f"model {config.model}: {error}") from error
    # A family headlab cannot analyse (or, with --prune, physically prune): refused once, here.
    check_supported(config.model, config.trust_remote_code, prune=config.prune)
    # A model directory without a tokenizer, or one whose special ids the model lacks: refused here.
    check_tokenizer_fits(load_tokenizer(config.model, config.trust_remote_code), model_config, config.model)
    for flag, path in (("--source", config.source), ("--target", config.target), ("--conllu", config.conllu),
                       ("--prune-source", config.prune_source), ("--prune-target", config.prune_target),
                       *(("--train-text", path) for path in config.train_text)):
        if path is not None:
            preflight.input_file(path, flag)
    if config.conllu is not None:
        from headlab.data.treebank import check_has_sentence

        check_has_sentence(config.conllu, "--conllu")
    from headlab.device_options import device_options

    device_options(config)  # a missing CUDA device fails here
    if config.engine == "kernel":  # refused as functions --engine kernel refuses it, before the first stage runs
        import torch

        from headlab.functions.analysis import check_kernel

        gpu = config.device_map is not None and torch.cuda.is_available()  # auto: the first block on a GPU
        check_kernel(torch.device("cuda" if gpu else config.device or "cpu"))
    if (config.prune_source is None) != (config.prune_target is None):
        raise HeadlabError("give both --prune-source and --prune-target, or neither")
    known = set(STAGES) | set(STAGE_GROUPS)
    for name in config.skip:
        if name not in known:
            raise HeadlabError(f"--skip {name}: unknown stage; expected one of {', '.join(STAGES)} or importance")
    # The sentences every stage reads, read through once here: a line that is not UTF-8 is exit 2
    # now, not a failed stage (exit 1, an empty report) after the others ran.
    n_source = len(_read_checked(config.source, "--source"))
    for flag, path in (("--prune-source", config.prune_source), ("--prune-target", config.prune_target)):
        if path is not None and config.prune:
            _read_checked(path, flag)
    if config.target is not None:
        n_target = len(_read_checked(config.target, "--target"))
        if n_source != n_target:
            raise HeadlabError(f"--source {config.source} has {counted(n_source, 'line')} but --target {config.target} has "
                               f"{n_target}: they must match line for line")
    if config.prune and "prune" not in _skipped_by_flag(config) and config.target is not None \
            and getattr(model_config, "is_encoder_decoder", False):
        _check_sweep(config)
    check_options_fit_model(config, model_config)
    if config.conllu_is_source:
        if config.conllu is None:
            raise HeadlabError("--conllu-is-source needs --conllu FILE")
        check_conllu_matches_source(config.conllu, config.source, config.limit)
    return out


def check_treebank_options(config: AnalyzeConfig) -> None:
    """The options that act on the treebank alone, given without ``--conllu``: the functions and
    aggregate stages are skipped then and no stage reads them (nor a stage's key, so no earlier
    result is kept by them, as the sweep's options keep an earlier sweep), so the run went on as if
    they had not been given."""
    if config.conllu is not None:
        return
    from headlab.functions.registry import option_specs as statistic_options

    given = (["--conllu-limit"] if config.conllu_limit is not None else []) + (
        ["--train-text"] if config.train_text else [])
    own = {f.name for f in fields(config)}
    treebank_only = {s.dest for s in statistic_options()} - own  # --window, --relations, ... (not --batch-size)
    given += list(dict.fromkeys(f"--{s.dest.replace('_', '-')}" for s in config.plugin_specs()
                                if s.dest in treebank_only and config.options.get(s.dest, s.default) != s.default))
    if given:
        these = "this option acts" if len(given) == 1 else "these options act"
        raise HeadlabError(f"{', '.join(given)}: {these} on the treebank of the head functions and aggregate "
                           f"statistics, and no --conllu was given: give --conllu FILE, or leave "
                           f"{'it' if len(given) == 1 else 'them'} out")


def check_options_fit_model(config: AnalyzeConfig, model_config: Any) -> None:
    """Options for another kind of model (read from its config, no weights): the stages refused
    them themselves, after the stages before them had run (exit 1, perhaps hours later), or
    ignored them (``--beam`` of a model that does not translate)."""
    from headlab.checkpoint import model_class_for
    from headlab.importance.config import check_ablation_metric, check_beam

    classifier = model_class_for(model_config, f"{config.model}/config.json").__name__.endswith("ForSequenceClassification")
    translates = bool(getattr(model_config, "is_encoder_decoder", False)) and not classifier
    kind = "a sequence classifier" if classifier else "a translation model" if translates else (
        f"a {model_config.model_type} model that does not translate")
    ablation = not not_requested("ablation", config) and "ablation" not in _skipped_by_flag(config)
    if config.target is not None and not translates:
        raise HeadlabError(f"--target: reference translations are for translation (encoder-decoder) models, and "
                           f"{config.model} is {kind}; leave --target out")
    check_beam(config.beam, translates=translates, classifier=classifier, arch=model_config.model_type,
               model=str(config.model), option="--beam")
    if ablation:
        check_ablation_metric(str(config.metric), translates=translates, classifier=classifier,
                              has_target=config.target is not None, arch=model_config.model_type,
                              model=str(config.model))


def _read_checked(path: str, flag: str) -> list[str]:
    from headlab.data.parallel import read_lines

    try:
        return read_lines(path)
    except HeadlabError as error:
        raise HeadlabError(f"{flag} {error}") from None


def _check_sweep(config: AnalyzeConfig) -> None:
    """--prune-gates and --prune-keeps against the model's heads (its structure, no weights read),
    so that a gate sweep that would fail does not leave an hour of other stages behind a failure."""
    from headlab.adapters import attention_blocks
    from headlab.loading import build_from_config
    from headlab.pruning.hard_concrete import gate_count
    from headlab.pruning.train import resolve_kinds
    from headlab.surgery import check_gates_free

    if (Path(config.model) / "headlab_pruning.json").is_file():
        return  # a pruned model: its head counts are in its weights, checked when the stage loads them
    structure = build_from_config(config.model, config.trust_remote_code)
    try:
        kinds = resolve_kinds(structure, config.prune_gates)
    except HeadlabError as error:
        raise HeadlabError(str(error).replace("--gates", "--prune-gates", 1)) from None
    check_gates_free(attention_blocks(structure), kinds)
    n_gated = gate_count(structure, kinds)  # as gates.for_model: a head of weights shared by several depths once
    if any(keep > n_gated for keep in config.prune_keeps):
        raise HeadlabError(f"--prune-keeps {','.join(map(str, config.prune_keeps))}: each budget must be between 1 "
                           f"and the {counted(n_gated, 'gated head')} ({', '.join(kinds)})")


def check_processes(config: AnalyzeConfig, processes: int) -> None:
    """What a run in several processes cannot do: the gate sweep trains with processes of its own."""
    if processes > 1 and config.prune:
        raise HeadlabError("--prune trains in processes of its own: run analyze --prune in one process, "
                           "or `headlab prune sweep` under accelerate launch")


# ----------------------------------------------------------------------------- the run's state


class _Context:
    """Lazily loaded model, tokenizer and data, shared by the stages of one run."""

    _model: Any  # None until loaded; typed loosely so that this module does not import torch's types
    _tokenizer: Any
    _info: Any
    _data: Any

    def __init__(self, config: AnalyzeConfig, out_dir: Path, log: Callable[[str], None],
                 shard: Shard = SINGLE) -> None:
        self.config, self.out_dir, self.log, self.shard = config, out_dir, log, shard
        self._model = self._tokenizer = self._info = self._data = None
        self.records: dict[str, StageRecord] = {}
        self.markers: dict[str, dict] = {}
        self.figures: list[dict] = []
        self.created: list[Path] = []  # stage directories this run made
        self.replaced: dict[Path, Path] = {}  # a stage directory cleared for this run: where its files wait
        # A skipped stage's earlier results set aside in stale/ (where each was, where it went) and
        # their markers removed (path -> bytes), stale/ itself if this run made it: put back if refused.
        self.set_aside: list[tuple[Path, Path]] = []
        self.removed_markers: dict[Path, bytes] = {}
        self.unvouched: dict[str, dict] = {}  # the markers _unvouch removed (for _discard)
        self.made_stale: Path | None = None
        # An earlier run's outputs that a stage not done this time removes (where each was, where it
        # waits in .headlab/held/): put back if a later stage refuses the run, to stale/ when it ends.
        self.held: list[tuple[Path, Path]] = []
        self._fingerprints: dict[str, str | None] = {}

    # -- model and data -------------------------------------------------------------------
    def load(self):
        if self._model is None:
            from headlab.loading import load_model, load_tokenizer

            self.log(f"loading {self.config.model}")
            from headlab.shard import rank_device

            placement = {**self.config.placement, "device": rank_device(self.config.device, self.shard)}
            try:
                self._model = load_model(self.config.model, trust_remote_code=self.config.trust_remote_code,
                                         **placement)
            except RunFailed:
                raise
            except HeadlabError as error:  # the user's model (weights missing a layer ...): no stage can run
                raise _ModelNotLoadable(str(error)) from None
            from headlab.adapters import attention_blocks

            if not any(b.n_heads > 0 for b in attention_blocks(self._model)):  # as `headlab importance` refuses it
                raise _ModelNotLoadable(f"{self.config.model}: every attention head of the model was pruned; there "
                                        "is no head to analyse")
            self._tokenizer = load_tokenizer(self.config.model, trust_remote_code=self.config.trust_remote_code)
        return self._model, self._tokenizer

    @property
    def info(self):
        if self._info is None:
            from headlab.model_description import model_info

            model, tokenizer = self.load()
            self._info = model_info(model, tokenizer, max_length=self.config.max_length, log=self.log)
        return self._info

    def importance_data(self):
        if self._data is None:
            from headlab.data.inputs import read_data

            _, tokenizer = self.load()
            data = read_data(self.config.source, tokenizer, self.info, target_path=self.config.target,
                             n_sentences=self.config.limit)
            self.log(data.summary())
            self._check_next_tokens(data)
            self._check_block_sparse(data)
            self._check_padded_targets()
            self._data = data
        return self._data

    def _check_next_tokens(self, data) -> None:
        """A language model's loss (gradient, ablation) is on predicting each sentence's next token:
        a one-token sentence has none and is skipped and counted (``n_scored_sentences``), but
        where every sentence is one token (``--limit 1`` on a one-word line) gradient failed after
        the stages before it had run (exit 1). Refused here, before the first stage's work."""
        if self.info.arch != "causal" or not self.info.has_lm_head or any(len(ids) > 1 for ids in data.sources):
            return
        c = self.config
        loss = [name for name, measure in MEASURES.items() if measure.uses_loss and not not_requested(name, c)
                and name not in _skipped_by_flag(c)]
        if not loss:
            return
        from headlab.data.parallel import first_sentences, read_lines

        lines = read_lines(c.source)
        numbers = [n for n, line in enumerate(lines[: first_sentences(lines, c.limit)], start=1) if line.strip()]
        shown = ", ".join(map(str, numbers[:5])) + (", ..." if len(numbers) > 5 else "")
        where = f"line {shown} is one token" if len(numbers) == 1 else f"lines {shown} are one token each"
        raise _Refused(f"--source {c.source}: {where}, and {_and(loss)} {'scores' if len(loss) == 1 else 'score'} "
                       "a language model by its loss of predicting each next token, which a one-token sentence does "
                       f"not have: give sentences of two tokens or more{'' if c.limit is None else ' (or a larger --limit)'}"
                       f", or --skip {' '.join(loss)}")

    def _check_padded_targets(self) -> None:
        """ProphetNet's decoder refuses a padded target batch before it runs (headlab.adapters.prophetnet: its
        predicting streams compute a padded row apart from the row alone), which the importance stages build from
        every batch of several sentences: refused here, before the first stage's work, naming the option."""
        from headlab.adapters.prophetnet import batch_size_problem

        model_type = getattr(getattr(self.load()[0], "config", None), "model_type", None)
        if problem := batch_size_problem(model_type, self.config.batch_size):
            raise _Refused(problem)

    def _check_block_sparse(self, data) -> None:
        """Block-sparse BigBird refuses, before its forward, every sentence of at most (5 + 2 x num_random_blocks) x
        block_size tokens (headlab.adapters.big_bird: on those transformers would switch its attention to full
        attention for good), whatever its batch: the stages failed one after another on the first short sentence.
        Refused here, before the first stage's work, naming the lines."""
        from headlab.adapters.big_bird import block_sparse_layout

        layout = block_sparse_layout(self.load()[0])
        if layout is None:
            return
        short = [i for i, ids in enumerate(data.sources) if len(ids) <= layout[1]]
        if not short:
            return
        from headlab.data.parallel import first_sentences, read_lines

        c = self.config
        lines = read_lines(c.source)
        numbers = [n for n, line in enumerate(lines[: first_sentences(lines, c.limit)], start=1) if line.strip()]
        named = [numbers[i] for i in short] if len(numbers) == len(data.sources) else [i + 1 for i in short]
        shown = ", ".join(map(str, named[:5])) + (", ..." if len(named) > 5 else "")
        where = "line" if len(numbers) == len(data.sources) else "sentence"
        raise _Refused(f"--source {c.source}: {where}{'s' if len(named) > 1 else ''} {shown} "
                       f"{'has' if len(named) == 1 else 'have'} at most {layout[1]} tokens, on which this block-sparse "
                       "BigBird would run full attention (transformers switches its attention modules to full "
                       f"attention for good on inputs of at most (5 + 2 x num_random_blocks) x block_size = {layout[1]} "
                       "tokens): give sentences longer than that, or load the model with "
                       "attention_type='original_full' (full attention, which headlab analyses on any input)")

    def keep_data(self, data) -> None:
        """Keep the data with the model's translations made by one measure for the next ones."""
        self._data = data

    # -- keys -----------------------------------------------------------------------------
    def fingerprint(self, path: str | None) -> str | None:
        if path is None:
            return None
        if path not in self._fingerprints:
            local = Path(path)
            self._fingerprints[path] = file_fingerprint(local) if local.exists() else f"hub:{path}"
        return self._fingerprints[path]

    def key(self, name: str) -> str:
        c = self.config
        common: dict[str, Any] = {"stage": name, "version": __version__, "model": self.fingerprint(c.model)}
        if c.dtype is not None:  # other weights, other numbers (the device only moves them)
            common["dtype"] = c.dtype
        text = {"source": self.fingerprint(c.source), "target": self.fingerprint(c.target), "limit": c.limit,
                "max_length": c.max_length}
        if name in IMPORTANCE_STAGES:
            payload = {**common, **text, "batch_size": c.batch_size}
            # The measure's options that change its numbers, where not their defaults (a default
            # leaves the key as it was before the option existed).
            own = {s.dest for s in c.plugin_specs()}
            payload.update({s.dest: getattr(c, s.dest) for s in MEASURES[name].option_specs()
                            if s.signed and s.dest in own and getattr(c, s.dest) != s.default})
            if c.beam != 1:  # every measure scores the model's translations of a beam (without --target)
                payload["beam"] = c.beam
            # The engine the measure runs on, where it has one and --engine gives it another than the
            # default: a changed engine computes the scores again rather than reusing another engine's.
            engine = confidence_engine(c.engine, c.query_chunk)
            if engine is not None and any(s.dest == "engine" for s in MEASURES[name].option_specs()):
                payload["engine"] = engine
        elif name in ("functions", "aggregate"):
            payload = {**common, "conllu": self.fingerprint(c.conllu), "limit": c.treebank_limit,
                       "max_length": c.max_length, "batch_size": c.batch_size}
            if c.engine is not None:  # as summary.json records it: another engine runs the pass again
                payload["engine"] = c.engine
            if c.dtype not in (None, DEFAULT_DTYPE):  # the tables say it since session 34: an earlier run's did not
                payload["dtype_recorded"] = True
            own = {s.dest for s in c.plugin_specs()}  # the pass's statistics' options, where not their defaults
            payload.update({s.dest: getattr(c, s.dest) for statistic in _statistics(name).values()
                            for s in statistic.option_specs()
                            if s.signed and s.dest in own and getattr(c, s.dest) != s.default})
            if any("frequencies" in s.needs for s in _statistics(name).values()):
                payload["frequencies"] = [self.fingerprint(p) for p in (c.train_text or (c.source,))]
                if not c.train_text:
                    payload["source_counting"] = SOURCE_COUNTING
        elif name == "prune":
            payload = {**common, **text, "prune_source": self.fingerprint(c.prune_source),
                       "prune_target": self.fingerprint(c.prune_target), "prune_limit": c.prune_limit,
                       "keeps": list(c.prune_keeps), "gates": c.prune_gates, "steps": c.prune_steps,
                       "max_tokens": c.prune_max_tokens, "beam": c.prune_eval_beam, "gate_lr": c.prune_gate_lr,
                       "init_log_alpha": c.prune_init_log_alpha}
        elif name == "attention":
            payload = {**common, **text, "sentences": c.attention_sentences}
            if c.conllu is not None:  # the treebank's sentences are shown (the key without --conllu is as it was)
                payload.update(conllu=self.fingerprint(c.conllu), conllu_limit=c.treebank_limit,
                               conllu_is_source=c.conllu_is_source)
        else:  # agreement, figures, report: what the stages before them produced
            upstream = {"agreement": IMPORTANCE_STAGES}.get(name, STAGES[: STAGES.index(name)])
            payload = {"stage": name, "version": __version__,
                       # each upstream stage's key, finishing time and marker id: a stage run again within
                       # the same second (same inputs or other ones) changes its id, not its time
                       "upstream": {u: _upstream_version(m) if (m := self.markers.get(u)) else None
                                    for u in upstream}}
            if name == "table":  # the table's own format: a resumed run rebuilds an older heads.csv
                from headlab.pipeline.table import TABLE_FORMAT

                payload["format"] = TABLE_FORMAT
        return stage_key(payload)

    def rel(self, paths) -> list[str]:
        """Paths (absolute or relative to the working directory) as paths relative to DIR."""
        root = self.out_dir.resolve()
        return sorted({Path(p).resolve().relative_to(root).as_posix() for p in paths})


def _upstream_version(marker: dict) -> list:
    """What a later stage's key holds of a stage it reads: key, finishing time and marker id
    (a marker written before the id existed: key and time, so the keys on it stay as they were)."""
    return [marker.get("key"), marker.get("finished"), *([marker["marker_id"]] if "marker_id" in marker else [])]


# ----------------------------------------------------------------------------- the stages


def _importance(name: str):
    def run(ctx: _Context) -> tuple[list, str | None]:
        from headlab.importance.pipeline import ImportanceConfig, run_importance

        c = ctx.config
        model, tokenizer = ctx.load()
        info = ctx.info
        if MEASURES[name].needs_lm_head and not info.has_lm_head:
            raise SkipStage(f"the model has no language-model head: {name} needs logits to explain or a loss "
                            "to differentiate")
        data = ctx.importance_data()
        values = c.option_values()
        beam: Any = c.beam  # a measure's option (ablation declares --beam), an int
        config = ImportanceConfig(methods=(name,), batch_size=c.batch_size, beam=beam, progress=c.progress, options={
            **{s.dest: values[s.dest] for s in ImportanceConfig.plugin_specs() if s.dest in values},
            # --engine eager with --query-chunk: the functions' and aggregate's engine; confidence is chunked
            "query_chunk": c.query_chunk, "engine": confidence_engine(c.engine, c.query_chunk)})
        result = run_importance(model, data, info, config, tokenizer=tokenizer, log=ctx.log)
        ctx.keep_data(result.data)
        if name in result.skipped:
            raise SkipStage(result.skipped[name])
        if not ctx.shard.main:
            return [], None
        directory = ctx.out_dir / "importance"
        written = [table.save(directory / f"{method}.json") for method, table in result.scores.items()]
        note = None
        if info.is_seq2seq and data.references is None and MEASURES[name].uses_loss:
            note = ("no --target: the loss is taken against the model's own "
                    + ("greedy translation" if c.beam == 1 else f"translation (beam {c.beam})"))
        return written, note

    return run


def _agreement(ctx: _Context) -> tuple[list, str | None]:
    from headlab.heads import HeadScores

    directory = ctx.out_dir / "importance"
    measures = {m: HeadScores.load(directory / f"{m}.json") for m in IMPORTANCE_STAGES
                if ctx.records.get(m) is not None and ctx.records[m].status == "done"}
    if len(measures) < 2:
        raise SkipStage("needs at least two importance measures (have: " + (", ".join(measures) or "none") + ")")
    return write_agreement(measures, directory), None


def write_agreement(measures: dict, directory: Path) -> list[Path]:
    """``agreement.json`` and ``agreement.md`` in ``directory``: Spearman tables between the
    measures (``{name: HeadScores}``, in :data:`STAGES` order), and against ablation when it ran."""
    import math

    from headlab.heads import atomic_write_text, write_json
    from headlab.importance.agreement import compute_agreement

    names = list(measures)
    tables = {ref: compute_agreement(measures, measures[ref]) for ref in names}
    columns = tables[names[0]].columns
    clean = lambda v: None if v is None or math.isnan(v) else round(float(v), 6)  # noqa: E731
    matrix = {col: [[clean(tables[ref].rho[m].get(col, math.nan)) for ref in names] for m in names] for col in columns}
    document = {
        "measures": names,
        "columns": columns,
        "n_heads": dict(tables[names[0]].n_heads),
        "matrix": matrix,
        "reference": REFERENCE if REFERENCE in measures else None,
        "metric": tables[REFERENCE].metric if REFERENCE in measures else "",
        "spearman": {},
    }
    lines = ["Spearman rank correlation between the importance measures, over all heads", "",
             "| measure | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for i, m in enumerate(names):
        cells = ["n/a" if v is None else f"{v:+.2f}" for v in matrix["all"][i]]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    if REFERENCE in measures:
        table = compute_agreement({m: s for m, s in measures.items() if m != REFERENCE}, measures[REFERENCE])
        document["spearman"] = table.to_json()["spearman"]
        lines += ["", f"Against {REFERENCE} ({table.metric}), per attention kind:", "", table.to_markdown().rstrip()]
    json_path, md_path = directory / "agreement.json", directory / "agreement.md"
    write_json(json_path, document)
    atomic_write_text(md_path, "\n".join(lines) + "\n")
    return [json_path, md_path]


def _statistics(stage: str) -> dict:
    """The statistics that the pass ``stage`` (``functions`` or ``aggregate``) feeds, by name."""
    from headlab.functions.registry import STATISTICS

    return {name: s for name, s in STATISTICS.items() if s.stage == stage}


def _and(items: list[str]) -> str:
    return ", ".join(items[:-1]) + (" and " if len(items) > 1 else "") + items[-1] if items else "nothing"


def _head_analysis(ctx: _Context, stage: str):
    from headlab.functions.analysis import AnalysisConfig, analyze_heads
    from headlab.heads import shown_model_name

    c = ctx.config
    statistics = _statistics(stage)
    if c.conllu is None:
        what = _and([s.title for s in statistics.values() if s.title])
        raise SkipStage(f"no --conllu: {what} are computed on a parsed treebank (CoNLL-U)")
    model, tokenizer = ctx.load()
    frequencies, note = None, None
    needing = [s.title or name for name, s in statistics.items() if "frequencies" in s.needs]
    if needing:
        from headlab.data.frequencies import TokenFrequencies
        from headlab.data.inputs import labelled_texts
        from headlab.model_description import is_classifier

        if c.train_text:
            frequencies = TokenFrequencies.from_corpus(tokenizer, list(c.train_text))
        elif is_classifier(model):  # --source is a labelled TSV: count its text columns, not the labels
            frequencies = TokenFrequencies.from_texts(tokenizer, labelled_texts(c.source), str(c.source))
        else:
            frequencies = TokenFrequencies.from_corpus(tokenizer, [c.source])
        if not c.train_text:
            note = f"token frequencies for {_and(needing)} counted on --source (pass --train-text for the training corpus)"
    config = AnalysisConfig(functions=stage == "functions", aggregate=stage == "aggregate", batch_size=c.batch_size,
                            max_sentences=c.treebank_limit, max_length=c.max_length, engine=c.engine,
                            # --query-chunk also chunks confidence: under --engine eager it is that stage's alone
                            query_chunk=None if c.engine == "eager" else c.query_chunk,
                            options={s.dest: getattr(c, s.dest) for statistic in statistics.values()
                                     for s in statistic.option_specs()})
    analysis = analyze_heads(model, tokenizer, c.conllu, frequencies=frequencies, config=config,
                             model_name=shown_model_name(c.model), progress=c.progress)
    if analysis.report.n_sentences == 0:
        raise HeadlabError(f"--conllu {c.conllu}: no sentence could be analysed\n{analysis.report.describe()}")
    return analysis, note


def _functions(ctx: _Context) -> tuple[list, str | None]:
    analysis, note = _head_analysis(ctx, "functions")
    if not ctx.shard.main:
        return [], None
    written = write_functions(analysis, ctx.out_dir / "functions")
    ctx.log(analysis.report.describe())
    return written, note


def write_functions(analysis, directory: Path) -> list[Path]:
    """The functions stage's files of a :class:`~headlab.functions.HeadAnalysis`, with labels.json."""
    from headlab.pipeline.labels import head_labels, save_labels

    written = analysis.save(directory, figures=False)
    written.append(save_labels(head_labels(analysis), directory / "labels.json"))
    return written


def _aggregate(ctx: _Context) -> tuple[list, str | None]:
    analysis, note = _head_analysis(ctx, "aggregate")
    if not ctx.shard.main:
        return [], None
    return write_pass(analysis, ctx.out_dir), note


def write_pass(analysis, out_dir: Path) -> list[Path]:
    """The aggregate stage's files: every result of the pass in its own folder of ``out_dir``
    (``result.write``), and, for a result that has one, its ``summary_markdown()`` as
    ``summary.md`` in that folder."""
    import os

    from headlab.heads import atomic_write_text

    written = []
    for result in analysis.results.values():
        paths = result.write(out_dir)
        if hasattr(result, "summary_markdown") and paths:
            path = Path(os.path.commonpath(paths)) / "summary.md"
            atomic_write_text(path, result.summary_markdown() + "\n")
            paths.append(path)
        written += paths
    return written


def write_aggregate(result, directory: Path) -> list[Path]:
    """The aggregate stage's files of an :class:`~headlab.aggregate.AggregateResult`, with summary.md."""
    from headlab.heads import atomic_write_text

    written = result.save(directory)
    path = directory / "summary.md"
    atomic_write_text(path, result.summary_markdown() + "\n")
    written.append(path)
    return written


def default_keeps(n_gated: int) -> list[int]:
    """Half, a quarter and an eighth of the gated heads (at least one, no repeats)."""
    return sorted({max(1, n_gated // d) for d in (2, 4, 8)}, reverse=True)


def _prune(ctx: _Context) -> tuple[list, str | None]:
    c = ctx.config
    model, tokenizer = ctx.load()
    if not ctx.info.is_seq2seq:
        raise SkipStage("the gate sweep of analyze scores BLEU and needs a translation (encoder-decoder) model; "
                        "for language models use `headlab prune sweep --train-text`")
    if c.target is None:
        raise SkipStage("no --target: the gate sweep needs reference translations to train on and to score BLEU")
    from headlab.data.parallel import read_parallel
    from headlab.loading import load_model, load_tokenizer
    from headlab.pruning.hard_concrete import gate_count
    from headlab.pruning.sweep import run_sweep, sweep_points
    from headlab.pruning.train import PruneConfig, resolve_kinds
    from headlab.training.config import TrainConfig

    kinds = resolve_kinds(model, c.prune_gates)
    n_gated = gate_count(model, kinds)  # as gates.for_model: a head of weights shared by several depths once
    keeps = list(c.prune_keeps) or default_keeps(n_gated)
    if any(k < 1 or k > n_gated for k in keeps):
        raise HeadlabError(f"--prune-keeps {keeps}: each budget must be between 1 and the {counted(n_gated, 'gated head')}")
    eval_data = read_parallel(c.source, c.target)
    if c.limit:
        eval_data = eval_data.subset(c.limit)
    train_data = read_parallel(c.prune_source or c.source, c.prune_target or c.target, max_tokens=100)
    if c.prune_limit:
        train_data = train_data.subset(c.prune_limit)
    directory = ctx.out_dir / "prune"
    base = PruneConfig(
        gates=c.prune_gates, lam=0.0, eval_beam=c.prune_eval_beam, log_every=max(1, c.prune_steps // 10),
        gate_lr=c.prune_gate_lr, init_log_alpha=c.prune_init_log_alpha,
        command="headlab analyze (short gate sweep)", model_fingerprint=weights_fingerprint(c.model) or "",
        train=TrainConfig(out_dir=str(directory), max_tokens=c.prune_max_tokens, lr=1e-4, warmup_steps=0,
                          schedule="constant", max_epochs=10**6, max_steps=c.prune_steps, save_every_steps=None,
                          validate=False, keep_epoch_checkpoints=False, seed=1, progress=c.progress))
    # The sweep trains with Accelerate, which places the model itself: only the dtype carries over.
    load = lambda: (load_model(c.model, trust_remote_code=c.trust_remote_code, dtype=c.dtype),  # noqa: E731
                    load_tokenizer(c.model, trust_remote_code=c.trust_remote_code))
    rows = run_sweep(load, train_data, eval_data, base, sweep_points(keeps=keeps), directory, log=ctx.log)
    written = [directory / n for n in ("sweep.json", "sweep.csv", "sweep.md", "full.json")]
    for row in rows:
        if row["point"] == "full":
            continue
        point = directory / row["point"]
        shutil.rmtree(point / "train", ignore_errors=True)  # resume checkpoints: not needed once finished
        written += [p for p in (point / "result.json", point / "trajectory.jsonl", point / "gates.json",
                                point / "pruned") if p.exists()]
    note = (f"{counted(len(keeps), 'head budget')} of the {counted(n_gated, '/'.join(kinds) + ' head')}, "
            f"{counted(c.prune_steps, 'step')} of "
            f"{c.prune_max_tokens} target tokens each; BLEU with beam {c.prune_eval_beam} on "
            f"{counted(len(eval_data), 'pair')} of --source/--target")
    if c.prune_source is None:
        note += "; fine-tuned on the same pairs (give --prune-source/--prune-target for separate training data)"
    return written, note


def _table(ctx: _Context) -> tuple[list, str | None]:
    from headlab.pipeline.table import write_heads_table

    written = write_heads_table(ctx.out_dir, ctx.config.model)
    if not written:
        raise SkipStage("no head was scored by any stage")
    return written, None if len(written) > 1 else "heads.csv only (install pyarrow for heads.parquet)"


def _attention(ctx: _Context) -> tuple[list, str | None]:
    from headlab.data.parallel import read_lines
    from headlab.report import write_attention_examples

    c = ctx.config
    model, tokenizer = ctx.load()
    if c.conllu is not None:  # the treebank's sentences, with their gold arcs for the viewer
        from headlab.report.examples import write_treebank_examples

        paired = None
        if c.conllu_is_source and c.target and ctx.info.is_seq2seq:
            # sentence i is the i-th non-empty line of --source (checked): that line's --target is its reference
            lines, references = read_lines(c.source), read_lines(c.target)
            paired = [references[i].strip() if i < len(references) else "" for i, s in enumerate(lines) if s.strip()]
        written = write_treebank_examples(model, tokenizer, c.conllu, paired, ctx.out_dir / "attention",
                                          max_sentences=c.attention_sentences, limit=c.treebank_limit,
                                          query_chunk=c.query_chunk, max_length=c.max_length)
        return [ctx.out_dir / p for p in written], "the treebank's sentences (--conllu), with their gold arcs"
    n = c.attention_sentences if c.limit is None else min(c.attention_sentences, c.limit)
    sources = [line.strip() for line in read_lines(c.source)]
    if ctx.info.arch == "classifier":  # a labelled TSV: the text (pairs joined), not the label
        data = ctx.importance_data()
        sources = data.source_texts
    targets = [line.strip() for line in read_lines(c.target)] if c.target else None
    keep = [i for i, s in enumerate(sources) if s and (targets is None or targets[i])][:n]
    sources = [sources[i] for i in keep]
    targets = None if targets is None else [targets[i] for i in keep]
    if not ctx.info.is_seq2seq:
        targets = None
    written = write_attention_examples(model, tokenizer, sources, targets, ctx.out_dir / "attention", max_sentences=n,
                                       query_chunk=c.query_chunk, max_length=c.max_length)
    return [ctx.out_dir / p if not Path(p).is_absolute() else Path(p) for p in written], None


def _figures(ctx: _Context) -> tuple[list, str | None]:
    from headlab.pipeline.figures import write_figures

    entries = write_figures(ctx.out_dir, progress=ctx.config.progress)
    ctx.figures = entries
    written = [ctx.out_dir / e[k] for e in entries for k in ("png", "svg")]
    written += [ctx.out_dir / "figures" / f"{e['name']}.json" for e in entries]
    if not entries:
        raise SkipStage("no results to plot")
    return written, None


def _report(ctx: _Context) -> tuple[list, str | None]:
    from headlab.report import build_report

    return [build_report(ctx.out_dir)], None


RUNNERS: dict[str, Callable[[_Context], tuple[list, str | None]]] = {
    **{name: _importance(name) for name in IMPORTANCE_STAGES},
    "agreement": _agreement,
    "functions": _functions,
    "aggregate": _aggregate,
    "prune": _prune,
    "table": _table,
    "attention": _attention,
    "figures": _figures,
    "report": _report,
}
"""Registry: stage name -> runner returning (written paths, note or None); a measure registered
later runs through :func:`_importance` too."""


# ----------------------------------------------------------------------------- the loop


def not_requested(name: str, config: AnalyzeConfig) -> str | None:
    """Why a stage that runs only when asked for did not (``--prune``; a measure ``on_request``:
    the AnalyzeConfig flag of its name, ``--ablation``), or None."""
    on_request = name == "prune" or (name in MEASURES and MEASURES[name].on_request)
    return f"not requested (pass --{name})" if on_request and not getattr(config, name) else None


def _skipped_by_flag(config: AnalyzeConfig) -> set[str]:
    return {stage for name in config.skip for stage in STAGE_GROUPS.get(name, (name,))}


def _prepare_dir(ctx: _Context, name: str, key: str) -> None:
    """Clear a stage's own directory when it holds results of other inputs (or with force)."""
    if name not in STAGE_DIRS:
        return
    directory = ctx.out_dir / STAGE_DIRS[name]
    key_file = directory / KEY_FILE
    old = key_file.read_text().strip() if key_file.is_file() else None
    if directory.exists() and (ctx.config.force or (old is not None and old != key)):
        # Set aside, deleted once the stage is done (else kept in stale/ at the run's end, _release):
        # a run refused before its work puts it back. A killed run's is gone by now (_recover_replaced).
        aside = _replaced(ctx.out_dir, name)
        directory.replace(aside)
        ctx.replaced[directory] = aside
    if not directory.exists():
        ctx.created.append(directory)  # removed again if the run is refused (_Refused)
    directory.mkdir(parents=True, exist_ok=True)
    key_file.write_text(key + "\n")


def _replaced(out_dir: Path, name: str) -> Path:
    """Where :func:`_prepare_dir` keeps stage ``name``'s folder of before while the stage runs again."""
    return out_dir / LOCK_FILE.parent / f"replaced-{name}"


def _key_only(path: Path) -> bool:
    """A folder holding nothing but its stage key: no result in it."""
    return path.is_dir() and not path.is_symlink() and {p.name for p in path.iterdir()} <= {KEY_FILE}


def _recover_replaced(ctx: _Context, name: str, key: str, position: str) -> None:
    """A run killed in stage ``name`` after :func:`_prepare_dir` moved its folder aside left it in
    .headlab/replaced-<name> (deleted only once the stage is done). Never deleted here: put back in
    place when the killed run wrote no result in the stage's folder and it was made for this run's
    key (it has no marker now, so the stage runs on it: a sweep resumes from its finished points),
    else set aside in stale/, as results this run will not use are."""
    aside = _replaced(ctx.out_dir, name)
    if name not in STAGE_DIRS or not (aside.exists() or aside.is_symlink()):
        return
    directory = ctx.out_dir / STAGE_DIRS[name]
    key_file = aside / KEY_FILE
    ours = key_file.is_file() and key_file.read_text().strip() == key
    said = f"{position} {name}: the results a killed run had replaced ({aside.relative_to(ctx.out_dir)}) were "
    if ours and (_key_only(directory) or not (directory.exists() or directory.is_symlink())):
        if directory.exists():
            shutil.rmtree(directory)  # its key file only
        aside.replace(directory)
        ctx.set_aside.append((aside, directory))  # a refused run leaves it as it found it (_undo)
        ctx.log(said + f"put back in {STAGE_DIRS[name]}/ (the killed run had written no result there)")
    else:
        target = _set_aside(ctx, aside, STAGE_DIRS[name])
        ctx.log(said + f"moved aside to {target.relative_to(ctx.out_dir)}")


def _recover_held(ctx: _Context) -> None:
    """What a killed run held in .headlab/held/ (:func:`_hold`: an earlier run's outputs of a stage
    not done, which its end would have moved to stale/) goes to stale/ now, never deleted (a refused
    run puts it back, :func:`_undo`); a folder holding only its key goes. Their places are not
    recorded and their markers are gone: not put back where they were."""
    holding = ctx.out_dir / HELD
    if not holding.is_dir():
        return
    order = lambda path: int(path.name.partition("-")[0]) if path.name.partition("-")[0].isdigit() else -1  # noqa: E731
    moved = []
    for path in sorted(holding.iterdir(), key=order):
        if _key_only(path):
            shutil.rmtree(path)
        else:
            moved.append(_set_aside(ctx, path, path.name.partition("-")[2] or path.name))
    if moved:
        ctx.log("the results a killed run had held (.headlab/held/) were moved aside to "
                f"{', '.join(str(p.relative_to(ctx.out_dir)) for p in moved)}; nothing reads stale/ again")


def _to_stale(out_dir: Path, path: Path, name: str) -> Path | None:
    """``path`` set aside in stale/ as ``name`` (:func:`set_aside`); a folder holding only its key
    (nothing lost) removed, None."""
    if _key_only(path):
        shutil.rmtree(path)
        return None
    return set_aside(path, out_dir, name)


# What a stage without a folder of its own writes where the table, figures and report read it (a
# measure: importance/<table>.json of each of its tables).
OWN_FILES = {"agreement": ("importance/agreement.json", "importance/agreement.md"),
             "table": ("heads.csv", "heads.parquet"), "report": ("index.html",)}


def _own_paths(out_dir: Path, name: str) -> list[Path]:
    """Where stage ``name`` writes, found without its marker: its folder, or its files."""
    if name in STAGE_DIRS:
        return [out_dir / STAGE_DIRS[name]]
    if name in MEASURES:
        return [out_dir / "importance" / f"{table}.json" for table in MEASURES[name].tables]
    return [out_dir / relative for relative in OWN_FILES.get(name, ())]


@dataclass
class _Discarded:
    """Where :func:`_discard` set a stage's files aside: ``kept``, an earlier run's results of other
    inputs (with ``keep``); ``unfinished``, outputs no done marker vouches for."""

    stage: str
    kept: list[Path]
    unfinished: list[Path]
    resumed: list[Path] = field(default_factory=list)  # a failed sweep left in place for the same command

    def said(self, out_dir: Path) -> str:
        """The log's words for them ("" when nothing was set aside)."""
        shown = lambda paths: ", ".join(str(path.relative_to(out_dir)) for path in paths)  # noqa: E731
        parts = []
        if self.kept:
            parts.append(f"its results of an earlier run with other inputs or options were moved aside to "
                         f"{shown(self.kept)}")
        if self.unfinished:
            parts.append(f"its unfinished results (of a run killed or failed in this stage: no done marker) were "
                         f"moved aside to {shown(self.unfinished)}, not read as this run's")
        if self.resumed:
            parts.append(f"its unfinished sweep (no done marker) stays in {shown(self.resumed)}/, not read as this "
                         "run's; the same command resumes it point by point")
        return "; ".join(parts)


def _discard(ctx: _Context, name: str, keep: bool = False, resumable: bool = False) -> _Discarded:
    """A stage that is not done this time leaves no marker and no outputs of an earlier run; with
    ``keep`` they are set aside in ``DIR/stale/`` (an LRP or a sweep may have cost hours), else
    held until the run ends (:func:`_hold`, then stale/): a run refused by a later stage puts either back.
    Outputs that no marker lists (a run killed in the stage before its marker, or one that failed
    in it) are set aside in ``stale/`` too, whole: left in place, the table, the figures and the
    report read them as this run's results. With ``resumable`` (a sweep that failed this time) its
    folder stays whole where the same command resumes it (run_sweep, point by point): the manifest,
    which records the stage as failed, keeps the readers out of it. Returns where they went."""
    marker = raw_marker(ctx.out_dir, name) or ctx.unvouched.get(name)
    kept = []
    own = ctx.out_dir / STAGE_DIRS[name] if name in STAGE_DIRS else None
    if keep and marker and own is not None and own.is_dir():  # whole, not its files flattened into stale/
        kept.append(_set_aside(ctx, own))
    for rel in (marker or {}).get("record", {}).get("outputs", []):
        path = ctx.out_dir / rel
        if own is not None and (own in ctx.replaced or resumable) and path.is_relative_to(own):
            continue  # its files wait in ctx.replaced, or resume; the ones of this name now are this run's (below)
        if keep and path.exists():
            kept.append(_set_aside(ctx, path))
        elif path.exists() or path.is_symlink():
            _hold(ctx, path)
    marker_file = ctx.out_dir / MARKER_DIR / f"{name}.json"
    if marker_file.is_file():  # a run refused later puts it back with what it names
        ctx.removed_markers[marker_file] = marker_file.read_bytes()
    remove_marker(ctx.out_dir, name)
    ctx.markers.pop(name, None)
    unfinished, resumed = [], []
    for path in _own_paths(ctx.out_dir, name):
        if _key_only(path):
            _hold(ctx, path)  # one this run made goes at its end; an earlier run's comes back if refused
        elif resumable and path == own and path.is_dir() and not path.is_symlink():
            resumed.append(path)
        elif path.exists() or path.is_symlink():
            unfinished.append(_set_aside(ctx, path))
    return _Discarded(name, kept, unfinished, resumed)


HELD = LOCK_FILE.parent / "held"


def _hold(ctx: _Context, path: Path) -> None:
    """Move ``path`` (inside DIR) into DIR/.headlab/held/ until the run ends (:func:`_release`)."""
    holding = ctx.out_dir / HELD
    holding.mkdir(parents=True, exist_ok=True)
    target = holding / f"{len(ctx.held)}-{path.name}"
    path.replace(target)
    ctx.held.append((path, target))


def _release(ctx: _Context) -> None:
    """The run ended without a refusal. A stage folder it replaced for a stage not done this time
    (the done ones' went when they finished) and the earlier outputs it held for one go to stale/,
    never deleted: no new results replaced them (the run's folders holding only their key go)."""
    for directory, aside in ctx.replaced.items():
        if (target := _to_stale(ctx.out_dir, aside, directory.name)) is not None:
            ctx.log(f"{aside.name.removeprefix('replaced-')}: its results of before, replaced for this run, were "
                    f"moved aside to {target.relative_to(ctx.out_dir)} (the stage was not done)")
    ctx.replaced.clear()
    moved = [kept for path, held in ctx.held if (kept := _to_stale(ctx.out_dir, held, path.name)) is not None]
    if moved:
        ctx.log(f"results of an earlier run of stages not done this time were moved aside to "
                f"{', '.join(str(p.relative_to(ctx.out_dir)) for p in moved)}")
    ctx.held.clear()
    shutil.rmtree(ctx.out_dir / HELD, ignore_errors=True)


def _set_aside(ctx: _Context, path: Path, name: str | None = None) -> Path:
    """:func:`set_aside`, remembered for :func:`_undo`."""
    if not (ctx.out_dir / "stale").exists():
        ctx.made_stale = ctx.out_dir / "stale"
    target = set_aside(path, ctx.out_dir, name)
    ctx.set_aside.append((path, target))
    return target


def _settled(ctx: _Context, name: str, key: str, position: str) -> StageRecord | None:
    """The record of a stage that does not run this time (reused, skipped, not requested), or None."""
    marker = read_marker(ctx.out_dir, name, key)
    flagged = name in _skipped_by_flag(ctx.config)
    # A stage not run this time (--skip, or not asked for: --prune, --ablation) is not run by
    # --force either: its earlier results stay when still valid, else go to stale/, never deleted.
    why = "--skip" if flagged else not_requested(name, ctx.config)
    if marker is not None and (not ctx.config.force or why):
        record = StageRecord(**marker["record"])
        ctx.markers[name] = marker
        if name == "figures":
            ctx.figures = marker.get("figures", [])
        ctx.log(f"{position} {name}: " + (f"kept (done earlier; {why})" if why and ctx.config.force
                                          else "reused (done earlier; --force runs it again)"))
        return record
    if why:  # results of other inputs or options would join this run's table and report: set aside
        moved = _discard(ctx, name, keep=True).said(ctx.out_dir)
        ctx.log(f"{position} {name}: " + ("skipped (--skip)" if flagged else why) + (f"; {moved}" if moved else ""))
        return StageRecord(name, "skipped", "skipped with --skip" if flagged else why)
    return None


def _unvouch(ctx: _Context, name: str) -> None:
    """Before stage ``name`` writes again: its row leaves manifest.json (an earlier run's, which
    this run has not rewritten yet) and its done marker goes, so that a run killed before the new
    marker leaves nothing vouching for the files the stage half rewrote (to the readers,
    :mod:`headlab.report.vouched`; to the next run, which with --force's same key would reuse them).
    A refused run puts both back (:func:`_undo`: the manifest's bytes, ``removed_markers``)."""
    from headlab.heads import write_json

    manifest = read_manifest(ctx.out_dir)
    if manifest is not None and any(row["name"] == name for row in stage_rows(manifest)):
        rows = [row for row in manifest["stages"] if not (isinstance(row, dict) and row.get("name") == name)]
        # written_by: with its last row gone it must still vouch for nothing, not read whole
        figures: dict[str, list] = {"figures": []} if name == "figures" else {}  # they are the stage's files
        write_json(ctx.out_dir / "manifest.json", {**manifest, "written_by": ANALYZE, "stages": rows, **figures},
                   ensure_ascii=False)
    marker_file = ctx.out_dir / MARKER_DIR / f"{name}.json"
    if marker_file.is_file():
        ctx.removed_markers.setdefault(marker_file, marker_file.read_bytes())
        if (marker := raw_marker(ctx.out_dir, name)) is not None:
            ctx.unvouched[name] = marker  # what _discard sets aside if the stage is not done
        remove_marker(ctx.out_dir, name)


def _run_stage(ctx: _Context, name: str, position: str) -> StageRecord:
    shard = ctx.shard
    key = ctx.key(name) if shard.main else ""
    if shard.main:
        _recover_replaced(ctx, name, key, position)
    # The main process decides from its markers; the others follow (sharded runs).
    settled, = shard.broadcast((_settled(ctx, name, key, position) if shard.main else None,))
    if settled is not None:
        return settled
    if name not in SHARDED_STAGES and not shard.main:
        record, = shard.broadcast((None,))  # the main process runs it alone
        return record
    ctx.log(f"{position} {name}: running")
    start = time.perf_counter()
    try:
        if shard.main:
            _unvouch(ctx, name)
            _prepare_dir(ctx, name, key)
        with sharding(shard if name in SHARDED_STAGES else SINGLE):
            written, note = (RUNNERS[name] if name in RUNNERS else _importance(name))(ctx)
        record = StageRecord(name, "done", note, round(time.perf_counter() - start, 2), ctx.rel(written))
    except SkipStage as skip:
        record = StageRecord(name, "skipped", str(skip))
        ctx.log(f"{position} {name}: skipped: {skip}")
    except _Refused:
        raise  # exit 2 with its one line, before the first stage's work: not every stage failed in turn
    except HeadlabError as error:
        record = StageRecord(name, "failed", str(error), round(time.perf_counter() - start, 2))
        ctx.log(f"{position} {name}: failed: {error}")
    except Exception as error:  # noqa: BLE001 - one stage's bug must not lose the others' results
        if shard.split:
            raise  # the other processes wait for this one's share: stop them all
        traceback.print_exc(file=sys.stderr)
        record = StageRecord(name, "failed", f"{type(error).__name__}: {error}", round(time.perf_counter() - start, 2))
        ctx.log(f"{position} {name}: failed: {type(error).__name__}: {error}")
    own = ctx.out_dir / STAGE_DIRS[name] if name in STAGE_DIRS else None
    if record.status == "done" and own in ctx.replaced:  # its new results replace the old ones for good
        shutil.rmtree(ctx.replaced.pop(own), ignore_errors=True)
    # else its replaced directory waits for the run's end (_release: to stale/): a later refusal puts it back
    if shard.main:
        if record.status == "done":
            ctx.markers[name] = write_marker(ctx.out_dir, name, key, record,
                                             {"figures": ctx.figures} if name == "figures" else None)
            ctx.log(f"{position} {name}: done in {record.seconds:.1f} s")
        elif moved := _discard(ctx, name, resumable=name == "prune" and record.status == "failed").said(ctx.out_dir):
            ctx.log(f"{position} {name}: {moved}")
    record, = shard.broadcast((record,))
    return record


def _undo(ctx: _Context, manifest: Path, earlier: bytes | None) -> None:
    """What a refused run wrote before the stage that refused (stages skipped or reused do no work):
    the manifest back as it was, the stage directories it made that hold only their key removed,
    one it cleared put back, a skipped stage's results it set aside in stale/ put back with their
    marker (and stale/ removed if it made it), and so are the results and markers of a stage that
    skipped or failed this time (held in .headlab/held/ until the run's end), and a killed run's
    leftovers that this run set aside in stale/ (:func:`_recover_held`, :func:`_recover_replaced`)."""
    from headlab.heads import atomic_write_bytes

    if earlier is None:
        manifest.unlink(missing_ok=True)
    elif manifest.read_bytes() != earlier:
        atomic_write_bytes(manifest, earlier)
    for path, target in reversed(ctx.set_aside):
        if not path.exists() and target.exists():
            target.replace(path)
    for path, target in reversed(ctx.held):  # a folder before the files held out of it earlier
        if not path.exists() and path.parent.is_dir() and (target.exists() or target.is_symlink()):
            target.replace(path)
    ctx.held.clear()
    try:
        (ctx.out_dir / HELD).rmdir()  # only if empty: what could not go back stays for the next run
    except OSError:
        pass
    for marker_file, content in ctx.removed_markers.items():
        if not marker_file.exists():
            atomic_write_bytes(marker_file, content)
    if ctx.made_stale is not None:
        try:
            ctx.made_stale.rmdir()  # only if empty
        except OSError:
            pass
    for directory in ctx.created:
        if directory.is_dir() and {p.name for p in directory.iterdir()} <= {KEY_FILE}:
            shutil.rmtree(directory)
    for directory, aside in ctx.replaced.items():  # a stage not done: what it left is this run's
        if directory.is_dir() and not directory.is_symlink():
            shutil.rmtree(directory)
        if not directory.exists():
            aside.replace(directory)


def run_analysis(config: AnalyzeConfig, *, log: Callable[[str], None] | None = None,
                 shard: Shard = SINGLE) -> AnalysisRun:
    """Run (or resume) every stage into ``config.out``; see the module docstring. ``shard``: this
    process's place in a sharded run (:mod:`headlab.shard`)."""
    from contextlib import nullcontext
    from dataclasses import replace

    log = log or (lambda message: print(f"headlab analyze: {message}", file=sys.stderr, flush=True))
    if not shard.main:  # the main process speaks for the run
        config, log = replace(config, progress=False), lambda message: None
    check_processes(config, shard.world)
    out_dir = validate(config)
    if config.threads:
        import torch

        torch.set_num_threads(config.threads)
    created = [path for path in (out_dir / LOCK_FILE.parent, out_dir) if not path.exists()]
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        # A second run on DIR refuses instead of interleaving; the main process holds the lock for all.
        with DirectoryLock(out_dir, "--out") if shard.main else nullcontext():
            return _run_stages(config, out_dir, log, shard)
    except _Refused:
        if shard.main:  # refused before any work: no trace left, an --out that existed as it was
            for path in created:
                try:
                    path.rmdir()  # only if empty
                except OSError:
                    pass
        raise


def _run_stages(config: AnalyzeConfig, out_dir: Path, log: Callable[[str], None], shard: Shard = SINGLE) -> AnalysisRun:
    header = {"headlab_version": __version__, "model": config.model, "source": config.source,
              "target": config.target, "conllu": config.conllu, "created": now_iso(), "written_by": ANALYZE}
    ctx = _Context(config, out_dir, log, shard)
    records: list[StageRecord] = []
    manifest = out_dir / "manifest.json"
    earlier = manifest.read_bytes() if manifest.is_file() else None
    if shard.main:
        _recover_held(ctx)  # a killed run's
        if not stage_rows(read_manifest(out_dir)):
            # None, or one read whole (a saved Analysis'): until a stage finishes, vouch for nothing
            write_manifest(out_dir, header, [], [])
    for i, name in enumerate(STAGES, start=1):
        try:
            record = _run_stage(ctx, name, f"[{i}/{len(STAGES)}]")
        except _Refused:
            if shard.main:
                _undo(ctx, manifest, earlier)
            raise
        ctx.records[name] = record
        records.append(record)
        if shard.main:
            manifest = write_manifest(out_dir, header, records, ctx.figures)
    _release(ctx)
    report = out_dir / "index.html" if ctx.records["report"].status == "done" else None
    return AnalysisRun(out_dir, records, ctx.figures, manifest, report)
