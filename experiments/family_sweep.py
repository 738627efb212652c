"""Sweep transformers' text model types for silent wrong results (session 22, task qa7).

For each ``model_type`` of transformers' ``CONFIG_MAPPING`` with a causal-LM, masked-LM or
sequence-to-sequence LM class, a tiny random model is built from its config (hidden 32, 2 layers,
4 query heads over 2 key/value heads of 8, vocab 99; float64 where the model runs in it; types
whose config ignores the tiny sizes, over 3M parameters, are skipped; ``OVERRIDES`` gives the types
that need them their own smallest sizes: latent attention, hybrids, DBRX, Gemma 3n/4, Zamba, multimodal and speech
models' text, audio and vision sub-configs; a class that takes a sub-config, Qwen3.5's text model, is built from it as
transformers' auto classes build it), with no download, and the
checks of tests/support/family_matrix.py are run through headlab's public functions:

* ``blocks``: :func:`headlab.attention_blocks` finds it, or refuses it (``HeadlabError``);
* ``idle``: the blocks it calls idle (a multimodal model's tower, a cross-attention given no encoder states) do not
  run on token ids; the checks below leave them out (tests/test_multimodal_towers.py checks what headlab does with them);
* ``capture``: :func:`headlab.capture_attention` (SDPA where the family has it) equals transformers'
  own eager ``output_attentions``, kind by kind; with learned sinks, the weights the values get, which
  Granite-SWA's ``output_attentions`` (the softmax before its sink) times ``1 / (1 + exp(sink - lse))``
  is (tests/support/family_matrix.attentions_applied_to_values: from the map, the sinks and the logits);
* ``mask``: masking the query heads of the last key/value head of the last block of each kind
  changes the logits and equals (a) zeroing that head's output where the attention function
  returns it (an attention function of this script's, wrapping SDPA/eager), and (b) zeroing its
  value weights by hand where the block names its value projection (rows of ``block.v``, and of the projections
  ``Family.head_row_values`` names: Zamba 2's value adapters);
* ``gates``: scalar gates at one change nothing, and leave no hook behind;
* ``prune``: :func:`headlab.prune_heads` equals masking (or is refused with a HeadlabError);
* ``lrp`` (decoder-only and encoder-only): :func:`headlab.importance.rules.check_rules` refuses, or
  the rules conserve relevance on a bias-free copy (tests/support/family_matrix.check_lrp_conserves; Gemma 3n's and
  Gemma 4's per-layer token embeddings, an input of their own, counted with the first layer's input);
  with final logit soft-capping (``y = cap * tanh(z / cap)``: Gemma 2, VaultGemma, NanoChat, Beam) the
  capped logit ``y``'s relevance sums to ``z * (1 - tanh(z / cap) ** 2)`` (neither ``z`` nor ``y``):
  ``z``'s relevance, every share scaled by ``dy/dz``. compute_lrp explains ``z`` itself, the LM head's output.
  A float32 model that compute_lrp widens to float64 (gated MLPs, mixtures of experts: lrp_precision) is
  checked in float64 too: Ding's product rule loses relevance to float32 rounding (docs/importance.md).

Each type gets one outcome: ``pass`` (every check it reached passed; refused features listed),
``refused`` (attention_blocks refused it before any work; or, check ``inputs``, its forward needs more than token ids,
which every command refuses before any work: ``headlab.loading.token_ids_problem``, session 38), ``FAIL`` (a check
found a silent wrong result: which check, by how much), ``CRASH`` (an exception other than HeadlabError: a raw
traceback for a user), ``skipped`` (does not build tiny, or ``SKIPPED`` gives the reason) or ``timeout``. Families already in the
test matrix (tests/support) are marked ``matrix`` and skipped unless ``--all``. ``SIZES``, the tiny
builder and the walk over the model types are benchmarks/survey_families.py's, imported from there.
``--multimodal`` (session 37) sweeps instead the types whose only text-generating class is an
``AutoModelForImageTextToText`` wrapper (Qwen3-VL, Mistral3, PaliGemma, Idefics3, InternVL, ...), on token ids, their
towers idle: a composite config gets the tiny sizes in its ``text_config`` and its vision tower at its smallest.
experiments/variant_sweep.py (session 39) runs these checks per config variant (``VARIANT``: flags set in every build).
``--dtype bfloat16`` / ``float16`` (session 40) builds every model in half precision as ``from_pretrained(dtype=...)``
gives it (:func:`as_loaded`: the parameters its class keeps in float32 kept so) and holds each check to the bound the
library already uses for that dtype (:func:`tolerance_for`); LRP runs as compute_lrp runs it (widened to
``lrp_precision``, its forward under ``_KeptWide``), and compute_lrp itself runs on the half-precision model as a user
calls it (:func:`check_compute_lrp`). A model whose own logits are NaN or inf in the dtype (LongT5 in
float16) is ``refused-late`` when capture and pruning both refuse it (``check_own_nonfinite``), FAIL where either
accepts it; one whose own forward fails in the dtype is ``refused`` where attention_blocks refuses it, else ``skipped``.
``--attn-implementation eager`` / ``flex_attention`` (session 46) builds the checked models with that implementation,
as ``from_pretrained(attn_implementation=...)`` does (the capture reference stays eager), adds check ``own`` (their
logits are the eager reference's) and runs the whole sweep under ``torch.compiler.set_stance("force_eager")`` (as
headlab's own runs: transformers would compile flex_attention); a class without the implementation, or whose own forward
fails with it, is ``skipped``; ``refused`` where headlab refuses it before any work (under flex: T5, learned sinks on
a CPU; :func:`implementation_for`).

    cd <checkout> && PYTHONPATH=src:tests OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 \\
        .venv/bin/python experiments/family_sweep.py [--all] [--only TYPE ...] [--timeout 30] [--causal-first]
        [--multimodal] [--dtype {float64,float32,bfloat16,float16}] [--attn-implementation {sdpa,eager,flex_attention}]
"""

from __future__ import annotations

import logging
import math
import re
import signal
import sys
import time
import traceback
import warnings
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import transformers as tf

from headlab import HeadlabError, ScalarGates, attention_blocks, capture_attention, gates_attached, mask_heads
from headlab.adapters import config_value, is_linear, sharing_groups
from headlab.adapters.big_bird import block_sparse_probe
from headlab.adapters.families import causal_on_token_ids, rows_per_head
from headlab.importance.lrp import CONSERVATION_TOLERANCE, _KeptWide, _widened, lrp_precision
from headlab.language_model import analysed_model
from headlab.loading import required_inputs, token_ids_problem
from headlab.prune_check import tolerance as prune_tolerance

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
# the survey's sizes, builder and loop over the model types (one copy of each)
from survey_families import SIZES, TOO_LARGE, arguments, found_by, model_types, tiny  # noqa: E402
from survey_families import model_class as first_class  # noqa: E402

SEQ2SEQ_SIZES = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                     decoder_attention_heads=4, encoder_ffn_dim=40, decoder_ffn_dim=40, num_layers=2,
                     num_decoder_layers=2, num_heads=4, d_kv=8, d_ff=40, decoder_start_token_id=0)
GPT_SIZES = dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, n_ctx=64, d_model=32, n_inner=40)
EXTRA_SIZES = dict(  # mixtures of experts, multi-head latent attention, partial rotary, state-space mixers
    moe_intermediate_size=40, num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
    n_shared_experts=1, shared_expert_intermediate_size=40, first_k_dense_replace=1, n_group=1, topk_group=1,
    kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, rotary_dim=4,
    linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
    mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_chunk_size=4, mamba_expand=1,
    mamba_head_dim=8, ssm_state_size=8, window_size=4, attention_types=[[["global", "local"], 1]],
    num_layers=2)
UNSET = object()  # an OVERRIDES value: the size left out (a config that refuses to be given it)
HYBRID = ["linear_attention", "full_attention"]  # one state-space / linear-attention layer, one attention layer
MLA = dict(num_key_value_heads=4)  # latent attention: keys and values per query head
GEMMA = {**SIZES, "query_pre_attn_scalar": 8}  # an encoder-decoder's halves (T5Gemma): the tiny sizes in each
LOCAL_GLOBAL = ["sliding_attention", "full_attention"]
TINY_STACK = dict(hidden_size=32, intermediate_size=40, num_attention_heads=4, max_position_embeddings=64)  # a sub-model
TINY_VISION = dict(hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=4, image_size=16,
                   patch_size=4)  # a vision tower that token ids never run, at its smallest
# Qwen2-VL's, Qwen2.5-VL's and GLM-4V's towers (depth, embed_dim, a patch merger out to the text width) and their text
# models' multimodal rotary sections (sum: half the head size)
PATCH_MERGER_VISION = dict(depth=1, embed_dim=32, hidden_size=32, num_heads=4, intermediate_size=40, out_hidden_size=32,
                           patch_size=4, spatial_merge_size=2, temporal_patch_size=2, image_size=16)
MROPE = dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]})
TINY_AUDIO = dict(d_model=32, encoder_layers=1, encoder_attention_heads=4, encoder_ffn_dim=40, hidden_size=32,
                  num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, intermediate_size=40, head_dim=8)
# Qwen4-Exp: its attention layers select keys through an indexer (QSA): 2 heads, blocks of 2 tokens, 1 block kept
QWEN4 = dict(layer_types=["linear_attention", "indexed_attention"], hc_lowrank=8, indexer_n_heads=2, indexer_kv_heads=1,
             indexer_head_dim=8, indexer_budget=2, indexer_compress_ratio=2)
OVERRIDES: dict[str, dict] = {  # the smallest sizes each type accepts (read off its configuration_*.py)
    **{t: MLA for t in ("deepseek_v2", "glm4_moe_lite", "minicpm3", "sarvam_mla", "axk2")},
    "bailing_hybrid": {**MLA, "layer_types": ["full_attention", "full_attention"]},  # its MLA layers only
    # DeepSeek Sparse Attention: an indexer of 2 heads picking 3 keys per query (of 7: the selection counts)
    **{t: {**MLA, "index_topk": 3, "index_n_heads": 2, "index_head_dim": 8} for t in ("deepseek_v32", "glm_moe_dsa")},
    # dots3-note's text model: the same indexer, an output gate per head (its validator wants the MLA head counts)
    "dots3_note_text": {**MLA, "index_topk": 3, "index_n_heads": 2, "index_head_dim": 8},
    # LongT5's local attention: blocks of 3 tokens (the 7 of inputs_for in 3 blocks, the last padded); its transient-
    # global attention (variant_sweep's encoder_attention_type): side keys of blocks of 2 tokens (3 of them, an orphan)
    "longt5": {"local_radius": 2, "global_block_size": 2},
    "pegasus_x": {"block_size": 4, "num_global_tokens": 3},  # several blocks of the 7 tokens, staggered and not
    # BigBird's block-sparse attention (its default; BigBird-Pegasus's encoder's): blocks of 2 tokens, one random
    # block, so that inputs longer than (5 + 2 x 1) x 2 = 14 tokens run it (inputs_for gives 18: block_sparse_probe)
    **{t: {"block_size": 2, "num_random_blocks": 1} for t in ("big_bird", "bigbird_pegasus")},
    **{t: {**MLA, "head_dim": 4} for t in ("deepseek_v3", "mistral4")},  # head_dim: the rotary part
    # LongCat-Flash: num_hidden_layers is 2 x its decoder layers (two attentions in each): two decoder layers
    "longcat_flash": {**MLA, "head_dim": 4, "num_hidden_layers": 4},
    **{t: {**MLA, "head_dim": 4} for t in ("youtu", "axk1")},
    "mimo_v2_flash": dict(head_dim=12),  # query/key heads wider than its value heads of 8, as released (192/128)
    **{t: dict(layer_types=HYBRID) for t in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")},
    "gemma4_text": dict(vocab_size_per_layer_input=99, hidden_size_per_layer_input=8, global_head_dim=8,
                        layer_types=["sliding_attention", "full_attention"], sliding_window=4),
    "kimi_linear": dict(num_key_value_heads=4, num_local_experts=4, linear_head_dim=8, linear_num_heads=4,
                        layer_types=HYBRID),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, use_mamba_kernels=False),
    "bamba": dict(attn_layer_indices=[1]),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"]),
    "recurrent_gemma": dict(block_types=["recurrent", "attention"], attention_window_size=16, lru_width=32),
    # the shared transformer's weights are tied across hybrid layers: two of them
    "zamba": dict(layers_block_type=["mamba", "hybrid", "hybrid"], num_hidden_layers=3),
    "zamba2": dict(layers_block_type=["mamba", "hybrid"], n_mamba_heads=4),
    "dbrx": dict(d_model=32, n_heads=4, n_layers=2, attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(ffn_hidden_size=40, moe_num_experts=4, moe_top_k=2)),
    "gemma3n_text": dict(layer_types=["sliding_attention", "full_attention"], num_kv_shared_layers=0, laurel_rank=4,
                         altup_num_inputs=2, hidden_size_per_layer_input=8, vocab_size_per_layer_input=99,
                         intermediate_size=[40, 40], activation_sparsity_pattern=[0.95, 0.0]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "mamba2": dict(num_heads=4, head_dim=16, expand=2, n_groups=1),
    # skip27B
    **{t: dict(text_config=dict(SIZES, global_attn_every_n_layers=2, local_attention=4), vision_config=TINY_VISION,
               pixel_shuffle_factor=2) for t in ("modernvbert", "ultravbert")},
    "mllama": dict(text_config={**SIZES, "cross_attention_layers": [1]}),
    "mobilebert": dict(embedding_size=32, intra_bottleneck_size=16, true_hidden_size=16, num_feedforward_networks=2),
    **{t: dict(text_config=SIZES, audio_config=TINY_AUDIO)
       for t in ("moss_transcribe_diarize", "qwen2_audio", "voxtral", "voxtral_realtime")},
    "musicflamingo": dict(text_config=SIZES, audio_config=dict(TINY_AUDIO, model_type="audioflamingo3_encoder")),
    # experts in every other layer (the default 4 gives the 2-layer build none, so its experts went unchecked)
    "nllb-moe": dict(encoder_sparse_step=2, decoder_sparse_step=2),
    # Switch Transformers: experts in both layers (the defaults, 12 sparse layers of 12, give the 2-layer build a sparse
    # step of 0, no experts at all)
    "switch_transformers": dict(num_sparse_encoder_layers=2, num_sparse_decoder_layers=2),
    # MusicGen's decoder (an LM over audio codes, one codebook here: input_ids [batch x codebooks, length])
    **{t: dict(decoder=dict(SIZES, ffn_dim=40, num_codebooks=1)) for t in ("musicgen", "musicgen_melody")},
    "nemo_speechlm": dict(text_config=dict(SIZES, **EXTRA_SIZES, model_type="nemotron_h"),
                          audio_config=dict(asr_config=dict(TINY_AUDIO, num_mel_bins=16),
                                            diarization_config=dict(
                                                model_type="nemotron3_diarization",
                                                audio_config=dict(TINY_AUDIO, num_mel_bins=16),
                                                head_config=dict(audio_hidden_size=32, hidden_size=16))),
                          word_timestamp_config=dict(TINY_AUDIO, vocab_size=16, blank_token_id=15)),
    "omniasr": dict(text_config=SIZES, audio_config=dict(TINY_AUDIO, conv_dim=[8, 8], conv_kernel=[10, 3],
                                                         conv_stride=[5, 2], num_conv_pos_embeddings=16,
                                                         num_conv_pos_embedding_groups=4)),
    "qwen3_asr": dict(text_config=SIZES, audio_config=dict(TINY_AUDIO, num_mel_bins=16, output_dim=32,
                                                           downsample_hidden_size=8)),
    "perceiver": dict(d_model=32, d_latents=32, num_latents=8, num_self_attends_per_block=2, num_self_attention_heads=4,
                      num_cross_attention_heads=4),
    "phi4_multimodal": dict(vision_config=dict(TINY_VISION, crop_size=16, feature_layer=-1),
                            audio_config=dict(TINY_AUDIO, num_blocks=1, ext_pw_out_channel=32,
                                              depthwise_separable_out_channel=32, nemo_conv_channels=32, input_size=16,
                                              bias_max_distance=16, feature_layer=-1)),
    "prophetnet": dict(num_hidden_layers=UNSET, num_encoder_layers=2, num_decoder_layers=2, num_encoder_attention_heads=4,
                       num_decoder_attention_heads=4, encoder_ffn_dim=40, decoder_ffn_dim=40, num_buckets=8,
                       # pad id 0, as the released checkpoints': transformers' cached generation checks positions
                       # that hold only then (session 41)
                       relative_max_distance=16, pad_token_id=0),
    **{t: dict(text_config={**SIZES, **EXTRA_SIZES, "layer_types": HYBRID}) for t in ("qwen3_5", "qwen3_5_moe")},
    "qwen4_exp": dict(text_config={**SIZES, **EXTRA_SIZES, **QWEN4}),
    "qwen4_exp_text": QWEN4,
    "reformer": dict(attn_layers=["local", "lsh"], attention_head_size=8, axial_pos_shape=[8, 8],
                     axial_pos_embds_dim=[16, 16], local_attn_chunk_length=4, lsh_attn_chunk_length=4,
                     num_buckets=2, feed_forward_size=40),
    "roc_bert": dict(pronunciation_embed_dim=8, pronunciation_vocab_size=20, shape_embed_dim=8, shape_vocab_size=20),
    "squeezebert": dict(embedding_size=32, q_groups=2, k_groups=2, v_groups=2, intermediate_groups=2, output_groups=2),
    "t5gemma": dict(vocab_size=99, encoder=dict(**GEMMA, layer_types=LOCAL_GLOBAL, sliding_window=4),
                    decoder=dict(**GEMMA, layer_types=LOCAL_GLOBAL, sliding_window=4)),
    # the encoder's bidirectional window of 6 (its own key, 2 back, 3 ahead): at 4 (1 back) a right-padded row's last
    # query sees only padding, which transformers' own float64 eager mask makes NaN (refused-late at capture, naming it)
    "t5gemma2": dict(encoder=dict(text_config=dict(**GEMMA, layer_types=LOCAL_GLOBAL, sliding_window=6),
                                  vision_config=TINY_VISION, mm_tokens_per_image=4),
                     decoder=dict(**GEMMA, layer_types=LOCAL_GLOBAL, sliding_window=4)),
    "vibevoice_asr": dict(text_config=SIZES, **{f"{k}_tokenizer_encoder_config": dict(
        hidden_size=8, num_filters=4, downsampling_ratios=[2], depths=[1, 1]) for k in ("acoustic", "semantic")}),
    "xmod": dict(languages=["en_XX", "de_DE"], default_language="en_XX"),
    "zaya": dict(num_experts_per_tok=1, moe_intermediate_size=40, router_hidden_size=16),
    "xlnet": dict(max_position_embeddings=UNSET, d_inner=40, mem_len=UNSET),
    # skip27A (tests/test_multimodal_towers.py builds gemma3, gemma4 and git too)
    "audioflamingo3": dict(text_config=dict(SIZES, model_type="qwen2"), audio_config=dict(
        hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=4, num_mel_bins=8,
        max_source_positions=64)),
    # byte latent transformer: an entropy patcher, a local encoder, a global transformer and a local decoder (refused)
    "blt": dict(vocab_size=260, encoder_hash_byte_group_vocab=64, cross_attn_k=1, local_attention_window_len=8,
                **{f"{part}_config": dict(TINY_STACK, vocab_size=260, hidden_size_global=32, cross_attn_k=1,
                                          num_hidden_layers=1) for part in ("patcher", "encoder", "decoder")},
                global_config=dict(TINY_STACK, num_hidden_layers=2)),
    # rope parameters per layer type (it reads them so, and sets none)
    "cohere_compass_text": dict(layer_types=LOCAL_GLOBAL, sliding_window=4, rope_parameters={
        t: dict(rope_type="default", rope_theta=10000.0) for t in LOCAL_GLOBAL}),
    # recurrent depth: one input, one looped (twice) and one output layer
    "dory": dict(num_hidden_layers=3, n_input_layers=1, n_recurrent_layers=1, n_output_layers=1, n_recurrent_loops=2,
                 layer_types=["sliding_attention", "full_attention", "sliding_attention"], sliding_window=4),
    # its causal LM is dots3_note_text's, built from the top-level sizes; the towers' adapters must emit its width
    "dots3_note": {**MLA, "index_topk": 3, "index_n_heads": 2, "index_head_dim": 8,
                   "vision_config": dict(adapter_out_dim=32), "audio_config": dict(adapter_out_dim=32)},
    "emu3": dict(text_config=SIZES),
    "encoder-decoder": dict(encoder=dict(TINY_STACK, num_hidden_layers=2, model_type="bert", vocab_size=99, pad_token_id=2),
                            decoder=dict(TINY_STACK, num_hidden_layers=2, model_type="bert", vocab_size=99, pad_token_id=2,
                                         is_decoder=True, add_cross_attention=True)),
    "esmc": dict(num_key_value_heads=4),  # no grouped-query attention
    "funnel": dict(num_hidden_layers=UNSET, block_sizes=[1, 1], num_decoder_layers=1, d_model=32, n_head=4, d_head=8,
                   d_inner=40),
    # session 37, --multimodal: partial rotary (half the head size rotated: sections summing to 2); Step-3.7's
    # sliding-window mask is built whatever its layer types
    **{t: dict(text_config={**SIZES, **EXTRA_SIZES, "rope_parameters": {
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 0], "partial_rotary_factor": 0.5}},
        vision_config=PATCH_MERGER_VISION) for t in ("glm4v_moe", "glm_ocr")},
    "cohere2_vision": dict(text_config=dict(SIZES, model_type="cohere2", layer_types=LOCAL_GLOBAL, sliding_window=4),
                           vision_config=dict(TINY_VISION, model_type="siglip_vision_model", patch_size=8),
                           alignment_intermediate_size=40, image_token_id=98),
    "ovis2": dict(hidden_size=32, vocab_size=99, image_token_id=98, visual_indicator_token_ids=[93, 94, 95, 96, 97],
                  text_config=dict(SIZES, model_type="qwen2"), vision_config=dict(TINY_VISION, vocab_size=64)),
    "molmo2": dict(image_start_token_id=90, low_res_image_start_token_id=91, image_end_token_id=92, image_patch_id=93,
                   frame_start_token_id=94, frame_end_token_id=95, text_config=SIZES,
                   vision_config=dict(TINY_VISION, num_hidden_layers=2, num_key_value_heads=4, head_dim=8,
                                      image_size=[16, 16]),
                   adapter_config=dict(vision_feature_layer=[-1, -2], hidden_size=32, num_attention_heads=4,
                                       num_key_value_heads=4, head_dim=8, intermediate_size=40, text_hidden_size=32)),
    "janus": dict(image_token_id=98, text_config=dict(SIZES, model_type="llama"),
                  vision_config=dict(TINY_VISION, projection_dim=32),
                  vq_config=dict(embed_dim=8, num_embeddings=16, base_channels=32, channel_multiplier=[1, 1],
                                 num_res_blocks=1, projection_dim=32, image_token_embed_dim=32, num_patches=16,
                                 num_hidden_layers=1)),
    **{t: dict(out_hidden_size=32, projector_hidden_size=40, image_token_id=98, video_token_id=97,
               text_config=dict(SIZES, layer_types=LOCAL_GLOBAL, sliding_window=4), vision_config=TINY_VISION)
       for t in ("muse_glimmer", "muse_spark")},
    "kimi_k25": dict(text_config={**SIZES, **EXTRA_SIZES, **MLA, "head_dim": 4, "model_type": "deepseek_v3"},
                     vision_config=dict(TINY_VISION, patch_size=4, pos_emb_height=8, pos_emb_width=8)),
    "step3p7": dict(text_config={**SIZES, **EXTRA_SIZES, "sliding_window": 4, "share_expert_dim": 16},
                    vision_config=dict(TINY_VISION, patch_size=8)),
    "gemma3": dict(text_config=dict(SIZES, sliding_window=4), mm_tokens_per_image=1,
                   vision_config=dict(TINY_VISION, patch_size=8)),
    "gemma4": dict(text_config=dict(SIZES, vocab_size_per_layer_input=99, hidden_size_per_layer_input=8,
                                    global_head_dim=8, layer_types=LOCAL_GLOBAL, sliding_window=4),
                   vision_config=dict(TINY_STACK, num_hidden_layers=1, num_key_value_heads=4, head_dim=8,
                                      position_embedding_size=64, patch_size=4, pooling_kernel_size=2),
                   audio_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                     subsampling_conv_channels=[8, 4], output_proj_dims=32)),
    "gemma4_unified": dict(text_config=dict(SIZES, layer_types=LOCAL_GLOBAL, sliding_window=4),
                           vision_config=dict(patch_size=4, pooling_kernel_size=2, mm_embed_dim=32, mm_posemb_size=16,
                                              output_proj_dims=32), audio_config=dict(audio_embed_dim=16)),
    "git": dict(vision_config=dict(TINY_VISION, patch_size=8)),
    "glmasr": dict(text_config=dict(SIZES, model_type="llama"), audio_config=dict(
        TINY_STACK, num_hidden_layers=1, num_mel_bins=8)),
    "got_ocr2": dict(text_config=dict(SIZES, model_type="qwen2"), vision_config=dict(
        hidden_size=32, output_channels=16, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8,
        window_size=2, global_attn_indexes=[1], mlp_dim=40)),
    **{t: dict(text_config=dict(SIZES, model_type="granite"), window_size=4, downsample_rate=2, encoder_config=dict(
        input_dim=8, num_layers=1, hidden_dim=32, num_heads=4, output_dim=8, context_size=8, max_pos_emb=16,
        conv_kernel_size=3), projector_config=dict(TINY_STACK, model_type="blip_2_qformer", num_hidden_layers=1,
                                                   encoder_hidden_size=32, vocab_size=99))
       for t in ("granite_speech", "granite_speech_plus")},
    # a sliding-window and a full layer (its default for 2 layers: sliding only), each with its own head counts
    **{t: dict(unpadded_vocab_size=99, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8,
               sliding_window_size=4, d_rel=4, rel_extent=8, moe_intermediate_size=40, n_routed_experts=4,
               num_experts_per_tok=2, n_layers_per_attn_res_block=1, layer_types=["hybrid_sliding", "hybrid"])
       for t in ("inkling2_text",)},
    # Inkling2-Loop: four layers, 1 and 2 looped twice (its default loop starts at layer 6)
    "inkling2_loop_text": dict(unpadded_vocab_size=99, swa_num_attention_heads=4, swa_num_key_value_heads=2,
                               swa_head_dim=8, sliding_window_size=4, d_rel=4, rel_extent=8, moe_intermediate_size=40,
                               n_routed_experts=4, num_experts_per_tok=2, n_layers_per_attn_res_block=1,
                               num_hidden_layers=4, layer_types=["hybrid_sliding", "hybrid"] * 2,
                               loop_layer_index_start=1, loop_layer_index_end=3, loop_num_passes=2, loop_gate_rank=8),
    # its vision tower one layer deep around the text model above (session 40: analysed as its language model)
    "inkling2": dict(text_config=dict(SIZES, unpadded_vocab_size=99, swa_num_attention_heads=4, swa_num_key_value_heads=2,
                                      swa_head_dim=8, sliding_window_size=4, d_rel=4, rel_extent=8, moe_intermediate_size=40,
                                      n_routed_experts=4, num_experts_per_tok=2, n_layers_per_attn_res_block=1,
                                      layer_types=["hybrid_sliding", "hybrid"]),
                     vision_config=dict(text_hidden_size=32, hidden_size=16, intermediate_size=20, num_hidden_layers=1,
                                        num_attention_heads=2)),
    "inkling2_loop": dict(text_config=dict(SIZES, unpadded_vocab_size=99, swa_num_attention_heads=4,
                                           swa_num_key_value_heads=2, swa_head_dim=8, sliding_window_size=4, d_rel=4,
                                           rel_extent=8, moe_intermediate_size=40, n_routed_experts=4,
                                           num_experts_per_tok=2, n_layers_per_attn_res_block=1, num_hidden_layers=4,
                                           layer_types=["hybrid_sliding", "hybrid"] * 2, loop_layer_index_start=1,
                                           loop_layer_index_end=3, loop_num_passes=2, loop_gate_rank=8),
                          vision_config=dict(text_hidden_size=32, hidden_size=16, intermediate_size=20,
                                             num_hidden_layers=1, num_attention_heads=2)),
    # its default for 3 layers is convolutions only: one of each kind
    "lfm3": dict(num_hidden_layers=3, layer_types=["conv", "sliding_attention", "full_attention"], sliding_window=4),
    # chunked attention over 4 tokens
    "llama4": dict(text_config=dict(SIZES, intermediate_size_mlp=40, num_local_experts=2, attention_chunk_size=4)),
    "luke": dict(entity_vocab_size=20, entity_emb_size=8),
    # session 38, main: the wrappers --multimodal skipped
    # Chameleon: image tokens need a vocabulary map (two of them here, their logits set to the minimum by its head)
    "chameleon": dict(vocabulary_map={"<image>": 98, "IMGIMG0Z": 97, "IMGIMG1Z": 96}, vq_config=dict(
        embed_dim=8, num_embeddings=16, latent_channels=32, base_channels=32, channel_multiplier=[1, 1],
        num_res_blocks=1, resolution=16)),
    # Muse Spark: MoE pooled to its own width, a dense and a sparse layer; its audio pyramid one stage deep
    "muse_spark": dict(text_config=dict(SIZES, moe_intermediate_size=40, num_local_experts=4, num_experts_per_tok=2,
                                        moe_hidden_size=16, sliding_window=4, mlp_layer_types=["dense", "sparse"]),
                       vision_config=dict(TINY_VISION, patch_size=8), out_hidden_size=32, projector_hidden_size=40,
                       audio_config=dict(patch_sizes=[2], hidden_sizes=[8], depths=[1], num_hidden_layers=1,
                                         out_hidden_size=32), image_token_id=98, video_token_id=97, audio_token_id=96),
    # Apertus 1.5: visual and audio token ranges (codebooks of 8) inside the vocabulary, an output head narrower than it
    "apertus1p5": dict(
        text_config=dict(SIZES, output_vocab_size=90), image_token_id=80, audio_token_id=81, image_token_offset=82,
        audio_token_offset=90, vision_config=dict(codebook_size=8, embed_dim=8, latent_channels=32, base_channels=32,
                                                  channel_multiplier=[1, 1], num_res_blocks=1, attn_resolutions=[],
                                                  resolution=16),
        audio_config=dict(model_type="wavtokenizer_encoder", codebook_size=8, hidden_size=16, codebook_dim=16,
                          num_filters=4, upsampling_ratios=[2], num_lstm_layers=1, decoder_hidden_size=32,
                          decoder_intermediate_size=40, decoder_num_layers=1, decoder_attention_num_groups=4)),
    # Cohere Compass: rotary parameters per layer type, M-RoPE on its sliding layers and none (NoPE) on its full one
    "cohere_compass": dict(text_config=dict(SIZES, layer_types=LOCAL_GLOBAL, sliding_window=4, rope_parameters={
        "sliding_attention": MROPE["rope_parameters"], "full_attention": None}), vision_config=dict(
        PATCH_MERGER_VISION, deepstack_visual_indexes=[0], num_position_embeddings=16, out_hidden_size=32)),
    # DiffusionGemma: experts in every layer (its forward takes no dense-only config), a canvas of 4 tokens
    "diffusion_gemma": dict(text_config=dict(SIZES, layer_types=LOCAL_GLOBAL, sliding_window=4, num_experts=4,
                                             top_k_experts=2, moe_intermediate_size=40, global_head_dim=8),
                            vision_config=dict(TINY_STACK, num_hidden_layers=1, num_key_value_heads=4, head_dim=8,
                                               position_embedding_size=64, patch_size=4, pooling_kernel_size=2),
                            canvas_length=4),
    # Qwen2.5-Omni's thinker: M-RoPE text model; window-attention vision tower and audio encoder at their smallest
    "qwen2_5_omni_thinker": dict(
        text_config=dict(SIZES, **MROPE), vision_config=dict(PATCH_MERGER_VISION, fullatt_block_indexes=[0],
                                                             window_size=8),
        audio_config=dict(num_mel_bins=8, encoder_layers=1, encoder_attention_heads=4, encoder_ffn_dim=40, d_model=32,
                          output_dim=32, max_source_positions=16, n_window=4),
        audio_token_index=90, image_token_index=91, video_token_index=92, audio_start_token_id=93,
        audio_end_token_id=94, user_token_id=95, vision_start_token_id=96),  # its forward reads it (no default)
    # Qwen3-Omni-MoE's thinker: M-RoPE mixture-of-experts text model, DeepStack vision tower, audio encoder
    "qwen3_omni_moe_thinker": dict(
        text_config=dict(SIZES, **MROPE, moe_intermediate_size=40, num_experts=4, num_experts_per_tok=2),
        vision_config=dict(PATCH_MERGER_VISION, deepstack_visual_indexes=[0], num_position_embeddings=16),
        audio_config=dict(num_mel_bins=8, encoder_layers=1, encoder_attention_heads=4, encoder_ffn_dim=40, d_model=32,
                          output_dim=32, max_source_positions=16, n_window=4, n_window_infer=8, conv_chunksize=4,
                          downsample_hidden_size=8),
        audio_token_id=90, image_token_id=91, video_token_id=92, audio_start_token_id=93, user_token_id=95,
        vision_start_token_id=96),
    # ERNIE 4.5 VL: text and vision experts (two expert widths), a dense then a sparse layer, M-RoPE
    "ernie4_5_vl_moe": dict(
        text_config=dict(SIZES, **MROPE, moe_intermediate_size=[40, 24], moe_k=2, moe_num_experts=4,
                         moe_num_shared_experts=1),
        vision_config=dict(depth=1, hidden_size=32, num_heads=4, intermediate_size=40, patch_size=4),
        image_start_token_id=90, image_end_token_id=91, image_token_id=92, video_start_token_id=93,
        video_end_token_id=94, video_token_id=95),
    # Granite 4 Vision: a window Q-Former projector (heads: the tower's width / 64), features injected into layer 0
    "granite4_vision": dict(
        text_config=SIZES, vision_config=dict(model_type="clip_vision_model", hidden_size=64, intermediate_size=40,
                                              num_hidden_layers=2, num_attention_heads=4, image_size=16, patch_size=8),
        qformer_config=dict(intermediate_size=40), downsample_rate="1/2", deepstack_layer_map=[[0, 0]],
        spatial_target_layers=[0, 1, 0, 1], image_grid_pinpoints=[[16, 16]], image_seq_length=4, image_token_index=98),
    # Granite-Docling: DeepStack from the tower's layer 0; the tower's output at the text width
    "granite_docling": dict(text_config=SIZES, vision_config=dict(
        TINY_VISION, patch_size=8, out_hidden_size=32, scale_factor=2, deepstack_visual_indexes=[0]), image_token_id=98,
        pad_token_id=0),
    # DeepSeek-VL hybrid: a Llama text model, a SigLIP tower and a SAM high-resolution tower (GOT-OCR2's sizes)
    "deepseek_vl_hybrid": dict(
        text_config=dict(SIZES, model_type="llama"), image_token_id=98,
        vision_config=dict(TINY_VISION, model_type="siglip_vision_model", patch_size=8),
        high_res_vision_config=dict(model_type="sam_vision_model", hidden_size=32, output_channels=16,
                                    num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8,
                                    window_size=2, global_attn_indexes=[1], mlp_dim=40)),
    # DeepSeek-OCR-2: a DeepSeek-MoE text model (a dense, then a sparse layer); a SAM tower, then a Qwen2-like encoder
    "deepseek_ocr2": dict(
        text_config=dict(SIZES, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=40,
                         mlp_layer_types=["dense", "sparse"]), image_token_id=98,
        vision_config=dict(sam_config=dict(hidden_size=32, output_channels=16, num_hidden_layers=2,
                                           num_attention_heads=4, image_size=32, patch_size=8, window_size=2,
                                           global_attn_indexes=[1], mlp_dim=40, downsample_channels=[16, 32]),
                           encoder_config=dict(SIZES))),
    # Nemotron-H Omni: a Nemotron-H hybrid text model, a RADIO tower and a Parakeet audio encoder (its projector's
    # sizes read from the audio config: transformers 5.24 gives them no default)
    "nemotron_h_omni": dict(
        text_config=dict(SIZES, **EXTRA_SIZES, model_type="nemotron_h"), projector_hidden_size=40,
        vision_config=dict(model_type="radio", hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                           patch_size=8, image_size=16, max_img_size=32, num_cls_tokens=1, num_registers=1,
                           video_temporal_patch_size=2), vision_hidden_size=32,
        audio_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=40,
                          subsampling_conv_channels=8, num_mel_bins=16, projection_hidden_size=40,
                          projection_bias=False), image_token_id=98, video_token_id=97, audio_token_id=96),
    # BLIP-2: an OPT text model under a one-layer Q-Former of two queries
    "blip-2": dict(text_config=dict(SIZES, model_type="opt", ffn_dim=40, word_embed_proj_dim=32),
                   vision_config=dict(TINY_VISION, patch_size=8), num_query_tokens=2, image_token_index=98,
                   qformer_config=dict(TINY_STACK, num_hidden_layers=1, encoder_hidden_size=32, vocab_size=99)),
    "kosmos-2": dict(text_config=dict(vocab_size=99, embed_dim=32, layers=2, ffn_dim=40, attention_heads=4,
                                      max_position_embeddings=64), vision_config=dict(TINY_VISION, patch_size=8),
                     latent_query_num=2),
    # IDEFICS (1): a Llama with gated cross-attention to images every second layer, a perceiver resampler
    "idefics": dict(SIZES, vision_config=dict(embed_dim=32, image_size=16, intermediate_size=40, patch_size=8,
                                              num_hidden_layers=1, num_attention_heads=4), cross_layer_interval=2,
                    perceiver_config=dict(resampler_n_latents=2, resampler_depth=1, resampler_n_heads=2,
                                          resampler_head_dim=8)),
    # a ViT encoder and a GPT-2 decoder that cross-attends to it
    "vision-encoder-decoder": dict(encoder=dict(TINY_VISION, model_type="vit", patch_size=8), decoder=dict(
        SIZES, model_type="gpt2", n_embd=32, n_layer=2, n_head=4, n_positions=64, is_decoder=True,
        add_cross_attention=True)),
    # Florence-2: a BART text model under a one-stage DaViT tower
    "florence2": dict(text_config=dict(SIZES, **SEQ2SEQ_SIZES, model_type="bart"), image_token_id=98, vision_config=dict(
        depths=[1], patch_size=[7], patch_stride=[4], patch_padding=[3], patch_prenorm=[False], embed_dim=[32],
        num_heads=[4], num_groups=[4], window_size=2, projection_dim=32)),
    # Unlimited-OCR: DeepSeek-OCR-2's text model with sliding windows (its forward fails with 2 key/value heads of 4:
    # as many as query heads); a SAM tower and a CLIP-like encoder
    "unlimited_ocr": dict(
        text_config=dict(SIZES, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=40,
                         mlp_layer_types=["dense", "sparse"], sliding_window=4, num_key_value_heads=4), image_token_id=98,
        vision_config=dict(sam_config=dict(hidden_size=32, output_channels=16, num_hidden_layers=2,
                                           num_attention_heads=4, image_size=32, patch_size=8, window_size=2,
                                           global_attn_indexes=[1], mlp_dim=40, downsample_channels=[16, 32]),
                           encoder_config=dict(TINY_VISION, patch_size=8))),
    # PP-FormulaNet: a SAM tower and an mBART-like decoder
    "pp_formulanet": dict(text_config=dict(SIZES, **SEQ2SEQ_SIZES), vision_config=dict(
        hidden_size=32, output_channels=16, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8,
        window_size=2, global_attn_indexes=[1], mlp_dim=40, post_conv_in_channels=16, post_conv_out_channels=32,
        post_conv_mid_channels=16, decoder_hidden_size=32)),
    # session 38, mm38a: the image-only wrappers --multimodal refuses ("inputs"), at their smallest: Pix2Struct and UDOP
    # are built for the probe that refuses them; the sweep refuses InstructBLIP and PI0 by their forward's signature
    # before building, their sizes are for checking by hand what a user gets (tests/test_pixel_only_wrappers.py)
    # InstructBLIP (and its video form): a Llama text model under a one-layer Q-Former of two queries
    **{t: dict(text_config=dict(SIZES, model_type="llama"), vision_config=dict(TINY_VISION, patch_size=8),
               num_query_tokens=2, image_token_index=98,
               qformer_config=dict(TINY_STACK, num_hidden_layers=1, encoder_hidden_size=32, vocab_size=99))
       for t in ("instructblip", "instructblipvideo")},
    # PI0: a PaliGemma (a Gemma and a SigLIP tower) and a Gemma action expert (its DiT), each at its smallest
    "pi0": dict(vlm_config=dict(text_config=dict(SIZES, model_type="gemma"), vision_config=dict(
        TINY_VISION, model_type="siglip_vision_model", patch_size=8, vision_use_head=False), projection_dim=32,
        image_token_id=98), dit_config=dict(SIZES, model_type="gemma"), chunk_size=4, max_state_dim=8,
        max_action_dim=8),
    # Pix2Struct: a T5-like text decoder and a patch-sequence vision encoder, both at their smallest
    "pix2struct": dict(text_config=dict(vocab_size=99, hidden_size=32, d_kv=8, d_ff=40, num_layers=2, num_heads=4),
                       vision_config=dict(hidden_size=32, patch_embed_hidden_size=32, d_ff=40, d_kv=8,
                                          num_hidden_layers=1, num_attention_heads=4, seq_len=16)),
    # UDOP: its T5 text sizes come from SEQ2SEQ_SIZES; a 16-pixel image of 8-pixel patches
    "udop": dict(image_size=16, patch_size=8),
    # session 38, mm38b: PerceptionLM's and FastVLM's towers are timm models (timm is not installed): a CLIP tower of
    # the projector's input width stands in (idle on token ids); their wrappers' text path is what is checked
    "perception_lm": dict(text_config=dict(SIZES, model_type="llama"), vision_config=dict(
        TINY_VISION, model_type="clip_vision_model", patch_size=8, model_args={"embed_dim": 32}), image_token_id=98),
    "fast_vlm": dict(text_config=dict(SIZES, model_type="qwen2"), vision_config=dict(
        TINY_VISION, model_type="clip_vision_model", patch_size=8), image_token_id=98),
}
# parameters a type's _init_weights sets to zero that the checks need drawn (an output projection at zero: masking would
# change nothing); NeoMME's value embeddings stay at zero, so that zeroing a key/value head's v_proj rows zeroes its
# values (tests/test_neomme.py checks them drawn)
ZERO_INITIALISED: dict[str, tuple[str, ...]] = {
    "neomme": ("output_projection.o_proj.weight", "mlp.down_proj.weight", "exclusive_self_attention.alpha"),
}
SKIPPED: dict[str, str] = {  # types left out, and why (printed instead of a build error)
    # skip27B
    "voxtral_realtime": "a streaming speech model: its forward needs audio features (input_features) at every step, "
                        "none on token ids alone (headlab refuses it so: adapters.families.UNSUPPORTED)",
    "xlstm": "no attention: xLSTM's mLSTM blocks are recurrent",
    # skip27A
    "gemma3n": "its vision tower is a timm model (timm is not installed); its text model is swept as gemma3n_text",
    # wrappers whose configs the generic builder cannot shrink (their validators tie sizes together), each checked on a
    # tiny model by a test file of its own
    "glm5_next": "checked by tests/test_mla_pruning.py and tests/test_multimodal_towers.py (a config of its own)",
    "hy_v4_vl": "checked by tests/test_hy_v4_vl.py and tests/test_lrp_hyper_connections.py (a config of its own)",
    "mistral_large4": "checked by tests/test_mla_pruning.py, tests/test_lrp_latent_attention.py and "
                      "tests/test_saved_class.py (shared key/value layers and an indexer: a config of its own)",
    **{t: "a drafter for speculative decoding: it ignores input_ids and attends to the target model's shared keys "
          "and values (shared_kv_states), so nothing runs on token ids alone" for t in (
        "gemma4_assistant", "gemma4_unified_assistant")},
}
AUTOS = (tf.AutoModelForSeq2SeqLM, tf.AutoModelForMaskedLM, tf.AutoModelForCausalLM)  # the first that has one
ZERO = "sweep_zero_heads"  # the attention function of the mask check's reference


VARIANT: dict = {}  # config attributes every build sets (experiments/variant_sweep.py: one flag at a time)
CAUSAL_FIRST = False  # --causal-first: the causal-LM class where a type has several
MULTIMODAL = False  # --multimodal: the types whose only text-generating class is an image-text-to-text wrapper
ATTN_IMPLEMENTATION: str | None = None  # --attn-implementation: the models checked loaded so (None: SDPA where it runs)
IMPLEMENTATIONS = ("sdpa", "eager", "flex_attention")
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HALF = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Tolerance:
    """How far two ways to the same numbers may lie apart: ``atol``, plus for attention maps ``map_rtol`` times each
    reference weight, plus for logits ``logit_rel`` times the reference's largest magnitude (at least 1)."""

    atol: float
    map_rtol: float = 0.0
    logit_rel: float = 0.0

    def at_least(self, atol: float) -> Tolerance:
        return replace(self, atol=max(self.atol, atol))


def tolerance_for(dtype: torch.dtype) -> Tolerance:
    """The sweep's bounds in ``dtype``. float64 and float32: the sweep's own, 1e-9 and 1e-5 absolute.

    Half precision (``--dtype bfloat16`` / ``float16``) reuses the bounds the library and its tests already hold half
    precision to, none new. Each check compares two ways to the same numbers (SDPA's weights and eager's, a gate at
    zero and the heads' outputs or values zeroed, a sliced model and a masked one): they differ by the rounding of
    reordered sums, a few eps per operation carried through the layers after it, where a wrong head moves a result
    by that head's contribution.

    * attention maps (capture): torch.testing.assert_close's defaults for the dtype, as tests/test_cuda_families.py
      compares a bfloat16 capture with output_attentions: ``|a - b| <= 1e-5 + rtol * |b|``, rtol 1.6e-2 for
      bfloat16 (2 eps), 1e-3 for float16 (1 eps);
    * logits (mask, prune): headlab.prune_check.tolerance, the bound prune_heads checks itself against in the
      model's dtype (and tests/test_cuda_families.py's pruning bound): ``sqrt(eps) * max(|reference|, 1)``, 0.088
      for bfloat16, 0.031 for float16;
    * gates at one: equal to the bit, in every dtype (a gate of one multiplies exactly);
    * LRP: run in the precision the library picks for the model (``importance.lrp.lrp_precision``: compute_lrp
      widens a half-precision model, its weights unchanged) and held to the bound of that precision's run.
    """
    if dtype in HALF:
        from torch.testing._comparison import default_tolerances

        rtol, atol = default_tolerances(dtype)
        return Tolerance(atol, map_rtol=rtol, logit_rel=prune_tolerance(dtype))
    return Tolerance(1e-9 if dtype == torch.float64 else 1e-5)


class Timeout(Exception):
    pass


class Fail(Exception):
    """A check found a silent wrong result."""

    def __init__(self, check: str, message: str):
        super().__init__(f"{check}: {message}")
        self.check = check


def model_class(config_class):
    if MULTIMODAL:  # those the walk over AUTOS never reaches
        return None if first_class(config_class, AUTOS) is not None \
            else first_class(config_class, (tf.AutoModelForImageTextToText,))
    return first_class(config_class, tuple(reversed(AUTOS)) if CAUSAL_FIRST else AUTOS)


def matrix_types() -> set[str]:
    """The model types of the test matrix (tests/support), built from their configs only."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from support import discovered, family_matrix, models

    types = set()
    for table in (models.CONFIGS, family_matrix.ANALYSED, family_matrix.PRUNING, family_matrix.SHARED,
                  family_matrix.HYBRID, family_matrix.REFUSED, discovered.DISCOVERED):
        for build in table.values():
            types.add(build()[1].model_type)
    # tests/test_refused_families.py (mpnet, xlm, flaubert and tapas since session 30: their own test files)
    types |= {"xlm", "flaubert", "mpnet", "tapas", "nystromformer", "trocr", "longformer", "mra", "yoso",
              "bigbird_pegasus", "led"}  # led: tests/test_led.py (session 31)
    types |= {"mvp"}  # tests/test_mvp_prophetnet_pegasus_x.py (session 31)
    types |= {"prophetnet"}  # tests/test_prophetnet.py (session 41; refused from session 31)
    types |= {"pegasus_x"}  # tests/test_pegasus_x.py (session 40)
    types |= {"longt5"}  # tests/test_longt5.py (session 32)
    types |= {"squeezebert"}  # tests/test_squeezebert_ibert.py (session 31; I-BERT is in family_matrix.ANALYSED)
    types |= {"deepseek_v32", "glm_moe_dsa"}  # tests/test_sparse_attention.py
    types |= {"cpmant", "diffllama", "jetmoe", "hrm_text"}  # tests/test_refused_families.py (session 32)
    types |= {"hy_v4", "qwen4_exp_text"}  # tests/test_hyper_connection_families.py (session 36)
    return types


def _text_defaults(config_class) -> dict:
    """For a composite config whose text_config is given as a dict: its default text model's ``model_type`` (an
    AutoConfig sub-config needs it) and, where it has layer types, two of them (one that is not attention first,
    then full attention), with a small sliding window."""
    try:
        text = config_class().get_text_config()
    except Exception:  # noqa: BLE001 - a config without defaults: nothing to add
        return {}
    found: dict = {"model_type": text.model_type}
    kinds = sorted(set(getattr(text, "layer_types", None) or ()))
    if "full_attention" in kinds:
        other = next((k for k in kinds if "attention" not in k or k.startswith("linear")), "sliding_attention")
        found.update(layer_types=[other if other in kinds else "full_attention", "full_attention"], sliding_window=4)
    return found


def with_variant(config_class, sizes: dict) -> dict:
    """``sizes`` with ``VARIANT`` (experiments/variant_sweep.py) set in them, in a composite config's text_config."""
    if not VARIANT:
        return sizes
    if "text_config" not in getattr(config_class, "sub_configs", {}):
        return {**sizes, **VARIANT}
    text = sizes.get("text_config")
    return {**sizes, "text_config": {**(text if isinstance(text, dict) else {}), **VARIANT}}


def variant_kept(model) -> None:
    """A ValueError where the config the model runs on does not hold ``VARIANT`` (Qwen2's sliding_window is None
    without use_sliding_window): a variant the config dropped would be the baseline, counted as its pass."""
    config = model.config.get_text_config()
    for key, value in VARIANT.items():
        if getattr(config, key, UNSET) != value:
            raise ValueError(f"the config keeps {key}={getattr(config, key, None)!r}, not {value!r}")


def _gist(error: Exception) -> str:
    """An error's first line, and its last where it has several (a config validator's reason, after a module's repr)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if len(lines) <= 1:
        return lines[0][:100] if lines else ""
    return f"{lines[0][:60]} ... {lines[-1][:120]}"


def build(config_class, cls, implementation: str, dtype: torch.dtype):
    """The tiny model, biases, norm weights and learned attention sinks moved off their initial values (so that
    they count)."""
    errors = []
    no_head_dim = {k: v for k, v in SIZES.items() if k != "head_dim"}  # a config whose head_dim is a property
    # a composite config (a vision-language wrapper): the tiny sizes in its text_config, its tower at its smallest
    own = _text_defaults(config_class)
    wrapped = [{"text_config": text, "vision_config": vision}
               for text in ({**SIZES, **EXTRA_SIZES, **MROPE, **own}, {**SIZES, **MROPE, **own},
                            {**SIZES, **EXTRA_SIZES, **own}, {**SIZES, **own}, {**SIZES, **EXTRA_SIZES, **MROPE},
                            {**SIZES, **MROPE}, {**SIZES, **EXTRA_SIZES}, SIZES)
               for vision in (dict(TINY_VISION, patch_size=8), TINY_VISION, PATCH_MERGER_VISION,
                              {k: v for k, v in PATCH_MERGER_VISION.items() if k != "embed_dim"})] \
        if {"text_config", "vision_config"} <= set(getattr(config_class, "sub_configs", {})) else []
    for sizes in ({**SIZES, **SEQ2SEQ_SIZES, **GPT_SIZES, **EXTRA_SIZES}, {**SIZES, **SEQ2SEQ_SIZES, **EXTRA_SIZES},
                  {**SIZES, **SEQ2SEQ_SIZES, **GPT_SIZES}, {**SIZES, **SEQ2SEQ_SIZES}, SIZES,
                  {**no_head_dim, **SEQ2SEQ_SIZES, **GPT_SIZES}, no_head_dim, *wrapped):
        sizes = {k: v for k, v in {**sizes, **OVERRIDES.get(config_class.model_type, {})}.items() if v is not UNSET}
        sizes = with_variant(config_class, sizes)
        try:
            model = tiny(config_class, cls, sizes, implementation)
            if model is not None:
                variant_kept(model)
        except Exception as error:  # noqa: BLE001 - any config: reported
            errors.append(f"{type(error).__name__}: {_gist(error)}")
            continue
        if model is not None:
            break
        errors.append(TOO_LARGE)
    else:
        return None, "; ".join(dict.fromkeys(errors))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or "norm" in name.lower():
                parameter.add_(torch.randn_like(parameter) * 0.1)
            elif name.endswith(".sinks"):  # learned sinks start at zero, all alike: a head's taken for another's shows
                parameter.add_(torch.randn_like(parameter))
            elif name.endswith(ZERO_INITIALISED.get(config_class.model_type, ())):
                parameter.add_(torch.randn_like(parameter) * 0.5)
    return as_loaded(model, dtype), ""


def as_loaded(model, dtype: torch.dtype):
    """``model`` in ``dtype`` as ``from_pretrained(..., dtype=dtype)`` gives it (what load_model hands headlab): cast,
    except the parameters its class keeps in float32 in half precision (``_keep_in_fp32_modules_strict``, and
    ``_keep_in_fp32_modules`` in float16: transformers' ``_get_dtype_plan``, matched as its loader matches them),
    and ``config.dtype`` set, its sub-configs' too."""
    model.to(dtype)
    plan = model._get_dtype_plan(dtype) if hasattr(model, "_get_dtype_plan") else {}
    if plan:
        from transformers.core_model_loading import build_glob_alternation

        pattern, groups, _ = build_glob_alternation(list(plan))
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor.is_floating_point() and (found := pattern.search(name)) is not None and found.lastgroup:
                tensor.data = tensor.data.to(plan[groups[found.lastgroup]])
    for config in (model.config, *(getattr(model.config, key, None) for key in model.config.sub_configs)):
        if config is not None:
            config.dtype = dtype
    return model


def probe_length(model) -> tuple[int, int]:
    """(length, right padding of row 1) of the probe inputs: 7 and 2; block-sparse BigBird's longer (on inputs up to
    (5 + 2 r) x block_size tokens transformers runs full attention, and headlab refuses them), padded within its last
    block (headlab refuses a sentence whose padding changes its blocks)."""
    sparse = block_sparse_probe(model)
    return (7, 2) if sparse is None else sparse[:2]


def inputs_for(model) -> dict:
    g = torch.Generator().manual_seed(1)
    length, pads = probe_length(model)
    ids = torch.randint(3, 99, (2, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, length - pads:] = 0
    inputs = {"input_ids": ids, "attention_mask": mask}
    if getattr(model.config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = torch.randint(3, 99, (2, 5), generator=g)
    return inputs


def teacher_forced(model) -> dict:
    """No cache for an encoder-decoder's teacher-forced pass: FSMT builds its decoder's causal mask only without one
    (transformers 5.24; with use_cache, its config's default, each target token attends to the later ones)."""
    return {"use_cache": False} if getattr(model.config, "is_encoder_decoder", False) else {}


def logits(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs, **teacher_forced(model)).logits


def check_padding(model, inputs, atol: Tolerance) -> None:
    """The right-padded row of the probe (row 1, as headlab's batchers pad: ``data.inputs._pad``) gives at its tokens
    the logits it gives alone: a sentence's results must not depend on its batch (ConvBERT's convolutions read the
    padding; BigBird's blocks follow the padded length: both found so, session 40). After the blocks were found, so
    that what headlab installs on a model (BigBird's guard) runs."""
    mask = inputs["attention_mask"]
    length = int(mask[1].sum())
    # the pad id where headlab's batches hold it (MobileBERT's trigram embeddings read the next token's embedding)
    pad, vocab = config_value(model.config, "pad_token_id"), config_value(model.config, "vocab_size")
    if isinstance(pad, int) and isinstance(vocab, int) and 0 <= pad < vocab:
        inputs = {**inputs, "input_ids": inputs["input_ids"].masked_fill(mask == 0, pad)}
    alone = {k: (v[1:2, :length] if k in ("input_ids", "attention_mask") else v[1:2]) for k, v in inputs.items()}
    batched, single = logits(model, inputs)[1:2], logits(model, alone)
    if not getattr(model.config, "is_encoder_decoder", False):  # the decoder's positions are the source's own
        batched = batched[:, :length]
    ok, diff = close(batched, single, atol)
    if not ok:
        raise Fail("padding", f"the right-padded row's logits differ from the row alone by {diff:.3g} "
                              f"(atol {atol.atol:g}, relative {atol.logit_rel:g})")


def close(a: torch.Tensor, b: torch.Tensor, atol: float | Tolerance, kind: str = "logits") -> tuple[bool, float]:
    """Whether ``a`` is ``b`` within the tolerance (a float: an absolute bound), and their largest difference (NaN or
    inf in either, unless equal, counts as an infinite difference: never accepted)."""
    if a.shape != b.shape:
        return False, float("inf")
    if not a.numel():
        return True, 0.0
    tol = atol if isinstance(atol, Tolerance) else Tolerance(atol)
    a, b = a.double(), b.double()
    diff = torch.where(a == b, 0.0, (a - b).abs().nan_to_num(nan=float("inf")))
    if kind == "maps":  # element by element, relative to the reference's weight (torch.testing.assert_close's rule)
        bound = tol.atol + tol.map_rtol * b.abs()
    else:  # relative to the reference's largest magnitude, at least 1 (headlab.prune_check's rule)
        bound = torch.tensor(tol.atol + tol.logit_rel * max(b.abs().nan_to_num(posinf=0, neginf=0).max().item(), 1.0))
    return bool((diff <= bound).all()), diff.max().item()


def reference_maps(model, inputs) -> tuple[dict[str, tuple], set[int]]:
    """transformers' own maps by kind, and the indices of those worked out from them (learned sinks)."""
    with torch.no_grad():
        out = model(**inputs, output_attentions=True, **teacher_forced(model))
    if model.config.model_type == "led":  # its encoder's band (and global rows) scattered into [batch, heads, q, k]
        from support.longformer import dense_maps

        encoder = dense_maps(out.encoder_attentions, out.encoder_global_attentions,
                             inputs.get("global_attention_mask"), model.config.attention_window)
        return {"enc_self": encoder, "dec_self": out.decoder_attentions, "dec_cross": out.cross_attentions}, set()
    if model.config.model_type == "longt5":  # its encoder's local windows put in place in [batch, heads, q, k] (the
        # transient-global encoder's side keys after them left out)
        from support.longt5 import dense_maps as longt5_maps

        windows = [a[..., :3 * a.shape[3]] for a in out.encoder_attentions]
        encoder = longt5_maps(windows, inputs["input_ids"].shape[1], inputs.get("attention_mask"))
        return {"enc_self": encoder, "dec_self": out.decoder_attentions, "dec_cross": out.cross_attentions}, set()
    if model.config.model_type == "pegasus_x":  # its encoder's blocks put in place, the global tokens' share left out
        from support.pegasus_x import dense_maps as pegasus_x_maps

        staggered = [layer.stagger_blocks_this_layer for layer in model.get_encoder().layers]
        encoder = pegasus_x_maps(out.encoder_attentions, inputs["input_ids"].shape[1], model.config.block_size,
                                 staggered, inputs.get("attention_mask"))
        return {"enc_self": encoder, "dec_self": out.decoder_attentions, "dec_cross": out.cross_attentions}, set()
    if any(type(m).__name__.endswith("BlockSparseAttention") for m in model.modules()):  # BigBird's (BigBird-Pegasus's
        # encoder's): its map worked out by hand (its dense output_attentions overwrites the random blocks' weights on
        # the first block's keys)
        from support.big_bird import dense_maps as big_bird_maps

        if getattr(model.config, "is_encoder_decoder", False):
            return {"enc_self": big_bird_maps(model, inputs), "dec_self": out.decoder_attentions,
                    "dec_cross": out.cross_attentions}, set()
        return {"any": big_bird_maps(model, inputs)}, set()
    if model.config.model_type == "prophetnet" and getattr(model.config, "is_encoder_decoder", False):
        # ProphetNetAttention hands out its masked scores (before its softmax) as encoder_attentions and
        # cross_attentions, the latter a row per query of every stream [main | ngram predicting]; decoder_attentions
        # are the main stream's probabilities (transformers 5.24): the maps are the main stream's (session 41)
        streams = 1 + model.config.ngram
        return {"enc_self": tuple(torch.softmax(a, dim=-1) for a in out.encoder_attentions),
                "dec_self": out.decoder_attentions,
                "dec_cross": tuple(torch.softmax(a, dim=-1)[:, :, :a.shape[2] // streams] for a in out.cross_attentions)
                }, set()
    if getattr(model.config, "is_encoder_decoder", False):
        return {"enc_self": out.encoder_attentions, "dec_self": out.decoder_attentions,
                "dec_cross": out.cross_attentions}, set()
    if any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in model.modules()):
        # learned sinks: the weights the values get (Granite-SWA's output_attentions is the softmax before its
        # sink, the output scaled after), worked out from output_attentions, the sinks and the logits
        from support.family_matrix import attentions_applied_to_values

        applied, derived = attentions_applied_to_values(model, inputs)
        return {"any": applied}, derived
    if model.config.model_type == "longformer":  # its band (and global rows) scattered into [batch, heads, q, k]
        from support.longformer import dense_maps

        return {"any": dense_maps(out.attentions, out.global_attentions, inputs.get("global_attention_mask"),
                                  model.config.attention_window)}, set()
    if model.config.model_type == "squeezebert":
        # SqueezeBERT hands out its attention scores (q k^T / sqrt(d) + mask, before its nn.Softmax(dim=-1)) as
        # attentions (transformers 5.24): its probabilities are their softmax
        return {"any": tuple(torch.softmax(a, dim=-1) for a in out.attentions)}, set()
    return {"any": out.attentions}, set()


def check_idle(model, blocks, inputs) -> list[str]:
    """The blocks headlab calls idle (a tower or a cross-attention that token ids never reach: left out of every
    measure, their pruning refused) really do not run on token ids; the checks after this one leave them out."""
    ran: list[str] = []
    handles = [b.module.register_forward_pre_hook(lambda *_, name=b.name: ran.append(name)) for b in blocks if b.idle]
    try:
        logits(model, inputs)
    finally:
        for handle in handles:
            handle.remove()
    if ran:
        raise Fail("idle", f"{sorted(set(ran))} called idle, but a forward on token ids runs them")
    idle = [b for b in blocks if b.idle]
    return [f"{len(idle)} idle ({', '.join(sorted({b.kind for b in idle}))})"] if idle else []


def check_capture(eager, model, blocks, inputs, atol: Tolerance) -> None:
    reference, derived = reference_maps(eager, inputs)
    with capture_attention(model) as record:
        logits(model, inputs)
    if not getattr(model.config, "is_encoder_decoder", False):  # a causal LM's cross-attention does not run
        blocks = [b for b in blocks if b.kind != "dec_cross"]
    if sorted(record) != sorted(b.key for b in blocks):
        raise Fail("capture", f"captured {sorted(record)} for blocks {sorted(b.key for b in blocks)}")
    for kind in ("enc_self", "dec_self", "dec_cross"):
        keys = sorted(b.key for b in blocks if b.kind == kind)
        maps = reference.get(kind, reference.get("any") if "any" in reference else None)
        if not keys:
            continue
        if "any" in reference and len({b.kind for b in blocks}) > 1:
            raise Fail("capture", f"kinds {sorted({b.kind for b in blocks})} in a model with one attentions tuple")
        maps = tuple(maps or ())
        indices = list(range(len(maps)))
        if len(maps) != len(keys) and len(maps) > max(layer for _, layer in keys):
            indices = [layer for _, layer in keys]  # one entry per layer (hybrids): the attention layers'
        indices = [i for i in indices if maps[i] is not None]
        if len(indices) != len(keys):
            raise Fail("capture", f"{kind}: {len(keys)} blocks but output_attentions gives {len(indices)} maps")
        for key, i in zip(keys, indices):
            reference_map = maps[i]
            # a map worked out in float64 from a float32 softmax and sink scale (Granite-SWA's): float32's precision
            ok, diff = close(record[key], reference_map, atol.at_least(1e-6) if i in derived else atol, "maps")
            if not ok:
                what = "the weights the values get (output_attentions, sinks)" if i in derived else "output_attentions"
                raise Fail("capture", f"{key} differs from {what} by {diff:.3g}")
            # the kind against the attention transformers computed: dec_self causal, enc_self not (row 0: no padding)
            future = torch.triu(reference_map[0].abs().sum(0), diagonal=1).sum().item()
            if kind == "dec_self" and future > 0 or kind == "enc_self" and future == 0:
                raise Fail("kind", f"{key}: the attention is {'not ' if future > 0 else ''}causal")


_TARGET: dict[int, list[int]] = {}  # id(core module) -> heads whose output the reference zeroes
_CALLED: list = []  # the target modules that called the reference's attention function


def _zeroing(implementation: str):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def attend(module, query, key, value, attention_mask, *args, **kwargs):
        inner = ALL_ATTENTION_FUNCTIONS[implementation] if implementation != "eager" else _eager(module)
        indices = kwargs.pop("indices", None)
        if indices is not None:  # DeepSeek Sparse Attention hands any function but eager/SDPA its top-k keys
            attention_mask = _fold_indices(attention_mask, indices, key.shape[2], query.dtype)
        out, weights = inner(module, query, key, value, attention_mask, *args, **kwargs)
        heads = _TARGET.get(id(module))
        if heads:
            _CALLED.append(module)
            out = out.clone()
            out[:, :, heads] = 0  # [batch, q, heads, d]
        return out, weights
    return attend


def _fold_indices(mask, indices, k_len: int, dtype):
    """The keys the indexer did not pick hidden, as DeepseekV32Attention.forward does for eager/SDPA."""
    hidden = torch.ones(*indices.shape[:2], k_len, dtype=torch.bool, device=indices.device)
    hidden = hidden.scatter(-1, indices.long(), False).unsqueeze(1)
    return mask & ~hidden if mask.dtype == torch.bool else mask.masked_fill(hidden, torch.finfo(dtype).min)


def _eager(module):
    """The module's own eager attention function (the one its modeling file defines)."""
    return sys.modules[type(module).__module__].eager_attention_forward


def float32_attention(model) -> bool:
    """Whether an attention module's own eager function scales its output by a factor it takes in float32 whatever
    the model's dtype (Granite-SWA's sink scale, ``.to(torch.float32).sigmoid()``): a float64 model is then only
    float32-exact there, and two ways to the same logits (pruned, masked) may round it apart by ~1e-8. (The float32
    softmax of most eager functions is cast back before the values: it has not shown such a difference.)"""
    import inspect

    from headlab.adapters.families import SUB_NORMS

    if any(SUB_NORMS.get(type(module).__name__) == "rms" for module in model.modules()):
        return True  # BitNet's attn_sub_norm normalises in float32 whatever the dtype: pruning rescales it
    for module in model.modules():
        function = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if hasattr(module, "config") and callable(function) and \
                re.search(r"\.to\(torch\.float32\)\.sigmoid\(\)", inspect.getsource(function)):
            return True
    return False


def register_zeroing(implementation: str) -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    name = f"{ZERO}_{implementation}"
    AttentionInterface.register(name, _zeroing(implementation))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[implementation])
    return name


def value_rows(block, kv_head: int):
    """Zero the value weights (and bias) of ``kv_head`` of ``block``'s own value projection (of its
    fused projection: the columns headlab's layout table gives, the table families' hand-read layouts
    being tested in tests/test_more_families.py)."""
    v = block.v if block.v is not None else block.qkv
    if type(v).__name__ == "HeadPoint":  # XLNet: its bare value parameter (d_model, n_head, d_head), modeling_xlnet's
        with torch.no_grad():
            block.core.v[:, kv_head] = 0
        return
    entries = torch.arange(kv_head * block.d_head, (kv_head + 1) * block.d_head)
    rows = entries if block.v is not None else block.qkv_columns()[2].reshape(-1)[entries]
    with torch.no_grad():
        # a value bias the forward adds after the fused projection (DeBERTa v1's v_bias: Family.head_biases)
        for path, part in block.family.head_biases:
            owner, _, name = path.rpartition(".")
            if part == "v":
                getattr(block.module.get_submodule(owner), name)[entries] = 0
        if is_linear(v) or isinstance(v, torch.nn.Conv1d):  # [out, in] (I-BERT's QuantLinear too), [out, in / g, 1]
            v.weight[rows] = 0
        else:  # Conv1D: weight [in, out]
            v.weight[:, rows] = 0
        if getattr(v, "bias", None) is not None:
            v.bias[rows] = 0
        # projections whose rows are values of the heads too (Family.head_row_values: Zamba 2's value adapters, added
        # to v_proj's output; Longformer's value_global), each head's rows as Family.head_rows sizes them
        sizes = dict(block.family.head_rows)
        for path in block.family.head_row_values:
            width = rows_per_head(block.core, sizes[path])
            assert width is not None  # checked when the block was made (adapters._check_head_rows)
            block.module.get_submodule(path).weight[kv_head * width:(kv_head + 1) * width] = 0


def check_mask(make, blocks, inputs, atol: Tolerance, implementation) -> list[str]:
    notes = []
    targets = {}
    for block in blocks:
        targets[block.kind] = block  # the last block of each kind
    if not getattr(make().config, "is_encoder_decoder", False):
        targets.pop("dec_cross", None)  # a causal LM's cross-attention does not run
    for kind, block in targets.items():
        if block.n_heads == 0:
            continue
        group = block.n_heads // max(block.n_kv_heads, 1)
        kv = max(block.n_kv_heads, 1) - 1
        heads = list(range(kv * group, (kv + 1) * group))
        model = make()
        blocks_here = attention_blocks(model)
        here = next(b for b in blocks_here if b.key == block.key)
        before = logits(model, inputs)
        with mask_heads(model, {block.key: heads}):
            masked = logits(model, inputs)
        if not torch.equal(logits(model, inputs), before):
            raise Fail("mask", f"{block.key}: the mask did not come off")
        if torch.equal(masked, before):
            raise Fail("mask", f"{block.key} heads {heads}: masking changed nothing")
        # (a) the heads' outputs zeroed where the attention function returns them
        name = register_zeroing(implementation)
        configs = [c for c in _attention_configs(model)]
        saved = [c._attn_implementation for c in configs]
        _TARGET.clear()
        _CALLED.clear()
        _TARGET[id(here.core)] = heads
        try:
            for c in configs:
                c._attn_implementation = name
            zeroed = logits(model, inputs)
        finally:
            for c, s in zip(configs, saved):
                c._attn_implementation = s
            _TARGET.clear()
        if here.shared:  # the reference would zero the heads at every depth the module runs at
            notes.append(f"{kind}: attention-function reference n/a (shared layers)")
        elif not _CALLED:
            notes.append(f"{kind}: attention-function reference n/a (its core does not call the interface)")
        else:
            ok, diff = close(masked, zeroed, atol)
            if not ok:
                raise Fail("mask", f"{block.key} heads {heads}: masked differs from the heads' outputs zeroed in the "
                                   f"attention function by {diff:.3g}")
        # (b) the value weights zeroed by hand
        if here.shared:
            notes.append(f"{kind}: value reference n/a (shared layers: tests/test_shared_layers.py)")
        elif _tied(model, here):
            notes.append(f"{kind}: value reference n/a (its weights are tied to another depth's)")
        elif here.v is not None or here.qkv is not None:
            value_rows(here, kv)
            reference = logits(model, inputs)
            ok, diff = close(masked, reference, atol)
            if not ok:
                raise Fail("mask", f"{block.key} heads {heads}: masked differs from zeroed values by {diff:.3g}")
        else:
            notes.append(f"{kind}: no value projection named (value reference n/a)")
    return notes


def _tied(model, block) -> bool:
    """Whether the block's value weights are also held by another module (Zamba's shared transformer)."""
    projection = block.v if block.v is not None else block.qkv
    if projection is None:
        return False
    weight = getattr(projection, "weight", None)
    if weight is None:  # XLNet's point: its value parameter is the layer's own
        return False
    return sum(p is weight for _, p in model.named_parameters(remove_duplicate=False)) > 1


def _attention_configs(model):
    from headlab.adapters import attention_configs

    return attention_configs(model)


def check_own_nonfinite(make, blocks, inputs, own: torch.Tensor) -> str:
    """What headlab does with a model whose own logits (unmodified, before headlab does anything) are NaN or inf on
    the inputs: capture and pruning must refuse, naming it, never hand out maps or a pruned model computed from NaN
    (a Fail where they do); the row's message says where the model's own NaN lies and both refusals."""
    rows = sorted({int(r) for r in (~own.isfinite()).nonzero()[:, 0]})
    padded = [r for r in rows if not bool(inputs["attention_mask"][r].all())]
    found = [f"its own logits are NaN or inf in {str(own.dtype)[6:]} in rows {rows} ({len(padded)} of them padded)"]
    model = make()
    try:
        with capture_attention(model) as record:
            logits(model, inputs)
    except HeadlabError as error:
        found.append(f"capture refused: {str(error).splitlines()[0][:160]}")
    else:
        if any(not maps.isfinite().all() for maps in record.values()):
            raise Fail("capture", f"{found[0]}, and capture returned NaN or inf maps without refusing")
        found.append("capture: every map finite (the NaN arises after the attention)")
    spec = {b.key: [b.n_heads - 1] for b in blocks[:1] if b.n_heads >= 2}
    if spec:
        from headlab import prune_heads

        try:
            prune_heads(make(), spec)
        except HeadlabError as error:
            found.append(f"prune refused: {str(error).splitlines()[0][:160]}")
        else:
            raise Fail("prune", f"{found[0]}, and prune_heads accepted a pruning it could not compare there")
    return "; ".join(found)


def check_gates(model, inputs) -> None:
    before = logits(model, inputs)
    with gates_attached(model, ScalarGates.for_model(model)):
        if not torch.equal(logits(model, inputs), before):
            raise Fail("gates", "gates at one changed the logits")
    if any(m._forward_pre_hooks or m._forward_hooks for m in model.modules()):
        raise Fail("gates", "hooks left behind")


def check_prune(model, blocks, inputs, atol: Tolerance) -> str | None:
    from headlab import prune_heads

    spec: dict[tuple[str, int], list[int]] = {}
    for block in blocks:  # not an idle block (token ids never run it: its pruning is refused, rightly)
        if block.n_heads >= 2 and not block.idle and len(spec) < 2:
            spec[block.key] = [block.n_heads - 1]
    # weights run at several depths (ALBERT's shared layers, Inkling2-Loop's loop layers): the same heads removed at
    # each of them, which pruning equals (any other plan is refused before any work: surgery.check_shared_plan)
    for group in sharing_groups(blocks):
        chosen = next((spec[b.key] for b in group if b.key in spec), None)
        if chosen is not None:
            spec.update({b.key: list(chosen) for b in group if not b.idle})
    if not spec:
        return "no block to prune"
    with mask_heads(model, spec):
        masked = logits(model, inputs)
    try:
        prune_heads(model, spec)
    except HeadlabError as error:
        return f"prune refused: {str(error).splitlines()[0][:150]}"
    after = {b.key: b.n_heads for b in attention_blocks(model) if not b.idle}  # ``blocks``: the non-idle ones
    expected = {b.key: b.n_heads - len(spec.get(b.key, ())) for b in blocks}
    if after != expected:
        raise Fail("prune", f"head counts {after} after pruning, expected {expected}")
    ok, diff = close(logits(model, inputs), masked, atol)
    if not ok:
        raise Fail("prune", f"pruned differs from masked by {diff:.3g}")
    return None


def check_lrp(model, blocks, widen: torch.dtype | None = None) -> str | None:
    """Conservation on a bias-free copy; ``widen``: the precision a half-precision model is computed in, as
    compute_lrp widens it (its redrawn weights rounded to the model's dtype first, as a user's are)."""
    from headlab.capture import eager_attention
    from headlab.importance.rules import altup_inputs, check_rules, lrp_rules, per_layer_embeddings

    if getattr(model.config, "is_encoder_decoder", False):
        return "lrp not checked (sequence-to-sequence)"
    try:
        check_rules(model)
    except HeadlabError as error:
        return f"lrp refused: {str(error).splitlines()[0][:150]}"
    # the first layer: the first of the module list holding the block's closest numbered ancestor (its input is the
    # residual stream; a hybrid's layers before its first attention block, a Gated DeltaNet at 0, are crossed too)
    name = blocks[0].name
    layer = re.match(r"(.*?\.)\d+(?:\.|$)", name)
    first = model.get_submodule(layer.group(1) + "0") if layer else blocks[0].module
    if blocks[0].family.channels_first:  # SqueezeBertEncoder calls layer.forward (no hook runs): the encoder's input
        first = model.get_submodule((layer.group(1) + "0").rsplit(".", 2)[0]) if layer else first
    with torch.no_grad():
        for pname, parameter in model.named_parameters():
            if pname.endswith("bias"):
                parameter.zero_()
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0, module.in_features ** -0.5)
    seen, per_layer = [], []
    # Gemma 3n: its input embeddings, which its AltUp streams (the first layer's input) are made from
    handles = [next(iter(altup_inputs(model)), first).register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(args[0] if args else kwargs["hidden_states"]), with_kwargs=True)]
    # Gemma 3n's and Gemma 4's per-layer token embeddings: an input of their own, counted with the first layer's
    handles += [e.register_forward_hook(lambda module, args, output: per_layer.append(output))
                for e in per_layer_embeddings(model)]
    # a module that returns float32 in a float64 run (Beam's MLP evaluates act(gate) * up in float32, whatever the
    # model's dtype): its rounding, amplified by relevances that cancel across a layer, is float32's, not float64's
    # (and, in a widened half-precision model, a module that returns its original dtype: half precision's rounding)
    narrow: list[str] = []
    run = widen or next(model.parameters()).dtype
    if run == torch.float64 or widen is not None:
        def narrower(module, args, output) -> None:
            if isinstance(output, torch.Tensor) and output.is_floating_point() \
                    and torch.finfo(output.dtype).bits < torch.finfo(run).bits:
                narrow.append(f"{type(module).__name__} in {str(output.dtype).removeprefix('torch.')}")
        handles += [m.register_forward_hook(narrower) for m in model.modules()]
    head_out: list[torch.Tensor] = []  # the LM head's output: a cap in the config that the class never applies
    if isinstance(head := model.get_output_embeddings(), torch.nn.Module):
        handles.append(head.register_forward_hook(lambda module, args, output: head_out.append(output)))
    ids = torch.randint(3, 99, (1, probe_length(model)[0]), generator=torch.Generator().manual_seed(1))
    try:
        with _widened(model, widen) if widen else nullcontext(), torch.enable_grad(), eager_attention(model), \
                lrp_rules(model):
            # widened, the forward runs as compute_lrp runs it (importance.lrp.head_relevance): transformers' own
            # narrowings (.float(), float32 norms and softmax) kept at the widened precision
            narrow.clear()  # the explained forward's only, not lrp_rules' probes of single modules
            with _KeptWide(run):  # as compute_lrp's forward (importance.lrp.head_relevance), at every precision
                out = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
            target = out[0, -1].argmax()
            grads = torch.autograd.grad(out[0, -1, target], [seen[0], *per_layer])
    finally:
        for handle in handles:
            handle.remove()
    total = sum((x.detach() * g).sum().item() for x, g in zip([seen[0], *per_layer], grads))
    want = out[0, -1, target].item()
    # RecurrentGemma names its cap logits_soft_cap (tanh(logits / cap) * cap after its LM head)
    # a wrapper's in its text config (Muse Glimmer's, whose output_multiplier scales z first: z * m is what is capped)
    configs = (model.config, model.config.get_text_config())
    cap = next((getattr(c, name) for c in configs for name in ("final_logit_softcapping", "logits_soft_cap")
                if getattr(c, name, None)), None)
    # Gemma 3's multimodal wrapper leaves its text config's final_logit_softcapping unapplied (transformers 5.24): the
    # logit is the head's output
    if head_out and head_out[-1][0, -1, target].item() == out[0, -1, target].item():
        cap = None
    if cap:  # logit = cap * tanh(z / cap): z's relevance, every share scaled by dy/dz = 1 - tanh(z / cap)^2
        z = cap * math.atanh(want / cap)
        want = z * (1 - math.tanh(z / cap) ** 2)
    # float32 inside: compute_lrp's own tolerance (importance.lrp.CONSERVATION_TOLERANCE, recorded with every run)
    rtol = CONSERVATION_TOLERANCE if narrow else 1e-4
    if abs(total - want) > rtol * abs(want) + 1e-5:
        raise Fail("lrp", f"relevance at {first.__class__.__name__} sums to {total:.6g}, the logit is {want:.6g}"
                          + (f" ({', '.join(sorted(set(narrow)))})" if narrow else ""))
    return f"lrp: {', '.join(sorted(set(narrow)))} (conserved to {abs(total / want - 1):.1g}, " \
           f"within {rtol:g})" if narrow else None


def check_compute_lrp(model) -> str | None:
    """compute_lrp as a user calls it, on the model in the sweep's dtype (its weights and biases as built, three padded
    sentences): its own conservation check passes (a RunFailed is a FAIL: the rules conserved in check_lrp), every
    score is finite, and the model comes back in its own dtype to the bit; a refusal before any work is a note."""
    from headlab.data.inputs import translate_data
    from headlab.errors import RunFailed
    from headlab.importance import ImportanceData, compute_lrp, describe_model

    before: dict[str, torch.Tensor] = {}
    try:
        info = describe_model(model)
        # I-BERT's QuantEmbedding and MusicGen's codebooks (a ModuleList) hold no num_embeddings: the config's size
        vocab = getattr(model.get_input_embeddings(), "num_embeddings", None) or config_value(model.config, "vocab_size")
        # the tiny build's: a wrapper's config keeps the real checkpoint's pad id (Idefics3's 128002) over the tiny
        # vocabulary of 99
        if info.pad_id is not None and isinstance(vocab, int) and info.pad_id >= vocab:
            info = replace(info, pad_id=0)
        eos = min(info.eos_ids) if info.eos_ids else 1
        g = torch.Generator().manual_seed(0)
        data = ImportanceData.from_ids([torch.randint(3, 99, (k,), generator=g).tolist() + [eos] for k in (4, 6, 8)])
        if info.is_seq2seq:  # LRP explains the model's own translation (greedy, a few tokens), as the CLI runs it
            data = translate_data(model, data, info, max_length_a=0.5, max_length_b=3)
        # the model as compute_lrp gets it: NLLB-MoE's router casts its classifier to router_dtype (float32) in its
        # first forward, translate_data's (transformers' NllbMoeTop2Router._cast_classifier), not headlab
        before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        scores = compute_lrp(model, data, info, bootstrap=0)
    except RunFailed as error:
        raise Fail("lrp", f"compute_lrp: {str(error).splitlines()[0][:250]}") from error
    except HeadlabError as error:
        return f"compute_lrp refused: {str(error).splitlines()[0][:150]}"
    after = model.state_dict()
    if any(after[name].dtype != tensor.dtype or not torch.equal(after[name], tensor) for name, tensor in before.items()):
        raise Fail("lrp", "compute_lrp did not give the model back as it was (dtype or values)")
    for block in attention_blocks(model):  # every head's score finite (NaN marks only where no head is)
        if block.n_heads and not block.idle and block.kind in scores.scores and \
                not all(math.isfinite(v) for v in scores.scores[block.kind][block.layer, :block.n_heads].tolist()):
            raise Fail("lrp", f"compute_lrp returned non-finite scores for {block.key}")
    # in float64 (the run's precision: importance.lrp.lrp_precision) what the embeddings and the biases keep is the
    # logit to float64's rounding: a share left unmeasured (a bias that only some tokens' rows see: NLLB-MoE's
    # experts' before session 42, 7e-5) passes compute_lrp's 1e-3 and shows here
    total = scores.signature["conservation"].get("with_biases") or {}
    if str(scores.signature.get("precision", "")).startswith("float64") and total:
        gap = max(abs(total["min"] - 1), abs(total["max"] - 1))
        if gap > 1e-8:
            return f"compute_lrp conserved to {gap:.1g} in float64"
    return None


def implementation_for(config_class, cls, eager, dtype: torch.dtype, inputs: dict) -> tuple[str | None, str]:
    """The attention implementation the checked models are built with, or (None, why the type is skipped).
    Default: SDPA where the class has it and every sub-model takes it (Gemma 4's audio tower does not), eager where
    headlab's load_model takes it (PaliGemma: its SDPA skips the causal mask, refused). ``--attn-implementation``:
    that one, as ``from_pretrained(attn_implementation=...)`` gives it; a class without it (``_supports_sdpa`` /
    ``_supports_flex_attn`` False, a sub-model that refuses it at build, or a forward of transformers' that fails
    with it: flex attention with learned sinks on CPU) is skipped, not failed; one whose forward fails and that headlab
    refuses before any work (T5 under flex) is refused (the reason starts with :data:`REFUSED_FIRST`)."""
    if ATTN_IMPLEMENTATION is None:
        sdpa = cls._supports_sdpa and not causal_on_token_ids(eager.config) and build(config_class, cls, "sdpa", dtype)[0]
        return ("sdpa" if sdpa else "eager"), ""
    if ATTN_IMPLEMENTATION == "eager":
        return "eager", ""
    supports = {"sdpa": "_supports_sdpa", "flex_attention": "_supports_flex_attn"}[ATTN_IMPLEMENTATION]
    if not getattr(cls, supports, False):
        return None, f"{cls.__name__} does not support {ATTN_IMPLEMENTATION} ({supports} False)"
    model, why = build(config_class, cls, ATTN_IMPLEMENTATION, dtype)
    if model is None:
        return None, f"not built with {ATTN_IMPLEMENTATION}: {why[:200]}"
    try:
        logits(as_analysed(model), inputs)
    except Exception as error:  # noqa: BLE001 - transformers' own forward: not headlab's to check
        fails = f"its own {ATTN_IMPLEMENTATION} forward fails ({type(error).__name__}: {_gist(error)})"
        refusal = capture_refusal(as_analysed(model))
        return None, f"{REFUSED_FIRST}{refusal[:200]} ({fails})" if refusal else fails
    return ATTN_IMPLEMENTATION, ""


REFUSED_FIRST = "refused: "  # implementation_for's reason for a type headlab refuses before any work


def capture_refusal(model) -> str:
    """headlab's refusal to read ``model``'s attention (the first line of the HeadlabError capture_attention raises on
    entering), or "" where it reads it."""
    try:
        with capture_attention(model):
            pass
    except HeadlabError as refusal:
        return str(refusal).splitlines()[0]
    return ""


def check_own_logits(model, eager, inputs, atol: Tolerance) -> None:
    """The model as built (``--attn-implementation``) gives the eager reference's logits: headlab's capture reads the
    eager attention, so an implementation that computes something else (a score_mod eager lacks) would be analysed
    from maps that are not the model's."""
    ok, diff = close(logits(model, inputs), logits(eager, inputs), atol)
    if ok:
        return
    differ = f"its {model.config._attn_implementation} logits differ from eager's by {diff:.3g}"
    if refusal := capture_refusal(model):  # headlab must refuse to read such a model's attention
        raise HeadlabError(f"{differ}; capture refuses it: {refusal}")
    raise Fail("own", f"{differ}, and capture_attention reads it")


def as_analysed(model):
    """The model the checks run on: a multimodal wrapper headlab refuses whole but whose language model it supports
    gives that language model (headlab.language_model.analysed_model, as load_model does); any other, itself."""
    try:
        return analysed_model(model)[0]
    except HeadlabError:
        return model


def sweep(model_type: str, config_class, timeout: int, requested: torch.dtype = torch.float64) -> tuple[str, str, str]:
    """(outcome, check, message); ``requested``: the dtype the model is built in (float64: float32 where the model does
    not run in float64)."""
    cls = model_class(config_class)
    if cls is None:
        return "", "", ""
    if model_type in SKIPPED:
        return "skipped", "n/a", SKIPPED[model_type]
    if required := required_inputs(cls):  # InstructBLIP's pixel_values: refused before any work, whatever the sizes
        return "refused", "inputs", f"{cls.__name__}.forward requires {', '.join(required)}"
    eager, why = build(config_class, cls, "eager", requested)
    if eager is None:
        return "skipped", "build", why
    if problem := token_ids_problem(eager):  # an image on every forward (BLIP-2, Kosmos-2): refused before any work
        return "refused", "inputs", problem[:300]
    dtype = requested
    inputs = inputs_for(eager)
    try:
        logits(eager, inputs)
    except Exception as error:  # noqa: BLE001 - float64 not supported: float32
        if requested != torch.float64:  # what headlab does with a model that does not run in this dtype
            fails = f"its own forward fails in {str(requested)[6:]} ({type(error).__name__}: {error})"
            try:
                attention_blocks(as_analysed(eager))
            except HeadlabError as refusal:
                return "refused", "blocks", f"{str(refusal).splitlines()[0][:200]} ({fails[:100]})"
            return "skipped", "forward", f"{fails[:200]}: transformers' own (attention_blocks finds its blocks; " \
                                         "every run fails as the model's forward does)"
        eager, _ = build(config_class, cls, "eager", torch.float32)
        dtype = torch.float32
        try:
            logits(eager, inputs)
        except Exception as error:  # noqa: BLE001
            return "skipped", "forward", f"its own forward fails at these sizes ({type(error).__name__}: {error})"[:200]
    atol = tolerance_for(dtype)
    implementation, why = implementation_for(config_class, cls, eager, dtype, inputs)
    if implementation is None:
        return ("refused" if why.startswith(REFUSED_FIRST) else "skipped"), "implementation", why

    def make(impl: str = implementation):
        return as_analysed(build(config_class, cls, impl, dtype)[0])

    eager = as_analysed(eager)
    notes: list[str | None] = [] if dtype == requested else ["float32"]
    if eager is not None and not isinstance(eager, cls):  # MiniCPM-V's: what load_model gives for its checkpoint
        notes.append(f"the language model of {cls.__name__} (headlab.language_model_of)")
    step = "blocks"
    try:
        model = make()
        try:
            blocks = attention_blocks(model)
        except HeadlabError as error:
            return "refused", "blocks", str(error).splitlines()[0][:300]
        if not blocks:
            raise Fail("blocks", "no block and no refusal")
        step = "idle"
        notes += check_idle(model, blocks, inputs)
        blocks = [b for b in blocks if not b.idle]
        if not (own := logits(eager, inputs)).isfinite().all():  # transformers' own NaN (LongT5 in float16)
            step = "capture"
            return "refused-late", "capture", check_own_nonfinite(make, blocks, inputs, own)
        if ATTN_IMPLEMENTATION is not None:
            step = "own"
            check_own_logits(model, eager, inputs, atol.at_least(1e-6))
        step = "padding"
        # float32's bound whatever the dtype: MPT's and OLMo-Hybrid's softmax are float32 in a float64 model, which
        # rounds a padded row apart from the row alone by 2e-9 to 5e-9; a leak moves it by a neighbour's share
        # (ConvBERT's convolutions: 5e-3)
        check_padding(model, inputs, atol.at_least(1e-6))
        step = "capture"
        check_capture(eager, model, blocks, inputs, atol)
        step = "mask"
        notes += check_mask(make, blocks, inputs, atol, implementation)
        step = "gates"
        check_gates(model, inputs)
        step = "prune"
        single = dtype == torch.float32 or float32_attention(model)
        notes.append(check_prune(make(), blocks, inputs, atol.at_least(1e-6 if single else 1e-9)))
        step = "lrp"
        lrp_model = make()
        # widened as compute_lrp widens it (lrp_rules runs the experts' eager loop, which takes float64); a
        # half-precision model in its own dtype, widened inside check_lrp after its weights are redrawn
        if dtype in HALF:
            notes.append(check_lrp(lrp_model, blocks, widen=lrp_precision(lrp_model)))
        else:
            notes.append(check_lrp(lrp_model.double() if dtype == torch.float64
                                   or lrp_precision(lrp_model) == torch.float64 else lrp_model, blocks))
        # the user's call too, at every precision: the model as built (biases kept), its own conservation check
        notes.append(check_compute_lrp(make()))
    except Fail as error:
        return "FAIL", error.check, str(error)
    except HeadlabError as error:
        return "refused-late", step, f"HeadlabError after the blocks were found: {str(error).splitlines()[0][:250]}"
    except Timeout:
        raise
    except Exception as error:  # noqa: BLE001 - reported as a crash
        frame = traceback.extract_tb(error.__traceback__)[-1]
        return "CRASH", step, (f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''} "
                               f"({Path(frame.filename).name}:{frame.lineno})")
    kinds = Counter(b.kind for b in blocks)
    head = f"{type(model).__name__}: {found_by(blocks)}, {', '.join(f'{n} {k}' for k, n in kinds.items())}"
    return "pass", "", "; ".join([head] + [n for n in notes if n])


def run_types(check, *, only: list[str] | None, timeout: int, columns: int = 1, skip=None, variants=None) -> None:
    """The sweep's loop, shared by experiments/fused_sweep.py: ``check(model_type, config_class)`` -> ``(outcome,
    *columns, message)`` for each type that has a class (``outcome`` "" leaves the type out), under a ``timeout`` of
    seconds each; a line per type, then the counts. ``skip(model_type)`` names a count a type goes to unchecked.
    ``variants(model_type, config_class)`` (experiments/variant_sweep.py): labels, a row and a ``check(model_type,
    config_class, label)`` for each instead of one per type."""
    counts: Counter = Counter()

    def alarm(*_):
        raise Timeout()

    signal.signal(signal.SIGALRM, alarm)
    # transformers compiles flex_attention on its first call (integrations/flex_attention.WrappedFlexAttention): the
    # sweep's own runs eagerly, as headlab's runs under headlab.compiled.running_eagerly
    with torch.compiler.set_stance("force_eager"):
        _run_types(check, only, timeout, columns, skip, variants, counts)
    print(" ".join(f"{k}={v}" for k, v in sorted(counts.items())))


def _run_types(check, only, timeout: int, columns: int, skip, variants, counts: Counter) -> None:
    for model_type, config_class in model_types(only):
        if model_class(config_class) is None:
            continue
        if skip is not None and (count := skip(model_type)):
            counts[count] += 1
            continue
        for label in variants(model_type, config_class) if variants is not None else [None]:
            start = time.perf_counter()
            signal.alarm(timeout)
            try:
                outcome, *middle, message = check(model_type, config_class, *([] if label is None else [label]))
            except Timeout:
                outcome, middle, message = "timeout", [""] * (columns - 1), f"over {timeout} s"
            except Exception as error:  # noqa: BLE001 - outside the checks (building): reported
                outcome, middle, message = "skipped", ["build"][:columns - 1], f"{type(error).__name__}: {error}"[:200]
            finally:
                signal.alarm(0)
            if not outcome:
                continue
            counts[outcome] += 1
            cells = f"{outcome:{12 if columns > 1 else 8}s} " + "".join(f"{cell:8s} " for cell in middle)
            name = model_type if label is None else f"{model_type:26s} {label:34s}"
            print(f"{name:26s} {cells}{time.perf_counter() - start:5.1f}s {message}", flush=True)


def implementation_argument(parser) -> None:
    """``--attn-implementation``, which the three sweeps take (session 46)."""
    parser.add_argument("--attn-implementation", choices=IMPLEMENTATIONS, default=None,
                        help="build the checked models with this attention implementation (default: SDPA where the "
                             "class has it, else eager); a class without it is skipped")


def main() -> None:
    parser = arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--all", action="store_true", help="also the types of the test matrix")
    parser.add_argument("--timeout", type=int, default=30, help="seconds per type")
    parser.add_argument("--causal-first", action="store_true",
                        help="the causal-LM class of a type that has several (BERT-style ForCausalLM, BartForCausalLM)")
    parser.add_argument("--multimodal", action="store_true",
                        help="instead, the types whose only text-generating class is an AutoModelForImageTextToText "
                             "wrapper, run on token ids (their towers idle)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float64",
                        help="the dtype the models are built in (float64: float32 where a model does not run in it); "
                             "half precision checked with its own tolerances (tolerance_for)")
    implementation_argument(parser)
    args = parser.parse_args()
    global CAUSAL_FIRST, MULTIMODAL, ATTN_IMPLEMENTATION
    CAUSAL_FIRST, MULTIMODAL, ATTN_IMPLEMENTATION = args.causal_first, args.multimodal, args.attn_implementation
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    in_matrix = matrix_types()
    run_types(lambda model_type, config_class: sweep(model_type, config_class, args.timeout, DTYPES[args.dtype]),
              only=args.only,
              timeout=args.timeout, columns=2,
              skip=lambda model_type: "matrix" if model_type in in_matrix and not args.all and not args.only else "")


if __name__ == "__main__":
    main()
