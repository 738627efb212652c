"""Families headlab has no table for, found at run time (headlab.adapters.discovery): Granite,
Cohere, Starcoder2, GLM, EXAONE 4, Persimmon (fused per-head query_key_value, its layout read since fused29) and
RoBERTa-PreLayerNorm
(an encoder whose output projection lies outside the module that calls the attention function), tiny models of
tests/support/discovered.py; and modules that do not go through transformers' attention
interface, or change the heads' outputs before the output projection, refused before any work.

On each family: the blocks have the config's head counts; capture equals transformers' own
``output_attentions`` (eager); masking the query heads of a key/value head equals zeroing that
head's value weights by hand; gates at one change nothing; a head whose values are zero gets a
gradient score of exactly 0. Where discovery ties one projection to each of the query, key and
value, physical pruning equals masking and LRP conserves relevance on a bias-free copy; elsewhere
pruning and LRP are refused with what is missing. Granite with unit multipliers is Llama: its
confidence and gradient scores through discovery equal those of the Llama table entry on the same
weights.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as tf
from torch import nn

from headlab import HeadlabError, attention_blocks, capture_attention, mask_heads
from headlab.cli import main
from support.discovered import ENCODERS, FAMILIES, TIED, VALUE_ROWS, tiny_model
from support.family_matrix import (
    ANALYZE_STAGES,
    analyze,
    check_capture_equals_output_attentions,
    check_gates_at_one_change_nothing,
    check_head_counts,
    check_lrp_conserves,
    check_masking_equals_zeroed_values,
    check_pruning_equals_masking,
    save_tiny,
    tiny_inputs,
    treebank_files,
    zero_values,
)
from support.family_matrix import logits as _logits


def _kind(family: str) -> str:
    return "enc_self" if family in ENCODERS else "dec_self"


def _build(family: str):
    return lambda **kwargs: tiny_model(family, **kwargs)


@pytest.mark.parametrize("family", FAMILIES)
def test_blocks_are_discovered_with_the_configs_head_counts(family):
    model = tiny_model(family)
    blocks = check_head_counts(model, _kind(family), VALUE_ROWS[family][2])
    assert blocks[0].family.name == f"discovered:{model.config.model_type}"
    if family in ENCODERS:  # the block around the calling module, holding the output projection
        attn = model.roberta_prelayernorm.encoder.layer[1].attention
        assert (blocks[1].module, blocks[1].core, blocks[1].o) == (attn, attn.self, attn.output.dense)
        assert (blocks[1].q, blocks[1].k, blocks[1].v) == (attn.self.query, attn.self.key, attn.self.value)
        return
    attn = model.model.layers[1].self_attn
    assert blocks[1].module is attn and blocks[1].o is getattr(attn, "dense" if family == "persimmon" else "o_proj")
    if family in TIED:
        assert (blocks[1].q, blocks[1].k, blocks[1].v) == (attn.q_proj, attn.k_proj, attn.v_proj)
    else:  # Persimmon: its fused projection, in its class's layout (before fused29: none tied, qkv None)
        assert (blocks[1].q, blocks[1].k, blocks[1].v, blocks[1].qkv) == (None, None, None, attn.query_key_value)


@pytest.mark.parametrize("family", FAMILIES)
def test_capture_equals_output_attentions(family):
    # the second sequence is padded
    model, _ = check_capture_equals_output_attentions(_build(family), _kind(family), tiny_inputs())
    assert model.config._attn_implementation == "sdpa"  # restored


@pytest.mark.parametrize("family", FAMILIES)
def test_masking_equals_zeroed_values(family):
    check_masking_equals_zeroed_values(_build(family), _kind(family), VALUE_ROWS[family], tiny_inputs())


@pytest.mark.parametrize("family", FAMILIES)
def test_gates_at_one_change_nothing_and_a_silent_head_has_no_gradient(family):
    from headlab.importance import ImportanceData, compute_gradient, describe_model

    model = tiny_model(family)
    check_gates_at_one_change_nothing(model, tiny_inputs())
    zero_values(model, VALUE_ROWS[family], 0, 0)  # the heads reading key/value head 0 of layer 0 now output 0
    silent = list(range(4 // VALUE_ROWS[family][2]))
    g = torch.Generator().manual_seed(5)
    data = ImportanceData.from_ids([torch.randint(3, 99, (k,), generator=g).tolist() for k in (5, 3, 6)])
    scores = compute_gradient(model, data, describe_model(model), batch_size=2, normalize=False)
    layer0 = scores[_kind(family)][0]
    assert (layer0[silent] == 0).all() and (layer0[len(silent):] > 0).all(), layer0
    assert (scores[_kind(family)][1] > 0).all()


def _llama_twin(model):
    """Granite with unit multipliers and attention_multiplier = d ** -0.5 is Llama: the same weights."""
    fields = set(tf.LlamaConfig().to_dict()) - {"model_type"}
    config = tf.LlamaConfig(**{k: v for k, v in model.config.to_dict().items() if k in fields})
    config._attn_implementation = "sdpa"
    twin = tf.LlamaForCausalLM(config).eval()
    twin.load_state_dict(model.state_dict())
    return twin


def test_discovered_scores_equal_the_table_entrys_on_the_same_weights():
    from headlab.importance import ImportanceData, compute_confidence, compute_gradient, describe_model

    granite = tiny_model("granite")
    llama = _llama_twin(granite)
    inputs = tiny_inputs()
    torch.testing.assert_close(_logits(granite, inputs), _logits(llama, inputs), atol=1e-5, rtol=0)
    assert attention_blocks(llama)[0].family.name == "llama-like"
    g = torch.Generator().manual_seed(5)
    data = ImportanceData.from_ids([torch.randint(3, 99, (k,), generator=g).tolist() for k in (5, 3, 6, 4)])
    for compute in (compute_confidence, compute_gradient):
        ours = compute(granite, data, describe_model(granite), batch_size=2)
        table = compute(llama, data, describe_model(llama), batch_size=2)
        np.testing.assert_allclose(ours["dec_self"], table["dec_self"], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", TIED)
def test_physical_pruning_equals_masking(family):
    check_pruning_equals_masking(tiny_model(family), _kind(family), tiny_inputs(), atol=1e-5)


def _layout_unread(monkeypatch) -> None:
    """Persimmon as a fused attention class whose layout headlab has not read (its entry in
    FUSED_ATTENTION_CLASSES, fused29, taken out): the generic refusals of untied projections."""
    from headlab.adapters import families

    monkeypatch.delitem(families.FUSED_ATTENTION_CLASSES, "PersimmonAttention")


def test_pruning_and_lrp_are_refused_where_the_projections_are_not_tied(monkeypatch):
    """A fused query_key_value whose layout headlab has not read feeds the query, key and value at once:
    discovery cannot tell its layout, so nothing is sliced and LRP (which holds the queries and keys
    constant) is refused. (Persimmon's layout is read since fused29: tests/test_fused_codegen_persimmon_dbrx.py.)"""
    from headlab import prune_heads
    from headlab.importance.rules import check_rules

    _layout_unread(monkeypatch)
    model, inputs = tiny_model("persimmon"), tiny_inputs()
    before = _logits(model, inputs)
    with pytest.raises(HeadlabError, match="physical pruning is refused: this family's projection layout is unknown"):
        prune_heads(model, {("dec_self", 0): [1]})
    assert torch.equal(_logits(model, inputs), before)
    with pytest.raises(HeadlabError, match="LRP: no rule for the attention of .*query and key projections are unknown"):
        check_rules(model)


@pytest.mark.parametrize("family", ["granite", "persimmon"])
def test_analyze_end_to_end(family, tmp_path, capsys, monkeypatch):
    """Every stage on a discovered family; on a fused layout headlab has not read (Persimmon's, taken out of
    FUSED_ATTENTION_CLASSES) LRP is refused and the rest is done."""
    if family == "persimmon":
        _layout_unread(monkeypatch)
    save_tiny(tiny_model(family), tmp_path / family, treebank_files(tmp_path))
    code, stages = analyze(tmp_path / family, tmp_path)
    err = capsys.readouterr().err
    assert code == (0 if family == "granite" else 1), err
    for name in ANALYZE_STAGES:
        assert stages[name]["status"] == "done", stages[name]
    if family == "granite":
        assert stages["lrp"]["status"] == "done", stages["lrp"]
    else:
        assert stages["lrp"]["status"] != "done" and err.count("query and key projections are unknown") == 1


def test_prune_is_refused_before_loading_where_the_projections_are_not_tied(tmp_path, capsys, monkeypatch):
    import headlab.loading

    _layout_unread(monkeypatch)
    save_tiny(tiny_model("persimmon"), tmp_path / "persimmon", ["the", "cat"])
    monkeypatch.setattr(headlab.loading, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    code = main(["prune", str(tmp_path / "persimmon"), "--heads", "dec_self:0:1", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("projection layout is unknown") == 1
    assert not (tmp_path / "out").exists()


# -- modules that discovery refuses -----------------------------------------------------------
class _HandMadeAttention(nn.Module):
    """Attention written out by hand, with the usual projection names: it never calls transformers'
    attention interface, so headlab cannot see what it computes."""

    def __init__(self, width: int = 32, heads: int = 4):
        super().__init__()
        self.head_dim, self.heads = width // heads, heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(width, width) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        out = torch.softmax(q @ k.transpose(-1, -2) * self.head_dim ** -0.5, -1) @ v
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class _HandMadeModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(99, 32)
        self.layers = nn.ModuleList([_HandMadeAttention(), _HandMadeAttention()])

    def forward(self, input_ids, attention_mask=None, **kwargs):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = x + layer(x)
        return x


def test_attention_outside_the_interface_is_refused_before_any_work():
    model = _HandMadeModel()
    for work in (lambda: attention_blocks(model), lambda: mask_heads(model, {("dec_self", 0): [0]}).__enter__(),
                 lambda: capture_attention(model).__enter__()):
        with pytest.raises(HeadlabError, match="layers.0 .*did not call transformers' attention interface"):
            work()
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_a_model_without_any_attention_says_so():
    model = _HandMadeModel()
    model.layers = nn.ModuleList([nn.Linear(32, 32)])
    with pytest.raises(HeadlabError, match="found no attention block: no module of it called transformers' "
                                           "attention interface"):
        attention_blocks(model)


class _GatedAttention(tf.models.llama.modeling_llama.LlamaAttention):
    """Llama's attention with an output gate before o_proj (as gated-attention models have): a slice
    of o_proj's input is then not a head's output as the attention function returned it."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        from transformers.models.llama.modeling_llama import (
            ALL_ATTENTION_FUNCTIONS,
            apply_rotary_pos_emb,
            eager_attention_forward,
        )

        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q, k, v = (p(hidden_states).view(shape).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        out, weights = attend(self, q, k, v, attention_mask, scaling=self.scaling, **kwargs)
        out = out.reshape(*hidden_states.shape[:-1], -1)
        gate = torch.sigmoid(self.q_proj(hidden_states) if self.gate_from != "heads" else out)
        if self.gate_from == "in place":  # the gated tensor keeps its name
            out.mul_(gate)
        else:
            out = out * gate
        return self.o_proj(out), weights


REFUSALS = {
    # a gate from a projection of the layer's input, in a model type whose forward headlab has not read
    # (adapters.families.OUTPUT_GATES): masking would be exact, pruning would not know the gate's rows
    "layer input": r"multiplied, elementwise, by a gate computed from q_proj \(an output gate, from the layer's "
                   r"input, not from the heads\).*headlab\.adapters\.families\.OUTPUT_GATES",
    "in place": "through operations other than reshapes",  # written into the heads' outputs: not told apart
    "heads": "through operations other than reshapes",  # sigmoid(out) * out: not a product with a gate of its own
}


@pytest.mark.parametrize("gate_from", REFUSALS)
def test_an_output_changed_before_the_output_projection_is_refused(gate_from):
    cls, config = tf.LlamaForCausalLM, tf.LlamaConfig(vocab_size=99, hidden_size=32, intermediate_size=37,
                                                      num_hidden_layers=2, num_attention_heads=4,
                                                      num_key_value_heads=2, max_position_embeddings=64)
    config.model_type = "gated-llama"  # no table entry: found at run time
    model = cls(config).eval()
    for i, layer in enumerate(model.model.layers):
        gated = _GatedAttention(config, i)
        gated.gate_from = gate_from
        gated.load_state_dict(layer.self_attn.state_dict())
        layer.self_attn = gated
    with pytest.raises(HeadlabError, match=REFUSALS[gate_from]):
        attention_blocks(model)


class _Adapted(nn.Module):
    """A low-rank adapter around a projection (as PEFT's LoRA wraps o_proj): base(x) + B(A(x))."""

    def __init__(self, base: nn.Linear):
        super().__init__()
        self.base_layer, self.lora_A, self.lora_B = base, nn.Linear(base.in_features, 2), nn.Linear(2, base.out_features)

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x))


def test_a_second_reader_of_the_heads_outputs_is_refused():
    """Masking the first projection to read the heads' outputs would leave the adapter's path
    unmasked: refused, naming the other reader."""
    config = tf.LlamaConfig(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config.model_type = "adapted-llama"  # no table entry: found at run time
    model = tf.LlamaForCausalLM(config).eval()
    for layer in model.model.layers:
        layer.self_attn.o_proj = _Adapted(layer.self_attn.o_proj)
    with pytest.raises(HeadlabError, match="besides its output projection .*base_layer, .*lora_A reads the heads"):
        attention_blocks(model)


def test_the_probe_leaves_the_model_as_it_was_and_runs_once(monkeypatch):
    """Implementation, training mode, hooks and the random generator are as before; a second call is
    served from the cache, until a module it found is replaced (an adapter around the output projection)."""
    import headlab.adapters.discovery as discovery

    model = tiny_model("granite")
    model.train()
    model.model.layers[0].eval()
    modes = [m.training for m in model.modules()]
    state = torch.random.get_rng_state()
    runs = []
    probe = discovery._discover
    monkeypatch.setattr(discovery, "_discover", lambda m: runs.append(1) or probe(m))
    attention_blocks(model)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert [m.training for m in model.modules()] == modes
    assert model.config._attn_implementation == "sdpa" and model.config._experts_implementation != "headlab_probe"
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    attention_blocks(model)
    assert len(runs) == 1
    model.model.layers[1].self_attn.o_proj = _Adapted(model.model.layers[1].self_attn.o_proj)
    with pytest.raises(HeadlabError, match="besides its output projection"):
        attention_blocks(model)
    assert len(runs) == 2


def test_a_causal_lms_unused_cross_attention_keeps_its_block():
    """PLBart's causal LM has cross-attention modules that run only with encoder states: the probe
    pass does not run them, so they are not refused as attention outside the interface; they keep
    the inert name-based blocks they had, beside the discovered self-attention."""
    config = tf.PLBartConfig(vocab_size=99, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                             decoder_attention_heads=4, encoder_ffn_dim=37, decoder_ffn_dim=37,
                             max_position_embeddings=64)
    model = tf.PLBartForCausalLM(config).eval()
    blocks = attention_blocks(model)
    assert [(b.kind, b.layer, b.family.name.split(":")[0]) for b in blocks] == [
        ("dec_self", 0, "discovered"), ("dec_cross", 0, "generic"), ("dec_self", 1, "discovered"),
        ("dec_cross", 1, "generic")]


@pytest.mark.parametrize("family", ["granite", "starcoder2", "glm", "exaone4"])
def test_lrp_conserves_relevance_where_the_projections_are_tied(family):
    """On a bias-free copy the LRP rules conserve relevance exactly (importance/rules.py): what
    reaches the first layer's input sums to the explained logit. Catches a query or key projection
    discovery tied wrongly (its relevance would leak through the attention weights)."""
    from headlab.importance.rules import check_rules

    model = tiny_model(family)
    check_rules(model)
    check_lrp_conserves(model, model.model.layers[0])
