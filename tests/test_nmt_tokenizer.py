"""The joint BPE tokenizer: loads with AutoTokenizer, appends </s>, keeps words recoverable."""

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from headlab.data import read_parallel
from headlab.errors import HeadlabError
from headlab.nmt.model import ModelConfig, build_marian_config
from headlab.nmt.tokenizer import load_tokenizer, train_tokenizer

DATA = Path(__file__).resolve().parents[1] / "data" / "multi30k"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    corpus = read_parallel(DATA / "val.en.gz", DATA / "val.de.gz")
    directory = tmp_path_factory.mktemp("tok")
    train_tokenizer(corpus.sources + corpus.targets, vocab_size=600, save_dir=directory)
    return directory


def test_autotokenizer_loads_a_fast_tokenizer_with_special_tokens(saved):
    tok = AutoTokenizer.from_pretrained(str(saved))
    assert tok.is_fast
    assert (tok.pad_token, tok.eos_token, tok.unk_token) == ("<pad>", "</s>", "<unk>")
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    assert len(tok) == 600
    assert load_tokenizer(saved).get_vocab() == tok.get_vocab()


def test_eos_is_appended_to_source_and_target(saved):
    tok = load_tokenizer(saved)
    encoded = tok(["A dog runs."], text_target=["Ein Hund läuft."])
    assert encoded["input_ids"][0][-1] == tok.eos_token_id
    assert encoded["labels"][0][-1] == tok.eos_token_id
    assert encoded["input_ids"][0].count(tok.eos_token_id) == 1


def test_words_are_recoverable_and_decoding_detokenizes(saved):
    tok = load_tokenizer(saved)
    sentence = "Two young, White males are outside near many bushes."
    encoding = tok(sentence)
    word_ids = encoding.word_ids()
    assert word_ids[-1] is None  # </s>
    words = sentence.split()
    assert max(w for w in word_ids if w is not None) == len(words) - 1
    for index, word in enumerate(words):
        pieces = [t for t, w in zip(encoding.tokens(), word_ids) if w == index]
        assert "".join(pieces).lstrip("▁") == word
    assert tok.decode(encoding["input_ids"], skip_special_tokens=True) == sentence
    offsets = tok(sentence, return_offsets_mapping=True)["offset_mapping"]
    assert sentence[offsets[0][0]:offsets[0][1]].strip() == "Two"


def test_marian_config_uses_pad_as_decoder_start(saved):
    tok = load_tokenizer(saved)
    config = build_marian_config(ModelConfig(d_model=32, ffn_dim=64, n_heads=4), tok)
    assert config.decoder_start_token_id == config.pad_token_id == tok.pad_token_id
    assert config.eos_token_id == tok.eos_token_id and config.vocab_size == len(tok)
    assert config.share_encoder_decoder_embeddings and config.tie_word_embeddings and config.scale_embedding
    with pytest.raises(HeadlabError, match="divisible"):
        build_marian_config(ModelConfig(d_model=30, n_heads=4), tok)


def test_missing_tokenizer_is_reported(tmp_path):
    with pytest.raises(HeadlabError, match="no tokenizer"):
        load_tokenizer(tmp_path)
