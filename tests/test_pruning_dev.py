"""The development curve of gated fine-tuning and the stale-point rule of sweeps (tiny Marian)."""

import json

import pytest

from headlab.cli import main
from headlab.pruning.dev import plateau, read_dev_curve
from headlab.pruning.train import prune_train
from headlab.resume import weights_fingerprint
from support.nmt import DATA
from support.nmt import tiny_marian as marian
from test_pruning_train import config


@pytest.fixture(scope="module")
def model_dir(tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "tiny"
    marian(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_dev_curve_every_n_updates_with_its_plateau_and_resume(corpus, tokenizer, tmp_path):
    out = tmp_path / "r"
    dev = corpus.subset(8)
    options = config(out, epochs=2, lam=0.0, dev_every=4, log_every=0)
    result = prune_train(marian(tokenizer), tokenizer, corpus.subset(60), None, options, dev_data=dev)
    curve = read_dev_curve(out)
    steps = [r["step"] for r in curve]
    assert steps[0] == 0 and steps[-1] == result.step and steps[1:-1] == list(range(4, result.step, 4))
    assert all(r["n_sentences"] == 8 and r["low"] <= r["bleu"] <= r["high"] and r["beam"] == 1 for r in curve)
    assert curve[0]["heads_open"] == {"enc_self": 8, "dec_self": 8, "dec_cross": 8}
    saved = json.loads((out / "result.json").read_text())["dev"]
    assert saved["curve"] == curve and saved["every"] == 4
    flat = saved["plateau"]
    assert flat["to_step"] == result.step and flat["from_step"] <= result.step / 2
    assert flat["low"] <= flat["delta"] <= flat["high"] and flat["call"] in ("flat", "rising", "undecided")
    # A torn line from a kill is skipped; a step evaluated again keeps the newer record.
    with open(out / "dev_curve.jsonl", "a") as handle:
        handle.write(json.dumps({**curve[1], "bleu": -1.0}) + "\n" + '{"step": 9')
    assert len(read_dev_curve(out)) == len(curve) and read_dev_curve(out)[1]["bleu"] == -1.0
    # Identical translations: no change, so flat.
    same = [{"step": 0}, {"step": 8}]
    (out / "dev" / "step-000008.txt").write_text((out / "dev" / "step-000000.txt").read_text())
    assert plateau(same, out, list(dev.targets))["call"] == "flat"
    assert plateau(same[:1], out, list(dev.targets)) is None


def test_a_budget_runs_tied_step_0_point_is_marked_as_chosen_by_position(corpus, tokenizer, tmp_path):
    """Before the first update every gate is tied, so a budget's step-0 point evaluates the first heads by position:
    its record and log say so (before session 45 nothing did, and its BLEU read as the gates' choice)."""
    out, lines = tmp_path / "r", []
    options = config(out, epochs=1, lam=0.0, keep=12, dev_every=4, log_every=0)
    result = prune_train(marian(tokenizer), tokenizer, corpus.subset(40), None, options, dev_data=corpus.subset(4),
                         log=lines.append)
    curve = read_dev_curve(out)
    assert curve[0]["step"] == 0 and curve[0]["tied_at_cut"] == {"tied": 24, "kept": 12}
    assert any(line.startswith("step 0: dev BLEU") and "12 of those heads kept by position" in line for line in lines)
    # Adam's first updates move every gate by about +-lr, so after 3 of them the cut still falls among equal
    # values: the export says so too, in its record and as a warning
    saved = json.loads((out / "result.json").read_text())
    assert curve[-1]["step"] == result.step == 3 and saved["tied_at_cut"] == curve[-1]["tied_at_cut"]
    assert 12 < saved["tied_at_cut"]["tied"] < 24
    assert any(line.startswith("warning: the budget's cut falls among") for line in lines)


def test_cli_dev_options_and_stale_points(model_dir, tmp_path, capsys):
    base = ["prune", "sweep", str(model_dir), "--train-src", str(DATA / "train.en.gz"),
            "--train-tgt", str(DATA / "train.de.gz"), "--valid-src", str(DATA / "test_2016_flickr.en.gz"),
            "--valid-tgt", str(DATA / "test_2016_flickr.de.gz"), "--limit", "40", "--eval-limit", "4",
            "--max-tokens", "400", "--eval-beam", "1", "--log-every", "0", "--no-progress", "--gates", "enc_self"]
    out = tmp_path / "s"
    dev = ["--dev-src", str(DATA / "val.en.gz"), "--dev-tgt", str(DATA / "val.de.gz"), "--dev-sentences", "4"]
    # The development set may not be the evaluation set; its options go together.
    same = ["--dev-src", str(DATA / "test_2016_flickr.en.gz"), "--dev-tgt", str(DATA / "test_2016_flickr.de.gz")]
    assert main(base + same + ["--dev-every", "2", "--lams", "0", "--out", str(out)]) == 2
    assert "is the evaluation set" in capsys.readouterr().err
    assert main(base + dev + ["--lams", "0", "--out", str(out)]) == 2
    assert "go together" in capsys.readouterr().err
    assert not (out / "lam-0").exists()

    args = base + dev + ["--dev-every", "2", "--lams", "0", "--out", str(out)]
    assert main(args) == 0
    result = json.loads((out / "lam-0" / "result.json").read_text())
    assert result["model_sha256"] == weights_fingerprint(model_dir)
    assert json.loads((out / "full.json").read_text())["model_sha256"] == result["model_sha256"]
    assert [r["n_sentences"] for r in result["dev"]["curve"]] == [4] * len(result["dev"]["curve"])
    capsys.readouterr()

    # Same weights, same options: skipped. Other options: stale, set aside and redone.
    assert main(args) == 0
    assert "lam-0: finished earlier, skipped" in capsys.readouterr().err
    assert main(base + dev + ["--dev-every", "3", "--lams", "0", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "lam-0: made with other options: dev_every 2 -> 3" in err and (out / "stale" / "lam-0").is_dir()

    baseline = ["prune", "baseline", *base[2:15], "--eval-beam", "1", "--method", "random", "--keeps", "3", "--seeds", "1",
                "--out", str(tmp_path / "b")]
    assert main(baseline) == 0
    before = weights_fingerprint(model_dir)

    # Retrained weights (a new bundled model): every point, full.json and baseline row are stale.
    config_file = model_dir / "config.json"
    config_file.write_text(config_file.read_text().replace('"dropout": 0.1', '"dropout": 0.2'))
    assert main(base + dev + ["--dev-every", "3", "--lams", "0", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "full.json: made from other weights" in err and "lam-0: made from other weights" in err
    assert (out / "stale" / "full.json").is_file() and (out / "stale" / "lam-0.old2").is_dir()
    assert json.loads((out / "lam-0" / "result.json").read_text())["model_sha256"] == weights_fingerprint(model_dir)
    assert main(baseline) == 0
    rows = json.loads((tmp_path / "b" / "baselines.json").read_text())
    assert [r["model_sha256"] for r in rows] == [weights_fingerprint(model_dir)]
    assert [r["model_sha256"] for r in json.loads((tmp_path / "b" / "baselines.stale.json").read_text())] == [before]


def test_bf16_points_and_training_baseline_rows_are_their_own(model_dir, tmp_path, capsys):
    """--mixed-precision changes what a point or a training baseline row computes: one made in
    the other precision is set aside and redone."""
    base = ["prune", "sweep", str(model_dir), "--train-src", str(DATA / "train.en.gz"),
            "--train-tgt", str(DATA / "train.de.gz"), "--valid-src", str(DATA / "test_2016_flickr.en.gz"),
            "--valid-tgt", str(DATA / "test_2016_flickr.de.gz"), "--limit", "40", "--eval-limit", "4",
            "--max-tokens", "400", "--eval-beam", "1", "--log-every", "0", "--no-progress", "--gates", "enc_self"]
    out = tmp_path / "s"
    args = base + ["--lams", "0", "--max-steps", "2", "--out", str(out)]
    assert main(args) == 0
    assert main(args + ["--mixed-precision", "bf16"]) == 0
    assert "lam-0: made with other options: train.mixed_precision no -> bf16" in capsys.readouterr().err
    assert json.loads((out / "lam-0" / "prune_config.json").read_text())["train"]["mixed_precision"] == "bf16"
    assert (out / "stale" / "lam-0").is_dir()

    baseline = ["prune", "baseline", *base[2:15], "--eval-beam", "1", "--method", "random", "--keeps", "3",
                "--seeds", "1", "--finetune-steps", "1", "--out", str(tmp_path / "b")]
    assert main(baseline) == 0
    assert main(baseline + ["--mixed-precision", "bf16"]) == 0
    rows = json.loads((tmp_path / "b" / "baselines.json").read_text())
    stale = json.loads((tmp_path / "b" / "baselines.stale.json").read_text())
    assert [r["mixed_precision"] for r in rows] == ["bf16"] and [r["mixed_precision"] for r in stale] == ["no"]
