"""Bad input to the Python API (headlab.importance, functions, ...): refused before any work with a
message naming the keyword, never accepted and ignored."""

import re

import pytest

import headlab
from headlab.errors import HeadlabError
from support.models import tiny_model
from support.treebank import word_tokenizer

WORDS = "the a cat dog runs sleeps on mat".split()
TEXTS = ["the cat runs", "a dog sleeps on the mat"]


@pytest.fixture(scope="module")
def lm():
    model = tiny_model("gpt2").eval()
    return model, word_tokenizer(WORDS, style="gpt2")


def test_beam_of_a_language_model_is_refused(lm):
    """Regression: ``headlab.importance(..., beam=3)`` on a language model ran and its scores'
    signature said beam 3, of a model that makes no translation for a beam to search (the CLI's
    ``--beam`` and analyze refuse it)."""
    with pytest.raises(HeadlabError, match="^beam=3: the beam of the model's translations, and the model is a"):
        headlab.importance(*lm, TEXTS, measures="confidence", beam=3)
    assert headlab.importance(*lm, TEXTS, measures="confidence", beam=1).scores["confidence"].method == "confidence"


@pytest.mark.parametrize("change, expected", [
    ({"heads": (5, -1)}, "head 5 is outside the sentence (-1 for the root, else 0..1)"),
    ({"heads": (-1, -1), "deprels": ("root", "root")}, "word 2 is a second root (HEAD 0, as word 1)"),
    ({"heads": (1, 0)}, "word 1 is on a cycle of heads"),
    ({"upos": ("NOUN",), "heads": (1,)}, "2 words but upos 1, heads 1: every column has one value per word"),
])
def test_parsed_sentences_that_are_no_parse_are_refused(change, expected):
    """Regression: sentences built in Python (``headlab.functions(model, tokenizer, [Sentence(...)])``)
    skipped every check the CoNLL-U reader makes: a HEAD outside the sentence, two roots, or columns
    of other lengths (zip cut the words to the heads) were scored without a word."""
    from dataclasses import replace

    from headlab.data.treebank import InMemoryTreebank, Sentence

    good = Sentence(words=("cat", "runs"), upos=("NOUN", "VERB"), heads=(1, -1), deprels=("nsubj", "root"),
                    space_after=(True, True), sent_id="s1")
    InMemoryTreebank([good])  # a parse
    with pytest.raises(HeadlabError, match=r"^<sentences>: sentences\[1\] \(s1\): " + re.escape(expected)):
        InMemoryTreebank([good, replace(good, **change)], name="<sentences>")


@pytest.mark.parametrize("function", ["importance", "analyze"])
@pytest.mark.parametrize("keyword, value, expected", [
    ("max_length", 0, "max_length must be at least 2, got 0"),  # was the model's longest input
    ("max_length", 1.5, "max_length must be a whole number at least 2, got 1.5"),  # a TypeError in tokenizing
    ("limit", 1.5, "limit must be a whole number at least 1, got 1.5"),  # importance: every text; analyze: TypeError
    ("limit", True, "limit must be a whole number at least 1, got True"),  # was one text
])
def test_counts_that_are_not_whole_numbers_are_refused(lm, function, keyword, value, expected):
    """Regression: ``max_length=0`` was taken as "the model's longest input", ``limit=True`` as 1 and
    ``limit=1.5`` (importance) as every text; a float ``max_length`` failed deep in tokenizing."""
    with pytest.raises(HeadlabError, match=f"^{function}: " + re.escape(expected)):
        getattr(headlab, function)(*lm, TEXTS, measures="confidence", **{keyword: value})


def test_a_number_for_measures_and_a_string_key_of_heads_are_refused_clearly(lm):
    """Regression: ``measures=5`` was a TypeError ("'int' object is not iterable") from inside the
    call; a heads key "enc_self:0" was refused as ('e', 'n', 'c', ...), spelt letter by letter."""
    from support.models import tiny_model

    with pytest.raises(HeadlabError, match=r"^measures=5: give a name or a list of names"):
        headlab.importance(*lm, TEXTS, measures=5)
    with pytest.raises(HeadlabError, match=r"^statistics=5: give a name or a list of names"):
        headlab.analyze(*lm, TEXTS, measures="confidence", statistics=5)
    with pytest.raises(HeadlabError, match=r"^head spec keys must be \(kind, layer\), got \('enc_self:0',\)"):
        headlab.prune(tiny_model("marian"), {"enc_self:0": [1]})


def test_a_mapping_of_texts_is_refused(lm):
    """Regression: ``texts={"the cat runs": 1, ...}`` (texts with their classes) was read as its keys
    alone: scored, every label dropped, no word said."""
    with pytest.raises(HeadlabError, match=r"^texts: expected a list of sentences, got a dict \(a classifier's classes go "):
        headlab.importance(*lm, {text: 1 for text in TEXTS}, measures="confidence")


def test_prune_with_no_kind_named_and_a_float_query_chunk_are_refused(lm):
    """Regression: ``headlab.prune(model, scores, keep=3, kinds=[])`` kept the 3 best heads of every
    kind (an empty kinds was read as "all"), where importance refuses kinds=[]; ``query_chunk=1.5``
    was a TypeError from inside the pass."""
    from support.models import tiny_model
    from support.treebank import SAMPLE_CONLLU, word_tokenizer

    words = [line.split("\t")[1] for line in SAMPLE_CONLLU.splitlines() if line and line[0].isdigit()]
    model, tokenizer = tiny_model("marian").eval(), word_tokenizer(words)
    scores = headlab.importance(model, tokenizer, TEXTS, measures="confidence").scores["confidence"]
    for kinds in ([], ""):
        with pytest.raises(HeadlabError, match="^kinds: no kind given"):
            headlab.prune(tiny_model("marian"), scores, keep=3, kinds=kinds)
    with pytest.raises(HeadlabError, match=re.escape("functions: query_chunk must be a whole number at least 1, got 1.5")):
        headlab.functions(model, tokenizer, SAMPLE_CONLLU, query_chunk=1.5)
