"""A model named by a hub id ("org/model") in the Python API's analyses: the name is shown whole
(captions, ``to_pandas()``, heads.csv, the report), and the '/' makes no subdirectory."""

import json
import re

import pytest

import headlab
from support.bad_input import SENTENCES
from support.models import tiny_model
from support.treebank import word_tokenizer


@pytest.fixture(scope="module")
def model_and_tokenizer():
    from support.bad_input import WORDS

    return tiny_model("marian"), word_tokenizer(WORDS)


def test_a_hub_id_is_shown_whole(model_and_tokenizer, tmp_path):
    """Regression: "org/tiny-marian" became "tiny-marian" (its last part), in the caption and in
    to_pandas(), while heads.csv of `headlab analyze org/tiny-marian` named the model whole."""
    model, tokenizer = model_and_tokenizer
    model.config._name_or_path = "org/tiny-marian"
    out = tmp_path / "out"
    analysis = headlab.analyze(model, tokenizer, SENTENCES, measures=["confidence"], attention_sentences=0, out=out)
    assert analysis.model == "org/tiny-marian"
    assert repr(analysis).startswith("Analysis of org/tiny-marian: ")
    assert 'title="headlab report: org/tiny-marian"' in analysis._repr_html_()
    assert set(analysis.to_pandas().model) == set(analysis.heads().model) == {"org/tiny-marian"}
    assert json.loads((out / "manifest.json").read_text())["model"] == "org/tiny-marian"
    assert not (out / "org").exists() and not any("org" in p.parts for p in out.rglob("*"))
    loaded = headlab.Analysis.load(out)
    assert loaded.model == "org/tiny-marian"
    saved = loaded.save(tmp_path / "saved", report=True)
    assert re.search(r"<h1>headlab report: <span class=\"model\">org/tiny-marian</span></h1>",
                     (saved / "index.html").read_text(encoding="utf-8"))
    assert sorted(p.name for p in saved.iterdir() if p.is_dir()) == ["importance"]


def test_a_local_directory_is_shown_by_its_name(tmp_path, monkeypatch):
    from headlab.api import _shown_name

    (tmp_path / "models" / "marian").mkdir(parents=True)
    assert _shown_name(str(tmp_path / "models" / "marian")) == "marian"
    monkeypatch.chdir(tmp_path)
    assert _shown_name("models/marian") == "marian"  # a relative path that is a directory here
    assert _shown_name("Helsinki-NLP/opus-mt-en-de") == "Helsinki-NLP/opus-mt-en-de"
    assert _shown_name("./models/marian") == "marian" and _shown_name("marian") == "marian"


def _hub_id_served_from(monkeypatch, model_dir, hub_id="org/tiny-marian"):
    """``hub_id`` loads from ``model_dir`` (no network): the loaders of headlab.loading redirected."""
    import headlab.loading

    for name in ("load_config", "load_model", "load_tokenizer", "check_supported"):
        original = getattr(headlab.loading, name)

        def redirected(name_or_path, *args, _original=original, **kwargs):
            return _original(str(model_dir) if name_or_path == hub_id else name_or_path, *args, **kwargs)

        monkeypatch.setattr(headlab.loading, name, redirected)


@pytest.fixture
def saved_model(model_and_tokenizer, tmp_path):
    from support.treebank import SAMPLE_CONLLU

    model, tokenizer = model_and_tokenizer
    model.save_pretrained(tmp_path / "saved")
    tokenizer.save_pretrained(tmp_path / "saved")
    (tmp_path / "tb.conllu").write_text(SAMPLE_CONLLU, encoding="utf-8")
    words = [line.split("\t")[1] for line in SAMPLE_CONLLU.splitlines() if line and line[0].isdigit()]
    (tmp_path / "src.txt").write_text(" ".join(words) + "\n", encoding="utf-8")
    return tmp_path / "saved"


def test_functions_command_keeps_a_hub_id_whole(saved_model, tmp_path, monkeypatch):
    """Regression: `headlab functions org/tiny-marian` named the model "tiny-marian" in its results."""
    from headlab.cli import main

    _hub_id_served_from(monkeypatch, saved_model)
    out = tmp_path / "out"
    assert main(["functions", "org/tiny-marian", "--conllu", str(tmp_path / "tb.conllu"), "--out", str(out),
                 "--aggregate", "--no-progress"]) == 0
    assert json.loads((out / "summary.json").read_text())["model"] == "org/tiny-marian"
    assert json.loads((out / "positional" / "share.json").read_text())["model"] == "org/tiny-marian"
    assert json.loads((out / "aggregate" / "dependency_alignment.json").read_text())["model"] == "org/tiny-marian"
    assert not any("org" in p.relative_to(out).parts for p in out.rglob("*"))  # the '/' made no folder


def test_analyze_keeps_a_hub_id_whole_in_functions_and_aggregate(saved_model, tmp_path, monkeypatch):
    """Regression: analyze's functions and aggregate stages named "org/tiny-marian" "tiny-marian"."""
    from headlab.cli import main

    _hub_id_served_from(monkeypatch, saved_model)
    out = tmp_path / "out"
    assert main(["analyze", "org/tiny-marian", "--source", str(tmp_path / "src.txt"), "--conllu",
                 str(tmp_path / "tb.conllu"), "--out", str(out), "--skip", "importance,attention,figures,report",
                 "--no-progress"]) == 0
    assert json.loads((out / "functions" / "summary.json").read_text())["model"] == "org/tiny-marian"
    assert json.loads((out / "functions" / "positional" / "share.json").read_text())["model"] == "org/tiny-marian"
    assert json.loads((out / "aggregate" / "dependency_alignment.json").read_text())["model"] == "org/tiny-marian"
    assert not any("org" in p.relative_to(out).parts for p in out.rglob("*"))  # the '/' made no folder
