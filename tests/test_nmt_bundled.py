"""The bundled EN-DE model loads with plain transformers and reproduces its model card's BLEU.

Slow (about 1-2 minutes on a 2-core CPU: 1,000 test sentences with beam 4); still run in CI.
"""

import json
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "multi30k-en-de"
RESULTS = MODEL / "eval_results.json"

pytestmark = pytest.mark.skipif(
    not RESULTS.is_file(), reason=f"bundled model not exported yet ({RESULTS} missing)"
)


def test_loads_with_plain_transformers():
    from transformers import AutoTokenizer, MarianMTModel

    model = MarianMTModel.from_pretrained(str(MODEL))
    tokenizer = AutoTokenizer.from_pretrained(str(MODEL))
    assert tokenizer.is_fast and model.config.decoder_start_token_id == tokenizer.pad_token_id
    assert (MODEL / "model.safetensors").stat().st_size <= 60 * 2**20
    batch = tokenizer(["A man is riding a bicycle."], return_tensors="pt")
    output = tokenizer.batch_decode(model.generate(**batch, num_beams=4), skip_special_tokens=True)[0]
    assert "Mann" in output


@pytest.mark.slow
def test_reproduces_the_model_cards_test_bleu(capsys):
    from headlab.cli import main

    results = json.loads(RESULTS.read_text())
    headline = results["headline"]
    card = (MODEL / "README.md").read_text()
    assert headline["command"] in card and f"{headline['bleu']:.2f}" in card
    argv = shlex.split(headline["command"])
    assert argv[:3] == ["headlab", "nmt", "evaluate"]
    assert main(argv[1:] + ["--json"]) == 0
    scores = json.loads(capsys.readouterr().out)
    assert scores["bleu"] == pytest.approx(headline["bleu"], abs=0.1)
    assert scores["chrf"] == pytest.approx(headline["chrf"], abs=0.1)
    assert scores["bleu_signature"] == headline["bleu_signature"]


@pytest.mark.parametrize("name", ["multi30k-en-de", "multi30k-en-fr"])
def test_card_tables_come_from_the_result_files(name):
    """Where a translation card has generated blocks, they equal a fresh rendering of its result files."""
    from headlab.analyze.profiles import read_block
    from headlab.nmt.card import render_card_blocks

    model = ROOT / "models" / name
    blocks = render_card_blocks(model)
    assert set(blocks) == {"curve", "scores"}  # both result files are bundled with every translation model
    history = json.loads((model / "train_history.json").read_text())
    rows = [line for line in blocks["curve"].splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == len(history)
    card = (model / "README.md").read_text()
    for block, body in blocks.items():
        if f"<!-- BEGIN generated:{block} -->" in card:
            assert read_block(card, block) == body, f"models/{name}/README.md block {block!r}: run experiments/model_card.py"
