"""The two walks over transformers' model types, benchmarks/survey_families.py and
experiments/family_sweep.py (docs/benchmarks.md): the sweep builds with the survey's sizes, builder
and walk (one copy of each, imported), and each still gives its documented line for a type."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from headlab import attention_blocks
from support.experiments import load_experiment

sweep = load_experiment("family_sweep")
import survey_families as survey  # noqa: E402  (benchmarks/, put on the path by the sweep as when it runs)


def test_the_sweep_builds_with_the_surveys_code():
    assert sweep.SIZES is survey.SIZES
    assert sweep.tiny is survey.tiny and sweep.found_by is survey.found_by
    assert [t for t, _ in survey.model_types(["llama", "gpt2", "no-such-type"])] == ["gpt2", "llama"]


def test_the_survey_line_of_a_type():
    assert survey.survey("gpt2", CONFIG_MAPPING["gpt2"]) == ("table", "2 blocks; capture equals output_attentions")
    assert survey.survey("biogpt", CONFIG_MAPPING["biogpt"]) == (
        "discovered", "2 blocks; capture equals output_attentions")
    # blenderbot's config names its sizes otherwise (d_model, encoder_layers...): over 3M parameters
    assert survey.survey("blenderbot", CONFIG_MAPPING["blenderbot"]) == ("skipped", survey.TOO_LARGE)


def test_the_sweep_line_of_a_type():
    assert sweep.sweep("llama", CONFIG_MAPPING["llama"], 30) == ("pass", "", "LlamaForCausalLM: table, 2 dec_self")
    # the classes in the sweep's order: a sequence-to-sequence LM first, the causal LM with --causal-first
    assert sweep.model_class(CONFIG_MAPPING["bart"]).__name__ == "BartForConditionalGeneration"
    sweep.CAUSAL_FIRST = True
    try:
        assert sweep.model_class(CONFIG_MAPPING["bart"]).__name__ == "BartForCausalLM"
    finally:
        sweep.CAUSAL_FIRST = False


def test_a_composite_configs_text_model_is_built_from_its_text_config():
    # as transformers' auto classes build it (Qwen3_5ForCausalLM takes a Qwen3_5TextConfig); before, the sweep
    # built it from the composite config and skipped the type ("no attribute 'layer_types'")
    config_class = CONFIG_MAPPING["qwen3_5"]
    cls = sweep.model_class(config_class)
    sizes = {**survey.SIZES, **sweep.EXTRA_SIZES, **sweep.OVERRIDES["qwen3_5"]}
    model = survey.tiny(config_class, cls, sizes)
    assert type(model.config).__name__ == "Qwen3_5TextConfig"
    assert model.config.layer_types == ["linear_attention", "full_attention"] and model.config.vocab_size == 99


def test_the_sweep_checks_that_idle_blocks_do_not_run():
    # an audio tower that token ids never reach: left out of the checks after it is seen not to run
    assert sweep.sweep("qwen2_audio", CONFIG_MAPPING["qwen2_audio"], 60) == (
        "pass", "", "Qwen2AudioForConditionalGeneration: discovered, 2 dec_self; 1 idle (enc_self)")
    config_class = CONFIG_MAPPING["llama"]
    model, _ = sweep.build(config_class, sweep.model_class(config_class), "eager", torch.float64)
    blocks = [dataclasses.replace(b, idle=b.layer == 1) for b in attention_blocks(model)]
    with pytest.raises(sweep.Fail, match=r"model.layers.1.self_attn'\] called idle, but a forward on token ids"):
        sweep.check_idle(model, blocks, sweep.inputs_for(model))
    assert sweep.sweep("xlstm", CONFIG_MAPPING["xlstm"], 60) == ("skipped", "n/a", sweep.SKIPPED["xlstm"])


@pytest.mark.parametrize(("model_type", "expected"), [
    ("llama", ("pass", "", "LlamaForCausalLM: table, 2 dec_self")),
    ("aria_text", ("skipped", "implementation",
                   "AriaTextForCausalLM does not support flex_attention (_supports_flex_attn False)")),
    ("t5", ("refused", "implementation", "refused: reading attention probabilities: T5ForConditionalGeneration")),
    ("doge", ("refused-late", "own", "HeadlabError after the blocks were found: its flex_attention logits differ "
                                     "from eager's")),
])
def test_the_sweep_under_flex_attention(monkeypatch, model_type, expected):
    """``--attn-implementation flex_attention`` (session 46): the checked models are built with it (run eagerly, as
    the sweep runs them); a class without it is skipped; T5, whose own flex forward fails on the probe's batch, and
    Doge, whose flex forward is not eager's, are refused by headlab (a FAIL where headlab reads Doge: below)."""
    monkeypatch.setattr(sweep, "ATTN_IMPLEMENTATION", "flex_attention")
    with torch.compiler.set_stance("force_eager"):
        outcome, check, message = sweep.sweep(model_type, CONFIG_MAPPING[model_type], 60)
    assert (outcome, check) == expected[:2] and message.startswith(expected[2]), message


def test_the_sweep_fails_a_flex_model_whose_forward_headlab_does_not_read(monkeypatch):
    from headlab.adapters import families

    monkeypatch.setattr(sweep, "ATTN_IMPLEMENTATION", "flex_attention")
    monkeypatch.delitem(families.FLEX_REFUSED, "doge")  # headlab as before session 46
    with torch.compiler.set_stance("force_eager"):
        outcome, check, message = sweep.sweep("doge", CONFIG_MAPPING["doge"], 60)
    assert (outcome, check) == ("FAIL", "own") and "capture_attention reads it" in message, message
