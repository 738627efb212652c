"""Muse Spark (``MuseSparkForConditionalGeneration``, model type ``muse_spark``; transformers 5.24): its language
model's attention normalises each head's output alone (``o_norm``, ``MuseSparkRMSNorm(with_scale=False)`` on the
attention function's ``[batch, seq, heads, head_dim]``), then multiplies it by ``sigmoid(gate_proj(hidden_states))``
(AFMoE's output gate) before ``o_proj``. Discovery lets the heads' outputs through such a norm
(``adapters.families.HEAD_NORMS``): a head's zeros stay zeros and no head reads another's features. Its sparse layers
pool the hidden states to the experts' width and norm each expert's output (``has_post_expert_norm``), and its
post-FFN norm scales before it normalises (``MuseSparkTextInputScaledRMSNorm``): both have LRP rules now.

Found by the session-38 sweep of vision-language wrappers (skipped before: its audio pyramid needs a config of its
own; then refused: "o_norm is not a linear map"). Checked on a tiny float64 model on token ids (towers idle): capture
equals output_attentions, masking equals zeroed value rows, gates at one change nothing, pruning slices the gate's rows
and equals masking, the saved directory reloads, and LRP conserves through the experts and the norms."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from headlab import attention_blocks, load_pruned, mask_heads, prune_heads, save_pruned
from headlab.errors import HeadlabError
from support.family_matrix import (
    check_capture_equals_output_attentions,
    check_gates_at_one_change_nothing,
    logits,
    perturbed_model,
    tiny_inputs,
)
from support.lrp_families import assert_conserved

_TEXT = dict(vocab_size=99, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=2, bos_token_id=0,
             eos_token_id=1, sliding_window=4, moe_intermediate_size=40, num_local_experts=4, num_experts_per_tok=2,
             moe_hidden_size=16, mlp_layer_types=["dense", "sparse"])
_VISION = dict(hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=4, patch_size=8)
_AUDIO = dict(patch_sizes=[2], hidden_sizes=[8], depths=[1], num_hidden_layers=1, out_hidden_size=32)


def _model(implementation: str = "sdpa") -> torch.nn.Module:
    if not hasattr(tf, "MuseSparkForConditionalGeneration"):
        pytest.skip("this transformers has no muse_spark")
    config = tf.MuseSparkConfig(text_config=_TEXT, vision_config=_VISION, audio_config=_AUDIO, out_hidden_size=32,
                                projector_hidden_size=40, image_token_id=98, video_token_id=97, audio_token_id=96)
    config.text_config._experts_implementation = "eager"  # grouped matmuls take no float64
    model = perturbed_model(tf.MuseSparkForConditionalGeneration, config, attn_implementation=implementation)
    with torch.no_grad():  # the gates spread, the norms' weights (zeros at init: 1 + w) and the residual gates off
        for name, parameter in model.named_parameters():
            if name.endswith("self_attn.gate_proj.weight"):
                parameter.mul_(8)
            elif name.endswith(("layernorm.weight", "expert_norm.weight", "residual_gate.gate")):
                parameter.add_(torch.randn_like(parameter) * 0.3)
    return model.double()


def _attention(model, layer: int):
    return model.model.language_model.layers[layer].self_attn


def test_blocks_capture_masking_and_gates():
    model = _model()
    live = [b for b in attention_blocks(model) if not b.idle]
    assert [(b.kind, b.layer, b.n_heads, b.n_kv_heads) for b in live] == [("dec_self", 0, 4, 2), ("dec_self", 1, 4, 2)]
    assert any(path.endswith("gate_proj") for path, _ in live[0].family.head_rows)
    inputs = tiny_inputs()
    check_capture_equals_output_attentions(lambda attn_implementation="sdpa": _model(attn_implementation), "dec_self",
                                           inputs)
    with mask_heads(model, {("dec_self", 1): [2, 3]}):  # key/value head 1's query heads
        masked = logits(model, inputs)
    zeroed = _model()
    with torch.no_grad():
        _attention(zeroed, 1).v_proj.weight[8:16] = 0
    torch.testing.assert_close(masked, logits(zeroed, inputs), atol=1e-12, rtol=0)
    check_gates_at_one_change_nothing(_model(), inputs)


def test_a_norm_over_every_head_at_once_is_not_let_through(monkeypatch):
    """The same norm over the heads' outputs regrouped ``[batch, seq, heads * head_dim]`` mixes the heads (a head's
    zeros change the others' scale): refused, as before, naming it."""
    from transformers.models.muse_spark import modeling_muse_spark as modeling

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        key = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        value = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        out, weights = modeling.ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, modeling.eager_attention_forward)(
            self, query, key, value, attention_mask, scaling=self.scaling, **kwargs)
        out = self.o_norm(out.reshape(*hidden_states.shape[:-1], -1))  # every head at once
        return self.o_proj(out * torch.sigmoid(self.gate_proj(hidden_states))), weights

    monkeypatch.setattr(modeling.MuseSparkTextAttention, "forward", forward)
    with pytest.raises(HeadlabError, match=r"o_norm, is a MuseSparkRMSNorm, not a linear map"):
        attention_blocks(_model())


def test_pruning_slices_the_gate_equals_masking_and_reloads(tmp_path):
    inputs = tiny_inputs()
    model = _model()
    spec = {("dec_self", 0): [0, 1, 2, 3], ("dec_self", 1): [1, 2]}  # layer 0 emptied; layer 1: one of each group
    with mask_heads(model, spec):
        masked = logits(model, inputs)
    prune_heads(model, spec)
    assert _attention(model, 1).gate_proj.weight.shape[0] == 2 * 8
    keep = inputs["attention_mask"].bool()
    pruned = logits(model, inputs)
    torch.testing.assert_close(pruned[keep], masked[keep], atol=1e-10, rtol=0)
    save_pruned(model, tmp_path)
    reloaded = load_pruned(tmp_path).double()
    reloaded.config.get_text_config()._experts_implementation = "eager"
    assert [b.n_heads for b in attention_blocks(reloaded) if not b.idle] == [0, 2]
    torch.testing.assert_close(logits(reloaded, inputs), pruned, atol=1e-12, rtol=0)


def test_lrp_conserves_through_the_experts_and_the_norms():
    assert_conserved(_model(), 1e-10)
