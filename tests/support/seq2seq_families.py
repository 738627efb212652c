"""The checks the encoder-decoder table-family test files share: families whose attention computes its own softmax
outside transformers' attention interface (BART's old attention and its kin), each with an adapter-table entry and a
pruned forward of its own (tests/test_fsmt_trocr.py, test_mvp_prophetnet_pegasus_x.py, test_led.py, test_pegasus_x.py).

Every check works on a tiny model of tests/support/models.py (2 + 2 layers, 4 heads of 8, float64) and on a padded
batch with target prefixes: :func:`seq2seq_inputs`, or the family's own (LED's global tokens); a family's own
references (where its value heads sit, how its encoder's maps read from ``output_attentions``) are the caller's.
To adopt them in a new family's file:

* the pruning plans: ``@pytest.mark.parametrize("spec_name", SPECS)`` (a few heads of each kind; or whole layers of
  each kind emptied, a layer with no head left);
* :func:`check_blocks_are_bart_layout`, :func:`check_captured_probabilities` (capture equals ``output_attentions``),
  :func:`check_masking_equals_zeroed` (masking head 2 of layer 1 equals zeroing its values by hand);
* :func:`check_pruned_equals_masked` (the logits of the padded batch and cached greedy generation, 1e-12),
  :func:`check_pruned_reloads` (save_pruned, load_pruned and plain transformers' ``AutoModelForSeq2SeqLM``);
* :func:`check_translated_lrp_conserves` (compute_lrp on the model's own translations);
* :func:`check_analyze_end_to_end` (every stage of ``headlab analyze --ablation`` on the saved model).

Gates at one: :func:`support.family_matrix.check_gates_at_one_change_nothing`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from support.family_matrix import logits

KINDS = ("enc_self", "dec_self", "dec_cross")
SPECS = {
    "partial": {("enc_self", 0): [1], ("enc_self", 1): [0, 2], ("dec_self", 0): [3], ("dec_cross", 1): [0, 1, 2]},
    "no head left": {("enc_self", 0): [0, 1, 2, 3], ("dec_self", 1): [0, 1, 2, 3], ("dec_cross", 0): [0, 1, 2, 3],
                     ("dec_cross", 1): [2]},
}
"""The two pruning plans, by name ({(kind, layer): heads removed}); a family may have its own."""


def seq2seq_inputs(pad: int) -> dict:
    """Two sources of 7 random ids, the second padded at the end (its last two ids ``pad``), and two target prefixes
    of 5."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 99, (2, 7), generator=g)
    mask = torch.ones_like(ids)
    ids[1, 5:], mask[1, 5:] = pad, 0
    return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": torch.randint(3, 99, (2, 5), generator=g)}


def cached_generation(model, inputs: dict, steps: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy generation of exactly ``steps`` tokens with the cache (EncoderDecoderCache: the decoder's keys and
    values, the encoder's once) from the sources of ``inputs`` (every input but the target prefix: LED's global
    attention mask too): the sequences and the per-step scores."""
    sources = {name: value for name, value in inputs.items() if name != "decoder_input_ids"}
    with torch.no_grad():
        out = model.generate(**sources, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, num_beams=1,
                             use_cache=True, output_scores=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.scores)


def heads_left(spec: dict) -> dict:
    """The heads each of the six blocks keeps once ``spec`` is pruned, by key."""
    return {(kind, layer): 4 - len(spec.get((kind, layer), [])) for kind in KINDS for layer in (0, 1)}


def check_blocks_are_bart_layout(model, family: str) -> None:
    """The six blocks of BART's layout (``model.{encoder,decoder}.layers.N.{self_attn,encoder_attn}``), 4 heads of 8,
    each of ``family``'s entry, none idle."""
    from headlab import attention_blocks

    blocks = attention_blocks(model)
    assert sorted((b.kind, b.layer, b.n_heads, b.d_head, b.family.name, b.idle) for b in blocks) == \
        sorted((kind, layer, 4, 8, family, False) for kind in KINDS for layer in (0, 1))
    assert {b.name for b in blocks} == {f"model.encoder.layers.{i}.self_attn" for i in (0, 1)} | \
        {f"model.decoder.layers.{i}.{n}" for i in (0, 1) for n in ("self_attn", "encoder_attn")}


def check_captured_probabilities(model, inputs: dict, *, encoder: Callable[[object], Sequence[torch.Tensor]] | None = None,
                                 atol: float | None = None) -> dict:
    """What capture reads on ``inputs`` is the six blocks' maps and equals transformers' own ``output_attentions``
    (``encoder_attentions``, or ``encoder(output)`` for a family whose encoder returns them otherwise; the decoder's
    and the cross-attention's): bit for bit when ``atol`` is None, else within ``atol`` in float64. The record back."""
    from headlab import capture_attention

    with torch.no_grad():
        out = model(**inputs, output_attentions=True)
    references = (out.encoder_attentions if encoder is None else encoder(out), out.decoder_attentions,
                  out.cross_attentions)
    with torch.no_grad(), capture_attention(model) as record:
        model(**inputs)
    assert sorted(record) == sorted((kind, layer) for kind in KINDS for layer in (0, 1))
    for layer in (0, 1):
        for kind, theirs in zip(KINDS, references):
            if atol is None:
                assert torch.equal(record[(kind, layer)], theirs[layer]), (kind, layer)
            else:
                torch.testing.assert_close(record[(kind, layer)].double(), theirs[layer], atol=atol, rtol=0)
    return record


def zero_value_rows(model, kind: str, layer: int, head: int) -> None:
    """BART's layout, read off its modeling code: head ``head``'s rows of ``v_proj`` (weights and bias) zeroed at
    ``layer`` of ``model.model``'s encoder (enc_self) or decoder (its self_attn, or encoder_attn for dec_cross)."""
    block = model.model.encoder.layers[layer] if kind == "enc_self" else model.model.decoder.layers[layer]
    v = (block.encoder_attn if kind == "dec_cross" else block.self_attn).v_proj
    with torch.no_grad():
        v.weight[head * 8:(head + 1) * 8] = 0
        v.bias[head * 8:(head + 1) * 8] = 0


def check_masking_equals_zeroed(model, kind: str, inputs: dict,
                                zero_head: Callable[[torch.nn.Module, str, int, int], None] = zero_value_rows) -> None:
    """Masking head 2 of layer 1 of ``kind`` changes the logits on ``inputs``, leaves them as they were once the mask
    is off, and equals (to 1e-12) zeroing its values by hand, ``zero_head(model, kind, layer, head)`` (its output is
    then 0)."""
    from headlab import mask_heads

    before = logits(model, inputs)
    with mask_heads(model, {(kind, 1): [2]}):
        masked = logits(model, inputs)
    assert torch.equal(logits(model, inputs), before)
    zero_head(model, kind, 1, 2)
    reference = logits(model, inputs)
    assert not torch.allclose(reference, before)
    torch.testing.assert_close(masked, reference, atol=1e-12, rtol=0)


def check_pruned_equals_masked(model, spec: dict, inputs: dict, steps: int = 6) -> dict:
    """``model`` (float64) pruned by ``spec`` keeps :func:`heads_left` heads and equals the masked model: the logits of
    ``inputs`` and greedy generation with the cache (:func:`cached_generation`), tokens and every step's scores, to
    1e-12. The heads left back."""
    from headlab import attention_blocks, mask_heads, prune_heads

    with mask_heads(model, spec):
        expected = logits(model, inputs)
        tokens, scores = cached_generation(model, inputs, steps)
    prune_heads(model, spec)
    counts = {b.key: b.n_heads for b in attention_blocks(model)}
    assert counts == heads_left(spec)
    torch.testing.assert_close(logits(model, inputs), expected, atol=1e-12, rtol=0)
    pruned_tokens, pruned_scores = cached_generation(model, inputs, steps)
    assert torch.equal(pruned_tokens, tokens)
    torch.testing.assert_close(pruned_scores, scores, atol=1e-12, rtol=0)
    return counts


def check_pruned_reloads(model, spec: dict, inputs: dict, directory, classes: set[str], steps: int = 6) -> None:
    """``model`` (float64) pruned by ``spec`` and saved to ``directory``, portable by remote code (the plan names the
    pruned forwards ``classes``): load_pruned and plain transformers (``AutoModelForSeq2SeqLM``, trust_remote_code,
    every weight loaded), both in float64, keep the same heads and give the masked model's logits of ``inputs`` (to
    1e-12) and its cached greedy tokens."""
    import json

    import transformers as tf

    from headlab import attention_blocks, load_pruned, mask_heads, prune_heads, save_pruned

    with mask_heads(model, spec):
        expected = logits(model, inputs)
        tokens, _ = cached_generation(model, inputs, steps)
    prune_heads(model, spec)
    counts = {b.key: b.n_heads for b in attention_blocks(model)}
    save_pruned(model, directory)
    record = json.loads((directory / "headlab_pruning.json").read_text())
    assert record["portable"]["how"] == "remote code"
    plan = json.loads((directory / "config.json").read_text())["headlab_pruned"]
    assert set(plan.get("classes", {}).values()) == classes, plan.get("classes")
    reloaded = load_pruned(directory).double()
    assert {b.key: b.n_heads for b in attention_blocks(reloaded)} == counts
    torch.testing.assert_close(logits(reloaded, inputs), expected, atol=1e-12, rtol=0)
    assert torch.equal(cached_generation(reloaded, inputs, steps)[0], tokens)
    plain, info = tf.AutoModelForSeq2SeqLM.from_pretrained(directory, trust_remote_code=True, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    plain = plain.eval().double()
    torch.testing.assert_close(logits(plain, inputs), expected, atol=1e-12, rtol=0)
    assert torch.equal(cached_generation(plain, inputs, steps)[0], tokens)


def translated_data(model, eos: int):
    """Three sources of 3, 6 and 9 random ids and ``eos``, with ``model``'s own greedy translations (at most 6
    tokens): the data and the model's description."""
    from headlab.importance import ImportanceData, describe_model, translate_data

    info = describe_model(model)
    g = torch.Generator().manual_seed(0)
    data = ImportanceData.from_ids([torch.randint(3, 99, (k,), generator=g).tolist() + [eos] for k in (3, 6, 9)])
    return translate_data(model, data, info, max_length_a=0, max_length_b=6), info


def check_translated_lrp_conserves(model, eos: int, bar: float = 1e-9) -> None:
    """compute_lrp (biases on) on :func:`translated_data` conserves every sentence's logit to ``bar`` (1e-9 in
    float64; tests/test_importance_lrp_conservation.py's bar, 1e-6, in float32), none outside its tolerance."""
    from headlab.importance import compute_lrp

    data, info = translated_data(model, eos)
    record = compute_lrp(model, data, info, bootstrap=0).signature["conservation"]
    assert record["n_sentences"] > 0 and record["n_outside"] == 0, record
    assert abs(record["with_biases"]["min"] - 1) < bar and abs(record["with_biases"]["max"] - 1) < bar, record


def check_analyze_end_to_end(model, tmp_path, capsys) -> None:
    """Every stage of ``headlab analyze --ablation`` (:func:`support.family_matrix.analyze`) on ``model`` saved with a
    word tokenizer with Marian's special ids (pad 0, eos 1: the model's config must hold them) runs, LRP and
    ablation included, all but pruning and the figures done; the attention examples it writes hold causal decoder
    self-attention (no weight on a later token)."""
    import numpy as np

    from headlab.report.examples import load_example
    from support.family_matrix import analyze, treebank_files
    from support.treebank import word_tokenizer

    word_tokenizer(treebank_files(tmp_path), style="marian").save_pretrained(tmp_path / "model")
    model.save_pretrained(tmp_path / "model")
    code, stages = analyze(tmp_path / "model", tmp_path)
    assert code == 0, capsys.readouterr().err
    assert {name for name, stage in stages.items() if stage["status"] != "done"} <= {"prune", "figures"}, stages
    assert stages["lrp"]["status"] == "done" and stages["ablation"]["status"] == "done"
    examples = sorted((tmp_path / "out").rglob("sentence-*.json"))
    assert examples
    for path in examples:
        _, attention = load_example(path)
        for (kind, _), maps in attention.items():
            if kind == "dec_self":
                assert maps.shape[-1] > 1 and np.triu(maps.sum(0), k=1).sum() == 0
