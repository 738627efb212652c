"""LRP through gated MLPs and experts that clamp their gate and up projections without GPT-OSS's alpha and ``+ 1``
(transformers 5.24): ``act(clamp(gate, max=l)) * clamp(up, -l, l)`` in HY-V4's and GLM-5-Next's experts (SiLU a function
call) and MLPs, DeepSeek-V4's MLPs and experts (its act_fn); ``clamp(act(gate), max=l) * clamp(up, -l, l)`` in
Step-3.7's. Those families are refused for other reasons today (hyper-connections, an output gate, compressed keys), so
each module is put, as transformers builds it, into a tiny Llama (dense) or Qwen3-MoE (experts) model, and its bound
set low enough that the clamps act on most neurons.

Before: the dense MLPs were ruled as ``act(gate x) * up x``, the product rule given up_proj's unclamped output, and
relevance was lost at the clamps (compute_lrp failed its conservation check, or worse, passed it where few neurons
were clamped); the experts were refused ("computes neither act_fn(gate) * up nor GPT-OSS's ...").
"""

from __future__ import annotations

import importlib

import pytest
import torch
import transformers as tf
from torch import nn

from headlab import HeadlabError
from headlab.importance.rules import check_rules, clamped_dense_mlps
from support.lrp_families import assert_conserved, check_rules_leave_the_forward_unchanged, lrp_data
from support.models import VOCAB

BOUND = 0.02  # the tiny models' projections are ~0.1: most neurons clamped
_SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=64, bos_token_id=0, eos_token_id=1,
              pad_token_id=2, hidden_act="silu", mlp_bias=False)
# model type -> (module, its class name); Step-3.7's MLP takes the layer index, its experts the bound
DENSE = {"glm5_next": "Glm5NextTextMLP", "deepseek_v4": "DeepseekV4MLP", "step3p7": "Step3p7MLP"}
EXPERTS = {"hy_v4": "HYV4Experts", "glm5_next": "Glm5NextTextExperts", "deepseek_v4": "DeepseekV4Experts",
           "step3p7": "Step3p7Experts"}
WHERE = {"glm5_next": "gate", "deepseek_v4": "gate", "step3p7": "act", "hy_v4": "gate"}


def _class(model_type: str, name: str) -> type:
    try:
        module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    except ImportError:
        pytest.skip(f"this transformers has no {model_type}")
    if not hasattr(module, name):
        pytest.skip(f"this transformers has no {name}")
    return getattr(module, name)


def _module_config(**values):
    """The fields the clamped modules read (a plain config: each family's own would validate its other fields)."""
    return tf.PreTrainedConfig(**{**_SIZES, "swiglu_limit": BOUND, "swiglu_limits_shared": [BOUND] * 2,
                                  "moe_intermediate_size": 16, "num_local_experts": 4, "n_routed_experts": 4,
                                  **values})


def _spread(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                parameter.uniform_(0.5, 1.5)
            elif name.endswith(("gate_up_proj", "experts.down_proj")):  # transformers leaves them uninitialised
                parameter.normal_(0, 0.1)
    return model.eval().to(dtype)


def dense_model(model_type: str, dtype: torch.dtype = torch.float64) -> nn.Module:
    """A tiny Llama whose MLPs are ``model_type``'s clamped MLP class."""
    cls = _class(model_type, DENSE[model_type])
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**{k: v for k, v in _SIZES.items() if k != "mlp_bias"}))
    for index, layer in enumerate(model.model.layers):
        layer.mlp = cls(_module_config(), index) if model_type == "step3p7" else cls(_module_config())
    return _spread(model, dtype)


def experts_model(model_type: str, dtype: torch.dtype = torch.float64) -> nn.Module:
    """A tiny Qwen3-MoE whose experts are ``model_type``'s clamped experts class (the same [experts, 2 x inner,
    hidden] and [experts, hidden, inner] weights, called as experts(hidden, top_k_index, top_k_weights))."""
    cls = _class(model_type, EXPERTS[model_type])
    torch.manual_seed(0)
    config = tf.Qwen3MoeConfig(**{k: v for k, v in _SIZES.items() if k not in ("mlp_bias", "intermediate_size")},
                               intermediate_size=40, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                               decoder_sparse_step=1)
    config._experts_implementation = "eager"
    model = tf.Qwen3MoeForCausalLM(config)
    for layer in model.model.layers:
        experts = cls(_module_config(intermediate_size=16), swiglu_limit=BOUND) if model_type == "step3p7" \
            else cls(_module_config(intermediate_size=16) if model_type == "deepseek_v4" else _module_config())
        assert experts.gate_up_proj.shape == layer.mlp.experts.gate_up_proj.shape
        layer.mlp.experts = experts
    return _spread(model, dtype)


def _clamped_share(model: nn.Module) -> float:
    """The share of the first layer's gate neurons beyond the bound on lrp_data's sentences (the clamps act)."""
    seen: list[torch.Tensor] = []
    layer = model.model.layers[0].mlp
    target = layer.gate_proj if hasattr(layer, "gate_proj") else None
    if target is None:
        return 1.0  # experts: checked through conservation alone
    handle = target.register_forward_hook(lambda module, args, output: seen.append(output.detach()))
    data, _ = lrp_data(model)
    with torch.no_grad():
        model(input_ids=torch.tensor([data.sources[0]]))
    handle.remove()
    return float((seen[0] > BOUND).double().mean())


@pytest.mark.parametrize("model_type", sorted(DENSE))
def test_dense_clamped_mlps_conserve_relevance(model_type):
    model = dense_model(model_type)
    assert [where for *_, bound, where in clamped_dense_mlps(model)] == [WHERE[model_type]] * 2
    assert _clamped_share(model) > 0.2  # the clamps act
    check_rules_leave_the_forward_unchanged(model)
    assert_conserved(model, 1e-10)


@pytest.mark.parametrize("model_type", sorted(EXPERTS))
def test_clamped_experts_conserve_relevance(model_type):
    model = experts_model(model_type)
    check_rules_leave_the_forward_unchanged(model)
    assert_conserved(model, 1e-10)


@pytest.mark.parametrize("model_type", ["glm5_next", "hy_v4"])
def test_clamped_float32_models_conserve(model_type):
    """In float32 (compute_lrp widens a model with gated MLPs or experts to float64: lrp_precision)."""
    model = dense_model(model_type, torch.float32) if model_type in DENSE else experts_model(model_type, torch.float32)
    assert_conserved(model, 1e-6)


def test_an_unbounded_step3p7_mlp_takes_the_plain_rule():
    """Step-3.7's unclamped layers (``limit = inf``): no clamp rule, the plain product rule, conserved."""
    model = dense_model("step3p7")
    for layer in model.model.layers:
        layer.mlp.limit = float("inf")
    assert clamped_dense_mlps(model) == []
    assert_conserved(model, 1e-10)


def test_a_clamped_mlp_of_another_formula_is_refused_before_any_work():
    """A bound and a forward that clamps otherwise (the gate to [-l, l] before the activation): none of the rules."""
    base = _class("glm5_next", "Glm5NextTextMLP")

    class SymmetricClamp(base):  # type: ignore[misc, valid-type]
        def forward(self, x):
            gate = self.gate_proj(x).clamp(min=-self.swiglu_limit, max=self.swiglu_limit)
            return self.down_proj(self.act_fn(gate) * self.up_proj(x).clamp(-self.swiglu_limit, self.swiglu_limit))

    model = dense_model("glm5_next")
    for layer in model.model.layers:
        mlp = SymmetricClamp(_module_config())
        mlp.load_state_dict(layer.mlp.state_dict())
        layer.mlp = mlp.double()
    with pytest.raises(HeadlabError, match=r"a gated MLP with a clamp bound \(0.02\) whose forward computes neither"):
        check_rules(model)
