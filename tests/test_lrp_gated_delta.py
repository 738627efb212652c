"""LRP through Gated DeltaNet mixers (headlab.importance.mixer_rules.gated_delta): Qwen3-Next, Qwen3.5, Qwen3.5-MoE,
OLMo-hybrid and LaraMini, each a hybrid (a Gated DeltaNet layer at 0, attention at 1). Before session 35 LRP was
refused on all of them ("a state-space (or linear recurrent) token mixer").

* conservation, float32, float64 and bfloat16 models (computed in float64: their gated MLPs), to float64 rounding;
* the rule is the stated rule: the relevance of the mixer's input equals gradient x input of a short float64
  re-implementation of the mixer written here (a per-step recurrence, not transformers' chunked one) in which q, k,
  beta, g, the gate, the SiLU's ratio and the norm's factor are plain numbers;
* the forward is bit for bit the same under the rules;
* a Gated DeltaNet of another class, another layout or another forward, and a cached state from earlier tokens, are
  refused, naming why;
* the relevance below the first attention layer is measured: a mixer rule that does not conserve fails the run
  (before, LRP's input cut was the first attention layer's input, above the mixer, and any rule passed).
"""

import pytest
import torch
import torch.nn.functional as F
import transformers as tf

from headlab.errors import HeadlabError, RunFailed
from headlab.importance import ImportanceData, compute_lrp, describe_model, lrp_rules
from headlab.importance.mixer_rules import gated_delta
from support.family_matrix import _gqa, perturbed_model
from support.family_matrix import tiny_model as matrix_model
from support.lrp_families import (
    check_lrp_refused_before_any_work,
    check_mixer_rule_written_out,
    check_rules_leave_the_forward_unchanged,
)


def _lara_mini() -> torch.nn.Module:
    config = tf.LaraMiniConfig(
        **{**_gqa(), "intermediate_size": 40}, layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        moe_intermediate_size=40, num_experts=3, num_experts_per_tok=2, shared_expert_intermediate_size=40)
    return perturbed_model(tf.LaraMiniForCausalLM, config)


BUILDERS = {
    **{f"{t}-hybrid": (lambda t=t: matrix_model(f"{t}-hybrid")) for t in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")},
    "olmo_hybrid": lambda: matrix_model("olmo_hybrid"),
    "lara_mini": _lara_mini,
}
FAMILIES = tuple(BUILDERS)


def _mixer(model):
    return model.model.layers[0].linear_attn


def _data(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return ImportanceData.from_ids([torch.randint(3, 99, (k,), generator=g).tolist() + [1] for k in (3, 6, 9, 5)[:n]])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_lrp_conserves_through_the_gated_delta_net(family, dtype):
    """Computed in float64 (their gated MLPs), also from a bfloat16 model (widened), whose probe before any work rounds
    apart from the formula by more than 1e-3 (it was refused: Qwen3.5-MoE's 'on a probe its forward does not
    compute')."""
    model = BUILDERS[family]().to(dtype)
    record = compute_lrp(model, _data(), describe_model(model), bootstrap=0).signature["conservation"]
    assert record["n_sentences"] == 4 and record["n_outside"] == 0
    total = record["with_biases"]
    assert abs(total["min"] - 1) < 1e-12 and abs(total["max"] - 1) < 1e-12


def test_a_mixer_rule_that_does_not_conserve_fails_the_run(monkeypatch):
    """The mixer's plain backward (no activation rule, q, k, beta and g with a gradient) loses relevance in the
    Gated DeltaNet at layer 0. Before, LRP's input was cut at the first attention layer's input (layer 1): the
    relevance through layer 0 was never measured, and this run conserved to 1e-16."""
    recompute = gated_delta.recompute
    monkeypatch.setattr(gated_delta, "recompute", lambda module, kept, rule: recompute(module, kept, rule=False))
    model = BUILDERS["qwen3_next-hybrid"]()
    with torch.no_grad():  # a mixer that matters: its share of the logit well above the tolerance
        for parameter in _mixer(model).parameters():
            parameter.mul_(5)
    with pytest.raises(RunFailed, match="did not conserve relevance"):
        compute_lrp(model, _data(1), describe_model(model), bootstrap=0)


@pytest.mark.parametrize("strategy", ["jacobian", "loop"])
def test_every_strategy_gives_vmaps_shares(strategy):
    """vmap's batched backward passes through the recomputed recurrence (solve_triangular, the chunk loop) as the
    one-target-at-a-time strategies do."""
    from support.lrp_families import check_strategies_agree, lrp_data

    model = BUILDERS["qwen3_next-hybrid"]().to(torch.float64)
    check_strategies_agree(model, *lrp_data(model), strategy)


# -- the reference: the rule written out, its held-constant factors plain numbers ------------------------------------


def _projections(mixer, x):
    """``(v [b, t, value_dim] with a gradient, and constants: qkv pre-activation, z, b, a)``, laid out as each class's
    forward reads them (transformers 5.24), by hand."""
    name = type(mixer).__name__
    hk, hv, dk, dv = mixer.num_k_heads, mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim
    batch, seq, _ = x.shape
    if name == "Qwen3NextGatedDeltaNet":  # per key head [q | k | v (hv/hk heads) | z (hv/hk heads)]; [b | a] likewise
        r = hv // hk
        p = mixer.in_proj_qkvz(x).view(batch, seq, hk, 2 * dk + 2 * r * dv)
        q, k = p[..., :dk].reshape(batch, seq, -1), p[..., dk:2 * dk].reshape(batch, seq, -1)
        v = p[..., 2 * dk:2 * dk + r * dv].reshape(batch, seq, -1)
        z = p[..., 2 * dk + r * dv:].reshape(batch, seq, -1)
        ba = mixer.in_proj_ba(x).view(batch, seq, hk, 2 * r)
        b, a = ba[..., :r].reshape(batch, seq, hv), ba[..., r:].reshape(batch, seq, hv)
    elif name == "OlmoHybridGatedDeltaNet":
        q, k, v, z, b, a = (getattr(mixer, n)(x) for n in ("q_proj", "k_proj", "v_proj", "g_proj", "b_proj", "a_proj"))
    else:
        q, k, v = mixer.in_proj_qkv(x).split([mixer.key_dim, mixer.key_dim, mixer.value_dim], dim=-1)
        z, b, a = mixer.in_proj_z(x), mixer.in_proj_b(x), mixer.in_proj_a(x)
    return v, torch.cat([q, k, v], -1).detach(), z.detach(), b.detach(), a.detach()


def _reference(mixer, x):
    """The mixer's output as a linear map of ``x`` through its values: every factor held constant is computed once,
    without a gradient, from the forward's own values."""
    hk, hv, dk, dv = mixer.num_k_heads, mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim
    batch, seq, _ = x.shape
    v_in, qkv, z, b, a = _projections(mixer, x)
    weight = mixer.conv1d.weight  # [channels, 1, kernel]
    kernel = weight.shape[-1]

    def conv(h, w):  # causal depthwise convolution, per channel: sum_j w[c, j] h[t - (kernel - 1) + j]
        padded = F.pad(h, (0, 0, kernel - 1, 0))
        return sum(w[:, 0, j] * padded[:, j:j + seq] for j in range(kernel))

    with torch.no_grad():
        pre = conv(qkv, weight)
        post = F.silu(pre)
        q = post[..., :mixer.key_dim].reshape(batch, seq, hk, dk)
        k = post[..., mixer.key_dim:2 * mixer.key_dim].reshape(batch, seq, hk, dk)
        q, k = (h * torch.rsqrt((h * h).sum(-1, keepdim=True) + 1e-6) for h in (q, k))  # FLA's l2norm, its eps
        q = q * dk ** -0.5
        q, k = q.repeat_interleave(hv // hk, dim=2), k.repeat_interleave(hv // hk, dim=2)
        beta = b.sigmoid() * (2.0 if getattr(mixer, "allow_neg_eigval", False) else 1.0)
        g = -mixer.A_log.exp() * F.softplus(a + mixer.dt_bias)
        pre_v = pre[..., 2 * mixer.key_dim:]
        ratio = torch.where(pre_v != 0, F.silu(pre_v) / pre_v, torch.zeros_like(pre_v))
    v = (conv(v_in, weight[2 * mixer.key_dim:]) * ratio).reshape(batch, seq, hv, dv)
    state = x.new_zeros(batch, hv, dv, dk)  # S_t: [value, key]
    outputs = []
    for t in range(seq):
        kt, qt, bt = k[:, t], q[:, t], beta[:, t, :, None, None]
        decayed = state * g[:, t].exp()[:, :, None, None]
        # S_t = S_{t-1} exp(g_t) (I - beta k k^T) + beta v k^T
        state = decayed - bt * (decayed @ kt[..., None]) @ kt[:, :, None, :] + bt * v[:, t, :, :, None] @ kt[:, :, None, :]
        outputs.append((state @ qt[..., None])[..., 0])
    o = torch.stack(outputs, dim=1).reshape(-1, dv)
    norm = getattr(mixer, "o_norm", None) or mixer.norm
    with torch.no_grad():
        zz = z.reshape(-1, dv)
        factor = torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) * norm.weight * F.silu(zz)
    out = getattr(mixer, "o_proj", None) or mixer.out_proj
    return out((o * factor).reshape(batch, seq, -1))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_relevance_is_that_of_the_rule_written_out(family):
    model = BUILDERS[family]().to(torch.float64)
    check_mixer_rule_written_out(model, _mixer(model), _reference, rtol=0, atol=1e-10, forward_atol=1e-12,
                                 conserved=1e-12)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_forward_is_unchanged_under_the_rules(family):
    check_rules_leave_the_forward_unchanged(BUILDERS[family](), padded=True)


# -- refusals ---------------------------------------------------------------------------------------------------------


def _refused(model, match):
    check_lrp_refused_before_any_work(model, match)


def test_a_gated_delta_net_of_another_class_is_refused_before_any_work():
    model = BUILDERS["qwen3_5_text-hybrid"]()
    mixer = _mixer(model)
    mixer.__class__ = type("NewGatedDeltaNet", (type(mixer),), {})
    _refused(model, r"no rule for NewGatedDeltaNet \(model\.layers\.0\.linear_attn\): Gated DeltaNet .*: "
                    r"NewGatedDeltaNet is a Gated DeltaNet this rule was not written for")


def test_a_gated_delta_net_computing_something_else_is_refused_before_any_work():
    """Its class named as one the rule knows, its forward another (the output doubled): the probe finds it."""
    model = BUILDERS["olmo_hybrid"]()
    mixer = _mixer(model)
    base = type(mixer)
    mixer.__class__ = type(base.__name__, (base,), {"forward": lambda self, *a, **k: 2 * base.forward(self, *a, **k),
                                                    "__module__": base.__module__})
    _refused(model, r"no rule for OlmoHybridGatedDeltaNet \(model\.layers\.0\.linear_attn\): .*on a probe its "
                    r"forward does not compute")


@pytest.mark.parametrize(("groups", "bias", "why"), [
    (1, False, "its conv1d is not a depthwise convolution over the 48 query, key and value channels"),
    (48, True, "its conv1d has a bias, whose share of the relevance headlab would not measure")])
def test_a_convolution_laid_out_otherwise_is_refused_before_any_work(groups, bias, why):
    model = BUILDERS["qwen3_next-hybrid"]()
    mixer = _mixer(model)
    mixer.conv1d = torch.nn.Conv1d(mixer.conv_dim, mixer.conv_dim, mixer.conv_kernel_size, groups=groups, bias=bias,
                                   padding=mixer.conv_kernel_size - 1)
    _refused(model, r"Qwen3NextGatedDeltaNet \(model\.layers\.0\.linear_attn\): .*" + why)


def test_a_gated_norm_that_is_not_one_is_refused():
    """A norm whose output is not rmsnorm(o) * w * silu(z) (a forward hook changes it): refused before any work (the
    probe runs the mixer's forward, its norm's hooks too), and by the rule's own check when it runs."""
    model = BUILDERS["qwen3_5_text-hybrid"]()
    norm = _mixer(model).norm
    handle = norm.register_forward_hook(lambda module, args, output: output + 1)
    _refused(model, r"Qwen3_5GatedDeltaNet \(model\.layers\.0\.linear_attn\): .*on a probe its forward does not "
                    r"compute")
    handle.remove()
    rule = gated_delta.delta_rule(_mixer(model))
    o, z = torch.randn(6, 8), torch.randn(6, 8)
    rule.o, rule.z = o, z
    with pytest.raises(HeadlabError, match=r"Qwen3_5GatedDeltaNet: its norm is not rmsnorm\(o\) \* w \* silu\(z\)"):
        rule.after_norm(norm, (o, z), norm(o, z) + 1)


def test_a_state_cached_from_earlier_tokens_is_refused():
    """The rule recomputes o from a zero state: continuing a cached sequence, o is not that, and is refused."""
    model = BUILDERS["qwen3_next-hybrid"]()
    with torch.no_grad():
        cache = model(input_ids=torch.tensor([[5, 17, 33]]), use_cache=True).past_key_values
    with pytest.raises(HeadlabError, match="Qwen3NextGatedDeltaNet: the o .* is not the gated delta rule of its "
                                           "projections"), torch.enable_grad(), lrp_rules(model):
        model(input_ids=torch.tensor([[8, 61]]), cache=cache, use_cache=True)


@pytest.mark.parametrize("gate", ["silu", "sigmoid"])
def test_qwen4_exp_gated_delta_net_conserves(gate):
    """Qwen4-Exp's Gated DeltaNet (``Qwen4ExpTextGatedDeltaNet``: Qwen3.5's, its gated norm's activation silu or
    sigmoid, ``output_gate_type``), put as transformers builds it into a tiny Qwen3.5 in its mixer's place (Qwen4-Exp's
    hyper-connections have no LRP rule: importance/residual_streams.py). Before: refused, "a Gated DeltaNet this rule
    was not written for"."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if "qwen4_exp_text" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no qwen4_exp_text")
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextGatedDeltaNet

    model = BUILDERS["qwen3_5_text-hybrid"]().double()
    config = CONFIG_MAPPING["qwen4_exp_text"](
        vocab_size=99, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"], output_gate_type=gate)
    mixer = Qwen4ExpTextGatedDeltaNet(config, 0).double()
    mixer.load_state_dict(_mixer(model).state_dict())
    assert mixer.norm.activation == gate
    model.model.layers[0].linear_attn = mixer.eval()
    ids = torch.randint(3, 99, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():  # the sigmoid gate computes another output: the mixer in place is Qwen4-Exp's
        plain = model(input_ids=ids).logits
    assert gate == "silu" or not torch.allclose(plain, BUILDERS["qwen3_5_text-hybrid"]().double()(input_ids=ids).logits)
    record = compute_lrp(model, _data(), describe_model(model), bootstrap=0).signature["conservation"]
    assert record["n_sentences"] == 4 and record["n_outside"] == 0
    total = record["with_biases"]
    assert abs(total["min"] - 1) < 1e-12 and abs(total["max"] - 1) < 1e-12
