"""The HTML report without a browser: attention data round trip, escaping, missing stages."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch

from headlab.capture import capture_attention
from headlab.errors import HeadlabError
from headlab.report import build_report, load_example, write_attention_examples
from headlab.report.build import json_for_script
from headlab.report.examples import dequantize, quantize
from support.report import IMG_SENTENCE, SCRIPT_SENTENCE, SOURCES, TARGETS, build_analysis_dir, tiny_marian, tokenizer


@pytest.fixture(scope="module")
def analysis_dir(tmp_path_factory):
    return build_analysis_dir(tmp_path_factory.mktemp("report") / "analysis", long=False)




def test_quantisation_error_is_at_most_half_a_step():
    probs = np.random.default_rng(0).random((3, 5, 7))
    assert np.abs(dequantize(quantize(probs)) - probs).max() <= 0.5 / 255 + 1e-7
    assert quantize(np.array([0.0, 1.0, 1.2, -0.1])).tolist() == [0, 255, 255, 0]


def test_attention_examples_round_trip(tmp_path):
    model, tok = tiny_marian(), tokenizer()
    paths = write_attention_examples(model, tok, SOURCES, TARGETS, tmp_path / "attention", max_sentences=3)
    assert paths == ["attention/sentence-000.json", "attention/sentence-001.json", "attention/sentence-002.json",
                     "attention/index.json"]
    index = json.loads((tmp_path / "attention" / "index.json").read_text())
    assert [s["source"] for s in index["sentences"]] == SOURCES[:3]
    assert index["sentences"][1]["target_from"] == "reference"
    for n, (source, target) in enumerate(zip(SOURCES[:3], TARGETS[:3])):
        ids = tok(source)["input_ids"]
        start = model.config.decoder_start_token_id
        decoder = [start] + tok(text_target=target)["input_ids"][:-1]
        with torch.no_grad(), capture_attention(model) as record:
            model(input_ids=torch.tensor([ids]), decoder_input_ids=torch.tensor([decoder]))
        tokens, attention = load_example(tmp_path / "attention" / f"sentence-{n:03d}.json")
        assert tokens["source"] == tok.convert_ids_to_tokens(ids)
        assert tokens["target"] == tok.convert_ids_to_tokens(decoder)
        assert set(attention) == set(record) == {(k, l) for k in ("enc_self", "dec_self", "dec_cross") for l in (0, 1)}
        for key, probs in record.items():
            np.testing.assert_allclose(attention[key], probs[0].numpy(), atol=1 / 255)
    # the injected markup is one token, kept verbatim in the data (escaping is the report's job)
    tokens, _ = load_example(tmp_path / "attention" / "sentence-001.json")
    assert "<script>window.__pwned=1</script>" in tokens["source"]


def test_attention_examples_from_query_chunks_equal_the_eager_ones(tmp_path):
    """With ``query_chunk`` each chunk of headlab's own attention is quantised as it arrives: the
    stored files are those of the eager capture (every weight rounds to the same byte)."""
    model, tok = tiny_marian(), tokenizer()
    eager = write_attention_examples(model, tok, SOURCES, TARGETS, tmp_path / "eager" / "attention", max_sentences=2)
    chunked = write_attention_examples(model, tok, SOURCES, TARGETS, tmp_path / "chunked" / "attention",
                                       max_sentences=2, query_chunk=2)
    assert chunked == eager
    for path in eager:
        assert (tmp_path / "chunked" / path).read_text() == (tmp_path / "eager" / path).read_text()
    for bad in (0, -1):
        with pytest.raises(HeadlabError, match="--query-chunk must be at least 1"):
            write_attention_examples(model, tok, SOURCES, TARGETS, tmp_path / "bad", query_chunk=bad)


def test_attention_examples_skip_empty_lines_translate_without_targets_and_check_input(tmp_path):
    model, tok = tiny_marian(), tokenizer()
    paths = write_attention_examples(model, tok, ["", "the cat sat", "  ", "a dog"], None, tmp_path / "a", max_sentences=5)
    index = json.loads((tmp_path / "a" / "index.json").read_text())
    assert [s["line"] for s in index["sentences"]] == [2, 4]
    assert all(s["target_from"] == "translation" for s in index["sentences"])
    assert len(paths) == 3
    with pytest.raises(HeadlabError, match="2 targets"):
        write_attention_examples(model, tok, ["a", "b", "c"], ["x", "y"], tmp_path / "b")
    (tmp_path / "file").write_text("x")
    with pytest.raises(HeadlabError, match="not a directory"):
        write_attention_examples(model, tok, ["a"], None, tmp_path / "file")


def test_attention_examples_of_an_encoder_only_model(tmp_path):
    from support.models import tiny_model
    from support.treebank import word_tokenizer
    tok = word_tokenizer("the cat sat".split(), style="bert")
    write_attention_examples(tiny_model("bert"), tok, ["the cat sat"], None, tmp_path / "attention")
    tokens, attention = load_example(tmp_path / "attention" / "sentence-000.json")
    assert tokens == {"source": ["[CLS]", "the", "cat", "sat", "[SEP]"]}
    assert sorted(attention) == [("enc_self", 0), ("enc_self", 1)]
    assert attention[("enc_self", 0)].shape == (4, 5, 5)


def test_json_for_script_cannot_close_the_script_block():
    text = json_for_script({"s": "</script><script>alert(1)</script> & \u2028"})
    assert "<" not in text and ">" not in text and "&" not in text and "\u2028" not in text
    assert json.loads(text) == {"s": "</script><script>alert(1)</script> & \u2028"}


def test_json_for_script_writes_nan_as_null_and_keeps_escaping():
    """Regression: a NaN in the report's data (a score with no case) ended in a raw ValueError from
    json.dumps(allow_nan=False); now it is null as in write_json's files, and infinity is refused."""
    text = json_for_script({"s": "</script>", "score": float("nan")})
    assert "<" not in text and json.loads(text) == {"s": "</script>", "score": None}
    with pytest.raises(HeadlabError, match=r"the report's data\['score'\]: inf is infinite"):
        json_for_script({"score": float("inf")})


def test_report_escapes_corpus_and_manifest_text(analysis_dir):
    html = build_report(analysis_dir).read_text(encoding="utf-8")
    assert "<script>window.__pwned" not in html and "<img src=x" not in html and "<b>bold</b>" not in html
    assert "&lt;script&gt;" not in html  # corpus text is only in the JSON blocks, \u003c-escaped
    assert "\\u003cscript\\u003ewindow.__pwned=1\\u003c/script\\u003e" in html
    assert "tiny-marian &lt;fixture&gt;" in html and "Figure 1 &lt;test&gt;" in html
    # exactly the report's own scripts: one data block, one per sentence, one program
    scripts = re.findall(r"<script[^>]*>", html)
    assert scripts.count("<script>") == 1
    assert all(s == "<script>" or 'type="application/json"' in s for s in scripts)
    assert "Content-Security-Policy" in html and "http://" not in html.replace("http://www.w3.org/2000/svg", "")
    assert "https://" not in html


def test_report_sections_have_content(analysis_dir):
    html = build_report(analysis_dir).read_text(encoding="utf-8")
    data = json.loads(re.search(r'<script type="application/json" id="headlab-data">(.*?)</script>', html).group(1))
    groups = {h["group"] for h in data["heatmaps"]}
    assert groups == {"importance", "functions", "aggregate", "pos"}
    assert [h["name"] for h in data["heatmaps"] if h["group"] == "importance"] == ["confidence", "lrp", "gradient",
                                                                                   "ablation"]
    assert data["heatmaps"][0]["scores"]["enc_self"][1][3] is None  # NaN head
    assert data["attention"]["mode"] == "inline" and len(data["attention"]["sentences"]) == len(SOURCES)
    assert html.count('id="headlab-attention-') == len(SOURCES)
    for text in ("Syntactic heads (Table 1 analogue)", "positional -1", "all (23 heads)", "lam-0.05",
                 '<a href="figures/figure1.png">PNG</a>', "v → s"):
        assert text in html


def test_missing_stages_are_listed_with_reasons(tmp_path):
    directory = build_analysis_dir(tmp_path / "a", long=False, stages_missing=True)
    html = build_report(directory).read_text(encoding="utf-8")
    assert html.count("no --conllu given") >= 3  # stage table + functions and aggregate sections
    assert "model has no LM head &lt;needs one&gt;" in html
    assert "--prune not given" in html
    assert '<span class="status failed">failed</span>' in html


def test_report_of_an_empty_or_damaged_directory(tmp_path):
    html = build_report(tmp_path).read_text(encoding="utf-8")
    assert "manifest.json: not found" in html and "No data for this section" in html
    (tmp_path / "importance").mkdir()
    (tmp_path / "importance" / "lrp.json").write_text("{not json")
    (tmp_path / "importance" / "agreement.json").write_text('{"x": 1}')
    (tmp_path / "manifest.json").write_text('["not", "an object"]')
    (tmp_path / "attention").mkdir()
    (tmp_path / "attention" / "index.json").write_text('{"sentences": [{"id": 0, "file": "sentence-000.json"}]}')
    html = build_report(tmp_path).read_text(encoding="utf-8")
    assert "importance/lrp.json: line 1: invalid JSON" in html
    assert "no &#x27;spearman&#x27; or &#x27;matrix&#x27; table" in html
    assert "attention/sentence-000.json: unreadable" in html
    with pytest.raises(HeadlabError, match="no such directory"):
        build_report(tmp_path / "missing")


def test_large_attention_data_goes_to_script_files(analysis_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(analysis_dir, copy)
    from headlab.report.build import build_report as build

    html = build(copy, inline_limit=0).read_text(encoding="utf-8")
    assert 'id="headlab-attention-' not in html
    scripts = sorted(p.name for p in (copy / "attention").glob("*.js"))
    assert scripts == [f"sentence-{i:03d}.js" for i in range(len(SOURCES))]
    text = (copy / "attention" / "sentence-001.js").read_text()
    assert text.startswith("window.headlabAttention(1,") and "<" not in text


def test_templates_are_package_data():
    from importlib import resources

    names = {p.name for p in resources.files("headlab.report").joinpath("templates").iterdir()}
    assert {"report.js", "report.css", "viewer.html"} <= names
    from pathlib import Path

    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    package_data = pyproject.split("[tool.setuptools.package-data]", 1)[1].split("\n[", 1)[0]
    assert '"report/templates/*"' in package_data


def test_sentences_with_markup_are_kept(analysis_dir):
    index = json.loads((analysis_dir / "attention" / "index.json").read_text())
    assert SCRIPT_SENTENCE in [s["source"] for s in index["sentences"]]
    assert IMG_SENTENCE in [s["source"] for s in index["sentences"]]


def test_agreement_section_shows_the_measure_by_measure_matrix(tmp_path):
    """`analyze` without --ablation writes a matrix and no reference: the report shows the matrix
    (issue 15, defect 4), never "correlation with None" and an empty table."""
    (tmp_path / "importance").mkdir()
    document = {"measures": ["confidence", "lrp", "gradient"], "columns": ["enc_self", "all"],
                "n_heads": {"enc_self": 8, "all": 8},
                "matrix": {"enc_self": [[1.0, 0.25, -0.5], [0.25, 1.0, None], [-0.5, None, 1.0]],
                           "all": [[1.0, 0.25, -0.5], [0.25, 1.0, None], [-0.5, None, 1.0]]},
                "reference": None, "metric": "", "spearman": {}}
    (tmp_path / "importance" / "agreement.json").write_text(json.dumps(document))
    html = build_report(tmp_path).read_text(encoding="utf-8")
    section = html[html.index('<section id="agreement">'):]
    section = section[:section.index("</section>")]
    assert "None" not in section and "No data for this section" not in section
    assert "<h3>all heads (8 heads)</h3>" in section and "<h3>enc_self (8 heads)</h3>" in section
    rows = re.findall(r"<tr><td>(\w+)</td>(.*?)</tr>", section)
    assert [name for name, _ in rows[:3]] == ["confidence", "lrp", "gradient"]
    assert re.findall(r'<span class="num">([^<]+)</span>|n/a', rows[1][1]) == ["+0.25", "+1.00", ""]
    overview = _section(html, "overview")  # the first screen: each pair once, over all heads
    assert 'confidence / lrp <span class="num">+0.25</span>' in overview and "lrp / gradient n/a" in overview
    # With ablation the table against the reference follows the matrix.
    document.update(reference="ablation", metric="loss",
                    spearman={"confidence": {"enc_self": 0.5, "all": 0.5}})
    (tmp_path / "importance" / "agreement.json").write_text(json.dumps(document))
    html = build_report(tmp_path).read_text(encoding="utf-8")
    assert "correlation of each measure with ablation (loss)" in html and "<h3>all heads (8 heads)</h3>" in html
    # a matrix that holds ablation too (as `analyze --ablation` writes it): each pair once on the overview
    document["measures"] = ["confidence", "lrp", "ablation"]
    (tmp_path / "importance" / "agreement.json").write_text(json.dumps(document))
    overview = _section(build_report(tmp_path).read_text(encoding="utf-8"), "overview")
    assert overview.count("confidence / ablation") == 1 and overview.count(" / ") == 3


def _section(html: str, name: str) -> str:
    section = html[html.index(f'<section id="{name}">'):]
    return section[:section.index("</section>")]


def _data(html: str) -> dict:
    return json.loads(re.search(r'<script type="application/json" id="headlab-data">(.*?)</script>', html).group(1))


def test_function_table_lists_only_labelled_heads(analysis_dir):
    """labels.json lists every analysed head, most with an empty list: the table used to list
    them all (384 rows for 2 labelled heads on a 24 x 16 model)."""
    labels = json.loads((analysis_dir / "functions" / "labels.json").read_text())
    assert len(labels) == 24 and sum(bool(v) for v in labels.values()) == 3
    html = build_report(analysis_dir).read_text(encoding="utf-8")
    rows = re.findall(r'<tr class="head-link"[^>]*data-kind="(\w+)" data-layer="(\d)" data-head="(\d)"',
                      _section(html, "functions"))
    assert rows == [("enc_self", "0", "1"), ("enc_self", "1", "2"), ("dec_cross", "1", "2")]
    assert set(_data(html)["labels"]) == {"enc_self:0:1", "enc_self:1:2", "dec_cross:1:2"}


def test_overview_ranks_heads_by_each_measure(analysis_dir):
    from headlab.heads import HeadScores

    html = build_report(analysis_dir).read_text(encoding="utf-8")
    overview = _section(html, "overview")
    assert html.index('<section id="overview">') < html.index('<section id="summary">')  # the first screen
    header = re.search(r'<table class="top-heads"><thead><tr>(.*?)</tr>', overview).group(1)
    assert re.findall(r"<th>(.*?)</th>", header)[0] == "rank" and len(re.findall(r"<th>", header)) == 5
    body = re.search(r'<table class="top-heads">.*?<tbody>(.*?)</tbody>', overview).group(1)
    rows = re.findall(r"<tr>(.*?)</tr>", body)
    assert len(rows) == 10  # TOP_N of the 23 scored heads
    for column, measure in enumerate(("confidence", "lrp", "gradient", "ablation")):
        scores = HeadScores.load(analysis_dir / "importance" / f"{measure}.json")
        expected = sorted(((float(v), kind, layer, head) for kind in scores.kinds
                           for (layer, head), v in np.ndenumerate(scores[kind]) if np.isfinite(v)),
                          key=lambda t: (-t[0], ("enc_self", "dec_self", "dec_cross").index(t[1]), t[2], t[3]))[:10]
        shown = [re.findall(r'data-kind="(\w+)" data-layer="(\d+)" data-head="(\d+)"', re.findall(
            r"<td>(.*?)</td>", row)[column + 1])[0] for row in rows]
        assert shown == [(k, str(layer), str(h)) for _, k, layer, h in expected]
    assert 'positional -1</span>' in overview or "nsubj v→s" in overview or "rare" in overview
    assert "confidence / ablation" in overview and "lrp / ablation" in overview  # agreement with the reference
    chart = re.search(r'<svg class="chart pruning-curve".*?</svg>', overview).group(0)
    assert chart.count("<circle") == 1 and 'class="reference"' in chart  # the sweep point and the full model


def test_overview_of_a_directory_without_results(tmp_path):
    html = build_report(tmp_path).read_text(encoding="utf-8")
    assert "No importance, agreement or pruning results" in _section(html, "overview")


def test_figures_are_linked_not_embedded(analysis_dir):
    html = build_report(analysis_dir).read_text(encoding="utf-8")
    assert "data:image/png" not in html and "<img" not in html
    figures = _section(html, "figures")
    assert '<a href="figures/figure1.png">PNG</a>' in figures and "Figure 1 &lt;test&gt;" in figures


def test_per_layer_curves_are_the_mean_over_heads(analysis_dir):
    from headlab.heads import HeadScores

    html = build_report(analysis_dir).read_text(encoding="utf-8")
    aggregate = _section(html, "aggregate")
    for name in ("mean_distance", "dependency_alignment", "mean_entropy"):
        chart = re.search(rf'<svg class="chart layer-curve {name}".*?</svg>', aggregate).group(0)
        scores = HeadScores.load(analysis_dir / "aggregate" / f"{name}.json")
        for kind in ("enc_self", "dec_self", "dec_cross"):
            shown = [float(v) for v in re.findall(rf"<title>{kind}: layer \d+, ([-\d.e]+)</title>", chart)]
            np.testing.assert_allclose(shown, np.nanmean(scores[kind], axis=1), rtol=1e-3)
    grid = re.search(r'<table class="pos-grid" data-kind="enc_self">.*?</table>', aggregate).group(0)
    noun = HeadScores.load(analysis_dir / "aggregate" / "pos" / "NOUN.json")["enc_self"]
    shown = [float(v) for v in re.findall(r'title="NOUN, layer \d: ([\d.]+)"', grid)]
    np.testing.assert_allclose(shown, np.nanmean(noun, axis=1), atol=5e-4)


def test_exemplars_are_embedded_compactly(analysis_dir):
    from support.report import EXEMPLARS

    data = _data(build_report(analysis_dir).read_text(encoding="utf-8"))["exemplars"]
    assert len(data["sentences"]) == 4  # each sentence once (the 4th exemplar of a head is not embedded)
    for block, heads in EXEMPLARS.items():
        for head, items in enumerate(heads):
            shown = data["heads"][block][head]
            assert len(shown) == 3
            for (weight, slot, query, key), item in zip(shown, items):
                assert weight == pytest.approx(item["weight"]) and (query, key) == (item["query"], item["key"])
                words = data["sentences"][slot]
                assert " ".join(words) == item["text"]
                assert words[query] == item["query_word"] and words[key] == item["key_word"]


def test_a_directory_written_before_the_redesign_still_opens(analysis_dir, tmp_path):
    """No exemplars.json, no offset map, labels.json with labelled heads only, aggregate under
    functions/: the report builds, and says nothing is missing where nothing was expected."""
    old = tmp_path / "old"
    shutil.copytree(analysis_dir, old)
    (old / "aggregate" / "exemplars.json").unlink()
    (old / "functions" / "positional" / "offset.json").unlink()
    labels = {k: v for k, v in json.loads((old / "functions" / "labels.json").read_text()).items() if v}
    (old / "functions" / "labels.json").write_text(json.dumps(labels))
    shutil.move(str(old / "aggregate"), str(old / "functions" / "aggregate"))
    html = build_report(old).read_text(encoding="utf-8")
    data = _data(html)
    assert data["exemplars"] is None and 'id="exemplars"' not in html
    assert len(data["labels"]) == 3
    assert "layer-curve mean_distance" in html and 'class="pos-grid"' in html
    assert "unreadable" not in html


def test_attention_beyond_the_inline_budget_is_loaded_on_demand(analysis_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(analysis_dir, copy)
    sizes = [len(json_for_script(json.loads(p.read_text())))
             for p in sorted((copy / "attention").glob("sentence-*.json"))]
    html = build_report(copy, inline_limit=sizes[0] + sizes[1]).read_text(encoding="utf-8")
    data = _data(html)
    assert data["attention"]["mode"] == "mixed"
    assert html.count('id="headlab-attention-') == 2
    assert [s.get("script") for s in data["attention"]["sentences"]] == \
        [None, None] + [f"attention/sentence-{i:03d}.js" for i in range(2, len(SOURCES))]


def test_chart_ticks_never_repeat_a_label():
    """A loss curve from 2.000 to 2.008 used to read "2", "2" on its axis."""
    from headlab.markup import tick_label as _tick_label
    from headlab.markup import ticks as _ticks

    for lo, hi in ((1.9995, 2.0083), (0.0, 1.0), (128.0, 512.0), (0.1, 0.73), (0.0, 31.0)):
        labels = [_tick_label(t) for t in _ticks(lo, hi, 4)]
        assert len(set(labels)) == len(labels) >= 2


def test_layer_curve_ticks_name_the_layers_under_their_points():
    """Regression: a one-layer model's per-layer chart read -1, 0, 1 under its one point (the axis
    was padded by a whole layer each side). Each tick sits under the point of its layer, numbered
    as the tables number layers (from 0)."""
    from headlab.markup import layer_means, line_chart

    for n_layers in (1, 2, 3, 12):
        heatmap = {"scores": {"enc_self": [[0.1 * layer, 0.2] for layer in range(n_layers)]}}
        chart = line_chart(layer_means(heatmap), "layer", "words", "layer-curve x", "t", integer_x=True)
        ticks = {float(label): float(x) for x, label in re.findall(r'<text x="([\d.]+)" y="[\d.]+" '
                                                                    r'text-anchor="middle">(-?[\d.]+)</text>', chart)}
        points = {int(layer): float(x) for x, layer in re.findall(r'<circle cx="([\d.]+)".*?layer (\d+),', chart)}
        assert set(ticks) <= set(points) and 0 in ticks and (n_layers - 1 in ticks or n_layers > 6)
        assert all(ticks[t] == points[int(t)] for t in ticks)


HOSTILE_CONLLU = """\
# sent_id = <b>x</b>
1\tThe\tthe\tDET\tDT\t_\t2\tdet\t_\t_
2\t<script>window.__pwned=3</script>\tx\tNOUN\tNN\t_\t3\tnsubj\t_\t_
3\tsleeps\tsleep\tVERB\tVBZ\t_\t0\troot\t_\t_
"""


def test_gold_arcs_map_word_heads_to_the_displayed_tokens(tmp_path):
    """Word-level gold heads become arcs between the words' first tokens; special tokens belong to
    no word; a word cut off by truncation takes its arcs with it."""
    from headlab.report.examples import gold_arcs
    from support.treebank import sample_sentences

    sentence = sample_sentences(tmp_path)[0]  # The old dog quickly chased a red ball .
    # [CLS] The old dog(2 tokens) quickly chased a red ball . [SEP]
    word_of_token = [-1, 0, 1, 2, 2, 3, 4, 5, 6, 7, 8, -1]
    gold = gold_arcs(sentence, word_of_token)
    assert gold["spans"] == [[1, 1], [2, 2], [3, 4], [5, 5], [6, 6], [7, 7], [8, 8], [9, 9], [10, 10]]
    assert gold["arcs"] == [[1, 3, "det"], [2, 3, "amod"], [3, 6, "nsubj"], [5, 6, "advmod"], [7, 9, "det"],
                            [8, 9, "amod"], [9, 6, "obj"], [10, 6, "punct"]]
    assert gold["root"] == [6] and gold["n_arcs"] == 8 and gold["where"].endswith(":1 (s1)")
    assert gold["words"] == list(sentence.words) and gold["deprels"][2] == "nsubj"
    # truncated after "quickly": the arcs into or out of words 4.. are dropped, the root too
    cut = gold_arcs(sentence, [-1, 0, 1, 2, 2, 3, -1])
    assert cut["arcs"] == [[1, 3, "det"], [2, 3, "amod"]] and cut["root"] == [] and cut["spans"][4] is None
    json.dumps(gold)  # JSON as it is


def test_treebank_examples_carry_the_gold_parse(tmp_path):
    """write_treebank_examples: the treebank's sentences (subword-tokenized as the head functions
    tokenize them), each with its gold arcs on the stored tokens; markup in the treebank reaches
    the report only escaped."""
    from headlab.data.alignment import align_sentences
    from headlab.data.treebank import InMemoryTreebank, read_conllu
    from headlab.report.examples import gold_arcs, write_treebank_examples
    from support.treebank import SAMPLE_CONLLU, TREEBANK_TEXTS, bpe_tokenizer

    tok = bpe_tokenizer(TREEBANK_TEXTS + ["The sleeps <script>window.__pwned=3</script>"])
    sentences = list(read_conllu(InMemoryTreebank(SAMPLE_CONLLU + "\n" + HOSTILE_CONLLU, "tb.conllu")))
    out = tmp_path / "analysis"
    paths = write_treebank_examples(tiny_marian(), tok, sentences, None, out / "attention", max_sentences=10)
    assert paths[-1] == "attention/index.json" and len(paths) == 6
    index = json.loads((out / "attention" / "index.json").read_text())
    assert [e["treebank"] for e in index["sentences"]][:2] == ["tb.conllu:1 (s1)", "tb.conllu:13 (s2)"]
    assert [e["source"] for e in index["sentences"]][0] == "The old dog quickly chased a red ball ."
    assert index["skipped"] == [] and all(e["target_from"] == "translation" for e in index["sentences"])
    for n, sentence in enumerate(sentences):
        payload = json.loads((out / "attention" / f"sentence-{n:03d}.json").read_text())
        aligned = align_sentences(tok, [sentence.words])[0]
        assert payload["tokens"]["source"] == tok.convert_ids_to_tokens(list(aligned.input_ids))
        assert payload["gold"] == gold_arcs(sentence, aligned.word_of_token.tolist())
        assert len(payload["gold"]["arcs"]) == payload["gold"]["n_arcs"] == len(sentence) - 1
    assert any(len(set(map(tuple, filter(None, json.loads((out / "attention" / f"sentence-{n:03d}.json")
                                                          .read_text())["gold"]["spans"])))) for n in range(4))
    page = build_report(out).read_text(encoding="utf-8")
    assert "<script>window.__pwned=3</script>" not in page and "<b>x</b>" not in page
    assert "\\u003cscript\\u003ewindow.__pwned=3\\u003c/script\\u003e" in page


def test_treebank_sentences_that_cannot_be_aligned_are_listed(tmp_path):
    """A sentence the tokenizer cannot align is left out, and index.json says where and why; a
    place kept by a malformed sentence (None) is skipped; the line is the sentence's place."""
    from dataclasses import replace

    from headlab.data.treebank import InMemoryTreebank, read_conllu
    from headlab.report.examples import write_treebank_examples
    from support.treebank import SAMPLE_CONLLU, word_tokenizer

    sentences = list(read_conllu(InMemoryTreebank(SAMPLE_CONLLU, "tb.conllu")))
    tok = word_tokenizer([w for s in sentences for w in s.words])
    broken = replace(sentences[2], words=("Birds", "", "and", "fish", "swim", "."))  # an empty word: no token
    write_treebank_examples(tiny_marian(), tok, [sentences[0], None, broken, sentences[1]], None, tmp_path / "attention",
                            max_sentences=5)
    index = json.loads((tmp_path / "attention" / "index.json").read_text())
    assert [e["line"] for e in index["sentences"]] == [1, 4]
    assert index["skipped"] == [{"where": "tb.conllu:23 (s3)", "reason": "word 2 '' gets no subword from the tokenizer"}]


def test_viewer_sentences_are_cut_to_max_length_as_the_statistics_cut_them(tmp_path):
    """``max_length`` (``--max-length``) reaches the viewer's sentences: they used to be cut at the
    model's limit only, so the viewer could show attention over tokens the statistics never saw."""
    from headlab.data.treebank import InMemoryTreebank, read_conllu
    from headlab.report.examples import write_treebank_examples
    from support.treebank import SAMPLE_CONLLU, TREEBANK_TEXTS, bpe_tokenizer

    model, tok = tiny_marian(), tokenizer()
    write_attention_examples(model, tok, SOURCES, TARGETS, tmp_path / "a" / "attention", max_sentences=3, max_length=4)
    lengths = [len(load_example(p)[0]["source"]) for p in sorted((tmp_path / "a" / "attention").glob("sentence-*.json"))]
    assert lengths and max(lengths) == 4
    sentences = list(read_conllu(InMemoryTreebank(SAMPLE_CONLLU, "tb.conllu")))
    write_treebank_examples(model, bpe_tokenizer(TREEBANK_TEXTS), sentences, None, tmp_path / "t" / "attention",
                            max_sentences=2, max_length=5)
    payload = json.loads((tmp_path / "t" / "attention" / "sentence-000.json").read_text())
    assert len(payload["tokens"]["source"]) <= 5 and None in payload["gold"]["spans"]


def test_a_file_of_a_done_stage_that_is_missing_is_noted_in_its_section(analysis_dir, tmp_path):
    """Regression: a file that manifest.json lists as an output of a done stage, deleted or not
    copied with the directory, was read as never computed: the importance section showed the other
    measures' heatmaps and left LRP's out without a word (so did the aggregate section)."""
    directory = tmp_path / "copy"
    shutil.copytree(analysis_dir, directory)  # its manifest lists each stage's files, as analyze's does
    html = build_report(directory).read_text(encoding="utf-8")
    assert "recorded as done" not in html  # every file there: nothing to say
    (directory / "importance" / "lrp.json").unlink()
    shutil.rmtree(directory / "aggregate")
    html = build_report(directory).read_text(encoding="utf-8")
    assert ("stage lrp is recorded as done, but 1 file it wrote is missing from the directory: "
            "importance/lrp.json") in _section(html, "importance")
    assert ("stage aggregate is recorded as done, but 7 files it wrote are missing from the directory: "
            "aggregate/dependency_alignment.json, aggregate/exemplars.json, aggregate/mean_distance.json, "
            "aggregate/mean_entropy.json (+3 more)") in _section(html, "aggregate")
    assert "lrp" not in {h["name"] for h in _data(html)["heatmaps"]}


def test_the_notebook_page_says_which_files_are_missing_and_not_those_it_does_not_hold(analysis_dir, tmp_path):
    """An Analysis holds no figures, heads.csv or pruning results: its page does not call them
    missing; a file of a done stage missing from the directory it was loaded from, it does, and
    so does the Analysis (Regression: its LRP table was left out without a word)."""
    import headlab

    directory = tmp_path / "copy"
    shutil.copytree(analysis_dir, directory)
    manifest = json.loads((directory / "manifest.json").read_text(encoding="utf-8"))
    manifest["stages"] += [{"name": "table", "status": "done", "reason": None, "seconds": 1.0, "outputs": ["heads.csv"]}]
    assert next(s for s in manifest["stages"] if s["name"] == "lrp")["outputs"] == ["importance/lrp.json"]
    (directory / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    (directory / "heads.csv").write_text("model,run\n", encoding="utf-8")
    analysis = headlab.Analysis.load(directory)
    assert "recorded as done" not in analysis.report_html() and "lrp" not in analysis.skipped
    (directory / "importance" / "lrp.json").unlink()
    analysis = headlab.Analysis.load(directory)
    page = analysis.report_html()
    assert page.count("recorded as done") == 1
    assert "stage lrp is recorded as done, but 1 file it wrote is missing from the directory: importance/lrp.json" in page
    assert analysis.skipped["lrp"] == (f"recorded as done in manifest.json, but importance/lrp.json is missing from "
                                       f"{directory}")
    assert "skipped lrp: recorded as done" in repr(analysis)


def test_files_of_a_stage_the_manifest_does_not_list_as_done_are_left_out_and_said(analysis_dir, tmp_path):
    """Regression: the report drew every file in the directory, those of a stage that manifest.json
    lacks (a run killed in it) or records as failed among them: LRP's map, the sweep and the
    aggregate section's exemplars appeared as results. Now each such stage's files are left out,
    and its section says which and why."""
    directory = tmp_path / "copy"
    shutil.copytree(analysis_dir, directory)
    manifest = json.loads((directory / "manifest.json").read_text(encoding="utf-8"))
    manifest["stages"] = [s for s in manifest["stages"] if s["name"] not in ("lrp", "aggregate")]
    for stage in manifest["stages"]:
        if stage["name"] == "prune":
            stage.update(status="failed", reason="boom", outputs=[])
    (directory / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    html = build_report(directory).read_text(encoding="utf-8")
    data = _data(html)
    assert "lrp" not in {h["name"] for h in data["heatmaps"]} and "confidence" in {h["name"] for h in data["heatmaps"]}
    assert not [h for h in data["heatmaps"] if h["group"] in ("aggregate", "pos")] and data["exemplars"] is None
    assert "stage lrp: 1 file (importance/lrp.json) left out, from a run that did not finish the stage" in \
        _section(html, "importance")
    assert ("stage aggregate: 7 files (aggregate/dependency_alignment.json, aggregate/exemplars.json, "
            "aggregate/mean_distance.json (+4 more)) left out") in _section(html, "aggregate")
    assert ("stage prune: 1 file (prune/sweep.json) left out, not results of this run (manifest.json records the "
            "stage as failed)") in _section(html, "pruning")
    assert "lam-0.05" not in _section(html, "pruning")


def test_the_stage_folders_are_those_analyze_writes():
    """The readers' stage folders (headlab.report.vouched) are the pipeline's."""
    from headlab.pipeline.pipeline import STAGE_DIRS
    from headlab.report.vouched import AREAS, stage_of

    assert {name: name for name in AREAS} == STAGE_DIRS
    assert [stage_of(p) for p in ("importance/gradient_raw.json", "importance/agreement.md", "aggregate/pos/_.json",
                                  "functions/positional/share.json", "heads.csv", "importance")] == \
        ["gradient", "agreement", "aggregate", "functions", None, None]
