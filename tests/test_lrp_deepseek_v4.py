"""LRP for DeepSeek-V4 (importance/shared_kv_rule.py, session 40). Before, refused before any work ("LRP: no rule for
the attention of ... (deepseek-v4): ... appends to the tokens' keys compressed key-value entries ..."), naming the
compressor, the indexer and the inverse rotation; with that refusal lifted and no rule, its hyper-connections were
refused (``DeepseekV4HyperConnection`` a hyper-connection the rule was not written for).

The rule: the queries (``q_b_proj``) detached; the one key-value head, both key and value, held constant as keys only
(inside the eager attention: its ``key`` detached, its ``value`` not); the compressor's softmax weights held constant
(``gate_proj`` detached), so its entries are linear in ``kv_proj``'s outputs; the indexer a mask; the inverse rotation
and the grouped output projection linear; the hyper-connections' mixing weights held constant (GLM-5-Next's rule:
``DeepseekV4HyperConnection`` and ``DeepseekV4HyperHead`` compute ``pre`` as it and HY-V4's head do). The tiny models
are tests/test_deepseek_v4.py's (float64, the three layer types, compress rates 2 and 3, index_topk 2)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from headlab.capture import eager_attention
from headlab.data.inputs import ImportanceData, make_batches
from headlab.errors import RunFailed
from headlab.importance import compute_lrp, describe_model, shared_kv_rule
from headlab.importance.lrp import _KeptWide, head_relevance
from headlab.importance.mixer_rules import hyper_connection
from headlab.importance.rules import lrp_rules
from support.lrp_families import (
    assert_conserved,
    check_rules_leave_the_forward_unchanged,
    check_strategies_agree,
    lrp_data,
)
from test_deepseek_v4 import build

IDS = torch.tensor([[5, 17, 33, 8, 61, 4, 9, 12, 40, 7]])  # 10 tokens: 5 sparse entries, 3 heavily compressed


def _bias_free(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias") and "position_bias" not in name:
                parameter.zero_()
    return model


@pytest.mark.parametrize("padded", [False, True], ids=["whole", "padded"])
def test_the_rules_leave_the_forward_unchanged(padded):
    check_rules_leave_the_forward_unchanged(build(), padded=padded)


@pytest.mark.parametrize("sizes", [{}, {"mlp_layer_types": ["hash_moe", "moe", "moe"]}], ids=["moe", "hash-moe"])
@pytest.mark.parametrize("longest", [8, 14])
def test_compute_lrp_conserves_relevance_on_padded_batches(sizes, longest):
    """Float64, four sentences of 4 to ``longest`` + 1 tokens in padded batches: the embeddings' relevance is the
    explained logit to 1e-10 in every sentence (measured: 4e-16). Before: refused before any work."""
    model = build(**sizes)
    if sizes:
        with torch.no_grad():  # the hash router's table off its zeros: tokens routed apart
            table = model.model.layers[0].mlp.gate.tid2eid
            table.copy_(torch.randint(0, 4, table.shape, generator=torch.Generator().manual_seed(0)))
    assert_conserved(model, 1e-10, longest=longest)


def test_a_float32_model_conserves():
    """Explained in float64 (compute_lrp widens it), as any float32 model."""
    assert_conserved(build().float(), 1e-6)


def test_a_pruned_model_conserves():
    """Pruned (layer 0 emptied, one head of each group gone in layers 1 and 2): its kept heads explained, conserved."""
    from headlab import prune_heads

    model = build()
    prune_heads(model, {("dec_self", 0): [0, 1, 2, 3], ("dec_self", 1): [1, 2], ("dec_self", 2): [0, 3]})
    record = assert_conserved(model, 1e-10, longest=12)
    assert record["n_sentences"] == 4


def test_a_sentences_relevance_in_a_padded_batch_is_its_own():
    """Right-padded beside a longer sentence, a sentence's head relevances and shares are those it gets alone (a real
    query sees only compressed windows of real tokens: the entries' causality, transformers' block bias)."""
    model = build()
    info = describe_model(model)
    short, long = [5, 17, 33, 8, 61, 1], [9, 12, 40, 22, 70, 31, 28, 44, 13, 6, 1]
    both = head_relevance(model, next(make_batches(ImportanceData.from_ids([short, long]), info, batch_size=2)))
    alone = head_relevance(model, next(make_batches(ImportanceData.from_ids([short]), info, batch_size=1)))
    row = int(both.steps[:, 0][both.steps[:, 1] == len(long) - 1][0]) ^ 1  # the short sentence's row
    mine = both.steps[:, 0] == row
    assert int(mine.sum()) == len(alone.steps) == len(short)
    torch.testing.assert_close(both.logits[mine], alone.logits, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(both.embedding[mine], alone.embedding, rtol=1e-9, atol=1e-12)
    for key, values in alone.relevance.items():
        torch.testing.assert_close(both.relevance[key][mine], values, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("strategy", ["loop", "jacobian"])
def test_every_strategy_gives_vmaps_shares(strategy):
    model = build()
    check_strategies_agree(model, *lrp_data(model), strategy)


def _strongly_gated():
    """The compressors' softmax weights depending strongly on the input (their gate projections 20 times larger)."""
    model = build()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("compressor.gate_proj.weight"):
                parameter.mul_(20)
    return model


def test_each_part_of_the_rule_is_needed(monkeypatch):
    """Without the keys held in the attention function, or with the compressor's softmax weights left free, the run
    fails its conservation check (before: with both, conserved to 1e-10)."""
    assert_conserved(_strongly_gated(), 1e-10)
    with monkeypatch.context() as patch:
        patch.setattr(shared_kv_rule, "keys_held", lambda blocks: contextlib.nullcontext())
        with pytest.raises(RunFailed, match="did not conserve relevance"):
            compute_lrp(build(), *lrp_data(build()), bootstrap=0)
    hooks = shared_kv_rule.hooks
    monkeypatch.setattr(shared_kv_rule, "hooks", lambda block: hooks(block)[:1])  # the queries only
    with pytest.raises(RunFailed, match="did not conserve relevance"):
        compute_lrp(_strongly_gated(), *lrp_data(_strongly_gated()), bootstrap=0)


def test_the_keys_are_held_and_the_values_keep_their_relevance(monkeypatch):
    """Inside the rules, the eager attention gets its keys detached and its values not (the same tensor before), the
    queries detached; the compressor's kv_proj keeps its gradient, its gate_proj not; the config's implementation is
    back to eager after."""
    import sys

    model = build()
    attention = model.model.layers[0].self_attn
    modeling = sys.modules[type(attention).__module__]
    eager = modeling.eager_attention_forward
    seen: list[tuple[bool, bool, bool]] = []

    def spy(module, query, key, value, *args, **kwargs):
        seen.append((query.requires_grad, key.requires_grad, value.requires_grad))
        return eager(module, query, key, value, *args, **kwargs)

    monkeypatch.setattr(modeling, "eager_attention_forward", spy)
    grads: dict[str, bool] = {}
    with torch.enable_grad(), eager_attention(model), lrp_rules(model):
        handles = [getattr(attention.compressor, name).register_forward_hook(  # after the rules' hooks
            lambda m, a, out, name=name: grads.__setitem__(name, out.requires_grad)) for name in ("kv_proj", "gate_proj")]
        # the relevance's source: the token embeddings, as a leaf of the graph
        handles.append(model.get_input_embeddings().register_forward_hook(
            lambda m, a, out: out.detach().requires_grad_()))
        model(input_ids=IDS)
        for handle in handles:
            handle.remove()
    assert seen == [(False, False, True)] * 3 and grads == {"kv_proj": True, "gate_proj": False}
    assert model.config._attn_implementation == "eager"


def _factor(norm, x: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V4's RMS norm's factor ``weight / rms(x)``, a constant (the norms' rule)."""
    return (norm.weight * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)).detach()


def _reference_entries(compressor, x: torch.Tensor, rotate) -> torch.Tensor:
    """The compressor's entries written from ``DeepseekV4{CSA,HCA}Compressor.forward`` (no cache), the softmax weights
    and the norm's factor constants: ``[batch, 1, windows, head_dim]``, linear in ``kv_proj(x)``."""
    batch, seq, _ = x.shape
    rate, d = compressor.compress_rate, compressor.head_dim
    n = seq // rate
    kv = compressor.kv_proj(x)[:, :n * rate].view(batch, n, rate, -1)
    gate = compressor.gate_proj(x).detach()[:, :n * rate].view(batch, n, rate, -1) + compressor.position_bias
    if kv.shape[-1] == 2 * d:  # CSA: window w pools the previous window's first half and its own second half
        kv = torch.cat([torch.cat([torch.zeros_like(kv[:, :1, :, :d]), kv[:, :-1, :, :d]], 1), kv[..., d:]], 2)
        gate = torch.cat([torch.cat([torch.full_like(gate[:, :1, :, :d], float("-inf")), gate[:, :-1, :, :d]], 1),
                          gate[..., d:]], 2)
    pooled = (kv * gate.softmax(dim=2)).sum(2)
    pooled = pooled * _factor(compressor.kv_norm, pooled)
    positions = (torch.arange(n) * rate).unsqueeze(0).expand(batch, -1)
    cos, sin = compressor.rotary_emb(pooled, position_ids=positions, layer_type="compress")
    return rotate(pooled.unsqueeze(1), cos, sin)


def _reference_attention(attention, x: torch.Tensor, probs: torch.Tensor, cos, sin) -> torch.Tensor:
    """The layer's output written from ``DeepseekV4Attention.forward``, the probabilities constants: the values
    ``[rope(kv_norm(kv_proj(x))) | the compressor's entries]``, weighed by ``probs``, rotated back, projected."""
    import sys

    rotate = sys.modules[type(attention).__module__].apply_rotary_pos_emb
    batch, seq, _ = x.shape
    kv = attention.kv_proj(x)
    values = rotate((kv * _factor(attention.kv_norm, kv)).unsqueeze(1), cos, sin)
    if attention.compressor is not None:
        values = torch.cat([values, _reference_entries(attention.compressor, x, rotate)], dim=2)
    heads = rotate(probs.detach() @ values, cos, -sin).transpose(1, 2)  # [batch, seq, heads, head_dim]
    grouped = attention.o_a_proj(heads.reshape(batch, seq, attention.config.o_groups, -1)).flatten(2)
    return attention.o_b_proj(grouped)


@pytest.mark.parametrize("layer", [0, 1, 2], ids=["sparse", "sliding", "heavily-compressed"])
def test_the_backward_through_an_attention_layer_is_the_rule_written_out(layer):
    """The rules' gradient of a random projection of the layer's output equals that of the reference (its only path
    from the input the values, the tokens' and the compressed entries'), and the reference computes the output."""
    model = build()
    attention = model.model.layers[layer].self_attn
    seen: dict = {}
    attention.register_forward_pre_hook(lambda module, args, kwargs: seen.update(
        x=args[0] if args else kwargs["hidden_states"], rope=kwargs["position_embeddings"]), with_kwargs=True)
    attention.register_forward_hook(lambda module, args, output: seen.update(out=output[0], probs=output[1]))
    with torch.enable_grad(), eager_attention(model), lrp_rules(model):
        with _KeptWide(torch.float64):  # as compute_lrp runs it
            model(input_ids=IDS)
        w = torch.randn(seen["out"].shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        grad, = torch.autograd.grad((seen["out"] * w).sum(), seen["x"])
    x = seen["x"].detach().requires_grad_()
    cos, sin = seen["rope"][attention.rope_layer_type]
    with torch.enable_grad(), _KeptWide(torch.float64):  # the rotations' float32 kept float64, as in the forward
        reference = _reference_attention(attention, x, seen["probs"], cos, sin)
        expected, = torch.autograd.grad((reference * w).sum(), x)
    torch.testing.assert_close(reference.detach(), seen["out"].detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, expected, rtol=0, atol=1e-12)
    assert grad.abs().max() > 1e-3
    if attention.compressor is not None:  # the entries' share: the reference without them differs
        assert seen["probs"].shape[-1] > IDS.shape[1]


def test_head_scores_are_the_relevance_at_o_a_projs_input_and_sum_to_the_layers_output():
    """A head's relevance is what reaches its head_dim features of o_a_proj's input (after the inverse rotation, a
    rotation of its own features), summed over positions; a layer's heads together hold the relevance of the layer's
    output (o_b_proj's), bias-free: the rotation back and the grouped projections conserve it."""
    model = _bias_free(build())
    info = describe_model(model)
    data = ImportanceData.from_ids([[5, 17, 33, 8, 61, 1], [9, 12, 40, 22, 70, 31, 28, 1]])
    batch = next(make_batches(data, info, batch_size=2))
    result = head_relevance(model, batch, strategy="loop")
    inputs: list[torch.Tensor] = []
    outputs: list[torch.Tensor] = []
    logits: list[torch.Tensor] = []
    handles = []
    for layer in model.model.layers:
        handles.append(layer.self_attn.o_a_proj.register_forward_pre_hook(lambda m, args: inputs.append(args[0])))
        handles.append(layer.self_attn.o_b_proj.register_forward_hook(lambda m, a, out: outputs.append(out)))
    handles.append(model.lm_head.register_forward_hook(lambda m, a, out: logits.append(out)))
    d = model.config.head_dim
    with torch.enable_grad(), eager_attention(model), lrp_rules(model):
        with _KeptWide(torch.float64):
            model(**batch.inputs)
        for n, (row, position) in enumerate(result.steps.tolist()):
            target = logits[-1][row, position, int(result.tokens[n])]
            grads = torch.autograd.grad(target, inputs + outputs, retain_graph=True)
            for layer, (h, g) in enumerate(zip(inputs, grads[:len(inputs)])):
                expected = (h[row] * g[row]).reshape(h.shape[1], -1, d).sum((0, 2))
                torch.testing.assert_close(result.relevance[("dec_self", layer)][n], expected.detach(), rtol=1e-9,
                                           atol=1e-12)
                out, g_out = outputs[layer], grads[len(inputs) + layer]
                torch.testing.assert_close(expected.sum(), (out[row] * g_out[row]).sum().detach(), rtol=1e-9,
                                           atol=1e-12)
    for handle in handles:
        handle.remove()
    assert len(result.steps) == 14  # every position of the two rows


def check_lrp_refused_before_any_work(model, match: str) -> None:
    """compute_lrp raises a HeadlabError matching ``match`` before any forward of ``model`` on the sentences (a table
    family: no discovery probe runs either; support.lrp_families' check asks for one)."""
    from headlab import HeadlabError

    seen: list = []
    handle = model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs.get("input_ids")),
                                             with_kwargs=True)
    try:
        with pytest.raises(HeadlabError, match=match):
            compute_lrp(model, *lrp_data(model), bootstrap=0)
    finally:
        handle.remove()
    assert all(ids is not None and not ids.any() for ids in seen), seen  # probes only, if any


def test_a_compressor_of_another_class_is_refused_before_any_work():
    model = build()
    compressor = model.model.layers[2].self_attn.compressor
    compressor.__class__ = type("OtherCompressor", (type(compressor),), {})
    check_lrp_refused_before_any_work(model, r"LRP: no rule for the attention of model\.layers\.2\.self_attn "
                                             r"\(deepseek-v4\): its compressor OtherCompressor is not one headlab read")


def test_an_indexer_of_another_class_is_refused_before_any_work():
    model = build()
    indexer = model.model.layers[0].self_attn.compressor.indexer
    indexer.__class__ = type("OtherIndexer", (type(indexer),), {})
    check_lrp_refused_before_any_work(model, r"model\.layers\.0\.self_attn \(deepseek-v4\): its compressor's indexer "
                                             r"OtherIndexer is not DeepseekV4Indexer")


def test_an_attention_of_another_class_is_refused_before_any_work():
    model = build()
    attention = model.model.layers[1].self_attn
    attention.__class__ = type("OtherAttention", (type(attention),), {})
    check_lrp_refused_before_any_work(model, r"model\.layers\.1\.self_attn \(deepseek-v4\): its one key-value head is "
                                             r"both key and value \(OtherAttention\)")


def test_a_hyper_connection_of_another_formula_is_refused_before_any_work():
    """The hyper-connections' rule recomputes ``pre``; a forward whose collapse is not ``sum_n pre_n s_n`` is refused
    (hyper_connection's probe)."""
    model = build()
    connection = model.model.layers[1].ffn_hc
    forward = type(connection).forward

    def doubled(self, streams):
        post, comb, out = forward(self, streams)
        return post, comb, 2 * out

    connection.forward = doubled.__get__(connection)
    check_lrp_refused_before_any_work(model, r"DeepseekV4HyperConnection.*on a probe its forward is not sum_n pre_n s_n")


def test_without_the_hyper_connections_rule_relevance_is_not_conserved(monkeypatch):
    """Strongly mixed streams (``fn`` 200 times its initial; 1000 saturates the sigmoids): conserved with the rule, not
    without (measured: 0.95 of the logit in a sentence)."""

    def mixed():
        model = build()
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith((".fn", ".hc_fn")):
                    parameter.mul_(200)
        return model

    assert_conserved(mixed(), 1e-10)
    monkeypatch.setattr(hyper_connection, "_rule", lambda module, args, output: output)
    with pytest.raises(RunFailed, match="did not conserve relevance"):
        compute_lrp(mixed(), *lrp_data(mixed()), bootstrap=0)
