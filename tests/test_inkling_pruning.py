"""Physical pruning of Inkling (``InklingForCausalLM``, model type ``inkling_text``), session 41.

transformers 5.24's ``InklingAttention`` (models/inkling/modeling_inkling.py), read: besides q/k/v/o, ``r_proj``
(hidden -> heads x ``d_rel``, viewed per head: each head's relative-position features, which ``rel_logits_proj`` maps
to that head's score bias) and the short convolutions ``k_sconv`` / ``v_sconv`` over the key and value projections'
channels (``u + conv1d(u)`` in float32, ``conv1d`` depthwise: one causal kernel per channel, ``groups`` = channels, the
last inputs of each channel kept in the cache's conv states, sized from the input on first use). So a key/value head's
keys and values come from its own channels only (``k_norm`` acts per head after the convolution), and a query head's
bias from its own rows of ``r_proj``. Physical pruning slices those rows (``families.QKV_HEAD_ROWS``) and the kept
key/value heads' channels of both convolutions (``families.KV_CHANNEL_CONVS``, ``Family.kv_convs``).

Before: refused before any work ("besides its q, k, v and output projections, its attention holds modules whose weights
span the heads' channels (r_proj ..., k_sconv ..., v_sconv ...)"): every test here but the refusals failed with it.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from headlab import HeadlabError, attention_blocks, prune_heads
from headlab.adapters import families
from support.family_matrix import check_pruned_generates_as_masked, check_pruned_reloads

if "inkling_text" not in CONFIG_MAPPING:
    pytest.skip("this transformers has no inkling", allow_module_level=True)

# a sliding-window layer, a full-attention one (log scaling), a sliding one: 4 query heads over 2 key/value heads of 8
SIZES = dict(vocab_size=99, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8,
             sliding_window_size=4, d_rel=6, max_position_embeddings=64, bos_token_id=0, eos_token_id=1,
             pad_token_id=2, layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"])


def _inkling() -> torch.nn.Module:
    config = tf.AutoConfig.for_model("inkling_text", **SIZES)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # kernels far from transformers' init, so that each channel's own kernel counts
        for name, parameter in model.named_parameters():
            if "sconv" in name or "r_proj" in name or "rel_logits_proj" in name:
                parameter.normal_(0, 0.5)
    return model


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 99, (2, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left-padded: the convolutions' conv_mask zeroes those positions
    return ids, mask


# layer 0 loses its first key/value head (heads 0, 1), layer 1 heads 1, 2 (both key/value heads kept, each with one
# query head), layer 2 every head (a layer emptied: its stand-in keeps the cache in step, the convolutions unused)
SPEC = {("dec_self", 0): [0, 1], ("dec_self", 1): [1, 2], ("dec_self", 2): [0, 1, 2, 3]}


def test_pruning_equals_masking_on_padded_rows_and_in_cached_generation_and_reloads(tmp_path):
    model = _inkling()
    ids, mask = _inputs()
    expected, tokens = check_pruned_generates_as_masked(model, SPEC, [2, 2, 0], ids, mask)
    attention = [layer.self_attn for layer in model.model.layers]
    assert [a.k_sconv.conv1d.weight.shape[0] for a in attention] == [8, 16, 0]
    assert [(a.v_sconv.conv1d.groups, a.r_proj.out_features) for a in attention] == [(8, 12), (16, 12), (0, 0)]
    record = check_pruned_reloads(model, tmp_path, [2, 2, 0], ids, mask, expected, tokens)
    assert record["blocks"]["dec_self"]["1"] == {"n_heads": 4, "kept_heads": [0, 3], "kept_kv_heads": [0, 1]}


def test_the_kept_key_value_heads_keep_their_own_kernels():
    """Layer 0 keeps key/value head 1 only: its channels 8 .. 15 of each convolution, in order."""
    model = _inkling()
    attention = model.model.layers[0].self_attn
    kernels = {name: getattr(attention, name).conv1d.weight.detach().clone() for name in ("k_sconv", "v_sconv")}
    rows = attention.r_proj.weight.detach().clone()
    prune_heads(model, {("dec_self", 0): [0, 1]})
    for name, kernel in kernels.items():
        assert torch.equal(getattr(attention, name).conv1d.weight, kernel[8:16])
    assert torch.equal(attention.r_proj.weight, rows[12:24])  # query heads 2, 3: 6 rows each


def test_a_convolution_that_is_not_depthwise_is_refused_before_any_work():
    """Inkling's forward runs its convolutions depthwise whatever they say (groups = the input's channels, the weight's
    second dimension squeezed); one whose module does not say so (groups 1 here) is not the convolution whose slicing
    headlab checked: refused before anything runs, naming it, not sliced on trust."""
    model = _inkling()
    model.model.layers[0].self_attn.k_sconv.conv1d.groups = 1
    assert attention_blocks(model)[0].family.kv_convs  # discovery's probe forward, before the hook below
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    calls: list = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    with pytest.raises(HeadlabError, match=r"model.layers.0.self_attn .*physical pruning is refused: its key "
                                           r"convolution k_sconv.conv1d \(in 16, out 16, groups 1, weight \[16, 1, 4\]\) "
                                           r"is not depthwise over the 16 channels of its 2 key/value heads"):
        prune_heads(model, {("dec_self", 0): [3]})
    assert not calls
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())


def test_without_its_table_entries_pruning_is_refused_naming_what_is_not_sliced(monkeypatch):
    """The general rule still holds for a type the tables do not list: modules whose weights span the heads' channels
    (r_proj's rows per head, the convolutions) are named, the model untouched."""
    monkeypatch.setattr(families, "QKV_HEAD_ROWS", {})
    monkeypatch.setattr(families, "KV_CHANNEL_CONVS", {})
    import headlab.adapters as adapters

    monkeypatch.setattr(adapters, "QKV_HEAD_ROWS", {})
    monkeypatch.setattr(adapters, "KV_CHANNEL_CONVS", {})
    model = _inkling()
    assert all(not b.family.kv_convs and not b.family.head_rows for b in attention_blocks(model))
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(HeadlabError, match=r"model.layers.0.self_attn .*modules whose weights span the heads' channels "
                                           r"\(r_proj \(Linear weight \[24, 32\]\), k_sconv "
                                           r"\(InklingShortConvolution conv1d.weight \[16, 1, 4\]\), v_sconv"):
        prune_heads(model, {("dec_self", 0): [3]})
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())


def test_in_float64_with_its_float32_convolutions_it_is_pruned_and_lrp_conserves_after():
    """Loaded in float64 (transformers' dtype=, which keeps the short convolutions in float32: its
    _keep_in_fp32_modules_strict), the convolutions compute in float32 and one over fewer channels rounds apart by
    float32's precision: the pruning check compares at float32's tolerance there (before: PruningNotExact, "max
    difference 5.68e-07, allowed 1.18e-07", the model left unpruned). LRP then runs on the pruned model, its emptied
    layer's convolutions with no channel left unprobed (before: RuntimeError "non-positive groups is not supported")."""
    from support.lrp_families import assert_conserved

    config = tf.AutoConfig.for_model("inkling_text", **SIZES)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float64).eval()
    model.config._experts_implementation = "eager"
    assert model.model.layers[0].self_attn.k_sconv.conv1d.weight.dtype == torch.float32
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "sconv" in name or "r_proj" in name:
                parameter.normal_(0, 0.5)
    ids, _ = _inputs()  # unpadded: in float64 eager its own padded rows are NaN (float64's lowest mask in a float32
    # softmax), which prune_heads' check names and works around, and the comparison here would not
    check_pruned_generates_as_masked(model, SPEC, [2, 2, 0], ids, torch.ones_like(ids))
    assert_conserved(model, 1e-10)
