"""Tiny hybrid models whose state-space layers are Mamba or Mamba-2 mixers (the families of
importance/mixer_rules/mamba.py), each with a mixer layer and an attention layer, built from configs (hidden 32,
vocab 99): no downloads. Every parameter a rule could ignore is drawn at random (biases, norm weights, ``A_log``,
``D``, ``dt_bias``, the conv's bias), so a rule that drops one is visible.

``MAMBA`` maps a name to ``(model class, config, path of a mixer)``; Falcon-H1 comes in its three gate layouts
(``norm(y * silu(z))``, ``norm(y) * silu(z)`` with ``mamba_norm_before_gate``, ``y * silu(z)`` without the norm);
the mixer comes after the first attention layer (so that relevance crosses it on its way to the first layer), and
before it in ``...-mamba-first``.
"""

from __future__ import annotations

import torch
import transformers as tf

_BASE = dict(vocab_size=99, hidden_size=32, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64, bos_token_id=0, eos_token_id=1, pad_token_id=2)
_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_chunk_size=4, mamba_expand=1,
               mamba_n_groups=2)


def _falcon_h1(**extra):
    return lambda: (tf.FalconH1ForCausalLM, tf.FalconH1Config(
        **_BASE, num_hidden_layers=2, **_MAMBA2, mamba_d_ssm=32, projectors_bias=True, mamba_conv_bias=True,
        ssm_multipliers=[0.5, 1.5, 0.75, 1.25, 0.9], ssm_in_multiplier=0.8, **extra), "model.layers.0.mamba")


MAMBA = {
    "jamba": lambda: (tf.JambaForCausalLM, tf.JambaConfig(
        **_BASE, num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=0, expert_layer_period=4,
        mamba_d_state=8, mamba_dt_rank=4, mamba_expand=2, mamba_proj_bias=True, use_mamba_kernels=False),
        "model.layers.1.mamba"),
    "zamba": lambda: (tf.ZambaForCausalLM, tf.ZambaConfig(
        **_BASE, num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "hybrid"], mamba_d_state=8, n_mamba_heads=2,
        mamba_dt_rank=4, mamba_proj_bias=True), "model.layers.2.mamba_decoder.mamba"),
    "bamba": lambda: (tf.BambaForCausalLM, tf.BambaConfig(
        **_BASE, num_hidden_layers=2, attn_layer_indices=[0], **_MAMBA2, mamba_proj_bias=True, mamba_conv_bias=True),
        "model.layers.1.mamba"),
    "falcon_h1": _falcon_h1(mamba_rms_norm=True),
    "falcon_h1-gate-after-norm": _falcon_h1(mamba_rms_norm=True, mamba_norm_before_gate=True),
    "falcon_h1-no-norm": _falcon_h1(mamba_rms_norm=False),
    "nemotron_h": lambda: (tf.NemotronHForCausalLM, tf.NemotronHConfig(
        **_BASE, layers_block_type=["attention", "mamba"], mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8,
        n_groups=2, chunk_size=4, use_bias=True, use_conv_bias=True), "model.layers.1.mixer"),
    "zamba2": lambda: (tf.Zamba2ForCausalLM, tf.Zamba2Config(
        **_BASE, num_hidden_layers=2, layers_block_type=["mamba", "hybrid"], n_mamba_heads=4, mamba_headdim=8,
        mamba_d_state=8, mamba_ngroups=2, mamba_expand=1, chunk_size=4, add_bias_linear=True),
        "model.layers.1.mamba_decoder.mamba"),
    # the common layout: the mixer first, the attention after it
    "jamba-mamba-first": lambda: (tf.JambaForCausalLM, tf.JambaConfig(
        **_BASE, num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=4,
        mamba_d_state=8, mamba_dt_rank=4, mamba_expand=2, mamba_proj_bias=True, use_mamba_kernels=False),
        "model.layers.0.mamba"),
    "bamba-mamba-first": lambda: (tf.BambaForCausalLM, tf.BambaConfig(
        **_BASE, num_hidden_layers=2, attn_layer_indices=[1], **_MAMBA2, mamba_proj_bias=True, mamba_conv_bias=True),
        "model.layers.0.mamba"),
    "granitemoehybrid": lambda: (tf.GraniteMoeHybridForCausalLM, tf.GraniteMoeHybridConfig(
        **_BASE, num_hidden_layers=2, layer_types=["attention", "mamba"], **_MAMBA2, mamba_proj_bias=True,
        mamba_conv_bias=True, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=40),
        "model.layers.1.mamba"),
}


def mamba_model(name: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The tiny ``name`` model (:data:`MAMBA`) in eval mode, its parameters that start at zero or one drawn at
    random, in ``dtype``."""
    cls, config, _ = MAMBA[name]()
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for path, parameter in model.named_parameters():
            last = path.rpartition(".")[2]
            if last.endswith("bias") or "norm" in path or last == "D":
                parameter.add_(torch.randn_like(parameter) * 0.3)
            elif last == "A_log":
                parameter.copy_(torch.rand_like(parameter) * 2 - 1)
    return model.to(dtype)


def mixer(model: torch.nn.Module, name: str) -> torch.nn.Module:
    return model.get_submodule(MAMBA[name]()[2])
