"""`headlab importance` end to end on tiny saved models, and its handling of bad input."""

import gzip
import json

import pytest
import transformers as tf

from headlab import HeadScores
from headlab.cli import main
from headlab.errors import HeadlabError
from headlab.importance import ImportanceData, describe_model, encode_texts
from headlab.importance.registry import MEASURES, REFERENCE, tables
from headlab.nmt.tokenizer import train_tokenizer
from support.models import tiny_model

SENTENCES = [
    "a man is riding a bike", "two dogs play in the snow", "a woman reads a book",
    "children are playing football", "a cat sleeps on the sofa", "the man is cooking dinner",
    "a girl is singing a song", "people walk in the park",
]
GERMAN = [
    "ein mann fährt fahrrad", "zwei hunde spielen im schnee", "eine frau liest ein buch",
    "kinder spielen fußball", "eine katze schläft auf dem sofa", "der mann kocht abendessen",
    "ein mädchen singt ein lied", "leute gehen im park",
]




@pytest.fixture(scope="module")
def tokenizer():
    # ids: <pad> 0, </s> 1, <unk> 2, like the tiny Marian config; vocabulary below its 99
    return train_tokenizer(SENTENCES + GERMAN, vocab_size=90, min_frequency=1)


@pytest.fixture
def files(tmp_path):
    source = tmp_path / "src.en.gz"
    with gzip.open(source, "wt", encoding="utf-8") as handle:
        handle.write("\n".join(SENTENCES[:5] + ["", SENTENCES[5]]) + "\n")
    target = tmp_path / "ref.de"
    target.write_text("\n".join(GERMAN[:5] + ["", GERMAN[5]]) + "\n", encoding="utf-8")
    return source, target


def _save(model, tokenizer, path):
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_all_methods_end_to_end(tmp_path, tokenizer, files, capsys):
    model_dir = _save(tiny_model("marian"), tokenizer, tmp_path / "marian")
    source, target = files
    out = tmp_path / "out"
    code = main(["importance", model_dir, "--data", str(source), "--target", str(target), "--out", str(out),
                 "--batch-size", "3", "--ablation-rows", "12", "--no-progress", "--plots"])
    assert code == 0
    printed = capsys.readouterr()
    for name in tables():  # every table of every registered measure
        scores = HeadScores.load(out / f"{name}.json")
        assert scores.method == name and scores.kinds == ("enc_self", "dec_self", "dec_cross")
        assert scores.signature["n_sentences"] == 6 and scores.signature["n_empty_skipped"] == 1
        assert (out / f"{name}.png").is_file()
    agreement = json.loads((out / "agreement.json").read_text())
    assert set(agreement["spearman"]) == set(tables()) - set(MEASURES[REFERENCE].tables)
    assert "| lrp |" in (out / "agreement.md").read_text()
    assert "Spearman correlation with ablation" in printed.out
    assert "6 sentences" in printed.err


def test_bleu_metric_and_single_method(tmp_path, tokenizer, files, capsys):
    model_dir = _save(tiny_model("marian"), tokenizer, tmp_path / "marian")
    source, target = files
    out = tmp_path / "out"
    assert main(["importance", model_dir, "--data", str(source), "--target", str(target), "--out", str(out),
                 "--method", "ablation,lrp", "--metric", "bleu", "--no-progress", "--n-sentences", "3"]) == 0
    assert sorted(p.name for p in out.iterdir()) == [".headlab", "ablation.json", "agreement.json", "agreement.md",
                                                     "lrp.json"]  # .headlab/files.json lists the others
    assert HeadScores.load(out / "ablation.json").signature["metric"] == "bleu"


def test_limit_counts_sentences_not_lines(tmp_path, tokenizer, files, capsys):
    """Regression: --limit N kept the first N lines, so a blank line among them (or in the
    references) gave N-1 sentences. The pruning data (prune train --train-text) reads the same way."""
    model_dir = _save(tiny_model("marian"), tokenizer, tmp_path / "marian")
    source, target = files  # 5 sentences, a blank line (both sides), 1 sentence
    out = tmp_path / "out"
    assert main(["importance", model_dir, "--source", str(source), "--target", str(target), "--out", str(out),
                 "--method", "confidence", "--no-progress", "--limit", "6"]) == 0
    signature = HeadScores.load(out / "confidence.json").signature
    assert signature["n_sentences"] == 6 and signature["n_empty_skipped"] == 1
    assert "6 sentences" in capsys.readouterr().err
    from headlab.data.parallel import first_sentences

    assert first_sentences(["a", "", "b", "c"], 2) == 3 and first_sentences(["a", "", "b"], 5) == 3
    assert first_sentences(["a", "b", "c"], 2, aligned=["x", "", "z"]) == 3  # a pair with a blank side is none


def test_counts_in_summaries_agree_in_number(tmp_path):
    """Regression: one sentence was "1 sentences" in the summaries and messages the CLI prints."""
    from headlab.data.parallel import read_parallel
    from headlab.errors import counted

    assert [counted(1, "sentence"), counted(2, "sentence"), counted(1204, "line", spec=","),
            counted(0, "sentence pair")] == ["1 sentence", "2 sentences", "1,204 lines", "0 sentence pairs"]
    assert ImportanceData.from_ids([[4, 5]]).summary() == "1 sentence (2 source tokens)"
    (tmp_path / "a").write_text("a b\n\n", encoding="utf-8")
    (tmp_path / "b").write_text("c d\n\n", encoding="utf-8")
    assert read_parallel(tmp_path / "a", tmp_path / "b").summary().startswith("1 sentence pair from ")
    assert read_parallel(tmp_path / "a", tmp_path / "b").summary().endswith("; 1 pair with an empty side skipped")


def test_model_without_lm_head_skips_what_needs_one(tmp_path, tokenizer, files, capsys):
    bare = tf.BertModel(tiny_model("bert").config).eval()
    model_dir = _save(bare, tokenizer, tmp_path / "bert")
    source, _ = files
    out = tmp_path / "out"
    assert main(["importance", model_dir, "--data", str(source), "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr()
    for method in ("lrp", "gradient", "ablation"):
        assert f"skipped {method}: the model has no language-model head" in printed.out
    assert sorted(p.name for p in out.iterdir()) == [".headlab", "confidence.json"]
    assert main(["importance", model_dir, "--data", str(source), "--out", str(tmp_path / "o"), "--method", "lrp"]) == 2
    assert "cannot run lrp" in capsys.readouterr().err


def test_bad_input_gets_clear_errors(tmp_path, tokenizer, files, capsys):
    model_dir = _save(tiny_model("gpt2"), tokenizer, tmp_path / "gpt2")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n\n", encoding="utf-8")
    assert main(["importance", model_dir, "--data", str(empty), "--out", str(tmp_path / "o")]) == 2
    assert "empty.txt: the file is empty" in capsys.readouterr().err
    source, target = files
    assert main(["importance", model_dir, "--data", str(source), "--out", str(tmp_path / "o"), "--method", "magic"]) == 2
    assert "unknown importance method 'magic'" in capsys.readouterr().err
    assert main(["importance", model_dir, "--data", str(source), "--out", str(tmp_path / "o"),
                 "--kinds", "enc_self,enc_cross"]) == 2
    assert "--kinds enc_self,enc_cross: unknown attention kind 'enc_cross'" in capsys.readouterr().err
    for option, value, expected in (("--kinds", ",", "--kinds ',': no kind named"),
                                    ("--kinds", "", "--kinds '': no kind named"),
                                    ("--method", ",", "no importance method given (--method)")):
        assert main(["importance", model_dir, "--data", str(source), "--out", str(tmp_path / "o"), option, value]) == 2
        assert expected in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    assert main(["importance", model_dir, "--data", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "o")]) == 2
    assert "missing.txt: no such file" in capsys.readouterr().err
    long = tmp_path / "long.txt"
    long.write_text(" ".join(SENTENCES) + "\na man\n", encoding="utf-8")
    out = tmp_path / "trunc"
    assert main(["importance", model_dir, "--data", str(long), "--out", str(out), "--max-length", "8",
                 "--method", "confidence,lrp", "--no-progress"]) == 0
    assert "1 input longer than 8 tokens was truncated" in capsys.readouterr().err
    assert HeadScores.load(out / "lrp.json").signature["n_truncated"] == 1


def test_encoding_counts_truncations_and_refuses_empty_data(tokenizer):
    model = tiny_model("marian")
    info = describe_model(model, tokenizer, max_length=5)
    assert info.max_length == 5 and {0, 1} <= info.special_ids
    data = encode_texts(tokenizer, info, [SENTENCES[0], "", SENTENCES[2]], [GERMAN[0], "x", GERMAN[2]])
    assert len(data) == 2 and data.n_empty == 1
    assert all(len(ids) <= 5 and ids[-1] == 1 for ids in data.sources + data.references)  # EOS kept
    assert data.n_truncated == 4
    with pytest.raises(HeadlabError, match="empty data set"):
        encode_texts(tokenizer, info, ["", " "])
    with pytest.raises(HeadlabError, match="empty data set"):
        ImportanceData.from_ids([])


def test_max_length_below_the_special_tokens_is_refused():
    """Regression: a tokenizer asked to cut below its own special tokens ([CLS] A [SEP] to 1 token)
    returns the input whole; the scores were of the full inputs, recorded as cut to 1 token."""
    from support.treebank import word_tokenizer

    tokenizer = word_tokenizer(" ".join(SENTENCES).split(), style="bert")
    info = describe_model(tiny_model("bert"), tokenizer, max_length=1)
    with pytest.raises(HeadlabError, match="--max-length 1: too short for the tokenizer"):
        encode_texts(tokenizer, info, SENTENCES[:2])
    info = describe_model(tiny_model("bert"), tokenizer, max_length=3)
    assert all(len(ids) == 3 for ids in encode_texts(tokenizer, info, SENTENCES[:2]).sources)


def test_confidence_with_query_chunk_writes_the_eager_scores(tmp_path, tokenizer, files, capsys):
    model_dir = _save(tiny_model("gpt2"), tokenizer, tmp_path / "gpt2")
    source, _ = files
    for bad in ("0", "-1"):
        out = tmp_path / f"bad{bad}"
        assert main(["importance", model_dir, "--data", str(source), "--out", str(out), "--method", "confidence",
                     "--query-chunk", bad]) == 2
        assert f"--query-chunk must be at least 1, got {bad}" in capsys.readouterr().err
        assert not out.exists()
    written = {}
    for name, extra in (("eager", []), ("chunked", ["--query-chunk", "2"])):
        out = tmp_path / name
        assert main(["importance", model_dir, "--data", str(source), "--out", str(out), "--method", "confidence",
                     "--batch-size", "3", "--no-progress", *extra]) == 0
        written[name] = HeadScores.load(out / "confidence.json")
    assert written["chunked"].to_json() == written["eager"].to_json()


def test_accuracy_metric_on_a_translation_model_is_refused_before_any_work(tmp_path, tokenizer, files, capsys):
    # It was refused only after the model had translated every sentence (the check sat in the measure).
    model_dir = _save(tiny_model("marian"), tokenizer, tmp_path / "marian")
    source, target = files
    out = tmp_path / "out"
    assert main(["importance", model_dir, "--source", str(source), "--target", str(target), "--out", str(out),
                 "--method", "ablation", "--metric", "accuracy", "--no-progress"]) == 2
    err = capsys.readouterr().err
    # since session 41 from config.json, before the weights load (tests/test_bad_input_cli.py)
    assert "--metric accuracy: the ablation's accuracy is a sequence classifier's" in err
    assert "translating" not in err and not out.exists()
    # With every method asked for, ablation is skipped with its reason and the others run.
    assert main(["importance", model_dir, "--source", str(source), "--target", str(target), "--out", str(out),
                 "--metric", "accuracy", "--no-progress"]) == 0
    assert "skipped ablation: --metric accuracy is for classifiers" in capsys.readouterr().out
    assert not (out / "ablation.json").exists() and (out / "lrp.json").is_file()


def test_beam_of_a_model_that_does_not_translate_is_refused(tmp_path, capsys):
    """Regression: `importance --beam 3` on a language model ran and wrote scores whose signature
    said beam 3, of a model that makes no translation for the beam to search (analyze refuses it)."""
    from pathlib import Path

    model = Path(__file__).resolve().parents[1] / "models" / "english-lm"
    if not (model / "config.json").is_file():
        pytest.skip("bundled language model missing")
    source = tmp_path / "s.txt"
    source.write_text("A dog runs .\n", encoding="utf-8")
    out = tmp_path / "o"
    assert main(["importance", str(model), "--source", str(source), "--method", "confidence", "--beam", "3",
                 "--out", str(out), "--no-progress"]) == 2
    assert "--beam 3: the beam of the model's translations, and" in capsys.readouterr().err
    assert not out.exists()


def test_lrp_bootstrap_of_one_resample_refused_and_one_sentence_said_undefined(tmp_path, capsys):
    """--lrp-bootstrap 1 wrote every standard error as null and said nothing (a standard deviation of one
    resample); one sentence likewise: refused before work, and said undefined (audit33)."""
    from support.bad_input import SENTENCES as FEW
    from support.bad_input import files_under, save_tiny_marian

    model = save_tiny_marian(tmp_path / "model")
    source = tmp_path / "src.txt"
    source.write_text("\n".join(FEW) + "\n", encoding="utf-8")
    run = ["importance", str(model), "--source", str(source), "--method", "lrp", "--no-progress"]
    assert main([*run, "--out", str(tmp_path / "one"), "--lrp-bootstrap", "1"]) == 2
    assert "--lrp-bootstrap 1: a standard error needs at least 2 resamples" in capsys.readouterr().err
    assert files_under(tmp_path / "one") == set()
    assert main([*run, "--out", str(tmp_path / "single"), "--limit", "1"]) == 0
    assert "lrp: bootstrap standard error undefined over 1 sentence (null in the file)" in capsys.readouterr().out
