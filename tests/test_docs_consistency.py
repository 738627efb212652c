"""What the documentation quotes exists in the code today (session 42's audit, kept as a test).

Read mechanically from README.md, CONTRIBUTING.md, docs/*.md, the model cards, the data cards and
experiments/*.md, in code only (inline spans and fenced blocks):

* every ``headlab COMMAND ... --option`` and ``python -m reproduction --option``: the command is
  one of ``headlab --help``'s, each option is that command's under its current name (a renamed
  option's old name is refused: it goes in the next release, headlab.options.Renamed), and a
  value of an option with choices is one of them. A command goes through the CLI's own
  ``rewrite_argv`` first, so the older forms it keeps working (``prune MODEL``, ``nmt evaluate
  --model DIR``, which the model cards' generated score tables record) pass. A command of a
  fenced block continued over lines (``\\``) is read whole, and one written out in full (no
  placeholder) is parsed as the command line parses it: no required option left out, no value of
  the wrong type;
* every ``make TARGET`` is a target of the Makefile;
* every repository path (``tests/test_x.py``, ``experiments/foo.py``, ...) exists, and a cited
  test (``tests/test_x.py::test_y``) is defined in its file;
* every dotted name under ``headlab.`` or ``reproduction.`` imports or resolves to an attribute, and
  so does every name a snippet imports from them (``from headlab.report import build_report``).

Left out: docs/benchmarks.md (its dated sections quote the commands of their day) and
docs/results/ (recorded runs). Placeholders (``MODEL``, ``<model>``, ``...``) are not checked.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import re
import shlex
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

from headlab.options import Renamed

REPO = Path(__file__).resolve().parents[1]
HISTORICAL = ("docs/benchmarks.md",)
DOCUMENTS = [path for path in sorted([REPO / "README.md", REPO / "CONTRIBUTING.md", *(REPO / "docs").glob("*.md"),
                                      *(REPO / "models").glob("*/README.md"), *(REPO / "data").glob("*/README.md"),
                                      *(REPO / "experiments").glob("*.md")])
             if path.relative_to(REPO).as_posix() not in HISTORICAL]
IDS = [path.relative_to(REPO).as_posix() for path in DOCUMENTS]
# Placeholders and alternatives stand for values, not values: `MODEL`, `<model>`, `{a,b}`, `a|b`, `$X`, `...`.
PLACEHOLDER = re.compile(r"^[A-Z<\[{$]|[|*<>{}]|\.\.\.|…")
HEADLAB_COMMAND = r"(?:^|(?<=[\s/;&|(]))headlab\s+(\S.*)"  # `headlab` as a word, then its arguments
TOP_FOLDERS = "src|tests|experiments|benchmarks|examples|docs|models|data|reproduction"
# CONTRIBUTING.md's worked example registers modules a contributor would write; the example's code
# is tests/support/plugins.py (tests/test_plugins.py runs it), so its names resolve there.
WORKED_EXAMPLE = ("headlab.importance.out_norm.", "headlab.functions.first_token.", "headlab.report.first_token.")


def code_quotes(text: str) -> Iterator[tuple[int, str, bool]]:
    """``(line, code, fenced)`` for each line of a fenced block, a shell line continued with a
    backslash joined to the next ones into one line (numbered by its first), and each inline span
    of the prose (a span may wrap over lines)."""
    in_fence, prose, continued, first = False, [], "", 0
    for number, line in enumerate(text.splitlines(), 1):
        prose.append("" if in_fence or line.lstrip().startswith("```") else line)
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
            if continued:  # a block that ends on a backslash
                yield first, continued, True
            continued = ""
        elif in_fence:
            first = first if continued else number
            continued += line
            if line.rstrip().endswith("\\"):
                continued = continued.rstrip()[:-1] + " "
            else:
                yield first, continued, True
                continued = ""
    joined = "\n".join(prose)
    for span in re.finditer(r"`([^`]+)`", joined):
        yield joined.count("\n", 0, span.start()) + 1, span.group(1).replace("\n", " "), False


def shell_words(code: str) -> list[str]:
    """The words of one command: up to a pipe, a comment, a redirection or the next command."""
    code = re.split(r"\s(?:\||&&|>>?|2>|#)\s|;(?:\s|$)", re.sub(r"\\\n\s*", " ", code))[0]
    try:
        return shlex.split(code)
    except ValueError:  # an unbalanced quote in prose
        return code.split()


@cache
def headlab_parsers() -> dict[tuple[str, ...], argparse.ArgumentParser]:
    """Every (sub-)command's parser by its words, with the plug-ins' options added."""
    from headlab.cli import build_parser

    found: dict[tuple[str, ...], argparse.ArgumentParser] = {}

    def walk(parser: argparse.ArgumentParser, words: tuple[str, ...]) -> None:
        parser.format_help()  # a LateParser adds its plug-ins' options when first used
        found[words] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    walk(child, (*words, name))

    walk(build_parser(), ())
    return found


@cache
def rewrites():
    from headlab.cli import COMMAND_MODULES

    modules = [importlib.import_module(name) for name in COMMAND_MODULES]
    return [module.rewrite_argv for module in modules if hasattr(module, "rewrite_argv")]


def option_problems(parser: argparse.ArgumentParser, command: str, words: list[str]) -> list[str]:
    options = {string: action for action in parser._actions for string in action.option_strings}
    problems = []
    for i, word in enumerate(words):
        name, _, value = word.partition("=")
        if not re.fullmatch(r"--[a-z][a-z0-9-]*", name):
            continue
        action = options.get(name)
        if action is None:
            problems.append(f"{command}: no option {name}")
            continue
        if isinstance(action, Renamed) and name != action.option_strings[0]:
            problems.append(f"{command} {name}: an old name, use {action.option_strings[0]}")
        if not value and action.nargs is None and action.choices is not None and i + 1 < len(words):
            value = words[i + 1]
        if action.choices is not None and value and not PLACEHOLDER.search(value):
            if any(v not in action.choices for v in value.split(",")) and value not in action.choices:
                problems.append(f"{command} {name} {value}: not one of {sorted(action.choices)}")
    return problems


def command_problems(code: str) -> list[str]:
    """What is wrong with the ``headlab`` and ``python -m reproduction`` commands in one quote."""
    problems = []
    for found in re.finditer(HEADLAB_COMMAND, code):
        words = shell_words(found.group(1))
        if not words or words[0] == "reproduce":  # moved out; `headlab reproduce` says where (headlab.cli)
            continue
        starts_quote = found.start() == len(code) - len(code.lstrip())
        parsers = headlab_parsers()
        if (words[0],) not in parsers:
            if starts_quote and re.fullmatch(r"[a-z][a-z-]*", words[0]):
                problems.append(f"no command `headlab {words[0]}`")
            continue
        for rewrite in rewrites():
            words = rewrite(words)
        depth = 1
        while depth < len(words) and tuple(words[:depth + 1]) in parsers:
            depth += 1
        command = "headlab " + " ".join(words[:depth])
        problems += option_problems(parsers[tuple(words[:depth])], command, words[depth:])
    for found in re.finditer(r"python3? -m reproduction(\s.*|$)", code):
        from reproduction.cli import build_parser

        problems += option_problems(build_parser(), "python -m reproduction", shell_words(found.group(1)))
    return problems


def parse_problems(code: str) -> list[str]:
    """What argparse says of each ``headlab`` and ``python -m reproduction`` command of a fenced
    block written out in full (no placeholder; a message quoted from a run, ``headlab nmt train:
    interrupted ...``, is no command): a required option left out, a value of the wrong type, an
    argument too many. Exit 0 (``--help``) is fine."""
    from reproduction.cli import build_parser

    commands = [(headlab_parsers()[()], words) for words in headlab_commands(code)]
    commands += [(build_parser(), shell_words(found.group(1)))
                 for found in re.finditer(r"python3? -m reproduction(\s.*|$)", code)]
    problems = []
    for parser, words in commands:
        if any(PLACEHOLDER.search(word) or word.endswith(":") for word in words):
            continue
        said = io.StringIO()
        try:
            with contextlib.redirect_stderr(said), contextlib.redirect_stdout(io.StringIO()):
                parser.parse_args(words)
        except SystemExit as error:
            if error.code:
                problems.append(said.getvalue().strip().splitlines()[-1])
    return problems


def headlab_commands(code: str) -> Iterator[list[str]]:
    """The words after ``headlab`` of each command of one of its (sub-)commands in ``code``, after
    the CLI's own ``rewrite_argv``."""
    for found in re.finditer(HEADLAB_COMMAND, code):
        words = shell_words(found.group(1))
        if words and (words[0],) in headlab_parsers():
            for rewrite in rewrites():
                words = rewrite(words)
            yield words


def path_problems(code: str, document: Path) -> list[str]:
    problems = []
    for found in re.finditer(rf"(?<![\w./-])((?:{TOP_FOLDERS})/[\w./<>{{}}*-]*[\w>}}*])((?:::\w+)*)", code):
        path, tests = found.group(1), found.group(2)
        if PLACEHOLDER.search(path):  # tests/test_<name>.py
            continue
        # README's layout names the package's files from src/headlab/; a --set PREFIX names PREFIX.en.gz ...
        places = [REPO / path, document.parent / path, REPO / "src" / "headlab" / path]
        if not any(place.exists() or list(place.parent.glob(place.name + ".*")) for place in places):
            problems.append(f"no file or folder {path}")
            continue
        for name in re.findall(r"::(\w+)", tests):
            if not re.search(rf"^\s*(?:async\s+)?(?:def|class) {name}\b", (REPO / path).read_text(encoding="utf-8"), re.M):
                problems.append(f"{path} defines no {name}")
    return problems


def resolves(dotted: str) -> bool:
    """``headlab.a.b.C``: the longest importable module prefix, then attributes."""
    if dotted.startswith(WORKED_EXAMPLE):
        dotted = "support.plugins." + dotted.rsplit(".", 1)[1]
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:end]))
        except ImportError:
            continue
        for part in parts[end:]:
            if not hasattr(found, part):
                return False
            found = getattr(found, part)
        return True
    return False


def name_problems(code: str) -> list[str]:
    names = re.findall(r"(?<![\w./-])((?:headlab|reproduction)(?:\.[A-Za-z_]\w*)+)", code)
    imported = re.match(r"\s*from ((?:headlab|reproduction)[\w.]*) import ([\w, ]+)", code)  # a snippet's import line
    if imported:
        names += [f"{imported.group(1)}.{name.strip()}" for name in imported.group(2).split(",") if name.strip()]
    return [f"{name} does not resolve" for name in names
            if not name.endswith((".md", ".json", ".py")) and not resolves(name)]


def makefile_targets() -> set[str]:
    return set(re.findall(r"^([a-z][\w-]*):", (REPO / "Makefile").read_text(encoding="utf-8"), re.M))


@pytest.mark.parametrize("document", DOCUMENTS, ids=IDS)
def test_quoted_commands_options_paths_and_names_exist(document):
    targets = makefile_targets()
    problems = []
    for line, code, fenced in code_quotes(document.read_text(encoding="utf-8")):
        found = command_problems(code) + path_problems(code, document) + name_problems(code)
        found += parse_problems(code) if fenced else []  # inline spans name commands in part
        for make in re.finditer(r"^\s*make ([a-z][\w-]*)", code):
            if make.group(1) not in targets:
                found.append(f"no Makefile target {make.group(1)}")
        problems += [f"{document.relative_to(REPO)}:{line}: {problem}  [{code.strip()[:80]}]" for problem in found]
    assert not problems, "\n".join(problems)


def test_the_checks_catch_each_kind_of_drift():
    """Each check on a quote that drifted, and on its corrected form."""
    readme = REPO / "README.md"
    assert command_problems("headlab importance MODEL --sources x --out d") == ["headlab importance: no option --sources"]
    assert command_problems("headlab parse --model m --input t --out o") == [
        "headlab parse --input: an old name, use --source"]
    assert command_problems("headlab functions MODEL --engine fast --out d") == [
        "headlab functions --engine fast: not one of ['chunked', 'eager', 'fused', 'kernel']"]
    assert command_problems("headlab prunes MODEL") == ["no command `headlab prunes`"]  # a quote that starts so
    assert command_problems("python -m reproduction --stage report") == ["python -m reproduction: no option --stage"]
    for fine in ("headlab prune MODEL --heads SPEC --out DIR", "headlab nmt evaluate --model m --src s --ref r --beam 4",
                 "headlab functions MODEL --engine eager|chunked --out d", "so headlab refuses it", "headlab reproduce",
                 "python -m reproduction --stages importance,report --docs-only"):
        assert command_problems(fine) == [], fine
    assert path_problems("tests/test_layers.py::test_no_upward_import", readme) == []
    assert path_problems("tests/test_layers.py::test_upward_import", readme) == [
        "tests/test_layers.py defines no test_upward_import"]
    assert path_problems("experiments/no_such_script.py", readme) == ["no file or folder experiments/no_such_script.py"]
    fence = "```\nheadlab analyze MODEL --source s \\\n    --no-such-flag 1 --out d\n```\n"
    [(line, code, fenced)] = code_quotes(fence)  # the continued lines read as one command
    assert (line, fenced) == (2, True) and command_problems(code) == ["headlab analyze: no option --no-such-flag"]
    assert parse_problems("headlab nmt evaluate models/m --src s.en --ref r.de --beam four") == [
        "headlab nmt evaluate: error: argument --beam: invalid int value: 'four'"]
    assert parse_problems("headlab prune apply models/m --out d") == [
        "headlab prune apply: error: the following arguments are required: --heads"]
    assert parse_problems("python -m reproduction --models") == [
        "python -m reproduction: error: argument --models: expected one argument"]
    for fine in ("headlab nmt evaluate --model models/m --src s.en --ref r.de --beam 4", "headlab prune MODEL --out d",
                 "headlab heads --help", "headlab nmt train: interrupted; the last checkpoint in run is kept"):
        assert parse_problems(fine) == [], fine
    assert name_problems("headlab.attention.NAME and headlab.importance.run_importance") == []
    assert name_problems("headlab.attention.no_such_name") == ["headlab.attention.no_such_name does not resolve"]
    assert name_problems("from headlab.report import build_report, load_example  # the API") == []
    assert name_problems("from headlab.report import build_report, no_such_name") == [
        "headlab.report.no_such_name does not resolve"]
