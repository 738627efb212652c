"""Physical pruning of attention with learned sinks (GPT-OSS, Granite-SWA, GraniteMoE-SWA, Flint, MiMo-V2-Flash).

Each of these attention modules holds ``sinks``, one logit per query head (``num_attention_heads`` entries), read
by transformers 5.24's attention functions for that head only: eager appends ``sinks.reshape(1, -1, 1, 1)`` to
each head's logits as one more softmax column and drops it (GPT-OSS, Flint, MiMo-V2-Flash), or scales head h's
output by ``sigmoid(logsumexp(logits_h) - sinks[h])`` (Granite-SWA, GraniteMoE-SWA); flex renormalises by the
same term. So head h's sink changes head h's output alone: masking is exact, and pruning keeps the kept heads'
entries (``adapters.families.ATTENTION_SINKS``). Before, the session-26 sweep found the pruned forward failing
its check with a shape error, and pruning was then refused ("per-head parameters of its own").

Tiny models (hidden 32, 2 layers, 4 query heads over 2 key/value heads of 8), eager attention (these classes
have no SDPA), sinks set far from zero and different per head, so that a sink left whole or sliced with the wrong
heads changes the output (checked). MiMo-V2-Flash: its sliding-window layer (1) has sinks and 4 key/value heads,
its full-attention layer (0) none; its value head size is the query's here (as shipped, 192 against 128:
tests/test_unequal_head_sizes.py, the sinks sliced there too).
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from headlab import HeadlabError, attention_blocks, capture_attention, mask_heads, prune_heads
from support.family_matrix import (
    attentions_applied_to_values,
    check_lrp_conserves,
    check_pruned_generates_as_masked,
    check_pruned_reloads,
    padded_inputs,
    padded_logits,
    perturbed_model,
    tiny_inputs,
)

_GQA = dict(vocab_size=99, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, bos_token_id=0, eos_token_id=1,
            pad_token_id=2)
_EXPERTS = dict(num_local_experts=4, num_experts_per_tok=2)
SINK_FAMILIES = {
    "gpt_oss": lambda: (tf.GptOssForCausalLM, tf.GptOssConfig(**_GQA, **_EXPERTS)),
    "granite_swa": lambda: (tf.GraniteSWAForCausalLM, tf.GraniteSWAConfig(**_GQA)),
    "granitemoe_swa": lambda: (tf.GraniteMoeSWAForCausalLM, tf.GraniteMoeSWAConfig(**_GQA, **_EXPERTS)),
    "flint": lambda: (tf.FlintForCausalLM, tf.FlintConfig(**_GQA)),
    "mimo_v2_flash": lambda: (tf.MiMoV2FlashForCausalLM, tf.MiMoV2FlashConfig(**_GQA, v_head_dim=8)),
}
SINKS = torch.tensor([[3.0, -2.0, 1.5, 0.5], [-1.0, 2.5, 0.0, 4.0]])  # per layer, per query head
ALL = [0, 1, 2, 3]
SPECS = {  # removed heads -> heads left per layer
    # layer 0 emptied; layer 1 loses head 1: uneven groups, its key/value heads repeated (group size 1)
    "emptied": ({("dec_self", 0): ALL, ("dec_self", 1): [1]}, [0, 3]),
    "one per group": ({("dec_self", 0): [0, 3], ("dec_self", 1): [2]}, [2, 3]),
}


def sink_model(family: str) -> torch.nn.Module:
    model = perturbed_model(*SINK_FAMILIES[family](), attn_implementation="eager")
    with torch.no_grad():
        for layer, sinks in zip(_layers(model), SINKS):
            if layer.self_attn.sinks is not None:
                layer.self_attn.sinks.copy_(sinks)
    return model


def _layers(model) -> torch.nn.ModuleList:
    return model.model.layers


def _has_sinks(family: str, layer: int) -> bool:
    return not (family == "mimo_v2_flash" and layer == 0)  # MiMo-V2-Flash: sliding-window layers only


@pytest.mark.parametrize("family", SINK_FAMILIES)
def test_per_head_sinks_matter_and_a_wrong_slice_shows(family):
    """The sinks change the output; after pruning layer 1 to heads 0, 2 and 3, its sinks are entries 0, 2 and 3,
    and the first three entries instead (a slice that ignores which heads were kept) change the logits."""
    ids, mask = padded_inputs(pad_id=2)
    model = sink_model(family)
    before = padded_logits(model, ids, mask)
    with torch.no_grad():
        _layers(model)[1].self_attn.sinks.zero_()
    assert not torch.allclose(padded_logits(model, ids, mask), before, atol=1e-3)

    model = sink_model(family)
    spec = {("dec_self", 1): [1]}
    with mask_heads(model, spec):
        expected = padded_logits(model, ids, mask)
    prune_heads(model, spec)
    sinks = _layers(model)[1].self_attn.sinks
    assert torch.equal(sinks.detach(), SINKS[1, [0, 2, 3]])
    torch.testing.assert_close(padded_logits(model, ids, mask), expected, atol=1e-5, rtol=0)
    with torch.no_grad():
        sinks.copy_(SINKS[1, :3])
    assert not torch.allclose(padded_logits(model, ids, mask), expected, atol=1e-3)
    with torch.no_grad():
        sinks.copy_(SINKS[1, [0, 2, 3]])
    prune_heads(model, {("dec_self", 1): [1]})  # pruned again, in the current numbering: original head 2
    assert torch.equal(_layers(model)[1].self_attn.sinks.detach(), SINKS[1, [0, 3]])


@pytest.mark.parametrize("spec_name", SPECS)
@pytest.mark.parametrize("family", SINK_FAMILIES)
def test_per_head_sinks_pruned_equal_masking_generate_and_reload(family, spec_name, tmp_path):
    """Pruning keeps the kept heads' sinks (an emptied layer keeps none: its stand-in adds the output projection's
    bias); the pruned model equals the masked one on padded rows and in cached generation, and reloads with
    load_pruned and with plain transformers (remote code), every weight loaded. Before: refused."""
    spec, heads_left = SPECS[spec_name]
    model = sink_model(family)
    ids, mask = padded_inputs(pad_id=2)
    expected, expected_tokens = check_pruned_generates_as_masked(model, spec, heads_left, ids, mask, atol=1e-5)
    for (_, layer), removed in spec.items():
        kept = [h for h in ALL if h not in removed]
        attention = _layers(model)[layer].self_attn
        if not kept:
            assert "sinks" not in dict(attention.named_parameters())
        elif _has_sinks(family, layer):
            assert torch.equal(attention.sinks.detach(), SINKS[layer, kept])

    check_pruned_reloads(model, tmp_path, heads_left, ids, mask, expected, expected_tokens)


@pytest.mark.parametrize("family", SINK_FAMILIES)
def test_per_head_sinks_pass_check_prunable(family):
    """A long run that ends in pruning is not refused for the sinks (a layer emptied, one head of the next removed),
    and the model is left as it was."""
    from headlab.surgery import check_prunable

    model = sink_model(family)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    check_prunable(model)
    assert {n: p.shape for n, p in model.named_parameters()} == {n: w.shape for n, w in weights.items()}
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("family", SINK_FAMILIES)
def test_per_head_sinks_capture_is_transformers_eager_and_masking_is_exact(family):
    """Capture returns the weights each head applies to its values, the sink's mass left out (a row sums to less
    than 1): transformers' own eager weights (output_attentions) for GPT-OSS, Flint and MiMo-V2-Flash, which drop
    the sink's column after the softmax; Granite-SWA and GraniteMoE-SWA return the softmax without the sink (rows
    of 1) and scale the head's output by sigmoid(lse - sink) after, and capture returns that softmax times the
    scale: output_attentions times 1 / (1 + exp(sink - lse)), the row's log-sum-exp recomputed from the query and
    key eager is handed (support.family_matrix.attentions_applied_to_values, as experiments/family_sweep.py
    compares; tests/test_attention_sink_statistics.py). Masking a head equals zeroing its output projection columns:
    the sinks act within a head."""
    inputs = tiny_inputs()
    model = sink_model(family)
    with torch.no_grad():
        reference = model(**inputs, output_attentions=True).attentions
    applied, derived = attentions_applied_to_values(model, inputs)  # from output_attentions, sinks, logits
    with capture_attention(model) as record:
        with torch.no_grad():
            model(**inputs)
    scaled_after = family in ("granite_swa", "granitemoe_swa")
    for (_, layer), probs in record.items():
        assert (layer in derived) == (scaled_after and _has_sinks(family, layer))
        if scaled_after and _has_sinks(family, layer):
            torch.testing.assert_close(reference[layer][0].sum(-1), torch.ones_like(probs[0].sum(-1)))
            assert not torch.allclose(probs, reference[layer], atol=1e-2)
            torch.testing.assert_close(probs, applied[layer], atol=1e-6, rtol=0)  # float32 logits against float64
        else:
            assert torch.equal(probs, reference[layer])
            assert torch.equal(applied[layer], reference[layer])
        rows = probs[0].sum(-1)  # the unpadded row
        if _has_sinks(family, layer):
            assert (rows < 1 - 1e-3).any()
        else:
            torch.testing.assert_close(rows, torch.ones_like(rows))

    with torch.no_grad():
        before = model(**inputs).logits
        with mask_heads(model, {("dec_self", 1): [0, 3]}):
            masked = model(**inputs).logits
        o_proj = _layers(model)[1].self_attn.o_proj
        o_proj.weight[:, 0:8] = 0
        o_proj.weight[:, 24:32] = 0
        zeroed = model(**inputs).logits
    assert not torch.allclose(masked, before)
    torch.testing.assert_close(masked, zeroed, atol=1e-6, rtol=0)


@pytest.mark.parametrize("family", ["granite_swa", "granitemoe_swa", "flint", "mimo_v2_flash", "gpt_oss"])
def test_per_head_sinks_lrp_conserves(family):
    """LRP holds the attention weights constant (query and key projections detached): the sinks, parameters, then
    only scale those constants (or the head's output by a constant), and relevance is conserved. GPT-OSS was
    refused for its experts until session 28 (their rule: tests/test_lrp_moe_layouts.py); checked in float64,
    as LRP computes it (lrp_precision: Ding's product rule in its gated experts)."""
    from headlab.importance.rules import check_rules

    model = sink_model(family)
    check_rules(model)  # not refused
    if family == "gpt_oss":
        model = model.double()  # LRP runs the experts' eager loop, which takes float64
    check_lrp_conserves(model, _layers(model)[0])


def test_per_head_sinks_of_a_type_not_read_stay_refused(monkeypatch):
    """A sink parameter in a model type whose forward headlab has not read (here GPT-OSS taken off the table): the
    generic refusal, naming it, before any work."""
    from headlab.adapters import families

    monkeypatch.setattr(families, "ATTENTION_SINKS", {})
    monkeypatch.setattr("headlab.adapters.ATTENTION_SINKS", {})
    model = sink_model("gpt_oss")
    with pytest.raises(HeadlabError, match=r"per-head parameters of its own \(sinks \[4\]: one value per query or "
                                           r"key/value head, which physical pruning does not slice"):
        prune_heads(model, {("dec_self", 0): [3]})


def test_per_head_sinks_of_another_length_are_refused():
    """Sinks that are not one entry per query head of the output projection: refused when the blocks are read."""
    model = sink_model("gpt_oss")
    _layers(model)[1].self_attn.sinks = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(HeadlabError, match=r"layers\.1\.self_attn.*sinks \(shape \[2\]\) is not one entry per head"):
        attention_blocks(model)
@pytest.mark.parametrize("family", ["granite_swa", "granitemoe_swa"])
def test_sink_scaled_eager_missing_is_refused_before_any_work(family, monkeypatch):
    """Capture wraps the modeling module's ``eager_attention_forward`` of Granite-SWA and GraniteMoE-SWA (their sinks
    scale the output after it); a transformers version without that name is refused, naming the model type and the
    function, when the blocks are read, and by capture for blocks read before (never an AttributeError mid-capture)."""
    import sys

    model = sink_model(family)
    blocks = attention_blocks(model)
    monkeypatch.delattr(sys.modules[type(_layers(model)[0].self_attn).__module__], "eager_attention_forward")
    refusal = rf"model_type '{family}'.*no eager_attention_forward"
    with pytest.raises(HeadlabError, match=refusal):
        attention_blocks(model)
    with pytest.raises(HeadlabError, match=refusal):
        with capture_attention(model, blocks=blocks):
            pytest.fail("capture started")


@pytest.mark.parametrize("family", ["granite_swa", "granitemoe_swa"])
def test_sink_scaled_capture_leaves_other_threads_alone(family):
    """Two captures of two Granite-SWA models in two threads, and a plain forward of a third model in a third, all
    at once: each capture gets the weights its values get, the plain forward transformers' own output_attentions,
    and transformers' modeling module is left as it was. Before: capture swapped the modeling module's
    ``eager_attention_forward``, which every model of the type reads: the plain forward got weights scaled twice,
    the capture that ended first took the scaling from the one still running (its maps the pre-sink softmax), and
    the module was left patched with the first capture's wrapper."""
    import sys
    import threading

    models = [sink_model(family) for _ in range(3)]
    inputs = tiny_inputs()
    with torch.no_grad():
        plain_expected = models[2](**inputs, output_attentions=True).attentions
        with capture_attention(models[0]) as record:
            models[0](**inputs)
        expected = dict(record.items())
    module = sys.modules[type(_layers(models[0])[0].self_attn).__module__]
    eager = module.eager_attention_forward
    first_in, second_in, plain_done, first_done = (threading.Event() for _ in range(4))
    captured: dict[int, dict] = {}
    errors: list[BaseException] = []

    def run(index: int, entered: threading.Event, wait_before: threading.Event | None,
            wait_inside: threading.Event, done: threading.Event | None) -> None:
        try:
            if wait_before is not None:
                assert wait_before.wait(30)
            with capture_attention(models[index]) as record, torch.no_grad():
                entered.set()
                assert wait_inside.wait(30)
                models[index](**inputs)
                captured[index] = dict(record.items())
        except BaseException as error:  # noqa: BLE001 (re-raised in the main thread)
            errors.append(error)
            entered.set()
        finally:
            if done is not None:
                done.set()

    first = threading.Thread(target=run, args=(0, first_in, None, plain_done, first_done))
    second = threading.Thread(target=run, args=(1, second_in, first_in, first_done, None))
    first.start()
    second.start()
    try:
        assert second_in.wait(30)
        with torch.no_grad():  # both captures inside: a plain forward of a third model
            plain = models[2](**inputs, output_attentions=True).attentions
    finally:
        plain_done.set()
        first.join(60)
        second.join(60)
    assert not errors, errors
    for layer, probs in enumerate(plain):
        assert torch.equal(probs, plain_expected[layer])
    for index in (0, 1):  # the second ran its forward after the first capture had ended
        assert captured[index].keys() == expected.keys()
        for key, probs in expected.items():
            assert torch.equal(captured[index][key], probs)
    assert module.eager_attention_forward is eager
