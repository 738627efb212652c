"""LRP through Gemma 4's and Gemma 3n's per-layer inputs (refused before session 29; Gemma 3n's AltUp and activation
sparsity: tests/test_lrp_altup.py).

Each such layer adds ``norm(W_p (act(W_g h) * p))`` to its residual stream, ``p`` its slice of
``(norm(W_m e * s) + T(ids)) / sqrt(2)`` (``e`` the input embeddings, ``T`` the per-layer token embedding
``embed_tokens_per_layer``). The product gets Ding et al.'s product rule, as a gated MLP's does
(importance/rules.py, ``_PerLayerInputProduct``); the relevance it sends into ``p`` reaches ``e`` through
``per_layer_model_projection`` and ``T``'s output, which compute_lrp counts with the input embeddings and reports
apart. Tiny models from configs (hidden 32, 2 layers), float64 where said; no download.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from headlab import HeadlabError
from headlab.capture import eager_attention
from headlab.importance import ImportanceData, compute_lrp, describe_model, lrp_rules
from headlab.importance import lrp as lrp_module
from headlab.importance.lrp import head_relevance, lrp_precision
from headlab.importance.rules import check_rules, per_layer_embeddings, per_layer_input_layers

_GQA = dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, bos_token_id=0, eos_token_id=1,
            pad_token_id=2)
_PER_LAYER = dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=99)


def _gemma4_text(**values):
    return tf.Gemma4ForCausalLM, tf.Gemma4TextConfig(**{
        **_GQA, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4, "global_head_dim": 8,
        **_PER_LAYER, **values})


def _gemma3n_text(**values):
    return tf.Gemma3nForCausalLM, tf.Gemma3nTextConfig(
        **{**_GQA, "intermediate_size": [37, 37]}, layer_types=["sliding_attention", "full_attention"],
        num_kv_shared_layers=0, laurel_rank=4, **_PER_LAYER,
        **{"activation_sparsity_pattern": [0.0, 0.0], "altup_num_inputs": 2, **values})


def _tiny(build, dtype=torch.float32, **values) -> torch.nn.Module:
    cls, config = build(**values)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(config).eval().to(dtype)
    with torch.no_grad():  # off their initial values (norm weights one), so that a rule ignoring them shows
        for name, parameter in model.named_parameters():
            if "norm" in name.lower() and name.endswith("weight"):
                parameter.uniform_(0.5, 1.5)
    return model


def _data(model, n=4):
    info = describe_model(model)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 9, (n,), generator=g).tolist()
    return ImportanceData.from_ids([torch.randint(4, 99, (k,), generator=g).tolist() + [1] for k in lengths]), info


_MOE = dict(enable_moe_block=True, num_experts=3, top_k_experts=2, moe_intermediate_size=16)


@pytest.mark.parametrize(("dtype", "values"), [(torch.float32, {}), (torch.float64, {}), (torch.float64, _MOE)],
                         ids=["float32", "float64", "moe"])
def test_gemma4_lrp_conserves_through_the_per_layer_inputs(dtype, values):
    """Refused before ("per-layer inputs ... none of headlab's rules splits that product"). Now conserved to float64
    rounding (computed in float64: the product rule divides by a + b), a share of it at the per-layer token
    embeddings, reported; with Gemma 4's experts beside the MLP too."""
    model = _tiny(_gemma4_text, dtype, **values)
    assert len(per_layer_input_layers(model)) == 2 and len(per_layer_embeddings(model)) == 1
    check_rules(model)
    assert lrp_precision(model) == torch.float64
    data, info = _data(model)
    record = compute_lrp(model, data, info, bootstrap=0).signature["conservation"]
    assert record["n_sentences"] == 4 and record["n_outside"] == 0, record
    total = record["with_biases"]
    assert abs(total["min"] - 1) < 1e-10 and abs(total["max"] - 1) < 1e-10, total
    # the per-layer token embeddings do get relevance (part of "embeddings"): not lost, not zero
    per_layer = record["per_layer_embeddings"]
    assert per_layer["min"] < per_layer["max"] and max(abs(per_layer["min"]), abs(per_layer["max"])) > 1e-3


def test_the_per_layer_token_embeddings_relevance_is_needed_for_conservation():
    """Without the per-layer token embeddings' share, the input embeddings alone miss relevance (so it is counted,
    not a rounding): the same targets, the share subtracted, are off by more than the tolerance."""
    model = _tiny(_gemma4_text, torch.float64)
    data, info = _data(model)
    from headlab.data.inputs import make_batches

    batch = next(iter(make_batches(data, info, batch_size=4, side="translation", device=torch.device("cpu"))))
    result = head_relevance(model, batch)
    torch.testing.assert_close(result.embedding + result.biases, result.logits, rtol=1e-10, atol=1e-10)
    assert result.per_layer_embedding is not None
    without = result.embedding - result.per_layer_embedding
    assert ((without - result.logits).abs() > lrp_module.CONSERVATION_TOLERANCE * result.logits.abs()).any()


@pytest.mark.parametrize("strategy", ["loop", "jacobian"])
def test_every_strategy_gives_the_same_shares(strategy):
    model = _tiny(_gemma4_text, torch.float64)
    data, info = _data(model, n=2)
    from headlab.data.inputs import make_batches

    batch = next(iter(make_batches(data, info, batch_size=2, side="translation", device=torch.device("cpu"))))
    vmap, other = head_relevance(model, batch), head_relevance(model, batch, strategy=strategy)
    for name in ("embedding", "biases", "per_layer_embedding"):
        torch.testing.assert_close(getattr(other, name), getattr(vmap, name), rtol=1e-9, atol=1e-12)
    for key, values in vmap.relevance.items():
        torch.testing.assert_close(other.relevance[key], values, rtol=1e-9, atol=1e-12)


def test_the_rules_leave_the_forward_unchanged():
    model = _tiny(_gemma4_text, torch.float64)
    ids = torch.randint(4, 99, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), eager_attention(model):
        before = model(input_ids=ids).logits
    with torch.enable_grad(), eager_attention(model), lrp_rules(model):
        during = model(input_ids=ids).logits
    assert torch.equal(during.detach(), before)


def test_a_layer_whose_product_is_something_else_is_refused():
    """The rule checks, on every call, that per_layer_projection's input is act(gate(h)) * per_layer_input."""
    model = _tiny(_gemma4_text, torch.float64)
    data, info = _data(model, n=1)
    layer = model.model.layers[1]
    # before the rule's pre-hook: the input it sees is no longer the product
    handle = layer.per_layer_projection.register_forward_pre_hook(lambda module, args: (args[0] * 1.5,), prepend=True)
    try:
        with pytest.raises(HeadlabError, match=r"is not act_fn\(per_layer_input_gate\(h\)\) \* per_layer_input"):
            compute_lrp(model, data, info, bootstrap=0)
    finally:
        handle.remove()


def test_per_layer_inputs_without_their_token_embedding_are_refused_before_any_work():
    model = _tiny(_gemma4_text, torch.float64)
    del model.model.embed_tokens_per_layer
    model.model.embed_tokens_per_layer = None
    with pytest.raises(HeadlabError, match=r"no per-layer token embedding \(embed_tokens_per_layer\)"):
        check_rules(model)


def test_gemma3ns_per_layer_inputs_have_their_rule_beside_altup():
    """Gemma 3n was refused here for its AltUp and activation sparsity until session 30; they have rules now
    (tests/test_lrp_altup.py, which checks conservation), and its per-layer inputs this one."""
    from headlab.importance.rules import _no_rule

    model = _tiny(_gemma3n_text)
    check_rules(model)
    assert len(per_layer_input_layers(model)) == 2 and len(per_layer_embeddings(model)) == 1
    assert _no_rule(model.model.layers[0], "model.layers.0", set()) is None


def test_the_report_caption_names_the_per_layer_share():
    from headlab.importance.lrp import LRP

    model = _tiny(_gemma4_text, torch.float64)
    data, info = _data(model, n=2)
    signature = compute_lrp(model, data, info, bootstrap=0).signature
    assert "at the per-layer token embeddings" in LRP.caption_note(signature)
    plain = {**signature, "conservation": {k: v for k, v in signature["conservation"].items()
                                           if k != "per_layer_embeddings"}}
    assert "per-layer" not in LRP.caption_note(plain) and "conservation over 2 sentences" in LRP.caption_note(plain)


def test_lrp_on_gemma4_with_its_towers_is_its_text_models():
    """Gemma 4's vision-language wrapper computes the per-layer inputs itself (Gemma4Model.forward, from the token
    ids) and hands them to its language model: the same relevance as the language model alone, the same weights."""
    import numpy as np

    from test_multimodal_towers import _text_model_alone, gemma4

    model = gemma4().double()
    text = _text_model_alone(model, tf.Gemma4ForCausalLM)
    data = ImportanceData.from_ids([[5, 6, 7, 8, 1], [9, 10, 11, 1], [12, 13, 14, 15, 16, 1]])
    got, want = (compute_lrp(m, data, describe_model(m), batch_size=2, bootstrap=0) for m in (model, text))
    np.testing.assert_allclose(got.scores["dec_self"], want.scores["dec_self"], rtol=1e-9, atol=1e-12)
    for part in ("embeddings", "with_biases", "per_layer_embeddings"):
        assert got.signature["conservation"][part] == pytest.approx(want.signature["conservation"][part], rel=1e-9)
    assert got.signature["conservation"]["n_outside"] == 0
