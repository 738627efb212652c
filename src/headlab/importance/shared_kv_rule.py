"""The LRP rule for DeepSeek-V4's attention (``DeepseekV4Attention``, transformers 5.24, models/deepseek_v4).

Its forward (``DeepseekV4Attention.forward``, the compressors' and the indexer's, read in transformers 5.24), for the
layer's normed input ``h``::

    r   = q_a_norm(q_a_proj(h));   q = rope(q_b_norm(q_b_proj(r)))            # per head
    kv  = rope(kv_norm(kv_proj(h)))                                          # one head: the key AND the value
    c_w = rope_w(kv_norm'(sum_j softmax_j(gate_proj'(h)_j + position_bias) kv_proj'(h)_j))   # a window's entry
    K = V = [kv | c]                       # compressed_sparse_ and heavily_compressed_attention layers only
    o   = softmax([q K^T * scaling + mask + block_bias | sink]) V   (the sink's column dropped)
    out = o_b_proj(o_a_proj(rope^-1(o)))   # the conjugate rotation per query, then the grouped output projection

The rule is headlab's attention rule (rules.py's docstring; Voita et al. 2019, App. A: the attention weights are the
weights of a weighted sum, held constant, the TF code's ``consider_attn_constant``; AttnLRP, Achtibat et al. 2024),
part by part:

* the queries: ``q_b_proj``'s output detached (a head row, as every query projection's);
* the one key-value head is both key and value (the same tensor, ``kv``, handed to the attention function twice): the
  keys are held constant inside the attention function (its ``key`` argument detached, its ``value`` not), so ``p`` is
  a constant and all relevance flows through the values, as Gemma 4's ``attention_k_eq_v`` keys are held after their
  norm (rules.KEYS_ONLY). The function is the module's own ``eager_attention_forward`` (DeepSeek-V4 runs eager only),
  called through :data:`NAME`, registered with transformers' ``AttentionInterface``, which the model's config names
  while the rules are on (:func:`keys_held`);
* the compressor's entries: a window's softmax weights, computed from ``gate_proj``'s output, are weights of a weighted
  sum of ``kv_proj``'s outputs, held constant as the attention weights are (``gate_proj``'s output detached); the sum,
  its RMS norm (the norms' rule), the fixed rotation at the window's position and the concatenation are then linear in
  ``kv_proj``'s output, so the entries, keys and values like the tokens', pass relevance by the linear rule;
* the indexer (sparse layers) only selects entries: integer top-k indices folded into the compressor's block bias, a
  mask no gradient crosses (as DeepSeek-V3.2's and GLM-MoE-DSA's indexer, rules.py); it needs no rule;
* the inverse rotation of each head's output (cos and -sin at the query's position: constants of the positions, a
  rotation of the head's own features) and the grouped ``o_a_proj`` and ``o_b_proj`` (bias-free) are linear maps: their
  ordinary backward is the linear rule, so relevance is conserved through them, and a head's relevance, read at
  ``o_a_proj``'s input, is that of its output before the rotation.

The hyper-connections joining the layers have their rule in :mod:`headlab.importance.mixer_rules.hyper_connection`.

Refused before any work (:func:`problem`), naming what: an attention class with a shared key-value head other than
``DeepseekV4Attention``; a compressor or indexer of another class, or without its ``gate_proj`` (a linear map); a
modeling module without ``eager_attention_forward``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from headlab.adapters import AttentionBlock
from headlab.capture import running_attention_function
from headlab.errors import HeadlabError

__all__ = ["NAME", "hooks", "is_shared_kv", "keys_held", "keys_held_eager", "problem"]

NAME = "headlab_lrp_shared_kv"
"""The attention implementation under which :func:`keys_held_eager` is registered with transformers."""
ATTENTION = "DeepseekV4Attention"
COMPRESSORS = ("DeepseekV4CSACompressor", "DeepseekV4HCACompressor")
INDEXER = "DeepseekV4Indexer"


def is_shared_kv(block: AttentionBlock) -> bool:
    """Whether ``block``'s one key-value head is both its key and its value (``Family.shared_kv``: DeepSeek-V4)."""
    return block.family.shared_kv


def _detach(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    return output.detach()


def problem(block: AttentionBlock) -> str | None:
    """Why the rule does not fit ``block`` (None: it does)."""
    core: Any = block.core
    name = type(core).__name__
    if name != ATTENTION:
        return (f"its one key-value head is both key and value ({name}), and headlab's rule for that is DeepSeek-V4's "
                f"({ATTENTION}, read in transformers 5.24): how this one computes its keys is unknown")
    if not callable(getattr(sys.modules.get(type(core).__module__), "eager_attention_forward", None)):
        return (f"its modeling module {type(core).__module__} has no eager_attention_forward, the function in which "
                "headlab holds the keys (which are its values) constant")
    compressor = getattr(core, "compressor", None)
    if compressor is None:
        return None
    kind = type(compressor).__name__
    if kind not in COMPRESSORS or not isinstance(getattr(compressor, "gate_proj", None), nn.Linear) \
            or not isinstance(getattr(compressor, "kv_proj", None), nn.Linear):
        return (f"its compressor {kind} is not one headlab read ({', '.join(COMPRESSORS)}: entries pooled from "
                "kv_proj's outputs with softmax weights from gate_proj's), so its weights cannot be held constant")
    indexer = getattr(compressor, "indexer", None)
    if kind == COMPRESSORS[0] and type(indexer).__name__ != INDEXER:
        return (f"its compressor's indexer {type(indexer).__name__} is not {INDEXER} (integer top-k indices folded "
                "into a mask), so what it passes on is unknown")
    return None


def hooks(block: AttentionBlock) -> list[tuple[nn.Module, Any]]:
    """(module, forward hook): the queries' projection and the compressor's gate projection detached (the keys are
    held in the attention function: :func:`keys_held`)."""
    core: Any = block.core
    held: list[tuple[nn.Module, Any]] = [(core.q_b_proj, _detach)]
    if getattr(core, "compressor", None) is not None:
        held.append((core.compressor.gate_proj, _detach))
    return held


def keys_held_eager(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0, **kwargs: Any) -> tuple:
    """The module's own eager attention (its modeling module's ``eager_attention_forward``) with its keys detached,
    its values not: the same values, bit for bit, and the attention weights a constant of the backward pass."""
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if not callable(eager):  # refused by problem() before any work; another model sharing the config here
        raise HeadlabError(f"{type(module).__name__}: its modeling module {type(module).__module__} has no "
                           "eager_attention_forward, the function headlab's LRP rule for its shared keys runs")
    return eager(module, query, key.detach(), value, attention_mask, scaling, dropout, **kwargs)


@contextmanager
def keys_held(blocks: list[AttentionBlock]) -> Iterator[None]:
    """Inside, the blocks with a shared key-value head (:func:`is_shared_kv`) run :func:`keys_held_eager`: their
    configs' attention implementation is :data:`NAME` (:func:`headlab.capture.running_attention_function`), and back
    to what it was on exit. A config on another implementation than eager (the only one DeepSeek-V4 has, which LRP
    runs) is refused."""
    configs: list[Any] = list({id(b.core.config): b.core.config for b in blocks
                               if b.n_heads and not b.idle and is_shared_kv(b)}.values())
    for config in configs:
        if config._attn_implementation not in (None, "eager"):
            raise HeadlabError(f"LRP: DeepSeek-V4's attention runs {config._attn_implementation!r}, where headlab's "
                               "rule holds its shared keys constant in its eager attention only")
    with running_attention_function(configs, NAME, keys_held_eager):
        yield
