"""The headlab loop both heavy-lifting drivers share (experiments/heavy_lifting_runner.py): the
deadline's SIGINT reaches the running command even when the driver was started with SIGINT
ignored (a background `&` launch), the command line goes to the log, and a failed configuration
does not stop the rest. A shell script stands in for ``python -m headlab``."""

import argparse
import datetime as dt
import json
import signal
from pathlib import Path

import pytest

from support.experiments import load_experiment

REPO = Path(__file__).resolve().parents[1]


runner = load_experiment("heavy_lifting_runner")


def _runner(tmp_path, cls=None, deadline=None, only=None):
    (tmp_path / "labels.json").write_text("{}")
    args = argparse.Namespace(root=str(tmp_path / "root"), model=str(tmp_path), deadline=deadline,
                              labels=str(tmp_path / "labels.json"), only=only)
    return (cls or runner.Runner)(args)


def test_the_deadline_interrupts_the_command_even_when_the_driver_ignores_sigint(tmp_path):
    """The child gets SIGINT back (a shell cannot trap a signal ignored at its start): the stand-in
    training writes its checkpoint and exits, and the driver stops with Deadline."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\n"
                    "trap 'echo checkpoint kept; kill $sleeper; exit 130' INT\n"
                    "echo training \"$@\"\n"
                    "sleep 60 & sleeper=$!\n"
                    "wait $sleeper\n")
    fake.chmod(0o755)
    r = _runner(tmp_path, deadline=dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=1.5))
    r.python = str(fake)
    log = tmp_path / "run" / "log.txt"
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with pytest.raises(runner.Deadline, match="deadline reached during headlab prune train"):
            r.headlab(["prune", "train", "model dir", "--heads", "dec_self:0:1;dec_self:1:2"], log)
    finally:
        signal.signal(signal.SIGINT, before)
    text = log.read_text()
    assert "$ headlab prune train 'model dir' --heads 'dec_self:0:1;dec_self:1:2'\n" in text
    assert "training -m headlab prune train model dir" in text
    assert text.rstrip().endswith("checkpoint kept")


def test_the_command_runs_to_its_end_before_the_deadline(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho done \"$@\"\nexit 3\n")
    fake.chmod(0o755)
    r = _runner(tmp_path, deadline=dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1))
    r.python = str(fake)
    assert r.headlab(["prune", "apply"], tmp_path / "log.txt") == 3
    assert "done -m headlab prune apply" in (tmp_path / "log.txt").read_text()


class _Plan(runner.Runner):
    ran: list

    def run_one(self, config):
        self.ran.append(config["name"])
        if config["name"] == "broken":
            raise RuntimeError("prune train exited 1")
        if config["name"] == "late":
            raise runner.Deadline("deadline reached during headlab prune train")
        (self.root / config["name"]).mkdir(parents=True)
        (self.root / config["name"] / "eval.json").write_text("{}")
        self.done.append(config["name"])


def test_a_failed_configuration_does_not_stop_the_rest(tmp_path):
    r = _runner(tmp_path, _Plan)
    r.ran = []
    (r.root / "finished").mkdir(parents=True)
    (r.root / "finished" / "eval.json").write_text("{}")
    r.run_one = lambda config: _Plan.run_one(r, config) if config["name"] != "finished" else None
    assert r.run_configs([{"name": "finished"}, {"name": "broken"}, {"name": "next"}]) == 1
    assert r.ran == ["broken", "next"]
    status = (r.root / "STATUS").read_text().splitlines()
    assert status[0].endswith("finished with failures: broken")
    assert status[1] == "finished: 2: finished, next"
    r.ran = []
    assert r.run_configs([{"name": "late"}, {"name": "after"}]) == 0  # the deadline stops the driver
    assert r.ran == ["late"]
    assert "stopped: deadline reached during headlab prune train" in (r.root / "STATUS").read_text()


def test_the_drivers_share_the_loop(tmp_path):
    """Both drivers' Runners are the shared one; the translation driver's stage-2 controls are
    finished by eval-1728.json, and the LM driver's side-by-side drivers each write a STATUS of their own."""
    lm, nmt = load_experiment("heavy_lifting_lm"), load_experiment("heavy_lifting_nmt")
    assert issubclass(lm.Runner, runner.Runner) and issubclass(nmt.Runner, runner.Runner)
    labels = json.loads((REPO / "docs" / "results" / "heavy-lifting-nmt" / "labels.json").read_text())
    args = argparse.Namespace(root=str(tmp_path), model=str(tmp_path), deadline=None, only=None,
                              labels=str(REPO / "docs" / "results" / "heavy-lifting-nmt" / "labels.json"),
                              data=str(tmp_path), results=str(tmp_path), stage=2, extra_train_args=None,
                              extra_control_args=None, extra_scratch_args=None, extra_gated_args=None)
    assert nmt.Runner(args).result_file(nmt.plan(labels, 2)[0]) == "eval-1728.json"
    args = argparse.Namespace(root=str(tmp_path), model=str(tmp_path), deadline=None, only="full",
                              labels=str(REPO / "docs" / "results" / "heavy-lifting-nmt" / "labels.json"),
                              eval=["dev=x"], train=["t"], extra_train_args=None, epochs=2)
    r = lm.Runner(args)
    assert r.status_name().startswith("STATUS-") and "2" in r.recipe
