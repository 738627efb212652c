"""Property tests (hypothesis) for the parsers that take the user's text: head specs, mask JSON,
CoNLL-U reading with positions kept, and word/subword alignment on random whitespace and
Unicode. Each holds for every input hypothesis draws: a right answer or a HeadlabError that
names the input, never another exception and never a silently wrong result."""

import json

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from headlab.adapters import attention_blocks
from headlab.data.alignment import Alignment, AlignmentError, align_sentences
from headlab.data.treebank import ProblemLog, TreebankCounts, read_conllu
from headlab.errors import HeadlabError
from headlab.headspec import load_mask_file, parse_heads
from support.models import tiny_model
from support.treebank import bpe_tokenizer

# derandomize: the same examples every run (no flaky CI); 600 random examples each passed once.
# No timing check (deadline, too_slow): a draw took 31 s once on a CI box under load 8, failing a test of no speed
SETTINGS = settings(max_examples=60, deadline=None, database=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
BLOCKS = attention_blocks(tiny_model("marian"))  # enc_self, dec_self, dec_cross: 2 layers x 4 heads
KEYS = sorted({(b.kind, b.layer) for b in BLOCKS})

def _scratch(factory):
    """One directory for every example (a new one per example would cost more than the test)."""
    path = factory.getbasetemp() / "properties"
    path.mkdir(exist_ok=True)
    return path


specs = st.dictionaries(st.sampled_from(KEYS), st.sets(st.integers(0, 3), min_size=1), max_size=len(KEYS))


def _typed(spec, data) -> str:
    """``spec`` written as a person might: ranges, duplicates, ``*``, any separators."""
    items = []
    for (kind, layer), heads in spec.items():
        heads = sorted(heads)
        if heads == [0, 1, 2, 3] and data.draw(st.booleans()):
            text = "*"
        else:
            parts = [f"{h}-{h + 1}" if h + 1 in heads and data.draw(st.booleans()) else str(h) for h in heads]
            parts += data.draw(st.lists(st.sampled_from([str(h) for h in heads]), max_size=2))  # repeats
            text = ",".join(data.draw(st.permutations(parts)))
        items.append(f"{kind}:{layer}:{text}")
    separators = st.sampled_from([" ", ";", "  ", "\t", " ; ", "\n"])
    return "".join(item + data.draw(separators) for item in items)


@SETTINGS
@given(specs, st.data())
def test_typed_spec_round_trips(spec, data):
    assume(spec)
    expected = {key: sorted(heads) for key, heads in spec.items()}
    assert parse_heads(_typed(spec, data), BLOCKS) == expected


@SETTINGS
@given(specs, st.booleans())
def test_mask_files_round_trip(tmp_path_factory, spec, keep_matrix):
    path = _scratch(tmp_path_factory) / "mask.json"
    if keep_matrix:
        document = {kind: [[0 if h in spec.get((kind, layer), ()) else 1 for h in range(4)] for layer in range(2)]
                    for kind in sorted({k for k, _ in spec})}
    else:
        document = {}
        for (kind, layer), heads in spec.items():
            document.setdefault(kind, {})[str(layer)] = sorted(heads)
    path.write_text(json.dumps(document), encoding="utf-8")
    assert load_mask_file(path, BLOCKS) == {key: sorted(heads) for key, heads in spec.items()}


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 6) | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["enc_self", "dec_self", "dec_cross", "0", "1", "7", "scores", "x"]), inner, max_size=4),
    max_leaves=12)


@SETTINGS
@given(json_values)
def test_any_json_gives_a_valid_spec_or_an_error_naming_the_file(tmp_path_factory, document):
    path = _scratch(tmp_path_factory) / "any.json"
    path.write_text(json.dumps(document), encoding="utf-8")
    try:
        spec = load_mask_file(path, BLOCKS)
    except HeadlabError as error:
        assert str(error).startswith(f"{path}: ")
        return
    for (kind, layer), heads in spec.items():
        assert (kind, layer) in KEYS and heads == sorted(set(heads)) and all(type(h) is int and 0 <= h < 4 for h in heads)


@SETTINGS
@given(st.text(max_size=30))
def test_any_typed_text_gives_a_valid_spec_or_an_error_naming_the_option(text):
    assume(not text.endswith(".json"))
    try:
        spec = parse_heads(text, BLOCKS)
    except HeadlabError as error:
        assert str(error).startswith("--heads")
        return
    assert all(key in KEYS and all(0 <= h < 4 for h in heads) for key, heads in spec.items())


# -- CoNLL-U ---------------------------------------------------------------------------------
words = st.text(st.characters(blacklist_categories=("Cc", "Cs", "Zs", "Zl", "Zp"), blacklist_characters="#\ufeff"),
                min_size=1, max_size=6)
CORRUPTIONS = ("columns", "head", "cycle", "bytes", "deprel")


@st.composite
def sentences(draw):
    """A random tree over random words: each word's governor comes before it in a random order."""
    n = draw(st.integers(1, 7))
    form = draw(st.lists(words, min_size=n, max_size=n))
    order = draw(st.permutations(range(n)))
    heads = [0] * n
    for position, word in enumerate(order[1:], start=1):
        heads[word] = order[draw(st.integers(0, position - 1))] + 1
    deprels = draw(st.lists(st.sampled_from(["nsubj", "obj", "amod", "advmod", "det", "nmod:poss"]), min_size=n, max_size=n))
    corrupt = draw(st.none() | st.sampled_from(CORRUPTIONS))
    return form, heads, deprels, corrupt


def _block(index, form, heads, deprels, corrupt) -> bytes:
    rows = [[str(i), word, word, "X", "_", "_", str(head), "root" if head == 0 else deprel, "_", "_"]
            for i, (word, head, deprel) in enumerate(zip(form, heads, deprels), start=1)]
    first = rows[0]
    if corrupt == "columns":
        del first[8:]
    elif corrupt == "head":
        first[6] = str(len(form) + 1)
    elif corrupt == "cycle":
        first[6] = "1"  # word 1 governs itself
    elif corrupt == "deprel":
        first[7] = "_"
    lines = [f"# sent_id = s{index}"] + ["\t".join(row) for row in rows]
    data = "\n".join(lines).encode("utf-8")
    return data.replace(b"\t", b"\xff\t", 1) if corrupt == "bytes" else data


@SETTINGS
@given(st.lists(sentences(), min_size=1, max_size=6), st.sampled_from(["\n", "\r\n"]), st.booleans(),
       st.integers(1, 3))
def test_conllu_reading_keeps_every_position(tmp_path_factory, drawn, newline, bom, blank_lines):
    """Sentence i of the file is item i of a lenient read with keep_place: the sentence as
    written, or None where it is malformed (counted and reported with its line)."""
    separator = newline.encode() * (blank_lines + 1)
    data = separator.join(_block(i, *s) for i, s in enumerate(drawn)).replace(b"\n", newline.encode())
    path = _scratch(tmp_path_factory) / "random.conllu"
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + data + newline.encode())
    problems, counts = ProblemLog(), TreebankCounts()
    read = list(read_conllu(path, problems=problems, counts=counts, keep_place=True))
    assert len(read) == len(drawn)
    for sentence, (form, heads, _deprels, corrupt) in zip(read, drawn):
        if corrupt is not None:
            assert sentence is None
            continue
        assert sentence.words == tuple(form)
        assert sentence.heads == tuple(h - 1 for h in heads)
    n_bad = sum(s[3] is not None for s in drawn)
    assert counts.n_malformed == n_bad and counts.n_sentences == len(drawn) - n_bad
    assert all(p.path == str(path) and p.line >= 1 for p in problems.problems)


# -- word/subword alignment ----------------------------------------------------------------
TOKENIZER = bpe_tokenizer(["the quick brown fox jumps over the lazy dog", "ein Bär schläft", "über straße",
                           "a cat sat on the mat", "東京 タワー", "naïve café"] * 3, vocab_size=80)


@SETTINGS
@given(st.lists(st.lists(words, min_size=1, max_size=6), min_size=1, max_size=3), st.none() | st.integers(3, 12))
def test_alignment_maps_every_subword_to_its_own_word(batch, max_length):
    for words_, alignment in zip(batch, align_sentences(TOKENIZER, batch, max_length=max_length)):
        if isinstance(alignment, AlignmentError):
            continue  # reported and skipped by the caller
        assert isinstance(alignment, Alignment)
        owners = alignment.word_of_token.tolist()
        assert all(-1 <= w < alignment.n_words for w in owners)
        kept = [w for w in owners if w >= 0]
        assert kept == sorted(kept) and set(kept) == set(range(alignment.n_words))  # in order, none lost
        assert alignment.n_words == len(words_) or alignment.truncated  # words are lost only to truncation
        if max_length is not None:
            assert len(alignment.input_ids) <= max_length
        if not alignment.truncated:
            reference = TOKENIZER(list(words_), is_split_into_words=True).word_ids()
            assert owners == [-1 if w is None else w for w in reference]
