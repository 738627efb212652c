"""Bad input to ``python -m reproduction`` (docs/cli.md's contract: exit 2, one line, before the
first stage runs): unknown stages and models, missing data, unwritable outputs, a work directory
in use, a model name that would write outside ``work_dir``. (Moved from headlab's
tests/test_bad_input_cli.py and tests/test_bad_input_outdirs.py with the reproduction.)"""

import json
import os
import socket
import subprocess
import sys

import pytest

from headlab.lock import LOCK_FILE
from reproduction.cli import main
from support.bad_input import SENTENCES, forbid_model_loading, save_tiny_marian, unwritable, world_readable_dir
from support.treebank import SAMPLE_CONLLU

TEXT = "\n".join(SENTENCES) + "\n"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("reproduce-inputs")
    save_tiny_marian(root / "model")
    (root / "src.txt").write_text(TEXT, encoding="utf-8")
    (root / "tb.conllu").write_text(SAMPLE_CONLLU, encoding="utf-8")
    return root


@pytest.fixture
def sleeper():
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield process
    process.kill()
    process.wait()


def _raise(error):
    def run(*args, **kwargs):
        raise error
    return run


def _hold(directory, pid):
    from headlab.lock import _start_time

    path = directory / LOCK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'{{"pid": {pid}, "host": "{socket.gethostname()}", "pid_start": "{_start_time(pid)}", '
                    '"started": "2025-01-01T00:00:00+00:00"}')


@pytest.fixture
def repro_config(inputs, tmp_path):
    """A reproduction config over the tiny model; its data are plain text files."""
    for name in ("train", "valid", "test"):
        for lang in ("en", "de"):
            (tmp_path / f"{name}.{lang}").write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    spec = {"models": [{"name": "tiny", "path": str(inputs / "model"), "src": "en", "tgt": "de"}],
            "data": {"train": "train.{lang}", "valid": "valid.{lang}", "test": "test.{lang}"},
            "work_dir": "work", "results_dir": "results", "doc": "reproduction.md", "img_dir": "img",
            "functions": {"conllu": str(inputs / "tb.conllu")},
            "prune": {"enc": {"gates": "enc_self", "keeps": [2]}}}
    config = tmp_path / "reproduce.json"
    config.write_text(json.dumps(spec))
    return config


def _forbid_reproduction_work(monkeypatch):
    import reproduction.pipeline

    forbid_model_loading(monkeypatch)
    monkeypatch.setattr(reproduction.pipeline, "run_pipeline", _raise(AssertionError("a stage ran")))


@pytest.mark.parametrize("case,expected", [
    ("stage", "--stages: unknown stage 'prune-encc'; expected one of importance, functions"),
    ("model", "--models: {config} has no model named 'tiny2' (it has tiny)"),
    ("data", "{config}: model tiny, stage prune-enc: --valid-src {root}/test.en: no such file"),
    ("conllu", "{config}: model tiny, stage functions: --conllu {root}/tb.conllu: the file is empty"),
    ("python", "{config}: model tiny, stage specialisation: data.valid {root}/valid.de: the file is empty"),
])
def test_reproduce_refuses_bad_input_before_the_first_stage(case, expected, repro_config, capsys, monkeypatch):
    """Regression: reproduce found a data file missing for a later stage only when that stage
    ran, after hours of the earlier ones."""
    _forbid_reproduction_work(monkeypatch)
    root = repro_config.parent
    args = ["--config", str(repro_config)]
    if case == "stage":
        args += ["--stages", "importance,prune-encc"]
    elif case == "model":
        args += ["--models", "tiny,tiny2"]
    elif case == "data":
        (root / "test.en").unlink()
    elif case == "conllu":
        spec = json.loads(repro_config.read_text())
        spec["functions"]["conllu"] = "tb.conllu"
        repro_config.write_text(json.dumps(spec))
        (root / "tb.conllu").write_text("\n")
    elif case == "python":
        (root / "valid.de").write_text("")
        args += ["--stages", "specialisation"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert expected.format(config=repro_config, root=root) in err and "Traceback" not in err
    assert not (root / "work").exists()


@pytest.mark.parametrize("section", ["importance", "functions"])
def test_reproduce_refuses_a_dtype_its_claims_would_mix_with_float32(section, repro_config, capsys, monkeypatch):
    """Regression (sig34): a bfloat16 functions pass (or importance) was set beside the specialisation stage's float32
    tables in the claims, without a word."""
    _forbid_reproduction_work(monkeypatch)
    spec = json.loads(repro_config.read_text())
    spec.setdefault(section, {})["dtype"] = "bfloat16"
    repro_config.write_text(json.dumps(spec))
    assert main(["--config", str(repro_config)]) == 2
    err = capsys.readouterr().err
    assert f"{repro_config}: {section}.dtype 'bfloat16': the claims read the {section} tables beside" in err
    assert "Traceback" not in err and not (repro_config.parent / "work").exists()
    spec[section]["dtype"] = "float32"  # the default, said: taken
    repro_config.write_text(json.dumps(spec))
    from reproduction.config import load_config

    assert getattr(load_config(repro_config), section)["dtype"] == "float32"


@pytest.mark.parametrize("flag", ["--stages", "--models"])
def test_reproduce_refuses_an_empty_list(flag, repro_config, capsys, monkeypatch):
    """Regression: `--stages ,` (an empty list once split) ran every stage, as if not given."""
    _forbid_reproduction_work(monkeypatch)
    assert main(["--config", str(repro_config), flag, ","]) == 2
    err = capsys.readouterr().err
    assert f"{flag} ',': an empty list" in err and "Traceback" not in err
    assert not (repro_config.parent / "work").exists()


def test_reproduce_checks_only_the_stages_that_will_run(repro_config, capsys, monkeypatch):
    import reproduction.pipeline

    root = repro_config.parent
    (root / "test.en").unlink()  # read by the pruning stages only
    calls = []
    monkeypatch.setattr(reproduction.pipeline, "run_pipeline", lambda config, **kwargs: calls.append(kwargs) or [])
    assert main(["--config", str(repro_config), "--stages", "importance,functions"]) == 0
    marker = root / "work" / "tiny" / "stages" / "prune-enc.json"
    marker.parent.mkdir(parents=True)
    marker.write_text("{}")  # finished earlier: skipped, so its data are not needed
    assert main(["--config", str(repro_config), "--stages", "functions,prune-enc"]) == 0
    assert main(["--config", str(repro_config), "--stages", "prune-enc", "--dry-run"]) == 0
    assert len(calls) == 3
    assert main(["--config", str(repro_config), "--stages", "prune-enc", "--force"]) == 2
    assert f"--valid-src {root / 'test.en'}: no such file" in capsys.readouterr().err
    # functions-parsed parses the validation text, then reads the trees the parse wrote under work_dir
    spec = json.loads(repro_config.read_text())
    spec["parse"] = {"model": "parser", "split": "valid"}
    repro_config.write_text(json.dumps(spec))
    (root / "parser").mkdir()
    (root / "parser" / "config.cfg").write_text("[nlp]\n")
    assert main(["--config", str(repro_config), "--stages", "functions-parsed"]) == 0
    (root / "valid.en").unlink()
    assert main(["--config", str(repro_config), "--stages", "functions-parsed"]) == 2
    assert f"stage functions-parsed: --source {root / 'valid.en'}: no such file" in capsys.readouterr().err
    assert len(calls) == 4


def test_reproduce_refuses_unwritable_outputs_and_a_work_dir_in_use(repro_config, capsys, monkeypatch, sleeper):
    _forbid_reproduction_work(monkeypatch)
    root = repro_config.parent
    with world_readable_dir() as scratch:
        spec = json.loads(repro_config.read_text())
        spec.update(results_dir=str(scratch / "results"), img_dir=str(scratch / "img"),
                    doc=str(scratch / "ro" / "reproduction.md"))
        config = scratch / "reproduce.json"
        config.write_text(json.dumps(spec))
        os.chmod(config, 0o644)
        for name in ("results", "img"):  # writable by anyone; only the document's directory is not
            (scratch / name).mkdir()
            os.chmod(scratch / name, 0o777)
        with unwritable(scratch / "ro") as ro:
            assert main(["--config", str(config), "--docs-only"]) == 2
        assert f"{config}: doc {ro / 'reproduction.md'}: cannot write in {ro}" in capsys.readouterr().err
    _hold(root / "work" / "locks" / "report", sleeper.pid)  # each stage has its own lock (test_reproduce.py)
    assert main(["--config", str(repro_config), "--stages", "importance,report"]) == 2
    err = capsys.readouterr().err
    assert f"work_dir {root / 'work' / 'locks' / 'report'} is in use by another headlab run (pid {sleeper.pid}" in err


@pytest.mark.parametrize("name", ["../escape", "a/b", "..", ""])
def test_reproduce_model_named_with_dot_dot(name, inputs, tmp_path, capsys, monkeypatch):
    """Regression: a reproduce model named "../x" wrote its stages' results outside work_dir."""
    import reproduction.pipeline

    for split in ("train", "valid", "test"):
        for lang in ("en", "de"):
            (tmp_path / f"{split}.{lang}").write_text(TEXT, encoding="utf-8")
    spec = {"models": [{"name": name, "path": str(inputs / "model"), "src": "en", "tgt": "de"}],
            "data": {"train": "train.{lang}", "valid": "valid.{lang}", "test": "test.{lang}"},
            "work_dir": "work/inner", "results_dir": "results", "doc": "reproduction.md", "img_dir": "img",
            "functions": {"conllu": str(inputs / "tb.conllu")}}
    config = tmp_path / "reproduce.json"
    config.write_text(json.dumps(spec))
    forbid_model_loading(monkeypatch)
    monkeypatch.setattr(reproduction.pipeline, "run_pipeline", lambda *a, **k: pytest.fail("a stage ran"))
    assert main(["--config", str(config), "--stages", "importance"]) == 2
    assert f"{config}: models[0].name {name!r}: not a plain name" in capsys.readouterr().err
    assert not (tmp_path / "work").exists() and not (tmp_path / "escape").exists()
