"""LRP through multi-head latent attention (session 28, task lrpmla28).

transformers' MLA (``DeepseekV3Attention.forward``, transformers 5.24): queries from ``q_b_proj`` (or ``q_proj``),
``kv_a_proj_with_mqa`` emits ``[latent | rotary key]``, the latent goes through ``kv_a_layernorm`` to ``kv_b_proj``,
viewed per head ``[k_nope | v]``. The rule (importance/rules.py, ``_latent_attention_hooks``) holds the attention
weights constant by detaching the query projection, the rotary columns of ``kv_a_proj_with_mqa`` and the ``k_nope``
columns of ``kv_b_proj``, as it detaches the query and key projections of other attention (Voita et al. 2019, App. A:
the attention weights are weights of a weighted sum); relevance reaches the layer's input through the values.

Before, LRP was refused on every latent-attention type ("no rule for the attention of model.layers.0.self_attn ...
multi-head latent attention"). Here, on the tiny models of tests/test_mla_pruning.py (MoE layers included: their
fused experts have a rule), bias-free in float64: every layer's input holds the whole logit; the rules' backward through
one attention layer equals a reference written here from the modeling code with the probabilities held constant; the
heads' scores are the relevance at their slices of o_proj's input; compute_lrp conserves with biases. A.X-K2's gated
norm (session 29; before, refused) holds its gate constant; LongCat-Flash (two attentions per layer, identity
experts): tests/test_longcat_flash.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from headlab import HeadlabError
from headlab.capture import eager_attention
from headlab.data.inputs import ImportanceData, make_batches
from headlab.importance import compute_lrp, describe_model
from headlab.importance.lrp import _KeptWide, head_relevance
from headlab.importance.rules import check_rules, lrp_rules
from test_mla_pruning import FAMILIES, _layers, mistral_large4, tiny_model

EXPLAINED = FAMILIES  # A.X-K2 with its gated norm (before: refused for it)
IDS = torch.tensor([[5, 17, 33, 8, 61, 4, 9, 12]])


def _bias_free(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` in float64 with its biases zero (a bias keeps a share of its own: Voita et al. 2019, App. A.2)."""
    model = model.double()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias") and "softmax_scaling" not in name:  # Mistral Large 4's scales the queries
                parameter.zero_()
    return model


@pytest.mark.parametrize("family", EXPLAINED)
def test_every_layer_holds_the_whole_logit(family):
    """Bias-free in float64 the relevance at every layer's input sums to the explained logit (before: refused)."""
    model = _bias_free(tiny_model(family))
    check_rules(model)
    with torch.enable_grad(), eager_attention(model), lrp_rules(model):
        out = model(input_ids=IDS, output_hidden_states=True)
        y = out.logits[0, 5].max()
        grads = torch.autograd.grad(y, list(out.hidden_states))
        totals = [float((h * g).sum().detach()) for h, g in zip(out.hidden_states, grads)]
    np.testing.assert_allclose(totals, float(y.detach()), rtol=1e-12)


def test_latents_shared_across_layers_send_relevance_to_the_layer_that_made_them():
    """Mistral Large 4 (layers 1 and 3 read the normed latent and rotated rotary key that layers 0 and 2 stored, its
    queries scaled per head, final logits soft-capped): relevance of the LM head's output z reaching the embeddings is
    z. A layer's input alone is no cut here (the shared latents pass beside it)."""
    model = _bias_free(mistral_large4())
    seen: list[torch.Tensor] = []
    model.lm_head.register_forward_hook(lambda module, args, output: seen.append(output))
    with torch.enable_grad(), eager_attention(model), lrp_rules(model):
        out = model(input_ids=IDS, output_hidden_states=True)
        z = seen[-1][0, 5].max()
        grad, = torch.autograd.grad(z, out.hidden_states[0])
    np.testing.assert_allclose(float((out.hidden_states[0] * grad).sum().detach()), float(z.detach()), rtol=1e-12)


def _reference_attention(attention, x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """The attention layer's output written from ``DeepseekV3Attention.forward`` (and Bailing-hybrid's gate), with
    the probabilities ``probs`` and the latent norm's factor ``gamma / rms`` constants, the gate ``sigmoid(g_proj x)``
    too: a function of ``x`` through the values only."""
    batch, seq, _ = x.shape
    nope, v, rank = attention.qk_nope_head_dim, attention.v_head_dim, attention.kv_lora_rank
    latent = attention.kv_a_proj_with_mqa(x)[..., :rank]
    factor = (attention.kv_a_layernorm.weight * torch.rsqrt(latent.pow(2).mean(-1, keepdim=True)
                                                            + attention.kv_a_layernorm.variance_epsilon)).detach()
    values = attention.kv_b_proj(latent * factor).view(batch, seq, -1, nope + v)[..., nope:].transpose(1, 2)
    heads = (probs.detach() @ values).transpose(1, 2)  # [batch, seq, heads, v]
    if getattr(attention, "g_proj", None) is not None:  # one gate per head
        heads = heads * torch.sigmoid(attention.g_proj(x)).detach()[..., None]
    return attention.o_proj(heads.reshape(batch, seq, -1))


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v3-no-q-latent", "minicpm3", "bailing_hybrid"])
def test_the_backward_through_an_attention_layer_holds_its_probabilities_constant(family):
    """Through layer 1's attention the rules' gradient of a random projection of the output equals the reference's,
    whose only path from the input is the values (queries, rotary and no-rope keys, gate, norm factor constant)."""
    model = _bias_free(tiny_model(family))
    attention = _layers(model)[1].self_attn
    seen: dict = {}
    attention.register_forward_pre_hook(lambda module, args, kwargs: seen.update(x=kwargs["hidden_states"]),
                                        with_kwargs=True)
    attention.register_forward_hook(lambda module, args, kwargs, output: seen.update(out=output[0], probs=output[1]),
                                    with_kwargs=True)
    weights = torch.randn(1, IDS.shape[1], model.config.hidden_size, generator=torch.Generator().manual_seed(3),
                          dtype=torch.float64)
    with torch.enable_grad(), eager_attention(model), lrp_rules(model):
        with _KeptWide(torch.float64):  # as compute_lrp runs it: the norms' and softmax's float32 kept float64
            model(input_ids=IDS)
        grad, = torch.autograd.grad((seen["out"] * weights).sum(), seen["x"])
    x = seen["x"].detach().requires_grad_()
    with torch.enable_grad():
        reference = _reference_attention(attention, x, seen["probs"])
        expected, = torch.autograd.grad((reference * weights).sum(), x)
    torch.testing.assert_close(reference.detach(), seen["out"].detach(), rtol=0, atol=1e-12)  # the module's output
    torch.testing.assert_close(grad, expected, rtol=0, atol=1e-12)
    assert grad.abs().max() > 1e-3


@pytest.mark.parametrize("family", ["deepseek_v3", "minicpm3", "bailing_hybrid", "glm_moe_dsa"])
def test_head_scores_are_the_relevance_at_their_slices_of_the_output_projections_input(family):
    """A head's relevance is what reaches its v_head_dim features of o_proj's input (head h: features h*v ..),
    summed over positions, recorded here by a hook of the test's own on o_proj."""
    model = _bias_free(tiny_model(family))
    info = describe_model(model)
    data = ImportanceData.from_ids([[5, 17, 33, 8, 61, 1], [9, 12, 40, 1]])
    batch = next(make_batches(data, info, batch_size=2))
    result = head_relevance(model, batch, strategy="loop")
    inputs: list[torch.Tensor] = []
    handles = [layer.self_attn.o_proj.register_forward_pre_hook(lambda module, args: inputs.append(args[0]))
               for layer in _layers(model)]
    heads: list[torch.Tensor] = []
    handles.append(model.lm_head.register_forward_hook(lambda module, args, output: heads.append(output)))
    v = model.config.v_head_dim
    with torch.enable_grad(), eager_attention(model), lrp_rules(model):
        with _KeptWide(torch.float64):
            model(**batch.inputs)
        z = heads[-1]
        for n, (row, position) in enumerate(result.steps.tolist()):
            target = z[row, position, int(result.tokens[n])]
            grads = torch.autograd.grad(target, inputs, retain_graph=True)
            for layer, (h, g) in enumerate(zip(inputs, grads)):
                expected = (h[row] * g[row]).reshape(h.shape[1], -1, v).sum((0, 2))
                torch.testing.assert_close(result.relevance[("dec_self", layer)][n], expected.detach(), rtol=1e-9,
                                           atol=1e-12)
    for handle in handles:
        handle.remove()
    assert len(result.steps) == 10  # every position of the two rows


@pytest.mark.parametrize("family", ["deepseek_v3", "minicpm3"])
def test_compute_lrp_conserves_with_biases(family):
    """With attention biases (kv_a_proj_with_mqa's included: its rotary columns' share is detached with them) and
    MoE layers, the signature's conservation is one to 1e-12."""
    import copy

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from headlab.checkpoint import model_class_for
    from support.family_matrix import perturbed_model
    from test_mla_pruning import _SIZES

    config = CONFIG_MAPPING[family](**copy.deepcopy({**_SIZES, "attention_bias": True}))
    model = perturbed_model(model_class_for(config), config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    assert model.model.layers[0].self_attn.kv_a_proj_with_mqa.bias is not None
    data = ImportanceData.from_ids([[5, 17, 33, 8, 1], [9, 12, 40, 70, 3, 6, 1], [4, 1]])
    scores = compute_lrp(model, data, describe_model(model), bootstrap=0)
    record = scores.signature["conservation"]["with_biases"]
    assert abs(record["min"] - 1) < 1e-12 and abs(record["max"] - 1) < 1e-12
    assert scores["dec_self"].shape == (2, 4) and not np.isnan(scores["dec_self"]).any()


def test_a_gated_norm_holds_its_gate_constant_and_conserves():
    """A.X-K2's AXK2GatedRMSNorm (``y * sigmoid(mlp(y))``, ``y`` its RMS norm's output): the gate is held constant
    (mlp's output detached), so the backward through it is the RMS rule's times ``sigmoid(mlp(y))``, checked against a
    reference written here; forward values are unchanged and compute_lrp conserves to 1e-12 in float64 (before: refused,
    "LRP: no rule for the gated normalisation AXK2GatedRMSNorm")."""
    model = _bias_free(tiny_model("axk2"))
    gated = model.model.layers[1].post_attention_layernorm
    assert type(gated).__name__ == "AXK2GatedRMSNorm"
    seen: dict = {}
    gated.register_forward_hook(lambda module, args, output: seen.update(x=args[0], out=output))
    model.config._experts_implementation = "eager"  # as lrp_rules runs the experts: grouped matmuls take no float64
    with torch.no_grad(), eager_attention(model), _KeptWide(torch.float64):
        plain = model(input_ids=IDS).logits
    weights = torch.randn(1, IDS.shape[1], model.config.hidden_size, generator=torch.Generator().manual_seed(5),
                          dtype=torch.float64)
    with torch.enable_grad(), eager_attention(model), lrp_rules(model):
        with _KeptWide(torch.float64):
            explained = model(input_ids=IDS).logits
        grad, = torch.autograd.grad((seen["out"] * weights).sum(), seen["x"])
    assert torch.equal(explained.detach(), plain)  # the rules change no forward value
    x = seen["x"].detach()
    norm = gated.norm
    factor = norm.weight * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)  # the RMS rule's
    gate = torch.sigmoid(gated.mlp(x * factor))
    torch.testing.assert_close(grad, (weights * gate * factor).detach(), rtol=0, atol=1e-12)
    assert grad.abs().max() > 1e-3
    data = ImportanceData.from_ids([[5, 17, 33, 8, 1], [9, 12, 40, 70, 3, 6, 1], [4, 1]])
    scores = compute_lrp(model, data, describe_model(model), bootstrap=0)
    record = scores.signature["conservation"]["with_biases"]
    assert abs(record["min"] - 1) < 1e-12 and abs(record["max"] - 1) < 1e-12
    assert not np.isnan(scores["dec_self"]).any()


def test_a_gated_norm_of_another_formula_is_refused_before_any_work(monkeypatch):
    """A gated norm that does not compute y * sigmoid(mlp(y)) (here y * mlp(y)) is refused naming it."""
    model = tiny_model("axk2")
    gated = type(model.model.layers[0].input_layernorm)
    monkeypatch.setattr(gated, "forward", lambda self, x: self.norm(x) * self.mlp(self.norm(x)))
    with pytest.raises(HeadlabError, match=r"LRP: no rule for the gated normalisation AXK2GatedRMSNorm "
                                           r"\(model\.layers\.0\.input_layernorm\): .*y \* sigmoid\(mlp\(y\)\)"):
        check_rules(model)


def test_a_gated_norm_is_checked_on_every_call(monkeypatch):
    """Where the probe cannot tell (weights on the meta device), the rule checks the product as the forward runs."""
    from headlab.importance import rules

    model = tiny_model("axk2")
    monkeypatch.setattr(rules, "_computes_gated_norm", lambda module: True)
    gated = type(model.model.layers[0].input_layernorm)
    monkeypatch.setattr(gated, "forward", lambda self, x: self.norm(x) * self.mlp(self.norm(x)))
    with pytest.raises(HeadlabError, match=r"LRP: the output of AXK2GatedRMSNorm is not y \* sigmoid\(mlp\(y\)\)"):
        with torch.enable_grad(), eager_attention(model), lrp_rules(model):
            model(input_ids=IDS)


def test_a_latent_attention_of_another_layout_is_refused():
    """A kv_a_proj_with_mqa that is not [latent | rotary key] wide: refused naming it, before any work."""
    model = tiny_model("deepseek_v3")
    attention = model.model.layers[0].self_attn
    check_rules(model)  # the blocks read, with the layout as it is
    attention.kv_a_proj_with_mqa = torch.nn.Linear(32, 16 + 4 + 1, bias=False)
    with pytest.raises(HeadlabError, match=r"LRP: no rule for the attention of model\.layers\.0\.self_attn "
                                           r"\(discovered:deepseek_v3\): multi-head latent attention, but its "
                                           r"kv_a_proj_with_mqa is not a linear map to the latent \(16\) and the "
                                           r"rotary key \(4\)"):
        check_rules(model)
