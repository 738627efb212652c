"""The checks the table-family test files share: families whose attention computes its own softmax outside
transformers' attention interface, each with an adapter-table entry (tests/test_neo_megatron_git.py,
test_rembert_roformer_xglm.py, test_mpnet_openai_gpt.py, test_xlm_flaubert_tapas.py, test_deberta_ibert_convbert.py).

Every check works on the tiny models of tests/support/family_matrix.py (2 layers, 4 heads of 8, vocab 99, pad id 2)
and on :func:`~support.family_matrix.padded_inputs` with ``pad_id=2``; a family's own references (where its value
heads sit, which class plain transformers loads) are the caller's. To adopt them in a new family's file:

* the pruning plans: ``@pytest.mark.parametrize("spec_name", SPECS)`` and ``spec, heads_left = table_spec(kind,
  spec_name)`` (head 1 of layer 0 and heads 0, 2 of layer 1; or layer 0 emptied, a layer with no head left);
* :func:`check_pruned_equals_masked` (float64, 1e-12), :func:`check_pruned_reloads_as_masked` (save_pruned,
  load_pruned and plain transformers' ``AutoModelForMaskedLM`` or the class given, 1e-5),
  :func:`check_pruned_generates_and_reloads` (a causal LM: cached greedy generation too, then its reloads);
* :func:`check_captured_probabilities` (capture equals ``output_attentions``), :func:`check_masking_equals_zeroed`
  (masking a head of layer 1 equals zeroing its values by hand);
* :func:`check_compute_lrp_conserves` (compute_lrp with biases, padded sentences, to 1e-9 in float64),
  :func:`check_decoder_prunes_and_conserves` (a BERT-like family built as a decoder);
* :func:`check_old_mask_buffers_load` (a checkpoint that still holds buffers transformers now rebuilds).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from support.family_matrix import (
    check_lrp_conserves,
    check_pruned_generates_as_masked,
    check_pruned_reloads,
    padded_inputs,
    padded_logits,
)

SPECS = {
    "partial": ({0: [1], 1: [0, 2]}, [3, 2]),
    "no head left": ({0: [0, 1, 2, 3], 1: [2]}, [0, 3]),
}
"""The two pruning plans, by name: the heads removed per layer, and the heads each layer keeps."""


def table_spec(kind: str, spec_name: str) -> tuple[dict, list[int]]:
    """``SPECS[spec_name]`` for blocks of ``kind``: the spec ``{(kind, layer): heads}`` and the heads left per layer."""
    layers, heads_left = SPECS[spec_name]
    return {(kind, layer): heads for layer, heads in layers.items()}, heads_left


def check_pruned_equals_masked(model, spec: dict, heads_left: list[int] | None, *, skip_idle: bool = False,
                               atol: float = 1e-12) -> None:
    """Prunes ``model`` by ``spec``: its blocks keep ``heads_left`` heads (unchecked when None; ``skip_idle``: counted
    over the blocks token ids run, GIT's image encoder left out), and its logits on the padded batch are the masked
    model's within ``atol``."""
    from headlab import attention_blocks, mask_heads, prune_heads

    ids, mask = padded_inputs(pad_id=2)
    with mask_heads(model, spec):
        expected = padded_logits(model, ids, mask)
    prune_heads(model, spec)
    if heads_left is not None:
        assert [b.n_heads for b in attention_blocks(model) if not (skip_idle and b.idle)] == heads_left
    torch.testing.assert_close(padded_logits(model, ids, mask), expected, atol=atol, rtol=0)


def check_pruned_reloads_as_masked(model, spec: dict, heads_left: list[int], directory, auto=None) -> None:
    """Prunes ``model`` by ``spec`` and saves it to ``directory`` (portable by remote code): ``load_pruned`` and plain
    transformers (``auto``, ``AutoModelForMaskedLM`` by default, ``trust_remote_code``, every weight loaded, none
    reshaped) give the masked model's logits on the padded batch, within 1e-5."""
    import json

    import transformers as tf

    from headlab import attention_blocks, load_pruned, mask_heads, prune_heads, save_pruned

    ids, mask = padded_inputs(pad_id=2)
    with mask_heads(model, spec):
        expected = padded_logits(model, ids, mask)
    prune_heads(model, spec)
    save_pruned(model, directory)
    assert json.loads((directory / "headlab_pruning.json").read_text())["portable"]["how"] == "remote code"
    reloaded = load_pruned(directory)
    assert [b.n_heads for b in attention_blocks(reloaded)] == heads_left
    torch.testing.assert_close(padded_logits(reloaded, ids, mask), expected, atol=1e-5, rtol=0)
    plain, info = (auto or tf.AutoModelForMaskedLM).from_pretrained(directory, trust_remote_code=True,
                                                                     output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    torch.testing.assert_close(padded_logits(plain.eval(), ids, mask), expected, atol=1e-5, rtol=0)


def check_pruned_generates_and_reloads(model, spec: dict, heads_left: list[int], directory) -> None:
    """A causal LM pruned by ``spec`` equals the masked one, also in greedy generation
    (:func:`~support.family_matrix.check_pruned_generates_as_masked`), and so does the directory saved to
    ``directory``, loaded by load_pruned and by plain transformers (:func:`~support.family_matrix.check_pruned_reloads`)."""
    ids, mask = padded_inputs(pad_id=2)
    expected, tokens = check_pruned_generates_as_masked(model, spec, heads_left, ids, mask)
    check_pruned_reloads(model, directory, heads_left, ids, mask, expected, tokens)


def check_captured_probabilities(model, kind: str, *, atol: float | None = None) -> None:
    """What capture reads on the padded batch equals transformers' own ``output_attentions`` at layers 0 and 1:
    bit for bit, and no other block captured, when ``atol`` is None; else within ``atol``, compared in float64."""
    from headlab import capture_attention

    ids, mask = padded_inputs(pad_id=2)
    with torch.no_grad():
        reference = model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    with torch.no_grad(), capture_attention(model) as record:
        model(input_ids=ids, attention_mask=mask)
    if atol is None:
        assert sorted(record) == [(kind, 0), (kind, 1)]
    for layer in (0, 1):
        if atol is None:
            assert torch.equal(record[(kind, layer)], reference[layer]), layer
        else:
            torch.testing.assert_close(record[(kind, layer)].double(), reference[layer], atol=atol, rtol=0)


def check_masking_equals_zeroed(build: Callable[[], torch.nn.Module], kind: str,
                                zero_head: Callable[[torch.nn.Module, int, int], None],
                                logits: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
    """For each head of layer 1, on a fresh ``build()``: masking it changes the ``logits(model, ids, mask)`` of the
    padded batch, leaves them as they were once the mask is off, and equals (to 1e-12) zeroing its values by hand,
    ``zero_head(model, layer, head)`` (the family's layout, read off its modeling code, not headlab's table)."""
    from headlab import mask_heads

    ids, mask = padded_inputs(pad_id=2)
    for head in range(4):
        model = build()
        before = logits(model, ids, mask)
        with mask_heads(model, {(kind, 1): [head]}):
            masked = logits(model, ids, mask)
        assert torch.equal(logits(model, ids, mask), before)  # the mask came off
        zero_head(model, 1, head)
        reference = logits(model, ids, mask)
        assert not torch.allclose(reference, before)
        torch.testing.assert_close(masked, reference, atol=1e-12, rtol=0)


def check_compute_lrp_conserves(model) -> None:
    """compute_lrp (biases on, three padded sentences of 3, 6 and 9 random ids) conserves every sentence's logit to
    1e-9 (``model`` in float64), none outside compute_lrp's tolerance."""
    from headlab.data.inputs import ImportanceData
    from headlab.importance.lrp import compute_lrp
    from headlab.model_description import describe_model

    g = torch.Generator().manual_seed(0)
    data = ImportanceData.from_ids([torch.randint(3, 99, (k,), generator=g).tolist() for k in (3, 6, 9)])
    record = compute_lrp(model, data, describe_model(model), bootstrap=0).signature["conservation"]
    assert record["n_outside"] == 0, record
    assert abs(record["with_biases"]["min"] - 1) < 1e-9 and abs(record["with_biases"]["max"] - 1) < 1e-9, record


def check_decoder_prunes_and_conserves(build: Callable[[], torch.nn.Module], layer: str) -> None:
    """A BERT-like family built as a decoder (``build()``: its ForCausalLM with is_decoder): two dec_self blocks,
    pruned equal to masked in cached generation with a layer left without heads, and a fresh one in float64
    conserving relevance to 1e-10 at ``layer`` (the path of its first layer)."""
    from headlab import attention_blocks

    model = build()
    assert [b.kind for b in attention_blocks(model)] == ["dec_self", "dec_self"]
    ids, mask = padded_inputs(pad_id=2)
    spec, heads_left = table_spec("dec_self", "no head left")
    check_pruned_generates_as_masked(model, spec, heads_left, ids, mask)
    model = build().double()
    check_lrp_conserves(model, model.get_submodule(layer), rtol=1e-10, atol=1e-10)


def check_old_mask_buffers_load(model, directory, buffers: dict[str, torch.Tensor]) -> None:
    """``model`` saved to ``directory`` with a GPT-2 style word tokenizer, ``buffers`` (name: tensor, what an old
    checkpoint held and transformers now rebuilds) added to its weights: headlab's loader loads it, and its logits on
    the padded batch are ``model``'s, bit for bit."""
    from safetensors.torch import load_file, save_file

    from headlab.loading import load_model
    from support.family_matrix import save_tiny

    save_tiny(model, directory, ["the", "a", "cat"], "gpt2")
    weights = load_file(directory / "model.safetensors")
    weights.update(buffers)
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    loaded = load_model(str(directory))
    ids, mask = padded_inputs(pad_id=2)
    assert torch.equal(padded_logits(loaded, ids, mask), padded_logits(model, ids, mask))
