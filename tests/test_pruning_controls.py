"""Controls of issue 35: `prune baseline --freeze-decoder` (k random or chosen encoder heads
fine-tuned as gated fine-tuning of encoder heads is, every decoder parameter frozen) and the
from-scratch recipe options (learning rate, warm-up, checkpoint averaging), on a tiny Marian."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from headlab.cli import main
from headlab.pruning import baselines
from headlab.pruning.dev import read_dev_curve
from headlab.pruning.train import _decoder_parameters, evaluate_model
from headlab.surgery import prune_heads
from headlab.training.config import TrainConfig
from headlab.training.loop import average_checkpoints
from support.nmt import DATA
from support.nmt import tiny_marian as marian


def _decoder_names(model) -> set[str]:
    frozen = _decoder_parameters(model)
    return {name for name, p in model.named_parameters() if id(p) in frozen}


class _AdamSpy(torch.optim.Adam):
    params: list[int] = []

    def __init__(self, params, *args, **kwargs):
        params = list(params)
        for item in params:
            _AdamSpy.params += [id(p) for p in (item["params"] if isinstance(item, dict) else [item])]
        super().__init__(params, *args, **kwargs)


@pytest.mark.parametrize("freeze", [True, False], ids=["frozen", "trained"])
def test_frozen_decoder_fine_tuning_leaves_every_decoder_weight_bit_identical(freeze, corpus, tokenizer, tmp_path,
                                                                             monkeypatch):
    model = marian(tokenizer)
    spec = baselines.random_spec(model, 3, ("enc_self",), seed=1)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    monkeypatch.setattr(torch.optim, "Adam", _AdamSpy)
    _AdamSpy.params = []
    config = TrainConfig(out_dir=str(tmp_path / "ft"), max_tokens=400, lr=1e-3, warmup_steps=0, schedule="constant",
                         max_epochs=10**6, max_steps=4, validate=False, keep_epoch_checkpoints=False, progress=False)
    row = baselines.evaluate_baseline(model, tokenizer, spec, corpus.subset(3), train_data=corpus.subset(60),
                                      finetune=config, beam=1, freeze_decoder=freeze)
    assert row["finetune_steps"] == 4 and row["heads_kept"]["enc_self"] == 3
    decoder = _decoder_names(model)
    assert "model.decoder.layers.0.self_attn.q_proj.weight" in decoder
    assert "model.shared.weight" in decoder  # tied to the output layer: the embeddings are the decoder's too
    after = dict(model.named_parameters())
    moved = {name for name in decoder if not torch.equal(after[name], before[name])}
    encoder = [name for name in after if name.startswith("model.encoder.layers.")
               and not name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias",
                                      "v_proj.weight", "v_proj.bias", "out_proj.weight"))]  # pruned: other shapes
    assert encoder and all(not torch.equal(after[name], before[name]) for name in encoder)
    in_optimizer = set(_AdamSpy.params)
    if freeze:
        assert not moved  # bit for bit
        assert not any(after[name].requires_grad or id(after[name]) in in_optimizer for name in decoder)
        assert row["freeze_decoder"] is True
    else:
        assert moved == decoder - {"model.decoder.embed_positions.weight"}  # never saved, never trained
        assert "freeze_decoder" not in row


def _run(out, config, corpus, tokenizer, monkeypatch, train=None):
    monkeypatch.setattr(baselines, "train", train or baselines.train)
    try:
        baselines.run_baselines(lambda: (marian(tokenizer), tokenizer), corpus.subset(60), corpus.subset(4), config,
                                out, dev_data=corpus.subset(5), log=lambda message: None)
    finally:
        monkeypatch.undo()
    return json.loads((out / "baselines.json").read_text())


def test_frozen_decoder_fine_tuning_killed_and_resumed_ends_bit_identical(corpus, tokenizer, tmp_path, monkeypatch):
    """A control costs 864 updates: one cut short continues from its last checkpoint to the
    weights, translations and development curve of an uninterrupted run, the decoder still the
    starting one; one killed after its last update, before its row, is not trained one update
    further."""
    config = baselines.BaselineConfig(method="random", keeps=(2,), seeds=(1,), finetune_steps=9, freeze_decoder=True,
                                      dev_every=3,
                                      max_tokens=400, lr=1e-3, eval_beam=1, model_fingerprint="tiny")
    whole = _run(tmp_path / "whole", config, corpus, tokenizer, monkeypatch)
    real_train = baselines.train

    def killed_at(step):
        def train(*args, **kwargs):
            real_train(*args[:4], replace(args[4], max_steps=step), **kwargs)
            raise KeyboardInterrupt
        return train

    name = "ft-random-2-1"
    for out, kill in ((tmp_path / "mid", 4), (tmp_path / "end", 9)):
        with pytest.raises(KeyboardInterrupt):
            _run(out, config, corpus, tokenizer, monkeypatch, killed_at(kill))
        assert json.loads((out / name / "last" / "trainer_state.json").read_text())["step"] == kill
        rows = _run(out, config, corpus, tokenizer, monkeypatch)
        assert rows == whole and rows[0]["finetune_steps"] == 9 and rows[0]["freeze_decoder"] is True
        a, b = (load_file(str(d / name / "last" / "model.safetensors")) for d in (tmp_path / "whole", out))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        for text in ("hypotheses.txt", "dev/step-000000.txt", "dev/step-000006.txt", "dev/step-000009.txt"):
            assert (out / name / text).read_text() == (tmp_path / "whole" / name / text).read_text()
        assert read_dev_curve(out / name) == read_dev_curve(tmp_path / "whole" / name)
    assert [r["step"] for r in read_dev_curve(tmp_path / "whole" / name)] == [0, 3, 6, 9]
    plateau = whole[0]["dev_plateau"]
    assert (plateau["from_step"], plateau["to_step"]) == (3, 9) and plateau["call"] in ("flat", "rising", "undecided")
    start = marian(tokenizer).state_dict()
    decoder = _decoder_names(marian(tokenizer))
    assert all(torch.equal(a[k], start[k]) for k in a if k in decoder)
    assert any(not torch.equal(a[k], start[k]) for k in a if k.startswith("model.encoder.layers.1.fc1"))
    # The same heads fine-tuned with the decoder trained: another row, not the frozen one re-used.
    rows = _run(tmp_path / "whole", replace(config, freeze_decoder=False), corpus, tokenizer, monkeypatch)
    assert len(rows) == 1 and "freeze_decoder" not in rows[0]
    assert json.loads((tmp_path / "whole" / "baselines.stale.json").read_text()) == whole


def test_from_scratch_with_the_full_models_recipe_scores_the_mean_of_its_last_epochs(corpus, tokenizer, tmp_path,
                                                                                     monkeypatch):
    config = baselines.BaselineConfig(method="random", keeps=(3,), seeds=(1,), from_scratch=True, scratch_epochs=3,
                                      scratch_lr=7e-4, scratch_warmup_steps=5, scratch_average_last=2, max_tokens=400,
                                      eval_beam=1, model_fingerprint="tiny")
    rows = _run(tmp_path / "b", config, corpus, tokenizer, monkeypatch)
    run = tmp_path / "b" / "scratch-random-3-1"
    recipe = json.loads((run / "train_config.json").read_text())
    assert (recipe["lr"], recipe["warmup_steps"], recipe["average_last"], recipe["max_epochs"]) == (7e-4, 5, 2, 3)
    row = rows[0]
    assert row["averaged_epochs"] == [2, 3]
    assert (row["scratch_lr"], row["scratch_warmup_steps"], row["scratch_average_last"]) == (7e-4, 5, 2)
    # The row scores the element-wise mean of epochs 2 and 3, not the last checkpoint.
    spec = baselines.random_spec(marian(tokenizer), 3, ("enc_self",), seed=1)

    def loss_of(weights):
        model = marian(tokenizer)
        prune_heads(model, spec)
        model.load_state_dict(weights, strict=False)
        return evaluate_model(model.eval(), tokenizer, corpus.subset(4), beam=1)["loss"]

    mean = average_checkpoints([run / "epochs" / "epoch-002", run / "epochs" / "epoch-003"])
    assert row["loss"] == loss_of(mean)
    assert row["loss"] != loss_of(load_file(str(run / "epochs" / "epoch-003" / "model.safetensors")))
    # A row of the earlier recipe (no such keys: lr 1e-3, warm-up 400, the last checkpoint) is stale.
    earlier = {k: v for k, v in row.items() if not k.startswith("scratch_") and k != "averaged_epochs"}
    (tmp_path / "b" / "baselines.json").write_text(json.dumps([earlier]))
    rows = _run(tmp_path / "b", config, corpus, tokenizer, monkeypatch)
    assert json.loads((tmp_path / "b" / "baselines.stale.json").read_text()) == [earlier]
    assert rows[0]["loss"] == row["loss"]


@pytest.fixture(scope="module")
def model_dir(tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("controls") / "tiny"
    marian(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _args(model_dir, out, *extra):
    return ["prune", "baseline", str(model_dir), "--train-src", str(DATA / "train.en.gz"),
            "--train-tgt", str(DATA / "train.de.gz"), "--valid-src", str(DATA / "val.en.gz"),
            "--valid-tgt", str(DATA / "val.de.gz"), "--method", "random", "--keeps", "1", "--out", str(out), *extra]


@pytest.mark.parametrize("extra, message", [
    (("--freeze-decoder",), "--freeze-decoder freezes the decoder during the fine-tuning of --finetune-steps"),
    (("--freeze-decoder", "--from-scratch"), "it does not apply to --from-scratch"),
    (("--scratch-lr", "7e-4"), "--scratch-lr set the recipe of --from-scratch"),
    (("--dev-src", str(DATA / "train.en.gz"), "--dev-tgt", str(DATA / "train.de.gz"), "--dev-every", "5"),
     "the development curve is of the fine-tuning of --finetune-steps N > 0"),
    (("--from-scratch", "--scratch-epochs", "3", "--scratch-average-last", "4"), "has only 3 epoch checkpoints"),
    (("--from-scratch", "--scratch-epochs", "1", "--scratch-average-last", "2"), "has only 1 epoch checkpoint\n"),
], ids=["no-finetuning", "from-scratch", "scratch-option-alone", "dev-without-finetuning", "average-more-than-epochs",
        "average-more-than-one-epoch"])
def test_recipe_options_that_would_do_nothing_are_refused_before_any_work(extra, message, model_dir, tmp_path,
                                                                         capsys):
    assert main(_args(model_dir, tmp_path / "out", *extra)) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_an_interrupted_baseline_says_that_its_running_trainings_checkpoint_is_kept(tmp_path):
    """Fine-tunings and from-scratch trainings resume from their last checkpoint: a Ctrl-C before
    the first row must not say that nothing was kept."""
    from headlab.cli import build_parser, interrupted_note

    args = build_parser().parse_args(_args("m", tmp_path / "out", "--finetune-steps", "9"))
    assert interrupted_note(args).startswith("nothing was kept")
    (tmp_path / "out" / "ft-random-1-1" / "last").mkdir(parents=True)
    assert interrupted_note(args).startswith(f"the finished rows of {tmp_path / 'out'}/baselines.json and the "
                                             "running training's last checkpoint are kept")


def _no_training_data(model_dir, out, *extra):
    return ["prune", "baseline", str(model_dir), "--valid-src", str(DATA / "val.en.gz"), "--valid-tgt",
            str(DATA / "val.de.gz"), "--eval-limit", "3", "--eval-beam", "1", "--keeps", "1", "--out", str(out), *extra]


def test_a_baseline_that_neither_estimates_nor_trains_needs_no_training_data(model_dir, tmp_path, capsys):
    """Random and score-ranked rows without fine-tuning only remove heads and evaluate: the row is
    the one made with training data given (which it does not read)."""
    assert main(_no_training_data(model_dir, tmp_path / "alone", "--method", "random", "--seeds", "1")) == 0
    assert main(_args(model_dir, tmp_path / "with", "--eval-limit", "3", "--eval-beam", "1", "--seeds", "1")) == 0
    capsys.readouterr()
    alone, given = (json.loads((tmp_path / name / "baselines.json").read_text()) for name in ("alone", "with"))
    assert alone == given and "train_data_sha256" not in alone[0]


@pytest.mark.parametrize("extra, message", [
    (("--method", "michel"), "--method michel estimates head importance on it"),
    (("--method", "random", "--finetune-steps", "2"), "--finetune-steps fine-tunes on it"),
    (("--method", "random", "--from-scratch"), "--from-scratch trains on it"),
    (("--method", "random", "--limit", "5"), "--limit N counts training sentences"),
    (("--method", "random", "--train-src", str(DATA / "train.en.gz")), "give both --train-src and --train-tgt"),
], ids=["michel", "finetune", "from-scratch", "limit", "half-a-pair"])
def test_a_baseline_that_reads_training_data_refuses_without_it(extra, message, model_dir, tmp_path, capsys):
    assert main(_no_training_data(model_dir, tmp_path / "out", *extra)) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_decoder_only_model_is_refused_before_any_row(tmp_path, capsys):
    """Rows are scored by translating --valid-src: a language model's continuation would be scored
    with its prompt in it (BLEU 100 with --valid-src = --valid-tgt), so it is refused, not scored."""
    lm = Path(__file__).resolve().parents[1] / "models" / "english-lm"
    text = tmp_path / "valid.txt"
    text.write_text("the cat sat on the mat .\na dog ran .\n")
    args = ["prune", "baseline", str(lm), "--valid-src", str(text), "--valid-tgt", str(text), "--method", "random",
            "--seeds", "1", "--keeps", "4", "--eval-limit", "2", "--eval-beam", "1", "--out", str(tmp_path / "out")]
    assert main(args) == 2
    assert "is not an encoder-decoder model" in capsys.readouterr().err
    assert not (tmp_path / "out" / "baselines.json").exists()


def test_training_text_and_training_pairs_together_are_refused(model_dir, tmp_path, capsys):
    """One of them would be read and the other silently not."""
    extra = ("--finetune-steps", "2", "--train-text", str(DATA / "train.en.gz"))
    assert main(_args(model_dir, tmp_path / "out", *extra)) == 2
    assert "not both" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_fine_tuning_row_with_another_development_set_is_made_again(corpus, tokenizer, tmp_path):
    """Regression: `prune baseline --finetune-steps` run again with another --dev-src (or
    --dev-every) kept its rows, whose dev_plateau was of the old development curve."""
    config = baselines.BaselineConfig(method="random", keeps=(2,), seeds=(1,), finetune_steps=2, dev_every=2,
                                      max_tokens=400, lr=1e-3, eval_beam=1, model_fingerprint="tiny")

    def run(dev, options=config):
        baselines.run_baselines(lambda: (marian(tokenizer), tokenizer), corpus.subset(20), corpus.subset(3), options,
                                tmp_path, dev_data=dev, log=lambda message: None)
        return json.loads((tmp_path / "baselines.json").read_text())

    first = run(corpus.subset(4))
    assert first[0]["dev_every"] == 2 and first[0]["dev_data_sha256"]
    assert run(corpus.subset(4)) == first  # the same development set: kept
    other = run(corpus.subset(5))
    assert len(other) == 1 and other[0]["dev_data_sha256"] != first[0]["dev_data_sha256"]
    assert json.loads((tmp_path / "baselines.stale.json").read_text()) == first
    assert run(corpus.subset(5), replace(config, dev_every=1))[0]["dev_every"] == 1


def test_a_fine_tuning_started_before_its_development_set_was_recorded_resumes(corpus, tokenizer, tmp_path,
                                                                              monkeypatch):
    """Regression: finetune_run.json gained dev_every/dev_data_sha256 (2026-11-28), and a control
    cut short (or continued to more updates) under the earlier record silently started over from
    update 0, its checkpoint cleared. Such a record now resumes; another development set starts
    over and says so."""
    config = baselines.BaselineConfig(method="random", keeps=(2,), seeds=(1,), finetune_steps=9, freeze_decoder=True,
                                      dev_every=3, max_tokens=400, lr=1e-3, eval_beam=1, model_fingerprint="tiny")
    whole = _run(tmp_path / "whole", config, corpus, tokenizer, monkeypatch)
    real_train, resumed = baselines.train, []

    def killed_at_4(*args, **kwargs):
        real_train(*args[:4], replace(args[4], max_steps=4), **kwargs)
        raise KeyboardInterrupt

    def spy(*args, **kwargs):
        resumed.append(args[4].resume)
        return real_train(*args, **kwargs)

    out, name = tmp_path / "old", "ft-random-2-1"
    with pytest.raises(KeyboardInterrupt):
        _run(out, config, corpus, tokenizer, monkeypatch, killed_at_4)
    record = json.loads((out / name / "finetune_run.json").read_text())
    legacy = {key: value for key, value in record.items() if key not in ("dev_every", "dev_data_sha256")}
    assert legacy != record
    (out / name / "finetune_run.json").write_text(json.dumps(legacy))  # as written before 2026-11-28
    assert _run(out, config, corpus, tokenizer, monkeypatch, spy) == whole and resumed == [True]
    assert json.loads((out / name / "finetune_run.json").read_text()) == record  # recorded in full now

    # A checkpoint of another development set: the curve would mix two sets, so it starts over.
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path / "other", config, corpus, tokenizer, monkeypatch, killed_at_4)
    said: list[str] = []
    monkeypatch.setattr(baselines, "train", spy)
    baselines.run_baselines(lambda: (marian(tokenizer), tokenizer), corpus.subset(60), corpus.subset(4), config,
                            tmp_path / "other", dev_data=corpus.subset(6), log=said.append)
    monkeypatch.undo()
    assert resumed == [True, False]
    assert any("trained with other dev_data_sha256" in line and "starting over" in line for line in said)
