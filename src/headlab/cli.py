"""Command-line interface: parse arguments, call the library, print. No logic lives here.

Each feature registers its own subcommands through a ``register(subparsers)`` function in
its package (``headlab.nmt.cli`` and so on); this module only collects them.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from headlab.errors import HeadlabError

# Modules that add subcommands, in the order they appear in ``headlab --help``.
COMMAND_MODULES = (
    "headlab.commands",
    "headlab.nmt.cli",
    "headlab.lm.cli",
    "headlab.importance.cli",
    "headlab.functions.cli",
    "headlab.pruning.cli",
    "headlab.analyze.cli",
    "headlab.reproduce.cli",
    "headlab.demo",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="headlab",
        description="Which attention heads matter, what they do, and how to prune the rest.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # A command module may define rewrite_argv(argv) -> argv to keep an older command form
    # working (headlab.pruning.cli: `prune MODEL ...` -> `prune apply MODEL ...`).
    for name in COMMAND_MODULES:
        rewrite = getattr(importlib.import_module(name), "rewrite_argv", None)
        if rewrite is not None:
            argv = rewrite(argv)
    args = parser.parse_args(argv)
    try:
        result = args.func(args)
    except (HeadlabError, ValueError, FileNotFoundError, FileExistsError, KeyError) as error:
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        print(f"headlab {args.command}: error: {message}", file=sys.stderr)
        return 2
    return int(result or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
