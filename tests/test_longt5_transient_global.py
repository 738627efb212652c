"""LongT5 with transient-global attention (``encoder_attention_type="transient-global"``, google/long-t5-tglobal-*)
analysed, masked and pruned (refused before any work until session 41: its side keys are not tokens).

Its encoder's ``TransientGlobalSelfAttention`` (``LongT5TransientGlobalAttention``, transformers 5.24) is the local
attention's layout (T5's q/k/v/o, blocks of ``block_len = local_radius + 1`` tokens over three blocks, masked to
``local_radius``) with side keys after each window: one per global block of ``global_block_size`` tokens, the layer's
own k and v of ``global_input_layer_norm`` of the sum of that block's input states (a token of no full block counted
in the block before), biased by ``global_relative_attention_bias`` and masked to the row's real global blocks. The
decoder is T5's. On tiny float64 models (local_radius 1: blocks of 2; global_block_size 2; sources of 7 tokens: four
local blocks, three global blocks, the last token an orphan of the third), a batch padded on the right and on the left:

* capture's encoder map equals transformers' ``output_attentions`` windows put in place (tests/support/longt5.py) bit
  for bit, and the probabilities recomputed by hand from the layer's projections (side keys from the aggregates built
  here) to float32's precision (its softmax is float32 in any dtype); with the side keys' share the module returns,
  every real token's row sums to one, and that share is not zero: the map's rows sum to less than one; the
  right-padded row maps as it does alone (its padded batch has one global block more, masked);
* masking a head equals zeroing its value rows (the side values too: one v); gates at one change nothing;
* physical pruning (tests/support/seq2seq_families.py's plans: the encoder's first layer, which computes the shared
  [local | side] bias, pruned or left with no head) equals masking on the padded batch and in cached greedy
  generation; each pruned layer is handed its kept heads' columns of both position tables, which stay whole (without
  that hook pruning fails; with the side keys' columns of other heads it differs: refused); the directory save_pruned
  writes reloads with load_pruned and plain transformers (pruned_heads.py's transient_global_bias_hook);
* LRP (q and k held constant: the side keys' scores too) conserves every sentence's logit to 1e-10 in float64 (1e-6
  in float32), pruned too: a side value is v of an RMS norm (its factor held constant) of a sum of the layer's input
  states, so its relevance reaches the tokens through linear maps; with that path cut, conservation fails;
* ``headlab analyze --ablation`` runs every stage on a saved tiny transient-global LongT5.

Every test here fails on main, where attention_blocks refused the model (UNSUPPORTED_CONFIGS["longt5"]).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers as tf

from headlab import attention_blocks, capture_attention, prune_heads
from support.family_matrix import (
    check_confidence_on_every_engine,
    check_gates_at_one_change_nothing,
    logits,
    perturbed_model,
)
from support.longt5 import dense_maps
from support.seq2seq_families import (
    KINDS,
    SPECS,
    check_analyze_end_to_end,
    check_masking_equals_zeroed,
    check_pruned_equals_masked,
    check_pruned_reloads,
    check_translated_lrp_conserves,
    translated_data,
)

RADIUS, GLOBAL_BLOCK, N = 1, 2, 7
STEPS = 5


def _config(**extra) -> tf.LongT5Config:
    return tf.LongT5Config(**{**dict(
        vocab_size=99, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_decoder_layers=2, num_heads=4,
        local_radius=RADIUS, global_block_size=GLOBAL_BLOCK, relative_attention_num_buckets=8,
        relative_attention_max_distance=16, encoder_attention_type="transient-global", pad_token_id=0,
        eos_token_id=1, decoder_start_token_id=0), **extra})


def tiny_tglobal(cls=tf.LongT5ForConditionalGeneration, **extra) -> torch.nn.Module:
    """2 + 2 layers, 4 heads of 8, local_radius 1, global_block_size 2, norms moved off their initial values, eager,
    float64."""
    return perturbed_model(cls, _config(**extra), seed=4, attn_implementation="eager").double()


def _inputs() -> dict:
    """Three sources of 7 tokens: one full, one padded on the right (2), one on the left (2); target prefixes of 5."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 99, (3, N), generator=g)
    mask = torch.ones(3, N, dtype=torch.long)
    mask[1, -2:] = 0
    mask[2, :2] = 0
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask,
            "decoder_input_ids": torch.randint(3, 99, (3, 5), generator=g)}


def _encoder_calls(model, inputs: dict) -> list[dict]:
    """What each encoder layer's attention was called with (its input states, the mask) and returned."""
    calls: list[dict] = []

    def record(module, args, kwargs, output):
        calls.append({"hidden": args[0] if args else kwargs["hidden_states"], "mask": kwargs["mask"],
                      "output": output})

    cores = [block.layer[0].TransientGlobalSelfAttention for block in model.encoder.block]
    handles = [core.register_forward_hook(record, with_kwargs=True) for core in cores]
    try:
        with torch.no_grad():
            model(**inputs, output_attentions=True)
    finally:
        for handle in handles:
            handle.remove()
    return calls


def _global_blocks(real: list[bool]) -> list[int]:
    """Each token's global block as LongT5 counts it (by position: ``p // global_block_size``), a token after the last
    full block of real tokens counted in it; -1 for padding (and for every token of a row with no full block)."""
    full = sum(1 for p, r in enumerate(real) if r and p % GLOBAL_BLOCK == GLOBAL_BLOCK - 1)
    return [min(p // GLOBAL_BLOCK, full - 1) if r else -1 for p, r in enumerate(real)]


def _by_hand(core, first, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token i's probabilities over the input's tokens, recomputed from ``core``'s projections (the position tables
    are ``first``'s, the stack's first layer): the softmax of ``q_i . k_j + bias(j - i)`` over the real tokens within
    local_radius and of ``q_i . k(norm(sum of the block's states)) + global bias(g - block(i))`` over the row's global
    blocks, the tokens' entries placed at their positions (the side keys' left out); padded queries' rows zero."""
    batch, n, _ = hidden.shape
    heads, d = core.n_heads, core.key_value_proj_dim

    def bucket(table, distance: int) -> torch.Tensor:
        which = first._relative_position_bucket(torch.tensor(distance), bidirectional=True,
                                                num_buckets=first.relative_attention_num_buckets,
                                                max_distance=first.relative_attention_max_distance)
        return table.weight[which]  # [heads]

    out = torch.zeros(batch, heads, n, n, dtype=hidden.dtype)
    for b in range(batch):
        real = [bool(mask[b, p]) for p in range(n)]
        blocks = _global_blocks(real)
        q = core.q(hidden[b]).view(n, heads, d)
        k = core.k(hidden[b]).view(n, heads, d)
        aggregates = [sum((hidden[b, p] for p in range(n) if blocks[p] == g), torch.zeros_like(hidden[b, 0]))
                      for g in range(max(blocks) + 1)]
        side = core.k(core.global_input_layer_norm(torch.stack(aggregates))).view(-1, heads, d) if aggregates \
            else k.new_zeros(0, heads, d)
        for i in (i for i in range(n) if real[i]):
            keys = [j for j in range(n) if real[j] and abs(j - i) <= RADIUS]
            scores = [(q[i] * k[j]).sum(-1) + bucket(first.relative_attention_bias, j - i) for j in keys]
            scores += [(q[i] * side[g]).sum(-1) + bucket(first.global_relative_attention_bias, g - blocks[i])
                       for g in range(side.shape[0])]
            probs = torch.stack(scores, -1).softmax(-1)  # [heads, keys + side keys]
            out[b, :, i, keys] = probs[:, :len(keys)]
    return out


def test_blocks_are_the_two_layouts():
    model = tiny_tglobal()
    blocks = attention_blocks(model)
    assert [(b.kind, b.layer, b.n_heads, b.d_head, b.family.name) for b in blocks] == [
        ("enc_self", 0, 4, 8, "longt5-transient-global"), ("enc_self", 1, 4, 8, "longt5-transient-global"),
        ("dec_self", 0, 4, 8, "longt5-decoder"), ("dec_cross", 0, 4, 8, "longt5-decoder"),
        ("dec_self", 1, 4, 8, "longt5-decoder"), ("dec_cross", 1, 4, 8, "longt5-decoder")]
    assert {type(b.core).__name__ for b in blocks[:2]} == {"LongT5TransientGlobalAttention"}
    assert blocks[0].o is model.encoder.block[0].layer[0].TransientGlobalSelfAttention.o
    encoder_only = attention_blocks(tiny_tglobal(tf.LongT5EncoderModel))
    assert [(b.kind, b.layer) for b in encoder_only] == [("enc_self", 0), ("enc_self", 1)]


def test_captured_probabilities_are_the_models_own():
    """The encoder's maps equal its output_attentions' local windows put in place bit for bit, and the probabilities
    recomputed by hand from the projections; the side keys' share is what each real row lacks to one."""
    model, inputs = tiny_tglobal(), _inputs()
    calls = _encoder_calls(model, inputs)
    with torch.no_grad():
        out = model(**inputs, output_attentions=True)
    block_len = RADIUS + 1
    assert out.encoder_attentions[0].shape == (3, 4, 4, block_len, 3 * block_len + 3)  # 4 local blocks, 3 global
    theirs = dense_maps([a[..., :3 * block_len] for a in out.encoder_attentions], N, inputs["attention_mask"])
    with torch.no_grad(), capture_attention(model) as record:
        model(**inputs)
    assert sorted(record) == sorted((kind, layer) for kind in KINDS for layer in (0, 1))
    real = inputs["attention_mask"].bool()
    first = model.encoder.block[0].layer[0].TransientGlobalSelfAttention
    for layer, call in enumerate(calls):
        probs = record[("enc_self", layer)]
        assert probs.shape == (3, 4, N, N)
        assert torch.equal(probs, theirs[layer])
        core = model.encoder.block[layer].layer[0].TransientGlobalSelfAttention
        with torch.no_grad():
            by_hand = _by_hand(core, first, call["hidden"], call["mask"])
        # the module's softmax is float32 in any dtype: the same probabilities to float32's precision
        torch.testing.assert_close(probs * real[:, None, :, None], by_hand, atol=2e-7, rtol=0)
        side = call["output"][2][..., 3 * block_len:]  # [batch, blocks, heads, block_len, global blocks]
        share = side.sum(-1).permute(0, 2, 1, 3).flatten(2)[:, :, :N]  # [batch, heads, tokens]
        rows = (probs.sum(-1) + share).permute(0, 2, 1)[real]
        torch.testing.assert_close(rows, torch.ones_like(rows), atol=1e-6, rtol=0)
        # every real token of a row with a full global block puts mass on the side keys: rows sum to less than one
        assert bool((share.permute(0, 2, 1)[real] > 0).all())
        assert not bool(probs[~real[:, None, None, :].expand_as(probs)].any())  # no mass on a padded key
        assert torch.equal(record[("dec_self", layer)], out.decoder_attentions[layer])
        assert torch.equal(record[("dec_cross", layer)], out.cross_attentions[layer])


def _zero_head(model, kind: str, layer: int, head: int) -> None:
    """Head ``head``'s value rows zeroed (T5 is bias-free): its output is then 0, over the tokens' values and the side
    keys' alike (one v for both)."""
    block = (model.encoder if kind == "enc_self" else model.decoder).block[layer]
    core = {"enc_self": lambda: block.layer[0].TransientGlobalSelfAttention,
            "dec_self": lambda: block.layer[0].SelfAttention, "dec_cross": lambda: block.layer[1].EncDecAttention}[kind]()
    with torch.no_grad():
        core.v.weight[head * 8:(head + 1) * 8] = 0


@pytest.mark.parametrize("kind", KINDS)
def test_masking_equals_zeroed_values(kind):
    check_masking_equals_zeroed(tiny_tglobal(), kind, _inputs(), zero_head=_zero_head)


def test_gates_at_one_change_nothing():
    check_gates_at_one_change_nothing(tiny_tglobal(), _inputs())


@pytest.mark.parametrize("spec_name", SPECS)
def test_pruned_equals_masked_and_generates_so(spec_name):
    """Pruned (q/k/v rows and o columns sliced; both position tables of the first layer kept whole, each pruned layer
    handed its kept heads' columns of the [local | side] bias with the masks folded in; a layer with no head left,
    the first one too: zeros) equals masked in float64: the padded batch's logits and cached greedy generation."""
    model = tiny_tglobal()
    counts = check_pruned_equals_masked(model, SPECS[spec_name], _inputs(), STEPS)
    first = model.encoder.block[0].layer[0].TransientGlobalSelfAttention
    assert first.relative_attention_bias.weight.shape == first.global_relative_attention_bias.weight.shape == (8, 4)
    core = model.encoder.block[1].layer[0].TransientGlobalSelfAttention
    kept = counts[("enc_self", 1)]
    assert (core.n_heads, core.inner_dim, core.q.weight.shape, core.o.weight.shape) == (
        kept, 8 * kept, (8 * kept, 32), (32, 8 * kept))


def _side_columns_of_heads_0_up(source):
    """The transient-global bias hook but for the side keys' columns: those of heads 0, 1, .. (as many as the layer
    kept), not of the heads it kept (a global table left unsliced per head)."""
    from headlab.portable_code import KEPT_ATTR, transient_global_bias_hook

    right = transient_global_bias_hook(source)

    def hook(module, args, kwargs):
        kept = getattr(module, KEPT_ATTR)
        _, good = right(module, args, dict(kwargs))
        setattr(module, KEPT_ATTR, list(range(len(kept))))
        try:
            _, other = right(module, args, dict(kwargs))
        finally:
            setattr(module, KEPT_ATTR, kept)
        width = 3 * module.block_len
        bias = torch.cat([good["position_bias"][..., :width], other["position_bias"][..., width:]], -1)
        return args, {**kwargs, "position_bias": bias}
    return hook


@pytest.mark.parametrize("hook", ["none", "side columns of other heads"])
def test_pruning_needs_its_bias_hook(monkeypatch, hook):
    """The regression the transient-global bias hook fixes: without a hook (the stack handing on layer 0's bias of its
    kept heads only) pruning the encoder fails; with the side keys' bias of other heads than the kept ones (the global
    table not sliced with the heads), it differs from masking. Both refused, the model left whole."""
    from headlab import surgery
    from headlab.adapters import families
    from headlab.errors import PruningNotExact

    if hook == "none":
        monkeypatch.setitem(families.FAMILIES, "longt5", dataclasses.replace(
            families.LONGT5, parts=(families.LONGT5_DECODER,
                                    dataclasses.replace(families.LONGT5_TRANSIENT_GLOBAL, shared_bias=""))))
    else:
        monkeypatch.setattr(surgery, "_transient_global_bias_hook", _side_columns_of_heads_0_up)
    model, inputs = tiny_tglobal(), _inputs()
    before = logits(model, inputs)
    why = "fails in enc_self layer 0" if hook == "none" else "differs from the masked one in enc_self layer 0"
    with pytest.raises(PruningNotExact, match=why):
        prune_heads(model, {("enc_self", 0): [1], ("enc_self", 1): [0, 2]})
    assert torch.equal(logits(model, inputs), before)
    assert [b.n_heads for b in attention_blocks(model)] == [4] * 6


@pytest.mark.parametrize("spec_name", SPECS)
def test_pruned_reloads(spec_name, tmp_path):
    """save_pruned, then load_pruned and plain transformers (pruned_heads.py, trust_remote_code; every weight loaded):
    the masked model's logits (1e-12) and cached greedy tokens; the plan hands the encoder's layers the
    transient-global bias, the decoder's T5's."""
    import json

    check_pruned_reloads(tiny_tglobal(), SPECS[spec_name], _inputs(), tmp_path, set(), STEPS)
    plan = json.loads((tmp_path / "config.json").read_text())["headlab_pruned"]["shared_bias"]
    assert {kind for path, (_, _, kind) in plan.items() if path.startswith("encoder.")} == {"transient-global"}
    assert {kind for path, (_, _, kind) in plan.items() if path.startswith("decoder.")} == {"t5"}


LRP_SPECS = {"partial": SPECS["partial"],  # SPECS' "no head left" translates nothing: LRP has no token to explain
             "first layer emptied": {("enc_self", 0): [0, 1, 2, 3], ("enc_self", 1): [2], ("dec_cross", 1): [0, 1, 2, 3]}}


@pytest.mark.parametrize("spec_name", [None, *LRP_SPECS])
def test_lrp_conserves_in_float64(spec_name):
    """compute_lrp on the model's own translations (sources of 4, 7 and 10 tokens: up to five global blocks)
    conserves every sentence's logit to 1e-10 in float64, pruned too: q and k held constant (the side keys' scores
    with the tokens'), the side values' relevance flowing through v, the global RMS norm (its factor constant) and the
    sum of the block's states back to its tokens. No rule was added: the existing ones are exact here."""
    model = tiny_tglobal()
    if spec_name:
        prune_heads(model, LRP_SPECS[spec_name])
    check_translated_lrp_conserves(model, eos=1, bar=1e-10)


def test_lrp_counts_the_side_values():
    """The side keys' values carry relevance: with their path cut (global_input_layer_norm's output detached, so what
    reaches the side values stops there), every sentence misses its logit by far more than the run's tolerance and
    compute_lrp fails; with it, conservation holds (above)."""
    from headlab.errors import RunFailed

    model = tiny_tglobal()
    for block in model.encoder.block:
        block.layer[0].TransientGlobalSelfAttention.global_input_layer_norm.register_forward_hook(
            lambda module, args, output: output.detach())
    with pytest.raises(RunFailed, match="did not conserve relevance"):
        check_translated_lrp_conserves(model, eos=1, bar=1e-10)


def test_lrp_conserves_in_float32_to_the_bar():
    check_translated_lrp_conserves(tiny_tglobal().float(), eos=1, bar=1e-6)


def test_captured_maps_of_a_pruned_model_are_its_kept_heads():
    """The maps of pruned encoder layers (the first one's own bias and the one handed to the second by the hook) are
    the masked model's maps of their kept heads."""
    from headlab import mask_heads

    model, spec = tiny_tglobal(), {("enc_self", 0): [3], ("enc_self", 1): [0, 2]}
    with torch.no_grad(), mask_heads(model, spec), capture_attention(model) as record:
        model(**_inputs())
    masked = {key: value.clone() for key, value in record.items()}
    prune_heads(model, spec)
    with torch.no_grad(), capture_attention(model) as record:
        model(**_inputs())
    torch.testing.assert_close(record[("enc_self", 0)], masked[("enc_self", 0)][:, [0, 1, 2]], atol=1e-12, rtol=0)
    torch.testing.assert_close(record[("enc_self", 1)], masked[("enc_self", 1)][:, [1, 3]], atol=1e-12, rtol=0)


def test_confidence_is_the_same_on_every_engine():
    """The encoder's attention does not dispatch through transformers' interface: the default and chunked engines
    take its eager maps (read as capture reads them), the decoder's through headlab's function, and give eager's
    scores."""
    from headlab.capture import not_streamable

    model = tiny_tglobal()
    assert "does not dispatch" in not_streamable(model)
    data, info = translated_data(model, eos=1)  # sources of 4, 7 and 10 tokens
    check_confidence_on_every_engine(model, data, info)


def test_analyze_end_to_end(tmp_path, capsys):
    """`headlab analyze --ablation` on a saved tiny transient-global LongT5 (a word tokenizer with Marian's special
    ids): every stage but pruning and the figures done, LRP and ablation included; the decoder's maps causal."""
    check_analyze_end_to_end(tiny_tglobal().float(), tmp_path, capsys)


def test_a_right_padded_row_maps_as_alone():
    """The right-padded row (as headlab's batches pad) has the encoder maps it has alone, its padding cut: its global
    blocks are counted from its first token either way and the padded batch's extra global block is masked (-1e10:
    probability exactly 0). (A left-padded row's blocks are counted from the padding's first slot: transformers'
    own computation, which capture reads as it is.)"""
    model, inputs = tiny_tglobal(), _inputs()
    length = int(inputs["attention_mask"][1].sum())
    alone = {"input_ids": inputs["input_ids"][1:2, :length], "attention_mask": inputs["attention_mask"][1:2, :length],
             "decoder_input_ids": inputs["decoder_input_ids"][1:2]}
    with torch.no_grad(), capture_attention(model) as record:
        model(**inputs)
    batched = {key: value[1:2].clone() for key, value in record.items()}
    with torch.no_grad(), capture_attention(model) as record:
        model(**alone)
    for layer in (0, 1):
        torch.testing.assert_close(batched[("enc_self", layer)][..., :length, :length], record[("enc_self", layer)],
                                   atol=1e-12, rtol=0)
