"""`headlab analyze` end to end on a tiny model of every supported family.

The families are those of :data:`tiny_models.FAMILIES` (the one list, also named in README.md):
each runs every stage but figures (plotting does not depend on the family and is covered by
test_analyze.py) and must finish it.
"""

import csv
import json

import pytest

from headlab.cli import main
from headlab.importance.registry import MEASURES
from support.models import FAMILIES, SEQ2SEQ, tiny_model
from support.treebank import SAMPLE_CONLLU, word_tokenizer

TEXTS = [line[len("# text = "):] for line in SAMPLE_CONLLU.splitlines() if line.startswith("# text = ")]
WORDS = [line.split("\t")[1] for line in SAMPLE_CONLLU.splitlines() if line and line[0].isdigit()]
STYLE = {"bert": "bert", "roberta": "bert", "distilbert": "bert", "gpt2": "gpt2", "llama": "gpt2", "qwen2": "gpt2"}
DONE = (*(name for name, measure in MEASURES.items() if not measure.on_request),  # the measures analyze runs unasked
        "agreement", "functions", "aggregate", "table", "attention", "report")


def byte_level_tokenizer(texts):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|endoftext|>")




@pytest.mark.parametrize("family", FAMILIES)
def test_analyze_runs_end_to_end(family, tmp_path, capsys):
    model_dir = tmp_path / family
    words = [w for text in TEXTS for w in text.split()] + WORDS
    model = tiny_model(family)
    if family == "qwen2":  # transformers loads any qwen2 tokenizer as its byte-level BPE Qwen2Tokenizer
        tokenizer = byte_level_tokenizer(TEXTS)
        model.resize_token_embeddings(len(tokenizer))
    else:
        tokenizer = word_tokenizer(words, style=STYLE.get(family, "marian"))
    for name in ("pad", "bos", "eos"):  # the config's special ids are the tokenizer's, as in a real checkpoint
        if getattr(model.config, f"{name}_token_id", None) is not None:
            setattr(model.config, f"{name}_token_id", getattr(tokenizer, f"{name}_token_id") or 0)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    (tmp_path / "text.txt").write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    (tmp_path / "tb.conllu").write_text(SAMPLE_CONLLU, encoding="utf-8")
    out = tmp_path / "out"
    code = main(["analyze", str(model_dir), "--source", str(tmp_path / "text.txt"), "--conllu",
                 str(tmp_path / "tb.conllu"), "--out", str(out), "--skip", "figures", "--no-progress",
                 "--attention-sentences", "2"])
    stages = {s["name"]: s for s in json.loads((out / "manifest.json").read_text())["stages"]}
    assert code == 0, capsys.readouterr().err
    for name in DONE:
        assert stages[name]["status"] == "done", stages[name]
    with open(out / "heads.csv", newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    kinds = {row["kind"] for row in rows}
    assert kinds == ({"enc_self", "dec_self", "dec_cross"} if family in SEQ2SEQ else
                     {"dec_self"} if STYLE.get(family) == "gpt2" else {"enc_self"})
    assert all(row["confidence"] != "" and row["lrp"] != "" for row in rows)
    analysed = "dec_self" if STYLE.get(family) == "gpt2" else "enc_self"
    assert all(row["mean_entropy"] != "" for row in rows if row["kind"] == analysed)
