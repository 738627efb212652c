"""A pruned model of a family whose checkpoints transformers converts (renamed weights, fused experts:
``transformers.conversion_mapping``) loads with plain transformers (``from_pretrained(path,
trust_remote_code=True)``, the saved pruned_heads.py) with every weight, and equals the pruned model.

transformers looks a model's conversion up by class name, then by ``model_type``, for the model and for
each sub-model that an ancestor's lookup does not already cover; a class defined outside transformers
(PrunedModel) is skipped unless its name is registered. Session 25 (fam10) found A.X-K1's
``post_mlp_layernorm`` left newly initialised: pruned_heads.py registered the model type's list under
PrunedModel's name, so that the inner model (AXK1Model, looked up by model type) applied it a second
time, renaming the norm twice (transformers' ignore list hid the unexpected key). It now registers the
original class's own entry (none for A.X-K1): looked up by model type, as the original class is. And a
load that leaves a weight newly initialised or one of the checkpoint unused raises instead.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file
from transformers import conversion_mapping
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from headlab import attention_blocks, load_pruned, prune_heads, save_pruned
from support import discovered, family_matrix, models
from support.converted import CONVERTED, tiny_config, tiny_model


def _loader(directory, model: torch.nn.Module):
    auto = next(iter(json.loads((directory / "config.json").read_text()).get("auto_map", {})), None)
    return getattr(tf, auto) if auto else type(model)  # a standard config: the original class


def _inputs() -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 99, (2, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("model_type", CONVERTED)
def test_plain_transformers_loads_every_weight_of_a_pruned_converted_family(model_type, tmp_path):
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {model_type}")
    model = tiny_model(model_type)
    assert conversion_mapping.get_model_conversion_mapping(model, add_legacy=False), "no conversion: not this list"
    spec = {}
    for block in attention_blocks(model):  # the last head of the first two blocks: layers that differ
        if block.n_heads >= 2 and len(spec) < 2:
            spec[block.key] = [block.n_heads - 1]
    prune_heads(model, spec)
    inputs = _inputs()
    with torch.no_grad():
        expected = model(**inputs).logits
    save_pruned(model, tmp_path)
    assert json.loads((tmp_path / "headlab_pruning.json").read_text())["portable"]["how"] == "remote code"
    plain, info = _loader(tmp_path, model).from_pretrained(tmp_path, trust_remote_code=True,
                                                            attn_implementation="eager", output_loading_info=True)
    assert type(plain).__name__ == "PrunedModel"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert plain.state_dict().keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():  # the weights themselves, not only their names
        assert torch.equal(plain.state_dict()[name], tensor), name
    with torch.no_grad():
        torch.testing.assert_close(plain.eval()(**inputs).logits, expected, atol=1e-6, rtol=0)
    reloaded = load_pruned(tmp_path)
    reloaded.config._attn_implementation = "eager"
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**inputs).logits, expected, atol=1e-6, rtol=0)


def test_every_converted_family_of_the_test_matrix_is_in_the_round_trip():
    """The families of tests/support that transformers converts are all in CONVERTED (by model type)."""
    tables = (models.CONFIGS, family_matrix.CONFIGS, family_matrix.SHARED, family_matrix.HYBRID,
              discovered.DISCOVERED)
    converted = set()
    for table in tables:
        for build in table.values():
            cls, config = build()
            with torch.device("meta"):
                model = cls(config)
            if conversion_mapping.get_model_conversion_mapping(model, add_legacy=False):
                converted.add(config.model_type)
    assert converted and converted <= set(CONVERTED), converted - set(CONVERTED)
    with torch.device("meta"):  # and each of CONVERTED is converted (the list stays true)
        from support.converted import model_class

        unconverted = [t for t in CONVERTED if t in CONFIG_MAPPING and not conversion_mapping.get_model_conversion_mapping(
            model_class(tiny_config(t))(tiny_config(t)), add_legacy=False)]
    assert not unconverted


@pytest.mark.parametrize("damage", ["missing", "unexpected"])
def test_a_plain_load_that_leaves_a_weight_newly_initialised_raises(damage, tmp_path):
    """Whatever transformers' conversions do in a later version: pruned_heads.py refuses a load that left
    a weight of the pruned model newly initialised, or one of the checkpoint unused (before, transformers
    warned and returned a different model)."""
    model = models.tiny_model("llama")
    prune_heads(model, {("dec_self", 0): [0], ("dec_self", 1): [1, 2]})  # layers that differ: remote code
    save_pruned(model, tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    if damage == "missing":
        del weights["model.layers.1.post_attention_layernorm.weight"]
    else:
        weights["model.layers.1.post_attention_layernorm.extra"] = torch.zeros(3)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(RuntimeError, match=r"did not load the pruned LlamaForCausalLM exactly.*post_attention_layernorm"):
        tf.AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True)
