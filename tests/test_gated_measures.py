"""Every public entry point that measures heads refuses gates the caller attached (sigfollow34).

Inside ``headlab.mask_heads`` (or after ``attach_gates``) an importance measure's own ``run``, ``compute_confidence``,
``compute_lrp``, ``head_relevance``, ``compute_gradient``, ``gate_gradients`` and ``compute_ablation`` measured the
gated model and their tables did not say so (``run_importance`` and the head pass refused it since session 34). They
refuse it before any work; the gates a measurement attaches itself (``run(mask=)``'s mask, ablation's masks, gradient
importance's gates at 1) are its own, also for the entry points it calls.
"""

from dataclasses import replace

import pytest
import torch

from headlab import ScalarGates, attach_gates, detach_gates, mask_heads
from headlab.data.inputs import make_batches
from headlab.errors import HeadlabError
from headlab.importance import (
    ImportanceData,
    compute_ablation,
    compute_confidence,
    compute_gradient,
    compute_lrp,
    describe_model,
    head_relevance,
)
from headlab.importance.ablation import compute_ablation_tables
from headlab.importance.gradient import gate_gradients
from headlab.importance.registry import MEASURES
from support.models import tiny_model

SPEC = {("enc_self", 0): [1]}


@pytest.fixture(scope="module")
def setup():
    torch.set_num_threads(1)
    model = tiny_model("marian")
    g = torch.Generator().manual_seed(3)
    sources = [torch.randint(3, 99, (k,), generator=g).tolist() + [1] for k in (5, 3)]
    references = [torch.randint(3, 99, (k,), generator=g).tolist() + [1] for k in (4, 2)]
    data = replace(ImportanceData.from_ids(sources, references), translations=references)
    return model, data, describe_model(model)


def _batch(model, data, info):
    return next(iter(make_batches(data, info, batch_size=2)))


ENTRY_POINTS = {
    **{f"{name}.run": lambda m, d, i, name=name: MEASURES[name]().run(m, d, i, batch_size=2) for name in MEASURES},
    "compute_confidence": lambda m, d, i: compute_confidence(m, d, i, batch_size=2),
    "compute_lrp": lambda m, d, i: compute_lrp(m, d, i, batch_size=2, bootstrap=0),
    "head_relevance": lambda m, d, i: head_relevance(m, _batch(m, d, i)),
    "compute_gradient": lambda m, d, i: compute_gradient(m, d, i, batch_size=2),
    "gate_gradients": lambda m, d, i: gate_gradients(m, [], i),
    "compute_ablation": lambda m, d, i: compute_ablation(m, d, i, batch_size=2),
    "compute_ablation_tables": lambda m, d, i: compute_ablation_tables(m, d, i, batch_size=2),
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_gates_the_caller_attached_are_refused_before_any_work(setup, entry, monkeypatch):
    """Failed before: each measured the masked model (every layer after the masked head computes on other inputs)
    and its tables did not blank the head nor say that anything was masked."""
    model, data, info = setup
    call = ENTRY_POINTS[entry]
    with mask_heads(model, SPEC), monkeypatch.context() as patched:
        patched.setattr(torch.nn.Module, "__call__", lambda *args, **kwargs: pytest.fail("no forward pass"))
        with pytest.raises(HeadlabError, match=r"the model has gates attached \(headlab_gates: headlab.mask_heads"):
            call(model, data, info)
    gates = ScalarGates.for_model(model)
    attach_gates(model, gates)  # gates attached by hand, at any value, are refused too
    try:
        with pytest.raises(HeadlabError, match="gates attached"):
            call(model, data, info)
    finally:
        detach_gates(model, gates)


def test_the_messages_say_how_to_measure_with_heads_masked(setup):
    model, data, info = setup
    with mask_heads(model, SPEC):
        with pytest.raises(HeadlabError, match=r"^confidence: the model has gates attached .* give mask= \(run's\)"):
            MEASURES["confidence"]().run(model, data, info)
        with pytest.raises(HeadlabError, match=r"^confidence: .* give mask= to the measure's run .* or to run_importance"):
            compute_confidence(model, data, info)
        with pytest.raises(HeadlabError, match=r"^gradient importance: .* give mask= \(compute_gradient's\)"):
            compute_gradient(model, data, info)


@pytest.mark.parametrize("name", list(MEASURES))
def test_a_measurement_s_own_gates_are_not_refused_and_nothing_is_left_behind(setup, name):
    """run(mask=) calls the measure's function inside mask_heads, ablation masks each head and gradient importance
    attaches gates at 1: gates of the measurement itself, never refused. Once it returns, or fails, a caller's gates
    are refused again."""
    model, data, info = setup
    tables = MEASURES[name]().run(model, data, info, mask=SPEC, batch_size=2)
    assert tables and all(torch.isnan(torch.as_tensor(t["enc_self"][0, 1])) for t in tables)
    assert "_headlab_measuring" not in model.__dict__ and not hasattr(model, "headlab_gates")
    with pytest.raises(HeadlabError):  # a measurement that fails half-way leaves no pass behind
        MEASURES[name]().run(model, data, info, mask={("enc_self", 0): [9]}, batch_size=2)
    assert "_headlab_measuring" not in model.__dict__
    with mask_heads(model, SPEC), pytest.raises(HeadlabError, match="gates attached"):
        MEASURES[name]().run(model, data, info, batch_size=2)
