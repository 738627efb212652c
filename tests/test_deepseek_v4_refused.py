"""DeepSeek-V4 refused before any work with its own reason, the compressed key-value entries its heads attend over
(before: discovery's generic "the attention function's output reaches o_a_proj through operations other than
reshapes and casts", true of the inverse rotation of its output but not why)."""

import pytest
import transformers as tf

from support.models import VOCAB
from test_mvp_prophetnet_pegasus_x import _check_refused


def _deepseek_v4():
    if not hasattr(tf, "DeepseekV4Config"):
        pytest.skip("this transformers has no deepseek_v4")
    config = tf.DeepseekV4Config(
        vocab_size=VOCAB, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        head_dim=16, qk_rope_head_dim=4, q_lora_rank=16, o_groups=2, o_lora_rank=8, n_routed_experts=4,
        num_experts_per_tok=2, index_n_heads=2, index_head_dim=8, index_topk=4, sliding_window=8, hc_mult=2,
        num_nextn_predict_layers=0, max_position_embeddings=64,
        layer_types=["compressed_sparse_attention", "heavily_compressed_attention"])
    return tf.DeepseekV4ForCausalLM(config).eval()


def test_deepseek_v4_is_refused_naming_compressed_entries(tmp_path, capsys):
    _check_refused(_deepseek_v4(), ("compressed key-value entries", "not a [query, key] map over the input's tokens",
                                    "hyper-connections"), tmp_path / "model", capsys)
