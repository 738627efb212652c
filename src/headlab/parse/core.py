"""One sentence per line in, one CoNLL-U sentence per line out.

Each non-blank input line is one sentence: its whitespace is collapsed to single spaces, spaCy's
tokenizer splits it, and the parser is told that no token after the first starts a sentence (the
arc-eager parser keeps preset boundaries), so every line becomes exactly one tree with one root.
A blank line is skipped; ``# sent_id`` is the input line number, so a sentence can always be
traced back (and paired with the same line of another file).

Columns written: ID, FORM, LEMMA ``_``, UPOS (the morphologizer's or tagger's POS), XPOS (the
tagger's tag, or ``_``), FEATS, HEAD, DEPREL (UD labels as the treebank was annotated; spaCy's
``ROOT`` becomes ``root``), DEPS ``_``, MISC ``SpaceAfter=No`` where the text had no space.

Loading a pipeline: ``spacy.load`` on a directory reads ``config.cfg`` (confection), ``meta.json``
and each component's weights and tables with srsly's msgpack (NumPy arrays are rebuilt with
``numpy.frombuffer``, which refuses object dtypes) and JSON: no pickle is involved. The config
names functions by registry name (``spacy.Tok2Vec.v2``, ...), resolved among installed packages;
nothing in the directory is imported or executed.
"""

from __future__ import annotations

import gzip
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from headlab.data.parallel import read_lines
from headlab.errors import HeadlabError, counted
from headlab.heads import atomic_write_bytes

__all__ = ["ParseReport", "check_pipeline_dir", "import_spacy", "load_pipeline", "parse_lines", "parse_text_file",
           "to_conllu"]

INSTALL_HINT = "pip install 'headlab[parse]' (or: pip install 'spacy>=3.8,<3.9')"
POS_COMPONENTS = ("morphologizer", "tagger")


@dataclass
class ParseReport:
    """What a parse read and wrote."""

    n_lines: int = 0
    n_blank: int = 0
    n_sentences: int = 0
    n_tokens: int = 0
    blank_lines: list[int] = field(default_factory=list)  # the first few, for the message

    def describe(self) -> str:
        text = (f"{counted(self.n_sentences, 'sentence', spec=',')} ({counted(self.n_tokens, 'token', spec=',')}) parsed "
                f"from {counted(self.n_lines, 'line', spec=',')}")
        if self.n_blank:
            shown = ", ".join(map(str, self.blank_lines))
            more = ", ..." if self.n_blank > len(self.blank_lines) else ""
            text += f"; {self.n_blank} blank lines skipped (line {shown}{more})"
        return text


def import_spacy():
    try:
        import spacy
    except ImportError:
        raise HeadlabError(f"headlab parse needs spaCy, which is not installed: {INSTALL_HINT}") from None
    return spacy


def check_pipeline_dir(path: str | os.PathLike, flag: str = "--model") -> Path:
    """``path`` looks like a saved spaCy pipeline (checked without importing spaCy)."""
    path = Path(path)
    if not path.exists():
        raise HeadlabError(f"{flag} {path}: no such directory")
    if not path.is_dir():
        raise HeadlabError(f"{flag} {path}: a file, not a spaCy pipeline directory")
    if not (path / "config.cfg").is_file() or not (path / "meta.json").is_file():
        raise HeadlabError(f"{flag} {path}: not a spaCy pipeline (no config.cfg and meta.json); build one with "
                           f"experiments/parser/train.sh")
    return path


def load_pipeline(path: str | os.PathLike, flag: str = "--model"):
    """A trained spaCy pipeline directory, checked to tag UPOS and to parse (HeadlabError if not)."""
    path = check_pipeline_dir(path, flag)
    spacy = import_spacy()
    try:
        nlp = spacy.load(path)
    except (OSError, ValueError, KeyError) as error:  # spaCy reports a bad directory as these
        raise HeadlabError(f"{flag} {path}: cannot load the spaCy pipeline ({error})") from None
    if "parser" not in nlp.pipe_names:
        raise HeadlabError(f"{flag} {path}: the pipeline has no parser (components: {', '.join(nlp.pipe_names)})")
    if not any(name in nlp.pipe_names for name in POS_COMPONENTS):
        raise HeadlabError(f"{flag} {path}: the pipeline has no morphologizer or tagger for UPOS "
                           f"(components: {', '.join(nlp.pipe_names)})")
    return nlp


def _one_sentence(nlp, text: str):
    """The tokenized line with every token after the first marked as not starting a sentence."""
    doc = nlp.make_doc(text)
    for token in doc[1:]:
        token.is_sent_start = False
    return doc


def parse_lines(nlp, texts: Iterable[str], batch_size: int = 64) -> Iterator:
    """spaCy ``Doc`` per text, each one sentence with one root."""
    docs = (_one_sentence(nlp, text) for text in texts)
    for doc in nlp.pipe(docs, batch_size=batch_size):
        roots = [token.i for token in doc if token.head.i == token.i]
        if len(roots) != 1:  # pragma: no cover - the parser keeps preset sentence boundaries
            raise RuntimeError(f"the parser split {doc.text!r} into {len(roots)} trees")
        yield doc


def _column(value: str) -> str:
    return value if value else "_"


def to_conllu(doc, sent_id: str) -> str:
    """One sentence block (comments, token lines, a blank line) for a parsed one-sentence ``Doc``."""
    lines = [f"# sent_id = {sent_id}", f"# text = {doc.text}"]
    last = len(doc) - 1
    for token in doc:
        head = 0 if token.head.i == token.i else token.head.i + 1
        deprel = "root" if head == 0 else token.dep_
        if not deprel:
            raise RuntimeError(f"token {token.i + 1} of {doc.text!r} has no dependency label")
        misc = "SpaceAfter=No" if not token.whitespace_ and token.i != last else "_"
        feats = str(token.morph)
        lines.append("\t".join((str(token.i + 1), token.text, "_", _column(token.pos_), _column(token.tag_),
                                _column(feats), str(head), deprel, "_", misc)))
    return "\n".join(lines) + "\n\n"


def _read_sentences(path: Path, report: ParseReport) -> list[tuple[int, str]]:
    sentences = []
    for number, line in enumerate(read_lines(path), start=1):
        text = " ".join(line.split())
        report.n_lines += 1
        if text:
            sentences.append((number, text))
        else:
            report.n_blank += 1
            if len(report.blank_lines) < 5:
                report.blank_lines.append(number)
    if not sentences:
        raise HeadlabError(f"--source {path}: no sentence (every line is blank)")
    return sentences


def parse_text_file(model: str | os.PathLike, input_path: str | os.PathLike, out: str | os.PathLike, *,
                    batch_size: int = 64, nlp=None, progress: bool = False) -> ParseReport:
    """Parse ``input_path`` (UTF-8 text, plain or ``.gz``, one sentence per line) into the CoNLL-U file
    ``out`` (gzip when it ends in ``.gz``), written at once when every line has been parsed.

    The input is read and checked before the pipeline loads: a line that is not UTF-8 is an error
    naming the line. ``nlp`` reuses a pipeline already loaded from ``model``.
    """
    input_path, out = Path(input_path), Path(out)
    report = ParseReport()
    sentences = _read_sentences(input_path, report)
    nlp = nlp if nlp is not None else load_pipeline(model)
    numbers: Sequence[int] = [number for number, _ in sentences]
    docs = parse_lines(nlp, (text for _, text in sentences), batch_size=batch_size)
    if progress:
        from tqdm.auto import tqdm

        docs = tqdm(docs, total=len(sentences), unit="sent", desc="parse", leave=False)
    blocks = []
    for number, doc in zip(numbers, docs):
        blocks.append(to_conllu(doc, str(number)))
        report.n_sentences += 1
        report.n_tokens += len(doc)
    data = "".join(blocks).encode("utf-8")
    atomic_write_bytes(out, gzip.compress(data, mtime=0) if out.suffix == ".gz" else data)
    return report
