"""The Qwen2.5-Omni and Qwen3-Omni-MoE thinkers (``Qwen2_5OmniThinkerForConditionalGeneration``,
``Qwen3OmniMoeThinkerForConditionalGeneration``; transformers 5.24), on token ids (their vision and audio towers idle).

Their forward computes its own M-RoPE positions while decoding from the whole attention mask, one per cached token
(``compute_3d_position_ids``), and fails on a one-token step given that mask; ``generate()`` gives them position ids
instead (``_prepare_position_ids_for_generation``, moved on by one a step). The pruning check's probe failed on the
unpruned model, so ``prune`` refused them ("cannot check pruning, the model itself fails on headlab's probe batch");
since session 38 a model that fails the plain probe is probed with the position ids ``generate()`` gives
(``prune_check.first_probe``). Found by the session-38 sweep of vision-language wrappers."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from headlab import attention_blocks, load_pruned, mask_heads
from support.family_matrix import (
    check_capture_equals_output_attentions,
    check_pruned_generates_as_masked,
    logits,
    padded_inputs,
    padded_logits,
    perturbed_model,
    tiny_inputs,
)

_TEXT = dict(vocab_size=99, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=2, bos_token_id=0,
             eos_token_id=1, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]})
_VISION = dict(depth=1, embed_dim=32, hidden_size=32, num_heads=4, intermediate_size=40, out_hidden_size=32,
               patch_size=4, spatial_merge_size=2, temporal_patch_size=2)
_AUDIO = dict(num_mel_bins=8, encoder_layers=1, encoder_attention_heads=4, encoder_ffn_dim=40, d_model=32, output_dim=32,
              max_source_positions=16, n_window=4)
_TOKENS = dict(audio_start_token_id=93, user_token_id=95, vision_start_token_id=96)  # the last: read, no default


def _qwen2_5(implementation: str = "sdpa") -> torch.nn.Module:
    config = tf.Qwen2_5OmniThinkerConfig(
        text_config=_TEXT, vision_config=dict(_VISION, fullatt_block_indexes=[0], window_size=8),
        audio_config=_AUDIO, audio_token_index=90, image_token_index=91, video_token_index=92,
        audio_end_token_id=94, **_TOKENS)
    return perturbed_model(tf.Qwen2_5OmniThinkerForConditionalGeneration, config, attn_implementation=implementation)


def _qwen3_moe(implementation: str = "sdpa") -> torch.nn.Module:
    config = tf.Qwen3OmniMoeThinkerConfig(
        text_config=dict(_TEXT, moe_intermediate_size=40, num_experts=4, num_experts_per_tok=2),
        vision_config=dict(_VISION, deepstack_visual_indexes=[0], num_position_embeddings=16),
        audio_config=dict(_AUDIO, n_window_infer=8, conv_chunksize=4, downsample_hidden_size=8),
        audio_token_id=90, image_token_id=91, video_token_id=92, **_TOKENS)
    return perturbed_model(tf.Qwen3OmniMoeThinkerForConditionalGeneration, config, attn_implementation=implementation)


@pytest.mark.parametrize("build", [_qwen2_5, _qwen3_moe])
def test_thinker_blocks_capture_and_masking(build):
    model = build()
    live = [b for b in attention_blocks(model) if not b.idle]
    assert [(b.kind, b.layer, b.n_heads) for b in live] == [("dec_self", 0, 4), ("dec_self", 1, 4)]
    inputs = tiny_inputs()
    check_capture_equals_output_attentions(lambda attn_implementation="sdpa": build(attn_implementation), "dec_self",
                                           inputs)
    with mask_heads(model, {("dec_self", 1): [0, 1]}):
        masked = logits(model, inputs)
    zeroed = build()
    with torch.no_grad():  # key/value head 0's values (its query heads 0 and 1): its rows and their bias
        values = next(b for b in attention_blocks(zeroed) if not b.idle and b.layer == 1).v
        values.weight[:8] = 0
        if values.bias is not None:  # Qwen2.5's (Qwen3's has none)
            values.bias[:8] = 0
    torch.testing.assert_close(masked, logits(zeroed, inputs), atol=1e-6, rtol=0)


@pytest.mark.parametrize("build", [_qwen2_5, _qwen3_moe])
def test_thinker_prunes_as_masked_in_cached_generation_and_reloads(build, tmp_path):
    from headlab import save_pruned

    model = build()
    ids, mask = padded_inputs(pad_id=2)
    spec = {("dec_self", 0): [0, 1, 2, 3], ("dec_self", 1): [1, 2]}  # layer 0 emptied
    check_pruned_generates_as_masked(model, spec, [0, 2], ids, mask)
    save_pruned(model, tmp_path)
    reloaded = load_pruned(tmp_path)  # its check runs the probe too
    assert [b.n_heads for b in attention_blocks(reloaded) if not b.idle] == [0, 2]
    torch.testing.assert_close(padded_logits(reloaded, ids, mask), padded_logits(model, ids, mask), atol=0, rtol=0)
