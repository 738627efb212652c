"""Files headlab writes get the permissions a plain open() would give them (0666 less the umask):
transformers' save_pretrained writes model.safetensors as 0600, unreadable to the other users of a
shared model or results directory."""

import os
import stat
import tempfile

import pytest

from headlab.heads import atomic_dir


@pytest.fixture
def umask_022():
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_atomic_dir_gives_what_the_umask_allows_and_takes_nothing_away(tmp_path, umask_022):
    def write(tmp):
        tmp.mkdir()
        fd, private = tempfile.mkstemp(dir=tmp)  # as save_pretrained writes its weights: 0600
        os.close(fd)
        os.rename(private, tmp / "model.safetensors")
        (tmp / "run.sh").write_text("#!/bin/sh\n")
        os.chmod(tmp / "run.sh", 0o755)

    atomic_dir(tmp_path / "out", write)
    assert _mode(tmp_path / "out" / "model.safetensors") == 0o644
    assert _mode(tmp_path / "out" / "run.sh") == 0o755


def test_saved_and_pruned_models_are_readable_as_the_umask_allows(tmp_path, umask_022):
    from headlab.adapters import attention_blocks
    from headlab.surgery import prune_heads, save_pruned
    from support.models import tiny_model

    model = tiny_model("marian")
    prune_heads(model, {attention_blocks(model)[0].key: [1]})
    save_pruned(model, tmp_path / "pruned")
    weights = tmp_path / "pruned" / "model.safetensors"
    assert weights.is_file() and _mode(weights) == 0o644
