"""LRP through HY-V4's and Qwen4-Exp's hyper-connections (importance/mixer_rules/hyper_connection.py, session 37): their
mixing weights, computed from the residual streams, are held constant, so the layer's input is a weighted sum of the
streams and the written-back streams a weighted sum of the residual and the layer's output. Before, LRP was refused
before any work naming them (importance/residual_streams.py), and Qwen4-Exp's hashed n-gram embeddings (PLE layers),
whose share is now counted as kept, as a bias's. HY-V4-VL's: tests/test_hy_v4_vl.py."""

from __future__ import annotations

import pytest
import torch

from headlab import HeadlabError
from headlab.errors import RunFailed
from headlab.importance import compute_lrp, lrp
from headlab.importance.mixer_rules import hyper_connection
from support.lrp_families import assert_conserved, check_rules_leave_the_forward_unchanged, lrp_data
from test_hyper_connection_families import build


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "with-experts"])
def test_lrp_conserves_through_the_hyper_connections(sparse):
    """Float64, padded batches; with its clamped SwiGLU experts too (tests/test_lrp_clamped_mlps.py)."""
    model = build("hy_v4", **({} if sparse else {"mlp_layer_types": ["dense", "dense"]}))
    check_rules_leave_the_forward_unchanged(model)
    assert_conserved(model, 1e-10)


def test_float32_model_conserves():
    assert_conserved(build("hy_v4").float(), 1e-6)


def _strongly_mixed():
    """Mixing weights that depend on the streams enough to show (``fn`` 1000 times its initial ~0.005)."""
    model = build("hy_v4", mlp_layer_types=["dense", "dense"])
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith((".fn", ".hc_fn")):
                parameter.mul_(1000)
    return model


def test_without_the_rule_relevance_is_not_conserved(monkeypatch):
    """The rule matters: on strongly mixed streams it conserves, and with the streams' plain backward (the weights'
    gradients flowing on) the run fails its conservation check."""
    assert_conserved(_strongly_mixed(), 1e-10)
    monkeypatch.setattr(hyper_connection, "_rule", lambda module, args, output: output)
    with pytest.raises(RunFailed, match="did not conserve relevance"):
        compute_lrp(_strongly_mixed(), *lrp_data(_strongly_mixed()), bootstrap=0)


def test_a_hyper_connection_of_another_formula_is_refused_before_any_work():
    model = build("hy_v4", mlp_layer_types=["dense", "dense"])
    connection = model.model.layers[1].ffn_hc
    forward = type(connection).forward

    def doubled(self, streams):  # a forward other than the one read: its collapse doubled
        post, out = forward(self, streams)
        return post, 2 * out

    connection.forward = doubled.__get__(connection)
    with pytest.raises(HeadlabError, match=r"on a probe its forward is not sum_n pre_n s_n"):
        compute_lrp(model, *lrp_data(model), bootstrap=0)


@pytest.mark.parametrize("layer_types", [["indexed_attention"] * 3, None], ids=["attention", "with-gated-delta-net"])
def test_qwen4_exp_without_ngram_embeddings_conserves(layer_types):
    """Qwen4-Exp's gated residuals (its mix weights, the norm's factor and the injection weights held constant), with
    its Gated DeltaNet layer too (its rule: mixer_rules/gated_delta.py); without PLE layers (``ple_layer_ids`` []: the
    config's default)."""
    model = build("qwen4_exp_text", ple_layer_ids=[], **({"layer_types": layer_types} if layer_types else {}))
    check_rules_leave_the_forward_unchanged(model)
    assert_conserved(model, 1e-10)


def test_qwen4_exp_with_ngram_embeddings_conserves_their_share_kept():
    """Its PLE layer's output (the n-gram embeddings gated by the streams) is a source of its own: its share is kept,
    measured by a probe, so the embeddings alone get less than the logit and with the kept shares all of it. Without
    the probe the detached share is lost and the run fails its check."""
    model = build("qwen4_exp_text")
    record = assert_conserved(model, 1e-10)
    assert record["embeddings"]["max"] < 1 - 1e-6, record


def test_qwen4_exp_ngram_share_unmeasured_fails_the_run(monkeypatch):
    monkeypatch.setattr(lrp, "injection_probe_hooks", lambda model, ones: [])
    model = build("qwen4_exp_text")
    with torch.no_grad():  # an injection that matters
        for name, parameter in model.named_parameters():
            if ".ple." in name and name.endswith("value_proj.weight"):
                parameter.mul_(50)
    with pytest.raises(RunFailed, match="did not conserve relevance"):
        compute_lrp(model, *lrp_data(model), bootstrap=0)


def test_an_ngram_injection_the_streams_reach_otherwise_is_refused_before_any_work():
    """A PLE layer whose output also carries the streams themselves (not only through its gate): holding the gate
    constant would not make it a function of the n-gram embeddings: refused before any work."""
    model = build("qwen4_exp_text")
    ple = model.model.layers[0].ple
    forward = type(ple).forward

    def leaking(self, hidden_states, input_ids, cache, conv_mask=None):
        return forward(self, hidden_states, input_ids, cache, conv_mask=conv_mask) + 0.1 * hidden_states

    ple.forward = leaking.__get__(ple)
    with pytest.raises(HeadlabError, match=r"with the streams in the gate g only"):
        compute_lrp(model, *lrp_data(model), bootstrap=0)
