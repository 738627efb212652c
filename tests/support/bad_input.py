"""Shared pieces of the bad-input catalogue (tests/test_bad_input_*.py): a tiny saved model
with a word-level tokenizer, a pruned copy of it, an output directory this process cannot
write (also when the tests run as root), and a guard that fails if a model is loaded."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from headlab import prune_heads, save_pruned
from support.models import tiny_model
from support.treebank import SAMPLE_CONLLU, word_tokenizer

WORDS = [line.split("\t")[1] for line in SAMPLE_CONLLU.splitlines() if line and line[0].isdigit()]
SENTENCES = ["The old dog chased a red ball .", "Cats sleep here .", "Birds sing and fish swim .",
             "A very big zebra ate green grass slowly ."]


def save_tiny_marian(path: Path, *, tokenizer: bool = True) -> Path:
    """The tiny random Marian of tiny_models (64 positions) with a word-level tokenizer."""
    tiny_model("marian").save_pretrained(path)
    if tokenizer:
        word_tokenizer(WORDS + ["do", "n't"]).save_pretrained(path)
    (path / "model.safetensors").chmod(0o644)  # safetensors writes 0600; the runs as user nobody read it
    return path


def save_tiny_pruned(path: Path) -> Path:
    """The same model with heads physically removed, written by save_pruned (with its tokenizer)."""
    model = tiny_model("marian")
    prune_heads(model, {("enc_self", 0): [1, 2], ("dec_cross", 1): [0, 1, 2, 3], ("dec_self", 0): [3]})
    save_pruned(model, path)
    word_tokenizer(WORDS + ["do", "n't"]).save_pretrained(path)
    return path


def files_under(path: Path) -> set[str]:
    """Every file below ``path`` (relative), to show that a refused run left nothing behind."""
    return {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()} if path.exists() else set()


@contextmanager
def world_readable_dir():
    """A scratch directory every user can read (for runs under another user id, see below)."""
    path = Path(tempfile.mkdtemp(prefix="headlab-bad-input-"))
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        for sub in path.rglob("*"):
            if sub.is_dir():
                os.chmod(sub, 0o755)
        shutil.rmtree(path)


@contextmanager
def unwritable(directory: Path):
    """``directory`` exists and this process cannot write in it. Root ignores file modes, so a
    root process runs the block as user nobody (its files must then be world-readable: use
    :func:`world_readable_dir`)."""
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o555)
    root = os.geteuid() == 0
    if root:
        os.setegid(65534)
        os.seteuid(65534)
    try:
        yield directory
    finally:
        if root:
            os.seteuid(0)
            os.setegid(0)
        os.chmod(directory, 0o755)


def forbid_model_loading(monkeypatch) -> None:
    """Fail the test if a command loads a model: its checks had to refuse before that."""
    import headlab.loading
    import headlab.nmt.model

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded although the command should have refused first")

    monkeypatch.setattr(headlab.loading, "load_model", refuse)
    monkeypatch.setattr(headlab.nmt.model, "load_translation_model", refuse)  # nmt translate/evaluate load with it
