"""Command-line interface: parse arguments, call the library, print. No logic lives here.

Each feature registers its own subcommands through a ``register(subparsers)`` function in
its package (``headlab.nmt.cli`` and so on); this module only collects them and keeps the
contract of docs/cli.md: exit 0 done, 1 a failure while running, 2 bad input or usage, 130
interrupted; a one-line message for the user's errors, a traceback for headlab's own bugs.

A command may say what an interruption keeps with ``set_defaults(interrupted="...")``, a
format string over its arguments (``{out}``), and with ``interrupted_if`` the paths that must exist
for that to be true (:func:`interrupted_note`); the default says that nothing was kept.
"""

from __future__ import annotations

import argparse
import errno
import glob
import importlib
import logging
import os
import re
import signal
import sys
import threading
import traceback

from headlab._version import __version__
from headlab.errors import HeadlabError, Terminated
from headlab.options import check_parsed
from headlab.plugins import LateParser
from headlab.shard import LAUNCHER, watch_launcher

# Modules that add subcommands, in the order they appear in ``headlab --help``.
COMMAND_MODULES = (
    "headlab.commands",
    "headlab.nmt.cli",
    "headlab.lm.cli",
    "headlab.importance.cli",
    "headlab.functions.cli",
    "headlab.parse.cli",
    "headlab.pruning.cli",
    "headlab.pipeline.cli",
    "headlab.demo",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="headlab",
        description="Which attention heads matter, what they do, and how to prune the rest.",
    )
    parser.add_argument("--version", action="version", version=f"headlab {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="print the full traceback of any error (for reporting a bug)")
    # A command's plug-in flags are added when it is used, not for `headlab --help` (headlab.plugins).
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=LateParser)
    subparsers.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


STARTUP_INTERRUPTED = "headlab: interrupted while starting; nothing was done"

# The paper's reproduction left the package (issue 33): `headlab reproduce`, no longer in --help, says where it went.
REPRODUCE_MOVED = ("headlab reproduce: the reproduction of Voita et al. 2019 is no longer part of the headlab package; "
                   "run `python -m reproduction` (same options) from the root of a headlab checkout "
                   "(docs/reproduction.md)")


class _Notes(logging.Handler):
    """headlab's INFO notes (which engine or path a model or statistic fell back to, and why) on the
    current sys.stderr; Python's default shows only warnings, so the CLI would keep them from its user."""

    def emit(self, record: logging.LogRecord) -> None:
        print(f"headlab: {self.format(record)}", file=sys.stderr)


def _show_notes() -> None:
    logger = logging.getLogger("headlab")
    if not any(isinstance(handler, _Notes) for handler in logger.handlers):
        logger.addHandler(_Notes(logging.INFO))
        logger.setLevel(logging.INFO)


_TERMINATED: list[int] = []  # SIGTERM received: the interruption exits 143 (128 + 15), not 130


def _terminate(number: int, frame: object) -> None:
    _TERMINATED.append(number)
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    _show_notes()
    watch_launcher()  # one of --num-processes' processes ends with its launcher (headlab.shard)
    # SIGTERM (kill, a batch scheduler's time limit) stops a command as Ctrl-C does: its one line, its
    # lock released, its temporary files removed; Python's default ended it with none of that. Not
    # in a process of --num-processes, which its launcher stops with SIGTERM (headlab.shard).
    previous = None
    if threading.current_thread() is threading.main_thread() and not os.environ.get(LAUNCHER) \
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        previous = signal.signal(signal.SIGTERM, _terminate)
    _TERMINATED.clear()
    try:
        return _run(argv)
    except KeyboardInterrupt:  # Ctrl-C before the command began (importing its modules, parsing)
        print(STARTUP_INTERRUPTED, file=sys.stderr)
        return 143 if _TERMINATED else 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _run(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if [a for a in argv if not a.startswith("-")][:1] == ["reproduce"]:
        print(REPRODUCE_MOVED, file=sys.stderr)
        return 2
    parser = build_parser()
    # A command module may define rewrite_argv(argv) -> argv to keep an older command form
    # working (headlab.pruning.cli: `prune MODEL ...` -> `prune apply MODEL ...`).
    for name in COMMAND_MODULES:
        rewrite = getattr(importlib.import_module(name), "rewrite_argv", None)
        if rewrite is not None:
            argv = rewrite(argv)
    args, unknown = parser.parse_known_args(argv)  # usage errors: argparse exits with 2
    if unknown:
        # before the command's name (`headlab --bogus heads`): headlab's own error; after it: named by
        # the command's parser (`headlab importance: error: ...`, its usage). argparse lists headlab's first.
        command = _command_parser(parser, args, depth=1)
        own = len(getattr(command, "unrecognized", [])) if command is not parser else 0
        leading, unknown = unknown[:len(unknown) - own], unknown[len(unknown) - own:]
        if leading:
            parser.error(f"unrecognized arguments: {' '.join(leading)}")
        _command_parser(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}")
    args.argv = argv  # a command that starts processes of its own runs them with these (headlab.shard)
    name = " ".join(getattr(args, key) for key in ("command", "nmt_command", "lm_command", "prune_command")
                    if isinstance(getattr(args, key, None), str))
    try:
        check_parsed(args)  # options out of their declared range: exit 2 before any work
        result = args.func(args)
    except KeyboardInterrupt:
        if args.debug:
            traceback.print_exc()
        print(f"headlab {name}: interrupted; {interrupted_note(args)}", file=sys.stderr)
        return 143 if _TERMINATED else 130
    except HeadlabError as error:
        return _fail(args, name, str(error), error.exit_code)
    except BrokenPipeError as error:  # stdout's reader left (`headlab heads MODEL | head`): not a failure
        if not _stdout_gone():  # another pipe (a process of the run): an error like any other
            return _fail(args, name, f"{error.strerror or error}", 1)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes it
        return 141  # 128 + SIGPIPE, as `yes | head` ends
    except OSError as error:  # the user's paths: unreadable, unwritable, disk full
        where = f"{error.filename}: " if error.filename else ""
        kept = _kept_after_failure(args) if error.errno in (errno.ENOSPC, errno.EDQUOT) else ""
        return _fail(args, name, f"{where}{error.strerror or error}{kept}", 1)
    except Exception as error:  # noqa: BLE001 - a bug in headlab: show where it is
        failed_write = _write_failure(error)
        if failed_write:  # a full disk under safetensors or tokenizers: the user's, not a bug
            return _fail(args, name, f"{failed_write}{_kept_after_failure(args)}", 1)
        in_model = _failed_in_model_code(error)
        if in_model:  # transformers' own modeling code raised (DeepSeek-V4 in float16): say so, not "a bug in headlab"
            return _fail(args, name, in_model, 1)
        traceback.print_exc()
        print(f"headlab {name}: internal error ({type(error).__name__}: {error}); this is a bug in headlab, "
              "the traceback above says where", file=sys.stderr)
        return 1
    return int(result or 0)


def _command_parser(parser: argparse.ArgumentParser, args, depth: int | None = None) -> argparse.ArgumentParser:
    """The parser of the (sub-)command that ``args`` ran: ``headlab prune sweep``'s for `prune sweep`
    (``depth`` 1: ``headlab prune``'s)."""
    while depth is None or depth > 0:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None or getattr(args, sub.dest, None) not in sub.choices:
            return parser
        parser = sub.choices[getattr(args, sub.dest)]
        depth = None if depth is None else depth - 1
    return parser


def _stdout_gone() -> bool:
    """Whether standard output is a pipe whose reader has left (poll says POLLERR), without writing to it."""
    import select

    if not hasattr(select, "poll"):  # Windows: the broken pipe is taken for stdout's
        return True
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), 0)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError):  # stdout replaced by an object without a file (a notebook's)
        return False


def interrupted_note(args) -> str:
    """What an interrupted command kept, and how to go on: the command's own note, or the default.

    A note that names what is kept goes with ``interrupted_if``, glob patterns (format strings over
    the arguments) of that: when none of them matches (the run was stopped before its first
    checkpoint, stage or row), the note would name a directory or checkpoint that does not exist,
    and the line says that nothing was kept instead."""
    note = getattr(args, "interrupted", None)
    patterns = getattr(args, "interrupted_if", None)
    if note and patterns:
        escaped = {key: glob.escape(value) if isinstance(value, str) else value for key, value in vars(args).items()}
        if not any(glob.glob(pattern.format(**escaped)) for pattern in patterns):
            return "nothing was kept (it was stopped before its first checkpoint or result was written); run it again"
    if not note:
        return "nothing was kept (results are written only when the command finishes); run it again"
    return note.format(**vars(args))


# What the system says to a write it refuses (a Rust error with another errno stays a traceback).
_WRITE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO}


def _write_failure(error: Exception) -> str | None:
    """What a writer outside Python's I/O says when the system refused a write (safetensors'
    ``SafetensorError: ... I/O error: No space left on device (os error 28)``, tokenizers' bare
    ``Exception: ... (os error 28)``), as a line for the user; None for anything else."""
    text = str(error)
    rust = type(error).__module__.split(".")[0] in ("safetensors", "tokenizers", "builtins")
    code = re.search(r"\(os error (\d+)\)", text)  # a Rust std::io::Error (safetensors, tokenizers)
    if rust and code and int(code.group(1)) in _WRITE_ERRORS:
        writer = {"safetensors": "the weights (safetensors)", "tokenizers": "the tokenizer"}.get(
            type(error).__module__.split(".")[0], "a file (tokenizers)")
        return f"cannot write {writer}: {os.strerror(int(code.group(1)))}"
    return None


_PASSED_THROUGH = (f"{os.sep}torch{os.sep}", f"{os.sep}transformers{os.sep}utils{os.sep}", f"{os.sep}functools.py",
                   f"{os.sep}contextlib.py")
"""Frames an error only passes through on its way out of a model's code: torch's modules and functions,
transformers' decorators (deprecated arguments, output capture), the standard library's wrappers."""


def _failed_in_model_code(error: Exception) -> str | None:
    """Where the innermost frame of ``error`` that is not one it only passed through is in a model's own modeling
    code (``transformers/models/...``, or a remote code module's ``modeling_*.py``), a line for the user saying so:
    that code's file and line, and how to tell transformers' failure from headlab's; None for anything else (an
    error raised in headlab's code, a hook of headlab's inside the forward included, stays an internal error)."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not any(p in f.filename for p in _PASSED_THROUGH)]
    if not frames:
        return None
    last = frames[-1]
    path = last.filename.replace(os.sep, "/")
    if "/transformers/models/" not in path and not os.path.basename(path).startswith("modeling_"):
        return None
    shown = path[path.index("transformers/models/"):] if "transformers/models/" in path else path
    code = f": `{last.line.strip()}`" if last.line else ""
    return (f"the model's own code failed ({type(error).__name__}: {str(error).strip().splitlines()[0]}) at "
            f"{shown}, line {last.lineno}, in {last.name}{code}. headlab ran the model as transformers does; if it "
            "fails so on its own too (the same inputs, dtype and device), the failure is the model code's (another "
            "--dtype may avoid it); if not, it is a bug in headlab: rerun with --debug and report the traceback")


def _kept_after_failure(args) -> str:
    """After a full disk: what the run kept, as its interruption would say (a command with a
    note of its own: checkpoints and stages are swapped in whole), else nothing more."""
    return f"; {interrupted_note(args)}" if getattr(args, "interrupted", None) else ""


def _fail(args, name: str, message: str, code: int) -> int:
    if args.debug:
        traceback.print_exc()
    print(f"headlab {name}: error: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
