"""LRP through Gemma 3n's alternating updates (AltUp) and activation sparsity (refused before session 30).

AltUp's streams are mixed by coefficients the router computes from the stream; the rule holds them constant (the
router's output detached), so predict and correct are weighted sums of the streams; the magnitude ratios that make
and put back the streams are held constant as an RMS norm's ``1 / rms`` is (importance/rules.py, ``_AltUpStreams``).
Activation sparsity, ``relu(x - mean(x) - z * std(x))``, keeps its ordinary backward: it is positively homogeneous
of degree one, so that backward conserves relevance (Euler), and holding its cutoff constant would not (a test below).
Relevance is measured at the input embeddings (the input of ``per_layer_model_projection``), from which both the
streams and the per-layer inputs are made. Tiny models from configs (hidden 32, 2 layers), no download.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from headlab import HeadlabError
from headlab.capture import eager_attention
from headlab.errors import RunFailed
from headlab.importance import compute_lrp, lrp_rules
from headlab.importance import lrp as lrp_module
from headlab.importance import rules as rules_module
from headlab.importance.lrp import lrp_precision
from headlab.importance.rules import _no_rule, altup_inputs, altup_models, check_rules
from support.family_matrix import check_lrp_conserves
from support.lrp_families import (
    check_lrp_refused_under_pre_hook,
    check_rules_leave_the_forward_unchanged,
    check_strategies_agree,
    gemma3n_text,
    lrp_data,
    per_layer_model,
)

_SPARSE = {"activation_sparsity_pattern": [0.95, 0.3]}


def _gemma3n(dtype=torch.float64, **values) -> nn.Module:
    """A tiny Gemma 3n whose AltUp does something: ``correct_output_scale`` is zero at initialisation (which switches
    the per-layer inputs' branch off) and the router's weights are small; both drawn off those values."""
    model = per_layer_model(gemma3n_text, dtype, **values)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("correct_output_scale"):
                parameter.uniform_(0.5, 1.5)
            elif any(part in name for part in ("prediction_coefs", "correction_coefs", "modality_router")):
                parameter.normal_(0, 0.5)
    return model


def _conservation(model) -> dict:
    data, info = lrp_data(model)
    return compute_lrp(model, data, info, bootstrap=0).signature["conservation"]


@pytest.mark.parametrize(("dtype", "values"), [
    (torch.float32, {}), (torch.float64, {}), (torch.float64, _SPARSE), (torch.float32, _SPARSE),
    (torch.float64, {**_SPARSE, "altup_num_inputs": 4, "altup_active_idx": 1}),
], ids=["float32", "float64", "sparse", "sparse-float32", "four-streams"])
def test_gemma3n_lrp_conserves_through_altup_and_activation_sparsity(dtype, values):
    """Refused before ("alternating updates ... none of headlab's rules splits"; "activation sparsity ... none of
    headlab's rules holds constant"). Now conserved to float64 rounding (computed in float64, for the per-layer
    inputs' product rule), the per-layer token embeddings' share live."""
    model = _gemma3n(dtype, **values)
    assert len(altup_models(model)) == 1 and altup_inputs(model) == [model.model.per_layer_model_projection]
    check_rules(model)
    assert lrp_precision(model) == torch.float64
    record = _conservation(model)
    assert record["n_sentences"] == 4 and record["n_outside"] == 0, record
    total = record["with_biases"]
    assert abs(total["min"] - 1) < 1e-12 and abs(total["max"] - 1) < 1e-12, total
    per_layer = record["per_layer_embeddings"]
    assert max(abs(per_layer["min"]), abs(per_layer["max"])) > 1e-3, per_layer


@pytest.mark.parametrize("values", [{}, _SPARSE], ids=["dense", "sparse"])
def test_the_bias_free_unit_gain_check_conserves(values):
    """The family matrix's check (every linear map redrawn at unit gain), in float64 to 1e-12."""
    model = _gemma3n(torch.float64, **values)
    calls = check_lrp_conserves(model, model.model.layers[0], rtol=1e-12, atol=1e-12)
    assert calls == 1


@pytest.mark.parametrize("values", [{}, _SPARSE], ids=["dense", "sparse"])
def test_the_rules_leave_the_forward_unchanged(values):
    check_rules_leave_the_forward_unchanged(_gemma3n(torch.float64, **values))


def test_a_live_router_would_not_conserve(monkeypatch):
    """Why the router's output is detached: with it live, AltUp's coefficients are functions of the stream they
    multiply, and relevance is no longer conserved (compute_lrp's check fails the run): the conservation above is
    the rule's doing."""
    model = _gemma3n(torch.float64)
    assert abs(_conservation(model)["with_biases"]["max"] - 1) < 1e-12
    hooks = rules_module._altup_hooks
    monkeypatch.setattr(rules_module, "_altup_hooks", lambda text: [
        (m, kind, hook) for m, kind, hook in hooks(text) if hook is not rules_module._detach_output])
    with pytest.raises(RunFailed, match="did not conserve relevance"):  # outside compute_lrp's 1e-3
        _conservation(model)


def test_holding_the_sparsity_cutoff_constant_would_not_conserve():
    """Why activation sparsity keeps its ordinary backward: with its cutoff mean + z * std held constant (as a gate
    would be), relu(x - c) keeps c's share like a bias, not counted anywhere, and relevance is lost."""
    model = _gemma3n(torch.float64, **_SPARSE)
    assert abs(_conservation(model)["with_biases"]["max"] - 1) < 1e-12
    for layer in model.model.layers:
        mlp = layer.mlp
        if mlp.activation_sparsity > 0:
            z = torch.distributions.normal.Normal(0, 1).icdf(torch.tensor(mlp.activation_sparsity)).item()

            def held(x, z=z):
                cutoff = (x.mean(-1, keepdim=True) + x.std(-1, keepdim=True, unbiased=False) * z).detach()
                return torch.relu(x - cutoff)

            mlp._gaussian_topk = held
    with pytest.raises(RunFailed, match="did not conserve relevance"):  # outside compute_lrp's 1e-3
        _conservation(model)


def test_a_first_layer_input_that_is_not_the_streams_is_refused():
    """The first layer's input is checked, on every call, to be the streams the rule recomputes."""
    model = _gemma3n(torch.float64)
    check_lrp_refused_under_pre_hook(
        model, model.model.layers[0], lambda module, args, kwargs: ((args[0] * 1.5, *args[1:]), kwargs) if args
        else (args, {**kwargs, "hidden_states": kwargs["hidden_states"] * 1.5}),
        r"the input of the first layer of Gemma3nTextModel is not", with_kwargs=True, prepend=True)


def test_a_final_mix_that_is_not_the_streams_is_refused():
    model = _gemma3n(torch.float64)
    check_lrp_refused_under_pre_hook(model, model.model.norm, lambda module, args: (args[0] * 1.5,),
                                     r"the input of the final norm of Gemma3nTextModel is not", prepend=True)


def test_altup_outside_gemma3ns_text_model_is_refused_before_any_work():
    model = _gemma3n(torch.float64)
    del model.model.altup_unembed_projections
    with pytest.raises(HeadlabError, match=r"no rule for the alternating updates Gemma3nTextAltUp "
                                           r"\(model.layers.0.altup\)"):
        check_rules(model)


def test_activation_sparsity_that_is_not_homogeneous_is_refused():
    """The ordinary backward conserves only for a positively homogeneous function: another one is named."""
    model = _gemma3n(torch.float64, **_SPARSE)
    mlp = model.model.layers[0].mlp
    assert _no_rule(mlp, "model.layers.0.mlp", set()) is None
    mlp._gaussian_topk = lambda x: torch.relu(x - 0.1)
    assert "not positively homogeneous" in _no_rule(mlp, "model.layers.0.mlp", set())
    with pytest.raises(HeadlabError, match=r"Gemma3nTextMLP \(model.layers.0.mlp\): activation sparsity"):
        check_rules(model)


def test_the_input_embeddings_are_the_cut():
    """LRP's input relevance is measured at the input embeddings, not at the stack of streams the first layer reads:
    the per-layer inputs reach them through per_layer_model_projection, past the stack."""
    model = _gemma3n(torch.float64)
    ids = torch.randint(4, 99, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.enable_grad(), eager_attention(model), lrp_rules(model), lrp_module._embeddings(model) as found:
        embeds = []
        handle = model.model.embed_tokens.register_forward_hook(lambda module, args, output: embeds.append(output))
        try:
            model(input_ids=ids)
        finally:
            handle.remove()
    assert len(found) == 1 and found[0] is embeds[0]


def test_gemma3n_with_shared_keys_and_values_conserves():
    """Gemma 3n's last layers attend with the keys and values of earlier ones (num_kv_shared_layers): conserved too."""
    from test_kv_shared_layers import _gemma3n as shared_gemma3n

    model = shared_gemma3n()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.altup.correct_output_scale.uniform_(0.5, 1.5)
    record = _conservation(model)
    assert record["n_outside"] == 0 and abs(record["with_biases"]["max"] - 1) < 1e-12 \
        and abs(record["with_biases"]["min"] - 1) < 1e-12, record
    check_lrp_conserves(model, model.model.layers[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("strategy", ["loop", "jacobian"])
def test_every_strategy_gives_the_same_shares(strategy):
    model = _gemma3n(torch.float64, **_SPARSE)
    check_strategies_agree(model, *lrp_data(model), strategy)
