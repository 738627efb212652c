"""LRP head relevance: conservation, unchanged forward, equal strategies, the model's own target."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from headlab import HeadlabError, HeadScores, attention_blocks
from headlab.importance import (
    ImportanceData,
    compute_lrp,
    describe_model,
    head_relevance,
    lrp_rules,
    make_batches,
    translate_data,
)
from headlab.importance.lrp import _auto_chunk, normalize_per_layer
from support.models import FAMILIES, tiny_inputs, tiny_model


def _bias_free(model):
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.zero_()
        for name, buffer in model.named_buffers():
            if name.endswith("final_logits_bias"):
                buffer.zero_()
    return model


def _hooks(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def _data(n=4, seed=0, eos=1):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 8, (n,), generator=g).tolist()
    return ImportanceData.from_ids([torch.randint(3, 99, (k,), generator=g).tolist() + [eos] for k in lengths])


@pytest.mark.parametrize("family", FAMILIES)
def test_relevance_is_conserved_layer_to_layer(family):
    """On a bias-free model, relevance summed over any layer's hidden states equals the logit."""
    model = _bias_free(tiny_model(family).double())
    inputs = tiny_inputs(family)
    with torch.enable_grad(), lrp_rules(model):
        out = model(**inputs, output_hidden_states=True)
        row, position = 1, 2
        y = out.logits[row, position].max()
        if model.config.is_encoder_decoder:
            encoder, decoder = list(out.encoder_hidden_states), list(out.decoder_hidden_states)
            grads = torch.autograd.grad(y, encoder + decoder)
            totals = [float((h * g).sum().detach()) for h, g in zip(encoder + decoder, grads)]
            enc, dec = totals[: len(encoder)], totals[len(encoder) :]
            # Every encoder layer passes on what the decoder's cross-attention sent it ...
            np.testing.assert_allclose(enc, enc[0], rtol=1e-9, atol=1e-12)
            # ... and at the bottom, encoder + decoder embeddings hold the whole logit.
            np.testing.assert_allclose(enc[0] + dec[0], float(y.detach()), rtol=1e-9)
        else:
            hidden = list(out.hidden_states)
            grads = torch.autograd.grad(y, hidden)
            totals = [float((h * g).sum().detach()) for h, g in zip(hidden, grads)]
            np.testing.assert_allclose(totals, float(y.detach()), rtol=1e-9)


@pytest.mark.parametrize("family", FAMILIES)
def test_rules_leave_the_forward_pass_unchanged_and_remove_their_hooks(family):
    model = tiny_model(family)
    inputs = tiny_inputs(family)
    before, hooks = model(**inputs).logits, _hooks(model)
    with lrp_rules(model):
        assert _hooks(model) > hooks
        inside = model(**inputs).logits
    assert torch.equal(before, inside)
    assert _hooks(model) == hooks
    with pytest.raises(RuntimeError, match="boom"), lrp_rules(model):
        raise RuntimeError("boom")
    assert _hooks(model) == hooks


@pytest.mark.parametrize("family", ["marian", "bart", "bert", "gpt2", "t5", "llama"])
def test_batched_loop_and_jacobian_strategies_agree(family):
    model = tiny_model(family)
    info = describe_model(model)
    data = _data()
    if info.is_seq2seq:
        data = translate_data(model, data, info, max_length_a=0, max_length_b=6)
    batch = next(make_batches(data, info, batch_size=4))
    results = {s: head_relevance(model, batch, strategy=s) for s in ("vmap", "loop", "jacobian")}
    chunked = head_relevance(model, batch, strategy="vmap", chunk_size=2)
    assert len(results["vmap"].steps) == int(batch.steps.sum()) > 0
    for other in (results["loop"], results["jacobian"], chunked):
        assert torch.equal(other.steps, results["vmap"].steps)
        for key, values in results["vmap"].relevance.items():
            torch.testing.assert_close(other.relevance[key], values, rtol=1e-4, atol=1e-6)


def test_translation_batches_group_rows_by_their_decoder_side():
    """A batch costs one backward per step of its longest decoder side, so rows are grouped by
    that length (then the source's), not by the source's alone."""
    model = tiny_model("marian")
    info = describe_model(model)
    sources = [[5] * 3 + [1], [6] * 9 + [1], [7] * 5 + [1], [8] * 7 + [1], [9] * 5 + [1]]
    translations = [[10] * 11 + [1], [11] * 2 + [1], [12] * 6 + [1], [13] * 2 + [1], [14] * 6 + [1]]
    data = ImportanceData.from_ids(sources, references=translations[::-1])
    data = replace(data, translations=translations)
    batches = list(make_batches(data, info, batch_size=2, side="translation"))
    # decoder lengths 12, 3, 7, 3, 7: ties go to the longer source (1 before 3), then keep their order (2, 4)
    assert [b.index for b in batches] == [[0, 2], [4, 1], [3]]
    assert [b.inputs["decoder_input_ids"].shape[1] for b in batches] == [12, 7, 3]
    assert [b.inputs["input_ids"].shape[1] for b in batches] == [6, 10, 8]
    # The reference side orders by the references (reversed translations: 7, 3, 7, 3, 12).
    assert [b.index for b in make_batches(data, info, batch_size=2, side="reference")] == [[4, 2], [0, 1], [3]]


def test_automatic_chunks_are_cache_sized_on_one_cpu_thread():
    """vmap steps per call: the widest batched gradient (~4x the widest head tensor per step)
    near 2^22 numbers on one CPU thread, 2^25 otherwise; never more steps than the batch has."""
    y = torch.zeros(32, 20)
    heads = [torch.zeros(32, 20, 8, 32), torch.zeros(32, 20, 4, 32)]  # widest: 163,840 numbers
    assert _auto_chunk(y, heads) == (1 << 22) // (4 * 163_840) == 6  # one thread (autouse fixture)
    assert _auto_chunk(y, [torch.zeros(2, 20, 4, 8)]) == 20  # tiny tensors: all steps in one call
    assert _auto_chunk(torch.zeros(1, 0), heads) == 1
    torch.set_num_threads(2)
    assert _auto_chunk(y, heads) == 20
    assert _auto_chunk(torch.zeros(32, 200), heads) == (1 << 25) // (4 * 163_840) == 51


def test_target_is_the_models_own_prediction_not_the_reference():
    model = tiny_model("marian")
    info = describe_model(model)
    references = [[5, 6, 7, 8, 1], [9, 10, 1], [11, 12, 13, 1], [14, 1]]
    data = translate_data(model, ImportanceData.from_ids(_data().sources, references), info,
                          max_length_a=0, max_length_b=6)
    batch = next(make_batches(data, info, batch_size=4, side="translation"))
    result = head_relevance(model, batch)
    # Greedy decoding: the top-1 token of each teacher-forced step is the translation's next token.
    expected = torch.cat([torch.tensor(data.translations[i]) for i in batch.index])
    rows = result.steps[:, 0]
    by_row = [result.tokens[rows == r] for r in range(batch.size)]
    assert torch.equal(torch.cat(by_row), expected)
    assert not torch.equal(result.tokens[: len(references[batch.index[0]])], torch.tensor(references[batch.index[0]]))
    # compute_lrp always scores the translation, also when references are present.
    scores = compute_lrp(model, data, info, batch_size=2)
    assert scores.signature["n_steps"] == sum(len(t) for t in data.translations)


def test_head_relevance_is_normalised_per_layer_then_averaged():
    model = tiny_model("gpt2")
    info = describe_model(model)
    data = _data(n=3, eos=0)
    batch = next(make_batches(data, info, batch_size=3))
    raw = head_relevance(model, batch)
    expected = {key: normalize_per_layer(v.double()).mean(0).numpy() for key, v in raw.relevance.items()}
    scores = compute_lrp(model, data, info, batch_size=3)
    assert isinstance(scores, HeadScores) and scores.method == "lrp"
    for (kind, layer), values in expected.items():
        np.testing.assert_allclose(scores[kind][layer], values, rtol=1e-6)
        assert np.isclose(np.abs(normalize_per_layer(raw.relevance[(kind, layer)])).sum(-1), 1).all()
    assert scores.signature["n_steps"] == sum(len(s) for s in data.sources)


def test_all_kinds_are_scored_for_translation_models():
    model = tiny_model("marian")
    info = describe_model(model)
    data = translate_data(model, _data(n=2), info, max_length_a=0, max_length_b=4)
    scores = compute_lrp(model, data, info)
    assert scores.kinds == ("enc_self", "dec_self", "dec_cross")
    assert all(scores[k].shape == (2, 4) and not np.isnan(scores[k]).any() for k in scores.kinds)
    only = compute_lrp(model, data, info, kinds=("dec_cross",))
    assert only.kinds == ("dec_cross",)
    np.testing.assert_allclose(only["dec_cross"], scores["dec_cross"], rtol=1e-5)


def test_lrp_errors_are_clear():
    import transformers as tf

    bare = tf.BertModel(tiny_model("bert").config).eval()
    info = describe_model(bare)
    assert not info.has_lm_head
    with pytest.raises(HeadlabError, match="language-model head"):
        compute_lrp(bare, _data(), info)
    model = tiny_model("marian")
    with pytest.raises(HeadlabError, match="translate_data"):
        compute_lrp(model, _data(), describe_model(model))
    with pytest.raises(HeadlabError, match="strategy"):
        head_relevance(model, None, strategy="magic")


def test_unsupported_normalisation_is_refused():
    model = tiny_model("gpt2")

    class FancyNorm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(32))

        def forward(self, x):
            return x * self.weight

    model.transformer.ln_f = FancyNorm()
    hooks = _hooks(model)
    with pytest.raises(HeadlabError, match="FancyNorm"), lrp_rules(model):
        pass
    assert _hooks(model) == hooks


def test_pruned_blocks_keep_original_head_numbering():
    from headlab import prune_heads

    model = tiny_model("gpt2")
    prune_heads(model, {("dec_self", 0): [1, 3]})
    scores = compute_lrp(model, _data(n=2, eos=0), describe_model(model))
    assert scores["dec_self"].shape == (2, 4)
    assert np.isnan(scores["dec_self"][0, [1, 3]]).all()
    assert not np.isnan(scores["dec_self"][0, [0, 2]]).any()
    assert len(attention_blocks(model)) == 2


def test_no_token_to_explain_is_blamed_on_the_length_not_on_translations():
    """A masked LM's sentences cut to [CLS] [SEP] leave LRP nothing to explain; the error used to
    ask whether "all translations" were empty on a model that translates nothing."""
    from headlab.data.inputs import encode_texts
    from support.treebank import word_tokenizer

    model = tiny_model("bert").eval()
    tokenizer = word_tokenizer(["a", "dog", "runs"], style="bert")
    info = describe_model(model, tokenizer, max_length=2)
    with pytest.raises(HeadlabError, match="cut to 2 tokens: --max-length") as error:
        compute_lrp(model, encode_texts(tokenizer, info, ["a dog runs", "a dog"]), info)
    assert "translations" not in str(error.value)
