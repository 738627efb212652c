"""A model compiled with torch.compile under headlab (headlab.compiled): never a silent wrong result.

Dynamo does not guard on module hooks (``torch._dynamo.config.skip_nnmodule_hook_guards``): a wrapper compiled before
``mask_heads`` ran unmasked inside it (0.15 from the masked logits, torch 2.13). The hook-guard behaviour is dynamo's,
whatever the backend: ``backend="eager"`` reproduces it and compiles in a second on CPU. Each test reset dynamo after
it, so that no later test's headlab context finds compiled code to discard.
"""

import logging

import numpy
import pytest
import torch

import headlab
from headlab import compiled as compiled_module
from headlab.pruning.hard_concrete import HardConcreteGates
from support.models import tiny_inputs, tiny_model
from support.treebank import SAMPLE_CONLLU, word_tokenizer

MASK = {("dec_self", 0): [0, 1]}
TEXTS = ["a man is riding a bike", "two dogs play in the snow", "a woman reads a book"]


@pytest.fixture(autouse=True)
def dynamo():
    dynamo = pytest.importorskip("torch._dynamo")
    if not dynamo.is_dynamo_supported():
        pytest.skip("torch.compile (dynamo) is not supported on this Python and torch")
    yield dynamo
    dynamo.reset()


@pytest.fixture
def compiled():
    """A tiny Llama and its compiled wrapper, already compiled once (the researcher's ``cmodel(ids)``)."""
    model = tiny_model("llama")
    wrapper = torch.compile(model, backend="eager")
    with torch.no_grad():
        wrapper(**tiny_inputs("llama"))
    return model, wrapper


def _logits(model):
    with torch.no_grad():
        return model(**tiny_inputs("llama")).logits


def _masked_logits():
    model = tiny_model("llama")
    with headlab.mask_heads(model, MASK):
        return _logits(model)


def test_a_mask_reaches_a_wrapper_compiled_before_it_and_leaves_with_the_block(compiled):
    # old: the wrapper's logits inside the block were the unmasked ones (0.15 from the masked)
    model, wrapper = compiled
    with headlab.mask_heads(model, MASK):
        torch.testing.assert_close(_logits(wrapper), _masked_logits(), rtol=0, atol=1e-6)
    torch.testing.assert_close(_logits(wrapper), _logits(tiny_model("llama")), rtol=0, atol=1e-6)


def test_the_wrapper_itself_is_masked_as_its_model(compiled):
    # old: AttributeError: 'LlamaForCausalLM' object has no attribute 'headlab_gates'
    model, wrapper = compiled
    with headlab.mask_heads(wrapper, MASK):
        torch.testing.assert_close(_logits(wrapper), _masked_logits(), rtol=0, atol=1e-6)
        torch.testing.assert_close(_logits(model), _masked_logits(), rtol=0, atol=1e-6)
    assert headlab.gates.attached_gates(model) == [] and not hasattr(model, "headlab_gates")
    torch.testing.assert_close(_logits(wrapper), _logits(tiny_model("llama")), rtol=0, atol=1e-6)


def test_the_wrappers_blocks_are_its_models(compiled):
    # old: _orig_mod.model.layers.0.self_attn
    model, wrapper = compiled
    assert [b.name for b in headlab.attention_blocks(wrapper)] == [b.name for b in headlab.attention_blocks(model)] \
        == ["model.layers.0.self_attn", "model.layers.1.self_attn"]


def test_head_output_hooks_reach_a_wrapper_compiled_before_them(compiled):
    # old: the halved heads did not reach the wrapper (0.09 from the eager model's logits)
    model, wrapper = compiled
    with headlab.head_output_hooks(headlab.attention_blocks(model), lambda block, heads: heads * 0.5):
        torch.testing.assert_close(_logits(wrapper), _logits(model), rtol=0, atol=1e-6)


def test_trained_gates_reach_a_wrapper_compiled_before_them(compiled):
    # old: the gates of prune training did not reach the wrapper (0.13 from the gated eager logits)
    model, wrapper = compiled
    gates = HardConcreteGates.for_model(model)
    with torch.no_grad():
        for parameter in gates.parameters():
            parameter.uniform_(-3, 3)
    gates.eval()
    with headlab.gates_attached(model, gates):
        torch.testing.assert_close(_logits(wrapper), _logits(model), rtol=0, atol=1e-6)
    torch.testing.assert_close(_logits(wrapper), _logits(tiny_model("llama")), rtol=0, atol=1e-6)


def test_a_model_compiled_in_place_is_masked():
    # old: model.compile() then mask_heads(model): the model's own call ran unmasked
    model = tiny_model("llama")
    model.compile(backend="eager")
    _logits(model)
    with headlab.mask_heads(model, MASK):
        torch.testing.assert_close(_logits(model), _masked_logits(), rtol=0, atol=1e-6)


def test_attention_captured_from_a_compiled_wrapper_is_the_models(compiled):
    # passed on old main too (switching to eager attention made dynamo compile again): kept as the guarantee
    model, wrapper = compiled
    eager = tiny_model("llama")
    with headlab.capture_attention(eager) as expected:
        _logits(eager)
    for captured in (model, wrapper):
        with headlab.capture_attention(captured) as record:
            _logits(wrapper)
        assert set(record) == set(expected)
        for key, probs in expected.items():
            torch.testing.assert_close(record[key], probs, rtol=0, atol=1e-6)


def test_heads_pruned_through_the_wrapper_are_pruned_in_it(compiled):
    # old: AttributeError (the pruning check's masks went onto the wrapper)
    model, wrapper = compiled
    kept = headlab.prune_heads(wrapper, MASK)
    assert kept == {("dec_self", 0): [2, 3]}
    assert model.model.layers[0].self_attn.q_proj.out_features == 2 * model.config.head_dim
    torch.testing.assert_close(_logits(wrapper), _masked_logits(), rtol=0, atol=1e-5)
    torch.testing.assert_close(_logits(wrapper), _logits(model), rtol=0, atol=1e-6)


def test_the_api_scores_the_wrapper_as_its_model(compiled):
    # old: ablation and gradient failed with an AttributeError (their gates went onto the wrapper)
    model, wrapper = compiled
    tokenizer = word_tokenizer(" ".join(TEXTS).split(), style="gpt2")
    measures = ["confidence", "ablation", "gradient", "lrp"]
    expected = headlab.importance(tiny_model("llama"), tokenizer, TEXTS, measures=measures)
    result = headlab.importance(wrapper, tokenizer, TEXTS, measures=measures)
    assert set(result.scores) == set(expected.scores) >= set(measures)  # and gradient_raw
    for name, table in expected.scores.items():
        numpy.testing.assert_allclose(result.scores[name]["dec_self"], table["dec_self"], rtol=1e-5, atol=1e-6)
    words = [line.split("\t")[1] for line in SAMPLE_CONLLU.splitlines() if line and line[0].isdigit()]
    treebank_tokenizer = word_tokenizer(words, style="gpt2")
    aggregate = headlab.aggregate(wrapper, treebank_tokenizer, SAMPLE_CONLLU)
    reference = headlab.aggregate(tiny_model("llama"), treebank_tokenizer, SAMPLE_CONLLU)
    for name, table in reference.scores.items():
        numpy.testing.assert_allclose(aggregate[name]["dec_self"], table["dec_self"], rtol=1e-5, atol=1e-6)
    assert headlab.prune(wrapper, "dec_self:1:0") == {("dec_self", 1): [1, 2, 3]}
    assert model.model.layers[1].self_attn.q_proj.out_features == 3 * model.config.head_dim


def test_headlabs_own_runs_compile_nothing(dynamo):
    # old: 35 frames compiled for one ablation on a model compiled in place, each mask a hook dynamo does not guard on
    model = tiny_model("llama")
    tokenizer = word_tokenizer(" ".join(TEXTS).split(), style="gpt2")
    expected = headlab.importance(tiny_model("llama"), tokenizer, TEXTS, measures=["ablation"])
    model.compile(backend="eager")
    _logits(model)
    frames = dynamo.utils.counters["frames"]["total"]
    result = headlab.importance(model, tokenizer, TEXTS, measures=["ablation"])
    assert dynamo.utils.counters["frames"]["total"] == frames
    numpy.testing.assert_allclose(result.scores["ablation"]["dec_self"], expected.scores["ablation"]["dec_self"],
                                  rtol=1e-5, atol=1e-6)


def test_discarding_compiled_code_is_said_once_with_why(compiled, caplog, monkeypatch):
    monkeypatch.setattr(compiled_module, "_warned", False)
    model, wrapper = compiled
    with caplog.at_level(logging.INFO, logger="headlab.compiled"):
        with headlab.mask_heads(model, MASK):
            _logits(wrapper)
    records = [r for r in caplog.records if r.name == "headlab.compiled"]
    assert [r.levelno for r in records] == [logging.WARNING, logging.INFO]  # entering, then leaving
    assert "skip_nnmodule_hook_guards" in records[0].getMessage() and "mask_heads" in records[0].getMessage()


def test_without_compiled_code_nothing_is_discarded(dynamo, monkeypatch):
    """A user who never compiles pays nothing: with no compiled code in the process (transformers' modelling imports
    dynamo, so it is imported), headlab's contexts and pruning never reset dynamo."""
    def refused():
        raise AssertionError("torch._dynamo.reset() called without compiled code")

    monkeypatch.setattr(dynamo, "reset", refused)
    model = tiny_model("llama")
    assert not compiled_module.compiled_code_exists()
    frames = dynamo.utils.counters["frames"]["total"]
    with headlab.mask_heads(model, MASK), headlab.capture_attention(model):
        _logits(model)
    headlab.prune_heads(model, MASK)
    assert dynamo.utils.counters["frames"]["total"] == frames


def test_prune_training_of_the_wrapper_trains_its_model(corpus, tokenizer, tmp_path):
    # old: AttributeError (the Hard Concrete gates went onto the wrapper)
    from headlab.pruning.train import PruneConfig, prune_train
    from headlab.training.config import TrainConfig
    from support.nmt import tiny_marian

    def trained(model, out):
        train = TrainConfig(out_dir=str(out), max_tokens=400, lr=1e-3, warmup_steps=0, schedule="constant",
                            max_epochs=1, validate=False, keep_epoch_checkpoints=False, progress=False, seed=3)
        config = PruneConfig(gates="all", lam=1.0, log_every=5, eval_beam=1, gate_lr=0.1, train=train)
        return prune_train(model, tokenizer, corpus.subset(40), None, config)

    expected_model = tiny_marian(tokenizer)
    expected = trained(expected_model, tmp_path / "eager")
    model = tiny_marian(tokenizer)
    wrapper = torch.compile(model, backend="eager")
    with torch.no_grad():
        wrapper(**tokenizer(["a man"], return_tensors="pt"), decoder_input_ids=torch.tensor([[0, 5]]))
    result = trained(wrapper, tmp_path / "compiled")
    assert (result.stopped, result.step, result.heads_kept) == (expected.stopped, expected.step, expected.heads_kept)
    for (name, parameter), (_, reference) in zip(model.named_parameters(), expected_model.named_parameters()):
        torch.testing.assert_close(parameter, reference, rtol=0, atol=0, msg=name)
