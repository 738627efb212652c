"""Command-line options generated from the config dataclasses, so that each default is written
once, in the dataclass. A field becomes ``--field-name`` (or ``--FLAG`` with ``flag`` in its
metadata) with the field's default, its ``help`` and any other argparse keyword of its metadata
(``choices``, ``metavar``, ``nargs``); :func:`from_args` reads the parsed values back into the
dataclass. Importing this module costs no torch (the commands register their options at start-up).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import inspect
import math
import sys
from dataclasses import MISSING, field, fields
from numbers import Integral
from typing import Any, Callable, Iterable, Sequence, TypeVar

from headlab.compiled import model_entry
from headlab.errors import HeadlabError, UnknownOption

_TYPES = {"int": int, "float": float, "str": str}
# metadata read here, not handed to argparse
_OWN_KEYS = ("flag", "positional", "range", "old_names", "signed", "omit_default", "command_line")


class Renamed(argparse.Action):
    """A stored option with its current name first and its old names after it (kept for one
    release): they still work, hidden from the help, with a one-line deprecation note on stderr.
    One name per concept in every command: ``--source`` for a text file of sentences, ``--conllu``
    for a treebank, ``--limit`` for "the first N sentences" (docs/cli.md)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if option_string is not None and option_string != self.option_strings[0]:
            print(f"headlab: {option_string} is deprecated, use {self.option_strings[0]} (the old name goes in the "
                  "next release)", file=sys.stderr)
        setattr(namespace, self.dest, values)


def renamed(parser: Any, name: str, *old_names: str, **keywords: Any) -> argparse.Action:
    """``parser.add_argument(name, ...)`` that also accepts ``old_names`` (see :class:`Renamed`)."""
    return parser.add_argument(name, *old_names, action=Renamed, **keywords)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's "(default: X)" after an option's help, only where it tells something: not when the
    help already says its default in words ("default: the model's maximum"), nor for None, False,
    an empty list or a suppressed default (a flag, or an option whose absence means "not asked for")."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if isinstance(action, Renamed):  # old names stay out of the help
            action = argparse.Action([action.option_strings[0]], action.dest, nargs=action.nargs,
                                     metavar=action.metavar, help=action.help)
        return super()._format_action_invocation(action)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        # By identity: `0 in (False, ...)` is true, and "(default: 0)" (often "off") tells something.
        silent = default is None or default is False or default is argparse.SUPPRESS or default in ([], ())
        if "default" in text.lower() or silent:
            return text
        return super()._get_help_string(action)


def option(default: Any = MISSING, help: str = "", **argparse_keywords: Any) -> Any:
    """A dataclass field with its default, its command-line help and its argparse keywords."""
    return field(default=default, metadata={"help": help, **argparse_keywords})


def model_flag_to_positional(argv: list[str], command: tuple[str, ...]) -> list[str]:
    """``COMMAND ... --model DIR ...`` -> ``COMMAND DIR ...``: the older form of a command that now
    takes its model as its first positional argument, as the other commands do (``rewrite_argv``
    of its module, before parsing). Global options (``--debug``) may come before ``COMMAND``."""
    at = next((i for i, arg in enumerate(argv) if not arg.startswith("-")), len(argv))
    if tuple(argv[at:at + len(command)]) != command:
        return argv
    head, rest = argv[:at + len(command)], argv[at + len(command):]
    for i, arg in enumerate(rest):
        if arg == "--":
            break
        if arg == "--model" and i + 1 < len(rest):
            return [*head, rest[i + 1], *rest[:i], *rest[i + 2:]]
        if arg.startswith("--model="):
            return [*head, arg[len("--model="):], *rest[:i], *rest[i + 1:]]
    return argv


def comma_list(text: str, flag: str) -> tuple[str, ...]:
    """A comma list of names (``"nsubj, amod"``), each stripped. An empty one (``","``, ``""``)
    is an error naming ``flag``: it would otherwise pass for the option's default."""
    items = tuple(x.strip() for x in text.split(",") if x.strip())
    if not items:
        raise HeadlabError(f"{flag} {text!r}: an empty list; give one or more comma-separated values")
    return items


def numbers(text: str, kind: type = int, flag: str | None = None) -> tuple:
    """A comma list of numbers (``"24, 12,6"``); anything else, or none (``","``), is an error
    naming the text (and ``flag``, the option that gave it)."""
    where = f"{flag} {text}: " if flag else ""
    kind_name = "integers" if kind is int else "numbers"
    try:
        values = tuple(kind(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError as error:
        raise HeadlabError(f"{where}cannot read a list of {kind_name} from {text!r}") from error
    if not values:
        raise HeadlabError(f"{where}an empty list; give one or more comma-separated {kind_name}")
    return values


def _bounds(interval: str) -> tuple[float, bool, float, bool]:
    """``"[0, 1)"`` -> ``(0.0, True, 1.0, False)``: low, low included, high, high included."""
    low, high = interval[1:-1].split(",")
    return float(low), interval[0] == "[", float(high), interval[-1] == "]"


def _describe(interval: str) -> str:
    low, low_in, high, high_in = _bounds(interval)
    if math.isinf(high):
        return f"at least {low:g}" if low_in else f"> {low:g}"  # "at least": preflight.at_least's words
    return f"in {interval}"


def range_error(value: Any, interval: str | None, flag: str) -> str | None:
    """Why ``value`` of option ``flag`` is outside ``interval`` (``"[0, 1)"``, ``"(0, inf)"``, a
    bound ``inf`` being open), or None when it is inside. NaN is outside every range, and an
    infinity outside every range that does not reach it."""
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if math.isnan(value):
        return f"{flag} must be a number{f' {_describe(interval)}' if interval else ''}, got nan"
    low, low_in, high, high_in = _bounds(interval) if interval else (-math.inf, False, math.inf, False)
    inside = (low < value or (low_in and low == value)) and (value < high or (high_in and high == value))
    if not inside:
        return f"{flag} must be {_describe(interval)}, got {value}" if interval else f"{flag} must be finite, got {value}"
    return None


RANGES = "_option_ranges"
"""The parsed arguments' table of the options with a declared range: ``{dest: (range, flag)}``."""


def check_parsed(args: argparse.Namespace) -> None:
    """Every option of ``args`` added by :func:`add_options` inside its declared range (floats:
    finite); the CLI calls it right after parsing, so the error (exit 2) comes before any work."""
    for dest, (interval, flag) in sorted(getattr(args, RANGES, {}).items()):
        error = range_error(getattr(args, dest, None), interval, flag)
        if error is not None:
            raise HeadlabError(error)


def check_ranges(config: Any) -> None:
    """Every field of the dataclass instance ``config`` that declares a ``range`` is inside it (a
    config built in Python, not through the command line); the error names the option."""
    for f in fields(config):
        interval = f.metadata.get("range")
        kind = str(getattr(f.type, "__name__", f.type)).replace(" | None", "")
        if interval is not None or kind == "float":
            value, flag = getattr(config, f.name), "--" + _dest(f).replace("_", "-")
            error = count_error(value, interval, flag) if kind == "int" else range_error(value, interval, flag)
            if error is not None:
                raise HeadlabError(error)


def count_error(value: Any, interval: str | None, name: str) -> str | None:
    """:func:`range_error` for a whole number: also why ``value`` is not one. range_error skips what
    is not a number, and a float (``lrp_targets=1.5``, ``limit=1.5``) or ``True`` for a count passed
    and failed deep in the work as a raw TypeError, was taken as a slice, or as 1. ``name``: the
    option (``--batch-size``) or the argument (``importance: limit``) as its caller spells it."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, Integral)):
        return f"{name} must be a whole number{f' {_describe(interval)}' if interval else ''}, got {value!r}"
    return range_error(value, interval, name)


def help_of(config: Any, name: str) -> str:
    """The help of field ``name`` of the dataclass ``config`` (for an option written by hand)."""
    return next(f.metadata.get("help", "") for f in fields(config) if f.name == name)


def _dest(f: dataclasses.Field) -> str:
    return f.metadata.get("flag", f.name).replace("-", "_")


def add_options(parser: Any, config: Any, names: Sequence[str]) -> None:
    """Add an option to ``parser`` (a parser or an argument group) for each field of ``names`` of
    the dataclass ``config``, in that order. ``config`` may be an instance: its values are then
    the defaults (a recipe that trains differently from the loop's own defaults)."""
    by_name = {f.name: f for f in fields(config)}
    for name in names:
        f = by_name[name]
        if not isinstance(config, type):
            default = getattr(config, name)
        else:
            default = f.default if f.default_factory is MISSING else f.default_factory()
        keywords = {k: v for k, v in f.metadata.items() if k not in _OWN_KEYS}
        if f.metadata.get("positional"):
            parser.add_argument(name, **keywords)
            continue
        kind = str(getattr(f.type, "__name__", f.type)).replace(" | None", "")
        if kind == "bool" and default is False:
            keywords["action"] = "store_true"
        elif kind in _TYPES:
            keywords.setdefault("type", _TYPES[kind])
        if f.metadata.get("range") or kind == "float":  # checked after parsing (check_parsed)
            ranges = {**(parser.get_default(RANGES) or {}),
                      _dest(f): (f.metadata.get("range"), "--" + _dest(f).replace("_", "-"))}
            parser.set_defaults(**{RANGES: ranges})
        elif not {"nargs", "action", "type"} & set(keywords):
            raise TypeError(f"{config.__name__ if isinstance(config, type) else type(config).__name__}.{name}: "
                            f"no command-line form for {kind}; give it nargs, action or type metadata")
        if default is MISSING:
            keywords["required"] = True
        elif "action" not in keywords and not keywords.get("required"):
            keywords["default"] = default
        old_names = f.metadata.get("old_names", ())
        if old_names:
            keywords["action"] = Renamed
        parser.add_argument("--" + _dest(f).replace("_", "-"), *old_names, **keywords)


def from_args(args: argparse.Namespace, config: Any, **values: Any) -> Any:
    """The dataclass ``config`` (a class, or an instance whose values are the defaults) with every
    field that ``args`` holds an option for, and ``values`` on top."""
    present = {f.name: getattr(args, _dest(f)) for f in fields(config) if hasattr(args, _dest(f))}
    present.update(values)
    if isinstance(config, type):
        return config(**present)
    return dataclasses.replace(config, **present)


F = TypeVar("F", bound=Callable[..., Any])


def checked_keywords(options: Callable[[], Iterable[str]] | None = None) -> Callable[[F], F]:
    """Decorator of the Python API's functions: a keyword they do not take is an
    :class:`~headlab.errors.UnknownOption` naming it and the closest names they take, as the
    command line names a misspelt flag, raised before any work (Python's own TypeError named no
    alternative; a keyword passed on through ``**options`` failed in a config's ``__init__``, after
    some of the work). ``options``: the names that ``**options`` takes, read at the call (their
    config is imported then, not with the API). The signature stays the function's
    (``functools.wraps``: ``inspect.signature`` and ``help`` show its parameters).
    Also the entry of a model compiled with ``torch.compile`` (:func:`headlab.compiled.model_entry`): the function's
    ``model`` argument, an ``OptimizedModule``, becomes the model it wraps, and the call runs eagerly."""

    def decorate(function: F) -> F:
        parameters = inspect.signature(function).parameters.values()
        if options is None and any(p.kind == p.VAR_KEYWORD for p in parameters):
            raise TypeError(f"{function.__qualname__} takes **keywords: give checked_keywords the names they take")
        named = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}

        @functools.wraps(function)
        def checked(*args: Any, **keywords: Any) -> Any:
            unknown = [k for k in keywords if k not in named]
            if unknown:
                known = named | set(options() if options is not None else ())
                unknown = [k for k in unknown if k not in known]
                if unknown:
                    raise _unknown(function.__qualname__, unknown[0], known)
            return entry(*args, **keywords)

        entry = model_entry(function)
        return checked  # type: ignore[return-value]

    return decorate


def _unknown(function: str, keyword: str, known: set[str]) -> UnknownOption:
    close = difflib.get_close_matches(keyword, sorted(known), n=3)
    hint = (f"did you mean {' or '.join(map(repr, close))}?" if close else
            f"it takes {', '.join(sorted(known))}")
    return UnknownOption(f"{function}(): unknown option {keyword!r}; {hint}")
