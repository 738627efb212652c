"""The second bad-input catalogue (issue 32), output directories, text input, options: each case
feeds one bad input and asserts the exit code, that the message names the file or option, and
that nothing of the user's is lost. One test per row of docs/cli.md's catalogue."""

import errno
import gzip
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import headlab.functions.analysis
from headlab.cli import main
from headlab.lock import LOCK_FILE, _start_time
from headlab.outdir import FILES
from support.bad_input import SENTENCES, files_under, forbid_model_loading, save_tiny_marian
from support.treebank import SAMPLE_CONLLU

SRC = str(Path(__file__).resolve().parents[1] / "src")


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


def _functions(inputs, out, *extra):
    return ["functions", str(inputs / "model"), "--conllu", str(inputs / "tb.conllu"), "--out", str(out),
            "--no-progress", "--no-figures", *extra]


def _importance(inputs, out, *extra):
    return ["importance", str(inputs / "model"), "--data", str(inputs / "src.txt"), "--out", str(out),
            "--no-progress", "--n-sentences", "2", *extra]


def test_functions_rerun_into_the_out_of_an_earlier_run(inputs, tmp_path, capsys):
    """Regression: a rerun without --aggregate (or with another model) wrote beside the earlier
    run's files and left its aggregate/ there, as if it were this run's."""
    out = tmp_path / "out"
    assert main(_functions(inputs, out, "--aggregate")) == 0
    first = files_under(out)
    assert any(name.startswith("aggregate/") for name in first)
    capsys.readouterr()
    assert main(_functions(inputs, out)) == 2
    assert f"--out {out}: holds the results of an earlier run (functions of {inputs / 'model'}" in capsys.readouterr().err
    assert files_under(out) == first
    assert main(_functions(inputs, out, "--overwrite")) == 0
    now = files_under(out)
    assert not any(name.startswith("aggregate") for name in now)  # only this run's files
    listed = json.loads((out / FILES).read_text())
    assert listed["complete"] and set(listed["files"]) == now - {str(FILES)}


def test_importance_rerun_with_fewer_methods_into_the_same_out(inputs, tmp_path, capsys):
    """Regression: gradient.json of the earlier run stayed beside the new confidence.json."""
    out = tmp_path / "out"
    assert main(_importance(inputs, out, "--method", "confidence,gradient")) == 0
    assert (out / "gradient.json").is_file()
    assert main(_importance(inputs, out, "--method", "confidence")) == 2
    assert main(_importance(inputs, out, "--method", "confidence", "--overwrite")) == 0
    assert files_under(out) == {"confidence.json", str(FILES)}


@pytest.mark.parametrize("command", ["functions", "importance"])
@pytest.mark.parametrize("mine", ["README.md", "summary.json", "symlink summary.json"])
def test_results_into_an_out_holding_a_users_file(command, mine, inputs, tmp_path, capsys, monkeypatch):
    """Regression: functions and importance overwrote a user's README.md and summary.json in --out,
    also through a symlink; now refused before any work, with or without --overwrite."""
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere.json"
    out.mkdir()
    name = mine.split()[-1]
    elsewhere.write_text("my own\n")
    if mine.startswith("symlink"):
        (out / name).symlink_to(elsewhere)
    else:
        (out / name).write_text("my own\n")
    forbid_model_loading(monkeypatch)
    run = _functions if command == "functions" else _importance
    for extra in ((), ("--overwrite",)):
        assert main(run(inputs, out, *extra)) == 2
        assert f"--out {out}: holds files headlab did not write ({name})" in capsys.readouterr().err
    assert (out / name).read_text() == "my own\n" and elsewhere.read_text() == "my own\n"
    assert files_under(out) == {name}


@pytest.fixture
def sleeper():
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield process
    process.kill()
    process.wait()


@pytest.mark.parametrize("command", ["functions", "importance"])
def test_results_into_an_out_another_run_is_writing(command, inputs, tmp_path, capsys, monkeypatch, sleeper):
    """Regression: functions and importance took no lock; two runs on one --out both exited 0 and
    the results of one of them vanished."""
    out = tmp_path / "out"
    (out / LOCK_FILE).parent.mkdir(parents=True)
    (out / LOCK_FILE).write_text(json.dumps({"pid": sleeper.pid, "host": socket.gethostname(),
                                             "pid_start": _start_time(sleeper.pid), "started": "2026-01-01T00:00:00"}))
    forbid_model_loading(monkeypatch)
    run = _functions if command == "functions" else _importance
    assert main(run(inputs, out)) == 2
    assert f"--out {out} is in use by another headlab run (pid {sleeper.pid}" in capsys.readouterr().err


def _fail_after_two_files(error):
    """analysis.save that writes two result files, then stops as Ctrl-C or a full disk would."""
    save = headlab.functions.analysis.HeadAnalysis.save

    def run(self, directory, figures=True):
        written = save(self, directory, figures)
        assert len(written) > 2
        for path in written[2:]:
            path.unlink()
        raise error
    return run


@pytest.mark.parametrize("error,code,said", [
    (KeyboardInterrupt(), 130, "interrupted; nothing was kept"),
    (OSError(errno.ENOSPC, "No space left on device"), 1, "error: No space left on device"),
])
def test_functions_stopped_while_writing_its_results(error, code, said, inputs, tmp_path, capsys, monkeypatch):
    """Regression: Ctrl-C or a full disk in functions' write phase left 2-17 result files without
    summary.json while the message said that nothing was kept. A rerun's old results stay whole."""
    fresh, earlier = tmp_path / "fresh", tmp_path / "earlier"
    assert main(_functions(inputs, earlier)) == 0
    before = {name: (earlier / name).read_bytes() for name in files_under(earlier)}
    monkeypatch.setattr(headlab.functions.analysis.HeadAnalysis, "save", _fail_after_two_files(error))
    assert main(_functions(inputs, fresh)) == code
    assert said in capsys.readouterr().err
    assert not fresh.exists()
    assert main(_functions(inputs, earlier, "--overwrite")) == code
    assert {name: (earlier / name).read_bytes() for name in files_under(earlier)} == before


def test_functions_interrupted_after_writing_says_so(inputs, tmp_path, capsys, monkeypatch):
    """The interruption after the results are in place says they are kept (not "nothing was kept")."""
    out = tmp_path / "out"
    monkeypatch.setattr(headlab.functions.analysis, "describe_heads", lambda analysis: (_ for _ in ()).throw(
        KeyboardInterrupt()))
    assert main(_functions(inputs, out)) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"headlab functions: interrupted; the results were written to {out} in full before the interruption")
    assert "summary.json" in files_under(out)


@pytest.mark.parametrize("mine", ["figures/plot.png", "functions/notes.md", "attention/x.json", "index.html"])
def test_analyze_force_into_an_out_holding_a_users_folder(mine, inputs, tmp_path, capsys, monkeypatch):
    """Regression: analyze --force deleted a user's figures/, functions/ and attention/ (a stage
    clears its folder before it runs) and overwrote index.html."""
    out = tmp_path / "mine"
    (out / mine).parent.mkdir(parents=True, exist_ok=True)
    (out / mine).write_text("mine\n")
    (out / "notes.txt").write_text("mine too\n")
    forbid_model_loading(monkeypatch)
    assert main(["analyze", str(inputs / "model"), "--source", str(inputs / "src.txt"), "--out", str(out),
                 "--force", "--no-progress"]) == 2
    assert f"--out {out}: holds {mine.split('/')[0]} of your own, which analyze would replace" in capsys.readouterr().err
    assert files_under(out) == {mine, "notes.txt"} and (out / mine).read_text() == "mine\n"


def _results_of(out, command, files):
    """``out`` as ``headlab COMMAND`` leaves it: ``files`` listed in .headlab/files.json; their bytes."""
    for name in files:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("{}\n")
    (out / FILES).parent.mkdir()
    (out / FILES).write_text(json.dumps({"headlab_version": "0.1.0", "command": command, "model": "m",
                                         "created": "2026-01-01T00:00:00+00:00", "complete": True, "files": files}))
    return {name: (out / name).read_bytes() for name in files_under(out)}


@pytest.mark.parametrize("command,files", [("functions", ["summary.json", "README.md", "positional/share.json"]),
                                           ("prune", ["config.json", "model.safetensors"])])
def test_analyze_into_an_out_holding_another_commands_results(command, files, inputs, tmp_path, capsys, monkeypatch):
    """Regression: analyze took a directory holding the results of functions, importance or prune
    apply (listed in .headlab/files.json) for its own and wrote its report among them."""
    out = tmp_path / "results"
    before = _results_of(out, command, files)
    forbid_model_loading(monkeypatch)
    assert main(["analyze", str(inputs / "model"), "--source", str(inputs / "src.txt"), "--out", str(out),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"--out {out}: holds the results of `headlab {command}`" in err and "Traceback" not in err
    assert {name: (out / name).read_bytes() for name in files_under(out)} == before


def test_another_commands_results_named_with_the_flag_that_does_not_replace_them(inputs, tmp_path, capsys,
                                                                                    monkeypatch):
    """Regression: analyze, Analysis.save and the --overwrite commands had twin checks with two
    wordings, and analyze's named neither the flag nor the command refused; one check now says
    which flag does not replace the results, for each."""
    from headlab.api import _check_directory
    from headlab.errors import HeadlabError

    forbid_model_loading(monkeypatch)
    for command, argv, flag in [
            ("analyze", lambda out: ["analyze", str(inputs / "model"), "--source", str(inputs / "src.txt"), "--out",
                                     str(out), "--force", "--no-progress"], "--force"),
            ("functions", lambda out: _functions(inputs, out, "--overwrite"), "--overwrite")]:
        out = tmp_path / command
        before = _results_of(out, "prune", ["config.json", "model.safetensors"])
        assert main(argv(out)) == 2
        err = capsys.readouterr().err
        assert (f"--out {out}: holds the results of `headlab prune` of m (config.json, model.safetensors), not of "
                f"`headlab {command}`; {flag} does not replace another command's results: choose a new or empty "
                "directory") in err
        assert {name: (out / name).read_bytes() for name in files_under(out)} == before
    out = tmp_path / "api"
    _results_of(out, "importance", ["confidence.json"])
    with pytest.raises(HeadlabError, match=f"^{out}: holds the results of `headlab importance` of m "
                                           r"\(confidence.json\), not of `headlab analyze`; overwrite=True does not"):
        _check_directory(out, True)


# ----------------------------------------------------------------------------- text input

TEXT = "\n".join(SENTENCES) + "\n"
ENCODED = {
    "utf-16le without a bom": (TEXT.encode("utf-16-le"), "looks like UTF-16LE without a byte order mark"),
    "utf-16be without a bom": (TEXT.encode("utf-16-be"), "looks like UTF-16BE without a byte order mark"),
    "utf-16 with a bom": (TEXT.encode("utf-16"), "is UTF-16LE (it starts with that byte order mark)"),
    "utf-32le without a bom": (TEXT.encode("utf-32-le"), "looks like UTF-32LE without a byte order mark"),
    "utf-32 with a bom": (TEXT.encode("utf-32"), "is UTF-32LE (it starts with that byte order mark)"),
    "cr-only line ends": (TEXT.replace("\n", "\r").encode(), "its lines end in a CR alone"),
    "nul bytes": (b"The dog\x00\x00\x00 barks\x00.\n", "holds NUL bytes"),
    # badinput: one stray NUL in UTF-8 text was "looks like UTF-16LE ...", whose iconv makes garbage of it
    "a stray nul in utf-8 text": (b"The dog barks .\nA cat\x00 sleeps .\n",
                                  "holds NUL bytes (1 in its first 32 bytes, the first on line 2)"),
    # audit31: said "holds NUL bytes: not a UTF-8 text file" (or "not valid UTF-8"), not what was wrong
    "gzip without .gz": (gzip.compress(TEXT.encode(), mtime=0), "gzip-compressed, yet its name does not end in .gz"),
}


@pytest.mark.parametrize("case", ENCODED)
def test_text_input_in_another_encoding_or_with_cr_only_line_ends(case, inputs, tmp_path, capsys, monkeypatch):
    """Regression: UTF-16LE without a BOM was read as UTF-8 (exit 0, garbage translations, lm
    perplexity 3.6M); CR-only line ends merged every sentence into one. Refused before work,
    naming the file, by the check of every command and by the library's readers."""
    from headlab.data import read_lines
    from headlab.data.treebank import read_conllu
    from headlab.errors import HeadlabError

    data, said = ENCODED[case]
    path = tmp_path / "text.txt"
    path.write_bytes(data)
    forbid_model_loading(monkeypatch)
    assert main(_importance(inputs, tmp_path / "out", "--data", str(path))) == 2
    err = capsys.readouterr().err
    assert f"--source {path}: " in err and said in err and "Traceback" not in err
    for read in (read_lines, lambda p: list(read_conllu(p))):
        with pytest.raises(HeadlabError, match=f"{path}: .*{said.split('(')[0].strip()}"):
            read(path)
    assert not (tmp_path / "out").exists()


def test_a_gz_file_that_is_not_gzip(inputs, tmp_path, capsys, monkeypatch):
    """Regression (audit31): "cannot read it (Not a gzipped file (b'Th'))" did not say what to do."""
    from headlab.data import read_lines
    from headlab.errors import HeadlabError

    path = tmp_path / "text.txt.gz"
    path.write_text(TEXT, encoding="utf-8")
    forbid_model_loading(monkeypatch)
    assert main(_importance(inputs, tmp_path / "out", "--data", str(path))) == 2
    err = capsys.readouterr().err
    assert f"--source {path}: its name ends in .gz, yet it is not gzip-compressed; rename it without .gz" in err
    with pytest.raises(HeadlabError, match="its name ends in .gz, yet it is not gzip-compressed"):
        read_lines(path)


def test_crlf_and_utf8_bom_still_read_as_before(tmp_path):
    """What held (docs/cli.md): CRLF line ends and a UTF-8 BOM read like plain UTF-8."""
    from headlab.data import read_lines

    path = tmp_path / "crlf.txt"
    path.write_bytes(b"\xef\xbb\xbf" + TEXT.replace("\n", "\r\n").encode())
    assert read_lines(path) == SENTENCES


def _nmt_bleu(hyp: str, ref, **popen):
    popen.setdefault("text", True)
    return subprocess.run([sys.executable, "-m", "headlab", "nmt", "bleu", "--hyp", hyp, "--ref", str(ref), "--json"],
                          capture_output=True, env={**os.environ, "PYTHONPATH": SRC}, timeout=120, **popen)


def test_input_from_dev_stdin_a_process_substitution_and_dev_null(tmp_path):
    """Regression: `/dev/stdin`, `<(cat f)` and `/dev/null` were "file not found". A pipe is read
    once, whole (so the check before work and the reader see the same lines); /dev/null is empty."""
    ref = tmp_path / "ref.txt"
    ref.write_text(TEXT, encoding="utf-8")
    done = _nmt_bleu("/dev/stdin", ref, input=TEXT)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["bleu"] == pytest.approx(100.0)  # every line read, none lost
    read, write = os.pipe()
    os.write(write, TEXT.encode())
    os.close(write)
    done = _nmt_bleu(f"/dev/fd/{read}", ref, pass_fds=(read,))  # what bash's <(cat f) hands over
    os.close(read)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["bleu"] == pytest.approx(100.0)  # every line read, none lost
    done = _nmt_bleu("/dev/null", ref)
    assert done.returncode == 2 and "--hyp /dev/null: the file is empty" in done.stderr
    done = _nmt_bleu("/dev/stdin", ref, input=TEXT.encode("utf-16-le"), text=False)  # a pipe is checked as well
    assert done.returncode == 2 and b"--hyp /dev/stdin: the file looks like UTF-16LE" in done.stderr


# ----------------------------------------------------------------------------- API misuse


@pytest.mark.parametrize("capture", ["capture_attention", "stream_attention"])
def test_capture_attention_on_a_model_in_training_mode(capture):
    """Regression: capture_attention on a model in training mode returned post-dropout attention
    (rows summing to 0.33-1.11, 29% zeros) without a word. It runs the model in evaluation mode
    inside and gives each module its own mode back (a frozen, eval-mode part included)."""
    import torch

    from headlab.capture import capture_attention, stream_attention
    from support.models import tiny_model

    model = tiny_model("bert")
    model.config.attention_probs_dropout_prob = 0.5
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.5
    model.train()
    frozen = model.bert.embeddings
    frozen.eval()
    modes = {name: m.training for name, m in model.named_modules()}
    ids = torch.randint(5, 50, (2, 9))
    rows = []
    if capture == "capture_attention":
        with torch.no_grad(), capture_attention(model) as record:
            model(input_ids=ids)
        rows = [probs.sum(-1) for probs in record.values()]
    else:
        def on_chunk(block, chunk):
            rows.append(chunk.probs.sum(-1))

        with torch.no_grad(), stream_attention(model, on_chunk, query_chunk=4):
            model(input_ids=ids)
    assert rows and all(torch.allclose(r, torch.ones_like(r), atol=1e-5) for r in rows)
    assert {name: m.training for name, m in model.named_modules()} == modes


# ----------------------------------------------------------------------------- options


@pytest.mark.parametrize("option,value,said", [
    ("--lr", "nan", "--lr must be a number > 0, got nan"),
    ("--lr", "0", "--lr must be > 0, got 0.0"),
    ("--label-smoothing", "2", "--label-smoothing must be in [0, 1), got 2.0"),
    ("--dropout", "inf", "--dropout must be in [0, 1), got inf"),
])
def test_nmt_train_with_an_option_out_of_its_declared_range(option, value, said, inputs, tmp_path, capsys):
    """Regression: `--lr nan` and `--label-smoothing 2` ended in a traceback after the work had
    started. Every option declared with a range (headlab.options) is checked right after parsing."""
    out = tmp_path / "run"
    args = ["nmt", "train", "--train-src", str(inputs / "src.txt"), "--train-tgt", str(inputs / "src.txt"),
            "--out", str(out), option, value]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"headlab nmt train: error: {said}" in err and "Traceback" not in err
    assert not out.exists()


def test_importance_with_a_negative_lrp_seed(inputs, tmp_path, capsys, monkeypatch):
    """Regression: `--lrp-seed -1` failed in numpy's generator after the model had loaded and the
    other measures had run."""
    forbid_model_loading(monkeypatch)
    assert main(_importance(inputs, tmp_path / "out", "--lrp-seed", "-1")) == 2
    assert "headlab importance: error: --lrp-seed must be at least 0, got -1" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_device_mps_on_a_machine_without_one(inputs, tmp_path, capsys):
    """Regression: `--device mps` on Linux passed the device check and crashed in torch."""
    import torch

    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        pytest.skip("this machine has an MPS device")
    assert main(_importance(inputs, tmp_path / "out", "--device", "mps")) == 2
    assert "--device mps: no MPS device is available here" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("extra,said", [
    (["--prune", "--prune-gates", "bogus"], "--prune-gates bogus: unknown kind 'bogus'"),
    (["--prune", "--prune-keeps", "999"], "--prune-keeps 999: each budget must be between 1 and the 8 gated heads"),
    (["--prune", "--prune-keeps", "0"], "--prune-keeps must be at least 1, got 0"),
    (["--prune", "--prune-gate-lr", "nan"], "--prune-gate-lr must be a number > 0, got nan"),
    (["--prune", "--prune-init-log-alpha", "inf"], "--prune-init-log-alpha must be finite, got inf"),
    (["--lrp-seed", "-1"], "--lrp-seed must be at least 0, got -1"),
    # Without --prune too: the sweep's options decide whether an earlier sweep is kept (its stage key)
    (["--prune-gates", ","], "--prune-gates ',': an empty list"),
    (["--prune-gates", "bogus"], "--prune-gates bogus: unknown kind 'bogus'"),
    (["--prune-keeps", "0"], "--prune-keeps must be at least 1, got 0"),
])
def test_analyze_with_out_of_range_prune_options(extra, said, inputs, tmp_path, capsys, monkeypatch):
    """Regression: analyze started work on out-of-range --prune-* options, failed the prune stage
    after the others had run and exited 1 with an empty report; now exit 2 before any work."""
    forbid_model_loading(monkeypatch)
    out = tmp_path / "out"
    assert main(["analyze", str(inputs / "model"), "--source", str(inputs / "src.txt"), "--target",
                 str(inputs / "src.txt"), "--out", str(out), "--no-progress", *extra]) == 2
    assert f"headlab analyze: error: {said}" in capsys.readouterr().err
    assert not out.exists()


def test_analyze_with_a_source_line_that_is_not_utf8_further_down(inputs, tmp_path, capsys, monkeypatch):
    """Regression: analyze checked only the start of --source; a bad line further down failed every
    stage that reads it (exit 1, an empty report written)."""
    source = tmp_path / "src.txt"
    source.write_bytes(b"The dog .\nCats sleep \xff here .\n")
    forbid_model_loading(monkeypatch)
    out = tmp_path / "out"
    assert main(["analyze", str(inputs / "model"), "--source", str(source), "--out", str(out), "--no-progress"]) == 2
    assert f"--source {source}, line 2: not valid UTF-8" in capsys.readouterr().err
    assert not out.exists()


def test_analyze_config_built_in_python_with_an_option_out_of_range(inputs, tmp_path):
    """The declared ranges hold for a config built in Python too (run_analysis checks them)."""
    from headlab.errors import HeadlabError
    from headlab.pipeline.pipeline import AnalyzeConfig, run_analysis

    config = AnalyzeConfig(str(inputs / "model"), str(inputs / "src.txt"), str(tmp_path / "out"), lrp_seed=-1)
    with pytest.raises(HeadlabError, match=r"--lrp-seed must be at least 0, got -1"):
        run_analysis(config)
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- interruptions


def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt


def test_analyze_interrupted_before_its_first_stage_finished(inputs, tmp_path, capsys, monkeypatch):
    """Regression: the line said "the finished stages are kept in DIR" when no stage had finished
    (and DIR held nothing to resume from)."""
    import headlab.pipeline.pipeline as pipeline

    monkeypatch.setitem(pipeline.RUNNERS, "confidence", _interrupt)
    out = tmp_path / "out"
    assert main(["analyze", str(inputs / "model"), "--source", str(inputs / "src.txt"), "--out", str(out),
                 "--no-progress"]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "headlab analyze: interrupted; nothing was kept (it was stopped before its first checkpoint or result was "
        "written); run it again")


_TERMINATED_IN_LRP = """
import os, signal, sys
import headlab.pipeline.pipeline as pipeline
from headlab.cli import main

def terminated(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)  # kill PID, a batch scheduler's time limit
    raise AssertionError("SIGTERM did not stop the stage")

pipeline.RUNNERS["lrp"] = terminated
sys.exit(main(sys.argv[1:]))
"""


def test_analyze_terminated_stops_as_ctrl_c_does_and_resumes(inputs, tmp_path, capsys):
    """Regression: SIGTERM ended a command at once (Python's default): no line said what was kept,
    its lock and temporary files stayed behind. Now it stops as Ctrl-C does, with exit 143."""
    out = tmp_path / "out"
    command = ["analyze", str(inputs / "model"), "--source", str(inputs / "src.txt"), "--out", str(out),
               "--no-progress", "--skip", "attention,figures,report"]
    run = subprocess.run([sys.executable, "-c", _TERMINATED_IN_LRP, *command], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": SRC}, timeout=300)
    assert run.returncode == 143, run.stderr
    assert run.stderr.strip().splitlines()[-1] == (
        f"headlab analyze: interrupted; the finished stages are kept in {out}; the same command resumes from them")
    assert not (out / LOCK_FILE).exists()
    assert main(command) == 0
    assert "confidence: reused" in capsys.readouterr().err


def test_sigterm_waits_for_a_rename_to_finish():
    """While results are moved into place SIGTERM waits, as Ctrl-C does, then stops the command."""
    import signal

    from headlab.cli import _terminate
    from headlab.outdir import _interrupts_held

    previous = signal.signal(signal.SIGTERM, _terminate)
    done = []
    try:
        with pytest.raises(KeyboardInterrupt):
            with _interrupts_held():
                os.kill(os.getpid(), signal.SIGTERM)
                done.append(True)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert done == [True]


def test_nmt_train_interrupted_before_its_first_checkpoint(inputs, tmp_path, capsys, monkeypatch):
    """Regression: "the last checkpoint in DIR is kept" for a run stopped before it wrote one."""
    import headlab.nmt.recipe

    monkeypatch.setattr(headlab.nmt.recipe, "run_recipe", _interrupt)
    out = tmp_path / "run"
    assert main(["nmt", "train", "--train-src", str(inputs / "src.txt"), "--train-tgt", str(inputs / "src.txt"),
                 "--out", str(out)]) == 130
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("headlab nmt train: interrupted; nothing was kept") and str(out) not in last
    (out / "last").mkdir(parents=True)  # a checkpoint: now the line names it
    assert main(["nmt", "train", "--train-src", str(inputs / "src.txt"), "--train-tgt", str(inputs / "src.txt"),
                 "--out", str(out), "--overwrite"]) == 130
    assert f"the last checkpoint in {out} is kept" in capsys.readouterr().err


@pytest.mark.parametrize("command,recorded,files", [
    ("functions", "prune", ["config.json", "model.safetensors"]),
    ("importance", "prune", ["config.json", "model.safetensors"]),
    ("functions", "importance", ["confidence.json"]),
    ("importance", "functions", ["summary.json", "positional/share.json"]),
])
def test_overwrite_replaces_only_the_same_commands_results(command, recorded, files, inputs, tmp_path, capsys,
                                                             monkeypatch):
    """Regression: --overwrite took any directory listed in .headlab/files.json for an earlier run
    of its own, so `functions --overwrite` into a `prune apply` model deleted the model."""
    out = tmp_path / "results"
    before = _results_of(out, recorded, files)
    forbid_model_loading(monkeypatch)
    build = _functions if command == "functions" else _importance
    assert main(build(inputs, out, "--overwrite")) == 2
    err = capsys.readouterr().err
    assert f"holds the results of `headlab {recorded}`" in err and "Traceback" not in err
    assert {name: (out / name).read_bytes() for name in files_under(out)} == before


@pytest.mark.parametrize("command,recorded,files", [
    ("functions", "prune", ["config.json", "model.safetensors"]),
    ("importance", "functions", ["summary.json", "positional/share.json"]),
])
def test_another_commands_results_without_overwrite_do_not_suggest_it(command, recorded, files, inputs, tmp_path,
                                                                       capsys, monkeypatch):
    """Regression: without --overwrite, a directory holding another command's results said "pass
    --overwrite to replace them", and --overwrite was then refused; now the first message says
    whose results they are and to choose a new or empty directory."""
    out = tmp_path / "results"
    before = _results_of(out, recorded, files)
    forbid_model_loading(monkeypatch)
    build = _functions if command == "functions" else _importance
    assert main(build(inputs, out)) == 2
    err = capsys.readouterr().err
    assert f"holds the results of `headlab {recorded}` of m" in err and f"not of `headlab {command}`" in err
    assert "choose a new or empty directory" in err and "pass --overwrite" not in err
    assert {name: (out / name).read_bytes() for name in files_under(out)} == before


@pytest.mark.parametrize("recorded, refused", [("functions", False), ("prune", True)])
def test_an_outs_manifest_is_read_once_per_check(recorded, refused, tmp_path, monkeypatch):
    """Regression: check_results_dir (and write_results) read .headlab/files.json twice, once in
    other_commands_results and once for the files it lists: two reads of a manifest another run
    may replace in between, judged as one. Each now reads it once."""
    import headlab.outdir as outdir
    from headlab.errors import HeadlabError

    out = tmp_path / "results"
    _results_of(out, recorded, ["summary.json"])
    reads = []
    listed = outdir._listed
    monkeypatch.setattr(outdir, "_listed", lambda directory: reads.append(directory) or listed(directory))
    if refused:
        with pytest.raises(HeadlabError, match="holds the results of `headlab prune`"):
            outdir.check_results_dir(out, True, command="functions")
    else:
        outdir.check_results_dir(out, True, command="functions")
    assert reads == [out]
    reads.clear()
    if not refused:
        outdir.write_results(out, lambda staging: (staging / "summary.json").write_text("[]\n"), command="functions",
                             model="m", overwrite=True)
        assert reads == [out]
