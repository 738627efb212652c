"""CoNLL-U treebanks (Universal Dependencies), read one sentence at a time.

Each token line is split on tabs (only: FORM, LEMMA and MISC may hold spaces) and the columns
used read as the ``conllu`` package reads them (plain numbers with ``int()``, any other ID or HEAD
and MISC with its parsers). Multiword-token lines (``1-2``) and
empty nodes (``8.1``) are skipped and counted: the analysis works on syntactic words, the
units that carry UPOS tags and dependency arcs. A malformed sentence is reported with its file
and line and skipped; the rest of the file is still read (``strict=True`` raises instead).

Relations are matched on the full DEPREL (``nsubj`` does not match ``nsubj:pass``); ``X:*``
matches ``X`` and every subtype of it. The paper's (Stanford) ``dobj`` is UD's ``obj``
(Voita et al. 2019, Sec. 5.2.1 use ``dobj``), so the name ``dobj`` matches both.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from conllu.exceptions import ParseException
from conllu.parser import (
    DEFAULT_FIELDS,
    parse_comment_line,
    parse_dict_value,
    parse_id_value,
    parse_int_value,
)

from headlab.data.parallel import numbered_lines, open_binary
from headlab.errors import HeadlabError, counted

__all__ = [
    "PAPER_RELATIONS",
    "RELATION_ALIASES",
    "UD_RELATIONS",
    "UPOS_TAGS",
    "Problem",
    "ProblemLog",
    "InMemoryTreebank",
    "Sentence",
    "Treebank",
    "check_has_sentence",
    "count_sentences",
    "read_conllu",
    "relation_matcher",
]

UPOS_TAGS = (
    "ADJ", "ADP", "ADV", "AUX", "CCONJ", "DET", "INTJ", "NOUN", "NUM",
    "PART", "PRON", "PROPN", "PUNCT", "SCONJ", "SYM", "VERB", "X",
)
"""The 17 universal part-of-speech tags (UD v2)."""

PAPER_RELATIONS = ("nsubj", "dobj", "amod", "advmod")
"""The relations of Voita et al. 2019, Table 1."""

RELATION_ALIASES = {"dobj": ("obj", "dobj")}
"""Paper name -> UD v2 labels it stands for (UD v1 and Stanford called ``obj`` ``dobj``)."""

UD_RELATIONS = frozenset((
    "acl", "advcl", "advmod", "amod", "appos", "aux", "case", "cc", "ccomp", "clf", "compound", "conj", "cop",
    "csubj", "dep", "det", "discourse", "dislocated", "expl", "fixed", "flat", "goeswith", "iobj", "list", "mark",
    "nmod", "nsubj", "nummod", "obj", "obl", "orphan", "parataxis", "punct", "reparandum", "root", "vocative",
    "xcomp",
    # UD v1 names still found in older treebanks
    "dobj", "nsubjpass", "csubjpass", "auxpass", "name", "mwe", "neg", "remnant",
))
"""The universal relations of UD v2 (and v1): a relation's part before any ``:subtype``."""


def relation_matcher(name: str) -> Callable[[str], bool]:
    """A predicate over DEPREL labels for the relation ``name``.

    ``dobj`` matches UD's ``obj``; ``X:*`` matches ``X`` and any ``X:subtype`` (``dobj:*``: ``obj``,
    ``dobj`` and their subtypes); any other name matches that exact label.
    """
    name = name.strip()
    if not name:
        raise HeadlabError("empty relation name")
    if name.split(":", 1)[0] not in UD_RELATIONS:
        raise HeadlabError(f"{name!r} is not a Universal Dependencies relation (nor X:subtype or X:* of one); "
                           f"expected one of {', '.join(sorted(UD_RELATIONS))}")
    if name.endswith(":*"):
        bases = RELATION_ALIASES.get(name[:-2], (name[:-2],))
        return lambda label: any(label == base or label.startswith(base + ":") for base in bases)
    labels = frozenset(RELATION_ALIASES.get(name, (name,)))
    return lambda label: label in labels


@dataclass(frozen=True)
class Problem:
    """Something in the input that could not be used, with where it is."""

    path: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}" if self.line else f"{self.path}: {self.message}"


@dataclass
class ProblemLog:
    """Problems met during a run, counted by kind; the first ``keep`` are kept in full."""

    keep: int = 200
    problems: list[Problem] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, problem: Problem) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if len(self.problems) < self.keep:
            self.problems.append(problem)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def to_json(self) -> dict:
        return {"counts": dict(self.counts), "first": [str(p) for p in self.problems]}


@dataclass(frozen=True)
class Sentence:
    """One parsed sentence: syntactic words with UPOS tags and dependency arcs.

    ``heads[i]`` is the 0-based index of word ``i``'s governor, -1 for the root.
    ``line`` is the 1-based line where the sentence starts in ``path``.
    """

    words: tuple[str, ...]
    upos: tuple[str, ...]
    heads: tuple[int, ...]
    deprels: tuple[str, ...]
    space_after: tuple[bool, ...]
    sent_id: str = ""
    path: str = ""
    line: int = 0
    text: str | None = None

    def __len__(self) -> int:
        return len(self.words)

    @property
    def where(self) -> str:
        name = f" ({self.sent_id})" if self.sent_id else ""
        return f"{self.path}:{self.line}{name}"

    def arcs(self) -> Iterator[tuple[int, int, str]]:
        """``(governor, dependent, deprel)`` for every non-root word."""
        for dependent, (governor, label) in enumerate(zip(self.heads, self.deprels)):
            if governor >= 0:
                yield governor, dependent, label


@dataclass
class TreebankCounts:
    """What reading a treebank skipped, for the run's summary."""

    n_sentences: int = 0
    n_words: int = 0
    n_multiword_tokens: int = 0
    n_empty_nodes: int = 0
    n_malformed: int = 0

    def to_json(self) -> dict:
        return dict(self.__dict__)


# The columns a Sentence is made of: ID, FORM, UPOS, HEAD, DEPREL, MISC. LEMMA, XPOS, FEATS and DEPS
# are not read, nor checked (conllu's own parser would refuse a DEPS such as "2-1:nsubj"; headlab has no
# use for it). ID and HEAD: a plain number (ASCII digits, no leading zero, "0" itself included: the
# one form that conllu's ID and HEAD patterns read as int(value)) is read with int() in the loop of
# _parse_block (conllu's regex match per field was a good part of the reading time); any other value
# (1-2, 1.1, _, a bad one) goes to conllu's parser. MISC goes to conllu's parser only where it names
# SpaceAfter, the one key read.
_ID, _FORM, _UPOS, _HEAD, _DEPREL, _MISC = (DEFAULT_FIELDS.index(name)
                                           for name in ("id", "form", "upos", "head", "deprel", "misc"))


class InMemoryTreebank:
    """A treebank held in memory, read like a CoNLL-U file called ``name``: CoNLL-U text, or
    sentences already parsed (:class:`Sentence`, e.g. from :func:`read_conllu`)."""

    def __init__(self, source: "str | Sequence[Sentence]", name: str = "<treebank>") -> None:
        if not isinstance(source, str):
            source = tuple(source)
            bad = next((s for s in source if not isinstance(s, Sentence)), None)
            if bad is not None:
                raise HeadlabError(f"{name}: parsed sentences must be headlab Sentence objects, got {type(bad).__name__}")
            for index, sentence in enumerate(source):
                if (problem := _parse_problem(sentence)) is not None:
                    where = f"sentences[{index}]" + (f" ({sentence.sent_id})" if sentence.sent_id else "")
                    raise HeadlabError(f"{name}: {where}: {problem}")
        self.source, self.name = source, name

    def __str__(self) -> str:
        return self.name

    def lines(self) -> Iterator[tuple[int, bytes]]:
        """``(line number, raw line)`` of the CoNLL-U text, as :func:`numbered_lines` gives a file's."""
        assert isinstance(self.source, str)
        text = self.source.lstrip("\ufeff")
        return enumerate(text.encode("utf-8").splitlines(keepends=True), start=1)


def _parse_problem(sentence: "Sentence") -> str | None:
    """What makes a Sentence built in Python not a parse the CoNLL-U reader would give (columns of
    other lengths, a HEAD outside it, a cycle, two roots), or None: the reader's checks, which such
    sentences skip."""
    n = len(sentence.words)
    lengths = {"upos": len(sentence.upos), "heads": len(sentence.heads), "deprels": len(sentence.deprels),
               "space_after": len(sentence.space_after)}
    if n == 0:
        return "sentence has no words"
    if other := [f"{field} {length}" for field, length in lengths.items() if length != n]:
        return f"{n} words but {', '.join(other)}: every column has one value per word"
    if bad := [head for head in sentence.heads if not (isinstance(head, numbers.Integral) and -1 <= head < n)]:
        return f"head {bad[0]!r} is outside the sentence (-1 for the root, else 0..{n - 1})"
    heads = [head + 1 for head in sentence.heads]  # the reader's 1-based HEADs, 0 the root
    if (cycle := _cycle(heads)) is not None:
        return f"word {cycle + 1} is on a cycle of heads: the parse is not a tree"
    if second := _second_root(heads):
        return _two_roots(second)
    return None


TreebankSource = "str | Path | InMemoryTreebank"
"""A CoNLL-U file (plain or ``.gz``) or a treebank in memory."""


def _blocks(path: "Path | InMemoryTreebank") -> Iterator[tuple[int, list[tuple[int, str]], tuple[int, str] | None]]:
    """``(first line, [(line number, text), ...], bad)`` for each blank-line separated block.

    ``bad`` is ``(line, message)`` for a block with bytes that are not UTF-8, else None: such a
    block is still yielded, so that the reader can skip it in its place (a paired run keeps its
    pairing). A UTF-8 byte order mark at the start of the file is dropped.
    """
    block: list[tuple[int, str]] = []
    bad: tuple[int, str] | None = None
    for number, raw in (path.lines() if isinstance(path, InMemoryTreebank) else numbered_lines(path)):
        try:
            line = raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError as error:
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            if bad is None:
                bad = (number, f"not valid UTF-8 ({error.reason} at byte {error.start})")
        if line.strip():
            block.append((number, line))
            continue
        if block:
            yield block[0][0], block, bad
            block, bad = [], None
    if block:
        yield block[0][0], block, bad


class _Malformed(Exception):
    def __init__(self, line: int, message: str) -> None:
        super().__init__(message)
        self.line = line
        self.message = message


def _parse_block(path: "Path | InMemoryTreebank", start: int, block: list[tuple[int, str]], counts: TreebankCounts) -> Sentence:
    """Parse one sentence block (``conllu``'s parsers where a value is not a plain number); raise
    _Malformed naming the bad line.

    A token line is split on tabs only: UD v2 allows spaces in FORM, LEMMA and MISC, and
    conllu's own line split (``parse_line``: tabs *or* two spaces) would read "New  York" as two
    columns and shift every later one. A line that is not 10 tab-separated columns (a
    space-separated one included) is refused, not guessed at.

    One pass over the lines. A line that does not parse (a comment, the column count, ID, HEAD) is
    refused before any word's error (ID out of sequence, HEAD or DEPREL '_'), wherever the two are:
    the first word error is held until every line has parsed.
    """
    metadata: dict = {}
    words: list[str]
    words, upos, heads, deprels, space_after, word_lines = [], [], [], [], [], []
    n_multiword = n_empty = 0
    held: _Malformed | None = None
    for number, line in block:
        if line.startswith("#"):
            try:
                metadata.update(parse_comment_line(line))
            except ParseException as error:
                raise _Malformed(number, f"not a CoNLL-U line ({error})") from None
            continue
        columns = line.split("\t")
        if len(columns) != 10:
            raise _Malformed(number, f"expected 10 tab-separated columns, found {len(columns)}")
        # conllu strips each line: spaces around it go, as they did (tabs are columns, counted above)
        value = columns[_ID].lstrip()
        try:
            # a plain number (see _ID above), tested inline: a call per field was ~2 ms of ~25 at 16k words
            token_id = (int(value) if value.isdigit() and value.isascii() and (value[0] != "0" or value == "0")
                        else parse_id_value(value))
        except ParseException as error:
            raise _Malformed(number, f"not a CoNLL-U line (Failed parsing field 'id': {error})") from None
        value = columns[_HEAD]
        try:
            head = (int(value) if value.isdigit() and value.isascii() and (value[0] != "0" or value == "0")
                    else parse_int_value(value))
        except ParseException as error:
            raise _Malformed(number, f"not a CoNLL-U line (Failed parsing field 'head': {error})") from None
        if held is not None:
            continue
        if isinstance(token_id, tuple):
            if token_id[1] == "-":
                n_multiword += 1
            else:
                n_empty += 1
            continue
        deprel = columns[_DEPREL]
        if token_id != len(words) + 1:
            held = _Malformed(number, f"word id {token_id} out of sequence (expected {len(words) + 1})")
        elif head is None:
            held = _Malformed(number, "HEAD is '_': the sentence has no dependency parse")
        elif not deprel or deprel == "_":
            held = _Malformed(number, "DEPREL is '_'")
        else:
            misc = columns[_MISC].rstrip()
            words.append(columns[_FORM])
            upos.append(columns[_UPOS] or "_")
            heads.append(head)
            deprels.append(deprel)
            # parse_dict_value gives a SpaceAfter key only to a MISC that names it
            space_after.append("SpaceAfter" not in misc or (parse_dict_value(misc) or {}).get("SpaceAfter") != "No")
            word_lines.append(number)
    if held is not None:
        raise held
    if not words:
        raise _Malformed(start, "sentence has no words")
    n = len(words)
    if min(heads) < 0 or max(heads) > n:
        number, head = next((number, head) for number, head in zip(word_lines, heads) if not 0 <= head <= n)
        raise _Malformed(number, f"HEAD {head} is outside the sentence (0..{n})")
    cycle = _cycle(heads)
    if cycle is not None:
        raise _Malformed(word_lines[cycle], f"word {cycle + 1} is on a cycle of HEADs: the parse is not a tree")
    if second := _second_root(heads):
        raise _Malformed(word_lines[second[1]], _two_roots(second))
    counts.n_multiword_tokens += n_multiword
    counts.n_empty_nodes += n_empty
    return Sentence(
        words=tuple(words),
        upos=tuple(upos),
        heads=tuple(h - 1 for h in heads),
        deprels=tuple(deprels),
        space_after=tuple(space_after),
        sent_id=str(metadata.get("sent_id") or ""),
        path=str(path),
        line=start,
        text=metadata.get("text"),
    )


def _second_root(heads: list[int]) -> tuple[int, int] | None:
    """The 0-based indices of the first two words of HEAD 0 (1-based ``heads``), or None: UD's basic
    dependencies are a tree with exactly one root (universaldependencies.org/format.html, HEAD;
    its validator's "multiple-roots")."""
    roots = [i for i, head in enumerate(heads) if head == 0]
    return (roots[0], roots[1]) if len(roots) > 1 else None


def _two_roots(roots: tuple[int, int]) -> str:
    return (f"word {roots[1] + 1} is a second root (HEAD 0, as word {roots[0] + 1}): a sentence's basic dependencies "
            "have exactly one root")


def _cycle(heads: list[int]) -> int | None:
    """The 0-based index of a word on a cycle of 1-based ``heads`` (0 = root), or None."""
    state = [0] * len(heads)  # 0 unseen, 1 on the current path, 2 reaches the root
    for first in range(len(heads)):
        path, word = [], first
        while word >= 0 and state[word] == 0:
            state[word] = 1
            path.append(word)
            word = heads[word] - 1
        if word >= 0 and state[word] == 1:
            return word
        for visited in path:
            state[visited] = 2
    return None


def read_conllu(
    path: "str | Path | InMemoryTreebank",
    *,
    problems: ProblemLog | None = None,
    counts: TreebankCounts | None = None,
    limit: int | None = None,
    keep_place: bool = False,
) -> Iterator[Sentence | None]:
    """Yield the sentences of a CoNLL-U file (plain or ``.gz``) one at a time.

    With ``problems`` a malformed sentence is logged (file, line, what is wrong) and skipped;
    without it the first one raises :class:`HeadlabError`. With ``keep_place`` a skipped
    sentence yields ``None`` instead, so that two files stay paired sentence by sentence.
    ``counts`` collects how many sentences, multiword tokens and empty nodes were read or
    skipped. ``limit`` stops after that many sentences. ``path`` may be an
    :class:`InMemoryTreebank` (parsed sentences are yielded as they are, counted).
    """
    counts = counts if counts is not None else TreebankCounts()
    if isinstance(path, InMemoryTreebank) and not isinstance(path.source, str):
        for sentence in path.source[:limit]:
            counts.n_sentences += 1
            counts.n_words += len(sentence)
            yield sentence
        return
    if not isinstance(path, InMemoryTreebank):
        path = _conllu_path(path)
    seen = 0
    for start, block, bad in _blocks(path):
        if all(line.startswith("#") for _, line in block):
            # A comment-only block (e.g. a trailing "# newdoc") holds no sentence and no place.
            if bad is not None:
                if problems is None:
                    raise HeadlabError(f"{path}:{bad[0]}: {bad[1]}")
                problems.add("encoding", Problem(str(path), bad[0], bad[1] + " in a comment"))
            continue
        if limit is not None and seen >= limit:
            return
        try:
            if bad is not None:
                raise _Malformed(*bad)
            sentence = _parse_block(path, start, block, counts)
        except _Malformed as error:
            counts.n_malformed += 1
            if problems is None:
                raise HeadlabError(f"{path}:{error.line}: {error.message}") from None
            problems.add("malformed", Problem(str(path), error.line, error.message + "; sentence skipped"))
            if keep_place:
                seen += 1
                yield None
            continue
        counts.n_sentences += 1
        counts.n_words += len(sentence)
        seen += 1
        yield sentence


def _conllu_path(path: "str | os.PathLike") -> Path:
    """``path`` as a Path, refused if empty (``Path("")`` would be the current directory), missing
    or a directory, each said as it is."""
    if not os.fspath(path):
        raise HeadlabError("CoNLL-U file: the path is empty")
    path = Path(path)
    if path.is_dir():
        raise HeadlabError(f"CoNLL-U file {path}: a directory, not a file")
    if not path.exists():
        raise HeadlabError(f"CoNLL-U file not found: {path}")
    return path


def count_sentences(path: "str | Path | InMemoryTreebank") -> int:
    """The number of sentence blocks in a CoNLL-U file, without parsing them (for progress bars)."""
    if isinstance(path, InMemoryTreebank):
        return len(path.source) if not isinstance(path.source, str) else _count_blocks(raw for _, raw in path.lines())
    path = _conllu_path(path)
    with open_binary(path) as handle:
        return _count_blocks(handle)


def check_has_sentence(path: "str | Path", flag: str) -> None:
    """Refuse, before any work, a CoNLL-U file with no well-formed sentence (comments and blank lines only, or
    every sentence malformed): a command found it after loading the model, analyze after its importance stages
    had run. Read up to its first well-formed sentence."""
    problems = ProblemLog(keep=1)
    for _ in read_conllu(path, problems=problems):
        return
    malformed = problems.counts.get("malformed", 0)
    if not malformed:
        raise HeadlabError(f"{flag} {path}: holds no sentence (only comments and blank lines)")
    first = str(problems.problems[0]).removesuffix("; sentence skipped")
    raise HeadlabError(f"{flag} {path}: no well-formed sentence ({counted(malformed, 'sentence')}, all malformed; "
                       f"the first: {first})")


def _count_blocks(lines) -> int:
    """The blocks :func:`read_conllu` reads as sentences, split as :func:`_blocks` splits them: a line blank to
    ``str.strip`` (a no-break space too) ends a block, a block of comments alone is none, a byte order mark
    opens no line. Counted on the bytes (``bytes.strip``, ``startswith(b"#")``) a no-break space line joined
    two sentences and a comment block after a byte order mark was one, which the paired check miscounted."""
    n, in_block = 0, False
    for index, raw in enumerate(lines):
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        if index == 0:
            line = line.lstrip("\ufeff")
        if not line.strip():
            in_block = False
        elif not line.startswith("#") and not in_block:
            n, in_block = n + 1, True
    return n


@dataclass
class Treebank:
    """A CoNLL-U file that can be read (streamed) more than once."""

    path: Path
    limit: int | None = None

    def __post_init__(self) -> None:
        self.path = _conllu_path(self.path)

    def sentences(self, problems: ProblemLog | None = None, counts: TreebankCounts | None = None) -> Iterator[Sentence]:
        # read_conllu yields None only with keep_place=True
        return cast(Iterator[Sentence], read_conllu(self.path, problems=problems, counts=counts, limit=self.limit))

    def __iter__(self) -> Iterator[Sentence]:
        return self.sentences()

    def __len__(self) -> int:
        n = count_sentences(self.path)
        return n if self.limit is None else min(n, self.limit)
