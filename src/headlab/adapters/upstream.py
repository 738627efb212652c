"""Known bugs of the installed transformers in a model's own forward, found by running the module's class.

headlab analyses a model as transformers computes it: its maps equal ``output_attentions``, its pruning equals
its masking, its LRP conserves that forward's logits. Where transformers itself computes another function than
the checkpoint's (a bug in the modeling code), every result is exact about a model nobody trained, and nothing in
the results shows it. Such bugs are checked here by behaviour, not by version: a tiny instance of the module's
class, built from a config of its own, is run on inputs whose right output is known, so a transformers that fixes
the bug stops the warning by itself. A model with such a module gets one warning per class and process, naming
the module and what it computes; the analysis then runs, as transformers computes the model.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def _nllb_moe_experts(cls: type[nn.Module]) -> str | None:
    """NLLB-MoE's experts (``NllbMoeExperts(config, ffn_dim)``, ``forward(hidden_states, router_mask,
    router_probs)``; read in transformers 5.24, models/nllb_moe): token ``t`` routed to expert ``t`` alone, with
    weight 1, must come out as ``expert_t(h_t)``. transformers 5.24 one-hot encodes the router's mask, which is
    one-hot already, and runs the expert named by the mask's value (0 or 1) instead of the expert's index."""
    import transformers

    experts = 4
    config = transformers.NllbMoeConfig(d_model=4, num_experts=experts, moe_token_dropout=0.0,
                                        activation_function="relu", activation_dropout=0.0)
    module: Any = cls(config, 3).double().eval()  # a ModuleDict of experts
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=torch.float64))
        hidden = torch.randn(experts, 4, generator=generator, dtype=torch.float64)
        routed = torch.eye(experts, dtype=torch.long)  # token t to expert t, the router's top-1 mask
        out = module(hidden, routed, routed.to(torch.float64))
        right = torch.stack([module[f"expert_{t}"](hidden[t]) for t in range(experts)])
        by_expert_1 = module["expert_1"](hidden)  # what transformers 5.24's bug computes for every token
    if torch.allclose(out, right, rtol=1e-12, atol=1e-12):
        return None
    ran = [t for t in range(experts) if torch.allclose(out[t], right[t], rtol=1e-12, atol=1e-12)]
    how = ("it one-hot encodes the router's top-1 mask, one-hot already, so expert_1 computes every token's first "
           "expert, expert_0 its second, with their routing weights, and the other experts never run"
           if torch.allclose(out, by_expert_1, rtol=1e-12, atol=1e-12) else "other experts than the router's, or "
           "other weights")
    return (f"{cls.__name__}.forward (transformers {transformers.__version__}) runs other experts than the router "
            f"chose: a tiny {cls.__name__} given each token routed to one expert computed the right output for "
            f"expert{'s' if len(ran) != 1 else ''} {', '.join(map(str, ran)) or 'none'} of {experts} only ({how}); "
            "this model's outputs are not its checkpoint's, and headlab's results are exact about the model as "
            "transformers computes it")


PROBES: dict[str, Callable[[type[nn.Module]], str | None]] = {"NllbMoeExperts": _nllb_moe_experts}
"""Module class names -> a probe of the class: what the installed transformers computes wrong, or None."""


_found: dict[type, str | None] = {}


def class_problem(cls: type[nn.Module]) -> str | None:
    """What :data:`PROBES` finds wrong in ``cls`` (None: nothing, or no probe for it; a probe that cannot build or
    run the class, as a transformers whose API changed, finds nothing: the bug it looks for is gone with that API)."""
    probe = PROBES.get(cls.__name__)
    if probe is None:
        return None
    if cls not in _found:  # once per class and process
        try:
            _found[cls] = probe(cls)
        except Exception:  # noqa: BLE001 - another API than the probe's: not the bug it checks for
            _found[cls] = None
    return _found[cls]


_warned: set[type] = set()


def warn_upstream_bugs(model: Any) -> None:
    """Warn, once per class and process, about each module class of ``model`` that :data:`PROBES` finds computing
    wrong."""
    if not isinstance(model, nn.Module):
        return
    for cls in {type(m) for m in model.modules() if type(m).__name__ in PROBES} - _warned:
        problem = class_problem(cls)
        if problem is not None:
            _warned.add(cls)
            warnings.warn(f"{type(model).__name__}: a bug of transformers: {problem}", UserWarning, stacklevel=3)
