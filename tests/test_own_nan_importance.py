"""Importance measures on a model whose own eager forward gives NaN on padded rows (session 28, nan28).

transformers fills an additive mask with the lowest number of the model's dtype and its eager attention takes the
softmax in float32: in a float64 model that number is -inf there, so a query that may attend to no key at all gets
NaN weights. headlab pads on the right, so that query is a padding position under a sliding window: ModernBERT's
local layers and Gemma 3's bidirectional variant (EmbeddingGemma's; bidirectional: the next layer's real rows read
its NaN value, 0 * NaN), and a causal sliding window (Mistral: NaN at the padding positions of its first layer, and from its
second layer on in the real rows too: 0 * NaN in the weighted sum of values). Before: ablation's
loss summed NaN * 0 over the padding positions and gradient importance took NaN through the softmax's backward, so
both gave tables of NaN without a word (base_loss NaN). Now both run under the float32 mask floor, as LRP does,
and score only the scored positions: the tables equal those of one sentence per batch (no padding, nothing NaN).
Confidence (headlab's own attention, whose float64 softmax keeps such a row finite) and LRP already did; confidence's
eager engine refuses, naming the cause.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as tf

from headlab.errors import HeadlabError
from headlab.importance import ImportanceData, compute_ablation, compute_confidence, compute_gradient, compute_lrp, describe_model
from support.family_matrix import VOCAB, perturbed_model


def modernbert() -> torch.nn.Module:
    """4 layers, the odd ones local (2 keys either side): layer 1's far padding queries see no key, layer 2's real
    rows read their values."""
    config = tf.ModernBertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                                 intermediate_size=37, max_position_embeddings=64, global_attn_every_n_layers=2,
                                 local_attention=4, pad_token_id=2, bos_token_id=0, eos_token_id=1, cls_token_id=0,
                                 sep_token_id=1)
    return perturbed_model(tf.ModernBertForMaskedLM, config, attn_implementation="eager").double()


def mistral() -> torch.nn.Module:
    """A causal sliding window of 2: a right-padded row's padding queries past it see no key."""
    config = tf.MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, sliding_window=2,
                              max_position_embeddings=64, pad_token_id=2, bos_token_id=0, eos_token_id=1)
    return perturbed_model(tf.MistralForCausalLM, config, attn_implementation="eager").double()


def gemma3_bidirectional() -> torch.nn.Module:
    """Gemma 3 with bidirectional attention (EmbeddingGemma's), sliding layers of window 2 before full ones."""
    config = tf.Gemma3TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=2,
                                 max_position_embeddings=64, pad_token_id=2, bos_token_id=0, eos_token_id=1,
                                 use_bidirectional_attention=True,
                                 layer_types=["sliding_attention", "full_attention"] * 2)
    return perturbed_model(tf.Gemma3ForCausalLM, config, attn_implementation="eager").double()


MODELS = {"modernbert": modernbert, "mistral": mistral, "gemma3-bidirectional": gemma3_bidirectional}


def _data() -> ImportanceData:
    g = torch.Generator().manual_seed(7)
    return ImportanceData.from_ids([torch.randint(3, 99, (k,), generator=g).tolist() for k in (12, 3, 12, 2)])


def _padded_forward_has_nan(model) -> bool:
    ids = torch.tensor([_data().sources[0], _data().sources[1] + [2] * 9])
    mask = (torch.arange(12) < torch.tensor([[12], [3]])).long()
    with torch.no_grad():
        return bool(model(input_ids=ids, attention_mask=mask).logits.isnan().any())


@pytest.mark.parametrize("family", MODELS)
def test_the_model_itself_gives_nan_on_a_padded_batch(family):
    """What the tests below rest on, in transformers alone."""
    assert _padded_forward_has_nan(MODELS[family]())


@pytest.mark.parametrize("family", MODELS)
@pytest.mark.parametrize("measure", ["ablation", "gradient", "lrp"])
def test_padded_batches_score_as_one_sentence_at_a_time(family, measure):
    """ablation and gradient: NaN tables before nan28; LRP: finite already (its own floor), kept so."""
    model = MODELS[family]()
    info = describe_model(model)
    compute = {"ablation": compute_ablation, "gradient": compute_gradient, "lrp": compute_lrp}[measure]
    batched = compute(model, _data(), info, batch_size=4)
    alone = compute(model, _data(), info, batch_size=1)  # no padding: finite in transformers itself
    for kind in alone.kinds:
        assert np.isfinite(alone[kind]).all()
        # ablation's loss is summed in float32 (common.sequence_nll), the padded batch in another grouping
        np.testing.assert_allclose(batched[kind], alone[kind], rtol=1e-6, atol=2e-6 if measure == "ablation" else 1e-9)
    if measure == "ablation":
        assert batched.signature["base_loss"] == pytest.approx(alone.signature["base_loss"], rel=1e-6)


@pytest.mark.parametrize("family", MODELS)
def test_confidence_on_padded_batches_is_finite_and_its_eager_engine_names_the_cause(family):
    model = MODELS[family]()
    info = describe_model(model)
    batched = compute_confidence(model, _data(), info, batch_size=4)
    alone = compute_confidence(model, _data(), info, batch_size=1)
    for kind in alone.kinds:
        np.testing.assert_allclose(batched[kind], alone[kind], rtol=1e-9)
    with pytest.raises(HeadlabError, match="float64 attention mask"):
        compute_confidence(model, _data(), info, batch_size=4, engine="eager")


def test_a_nan_the_floor_does_not_explain_is_refused_not_scored():
    """NaN in the weights: not the padding's, so no table of NaN comes back (before: NaN tables, base_loss NaN)."""
    model = mistral()
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    info = describe_model(model)
    with pytest.raises(HeadlabError, match="ablation: the model computes NaN or inf in its loss on sentences 1-4"):
        compute_ablation(model, _data(), info, batch_size=4)
    with pytest.raises(HeadlabError, match="gradient importance: the model computes NaN or inf in its loss on batch 1"):
        compute_gradient(model, _data(), info, batch_size=4)


@pytest.mark.parametrize("family", ["modernbert", "gemma3-bidirectional"])
def test_statistics_on_padded_batches_equal_one_sentence_at_a_time_or_are_refused(family, tmp_path):
    """The head statistics (functions and aggregate) read attention weights only: on the fused and chunked engines
    (headlab's attention, float64 softmax) a padded batch gives the statistics of one sentence per batch; the eager
    engine (transformers' weights) refuses the padded batch, naming the float64 mask, rather than sum NaN."""
    from headlab.data.frequencies import TokenFrequencies
    from headlab.functions import AnalysisConfig, analyze_heads
    from support.treebank import SAMPLE_CONLLU
    from test_chunked_statistics import _assert_close, _written
    from test_fused_statistics import word_tokenizer

    model, tokenizer = MODELS[family](), word_tokenizer()
    path = tmp_path / "tb.conllu"
    path.write_text(SAMPLE_CONLLU, encoding="utf-8")
    counts = np.arange(tokenizer.vocab_size, dtype=np.int64) % 5 + 1

    def run(engine: str, batch_size: int, query_chunk: int | None = None) -> dict:
        config = AnalysisConfig(batch_size=batch_size, top_frequent=3, window=4, top_k=3, engine=engine,
                                query_chunk=query_chunk, sensitivity=True)
        analysis = analyze_heads(model, tokenizer, path, config=config, frequencies=TokenFrequencies(counts, "set"))
        return _written(analysis.results.values(), tmp_path / f"{engine}-{batch_size}")

    alone = run("eager", 1)  # no padding: transformers' own weights, finite
    for got in (run("fused", 4), run("chunked", 4, query_chunk=3)):
        assert set(got) == set(alone)
        for name in alone:
            _assert_close(got[name], alone[name], name, rtol=1e-6, atol=1e-8)
    with pytest.raises(HeadlabError, match="float64 attention mask"):
        run("eager", 4)


def t5gemma(vocab: int = VOCAB) -> torch.nn.Module:
    """A translation model with a sliding window (2) in its bidirectional encoder: a right-padded row's far padding
    queries see no key, the encoder's next layer reads their NaN into the real rows, the decoder reads those."""
    def module(**extra) -> dict:
        return dict(vocab_size=vocab, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, sliding_window=2, max_position_embeddings=64, pad_token_id=0,
                    bos_token_id=2, eos_token_id=1, layer_types=["sliding_attention", "full_attention"], **extra)
    config = tf.T5GemmaConfig(encoder=module(), decoder=module(), vocab_size=vocab, tie_word_embeddings=True)
    config.pad_token_id, config.eos_token_id, config.bos_token_id, config.decoder_start_token_id = 0, 1, 2, 2
    return perturbed_model(tf.T5GemmaForConditionalGeneration, config, attn_implementation="eager").double()


class _IdsTokenizer:
    """A translation's text is its token ids (padding 0 and EOS 1 left out)."""

    def batch_decode(self, rows, skip_special_tokens=True):
        return [" ".join(str(t) for t in row if t not in (0, 1)) for row in rows]


def _translation_data() -> ImportanceData:
    g = torch.Generator().manual_seed(7)
    sources = [torch.randint(3, 99, (k,), generator=g).tolist() + [1] for k in (11, 2, 11, 3)]  # padded to 12
    references = [torch.randint(3, 99, (k,), generator=g).tolist() + [1] for k in (4, 6, 2, 3)]
    return ImportanceData.from_ids(sources, references)


def _alone(model, info, sources, limit: int, beam: int, **options) -> list[list[int]]:
    """Each sentence translated on its own (no padding: finite in transformers itself), with the length limit its
    padded batch gets."""
    from headlab.data.inputs import generated_tokens

    out = []
    with torch.no_grad():
        for ids in sources:
            row = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 num_beams=beam, do_sample=False, max_new_tokens=limit, max_length=None, **options)
            out.append(generated_tokens(row[0].tolist(), info))
    return out


def test_the_model_s_own_translation_of_a_padded_batch_is_each_sentence_s_alone():
    """translate_data (the translation the decoder-side measures read): under the floor now; before, the padded
    batch's NaN encoder states gave other translations."""
    from headlab.importance import translate_data

    model, data = t5gemma(), _translation_data()
    info = describe_model(model)
    assert model(input_ids=torch.tensor([data.sources[0], data.sources[1] + [0] * 9]),
                 attention_mask=(torch.arange(12) < torch.tensor([[12], [3]])).long(),
                 decoder_input_ids=torch.tensor([[2], [2]])).logits.isnan().any()  # transformers alone: NaN
    translated = translate_data(model, data, info, batch_size=4)
    assert translated.translations == _alone(model, info, data.sources, int(1.5 * 12 + 10), 1, min_new_tokens=1)


def test_bleu_ablation_of_a_padded_batch_equals_translating_each_sentence_alone():
    """BLEU ablation (nan28 floored it, untested): on a padded batch of a model whose padding gives NaN, the base BLEU
    and each masked head's equal those of translating each sentence alone with that head masked."""
    from sacrebleu.metrics import BLEU

    from headlab import attention_blocks, mask_heads

    model, data, tokenizer = t5gemma(), _translation_data(), _IdsTokenizer()
    info = describe_model(model)
    limit = int(1.5 * 12 + 10)  # _ablate_bleu's, of the padded width
    # references: the model's own translations, so that the BLEU scores are far from 0
    data.reference_texts = tokenizer.batch_decode(_alone(model, info, data.sources, limit, 2))
    scores = compute_ablation(model, data, info, metric="bleu", tokenizer=tokenizer, batch_size=4, max_rows=8, beam=2)

    def bleu() -> float:
        texts = tokenizer.batch_decode(_alone(model, info, data.sources, limit, 2))
        return BLEU().corpus_score(texts, [data.reference_texts]).score

    base = bleu()
    assert scores.signature["base_bleu"] == pytest.approx(base) == pytest.approx(100.0)
    blocks = attention_blocks(model)
    for block in (blocks[0], blocks[-1]):  # the encoder's sliding layer, the decoder's last cross-attention
        for head in range(block.n_heads):
            with mask_heads(model, {block.key: [head]}):
                expected = base - bleu()
            assert scores[block.kind][block.layer, head] == pytest.approx(expected, abs=1e-9), (block.key, head)
    assert np.abs(scores["enc_self"]).max() > 0  # a masked head changes a translation
