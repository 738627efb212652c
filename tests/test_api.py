"""The Python API (headlab.analyze, importance, functions, aggregate, prune; Analysis) on a tiny
Marian: the same numbers as the command line's files, in-memory inputs, pandas, save/load, reprs."""

import json
import math
import os
import sys
from pathlib import Path

import pytest

import headlab
from headlab.api import DEFAULT_MEASURES
from headlab.cli import main
from headlab.data.treebank import InMemoryTreebank, read_conllu
from headlab.errors import HeadlabError
from headlab.importance.registry import MEASURES
from support.models import tiny_model
from support.treebank import SAMPLE_CONLLU, save_marian_for_treebank

SENTENCES = ["a man is riding a bike", "two dogs play in the snow", "a woman reads a book",
             "children are playing football", "a cat sleeps on the sofa"]
GERMAN = ["ein mann fährt fahrrad", "zwei hunde spielen im schnee", "eine frau liest ein buch",
          "kinder spielen fußball", "eine katze schläft auf dem sofa"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("api")
    save_marian_for_treebank(root / "model", SENTENCES + GERMAN)
    (root / "src.en").write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    (root / "tb.conllu").write_text(SAMPLE_CONLLU, encoding="utf-8")
    # What the command line computes: the tests compare the API's results with these files.
    cli = root / "cli"
    assert main(["analyze", str(root / "model"), "--source", str(root / "src.en"), "--conllu", str(root / "tb.conllu"),
                 "--out", str(cli), "--no-progress", "--skip", "attention,figures,report"]) == 0
    from headlab.loading import load_model, load_tokenizer

    loaded = load_model(str(root / "model")), load_tokenizer(str(root / "model"))
    api = headlab.analyze(*loaded, SENTENCES, treebank=root / "tb.conllu")
    return root, cli, loaded, api


def _scores(table):
    """A heads table without its ``model`` and ``run`` columns (the model argument as given, the
    directory's name: they name the run, they are not its results)."""
    columns, rows = table
    assert columns[:2] == ["model", "run"]
    return columns[2:], [row[2:] for row in rows]


def _csv(path):
    import csv

    with open(path, newline="", encoding="utf-8") as handle:
        rows = list(csv.reader(handle))
    return rows[0], rows[1:]


def test_analyze_gives_the_command_lines_numbers(setup):
    root, cli, _, api = setup
    columns, rows = _scores(api.heads_table())
    cli_columns, cli_rows = _scores(_csv(cli / "heads.csv"))
    assert columns == cli_columns
    assert [["" if v is None else repr(v) if isinstance(v, float) else str(v) for v in row] for row in rows] == cli_rows
    for measure in DEFAULT_MEASURES:  # what analyze runs unasked
        ours, theirs = api[measure], headlab.HeadScores.load(cli / "importance" / f"{measure}.json")
        assert ours.fingerprint() == theirs.fingerprint()
    assert api.agreement == json.loads((cli / "importance" / "agreement.json").read_text())
    assert api.labels == json.loads((cli / "functions" / "labels.json").read_text())
    assert api.measures == sorted(t for m in DEFAULT_MEASURES for t in MEASURES[m].tables)  # heads.csv's order


def test_the_single_steps_equal_the_pipeline(setup):
    root, cli, (model, tokenizer), _ = setup
    result = headlab.importance(model, tokenizer, SENTENCES, measures=["confidence"])
    assert result.scores["confidence"].fingerprint() == \
        headlab.HeadScores.load(cli / "importance" / "confidence.json").fingerprint()
    assert "confidence" in repr(result) and "array(" not in repr(result)
    stats = headlab.aggregate(model, tokenizer, SAMPLE_CONLLU)  # CoNLL-U text in memory
    assert stats["mean_distance"].fingerprint() == \
        headlab.HeadScores.load(cli / "aggregate" / "mean_distance.json").fingerprint()
    parsed = [s for s in read_conllu(root / "tb.conllu")]  # parsed sentences
    functions = headlab.functions(model, tokenizer, parsed, frequency_texts=SENTENCES)
    assert functions.positional.share.fingerprint() == \
        headlab.HeadScores.load(cli / "functions" / "positional" / "share.json").fingerprint()
    assert "HeadAnalysis" in repr(functions) and len(repr(functions)) < 1500


def test_a_bytes_treebank_path_is_named_as_bytes():
    """Regression (qa6): treebank=b"x.conllu" said "got int" (list() of bytes is ints)."""
    from headlab.api import as_treebank

    for value in (b"x.conllu", bytearray(b"x.conllu")):
        with pytest.raises(HeadlabError, match=f"treebank: got {type(value).__name__}; pass a CoNLL-U path as str"):
            as_treebank(value)


def test_in_memory_treebank_reads_like_the_file(tmp_path):
    path = tmp_path / "tb.conllu"
    path.write_text(SAMPLE_CONLLU, encoding="utf-8")
    from_file = list(read_conllu(path))
    from_text = list(read_conllu(InMemoryTreebank(SAMPLE_CONLLU, "mem")))
    assert [s.words for s in from_text] == [s.words for s in from_file]
    assert [s.heads for s in from_text] == [s.heads for s in from_file]
    assert list(read_conllu(InMemoryTreebank(from_file), limit=2)) == from_file[:2]
    bad = SAMPLE_CONLLU.replace("1\tThe\tthe\tDET", "1\tThe\tthe", 1)
    with pytest.raises(HeadlabError, match=r"^mem:3: expected 10"):
        list(read_conllu(InMemoryTreebank(bad, "mem")))
    with pytest.raises(HeadlabError, match="Sentence objects"):
        InMemoryTreebank(["not a sentence"])


def test_in_memory_texts_are_checked_like_a_file(setup):
    _, _, (model, tokenizer), _ = setup
    with pytest.raises(HeadlabError, match="one string"):
        headlab.importance(model, tokenizer, "a man is riding a bike")
    # Regression: a string of targets (or frequency texts) was said to be a string of texts
    with pytest.raises(HeadlabError, match="^targets: expected a list of sentences, got one string"):
        headlab.importance(model, tokenizer, ["a man"], targets="ein mann", measures="confidence")
    with pytest.raises(HeadlabError, match="^frequency_texts: expected a list of sentences, got one string"):
        headlab.functions(model, tokenizer, SAMPLE_CONLLU, frequency_texts="a man")
    with pytest.raises(HeadlabError, match="no non-empty line"):
        headlab.importance(model, tokenizer, ["", "  "], measures="confidence")
    with pytest.raises(HeadlabError, match="has 2 lines but <targets> has 1"):
        headlab.importance(model, tokenizer, ["a", "b"], targets=["x"], measures="confidence")
    with pytest.raises(HeadlabError, match="unknown importance method"):
        headlab.importance(model, tokenizer, SENTENCES, measures=["nope"])
    with pytest.raises(HeadlabError, match="CoNLL-U file not found"):
        headlab.functions(model, tokenizer, "no/such.conllu")
    with pytest.raises(HeadlabError, match="^functions: limit must be at least 1, got 0"):
        headlab.functions(model, tokenizer, SAMPLE_CONLLU, limit=0)  # was "no sentence could be analysed"
    with pytest.raises(HeadlabError, match="^aggregate: max_length must be at least 2, got 1"):
        headlab.aggregate(model, tokenizer, SAMPLE_CONLLU, max_length=1)
    with pytest.raises(HeadlabError, match="CoNLL-U path is empty"):
        headlab.functions(model, tokenizer, "")
    with pytest.raises(HeadlabError, match="is a directory, not a CoNLL-U file"):
        headlab.functions(model, tokenizer, Path(__file__).parent)


def test_arguments_of_the_wrong_type_are_refused_clearly(setup):
    # Regression: each of these failed deep inside with a TypeError or AttributeError traceback
    import torch

    _, _, (model, tokenizer), _ = setup
    with pytest.raises(HeadlabError, match="^texts: expected a list of sentences, got NoneType"):
        headlab.importance(model, tokenizer, None, measures="confidence")
    with pytest.raises(HeadlabError, match="^texts: item 2 is int 7, not a string"):
        headlab.importance(model, tokenizer, ["a man", 7], measures="confidence")
    with pytest.raises(HeadlabError, match="<texts>: text 1 is a tuple, not a string .pairs of texts are for"):
        headlab.importance(model, tokenizer, [("a man", "a dog")], measures="confidence")
    with pytest.raises(HeadlabError, match="^targets: item 1 is NoneType"):
        headlab.analyze(model, tokenizer, ["a man"], targets=[None], measures="confidence")
    with pytest.raises(HeadlabError, match="^model: expected a transformers model .* got Linear"):
        headlab.importance(torch.nn.Linear(2, 2), tokenizer, SENTENCES, measures="confidence")
    with pytest.raises(HeadlabError, match="^model: expected a transformers model .* got Linear"):
        headlab.functions(torch.nn.Linear(2, 2), tokenizer, SAMPLE_CONLLU)
    with pytest.raises(HeadlabError, match="^model: expected a transformers model .* got Linear"):
        headlab.prune(torch.nn.Linear(2, 2), "enc_self:0:1")
    with pytest.raises(HeadlabError, match="^tokenizer: expected the model's tokenizer .* got NoneType"):
        headlab.analyze(model, None, SENTENCES, measures="confidence")
    with pytest.raises(HeadlabError, match="^prune: heads must be .* got 5"):
        headlab.prune(model, 5)
    with pytest.raises(HeadlabError, match="^prune: heads must be"):
        headlab.prune(model, {("enc_self", 0): 1})
    with pytest.raises(HeadlabError, match="^prune: kinds= goes with HeadScores"):
        headlab.prune(model, "enc_self:0:1", kinds=["dec_self"])  # the kinds were ignored: enc_self's head went
    # names separated by commas, as the command line takes them: one unknown name before (session 45)
    assert headlab.api._names("confidence, ablation", "measures") == ("confidence", "ablation")
    with pytest.raises(HeadlabError, match="unknown importance method 'ablaton'"):
        headlab.importance(model, tokenizer, SENTENCES, measures="confidence,ablaton")
    assert set(headlab.importance(model, tokenizer, SENTENCES[:2], measures="confidence,gradient").scores) >= {
        "confidence", "gradient"}
    # one statistic as a string, as measures="lrp": it was read letter by letter ("unknown statistic 'f'")
    tables = headlab.analyze(model, tokenizer, treebank=SAMPLE_CONLLU, statistics="aggregate",
                             attention_sentences=0).tables
    assert "mean_entropy" in tables and "positional_share" not in tables
    # nothing to compute: it returned an empty Analysis
    with pytest.raises(HeadlabError, match="^analyze: nothing to compute: measures is empty and no treebank"):
        headlab.analyze(model, tokenizer, SENTENCES, measures=(), attention_sentences=0)
    with pytest.raises(HeadlabError, match="^analyze: nothing to compute: no texts .* statistics is empty"):
        headlab.analyze(model, tokenizer, treebank=SAMPLE_CONLLU, statistics=(), attention_sentences=0)
    # the API's own argument is named, not the command's --limit
    with pytest.raises(HeadlabError, match="^analyze: treebank_limit must be at least 1, got 0"):
        headlab.analyze(model, tokenizer, treebank=SAMPLE_CONLLU, treebank_limit=0)
    with pytest.raises(HeadlabError, match="^analyze: limit must be at least 1, got 0"):
        headlab.analyze(model, tokenizer, SENTENCES, limit=0)


def test_top_heads_are_the_highest_scores_and_n_is_checked(setup):
    """Regression: top_heads(measure, -1) returned every head but the lowest (a slice), silently."""
    _, _, _, api = setup
    top = api.top_heads("confidence", 3)
    values = sorted((v for _, v in api["confidence"].items() if not math.isnan(v)), reverse=True)
    assert [value for _, value in top] == values[:3]
    assert api.top_heads("confidence", 0) == []
    for n in (-1, 1.5, True):
        with pytest.raises(HeadlabError, match="n must be an integer >= 0"):
            api.top_heads("confidence", n)


def test_tidy_records_and_pandas(setup, monkeypatch):
    _, _, _, api = setup
    records = api.records()
    assert set(records[0]) == {"model", "kind", "layer", "head", "measure", "value"}
    n_heads = {(r["kind"], r["layer"], r["head"]) for r in records}
    assert len(n_heads) == 3 * 2 * 4  # tiny marian: three kinds, 2 layers x 4 heads
    assert all(math.isfinite(r["value"]) for r in records)
    confidence = {(r["kind"], r["layer"], r["head"]): r["value"] for r in records if r["measure"] == "confidence"}
    assert confidence == dict(api["confidence"].items())
    monkeypatch.setitem(sys.modules, "pandas", None)  # pandas is optional: a clear error without it
    with pytest.raises(HeadlabError, match=r"pip install 'headlab\[pandas\]'"):
        api.to_pandas()
    with pytest.raises(HeadlabError, match="pandas"):
        api.heads()


def test_pandas_frames(setup):
    pandas = pytest.importorskip("pandas")
    _, cli, _, api = setup
    tidy = api.to_pandas()
    assert list(tidy.columns) == ["model", "kind", "layer", "head", "measure", "value"]
    wide = api.heads().drop(columns=["model", "run"])  # the run's own names (see _scores)
    cli_wide = pandas.read_csv(cli / "heads.csv", keep_default_na=False, na_values=[""]).drop(columns=["model", "run"])
    labels = [c for c in wide.columns if not pandas.api.types.is_numeric_dtype(wide[c])]  # "": no label
    cli_wide[labels] = cli_wide[labels].astype(object).fillna("")
    pandas.testing.assert_frame_equal(wide, cli_wide, check_dtype=False)


def test_save_and_load_round_trip_and_cli_directories_load(setup, tmp_path):
    root, cli, _, api = setup
    loaded = headlab.Analysis.load(cli)  # a directory written by `headlab analyze`
    assert _scores(loaded.heads_table()) == _scores(api.heads_table())
    assert loaded.model == "model" and loaded.heads_table()[1][0][:2] == [str(root / "model"), "cli"]
    api.save(tmp_path / "saved")
    again = headlab.Analysis.load(tmp_path / "saved")
    assert _scores(again.heads_table()) == _scores(api.heads_table()) and again.labels == api.labels
    assert _scores(_csv(tmp_path / "saved" / "heads.csv")) == _scores(_csv(cli / "heads.csv"))
    api.save(tmp_path / "saved", report=True, overwrite=True)  # the report opens it
    assert "<html" in (tmp_path / "saved" / "index.html").read_text(encoding="utf-8").lower()
    with pytest.raises(HeadlabError, match="overwrite=True"):
        api.save(tmp_path / "saved")
    (tmp_path / "saved" / "functions" / "stale.json").write_text(json.dumps(api["confidence"].to_json()))
    api.save(tmp_path / "saved", overwrite=True)  # replaced whole: nothing of the earlier one stays
    assert not (tmp_path / "saved" / "functions" / "stale.json").exists()
    assert not (tmp_path / "saved" / "index.html").exists() and (tmp_path / "saved" / "heads.csv").is_file()
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "thesis.tex").write_text("x")
    with pytest.raises(HeadlabError, match="did not write"):
        api.save(tmp_path / "foreign")
    with pytest.raises(HeadlabError, match="not an analysis directory"):
        headlab.Analysis.load(tmp_path / "foreign")
    with pytest.raises(HeadlabError, match="the directory path is empty"):  # was '.: not an analysis directory'
        headlab.Analysis.load("")


def test_save_over_another_commands_results_is_refused_with_overwrite_too(setup, tmp_path):
    """Regression: save(..., overwrite=True) into a directory written by `headlab prune apply` (or
    functions, importance: .headlab/files.json) took it for an earlier analysis and deleted the model."""
    root, _, (model, _tokenizer), api = setup
    pruned = tmp_path / "pruned"
    assert main(["prune", "apply", str(root / "model"), "--heads", "enc_self:0:1", "--out", str(pruned)]) == 0
    before = {p.name: p.read_bytes() for p in pruned.iterdir() if p.is_file()}
    for overwrite in (False, True):
        with pytest.raises(HeadlabError, match="holds the results of `headlab prune`"):
            api.save(pruned, overwrite=overwrite)
        with pytest.raises(HeadlabError, match="holds the results of `headlab prune`"):
            headlab.analyze(model, _tokenizer, SENTENCES, measures=["confidence"], out=pruned, overwrite=overwrite)
    assert {p.name: p.read_bytes() for p in pruned.iterdir() if p.is_file()} == before


def test_analyze_writes_out_like_the_cli(setup, tmp_path):
    root, cli, (model, tokenizer), _ = setup
    analysis = headlab.analyze(model, tokenizer, SENTENCES, treebank=SAMPLE_CONLLU, out=tmp_path / "run",
                               statistics=["aggregate"], measures=["confidence"])
    assert (tmp_path / "run" / "aggregate" / "exemplars.json").is_file()
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert [s["name"] for s in manifest["stages"]] == ["confidence", "aggregate", "attention"]
    index = json.loads((tmp_path / "run" / "attention" / "index.json").read_text())
    assert [e["treebank"] for e in index["sentences"]] == ["<conllu text>:1 (s1)", "<conllu text>:13 (s2)",
                                                           "<conllu text>:23 (s3)"]
    # without a treebank, the texts are shown
    plain = headlab.analyze(model, tokenizer, SENTENCES, measures=["confidence"], attention_sentences=2)
    shown = json.loads(plain.files["attention/index.json"])["sentences"]
    assert [e["source"] for e in shown] == SENTENCES[:2] and not any("treebank" in e for e in shown)
    assert "positional_share" not in analysis.tables and "mean_entropy" in analysis.tables
    with pytest.raises(HeadlabError, match="overwrite=True"):  # refused before any work: no texts needed
        headlab.analyze(model, tokenizer, ["x"], treebank="no/such.conllu", out=tmp_path / "run")


def _page(html: str) -> str:
    """The report page inside ``Analysis._repr_html_``'s frame (a base64 data: URL)."""
    import base64
    import re

    found = re.search(r'<iframe src="data:text/html;base64,([A-Za-z0-9+/=]+)"', html)
    assert found is not None, html[:300]
    return base64.b64decode(found.group(1)).decode("utf-8")


def _report_data(page: str) -> dict:
    import re

    found = re.search(r'<script type="application/json" id="headlab-data">(.*?)</script>', page, re.S)
    assert found is not None
    return json.loads(found.group(1))


def test_reprs_are_short_and_html_is_self_contained(setup):
    root, _, _, api = setup
    text = repr(api)
    assert "top by confidence" in text and "array(" not in text and len(text) < 1000
    html = api._repr_html_()
    assert html.startswith('<iframe src="data:text/html;base64,') and "<script" not in html
    assert len(html) < 300_000  # 220 kB on this model
    page = _page(html)
    # the report of `headlab analyze`, built from the held files; each build stamps its minute ("2026-11-29 05:37 UTC":
    # the two builds may straddle a minute, a CI run failed so)
    import re

    stamp = re.compile(r"\d{4}-\d{2}-\d{2} \d{2}:\d{2} UTC")
    assert stamp.sub("", page) == stamp.sub("", api.report_html())
    assert "default-src &#x27;none&#x27;" in page  # its Content-Security-Policy: nothing from the network
    import re

    assert not re.search(r"""(?:src|href)\s*=\s*["']?(?:https?:)?//""", page)  # nor any link to load from it
    data = _report_data(page)
    shown = {h["id"] for h in data["heatmaps"]}
    assert {"importance/confidence", "importance/lrp", "importance/gradient", "functions/positional/share",
            "aggregate/mean_entropy", "pos/NOUN"} <= shown
    # The viewer: the treebank's first 3 sentences (with their gold parse), every one inlined (the
    # frame has no file beside it).
    sentences = data["attention"]["sentences"]
    words = [" ".join(s.words) for s in read_conllu(root / "tb.conllu")]
    assert data["attention"]["mode"] == "inline" and [e["source"] for e in sentences] == words[:3]
    assert [e["treebank"] for e in sentences] == [f"{root / 'tb.conllu'}:{line} (s{n})"
                                                  for n, line in ((1, 1), (2, 13), (3, 23))]
    assert '"gold":{"side":"source"' in page
    assert all(f'id="headlab-attention-{i}"' in page for i in range(3)) and not any("script" in e for e in sentences)
    assert '<section id="viewer">' in page and '<section id="functions">' in page
    assert "No data for this section" in _page(headlab.Analysis()._repr_html_())  # an empty one shows as empty
    scores = api["confidence"]
    assert repr(scores).startswith("HeadScores(confidence") and "enc_self 2x4" in repr(scores)
    assert scores._repr_html_().count("<svg") == len(scores.kinds)


def test_notebook_html_shows_the_function_labels(setup, tmp_path):
    """A labelled head (here one written into labels.json) appears in the page's function table
    and in the report's data for the heatmaps' marks."""
    _, _, _, api = setup
    api.save(tmp_path / "run")
    labels = json.loads((tmp_path / "run" / "functions" / "labels.json").read_text())
    key = next(iter(labels))
    labels[key] = ["positional -1", "nsubj v->s"]
    (tmp_path / "run" / "functions" / "labels.json").write_text(json.dumps(labels))
    page = _page(headlab.Analysis.load(tmp_path / "run")._repr_html_())
    kind, layer, head = key.split(":")
    assert (f'data-head="{head}"><td>{kind}</td><td>{layer}</td><td>{head}</td><td>positional -1, nsubj v-&gt;s</td>'
            in page)
    assert _report_data(page)["labels"][key] == ["positional -1", "nsubj v->s"]


def test_notebook_html_escapes_corpus_text(tmp_path):
    """Corpus text with markup reaches the page escaped (in HTML) or \\u003c-escaped (in JSON)."""
    from support.report import IMG_SENTENCE, SCRIPT_SENTENCE, build_analysis_dir

    analysis = headlab.Analysis.load(build_analysis_dir(tmp_path / "hostile", long=False))
    html = analysis._repr_html_()
    page = _page(html)
    for hostile in (SCRIPT_SENTENCE, IMG_SENTENCE, "<script>window.__pwned=1</script>", "<img src=x"):
        assert hostile not in page and hostile not in html
    sources = [e["source"] for e in _report_data(page)["attention"]["sentences"]]
    assert SCRIPT_SENTENCE in sources and IMG_SENTENCE in sources  # shown, as text
    assert page.count("<script") == 2 + len(sources)  # the data, one per inlined sentence and report.js: no other


def test_notebook_html_is_bounded_at_32_by_32_heads(tmp_path, monkeypatch):
    """A 32 x 32-head analysis: the page stays under PAGE_LIMIT (a longer data: URL shows a blank
    frame in Chromium); attention sentences are held while they fit VIEWER_BYTES, then dropped
    from the page, last first, to fit; a page too large even without them is not embedded."""
    import headlab.api as api_module
    from support.report import build_large_dir

    directory = build_large_dir(tmp_path / "large", 32, 32, sentences=3, n_tokens=20)
    analysis = headlab.Analysis.load(directory)
    assert len(analysis._viewer_sentences()) == 1  # 550 kB a sentence at 32 x 32 x 20 x 20
    html = analysis._repr_html_()
    page = _page(html)
    assert len(page.encode()) <= api_module.PAGE_LIMIT and len(html) < 2 * 1024 * 1024  # measured: 1.04 / 1.39 MB
    assert len(_report_data(page)["heatmaps"]) >= 4 + 4 + 4 + 18  # measures, functions, aggregate, POS
    assert "shows 1 of the 3 example sentences" in html
    # The held sentence does not fit a smaller page: dropped, the maps stay.
    monkeypatch.setattr(api_module, "PAGE_LIMIT", len(page.encode()) - 1)
    smaller = _page(analysis._repr_html_())
    assert _report_data(smaller)["attention"]["sentences"] == [] and len(smaller) < len(page) - 500_000
    monkeypatch.setattr(api_module, "PAGE_LIMIT", 100_000)  # not even the maps
    fallback = analysis._repr_html_()
    assert fallback.startswith("<pre>Analysis of synthetic") and "save(directory, report=True)" in fallback


def test_notebook_html_says_why_long_sentences_are_not_shown(tmp_path, monkeypatch):
    """At 32 x 32 heads a 30-token sentence (1.2 MB) does not fit the notebook's viewer: the viewer
    says how many sentences are left out and why, not "No data for this section"."""
    import headlab.api as api_module
    from support.report import build_large_dir

    analysis = headlab.Analysis.load(build_large_dir(tmp_path / "long", 32, 32, sentences=3, n_tokens=30))
    assert analysis._viewer_sentences() == []
    html = analysis._repr_html_()
    page = _page(html)
    viewer = page[page.index('<section id="viewer">'):]
    viewer = viewer[: viewer.index("</section>")]
    assert "No data for this section" not in viewer
    expected = ("3 of the 3 example sentences of this analysis are not shown in this notebook view: 3 not held by the "
                "Analysis, whose viewer keeps at most 0.6 MB of attention data (the first of them, sentence 0 of 30 "
                "tokens, takes 1.23 MB of attention data")
    assert expected in viewer.replace("&#x27;", "'")
    assert _report_data(page)["attention"]["not_shown"].startswith(expected)  # the viewer's status line (report.js)
    assert "shows 0 of the 3 example sentences (its section says why" in html
    # held, then dropped to fit the page: said too
    short = headlab.Analysis.load(build_large_dir(tmp_path / "short", 32, 32, sentences=3, n_tokens=20))
    monkeypatch.setattr(api_module, "PAGE_LIMIT", len(short.report_html().encode()) - 1)
    note = _report_data(_page(short._repr_html_()))["attention"]["not_shown"]
    assert note.startswith("3 of the 3 example sentences") and "1 dropped, last first, to keep this page within" in note
    assert "2 not held by the Analysis" in note


def test_a_loaded_analysis_holds_the_first_sentences_that_fit(tmp_path, monkeypatch):
    """Analysis.load holds attention/index.json and its first sentences while they fit
    VIEWER_BYTES; save writes back those (the index trimmed to them); the caption counts the
    directory's sentences."""
    import headlab.api as api_module
    from support.report import build_large_dir

    directory = build_large_dir(tmp_path / "run", 4, 4, sentences=5, n_tokens=10)
    everything = headlab.Analysis.load(directory)
    assert everything._viewer_sentences() == [f"attention/sentence-{i:03d}.json" for i in range(5)]
    from headlab.report.build import json_for_script

    size = [len(json_for_script(json.loads(everything.files[f"attention/sentence-{i:03d}.json"]))) for i in range(3)]
    monkeypatch.setattr(api_module, "VIEWER_BYTES", size[0] + size[1] + size[2] - 1)  # as the report embeds them
    two = headlab.Analysis.load(directory)
    assert two._viewer_sentences() == ["attention/sentence-000.json", "attention/sentence-001.json"]
    assert "shows 2 of the 5 example sentences" in two._repr_html_()
    two.save(tmp_path / "saved")
    index = json.loads((tmp_path / "saved" / "attention" / "index.json").read_text())
    assert [e["file"] for e in index["sentences"]] == ["sentence-000.json", "sentence-001.json"]
    assert "shows 2 of the 5" in headlab.Analysis.load(tmp_path / "saved")._repr_html_()


def test_saving_onto_a_file_is_refused_and_keeps_it(setup, tmp_path):
    """Regression: Analysis.save(FILE) and analyze(out=FILE) replaced the user's file with the directory."""
    _, _, (model, tokenizer), api = setup
    notes = tmp_path / "notes.txt"
    notes.write_text("mine", encoding="utf-8")
    with pytest.raises(HeadlabError, match="notes.txt: exists and is not a directory"):
        api.save(notes)
    with pytest.raises(HeadlabError, match="notes.txt: exists and is not a directory"):
        headlab.analyze(model, tokenizer, SENTENCES, measures=["confidence"], statistics=(), out=notes)
    assert notes.read_text(encoding="utf-8") == "mine"


def test_saving_into_a_directory_a_running_command_writes_is_refused(setup, tmp_path):
    """Regression: save(DIR, overwrite=True) and analyze(out=DIR) took no notice of the lock of a
    `headlab analyze --out DIR` still running: they swapped the directory away under it, and the
    command went on writing its later stages into the API's results."""
    import socket
    import subprocess

    from headlab.lock import LOCK_FILE, _start_time

    _, _, (model, tokenizer), api = setup
    out = tmp_path / "run"
    api.save(out)
    before = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (out / LOCK_FILE).parent.mkdir(parents=True, exist_ok=True)
        (out / LOCK_FILE).write_text(json.dumps({"pid": sleeper.pid, "host": socket.gethostname(),
                                                 "pid_start": _start_time(sleeper.pid), "started": "2026-01-01"}))
        with pytest.raises(HeadlabError, match=f"is in use by another headlab run .pid {sleeper.pid}"):
            api.save(out, overwrite=True)
        with pytest.raises(HeadlabError, match="is in use by another headlab run"):
            headlab.analyze(model, tokenizer, SENTENCES, measures="confidence", out=out, overwrite=True)
        assert (out / LOCK_FILE).exists()
    finally:
        sleeper.kill()
        sleeper.wait()
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if ".headlab" not in p.parts) == \
        [name for name in before if ".headlab" not in name]
    api.save(out, overwrite=True)  # the lock of a run that is gone does not stop it


def test_analyze_into_a_directory_holds_its_lock_to_the_end(setup, tmp_path, monkeypatch):
    """Regression (qa6): analyze(out=DIR) took no lock, so two calls at once into DIR both wrote it
    (the last won) and the first could load the other's results. It now holds DIR/.headlab/lock, as
    `headlab analyze --out DIR` does, from before its work until it has read its results back, and
    leaves no trace of it in the results."""
    import headlab.api
    import headlab.importance.pipeline
    from headlab.lock import LOCK_FILE

    _, _, (model, tokenizer), _ = setup
    out = tmp_path / "out"
    seen = []
    run_importance, load = headlab.importance.pipeline.run_importance, headlab.api.Analysis.load

    def holder() -> object:
        return json.loads((out / LOCK_FILE).read_text())["pid"] if (out / LOCK_FILE).exists() else None

    def working(*args, **kwargs):
        seen.append(("work", holder()))
        return run_importance(*args, **kwargs)

    def loading(directory):
        seen.append(("load", holder()))
        return load(directory)

    monkeypatch.setattr(headlab.importance.pipeline, "run_importance", working)
    monkeypatch.setattr(headlab.api.Analysis, "load", staticmethod(loading))
    analysis = headlab.analyze(model, tokenizer, SENTENCES, measures="confidence", statistics=(), out=out)
    assert seen == [("work", os.getpid()), ("load", os.getpid())]
    assert not (out / ".headlab").exists() and "confidence" in analysis.tables
    headlab.analyze(model, tokenizer, SENTENCES, measures="confidence", statistics=(), out=out, overwrite=True)
    assert seen[2:] == [("work", os.getpid()), ("load", os.getpid())] and not (out / ".headlab").exists()


def test_a_pruned_directory_loaded_by_transformers_alone_is_refused(setup, tmp_path):
    """Regression: a directory written by `headlab prune`, loaded with transformers'
    from_pretrained(trust_remote_code=True) as the README shows, gave scores in the kept heads'
    own numbering: enc_self L0 H1 was the original head 3 and the pruned heads 1, 2 showed as
    6, 7 (NaN), without a word. A layer left with no head failed with "no head size attribute"."""
    import transformers

    root, _, (_, tokenizer), _ = setup
    for heads, said in (("enc_self:0:1,2", "was pruned by headlab and loaded without it: its heads have lost their "
                                           "original numbering"),
                        ("enc_self:0:*", "a layer pruned by headlab, loaded without headlab")):
        out = tmp_path / heads.replace(":", "-").replace("*", "all").replace(",", "")
        assert main(["prune", str(root / "model"), "--heads", heads, "--out", str(out)]) == 0
        plain = transformers.AutoModelForSeq2SeqLM.from_pretrained(out, trust_remote_code=True)
        with pytest.raises(HeadlabError, match=said):
            headlab.importance(plain, tokenizer, SENTENCES, measures="confidence")
        scores = headlab.importance(headlab.load_pruned(out), tokenizer, SENTENCES,
                                    measures="confidence").scores["confidence"]["enc_self"]
        assert math.isnan(scores[0][1]) and math.isnan(scores[0][2])  # the original numbering


def test_the_low_level_calls_refuse_a_pruned_directory_loaded_by_transformers_alone(setup, tmp_path):
    """Regression (qa6): mask_heads and capture_attention on a pruned directory loaded by
    transformers alone used the kept heads' own numbering (mask_heads({enc_self L0: [1]}) switched
    off the original head 3) without a word; they now refuse it as the analysis calls do."""
    import torch
    import transformers

    root, _, (_, tokenizer), _ = setup
    out = tmp_path / "pruned"
    assert main(["prune", str(root / "model"), "--heads", "enc_self:0:1,2", "--out", str(out)]) == 0
    plain = transformers.AutoModelForSeq2SeqLM.from_pretrained(out, trust_remote_code=True)
    said = "was pruned by headlab and loaded without it: its heads have lost their original numbering"
    with pytest.raises(HeadlabError, match=said):
        with headlab.mask_heads(plain, {("enc_self", 0): [1]}):
            pass
    with pytest.raises(HeadlabError, match=said):
        with headlab.capture_attention(plain):
            pass
    model = headlab.load_pruned(out)  # the original numbering: both work
    batch = tokenizer(SENTENCES[:1], return_tensors="pt")
    with torch.no_grad(), headlab.mask_heads(model, {("enc_self", 0): [0]}), headlab.capture_attention(model) as record:
        model(**batch, decoder_input_ids=batch["input_ids"][:, :2])
    assert ("enc_self", 0) in record


def test_the_summary_counts_the_heads_analysed_not_the_pruned_ones(setup):
    """Regression: the summary line counted a pruned head (listed in labels with no label) as an
    analysed head: "0 of 8 analysed heads" for a model with 4 heads left."""
    root, _, (_, tokenizer), _ = setup
    from headlab.loading import load_model

    model = load_model(str(root / "model"))
    headlab.prune(model, "enc_self:0:*")
    analysis = headlab.analyze(model, tokenizer, treebank=SAMPLE_CONLLU, statistics="functions", attention_sentences=0)
    assert sorted(analysis.labels) == [f"enc_self:1:{h}" for h in range(4)]  # the removed heads are not analysed
    assert repr(analysis).splitlines()[0].endswith(" of 4 analysed heads with a function")


def test_prune_by_spec_and_by_scores(setup):
    root, _, _, api = setup
    from headlab.loading import load_model

    model = load_model(str(root / "model"))
    kept = headlab.prune(model, "enc_self:0:1,2")
    assert kept[("enc_self", 0)] == [0, 3]
    model = load_model(str(root / "model"))
    kept = headlab.prune(model, api["confidence"], keep=14, kinds=["enc_self", "dec_self"])
    assert sum(len(v) for v in kept.values()) + sum(
        4 for kind in ("enc_self", "dec_self") for layer in range(2) if (kind, layer) not in kept) == 14
    with pytest.raises(HeadlabError, match="keep=N"):
        headlab.prune(model, api["confidence"])


def test_prune_warns_when_a_head_is_named_twice(setup, tmp_path):
    """Regression (resume31): headlab.prune with [1, 1] (meant: [1, 2]) removed one head without a word, where
    `headlab prune apply` notes it; the API now warns in the CLI's words (each head is still removed once)."""
    import json
    import warnings

    root = setup[0]
    from headlab.loading import load_model

    mask = tmp_path / "mask.json"
    mask.write_text(json.dumps({"enc_self": {"0": [1, 1]}}))
    for heads in ({("enc_self", 0): [1, 1]}, "enc_self:0:1,1", str(mask)):
        with pytest.warns(UserWarning, match="prune: heads names enc_self:0:1 more than once; each head is removed once"):
            kept = headlab.prune(load_model(str(root / "model")), heads)
        assert kept[("enc_self", 0)] == [0, 2, 3]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # heads named once: no warning
        headlab.prune(load_model(str(root / "model")), {("enc_self", 0): [1, 2]})


def test_prune_by_scores_of_a_pruned_model_keeps_the_best_heads():
    """Regression: scores number a pruned model's heads as the model did before pruning (NaN for
    the heads it lost), but prune(model, scores, keep=N) applied their numbers to the model's
    current numbering: with heads 0 and 3 of a layer kept, the least important head 3 went as
    'head 3' (refused) or, worse, original head 1 was taken for the current head 1 (original 2)."""
    import numpy as np

    from headlab.pruning.baselines import scores_spec

    for prune in (lambda model, scores: headlab.prune(model, scores, keep=3, kinds=["enc_self"]),
                  lambda model, scores: headlab.prune_heads(model, scores_spec(scores, 3, ["enc_self"], model))):
        model = tiny_model("marian")
        headlab.prune(model, "enc_self:0:1,2 enc_self:1:0")  # layer 0 keeps heads 0, 3; layer 1 heads 1, 2, 3
        values = np.array([[0.9, np.nan, np.nan, 0.8], [np.nan, 0.1, 0.7, 0.6]])  # as importance writes them
        scores = headlab.HeadScores({"enc_self": values}, "confidence", "m")
        prune(model, scores)
        assert headlab.surgery.pruning_record(model)["blocks"]["enc_self"] == {
            "0": {"n_heads": 4, "kept_heads": [0, 3], "kept_kv_heads": [0, 3]},
            "1": {"n_heads": 4, "kept_heads": [2], "kept_kv_heads": [2]}}
        # scores of the model before it was pruned: a head it lost is not among the N kept
        model = tiny_model("marian")
        headlab.prune(model, "enc_self:0:1,2 enc_self:1:0")
        full = headlab.HeadScores({"enc_self": np.array([[0.9, 0.95, 0.2, 0.8], [0.99, 0.1, 0.7, 0.6]])}, "c", "m")
        prune(model, full)
        assert headlab.surgery.pruning_record(model)["blocks"]["enc_self"]["1"]["kept_heads"] == [2]


def test_kinds_are_checked_and_a_string_is_a_comma_list(setup):
    """Regression: an unknown or absent kind scored nothing, silently (empty HeadScores), and a
    string was taken letter by letter (the signature's kinds, prune's keep=0 removing nothing)."""
    root, _, (model, tokenizer), api = setup
    from headlab.loading import load_model

    with pytest.raises(HeadlabError, match="unknown attention kind 'enc_cross'"):
        headlab.importance(model, tokenizer, SENTENCES, measures="confidence", kinds=("enc_cross",))
    with pytest.raises(HeadlabError, match="the model has no enc_self heads"):
        headlab.importance(tiny_model("gpt2"), None, SENTENCES, measures="confidence", kinds=["enc_self"])
    scores = headlab.importance(model, tokenizer, SENTENCES, measures="confidence",
                                kinds="enc_self,dec_cross").scores["confidence"]
    assert set(scores.kinds) == {"enc_self", "dec_cross"}
    assert scores.signature["options"]["kinds"] == ["enc_self", "dec_cross"]
    kept = headlab.prune(load_model(str(root / "model")), api["confidence"], keep=0, kinds="dec_cross")
    assert kept == {("dec_cross", 0): [], ("dec_cross", 1): []}


def test_the_verbs_are_callable_packages():
    """headlab.importance is both the API's function and the package (whichever was imported first)."""
    import headlab.importance.pipeline  # noqa: F401 - the submodule import sets headlab.importance

    assert callable(headlab.importance) and hasattr(headlab.importance, "run_importance")
    assert callable(headlab.functions) and hasattr(headlab.functions, "analyze_heads")
    assert callable(headlab.aggregate) and hasattr(headlab.aggregate, "AggregateStats")
    from headlab.api import analyze

    assert headlab.analyze is analyze  # the function, not the package of the pipeline (headlab.pipeline)
    assert {"analyze", "importance", "functions", "aggregate", "prune", "Analysis"} <= set(headlab.__all__)


def test_texts_data_equals_read_data(tmp_path, setup):
    """The in-memory path of the data layer gives read_data's ImportanceData, for a translation
    model (with references) and for a classifier (texts, pairs, labels by name or index)."""
    import transformers as tf

    from headlab.data.inputs import read_data, texts_data
    from headlab.model_description import describe_model
    from support.treebank import word_tokenizer

    _, _, (model, tokenizer), _ = setup
    info = describe_model(model, tokenizer)
    (tmp_path / "s.txt").write_text("\n".join(SENTENCES[:3] + [""]) + "\n", encoding="utf-8")
    (tmp_path / "t.txt").write_text("\n".join(GERMAN[:3] + ["x"]) + "\n", encoding="utf-8")
    from_file = read_data(tmp_path / "s.txt", tokenizer, info, target_path=tmp_path / "t.txt")
    in_memory = texts_data(SENTENCES[:3] + [""], tokenizer, info, targets=GERMAN[:3] + ["x"],
                           name=str(tmp_path / "s.txt"), target_name=str(tmp_path / "t.txt"))
    assert in_memory == from_file and in_memory.n_empty == 1

    words = "the cat sees a dog yes no".split()
    classifier_tokenizer = word_tokenizer(words, style="bert")
    classifier = tf.BertForSequenceClassification(tf.BertConfig(
        vocab_size=len(classifier_tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=37, max_position_embeddings=32, num_labels=2, id2label={0: "no", 1: "yes"},
        label2id={"no": 0, "yes": 1}))
    info = describe_model(classifier, classifier_tokenizer)
    (tmp_path / "c.tsv").write_text("text\tlabel\nthe cat sees a dog\tyes\na dog\t0\n", encoding="utf-8")
    from_file = read_data(tmp_path / "c.tsv", classifier_tokenizer, info)
    in_memory = texts_data(["the cat sees a dog", "a dog"], classifier_tokenizer, info, labels=["yes", 0])
    assert in_memory.sources == from_file.sources and in_memory.classes == from_file.classes == [1, 0]
    with pytest.raises(HeadlabError, match="one label per text"):
        texts_data(["a dog"], classifier_tokenizer, info)
    with pytest.raises(HeadlabError, match="holds a tab"):
        texts_data(["a\tdog"], classifier_tokenizer, info, labels=[0])
    with pytest.raises(HeadlabError, match="label 7 is outside"):
        texts_data(["a dog"], classifier_tokenizer, info, labels=[7])
    result = headlab.importance(classifier, classifier_tokenizer, ["the cat sees a dog", "a dog"], labels=[1, 0],
                                measures="confidence")
    assert result.scores["confidence"]["enc_self"].shape == (2, 4)


def test_a_bfloat16_model_gives_the_command_lines_numbers(setup, tmp_path):
    """Any dtype: the API on a model the user loaded in bfloat16 equals `analyze --dtype bfloat16`."""
    import torch

    from headlab.loading import load_model

    root, _, (_, tokenizer), _ = setup
    out = tmp_path / "cli"
    skip = ["--skip", ",".join([m for m in MEASURES if m != "confidence"] + ["agreement", "functions", "attention",
                                                                              "figures", "report"])]
    assert main(["analyze", str(root / "model"), "--source", str(root / "src.en"), "--conllu", str(root / "tb.conllu"),
                 "--out", str(out), "--no-progress", "--dtype", "bfloat16", *skip]) == 0
    model = load_model(str(root / "model"), dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16
    analysis = headlab.analyze(model, tokenizer, SENTENCES, treebank=root / "tb.conllu", measures=["confidence"],
                           statistics=["aggregate"])
    assert next(model.parameters()).dtype == torch.bfloat16  # the user's model is left as it was
    assert _scores(analysis.heads_table()) == _scores(headlab.Analysis.load(out).heads_table())


def test_the_command_keeps_its_name():
    """`python -m headlab analyze` is still the command (its package is headlab.pipeline, the name
    headlab.analyze the API's function)."""
    import os
    import subprocess
    from pathlib import Path

    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-m", "headlab", "analyze", "--help"], capture_output=True, text=True,
                         env=env, check=True)
    assert out.stdout.startswith("usage: headlab analyze")


def test_cli_viewer_shows_the_treebank_sentences_with_gold_arcs(setup, tmp_path):
    """``headlab analyze --conllu``: the attention stage stores the treebank's sentences, each with
    its gold parse; with ``--conllu-is-source`` the decoder is teacher-forced on sentence i's
    --target line (the reference), else on the model's translation."""
    root, _, _, _ = setup
    treebank_lines = [s.text for s in read_conllu(root / "tb.conllu")]
    (root / "tb.en").write_text("\n".join(treebank_lines) + "\n", encoding="utf-8")
    (root / "tb.de").write_text("\n".join(GERMAN[:4]) + "\n", encoding="utf-8")
    skip = ["--skip", "confidence,lrp,gradient,agreement,functions,aggregate,table,figures,report"]
    for out, extra in (("plain", []), ("paired", ["--conllu-is-source", "--target", str(root / "tb.de")])):
        assert main(["analyze", str(root / "model"), "--source", str(root / "tb.en"), "--conllu",
                     str(root / "tb.conllu"), "--out", str(tmp_path / out), "--no-progress",
                     "--attention-sentences", "2", *skip, *extra]) == 0
    plain = json.loads((tmp_path / "plain" / "attention" / "index.json").read_text())["sentences"]
    paired = json.loads((tmp_path / "paired" / "attention" / "index.json").read_text())["sentences"]
    assert [e["treebank"] for e in plain] == [f"{root / 'tb.conllu'}:1 (s1)", f"{root / 'tb.conllu'}:13 (s2)"]
    assert [e["target_from"] for e in plain] == ["translation"] * 2
    assert [(e["target_from"], e["target"]) for e in paired] == [("reference", GERMAN[0]), ("reference", GERMAN[1])]
    gold = json.loads((tmp_path / "paired" / "attention" / "sentence-000.json").read_text())["gold"]
    assert gold["words"] == list(next(iter(read_conllu(root / "tb.conllu"))).words) and len(gold["arcs"]) == 8
    manifest = json.loads((tmp_path / "plain" / "manifest.json").read_text())
    assert next(s for s in manifest["stages"] if s["name"] == "attention")["reason"].startswith("the treebank's")


def test_model_info_counts_a_head_the_checkpoint_lacks_as_absent():
    """headlab.api.model_info (which ``headlab importance`` calls): a model object with an LM head
    whose checkpoint was saved without one has no usable head, and ``log`` says why."""
    from headlab.api import model_info
    from support.models import tiny_model
    from support.treebank import word_tokenizer

    model, tokenizer = tiny_model("marian"), word_tokenizer(SENTENCES)
    assert model_info(model, tokenizer).has_lm_head
    model.config.architectures = ["MarianModel"]
    said: list[str] = []
    assert not model_info(model, tokenizer, log=said.append).has_lm_head
    assert said == ["the checkpoint was saved as MarianModel, without a language-model head"]


def test_analyze_engine_eager_is_the_reference(setup, monkeypatch):
    """``headlab.analyze(..., engine="eager")``, as ``headlab analyze --engine eager``: confidence,
    functions and aggregate on each block's whole map (no chunked stream), the default's numbers to
    float32 rounding; a bad engine is refused before any work."""
    import numpy as np

    import headlab.capture

    root, _, (model, tokenizer), api = setup
    streamed = []
    original = headlab.capture.stream_attention
    monkeypatch.setattr(headlab.capture, "stream_attention", lambda *a, **k: streamed.append(1) or original(*a, **k))
    for module in ("headlab.functions.analysis", "headlab.importance.confidence"):
        monkeypatch.setattr(f"{module}.stream_attention", headlab.capture.stream_attention)
    eager = headlab.analyze(model, tokenizer, SENTENCES, treebank=root / "tb.conllu", measures=["confidence"],
                            engine="eager", attention_sentences=0)
    assert not streamed
    for name in ("confidence", "positional_share", "mean_entropy", "mean_distance"):
        for kind in eager[name].kinds:
            np.testing.assert_allclose(eager[name][kind], api[name][kind], rtol=1e-5, atol=1e-6)
    with pytest.raises(HeadlabError, match="engine must be one of"):
        headlab.analyze(model, tokenizer, ["x"], engine="flash")
