"""LUKE (studio-ousia/luke-base's LukeForMaskedLM): a table family whose attention computes its own softmax outside
transformers' attention interface, over the words and, when entity_ids are given, the entities after them, and
returns its probabilities only when asked (``output_attentions``); before its entry it was refused before any work.

With ``use_entity_aware_attention`` (its default) and entities given, the query of each (word | entity) x (word |
entity) block comes from a projection of its own (``query``, ``w2e_query``, ``e2w_query``, ``e2e_query``), each viewed
per head as ``query`` is: a head owns its rows in all four. Keys and values serve every block, and the two streams'
contexts meet again in ``output.dense``. So, on each path with entities and without (headlab's own inputs have none):
capture equals transformers' ``output_attentions`` (a map over [words | entities]), masking a head equals zeroing its
value rows by hand (in float64), gates at one change nothing, pruning (a head; a whole layer, whose stand-in returns an
empty output for each stream) equals masking in float64 on a padded batch, all four query projections sliced per head,
and so does the directory save_pruned writes, loaded by load_pruned and by plain transformers (pruned_heads.py); LRP
conserves relevance (the block-wise query choice only picks which constant weights a query row gets: the four query
projections are held constant, as ``query`` is for BERT). headlab's text inputs (input_ids, attention_mask: no
entity) give the model's own forward on its own tokenizer's batch.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from headlab import attention_blocks, capture_attention, mask_heads, prune_heads, save_pruned
from support.family_matrix import (
    check_gates_at_one_change_nothing,
    check_lrp_conserves,
    padded_inputs,
    padded_logits,
    perturbed_model,
)
from support.table_families import (
    SPECS,
    check_captured_probabilities,
    check_compute_lrp_conserves,
    check_pruned_equals_masked,
    check_pruned_reloads_as_masked,
    table_spec,
)

QUERIES = ("query", "w2e_query", "e2w_query", "e2e_query")


def _config(**extra) -> tf.LukeConfig:
    return tf.LukeConfig(vocab_size=99, entity_vocab_size=20, entity_emb_size=8, hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=4, intermediate_size=37, max_position_embeddings=64, pad_token_id=2,
                         bos_token_id=0, eos_token_id=1, **extra)


def _luke(**extra) -> torch.nn.Module:
    return perturbed_model(tf.LukeForMaskedLM, _config(**extra), attn_implementation="eager")


def _entities() -> dict:
    """Two entities per row of padded_inputs' three (the third row's second entity padded), each on one or two word
    positions the row keeps (entity_position_ids: -1 past a mention's words)."""
    positions = torch.full((3, 2, 3), -1)
    positions[:, 0, :2] = torch.tensor([3, 4])
    positions[:, 1, 0] = torch.tensor([5, 1, 6])
    mask = torch.ones(3, 2, dtype=torch.long)
    mask[2, 1] = 0
    return {"entity_ids": torch.tensor([[4, 7], [9, 3], [11, 0]]), "entity_position_ids": positions,
            "entity_attention_mask": mask}


def _outputs(model, ids, mask, entities: dict | None) -> torch.Tensor:
    """The word logits the mask keeps, and with entities the entity logits their mask keeps after them."""
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, **(entities or {}))
    if entities is None:
        assert out.entity_logits is None
        return out.logits[mask.bool()]
    return torch.cat([out.logits[mask.bool()].flatten(), out.entity_logits[entities["entity_attention_mask"].bool()].flatten()])


WITH = {"words": None, "words and entities": _entities}


def test_blocks_are_the_table():
    """Two enc_self blocks of 4 heads of 8; the three entity-aware query projections are the heads' rows too, and
    absent from the entry where the config has none."""
    blocks = attention_blocks(_luke())
    assert [(b.kind, b.layer, b.n_heads, b.d_head, b.family.name) for b in blocks] == \
        [("enc_self", layer, 4, 8, "luke") for layer in (0, 1)]
    assert [path for path, _ in blocks[0].family.head_rows] == [f"self.{q}" for q in QUERIES[1:]]
    plain = attention_blocks(_luke(use_entity_aware_attention=False))
    assert [b.n_heads for b in plain] == [4, 4] and not plain[0].family.head_rows


def test_captured_probabilities_are_the_models_own():
    check_captured_probabilities(_luke().double(), "enc_self", atol=1e-12)


def test_captured_probabilities_with_entities_cover_words_then_entities():
    """With entities, capture's map is over [words | entities] (7 + 2), transformers' output_attentions to the bit."""
    model = _luke().double()
    ids, mask = padded_inputs(pad_id=2)
    entities = _entities()
    with torch.no_grad():
        reference = model(input_ids=ids, attention_mask=mask, output_attentions=True, **entities).attentions
    with torch.no_grad(), capture_attention(model) as record:
        model(input_ids=ids, attention_mask=mask, **entities)
    for layer in (0, 1):
        assert record[("enc_self", layer)].shape == (3, 4, 9, 9)
        assert torch.equal(record[("enc_self", layer)], reference[layer])


@pytest.mark.parametrize("inputs", WITH)
def test_masking_equals_zeroed_values(inputs):
    """Masking head h of layer 1 equals zeroing rows h*8..h*8+7 of its value projection (LukeSelfAttention's
    transpose_for_scores over num_attention_heads x attention_head_size; the values serve words and entities)."""
    ids, mask = padded_inputs(pad_id=2)
    entities = WITH[inputs]() if WITH[inputs] else None
    for head in range(4):
        model = _luke().double()
        before = _outputs(model, ids, mask, entities)
        with mask_heads(model, {("enc_self", 1): [head]}):
            masked = _outputs(model, ids, mask, entities)
        assert torch.equal(_outputs(model, ids, mask, entities), before)
        value = model.luke.encoder.layer[1].attention.self.value
        with torch.no_grad():
            value.weight[head * 8:(head + 1) * 8] = 0
            value.bias[head * 8:(head + 1) * 8] = 0
        reference = _outputs(model, ids, mask, entities)
        assert not torch.allclose(reference, before)
        torch.testing.assert_close(masked, reference, atol=1e-12, rtol=0)


def test_gates_at_one_change_nothing():
    ids, mask = padded_inputs(pad_id=2)
    check_gates_at_one_change_nothing(_luke(), {"input_ids": ids, "attention_mask": mask})


@pytest.mark.parametrize("inputs", WITH)
@pytest.mark.parametrize("spec_name", SPECS)
def test_pruned_equals_masked_in_float64(spec_name, inputs):
    """A head, and a whole layer: with entities the four query projections are sliced per head (a wrong row of
    w2e/e2w/e2e_query changes the entity blocks' weights), and a layer with no head left returns an empty output for
    the words and for the entities (LukeAttention concatenates them before output.dense)."""
    model = _luke().double()
    spec, heads_left = table_spec("enc_self", spec_name)
    ids, mask = padded_inputs(pad_id=2)
    entities = WITH[inputs]() if WITH[inputs] else None
    with mask_heads(model, spec):
        expected = _outputs(model, ids, mask, entities)
    prune_heads(model, spec)
    assert [b.n_heads for b in attention_blocks(model)] == heads_left
    for layer, left in enumerate(heads_left):
        if left:
            attention = model.luke.encoder.layer[layer].attention.self
            assert [getattr(attention, q).out_features for q in QUERIES] == [8 * left] * 4
    torch.testing.assert_close(_outputs(model, ids, mask, entities), expected, atol=1e-12, rtol=0)


def test_pruned_query_rows_are_the_kept_heads():
    """The kept heads' rows of every query projection, in order (head 1 of 4 removed: rows 0-7, 16-31)."""
    model = _luke()
    before = {q: getattr(model.luke.encoder.layer[0].attention.self, q).weight.detach().clone() for q in QUERIES}
    prune_heads(model, {("enc_self", 0): [1]})
    keep = torch.cat([torch.arange(0, 8), torch.arange(16, 32)])
    for q in QUERIES:
        assert torch.equal(getattr(model.luke.encoder.layer[0].attention.self, q).weight, before[q][keep]), q


def test_pruned_without_entity_aware_attention_equals_masked():
    check_pruned_equals_masked(_luke(use_entity_aware_attention=False).double(),
                               *table_spec("enc_self", "no head left"))


@pytest.mark.parametrize("spec_name", SPECS)
def test_pruned_reloads(spec_name, tmp_path):
    """save_pruned, load_pruned and plain transformers (pruned_heads.py), every weight loaded, none reshaped."""
    check_pruned_reloads_as_masked(_luke(), *table_spec("enc_self", spec_name), tmp_path)


def test_pruned_reloads_run_entities(tmp_path):
    """The saved directory, loaded by load_pruned and by plain transformers, runs entities as the masked model does
    (the stand-in of a layer with no head, pruned_heads.py's, returns an empty output for them too)."""
    from headlab import load_pruned

    model = _luke()
    spec, _ = table_spec("enc_self", "no head left")
    ids, mask = padded_inputs(pad_id=2)
    entities = _entities()
    with mask_heads(model, spec):
        expected = _outputs(model, ids, mask, entities)
    prune_heads(model, spec)
    save_pruned(model, tmp_path)
    torch.testing.assert_close(_outputs(load_pruned(tmp_path), ids, mask, entities), expected, atol=1e-5, rtol=0)
    plain = tf.AutoModelForMaskedLM.from_pretrained(tmp_path, trust_remote_code=True).eval()
    torch.testing.assert_close(_outputs(plain, ids, mask, entities), expected, atol=1e-5, rtol=0)


def test_lrp_conserves_in_float64():
    model = _luke().double()
    check_lrp_conserves(model, model.luke.encoder.layer[0], rtol=1e-10, atol=1e-10)


def test_lrp_with_entities_conserves_over_both_streams():
    """With entities (which headlab does not feed, but a LUKE runs on), the relevance of a word logit reaching the
    first layer's words and entities sums to it in float64: the entity-aware query projections are held constant (a
    rule missing on one of them leaks relevance through the softmax)."""
    from headlab.capture import eager_attention
    from headlab.importance.rules import lrp_rules

    model = _luke().double()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.zero_()
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    head: list[torch.Tensor] = []
    ids, mask = padded_inputs(pad_id=2)
    layer = model.luke.encoder.layer[0]
    handles = [layer.register_forward_pre_hook(lambda module, args: seen.append(args[:2])),
               model.get_output_embeddings().register_forward_hook(lambda module, args, output: head.append(output))]
    try:
        with torch.enable_grad(), eager_attention(model), lrp_rules(model):
            model(input_ids=ids[:1], attention_mask=mask[:1], **{k: v[:1] for k, v in _entities().items()})
            z = head[0][0, -1].max()
            words, entities = seen[0]
            grad_words, grad_entities = torch.autograd.grad(z, [words, entities])
    finally:
        for handle in handles:
            handle.remove()
    total = (words.detach() * grad_words).sum() + (entities.detach() * grad_entities).sum()
    assert (entities.detach() * grad_entities).abs().sum() > 0  # the entities do take relevance
    torch.testing.assert_close(total, z.detach(), rtol=1e-10, atol=1e-10)


def test_compute_lrp_conserves_with_biases_and_padding():
    check_compute_lrp_conserves(_luke().double())


def test_lrp_conserves_after_pruning():
    model = _luke().double()
    prune_heads(model, table_spec("enc_self", "no head left")[0])
    check_compute_lrp_conserves(model)


def _tokenizer() -> tf.LukeTokenizer:
    """A tiny LukeTokenizer: byte-level BPE over single letters, <s>, </s>, <pad> at the tiny config's ids 0, 1, 2."""
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["Ġ"]
    specials = {"<s>": 0, "</s>": 1, "<pad>": 2, "<unk>": 3, "<mask>": 4}
    vocab = {**specials, **{letter: 5 + i for i, letter in enumerate(letters)}}
    return tf.LukeTokenizer(vocab=vocab, merges=[])


def test_headlab_text_inputs_are_the_models_own_forward():
    """What headlab feeds LUKE from text (input_ids and attention_mask, padded with the config's pad id; no entity,
    no token type) gives the logits of LUKE's own tokenizer's batch, the tokenizer returning no entity input either."""
    from headlab.data.inputs import encode_texts, make_batches
    from headlab.model_description import describe_model

    model = _luke().double()
    tokenizer = _tokenizer()
    texts = ["a cat sat", "the dog ran far away", "hi"]
    encoded = tokenizer(texts, padding=True, return_tensors="pt")
    assert sorted(encoded) == ["attention_mask", "input_ids"]
    info = describe_model(model)
    data = encode_texts(tokenizer, info, texts)
    (batch,) = list(make_batches(data, info, batch_size=3))
    ids, mask = batch.inputs["input_ids"], batch.inputs["attention_mask"]
    assert sorted(batch.inputs) == ["attention_mask", "input_ids"]
    order = torch.tensor(batch.index)  # headlab's batch sorts the sentences by length
    assert torch.equal(ids[mask.bool()], encoded["input_ids"][order][encoded["attention_mask"][order].bool()])
    torch.testing.assert_close(padded_logits(model, ids, mask),
                               padded_logits(model, encoded["input_ids"][order], encoded["attention_mask"][order]),
                               atol=1e-12, rtol=0)



@pytest.mark.parametrize("cls", ["LukeForEntityClassification", "LukeForEntityPairClassification",
                                 "LukeForEntitySpanClassification"])
def test_entity_classifiers_are_refused_before_any_work(cls, tmp_path, capsys):
    """LUKE's entity classifiers read the entities' last hidden states, None without entity_ids: on headlab's text
    inputs their forward raised a TypeError mid-run ("internal error" after "computing confidence"); refused when
    loaded, naming why and how to analyse the base model, nothing written."""
    from headlab.cli import main

    config = _config(num_labels=3)
    config.architectures = [cls]
    perturbed_model(getattr(tf, cls), config, attn_implementation="eager").save_pretrained(tmp_path / "model")
    _tokenizer().save_pretrained(tmp_path / "model")
    (tmp_path / "source.txt").write_text("a cat sat\nthe dog ran\n")
    for argv in (["heads", str(tmp_path / "model")],
                 ["importance", str(tmp_path / "model"), "--source", str(tmp_path / "source.txt"),
                  "--out", str(tmp_path / "out"), "--method", "confidence"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"{cls}, which classifies entities" in err and "entity_ids" in err and "base_model" in err, err
    assert not (tmp_path / "out").exists()


def test_base_model_loads_prunes_and_reloads(tmp_path):
    """LukeModel (what the entity classifiers' refusal suggests saving): loaded as LukeModel, pruned equal to masked
    on its word and entity hidden states, and reloaded by load_pruned and plain transformers' AutoModel."""
    from headlab import load_pruned
    from headlab.loading import load_model

    config = _config()
    config.architectures = ["LukeModel"]
    perturbed_model(tf.LukeModel, config, attn_implementation="eager").save_pretrained(tmp_path / "base")
    model = load_model(str(tmp_path / "base"), dtype=torch.float64)
    assert type(model).__name__ == "LukeModel"
    spec, _ = table_spec("enc_self", "no head left")
    ids, mask = padded_inputs(pad_id=2)
    entities = _entities()

    def hidden(m):
        with torch.no_grad():
            out = m(input_ids=ids, attention_mask=mask, **entities)
        return torch.cat([out.last_hidden_state[mask.bool()].flatten(),
                          out.entity_last_hidden_state[entities["entity_attention_mask"].bool()].flatten()])

    with mask_heads(model, spec):
        expected = hidden(model)
    prune_heads(model, spec)
    torch.testing.assert_close(hidden(model), expected, atol=1e-12, rtol=0)
    save_pruned(model, tmp_path / "pruned")
    torch.testing.assert_close(hidden(load_pruned(tmp_path / "pruned").double()), expected, atol=1e-12, rtol=0)
    plain = tf.AutoModel.from_pretrained(tmp_path / "pruned", trust_remote_code=True, dtype=torch.float64).eval()
    torch.testing.assert_close(hidden(plain), expected, atol=1e-12, rtol=0)


def test_sequence_classifier_lrp_conserves():
    """LukeForSequenceClassification (its head reads the pooled first word: no entity needed) conserves too."""
    check_compute_lrp_conserves(perturbed_model(tf.LukeForSequenceClassification, _config(num_labels=3),
                                                attn_implementation="eager").double())
