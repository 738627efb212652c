"""The fused engine (headlab.data.fused) writes what the eager reference writes.

On every family of the test matrix, in float64: ``analyze_heads`` with ``engine="fused"`` against
the eager capture and the chunked path, with a word-level tokenizer (every word one token, a
BOS before them: the fused word passes run) and a BPE one (words of several subwords: the word
statistics take the chunked path for those batches, the token ones stay fused). Counts, offsets
and argmax decisions are identical (the maxima are taken over the same weights in the same order
on both paths, ties to the first position); float sums agree to 1e-8.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from headlab.data.alignment import AttentionView
from headlab.data.frequencies import TokenFrequencies
from headlab.data.fused import WORD_PASSES, FusedView, unavailable_passes, word_offset
from headlab.errors import HeadlabError
from headlab.functions import AnalysisConfig, analyze_heads
from headlab.functions.registry import STATISTICS
from support.models import FAMILIES, SEQ2SEQ, VOCAB, tiny_model
from support.treebank import SAMPLE_CONLLU, FakeBlock, bpe_tokenizer, sample_sentences, side_batch
from test_chunked_statistics import TOKENIZER_TEXTS, _assert_close, _statistics, _written

pytestmark = pytest.mark.unit

# Llama-like models' eager softmax runs in float32 whatever the model's dtype (headlab's chunked
# attention, under the fused and chunked engines, in float64): against eager, float32 rounding.
FLOAT32_EAGER = {"llama", "qwen2"}


def word_tokenizer() -> PreTrainedTokenizerFast:
    """One token per word of the sample treebank, ``<s>`` before and ``</s>`` after."""
    words = sorted({line.split("\t")[1] for line in SAMPLE_CONLLU.splitlines() if line and not line.startswith("#")})
    specials = ["<pad>", "</s>", "<unk>", "<s>"]
    vocab = {token: i for i, token in enumerate(specials + words)}
    assert len(vocab) <= VOCAB
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 3), ("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   bos_token="<s>")


def _unfused(tokenizer) -> dict[str, str]:
    """The registered statistics that declare no fused passes: always the chunked path, said so."""
    return {name: "it declares no fused passes" for name, stat in _statistics(tokenizer).items()
            if stat is not None and getattr(stat, "fused_passes", None) is None}


def _word_passes(tokenizer) -> set[str]:
    """The registered statistics whose declared fused passes include a word pass: where words are
    several subwords those passes do not apply (``unavailable_passes``), so they take word rows."""
    return {name for name, stat in _statistics(tokenizer).items()
            if stat is not None and set(getattr(stat, "fused_passes", None) or ()) & set(WORD_PASSES)}


def _analyse(family, tmp_path, tokenizer, engine, query_chunk=None, pooling="sum"):
    model = tiny_model(family, attn_implementation="sdpa").double()
    path = tmp_path / "tb.conllu"
    path.write_text(SAMPLE_CONLLU, encoding="utf-8")
    counts = np.arange(tokenizer.vocab_size, dtype=np.int64) % 5 + 1
    config = AnalysisConfig(batch_size=3, top_frequent=3, window=4, top_k=3, engine=engine, query_chunk=query_chunk,
                            sensitivity=True, word_pooling=pooling)
    target = path if family in SEQ2SEQ else None
    return analyze_heads(model, tokenizer, path, target_conllu=target, config=config,
                         frequencies=TokenFrequencies(counts, "hand-set"))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("words", ["word", "bpe"])
def test_fused_equals_eager_and_chunked(tmp_path, family, words):
    tokenizer = word_tokenizer() if words == "word" else bpe_tokenizer(TOKENIZER_TEXTS * 3, vocab_size=45)
    eager = _analyse(family, tmp_path, tokenizer, "eager")
    chunked = _analyse(family, tmp_path, tokenizer, "chunked", query_chunk=3)
    fused = _analyse(family, tmp_path, tokenizer, "fused", query_chunk=3)
    assert set(fused.results) == set(STATISTICS)
    expected = _written(eager.results.values(), tmp_path / "eager")
    reference = _written(chunked.results.values(), tmp_path / "chunked")
    got = _written(fused.results.values(), tmp_path / "fused")
    assert len(got) > 10
    _assert_close(got, reference, atol=1e-8)
    _assert_close(got, expected, atol=1e-8, rtol=1e-6 if family in FLOAT32_EAGER else 0.0)
    if words == "word":
        assert fused.report.chunked_statistics == _unfused(tokenizer)  # every statistic with fused passes fused
    else:  # the word statistics over word rows, said so; the token ones fused
        assert set(fused.report.chunked_statistics) == {*_word_passes(tokenizer), *_unfused(tokenizer)}
        assert "chunked path" in fused.report.describe()


@pytest.mark.parametrize("pooling", ["first", "max"])
def test_fused_under_other_poolings(tmp_path, pooling):
    """A one-token word is its token under every pooling: the fused passes apply and agree."""
    tokenizer = word_tokenizer()
    eager = _analyse("bert", tmp_path, tokenizer, "eager", pooling=pooling)
    fused = _analyse("bert", tmp_path, tokenizer, "fused", query_chunk=2, pooling=pooling)
    assert fused.report.chunked_statistics == _unfused(tokenizer)
    _assert_close(_written(fused.results.values(), tmp_path / "fused"),
                  _written(eager.results.values(), tmp_path / "eager"), atol=1e-8)


def test_fused_view_is_the_word_view(tmp_path):
    """Under a word offset, a FusedView's word maxima and word block are the AttentionView's, to the bit."""
    sentences = sample_sentences(tmp_path)
    side, _ = side_batch(sentences[:3], word_tokenizer())
    assert word_offset(side) == 1 and unavailable_passes(side) == ()
    g = torch.Generator().manual_seed(0)
    B, T = side.token_ids.shape
    probs = torch.randn(B, 2, T, T, generator=g).mul(3).softmax(-1)
    probs[:, :, :, 4] = probs[:, :, :, 3]  # exact ties: the first position wins on both paths
    block = FakeBlock("enc_self", 0, 2)
    whole = AttentionView(block, probs, side)
    fused = FusedView(block, probs, side, start=0, last=True)
    assert (fused.word_start, fused.word_stop) == (0, side.max_words)
    torch.testing.assert_close(fused.word_argmax, whole.word_argmax, rtol=0, atol=0)
    torch.testing.assert_close(fused.word_max, whole.word_max, rtol=0, atol=0)
    torch.testing.assert_close(fused.words, whole.words, rtol=0, atol=0)


def test_bpe_words_have_no_offset(tmp_path):
    sentences = sample_sentences(tmp_path)
    side, _ = side_batch(sentences[:2], bpe_tokenizer(TOKENIZER_TEXTS * 3, vocab_size=45))
    assert word_offset(side) is None and "word_max" in unavailable_passes(side)


def test_engine_option_is_checked():
    with pytest.raises(HeadlabError, match="engine must be one of"):
        AnalysisConfig(engine="flash")
    with pytest.raises(HeadlabError, match="not with --engine eager"):
        AnalysisConfig(engine="eager", query_chunk=4)
    # fused is the default (issue 34), with or without --query-chunk; eager and chunked stay as references
    assert AnalysisConfig().resolved_engine == "fused" and AnalysisConfig(query_chunk=4).resolved_engine == "fused"
    assert AnalysisConfig(engine="eager").resolved_engine == "eager"
    assert AnalysisConfig(engine="chunked").resolved_engine == "chunked"
    assert AnalysisConfig(engine="fused").chunk_rows == 128


def test_fused_statistics_on_a_device_make_nothing_on_the_host(tmp_path, monkeypatch):
    """As tests/test_statistics_device.py checks the chunked path: with the statistics sent to a
    stand-in device, no operation of the fused passes mixes a tensor there with one made on the
    host, and the files are the CPU's."""
    import headlab.functions.analysis as analysis
    from headlab.data.alignment import SideBatch
    from support.fake_device import DEVICE, FakeDevice
    from test_statistics_device import _files

    tokenizer = word_tokenizer()
    expected = _files(_analyse("gpt2", tmp_path, tokenizer, "fused", query_chunk=3), tmp_path / "plain")
    monkeypatch.setattr(analysis, "statistics_device", lambda device: DEVICE)
    monkeypatch.setattr(SideBatch, "to", lambda self, device: self.copy_to(device))
    with FakeDevice() as device:
        result = _analyse("gpt2", tmp_path, tokenizer, "fused", query_chunk=3)
        written = _files(result, tmp_path / "device")
    assert result.report.chunked_statistics == _unfused(tokenizer)
    assert not device.mixed, "\n".join(device.mixed[:3])
    assert written == expected


def test_query_chunk_runs_fused_and_writes_the_chunked_files_where_words_have_subwords(tmp_path, caplog):
    """``--query-chunk`` alone runs the fused engine; with BPE words (the bundled models' case) the
    word statistics get the chunked path's word rows and the token ones the same maxima: every file
    is the chunked engine's, byte for byte, and the summary has no new key (the fallback is logged)."""
    import logging

    from test_statistics_device import _files

    tokenizer = bpe_tokenizer(TOKENIZER_TEXTS * 3, vocab_size=45)
    chunked = _analyse("gpt2", tmp_path, tokenizer, "chunked", query_chunk=3)
    with caplog.at_level(logging.DEBUG, logger="headlab.functions.analysis"):
        default = _analyse("gpt2", tmp_path, tokenizer, None, query_chunk=3)
    assert default.config.resolved_engine == "fused"
    assert _files(default, tmp_path / "default") == _files(chunked, tmp_path / "chunked")
    assert default.report.to_json().keys() == chunked.report.to_json().keys()
    assert "syntactic: computed over word rows" in caplog.text


def test_fused_in_bfloat16_agrees_with_chunked(tmp_path):
    """A bfloat16 model (the GPU benchmark's dtype): bf16 scores, float32 probabilities; entropy then
    comes from a dot product with the chunk's scores (the attention pass's product needs float32
    or float64 queries). Decisions identical to the chunked path's, float totals close."""
    tokenizer = word_tokenizer()
    path = tmp_path / "tb.conllu"
    path.write_text(SAMPLE_CONLLU, encoding="utf-8")
    counts = np.arange(tokenizer.vocab_size, dtype=np.int64) % 5 + 1
    model = tiny_model("llama", attn_implementation="sdpa").to(torch.bfloat16)
    written = {}
    for engine in ("chunked", "fused"):
        config = AnalysisConfig(batch_size=3, top_frequent=3, window=4, top_k=3, engine=engine, query_chunk=3)
        analysis = analyze_heads(model, tokenizer, path, config=config, frequencies=TokenFrequencies(counts, "hand-set"))
        written[engine] = _written(analysis.results.values(), tmp_path / engine)
    _assert_close(written["fused"], written["chunked"], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("columns", [255, 256, 300, 1087, 1088])
def test_first_max_is_max_with_its_first_position(columns):
    """The blocked maximum of long rows (the maxima and their positions of every view) gives
    ``max(-1)``'s values and positions: ties to the first column, within a block, across blocks and
    after the last whole block, NaN included; over contiguous rows, a slice of columns and strided rows."""
    from headlab.data.alignment import first_max

    torch.manual_seed(columns)
    x = torch.softmax(torch.randn(2, 3, 40, columns) * 4, -1)
    best = x.max(-1).values
    x[0, 0, :, 0] = best[0, 0]  # a tie in the first block
    x[0, 1, :, -1] = best[0, 1]  # a tie after the maximum: in the last block or after it
    x[0, 2, :, 70] = best[0, 2] * 2  # a larger value in the second block, tied again in the last column
    x[0, 2, :, -1] = best[0, 2] * 2
    x[1, 0, :, columns // 2] = best[1, 0]
    x[1, 1] = 0.0  # every column tied
    x[1, 2, 3, 7] = x[1, 2, 4, -1] = x[1, 2, 5, 70] = x[1, 2, 5, -2] = float("nan")
    for y in (x, x[..., 1:], x.transpose(2, 3).contiguous().transpose(2, 3)):
        values, positions = y.max(-1)
        got_values, got_positions = first_max(y)
        assert torch.equal(got_positions, positions)
        torch.testing.assert_close(got_values, values, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("family", ["llama", "marian"])
@pytest.mark.parametrize("engine", ["fused", "chunked"])
def test_forward_stops_after_the_last_analysed_block(tmp_path, monkeypatch, family, engine):
    """Under headlab's attention function the forward pass stops once every analysed block has
    reported (functions.analysis._ForwardDone): the logits are never computed (nor, for an encoder
    analysed alone, the decoder), and every file is, to the bit, that of the whole forward."""
    import headlab.functions.analysis as analysis

    tokenizer = word_tokenizer()
    path = tmp_path / "tb.conllu"
    path.write_text(SAMPLE_CONLLU, encoding="utf-8")
    counts = np.arange(tokenizer.vocab_size, dtype=np.int64) % 5 + 1
    config = AnalysisConfig(batch_size=3, top_frequent=3, window=4, top_k=3, engine=engine, query_chunk=3)
    runs = []
    for stop in (True, False):
        if not stop:  # as where a block falls back to the eager capture: the whole forward
            monkeypatch.setattr(analysis, "unregistrable", lambda blocks: blocks[:1])
        model = tiny_model(family, attn_implementation="sdpa").double()
        heads = []
        model.get_output_embeddings().register_forward_hook(lambda *args, heads=heads: heads.append(1))
        result = analyze_heads(model, tokenizer, path, config=config, frequencies=TokenFrequencies(counts, "hand-set"))
        runs.append((_written(result.results.values(), tmp_path / str(stop)), heads))
    (stopped, heads), (whole, whole_heads) = runs
    assert not heads and whole_heads  # the logits: only in the whole forward
    assert len(stopped) > 10 and stopped.keys() == whole.keys()
    for name, value in whole.items():
        assert stopped[name] == value, name


def test_fused_is_the_default_without_query_chunk(tmp_path, monkeypatch):
    """Issue 34: with neither --engine nor --query-chunk the statistics run on the fused engine, in
    chunks of ``FUSED_QUERY_CHUNK`` rows (the forward stops after the last analysed block: no
    logits), and write what ``engine="fused", query_chunk=128`` writes, byte for byte; the eager
    reference agrees to 1e-8 in float64."""
    import headlab.functions.analysis as analysis
    from headlab.functions.config import FUSED_QUERY_CHUNK
    from test_statistics_device import _files

    asked = []
    original = analysis.stream_attention

    def spy(model, callback, **kwargs):
        asked.append(kwargs["query_chunk"])
        return original(model, callback, **kwargs)

    monkeypatch.setattr(analysis, "stream_attention", spy)
    tokenizer = word_tokenizer()
    default = _analyse("llama", tmp_path, tokenizer, None)
    assert asked == [FUSED_QUERY_CHUNK] and default.config.resolved_engine == "fused"
    assert default.report.chunked_statistics == {}
    fused = _analyse("llama", tmp_path, tokenizer, "fused", query_chunk=FUSED_QUERY_CHUNK)
    assert _files(default, tmp_path / "default") == _files(fused, tmp_path / "fused")
    eager = _analyse("llama", tmp_path, tokenizer, "eager")
    assert len(asked) == 2  # eager: no stream
    _assert_close(_written(default.results.values(), tmp_path / "d"), _written(eager.results.values(), tmp_path / "e"),
                  atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("cause", ["dispatch", "sinks"])
def test_default_runs_eager_where_the_model_cannot_use_headlabs_attention(tmp_path, monkeypatch, caplog, cause):
    """A model whose attention does not go through headlab's attention function (no dispatch through
    transformers' registry, or attention sinks, ``s_aux``, of a type not in ATTENTION_SINKS, which the function has
    not read)
    gets the eager reference by default, said once, with eager's files to the bit."""
    import inspect
    import logging

    import headlab.capture
    import headlab.functions.analysis as analysis
    from test_statistics_device import _files

    tokenizer = word_tokenizer()
    eager = _analyse("gpt2", tmp_path, tokenizer, "eager")
    if cause == "dispatch":
        monkeypatch.setattr(headlab.capture, "unregistrable", lambda blocks: blocks[:1])
    else:
        getsource = inspect.getsource  # as GPT-OSS's forward: the interface called with s_aux=self.sinks
        monkeypatch.setattr(inspect, "getsource", lambda obj: getsource(obj) + "\n    s_aux=self.sinks")
    streamed = []
    monkeypatch.setattr(analysis, "stream_attention", lambda *args, **kwargs: streamed.append(1))
    with caplog.at_level(logging.INFO, logger="headlab.functions.analysis"):
        default = _analyse("gpt2", tmp_path, tokenizer, None)
    assert not streamed
    assert caplog.text.count("not the fused engine") == 1
    assert ("sinks" in caplog.text) == (cause == "sinks")
    assert _files(default, tmp_path / "default") == _files(eager, tmp_path / "eager")
