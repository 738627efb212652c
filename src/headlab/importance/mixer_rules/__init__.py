"""LRP rules for the token mixers that hybrid models place beside (or instead of some of) their attention layers, and
for the other parts of a family that rules.py's general rules do not cover (Inkling's shared experts and score biases).

A mixer rule is a plugin: a module of this package that defines one :class:`MixerRule` and declares it with
:func:`register` when imported. :mod:`headlab.importance.rules` asks :func:`rule_for` about every module of the
model: a module some rule matches is checked by the rule's ``problem`` (a layout or forward the rule was not written
for is refused before any work, naming why) instead of being refused outright as a mixer without a rule, and
:func:`headlab.importance.rules.lrp_rules` installs the rule's ``hooks``.

Every rule follows the same principle as headlab's attention rule (rules.py's docstring): the factors a mixer
computes from its own input to weigh its values (the attention weights there; a state-space model's decay and
input/output matrices, a delta rule's keys, queries and betas, a convolution's gates here) are held constant in the
backward pass, so the mixer is a weighted sum of its values and relevance flows through them and the residual
stream, conserved (Jafari et al. 2024, "MambaLRP: Explaining Selective State Space Sequence Models", NeurIPS, which
shows that holding them constant is what conserves relevance through a selective SSM). Forward values stay
bit-for-bit unchanged: hooks only reshape the backward (``y.detach() + (z - z.detach())``).

Two more kinds of plugin declare themselves the same way, for parts rules.py's general rules have no rule for:
:class:`ExpertsRule` (a mixture-of-experts module of a layout of its own: :func:`experts_rule_for`) and
:class:`ScoreBiasRule` (an attention that adds to its scores a bias computed from the layer's input:
:func:`score_bias_rule_for`).

The rule modules are imported on the first call of :func:`rules` (they import rules.py's primitives, and rules.py
asks this package: importing them later keeps one direction of imports at import time).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from torch import nn

__all__ = ["ExpertsRule", "Hook", "MixerRule", "ScoreBiasRule", "experts_rule_for", "owned", "register", "rule_for",
           "rules", "score_bias_rule_for"]

Hook = tuple[nn.Module, str, Callable[..., Any]]
"""Where a rule hooks and how: ``(module, kind, hook)`` with kind ``"forward"`` (a forward hook),
``"forward_kwargs"`` (a forward hook given the keyword arguments too), ``"pre"`` (a forward pre-hook) or
``"pre_kwargs"``."""


@dataclass(frozen=True)
class MixerRule:
    """One LRP rule for one kind of token mixer.

    ``name``: what it is, as a refusal or the docs say it ("Gated DeltaNet (Qwen3-Next, Qwen3.5, ...)").
    ``matches(module)``: whether ``module`` is a mixer of this kind (by class layout, not by family name alone).
    ``problem(module, path)``: why the rule does not fit this module after all (a layout or a forward it was not
    written for, found by reading its parts or a probe forward), as the refusal says it; None where it fits.
    ``hooks(module)``: the hooks that make gradient x input the rule's relevance, installed by ``lrp_rules`` for the
    duration of one explanation and removed after it.
    ``owns(module)``: the modules inside the mixer whose rule its hooks apply (a gated norm ``norm(o, z)``, which
    rules.py's norm rules do not know): rules.py neither refuses them nor gives them a rule of its own. None by
    default.
    """

    name: str
    matches: Callable[[nn.Module], bool]
    problem: Callable[[nn.Module, str], str | None]
    hooks: Callable[[nn.Module], list[Hook]]
    owns: Callable[[nn.Module], list[nn.Module]] = lambda module: []


@dataclass(frozen=True)
class ExpertsRule:
    """The LRP rule for one layout of mixture-of-experts module that rules.py's experts rule does not read.

    ``matches(module)``: whether ``module`` is laid out so; ``problem(module)``: why the rule does not fit it after all
    (layout, a probe forward), None where it fits; ``rule(module, args, kwargs, output)``: the module's forward hook
    (with kwargs) whose output's backward is the rule's (rules.py's ``_experts_rule`` hands it on)."""

    name: str
    matches: Callable[[nn.Module], bool]
    problem: Callable[[nn.Module], str | None]
    rule: Callable[..., Any]


@dataclass(frozen=True)
class ScoreBiasRule:
    """An attention that adds to its scores a bias computed from the layer's input, a factor of the attention weights
    that the attention rule holds constant with the queries and keys.

    ``matches(core)``: whether the attention module ``core`` has such a bias; ``hooks(core)``: ``(module, forward
    hook)`` pairs that detach it; ``problem(block, hooks)``: why the attention rule with ``hooks`` (the block's
    attention hooks, these included) does not fit the block (a probe), None where it does."""

    name: str
    matches: Callable[[nn.Module], bool]
    hooks: Callable[[nn.Module], list[tuple[nn.Module, Any]]]
    problem: Callable[[Any, list[tuple[nn.Module, Any]]], str | None]


_RULES: list[MixerRule | ExpertsRule | ScoreBiasRule] = []

_PLUGINS: tuple[str, ...] = ("gated_delta", "short_conv", "rg_lru", "lightning", "mamba", "inkling", "inkling2",
                             "hyper_connection", "kda", "prophetnet", "convbert")
"""The rule modules of this package, imported on the first :func:`rule_for` (each calls :func:`register`)."""

_loaded = False


_Rule = TypeVar("_Rule", MixerRule, ExpertsRule, ScoreBiasRule)


def register(rule: _Rule) -> _Rule:
    """Declare ``rule`` (called by each rule module when imported)."""
    _RULES.append(rule)
    return rule


def _all_rules() -> list[MixerRule | ExpertsRule | ScoreBiasRule]:
    global _loaded
    if not _loaded:
        _loaded = True
        for name in _PLUGINS:
            importlib.import_module(f"{__name__}.{name}")
    return list(_RULES)


def rules() -> list[MixerRule]:
    """Every registered mixer rule, its plugins loaded."""
    return [rule for rule in _all_rules() if isinstance(rule, MixerRule)]


def _one(kind: type[_Rule], module: nn.Module) -> _Rule | None:
    """The rule of ``kind`` that matches ``module``; None where none does. Two matching are a bug of this package."""
    found = [rule for rule in _all_rules() if isinstance(rule, kind) and rule.matches(module)]
    if len(found) > 1:
        raise AssertionError(f"two LRP {kind.__name__.removesuffix('Rule').lower()} rules match "
                             f"{type(module).__name__}: {[r.name for r in found]}")
    return found[0] if found else None


def rule_for(module: nn.Module) -> MixerRule | None:
    """The mixer rule that matches ``module``; None where none does."""
    return _one(MixerRule, module)


def experts_rule_for(module: nn.Module) -> ExpertsRule | None:
    """The experts rule that matches ``module``; None where none does."""
    return _one(ExpertsRule, module)


def score_bias_rule_for(core: nn.Module) -> ScoreBiasRule | None:
    """The score-bias rule that matches the attention module ``core``; None where none does."""
    return _one(ScoreBiasRule, core)


def owned(model: nn.Module) -> set[int]:
    """The ids of the modules that the mixers' rules apply the rule of (:attr:`MixerRule.owns`) in ``model``."""
    return {id(part) for module in model.modules() if (rule := rule_for(module)) is not None
            for part in rule.owns(module)}
