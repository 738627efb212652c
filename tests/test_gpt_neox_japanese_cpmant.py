"""GPT-NeoX-Japanese as a table family, and CPM-Ant refused naming what is missing.

GPT-NeoX-Japanese: its attention computes its own softmax outside transformers' attention
interface (before its entry, refused before any work: "found no attention block").

GPTNeoXJapaneseAttention fuses q/k/v as GPT-NeoX does (``query_key_value`` viewed ``[.., heads, 3 * head_size]``:
head h's [q | k | v] together), rotates part of each head, and always returns ``(dense(heads), probs, dense_bias)``:
``dense`` has no bias, and ``dense_bias``, a vector in the LAST layer only (None in the others), is added by the layer
after the attention output. A last layer with no head left must still return it (Concat() W^O + b = b), and LRP must
count its relevance as a bias's. On a tiny model in float64: capture equals transformers' ``output_attentions``,
pruning (a head, a first or last layer emptied) equals masking on a padded batch, in cached greedy generation too, and
so does the directory save_pruned writes, loaded by load_pruned and by plain transformers (pruned_heads.py); the LRP
rules conserve relevance, biases and dense_bias counted, to 1e-9. The matrix checks (tests/test_more_families.py:
masking equals zeroed values, gates at one change nothing, the fused layout's value columns, analyze end to end) run
on it too.

CPM-Ant (before: "found no attention block") is refused before any work, naming its prompt tokens and its padding read
from the ids; what the refusal says of it is checked here on a tiny CpmAntForCausalLM, so that it stays true.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from headlab import HeadlabError, attention_blocks, prune_heads
from support.family_matrix import check_lrp_conserves, tiny_model
from support.table_families import (
    SPECS,
    check_captured_probabilities,
    check_compute_lrp_conserves,
    check_old_mask_buffers_load,
    check_pruned_equals_masked,
    check_pruned_generates_and_reloads,
    table_spec,
)

LAST_EMPTIED = ({("dec_self", 0): [2], ("dec_self", 1): [0, 1, 2, 3]}, [3, 0])
"""Layer 1, the one with dense_bias, left with no head."""
NEOX_SPECS = {**{name: table_spec("dec_self", name) for name in SPECS}, "last layer emptied": LAST_EMPTIED}


def _neox_japanese() -> torch.nn.Module:
    """The tiny GPT-NeoX-Japanese of the matrix, its dense_bias (zeros at init, 0.1 noise in tiny_model) drawn at
    unit scale: handing it back wrongly, or not counting its relevance, shows."""
    model = tiny_model("gpt_neox_japanese", attn_implementation="eager")
    with torch.no_grad():
        model.gpt_neox_japanese.layers[1].attention.dense_bias.normal_(0, 1)
    return model


def test_blocks_are_the_table():
    model = _neox_japanese()
    assert model.gpt_neox_japanese.layers[0].attention.dense_bias is None  # the last layer's only
    assert [(b.name, b.kind, b.n_heads, b.d_head, b.family.name) for b in attention_blocks(model)] == \
        [(f"gpt_neox_japanese.layers.{layer}.attention", "dec_self", 4, 8, "gpt-neox-japanese") for layer in (0, 1)]


def test_captured_probabilities_are_the_models_own():
    check_captured_probabilities(_neox_japanese().double(), "dec_self")


@pytest.mark.parametrize("spec_name", NEOX_SPECS)
def test_pruned_equals_masked_in_float64(spec_name):
    """Also with the last layer emptied: its stand-in returns dense_bias, which the layer adds (before, the pruned
    model's logits were 0.5 off the masked one's, and prune refused as not exact)."""
    check_pruned_equals_masked(_neox_japanese().double(), *NEOX_SPECS[spec_name])


@pytest.mark.parametrize("spec_name", NEOX_SPECS)
def test_pruned_generates_as_masked_and_reloads(spec_name, tmp_path):
    """Cached greedy generation, save_pruned, load_pruned and plain transformers (pruned_heads.py: the emptied last
    layer keeps dense_bias under its state_dict key, loaded, and returns it)."""
    check_pruned_generates_and_reloads(_neox_japanese(), *NEOX_SPECS[spec_name], tmp_path)


def test_lrp_conserves_in_float64():
    model = _neox_japanese().double()
    check_lrp_conserves(model, model.gpt_neox_japanese.layers[0], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("spec_name", [None, "last layer emptied"])
def test_compute_lrp_conserves_with_dense_bias(spec_name):
    """compute_lrp counts dense_bias's relevance as a bias's, returned by the attention or by a layer with no head
    left (before: not conserved, -0.04 of the logit unaccounted for, and refused)."""
    model = _neox_japanese().double()
    if spec_name:
        prune_heads(model, NEOX_SPECS[spec_name][0])
    check_compute_lrp_conserves(model)


def test_checkpoint_with_per_layer_rotary_buffers_loads(tmp_path):
    """abeja's checkpoint (2022) was saved when each attention kept its own RotaryEmbedding, whose inv_freq was a
    persistent buffer; transformers 5.24 computes it once in the model and drops such keys as unexpected
    (``rotary_emb.inv_freq``): headlab's loader loads it, the logits the model's own."""
    model = tiny_model("gpt_neox_japanese", attn_implementation="eager")
    inv_freq = model.gpt_neox_japanese.rotary_emb.inv_freq
    check_old_mask_buffers_load(model, tmp_path, {f"gpt_neox_japanese.layers.{i}.attention.rotary_emb.inv_freq":
                                                  inv_freq.clone() for i in range(2)})


def _cpmant() -> torch.nn.Module:
    config = tf.CpmAntConfig(vocab_size=99, hidden_size=32, num_attention_heads=4, dim_head=8, dim_ff=37,
                             num_hidden_layers=2, prompt_length=4)
    torch.manual_seed(0)
    return tf.CpmAntForCausalLM(config).eval()


def test_cpmant_is_refused_naming_its_prompts_and_padding():
    with pytest.raises(HeadlabError, match=r"is not supported: CPM-Ant prepends config.prompt_length learned prompt "
                                           r"tokens.*ignores attention_mask.*only on the left"):
        attention_blocks(_cpmant())


def test_what_the_cpmant_refusal_says_holds():
    """Its maps over the tokens lose what went to the prompts; attention_mask changes nothing, and only a row padded
    with id 0 on the left gives the unpadded row's logits."""
    model = _cpmant()
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        alone = model(input_ids=ids).logits
        maps = model(input_ids=ids, output_attentions=True).attentions
        left = model(input_ids=torch.tensor([[0, 0, 5, 6, 7]])).logits[:, 2:]
        right = model(input_ids=torch.tensor([[5, 6, 7, 0, 0]]), attention_mask=torch.tensor([[1, 1, 1, 0, 0]]))
        unmasked = model(input_ids=torch.tensor([[5, 6, 7, 0, 0]])).logits
    assert maps[0].shape == (1, 4, 3, 3) and bool((maps[0].sum(-1) < 1 - 1e-3).any())
    torch.testing.assert_close(left, alone, atol=1e-5, rtol=0)
    assert not torch.allclose(right.logits[:, :3], alone, atol=1e-3)
    assert torch.equal(right.logits, unmasked)  # the mask is a dummy
