"""Word/subword alignment across the tokenizer pipelines of real model families (tests/support/tokenizers_zoo.py):
headlab aligns a sentence exactly as an independent oracle does (tests/support/alignment_oracle.py), or
refuses it; never a subword given to the wrong word. experiments/fuzz_alignment.py runs the same check
over many more sentences."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from headlab.data.alignment import Alignment, AlignmentError, align_sentences
from support.alignment_oracle import KINDS, check_sentence, reference_alignment
from support.tokenizers_zoo import PIPELINES, zoo_tokenizer

# derandomize: the same examples every run (~30 s on one thread; on old main it finds the RoBERTa offsets
# defect below); experiments/fuzz_alignment.py checked 6000 random sentences per pipeline (session 46).
SETTINGS = settings(max_examples=3000, deadline=None, database=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])

PIECES = sorted({piece for kind in KINDS for piece in kind})
words_strategy = st.lists(st.lists(st.sampled_from(PIECES), min_size=1, max_size=3).map("".join),
                          min_size=1, max_size=10)


@SETTINGS
@given(name=st.sampled_from(PIPELINES), words=words_strategy, data=st.data(),
       max_length=st.none() | st.integers(1, 40), seed=st.integers(0, 2**16))
def test_zoo_alignment_matches_the_oracle_or_refuses(name, words, data, max_length, seed):
    space_after = data.draw(st.none() | st.lists(st.booleans(), min_size=len(words), max_size=len(words)))
    outcome = check_sentence(name, words, space_after, max_length, random.Random(seed))  # raises Failure
    assert outcome != "over-refused", "headlab refuses a sentence the oracle aligns"


# Regression (session 46): a word that begins with a combining mark, glued to the word before it
# (SpaceAfter=No), composes with that word's last character under NFKC; tokenizers give the merged
# character the offsets of one of the two, so a subword went silently to the wrong word.
@pytest.mark.parametrize("name, words", [
    ("xlmr", ["㎏", "\u0301"]),  # "kg" + acute -> "kǵ": "ǵ" was word 2's, the "g" is word 1's
    ("t5", ["Œuvre", "\u0301\u0302a"]),  # "e" + acute -> "é", all given to word 1
    ("xlmr", ["a\u0301", "\u0323b"]),  # canonical reordering moves the dot below into word 1
])
def test_a_combining_mark_glued_to_the_word_before_is_refused(name, words):
    assert reference_alignment(name, words, [False, True]).refusal is not None
    result = align_sentences(zoo_tokenizer(name), [words], space_after=[[False, True]])[0]
    assert isinstance(result, AlignmentError)
    assert "without a space" in str(result) and repr(words[1]) in str(result)


@pytest.mark.parametrize("name", ["gpt2", "llama2", "mistral-metaspace", "bert-uncased"])
def test_a_glued_combining_mark_aligns_where_nothing_composes(name):
    """No composing normalization (byte-level, SentencePiece's Replace/Prepend, BERT's accent stripping): no refusal."""
    words = ["ab", "\u0301c"]
    assert check_sentence(name, words, [False, True], None, random.Random(0)) == "aligned"


@pytest.mark.parametrize("name", ["xlmr", "t5", "bert-uncased"])
def test_a_combining_mark_after_a_space_is_not_refused(name):
    """With a space between them the words cannot compose: only a glued mark is refused."""
    result = align_sentences(zoo_tokenizer(name), [["ab", "\u0301c"]], space_after=[[True, True]])[0]
    assert isinstance(result, Alignment) or "composes" not in str(result)
    assert "without a space" not in str(result)


# Regression (session 46): RoBERTa's post-processor (add_prefix_space, trim_offsets) gives the first subword
# after an added token typed in the text ("<s>", "</s>") an empty span one character too far ("<s>f b":
# "Ġf" at (4, 4)); covering no word's character it was taken for a boundary mark and given to the next word.
@pytest.mark.parametrize("words", [["<s>f", "b"], ["</s>f", "b"], ["x", "<s>ab", "c"]])
def test_a_subword_whose_offsets_miss_its_text_is_refused(words):
    assert reference_alignment("roberta", words, None).refusal is not None
    result = align_sentences(zoo_tokenizer("roberta"), [words])[0]
    assert isinstance(result, AlignmentError)
    assert "offsets" in str(result) and "cover no word" in str(result)


@pytest.mark.parametrize("name", ["roberta", "t5", "llama2", "mistral-metaspace"])
def test_boundary_marks_still_open_their_word(name):
    """A lone "▁" or a prefix "Ġ" (no text of its own) still belongs to the word it opens."""
    words = ["The", "dog", "sleeps", "."]
    assert check_sentence(name, words, None, None, random.Random(0)) == "aligned"
    owners = align_sentences(zoo_tokenizer(name), [words])[0].word_of_token.tolist()
    assert [w for w in owners if w >= 0] == sorted(w for w in owners if w >= 0)
