"""GPT-Neo (the TinyStories models, GPT-Neo 125M), Megatron-BERT and GIT: table families whose attention computes
its own softmax (outside transformers' attention interface; the generic path refused to prune them).

GPT-Neo nests its attention (``h.N.attn.attention``), has no 1/sqrt(d) scaling, computes its logits in float32
and alternates global layers with windowed ones (``attention_types``); Megatron-BERT is BERT's attention after a
pre-norm; GIT is BERT's post-norm layers, causal over text, beside a CLIP image encoder that token ids never run.
On each, in float64: pruning (a head, and a whole layer) equals masking, also in cached generation, and so does
the directory save_pruned writes, loaded by load_pruned and by plain transformers (the portable pruned_heads.py);
the LRP rules conserve relevance to 1e-10. The analysis and masking checks of the matrix
(tests/test_more_families.py) run on them too.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from headlab import HeadlabError, attention_blocks, capture_attention, prune_heads
from support.family_matrix import check_lrp_conserves, padded_inputs, padded_logits, tiny_model
from support.table_families import (
    SPECS,
    check_compute_lrp_conserves,
    check_decoder_prunes_and_conserves,
    check_old_mask_buffers_load,
    check_pruned_equals_masked,
    check_pruned_generates_and_reloads,
    check_pruned_reloads_as_masked,
    table_spec,
)

CAUSAL = ["gpt_neo", "git"]


def _model(family: str) -> torch.nn.Module:
    return tiny_model(family, attn_implementation="eager").double()


def _kind(family: str) -> str:
    return "enc_self" if family == "megatron-bert" else "dec_self"


@pytest.mark.parametrize("spec_name", SPECS)
@pytest.mark.parametrize("family", ["gpt_neo", "megatron-bert", "git"])
def test_pruned_equals_masked_in_float64(family, spec_name):
    """GPT-Neo's logits are float32 in both models, computed head by head alike: equal to 1e-12 all the same."""
    model = tiny_model(family, attn_implementation="eager").double()
    check_pruned_equals_masked(model, *table_spec(_kind(family), spec_name), skip_idle=True)


@pytest.mark.parametrize("spec_name", SPECS)
@pytest.mark.parametrize("family", CAUSAL)
def test_pruned_generates_as_masked_and_reloads(family, spec_name, tmp_path):
    """Cached greedy generation, save_pruned, load_pruned and plain transformers (pruned_heads.py). GIT's text-only
    cached generation is transformers' own (it widens the mask by the image tokens): the same in both models. A
    layer with no head keeps the cache in step: GPT-Neo's attention names its cache layer layer_id, and GitAttention
    hands GitSelfAttention its cache by position (before: positions counted from an empty layer 0)."""
    spec, heads_left = table_spec("dec_self", spec_name)
    check_pruned_generates_and_reloads(tiny_model(family), spec, heads_left, tmp_path)


@pytest.mark.parametrize("spec_name", SPECS)
def test_megatron_bert_pruned_reloads(spec_name, tmp_path):
    check_pruned_reloads_as_masked(tiny_model("megatron-bert"), *table_spec("enc_self", spec_name), tmp_path)


@pytest.mark.parametrize("family", ["gpt_neo", "megatron-bert", "git"])
def test_lrp_conserves_in_float64(family):
    model = _model(family)
    layer = {"gpt_neo": "transformer.h.0", "megatron-bert": "bert.encoder.layer.0", "git": "git.encoder.layer.0"}
    check_lrp_conserves(model, model.get_submodule(layer[family]), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("family", ["gpt_neo", "megatron-bert", "git"])
def test_compute_lrp_conserves_with_biases_and_padding(family):
    """compute_lrp (biases on, padded sentences; GPT-Neo's local layer of window 3 over sentences longer than it)
    conserves every sentence's logit to 1e-9 in float64. GPT-Neo's relevance was cut at its attention's input
    (h.N.attn, after ln_1), not its layer's (h.N): the residual path's share was lost (ratios 0.988 to 1.007)."""
    check_compute_lrp_conserves(_model(family))


def test_gpt_neo_local_layer_is_windowed_and_unscaled():
    """The probabilities capture reads are GPT-Neo's: no 1/sqrt(d), and the local layer (1) sees its window only."""
    model = _model("gpt_neo")
    ids, mask = padded_inputs(pad_id=2)
    with capture_attention(model) as record:
        padded_logits(model, ids, mask)
    attn = model.transformer.h[1].attn.attention
    x = model.transformer.h[1].ln_1  # the reference from the weights, by hand
    with torch.no_grad():
        out = model(input_ids=ids[:1], output_hidden_states=True)
        h = x(out.hidden_states[1])
        q = attn.q_proj(h).view(1, 7, 4, 8).transpose(1, 2)
        k = attn.k_proj(h).view(1, 7, 4, 8).transpose(1, 2)
        logits = (q @ k.transpose(-1, -2)).float()  # no scaling
        window = torch.ones(7, 7, dtype=torch.bool).tril() & ~torch.ones(7, 7, dtype=torch.bool).tril(-3)
        probs = logits.masked_fill(~window, torch.finfo(torch.float32).min).softmax(-1)
    captured = record[("dec_self", 1)][:1].float()
    torch.testing.assert_close(captured, probs, atol=1e-6, rtol=0)
    assert torch.all(captured[:, :, 6, :4] == 0)  # outside the window of 3


def test_gpt_neo_with_flash_attention_is_refused_before_any_work():
    """GPTNeoFlashAttention2 returns the merged outputs, not probabilities, and is chosen when the model is built."""
    from transformers.models.gpt_neo.modeling_gpt_neo import GPTNeoFlashAttention2

    model = tiny_model("gpt_neo", attn_implementation="eager")
    model.transformer.h[1].attn.attention.__class__ = GPTNeoFlashAttention2
    with pytest.raises(HeadlabError, match="GPTNeoFlashAttention2: .*attn_implementation='eager'"):
        attention_blocks(model)


def test_git_image_encoder_is_idle_and_not_pruned():
    """GIT's CLIP tower, run on pixel_values only, is listed idle (as the generic path listed it) and left out."""
    model = _model("git")
    blocks = attention_blocks(model)
    tower = [b for b in blocks if b.idle]
    assert [(b.kind, b.n_heads, b.d_head) for b in tower] == [("enc_self", 4, 8)]
    assert tower[0].name == "git.image_encoder.vision_model.encoder.layers.0.self_attn"
    assert [b.kind for b in blocks if not b.idle] == ["dec_self", "dec_self"]
    with pytest.raises(HeadlabError, match="enc_self"):
        prune_heads(model, {("enc_self", 0): [1]})


def test_gpt_neo_checkpoint_with_its_old_mask_buffers_loads(tmp_path):
    """EleutherAI's GPT-Neo checkpoints (2021) hold each layer's causal/windowed mask ``bias`` and ``masked_bias``,
    persistent buffers then; transformers rebuilds the first from the config and lists both as unexpected. They
    were refused ("4 tensor(s) of the weights are not in the model"); now loaded, the logits the model's own."""
    model = tiny_model("gpt_neo", attn_implementation="eager")
    buffers = {}
    for i, block in enumerate(model.transformer.h):
        buffers[f"transformer.h.{i}.attn.attention.bias"] = block.attn.attention.bias.clone()
        buffers[f"transformer.h.{i}.attn.attention.masked_bias"] = torch.tensor(-1e9)
    check_old_mask_buffers_load(model, tmp_path, buffers)


def test_megatron_bert_as_a_decoder_prunes_and_conserves():
    """MegatronBertForCausalLM with is_decoder: dec_self blocks (bert_like's decoder entry), pruned equal to masked in
    cached generation (a layer with no head left too), LRP conserving in float64."""
    from support.family_matrix import perturbed_model

    config = tf.MegatronBertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=37, max_position_embeddings=64, pad_token_id=2, is_decoder=True)
    check_decoder_prunes_and_conserves(
        lambda: perturbed_model(tf.MegatronBertForCausalLM, config, attn_implementation="eager"), "bert.encoder.layer.0")
