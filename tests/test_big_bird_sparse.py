"""BigBird's block-sparse attention (its config's default) as a table family (refused before any work until session 40).

Read in transformers 5.24 (models/big_bird, headlab.adapters.big_bird): in evaluation mode the random blocks are not
drawn, each is the first block, so a middle query's softmax counts the first block's keys 1 + num_random_blocks times
(two forwards are equal: the map is a function of the input); transformers' dense map overwrites those entries instead
of adding them. On tiny float64 models (block_size 2, num_random_blocks 1 and 2, inputs longer than
(5 + 2 r) x block_size, lengths the model pads to a multiple of block_size, padded batches):

* capture equals the map worked out by hand from the layer's queries and keys (each block's keys, repeats counted;
  tests/support/big_bird.py), whose product with the values is the forward's context; transformers' own map is not
  that map; a map read otherwise (random blocks elsewhere) is refused; the paper's lengths (1024) read the same;
* inputs on which transformers would swap the attention modules for full ones (too short), or on which a sentence's
  block layout would differ from its own (padded past its last block, padded on the left), are refused before the
  forward runs, the modules left as they are (under accelerate's dispatch hooks too); a model already switched is
  refused by attention_blocks; a block-sparse decoder before any work;
* masking a head equals zeroing its value rows, gates at one change nothing, physical pruning equals masking (a layer
  with no head left too), and so do load_pruned and plain transformers on the saved directory;
* LRP (queries and keys held constant) conserves relevance to 1e-10 bias-free, compute_lrp to 1e-9 with biases,
  pruned too;
* functions and aggregate run on sentences long enough; `headlab analyze` runs every stage one sentence per batch,
  and refuses a source of short sentences before any work;
* BigBird-Pegasus (refused whole until session 40): its encoder's attention BigBird's (block-sparse or full), its
  decoder's BART's: capture, masking, pruning (cached generation too) and reloads, short sources refused, LRP.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from headlab import HeadlabError, attention_blocks, capture_attention, load_pruned, mask_heads, prune_heads, save_pruned
from headlab.data.inputs import ImportanceData
from headlab.importance.lrp import compute_lrp
from headlab.model_description import describe_model
from support.big_bird import by_hand, dense_maps, long_treebank
from support.family_matrix import check_gates_at_one_change_nothing, perturbed_model
from support.seq2seq_families import SPECS as PEGASUS_SPECS
from support.seq2seq_families import (
    check_captured_probabilities,
    check_masking_equals_zeroed,
    check_pruned_equals_masked,
    check_translated_lrp_conserves,
    seq2seq_inputs,
    zero_value_rows,
)

BLOCK = 2


def _config(random_blocks: int = 1, **extra) -> tf.BigBirdConfig:
    return tf.BigBirdConfig(**{**dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                                      num_attention_heads=4, max_position_embeddings=64, block_size=BLOCK,
                                      num_random_blocks=random_blocks, attention_type="block_sparse",
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2, sep_token_id=3), **extra})


def _model(random_blocks: int = 1, cls=tf.BigBirdForMaskedLM, **extra) -> torch.nn.Module:
    return perturbed_model(cls, _config(random_blocks, **extra), attn_implementation="eager").double()


def _threshold(random_blocks: int) -> int:
    return (5 + 2 * random_blocks) * BLOCK


def _inputs(random_blocks: int = 1, odd: bool = False) -> dict:
    """Three rows of threshold + 4 tokens, the last one's last token padding (its own length rounds up to the same
    number of blocks); ``odd``: threshold + 3, none padding (the model pads them by one to a multiple of 2)."""
    length = _threshold(random_blocks) + (3 if odd else 4)
    ids = torch.randint(4, 99, (3, length), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    if not odd:
        mask[2, -1:] = 0
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


@pytest.mark.parametrize("odd", [False, True], ids=["padded batch", "padded by the model"])
@pytest.mark.parametrize("random_blocks", [1, 2])
def test_capture_is_the_weights_the_forward_applied(random_blocks, odd):
    model = _model(random_blocks)
    inputs = _inputs(random_blocks, odd)
    seen: dict[int, tuple] = {}
    hooks = [layer.attention.self.register_forward_hook(
        lambda module, args, output, i=i: seen.__setitem__(i, (args[0], args[2], output)))
        for i, layer in enumerate(model.bert.encoder.layer)]
    with torch.no_grad():
        first = model(**inputs).logits
        assert torch.equal(model(**inputs).logits, first)  # evaluation mode: no random draw
    for hook in hooks:
        hook.remove()
    length = inputs["input_ids"].shape[1]
    with capture_attention(model) as record, torch.no_grad():
        model(**inputs)
    assert sorted(record) == [("enc_self", 0), ("enc_self", 1)]
    for layer in range(2):
        hidden, from_mask, (context, theirs) = seen[layer]
        core = model.bert.encoder.layer[layer].attention.self
        real = from_mask[:, 0, :, 0]
        with torch.no_grad():
            reference = by_hand(core, hidden, real)
            values = core.value(hidden).view(*hidden.shape[:2], 4, -1).transpose(1, 2)
        # the by-hand map is the forward's: its product with the values is the context (padded queries' zeroed)
        torch.testing.assert_close((reference @ values).transpose(1, 2).flatten(2), context, rtol=0, atol=1e-13)
        captured = record[("enc_self", layer)]
        assert captured.shape == (3, 4, length, length)  # (odd) cut back from the padded length + 1
        torch.testing.assert_close(captured, reference[:, :, :length, :length], rtol=0, atol=1e-14)
        sums = captured.sum(-1).permute(0, 2, 1)[inputs["attention_mask"].bool()]
        torch.testing.assert_close(sums, torch.ones_like(sums), rtol=0, atol=1e-13)
        # transformers' own map: the first block's columns of the middle rows undercounted (rows sum to less)
        assert (theirs.sum(-1)[0, :, BLOCK:-BLOCK] < 1 - 1e-3).all()


def test_a_padded_sentence_equals_itself_alone():
    """What the guard lets through: padding within a sentence's last block changes nothing of its logits."""
    model, inputs = _model(), _inputs()
    attention_blocks(model)  # the guard installed
    length = inputs["input_ids"].shape[1]
    with torch.no_grad():
        batch = model(**inputs).logits[2, :length - 1]
        alone = model(input_ids=inputs["input_ids"][2:, :length - 1]).logits[0]
    torch.testing.assert_close(batch, alone, rtol=0, atol=1e-12)


def _unchanged(model) -> bool:
    return model.bert.attention_type == "block_sparse" and all(
        type(layer.attention.self).__name__ == "BigBirdBlockSparseAttention" for layer in model.bert.encoder.layer)


def test_short_inputs_are_refused_before_transformers_swaps_the_modules():
    model = _model()
    attention_blocks(model)
    short = torch.randint(4, 99, (1, _threshold(1)))
    with pytest.raises(HeadlabError, match=r"given 14 tokens: on inputs of at most 14 tokens .* switches every layer"):
        model(input_ids=short)
    assert _unchanged(model)


def test_the_guard_holds_under_accelerates_hooks():
    """A model dispatched by accelerate (device_map) has its forwards replaced on the instance, calling the class's
    forward bound before: the guard wraps that one too (without, the short input swapped the modules)."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    model = _model()
    add_hook_to_module(model.bert, ModelHook())
    attention_blocks(model)
    with pytest.raises(HeadlabError, match="given 14 tokens"):
        model(input_ids=torch.randint(4, 99, (1, _threshold(1))))
    assert _unchanged(model)
    attention_blocks(model)  # once: installed again, the guard is not stacked
    with torch.no_grad():
        model(**_inputs())


@pytest.mark.parametrize("padding", ["past its last block", "left", "short row"])
def test_batches_that_change_a_sentences_blocks_are_refused(padding):
    """A row padded past its last block attends otherwise than alone (its last block is no longer global), so does a
    left-padded row (its blocks shifted), and a row short enough that alone it would run full attention."""
    model = _model()
    attention_blocks(model)
    inputs = _inputs()
    mask = inputs["attention_mask"]
    if padding == "past its last block":
        mask[1, -2:] = 0
    elif padding == "left":
        mask[1, :1] = 0
    else:
        mask[1, _threshold(1) - 2:] = 0
    words = {"past its last block": "sentence 1 has 16 of its 18 tokens", "left": "padded on the left",
             "short row": "sentence 1 has 12 of its 18 tokens"}[padding]
    with pytest.raises(HeadlabError, match=words):
        model(**inputs)
    assert _unchanged(model)


def test_a_model_switched_by_an_earlier_short_input_is_refused():
    model = _model()
    with torch.no_grad():
        model(input_ids=torch.randint(4, 99, (1, 6)))  # transformers swaps the modules, for good
    with pytest.raises(HeadlabError, match="switched its attention modules for good"):
        attention_blocks(model)


def test_a_block_sparse_decoder_is_refused_before_any_work():
    model = _model(cls=tf.BigBirdForCausalLM, is_decoder=True)
    with pytest.raises(HeadlabError, match="BigBird as a decoder"):
        attention_blocks(model)


def _zero_values(model, layer: int, head: int) -> None:
    core = model.bert.encoder.layer[layer].attention.self
    rows = slice(head * core.attention_head_size, (head + 1) * core.attention_head_size)
    with torch.no_grad():
        core.value.weight[rows] = 0
        core.value.bias[rows] = 0


def test_masking_equals_zeroed_values_and_gates_at_one_change_nothing():
    model, inputs = _model(), _inputs()
    with torch.no_grad():
        before = model(**inputs).logits
        with mask_heads(model, {("enc_self", 0): [2]}):
            masked = model(**inputs).logits
        assert not torch.allclose(masked, before)
        assert torch.equal(model(**inputs).logits, before)  # the mask came off
        zeroed = _model()
        _zero_values(zeroed, 0, 2)
        torch.testing.assert_close(masked, zeroed(**inputs).logits, rtol=0, atol=1e-12)
    check_gates_at_one_change_nothing(model, inputs)


SPECS = {
    "partial": ({("enc_self", 0): [1], ("enc_self", 1): [0, 2]}, [3, 2]),
    "no head left": ({("enc_self", 0): [0, 1, 2, 3], ("enc_self", 1): [2]}, [0, 3]),
}


@pytest.mark.parametrize("random_blocks", [1, 2])
@pytest.mark.parametrize("spec_name", SPECS)
def test_pruned_equals_masked(spec_name, random_blocks):
    model, inputs = _model(random_blocks), _inputs(random_blocks)
    spec, heads_left = SPECS[spec_name]
    with torch.no_grad(), mask_heads(model, spec):
        expected = model(**inputs).logits
    prune_heads(model, spec)
    assert [block.n_heads for block in attention_blocks(model)] == heads_left
    core = model.bert.encoder.layer[1].attention.self
    assert core.query.weight.shape == (8 * heads_left[1], 32) and core.num_attention_heads == heads_left[1]
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, expected, atol=1e-12, rtol=0)


def test_pruned_layer_captures_its_kept_heads():
    model, inputs = _model(), _inputs()
    with capture_attention(model) as full, torch.no_grad():
        model(**inputs)
    prune_heads(model, SPECS["partial"][0])
    with capture_attention(model) as pruned, torch.no_grad():
        model(**inputs)
    torch.testing.assert_close(pruned[("enc_self", 0)], full[("enc_self", 0)][:, [0, 2, 3]], atol=1e-14, rtol=0)


@pytest.mark.parametrize("spec_name", SPECS)
def test_pruned_reloads(spec_name, tmp_path):
    model, inputs = _model(), _inputs()
    spec, heads_left = SPECS[spec_name]
    with torch.no_grad(), mask_heads(model, spec):
        expected = model(**inputs).logits
    prune_heads(model, spec)
    save_pruned(model, tmp_path)
    reloaded = load_pruned(tmp_path).double()
    assert [block.n_heads for block in attention_blocks(reloaded)] == heads_left
    plain, info = tf.AutoModelForMaskedLM.from_pretrained(tmp_path, trust_remote_code=True, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**inputs).logits, expected, atol=1e-12, rtol=0)
        torch.testing.assert_close(plain.eval().double()(**inputs).logits, expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("spec_name", [None, *SPECS])
def test_compute_lrp_conserves(spec_name):
    """compute_lrp (biases on; sentences of 16, 17 and 18 ids, one batch padded within its last block) conserves
    every logit to 1e-9."""
    model = _model()
    if spec_name:
        prune_heads(model, SPECS[spec_name][0])
    g = torch.Generator().manual_seed(0)
    data = ImportanceData.from_ids([torch.randint(4, 99, (k,), generator=g).tolist() for k in (17, 18, 18)])
    record = compute_lrp(model, data, describe_model(model), bootstrap=0).signature["conservation"]
    assert record["n_outside"] == 0, record
    assert abs(record["with_biases"]["min"] - 1) < 1e-9 and abs(record["with_biases"]["max"] - 1) < 1e-9, record


# BigBird-Pegasus (refused whole until session 40): its encoder's attention is BigBird's (block-sparse by default, or
# full), its decoder's BART's. Sources of 18 ids (the second's last one padding: its blocks stay the batch's) and
# target prefixes of 5, on a tiny float64 model; with full attention, support.seq2seq_families' 7-token batch.
def _pegasus(attention_type: str = "block_sparse") -> torch.nn.Module:
    config = tf.BigBirdPegasusConfig(vocab_size=99, d_model=32, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=37,
                                     decoder_ffn_dim=37, max_position_embeddings=64, block_size=BLOCK,
                                     num_random_blocks=1, attention_type=attention_type, pad_token_id=0,
                                     bos_token_id=2, eos_token_id=1, decoder_start_token_id=0, use_bias=True)
    return perturbed_model(tf.BigBirdPegasusForConditionalGeneration, config, attn_implementation="eager").double()


def _pegasus_inputs(attention_type: str = "block_sparse") -> dict:
    if attention_type != "block_sparse":
        return seq2seq_inputs(pad=0)
    inputs = _inputs()
    inputs = {"input_ids": inputs["input_ids"][:2], "attention_mask": inputs["attention_mask"][:2]}
    inputs["attention_mask"][1, -1] = 0
    inputs["input_ids"][1, -1] = 0
    inputs["decoder_input_ids"] = torch.randint(4, 99, (2, 5), generator=torch.Generator().manual_seed(4))
    return inputs


def _zero_pegasus_head(model, kind: str, layer: int, head: int) -> None:
    if kind != "enc_self":
        zero_value_rows(model, kind, layer, head)
        return
    value = model.model.encoder.layers[layer].self_attn.self.value
    with torch.no_grad():
        value.weight[head * 8:(head + 1) * 8] = 0
        value.bias[head * 8:(head + 1) * 8] = 0


ATTENTION_TYPES = ["block_sparse", "original_full"]


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
def test_pegasus_blocks_and_capture(attention_type):
    """Its six blocks (the encoder's BigBird's, the decoder's BART's); capture gives the encoder's maps worked out by
    hand (block-sparse) or transformers' own (full), and the decoder's and cross-attention's output_attentions."""
    model, inputs = _pegasus(attention_type), _pegasus_inputs(attention_type)
    blocks = attention_blocks(model)
    encoder = "bigbird_pegasus-block-sparse" if attention_type == "block_sparse" else "bigbird_pegasus-full"
    assert sorted((b.kind, b.layer, b.n_heads, b.d_head, b.family.name) for b in blocks) == sorted(
        [("enc_self", i, 4, 8, encoder) for i in (0, 1)] +
        [(kind, i, 4, 8, "bigbird_pegasus-decoder") for kind in ("dec_self", "dec_cross") for i in (0, 1)])
    if attention_type == "block_sparse":
        reference = dense_maps(model, inputs)
        check_captured_probabilities(model, inputs, encoder=lambda out: reference, atol=1e-14)
    else:
        check_captured_probabilities(model, inputs)


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
@pytest.mark.parametrize("kind", ["enc_self", "dec_cross"])
def test_pegasus_masking_equals_zeroed_values(kind, attention_type):
    model = _pegasus(attention_type)
    check_masking_equals_zeroed(model, kind, _pegasus_inputs(attention_type), zero_head=_zero_pegasus_head)
    check_gates_at_one_change_nothing(_pegasus(attention_type), _pegasus_inputs(attention_type))


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
@pytest.mark.parametrize("spec_name", PEGASUS_SPECS)
def test_pegasus_pruned_equals_masked_and_reloads(spec_name, attention_type, tmp_path):
    """The logits of the padded batch and cached greedy generation, pruned, equal the masked model's (1e-12), and so do
    load_pruned and plain transformers (trust_remote_code) on the saved directory."""
    spec, inputs = PEGASUS_SPECS[spec_name], _pegasus_inputs(attention_type)
    counts = check_pruned_equals_masked(_pegasus(attention_type), spec, inputs)
    model = _pegasus(attention_type)
    with torch.no_grad(), mask_heads(model, spec):
        expected = model(**inputs).logits
    prune_heads(model, spec)
    save_pruned(model, tmp_path)  # no pruned forward: the plan resizes the layers only
    reloaded = load_pruned(tmp_path).double()
    assert {b.key: b.n_heads for b in attention_blocks(reloaded)} == counts
    plain, info = tf.AutoModelForSeq2SeqLM.from_pretrained(tmp_path, trust_remote_code=True, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**inputs).logits, expected, atol=1e-12, rtol=0)
        torch.testing.assert_close(plain.eval().double()(**inputs).logits, expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("attention_type", ATTENTION_TYPES)
def test_pegasus_short_sources_and_lrp(attention_type):
    """Block-sparse: a source too short is refused before the encoder swaps its modules; compute_lrp on the model's
    own translations of sources of 19 and 20 ids (one batch, padded within its last block) conserves every logit to
    1e-9. Full attention: compute_lrp on translations of 3, 6 and 9 ids."""
    from headlab.importance import translate_data

    model = _pegasus(attention_type)
    if attention_type == "original_full":
        check_translated_lrp_conserves(model, eos=1)
        return
    attention_blocks(model)
    with pytest.raises(HeadlabError, match="given 7 tokens"):
        model(**seq2seq_inputs(pad=0))
    assert all(type(layer.self_attn.self).__name__ == "BigBirdPegasusBlockSparseAttention"
               for layer in model.model.encoder.layers)
    g = torch.Generator().manual_seed(0)
    info = describe_model(model)
    data = ImportanceData.from_ids([torch.randint(4, 99, (k,), generator=g).tolist() + [1] for k in (18, 19, 19)])
    data = translate_data(model, data, info, max_length_a=0, max_length_b=6)
    record = compute_lrp(model, data, info, bootstrap=0).signature["conservation"]
    assert record["n_sentences"] == 3 and record["n_outside"] == 0, record
    assert abs(record["with_biases"]["min"] - 1) < 1e-9 and abs(record["with_biases"]["max"] - 1) < 1e-9, record


def test_a_map_read_otherwise_is_refused(monkeypatch):
    """The reader's assumption (random blocks all block 0 in evaluation mode) checked on every map: with random blocks
    drawn elsewhere (block 3, as a transformers drawing them in evaluation mode might), the rows it builds do not sum
    to one, and capture refuses instead of handing out a wrong map."""
    from transformers.models.big_bird import modeling_big_bird

    original = modeling_big_bird.BigBirdBlockSparseAttention._bigbird_block_rand_mask_with_head

    def elsewhere(self, *args, **kwargs):
        return [blocks + 3 for blocks in original(self, *args, **kwargs)]

    monkeypatch.setattr(modeling_big_bird.BigBirdBlockSparseAttention, "_bigbird_block_rand_mask_with_head", elsewhere)
    model, inputs = _model(), _inputs()
    with pytest.raises(HeadlabError, match="has a query's row summing to 1 "), capture_attention(model), \
            torch.no_grad():
        model(**inputs)


def test_functions_and_aggregate_run_on_sentences_long_enough(tmp_path):
    """analyze_heads (functions and aggregate, the fused engine falling back to eager capture: the core does not
    dispatch) on sentences of 20 tokens writes its results; on the sample treebank's short sentences it refuses with
    the guard's reason."""
    import numpy as np

    from headlab.data.frequencies import TokenFrequencies
    from headlab.functions import AnalysisConfig, analyze_heads
    from support.treebank import SAMPLE_CONLLU
    from test_fused_statistics import word_tokenizer

    model = _model(pad_token_id=0, bos_token_id=3, eos_token_id=1, sep_token_id=1)
    tokenizer = word_tokenizer()
    frequencies = TokenFrequencies(np.arange(tokenizer.vocab_size, dtype=np.int64) % 5 + 1, "hand-set")
    config = AnalysisConfig(batch_size=3, top_frequent=3, window=4, top_k=3)
    long_treebank(tmp_path / "long.conllu", words=18)  # 20 tokens with <s> and </s>
    result = analyze_heads(model, tokenizer, tmp_path / "long.conllu", config=config, frequencies=frequencies)
    assert result.results
    (tmp_path / "short.conllu").write_text(SAMPLE_CONLLU, encoding="utf-8")
    with pytest.raises(HeadlabError, match="transformers runs full attention instead"):
        analyze_heads(model, tokenizer, tmp_path / "short.conllu", config=config, frequencies=frequencies)
    assert _unchanged(model)


def test_the_papers_lengths_read_the_same():
    """On 1024 tokens (one of the paper's lengths, 1024, 3072 and 4096) transformers draws its random blocks by its
    old plan (_bigbird_block_rand_mask), all block 0 in evaluation mode too: capture equals the by-hand map."""
    model = _model(max_position_embeddings=1024, block_size=16)
    ids = torch.randint(4, 99, (1, 1024), generator=torch.Generator().manual_seed(5))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    reference = dense_maps(model, inputs)
    with capture_attention(model) as record, torch.no_grad():
        model(**inputs)
    for layer in range(2):
        torch.testing.assert_close(record[("enc_self", layer)], reference[layer], rtol=0, atol=1e-14)


def test_analyze_end_to_end_one_sentence_per_batch(tmp_path, capsys):
    """headlab analyze --ablation --batch-size 1 on a saved block-sparse BigBird, its source sentences of 20 and 23
    tokens and its treebank's of 20: every stage done (one sentence per batch: no padding changes a sentence's
    blocks); with the default batch size the importance stages fail, naming the sentence padded past its blocks."""
    import json

    from headlab.cli import main
    from support.family_matrix import save_tiny

    long_treebank(tmp_path / "tb.conllu", words=18)
    texts = [line[len("# text = "):] for line in (tmp_path / "tb.conllu").read_text().splitlines()
             if line.startswith("# text = ")]
    texts = [text + (" the old dog" if i % 2 else "") for i, text in enumerate(texts)]
    (tmp_path / "text.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
    save_tiny(_model().float(), tmp_path / "bb", sorted({w for text in texts for w in text.split()}), "bert")

    def analyze(out: str, *extra: str) -> tuple[int, dict]:
        code = main(["analyze", str(tmp_path / "bb"), "--source", str(tmp_path / "text.txt"), "--conllu",
                     str(tmp_path / "tb.conllu"), "--out", str(tmp_path / out), "--skip", "figures", "--no-progress",
                     "--attention-sentences", "2", "--ablation", *extra])
        manifest = json.loads((tmp_path / out / "manifest.json").read_text())
        return code, {stage["name"]: stage for stage in manifest["stages"]}

    code, stages = analyze("one", "--batch-size", "1")
    assert code == 0, capsys.readouterr().err
    assert {name for name, stage in stages.items() if stage["status"] != "done"} == {"prune", "figures"}, stages
    capsys.readouterr()
    code, stages = analyze("batched")
    assert code == 1
    assert stages["confidence"]["status"] == "failed" and stages["functions"]["status"] == "done"
    captured = capsys.readouterr()
    assert "would attend otherwise than alone" in captured.out + captured.err


def test_analyze_refuses_short_sources_before_any_work(tmp_path, capsys):
    """Every sentence of at most the threshold's tokens would be refused by the guard whatever its batch: `headlab
    analyze` refuses the run once, naming the lines, before the first stage's work (before, every stage failed in turn
    on the first short sentence)."""
    from headlab.cli import main
    from support.family_matrix import save_tiny, treebank_files

    words = treebank_files(tmp_path)  # text.txt: the sample treebank's sentences, 6 to 11 tokens
    save_tiny(_model().float(), tmp_path / "bb", words, "bert")
    code = main(["analyze", str(tmp_path / "bb"), "--source", str(tmp_path / "text.txt"), "--out",
                 str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("lines 1, 2, 3, 4 have at most 14 tokens") == 1 and "running" not in err.split("error:")[-1]
    assert not (tmp_path / "out" / "manifest.json").exists()


@pytest.mark.parametrize("random_blocks", [1, 2])
def test_lrp_conserves_to_1e10_bias_free(random_blocks):
    """On a bias-free copy (Linear weights at unit gain), the relevance reaching layer 0's input sums to the explained
    logit to 1e-10: the queries and keys held constant, the block-sparse weights (the first block's keys counted
    1 + r times) weigh the values linearly."""
    from headlab.capture import eager_attention
    from headlab.importance.rules import lrp_rules

    model, inputs = _model(random_blocks), _inputs(random_blocks)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.zero_()
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0, module.in_features ** -0.5)
    seen: list[torch.Tensor] = []
    handle = model.bert.encoder.layer[0].register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    try:
        with torch.enable_grad(), eager_attention(model), lrp_rules(model):
            out = model(**inputs).logits
            z = out[2, 5, out[2, 5].argmax()]  # the padded row's
            grad, = torch.autograd.grad(z, [seen[0]])
    finally:
        handle.remove()
    torch.testing.assert_close((seen[0].detach() * grad).sum(), z.detach(), rtol=1e-10, atol=1e-10)
