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

import pytest
import torch
import transformers as tf

from headlab import HeadlabError, attention_blocks, load_pruned, prune_heads, save_pruned
from support import family_matrix, models

peft = pytest.importorskip("peft")

TARGETS = {"llama": ["q_proj", "k_proj", "v_proj", "o_proj"], "gpt_neox": ["query_key_value", "dense"]}
PRUNED = {"llama": {("dec_self", 0): [0], ("dec_self", 1): [1, 2]},
          "gpt_neox": {("dec_self", 0): [1], ("dec_self", 1): [0, 2]}}


def _model(family: str) -> torch.nn.Module:
    """A tiny Llama (grouped keys and values) or GPT-NeoX (fused q/k/v), eager attention."""
    source = family_matrix if family == "gpt_neox" else models
    return source.tiny_model(family, attn_implementation="eager")


def _logits(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(**models.tiny_inputs("llama")).logits


def _lora(model: torch.nn.Module, family: str, directory) -> torch.Tensor:
    """A LoRA adapter on every attention projection of ``model``, its weights random (a new one's B is
    zero: it would change nothing), saved to ``directory``; the logits of the adapted model."""
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=2, lora_alpha=4, target_modules=TARGETS[family]))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    logits = _logits(adapted)
    adapted.save_pretrained(directory)
    return logits


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each family pruned and saved (layers that differ: plain transformers loads it as a PrunedModel),
    with a LoRA adapter trained on the pruned model and one on the unpruned model."""
    root = tmp_path_factory.mktemp("peft")
    expected = {}
    for family in TARGETS:
        model = _model(family)
        prune_heads(model, PRUNED[family])
        save_pruned(model, root / family)
        expected[family] = _lora(model, family, root / f"{family}-lora")
        _lora(_model(family), family, root / f"{family}-unpruned-lora")
    return root, expected


def _plain(root, family: str) -> torch.nn.Module:
    model = tf.AutoModelForCausalLM.from_pretrained(root / family, trust_remote_code=True, attn_implementation="eager")
    assert type(model).__name__ == "PrunedModel"
    return model


def _load_pruned(root, family: str) -> torch.nn.Module:
    model = load_pruned(root / family)
    model.config._attn_implementation = "eager"
    return model


@pytest.mark.parametrize("family", list(TARGETS))
@pytest.mark.parametrize("loader", ["load_pruned", "plain"])
@pytest.mark.parametrize("attach", ["load_adapter", "PeftModel"])
def test_an_adapter_of_a_pruned_model_loads_back_onto_it(family, loader, attach, saved):
    root, expected = saved
    model = (_plain if loader == "plain" else _load_pruned)(root, family)
    if attach == "load_adapter":
        model.load_adapter(str(root / f"{family}-lora"))
    else:
        model = peft.PeftModel.from_pretrained(model, root / f"{family}-lora")
    torch.testing.assert_close(_logits(model), expected[family], atol=1e-6, rtol=0)


@pytest.mark.parametrize("order", [("llama", "gpt_neox"), ("gpt_neox", "llama")])
def test_adapters_of_two_families_loaded_in_one_process(order, saved):
    """Both pruned models are PrunedModel, and the conversion registered under that name is the last one
    loaded's (GPT-NeoX's renaming of embed_out, or Llama's none) when each model's adapter is loaded."""
    root, expected = saved
    loaded = {family: _plain(root, family) for family in order}
    for family in order:
        loaded[family].load_adapter(str(root / f"{family}-lora"))
    for family in order:
        torch.testing.assert_close(_logits(loaded[family]), expected[family], atol=1e-6, rtol=0)
    loaded = {family: _plain(root, family) for family in order}
    for family in order:
        adapted = peft.PeftModel.from_pretrained(loaded[family], root / f"{family}-lora")
        torch.testing.assert_close(_logits(adapted), expected[family], atol=1e-6, rtol=0)


@pytest.mark.parametrize("family", list(TARGETS))
@pytest.mark.parametrize("loader", ["load_pruned", "plain"])
@pytest.mark.parametrize("attach", ["load_adapter", "PeftModel"])
def test_an_adapter_of_the_unpruned_model_is_refused(family, loader, attach, saved):
    """Its q/k/v rows and output-projection columns are the unpruned model's: transformers and peft
    refuse the shapes (no adapter weight left at its initialisation). pruned_heads.py's load_adapter
    names them (transformers' own error points to its logged report)."""
    root, _ = saved
    model = (_plain if loader == "plain" else _load_pruned)(root, family)
    projection = "query_key_value" if family == "gpt_neox" else "q_proj"
    if attach == "PeftModel":
        with pytest.raises(RuntimeError, match=rf"size mismatch for .*{projection}\.lora_B"):
            peft.PeftModel.from_pretrained(model, root / f"{family}-unpruned-lora")
    elif loader == "plain":
        with pytest.raises(RuntimeError, match=rf"adapter does not fit the pruned .*another shape.*{projection}\.lora_B"
                                                r".*unpruned model"):
            model.load_adapter(str(root / f"{family}-unpruned-lora"))
    else:  # headlab's load_pruned: transformers' own class and message, the shapes in its logged report
        with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
            model.load_adapter(str(root / f"{family}-unpruned-lora"))


@pytest.mark.parametrize("damage", ["mismatched", "missing", "unexpected"])
def test_plain_load_adapter_refuses_an_adapter_it_would_load_partly(damage, saved, tmp_path):
    """transformers initialises anew the adapter weights of another shape under ``ignore_mismatched_sizes=True``
    and only logs an adapter weight missing from the file or one of the file left unread: the pruned model then
    ran with an adapter other than the saved one, with no error. pruned_heads.py refuses, and takes it off."""
    from safetensors.torch import load_file, save_file

    root, _ = saved
    family = "llama"
    model = _plain(root, family)
    before = _logits(model)
    source = root / f"{family}-{'unpruned-' if damage == 'mismatched' else ''}lora"
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text((source / "adapter_config.json").read_text())
    weights = load_file(source / "adapter_model.safetensors")
    key = "base_model.model.model.layers.1.self_attn.o_proj.lora_A.weight"
    if damage == "missing":
        del weights[key]
    elif damage == "unexpected":
        weights[key.replace("o_proj", "extra_proj")] = weights[key].clone()
    save_file(weights, adapter / "adapter_model.safetensors", metadata={"format": "pt"})
    what = {"mismatched": "another shape", "missing": "missing", "unexpected": "not loaded"}[damage]
    with pytest.raises(RuntimeError, match=rf"adapter does not fit the pruned LlamaForCausalLM.*{what}"):
        model.load_adapter(str(adapter), ignore_mismatched_sizes=damage == "mismatched")
    assert not getattr(model, "peft_config", None)
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
