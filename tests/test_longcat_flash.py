"""LongCat-Flash: two multi-head latent attentions in every decoder layer.

``LongcatFlashDecoderLayer`` holds ``self_attn = ModuleList([LongcatFlashMLA(layer_idx=2N), LongcatFlashMLA(
layer_idx=2N + 1)])`` and runs them one after the other; transformers numbers them by that ``layer_idx``
(the cache layer, the place in ``output_attentions``; ``config.num_hidden_layers`` is ``2 * num_layers``).
headlab numbers its blocks the same way (``adapters.families.ATTENTION_SUBLAYERS``): block ``2N + i`` is
``model.layers.N.self_attn.i``. Before, the layer was the path's last number, i: with two decoder
layers both first attentions claimed layer 0 (refused, "two modules claim dec_self layer 0"), and with
one decoder layer its two attentions happened to be 0 and 1.

Each attention is DeepSeek-V3's MLA (``q_b_proj`` viewed ``[batch, seq, -1, nope + rope]``, ``kv_b_proj``
``[batch, seq, -1, nope + v]`` split ``[k_nope | v]``, ``o_proj`` reading v per head), with the query and
key/value latents scaled by constants: pruned as the types of ``adapters.families.LATENT_ATTENTION``.
Checked here: the numbering, capture equal to ``output_attentions``, masking one block's head equal to
zeroing that head's value rows of that attention's ``kv_b_proj`` (and of no other), pruning equal to masking
(padded rows, cached generation, an attention left with no head), reloading, LRP conserving (its identity
experts too).
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from headlab import HeadlabError, attention_blocks, load_pruned, mask_heads, prune_heads, save_pruned
from headlab.checkpoint import model_class_for
from support.family_matrix import (
    check_capture_equals_output_attentions,
    check_gates_at_one_change_nothing,
    check_pruned_generates_as_masked,
    check_streamed_chunks_equal_capture,
    logits,
    padded_inputs,
    padded_logits,
    perturbed_model,
    tiny_inputs,
)

NOPE, ROPE, V = 4, 4, 8
SIZES = dict(vocab_size=99, hidden_size=32, num_layers=2, num_attention_heads=4, num_key_value_heads=4,
             max_position_embeddings=64, bos_token_id=0, eos_token_id=1, pad_token_id=2, q_lora_rank=16,
             kv_lora_rank=16, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, head_dim=ROPE, v_head_dim=V,
             ffn_hidden_size=40, expert_ffn_hidden_size=40, n_routed_experts=4, zero_expert_num=1, moe_topk=2)
N_BLOCKS = 4  # two decoder layers of two attentions


def tiny_model(attn_implementation: str = "sdpa", seed: int = 0, **extra) -> torch.nn.Module:
    if "longcat_flash" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no longcat_flash")
    config = CONFIG_MAPPING["longcat_flash"](**{**SIZES, **extra})
    return perturbed_model(model_class_for(config), config, seed, attn_implementation)


def attention(model, block: int) -> torch.nn.Module:
    """Block ``block``'s module, as the modeling code numbers it: decoder layer block // 2, attention block % 2."""
    return model.model.layers[block // 2].self_attn[block % 2]


def test_blocks_are_numbered_as_transformers_numbers_the_attentions():
    """Regression: the path's last number made both decoder layers' first attention layer 0 (refused)."""
    model = tiny_model()
    assert model.config.num_hidden_layers == N_BLOCKS
    blocks = attention_blocks(model)
    assert [(b.kind, b.layer, b.name, b.n_heads, b.n_kv_heads, b.d_head) for b in blocks] == [
        ("dec_self", i, f"model.layers.{i // 2}.self_attn.{i % 2}", 4, 4, V) for i in range(N_BLOCKS)]
    assert [b.core.layer_idx for b in blocks] == list(range(N_BLOCKS))
    assert all(b.module is attention(model, b.layer) for b in blocks)


def test_capture_and_streamed_chunks_equal_output_attentions():
    inputs = tiny_inputs()
    model, record = check_capture_equals_output_attentions(tiny_model, "dec_self", inputs, n_layers=N_BLOCKS)
    streamed = check_streamed_chunks_equal_capture(model, inputs, record)
    torch.testing.assert_close(streamed, logits(model, inputs), atol=1e-6, rtol=0)


@pytest.mark.parametrize("block", range(N_BLOCKS))
def test_masking_a_head_equals_zeroing_its_values_in_that_attention(block):
    """Head 2 of block ``block`` masked = head 2's value rows of that attention's kv_b_proj zeroed (rows
    2*(nope+v)+nope.. of the view [batch, seq, heads, nope + v]); zeroing them in any other attention differs."""
    inputs = tiny_inputs()
    model = tiny_model()
    before = logits(model, inputs)
    with mask_heads(model, {("dec_self", block): [2]}):
        masked = logits(model, inputs)
    assert torch.equal(logits(model, inputs), before)
    rows = torch.arange(2 * (NOPE + V) + NOPE, 3 * (NOPE + V))
    for other in range(N_BLOCKS):
        reference_model = tiny_model()
        with torch.no_grad():
            attention(reference_model, other).kv_b_proj.weight[rows] = 0
        reference = logits(reference_model, inputs)
        assert not torch.allclose(reference, before)
        if other == block:
            torch.testing.assert_close(masked, reference, atol=1e-6, rtol=0)
        else:
            assert not torch.allclose(masked, reference, atol=1e-4), other


def test_pruning_slices_the_rows_of_the_right_attention():
    model = tiny_model()
    before = {i: {n: p.clone() for n, p in attention(model, i).named_parameters()} for i in range(N_BLOCKS)}
    assert prune_heads(model, {("dec_self", 2): [0, 2]}) == {("dec_self", 2): [1, 3]}
    rows = lambda width: [r for h in (1, 3) for r in range(h * width, (h + 1) * width)]  # noqa: E731
    pruned = attention(model, 2)  # decoder layer 1's first attention
    assert torch.equal(pruned.q_b_proj.weight, before[2]["q_b_proj.weight"][rows(NOPE + ROPE)])
    assert torch.equal(pruned.kv_b_proj.weight, before[2]["kv_b_proj.weight"][rows(NOPE + V)])
    assert torch.equal(pruned.o_proj.weight, before[2]["o_proj.weight"][:, rows(V)])
    for i in (0, 1, 3):
        for name, parameter in attention(model, i).named_parameters():
            assert torch.equal(parameter, before[i][name]), (i, name)
    assert [b.n_heads for b in attention_blocks(model)] == [4, 4, 2, 4]


def test_pruning_equals_masking_generates_and_reloads(tmp_path):
    """Heads of the second attention of decoder layer 0 and the first of layer 1, and every head of the last
    attention (a stand-in that keeps its cache layer, 3): the masked model's logits and generation."""
    spec = {("dec_self", 1): [1], ("dec_self", 2): [0, 2], ("dec_self", 3): [0, 1, 2, 3]}
    model = tiny_model()
    ids, mask = padded_inputs(pad_id=2)
    expected, _ = check_pruned_generates_as_masked(model, spec, [4, 3, 2, 0], ids, mask, atol=1e-5)
    assert type(attention(model, 3)).__name__ == "ZeroHeadAttention"
    check_gates_at_one_change_nothing(model, tiny_inputs())

    save_pruned(model, tmp_path)
    reloaded = load_pruned(tmp_path)
    assert [(b.layer, b.name, b.n_heads) for b in attention_blocks(reloaded)] == [
        (0, "model.layers.0.self_attn.0", 4), (1, "model.layers.0.self_attn.1", 3),
        (2, "model.layers.1.self_attn.0", 2), (3, "model.layers.1.self_attn.1", 0)]
    assert torch.equal(padded_logits(reloaded, ids, mask), padded_logits(model, ids, mask))
    plain = tf.AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True).eval()
    torch.testing.assert_close(padded_logits(plain, ids, mask), expected, atol=1e-5, rtol=0)


def test_an_attention_whose_layer_idx_disagrees_with_its_place_is_refused():
    """The two numberings must agree, else headlab cannot tell which attention a block is."""
    model = tiny_model()
    attention(model, 1).layer_idx = 3
    with pytest.raises(HeadlabError, match=r"model\.layers\.0\.self_attn\.1 .*its layer_idx is 3, not 1"):
        attention_blocks(model)


def test_lrp_conserves_through_both_attentions_and_the_identity_experts():
    """Its attentions have the rule for latent attention (tests/test_lrp_latent_attention.py); its experts are
    transformers' fused gated experts plus identity ("zero computation") experts, expert 4 here, whose output is
    ``w_k x``: linear once the routing weight is a constant, as the rule makes every routing weight. Bias-free in
    float64 every decoder layer's input holds the whole logit, with tokens routed to the identity expert in both
    layers. Before: refused, naming the latent attention, then (with the attention's rule) the experts' layout."""
    import numpy as np

    from headlab.capture import eager_attention
    from headlab.importance.rules import lrp_rules

    model = tiny_model().double()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.zero_()
    routed: list[torch.Tensor] = []
    for layer in model.model.layers:
        # the explained pass only (discovery's probe, under no_grad, runs inside lrp_rules first)
        layer.mlp.experts.register_forward_hook(
            lambda module, args, output: routed.append(args[1]) if torch.is_grad_enabled() else None)
    with torch.enable_grad(), eager_attention(model), lrp_rules(model):
        out = model(input_ids=torch.tensor([[5, 17, 33, 8, 61, 4, 9, 12]]), output_hidden_states=True)
        y = out.logits[0, 5].max()
        grads = torch.autograd.grad(y, list(out.hidden_states))
        totals = [float((h * g).sum().detach()) for h, g in zip(out.hidden_states, grads)]
    np.testing.assert_allclose(totals, float(y.detach()), rtol=1e-12)
    assert len(routed) == 2 and all((index == SIZES["n_routed_experts"]).any() for index in routed)


def test_experts_of_another_layout_are_still_refused():
    """An identity expert count that does not match gate_up_proj's rows: refused, naming the experts."""
    from headlab.importance.rules import check_rules

    model = tiny_model()
    model.model.layers[0].mlp.experts.zero_expert_num = 2
    with pytest.raises(HeadlabError, match=r"LRP: no rule for the mixture-of-experts module LongcatFlashExperts "
                                           r"\(model\.layers\.0\.mlp\.experts\): its expert weights are not"):
        check_rules(model)
