"""LRP on ConvBERT (session 43); before, refused before any work (``Family.lrp_refused``: "ConvBERT's span-based dynamic
convolution heads ... have no LRP rule"), every test here failing with it.

The rule (headlab.importance.mixer_rules.convbert): the convolution heads' taps ``softmax(conv_kernel_layer(query(x) *
key_conv_attn_layer(x)))`` held constant, as the attention weights are (``key_conv_attn_layer``'s and
``conv_kernel_layer``'s outputs detached, ``query``'s by the attention rule), so the convolution is linear in
``conv_out_layer(x)``; on a padded batch ``conv_out_layer``'s padded rows (zeroed by headlab's padding mask) are zeroed
again after lrp.py's bias probe. Tiny models from tests/test_convbert.py's builder (head_ratio 2 and a config left with
one head, biases and norms off their initial values), in float64.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from headlab import HeadlabError, prune_heads
from headlab.importance import ImportanceData, compute_lrp, describe_model, head_relevance, make_batches
from headlab.importance.rules import check_rules
from support.lrp_families import (
    check_lrp_refused_before_any_work,
    check_probed_widened_and_left_as_it_was,
    check_rules_leave_the_forward_unchanged,
    check_strategies_agree,
    lrp_data,
)
from test_convbert import CONFIGS, build
from test_importance_lrp_reference import (
    _b,
    _w,
    attention,
    layer_norm,
    linear,
    rel_add,
    rel_attention_values,
    rel_layer_norm,
    rel_linear,
)

VARIANTS = {"ratio2": dict(name="ratio2"), "one-head": dict(name="one-head"),
            "kernel 5": dict(name="ratio2", conv_kernel_size=5)}


def _model(variant: str = "ratio2") -> torch.nn.Module:
    return build(**VARIANTS[variant])


def _conservation(model, data: ImportanceData, batch_size: int) -> dict:
    return compute_lrp(model, data, describe_model(model), batch_size=batch_size, bootstrap=0).signature["conservation"]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_old_refusal_is_gone(name):
    from headlab.adapters.families import CONVBERT

    assert not CONVBERT.lrp_refused and not CONVBERT.refused
    check_rules(build(name))  # before: "LRP: no rule for the attention of convbert.encoder.layer.0.attention ..."


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_lrp_conserves_every_sentence_in_float64_on_a_padded_batch(variant):
    """Four sentences of 4 to 9 tokens in one right-padded batch, biases on: the relevance reaching the first layer's
    input plus what the biases keep is each sentence's explained logits to 1e-8 (measured: 2e-16)."""
    model = _model(variant)
    data, _ = lrp_data(model)
    record = _conservation(model, data, batch_size=4)
    assert record["n_sentences"] == 4 and record["n_outside"] == 0, record
    total = record["with_biases"]
    assert abs(total["min"] - 1) < 1e-8 and abs(total["max"] - 1) < 1e-8, total
    assert record["embeddings"]["max"] < 0.9  # the biases keep a share: their probes count it


def test_a_padded_sentence_gets_what_it_gets_alone():
    """Every share (the head relevances, the embeddings', the biases') of each sentence in a padded batch equals its
    shares alone, to 1e-10. Without the rule's hook that zeroes conv_out_layer's padded rows again after lrp.py's bias
    probe, the probe counted conv_out_layer's bias on the padding (which the padding mask had zeroed): the biases'
    share of the shorter sentences was off (conservation 0.99988 on this batch)."""
    model = _model()
    data, info = lrp_data(model)
    batches = {size: list(make_batches(data, info, batch_size=size)) for size in (1, 4)}
    alone = [head_relevance(model, batch) for batch in batches[1]]
    together = head_relevance(model, batches[4][0])
    start = 0
    for one in alone:
        n = one.logits.shape[0]
        for name in ("logits", "embedding", "biases"):
            torch.testing.assert_close(getattr(together, name)[start:start + n], getattr(one, name),
                                       rtol=1e-10, atol=1e-12)
        for key, values in one.relevance.items():
            torch.testing.assert_close(together.relevance[key][start:start + n], values, rtol=1e-10, atol=1e-12)
        start += n
    assert start == together.logits.shape[0]


@pytest.mark.parametrize("spec", [{("enc_self", 0): [1]}, {("enc_self", 0): [0], ("enc_self", 1): [0, 1]}],
                         ids=["a head removed", "a layer's attention heads all removed"])
def test_lrp_conserves_after_physical_pruning(spec):
    """Pruned (the query kept whole, the kept heads' rows first; a layer left with its convolution heads only): the
    probe's formula reads the pruned layout, every sentence conserved to 1e-8 in float64, the removed heads unscored
    (NaN), the kept ones scored."""
    import numpy as np

    model = _model()
    prune_heads(model, spec)
    data, info = lrp_data(model)
    scores = compute_lrp(model, data, info, batch_size=4, bootstrap=0)
    total = scores.signature["conservation"]["with_biases"]
    assert abs(total["min"] - 1) < 1e-8 and abs(total["max"] - 1) < 1e-8, total
    for (kind, layer), heads in spec.items():
        assert np.isnan(scores[kind][layer, heads]).all()
        kept = [h for h in range(2) if h not in heads]
        assert not np.isnan(scores[kind][layer, kept]).any()


def test_the_rules_leave_the_forward_unchanged():
    check_rules_leave_the_forward_unchanged(_model(), padded=True)


@pytest.mark.parametrize("strategy", ["loop", "jacobian"])
def test_every_strategy_gives_vmaps_shares(strategy):
    model = _model()
    data, info = lrp_data(model)
    check_strategies_agree(model, data, info, strategy)


def test_in_bfloat16_the_probes_leave_it_as_it_was_and_lrp_conserves():
    """The rule's probe runs a float64 copy of each module: the bfloat16 model's weights stay as they were, bit for bit,
    and LRP (computed widened) conserves to 1e-6."""
    check_probed_widened_and_left_as_it_was(_model().to(torch.bfloat16))


# -- the reference: ConvBERT's layers written out from their weights, relevance propagated neuron by neuron ------------
def _separable_conv(h: torch.Tensor, conv) -> torch.Tensor:
    """``key_conv_attn_layer`` on ``h`` ``[n, hidden]``: per channel i, ``sum_j w_dw[i, j] h[t + j - K // 2, i]``
    (zeros beyond the ends), then the pointwise ``W_pw`` and the bias."""
    n, kernel = h.shape[0], conv.depthwise.weight.shape[-1]
    depthwise = conv.depthwise.weight.detach().double()[:, 0]  # [hidden, K]
    padded = torch.cat([h.new_zeros(kernel // 2, h.shape[1]), h, h.new_zeros(kernel // 2, h.shape[1])])
    spread = sum(depthwise[:, j] * padded[j:j + n] for j in range(kernel))
    return spread @ conv.pointwise.weight.detach().double()[:, :, 0].T + conv.bias.detach().double()[:, 0]


def _span_conv(taps: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``conv[t, h, c] = sum_k taps[t, h, k] u[t + k - P, h, c]``, ``u`` ``[n, H, d]`` zero beyond the ends; as a
    contribution tensor ``z[t, s, h, c]`` of ``u[s]`` to ``conv[t]``, summed over ``s``."""
    return _span_contributions(taps, u).sum(1)


def _span_contributions(taps: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    n, heads, kernel = taps.shape
    pad = (kernel - 1) // 2
    z = u.new_zeros(n, n, *u.shape[1:])  # [t, s, H, d]
    for t in range(n):
        for k in range(kernel):
            s = t + k - pad
            if 0 <= s < n:
                z[t, s] = taps[t, :, k, None] * u[s]
    return z


def _rel_span_conv(taps: torch.Tensor, u: torch.Tensor, r_conv: torch.Tensor) -> torch.Tensor:
    """A weighted sum with the taps as its weights: ``R(u[s]) = sum_t z[t, s] / conv[t] * R(conv[t])``."""
    z = _span_contributions(taps, u)
    conv = z.sum(1)
    return (z / conv[:, None] * r_conv[:, None]).sum(0)


def _reference(model, ids: list[int]) -> tuple[dict, torch.Tensor]:
    """Head relevances ``{("enc_self", layer): [n, H]}`` for the top-1 logit at every position of the sentence ``ids``
    alone, and the tokens: from the first layer's input (the model's own, where LRP's relevance ends), every layer written
    out from its weights in float64, no autograd; the attention weights and the taps are the weights of their sums."""
    layers = model.convbert.encoder.layer
    seen: dict = {}
    handle = layers[0].register_forward_pre_hook(lambda module, args: seen.update(h=args[0][0].detach()))
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]))
    handle.remove()
    h, n = seen["h"], len(ids)
    allowed = torch.ones(n, n, dtype=torch.bool)
    cache = []
    for layer in layers:
        sa, so = layer.attention.self, layer.attention.output
        heads_n, d = sa.num_attention_heads, sa.attention_head_size
        q, k, v = (linear(h, _w(p), _b(p)) for p in (sa.query, sa.key, sa.value))
        heads, probs = attention(q, k, v, heads_n, d ** -0.5, allowed)
        logits = linear(q * _separable_conv(h, sa.key_conv_attn_layer), _w(sa.conv_kernel_layer),
                        _b(sa.conv_kernel_layer))
        taps = logits.view(n, heads_n, sa.conv_kernel_size).softmax(-1)
        u = linear(h, _w(sa.conv_out_layer), _b(sa.conv_out_layer)).view(n, heads_n, d)
        context = torch.cat([heads.reshape(n, -1), _span_conv(taps, u).reshape(n, -1)], dim=-1)
        a = linear(context, _w(so.dense), _b(so.dense))
        s1 = a + h
        h1 = layer_norm(s1, _w(so.LayerNorm), _b(so.LayerNorm), so.LayerNorm.eps)
        g = layer.intermediate.intermediate_act_fn(linear(h1, _w(layer.intermediate.dense),
                                                          _b(layer.intermediate.dense)))
        f2 = linear(g, _w(layer.output.dense), _b(layer.output.dense))
        s2 = f2 + h1
        cache.append((h, probs, v, taps, u, context, a, s1, h1, g, f2, s2, layer))
        h = layer_norm(s2, _w(layer.output.LayerNorm), _b(layer.output.LayerNorm), layer.output.LayerNorm.eps)
    head = model.generator_predictions
    t1 = linear(h, _w(head.dense), _b(head.dense))
    t2 = F.gelu(t1)
    z = layer_norm(t2, _w(head.LayerNorm), _b(head.LayerNorm), head.LayerNorm.eps)
    out_w = _w(model.generator_lm_head)
    tokens = linear(z, out_w, _b(model.generator_lm_head)).argmax(-1)
    results: dict = {}
    for t in range(n):
        r_z = torch.zeros_like(z)
        r_z[t] = out_w[int(tokens[t])] * z[t]
        r_t2 = rel_layer_norm(t2, _w(head.LayerNorm), _b(head.LayerNorm), head.LayerNorm.eps, r_z)
        r_h = rel_linear(h, _w(head.dense), _b(head.dense), r_t2)  # the activation: R(t1) = R(t2)
        for li in reversed(range(len(cache))):
            (h_in, probs, v, taps, u, context, a, s1, h1, g, f2, s2, layer) = cache[li]
            sa, so = layer.attention.self, layer.attention.output
            heads_n, d = sa.num_attention_heads, sa.attention_head_size
            out_ln = layer.output.LayerNorm
            r_f2, r_h1 = rel_add(f2, h1, rel_layer_norm(s2, _w(out_ln), _b(out_ln), out_ln.eps, r_h))
            r_g = rel_linear(g, _w(layer.output.dense), _b(layer.output.dense), r_f2)
            r_h1 = r_h1 + rel_linear(h1, _w(layer.intermediate.dense), _b(layer.intermediate.dense), r_g)
            r_a, r_in = rel_add(a, h_in, rel_layer_norm(s1, _w(so.LayerNorm), _b(so.LayerNorm), so.LayerNorm.eps, r_h1))
            r_context = rel_linear(context, _w(so.dense), _b(so.dense), r_a)
            r_heads = r_context[:, :heads_n * d].view(n, heads_n, d)
            results.setdefault(("enc_self", li), []).append(r_heads.sum(dim=(0, 2)))
            r_v = rel_attention_values(probs, v, heads_n, r_heads)
            r_u = _rel_span_conv(taps, u, r_context[:, heads_n * d:].view(n, heads_n, d))
            r_h = r_in + rel_linear(h_in, _w(sa.value), _b(sa.value), r_v) \
                + rel_linear(h_in, _w(sa.conv_out_layer), _b(sa.conv_out_layer), r_u.reshape(n, -1))
    return {key: torch.stack(values) for key, values in results.items()}, tokens


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_head_relevance_equals_the_reference_written_out_neuron_by_neuron(variant):
    """Three sentences in one right-padded batch: each target's head relevances are the reference's for the sentence
    alone, to 1e-7 relative (the neuron-by-neuron divisions' rounding, as tests/test_importance_lrp_reference.py)."""
    model = _model(variant)
    g = torch.Generator().manual_seed(0)
    data = ImportanceData.from_ids([torch.randint(3, 99, (k,), generator=g).tolist() + [1] for k in (6, 4, 5)])
    batch = next(make_batches(data, describe_model(model), batch_size=3))
    fast = head_relevance(model, batch)
    cache: dict = {}
    for i, (row, position) in enumerate(fast.steps.tolist()):
        if row not in cache:
            cache[row] = _reference(model, batch.inputs["input_ids"][row][batch.inputs["attention_mask"][row].bool()]
                                    .tolist())
        expected, tokens = cache[row]
        assert int(fast.tokens[i]) == int(tokens[position])
        for key, values in fast.relevance.items():
            torch.testing.assert_close(values[i], expected[key][position], rtol=1e-7, atol=1e-9,
                                       msg=f"{variant} {key} target {(row, position)}")
    assert len(cache) == 3 and fast.relevance[("enc_self", 1)].abs().min() > 0


# -- refusals ----------------------------------------------------------------------------------------------------------
def _with_conv_part(forward_of_part):
    """ConvBertSelfAttention's forward with its convolution heads' columns replaced by ``forward_of_part(core, x,
    context)``."""
    from transformers.models.convbert.modeling_convbert import ConvBertSelfAttention

    plain = ConvBertSelfAttention.forward

    def forward(self, hidden_states, *args, **kwargs):
        context, probs = plain(self, hidden_states, *args, **kwargs)
        width = self.all_head_size
        return torch.cat([context[..., :width], forward_of_part(self, hidden_states, context[..., width:])], -1), probs

    return forward


def test_a_convolution_computing_otherwise_is_refused_before_any_work(monkeypatch):
    """tanh of the convolution heads' outputs: not the formula, refused naming the rule and what it checked."""
    from transformers.models.convbert import modeling_convbert

    monkeypatch.setattr(modeling_convbert.ConvBertSelfAttention, "forward",
                        _with_conv_part(lambda core, x, conv: torch.tanh(conv)))
    check_lrp_refused_before_any_work(
        _model(), r"LRP: no rule for ConvBertSelfAttention \(convbert.encoder.layer.0.attention.self\): ConvBERT's "
                  r"span-based dynamic convolution heads .*: on a probe its forward is not \[softmax")


def test_taps_computed_past_the_held_modules_are_refused_before_any_work(monkeypatch):
    """The same values, but the taps computed without calling key_conv_attn_layer (its depthwise and pointwise parts
    called) nor conv_kernel_layer (its weights applied), so the rule's hooks cannot hold them constant: its relevance on
    the probe is not the formula's, refused."""
    from transformers.models.convbert import modeling_convbert

    def same_values_other_path(core, x, conv):
        from headlab.importance.mixer_rules.convbert import conv_heads

        separable = core.key_conv_attn_layer
        key_conv = (separable.pointwise(separable.depthwise(x.transpose(1, 2))) + separable.bias).transpose(1, 2)
        layer = core.conv_kernel_layer
        logits = F.linear(core.query(x) * key_conv, layer.weight, layer.bias)
        taps = torch.softmax(logits.view(*x.shape[:2], core.num_attention_heads, core.conv_kernel_size), dim=-1)
        return conv_heads(core, core.conv_out_layer(x), taps)

    monkeypatch.setattr(modeling_convbert.ConvBertSelfAttention, "forward", _with_conv_part(same_values_other_path))
    check_lrp_refused_before_any_work(_model(), r"on a probe its relevance with query, key, key_conv_attn_layer and "
                                                r"conv_kernel_layer detached is not the formula's")


def _even_kernel(core) -> None:
    core.conv_kernel_size = 4


def _wider_kernel_layer(core) -> None:
    core.conv_kernel_layer = torch.nn.Linear(core.all_head_size, 5 * core.num_attention_heads, dtype=torch.float64)


@pytest.mark.parametrize("change, match", [
    (_even_kernel, "its conv_kernel_size 4 is even: transformers' unfold then gives one position fewer"),
    (_wider_kernel_layer, r"its parts are not query and conv_out_layer \(Linear, to H x d\), key and value "
                          r"\(Linear, to its num_attention_heads x d, at most H\), conv_kernel_layer"),
], ids=["even kernel", "kernel layer of another width"])
def test_a_layout_the_rule_was_not_written_for_is_refused_before_its_probe(change, match):
    """Read off the module's parts before any probe runs (an even conv_kernel_size: transformers' unfold then loses a
    position and its forward fails)."""
    model = _model()
    change(model.convbert.encoder.layer[1].attention.self)
    with pytest.raises(HeadlabError, match=r"LRP: no rule for ConvBertSelfAttention "
                                           r"\(convbert.encoder.layer.1.attention.self\): ConvBERT's .*: " + match):
        check_rules(model)


def test_columns_after_the_heads_without_a_rule_are_refused(monkeypatch):
    """A block whose output projection reads columns after its heads that no mixer rule covers: refused naming them
    (the rule taken away here)."""
    from headlab.importance import mixer_rules
    from headlab.importance.mixer_rules.convbert import RULE

    mixer_rules.rules()  # the plugins loaded
    monkeypatch.setattr(mixer_rules, "_RULES", [rule for rule in mixer_rules._RULES if rule is not RULE])
    with pytest.raises(HeadlabError, match=r"LRP: no rule for the attention of convbert.encoder.layer.0.attention "
                                           r"\(convbert\): its output projection reads 16 columns after its heads' "
                                           r"\(conv_out_layer.out_features\) that no LRP rule covers"):
        check_rules(_model())


def test_the_probe_formula_is_the_modules_forward():
    """self_attention (the probe's formula) reproduces the module's own first output to 1e-12, kernels 3 and 5."""
    from headlab.importance.mixer_rules.convbert import self_attention

    for variant in ("ratio2", "kernel 5", "one-head"):
        core = _model(variant).convbert.encoder.layer[1].attention.self
        x = torch.randn((2, 7, 32), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        with torch.no_grad():
            torch.testing.assert_close(self_attention(core, x), core(x)[0], rtol=1e-12, atol=1e-12)
            assert math.isfinite(float(core(x)[0].sum()))


def test_analyze_end_to_end(tmp_path):
    """`headlab analyze --ablation` on a saved tiny ConvBERT (float32): every stage done, LRP too (its conservation
    check passed), both layers' heads scored by every measure. Before: LRP failed, refused naming the convolution."""
    import json

    from support.family_matrix import ANALYZE_STAGES, analyze, save_tiny, treebank_files

    model = _model().float()
    save_tiny(model, tmp_path / "model", treebank_files(tmp_path), style="bert")
    code, stages = analyze(tmp_path / "model", tmp_path)
    for name in (*ANALYZE_STAGES, "lrp"):
        assert stages[name]["status"] == "done", stages[name]
    assert code == 0
    for measure in ("confidence", "gradient", "ablation", "lrp"):
        rows = json.loads((tmp_path / "out" / "importance" / f"{measure}.json").read_text())["scores"]["enc_self"]
        assert [len(row) for row in rows] == [2, 2], measure
        assert all(v is not None for row in rows for v in row), measure
