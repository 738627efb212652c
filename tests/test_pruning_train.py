"""Gated fine-tuning, export, sweeps and baselines on a tiny Marian model and 300 Multi30k pairs."""

import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from headlab import attach_gates, load_pruned
from headlab.cli import main
from headlab.errors import HeadlabError
from headlab.pruning import HardConcreteGates, baselines
from headlab.pruning.budget import LagrangianBudget
from headlab.pruning.train import PruneConfig, encode_monolingual_corpus, export_pruned, prune_train, read_trajectory
from headlab.training.config import TrainConfig
from headlab.training.loop import load_weights
from support.nmt import DATA
from support.nmt import tiny_marian as marian


def config(out_dir, epochs=1, **overrides):
    train = TrainConfig(out_dir=str(out_dir), max_tokens=400, lr=1e-3, warmup_steps=0, schedule="constant",
                        max_epochs=epochs, validate=False, keep_epoch_checkpoints=False, progress=False, seed=3)
    options = dict(gates="all", lam=0.0, log_every=5, eval_beam=1, gate_lr=0.1, train=train)
    options.update(overrides)
    return PruneConfig(**options)


def sample_inputs(tokenizer, corpus, n=4):
    enc = tokenizer(corpus.sources[:n], return_tensors="pt", padding=True)
    dec = tokenizer(corpus.targets[:n], return_tensors="pt", padding=True)["input_ids"]
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "decoder_input_ids": dec}


def test_lambda_zero_keeps_all_heads(corpus, tokenizer, tmp_path):
    result = prune_train(marian(tokenizer), tokenizer, corpus, corpus.subset(10), config(tmp_path / "r", lam=0.0))
    assert result.stopped == "finished"
    assert result.heads_kept == result.heads_total == {"enc_self": 8, "dec_self": 8, "dec_cross": 8}
    assert {"bleu", "chrf", "loss"} <= set(result.metrics)
    saved = json.loads((tmp_path / "r" / "result.json").read_text())
    assert saved["heads_kept"] == result.heads_kept and saved["lam"] == 0.0
    assert "heads kept" in (tmp_path / "r" / "pruned" / "README.md").read_text()


def test_large_lambda_closes_most_gates_and_logs_a_trajectory(corpus, tokenizer, tmp_path):
    result = prune_train(marian(tokenizer), tokenizer, corpus, None, config(tmp_path / "r", epochs=3, lam=1.0))
    assert sum(result.heads_kept.values()) <= 6  # at least 75% of 24 heads closed
    records = read_trajectory(tmp_path / "r")
    assert [r["step"] for r in records] == list(range(5, 70, 5))
    first, last = records[0], records[-1]
    assert last["expected_l0"] < first["expected_l0"]
    assert len(first["p_open"]["enc_self"]) == 2 and len(first["p_open"]["enc_self"][0]) == 4
    assert {"heads_closed", "heads_open", "polarized", "grad_loss_log_alpha", "grad_penalty_log_alpha",
            "penalty_to_loss"} <= set(first)
    assert result.metrics["polarized"] >= 0.95  # P(open) < 0.05 or > 0.95 for the gates at the end
    # A torn last line (a kill while appending) is skipped.
    with open(tmp_path / "r" / "trajectory.jsonl", "a") as handle:
        handle.write('{"step": 99, "lo')
    assert len(read_trajectory(tmp_path / "r")) == len(records)


def test_enc_self_mode_leaves_every_decoder_parameter_bit_identical(corpus, tokenizer, tmp_path):
    model = marian(tokenizer)
    decoder = {name: p.detach().clone() for name, p in model.named_parameters()
               if not name.startswith("model.encoder.") or name == "model.encoder.embed_tokens.weight"}
    encoder = {name: p.detach().clone() for name, p in model.named_parameters() if name.startswith("model.encoder.layers")}
    result = prune_train(model, tokenizer, corpus, None, config(tmp_path / "r", gates="enc_self", lam=0.1))
    assert result.heads_kept["dec_self"] == 8 and result.heads_kept["dec_cross"] == 8
    after = dict(load_pruned(tmp_path / "r" / "pruned").named_parameters())
    for name, value in decoder.items():  # shared embeddings and lm head included
        assert torch.equal(after[name], value), name
    changed = [n for n in encoder if "self_attn" not in n and not torch.equal(after[n], encoder[n])]
    assert changed  # the encoder did train


def test_exported_model_equals_gated_model_with_deterministic_gates(corpus, tokenizer, tmp_path):
    inputs = sample_inputs(tokenizer, corpus)
    # 1) Mixed gates set by hand: export == gated model in eval mode.
    model = marian(tokenizer).eval()
    gates = HardConcreteGates.for_model(model)
    with torch.no_grad():
        for i, value in enumerate(gates.log_alpha.values()):
            value.copy_(torch.tensor([3.0, -3.0, 0.5, -0.2]).roll(i))
    attach_gates(model, gates)
    model.eval()  # the gate module joins in training mode; eval() makes the gates deterministic
    with torch.no_grad():
        expected = model(**inputs).logits
    spec = gates.closed_heads()
    assert sum(len(v) for v in spec.values()) == 12
    export_pruned(model, spec, tmp_path / "hand", tokenizer)
    with torch.no_grad():
        torch.testing.assert_close(load_pruned(tmp_path / "hand")(**inputs).logits, expected, atol=1e-5, rtol=0)
    # 2) End to end: the exported model == the trained gated model (train/last) in eval mode.
    result = prune_train(marian(tokenizer), tokenizer, corpus, None, config(tmp_path / "r", epochs=2, lam=0.5))
    gated = marian(tokenizer, seed=5)
    attach_gates(gated, HardConcreteGates.for_model(gated))
    load_weights(gated, tmp_path / "r" / "train" / "last")
    gated.eval()
    assert sum(result.heads_kept.values()) < 24  # (untrained: the gates move together)
    with torch.no_grad():
        torch.testing.assert_close(load_pruned(tmp_path / "r" / "pruned")(**inputs).logits, gated(**inputs).logits,
                                   atol=1e-5, rtol=0)


def test_budget_mode_reaches_exactly_n_heads(corpus, tokenizer, tmp_path):
    cfg = config(tmp_path / "r", gates="enc_self", keep=5, multiplier_lr=0.2, budget_warmup=0.5)
    cfg.train = replace(cfg.train, max_epochs=100, max_steps=40)
    result = prune_train(marian(tokenizer), tokenizer, corpus, None, cfg)
    assert result.heads_kept["enc_self"] == 5
    saved = json.loads((tmp_path / "r" / "result.json").read_text())
    assert saved["keep"] == 5 and saved["lam"] is None  # no fixed lambda (was 0.0, the control's)
    records = read_trajectory(tmp_path / "r")
    assert records[-1]["target"] == 5 and records[-1]["lambda_1"] != 0
    assert records[-1]["expected_l0"] < records[0]["expected_l0"]
    # The test-time gates are the budget's heads: the trajectory counts them, and the export
    # equals the gated model in eval mode (what a development curve evaluates).
    assert records[-1]["heads_open"] == {"enc_self": 5} and records[-1]["heads_closed"] == 3
    gated = marian(tokenizer, seed=5)
    gates = HardConcreteGates.for_model(gated, ("enc_self",), keep=5)
    gates.budget = LagrangianBudget(8, 5, 0)
    attach_gates(gated, gates)
    load_weights(gated, tmp_path / "r" / "train" / "last")
    gated.eval()
    inputs = sample_inputs(tokenizer, corpus)
    with torch.no_grad():
        torch.testing.assert_close(load_pruned(tmp_path / "r" / "pruned")(**inputs).logits, gated(**inputs).logits,
                                   atol=1e-5, rtol=0)


def test_a_budget_point_of_a_sweep_names_no_lambda(tmp_path):
    """A budget row's lam was 0, the control's value: the table, sweep.json and Fig. 7 read it as none."""
    from headlab.pruning.sweep import _row, point_name, sweep_points, write_table

    points = sweep_points(lams=(0.0, 0.5), keeps=(3,))
    result = {"heads_kept": {"enc_self": 3}, "metrics": {"bleu": 1.0}, "stopped": "finished"}
    rows = [_row(point_name(p), p, result) for p in points]
    assert [(r["point"], r["lam"], r["keep"]) for r in rows] == [("lam-0", 0.0, None), ("lam-0.5", 0.5, None),
                                                                  ("keep-3", None, 3)]
    write_table(rows, tmp_path)
    assert json.loads((tmp_path / "sweep.json").read_text())[2]["lam"] is None
    assert (tmp_path / "sweep.md").read_text().splitlines()[-1].startswith("| keep-3 |  | 3 | 3 |")
    assert (tmp_path / "sweep.csv").read_text().splitlines()[-1].startswith("keep-3,,3,3,")


def test_bad_input_is_refused_before_anything_is_written(corpus, tokenizer, tmp_path):
    with pytest.raises(HeadlabError, match="lambda must be"):
        prune_train(marian(tokenizer), tokenizer, corpus, None, config(tmp_path / "a", lam=-1.0))
    with pytest.raises(HeadlabError, match="larger than the 8 gated heads"):
        prune_train(marian(tokenizer), tokenizer, corpus, None, config(tmp_path / "b", gates="enc_self", keep=9))
    with pytest.raises(HeadlabError, match="unknown kind 'cross'"):
        prune_train(marian(tokenizer), tokenizer, corpus, None, config(tmp_path / "c", gates="cross"))
    import transformers as tf
    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=4, n_positions=64))
    with pytest.raises(HeadlabError, match="the model has no enc_self attention"):
        prune_train(gpt2, tokenizer, corpus, None, config(tmp_path / "d", gates="enc_self"))
    assert not any((tmp_path / name).exists() for name in "abcd")


def test_divergence_stops_and_keeps_the_last_good_checkpoint(corpus, tokenizer, tmp_path, monkeypatch):
    calls = {"n": 0}
    real = HardConcreteGates.l0_penalty

    def poisoned(self):
        calls["n"] += 1
        value = real(self)
        return value * float("nan") if calls["n"] > 12 else value

    monkeypatch.setattr(HardConcreteGates, "l0_penalty", poisoned)
    cfg = config(tmp_path / "r", lam=0.1)
    cfg.train = replace(cfg.train, save_every_steps=5)
    result = prune_train(marian(tokenizer), tokenizer, corpus, None, cfg)
    assert result.stopped == "diverged"
    assert "Last good checkpoint" in result.message and "nothing exported" in result.message
    state = json.loads((tmp_path / "r" / "train" / "last" / "trainer_state.json").read_text())
    assert state["step"] == 10
    assert not (tmp_path / "r" / "pruned").exists() and not (tmp_path / "r" / "result.json").exists()


def test_decoder_only_model_with_lm_loss(corpus, tokenizer, tmp_path):
    import transformers as tf

    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                            bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id))
    data = encode_monolingual_corpus(tokenizer, corpus.targets, 64)
    result = prune_train(gpt2, tokenizer, data, None, config(tmp_path / "r", epochs=2, lam=1.0))
    assert result.heads_total == {"dec_self": 8}
    assert sum(result.heads_kept.values()) < 8
    assert read_trajectory(tmp_path / "r")[0]["loss"] > 0


def test_default_gates_are_the_encoder_or_a_decoder_only_model_s_self_attention(corpus, tokenizer, tmp_path):
    """--gates auto (the default): a decoder-only model is gated on its own self-attention (it was
    refused for lacking enc_self), a translation model keeps the paper's enc_self with the decoder
    frozen, and the record names the kinds chosen."""
    import transformers as tf

    from headlab.pruning.train import resolve_kinds

    assert PruneConfig().gates == "auto"
    assert resolve_kinds(marian(tokenizer), "auto") == ("enc_self",)
    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                            bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id))
    data = encode_monolingual_corpus(tokenizer, corpus.targets[:8], 64)
    options = config(tmp_path / "r", lam=1.0)
    result = prune_train(gpt2, tokenizer, data, None, replace(options, gates=PruneConfig().gates))
    assert result.heads_total == {"dec_self": 8}
    assert json.loads((tmp_path / "r" / "prune_config.json").read_text())["gates"] == "dec_self"


def test_baselines_give_equal_head_counts(corpus, tokenizer):
    model = marian(tokenizer)
    first = baselines.random_spec(model, 3, ("enc_self",), seed=1)
    assert sum(len(v) for v in first.values()) == 5
    assert first != baselines.random_spec(model, 3, ("enc_self",), seed=2)
    steps = []
    spec = baselines.michel_spec(model, tokenizer, corpus.subset(40), 3, ("enc_self",), step_fraction=0.25,
                                 on_step=steps.append)
    assert sum(len(v) for v in spec.values()) == 5
    assert [sum(len(v) for v in s.values()) for s in steps] == [2, 4, 5]
    scores = baselines.gradient_importance(model, tokenizer, corpus.subset(40), ("enc_self",), spec)
    assert scores["enc_self"].shape == (2, 4)
    assert sum(1 for _ in scores.items()) == 3  # removed heads are NaN
    assert baselines.scores_spec(scores, 2) == scores.top_mask(2, ("enc_self",))
    with pytest.raises(HeadlabError, match="cannot keep 9 heads"):
        baselines.random_spec(model, 9)


def test_michel_is_refused_where_a_pruned_model_s_heads_are_renumbered(corpus, tokenizer):
    """Regression: its gradient scores name a pruned model's heads by their original index and its
    masks (and the spec it returns) by the current one, so on a layer that kept heads 1-3 the head
    it ranked least important was not the one it removed. Refused; a layer that kept its first
    heads runs."""
    from headlab import prune_heads

    model = marian(tokenizer)
    prune_heads(model, {("enc_self", 0): [3]})  # keeps 0, 1, 2: their indices hold
    assert sum(len(v) for v in baselines.michel_spec(model, tokenizer, corpus.subset(20), 5, ("enc_self",)).values()) == 2
    prune_heads(model, {("enc_self", 1): [0]})  # keeps 1, 2, 3, now at 0, 1, 2
    with pytest.raises(HeadlabError, match=r"--method michel on a pruned model .*\(enc_self:1\)"):
        baselines.michel_spec(model, tokenizer, corpus.subset(20), 4, ("enc_self",))


@pytest.fixture(scope="module")
def model_dir(tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "tiny"
    model = marian(tokenizer)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _data_args(limit=200):
    return ["--train-src", str(DATA / "train.en.gz"), "--train-tgt", str(DATA / "train.de.gz"),
            "--valid-src", str(DATA / "val.en.gz"), "--valid-tgt", str(DATA / "val.de.gz"),
            "--limit", str(limit), "--eval-limit", "10", "--max-tokens", "400", "--eval-beam", "1",
            "--log-every", "5", "--no-progress", "--lr", "1e-3", "--gate-lr", "0.1"]


def _baseline_args(model_dir, *options) -> list[str]:
    """`prune baseline` on 50 training pairs, scored greedily on 5 validation sentences."""
    return ["prune", "baseline", str(model_dir), "--train-src", str(DATA / "train.en.gz"),
            "--train-tgt", str(DATA / "train.de.gz"), "--valid-src", str(DATA / "val.en.gz"),
            "--valid-tgt", str(DATA / "val.de.gz"), "--limit", "50", "--eval-limit", "5", "--eval-beam", "1", *options]


def test_cli_baseline_no_progress_turns_off_the_from_scratch_bar(model_dir, tmp_path, monkeypatch):
    """`prune baseline` lacked --no-progress, which the other training commands have (exit 2)."""
    seen = []

    def train_from_scratch(model, tokenizer, spec, train_data, eval_data, config, **kwargs):
        seen.append(config.progress)
        raise KeyboardInterrupt  # stop before any training; nothing was kept

    monkeypatch.setattr(baselines, "train_from_scratch", train_from_scratch)
    for n, flags in enumerate(([], ["--no-progress"])):
        args = _baseline_args(model_dir, "--method", "random", "--keeps", "3", "--seeds", "1", "--from-scratch",
                              *flags, "--out", str(tmp_path / f"b{n}"))
        assert main(args) == 130
    assert seen == [True, False]


def test_cli_train_and_its_errors(model_dir, tmp_path, capsys):
    out = tmp_path / "t"
    assert main(["prune", "train", str(model_dir), *_data_args(), "--gates", "all", "--lam", "0.5", "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["heads_total"] == {"enc_self": 8, "dec_self": 8, "dec_cross": 8} and "bleu" in summary
    assert main(["heads", str(out / "pruned"), "--json"]) == 0
    capsys.readouterr()
    # A finished run is not overwritten by accident.
    assert main(["prune", "train", str(model_dir), *_data_args(), "--out", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main(["prune", "train", str(model_dir), *_data_args(), "--lam", "-0.1", "--out", str(tmp_path / "n")]) == 2
    assert "--lam must be >= 0" in capsys.readouterr().err
    assert main(["prune", "train", str(model_dir), *_data_args(), "--keep", "99", "--out", str(tmp_path / "k")]) == 2
    assert "larger than the 8 gated heads" in capsys.readouterr().err
    assert not (tmp_path / "n").exists() and not (tmp_path / "k").exists()
    # The physical pruning command, old and new spelling.
    assert main(["prune", "apply", str(model_dir), "--heads", "enc_self:0:1", "--out", str(tmp_path / "a")]) == 0
    assert main(["prune", str(model_dir), "--heads", "enc_self:0:1", "--out", str(tmp_path / "b")]) == 0


def test_cli_sweep_resumes_and_skips_finished_points(model_dir, tmp_path, capsys):
    out = tmp_path / "s"
    args = ["prune", "sweep", str(model_dir), *_data_args(100), "--gates", "enc_self", "--lams", "0,2",
            "--latency", "2", "--out", str(out)]
    assert main(args) == 0
    table = capsys.readouterr().out
    # The unpruned reference and every point are timed alike, and a point keeps the translations it scored.
    for result in (out / "full.json", out / "lam-0" / "result.json"):
        assert json.loads(result.read_text())["metrics"]["latency"]["sentences"] == 2
    hypotheses = (out / "lam-0" / "hypotheses.txt").read_text(encoding="utf-8").splitlines()
    assert len(hypotheses) == 10  # --eval-limit
    assert table.splitlines()[0].startswith("| point | lam | keep | enc_self | dec_self | dec_cross | heads | bleu | chrf | loss")
    rows = json.loads((out / "sweep.json").read_text())
    assert [r["point"] for r in rows] == ["full", "lam-0", "lam-2"]
    assert rows[1]["enc_self"] == 8 and rows[2]["enc_self"] <= rows[1]["enc_self"]
    assert all(r["bleu"] is not None and r["loss"] is not None for r in rows)
    # Interrupt simulation: drop the second point's result; the rerun skips the first only.
    (out / "lam-2" / "result.json").unlink()
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "lam-0: finished earlier, skipped" in captured.out + captured.err
    assert "lam-2: resuming" in captured.out + captured.err
    assert len(json.loads((out / "sweep.json").read_text())) == 3
    # The default, --gates auto, is enc_self on a translation model: the points made with enc_self are its own.
    assert main([a for a in args if a not in ("--gates", "enc_self")]) == 0
    captured = capsys.readouterr()
    assert "lam-2: finished earlier, skipped" in captured.out + captured.err and not (out / "stale").exists()


def test_cli_baseline_random_over_seeds(model_dir, tmp_path, capsys):
    out = tmp_path / "b"
    args = _baseline_args(model_dir, "--method", "random", "--keeps", "3", "--seeds", "1,2", "--out", str(out))
    assert main(args) == 0
    assert "| random | 3 | 0 | no | 2 |" in capsys.readouterr().out
    rows = json.loads((out / "baselines.json").read_text())
    assert [r["seed"] for r in rows] == [1, 2] and all(r["heads_kept"]["enc_self"] == 3 for r in rows)
    assert main(args) == 0  # finished rows are skipped, not repeated
    assert len(json.loads((out / "baselines.json").read_text())) == 2
    # Another test set or beam: the rows' BLEU is of other translations, so they are made again.
    for n, (option, value) in enumerate((("--eval-limit", "4"), ("--eval-beam", "2")), start=1):
        args[args.index(option) + 1] = value
        assert main(args) == 0
        assert len(json.loads((out / "baselines.json").read_text())) == 2
        assert len(json.loads((out / "baselines.stale.json").read_text())) == 2 * n
    assert {r["eval_beam"] for r in json.loads((out / "baselines.json").read_text())} == {2}


def test_cli_baseline_by_scores_skips_its_finished_rows_wherever_the_score_file_was_written(model_dir, tmp_path, capsys):
    from headlab import HeadScores

    scores = HeadScores({"enc_self": np.arange(8, dtype=float).reshape(2, 4)}, "lrp", str(model_dir))
    scores.save(tmp_path / "lrp.json")
    out = tmp_path / "b"
    args = _baseline_args(model_dir, "--method", "scores", "--scores", str(tmp_path / "lrp.json"), "--keeps", "3",
                          "--out", str(out))
    assert main(args) == 0
    rows = json.loads((out / "baselines.json").read_text())
    assert [(r["method"], r["keep"]) for r in rows] == [("scores:lrp", 3)]
    assert rows[0]["scores_sha256"] == scores.fingerprint()
    # The same scores in a file written elsewhere (the reproduction's report makes paths relative).
    HeadScores(scores.scores, "lrp", "models/m", {"copied": True}).save(tmp_path / "lrp.json")
    assert main(args) == 0
    assert json.loads((out / "baselines.json").read_text()) == rows  # skipped, not repeated
    assert not (out / "baselines.stale.json").exists()
    # Other scores: the row is set aside and made again.
    HeadScores({"enc_self": -np.arange(8, dtype=float).reshape(2, 4)}, "lrp", "models/m").save(tmp_path / "lrp.json")
    assert main(args) == 0
    assert len(json.loads((out / "baselines.stale.json").read_text())) == 1
    assert len(json.loads((out / "baselines.json").read_text())) == 1


def test_report_draws_figures_and_table(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    rows = [{"point": "full", "lam": None, "keep": None, "enc_self": 8, "dec_self": 8, "dec_cross": 8, "heads": 24,
             "bleu": 30.0, "chrf": 55.0, "loss": 2.0},
            {"point": "lam-0.1", "lam": 0.1, "keep": None, "enc_self": 3, "dec_self": 8, "dec_cross": 8, "heads": 19,
             "bleu": 29.5, "chrf": 54.0, "loss": 2.1}]
    (sweep / "sweep.json").write_text(json.dumps(rows))
    base = tmp_path / "base"
    base.mkdir()
    (base / "baselines.json").write_text(json.dumps(
        [{"method": "random", "keep": 3, "seed": s, "finetune_steps": 0, "heads_kept": {"enc_self": 3}, "bleu": b}
         for s, b in [(1, 20.0), (2, 22.0)]]
        + [{"method": "random", "keep": 19, "seed": 1, "finetune_steps": 0, "from_scratch": True,
            "heads_kept": {"enc_self": 3, "dec_self": 8, "dec_cross": 8}, "bleu": 27.0}]))
    assert main(["prune", "report", str(sweep), "--baselines", str(base), "--out", str(tmp_path / "fig")]) == 0
    assert (tmp_path / "fig" / "sweep-bleu-vs-heads.png").stat().st_size > 1000
    assert (tmp_path / "fig" / "sweep-heads-per-kind.png").is_file()
    table = (tmp_path / "fig" / "sweep-table.md").read_text()
    assert "| 3/8/8 | 19 | 29.50 | 27.00 |" in table


def test_encoder_only_model_with_masked_lm_loss(corpus, tokenizer, tmp_path):
    import copy

    import transformers as tf

    tok = copy.deepcopy(tokenizer)
    tok.add_special_tokens({"mask_token": "<mask>"})
    bert = tf.BertForMaskedLM(tf.BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2,
                                            num_attention_heads=4, intermediate_size=37, max_position_embeddings=64,
                                            pad_token_id=tok.pad_token_id))
    data = encode_monolingual_corpus(tok, corpus.sources, 64)
    result = prune_train(bert, tok, data, None, config(tmp_path / "r", gates="enc_self", epochs=2, lam=1.0))
    assert result.heads_total == {"enc_self": 8} and sum(result.heads_kept.values()) < 8
    assert json.loads((tmp_path / "r" / "prune_config.json").read_text())["loss"] == "auto"
    assert read_trajectory(tmp_path / "r")[0]["loss"] > 0


def test_michel_importance_equals_a_sentence_by_sentence_reference(corpus, tokenizer):
    import numpy as np

    from headlab import ScalarGates, gates_attached
    from headlab.training.corpus import collate, encode_corpus

    model = marian(tokenizer).eval()
    small = corpus.subset(3)
    removed = {("enc_self", 1): [2]}
    scores = baselines.gradient_importance(model, tokenizer, small, ("enc_self",), removed, batch_tokens=10_000)
    encoded = encode_corpus(tokenizer, small)
    total = {0: np.zeros(4), 1: np.zeros(4)}
    for i in range(3):  # one sentence at a time, one scalar gate per head
        gates = ScalarGates.for_model(model, ("enc_self",))
        with torch.no_grad():
            gates.values["enc_self_1"][2] = 0.0
        batch = collate(encoded, [i], tokenizer.pad_token_id, tokenizer.pad_token_id)
        with gates_attached(model, gates):
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                        decoder_input_ids=batch["decoder_input_ids"]).logits
            loss = torch.nn.functional.cross_entropy(out[0], batch["labels"][0])
            loss.backward()
        for layer in (0, 1):
            total[layer] += gates.values[f"enc_self_{layer}"].grad.abs().numpy()
    for layer in (0, 1):
        expected = total[layer] / 3
        expected = expected / np.linalg.norm(expected)
        if layer == 1:
            expected[2] = np.nan
        np.testing.assert_allclose(scores["enc_self"][layer], expected, rtol=1e-4)


@pytest.mark.parametrize("keep", [None, 3])
def test_diagnostics_split_the_log_alpha_gradient_into_loss_and_penalty(keep, tmp_path):
    from headlab.pruning.train import _Diagnostics

    gates = HardConcreteGates({("enc_self", 0): 8})
    if keep is not None:
        gates.budget = LagrangianBudget(8, keep, 0)
        with torch.no_grad():
            gates.budget.lambda_1.fill_(0.5)
            gates.budget.lambda_2.fill_(0.1)
    diagnostics = _Diagnostics(gates, PruneConfig(lam=0.3, keep=keep), tmp_path / "t.jsonl", print, 10)
    diagnostics.extra_loss(None, None, 5).backward()  # the penalty alone: the loss's share is 0
    record = diagnostics.record(None, 5, {"loss": 1.0})
    expected = gates.log_alpha["enc_self_0"].grad.abs().mean().item()
    assert record["grad_loss_log_alpha"] < 1e-6
    assert record["grad_penalty_log_alpha"] == pytest.approx(expected, rel=1e-5)
    if keep is None:
        assert record["penalty_term"] == pytest.approx(0.3 * record["l0_penalty"])


def test_latency_is_measured_in_eval_mode_and_the_mode_is_restored(corpus, tokenizer):
    """Regression: measure_latency left a model that was training in eval mode (dropout off)."""
    from headlab.pruning.train import measure_latency

    model = marian(tokenizer)
    seen = []
    model.get_encoder().register_forward_pre_hook(lambda module, args: seen.append(module.training))
    model.train()
    timings = measure_latency(model, tokenizer, corpus.sources[:2], beam=1, repeats=1)
    assert timings["sentences"] == 2 and timings["encoder_s"] > 0 and timings["translate_s"] > 0
    assert seen and not any(seen)  # timed without dropout
    assert model.training and all(module.training for module in model.modules())
    model.eval()
    measure_latency(model, tokenizer, corpus.sources[:2], beam=1, repeats=1)
    assert not any(module.training for module in model.modules())


def test_a_from_scratch_training_cut_short_goes_on_only_for_the_same_heads(corpus, tokenizer, tmp_path, monkeypatch,
                                                                            capsys):
    """A from-scratch row costs a full training: a run killed part-way continues from its last
    checkpoint (to the weights of an uninterrupted run), unless it was started for other heads."""
    from safetensors.torch import load_file

    data, eval_data = corpus.subset(60), corpus.subset(4)
    config = baselines.BaselineConfig(method="random", keeps=(3,), seeds=(1,), from_scratch=True, scratch_epochs=2,
                                      max_tokens=400, eval_beam=1)
    load = lambda: (marian(tokenizer), tokenizer)  # noqa: E731
    baselines.run_baselines(load, data, eval_data, config, tmp_path / "whole")
    real_train = baselines.train

    def killed_after_one_epoch(model, tokenizer, train_data, valid_data, train_config):
        real_train(model, tokenizer, train_data, valid_data, replace(train_config, max_epochs=1))
        raise KeyboardInterrupt

    def run(out, train):
        monkeypatch.setattr(baselines, "train", train)
        baselines.run_baselines(load, data, eval_data, config, out)
        return capsys.readouterr().out

    for out, other_heads in ((tmp_path / "resumed", False), (tmp_path / "restarted", True)):
        with pytest.raises(KeyboardInterrupt):
            run(out, killed_after_one_epoch)
        run_file = out / "scratch-random-3-1" / baselines.SCRATCH_RUN_FILE
        if other_heads:
            run_file.write_text(json.dumps({**json.loads(run_file.read_text()), "spec": []}))
        log = run(out, real_train)
        assert ("resuming from" in log) is not other_heads
        rows = [json.loads((d / "baselines.json").read_text()) for d in (tmp_path / "whole", out)]
        assert rows[1][0]["train_steps"] == rows[0][0]["train_steps"]
        weights = [load_file(str(d / "scratch-random-3-1" / "last" / "model.safetensors"))
                   for d in (tmp_path / "whole", out)]
        assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


@pytest.mark.parametrize("family", ["gpt2", "roberta"])
def test_cli_lm_text_is_cut_to_the_positions_the_model_takes(family, tmp_path):
    """--train-text lines were cut at ``max_position_embeddings``, 2 rows more than RoBERTa's
    embeddings take (positions start at padding_idx + 1): a long line crashed the run there."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from support.models import CONFIGS

    words = [f"w{i}" for i in range(90)]
    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<pad>", "<unk>", "<s>", "</s>", "<mask>", *words])},
                                     unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
                                  eos_token="</s>", mask_token="<mask>")
    cls, config = CONFIGS[family]()
    config.pad_token_id, config.bos_token_id, config.eos_token_id = 0, 2, 3
    path = tmp_path / "model"
    cls(config).save_pretrained(path)
    tok.save_pretrained(path)
    text = tmp_path / "train.txt"
    text.write_text(" ".join(words) + "\n" + " ".join(words[:5]) + "\n")  # 90 tokens > the 64 / 68 positions
    out = tmp_path / "out"
    assert main(["prune", "train", str(path), "--train-text", str(text), "--gates", "all", "--lam", "0.1",
                 "--max-steps", "1", "--no-progress", "--out", str(out)]) == 0


def test_cli_baseline_runs_a_seed_or_keep_given_twice_once(model_dir, tmp_path, capsys):
    """Regression: `--seeds 1,1` made two rows of the same run, reported as 2 runs with std 0.00
    (a spread the numbers do not have), and `--keeps 3,3` two rows of one configuration."""
    out = tmp_path / "b"
    args = _baseline_args(model_dir, "--method", "random", "--keeps", "3,3", "--seeds", "1,1", "--out", str(out))
    assert main(args) == 0
    assert "| random | 3 | 0 | no | 1 |" in capsys.readouterr().out
    assert [(r["keep"], r["seed"]) for r in json.loads((out / "baselines.json").read_text())] == [(3, 1)]


def test_report_refuses_baselines_of_another_beam_or_other_weights(tmp_path, capsys):
    """Regression: baselines scored greedily were drawn beside a sweep scored with beam 4 (and its
    beam-4 full model as the line), so a greedy baseline appeared to beat or trail the gates by the
    beam's difference alone; baselines of other weights likewise. Nothing is written then."""
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "sweep.json").write_text(json.dumps(
        [{"point": "full", "lam": None, "keep": None, "enc_self": 8, "dec_self": 8, "dec_cross": 8, "heads": 24,
          "bleu": 30.0}]))
    (sweep / "full.json").write_text(json.dumps({"metrics": {"bleu": 30.0, "beam": 4}, "model_sha256": "a" * 64}))
    base = tmp_path / "base"
    base.mkdir()
    row = {"method": "random", "keep": 3, "seed": 1, "finetune_steps": 0, "heads_kept": {"enc_self": 3}, "bleu": 20.0,
           "eval_beam": 1, "model_sha256": "a" * 64}
    args = ["prune", "report", str(sweep), "--baselines", str(base), "--out", str(tmp_path / "fig")]
    (base / "baselines.json").write_text(json.dumps([row]))
    assert main(args) == 2
    assert f"--baselines {base}: its rows were scored with beam 1, the sweep {sweep} with beam 4" in capsys.readouterr().err
    (base / "baselines.json").write_text(json.dumps([{**row, "eval_beam": 4, "model_sha256": "b" * 64}]))
    assert main(args) == 2
    assert "its rows were made from other weights than the sweep" in capsys.readouterr().err
    assert not (tmp_path / "fig").exists()
    # Regression: baselines scored on another test set (another --valid-src or --eval-limit) were drawn too.
    full = json.loads((sweep / "full.json").read_text())
    (sweep / "full.json").write_text(json.dumps({**full, "eval_data_sha256": "c" * 64}))
    (base / "baselines.json").write_text(json.dumps([{**row, "eval_beam": 4, "eval_data_sha256": "d" * 64}]))
    assert main(args) == 2
    assert f"--baselines {base}: its rows were scored on another test set than the sweep" in capsys.readouterr().err
    assert not (tmp_path / "fig").exists()
    (base / "baselines.json").write_text(json.dumps([{**row, "eval_beam": 4}]))
    assert main(args) == 0
    assert (tmp_path / "fig" / "sweep-bleu-vs-heads.png").is_file()
    # Regression: a sweep made with --no-reference has no full.json, and then nothing was compared.
    (sweep / "full.json").unlink()
    (sweep / "lam-0").mkdir()
    (sweep / "lam-0" / "prune_config.json").write_text(json.dumps({"eval_beam": 4, "model_fingerprint": "a" * 64}))
    (base / "baselines.json").write_text(json.dumps([row]))  # beam 1
    assert main([*args[:-1], str(tmp_path / "fig2")]) == 2
    assert f"--baselines {base}: its rows were scored with beam 1, the sweep {sweep} with beam 4" in capsys.readouterr().err
    assert main(["prune", "report", str(tmp_path / "none"), "--out", str(tmp_path / "fig2")]) == 2
    assert not (tmp_path / "fig2").exists()  # a refused report leaves no empty directory behind


def test_cli_sweep_rerun_on_other_data_makes_its_points_again(model_dir, tmp_path, capsys):
    """Regression: a sweep run again into the same --out with another evaluation or training set
    (--eval-limit, --valid-src, --limit, --train-src) kept its finished points and full.json: one
    table of BLEU on two test sets, or of gates trained on two corpora, exit 0."""
    out = tmp_path / "s"
    args = ["prune", "sweep", str(model_dir), *_data_args(30), "--gates", "enc_self", "--lams", "0", "--out", str(out)]
    assert main(args) == 0
    capsys.readouterr()
    args[args.index("--eval-limit") + 1] = "5"
    assert main(args) == 0
    said = "".join(capsys.readouterr())
    assert "full.json: evaluated on other data" in said and "lam-0: evaluated on other data" in said
    assert len((out / "lam-0" / "hypotheses.txt").read_text(encoding="utf-8").splitlines()) == 5
    args[args.index("--limit") + 1] = "20"
    assert main(args) == 0
    said = "".join(capsys.readouterr())
    assert "lam-0: trained on other data" in said and "full.json" not in said  # the full model is not trained
    assert main(args) == 0  # the same data: nothing is made again
    assert "lam-0: finished earlier, skipped" in "".join(capsys.readouterr())


def test_cli_sweep_rerun_with_another_development_set_makes_its_points_again(model_dir, tmp_path, capsys):
    """Regression: a sweep run again into the same --out with another --dev-src/--dev-tgt (same
    --dev-sentences) kept its finished points: their development curves were of the old set, shown
    beside new points' curves of the new one, exit 0."""
    import gzip

    out = tmp_path / "s"
    val_en, val_de = (gzip.open(DATA / f"val.{lang}.gz", "rt", encoding="utf-8").read().splitlines() for lang in ("en", "de"))
    for name, start in (("a", 0), ("b", 4)):
        (tmp_path / f"{name}.en").write_text("\n".join(val_en[start:start + 4]) + "\n", encoding="utf-8")
        (tmp_path / f"{name}.de").write_text("\n".join(val_de[start:start + 4]) + "\n", encoding="utf-8")
    args = ["prune", "sweep", str(model_dir), *_data_args(30), "--eval-limit", "3", "--gates", "enc_self", "--lams", "0",
            "--dev-every", "4", "--dev-src", str(tmp_path / "a.en"), "--dev-tgt", str(tmp_path / "a.de"), "--out", str(out)]
    assert main(args) == 0
    curve = json.loads((out / "lam-0" / "result.json").read_text())["dev"]["curve"]
    capsys.readouterr()
    args[args.index("--dev-src") + 1], args[args.index("--dev-tgt") + 1] = str(tmp_path / "b.en"), str(tmp_path / "b.de")
    assert main(args) == 0
    said = "".join(capsys.readouterr())
    assert "lam-0: its development curve made on other data (dev_data_sha256" in said
    assert "full.json" not in said  # the full model has no development curve
    new = json.loads((out / "lam-0" / "result.json").read_text())["dev"]["curve"]
    assert (out / "stale" / "lam-0").is_dir() and new != curve
    assert main(args) == 0  # the same data: nothing is made again
    assert "lam-0: finished earlier, skipped" in "".join(capsys.readouterr())


def test_a_journal_line_holds_null_for_nan(tmp_path):
    """Regression: trajectory.jsonl's lines were bare json.dumps: a NaN (the loss before a step reports
    one) was the token NaN, not JSON. It is null; a journal written before, with NaN tokens, still reads."""
    from headlab.resume import append_record, read_step_records

    path = tmp_path / "trajectory.jsonl"
    path.write_text('{"step": 1, "loss": NaN}\n')  # an older run's line
    append_record(path, {"step": 2, "loss": float("nan"), "lambda": 0.1})
    assert path.read_text().splitlines()[1] == '{"step":2,"loss":null,"lambda":0.1}'
    records = read_step_records(path)
    assert math.isnan(records[0]["loss"]) and records[1]["loss"] is None
