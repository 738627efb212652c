"""Bad input to the Python API (headlab.importance, functions, ...): refused before any work with a
message naming the keyword, never accepted and ignored."""

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
