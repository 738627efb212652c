"""`headlab nmt ...` subcommands."""


def register(subparsers) -> None:
    subparsers.add_parser("nmt", help="train, translate with and score translation models")
