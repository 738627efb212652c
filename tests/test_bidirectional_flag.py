"""Gemma, Gemma 2 and Gemma 3's multimodal wrapper with ``use_bidirectional_attention`` set (the flag PaliGemma sets on
its Gemma text model): the attention's ``is_causal`` is False, but the model's mask is causal whatever the flag says
(transformers 5.24; Gemma 3's text model, ``gemma3_text``, honours it). Found by the session-39 variant sweep
(``experiments/variant_sweep.py``, ``use_bidirectional_attention=True``: FAIL ``kind``, "('enc_self', 0): the attention
is causal"): headlab took the blocks for an encoder's (``enc_self``: a masked LM's objective, its loss unshifted), and
under SDPA the model attends bidirectionally over a batch without padding and causally over a padded one. Now the
blocks are ``dec_self`` (``adapters.families.causal_on_token_ids``), SDPA is refused before any work, naming the way
out, and ``load_model`` loads such a checkpoint with eager attention. Both failed before the fix.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from headlab import HeadlabError, attention_blocks, capture_attention
from headlab.loading import load_model
from headlab.model_description import describe_model
from support.family_matrix import logits, perturbed_model, tiny_inputs

_TEXT = dict(vocab_size=99, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=2, bos_token_id=0,
             eos_token_id=1)
_CAUSAL_LMS = {"gemma": (tf.GemmaConfig, tf.GemmaForCausalLM), "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM)}


def _model(name: str, implementation: str = "eager", flag: bool = True) -> torch.nn.Module:
    config_class, cls = _CAUSAL_LMS[name]
    config = config_class(**_TEXT, use_bidirectional_attention=flag)
    return perturbed_model(cls, config, attn_implementation=implementation).double()


@pytest.mark.parametrize("name", sorted(_CAUSAL_LMS))
def test_blocks_are_causal_and_capture_equals_output_attentions(name):
    model = _model(name)
    assert all(not m.is_causal for m in model.modules() if hasattr(m, "q_proj"))  # what the kind was read from
    assert [b.kind for b in attention_blocks(model)] == ["dec_self", "dec_self"]
    assert describe_model(model).arch == "causal"
    inputs = tiny_inputs()
    with torch.no_grad():
        expected = model(**inputs, output_attentions=True).attentions
    with capture_attention(model) as record:
        logits(model, inputs)
    for (_, layer), probs in record.items():
        torch.testing.assert_close(probs, expected[layer], atol=1e-12, rtol=0)
        assert torch.triu(probs[0].sum(0), diagonal=1).abs().max() == 0  # no weight on a later token


@pytest.mark.parametrize("name", ["gemma"])  # Gemma 2 has no SDPA
def test_sdpa_is_refused_before_any_work_and_load_model_takes_eager(name, tmp_path):
    model = _model(name, "sdpa")
    ids = tiny_inputs()["input_ids"][:1]
    with torch.no_grad():  # what is refused: the SDPA forward attends to later tokens on an unpadded row
        assert not torch.allclose(model(input_ids=ids).logits, _model(name)(input_ids=ids).logits, atol=1e-6)
    with pytest.raises(HeadlabError, match=r"attn_implementation='sdpa'.*load it with attn_implementation='eager'"):
        capture_attention(model).__enter__()
    model.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    assert loaded.config._attn_implementation == "eager"
    assert [b.kind for b in attention_blocks(loaded)] == ["dec_self", "dec_self"]


def test_without_the_flag_sdpa_is_kept():
    model = _model("gemma", "sdpa", flag=False)
    with capture_attention(model):
        pass
    assert [b.kind for b in attention_blocks(model)] == ["dec_self", "dec_self"]


def test_gemma3_wrapper_is_causal_and_its_text_model_bidirectional():
    vision = dict(hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=4, image_size=16,
                  patch_size=8)
    config = tf.Gemma3Config(text_config=dict(_TEXT, use_bidirectional_attention=True), vision_config=vision,
                             mm_tokens_per_image=1)
    wrapper = perturbed_model(tf.Gemma3ForConditionalGeneration, config, attn_implementation="eager").double()
    assert [b.kind for b in attention_blocks(wrapper) if not b.idle] == ["dec_self", "dec_self"]
    text = perturbed_model(tf.Gemma3ForCausalLM, tf.Gemma3TextConfig(**_TEXT, use_bidirectional_attention=True),
                           attn_implementation="eager").double()
    assert [b.kind for b in attention_blocks(text)] == ["enc_self", "enc_self"]
    inputs = tiny_inputs()
    with torch.no_grad():
        expected = text(**inputs, output_attentions=True).attentions
    assert torch.triu(expected[0][0].sum(0), diagonal=1).abs().max() > 0  # it does attend to later tokens
