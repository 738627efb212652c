"""The resume point's optimizer and RNG states: safetensors and JSON, never a pickle
(headlab.training.state_files), and the legacy ``optimizer.pt`` / ``rng-<rank>.pt`` still resumed."""

import pickle
import random

import numpy as np
import pytest
import torch

import headlab.training.loop as trainer
from headlab.errors import HeadlabError
from headlab.nmt.train import train
from headlab.training import state_files
from headlab.training.config import TrainConfig
from support.nmt import tiny_marian as tiny_model


def config(out_dir, **overrides):
    options = dict(out_dir=str(out_dir), max_tokens=1000, lr=3e-3, warmup_steps=5, max_epochs=3, validate=False,
                   progress=False, seed=3)
    options.update(overrides)
    return TrainConfig(**options)


class Draws:
    """An ``extra_loss`` hook that draws from numpy's and python's global generators at each step,
    as a user's hook may: a resumed run must draw what the uninterrupted one drew."""

    def __init__(self):
        self.seen = {}

    def __call__(self, model, batch, step):
        self.seen[step] = (random.random(), float(np.random.random()))
        return torch.zeros(())


def _no_unpickling(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("unpickled")

    monkeypatch.setattr(torch, "load", refuse)
    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)


def _reference(tmp_path, corpus, tokenizer):
    """12 uninterrupted steps over an epoch boundary (9 steps an epoch at 1,000 tokens)."""
    random.seed(1)
    np.random.seed(1)
    draws = Draws()
    model = tiny_model(tokenizer)
    train(model, tokenizer, corpus, None, config(tmp_path / "full", max_steps=12), extra_loss=draws)
    return model, draws


def _cut(tmp_path, corpus, tokenizer):
    """The same run stopped at step 6 (mid-epoch), the global generators then drawn from elsewhere."""
    random.seed(1)
    np.random.seed(1)
    train(tiny_model(tokenizer), tokenizer, corpus, None, config(tmp_path / "cut", max_steps=6, save_every_steps=3),
          extra_loss=Draws())
    random.seed(99)
    np.random.seed(99)
    return tmp_path / "cut"


def _resumed(run, corpus, tokenizer, log=None):
    draws = Draws()
    model = tiny_model(tokenizer, seed=123)  # a fresh process builds a fresh model
    result = train(model, tokenizer, corpus, None, config(run, max_steps=12, resume=True), extra_loss=draws, log=log)
    assert result.step == 12
    return model, draws


def _same(model, reference, draws, reference_draws):
    for key, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key  # bit-exact, not close
    assert draws.seen == {step: reference_draws.seen[step] for step in range(7, 13)}


def test_a_checkpoint_holds_no_pickle_and_resumes_bit_exactly_without_unpickling(tmp_path, corpus, tokenizer,
                                                                                  monkeypatch):
    """Regression: last/ held optimizer.pt and rng-0.pt (torch.save: pickle), read back by torch's
    unpickler; now safetensors with a JSON header, and a resume unpickles nothing."""
    reference, reference_draws = _reference(tmp_path, corpus, tokenizer)
    run = _cut(tmp_path, corpus, tokenizer)
    files = sorted(p.name for p in (run / "last").iterdir())
    assert not [name for name in files if name.endswith((".pt", ".bin", ".pkl"))], files
    assert {"optimizer.safetensors", "rng-0.safetensors", "model.safetensors", "trainer_state.json"} <= set(files)
    trainer.check_resume_point(run)

    _no_unpickling(monkeypatch)
    lines = []
    model, draws = _resumed(run, corpus, tokenizer, log=lines.append)
    _same(model, reference, draws, reference_draws)
    assert not [line for line in lines if "in the legacy torch.save format" in line]
    assert not [p for p in (run / "last").iterdir() if p.suffix == ".pt"]


def _make_legacy(last):
    """``last/`` as the loop wrote it before: optimizer.pt and rng-0.pt (torch.save), torch's generator only."""
    torch.save(state_files.load_optimizer(last / "optimizer.safetensors"), last / "optimizer.pt")
    torch.save({"torch": state_files.load_rng(last / "rng-0.safetensors")["torch"]}, last / "rng-0.pt")
    (last / "optimizer.safetensors").unlink()
    (last / "rng-0.safetensors").unlink()


def test_a_legacy_checkpoint_still_resumes_and_the_next_one_is_new(tmp_path, corpus, tokenizer):
    """Runs that wrote last/optimizer.pt before this format resume from it (torch.load with
    weights_only=True), saying so in one line; what they write next is the new format."""
    reference, reference_draws = _reference(tmp_path, corpus, tokenizer)
    run = _cut(tmp_path, corpus, tokenizer)
    _make_legacy(run / "last")
    trainer.check_resume_point(run)
    lines = []
    model, _ = _resumed(run, corpus, tokenizer, log=lines.append)
    for key, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    legacy = [line for line in lines if "in the legacy torch.save format" in line]
    assert len(legacy) == 1 and "optimizer.pt" in legacy[0] and "rng-0.pt" in legacy[0], lines
    assert sorted(p.name for p in (run / "last").iterdir() if p.suffix in (".pt", ".safetensors")) == \
        ["model.safetensors", "optimizer.safetensors", "rng-0.safetensors"]


def test_a_missing_rng_file_is_said_not_skipped_in_silence(tmp_path, corpus, tokenizer):
    """Regression: a process stopped after the new last/ was in place but before its own
    rng-<rank> file was renamed in resumed without its generators' state, saying nothing."""
    run = _cut(tmp_path, corpus, tokenizer)
    (run / "last" / "rng-0.safetensors").unlink()
    lines = []
    _resumed(run, corpus, tokenizer, log=lines.append)
    said = [line for line in lines if "no random-generator state of process 0" in line]
    assert len(said) == 1 and "rng-0.safetensors" in said[0], lines


def test_a_legacy_checkpoint_that_is_damaged_is_refused_naming_it(tmp_path, corpus, tokenizer):
    run = _cut(tmp_path, corpus, tokenizer)
    _make_legacy(run / "last")
    (run / "last" / "optimizer.pt").write_bytes(b"PK")
    with pytest.raises(HeadlabError, match=f"--resume: {run / 'last' / 'optimizer.pt'} is damaged"):
        trainer.check_resume_point(run)


def test_optimizer_state_round_trips_values_and_types():
    state = {
        "state": {
            0: {"step": torch.tensor(7.0), "exp_avg": torch.randn(3, 2, dtype=torch.bfloat16),
                "exp_avg_sq": torch.rand(3, 2).t()},  # a non-contiguous one
            2: {"step": 5, "momentum_buffer": None, "scale": 0.1 + 0.2, "flags": (True, 3, "x")},
        },
        "param_groups": [{"lr": torch.tensor(1e-3, dtype=torch.float64), "betas": (0.9, 0.98), "eps": 1e-9,
                          "foreach": None, "amsgrad": False, "weight_decay": 0, "params": [0, 1],
                          "lr_scale": float("inf")},
                         {"lr": 2e-4, "betas": [0.9, 0.999], "params": [2], "nested": {"a": [1.5, (2,)]}}],
    }
    tensors, record = state_files.optimizer_record(state)
    assert "state.0.exp_avg" in tensors and "param_groups.0.lr" in tensors
    back = state_files.optimizer_state(tensors, record)

    def same(a, b):
        assert type(a) is type(b), (a, b)
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        elif isinstance(a, dict):
            assert a.keys() == b.keys()
            for key in a:
                same(a[key], b[key])
        elif isinstance(a, (list, tuple)):
            assert len(a) == len(b)
            for x, y in zip(a, b):
                same(x, y)
        else:
            assert a == b

    same(state, back)


def test_optimizer_state_round_trips_through_a_file(tmp_path):
    param = torch.nn.Parameter(torch.randn(4, 3))
    optimizer = torch.optim.Adam([param], lr=1e-2, betas=(0.9, 0.98), amsgrad=True)
    for _ in range(3):
        param.grad = torch.randn_like(param)
        optimizer.step()
    state_files.save_optimizer(optimizer.state_dict(), tmp_path / "o.safetensors")
    twin = torch.nn.Parameter(param.detach().clone())
    other = torch.optim.Adam([twin], lr=5.0)
    other.load_state_dict(state_files.load_optimizer(tmp_path / "o.safetensors"))
    assert other.param_groups[0]["lr"] == 1e-2 and other.param_groups[0]["betas"] == (0.9, 0.98)
    grad = torch.randn_like(param)
    param.grad, twin.grad = grad, grad.clone()
    optimizer.step()
    other.step()
    assert torch.equal(param, twin)


@pytest.mark.parametrize("value,what", [({1, 2}, "set"), (np.float64(1.0), "float64"), ({1: 2}, "dict")])
def test_a_value_json_cannot_give_back_is_refused(value, what):
    with pytest.raises(HeadlabError, match=f"state.0.odd is a {what}"):
        state_files.optimizer_record({"state": {0: {"odd": value}}, "param_groups": []})


def test_rng_states_round_trip(tmp_path):
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    np.random.standard_normal()  # numpy now holds a cached gaussian
    random.gauss(0, 1)  # and python a gauss_next
    path = tmp_path / state_files.rng_file(0)
    state_files.save_rng(torch.device("cpu"), path)
    expected = (torch.rand(5), np.random.standard_normal(3), random.gauss(0, 1), random.random())
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    state_files.set_rng(state_files.load_rng(path), torch.device("cpu"))
    got = (torch.rand(5), np.random.standard_normal(3), random.gauss(0, 1), random.random())
    assert torch.equal(got[0], expected[0]) and np.array_equal(got[1], expected[1]) and got[2:] == expected[2:]


def test_a_full_disk_under_the_state_writer_names_the_file(tmp_path, monkeypatch):
    from safetensors import SafetensorError

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(state_files, "save_file", full)
    with pytest.raises(OSError, match="No space left on device") as error:
        state_files.save_rng(torch.device("cpu"), tmp_path / "rng-0.safetensors")
    assert error.value.filename == str(tmp_path / "rng-0.safetensors")
    monkeypatch.setattr(state_files, "save_file", lambda *a, **k: (_ for _ in ()).throw(SafetensorError("boom")))
    with pytest.raises(SafetensorError, match="boom"):  # any other failure stays a bug
        state_files.save_rng(torch.device("cpu"), tmp_path / "rng-0.safetensors")


def test_an_optimizer_whose_groups_last_cannot_hold_is_refused_before_any_work(tmp_path, corpus, tokenizer):
    def factory(params, cfg):
        return torch.optim.Adam([{"params": params, "tags": {"a", "b"}}], lr=cfg.lr)

    with pytest.raises(HeadlabError, match="param_groups.0.tags is a set"):
        train(tiny_model(tokenizer), tokenizer, corpus, None, config(tmp_path / "run", max_steps=2),
              optimizer_factory=factory)
    assert not (tmp_path / "run").exists()


def test_a_finished_run_resumed_says_there_is_nothing_to_train(tmp_path, corpus, tokenizer):
    """Regression: ``--resume`` on a run that had done its epochs printed "resuming from ...: epoch 2" and then
    nothing, as if it went on; now one line says it had finished and how to go on."""
    run = tmp_path / "done"
    train(tiny_model(tokenizer), tokenizer, corpus, None, config(run, max_epochs=1))
    lines = []
    result = train(tiny_model(tokenizer, seed=123), tokenizer, corpus, None, config(run, max_epochs=1, resume=True),
                   log=lines.append)
    said = [line for line in lines if line.startswith("nothing to train")]
    assert len(said) == 1 and "its 1 epoch (step 9" in said[0] and "max_epochs 1" in said[0], lines
    assert result.step == 9
