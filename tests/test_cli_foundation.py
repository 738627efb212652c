"""`headlab heads` and `headlab prune` end to end, and the head spec formats."""

import json

import pytest
import torch

from headlab import HeadlabError, attention_blocks, load_pruned, mask_heads
from headlab.cli import main
from headlab.headspec import parse_heads
from support.models import logits, tiny_inputs, tiny_model


@pytest.fixture
def marian_dir(tmp_path):
    model = tiny_model("marian")
    model.save_pretrained(tmp_path / "tiny")
    return tmp_path / "tiny", model


def test_heads_table_and_json(marian_dir, capsys):
    path, _ = marian_dir
    assert main(["heads", str(path)]) == 0
    table = capsys.readouterr().out
    assert "dec_cross" in table and "24 heads" in table
    assert main(["heads", str(path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0] == {"kind": "enc_self", "layer": 0, "n_heads": 4, "n_kv_heads": 4, "d_head": 8, "d_qk": 8,
                       "module": "model.encoder.layers.0.self_attn", "idle": False, "head_numbers": [0, 1, 2, 3],
                       "numbering": "original"}
    assert not any(row["idle"] for row in rows)  # an encoder-decoder feeds its cross-attention


def test_prune_command_equals_masking(marian_dir, tmp_path, capsys):
    path, model = marian_dir
    inputs = tiny_inputs("marian")
    with mask_heads(model, {("enc_self", 0): [1, 2], ("dec_cross", 1): [0, 1, 2, 3]}):
        expected = logits(model, inputs)
    out = tmp_path / "pruned"
    assert main(["prune", str(path), "--heads", "enc_self:0:1-2; dec_cross:1:*", "--out", str(out)]) == 0
    assert "removed 6 heads" in capsys.readouterr().out
    torch.testing.assert_close(logits(load_pruned(out), inputs), expected, atol=1e-5, rtol=0)
    # Listing a pruned directory shows the heads that are left.
    assert main(["heads", str(out), "--json"]) == 0
    counts = [row["n_heads"] for row in json.loads(capsys.readouterr().out)]
    assert counts == [2, 4, 4, 4, 4, 0]
    # A second run into the same directory is refused without --overwrite.
    assert main(["prune", str(path), "--heads", "enc_self:0:1", "--out", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err


def test_prune_command_reports_bad_specs(marian_dir, tmp_path, capsys):
    path, _ = marian_dir
    for spec, message in [("enc_self:0:4", "no head 4"), ("enc_self:x:1", "cannot read"),
                          ("dec_self:7:0", "no layer 7"), ("self:0:0", "unknown attention kind")]:
        assert main(["prune", str(path), "--heads", spec, "--out", str(tmp_path / "o")]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_json_mask_files(tmp_path):
    blocks = attention_blocks(tiny_model("bert"))
    listed = tmp_path / "listed.json"
    listed.write_text(json.dumps({"enc_self": {"1": [0, 3]}}))
    assert parse_heads(str(listed), blocks) == {("enc_self", 1): [0, 3]}
    matrix = tmp_path / "matrix.json"
    matrix.write_text(json.dumps({"scores": {"enc_self": [[1, 1, 1, 1], [0, 1, 1, 0]]}}))
    assert parse_heads(str(matrix), blocks) == {("enc_self", 1): [0, 3]}
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"enc_self": [[1, 1, 1], [1, 1, 1, 1]]}))
    with pytest.raises(HeadlabError, match="layer 0 mask has 3 entries; the layer has 4 heads"):
        parse_heads(str(wrong), blocks)
    wrong.write_text(json.dumps({"enc_self": [[1, 1, 1, 1]]}))
    with pytest.raises(HeadlabError, match="mask has 1 layer; the model has 2"):
        parse_heads(str(wrong), blocks)
    with pytest.raises(HeadlabError, match="no such mask file"):
        parse_heads(str(tmp_path / "missing.json"), blocks)


@pytest.mark.parametrize("argv", [["reproduce"], ["reproduce", "--docs-only"], ["--debug", "reproduce", "--models", "x"]])
def test_reproduce_left_the_package_and_says_where_it_went(argv, capsys):
    """`headlab reproduce` is no command of the package any more (issue 33): one line naming
    `python -m reproduction`, exit 2, and it is not listed in --help."""
    from headlab.cli import build_parser

    assert main(argv) == 2
    out = capsys.readouterr()
    assert out.err.count("\n") == 1 and "python -m reproduction" in out.err and out.out == ""
    assert "reproduce" not in build_parser().format_help()


def test_output_cut_short_by_its_reader_is_not_an_error(tmp_path):
    """Regression: `headlab heads MODEL --json | head -1` ended with "headlab heads: error: Broken
    pipe" (exit 1) once the reader had left: the convention of `yes | head` is a quiet exit 141."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from support.models import CONFIGS

    _, config = CONFIGS["gpt2"]()
    config.n_layer = 2000  # a long listing, more than a pipe holds; no weights: the config's heads
    config.save_pretrained(tmp_path / "long")
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": src, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-m", "headlab", "heads", str(tmp_path / "long"), "--json"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert process.stdout.readline() == b"[\n"
    process.stdout.close()  # the reader leaves, as `head -1` does
    err = process.stderr.read().decode()
    assert process.wait(timeout=120) == 141 and err == "", err


def test_a_broken_pipe_that_is_not_stdout_stays_an_error(marian_dir, capsys, monkeypatch):
    import headlab.commands

    def broken(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(headlab.commands, "run_heads", broken)  # the parser is built on each call
    assert main(["heads", str(marian_dir[0])]) == 1
    assert "headlab heads: error: Broken pipe" in capsys.readouterr().err
