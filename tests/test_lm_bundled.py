"""The bundled English LM loads with plain transformers and reproduces its card's perplexity."""

import json
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "english-lm"
RESULTS = MODEL / "eval_results.json"

pytestmark = pytest.mark.skipif(not RESULTS.is_file(), reason=f"bundled LM not exported yet ({RESULTS} missing)")


def test_loads_with_plain_transformers_in_fp16_under_25_mb():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert (MODEL / "model.safetensors").stat().st_size <= 25 * 2**20
    model = AutoModelForCausalLM.from_pretrained(str(MODEL))
    tokenizer = AutoTokenizer.from_pretrained(str(MODEL))
    assert model.dtype == torch.float16
    ids = tokenizer(["The man went to the"], return_tensors="pt")["input_ids"]
    assert ids[0, 0] == tokenizer.bos_token_id
    with torch.no_grad():
        logits = model.float()(ids[:, :-1]).logits  # the sentence's </s> is not an input
    assert torch.isfinite(logits).all()


@pytest.mark.slow
def test_reproduces_the_cards_perplexity(capsys):
    from headlab.cli import main

    headline = json.loads(RESULTS.read_text())["headline"]
    card = (MODEL / "README.md").read_text()
    assert headline["command"] in card and f"{headline['perplexity']:.2f}" in card
    argv = shlex.split(headline["command"])[1:]
    assert main([arg if not arg.startswith(("models/", "data/")) else str(ROOT / arg) for arg in argv] + ["--json"]) == 0
    scored = json.loads(capsys.readouterr().out)
    assert scored["tokens"] == headline["tokens"]
    assert scored["perplexity"] == pytest.approx(headline["perplexity"], rel=1e-4)


def test_the_cards_tables_are_the_result_files():
    from headlab.lm.card import CARD_BLOCKS, render_card_blocks
    from headlab.pipeline.profiles import read_block

    card = (MODEL / "README.md").read_text(encoding="utf-8")
    blocks = render_card_blocks(MODEL)
    assert set(blocks) == set(CARD_BLOCKS)
    for name, body in blocks.items():
        assert read_block(card, name) == body, f"models/english-lm/README.md block {name!r}: run experiments/model_card.py"


def test_evaluate_says_how_many_sentences_it_cut(tmp_path, capsys):
    """Regression: a sentence longer than the model's 256 positions was scored on its first 256
    tokens, and the line said "256 tokens in 1 sentence" with nothing about the rest."""
    from headlab.cli import main

    text = tmp_path / "long.txt"
    text.write_text(" ".join(["the cat"] * 400) + "\nA dog runs .\n", encoding="utf-8")
    assert main(["lm", "evaluate", str(MODEL), "--text", str(text)]) == 0
    assert "1 of the 2 sentences was longer than the model's 256 positions and cut" in capsys.readouterr().out
    assert main(["lm", "evaluate", str(MODEL), "--text", str(text), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["truncated"] == 1
