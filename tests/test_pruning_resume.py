"""Bad-input catalogue, ``prune train`` killed and resumed (issue 32, row 3): a run killed at several
points and resumed each time ends bit-identical to an uninterrupted run (weights, gates, trajectory,
development curve, translations, result.json), like ``nmt train``'s resume test.

Each resumed part starts as a new process would: a fresh model loaded from the saved directory
with :func:`headlab.loading.load_model` (what ``headlab prune train`` does), so everything the
first part changed must come from ``train/last``. The "kill" is an exception raised after a step's
update and callbacks, before the trainer's next checkpoint, so each resume repeats some steps."""

import json

import pytest
import torch
from safetensors.torch import load_file

import headlab.pruning.train as pruning_train
from headlab import load_pruned
from headlab.errors import HeadlabError
from headlab.loading import load_model
from headlab.nmt.train import train
from headlab.pruning.dev import read_dev_curve
from headlab.pruning.train import PruneConfig, prune_train, read_trajectory
from headlab.training.config import TrainConfig
from support.nmt import tiny_marian

# 23 updates an epoch at 400 tokens (300 pairs); checkpoints every 3 updates and at the epoch's end.
# Kills: after the first checkpoint, in mid-epoch, on the epoch's last update (before its end-of-epoch
# checkpoint) and in the second epoch.
KILLS = (4, 11, 23, 26)
MAX_STEPS = 30


@pytest.fixture(scope="module")
def model_dir(tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("prune-resume") / "tiny"
    tiny_marian(tokenizer).save_pretrained(path)
    return path


class Killed(Exception):
    pass


def _config(out, keep, resume=False):
    train = TrainConfig(out_dir=str(out), max_tokens=400, lr=1e-3, warmup_steps=0, schedule="constant", max_epochs=2,
                        max_steps=MAX_STEPS, save_every_steps=3, validate=False, keep_epoch_checkpoints=False,
                        progress=False, seed=3, resume=resume)
    return PruneConfig(gates="all", lam=0.0 if keep else 0.2, keep=keep, log_every=2, dev_every=5, eval_beam=1,
                       gate_lr=0.1, multiplier_lr=0.05, train=train)


def _run(model_dir, tokenizer, corpus, out, keep, resume=False):
    model = load_model(str(model_dir))  # a new process's model: the checkpoint must supply the rest
    prune_train(model, tokenizer, corpus, corpus.subset(10), _config(out, keep, resume),
                dev_data=corpus.subset(6), log=lambda message: None)
    return model


def _kill_after(monkeypatch, kill_step):
    """The trainer, stopped by an exception once update ``kill_step`` and its callbacks are done."""
    real = pruning_train.train

    def train(*args, **kwargs):
        callback, every = kwargs["callback"], kwargs["callback_every"]

        def each_step(model, step, info):
            if every and step % every == 0:
                callback(model, step, info)
            if step == kill_step:
                raise Killed

        return real(*args, **{**kwargs, "callback": each_step, "callback_every": 1})

    monkeypatch.setattr(pruning_train, "train", train)


def _result(out):
    record = json.loads((out / "result.json").read_text())
    for key in ("out_dir", "pruned_dir"):
        record.pop(key)
    return record


@pytest.mark.parametrize("keep", [None, 12], ids=["lambda", "budget"])
def test_prune_train_killed_four_times_resumes_bit_identically(keep, model_dir, tokenizer, corpus, tmp_path,
                                                              monkeypatch):
    whole = _run(model_dir, tokenizer, corpus, tmp_path / "whole", keep)

    cut = tmp_path / "cut"
    for i, kill_step in enumerate(KILLS):
        _kill_after(monkeypatch, kill_step)
        with pytest.raises(Killed):
            _run(model_dir, tokenizer, corpus, cut, keep, resume=i > 0)
        monkeypatch.undo()
        state = json.loads((cut / "train" / "last" / "trainer_state.json").read_text())
        assert state["step"] < kill_step  # the resume repeats the steps after the last checkpoint
    resumed = _run(model_dir, tokenizer, corpus, cut, keep, resume=True)

    # Every tensor of the final (pruned) model, the never-saved ones included, bit for bit.
    expected, got = whole.state_dict(), resumed.state_dict()
    assert expected.keys() == got.keys()
    differ = {k: (expected[k] - got[k]).abs().max().item() for k in expected if not torch.equal(expected[k], got[k])}
    assert not differ, differ
    # The saved pruned model is the one evaluated: no trained tensor was left out of it.
    saved = load_pruned(str(cut / "pruned")).state_dict()
    assert saved.keys() == got.keys() and all(torch.equal(saved[k], got[k]) for k in got)
    for name in ("train/last/model.safetensors", "pruned/model.safetensors"):
        a, b = load_file(str(tmp_path / "whole" / name)), load_file(str(cut / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    assert (cut / "gates.json").read_text() == (tmp_path / "whole" / "gates.json").read_text()
    trajectory = read_trajectory(cut)
    assert [r["step"] for r in trajectory] == list(range(2, MAX_STEPS + 1, 2))
    assert trajectory == read_trajectory(tmp_path / "whole")
    curve = read_dev_curve(cut)
    assert [r["step"] for r in curve] == list(range(0, MAX_STEPS + 1, 5))
    assert curve == read_dev_curve(tmp_path / "whole")
    for step in (0, 15, MAX_STEPS):
        name = f"dev/step-{step:06d}.txt"
        assert (cut / name).read_text() == (tmp_path / "whole" / name).read_text()
    assert (cut / "hypotheses.txt").read_text() == (tmp_path / "whole" / "hypotheses.txt").read_text()
    assert _result(cut) == _result(tmp_path / "whole")


def test_the_trainer_never_trains_a_parameter_the_model_never_saves(model_dir, tokenizer, corpus, tmp_path):
    """The root cause of the row above: Marian's sinusoidal positions are left out of every save
    (``_keys_to_ignore_on_save``), yet transformers v5's from_pretrained leaves them trainable."""
    model = load_model(str(model_dir))
    positions = model.model.encoder.embed_positions.weight
    positions.requires_grad_(True)  # as from_pretrained leaves them (set here whatever the version does)
    before = positions.detach().clone()
    config = TrainConfig(out_dir=str(tmp_path / "run"), max_tokens=400, lr=1e-2, warmup_steps=0, max_steps=2,
                         validate=False, keep_epoch_checkpoints=False, progress=False)
    train(model, tokenizer, corpus, None, config)
    assert not positions.requires_grad and torch.equal(positions, before)
    named = TrainConfig(**{**config.to_dict(), "out_dir": str(tmp_path / "named")})
    with pytest.raises(HeadlabError, match="never saves.*model.encoder.embed_positions.weight"):
        train(load_model(str(model_dir)), tokenizer, corpus, None, named,
              trainable=["model.encoder.embed_positions.weight", "model.encoder.layers.0.fc1.weight"])


def test_a_resume_with_other_options_or_data_is_refused_before_anything_changes(model_dir, tokenizer, corpus,
                                                                                  tmp_path, monkeypatch):
    """Regression (audit31): ``prune train --resume`` with another --lam, --gates or training set went on from the
    first part's weights and gates under the new options (exit 0) and rewrote prune_config.json with them alone:
    two trainings mixed under one record (another --gates failed later, in the weights' load, the record
    already rewritten)."""
    cut = tmp_path / "cut"
    _kill_after(monkeypatch, 4)
    with pytest.raises(Killed):
        _run(model_dir, tokenizer, corpus, cut, None)
    monkeypatch.undo()
    recorded = (cut / "prune_config.json").read_text()
    last = (cut / "train" / "last" / "trainer_state.json").read_text()

    def resume(config, data=corpus):
        prune_train(load_model(str(model_dir)), tokenizer, data, corpus.subset(10), config,
                    dev_data=corpus.subset(6), log=lambda message: None)

    same = _config(cut, None, resume=True)
    cases = {
        "--lam 0.2 (now 0.5)": (PruneConfig(**{**same.__dict__, "lam": 0.5}), corpus),
        "--gates all (now enc_self)": (PruneConfig(**{**same.__dict__, "gates": "enc_self"}), corpus),
        "the training pairs": (same, corpus.subset(200)),
    }
    for said, (config, data) in cases.items():
        with pytest.raises(HeadlabError, match="--resume: the run in .* was started with other options or data") as error:
            resume(config, data)
        assert said in str(error.value)
        assert (cut / "prune_config.json").read_text() == recorded  # nothing rewritten
        assert (cut / "train" / "last" / "trainer_state.json").read_text() == last


def test_a_resume_inside_an_epoch_with_another_batch_order_is_refused_before_anything_changes(
        model_dir, tokenizer, corpus, tmp_path, monkeypatch):
    """Regression (resume31): ``prune train --resume`` with another --seed or --max-tokens inside an epoch went on
    from the saved batch position in other batches (pairs skipped or seen twice) and rewrote prune_config.json."""
    cut = tmp_path / "cut"
    _kill_after(monkeypatch, 4)
    with pytest.raises(Killed):
        _run(model_dir, tokenizer, corpus, cut, None)
    monkeypatch.undo()
    recorded = (cut / "prune_config.json").read_text()
    last = (cut / "train" / "last" / "trainer_state.json").read_text()
    assert json.loads(last)["batch_in_epoch"] == 3  # the checkpoint after update 3, inside the first epoch
    same = _config(cut, None, resume=True)
    for options, said in (({"seed": 5}, "--seed 3 (now 5)"), ({"max_tokens": 300}, "--max-tokens 400 (now 300)")):
        config = PruneConfig(**{**same.__dict__, "train": TrainConfig(**{**same.train.__dict__, **options})})
        with pytest.raises(HeadlabError, match="stopped inside epoch 1") as error:
            prune_train(load_model(str(model_dir)), tokenizer, corpus, corpus.subset(10), config,
                        dev_data=corpus.subset(6), log=lambda message: None)
        assert said in str(error.value)
        assert (cut / "prune_config.json").read_text() == recorded  # nothing rewritten
        assert (cut / "train" / "last" / "trainer_state.json").read_text() == last
