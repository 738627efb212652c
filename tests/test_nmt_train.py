"""The training loop on a tiny Marian model (d_model 32, 2+2 layers, 4 heads) and 300 pairs."""

import json

import pytest
import torch
from safetensors.torch import load_file

from headlab.cli import main
from headlab.data.batching import length_batches, token_budget_batches
from headlab.errors import HeadlabError
from headlab.nmt.train import train
from headlab.training.config import TrainConfig
from headlab.training.corpus import collate, encode_corpus
from headlab.training.loop import inverse_sqrt_lr
from headlab.training.losses import evaluate_loss, label_smoothed_loss
from support.nmt import DATA
from support.nmt import tiny_marian as tiny_model


def config(out_dir, **overrides):
    options = dict(out_dir=str(out_dir), max_tokens=400, lr=3e-3, warmup_steps=5, max_epochs=1,
                   validate=False, progress=False, seed=3)
    options.update(overrides)
    return TrainConfig(**options)


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_batches_are_token_bounded_deterministic_and_sharded(corpus, tokenizer):
    encoded = encode_corpus(tokenizer, corpus)
    batches = token_budget_batches(encoded, 300, seed=1, epoch=0)
    assert sorted(i for b in batches for i in b) == list(range(len(encoded)))
    assert all(sum(len(encoded.targets[i]) for i in b) <= 300 for b in batches)
    assert batches == token_budget_batches(encoded, 300, seed=1, epoch=0)
    assert batches != token_budget_batches(encoded, 300, seed=1, epoch=1)
    rank0 = token_budget_batches(encoded, 300, seed=1, epoch=0, rank=0, world_size=2)
    rank1 = token_budget_batches(encoded, 300, seed=1, epoch=0, rank=1, world_size=2)
    assert len(rank0) == len(rank1) == len(batches) // 2
    assert not {i for b in rank0 for i in b} & {i for b in rank1 for i in b}


def test_length_batches_are_longest_first_and_sized():
    assert length_batches([2, 5, 1, 4, 3], 2) == [[1, 3], [4, 0], [2]]
    assert length_batches({7: 1, 9: 3}, 5, [7, 9]) == [[9, 7]]


def test_collate_shifts_targets_and_masks_padding(corpus, tokenizer):
    encoded = encode_corpus(tokenizer, corpus)
    batch = collate(encoded, [0, 1], pad_id=tokenizer.pad_token_id, decoder_start_id=tokenizer.pad_token_id)
    target = encoded.targets[0]
    assert target[-1] == tokenizer.eos_token_id and encoded.sources[0][-1] == tokenizer.eos_token_id
    assert batch["labels"][0, : len(target)].tolist() == target
    assert batch["decoder_input_ids"][0, 0] == tokenizer.pad_token_id
    assert batch["decoder_input_ids"][0, 1 : len(target)].tolist() == target[:-1]
    assert (batch["labels"] == -100).sum() == batch["labels"].numel() - len(target) - len(encoded.targets[1])
    assert batch["attention_mask"].sum() == len(encoded.sources[0]) + len(encoded.sources[1])


def test_schedule_warms_up_then_decays():
    assert inverse_sqrt_lr(1, 1e-3, 400) == pytest.approx(2.5e-6)
    assert inverse_sqrt_lr(400, 1e-3, 400) == pytest.approx(1e-3)
    assert inverse_sqrt_lr(1600, 1e-3, 400) == pytest.approx(5e-4)
    assert inverse_sqrt_lr(1600, 1e-3, 400, "constant") == pytest.approx(1e-3)


def test_a_few_steps_lower_the_loss(tmp_path, corpus, tokenizer):
    model = tiny_model(tokenizer)
    encoded = encode_corpus(tokenizer, corpus)
    batch = collate(encoded, list(range(32)), tokenizer.pad_token_id, tokenizer.pad_token_id)
    cfg = config(tmp_path / "run", max_epochs=3)

    def loss_now():
        model.eval()
        with torch.no_grad():
            total, n = label_smoothed_loss(model, batch, cfg)
        return total.item() / n

    before = loss_now()
    seen = []
    result = train(model, tokenizer, corpus, None, cfg, callback=lambda m, step, info: seen.append(info["loss"]),
                   callback_every=1)
    after = loss_now()
    assert result.stopped == "finished" and result.epoch == 3
    assert after < before - 0.5, (before, after)
    assert seen[-1] < seen[0]
    assert [record["epoch"] for record in result.history] == [1, 2, 3]
    assert sorted(p.name for p in (tmp_path / "run" / "epochs").iterdir()) == ["epoch-001", "epoch-002", "epoch-003"]


def test_resume_continues_exactly_where_the_run_stopped(tmp_path, corpus, tokenizer):
    # Reference: 12 uninterrupted steps over an epoch boundary (9 steps an epoch at 1,000 tokens).
    reference = tiny_model(tokenizer)
    full = train(reference, tokenizer, corpus, None, config(tmp_path / "full", max_tokens=1000, max_epochs=3,
                                                            max_steps=12))
    assert full.step == 12 and [r["epoch"] for r in full.history] == [1]

    # "Killed" run: stops at step 6 (mid-epoch); its resume checkpoint holds that position.
    first = tiny_model(tokenizer)
    stopped = train(first, tokenizer, corpus, None, config(tmp_path / "cut", max_tokens=1000, max_epochs=3,
                                                           max_steps=6, save_every_steps=3))
    assert stopped.stopped == "max_steps"
    state = json.loads((tmp_path / "cut" / "last" / "trainer_state.json").read_text())
    assert state["step"] == 6 and state["epoch"] == 0 and state["batch_in_epoch"] == 6
    saved = load_file(str(tmp_path / "cut" / "last" / "model.safetensors"))
    assert all(torch.equal(saved[k], v) for k, v in first.state_dict().items() if k in saved)

    # A fresh process would build a fresh model: its weights must come from the checkpoint.
    second = tiny_model(tokenizer, seed=123)
    resumed = train(second, tokenizer, corpus, None, config(tmp_path / "cut", max_tokens=1000, max_epochs=3,
                                                            max_steps=12, resume=True))
    assert resumed.step == 12
    for key, value in reference.state_dict().items():
        assert torch.allclose(second.state_dict()[key], value, atol=1e-6), key
    # The epoch cut at step 6 is recorded whole: its loss is over all 9 steps, not the last 3.
    record, whole = resumed.history[0], full.history[0]
    assert record["epoch"] == 1 and record["step"] == whole["step"] == 9
    assert record["train_loss"] == pytest.approx(whole["train_loss"], rel=1e-6)
    assert record["tokens_seen"] == whole["tokens_seen"]
    # speed x minutes: the tokens of both parts of the epoch
    assert record["tokens_per_s"] * record["epoch_minutes"] * 60 == pytest.approx(whole["tokens_seen"], rel=1e-6)


def test_a_resume_of_a_run_already_at_max_steps_makes_no_update(tmp_path, corpus, tokenizer):
    """A run stopped by --max-steps and resumed with the same limit stays where it was (it made one
    more update: 23 became 24)."""
    out = tmp_path / "run"
    first = train(tiny_model(tokenizer), tokenizer, corpus, None, config(out, max_tokens=1000, max_steps=3))
    assert first.step == 3
    before = load_file(str(out / "last" / "model.safetensors"))
    again = tiny_model(tokenizer, seed=123)
    resumed = train(again, tokenizer, corpus, None, config(out, max_tokens=1000, max_steps=3, resume=True))
    assert resumed.step == 3 and resumed.stopped == "max_steps"
    assert json.loads((out / "last" / "trainer_state.json").read_text())["step"] == 3
    assert all(torch.equal(again.state_dict()[k], v) for k, v in before.items() if k in again.state_dict())


def test_a_resume_that_changes_options_is_recorded(tmp_path, corpus, tokenizer):
    """train_config.json keeps the first start's options; a resume with other values for options that
    change the training appends them with its step (a time limit alone is no change)."""
    out = tmp_path / "run"
    train(tiny_model(tokenizer), tokenizer, corpus, None, config(out, max_tokens=1000, max_steps=3))
    train(tiny_model(tokenizer), tokenizer, corpus, None,
          config(out, max_tokens=1000, max_steps=4, resume=True, max_time_minutes=5.0))
    changes_file = out / "train_config_changes.json"
    assert json.loads(changes_file.read_text()) == [
        {"step": 3, "epoch": 1, "batch_in_epoch": 3, "changed": {"max_steps": 4}}]
    train(tiny_model(tokenizer), tokenizer, corpus, None,
          config(out, max_tokens=1000, max_steps=5, warmup_steps=7, resume=True))
    changes = json.loads(changes_file.read_text())
    assert changes[1] == {"step": 4, "epoch": 1, "batch_in_epoch": 4, "changed": {"max_steps": 5, "warmup_steps": 7}}
    assert json.loads((out / "train_config.json").read_text())["max_steps"] == 3


def test_output_directory_with_a_model_is_refused(tmp_path, corpus, tokenizer):
    out = tmp_path / "run"
    train(tiny_model(tokenizer), tokenizer, corpus, None, config(out, max_steps=2))
    with pytest.raises(HeadlabError, match="--overwrite"):
        train(tiny_model(tokenizer), tokenizer, corpus, None, config(out, max_steps=2))
    result = train(tiny_model(tokenizer), tokenizer, corpus, None, config(out, max_steps=2, overwrite=True))
    assert result.step == 2


def test_divergence_stops_and_keeps_the_last_good_checkpoint(tmp_path, corpus, tokenizer):
    model = tiny_model(tokenizer)

    def poison(model, batch, step):  # the extra-loss hook turns the loss into NaN at step 5
        return torch.tensor(float("nan")) if step == 5 else torch.tensor(0.0)

    result = train(model, tokenizer, corpus, None, config(tmp_path / "run", save_every_steps=2), extra_loss=poison)
    assert result.stopped == "diverged" and result.step == 4
    assert "diverged" in result.message and "last" in result.message
    state = json.loads((tmp_path / "run" / "last" / "trainer_state.json").read_text())
    assert state["step"] == 4
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_only_selected_parameters_train_and_extra_loss_is_added(tmp_path, corpus, tokenizer):
    model = tiny_model(tokenizer)
    before = weights(model)
    selected = lambda name, param: name.startswith("model.encoder.layers.0.")  # noqa: E731
    calls = []

    def extra(model, batch, step):
        calls.append(step)
        return 0.0 * sum(p.sum() for p in model.model.encoder.layers[0].parameters())

    train(model, tokenizer, corpus, None, config(tmp_path / "run", max_steps=3), trainable=selected, extra_loss=extra)
    after = weights(model)
    assert calls == [1, 2, 3]
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith("model.encoder.layers.0.") for k in changed)


def test_validation_keeps_the_best_checkpoint_and_averages(tmp_path, corpus, tokenizer):
    valid = corpus.subset(20)
    scores = iter([1.0, 3.0, 2.0, 0.5])  # a stand-in validation metric, then the average's
    result = train(
        tiny_model(tokenizer), tokenizer, corpus, valid,
        config(tmp_path / "run", max_epochs=3, validate=True, average_last=2),
        validate_fn=lambda model, tok, data, cfg: {"score": next(scores)},
    )
    assert result.best_epoch == 2 and result.best_score == 3.0 and result.averaged_score == 0.5
    best = json.loads((tmp_path / "run" / "best" / "metrics.json").read_text())
    assert best["epoch"] == 2
    assert (tmp_path / "run" / "best" / "tokenizer.json").is_file()
    averaged = json.loads((tmp_path / "run" / "averaged" / "metrics.json").read_text())
    assert averaged["averaged_epochs"] == [2, 3]


@pytest.mark.parametrize("metric", ["score", "loss"])
def test_a_nan_averaged_model_is_refused_and_not_written(tmp_path, corpus, tokenizer, metric):
    """The averaged model's validation was only logged: a NaN score (or loss) was returned as the run's
    averaged_score and its weights written to ``averaged/`` (which the from-scratch baselines then score). It is
    refused instead, naming the cause, and an ``averaged/`` of an earlier average of the run is removed;
    ``best/`` and the history are the run's."""
    out = tmp_path / "run"
    scores = iter([{"score": 1.0, "loss": 3.0}, {"score": 3.0, "loss": 2.0}, {"score": 0.5, "loss": 2.5}])
    train(tiny_model(tokenizer), tokenizer, corpus, corpus.subset(5),
          config(out, max_epochs=2, max_tokens=2000, validate=True, average_last=2),
          validate_fn=lambda model, tok, data, cfg: next(scores))
    assert (out / "averaged" / "metrics.json").is_file()  # epochs 1 and 2, validated finite
    nan = float("nan")
    bad = {"score": nan, "loss": 2.5} if metric == "score" else {"score": 0.5, "loss": nan}
    scores = iter([{"score": 2.0, "loss": 2.2}, bad])
    with pytest.raises(HeadlabError, match=rf"the averaged model of epochs \[2, 3\] validates to a {metric} that is "
                                           rf"not finite \(.*\): not written to .*averaged.*best/ \(epoch 2\)"):
        train(tiny_model(tokenizer), tokenizer, corpus, corpus.subset(5),
              config(out, max_epochs=3, max_tokens=2000, validate=True, average_last=2, resume=True),
              validate_fn=lambda model, tok, data, cfg: next(scores))
    assert not (out / "averaged").exists()
    assert json.loads((out / "best" / "metrics.json").read_text())["epoch"] == 2
    assert [record["valid_score"] for record in json.loads((out / "history.json").read_text())] == [1.0, 3.0, 2.0]


@pytest.mark.parametrize("first", [True, False])
@pytest.mark.parametrize("metric", ["score", "loss"])
def test_a_nan_validation_stops_the_run_and_never_becomes_best(tmp_path, corpus, tokenizer, first, metric):
    """A model gone bad validates to NaN: NaN compares false with everything, so it was taken as the
    best at the first validation (``best/`` written from it, NaN in the history) and never beaten. It
    stops the run as diverged instead, naming the epoch and the metric, with ``best/``, ``last/`` and
    the history as the last good epoch left them."""
    nan = float("nan")
    good = [] if first else [{"score": 2.0, "loss": 3.0}]
    bad = {"score": nan, "loss": 2.5} if metric == "score" else {"score": 1.0, "loss": nan}
    metrics = iter([*good, bad, {"score": 9.0, "loss": 1.0}])
    out = tmp_path / "run"
    result = train(tiny_model(tokenizer), tokenizer, corpus, corpus.subset(5),
                   config(out, max_epochs=3, max_tokens=2000, validate=True, patience_metric=metric),
                   validate_fn=lambda model, tok, data, cfg: next(metrics))
    epoch = len(good) + 1
    assert result.stopped == "diverged" and result.epoch == len(good)
    assert f"training diverged at the validation of epoch {epoch} (after step " in result.message, result.message
    assert f"the validation {metric} is not finite" in result.message
    assert len(result.history) == len(good)
    assert all(record["valid_score"] == 2.0 for record in result.history)
    assert not (out / "epochs" / f"epoch-{epoch:03d}").exists()
    if first:
        assert result.best_score is None and not (out / "best").exists() and not (out / "last").exists()
        assert "Last good checkpoint: none written yet" in result.message
    else:
        assert result.best_score == 2.0 and result.best_epoch == 1
        assert json.loads((out / "best" / "metrics.json").read_text())["epoch"] == 1
        assert json.loads((out / "last" / "trainer_state.json").read_text())["epoch"] == 1
        assert json.loads((out / "history.json").read_text()) == result.history


def _strict(path):
    """``path`` read as JSON that a strict reader (JSON.parse, jq) takes: no NaN or Infinity token."""
    def refuse(token):
        raise AssertionError(f"{path.name}: {token} is not JSON")
    return json.loads(path.read_text(), parse_constant=refuse)


def test_a_nan_beside_the_watched_score_is_written_as_null_and_resumes(tmp_path, corpus, tokenizer):
    """Regression: a validation loss of NaN beside a finite BLEU (the patience rule watches the score)
    was written into history.json, trainer_state.json and best/metrics.json as the bare token NaN,
    which is not JSON. It is null now; a resume reads the state back and the card shows n/a."""
    nan = float("nan")
    metrics = iter([{"score": 2.0, "bleu": 2.0, "chrf": 9.0, "loss": nan}, {"score": 3.0, "bleu": 3.0, "chrf": 9.5,
                                                                            "loss": 2.0}])
    out = tmp_path / "run"
    train(tiny_model(tokenizer), tokenizer, corpus, corpus.subset(5),
          config(out, max_epochs=1, max_tokens=2000, validate=True),
          validate_fn=lambda model, tok, data, cfg: next(metrics))
    assert _strict(out / "history.json")[0]["valid_loss"] is None
    assert _strict(out / "last" / "trainer_state.json")["history"][0]["valid_loss"] is None
    assert _strict(out / "best" / "metrics.json")["valid_loss"] is None
    result = train(tiny_model(tokenizer), tokenizer, corpus, corpus.subset(5),
                   config(out, max_epochs=2, max_tokens=2000, validate=True, resume=True),
                   validate_fn=lambda model, tok, data, cfg: next(metrics))
    assert result.epoch == 2 and result.best_epoch == 2
    assert [record["valid_loss"] for record in _strict(out / "history.json")] == [None, 2.0]
    curve = render_card_blocks_of(tmp_path, result.history)
    assert "| n/a |" in curve and "| 2.0000 |" in curve


def test_a_curve_written_with_nan_tokens_still_renders(tmp_path):
    """Files written before NaN became null hold NaN tokens (Python's json reads them): the card shows n/a."""
    from headlab.nmt.card import curve_table

    row = {"epoch": 1, "step": 10, "tokens_seen": 99, "train_loss": float("nan"), "valid_bleu": 1.0, "valid_chrf": 2.0,
           "valid_loss": None, "epoch_minutes": 1.0, "tokens_per_s": 5.0}
    assert curve_table(json.loads(json.dumps([row]))).count("n/a") == 2


@pytest.mark.parametrize("metric, epochs", [("score", 3), ("loss", 5)])
def test_the_patience_rule_reads_the_score_or_the_loss(tmp_path, corpus, tokenizer, metric, epochs):
    """BLEU best at epoch 1, the loss falling by 0.1 until epoch 3, then by 0.01: patience 2 stops
    after epoch 3 on the score and after epoch 5 on the loss (epochs 2 and 3 count as progress, 4
    and 5 not: 0.01 is below --min-improvement 0.05); the best checkpoint is the best score either way."""
    metrics = iter([{"score": 5.0, "loss": 3.0}, {"score": 5.0, "loss": 2.9}, {"score": 4.0, "loss": 2.8},
                    {"score": 4.0, "loss": 2.79}, {"score": 4.0, "loss": 2.78}, {"score": 4.0, "loss": 2.77}])
    result = train(tiny_model(tokenizer), tokenizer, corpus, corpus.subset(5),
                   config(tmp_path / "run", max_epochs=6, max_tokens=2000, validate=True, patience=2,
                          min_improvement=0.05, patience_metric=metric),
                   validate_fn=lambda model, tok, data, cfg: next(metrics))
    assert result.stopped == "converged" and result.epoch == epochs
    assert result.best_epoch == 1
    if metric == "loss":  # the message names what the rule watched, not the best score alone
        assert "without lowering the validation loss by 0.05 (lowest 2.7800, last lowered so at epoch 3" \
            in result.message, result.message


def test_default_validation_is_bleu_with_the_loss_beside_it(tmp_path, corpus, tokenizer):
    valid = corpus.subset(10)
    model = tiny_model(tokenizer)
    result = train(model, tokenizer, corpus, valid, config(tmp_path / "run", validate=True, valid_batch_size=10))
    record = result.history[0]
    assert record["valid_beam"] == 1 and 0.0 <= record["valid_bleu"] <= 100.0 and "valid_chrf" in record
    assert record["valid_score"] == record["valid_bleu"]  # the patience rule reads BLEU
    # The loss is the epoch's weights' mean cross-entropy per reference token, without smoothing.
    assert record["valid_loss"] == pytest.approx(evaluate_loss(model, tokenizer, valid, batch_tokens=400), rel=1e-5)
    assert "| val loss |" in render_card_blocks_of(tmp_path, result.history)


def render_card_blocks_of(folder, history):
    from headlab.nmt.card import render_card_blocks

    (folder / "train_history.json").write_text(json.dumps(history))
    return render_card_blocks(folder)["curve"]


def test_cli_train_then_refuses_existing_output(tmp_path, capsys):
    args = ["nmt", "train", "--train-src", str(DATA / "val.en.gz"), "--train-tgt", str(DATA / "val.de.gz"),
            "--out", str(tmp_path / "run"), "--limit", "100", "--vocab-size", "300", "--d-model", "32",
            "--ffn", "64", "--layers", "2", "--heads", "4", "--max-positions", "64", "--max-steps", "2",
            "--max-tokens", "300", "--no-progress"]
    assert main(args) == 0
    assert (tmp_path / "run" / "last" / "model.safetensors").is_file()
    assert (tmp_path / "run" / "tokenizer" / "tokenizer.json").is_file()
    assert main(args) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main(args + ["--overwrite"]) == 0


def test_cli_train_reports_bad_input(tmp_path, capsys):
    args = ["nmt", "train", "--train-src", str(tmp_path / "missing.en"), "--train-tgt", str(DATA / "val.de.gz"),
            "--out", str(tmp_path / "run")]
    assert main(args) == 2
    assert "missing.en" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_bf16_autocast_trains_and_keeps_fp32_weights(tmp_path, corpus, tokenizer):
    model = tiny_model(tokenizer)
    seen = []
    train(model, tokenizer, corpus, None, config(tmp_path / "run", max_epochs=2, mixed_precision="bf16"),
          callback=lambda m, step, info: seen.append(info["loss"]), callback_every=1)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert sum(seen[-3:]) / 3 < sum(seen[:3]) / 3
    with pytest.raises(HeadlabError, match="mixed_precision"):
        train(tiny_model(tokenizer), tokenizer, corpus, None, config(tmp_path / "x", mixed_precision="fp16"))


def test_adaptive_threads_keeps_the_faster_setting_and_probes_rarely(monkeypatch):
    from headlab.nmt import threads as module

    clock = {"now": 0.0}
    monkeypatch.setattr(module.time, "perf_counter", lambda: clock["now"])
    monkeypatch.setattr(module.torch, "set_num_threads", lambda n: None)
    speed = {1: 1000.0, 2: 100.0}  # target tokens/s with n threads on a busy machine
    adaptive = module.AdaptiveThreads([1, 2], probe_steps=2, first_interval=8)
    used = []
    tokens = 0
    for step in range(1, 401):
        used.append(adaptive.current)  # the setting this step runs with
        clock["now"] += 400 / speed[adaptive.current]
        tokens += 400
        adaptive(None, step, {"tokens": tokens, "epoch": 0})
    assert adaptive.best == 1 and adaptive.rates[1] == pytest.approx(1000.0)
    assert adaptive.rates[2] == pytest.approx(100.0)
    assert 3 <= used.count(2) <= 20  # probed now and then, with growing gaps

    speed = {1: 500.0, 2: 1000.0}  # the load changes: two threads now win
    for step in range(401, 1001):
        clock["now"] += 400 / speed[adaptive.current]
        tokens += 400
        adaptive(None, step, {"tokens": tokens, "epoch": 0})
    assert adaptive.best == 2


def test_the_card_marks_an_epoch_recorded_only_after_a_resume(tmp_path):
    """Records of older trainers covered only the part of a resumed epoch after the resume;
    the card's curve says so where the speed x minutes falls short of the epoch's tokens."""
    from headlab.nmt.card import render_card_blocks

    def record(epoch, seen, minutes, speed):
        return {"epoch": epoch, "step": 10 * epoch, "tokens_seen": seen, "train_loss": 3.0, "valid_bleu": 1.0,
                "valid_chrf": 2.0, "epoch_minutes": minutes, "tokens_per_s": speed}

    history = [record(1, 6000, 1.0, 100.0), record(2, 12000, 0.25, 100.0), record(3, 18000, 2.0, 50.0)]
    (tmp_path / "train_history.json").write_text(json.dumps(history))
    curve = render_card_blocks(tmp_path)["curve"]
    rows = [line for line in curve.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [row.count("*") for row in rows] == [0, 3, 0]
    assert curve.rstrip().endswith("epoch 2 (25%).")


@pytest.mark.parametrize("option, value, expected", [
    ("--heads", "3", "--d-model 32 is not divisible by --heads 3"),
    ("--vocab-size", "5", "--vocab-size 5 is too small"),
])
def test_train_refuses_a_bad_shape_before_reading_the_data(option, value, expected, tmp_path, capsys, monkeypatch):
    """Regression: --heads not dividing --d-model, or a vocabulary too small for the special
    tokens, was refused only after the training data were read and a vocabulary trained."""
    import headlab.nmt.recipe

    monkeypatch.setattr(headlab.nmt.recipe, "run_tokenizer", lambda *a, **k: pytest.fail("a vocabulary was made"))
    src, tgt = tmp_path / "train.en", tmp_path / "train.de"
    src.write_text("a dog runs\n", encoding="utf-8")
    tgt.write_text("ein hund rennt\n", encoding="utf-8")
    args = ["nmt", "train", "--train-src", str(src), "--train-tgt", str(tgt), "--out", str(tmp_path / "run"),
            "--d-model", "32", "--heads", "4", "--vocab-size", "300", option, value]
    assert main(args) == 2
    assert expected in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
