"""`headlab functions` / `headlab aggregate` end to end on tiny saved models, with bad input."""

import json

import numpy as np
import pytest
from tokenizers import normalizers

from headlab.cli import main
from headlab.functions import AnalysisConfig, analyze_heads
from headlab.heads import HeadScores
from support.models import tiny_model
from support.treebank import SAMPLE_CONLLU, word_tokenizer

LONG = " ".join(["the", "old", "dog"] * 25)  # 75 words > the tiny model's 64 positions


def _long_sentence():
    words = LONG.split()
    lines = ["# sent_id = long"]
    for i, word in enumerate(words, start=1):
        head = 0 if i == 1 else 1
        lines.append(f"{i}\t{word}\t{word}\tNOUN\tNN\t_\t{head}\t{'root' if head == 0 else 'dep'}\t_\t_")
    return "\n".join(lines) + "\n"


BAD_LINE = "3\tdog\tdog\tNOUN\tNN\t_\t5\tnsubj"  # 8 columns
UNALIGNABLE = """# sent_id = hash
1\tCats\tcat\tNOUN\tNNS\t_\t2\tnsubj\t_\t_
2\tsleep\tsleep\tVERB\tVB\t_\t0\troot\t_\t_
3\t#\t#\tSYM\tNFP\t_\t2\tdep\t_\t_
"""


@pytest.fixture
def corpus(tmp_path):
    """The sample with a malformed line in s1, an unalignable sentence and an over-long one."""
    text = SAMPLE_CONLLU.replace("3\tdog\tdog\tNOUN\tNN\t_\t5\tnsubj\t_\t_", BAD_LINE, 1)
    text = text + "\n" + UNALIGNABLE + "\n" + _long_sentence()
    path = tmp_path / "corpus.conllu"
    path.write_text(text, encoding="utf-8")
    bad_line = text.splitlines().index(BAD_LINE) + 1
    hash_line = text.splitlines().index("# sent_id = hash") + 1
    return path, bad_line, hash_line


@pytest.fixture
def model_dir(tmp_path):
    words = [line.split("\t")[1] for line in SAMPLE_CONLLU.splitlines() if line and not line.startswith("#")]
    tokenizer = word_tokenizer(words + ["#"])
    tokenizer.backend_tokenizer.normalizer = normalizers.Replace("#", "")  # "#" gets no token
    path = tmp_path / "tiny-marian"
    tiny_model("marian").save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_functions_cli_reports_bad_input_and_loses_nothing_else(tmp_path, corpus, model_dir, capsys):
    conllu, bad_line, hash_line = corpus
    train = tmp_path / "train.txt"
    train.write_text("the old dog chased a red ball .\nthe dog sleep here .\n", encoding="utf-8")
    out = tmp_path / "out"
    code = main(["functions", str(model_dir), "--conllu", str(conllu), "--out", str(out), "--aggregate",
                 "--train-text", str(train), "--top-frequent", "3", "--no-progress", "--batch-size", "2",
                 "--relations", "nsubj,dobj,amod,advmod,csubj"])
    printed = capsys.readouterr().out
    assert code == 0
    assert f"{conllu}:{bad_line}: expected 10 tab-separated columns" in printed
    assert f"{conllu}:{hash_line}: sentence hash: word 3 '#' gets no subword" in printed
    assert "1 sentence truncated to 64 tokens" in printed
    summary = json.loads((out / "summary.json").read_text())
    report = summary["report"]
    assert report["n_sentences"] == 4  # s2, s3, s4 and the long one (cut to 63 words)
    assert report["problems"]["counts"] == {"malformed": 1, "unaligned": 1, "truncated": 1}
    table = json.loads((out / "syntactic" / "table1.json").read_text())["table"]
    assert [r["status"] for r in table if r["relation"] == "csubj"] == ["absent from the data"] * 2
    assert "| csubj | gov -> dep | 0 | absent from the data |" in (out / "syntactic" / "table1.md").read_text()
    share = HeadScores.load(out / "positional" / "share.json")
    assert share["enc_self"].shape == (2, 4) and not np.isnan(share["enc_self"]).any()
    for name in ("rare_tokens/rarest.json", "aggregate/variability.json", "aggregate/pos/NOUN.json",
                 "functions_enc_self.png", "aggregate_enc_self.png", "README.md"):
        assert (out / name).is_file(), name


def test_aggregate_cli(tmp_path, corpus, model_dir, capsys):
    conllu, _, _ = corpus
    out = tmp_path / "agg"
    assert main(["aggregate", str(model_dir), "--conllu", str(conllu), "--out", str(out), "--no-progress",
                 "--no-figures", "--top-k", "2", "--window", "5"]) == 0
    printed = capsys.readouterr().out
    assert "| mean_entropy | enc_self |" in printed
    assert not (out / "positional").exists()
    exemplars = json.loads((out / "aggregate" / "exemplars.json").read_text())
    assert len(exemplars["enc_self:0"]) == 4 and len(exemplars["enc_self:0"][0]) == 2


def test_cli_errors_are_clear(tmp_path, model_dir, capsys):
    assert main(["functions", str(model_dir), "--out", str(tmp_path / "o")]) == 2
    assert "give --conllu FILE" in capsys.readouterr().err
    assert main(["functions", str(model_dir), "--conllu", str(tmp_path / "none.conllu"),
                 "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    assert "none.conllu: no such file" in capsys.readouterr().err


def test_decoder_self_attention_with_target_parses(tmp_path, model_dir):
    from headlab.loading import load_model, load_tokenizer

    target = tmp_path / "target.conllu"
    target.write_text(SAMPLE_CONLLU, encoding="utf-8")
    source = tmp_path / "source.txt"
    source.write_text("the dog\nthe cat\nbirds sing\na zebra\n", encoding="utf-8")
    model, tokenizer = load_model(str(model_dir)), load_tokenizer(str(model_dir))
    analysis = analyze_heads(model, tokenizer, target_conllu=target, source_text=source,
                             config=AnalysisConfig(top_k=1))
    assert analysis.report.analysed == ["dec_self"]
    assert analysis.positional.share.kinds == ("dec_self",)
    assert analysis.aggregate.scores["mean_distance"].kinds == ("dec_self",)
    # Causal self-attention never looks ahead: no positive offset can be a maximum.
    counts = analysis.positional.counts[("dec_self", 0)]
    offsets = analysis.positional.offsets()
    assert counts[:, offsets > 0].sum() == 0 and counts.sum() > 0
    # A malformed target sentence drops its pair, not the pairing; extra source lines are reported.
    target.write_text(SAMPLE_CONLLU.replace("3\tdog\tdog\tNOUN\tNN\t_\t5\tnsubj\t_\t_", BAD_LINE), encoding="utf-8")
    source.write_text("the dog\nthe cat\nbirds sing\na zebra\none more\n", encoding="utf-8")
    paired = analyze_heads(model, tokenizer, target_conllu=target, source_text=source,
                           config=AnalysisConfig(aggregate=False))
    assert paired.report.n_sentences == 3
    assert paired.report.problems.counts == {"malformed": 1, "unpaired": 1}
    assert "has more sentences than" in str(paired.report.problems.problems[-1])
    # Both sides parsed: encoder and decoder analysed in one pass.
    target.write_text(SAMPLE_CONLLU, encoding="utf-8")
    both = analyze_heads(model, tokenizer, target, target_conllu=target, config=AnalysisConfig(aggregate=False))
    assert both.report.analysed == ["enc_self", "dec_self"]


@pytest.mark.parametrize("family,style,kind", [("bert", "bert", "enc_self"), ("gpt2", "gpt2", "dec_self")])
def test_single_stack_models(tmp_path, family, style, kind):
    path = tmp_path / "t.conllu"
    path.write_text(SAMPLE_CONLLU, encoding="utf-8")
    words = [line.split("\t")[1] for line in SAMPLE_CONLLU.splitlines() if line and not line.startswith("#")]
    tokenizer = word_tokenizer(words, style=style)
    analysis = analyze_heads(tiny_model(family), tokenizer, path, config=AnalysisConfig(top_k=1))
    assert analysis.report.analysed == [kind]
    assert analysis.report.n_words == 30
    assert not np.isnan(analysis.aggregate.scores["mean_entropy"][kind]).any()


@pytest.mark.parametrize("command", ["functions", "aggregate", "analyze"])
@pytest.mark.parametrize("bad", ["0", "-2"])
def test_query_chunk_below_one_is_a_usage_error(tmp_path, model_dir, command, bad, capsys):
    conllu = tmp_path / "tb.conllu"
    conllu.write_text(SAMPLE_CONLLU, encoding="utf-8")
    args = [command, str(model_dir), "--conllu", str(conllu), "--out", str(tmp_path / "out"), "--query-chunk", bad]
    if command == "analyze":
        args += ["--source", str(conllu)]
    assert main(args) == 2
    assert f"--query-chunk must be at least 1, got {bad}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize("registrable", [True, False])
def test_functions_cli_with_query_chunk_writes_what_eager_writes(tmp_path, model_dir, capsys, monkeypatch, caplog,
                                                                  registrable):
    """By default (the fused engine) and with --query-chunk the files are the eager reference's
    (--engine eager); a model whose attention cannot be registered runs the eager path instead and
    says so in the log, once: by default (an info of ``headlab.functions.analysis``), and under an
    explicit --engine chunked (a warning of ``headlab.capture``)."""
    import logging

    conllu = tmp_path / "tb.conllu"
    conllu.write_text(SAMPLE_CONLLU, encoding="utf-8")
    outputs = {}
    runs = (("eager", ["--engine", "eager"]), ("default", []), ("query_chunk", ["--query-chunk", "3"]),
            ("chunked", ["--engine", "chunked", "--query-chunk", "3"]))
    for name, extra in runs:
        if name == "default" and not registrable:
            import headlab.capture

            monkeypatch.setattr(headlab.capture, "dispatches", lambda module: False)
        out = tmp_path / name
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="headlab.functions.analysis"):
            assert main(["functions", str(model_dir), "--conllu", str(conllu), "--out", str(out), "--aggregate",
                         "--no-figures", "--no-progress", *extra]) == 0, capsys.readouterr().err
        fell_back = not registrable and name != "eager"
        # The CLI shows the note on stderr (Python's default would show warnings only).
        assert ("not the fused engine" in capsys.readouterr().err) == (fell_back and name != "chunked")
        assert ("falling back to eager capture" in caplog.text) == (fell_back and name == "chunked")
        assert caplog.text.count("not the fused engine") == (fell_back and name != "chunked")
        outputs[name] = out
    def results(directory):  # .headlab/files.json: the run's own bookkeeping (with its time)
        return sorted(p.relative_to(directory) for p in directory.rglob("*.json") if ".headlab" not in p.parts)

    files = results(outputs["eager"])
    for name in ("default", "query_chunk", "chunked"):
        assert files == results(outputs[name])
        for path in files:
            if path.name != "summary.json":  # summary.json holds the run's time and configuration
                _assert_json_close(json.loads((outputs[name] / path).read_text()),
                                   json.loads((outputs["eager"] / path).read_text()), str(path))


def _assert_json_close(a, b, where):
    """Same structure, same counts and positions; floats (the model runs in float32) to 1e-5."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_json_close(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_json_close(x, y, f"{where}/{i}")
    elif isinstance(a, float) and isinstance(b, float):
        assert abs(a - b) <= 1e-6 + 1e-5 * abs(b), (where, a, b)
    else:
        assert a == b, (where, a, b)


def test_word_pooling_and_sensitivity_options(tmp_path, model_dir, capsys):
    """--word-pooling changes the word-level results only (tokens and baselines stay); --sensitivity
    adds the interior positional share and the per-sentence rare-token files; the default run's
    summary.json keeps the options it always had."""
    conllu = tmp_path / "tb.conllu"
    conllu.write_text(SAMPLE_CONLLU, encoding="utf-8")
    train = tmp_path / "train.txt"
    train.write_text("the old dog chased a red ball .\nthe dog sleep here .\n", encoding="utf-8")
    outs = {}
    for pooling in ("sum", "max"):
        outs[pooling] = tmp_path / pooling
        extra = ["--word-pooling", pooling, "--sensitivity"] if pooling == "max" else []
        assert main(["functions", str(model_dir), "--conllu", str(conllu), "--out", str(outs[pooling]), "--no-progress",
                     "--no-figures", "--train-text", str(train), "--top-frequent", "3", *extra]) == 0
    capsys.readouterr()
    default, other = (json.loads((outs[p] / "summary.json").read_text()) for p in ("sum", "max"))
    assert "word_pooling" not in default["config"] and "sensitivity" not in default["config"]
    assert other["config"]["word_pooling"] == "max" and other["config"]["sensitivity"] is True
    for name in ("positional/interior_share.json", "rare_tokens/per_sentence.json", "rare_tokens/rarest_per_sentence.json"):
        assert (outs["max"] / name).is_file() and not (outs["sum"] / name).exists(), name
    for name in ("positional/token_share.json", "rare_tokens/rarest.json"):  # subword-token level: unchanged
        a, b = (HeadScores.load(outs[p] / name)["enc_self"] for p in ("sum", "max"))
        np.testing.assert_array_equal(a, b)
    tables = [json.loads((outs[p] / "syntactic" / "table1.json").read_text())["table"] for p in ("sum", "max")]
    assert [r["baseline"] for r in tables[0]] == [r["baseline"] for r in tables[1]]
    with pytest.raises(SystemExit) as exit_info:  # argparse: not a choice
        main(["functions", str(model_dir), "--conllu", str(conllu), "--out", str(tmp_path / "x"), "--word-pooling", "mean"])
    assert exit_info.value.code == 2 and "--word-pooling" in capsys.readouterr().err


@pytest.mark.parametrize("extra, named", [(["--window", "3"], "--window"),
                                          (["--top-k", "2", "--min-weight", "0.5"], "--min-weight, --top-k")])
def test_functions_refuses_options_of_the_aggregate_statistics_without_aggregate(extra, named, model_dir, tmp_path,
                                                                                  capsys, monkeypatch):
    """Regression: `headlab functions --window 3` (an option of the aggregate statistics, which run
    only with --aggregate) ran and wrote its results as if it had not been given, exit 0."""
    import headlab.loading

    monkeypatch.setattr(headlab.loading, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    conllu = tmp_path / "s.conllu"
    conllu.write_text(SAMPLE_CONLLU, encoding="utf-8")
    out = tmp_path / "o"
    assert main(["functions", str(model_dir), "--conllu", str(conllu), "--out", str(out), *extra]) == 2
    assert (f"{named}: {'options' if ',' in named else 'an option'} of the aggregate statistics, which run with "
            "--aggregate (or headlab aggregate)") in capsys.readouterr().err
    assert not out.exists()
