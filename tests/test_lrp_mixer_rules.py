"""The plugin interface of LRP's mixer rules (headlab.importance.mixer_rules): a registered rule's refusal
replaces the blanket one for mixers without a rule, its hooks are installed for one explanation and removed after
it, and two rules matching one module are a bug."""

import pytest
import torch
from torch import nn

from headlab.errors import HeadlabError
from headlab.importance import mixer_rules, rules
from headlab.importance.mixer_rules import MixerRule


class _Mixer(nn.Module):
    """A stand-in token mixer with a state-space decay (A_log), which rules.py refuses without a rule."""

    def __init__(self):
        super().__init__()
        self.A_log = nn.Parameter(torch.zeros(2))
        self.proj = nn.Linear(2, 2)

    def forward(self, x):
        return self.proj(x)


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setattr(mixer_rules, "_RULES", [])
    monkeypatch.setattr(mixer_rules, "_loaded", True)
    monkeypatch.setattr(rules, "attention_blocks", lambda model: [])  # the stand-in models hold no attention
    return mixer_rules._RULES


def test_a_mixer_without_a_rule_is_refused(registered):
    problem = rules._no_rule(_Mixer(), "layers.0.mixer", set())
    assert problem is not None and "state-space" in problem


def test_a_registered_rule_decides_and_names_itself_in_its_refusal(registered):
    verdicts = {"fits": None, "misfit": "its conv has a bias"}
    for label, verdict in verdicts.items():
        registered[:] = [MixerRule(name=f"the {label} rule", matches=lambda m: isinstance(m, _Mixer),
                                   problem=lambda m, path, v=verdict: v, hooks=lambda m: [])]
        problem = rules._no_rule(_Mixer(), "layers.0.mixer", set())
        assert problem == (None if verdict is None else f"the {label} rule: {verdict}")


def test_the_rules_hooks_are_installed_for_the_explanation_only(registered):
    calls = []
    model = nn.Sequential(_Mixer())
    registered.append(MixerRule(
        name="stand-in", matches=lambda m: isinstance(m, _Mixer), problem=lambda m, path: None,
        hooks=lambda m: [(m.proj, "forward", lambda mod, args, out: calls.append("forward")),
                         (m, "pre", lambda mod, args: calls.append("pre"))]))
    x = torch.randn(1, 2)
    with rules.lrp_rules(model, blocks=[]):
        model(x)
    model(x)
    assert calls == ["pre", "forward"]


def test_two_rules_matching_one_module_are_a_bug(registered):
    for name in ("a", "b"):
        registered.append(MixerRule(name=name, matches=lambda m: True, problem=lambda m, p: None,
                                    hooks=lambda m: []))
    with pytest.raises(AssertionError, match="two LRP mixer rules"):
        mixer_rules.rule_for(_Mixer())


def test_a_misfit_refuses_before_any_work(registered):
    registered.append(MixerRule(name="stand-in", matches=lambda m: isinstance(m, _Mixer),
                                problem=lambda m, path: "not laid out so", hooks=lambda m: []))
    with pytest.raises(HeadlabError, match="stand-in: not laid out so"), rules.lrp_rules(nn.Sequential(_Mixer()),
                                                                                        blocks=[]):
        pass


class _ScaleNorm(nn.Module):
    """A normalisation rules.py has no rule for (its class says norm), called with a second input, as a gated norm is."""

    def forward(self, x, gate):
        return x / x.norm(dim=-1, keepdim=True) * torch.sigmoid(gate)


class _GatedMixer(_Mixer):
    def __init__(self):
        super().__init__()
        self.norm = _ScaleNorm()

    def forward(self, x):
        return self.norm(self.proj(x), x)


def test_the_parts_a_rule_owns_are_neither_refused_nor_given_a_rule(registered):
    """A mixer's gated norm ``norm(o, z)`` is the mixer rule's (``MixerRule.owns``, session 35: the Gated DeltaNet's):
    rules.py neither refuses it as a normalisation without a rule nor hooks it. Without ``owns`` it is refused."""
    model = nn.Sequential(_GatedMixer())
    calls = []
    rule = MixerRule(name="stand-in", matches=lambda m: isinstance(m, _Mixer), problem=lambda m, path: None,
                     hooks=lambda m: [(m.norm, "forward", lambda mod, args, out: calls.append("norm"))])
    registered.append(rule)
    with pytest.raises(HeadlabError, match=r"no rule for the normalisation module _ScaleNorm \(at 0.norm\)"):
        rules.check_rules(model)
    registered[:] = [MixerRule(name=rule.name, matches=rule.matches, problem=rule.problem, hooks=rule.hooks,
                               owns=lambda m: [m.norm])]
    rules.check_rules(model)
    with rules.lrp_rules(model, blocks=[]):
        model(torch.randn(1, 2))
    assert calls == ["norm"]
