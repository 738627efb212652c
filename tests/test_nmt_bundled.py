"""The bundled translation models load with plain transformers and reproduce their cards' BLEU.

Slow (about 1-2 minutes a model on a 2-core CPU: 1,000 test sentences with beam 4); still run in CI.
"""

import json
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# each bundled translation model: a source sentence and a word its translation must contain
MODELS = {
    "multi30k-en-de": ("A man is riding a bicycle.", "Mann"),
    "multi30k-en-fr": ("A man is riding a bicycle.", "homme"),
    "news-en-de": ("The government announced new measures on Tuesday.", "Regierung"),
}


def bundled(name: str) -> Path:
    model = ROOT / "models" / name
    if not (model / "eval_results.json").is_file():
        pytest.skip(f"bundled model not exported yet ({model / 'eval_results.json'} missing)")
    return model


@pytest.mark.parametrize("name", MODELS)
def test_loads_with_plain_transformers(name):
    from transformers import AutoTokenizer, MarianMTModel

    model_dir = bundled(name)
    model = MarianMTModel.from_pretrained(str(model_dir))
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    assert tokenizer.is_fast and model.config.decoder_start_token_id == tokenizer.pad_token_id
    assert (model_dir / "model.safetensors").stat().st_size <= 30 * 2**20  # fp16 (issue 12)
    sentence, word = MODELS[name]
    batch = tokenizer([sentence], return_tensors="pt")
    output = tokenizer.batch_decode(model.generate(**batch, num_beams=4), skip_special_tokens=True)[0]
    assert word in output


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_reproduces_the_model_cards_test_bleu(name, capsys):
    from headlab.cli import main

    model_dir = bundled(name)
    headline = json.loads((model_dir / "eval_results.json").read_text())["headline"]
    card = (model_dir / "README.md").read_text()
    assert headline["command"] in card and f"{headline['bleu']:.2f}" in card
    argv = shlex.split(headline["command"])
    assert argv[:3] == ["headlab", "nmt", "evaluate"] and argv[argv.index("--model") + 1] == f"models/{name}"
    assert main(argv[1:] + ["--json"]) == 0
    scores = json.loads(capsys.readouterr().out)
    assert scores["bleu"] == pytest.approx(headline["bleu"], abs=0.1)
    assert scores["chrf"] == pytest.approx(headline["chrf"], abs=0.1)
    assert scores["bleu_signature"] == headline["bleu_signature"]


@pytest.mark.parametrize("name", MODELS)
def test_card_tables_come_from_the_result_files(name):
    """A translation card shows a generated block for each of its result files, equal to a fresh rendering."""
    from headlab.nmt.card import render_card_blocks
    from headlab.pipeline.profiles import read_block

    model = bundled(name)
    blocks = render_card_blocks(model)
    assert {"curve", "scores"} <= set(blocks)  # both result files are bundled with every translation model
    history = json.loads((model / "train_history.json").read_text())
    rows = [line for line in blocks["curve"].splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == len(history)
    card = (model / "README.md").read_text()
    for block, body in blocks.items():
        assert read_block(card, block) == body, f"models/{name}/README.md block {block!r}: run experiments/model_card.py"
