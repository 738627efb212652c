"""LRP's bias probes on modules that see a subset of the batch's tokens, or its tokens in another order (session 42).

A bias is probed with one ``s`` per row of its module's output, read batch-major (lrp._bias_probes): a module run on
rows gathered by a router (an expert's tokens; a grouped implementation's, sorted by score) would have its bias's
share attributed to the wrong sentences whenever the row count is a multiple of the batch size, which the
per-sentence conservation check catches only when the biases are large. Now: experts held as a list of modules with
biases are refused before any work; rows whose count is no input's token count get probes of their own, refused if
relevance reaches them; and rows that could be in any order are checked batch-major on every batch
(lrp._check_rows). Tiny Mistral models whose MLPs are replaced by the modules below; float64; no download."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from headlab.errors import HeadlabError
from headlab.importance import compute_lrp
from headlab.importance.lrp import _Tokens
from support.lrp_families import lrp_data, tiny_lrp_model


class _Expert(nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(32, 40, bias=bias), nn.ReLU(), nn.Linear(40, 32, bias=bias)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class _SortedMoe(nn.Module):
    """Top-1 routing, each expert on its tokens sorted by the router's score (as a grouped implementation orders
    them), no routing weight: ``sum_e E_e(x)`` over the rows routed to ``e``."""

    def __init__(self, n_experts: int, bias: bool) -> None:
        super().__init__()
        self.router = nn.Linear(32, n_experts, bias=False)
        self.experts = nn.ModuleList(_Expert(bias) for _ in range(n_experts))

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        with torch.no_grad():
            scores = self.router(flat)
            route, order = scores.argmax(-1), torch.argsort(scores.amax(-1), descending=True)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows = order[route[order] == e]
            out = out.index_add(0, rows, expert(flat[rows]))
        return out.reshape(x.shape)


class _ReversedMlp(nn.Module):
    """An MLP run on the batch's tokens in reverse order (all of them: the count is right, the order is not)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = _Expert(bias=True)

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1]).flip(0)
        return self.mlp(flat).flip(0).reshape(x.shape)


class _OddRowsMlp(nn.Module):
    """An MLP run on every other token of the flattened batch (a subset, whose count is no input's token count)."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = _Expert(bias=True)

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        return flat.index_add(0, torch.arange(1, len(flat), 2), self.mlp(flat[1::2])).reshape(x.shape)


def _model(mlp):
    model = tiny_lrp_model("mistral", dtype=torch.float64)
    torch.manual_seed(1)
    for layer in model.model.layers:
        layer.mlp = mlp().double()
        with torch.no_grad():
            for name, parameter in layer.mlp.named_parameters():
                if name.endswith("bias"):
                    parameter.normal_(0, 0.5)
    return model


def _forwards(model):
    from headlab.adapters import discovery

    calls = []
    model.register_forward_pre_hook(lambda module, args: None if discovery._ACTIVE else calls.append(1))
    return calls


def test_experts_with_biases_held_in_a_module_list_are_refused_before_any_work():
    """Before: the biases' shares went to the wrong sentences (here refused after the work, as "did not conserve
    relevance", sentence 2's ratio 0.45; within the check's 1e-3 with small biases)."""
    model = _model(lambda: _SortedMoe(2, bias=True))
    data, info = lrp_data(model)
    calls = _forwards(model)
    with pytest.raises(HeadlabError, match=r"no rule for the experts ModuleList \(model.layers.0.mlp.experts\): "
                                           r"its experts' biases \(fc1, fc2\) apply to the tokens routed"):
        compute_lrp(model, data, info, bootstrap=0)
    assert calls == []


def test_experts_without_biases_in_a_module_list_conserve():
    model = _model(lambda: _SortedMoe(2, bias=False))
    data, info = lrp_data(model)
    record = compute_lrp(model, data, info, bootstrap=0).signature["conservation"]
    total = record["with_biases"]
    assert record["n_sentences"] == 4 and abs(total["min"] - 1) < 1e-10 and abs(total["max"] - 1) < 1e-10, total


@pytest.mark.parametrize("strategy", ["vmap", "loop"])
def test_a_biased_module_on_the_tokens_in_another_order_is_refused(strategy):
    """The row count is the batch's tokens; the order is not batch-major: the per-sentence check of the rows
    (lrp._check_rows) refuses it at the first batch, naming the module. Before: explained, wrong per sentence."""
    model = _model(_ReversedMlp)
    data, info = lrp_data(model)
    with pytest.raises(HeadlabError, match=r"no rule for the bias of model.layers.\d.mlp.mlp.fc\d: its \d+ rows are not "
                                           r"the batch's tokens in batch order"):
        compute_lrp(model, data, info, bootstrap=0, strategy=strategy)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_row_order_check_holds_for_a_half_precision_model_and_40_sentences_a_batch(dtype):
    """The check scales sentence r by 2^(r mod 32) and 2^(r // 32 mod 32), 2^31 at most: beyond float16's range,
    but LRP never computes in a half precision (lrp_precision: float32 or float64, the model widened), so a
    reordered module is still refused with more than 32 sentences a batch (none skipped as non-finite)."""
    from headlab.data.inputs import ImportanceData
    from headlab.importance import describe_model

    model = _model(_ReversedMlp).to(dtype)
    sentences = [[5 + (7 * i + j) % 80 for j in range(3 + i % 5)] for i in range(40)]
    with pytest.raises(HeadlabError, match=r"rows are not the batch's tokens in batch order"):
        compute_lrp(model, ImportanceData.from_ids(sentences), describe_model(model), bootstrap=0, batch_size=40)


def test_a_biased_module_on_a_subset_of_the_tokens_is_refused():
    """Every other token: a count that is a multiple of the batch size (4 sentences, 9 tokens each: 36 rows, 18
    of them), but no input's token count: probes of its own, which relevance reaches, so refused. Before: its 18
    rows read as 4 sentences' (silently wrong per sentence, or a failed conservation check after the work)."""
    model = _model(_OddRowsMlp)
    data, info = lrp_data(model)
    with pytest.raises(HeadlabError, match=r"no rule for the bias of model.layers.0.mlp.mlp.fc1: it is added to rows "
                                           r"\(\d+,\) that are not the batch's tokens"):
        compute_lrp(model, data, info, bootstrap=0, batch_size=4)


def test_flattened_rows_are_tokens_only_when_they_are_all_of_them():
    tokens = _Tokens.of({"input_ids": torch.zeros(4, 9, dtype=torch.long), "decoder_input_ids": torch.zeros(4, 5)})
    assert tokens.per_token(torch.Size([36])) and tokens.per_token(torch.Size([20])) and tokens.per_token(torch.Size([4]))
    assert not tokens.per_token(torch.Size([16])) and not tokens.per_token(torch.Size([8]))  # multiples of 4, subsets
    assert tokens.per_token(torch.Size([4, 7])) and not tokens.per_token(torch.Size([3, 7]))  # led by the batch


def test_xmods_adapter_of_a_language_no_sentence_is_in_runs_on_no_row():
    """X-MOD runs each language's adapter on the sentences in that language (``hidden_states[lang_mask]``): the
    others' on ``[0, seq, d]``, whose probes hold no row to check (the family sweep: before the check skipped them,
    a RuntimeError from max() of an empty tensor). All sentences in the default language: conserved."""
    import transformers as tf

    config = tf.XmodConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=37, max_position_embeddings=64, pad_token_id=0,
                           languages=["en_XX", "de_DE"], default_language="en_XX")
    torch.manual_seed(0)
    model = tf.XmodForMaskedLM(config).eval().double()
    data, info = lrp_data(model)
    total = compute_lrp(model, data, info, bootstrap=0).signature["conservation"]["with_biases"]
    assert abs(total["min"] - 1) < 1e-10 and abs(total["max"] - 1) < 1e-10, total
