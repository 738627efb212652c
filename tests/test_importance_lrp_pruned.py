"""LRP on physically pruned models whose layers keep no head: the output projection's bias that
such a layer still adds (ZeroHeadAttention) is a bias neuron like any other, so relevance is
conserved (it used to be lost: 0.953 of the logit with a decoder cross-attention layer left empty)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from headlab import prune_heads
from headlab.importance import ImportanceData, compute_lrp, describe_model, translate_data
from support.models import tiny_model

ALL = [0, 1, 2, 3]


def _data(n=4, seed=0, eos=1):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 8, (n,), generator=g).tolist()
    return ImportanceData.from_ids([torch.randint(3, 99, (k,), generator=g).tolist() + [eos] for k in lengths])


@pytest.mark.parametrize("family, spec, eos", [
    ("marian", {("dec_cross", 1): ALL, ("dec_self", 0): [0, 1, 3], ("enc_self", 0): [1, 2]}, 1),
    ("marian", {("dec_self", 1): ALL}, 1),
    ("marian", {("enc_self", 1): ALL}, 1),
    ("gpt2", {("dec_self", 0): ALL, ("dec_self", 1): [2]}, 0),
    ("bert", {("enc_self", 0): ALL, ("enc_self", 1): [0, 2, 3]}, 1),
])
def test_lrp_conserves_with_a_layer_left_without_heads(family, spec, eos):
    model = tiny_model(family)
    prune_heads(model, spec)
    info, data = describe_model(model), _data(eos=eos)
    if model.config.is_encoder_decoder:  # LRP explains the model's own translation
        data = translate_data(model, data, info, max_length_a=0, max_length_b=6)
    scores = compute_lrp(model, data, info)
    conservation = scores.signature["conservation"]["with_biases"]
    assert abs(conservation["min"] - 1) < 1e-3 and abs(conservation["max"] - 1) < 1e-3, conservation
    for (kind, layer), heads in spec.items():  # removed heads unscored, the kept ones scored
        assert np.isnan(scores[kind][layer, heads]).all()
        kept = [h for h in ALL if h not in heads]
        assert not np.isnan(scores[kind][layer, kept]).any()
