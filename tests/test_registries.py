"""The registries drive everything downstream, and every entry keeps the contract.

Every importance measure on every tiny model family: finite scores for each table it declares (or
a reason it cannot run), no hook left behind, the model's training mode and attention
implementation given back, also when a forward pass fails half-way. Every head statistic on a
treebank: a result that writes files, a README section and labels.
"""

import copy
from dataclasses import replace

import numpy as np
import pytest
import torch

from headlab import mask_heads, prune_heads
from headlab.adapters import attention_blocks, attention_configs
from headlab.data.frequencies import TokenFrequencies
from headlab.functions import AnalysisConfig, analyze_heads
from headlab.functions.registry import STATISTICS
from headlab.gates import measuring
from headlab.importance import ImportanceData, describe_model
from headlab.importance.registry import MEASURES, tables
from headlab.pipeline.pipeline import STAGES
from headlab.report.sections import SECTIONS, render_navigation
from support.models import FAMILIES, SEQ2SEQ, tiny_model
from support.treebank import sample_sentences, word_tokenizer


def _data(seq2seq: bool) -> ImportanceData:
    """Two sentences; a translation model's decoder is teacher-forced on the references."""
    g = torch.Generator().manual_seed(3)
    sources = [torch.randint(3, 99, (k,), generator=g).tolist() + [1] for k in (5, 3)]
    if not seq2seq:
        return ImportanceData.from_ids(sources)
    references = [torch.randint(3, 99, (k,), generator=g).tolist() + [1] for k in (4, 2)]
    return replace(ImportanceData.from_ids(sources, references), translations=references)


def _hooks(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def _implementations(model) -> list[str]:
    return [config._attn_implementation for config in attention_configs(model)]


@pytest.mark.parametrize("name", list(MEASURES))
@pytest.mark.parametrize("family", FAMILIES)
def test_every_measure_on_every_family(family, name):
    torch.set_num_threads(1)
    model = tiny_model(family).train()
    info = describe_model(model)
    data = _data(family in SEQ2SEQ)
    measure = MEASURES[name]()
    hooks, implementations = _hooks(model), _implementations(model)
    reason = measure.unavailable(info, data)
    if reason is not None:
        assert measure.needs_lm_head and not info.has_lm_head
        return
    scored = measure.score_tables(model, data, info, batch_size=2)
    assert [t.method for t in scored] == list(measure.tables)
    for table in scored:
        assert table.kinds, f"{name} scored no kind"
        for kind in table.kinds:
            assert np.isfinite(table[kind]).all(), f"{name} {family} {kind}: {table[kind]}"
    assert model.training and _hooks(model) == hooks and _implementations(model) == implementations
    assert not hasattr(model, "headlab_gates")


@pytest.mark.parametrize("name", list(MEASURES))
def test_score_is_the_first_table(name):
    """A measure defines score or score_tables; the other follows from it."""
    from headlab.importance.measure import ImportanceMeasure

    torch.manual_seed(0)
    model = tiny_model("marian").eval()
    info, data = describe_model(model), _data(True)
    measure = MEASURES[name]()
    one, first = measure.score(model, data, info, batch_size=2), measure.score_tables(model, data, info, batch_size=2)[0]
    assert one.method == first.method == name
    for kind in one.kinds:
        np.testing.assert_allclose(one[kind], first[kind], rtol=1e-5)

    class Neither(ImportanceMeasure):
        name = "neither"

    with pytest.raises(NotImplementedError, match="neither score nor score_tables"):
        Neither().score(model, data, info)


@pytest.mark.parametrize("name", list(MEASURES))
def test_a_failing_forward_leaves_the_model_as_it_was(name):
    model = tiny_model("marian").train()
    info = describe_model(model)
    data = _data(True)
    hooks, implementations = _hooks(model), _implementations(model)
    block = attention_blocks(model)[-1]

    def fail(module, args, output):
        raise RuntimeError("injected")

    handle = block.module.register_forward_hook(fail)
    try:  # a measure that runs the model fails with it; one that reads weights only does not run it
        MEASURES[name]().score_tables(model, data, info, batch_size=2)
    except RuntimeError as error:
        assert "injected" in str(error)
    handle.remove()
    assert model.training and _hooks(model) == hooks and _implementations(model) == implementations
    assert not hasattr(model, "headlab_gates")


@pytest.mark.parametrize("name", list(MEASURES))
@pytest.mark.parametrize("family", ["marian", "gpt2", "bert"])
def test_scoring_under_a_mask_equals_scoring_the_masked_and_the_pruned_model(family, name):
    """``mask=`` composes with the measure's own gates: the scores are those of the model inside
    ``mask_heads``, and those of the model with the heads physically removed (NaN for them)."""
    torch.set_num_threads(1)
    model = tiny_model(family)
    info, data, measure = describe_model(model), _data(family in SEQ2SEQ), MEASURES[name]()
    if measure.unavailable(info, data) is not None:
        return
    kind = attention_blocks(model)[0].kind
    spec = {(kind, 0): [1], (kind, 1): [0, 3]}
    under_mask = measure.run(model, data, info, mask=spec, batch_size=2)
    # (a caller's gates are refused by the measures: inside measuring they are the measurement's own, as in run)
    with measuring(model, name), mask_heads(model, spec):
        masked = [t.without(spec) for t in measure.score_tables(model, data, info, batch_size=2)]
    pruned_model = copy.deepcopy(model)
    prune_heads(pruned_model, spec)
    pruned = measure.score_tables(pruned_model, data, describe_model(pruned_model), batch_size=2)
    assert not hasattr(model, "headlab_gates") and _hooks(model) == 0
    for ours, inside, removed in zip(under_mask, masked, pruned):
        assert ours.method == inside.method == removed.method
        assert np.isnan(ours[kind][0, 1]) and np.isnan(removed[kind][0, 1])
        for k in ours.kinds:
            np.testing.assert_array_equal(ours[k], inside[k])
            np.testing.assert_allclose(ours[k], removed[k], rtol=1e-4, atol=1e-6, err_msg=f"{name} {k}")


def test_lists_come_from_the_registries():
    assert STAGES[: len(MEASURES)] == tuple(MEASURES)
    assert list(tables()) == [t for m in MEASURES.values() for t in m.tables]
    assert render_navigation().count("<a ") == len(SECTIONS)


def test_every_statistic_keeps_the_result_contract(sample_path, tmp_path):  # noqa: F811
    torch.set_num_threads(1)
    sentences = sample_sentences(sample_path.parent)
    tokenizer = word_tokenizer([w for s in sentences for w in s.words])
    counts = np.array([0 if i < 3 else 1000 - i for i in range(len(tokenizer))])
    analysis = analyze_heads(tiny_model("marian"), tokenizer, sample_path,
                             config=AnalysisConfig(top_frequent=3, sensitivity=True),  # every statistic runs
                             frequencies=TokenFrequencies(counts, "hand-set"))
    assert list(analysis.results) == list(STATISTICS)
    for name, result in analysis.results.items():
        assert getattr(analysis, name) is result
        written = result.write(tmp_path / name)
        assert written and all(p.is_file() for p in written), name
        assert all(isinstance(line, str) for line in result.markdown())
        labels = result.labels()
        assert all(isinstance(v, list) and len(k) == 3 for k, v in labels.items()), name
        assert all(isinstance(line, str) for line in result.describe_heads())
    assert "## Positional heads" in analysis.functions_markdown()


def test_measures_compose_with_a_mask():
    """Gates stack: every measure runs under mask_heads, and a masked head has no gradient. (A caller's gates are
    refused by the measures: inside measuring they are the measurement's own, as in ``run(mask=)``.)"""
    torch.set_num_threads(1)
    model = tiny_model("marian")
    info, data = describe_model(model), _data(True)
    with measuring(model, "the measures"), mask_heads(model, {("enc_self", 0): [2]}):
        scored = {t.method: t for name in MEASURES for t in MEASURES[name]().score_tables(model, data, info,
                                                                                            batch_size=2)}
    assert set(scored) == set(tables())
    assert scored["gradient_raw"]["enc_self"][0, 2] == 0 and scored["gradient_raw"]["enc_self"][0, 1] > 0
    assert scored["ablation"]["enc_self"][0, 2] == 0  # masking a masked head changes nothing
    assert not hasattr(model, "headlab_gates")
