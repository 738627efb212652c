"""Attention with an output gate per head from its own projection (session 25, branch fam11).

transformers 5.24's forwards, read: Bailing-hybrid's MLA layers (``BailingHybridAttention``) and dots3-note's
text model (``Dots3NoteTextAttention``) compute ``gate = sigmoid(g_proj(hidden_states))``, one value per head
(``g_proj``: hidden -> heads), and multiply the attention function's output ``[batch, seq, heads, v]`` by it
(``gate.unsqueeze(-1)`` / ``.view(b, s, -1, 1)``) before ``o_proj``. A.X-K2 (``AXK2Attention``) views its fused
``q_gate_proj`` ``[batch, seq, -1, nope + rope + v]``, splits each head's rows into ``[query | gate]`` and
multiplies the output, reshaped ``[batch, seq, heads * v]``, by ``sigmoid(gate)`` reshaped the same way. In all
three each head's slice is multiplied by a function of the layer's input computed by that head's own rows,
never by another head's output: capture (the attention function's probabilities) is untouched, masking a head
(zeros at ``o_proj``'s input) equals removing it (``0 * sigmoid(g) = 0``), and pruning removes the head's gate
rows with its query and key/value rows (``adapters.families.OUTPUT_GATES``, ``LATENT_ATTENTION``'s head_rows).

Before, all three were refused before any work ("the attention function's output reaches ... o_proj through
operations other than reshapes and casts"). Pruning equals masking on padded rows and in cached generation,
empties a layer and reloads (``load_pruned``, plain transformers): tests/test_mla_pruning.py, whose
``CONFIGS`` list them. Hy-V4 (an elementwise gate from ``gate_proj``, beside attention sinks and
hyper-connections), refused for those until session 36, is analysed and pruned: tests/test_hyper_connection_families.py.

Session 28 (branch gates28): AFMoE, Laguna and LFM3, whose gate's projection sits beside q/k/v projections as Beam's
(``adapters.families.QKV_OUTPUT_GATES``), are analysed, masked and pruned; Inkling2 and Inkling2-Loop stay refused,
naming what besides their gate headlab has not checked (``OUTPUT_GATES_REFUSED``). Since session 40 both are
analysed and masked, and since session 41 pruned: tests/test_inkling2.py.
Qwen4-Exp, refused so until session 36, is analysed and pruned as Qwen3-Next's gated attention:
tests/test_hyper_connection_families.py.
"""

from __future__ import annotations

import re

import pytest
import torch
import transformers as tf
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from headlab import HeadlabError, attention_blocks, mask_heads, prune_heads
from headlab.checkpoint import model_class_for
from headlab.portable_code import install_tie_rule
from support.family_matrix import (
    check_capture_equals_output_attentions,
    check_gates_at_one_change_nothing,
    check_masking_equals_zeroed_values,
    check_pruned_reloads,
    logits,
    tiny_inputs,
)

NOPE, ROPE, V = 4, 4, 8
_SIZES = dict(vocab_size=99, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=4, max_position_embeddings=64, bos_token_id=0, eos_token_id=1, pad_token_id=2,
              q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V,
              first_k_dense_replace=1, moe_intermediate_size=40, n_routed_experts=4, num_experts_per_tok=2,
              n_shared_experts=1, n_group=1, topk_group=1)
_INDEXER = dict(index_topk=3, index_n_heads=2, index_head_dim=8)  # DeepSeek Sparse Attention: 3 keys picked
# model type -> (its config's sizes, the gate's projection, its rows per head, their place among a head's rows)
GATED = {
    "bailing_hybrid": ({"layer_types": ["full_attention", "full_attention"]}, "g_proj", 1, slice(0, 1)),
    "dots3_note_text": (_INDEXER, "g_proj", 1, slice(0, 1)),
    "axk2": (_INDEXER, "q_gate_proj", NOPE + ROPE + V, slice(NOPE + ROPE, NOPE + ROPE + V)),  # [query | gate]
}
FAMILIES = tuple(GATED)


def build(family: str, attn_implementation: str = "sdpa", seed: int = 0) -> torch.nn.Module:
    if family not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {family}")
    config = CONFIG_MAPPING[family](**{**_SIZES, **GATED.get(family, (_INDEXER,))[0]})
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = model_class_for(config)(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or "norm" in name:  # off their initial values, so that they count
                parameter.add_(torch.randn_like(parameter) * 0.1)
            if family in GATED and name.endswith(f"{GATED[family][1]}.weight"):  # gates far from one another and from 1/2
                parameter.mul_(8)
    install_tie_rule(model)  # as headlab runs it (tied top-k keys: the lowest index)
    return model


def _gate_rows(family: str, head: int) -> list[int]:
    _, _, width, place = GATED[family]
    return list(range(head * width, (head + 1) * width))[place]


@pytest.mark.parametrize("family", FAMILIES)
def test_blocks_are_found_with_their_gate(family):
    """Before: refused before any work, the gate taken for an operation mixing heads."""
    blocks = attention_blocks(build(family))
    assert [(b.kind, b.layer, b.n_heads, b.n_kv_heads, b.d_head) for b in blocks] == [("dec_self", i, 4, 4, V)
                                                                                       for i in range(2)]
    assert GATED[family][1] in [path for path, _ in blocks[0].family.head_rows]


@pytest.mark.parametrize("family", FAMILIES)
def test_capture_equals_output_attentions(family):
    check_capture_equals_output_attentions(lambda **kw: build(family, **kw), "dec_self", tiny_inputs())


@pytest.mark.parametrize("family", FAMILIES)
def test_masking_equals_zeroed_values_and_gates_at_one_change_nothing(family):
    """Masking head j of layer 1 equals zeroing its value rows of kv_b_proj (rows j*(nope+v)+nope ..): its
    output, times its gate, is zero either way."""
    values = (lambda model, layer: model.model.layers[layer].self_attn.kv_b_proj,
              lambda j: range(j * (NOPE + V) + NOPE, (j + 1) * (NOPE + V)), 4)
    check_masking_equals_zeroed_values(lambda: build(family), "dec_self", values, tiny_inputs())
    check_gates_at_one_change_nothing(build(family), tiny_inputs())


@pytest.mark.parametrize("family", FAMILIES)
def test_each_heads_gate_multiplies_that_head_only(family):
    """Head 1's gate rows changed: the logits change, unless head 1 is masked (then nothing changes: the gate
    multiplies no other head's output, and a masked head's zeros stay zeros whatever its gate)."""
    inputs = tiny_inputs()
    model = build(family)
    before = logits(model, inputs)
    with mask_heads(model, {("dec_self", 1): [1]}):
        masked = logits(model, inputs)
    gate = model.model.layers[1].self_attn.get_submodule(GATED[family][1])
    with torch.no_grad():
        gate.weight[_gate_rows(family, 1)] *= -3
    assert not torch.allclose(logits(model, inputs), before)
    with mask_heads(model, {("dec_self", 1): [1]}):
        assert torch.equal(logits(model, inputs), masked)


@pytest.mark.parametrize("family", FAMILIES)
def test_pruning_removes_each_heads_gate_rows(family):
    """Heads 0 and 2 of layer 1 pruned: the gate projection keeps heads 1 and 3's rows (a row per head for
    g_proj; [query | gate] per head for q_gate_proj), kv_b_proj their [k_nope | v] rows, o_proj their columns;
    what all heads share (latents, norms, the indexer) is untouched."""
    model = build(family)
    attention = model.model.layers[1].self_attn
    path, width = GATED[family][1], GATED[family][2]
    before = {name: p.detach().clone() for name, p in attention.named_parameters()}
    assert prune_heads(model, {("dec_self", 1): [0, 2]}) == {("dec_self", 1): [1, 3]}
    rows = lambda size: [r for h in (1, 3) for r in range(h * size, (h + 1) * size)]  # noqa: E731
    assert torch.equal(attention.get_submodule(path).weight, before[f"{path}.weight"][rows(width)])
    assert torch.equal(attention.kv_b_proj.weight, before["kv_b_proj.weight"][rows(NOPE + V)])
    assert torch.equal(attention.o_proj.weight, before["o_proj.weight"][:, rows(V)])
    sliced = {f"{path}.weight", "kv_b_proj.weight", "o_proj.weight"}
    if getattr(attention, "q_b_proj", None) is not None:
        assert torch.equal(attention.q_b_proj.weight, before["q_b_proj.weight"][rows(NOPE + ROPE)])
        sliced.add("q_b_proj.weight")
    for name, parameter in attention.named_parameters():
        if name not in sliced:
            assert torch.equal(parameter, before[name]), name


@pytest.mark.parametrize("family", FAMILIES)
def test_a_gate_the_table_does_not_know_is_refused(family, monkeypatch):
    """Without the model type's entry in OUTPUT_GATES (or with another projection named there) the gate is
    refused before any work, naming its projection: pruning would not know its rows."""
    from headlab.adapters import families

    monkeypatch.delitem(families.OUTPUT_GATES, family)
    message = rf"self_attn: the attention function's output reaches model\.layers\.0\.self_attn\.o_proj multiplied, " \
              rf"elementwise, by a gate computed from {GATED[family][1]} \(an output gate"
    with pytest.raises(HeadlabError, match=message):
        attention_blocks(build(family))
    monkeypatch.setitem(families.OUTPUT_GATES, family, ("kv_b_proj",))
    with pytest.raises(HeadlabError, match=message):
        attention_blocks(build(family))


@pytest.mark.parametrize("family", ["bailing_hybrid", "dots3_note_text", "axk2"])
def test_lrp_holds_the_gate_constant_and_conserves(family):
    """g_proj's output is detached with the latent attention's queries and keys (importance/rules.py; A.X-K2's
    q_gate_proj with the queries): the gate a per-head weight of the heads' outputs, so bias-free in float64 every
    layer's input holds the whole logit (the backward against a reference: tests/test_lrp_latent_attention.py).
    Before: refused, naming the latent attention and the gate; A.X-K2 then for its gated norm (session 29: its gate
    held constant too)."""
    import numpy as np

    from headlab.capture import eager_attention
    from headlab.importance.rules import lrp_rules

    model = build(family).double()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.zero_()
    with torch.enable_grad(), eager_attention(model), lrp_rules(model):
        out = model(input_ids=torch.tensor([[5, 17, 33, 8, 61, 4]]), output_hidden_states=True)
        y = out.logits[0, 4].max()
        grads = torch.autograd.grad(y, list(out.hidden_states))
        totals = [float((h * g).sum().detach()) for h, g in zip(out.hidden_states, grads)]
    np.testing.assert_allclose(totals, float(y.detach()), rtol=1e-12)


# dots3-note's released checkpoints are the multimodal model (model_type dots3_note: text_config, vision_config,
# audio_config); transformers' Dots3NoteForCausalLM (AutoModelForCausalLM of dots3_note and dots3_note_text) is the
# text model alone, which on text inputs is what Dots3NoteForConditionalGeneration runs (embeddings, language model,
# lm_head), and does not declare the towers' tensors ignorable.
_TOWERS = dict(vision_config=dict(mlp_layer_types=["dense"], hidden_size=16, intermediate_size=20, num_hidden_layers=1,
                                  num_attention_heads=2, adapter_in_dim=16, adapter_out_dim=32),
               audio_config=dict(hidden_size=16, intermediate_size=20, num_hidden_layers=1, num_attention_heads=2,
                                 adapter_input_size=16, adapter_out_dim=32, downsample_hidden_size=8))


def dots3_note_multimodal() -> torch.nn.Module:
    if "dots3_note" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no dots3_note")
    text = CONFIG_MAPPING["dots3_note_text"](**{**_SIZES, **_INDEXER})
    config = CONFIG_MAPPING["dots3_note"](text_config=text.to_dict(), **_TOWERS)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return tf.Dots3NoteForConditionalGeneration(config).eval()


def test_the_multimodal_dots3_note_is_analysed_as_its_language_model():
    """The Python API given Dots3NoteForConditionalGeneration: its language model's blocks, with their gate rows, the
    towers idle; capture equals transformers' eager output_attentions and pruning equals masking. Before session 37,
    refused naming the text model to pass: discovery looked the gate up under the wrapper's type ("dots3_note"), not
    listed; now under its attention module's config's (adapters._table_type; tests/test_lfm3_vl.py)."""
    model = dots3_note_multimodal()
    model.set_experts_implementation("eager")  # grouped matmuls take no float64
    model = model.double()
    blocks = attention_blocks(model)
    assert [(b.kind, b.layer, b.idle) for b in blocks] == [("enc_self", 0, True), ("dec_self", 0, False),
                                                          ("dec_self", 1, False)]
    inputs = tiny_inputs()
    with torch.no_grad():
        eager = dots3_note_multimodal()
        eager.set_experts_implementation("eager")
        eager.set_attn_implementation("eager")
        expected = [m for m in eager.double()(**inputs, output_attentions=True).attentions if m is not None]
    from headlab import capture_attention

    with capture_attention(model) as record:
        logits(model, inputs)
    for (_, layer), probs in record.items():
        torch.testing.assert_close(probs, expected[layer], atol=1e-12, rtol=0)
    spec = {("dec_self", 1): [1]}
    with mask_heads(model, spec):
        masked = logits(model, inputs)
    prune_heads(model, spec)
    keep = inputs["attention_mask"].bool()
    torch.testing.assert_close(logits(model, inputs)[keep], masked[keep], atol=1e-10, rtol=0)


def test_a_multimodal_dots3_note_checkpoint_is_refused_naming_its_language_model(tmp_path, capsys):
    """load_model and the command line on the saved multimodal model: refused, naming Dots3NoteForCausalLM and how to
    save it alone (before: "46 tensor(s) of the weights are not in the model (audio_encoder...)"); the directory so
    saved loads, and its logits are the multimodal model's on text."""
    from headlab.cli import main
    from headlab.loading import load_model

    full = dots3_note_multimodal()
    full.save_pretrained(tmp_path / "full")
    message = (r"full is a multimodal 'dots3_note' checkpoint: headlab analyses its language model, Dots3NoteForCausalLM "
               r"\(model_type 'dots3_note_text'\), and loaded every tensor of it, but \d+ tensor\(s\) of the checkpoint "
               r"are not in it \(audio_encoder\.\*, vision_encoder\.\*\), which headlab does not "
               r"ignore\. Save the language model alone and pass that directory: "
               r"transformers\.Dots3NoteForCausalLM\.from_pretrained\(path\)\.save_pretrained\(text_dir\)")
    with pytest.raises(HeadlabError, match=message):
        load_model(str(tmp_path / "full"))
    code = main(["prune", str(tmp_path / "full"), "--heads", "dec_self:1:0", "--out", str(tmp_path / "out")])
    assert code != 0 and re.search(message, " ".join(capsys.readouterr().err.split()))
    assert not (tmp_path / "out").exists()

    tf.Dots3NoteForCausalLM.from_pretrained(tmp_path / "full").save_pretrained(tmp_path / "text")
    model = load_model(str(tmp_path / "text"))
    assert type(model).__name__ == "Dots3NoteForCausalLM" and model.config.model_type == "dots3_note_text"
    assert [b.name for b in attention_blocks(model)] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    inputs = tiny_inputs()
    torch.testing.assert_close(logits(model, inputs), logits(full, inputs), atol=1e-6, rtol=0)


# Beam (transformers 5.24, BeamAttention): q/k/v projections (grouped query attention, q_norm/k_norm over the head
# size) and gate = gate_proj(hidden_states).view_as(attn_output) + gate_bias[None, None, :, None], the attention
# function's output [batch, seq, heads, head_dim] times sigmoid(gate) before o_proj: head h's gate is its head_dim
# rows of gate_proj plus gate_bias[h] (adapters.families.QKV_OUTPUT_GATES). Before: refused before any work ("an
# output gate ... known only for the model types of OUTPUT_GATES"). Its full-attention layer (1) runs without RoPE,
# its queries scaled per position, the same for every head.
BEAM_D = 8
_BEAM = dict(vocab_size=99, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=BEAM_D, max_position_embeddings=64, bos_token_id=0, eos_token_id=1,
             pad_token_id=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_group=1, topk_group=1,
             mlp_layer_types=["dense", "sparse"])


def build_beam(attn_implementation: str = "sdpa", seed: int = 0, **sizes) -> torch.nn.Module:
    if "beam" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no beam")
    config = CONFIG_MAPPING["beam"](**{**_BEAM, **sizes})
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = model_class_for(config)(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or "norm" in name:  # gate_bias too (zeros as initialised): off, so it counts
                parameter.add_(torch.randn_like(parameter) * (2.0 if name.endswith("gate_bias") else 0.1))
            if name.endswith("gate_proj.weight") and "self_attn" in name:
                parameter.mul_(8)
    return model


def _beam_attention(model, layer: int):
    return model.model.layers[layer].self_attn


def _beam_rows(heads, size: int = BEAM_D) -> list[int]:
    return [r for h in heads for r in range(h * size, (h + 1) * size)]


def test_beam_blocks_are_found_with_their_gate():
    """Its q/k/v projections tied (the gate no longer hides them), the gate's rows and bias sliced per head."""
    blocks = attention_blocks(build_beam())
    assert [(b.kind, b.layer, b.n_heads, b.n_kv_heads, b.d_head) for b in blocks] == [("dec_self", i, 4, 2, BEAM_D)
                                                                                       for i in range(2)]
    family = blocks[0].family
    assert (family.q, family.k, family.v, family.o) == ("q_proj", "k_proj", "v_proj", "o_proj")
    assert family.head_rows == (("gate_proj", ("head_dim",)),) and family.head_vectors == ("gate_bias",)


def test_beam_capture_masking_and_gates():
    """Capture equals output_attentions; masking the query heads of a key/value head equals zeroing its value rows
    of v_proj (its output, times its gate, is zero either way); scalar gates at one change nothing."""
    inputs = tiny_inputs()
    check_capture_equals_output_attentions(build_beam, "dec_self", inputs)
    values = (lambda model, layer: _beam_attention(model, layer).v_proj, lambda j: range(j * BEAM_D, (j + 1) * BEAM_D), 2)
    check_masking_equals_zeroed_values(build_beam, "dec_self", values, inputs)
    check_gates_at_one_change_nothing(build_beam(), inputs)


@pytest.mark.parametrize("part", ["gate_proj rows", "gate_bias entry"])
def test_beam_each_heads_gate_multiplies_that_head_only(part):
    """Head 1's gate changed (its rows of gate_proj, or its gate_bias entry): the logits change, unless head 1 is
    masked."""
    inputs = tiny_inputs()
    model = build_beam()
    before = logits(model, inputs)
    with mask_heads(model, {("dec_self", 1): [1]}):
        masked = logits(model, inputs)
    attention = _beam_attention(model, 1)
    with torch.no_grad():
        if part == "gate_proj rows":
            attention.gate_proj.weight[_beam_rows([1])] *= -3
        else:
            attention.gate_bias[1] -= 5
    assert not torch.allclose(logits(model, inputs), before)
    with mask_heads(model, {("dec_self", 1): [1]}):
        assert torch.equal(logits(model, inputs), masked)


def test_beam_pruning_slices_the_gate_generates_as_masked_and_reloads(tmp_path):
    """Layer 0 emptied, layer 1 loses heads 0 and 3 (one per key/value head: uneven groups): gate_proj keeps the kept
    heads' rows, gate_bias their entries; the pruned model equals the masked one on padded rows and in cached
    generation, and reloads (load_pruned, and plain transformers), every weight loaded."""


    from support.family_matrix import check_pruned_generates_as_masked, padded_inputs

    model = build_beam()
    attention = _beam_attention(model, 1)
    before = {name: p.detach().clone() for name, p in attention.named_parameters()}
    ids, mask = padded_inputs(pad_id=2)
    spec = {("dec_self", 0): [0, 1, 2, 3], ("dec_self", 1): [0, 3]}
    expected, expected_tokens = check_pruned_generates_as_masked(model, spec, [0, 2], ids, mask)
    assert torch.equal(attention.gate_proj.weight, before["gate_proj.weight"][_beam_rows([1, 2])])
    assert torch.equal(attention.gate_bias, before["gate_bias"][[1, 2]])
    assert torch.equal(attention.q_proj.weight, before["q_proj.weight"][_beam_rows([1, 2])])
    assert torch.equal(attention.o_proj.weight, before["o_proj.weight"][:, _beam_rows([1, 2])])
    for name in ("q_norm.weight", "k_norm.weight"):
        assert torch.equal(dict(attention.named_parameters())[name], before[name])

    check_pruned_reloads(model, tmp_path, [0, 2], ids, mask, expected, expected_tokens)


def test_beam_lrp_holds_the_gate_constant_and_conserves():
    """LRP: gate_proj's output is detached with the query and key projections (the gate a per-feature weight of
    the heads' outputs, as Qwen3-Next's), so relevance is conserved; not detached, part of it leaks into the gate.
    Dense MLPs: LRP refuses BeamExperts (its own _apply_gate) before any work. Beam's default final logit
    soft-capping (y = 30 tanh(z / 30)) stays on: the relevance of z, the logit compute_lrp explains, sums to z, and
    y's to z (1 - tanh(z / 30)^2) (before, the cap was turned off here: y's relevance, 3.395, is not y, 3.425)."""
    from headlab.importance import ImportanceData, compute_lrp, describe_model
    from support.family_matrix import check_lrp_conserves

    model = build_beam(attn_implementation="eager", mlp_layer_types=["dense", "dense"])
    assert model.config.final_logit_softcapping == 30
    data = ImportanceData.from_ids([[5, 17, 33, 8, 1], [9, 61, 4, 27, 44, 12, 1]])
    record = compute_lrp(model, data, describe_model(model), bootstrap=0).signature["conservation"]
    # widened to float64 (its gated MLPs), also where Beam's MLP asks for float32 (act(gate.float()) * up.float()):
    # before, that product was computed in float32, and 3e-6 of the logit was lost
    assert record["n_outside"] == 0 and abs(record["with_biases"]["min"] - 1) < 1e-12
    assert abs(record["with_biases"]["max"] - 1) < 1e-12
    check_lrp_conserves(model, model.model.layers[0])


def test_beam_gate_unknown_to_the_table_is_refused(monkeypatch):
    """Without Beam's entry in OUTPUT_GATES, refused before any work naming gate_proj (gate_proj(x).view_as(
    attn_output): the attention output lends its shape only, the gate is named)."""
    from headlab.adapters import families

    monkeypatch.delitem(families.OUTPUT_GATES, "beam")
    with pytest.raises(HeadlabError, match=r"self_attn: the attention function's output reaches model\.layers\.0\."
                                           r"self_attn\.o_proj multiplied, elementwise, by a gate computed from "
                                           r"gate_proj \(an output gate"):
        attention_blocks(build_beam())


# AFMoE, Laguna and LFM3 (session 28, branch gates28; transformers 5.24's forwards, adapters.families.QKV_OUTPUT_GATES):
# q/k/v projections (grouped-query attention, q_norm/k_norm over the head size) and a gate from a projection of the
# layer's input between the attention function and o_proj. AFMoE (AfmoeAttention): the output reshaped [batch, seq,
# heads * head_dim] times sigmoid(gate_proj(x)), gate_proj hidden -> heads x head_dim (head h: rows h * head_dim ..).
# Laguna (LagunaAttention): softplus(g_proj(x)), per head (gating True / "per-head": g_proj hidden -> heads, the output
# viewed [.., heads, head_dim] times gate.unsqueeze(-1); head h: row h) or per element (hidden -> heads x head_dim), and
# its layers may have head counts of their own (num_attention_heads_per_layer). LFM3 (Lfm3Attention): the output
# [batch, seq, heads, head_dim] times sigmoid(g_proj(x)).unsqueeze(-1), g_proj hidden -> heads (head h: row h), its
# other layers short convolutions. Before: refused before any work ("multiplied, elementwise, by a gate computed from
# gate_proj / g_proj (an output gate ...)").
_QKV = dict(vocab_size=99, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=BEAM_D, max_position_embeddings=64, bos_token_id=0, eos_token_id=1,
            pad_token_id=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, sliding_window=4,
            layer_types=["sliding_attention", "full_attention"])
# variant -> (model type, its config beyond _QKV, the gate's projection, its rows per head, the heads per layer)
QKV_GATED = {
    "afmoe": ("afmoe", dict(num_dense_layers=1, attention_bias=True, mup_enabled=True), "gate_proj", BEAM_D, [4, 4]),
    "laguna": ("laguna", dict(gating=True, num_attention_heads_per_layer=[6, 4], mlp_layer_types=["dense", "sparse"]),
               "g_proj", 1, [6, 4]),
    "laguna-per-element": ("laguna", dict(gating="per-element", attention_bias=True, mlp_layer_types=["dense", "sparse"]),
                           "g_proj", BEAM_D, [4, 4]),
    "lfm3": ("lfm3", {}, "g_proj", 1, [4, 4]),
}
QKV_VARIANTS = tuple(QKV_GATED)


def build_qkv_gated(variant: str, attn_implementation: str = "sdpa", seed: int = 0, **sizes) -> torch.nn.Module:
    model_type, extra, gate, _, _ = QKV_GATED[variant]
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {model_type}")
    config = CONFIG_MAPPING[model_type](**{**_QKV, **extra, **sizes})
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = model_class_for(config)(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or "norm" in name:  # off their initial values, so that they count
                parameter.add_(torch.randn_like(parameter) * 0.1)
            if name.endswith(f"self_attn.{gate}.weight"):  # gates far from one another and from their middle
                parameter.mul_(8)
    return model


def _gate(model, layer: int, variant: str):
    return model.model.layers[layer].self_attn.get_submodule(QKV_GATED[variant][2])


@pytest.mark.parametrize("variant", QKV_VARIANTS)
def test_qkv_gated_blocks_are_found_with_their_gate(variant):
    """Before: refused before any work. Its q/k/v projections tied, the gate's rows per head named (Laguna's per
    head or per element as its gating says; each layer its own head count)."""
    _, _, gate, width, heads = QKV_GATED[variant]
    blocks = attention_blocks(build_qkv_gated(variant))
    assert [(b.kind, b.layer, b.n_heads, b.n_kv_heads, b.d_head) for b in blocks] == \
        [("dec_self", i, n, 2, BEAM_D) for i, n in enumerate(heads)]
    family = blocks[0].family
    assert (family.q, family.k, family.v, family.o) == ("q_proj", "k_proj", "v_proj", "o_proj")
    assert family.head_rows == ((gate, (1,) if width == 1 else ("head_dim",)),) and family.head_vectors == ()


@pytest.mark.parametrize("variant", QKV_VARIANTS)
def test_qkv_gated_capture_masking_and_gates(variant):
    """Capture equals output_attentions; masking the query heads of a key/value head of layer 1 equals zeroing its
    value rows of v_proj (their output, times the gate, is zero either way); scalar gates at one change nothing."""
    inputs = tiny_inputs()
    build = lambda **kw: build_qkv_gated(variant, **kw)  # noqa: E731
    check_capture_equals_output_attentions(build, "dec_self", inputs)
    values = (lambda model, layer: model.model.layers[layer].self_attn.v_proj,
              lambda j: range(j * BEAM_D, (j + 1) * BEAM_D), 2)
    check_masking_equals_zeroed_values(build, "dec_self", values, inputs)
    check_gates_at_one_change_nothing(build(), inputs)


@pytest.mark.parametrize("variant", QKV_VARIANTS)
def test_qkv_gated_each_heads_gate_multiplies_that_head_only(variant):
    """Head 1's gate rows of layer 1 changed: the logits change, unless head 1 is masked."""
    width = QKV_GATED[variant][3]
    inputs = tiny_inputs()
    model = build_qkv_gated(variant)
    before = logits(model, inputs)
    with mask_heads(model, {("dec_self", 1): [1]}):
        masked = logits(model, inputs)
    with torch.no_grad():
        _gate(model, 1, variant).weight[_beam_rows([1], width)] *= -3
    assert not torch.allclose(logits(model, inputs), before)
    with mask_heads(model, {("dec_self", 1): [1]}):
        assert torch.equal(logits(model, inputs), masked)


@pytest.mark.parametrize("variant", QKV_VARIANTS)
def test_qkv_gated_pruning_slices_the_gate_generates_as_masked_and_reloads(variant, tmp_path):
    """Layer 0 emptied, layer 1 loses heads 0 and 3 (one per key/value head: uneven groups): the gate's projection
    keeps the kept heads' rows, q_proj their rows, o_proj their columns, the norms over one head stay; the pruned model
    equals the masked one on padded rows and in cached generation, and reloads (load_pruned, plain transformers)."""
    from support.family_matrix import check_pruned_generates_as_masked, padded_inputs

    width = QKV_GATED[variant][3]
    model = build_qkv_gated(variant)
    attention = model.model.layers[1].self_attn
    before = {name: p.detach().clone() for name, p in attention.named_parameters()}
    ids, mask = padded_inputs(pad_id=2)
    spec = {("dec_self", 0): list(range(QKV_GATED[variant][4][0])), ("dec_self", 1): [0, 3]}
    expected, expected_tokens = check_pruned_generates_as_masked(model, spec, [0, 2], ids, mask)
    gate = QKV_GATED[variant][2]
    assert torch.equal(_gate(model, 1, variant).weight, before[f"{gate}.weight"][_beam_rows([1, 2], width)])
    assert torch.equal(attention.q_proj.weight, before["q_proj.weight"][_beam_rows([1, 2])])
    assert torch.equal(attention.o_proj.weight, before["o_proj.weight"][:, _beam_rows([1, 2])])
    for name in ("q_norm.weight", "k_norm.weight"):
        assert torch.equal(dict(attention.named_parameters())[name], before[name])
    check_pruned_reloads(model, tmp_path, [0, 2], ids, mask, expected, expected_tokens)


def test_lfm3_with_its_short_convolutions_prunes_as_masked(tmp_path):
    """LFM3 as released: short-convolution layers beside the attention ones (layer 0 a convolution, its state in the
    cache): the attention layers are blocks 1 and 2, and pruning (layer 1 emptied) equals masking in cached
    generation and reloads."""
    from support.family_matrix import check_pruned_generates_as_masked, padded_inputs

    model = build_qkv_gated("lfm3", num_hidden_layers=3, layer_types=["conv", "sliding_attention", "full_attention"])
    assert [(b.layer, b.n_heads) for b in attention_blocks(model)] == [(1, 4), (2, 4)]
    ids, mask = padded_inputs(pad_id=2)
    spec = {("dec_self", 1): [0, 1, 2, 3], ("dec_self", 2): [2]}
    expected, tokens = check_pruned_generates_as_masked(model, spec, [0, 3], ids, mask)
    assert model.model.layers[2].self_attn.g_proj.weight.shape == (3, 32)
    check_pruned_reloads(model, tmp_path, [0, 3], ids, mask, expected, tokens)


def test_lfm3_without_its_gate_has_no_gate_rows():
    """use_attention_gate=False: no g_proj, no gate: nothing of the table's applies, and the heads prune as any."""
    blocks = attention_blocks(build_qkv_gated("lfm3", use_attention_gate=False))
    assert [b.family.head_rows for b in blocks] == [(), ()]


@pytest.mark.parametrize("variant", QKV_VARIANTS)
def test_qkv_gated_lrp_holds_the_gate_constant_and_conserves(variant):
    """LRP: the gate's projection is detached with the query and key projections (the gate a per-feature weight of
    the heads' outputs, as Beam's), so relevance is conserved on dense layers."""
    from headlab.importance import ImportanceData, compute_lrp, describe_model
    from headlab.importance.rules import check_rules
    from support.family_matrix import check_lrp_conserves

    # LFM3's dense MLP is LFM2's (w2(silu(w1 x) * w3 x)), which the rules know since lrpnorm28
    dense = {"afmoe": dict(num_dense_layers=2), "lfm3": {}}.get(variant, dict(mlp_layer_types=["dense", "dense"]))
    model = build_qkv_gated(variant, attn_implementation="eager", **dense)
    check_rules(model)
    # the pipeline's record, in float64 (Laguna's gate takes softplus in float32; AFMoE's norms ask for float32 too)
    model64 = build_qkv_gated(variant, attn_implementation="eager", **dense).to(torch.float64)
    data = ImportanceData.from_ids([[5, 17, 33, 8, 1], [9, 61, 4, 27, 44, 12, 1]])
    record = compute_lrp(model64, data, describe_model(model64), bootstrap=0).signature["conservation"]
    assert record["n_outside"] == 0 and abs(record["with_biases"]["min"] - 1) < 1e-12
    assert abs(record["with_biases"]["max"] - 1) < 1e-12
    check_lrp_conserves(model, model.model.layers[0])


def test_lfm3_lrp_runs_through_its_convolutions_and_conserves():
    """LFM3 with its gated short convolutions (B * x before the convolution, C * y after it: B and C held constant,
    session 35, tests/test_lrp_gated_short_conv.py; refused before any work until then). Its MLP, w2(silu(w1 x) * w3 x),
    has LFM2's rule."""
    from headlab.importance import ImportanceData, compute_lrp, describe_model
    from headlab.importance.rules import check_rules

    model = build_qkv_gated("lfm3", attn_implementation="eager", num_hidden_layers=3,
                            layer_types=["conv", "sliding_attention", "full_attention"]).to(torch.float64)
    check_rules(model)
    data = ImportanceData.from_ids([[5, 17, 33, 8, 1], [9, 61, 4, 27, 44, 12, 1]])
    total = compute_lrp(model, data, describe_model(model), bootstrap=0).signature["conservation"]["with_biases"]
    assert abs(total["min"] - 1) < 1e-12 and abs(total["max"] - 1) < 1e-12


@pytest.mark.parametrize("variant", QKV_VARIANTS)
def test_qkv_gate_unknown_to_the_table_is_refused(variant, monkeypatch):
    """Without the type's entry in OUTPUT_GATES, refused before any work naming the gate's projection; with the entry
    but no rows from QKV_OUTPUT_GATES (a forward other than the one read: Laguna's gate_per_head not a bool), refused
    too, where pruning would have left the gate's rows unsliced."""
    from headlab.adapters import families

    model_type, _, gate, _, _ = QKV_GATED[variant]
    monkeypatch.delitem(families.OUTPUT_GATES, model_type)
    with pytest.raises(HeadlabError, match=rf"self_attn: the attention function's output reaches model\.layers\.0\."
                                           rf"self_attn\.o_proj multiplied, elementwise, by a gate computed from "
                                           rf"{gate} \(an output gate"):
        attention_blocks(build_qkv_gated(variant))
    monkeypatch.undo()
    monkeypatch.setitem(families.QKV_OUTPUT_GATES, model_type, lambda core: ((), ()))
    with pytest.raises(HeadlabError, match=rf"model\.layers\.0\.self_attn: an output gate from {gate} that headlab\."
                                           r"adapters\.families\.QKV_OUTPUT_GATES gives no rows per head for"):
        attention_blocks(build_qkv_gated(variant))


def test_laguna_gate_flag_other_than_a_bool_gives_no_rows():
    """Laguna's rows come from its module's gate_per_head (True: one row per head; False: one per value); anything
    else is a forward headlab did not read: no rows, so the gate is refused (above), not sliced by a guess."""
    from headlab.adapters.families import laguna_gate

    core = build_qkv_gated("laguna").model.layers[0].self_attn
    assert laguna_gate(core) == ((("g_proj", (1,)),), ())
    core.gate_per_head = False
    assert laguna_gate(core) == ((("g_proj", ("head_dim",)),), ())
    core.gate_per_head = "per-head"
    assert laguna_gate(core) == ((), ())


def test_a_gated_type_refused_for_a_reason_of_its_own_is_refused_naming_it(monkeypatch):
    """OUTPUT_GATES_REFUSED (Inkling2 and Inkling2-Loop's until session 40, both analysed since: tests/test_inkling2.py):
    a type listed there is refused before any work with its reason, where discovery sees its gate and where its probe
    forward fails (converted whole to float64, Inkling2's does)."""
    from headlab import adapters
    from test_inkling2 import build as build_inkling2

    monkeypatch.setitem(adapters.OUTPUT_GATES_REFUSED, "inkling2_text", "a reason of its own")
    monkeypatch.delitem(adapters.OUTPUT_GATES, "inkling2_text")  # as for a type whose gate is not listed
    monkeypatch.delitem(adapters.PROBE_FAILURES, "inkling2_text")
    model = build_inkling2()
    with pytest.raises(HeadlabError, match=r"model_type 'inkling2_text'\): model\.layers\.\d\.self_attn: an output "
                                           r"gate from o_proj\.gate_proj: a reason of its own"):
        attention_blocks(model)
    with pytest.raises(HeadlabError, match=r"model_type 'inkling2_text'\): a reason of its own$"):
        attention_blocks(build_inkling2().double())
