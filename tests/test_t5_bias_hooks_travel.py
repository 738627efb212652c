"""A pruned T5 stack's position bias hooks (headlab.portable_code.StackBiasHook) travel with the model, pruned by
headlab or loaded by plain transformers through pruned_heads.py:

* a deep copy reads its own relative position bias table, not the original's: the hooks were closures over the
  table's layer, which ``copy.deepcopy`` does not copy, so a copy given other weights (training's averaged model,
  ``training.loop._average_and_validate``: a deep copy loaded with the averaged weights, then validated) computed its
  pruned layers' bias from the original's table, silently;
* the model pickles (``torch.save``; a closure does not) and the unpickled model computes the same logits;
* generate() with a static cache (``cache_implementation="static"``) equals the masked model's: T5Attention biases
  every slot of a static cache (``key_states.shape[-2]``, ``max_cache_len``), where the hook built ``past + q``
  columns and the pruned model failed (a size mismatch).

Tiny float64 T5 and local LongT5, the first layer of each stack (the one with the table) pruned and a layer with no
head left.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import transformers as tf

from headlab import mask_heads, prune_heads, save_pruned
from support.family_matrix import perturbed_model

SPEC = {("enc_self", 0): [1, 3], ("enc_self", 1): [0, 1, 2, 3], ("dec_self", 0): [2], ("dec_self", 1): [0, 3],
        ("dec_cross", 1): [0, 1, 2, 3]}
# the first layers (the tables') with no head left: their stand-ins keep the table and compute_bias
EMPTIED_FIRST = {("enc_self", 0): [0, 1, 2, 3], ("enc_self", 1): [2], ("dec_self", 0): [0, 1, 2, 3],
                 ("dec_self", 1): [1]}


def _model(family: str) -> torch.nn.Module:
    sizes = dict(vocab_size=99, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_decoder_layers=2, num_heads=4,
                 relative_attention_num_buckets=8, relative_attention_max_distance=16, pad_token_id=0, eos_token_id=1,
                 decoder_start_token_id=0)
    if family == "longt5":
        cls, config = tf.LongT5ForConditionalGeneration, tf.LongT5Config(**sizes, local_radius=2,
                                                                          encoder_attention_type="local")
    else:
        cls, config = tf.T5ForConditionalGeneration, tf.T5Config(**sizes)
    return perturbed_model(cls, config, seed=4, attn_implementation="eager").double()


def _inputs() -> dict:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 99, (2, 10), generator=g)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, -3:] = 0
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask,
            "decoder_input_ids": torch.randint(3, 99, (2, 5), generator=g)}


def _logits(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


def _tables(model) -> list[torch.Tensor]:
    # a stack's table, once per stack (an emptied first layer's stand-in holds the same Embedding)
    found = {id(m.relative_attention_bias): m.relative_attention_bias.weight for m in model.modules()
             if isinstance(getattr(m, "relative_attention_bias", None), torch.nn.Embedding)}
    return list(found.values())


def _pruned(family: str, how: str, tmp_path, model=None, spec=None) -> torch.nn.Module:
    model = _model(family) if model is None else model
    prune_heads(model, spec or SPEC)
    if how == "headlab":
        return model
    save_pruned(model, tmp_path)
    plain = tf.AutoModelForSeq2SeqLM.from_pretrained(tmp_path, trust_remote_code=True).double()
    plain.config._attn_implementation = "eager"
    return plain


@pytest.mark.parametrize("emptied_first", [False, True], ids=["first pruned", "first emptied"])
@pytest.mark.parametrize("how", ["headlab", "plain"])
@pytest.mark.parametrize("family", ["t5", "longt5"])
def test_a_deep_copy_of_a_pruned_t5_reads_its_own_table(family, how, emptied_first, tmp_path):
    model = _pruned(family, how, tmp_path, spec=EMPTIED_FIRST if emptied_first else SPEC)
    inputs = _inputs()
    before = _logits(model, inputs)
    twin = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        shifts = [torch.randn(table.shape, generator=g, dtype=table.dtype) for table in _tables(model)]
        for table, shift in zip(_tables(model), shifts):
            table.add_(shift)
    after = _logits(model, inputs)
    assert not torch.allclose(after, before)  # the table moves the pruned layers' outputs
    torch.testing.assert_close(_logits(twin, inputs), before, atol=1e-12, rtol=0)  # not the original's table
    with torch.no_grad():
        for table, shift in zip(_tables(twin), shifts):
            table.add_(shift)
    torch.testing.assert_close(_logits(twin, inputs), after, atol=1e-12, rtol=0)  # its own


@pytest.mark.parametrize("emptied_first", [False, True], ids=["first pruned", "first emptied"])
@pytest.mark.parametrize("how", ["headlab", "plain"])
@pytest.mark.parametrize("family", ["t5", "longt5"])
def test_a_pruned_t5_pickles(family, how, emptied_first, tmp_path):
    model = _pruned(family, how, tmp_path, spec=EMPTIED_FIRST if emptied_first else SPEC)
    inputs = _inputs()
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    torch.testing.assert_close(_logits(loaded, inputs), _logits(model, inputs), atol=0, rtol=0)


def _static_generation(model, inputs) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        out = model.generate(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], max_new_tokens=5,
                             min_new_tokens=5, do_sample=False, num_beams=1, cache_implementation="static",
                             output_scores=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.scores)


@pytest.mark.parametrize("how", ["headlab", "plain"])
@pytest.mark.parametrize("family", ["t5", "longt5"])
def test_a_pruned_t5_generates_with_a_static_cache(family, how, tmp_path):
    model, inputs = _model(family), _inputs()
    with mask_heads(model, SPEC):
        tokens, scores = _static_generation(model, inputs)
    pruned = _pruned(family, how, tmp_path, model)
    pruned_tokens, pruned_scores = _static_generation(pruned, inputs)
    assert torch.equal(pruned_tokens, tokens)
    torch.testing.assert_close(pruned_scores, scores, atol=1e-12, rtol=0)
