"""Vision-language models whose forward needs an image: BLIP-2 (``pixel_values`` a required argument of
``Blip2ForConditionalGeneration.forward``), Kosmos-2 and IDEFICS (their forwards raise without ``pixel_values`` or
image embeddings). Every headlab command runs a model on token ids; before session 38 such a model
was analysed by its layers' names (the discovery probe's fallback for older modeling code), loaded, and the first stage
failed with "internal error (TypeError ...); this is a bug in headlab". Now the check every command makes before any
work (``loading.check_supported``, ``token_ids_problem``) refuses it with exit 2, naming what the forward needs; the
one-call API (``headlab.functions``, ``importance``, ``analyze``) refuses it too (session 38, mm38a), and
``headlab.prune`` refuses PP-FormulaNet (no embedding getter) instead of crashing."""

from __future__ import annotations

import re

import pytest
import torch
import transformers as tf

from headlab.cli import main
from headlab.loading import token_ids_problem
from support.family_matrix import save_tiny, treebank_files

_VISION = dict(hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=4, image_size=16,
               patch_size=8)


def _blip2() -> torch.nn.Module:
    config = tf.Blip2Config(text_config=dict(model_type="opt", vocab_size=99, hidden_size=32, ffn_dim=40,
                                             num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=32,
                                             max_position_embeddings=64),
                            vision_config=_VISION, num_query_tokens=2, image_token_index=98,
                            qformer_config=dict(hidden_size=32, intermediate_size=40, num_hidden_layers=1,
                                                num_attention_heads=4, encoder_hidden_size=32, vocab_size=99))
    torch.manual_seed(0)
    return tf.Blip2ForConditionalGeneration(config).eval()


def _kosmos2() -> torch.nn.Module:
    config = tf.Kosmos2Config(text_config=dict(vocab_size=99, embed_dim=32, layers=2, ffn_dim=40, attention_heads=4,
                                               max_position_embeddings=64), vision_config=_VISION, latent_query_num=2)
    torch.manual_seed(0)
    return tf.Kosmos2ForConditionalGeneration(config).eval()


def _idefics() -> torch.nn.Module:
    config = tf.IdeficsConfig(vocab_size=99, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                              num_attention_heads=4, max_position_embeddings=64, cross_layer_interval=2,
                              vision_config=dict(embed_dim=32, image_size=16, intermediate_size=40, patch_size=8,
                                                 num_hidden_layers=1, num_attention_heads=4),
                              perceiver_config=dict(resampler_n_latents=2, resampler_depth=1, resampler_n_heads=2,
                                                    resampler_head_dim=8))
    torch.manual_seed(0)
    return tf.IdeficsForVisionText2Text(config).eval()


@pytest.mark.parametrize(("build", "needs"), [
    (_blip2, r"Blip2ForConditionalGeneration\.forward requires pixel_values"),
    (_kosmos2, r"Kosmos2ForConditionalGeneration's forward fails on token ids alone \(ValueError: You have to specify "
               r"either `pixel_values` or `image_embeds`\.\)"),
    # its dropout module holds a float as ``config``: the probe's record of plain attributes crashed on it (TypeError)
    (_idefics, r"IdeficsForVisionText2Text's forward fails on token ids alone \(ValueError: Exactly 1 of pixel_values"),
])
def test_a_model_that_needs_an_image_is_refused_before_any_work(build, needs, tmp_path, capsys):
    model = build()
    problem = token_ids_problem(model)
    assert problem is not None and "headlab runs models on token ids (their text) only" in problem
    save_tiny(model, tmp_path / "model", treebank_files(tmp_path))
    out = tmp_path / "out"
    assert main(["functions", str(tmp_path / "model"), "--conllu", str(tmp_path / "tb.conllu"), "--out",
                 str(out)]) == 2
    err = capsys.readouterr().err
    assert "internal error" not in err and "Traceback" not in err
    assert re.search(needs, err), err
    assert not out.exists()


def _udop() -> torch.nn.Module:
    config = tf.UdopConfig(vocab_size=99, d_model=32, d_kv=8, d_ff=40, num_layers=2, num_heads=4, image_size=16,
                           patch_size=8)
    torch.manual_seed(0)
    return tf.UdopForConditionalGeneration(config).eval()


def _pi0() -> torch.nn.Module:
    text = dict(model_type="gemma", vocab_size=99, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    config = tf.PI0Config(vlm_config=dict(text_config=text, vision_config=dict(
        _VISION, model_type="siglip_vision_model", vision_use_head=False), projection_dim=32, image_token_id=98),
        dit_config=text, chunk_size=4, max_state_dim=8, max_action_dim=8)
    torch.manual_seed(0)
    return tf.PI0ForConditionalGeneration(config).eval()


_BUILD = {"blip2": _blip2, "kosmos2": _kosmos2, "idefics": _idefics, "udop": _udop, "pi0": _pi0}
_NEEDS = {"blip2": r"Blip2ForConditionalGeneration\.forward requires pixel_values",
          "kosmos2": r"Kosmos2ForConditionalGeneration's forward fails on token ids alone \(ValueError",
          "idefics": r"IdeficsForVisionText2Text's forward fails on token ids alone \(ValueError",
          "udop": r"UdopForConditionalGeneration's forward fails on token ids alone \(ValueError: Bbox is required",
          "pi0": r"PI0ForConditionalGeneration\.forward requires state"}


@pytest.mark.parametrize("name", list(_BUILD))
@pytest.mark.parametrize("call", ["functions", "importance", "analyze", "prune"])
def test_the_api_refuses_a_model_that_needs_an_image_before_any_work(name, call, monkeypatch):
    """The one-call API on a model already loaded: before session 38 (mm38a) ``headlab.functions`` failed deep inside
    with the forward's TypeError (BLIP-2) or ValueError (Kosmos-2, IDEFICS), and ``headlab.importance`` ran every
    measure first, then raised MeasuresFailed naming the forward's error (BLIP-2: an LRP rule missing for its tower);
    UDOP and PI0 were refused for their blocks' name-based view ("two modules claim enc_self layer 0"), not their
    inputs, by every call, ``headlab.prune`` too."""
    import headlab
    from headlab import HeadlabError
    from support.treebank import SAMPLE_CONLLU, word_tokenizer

    def no_work(*args, **kwargs):
        raise AssertionError("work started")

    monkeypatch.setattr("headlab.functions.analysis.analyze_heads", no_work)
    monkeypatch.setattr("headlab.importance.pipeline.run_importance", no_work)
    monkeypatch.setattr("headlab.surgery.prune_heads", no_work)
    model = _BUILD[name]()
    tokenizer = word_tokenizer(["the", "cat", "sat"], style="gpt2")
    run = {"functions": lambda: headlab.functions(model, tokenizer, SAMPLE_CONLLU),
           "importance": lambda: headlab.importance(model, tokenizer, ["the cat sat"]),
           "analyze": lambda: headlab.analyze(model, tokenizer, ["the cat sat"], treebank=SAMPLE_CONLLU),
           "prune": lambda: headlab.prune(model, "dec_self:0:0")}[call]
    with pytest.raises(HeadlabError, match=r"model: " + _NEEDS[name]):
        run()


def test_text_only_and_token_id_wrappers_pass():
    """A text model and a wrapper that runs on token ids (its tower idle) have no such problem."""
    from support.family_matrix import tiny_model

    assert token_ids_problem(tiny_model("llama")) is None
    config = tf.LlavaConfig(text_config=dict(model_type="llama", vocab_size=99, hidden_size=32, intermediate_size=40,
                                             num_hidden_layers=2, num_attention_heads=4,
                                             max_position_embeddings=64),
                            vision_config=dict(_VISION, model_type="clip_vision_model"), image_token_index=98)
    assert token_ids_problem(tf.LlavaForConditionalGeneration(config).eval()) is None


def _pp_formulanet() -> torch.nn.Module:
    config = tf.PPFormulaNetConfig(
        text_config=dict(vocab_size=99, d_model=32, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=40,
                         max_position_embeddings=64, encoder_layers=2, encoder_attention_heads=4,
                         encoder_ffn_dim=40),
        vision_config=dict(hidden_size=32, output_channels=16, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=8, window_size=2, global_attn_indexes=[1], mlp_dim=40,
                           post_conv_in_channels=16, post_conv_out_channels=32, post_conv_mid_channels=16,
                           decoder_hidden_size=32))
    torch.manual_seed(0)
    return tf.PPFormulaNetForConditionalGeneration(config).eval()


def test_pruning_a_model_without_an_embedding_getter_is_refused_naming_its_input():
    """PP-FormulaNet (an image encoder, an mBART-like decoder): its base model's ``get_input_embeddings`` raises
    NotImplementedError, and before session 38 (mm38a) ``headlab.prune_heads`` crashed with it while building the
    probe batch that checks the pruning. Now the probe reads the vocabulary from the config, the forward fails on token
    ids alone, and the pruning is refused before any weight changes (``headlab.prune`` refuses it earlier, above)."""
    import headlab
    from headlab import HeadlabError

    model = _pp_formulanet()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    block = headlab.attention_blocks(model)[0]
    with pytest.raises(HeadlabError, match=r"cannot check pruning, the model itself fails on headlab's probe batch "
                                           r"\(short rows, with and without padding\): ValueError: .*pixel_values"):
        headlab.prune_heads(model, {(block.kind, block.layer): [0]})
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize(("build", "needs"), [
    (_udop, r"UdopForConditionalGeneration's forward fails on token ids alone \(ValueError: Bbox is required"),
    (_pi0, r"PI0ForConditionalGeneration\.forward requires state"),
])
def test_load_model_names_the_input_where_the_blocks_of_a_model_that_needs_an_image_are_not_found(build, needs,
                                                                                                   tmp_path):
    """``headlab.load_model`` reads a pruning record off the weights' shapes through the model's blocks; UDOP's and
    PI0's name-based blocks clash (two modules claim enc_self layer 0), which it reported before session 38 (mm38a),
    not the boxes or state their forward needs."""
    from headlab import HeadlabError
    from headlab.loading import load_model

    save_tiny(build(), tmp_path / "model", treebank_files(tmp_path))
    with pytest.raises(HeadlabError, match=needs):
        load_model(str(tmp_path / "model"))
