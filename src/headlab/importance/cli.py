"""CLI for importance."""


def register(subparsers) -> None:
    pass
