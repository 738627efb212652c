"""A language model's loss measures (gradient, ablation) on one-token sentences: a sentence of one
token has no next token to predict. Among longer ones it is skipped and counted; where every
sentence is one (``analyze --limit 1`` on a one-word first line) the run is refused before the
first stage's work, naming the lines, where gradient failed after the others had run (exit 1)."""

import json

import pytest

from headlab.cli import main
from support.bad_input import WORDS
from support.models import tiny_model
from support.treebank import word_tokenizer


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("one-token")
    tiny_model("gpt2").save_pretrained(root / "lm")
    word_tokenizer(WORDS, style="gpt2").save_pretrained(root / "lm")  # nothing added: "Cats" is one token
    (root / "src.txt").write_text("Cats\n\nsleep\nThe old dog chased a red ball .\n", encoding="utf-8")
    return root


def _analyze(inputs, out, *extra):
    return ["analyze", str(inputs / "lm"), "--source", str(inputs / "src.txt"), "--out", str(out), "--no-progress",
            "--skip", "attention", "figures", "report", *extra]


def test_analyze_where_every_sentence_is_one_token(inputs, tmp_path, capsys):
    """Regression: `analyze --limit 1` exited 1, its gradient stage failed ("no sentence has a
    token to score") after confidence and LRP had run."""
    out = tmp_path / "out"
    assert main(_analyze(inputs, out, "--limit", "2", "--ablation")) == 2
    err = capsys.readouterr().err
    assert (f"headlab analyze: error: --source {inputs / 'src.txt'}: lines 1, 3 are one token each, and gradient and "
            "ablation score a language model by its loss of predicting each next token, which a one-token sentence "
            "does not have: give sentences of two tokens or more (or a larger --limit), or --skip gradient "
            "ablation") in err
    assert "Traceback" not in err and "failed" not in err
    assert not (out / "importance").exists() and not (out / "manifest.json").exists()


def test_one_token_sentence_among_longer_ones_is_skipped_and_counted(inputs, tmp_path):
    out = tmp_path / "out"
    assert main(_analyze(inputs, out, "--limit", "3", "--skip", "lrp")) == 0
    signature = json.loads((out / "importance" / "gradient.json").read_text())["signature"]
    assert (signature["n_sentences"], signature["n_scored_sentences"], signature["n_scored_tokens"]) == (3, 1, 7)


def test_importance_where_every_sentence_is_one_token(inputs, tmp_path, capsys):
    """`importance`: gradient and ablation skipped with the reason (as any measure that cannot run
    on the data) where they failed (exit 1); asked for alone, a usage error (exit 2)."""
    out = tmp_path / "all"
    assert main(["importance", str(inputs / "lm"), "--source", str(inputs / "src.txt"), "--out", str(out),
                 "--limit", "1", "--no-progress", "--lrp-bootstrap", "0"]) == 0
    printed = capsys.readouterr().out
    assert "skipped gradient: every sentence is one token, and a language model's loss is on predicting" in printed
    assert "skipped ablation: every sentence is one token" in printed
    assert sorted(p.name for p in out.glob("*.json")) == ["confidence.json", "lrp.json"]
    assert main(["importance", str(inputs / "lm"), "--source", str(inputs / "src.txt"), "--out", str(tmp_path / "g"),
                 "--limit", "1", "--no-progress", "--method", "gradient"]) == 2
    assert "error: cannot run gradient: every sentence is one token" in capsys.readouterr().err
