"""The foundation on CUDA, half precision and Accelerate's big-model dispatch.

Skipped (with the reason shown) on machines without a GPU; CI has none, so these run on a
lent GPU machine: `pytest tests/test_cuda.py`.
"""

import pytest
import torch

from headlab import attention_blocks, capture_attention, load_pruned, mask_heads, prune_heads, save_pruned
from support.models import FAMILIES, logits, tiny_inputs, tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _to(inputs, device):
    return {k: v.to(device) for k, v in inputs.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_pruning_equals_masking_on_cuda(family, dtype, tmp_path):
    model = tiny_model(family).to("cuda", dtype)
    inputs = _to(tiny_inputs(family), "cuda")
    spec = {attention_blocks(model)[0].key: [1], attention_blocks(model)[1].key: [0, 1, 2, 3]}
    with mask_heads(model, spec):
        masked = logits(model, inputs)
    rtol = 1e-5 if dtype == torch.float32 else 0.0
    if dtype == torch.float32:
        tol = 1e-5
    else:
        # Half precision: the pruned model's smaller matrix products round differently, so it may
        # differ from masking by as much as the masked model itself differs from float32 (on the
        # H100, bf16 t5: 0.028 in 1 of 990 logits). Tolerance: twice that rounding error.
        with mask_heads(model.float(), spec):
            exact = logits(model, inputs)
        model.to(dtype)
        tol = 2 * (masked.float() - exact).abs().max().item() + 1e-3
    prune_heads(model, spec)
    torch.testing.assert_close(logits(model, inputs).float(), masked.float(), atol=tol, rtol=rtol)
    save_pruned(model, tmp_path / "m")
    reloaded = load_pruned(tmp_path / "m").to("cuda", dtype)
    torch.testing.assert_close(logits(reloaded, inputs).float(), logits(model, inputs).float(), atol=tol, rtol=rtol)


def test_device_map_auto(tmp_path):
    """A model dispatched by Accelerate (device_map="auto") is masked, captured and pruned alike."""
    import transformers

    tiny_model("marian").save_pretrained(tmp_path / "m")
    model = transformers.MarianMTModel.from_pretrained(tmp_path / "m", device_map="auto").eval()
    inputs = _to(tiny_inputs("marian"), next(model.parameters()).device)
    with capture_attention(model) as record:
        logits(model, inputs)
    assert record[("dec_cross", 1)].shape == (2, 4, 5, 7)
    spec = {("enc_self", 1): [0, 3]}
    with mask_heads(model, spec):
        masked = logits(model, inputs)
    prune_heads(model, spec)
    torch.testing.assert_close(logits(model, inputs), masked, atol=1e-5, rtol=1e-5)
