"""ProphetNet's decoder self-attention's relative-position scores held constant (a :class:`~.ScoreBiasRule`).

transformers 5.24 (models/prophetnet/modeling_prophetnet.py): ``ProphetNetNgramSelfAttention`` adds to each stream's
scores ``q k^T / sqrt(d)`` relative-position scores projected from that stream's hidden states
(``relative_pos_embeddings``, a row per (bucket, head), gathered by the buckets of the query's relative positions), then
takes the softmax. Those scores are a factor of the attention weights, as the queries and keys are: the attention rule
holds them constant with them (``relative_pos_embeddings``' output detached), so the attention is a weighted sum of its
values and relevance flows through the values and the residual stream only.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from headlab.importance.mixer_rules import ScoreBiasRule, register


def is_ngram_attention(core: nn.Module) -> bool:
    """ProphetNet's decoder self-attention, its relative-position projection a Linear."""
    return type(core).__name__ == "ProphetNetNgramSelfAttention" and \
        isinstance(getattr(core, "relative_pos_embeddings", None), nn.Linear)


def score_bias_hooks(core: nn.Module) -> list[tuple[nn.Module, Any]]:
    """The forward hook that detaches ``relative_pos_embeddings``' output."""
    from headlab.importance.rules import _detach_output

    return [(core.get_submodule("relative_pos_embeddings"), _detach_output)]


SCORE_BIASES = register(ScoreBiasRule(
    name="ProphetNet's relative-position scores (held constant with the queries and keys)",
    matches=is_ngram_attention, hooks=score_bias_hooks, problem=lambda block, hooks: None))
