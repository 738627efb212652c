"""The family matrix on a CUDA GPU in bfloat16 (issue 31, item 6): every tiny family of
tests/support, moved to the GPU in bfloat16, is captured as transformers' own eager attention
returns it, pruned exactly as masked (or refused, never silently wrong: the check of
headlab.prune_check runs inside prune_heads with bfloat16's tolerance), and explained by LRP with
its conservation inside the tolerance (LRP widens a half-precision model itself).

Skipped on machines without a GPU; run on a lent one: `pytest tests/test_cuda_families.py`.
"""

from __future__ import annotations

import os

import pytest
import torch

from headlab import attention_blocks, capture_attention, mask_heads, prune_heads
from headlab.errors import HeadlabError
from support import family_matrix, lrp_families, models

# HEADLAB_MATRIX_DEVICE=cpu runs the same matrix on the CPU (in bfloat16), to debug it without a GPU.
DEVICE = os.environ.get("HEADLAB_MATRIX_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU")

DTYPE = torch.bfloat16
BUILDERS = {
    **{f: (lambda f=f, **kw: models.tiny_model(f, **kw)) for f in models.FAMILIES},
    **{f: (lambda f=f, **kw: family_matrix.tiny_model(f, **kw)) for f in family_matrix.FAMILIES if f not in models.FAMILIES},
}
LRP_ONLY = [f for f in lrp_families.FAMILIES if f not in BUILDERS]
# transformers' eager output_attentions add ALiBi twice (tests/test_more_families.py skips it alike; headlab refuses a
# Falcon-ALiBi loaded eager and reads its SDPA attention: tests/test_falcon_alibi_eager.py)
EAGER_ADDS_ALIBI_TWICE = {"falcon_alibi"}


def _inputs(model) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 99, (2, 7), generator=g)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, -2:] = 0  # the second row padded
    inputs = {"input_ids": ids, "attention_mask": mask}
    if model.config.is_encoder_decoder:
        inputs["decoder_input_ids"] = torch.randint(3, 99, (2, 5), generator=g)
    return {k: v.to(DEVICE) for k, v in inputs.items()}


def _logits(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits.float()


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_capture_equals_output_attentions_in_bfloat16(family):
    if family in EAGER_ADDS_ALIBI_TWICE:
        pytest.skip("transformers' eager output_attentions add ALiBi twice: tests/test_falcon_alibi_eager.py")
    eager = BUILDERS[family](attn_implementation="eager").to(DEVICE, DTYPE)
    inputs = _inputs(eager)
    with torch.no_grad():
        out = eager(**inputs, output_attentions=True)
    reference = list(getattr(out, "encoder_attentions", None) or out.attentions)
    model = BUILDERS[family]().to(DEVICE, DTYPE)
    with capture_attention(model) as record:
        _logits(model, inputs)
    first_kind = next(b for b in attention_blocks(model) if not b.idle).kind  # GIT's image encoder: idle on token ids
    captured = [probs for (kind, _), probs in sorted(record.items(), key=lambda item: item[0][1]) if kind == first_kind]
    assert len(captured) == len(reference)
    for layer, (got, want) in enumerate(zip(captured, reference)):
        assert got.dtype == DTYPE and got.device.type == torch.device(DEVICE).type
        torch.testing.assert_close(got, want, msg=lambda m, layer=layer: f"layer {layer}: {m}")


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_pruning_equals_masking_or_is_refused_in_bfloat16(family):
    model = BUILDERS[family]().to(DEVICE, DTYPE)
    inputs = _inputs(model)
    blocks = [b for b in attention_blocks(model) if b.n_heads > 1]
    spec = {blocks[0].key: [0], blocks[-1].key: list(range(blocks[-1].n_heads // 2))}
    with mask_heads(model, spec):
        masked = _logits(model, inputs)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        prune_heads(model, spec)  # checks itself against masking, bfloat16's tolerance
    except HeadlabError as error:  # refused: the model must be left as it was
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), str(error)
        pytest.skip(f"refused, model unchanged: {str(error)[:160]}")
    pruned = _logits(model, inputs)
    scale = masked.abs().max().item()
    assert (pruned - masked).abs().max().item() <= 0.09 * max(scale, 1.0)  # sqrt(eps of bfloat16) x scale


@pytest.mark.parametrize("family", sorted(BUILDERS) + LRP_ONLY)
def test_lrp_conserves_relevance_in_bfloat16(family):
    from headlab.importance import ImportanceData, compute_lrp, describe_model, translate_data

    build = BUILDERS.get(family) or (lambda: lrp_families.tiny_lrp_model(family))
    model = build().to(DEVICE, DTYPE)
    info = describe_model(model)
    eos = min(info.eos_ids) if info.eos_ids else 1
    g = torch.Generator().manual_seed(0)
    data = ImportanceData.from_ids([torch.randint(3, 99, (k,), generator=g).tolist() + [eos] for k in (4, 6, 8)])
    if info.is_seq2seq:
        data = translate_data(model, data, info, max_length_a=0, max_length_b=6)
    try:
        scores = compute_lrp(model, data, info, bootstrap=0)
    except HeadlabError as error:  # refused before any work (no rule) or failed its conservation check
        pytest.skip(f"LRP refused: {str(error)[:200]}")
    record = scores.signature["conservation"]
    assert record["n_outside"] == 0, record
    assert next(model.parameters()).dtype == DTYPE  # narrowed back after LRP
