"""LRP through the Mamba and Mamba-2 mixers of hybrid models (importance/mixer_rules/mamba.py; refused until session
35 as "a state-space (or linear recurrent) token mixer"): MambaLRP's rule (Jafari et al. 2024), the selective SSM's
decay and input/output matrices held constant, the gate held constant, the norm's scale detached.

On tiny hybrids (tests/support/mamba_hybrids.py: a mixer layer after an attention layer, or before it, every
parameter a rule could drop drawn at random): relevance is conserved (float32 and float64 runs), the forward is bit
for bit unchanged, the relevance of a mixer's input is that of an independent float64 re-implementation of the
recurrence whose held-constant factors are plain constants, and a mixer that computes something else, or a class of
that layout the rule was not checked against, is refused before any work, naming it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers as tf

from headlab import HeadlabError, attention_blocks
from headlab.importance import ImportanceData, compute_lrp, describe_model, lrp_rules
from headlab.importance.lrp import _KeptWide
from support.family_matrix import tiny_inputs
from support.mamba_hybrids import MAMBA, mamba_model, mixer

CONSERVING = [name for name in MAMBA if not name.endswith("-mamba-first")]


def _data(model, n=4, seed=0):
    info = describe_model(model)
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 9, (n,), generator=g).tolist()
    return ImportanceData.from_ids([torch.randint(3, 99, (k,), generator=g).tolist() + [1] for k in lengths]), info


@pytest.mark.parametrize("name", CONSERVING)
def test_lrp_conserves_relevance(name):
    """Embeddings plus the biases' shares (the convolution's bias among them) are the explained logit, per sentence,
    in a float32 run (the model's own dtype) and to float64 rounding in a float64 one. Before: refused."""
    for dtype, tolerance in ((torch.float32, 1e-6), (torch.float64, 5e-14)):
        model = mamba_model(name, dtype=dtype)
        data, info = _data(model)
        record = compute_lrp(model, data, info, bootstrap=0).signature["conservation"]
        assert record["n_sentences"] == 4 and record["n_outside"] == 0, record
        total = record["with_biases"]
        assert abs(total["min"] - 1) < tolerance and abs(total["max"] - 1) < tolerance, (dtype, total)


@pytest.mark.parametrize("name", ["jamba-mamba-first", "bamba-mamba-first"])
def test_a_mixer_before_the_first_attention_layer_is_crossed_too(name):
    """With the mixer first, conservation is measured at the first layer's input, the embeddings, not at the first
    attention layer's (before: there, and the mixer's relevance was never checked; Zamba's hybrid layers, which read
    the embeddings beside the residual stream, lost that share: 1.14 of the logit)."""
    model = mamba_model(name, dtype=torch.float64)
    data, info = _data(model)
    total = compute_lrp(model, data, info, bootstrap=0).signature["conservation"]["with_biases"]
    assert abs(total["min"] - 1) < 5e-14 and abs(total["max"] - 1) < 5e-14, total


@pytest.mark.parametrize("name", ["jamba", "zamba", "bamba", "falcon_h1", "falcon_h1-gate-after-norm"])
def test_the_forward_is_unchanged(name):
    model = mamba_model(name)
    inputs = tiny_inputs()  # the second sequence padded: the mixers' masks
    with torch.no_grad():
        before = model(**inputs).logits
    with torch.enable_grad(), lrp_rules(model):
        during = model(**inputs).logits
    assert torch.equal(before, during)


# -- the independent references -----------------------------------------------------------------------------------
def _causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Depthwise causal convolution of ``x`` [b, T, c] written out: out_t = sum_k w_k x_{t - K + 1 + k} + bias."""
    kernel = weight.shape[-1]
    out = torch.zeros_like(x) if bias is None else bias.expand_as(x).clone()
    for k in range(kernel):
        shift = kernel - 1 - k
        shifted = F.pad(x, (0, 0, shift, 0))[:, : x.shape[1]]
        out = out + shifted * weight[:, 0, k]
    return out


def _silu_rule(x: torch.Tensor) -> torch.Tensor:
    return x * (F.silu(x) / x).detach()


def _bamba_reference(m, h: torch.Tensor) -> torch.Tensor:
    """BambaMixer with dt, B, C, z, the decays and the norm's scale as constants; the recurrence step by step."""
    inner, heads, groups, n = m.intermediate_size, m.num_heads, m.n_groups, m.ssm_state_size
    width, conv_dim = inner // heads, m.conv_dim
    projected = h @ m.in_proj.weight.T + m.in_proj.bias
    xbc = _causal_conv(projected[..., inner:inner + conv_dim], m.conv1d.weight, m.conv1d.bias)
    with torch.no_grad():  # the constants, once
        z = projected[..., :inner]
        silu_xbc = F.silu(xbc)
        B = silu_xbc[..., inner:inner + groups * n].reshape(*h.shape[:2], groups, n)
        C = silu_xbc[..., inner + groups * n:].reshape(*h.shape[:2], groups, n)
        dt = F.softplus(projected[..., inner + conv_dim:] + m.dt_bias)  # [b, T, heads]
        A = -torch.exp(m.A_log)
        gate = F.silu(z)
    x = _silu_rule(xbc)[..., :inner].reshape(*h.shape[:2], heads, width)
    state = h.new_zeros(h.shape[0], heads, width, n)
    ys = []
    group = torch.arange(heads) // (heads // groups)
    for t in range(h.shape[1]):
        decay = torch.exp(dt[:, t] * A)[:, :, None, None]
        state = decay * state + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, group][:, :, None, :]
        ys.append((state * C[:, t, group][:, :, None, :]).sum(-1) + m.D[:, None] * x[:, t])
    v = torch.stack(ys, dim=1).reshape(*h.shape[:2], inner) * gate
    grouped = v.reshape(*h.shape[:2], groups, -1)
    scale = (torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + m.norm.variance_epsilon)
             * m.norm.weight.reshape(groups, -1)).detach()
    return (grouped * scale).reshape(v.shape) @ m.out_proj.weight.T + m.out_proj.bias


def _jamba_reference(m, h: torch.Tensor) -> torch.Tensor:
    """JambaMambaMixer with dt, B, C (after their norms), z and the decays as constants; the recurrence step by
    step, one channel state of size n per channel."""
    inner, n, rank = m.intermediate_size, m.ssm_state_size, m.time_step_rank
    projected = h @ m.in_proj.weight.T + m.in_proj.bias
    conv = _causal_conv(projected[..., :inner], m.conv1d.weight, m.conv1d.bias)
    x = _silu_rule(conv)  # [b, T, inner]

    def rms(v, norm):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) * norm.weight

    with torch.no_grad():
        params = F.silu(conv) @ m.x_proj.weight.T
        step, B, C = params[..., :rank], params[..., rank:rank + n], params[..., rank + n:]
        step, B, C = rms(step, m.dt_layernorm), rms(B, m.b_layernorm), rms(C, m.c_layernorm)
        dt = F.softplus(step @ m.dt_proj.weight.T + m.dt_proj.bias)  # [b, T, inner]
        A = -torch.exp(m.A_log)  # [inner, n]
        gate = F.silu(projected[..., inner:])
    state = h.new_zeros(h.shape[0], inner, n)
    ys = []
    for t in range(h.shape[1]):
        state = torch.exp(dt[:, t, :, None] * A) * state + (dt[:, t] * x[:, t])[..., None] * B[:, t, None, :]
        ys.append((state * C[:, t, None, :]).sum(-1) + m.D * x[:, t])
    return (torch.stack(ys, dim=1) * gate) @ m.out_proj.weight.T + m.out_proj.bias


@pytest.mark.parametrize("name, reference", [("bamba", _bamba_reference), ("jamba", _jamba_reference)])
def test_the_relevance_is_that_of_the_recurrence_with_its_factors_constant(name, reference):
    """In float64, the relevance of the mixer's input under lrp_rules (x * grad, the mixer called inside the
    model's rules) equals x * grad of the reference, to 1e-10; the reference's output is the mixer's."""
    model = mamba_model(name, dtype=torch.float64)
    m = mixer(model, name)
    with torch.no_grad():  # at unit gain, so that the relevance compared is of the order of one
        for module in m.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0, module.in_features ** -0.5)
    g = torch.Generator().manual_seed(5)
    # 11 positions: three of Mamba-2's chunks of 4 (its chunk_size), the last one padded
    h = torch.randn(2, 11, 32, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 11, 32, generator=g, dtype=torch.float64)
    with torch.enable_grad(), lrp_rules(model), _KeptWide(torch.float64):
        out = m(h)
        (grad,) = torch.autograd.grad((out * w).sum(), h)
    with torch.enable_grad():
        expected = reference(m, h)
        (expected_grad,) = torch.autograd.grad((expected * w).sum(), h)
    torch.testing.assert_close(expected.detach(), out.detach(), rtol=0, atol=1e-10)
    torch.testing.assert_close(h.detach() * grad, h.detach() * expected_grad, rtol=0, atol=1e-10)
    assert (h.detach() * grad).abs().max() > 1e-2  # relevance there to compare


# -- refusals -----------------------------------------------------------------------------------------------------
def _refused_before_any_work(model, message: str) -> None:
    attention_blocks(model)  # discovery's probe pass (once, cached): not the measure's work
    calls: list = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    data, info = _data(model)
    with pytest.raises(HeadlabError, match=message):
        compute_lrp(model, data, info, bootstrap=0)
    assert not calls


@pytest.mark.parametrize("name, where, rule", [
    ("bamba", r"BambaMixer \(model.layers.1.mamba\): Mamba-2 selective SSM", "Mamba-2"),
    ("jamba", r"JambaMambaMixer \(model.layers.1.mamba\): Mamba selective SSM", "Mamba"),
])
def test_a_mixer_whose_forward_computes_something_else_is_refused(name, where, rule, monkeypatch):
    model = mamba_model(name)
    cls = type(mixer(model, name))
    original = cls.forward
    monkeypatch.setattr(cls, "forward", lambda self, *args, **kwargs: 1.5 * original(self, *args, **kwargs))
    _refused_before_any_work(model, where + r".*differs from the rule's recomputation")


def test_a_mixer_of_that_layout_the_rule_does_not_know_is_refused():
    model = mamba_model("bamba")
    m = mixer(model, "bamba")
    m.__class__ = type("OtherMamba2Mixer", (type(m),), {})
    _refused_before_any_work(model, r"OtherMamba2Mixer \(model.layers.1.mamba\): .*laid out as one of these mixers, "
                                    r"but its forward is none the rule was checked against")


def test_zamba2s_mlp_adapters_are_weighted_sums_beside_gate_up_proj():
    """Zamba 2's shared MLP adds a LoRA adapter's output to gate_up_proj's before the gated product: the product rule
    takes their sum as its factor (before: no rule for the product, 1.2e-5 of the logit lost, within the check's
    tolerance, so the run passed; refused for its mixer then), and the run computes in float64 for it."""
    from headlab.importance.lrp import lrp_precision

    model = mamba_model("zamba2")
    assert lrp_precision(model) == torch.float64
    data, info = _data(model)
    total = compute_lrp(model, data, info, bootstrap=0).signature["conservation"]["with_biases"]
    assert abs(total["min"] - 1) < 5e-14 and abs(total["max"] - 1) < 5e-14, total


def test_granites_shared_mlp_is_a_fused_gated_mlp():
    """The Granite MoE families' shared MLP, output_linear(act(h0) * h1) with h = input_linear(x).chunk(2), gets the
    fused gated rule (before: no product rule, 2% of the logit not conserved on the hybrid, refused for its mixer
    then; the run failed on Granite-MoE-shared with a shared MLP)."""
    model = tf.GraniteMoeSharedForCausalLM(tf.GraniteMoeSharedConfig(
        vocab_size=99, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=1, pad_token_id=2,
        num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=40)).eval()
    data, info = _data(model)
    total = compute_lrp(model, data, info, bootstrap=0).signature["conservation"]["with_biases"]
    assert abs(total["min"] - 1) < 1e-6 and abs(total["max"] - 1) < 1e-6, total


@pytest.mark.parametrize("name", ["jamba", "bamba"])
def test_a_bfloat16_hybrid_is_explained(name):
    """Released hybrids are bfloat16: the probe runs the mixer widened to float32 (as LRP computes it; before, a
    float32 probe input met bfloat16 weights and the mixer was refused), and the run conserves."""
    model = mamba_model(name, dtype=torch.bfloat16)
    data, info = _data(model)
    total = compute_lrp(model, data, info, bootstrap=0).signature["conservation"]["with_biases"]
    assert abs(total["min"] - 1) < 1e-6 and abs(total["max"] - 1) < 1e-6, total
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())  # put back as it was


@pytest.mark.parametrize("strategy", ["jacobian", "loop"])
@pytest.mark.parametrize("name", ["jamba", "bamba"])
def test_every_strategy_gives_the_same_shares(name, strategy):
    """vmap's batched backward passes through the recomputed scan (the Mamba step loop, the Mamba-2 weight matrix) as
    the jacobian and loop strategies do: the same shares."""
    from support.lrp_families import check_strategies_agree, lrp_data

    model = mamba_model(name, dtype=torch.float64)
    check_strategies_agree(model, *lrp_data(model, n=2), strategy)


# -- the chunked scan ---------------------------------------------------------------------------------------------
def _whole_matrix_scan(x, dt, A, B, C, D):
    """Mamba-2's scan as its one constant matrix ``M[b, h, t, s] = (C_t . B_s) exp(sum_{s<r<=t} dt_r A) dt_s``."""
    T = x.shape[1]
    cum = torch.cumsum(dt * A, dim=1).permute(0, 2, 1)  # [b, h, T]
    exponent = (cum[..., :, None] - cum[..., None, :]).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -torch.inf)
    weights = torch.einsum("bthn,bshn->bhts", C, B) * torch.exp(exponent) * dt.permute(0, 2, 1)[:, :, None, :]
    return torch.einsum("bhts,bshp->bthp", weights, x) + x * D[:, None]


@pytest.mark.parametrize("length", [1, 63, 64, 65, 150])
def test_the_chunked_scan_is_the_whole_matrix_and_keeps_no_t_by_t_weights(length):
    """_mamba2_scan by chunks of 64 equals the scan as one [T, T] matrix per head (output and x * grad, float64, to
    1e-12), and what autograd keeps for the backward pass is at most [b, h, T, 64] (a text shorter than a chunk is one
    chunk of its length, not padded to 64): fewer than T x T entries per head beyond two chunks."""
    from headlab.importance.mixer_rules.mamba import _mamba2_scan

    g = torch.Generator().manual_seed(length)
    b, h, p, n = 2, 3, 4, 5
    x = torch.randn(b, length, h, p, generator=g, dtype=torch.float64, requires_grad=True)
    dt = torch.rand(b, length, h, generator=g, dtype=torch.float64) * 0.3
    A, D = -torch.rand(h, generator=g, dtype=torch.float64) * 2, torch.randn(h, generator=g, dtype=torch.float64)
    B, C = (torch.randn(b, length, h, n, generator=g, dtype=torch.float64) for _ in range(2))
    w = torch.randn(b, length, h, p, generator=g, dtype=torch.float64)
    sizes: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
        y = _mamba2_scan(x, dt, A, B, C, D)
    (grad,) = torch.autograd.grad((y * w).sum(), x)
    expected = _whole_matrix_scan(x, dt, A, B, C, D)
    (expected_grad,) = torch.autograd.grad((expected * w).sum(), x)
    torch.testing.assert_close(y, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(x.detach() * grad, x.detach() * expected_grad, rtol=0, atol=1e-12)
    padded = -(-length // 64) * 64
    assert max(sizes) <= b * h * min(length, 64) * max(padded if length > 64 else length, n)
    if length > 128:
        assert max(sizes) < b * h * length * length
