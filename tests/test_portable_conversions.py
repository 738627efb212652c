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

Session 26 (port11): that entry is keyed by the one name ``PrunedModel`` of every family, so pruned models
of two families in one process (a thread loading one while another builds the other; a model built from
its config and saved later) could get each other's; and transformers' ignore lists could hide a key of a
projection headlab resized from the report that pruned_heads.py checks.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file
from transformers import conversion_mapping, modeling_utils
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from headlab import attention_blocks, load_pruned, prune_heads, save_pruned
from headlab.portable import CODE_FILE
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
def test_plain_transformers_loads_every_weight_of_a_pruned_converted_family(model_type, tmp_path, monkeypatch):
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
    raw = []  # the report before transformers' ignore lists: they hid nothing either
    adjust = tf.PreTrainedModel._adjust_missing_and_unexpected_keys

    def spy(self, loading_info) -> None:
        raw.append((set(loading_info.missing_keys), set(loading_info.unexpected_keys)))
        adjust(self, loading_info)

    monkeypatch.setattr(tf.PreTrainedModel, "_adjust_missing_and_unexpected_keys", spy)
    plain, info = _loader(tmp_path, model).from_pretrained(tmp_path, trust_remote_code=True,
                                                            attn_implementation="eager", output_loading_info=True)
    assert type(plain).__name__ == "PrunedModel"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert raw == [(set(), set())], raw
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


@pytest.mark.parametrize("damage", ["missing", "unexpected", "mismatched"])
def test_a_plain_load_that_leaves_a_weight_newly_initialised_raises(damage, tmp_path):
    """Whatever transformers' conversions do in a later version: pruned_heads.py refuses a load that left
    a weight of the pruned model newly initialised, or one of the checkpoint unused (before, transformers
    warned and returned a different model). Also one of another shape under ``ignore_mismatched_sizes=True``,
    which transformers initialises anew and reports apart (port11: it was not checked)."""
    model = models.tiny_model("llama")
    prune_heads(model, {("dec_self", 0): [0], ("dec_self", 1): [1, 2]})  # layers that differ: remote code
    save_pruned(model, tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    if damage == "missing":
        del weights["model.layers.1.post_attention_layernorm.weight"]
    elif damage == "unexpected":
        weights["model.layers.1.post_attention_layernorm.extra"] = torch.zeros(3)
    else:
        weights["model.layers.1.post_attention_layernorm.weight"] = torch.ones(5)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(RuntimeError, match=r"did not load the pruned LlamaForCausalLM exactly.*post_attention_layernorm"):
        tf.AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True,
                                                ignore_mismatched_sizes=damage == "mismatched")


def _pruned_directory(family: str, path):
    """A pruned GPT-NeoX (fused q/k/v; transformers renames its checkpoint's embed_out to lm_head) or
    Llama (no conversion) saved with remote code (layers that differ)."""
    if family == "gpt_neox":
        model = family_matrix.tiny_model("gpt_neox", attn_implementation="eager")
        prune_heads(model, {("dec_self", 0): [1], ("dec_self", 1): [0, 2]})
    else:
        model = models.tiny_model("llama", attn_implementation="eager")
        prune_heads(model, {("dec_self", 0): [0], ("dec_self", 1): [1, 2]})
    save_pruned(model, path)
    assert (path / CODE_FILE).exists()
    return model


def _same_weights(loaded: torch.nn.Module, model: torch.nn.Module) -> None:
    assert loaded.state_dict().keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_two_families_loaded_at_once_each_get_their_own_conversion(tmp_path, monkeypatch):
    """Every pruned model is a ``PrunedModel``, and transformers keeps one conversion per class name in
    one dict: the entry is the last pruned model's built, of whatever family. A Llama built by another
    thread between the GPT-NeoX model's construction and transformers' lookup of its conversion gave it
    Llama's (none): GPT-NeoX's embed_out was left unread and lm_head newly initialised (refused, port10).
    Now a registration waits for that lookup (one lock for every pruned_heads.py of the process)."""
    neox = _pruned_directory("gpt_neox", tmp_path / "neox")
    llama = _pruned_directory("llama", tmp_path / "llama")
    waiting = threading.Event()  # the Llama thread is done, or waits for the lock (held by the GPT-NeoX load)

    class Lock:  # the lock pruned_heads.py takes, saying when the other thread reaches it
        def __init__(self) -> None:
            self.lock = threading.RLock()

        def __enter__(self):
            if threading.current_thread() is other:
                waiting.set()
            self.lock.acquire()

        def __exit__(self, *exc) -> None:
            self.lock.release()

    monkeypatch.setattr(conversion_mapping, "_headlab_pruned_model_lock", Lock(), raising=False)
    loaded = {}

    def load_llama() -> None:
        loaded["llama"] = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "llama", trust_remote_code=True)
        waiting.set()

    other = threading.Thread(target=load_llama)
    lookup = modeling_utils.get_model_conversion_mapping

    def in_between(model, *args, **kwargs):  # GPT-NeoX built, its conversion not yet looked up
        if model.config.model_type == "gpt_neox" and not waiting.is_set():
            other.start()
            assert waiting.wait(120), "the Llama thread neither finished nor waited for the lock"
        return lookup(model, *args, **kwargs)

    monkeypatch.setattr(modeling_utils, "get_model_conversion_mapping", in_between)
    loaded["gpt_neox"] = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "neox", trust_remote_code=True)
    other.join(120)
    assert not other.is_alive() and "llama" in loaded
    _same_weights(loaded["gpt_neox"], neox)
    _same_weights(loaded["llama"], llama)


@pytest.mark.parametrize(("built", "then"), [("llama", "gpt_neox"), ("gpt_neox", "llama")])
def test_a_pruned_model_built_in_the_process_saves_with_its_own_conversion(built, then, tmp_path):
    """save_pretrained converts the weights back with the model's conversion, looked up by class name at
    save time for a model not loaded by from_pretrained: a pruned Llama built from its config after a
    pruned GPT-NeoX was loaded wrote its lm_head as GPT-NeoX's embed_out (a directory no load reads back),
    and a pruned GPT-NeoX built before a Llama wrote lm_head where GPT-NeoX's checkpoints hold embed_out.
    Now each model keeps the conversion it was built with."""
    model = _pruned_directory(built, tmp_path / built)
    _pruned_directory(then, tmp_path / then)
    plain = tf.AutoModelForCausalLM.from_pretrained(tmp_path / built, trust_remote_code=True)
    fresh = type(plain)(plain.config)  # built here, as from_config builds it
    fresh.load_state_dict(plain.state_dict())
    tf.AutoModelForCausalLM.from_pretrained(tmp_path / then, trust_remote_code=True)
    fresh.save_pretrained(tmp_path / "saved")
    assert load_file(tmp_path / "saved" / "model.safetensors").keys() == load_file(
        tmp_path / built / "model.safetensors").keys()
    _same_weights(tf.AutoModelForCausalLM.from_pretrained(tmp_path / "saved", trust_remote_code=True), model)


@pytest.mark.parametrize("side", ["missing", "unexpected"])
def test_an_ignore_list_never_hides_a_weight_of_a_pruned_projection(side, tmp_path, monkeypatch):
    """transformers drops the keys a family's ignore lists match (``_keys_to_ignore_on_load_missing`` /
    ``_unexpected``, regular expressions) from the report that pruned_heads.py checks. In transformers
    5.24 the only such list that matches a projection headlab prunes is GPT-2's ``attn.bias`` (meant for
    an old mask buffer; it matches ``attn.c_attn.bias``), on the unexpected side only, where the model's
    own key would still be reported missing. A family's list on either side (set here on GPT-2) let a
    resized projection's bias be left at its initialisation, or a tensor under it unread, with no
    error. Now keys under a projection headlab resized are reported whatever the lists say."""
    model = models.tiny_model("gpt2")
    prune_heads(model, {("dec_self", 0): [0, 3], ("dec_self", 1): [1]})
    save_pruned(model, tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    if side == "missing":
        del weights["transformer.h.1.attn.c_attn.bias"]
        monkeypatch.setattr(tf.GPT2PreTrainedModel, "_keys_to_ignore_on_load_missing", [r"attn\.c_attn\.bias"])
    else:
        weights["transformer.h.1.attn.c_attn.scale"] = torch.ones(3)
        monkeypatch.setattr(tf.GPT2PreTrainedModel, "_keys_to_ignore_on_load_unexpected", [r"attn\.c_attn\.scale"])
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(RuntimeError, match=r"did not load the pruned GPT2LMHeadModel exactly.*h\.1\.attn\.c_attn\."):
        tf.AutoModelForCausalLM.from_pretrained(tmp_path, trust_remote_code=True)
