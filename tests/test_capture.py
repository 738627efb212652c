"""Capture equals transformers' own eager attentions, and always restores the model."""

import pytest
import torch

from headlab import attention_blocks, capture_attention
from support.models import FAMILIES, SEQ2SEQ, tiny_inputs, tiny_model


def _reference(model, inputs):
    """transformers' own eager output_attentions, keyed like headlab's record."""
    with torch.no_grad():
        out = model(**inputs, output_attentions=True)
    if hasattr(out, "encoder_attentions") and out.encoder_attentions is not None:
        ref = {("enc_self", i): a for i, a in enumerate(out.encoder_attentions)}
        ref.update({("dec_self", i): a for i, a in enumerate(out.decoder_attentions)})
        ref.update({("dec_cross", i): a for i, a in enumerate(out.cross_attentions)})
        return ref
    kind = attention_blocks(model)[0].kind
    return {(kind, i): a for i, a in enumerate(out.attentions)}


@pytest.mark.parametrize("family", FAMILIES)
def test_capture_equals_output_attentions(family):
    model = tiny_model(family, attn_implementation="eager")
    inputs = tiny_inputs(family)  # the second sequence is padded
    reference = _reference(model, inputs)
    sdpa = tiny_model(family, attn_implementation="sdpa")
    with capture_attention(sdpa) as record:
        with torch.no_grad():
            sdpa(**inputs)
    assert set(record) == set(reference)
    for key, probs in record.items():
        assert probs.shape == reference[key].shape
        assert torch.equal(probs, reference[key]), key
    # Padding: keys at padded positions get no attention.
    enc_kind = "enc_self" if family in SEQ2SEQ or family in ("bert", "roberta", "distilbert") else "dec_self"
    assert torch.all(record[(enc_kind, 0)][1, :, :5, 5:] == 0)


def test_capture_restores_attn_implementation_on_error():
    model = tiny_model("marian", attn_implementation="sdpa")
    with pytest.raises(RuntimeError, match="boom"):
        with capture_attention(model):
            assert model.config._attn_implementation == "eager"
            raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"
    assert all(not b.core._forward_hooks for b in attention_blocks(model))


def test_streaming_callback_keeps_nothing():
    model = tiny_model("bart")
    inputs = tiny_inputs("bart")
    seen = []
    with capture_attention(model, callback=lambda block, probs: seen.append((block.key, probs.shape))) as record:
        with torch.no_grad():
            model(**inputs)
            model(**inputs)
    assert len(record) == 0
    assert len(seen) == 2 * 6
    assert seen[0] == (("enc_self", 0), torch.Size([2, 4, 7, 7]))
    assert record.calls[("dec_cross", 1)] == 2


def test_capture_during_generation_counts_every_step():
    model = tiny_model("marian")
    inputs = tiny_inputs("marian")
    inputs.pop("decoder_input_ids")
    with capture_attention(model) as record:
        out = model.generate(**inputs, max_new_tokens=4, min_new_tokens=4, num_beams=1, do_sample=False)
    assert record.calls[("enc_self", 0)] == 1
    assert record.calls[("dec_self", 0)] == out.shape[1] - 1


@pytest.mark.parametrize("family", FAMILIES)
def test_capture_switches_through_set_attn_implementation(family, monkeypatch):
    """Where transformers can switch the model (``set_attn_implementation``), headlab asks it to,
    and every config ends as it began."""
    model = tiny_model(family, attn_implementation="sdpa")
    before = {id(m.config): m.config._attn_implementation for m in model.modules() if hasattr(m, "config")}
    calls = []
    original = model.set_attn_implementation
    monkeypatch.setattr(model, "set_attn_implementation", lambda name: calls.append(name) or original(name))
    with capture_attention(model):
        with torch.no_grad():
            model(**tiny_inputs(family))
    if type(model)._can_set_attn_implementation():
        assert calls == ["eager", "sdpa"]
    after = {id(m.config): m.config._attn_implementation for m in model.modules() if hasattr(m, "config")}
    assert after == before
