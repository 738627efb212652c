"""T5Gemma 2: analysed, masked and pruned (session 39, branch t5g2).

Before, refused before any work (``adapters.families.UNSUPPORTED["t5gemma2"]``: "T5Gemma 2's decoder attends with
merged attention ..."; tests/test_t5gemma2_refused.py). Read in transformers 5.24 (models/t5gemma2) and checked here,
on tiny float64 models with a sliding and a global layer on each side:

* the encoder's attention (``T5Gemma2SelfAttention``) is Gemma 3's: ordinary ``enc_self`` blocks (its vision tower's,
  which token ids never run, idle);
* the decoder's (``T5Gemma2MergedAttention``) takes ONE softmax per head over ``[the decoder's tokens | the encoder's
  tokens]``, keys and values of both from the same ``k_proj``/``v_proj`` (``k_norm`` on both, rotary on the decoder's
  keys only), one ``o_proj``; it returns the map split at the decoder's last key, which ``output_attentions`` gives as
  ``decoder_attentions`` and ``cross_attentions``.

So: a decoder layer is a ``dec_self`` block whose map is over the decoder's tokens (``decoder_attentions``), what a row
lacks to one being the encoder's share, left out as a sink's is (``Family.appended_keys``, as DeepSeek-V4's compressed
entries). No ``dec_cross`` block is made of the same heads: headlab keys blocks, gates, masks, scores and pruning plans
on (kind, layer), and a plan could then switch a head off under one kind and keep it under the other, while the head
is one. Masking a head zeroes its output at ``o_proj``'s input (both parts at once); pruning slices q/k/v/o per head
(GQA), so the encoder's keys and values (the cross cache) lose the head too.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from headlab import HeadlabError, attention_blocks, capture_attention, mask_heads, prune_heads
from support.family_matrix import check_confidence_on_every_engine, check_gates_at_one_change_nothing, padded_inputs

HEADS, KV, D = 4, 2, 8
_SIZES = dict(vocab_size=99, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=HEADS,
              num_key_value_heads=KV, head_dim=D, max_position_embeddings=64, query_pre_attn_scalar=8,
              layer_types=["sliding_attention", "full_attention"], sliding_window=3, attn_logit_softcapping=None,
              final_logit_softcapping=None)
_VISION = dict(hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=4, image_size=16,
               patch_size=4)


def build(seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    """The tiny model, eager attention, its norms moved off their initial values; the encoder's window of 7 (its own
    key, 3 each side: so that no padded query of the padded batch has none to attend to), the decoder's of 3."""
    encoder = dict(text_config=dict(_SIZES, sliding_window=7), vision_config=_VISION, mm_tokens_per_image=4)
    config = tf.T5Gemma2Config(encoder=encoder, decoder=_SIZES, vocab_size=99, pad_token_id=2, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(seed)
    model = tf.T5Gemma2ForConditionalGeneration(config).eval()
    model.set_attn_implementation("eager")
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.add_(torch.randn_like(parameter) * 0.5)
    return model.to(dtype)


def _inputs() -> dict:
    """Three source rows (full, right-padded, left-padded) and three target rows padded the other way round."""
    ids, mask = padded_inputs()
    target, target_mask = padded_inputs(seed=5)
    target_mask = target_mask[[2, 0, 1]]
    return dict(input_ids=ids, attention_mask=mask, decoder_input_ids=target[:, :6],
                decoder_attention_mask=target_mask[:, :6])


def _logits(model, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs, use_cache=False).logits


def test_blocks_are_the_encoders_and_the_decoders_merged_attention_as_dec_self():
    """Before: refused. Now enc_self 0 and 1 (the text encoder), the vision tower's idle block, dec_self 0 and 1 (the
    merged attention: q/k/v/o_proj, 4 heads over 2 key/value heads, the encoder's tokens appended to its keys); no
    dec_cross block."""
    model = build()
    blocks = attention_blocks(model)
    assert [(b.kind, b.layer, b.n_heads, b.n_kv_heads, b.d_head, b.idle) for b in blocks] == [
        ("enc_self", 0, HEADS, KV, D, False), ("enc_self", 1, HEADS, KV, D, False), ("enc_self", 2, 4, 4, 8, True),
        ("dec_self", 0, HEADS, KV, D, False), ("dec_self", 1, HEADS, KV, D, False)]
    for block, layer in zip(blocks[3:], model.model.decoder.layers):
        attention = layer.self_attn
        assert (block.q, block.k, block.v, block.o) == (attention.q_proj, attention.k_proj, attention.v_proj,
                                                        attention.o_proj)
        assert block.family.appended_keys.startswith("the encoder's tokens")


def test_capture_is_eager_output_attentions_and_rows_lack_the_encoders_share():
    """capture_attention's maps are transformers' eager output_attentions in float64 to 1e-12: encoder_attentions for
    enc_self, decoder_attentions for dec_self (the merged softmax's decoder columns), on rows padded on the right and
    on the left on both sides, through the sliding and the global layer. A decoder row plus its cross_attentions row
    sums to one (to eager's float32 softmax, which it upcasts to); the map's own rows to less."""
    model = build()
    inputs = _inputs()
    with torch.no_grad():
        out = model(**inputs, output_attentions=True, use_cache=False)
    with capture_attention(model) as record:
        _logits(model, inputs)
    for layer in range(2):
        torch.testing.assert_close(record[("enc_self", layer)], out.encoder_attentions[layer], atol=1e-12, rtol=0)
        torch.testing.assert_close(record[("dec_self", layer)], out.decoder_attentions[layer], atol=1e-12, rtol=0)
        rows = record[("dec_self", layer)].sum(-1) + out.cross_attentions[layer].sum(-1)
        torch.testing.assert_close(rows, torch.ones_like(rows), atol=1e-6, rtol=0)  # eager's float32 softmax
        assert bool((record[("dec_self", layer)].sum(-1) < 1 - 1e-6).all())
    # the sliding layer's window (3 keys) and causality hold in the decoder's map
    assert float(record[("dec_self", 0)][0, :, 5, :3].abs().max()) == 0.0
    assert float(record[("dec_self", 1)][0, :, 2, 3:].abs().max()) == 0.0


def test_capture_over_a_cache_of_earlier_tokens_is_refused():
    """One query over a cache of earlier decoder tokens is not one pass's map: refused, naming the cache (the
    sliding layer first, its cache of 3 keys)."""
    model = build()
    inputs = _inputs()
    with torch.no_grad():
        past = model(**inputs, use_cache=True).past_key_values
    step = dict(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                decoder_input_ids=inputs["decoder_input_ids"][:, -1:], past_key_values=past)
    with pytest.raises(HeadlabError, match=r"T5Gemma2MergedAttention: 1 queries over 3 decoder keys \(a cache"), \
            capture_attention(model):
        _logits(model, step)


_ZEROED = "headlab_test_t5gemma2_zeroed"


def _zeroing_eager(module, query, key, value, attention_mask, **kwargs):
    """transformers' eager of T5Gemma 2, then the heads of ``module.zeroed`` zeroed in its output
    ``[batch, seq, heads, head_dim]``, before o_proj: the reference by hand."""
    from transformers.models.t5gemma2.modeling_t5gemma2 import eager_attention_forward

    output, weights = eager_attention_forward(module, query, key, value, attention_mask, **kwargs)
    output = output.clone()
    for head in getattr(module, "zeroed", ()):
        output[:, :, head] = 0.0
    return output, weights


class _ByHand:
    """The decoder's layers run ``_zeroing_eager`` with ``zeroed`` heads per layer inside."""

    def __init__(self, model, zeroed: dict[int, list[int]]):
        self.model, self.zeroed = model, zeroed

    def __enter__(self):
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, eager_mask

        AttentionInterface.register(_ZEROED, _zeroing_eager)
        AttentionMaskInterface.register(_ZEROED, eager_mask)
        for layer, heads in self.zeroed.items():
            self.model.model.decoder.layers[layer].self_attn.zeroed = heads
        for attention in self._attentions():
            attention.config._attn_implementation = _ZEROED
        return self

    def _attentions(self):
        return [layer.self_attn for layer in self.model.model.decoder.layers]

    def __exit__(self, *exc):
        for attention in self._attentions():
            attention.config._attn_implementation = "eager"
            attention.__dict__.pop("zeroed", None)


@pytest.mark.parametrize("spec", [{0: [1]}, {1: [0, 3]}, {0: [2, 3], 1: [0, 1, 2, 3]}])
def test_masking_equals_zeroed_head_outputs(spec):
    """Masking decoder heads (one, one per key/value head, a whole key/value group, a whole layer) equals zeroing
    their rows of the merged attention's output by hand, before o_proj, on the padded batch, to 1e-12 (the head's
    self and cross parts both: they are one output); the mask comes off. Before: refused."""
    model = build()
    inputs = _inputs()
    before = _logits(model, inputs)
    with mask_heads(model, {("dec_self", layer): heads for layer, heads in spec.items()}):
        masked = _logits(model, inputs)
    assert torch.equal(_logits(model, inputs), before)
    with _ByHand(model, spec):
        reference = _logits(model, inputs)
    assert not torch.allclose(reference, before)
    torch.testing.assert_close(masked, reference, atol=1e-12, rtol=0)


def _generate(model, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        out = model.generate(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], max_new_tokens=4,
                             do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=2)
    return out.sequences, torch.stack(out.scores)


def test_masking_in_cached_generation_equals_zeroed_head_outputs():
    """Greedy cached generation (the cross cache filled at the first step) with heads masked equals generation with
    their outputs zeroed by hand: the same tokens, scores to 1e-12."""
    model = build()
    inputs = _inputs()
    spec = {0: [0, 3], 1: [2]}
    with mask_heads(model, {("dec_self", layer): heads for layer, heads in spec.items()}):
        tokens, scores = _generate(model, inputs)
    with _ByHand(model, spec):
        reference_tokens, reference_scores = _generate(model, inputs)
    assert torch.equal(tokens, reference_tokens)
    torch.testing.assert_close(scores, reference_scores, atol=1e-12, rtol=0)
    assert not torch.allclose(_generate(model, inputs)[1], scores)  # the masking did something


def test_gates_at_one_change_nothing():
    check_gates_at_one_change_nothing(build(), _inputs())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_pruning_equals_masking_in_generation_empties_a_layer_and_reloads(dtype, tmp_path):
    """Decoder layer 0 emptied, heads 1 and 2 of layer 1 removed (one per key/value head) and head 3 of the encoder's
    layer 0: the pruned model equals the masked one on the padded batch and in greedy cached generation (the cross
    cache built from the sliced k_proj/v_proj), in float64 to 1e-10. In float32, saved, it reloads with load_pruned
    and with plain transformers (remote code), which give the masked model's logits and tokens. Before: refused."""
    import json

    from headlab import load_pruned, save_pruned

    model = build(dtype=dtype)
    inputs = _inputs()
    spec = {("dec_self", 0): [0, 1, 2, 3], ("dec_self", 1): [1, 2], ("enc_self", 0): [3]}
    atol = 1e-10 if dtype == torch.float64 else 1e-5
    with mask_heads(model, spec):
        expected = _logits(model, inputs)
        expected_tokens, expected_scores = _generate(model, inputs)
    prune_heads(model, spec)  # checks itself against masking (padded probe, cached generation)
    assert [(b.kind, b.n_heads, b.n_kv_heads) for b in attention_blocks(model) if not b.idle] == \
        [("enc_self", 3, 3), ("enc_self", 4, 2), ("dec_self", 0, 0), ("dec_self", 2, 2)]
    attention = model.model.decoder.layers[1].self_attn
    assert (attention.q_proj.out_features, attention.k_proj.out_features, attention.o_proj.in_features) == (16, 16, 16)
    torch.testing.assert_close(_logits(model, inputs), expected, atol=atol, rtol=0)
    tokens, scores = _generate(model, inputs)
    assert torch.equal(tokens, expected_tokens)
    torch.testing.assert_close(scores, expected_scores, atol=atol, rtol=0)
    if dtype == torch.float64:
        return
    save_pruned(model, tmp_path)
    record = json.loads((tmp_path / "headlab_pruning.json").read_text())
    assert record["portable"]["how"] == "remote code"
    assert {layer: entry["kept_heads"] for layer, entry in record["blocks"]["dec_self"].items()} == \
        {"0": [], "1": [0, 3]}
    reloaded = load_pruned(tmp_path)  # sdpa, as loaded: float32's rounding apart from the eager model's logits
    torch.testing.assert_close(_logits(reloaded, inputs), expected, atol=1e-5, rtol=0)
    assert torch.equal(_generate(reloaded, inputs)[0], expected_tokens)
    plain, info = tf.AutoModelForSeq2SeqLM.from_pretrained(tmp_path, trust_remote_code=True, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    plain.eval()
    torch.testing.assert_close(_logits(plain, inputs), expected, atol=1e-5, rtol=0)
    assert torch.equal(_generate(plain, inputs)[0], expected_tokens)


def test_dec_cross_plans_are_refused_there_being_no_such_block():
    """The heads' cross part is no block of its own: a mask or pruning plan naming dec_cross is refused before any work,
    naming the kinds the model has."""
    model = build()
    for act in (lambda: prune_heads(model, {("dec_cross", 0): [1]}),
                lambda: mask_heads(model, {("dec_cross", 0): [1]}).__enter__()):
        with pytest.raises(HeadlabError, match=r"the model has no dec_cross attention \(it has enc_self, dec_self\)"):
            act()
    assert [b.n_heads for b in attention_blocks(model) if not b.idle] == [HEADS] * 4


@pytest.mark.parametrize("pruned", [False, True])
def test_lrp_conserves_in_float64(pruned):
    """compute_lrp on the model's own translations conserves every sentence's logit to 1e-9 in float64 (relevance
    through the merged attention's values reaches both the decoder's tokens and the encoder's), pruned too (a layer
    emptied)."""
    from headlab.importance import ImportanceData, compute_lrp, describe_model, translate_data

    model = build()
    if pruned:
        prune_heads(model, {("dec_self", 0): [0, 1, 2, 3], ("dec_self", 1): [1, 2], ("enc_self", 0): [3]})
    info = describe_model(model)
    g = torch.Generator().manual_seed(0)
    data = ImportanceData.from_ids([torch.randint(3, 99, (k,), generator=g).tolist() + [1] for k in (3, 6, 9)])
    data = translate_data(model, data, info, max_length_a=0, max_length_b=6)
    record = compute_lrp(model, data, info, bootstrap=0).signature["conservation"]
    assert record["n_sentences"] == 3 and record["n_outside"] == 0, record
    assert abs(record["with_biases"]["min"] - 1) < 1e-9 and abs(record["with_biases"]["max"] - 1) < 1e-9, record


def test_confidence_is_the_same_on_every_engine():
    """The fused and chunked engines cannot run headlab's attention function on the decoder (it would count the
    encoder's tokens as the decoder's keys): they take the eager maps (stream_attention's fallback, in float32) and give
    eager's scores to float32's rounding."""

    from headlab.capture import not_streamable
    from headlab.importance import ImportanceData, describe_model, translate_data

    model = build()
    assert "appends the encoder's tokens" in not_streamable(model)
    info = describe_model(model)
    data = ImportanceData.from_ids([[5, 17, 33, 41, 8, 1], [9, 60, 22, 1], [70, 12, 45, 31, 28, 90, 3, 1]])
    data = translate_data(model, data, info, max_length_a=0, max_length_b=6)
    check_confidence_on_every_engine(model, data, info)


def test_analyze_end_to_end(tmp_path, capsys):
    """Every stage of ``headlab analyze --ablation`` on a saved tiny T5Gemma 2 (a word tokenizer with Marian's special
    ids), LRP's too; a score row per layer of each kind. Before: every stage refused with the model."""
    import json

    from support.family_matrix import analyze, treebank_files
    from support.treebank import word_tokenizer

    model = build(dtype=torch.float32)
    model.config.pad_token_id, model.config.eos_token_id = 0, 1
    model.config.decoder.pad_token_id = model.config.decoder.bos_token_id = 0
    word_tokenizer(treebank_files(tmp_path), style="marian").save_pretrained(tmp_path / "model")
    model.save_pretrained(tmp_path / "model")
    code, stages = analyze(tmp_path / "model", tmp_path)
    assert code == 0, capsys.readouterr().err
    assert {name for name, stage in stages.items() if stage["status"] != "done"} <= {"prune", "figures"}, stages
    assert stages["lrp"]["status"] == "done"
    scores = json.loads((tmp_path / "out" / "importance" / "confidence.json").read_text())["scores"]
    assert sorted(scores) == ["dec_self", "enc_self"] and len(scores["dec_self"]) == 2
    assert all(v is not None for row in scores["dec_self"] for v in row)


def test_pruning_an_uneven_group_equals_masking_in_generation():
    """One head of a key/value group pruned in each decoder layer (the group's key/value head copied for the kept head
    that shares it, as for any grouped-query attention), the self and cross keys alike: equal to masking on the padded
    batch and in greedy cached generation, float64, to 1e-10."""
    model = build()
    inputs = _inputs()
    spec = {("dec_self", 0): [1], ("dec_self", 1): [2]}
    with mask_heads(model, spec):
        expected = _logits(model, inputs)
        expected_tokens, expected_scores = _generate(model, inputs)
    prune_heads(model, spec)
    assert [(b.n_heads, b.n_kv_heads) for b in attention_blocks(model) if b.kind == "dec_self"] == [(3, 3), (3, 3)]
    torch.testing.assert_close(_logits(model, inputs), expected, atol=1e-10, rtol=0)
    tokens, scores = _generate(model, inputs)
    assert torch.equal(tokens, expected_tokens)
    torch.testing.assert_close(scores, expected_scores, atol=1e-10, rtol=0)
