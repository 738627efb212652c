"""LRP on a sample of target positions (``--lrp-targets K``) and the bootstrap standard error of
its scores: K at least a sentence's length changes nothing, a seed fixes the sample, sampled
targets take the batched path and each one's relevance is still conserved, the standard error
behaves as a standard error, and a negative K is refused before any work."""

import json

import numpy as np
import pytest
import torch

from headlab.cli import main
from headlab.heads import HeadScores
from headlab.importance import (
    ImportanceData,
    compute_lrp,
    describe_model,
    head_relevance,
    lrp_rules,
    make_batches,
    translate_data,
)
from headlab.importance.lrp import _slot_selectors, _slots, bootstrap_stderr, sample_targets
from support.bad_input import SENTENCES, forbid_model_loading, save_tiny_marian
from support.models import tiny_model

LENGTHS = [5, 9, 12, 7, 3, 10]


def _data(lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return ImportanceData.from_ids([torch.randint(3, 99, (k,), generator=g).tolist() for k in lengths])


def _prepared(family, data):
    model = tiny_model(family)
    info = describe_model(model)
    if info.is_seq2seq:
        data = translate_data(model, data, info, max_length_a=0, max_length_b=8)
    return model, info, data


@pytest.mark.parametrize("family", ["llama", "marian"])
def test_k_at_least_every_sentence_length_equals_all_positions_exactly(family):
    model, info, data = _prepared(family, _data())
    longest = max(len(s) for s in (data.translations or data.sources))
    every = compute_lrp(model, data, info, batch_size=4)
    for k in (longest, longest + 5):
        sampled = compute_lrp(model, data, info, batch_size=4, targets=k)
        assert sampled.signature["n_steps"] == every.signature["n_steps"]
        for kind in every.kinds:
            assert np.array_equal(sampled[kind], every[kind])
        assert sampled.signature["bootstrap"] == every.signature["bootstrap"]
    assert every.signature["targets_per_sentence"] == "all"
    assert compute_lrp(model, data, info, batch_size=4, targets=0).scores.keys() == every.scores.keys()


def test_sample_is_seeded_per_sentence_and_sized_min_k_steps():
    model, info, data = _prepared("llama", _data())
    k = 4
    first = compute_lrp(model, data, info, batch_size=4, targets=k, seed=3)
    again = compute_lrp(model, data, info, batch_size=4, targets=k, seed=3)
    other_batches = compute_lrp(model, data, info, batch_size=2, targets=k, seed=3)
    other_seed = compute_lrp(model, data, info, batch_size=4, targets=k, seed=4)
    assert first.signature["n_steps"] == sum(min(k, n) for n in LENGTHS)
    assert first.signature["target_sample"] == {"seed": 3, "n_available_steps": sum(LENGTHS)}
    assert np.array_equal(first["dec_self"], again["dec_self"])
    assert first.signature["bootstrap"] == again.signature["bootstrap"]
    # The sample of a sentence depends on (seed, sentence number) only, not on the batching.
    np.testing.assert_allclose(other_batches["dec_self"], first["dec_self"], rtol=1e-6, atol=1e-9)
    assert not np.allclose(other_seed["dec_self"], first["dec_self"])

    steps = torch.ones(3, 12, dtype=torch.bool)
    steps[1, 5:] = False  # 5 steps
    steps[2, 3:] = False  # 3 steps: fewer than k, all kept
    chosen = sample_targets(steps, [0, 1, 2], k, seed=3)
    assert chosen.sum(1).tolist() == [4, 4, 3] and not (chosen & ~steps).any()
    assert torch.equal(chosen[2], steps[2])
    full = torch.ones(2, 12, dtype=torch.bool)
    assert torch.equal(sample_targets(full, [8, 7], k, seed=3)[1], sample_targets(full[:1], [7], k, seed=3)[0])


@pytest.mark.parametrize("family", ["llama", "gpt2", "marian"])
def test_sampled_targets_take_the_batched_path_and_equal_one_backward_each(family):
    model, info, data = _prepared(family, _data())
    batch = next(make_batches(data, info, batch_size=4))
    steps = sample_targets(batch.steps, batch.index, 2, seed=1)
    assert (steps.sum(1) == batch.steps.sum(1).clamp(max=2)).all()
    rank, n_slots = _slots(steps)
    assert n_slots == 2  # two batched backward slices for the whole batch, wherever the targets sit
    from dataclasses import replace

    sampled = replace(batch, steps=steps)
    batched = head_relevance(model, sampled, strategy="vmap")
    single = head_relevance(model, sampled, strategy="jacobian")  # one backward per target
    assert torch.equal(batched.steps, steps.nonzero())
    for key, values in single.relevance.items():
        torch.testing.assert_close(batched.relevance[key], values, rtol=1e-4, atol=1e-6)


def test_relevance_is_conserved_per_sampled_target():
    """Through the slot selectors of the batched backward, each sampled target's relevance at the
    embeddings sums to its own logit (bias-free model, float64): slots mix no targets."""
    model = tiny_model("llama").double()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.zero_()
    info = describe_model(model)
    batch = next(make_batches(_data(), info, batch_size=4))
    steps = sample_targets(batch.steps, batch.index, 3, seed=2)
    rank, n_slots = _slots(steps)
    with torch.enable_grad(), lrp_rules(model):
        out = model(**batch.inputs, output_hidden_states=True)
        y = out.logits.max(-1).values  # the top-1 logit of every position
        embeddings = out.hidden_states[0]
        grads, = torch.autograd.grad(y, [embeddings], grad_outputs=_slot_selectors(steps, rank, 0, n_slots, y),
                                     is_grads_batched=True)
    relevance = (grads * embeddings.detach()).sum((-1, -2))  # [slots, batch]
    rows, positions = steps.nonzero(as_tuple=True)
    expected = y.detach()[rows, positions]
    got = relevance[rank[rows, positions], rows]
    np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-9)
    assert len(got) == sum(min(3, n) for n in sorted(LENGTHS, reverse=True)[:4])


def test_bootstrap_standard_error_behaves_as_one():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 3))
    ones = np.ones(40)
    # One target per sentence: the bootstrap standard error of a mean is std / sqrt(n).
    se = bootstrap_stderr(x, ones, resamples=4000, seed=0)
    np.testing.assert_allclose(se, x.std(0) / np.sqrt(40), rtol=0.08)
    # Four times the sentences (the same ones repeated): half the error.
    four = bootstrap_stderr(np.tile(x, (4, 1)), np.tile(ones, 4), resamples=4000, seed=0)
    np.testing.assert_allclose(four / se, 0.5, rtol=0.1)
    # Seeded; identical sentences: no error; one sentence or no resample: unknown.
    assert np.array_equal(bootstrap_stderr(x, ones, 200, 5), bootstrap_stderr(x, ones, 200, 5))
    assert np.allclose(bootstrap_stderr(np.tile(x[:1] * 3, (10, 1)), np.full(10, 3.0), 200, 0), 0, atol=1e-12)
    assert np.isnan(bootstrap_stderr(x[:1], ones[:1], 200, 0)).all()
    assert np.isnan(bootstrap_stderr(x, ones, 0, 0)).all()



def test_bootstrap_standard_error_agrees_with_scipy():
    """The hand-written bootstrap stays (its multinomial weights are a matrix product: 0.13 s
    where scipy.stats.bootstrap took 4.8 s at 60 sentences x 384 heads x 4000 resamples, and
    its seeded stream fixes the standard errors already written): scipy's, resampling the
    same sentences in pairs (sums, counts), gives the same standard error up to Monte Carlo
    noise, with targets per sentence from 1 to 29."""
    scipy_stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(1)
    counts = rng.integers(1, 30, size=60).astype(float)
    sums = (rng.normal(size=(60, 8)) + rng.gamma(2, size=(60, 1))) * counts[:, None]
    ours = bootstrap_stderr(sums, counts, resamples=4000, seed=0)
    theirs = scipy_stats.bootstrap((sums, counts[:, None]), lambda s, c, axis: s.sum(axis) / c.sum(axis),
                                   paired=True, vectorized=True, n_resamples=4000, method="percentile", rng=0,
                                   axis=0).standard_error
    # Each estimate's relative Monte Carlo error is about 1 / sqrt(2 * 4000) = 1.1%.
    np.testing.assert_allclose(ours, theirs, rtol=0.06)
    assert abs(float(np.mean(ours / theirs)) - 1) < 0.03


def test_lrp_writes_its_standard_error_beside_the_scores(tmp_path):
    model, info, _ = _prepared("llama", _data())
    same = ImportanceData.from_ids([list(range(3, 12))] * 5)
    identical = compute_lrp(model, same, info, batch_size=5)
    errors = identical.stderr()
    assert errors.method == "lrp_stderr" and errors.signature["resamples"] == 200
    assert errors["dec_self"].shape == identical["dec_self"].shape
    assert np.allclose(errors["dec_self"], 0, atol=1e-9)  # every resample is the same sentences
    # With 4 of the 9 positions sampled, the copies explain different targets: the bootstrap over
    # sentences also measures the error of the target sample.
    assert (compute_lrp(model, same, info, batch_size=5, targets=4).stderr()["dec_self"] > 1e-4).all()

    scores = compute_lrp(model, _data(), info, batch_size=4, targets=4, bootstrap=50)
    path = scores.save(tmp_path / "lrp.json")
    loaded = HeadScores.load(path).stderr()
    assert loaded.signature["resamples"] == 50
    assert (loaded["dec_self"] > 0).all() and (loaded["dec_self"] < 1).all()
    assert "bootstrap" not in compute_lrp(model, _data(), info, batch_size=4, bootstrap=0).signature
    assert json.loads(path.read_text())["signature"]["targets_per_sentence"] == 4


@pytest.mark.parametrize("command", ["importance", "analyze"])
def test_negative_k_is_a_usage_error_before_work(command, tmp_path, capsys, monkeypatch):
    save_tiny_marian(tmp_path / "model")
    (tmp_path / "src.txt").write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    data_flag = "--data" if command == "importance" else "--source"
    forbid_model_loading(monkeypatch)
    out = tmp_path / "out"
    code = main([command, str(tmp_path / "model"), data_flag, str(tmp_path / "src.txt"), "--out", str(out),
                 "--lrp-targets", "-1", "--no-progress"])
    assert code == 2
    err = capsys.readouterr().err
    assert "--lrp-targets must be at least 0, got -1" in err and "Traceback" not in err
    assert not out.exists() or not any(out.iterdir())


def test_report_and_heads_table_show_the_standard_error(tmp_path):
    from headlab.pipeline.table import heads_table
    from headlab.report.collect import collect

    scores = HeadScores({"dec_self": [[0.5, 0.5], [0.25, 0.75]]}, "lrp", "m", {
        "bootstrap": {"resamples": 200, "seed": 0, "unit": "sentence",
                      "stderr": {"dec_self": [[0.01, 0.02], [None, 0.04]]}}})
    scores.save(tmp_path / "importance" / "lrp.json")
    maps = {m["name"]: m for m in collect(tmp_path).heatmaps}
    assert maps["lrp_stderr"]["scores"] == {"dec_self": [[0.01, 0.02], [None, 0.04]]}
    assert "standard error" in maps["lrp_stderr"]["title"] and "200 resamples" in maps["lrp_stderr"]["caption"]
    columns, rows = heads_table(tmp_path)
    assert columns == ["model", "run", "kind", "layer", "head", "lrp", "lrp_stderr"]
    assert rows[1] == ["m", tmp_path.name, "dec_self", 0, 1, 0.5, 0.02] and rows[2][6] is None
