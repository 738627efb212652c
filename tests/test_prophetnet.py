"""ProphetNet (microsoft/prophetnet-*, transformers 5.24 models/prophetnet) analysed and masked (session 41, branch
prophetnet; refused before any work by ``adapters.families.UNSUPPORTED`` until then, tests/test_mvp_prophetnet_pegasus_x.py).

Its encoder self-attention and decoder cross-attention are ``ProphetNetAttention`` (BART's old attention outside the
attention interface, which returns its masked scores before the softmax when asked): capture reads their softmax. Its
decoder self-attention (``ProphetNetNgramSelfAttention``) runs the target tokens as a main stream and ``ngram``
predicting streams through one set of projections, and its output projection twice (main, then predicting streams):
the map analysed is the main stream's (the decoder's cross-attention's rows likewise), and masking a head removes it
from every stream. The next-token logits come from the first predicting stream (checked here), which masking reaches.

transformers' ProphetNet gives NaN in float64 on an integer padding mask (``1.0 - mask``, float32, times
``finfo(float64).min``, which overflows to -inf: 0 x -inf at every unmasked key): headlab's blocks hand a float64
ProphetNet its masks as float64 (headlab.adapters.prophetnet). Its predicting streams' relative-position scores are not
their own (position, stream, head)'s (get_predict_relative_pos_embeddings' order follows the length and the head
count): a padded target batch is refused before the decoder runs, and a pruned decoder self-attention computes them
for the config's heads and takes its kept heads' (PRUNED_FORWARDS["prophetnet"], session 43; refused before).

On a tiny ProphetNet in float64 with a padded source batch (pad id 0, as the released checkpoints': transformers'
cached generation checks positions that hold only then): capture equals the module's probabilities bit for bit,
masking equals zeroing the head's values by hand in every stream, gates at one change nothing (a Hard Concrete gate
drawn once per call for every stream), pruning heads of the three kinds (a layer of each emptied too, pruned twice, the
decoder alone too) equals masking (padded batch, cached generation) and reloads (load_pruned, plain transformers), gates
at one change nothing and LRP conserves to 1e-10 (pruned too),
``headlab analyze --ablation --batch-size 1`` runs every stage (the encoder-decoder and ProphetNetForCausalLM). Every
test here fails on main, where attention_blocks refused the model (UNSUPPORTED["prophetnet"]).
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from headlab import HeadlabError, attention_blocks, capture_attention, mask_heads

PAD = 0
KINDS = ("enc_self", "dec_self", "dec_cross")


def _config(**overrides) -> tf.ProphetNetConfig:
    values = dict(vocab_size=99, hidden_size=32, encoder_ffn_dim=37, decoder_ffn_dim=37, num_encoder_layers=2,
                  num_decoder_layers=2, num_encoder_attention_heads=4, num_decoder_attention_heads=4,
                  max_position_embeddings=64, ngram=2, num_buckets=8, relative_max_distance=16, pad_token_id=PAD,
                  bos_token_id=1, eos_token_id=1, decoder_start_token_id=1)
    return tf.ProphetNetConfig(**{**values, **overrides})


def tiny_prophetnet(**overrides) -> torch.nn.Module:
    """A tiny ProphetNet in float64, headlab's blocks made (its masks as float64: the module's docstring)."""
    torch.manual_seed(0)
    model = tf.ProphetNetForConditionalGeneration(_config(**overrides)).double().eval()
    attention_blocks(model)
    return model


def inputs() -> dict:
    """Two sources of 7 ids, the second padded at the end (an integer mask, a tokenizer's), and two target prefixes
    of 5."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 99, (2, 7), generator=g)
    mask = torch.ones(2, 7, dtype=torch.long)
    ids[1, 5:], mask[1, 5:] = PAD, 0
    return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": torch.randint(3, 99, (2, 5), generator=g)}


def logits(model, batch: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch).logits


def test_blocks_are_the_three_kinds():
    """Encoder self-attention and decoder cross-attention (ProphetNetAttention), decoder self-attention (the n-gram
    attention), 4 heads of 8 each, none idle; the causal LM's cross-attention (never fed) idle."""
    blocks = attention_blocks(tiny_prophetnet())
    assert sorted((b.kind, b.layer, b.n_heads, b.d_head, b.family.name, b.idle) for b in blocks) == sorted(
        [("enc_self", i, 4, 8, "prophetnet-attention", False) for i in (0, 1)]
        + [("dec_cross", i, 4, 8, "prophetnet-attention", False) for i in (0, 1)]
        + [("dec_self", i, 4, 8, "prophetnet", False) for i in (0, 1)])
    decoder = attention_blocks(tf.ProphetNetForCausalLM(_config()).eval())
    assert sorted((b.kind, b.layer, b.idle) for b in decoder) == \
        sorted([("dec_self", i, False) for i in (0, 1)] + [("dec_cross", i, True) for i in (0, 1)])


def test_float64_takes_integer_masks():
    """Regression: in float64, transformers' ProphetNet gives NaN on an integer padding mask; once headlab made its
    blocks, the logits are finite and equal those of the same mask in float64 (bit for bit: what transformers computes
    with a float mask), encoder and decoder masks both; float32 is left alone."""
    torch.manual_seed(0)
    plain = tf.ProphetNetForConditionalGeneration(_config()).double().eval()
    batch = {**inputs(), "decoder_attention_mask": torch.ones(2, 5, dtype=torch.long)}
    floats = {**batch, "attention_mask": batch["attention_mask"].double(),
              "decoder_attention_mask": batch["decoder_attention_mask"].double()}
    reference = logits(plain, floats)
    assert torch.isfinite(reference).all()
    attention_blocks(plain)
    assert torch.equal(logits(plain, batch), reference)
    assert torch.equal(logits(plain, floats), reference)
    single = tf.ProphetNetForConditionalGeneration(_config()).eval()
    attention_blocks(single)
    assert type(single.prophetnet.encoder).forward is not tf.ProphetNetEncoder.forward
    torch.testing.assert_close(logits(single, batch), logits(single.double(), floats).float(), atol=1e-5, rtol=0)


def test_padded_targets_refused_before_the_decoder_runs():
    """Regression: transformers' predicting streams gather their relative-position scores in an order that follows
    the padded length, so a right-padded target row's logits differ from the row alone (checked here, without
    headlab); the decoder refuses a padded target batch before it runs, naming the fix. Targets of one length give
    each row's logits alone (1e-12), padded sources too, and so does cached greedy generation of a padded batch."""
    model, batch = tiny_prophetnet(), inputs()
    padded = {**batch, "decoder_attention_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])}
    alone = {"input_ids": batch["input_ids"][1:, :5], "decoder_input_ids": batch["decoder_input_ids"][1:, :3]}
    plain = tf.ProphetNetForConditionalGeneration(_config()).double().eval()
    plain.load_state_dict(model.state_dict())
    floats = {**padded, "attention_mask": padded["attention_mask"].double(),
              "decoder_attention_mask": padded["decoder_attention_mask"].double()}
    assert not torch.allclose(logits(plain, floats)[1, :3], logits(plain, alone)[0], atol=1e-6, rtol=0)
    calls: list = []
    model.prophetnet.decoder.layers[0].register_forward_pre_hook(lambda *_: calls.append(1))
    with pytest.raises(HeadlabError, match=r"row 1 is padded \(3 of 5 positions\).*--batch-size 1"):
        logits(model, padded)
    assert not calls
    whole = {"input_ids": batch["input_ids"][1:, :5], "decoder_input_ids": batch["decoder_input_ids"][1:]}
    torch.testing.assert_close(logits(model, batch)[1], logits(model, whole)[0], atol=1e-12, rtol=0)
    sources = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    kwargs = dict(max_new_tokens=5, do_sample=False, num_beams=1, use_cache=True, output_scores=True,
                  return_dict_in_generate=True)
    with torch.no_grad():
        both = model.generate(**sources, **kwargs)
        one = model.generate(input_ids=batch["input_ids"][1:, :5], **kwargs)
    assert torch.equal(both.sequences[1], one.sequences[0])
    torch.testing.assert_close(torch.stack(both.scores)[:, 1], torch.stack(one.scores)[:, 0], atol=1e-12, rtol=0)


def test_logits_come_from_the_first_predicting_stream():
    """What the analysis rests on, read in ProphetNetForConditionalGeneration.forward: the next-token logits are the
    LM head of the first predicting stream, not of the main stream (whose map is the one analysed; it reaches them
    through every layer's keys and values)."""
    model, batch = tiny_prophetnet(), inputs()
    with torch.no_grad():
        out = model(**batch, output_hidden_states=True)
        streams = model.prophetnet(**batch).last_hidden_state_ngram
    torch.testing.assert_close(out.logits, model.lm_head(streams[:, :5]), atol=1e-14, rtol=0)
    assert not torch.allclose(out.logits, model.lm_head(out.decoder_hidden_states[-1]))


def test_capture_equals_the_modules_probabilities():
    """Capture on a padded batch: the encoder's and the cross-attention's maps equal the softmax of the scores
    ``output_attentions`` returns (what the module's forward takes its softmax of), the cross-attention's main-stream
    rows; the decoder's the main stream's probabilities; bit for bit, rows summing to one."""
    model, batch = tiny_prophetnet(), inputs()
    with torch.no_grad():
        out = model(**batch, output_attentions=True)
        with capture_attention(model) as record:
            model(**batch)
    assert sorted(record) == sorted((kind, layer) for kind in KINDS for layer in (0, 1))
    for layer in (0, 1):
        assert out.cross_attentions[layer].shape[2] == 3 * 5  # [main | predicting 1 | predicting 2] x 5 tokens
        assert torch.equal(record[("enc_self", layer)], out.encoder_attentions[layer].softmax(-1))
        assert torch.equal(record[("dec_cross", layer)], out.cross_attentions[layer].softmax(-1)[:, :, :5])
        assert torch.equal(record[("dec_self", layer)], out.decoder_attentions[layer])
        for kind in KINDS:
            torch.testing.assert_close(record[(kind, layer)].sum(-1), torch.ones(2, 4, record[(kind, layer)].shape[2],
                                       dtype=torch.float64), atol=1e-6, rtol=0)
    assert torch.equal(record[("enc_self", 0)][1, :, :, 5:], torch.zeros(4, 7, 2, dtype=torch.float64))


def _zero_values(model, kind: str, layer: int, head: int) -> None:
    if kind == "enc_self":
        attention = model.prophetnet.encoder.layers[layer].self_attn
    else:
        decoder = model.prophetnet.decoder.layers[layer]
        attention = decoder.cross_attn if kind == "dec_cross" else decoder.self_attn
    with torch.no_grad():
        attention.value_proj.weight[head * 8:(head + 1) * 8] = 0
        attention.value_proj.bias[head * 8:(head + 1) * 8] = 0


@pytest.mark.parametrize("kind", KINDS)
def test_masking_equals_zeroing_the_values(kind):
    """Masking head 2 of layer 1 changes the logits, comes off cleanly, and equals zeroing the head's value rows by
    hand (its output 0 in every stream: the decoder self-attention's output projection runs on the main stream's heads
    and on the predicting streams', both masked) to 1e-12."""
    model, batch = tiny_prophetnet(), inputs()
    before = logits(model, batch)
    with mask_heads(model, {(kind, 1): [2]}):
        masked = logits(model, batch)
    assert torch.equal(logits(model, batch), before)
    _zero_values(model, kind, 1, 2)
    reference = logits(model, batch)
    assert not torch.allclose(reference, before)
    torch.testing.assert_close(masked, reference, atol=1e-12, rtol=0)


def test_masking_reaches_the_predicting_streams():
    """A decoder self-attention head masked is gone from the predicting streams too: logits_ngram (the second
    predicting stream's, which the first's logits never see) equal those with its values zeroed."""
    model, batch = tiny_prophetnet(), inputs()
    with torch.no_grad(), mask_heads(model, {("dec_self", 0): [1]}):
        masked = model(**batch).logits_ngram
    _zero_values(model, "dec_self", 0, 1)
    with torch.no_grad():
        torch.testing.assert_close(masked, model(**batch).logits_ngram, atol=1e-12, rtol=0)


def test_gates_at_one_change_nothing():
    from support.family_matrix import check_gates_at_one_change_nothing

    check_gates_at_one_change_nothing(tiny_prophetnet(), inputs())


def test_hard_concrete_gates_draw_once_per_call_for_every_stream():
    """In training, a Hard Concrete gate of a decoder self-attention head is drawn once per call of the attention, and
    that one sample scales the head's output in the main stream and in the predicting streams (out_proj's two runs):
    the pass equals one with constant gates at the drawn values."""
    from support.family_matrix import check_gates_draw_once_per_call

    check_gates_draw_once_per_call(tiny_prophetnet(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0), inputs())


SPECS = {
    "partial": {("enc_self", 0): [1], ("enc_self", 1): [0, 2], ("dec_self", 0): [1], ("dec_self", 1): [0, 3],
                ("dec_cross", 1): [0, 1, 2]},
    "no head left": {("enc_self", 0): [0, 1, 2, 3], ("dec_self", 0): [0, 1, 2, 3], ("dec_self", 1): [2],
                     ("dec_cross", 0): [0, 1, 2, 3], ("dec_cross", 1): [2]},
}
"""Pruning plans of the three kinds ({(kind, layer): heads removed}): "no head left" empties a layer of each, the
decoder's first self-attention layer among them (the decoder reads the next position from its cache's length)."""


@pytest.mark.parametrize("spec_name", SPECS)
def test_pruned_equals_masked(spec_name):
    """Heads of the three kinds pruned (a layer of each emptied in "no head left"): the logits of the padded batch (two
    teacher-forced targets of one length) and cached greedy generation equal the masked model's (1e-12). Before
    session 43 the decoder self-attention's pruning was refused."""
    from support.seq2seq_families import check_pruned_equals_masked

    check_pruned_equals_masked(tiny_prophetnet(), SPECS[spec_name], inputs())


@pytest.mark.parametrize("spec_name", SPECS)
def test_pruned_reloads(spec_name, tmp_path):
    """The pruned directory loads with load_pruned and with plain transformers (trust_remote_code: its pruned layers
    take PRUNED_FORWARDS["prophetnet-attention"] and ["prophetnet"], the latter told its kept heads by the plan's
    score_heads) and gives the masked model's logits and cached greedy tokens. (Float
    masks: plain transformers' ProphetNet gives NaN in float64 on integer ones.)"""
    from support.seq2seq_families import check_pruned_reloads

    batch = inputs()
    batch["attention_mask"] = batch["attention_mask"].double()
    check_pruned_reloads(tiny_prophetnet(), SPECS[spec_name], batch, tmp_path / "pruned",
                         {"prophetnet-attention", "prophetnet"})


def test_predicting_streams_scores_are_not_their_own():
    """Why padded targets are refused and a pruned decoder self-attention computes these scores for the config's heads,
    read in transformers 5.24
    (get_predict_relative_pos_embeddings): the relative-position scores it adds for head h of predicting stream n at
    position t are not the projection of that stream's hidden state at t with head h's rows (gathered with t's
    buckets), but another (position, stream, head)'s, in an order that follows the head count and the length. Should
    transformers fix it, this fails: the refusal and the pruned forward's detour can then be revisited."""
    attention = tiny_prophetnet().prophetnet.decoder.layers[0].self_attn
    batch, length, ngram, buckets, heads = 2, 5, 2, 8, 4
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(batch, length, ngram, 32, dtype=torch.float64, generator=g)
    bucket = torch.randint(0, buckets, (batch, length, 2 * length), generator=g)
    weights = torch.zeros(batch, ngram, heads, length, 2 * length, dtype=torch.float64)
    with torch.no_grad():
        theirs = attention.get_predict_relative_pos_embeddings(hidden, weights, None, bucket)
        projected = attention.relative_pos_embeddings(hidden).view(batch, length, ngram, buckets, heads)
    own = torch.stack([torch.stack([torch.stack([projected[b, :, n, :, h].gather(1, bucket[b]) for h in range(heads)])
                                    for n in range(ngram)]) for b in range(batch)])
    assert theirs.shape == own.shape and not torch.allclose(theirs, own)


def test_pruned_layer_reads_every_heads_relative_position_rows():
    """The decoder self-attention pruned: relative_pos_embeddings stays whole and the layer knows its kept heads in the
    config's numbering (SCORE_HEADS_ATTR), its logits the masked model's (1e-12); the removed heads' rows of
    relative_pos_embeddings are read (set to zero, the logits move): the predicting streams' scores of a kept head are
    gathered from other heads' rows too, so a projection narrowed to the kept heads' rows could not be exact."""
    from headlab import prune_heads
    from headlab.portable_code import SCORE_HEADS_ATTR

    spec, batch = {("dec_self", 0): [0, 2]}, inputs()
    model = tiny_prophetnet()
    with mask_heads(model, spec):
        expected = logits(model, batch)
    prune_heads(model, spec)
    attention = model.prophetnet.decoder.layers[0].self_attn
    assert attention.relative_pos_embeddings.out_features == 8 * 4 and attention.num_attn_heads == 2
    assert getattr(attention, SCORE_HEADS_ATTR) == [1, 3]
    torch.testing.assert_close(logits(model, batch), expected, atol=1e-12, rtol=0)
    removed_rows = torch.tensor([bucket * 4 + h for bucket in range(8) for h in (0, 2)])  # [bucket, head] row-major
    with torch.no_grad():
        attention.relative_pos_embeddings.weight[removed_rows] = 0
        attention.relative_pos_embeddings.bias[removed_rows] = 0
    assert (logits(model, batch) - expected).abs().max() > 1e-6


def test_capture_of_a_pruned_decoder_self_attention_is_its_kept_heads_maps():
    """Capture on the padded batch after pruning the decoder's second self-attention layer: its maps are the whole
    model's maps of the heads it kept (main stream; the softmax is float32 in transformers' and the pruned forward:
    1e-6), numbered as in the original model."""
    from headlab import prune_heads
    from headlab.surgery import original_heads

    model, batch = tiny_prophetnet(), inputs()
    with torch.no_grad(), capture_attention(model) as whole:
        model(**batch)
    prune_heads(model, {("dec_self", 1): [0, 2]})
    with torch.no_grad(), capture_attention(model) as pruned:
        model(**batch)
    block = next(b for b in attention_blocks(model) if b.key == ("dec_self", 1))
    assert original_heads(block) == ([1, 3], 4)
    torch.testing.assert_close(pruned[("dec_self", 1)], whole[("dec_self", 1)][:, [1, 3]], atol=1e-6, rtol=0)


def test_decoder_self_attention_pruned_twice_equals_masked():
    """Pruned again (current numbering: the kept heads renumbered from 0), the layer's kept heads in the config's
    numbering follow: the logits and cached generation equal the model with both removals masked (1e-12)."""
    from headlab import prune_heads
    from headlab.portable_code import SCORE_HEADS_ATTR
    from support.seq2seq_families import cached_generation

    batch, reference = inputs(), tiny_prophetnet()
    with mask_heads(reference, {("dec_self", 0): [0, 2], ("dec_self", 1): [1]}):
        expected = logits(reference, batch)
        tokens, scores = cached_generation(reference, batch)
    model = tiny_prophetnet()
    prune_heads(model, {("dec_self", 0): [0]})
    prune_heads(model, {("dec_self", 0): [1], ("dec_self", 1): [1]})
    assert getattr(model.prophetnet.decoder.layers[0].self_attn, SCORE_HEADS_ATTR) == [1, 3]
    torch.testing.assert_close(logits(model, batch), expected, atol=1e-12, rtol=0)
    pruned_tokens, pruned_scores = cached_generation(model, batch)
    assert torch.equal(pruned_tokens, tokens)
    torch.testing.assert_close(pruned_scores, scores, atol=1e-12, rtol=0)


def test_reconstructed_numbering_of_a_pruned_decoder_self_attention_is_refused(tmp_path):
    """Re-saved without record or plan (load_pruned, then save_pretrained), a pruned decoder self-attention's kept
    heads would be numbered 0, 1 from the weights' shapes, and would take another head's relative-position scores
    (its kept heads' numbers pick them from the config's): the load is refused, naming the layer and what to put
    back; through the record it loads."""
    from headlab import load_pruned, prune_heads, save_pruned
    from headlab.loading import load_model
    from headlab.portable import PRUNING_FILE

    model = tiny_prophetnet()
    prune_heads(model, {("dec_self", 1): [0, 2]})
    save_pruned(model, tmp_path / "pruned")
    load_pruned(tmp_path / "pruned").save_pretrained(tmp_path / "resaved")
    with pytest.raises(HeadlabError, match="numbering of the kept heads of dec_self:1 is in neither the weights nor the "
                                           f"config.*relative-position scores.*{PRUNING_FILE}"):
        load_model(str(tmp_path / "resaved"))
    (tmp_path / "resaved" / PRUNING_FILE).write_bytes((tmp_path / "pruned" / PRUNING_FILE).read_bytes())
    batch = inputs()
    torch.testing.assert_close(logits(load_model(str(tmp_path / "resaved"), dtype=torch.float64), batch),
                               logits(model, batch), atol=1e-12, rtol=0)


def test_causal_lm_pruned_equals_masked():
    """ProphetNetForCausalLM (the decoder alone): its self-attention pruned, the first layer emptied, gives the masked
    model's logits of a batch of one length and its cached greedy continuation (1e-12)."""
    from headlab import prune_heads

    torch.manual_seed(0)
    model = tf.ProphetNetForCausalLM(_config()).double().eval()
    spec = {("dec_self", 0): [0, 1, 2, 3], ("dec_self", 1): [1, 2]}
    ids = torch.randint(3, 99, (2, 5), generator=torch.Generator().manual_seed(2))

    def run():
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, use_cache=True,
                                 output_scores=True, return_dict_in_generate=True, pad_token_id=PAD)
            return model(input_ids=ids).logits, out.sequences, torch.stack(out.scores)

    with mask_heads(model, spec):
        expected, tokens, scores = run()
    prune_heads(model, spec)
    assert [b.n_heads for b in attention_blocks(model) if b.kind == "dec_self"] == [0, 2]
    pruned, pruned_tokens, pruned_scores = run()
    torch.testing.assert_close(pruned, expected, atol=1e-12, rtol=0)
    assert torch.equal(pruned_tokens, tokens)
    torch.testing.assert_close(pruned_scores, scores, atol=1e-12, rtol=0)


def test_gates_at_one_change_nothing_after_pruning():
    """Heads of the three kinds pruned: gates at one on the heads left change nothing (the decoder's first
    self-attention emptied too), and a Hard Concrete gate of a pruned decoder self-attention head is drawn once per
    call for every stream (every layer keeping heads: one with none draws no gate)."""
    from headlab import prune_heads
    from support.family_matrix import check_gates_at_one_change_nothing, check_gates_draw_once_per_call

    for spec_name in SPECS:
        model = tiny_prophetnet(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
        prune_heads(model, SPECS[spec_name])
        check_gates_at_one_change_nothing(model, inputs())
        if spec_name == "partial":
            check_gates_draw_once_per_call(model, inputs())


def _lrp_conservation(model) -> dict:
    """compute_lrp (one sentence per batch) on the model's own greedy translations of three sources: the
    conservation record."""
    from headlab.importance import compute_lrp
    from support.seq2seq_families import translated_data

    data, info = translated_data(model, eos=1)
    return compute_lrp(model, data, info, bootstrap=0, batch_size=1).signature["conservation"]


@pytest.mark.parametrize("pruned", [False, True], ids=["whole", "pruned"])
def test_lrp_conserves(pruned):
    """LRP (biases and norms offset from their initial values) conserves every sentence's logit to 1e-10 in float64,
    encoder and cross-attention heads pruned too: the attention rule holds the decoder self-attention's
    relative-position scores constant with its queries and keys (mixer_rules.prophetnet: without, 2.4e-4 is lost on
    this model), the logit is the first predicting stream's, and the relevance reaching the predicting streams' rows of
    the decoder's first layer (learned embeddings, no tokens) is kept as a bias's (LEARNED_STREAMS). Before session
    41's rule, refused."""
    from headlab import prune_heads
    from support.lrp_families import offset_biases_and_norms

    model = tiny_prophetnet()
    torch.manual_seed(3)
    offset_biases_and_norms(model)
    if pruned:
        prune_heads(model, SPECS["partial"])
    record = _lrp_conservation(model)
    assert record["n_sentences"] == 3 and record["n_outside"] == 0, record
    assert abs(record["with_biases"]["min"] - 1) < 1e-10 and abs(record["with_biases"]["max"] - 1) < 1e-10, record


def test_lrp_counts_the_predicting_streams_as_constants():
    """The relevance reaching the decoder's first layer is split: its tokens' rows are input embeddings, its
    predicting streams' rows a constant's share (kept with the biases'): the input embeddings' share is less than
    with every row counted as input (0.88 on this model), the total one either way."""
    import headlab.importance.lrp as lrp
    from support.lrp_families import offset_biases_and_norms

    model = tiny_prophetnet()
    torch.manual_seed(3)
    offset_biases_and_norms(model)
    split = _lrp_conservation(model)
    streams = dict(lrp.LEARNED_STREAMS)
    lrp.LEARNED_STREAMS.clear()
    try:
        whole = _lrp_conservation(model)
    finally:
        lrp.LEARNED_STREAMS.update(streams)
    for record in (split, whole):
        assert abs(record["with_biases"]["mean"] - 1) < 1e-10, record
    assert whole["embeddings"]["mean"] > split["embeddings"]["mean"] + 0.5, (whole, split)


def test_analyze_end_to_end(tmp_path, capsys):
    """``headlab analyze --ablation --batch-size 1`` on a saved tiny ProphetNet (float32, a word tokenizer with Marian's
    special ids): every stage done, LRP included, but pruning and the figures; the examples' decoder
    self-attention causal. (With batches of several sentences, a stage that pads targets is refused: see
    test_padded_targets_refused_before_the_decoder_runs.)"""
    import numpy as np

    from headlab.report.examples import load_example
    from support.family_matrix import ANALYZE_STAGES, analyze, treebank_files
    from support.treebank import word_tokenizer

    model = tiny_prophetnet(pad_token_id=0, bos_token_id=1, eos_token_id=1, decoder_start_token_id=1).float()
    word_tokenizer(treebank_files(tmp_path), style="marian").save_pretrained(tmp_path / "model")
    model.save_pretrained(tmp_path / "model")
    code, stages = analyze(tmp_path / "model", tmp_path, "--batch-size", "1")
    assert code == 0, capsys.readouterr().err
    for name in (*ANALYZE_STAGES, "lrp"):
        assert stages[name]["status"] == "done", stages[name]
    examples = sorted((tmp_path / "out").rglob("sentence-*.json"))
    assert examples
    for path in examples:
        _, attention = load_example(path)
        assert {kind for kind, _ in attention} == set(KINDS)
        for (kind, _), maps in attention.items():
            if kind == "dec_self":
                assert maps.shape[-1] > 1 and np.triu(maps.sum(0), k=1).sum() == 0


def test_causal_lm_analyze_end_to_end(tmp_path, capsys):
    """``headlab analyze --ablation --batch-size 1`` on a saved ProphetNetForCausalLM (the decoder alone, its
    cross-attention idle): every stage done, LRP included, but pruning and the figures."""
    from support.family_matrix import ANALYZE_STAGES, analyze, save_tiny, treebank_files

    torch.manual_seed(0)
    save_tiny(tf.ProphetNetForCausalLM(_config()).eval(), tmp_path / "model", treebank_files(tmp_path))
    code, stages = analyze(tmp_path / "model", tmp_path, "--batch-size", "1")
    assert code == 0, capsys.readouterr().err
    for name in (*ANALYZE_STAGES, "lrp"):
        assert stages[name]["status"] == "done", stages[name]


def test_analyze_refuses_batches_of_several_sentences_before_any_work(tmp_path, capsys):
    """Before, ``headlab analyze`` without ``--batch-size 1`` loaded the model and failed in its first stage that
    batched two targets of different lengths; now exit 2 before any stage, naming the option."""
    from support.family_matrix import analyze, treebank_files
    from support.treebank import word_tokenizer

    model = tiny_prophetnet(pad_token_id=0, bos_token_id=1, eos_token_id=1, decoder_start_token_id=1).float()
    word_tokenizer(treebank_files(tmp_path), style="marian").save_pretrained(tmp_path / "model")
    model.save_pretrained(tmp_path / "model")
    with pytest.raises(FileNotFoundError):  # no manifest: no stage began
        analyze(tmp_path / "model", tmp_path, "--batch-size", "4")
    err = capsys.readouterr().err
    assert "headlab analyze: error: --batch-size 4: ProphetNet's decoder runs one sentence per batch" in err, err
    assert "give --batch-size 1" in err


def test_importance_refuses_batches_of_several_sentences_before_the_weights_load(tmp_path, capsys):
    """``headlab importance`` likewise, from config.json: exit 2 naming the option, nothing written."""
    from headlab.cli import main
    from support.family_matrix import treebank_files
    from support.treebank import word_tokenizer

    model = tiny_prophetnet(pad_token_id=0, bos_token_id=1, eos_token_id=1, decoder_start_token_id=1).float()
    word_tokenizer(treebank_files(tmp_path), style="marian").save_pretrained(tmp_path / "model")
    model.save_pretrained(tmp_path / "model")
    code = main(["importance", str(tmp_path / "model"), "--source", str(tmp_path / "text.txt"), "--method",
                 "confidence", "--out", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "--batch-size 32: ProphetNet's decoder runs one sentence per batch" in err and "loading" not in err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
