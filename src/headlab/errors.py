"""Errors whose message is meant for the user (the CLI prints them without a traceback)."""


class HeadlabError(Exception):
    """Bad input or an unsupported model, described so the user can fix it."""
