"""ProphetNet's padding masks made usable in float64, padded targets refused, and its streams marked (transformers 5.24,
models/prophetnet/modeling_prophetnet.py).

What transformers does: ``ProphetNetEncoder`` and ``ProphetNetDecoder`` turn their padding masks into additive ones as
``(1.0 - mask) * torch.finfo(self.dtype).min``. From an integer or boolean mask (a tokenizer's), ``1.0 - mask`` is
float32; in a float64 model ``finfo(float64).min`` overflows float32 to -inf, so an unmasked key gets ``0 x -inf`` =
NaN and every output of a padded batch (and of an unpadded one given its mask) is NaN. In float32, bfloat16 and
float16 the minimum fits float32 and nothing goes wrong.

What headlab does: :func:`install` (called whenever headlab makes the model's blocks) swaps the two stacks' classes for
subclasses of the same names, no hook (as :func:`headlab.adapters.convbert.install_padding_mask`), whose forward hands
a float64 model its integer or boolean masks as float64 (the same zeros and ones): the additive masks are then 0 and
``finfo(float64).min``, what a float mask gives transformers' own forward. In any other precision the forward is the
original's, untouched. The decoder's forward also refuses, before it runs, a teacher-forced batch whose padding mask
masks positions: its predicting streams' relative-position scores are gathered from rows in an order that follows the
padded length (``get_predict_relative_pos_embeddings``: the projected scores ordered [batch, position, stream, head],
the buckets [stream, batch, head, position]), so a right-padded row's logits differ from the row alone (by 4e-4 on a
tiny model in float64), and a position's logits change with the sequence's length; the main stream, whose maps
headlab reads, is untouched by it. Batches of one target length (one sentence per batch) are the rows alone; so is
cached generation (checked: a batch of two generates what each does alone), whose scores differ from a teacher-forced
pass over the same tokens for that reason (4e-4 on the tiny model: one position per step). It also marks each
``ProphetNetAttention`` with how many streams its queries stack (``headlab_streams``, an attribute its forward never
reads), which :func:`headlab.adapters.families.prophetnet_probs` reads: 1 in the encoder, ``1 + ngram`` in a decoder
layer's cross- attention, whose queries are the decoder's ``[main stream | ngram predicting streams]`` along the
sequence.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from headlab.errors import HeadlabError

MASKS: dict[str, tuple[tuple[str, int], ...]] = {
    "ProphetNetEncoder": (("attention_mask", 1),),
    "ProphetNetDecoder": (("attention_mask", 1), ("encoder_attention_mask", 3))}
"""The stacks whose forward makes additive masks of its padding masks: (argument, position) of each mask."""
PADDED_TARGETS_REFUSED = {"prophetnet": (
    "ProphetNet's decoder runs one sentence per batch in headlab: transformers' predicting streams gather their "
    "relative-position scores in an order that follows the padded length, so a padded target row's logits differ "
    "from the row's alone, and a batch of several sentences pads its targets")}
"""Model types whose decoder refuses padded target batches (:func:`check_target_padding`): what ``headlab analyze``
and ``headlab importance`` say before any work where ``--batch-size`` is more than 1."""


def batch_size_problem(model_type: str | None, batch_size: int) -> str | None:
    """Why ``--batch-size`` ``batch_size`` cannot run a model of ``model_type`` (:data:`PADDED_TARGETS_REFUSED`), or
    None."""
    if model_type not in PADDED_TARGETS_REFUSED or batch_size <= 1:
        return None
    return f"--batch-size {batch_size}: {PADDED_TARGETS_REFUSED[model_type]}; give --batch-size 1"
_INSTALLED = "_headlab_float_masks"
_CLASSES: dict[type, type] = {}


def float_masks(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` of a call of ``module`` (a :data:`MASKS` stack) with its integer or boolean masks as
    float64 where the module is float64; as they were otherwise."""
    if getattr(module, "dtype", None) != torch.float64:
        return args, kwargs
    listed, named = list(args), dict(kwargs)
    for name, position in MASKS[type(module).__name__]:
        positional = name not in named and len(listed) > position
        mask = listed[position] if positional else named.get(name)
        if isinstance(mask, torch.Tensor) and not mask.is_floating_point():
            if positional:
                listed[position] = mask.to(torch.float64)
            else:
                named[name] = mask.to(torch.float64)
    return tuple(listed), named


def check_target_padding(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Refuse, before ``ProphetNetDecoder.forward`` runs, a batch of more than one position whose padding mask masks
    some (see the module's docstring: a padded row's logits are not the row's alone)."""
    if type(module).__name__ != "ProphetNetDecoder":
        return
    mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[1] < 2 or bool(mask.bool().all()):
        return
    row = int((~mask.bool()).any(dim=1).nonzero()[0, 0])
    raise HeadlabError(
        f"ProphetNet's decoder given a batch whose row {row} is padded ({int(mask[row].bool().sum())} of "
        f"{mask.shape[1]} positions): in transformers' ProphetNetNgramSelfAttention the predicting streams' "
        "relative-position scores (get_predict_relative_pos_embeddings) are gathered in an order that follows the "
        "padded length, so a padded row's logits differ from the row's alone (and the next-token logits come from the "
        "first predicting stream); run one sentence per batch (--batch-size 1), or batch targets of one length")


def _forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    args, kwargs = float_masks(self, args, kwargs)
    check_target_padding(self, args, kwargs)
    return type(self)._headlab_plain_forward(self, *args, **kwargs)  # type: ignore[attr-defined]


def _instance_forward(module: nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward``, a module's own (accelerate's hooks set ``module.forward``, calling the class's bound before), with
    the masks as :func:`float_masks` gives them."""
    @functools.wraps(forward)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = float_masks(module, args, kwargs)
        check_target_padding(module, args, kwargs)
        return forward(*args, **kwargs)

    setattr(wrapped, _INSTALLED, True)
    return wrapped


def _swap(module: nn.Module) -> None:
    cls = type(module)
    if not getattr(cls, _INSTALLED, False):
        if cls not in _CLASSES:
            _CLASSES[cls] = type(cls.__name__, (cls,), {
                "forward": _forward, "_headlab_plain_forward": getattr(cls, "forward"),  # noqa: B009
                _INSTALLED: True, "__module__": cls.__module__, "__qualname__": cls.__qualname__})
        module.__class__ = _CLASSES[cls]
    own = vars(module).get("forward")
    if own is not None and not getattr(own, _INSTALLED, False):
        module.forward = _instance_forward(module, own)  # type: ignore[method-assign]


def install(model: nn.Module) -> None:
    """Every ProphetNet stack of ``model`` (once) given float64 masks in float64, every ``ProphetNetAttention`` marked
    with its streams (see the module's docstring)."""
    for module in model.modules():
        name = type(module).__name__
        if name in MASKS:
            _swap(module)
        elif name == "ProphetNetEncoderLayer":
            setattr(module.get_submodule("self_attn"), "headlab_streams", 1)  # noqa: B010
        elif name == "ProphetNetDecoderLayer" and hasattr(module, "cross_attn"):
            streams = 1 + int(getattr(module.get_submodule("self_attn"), "ngram"))  # noqa: B009
            setattr(module.get_submodule("cross_attn"), "headlab_streams", streams)  # noqa: B010
