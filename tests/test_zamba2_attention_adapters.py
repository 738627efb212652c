"""Zamba 2 with shared attention adapters (``use_shared_attention_adapter``, transformers 5.24's ``Zamba2Attention``:
``q = q_proj(x) + linear_q_adapter_list[i](x)``, the same for k and v, one adapter per hybrid layer, the shared
transformer's weights tied across hybrid layers). Before session 36 analysis worked, but physical pruning was refused
("this family's projection layout is unknown") and so was LRP ("its query and key projections are unknown"):
discovery ties no single projection to a sum. headlab.adapters.families.QKV_ADAPTERS reads the layout off the module
and the probe's traces: q/k/v tied, every adapter's second Linear sliced with the heads (``head_rows``), the value
adapters passing relevance as v_proj does (``head_row_values``), the query and key adapters held constant.

Tiny models from configs, every adapter weight and norm weight drawn at random (the adapters' own initialisation is
small, where a rule that left one out would hardly show): physical pruning equals masking (float64, a padded batch),
the directory reloads (load_pruned, plain transformers through pruned_heads.py); LRP conserves (float32 and float64
runs, measured at the embeddings, the first layer's input), leaves the forward bit for bit unchanged, and gives the
value path the relevance of an independent float64 reference; an adapter laid out otherwise, or another attention
class, is refused before any work, naming it.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf

from headlab import HeadlabError, attention_blocks, load_pruned, mask_heads, prune_heads, save_pruned
from headlab.adapters import sharing_groups
from headlab.importance import ImportanceData, compute_lrp, describe_model, lrp_rules
from support.family_matrix import logits, tiny_inputs
from support.lrp_families import check_lrp_refused_before_any_work

LAYOUTS = {
    # two hybrid layers over one shared block (tied): adapters 0 and 1 in each of the two (tied) modules
    "tied": dict(layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], num_mem_blocks=1),
    # the attention first, two blocks of their own: each serves one hybrid layer, nn.Identity at the other place
    "untied": dict(layers_block_type=["hybrid", "mamba", "hybrid"], num_mem_blocks=2),
}


def _adapted(layout: str = "tied", dtype: torch.dtype = torch.float64, seed: int = 0) -> torch.nn.Module:
    config = tf.Zamba2Config(
        vocab_size=99, hidden_size=32, intermediate_size=40, num_attention_heads=4, num_key_value_heads=4,
        head_dim=16, max_position_embeddings=64, num_hidden_layers=len(LAYOUTS[layout]["layers_block_type"]),
        n_mamba_heads=4, mamba_headdim=8, mamba_d_state=8, mamba_ngroups=2, mamba_expand=1, chunk_size=4,
        use_shared_attention_adapter=True, adapter_rank=4, bos_token_id=0, eos_token_id=1, pad_token_id=2,
        **LAYOUTS[layout])
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = tf.Zamba2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "adapter_list" in name:
                parameter.normal_(0, parameter.shape[1] ** -0.5)
            elif "norm" in name and name.endswith("weight"):
                parameter.uniform_(0.5, 1.5)
    return model.to(dtype)


def _attention(model: torch.nn.Module, layer: int) -> torch.nn.Module:
    return model.model.layers[layer].shared_transformer.self_attn


def _close(a: torch.Tensor, b: torch.Tensor, inputs: dict, atol: float = 1e-10) -> None:
    keep = inputs["attention_mask"].bool()  # padded positions: whatever the model computes there
    torch.testing.assert_close(a[keep], b[keep], atol=atol, rtol=0)


def test_the_projections_and_every_adapter_are_tied():
    """q/k/v are the projections; the head rows every adapter's second Linear (the first, to the rank, is shared by
    all heads); the value adapters are values. Before: q, k and v None (discovery ties no sum)."""
    for layout, places in (("tied", (0, 1)), ("untied", (0,))):
        model = _adapted(layout)
        blocks = attention_blocks(model)
        assert len(blocks) == 2
        for block in blocks:
            assert (block.q, block.k, block.v) == (block.core.q_proj, block.core.k_proj, block.core.v_proj)
            assert (block.n_heads, block.n_kv_heads, block.d_head) == (4, 4, 16)
            own = places if layout == "tied" else (0,) if block.layer == 0 else (1,)
            assert block.family.head_rows == tuple((f"linear_{w}_adapter_list.{i}.1", ("head_dim",))
                                                   for w in "qkv" for i in own)
            assert block.family.head_row_values == tuple(f"linear_v_adapter_list.{i}.1" for i in own)
    assert [[b.layer for b in g] for g in sharing_groups(attention_blocks(_adapted("tied")))] == [[1, 3]]


@pytest.mark.parametrize("layout,removed", [
    ("tied", {1: [0, 3], 3: [0, 3]}), ("tied", {1: [0, 1, 2, 3], 3: [0, 1, 2, 3]}),
    ("untied", {0: [1], 2: [0, 2, 3]}), ("untied", {0: [0, 1, 2, 3], 2: [2]})],
    ids=["tied-two-heads", "tied-every-head", "untied", "untied-every-head-at-one"])
def test_pruned_equals_masked_and_reloads(layout, removed, tmp_path):
    """Each removed head's rows cut from q_proj, k_proj, v_proj and the second Linear of every adapter (tied modules
    tied again): the model computes what masking those heads computes, and the directory reloads with load_pruned
    and with plain transformers (pruned_heads.py) to the same logits. Before: refused, the layout unknown."""
    model = _adapted(layout)
    inputs = tiny_inputs()
    spec = {("dec_self", layer): heads for layer, heads in removed.items()}
    with mask_heads(model, spec):
        masked = logits(model, inputs)
    before = logits(model, inputs)
    kept = prune_heads(model, spec)
    assert kept == {("dec_self", layer): [h for h in range(4) if h not in heads] for layer, heads in removed.items()}
    pruned = logits(model, inputs)
    _close(pruned, masked, inputs)
    assert not torch.allclose(pruned, before)  # the heads did something
    counts = {b.key: b.n_heads for b in attention_blocks(model)}
    assert counts == {("dec_self", layer): 4 - len(heads) for layer, heads in removed.items()}
    for layer, heads in removed.items():
        if len(heads) < 4:
            attention = _attention(model, layer)
            width = 16 * (4 - len(heads))
            assert attention.q_proj.out_features == attention.v_proj.out_features == width
            assert all(adapter[1].weight.shape == (width, 4) for w in "qkv"
                       for adapter in getattr(attention, f"linear_{w}_adapter_list")
                       if isinstance(adapter, torch.nn.Sequential))
    if layout == "tied" and len(removed[1]) < 4:  # one set of weights again, adapters with it
        first, second = _attention(model, 1), _attention(model, 3)
        assert first.linear_v_adapter_list[1][1].weight is second.linear_v_adapter_list[1][1].weight
        assert first.q_proj.weight is second.q_proj.weight
    save_pruned(model, tmp_path / "m")
    record = json.loads((tmp_path / "m" / "headlab_pruning.json").read_text())
    assert sorted(int(layer) for layer in record["blocks"]["dec_self"]) == sorted(removed)
    loaded = load_pruned(tmp_path / "m").double()
    _close(logits(loaded, inputs), pruned, inputs, atol=1e-5)  # saved in float32
    assert {b.key: b.n_heads for b in attention_blocks(loaded)} == counts
    plain = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "m", trust_remote_code=True).eval()
    _close(logits(plain.double(), inputs), pruned, inputs, atol=1e-5)
    # re-saved by transformers (no headlab_pruning.json): the record read off the weights gives every layer its heads
    from headlab.loading import load_model

    plain.float().save_pretrained(tmp_path / "resaved")
    resaved = load_model(str(tmp_path / "resaved")).double()
    assert {b.key: list(b.core._headlab_kept_heads) for b in attention_blocks(resaved)
            if getattr(b.core, "_headlab_kept_heads", None) is not None} == kept
    _close(logits(resaved, inputs), pruned, inputs, atol=1e-5)


def test_a_plan_that_differs_between_the_tied_depths_is_refused():
    model = _adapted("tied")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(HeadlabError, match=r"dec_self layers 1,3: their attention weights are shared by 2 depths"):
        prune_heads(model, {("dec_self", 1): [0], ("dec_self", 3): [1]})
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def _data(model, n=4, seed=0):
    info = describe_model(model)
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 9, (n,), generator=g).tolist()
    return ImportanceData.from_ids([torch.randint(3, 99, (k,), generator=g).tolist() + [1] for k in lengths]), info


@pytest.mark.parametrize("pruned", [False, True], ids=["whole", "pruned"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lrp_conserves_relevance(layout, pruned):
    """Embeddings plus the biases' shares are the explained logit, per sentence, measured at the first layer's input:
    within 1e-6 in a float32 run, to float64 rounding in a float64 one (also on a pruned model). Before: refused."""
    for dtype, tolerance in ((torch.float32, 1e-6), (torch.float64, 5e-14)):
        model = _adapted(layout, dtype)
        if pruned:
            prune_heads(model, {b.key: [1] for b in attention_blocks(model)})
        data, info = _data(model)
        record = compute_lrp(model, data, info, bootstrap=0).signature["conservation"]
        assert record["n_sentences"] == 4 and record["n_outside"] == 0, record
        total = record["with_biases"]
        assert abs(total["min"] - 1) < tolerance and abs(total["max"] - 1) < tolerance, (dtype, total)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_forward_is_unchanged(layout):
    model = _adapted(layout, torch.float32)
    inputs = tiny_inputs()
    with torch.no_grad():
        before = model(**inputs).logits
    with torch.enable_grad(), lrp_rules(model):
        during = model(**inputs).logits
    assert torch.equal(before, during)


def test_the_value_paths_relevance_is_that_of_an_independent_reference():
    """One adapted attention, in float64, on the normed input ``x`` its hybrid layer hands it: under lrp_rules,
    ``x * grad`` of its output (weighted by a random vector) equals that of a re-implementation in which the
    attention weights are plain constants (computed once, no grad) and the values are ``x Wv^T + (x A^T) B^T``:
    relevance through v_proj and the layer's value adapter, none through the queries and keys or their adapters."""
    model = _adapted("tied")
    attention = _attention(model, 3)  # the second hybrid layer: adapter 1
    seen: list = []
    handle = attention.register_forward_pre_hook(lambda m, args, kwargs: seen.append(kwargs), with_kwargs=True)
    with torch.no_grad():
        model(**tiny_inputs())
    handle.remove()
    kwargs = seen[-1]
    assert kwargs["layer_idx"] == 3
    x = kwargs["hidden_states"].detach().clone()
    mask = kwargs["attention_mask"]
    weights = torch.randn(x.shape[0], x.shape[1], 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    x_rule = x.clone().requires_grad_(True)
    with torch.enable_grad(), lrp_rules(model):
        output, probabilities = attention(x_rule, layer_idx=3, attention_mask=mask)
        (gradient,) = torch.autograd.grad((output * weights).sum(), x_rule)
    relevance = x * gradient

    b, t, heads, d = x.shape[0], x.shape[1], 4, 16
    adapter = attention.linear_v_adapter_list[1]
    with torch.no_grad():  # the constants: the attention weights, from the module's own queries and keys
        p = probabilities.detach().clone()
        q = attention.q_proj(x) + attention.linear_q_adapter_list[1](x)
        k = attention.k_proj(x) + attention.linear_k_adapter_list[1](x)
        logits_ = q.view(b, t, heads, d).transpose(1, 2) @ k.view(b, t, heads, d).transpose(1, 2).transpose(2, 3)
        expected = torch.softmax(logits_ * (d / 2) ** -0.5 + mask, dim=-1)
        torch.testing.assert_close(p, expected, atol=1e-6, rtol=0)  # the weights it used (its softmax in float32)
    x_ref = x.clone().requires_grad_(True)
    values = x_ref @ attention.v_proj.weight.T + (x_ref @ adapter[0].weight.T) @ adapter[1].weight.T
    heads_out = p @ values.view(b, t, heads, d).transpose(1, 2)  # [b, heads, t, d]
    reference = heads_out.transpose(1, 2).reshape(b, t, heads * d) @ attention.o_proj.weight.T
    torch.testing.assert_close(reference.detach(), output.detach(), atol=1e-12, rtol=0)  # the same forward
    (gradient_ref,) = torch.autograd.grad((reference * weights).sum(), x_ref)
    torch.testing.assert_close(relevance, x * gradient_ref, atol=1e-10, rtol=0)
    assert relevance.abs().sum() > 0


def _refused_before_any_change(model, match: str) -> None:
    """LRP refused with ``match`` before any work (first: the probe pass it counts has not run yet); physical pruning
    refused with it, nothing changed."""
    check_lrp_refused_before_any_work(model, match)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(HeadlabError, match=match):
        prune_heads(model, {b.key: [1] for b in attention_blocks(model)})
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_an_adapter_laid_out_otherwise_is_refused_naming_it():
    """An adapter with an activation between its two maps is no weighted sum of the head rows the table slices:
    pruning and LRP refused, naming the adapter, instead of "layout unknown"; analysis still runs."""
    model = _adapted("untied", torch.float32)
    for layer in (0, 2):
        adapters = _attention(model, layer).linear_k_adapter_list
        for i, adapter in enumerate(adapters):
            if isinstance(adapter, torch.nn.Sequential):
                adapters[i] = torch.nn.Sequential(adapter[0], torch.nn.SiLU(), adapter[1])
    _refused_before_any_change(model, r"model.layers.0.shared_transformer.self_attn .*the layout of attention "
                                      r"adapters .*does not fit: its adapter linear_k_adapter_list.0 is not two "
                                      r"bias-free linear maps 64 -> rank -> 64")
    assert [b.q for b in attention_blocks(model)] == [None, None]  # analysed as before, its projections not tied


def test_another_attention_class_is_refused_naming_it():
    """A subclass of Zamba2Attention (another forward, which headlab did not read) is not tied by the table."""
    model = _adapted("untied", torch.float32)
    for layer in (0, 2):
        attention = _attention(model, layer)
        attention.__class__ = type("Zamba2Attention", (type(attention),), {"__module__": "my_models"})
    _refused_before_any_change(model, r"attention adapters .*does not fit: its attention class "
                                      r"my_models.Zamba2Attention is not transformers' Zamba2Attention")


@pytest.mark.parametrize("adapters", [False, True], ids=["no-adapters", "adapters"])
def test_a_hybrid_layer_left_with_no_head_keeps_its_own_cache_layer(adapters, tmp_path):
    """Zamba 2 builds its shared attention with ``layer_idx=-1`` and hands it the layer's index as an argument: a layer
    pruned to no head kept the cache in step at index -1, the last hybrid layer's, whose cached generation then failed
    ("Sizes of tensors must match"), so pruning every head of one hybrid layer and not of another was refused (also
    without adapters). Now at the index it is handed: pruned equals masked, and plain transformers reloads it."""
    if adapters:
        model = _adapted("untied")
    else:
        config = tf.Zamba2Config(
            vocab_size=99, hidden_size=32, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, num_hidden_layers=3, n_mamba_heads=4, mamba_headdim=8, mamba_d_state=8,
            mamba_ngroups=2, mamba_expand=1, chunk_size=4, bos_token_id=0, eos_token_id=1, pad_token_id=2,
            **LAYOUTS["untied"])
        config._attn_implementation = "eager"
        torch.manual_seed(0)
        model = tf.Zamba2ForCausalLM(config).eval().double()
    inputs = tiny_inputs()
    spec = {("dec_self", 0): [0, 1, 2, 3], ("dec_self", 2): [1]}
    with mask_heads(model, spec):
        masked = logits(model, inputs)
    prune_heads(model, spec)
    pruned = logits(model, inputs)
    _close(pruned, masked, inputs)
    save_pruned(model, tmp_path / "m")
    plain = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "m", trust_remote_code=True).eval().double()
    _close(logits(plain, inputs), pruned, inputs, atol=1e-5)
