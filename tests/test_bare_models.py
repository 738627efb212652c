"""A bare model (no language-model head: it returns hidden states, no logits) and the measures that need a loss.

GLM-5-Next's text model (``glm5_next_text``) loads as the bare ``Glm5NextTextModel``: transformers 5.24 has no
causal LM class for it (its LM head is the multimodal ``Glm5NextForConditionalGeneration``'s, tests/test_mla_pruning.py).
headlab's importance measures that differentiate a loss or explain logits (gradient, ablation, LRP) are refused
naming the missing head, and ``prune train`` (gates trained on a loss) is refused before any work: before, its
``--loss auto`` took a bare model for a masked LM (or stopped on the tokenizer's mask token), and ``causal_lm``
failed on ``.logits`` after the run had begun. No loss is ever computed on hidden states.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from transformers import CONFIG_MAPPING

from headlab import HeadlabError, importance
from headlab.pruning.train import PruneConfig, encode_monolingual_corpus, prune_train
from headlab.training.config import TrainConfig
from support.family_matrix import perturbed_model
from support.treebank import word_tokenizer

WORDS = ["the", "a", "cat", "dog", "sat", "on", "mat", "ran"]
TEXTS = ["the cat sat on the mat", "a dog ran", "the dog sat", "a cat ran on the mat"]
_GLM5_NEXT = dict(vocab_size=99, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=64, bos_token_id=0, eos_token_id=1, pad_token_id=2,
                  q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=0, v_head_dim=8,
                  index_topk=4, index_n_heads=2, index_head_dim=8, index_kpool=2, linear_head_dim=8, linear_num_heads=4,
                  hc_mult=2, mlp_layer_types=["dense", "dense"], layer_types=["indexed_attention"] * 2)


def glm5_next_text() -> torch.nn.Module:
    if "glm5_next_text" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no glm5_next_text")
    return perturbed_model(tf.Glm5NextTextModel, CONFIG_MAPPING["glm5_next_text"](**_GLM5_NEXT))


def llama_model() -> torch.nn.Module:
    return perturbed_model(tf.LlamaModel, tf.LlamaConfig(
        vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=1, pad_token_id=2))


BARE = {"glm5_next_text": glm5_next_text, "llama": llama_model}


def test_glm5_next_text_has_no_causal_lm_class_and_loads_bare():
    """What the refusals below are about: transformers' causal-LM auto class has no entry for glm5_next_text, so
    headlab builds the bare model."""
    from headlab.checkpoint import model_class_for

    config = CONFIG_MAPPING["glm5_next_text"](**_GLM5_NEXT) if "glm5_next_text" in CONFIG_MAPPING else None
    if config is None:
        pytest.skip("this transformers has no glm5_next_text")
    assert type(config) not in tf.AutoModelForCausalLM._model_mapping
    assert model_class_for(config) is tf.Glm5NextTextModel


@pytest.mark.parametrize("measure", ["gradient", "ablation", "lrp"])
def test_loss_and_logit_measures_are_refused_on_glm5_next_text_naming_the_missing_head(measure):
    model = glm5_next_text()
    with pytest.raises(HeadlabError, match=f"cannot run {measure}: the model has no language-model head"):
        importance(model, word_tokenizer(WORDS, style="gpt2"), TEXTS, measures=measure)
    assert list(importance(model, word_tokenizer(WORDS, style="gpt2"), TEXTS, measures="all").scores) == ["confidence"]


@pytest.mark.parametrize("loss", ["auto", "causal_lm", "masked_lm"])
@pytest.mark.parametrize("family", BARE)
def test_prune_train_refuses_a_bare_model_before_any_work(family, loss, tmp_path):
    """A bare Llama: before, auto gave a masked-LM loss (or the mask-token error), causal_lm an AttributeError on
    .logits with the output directory already written. GLM-5-Next's text model too (until session 38 it was refused
    first for the pruning its run ends in, an unchecked latent attention; its attention prunes since)."""
    model, tokenizer = BARE[family](), word_tokenizer(WORDS, style="gpt2")
    data = encode_monolingual_corpus(tokenizer, TEXTS, 64)
    train = TrainConfig(out_dir=str(tmp_path / "r"), max_tokens=400, lr=1e-3, warmup_steps=0, schedule="constant",
                        max_epochs=1, validate=False, keep_epoch_checkpoints=False, progress=False, seed=3)
    config = PruneConfig(gates="all", lam=0.0, log_every=5, eval_beam=1, gate_lr=0.1, loss=loss, train=train)
    calls: list = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    why = rf"prune train needs a loss, hence a language-model head, and {type(model).__name__} has none \(a bare model"
    with pytest.raises(HeadlabError, match=why):
        prune_train(model, tokenizer, data, None, config)
    assert not (tmp_path / "r").exists()
