"""`headlab lm train`: a tiny Llama / GPT-2 on a few hundred Multi30k sentences.

What must hold (issue 12): a resumed run ends with the weights of an uninterrupted one, a run
stopped mid-epoch loses nothing before its last checkpoint, early stopping follows its rule,
and bad text (empty, blank, non-UTF-8, a directory) is a clear error naming the file.
"""

import gzip
import json
import math

import pytest
import torch

from headlab.cli import main
from headlab.errors import HeadlabError
from headlab.lm.data import collate_lm, encode_lm_corpus, read_text_corpus
from headlab.lm.model import LMConfig, build_lm_config, create_lm
from headlab.lm.train import LMRecipe, perplexity, run_lm_recipe
from headlab.nmt.tokenizer import train_tokenizer
from headlab.training.config import TrainConfig
from support.nmt import DATA

TRAIN = DATA / "val.en.gz"  # 1,014 sentences, in the repository


def tiny_recipe(out, arch="llama", **train_options):
    options = dict(out_dir=str(out), max_tokens=600, lr=3e-3, warmup_steps=5, max_epochs=1, progress=False,
                   seed=3, label_smoothing=0.0)
    options.update(train_options)
    return LMRecipe(train_files=[str(TRAIN)], valid_files=[str(DATA / "test_2016_flickr.en.gz")],
                    vocab_size=300, model=LMConfig(arch=arch, d_model=32, ffn_dim=64, layers=2, n_heads=4,
                                                   max_positions=64),
                    train=TrainConfig(**options))


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(read_text_corpus([TRAIN]).sentences[:300], 300, bos=True)


def test_sentences_open_with_bos_and_batches_shift_by_one(tokenizer):
    corpus = encode_lm_corpus(tokenizer, ["a dog runs .", "two men"], max_positions=64)
    assert all(ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id for ids in corpus.targets)
    batch = collate_lm(corpus, [0, 1], tokenizer.pad_token_id)
    first, second = corpus.targets
    assert batch["input_ids"][0].tolist() == first[:-1]
    assert batch["labels"][0].tolist() == first[1:]
    n = len(second) - 1
    assert batch["labels"][1, :n].tolist() == second[1:] and (batch["labels"][1, n:] == -100).all()
    assert batch["attention_mask"][1].sum() == n


def test_long_sentences_are_cut_keeping_eos_and_counted(tokenizer):
    corpus = encode_lm_corpus(tokenizer, ["word " * 100], max_positions=16)
    assert len(corpus.targets[0]) == 17 and corpus.targets[0][-1] == tokenizer.eos_token_id
    assert corpus.n_truncated == 1


def test_the_cut_is_said_by_headlab_alone(tokenizer):
    """transformers' "Token indices sequence length is longer than the specified maximum" warning is not let through
    beside headlab's own count of the sentences cut (found by running lm.md's commands, session 43)."""
    import copy

    short = copy.deepcopy(tokenizer)
    short.model_max_length = 8
    short.deprecation_warnings.clear()
    corpus = encode_lm_corpus(short, ["word " * 100], max_positions=16)
    assert corpus.n_truncated == 1
    assert "sequence-length-is-longer-than-the-specified-maximum" not in short.deprecation_warnings


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_training_lowers_validation_perplexity(tmp_path, arch):
    result = run_lm_recipe(tiny_recipe(tmp_path / "run", arch=arch, max_epochs=2))
    first, second = result.history
    assert second["valid_perplexity"] < first["valid_perplexity"]
    assert math.isclose(first["valid_score"], -first["valid_loss"])
    assert (tmp_path / "run" / "best" / "model.safetensors").is_file()


def test_perplexity_is_the_exponential_of_the_mean_token_loss(tokenizer):
    model = create_lm(build_lm_config(LMConfig(d_model=32, ffn_dim=64, layers=2, n_heads=4), tokenizer), seed=0)
    sentences = ["a dog runs .", "two men are walking on the street .", "hi"]
    corpus = encode_lm_corpus(tokenizer, sentences, 64)
    result = perplexity(model, corpus, tokenizer.pad_token_id, max_tokens=8)  # several batches
    assert model.training  # restored after scoring
    model.eval()  # the reference below must not drop attention either
    total, count = 0.0, 0
    with torch.no_grad():
        for ids in corpus.targets:  # one sentence at a time, no padding
            logits = model(torch.tensor([ids[:-1]])).logits[0]
            total += torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum").item()
            count += len(ids) - 1
    assert result["tokens"] == count
    assert result["loss"] == pytest.approx(total / count, rel=1e-5)


def test_resume_gives_the_weights_of_an_uninterrupted_run(tmp_path):
    full = tmp_path / "full"
    run_lm_recipe(tiny_recipe(full, max_epochs=2, max_steps=9, validate=False))
    cut = tmp_path / "cut"
    stopped = run_lm_recipe(tiny_recipe(cut, max_epochs=2, max_steps=5, validate=False))
    assert stopped.stopped == "max_steps"
    state = json.loads((cut / "last" / "trainer_state.json").read_text())
    assert state["step"] == 5  # a kill after this loses nothing before step 5
    resumed = run_lm_recipe(tiny_recipe(cut, max_epochs=2, max_steps=9, validate=False, resume=True))
    assert resumed.step == 9
    from safetensors.torch import load_file

    reference, continued = load_file(str(full / "last" / "model.safetensors")), load_file(str(cut / "last" / "model.safetensors"))
    for key, value in reference.items():
        assert torch.allclose(continued[key], value, atol=1e-6), key


def test_a_resume_inside_an_epoch_with_other_batches_is_refused(tmp_path):
    """Regression (resume31): a --resume inside an epoch with another --seed or --max-tokens went on from the saved
    batch position in the other options' batches (some pairs skipped, others seen twice), recorded only in
    train_config_changes.json. At an epoch boundary a new order from the next epoch on is allowed."""
    cut = tmp_path / "cut"
    run_lm_recipe(tiny_recipe(cut, max_epochs=2, max_steps=5, validate=False))
    last = (cut / "last" / "trainer_state.json").read_text()
    state = json.loads(last)
    assert state["epoch"] == 0 and 0 < state["batch_in_epoch"]  # stopped inside the first epoch
    for options, said in (({"seed": 4}, "--seed 3 (now 4)"), ({"max_tokens": 500}, "--max-tokens 600 (now 500)")):
        with pytest.raises(HeadlabError, match="stopped inside epoch 1") as error:
            run_lm_recipe(tiny_recipe(cut, max_epochs=2, max_steps=9, validate=False, resume=True, **options))
        assert said in str(error.value)
        assert (cut / "last" / "trainer_state.json").read_text() == last  # nothing changed
        assert not (cut / "train_config_changes.json").exists()
    # only the length changed (issue 35's case): resumed
    assert run_lm_recipe(tiny_recipe(cut, max_epochs=2, max_steps=6, validate=False, resume=True)).step == 6

    edge = tmp_path / "edge"
    run_lm_recipe(tiny_recipe(edge, max_epochs=1, validate=False))
    assert json.loads((edge / "last" / "trainer_state.json").read_text())["batch_in_epoch"] == 0
    resumed = run_lm_recipe(tiny_recipe(edge, max_epochs=2, validate=False, resume=True, seed=4))
    assert resumed.epoch == 2
    changes = json.loads((edge / "train_config_changes.json").read_text())
    assert changes[-1]["changed"]["seed"] == 4 and changes[-1]["batch_in_epoch"] == 0


def test_patience_stops_a_run_whose_validation_loss_stalls(tmp_path):
    # A learning rate of 0 leaves the loss where it is: no epoch improves on the first.
    result = run_lm_recipe(tiny_recipe(tmp_path / "run", max_epochs=10, lr=0.0, patience=2, min_improvement=0.01))
    assert result.stopped == "converged"
    assert result.epoch == 3 and result.best_epoch == 1
    # Resuming a converged run trains no further.
    again = run_lm_recipe(tiny_recipe(tmp_path / "run", max_epochs=10, lr=0.0, patience=2, min_improvement=0.01,
                                      resume=True))
    assert again.stopped == "converged" and again.step == result.step


def test_patience_waits_for_the_end_of_the_warm_up(tmp_path):
    # The same stalled loss, but every epoch ends inside the warm-up: none counts against the patience.
    result = run_lm_recipe(tiny_recipe(tmp_path / "run", max_epochs=4, lr=0.0, patience=2, min_improvement=0.01,
                                       warmup_steps=10_000))
    assert result.stopped == "finished" and result.epoch == 4


def write_gz(path, data: bytes):
    with gzip.open(path, "wb") as handle:
        handle.write(data)
    return path


@pytest.mark.parametrize("name, content, expected", [
    ("empty.txt", b"", "holds no sentence"),
    ("blank.txt", b"\n  \n\n", "holds no sentence"),
    ("latin1.txt", b"fine line\nbad \xe9 line\n", "line 2"),
])
def test_bad_text_is_an_error_naming_the_file(tmp_path, name, content, expected):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(HeadlabError, match=expected) as error:
        read_text_corpus([TRAIN, path])
    assert name in str(error.value)


def test_truncated_gzip_and_directories_are_errors(tmp_path):
    whole = write_gz(tmp_path / "whole.gz", b"a sentence .\n" * 2000)
    cut = tmp_path / "cut.gz"
    cut.write_bytes(whole.read_bytes()[:-30])
    with pytest.raises(HeadlabError, match="cut.gz"):
        read_text_corpus([cut])
    with pytest.raises(HeadlabError, match="is a directory"):
        read_text_corpus([tmp_path])


def test_treebank_text_keeps_its_own_spacing(tmp_path):
    path = tmp_path / "t.conllu"
    path.write_text("# text = Hi, you.\n1\tHi\thi\tINTJ\t_\t_\t0\troot\t_\tSpaceAfter=No\n"
                    "2\t,\t,\tPUNCT\t_\t_\t1\tpunct\t_\t_\n3\tyou\tyou\tPRON\t_\t_\t1\tvocative\t_\tSpaceAfter=No\n"
                    "4\t.\t.\tPUNCT\t_\t_\t1\tpunct\t_\t_\n\n", encoding="utf-8")
    assert read_text_corpus([path]).sentences == ["Hi, you."]


def test_cli_trains_evaluates_and_refuses_bad_input(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["lm", "train", "--train", str(TRAIN), "--valid", str(DATA / "test_2016_flickr.en.gz"), "--out", str(out),
            "--vocab-size", "300", "--d-model", "32", "--ffn", "64", "--layers", "2", "--heads", "4",
            "--max-positions", "64", "--max-tokens", "600", "--epochs", "1", "--no-progress"]
    assert main(args) == 0
    assert main(args) == 2 and "--overwrite" in capsys.readouterr().err
    capsys.readouterr()
    assert main(["lm", "evaluate", "--model", str(out / "best"), "--text", str(DATA / "test_2016_flickr.en.gz"),
                 "--json"]) == 0
    scored = json.loads(capsys.readouterr().out)
    history = json.loads((out / "history.json").read_text())
    assert scored["perplexity"] == pytest.approx(history[-1]["valid_perplexity"], rel=1e-4)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert main(["lm", "train", "--train", str(empty), "--out", str(tmp_path / "other"), "--patience", "0"]) == 2
    assert "empty.txt" in capsys.readouterr().err and not (tmp_path / "other").exists()
    assert main(["lm", "train", "--train", str(TRAIN), "--out", str(tmp_path / "other")]) == 2
    assert "--valid" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-5"])
def test_evaluate_refuses_max_tokens_below_one_before_loading(value, tmp_path, capsys, monkeypatch):
    """Regression: lm evaluate --max-tokens 0 (or -5) ran, where lm train refuses it."""
    import headlab.loading

    monkeypatch.setattr(headlab.loading, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    text = tmp_path / "text.txt"
    text.write_text("a dog runs\n", encoding="utf-8")
    assert main(["lm", "evaluate", "--model", str(tmp_path), "--text", str(text), "--max-tokens", value]) == 2
    assert f"--max-tokens must be at least 1, got {value}" in capsys.readouterr().err


def test_evaluate_names_text_for_a_bad_file_before_loading(tmp_path, capsys, monkeypatch):
    """Regression: `lm evaluate --text nope.txt` said "file not found: nope.txt", not naming --text
    (lm train names --train and --valid)."""
    import headlab.loading

    monkeypatch.setattr(headlab.loading, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    good, empty = tmp_path / "good.txt", tmp_path / "empty.txt"
    good.write_text("a dog runs\n", encoding="utf-8")
    empty.write_text("\n\n", encoding="utf-8")
    for text, said in ((tmp_path / "nope.txt", "no such file"), (tmp_path, "a directory, not a file"),
                       (empty, "the file is empty")):
        assert main(["lm", "evaluate", str(tmp_path), "--text", str(good), str(text)]) == 2
        assert f"--text {text}: {said}" in capsys.readouterr().err


def test_export_writes_fp16_that_plain_transformers_loads(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_lm_recipe(tiny_recipe(tmp_path / "run", max_epochs=1))
    assert main(["lm", "export", "--run", str(tmp_path / "run"), "--to", str(tmp_path / "model")]) == 0
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "model"))
    assert model.dtype == torch.float16
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "model"))
    assert tokenizer("a dog")["input_ids"][0] == tokenizer.bos_token_id


@pytest.mark.parametrize("family", ["lm", "nmt"])
def test_training_into_a_directory_in_use_or_unwritable_is_refused_before_work(family, tmp_path, capsys, monkeypatch):
    import socket
    import subprocess
    import sys

    from headlab.lock import LOCK_FILE, _start_time

    if family == "lm":
        import headlab.lm.train as module
        args = ["lm", "train", "--train", str(TRAIN), "--patience", "0"]
        monkeypatch.setattr(module, "run_lm_recipe", lambda *a, **k: pytest.fail("training started"))
    else:
        import headlab.nmt.recipe as module
        args = ["nmt", "train", "--train-src", str(TRAIN), "--train-tgt", str(TRAIN)]
        monkeypatch.setattr(module, "run_recipe", lambda *a, **k: pytest.fail("training started"))
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        out = tmp_path / "run"
        (out / LOCK_FILE).parent.mkdir(parents=True)
        (out / LOCK_FILE).write_text(f'{{"pid": {sleeper.pid}, "host": "{socket.gethostname()}", '
                                     f'"pid_start": "{_start_time(sleeper.pid)}", "started": "2025-01-01T00:00:00+00:00"}}')
        assert main(args + ["--out", str(out)]) == 2
        assert f"--out {out} is in use by another headlab run" in capsys.readouterr().err
    finally:
        sleeper.kill()
        sleeper.wait()
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    assert main(args + ["--out", str(blocker / "run")]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err
    missing = tmp_path / "missing.txt"
    bad = list(args)
    bad[3] = str(missing)  # the (first) training file
    assert main(bad + ["--out", str(tmp_path / "x")]) == 2
    assert "missing.txt: no such file" in capsys.readouterr().err


@pytest.mark.parametrize("option, value, expected", [
    ("--heads", "3", "--d-model 32 is not divisible by --heads 3"),
    ("--vocab-size", "5", "--vocab-size 5 is too small"),
])
def test_train_refuses_a_bad_shape_before_reading_the_text(option, value, expected, tmp_path, capsys, monkeypatch):
    """Regression: --heads not dividing --d-model, or a vocabulary too small for the special
    tokens, was refused only after the whole training text was read and a vocabulary trained."""
    import headlab.lm.train

    monkeypatch.setattr(headlab.lm.train, "read_text_corpus", lambda *a, **k: pytest.fail("the text was read"))
    args = ["lm", "train", "--train", str(TRAIN), "--out", str(tmp_path / "run"), "--patience", "0",
            "--d-model", "32", "--heads", "4", "--vocab-size", "300", option, value]
    assert main(args) == 2
    assert expected in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_evaluate_refuses_a_tokenizer_larger_than_the_model(tokenizer, tmp_path, capsys):
    """Regression: a language model directory holding another model's tokenizer (more tokens than
    its embeddings) ended in an IndexError traceback (internal error) from the embedding lookup."""
    small = train_tokenizer(read_text_corpus([TRAIN]).sentences[:300], 100, bos=True)
    create_lm(build_lm_config(LMConfig(d_model=16, ffn_dim=32, layers=1, n_heads=2, max_positions=32), small),
              seed=0).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)  # 300 tokens, for a model of 100
    assert main(["lm", "evaluate", str(tmp_path), "--text", str(TRAIN)]) == 2
    err = capsys.readouterr().err
    assert "more than the model's 100 embeddings" in err and "Traceback" not in err


def test_a_loss_past_exps_range_gives_infinite_perplexity_written_as_null(tmp_path, monkeypatch):
    """A validation loss above ~709.78 nats: math.exp raised OverflowError and the run crashed; now an infinite
    perplexity, and the history (whose writer refuses infinity) holds null beside the finite loss."""

    from headlab.lm import train as lm_train
    from headlab.lm.card import _scores

    real, real_loss = lm_train.perplexity, lm_train.causal_lm_loss

    def huge_loss(model, batch, config):
        loss, tokens = real_loss(model, batch, config)
        return torch.as_tensor(800.0 * tokens), tokens

    def huge(*args, **kwargs):
        monkeypatch.setattr(lm_train, "causal_lm_loss", huge_loss)  # scoring only: training keeps its own loss
        try:
            return real(*args, **kwargs)
        finally:
            monkeypatch.setattr(lm_train, "causal_lm_loss", real_loss)

    monkeypatch.setattr(lm_train, "perplexity", huge)
    result = run_lm_recipe(tiny_recipe(tmp_path / "run", max_epochs=1))
    assert result.history[-1]["valid_loss"] == 800.0 and result.history[-1]["valid_perplexity"] is None
    written = json.loads((tmp_path / "run" / "history.json").read_text())
    assert written[-1]["valid_perplexity"] is None
    assert "n/a" in _scores({"runs": [{"set": "test", "tokens": 3, "perplexity": None, "loss": 800.0, "command": "x"}]})
