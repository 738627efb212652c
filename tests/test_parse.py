"""`headlab parse` (raw text to CoNLL-U with a spaCy pipeline), on a tiny pipeline trained here in
seconds: the output is one tree per non-blank line that headlab's treebank reader accepts, the
bad inputs of docs/cli.md are refused before any output is written, and loading a pipeline
never unpickles. spaCy comes with the `test` extra (CI installs it), so these tests do not skip.
"""

import gzip
import pickle
import sys

import pytest
import spacy

from headlab.cli import main
from headlab.data.treebank import UPOS_TAGS, read_conllu
from headlab.errors import HeadlabError
from headlab.parse import load_pipeline, parse_text_file
from support.parser import PARSER_TRAIN, tiny_parser


@pytest.fixture(scope="module")
def pipeline_dir(tmp_path_factory):
    """A morphologizer + parser pipeline trained on PARSER_TRAIN (about a second)."""
    return tiny_parser(tmp_path_factory.mktemp("parser") / "pipeline")


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def test_parse_writes_one_tree_per_line(pipeline_dir, tmp_path):
    lines = ["A dog runs .", "", "The man eats an apple.", "A  girl sees the red ball ."]
    source = _write(tmp_path / "in.txt", "\n".join(lines) + "\n")
    out = tmp_path / "out.conllu"
    report = parse_text_file(pipeline_dir, source, out)
    assert (report.n_lines, report.n_blank, report.n_sentences) == (4, 1, 3)
    sentences = list(read_conllu(out))
    assert [s.sent_id for s in sentences] == ["1", "3", "4"]  # input line numbers
    assert [s.text for s in sentences] == ["A dog runs .", "The man eats an apple.", "A girl sees the red ball ."]
    assert sentences[1].words == ("The", "man", "eats", "an", "apple", ".")
    assert sentences[1].space_after == (True, True, True, True, False, True)  # "apple." as typed
    for sentence in sentences:
        assert sentence.heads.count(-1) == 1  # one root: the line is one sentence
        assert sentence.deprels[sentence.heads.index(-1)] == "root"
        assert set(sentence.upos) <= set(UPOS_TAGS)
    # The pipeline reproduces the trees it was trained on.
    gold = {text: ([h - 1 for h in heads], upos, deps) for text, upos, heads, deps in PARSER_TRAIN}
    for sentence in (sentences[0], sentences[2]):
        heads, upos, deps = gold[sentence.text]
        assert (list(sentence.heads), list(sentence.upos), list(sentence.deprels)) == (heads, upos, deps)


def test_cli_gz_in_and_out(pipeline_dir, tmp_path, capsys):
    source = tmp_path / "in.txt.gz"
    source.write_bytes(gzip.compress("Two boys play quickly .\nA dog runs .\n".encode()))
    out = tmp_path / "out.conllu.gz"
    # --input: the old name of --source, kept for a release
    assert main(["parse", "--model", str(pipeline_dir), "--input", str(source), "--out", str(out), "--no-progress"]) == 0
    said = capsys.readouterr()
    assert "2 sentences" in said.out and "--input is deprecated, use --source" in said.err
    sentences = list(read_conllu(out))
    assert [s.words for s in sentences] == [("Two", "boys", "play", "quickly", "."), ("A", "dog", "runs", ".")]
    assert gzip.decompress(out.read_bytes()).decode().startswith("# sent_id = 1\n# text = Two boys play quickly .\n")


def _fails(argv, capsys, *needles):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err


def test_bad_inputs_exit_2_and_write_nothing(pipeline_dir, tmp_path, capsys):
    out = tmp_path / "out.conllu"
    good = _write(tmp_path / "in.txt", "A dog runs .\n")

    def argv(model=pipeline_dir, source=good):
        return ["parse", "--model", str(model), "--source", str(source), "--out", str(out), "--no-progress"]

    _fails(argv(model=tmp_path / "nope"), capsys, "--model", "nope: no such directory")
    (tmp_path / "empty-dir").mkdir()
    _fails(argv(model=tmp_path / "empty-dir"), capsys, "not a spaCy pipeline", "experiments/parser/train.sh")
    _fails(argv(source=tmp_path / "missing.txt"), capsys, "--source", "no such file")
    _fails(argv(source=_write(tmp_path / "empty.txt", "")), capsys, "--source", "the file is empty")
    _fails(argv(source=_write(tmp_path / "blank.txt", "\n  \n")), capsys, "--source", "the file is empty")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"A dog runs .\nThe \xff man\n")
    _fails(argv(source=bad), capsys, "bad.txt, line 2: not valid UTF-8")
    _fails(argv() + ["--batch-size", "0"], capsys, "--batch-size must be at least 1")
    # regression: --out naming --source overwrote the text with its parse
    _fails(argv()[:-3] + ["--out", str(good), "--no-progress"], capsys, f"--out {good}: the same file as --source")
    assert good.read_text(encoding="utf-8") == "A dog runs .\n"
    assert not out.exists()
    assert not list(tmp_path.glob(".out.conllu.*"))  # no temporary file left


def test_pipeline_without_parser_is_refused(tmp_path, capsys):
    nlp = spacy.blank("en")
    nlp.add_pipe("sentencizer")
    nlp.to_disk(tmp_path / "no-parser")
    with pytest.raises(HeadlabError, match="has no parser"):
        load_pipeline(tmp_path / "no-parser")


def test_missing_spacy_names_the_install(pipeline_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "spacy", None)  # `import spacy` raises ImportError
    source = _write(tmp_path / "in.txt", "A dog runs .\n")
    _fails(["parse", "--model", str(pipeline_dir), "--source", str(source), "--out", str(tmp_path / "o.conllu")],
           capsys, "needs spaCy", "pip install 'headlab[parse]'")


def test_loading_a_pipeline_never_unpickles(pipeline_dir, monkeypatch):
    import srsly

    def refuse(*args, **kwargs):
        raise AssertionError("unpickling while loading a spaCy pipeline")

    for module, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (srsly, "pickle_loads")):
        monkeypatch.setattr(module, name, refuse)
    nlp = load_pipeline(pipeline_dir)
    assert nlp.pipe_names == ["morphologizer", "parser"]


def test_bundled_parser_loads_parses_and_its_card_matches_its_scores(tmp_path):
    """models/ewt-parser: the card's EWT test row is eval_results.json, and it parses a caption."""
    import json
    from pathlib import Path

    bundled = Path(__file__).resolve().parents[1] / "models" / "ewt-parser"
    scores = json.loads((bundled / "eval_results.json").read_text(encoding="utf-8"))
    card = (bundled / "README.md").read_text(encoding="utf-8")
    row = (f"| EWT test, gold words, punctuation included | {100 * scores['uas']:.1f}% | {100 * scores['las']:.1f}% | "
           f"{100 * scores['las_universal']:.1f}% | {100 * scores['upos']:.1f}% |")
    assert row in card
    source = _write(tmp_path / "in.txt", "A man in a blue shirt is riding a bike .\n")
    parse_text_file(bundled, source, tmp_path / "out.conllu")
    (sentence,) = read_conllu(tmp_path / "out.conllu")
    assert sentence.deprels[sentence.words.index("man")] == "nsubj"
    assert sentence.upos[sentence.words.index("blue")] == "ADJ"
