"""A saved directory loads as the class it was saved from (session 28, class28).

Every tiny model of tests/support (the family matrix, the discovered families, the MLA families) and the multimodal
wrappers of the tower tests is saved with ``save_pretrained`` from its head class, and the directory goes through
headlab's directory loader: ``check_supported`` (what every command runs first), ``build_from_config`` (the structure
``headlab heads`` lists) and ``load_model``. Each must give the saved class, with every tensor as saved, or be refused
before any work naming why. Before, the class came from the first auto table that had the model type, the name in
config.json's ``architectures`` deciding only among those: a ``Glm5NextForConditionalGeneration``,
``MistralLarge4ForConditionalGeneration`` or ``LlavaForConditionalGeneration`` directory was built as the bare model
(listed without its LM head, refused by load_model: "lm_head.weight ... not in the model"), a ``Mistral4ForCausalLM``
too, and a token classifier was built as the masked or causal LM (refused naming the missing LM-head tensors).

The documented exceptions (``checkpoint.model_class_for``): a multimodal checkpoint whose language model
``AutoModelForCausalLM`` builds alone on its text config loads as that causal LM (Qwen3.5's; Mllama's is then refused
naming its towers' tensors and how to save the text model), and a class of a kind headlab does not analyse (token
classification, question answering) is refused naming it.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from headlab import HeadlabError
from headlab.checkpoint import model_class_for
from headlab.loading import build_from_config, check_supported, load_config, load_model
from support import discovered, family_matrix, models
from support.family_matrix import perturbed_model

BUILDERS = {
    **{f"models:{name}": (lambda name=name: perturbed_model(*models.CONFIGS[name]())) for name in models.CONFIGS},
    **{f"matrix:{name}": (lambda name=name: family_matrix.tiny_model(name))
       for table in (family_matrix.CONFIGS, family_matrix.SHARED, family_matrix.HYBRID, family_matrix.REFUSED)
       for name in table},
    **{f"discovered:{name}": (lambda name=name: discovered.tiny_model(name)) for name in discovered.DISCOVERED},
}


def _tower(module: str, name: str, *args):
    def build():
        import importlib

        return getattr(importlib.import_module(module), name)(*args)
    return build


TOWERS = {
    "llava": _tower("test_multimodal_towers", "llava"),
    "gemma3": _tower("test_multimodal_towers", "gemma3"),
    "gemma4": _tower("test_multimodal_towers", "gemma4"),
    "got_ocr2": _tower("test_multimodal_towers", "got_ocr2"),
    "granite_speech": _tower("test_multimodal_towers", "granite_speech"),
    "granite_speech_plus": _tower("test_multimodal_towers", "granite_speech", True),
    "git": _tower("test_multimodal_towers", "git"),
    "glm5_next": _tower("test_mla_pruning", "glm5_next", ["indexed_attention"] * 2),
    "glm5_next_text": _tower("test_bare_models", "glm5_next_text"),
    "mistral_large4": _tower("test_mla_pruning", "mistral_large4"),
    "modernvbert": _tower("test_tower_numbering", "modernvbert"),
    "ultravbert": _tower("test_tower_numbering", "ultravbert"),
    "phi4_multimodal": _tower("test_tower_numbering", "phi4_multimodal"),
    "nemo_speechlm": _tower("test_tower_numbering", "nemo_speechlm"),
    "mllama": _tower("test_tower_numbering", "mllama"),
    "dots3_note": _tower("test_output_gates", "dots3_note_multimodal"),
}
BUILDERS.update({f"towers:{name}": build for name, build in TOWERS.items()})
BUILDERS.update({f"mla:{name}": _tower("test_mla_pruning", "tiny_model", name)
                 for name in ("deepseek_v3", "mistral4", "glm_moe_dsa", "dots3_note_text")})


def _qwen3_5() -> torch.nn.Module:
    _, text = family_matrix.qwen3_next("qwen3_5_text", ["linear_attention", "full_attention"])
    config = tf.Qwen3_5Config(text_config=text.to_dict(), vision_config=dict(depth=1, hidden_size=16, num_heads=2,
                                                                            intermediate_size=16, out_hidden_size=32))
    return perturbed_model(tf.Qwen3_5ForConditionalGeneration, config)


BUILDERS["towers:qwen3_5"] = _qwen3_5

# The other heads of the small families: (the LM class's name -> the stem) + suffix
_HEADS = ("ForSequenceClassification", "Model", "ForTokenClassification", "ForQuestionAnswering")


def _head(family: str, suffix: str):
    def build():
        cls, config = models.CONFIGS[family]()
        stem = {"MarianMTModel": "Marian", "GPT2LMHeadModel": "GPT2"}.get(cls.__name__, cls.__name__)
        for ending in ("ForConditionalGeneration", "ForCausalLM", "ForMaskedLM"):
            stem = stem.removesuffix(ending)
        head = getattr(tf, stem + suffix, None)
        if head is None:
            pytest.skip(f"transformers has no {stem}{suffix}")
        return perturbed_model(head, config)
    return build


BUILDERS.update({f"{suffix}:{family}": _head(family, suffix) for family in models.CONFIGS for suffix in _HEADS})

# What each directory is refused for (the message's words), before any work: check_supported refuses it.
REFUSED = {
    "matrix:deberta": r"model_type 'deberta'\) is not supported: DeBERTa \(v1\)",
    "matrix:whisper": r"model_type 'whisper'\) is not supported: Whisper is a speech model",
    **{f"{suffix}:{family}": rf"architectures names \w+{suffix}, a {kind} model \(transformers' AutoModelFor"
       rf"{suffix[3:]}\); headlab analyses language models .* save its base model"
       for family in models.CONFIGS for suffix, kind in (("ForTokenClassification", "token classification"),
                                                         ("ForQuestionAnswering", "question answering"))},
}
# Loaded as the causal LM of their text config (AutoModelForCausalLM's class for the multimodal type), whose logits
# on token ids are the wrapper's; refused when the wrapper's other tensors are not ignorable, after the weights' check.
TEXT_MODEL = {"towers:qwen3_5": "Qwen3_5ForCausalLM", "towers:mllama": "MllamaForCausalLM",
              "towers:dots3_note": "Dots3NoteForCausalLM"}
TEXT_REFUSED = {"towers:mllama": r"is a multimodal 'mllama' checkpoint: headlab analyses its language model, "
                                 r"MllamaForCausalLM .* Save the language model alone",
                "towers:dots3_note": r"is a multimodal 'dots3_note' checkpoint: headlab analyses its language model, "
                                     r"Dots3NoteForCausalLM"}


@pytest.mark.parametrize("key", BUILDERS)
def test_a_saved_directory_loads_as_the_class_it_was_saved_from(key, tmp_path):
    model = BUILDERS[key]()
    model.save_pretrained(tmp_path)
    saved = type(model).__name__
    assert load_config(str(tmp_path)).architectures == [saved]
    if key in REFUSED:
        with pytest.raises(HeadlabError, match=REFUSED[key]):
            check_supported(str(tmp_path))
        with pytest.raises(HeadlabError, match=REFUSED[key]):
            load_model(str(tmp_path))
        return
    expected = TEXT_MODEL.get(key, saved)
    check_supported(str(tmp_path))
    assert model_class_for(load_config(str(tmp_path))).__name__ == expected
    assert type(build_from_config(str(tmp_path))).__name__ == expected
    if key in TEXT_REFUSED:
        with pytest.raises(HeadlabError, match=TEXT_REFUSED[key]):
            load_model(str(tmp_path))
        return
    loaded = load_model(str(tmp_path))
    assert type(loaded).__name__ == expected
    if key in TEXT_MODEL:  # the language model's tensors, each as saved (the wrapper names them by another path)
        ids = torch.tensor([[5, 6, 7, 8, 9]])
        with torch.no_grad():
            assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
        return
    state = loaded.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(state[name], tensor), name


def test_a_pretraining_checkpoint_loads_as_its_masked_lm(tmp_path):
    """BertForPreTraining (bert-base-uncased's own class): its masked LM, whose allow-list covers the pooler and the
    next-sentence head (checkpoint.ALLOWED_UNEXPECTED); before, the first LM class, BertLMHeadModel, a decoder."""
    cls, config = models.CONFIGS["bert"]()
    pretraining = perturbed_model(tf.BertForPreTraining, config)
    pretraining.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    assert type(loaded) is tf.BertForMaskedLM is cls
    assert torch.equal(loaded.cls.predictions.decoder.weight, pretraining.cls.predictions.decoder.weight)


def test_a_class_transformers_lacks_gets_the_first_language_model_class():
    """A remote-code class name (not in transformers) or none: the model type's first LM class, as before."""
    _, config = models.CONFIGS["llama"]()
    assert model_class_for(config) is tf.LlamaForCausalLM
    config.architectures = ["MyLlamaForCausalLM"]
    assert model_class_for(config) is tf.LlamaForCausalLM
    config.architectures = ["BertForMaskedLM"]  # another model type's class: not this config's
    assert model_class_for(config) is tf.LlamaForCausalLM
