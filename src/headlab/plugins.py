"""What a plug-in declares, and the generic machinery that reads the declarations.

An importance measure (:class:`headlab.importance.measure.ImportanceMeasure`), a head statistic
(:class:`Statistic`, here: below the packages that define statistics) and a report section
(:class:`headlab.report.sections.Section`) each declare, in their own module:

* their options: one frozen dataclass whose fields carry their help, ``range`` (checked before any
  work), ``choices``, ``metavar`` and, where the flag is not ``--<prefix>-<field>``, ``flag`` in their
  metadata (:func:`headlab.options.option`). :func:`option_specs` turns it into the command line's
  flags (``headlab importance`` and ``headlab analyze`` add them with :func:`add_plugin_options`), the
  values of a config (:class:`PluginOptions`), the scores' signature and the stage keys of ``analyze``
  (a field with ``signed=False`` in its metadata changes no number and is left out of both; one with
  ``omit_default=True`` came after results were published and is left out of ``summary.json`` at its
  default; one with ``command_line=False`` is a keyword of the configs and part of ``summary.json``
  but no flag); several plug-ins may declare one flag alike (one option, one value);
* their output files with titles (:class:`Output`), which the report draws, and what else the
  report shows of them (:class:`ReportPart`: their own tables and charts, drawn in their own module);
* their label group (statistics: the ``heads.csv`` column and Figure 1 row their labels go to, how
  Figure 1 names and writes them) and what they add to a model's profile (:class:`ProfilePart`);
* what they need from a run (measures: capability flags; statistics: the pass that feeds them).

The registries are :class:`~headlab._lazy.LazyRegistry` objects;
:meth:`~headlab._lazy.LazyRegistry.registered` adds an entry for the length of a ``with`` block (a
test's plug-in). Importing this module costs no torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any, NoReturn

from headlab.errors import HeadlabError
from headlab.options import Renamed, add_options, check_ranges

__all__ = ["Output", "Figure", "ReportPart", "ProfilePart", "read_result",
           "OptionSpec", "Statistic", "PASSES", "WRITTEN_UNDER", "LabelReader", "option_specs",
           "option_table", "add_plugin_options", "values_from_args", "build_options", "check_values", "PluginOptions",
           "plugin_options", "defer", "LateParser"]


@dataclass(frozen=True)
class Figure:
    """An :class:`Output` that ``headlab analyze``'s figures stage also draws as a figure of its own:
    ``figures/<name>.png`` and ``.svg``, a layer x head heatmap per attention kind. Each text may
    name ``{stem}``, the file's name without ``.json``, and ``{label}``, the stem with spaces for
    underscores."""

    name: str
    """The figure's file name without its suffix (``aggregate_{stem}``)."""
    title: str
    """Its title in the manifest and the report."""
    caption: str
    heading: str = "{label}"
    """The title drawn above the heatmap."""

    def texts(self, stem: str) -> tuple[str, str, str, str]:
        """``(name, title, caption, heading)`` of the file ``<stem>.json``."""
        words = {"stem": stem, "label": stem.replace("_", " ")}
        return (self.name.format(**words), self.title.format(**words), self.caption.format(**words),
                self.heading.format(**words))


@dataclass(frozen=True)
class Output:
    """One file (or, with ``*`` in ``path``, a family of files) of HeadScores that a plug-in writes
    and the report draws as a heatmap. ``path`` is relative to the directory its stage writes under;
    ``title`` and ``caption`` may name ``{stem}``, the file's name without ``.json`` (a family);
    ``group`` is the report's group of the map (default: the first folder of its path in the
    analysis directory); ``categorical``: its values are categories (an offset), one colour each."""

    path: str
    title: str
    caption: str = ""
    group: str | None = None
    categorical: bool = False
    figure: Figure | None = None
    """Also drawn as a figure of its own (a family: one per file)."""


@dataclass(frozen=True)
class ReportPart:
    """HTML that a plug-in adds to a report section, drawn from its own files by its own module
    (:attr:`Statistic.report`, :attr:`headlab.importance.measure.ImportanceMeasure.report`); the
    section is one that draws heatmaps (``functions``, ``aggregate``, ``importance``). The pieces
    of HTML it may share with the report are in :mod:`headlab.markup`."""

    name: str
    """Its key: what ``collect`` read is ``Collected.sections[name]``."""
    section: str
    """The id of the report section it goes in."""
    render: Callable[[Any], str]
    """``render(collected: headlab.report.collect.Collected) -> HTML`` ("" for nothing); escape what
    the directory gave."""
    before: bool = False
    """Above the section's heatmaps (else below them, after the section's own tables)."""
    collect: Callable[[Path, Callable[[str], None]], Any] | None = None
    """What it reads from the analysis directory: ``collect(directory, note)``; never raises:
    ``note(text)`` shows a problem in its section."""
    embed: str | None = None
    """The key under which what it read is also handed to the page's script (``exemplars``)."""


def read_result(path: Path) -> Any:
    """A result file's JSON content, as the model profiles read it: a missing file is an error
    that names it and the command that writes it."""
    if not path.is_file():
        raise HeadlabError(f"{path}: missing; run headlab analyze (functions and aggregate stages) first")
    return json.loads(path.read_text(encoding="utf-8"))


@dataclass(frozen=True)
class ProfilePart:
    """What a statistic adds to a model's profile (:mod:`headlab.pipeline.profiles`: the few numbers
    docs/functions.md compares across models), read from its own files and written as markdown by
    its own module (:attr:`Statistic.profile`). The profile's consumers name no statistic: they join
    the parts in registry order. The markdown pieces it may share are in :mod:`headlab.markup`."""

    collect: Callable[[Path, str], dict[str, Any]]
    """``collect(directory, kind) -> {key: value}``: its entries in the profile of the attention
    kind ``kind`` (``profile["kinds"][kind]``), from its files under ``directory`` (where its pass
    wrote, :data:`WRITTEN_UNDER`), read with :func:`read_result`."""
    columns: tuple[str, ...] = ()
    """Its columns of the overview table (one row per model and kind)."""
    cells: Callable[[str, dict[str, Any]], list[str]] | None = None
    """``cells(kind, entries) -> [markdown]``, one per column; ``entries``: ``profile["kinds"][kind]``
    (every part's entries, its own among them)."""
    table: Callable[[Mapping[str, dict[str, Any]]], list[str]] | None = None
    """``table(profile["kinds"]) -> [markdown line]``: a table of its own under each model's heading."""

    def __post_init__(self) -> None:
        if bool(self.columns) != (self.cells is not None):
            raise ValueError("a profile part declares its overview columns and their cells together")


@dataclass(frozen=True)
class OptionSpec:
    """One option of a plug-in as configs and the command line see it."""

    dest: str  # the flag without dashes and the config's keyword: ``lrp_targets`` (--lrp-targets)
    owner: str  # the plug-in's registry name
    name: str  # the field of the plug-in's options dataclass: ``targets``
    field: dataclasses.Field[Any]
    signed: bool  # part of the scores' signature and of the stage key (it changes the numbers)

    @property
    def default(self) -> object:
        if self.field.default is not MISSING:
            return self.field.default
        if self.field.default_factory is not MISSING:
            return self.field.default_factory()
        raise TypeError(f"option {self.dest} of {self.owner} has no default")


def option_specs(owner: str, options: type, prefix: str = "") -> list[OptionSpec]:
    """The options of a plug-in's dataclass ``options``: field ``x`` is ``--<prefix>x`` unless its
    metadata names its ``flag`` (then shared with any other option or config field of that name)."""
    return [OptionSpec(f.metadata.get("flag", prefix + f.name).replace("-", "_"), owner, f.name, f,
                       bool(f.metadata.get("signed", True))) for f in fields(options)]


def option_table(specs: list[OptionSpec], name: str = "PluginOptionTable") -> type:
    """A dataclass with one field per distinct ``dest`` of ``specs``: what
    :func:`headlab.options.add_options` and :func:`headlab.options.check_ranges` read. Plug-ins
    that declare one flag (``--sensitivity``) share it, one value for all; they must declare it
    alike (type, default, help, range, ...), else the flag would mean what the first one says."""
    seen: dict[str, OptionSpec] = {}
    for spec in specs:
        first = seen.setdefault(spec.dest, spec)
        if _declared(first) != _declared(spec):
            raise ValueError(f"--{spec.dest.replace('_', '-')} is declared differently by {first.owner} and "
                             f"{spec.owner}: plug-ins that share a flag declare it alike (type, default, help, range)")
    columns = []
    for dest, spec in seen.items():
        metadata = {k: v for k, v in spec.field.metadata.items() if k not in ("flag", "signed")}
        columns.append((dest, spec.field.type, dataclasses.field(default=spec.default, metadata=metadata)))
    return dataclasses.make_dataclass(name, columns, frozen=True)


def _declared(spec: OptionSpec) -> tuple[str, object, dict[str, Any]]:
    """What a declaration of a flag says (its type by name: a module may postpone annotations)."""
    return str(getattr(spec.field.type, "__name__", spec.field.type)), spec.default, dict(spec.field.metadata)


def add_plugin_options(parser: Any, specs: list[OptionSpec], skip: tuple[str, ...] = ()) -> None:
    """A flag for each option of ``specs`` whose dest is not in ``skip`` (a flag the command declares
    itself, such as ``--query-chunk``) and that is meant for the command line (not ``command_line=False``)."""
    table = option_table([s for s in specs if s.dest not in skip and s.field.metadata.get("command_line", True)])
    add_options(parser, table, [f.name for f in fields(table)])


def values_from_args(args: argparse.Namespace, specs: list[OptionSpec]) -> dict[str, object]:
    """``{dest: value}`` of the options of ``specs`` that the parsed ``args`` hold."""
    return {s.dest: getattr(args, s.dest) for s in specs if hasattr(args, s.dest)}


def build_options(options: type, specs: list[OptionSpec], values: Mapping[str, object]) -> Any:
    """The plug-in's options dataclass from ``{dest: value}`` (missing dests: the field's default)."""
    return options(**{s.name: values[s.dest] for s in specs if s.dest in values})


def check_values(specs: list[OptionSpec], values: Mapping[str, object]) -> None:
    """Every value of ``values`` is a known option of ``specs`` and inside its declared range."""
    known = {s.dest for s in specs}
    unknown = sorted(set(values) - known)
    if unknown:
        raise HeadlabError(f"unknown option {', '.join(unknown)}; the plug-ins declare {', '.join(sorted(known))}")
    check_ranges(option_table(specs)(**{k: v for k, v in values.items()}))


class PluginOptions:
    """A config dataclass whose plug-ins' options are keywords too: ``ImportanceConfig(lrp_targets=4)``
    keeps ``lrp_targets`` in its ``options`` dict (a field), and ``config.lrp_targets`` reads it back,
    or the option's declared default. A subclass defines :meth:`plugin_specs` and a field ``options``."""

    options: dict[str, object]

    @classmethod
    def plugin_specs(cls) -> list[OptionSpec]:
        raise NotImplementedError

    @classmethod
    def with_options(cls, init: Callable[..., None]) -> Callable[..., None]:
        def __init__(self: PluginOptions, *args: Any, options: Mapping[str, object] | None = None,
                     **keywords: Any) -> None:
            own = {f.name for f in fields(self)}  # type: ignore[arg-type]
            extra = {k: keywords.pop(k) for k in list(keywords) if k not in own}
            if extra:
                known = {s.dest for s in type(self).plugin_specs()}
                unknown = sorted(set(extra) - known)
                if unknown:
                    raise TypeError(f"{type(self).__name__}() got an unexpected keyword argument {unknown[0]!r}")
            init(self, *args, options={**(options or {}), **extra}, **keywords)
        return __init__

    def __getattr__(self, name: str) -> object:
        if name.startswith("__") or name == "options":
            raise AttributeError(name)
        for spec in type(self).plugin_specs():
            if spec.dest == name:
                return self.__dict__.get("options", {}).get(name, spec.default)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def option_values(self) -> dict[str, object]:
        """Every plug-in option's value, given or default, by dest (first spec of a dest wins)."""
        values: dict[str, object] = {}
        for spec in type(self).plugin_specs():
            values.setdefault(spec.dest, self.options.get(spec.dest, spec.default))
        return values


def plugin_options(cls: type) -> type:
    """Class decorator (after ``@dataclass``): the ``__init__`` of :class:`PluginOptions`."""
    cls.__init__ = PluginOptions.with_options(cls.__init__)  # type: ignore[misc]
    return cls


PASSES = ("functions", "aggregate")
"""The passes of ``headlab analyze`` that feed statistics, each a stage: a statistic of the
``functions`` pass runs when ``AnalysisConfig.functions`` is set, one of ``aggregate`` when
``AnalysisConfig.aggregate`` is."""

WRITTEN_UNDER = {"functions": "functions", "aggregate": ""}
"""Where ``headlab analyze`` writes each pass's results (``result.write(DIR / here)``), relative to
the analysis directory: the functions in ``functions/<its folder>``, the aggregate statistics in
``<its folder>`` (``aggregate/``)."""

LabelReader = Callable[[Path], Any]
"""The report's reader of a JSON file: its content, or None when missing or unreadable (noted)."""


@dataclass(frozen=True)
class Statistic:
    """A statistic's declaration, its registry entry: ``STATISTICS[name](config, frequencies)``
    builds it (``make`` returns None when the configuration does not ask for it)."""

    make: Callable[..., Any]
    """``(config: AnalysisConfig, frequencies: TokenFrequencies | None) -> HeadStatistic | None``
    (:class:`headlab.functions.statistic.HeadStatistic`)."""
    stage: str = "functions"
    """The pass of :data:`PASSES` that feeds it (and the ``analyze`` stage that writes it)."""
    title: str = ""
    """What it finds, in the words of ``analyze``'s messages ("rare-token heads"); "": a variant
    of another statistic, not named in them."""
    needs: tuple[str, ...] = ()
    """What it needs beyond the treebank: ``"frequencies"`` (token frequencies of the training text)."""
    label_group: str | None = None
    """The ``heads.csv`` column and Figure 1 row of its labels (None: it labels no head)."""
    label_pattern: str = ""
    """A regular expression that each of its labels matches in full: how ``heads.csv``, built from
    ``labels.json``, knows a label's group."""
    label_caption: str = ""
    """How Figure 1's caption names its labels (``positional (offset)``); "": not named."""
    label_cell: Callable[[str], str] | None = None
    """One of its labels as a cell of Figure 1's grid writes it (``positional -1`` -> ``-1``); None: as it is."""
    outputs: tuple[Output, ...] = ()
    """Its HeadScores files that the report draws, relative to where its pass writes (:data:`WRITTEN_UNDER`)."""
    report: tuple[ReportPart, ...] = ()
    """What else the report shows of it, drawn by its own module (Table 1, the per-layer curves)."""
    profile: ProfilePart | None = None
    """What it adds to a model's profile (the tables of docs/functions.md)."""
    read_labels: Callable[[Path, LabelReader], dict[str, list[str]]] | None = None
    """Its labels read back from its files (``directory``: where its pass wrote), for a directory
    without ``labels.json``; ``{"kind:layer:head": [label]}``."""
    Options: type | None = None
    """A frozen dataclass of its own options, as a measure's (:func:`option_specs`, flags
    ``--<option_prefix><field>`` of ``headlab functions``/``aggregate`` and ``analyze``); ``make``
    then takes them as a third argument."""
    option_prefix: str = ""
    """The prefix of its options' flags and keywords, its registry name and ``_`` by convention."""
    original_numbering: bool = False
    """Its result defines ``renumbered(numbering) -> result`` (:data:`headlab.heads.Numbering`): the
    same result with a physically pruned model's heads by their original index, as the importance
    scores name them. A statistic without it is refused, before any work, on a model whose kept
    heads are not ``0..n-1`` of some layer (its table would name other heads than ``heads.csv``'s)."""

    def __post_init__(self) -> None:
        if self.stage not in PASSES:
            raise ValueError(f"a statistic's stage is one of {', '.join(PASSES)}, got {self.stage!r}")
        if self.label_group is not None and not self.label_pattern:
            raise ValueError(f"label group {self.label_group!r}: declare the label_pattern its labels match")

    def __call__(self, config: Any, frequencies: Any = None) -> Any:
        if not getattr(config, self.stage, False):
            return None
        if self.Options is None:
            return self.make(config, frequencies)
        return self.make(config, frequencies, self.options_from(
            {s.dest: getattr(config, s.dest) for s in self.option_specs() if hasattr(config, s.dest)}))

    def options_from(self, values: Mapping[str, object]) -> Any:
        """Its options dataclass from ``{dest: value}`` (missing: the defaults); its checks run."""
        return None if self.Options is None else build_options(self.Options, self.option_specs(), values)

    def option_specs(self) -> list[OptionSpec]:
        return [] if self.Options is None else option_specs(self.option_prefix.rstrip("_") or "statistic",
                                                            self.Options, self.option_prefix)

    def owns(self, label: str) -> bool:
        """Whether ``label`` is one of its labels."""
        return self.label_group is not None and re.fullmatch(self.label_pattern, label) is not None


class LateParser(argparse.ArgumentParser):
    """A sub-command's parser whose plug-in flags are added when it is first used (parsing or its
    help), not when ``headlab --help`` lists the commands: declaring them imports the plug-ins,
    and with them torch."""

    def __init__(self, *args: Any, **keywords: Any) -> None:
        super().__init__(*args, **keywords)
        self._late: list[Callable[[argparse.ArgumentParser], None]] = []
        self.unrecognized: list[str] = []

    def _add_late(self) -> None:
        while self._late:
            self._late.pop(0)(self)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._add_late()
        namespace, extras = super().parse_known_args(args, namespace)
        self.unrecognized = list(extras)  # its own and its sub-commands' (headlab.cli tells them from headlab's)
        return namespace, extras

    def format_help(self) -> str:
        self._add_late()
        return super().format_help()

    def format_usage(self) -> str:
        self._add_late()
        return super().format_usage()

    def error(self, message: str) -> NoReturn:
        # argparse names an option by all its strings (`--source/--data`); a renamed option's old
        # names stay hidden (headlab.options.Renamed), in its messages as in the help.
        for action in self._actions:
            if isinstance(action, Renamed) and len(action.option_strings) > 1:
                message = message.replace("/".join(action.option_strings), action.option_strings[0])
        super().error(message)


def defer(parser: argparse.ArgumentParser, add: Callable[[argparse.ArgumentParser], None]) -> None:
    """Run ``add(parser)`` when ``parser`` is first used (a :class:`LateParser`), else now."""
    if isinstance(parser, LateParser):
        parser._late.append(add)
    else:
        add(parser)
