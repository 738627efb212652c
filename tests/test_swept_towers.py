"""Multimodal types the family sweep skipped until session 27 (skip27B: experiments/family_sweep.py now builds them
tiny) and what it found:

* Mllama's text model (``MllamaForCausalLM``) interleaves ``cross_attn`` layers, over the vision tower's states,
  with its self-attention layers. Its config has no ``is_decoder``, so the name-based discovery took them for
  ``dec_self`` blocks: token ids never run them, and capture refused every forward pass ("1 of its 2 attention
  blocks never ran ... dec_self layer 1"). Now they are ``dec_cross`` blocks, idle, as BART's and BERT's unfed
  cross-attention (tests/test_unfed_cross_attention.py).
* Voxtral Realtime (its forward needs audio features at every step) is refused before any work naming that.
* A tower numbered like the text model's own blocks (ModernVBERT's vision encoder beside its ModernBERT text
  encoder, both ``enc_self``) was refused before any work ("two modules claim enc_self layer 0"); since towers27 its
  blocks are numbered after the text's (tests/test_tower_numbering.py).

Tiny models built from their configs, no download.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from headlab import HeadlabError, attention_blocks, capture_attention, mask_heads, prune_heads
from support.family_matrix import perturbed_model, tiny_inputs

_TEXT = dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=1, pad_token_id=2)


def _mllama() -> torch.nn.Module:
    config = tf.MllamaTextConfig(**_TEXT, cross_attention_layers=[1])  # layer 0 self-attention, layer 1 cross
    return perturbed_model(tf.MllamaForCausalLM, config, attn_implementation="eager").double()


def test_mllamas_cross_attention_layers_are_idle_cross_attention():
    blocks = {b.key: b for b in attention_blocks(_mllama())}
    assert sorted(blocks) == [("dec_cross", 1), ("dec_self", 0)]
    assert blocks["dec_cross", 1].name == "model.layers.1.cross_attn" and blocks["dec_cross", 1].idle
    assert not blocks["dec_self", 0].idle


def test_mllamas_text_model_is_captured_and_masked():
    model, batch = _mllama(), tiny_inputs()
    with torch.no_grad():
        reference = model(**batch, output_attentions=True).attentions[0]
        before = model(**batch).logits
    with torch.no_grad(), capture_attention(model) as record:
        model(**batch)
    assert sorted(record) == [("dec_self", 0)]
    torch.testing.assert_close(record["dec_self", 0], reference, rtol=0, atol=1e-12)
    # masking the last key/value head's two query heads equals zeroing that head's value weights
    with torch.no_grad(), mask_heads(model, {("dec_self", 0): [2, 3]}):
        masked = model(**batch).logits
    assert not torch.equal(masked, before)
    with torch.no_grad():
        model.model.layers[0].self_attn.v_proj.weight[8:16] = 0
        torch.testing.assert_close(model(**batch).logits, masked, rtol=0, atol=1e-10)


def test_pruning_mllamas_cross_attention_is_refused_before_any_work():
    model = _mllama()
    weight = model.model.layers[1].cross_attn.q_proj.weight.clone()
    with pytest.raises(HeadlabError, match="dec_cross"):
        prune_heads(model, {("dec_cross", 1): [0]})
    assert torch.equal(model.model.layers[1].cross_attn.q_proj.weight, weight)


def test_voxtral_realtime_is_refused_before_any_work_naming_its_audio_input():
    # its forward needs input_features at every step; before, "two modules claim dec_self layer 0" (its audio
    # tower's and its language model's first layers), the probe forward on token ids having failed
    audio = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=4, head_dim=8)
    config = tf.VoxtralRealtimeConfig(text_config=dict(_TEXT, head_dim=8), audio_config=audio)
    model = perturbed_model(tf.VoxtralRealtimeForConditionalGeneration, config, attn_implementation="eager")
    with pytest.raises(HeadlabError, match=r"is not supported: Voxtral Realtime is a streaming speech model: its "
                                           r"forward reads audio features \(input_features\)"):
        attention_blocks(model)
