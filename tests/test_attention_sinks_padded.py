"""Attention-sink models (GPT-OSS, Granite-SWA, GraniteMoE-SWA, Flint, MiMo-V2-Flash) in bfloat16, and on padded
batches longer than their sliding window.

A sentence in a padded batch (padding on the right, or on the left) gives what it gives alone, unpadded: its
captured map, its logits with and without heads masked, its logits after pruning, and the confidence of every
engine (eager; fused and chunked: headlab's attention function, which takes the sinks itself; kernel: refuses the
sinks, its calls on the fused path). The window is 3 keys and the sentences 6 to 9 tokens, so the sliding layers
hide keys from the real rows and the pad rows of a left-padded row see no key but the sink (no NaN: the sink's
logit is in every softmax). float32 to 1e-6; bfloat16 to its own precision (a logit ulp is 2^-8 of its size).

In bfloat16 the masked path with every head kept (gates at one) is transformers' eager forward bit for bit, capture
is output_attentions bit for bit (Granite-SWA: the weights its values get, worked out from it), pruning equals
masking, and headlab's attention function (the fused engine's forward) differs from eager by what transformers'
own eager and SDPA differ by in bfloat16 (a logit ulp; GPT-OSS's and MiMo-V2-Flash's eager softmax is bfloat16,
headlab's float32). No defect was found here (session 27): these tests hold what was checked.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from headlab import capture_attention, mask_heads, prune_heads
from headlab.capture import stream_attention
from headlab.importance import ImportanceData, compute_confidence, describe_model
from support.family_matrix import attentions_applied_to_values, check_gates_at_one_change_nothing, perturbed_model
from test_attention_sinks import SINK_FAMILIES, SINKS, _layers

WINDOW = 3
LENGTHS = (9, 6, 8)
SPEC = {("dec_self", 1): [0, 3]}
# (map, logits, confidence) tolerances: float32 rounding; bfloat16's (its logits are a few units: ulp 2^-8 of that)
TOLERANCES = {torch.float32: (1e-6, 1e-5, 1e-6), torch.bfloat16: (4e-3, 1e-2, 1e-3)}


def windowed_model(family: str, dtype: torch.dtype) -> torch.nn.Module:
    """The sink model of test_attention_sinks with a 3-key window on every layer (MiMo-V2-Flash: layer 1, its
    sliding layer with sinks; layer 0 full attention, no sinks), in ``dtype``."""
    cls, config = SINK_FAMILIES[family]()
    config.sliding_window = WINDOW
    config.layer_types = ["full_attention" if family == "mimo_v2_flash" else "sliding_attention", "sliding_attention"]
    model = perturbed_model(cls, config, attn_implementation="eager")
    with torch.no_grad():
        for layer, sinks in zip(_layers(model), SINKS):
            if layer.self_attn.sinks is not None:
                layer.self_attn.sinks.copy_(sinks)
    if hasattr(model, "set_experts_implementation"):  # grouped_mm takes no bfloat16 on the CPU
        model.set_experts_implementation("eager")
    return model.to(dtype)


def sentences() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 99, (n,), generator=g) for n in LENGTHS]


def padded(side: str) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.full((len(LENGTHS), max(LENGTHS)), 2)
    mask = torch.zeros_like(ids)
    for row, sentence in enumerate(sentences()):
        place = slice(0, len(sentence)) if side == "right" else slice(max(LENGTHS) - len(sentence), None)
        ids[row, place] = sentence
        mask[row, place] = 1
    return ids, mask


def _logits(model, ids, mask=None) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, use_cache=False).logits


def _close(got: torch.Tensor, expected: torch.Tensor, atol: float) -> None:
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("family", SINK_FAMILIES)
def test_padded_rows_beyond_the_window_equal_each_sentence_alone(family, dtype):
    map_atol, logit_atol, _ = TOLERANCES[dtype]
    model = windowed_model(family, dtype)
    alone, alone_masked, alone_maps = [], [], []
    for sentence in sentences():
        alone.append(_logits(model, sentence[None])[0])
        with mask_heads(model, SPEC):
            alone_masked.append(_logits(model, sentence[None])[0])
        with capture_attention(model) as record:
            _logits(model, sentence[None])
        alone_maps.append({key: probs[0] for key, probs in record.items()})
    for side in ("right", "left"):
        ids, mask = padded(side)
        logits = _logits(model, ids, mask)
        with mask_heads(model, SPEC):
            masked = _logits(model, ids, mask)
        with capture_attention(model) as record:
            _logits(model, ids, mask)
        for row, real in enumerate(mask.bool()):
            _close(logits[row, real], alone[row], logit_atol)
            _close(masked[row, real], alone_masked[row], logit_atol)
            assert not torch.equal(masked[row, real], logits[row, real])
            for (kind, layer), probs in record.items():
                _close(probs[row][:, real][:, :, real], alone_maps[row][kind, layer], map_atol)
                if layer == 1 or family != "mimo_v2_flash":  # the window: a real row reads its last 3 keys at most
                    assert (probs[row][:, real][:, :, real].count_nonzero(-1) <= WINDOW).all()

    pruned = windowed_model(family, dtype)
    prune_heads(pruned, SPEC)
    ids, mask = padded("right")
    for row, real in enumerate(mask.bool()):
        _close(_logits(pruned, ids, mask)[row, real], alone_masked[row], logit_atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("family", SINK_FAMILIES)
def test_confidence_of_every_engine_on_padded_batches_is_each_sentence_alone(family, dtype):
    """Confidence over three sentences longer than the window: eager one sentence at a time is the reference; eager,
    fused and chunked on padded batches of three (and the kernel, in Triton's interpreter: its fallback) give it."""
    *_, atol = TOLERANCES[dtype]
    model = windowed_model(family, dtype)
    data = ImportanceData.from_ids([sentence.tolist() for sentence in sentences()])
    info = describe_model(model)
    reference = compute_confidence(model, data, info, batch_size=1, engine="eager")
    runs = [("eager", None, 3), ("fused", None, 3), ("chunked", 2, 3), ("chunked", 2, 1)]
    if _kernel_runs():
        runs.append(("kernel", None, 3))
    for engine, query_chunk, batch_size in runs:
        scores = compute_confidence(model, data, info, batch_size=batch_size, engine=engine, query_chunk=query_chunk)
        for kind in reference.kinds:
            np.testing.assert_allclose(scores[kind], reference[kind], rtol=0, atol=atol, err_msg=engine)


def _kernel_runs() -> bool:
    try:
        from headlab.data.attention_kernel import interpreted
    except ImportError:  # no triton
        return False
    return interpreted()


@pytest.mark.parametrize("family", SINK_FAMILIES)
def test_bfloat16_masked_path_capture_and_headlab_attention_against_transformers_eager(family):
    """bfloat16: gates at one change no bit; capture is output_attentions bit for bit (Granite-SWA: the weights its
    values get, worked out from output_attentions, the sinks and the logits, to bfloat16's rounding of them); masking
    a head equals zeroing its output projection columns; headlab's attention function runs the model to within a
    logit ulp of eager (transformers' own eager and SDPA differ by that much on a Llama of these sizes: 2e-3)."""
    from support.family_matrix import tiny_inputs

    model = windowed_model(family, torch.bfloat16)
    inputs = tiny_inputs(length=9)
    check_gates_at_one_change_nothing(model, inputs)
    with torch.no_grad():
        reference = model(**inputs, output_attentions=True).attentions
    applied, derived = attentions_applied_to_values(model, inputs)
    with capture_attention(model) as record, torch.no_grad():
        eager = model(**inputs).logits
    for (_, layer), probs in record.items():
        assert probs.dtype == torch.bfloat16
        if layer in derived:
            torch.testing.assert_close(probs, applied[layer], atol=4e-3, rtol=8e-3)
        else:
            assert torch.equal(probs, reference[layer])
    with torch.no_grad():
        with stream_attention(model, lambda block, chunk: None, query_chunk=4):
            streamed = model(**inputs).logits
        with mask_heads(model, SPEC):
            masked = model(**inputs).logits
        o_proj = _layers(model)[1].self_attn.o_proj
        o_proj.weight[:, 0:8] = 0
        o_proj.weight[:, 24:32] = 0
        zeroed = model(**inputs).logits
    real = inputs["attention_mask"].bool()
    _close(streamed[real], eager[real], 1e-2)
    assert not torch.allclose(masked, eager)
    assert torch.equal(masked, zeroed)


@pytest.mark.parametrize("family", ["granite_swa", "granitemoe_swa"])
def test_float64_sink_scaled_pruning_is_checked_to_the_float32_of_its_sink_scale(family):
    """Granite-SWA's eager takes its sink scale sigmoid(lse - sink) in float32 whatever the model's dtype
    (transformers 5.24, "Force sink scaling to fp32"): a float64 model is float32-exact there, and the pruned and the
    masked model, whose logits differ by float64 rounding, may round that scale apart (~6e-8 of a head's output).
    The pruning check then holds them to float32's tolerance, not float64's (1.5e-8). Before: a correct prune of this
    model (experiments/family_sweep.py's tiny build, its sinks moved off zero) was refused, "max difference 6.99e-10,
    allowed 3.21e-10"; a wrong sink slice still shows (test_attention_sinks)."""
    cls, config = SINK_FAMILIES[family]()
    config.intermediate_size = 40
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or "norm" in name.lower():
                parameter.add_(torch.randn_like(parameter) * 0.1)
            elif name.endswith(".sinks"):
                parameter.add_(torch.randn_like(parameter))
    model = model.double()
    if hasattr(model, "set_experts_implementation"):  # grouped_mm takes no float64
        model.set_experts_implementation("eager")
    spec = {("dec_self", 0): [3], ("dec_self", 1): [3]}
    ids, mask = padded("right")
    with mask_heads(model, spec):
        expected = _logits(model, ids, mask)[mask.bool()]
    prune_heads(model, spec)
    _close(_logits(model, ids, mask)[mask.bool()], expected, 1e-7)
