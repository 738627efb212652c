"""Command-line options generated from config dataclasses: one default, written in the dataclass."""

import argparse
import re
from dataclasses import dataclass

import pytest

from headlab.errors import HeadlabError
from headlab.options import HelpFormatter, add_options, from_args, help_of, numbers, option


@dataclass
class Config:
    path: str = option(help="an input file")
    size: int = option(8, "how many", flag="n", metavar="N")
    rate: float | None = option(None, "a rate")
    mode: str = option("fast", "how", choices=("fast", "slow"))
    verbose: bool = option(False, "say more")
    out_dir: str = option("runs/x", "where", flag="out", required=True)
    hidden: int = 3  # no option


def _parser(config=Config):
    parser = argparse.ArgumentParser()
    add_options(parser, config, ("path", "size", "rate", "mode", "verbose", "out_dir"))
    return parser


def test_options_carry_the_dataclass_defaults_and_read_back():
    args = _parser().parse_args(["--path", "a.txt", "--out", "o"])
    assert (args.path, args.n, args.rate, args.mode, args.verbose, args.out) == ("a.txt", 8, None, "fast", False, "o")
    assert from_args(args, Config, hidden=5) == Config("a.txt", 8, None, "fast", False, "o", 5)
    args = _parser().parse_args(["--path", "a", "--n", "2", "--rate", "0.5", "--mode", "slow", "--verbose", "--out", "o"])
    assert from_args(args, Config) == Config("a", 2, 0.5, "slow", True, "o")


def test_an_instance_gives_its_values_as_defaults():
    base = Config("p", size=100)
    args = _parser(base).parse_args(["--path", "q", "--out", "o"])
    assert args.n == 100 and from_args(args, base) == Config("q", 100, out_dir="o")


def test_required_options_and_choices_are_argparse_errors():
    with pytest.raises(SystemExit):
        _parser().parse_args(["--out", "o"])  # --path has no default
    with pytest.raises(SystemExit):
        _parser().parse_args(["--path", "a"])  # --out is required although the field has a default
    with pytest.raises(SystemExit):
        _parser().parse_args(["--path", "a", "--out", "o", "--mode", "medium"])


def test_help_numbers_and_unsupported_fields():
    assert help_of(Config, "size") == "how many"
    assert numbers("24, 12,6") == (24, 12, 6) and numbers("0.1,2", float) == (0.1, 2.0)
    with pytest.raises(HeadlabError, match="integers"):
        numbers("1,x")

    @dataclass
    class Listy:
        items: tuple[int, ...] = option((), "several")

    with pytest.raises(TypeError, match="Listy.items"):
        add_options(argparse.ArgumentParser(), Listy, ("items",))


def test_help_states_each_default_once_and_only_when_it_tells_something():
    parser = argparse.ArgumentParser(formatter_class=HelpFormatter)
    add_options(parser, Config, ("path", "size", "rate", "mode", "verbose"))
    parser.add_argument("--limit", type=int, help="tokens per sentence (default: the model's maximum)")
    parser.add_argument("--every", type=int, default=0, help="every N updates (0: off)")
    parser.add_argument("--scale", type=float, default=0.0, help="a factor")
    text = " ".join(parser.format_help().split())
    assert "(0: off) (default: 0)" in text and "a factor (default: 0.0)" in text  # 0 == False, yet it is shown
    assert "(default: None)" not in text and "(default: False)" not in text
    assert text.count("(default: the model's maximum)") == 1 and "maximum) (default" not in text
    assert "how many (default: 8)" in text and "how (default: fast)" in text


def _parsers(parser, name="headlab"):
    """Every parser of the CLI, sub-commands and their sub-commands included, with its name."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, child in action.choices.items():
                yield from _parsers(child, f"{name} {sub}")


def test_every_option_s_help_states_its_default():
    """`--help` of every command shows each default that tells something (lm train --min-improvement
    0.01, the recipe's own), and no "(default: [])" for a list not given."""
    from headlab.cli import build_parser

    missing, empty = [], []
    for name, parser in _parsers(build_parser()):
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.option_strings or action.help == argparse.SUPPRESS:
                continue
            shown = formatter._get_help_string(action) or ""
            if isinstance(formatter, argparse.ArgumentDefaultsHelpFormatter) and "%(default)s" in shown:
                shown = shown % {"default": action.default}
            if action.default not in (None, False, argparse.SUPPRESS, [], ()) and "default" not in shown.lower():
                missing.append(f"{name} {action.option_strings[0]}")
            if "(default: [])" in shown or "(default: ())" in shown:
                empty.append(f"{name} {action.option_strings[0]}")
        if name == "headlab lm train":
            text = " ".join(parser.format_help().split())
            assert "below the lowest so far) (default: 0.01)" in text
    assert missing == [] and empty == []


def test_version_names_the_package_version(capsys):
    from headlab import __version__
    from headlab.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0 and capsys.readouterr().out.strip() == f"headlab {__version__}"


def test_analyze_skip_repeated_adds_up():
    """`--skip a --skip b` kept only b: the stages named first ran although the user skipped them."""
    from headlab.cli import build_parser

    args = build_parser().parse_args(["analyze", "m", "--source", "s", "--out", "o", "--skip", "lrp", "--skip", "figures,report"])
    assert args.skip == ["lrp", "figures,report"]


def test_renamed_option_keeps_its_old_name_hidden_with_a_deprecation_note(capsys):
    from headlab.options import renamed

    @dataclass
    class Counted:
        max_sentences: int | None = option(None, "the first N", flag="limit", old_names=("--max-sentences",))

    parser = argparse.ArgumentParser(formatter_class=HelpFormatter)
    renamed(parser, "--source", "--data", required=True, help="a text file")
    add_options(parser, Counted, ("max_sentences",))
    args = parser.parse_args(["--data", "a.txt", "--max-sentences", "3"])
    assert (args.source, args.limit, from_args(args, Counted).max_sentences) == ("a.txt", 3, 3)
    err = capsys.readouterr().err
    assert "--data is deprecated, use --source" in err and "--max-sentences is deprecated, use --limit" in err
    args = parser.parse_args(["--source", "b.txt", "--limit=2"])
    assert (args.source, args.limit) == ("b.txt", 2) and capsys.readouterr().err == ""
    text = parser.format_help()
    assert "--source SOURCE" in text and "--limit LIMIT" in text
    assert "--data" not in text and "--max-sentences" not in text


# One name per concept in every command (docs/cli.md): the text file is --source, the treebank
# --conllu, "the first N sentences" --limit; the old names work, hidden from the help.
DIALECT = {
    ("importance",): ({"--source", "--limit"}, {"--data", "--n-sentences"}),
    ("functions",): ({"--source", "--conllu", "--limit"}, {"--source-text", "--max-sentences"}),
    ("aggregate",): ({"--conllu", "--limit"}, {"--max-sentences"}),
    ("parse",): ({"--source"}, {"--input"}),
    ("analyze",): ({"--source", "--conllu", "--limit", "--conllu-limit"}, set()),
    ("demo",): ({"--source", "--target", "--conllu", "--limit", "--conllu-limit"},
                {"--reference", "--n-sentences", "--treebank-sentences"}),
}


@pytest.mark.parametrize("command", sorted(DIALECT))
def test_every_command_speaks_one_dialect(command):
    import re

    from headlab.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command[0]]
    shown = set(re.findall(r"(--[a-z-]+)", sub.format_help()))
    current, old = DIALECT[command]
    assert current <= shown and not (old & shown)
    known = {s for action in sub._actions for s in action.option_strings}
    assert old <= known  # still accepted


def test_a_measure_option_that_counts_refuses_a_float_or_bool_naming_it():
    """Regression: the range check skipped what is not a number, so ``lrp_targets=1.5`` in Python
    passed and ended in a raw TypeError inside LRP, and ``True`` was taken as 1."""
    from headlab.importance import ImportanceConfig

    for keywords, message in (({"lrp_targets": 1.5}, "--lrp-targets must be a whole number at least 0, got 1.5"),
                              ({"lrp_targets": True}, "--lrp-targets must be a whole number at least 0, got True"),
                              ({"ablation_rows": "2"}, "--ablation-rows must be a whole number at least 1, got '2'"),
                              ({"query_chunk": 1.0}, "--query-chunk must be a whole number at least 1, got 1.0")):
        with pytest.raises(HeadlabError, match=re.escape(message)):
            ImportanceConfig(**keywords).resolved_methods()
    ImportanceConfig(lrp_targets=3, query_chunk=None).resolved_methods()  # whole numbers and None still pass


def test_the_importance_run_s_own_counts_are_checked_as_the_measures_options():
    """Regression: ImportanceConfig's own fields escaped the range check its measures' options get:
    ``batch_size=2.0`` passed (and failed deep in the pass), ``batch_size=True`` was 1, and
    ``beam=0`` was refused as "batch size and beam must be at least 1", naming neither value."""
    from headlab.importance import ImportanceConfig

    for keywords, message in (({"batch_size": 2.0}, "--batch-size must be a whole number at least 1, got 2.0"),
                              ({"batch_size": True}, "--batch-size must be a whole number at least 1, got True"),
                              ({"batch_size": 0}, "--batch-size must be at least 1, got 0"),
                              ({"beam": 0}, "--beam must be at least 1, got 0"),
                              ({"beam": 2.5}, "--beam must be a whole number at least 1, got 2.5")):
        with pytest.raises(HeadlabError, match=f"^{re.escape(message)}$"):
            ImportanceConfig(**keywords).resolved_methods()
    ImportanceConfig(batch_size=4, beam=2).resolved_methods()


def test_the_api_s_counts_and_a_config_s_options_share_one_check():
    """The API's counts (``limit``, ``max_length``, ...) are refused by the code and in the words
    of a config's ranged options (options.count_error), naming the argument, not a flag."""
    from headlab.api import _check_counts
    from headlab.options import count_error

    assert count_error(1.5, "[1, inf)", "--limit") == "--limit must be a whole number at least 1, got 1.5"
    with pytest.raises(HeadlabError, match=r"^importance: limit must be a whole number at least 1, got 1\.5$"):
        _check_counts("importance", limit=1.5)
    with pytest.raises(HeadlabError, match=r"^analyze: max_length must be at least 2, got 1$"):
        _check_counts("analyze", max_length=1)
    _check_counts("analyze", limit=None, max_length=2, attention_sentences=0)
