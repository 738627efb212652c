"""Which configs headlab switches to another attention implementation (capture's eager mode, the
streaming function) and gives back: on a plain decoder, an encoder-decoder, a composite of two
models (EncoderDecoderModel: config.encoder and config.decoder) and a multimodal one (Llava:
config.vision_config and config.text_config, here one of them eager and the other SDPA). Every
config a module holds and every sub-config is switched inside and has its own implementation back
on exit. Tiny models built from configs."""

from __future__ import annotations

import pytest
import transformers as tf

from headlab.attention import register
from headlab.capture import eager_attention, stream_attention
from support.models import VOCAB
from support.models import tiny_model as tiny_base


def _encoder_decoder():
    def bert(**extra):
        return tf.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                             intermediate_size=37, max_position_embeddings=64, **extra)

    config = tf.EncoderDecoderConfig.from_encoder_decoder_configs(bert(), bert(is_decoder=True, add_cross_attention=True))
    config._attn_implementation = "sdpa"
    return tf.EncoderDecoderModel(config=config).eval()


def _llava():
    vision = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                                 image_size=16, patch_size=8, projection_dim=32)
    text = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config = tf.LlavaConfig(vision_config=vision, text_config=text, image_token_index=VOCAB - 1)
    config._attn_implementation = "sdpa"
    model = tf.LlavaForConditionalGeneration(config).eval()
    model.config.vision_config._attn_implementation = "eager"  # the parts differ
    return model


MODELS = {"llama": lambda: tiny_base("llama"), "marian": lambda: tiny_base("marian"),
          "encoder-decoder": _encoder_decoder, "llava": _llava}
SWITCHED = {  # the configs switched, by where they hang: every one there is
    "llama": ["config"],
    "marian": ["config"],
    "encoder-decoder": ["config", "config.encoder", "config.decoder"],
    "llava": ["config", "config.text_config", "config.vision_config"],
}


def _implementations(model) -> dict:
    """Each config object a module holds, and its sub-configs, by the path of its first holder."""
    found: dict[int, tuple[str, object]] = {}

    def visit(path, config):
        if config is None or not hasattr(config, "_attn_implementation") or id(config) in found:
            return
        found[id(config)] = (path, config)
        for key in getattr(config, "sub_configs", {}):
            visit(f"{path}.{key}", getattr(config, key, None))

    for name, module in model.named_modules():
        visit(f"{name}.config" if name else "config", getattr(module, "config", None))
    return {path: config._attn_implementation for path, config in found.values()}


@pytest.mark.parametrize("family", MODELS)
def test_eager_attention_switches_every_config_and_gives_each_its_own_back(family):
    model = MODELS[family]()
    before = _implementations(model)
    assert sorted(before) == sorted(SWITCHED[family])
    with eager_attention(model):
        inside = _implementations(model)
    assert inside == {path: "eager" for path in before}
    assert _implementations(model) == before
    if family == "llava":
        assert before["config.vision_config"] == "eager" and before["config.text_config"] == "sdpa"


@pytest.mark.parametrize("family", ["llama", "marian"])
def test_streaming_switches_every_config_and_gives_each_its_own_back(family):
    model = MODELS[family]()
    before = _implementations(model)
    with stream_attention(model, lambda block, chunk: None, query_chunk=3):
        inside = _implementations(model)
    assert inside == {path: register() for path in before}
    assert _implementations(model) == before


def test_a_sub_config_no_module_holds_gets_its_own_implementation_back():
    """Setting a config's implementation sets its sub-configs' too (transformers' setter): restoring
    only the configs the modules hold gave a sub-config of its own the parent's implementation,
    not its own. Regression: capture's list of configs lacked the sub-configs discovery's had."""
    model = _llava()
    model.config.text_config = model.config.text_config.__class__(**model.config.text_config.to_dict())
    model.config.text_config._attn_implementation = "eager"  # a copy, held by no module
    assert model.config._attn_implementation == "sdpa"
    with eager_attention(model):
        assert model.config.text_config._attn_implementation == "eager"
    assert model.config.text_config._attn_implementation == "eager"
    assert model.config._attn_implementation == "sdpa"
