"""`headlab demo` end to end on a tiny translation model (the bundled one is too slow for a unit test)."""

import json
from pathlib import Path

import torch

from headlab.cli import main
from headlab.data import read_parallel
from headlab.importance.registry import MEASURES
from headlab.lm.model import LMConfig, build_lm_config, create_lm
from headlab.nmt.model import ModelConfig, build_marian_config, create_model
from headlab.nmt.tokenizer import train_tokenizer
from support.treebank import SAMPLE_CONLLU

DATA = Path(__file__).resolve().parents[1] / "data" / "multi30k"


def test_demo_runs_analyze_with_pruning_and_prints_the_report(tmp_path, capsys):
    threads = torch.get_num_threads()
    corpus = read_parallel(DATA / "train.en.gz", DATA / "train.de.gz", max_tokens=20).subset(200)
    tokenizer = train_tokenizer(corpus.sources + corpus.targets, vocab_size=300)
    tiny = ModelConfig(d_model=32, ffn_dim=64, encoder_layers=2, decoder_layers=2, n_heads=4, max_positions=64)
    model = create_model(build_marian_config(tiny, tokenizer), seed=0)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    for name, lines in (("src.en", corpus.sources), ("ref.de", corpus.targets)):
        (tmp_path / name).write_text("\n".join(lines[:8]) + "\n", encoding="utf-8")
        (tmp_path / f"train.{name}").write_text("\n".join(lines[8:]) + "\n", encoding="utf-8")
    (tmp_path / "tb.conllu").write_text(SAMPLE_CONLLU, encoding="utf-8")
    lm_tokenizer = train_tokenizer(corpus.sources, vocab_size=300, bos=True)
    lm = create_lm(build_lm_config(LMConfig(d_model=32, ffn_dim=64, layers=2, n_heads=4, max_positions=64),
                                   lm_tokenizer), seed=0)
    lm.save_pretrained(tmp_path / "lm")
    lm_tokenizer.save_pretrained(tmp_path / "lm")
    out = tmp_path / "demo"
    try:
        code = main(["demo", "--model", str(tmp_path / "model"), "--source", str(tmp_path / "src.en"),
                     "--reference", str(tmp_path / "ref.de"), "--conllu", str(tmp_path / "tb.conllu"),
                     "--train-source", str(tmp_path / "train.src.en"), "--train-target", str(tmp_path / "train.ref.de"),
                     "--n-sentences", "6", "--prune-steps", "2", "--prune-keeps", "4,2", "--no-progress",
                     "--out", str(out), "--lm", str(tmp_path / "lm"), "--lm-sentences", "4",
                     "--lm-out", str(tmp_path / "demo-lm")])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    printed = capsys.readouterr().out
    assert f"Open the report of the translation model: {out / 'index.html'}" in printed
    assert f"Open the report of the language model: {tmp_path / 'demo-lm' / 'index.html'}" in printed
    lm_stages = {s["name"]: s for s in json.loads((tmp_path / "demo-lm" / "manifest.json").read_text())["stages"]}
    asked = {name for name, measure in MEASURES.items() if measure.on_request}  # run only when asked: --ablation
    assert all(lm_stages[name]["status"] == "done" for name in (*(m for m in MEASURES if m not in asked), "functions",
                                                                   "aggregate", "report"))
    stages = {s["name"]: s for s in json.loads((out / "manifest.json").read_text())["stages"]}
    assert all(stages[name]["status"] == "skipped" for name in asked)
    assert all(s["status"] == "done" for name, s in stages.items() if name not in asked)
    rows = json.loads((out / "prune" / "sweep.json").read_text())
    assert [r["enc_self"] for r in rows] == [8, 4, 2]
    assert "separate training data" not in stages["prune"]["reason"]  # fine-tuned on the training pairs


def test_demo_without_a_model_says_how_to_get_one(tmp_path, capsys):
    assert main(["demo", "--model", str(tmp_path / "none")]) == 2
    assert "headlab nmt train" in capsys.readouterr().err
    bundled = Path(__file__).resolve().parents[1] / "models" / "multi30k-en-de"
    assert main(["demo", "--model", str(bundled), "--lm", str(tmp_path / "no-lm")]) == 2
    assert "--no-lm" in capsys.readouterr().err


def test_demo_outside_a_checkout_says_the_models_come_with_the_repository(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # as after `pip install headlab-*.whl`, anywhere but the repository
    assert main(["demo"]) == 2
    err = capsys.readouterr().err
    assert "checkout of headlab's repository" in err and "not with the installed package" in err
