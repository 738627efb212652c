"""The CLI contract (docs/cli.md): exit 0 done, 1 a failure while running, 2 bad input or usage
found before work starts, 130 interrupted with one line on what was kept; one-line messages
for the user's errors, a traceback for headlab's own bugs (and for anything with --debug).
Also: unwritable output directories refused before work, analyze refusing an empty --source and
a directory of someone else's files, and one run at a time per output directory."""

import os
import re
import socket
import subprocess
import sys
import time
from contextlib import nullcontext

import pytest

import headlab.functions.analysis
import headlab.pipeline.pipeline as pipeline
from headlab.cli import main
from headlab.errors import HeadlabError, RunFailed
from headlab.lock import LOCK_FILE, DirectoryLock
from support.bad_input import SENTENCES, files_under, forbid_model_loading, save_tiny_marian, unwritable, world_readable_dir
from support.treebank import SAMPLE_CONLLU


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-inputs")
    save_tiny_marian(root / "model")
    (root / "src.txt").write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    (root / "tb.conllu").write_text(SAMPLE_CONLLU, encoding="utf-8")
    return root


def _functions(inputs, out, *extra):
    return ["functions", str(inputs / "model"), "--conllu", str(inputs / "tb.conllu"), "--out", str(out),
            "--no-progress", "--no-figures", *extra]


def _raise(error):
    def run(*args, **kwargs):
        raise error
    return run


@pytest.mark.parametrize("error,code,expected,traceback", [
    (HeadlabError("--x: bad input"), 2, "headlab functions: error: --x: bad input", False),
    (RunFailed("nothing could be analysed"), 1, "headlab functions: error: nothing could be analysed", False),
    (PermissionError(13, "Permission denied", "/data/out/table.csv"), 1,
     "headlab functions: error: /data/out/table.csv: Permission denied", False),
    (KeyError("n_heads"), 1, "internal error (KeyError: 'n_heads'); this is a bug in headlab", True),
    (ValueError("shapes differ"), 1, "internal error (ValueError: shapes differ)", True),
])
def test_exit_codes_and_messages(error, code, expected, traceback, inputs, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(headlab.functions.analysis, "analyze_heads", _raise(error))
    assert main(_functions(inputs, tmp_path / "o")) == code
    err = capsys.readouterr().err
    assert expected in err
    assert ("Traceback (most recent call last)" in err) == traceback
    if not traceback:
        assert err.strip().splitlines()[-1].startswith("headlab functions: error:")
        assert main(["--debug", *_functions(inputs, tmp_path / "o")]) == code  # --debug: the traceback too
        assert "Traceback (most recent call last)" in capsys.readouterr().err


def test_a_failure_in_the_model_s_own_code_is_named_so(inputs, tmp_path, capsys, monkeypatch):
    """Regression: DeepSeek-V4 loaded in float16 fails in transformers' own forward (a float32 compressor fed float16
    states); headlab said "internal error ... this is a bug in headlab". A forward whose code is transformers' (its
    frame in modeling_marian.py) failing inside a torch module (frames only passed through) is named as the model
    code's, with its file and line, no traceback without --debug."""
    import torch
    import transformers.models.marian.modeling_marian as modeling

    space: dict = {"torch": torch}
    exec(compile("def forward(self, *args, **kwargs):\n    return torch.nn.Linear(2, 2)(torch.zeros(1, 2, "
                 "dtype=torch.float64))\n", modeling.__file__, "exec"), space)
    monkeypatch.setattr(modeling.MarianAttention, "forward", space["forward"])
    args = ["importance", str(inputs / "model"), "--source", str(inputs / "src.txt"), "--method", "confidence",
            "--out", str(tmp_path / "o"), "--no-progress"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "bug in headlab, the traceback" not in err, err
    assert "headlab importance: error: the model's own code failed (RuntimeError: " in err
    assert "at transformers/models/marian/modeling_marian.py, line 2, in forward" in err
    assert main(["--debug", *args]) == 1
    assert "Traceback (most recent call last)" in capsys.readouterr().err


@pytest.mark.parametrize("extra,expected", [
    (["--method", "ablation", "--metric", "bleu"], "--metric bleu: the ablation's BLEU needs a translation model and "
                                                  "reference translations (--target); give --target FILE"),
    (["--method", "confidence,ablation", "--metric", "accuracy"], "--metric accuracy: the ablation's accuracy is a "
                                                                  "sequence classifier's"),
])
def test_importance_ablation_metric_that_cannot_apply_is_refused_before_the_model_loads(extra, expected, inputs,
                                                                                         tmp_path, capsys, monkeypatch):
    """Left by session 41's audit: `importance --method ablation --metric bleu` without --target (or accuracy on a
    translation model) was refused only once the weights had loaded; now from config.json, as analyze refuses it.
    With --method all such an ablation is skipped instead (run_importance), so it is not refused here."""
    forbid_model_loading(monkeypatch)
    code = main(["importance", str(inputs / "model"), "--source", str(inputs / "src.txt"), *extra,
                 "--out", str(tmp_path / "o"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert expected in err and "Traceback" not in err
    assert not files_under(tmp_path / "o")


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["functions"])
    assert exit_.value.code == 2 and "usage:" in capsys.readouterr().err


@pytest.mark.parametrize("command,name", [
    (["importance", "m", "--source", "s", "--out", "o", "--bogus"], "headlab importance"),
    (["prune", "sweep", "m", "--out", "o", "--bogus", "1"], "headlab prune sweep"),
    (["nmt", "translate", "m", "--bogus"], "headlab nmt translate"),
    (["heads", "m", "--bogus"], "headlab heads"),
])
def test_an_unknown_option_is_named_by_its_command(command, name, capsys):
    """Regression: a misspelt flag was `headlab: error: unrecognized arguments: ...` under the usage of
    `headlab` itself, not of the command that was run (docs/cli.md: `headlab COMMAND: error: ...`)."""
    with pytest.raises(SystemExit) as exit_:
        main(command)
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.strip().splitlines()[-1].startswith(f"{name}: error: unrecognized arguments: --bogus")
    assert f"usage: {name} " in err


@pytest.mark.parametrize("command,before,after", [
    (["--bogus", "heads", "m"], "--bogus", None),
    (["--bogus", "--debug", "prune", "sweep", "m", "--out", "o"], "--bogus", None),
    (["--bogus", "heads", "m", "--other"], "--bogus", None),  # headlab's first, as argparse reads them
    (["--debug", "heads", "m", "--bogus"], None, "--bogus"),
    (["--debug", "prune", "sweep", "m", "--out", "o", "--debug"], None, "--debug"),  # a top-level flag, after the name
])
def test_an_unknown_option_before_the_command_is_headlab_s(command, before, after, capsys):
    """Regression: `headlab --bogus heads x` was `headlab heads: error: ...`, as if heads had no --bogus;
    an option before the command's name is headlab's, and one after it stays the command's."""
    with pytest.raises(SystemExit) as exit_:
        main(command)
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert exit_.value.code == 2
    if before is not None:
        assert last == f"headlab: error: unrecognized arguments: {before}" and "usage: headlab [-h]" in err
    else:
        name = "headlab " + " ".join(a for a in command[1:command.index("m")])
        assert last == f"{name}: error: unrecognized arguments: {after}" and f"usage: {name} " in err


@pytest.mark.parametrize("command,expected", [
    (["importance", "m", "--out", "o"], "the following arguments are required: --source\n"),
    (["importance", "m", "--out", "o", "--source"], "argument --source: expected one argument"),
    (["demo", "--target"], "argument --target: expected one argument"),
])
def test_a_renamed_option_is_named_without_its_old_names(command, expected, capsys):
    """Regression: argparse's messages named `--source/--data`, the deprecated name that --help hides
    (docs/cli.md, "One name per concept")."""
    with pytest.raises(SystemExit) as exit_:
        main(command)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and expected in err and "--data" not in err and "--reference" not in err


@pytest.mark.parametrize("command,expected", [
    (["functions", "--relations", ","], "argument --relations: an empty list (','); give one or more comma-separated "
                                        "relations"),
    (["functions", "--relations", " "], "argument --relations: an empty list (' ')"),
    (["analyze", "--skip", ","], "--skip ',': an empty list; give one or more comma-separated values"),
    (["analyze", "--prune-keeps", ","], "--prune-keeps ,: an empty list; give one or more comma-separated integers"),
    (["analyze", "--prune-keeps", ""], "--prune-keeps : an empty list"),
    (["prune", "sweep", "--keeps", ","], "--keeps ,: an empty list; give one or more comma-separated integers"),
    (["prune", "sweep", "--lams", ","], "--lams ,: an empty list; give one or more comma-separated numbers"),
    # Regression: refused only after the model had loaded (prune train, prune sweep)
    (["prune", "train", "--gates", ","], "--gates ',': an empty list; give one or more comma-separated values"),
    (["prune", "train", "--gates", " , "], "--gates ' , ': an empty list"),
    (["prune", "train", "--gates", "enc_self,encself"], "--gates enc_self,encself: unknown kind 'encself'"),
])
def test_an_empty_comma_list_is_a_usage_error(command, expected, inputs, tmp_path, capsys, monkeypatch):
    """Regression: `--relations ,` (an empty list once split) ran with the default relations, and
    `analyze --skip ,` / `--prune-keeps ,` with none skipped / the default budgets, silently."""
    forbid_model_loading(monkeypatch)
    model, source, out = str(inputs / "model"), str(inputs / "src.txt"), str(tmp_path / "out")
    args = {"functions": ["--conllu", str(inputs / "tb.conllu"), "--no-figures"], "analyze": ["--source", source],
            "prune": ["--train-src", source, "--train-tgt", source]}[command[0]]
    with pytest.raises(SystemExit) if command[0] == "functions" else nullcontext() as usage:  # argparse's exit
        code = main([*command[:-2], model, *args, "--out", out, "--no-progress", *command[-2:]])
    assert (usage.value.code if usage else code) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_interrupt_exits_130_with_one_line(inputs, tmp_path, capsys, monkeypatch):
    """Regression: Ctrl-C exited 1 with a 60-line traceback and no word about resuming."""
    monkeypatch.setattr(headlab.functions.analysis, "analyze_heads", _raise(KeyboardInterrupt()))
    assert main(_functions(inputs, tmp_path / "o")) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == ("headlab functions: interrupted; nothing was kept (results are written "
                                            "only when the command finishes); run it again")
    assert files_under(tmp_path / "o") == set()


def test_interrupted_analyze_keeps_finished_stages_and_resumes(inputs, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    args = ["analyze", str(inputs / "model"), "--source", str(inputs / "src.txt"), "--out", str(out), "--no-progress",
            "--skip", "gradient", "agreement", "functions", "aggregate", "attention", "figures", "report"]
    lrp = pipeline.RUNNERS["lrp"]
    monkeypatch.setitem(pipeline.RUNNERS, "lrp", _raise(KeyboardInterrupt()))
    assert main(args) == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (f"headlab analyze: interrupted; the finished stages are kept in {out}; "
                                            "the same command resumes from them")
    assert (out / "importance" / "confidence.json").is_file() and not (out / LOCK_FILE).exists()
    monkeypatch.setitem(pipeline.RUNNERS, "lrp", lrp)
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "confidence: reused" in err and "lrp: done" in err


@pytest.mark.parametrize("command", ["functions", "importance", "analyze"])
def test_unwritable_out_is_refused_before_any_work(command, capsys, monkeypatch):
    """Regression: functions, importance and analyze raised a traceback on a read-only output
    directory, functions and importance only after all the work."""
    with world_readable_dir() as root:
        save_tiny_marian(root / "model")
        (root / "src.txt").write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
        (root / "tb.conllu").write_text(SAMPLE_CONLLU, encoding="utf-8")
        args = {
            "functions": ["functions", str(root / "model"), "--conllu", str(root / "tb.conllu")],
            "importance": ["importance", str(root / "model"), "--data", str(root / "src.txt")],
            "analyze": ["analyze", str(root / "model"), "--source", str(root / "src.txt")],
        }[command]
        forbid_model_loading(monkeypatch)
        with unwritable(root / "ro") as ro:
            code = main([*args, "--out", str(ro / "out"), "--no-progress"])
        assert code == 2
        err = capsys.readouterr().err
        assert f"--out {ro / 'out'}: cannot write in {ro}" in err and "Traceback" not in err
        assert files_under(ro) == set()


def test_analyze_refuses_an_empty_source_up_front(inputs, tmp_path, capsys, monkeypatch):
    """Regression: an empty --source ran every stage to "failed" instead of refusing."""
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n", encoding="utf-8")
    forbid_model_loading(monkeypatch)
    assert main(["analyze", str(inputs / "model"), "--source", str(empty), "--out", str(tmp_path / "o")]) == 2
    assert f"--source {empty}: the file is empty" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_analyze_never_clobbers_files_it_did_not_write(inputs, tmp_path, capsys):
    """Regression: analyze overwrote a user's own index.html and manifest.json."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "index.html").write_text("<p>my page</p>")
    (out / "manifest.json").write_text('{"mine": true}')
    args = ["analyze", str(inputs / "model"), "--source", str(inputs / "src.txt"), "--out", str(out), "--no-progress",
            "--skip", "importance", "functions", "aggregate", "attention", "figures", "report"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"--out {out}: the directory holds files headlab did not write (index.html, manifest.json)" in err
    # Regression: it said "pass --force to write into it anyway", which is refused over these two files
    assert "--force to write into it anyway" not in err and "or move index.html, manifest.json away" in err
    assert files_under(out) == {"index.html", "manifest.json"}
    assert (out / "manifest.json").read_text() == '{"mine": true}'
    # --force writes beside the user's files, never over them (issue 32: it replaced manifest.json)
    assert main([*args, "--force"]) == 2
    assert "holds index.html, manifest.json of your own, which analyze would replace" in capsys.readouterr().err
    assert (out / "manifest.json").read_text() == '{"mine": true}'
    (out / "manifest.json").rename(out / "mine.json")
    (out / "index.html").rename(out / "mine.html")
    assert main(args) == 2  # a file of the user's that analyze would not replace: --force is the way
    assert "or pass --force to write into it anyway" in capsys.readouterr().err
    assert main([*args, "--force"]) == 0  # the user says so
    assert (out / "mine.json").read_text() == '{"mine": true}' and (out / "mine.html").read_text() == "<p>my page</p>"
    assert main(args) == 0  # now headlab's directory: resumes without --force


@pytest.fixture
def sleeper():
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield process
    process.kill()
    process.wait()


def _hold(directory, pid):
    from headlab.lock import _start_time

    path = directory / LOCK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'{{"pid": {pid}, "host": "{socket.gethostname()}", "pid_start": "{_start_time(pid)}", '
                    '"started": "2025-01-01T00:00:00+00:00"}')


def test_second_run_on_a_directory_refuses_and_a_stale_lock_is_taken_over(inputs, tmp_path, capsys, sleeper):
    out = tmp_path / "run"
    args = ["analyze", str(inputs / "model"), "--source", str(inputs / "src.txt"), "--out", str(out), "--no-progress",
            "--skip", "importance", "functions", "aggregate", "attention", "figures", "report"]
    _hold(out, sleeper.pid)  # another run, alive
    before = files_under(out)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"--out {out} is in use by another headlab run (pid {sleeper.pid}" in err
    assert f"delete {out / LOCK_FILE}" in err and files_under(out) == before
    sleeper.kill()
    sleeper.wait()  # the other run crashed: its lock is stale
    assert main(args) == 0
    assert not (out / LOCK_FILE).exists()


def test_lock_between_processes(tmp_path):
    """Two processes: the second waits for nothing and refuses while the first holds the lock."""
    code = ("import sys, time; from headlab.lock import DirectoryLock\n"
            "with DirectoryLock(sys.argv[1]):\n    print('held', flush=True); time.sleep(30)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(HeadlabError, match=f"in use by another headlab run \\(pid {holder.pid} "):
            DirectoryLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()
    with DirectoryLock(tmp_path):  # killed without releasing: stale, taken over
        assert (tmp_path / LOCK_FILE).is_file()
    assert not (tmp_path / LOCK_FILE).exists()


def test_sweep_refuses_a_directory_in_use(inputs, tmp_path, capsys, sleeper, monkeypatch):
    out = tmp_path / "sweep"
    _hold(out, sleeper.pid)
    forbid_model_loading(monkeypatch)
    import headlab.pruning.cli

    monkeypatch.setattr(headlab.pruning.cli, "_load", _raise(AssertionError("model loaded")))
    assert main(["prune", "sweep", str(inputs / "model"), "--train-src", str(inputs / "src.txt"), "--train-tgt",
                 str(inputs / "src.txt"), "--keeps", "2", "--out", str(out)]) == 2
    assert f"--out {out} is in use by another headlab run" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["functions", "analyze"])
def test_model_without_tokenizer_is_refused(command, inputs, tmp_path, capsys):
    bare = save_tiny_marian(tmp_path / "bare", tokenizer=False)
    args = {"functions": ["functions", str(bare), "--conllu", str(inputs / "tb.conllu")],
            "analyze": ["analyze", str(bare), "--source", str(inputs / "src.txt")]}[command]
    assert main([*args, "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{bare}: cannot load a tokenizer" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("command", ["functions", "aggregate", "importance", "prune train", "lm evaluate"])
def test_model_without_tokenizer_is_refused_before_its_weights_load(command, inputs, tmp_path, capsys, monkeypatch):
    """Regression: these commands loaded the weights (minutes for a large model) before finding that the
    directory holds no tokenizer; analyze and nmt translate refused first."""
    bare = save_tiny_marian(tmp_path / "bare", tokenizer=False)
    forbid_model_loading(monkeypatch)
    src, out = str(inputs / "src.txt"), str(tmp_path / "o")
    args = {"functions": ["functions", str(bare), "--conllu", str(inputs / "tb.conllu"), "--out", out],
            "aggregate": ["aggregate", str(bare), "--conllu", str(inputs / "tb.conllu"), "--out", out],
            "importance": ["importance", str(bare), "--source", src, "--method", "confidence", "--out", out],
            "prune train": ["prune", "train", str(bare), "--train-src", src, "--train-tgt", src, "--keep", "2",
                            "--out", out],
            "lm evaluate": ["lm", "evaluate", str(bare), "--text", src]}[command]
    assert main([*args, "--no-progress"] if command != "lm evaluate" else args) == 2
    err = capsys.readouterr().err
    assert f"{bare}: cannot load a tokenizer" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_lm_evaluate_of_a_directory_whose_tokenizer_has_no_bos_is_refused_before_the_weights_load(inputs, capsys,
                                                                                                   monkeypatch):
    """Regression: `lm evaluate` of a translation model's directory loaded its weights before saying so."""
    forbid_model_loading(monkeypatch)
    assert main(["lm", "evaluate", str(inputs / "model"), "--text", str(inputs / "src.txt")]) == 2
    err = capsys.readouterr().err
    assert f"{inputs / 'model'}: the tokenizer has no BOS token (not a headlab language model)" in err


@pytest.mark.parametrize("command", ["importance", "importance --beam", "functions"])
def test_target_side_of_a_one_stack_model_is_refused_before_the_weights_load(command, inputs, tmp_path, capsys,
                                                                              monkeypatch):
    """Regression: importance --target or --beam and functions --target-conllu on a language model were refused
    only after its weights loaded."""
    from support.models import tiny_model
    from support.treebank import word_tokenizer

    lm = tmp_path / "gpt2"
    tiny_model("gpt2").save_pretrained(lm)
    word_tokenizer([w for s in SENTENCES for w in s.split()]).save_pretrained(lm)
    forbid_model_loading(monkeypatch)
    src, out = str(inputs / "src.txt"), str(tmp_path / "o")
    args = {"importance": ["importance", str(lm), "--source", src, "--target", src, "--out", out],
            "importance --beam": ["importance", str(lm), "--source", src, "--beam", "3", "--out", out],
            "functions": ["functions", str(lm), "--target-conllu", str(inputs / "tb.conllu"), "--source", src,
                          "--out", out]}[command]
    assert main([*args, "--no-progress"]) == 2
    err = capsys.readouterr().err
    said = {"importance": f"--target {src}: references are only used with translation (encoder-decoder) models; "
                          f"{lm} has one stack",
            "importance --beam": f"--beam 3: the beam of the model's translations, and {lm} is a gpt2 model that does "
                                 "not translate",
            "functions": f"--target-conllu {inputs / 'tb.conllu'}: target-side parses need an encoder-decoder model; "
                         f"{lm} has one stack"}[command]
    assert said in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_importance_kind_the_model_lacks_is_refused_before_the_weights_load(tmp_path, capsys, monkeypatch):
    """Regression: `importance --kinds dec_self` of an encoder was refused only after its weights loaded."""
    from support.models import tiny_model
    from support.treebank import word_tokenizer

    bert = tmp_path / "bert"
    tiny_model("bert").save_pretrained(bert)
    word_tokenizer([w for s in SENTENCES for w in s.split()]).save_pretrained(bert)
    source = tmp_path / "src.txt"
    source.write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    forbid_model_loading(monkeypatch)
    assert main(["importance", str(bert), "--source", str(source), "--kinds", "enc_self,dec_self", "--out",
                 str(tmp_path / "o"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--kinds dec_self: the model has no dec_self heads (it has enc_self)" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_bad_frequency_file_is_refused_before_the_weights_load(inputs, tmp_path, capsys, monkeypatch):
    """Regression: a --frequencies line naming a token the tokenizer lacks was found after the weights loaded."""
    frequencies = tmp_path / "freq.tsv"
    frequencies.write_text("dog\t5\nnot-a-word-of-it\t3\n", encoding="utf-8")
    forbid_model_loading(monkeypatch)
    assert main(_functions(inputs, tmp_path / "o", "--frequencies", str(frequencies))) == 2
    err = capsys.readouterr().err
    assert f"{frequencies}:2: token 'not-a-word-of-it' is not in the tokenizer's vocabulary" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("command", ["functions", "importance", "analyze"])
def test_tokenizer_of_a_bigger_vocabulary_is_refused(command, inputs, tmp_path, capsys):
    """Regression: `functions --tokenizer` (or a model directory's own tokenizer) whose ordinary
    vocabulary is larger than the model's embeddings ended in an IndexError traceback (internal
    error) from the embedding lookup."""
    from support.treebank import word_tokenizer

    words = [f"w{i}" for i in range(150)] + [line.split("\t")[1] for line in SAMPLE_CONLLU.splitlines()
                                             if line and line[0].isdigit()]
    big = tmp_path / "big"
    if command == "functions":
        word_tokenizer(words, max_vocab=400).save_pretrained(big)
        args = ["functions", str(inputs / "model"), "--tokenizer", str(big), "--conllu", str(inputs / "tb.conllu"),
                "--no-figures"]
    else:
        save_tiny_marian(big, tokenizer=False)
        word_tokenizer(words, max_vocab=400).save_pretrained(big)
        args = [command, str(big), "--source", str(inputs / "src.txt")]
    code = main([*args, "--out", str(tmp_path / "o"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert "more than the model's 99 embeddings" in err
    if command == "functions":  # audit31: "tokenizer of MODEL" blamed the model's own tokenizer for --tokenizer's
        assert f"tokenizer {big} (given for model): its vocabulary has" in err
    else:
        assert f"tokenizer of {big}: its vocabulary has" in err
    assert not files_under(tmp_path / "o")


@pytest.mark.parametrize("command", [["baseline", "--method", "random", "--keeps", "2"], ["sweep", "--keeps", "2"],
                                     ["train", "--keep", "2"]])
def test_prune_training_commands_refuse_a_tokenizer_of_a_bigger_vocabulary(command, inputs, tmp_path, capsys):
    """Regression: `prune baseline|sweep|train --tokenizer DIR` of a larger vocabulary than the
    model's embeddings ended in an IndexError traceback (internal error) from the embedding lookup."""
    from support.treebank import word_tokenizer

    big = tmp_path / "big"
    word_tokenizer([f"w{i}" for i in range(150)] + [w for s in SENTENCES for w in s.split()],
                   max_vocab=400).save_pretrained(big)
    source = str(inputs / "src.txt")
    data = ["--valid-src", source, "--valid-tgt", source, "--eval-beam", "1"]
    if command[0] != "baseline":
        data += ["--train-src", source, "--train-tgt", source, "--no-progress"]
    code = main(["prune", command[0], str(inputs / "model"), *command[1:], "--tokenizer", str(big), *data,
                 "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert "more than the model's 99 embeddings" in err
    assert f"tokenizer {big} (given for {inputs / 'model'}): its vocabulary has" in err  # audit31: named the model's
    assert not files_under(tmp_path / "o")


@pytest.mark.parametrize("command", ["functions", "prune"])
def test_another_models_tokenizer_of_no_larger_vocabulary_is_refused_before_the_weights_load(
        command, inputs, tmp_path, capsys, monkeypatch):
    """Regression (session 42): `--tokenizer DIR` of another vocabulary no larger than the model's embeddings (here
    the model's own words, numbered in reverse) was accepted, with no word: every id then meant another token to the
    model. Refused before the weights load, naming both tokenizers and the first token whose id differs."""
    from support.bad_input import WORDS
    from support.treebank import word_tokenizer

    foreign = tmp_path / "foreign"
    word_tokenizer(list(reversed(WORDS + ["do", "n't"]))).save_pretrained(foreign)
    forbid_model_loading(monkeypatch)
    if command == "functions":
        args = _functions(inputs, tmp_path / "o", "--tokenizer", str(foreign))
    else:
        source = str(inputs / "src.txt")
        args = ["prune", "train", str(inputs / "model"), "--keep", "2", "--tokenizer", str(foreign), "--train-src",
                source, "--train-tgt", source, "--valid-src", source, "--valid-tgt", source, "--no-progress", "--out",
                str(tmp_path / "o")]
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    first = WORDS[0]  # the model's id 3 (after <pad>, </s>, <unk>), the last id in the reversed vocabulary
    assert re.search(rf"--tokenizer {re.escape(str(foreign))}: its vocabulary is not that of the model's own tokenizer "
                     rf"\({re.escape(str(inputs / 'model'))}\): '{re.escape(first)}' is id \d+ in it and id 3 in the "
                     r"model's, so the model would read its ids as other tokens", err), err
    assert not files_under(tmp_path / "o")


def test_a_copy_of_the_models_own_tokenizer_is_accepted(inputs, tmp_path):
    """Its files elsewhere, a pad token added: the same ordinary vocabulary, accepted; a model directory without a
    tokenizer, or whose tokenizer does not load, takes any (--tokenizer is its only one)."""
    import transformers

    from headlab.loading import check_same_vocabulary, load_tokenizer

    copy = tmp_path / "copy"
    tokenizer = transformers.AutoTokenizer.from_pretrained(inputs / "model")
    tokenizer.add_tokens(["<extra>"])
    tokenizer.save_pretrained(copy)
    check_same_vocabulary(load_tokenizer(str(copy)), str(copy), str(inputs / "model"))
    bare = save_tiny_marian(tmp_path / "bare", tokenizer=False)
    check_same_vocabulary(load_tokenizer(str(copy)), str(copy), str(bare))
    # a directory whose own tokenizer does not load (a stray tokenizer_config.json alone): why --tokenizer is given
    broken = save_tiny_marian(tmp_path / "broken", tokenizer=False)
    (broken / "tokenizer_config.json").write_text("{not json")
    check_same_vocabulary(load_tokenizer(str(copy)), str(copy), str(broken))


@pytest.mark.parametrize("content", ['{"pid": "x"}', "[1, 2]", ""])
def test_garbage_lock_is_held_for_a_while_then_taken_over(content, tmp_path):
    path = tmp_path / LOCK_FILE
    path.parent.mkdir()
    path.write_text(content)
    with pytest.raises(HeadlabError, match="in use by another headlab run"):
        DirectoryLock(tmp_path).acquire()  # perhaps being written right now
    old = time.time() - 120
    os.utime(path, (old, old))
    with DirectoryLock(tmp_path):
        assert path.read_text().startswith('{"pid": ' + str(os.getpid()))


# ----------------------------------------------------------------------------- prune train / baseline


def _baseline(inputs, out, *extra):
    src = str(inputs / "src.txt")
    return ["prune", "baseline", str(inputs / "model"), "--train-src", src, "--train-tgt", src, "--valid-src", src,
            "--valid-tgt", src, "--method", "random", "--keeps", "2", "--seeds", "1", "--eval-beam", "1",
            "--out", str(out), *extra]


def _forbid_pruning_work(monkeypatch):
    import headlab.pruning.cli

    forbid_model_loading(monkeypatch)
    monkeypatch.setattr(headlab.pruning.cli, "_load", _raise(AssertionError("model loaded")))


@pytest.mark.parametrize("case,expected", [
    ("missing data", "--train-src {root}/none.txt: no such file"),
    ("empty data", "--valid-tgt {root}/empty.txt: the file is empty"),
    ("no model", "model {root}/no/model: no such directory"),
    ("no scores", "--scores {root}/none.json: no such file"),
    ("bad scores", "--scores {root}/src.txt: line 1: invalid JSON"),
    ("bad keeps", "--keeps -1: give one or more head counts >= 0"),
    ("keeps not numbers", "--keeps 4,a: cannot read a list of integers"),
    ("seeds not numbers", "--seeds 1,x: cannot read a list of integers"),
    ("bad kinds", "--kinds enc_slf: expected auto, all or a comma list of"),
    ("bad table", "{out}/baselines.json: not a baselines table"),
    ("no valid", "baselines need --valid-src and --valid-tgt"),
])
def test_prune_baseline_refuses_bad_input_before_loading(case, expected, inputs, tmp_path, capsys, monkeypatch):
    """Regression: prune baseline loaded the model first and found a missing file, a bad --scores
    or a corrupt baselines.json only then (or after the first row), as a traceback."""
    _forbid_pruning_work(monkeypatch)
    (tmp_path / "empty.txt").write_text("\n")
    out = tmp_path / "out"
    args = _baseline(inputs, out)
    if case == "missing data":
        args[args.index("--train-src") + 1] = str(tmp_path / "none.txt")
    elif case == "empty data":
        args[args.index("--valid-tgt") + 1] = str(tmp_path / "empty.txt")
    elif case == "no model":
        args[2] = str(tmp_path / "no" / "model")
    elif case in ("no scores", "bad scores"):
        scores = tmp_path / "none.json" if case == "no scores" else inputs / "src.txt"
        args[args.index("random")] = "scores"
        args += ["--scores", str(scores)]
    elif case == "bad keeps":
        args[args.index("--keeps") + 1] = "-1"
    elif case == "keeps not numbers":
        args[args.index("--keeps") + 1] = "4,a"
    elif case == "seeds not numbers":
        args += ["--seeds", "1,x"]
    elif case == "bad kinds":
        args += ["--kinds", "enc_slf"]
    elif case == "bad table":
        out.mkdir()
        (out / "baselines.json").write_text('{"rows": 1}')
    elif case == "no valid":
        args = args[:7] + args[11:]
    root = inputs if case == "bad scores" else tmp_path
    assert main(args) == 2
    err = capsys.readouterr().err
    assert expected.format(root=root, out=out) in err and "Traceback" not in err
    assert files_under(out) == ({"baselines.json"} if case == "bad table" else set())


def test_prune_baseline_refuses_unwritable_out_and_a_directory_in_use(inputs, capsys, monkeypatch, sleeper):
    _forbid_pruning_work(monkeypatch)
    with world_readable_dir() as root:
        save_tiny_marian(root / "model")
        (root / "src.txt").write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
        with unwritable(root / "ro") as ro:
            assert main(_baseline(root, ro / "out")) == 2
        assert f"--out {ro / 'out'}: cannot write in {ro}" in capsys.readouterr().err
        assert files_under(ro) == set()
    busy = inputs / "busy-baseline"
    _hold(busy, sleeper.pid)
    assert main(_baseline(inputs, busy)) == 2
    assert f"--out {busy} is in use by another headlab run (pid {sleeper.pid}" in capsys.readouterr().err


def test_prune_baseline_refuses_too_many_heads_before_any_row(inputs, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(_baseline(inputs, out, "--keeps", "2,99")) == 2
    assert "--keeps 2,99: the model has 8 heads of enc_self" in capsys.readouterr().err
    assert not out.exists()  # the directory the run created for its lock is gone again


def test_prune_train_refuses_bad_input_and_a_directory_in_use(inputs, tmp_path, capsys, monkeypatch, sleeper):
    """Regression: prune train took no lock (two runs interleaved their checkpoints) and found a
    missing training file only after loading the model."""
    _forbid_pruning_work(monkeypatch)
    src = str(inputs / "src.txt")
    args = ["prune", "train", str(inputs / "model"), "--train-src", src, "--train-tgt", src, "--keep", "2"]
    assert main([*args, "--valid-src", str(tmp_path / "none.txt"), "--valid-tgt", src,
                 "--out", str(tmp_path / "o")]) == 2
    assert f"--valid-src {tmp_path / 'none.txt'}: no such file" in capsys.readouterr().err
    assert main([*args, "--limit", "0", "--out", str(tmp_path / "o")]) == 2
    assert "--limit must be at least 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    busy = tmp_path / "busy"
    _hold(busy, sleeper.pid)
    before = files_under(busy)
    assert main([*args, "--out", str(busy)]) == 2
    err = capsys.readouterr().err
    assert f"--out {busy} is in use by another headlab run (pid {sleeper.pid}" in err and "Traceback" not in err
    assert files_under(busy) == before


@pytest.mark.parametrize("command, runner", [("train", "headlab.pruning.train.prune_train"),
                                             ("sweep", "headlab.pruning.sweep.run_sweep")])
def test_prune_lock_is_held_by_the_main_process_only(command, runner, inputs, tmp_path, monkeypatch, sleeper):
    """Under accelerate launch every rank runs the command on the same --out: rank 0 holds the lock.
    Regression: prune sweep took a plain lock in every rank (rank 1 refused rank 0's directory)."""
    import headlab.pruning.cli

    out = tmp_path / "o"
    held = []

    def run(*args, **kwargs):
        held.append((out / LOCK_FILE).is_file())
        raise KeyboardInterrupt

    monkeypatch.setattr(headlab.pruning.cli, "_load", lambda args: (None, None))
    monkeypatch.setattr(headlab.pruning.cli, "_data", lambda args, tokenizer, model: (None, None))
    monkeypatch.setattr(headlab.pruning.cli, "_check_budgets", lambda model, config, points: None)  # no model here
    monkeypatch.setattr(runner, run)
    src = str(inputs / "src.txt")
    args = ["prune", command, str(inputs / "model"), "--train-src", src, "--train-tgt", src, "--out", str(out)]
    args += ["--keeps", "2"] if command == "sweep" else []
    assert main(args) == 130 and held == [True]
    assert not (out / LOCK_FILE).exists()  # released
    assert not out.exists()  # nothing written: the directory the run created for its lock is gone again
    _hold(out, sleeper.pid)  # rank 0 of a launch holds it
    monkeypatch.setenv("RANK", "1")
    assert main(args) == 130 and held == [True, True]


@pytest.mark.parametrize("points, expected", [
    (["--keeps", "-1"], "--keeps -1: a head budget must be >= 1"),
    # 0 was run (every gated head closed: no choice for the gates) while prune train --keep and analyze's
    # --prune-keeps refuse it
    (["--keeps", "2,0"], "--keeps 0: a head budget must be >= 1, as prune train --keep"),
    (["--lams", "inf"], "lambda must be a finite number >= 0, got inf"),
    (["--lams", "0.1,-0.0,0"], "repeated sweep points"),  # -0.0 was a point of its own, "lam--0"
])
def test_sweep_refuses_bad_points_before_loading(points, expected, inputs, tmp_path, capsys, monkeypatch):
    """Regression: a negative budget or an infinite lambda was refused only when its point started,
    after the model was loaded and the full model evaluated (full.json written)."""
    forbid_model_loading(monkeypatch)
    import headlab.pruning.cli

    monkeypatch.setattr(headlab.pruning.cli, "_load", _raise(AssertionError("model loaded")))
    out = tmp_path / "sweep"
    assert main(["prune", "sweep", str(inputs / "model"), "--train-src", str(inputs / "src.txt"), "--train-tgt",
                 str(inputs / "src.txt"), *points, "--out", str(out)]) == 2
    assert expected in capsys.readouterr().err
    assert not out.exists()


def test_sweep_refuses_a_budget_above_the_gated_heads_before_any_point(inputs, tmp_path, capsys):
    """Regression: `--keeps 999` was refused when its point started, after the full model had been
    evaluated and full.json written."""
    out = tmp_path / "sweep"
    assert main(["prune", "sweep", str(inputs / "model"), "--train-src", str(inputs / "src.txt"), "--train-tgt",
                 str(inputs / "src.txt"), "--valid-src", str(inputs / "src.txt"), "--valid-tgt", str(inputs / "src.txt"),
                 "--keeps", "2,999", "--out", str(out)]) == 2
    assert "--keeps 999 is larger than the 8 gated heads (enc_self)" in capsys.readouterr().err
    assert not (out / "full.json").exists()


@pytest.mark.parametrize("extra, expected", [
    (["--conllu-limit", "2"], "--conllu-limit: this option acts on the treebank of the head functions and aggregate "
                              "statistics, and no --conllu was given: give --conllu FILE, or leave it out"),
    (["--train-text", "SOURCE"], "--train-text: this option acts on the treebank"),
    (["--window", "5", "--relations", "nsubj"], "--relations, --window: these options act on the treebank of the head "
                                                "functions and aggregate statistics, and no --conllu was given: give "
                                                "--conllu FILE, or leave them out"),
    (["--ablation", "--metric", "bleu"], "--metric bleu: the ablation's BLEU needs a translation model and reference "
                                         "translations (--target); give --target FILE, or use --metric loss"),
])
def test_analyze_refuses_options_that_cannot_act_before_any_work(extra, expected, inputs, tmp_path, capsys, monkeypatch):
    """Regression: without --conllu, analyze ran every stage and ignored --conllu-limit, --train-text
    and the statistics' options (--window, ...) without a word; --ablation --metric bleu without
    --target ran the other measures and failed the ablation stage (exit 1)."""
    forbid_model_loading(monkeypatch)
    source = str(inputs / "src.txt")
    out = tmp_path / "o"
    assert main(["analyze", str(inputs / "model"), "--source", source, "--out", str(out),
                 *[source if e == "SOURCE" else e for e in extra]]) == 2
    assert expected in capsys.readouterr().err
    assert not out.exists()


@pytest.fixture(scope="module")
def language_model(tmp_path_factory):
    from support.bad_input import WORDS
    from support.models import tiny_model
    from support.treebank import word_tokenizer

    path = tmp_path_factory.mktemp("gpt2") / "gpt2"
    tiny_model("gpt2").save_pretrained(path)
    word_tokenizer(WORDS, style="gpt2").save_pretrained(path)
    return path


@pytest.mark.parametrize("model, extra, expected", [
    ("gpt2", ["--target", "SOURCE"], "--target: reference translations are for translation (encoder-decoder) models, "
                                     "and {model} is a gpt2 model that does not translate; leave --target out"),
    ("gpt2", ["--beam", "3"], "--beam 3: the beam of the model's translations, and {model} is a gpt2 model that does "
                              "not translate; leave --beam out"),
    ("gpt2", ["--ablation", "--metric", "bleu"], "--metric bleu: the ablation's BLEU needs a translation model and "
                                                 "reference translations (--target); {model} is a gpt2 model"),
    ("marian", ["--target", "SOURCE", "--ablation", "--metric", "accuracy"],
     "--metric accuracy: the ablation's accuracy is a sequence classifier's, and {model} is a translation model; use "
     "--metric loss or bleu"),
])
def test_analyze_refuses_options_for_another_kind_of_model_before_any_work(model, extra, expected, inputs,
                                                                            language_model, tmp_path, capsys, monkeypatch):
    """Regression: --target with a model that does not translate failed every importance stage,
    and --ablation --metric accuracy with one that does not classify the ablation stage, after
    the other stages had run (exit 1); --beam of a model that does not translate was ignored."""
    forbid_model_loading(monkeypatch)
    path = language_model if model == "gpt2" else inputs / "model"
    source = str(inputs / "src.txt")
    out = tmp_path / "o"
    assert main(["analyze", str(path), "--source", source, "--out", str(out),
                 *[source if e == "SOURCE" else e for e in extra]]) == 2
    assert expected.format(model=path) in capsys.readouterr().err
    assert not out.exists()


def test_options_of_the_treebank_are_taken_with_one_or_at_their_defaults(inputs, tmp_path):
    """What the refusal above leaves alone: each with --conllu, and a statistic's default given without it."""
    from headlab.pipeline.pipeline import AnalyzeConfig, check_treebank_options

    source, conllu = str(inputs / "src.txt"), str(inputs / "tb.conllu")
    base = {"model": str(inputs / "model"), "source": source, "out": str(tmp_path / "o")}
    check_treebank_options(AnalyzeConfig(**base, conllu=conllu, conllu_limit=2, train_text=(source,), window=5))
    check_treebank_options(AnalyzeConfig(**base, window=10, top_k=5))  # the defaults, spelt out
    with pytest.raises(HeadlabError, match="--top-k: this option"):
        check_treebank_options(AnalyzeConfig(**base, window=10, top_k=3))


def test_beam_of_a_classifier_is_refused_by_analyze_in_importances_words(tmp_path):
    """Regression: analyze, importance and the API each wrote their own beam check, and analyze's
    said "is a sequence classifier; leave --beam out" where importance said "is a sequence classifier
    that does not translate". One check now (importance.config.check_beam), one wording."""
    import transformers

    from headlab.importance.config import check_beam
    from headlab.pipeline.pipeline import AnalyzeConfig, check_options_fit_model

    model_config = transformers.BertConfig(architectures=["BertForSequenceClassification"], num_labels=2)
    config = AnalyzeConfig(model="m", source="s.txt", out=str(tmp_path / "o"), beam=3)
    expected = ("--beam 3: the beam of the model's translations, and m is a sequence classifier that does not "
                "translate; leave --beam out")
    with pytest.raises(HeadlabError, match=f"^{re.escape(expected)}$"):
        check_options_fit_model(config, model_config)
    with pytest.raises(HeadlabError, match=f"^{re.escape(expected)}$"):
        check_beam(3, translates=False, classifier=True, arch="bert", model="m", option="--beam")
    check_beam(3, translates=True, classifier=False, arch="marian", model="m", option="--beam")  # a translation model
