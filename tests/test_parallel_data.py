"""Parallel text loading: plain and gzipped files, and every bad input gives a clear error."""

import gzip
from pathlib import Path

import pytest

from headlab.data import read_lines, read_parallel
from headlab.errors import HeadlabError

DATA = Path(__file__).resolve().parents[1] / "data" / "multi30k"


def write(path: Path, lines: list[str], *, gz: bool = False) -> Path:
    text = "".join(line + "\n" for line in lines).encode("utf-8")
    if gz:
        with gzip.open(path, "wb") as handle:
            handle.write(text)
    else:
        path.write_bytes(text)
    return path


def test_plain_and_gzipped_read_the_same(tmp_path):
    lines = ["Ein Hund läuft.", "Zwei Männer."]
    plain = write(tmp_path / "a.txt", lines)
    packed = write(tmp_path / "a.txt.gz", lines, gz=True)
    assert read_lines(plain) == read_lines(packed) == lines
    corpus = read_parallel(plain, packed)
    assert list(corpus) == list(zip(lines, lines))


def test_bundled_multi30k_copy_is_complete():
    corpus = read_parallel(DATA / "val.en.gz", DATA / "val.de.gz")
    assert len(corpus) == 1014 and corpus.n_empty == 0
    assert corpus.sources[0].startswith("A group of men")


def test_mismatched_line_counts_name_both_files_and_counts(tmp_path):
    src = write(tmp_path / "s.en", ["a", "b", "c"])
    tgt = write(tmp_path / "t.de", ["x", "y"])
    with pytest.raises(HeadlabError) as error:
        read_parallel(src, tgt)
    message = str(error.value)
    assert str(src) in message and str(tgt) in message
    assert "3 lines" in message and "2 lines" in message


def test_empty_lines_are_skipped_and_counted(tmp_path):
    src = write(tmp_path / "s.en", ["a b", "", "c", "  ", "d"])
    tgt = write(tmp_path / "t.de", ["x", "y", "", "z", "w"])
    corpus = read_parallel(src, tgt)
    assert list(corpus) == [("a b", "x"), ("d", "w")]
    assert corpus.n_empty == 3
    assert corpus.line_numbers == [1, 5]
    assert "3 pairs with an empty side skipped" in corpus.summary()


def test_overlong_sentences_are_truncated_and_counted(tmp_path):
    src = write(tmp_path / "s.en", ["one two three four five", "short"])
    tgt = write(tmp_path / "t.de", ["eins zwei", "kurz und knapp gesagt"])
    corpus = read_parallel(src, tgt, max_tokens=3)
    assert corpus.sources == ["one two three", "short"]
    assert corpus.targets == ["eins zwei", "kurz und knapp"]
    assert corpus.n_truncated == 2
    assert "2 pairs truncated to 3 tokens" in corpus.summary()
    assert read_parallel(src, tgt).n_truncated == 0


def test_non_utf8_line_names_file_and_line(tmp_path):
    src = write(tmp_path / "s.en", ["fine", "also fine", "bad"])
    tgt = tmp_path / "t.de"
    tgt.write_bytes(b"gut\nschlecht \xff\xfe\nauch\n")
    with pytest.raises(HeadlabError) as error:
        read_parallel(src, tgt)
    assert str(tgt) in str(error.value) and "line 2" in str(error.value)
    packed = tmp_path / "t.de.gz"
    with gzip.open(packed, "wb") as handle:
        handle.write(b"gut\nauch\n\xc3(\n")
    with pytest.raises(HeadlabError, match=r"t\.de\.gz, line 3"):
        read_lines(packed)


def test_empty_corpus_is_an_error(tmp_path):
    src = write(tmp_path / "s.en", ["", ""])
    tgt = write(tmp_path / "t.de", ["x", ""])
    with pytest.raises(HeadlabError, match="empty corpus"):
        read_parallel(src, tgt)
    nothing = write(tmp_path / "n.en", [])
    with pytest.raises(HeadlabError, match="empty corpus"):
        read_parallel(nothing, nothing)
    assert len(read_parallel(src, tgt, allow_empty=True)) == 0


def test_missing_file_is_named(tmp_path):
    present = write(tmp_path / "s.en", ["a"])
    missing = tmp_path / "nope.de"
    with pytest.raises(HeadlabError, match="nope.de"):
        read_parallel(present, missing)


def test_bad_max_tokens(tmp_path):
    src = write(tmp_path / "s.en", ["a"])
    with pytest.raises(HeadlabError, match="max_tokens"):
        read_parallel(src, src, max_tokens=0)
