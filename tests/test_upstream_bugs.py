"""A bug of transformers in a model's own forward is said, not analysed in silence (session 43).

transformers 5.24's ``NllbMoeExperts.forward`` one-hot encodes the router's top-1 mask, which is one-hot already:
``expert_1`` computes every token's first expert, ``expert_0`` its second, and no other expert runs. headlab analyses
the model as transformers computes it, exactly, so every result was about a model nobody trained, with nothing to
show it. Now building the attention blocks of a model with such a module warns once, naming the module. The checks
here compute the right output themselves, so they hold on a transformers that fixes the bug (no warning then)."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers as tf
from torch import nn
from transformers.models.nllb_moe.modeling_nllb_moe import NllbMoeExperts

from headlab.adapters import attention_blocks, upstream


def _tiny_nllb_moe() -> nn.Module:
    config = tf.NllbMoeConfig(vocab_size=99, d_model=16, encoder_layers=1, decoder_layers=1, encoder_ffn_dim=8,
                              decoder_ffn_dim=8, encoder_attention_heads=2, decoder_attention_heads=2, num_experts=4,
                              encoder_sparse_step=1, decoder_sparse_step=1, pad_token_id=0, eos_token_id=1,
                              bos_token_id=0, decoder_start_token_id=1, max_position_embeddings=32)
    torch.manual_seed(0)
    return tf.NllbMoeForConditionalGeneration(config).eval()


def _routes_right(cls: type[nn.Module]) -> bool:
    """Whether ``cls`` gives a token routed to expert 3 alone, weight 1, expert 3's output (written apart from the
    probe: three tokens, other shapes)."""
    config = tf.NllbMoeConfig(d_model=6, num_experts=5, moe_token_dropout=0.0)
    torch.manual_seed(1)
    module = cls(config, 5).double().eval()
    hidden = torch.randn(3, 6, dtype=torch.float64)
    mask = torch.zeros(3, 5, dtype=torch.long)
    mask[:, 3] = 1
    with torch.no_grad():
        return torch.allclose(module(hidden, mask, mask.double()), module["expert_3"](hidden))


class _FixedExperts(NllbMoeExperts):
    """The experts as the router means them: token ``t`` through each expert ``e`` with ``mask[t, e]``, weighted."""

    def forward(self, hidden_states, router_mask, router_probs):
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            rows = router_mask[:, e].bool()
            if rows.any():
                out[rows] += self[f"expert_{e}"](hidden_states[rows]) * router_probs[rows, e, None]
        return out


def test_the_probe_finds_what_the_module_computes():
    problem = upstream.class_problem(NllbMoeExperts)
    assert (problem is None) == _routes_right(NllbMoeExperts)
    if problem is not None:
        assert "NllbMoeExperts.forward" in problem and f"transformers {tf.__version__}" in problem


def test_the_installed_transformers_5_24_bug_is_explained():
    if _routes_right(NllbMoeExperts):
        pytest.skip("this transformers routes NLLB-MoE's experts right")
    problem = upstream.class_problem(NllbMoeExperts)
    assert problem is not None and "expert_1 computes every token's first expert" in problem


def test_a_right_forward_gives_no_problem():
    assert _routes_right(_FixedExperts)
    assert upstream.class_problem(_FixedExperts) is None


def test_building_the_blocks_warns_once(monkeypatch):
    monkeypatch.setattr(upstream, "_warned", set())
    model = _tiny_nllb_moe()
    buggy = not _routes_right(NllbMoeExperts)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        attention_blocks(model)
        attention_blocks(model)
    said = [str(w.message) for w in caught if "a bug of transformers" in str(w.message)]
    assert len(said) == (1 if buggy else 0), said
    if buggy:
        assert said[0].startswith("NllbMoeForConditionalGeneration: a bug of transformers: NllbMoeExperts.forward")


def test_a_model_with_right_experts_is_not_warned(monkeypatch):
    monkeypatch.setattr(upstream, "_warned", set())
    model = _tiny_nllb_moe()
    swapped = [m for m in model.modules() if type(m) is NllbMoeExperts]
    for experts in swapped:
        experts.__class__ = _FixedExperts
    assert swapped
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        attention_blocks(model)
    assert not [w for w in caught if "a bug of transformers" in str(w.message)]


def test_a_probe_that_cannot_run_finds_nothing():
    """A class of another API than the probe's (a transformers that rewrote it) is not the bug the probe knows."""

    class NllbMoeExperts(nn.Module):  # the name, another constructor
        def __init__(self):
            super().__init__()

    assert upstream.class_problem(NllbMoeExperts) is None
