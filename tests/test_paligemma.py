"""PaliGemma (``PaliGemmaForConditionalGeneration``): its language model's attention says it is not causal
(``is_causal`` False: the text config's ``use_bidirectional_attention``, for the image and prompt prefix that
``token_type_ids`` marks), but on token ids alone ``PaliGemmaModel.forward`` builds a causal mask (transformers 5.24).

Found by the session-37 sweep of vision-language wrappers (``experiments/family_sweep.py --multimodal``): headlab took
its blocks for an encoder's (``enc_self``, from the flag: a masked LM's objective, its loss unshifted), and under SDPA
the model attends bidirectionally over a batch without padding (the mask skipped, ``is_causal`` False) and causally over
a padded one. Now its language model's blocks are ``dec_self`` (``adapters.families.CAUSAL_ON_TOKEN_IDS``), a model
loaded with SDPA is refused before any work, naming the way out, and ``load_model`` loads it with eager attention.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from headlab import HeadlabError, attention_blocks, capture_attention, mask_heads, prune_heads
from headlab.importance import compute_gradient
from headlab.loading import load_model
from headlab.model_description import describe_model
from support.family_matrix import check_gates_at_one_change_nothing, logits, perturbed_model, tiny_inputs
from support.lrp_families import lrp_data

_TEXT = dict(vocab_size=99, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=2, bos_token_id=0,
             eos_token_id=1)
_VISION = dict(hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=4, image_size=16,
               patch_size=8)


def _model(implementation: str = "eager") -> torch.nn.Module:
    if not hasattr(tf, "PaliGemmaForConditionalGeneration"):
        pytest.skip("this transformers has no paligemma")
    config = tf.PaliGemmaConfig(text_config=_TEXT, vision_config=_VISION, image_token_index=98)
    assert config.text_config.use_bidirectional_attention is True  # the flag the blocks' kind was read from
    return perturbed_model(tf.PaliGemmaForConditionalGeneration, config, attn_implementation=implementation).double()


def test_the_language_models_blocks_are_causal_decoder_blocks():
    model = _model()
    assert [(b.kind, b.layer, b.idle) for b in attention_blocks(model)] == [
        ("enc_self", 0, True), ("dec_self", 0, False), ("dec_self", 1, False)]
    assert describe_model(model).arch == "causal"


def test_capture_equals_output_attentions_causal_with_and_without_padding():
    model = _model()
    inputs = tiny_inputs()
    unpadded = {"input_ids": inputs["input_ids"][:1], "attention_mask": torch.ones_like(inputs["input_ids"][:1])}
    for batch in (inputs, unpadded):
        with torch.no_grad():
            expected = model(**batch, output_attentions=True).attentions
        with capture_attention(model) as record:
            logits(model, batch)
        for (_, layer), probs in record.items():
            torch.testing.assert_close(probs, expected[layer], atol=1e-12, rtol=0)
            assert torch.triu(probs[0].sum(0), diagonal=1).abs().max() == 0  # no weight on a later token


def test_masking_pruning_and_gates():
    inputs = tiny_inputs()
    model = _model()
    spec = {("dec_self", 1): [0, 1]}
    with mask_heads(model, spec):
        masked = logits(model, inputs)
    prune_heads(model, spec)  # checks itself against masking
    keep = inputs["attention_mask"].bool()
    torch.testing.assert_close(logits(model, inputs)[keep], masked[keep], atol=1e-10, rtol=0)
    check_gates_at_one_change_nothing(_model(), inputs)


def test_sdpa_is_refused_before_any_work_and_load_model_takes_eager(tmp_path):
    model = _model("sdpa")
    ids = tiny_inputs()["input_ids"][:1]
    with torch.no_grad():  # what is refused: the SDPA forward attends to later tokens on an unpadded row
        assert not torch.allclose(model(input_ids=ids).logits, _model()(input_ids=ids).logits, atol=1e-6)
    data, info = lrp_data(model)
    for measure in (lambda: capture_attention(model).__enter__(), lambda: compute_gradient(model, data, info)):
        with pytest.raises(HeadlabError, match=r"attn_implementation='sdpa'.*load it with attn_implementation='eager'"):
            measure()
    model.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    assert loaded.config.get_text_config()._attn_implementation == "eager"
    assert [b.kind for b in attention_blocks(loaded) if not b.idle] == ["dec_self", "dec_self"]
