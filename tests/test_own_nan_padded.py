"""A model that gives NaN by itself on a padded batch is said so, not blamed on headlab (session 27, nan27).

transformers fills an additive mask with the lowest number of the model's dtype and its eager attention takes the
softmax in float32: a float64 model's lowest number is -inf there, so on a left-padded row the padding queries, which
may attend to no key, get NaN weights, and the next layer's real rows read their NaN values (0 * NaN). The same model
in float32, or with SDPA, is finite. Before: capture blamed a sliding window (there is none), and pruning a whole
layer of such a model was refused with "max difference inf" (the masked reference had the NaN, the pruned model,
whose emptied layer reads no value, had not). Both now name the model's own NaN and its cause, checked by running
the probe again with the mask floored at float32's lowest value; a real difference still wins over it. Where that
floored probe is finite and agrees at every value, the pruning is exact and kept, the model's own NaN said in a
warning (session 28, nanfin28); where it is not finite, still refused.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

from headlab import attention_blocks, capture_attention, load_pruned, prune_heads, save_pruned
from headlab.errors import HeadlabError, PruningNotExact
from headlab.prune_check import Trace, first_mismatch, probe_inputs, run_probe
from support.models import tiny_model

EMPTY_LAYER = {("dec_self", 0): [0, 1, 2, 3]}


def float64_llama(attn_implementation: str = "eager") -> torch.nn.Module:
    return tiny_model("llama", attn_implementation=attn_implementation).double()


def _forward(model, probe):
    with torch.no_grad():
        return model(input_ids=probe["input_ids"], attention_mask=probe["attention_mask"]).logits


def test_the_float64_eager_model_itself_gives_nan_on_a_left_padded_row():
    """What the refusals below rest on, in transformers alone: NaN on the left-padded row's real positions in
    float64 eager, none in float32 eager or float64 SDPA."""
    probe = probe_inputs(float64_llama())
    real = probe["attention_mask"].bool()
    logits = _forward(float64_llama(), probe)
    assert logits[2][real[2]].isnan().all() and logits[:2][real[:2]].isfinite().all()
    assert _forward(float64_llama().float(), probe)[real].isfinite().all()
    assert _forward(float64_llama("sdpa"), probe)[real].isfinite().all()


def test_capture_names_the_float64_mask_not_a_sliding_window():
    model = float64_llama()
    probe = probe_inputs(model)
    with pytest.raises(HeadlabError) as caught, capture_attention(model):
        _forward(model, probe)
    message = str(caught.value)
    assert message.startswith("dec_self layer 0: ")  # where the NaN starts, not where it spreads
    assert "batch row 2, queries 0-1: padding" in message
    assert "float64 attention mask" in message and "float32" in message
    assert "sliding window" not in message
    with capture_attention(float64_llama().float()) as record:  # the remedy named works
        _forward(float64_llama().float(), probe)
    assert all(probs.isfinite().all() for probs in record.values())


def test_pruning_a_whole_layer_is_kept_and_names_the_models_own_nan(caplog):
    """The masked reference reads the unmodified model's NaN on the left-padded row, the pruned model (its layer 0
    emptied) does not; with the mask floored at float32's lowest value every value agrees, so the pruning is exact:
    kept (refused in sessions 27 and 28), and the model's own NaN said once, with its cause and remedy."""
    model = float64_llama()
    with caplog.at_level(logging.WARNING, logger="headlab.surgery"):
        prune_heads(model, EMPTY_LAYER)
    assert [block.n_heads for block in attention_blocks(model)] == [0, 4]
    notes = [record.getMessage() for record in caplog.records if record.name == "headlab.surgery"]
    assert len(notes) == 1, notes
    message = notes[0]
    assert message.startswith("llama: pruned, checked at every value: the model itself gives NaN or inf on headlab's "
                              "padded probe before any head is removed (it computes NaN or inf in dec_self layer 1 "
                              "(forward) at probe row 2 (padded on the left), positions 2-5)"), message
    assert "with the mask floored at float32's lowest value both are finite and agree everywhere" in message
    assert "float64 attention mask" in message and 'attn_implementation="sdpa"' in message

    sdpa = float64_llama("sdpa")  # the remedy named: finite, pruned with nothing to say
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="headlab.surgery"):
        prune_heads(sdpa, EMPTY_LAYER)
    assert [block.n_heads for block in attention_blocks(sdpa)] == [0, 4]
    assert not [record for record in caplog.records if record.name == "headlab.surgery"]


def test_pruning_a_whole_layer_is_still_checked_at_the_floored_mask(monkeypatch):
    """Kept only where the floored comparison agrees: a real difference there is still PruningNotExact."""
    import headlab.prune_check as prune_check

    model = float64_llama()
    real = prune_check.run_floored
    calls = []

    def shifted(model, probe):  # the second floored run is the pruned model's: one value off
        trace = real(model, probe)
        calls.append(1)
        if len(calls) == 2:
            call, what, value = trace.entries[-1]
            trace.entries[-1] = (call, what, value + 1.0)
        return trace

    monkeypatch.setattr(prune_check, "run_floored", shifted)
    with pytest.raises(PruningNotExact, match="floored at float32's lowest value"):
        prune_heads(model, EMPTY_LAYER)
    assert len(calls) == 2
    assert [block.n_heads for block in attention_blocks(model)] == [4, 4]


def test_a_float64_granite_swa_with_an_emptied_layer_names_the_models_own_nan(caplog):
    """The case found (sink27): Granite-SWA's eager has no SDPA to offer, so float32 alone is named. Its floored
    probe is finite and agrees (to float32's precision, at which its eager takes the sink scale), so the pruning is
    kept as Llama's is (refused in sessions 27 and 28)."""
    from support.family_matrix import perturbed_model
    from test_attention_sinks import SINK_FAMILIES

    cls, config = SINK_FAMILIES["granite_swa"]()
    model = perturbed_model(cls, config, attn_implementation="eager").double()
    with caplog.at_level(logging.WARNING, logger="headlab.surgery"):
        prune_heads(model, {("dec_self", 0): list(range(config.num_attention_heads))})
    assert [block.n_heads for block in attention_blocks(model)][:2] == [0, config.num_attention_heads]
    notes = [record.getMessage() for record in caplog.records if record.name == "headlab.surgery"]
    assert len(notes) == 1 and "the model itself gives NaN or inf on headlab's padded probe" in notes[0], notes
    assert "load it in float32" in notes[0] and "sdpa" not in notes[0]
    assert model.config._attn_implementation == "eager"  # the SDPA try left it as it was


def test_the_models_own_nan_is_still_refused_where_the_floored_mask_leaves_it(monkeypatch):
    """Kept only where the floored probe is finite: where it is not (a NaN the float64 mask does not explain), the
    reference's NaN compares nothing, and the pruning is refused naming the model's own NaN."""
    import headlab.prune_check as prune_check

    model = float64_llama()
    monkeypatch.setattr(prune_check, "run_floored", prune_check.run_probe)  # a floor that changes nothing
    with pytest.raises(HeadlabError) as caught:
        prune_heads(model, EMPTY_LAYER)
    message = str(caught.value)
    assert not isinstance(caught.value, PruningNotExact) and "max difference" not in message
    assert "cannot check pruning: the model itself gives NaN or inf on headlab's padded probe" in message
    assert "where the pruned one is finite, so pruning cannot be checked there" in message
    assert [block.n_heads for block in attention_blocks(model)] == [4, 4]


def _trace(*entries: tuple[str, object, torch.Tensor]) -> Trace:
    trace = Trace()
    for call, what, value in entries:
        trace.add(call, what, value, None)
    return trace


def test_a_real_difference_is_not_hidden_behind_the_references_nan():
    nan_row = torch.tensor([[1.0, 2.0], [math.nan, math.nan]])
    finite = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    reference = _trace(("forward", ("dec_self", 1), nan_row), ("forward", "logits", finite))

    only_nan = first_mismatch(reference, _trace(("forward", ("dec_self", 1), finite),
                                                ("forward", "logits", finite)), torch.float64)
    assert only_nan is not None and only_nan.not_finite == "probe row 1 (padded on the right)"

    later = first_mismatch(reference, _trace(("forward", ("dec_self", 1), finite),
                                             ("forward", "logits", finite + 1)), torch.float64)
    assert later is not None and later.not_finite is None and later.what == "logits" and later.difference == 1.0

    same_row = first_mismatch(reference, _trace(("forward", ("dec_self", 1), finite + torch.tensor([[1.0], [0.0]])),
                                                ("forward", "logits", finite)), torch.float64)
    assert same_row is not None and same_row.not_finite is None and same_row.difference == 1.0

    both = first_mismatch(reference, reference, torch.float64)  # NaN where both are NaN: compared nowhere, said so
    assert both is not None and both.unchecked and both.not_finite is None
    assert both.uncompared == "probe row 1 (padded on the right)" and both.what == ("dec_self", 1)
    assert first_mismatch(_trace(("forward", "logits", finite)), _trace(("forward", "logits", finite)),
                          torch.float64) is None


def test_the_probe_names_rows_and_positions_of_nan():
    model = float64_llama()
    trace = run_probe(model, probe_inputs(model))
    from headlab.prune_check import not_finite

    assert not_finite(trace) == ("computes NaN or inf in dec_self layer 1 (forward) at probe row 2 (padded on the "
                                 "left), positions 2-5")


def test_load_pruned_says_the_nan_is_the_models_attention_not_its_weights(tmp_path):
    model = float64_llama("sdpa")
    prune_heads(model, {("dec_self", 0): [0]})
    save_pruned(model, tmp_path / "pruned")
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # load_pruned builds in the default dtype
    try:
        assert next(load_pruned(tmp_path / "pruned").parameters()).dtype == torch.float64
        with pytest.raises(HeadlabError, match="its own eager attention makes it on padded rows, not its weights: "
                                               "its float64 attention mask"):
            load_pruned(tmp_path / "pruned", attn_implementation="eager")
    finally:
        torch.set_default_dtype(default)


def _wrong_on_the_left_padded_row(monkeypatch, layer: int) -> list:
    """Prune as headlab does, then make ``dec_self layer {layer}`` add 1 to batch row 2 of its output: a pruning
    wrong only on the probe's left-padded row, where the float64 eager model is NaN by itself."""
    import headlab.surgery as surgery

    handles = []
    prune_block = surgery._prune_block

    def wrong(model, block, *args, **kwargs):
        prune_block(model, block, *args, **kwargs)
        if block.key == ("dec_self", layer):
            def shift(module, args, output):
                if output[0].shape[0] == 3:
                    output[0][2] += 1.0

            handles.append(block.module.register_forward_hook(shift))

    monkeypatch.setattr(surgery, "_prune_block", wrong)
    return handles


def test_a_difference_only_where_both_are_nan_is_compared_under_the_floored_mask(monkeypatch):
    """Before (nan28): the masked reference and the pruned model were both NaN on the left-padded row from layer 1
    on, those items counted as the same, and a pruning wrong only there passed. Both probes now run again with the
    mask floored at float32's lowest value (finite there), and that comparison catches it."""
    model = float64_llama()
    handles = _wrong_on_the_left_padded_row(monkeypatch, 1)
    try:
        with pytest.raises(PruningNotExact) as caught:
            prune_heads(model, {("dec_self", 1): [0]})
    finally:
        for handle in handles:
            handle.remove()
    message = str(caught.value)
    assert "differs from the masked one in dec_self layer 1 (forward)" in message
    assert "floored" in message and "max difference 1" in message
    assert [block.n_heads for block in attention_blocks(model)] == [4, 4]  # left unpruned


def test_a_right_pruning_of_a_float64_eager_model_is_checked_everywhere_and_kept():
    """The same pruning without the fault: every value agrees under the floored mask, so it is kept, and the pruned
    model gives what the masked one gives (NaN included, which is the model's own)."""
    model = float64_llama()
    probe = probe_inputs(model)
    from headlab.gates import masked_heads

    with masked_heads(model, {("dec_self", 1): [0]}):
        masked = _forward(model, probe)
    prune_heads(model, {("dec_self", 1): [0]})
    assert [block.n_heads for block in attention_blocks(model)] == [4, 3]
    pruned = _forward(model, probe)
    assert torch.equal(pruned.isnan(), masked.isnan())
    assert torch.allclose(pruned.nan_to_num(), masked.nan_to_num())


def test_nan_in_both_that_the_floor_does_not_remove_is_refused_naming_what_was_not_compared(monkeypatch):
    """Where the floored probe is not finite either (here: the floor made to do nothing), the items both models
    have NaN at were compared nowhere: refused, named, not passed (before nan28: pruned silently)."""
    import headlab.prune_check as prune_check

    monkeypatch.setattr(prune_check, "run_floored", run_probe)
    model = float64_llama()
    with pytest.raises(HeadlabError) as caught:
        prune_heads(model, {("dec_self", 1): [0]})
    message = str(caught.value)
    assert not isinstance(caught.value, PruningNotExact) and "max difference" not in message
    assert ("has NaN or inf in dec_self layer 1 (forward) at probe row 2 (padded on the left), positions 2-5, as has "
            "the pruned one, also with the mask floored at float32's lowest value, so those values could not be "
            "compared (every finite value agrees)") in message
    assert "float64 attention mask" in message  # own_nan_cause's own floor still names the cause
    assert [block.n_heads for block in attention_blocks(model)] == [4, 4]


def _float64_mpt() -> torch.nn.Module:
    from support.family_matrix import ANALYSED

    cls, config = ANALYSED["mpt"]()
    torch.manual_seed(0)
    return cls(config).double().eval()


def test_mpts_own_filled_mask_is_named_where_the_floor_cannot_reach_it():
    """MptAttention fills its scores from a boolean mask with float64's lowest value itself, then takes a float32
    softmax: the left-padded row is NaN and no floor of a mask handed to attention removes it. Before, pruning said
    "Check its weights and dtype" and capture blamed an overflow in the block's input or weights (session 45)."""
    model = _float64_mpt()
    probe = probe_inputs(model)
    real = probe["attention_mask"].bool()
    assert _forward(model, probe)[2][real[2]].isnan().all()  # what the messages rest on, in transformers alone
    with pytest.raises(HeadlabError) as caught:
        prune_heads(_float64_mpt(), {("dec_self", 0): [1]})
    message = str(caught.value)
    assert "Cause: MPT's attention (MptAttention) fills its masked scores with float64's lowest value" in message
    assert "load it in float32, where it is finite; nothing was pruned" in message
    with pytest.raises(HeadlabError) as caught:
        with capture_attention(model):
            _forward(model, probe)
    message = str(caught.value)
    assert message.startswith("dec_self layer 0: ") and "batch row 2, queries 0-1: padding" in message
    assert "MptAttention" in message and "Load the model in float32" in message
    assert "overflow" not in message
    float32 = _float64_mpt().float()  # the remedy named works: finite, and the pruning is checked and kept
    assert _forward(float32, probe)[real].isfinite().all()
    prune_heads(float32, {("dec_self", 0): [1]})
    assert [block.n_heads for block in attention_blocks(float32)] == [3, 4]
