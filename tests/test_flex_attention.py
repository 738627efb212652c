"""Models loaded with ``attn_implementation="flex_attention"`` are analysed, masked, gated, pruned and explained exactly,
or refused before any work (session 46).

transformers' ``flex_attention_forward`` (integrations/flex_attention.py) takes the causal and sliding-window masks as a
``BlockMask`` and soft-capping, padding and position biases in a ``score_mod``; headlab reads the attention in eager
mode (capture, LRP) or with its own attention function (the fused statistics), and masks, gates and prunes at the
output projection, so on these models: the flex forward is eager's (what headlab reads is the model's), the capture is
eager's ``output_attentions``, masking equals the values zeroed by hand, gates at one change nothing, pruning equals
masking, the fused statistics equal the eager reference, and LRP conserves relevance. Llama (grouped queries), Qwen 2
and 3 (query/key norms), Gemma 2 (soft-capping at 2, a window of 4 keys), Gemma 3 (a window), BERT and ModernBERT
(encoders, ModernBERT's local layer), BART (an encoder-decoder); Gemma with ``use_bidirectional_attention``, whose
mask SDPA skips and flex builds, is read. Doge and T5, which transformers 5.24 runs wrongly under flex (Doge's attention
drops the causal block mask; T5's position bias of one batch row fails on batches), and learned sinks on a CPU
(transformers' flex forward raises) are refused (``headlab.adapters.refuse_broken_flex``); so are, on a CPU, gradient
importance and gated training (``flex_without_backward``: torch's FlexAttention has no backward pass there).
experiments/family_sweep.py ``--attn-implementation flex_attention`` sweeps
every type. transformers compiles flex attention on its first call (seconds on a CPU); headlab's own runs are eager
(``headlab.compiled.running_eagerly``), and so are these tests' references (``force_eager``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as tf
from transformers.utils import is_torch_flex_attn_available

from headlab import HeadlabError, capture_attention
from headlab.data.frequencies import TokenFrequencies
from headlab.functions import AnalysisConfig, analyze_heads
from headlab.gates import measuring
from support import family_matrix as fm
from support import models as sm
from support.treebank import SAMPLE_CONLLU
from test_chunked_statistics import _assert_close, _written
from test_fused_statistics import word_tokenizer

pytestmark = [pytest.mark.unit,
              pytest.mark.skipif(not is_torch_flex_attn_available(), reason="torch has no flex_attention")]

FLEX = "flex_attention"
D = 8  # head size


def _gemma2():
    cls, config = fm.CONFIGS["gemma2"]()  # a window of 4 keys over the 7 tokens
    config.attn_logit_softcapping = 2.0  # small enough to bend the tiny model's scores
    return cls, config


def _rows(path: str):
    """The value projection at ``path`` of layer ``i`` and key/value head ``j``'s rows."""
    def module(model, i):
        return model.get_submodule(path.format(i))
    return module, lambda j: range(j * D, (j + 1) * D)


_LLAMA_V = _rows("model.layers.{}.self_attn.v_proj")
FAMILIES = {  # name: (cls and config, kind, values (module, rows, key/value heads), first layer)
    "llama": (fm.CONFIGS["llama"], "dec_self", (*_LLAMA_V, 2), "model.layers.0"),
    "qwen2": (fm.CONFIGS["qwen2"], "dec_self", (*_LLAMA_V, 2), "model.layers.0"),
    "qwen3": (fm.CONFIGS["qwen3"], "dec_self", (*_LLAMA_V, 2), "model.layers.0"),
    "gemma2": (_gemma2, "dec_self", (*_LLAMA_V, 2), "model.layers.0"),
    "gemma3": (fm.CONFIGS["gemma3"], "dec_self", (*_LLAMA_V, 2), "model.layers.0"),
    "modernbert": (fm.CONFIGS["modernbert"], "enc_self", fm.VALUES["modernbert"], "model.layers.0"),
    "bert": (sm.CONFIGS["bert"], "enc_self", (*_rows("bert.encoder.layer.{}.attention.self.value"), 4),
             "bert.encoder.layer.0"),
}


@pytest.fixture(autouse=True)
def eager_flex():
    """The tests' own forwards run flex attention eagerly, as headlab's runs do (no compilation)."""
    with torch.compiler.set_stance("force_eager"):
        yield


def _build(family: str):
    def build(attn_implementation: str = FLEX):
        cls, config = (FAMILIES[family][0] if family in FAMILIES else sm.CONFIGS[family])()
        return fm.perturbed_model(cls, config, attn_implementation=attn_implementation).double()
    return build


def _inputs(family: str) -> dict:
    return sm.tiny_inputs(family) if family in sm.SEQ2SEQ else fm.tiny_inputs()


@pytest.mark.parametrize("family", [*FAMILIES, "bart"])
def test_the_flex_forward_runs_flex_and_is_eagers(family, monkeypatch):
    """What headlab reads in eager mode is the flex model's own attention: its logits are eager's (float64; Llama-like
    eager softmax runs in float32 whatever the dtype: its rounding), and its forward calls transformers' flex
    attention (eagerly: the autouse ``force_eager``)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    calls = []
    flex = ALL_ATTENTION_FUNCTIONS[FLEX]
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, FLEX,
                        lambda *args, **kwargs: calls.append(1) or flex(*args, **kwargs))
    build, inputs = _build(family), _inputs(family)
    model = build()
    assert model.config._attn_implementation == FLEX
    torch.testing.assert_close(fm.logits(model, inputs), fm.logits(build("eager"), inputs), atol=1e-6, rtol=0)
    assert calls


@pytest.mark.parametrize("family", FAMILIES)
def test_capture_masking_gates_pruning_and_lrp_under_flex(family):
    _, kind, values, first = FAMILIES[family]
    build, inputs = _build(family), fm.tiny_inputs()
    fm.check_capture_equals_output_attentions(build, kind, inputs)
    fm.check_masking_equals_zeroed_values(build, kind, values, inputs)
    fm.check_gates_at_one_change_nothing(build(), inputs)
    fm.check_pruning_equals_masking(build(), kind, inputs, atol=1e-10)
    model = build()
    fm.check_lrp_conserves(model, model.get_submodule(first), rtol=1e-8, atol=1e-8)
    assert model.config._attn_implementation == FLEX  # LRP's eager reading switched it back


def test_an_encoder_decoder_under_flex():
    """BART: every kind's capture is eager's, masking a decoder head equals its values zeroed, pruning equals
    masking."""
    from headlab import mask_heads, prune_heads

    build, inputs = _build("bart"), sm.tiny_inputs("bart")
    with torch.no_grad():
        reference = build("eager")(**inputs, output_attentions=True)
    model = build()
    with capture_attention(model) as record:
        fm.logits(model, inputs)
    expected = {"enc_self": reference.encoder_attentions, "dec_self": reference.decoder_attentions,
                "dec_cross": reference.cross_attentions}
    assert sorted(record) == sorted((kind, layer) for kind in expected for layer in range(2))
    for (kind, layer), probs in record.items():
        assert torch.equal(probs, expected[kind][layer]), (kind, layer)
    with mask_heads(model, {("dec_self", 1): [2]}):
        masked = fm.logits(model, inputs)
    zeroed = build()
    with torch.no_grad():
        zeroed.model.decoder.layers[1].self_attn.v_proj.weight[2 * D:3 * D] = 0
        zeroed.model.decoder.layers[1].self_attn.v_proj.bias[2 * D:3 * D] = 0
    torch.testing.assert_close(masked, fm.logits(zeroed, inputs), atol=1e-10, rtol=0)
    spec = {("enc_self", 0): [1], ("dec_self", 1): [0, 2], ("dec_cross", 0): [3]}
    with mask_heads(model, spec):
        masked = fm.logits(model, inputs)
    prune_heads(model, spec)
    torch.testing.assert_close(fm.logits(model, inputs), masked, atol=1e-10, rtol=0)


def _statistics(model, tmp_path, engine: str) -> dict:
    path = tmp_path / "tb.conllu"
    path.write_text(SAMPLE_CONLLU, encoding="utf-8")
    tokenizer = word_tokenizer()
    counts = np.arange(tokenizer.vocab_size, dtype=np.int64) % 5 + 1
    config = AnalysisConfig(batch_size=3, top_frequent=3, window=4, top_k=3, engine=engine,
                            query_chunk=None if engine == "eager" else 3, sensitivity=True)
    result = analyze_heads(model, tokenizer, path, config=config, frequencies=TokenFrequencies(counts, "hand-set"))
    return _written(result.results.values(), tmp_path / engine)


@pytest.mark.parametrize("family", ["gemma2", "bert"])
def test_fused_statistics_equal_the_eager_reference_under_flex(family, tmp_path):
    """The fused engine's statistics of a flex model (headlab's own attention function, its soft-cap and windows
    taken from the model's call) are the eager reference's, as on the SDPA model (tests/test_fused_statistics.py)."""
    model = _build(family)()
    fused = _statistics(model, tmp_path, "fused")
    assert len(fused) > 10
    _assert_close(fused, _statistics(model, tmp_path, "eager"), atol=1e-8, rtol=1e-6)
    assert model.config._attn_implementation == FLEX


def _doge(attn_implementation: str):
    config = tf.DogeConfig(vocab_size=fm.VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return fm.perturbed_model(tf.DogeForCausalLM, config, attn_implementation=attn_implementation).double()


def _t5(attn_implementation: str):
    cls, config = sm.CONFIGS["t5"]()
    return fm.perturbed_model(cls, config, attn_implementation=attn_implementation).double()


@pytest.mark.parametrize(("build", "wrong"), [(_doge, "drops the causal block mask"),
                                              (_t5, "position bias of one batch row")])
def test_a_model_transformers_runs_wrongly_under_flex_is_refused(build, wrong):
    """Doge: its flex forward is not causal (its logits not eager's), T5: its flex forward fails on a batch of two;
    capture and every measurement (``measuring``) refuse them before any work, naming the cause and SDPA; the same
    models loaded with SDPA are not refused. Fails on main before session 46 (both read in eager mode)."""
    model = build(FLEX)
    family = "t5" if model.config.model_type == "t5" else "llama"
    inputs = sm.tiny_inputs("t5") if family == "t5" else fm.tiny_inputs()
    if family == "t5":  # the premise: transformers' own flex forward
        with pytest.raises(IndexError):
            fm.logits(model, inputs)
    else:
        assert not torch.allclose(fm.logits(model, inputs), fm.logits(build("eager"), inputs), atol=1e-3)
    with pytest.raises(HeadlabError, match=f"flex_attention.*{wrong}.*attn_implementation='sdpa'"):
        with capture_attention(model):
            pass
    with pytest.raises(HeadlabError, match=f"importance: .*{wrong}"):
        with measuring(model, "importance"):
            pass
    sdpa = build("sdpa")
    with capture_attention(sdpa) as record:
        fm.logits(sdpa, inputs)
    assert record


def test_what_differentiates_the_models_flex_forward_is_refused_on_a_cpu(tmp_path):
    """torch's FlexAttention has no backward pass on a CPU: gradient importance (the measure, compute_gradient) and
    gated training refuse a flex model there before any work, naming SDPA; the other measures run. Before session
    46: importance ran confidence first, then failed in gradient with torch's NotImplementedError (MeasuresFailed);
    prune_train wrote its output directory first."""
    import headlab
    from headlab.data.inputs import texts_data
    from headlab.importance.gradient import compute_gradient
    from headlab.model_description import describe_model
    from headlab.pruning import PruneConfig, prune_train
    from headlab.training.config import TrainConfig

    model, tokenizer = _build("llama")(), word_tokenizer()
    with pytest.raises(NotImplementedError, match="backward on CPU"):  # the premise: torch's own refusal
        model(**fm.tiny_inputs()).logits.sum().backward()
    texts = ["the cat sat", "a dog ran"]
    with pytest.raises(HeadlabError, match="cannot run gradient: .*no backward pass on a CPU.*'sdpa'"):
        headlab.importance(model, tokenizer, texts, measures="confidence,gradient")
    info = describe_model(model)
    with pytest.raises(HeadlabError, match="gradient importance .*flex_attention"):
        compute_gradient(model, texts_data(texts, tokenizer, info), info)
    assert "confidence" in headlab.importance(model, tokenizer, texts, measures="confidence,ablation").scores
    train = TrainConfig(out_dir=str(tmp_path / "r"), max_tokens=400, progress=False)
    with pytest.raises(HeadlabError, match="gated training .*no backward pass on a CPU"):
        prune_train(model, tokenizer, [], None, PruneConfig(gates="all", lam=0.0, loss="causal_lm", train=train))
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(("family", "attribute"), [("llama", "attention_dropout"), ("bert", "attention_probs_dropout_prob")])
def test_attention_dropout_under_flex_is_refused_for_training(family, attribute):
    """transformers' flex_attention_forward refuses attention dropout, which the attention hands it in training mode
    (Llama's float ``attention_dropout``, BERT's ``nn.Dropout``'s p): gated training names it before any work
    (prune_train on a GPU; on a CPU the missing backward pass is named first). Before session 46 the first training
    step failed with transformers' ValueError after the output directory was written."""
    from headlab.adapters import flex_attention_dropout

    cls, config = (FAMILIES[family][0])()
    setattr(config, attribute, 0.0)
    assert flex_attention_dropout(fm.perturbed_model(cls, config, attn_implementation=FLEX)) is None  # dropout 0
    setattr(config, attribute, 0.25)
    model = fm.perturbed_model(cls, config, attn_implementation=FLEX)
    with pytest.raises(ValueError, match="does not support `dropout`"):  # the premise: transformers' own refusal
        model.train()(**_inputs(family))
    assert "0.25" in (flex_attention_dropout(model) or "")
    assert flex_attention_dropout(fm.perturbed_model(cls, config, attn_implementation="sdpa")) is None


def test_learned_sinks_under_flex_on_a_cpu_are_refused():
    """transformers runs flex attention with learned sinks only off a CPU (a ValueError in the model's own forward):
    capture and every measurement refuse GPT-OSS so loaded before any work, naming eager; before session 46 capture
    read it (in eager mode) while the model's own forward, which ablation runs, fails."""
    config = tf.GptOssConfig(vocab_size=fm.VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                             num_experts_per_tok=2, max_position_embeddings=64)
    model = fm.perturbed_model(tf.GptOssForCausalLM, config, attn_implementation=FLEX)
    with pytest.raises(ValueError, match="Attention sinks cannot be run on CPU"):  # the premise
        fm.logits(model, fm.tiny_inputs())
    with pytest.raises(HeadlabError, match="learned attention sinks .*flex_attention.*attn_implementation='eager'"):
        with capture_attention(model):
            pass
    with pytest.raises(HeadlabError, match="importance: .*learned attention sinks"):
        with measuring(model, "importance"):
            pass


def test_a_gemma_causal_on_token_ids_is_read_under_flex():
    """Gemma with ``use_bidirectional_attention`` (PaliGemma's flag; its mask is causal on token ids): SDPA skips
    that mask on a batch without padding and is refused, but flex always builds its block mask, so the flex model is
    eager's, causal, and read (before session 46 refused as under SDPA: ``adapters.refuse_mask_skip``)."""
    def build(attn_implementation: str = FLEX):
        cls, config = fm.CONFIGS["gemma"]()
        config.use_bidirectional_attention = True
        return fm.perturbed_model(cls, config, attn_implementation=attn_implementation).double()

    inputs = fm.tiny_inputs(pad=False)  # SDPA's skip: a batch without padding
    torch.testing.assert_close(fm.logits(build(), inputs), fm.logits(build("eager"), inputs), atol=1e-6, rtol=0)
    _, record = fm.check_capture_equals_output_attentions(build, "dec_self", inputs)
    assert all(not torch.triu(probs, diagonal=1).any() for probs in record.values())  # causal
    with pytest.raises(HeadlabError, match="use_bidirectional_attention"):
        with capture_attention(build("sdpa")):
            pass
