"""Multimodal wrappers whose idle tower's blocks claim the text model's layer numbers (session 27, towers27).

headlab numbers the blocks of a kind as one stack. ModernVBERT's and UltraVBERT's SigLIP tower beside their text
encoder (both ``enc_self``), Phi-4-multimodal's image encoder beside its language model (both ``dec_self``), Mllama's
two vision stacks and Nemotron-3.5's two audio towers (each other's ``enc_self`` layer 0) were refused before any work
("two modules claim enc_self layer 0"). Token ids never run such a tower (its blocks are idle: the measures leave them
out, pruning refuses them), so now its blocks are numbered after the text's blocks of their kind: the text model's
blocks keep the numbers the text model alone has, and everything headlab computes from text (capture, masking, gates,
the measures' tables, pruning) equals the text model's, extracted with the same weights. Two blocks that both run and
claim one number stay refused.

Tiny models built from their configs, no download.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import transformers as tf

import headlab
from headlab import HeadlabError, ScalarGates, attention_blocks, capture_attention, gates_attached, mask_heads, prune_heads
from headlab.commands import heads_table
from support.family_matrix import perturbed_model

_TEXT = dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=1, pad_token_id=2)
_VISION = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=4, image_size=16,
               patch_size=4)
_AUDIO = dict(d_model=32, encoder_layers=1, encoder_attention_heads=4, encoder_ffn_dim=40, hidden_size=32,
              num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, intermediate_size=40, head_dim=8)


def modernvbert(cls=tf.ModernVBertForMaskedLM) -> torch.nn.Module:
    text = tf.ModernBertConfig(**{**_TEXT, "num_key_value_heads": 4}, global_attn_every_n_layers=2, local_attention=4)
    config = tf.ModernVBertConfig(text_config=text, vision_config=_VISION, pixel_shuffle_factor=2)
    return perturbed_model(cls, config, attn_implementation="eager").double()


def ultravbert() -> torch.nn.Module:
    config = tf.UltraVBertConfig(text_config=dict(_TEXT, global_attn_every_n_layers=2, local_attention=4),
                                 vision_config=_VISION, pixel_shuffle_factor=2)
    return perturbed_model(tf.UltraVBertForMaskedLM, config, attn_implementation="eager").double()


def phi4_multimodal() -> torch.nn.Module:
    config = tf.Phi4MultimodalConfig(
        **_TEXT, vision_config=dict(_VISION, crop_size=16, feature_layer=-1),
        audio_config=dict(_AUDIO, num_blocks=1, ext_pw_out_channel=32, depthwise_separable_out_channel=32,
                          nemo_conv_channels=32, input_size=16, bias_max_distance=16, feature_layer=-1))
    return perturbed_model(tf.Phi4MultimodalForCausalLM, config, attn_implementation="eager").double()


def nemo_speechlm() -> torch.nn.Module:
    extra = dict(mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_chunk_size=4, mamba_expand=1,
                 mamba_head_dim=8, ssm_state_size=8, head_dim=8, n_groups=1, moe_intermediate_size=40,
                 n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1)
    audio = dict(_AUDIO, num_mel_bins=16)
    config = tf.Nemotron3_5TranscribeConfig(
        text_config=dict(_TEXT, **extra, model_type="nemotron_h"),
        audio_config=dict(asr_config=audio, diarization_config=dict(
            model_type="nemotron3_diarization", audio_config=audio,
            head_config=dict(audio_hidden_size=32, hidden_size=16))),
        word_timestamp_config=dict(_AUDIO, vocab_size=16, blank_token_id=15))
    return perturbed_model(tf.Nemotron3_5TranscribeForConditionalGeneration, config, attn_implementation="eager")


def mllama() -> torch.nn.Module:
    vision = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_global_layers=1, attention_heads=4,
                  image_size=16, patch_size=8, intermediate_layers_indices=[0], vision_output_dim=64,
                  max_num_tiles=1, supported_aspect_ratios=[[1, 1]])
    config = tf.MllamaConfig(text_config=dict(_TEXT, cross_attention_layers=[1]), vision_config=vision)
    return perturbed_model(tf.MllamaForConditionalGeneration, config, attn_implementation="eager").double()


# the blocks text runs (as the text model alone numbers them) and the towers' blocks, numbered after them, by kind
WRAPPERS = {
    "modernvbert": (modernvbert, {("enc_self", 0): "model.text_model.layers.0.attn",
                                  ("enc_self", 1): "model.text_model.layers.1.attn"},
                    {("enc_self", 2): "model.vision_model.encoder.layers.0.self_attn"}),
    "ultravbert": (ultravbert, {("enc_self", 0): "model.text_model.layers.0.self_attn",
                                ("enc_self", 1): "model.text_model.layers.1.self_attn"},
                   {("enc_self", 2): "model.vision_model.encoder.layers.0.self_attn"}),
    "phi4_multimodal": (phi4_multimodal, {("dec_self", 0): "model.layers.0.self_attn",
                                          ("dec_self", 1): "model.layers.1.self_attn"},
                        {("dec_self", 2): "model.embed_tokens_extend.image_embed.img_processor.encoder.layers.0.self_attn",
                         ("dec_self", 3): None}),
    "mllama": (mllama, {("dec_self", 0): "model.language_model.layers.0.self_attn"},
               {("enc_self", 0): "model.vision_model.transformer.layers.0.self_attn",
                ("enc_self", 1): "model.vision_model.transformer.layers.1.self_attn",
                ("enc_self", 2): "model.vision_model.global_transformer.layers.0.self_attn",
                ("dec_cross", 1): "model.language_model.layers.1.cross_attn"}),
    "nemo_speechlm": (nemo_speechlm, None, None),
}


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_the_towers_blocks_are_numbered_after_the_texts(wrapper):
    build, running, idle = WRAPPERS[wrapper]
    blocks = attention_blocks(build())  # before: "two modules claim ... layer 0"
    assert len({b.key for b in blocks}) == len(blocks)
    if running is None:  # Nemotron-3.5: its audio towers' three enc_self blocks, numbered in module order
        tower = [b for b in blocks if b.idle]
        assert [b.key for b in tower] == [("enc_self", i) for i in range(3)]
        assert tower[0].name.startswith("model.audio_tower.asr_encoder.")
        assert all(b.kind == "dec_self" for b in blocks if not b.idle)
        return
    assert {b.key: b.name for b in blocks if not b.idle} == running
    assert sorted(b.key for b in blocks if b.idle) == sorted(idle)
    assert all(b.name == name for b in blocks if b.idle and (name := idle[b.key]) is not None)
    table = heads_table(blocks)
    assert "not run by token ids" in table and "pruning them is refused" in table


def test_two_blocks_that_run_and_claim_one_number_stay_refused(monkeypatch):
    """Only an idle block is renumbered: with the tower taken for a block text runs, the clash is refused."""
    from headlab import adapters

    discovered = adapters._discovered_candidates
    monkeypatch.setattr(adapters, "_discovered_candidates", lambda model, idle=None: discovered(model, None))
    with pytest.raises(HeadlabError, match=r"^two modules claim enc_self layer 0: model\.text_model\.layers\.0\.attn "
                                           r"and model\.vision_model\.encoder\.layers\.0\.self_attn$"):
        attention_blocks(modernvbert())


def _text_alone(wrapper: torch.nn.Module) -> torch.nn.Module:
    """ModernVBERT's text model as a ModernBertForMaskedLM with the wrapper's weights (its prediction head, decoder)."""
    config = copy.deepcopy(wrapper.config.text_config)
    config.tie_word_embeddings = False  # the wrapper's lm_head is its own (tied, loading it would set the embeddings)
    text = tf.ModernBertForMaskedLM(config).double().eval()
    text.model.load_state_dict(wrapper.model.text_model.state_dict())
    text.head.load_state_dict(wrapper.projection_head.state_dict())
    text.decoder.load_state_dict(wrapper.lm_head.state_dict())
    return text


def _batch() -> dict:
    ids = torch.randint(3, 98, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def test_modernvbert_gives_what_its_text_model_alone_gives():
    """Capture, masking and gates at one: the wrapper's text blocks give the extracted ModernBERT's, bit for bit."""
    wrapper = modernvbert()
    text = _text_alone(wrapper)
    batch = _batch()
    with torch.no_grad():
        torch.testing.assert_close(wrapper(**batch).logits, text(**batch).logits, rtol=0, atol=1e-12)
        with capture_attention(wrapper) as got, capture_attention(text) as want:
            wrapper(**batch)
            text(**batch)
        assert sorted(got) == sorted(want) == [("enc_self", 0), ("enc_self", 1)]
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-12)
        spec = {("enc_self", 0): [1], ("enc_self", 1): [0, 3]}
        with mask_heads(wrapper, spec), mask_heads(text, spec):
            masked = wrapper(**batch).logits
            torch.testing.assert_close(masked, text(**batch).logits, rtol=0, atol=1e-12)
        assert not torch.allclose(masked, text(**batch).logits)
        before = wrapper(**batch).logits
        with gates_attached(wrapper, ScalarGates.for_model(wrapper)):
            assert torch.equal(wrapper(**batch).logits, before)


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(98)} | {"[UNK]": 98}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return tf.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", bos_token="w0", eos_token="w1",
                                      pad_token="w2", mask_token="w3")


def test_the_measures_score_modernvberts_text_model_as_alone():
    """Every measure's table of the kind the tower shares is the text model's (two layers, its heads), equal to the
    extracted ModernBERT's; the signature says what was left out (before: refused before any work)."""
    wrapper = modernvbert()
    text = _text_alone(wrapper)
    texts = ["w5 w6 w7 w8", "w9 w10 w11", "w12 w13 w14 w15 w16"]
    measures = ("confidence", "gradient", "ablation")
    got = headlab.importance(wrapper, _tokenizer(), texts, measures=measures)
    want = headlab.importance(text, _tokenizer(), texts, measures=measures)
    for name in measures:
        assert list(got.scores[name].scores) == ["enc_self"], name
        assert got.scores[name].scores["enc_self"].shape == (2, 4), name
        np.testing.assert_allclose(got.scores[name].scores["enc_self"], want.scores[name].scores["enc_self"],
                                   rtol=1e-9, atol=1e-12, err_msg=name)
        assert got.scores[name].signature["left_out"].startswith(
            "enc_self layer 2 (model.vision_model.encoder.layers.0.self_attn)"), name
        assert "left_out" not in want.scores[name].signature


def test_pruning_the_towers_renumbered_block_is_refused():
    model = mllama()
    with pytest.raises(HeadlabError, match=r"enc_self layer 2 \(model\.vision_model\.global_transformer\.layers\.0"):
        prune_heads(model, {("enc_self", 2): [0]})


def test_mllamas_wrapper_prunes_as_its_text_model_masks():
    """Mllama's wrapper (its two vision stacks renumbered): pruning its language model's heads equals masking them,
    and equals its causal LM alone (the same weights) masked."""
    wrapper = mllama()
    text = tf.MllamaForCausalLM(wrapper.config.text_config).double().eval()
    text.model.load_state_dict(wrapper.model.language_model.state_dict())
    text.lm_head.load_state_dict(wrapper.lm_head.state_dict())
    batch = _batch()
    spec = {("dec_self", 0): [1, 3]}
    with torch.no_grad():  # the causal LM alone casts its logits to float32 (MllamaForCausalLM.forward), the wrapper not
        torch.testing.assert_close(wrapper(**batch).logits.float(), text(**batch).logits, rtol=0, atol=0)
        with mask_heads(text, spec):
            masked = text(**batch).logits
        assert not torch.equal(masked, text(**batch).logits)
        prune_heads(wrapper, spec)
        torch.testing.assert_close(wrapper(**batch).logits.float(), masked, rtol=0, atol=1e-6)
    assert wrapper.model.language_model.layers[0].self_attn.q_proj.weight.shape[0] == 16


def test_modernvberts_head_functions_are_its_text_models(tmp_path):
    """headlab functions (positional heads) over the wrapper: the text encoder's two layers, as the text model alone."""
    from support.treebank import SAMPLE_CONLLU, sample_sentences, word_tokenizer

    tokenizer = word_tokenizer([w for s in sample_sentences(tmp_path) for w in s.words], style="bert")
    wrapper = modernvbert()
    got = headlab.functions(wrapper, tokenizer, SAMPLE_CONLLU, batch_size=1)
    want = headlab.functions(_text_alone(wrapper), tokenizer, SAMPLE_CONLLU, batch_size=1)
    assert sorted(got.positional.counts) == sorted(want.positional.counts) == [("enc_self", 0), ("enc_self", 1)]
    for key, counts in want.positional.counts.items():
        np.testing.assert_array_equal(got.positional.counts[key], counts)


def test_prune_trains_gates_and_baselines_take_the_text_models_heads():
    """headlab prune train gates the kind the tower shares at the text's blocks only (before the fix, a gate on the
    tower's block would have learned the penalty alone and counted in it); the baselines draw from the text's heads."""
    from headlab.pruning.baselines import _heads
    from headlab.pruning.train import resolve_kinds

    model = modernvbert()
    assert resolve_kinds(model, "auto") == ("enc_self",)
    assert ScalarGates.for_model(model, ("enc_self",)).n_heads == {("enc_self", 0): 4, ("enc_self", 1): 4}
    assert {(kind, layer) for kind, layer, _ in _heads(model, ("enc_self",))} == {("enc_self", 0), ("enc_self", 1)}


def test_the_gate_sweeps_budget_counts_the_text_models_heads(tmp_path):
    """analyze's --prune-keeps is checked against the gated heads: the text encoder's 8, not the tower's 4 with them."""
    from types import SimpleNamespace

    from headlab.pipeline.pipeline import _check_sweep

    modernvbert().save_pretrained(tmp_path)
    config = SimpleNamespace(model=str(tmp_path), trust_remote_code=False, prune_gates="enc_self", prune_keeps=(8,))
    _check_sweep(config)  # type: ignore[arg-type]
    with pytest.raises(HeadlabError, match=r"--prune-keeps 9: each budget must be between 1 and the 8 gated heads"):
        _check_sweep(SimpleNamespace(**{**vars(config), "prune_keeps": (9,)}))  # type: ignore[arg-type]
