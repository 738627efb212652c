"""`headlab demo` end to end on a tiny translation model (the bundled one is too slow for a unit test)."""

import json
from pathlib import Path

from headlab import attention_blocks, load_pruned
from headlab.cli import main
from headlab.data import read_parallel
from headlab.nmt.model import ModelConfig, build_marian_config, create_model
from headlab.nmt.tokenizer import train_tokenizer

DATA = Path(__file__).resolve().parents[1] / "data" / "multi30k"


def test_demo_scores_prunes_and_compares(tmp_path, capsys):
    corpus = read_parallel(DATA / "train.en.gz", DATA / "train.de.gz", max_tokens=20).subset(200)
    tokenizer = train_tokenizer(corpus.sources + corpus.targets, vocab_size=300)
    tiny = ModelConfig(d_model=32, ffn_dim=64, encoder_layers=2, decoder_layers=2, n_heads=4, max_positions=64)
    model = create_model(build_marian_config(tiny, tokenizer), seed=0)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    out = tmp_path / "demo"
    assert main(["demo", "--model", str(tmp_path / "model"), "--n-sentences", "4", "--keep", "3",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "kept the 3 most confident of 8 encoder heads" in printed
    assert "BLEU" in printed
    scores = json.loads((out / "confidence.json").read_text())
    assert scores["method"] == "confidence" and len(scores["scores"]["enc_self"]) == 2
    pruned = load_pruned(out / "pruned")
    assert sum(b.n_heads for b in attention_blocks(pruned) if b.kind == "enc_self") == 3


def test_demo_without_a_model_says_how_to_get_one(tmp_path, capsys):
    assert main(["demo", "--model", str(tmp_path / "none")]) == 2
    assert "headlab nmt train" in capsys.readouterr().err
