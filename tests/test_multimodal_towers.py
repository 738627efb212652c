"""Multimodal wrappers whose attention blocks include a vision tower's (session 26, vis14).

Of the wrappers the tests build, Llava (a CLIP tower, tests/test_capture_configs.py) and Mistral Large 4
(``MistralLarge4ForConditionalGeneration``, a Pixtral tower, tests/test_mla_pruning.py) list their tower's attention
as ``enc_self`` blocks; GLM-5-Next's wrapper lists its language model's only, Qwen3.5's is refused naming its language
model, and dots3-note's (vision, audio) lists its language model's and its towers' since session 37. Everything
headlab computes runs the model on token ids, which never reach the tower: before, pruning its heads passed the check
against masking (the probe compared nothing there) and was written, gradient and ablation scored its heads 0 as if
measured, confidence and LRP failed with a KeyError, the wrapper was taken for a masked LM (an ``enc_self`` kind: its
loss unshifted) and ``headlab prune train`` gated the tower (``--gates auto``: the encoder's). Now such blocks are
``idle``: pruning them is refused before any work (the check also refuses any planned block its probe did not run),
the measures leave their kind out, saying so in the tables' signature, and the gates go to the kinds text runs.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import transformers as tf
from tokenizers import Tokenizer, models, pre_tokenizers

import headlab
from headlab import HeadlabError, attention_blocks, prune_heads
from headlab.model_description import describe_model
from headlab.pruning.train import resolve_kinds
from support.family_matrix import perturbed_model
from test_mla_pruning import glm5_next, mistral_large4

VOCAB = 99


def llava() -> torch.nn.Module:
    vision = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                                 image_size=16, patch_size=8, projection_dim=32)
    text = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0,
                          eos_token_id=1, pad_token_id=2)
    config = tf.LlavaConfig(vision_config=vision, text_config=text, image_token_index=VOCAB - 1)
    return perturbed_model(tf.LlavaForConditionalGeneration, config)


def gemma4() -> torch.nn.Module:
    """Gemma 4's tower projects through Gemma4ClippableLinear (a clamp around ``.linear``): before, refused
    ("cannot read the output width of Gemma4ClippableLinear"), its language model with it."""
    text = tf.Gemma4TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=8,
                               max_position_embeddings=64, vocab_size_per_layer_input=VOCAB,
                               hidden_size_per_layer_input=8, layer_types=["sliding_attention", "full_attention"],
                               sliding_window=4, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    vision = tf.Gemma4VisionConfig(hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=4, head_dim=8, position_embedding_size=64, patch_size=4,
                                   pooling_kernel_size=2)
    config = tf.Gemma4Config(text_config=text, vision_config=vision, audio_config=None)
    return perturbed_model(tf.Gemma4ForConditionalGeneration, config)


WRAPPERS = {"llava": (llava, "model.vision_tower.encoder.layers.", 2),
            "mistral_large4": (mistral_large4, "model.vision_tower.transformer.layers.", 1),
            "gemma4": (gemma4, "model.vision_tower.encoder.layers.", 1)}
MESSAGE = (r"cannot check pruning the heads of enc_self layer 0 \(model\.vision_tower\.[a-z.]*layers\.0\.[a-z_]*\): "
           r"headlab checks every prune against masking on token ids .* token ids never run these blocks .*nothing was "
           r"pruned\. Remove heads of the blocks text runs only \(dec_self layers 0-[13]\)")


def _tokenizer():
    vocab = {f"w{i}": i for i in range(VOCAB - 1)} | {"[UNK]": VOCAB - 1}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return tf.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", bos_token="w0", eos_token="w1",
                                      pad_token="w2")


TEXTS = ["w5 w6 w7 w8", "w9 w10 w11", "w12 w13 w14 w15 w16"]


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_the_vision_towers_blocks_are_the_idle_ones(wrapper):
    build, tower, n_tower = WRAPPERS[wrapper]
    model = build()
    blocks = attention_blocks(model)
    assert [b.name for b in blocks if b.idle] == [f"{tower}{i}.{blocks[0].name.rsplit('.', 1)[1]}" for i in range(n_tower)]
    assert all(b.kind == "enc_self" for b in blocks if b.idle)
    assert all(b.kind == "dec_self" and b.name.startswith("model.language_model.") for b in blocks if not b.idle)
    assert describe_model(model).arch == "causal"  # before: "masked", for the tower's enc_self


def test_a_wrapper_that_lists_no_tower_block_has_none_idle():
    assert not any(b.idle for b in attention_blocks(glm5_next(["indexed_attention"] * 2)))


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_pruning_a_towers_heads_is_refused_before_any_work(wrapper):
    """Alone or beside text heads: refused naming the tower's block and the blocks text runs, the model untouched;
    the language model's heads are still pruned (and checked)."""
    model = WRAPPERS[wrapper][0]()
    before = {name: p.clone() for name, p in model.state_dict().items()}
    for spec in ({("enc_self", 0): [1]}, {("dec_self", 1): [0], ("enc_self", 0): [0, 1]}):
        with pytest.raises(HeadlabError, match=MESSAGE):
            prune_heads(model, spec)
        after = model.state_dict()
        assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    assert prune_heads(model, {("dec_self", 1): [0]}) == {("dec_self", 1): [1, 2, 3]}


def test_the_check_refuses_a_block_its_probe_did_not_run(monkeypatch):
    """The check itself, whatever the adapter said (a block not marked idle, as a table family's unused
    cross-attention would be): a planned block that the masked model's probe never ran is refused, nothing pruned."""
    from headlab import surgery

    monkeypatch.setattr(surgery, "check_checkable", lambda *args, **kwargs: None, raising=False)
    model = llava()
    weight = model.model.vision_tower.encoder.layers[0].self_attn.q_proj.weight
    with pytest.raises(HeadlabError, match=MESSAGE):
        prune_heads(model, {("enc_self", 0): [1]})
    assert weight.shape[0] == 32


def test_the_measures_leave_the_tower_out_and_say_so():
    """Every default measure scores the language model's heads only (before: gradient and ablation 0 for every tower
    head, confidence and LRP a KeyError, the loss a masked LM's); asking for the tower's kind is refused."""
    model, tokenizer = llava(), _tokenizer()
    result = headlab.importance(model, tokenizer, TEXTS, measures=("confidence", "gradient", "ablation", "lrp"))
    assert set(result.scores) >= {"confidence", "gradient", "ablation", "lrp"}
    for name, table in result.scores.items():
        assert list(table.scores) == ["dec_self"], name
        assert table.scores["dec_self"].shape == (2, 4) and not torch.tensor(table.scores["dec_self"]).isnan().any()
        assert table.signature["left_out"].startswith("enc_self layers 0, 1 (model.vision_tower.encoder.layers.0"), name
    with pytest.raises(HeadlabError, match=r"kinds enc_self: enc_self layers 0, 1 \(model\.vision_tower.*which token ids "
                                           r"do not run.*score the kinds text runs \(dec_self\)"):
        headlab.importance(model, tokenizer, TEXTS, measures="gradient", kinds="enc_self")


def test_the_gates_go_to_the_kinds_text_runs():
    """headlab prune train's --gates: auto and all gate the language model (before, auto gated the tower: the
    'encoder'); naming the tower's kind is refused."""
    model = llava()
    assert resolve_kinds(model, "auto") == ("dec_self",) and resolve_kinds(model, "all") == ("dec_self",)
    with pytest.raises(HeadlabError, match=r"--gates enc_self: the model's enc_self attention is enc_self layers 0, 1 "
                                           r"\(model\.vision_tower.*gate the kinds text runs \(dec_self\)"):
        resolve_kinds(model, "enc_self")


def test_headlab_prune_refuses_a_towers_heads_before_reading_the_weights(tmp_path, capsys, monkeypatch):
    from headlab import loading
    from headlab.cli import main

    llava().save_pretrained(tmp_path / "model")

    def no_load(*args, **kwargs):
        raise AssertionError("the weights were read")

    monkeypatch.setattr(loading, "load_model", no_load)
    code = main(["prune", str(tmp_path / "model"), "--heads", "enc_self:1:0", "--out", str(tmp_path / "out")])
    err = " ".join(capsys.readouterr().err.split())
    assert code != 0 and "cannot check pruning the heads of enc_self layer 1 (" in err
    assert "vision_tower.encoder.layers.1.self_attn): headlab checks every prune" in err
    assert not (tmp_path / "out").exists()


def git() -> torch.nn.Module:
    vision = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=4, image_size=16,
                  patch_size=8)
    config = tf.GitConfig(vision_config=vision, vocab_size=VOCAB, hidden_size=32, intermediate_size=37,
                          num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64, pad_token_id=2,
                          bos_token_id=0, eos_token_id=1)
    return perturbed_model(tf.GitForCausalLM, config, attn_implementation="eager")


def test_a_name_found_towers_blocks_are_idle():
    """GIT's attention calls no attention interface (found by its projections' names): before, its image encoder's
    block was taken for a text encoder's (not idle), the model for a masked LM, and the measures scored it."""
    model = git()
    blocks = attention_blocks(model)
    assert [(b.kind, b.layer) for b in blocks if b.idle] == [("enc_self", 0)]
    assert blocks[0].name == "git.image_encoder.vision_model.encoder.layers.0.self_attn"
    assert [b.name for b in blocks if not b.idle] == [f"git.encoder.layer.{i}.attention" for i in range(2)]
    assert describe_model(model).arch == "causal"


def gemma3() -> torch.nn.Module:
    text = tf.Gemma3TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                               sliding_window=4, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=4,
                                   image_size=16, patch_size=8)
    config = tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=1)
    return perturbed_model(tf.Gemma3ForConditionalGeneration, config, attn_implementation="eager")


def test_lrp_needs_no_rule_for_a_tower_text_never_runs():
    """Gemma 3's SigLIP tower ends in a pooling head (nn.MultiheadAttention) that no rule covers: before, LRP was
    refused for it on the whole model ("no rule for MultiheadAttention (model.vision_tower.head.attention)"); token
    ids never run the tower (its blocks are idle), so no relevance reaches it, and the language model's conserves."""
    from headlab.importance.rules import check_rules
    from support.family_matrix import check_lrp_conserves

    model = gemma3().double()
    assert [b.kind for b in attention_blocks(model) if b.idle] == ["enc_self"]
    check_rules(model)
    check_lrp_conserves(model, model.model.language_model.layers[0])


def got_ocr2() -> torch.nn.Module:
    text = tf.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0,
                          eos_token_id=1, pad_token_id=2)
    vision = tf.GotOcr2VisionConfig(hidden_size=32, output_channels=16, num_hidden_layers=2, num_attention_heads=4,
                                    image_size=32, patch_size=8, window_size=2, global_attn_indexes=[1], mlp_dim=40)
    config = tf.GotOcr2Config(vision_config=vision, text_config=text)
    return perturbed_model(tf.GotOcr2ForConditionalGeneration, config, attn_implementation="eager")


def granite_speech(plus: bool = False) -> torch.nn.Module:
    text = tf.GraniteConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                            embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2,
                            logits_scaling=3.0, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    encoder = dict(input_dim=8, num_layers=1, hidden_dim=32, num_heads=4, output_dim=8, context_size=8, max_pos_emb=16,
                   conv_kernel_size=3)
    projector = dict(model_type="blip_2_qformer", hidden_size=32, intermediate_size=37, num_hidden_layers=1,
                     num_attention_heads=4, encoder_hidden_size=32, vocab_size=VOCAB)
    config_class, cls = (tf.GraniteSpeechPlusConfig, tf.GraniteSpeechPlusForConditionalGeneration) if plus else \
        (tf.GraniteSpeechConfig, tf.GraniteSpeechForConditionalGeneration)
    config = config_class(text_config=text.to_dict(), encoder_config=encoder, projector_config=projector,
                          window_size=4, downsample_rate=2)
    return perturbed_model(cls, config)


# The tower's attention is no block headlab lists (GOT-OCR2's SAM-style vision attention computes its own
# probabilities; the conformer's attention too), and the conformer holds a BatchNorm1d, which no rule covers.
TOWERS = {"got_ocr2": (got_ocr2, tf.Qwen2ForCausalLM, "GotOcr2VisionAttention (model.vision_tower.layers.0.attn)"),
          "granite_speech": (granite_speech, tf.GraniteForCausalLM,
                             "GraniteSpeechConformerAttention (model.encoder.layers.0.attn)"),
          "granite_speech_plus": (lambda: granite_speech(plus=True), tf.GraniteForCausalLM,
                                  "GraniteSpeechPlusConformerAttention (model.encoder.layers.0.attn)")}


def _text_model_alone(model: torch.nn.Module, cls) -> torch.nn.Module:
    """The wrapper's language model and LM head as a causal LM of their own, the same weights."""
    config = copy.deepcopy(model.config.text_config)  # the wrapper's own stays as it was
    config._attn_implementation = "eager"
    text = cls(config).eval().to(model.dtype)
    state = {"model." + k.removeprefix("model.language_model."): v for k, v in model.state_dict().items()
             if k.startswith("model.language_model.")}
    text.load_state_dict(state | {"lm_head.weight": model.lm_head.weight}, strict=True)
    return text


@pytest.mark.parametrize("tower", TOWERS)
def test_lrp_needs_no_rule_for_a_tower_whose_attention_is_no_block(tower):
    """Before, LRP was refused on the whole model for a module of a tower that no block lists ("no rule for
    GotOcr2VisionAttention (model.vision_tower.layers.0.attn): a token mixer named attention ..."): token ids never
    run the tower (nor its projector), so no relevance reaches it, and the language model's rules conserve."""
    from headlab.importance import rules
    from support.family_matrix import check_lrp_conserves

    model = TOWERS[tower][0]().double()
    assert not any(b.idle for b in attention_blocks(model))  # before, only the subtrees around idle blocks were left
    rules.check_rules(model)
    check_lrp_conserves(model, model.model.language_model.layers[0])
    skipped = rules.never_run(model)
    assert TOWERS[tower][2].split("(")[1][:-1] in skipped
    assert not any(path.startswith("model.language_model") or path == "lm_head" for path in skipped)


@pytest.mark.parametrize("tower", TOWERS)
def test_lrp_on_a_wrapper_is_its_text_models(tower):
    """The wrapper's head relevance is that of its language model alone, with the same weights: the tower adds
    nothing, and conservation is measured the same."""
    from headlab.importance import ImportanceData, compute_lrp

    build, text_class, _ = TOWERS[tower]
    model = build().double()
    text = _text_model_alone(model, text_class)
    data = ImportanceData.from_ids([[5, 6, 7, 8, 1], [9, 10, 11, 1], [12, 13, 14, 15, 16, 1]])
    got, want = (compute_lrp(m, data, describe_model(m), batch_size=2, bootstrap=0) for m in (model, text))
    assert list(got.scores) == list(want.scores) == ["dec_self"]
    np.testing.assert_allclose(got.scores["dec_self"], want.scores["dec_self"], rtol=1e-9, atol=1e-12)
    assert got.signature["n_steps"] == want.signature["n_steps"] == 15
    for part in ("embeddings", "with_biases"):
        assert got.signature["conservation"][part] == pytest.approx(want.signature["conservation"][part], rel=1e-9)


def test_a_module_the_probe_left_out_is_refused_if_lrp_runs_it(monkeypatch):
    """check_rules skips what the probe forward never ran; should LRP's forward run such a module after all (an
    expert the probe's tokens were not routed to) and it has no rule, LRP is refused when it runs, never left
    unruled. Simulated: the probe's record without an MLP's activation, made in-place (no rule)."""
    from headlab.adapters import discovery
    from headlab.importance import ImportanceData, compute_lrp
    from headlab.importance.rules import check_rules

    model = llava()
    model.model.language_model.layers[1].mlp.act_fn = torch.nn.ReLU(inplace=True)
    path = "model.language_model.layers.1.mlp.act_fn"
    with pytest.raises(HeadlabError, match=rf"in-place activation ReLU \({path}\) is not supported$"):
        check_rules(model)
    probed = discovery.ran(model)
    monkeypatch.setattr(discovery, "ran", lambda m: probed - {path})
    check_rules(model)  # left out
    with pytest.raises(HeadlabError, match=rf"in-place activation ReLU \({path}\) is not supported \(it ran in LRP's "
                                           r"forward, though discovery's probe forward on token ids did not run it"):
        compute_lrp(model, ImportanceData.from_ids([[5, 6, 7, 1]]), describe_model(model), bootstrap=0)
