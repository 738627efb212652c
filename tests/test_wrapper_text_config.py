"""A multimodal wrapper's special tokens and longest input are its text model's (session 28, wrapper28).

ModernVBERT's config (``ModernVBertConfig``, like UltraVBERT's and Mllama's) has no padding, EOS, BOS, SEP or CLS id
and no position limit at its top level: they are in its ``text_config``. ``describe_model`` read the top level only,
so without a tokenizer a wrapper was padded with id 0, had no EOS (its special ids, which confidence leaves out and
LRP never targets, were {0}) and took inputs of 512 tokens through a text model of 64 positions (Mllama: padded with
its EOS). Now a value the top level lacks is read from the text config (transformers' ``get_text_config()``); where
both have one the top level wins for the ids (as transformers' generation config takes them) and the smaller limit
for the length; a classifier's padding id is the one transformers pools by (the text config's).

Phi-4-multimodal and GIT (flat configs, their ids at the top level) are the controls. Tiny models built from their
configs, no download.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf

from headlab.model_description import describe_model
from support.family_matrix import perturbed_model
from test_mla_pruning import glm5_next, mistral_large4
from test_multimodal_towers import gemma3, gemma4, git, got_ocr2, granite_speech, llava
from test_tower_numbering import mllama, modernvbert, nemo_speechlm, phi4_multimodal, ultravbert

WRAPPERS = {
    "modernvbert": modernvbert, "ultravbert": ultravbert, "phi4_multimodal": phi4_multimodal, "mllama": mllama,
    "llava": llava, "gemma3": gemma3, "gemma4": gemma4, "git": git, "got_ocr2": got_ocr2,
    "granite_speech": granite_speech, "granite_speech_plus": lambda: granite_speech(plus=True),
    "mistral_large4": mistral_large4, "glm5_next": lambda: glm5_next(["indexed_attention"] * 2),
    "nemo_speechlm": nemo_speechlm,
}


def _text_model_alone(wrapper: torch.nn.Module) -> torch.nn.Module:
    """The wrapper's text model built from its text config alone (its own weights do not matter here)."""
    config = copy.deepcopy(wrapper.config.get_text_config())
    if isinstance(config, tf.MllamaTextConfig):  # no auto class takes it
        return tf.MllamaForCausalLM(config)
    return tf.AutoModel.from_config(config)


def _fields(model: torch.nn.Module) -> dict:
    info = describe_model(model)
    return {"pad_id": info.pad_id, "eos_ids": info.eos_ids, "special_ids (pad, eos, bos, sep, cls)": info.special_ids,
            "decoder_start_id": info.decoder_start_id, "max_length": info.max_length}


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_a_wrapper_is_described_as_its_text_model(wrapper):
    """Before: ModernVBERT, UltraVBERT and Mllama padded with 0 (Mllama: its EOS, 1), took 512 tokens, and had
    no special ids but the padding one."""
    model = WRAPPERS[wrapper]()
    got, want = _fields(model), _fields(_text_model_alone(model))
    assert got == want
    assert got["pad_id"] == 2 and 1 in got["eos_ids"] and got["max_length"] == 64


def test_the_top_levels_ids_win_and_the_smaller_length():
    """A wrapper whose top level sets ids and a limit of its own: its ids win (transformers' generation config
    takes the outer attributes first), the text config's fill what it lacks, and the smaller limit holds."""
    model = modernvbert()
    model.config.pad_token_id, model.config.max_position_embeddings = 5, 32
    info = describe_model(model)
    assert info.pad_id == 5 and info.eos_ids == {1} and {0, 1, 5} <= info.special_ids and 2 not in info.special_ids
    assert info.max_length == 32
    model.config.max_position_embeddings = 128
    assert describe_model(model).max_length == 64


def test_a_wrapped_classifier_pads_as_transformers_pools():
    """Gemma 3's classifier pools at the last token that is not its text config's padding id
    (``GenericForSequenceClassification``); describe_model pads with that id and LRP reads the logits there."""
    from headlab.importance.lrp import _pooled_positions

    config = gemma3().config
    model = perturbed_model(tf.Gemma3ForSequenceClassification, config, attn_implementation="eager")
    model.config.pad_token_id = 5  # the top level disagrees: transformers pools by the text config's 2
    assert describe_model(model).pad_id == 2
    ids = torch.tensor([[7, 8, 9, 2, 2], [7, 8, 5, 9, 2]])
    assert _pooled_positions(model, ids).tolist() == [2, 3]


_PE_TEXT = dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=64, bos_token_id=0, eos_token_id=1, pad_token_id=2, model_type="modernbert",
                global_attn_every_n_layers=2, local_attention=4)
_PE_ENCODER = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=4, head_dim=8)


def test_perception_encoders_are_refused_before_any_work_naming_their_media_input():
    """PE Audio's forward needs audio besides token ids. Before: attention_blocks listed its audio encoder's block as a
    running enc_self layer 0 and not its ModernBERT's, and describe_model failed with a raw NotImplementedError
    (get_input_embeddings). Its text model alone is described as the ModernBERT it is."""
    from headlab import HeadlabError, attention_blocks
    from headlab.adapters import unsupported_reason

    model = tf.PeAudioModel(tf.PeAudioConfig(text_config=_PE_TEXT, audio_config=_PE_ENCODER))
    for check in (attention_blocks, describe_model):
        with pytest.raises(HeadlabError, match=r"model_type 'pe_audio'\) is not supported: .* contrastive embedding "
                                               r"model: .* audio \(input_values\), which headlab's text inputs cannot"):
            check(model)
    assert [b.name for b in attention_blocks(model.text_model)] == ["layers.0.attn", "layers.1.attn"]
    assert describe_model(model.text_model).max_length == 64
    # their video towers need timm to build: the configs are refused as the models would be
    video = tf.PeVideoConfig(text_config=_PE_TEXT)
    assert "video (pixel_values_videos)" in unsupported_reason(video)
    assert "audio and video" in unsupported_reason(tf.PeAudioVideoConfig(text_config=_PE_TEXT))


def test_prunings_probe_pads_with_the_text_models_padding_id():
    """headlab's check of every prune pads its probe with the wrapper's padding id (before: ModernVBERT's was none,
    its padded positions random ids)."""
    from headlab.prune_check import PADS, probe_inputs

    probe = probe_inputs(modernvbert())
    assert probe["input_ids"][1, -PADS:].tolist() == [2] * PADS and probe["input_ids"][2, :PADS].tolist() == [2] * PADS
