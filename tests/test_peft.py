"""PEFT adapters (LoRA) and headlab's pruned models (peft is optional: these tests skip without it).

A pruned model loaded with plain transformers is a ``PrunedModel`` of every family, and transformers
keys its weight conversions by class name (tests/test_portable_conversions.py). Its adapter loading
(``load_adapter``) looks the model's conversion up by class name again, from that one shared entry:
these check that a LoRA adapter trained on a pruned Llama or GPT-NeoX (whose conversion renames
embed_out) comes back with the same logits onto the model rebuilt by ``load_pruned`` and by plain
transformers, with both families loaded in one process, through transformers' ``load_adapter`` and
peft's ``PeftModel.from_pretrained``; and that an adapter of the unpruned model (other shapes) is refused.

headlab itself reads, masks and prunes plain projections: a model with an adapter layer on an attention
projection is refused with a message that says so, and save_pruned refuses a model carrying an adapter.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file

import headlab
from headlab import HeadlabError, attention_blocks, load_pruned, prune_heads, save_pruned
from support import family_matrix, models

peft = pytest.importorskip("peft")

TARGETS = {"llama": ["q_proj", "k_proj", "v_proj", "o_proj"], "gpt_neox": ["query_key_value", "dense"]}
PRUNED = {"llama": {("dec_self", 0): [0], ("dec_self", 1): [1, 2]},
          "gpt_neox": {("dec_self", 0): [1], ("dec_self", 1): [0, 2]}}
OTHER = {"llama": {("dec_self", 0): [3], ("dec_self", 1): [0, 3]},  # the same head counts, other heads
         "gpt_neox": {("dec_self", 0): [2], ("dec_self", 1): [1, 3]}}


def _model(family: str) -> torch.nn.Module:
    """A tiny Llama (grouped keys and values) or GPT-NeoX (fused q/k/v), eager attention."""
    source = family_matrix if family == "gpt_neox" else models
    return source.tiny_model(family, attn_implementation="eager")


def _logits(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(**models.tiny_inputs("llama")).logits


def _lora(model: torch.nn.Module, family: str, directories, targets=None) -> torch.Tensor:
    """A LoRA adapter on every attention projection of ``model`` (or ``targets``), its weights random (a new
    one's B is zero: it would change nothing), saved to each of ``directories`` ({directory: recorded}: with
    headlab.save_adapter, or peft's own save_pretrained); the logits of the adapted model."""
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=targets or TARGETS[family])
    adapted = peft.get_peft_model(model, config)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    logits = _logits(adapted)
    for directory, recorded in directories.items():
        headlab.save_adapter(adapted, directory) if recorded else adapted.save_pretrained(directory)
    return logits


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each family pruned and saved (layers that differ: plain transformers loads it as a PrunedModel),
    with a LoRA adapter trained on the pruned model (saved with its record and without), one on the unpruned
    model and one on another pruning with the same head counts (its shapes the pruned model's)."""
    root = tmp_path_factory.mktemp("peft")
    expected = {}
    for family in TARGETS:
        model = _model(family)
        prune_heads(model, PRUNED[family])
        save_pruned(model, root / family)
        expected[family] = _lora(model, family, {root / f"{family}-lora": True, root / f"{family}-unrecorded": False})
        _lora(_model(family), family, {root / f"{family}-unpruned-lora": False})
        other = _model(family)
        prune_heads(other, OTHER[family])
        _lora(other, family, {root / f"{family}-other-lora": True})
        shapes = [{key: value.shape for key, value in load_file(root / f"{family}-{name}" / "adapter_model.safetensors")
                   .items()} for name in ("lora", "other-lora")]
        assert shapes[0] == shapes[1]  # every shape fits: only the record tells them apart
    return root, expected


def _plain(root, family: str) -> torch.nn.Module:
    model = tf.AutoModelForCausalLM.from_pretrained(root / family, trust_remote_code=True, attn_implementation="eager")
    assert type(model).__name__ == "PrunedModel"
    return model


def _load_pruned(root, family: str) -> torch.nn.Module:
    model = load_pruned(root / family)
    model.config._attn_implementation = "eager"
    return model


def _attach(model: torch.nn.Module, loader: str, attach: str, path) -> torch.nn.Module:
    """The checked ways to load an adapter: transformers' ``load_adapter`` (pruned_heads.py's for a model loaded by
    plain transformers; ``headlab.load_adapter`` for one from load_pruned, whose class is transformers' own) or a
    PeftModel (``peft_from_pretrained`` of pruned_heads.py; ``headlab.load_adapter(peft_model=True)``)."""
    if loader == "plain":
        if attach == "load_adapter":
            model.load_adapter(str(path))
            return model
        return model.peft_from_pretrained(model, path)
    return headlab.load_adapter(model, path, peft_model=attach == "PeftModel")


def _tuner_layers(model: torch.nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if isinstance(module, peft.tuners.tuners_utils.BaseTunerLayer)]


@pytest.mark.parametrize("family", list(TARGETS))
@pytest.mark.parametrize("loader", ["load_pruned", "plain"])
@pytest.mark.parametrize("attach", ["load_adapter", "PeftModel"])
def test_an_adapter_of_a_pruned_model_loads_back_onto_it(family, loader, attach, saved):
    root, expected = saved
    model = (_plain if loader == "plain" else _load_pruned)(root, family)
    model = _attach(model, loader, attach, root / f"{family}-lora")
    torch.testing.assert_close(_logits(model), expected[family], atol=1e-6, rtol=0)


def test_the_record_is_the_pruning_s_kept_heads(saved, tmp_path):
    """headlab_adapter.json holds config.json's kept heads per attention layer (original numbering); without headlab,
    the pruned model's own save_adapter writes it for a PeftModel around it, and the adapter loads back."""
    root, expected = saved
    kept = json.loads((root / "llama" / "config.json").read_text())["headlab_pruned"]["kept"]
    assert kept == {"model.layers.0.self_attn": [[1, 2, 3], [0, 1, 1], 4], "model.layers.1.self_attn": [[0, 3], [0, 1], 4]}
    assert json.loads((root / "llama-lora" / "headlab_adapter.json").read_text()) == {"format": 1, "kept": kept}
    assert json.loads((root / "llama-other-lora" / "headlab_adapter.json").read_text())["kept"] != kept
    model = _plain(root, "llama")
    adapted = model.peft_from_pretrained(model, root / "llama-lora")
    model.save_adapter(adapted, tmp_path / "again")
    assert json.loads((tmp_path / "again" / "headlab_adapter.json").read_text())["kept"] == kept
    model = _plain(root, "llama")
    model.load_adapter(str(tmp_path / "again"))
    torch.testing.assert_close(_logits(model), expected["llama"], atol=1e-6, rtol=0)


@pytest.mark.skipif(tuple(int(n) for n in peft.__version__.split(".")[:2]) < (0, 22),
                    reason="transformers saves a loaded adapter with peft 0.22 or later")
def test_save_pretrained_of_a_loaded_adapter_keeps_the_record(saved, tmp_path):
    root, expected = saved
    model = _plain(root, "llama")
    model.load_adapter(str(root / "llama-lora"))
    model.save_pretrained(tmp_path / "again")
    assert (tmp_path / "again" / "headlab_adapter.json").read_text() == (root / "llama-lora" / "headlab_adapter.json").read_text()


@pytest.mark.parametrize("family", list(TARGETS))
@pytest.mark.parametrize("loader", ["load_pruned", "plain"])
@pytest.mark.parametrize("attach", ["load_adapter", "PeftModel", "peft's own"])
def test_an_adapter_of_another_pruning_with_the_same_shapes_is_refused(family, loader, attach, saved):
    """Pruning B keeps other heads than A, as many per layer: every adapter shape fits A and it loaded silently, its
    q/k/v rows and output-projection columns acting on other heads. The checked loaders compare the records and
    name both; peft's own PeftModel.from_pretrained cannot hand the model the record and is refused on pruned
    attention. The adapter is taken off again: the model computes what it did."""
    root, _ = saved
    model = (_plain if loader == "plain" else _load_pruned)(root, family)
    before = _logits(model)
    error = HeadlabError if loader == "load_pruned" and attach != "peft's own" else RuntimeError
    if attach == "peft's own":
        with pytest.raises(error, match=r"adapts the attention of pruned layers .*do not show the model the "
                                        r"adapter's headlab_adapter\.json.*headlab\.load_adapter.*taken off"):
            peft.PeftModel.from_pretrained(model, root / f"{family}-other-lora")
    else:
        layer = "gpt_neox.layers.0.attention" if family == "gpt_neox" else "model.layers.0.self_attn"
        theirs, ours = ("0,1,2", "1,2,3") if family == "llama" else ("0,1,3", "0,2,3")
        name = "GPTNeoXForCausalLM" if family == "gpt_neox" else "LlamaForCausalLM"
        with pytest.raises(error, match=rf"trained on another pruning than this pruned {name}'s \(2 attention layers "
                                        rf"differ: {layer}: the adapter's heads {theirs} of 4.*, this model's heads "
                                        rf"{ours} of 4"):
            _attach(model, loader, attach, root / f"{family}-other-lora")
    assert not _tuner_layers(model) and not getattr(model, "peft_config", None)
    torch.testing.assert_close(_logits(model), before, atol=0, rtol=0)


@pytest.mark.parametrize("loader", ["load_pruned", "plain"])
@pytest.mark.parametrize("attach", ["load_adapter", "PeftModel", "peft's own"])
def test_an_adapter_on_pruned_attention_without_its_record_is_refused(loader, attach, saved):
    """Saved by peft's own save_pretrained (no headlab_adapter.json): which heads it was trained on is unknown."""
    root, _ = saved
    model = (_plain if loader == "plain" else _load_pruned)(root, "llama")
    before = _logits(model)
    if attach == "peft's own":
        with pytest.raises(RuntimeError, match="do not show the model"):
            peft.PeftModel.from_pretrained(model, root / "llama-unrecorded")
    else:
        with pytest.raises((RuntimeError, HeadlabError), match=r"adapts the attention of pruned layers "
                           r"\(model\.layers\.0\.self_attn, model\.layers\.1\.self_attn\) and has no "
                           r"headlab_adapter\.json.*headlab\.save_adapter"):
            _attach(model, loader, attach, root / "llama-unrecorded")
    assert not _tuner_layers(model)
    torch.testing.assert_close(_logits(model), before, atol=0, rtol=0)


@pytest.mark.parametrize("loader", ["load_pruned", "plain"])
def test_an_adapter_away_from_the_attention_needs_no_record(loader, saved, tmp_path):
    """An adapter on the MLP only acts on no head: peft's own save and load, as before."""
    root, _ = saved
    expected = _lora((_plain if loader == "plain" else _load_pruned)(root, "llama"), "llama", {tmp_path / "mlp": False},
                     targets=["gate_proj"])
    adapted = peft.PeftModel.from_pretrained((_plain if loader == "plain" else _load_pruned)(root, "llama"),
                                             tmp_path / "mlp")
    torch.testing.assert_close(_logits(adapted), expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("family", list(TARGETS))
@pytest.mark.parametrize("loader", ["load_pruned", "plain"])
@pytest.mark.parametrize("attach", ["load_adapter", "PeftModel"])
def test_an_adapter_of_the_unpruned_model_is_refused(family, loader, attach, saved):
    """Its q/k/v rows and output-projection columns are the unpruned model's: transformers and peft
    refuse the shapes (no adapter weight left at its initialisation). The model's load_adapter (pruned_heads.py's;
    headlab's route on a model from load_pruned, since session 29: transformers' own error pointed to its logged
    report and left the adapter on) names them and takes the adapter off; so does headlab.load_adapter."""
    root, _ = saved
    model = (_plain if loader == "plain" else _load_pruned)(root, family)
    projection = "query_key_value" if family == "gpt_neox" else "q_proj"
    if attach == "PeftModel":
        with pytest.raises(RuntimeError, match=rf"size mismatch for .*{projection}\.lora_B"):
            peft.PeftModel.from_pretrained(model, root / f"{family}-unpruned-lora")
        return
    error = RuntimeError if loader == "plain" else HeadlabError
    with pytest.raises(error, match=rf"adapter does not fit the pruned .*another shape.*{projection}\.lora_B"
                                    r".*unpruned model"):
        model.load_adapter(str(root / f"{family}-unpruned-lora"))
    assert not _tuner_layers(model) and not getattr(model, "peft_config", None)
    with pytest.raises(HeadlabError, match=rf"adapter does not fit .*another shape.*{projection}\.lora_B"):
        headlab.load_adapter(model, root / f"{family}-unpruned-lora")
    assert not _tuner_layers(model) and not getattr(model, "peft_config", None)


@pytest.mark.parametrize("family", list(TARGETS))
@pytest.mark.parametrize("loader", ["load_pruned", "plain"])
def test_peft_s_ignore_mismatched_sizes_does_not_reinitialise_an_adapter(family, loader, saved):
    """peft's ``ignore_mismatched_sizes=True`` dropped the adapter weights of another shape (a warning) and left
    them at their initialisation: the pruned model ran with another adapter than the saved one. Refused, the
    adapter taken off again, by the pruned model's load_state_dict hooks."""
    root, _ = saved
    model = (_plain if loader == "plain" else _load_pruned)(root, family)
    before = _logits(model)
    projection = "query_key_value" if family == "gpt_neox" else "q_proj"
    with pytest.raises(RuntimeError, match=rf"left \d+ adapter weights at their initialisation \(of another shape "
                                            rf"under ignore_mismatched_sizes=True.*{projection}\.lora_B"):
        peft.PeftModel.from_pretrained(model, root / f"{family}-unpruned-lora", ignore_mismatched_sizes=True)
    assert not _tuner_layers(model)
    torch.testing.assert_close(_logits(model), before, atol=0, rtol=0)


@pytest.mark.parametrize("damage", ["mismatched", "missing", "unexpected"])
@pytest.mark.parametrize("attach", ["load_adapter", "PeftModel"])
def test_plain_load_adapter_refuses_an_adapter_it_would_load_partly(damage, attach, saved, tmp_path):
    """transformers initialises anew the adapter weights of another shape under ``ignore_mismatched_sizes=True``
    and only logs an adapter weight missing from the file or one of the file left unread: the pruned model then
    ran with an adapter other than the saved one, with no error. pruned_heads.py refuses, and takes it off; peft's
    loading (``peft_from_pretrained``, its record right) is refused the same by the load_state_dict hooks."""
    from safetensors.torch import save_file

    root, _ = saved
    family = "llama"
    model = _plain(root, family)
    before = _logits(model)
    source = root / f"{family}-{'unpruned-' if damage == 'mismatched' else ''}lora"
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text((source / "adapter_config.json").read_text())
    (adapter / "headlab_adapter.json").write_text((root / f"{family}-lora" / "headlab_adapter.json").read_text())
    weights = load_file(source / "adapter_model.safetensors")
    key = "base_model.model.model.layers.1.self_attn.o_proj.lora_A.weight"
    if damage == "missing":
        del weights[key]
    elif damage == "unexpected":
        weights[key.replace("o_proj", "extra_proj")] = weights[key].clone()
    save_file(weights, adapter / "adapter_model.safetensors", metadata={"format": "pt"})
    if attach == "load_adapter":
        what = {"mismatched": "another shape", "missing": "missing", "unexpected": "not loaded"}[damage]
        with pytest.raises(RuntimeError, match=rf"adapter does not fit the pruned LlamaForCausalLM.*{what}"):
            model.load_adapter(str(adapter), ignore_mismatched_sizes=damage == "mismatched")
    else:
        what = {"mismatched": r"at their initialisation \(of another shape", "missing": "at their initialisation",
                "unexpected": r"unread .*extra_proj\.lora_A"}[damage]
        with pytest.raises(RuntimeError, match=rf"onto this pruned LlamaForCausalLM left \d+ .*{what}"):
            model.peft_from_pretrained(model, adapter, ignore_mismatched_sizes=damage == "mismatched")
    assert not getattr(model, "peft_config", None) and not _tuner_layers(model)
    torch.testing.assert_close(_logits(model), before, atol=0, rtol=0)


@pytest.mark.parametrize("family", list(TARGETS))
def test_headlab_refuses_an_adapter_on_an_attention_projection(family):
    """headlab slices, masks and reads the attention projections themselves; a LoRA layer wrapping one was
    refused with 'cannot read the output width of Linear' (peft's class name, no hint of the adapter)."""
    model = peft.get_peft_model(_model(family), peft.LoraConfig(r=2, target_modules=TARGETS[family][-1:]))
    with pytest.raises(HeadlabError, match=r"a PEFT adapter layer \(peft\.tuners\.lora\.layer\.Linear\).*merge_and_unload"):
        attention_blocks(model)
    with pytest.raises(HeadlabError, match="PEFT adapter"):
        prune_heads(model, {("dec_self", 0): [1]})


@pytest.mark.parametrize("wrapped", [True, False])
def test_save_pruned_refuses_a_model_carrying_an_adapter(wrapped, tmp_path):
    """An adapter on the MLP leaves the attention alone: pruning it is exact (checked against masking).
    save_pruned wrote the adapted model's state dict (gate_proj.base_layer, lora_A...), which load_pruned
    and plain transformers refuse; a PeftModel failed after writing the adapter (no config.json). Now it
    refuses before a file is written."""
    config = peft.LoraConfig(r=2, target_modules=["gate_proj"], init_lora_weights=False)
    model = _model("llama")
    model = peft.get_peft_model(model, config) if wrapped else peft.inject_adapter_in_model(config, model)
    prune_heads(model, {("dec_self", 0): [1]})
    with pytest.raises(HeadlabError, match=r"carries a PEFT adapter \(2 adapter layers: .*gate_proj.*merge_and_unload"):
        save_pruned(model, tmp_path / "saved")
    assert not (tmp_path / "saved").exists()


def test_a_directory_pruned_before_its_plan_held_kept_refuses_attention_adapters(saved, tmp_path):
    """A plan without ``kept`` (the bundled models/*-pruned-*) tells the resized projections only: which heads its
    layers kept is unknown, so no adapter on them can be compared (an MLP adapter still loads)."""
    import shutil

    root, _ = saved
    shutil.copytree(root / "llama", tmp_path / "old")
    config = json.loads((tmp_path / "old" / "config.json").read_text())
    del config["headlab_pruned"]["kept"]
    (tmp_path / "old" / "config.json").write_text(json.dumps(config))
    model = _plain(tmp_path, "old")
    with pytest.raises(RuntimeError, match=r"adapts the attention of pruned layers \(model\.layers\.0\.self_attn, "
                                           r"model\.layers\.1\.self_attn\).*does not record which heads they kept"):
        model.load_adapter(str(root / "llama-lora"))
    assert not _tuner_layers(model)


def _headlab_model(root, family: str, loader: str) -> torch.nn.Module:
    """The pruned model as headlab hands it over, of transformers' own class: rebuilt by load_pruned, or pruned in
    this process by prune_heads (the fixture's pruning of the same tiny model: the same weights)."""
    if loader == "load_pruned":
        return _load_pruned(root, family)
    model = _model(family)
    prune_heads(model, PRUNED[family])
    return model


@pytest.mark.parametrize("family", list(TARGETS))
@pytest.mark.parametrize("loader", ["load_pruned", "prune_heads"])
def test_transformers_load_adapter_of_a_headlab_model_checks_the_record(family, loader, saved):
    """transformers' own ``model.load_adapter`` of a model from load_pruned or prune_heads (transformers' classes)
    loads the adapter's weights with its own loading code, which the load_state_dict hooks never see: an adapter of
    another pruning with the same head counts loaded silently, its rows acting on other heads (before session 29).
    headlab routes the instance's load_adapter through the checked loader: refused naming both head sets, taken off
    again; the adapter trained on this pruning still loads, with the logits it had."""
    root, expected = saved
    model = _headlab_model(root, family, loader)
    before = _logits(model)
    layer = "gpt_neox.layers.0.attention" if family == "gpt_neox" else "model.layers.0.self_attn"
    theirs, ours = ("0,1,2", "1,2,3") if family == "llama" else ("0,1,3", "0,2,3")
    with pytest.raises(HeadlabError, match=rf"trained on another pruning than this pruned .*ForCausalLM's .*{layer}: "
                                           rf"the adapter's heads {theirs} of 4.*, this model's heads {ours} of 4"):
        model.load_adapter(str(root / f"{family}-other-lora"))
    assert not _tuner_layers(model) and not getattr(model, "peft_config", None)
    torch.testing.assert_close(_logits(model), before, atol=0, rtol=0)
    with pytest.raises(HeadlabError, match=r"adapts the attention of pruned layers .*has no headlab_adapter\.json"):
        model.load_adapter(str(root / f"{family}-unrecorded"))
    assert not _tuner_layers(model)
    model.load_adapter(str(root / f"{family}-lora"))
    torch.testing.assert_close(_logits(model), expected[family], atol=1e-6, rtol=0)


@pytest.mark.parametrize("loader", ["load_pruned", "prune_heads"])
def test_transformers_ignore_mismatched_sizes_cannot_reinitialise_a_headlab_model_s_adapter(loader, saved):
    """Under ``ignore_mismatched_sizes=True`` transformers' load_adapter initialises anew the adapter weights of
    another shape (an adapter of the unpruned model) and only logs it: refused instead, the adapter taken off."""
    root, _ = saved
    model = _headlab_model(root, "llama", loader)
    before = _logits(model)
    with pytest.raises(HeadlabError, match=r"adapter does not fit the pruned LlamaForCausalLM.*another shape.*"
                                           r"q_proj\.lora_B"):
        model.load_adapter(str(root / "llama-unpruned-lora"), ignore_mismatched_sizes=True)
    assert not _tuner_layers(model) and not getattr(model, "peft_config", None)
    torch.testing.assert_close(_logits(model), before, atol=0, rtol=0)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_of_a_headlab_model_checks_its_own_adapters(how, saved, tmp_path):
    """The checked load_adapter travels with a deep copy or a pickled model and loads onto the copy, not the
    original; save_pruned writes the same files as before (the route is no weight and no config entry)."""
    import copy
    import pickle

    root, expected = saved
    model = _load_pruned(root, "llama")
    before = _logits(model)
    twin = copy.deepcopy(model) if how == "deepcopy" else pickle.loads(pickle.dumps(model))
    with pytest.raises(HeadlabError, match="trained on another pruning"):
        twin.load_adapter(str(root / "llama-other-lora"))
    twin.load_adapter(str(root / "llama-lora"))
    torch.testing.assert_close(_logits(twin), expected["llama"], atol=1e-6, rtol=0)
    assert not _tuner_layers(model) and not getattr(model, "peft_config", None)
    torch.testing.assert_close(_logits(model), before, atol=0, rtol=0)
    save_pruned(model, tmp_path / "again")
    assert sorted(path.name for path in (tmp_path / "again").iterdir()) == [
        "config.json", "generation_config.json", "headlab_pruning.json", "model.safetensors", "pruned_heads.py"]
    assert "load_adapter" not in (tmp_path / "again" / "config.json").read_text()


def test_an_unpruned_model_keeps_transformers_load_adapter(saved):
    """Nothing changes for a model headlab did not prune: transformers' own method, its own adapter loading."""
    root, _ = saved
    model = _model("llama")
    assert "load_adapter" not in model.__dict__
    model.load_adapter(str(root / "llama-unpruned-lora"))
    assert _tuner_layers(model)


def test_an_adapter_of_another_base_model_is_said(tmp_path):
    """Regression (audit31): headlab.load_adapter put the LoRA of one model (trained against its weights) on another of
    the same shapes without a word; now a UserWarning names both directories. The adapter of the model itself: none."""
    import warnings

    from headlab.loading import load_model

    for name, seed in (("a", 0), ("b", 5)):
        models.tiny_model("marian", seed=seed).save_pretrained(tmp_path / name)
    trained = peft.get_peft_model(load_model(str(tmp_path / "b")), peft.LoraConfig(target_modules=["q_proj"], r=2))
    trained.save_pretrained(tmp_path / "lora-b")
    with pytest.warns(UserWarning, match=f"an adapter of {tmp_path / 'b'} .*differ from those of {tmp_path / 'a'}"):
        headlab.load_adapter(load_model(str(tmp_path / "a")), tmp_path / "lora-b")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        headlab.load_adapter(load_model(str(tmp_path / "b")), tmp_path / "lora-b")
