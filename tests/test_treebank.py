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


def _reference_block(block):
    """Reference for ``_parse_block``: its generic form before the one-pass loop, every used column
    through conllu's default parsers (ID and HEAD by regex, MISC into a dict), all lines first,
    then the words checked in order. ``(sentence, multiword, empty)`` or ``(line, message)``."""
    from conllu.exceptions import ParseException
    from conllu.parser import DEFAULT_FIELD_PARSERS, DEFAULT_FIELDS, parse_comment_line

    from headlab.data.treebank import Sentence, _cycle, _two_roots

    used = [(i, name) for i, name in enumerate(DEFAULT_FIELDS) if name in ("id", "form", "upos", "head", "deprel", "misc")]
    tokens, token_lines, metadata = [], [], {}
    for number, line in block:
        if line.startswith("#"):
            try:
                metadata.update(parse_comment_line(line))
            except ParseException as error:
                return number, f"not a CoNLL-U line ({error})"
            continue
        columns = line.split("\t")
        if len(columns) != 10:
            return number, f"expected 10 tab-separated columns, found {len(columns)}"
        columns[0], columns[9] = columns[0].lstrip(), columns[9].rstrip()
        token = {}
        for i, name in used:
            try:
                token[name] = DEFAULT_FIELD_PARSERS[name](columns, i) if name in DEFAULT_FIELD_PARSERS else columns[i]
            except ParseException as error:
                return number, f"not a CoNLL-U line (Failed parsing field '{name}': {error})"
        tokens.append(token)
        token_lines.append(number)
    words, upos, heads, deprels, space_after, word_lines = [], [], [], [], [], []
    multiword = empty = 0
    for number, token in zip(token_lines, tokens):
        if isinstance(token["id"], tuple):
            multiword, empty = (multiword + 1, empty) if token["id"][1] == "-" else (multiword, empty + 1)
            continue
        if token["id"] != len(words) + 1:
            return number, f"word id {token['id']} out of sequence (expected {len(words) + 1})"
        if token["head"] is None:
            return number, "HEAD is '_': the sentence has no dependency parse"
        if not token["deprel"] or token["deprel"] == "_":
            return number, "DEPREL is '_'"
        words.append(token["form"])
        upos.append(token["upos"] or "_")
        heads.append(int(token["head"]))
        deprels.append(token["deprel"])
        space_after.append((token["misc"] or {}).get("SpaceAfter") != "No")
        word_lines.append(number)
    if not words:
        return block[0][0], "sentence has no words"
    for number, head in zip(word_lines, heads):
        if not 0 <= head <= len(words):
            return number, f"HEAD {head} is outside the sentence (0..{len(words)})"
    cycle = _cycle(heads)
    if cycle is not None:
        return word_lines[cycle], f"word {cycle + 1} is on a cycle of HEADs: the parse is not a tree"
    roots = [i for i, head in enumerate(heads) if head == 0]
    if len(roots) > 1:
        return word_lines[roots[1]], _two_roots((roots[0], roots[1]))
    sentence = Sentence(tuple(words), tuple(upos), tuple(h - 1 for h in heads), tuple(deprels), tuple(space_after),
                        sent_id=str(metadata.get("sent_id") or ""), path="x.conllu", line=block[0][0],
                        text=metadata.get("text"))
    return sentence, multiword, empty


def _parsed_block(block):
    """``_parse_block``'s outcome in the reference's form."""
    from headlab.data.treebank import _Malformed, _parse_block

    counts = TreebankCounts()
    try:
        sentence = _parse_block(Path("x.conllu"), block[0][0], block, counts)
    except _Malformed as error:
        return error.line, error.message
    return sentence, counts.n_multiword_tokens, counts.n_empty_nodes


def _numbered(text):
    return [(number, line) for number, line in enumerate(text.split("\n"), start=1) if line.strip()]


@pytest.mark.parametrize("value", [
    "0", "1", "2", "7", "10", "16384", "01", "007", "-1", "-0", "+1", "1-2", "2-1", "1-1", "1.1", "0.1", "1.0", "_", "",
    "٣", "１", "²", "1 ", " 1", "x", "1e3", "1_0",
])
def test_id_and_head_values_read_as_conllu_reads_them(value):
    # ID and HEAD take int(value) for plain digits and hand everything else to conllu: the value,
    # or the error and its line, must be conllu's for every form, odd ones included.
    # the second word's ID, then its HEAD
    for line in (f"{value}\tb\tb\tX\t_\t_\t1\tdep\t_\t_", f"2\tb\tb\tX\t_\t_\t{value}\tdep\t_\t_"):
        block = _numbered(f"# sent_id = v\n1\ta\ta\tX\t_\t_\t0\troot\t_\t_\n{line}")
        assert _parsed_block(block) == _reference_block(block), line


def test_blocks_of_ewt_dev_read_as_the_reference_reads_them():
    from headlab.data.treebank import _blocks

    n_multiword = n_empty = 0
    for _, block, _ in _blocks(EWT / "en_ewt-ud-dev.conllu"):
        if all(line.startswith("#") for _, line in block):
            continue
        got, expected = _parsed_block(block), _reference_block(block)
        assert got == expected, block[0]
        n_multiword, n_empty = n_multiword + got[1], n_empty + got[2]
    assert n_multiword > 0 and n_empty > 0  # the odd ids were met


# Odd values for a column, and whole-line edits: the errors of every kind, in every order.
ODD = ["_", "", " ", "0", "01", "1-2", "3-2", "1.1", "x", "-1", "٣", "99", "root", "SpaceAfter=No",
       "SpaceAfter=No|SpaceAfter=Yes", "SpaceAfter", "SpaceAfter=No=x", "_|SpaceAfter=No", "X=1|SpaceAfter=No ",
       "SpaceAfter=No ", "Gloss=a  b|SpaceAfter=No", "=No", "SpaceAfter=", "New  York"]


def _mutated(block, rng):
    lines = [line for _, line in block]
    for _ in range(rng.randint(1, 3)):
        at = rng.randrange(len(lines))
        kind = rng.randrange(8)
        if kind <= 3 and not lines[at].startswith("#"):
            columns = lines[at].split("\t")
            column = rng.choice([0, 0, 1, 3, 6, 6, 7, 9, 9, rng.randrange(len(columns))])
            if column < len(columns):
                columns[column] = rng.choice(ODD) if kind < 3 else str(rng.randint(0, len(lines) + 1))
            lines[at] = "\t".join(columns)
        elif kind == 4:
            lines[at] = rng.choice(["# bad", "#", "# = x", "# text = t", "# sent_id = z", "#sent_id=y", " # x"])
        elif kind == 5:
            lines.insert(at, rng.choice(lines))
        elif kind == 6:
            lines[at] = lines[at] + "\t_" if rng.random() < 0.5 else lines[at].rsplit("\t", 1)[0]
        elif len(lines) > 1:
            lines.pop(at)
    return [(number, line) for number, line in enumerate(lines, start=block[0][0]) if line.strip()]


def test_mutated_blocks_fail_or_read_as_the_reference():
    import random

    from headlab.data.treebank import InMemoryTreebank, _blocks

    rng = random.Random(34)
    blocks = [block for _, block, _ in _blocks(InMemoryTreebank(SAMPLE_CONLLU))]
    blocks += [block for _, block, _ in _blocks(EWT / "en_ewt-ud-dev.conllu")][:60]
    outcomes = set()
    for _ in range(3000):
        block = _mutated(rng.choice(blocks), rng)
        if not block or all(line.startswith("#") for _, line in block):
            continue
        got, expected = _parsed_block(block), _reference_block(block)
        assert got == expected, block
        outcomes.add(next((m for m in MARKERS if m in got[1]), got[1]) if isinstance(got[1], str) else "read")
    assert outcomes == {"read", *MARKERS}  # every kind of error was met (a comment never fails), and sentences read


MARKERS = ("not a CoNLL-U line (Failed parsing field 'id'", "not a CoNLL-U line (Failed parsing field 'head'",
           "tab-separated columns", "out of sequence", "no dependency parse", "DEPREL is '_'",
           "outside the sentence", "on a cycle", "a second root")


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
