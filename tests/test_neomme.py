"""NeoMME (``NeoMMEForMaskedLM``, model type ``neomme``; transformers 5.24): a bidirectional encoder whose attention
maps each head's output by ``exclusive_self_attention`` (``o_i - tanh(alpha_h) (o_i . v^_i) v^_i``, ``v^_i`` the unit
vector of position i's own value in the head's key/value group: ``adapters.families.HEAD_MAPS``) and then gates it
(``output_projection``: ``o_proj(attn_output * sigmoid(gate_proj(hidden_states)))``, an output gate from the layer's
input: ``adapters.families.OUTPUT_GATES``). Its first and last full-attention layers add the model's value embeddings
to their values (``adapters.families.VALUE_EMBEDDINGS``); its sliding layers attend within a half-width window.

Refused before session 39 ("exclusive_self_attention ... is a NeoMMEExclusiveSelfAttention, not a linear map"): every
test here fails on main at attention_blocks. Checked on a tiny float64 model with padded batches, sliding and global
layers, value embeddings drawn (zeros at init) and the zero-initialised output projections and alphas drawn: capture
equals output_attentions, masking equals the head's output zeroed before the exclusive map, a gate commutes with it,
pruning equals masking (uneven groups, a whole group, a layer with no head), reloads with headlab and with plain
transformers, is refused before any work where the value embeddings would no longer fit, and LRP conserves."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf

from headlab import attention_blocks, gates_attached, load_pruned, mask_heads, prune_heads, save_pruned
from headlab.errors import HeadlabError, PruningNotExact, RunFailed
from headlab.gates import ConstantGates
from support.family_matrix import check_capture_equals_output_attentions, check_gates_at_one_change_nothing, logits

# sliding (window 2), global with value embeddings, sliding (the long window), global without, global with
_LAYERS = ["sliding_attention", "full_attention", "sliding_attention", "full_attention", "full_attention"]
_WINDOW = 2


def _config() -> tf.PretrainedConfig:
    if not hasattr(tf, "NeoMMEForMaskedLM"):
        pytest.skip("this transformers has no neomme")
    return tf.NeoMMEConfig(
        vocab_size=99, embedding_rank=16, hidden_size=32, intermediate_size=40, num_hidden_layers=5,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64, layer_types=_LAYERS,
        sliding_window=_WINDOW, patch_size=2, pad_token_id=2,
        rope_parameters={"full_attention": {"rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                         "sliding_attention": {"rope_theta": 1000.0, "partial_rotary_factor": 1.0}})


def _model(attn_implementation: str = "sdpa", seed: int = 0) -> torch.nn.Module:
    config = _config()
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = tf.NeoMMEForMaskedLM(config).eval()
    with torch.no_grad():  # what NeoMME initialises to zero (o_proj, down_proj, value embeddings, alpha), drawn
        for name, parameter in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "value_embeddings.weight")):
                parameter.normal_(0, 0.3)
            elif name.endswith("exclusive_self_attention.alpha"):
                parameter.normal_(0, 1.0)
            elif name.endswith("gate_proj.weight"):
                parameter.mul_(8)  # the gates spread over (0, 1)
            elif name.endswith("lambdas"):
                parameter.add_(torch.randn_like(parameter) * 0.3)
    return model.double()


def _inputs() -> dict:
    """Three rows of 7 ids: one full, one padded on the right, one on the left (by 2)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(7, 99, (3, 7), generator=g)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, -2:] = 0
    mask[2, :2] = 0  # (3 would leave a padded query of the window-2 layer no key: NaN in eager float64)
    return {"input_ids": ids, "attention_mask": mask}


def _kept(inputs: dict, out: torch.Tensor) -> torch.Tensor:
    return out[inputs["attention_mask"].bool()]


def _attention(model, layer: int):
    return model.model.layers[layer].self_attn


def _scaled_before_the_map(model, layer: int, heads: list[int], factor: float):
    """A hook that multiplies ``heads``' outputs by ``factor`` where the attention function returns them, before the
    exclusive map (the by-hand reference)."""
    def scale(module, args):
        out = args[0].clone()
        out[:, :, heads] = out[:, :, heads] * factor
        return (out, *args[1:])
    return _attention(model, layer).exclusive_self_attention.register_forward_pre_hook(scale)


def test_blocks_are_found_with_the_map_and_the_gate():
    model = _model()
    blocks = attention_blocks(model)
    assert [(b.kind, b.layer, b.n_heads, b.n_kv_heads, b.d_head) for b in blocks] == \
        [("enc_self", layer, 4, 2, 8) for layer in range(5)]
    family = blocks[0].family
    assert family.o == "output_projection.o_proj"
    assert dict(family.head_rows) == {"output_projection.gate_proj": ("head_dim",)}
    assert "exclusive_self_attention.alpha" in family.head_vectors
    assert family.group_holders == ("exclusive_self_attention",)
    assert model.model.value_embedding_layers == {1, 4}


class _Transposed(torch.nn.Module):
    """The exclusive map handed the heads' outputs transposed, ``[batch, seq, head_dim, heads]``."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, attn_output, value_states):
        return self.inner(attn_output.transpose(-1, -2), value_states).transpose(-1, -2)


def test_the_map_on_features_that_are_not_one_heads_is_not_let_through():
    """The same map given the heads' outputs transposed (each of its "heads" a feature of every head: a head's zeros no
    longer its own slice) is refused, naming it, as before session 39."""
    config = tf.NeoMMEConfig(  # heads of 4 features, 4 heads: the transposed map runs
        vocab_size=99, embedding_rank=16, hidden_size=16, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=4, max_position_embeddings=64, sliding_window=2,
        patch_size=2, pad_token_id=2, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_theta": 10000.0, "partial_rotary_factor": 1.0},
                         "sliding_attention": {"rope_theta": 1000.0, "partial_rotary_factor": 1.0}})
    model = tf.NeoMMEForMaskedLM(config).eval()
    for layer in model.model.layers:
        layer.self_attn.exclusive_self_attention = _Transposed(layer.self_attn.exclusive_self_attention)
    with torch.no_grad():
        logits(model, _inputs())  # it runs
    with pytest.raises(HeadlabError, match=r"exclusive_self_attention.inner through operations other than reshapes "
                                           r"and casts \(transpose\)"):
        attention_blocks(model)


def test_capture_equals_output_attentions_with_padding_and_windows():
    inputs = _inputs()
    _, record = check_capture_equals_output_attentions(_model, "enc_self", inputs, n_layers=5)
    distance = (torch.arange(7)[:, None] - torch.arange(7)[None, :]).abs()
    first = record[("enc_self", 0)][0]  # the unpadded row of the short sliding layer: a band of half-width 2
    assert torch.all(first[:, distance > _WINDOW] == 0) and torch.all(first[:, distance <= _WINDOW] > 0)
    assert torch.all(record[("enc_self", 1)][0] > 0)  # global
    assert torch.all(record[("enc_self", 1)][1][:, :, -2:] == 0)  # the padded keys of row 1


@pytest.mark.parametrize("layer", [0, 1, 3])  # sliding, global with value embeddings, global without
def test_masking_equals_the_heads_output_zeroed_before_the_map(layer):
    inputs = _inputs()
    model = _model()
    before = logits(model, inputs)
    for heads in ([1], [2, 3], [0, 3]):
        with mask_heads(model, {("enc_self", layer): heads}):
            masked = logits(model, inputs)
        assert torch.equal(logits(model, inputs), before)  # the mask came off
        handle = _scaled_before_the_map(model, layer, heads, 0.0)
        try:
            reference = logits(model, inputs)
        finally:
            handle.remove()
        assert not torch.allclose(reference, before)
        torch.testing.assert_close(masked, reference, atol=1e-12, rtol=0)


def test_a_gate_commutes_with_the_map_and_gates_at_one_change_nothing():
    """A gate g on a head (at the output projection's input) equals g times the head's output before the exclusive map
    (the map is linear in the head's output for fixed values), and gates at one change nothing."""
    inputs = _inputs()
    model = _model()
    check_gates_at_one_change_nothing(model, inputs)
    handles = [_scaled_before_the_map(model, 1, [1], 0.25), _scaled_before_the_map(model, 1, [3], 0.5)]
    try:
        reference = logits(model, inputs)
    finally:
        for handle in handles:
            handle.remove()
    values = {("enc_self", layer): torch.ones(4) for layer in range(5)}
    values[("enc_self", 1)] = torch.tensor([1.0, 0.25, 1.0, 0.5])
    with gates_attached(model, ConstantGates(values)):
        gated = logits(model, inputs)
    torch.testing.assert_close(gated, reference, atol=1e-12, rtol=0)


# layer 0 (sliding): uneven groups, each kept query head its own key/value copy; layer 1 (value embeddings): uneven, its
# embedding's columns repeated with its values; layer 2 (sliding, long window): no head left; layer 3 (global, no value
# embeddings): uneven; layer 4 (value embeddings): a whole group, one key/value head left
_SPEC = {("enc_self", 0): [3], ("enc_self", 1): [3], ("enc_self", 2): [0, 1, 2, 3], ("enc_self", 3): [0],
         ("enc_self", 4): [0, 1]}
_LEFT = [3, 3, 0, 3, 2]
_GROUPS = {0: 1, 1: 1, 3: 1, 4: 2}  # the exclusive maps' num_key_value_groups after pruning


def _pruned(model, inputs, spec=None) -> torch.Tensor:
    with mask_heads(model, spec or _SPEC):
        masked = logits(model, inputs)
    prune_heads(model, spec or _SPEC)  # checks itself against masking
    return masked


def test_pruning_equals_masking_and_keeps_the_maps_groups():
    inputs = _inputs()
    model = _model()
    masked = _pruned(model, inputs)
    assert [b.n_heads for b in attention_blocks(model)] == _LEFT
    for layer, groups in _GROUPS.items():
        attention = _attention(model, layer)
        exclusive = attention.exclusive_self_attention
        assert exclusive.num_key_value_groups == attention.num_key_value_groups == groups, layer
        assert exclusive.alpha.shape == (_LEFT[layer],)
        assert attention.output_projection.gate_proj.weight.shape == (_LEFT[layer] * 8, 32)
        assert attention.output_projection.o_proj.weight.shape == (32, _LEFT[layer] * 8)
    assert _attention(model, 1).v_proj.weight.shape[0] == 3 * 8 and _attention(model, 4).v_proj.weight.shape[0] == 8
    assert model.model.value_embeddings.weight.shape == (99, 2 * 8)  # the model's, whole
    # the kept heads' alphas, in order (layer 3 kept heads 1, 2, 3)
    fresh = _model()
    torch.testing.assert_close(_attention(model, 3).exclusive_self_attention.alpha,
                               _attention(fresh, 3).exclusive_self_attention.alpha[1:], atol=0, rtol=0)
    torch.testing.assert_close(_kept(inputs, logits(model, inputs)), _kept(inputs, masked), atol=1e-12, rtol=0)


def test_pruned_reloads_with_headlab_and_plain_transformers(tmp_path):
    inputs = _inputs()
    model = _model()
    masked = _pruned(model, inputs)
    pruned = logits(model, inputs)
    save_pruned(model, tmp_path)
    assert json.loads((tmp_path / "headlab_pruning.json").read_text())["portable"]["how"] == "remote code"
    reloaded = load_pruned(tmp_path).double().eval()
    assert [b.n_heads for b in attention_blocks(reloaded)] == _LEFT
    torch.testing.assert_close(logits(reloaded, inputs), pruned, atol=1e-12, rtol=0)
    plain, info = tf.AutoModelForMaskedLM.from_pretrained(tmp_path, trust_remote_code=True, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    plain = plain.double().eval()
    assert {layer: _attention(plain, layer).exclusive_self_attention.num_key_value_groups for layer in _GROUPS} == \
        _GROUPS
    torch.testing.assert_close(_kept(inputs, logits(plain, inputs)), _kept(inputs, masked), atol=1e-12, rtol=0)


def test_a_value_embedding_layer_pruned_twice_reads_its_kept_heads_columns(tmp_path):
    """Layer 1 pruned to heads 0, 1, 2 (key/value heads 0, 0, 1), then to its heads 1 and 2 (original 1 and 2: key/value
    heads 0 and 1, each once); layer 4 to head 3 alone (key/value head 1): each step equals masking the heads gone, and
    the plain transformers reload computes the same."""
    inputs = _inputs()
    model = _model()
    with mask_heads(model, {("enc_self", 1): [0, 3], ("enc_self", 4): [0, 1, 2]}):
        masked = logits(model, inputs)
    _pruned(model, inputs, {("enc_self", 1): [3], ("enc_self", 4): [0]})
    _pruned(model, inputs, {("enc_self", 1): [0], ("enc_self", 4): [0, 1]})
    assert [b.n_heads for b in attention_blocks(model)] == [4, 2, 4, 4, 1]
    torch.testing.assert_close(_kept(inputs, logits(model, inputs)), _kept(inputs, masked), atol=1e-12, rtol=0)
    save_pruned(model, tmp_path)
    plain = tf.AutoModelForMaskedLM.from_pretrained(tmp_path, trust_remote_code=True).double().eval()
    torch.testing.assert_close(_kept(inputs, logits(plain, inputs)), _kept(inputs, masked), atol=1e-12, rtol=0)


def test_without_the_narrowed_value_embeddings_the_prune_is_not_exact(monkeypatch):
    """The value embeddings do matter to a pruned layer: without its kept heads' columns (the hook a no-op) the pruned
    layer 1 cannot even add them to its three value heads, and pruning is undone, refused."""
    from headlab import portable_code

    monkeypatch.setattr(portable_code.ValueEmbedsHook, "__call__", lambda self, module, args, kwargs: None)
    model = _model()
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(PruningNotExact, match=r"fails in enc_self layer 1"):
        prune_heads(model, {("enc_self", 1): [3]})
    assert [b.n_heads for b in attention_blocks(model)] == [4] * 5
    assert all(torch.equal(tensor, state[name]) for name, tensor in model.state_dict().items())


def test_lrp_conserves_through_the_exclusive_map_the_gate_and_the_value_embeddings(monkeypatch):
    """Conserved to 1e-10 with the value embeddings counted as input relevance (rules.per_layer_embeddings); without
    them counted, what reaches them is missing (they do take relevance)."""
    from headlab.importance import rules
    from support.lrp_families import assert_conserved

    assert_conserved(_model(), 1e-10)
    monkeypatch.setattr(rules, "VALUE_EMBEDDINGS", {})
    with pytest.raises(RunFailed, match="did not conserve"):
        assert_conserved(_model(), 1e-6)


def test_lrp_holds_the_unit_values_of_the_exclusive_map_constant():
    """Under lrp_rules the map's backward is that of ``o -> o - tanh(alpha) (o . v^) v^`` with ``v^`` constant: no
    gradient reaches the values through it, and the heads' outputs get ``M^T g`` (M symmetric); forward unchanged."""
    from headlab.importance.rules import lrp_rules

    model = _model()
    exclusive = _attention(model, 1).exclusive_self_attention
    g = torch.Generator().manual_seed(4)
    heads = torch.randn(2, 5, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    values = torch.randn(2, 2, 5, 8, generator=g, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(2, 5, 4, 8, generator=g, dtype=torch.float64)
    plain = exclusive(heads, values)
    assert torch.autograd.grad((plain * upstream).sum(), values)[0].abs().max() > 0  # the map does read the values
    with lrp_rules(model):
        out = exclusive(heads, values)
        d_heads, d_values = torch.autograd.grad((out * upstream).sum(), [heads, values], allow_unused=True)
    assert torch.equal(out, plain)
    assert d_values is None or torch.all(d_values == 0)
    # v^ normalised in float32, as the forward does
    unit = torch.nn.functional.normalize(values.detach().float(), dim=-1).double().repeat_interleave(2, dim=1)
    unit = unit.transpose(1, 2)
    scale = torch.tanh(exclusive.alpha.detach()).view(1, 1, -1, 1)
    torch.testing.assert_close(d_heads, upstream - scale * (upstream * unit).sum(-1, keepdim=True) * unit,
                               atol=1e-14, rtol=0)


def test_lrp_refuses_an_exclusive_map_that_computes_something_else(monkeypatch):
    """A forward other than the one the rule reads (here: v^ not normalised) is refused, naming the map."""
    from transformers.models.neomme import modeling_neomme as modeling

    from headlab.importance import compute_lrp
    from support.lrp_families import lrp_data

    def forward(self, attn_output, value_states):
        values = modeling.repeat_kv(value_states, self.num_key_value_groups).transpose(1, 2)
        scale = torch.tanh(self.alpha).to(attn_output.dtype).view(1, 1, -1, 1)
        return attn_output - scale * (attn_output * values).sum(-1, keepdim=True) * values

    monkeypatch.setattr(modeling.NeoMMEExclusiveSelfAttention, "forward", forward)
    model = _model()
    data, info = lrp_data(model)
    with pytest.raises(HeadlabError, match=r"NeoMMEExclusiveSelfAttention computed something other than"):
        compute_lrp(model, data, info, bootstrap=0)


def test_analyze_end_to_end(tmp_path, capsys):
    """headlab analyze on a saved tiny NeoMME: every stage runs (LRP's conservation check included)."""
    from support.family_matrix import ANALYZE_STAGES, analyze, save_tiny, treebank_files

    save_tiny(_model().float(), tmp_path / "neomme", treebank_files(tmp_path), "bert")
    code, stages = analyze(tmp_path / "neomme", tmp_path)
    assert code == 0, capsys.readouterr().err
    for name in (*ANALYZE_STAGES, "lrp"):
        assert stages[name]["status"] == "done", stages[name]
