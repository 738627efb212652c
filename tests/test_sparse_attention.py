"""DeepSeek Sparse Attention: DeepSeek-V3.2 (``deepseek_v32``) and GLM-MoE-DSA (``glm_moe_dsa``).

Each attention layer is DeepSeek-V3's multi-head latent attention with a lightning indexer beside
it: the indexer (its own projections ``wq_b``, ``wk``, ``weights_proj``, under ``torch.no_grad``)
picks the top-k keys of each query, and the attention runs over those keys only. transformers
(``DeepseekV32Attention.forward``) folds the selection into the mask for eager and SDPA only (an
additive float minimum, or False in a boolean mask); any other attention function gets the indices
(``indices=``, for the flash-MLA kernel) and an unfolded mask. GLM-MoE-DSA's ``"shared"`` layers
reuse the previous full layer's selection (``indexer_types``).

The family sweep of session 22 found the probe crashing inside the indexer (it reads the mask, which
the probe did not build): now the probe builds an all-visible mask where the model asks for one. And
headlab's own attention function (the default fused engine, confidence) ignored ``indices``: every
key attended, a silently wrong map and output; it now folds them as transformers does.

On tiny models (index_topk 3 of 7 keys, so that the selection hides keys): the blocks are found
(on the meta device too); capture equals transformers' eager ``output_attentions``, which the
selection visibly thins; the streamed chunks equal it and the streamed logits equal SDPA's; masking
the heads equals zeroing their value rows of ``kv_b_proj`` by hand (read off the modeling code: per
head ``[k_nope (4) | v (8)]``) and leaves the indexer's selection of that layer as it is; gates at
one change nothing; LRP explains them as DeepSeek-V3 (the selection is a mask, with no gradient), with the
selection active in the pass explained. Physical pruning: tests/test_mla_pruning.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from headlab import attention_blocks, mask_heads
from headlab.checkpoint import model_class_for
from support.family_matrix import (
    check_capture_equals_output_attentions,
    check_gates_at_one_change_nothing,
    check_head_counts,
    check_masking_equals_zeroed_values,
    check_streamed_chunks_equal_capture,
    logits,
    perturbed_model,
    tiny_inputs,
)

NOPE, ROPE, V = 4, 4, 8  # per head: keys [nope | rope], values of 8
TOPK = 3
_SIZES = dict(vocab_size=99, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=4, max_position_embeddings=64, bos_token_id=0, eos_token_id=1, pad_token_id=2,
              q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V,
              index_topk=TOPK, index_n_heads=2, index_head_dim=8,
              # layer 1 a mixture of experts
              first_k_dense_replace=1, moe_intermediate_size=40, n_routed_experts=4, num_experts_per_tok=2,
              n_shared_experts=1, n_group=1, topk_group=1)
CONFIGS = {
    "deepseek_v32": {},
    "glm_moe_dsa": {},
    # layer 1 reuses layer 0's selection (it has no indexer of its own)
    "glm_moe_dsa-shared": {"indexer_types": ["full", "shared"]},
}
FAMILIES = tuple(CONFIGS)

# (module holding layer i's values, rows of head h, key/value heads): kv_b_proj's output is viewed
# [batch, seq, heads, nope + v] and split [k_nope | v] (DeepseekV32Attention.expand_kv)
VALUES = (lambda m, i: m.model.layers[i].self_attn.kv_b_proj,
          lambda h: range(h * (NOPE + V) + NOPE, (h + 1) * (NOPE + V)), 4)


def tiny_model(family: str, attn_implementation: str = "sdpa", seed: int = 0) -> torch.nn.Module:
    model_type = family.split("-")[0]
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {model_type}")
    config = CONFIG_MAPPING[model_type](**_SIZES, **CONFIGS[family])
    return perturbed_model(model_class_for(config), config, seed, attn_implementation)


def _build(family: str):
    return lambda **kwargs: tiny_model(family, **kwargs)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_blocks_are_found(family, device):
    """The probe runs through the indexer (which reads the mask) on the meta device too."""
    with torch.device(device):
        model = tiny_model(family)
    blocks = check_head_counts(model, "dec_self", 4)
    assert [b.name for b in blocks] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert all(b.o is b.module.o_proj for b in blocks)


@pytest.mark.parametrize("family", FAMILIES)
def test_capture_and_streamed_chunks_equal_output_attentions(family):
    inputs = tiny_inputs()
    model, record = check_capture_equals_output_attentions(_build(family), "dec_self", inputs)
    for probs in record.values():  # the selection hides keys: rows that see 7 causal keys weigh TOPK of them
        assert int((probs[0] > 0).sum(-1).max()) == TOPK
    streamed = check_streamed_chunks_equal_capture(model, inputs, record)
    torch.testing.assert_close(streamed, logits(model, inputs), atol=1e-6, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_attention_folds_the_selection(family):
    """Regression: headlab's attention function got the indexer's picks as ``indices=`` and attended
    every key (logits off by about 0.1 on these models)."""
    from headlab.capture import stream_attention

    model = tiny_model(family)
    inputs = tiny_inputs()
    reference = logits(model, inputs)
    with stream_attention(model, lambda block, chunk: None, query_chunk=2):
        streamed = logits(model, inputs)
    torch.testing.assert_close(streamed, reference, atol=1e-6, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_masking_equals_zeroed_values(family):
    check_masking_equals_zeroed_values(_build(family), "dec_self", VALUES, tiny_inputs())


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_masking_a_layers_heads_leaves_its_indexer_selection(family):
    """The indexer reads the layer's input and the shared query latent, not the heads: masking (or
    removing) heads of a layer does not change which keys that layer's heads may see."""
    model = tiny_model(family)
    attention_blocks(model)  # the probe pass (it runs the indexer too) before the hook
    indexer = model.model.layers[1].self_attn.indexer
    picked: list[torch.Tensor] = []
    handle = indexer.register_forward_hook(lambda module, args, output: picked.append(output))
    try:
        logits(model, tiny_inputs())
        with mask_heads(model, {("dec_self", 1): [0, 2]}):
            logits(model, tiny_inputs())
    finally:
        handle.remove()
    assert len(picked) == 2 and torch.equal(picked[0], picked[1])


@pytest.mark.parametrize("family", FAMILIES)
def test_gates_at_one_change_nothing(family):
    check_gates_at_one_change_nothing(tiny_model(family), tiny_inputs())


@pytest.mark.parametrize("family", FAMILIES)
def test_lrp_explains_through_the_selection(family):
    """The indexer's selection reaches the attention as a mask only: integer top-k indices scattered into a boolean
    mask, folded into the additive one (DeepseekV32Attention.forward), with no gradient. So the rule for latent
    attention (tests/test_lrp_latent_attention.py) covers these layers: bias-free in float64, every layer's input
    holds the whole logit, in a pass where the selection hides keys (each query sees at most its top 3 of 7).
    Before: refused, naming the latent attention."""
    import numpy as np

    from headlab.capture import eager_attention
    from headlab.importance.rules import check_rules, lrp_rules

    model = tiny_model(family).double()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.zero_()
    check_rules(model)
    probs: list[torch.Tensor] = []
    for layer in model.model.layers:
        layer.self_attn.register_forward_hook(lambda module, args, output: probs.append(output[1].detach()))
    ids = torch.tensor([[5, 17, 33, 8, 61, 4, 9]])
    with torch.enable_grad(), eager_attention(model), lrp_rules(model):
        out = model(input_ids=ids, output_hidden_states=True)
        y = out.logits[0, 6].max()
        grads = torch.autograd.grad(y, list(out.hidden_states))
        totals = [float((h * g).sum().detach()) for h, g in zip(out.hidden_states, grads)]
    np.testing.assert_allclose(totals, float(y.detach()), rtol=1e-12)
    assert len(probs) == 2 and all(((p > 0).sum(-1) == torch.arange(1, 8).clamp(max=TOPK)).all() for p in probs)


def test_analyze_end_to_end(tmp_path):
    """`headlab analyze --ablation` (the fused engine: headlab's attention function): every stage done, LRP too
    (before: refused, exit 1, naming the latent attention)."""
    from support.family_matrix import ANALYZE_STAGES, analyze, save_tiny, treebank_files

    save_tiny(tiny_model("glm_moe_dsa-shared"), tmp_path / "dsa", treebank_files(tmp_path))
    code, stages = analyze(tmp_path / "dsa", tmp_path)
    for name in ANALYZE_STAGES:
        assert stages[name]["status"] == "done", stages[name]
    assert stages["lrp"]["status"] == "done" and code == 0, stages["lrp"]
