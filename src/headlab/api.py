"""The Python API: one call per analysis, on a model and tokenizer already loaded (any device,
any dtype) and on data held in memory.

* :func:`importance` - scores of every head by each measure (:func:`headlab.importance.run_importance`);
* :func:`functions` - positional, syntactic and rare-token heads on a treebank
  (:func:`headlab.functions.analyze_heads`);
* :func:`aggregate` - the Vig & Belinkov statistics on a treebank (the same pass);
* :func:`prune` - remove heads (:func:`headlab.prune_heads`), given by spec or by scores and a budget;
* :func:`analyze` - all of them as ``headlab analyze`` runs them, into an :class:`Analysis` that
  converts to pandas, displays in a notebook and saves to (or loads from) the directory layout
  of ``headlab analyze``.

Every step calls the same library functions with the same options as the command line, so the
numbers are the command's, to the bit (tests/test_api.py compares them).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Sequence

from headlab.errors import HeadlabError, counted
from headlab.heads import HeadScores, format_head, normalised_per_layer, not_comparable_across_layers
from headlab.heads import shown_model_name as _shown_name
from headlab.importance.registry import DEFAULT_MEASURES
from headlab.options import checked_keywords, count_error

if TYPE_CHECKING:
    from torch import nn

    from headlab.aggregate import AggregateResult
    from headlab.data.treebank import InMemoryTreebank
    from headlab.functions.analysis import HeadAnalysis
    from headlab.importance.pipeline import ImportanceResult

__all__ = ["Analysis", "DEFAULT_MEASURES", "aggregate", "analyze", "functions", "importance", "prune"]

STATISTICS = ("functions", "aggregate")
"""What :func:`analyze` computes on a treebank."""

# Directories of an analysis directory that an Analysis holds (small JSON and Markdown files), and
# the first sentences of attention/ (for its viewer, up to VIEWER_BYTES); figures/, prune/,
# index.html and the other sentences stay on disk.
_HELD = ("importance", "functions", "aggregate")
_MANIFEST = "manifest.json"

VIEWER_BYTES = 600_000
"""Attention data (bytes, as the report embeds it) an :class:`Analysis` holds for its viewer: the
first sentences of ``attention/`` that fit. At 32 layers x 32 heads one 20-token sentence takes
about 550 kB, so a notebook output stays far below :data:`PAGE_LIMIT`."""
PAGE_LIMIT = 1_500_000
"""The most bytes of report page that :meth:`Analysis._repr_html_` embeds: as a base64 ``data:``
URL that is 2.0 MB, within Chromium's 2 MiB limit on URLs (a longer one shows a blank frame).
Sentences of the viewer are dropped, last first, to fit."""


# ----------------------------------------------------------------------------- inputs


def _model_name(model: nn.Module) -> str:
    name = str(getattr(getattr(model, "config", None), "name_or_path", "") or "")
    return _shown_name(name) if name else type(model).__name__


def model_info(model: nn.Module, tokenizer: Any, max_length: int | None = None,
               log: Callable[[str], None] | None = None) -> Any:
    """:func:`headlab.model_description.model_info` (imported on first use: ``import headlab.api``
    stays free of torch)."""
    from headlab.model_description import model_info as describe

    return describe(model, tokenizer, max_length, log)


def as_treebank(treebank: Any) -> "str | Path | InMemoryTreebank":
    """A CoNLL-U path, CoNLL-U text (a string with a line break), or parsed sentences."""
    from headlab.data.treebank import InMemoryTreebank

    if isinstance(treebank, InMemoryTreebank):
        return treebank
    if isinstance(treebank, os.PathLike):
        path = Path(treebank)
    elif isinstance(treebank, str):
        if "\n" in treebank:
            return InMemoryTreebank(treebank, "<conllu text>")
        path = Path(treebank)
    elif isinstance(treebank, (bytes, bytearray)):  # list() of it is ints: "got int" named no cause
        raise HeadlabError(f"treebank: got {type(treebank).__name__}; pass a CoNLL-U path as str or pathlib.Path, "
                           "or CoNLL-U text as str (decode the bytes first)")
    else:
        try:
            return InMemoryTreebank(list(treebank), "<sentences>")
        except TypeError:
            raise HeadlabError(f"treebank: expected a CoNLL-U path, CoNLL-U text or parsed sentences, got "
                               f"{type(treebank).__name__}") from None
    if not os.fspath(treebank):  # Path("") is the current directory
        raise HeadlabError("treebank: the CoNLL-U path is empty")
    if path.is_dir():
        raise HeadlabError(f"treebank: {path} is a directory, not a CoNLL-U file")
    if not path.is_file():
        raise HeadlabError(f"treebank: CoNLL-U file not found: {path}")
    return path


def _check_transformers_model(model: Any) -> None:
    """A transformers model (its ``config`` read everywhere): anything else failed deep inside as an
    AttributeError or TypeError."""
    if getattr(model, "config", None) is None:
        raise HeadlabError(f"model: expected a transformers model (a PreTrainedModel with a config), got "
                           f"{type(model).__name__}")


def _check_counts(function: str, **counts: Any) -> None:
    """Whole numbers of a call (``limit``, ``batch_size``, ``max_length`` ...) that are None or at
    least their minimum (``max_length=0`` meant the model's longest input): the check and the words
    of a config's options (:func:`headlab.options.count_error`), naming the argument."""
    minimum = {"max_length": 2, "attention_sentences": 0}
    for name, value in counts.items():
        error = count_error(value, f"[{minimum.get(name, 1)}, inf)", f"{function}: {name}")
        if error is not None:
            raise HeadlabError(error)


def _check_token_ids(model: nn.Module) -> None:
    """Every measure, statistic and pruning check runs the model on token ids: one whose forward needs an image
    (BLIP-2's pixel_values, Kosmos-2's; its blocks found by their names) failed deep inside the first of them with a
    TypeError or ValueError, UDOP's (bbox) and PI0's (state) in the name-based view of its blocks ("two modules
    claim"). Refused here as the CLI's check_supported refuses it, in its order: a type headlab refuses by name says
    why first."""
    from headlab.adapters import unsupported_reason
    from headlab.loading import token_ids_problem

    problem = None if unsupported_reason(model) else token_ids_problem(model)
    if problem:
        raise HeadlabError(f"model: {problem}")


def _check_model(model: Any, tokenizer: Any) -> None:
    """:func:`_check_transformers_model`, a tokenizer that can be called, and heads to analyse in
    their original numbering."""
    _check_transformers_model(model)
    if not callable(tokenizer):
        raise HeadlabError(f"tokenizer: expected the model's tokenizer (AutoTokenizer.from_pretrained), got "
                           f"{type(tokenizer).__name__}")
    from headlab.adapters import attention_blocks

    _check_token_ids(model)
    # A model without attention (a HeadlabError naming what was looked for), or with every head
    # pruned: importance returned tables with no head scored, as if it had scored them.
    blocks = attention_blocks(model)
    if not any(b.n_heads > 0 for b in blocks):
        raise HeadlabError("model: every attention head of the model was pruned; there is no head to analyse")
    from headlab.portable import check_pruned_numbering

    check_pruned_numbering(model, blocks)  # the low-level calls (mask_heads, capture_attention) refuse it too


def _texts(texts: Any, name: str = "texts") -> list:
    if isinstance(texts, str):
        raise HeadlabError(f"{name}: expected a list of sentences, got one string (wrap it in a list)")
    if isinstance(texts, Mapping):  # list() would take its keys alone: {text: label} lost every label
        raise HeadlabError(f"{name}: expected a list of sentences, got a {type(texts).__name__} (a classifier's "
                           "classes go in labels=, one per text)")
    try:
        items = list(texts)
    except TypeError:
        raise HeadlabError(f"{name}: expected a list of sentences, got {type(texts).__name__}") from None
    for number, text in enumerate(items, start=1):
        # a string, or (a sequence classifier's sentence pair) a tuple or list of strings
        if not (isinstance(text, str) or isinstance(text, (tuple, list)) and text
                and all(isinstance(part, str) for part in text)):
            raise HeadlabError(f"{name}: item {number} is {type(text).__name__} {text!r:.40}, not a string")
    return items


def _frequency_texts(texts: Sequence) -> list[str]:
    """The sentences whose tokens the rare-token heads count: a pair's two texts each."""
    return [part for text in texts for part in ([text] if isinstance(text, str) else list(text))]


# ----------------------------------------------------------------------------- single steps


def _kinds(model: nn.Module, kinds: str | Sequence[str]) -> tuple[str, ...]:
    """``kinds`` as a tuple of kinds the model has, as ``headlab importance --kinds`` checks them:
    an unknown or absent kind scored nothing, silently (and a string was taken letter by letter)."""
    from headlab.adapters import attention_blocks
    from headlab.heads import KINDS

    named = tuple(k.strip() for k in kinds.split(",") if k.strip()) if isinstance(kinds, str) else tuple(kinds)
    present = {b.kind for b in attention_blocks(model) if b.n_heads > 0}
    for kind in named:
        if kind not in KINDS:
            raise HeadlabError(f"kinds: unknown attention kind {kind!r}; expected some of {', '.join(KINDS)}")
        if kind not in present:
            raise HeadlabError(f"kinds: the model has no {kind} heads (it has {', '.join(sorted(present))})")
    if not named:
        raise HeadlabError("kinds: no kind given (None scores every kind)")
    return named


def _names(value: Any, keyword: str) -> tuple:
    """A name, names separated by commas as the command line takes them (``"confidence,lrp"``; it was one unknown
    name), or a sequence of names (``measures``, ``statistics``) as a tuple; anything else (a number) refused, not a
    TypeError from deep in the call."""
    if isinstance(value, str):
        return tuple(name.strip() for name in value.split(","))
    try:
        return tuple(value)
    except TypeError:
        raise HeadlabError(f"{keyword}={value!r}: give a name or a list of names") from None


def _importance_config(measures: str | Sequence[str], batch_size: int, progress: bool, options: dict) -> Any:
    from headlab.importance.config import ImportanceConfig

    measures = _names(measures, "measures")
    return ImportanceConfig(methods=measures, batch_size=batch_size, progress=progress, **options)


def _config_keywords(config: Any, *set_here: str) -> set[str]:
    """The keywords of ``config`` (its fields and its plug-ins' options) that a function's
    ``**options`` passes on: all but those the function sets itself (``set_here``)."""
    from dataclasses import fields

    return ({f.name for f in fields(config)} | {s.dest for s in config.plugin_specs()}) - set(set_here)


def _importance_options() -> set[str]:
    from headlab.importance.config import ImportanceConfig

    return _config_keywords(ImportanceConfig, "methods", "batch_size", "progress")


def _analysis_options() -> set[str]:
    from headlab.functions.config import AnalysisConfig

    return _config_keywords(AnalysisConfig, "functions", "aggregate", "batch_size", "max_sentences", "max_length",
                            "query_chunk")


@checked_keywords(_importance_options)
def importance(model: nn.Module, tokenizer: Any, texts: Sequence[str], *, targets: Sequence[str] | None = None,
               labels: Sequence[int | str] | None = None, measures: str | Sequence[str] = DEFAULT_MEASURES,
               limit: int | None = None, batch_size: int = 32, max_length: int | None = None,
               progress: bool = False, mask: Any = None, **options: Any) -> "ImportanceResult":
    """Score every head of ``model`` on ``texts`` by each of ``measures`` (``"all"``: every one
    that can run). ``targets``: reference translations (a translation model); ``labels``: the
    classes of a sequence classifier's texts (a text may be a pair of strings). ``mask``: heads
    to switch off while measuring (``{(kind, layer): [head, ...]}`` or a spec string, as
    :func:`prune` takes them): they are NaN in the tables, whose signature records them
    (:func:`~headlab.importance.run_importance`'s ``mask``); a model with gates attached by the
    caller (inside ``mask_heads``) is refused before any work. ``options``: the
    other fields of :class:`~headlab.importance.ImportanceConfig` (``lrp_targets``, ``beam``,
    ``metric``, ``kinds``, ...). What ``headlab importance`` computes on the same sentences."""
    from headlab.data.inputs import texts_data
    from headlab.gates import refuse_gated
    from headlab.importance.config import check_beam
    from headlab.importance.pipeline import run_importance

    _check_counts("importance", limit=limit, batch_size=batch_size, max_length=max_length)
    if options.get("kinds") is not None:
        options["kinds"] = _kinds(model, options["kinds"])
    _check_model(model, tokenizer)
    refuse_gated(model, "importance", instead="give mask= (headlab.importance's), which the tables record")
    spec = _head_spec(model, mask, "importance: mask") if mask is not None else None
    if spec:
        from headlab.adapters import attention_blocks
        from headlab.gates import validate_heads

        validate_heads(attention_blocks(model), spec)  # an unknown head fails here, not after the data is read
    config = _importance_config(measures, batch_size, progress, options)
    config.resolved_methods()  # a bad measure or option fails before any work
    config.check_options_act(str, f"measures={list(config.methods)!r}")
    info = model_info(model, tokenizer, max_length)
    check_beam(config.beam, translates=info.is_seq2seq, classifier=info.arch == "classifier", arch=info.arch,
               model="the model", option="beam")
    data = texts_data(_texts(texts), tokenizer, info, targets=None if targets is None else _texts(targets, "targets"),
                      labels=labels, n_sentences=limit, name="<texts>", target_name="" if targets is None else "<targets>")
    return run_importance(model, data, info, config, tokenizer=tokenizer, mask=spec)


def _head_pass(model: nn.Module, tokenizer: Any, treebank: Any, *, functions: bool,
               frequency_texts: Iterable[str] | None, limit: int | None, batch_size: int, max_length: int | None,
               query_chunk: int | None, progress: bool, options: dict) -> "HeadAnalysis":
    from headlab.functions.analysis import AnalysisConfig, analyze_heads
    from headlab.gates import refuse_gated

    _check_counts("functions" if functions else "aggregate", limit=limit, batch_size=batch_size, max_length=max_length,
                  query_chunk=query_chunk)
    _check_model(model, tokenizer)
    refuse_gated(model, "functions" if functions else "aggregate")  # before the frequency texts are read
    frequencies = None
    if functions and frequency_texts is not None:
        from headlab.data.frequencies import TokenFrequencies

        frequencies = (frequency_texts if isinstance(frequency_texts, TokenFrequencies) else
                       TokenFrequencies.from_texts(tokenizer, _frequency_texts(_texts(frequency_texts, "frequency_texts")),
                                                   "<texts>"))
    config = AnalysisConfig(functions=functions, aggregate=not functions, batch_size=batch_size, max_sentences=limit,
                            max_length=max_length, query_chunk=query_chunk, **options)
    source = as_treebank(treebank)
    analysis = analyze_heads(model, tokenizer, source, frequencies=frequencies, config=config,
                             model_name=_model_name(model), progress=progress)
    if analysis.report.n_sentences == 0:
        raise HeadlabError(f"treebank {source}: no sentence could be analysed\n{analysis.report.describe()}")
    return analysis


@checked_keywords(_analysis_options)
def functions(model: nn.Module, tokenizer: Any, treebank: Any, *, frequency_texts: Iterable[str] | None = None,
              limit: int | None = None, batch_size: int = 32, max_length: int | None = None, query_chunk: int | None = None,
              progress: bool = False, **options: Any) -> "HeadAnalysis":
    """Positional, syntactic and (with ``frequency_texts``, the corpus whose token frequencies
    define "rare") rare-token heads on ``treebank``: a CoNLL-U path, CoNLL-U text or parsed
    sentences. ``options``: fields of :class:`~headlab.functions.AnalysisConfig`."""
    return _head_pass(model, tokenizer, treebank, functions=True, frequency_texts=frequency_texts, limit=limit,
                      batch_size=batch_size, max_length=max_length, query_chunk=query_chunk, progress=progress,
                      options=options)


@checked_keywords(_analysis_options)
def aggregate(model: nn.Module, tokenizer: Any, treebank: Any, *, limit: int | None = None, batch_size: int = 32,
              max_length: int | None = None, query_chunk: int | None = None, progress: bool = False,
              **options: Any) -> "AggregateResult":
    """The aggregate statistics of Vig & Belinkov 2019 per head on ``treebank`` (see :func:`functions`)."""
    analysis = _head_pass(model, tokenizer, treebank, functions=False, frequency_texts=None, limit=limit,
                          batch_size=batch_size, max_length=max_length, query_chunk=query_chunk, progress=progress,
                          options=options)
    return analysis.aggregate


@checked_keywords()
def prune(model: nn.Module, heads: Any, *, keep: int | None = None, kinds: Sequence[str] | None = None) -> dict:
    """Remove heads from ``model`` in place (:func:`headlab.prune_heads`, checked to be exact).

    ``heads``: ``{(kind, layer): [head, ...]}``, a spec string (``"enc_self:0:1,2 dec_cross:5:*"``),
    or :class:`HeadScores` with ``keep``: the ``keep`` best-scored heads (over ``kinds``) stay (refused on attention
    weights shared by several depths, ALBERT's or Zamba's, where a spec must remove the same heads at each of them).
    Scores measured on another model than ``model`` (the table's ``model`` against ``model.config._name_or_path``:
    other weights, or other names where the weights cannot be read) give a warning naming both, as
    ``headlab prune baseline --method scores`` notes it: they rank that model's heads.
    Returns the heads each pruned block keeps, in the model's original numbering."""
    from headlab.surgery import prune_heads, removal_by_scores

    _check_transformers_model(model)
    _check_token_ids(model)
    if isinstance(heads, HeadScores):
        if keep is None:
            raise HeadlabError("prune: give keep=N (heads to keep) with scores")
        # kinds=[] or "" names no kind (refused), not every kind
        spec = removal_by_scores(model, heads, keep, _kinds(model, kinds) if kinds is not None else None)
        _warn_other_model(heads, model, keep)
    elif keep is not None or kinds is not None:  # kinds= with a spec was ignored: every named head went
        raise HeadlabError(f"prune: {'keep=' if keep is not None else 'kinds='} goes with HeadScores, not with a "
                           "list of heads to remove")
    else:
        spec = _head_spec(model, heads, "prune: heads", " or HeadScores with keep=N")
    return prune_heads(model, spec)


def _head_spec(model: nn.Module, heads: Any, what: str, also: str = "") -> dict:
    """``heads`` (``{(kind, layer): [head, ...]}`` or a spec string) as a head spec; a head named twice is warned of."""
    from headlab.adapters import attention_blocks

    if isinstance(heads, str):
        from headlab.headspec import parse_heads, repeated_heads

        _warn_repeated(repeated_heads(heads, attention_blocks(model)))
        return parse_heads(heads, attention_blocks(model))
    try:
        # a string key ("enc_self:0") is not a (kind, layer): tuple() would spell it letter by letter
        spec = {tuple(block) if not isinstance(block, str) else (block,): list(h) for block, h in dict(heads).items()}
    except (TypeError, ValueError):
        raise HeadlabError(f"{what} must be {{(kind, layer): [head, ...]}}, a spec string "
                           f"(\"enc_self:0:1,2\"){also}, got {heads!r:.60}") from None
    from headlab.headspec import repeated_in

    _warn_repeated(repeated_in(spec))
    return spec


def _warn_other_model(scores: HeadScores, model: nn.Module, keep: int) -> None:
    """As ``headlab prune baseline --method scores`` notes it: a table measured on another model ranks that model's
    heads (:func:`headlab.resume.other_model_note`; the model given is named by its config's ``_name_or_path``)."""
    from headlab.resume import other_model_note

    name = str(getattr(getattr(model, "config", None), "_name_or_path", "") or "")
    note = other_model_note(scores.model, name, f"keep={keep} prunes this model by that model's ranking of its heads")
    if note is not None:
        import warnings

        warnings.warn(f"prune: the scores {note}", UserWarning, stacklevel=3)


def _warn_repeated(repeated: list[str]) -> None:
    """As ``headlab prune`` notes it: a head named twice is removed once ([1, 1] meant as [1, 2] removes one head)."""
    if repeated:
        import warnings

        from headlab.headspec import repeated_note

        warnings.warn(f"prune: {repeated_note(repeated, 'heads')}", UserWarning, stacklevel=3)


# ----------------------------------------------------------------------------- everything


def _check_engine(model: nn.Module, engine: str | None) -> None:
    """``analyze``'s ``engine``: one of the engines, and the kernel only where it can run (triton, a
    CUDA GPU), refused before the first measure runs."""
    from headlab.functions.config import ENGINES

    if engine is not None and engine not in ENGINES:
        raise HeadlabError(f"analyze: engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if engine == "kernel":
        from headlab.functions.analysis import check_kernel

        check_kernel(next(model.parameters()).device)


@checked_keywords()
def analyze(model: nn.Module, tokenizer: Any, texts: Sequence[str] | None = None, *, treebank: Any = None,
            targets: Sequence[str] | None = None, labels: Sequence[int | str] | None = None,
            measures: Sequence[str] = DEFAULT_MEASURES, statistics: Sequence[str] = STATISTICS,
            frequency_texts: Iterable[str] | None = None, limit: int | None = None, treebank_limit: int | None = None,
            batch_size: int = 32, max_length: int | None = None, lrp_targets: int | None = None, lrp_seed: int = 0,
            query_chunk: int | None = None, engine: str | None = None, attention_sentences: int = 3,
            progress: bool = False, out: str | os.PathLike | None = None, overwrite: bool = False) -> "Analysis":
    """What ``headlab analyze`` computes, in one call: the importance ``measures`` of every head
    on ``texts`` (with their agreement), and the ``statistics`` (``functions``, ``aggregate``) on
    ``treebank`` (a CoNLL-U path, CoNLL-U text or parsed sentences; rare-token heads count token
    frequencies on ``frequency_texts``, by default ``texts``, as ``analyze`` counts them on
    ``--source``). ``limit`` / ``treebank_limit``: the first N texts / sentences. The attention of
    the first ``attention_sentences`` sentences of the treebank (with their gold arcs), or without
    one of the texts, is kept for the viewer of the report and of :meth:`Analysis._repr_html_`
    (``headlab analyze --attention-sentences``, 20 there; 0: none).
    With ``out``, the files are also written there, as ``headlab analyze`` writes them
    (:meth:`Analysis.save`; an earlier analysis there is replaced only with ``overwrite``).
    ``engine``: where confidence, functions and aggregate run, as ``headlab analyze --engine``
    (None: the fused engine; "eager" or "chunked": the references; "kernel": the Triton kernel, on a
    CUDA GPU)."""
    from headlab.gates import refuse_gated
    from headlab.importance.measure_options import LRPOptions, confidence_engine
    from headlab.importance.registry import MEASURES
    from headlab.pipeline.pipeline import IMPORTANCE_STAGES, write_aggregate, write_agreement, write_functions

    if texts is None and treebank is None:
        raise HeadlabError("analyze: give texts (importance), a treebank (functions, aggregate), or both")
    _check_model(model, tokenizer)
    # before any work: the attention kept for the viewer would be the gated model's too, and no table would say so
    refuse_gated(model, "analyze")
    measures, statistics = _names(measures, "measures"), _names(statistics, "statistics")  # not letter by letter
    for name in measures:
        if name not in MEASURES:
            raise HeadlabError(f"analyze: unknown measure {name!r}; expected some of {', '.join(MEASURES)}")
    for name in statistics:
        if name not in STATISTICS:
            raise HeadlabError(f"analyze: unknown statistic {name!r}; expected some of {', '.join(STATISTICS)}")
    if not (texts is not None and measures or treebank is not None and statistics or attention_sentences):
        # it returned an empty Analysis (0 tables), as if the model had been analysed
        raise HeadlabError("analyze: nothing to compute: " + (
            "measures is empty" if texts is not None else "no texts for the measures") + " and " + (
            "statistics is empty" if treebank is not None else "no treebank for the statistics") +
            " (and attention_sentences=0)")
    _check_parts(texts is not None, treebank is not None, measures, statistics, treebank_limit=treebank_limit,
                 frequency_texts=frequency_texts, targets=targets, labels=labels, lrp_targets=lrp_targets,
                 lrp_seed=lrp_seed or None)
    # the library's messages name the command's --limit
    _check_counts("analyze", limit=limit, treebank_limit=treebank_limit, batch_size=batch_size, max_length=max_length,
                  attention_sentences=attention_sentences, query_chunk=query_chunk)
    _check_engine(model, engine)
    if out is not None:
        _check_directory(Path(out), overwrite)  # before any work
    # Held to the end, as `headlab analyze --out DIR` holds it: a second call into DIR meanwhile is
    # refused, instead of the last one winning and the first loading the other's results.
    with nullcontext() if out is None else _holding(Path(out)):
        texts = None if texts is None else _texts(texts)
        treebank = None if treebank is None else as_treebank(treebank)
        lrp_targets = LRPOptions.targets if lrp_targets is None else lrp_targets
        model_name = _model_name(model)
        skipped: dict[str, str] = {}
        writers: list = []  # (stage, function(directory) -> paths)

        if texts is not None and measures:
            from headlab.data.inputs import texts_data
            from headlab.importance.pipeline import run_importance

            info = model_info(model, tokenizer, max_length)
            data = texts_data(texts, tokenizer, info, targets=None if targets is None else _texts(targets, "targets"),
                              labels=labels, n_sentences=limit, name="<texts>",
                              target_name="" if targets is None else "<targets>")
            scores: dict[str, HeadScores] = {}
            for name in (m for m in IMPORTANCE_STAGES if m in measures):  # the pipeline's order, one run each
                if MEASURES[name].needs_lm_head and not info.has_lm_head:
                    skipped[name] = (f"the model has no language-model head: {name} needs logits to explain or a loss "
                                     "to differentiate")
                    continue
                config = _importance_config((name,), batch_size, progress,
                                            {"lrp_targets": lrp_targets, "lrp_seed": lrp_seed, "query_chunk": query_chunk,
                                             # as analyze: with query_chunk, eager is the statistics' engine alone
                                             "engine": confidence_engine(engine, query_chunk)})
                result = run_importance(model, data, info, config, tokenizer=tokenizer)
                data = result.data  # the model's translations, made once, for the next measures
                skipped.update(result.skipped)
                scores.update(result.scores)
            for method, table in scores.items():
                writers.append((method, lambda d, t=table, m=method: [t.save(d / "importance" / f"{m}.json")]))
            if len([m for m in IMPORTANCE_STAGES if m in scores]) >= 2:
                ordered = {m: scores[m] for m in IMPORTANCE_STAGES if m in scores}
                writers.append(("agreement", lambda d: write_agreement(ordered, d / "importance")))
        if treebank is not None:
            sentences = treebank_limit if treebank_limit is not None else limit
            if "functions" in statistics:
                if frequency_texts is None and texts is not None:
                    frequency_texts = texts
                head_analysis = functions(model, tokenizer, treebank, frequency_texts=frequency_texts, limit=sentences,
                                          batch_size=batch_size, max_length=max_length,
                                          query_chunk=None if engine == "eager" else query_chunk, progress=progress,
                                          engine=engine)
                writers.append(("functions", lambda d: write_functions(head_analysis, d / "functions")))
            if "aggregate" in statistics:
                result_aggregate = aggregate(model, tokenizer, treebank, limit=sentences, batch_size=batch_size,
                                             max_length=max_length, query_chunk=None if engine == "eager" else query_chunk,
                                             progress=progress, engine=engine)
                writers.append(("aggregate", lambda d: write_aggregate(result_aggregate, d / "aggregate")))
        if treebank is not None and attention_sentences:  # its sentences, with their gold arcs, as `headlab analyze`
            writers.append(("attention", _treebank_attention_writer(
                model, tokenizer, treebank, treebank_limit if treebank_limit is not None else limit, attention_sentences,
                query_chunk, max_length)))
        elif texts is not None and attention_sentences:
            writers.append(("attention", _attention_writer(model, tokenizer, texts[:limit], targets, attention_sentences,
                                                           query_chunk, max_length)))

        header = {"model": model_name, "source": "<texts>" if texts is not None else None,
                  "target": "<targets>" if targets is not None else None,
                  "conllu": None if treebank is None else str(treebank), "written_by": ANALYZED_BY}

        def write(directory: Path) -> None:
            from headlab.pipeline.records import StageRecord

            records = [StageRecord(stage, "done", None, None,
                                   sorted(Path(p).relative_to(directory).as_posix() for p in make(directory)))
                       for stage, make in writers]
            records += [StageRecord(name, "skipped", reason) for name, reason in skipped.items()]
            _finish(directory, header, records)

        if out is not None:
            _write_directory(Path(out), write, overwrite)
            analysis = Analysis.load(out)
        else:  # the files are the results' one serialisation: written to a scratch directory, read back
            with tempfile.TemporaryDirectory(prefix="headlab-analysis-") as scratch:
                write(Path(scratch))
                analysis = replace(Analysis.load(scratch), run="")
        analysis.skipped.update(skipped)
        return analysis


def _check_parts(texts: bool, treebank: bool, measures: Sequence[str], statistics: Sequence[str],
                 **given: Any) -> None:
    """:func:`analyze`'s arguments of a part that does not run (``given`` and not None): refused,
    where they were ignored without a word (as ``analyze --window`` without ``--conllu``)."""
    lrp = (texts and "lrp" in measures, "measure 'lrp' on the texts")
    parts = {"treebank_limit": (treebank, "the treebank"),
             "frequency_texts": (treebank and "functions" in statistics,
                                 "the rare-token heads of statistics 'functions' on a treebank"),
             "targets": (texts, "the texts"), "labels": (texts, "the texts"), "lrp_targets": lrp, "lrp_seed": lrp}
    for name, value in given.items():
        runs, what = parts[name]
        if value is not None and not runs:
            raise HeadlabError(f"analyze: {name} goes with {what}, which this call does not compute; leave it out")


def _attention_writer(model: nn.Module, tokenizer: Any, texts: list, targets: Sequence[str] | None, n: int,
                      query_chunk: int | None, max_length: int | None) -> Callable[[Path], list[Path]]:
    """The attention stage of ``headlab analyze`` on in-memory texts: a function(directory) that
    writes ``attention/`` (:func:`headlab.report.write_attention_examples`) and returns its paths."""
    from headlab.report import write_attention_examples

    # A classifier's pair of texts is shown joined, as the command shows a labelled TSV's.
    sources = [text if isinstance(text, str) else " ".join(text) for text in texts]
    seq2seq = model_info(model, tokenizer).is_seq2seq
    references = _texts(targets, "targets")[: len(sources)] if targets is not None and seq2seq else None

    def write(directory: Path) -> list[Path]:
        written = write_attention_examples(model, tokenizer, sources, references, directory / "attention",
                                           max_sentences=n, query_chunk=query_chunk, max_length=max_length)
        return [directory / path for path in written]

    return write


def _treebank_attention_writer(model: nn.Module, tokenizer: Any, treebank: Any, limit: int | None, n: int,
                               query_chunk: int | None, max_length: int | None) -> Callable[[Path], list[Path]]:
    """The attention stage of ``headlab analyze --conllu``: the treebank's first ``n`` sentences,
    each with its gold parse (:func:`headlab.report.examples.write_treebank_examples`); a
    translation model is teacher-forced on its own translation (a treebank has no reference)."""
    from headlab.report.examples import write_treebank_examples

    def write(directory: Path) -> list[Path]:
        written = write_treebank_examples(model, tokenizer, treebank, None, directory / "attention", max_sentences=n,
                                          limit=limit, query_chunk=query_chunk, max_length=max_length)
        return [directory / path for path in written]

    return write


def _held_attention(directory: Path) -> dict[str, bytes]:
    """``attention/index.json`` and the first sentences it lists that fit :data:`VIEWER_BYTES` (as
    the report embeds them), the index trimmed to those; nothing when there is no readable index."""
    from headlab.report.build import json_for_script

    try:
        index = json.loads((directory / "attention" / "index.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(index, dict) or not isinstance(index.get("sentences"), list):
        return {}
    held: dict[str, bytes] = {}
    kept, used, first_left = [], 0, None
    for entry in index["sentences"]:
        name = Path(str(entry.get("file", ""))).name if isinstance(entry, dict) else ""
        try:
            content = (directory / "attention" / name).read_bytes() if name else b""
            size = len(json_for_script(json.loads(content)))
        except (OSError, ValueError):
            continue  # the report notes an unreadable sentence; the analysis leaves it out
        if used + size > VIEWER_BYTES:
            tokens = entry.get("n_tokens") if isinstance(entry.get("n_tokens"), dict) else {}
            first_left = {"id": entry.get("id"), "tokens": max(tokens.values(), default=0), "bytes": size}
            break
        held[f"attention/{name}"] = content
        kept.append(entry)
        used += size
    # How many the directory has, for the notebook's caption (a held subset saved and loaded keeps it),
    # and the first sentence left out, for the viewer's note on why.
    total = index.get("sentences_in_directory", len(index["sentences"]))
    extra = {"first_not_held": first_left} if first_left is not None else {}
    held["attention/index.json"] = (json.dumps({**index, "sentences": kept, "sentences_in_directory": total, **extra},
                                               indent=1) + "\n").encode("utf-8")
    return held


def _write_directory(directory: Path, write: Callable[[Path], None], overwrite: bool) -> None:
    """``write(tmp)`` into a new directory swapped in for ``directory`` at the end (a kill leaves
    the old one or the new one). A directory holding files headlab did not write is refused; a
    headlab directory is replaced whole (no stale stage of an earlier run stays) with ``overwrite``."""
    from headlab.heads import atomic_dir
    from headlab.lock import LOCK_FILE

    _check_directory(directory, overwrite)
    with _holding(directory):
        def written(tmp: Path) -> None:
            write(tmp)
            # the lock goes with the swap: DIR stays held until the caller is done with it
            (tmp / LOCK_FILE).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(directory / LOCK_FILE, tmp / LOCK_FILE)

        atomic_dir(directory, written)


@contextmanager
def _holding(directory: Path) -> Iterator[None]:
    """Hold ``DIR/.headlab/lock`` (re-entrant in this process), made with ``DIR`` if need be; the
    results keep no trace of it (no ``.headlab/`` left behind, nor ``DIR`` if nothing was written)."""
    from headlab.lock import LOCK_FILE, locked_output

    with locked_output(directory, "out"):
        yield
    try:
        (directory / LOCK_FILE.parent).rmdir()  # only if empty
    except OSError:
        pass


def _only_our_lock(directory: Path) -> bool:
    """``DIR/.headlab`` holds nothing but this process's lock (taken by :func:`_holding`)."""
    from headlab.lock import LOCK_FILE, DirectoryLock

    marks = directory / LOCK_FILE.parent
    held = marks.is_dir() and [p.name for p in marks.iterdir()] == [LOCK_FILE.name]
    return held and DirectoryLock(directory).held_elsewhere() is None and (directory / LOCK_FILE).is_file()


def _check_directory(directory: Path, overwrite: bool) -> None:
    from headlab.lock import LOCK_FILE, DirectoryLock
    from headlab.outdir import other_commands_results
    from headlab.pipeline.pipeline import _foreign_files

    if directory.exists() and not directory.is_dir():  # the swap at the end would replace the user's file
        raise HeadlabError(f"{directory}: exists and is not a directory")
    # A command writing there (`headlab analyze --out DIR` running): the swap would pull the directory
    # from under it, and its later stages would land in these results.
    holder = DirectoryLock(directory).held_elsewhere()
    if holder is not None:
        raise HeadlabError(f"{directory} is in use by another headlab run (pid {holder.get('pid', '?')} on "
                           f"{holder.get('host', '?')}, since {holder.get('started', '?')}); wait for it to finish or "
                           f"choose another directory. If no such run is going, delete {directory / LOCK_FILE}")
    # A pruned model, functions' results ...: refused also with overwrite.
    if other := other_commands_results(directory, "analyze", "overwrite=True", where=""):
        raise HeadlabError(other)
    foreign = _foreign_files(directory)
    if foreign:
        raise HeadlabError(f"{directory}: the directory holds files headlab did not write ({', '.join(foreign[:5])}); "
                           "choose a new or empty directory")
    if directory.is_dir() and any(p.name != LOCK_FILE.parent.name or not _only_our_lock(directory)
                                  for p in directory.iterdir()) and not overwrite:
        raise HeadlabError(f"{directory}: the directory holds an earlier analysis; pass overwrite=True to replace it "
                           "(all of it: its report, figures and attention examples too)")


ANALYZED_BY = "headlab.analyze (Python API)"
"""``written_by`` of the manifest :func:`analyze` writes (every stage's row at once)."""
SAVED_BY = "headlab.Analysis.save (Python API)"
"""``written_by`` of the manifest :meth:`Analysis.save` writes: the rows it keeps are those of the
stages whose files it writes, so the readers read it by its rows, and whole when it has none; never
``headlab analyze``'s (:data:`headlab.report.vouched.ANALYZE`), whose manifest with no row vouches
for nothing: headlab analyze did not write this one."""


def _finish(directory: Path, header: dict, records: list) -> None:
    """The manifest (``headlab analyze``'s, with the stages written) and heads.csv."""
    from headlab._version import __version__
    from headlab.pipeline.records import write_manifest
    from headlab.pipeline.table import write_heads_table
    from headlab.resume import now_iso

    directory.mkdir(parents=True, exist_ok=True)
    write_heads_table(directory)
    write_manifest(directory, {"headlab_version": __version__, **header, "created": now_iso()}, records, [])


# ----------------------------------------------------------------------------- the result


@dataclass
class Analysis:
    """The results of one analysis: every HeadScores table (by its heads.csv column), the heads'
    function labels, the agreement between measures, and the files they came from.

    ``files`` holds the analysis directory's ``importance/``, ``functions/`` and ``aggregate/``
    files (relative path -> bytes), the first sentences of ``attention/`` (up to
    :data:`VIEWER_BYTES`) and its manifest, so that :meth:`save` writes back what :meth:`load`
    read, in the layout of ``headlab analyze``."""

    model: str = ""
    tables: dict[str, HeadScores] = field(default_factory=dict)
    labels: dict[str, list[str]] = field(default_factory=dict)
    agreement: dict | None = None
    skipped: dict[str, str] = field(default_factory=dict)
    files: dict[str, bytes] = field(default_factory=dict, repr=False)
    run: str = ""
    """The analysis directory's name (heads.csv's ``run`` column); empty when it was never on disk."""

    # -- files ------------------------------------------------------------------------------
    @classmethod
    @checked_keywords()
    def load(cls, directory: str | os.PathLike) -> "Analysis":
        """An analysis directory written by ``headlab analyze`` (any version that wrote these
        files; any stage may be missing) or by :meth:`save`. The files of a stage that its
        ``manifest.json`` does not list as done (a run killed in the stage) are not read: a warning
        names the stage, and :attr:`skipped` lists it (:mod:`headlab.report.vouched`)."""
        import warnings

        from headlab.pipeline.labels import load_labels
        from headlab.pipeline.table import score_columns
        from headlab.report.vouched import read_manifest, vouched

        if not str(directory).strip():  # Path("") is the working directory
            raise HeadlabError("Analysis.load: the directory path is empty")
        directory = Path(directory)
        if not directory.is_dir():
            raise HeadlabError(f"{directory}: no such analysis directory")
        readable = vouched(directory, read_manifest(directory))
        files: dict[str, bytes] = {}
        for group in _HELD:
            root = directory / group
            if root.is_dir():
                for path in sorted(root.rglob("*")):
                    inside = path.relative_to(directory)
                    if path.is_file() and not any(part.startswith(".") for part in inside.parts) \
                            and readable.reads(inside):
                        files[inside.as_posix()] = path.read_bytes()
        if readable.reads("attention/index.json"):
            files.update(_held_attention(directory))
        left_out = {group.stage: group.text() for group in readable.under(*_HELD, "attention")}
        for text in left_out.values():
            warnings.warn(f"Analysis.load({directory}): {text}", UserWarning, stacklevel=3)
        if (directory / _MANIFEST).is_file():
            files[_MANIFEST] = (directory / _MANIFEST).read_bytes()
        if not files:
            raise HeadlabError(f"{directory}: not an analysis directory (no importance/, functions/, aggregate/ "
                               "or manifest.json)")
        documents: list[tuple[str, object]] = []
        for relative, content in files.items():
            if relative.endswith(".json") and relative != _MANIFEST and not relative.startswith("attention/"):
                try:
                    documents.append((relative, json.loads(content)))
                except ValueError as error:
                    raise HeadlabError(f"{directory / relative}: invalid JSON ({error})") from error
        columns = dict(score_columns(documents, directory))
        labels = load_labels(directory / "functions" / "labels.json") if "functions/labels.json" in files else {}
        found = dict(documents).get("importance/agreement.json")
        agreement = found if isinstance(found, dict) else None
        manifest = json.loads(files[_MANIFEST]) if _MANIFEST in files else {}
        skipped = {s["name"]: s.get("reason") or "" for s in manifest.get("stages", []) or []
                   if isinstance(s, dict) and s.get("status") == "skipped" and "name" in s}
        skipped.update(_missing_outputs(manifest, files, directory))
        for stage, text in left_out.items():
            skipped[stage] = f"{skipped[stage]}; {text}" if skipped.get(stage) else text
        model = str(manifest.get("model") or next((t.model for t in columns.values() if t.model), ""))
        return cls(_shown_name(model) if model else "", columns, labels, agreement, skipped, files,
                   run=directory.resolve().name)

    @checked_keywords()
    def save(self, directory: str | os.PathLike, report: bool = False, overwrite: bool = False) -> Path:
        """Write the analysis directory (the files it was made of, heads.csv, manifest.json), in
        the layout of ``headlab analyze``, which :meth:`load` reads; with ``report``, also the HTML
        report ``index.html`` (:func:`headlab.report.build_report`). A directory holding files
        that headlab did not write is refused, one holding an analysis replaced only with ``overwrite``."""
        from headlab.pipeline.records import StageRecord

        directory = Path(directory)
        manifest = json.loads(self.files[_MANIFEST]) if _MANIFEST in self.files else {}
        records = [StageRecord(**s) for s in manifest.get("stages", []) or []]
        header = {k: v for k, v in manifest.items()
                  if k not in ("stages", "figures", "headlab_version", "created", "written_by")}
        # the rows loaded vouch for exactly the files written (load read no other); the writer is not theirs
        header = {**(header or {"model": self.model}), "written_by": SAVED_BY}

        def write(target: Path) -> None:
            for relative, content in self.files.items():
                if relative != _MANIFEST:
                    (target / relative).parent.mkdir(parents=True, exist_ok=True)
                    (target / relative).write_bytes(content)
            _finish(target, header, records)
            if report:
                from headlab.report import build_report

                build_report(target)

        _write_directory(directory, write, overwrite)
        return directory

    # -- tables -----------------------------------------------------------------------------
    def heads_table(self) -> tuple[list[str], list[list]]:
        """``(columns, rows)`` of heads.csv: one row per head, one column per table, then the labels."""
        from headlab.pipeline.table import table_rows

        manifest = json.loads(self.files[_MANIFEST]) if _MANIFEST in self.files else {}
        model = manifest.get("model") if isinstance(manifest.get("model"), str) else self.model
        return table_rows(self.tables.items(), self.labels, model=model or "", run=self.run)

    def heads(self) -> Any:
        """heads.csv as a pandas DataFrame (one row per head)."""
        columns, rows = self.heads_table()
        frame = _pandas().DataFrame(rows, columns=columns)
        # A measure no head scored is all None: NaN, as pandas.read_csv gives for heads.csv's empty cells.
        not_scores = ("model", "run", "kind", "numbering", "dtype", "functions")
        scored = [c for c in columns if c not in not_scores and frame[c].isna().all()]
        frame[scored] = frame[scored].astype(float)
        return frame

    def records(self) -> list[dict]:
        """The tidy table as dicts: one per model, kind, layer, head, measure (the heads.csv
        column), value; heads a table does not score (NaN) are left out. A ``dtype`` after ``head``
        where :meth:`heads` has that column: the tables were measured in another dtype than float32
        (tables of two are refused, as there)."""
        return self._records(self._dtype())

    def _dtype(self) -> str | None:
        """The heads table's ``dtype`` column (:func:`headlab.pipeline.table.table_dtype`); None: it has none."""
        from headlab.pipeline.table import table_dtype

        return table_dtype(list(self.tables.items()), "heads table")

    def _records(self, dtype: str | None) -> list[dict]:
        precision = {"dtype": dtype} if dtype is not None else {}  # float32: the keys they always were
        return [{"model": self.model, "kind": kind, "layer": layer, "head": head, **precision, "measure": name,
                 "value": value}
                for name, table in self.tables.items() for (kind, layer, head), value in table.items()]

    def to_pandas(self) -> Any:
        """:meth:`records` as a pandas DataFrame: stack several models' with ``pandas.concat``."""
        dtype = self._dtype()
        columns = ["model", "kind", "layer", "head", *(["dtype"] if dtype is not None else []), "measure", "value"]
        return _pandas().DataFrame(self._records(dtype), columns=columns)

    def __getitem__(self, column: str) -> HeadScores:
        if column not in self.tables:
            raise KeyError(f"{column!r}: not a table of this analysis (have {', '.join(self.tables)})")
        return self.tables[column]

    @property
    def measures(self) -> list[str]:
        """The importance measures (and their standard errors) among the tables."""
        return [name for name in self.tables if any(r == f"importance/{name}.json" for r in self.files)]

    # -- display ----------------------------------------------------------------------------
    @checked_keywords()
    def top_heads(self, measure: str, n: int = 5) -> list[tuple[str, float]]:
        """The ``n`` heads ``measure`` scores highest, as ``(name, score)``, with their labels."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:  # n=-1 sliced off the lowest head, silently
            raise HeadlabError(f"top_heads: n must be an integer >= 0, got {n!r}")
        ranked = sorted(((v, k) for k, v in self[measure].items() if not math.isnan(v)), reverse=True)[:n]
        return [(format_head(*key) + _label_suffix(self.labels, key), value) for value, key in ranked]

    def _analysed_heads(self) -> list[str]:
        """The heads of :attr:`labels` the functions stage analysed: a pruned head is listed there too,
        with no label, and has no positional share."""
        share = self.tables.get("positional_share")
        if share is None:
            return list(self.labels)
        heads = []
        for key in self.labels:
            kind, layer, head = key.split(":")
            try:
                missing = math.isnan(float(share[kind][int(layer)][int(head)]))
            except (KeyError, IndexError, ValueError):
                missing = False
            if not missing:
                heads.append(key)
        return heads

    def __repr__(self) -> str:
        analysed = self._analysed_heads()
        labelled = sum(1 for key in analysed if self.labels[key])
        lines = [f"Analysis of {self.model or 'a model'}: {counted(len(self.tables), 'table')} "
                 f"({', '.join(self.measures) or 'no importance measure'}; "
                 f"{len(self.tables) - len(self.measures)} function and aggregate maps), "
                 f"{labelled} of {len(analysed)} analysed heads with a function"]
        for measure in [m for m in self.measures if not m.endswith(("_raw", "_stderr"))][:4]:
            table = self[measure]
            why = not_comparable_across_layers(table.scores) if normalised_per_layer(table.signature) else ""
            if why:  # a pruned model's gradient importance or LRP: the report leaves it out of its ranking too
                raw = f"; see {measure}_raw" if f"{measure}_raw" in self.tables else ""
                lines.append(f"  top by {measure}: not ranked (normalised per layer and {why}{raw})")
                continue
            top = ", ".join(f"{name} {value:.3g}" for name, value in self.top_heads(measure, 3))
            lines.append(f"  top by {measure}: {top}")
        for name, reason in self.skipped.items():
            lines.append(f"  skipped {name}: {reason}")
        return "\n".join(lines)

    def report_html(self) -> str:
        """The report of ``headlab analyze`` (:func:`headlab.report.build_report`) for this analysis
        as one self-contained page: the heatmaps, function labels, agreement and the attention
        viewer on the held sentences, with no file beside it and nothing from the network. At most
        :data:`PAGE_LIMIT` bytes: the viewer's sentences are dropped, last first, to fit (a
        heads x layers map is never dropped; a page too large without them raises HeadlabError)."""
        return self._report_page()[0]

    def _report_page(self) -> tuple[str, int]:
        """:meth:`report_html`'s page and the number of attention sentences it shows."""
        from html import escape

        from headlab.report import build_report

        shown = self._viewer_sentences()
        with tempfile.TemporaryDirectory(prefix="headlab-report-") as scratch:
            target = Path(scratch) / "analysis"
            while True:
                shutil.rmtree(target, ignore_errors=True)
                target.mkdir()  # an empty analysis too: a report that says what is missing
                self._write_files(target, shown)
                # Every sentence inlined: a data: URL page cannot load attention/*.js beside it.
                page = (build_report(target, inline_limit=PAGE_LIMIT).read_text(encoding="utf-8")
                        .replace(escape(str(target)), escape(self.run or "(in memory)")))
                size = len(page.encode("utf-8"))
                if size <= PAGE_LIMIT or not shown:
                    break
                excess = size - PAGE_LIMIT
                while shown and excess > 0:  # last first, until about enough bytes go
                    excess -= len(self.files[shown.pop()])
        if size > PAGE_LIMIT:
            raise HeadlabError(f"the report of this analysis takes {size / 1e6:.1f} MB without attention "
                               f"examples, more than a notebook embeds ({PAGE_LIMIT / 1e6:.1f} MB); write it with "
                               "save(directory, report=True) and open index.html")
        return page, len(shown)

    def _viewer_sentences(self) -> list[str]:
        """The held attention sentences (``attention/sentence-NNN.json``), in the index's order."""
        try:
            index = json.loads(self.files["attention/index.json"])
            names = [f"attention/{Path(str(entry['file'])).name}" for entry in index["sentences"]]
        except (KeyError, TypeError, ValueError):
            return []
        return [name for name in names if name in self.files]

    def _write_files(self, target: Path, sentences: list[str]) -> None:
        """The held files under ``target``, of the attention examples only ``sentences`` (the
        index trimmed to them)."""
        for relative, content in self.files.items():
            if relative.startswith("attention/sentence-") and relative not in sentences:
                continue
            if relative == "attention/index.json":
                index = json.loads(content)
                held = index["sentences"]
                index["sentences"] = [e for e in held if f"attention/{Path(str(e.get('file', ''))).name}" in sentences]
                note = _not_shown_note(index, len(held))
                if note:
                    index["not_shown"] = note  # the viewer says it (headlab.report.build), not "no data"
                content = json.dumps(index).encode("utf-8")
            if relative == _MANIFEST:  # its stages' outputs outside _HELD are on disk, not missing
                from headlab.report.collect import PARTIAL

                manifest = json.loads(content)
                if isinstance(manifest, dict):
                    content = json.dumps({**manifest, PARTIAL: [f"{group}/" for group in _HELD]}).encode("utf-8")
            (target / relative).parent.mkdir(parents=True, exist_ok=True)
            (target / relative).write_bytes(content)

    def _repr_html_(self) -> str:
        """In Jupyter: the report of this analysis (:meth:`report_html`) in a frame, as a base64
        ``data:`` URL, so that its styles and script stay inside it and its links work (a
        ``srcdoc`` frame resolves ``#section`` links against the notebook's address). Too large
        a report: the text summary and how to write the report."""
        import base64
        from html import escape

        try:
            page, shown = self._report_page()
        except HeadlabError as too_large:
            return f"<pre>{escape(repr(self))}</pre><p>{escape(str(too_large))}</p>"
        url = "data:text/html;base64," + base64.b64encode(page.encode("utf-8")).decode("ascii")
        title = escape(f"headlab report: {self.model or 'analysis'}", quote=True)
        try:
            total = int(json.loads(self.files["attention/index.json"])["sentences_in_directory"])
        except (KeyError, TypeError, ValueError):
            total = shown
        viewer = (f" The attention viewer shows {shown} of the {counted(total, 'example sentence')} (its section says why: a "
                  f"notebook output holds {PAGE_LIMIT / 1e6:.1f} MB at most); the analysis directory's own report "
                  "shows every one." if shown < total else "")
        return (f'<iframe src="{url}" title="{title}" style="width:100%;height:760px;border:1px solid #ccc"></iframe>'
                f'<div style="font-size:11px;color:#555">{escape(repr(self).splitlines()[0])}. The report of '
                "<code>headlab analyze</code>, self-contained (no network); "
                f"<code>analysis.save(directory, report=True)</code> writes it as index.html.{escape(viewer)}</div>")


def _missing_outputs(manifest: dict, files: Mapping[str, bytes], directory: Path) -> dict[str, str]:
    """``{stage: why}`` for each done stage of ``manifest`` whose files under :data:`_HELD` the
    directory lacks (deleted, or copied in part): its tables were left out without a word."""
    missing = {}
    for stage in manifest.get("stages", []) or []:
        outputs = stage.get("outputs") if isinstance(stage, dict) and stage.get("status") == "done" else None
        lost = [str(path) for path in outputs or [] if str(path).startswith(tuple(f"{g}/" for g in _HELD))
                and str(path) not in files and not (directory / str(path)).exists()]
        if lost and "name" in stage:
            missing[str(stage["name"])] = (f"recorded as done in manifest.json, but {', '.join(lost[:3])}"
                                           f"{f' (+{len(lost) - 3} more)' if len(lost) > 3 else ''} "
                                           f"{'is' if len(lost) == 1 else 'are'} missing from {directory}")
    return missing


def _not_shown_note(index: dict, n_held: int) -> str | None:
    """Why the viewer of the notebook's page lacks some of the directory's example sentences: not
    held by the Analysis (:data:`VIEWER_BYTES`), or dropped to fit the page (:data:`PAGE_LIMIT`)."""
    shown = len(index["sentences"])
    try:
        total = int(index.get("sentences_in_directory", n_held))
    except (TypeError, ValueError):
        total = n_held
    if shown >= total:
        return None
    reasons = []
    if n_held > shown:
        reasons.append(f"{n_held - shown} dropped, last first, to keep this page within the {PAGE_LIMIT / 1e6:.1f} MB "
                       "a notebook output holds")
    if total > n_held:
        first = index.get("first_not_held")
        size = ""
        if isinstance(first, dict) and isinstance(first.get("bytes"), int):
            size = (f" (the first of them, sentence {first.get('id')} of {first.get('tokens')} tokens, takes "
                    f"{first['bytes'] / 1e6:.2f} MB of attention data: a sentence's weight grows with layers x heads "
                    "x tokens squared)")
        reasons.append(f"{total - n_held} not held by the Analysis, whose viewer keeps at most "
                       f"{VIEWER_BYTES / 1e6:.1f} MB of attention data{size}")
    return (f"{total - shown} of the {counted(total, 'example sentence')} of this analysis are not shown in this notebook "
            f"view: {'; '.join(reasons)}. The analysis directory's own report shows every one "
            "(analysis.save(directory, report=True), then open its index.html).")


def _label_suffix(labels: Mapping[str, list[str]], key: tuple[str, int, int]) -> str:
    found = labels.get(":".join(map(str, key)), [])
    return f" ({', '.join(found)})" if found else ""


def _pandas() -> Any:
    try:
        import pandas
    except ImportError:
        raise HeadlabError("this needs pandas, which is not installed: pip install 'headlab[pandas]' "
                           "(or use Analysis.records() / heads_table(), which need nothing)") from None
    return pandas

