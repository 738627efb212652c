"""The second bad-input catalogue (issue 32), output directories, text input, options: each case
feeds one bad input and asserts the exit code, that the message names the file or option, and
that nothing of the user's is lost. One test per row of docs/cli.md's catalogue."""

import os

import pytest

from headlab.cli import main
from support.bad_input import SENTENCES, files_under, forbid_model_loading, save_tiny_marian
from support.treebank import SAMPLE_CONLLU


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("outdir-inputs")
    save_tiny_marian(root / "model")
    (root / "src.txt").write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    (root / "tb.conllu").write_text(SAMPLE_CONLLU, encoding="utf-8")
    return root


# ----------------------------------------------------------------------------- output directories


def test_prune_apply_beside_a_users_dir_named_out_old(inputs, tmp_path, capsys):
    """Regression: `prune apply --out X` deleted a sibling X.old it never wrote (heads.atomic_dir),
    on a first run and with --overwrite."""
    mine = tmp_path / "pruned.old"
    mine.mkdir()
    (mine / "notes.txt").write_text("my notes\n")
    out = tmp_path / "pruned"
    assert main(["prune", str(inputs / "model"), "--heads", "enc_self:0:1", "--out", str(out)]) == 0
    assert main(["prune", str(inputs / "model"), "--heads", "enc_self:0:2", "--out", str(out), "--overwrite"]) == 0
    assert (mine / "notes.txt").read_text() == "my notes\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pruned", "pruned.old"]  # nothing of ours left beside
