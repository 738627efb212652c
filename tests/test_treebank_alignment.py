"""Words to subwords for fast tokenizers, and word-level attention (Clark et al. 2019)."""

import pytest
import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from headlab.data.alignment import AlignmentError, align_sentences, join_words, word_attention
from headlab.errors import HeadlabError
from support.treebank import bpe_tokenizer, sample_sentences, side_batch, word_tokenizer

TEXTS = ["the quick brown fox jumps over the lazy dog", "a cat sat on the mat", "dogs and cats"] * 3


def test_join_words_spacing():
    assert join_words(["a", "b", "."]) == ("a b .", [(0, 1), (2, 3), (4, 5)])
    assert join_words(["a", "b", "."], [True, False, True]) == ("a b.", [(0, 1), (2, 3), (3, 4)])


def _join_words_loop(words, space_after=None):
    """The per-word loop ``join_words`` replaced (reference)."""
    parts, spans, position = [], [], 0
    for index, word in enumerate(words):
        spans.append((position, position + len(word)))
        parts.append(word)
        position += len(word)
        if index + 1 < len(words) and (space_after is None or space_after[index]):
            parts.append(" ")
            position += 1
    return "".join(parts), spans


def test_join_words_matches_the_per_word_loop():
    import random

    from headlab.data.alignment import _MANY_WORDS

    rng = random.Random(1)
    for case in range(600):  # short sentences (a loop per word) and long ones (whole lists)
        size = rng.randint(0, 8) if case % 3 else rng.randint(_MANY_WORDS - 2, 3 * _MANY_WORDS)
        words = [rng.choice(["", "a", "bc", "d e", "ü", "_"]) for _ in range(size)]
        spacing = [rng.choice([True, False, 0, 1]) for _ in words]
        for space_after in (None, spacing):
            text, spans = join_words(words, space_after)
            assert (text, spans) == _join_words_loop(words, space_after)
            assert all(type(start) is int and type(end) is int for start, end in spans)


def test_word_level_tokenizer_one_token_per_word(tmp_path):
    sentences = sample_sentences(tmp_path)
    tokenizer = word_tokenizer([w for s in sentences for w in s.words])
    alignment = align_sentences(tokenizer, [sentences[0].words])[0]
    assert alignment.word_of_token.tolist() == list(range(9)) + [-1]  # EOS belongs to no word
    assert alignment.n_words == 9 and not alignment.truncated


def test_subwords_map_to_their_words_and_match_word_ids():
    tokenizer = bpe_tokenizer(TEXTS, vocab_size=40)
    words = ["the", "lazy", "xylophone", ",", "jumps", "!"]
    (alignment,) = align_sentences(tokenizer, [words])
    tokens = tokenizer.convert_ids_to_tokens(list(alignment.input_ids))
    assert len(tokens) > len(words) + 1  # really split into subwords
    # Independent reference: the tokenizer's own pre-tokenized word ids.
    expected = tokenizer(words, is_split_into_words=True).word_ids()
    assert alignment.word_of_token.tolist() == [-1 if w is None else w for w in expected]
    # Lone boundary markers "▁" belong to the word they open.
    for t, token in enumerate(tokens):
        if token == "▁":
            assert alignment.word_of_token[t] == alignment.word_of_token[t + 1]


def test_text_spacing_subword_across_words_is_an_alignment_error():
    tokenizer = bpe_tokenizer(["cats. dogs. cats. dogs."] * 20, vocab_size=40)
    # With the treebank's spacing "cats" and "." touch, and BPE has learnt "s." as one piece.
    result = align_sentences(tokenizer, [["cats", "."]], space_after=[[False, True]])[0]
    assert isinstance(result, AlignmentError) and "spans the words" in str(result)
    assert str(result) == "subword '▁cats.' spans the words 'cats' and '.'"  # the token's text, made lazily
    assert not isinstance(align_sentences(tokenizer, [["cats", "."]])[0], AlignmentError)


def test_word_without_subword_is_an_alignment_error():
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, "a": 3, "b": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Replace("#", "")
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>")
    result = align_sentences(tokenizer, [["a", "#", "b"]])[0]
    assert isinstance(result, AlignmentError) and "'#' gets no subword" in str(result)


def test_truncation_keeps_whole_words_and_says_so():
    tokenizer = bpe_tokenizer(TEXTS, vocab_size=40)
    words = ["the", "xylophone", "jumps", "over", "the", "dog"]
    full = align_sentences(tokenizer, [words])[0]
    cut = align_sentences(tokenizer, [words], max_length=6)[0]
    assert len(cut.input_ids) == 6 and cut.truncated and not full.truncated
    assert 0 < cut.n_words < len(words)
    kept = cut.word_of_token[cut.word_of_token >= 0]
    assert kept.max() == cut.n_words - 1
    # Every kept word has all the subwords it has in the untruncated tokenization.
    for w in range(cut.n_words):
        assert (cut.word_of_token == w).sum() == (full.word_of_token == w).sum()


def test_slow_tokenizer_is_refused():
    class Slow:
        is_fast = False

    with pytest.raises(HeadlabError, match="not a fast tokenizer"):
        align_sentences(Slow(), [["a"]])


def test_word_attention_is_sum_to_and_mean_from_subwords():
    tokenizer = bpe_tokenizer(TEXTS, vocab_size=40)

    class S:  # minimal sentence
        def __init__(self, words):
            self.words = words
            self.heads = tuple([-1] * len(words))
            self.deprels = ("root",) * len(words)
            self.upos = ("X",) * len(words)
            self.sent_id, self.where = "", ""

    sentences = [S(("the", "xylophone", "jumps")), S(("lazy", "dogs", "and", "cats", "over"))]
    side, alignments = side_batch(sentences, tokenizer)
    B, T = side.token_ids.shape
    torch.manual_seed(0)
    probs = torch.rand(B, 3, T, T)
    probs = probs / probs.sum(-1, keepdim=True)
    words = word_attention(probs, side)
    for b, alignment in enumerate(alignments):
        owner = alignment.word_of_token.tolist()
        n = alignment.n_words
        for h in range(3):
            for i in range(n):
                queries = [t for t, w in enumerate(owner) if w == i]
                for j in range(n):
                    keys = [t for t, w in enumerate(owner) if w == j]
                    expected = sum(sum(float(probs[b, h, q, k]) for k in keys) for q in queries) / len(queries)
                    assert abs(float(words[b, h, i, j]) - expected) < 1e-5
        assert float(words[b, :, n:, :].abs().sum()) == 0  # padding words are empty


def test_the_torch_free_config_names_the_same_poolings():
    from headlab.data.alignment import POOLINGS
    from headlab.functions.config import WORD_POOLINGS

    assert WORD_POOLINGS == POOLINGS


@pytest.mark.parametrize("pooling", ["first", "max"])
def test_word_attention_other_poolings_match_a_loop(pooling):
    tokenizer = bpe_tokenizer(TEXTS, vocab_size=40)

    class S:  # minimal sentence
        def __init__(self, words):
            self.words = words
            self.heads = tuple([-1] * len(words))
            self.deprels = ("root",) * len(words)
            self.upos = ("X",) * len(words)
            self.sent_id, self.where = "", ""

    side, alignments = side_batch([S(("the", "xylophone", "jumps")), S(("lazy", "dogs", "and", "cats", "over"))],
                                  tokenizer)
    side.pooling = pooling
    B, T = side.token_ids.shape
    torch.manual_seed(0)
    probs = torch.rand(B, 3, T, T).softmax(-1)
    words = word_attention(probs, side)
    assert any(len([t for t in a.word_of_token.tolist() if t == 1]) > 1 for a in alignments)  # a split word
    for b, alignment in enumerate(alignments):
        owner = alignment.word_of_token.tolist()
        for h in range(3):
            for i in range(alignment.n_words):
                queries = [t for t, w in enumerate(owner) if w == i]
                for j in range(alignment.n_words):
                    keys = [t for t, w in enumerate(owner) if w == j]
                    if pooling == "first":
                        expected = float(probs[b, h, queries[0], keys[0]])
                    else:
                        expected = max(float(probs[b, h, q, k]) for q in queries for k in keys)
                    assert abs(float(words[b, h, i, j]) - expected) < 1e-6


def _align_one_loop(words, spans, text, offsets, special, tokens):
    """The per-token walk ``_align_one`` replaced (reference): word of each token, or the error."""
    import numpy as np

    char_word = np.full(len(text) + 1, -1, dtype=np.int64)
    for index, (start, end) in enumerate(spans):
        char_word[start:end] = index
    word_of_token = np.full(len(offsets), -1, dtype=np.int64)
    pending: list[int] = []
    for t in range(len(offsets)):
        if special[t]:
            continue
        owners = char_word[offsets[t][0]:offsets[t][1]]
        owners = owners[owners >= 0]
        if owners.size == 0:
            pending.append(t)
            continue
        first, last = int(owners[0]), int(owners[-1])
        if first != last:
            return f"subword {tokens[t]!r} spans the words {words[first]!r} and {words[last]!r}"
        word_of_token[t] = first
        for p in pending:
            word_of_token[p] = first
        pending.clear()
    if pending:
        previous = [int(w) for w in word_of_token[: pending[0]] if w >= 0]
        for p in pending:
            word_of_token[p] = previous[-1] if previous else -1
    missing = sorted(set(range(len(words))) - set(word_of_token.tolist()))
    if missing:
        return f"word {missing[0] + 1} {words[missing[0]]!r} gets no subword from the tokenizer"
    return word_of_token.tolist()


def test_align_one_matches_the_per_token_walk_on_random_offsets():
    # Random tokenizations: specials anywhere, boundary-only and empty tokens (leading, inner,
    # trailing), tokens over spaces, tokens spanning two words; words may get no token. Long
    # sentences: each word in one or two subwords, some with the space before, a rare odd token.
    import random

    from headlab.data.alignment import _MANY_WORDS, _align_one

    rng = random.Random(0)
    results = []
    for case in range(440):  # short sentences (a loop per word) and long ones (whole arrays)
        size = rng.randint(1, 6) if case % 11 else rng.randint(_MANY_WORDS - 2, 2 * _MANY_WORDS)
        words = [rng.choice(["a", "bc", "def", "ghij", ""][: 5 if size < _MANY_WORDS or case % 2 else 4])
                 for _ in range(size)]
        text, spans = join_words(words, [rng.random() < 0.7 for _ in words])
        offsets, special = [], []
        if size >= _MANY_WORDS:  # subwords of each word (some with the space before, or boundary-only), a few odd
            for start, end in spans:
                cut = rng.randint(start, end)
                space = start > 0 and text[start - 1] == " " and rng.random() < 0.3
                offsets += [(start - space, cut), (cut, end)]
                special += [0, 0]
                if rng.random() < 0.002:
                    offsets.append((rng.randint(0, len(text)), rng.randint(0, len(text))))
                    special.append(rng.choice([0, 1]))
        for _ in range(rng.randint(0, 12) if size < _MANY_WORDS else 0):
            if rng.random() < 0.15:
                offsets.append((0, 0))
                special.append(1)
                continue
            start = rng.randint(0, len(text))
            offsets.append((start, min(len(text), start + rng.choice([0, 1, 1, 2, 3]))))
            special.append(0)
        tokens = [f"t{i}" for i in range(len(offsets))]
        expected = _align_one_loop(words, spans, text, offsets, special, tokens)
        try:
            got = _align_one(words, spans, text, list(range(len(offsets))), offsets, special, tokens.__getitem__,
                             None)
        except AlignmentError as error:
            assert isinstance(expected, str) and str(error) == expected
            results.append((size >= _MANY_WORDS, "error"))
            continue
        assert got.word_of_token.tolist() == expected and got.word_of_token.dtype.name == "int64"
        results.append((size >= _MANY_WORDS, "aligned"))
    assert {(True, "error"), (True, "aligned"), (False, "error"), (False, "aligned")} <= set(results)
