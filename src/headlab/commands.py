"""Foundation subcommands: `headlab heads`, `headlab prune`."""


def register(subparsers) -> None:
    pass
