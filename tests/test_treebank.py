"""CoNLL-U reading: words, arcs, skipped lines, and errors that name file and line."""

from pathlib import Path

import pytest

from headlab.data.treebank import (
    ProblemLog,
    Treebank,
    TreebankCounts,
    count_sentences,
    read_conllu,
    relation_matcher,
)
from headlab.errors import HeadlabError
from support.treebank import SAMPLE_CONLLU

REPO = Path(__file__).resolve().parents[1]
EWT = REPO / "data" / "ud-english-ewt"


def test_reads_words_tags_arcs_and_skips_multiword_and_empty_nodes(sample_path):
    counts = TreebankCounts()
    sentences = list(read_conllu(sample_path, counts=counts))
    assert [s.sent_id for s in sentences] == ["s1", "s2", "s3", "s4"]
    first = sentences[0]
    assert first.words == ("The", "old", "dog", "quickly", "chased", "a", "red", "ball", ".")
    assert first.upos[:3] == ("DET", "ADJ", "NOUN")
    assert first.heads == (2, 2, 4, 4, -1, 7, 7, 4, 4)  # 0-based, root -1
    assert first.deprels[7] == "obj"
    assert first.space_after[7] is False and first.space_after[0] is True
    assert first.line == 1 and first.text.startswith("The old dog")
    second = sentences[1]
    assert second.words == ("Cats", "do", "n't", "sleep", "here", ".")  # "don't" line skipped
    assert sentences[2].words == ("Birds", "sing", "and", "fish", "swim", ".")  # empty node 4.1 skipped
    assert counts.n_multiword_tokens == 1 and counts.n_empty_nodes == 1
    assert counts.n_sentences == 4 and counts.n_words == 9 + 6 + 6 + 9
    assert list(sentences[0].arcs())[0] == (2, 0, "det")
    assert count_sentences(sample_path) == 4


def _broken(tmp_path, old, new):
    text = SAMPLE_CONLLU.replace(old, new, 1)
    path = tmp_path / "broken.conllu"
    path.write_text(text, encoding="utf-8")
    line = text.splitlines().index(new.split("\n")[0]) + 1 if new else None
    return path, line


@pytest.mark.parametrize("old,new,message", [
    ("3\tdog\tdog\tNOUN\tNN\t_\t5\tnsubj\t_\t_", "3\tdog\tdog\tNOUN\tNN\t_\t5\tnsubj\t_", "10 tab-separated"),
    ("3\tdog\tdog\tNOUN\tNN\t_\t5\tnsubj\t_\t_", "3\tdog\tdog\tNOUN\tNN\t_\tfive\tnsubj\t_\t_", "not a CoNLL-U line"),
    ("3\tdog\tdog\tNOUN\tNN\t_\t5\tnsubj\t_\t_", "3\tdog\tdog\tNOUN\tNN\t_\t42\tnsubj\t_\t_", "outside the sentence"),
    ("3\tdog\tdog\tNOUN\tNN\t_\t5\tnsubj\t_\t_", "7\tdog\tdog\tNOUN\tNN\t_\t5\tnsubj\t_\t_", "out of sequence"),
    ("3\tdog\tdog\tNOUN\tNN\t_\t5\tnsubj\t_\t_", "3\tdog\tdog\tNOUN\tNN\t_\t_\t_\t_\t_", "no dependency parse"),
])
def test_malformed_sentence_is_reported_with_file_and_line_and_the_rest_is_read(tmp_path, old, new, message):
    path, line = _broken(tmp_path, old, new)
    problems = ProblemLog()
    counts = TreebankCounts()
    sentences = list(read_conllu(path, problems=problems, counts=counts))
    assert [s.sent_id for s in sentences] == ["s2", "s3", "s4"]  # only the broken sentence is lost
    assert counts.n_malformed == 1
    (problem,) = problems.problems
    assert problem.path == str(path) and problem.line == line
    assert message in problem.message and f"{path}:{line}:" in str(problem)
    with pytest.raises(HeadlabError, match=f"{path}:{line}: .*{message}"):
        list(read_conllu(path))  # strict: no problem log


def test_bad_utf8_is_reported_with_its_line(tmp_path):
    path = tmp_path / "bytes.conllu"
    data = SAMPLE_CONLLU.encode("utf-8").replace(b"quickly\tquickly", b"quick\xffy\tquickly")
    path.write_bytes(data)
    problems = ProblemLog()
    sentences = list(read_conllu(path, problems=problems))
    assert len(sentences) == 3
    assert problems.problems[0].line == 6 and "UTF-8" in problems.problems[0].message


def test_missing_file_and_limit(tmp_path, sample_path):
    with pytest.raises(HeadlabError, match="not found"):
        list(read_conllu(tmp_path / "nope.conllu"))
    assert len(list(read_conllu(sample_path, limit=2))) == 2
    assert len(Treebank(sample_path, limit=3)) == 3


def test_relation_names():
    dobj = relation_matcher("dobj")
    assert dobj("obj") and dobj("dobj") and not dobj("iobj")
    nsubj = relation_matcher("nsubj")
    assert nsubj("nsubj") and not nsubj("nsubj:pass")
    nmod = relation_matcher("nmod:*")
    assert nmod("nmod") and nmod("nmod:poss") and not nmod("nummod")
    with pytest.raises(HeadlabError):
        relation_matcher(" ")


def test_bundled_ewt_has_licence_and_reads():
    assert (EWT / "LICENSE.txt").is_file()
    readme = (EWT / "README.md").read_text()
    assert "CC BY-SA 4.0" in readme and "Universal Dependencies" in readme
    counts = TreebankCounts()
    sentences = list(read_conllu(EWT / "en_ewt-ud-dev.conllu", counts=counts, limit=50))
    assert len(sentences) == 50 and all(len(s.words) == len(s.heads) for s in sentences)
    assert sentences[0].words[:3] == ("From", "the", "AP")


@pytest.mark.parametrize("value", [
    "0", "1", "7", "10", "16384", "01", "007", "-1", "+1", "1-2", "2-1", "1.1", "0.1", "1.0", "_", "",
    "٣", "１", "²", "1 ", "x", "1e3",
])
def test_fast_id_and_head_parsers_agree_with_conllu(value):
    # The ID/HEAD parsers take int(value) for plain digits and hand everything else to conllu:
    # value and error must be conllu's own for every form, odd ones included.
    from conllu.exceptions import ParseException
    from conllu.parser import DEFAULT_FIELD_PARSERS

    from headlab.data.treebank import _FIELD_PARSERS

    for name in ("id", "head"):
        try:
            expected = DEFAULT_FIELD_PARSERS[name]([value], 0)
        except ParseException as error:
            with pytest.raises(ParseException) as raised:
                _FIELD_PARSERS[name]([value], 0)
            assert str(raised.value) == str(error)
        else:
            got = _FIELD_PARSERS[name]([value], 0)
            assert got == expected and type(got) is type(expected)


def test_fast_parsers_read_ewt_dev_as_conllu_defaults_do(monkeypatch):
    from conllu.parser import DEFAULT_FIELD_PARSERS

    import headlab.data.treebank as treebank

    fast_counts, slow_counts = TreebankCounts(), TreebankCounts()
    fast = list(read_conllu(EWT / "en_ewt-ud-dev.conllu", counts=fast_counts))
    slow_parsers = {**DEFAULT_FIELD_PARSERS, "feats": treebank._FIELD_PARSERS["feats"],
                    "deps": treebank._FIELD_PARSERS["deps"]}
    monkeypatch.setattr(treebank, "_FIELD_PARSERS", slow_parsers)
    slow = list(read_conllu(EWT / "en_ewt-ud-dev.conllu", counts=slow_counts))
    assert fast == slow and fast_counts == slow_counts
    assert fast_counts.n_multiword_tokens > 0 and fast_counts.n_empty_nodes > 0  # the odd ids were met


# UD v2 allows spaces in FORM, LEMMA and MISC; the columns are separated by tabs only. conllu's
# own line split (r"\t| {2,}") would read "New  York" as two columns and shift every later one.
SPACED_CONLLU = """\
# sent_id = spaced
# text = New  York is big.
1\tNew  York\tNew  York\tPROPN\tNNP\tNumber=Sing\t3\tnsubj\t_\tGloss=the  city|SpaceAfter=No
2\tis\tbe\tAUX\tVBZ\t_\t3\tcop\t_\t_
3\tbig\tbig\tADJ\tJJ\tDegree=Pos\t0\troot\t_\tSpaceAfter=No
4\t.\t.\tPUNCT\t.\t_\t3\tpunct\t_\t_
"""


def test_tab_separated_columns_are_split_on_tabs_only(tmp_path):
    path = tmp_path / "spaced.conllu"
    path.write_text(SPACED_CONLLU, encoding="utf-8")
    (sentence,) = read_conllu(path)
    assert sentence.words == ("New  York", "is", "big", ".")
    assert sentence.upos == ("PROPN", "AUX", "ADJ", "PUNCT")
    assert sentence.heads == (2, 2, -1, 2) and sentence.deprels == ("nsubj", "cop", "root", "punct")
    # MISC's SpaceAfter=No after a value with two spaces is still read
    assert sentence.space_after == (False, True, False, True)


def test_two_spaces_in_misc_keep_its_later_items(tmp_path):
    # Split on spaces, MISC lost "|SpaceAfter=No" without a word: the text had a space too many.
    path = tmp_path / "misc.conllu"
    path.write_text(SPACED_CONLLU.replace("New  York", "York"), encoding="utf-8")
    (sentence,) = read_conllu(path)
    assert sentence.words == ("York", "is", "big", ".")
    assert sentence.space_after == (False, True, False, True)


def test_a_word_with_spaces_aligns_to_all_its_subwords(tmp_path):
    from headlab.data.alignment import align_sentences
    from support.treebank import word_tokenizer

    path = tmp_path / "spaced.conllu"
    path.write_text(SPACED_CONLLU, encoding="utf-8")
    (sentence,) = read_conllu(path)
    tokenizer = word_tokenizer(["New", "York", "is", "big", "."])
    (alignment,) = align_sentences(tokenizer, [sentence.words])
    assert alignment.word_of_token.tolist()[:5] == [0, 0, 1, 2, 3]  # New, York -> word 0


def test_space_separated_line_is_refused_with_its_line(tmp_path):
    # Two spaces between columns is not CoNLL-U: refused where it is, not read as columns.
    path = tmp_path / "spaces.conllu"
    path.write_text(SPACED_CONLLU.replace("2\tis\tbe\tAUX\tVBZ\t_\t3\tcop\t_\t_",
                                          "2  is  be  AUX  VBZ  _  3  cop  _  _"), encoding="utf-8")
    with pytest.raises(HeadlabError, match=f"{path}:4: expected 10 tab-separated columns, found 1"):
        list(read_conllu(path))


def test_tab_split_reads_ewt_dev_as_conllu_does():
    # EWT has no two spaces in a column: there conllu's own parse is a reference for the tab split.
    import conllu

    with open(EWT / "en_ewt-ud-dev.conllu", encoding="utf-8") as handle:
        reference = list(conllu.parse_incr(handle))
    ours = list(read_conllu(EWT / "en_ewt-ud-dev.conllu"))
    assert len(ours) == len(reference)
    for sentence, parsed in zip(ours, reference):
        tokens = [t for t in parsed if isinstance(t["id"], int)]
        assert sentence.words == tuple(t["form"] for t in tokens)
        assert sentence.upos == tuple(t["upos"] for t in tokens)
        assert sentence.heads == tuple(t["head"] - 1 for t in tokens)
        assert sentence.deprels == tuple(t["deprel"] for t in tokens)
        assert sentence.space_after == tuple((t["misc"] or {}).get("SpaceAfter") != "No" for t in tokens)
        assert sentence.sent_id == parsed.metadata["sent_id"] and sentence.text == parsed.metadata["text"]
