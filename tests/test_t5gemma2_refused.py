"""T5Gemma 2 refused before any work with its own reason, merged attention (before: discovery's generic "its forward
does not return the attention function's weights", true but not why)."""

import transformers as tf

from support.models import VOCAB
from test_mvp_prophetnet_pegasus_x import _check_refused

_SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=64, query_pre_attn_scalar=8,
              layer_types=["sliding_attention", "full_attention"], sliding_window=4)


def _t5gemma2():
    vision = dict(hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=4, image_size=16,
                  patch_size=4)
    config = tf.T5Gemma2Config(encoder=dict(text_config=_SIZES, vision_config=vision, mm_tokens_per_image=4),
                               decoder=_SIZES)
    return tf.T5Gemma2ForConditionalGeneration(config).eval()


def test_t5gemma2_is_refused_naming_merged_attention(tmp_path, capsys):
    _check_refused(_t5gemma2(), ("merged attention", "one softmax over [the decoder's tokens | the encoder's tokens]",
                                 "dec_cross"), tmp_path / "model", capsys)
