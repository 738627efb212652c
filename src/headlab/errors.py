"""Errors whose message is meant for the user (the CLI prints them without a traceback).

The command line maps them onto its exit codes (docs/cli.md): a :class:`HeadlabError` is bad
input or usage (exit 2), a :class:`RunFailed` a failure while running (exit 1).
"""


class HeadlabError(Exception):
    """Bad input or an unsupported model, described so the user can fix it."""

    exit_code = 2


class RunFailed(HeadlabError):
    """The work started and could not finish (nothing usable came out, a stage failed, ...)."""

    exit_code = 1


class UnknownOption(HeadlabError, TypeError):
    """A keyword that a function of the Python API does not take (:func:`headlab.options.checked_keywords`):
    a user's error like a misspelt flag, and still the TypeError that Python raises for it."""


class UnsupportedVersion(HeadlabError, ImportError):
    """A dependency or a Python outside the range headlab runs on (headlab._version.require_transformers and
    require_python): the user's install to fix, which the command line reports as bad input (exit 2), and the
    ImportError a Python user expects of it."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised by the command line's handler (headlab.cli): it stops a command as Ctrl-C
    does, but the exit status is 143 (128 + 15), not 130; a launcher of processes that catches it
    (headlab.shard) tells the two apart by this class."""


class PruningNotExact(HeadlabError):
    """Physical pruning would not compute what masking the same heads computes (headlab.surgery):
    refused, with the family (``model_type``), the block and the difference found."""

    def __init__(self, message: str, *, model_type: str | None = None, block: object = None,
                 difference: float | None = None) -> None:
        super().__init__(message)
        self.model_type, self.block, self.difference = model_type, block, difference


def counted(n: int, noun: str, plural: str | None = None, spec: str = "") -> str:
    """``n`` and its noun, singular for one, for messages and summaries: ``1 sentence``,
    ``2 sentences``, ``1,204 lines`` (``spec=","``); ``plural`` where adding an s is wrong."""
    return f"{n:{spec}} {noun if n == 1 else plural or noun + 's'}"
