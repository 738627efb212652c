"""Falcon with ALiBi (``alibi=True``) under transformers' eager attention adds each head's bias twice.

transformers 5.24, ``modeling_falcon``: ``FalconModel.forward`` folds the ALiBi biases, divided by ``sqrt(d_head)``,
into the 4-D attention mask it hands every layer, whatever the implementation; ``FalconAttention.forward``'s eager
branch then adds ``alibi`` to the scores once more::

    eager: softmax((q k^T + alibi) / sqrt(d) + (alibi / sqrt(d) + mask))   # twice the slopes
    sdpa:  softmax( q k^T          / sqrt(d) + (alibi / sqrt(d) + mask))   # once

SDPA's is the correct one: the original Falcon code (tiiuae's ``modelling_RW.py``:
``softmax((scores + alibi) * inv_norm_factor + mask)`` with a boolean mask) and Bloom's
(``alibi.baddbmm(q, k^T, alpha=inv_norm_factor)``, its mask separate) add one bias per head, as ALiBi has it
(Press et al. 2022, Sec. 3: ``softmax(q_i K^T + m * [-(i-1), ..., -1, 0])``), and it is what a Falcon loaded with the
default implementation (SDPA) computes. Eager's probabilities, and the logits after them, are another model's.

headlab reads attention probabilities in eager mode (:func:`headlab.capture.eager_attention`): for such a model
switched to eager from SDPA, :func:`alibi_once` hands each Falcon attention a zero ``alibi`` while its mask carries the
biases, so eager computes SDPA's scores (the model's own) and returns their softmax. A model *loaded* in eager mode
computes the doubled bias in every forward of its own: :func:`refuse_alibi_twice` refuses to measure it, before any
work, naming the bug and the way out (load it with ``attn_implementation="sdpa"``).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

import torch
from torch import nn

from headlab.adapters.discovery import attention_configs
from headlab.errors import HeadlabError

__all__ = ["SWITCHED", "adds_alibi_twice", "refuse_alibi_twice", "alibi_once"]

SWITCHED = "_headlab_switched_to_eager"
"""Key in a model's ``__dict__`` while headlab has switched it to eager (:func:`headlab.capture.eager_attention`):
its eager implementation is then headlab's, not the one it was loaded with."""


@lru_cache(maxsize=8)
def _module_adds_twice(module_name: str) -> bool:
    """Whether the modeling module folds ALiBi into the mask and its eager attention adds it again (read off its
    source, so that a transformers version that fixes either is no longer refused or corrected)."""
    try:
        source = inspect.getsource(sys.modules[module_name])
    except (KeyError, OSError, TypeError):
        return False
    folds = "alibi / math.sqrt" in source  # FalconModel.forward: masked_fill(alibi / sqrt(d_head), ...)
    adds = "attention_scores + alibi" in source  # FalconAttention.forward, eager branch
    return folds and adds


def _falcon_alibi(module: nn.Module) -> Any:
    """The config of a Falcon attention module with ALiBi whose modeling code adds it twice in eager mode, or None."""
    config = getattr(module, "config", None)
    if getattr(config, "model_type", None) != "falcon" or not getattr(config, "alibi", False):
        return None
    if not hasattr(module, "query_key_value") or "alibi" not in inspect.signature(type(module).forward).parameters:
        return None  # not the attention itself (FalconDecoderLayer takes alibi too)
    return config if _module_adds_twice(type(module).__module__) else None


def adds_alibi_twice(model: nn.Module) -> bool:
    """Whether ``model`` runs, as loaded (not switched by headlab), the eager attention of a Falcon with ALiBi,
    which adds each head's bias twice."""
    if model.__dict__.get(SWITCHED):
        return False
    if not any(getattr(c, "model_type", None) == "falcon" and getattr(c, "alibi", False)
               for c in attention_configs(model)):
        return False
    return any(config._attn_implementation == "eager"
               for config in (_falcon_alibi(m) for m in model.modules()) if config is not None)


def refuse_alibi_twice(model: nn.Module, what: str) -> None:
    """Refuse to measure ``what`` on a Falcon with ALiBi loaded with eager attention (see the module's docstring)."""
    if adds_alibi_twice(model):
        raise HeadlabError(
            f"{what}: this Falcon with ALiBi (alibi=True) was loaded with attn_implementation='eager', whose attention "
            "in this transformers version adds each head's ALiBi bias twice (once to the scores, once in the attention "
            "mask FalconModel folded it into; SDPA adds it once, as the original Falcon), so its attention and "
            "outputs are not the model's: load it with attn_implementation='sdpa' (the default; headlab still reads "
            "its attention probabilities, computed with the bias once)")


def _argument(module: nn.Module, name: str, args: tuple, kwargs: dict) -> tuple[int | None, Any]:
    """Where ``name`` was passed (its position, or None for a keyword) and its value."""
    if name in kwargs:
        return None, kwargs[name]
    position = list(inspect.signature(type(module).forward).parameters).index(name) - 1  # without self
    return position, args[position] if position < len(args) else None


def _zero_alibi(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Hand the eager attention a zero ``alibi`` where its mask carries the biases (a float mask with a finite
    non-zero entry: FalconModel folded ``alibi / sqrt(d_head)`` into it); else leave the call alone."""
    position, alibi = _argument(module, "alibi", args, kwargs)
    _, mask = _argument(module, "attention_mask", args, kwargs)
    if not isinstance(alibi, torch.Tensor) or not isinstance(mask, torch.Tensor) or not mask.is_floating_point():
        return None
    visible = mask > torch.finfo(mask.dtype).min / 2
    if not bool((visible & (mask != 0)).any()):  # no bias in the mask: eager adds alibi once, as it should
        return None
    zero = torch.zeros_like(alibi)
    if position is None:
        return args, {**kwargs, "alibi": zero}
    return (*args[:position], zero, *args[position + 1:]), kwargs


@contextmanager
def alibi_once(model: nn.Module) -> Iterator[None]:
    """Inside, every Falcon attention with ALiBi of ``model`` (switched to eager by headlab) adds its bias once, as
    SDPA does: a forward pre-hook hands it a zero ``alibi`` while its mask carries the biases. Removed on exit."""
    handles = [m.register_forward_pre_hook(_zero_alibi, with_kwargs=True)
               for m in model.modules() if _falcon_alibi(m) is not None]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
