"""BigBird's block-sparse attention (transformers 5.24, models/big_bird/modeling_big_bird.py; BigBird-Pegasus's
encoder holds a copy, models/bigbird_pegasus), read so that headlab can analyse, mask and prune it exactly.

What transformers does, and what headlab does about it:

* ``BigBirdBlockSparseAttention`` splits the (padded) tokens into blocks of ``block_size``: the first and the last
  block's queries attend over every key; every other block's over the first and the last block, its own and its two
  neighbours, and ``num_random_blocks`` random blocks. In evaluation mode the random blocks are not drawn: the
  helpers return all-zero indices (``_bigbird_block_rand_mask_with_head``: "During inference (eval) no randomness"),
  so each random block is the first block again, and a middle query's softmax counts the first block's keys
  ``1 + num_random_blocks`` times: the map is a function of the input (two forwards are equal), but the weight
  applied to a first-block key is ``(1 + num_random_blocks)`` times each entry. The dense map transformers builds
  beside (its second output, always returned) scatters the random entries onto the first block's columns,
  overwriting instead of adding: its middle rows sum to less than one. :func:`sparse_probs` multiplies those
  columns back, checks that every query's row sums to one, and zeroes the padded queries' rows (their output is
  zeroed by ``from_mask``).
* ``BigBirdModel.forward`` (BigBird-Pegasus's ``BigBirdPegasusEncoder.forward``, its copy) switches the whole
  model to full attention on inputs of at most ``(5 + 2 * num_random_blocks) * block_size`` tokens, for good
  (``set_attention_type`` replaces every layer's attention module), and pads the tokens to a multiple of
  ``block_size`` (``Family.padded_by``). The block layout follows the padded length: a sentence padded by its batch
  past its own last block attends otherwise than alone (its last block is no longer global). :func:`install_guard`
  refuses both before the forward runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from headlab.errors import HeadlabError

GUARDED_CLASSES = {"BigBirdModel": "BigBirdSelfAttention", "BigBirdPegasusEncoder": "BigBirdPegasusSelfAttention"}
"""The modules whose forward pads the tokens and switches their attention modules on short inputs (BigBird's model,
BigBird-Pegasus's encoder), with the class of the full attention they switch to."""
_GUARDED = "_headlab_block_sparse_guard"


def sparse_probs(core: Any, args: tuple, kwargs: dict, output: Any) -> torch.Tensor:
    """The probabilities each query of ``core`` (a ``BigBirdBlockSparseAttention``) weighed the keys with,
    ``[batch, heads, q, k]`` over the padded tokens, from transformers' dense map ``output[1]`` (see the module's
    docstring): the first block's columns of the rows of blocks 1 .. n-2 times ``1 + num_random_blocks``."""
    if core.training:
        raise HeadlabError(f"{type(core).__name__}: in training mode its random blocks are drawn (seeded per layer); "
                           "headlab reads its maps in evaluation mode only")
    probs = output[1]
    size, repeats = int(core.block_size), 1 + int(core.num_random_blocks)
    probs = probs.clone()
    probs[:, :, size:-size, :size] *= repeats
    from_mask = kwargs.get("from_mask", args[2] if len(args) > 2 else None)
    if from_mask is None:
        raise HeadlabError(f"{type(core).__name__} ran without from_mask: headlab cannot tell its padded queries")
    real = from_mask.reshape(probs.shape[0], 1, probs.shape[2], 1).to(probs.dtype)
    probs = probs * real
    sums = probs.sum(dim=-1, dtype=torch.float64)  # a half-precision sum over thousands of keys would drift
    tolerance = float(torch.finfo(probs.dtype).eps) ** 0.5
    off = (sums - real[..., 0].double()).abs().amax() if probs.numel() else torch.zeros(())
    if float(off) > tolerance:
        raise HeadlabError(f"{type(core).__name__}: its dense map, read as transformers 5.24 builds it (random blocks "
                           f"all the first block in evaluation mode), has a query's row summing to 1 {float(off):+.3g} "
                           "off: this transformers draws its random blocks otherwise, which headlab does not read")
    return probs


def _tokens(module: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
    tokens = kwargs.get("input_ids", args[0] if args else None)
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
    if tokens is None:
        raise HeadlabError(f"{type(module).__name__} was called with neither input_ids nor inputs_embeds")
    return tokens


def check_input(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Refuse, before ``BigBirdModel.forward`` (``BigBirdPegasusEncoder.forward``) runs, an input on which
    block-sparse attention would not be the same function of each sentence as when it runs alone, or would not run
    (see the module's docstring)."""
    config = getattr(module, "config")  # noqa: B009 (mypy: a module's attribute)
    if getattr(module, "attention_type", None) != "block_sparse":
        raise HeadlabError(_switched(module))
    size = int(config.block_size)
    threshold = (5 + 2 * int(config.num_random_blocks)) * size
    tokens = _tokens(module, args, kwargs)
    length = int(tokens.shape[1])
    retry = ("; or load it with attention_type='original_full' (full attention, which headlab analyses on any "
             "input)")
    if length <= threshold:
        raise HeadlabError(f"block-sparse BigBird given {length} tokens: on inputs of at most {threshold} tokens "
                           f"((5 + 2 x num_random_blocks) x block_size, {config.num_random_blocks} and {size}) "
                           "transformers runs full attention instead, and switches every layer's attention module to "
                           "full attention for good (set_attention_type), which headlab's blocks would no "
                           f"longer be; give it inputs longer than {threshold} tokens" + retry)
    mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    if mask is None:
        return
    mask = mask.to(torch.bool)
    spans = mask.long().sum(dim=1)
    positions = torch.arange(length, device=mask.device)
    if not bool(torch.equal(mask, positions[None, :] < spans[:, None])):
        raise HeadlabError("block-sparse BigBird given a batch padded on the left or with gaps: its blocks follow the "
                           "positions, so a sentence's attention would differ from its attention alone; pad on the "
                           "right" + retry)
    blocks = -(-length // size)
    for row, span in enumerate(spans.tolist()):
        if -(-span // size) != blocks or span <= threshold:
            raise HeadlabError(
                f"block-sparse BigBird given a batch whose sentence {row} has {span} of its {length} tokens: its "
                f"attention follows the padded length (blocks of {size}, the last one global), so the sentence would "
                "attend otherwise than alone" + (f" (alone, at most {threshold} tokens, it runs full attention)"
                                                 if span <= threshold else "") +
                f"; batch sentences whose lengths round up to the same multiple of {size} tokens, all longer than "
                f"{threshold}, or run one sentence per batch" + retry)


def block_sparse_layout(model: nn.Module) -> tuple[int, int] | None:
    """(block_size, threshold) of a block-sparse BigBird (BigBird-Pegasus): it runs block-sparse attention on inputs
    longer than the threshold, (5 + 2 x num_random_blocks) x block_size tokens, and :func:`check_input` refuses the
    others; None for any other model."""
    for module in model.modules():
        if type(module).__name__ in GUARDED_CLASSES and getattr(module, "attention_type", None) == "block_sparse":
            config = getattr(module, "config")  # noqa: B009 (mypy: a module's attribute)
            size = int(config.block_size)
            return size, (5 + 2 * int(config.num_random_blocks)) * size
    return None


def block_sparse_probe(model: nn.Module) -> tuple[int, int, int] | None:
    """(length, right padding, left padding) of a probe batch that a block-sparse BigBird runs as :func:`check_input`
    lets it: two blocks past its threshold, the padding within the last block, none on the left; None for any other
    model."""
    layout = block_sparse_layout(model)
    if layout is None:
        return None
    size, threshold = layout
    return (threshold // size + 2) * size, min(2, size - 1), 0


def _switched(module: nn.Module) -> str:
    return (f"this block-sparse BigBird runs full attention now ({type(module).__name__}.attention_type is "
            f"{getattr(module, 'attention_type', None)!r}): transformers switched its attention modules for good on "
            "an earlier input too short for block-sparse attention; load it afresh, or call "
            "set_attention_type('block_sparse') on it")


def _guarded_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
    check_input(self, args, kwargs)
    return self._headlab_unguarded_forward(*args, **kwargs)


_CLASSES: dict[type, type] = {}


def _guarded(cls: type) -> type:
    """``cls`` with :func:`check_input` before its forward (one class per original, named as it, as
    :func:`headlab.adapters.xlnet._with_points`): no hook, so that headlab's hooks come off as they went on."""
    if getattr(cls, _GUARDED, False):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (cls,), {
            "forward": _guarded_forward, "_headlab_unguarded_forward": getattr(cls, "forward"),  # noqa: B009
            _GUARDED: True, "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    return _CLASSES[cls]


def _guarded_instance(module: nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward``, a module's own (an instance attribute: accelerate's hooks replace ``module.forward`` so, calling
    the class's forward bound before), with :func:`check_input` before it."""
    @functools.wraps(forward)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        check_input(module, args, kwargs)
        return forward(*args, **kwargs)

    setattr(guarded, _GUARDED, True)
    return guarded


def install_guard(model: nn.Module) -> None:
    """Give every ``BigBirdModel`` and ``BigBirdPegasusEncoder`` of ``model`` (once) a forward that refuses, before
    transformers' runs, what :func:`check_input` refuses: an input on which transformers would swap the attention
    modules, or whose batch padding would change a sentence's block layout (its class becomes a subclass of the same
    name; nothing it computes changes). Refuses a model already switched to full attention."""
    for module in model.modules():
        full = GUARDED_CLASSES.get(type(module).__name__)
        if full is None:
            continue
        if getattr(module, "attention_type", None) != "block_sparse" or any(
                type(m).__name__ == full for m in module.modules()):
            raise HeadlabError(_switched(module))
        module.__class__ = _guarded(type(module))
        own = vars(module).get("forward")  # a forward set on the instance (accelerate's) would skip the class's
        if own is not None and not getattr(own, _GUARDED, False):
            module.forward = _guarded_instance(module, own)  # type: ignore[method-assign]
