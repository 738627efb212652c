"""HY-V4-VL (``HYV4VLForConditionalGeneration``, model types ``hy_v4_vl`` / ``hy_v4_vl_text``): its language model's
attention (``HYV4VLAttention``) is HY-V4's line for line (transformers 5.24; only its latent norms' eps differ), so
it takes HY-V4's table entries (``adapters.families``: LATENT_ATTENTION's ``hy_v4_rows``, the ``gate_proj`` output
gate, the sinks). Before (session 36), discovery refused the model as an output gate of a type it had not checked.
Checked here on a tiny float64 model, the vision tower idle (token ids never run it): capture equals transformers'
eager output_attentions, masking equals zeroing a head's value rows of ``kv_b_proj`` by hand, gates at one change
nothing, pruning equals masking on a padded batch (a layer left with no head too; reloaded by load_pruned and by plain
transformers' AutoModel with remote code) and LRP is refused before any
work, naming the hyper-connections, as HY-V4's (tests/test_hyper_connection_families.py)."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from headlab import attention_blocks, capture_attention, load_pruned, mask_heads, prune_heads, save_pruned
from headlab.importance import compute_lrp
from headlab.portable_code import install_tie_rule
from support.family_matrix import check_gates_at_one_change_nothing, logits, tiny_inputs
from support.lrp_families import lrp_data
from test_hyper_connection_families import _HY_V4, NOPE, V

_VISION = dict(hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=4, patch_size=4,
               image_size=16)


def _model(seed: int = 0) -> torch.nn.Module:
    if not hasattr(tf, "HYV4VLConfig"):
        pytest.skip("this transformers has no hy_v4_vl")
    text = dict(_HY_V4, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 0]})
    config = tf.HYV4VLConfig(text_config=text, vision_config=_VISION)
    config.text_config._experts_implementation = "eager"  # grouped matmuls take no float64
    torch.manual_seed(seed)
    model = tf.HYV4VLForConditionalGeneration(config).eval()
    with torch.no_grad():  # biases, norms and sinks off their initial values, the gates spread
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or "norm" in name or name.endswith(".sinks"):
                parameter.add_(torch.randn_like(parameter) * (1.0 if name.endswith(".sinks") else 0.1))
            if name.endswith("self_attn.gate_proj.weight"):
                parameter.mul_(8)
    install_tie_rule(model)  # as headlab runs it (tied top-k keys: the lowest index)
    return model.double()


def _attention(model, layer: int):
    return model.model.language_model.layers[layer].self_attn


def test_blocks_are_hy_v4s_the_vision_tower_idle():
    blocks = attention_blocks(_model())
    assert [(b.kind, b.layer, b.n_heads, b.d_head, b.idle) for b in blocks] == [
        ("enc_self", 0, 4, 8, True), ("dec_self", 0, 4, V, False), ("dec_self", 1, 4, V, False)]
    assert blocks[1].family.head_rows == (("q_b_proj", ("qk_nope_head_dim", "qk_rope_head_dim")),
                                          ("kv_b_proj", ("qk_nope_head_dim", "v_head_dim")),
                                          ("gate_proj", ("v_head_dim",)))
    assert blocks[1].family.head_vectors == ("sinks",)


def test_capture_equals_output_attentions():
    inputs = tiny_inputs()
    model = _model()
    with torch.no_grad():
        reference = model(**inputs, output_attentions=True).attentions
    with capture_attention(model) as record:
        logits(model, inputs)
    assert sorted(record) == [("dec_self", 0), ("dec_self", 1)]
    for (_, layer), probs in record.items():
        torch.testing.assert_close(probs, reference[layer], atol=1e-12, rtol=0)


def test_masking_equals_zeroed_values_and_gates_at_one_change_nothing():
    inputs = tiny_inputs()
    model = _model()
    before = logits(model, inputs)
    with mask_heads(model, {("dec_self", 1): [2]}):
        masked = logits(model, inputs)
    with torch.no_grad():  # kv_b_proj viewed [.., -1, nope + v], split [k_nope | v]: head 2's value rows
        _attention(model, 1).kv_b_proj.weight[2 * (NOPE + V) + NOPE:3 * (NOPE + V)] = 0
    reference = logits(model, inputs)
    assert not torch.allclose(reference, before)
    torch.testing.assert_close(masked, reference, atol=1e-12, rtol=0)
    check_gates_at_one_change_nothing(_model(), inputs)


def test_pruning_equals_masking_a_layer_emptied_and_reloads(tmp_path):
    inputs = tiny_inputs()
    spec = {("dec_self", 0): [0, 1, 2, 3], ("dec_self", 1): [1, 2]}
    model = _model()
    with mask_heads(model, spec):
        masked = logits(model, inputs)
    assert prune_heads(model, spec) == {("dec_self", 0): [], ("dec_self", 1): [0, 3]}
    assert _attention(model, 1).gate_proj.weight.shape[0] == 2 * V and _attention(model, 1).sinks.shape == (2,)
    keep = inputs["attention_mask"].bool()
    torch.testing.assert_close(logits(model, inputs)[keep], masked[keep], atol=1e-10, rtol=0)
    save_pruned(model, tmp_path / "pruned")
    reloaded = load_pruned(tmp_path / "pruned")
    assert [b.n_heads for b in attention_blocks(reloaded) if not b.idle] == [0, 2]
    reloaded.set_experts_implementation("eager")  # grouped matmuls take no float64
    torch.testing.assert_close(logits(reloaded.double(), inputs)[keep], masked[keep], atol=1e-10, rtol=0)
    # plain transformers: config.json's auto_map names the task's auto class of a multimodal wrapper and AutoModel
    # (headlab.portable); before, AutoModelForImageTextToText built the unpruned class and failed on the shapes
    for auto in (tf.AutoModel, tf.AutoModelForImageTextToText):
        plain, info = auto.from_pretrained(tmp_path / "pruned", trust_remote_code=True, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
        plain.set_experts_implementation("eager")
        torch.testing.assert_close(logits(plain.eval().double(), inputs)[keep], masked[keep], atol=1e-10, rtol=0)


def test_lrp_conserves_through_the_hyper_connections():
    """Its hyper-connections (HYV4VLHyperConnection, HYV4VLHyperHead: HY-V4's) hold their mixing weights constant
    (importance/mixer_rules/hyper_connection.py; refused before session 37)."""
    model = _model()
    record = compute_lrp(model, *lrp_data(model), bootstrap=0).signature["conservation"]
    assert record["n_outside"] == 0 and abs(record["with_biases"]["min"] - 1) < 1e-10 \
        and abs(record["with_biases"]["max"] - 1) < 1e-10, record
