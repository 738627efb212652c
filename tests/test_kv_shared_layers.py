"""Gemma 4's (and Gemma 3n's) key/value-shared layers (``num_kv_shared_layers`` > 0; session 29, gemmakv29).

The last layers attend with the keys and values an earlier layer of their attention type stored
(transformers' ``Gemma4TextAttention``: ``is_kv_shared_layer``, ``shared_kv_states``): they have a query and an
output projection of their own and no key or value projection. Discovery ties their query projection alone and
names the key projection their keys come from (``family.kv_from``). Masking their heads is exact as for any layer;
LRP detaches their queries here and the shared keys in the layer that computes them, so relevance flows back
through the shared values into that layer's value projection and is conserved; physical pruning of a sharing
layer slices its query and output projections and sets its groups where every shared key/value head keeps the same
number of query heads (kvprune29; else refused before any work), and pruning of the layer it reads keeps every
key/value head (or is refused before any work).
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from headlab import HeadlabError, attention_blocks, mask_heads, prune_heads
from headlab.importance.rules import check_rules
from support.family_matrix import check_lrp_conserves, perturbed_model
from support.lrp_families import assert_conserved

_IDS = torch.tensor([[3, 5, 7, 9, 11, 13, 17], [4, 6, 8, 10, 12, 14, 16]])


def _model(shared: int = 1) -> torch.nn.Module:
    """4 layers, sliding and full in turn; the last ``shared`` reuse the keys/values of the last earlier layer of their
    type (shared=1: layer 3 reads layer 1's; shared=2: layers 2 and 3 read layers 0's and 1's)."""
    config = tf.Gemma4TextConfig(
        vocab_size=99, bos_token_id=0, eos_token_id=1, pad_token_id=2, hidden_size=32, intermediate_size=37,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=4, global_head_dim=8,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=99, num_kv_shared_layers=shared)
    return perturbed_model(tf.Gemma4ForCausalLM, config, attn_implementation="eager").double()


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=_IDS).logits


def _state(model) -> dict:
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


@pytest.mark.parametrize("shared", [1, 2])
def test_a_sharing_layer_has_its_query_projection_and_names_the_keys_it_reads(shared):
    """Before, discovery tied no projection of a sharing layer (its keys and values came from another layer's), so
    LRP refused the model ("its query and key projections are unknown")."""
    model = _model(shared)
    blocks = attention_blocks(model)
    for layer, block in enumerate(blocks):
        if layer < 4 - shared:
            assert block.k is not None and block.family.kv_from == ""
        else:
            source = layer - 2  # the last earlier layer of the same type
            assert block.q is model.model.layers[layer].self_attn.q_proj and block.k is None and block.v is None
            assert block.family.kv_from == f"model.layers.{source}.self_attn.k_proj"
            assert (block.n_heads, block.n_kv_heads) == (4, 2)


def test_masking_a_sharing_layers_heads_equals_zeroing_their_output_columns():
    model = _model(1)
    with mask_heads(model, {("dec_self", 3): [2, 3]}):
        masked = _logits(model)
    with torch.no_grad():
        model.model.layers[3].self_attn.o_proj.weight[:, 16:] = 0  # heads 2 and 3: o_proj's input columns 16..31
    torch.testing.assert_close(masked, _logits(model), rtol=0, atol=1e-12)


@pytest.mark.parametrize("shared", [1, 2])
def test_lrp_conserves_relevance_through_the_shared_keys_and_values(shared):
    """The sharing layer's relevance reaches the source layer's value projection through autograd; the sum at the
    first layer's input (with the per-layer embeddings') is the logit."""
    model = _model(shared)
    check_rules(model)
    check_lrp_conserves(model, model.model.layers[0], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compute_lrp_conserves_relevance_on_every_sentence(dtype):
    """compute_lrp end to end (float32 widened to float64 for the gated MLPs' product rule): every sentence's
    relevance, biases and per-layer token embeddings counted, sums to its logit."""
    model = _model(2).to(dtype)
    assert_conserved(model, 1e-10)


def test_pruning_a_source_layer_that_keeps_its_key_value_heads_equals_masking():
    """Heads 1 and 3 go: one query head per key/value head stays, so the keys and values layer 3 reads are layer 1's as
    before (group 1 here, 2 in layer 3)."""
    model = _model(1)
    with mask_heads(model, {("dec_self", 1): [1, 3]}):
        masked = _logits(model)
    prune_heads(model, {("dec_self", 1): [1, 3]})
    assert [(b.n_heads, b.n_kv_heads) for b in attention_blocks(model)] == [(4, 2), (2, 2), (4, 2), (4, 2)]
    torch.testing.assert_close(_logits(model), masked, rtol=0, atol=1e-10)


@pytest.mark.parametrize("removed", [[3], [2, 3]])
def test_pruning_a_source_layer_that_changes_its_key_value_heads_is_refused_before_any_work(removed):
    """[3]: key/value head 1 would be copied per query head ([0, 0, 1]); [2, 3]: it would go. Layer 3 attends with
    all of them. Before, the pruned model was built, failed its check with a shape error and was put back."""
    model = _model(1)
    state = _state(model)
    with pytest.raises(HeadlabError, match=r"dec_self:1 \(model.layers.1.self_attn\): pruning heads .* but layer\(s\) "
                                           r"dec_self:3 attend with them too"):
        prune_heads(model, {("dec_self", 1): removed})
    assert all(torch.equal(state[name], tensor) for name, tensor in model.state_dict().items())


# query head h of a sharing layer reads shared key/value head h // groups (4 heads over 2: groups 2)
_EVEN = {1: {("dec_self", 3): [1, 2]}, 2: {("dec_self", 2): [0, 3], ("dec_self", 3): [1, 2], ("dec_self", 1): [1, 3]}}


def _greedy(model) -> torch.Tensor:
    """A few steps of cached greedy generation (the cache's sliding and full layers, the shared keys at every step)."""
    with torch.no_grad():
        return model.generate(input_ids=_IDS[:1], max_new_tokens=5, do_sample=False, use_cache=True,
                              output_logits=True, return_dict_in_generate=True)


@pytest.mark.parametrize("shared", [1, 2])
def test_pruning_a_sharing_layer_that_keeps_its_groups_even_equals_masking(shared):
    """Kept heads [0, 3] of 4 over 2 shared key/value heads: groups 2 -> 1, head 0 reads key/value head 0 and head 1
    key/value head 1, as heads 0 and 3 did. Before, every pruning of a sharing layer was refused (and with it
    check_supported(prune=True), so `headlab prune`, refused any model with sharing layers)."""
    model = _model(shared)
    spec = _EVEN[shared]
    with mask_heads(model, spec):
        masked, generated = _logits(model), _greedy(model)
    kept = prune_heads(model, spec)
    assert kept[("dec_self", 3)] == [0, 3]
    blocks = attention_blocks(model)
    assert (blocks[3].n_heads, blocks[3].n_kv_heads) == (2, 2) and blocks[3].family.kv_from
    attn = model.model.layers[3].self_attn
    assert (attn.num_key_value_groups, attn.q_proj.out_features, attn.o_proj.in_features) == (1, 16, 16)
    torch.testing.assert_close(_logits(model), masked, rtol=0, atol=1e-10)
    pruned = _greedy(model)
    assert torch.equal(pruned.sequences, generated.sequences)
    torch.testing.assert_close(torch.stack(pruned.logits), torch.stack(generated.logits), rtol=0, atol=1e-10)


def test_lrp_conserves_on_pruned_sharing_layers():
    model = _model(2)
    prune_heads(model, _EVEN[2])
    check_rules(model)
    check_lrp_conserves(model, model.model.layers[0], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("removed", [[0], [0, 1], [1, 2, 3], [0, 1, 2, 3]])
def test_pruning_a_sharing_layer_unevenly_is_refused_before_any_work(removed):
    """[0]: key/value head 0 would keep one query head and head 1 two; [0, 1] and [1, 2, 3]: one key/value head none;
    all four: none. No key or value projection here to copy rows of, so no slicing is exact: refused naming the rule
    and the layer it reads, the model untouched."""
    model = _model(1)
    state = _state(model)
    with pytest.raises(HeadlabError, match=r"dec_self:3 \(model.layers.3.self_attn\): pruning heads .* query heads over "
                                           r"its 2 key/value heads, .*keys and values of model.layers.1.self_attn.k_proj "
                                           r".*must keep the same number of query heads, at least one; nothing was"):
        prune_heads(model, {("dec_self", 3): removed})
    assert all(torch.equal(state[name], tensor) for name, tensor in model.state_dict().items())
    assert [(b.n_heads, b.n_kv_heads) for b in attention_blocks(model)] == [(4, 2)] * 4


def test_sharing_layers_pruned_save_and_load_back(tmp_path):
    """save_pruned writes the sharing layers' narrower query and output projections and their groups; load_pruned
    rebuilds and checks them, and plain transformers loads the directory through its portable code."""
    from headlab import load_pruned, save_pruned

    model = _model(2)
    prune_heads(model, _EVEN[2])
    save_pruned(model, tmp_path)
    loaded = load_pruned(tmp_path).double()  # loaded in float32 (the loader's default): compared at its rounding
    assert [(b.n_heads, b.n_kv_heads, b.family.kv_from) for b in attention_blocks(loaded)] == [
        (4, 2, ""), (2, 2, ""), (2, 2, "model.layers.0.self_attn.k_proj"), (2, 2, "model.layers.1.self_attn.k_proj")]
    torch.testing.assert_close(_logits(loaded), _logits(model), rtol=0, atol=1e-6)
    plain = tf.AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True).double()
    torch.testing.assert_close(_logits(plain), _logits(model), rtol=0, atol=1e-6)


def test_headlab_prune_takes_a_model_with_sharing_layers(tmp_path, capsys):
    """check_supported(prune=True), which `headlab prune` and `headlab analyze --prune` call first, refused every model
    with sharing layers up front; now only a plan that breaks the rule is refused, before the weights are read."""
    from headlab.cli import main
    from headlab.loading import check_supported

    _model(1).float().save_pretrained(tmp_path / "gemma4")
    check_supported(str(tmp_path / "gemma4"), prune=True)  # raised before
    assert main(["prune", str(tmp_path / "gemma4"), "--heads", "dec_self:3:1,2", "--out", str(tmp_path / "out")]) == 0
    capsys.readouterr()
    assert [(b.n_heads, b.n_kv_heads) for b in attention_blocks(tf.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", trust_remote_code=True))] == [(4, 2), (4, 2), (4, 2), (2, 2)]
    assert main(["prune", str(tmp_path / "gemma4"), "--heads", "dec_self:3:0", "--out", str(tmp_path / "uneven")]) == 2
    assert "must keep the same number of query heads" in capsys.readouterr().err
    assert not (tmp_path / "uneven" / "model.safetensors").exists()


@pytest.mark.parametrize("shared", [1, 2])
def test_gated_pruning_of_sharing_layers_and_their_sources_is_refused_before_any_work(shared):
    """headlab prune train's gates pick heads freely, which these layers cannot take (the export would be refused after
    training): refused up front by check_prunable, naming the layers and the rule, not by its sample's own pick."""
    from headlab.surgery import check_prunable

    model = _model(shared)
    names = "dec_self:1, dec_self:3" if shared == 1 else "dec_self:0, dec_self:1, dec_self:2, dec_self:3"
    with pytest.raises(HeadlabError, match=rf"^{names}: attend with keys and values another layer computes, .*the "
                                           r"gates of headlab prune train pick heads freely"):
        check_prunable(model, ("dec_self",))


def test_a_layer_whose_keys_nobody_reads_prunes_as_before():
    model = _model(1)  # layer 0 stores nothing a later layer reads (layer 2, the last sliding one, does)
    with mask_heads(model, {("dec_self", 0): [3]}):
        masked = _logits(model)
    prune_heads(model, {("dec_self", 0): [3]})
    torch.testing.assert_close(_logits(model), masked, rtol=0, atol=1e-10)


@pytest.mark.parametrize("shared", [1, 2])
def test_ablation_of_every_head_equals_one_masked_pass(shared):
    """Ablation replays the layers below a masked head from their recorded outputs; a replayed layer stores no keys or
    values, so the replay stops below the first layer that stores them for a later one. Before, the sharing layers
    failed (KeyError: 'sliding_attention', transformers' shared_kv_states left empty)."""
    from headlab.importance import ImportanceData, compute_ablation, describe_model

    model = _model(shared)
    info = describe_model(model)
    data = ImportanceData.from_ids([row.tolist() for row in _IDS])

    def nll() -> float:
        with torch.no_grad():
            logits = model(input_ids=_IDS).logits[:, :-1]
        return float(torch.nn.functional.cross_entropy(logits.reshape(-1, 99), _IDS[:, 1:].reshape(-1), reduction="sum"))

    scores = compute_ablation(model, data, info, batch_size=2, max_rows=4)
    base, count = nll(), _IDS[:, 1:].numel()
    assert scores.signature["base_loss"] == pytest.approx(base / count, rel=1e-6)
    for block in attention_blocks(model):
        for head in range(block.n_heads):
            with mask_heads(model, {block.key: [head]}):
                masked = nll()
            assert scores["dec_self"][block.layer, head] == pytest.approx((masked - base) / count, abs=2e-6)


def _gemma3n() -> torch.nn.Module:
    """Gemma 3n shares keys and values as Gemma 4 does (layers 2 and 3 read 0's and 1's); its sharing layers keep
    k_proj and v_proj, unused. Its LRP conserves (tests/test_lrp_altup.py; refused for AltUp until session 30)."""
    config = tf.Gemma3nTextConfig(
        vocab_size=99, bos_token_id=0, eos_token_id=1, pad_token_id=2, hidden_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64, intermediate_size=[37] * 4,
        layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=4, num_kv_shared_layers=2,
        laurel_rank=4, altup_num_inputs=2, hidden_size_per_layer_input=8, vocab_size_per_layer_input=99,
        activation_sparsity_pattern=[0.0] * 4)
    return perturbed_model(tf.Gemma3nForCausalLM, config, attn_implementation="eager").double()


def test_gemma3n_sharing_layers_are_found_and_their_source_pruned_exactly_or_refused():
    model = _gemma3n()
    blocks = attention_blocks(model)
    assert [b.family.kv_from for b in blocks] == ["", "", "model.layers.0.self_attn.k_proj",
                                                 "model.layers.1.self_attn.k_proj"]
    assert blocks[3].k is None and blocks[3].q is model.model.layers[3].self_attn.q_proj
    with mask_heads(model, {("dec_self", 1): [1, 3]}):
        masked = _logits(model)
    prune_heads(model, {("dec_self", 1): [1, 3]})
    torch.testing.assert_close(_logits(model), masked, rtol=0, atol=1e-10)
    state = _state(model)
    with pytest.raises(HeadlabError, match=r"dec_self:0 .* but layer\(s\) dec_self:2 attend with them too"):
        prune_heads(model, {("dec_self", 0): [2, 3]})
    with pytest.raises(HeadlabError, match=r"model.layers.2.self_attn\): pruning heads \[0\] .*attends with the keys "
                                           r"and values of model.layers.0.self_attn.k_proj"):
        prune_heads(model, {("dec_self", 2): [0]})
    assert all(torch.equal(state[name], tensor) for name, tensor in model.state_dict().items())
    with mask_heads(model, {("dec_self", 2): [1, 2]}):
        masked = _logits(model)
    prune_heads(model, {("dec_self", 2): [1, 2]})  # its unused k_proj and v_proj stay whole, as its key/value heads
    torch.testing.assert_close(_logits(model), masked, rtol=0, atol=1e-10)


def test_source_layers_pruned_save_and_load_back_with_their_readers(tmp_path):
    from headlab import load_pruned, save_pruned

    model = _model(2)
    prune_heads(model, {("dec_self", 0): [0, 2], ("dec_self", 1): [1, 3]})
    save_pruned(model, tmp_path)
    loaded = load_pruned(tmp_path).double()  # loaded in float32 (the loader's default): compared at its rounding
    assert [(b.n_heads, b.n_kv_heads, b.family.kv_from) for b in attention_blocks(loaded)] == [
        (2, 2, ""), (2, 2, ""), (4, 2, "model.layers.0.self_attn.k_proj"), (4, 2, "model.layers.1.self_attn.k_proj")]
    torch.testing.assert_close(_logits(loaded), _logits(model), rtol=0, atol=1e-6)


def test_capture_and_streamed_chunks_of_the_sharing_layers_equal_output_attentions():
    """The sharing layers' maps, from the keys they were given (the other layer's): as transformers' own."""
    from support.family_matrix import check_capture_equals_output_attentions, check_streamed_chunks_equal_capture

    def build(attn_implementation="sdpa"):
        model = _model(2).float()  # the streamed chunks are compared in float32
        model.config._attn_implementation = attn_implementation
        return model

    inputs = {"input_ids": _IDS, "attention_mask": torch.tensor([[1] * 7, [1] * 5 + [0] * 2])}
    model, record = check_capture_equals_output_attentions(build, "dec_self", inputs, n_layers=4)
    check_streamed_chunks_equal_capture(model, inputs, record)
