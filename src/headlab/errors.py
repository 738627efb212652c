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
