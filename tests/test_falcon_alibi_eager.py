"""Falcon with ALiBi: headlab reads the attention the model computes, not transformers' eager one (fixes35).

transformers 5.24's eager attention of Falcon with ``alibi=True`` adds each head's ALiBi bias twice (to the scores,
and again in the attention mask FalconModel folded it into); SDPA, the default, adds it once, as the original Falcon
and ALiBi do (headlab.adapters.eager_alibi). headlab reads probabilities in eager mode, so before this session every
capture of a Falcon-ALiBi model loaded with SDPA (confidence, head functions, aggregate statistics, LRP) reported the
maps and relevance of the doubled-bias model (weights up to 0.045 and logits up to 7.8e-4 away, float64), without
a word.

* capture_attention on an SDPA-loaded model: the probabilities equal a hand computation of ALiBi once (Press et al.
  2022; slopes 2^-2, 2^-4, 2^-6, 2^-8 for 4 heads, times each key's position among the real tokens) from the
  model's own q and k, and the logits inside equal those outside (grouped, multi-query and per-head layouts, a
  right- and a left-padded row);
* eager_attention (LRP's seam): the same logits as SDPA, the hooks gone and the implementation back on exit;
* a model loaded with attn_implementation="eager" computes the doubled bias in every forward of its own: capture and
  every measuring entry point refuse it before any forward pass, naming the bug and attn_implementation='sdpa'.
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers as tf

from headlab import capture_attention, eager_attention
from headlab.data.inputs import ImportanceData
from headlab.errors import HeadlabError
from headlab.importance import compute_confidence, compute_gradient, compute_lrp, describe_model
from support.family_matrix import padded_inputs, perturbed_model

LAYOUTS = {
    "grouped": dict(new_decoder_architecture=True, num_kv_heads=2),
    "multi-query": dict(multi_query=True, parallel_attn=False),
    "per-head": dict(multi_query=False, parallel_attn=False),
}
SLOPES = torch.tensor([2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8], dtype=torch.float64)  # 4 heads: 2^(-8h/4)
TWICE = "adds each head's ALiBi bias twice .* attn_implementation='sdpa'"


def _falcon(layout: str, attn_implementation: str = "sdpa") -> torch.nn.Module:
    config = tf.FalconConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=True,
                             bias=True, bos_token_id=0, eos_token_id=1, pad_token_id=2, **LAYOUTS[layout])
    return perturbed_model(tf.FalconForCausalLM, config, 0, attn_implementation).double()


def _alibi_once(core, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """softmax((q k^T + m_h * key position) / sqrt(d_head)) over the real keys up to the query, from the model's q and
    k (its own split of the fused projection); ``[batch, heads, q, k]``."""
    query, key, _ = core._split_heads(core.query_key_value(hidden))  # [batch, seq, heads (or 1), d_head]
    query, key = query.transpose(1, 2), key.transpose(1, 2).expand(-1, query.shape[2], -1, -1)
    scores = query @ key.transpose(-1, -2)  # [batch, heads, q, k]
    positions = ((mask.cumsum(-1) - 1) * mask).to(torch.float64)  # each key's position among the real tokens
    scores = (scores + SLOPES[None, :, None, None] * positions[:, None, None, :]) / math.sqrt(query.shape[-1])
    length = mask.shape[1]
    hidden_keys = torch.ones(length, length, dtype=torch.bool).triu(1)[None, None] | (mask == 0)[:, None, None, :]
    return scores.masked_fill(hidden_keys, -math.inf).softmax(-1)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_capture_reads_the_alibi_bias_once_as_the_sdpa_model_computes(layout):
    """Failed before: the maps were eager's (the bias twice), up to 0.045 away from these, and the logits inside
    the capture up to 7.8e-4 away from the model's (float64); now 6e-17 and 2e-16."""
    model = _falcon(layout)
    ids, mask = padded_inputs()  # a full row, a right-padded and a left-padded one
    hidden: dict[int, torch.Tensor] = {}
    handles = [layer.self_attention.register_forward_pre_hook(
        lambda module, args, kwargs, i=i: hidden.__setitem__(i, kwargs.get("hidden_states", args[0] if args else None)),
        with_kwargs=True) for i, layer in enumerate(model.transformer.h)]
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
        with capture_attention(model) as record:
            inside = model(input_ids=ids, attention_mask=mask).logits
        for handle in handles:
            handle.remove()
        real = mask.bool()
        torch.testing.assert_close(inside[real], expected[real], atol=1e-12, rtol=0)
        for layer, core in enumerate(layer.self_attention for layer in model.transformer.h):
            reference = _alibi_once(core, hidden[layer], mask)
            for row in range(ids.shape[0]):
                rows = real[row]  # the real query positions (a padded query's row is the mask's, not ALiBi's)
                torch.testing.assert_close(record[("dec_self", layer)][row][:, rows], reference[row][:, rows],
                                           atol=1e-12, rtol=0)
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_eager_attention_computes_the_sdpa_model(layout):
    """LRP runs its forward and backward inside eager_attention: the model there is the SDPA model (failed before:
    the logits 7e-4 away), and nothing is left on the model after."""
    model = _falcon(layout)
    ids, mask = padded_inputs()
    hooks = [len(m._forward_pre_hooks) for m in model.modules()]
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
        with eager_attention(model):
            assert model.config._attn_implementation == "eager"
            inside = model(input_ids=ids, attention_mask=mask).logits
            with eager_attention(model):  # nested: the same model
                nested = model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(inside[real], expected[real], atol=1e-12, rtol=0)
    assert torch.equal(nested, inside)
    assert model.config._attn_implementation == "sdpa"
    assert [len(m._forward_pre_hooks) for m in model.modules()] == hooks
    assert not any(key.startswith("_headlab") for key in model.__dict__)


def _never_called(*args, **kwargs):
    pytest.fail("a forward pass ran before the refusal")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_falcon_alibi_loaded_in_eager_mode_is_refused_before_any_work(layout, monkeypatch):
    """Failed before: every entry point measured the doubled-bias model without a word."""
    model = _falcon(layout, "eager")
    data = ImportanceData.from_ids([[5, 6, 7, 8, 1], [9, 10, 1]])
    info = describe_model(model)
    entries = {
        "capture_attention": lambda: capture_attention(model).__enter__(),
        "eager_attention": lambda: eager_attention(model).__enter__(),
        "compute_confidence": lambda: compute_confidence(model, data, info, batch_size=2),
        "compute_gradient": lambda: compute_gradient(model, data, info, batch_size=2),
        "compute_lrp": lambda: compute_lrp(model, data, info, batch_size=2, bootstrap=0),
    }
    with monkeypatch.context() as patched:
        patched.setattr(torch.nn.Module, "__call__", _never_called)
        for call in entries.values():
            with pytest.raises(HeadlabError, match=TWICE):
                call()
    assert model.config._attn_implementation == "eager"
    sdpa = _falcon(layout)  # the same model loaded with SDPA is measured
    assert compute_gradient(sdpa, data, describe_model(sdpa), batch_size=2)["dec_self"].shape == (2, 4)
