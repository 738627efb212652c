"""LRP through Kimi Delta Attention (headlab.importance.mixer_rules.kda): Kimi Linear's and GLM-5-Next's KDA layers as
released (a KDA layer, then an attention layer). Since session 38: relevance conserved through the hybrid (before,
refused before any work: no rule for KDA), the relevance the rule gives equal to the rule written out by hand from the
modeling code (the per-token recurrence, every factor computed from the input held constant), the forward unchanged
under the rules, and a KDA layer computing something else refused before any work."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from support.lrp_families import (
    assert_conserved,
    check_lrp_refused_before_any_work,
    check_mixer_rule_written_out,
    check_rules_leave_the_forward_unchanged,
)
from test_kda_hybrids import _kimi
from test_mla_pruning import glm5_next


def _glm5_next():
    return glm5_next(["linear_attention", "indexed_attention"])


BUILDERS = {"kimi_linear": _kimi, "glm5_next": _glm5_next}


def _eager_experts(model):
    model.config.get_text_config()._experts_implementation = "eager"  # grouped matmuls take no float64
    return model


def _mixer(model):
    return next(m for m in model.modules() if type(m).__name__ in ("KimiLinearDeltaAttention",
                                                                   "Glm5NextTextLinearAttention"))


@pytest.mark.parametrize("family", BUILDERS)
def test_lrp_conserves_through_the_kda_layer(family):
    assert_conserved(_eager_experts(BUILDERS[family]()).double(), 1e-10)


def _reference(mixer, x):
    """The mixer's output as a linear map of ``x`` through its values: every factor computed from the input held
    constant (without a gradient, from the forward's own values), the recurrence written per token."""
    heads, d, width = mixer.num_heads, mixer.head_dim, mixer.qkv_dim
    batch, seq, _ = x.shape
    weight = mixer.conv1d.weight  # [channels, 1, kernel]
    kernel = weight.shape[-1]

    def conv(h, w):  # causal depthwise convolution, per channel: sum_j w[c, j] h[t - (kernel - 1) + j]
        padded = F.pad(h, (0, 0, kernel - 1, 0))
        return sum(w[:, 0, j] * padded[:, j:j + seq] for j in range(kernel))

    v_in = mixer.v_proj(x)
    with torch.no_grad():
        pre = conv(torch.cat([mixer.q_proj(x), mixer.k_proj(x), v_in], -1), weight)
        post = F.silu(pre)
        q = post[..., :width].reshape(batch, seq, heads, d)
        k = post[..., width:2 * width].reshape(batch, seq, heads, d)
        q, k = (h / torch.sqrt((h * h).sum(-1, keepdim=True) + 1e-6) for h in (q, k))  # FLA's l2norm, its eps
        q = q * d ** -0.5
        beta = torch.sigmoid(mixer.b_proj(x))
        g = mixer.forget_gate(x)  # [batch, seq, heads, d]: a decay per channel
        pre_v = pre[..., 2 * width:]
        ratio = torch.where(pre_v != 0, F.silu(pre_v) / pre_v, torch.zeros_like(pre_v))
        z = mixer.g_b_proj(mixer.g_a_proj(x)).reshape(batch, seq, heads, d)
    v = (conv(v_in, weight[2 * width:]) * ratio).reshape(batch, seq, heads, d)
    state = x.new_zeros(batch, heads, d, d)  # S_t: [key, value]
    outputs = []
    for t in range(seq):  # recurrent_kimi_delta_attention's loop
        state = state * g[:, t].exp()[..., None]
        delta = (v[:, t] - (state * k[:, t, ..., None]).sum(-2)) * beta[:, t, :, None]
        state = state + k[:, t, ..., None] * delta[..., None, :]
        outputs.append((state * q[:, t, ..., None]).sum(-2))
    o = torch.stack(outputs, dim=1)
    norm = mixer.o_norm
    with torch.no_grad():
        factor = torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) * norm.weight * torch.sigmoid(z)
    return mixer.o_proj((o * factor).reshape(batch, seq, -1))


@pytest.mark.parametrize("family", BUILDERS)
def test_the_relevance_is_that_of_the_rule_written_out(family):
    model = _eager_experts(BUILDERS[family]()).to(torch.float64)
    # to float32's rounding: the forget gate computes in float32 whatever the model's dtype (``.float()``), and the
    # forward's recurrence is the chunked form, the reference's the per-token one
    check_mixer_rule_written_out(model, _mixer(model), _reference, rtol=1e-5, atol=1e-8, forward_atol=1e-8,
                                 conserved=1e-10)


@pytest.mark.parametrize("family", BUILDERS)
def test_the_forward_is_unchanged_under_the_rules(family):
    check_rules_leave_the_forward_unchanged(BUILDERS[family](), padded=True)


def test_a_kda_layer_computing_something_else_is_refused_before_any_work():
    """Its class named as one the rule knows, its forward another (the output doubled): the probe finds it."""
    model = _kimi()
    mixer = _mixer(model)
    base = type(mixer)
    mixer.__class__ = type(base.__name__, (base,), {"forward": lambda self, *a, **k: 2 * base.forward(self, *a, **k),
                                                    "__module__": base.__module__})
    check_lrp_refused_before_any_work(model, r"no rule for KimiLinearDeltaAttention \(model\.layers\.0\.self_attn\): "
                                             r".*on a probe its forward does not compute")
