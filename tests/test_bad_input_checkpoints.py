"""Bad-input catalogue, writing and resuming checkpoints and model directories (docs/cli.md): a
full disk under safetensors' or torch's writer (``prune apply``, ``nmt train``), a damaged resume
point (``nmt train --resume``, ``prune train --resume``), and ``nmt export``'s ``--to`` (a user's
files, an earlier export, a directory in use). The full disk is simulated at the writers: a
``SafetensorError`` as safetensors raises it on ENOSPC, under transformers' weights writer or the
optimizer and RNG states' (headlab.training.state_files)."""

import json
import os
import socket
import subprocess
import sys

import pytest
import transformers.modeling_utils
from safetensors import SafetensorError

from headlab.cli import main
from headlab.errors import HeadlabError
from headlab.loading import load_model
from headlab.lock import LOCK_FILE, _start_time
from headlab.pruning.train import PruneConfig, prune_train
from headlab.training.config import TrainConfig
from support.bad_input import SENTENCES, files_under, save_tiny_marian
from support.nmt import tiny_marian

ENOSPC_SAFETENSORS = "Error while serializing: I/O error: No space left on device (os error 28)"


def _full_disk_for_safetensors(monkeypatch):
    def save_file(*args, **kwargs):
        raise SafetensorError(ENOSPC_SAFETENSORS)

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", save_file)


def _full_disk_for_state_files(monkeypatch):
    import headlab.training.state_files as state_files

    def save_file(*args, **kwargs):
        raise SafetensorError(ENOSPC_SAFETENSORS)

    monkeypatch.setattr(state_files, "save_file", save_file)


def _contents(directory):
    """Every file's bytes, headlab's lock bookkeeping left out."""
    return {name: (directory / name).read_bytes() for name in files_under(directory) if not name.startswith(".headlab")}


def test_full_disk_in_prune_apply(tmp_path, capsys, monkeypatch):
    """Regression (issue 32 row 8): ENOSPC under safetensors was a SafetensorError traceback."""
    model = save_tiny_marian(tmp_path / "model")
    _full_disk_for_safetensors(monkeypatch)
    out = tmp_path / "pruned"
    assert main(["prune", str(model), "--heads", "enc_self:0:1", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "headlab prune apply: error: cannot write the weights (safetensors): No space left on device" in err
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no half-written directory


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pairs")
    (root / "src.txt").write_text("\n".join(SENTENCES * 10) + "\n", encoding="utf-8")
    return root / "src.txt"


def _nmt_train(pairs, out, *extra):
    return main(["nmt", "train", "--train-src", str(pairs), "--train-tgt", str(pairs), "--vocab-size", "60",
                 "--d-model", "16", "--ffn", "32", "--layers", "1", "--heads", "2", "--max-positions", "32",
                 "--max-tokens", "200", "--no-progress", "--out", str(out), *extra])


@pytest.fixture(scope="module")
def one_epoch(pairs, tmp_path_factory):
    """A finished one-epoch nmt train run, to resume from (copied by each test)."""
    out = tmp_path_factory.mktemp("nmt-run") / "run"
    assert _nmt_train(pairs, out, "--epochs", "1") == 0
    return out


def _copy(run, to):
    import shutil

    shutil.copytree(run, to)
    return to


@pytest.mark.parametrize("writer", ["safetensors", "state-files"])
def test_full_disk_in_nmt_train(writer, pairs, one_epoch, tmp_path, capsys, monkeypatch):
    """Regression (issue 32 row 8): ENOSPC while nmt train wrote a checkpoint was a traceback
    (SafetensorError, or torch.save's "unexpected pos" RuntimeError that names no file, when
    optimizer.pt was written with it); now exit 1, the cause, and what is kept: the last
    checkpoint, whole, and --resume goes on."""
    run = _copy(one_epoch, tmp_path / "run")
    before = _contents(run)
    (_full_disk_for_safetensors if writer == "safetensors" else _full_disk_for_state_files)(monkeypatch)
    assert _nmt_train(pairs, run, "--epochs", "2", "--resume") == 1
    err = capsys.readouterr().err
    cause = ("cannot write the weights (safetensors): No space left on device" if writer == "safetensors"
             else "optimizer.safetensors: No space left on device")
    assert cause in err and f"the last checkpoint in {run} is kept; add --resume" in err
    assert "Traceback" not in err and "internal error" not in err
    after = _contents(run)
    assert {name: after[name] for name in before if name.startswith("last/")} == \
        {name: data for name, data in before.items() if name.startswith("last/")}
    assert not [p for p in run.iterdir() if p.name.startswith(".last.tmp")]  # no temporary directory left
    monkeypatch.undo()
    assert _nmt_train(pairs, run, "--epochs", "2", "--resume") == 0


def _damage(path, how):
    if how == "missing":
        path.unlink()
    elif how == "empty":
        path.write_bytes(b"")
    else:
        path.write_bytes(path.read_bytes()[:50])


@pytest.mark.parametrize("name,how", [("trainer_state.json", "truncated"), ("trainer_state.json", "empty"),
                                      ("optimizer.safetensors", "truncated"), ("optimizer.safetensors", "missing"),
                                      ("model.safetensors", "truncated"), ("rng-0.safetensors", "truncated"),
                                      ("rng-0.safetensors", "empty")])
def test_damaged_resume_state_in_nmt_train(name, how, pairs, one_epoch, tmp_path, capsys):
    """Regression (issue 32 row 8): a truncated or corrupt file in last/ was a JSONDecodeError,
    SafetensorError or PytorchStreamReader traceback; now exit 2 naming the file, nothing changed."""
    run = _copy(one_epoch, tmp_path / "run")
    _damage(run / "last" / name, how)
    before = _contents(run)
    assert _nmt_train(pairs, run, "--epochs", "2", "--resume") == 2
    err = capsys.readouterr().err
    assert f"--resume: {run / 'last' / name} is damaged or not this run's" in err
    assert "Traceback" not in err and "internal error" not in err
    assert _contents(run) == before


def test_nmt_train_resumed_on_other_training_pairs_is_refused(pairs, one_epoch, tmp_path, capsys):
    """Regression (audit31): `nmt train --resume` with another --train-src/--train-tgt went on from the checkpoint's
    epoch and batch in the other data's batches (exit 0): two trainings mixed under one record, some pairs skipped
    and others seen twice. Now exit 2 before any step, nothing changed; the same data resumes as before."""
    run = _copy(one_epoch, tmp_path / "run")
    other = tmp_path / "other.txt"
    other.write_text("\n".join(SENTENCES[:2] * 10) + "\n", encoding="utf-8")
    before = _contents(run)
    assert main(["nmt", "train", "--train-src", str(other), "--train-tgt", str(other), "--vocab-size", "60",
                 "--d-model", "16", "--ffn", "32", "--layers", "1", "--heads", "2", "--max-positions", "32",
                 "--max-tokens", "200", "--no-progress", "--out", str(run), "--epochs", "2", "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"--resume: {run / 'last'} was trained on other training pairs" in err and "Traceback" not in err
    assert _contents(run) == before
    assert _nmt_train(pairs, run, "--epochs", "2", "--resume") == 0


def test_damaged_resume_state_in_prune_train(tokenizer, corpus, tmp_path):
    """``prune train --resume`` over a train/last whose trainer_state.json was cut short: the
    error names the file (exit 2) before any step, and the run's files are as they were."""
    model_dir = tmp_path / "tiny"
    tiny_marian(tokenizer).save_pretrained(model_dir)

    def config(resume):
        train = TrainConfig(out_dir=str(tmp_path / "out"), max_tokens=400, lr=1e-3, warmup_steps=0, max_epochs=1,
                            max_steps=3, save_every_steps=3, validate=False, keep_epoch_checkpoints=False,
                            progress=False, seed=3, resume=resume)
        return PruneConfig(gates="all", lam=0.2, log_every=1, eval_beam=1, train=train)

    def run(resume):
        prune_train(load_model(str(model_dir)), tokenizer, corpus, corpus.subset(4), config(resume),
                    log=lambda message: None)

    run(False)
    state = tmp_path / "out" / "train" / "last" / "trainer_state.json"
    _damage(state, "truncated")
    before = _contents(tmp_path / "out")
    with pytest.raises(HeadlabError, match=f"--resume: {state} is damaged or not this run's") as error:
        run(True)
    assert error.value.exit_code == 2
    assert _contents(tmp_path / "out") == before
    assert json.loads((tmp_path / "out" / "gates.json").read_text())  # the finished run's results stay


def test_nmt_export_into_a_users_directory_a_locked_one_and_over_an_earlier_export(one_epoch, tmp_path, capsys):
    """Regression (issue 32): `nmt export` took no lock and wrote into any directory, beside a
    user's files, and --overwrite left an earlier export's files it did not write again. Now
    like functions' --out (headlab.outdir)."""
    target = tmp_path / "model"
    target.mkdir()
    (target / "README.md").write_text("mine")
    args = ["nmt", "export", "--run", str(one_epoch), "--checkpoint", "last", "--to", str(target)]
    for extra in ([], ["--overwrite"]):
        assert main([*args, *extra]) == 2
        assert "--to " + str(target) + ": holds files headlab did not write (README.md)" in capsys.readouterr().err
    assert files_under(target) == {"README.md"}
    (target / "README.md").unlink()

    assert main(args) == 0
    first = files_under(target)
    assert {"model.safetensors", "tokenizer.json", "export.json", ".headlab/files.json"} <= first
    assert main(args) == 2
    assert "holds the results of an earlier run" in capsys.readouterr().err
    (target / "train_history.json").write_text("{}")  # a file of the earlier export's list, changed
    assert main([*args, "--overwrite", "--dtype", "float16"]) == 0
    assert files_under(target) == first
    assert json.loads((target / "export.json").read_text())["dtype"] == "float16"

    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (target / LOCK_FILE).write_text(json.dumps({"pid": holder.pid, "host": socket.gethostname(),
                                                    "pid_start": _start_time(holder.pid), "started": "now"}))
        before = _contents(target)
        assert main([*args, "--overwrite"]) == 2
        assert f"is in use by another headlab run (pid {holder.pid}" in capsys.readouterr().err
        assert _contents(target) == before
    finally:
        holder.kill()
        holder.wait()
        os.unlink(target / LOCK_FILE)
