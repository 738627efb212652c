"""The committed pruned models load, and are what their result files and cards say."""

import json
from pathlib import Path

import pytest

from headlab import count_parameters, load_pruned
from headlab.pruning.train import heads_per_kind

MODELS = Path(__file__).resolve().parents[1] / "models"


@pytest.mark.parametrize("name", ["multi30k-en-de-pruned-enc", "multi30k-en-de-pruned-all"])
def test_committed_pruned_model_matches_its_record(name):
    directory = MODELS / name
    result = json.loads((directory / "prune_result.json").read_text())
    model = load_pruned(directory)
    assert heads_per_kind(model) == result["heads_kept"]
    assert count_parameters(model) == result["metrics"]["parameters_after"]
    card = (directory / "README.md").read_text()
    assert f"{result['metrics']['bleu']:.2f}" in card
    for kind, kept in result["heads_kept"].items():
        assert f"| {kind} | {kept} | 48 |" in card


@pytest.mark.parametrize("name", ["multi30k-en-de-pruned-enc", "multi30k-en-de-pruned-all"])
def test_committed_pruned_models_config_plan_records_the_kept_heads(name):
    """config.json's plan (what pruned_heads.py reads under plain transformers, and what an adapter's record is
    compared with) is the plan headlab writes for the model: ``kept`` included, as in headlab_pruning.json."""
    from headlab.surgery import pruning_plan

    config = json.loads((MODELS / name / "config.json").read_text())
    assert config["headlab_pruned"] == pruning_plan(load_pruned(MODELS / name))
    assert config["headlab_pruned"]["kept"]
