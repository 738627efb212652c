"""A block that never runs records nothing (no error in the capture hooks): where other blocks of its
kind ran in the same forward pass, that is a layer the forward skips, and the statistics of
``functions``/``aggregate``/``analyze`` (and confidence) would cover fewer layers without a word.
Llama-style models run ``self.layers[: config.num_hidden_layers]``: lowering that number after
loading (to study a truncated model) left the last layers out of every table. Refused now, at the
first forward pass, naming the layers. A causal LM's cross-attention that never runs (no encoder)
and an encoder run alone (its decoder's blocks none of them running) stay fine."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

import headlab
from headlab import HeadlabError, attention_blocks, capture_attention
from support.treebank import SAMPLE_CONLLU, sample_sentences, word_tokenizer

SKIPPED = r"1 of its 3 attention blocks never ran .*: dec_self layer 2 \(model.layers.2.self_attn\) \(its config says " \
          r"num_hidden_layers=2, and it holds 3 dec_self layers"


def _llama(tokenizer) -> torch.nn.Module:
    config = tf.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=37, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                            pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    sentences = sample_sentences(tmp_path_factory.mktemp("tb"))
    return word_tokenizer([w for s in sentences for w in s.words], style="gpt2")


@pytest.mark.parametrize("engine", ["eager", "chunked", "fused"])
def test_statistics_over_a_model_that_skips_a_layer_are_refused(tokenizer, engine):
    model = _llama(tokenizer)
    whole = headlab.functions(model, tokenizer, SAMPLE_CONLLU, engine=engine)
    assert sorted(whole.positional.counts) == [("dec_self", 0), ("dec_self", 1), ("dec_self", 2)]
    model.config.num_hidden_layers = 2  # layer 2 is still a block, and never runs (before: two layers' tables)
    with pytest.raises(HeadlabError, match=SKIPPED):
        headlab.functions(model, tokenizer, SAMPLE_CONLLU, engine=engine)


def test_capture_refuses_a_skipped_layer_and_keeps_unused_cross_attention_and_an_encoder_alone(tokenizer):
    model = _llama(tokenizer)
    model.config.num_hidden_layers = 2
    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(HeadlabError, match=SKIPPED), capture_attention(model):
        model(input_ids=ids)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())  # hooks came off
    # BART's decoder as a causal LM: cross-attention layers and no encoder, dec_cross never runs
    bart = tf.BartForCausalLM(tf.BartConfig(vocab_size=99, d_model=32, decoder_layers=2, decoder_attention_heads=4,
                                            decoder_ffn_dim=37, max_position_embeddings=64)).eval()
    assert {b.kind for b in attention_blocks(bart)} == {"dec_self", "dec_cross"}
    with capture_attention(bart) as record:
        bart(input_ids=ids)
    assert sorted(record) == [("dec_self", 0), ("dec_self", 1)]
    # an encoder-decoder's encoder run alone: no decoder block runs, the top-level forward not called
    t5 = tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=99, d_model=32, d_kv=8, d_ff=37, num_layers=2,
                                                   num_heads=4, decoder_start_token_id=0)).eval()
    with capture_attention(t5) as record:
        t5.get_encoder()(input_ids=ids)
        t5(input_ids=ids, decoder_input_ids=ids)
    assert len(record) == 6
