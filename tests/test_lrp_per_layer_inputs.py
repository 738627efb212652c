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
from headlab.importance import ImportanceData, compute_lrp, describe_model
from headlab.importance import lrp as lrp_module
from headlab.importance.lrp import head_relevance, lrp_precision
from headlab.importance.rules import check_rules, per_layer_embeddings, per_layer_input_layers
from support.lrp_families import (
    check_lrp_refused_under_pre_hook,
    check_rules_leave_the_forward_unchanged,
    check_strategies_agree,
    gemma3n_text,
    gemma4_text,
    lrp_data,
    per_layer_model,
)

_MOE = dict(enable_moe_block=True, num_experts=3, top_k_experts=2, moe_intermediate_size=16)


@pytest.mark.parametrize(("dtype", "values"), [(torch.float32, {}), (torch.float64, {}), (torch.float64, _MOE)],
                         ids=["float32", "float64", "moe"])
def test_gemma4_lrp_conserves_through_the_per_layer_inputs(dtype, values):
    """Refused before ("per-layer inputs ... none of headlab's rules splits that product"). Now conserved to float64
    rounding (computed in float64: the product rule divides by a + b), a share of it at the per-layer token
    embeddings, reported; with Gemma 4's experts beside the MLP too."""
    model = per_layer_model(gemma4_text, dtype, **values)
    assert len(per_layer_input_layers(model)) == 2 and len(per_layer_embeddings(model)) == 1
    check_rules(model)
    assert lrp_precision(model) == torch.float64
    data, info = lrp_data(model)
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
    model = per_layer_model(gemma4_text, torch.float64)
    data, info = lrp_data(model)
    from headlab.data.inputs import make_batches

    batch = next(iter(make_batches(data, info, batch_size=4, side="translation", device=torch.device("cpu"))))
    result = head_relevance(model, batch)
    torch.testing.assert_close(result.embedding + result.biases, result.logits, rtol=1e-10, atol=1e-10)
    assert result.per_layer_embedding is not None
    without = result.embedding - result.per_layer_embedding
    assert ((without - result.logits).abs() > lrp_module.CONSERVATION_TOLERANCE * result.logits.abs()).any()


@pytest.mark.parametrize("strategy", ["loop", "jacobian"])
def test_every_strategy_gives_the_same_shares(strategy):
    model = per_layer_model(gemma4_text, torch.float64)
    check_strategies_agree(model, *lrp_data(model, n=2), strategy)


def test_the_rules_leave_the_forward_unchanged():
    check_rules_leave_the_forward_unchanged(per_layer_model(gemma4_text, torch.float64))


def test_a_layer_whose_product_is_something_else_is_refused():
    """The rule checks, on every call, that per_layer_projection's input is act(gate(h)) * per_layer_input."""
    model = per_layer_model(gemma4_text, torch.float64)
    # before the rule's pre-hook: the input it sees is no longer the product
    check_lrp_refused_under_pre_hook(
        model, model.model.layers[1].per_layer_projection, lambda module, args: (args[0] * 1.5,),
        r"is not act_fn\(per_layer_input_gate\(h\)\) \* per_layer_input", n=1, prepend=True)


def test_per_layer_inputs_without_their_token_embedding_are_refused_before_any_work():
    model = per_layer_model(gemma4_text, torch.float64)
    del model.model.embed_tokens_per_layer
    model.model.embed_tokens_per_layer = None
    with pytest.raises(HeadlabError, match=r"no per-layer token embedding \(embed_tokens_per_layer\)"):
        check_rules(model)


def test_gemma3ns_per_layer_inputs_have_their_rule_beside_altup():
    """Gemma 3n was refused here for its AltUp and activation sparsity until session 30; they have rules now
    (tests/test_lrp_altup.py, which checks conservation), and its per-layer inputs this one."""
    from headlab.importance.rules import _no_rule

    model = per_layer_model(gemma3n_text)
    check_rules(model)
    assert len(per_layer_input_layers(model)) == 2 and len(per_layer_embeddings(model)) == 1
    assert _no_rule(model.model.layers[0], "model.layers.0", set()) is None


def test_the_report_caption_names_the_per_layer_share():
    from headlab.importance.lrp import LRP

    model = per_layer_model(gemma4_text, torch.float64)
    data, info = lrp_data(model, n=2)
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
