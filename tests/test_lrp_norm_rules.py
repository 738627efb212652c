"""LRP rules for the normalisations and the MLP that the family sweep (experiments/family_sweep.py) found
refused (session 28, task lrpnorm28); each is a computation headlab already had a rule for:

* Cohere's ``CohereLayerNorm`` (Cohere 2, Cohere2-MoE and Compass have copies): a layer norm with a weight and no
  bias, computed in float32: the layer-norm rule (``1 / std`` held constant, LXT's ``layer_norm_forward``) with
  the factor it really applied. A class named ``...LayerNorm`` that computes an RMS norm (T5's copies: Switch
  Transformers', Pop2Piano's) gets the RMS rule since session 41, and one computing neither stays refused before
  any work: a probe of its forward says what it computes;
* MobileBERT's ``NoNorm``: ``x * weight + bias``, no statistics: a weighted sum, whose ordinary backward is the
  linear rule; and MobileBERT's LM head, which multiplies its output layer's weight itself (never calling it):
  the explained logit is rebuilt from the head's own parts (checked);
* RoBERTa-PreLayerNorm's ``RobertaPreLayerNormLMHead`` was taken for a norm by its family's name: it is
  RoBERTa's LM head;
* LFM2's ``Lfm2MLP``: ``w2(silu(w1 x) * w3 x)`` with ``F.silu`` a function call: Llama's gated MLP, the same
  activation and product rules, hooked on ``w1``, ``w3`` and ``w2``; another activation is refused before any work.

Relevance is conserved in float64 to 1e-12 on bias-free copies (tests/support/family_matrix.check_lrp_conserves),
and compute_lrp's own conservation record holds. Before, check_rules refused each of them. Tiny models from
their configs; no download.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from headlab import HeadlabError
from headlab.importance import ImportanceData, compute_lrp, describe_model
from headlab.importance.rules import check_rules, lrp_rules, norm_rule
from support.discovered import tiny_model
from support.family_matrix import check_lrp_conserves

_GQA = dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, bos_token_id=0, eos_token_id=1,
            pad_token_id=2)


def _build(cls, config) -> torch.nn.Module:
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():  # off their initial values, so that a rule ignoring them shows
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 0.1)
            elif "norm" in name.lower() and name.endswith("weight"):
                parameter.uniform_(0.5, 1.5)
    return model


FAMILIES = {  # name: (build, first layer, how precise compute_lrp's record is in the precision LRP picks)
    "cohere": (lambda: tiny_model("cohere", attn_implementation="eager"), lambda m: m.model.layers[0], 1e-9),
    # its q_norm and k_norm: CohereLayerNorm with a weight [heads, d], on the detached queries and keys
    "cohere-qk-norm": (lambda: _build(tf.CohereForCausalLM, tf.CohereConfig(**_GQA, use_qk_norm=True)),
                       lambda m: m.model.layers[0], 1e-9),
    "cohere2": (lambda: _build(tf.Cohere2ForCausalLM, tf.Cohere2Config(**_GQA, sliding_window=4)),
                lambda m: m.model.layers[0], 1e-9),
    "lfm2": (lambda: _build(tf.Lfm2ForCausalLM, tf.Lfm2Config(**_GQA, layer_types=["full_attention"] * 2)),
             lambda m: m.model.layers[0], 1e-9),
    "mobilebert": (lambda: _build(tf.MobileBertForMaskedLM, tf.MobileBertConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
        embedding_size=16, intra_bottleneck_size=16, true_hidden_size=16, num_feedforward_networks=2,
        pad_token_id=2)), lambda m: m.mobilebert.encoder.layer[0], 1e-5),
    "roberta-prelayernorm": (lambda: tiny_model("roberta-prelayernorm", attn_implementation="eager"),
                             lambda m: m.roberta_prelayernorm.encoder.layer[0], 1e-5),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_lrp_conserves_relevance_in_float64(family):
    """What reaches the first layer's input sums to the explained logit within 1e-12 (before: refused)."""
    build, first, _ = FAMILIES[family]
    model = build().double()
    check_rules(model)
    assert check_lrp_conserves(model, first(model), rtol=1e-12, atol=1e-12) == 1


@pytest.mark.parametrize("family", FAMILIES)
def test_compute_lrp_conserves_relevance(family):
    """The measure itself (its precision, its bias probes, its targets): relevance at the embeddings plus the
    biases' shares is the explained logit, per sentence, with random biases and norm weights."""
    build, _, tolerance = FAMILIES[family]
    model = build()
    info = describe_model(model)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 9, (4,), generator=g).tolist()
    data = ImportanceData.from_ids([torch.randint(4, 99, (k,), generator=g).tolist() + [1] for k in lengths])
    record = compute_lrp(model, data, info, bootstrap=0).signature["conservation"]
    assert record["n_sentences"] == 4 and record["n_outside"] == 0, record
    total = record["with_biases"]
    assert abs(total["min"] - 1) < tolerance and abs(total["max"] - 1) < tolerance, total


def test_mobileberts_logits_are_explained_through_the_weights_its_head_multiplies():
    """Its head never calls ``decoder``: the target is ``transform(x)`` times ``[decoder.weight^T; dense.weight]``
    plus ``decoder.bias``, rebuilt and checked against the logits; a head computing anything else is refused."""
    model = FAMILIES["mobilebert"][0]()
    info = describe_model(model)
    data = ImportanceData.from_ids([[5, 6, 7, 8, 1], [9, 10, 11, 1]])
    compute_lrp(model, data, info, bootstrap=0)
    head = model.cls.predictions
    original = type(head).forward
    # the same class name, logits doubled: no longer what the rebuilt target is
    doubled = type("MobileBertLMPredictionHead", (type(head),), {"forward": lambda self, h: original(self, h) * 2})
    head.__class__ = doubled
    with pytest.raises(HeadlabError, match="MobileBERT's LM head does not compute its logits as"):
        compute_lrp(model, data, info, bootstrap=0)


def test_a_layer_norm_by_name_is_one_only_if_it_computes_one():
    """Cohere's norm gets the layer-norm rule; T5's copy in Pop2Piano (``Pop2PianoLayerNorm``: an RMS norm) gets the
    RMS norm's, as a probe shows it computes one (since session 41; refused before); a ``...LayerNorm`` computing
    neither is refused before any work; on the meta device (no probe) the rule checks the formula on every call."""
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm
    from transformers.models.pop2piano.modeling_pop2piano import Pop2PianoLayerNorm

    from headlab.importance.rules import _rms_norm_rule

    class DoubledLayerNorm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(8))

        def forward(self, x):
            return 2 * x * self.weight

    cohere = CohereLayerNorm(8)
    assert norm_rule(cohere) is not None
    assert norm_rule(Pop2PianoLayerNorm(8)) is _rms_norm_rule
    with pytest.raises(HeadlabError, match="no rule for the normalisation module DoubledLayerNorm"):
        norm_rule(DoubledLayerNorm())
    with torch.device("meta"):
        assert norm_rule(Pop2PianoLayerNorm(8)) is not None
    rms = Pop2PianoLayerNorm(8)
    rule = norm_rule(CohereLayerNorm(8))
    x = torch.randn(2, 3, 8)
    with pytest.raises(HeadlabError, match="Pop2PianoLayerNorm is not \\(x - mean\\(x\\)\\) / std\\(x\\)"):
        rule(rms, (x,), rms(x))
    # Cohere's QK norm: a weight per head, [heads, d]
    per_head = CohereLayerNorm((4, 8))
    with torch.no_grad():
        per_head.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 3, 4, 8, dtype=torch.float64, requires_grad=True)
    out = norm_rule(per_head)(per_head, (x,), per_head.double()(x))
    torch.testing.assert_close(out, per_head(x))
    g, = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close((x * g).sum(), out.sum(), rtol=1e-12, atol=1e-12)  # the identity rule: conserved


def test_an_affine_norm_is_one_only_if_it_computes_x_times_weight_plus_bias():
    """MobileBERT's ``NoNorm`` gets the linear rule (its output left as it is); a module of that name computing
    anything else is refused before any work."""
    from transformers.models.mobilebert.modeling_mobilebert import NoNorm

    assert norm_rule(NoNorm(8)) is not None

    class OtherNoNorm(NoNorm):
        def forward(self, input_tensor):
            return input_tensor * self.weight + self.bias * input_tensor.mean(-1, keepdim=True)

    OtherNoNorm.__name__ = "NoNorm"
    other = OtherNoNorm(8)
    with torch.no_grad():
        other.bias.fill_(1.0)
    with pytest.raises(HeadlabError, match="no rule for the normalisation module NoNorm"):
        norm_rule(other)


def test_lfm2s_mlp_with_another_activation_is_refused_before_any_work():
    """``w2(gelu(w1 x) * w3 x)`` is not the SiLU the rule assumes: refused by check_rules, naming it."""
    from transformers.models.lfm2.modeling_lfm2 import Lfm2MLP

    class GeluMLP(Lfm2MLP):
        def forward(self, x):
            return self.w2(torch.nn.functional.gelu(self.w1(x)) * self.w3(x))

    model = FAMILIES["lfm2"][0]()
    check_rules(model)
    model.model.layers[1].feed_forward.__class__ = GeluMLP
    with pytest.raises(HeadlabError, match=r"GeluMLP \(model.layers.1.feed_forward\): a gated MLP .* not SiLU"):
        check_rules(model)


def test_lfm2s_product_is_checked_on_every_call():
    """Where no probe ran (the check passed on another forward), a product that is not silu(w1 x) * w3 x at w2's
    input is refused when it reaches w2, not given a wrong backward."""
    model = FAMILIES["lfm2"][0]()
    mlp = model.model.layers[0].feed_forward
    with torch.enable_grad(), lrp_rules(model):
        mlp.w1.register_forward_hook(lambda module, args, output: output * 2)  # after the rule's hook: w2's input differs
        with pytest.raises(HeadlabError, match="the input of Linear is not silu\\(w1 x\\) \\* w3 x"):
            model(input_ids=torch.tensor([[5, 6, 7]]))


def test_lfm2s_mlp_is_computed_in_float64_as_the_other_gated_mlps():
    """Ding et al.'s product rule divides by ``a + b``, which crosses zero: LRP runs LFM2 in float64 too."""
    from headlab.importance.lrp import lrp_precision

    assert lrp_precision(FAMILIES["lfm2"][0]()) == torch.float64
    assert lrp_precision(FAMILIES["mobilebert"][0]()) == torch.float32  # no gated MLP


def test_switch_transformers_norm_is_an_rms_norm_and_lrp_conserves():
    """Regression: Switch Transformers' ``SwitchTransformersLayerNorm`` (T5's RMS norm under a layer norm's name) had
    no rule: its LRP was refused before any work ("no rule for the normalisation module"). A probe shows it to be an
    RMS norm; compute_lrp explains the model's own translation, relevance conserved in float64."""
    from headlab.data.inputs import translate_data
    from support.lrp_families import lrp_data, offset_biases_and_norms
    from test_swept_families import T5_LIKE

    cls, config = T5_LIKE["switch_transformers"]()
    torch.manual_seed(0)
    model = cls(config).eval().double()
    offset_biases_and_norms(model)
    check_rules(model)
    data, info = lrp_data(model)
    data = translate_data(model, data, info, max_length_a=0.5, max_length_b=4)
    translated = sum(1 for t in data.translations if t)  # an empty translation (end of sentence first) has no target
    assert translated >= 2
    record = compute_lrp(model, data, info, bootstrap=0).signature["conservation"]
    assert record["n_sentences"] == translated and record["n_outside"] == 0, record
    total = record["with_biases"]
    assert abs(total["min"] - 1) < 1e-10 and abs(total["max"] - 1) < 1e-10, total
