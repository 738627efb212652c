"""What is measured with heads switched off says so (fixes35, after sigfollow34's refusals).

* ``capture_attention`` / ``stream_attention`` inside ``mask_heads`` (or with gates attached) returned the gated
  model's maps, nothing in the record saying so: capture is the primitive that checks "pruning equals masking" on
  masked maps, so it is not refused; its record names the gate sets (``record.gates``) and the heads their constant
  gates switch off (``record.masked``), both empty otherwise;
* ``ImportanceMeasure.run(mask=)`` and ``compute_gradient(mask=)`` blanked the masked heads but their tables'
  signature did not record the mask (``run_importance``'s did): now ``options["mask"]``, as run_importance writes it;
* ``headlab.importance`` (the API) had no ``mask=`` and, inside ``mask_heads``, its refusal told the caller to give
  ``mask= (run_importance's)``, an option of another function; it refused only after reading the texts. It takes
  ``mask=`` now (recorded), and refuses before any work naming its own.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import headlab
from headlab import ScalarGates, attach_gates, capture_attention, detach_gates, mask_heads
from headlab.capture import stream_attention
from headlab.data.inputs import ImportanceData
from headlab.errors import HeadlabError
from headlab.importance import compute_gradient, describe_model
from headlab.importance.registry import MEASURES
from support.models import tiny_model
from support.treebank import word_tokenizer

SPEC = {("dec_self", 0): [1, 3], ("dec_self", 1): [0]}
RECORDED = {"dec_self:0": [1, 3], "dec_self:1": [0]}
WORDS = ["a", "man", "rides", "the", "dog", "sleeps"]
TEXTS = ["a man rides the dog", "the dog sleeps", "a dog rides"]


@pytest.fixture(scope="module")
def gpt2():
    torch.set_num_threads(1)
    model, tokenizer = tiny_model("gpt2"), word_tokenizer(WORDS, style="gpt2")
    for name in ("pad", "bos", "eos"):
        setattr(model.config, f"{name}_token_id", getattr(tokenizer, f"{name}_token_id", None) or 0)
    return model, tokenizer


def _ids() -> torch.Tensor:
    return torch.randint(3, 50, (2, 6), generator=torch.Generator().manual_seed(0))


def test_a_capture_inside_mask_heads_names_the_gates_and_the_heads_switched_off(gpt2):
    """Failed before: the record had no ``gates`` nor ``masked`` (AttributeError): a masked map looked like the
    model's."""
    model, _ = gpt2
    with torch.no_grad(), capture_attention(model) as plain:
        model(_ids())
    assert plain.gates == () and plain.masked == {}
    with torch.no_grad(), mask_heads(model, SPEC), capture_attention(model) as masked:
        model(_ids())
    assert masked.gates == ("headlab_gates",) and masked.masked == SPEC
    assert not torch.equal(masked[("dec_self", 1)], plain[("dec_self", 1)])  # the gated model's maps indeed
    with torch.no_grad(), mask_heads(model, SPEC), stream_attention(model, lambda b, c: None, query_chunk=2) as streamed:
        model(_ids())
    assert streamed.gates == ("headlab_gates",) and streamed.masked == SPEC
    gates = ScalarGates.for_model(model)  # learnable gates: named, no fixed head off
    attach_gates(model, gates)
    try:
        with torch.no_grad(), mask_heads(model, {("dec_self", 0): [2]}), capture_attention(model) as both:
            model(_ids())
    finally:
        detach_gates(model, gates)
    assert both.gates == ("headlab_gates", "headlab_gates_1") and both.masked == {("dec_self", 0): [2]}


def _data() -> ImportanceData:
    g = torch.Generator().manual_seed(3)
    return ImportanceData.from_ids([torch.randint(3, 99, (k,), generator=g).tolist() + [1] for k in (5, 4)])


@pytest.mark.parametrize("name", list(MEASURES))
def test_a_measure_s_run_with_a_mask_records_it(gpt2, name):
    """Failed before: the tables blanked the heads, their signature had no mask."""
    model, _ = gpt2
    data, info = _data(), describe_model(model)
    if MEASURES[name]().unavailable(info, data) is not None:
        pytest.skip(MEASURES[name]().unavailable(info, data))
    for table in MEASURES[name]().run(model, data, info, mask=SPEC, batch_size=2):
        assert table.signature["options"]["mask"] == RECORDED, table.method
        assert all(torch.isnan(torch.as_tensor(table["dec_self"][0, [1, 3]])))


def test_compute_gradient_with_a_mask_records_it(gpt2):
    model, _ = gpt2
    for normalize in (True, False):
        table = compute_gradient(model, _data(), describe_model(model), mask=SPEC, normalize=normalize, batch_size=2)
        assert table.signature["options"]["mask"] == RECORDED


def test_the_api_s_importance_takes_a_mask_and_names_its_own_option_when_refusing(gpt2, monkeypatch):
    """Failed before: importance() took no mask=, and inside mask_heads it refused after reading the texts, saying
    "give mask= (run_importance's)"."""
    model, tokenizer = gpt2
    result = headlab.importance(model, tokenizer, TEXTS, measures="gradient", mask="dec_self:0:1,3 dec_self:1:0")
    table = result.scores["gradient"]
    assert table.signature["options"]["mask"] == RECORDED
    assert all(torch.isnan(torch.as_tensor(table["dec_self"][0, [1, 3]])))
    same = headlab.importance(model, tokenizer, TEXTS, measures="gradient", mask=SPEC).scores["gradient"]
    assert np.array_equal(same["dec_self"], table["dec_self"], equal_nan=True)
    with pytest.raises(HeadlabError, match="dec_self layer 0 has heads 0..3; no head 7"):
        headlab.importance(model, tokenizer, TEXTS, measures="gradient", mask={("dec_self", 0): [7]})
    import headlab.data.inputs as inputs

    with mask_heads(model, SPEC), monkeypatch.context() as patched:
        patched.setattr(inputs, "texts_data", lambda *a, **k: pytest.fail("the texts were read before the refusal"))
        with pytest.raises(HeadlabError, match=r"^importance: the model has gates attached .* give mask= "
                                               r"\(headlab.importance's\)"):
            headlab.importance(model, tokenizer, TEXTS, measures="gradient")
