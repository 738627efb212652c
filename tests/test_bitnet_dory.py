"""BitNet as a family (a norm between its heads and o_proj), and Dory refused naming what is missing.

BitNetAttention (transformers 5.24, models/bitnet) computes ``o_proj(attn_sub_norm(heads))``: an RMS norm
(``BitNetRMSNorm``, in float32 whatever the dtype) over all heads' concatenated outputs. headlab reads, masks and gates
the heads at the norm's input, where zeroing a head is zeroing its value rows; pruning keeps the kept heads' entries
of the norm's weight times ``sqrt(n / n')`` and its epsilon times ``n / n'`` (headlab.adapters.families.SUB_NORMS),
so that the kept entries are normalised as they were beside the removed heads' zeros. The tiny model's norms have
epsilon 0.05 (a pruned norm that kept its epsilon, or did not rescale its weight, is off by far more than the
tolerance), perturbed norm weights and biases everywhere. Its eager softmax is float32 too, so the checks run in
float32 (1e-6); LRP's in float64.

Before this family (main at 56f3617), BitNet was refused ("the first module to read the attention function's output
... is a BitNetRMSNorm, not a linear map") and every test here failed.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from headlab import HeadlabError, attention_blocks, prune_heads
from support.family_matrix import (
    check_capture_equals_output_attentions,
    check_gates_at_one_change_nothing,
    check_lrp_conserves,
    check_masking_equals_zeroed_values,
    logits,
    perturbed_model,
    tiny_inputs,
)
from support.table_families import (
    SPECS,
    check_compute_lrp_conserves,
    check_pruned_equals_masked,
    check_pruned_generates_and_reloads,
    table_spec,
)

EPS = 0.05
"""The norms' epsilon: large against the heads' mean square, so that a pruned norm whose epsilon was not rescaled
shows."""


def _bitnet(attn_implementation: str = "sdpa", kv_heads: int = 2) -> torch.nn.Module:
    config = tf.BitNetConfig(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                             max_position_embeddings=64, bos_token_id=0, eos_token_id=1, pad_token_id=2,
                             num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=8, attention_bias=True,
                             rms_norm_eps=EPS)
    return perturbed_model(tf.BitNetForCausalLM, config, 0, attn_implementation)


def _spec(name: str) -> tuple[dict, list[int]]:
    return table_spec("dec_self", name)


def test_blocks_read_the_heads_at_the_sub_norm():
    assert [(b.name, b.kind, b.n_heads, b.n_kv_heads, b.d_head, b.family.sub_norm) for b in attention_blocks(_bitnet())] \
        == [(f"model.layers.{layer}.self_attn", "dec_self", 4, 2, 8, "attn_sub_norm") for layer in (0, 1)]


def test_captured_probabilities_are_the_models_own():
    check_capture_equals_output_attentions(_bitnet, "dec_self", tiny_inputs())


def test_masking_equals_zeroed_values():
    """Masking every query head of a key/value head equals zeroing that head's value rows by hand: the norm then sees
    zeros at those heads' entries, as it does when headlab masks at its input."""
    values = (lambda m, i: m.model.layers[i].self_attn.v_proj, lambda j: range(j * 8, (j + 1) * 8), 2)
    check_masking_equals_zeroed_values(_bitnet, "dec_self", values, tiny_inputs())


def test_gates_at_one_change_nothing():
    check_gates_at_one_change_nothing(_bitnet(), tiny_inputs())


@pytest.mark.parametrize("spec_name", SPECS)
def test_pruned_equals_masked(spec_name):
    """Also with layer 0 left with no head: the norm's input is all zeros, its output 0, so the layer adds o_proj's
    bias, which the stand-in returns."""
    check_pruned_equals_masked(_bitnet(), *_spec(spec_name), atol=1e-6)


def test_pruned_norm_is_rescaled():
    """The kept entries of the weight times sqrt(n / n'), the epsilon times n / n' (n = 32 entries, n' = 24)."""
    model = _bitnet()
    norm = model.model.layers[0].self_attn.attn_sub_norm
    weight = norm.weight.detach().clone()
    prune_heads(model, {("dec_self", 0): [1]})
    kept = torch.cat([weight[:8], weight[16:]])
    torch.testing.assert_close(norm.weight.detach(), kept * (32 / 24) ** 0.5, atol=1e-7, rtol=0)
    assert norm.variance_epsilon == pytest.approx(EPS * 32 / 24, rel=1e-12)


@pytest.mark.parametrize("spec_name", SPECS)
def test_pruned_generates_as_masked_and_reloads(spec_name, tmp_path):
    """Cached greedy generation, save_pruned, load_pruned and plain transformers (pruned_heads.py rebuilds each
    pruned norm's width and epsilon)."""
    check_pruned_generates_and_reloads(_bitnet(), *_spec(spec_name), tmp_path)


def test_wrong_epsilon_would_show():
    """The tolerance above can tell: the pruned norm with its epsilon put back as before is off the masked model."""
    from headlab import mask_heads

    model, inputs = _bitnet(), tiny_inputs()
    spec = {("dec_self", 0): [1], ("dec_self", 1): [0, 2]}
    with mask_heads(model, spec):
        masked = logits(model, inputs)
    prune_heads(model, spec)
    for layer in model.model.layers:
        layer.self_attn.attn_sub_norm.variance_epsilon = EPS
    assert (logits(model, inputs) - masked).abs().max() > 1e-3


def test_lrp_conserves_in_float64():
    """The layer-norm rule at attn_sub_norm, the gated-MLP product rule at ffn_sub_norm's input (BitNetMLP:
    down_proj(ffn_sub_norm(act(gate) * up)))."""
    model = _bitnet().double()
    check_lrp_conserves(model, model.model.layers[0], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("spec_name", [None, "no head left"])
def test_compute_lrp_conserves(spec_name):
    model = _bitnet()
    if spec_name:
        prune_heads(model, _spec(spec_name)[0])
    check_compute_lrp_conserves(model.double())


def test_quantized_projections_are_not_pruned():
    """AutoBitLinear with online quantization scales its ternary weight by the whole matrix's mean |W|: slicing a
    head's rows changes the other heads' weights. Refused before any change, masking still allowed."""
    from transformers.integrations.bitnet import AutoBitLinear

    model = _bitnet()
    attention = model.model.layers[1].self_attn
    quantized = AutoBitLinear(32, 32, bias=True, online_quant=True)
    quantized.load_state_dict(attention.q_proj.state_dict())
    attention.q_proj = quantized.eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(HeadlabError, match=r"physical pruning is refused: its projections are BitNet-quantized "
                                           r"\(q: AutoBitLinear.*mean\(\|W\|\)"):
        prune_heads(model, {("dec_self", 1): [0]})
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())


def _dory() -> torch.nn.Module:
    config = tf.DoryConfig(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                           n_input_layers=1, n_recurrent_layers=1, n_output_layers=1, n_recurrent_loops=2,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention"], sliding_window=4,
                           pad_token_id=2, bos_token_id=0, eos_token_id=1)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return tf.DoryForCausalLM(config).eval()


def test_dory_is_refused_naming_what_is_missing():
    with pytest.raises(HeadlabError, match=r"Dory \(nGPT\) is not analysed: its recurrent section runs its 1 layer 2 "
                                           r"times.*sqk, s_gate.*lambda_1, lambda_2.*logit_scale"):
        attention_blocks(_dory())


def test_what_the_dory_refusal_says_holds():
    """Its recurrent layer runs twice in one forward (two maps of it), and its attention holds the per-channel vectors
    the refusal names."""
    model = _dory()
    attention = model.model.layers[1].self_attn
    assert {"sqk", "s_gate"} <= {name.split(".")[-1] for name, _ in attention.named_parameters()} | \
        {name for name, _ in attention.named_buffers()} | set(vars(attention)), list(attention.named_parameters())
    with torch.no_grad():
        maps = model(**tiny_inputs(pad=False), output_attentions=True).attentions
    assert len(maps) == 4  # input layer, the recurrent layer twice, output layer
