"""MPNet and OpenAI GPT (GPT-1): table families whose attention computes its own softmax outside transformers'
attention interface and returns its probabilities only when asked (``output_attentions``); before their entries,
both were refused before any work.

MPNet is BERT-like, its q/k/v/o inside ``MPNetSelfAttention``, with a relative position bias computed ONCE by the
encoder from one ``relative_attention_bias`` (buckets x the config's heads) and handed to every layer: a pruned layer
must get its own kept heads' columns of it, at every depth with its own plan. GPT-1 fuses q/k/v in a Conv1D
``c_attn`` ([all q | all k | all v] at ``split_size``), masks causally with its own buffer, keeps no head size, and
returns a list, which its block extends with a list (a layer with no head left must return one too).
On each, in float64: capture equals transformers' ``output_attentions``, pruning (a head, and a whole layer) equals
masking on a padded batch, and so does the directory save_pruned writes, loaded by load_pruned and by plain
transformers (the portable pruned_heads.py); GPT-1's greedy generation too; the LRP rules conserve relevance to
1e-10. The analysis and masking checks of the matrix (tests/test_more_families.py: masking equals zeroed values,
gates at one change nothing, analyze end to end) run on them too.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from headlab import HeadlabError, attention_blocks, capture_attention, mask_heads, prune_heads, save_pruned
from support.family_matrix import check_lrp_conserves, padded_inputs, padded_logits, perturbed_model, tiny_model
from support.table_families import (
    SPECS,
    check_captured_probabilities,
    check_compute_lrp_conserves,
    check_old_mask_buffers_load,
    check_pruned_equals_masked,
    check_pruned_generates_and_reloads,
    check_pruned_reloads_as_masked,
    table_spec,
)

FAMILIES = ["mpnet", "openai-gpt"]
KIND = {"mpnet": "enc_self", "openai-gpt": "dec_self"}
LAYER = {"mpnet": "mpnet.encoder.layer.0", "openai-gpt": "transformer.h.0"}


def _spec(family: str, spec_name: str) -> dict:
    return table_spec(KIND[family], spec_name)[0]


def _mpnet(layers: int = 2) -> torch.nn.Module:
    """A tiny MPNet with its relative position table drawn larger than its init (std 0.02): the heads' columns
    then differ enough that handing a layer the wrong ones shows."""
    model = perturbed_model(tf.MPNetForMaskedLM, tf.MPNetConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=37,
        max_position_embeddings=64, pad_token_id=2, bos_token_id=0, eos_token_id=1), attn_implementation="eager")
    with torch.no_grad():
        model.mpnet.encoder.relative_attention_bias.weight.normal_(0, 1)
    return model


def _float64(family: str) -> torch.nn.Module:
    return (_mpnet() if family == "mpnet" else tiny_model(family, attn_implementation="eager")).double()


@pytest.mark.parametrize("family", FAMILIES)
def test_blocks_are_the_tables(family):
    blocks = attention_blocks(tiny_model(family, attn_implementation="eager"))
    assert [(b.kind, b.layer, b.n_heads, b.d_head, b.family.name) for b in blocks] == \
        [(KIND[family], layer, 4, 8, family) for layer in (0, 1)]


@pytest.mark.parametrize("family", FAMILIES)
def test_captured_probabilities_are_the_models_own(family):
    """What capture reads (asking the core for its probabilities) equals transformers' own output_attentions."""
    check_captured_probabilities(tiny_model(family, attn_implementation="eager").double(), KIND[family], atol=1e-12)


@pytest.mark.parametrize("spec_name", SPECS)
@pytest.mark.parametrize("family", FAMILIES)
def test_pruned_equals_masked_in_float64(family, spec_name):
    model = _float64(family)
    check_pruned_equals_masked(model, *table_spec(KIND[family], spec_name))


def test_mpnet_each_depth_reads_its_own_heads_position_bias():
    """Three layers pruned three ways (one keeps heads 0, 2, 3, one 1 and 3, one all): each reads the shared
    table's columns of the heads it kept, in order, and the table stays whole (every layer reads it)."""
    model = _mpnet(layers=3).double()
    table = model.mpnet.encoder.relative_attention_bias.weight.detach().clone()
    spec = {("enc_self", 0): [1], ("enc_self", 1): [0, 2]}
    ids, mask = padded_inputs(pad_id=2)
    with mask_heads(model, spec):
        expected = padded_logits(model, ids, mask)
    assert prune_heads(model, spec) == {("enc_self", 0): [0, 2, 3], ("enc_self", 1): [1, 3]}
    torch.testing.assert_close(padded_logits(model, ids, mask), expected, atol=1e-12, rtol=0)
    assert torch.equal(model.mpnet.encoder.relative_attention_bias.weight, table)
    with torch.no_grad(), capture_attention(model) as record:
        model(input_ids=ids, attention_mask=mask)
    assert [record[("enc_self", layer)].shape[1] for layer in range(3)] == [3, 2, 4]


@pytest.mark.parametrize("spec_name", SPECS)
def test_mpnet_pruned_reloads(spec_name, tmp_path):
    """save_pruned, load_pruned and plain transformers (pruned_heads.py): the position bias sliced per layer there
    too, every weight loaded, none reshaped."""
    check_pruned_reloads_as_masked(_mpnet(), *table_spec("enc_self", spec_name), tmp_path)


@pytest.mark.parametrize("spec_name", SPECS)
def test_openai_gpt_pruned_generates_as_masked_and_reloads(spec_name, tmp_path):
    """Greedy generation (GPT-1 has no cache: each step reruns the prefix), save_pruned, load_pruned and plain
    transformers (pruned_heads.py; a layer with no head left returns a list, as GPT-1's attention does)."""
    check_pruned_generates_and_reloads(tiny_model("openai-gpt", attn_implementation="eager"),
                                       *table_spec("dec_self", spec_name), tmp_path)


@pytest.mark.parametrize("family", FAMILIES)
def test_lrp_conserves_in_float64(family):
    model = _float64(family)
    check_lrp_conserves(model, model.get_submodule(LAYER[family]), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("family", FAMILIES)
def test_compute_lrp_conserves_with_biases_and_padding(family):
    """compute_lrp (biases on, padded sentences) conserves every sentence's logit to 1e-9 in float64."""
    check_compute_lrp_conserves(_float64(family))


@pytest.mark.parametrize("family", FAMILIES)
def test_lrp_conserves_after_pruning(family):
    """A pruned model (a layer with no head left: its stand-in's bias probed, GPT-1's list kept a list) conserves."""
    model = _float64(family)
    prune_heads(model, _spec(family, "no head left"))
    check_compute_lrp_conserves(model)


def test_openai_gpt_emptied_layer_loaded_without_headlab_is_refused(tmp_path):
    """GPT-1's head size comes from its config, not its attention: a layer with no head left, loaded by plain
    transformers, is still refused (as other families' are), naming headlab's loader, not listed with 0 heads."""
    model = tiny_model("openai-gpt", attn_implementation="eager")
    prune_heads(model, {("dec_self", 0): [0, 1, 2, 3]})
    save_pruned(model, tmp_path)
    plain = tf.AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True)
    with pytest.raises(HeadlabError, match="loaded without headlab"):
        attention_blocks(plain)


def test_openai_gpt_checkpoint_with_its_old_mask_buffers_loads(tmp_path):
    """openai-gpt's checkpoint (2019) holds each layer's causal mask ``h.N.attn.bias``, a persistent buffer then,
    which transformers 5.24 rebuilds and lists as unexpected: loaded, the logits the model's own (before: refused,
    "2 tensor(s) of the weights are not in the model")."""
    model = tiny_model("openai-gpt", attn_implementation="eager")
    check_old_mask_buffers_load(model, tmp_path, {f"transformer.h.{i}.attn.bias": block.attn.bias.clone()
                                                  for i, block in enumerate(model.transformer.h)})


def test_mpnet_encoder_without_lm_head_loads_prunes_and_reloads(tmp_path):
    """An MPNetModel checkpoint (sentence-transformers' all-mpnet-base-v2 is one: no LM head, a pooler) loads as
    MPNetModel, prunes equal to masked on its hidden states, and reloads through load_pruned and plain transformers."""
    from headlab.loading import load_model

    config = _mpnet().config
    config.architectures = ["MPNetModel"]
    perturbed_model(tf.MPNetModel, config, attn_implementation="eager").save_pretrained(tmp_path / "base")
    model = load_model(str(tmp_path / "base"), dtype=torch.float64)
    assert type(model).__name__ == "MPNetModel"
    spec = _spec("mpnet", "partial")
    ids, mask = padded_inputs(pad_id=2)

    def hidden(m):
        with torch.no_grad():
            return m(input_ids=ids, attention_mask=mask).last_hidden_state[mask.bool()]

    with mask_heads(model, spec):
        expected = hidden(model)
    prune_heads(model, spec)
    torch.testing.assert_close(hidden(model), expected, atol=1e-12, rtol=0)
    save_pruned(model, tmp_path / "pruned")
    torch.testing.assert_close(hidden(load_model(str(tmp_path / "pruned"), dtype=torch.float64)), expected, atol=1e-12,
                               rtol=0)  # load_pruned, through headlab's loader
    plain = tf.AutoModel.from_pretrained(tmp_path / "pruned", trust_remote_code=True, dtype=torch.float64).eval()
    torch.testing.assert_close(hidden(plain), expected, atol=1e-12, rtol=0)
