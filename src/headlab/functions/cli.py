"""CLI for functions."""


def register(subparsers) -> None:
    pass
