"""The two walks over transformers' model types, benchmarks/survey_families.py and
experiments/family_sweep.py (docs/benchmarks.md): the sweep builds with the survey's sizes, builder
and walk (one copy of each, imported), and each still gives its documented line for a type."""

from __future__ import annotations

from transformers.models.auto.configuration_auto import CONFIG_MAPPING

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
