"""Bad-input catalogue, translation commands: pruned models, truncation, the input files'
rows (missing, empty, directory, non-UTF-8, CRLF, BOM, truncated gzip, mismatched pairs), a
model without a tokenizer and an unwritable --output. docs/cli.md lists the contract."""

import gzip
import json
import os
import shutil
import socket
import subprocess
import sys
from contextlib import contextmanager

import pytest

from headlab.cli import main
from headlab.loading import load_model
from headlab.nmt.tokenizer import load_tokenizer
from headlab.nmt.translate import translate
from support.bad_input import (
    SENTENCES,
    files_under,
    forbid_model_loading,
    save_tiny_marian,
    save_tiny_pruned,
    unwritable,
    world_readable_dir,
)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("nmt-models")
    return save_tiny_marian(root / "full"), save_tiny_pruned(root / "pruned")


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "src.txt"
    path.write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    return path


def test_translate_and_evaluate_a_pruned_model(models, source, tmp_path, capsys):
    """Regression: nmt translate/evaluate used MarianMTModel.from_pretrained and crashed with a
    size mismatch on every pruned directory; they now use headlab's one loader."""
    _, pruned = models
    out = tmp_path / "out.txt"
    assert main(["nmt", "translate", "--model", str(pruned), "--input", str(source), "--output", str(out),
                 "--beam", "2"]) == 0
    expected = translate(load_model(str(pruned)), load_tokenizer(pruned), SENTENCES, beam=2)
    assert out.read_text(encoding="utf-8").splitlines() == expected
    assert main(["nmt", "evaluate", "--model", str(pruned), "--src", str(source), "--ref", str(source),
                 "--beam", "1", "--json"]) == 0
    assert '"bleu"' in capsys.readouterr().out


def test_the_model_is_a_positional_argument_as_elsewhere_and_model_the_older_form(models, source, tmp_path, capsys,
                                                                                   monkeypatch):
    """Regression: nmt translate, nmt evaluate and lm evaluate took --model only, where every other
    command takes MODEL first; both forms now give the same run."""
    import headlab.loading

    full, _ = models
    for n, model in enumerate(([str(full)], ["--model", str(full)], [f"--model={str(full)}"])):
        assert main(["nmt", "translate", *model, "--input", str(source), "--beam", "1",
                     "--output", str(tmp_path / f"{n}.txt")]) == 0
        assert main(["nmt", "evaluate", *model, "--src", str(source), "--ref", str(source), "--beam", "1",
                     "--json"]) == 0
    assert (tmp_path / "0.txt").read_text() == (tmp_path / "1.txt").read_text() == (tmp_path / "2.txt").read_text()
    capsys.readouterr()
    assert main(["--debug", "nmt", "translate", "--input", str(source), "--model", str(tmp_path / "none")]) == 2
    assert f"model {tmp_path / 'none'}: no such directory" in capsys.readouterr().err
    monkeypatch.setattr(headlab.loading, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    for model in ([str(full)], ["--model", str(full)]):
        assert main(["lm", "evaluate", *model, "--text", str(source), "--max-tokens", "0"]) == 2
        assert "--max-tokens must be at least 1, got 0" in capsys.readouterr().err


def test_long_input_is_cut_and_the_user_told(models, tmp_path, capsys):
    """Regression: a sentence longer than the model's positions was cut without a word."""
    full, _ = models
    long = " ".join(["dog"] * 100)  # 101 tokens with </s>; the model has 64 positions
    source = tmp_path / "long.txt"
    source.write_text(f"Cats sleep here .\n{long}\n", encoding="utf-8")
    assert main(["nmt", "translate", "--model", str(full), "--input", str(source), "--beam", "1",
                 "--output", str(tmp_path / "o.txt")]) == 0
    err = capsys.readouterr().err
    assert "1 of 2 inputs is longer than 64 tokens and was cut to 64 (line 2); only its first 64 tokens" in err
    truncated = []
    translate(load_model(str(full)), load_tokenizer(full), ["Cats", long, long], beam=1, truncated=truncated)
    assert truncated == [1, 2]


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("row", ["missing", "empty", "directory", "non-utf8", "truncated-gzip"])
def test_bad_input_file_is_refused_before_the_model_loads(row, models, tmp_path, capsys, monkeypatch):
    full, _ = models
    good = "\n".join(SENTENCES).encode()
    path = {
        "missing": lambda: tmp_path / "none.txt",
        "empty": lambda: _write(tmp_path / "empty.txt", b"\n \n"),
        "directory": lambda: tmp_path,
        "non-utf8": lambda: _write(tmp_path / "latin1.txt", good + b"\nder B\xe4r schl\xe4ft\n"),
        "truncated-gzip": lambda: _write(tmp_path / "cut.txt.gz", gzip.compress(good * 50)[:-20]),
    }[row]()
    expected = {"missing": "no such file", "empty": "the file is empty", "directory": "a directory, not a file",
                "non-utf8": "line 5: not valid UTF-8", "truncated-gzip": "cannot read"}[row]
    forbid_model_loading(monkeypatch)
    out = tmp_path / "out.txt"
    assert main(["nmt", "translate", "--model", str(full), "--input", str(path), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and expected in err and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize("row", ["crlf", "bom"])
def test_crlf_and_bom_translate_like_plain_text(row, models, tmp_path):
    full, _ = models
    text = "\n".join(SENTENCES) + "\n"
    data = text.replace("\n", "\r\n").encode() if row == "crlf" else b"\xef\xbb\xbf" + text.encode()
    plain, odd = tmp_path / "plain.txt", _write(tmp_path / f"{row}.txt", data)
    plain.write_text(text, encoding="utf-8")
    for path in (plain, odd):
        assert main(["nmt", "translate", "--model", str(full), "--input", str(path), "--beam", "1",
                     "--output", str(path) + ".out"]) == 0
    assert (tmp_path / f"{row}.txt.out").read_text() == (tmp_path / "plain.txt.out").read_text()


def test_mismatched_parallel_files_are_refused(models, source, tmp_path, capsys, monkeypatch):
    full, _ = models
    ref = _write(tmp_path / "ref.txt", b"one line\n")
    forbid_model_loading(monkeypatch)
    assert main(["nmt", "evaluate", "--model", str(full), "--src", str(source), "--ref", str(ref)]) == 2
    err = capsys.readouterr().err
    assert f"--src {source} has 4 lines, --ref {ref} has 1 line:" in err


@pytest.mark.parametrize("command", ["translate", "evaluate"])
def test_output_naming_an_input_is_refused(command, models, source, tmp_path, capsys, monkeypatch):
    """Regression: --output naming --input (or --src, --ref) overwrote the text with its translation."""
    full, _ = models
    text = tmp_path / "text.txt"
    text.write_bytes(source.read_bytes())
    forbid_model_loading(monkeypatch)
    files = ["--input", str(text)] if command == "translate" else ["--src", str(source), "--ref", str(text)]
    flag = "--input" if command == "translate" else "--ref"
    assert main(["nmt", command, "--model", str(full), *files, "--output", str(tmp_path / "." / "text.txt")]) == 2
    assert f"the same file as {flag} {text}; writing it would destroy the input" in capsys.readouterr().err
    assert text.read_bytes() == source.read_bytes()


@pytest.mark.parametrize("text", ["", "\n  \n"])
def test_empty_standard_input_is_refused_like_an_empty_file(text, models, capsys, monkeypatch):
    """Regression: `nmt translate --input -` on an empty stdin said "translated 0 lines", exit 0."""
    import io
    import sys

    full, _ = models
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    forbid_model_loading(monkeypatch)
    assert main(["nmt", "translate", "--model", str(full), "--input", "-"]) == 2
    assert "--input -: standard input is empty" in capsys.readouterr().err


def test_model_without_tokenizer_is_refused(tmp_path, source, capsys):
    bare = save_tiny_marian(tmp_path / "bare", tokenizer=False)
    assert main(["nmt", "translate", "--model", str(bare), "--input", str(source)]) == 2
    assert f"no tokenizer in {bare}" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["translate", "evaluate"])
def test_tokenizer_of_a_bigger_vocabulary_is_refused(command, tmp_path, source, capsys):
    """Regression: a model directory holding another model's tokenizer (more tokens than its
    embeddings) ended in an IndexError traceback (internal error) from the embedding lookup."""
    from support.treebank import word_tokenizer

    model = save_tiny_marian(tmp_path / "m", tokenizer=False)
    word_tokenizer([f"w{i}" for i in range(150)] + [w for s in SENTENCES for w in s.split()],
                   max_vocab=400).save_pretrained(model)
    files = ["--input", str(source)] if command == "translate" else ["--src", str(source), "--ref", str(source)]
    assert main(["nmt", command, str(model), *files]) == 2
    err = capsys.readouterr().err
    assert "more than the model's 99 embeddings" in err and "Traceback" not in err


@pytest.mark.parametrize("command", ["translate", "evaluate"])
@pytest.mark.parametrize("row", ["missing-tokenizer-json", "empty-tokenizer-json", "truncated-tokenizer-json"])
def test_damaged_tokenizer_json_is_refused(row, command, tmp_path, source, capsys, monkeypatch):
    """Regression (issue 32 row 8): a missing, empty or cut tokenizer.json was a ValueError or
    JSONDecodeError traceback ("internal error", exit 1) from transformers."""
    model = save_tiny_marian(tmp_path / "model")
    tokenizer = model / "tokenizer.json"
    if row == "missing-tokenizer-json":
        tokenizer.unlink()  # tokenizer_config.json stays
    else:
        tokenizer.write_bytes(b"" if row == "empty-tokenizer-json" else tokenizer.read_bytes()[:100])
    forbid_model_loading(monkeypatch)
    files = ["--input", str(source)] if command == "translate" else ["--src", str(source), "--ref", str(source)]
    assert main(["nmt", command, "--model", str(model), *files]) == 2
    err = capsys.readouterr().err
    expected = {"missing-tokenizer-json": f"no usable tokenizer in {model}: tokenizer.json is missing",
                "empty-tokenizer-json": f"{tokenizer}: the file is empty",
                "truncated-tokenizer-json": f"{tokenizer}: not a tokenizer"}[row]
    assert expected in err and "Traceback" not in err and "internal error" not in err


@pytest.mark.parametrize("option", [["--beam", "0"], ["--batch-size", "0"], ["--threads", "-1"]])
def test_options_out_of_range(option, models, source, capsys, monkeypatch):
    forbid_model_loading(monkeypatch)
    assert main(["nmt", "translate", "--model", str(models[0]), "--input", str(source), *option]) == 2
    assert f"{option[0]} must be at least" in capsys.readouterr().err


def test_unwritable_output_is_refused_before_any_work(capsys, monkeypatch):
    """Regression: translate found a read-only --output only after translating everything."""
    with world_readable_dir() as root:
        model = save_tiny_marian(root / "model")
        source = _write(root / "src.txt", "\n".join(SENTENCES).encode())
        forbid_model_loading(monkeypatch)
        with unwritable(root / "ro") as ro:
            code = main(["nmt", "translate", "--model", str(model), "--input", str(source),
                         "--output", str(ro / "out.txt")])
        assert code == 2
        err = capsys.readouterr().err
        assert f"--output {ro / 'out.txt'}: cannot write" in err and "Traceback" not in err
        assert files_under(ro) == set()


def test_train_refuses_mismatched_validation_files_before_reading_the_training_data(source, tmp_path, capsys,
                                                                                     monkeypatch):
    """Regression: the validation pair's differing lengths were found only after the training data
    had been read, and the message named no option."""
    import headlab.nmt.recipe

    ref = _write(tmp_path / "ref.txt", b"one line\n")
    monkeypatch.setattr(headlab.nmt.recipe, "run_recipe", lambda *a, **k: pytest.fail("the training started"))
    out = tmp_path / "run"
    assert main(["nmt", "train", "--train-src", str(source), "--train-tgt", str(source), "--valid-src", str(source),
                 "--valid-tgt", str(ref), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--valid-src/--valid-tgt: parallel files differ in length: {source} has 4 lines" in err
    assert "Traceback" not in err and not out.exists()


@pytest.mark.parametrize("which", ["epoch-x", "epoch-", "epoch-0", "epoch--1", "epoch-1.5"])
def test_export_of_an_epoch_that_is_not_a_number(which, tmp_path, capsys):
    """Regression: `lm export`/`nmt export --checkpoint epoch-x` was an internal error (ValueError
    from int()), and `epoch--1` looked for `epochs/epoch--01`."""
    (tmp_path / "run" / "epochs" / "epoch-001").mkdir(parents=True)
    (tmp_path / "run" / "epochs" / "epoch-001" / "model.safetensors").write_bytes(b"")
    for command in ("lm", "nmt"):
        assert main([command, "export", "--run", str(tmp_path / "run"), "--to", str(tmp_path / "out"),
                     "--checkpoint", which]) == 2
        err = capsys.readouterr().err
        assert f"--checkpoint {which}: not an epoch number; expected epoch-N with N >= 1" in err and "internal" not in err
    assert not (tmp_path / "out").exists()


def test_export_takes_a_checkpoint_of_the_run_never_a_path(tmp_path, capsys):
    """Regression: `lm export`/`nmt export --checkpoint ../x` exported a checkpoint outside --run
    (another run's weights, recorded in export.json as this run's). --checkpoint names one of the
    run's checkpoints; a path, or a link out of the run, is refused naming the option."""
    for checkpoint in ("run/best", "run/epochs/epoch-001", "other/best"):
        (tmp_path / checkpoint).mkdir(parents=True)
        (tmp_path / checkpoint / "model.safetensors").write_bytes(b"")
    (tmp_path / "run" / "linked").symlink_to(tmp_path / "other" / "best")
    run, out = tmp_path / "run", tmp_path / "out"
    for command in ("lm", "nmt"):
        for which in ("../other/best", str(tmp_path / "other" / "best"), "best/", "./best", "..", "."):
            assert main([command, "export", "--run", str(run), "--to", str(out), "--checkpoint", which]) == 2
            assert (f"--checkpoint {which}: not the name of a checkpoint of the run (best, epoch-1); a path, inside "
                    f"{run} or not, is not one") in capsys.readouterr().err
        assert main([command, "export", "--run", str(run), "--to", str(out), "--checkpoint", "linked"]) == 2
        assert f"--checkpoint linked: {run / 'linked'} leads out of the run directory {run}" in capsys.readouterr().err
        assert main([command, "export", "--run", str(run), "--to", str(out), "--checkpoint", "last"]) == 2
        assert (f"--checkpoint last: no checkpoint 'last' in {run} (looked for {run / 'last' / 'model.safetensors'}; "
                "the run has best, epoch-1)") in capsys.readouterr().err
    assert not out.exists()


@contextmanager
def _locked_by_another_process(run):
    """``run``'s lock held by a live process other than this one (a training, say), for the block:
    yields its pid; the process is killed after the block, so that its lock is stale."""
    from headlab.lock import LOCK_FILE, _start_time

    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (run / LOCK_FILE).parent.mkdir()
        (run / LOCK_FILE).write_text(json.dumps({"pid": holder.pid, "host": socket.gethostname(),
                                                 "pid_start": _start_time(holder.pid), "started": "now"}))
        yield holder.pid
    finally:
        holder.kill()
        holder.wait()


def _lock_holders_at_each_call(monkeypatch, module, name, run) -> list:
    """``module.name`` replaced by a spy that calls it and records, at each call, the pid that holds
    ``run``'s lock: the list it fills."""
    from headlab.lock import LOCK_FILE

    holders = []
    real = getattr(module, name)

    def spy(*args, **kwargs):
        holders.append(json.loads((run / LOCK_FILE).read_text())["pid"])
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return holders


def test_average_holds_the_runs_lock(tmp_path, capsys, monkeypatch):
    """Regression: `nmt average` wrote DIR/averaged-lastN without the run's lock, so a training still
    writing DIR (which averages into the same place when it reaches --epochs) or a second average
    could interleave their writes. It now holds DIR/.headlab/lock while it reads and writes."""
    import headlab.training.loop
    from headlab.lock import LOCK_FILE

    run = tmp_path / "run"
    for epoch in (1, 2):
        save_tiny_marian(run / "epochs" / f"epoch-{epoch:03d}")
    shutil.copytree(run / "epochs" / "epoch-001", run / "tokenizer")
    with _locked_by_another_process(run) as pid:
        assert main(["nmt", "average", "--run", str(run), "--last", "2"]) == 2
        assert f"--run {run} is in use by another headlab run (pid {pid}" in capsys.readouterr().err
        assert not (run / "averaged-last2").exists() and not (run / ".averaged-last2.tmp").exists()
    holders = _lock_holders_at_each_call(monkeypatch, headlab.training.loop, "average_checkpoints", run)
    assert main(["nmt", "average", "--run", str(run), "--last", "2"]) == 0  # the holder is gone: stale, taken over
    assert holders == [os.getpid()] and not (run / LOCK_FILE).exists()
    assert (run / "averaged-last2" / "model.safetensors").is_file()


def test_export_holds_the_runs_lock(tmp_path, capsys, monkeypatch):
    """Regression (qa6): `nmt export` / `lm export` read the run without its lock, so an export beside
    a training still writing the run could copy a half-written checkpoint. Like `nmt average`, they
    now hold DIR/.headlab/lock while they read the run, and refuse while another run holds it."""
    import headlab.nmt.export
    from headlab.lock import LOCK_FILE

    run = tmp_path / "run"
    save_tiny_marian(run / "last")
    with _locked_by_another_process(run) as pid:
        for trainer in ("nmt", "lm"):
            out = tmp_path / f"{trainer}-model"
            assert main([trainer, "export", "--run", str(run), "--checkpoint", "last", "--to", str(out)]) == 2
            assert f"--run {run} is in use by another headlab run (pid {pid}" in capsys.readouterr().err
            assert not out.exists()
    holders = _lock_holders_at_each_call(monkeypatch, headlab.nmt.export, "_load_checkpoint", run)
    out = tmp_path / "model"
    assert main(["nmt", "export", "--run", str(run), "--checkpoint", "last", "--to", str(out)]) == 0  # stale: taken over
    assert holders == [os.getpid()] and not (run / LOCK_FILE).exists()
    assert (out / "model.safetensors").is_file()
    assert main(["nmt", "export", "--run", str(tmp_path / "none"), "--checkpoint", "last", "--to", str(out)]) == 2
    assert not (tmp_path / "none").exists()  # refused before the lock: nothing made in a wrong --run


def test_average_of_more_epochs_than_the_run_has_counts_them(tmp_path, capsys):
    """Regression: "holds 1 epoch checkpoints" (plural for one)."""
    (tmp_path / "run" / "epochs" / "epoch-001").mkdir(parents=True)
    assert main(["nmt", "average", "--run", str(tmp_path / "run"), "--last", "2"]) == 2
    assert "epochs holds 1 epoch checkpoint; cannot average the last 2" in capsys.readouterr().err
    assert not (tmp_path / "run" / ".headlab").exists()  # refused before the lock: nothing made in --run


def test_export_help_says_the_default_dtype(capsys):
    """Regression: `lm export` writes float16 and `nmt export` float32 by default, and neither
    --help said so (docs/lm.md wrote `[--dtype float16]` as if it were not the default)."""
    for command, dtype in (("lm", "float16"), ("nmt", "float32")):
        with pytest.raises(SystemExit):
            main([command, "export", "--help"])
        assert f"the exported weights' dtype (default: {dtype})" in " ".join(capsys.readouterr().out.split())
