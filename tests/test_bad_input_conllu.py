"""Bad-input catalogue, treebanks: each kind of malformed CoNLL-U (column errors, bad HEAD,
cycles, non-UTF-8 bytes) in single and paired runs, multiword tokens and empty nodes, CRLF and
BOM, truncated gzip, empty files, unknown relations and the dobj alias, over-long sentences."""

import gzip
import json

import pytest

from headlab.cli import main
from headlab.data.treebank import ProblemLog, TreebankCounts, read_conllu, relation_matcher
from headlab.errors import HeadlabError
from headlab.functions import AnalysisConfig, analyze_heads
from support.bad_input import files_under, forbid_model_loading, save_tiny_marian
from support.models import tiny_model
from support.treebank import SAMPLE_CONLLU, word_tokenizer

BLOCKS = SAMPLE_CONLLU.split("\n\n")  # four sentences: s1 .. s4
S2_WORD = "4\tsleep\tsleep\tVERB\tVB\t_\t0\troot\t_\t_"

# One row per kind of malformed sentence: what replaces S2_WORD in s2, and what the error says.
MALFORMED = {
    "columns": ("4\tsleep\tsleep\tVERB\tVB\t_\t0\troot", "expected 10 tab-separated columns, found 8"),
    "id": ("x\tsleep\tsleep\tVERB\tVB\t_\t0\troot\t_\t_", "not a CoNLL-U line"),
    "head-not-a-number": ("4\tsleep\tsleep\tVERB\tVB\t_\tzero\troot\t_\t_", "not a CoNLL-U line"),
    "head-missing": ("4\tsleep\tsleep\tVERB\tVB\t_\t_\troot\t_\t_", "HEAD is '_'"),
    "deprel-missing": ("4\tsleep\tsleep\tVERB\tVB\t_\t0\t_\t_\t_", "DEPREL is '_'"),
    "head-out-of-range": ("4\tsleep\tsleep\tVERB\tVB\t_\t9\troot\t_\t_", "HEAD 9 is outside the sentence (0..6)"),
    "cycle": ("4\tsleep\tsleep\tVERB\tVB\t_\t5\troot\t_\t_", "on a cycle of HEADs"),
    "non-utf8": ("4\tsl\xffeep\tsleep\tVERB\tVB\t_\t0\troot\t_\t_", "not valid UTF-8"),
}


def _treebank(path, row=None):
    text = SAMPLE_CONLLU
    data = text.encode("utf-8")
    if row is not None:
        bad = MALFORMED[row][0]
        data = text.replace(S2_WORD, "@@").encode("utf-8").replace(b"@@", bad.encode("latin-1"))
    path.write_bytes(data)
    line = data.split(b"\n").index(MALFORMED[row][0].encode("latin-1")) + 1 if row else None
    return path, line


@pytest.mark.parametrize("row", sorted(MALFORMED))
def test_malformed_sentence_single_run(row, tmp_path):
    """Strict reading names file and line; lenient reading skips the sentence, counts it and
    keeps its place (None) so that paired files stay paired."""
    path, line = _treebank(tmp_path / f"{row}.conllu", row)
    with pytest.raises(HeadlabError, match=f"{path}:{line}: .*{MALFORMED[row][1][:20]}"):
        list(read_conllu(path))
    problems, counts = ProblemLog(), TreebankCounts()
    read = list(read_conllu(path, problems=problems, counts=counts, keep_place=True))
    assert [s.sent_id if s else None for s in read] == ["s1", None, "s3", "s4"]
    assert counts.n_malformed == 1 and counts.n_sentences == 3
    assert [(p.path, p.line) for p in problems.problems] == [(str(path), line)]


def test_a_sentence_with_two_roots_is_malformed(tmp_path):
    """Regression: a sentence with two words of HEAD 0 was read as a tree (the syntactic test then
    scored a forest); UD's basic dependencies have exactly one root. It is named by file and line
    (strict) or skipped and counted (lenient), as a HEAD cycle is."""
    here = "5\there\there\tADV\tRB\t_\t4\tadvmod\t_\tSpaceAfter=No"
    second = here.replace("\t4\tadvmod", "\t0\troot")
    path = tmp_path / "two-roots.conllu"
    path.write_text(SAMPLE_CONLLU.replace(here, second), encoding="utf-8")
    line = path.read_text(encoding="utf-8").split("\n").index(second) + 1
    with pytest.raises(HeadlabError, match=f"^{path}:{line}: word 5 is a second root \\(HEAD 0, as word 4\\)"):
        list(read_conllu(path))
    problems, counts = ProblemLog(), TreebankCounts()
    read = list(read_conllu(path, problems=problems, counts=counts, keep_place=True))
    assert [s.sent_id if s else None for s in read] == ["s1", None, "s3", "s4"]
    assert counts.n_malformed == 1 and [(p.path, p.line) for p in problems.problems] == [(str(path), line)]


@pytest.fixture(scope="module")
def marian():
    words = [line.split("\t")[1] for line in SAMPLE_CONLLU.splitlines() if line and line[0].isdigit()]
    return tiny_model("marian").eval(), word_tokenizer(words)


@pytest.mark.parametrize("row", ["non-utf8", "cycle"])
def test_malformed_target_sentence_keeps_the_pairing(row, marian, tmp_path):
    """Regression: a non-UTF-8 target sentence was dropped before the code that keeps
    positions saw it, so source sentence 3 was paired with target sentence 2, and the malformed
    count said 0. Any malformed sentence must now drop its pair and keep the others paired, as
    a column error always did."""
    model, tokenizer = marian
    source, _ = _treebank(tmp_path / "source.conllu")
    results = {}
    for name in (row, "columns"):
        target, line = _treebank(tmp_path / f"target-{name}.conllu", name)
        analysis = analyze_heads(model, tokenizer, source, target_conllu=target, progress=False,
                                 config=AnalysisConfig(aggregate=False, batch_size=2))
        assert analysis.report.n_sentences == 3
        assert analysis.report.treebanks[str(target)]["n_malformed"] == 1
        assert [(p.path, p.line) for p in analysis.report.problems.problems] == [(str(target), line)]
        # The encoder side's arcs are those of source sentences s1, s3, s4 (not s1, s2, s3).
        results[name] = analysis.syntactic.offsets["enc_self"]
    assert results[row] == results["columns"]
    solo = analyze_heads(model, tokenizer, source, progress=False,
                         config=AnalysisConfig(aggregate=False, max_sentences=1))
    assert results[row] != solo.syntactic.offsets["enc_self"]  # the offsets do depend on the sentences


def test_multiword_tokens_and_empty_nodes_are_skipped_and_counted(tmp_path):
    path, _ = _treebank(tmp_path / "tb.conllu")
    counts = TreebankCounts()
    sentences = list(read_conllu(path, counts=counts))
    assert sentences[1].words == ("Cats", "do", "n't", "sleep", "here", ".")  # "don't" (2-3) skipped
    assert sentences[2].words == ("Birds", "sing", "and", "fish", "swim", ".")  # empty node 4.1 skipped
    assert sentences[2].heads == (1, -1, 4, 4, 1, 1)
    assert (counts.n_multiword_tokens, counts.n_empty_nodes, counts.n_malformed) == (1, 1, 0)


@pytest.mark.parametrize("form", ["crlf", "bom", "gzip"])
def test_crlf_bom_and_gzip_read_like_plain_utf8(form, tmp_path):
    plain, _ = _treebank(tmp_path / "plain.conllu")
    data = SAMPLE_CONLLU.encode()
    path = tmp_path / ("tb.conllu.gz" if form == "gzip" else f"{form}.conllu")
    path.write_bytes({"crlf": data.replace(b"\n", b"\r\n"), "bom": b"\xef\xbb\xbf" + data,
                      "gzip": gzip.compress(data)}[form])
    strip = lambda s: (s.words, s.upos, s.heads, s.deprels, s.space_after, s.sent_id, s.line, s.text)  # noqa: E731
    assert [strip(s) for s in read_conllu(path)] == [strip(s) for s in read_conllu(plain)]


def test_truncated_gzip_names_the_file(tmp_path):
    path = tmp_path / "tb.conllu.gz"
    path.write_bytes(gzip.compress(SAMPLE_CONLLU.encode() * 20)[:-30])
    with pytest.raises(HeadlabError, match=f"cannot read {path}"):
        list(read_conllu(path, problems=ProblemLog()))


def test_empty_path_and_directory_are_named_for_what_they_are(model_dir, tmp_path, capsys):
    """Regression: "" (Path("") is ".") and a directory were both "CoNLL-U file not found"."""
    from headlab.data.treebank import Treebank, count_sentences

    for read in (lambda p: list(read_conllu(p)), count_sentences, Treebank):
        with pytest.raises(HeadlabError, match="CoNLL-U file: the path is empty"):
            read("")
        with pytest.raises(HeadlabError, match=f"CoNLL-U file {tmp_path}: a directory, not a file"):
            read(tmp_path)
    assert main(["functions", str(model_dir), "--conllu", "", "--out", str(tmp_path / "out")]) == 2
    assert "--conllu: the path is empty" in capsys.readouterr().err


def test_relation_aliases_and_unknown_relations():
    """Regression: dobj:* skipped the dobj -> obj alias and found no arc."""
    assert relation_matcher("dobj:*")("obj") and relation_matcher("dobj:*")("obj:lvc")
    assert relation_matcher("dobj")("obj") and not relation_matcher("dobj")("obj:lvc")
    assert relation_matcher("nmod:poss:*")("nmod:poss") and not relation_matcher("nmod:poss:*")("nmod")
    with pytest.raises(HeadlabError, match="'subj' is not a Universal Dependencies relation"):
        relation_matcher("subj")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_marian(tmp_path_factory.mktemp("conllu-model") / "m")


def test_cli_dobj_alias_finds_arcs_and_unknown_relations_are_refused(model_dir, tmp_path, capsys, monkeypatch):
    path, _ = _treebank(tmp_path / "tb.conllu")
    out = tmp_path / "out"
    assert main(["functions", str(model_dir), "--conllu", str(path), "--out", str(out), "--no-progress",
                 "--no-figures", "--relations", "dobj:*,nsubj:*"]) == 0
    captured = capsys.readouterr()
    assert "no arc" not in captured.err
    assert "dobj:*" in captured.out
    forbid_model_loading(monkeypatch)
    assert main(["functions", str(model_dir), "--conllu", str(path), "--out", str(tmp_path / "o2"),
                 "--relations", "nsubj,objj"]) == 2
    assert "--relations: 'objj' is not a Universal Dependencies relation" in capsys.readouterr().err
    assert not (tmp_path / "o2").exists()


def test_cli_relation_without_arcs_is_reported(model_dir, tmp_path, capsys):
    path, _ = _treebank(tmp_path / "tb.conllu")
    assert main(["functions", str(model_dir), "--conllu", str(path), "--out", str(tmp_path / "o"), "--no-progress",
                 "--no-figures", "--relations", "nsubj,iobj"]) == 0
    assert "--relations iobj: no arc of it in the data" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["functions", "analyze"])
@pytest.mark.parametrize("content", [b"", b"\n\n", b"# newdoc\n# only comments\n", b"# newdoc\n\n# only comments\n\n"])
def test_cli_empty_treebank_is_refused_and_writes_nothing(content, command, model_dir, tmp_path, capsys, monkeypatch):
    """Regression: an empty CoNLL-U file exited 0 and wrote tables of NaN. One of comments alone was found only
    after the model loaded (functions: exit 1) or after analyze's importance stages had run (exit 1)."""
    path = tmp_path / "empty.conllu"
    path.write_bytes(content)
    source = tmp_path / "source.txt"
    source.write_text("the dog\n", encoding="utf-8")
    out = tmp_path / "out"
    forbid_model_loading(monkeypatch)
    extra = ["--source", str(source)] if command == "analyze" else []
    code = main([command, str(model_dir), "--conllu", str(path), *extra, "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err
    said = "holds no sentence (only comments and blank lines)" if content.strip() else "the file is empty"
    assert code == 2 and f"--conllu {path}: {said}" in err
    assert "Traceback" not in err and files_under(out) == set()


@pytest.mark.parametrize("command", ["functions", "analyze"])
def test_cli_every_sentence_malformed_is_refused_before_any_work(command, model_dir, tmp_path, capsys, monkeypatch):
    """Regression: found after the model loaded (functions, exit 1) or after analyze's importance stages had run
    (its functions and aggregate stages failed, exit 1)."""
    path = tmp_path / "bad.conllu"
    path.write_text("# a comment\n1\tword\n\n1\tother\n", encoding="utf-8")
    source = tmp_path / "source.txt"
    source.write_text("the dog\n", encoding="utf-8")
    out = tmp_path / "out"
    forbid_model_loading(monkeypatch)
    extra = ["--source", str(source)] if command == "analyze" else []
    assert main([command, str(model_dir), "--conllu", str(path), *extra, "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert (f"--conllu {path}: no well-formed sentence (2 sentences, all malformed; the first: {path}:2: expected 10 "
            "tab-separated columns, found 2)") in err
    assert "Traceback" not in err and files_under(out) == set()


def test_cli_long_sentence_truncation_is_reported(model_dir, tmp_path, capsys):
    words = ["dog"] * 80  # the model has 64 positions
    lines = [f"{i}\t{w}\t{w}\tNOUN\tNN\t_\t{0 if i == 1 else 1}\t{'root' if i == 1 else 'dep'}\t_\t_"
             for i, w in enumerate(words, start=1)]
    path = tmp_path / "long.conllu"
    path.write_text(SAMPLE_CONLLU + "\n" + "\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    assert main(["functions", str(model_dir), "--conllu", str(path), "--out", str(out), "--no-progress",
                 "--no-figures"]) == 0
    assert "1 sentence truncated to 64 tokens" in capsys.readouterr().out
    assert json.loads((out / "summary.json").read_text())["report"]["n_truncated"] == 1
    # Regression: --max-length above the 64 positions was taken as it was, and the 80-word sentence
    # indexed past the position table: an internal error (IndexError). It is lowered, and said so.
    out = tmp_path / "asked"
    assert main(["functions", str(model_dir), "--conllu", str(path), "--out", str(out), "--no-progress",
                 "--no-figures", "--max-length", "1000"]) == 0
    said = capsys.readouterr().out
    assert "--max-length 1000 is above the model's longest input (64 tokens, its position table): lowered to 64" in said
    assert "1 sentence truncated to 64 tokens" in said
    report = json.loads((out / "summary.json").read_text())["report"]
    assert report["max_length"] == 64 and report["length_lowered"].startswith("--max-length 1000 is above")


def test_cli_importance_says_that_max_length_was_lowered(model_dir, tmp_path, capsys):
    """Regression: `importance --max-length 1000` on a model of 64 positions cut inputs to 64 tokens
    and said only "truncated to 64 tokens", never that the option itself was lowered."""
    source = tmp_path / "long.txt"
    source.write_text(" ".join(["dog"] * 80) + "\n", encoding="utf-8")
    assert main(["importance", str(model_dir), "--source", str(source), "--out", str(tmp_path / "o"), "--no-progress",
                 "--method", "confidence", "--max-length", "1000"]) == 0
    err = capsys.readouterr().err
    assert "--max-length 1000 is above the model's longest input (64 tokens, its position table): lowered to 64" in err
    assert main(["importance", str(model_dir), "--source", str(source), "--out", str(tmp_path / "p"), "--no-progress",
                 "--method", "confidence", "--max-length", "64"]) == 0
    assert "lowered" not in capsys.readouterr().err


@pytest.mark.parametrize("paired", [False, True])
def test_cli_reports_each_malformed_sentence_with_file_and_line(paired, model_dir, tmp_path, capsys):
    """Every kind of malformed sentence in one file: the run goes on, skips each one and names
    its file and line; in a paired run the other sentences stay paired."""
    good = SAMPLE_CONLLU.encode()
    blocks = []
    for row in sorted(MALFORMED):
        bad, _ = _treebank(tmp_path / f"{row}.conllu", row)
        blocks.append(bad.read_bytes().split(b"\n\n")[1])  # the broken s2
    data = good.rstrip(b"\n") + b"\n\n" + b"\n\n".join(blocks) + b"\n"
    path = tmp_path / "mixed.conllu"
    path.write_bytes(data)
    lines = [data.split(b"\n").index(MALFORMED[row][0].encode("latin-1")) + 1 for row in sorted(MALFORMED)]
    args = ["functions", str(model_dir), "--out", str(tmp_path / "o"), "--no-progress", "--no-figures"]
    if paired:  # the source side: the same sentences, all well formed
        source = tmp_path / "source.conllu"
        source.write_bytes(good.rstrip(b"\n") + b"\n\n" + b"\n\n".join([good.split(b"\n\n")[1]] * len(blocks)) + b"\n")
        args += ["--conllu", str(source), "--target-conllu", str(path)]
    else:
        args += ["--conllu", str(path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"{len(MALFORMED)} malformed sentences skipped" in out
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())["report"]
    assert summary["n_sentences"] == 4
    problems = summary["problems"]["first"]
    assert len(problems) == len(MALFORMED)
    for problem, row, line in zip(problems, sorted(MALFORMED), lines):
        assert problem.startswith(f"{path}:{line}: ") and MALFORMED[row][1] in problem, (row, problem)


def test_non_utf8_comment_between_sentences_takes_no_place(tmp_path):
    """Bad bytes in a comment-only block: reported, but no sentence is lost or invented."""
    blocks = SAMPLE_CONLLU.encode().split(b"\n\n")
    path = tmp_path / "tb.conllu"
    path.write_bytes(b"\n\n".join([blocks[0], b"# newdoc id = caf\xe9", *blocks[1:]]))
    problems = ProblemLog()
    read = list(read_conllu(path, problems=problems, keep_place=True))
    assert [s.sent_id for s in read] == ["s1", "s2", "s3", "s4"]
    assert [(p.line, p.message[:19]) for p in problems.problems] == [(13, "not valid UTF-8 (in")]


def _paired_run(tmp_path, model_dir, *sides):
    return main(["functions", str(model_dir), *sides, "--out", str(tmp_path / "o"), "--no-progress", "--no-figures"])


@pytest.mark.parametrize("case", ["source-without-target", "source-beside-conllu", "no-source-side",
                                  "source-text-one-line-more", "source-text-one-line-fewer", "conllu-one-sentence-fewer"])
def test_paired_sides_that_cannot_pair_are_refused_before_the_model_loads(case, model_dir, tmp_path, capsys,
                                                                         monkeypatch):
    """Regression: --source without --target-conllu, or beside --conllu, was ignored (exit 0); --target-conllu
    with no source side was refused only after the weights loaded; sides of other lengths were analysed up to
    the shorter one with a note (exit 0), every pair after an extra or missing line a wrong one."""
    target = tmp_path / "target.conllu"
    target.write_text(SAMPLE_CONLLU, encoding="utf-8")
    four = ["the dog", "the cat", "birds sing", "a zebra"]
    text = tmp_path / "source.txt"
    text.write_text("\n".join(four + (["one more"] if case == "source-text-one-line-more" else [])
                              if case != "source-text-one-line-fewer" else four[:3]) + "\n", encoding="utf-8")
    short = tmp_path / "short.conllu"
    short.write_text("\n\n".join(BLOCKS[:3]) + "\n\n", encoding="utf-8")
    sides, said = {
        "source-without-target": (["--conllu", str(target), "--source", str(text)],
                                  f"--source {text}: the source sentences of --target-conllu, which is not given"),
        "source-beside-conllu": (["--conllu", str(target), "--target-conllu", str(target), "--source", str(text)],
                                 f"--conllu {target} and --source {text} both give the source side"),
        "no-source-side": (["--target-conllu", str(target)],
                           f"--target-conllu {target}: decoder analysis needs the source sentences"),
        "source-text-one-line-more": (["--target-conllu", str(target), "--source", str(text)],
                                      f"--target-conllu {target} has 4 sentences but --source {text} has 5 lines"),
        "source-text-one-line-fewer": (["--target-conllu", str(target), "--source", str(text)],
                                       f"--target-conllu {target} has 4 sentences but --source {text} has 3 lines"),
        "conllu-one-sentence-fewer": (["--conllu", str(short), "--target-conllu", str(target)],
                                      f"--target-conllu {target} has 4 sentences but --conllu {short} has 3 sentences"),
    }[case]
    forbid_model_loading(monkeypatch)
    assert _paired_run(tmp_path, model_dir, *sides) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err
    assert files_under(tmp_path / "o") == set()


def test_paired_sides_of_one_length_run_and_blank_lines_after_the_last_source_line_are_none(model_dir, tmp_path,
                                                                                             capsys):
    target = tmp_path / "target.conllu"
    target.write_text(SAMPLE_CONLLU, encoding="utf-8")
    text = tmp_path / "source.txt"
    text.write_text("the dog\n\nbirds sing\na zebra\n\n  \n", encoding="utf-8")  # line 2 blank: its pair skipped
    assert _paired_run(tmp_path, model_dir, "--target-conllu", str(target), "--source", str(text)) == 0
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())["report"]
    assert summary["n_sentences"] == 3 and summary["problems"]["counts"] == {"malformed": 1}


def test_sentences_are_counted_as_the_reader_reads_them(tmp_path):
    """Regression: count_sentences (progress, --num-processes, the paired check) read a line holding a
    no-break space as a sentence's line, joining the two around it, and a comment block after a UTF-8
    byte order mark as a sentence."""
    from headlab.data.treebank import count_sentences

    path = tmp_path / "tb.conllu"
    path.write_bytes(b"\xef\xbb\xbf# newdoc id = d1\n\n" + "\n\u00a0\n".join(BLOCKS).encode("utf-8"))
    assert len(list(read_conllu(path))) == 4
    assert count_sentences(path) == 4
