"""Under ``lrp_rules`` a clamp passes the gradient at its bounds, on every torch (``rules._ClosedClamps``).

torch 2.14 changed the gradient of ``clamp``, ``clip``, ``clamp_min`` and ``clamp_max`` at their bounds from 1 to 0
(the minimum-norm subgradient; pytorch issue #195931; 2.15 keeps it). headlab's identity rule clamps a projection's
output onto the bounds before the model's own clamp (DBRX's and MPT's ``clip_qkv``, OLMo's in place, the gated MLPs'
``swiglu_limit``), which then dropped every clipped value's relevance: on torch 2.15.0 relevance was not conserved
(``test_lrp_passes_relevance_through_clip_qkv[olmo]``: 2.4605 logit, -13.47 relevance) in the 6 clip_qkv tests of
test_fused_codegen_persimmon_dbrx.py. These tests fail on torch 2.14.1 and 2.15.0 before the fix (gradient 0 at the
bounds) and pass on 2.13, where torch's own clamp is the closed one.
"""

from __future__ import annotations

import pytest
import torch

from headlab.importance.rules import lrp_rules
from support.models import tiny_model

VALUES = [-2.0, -1.0, -0.5, 0.0, 1.0, 2.0]  # two on the bounds -1 and 1
CALLS = {
    "Tensor.clamp": lambda x: x.clamp(-1.0, 1.0),
    "torch.clamp by name": lambda x: torch.clamp(x, min=-1.0, max=1.0),
    "torch.clip": lambda x: torch.clip(x, -1.0, 1.0),
    "Tensor.clamp_ (OLMo's)": lambda x: (x * 1).clamp_(min=-1.0, max=1.0),
    "Tensor.clip_": lambda x: (x * 1).clip_(-1.0, 1.0),
    "clamp_min then clamp_max": lambda x: torch.clamp_max(x.clamp_min(-1.0), 1.0),
    "clamp_min_ then clamp_max_": lambda x: (x * 1).clamp_min_(-1.0).clamp_max_(1.0),
    "max only": lambda x: x.clamp(max=1.0).clamp(min=-1.0),
}


def _value_and_gradient(call) -> tuple[list[float], list[float]]:
    x = torch.tensor(VALUES, dtype=torch.float64, requires_grad=True)
    y = call(x)
    y.sum().backward()
    assert x.grad is not None
    return y.tolist(), x.grad.tolist()


@pytest.mark.parametrize("call", CALLS.values(), ids=CALLS.keys())
def test_a_clamp_passes_the_gradient_at_its_bounds_under_the_rules(call):
    with lrp_rules(tiny_model("llama")):
        value, gradient = _value_and_gradient(call)
    assert value == [-1.0, -1.0, -0.5, 0.0, 1.0, 1.0]
    assert gradient == [0.0, 1.0, 1.0, 1.0, 1.0, 0.0]


def test_the_rules_leave_clamps_as_torch_has_them_outside_and_on_tensor_bounds():
    """Outside the rules, and for a clamp with tensor bounds inside, the gradient is torch's own (whichever)."""
    low, high = torch.tensor(-1.0, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64)
    own = _value_and_gradient(CALLS["Tensor.clamp"])
    own_tensor = _value_and_gradient(lambda x: x.clamp(low, high))
    with lrp_rules(tiny_model("llama")):
        assert _value_and_gradient(lambda x: x.clamp(low, high)) == own_tensor
    assert _value_and_gradient(CALLS["Tensor.clamp"]) == own


def test_an_in_place_clamp_under_the_rules_changes_its_tensor():
    """OLMo ignores what ``clamp_`` returns: the clamped values must be the tensor's own."""
    with lrp_rules(tiny_model("llama")):
        x = torch.tensor(VALUES, dtype=torch.float64, requires_grad=True)
        y = x * 2
        returned = y.clamp_(-1.0, 1.0)
    assert returned is y and y.tolist() == [-1.0, -1.0, -1.0, 0.0, 1.0, 1.0]
