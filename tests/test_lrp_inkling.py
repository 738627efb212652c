"""LRP on Inkling (``InklingForCausalLM``, session 36; before, refused for its shared experts and its normed
embedding): the shared experts' gammas, the routed experts' weights and the relative-position logits held constant,
the short convolutions linear (headlab.importance.mixer_rules.inkling). Tiny models from tests/support/lrp_families.py's
config (a sliding layer with experts, a full one with log scaling and a dense MLP, a sliding one with experts)."""

import pytest
import torch
from torch.nn import functional as F

from headlab.errors import HeadlabError
from headlab.importance import compute_lrp, lrp_rules
from headlab.importance.lrp import _KeptWide
from headlab.importance.rules import check_rules
from support.lrp_families import (
    assert_conserved,
    check_lrp_refused_before_any_work,
    check_rules_leave_the_forward_unchanged,
    lrp_data,
    tiny_lrp_model,
)

SHARED = "model.layers.0.mlp.shared_experts"


def _inkling(dtype=torch.float32):
    model = tiny_lrp_model("inkling", dtype=dtype)
    model.config._attn_implementation = "eager"
    with torch.no_grad():  # off transformers' std 0.02, so that the experts' products and the score biases count
        for name, parameter in model.named_parameters():
            if parameter.dim() >= 2 and "norm" not in name:
                parameter.normal_(0, 0.3)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_inkling_conserves_to_float64_rounding_from_layer_zero(dtype):
    """compute_lrp computes Inkling in float64 (its experts' product rule) and the record holds the whole logit at the
    first layer's input (layer 0: the normed embedding before it needs no rule), to float64 rounding."""
    from headlab.adapters import attention_blocks
    from headlab.importance.lrp import _cut_path, _stack_start

    model = _inkling(dtype)
    first = attention_blocks(model)[0]
    assert _stack_start(dict(model.named_modules()), _cut_path(first)) == "model.layers.0"
    record = assert_conserved(model, 1e-12)
    assert record["embeddings"]["min"] != record["embeddings"]["max"]
    data, info = lrp_data(model)
    assert compute_lrp(model, data, info, bootstrap=0).signature["precision"].startswith("float64")


def test_the_rules_leave_inklings_forward_unchanged():
    """In float64, where compute_lrp runs Inkling (lrp_precision: its experts' product rule, whose float32 surrogate
    rounds apart from the experts' own output where a + b crosses zero, as Mixtral's does)."""
    model = _inkling(torch.float64)
    model.config._experts_implementation = "eager"  # transformers' grouped matmul takes no float64 (lrp_rules' too)
    check_rules_leave_the_forward_unchanged(model)


def _reference_shared(module, x, gammas):
    """Inkling's shared experts written apart from headlab's code, in float64, with the factors LRP holds constant
    computed once under no_grad as plain numbers: the gammas; SiLU's ratio silu(g) / g (the activation rule); the
    product's weight a b / (a + b), so that (a + b) * c sends a / (a + b) of R(a b) to a (Ding et al.'s product rule)."""
    out = 0
    for e in range(module.gate_proj.shape[0]):
        g, u = x @ module.gate_proj[e].T, x @ module.up_proj[e].T
        with torch.no_grad():
            ratio = F.silu(g) / g
            a, b = F.silu(g), u
            weight = a * b / (a + b)
            gamma = gammas[..., e:e + 1].clone()
        out = out + (((g * ratio + u) * weight) * gamma) @ module.down_proj[e].T
    return out


def test_the_shared_experts_relevance_is_x_times_the_gradient_of_the_reference_with_its_factors_constant():
    """The relevance of the shared experts' input under lrp_rules equals x * grad of the reference, to 1e-10: the rule
    is the stated rule (gammas constant, activation and product rules), not merely something that conserves."""
    model = _inkling(torch.float64)
    module = model.get_submodule(SHARED)
    g = torch.Generator().manual_seed(3)
    x = torch.randn((2, 5, 32), generator=g, dtype=torch.float64, requires_grad=True)
    gammas = torch.rand((2, 5, 2), generator=g, dtype=torch.float64, requires_grad=True)  # as the router's: a graph
    r = torch.randn((2, 5, 32), generator=g, dtype=torch.float64)
    with torch.enable_grad(), lrp_rules(model), _KeptWide(torch.float64):  # its float32 sum widened, as compute_lrp does
        out = module(x, gammas=gammas * 1.0)
        (grad,) = torch.autograd.grad((out * r).sum(), x)
    x_ref = x.detach().clone().requires_grad_(True)
    reference = _reference_shared(module, x_ref, gammas.detach())
    torch.testing.assert_close(out.detach(), reference.detach(), rtol=1e-12, atol=1e-12)
    (want,) = torch.autograd.grad((reference * r).sum(), x_ref)
    torch.testing.assert_close(x.detach() * grad, x_ref.detach() * want, rtol=0, atol=1e-10)
    # conserved through the module: all of it reaches x, none the gammas
    assert abs(float((x.detach() * grad).sum()) - float((out * r).sum().detach())) < 1e-10


def test_shared_experts_laid_out_otherwise_are_refused_before_any_work():
    """down_proj stored [experts, inner, hidden] (transposed): the rule's layout does not fit, refused naming it."""
    model = _inkling()
    module = model.get_submodule(SHARED)
    module.down_proj = torch.nn.Parameter(module.down_proj.detach().transpose(1, 2).contiguous())
    with pytest.raises(HeadlabError, match=r"InklingSharedExperts \(model.layers.0.mlp.shared_experts\): headlab's "
                                           r"rule for shared experts is for gate_proj and up_proj"):
        check_rules(model)


def test_shared_experts_that_compute_something_else_are_refused_before_any_work():
    """A shared-experts class whose forward is not sum_e gammas_e down_e(act(gate_e x) * up_e x) (its gammas squared):
    refused before any work by the probe, naming the module."""
    model = _inkling()
    module = model.get_submodule(SHARED)
    original = type(module)

    class Squared(original):  # type: ignore[misc, valid-type]
        def forward(self, hidden_states, gammas):
            return original.forward(self, hidden_states, gammas * gammas)

    module.__class__ = Squared
    check_lrp_refused_before_any_work(model, r"Squared \(model.layers.0.mlp.shared_experts\): its forward does not "
                                             r"compute sum_e gammas_e")


def test_a_short_convolution_with_a_bias_is_refused_before_any_work():
    """A bias inside causal_conv1d_fn keeps relevance no probe can count: refused, naming the module."""
    model = _inkling()
    conv = model.model.layers[1].mlp_sconv.conv1d
    conv.bias = torch.nn.Parameter(torch.ones(conv.out_channels))
    check_lrp_refused_before_any_work(model, r"InklingShortConvolution \(model.layers.1.mlp_sconv\): Inkling's "
                                             r"residual short convolution: its convolution has a bias")


def test_a_short_convolution_computing_something_else_is_refused_before_any_work():
    model = _inkling()
    module = model.model.layers[0].attn_sconv
    original = type(module)

    class Doubled(original):  # type: ignore[misc, valid-type]
        def forward(self, hidden_states, cache=None, conv_mask=None, **kwargs):
            return 2 * original.forward(self, hidden_states, cache=cache, conv_mask=conv_mask)

    module.__class__ = Doubled
    check_lrp_refused_before_any_work(model, r"Doubled \(model.layers.0.attn_sconv\): .*on a probe its forward is not "
                                             r"u \+ conv\(u\)")


def test_an_attention_gated_by_its_relative_states_is_refused_before_any_work():
    """An Inkling attention whose output is also scaled by a function of r_proj's output (a factor the rule does not
    hold constant): the probe of its backward under the rule's hooks does not conserve, refused naming the layer."""
    model = _inkling()
    attention = model.model.layers[2].self_attn
    original = type(attention)

    class Gated(original):  # type: ignore[misc, valid-type]
        def forward(self, hidden_states, attention_mask, conv_mask=None, cache=None, **kwargs):
            out, weights = original.forward(self, hidden_states, attention_mask, conv_mask, cache, **kwargs)
            return out * torch.sigmoid(self.r_proj(hidden_states).mean(-1, keepdim=True)), weights

    attention.__class__ = Gated
    check_lrp_refused_before_any_work(model, r"attention of model.layers.2.self_attn .*its backward does not "
                                             r"conserve")


def test_without_the_score_bias_held_constant_inkling_does_not_conserve(monkeypatch):
    """Why rel_logits_proj's output is detached: with its hook and the attention's probe stubbed out, relevance leaks
    through the softmax into r_proj and compute_lrp fails its conservation check (4 of 4 sentences)."""
    from headlab.errors import RunFailed
    from headlab.importance.mixer_rules import inkling as inkling_rule

    monkeypatch.setattr(inkling_rule, "score_bias_hooks", lambda core: [])
    monkeypatch.setattr(inkling_rule, "attention_problem", lambda block, hooks: None)
    model = _inkling()
    with pytest.raises(RunFailed, match="in 4 of 4 sentences"):
        compute_lrp(model, *lrp_data(model), bootstrap=0)
