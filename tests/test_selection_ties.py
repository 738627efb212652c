"""Sparse attention's key selection, the same for a sentence alone and in a padded batch (headlab.portable_code).

The variant sweep of session 40 found it: on GLM-MoE-DSA and dots3-note with ``attention_bias=True`` a right-padded
row's logits were 5e-3 from the row alone. Two keys tied at index score 0 at the indexer's top-k boundary, and
``Tensor.topk`` kept one or the other by the tensor's length. Here every index score is made 0 (the indexers'
``weights_proj`` zeroed), so every selection is a tie: transformers' own forward then differs between the padded row
and the row alone by about 0.09 in the logits (the three DSA models below, measured before the fix), and headlab's,
ties to the lowest index, not at all.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaIndexer

from headlab import HeadlabError, attention_blocks
from headlab.capture import capture_attention
from headlab.portable_code import install_tie_rule, is_indexer, stable_topk
from support.family_matrix import logits
from test_sparse_attention import FAMILIES, TOPK, tiny_model


def test_ties_go_to_the_lowest_index():
    scores = torch.tensor([[0.0, 3.0, 0.0, 1.0, 0.0, 0.0], [-1.0, -1.0, -1.0, -1.0, -1.0, -1.0]])
    top = stable_topk(scores, 3)
    assert top.indices.tolist() == [[1, 3, 0], [0, 1, 2]]
    assert top.values.tolist() == [[3.0, 1.0, 0.0], [-1.0, -1.0, -1.0]]
    assert stable_topk(scores, 2, largest=False).indices.tolist() == [[0, 2], [0, 1]]


@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("largest", [True, False])
def test_on_distinct_scores_it_is_topk(dim, largest):
    scores = torch.randn(5, 6, 7, generator=torch.Generator().manual_seed(0))
    ours, theirs = stable_topk(scores, 3, dim=dim, largest=largest), torch.topk(scores, 3, dim=dim, largest=largest)
    assert torch.equal(ours.values, theirs.values) and torch.equal(ours.indices, theirs.indices)


def _all_tied(family: str) -> torch.nn.Module:
    model = tiny_model(family, "eager")
    for module in model.modules():
        if is_indexer(module):
            torch.nn.init.zeros_(module.weights_proj.weight)  # every index score 0: every selection a tie
    return model


def _padded_and_alone(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 99, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    ids[1, 5:] = model.config.pad_token_id
    padded = logits(model, {"input_ids": ids, "attention_mask": mask})[1, :5]
    alone = logits(model, {"input_ids": ids[1:2, :5], "attention_mask": mask[1:2, :5]})[0]
    return padded, alone


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_row_equals_the_row_alone(family):
    model = _all_tied(family)
    attention_blocks(model)
    padded, alone = _padded_and_alone(model)
    torch.testing.assert_close(padded, alone, atol=1e-6, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_tied_keys_kept_are_the_first(family):
    """All index scores tied: query i keeps keys 0 .. min(i, TOPK - 1), in every layer's map."""
    model = _all_tied(family)
    inputs = {"input_ids": torch.randint(3, 99, (1, 7), generator=torch.Generator().manual_seed(2))}
    with capture_attention(model) as record:
        logits(model, inputs)
    kept = torch.tril(torch.ones(7, 7, dtype=torch.bool))
    kept[:, TOPK:] = False
    assert record
    for probs in record.values():
        assert torch.equal(probs[0] > 0, kept.expand_as(probs[0]))


def test_installed_once():
    model = _all_tied("glm_moe_dsa")
    install_tie_rule(model)
    install_tie_rule(model)
    indexers = [m for m in model.modules() if is_indexer(m)]
    assert indexers
    for indexer in indexers:  # one subclass of the same name over transformers' class
        assert [c.__name__ for c in type(indexer).__mro__].count("GlmMoeDsaIndexer") == 2


def test_a_forward_set_on_the_instance_keeps_the_rule():
    """accelerate's hooks replace ``module.forward`` on the instance, which would skip the class's."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    model = _all_tied("glm_moe_dsa")
    for module in model.modules():
        if is_indexer(module):
            add_hook_to_module(module, ModelHook())
    attention_blocks(model)
    padded, alone = _padded_and_alone(model)
    torch.testing.assert_close(padded, alone, atol=1e-6, rtol=0)


# A model's own indexer classes (trust_remote_code: defined in its modeling file, not in transformers.models): classes
# defined here stand in for them, on GLM-MoE-DSA's layers.
class GlmMoeDsaOwnIndexer(GlmMoeDsaIndexer):
    """A remote modeling file's copy of the indexer: its own class, transformers' computation (``topk``)."""

    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs)


class SortingIndexer(GlmMoeDsaIndexer):
    """An own indexer that keeps its keys by an argsort of the index scores, which the tie rule does not reach."""

    def forward(self, hidden_states, *args, **kwargs):
        scores = hidden_states[..., :1].expand(*hidden_states.shape[:-1], hidden_states.shape[1])
        return scores.argsort(-1, descending=True)[..., :TOPK].to(torch.int32)


class PositionIndexer(torch.nn.Module):
    """Named an indexer, selecting nothing."""

    def forward(self, x):
        return torch.arange(x.shape[1])


def _with_own_indexers(cls) -> torch.nn.Module:
    model = _all_tied("glm_moe_dsa")
    for module in model.modules():
        if isinstance(module, GlmMoeDsaIndexer):  # transformers' class, or headlab's over it
            module.__class__ = cls
    return model


def test_a_models_own_indexer_gets_the_tie_rule():
    """Before (session 42): only transformers' classes were swapped, and a remote-code indexer broke its ties by the
    tensor's length: the padded row's logits were 0.091 from the row alone's."""
    model = _with_own_indexers(GlmMoeDsaOwnIndexer)
    attention_blocks(model)
    indexers = [m for m in model.modules() if isinstance(m, GlmMoeDsaOwnIndexer)]
    assert indexers and all(is_indexer(m) and type(m).__mro__[1] is GlmMoeDsaOwnIndexer for m in indexers)
    padded, alone = _padded_and_alone(model)
    torch.testing.assert_close(padded, alone, atol=1e-6, rtol=0)


def test_an_own_indexer_that_selects_otherwise_is_refused():
    model = _with_own_indexers(SortingIndexer)
    with pytest.raises(HeadlabError, match=r"the sparse-attention indexer SortingIndexer \(model.layers.0.self_attn."
                                           r"indexer, the model's own code, [\w.]*test_selection_ties\) selects its "
                                           r"keys with argsort, not topk"):
        attention_blocks(model)
    assert not any(getattr(type(m), "_headlab_lowest_index_ties", False) for m in model.modules())  # none changed


def test_an_own_module_named_indexer_that_selects_nothing_is_left_alone():
    module = PositionIndexer()
    install_tie_rule(module)
    assert not is_indexer(module) and type(module) is PositionIndexer
