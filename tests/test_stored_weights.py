"""Weights stored quantized or offloaded (headlab.stored_weights): LRP and physical pruning are refused before any
work, naming the modules; nothing is changed.

Before, LRP widened transformers' ``FP8Linear`` weights (float8 with block scales) to float64 and ran ``F.linear`` on
the stored values without their scales: it explained another model and said its relevance was conserved (it is that
model's own). Pruning sliced the float8 rows and left ``weight_scale_inv`` whole. The quantized layer here is
transformers' own class; its forward needs a GPU kernel, which the refusals never reach.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.integrations.finegrained_fp8 import FP8Linear

from headlab import HeadlabError, attention_blocks, prune_heads
from headlab.stored_weights import stored_elsewhere_modules, stored_quantized
from headlab.surgery import check_block_sliceable, check_prunable
from support import models
from support.lrp_families import lrp_data


def _fp8(linear: nn.Linear, block: int = 8) -> FP8Linear:
    """``linear`` as transformers' FP8 quantizer stores it: float8 weights, one float32 scale per block x block."""
    out_f, in_f = linear.weight.shape
    quantized = FP8Linear(in_f, out_f, block_size=(block, block))
    blocks = linear.weight.detach().float().reshape(out_f // block, block, in_f // block, block)
    scale = blocks.abs().amax(dim=(1, 3)) / torch.finfo(torch.float8_e4m3fn).max
    with torch.no_grad():
        quantized.weight.copy_((blocks / scale[:, None, :, None]).reshape(out_f, in_f).to(torch.float8_e4m3fn))
        quantized.weight_scale_inv.copy_(scale)
    return quantized.eval()


def _quantized_llama(where: str = "q_proj") -> nn.Module:
    model = models.tiny_model("llama", attn_implementation="eager")
    attention = model.model.layers[1].self_attn
    setattr(attention, where, _fp8(getattr(attention, where)))
    return model


def _state(model: nn.Module) -> dict:
    return {name: (tensor.dtype, tensor.clone()) for name, tensor in model.state_dict().items()}


def _unchanged(model: nn.Module, state: dict) -> bool:
    now = model.state_dict()
    return now.keys() == state.keys() and all(now[k].dtype == d and torch.equal(now[k].float(), t.float())
                                              for k, (d, t) in state.items())


def test_what_is_stored_quantized():
    plain = nn.Linear(4, 4)
    assert stored_quantized(plain) is None
    assert stored_quantized(_fp8(nn.Linear(8, 8))) == "weight float8_e4m3fn"
    packed = nn.Linear(4, 4)
    packed.register_buffer("qweight", torch.zeros(4, 1, dtype=torch.int32))  # GPTQ's and AWQ's packed weights
    assert stored_quantized(packed) == "qweight int32"
    indexed = nn.Linear(4, 4)
    indexed.register_buffer("position_ids", torch.arange(4))  # an index (int64), a mask (bool): not weights
    indexed.register_buffer("mask", torch.ones(4, dtype=torch.bool))
    assert stored_quantized(indexed) is None


@pytest.mark.parametrize("family", models.FAMILIES)
def test_no_model_of_the_matrix_counts_as_quantized(family):
    assert stored_elsewhere_modules(models.tiny_model(family)) == []


def test_lrp_is_refused_before_any_work_naming_the_module():
    from headlab.importance import compute_lrp

    model = _quantized_llama()
    data, info = lrp_data(model)
    state = _state(model)
    with pytest.raises(HeadlabError, match=r"LRP is refused on a model whose weights are stored quantized or offloaded \("
                                           r"model\.layers\.1\.self_attn\.q_proj \(FP8Linear: weight float8_e4m3fn\)\)"
                                           r".*dequantize"):
        compute_lrp(model, data, info, bootstrap=0)
    assert _unchanged(model, state)
    assert model.model.layers[1].self_attn.q_proj.weight.dtype == torch.float8_e4m3fn


@pytest.mark.parametrize("where", ["q_proj", "o_proj"])
def test_pruning_is_refused_before_any_change_naming_the_module(where):
    model = _quantized_llama(where)
    state = _state(model)
    with pytest.raises(HeadlabError, match=rf"model\.layers\.1\.self_attn \(.*\): physical pruning is refused: its "
                                           rf"weights are stored quantized or offloaded \(model\.layers\.1\.self_attn\.{where} "
                                           r"\(FP8Linear: weight float8_e4m3fn\)\).*mask the heads instead"):
        prune_heads(model, {("dec_self", 1): [0]})
    assert _unchanged(model, state)
    with pytest.raises(HeadlabError, match="stored quantized"):  # prune train's check, before its gates train
        check_prunable(model)
    assert _unchanged(model, state)


def test_only_the_pruned_blocks_weights_count():
    """Layer 0 has no quantized weight: its slicing is allowed (the pruning check after it runs the model, whose FP8
    forward needs a GPU kernel here)."""
    blocks = attention_blocks(_quantized_llama())
    check_block_sliceable(blocks[0])
    with pytest.raises(HeadlabError, match="stored quantized"):
        check_block_sliceable(blocks[1])


def _offloaded_llama() -> nn.Module:
    """accelerate's CPU offloading: parameters on the meta device, an AlignDevicesHook loading them at each forward
    (what a device_map with "cpu" or "disk" entries beside a GPU gives)."""
    from accelerate import cpu_offload

    model = models.tiny_model("llama", attn_implementation="eager")
    cpu_offload(model, execution_device=torch.device("cpu"))
    return model


def test_lrp_on_an_offloaded_model_is_refused_before_any_work():
    """Before, it failed inside the run (``Tensor.item() cannot be called on meta tensors``), an internal error."""
    from headlab.importance import compute_lrp

    model = _offloaded_llama()
    data, info = lrp_data(models.tiny_model("llama"))
    with pytest.raises(HeadlabError, match=r"LRP is refused on a model whose weights are stored quantized or offloaded "
                                           r"\(model\.embed_tokens \(Embedding: weight offloaded \(accelerate\)\)"):
        compute_lrp(model, data, info, bootstrap=0)


def test_pruning_an_offloaded_model_is_refused_before_any_change():
    """Before, the slicing ran on the meta parameters and the check then failed, blaming the model's own forward."""
    model = _offloaded_llama()
    ids = torch.tensor([[3, 5, 7, 9]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
    with pytest.raises(HeadlabError, match=r"physical pruning is refused: its weights are stored quantized or "
                                           r"offloaded \(model\.layers\.0\.self_attn\.q_proj \(Linear: weight "
                                           r"offloaded \(accelerate\)\)"):
        prune_heads(model, {("dec_self", 0): [0]})
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before)
    assert [b.n_heads for b in attention_blocks(model)] == [4, 4]


def test_a_model_built_on_the_meta_device_is_not_offloaded():
    """check_supported reads a structure built on the meta device (no hook, no weights yet): not refused here."""
    with torch.device("meta"):
        model = models.tiny_model("llama")
    assert stored_elsewhere_modules(model) == []
    check_block_sliceable(attention_blocks(model)[0])
