"""The probe of a weightless structure, run again on zeros (adapters.discovery._given_values), reads no weight whole.

A structure built from a config on the meta device whose forward reads values (GLM-5-Next's, LFM2's, ...) is probed
with each meta parameter swapped for one zero expanded to its shape. torch's product with such a weight copies it
whole first: ``headlab heads`` on a GLM-5-Next config of hidden 4096 and vocabulary 151552 peaked at 2.9 GB of
resident memory (the LM head's 2.4 GiB copy; 0.47 GB without the probe) and took 32 s. Now a projection whose weight
was swapped returns its bias (or zeros) of its output's shape without reading the weight: 0.48 GB, 0.2 s (session 28;
measured with /usr/bin/time -v, not here: no timed tests).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from headlab import attention_blocks
from headlab.adapters import discovery
from test_mla_pruning import glm5_next


def test_the_zero_value_probe_multiplies_by_no_projections_weight(monkeypatch):
    """Every nn.Linear of the retried probe: before, its forward multiplied by the swapped weight (stride 0), a copy
    of it whole, the LM head's included; now none runs, and the blocks are the same. (GLM-5-Next's own F.linear of
    its hyper-connections' and router's parameters, no projections, still copies those, a few rows each.)"""
    with torch.device("meta"):
        structure = glm5_next(["indexed_attention"] * 2)
    assert all(p.is_meta for p in structure.parameters())
    expanded: list[tuple[int, ...]] = []
    retried: list[int] = []
    forward, given = nn.Linear.forward, discovery._given_values

    def spy(self, x):
        if 0 in self.weight.stride():
            expanded.append(tuple(self.weight.shape))
        return forward(self, x)

    def counted(model):
        retried.append(1)
        return given(model)

    monkeypatch.setattr(nn.Linear, "forward", spy)
    monkeypatch.setattr(discovery, "_given_values", counted)
    names = [b.name for b in attention_blocks(structure)]
    assert retried == [1]  # the forward read values: the probe ran again on zeros
    assert expanded == []
    assert names == ["model.language_model.layers.0.self_attn", "model.language_model.layers.1.self_attn"]
    assert all(p.is_meta for p in structure.parameters())  # the meta tensors are back
    assert all("forward" not in vars(m) for m in structure.modules())  # and the modules' own forwards


def test_a_weightless_projection_gives_what_its_zero_weight_gives():
    """nn.Linear (with and without a bias) and GPT-2's Conv1D: the output of an all-zero weight, its bias at every
    position, of the same shape and dtype, without the weight; an input of another width is refused as the module
    refuses it."""
    torch.manual_seed(0)
    with torch.device("meta"):
        modules = nn.ModuleList([nn.Linear(6, 5), nn.Linear(6, 3, bias=False), Conv1D(4, 6)])
    x = torch.randn(2, 3, 6)
    with discovery._given_values(modules):
        with torch.no_grad():
            for module in modules:
                out = module(x)
                width = module.out_features if isinstance(module, nn.Linear) else module.nf
                assert out.shape == (2, 3, width) and out.dtype == x.dtype
                assert torch.equal(out, torch.zeros(2, 3, width))  # the swapped bias is zeros too
                try:
                    module(torch.randn(2, 3, 7))
                except RuntimeError:
                    pass
                else:
                    raise AssertionError("an input of the wrong width was accepted")
    assert all(p.is_meta for p in modules.parameters())
    real = nn.Linear(6, 5)  # a loaded bias stays: x @ 0 + b is b
    with torch.device("meta"):
        half = nn.Linear(6, 5)
    half.bias = real.bias
    with discovery._given_values(half), torch.no_grad():
        assert torch.equal(half(x), real.bias.expand(2, 3, 5))
