"""A pruned T5 stack's position bias hooks (headlab.portable_code.StackBiasHook) travel with the model, pruned by
headlab or loaded by plain transformers through pruned_heads.py:

* a deep copy reads its own relative position bias table, not the original's: the hooks were closures over the
  table's layer, which ``copy.deepcopy`` does not copy, so a copy given other weights (training's averaged model,
  ``training.loop._average_and_validate``: a deep copy loaded with the averaged weights, then validated) computed its
  pruned layers' bias from the original's table, silently;
* the model pickles (``torch.save``; a closure does not) and the unpickled model computes the same logits;
* generate() with a static cache (``cache_implementation="static"``) equals the masked model's: T5Attention biases
  every slot of a static cache (``key_states.shape[-2]``, ``max_cache_len``), where the hook built ``past + q``
  columns and the pruned model failed (a size mismatch);
* every tensor a hook hands its layer is on that layer's device (its hidden states'), the bias computed where the
  stack's table is: a device_map may put the first layer and a later one apart (transformers' own T5 hands the first
  layer's bias on, which accelerate's hooks move). With the later layer's inputs on the meta device standing in for
  another device, the hook handed a CPU bias (T5) or failed adding the CPU bias to the meta mask (local LongT5) until
  session 34 (the first layer's device on real GPUs: tests/test_cuda.py); with the first layers offloaded by
  accelerate (their table on the meta device outside their forward) the logits are the same.

Tiny float64 T5, local LongT5 and transient-global LongT5 (since session 41: both its tables), the first layer of each
stack (the one with the table) pruned and a layer with no head left.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import transformers as tf

from headlab import mask_heads, prune_heads, save_pruned
from support.family_matrix import perturbed_model

SPEC = {("enc_self", 0): [1, 3], ("enc_self", 1): [0, 1, 2, 3], ("dec_self", 0): [2], ("dec_self", 1): [0, 3],
        ("dec_cross", 1): [0, 1, 2, 3]}
# the first layers (the tables') with no head left: their stand-ins keep the table and compute_bias
EMPTIED_FIRST = {("enc_self", 0): [0, 1, 2, 3], ("enc_self", 1): [2], ("dec_self", 0): [0, 1, 2, 3],
                 ("dec_self", 1): [1]}


FAMILIES = ["t5", "longt5", "longt5-tglobal"]
CORES = {"t5": {"T5Attention"}, "longt5": {"LongT5LocalAttention", "LongT5Attention"},
         "longt5-tglobal": {"LongT5TransientGlobalAttention", "LongT5Attention"}}


def _same(family: str, how: str) -> float:
    """The tolerance of a pruned model against its copy (pickled, or its first layers' weights copied by accelerate's
    offloading): none, but for the tiny transient-global LongT5 loaded by plain transformers, whose encoder's first
    layer's weights sit 56 bytes past a 64-byte boundary (views into one loaded buffer): the BLAS kernels round its
    matrix products otherwise on aligned copies, by an ulp (measured 2e-16 at layer 0's output, 1e-15 in the logits;
    the weights' values and strides equal; cloning them in place removes it). Which layout a load gives is chance."""
    return 1e-13 if (family, how) == ("longt5-tglobal", "plain") else 0.0


def _model(family: str) -> torch.nn.Module:
    sizes = dict(vocab_size=99, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_decoder_layers=2, num_heads=4,
                 relative_attention_num_buckets=8, relative_attention_max_distance=16, pad_token_id=0, eos_token_id=1,
                 decoder_start_token_id=0)
    if family == "longt5":
        cls, config = tf.LongT5ForConditionalGeneration, tf.LongT5Config(**sizes, local_radius=2,
                                                                          encoder_attention_type="local")
    elif family == "longt5-tglobal":  # side keys of 3 blocks of 3 tokens (the 10th an orphan)
        cls, config = tf.LongT5ForConditionalGeneration, tf.LongT5Config(
            **sizes, local_radius=2, global_block_size=3, encoder_attention_type="transient-global")
    else:
        cls, config = tf.T5ForConditionalGeneration, tf.T5Config(**sizes)
    return perturbed_model(cls, config, seed=4, attn_implementation="eager").double()


def _inputs() -> dict:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 99, (2, 10), generator=g)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, -3:] = 0
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask,
            "decoder_input_ids": torch.randint(3, 99, (2, 5), generator=g)}


def _logits(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


def _tables(model) -> list[torch.Tensor]:
    # a stack's tables, once per stack (an emptied first layer's stand-in holds the same Embeddings): the relative
    # position bias's, and transient-global LongT5's side keys' bias's
    found = {id(table): table.weight for m in model.modules()
             for table in (getattr(m, name, None) for name in ("relative_attention_bias", "global_relative_attention_bias"))
             if isinstance(table, torch.nn.Embedding)}
    return list(found.values())


def _pruned(family: str, how: str, tmp_path, model=None, spec=None) -> torch.nn.Module:
    model = _model(family) if model is None else model
    prune_heads(model, spec or SPEC)
    if how == "headlab":
        return model
    save_pruned(model, tmp_path)
    plain = tf.AutoModelForSeq2SeqLM.from_pretrained(tmp_path, trust_remote_code=True).double()
    plain.config._attn_implementation = "eager"
    return plain


@pytest.mark.parametrize("emptied_first", [False, True], ids=["first pruned", "first emptied"])
@pytest.mark.parametrize("how", ["headlab", "plain"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_deep_copy_of_a_pruned_t5_reads_its_own_table(family, how, emptied_first, tmp_path):
    model = _pruned(family, how, tmp_path, spec=EMPTIED_FIRST if emptied_first else SPEC)
    inputs = _inputs()
    before = _logits(model, inputs)
    twin = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        shifts = [torch.randn(table.shape, generator=g, dtype=table.dtype) for table in _tables(model)]
        for table, shift in zip(_tables(model), shifts):
            table.add_(shift)
    after = _logits(model, inputs)
    assert not torch.allclose(after, before)  # the table moves the pruned layers' outputs
    torch.testing.assert_close(_logits(twin, inputs), before, atol=1e-12, rtol=0)  # not the original's table
    with torch.no_grad():
        for table, shift in zip(_tables(twin), shifts):
            table.add_(shift)
    torch.testing.assert_close(_logits(twin, inputs), after, atol=1e-12, rtol=0)  # its own


@pytest.mark.parametrize("emptied_first", [False, True], ids=["first pruned", "first emptied"])
@pytest.mark.parametrize("how", ["headlab", "plain"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_pruned_t5_pickles(family, how, emptied_first, tmp_path):
    model = _pruned(family, how, tmp_path, spec=EMPTIED_FIRST if emptied_first else SPEC)
    inputs = _inputs()
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    torch.testing.assert_close(_logits(loaded, inputs), _logits(model, inputs), atol=_same(family, how), rtol=0)


def _static_generation(model, inputs) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        out = model.generate(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], max_new_tokens=5,
                             min_new_tokens=5, do_sample=False, num_beams=1, cache_implementation="static",
                             output_scores=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.scores)


@pytest.mark.parametrize("how", ["headlab", "plain"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_pruned_t5_generates_with_a_static_cache(family, how, tmp_path):
    model, inputs = _model(family), _inputs()
    with mask_heads(model, SPEC):
        tokens, scores = _static_generation(model, inputs)
    pruned = _pruned(family, how, tmp_path, model)
    pruned_tokens, pruned_scores = _static_generation(pruned, inputs)
    assert torch.equal(pruned_tokens, tokens)
    torch.testing.assert_close(pruned_scores, scores, atol=1e-12, rtol=0)


def _bias_hooks(model) -> list:
    """(layer, its StackBiasHook): headlab's class, or the copy in the directory's pruned_heads.py."""
    return [(module, hook) for module in model.modules() for hook in module._forward_pre_hooks.values()
            if type(hook).__name__ == "StackBiasHook"]


def _tensors(*trees) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for tree in trees:
        values = tree.values() if isinstance(tree, dict) else tree
        found += [value for value in values if isinstance(value, torch.Tensor)]
    return found


@pytest.mark.parametrize("how", ["headlab", "plain"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_bias_hook_hands_its_layer_tensors_on_the_layers_device(family, how, tmp_path):
    model = _pruned(family, how, tmp_path)
    calls = []
    handles = [module.register_forward_pre_hook(
        lambda module, args, kwargs, hook=hook: calls.append((module, hook, args, dict(kwargs))), with_kwargs=True,
        prepend=True) for module, hook in _bias_hooks(model)]
    _logits(model, {**_inputs(), "use_cache": False})
    for handle in handles:
        handle.remove()
    assert {type(module).__name__ for module, *_ in calls} >= CORES[family]

    def meta(value):
        return value.to("meta") if isinstance(value, torch.Tensor) else value

    for module, hook, args, kwargs in calls:
        here = hook(module, args, dict(kwargs))
        there = hook(module, tuple(map(meta, args)), {name: meta(value) for name, value in kwargs.items()})
        assert [t.shape for t in _tensors(*there)] == [t.shape for t in _tensors(*here)]
        assert {t.device.type for t in _tensors(*there)} == {"meta"}, (type(module).__name__, module.layer_idx)


@pytest.mark.parametrize("how", ["headlab", "plain"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_pruned_t5_runs_with_its_tables_offloaded(family, how, tmp_path):
    """accelerate's offloading of each stack's first layer (a device_map's "cpu" beside a GPU; here executed on the
    CPU): its table is on the meta device outside that layer's forward, where the other layers' hooks compute."""
    from accelerate.hooks import attach_align_device_hook

    model, inputs = _pruned(family, how, tmp_path), _inputs()
    expected = _logits(model, inputs)
    for stack in (model.encoder, model.decoder):
        first = stack.block[0]
        attach_align_device_hook(first, execution_device=torch.device("cpu"), offload=True,
                                 weights_map={name: tensor.clone() for name, tensor in first.state_dict().items()})
    assert {table.device.type for table in _tables(model)} == {"meta"}
    torch.testing.assert_close(_logits(model, inputs), expected, atol=_same(family, how), rtol=0)
