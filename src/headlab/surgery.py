"""Physical head removal, and saving/loading pruned models.

transformers v5 dropped ``prune_heads``; this module puts it back for every family the
adapter knows. Removing head h of a block slices rows h*d_head:(h+1)*d_head out of q (and of
k and v when the head owns its key/value head) and the same columns out of the output
projection (q and k rows by ``d_qk`` where query/key heads are wider than value heads:
MiMo-V2-Flash); a fused q/k/v projection is sliced in its own layout (GPT-2, GPT-NeoX, Phi-3,
Falcon, GPT-BigCode, Bloom: :func:`_fused_index`). The attention forwards of transformers v5
mostly infer the head count from tensor shapes, so layers may keep different numbers of heads;
the attributes (and Phi-3's config field) that a forward does read are kept in step. Where a norm spans a whole query
or key projection (OLMo 2's ``q_norm``), that projection and its norm stay whole and the kept heads are selected
after the norm (:func:`_whole_width_norms`); a norm with a row of parameters per head (Chameleon's) loses the pruned
heads' rows (:func:`_per_head_tables`). A layer left with no head is replaced
by :class:`ZeroHeadAttention`, which keeps only the output projection's bias and the residual
path (Voita et al. 2019, footnote 9).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import json
import logging
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, cast

import torch
from torch import nn
from transformers.modeling_utils import local_torch_dtype

from headlab.adapters import (
    AttentionBlock,
    attention_blocks,
    find_block,
    grouped,
    idle_blocks,
    is_linear,
    out_features,
    peft_layer,
    qkv_columns,
    qkv_groups,
    sharing_groups,
    sub_norm,
)
from headlab.adapters.families import (
    FUSED_REFUSED,
    HEAD_PARAMETERS_REFUSED,
    KV_DYNAMIC_MASKS,
    QKV_LAYOUTS,
    SINKS_SCALE_OUTPUT,
    SUB_NORMS,
    VALUE_EMBEDDINGS,
    rows_per_head,
    unpruned_latent_reason,
)
from headlab.compiled import discard_compiled_code
from headlab.errors import HeadlabError, PruningNotExact, counted
from headlab.gates import _STACK as GATE_STACK
from headlab.gates import validate_heads
from headlab.heads import KINDS, HeadSpec, kv_heads_kept, readable_as_umask_allows, write_json
from headlab.options import checked_keywords
from headlab.portable import PLAN_KEY, PRUNING_FILE, check_pruned_numbering, make_portable, restore_original_config
from headlab.portable_code import (
    KEPT_ATTR,
    ORIGINAL_ATTR,
    SCORE_HEADS_ATTR,
    SELECTED_ATTR,
    VALUE_EMBEDS_ATTR,
    LayerConfig,
    NoHeadAttention,
    NoInputConv1d,
    ValueEmbedsHook,
    alibi_hook,
    load_checked_adapter,
    local_bias_hook,
    peft_from_pretrained,
    pruned_class,
    record_kept_blocks,
    selection_hook,
    t5_bias_hook,
    transient_global_bias_hook,
)
from headlab.portable_code import save_adapter as _save_adapter
from headlab.stored_weights import HINT, describe, stored_elsewhere, stored_elsewhere_modules

if TYPE_CHECKING:
    from headlab.prune_check import Mismatch

FORMAT_VERSION = 1

# Attributes on an attention core that record what pruning kept, in original numbering.
# (KEPT_ATTR and ORIGINAL_ATTR are headlab.portable_code's: its ALiBi hook reads them.)
KV_KEPT_ATTR = "_headlab_kept_kv_heads"
# On the model: {"reconstructed": ["dec_self:0", ...]} where its kept heads' numbering was not the original one
# (read off a re-saved directory's weights, checkpoint.record_from_weights); written on in its pruning record.
NUMBERING_ATTR = "_headlab_numbering"
# On a hooked layer of a pruned T5 stack: (path of the stack's first layer, whose table gives the bias; its
# Family.shared_bias), which pruning_plan writes for pruned_heads.py
T5_SOURCE_ATTR = "_headlab_t5_source"


# -- slicing -------------------------------------------------------------------------------
def _head_index(heads: list[int], d_head: int, device) -> torch.Tensor:
    """Feature indices of ``heads``: h*d_head .. (h+1)*d_head-1 for each h, in order."""
    index = [h * d_head + i for h in heads for i in range(d_head)]
    return torch.tensor(index, dtype=torch.long, device=device)


class _Journal:
    """Every attribute pruning sets and hook it adds, so that a prune that fails its check is
    undone: the model is left as it was (the old parameters are kept until then)."""

    _ABSENT = object()

    def __init__(self) -> None:
        self.changes: list[tuple[object, str, object]] = []
        self.hooks: list = []

    def set(self, obj: object, name: str, value: object) -> None:
        old = obj._parameters.get(name, obj._modules.get(name, self._ABSENT)) if isinstance(obj, nn.Module) \
            else self._ABSENT
        if old is self._ABSENT:
            old = getattr(obj, name, self._ABSENT)
        self.changes.append((obj, name, old))
        setattr(obj, name, value)

    def undo(self) -> None:
        for handle in reversed(self.hooks):
            handle.remove()
        for obj, name, old in reversed(self.changes):
            if old is self._ABSENT:
                delattr(obj, name)
            else:
                setattr(obj, name, old)
        self.changes.clear()
        self.hooks.clear()


def _replace(module: nn.Module, name: str, value: torch.Tensor, journal: _Journal) -> None:
    old = getattr(module, name)
    journal.set(module, name, nn.Parameter(value.contiguous(), requires_grad=old.requires_grad))


# I-BERT's QuantLinear: its integer copies of the weight ([out, in]) and bias and its per-row scaling factors, unread
# with quant_mode=False but saved with the weights: sliced with them, so that the saved shapes are the pruned ones
_QUANT_ROWS = ("weight_integer", "fc_scaling_factor", "bias_integer")


def _slice_buffers(module: Any, dim: int, index: torch.Tensor, journal: _Journal) -> None:
    """Slice the buffers of :data:`_QUANT_ROWS` that ``module`` holds along ``dim`` (0: rows, 1: columns)."""
    for name in _QUANT_ROWS:
        buffer = module._buffers.get(name)
        if isinstance(buffer, torch.Tensor) and buffer.dim() > dim:
            journal.set(module, name, buffer.index_select(dim, index.to(buffer.device)).contiguous())


def _slice_conv(module: nn.Conv1d, index: torch.Tensor, outputs: bool, journal: _Journal) -> None:
    """Keep the output (``outputs``) or input channels ``index`` of a 1x1 ``nn.Conv1d`` (SqueezeBERT's; weight
    ``[out, in / groups, 1]``, group j's output channels reading only its input channels). Where every group keeps as
    many channels, the groups stay (group j's kept channels, in order); otherwise the convolution becomes ungrouped,
    its weight ``[out, in, 1]`` zero outside each output channel's group: an output then sums the same products and
    exact zeros, what it summed before. A convolution left with no input channel (a layer with no head: torch's
    convolution refuses an empty input) becomes :class:`~headlab.portable_code.NoInputConv1d`, which adds its bias."""
    groups, weight = module.groups, module.weight
    out_per, in_per = module.out_channels // groups, module.in_channels // groups
    owner = torch.div(index, out_per if outputs else in_per, rounding_mode="floor")
    counts = torch.bincount(owner, minlength=groups) if len(index) else torch.zeros(groups, dtype=torch.long)
    # grouped still: as many channels kept per group, in group order (a convolution's group j is its j-th block)
    if bool((counts == counts[0]).all()) and bool((owner[1:] >= owner[:-1]).all()):
        if outputs:
            new = weight.index_select(0, index)
        else:
            new = torch.cat([weight[j * out_per:(j + 1) * out_per].index_select(1, index[owner == j] - j * in_per)
                             for j in range(groups)], dim=0)
    else:
        dense = weight.new_zeros(module.out_channels, module.in_channels, *weight.shape[2:])
        for j in range(groups):
            dense[j * out_per:(j + 1) * out_per, j * in_per:(j + 1) * in_per] = weight[j * out_per:(j + 1) * out_per]
        new = dense.index_select(0 if outputs else 1, index)
        journal.set(module, "groups", 1)
    _replace(module, "weight", new, journal)
    journal.set(module, "out_channels" if outputs else "in_channels", len(index))
    if outputs and module.bias is not None:
        _replace(module, "bias", module.bias.index_select(0, index.to(module.bias.device)), journal)
    if not outputs and not len(index):
        journal.set(module, "__class__", NoInputConv1d)


def _slice_outputs(module: Any, index: torch.Tensor, journal: _Journal) -> None:
    """Keep output features ``index`` of a Linear (I-BERT's QuantLinear too), a Conv1D (weight [in, out]) or a 1x1
    nn.Conv1d (:func:`_slice_conv`)."""
    index = index.to(module.weight.device)
    if isinstance(module, nn.Conv1d):
        _slice_conv(module, index, True, journal)
        return
    if is_linear(module):
        _replace(module, "weight", module.weight.index_select(0, index), journal)
        journal.set(module, "out_features", len(index))
        _slice_buffers(module, 0, index, journal)
    else:
        _replace(module, "weight", module.weight.index_select(1, index), journal)
        journal.set(module, "nf", len(index))
    if module.bias is not None:
        _replace(module, "bias", module.bias.index_select(0, index.to(module.bias.device)), journal)


def _slice_inputs(module: Any, index: torch.Tensor, journal: _Journal) -> None:
    index = index.to(module.weight.device)
    if isinstance(module, nn.Conv1d):
        _slice_conv(module, index, False, journal)
        return
    if is_linear(module):
        _replace(module, "weight", module.weight.index_select(1, index), journal)
        journal.set(module, "in_features", len(index))
        _slice_buffers(module, 1, index, journal)
    else:
        _replace(module, "weight", module.weight.index_select(0, index), journal)
        if hasattr(module, "nx"):
            journal.set(module, "nx", len(index))


def head_row_modules(block: AttentionBlock) -> list[nn.Module]:
    """The projections of ``block.family.head_rows`` (multi-head latent attention's query and key/value maps, an
    output gate's projection)."""
    return [block.module.get_submodule(path) for path, _ in block.family.head_rows]


def head_vectors(block: AttentionBlock) -> list[tuple[nn.Module, str]]:
    """The parameters of ``block.family.head_vectors`` (one entry per head), as (owning module, name); a layer left
    with no head has none (HY-V4's sinks: its stand-in adopts the original's sub-modules, not its parameters; the
    adapter refuses a vector missing from a layer with heads)."""
    found = []
    for path in block.family.head_vectors:
        owner_path, _, name = path.rpartition(".")
        owner = block.module.get_submodule(owner_path)
        if isinstance(getattr(owner, name, None), torch.Tensor):
            found.append((owner, name))
    return found


def group_holders(block: AttentionBlock) -> list[nn.Module]:
    """The children of ``block.core`` of ``block.family.group_holders`` that hold ``num_key_value_groups`` (NeoMME's
    ``exclusive_self_attention``; a layer left with no head keeps it, unused, as a child of its stand-in)."""
    found = []
    for path in block.family.group_holders:
        try:
            holder = block.core.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(getattr(holder, _GROUP_ATTRS[0], None), int):
            found.append(holder)
    return found


def head_biases(block: AttentionBlock) -> list[tuple[nn.Module, str, str]]:
    """The parameters of ``block.family.head_biases`` (``d_head`` entries per head), as (owning module, name, "q" or
    "v"); a layer left with no head has none (its stand-in adopts the original's sub-modules, not its parameters)."""
    found = []
    for path, part in block.family.head_biases:
        owner_path, _, name = path.rpartition(".")
        owner = block.module.get_submodule(owner_path)
        if isinstance(getattr(owner, name, None), torch.Tensor):
            found.append((owner, name, part))
    return found


def kv_conv_modules(block: AttentionBlock) -> list[tuple[nn.Conv1d, str]]:
    """The depthwise convolutions of ``block.family.kv_convs`` over the key ("k") or value ("v") channels (Inkling's
    ``k_sconv.conv1d``, ``v_sconv.conv1d``), as (convolution, role); a layer left with no head keeps them, sliced to
    no channel, as children of its stand-in."""
    found = []
    for path, role in block.family.kv_convs:
        try:
            conv = block.module.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(conv, nn.Conv1d):
            found.append((conv, role))
    return found


def head_tables(block: AttentionBlock) -> list[tuple[nn.Module, str]]:
    """The parameters of ``block.family.head_tables`` (a row per query head: Inkling2's norms' ``scale``), as (owning
    module, name)."""
    found = []
    for path in block.family.head_tables:
        owner_path, _, name = path.rpartition(".")
        try:
            owner = block.module.get_submodule(owner_path)
        except AttributeError:
            continue
        if isinstance(getattr(owner, name, None), torch.Tensor):
            found.append((owner, name))
    return found


def count_holders(block: AttentionBlock) -> list[tuple[nn.Module, str]]:
    """The sub-modules of ``block.family.count_holders`` with an int ``num_heads`` (Inkling2's
    ``relative_position_bias``: query heads, "q"; its dynamic convolutions: key/value heads, "kv"), as (module, role)."""
    found = []
    for path, role in block.family.count_holders:
        try:
            holder = block.module.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(getattr(holder, "num_heads", None), int):
            found.append((holder, role))
    return found


def kv_dynamic_convs(block: AttentionBlock) -> list[tuple[nn.Module, str]]:
    """The dynamic convolutions of ``block.family.kv_dynamic_convs`` (Inkling2's full-attention layers'
    ``k_proj.sconv``, ``v_proj.sconv``: ``static_weight`` and ``weight_proj``), as (module, "k" or "v")."""
    found = []
    for path, role in block.family.kv_dynamic_convs:
        try:
            conv = block.module.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(getattr(conv, "static_weight", None), torch.Tensor) and \
                isinstance(getattr(conv, "weight_proj", None), nn.Linear):
            found.append((conv, role))
    return found


def _head_parts_problem(block: AttentionBlock) -> str | None:
    """Why a part of ``block`` that pruning slices per head by its tables (``Family.head_tables``, ``count_holders``,
    ``kv_dynamic_convs``) does not have the sizes the slicing assumes (one row per query head; a head count equal to
    the block's; ``static_weight`` ``[kernel, channels]`` and ``weight_proj`` of kernel rows per key/value head);
    None where each has."""
    for owner, name in head_tables(block):
        table = getattr(owner, name)
        if table.dim() < 1 or table.shape[0] != block.n_heads:
            return (f"its {_child_name(block, owner)}.{name} {list(table.shape)} is not one row per query head of the "
                    f"{block.n_heads}, which pruning would slice with the heads")
    for holder, role in count_holders(block):
        count = block.n_heads if role == "q" else block.n_kv_heads
        if holder.num_heads != count:
            return (f"its {_child_name(block, holder)} views its states by num_heads={holder.num_heads}, not the "
                    f"block's {count} {'query' if role == 'q' else 'key/value'} heads")
    for conv, role in kv_dynamic_convs(block):
        width = block.n_kv_heads * (block.d_qk if role == "k" else block.d_head)
        static, projection = cast(torch.Tensor, conv.static_weight), cast(nn.Linear, conv.weight_proj)
        kernel = static.shape[0] if static.dim() == 2 else -1
        if static.dim() != 2 or static.shape[1] != width or projection.out_features != block.n_kv_heads * kernel \
                or getattr(conv, "conv_kernel_size", None) != kernel:
            return (f"its dynamic convolution {_child_name(block, conv)} (static_weight {list(static.shape)}, weight_proj "
                    f"{projection.in_features} -> {projection.out_features}) does not hold a kernel per channel of its "
                    f"{width} and one per key/value head of its {block.n_kv_heads}, as headlab's slicing reads it")
    return None


def _slice_dynamic_conv(conv: nn.Module, channels: torch.Tensor, kv_keep: list[int], journal: _Journal) -> None:
    """Keep the kept channels' columns of a dynamic convolution's ``static_weight`` (``[kernel, channels]``), the kept
    key/value heads' ``kernel`` rows each of ``weight_proj`` (repeats allowed), and set ``num_heads``."""
    static = cast(torch.Tensor, conv.static_weight)
    kernel = static.shape[0]
    _replace(conv, "static_weight", static.index_select(1, channels.to(static.device)), journal)
    projection = cast(nn.Linear, conv.weight_proj)
    _slice_outputs(projection, _head_index(kv_keep, kernel, projection.weight.device), journal)
    journal.set(conv, "num_heads", len(kv_keep))


def _slice_head_parts(block: AttentionBlock, keep: list[int], kv_keep: list[int], journal: _Journal) -> None:
    """The parts per head a block's tables name, kept for heads ``keep`` and key/value heads ``kv_keep``: the channels
    of its depthwise key/value convolutions (Inkling's ``k_sconv``, Inkling2's sliding layers) and of its dynamic ones
    with their rows per key/value head (Inkling2's full layers), a row per query head of its tables (Inkling2's norms'
    ``scale``), and its sub-modules' ``num_heads``."""
    device = block.o.weight.device
    for conv, role in kv_conv_modules(block):
        _slice_depthwise(conv, _head_index(kv_keep, block.d_qk if role == "k" else block.d_head, device), journal)
    for dynamic_conv, role in kv_dynamic_convs(block):
        channels = _head_index(kv_keep, block.d_qk if role == "k" else block.d_head, device)
        _slice_dynamic_conv(dynamic_conv, channels, kv_keep, journal)
    for owner, name in head_tables(block):
        table = getattr(owner, name)
        _replace(owner, name, table.index_select(0, torch.tensor(keep, dtype=torch.long, device=table.device)), journal)
    for holder, role in count_holders(block):
        journal.set(holder, "num_heads", len(keep) if role == "q" else len(kv_keep))


def _kv_conv_problem(block: AttentionBlock) -> str | None:
    """Why a convolution of ``block.family.kv_convs`` is not one whose key/value heads' channels can be sliced out
    exactly: each must be depthwise (``groups`` = input = output channels, weight ``[channels, 1, kernel]``) over the
    key (``n_kv_heads x d_qk``) or value (``n_kv_heads x d_head``) width; None where each is."""
    for conv, role in kv_conv_modules(block):
        width = block.n_kv_heads * (block.d_qk if role == "k" else block.d_head)
        channels = (conv.in_channels, conv.out_channels, conv.groups)
        if channels != (width,) * 3 or tuple(conv.weight.shape[:2]) != (width, 1):
            return (f"its {'key' if role == 'k' else 'value'} convolution {_child_name(block, conv)} (in {conv.in_channels}"
                    f", out {conv.out_channels}, groups {conv.groups}, weight {list(conv.weight.shape)}) is not "
                    f"depthwise over the {width} channels of its {block.n_kv_heads} key/value heads, the one "
                    "convolution whose heads' channels headlab slices")
    return None


def _slice_depthwise(conv: nn.Conv1d, index: torch.Tensor, journal: _Journal) -> None:
    """Keep channels ``index`` of a depthwise ``nn.Conv1d`` (one kernel per channel: weight ``[channels, 1, kernel]``):
    their kernels (and bias entries), ``groups`` the channels left. A layer with no head keeps none (never called)."""
    index = index.to(conv.weight.device)
    _replace(conv, "weight", conv.weight.index_select(0, index), journal)
    if conv.bias is not None:
        _replace(conv, "bias", conv.bias.index_select(0, index), journal)
    for name in ("in_channels", "out_channels", "groups"):
        journal.set(conv, name, len(index))


def head_column_modules(block: AttentionBlock) -> list[nn.Embedding]:
    """The embeddings of ``block.family.head_columns`` this block's core has (UMT5's cross-attention has none)."""
    found = [getattr(block.core, path, None) for path in block.family.head_columns]
    return [module for module in found if isinstance(module, nn.Embedding)]


def kv_dynamic_mask(block: AttentionBlock) -> tuple[nn.Linear, nn.Module, str] | None:
    """The projection and the vector (its owner, its name) of ``block.family.kv_dynamic_mask`` (Doge's ``dt_proj``
    and ``A``: :data:`headlab.adapters.families.KV_DYNAMIC_MASKS`), or None."""
    if not block.family.kv_dynamic_mask:
        return None
    projection, vector = block.family.kv_dynamic_mask
    owner, _, name = vector.rpartition(".")
    return cast(nn.Linear, block.module.get_submodule(projection)), block.module.get_submodule(owner), name


def kv_dynamic_mask_reason(block: AttentionBlock, keep: list[int], kv_keep: list[int]) -> str | None:
    """Why pruning ``block`` to query heads ``keep`` and key/value heads ``kv_keep`` (current numbering, as
    :func:`_kv_plan` gives them) is not exact for a dynamic mask computed from every key/value head's values (Doge),
    or None: a layer that keeps a head must keep every key/value head it had (original numbering: a repeated one
    counts once), since each mask reads all their values."""
    if not block.family.kv_dynamic_mask or not keep:
        return None
    _, kv_kept, _ = _original(block)
    gone = sorted(set(kv_kept) - {kv_kept[j] for j in kv_keep})
    if not gone:
        return None
    projection, vector = block.family.kv_dynamic_mask
    return (f"removing query heads {[h for h in range(block.n_heads) if h not in keep]} removes key/value head"
            f"{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))} (its whole group), and {block.name}."
            f"{projection} computes each key/value head's dynamic mask (scaled by {vector}) from the values of every "
            "key/value head of the layer, so the masks of the heads kept would change; physical pruning of this "
            "family is exact only while a layer keeps at least one query head of each key/value head, or none "
            "(mask the heads instead: headlab.mask_heads)")


def _reads_value_embeddings(model: nn.Module, block: AttentionBlock) -> bool:
    """Whether ``block``'s layer adds the model's value embeddings to its values
    (:data:`~headlab.adapters.families.VALUE_EMBEDDINGS`: NeoMME's first and last full-attention layers)."""
    entry = VALUE_EMBEDDINGS.get(_model_type(model))
    if entry is None:
        return False
    owner = next((m for m in model.modules() if isinstance(getattr(m, entry[0], None), nn.Embedding)
                  and isinstance(getattr(m, entry[1], None), (set, frozenset, list, tuple))), None)
    return owner is not None and getattr(block.core, "layer_idx", block.layer) in getattr(owner, entry[1])


def _narrow_value_embeddings(model: nn.Module, block: AttentionBlock, kv_kept: list[int], journal: _Journal) -> None:
    """A layer that adds the model's value embeddings (of every key/value head) to its values and keeps other
    key/value heads than all of them, each once: handed its kept heads' columns (:class:`ValueEmbedsHook`, which
    pruned_heads.py installs likewise: the plan's ``value_embeds``)."""
    if not _reads_value_embeddings(model, block) or isinstance(block.core, ZeroHeadAttention):
        return
    hooked = getattr(block.core, "_headlab_value_embeds_hooked", None)
    if hooked is None and kv_kept == list(range(block.n_kv_heads)):
        return  # every key/value head, in order: the embedding fits as it is
    journal.set(block.core, VALUE_EMBEDS_ATTR, list(kv_kept))
    if hooked is None:  # the original count: no earlier pruning changed this layer's key/value heads
        journal.hooks.append(block.core.register_forward_pre_hook(ValueEmbedsHook(block.n_kv_heads), with_kwargs=True))
        journal.set(block.core, "_headlab_value_embeds_hooked", block.n_kv_heads)


# -- the plan for one block ----------------------------------------------------------------
def _kv_plan(block: AttentionBlock, keep: list[int]) -> tuple[list[int], int]:
    """Which key/value heads to keep (current numbering, repeats allowed) and the new group size:
    :func:`headlab.heads.kv_heads_kept` on the block's current head counts."""
    return kv_heads_kept(keep, block.n_heads, block.n_kv_heads)


def _original(block: AttentionBlock) -> tuple[list[int], list[int], int]:
    """Kept query heads and key/value heads in the model's original numbering, and the original count."""
    core = block.core
    kept = getattr(core, KEPT_ATTR, None)
    if kept is None:
        return list(range(block.n_heads)), list(range(block.n_kv_heads)), block.n_heads
    return list(kept), list(getattr(core, KV_KEPT_ATTR)), getattr(core, ORIGINAL_ATTR)


def original_heads(block: AttentionBlock) -> tuple[list[int], int]:
    """The original numbering of ``block``'s heads, and the original head count.

    A physically pruned model keeps its heads' original indices, so that its scores and head
    functions line up with those of the unpruned model.
    """
    kept = getattr(block.core, KEPT_ATTR, None)
    if kept is None:
        return list(range(block.n_heads)), block.n_heads
    return list(kept), int(getattr(block.core, ORIGINAL_ATTR, max(kept, default=-1) + 1))


# Attributes of an attention module that transformers' forwards read a head count from, whatever
# the family (StableLM and OPT reshape with ``num_heads``; Gemma, OLMo and Mixtral repeat key/value
# heads ``num_key_value_groups`` times): query heads, key/value heads, query heads per key/value head.
_HEAD_ATTRS = ("num_heads", "num_attention_heads", "n_heads", "n_head")
_KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")
_GROUP_ATTRS = ("num_key_value_groups",)


def _per_head_lists(block: AttentionBlock) -> list[tuple[str, nn.Module, bool]]:
    """Sub-modules of the attention that hold one module per head (StableLM's per-head query/key
    LayerNorms: ``.norms`` with ``num_heads`` entries): ``(path, module, is_key)``."""
    found = []
    for name, module in block.core.named_modules():
        norms = getattr(module, "norms", None)
        if isinstance(norms, nn.ModuleList) and getattr(module, "num_heads", None) == len(norms) and name:
            is_key = name.rsplit(".", 1)[-1].startswith("k")
            if len(norms) == (block.n_kv_heads if is_key else block.n_heads):
                found.append((name, module, is_key))
    return found


def _per_head_tables(block: AttentionBlock) -> list[tuple[nn.Module, bool]]:
    """Norms of ``block`` with one row of parameters per head (Chameleon's ``q_norm``/``k_norm``: a LayerNorm
    over each head's features with a ``[heads, d_head]`` weight and bias): ``(module, is_key)``; their rows are
    sliced with the heads. Tied by name (``q...``, ``k...``) and shape, as :func:`_whole_width_norms` ties its norms."""
    found = []
    for name, module in block.core.named_children():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or is_linear(module) or name[:1] not in ("q", "k"):
            continue
        is_key = name.startswith("k")
        if tuple(weight.shape) == ((block.n_kv_heads if is_key else block.n_heads), block.d_qk):
            found.append((module, is_key))
    return found


def _whole_width_norms(block: AttentionBlock) -> tuple[dict[str, str], list[str]]:
    """The norms of ``block`` over a whole query or key projection (OLMo 2's ``q_norm``/``k_norm``: RMSNorm over all
    heads' features at once), as ``{"q": name, "k": name}``, and the names of the others of such a width that
    cannot be tied to the query or key projection (refused when pruning would change that width).

    Slicing a head's rows out of such a projection changes what the norm divides every other head's features by,
    so pruning keeps the projection and its norm whole and selects the kept heads after the norm
    (:func:`headlab.portable_code.selection_hook`). A norm is tied by its name beside its projection (``q...``,
    ``k...``) and its width, or by the selection an earlier pruning recorded on it; the pruning check
    (:mod:`headlab.prune_check`) verifies the rest: the norm's output must be what the attention reads."""
    projections = {id(m) for m in (block.q, block.k, block.v, block.o, block.qkv) if m is not None}
    found = sub_norm(block)
    if found is not None:  # over the heads' outputs (BitNet's attn_sub_norm), sliced with them: _slice_sub_norm
        projections.add(id(found[0]))
    children = dict(block.core.named_children())
    tied: dict[str, str] = {}
    untied: list[str] = []
    # a norm over a whole query or key width: of query/key heads (their size, d_qk, where values differ)
    widths = {"q": block.n_heads * block.d_qk, "k": block.n_kv_heads * block.d_qk}
    separate = block.q is not None and block.k is not None and not block.family.query_gate
    for name, module in children.items():
        if id(module) in projections or name in block.family.output_norms or name in block.family.input_readers:
            continue
        selected = getattr(module, SELECTED_ATTR, None)
        if selected:  # pruned before: whole, its heads selected
            role = next((r for r, p in (("q", block.q), ("k", block.k)) if children.get(selected["of"]) is p), None)
            if role is None:
                untied.append(name)
            else:
                tied[role] = name
            continue
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or weight.shape[0] == block.d_qk:
            continue
        role = next((r for r in ("q", "k") if separate and name.startswith(r) and weight.shape[0] == widths[r]
                     and r not in tied and any(c is (block.q if r == "q" else block.k) for c in children.values())),
                    None)
        if role is not None:
            tied[role] = name
        elif weight.shape[0] in widths.values():
            untied.append(name)
    return tied, untied


def _whole_width_refusal(block: AttentionBlock, keep: list[int], kv_keep: list[int]) -> str | None:
    """The name of a norm over a whole query or key width that pruning ``block`` would change and that cannot be
    kept whole with its heads selected after it (:func:`_whole_width_norms`), else None."""
    q_changes = 0 < len(keep) < block.n_heads
    kv_changes = bool(keep) and kv_keep != list(range(block.n_kv_heads))
    if not (q_changes or kv_changes):
        return None
    _, untied = _whole_width_norms(block)
    for name in untied:
        norm = getattr(block.core, name)
        width = norm.weight.shape[0]
        if getattr(norm, SELECTED_ATTR, None) or (q_changes and width == block.n_heads * block.d_qk) or \
                (kv_changes and width == block.n_kv_heads * block.d_qk):
            return name
    return None


def _pruned_groups(block: AttentionBlock, n_keep: int) -> int:
    """The groups of a pruned "mp-groups" projection (CodeGen's ``mp_num``): the most of the layer's that divide the
    kept heads evenly, ``gcd(n_keep, groups)`` (its own where they still do), so that its forward's
    ``view(..., -1, 3 * embed_dim // mp_num)`` splits whole heads again; 1 for any other layout."""
    groups = qkv_groups(block.core, block.family)
    return math.gcd(n_keep, groups) if block.family.qkv_layout == "mp-groups" and n_keep else groups


def _select_heads(block: AttentionBlock, name: str, projection: nn.Module, heads: list[int], journal: _Journal) -> None:
    """Keep ``projection`` and the norm ``name`` over its whole width as they are, and narrow the norm's output to
    ``heads`` (current numbering): composed with the selection of an earlier pruning."""
    norm = getattr(block.core, name)
    old = getattr(norm, SELECTED_ATTR, None)
    if old:
        of, current = old["of"], list(old["heads"])
    else:
        of = next(n for n, child in block.core.named_children() if child is projection)
        current = list(range(out_features(projection) // block.d_qk))
    journal.set(norm, SELECTED_ATTR, {"of": of, "heads": [current[h] for h in heads], "size": block.d_qk})
    if not getattr(norm, "_headlab_select_hooked", False):
        journal.hooks.append(norm.register_forward_hook(selection_hook))
        journal.set(norm, "_headlab_select_hooked", True)


def _fused_index(block: AttentionBlock, keep: list[int], kv_keep: list[int]) -> torch.Tensor:
    """Columns of the fused projection to keep, in the order the pruned layer reads them.

    The pruned projection has the family's layout again (:func:`headlab.adapters.qkv_columns`),
    for ``len(keep)`` query and ``len(kv_keep)`` key/value heads: where the new layout puts query
    head i, the old column of query head ``keep[i]`` goes, and likewise for keys and values. Kept
    query heads are grouped by key/value head in ``kv_keep`` order (:func:`_kv_plan`), so the
    layout's pairing of query head i with key/value head i // group is the original pairing."""
    assert block.qkv is not None  # a fused projection
    device = cast(torch.Tensor, block.qkv.weight).device
    d = block.d_head
    old = [c.view(-1, d) for c in block.qkv_columns(device)]
    new = qkv_columns(block.family.qkv_layout, len(keep), len(kv_keep), d, device, _pruned_groups(block, len(keep)))
    index = torch.empty(sum(len(c) for c in new), dtype=torch.long, device=device)
    for old_columns, new_columns, heads in zip(old, new, (keep, kv_keep, kv_keep)):
        index[new_columns] = old_columns[torch.tensor(heads, dtype=torch.long, device=device)].reshape(-1)
    return index


def _slice_per_head_norms(block: AttentionBlock, keep: list[int], kv_keep: list[int], journal: _Journal) -> None:
    """The kept heads' norms: rows of a per-head table (Chameleon), modules of a per-head list (StableLM)."""
    for module, is_key in _per_head_tables(block):
        rows = torch.tensor(kv_keep if is_key else keep, dtype=torch.long, device=cast(torch.Tensor, module.weight).device)
        for name in ("weight", "bias"):
            if isinstance(getattr(module, name, None), torch.Tensor):
                _replace(module, name, getattr(module, name).index_select(0, rows), journal)
    for _path, module, is_key in _per_head_lists(block):
        chosen = kv_keep if is_key else keep
        norms = [cast(nn.ModuleList, module.norms)[h] for h in chosen]
        norms = [n if norms.index(n) == i else copy.deepcopy(n) for i, n in enumerate(norms)]  # repeats: own copy
        journal.set(module, "norms", nn.ModuleList(norms))
        journal.set(module, "num_heads", len(chosen))


def _prune_block(model: nn.Module, block: AttentionBlock, keep: list[int], kv_keep: list[int], groups: int,
                 journal: _Journal) -> None:
    family, core, d = block.family, block.core, block.d_head
    device = block.o.weight.device
    q_index = _head_index(keep, d, device)
    kv_index = _head_index(kv_keep, d, device)
    if block.qkv is not None:  # a fused projection, in the layout of family.qkv_layout
        mp_groups = _pruned_groups(block, len(keep))  # from the core's count, before it is set below
        _slice_outputs(block.qkv, _fused_index(block, keep, kv_keep), journal)
        if hasattr(core, "split_size"):
            journal.set(core, "split_size", len(keep) * d)
        if family.qkv_groups_attr and keep:  # CodeGen's mp_num: the groups the kept heads are laid out in
            journal.set(core, family.qkv_groups_attr, mp_groups)
    elif block.q is not None:
        _slice_separate(block, keep, kv_keep, kv_index, journal)
    else:
        assert family.head_rows  # multi-head latent attention (check_block_sliceable refuses untied projections)
    # each head's rows: latent attention's query and key/value maps, an output gate's projection (Beam's gate_proj)
    for path, attrs in family.head_rows:
        width = rows_per_head(core, attrs)
        assert width is not None  # checked when the block was made (adapters._check_head_rows)
        _slice_outputs(block.module.get_submodule(path), _head_index(keep, width, device), journal)
    if grouped(block.o):  # DeepSeek-V4's o_a_proj: each group's kept heads, as many in each (_check_groups_kept)
        _slice_grouped_inputs(block, keep, journal)
    else:  # the heads' outputs: value-sized; then the columns after them, kept (ConvBERT's convolution heads')
        after = torch.arange(block.n_heads * d, block.n_heads * d + block.columns_after, device=q_index.device)
        _slice_inputs(block.o, torch.cat([q_index, after]), journal)
    _slice_sub_norm(block, q_index, journal)  # a norm over them before o_proj (BitNet's attn_sub_norm)
    # one entry per query head: Mistral Large 4's query scale and bias, attention sinks (GPT-OSS, ...)
    for owner, name in head_vectors(block):
        vector = getattr(owner, name)
        _replace(owner, name, vector.index_select(0, torch.tensor(keep, dtype=torch.long, device=vector.device)),
                 journal)
    for owner, name, _ in head_biases(block):  # d entries per query head: DeBERTa v1's q_bias and v_bias
        vector = getattr(owner, name)
        _replace(owner, name, vector.index_select(0, q_index.to(vector.device)), journal)
    dynamic = kv_dynamic_mask(block)
    if dynamic is not None:  # Doge's dt_proj and A: rows and entries per key/value head, columns per its values
        _slice_kv_dynamic_mask(block, *dynamic, kv_keep, journal)
    _slice_head_parts(block, keep, kv_keep, journal)  # Inkling's and Inkling2's convolutions, norms' scales
    for embedding in head_column_modules(block):  # one column per head (UMT5's relative position bias)
        columns = torch.tensor(keep, dtype=torch.long, device=embedding.weight.device)
        _replace(embedding, "weight", embedding.weight.index_select(1, columns), journal)
        journal.set(embedding, "embedding_dim", len(keep))
    _slice_per_head_norms(block, keep, kv_keep, journal)
    for attr in dict.fromkeys((*family.head_count_attrs, *_HEAD_ATTRS)):
        if isinstance(getattr(core, attr, None), int):
            journal.set(core, attr, len(keep))
    for attr in _KV_HEAD_ATTRS:
        if isinstance(getattr(core, attr, None), int):
            journal.set(core, attr, len(kv_keep))
    for attr in ("all_head_size", "inner_dim", *family.width_attrs):
        if hasattr(core, attr):
            journal.set(core, attr, len(keep) * d)
    for attr in family.kv_head_count_attrs:
        if hasattr(core, attr):
            journal.set(core, attr, len(kv_keep))
    for attr in family.kv_width_attrs:
        if hasattr(core, attr):
            journal.set(core, attr, len(kv_keep) * d)
    if family.config_head_count_attrs and getattr(core, "config", None) is not None:
        base = core.config.base if isinstance(core.config, LayerConfig) else core.config
        journal.set(core, "config", LayerConfig(base, dict.fromkeys(family.config_head_count_attrs, len(keep))))
    _set_groups(block, groups, journal)

    _give_pruned_forward(block, keep, journal)
    kept, kv_kept, original = _original(block)
    journal.set(core, KEPT_ATTR, [kept[h] for h in keep])
    journal.set(core, KV_KEPT_ATTR, [kv_kept[j] for j in kv_keep])
    journal.set(core, ORIGINAL_ATTR, original)
    if keep:  # NeoMME's value embeddings: the kept key/value heads' columns
        _narrow_value_embeddings(model, block, [kv_kept[j] for j in kv_keep], journal)
    elif not family.query_channels:  # ConvBERT's layer keeps its convolution heads: its pruned forward, no head
        _replace_with_zero_heads(model, block, journal)


def _set_groups(block: AttentionBlock, groups: int, journal: _Journal) -> None:
    """The query heads per key/value head a pruned layer repeats its keys and values by (``num_key_value_groups``,
    ``Family.kv_groups_attr``), on its core and on the children that repeat them themselves (NeoMME's
    ``exclusive_self_attention``: ``Family.group_holders``)."""
    for attr in dict.fromkeys((block.family.kv_groups_attr or "", *_GROUP_ATTRS)):
        if attr and hasattr(block.core, attr):
            journal.set(block.core, attr, groups)
    for holder in group_holders(block):
        journal.set(holder, _GROUP_ATTRS[0], groups)


def _slice_grouped_inputs(block: AttentionBlock, keep: list[int], journal: _Journal) -> None:
    """A grouped output projection (``adapters.GROUPED_LINEARS``: weight ``[groups x out, in]``, group g's rows
    reading the heads ``g x heads / groups ..``, ``in`` their outputs side by side) keeps, for each group, its rows'
    columns of that group's kept heads: ``in`` becomes the kept heads per group (the same in each) x the head size."""
    o, d = block.o, block.d_head
    groups = int(getattr(o, "n_groups"))  # noqa: B009 (typed as Tensor | Module for mypy)
    per_group = block.n_heads // groups
    weight = cast(torch.Tensor, o.weight).detach()
    rows = weight.shape[0] // groups
    parts = []
    for g in range(groups):
        local = [h - g * per_group for h in keep if h // per_group == g]
        columns = _head_index(local, d, weight.device)
        parts.append(weight[g * rows:(g + 1) * rows].index_select(1, columns))
    _replace(o, "weight", torch.cat(parts, dim=0), journal)
    journal.set(o, "in_features", len(keep) // groups * d)


def _check_groups_kept(model: nn.Module, block: AttentionBlock, keep: list[int]) -> None:
    """Refuse, before any work, a pruning that leaves the groups of a grouped output projection
    (``adapters.GROUPED_LINEARS``: DeepSeek-V4's ``o_a_proj``) unequal: every group has one width, so each must keep
    as many heads as the others (or all lose every head: a layer with no head), and each group must read whole heads
    (as many groups as heads or fewer, dividing them)."""
    if not grouped(block.o) or not keep:
        return
    groups = int(getattr(block.o, "n_groups"))  # noqa: B009
    if block.n_heads % groups:  # a head's output spans groups: removing it would remove a group's whole input
        raise PruningNotExact(
            f"{_model_type(model)}: {block.kind} layer {block.layer}: its {block.n_heads} heads do not split into the "
            f"{groups} groups of its grouped output projection ({block.name}.{_child_name(block, block.o)}), so a head's "
            "output spans several groups and removing it would take whole groups away, whose count the forward reads "
            "from the config (o_groups); physical pruning has no exact slicing for it: mask the heads instead "
            "(mask_heads)", model_type=_model_type(model), block=block.key)
    per_group = block.n_heads // groups
    counts = [sum(h // per_group == g for h in keep) for g in range(groups)]
    if len(set(counts)) > 1:
        raise PruningNotExact(
            f"{_model_type(model)}: {block.kind} layer {block.layer}: pruning heads "
            f"{sorted(set(range(block.n_heads)) - set(keep))} would leave {counts} heads in the {groups} groups of "
            f"its grouped output projection ({block.name}.{_child_name(block, block.o)}: each group of "
            f"{per_group} heads read by its own block of one width, heads g x {per_group} ..), which has no exact "
            "narrower form with groups of different widths; remove as many heads from every group (or every head "
            "of the layer), or mask the heads instead (mask_heads)", model_type=_model_type(model), block=block.key)


def _child_name(block: AttentionBlock, module: nn.Module) -> str:
    return next((name for name, child in block.module.named_modules() if child is module), "?")


def _slice_sub_norm(block: AttentionBlock, index: torch.Tensor, journal: _Journal) -> None:
    """The norm between the heads and the output projection (``Family.sub_norm``) over the kept heads' entries
    ``index`` only, computing for them what it computed with the removed heads' entries zero
    (:data:`~headlab.adapters.families.SUB_NORMS`): an RMS norm's weight entries kept and times ``sqrt(n / n')``, its
    epsilon times ``n / n'``; an L2 norm as it is. A layer left with no head keeps none of the weight (its stand-in
    never calls the norm), so that its width is that of the layer's heads, whatever was pruned before."""
    found = sub_norm(block)
    if found is None or found[1] != "rms":  # "l2": sum(x^2) and eps are what they were without the zero entries
        return
    norm = found[0]
    weight = cast(torch.Tensor, norm.weight)
    n, kept = int(weight.shape[0]), int(index.numel())
    if kept == n:
        return
    entries = weight.detach().index_select(0, index.to(weight.device))
    if not kept:
        _replace(norm, "weight", entries, journal)
        return
    # mean over n' entries + eps n / n' = (mean over n + eps) n / n': the weight's sqrt(n / n') makes up the factor
    _replace(norm, "weight", entries * math.sqrt(n / kept), journal)
    journal.set(norm, "variance_epsilon", float(cast(Any, norm).variance_epsilon) * n / kept)


def _prune_head_parameters(block: AttentionBlock, keep: list[int], kv_keep: list[int], journal: _Journal) -> None:
    """A layer whose forward applies bare per-head parameters (``Family.head_parameters``: XLNet's q, k, v, o, r and
    seg_embed on dim 1, its three biases on dim 0): the kept heads' slices of each, and the points' widths. The
    forward is shape-driven, so a layer with no head left keeps its own forward, its parameters of zero heads: the
    ``o`` einsum over no head gives 0, the residual and the layer norm run as before (fam31d's test)."""
    core = block.core
    for name, dim in block.family.head_parameters:
        parameter = getattr(core, name)
        index = torch.tensor(keep, dtype=torch.long, device=parameter.device)
        _replace(core, name, parameter.index_select(dim, index), journal)
    for path in (block.family.q, block.family.k, block.family.v, block.family.o):
        point = block.module.get_submodule(path) if path else None
        if point is not None:
            journal.set(point, "in_features", len(keep) * block.d_head)
            journal.set(point, "out_features", len(keep) * block.d_head)
    for attr in block.family.head_count_attrs:
        journal.set(core, attr, len(keep))
    kept, kv_kept, original = _original(block)
    journal.set(core, KEPT_ATTR, [kept[h] for h in keep])
    journal.set(core, KV_KEPT_ATTR, [kv_kept[j] for j in kv_keep])
    journal.set(core, ORIGINAL_ATTR, original)


def _give_pruned_forward(block: AttentionBlock, keep: list[int], journal: _Journal) -> None:
    """A layer whose own forward cannot run with fewer heads (FSMT's and TrOCR's merge them into the hidden states'
    width) takes the family's (``Family.pruned_forward``): the same computation, merging the kept heads; ConvBERT's
    (``Family.query_channels``) with no head left too, its convolution heads still run. One that computes scores for
    every head of the config (``Family.score_heads``: ProphetNet's) is told its kept heads in the config's numbering
    (:data:`~headlab.portable_code.SCORE_HEADS_ATTR`)."""
    if block.family.pruned_forward and (keep or block.family.query_channels):
        journal.set(block.core, "__class__", pruned_class(type(block.core), block.family.pruned_forward))
    if block.family.score_heads and keep:  # ProphetNet's: scores computed for the config's heads, its own kept
        kept, _, _ = _original(block)
        journal.set(block.core, SCORE_HEADS_ATTR, [kept[h] for h in keep])


def _reorder_query(block: AttentionBlock, keep: list[int], journal: _Journal) -> None:
    """A query kept whole (``Family.query_channels``: ConvBERT's, whose every row feeds the convolution heads' kernels):
    its rows reordered, the kept heads' first, then the heads removed, then the rows an earlier pruning put after the
    heads, and the parameters indexed by its channels reordered with them, so the channel-wise products and the maps
    reading them compute the same sums (in another order)."""
    assert block.q is not None
    d = block.d_qk
    removed = [h for h in range(block.n_heads) if h not in keep]
    heads = _head_index(keep + removed, d, block.q.weight.device)
    order = torch.cat([heads, torch.arange(block.n_heads * d, out_features(block.q), device=heads.device)])
    _slice_outputs(block.q, order, journal)
    for path, dim in block.family.query_channels:
        owner_path, _, name = path.rpartition(".")
        owner = block.core.get_submodule(owner_path) if owner_path else block.core
        parameter = getattr(owner, name)
        _replace(owner, name, parameter.index_select(dim, order.to(parameter.device)), journal)


def _slice_separate(block: AttentionBlock, keep: list[int], kv_keep: list[int], kv_index: torch.Tensor,
                    journal: _Journal) -> None:
    """Slice separate query, key and value projections to ``keep`` and ``kv_keep``."""
    assert block.q is not None  # separate projections
    # query and key rows by the query/key head size, value rows by the value head size (MiMo-V2-Flash: 192, 128)
    d_qk, device = block.d_qk, kv_index.device
    # a norm over the whole query or key projection (OLMo 2): both kept whole, the heads selected after it
    norms = _whole_width_norms(block)[0] if keep else {}
    if "q" in norms:
        _select_heads(block, norms["q"], block.q, keep, journal)
    elif block.family.query_channels:  # ConvBERT's: whole, the kept heads' rows first
        _reorder_query(block, keep, journal)
    else:  # [query | gate] per head (Qwen3-Next, Qwen3.5): head h owns rows 2hd .. 2hd + 2d - 1
        _slice_outputs(block.q, _head_index(keep, 2 * d_qk if block.family.query_gate else d_qk, device), journal)
    if block.family.kv_from:  # keys and values from another layer, all kept (_check_sharing_layer_kept): queries only
        return
    assert block.k is not None and block.v is not None
    if "k" not in norms:
        _slice_outputs(block.k, _head_index(kv_keep, d_qk, device), journal)
    elif kv_keep != list(range(block.n_kv_heads)):
        _select_heads(block, norms["k"], block.k, kv_keep, journal)
    if block.v is not block.k:  # values from the key projection (Gemma 4's attention_k_eq_v): its rows sliced once
        _slice_outputs(block.v, kv_index, journal)
    if not keep:  # emptied: its stand-in calls no norm, and the projections are sliced to no row
        for child in block.core.children():
            if getattr(child, SELECTED_ATTR, None):
                journal.set(child, SELECTED_ATTR, None)


def _slice_kv_dynamic_mask(block: AttentionBlock, projection: nn.Linear, owner: nn.Module, name: str,
                           kv_keep: list[int], journal: _Journal) -> None:
    """Keep the rows of ``projection`` and the entries of ``owner.name`` of key/value heads ``kv_keep`` (repeats
    allowed), and give ``projection`` the columns of each original key/value head once, at its first place in
    ``kv_keep``: the sum of its copies' columns (all its copies read the same values, so the sum is what they
    contributed together), zeros at its later places. The input the pruned forward gives it, every kept key/value
    head's values, then yields the rows' original numbers (``DogeAttention.forward``, transformers 5.24)."""
    d = block.d_head  # dt_proj reads the values: value-sized heads
    _, kv_kept, _ = _original(block)
    device = projection.weight.device
    _slice_outputs(projection, torch.tensor(kv_keep, dtype=torch.long, device=device), journal)
    weight = projection.weight.detach()
    columns = weight.new_zeros(weight.shape[0], len(kv_keep) * d)
    placed: set[int] = set()
    for j, current in enumerate(kv_keep):
        if kv_kept[current] in placed:
            continue
        placed.add(kv_kept[current])
        for copy_ in (c for c, original in enumerate(kv_kept) if original == kv_kept[current]):
            columns[:, j * d:(j + 1) * d] += weight[:, copy_ * d:(copy_ + 1) * d]
    _replace(projection, "weight", columns, journal)
    journal.set(projection, "in_features", len(kv_keep) * d)
    vector = getattr(owner, name)
    _replace(owner, name, vector.index_select(0, torch.tensor(kv_keep, dtype=torch.long, device=vector.device)),
             journal)


# -- layers with no head left --------------------------------------------------------------
class ZeroHeadAttention(NoHeadAttention):
    """Stands in for an attention core whose heads were all pruned.

    With no head, MultiHead(Q, K, V) = Concat() W^O + b = b: the block adds the output
    projection's bias (zero if it has none) and the residual path carries the rest (Voita
    et al. 2019, footnote 9). The original's sub-modules are adopted under the same names, so
    ``state_dict`` keys do not change, and the key/value cache is kept in step (with empty
    tensors) so that generation still counts positions correctly. The forward is the one the
    portable module (:mod:`headlab.portable_code`) ships; this class also keeps the original's
    plain attributes (head counts, sizes) and what pruning kept, for headlab's own bookkeeping.
    """

    def __init__(self, original: nn.Module, o_name: str | None, n_outputs: int, d_head: int,
                 residual: tuple[str, int] | None = None, norm: str | None = None, selection: str | None = None):
        super().__init__(original, o_name, n_outputs, d_head, residual, norm, selection)
        # (kind, Family) of the block, set by pruning: adapters list the stand-in by it (adapters._without_heads)
        self.stands_for_block: tuple[str, Any] | None = None
        for name, value in vars(original).items():
            if not name.startswith("_") and name not in vars(self) and isinstance(value, (int, float, bool, str)):
                setattr(self, name, value)
        for name in (KEPT_ATTR, KV_KEPT_ATTR, ORIGINAL_ATTR):
            setattr(self, name, getattr(original, name))
        self.config = getattr(original, "config", None)


def _replace_with_zero_heads(model: nn.Module, block: AttentionBlock, journal: _Journal) -> None:
    parent_path, _, attr = _core_path(block).rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    # its path from the core: a child (o_proj), or deeper (NeoMME's output_projection.o_proj); DeepSeek-V4's o_b_proj
    o_name = block.family.output_after or next((name for name, child in block.core.named_modules()
                                                if child is block.o and name), None)
    n_outputs = (block.family.probs_index + 1 if block.family.probs_index >= 0 else 2) + block.family.extra_outputs
    selection = block.family.selection_argument
    n_outputs += bool(selection)  # (output, probs, selection)
    norm = next(iter(block.family.output_norms), None)  # ALBERT: LayerNorm(input + attention)
    stand_in = ZeroHeadAttention(block.core, o_name, n_outputs, block.d_head, block.family.residual_argument, norm,
                                 selection)
    # what it stands for, as found: a discovered layer (whose projections may have names no scheme knows) is listed
    # by it (adapters._without_heads), with its number, not left out of the blocks (the layers after it renumbered)
    stand_in.stands_for_block = (block.kind, block.family)
    journal.set(parent, attr, stand_in)


# -- ALiBi: one bias per head, built by the model for all its heads --------------------------
def _takes_alibi(block: AttentionBlock) -> bool:
    return block.family.alibi_argument in inspect.signature(type(block.core).forward).parameters


def _install_alibi_hooks(blocks: list[AttentionBlock], journal: _Journal) -> None:
    """Bloom and Falcon (alibi=True) build ALiBi's per-head slopes once for the model, from the
    config's head count, and hand them (Falcon: also folded into the attention mask) to every
    layer, which reads them in head order. A pruned layer gets the rows of the heads it kept
    (Press et al. 2022: a head's bias depends on its original index only)."""
    for block in blocks:
        core = block.core
        if getattr(core, KEPT_ATTR, None) is None or isinstance(core, ZeroHeadAttention) or not _takes_alibi(block):
            continue
        if getattr(core, "_headlab_alibi_hooked", False):  # reads what it kept when called: a second prune is seen
            continue
        journal.hooks.append(core.register_forward_pre_hook(alibi_hook(type(core), block.family.alibi_argument),
                                                            with_kwargs=True))
        journal.set(core, "_headlab_alibi_hooked", True)


# -- T5: one relative position bias shared by the layers of a stack --------------------------
def _install_t5_bias_hooks(model: nn.Module, blocks: list[AttentionBlock], journal: _Journal) -> None:
    """T5 computes its position bias [1, n_heads, q, k] in the first layer of a stack and
    hands it to the others, which breaks once layers keep different heads. In a pruned stack
    each layer instead gets the full bias recomputed from the first layer's table, sliced to
    the heads it kept (cross-attention has no position bias: zeros). LongT5's local encoder
    (``shared_bias == "local"``) hands on its blocked bias with the mask folded in, its transient-global
    encoder (``"transient-global"``) that bias and the side keys' after it: each layer gets the same, sliced."""
    stacks = {"enc_self": "encoder", "dec_self": "decoder", "dec_cross": "decoder"}
    blocks = [b for b in blocks if b.family.shared_bias]
    names = {id(module): name for name, module in model.named_modules()}
    pruned_stacks = {stacks[b.kind] for b in blocks if getattr(b.core, KEPT_ATTR, None) is not None}
    for stack in pruned_stacks:
        members = [b for b in blocks if stacks[b.kind] == stack]
        source = next(b.core for b in members if b.kind != "dec_cross" and b.layer == 0)
        for block in members:
            core = block.core
            if getattr(core, "_headlab_t5_hooked", False) or isinstance(core, ZeroHeadAttention):
                continue
            if getattr(core, KEPT_ATTR, None) is None:
                journal.set(core, KEPT_ATTR, list(range(block.n_heads)))
                journal.set(core, KV_KEPT_ATTR, list(range(block.n_kv_heads)))
                journal.set(core, ORIGINAL_ATTR, block.n_heads)
            hook = {"local": _local_bias_hook, "transient-global": _transient_global_bias_hook}.get(
                block.family.shared_bias, _t5_bias_hook)
            journal.hooks.append(core.register_forward_pre_hook(hook(source), with_kwargs=True))
            journal.set(core, "_headlab_t5_hooked", True)
            # what pruning_plan writes for pruned_heads.py: the table's layer, by path, and the bias's kind
            journal.set(core, T5_SOURCE_ATTR, (names[id(source)], block.family.shared_bias))


# the hooks are pruned_heads.py's (headlab.portable_code), so that plain transformers loads the same computation
_local_bias_hook = local_bias_hook
_transient_global_bias_hook = transient_global_bias_hook
_t5_bias_hook = t5_bias_hook


# -- public API ----------------------------------------------------------------------------
VERIFIED_ATTR = "_headlab_verified_pruning"  # in model.__dict__: the pruning record that was checked


@checked_keywords()
def prune_heads(model: nn.Module, heads: HeadSpec) -> dict[tuple[str, int], list[int]]:
    """Remove ``heads`` (``{(kind, layer): [head, ...]}``, current numbering) in place.

    Validates everything before changing anything, and checks the result (:mod:`headlab.prune_check`):
    the pruned model must compute what the model with the same heads masked computes, on a
    padded probe batch and a few steps of cached generation. If it does not, the model is put back
    as it was and :class:`~headlab.errors.PruningNotExact` names the family, the block and the
    difference. Returns the heads each pruned block now keeps, in the model's original numbering.
    """
    blocks = attention_blocks(model)
    check_pruned_numbering(model, blocks, to_prune=True)  # a pruned directory loaded without headlab: renumbered
    spec = validate_heads(blocks, heads)
    check_shared_plan(blocks, spec)
    plans = []
    planned: set[int] = set()
    for key, removed in spec.items():
        block = find_block(blocks, *key)
        if id(block.core) in planned:  # a shared module (ALBERT) at another depth: sliced once, for every depth
            continue
        planned.add(id(block.core))
        keep = [h for h in range(block.n_heads) if h not in set(removed)]
        if not keep and getattr(block.core, "store_full_length_kv", None) is True and \
                not hasattr(block.core, "kv_lora_rank"):
            # the stand-in stores Mistral Large 4's latents only: Gemma 4's would crash it (AttributeError) or leave
            # the layers that reuse this one's keys and values without them
            raise HeadlabError(
                f"{block.kind}:{block.layer} ({block.name}, {type(block.core).__name__}): removing every head of a "
                "layer that stores its keys and values for later layers (store_full_length_kv, Gemma 4's key/value "
                "sharing) is not supported: a layer with no head left would store none; keep at least one head")
        _check_shared_kv_kept(blocks, block, keep)
        plans.append((block, keep, *_kv_plan(block, keep)))
    try:
        blocks = _prune_checked(model, plans, spec)
    finally:  # smaller weights and hooks of its own, which compiled code would not see (headlab.compiled)
        discard_compiled_code("pruned heads (prune_heads)")
    return {b.key: list(getattr(b.core, KEPT_ATTR)) for b in blocks if getattr(b.core, KEPT_ATTR, None) is not None}


# -- attention weights shared by several depths (ALBERT, Zamba) -------------------------------
def _sharing_what(group: list[AttentionBlock]) -> str:
    if all(b.core is group[0].core for b in group):
        return f"ALBERT's shared layers: one module, {group[0].name}, runs at each"
    return (f"tied parameters, Zamba's shared transformer: the attention modules {', '.join(b.name for b in group)} "
            "hold the same weights")


def check_shared_plan(blocks: list[AttentionBlock], spec: Mapping[tuple[str, int], Any]) -> None:
    """Refuse, before any work, a removal ``spec`` that differs between depths computed by one set of attention
    weights (:func:`sharing_groups`). Slicing a head out of the weights removes it at every depth that uses them, so
    pruning equals masking exactly when the plan removes the same heads at each of those depths (then it is that
    masking); any other plan cannot be pruned physically."""
    for group in sharing_groups(blocks):
        removed = {b.layer: sorted(int(h) for h in spec.get(b.key, ())) for b in group}
        if len({tuple(heads) for heads in removed.values()}) < 2:
            continue
        kind = group[0].kind
        by_heads: dict[tuple[int, ...], list[int]] = {}
        for layer, heads in removed.items():
            by_heads.setdefault(tuple(heads), []).append(layer)
        said = "; ".join(f"{counted(len(heads), 'head').split()[1] + ' ' + ','.join(map(str, heads)) if heads else 'no head'} at "
                         f"{'layer' if len(layers) == 1 else 'layers'} {','.join(map(str, layers))}"
                         for heads, layers in by_heads.items())
        raise HeadlabError(
            f"{kind} layers {','.join(str(b.layer) for b in group)}: their attention weights are shared by "
            f"{len(group)} depths ({_sharing_what(group)}), so removing a head removes it at every one of them, but "
            f"this plan removes {said}. Remove the same heads at each of these depths (pruned then equals those heads "
            f"masked at every depth), or mask the heads instead (mask_heads); nothing was pruned")


def _retie(model: nn.Module, groups: list[list[AttentionBlock]], journal: _Journal) -> None:
    """Tie again the weights pruning sliced apart: layers whose own attention modules held the same tensors (Zamba),
    each sliced alike by an agreeing plan, hold their first layer's sliced tensors again (as transformers ties them
    on loading), so that training or saving the pruned model keeps one set of weights."""
    for group in groups:
        if all(b.core is group[0].core for b in group):
            continue  # one module (ALBERT): sliced once
        first = model.get_submodule(group[0].name)
        for block in group[1:]:
            module = model.get_submodule(block.name)
            for name, parameter in first.named_parameters():
                parent, _, leaf = name.rpartition(".")
                owner = module.get_submodule(parent)
                if owner._parameters.get(leaf) is not parameter:
                    journal.set(owner, leaf, parameter)


def _check_shared_kv_kept(blocks: list[AttentionBlock], block: AttentionBlock, keep: list[int]) -> None:
    """Refuse, before any work, a pruning of ``block`` that changes the keys and values a later layer attends with
    (Gemma 4's key/value sharing: ``family.kv_from`` names this block's key projection). The readers' query heads
    map onto all of this layer's key/value heads, in order: every one must stay, once each (no per-head copies)."""
    readers = [b for b in blocks if b.family.kv_from.startswith(block.name + ".") and b is not block]
    if not readers or not keep:  # no head left: refused by the caller, naming store_full_length_kv
        return
    kv_keep, _ = _kv_plan(block, keep)
    if kv_keep != list(range(block.n_kv_heads)):
        names = ", ".join(f"{b.kind}:{b.layer}" for b in readers)
        raise HeadlabError(
            f"{block.kind}:{block.layer} ({block.name}): pruning heads {sorted(set(range(block.n_heads)) - set(keep))} "
            f"would change the {block.n_kv_heads} key/value heads this layer computes to {kv_keep} (pruning's "
            f"grouping rule, headlab.heads.kv_heads_kept), but layer(s) {names} attend with them too (key/value "
            "sharing, Gemma 4's and Gemma 3n's num_kv_shared_layers): each key/value head must keep the same number of query "
            "heads here (at least one); nothing was changed")


def _check_sharing_layer_kept(block: AttentionBlock, keep: list[int], kv_keep: list[int]) -> None:
    """Refuse, before any work, a pruning of a layer that attends with another layer's keys and values
    (``family.kv_from``: Gemma 4's and Gemma 3n's key/value sharing) that its query projection alone cannot make:
    query head h reads shared key/value head h // groups (transformers' repeat_kv with num_key_value_groups), so
    slicing the query rows and setting the groups is exact only while every shared key/value head keeps the same
    number of query heads, at least one (:func:`headlab.heads.kv_heads_kept` keeps them all, once each); there is
    no key or value projection here whose rows could be copied or dropped."""
    if not block.family.kv_from or len(keep) == block.n_heads or (keep and kv_keep == list(range(block.n_kv_heads))):
        return
    group = block.n_heads // block.n_kv_heads
    counts = [sum(h // group == j for h in keep) for j in range(block.n_kv_heads)]
    raise HeadlabError(
        f"{block.kind}:{block.layer} ({block.name}): pruning heads {sorted(set(range(block.n_heads)) - set(keep))} "
        f"would leave {counts} query heads over its {block.n_kv_heads} key/value heads, but this layer has no key or "
        f"value projection of its own, it attends with the keys and values of {block.family.kv_from} (key/value "
        "sharing, Gemma 4's and Gemma 3n's num_kv_shared_layers), whose query head h reads key/value head h // "
        f"groups ({group} query heads per key/value head now): each of its key/value heads must keep the same "
        "number of query heads, at least one; nothing was changed (or mask the heads instead: mask_heads)")


def removal_by_scores(model: nn.Module, scores: Any, keep: int,
                      kinds: tuple[str, ...] | None = None) -> dict[tuple[str, int], list[int]]:
    """The heads to remove so that the ``keep`` best-scored heads of ``model`` remain
    (:meth:`HeadScores.top_mask`), in the model's current numbering.

    Scores number a pruned model's heads as before pruning (headlab's score tables of a pruned
    model do, NaN for the heads it lost): the heads already removed are not ranked, and the others
    are renumbered (a layer that kept heads 0 and 3 calls head 3 its head 1). A kind whose scores
    are as wide as the model's current heads is taken as numbered so already."""
    ranked = tuple(kinds) if kinds is not None else tuple(scores.scores)
    shared = [group for group in sharing_groups(attention_blocks(model)) if group[0].kind in ranked]
    if shared:
        # each depth has a score of its own, and a ranking of depths' heads would cut a shared head at some of
        # its depths only, which no pruning makes (check_shared_plan); a budget in depths' heads over heads that
        # each cost several depths is not a ranking either
        group = shared[0]
        raise HeadlabError(
            f"{group[0].kind} layers {','.join(str(b.layer) for b in group)}: their attention weights are shared by "
            f"{len(group)} depths, and a plan ranked by scores per depth would remove a head at some of them only; "
            "nothing was pruned. Name the heads to remove, the same at each of these depths (--heads), or learn "
            "them with gated pruning (headlab prune train: one gate per shared head)")
    absent: dict[tuple[str, int], list[int]] = {}
    unscored: list[str] = []
    for block in attention_blocks(model):
        heads, _, n = _original(block)
        if len(heads) != n and block.kind in scores.scores and scores.scores[block.kind].shape[1] == n:
            absent[block.key] = [h for h in range(n) if h not in heads]
        else:
            heads = list(range(block.n_heads))
        if block.kind in (kinds or scores.kinds):
            # top_mask ranks only the scored heads: one without a score (a table of another model's
            # shape, a NaN) would stay beside the `keep` best, and the model keep more heads than asked
            table = scores.scores.get(block.kind)
            missing = [h for h in heads if table is None or block.layer >= table.shape[0] or h >= table.shape[1]
                       or math.isnan(table[block.layer, h])]
            if missing:
                unscored.append(f"{block.kind} layer {block.layer} {'head' if len(missing) == 1 else 'heads'} "
                                f"{','.join(map(str, missing))}")
    if unscored:
        shapes = ", ".join(f"{kind} {'x'.join(map(str, a.shape))}" for kind, a in scores.scores.items())
        raise HeadlabError(f"{scores.method} scores ({shapes}, layers x heads) have no score for "
                           f"{'; '.join(unscored[:4])}{'; ...' if len(unscored) > 4 else ''}: those heads would stay "
                           f"beside the {keep} kept. Score this model's heads (headlab importance on it)")
    mask = scores.without(absent).top_mask(keep, kinds)
    # The layers numbered as before pruning: none of their removed heads is ranked, so none is named.
    return {**mask, **to_current_numbering(model, {key: mask[key] for key in absent if key in mask})}


def in_original_numbering(model: nn.Module) -> list[AttentionBlock]:
    """``model``'s blocks with their original head counts: a head spec read against them names a
    pruned model's heads as its ``heads.csv``, score tables and ``headlab_pruning.json`` do."""
    return [dataclasses.replace(block, n_heads=_original(block)[2]) for block in attention_blocks(model)]


def to_current_numbering(model: nn.Module, spec: Mapping[tuple[str, int], list[int]],
                         gone_ok: frozenset[tuple[str, int]] = frozenset()) -> dict[tuple[str, int], list[int]]:
    """A removal ``spec`` in original numbering (:func:`in_original_numbering`) as the model's current
    head indices. A head already removed is an error (the spec was likely written in the current
    numbering), except in the layers of ``gone_ok`` (``*``, a mask file), where it is skipped."""
    out: dict[tuple[str, int], list[int]] = {}
    for block in attention_blocks(model):
        if block.key not in spec:
            continue
        kept = _original(block)[0]
        gone = sorted(h for h in spec[block.key] if h not in kept)
        if gone and block.key not in gone_ok:
            raise HeadlabError(
                f"--heads {block.kind}:{block.layer}: {'head' if len(gone) == 1 else 'heads'} "
                f"{','.join(map(str, gone))} already removed; "
                + (f"this model keeps heads {','.join(map(str, kept))} of that layer" if kept else
                   "that layer has no heads left")
                + ". Heads are named in the original model's numbering, as in heads.csv and headlab_pruning.json")
        out[block.key] = [kept.index(h) for h in spec[block.key] if h in kept]
    return out


def _mark_verified(model: nn.Module) -> None:
    """The pruning of ``model`` was checked: its record (which save_pruned requires), and the heads each
    pruned layer kept, which an adapter loaded onto it must have been trained on (portable_code's
    check_adapter_record; its load_state_dict hooks refuse peft's unchecked loading)."""
    model.__dict__[VERIFIED_ATTR] = pruning_record(model)["blocks"]
    record_kept_blocks(model, {"kept": kept_blocks(model), "projections": {}})
    _route_load_adapter(model)


def _route_load_adapter(model: nn.Module) -> None:
    """Make ``model.load_adapter`` (transformers' PEFT loading) the checked one, :func:`_checked_load_adapter`.
    transformers' own reads the adapter's weights with its loading code, not ``load_state_dict``: the hooks of
    record_kept_blocks never see it, and it reads no record of kept heads, so an adapter of another pruning with
    the same head counts loaded silently, and under ``ignore_mismatched_sizes=True`` weights of another shape were
    initialised anew. Only where the class's method is transformers' own: pruned_heads.py's PrunedModel checks
    itself, Wav2Vec2's ``load_adapter`` loads another kind of adapter, a PeftModel's is guarded by the hooks. An
    instance attribute (not a class of headlab's: the class name and pickling stay transformers'); a partial of
    the model, so that deepcopy and pickle bind the copy's to the copy."""
    from transformers.integrations.peft import PeftAdapterMixin

    if getattr(type(model), "load_adapter", None) is PeftAdapterMixin.load_adapter:
        model.__dict__["load_adapter"] = functools.partial(_checked_load_adapter, model)


def _checked_load_adapter(model: nn.Module, peft_model_id: Any = None, adapter_name: str | None = None,
                          *args: Any, **kwargs: Any) -> Any:
    """The class's ``load_adapter`` (transformers') of ``model`` with portable_code's checks
    (:func:`load_checked_adapter`): refused, the adapter taken off again, when it adapts a pruned attention layer
    and its headlab_adapter.json is missing or names other kept heads, or when a weight of it was left at its
    initialisation or unread. Returns what transformers' returns (the loading info)."""
    load = functools.partial(cast(Any, type(model)).load_adapter, model)  # the class's, past the instance's route
    try:
        if type(model).__name__ == "PrunedModel" and hasattr(type(model), "save_adapter"):  # pruned_heads.py's: checks itself
            return load(peft_model_id, adapter_name, *args, **kwargs)
        return load_checked_adapter(model, load, peft_model_id, adapter_name, *args, **kwargs)
    except RuntimeError as error:
        raise HeadlabError(str(error).removeprefix("pruned_heads.py: ")) from error


def kept_blocks(model: nn.Module) -> dict:
    """Attention path -> [kept heads, kept key/value heads, original count], in original numbering, of every
    pruned layer: the plan's ``kept``, and what an adapter saved from ``model`` records."""
    return {block.name: [list(getattr(block.core, KEPT_ATTR)), list(getattr(block.core, KV_KEPT_ATTR)),
                         int(getattr(block.core, ORIGINAL_ATTR))]
            for block in attention_blocks(model) if getattr(block.core, KEPT_ATTR, None) is not None}


@checked_keywords()
def save_adapter(model: nn.Module, path: str | os.PathLike) -> Path:
    """Save the PEFT adapter of a pruned model (a ``PeftModel`` around it, or the model with adapters loaded by
    transformers' ``load_adapter``) with its ``save_pretrained``, and ``headlab_adapter.json`` beside it: the heads
    the pruning kept, which :func:`load_adapter` (and a pruned directory's ``load_adapter`` without headlab)
    compares with the model's before the adapter is used. Another pruning with the same head counts per layer fits
    every shape, its adapter rows belonging to other heads."""
    try:
        _save_adapter(model, str(path))
    except ValueError as error:
        raise HeadlabError(str(error)) from error
    return Path(path)


def _check_adapter_base(model: nn.Module, path: str | os.PathLike) -> None:
    """Warn when an adapter names as its base a local model directory whose weights differ from those ``model`` was
    loaded from: its low-rank updates were learnt against the other weights, and peft and transformers load it without
    a word when the shapes agree. A warning, not a refusal: the files are compared, and a copy re-saved with the same
    tensors differs in them. Compared only when both are local directories (a hub id or a moved directory: not)."""
    import warnings

    from headlab.resume import weights_fingerprint

    try:
        base = json.loads((Path(path) / "adapter_config.json").read_text(encoding="utf-8")).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        return  # not a local adapter directory: peft's own load says what is wrong
    origin = getattr(getattr(model, "config", None), "_name_or_path", "")
    if not (isinstance(base, str) and base and isinstance(origin, str) and origin):
        return
    ours, theirs = weights_fingerprint(origin), weights_fingerprint(base)
    if ours is not None and theirs is not None and ours != theirs:
        warnings.warn(
            f"{path}: an adapter of {base} (adapter_config.json's base_model_name_or_path), whose weight files differ "
            f"from those of {origin}, which the model was loaded from: its updates were trained against the other "
            "weights unless the two hold the same tensors", UserWarning, stacklevel=3)


@checked_keywords()
def load_adapter(model: nn.Module, path: str | os.PathLike, *, adapter_name: str | None = None,
                 is_trainable: bool = False, peft_model: bool = False) -> nn.Module:
    """Load the PEFT adapter at ``path`` onto ``model`` (transformers' ``model.load_adapter``; with ``peft_model``,
    peft's ``PeftModel.from_pretrained``, which is returned), refused and taken off again when it adapts a pruned
    attention layer and its ``headlab_adapter.json`` is missing or names other kept heads, or when a weight of it
    was left at its initialisation (another shape, missing) or unread; a ``UserWarning`` when its
    ``adapter_config.json`` names as its base a local model directory whose weight files differ from those ``model``
    was loaded from. Returns ``model`` or the PeftModel."""
    _check_adapter_base(model, path)
    if peft_model:
        try:
            return peft_from_pretrained(model, str(path), adapter_name=adapter_name or "default",
                                        is_trainable=is_trainable)
        except RuntimeError as error:
            raise HeadlabError(str(error).removeprefix("pruned_heads.py: ")) from error
    _checked_load_adapter(model, str(path), adapter_name, is_trainable=is_trainable)
    return model


@checked_keywords()
def pruning_record(model: nn.Module) -> dict:
    """What was pruned, in original numbering: the content of ``headlab_pruning.json``."""
    blocks: dict = {}
    for block in attention_blocks(model):
        kept = getattr(block.core, KEPT_ATTR, None)
        if kept is None:
            continue
        blocks.setdefault(block.kind, {})[str(block.layer)] = {
            "n_heads": getattr(block.core, ORIGINAL_ATTR),
            "kept_heads": list(kept),
            "kept_kv_heads": list(getattr(block.core, KV_KEPT_ATTR)),
        }
    numbering = model.__dict__.get(NUMBERING_ATTR)
    return {"format": FORMAT_VERSION, "blocks": blocks, **({"numbering": numbering} if numbering else {})}


def declared_numbering(model: nn.Module) -> dict:
    """What a table or report computed on ``model`` declares of its head numbers, to add to its
    signature: ``{"numbering": {"reconstructed": ["dec_self:0", ...]}}`` where the kept heads of
    those blocks were numbered by reconstruction (a re-saved directory without its record,
    :func:`headlab.checkpoint.record_from_weights`); ``{}`` where every head has its own number."""
    numbering = model.__dict__.get(NUMBERING_ATTR) or {}
    blocks = numbering.get("reconstructed")
    return {"numbering": {"reconstructed": list(blocks)}} if blocks else {}


def apply_pruning_record(model: nn.Module, record: Mapping, source: str = PRUNING_FILE) -> None:
    """Prune a freshly built (unpruned) model exactly as ``record`` says."""
    if record.get("format") != FORMAT_VERSION:
        raise HeadlabError(f"{source}: unsupported format {record.get('format')!r} (expected {FORMAT_VERSION})")
    blocks = attention_blocks(model)
    plans = []
    planned: set[int] = set()
    try:
        for kind, layers in record["blocks"].items():
            for layer, entry in layers.items():
                block = find_block(blocks, kind, int(layer))
                keep, kv_keep = [int(h) for h in entry["kept_heads"]], [int(h) for h in entry["kept_kv_heads"]]
                if entry["n_heads"] != block.n_heads or any(not 0 <= h < block.n_heads for h in keep) \
                        or any(not 0 <= h < block.n_kv_heads for h in kv_keep):
                    raise HeadlabError(
                        f"{source}: {kind} layer {layer} does not fit the model "
                        f"({counted(block.n_heads, 'head')}, {counted(block.n_kv_heads, 'key/value head')})"
                    )
                groups = len(keep) // len(kv_keep) if kv_keep and len(keep) % len(kv_keep) == 0 else 1
                plans.append((block, keep, kv_keep, groups))
    except (KeyError, TypeError, ValueError) as error:
        raise HeadlabError(f"{source}: malformed pruning record ({error!r})") from error
    # every depth of weights shared by several is recorded (masked alike in the check), the same heads at each
    spec = {block.key: [h for h in range(block.n_heads) if h not in set(keep)] for block, keep, _, _ in plans}
    try:
        check_shared_plan(blocks, spec)
    except HeadlabError as error:
        raise HeadlabError(f"{source}: {error}") from None
    once = []
    for plan in plans:  # a shared module (ALBERT), recorded at each depth: sliced once
        if id(plan[0].core) not in planned:
            planned.add(id(plan[0].core))
            once.append(plan)
    _prune_checked(model, once, spec)


def _model_type(model: nn.Module) -> str:
    return str(getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__)


def _refuse_inexact(model: nn.Module, plans: list[tuple]) -> None:
    """Refuse, before any work, what no slicing can make exact."""
    if model.__dict__.get(GATE_STACK) is not None:  # their hooks assume the unpruned head counts
        raise HeadlabError("the model has gates attached (headlab.attach_gates); detach them before pruning")
    for block, *_ in plans:  # fused layouts and projections the slicing here does not know
        check_block_sliceable(block)
    for block, keep, kv_keep, _ in plans:
        _check_sharing_layer_kept(block, keep, kv_keep)
        _check_groups_kept(model, block, keep)
    _refuse_tied(model, [block for block, *_ in plans])
    for block, keep, kv_keep, _ in plans:
        dynamic = kv_dynamic_mask_reason(block, keep, kv_keep)
        if dynamic is not None:
            raise PruningNotExact(f"{_model_type(model)}: {block.kind} layer {block.layer}: {dynamic}",
                                  model_type=_model_type(model), block=block.key)
        norm = _whole_width_refusal(block, keep, kv_keep)
        if norm is not None:
            raise PruningNotExact(
                f"{_model_type(model)}: {block.kind} layer {block.layer}: {block.name}.{norm} normalises a whole "
                "projection's width (every head at once), so removing a head changes how the others are normalised, "
                "and headlab cannot tie it to the query or key projection (a separate q or k projection beside it, "
                "its name starting with q or k) to keep that projection whole and select the kept heads after the "
                "norm; physical pruning cannot be exact for this layer unless it keeps all its heads or none (mask "
                "the heads instead: headlab.mask_heads)",
                model_type=_model_type(model), block=block.key,
            )


def _refuse_tied(model: nn.Module, blocks: list[AttentionBlock]) -> None:
    """Refuse a block whose weights are tied to a module other than the attention of another depth
    (:func:`sharing_groups`: Zamba's shared transformer, pruned alike at every depth and tied again).
    Slicing would untie them in memory, and transformers re-ties them on loading, giving the other
    module the pruned layer's weights."""
    owners: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(parameter), []).append(name)
    # the other depths of weights shared by several (Zamba's tied layers): pruned alike, by an agreeing plan
    # (check_shared_plan), and tied again after slicing (_retie)
    alike = {b.name: tuple(m.name + "." for m in group) for group in sharing_groups(attention_blocks(model))
             for b in group}
    for block in blocks:
        for name, parameter in block.module.named_parameters(prefix=block.name, remove_duplicate=False):
            elsewhere = [n for n in owners.get(id(parameter), ())
                         if not n.startswith(alike.get(block.name, (block.name + ".",)))]
            if elsewhere:
                raise HeadlabError(
                    f"{block.name} ({block.family.name}): physical pruning is refused: its weight {name} is tied to "
                    f"{elsewhere[0]}{f' and {len(elsewhere) - 1} more' if len(elsewhere) > 1 else ''}, so slicing a "
                    "head out of it would remove it at every depth that holds it; mask the heads instead (mask_heads, "
                    "or headlab prune train's gates)")


def check_prunable(model: nn.Module, kinds: tuple[str, ...] | None = None) -> None:
    """Refuse, before a long run whose end prunes (``headlab prune train``, sweeps), a model that
    headlab cannot prune exactly: prune a sample of heads with the check of :func:`prune_heads`
    and undo it, whatever the outcome. The sample removes every head of each kind's first layer
    (a layer with no head left) and head 0 of the others (one query head of a key/value group)."""
    check_gates_free(attention_blocks(model), kinds)
    blocks = [b for b in attention_blocks(model) if (kinds is None or b.kind in kinds) and b.n_heads]
    first: dict = {}
    for block in blocks:
        first.setdefault(block.kind, block.layer)
    spec = {}
    for block in blocks:
        whole = block.layer == first[block.kind] and sum(b.kind == block.kind for b in blocks) > 1
        spec[block.key] = list(range(block.n_heads)) if whole else [0]
    for group in sharing_groups(attention_blocks(model)):  # weights shared by several depths: one plan for all
        for block in group[1:]:
            if block.key in spec and group[0].key in spec:
                spec[block.key] = spec[group[0].key]
    plans = []
    planned: set[int] = set()
    for block in blocks:
        if id(block.core) in planned:  # a shared module (ALBERT): sliced once
            continue
        planned.add(id(block.core))
        keep = [h for h in range(block.n_heads) if h not in spec[block.key]]
        plans.append((block, keep, *_kv_plan(block, keep)))
    _prune_checked(model, plans, spec, commit=False)


def check_gates_free(blocks: list[AttentionBlock], kinds: tuple[str, ...] | None = None) -> None:
    """Refuse, before any work, gates (``headlab prune train``, ``analyze --prune``) over a layer whose heads meet a
    grouped output projection (DeepSeek-V4's, :func:`_check_groups_kept`) or that attends with
    another layer's keys and values or computes them for one (``family.kv_from``: Gemma 4's and Gemma 3n's key/value
    sharing): the gates pick each layer's heads freely, but those layers prune exactly only while every shared
    key/value head keeps the same number of query heads (:func:`_check_sharing_layer_kept`, :func:`_check_shared_kv_kept`),
    so the export after training would be refused for most picks."""
    uneven = [b for b in blocks if (kinds is None or b.kind in kinds) and b.n_heads and grouped(b.o)]
    if uneven:
        names = ", ".join(f"{b.kind}:{b.layer}" for b in uneven)
        raise HeadlabError(
            f"{names}: their heads meet a grouped output projection (DeepSeek-V4's o_a_proj: groups of one width), "
            "and prune exactly only while every group keeps as many heads as the others (or the layer none); the "
            "gates of headlab prune train pick heads freely, so the pruned model could not be exported. Prune these "
            "layers with headlab prune --heads (a plan that keeps the groups even), or mask their heads")
    sources = {b.family.kv_from.rsplit(".", 1)[0] for b in blocks if b.family.kv_from}
    tied = [b for b in blocks if (kinds is None or b.kind in kinds) and b.n_heads and (b.family.kv_from or b.name in sources)]
    if tied:
        names = ", ".join(f"{b.kind}:{b.layer}" for b in tied)
        raise HeadlabError(
            f"{names}: attend with keys and values another layer computes, or compute them for one (key/value "
            "sharing, Gemma 4's and Gemma 3n's num_kv_shared_layers), and prune exactly only while each shared "
            "key/value head keeps the same number of query heads (at least one); the gates of headlab prune train pick "
            "heads freely, so the pruned model could not be exported. Prune these layers with headlab prune --heads "
            "(a plan that keeps the groups even), or gate other kinds only (--gates; analyze's --prune-gates)")


def check_checkable(blocks: list[AttentionBlock], spec: Mapping[tuple[str, int], Any], model_type: str = "the model") -> None:
    """Refuse, before any work, removing heads of blocks that token ids do not run
    (:attr:`AttentionBlock.idle`: a multimodal wrapper's vision or audio tower): the check of every prune
    (:mod:`headlab.prune_check`) runs the model on token ids, so it would compare nothing there."""
    where = idle_blocks(blocks, {key for key, heads in spec.items() if len(heads)})
    if where is not None:
        _refuse_unchecked(model_type, where, blocks)


def _refuse_unchecked(model_type: str, where: str, blocks: list[AttentionBlock]) -> None:
    running: dict[str, list[int]] = {}
    for block in blocks:
        if not block.idle and block.n_heads:
            running.setdefault(block.kind, []).append(block.layer)
    runs = "; ".join(f"{kind} layers {min(ls)}-{max(ls)}" if len(ls) > 1 else f"{kind} layer {ls[0]}"
                     for kind, ls in running.items()) or "none"
    raise HeadlabError(
        f"{model_type}: cannot check pruning the heads of {where}: headlab checks every prune against masking on "
        "token ids (padded rows, cached generation), and token ids never run these blocks (a vision or audio tower, "
        "or a cross-attention given no encoder states), so nothing would show that the pruned blocks compute what "
        f"the masked ones do; nothing was pruned. Remove heads of the blocks text runs only ({runs}), or mask these "
        "heads instead (mask_heads) and compare on inputs that run them")


def _prune_checked(model: nn.Module, plans: list[tuple], spec: dict, commit: bool = True) -> list[AttentionBlock]:
    """Prune each ``(block, keep, kv_keep, groups)`` and check the result against the model with
    ``spec`` masked (:mod:`headlab.prune_check`); undo everything if it differs (and, with
    ``commit=False``, also if it does not). The model's attention blocks afterwards."""
    from headlab.gates import masked_heads
    from headlab.prune_check import _name, first_mismatch, first_probe, not_finite, own_nan_cause, run_floored, run_probe

    # first: an idle block's projections may be unknown (GPT-2's cross-attention), and that is not why it is refused
    check_checkable(attention_blocks(model), spec, _model_type(model))
    check_shared_plan(attention_blocks(model), spec)  # _retie below gives every depth the first one's slices
    _refuse_inexact(model, plans)
    journal = _Journal()
    if not plans:
        blocks = attention_blocks(model)
        _mark_verified(model)
        return blocks
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    if dtype == torch.float64 and any(b.n_heads and _model_type(b.core) in SINKS_SCALE_OUTPUT for b, *_ in plans):
        # its eager takes the sink scale in float32 whatever the dtype (transformers 5.24 granite_swa, "Force sink
        # scaling to fp32"): pruned and masked may round it apart by float32's, not float64's, precision
        dtype = torch.float32
    if dtype == torch.float64 and any(b.n_heads and (found := sub_norm(b)) is not None and found[1] == "rms"
                                      for b, *_ in plans):
        # BitNetRMSNorm normalises in float32 whatever the dtype (transformers 5.24): its rescaled weight and epsilon
        # (_slice_sub_norm) round apart from the unpruned norm's by float32's precision
        dtype = torch.float32
    if dtype == torch.float64 and any(b.n_heads and (b.family.kv_convs or b.family.kv_dynamic_convs) for b, *_ in plans):
        # Inkling's and Inkling2's key/value short convolutions compute in float32 whatever the dtype (hidden_states
        # .float(), transformers 5.24): a convolution over fewer channels rounds apart by float32's precision
        dtype = torch.float32
    with masked_heads(model, spec):
        probe, reference = first_probe(model)  # the padded probe, or generate()'s positions, or one unpadded row
    if reference.error is not None:
        raise HeadlabError(
            f"{_model_type(model)}: cannot check pruning, the model itself fails on headlab's probe batch "
            f"(short rows, with and without padding): {type(reference.error).__name__}: "
            f"{str(reference.error).splitlines()[0][:300]}"
        ) from reference.error
    # What the probe did not run, whatever the adapter knew of it (a table family's unused cross-attention):
    # the comparison below would pass it unseen.
    unrun = [dataclasses.replace(block, idle=True) for block, *_ in plans if block.key not in reference.ran]
    if unrun:
        _refuse_unchecked(_model_type(model), str(idle_blocks(unrun)), attention_blocks(model))
    floored_reference = None
    own_nan = None  # where the unmodified model itself is not finite on the probe, and why: read before pruning
    if not_finite(reference) is not None:
        # NaN or inf in the reference compares nothing there (a float64 eager model's padded rows): with the mask
        # floored at float32's lowest both models are finite there, and every value can be compared
        with masked_heads(model, spec):
            floored_reference = run_floored(model, probe)
        if floored_reference.error is not None or not_finite(floored_reference) is not None:
            floored_reference = None
        else:
            own = not_finite(run_probe(model, probe))
            own_nan = (own, own_nan_cause(model, probe)) if own is not None else None
    accepted = None  # the reference's own NaN, which the pruned model does not read: exact, said once
    sharing = sharing_groups(attention_blocks(model))
    try:
        for block, keep, kv_keep, groups in plans:
            if block.family.head_parameters:  # XLNet's bare einsum parameters
                _prune_head_parameters(block, keep, kv_keep, journal)
            else:
                _prune_block(model, block, keep, kv_keep, groups, journal)
        _retie(model, sharing, journal)
        blocks = attention_blocks(model)
        if any(block.family.shared_bias for block in blocks):  # T5's, LongT5's
            _install_t5_bias_hooks(model, blocks, journal)
        _install_alibi_hooks(blocks, journal)
        mismatch = first_mismatch(reference, run_probe(model, probe), dtype)
        if mismatch is not None and mismatch.unchecked and floored_reference is not None:
            floored = first_mismatch(floored_reference, run_floored(model, probe), dtype)
            if floored is not None:  # a real difference the NaN hid
                mismatch = dataclasses.replace(floored, floored=True)
            elif mismatch.not_finite is None:  # NaN in both where the floored probe agrees: every value compared
                mismatch = None
            elif own_nan is not None:  # finite where the masked model reads the unmodified one's NaN, and agreeing
                # at every value with the mask floored: the pruning is exact (nan28 refused it)
                accepted, mismatch = mismatch, None
            else:  # masking made the NaN (0 x inf): said in the refusal
                mismatch = dataclasses.replace(mismatch, floored=True)
    except BaseException:
        journal.undo()
        raise
    if mismatch is not None or not commit:
        journal.undo()
    if mismatch is not None and mismatch.unchecked:
        _refuse_own_nan(model, probe, mismatch, spec)
    if mismatch is not None:
        raise PruningNotExact(mismatch.describe(_model_type(model)) + "; the model was left unpruned, nothing written",
                              model_type=_model_type(model), block=mismatch.what, difference=mismatch.difference)
    if not commit:
        return attention_blocks(model)
    if accepted is not None and own_nan is not None:
        own, cause = own_nan
        logging.getLogger(__name__).warning(
            "%s: pruned, checked at every value: the model itself gives NaN or inf on headlab's padded probe before "
            "any head is removed (it %s); the masked model, the reference, has it in %s (%s) at %s, where the pruned "
            "one, which no longer reads it, is finite, and with the mask floored at float32's lowest value both are "
            "finite and agree everywhere. %s", _model_type(model), own, _name(accepted.what), accepted.call,
            accepted.not_finite, f"Cause: {cause}" if cause else "Check its weights and dtype")
    _mark_verified(model)
    return blocks


def _refuse_own_nan(model: nn.Module, probe: dict, mismatch: Mismatch, spec: dict) -> NoReturn:
    """The masked reference has NaN or inf where the pruned model has not (``not_finite``), or both have it
    and the floored mask could not make them finite (``uncompared``), and nothing else differs: say whose
    NaN it is (the unmodified model's, and why where that is known), not that pruning differs."""
    from headlab.prune_check import _name, not_finite, own_nan_cause, run_probe

    model_type = _model_type(model)
    own = not_finite(run_probe(model, probe))
    if own is None:  # masking made it (0 * inf): the masked model is the one that fails
        raise HeadlabError(mismatch.describe(model_type) + "; the unmodified model is finite on the probe, so "
                           "masking " + "; ".join(f"{_name(key)} heads {list(heads)}" for key, heads in spec.items())
                           + " makes the NaN; nothing was pruned")
    cause = own_nan_cause(model, probe)
    where = mismatch.not_finite or mismatch.uncompared
    if mismatch.not_finite is not None:  # the floored mask left the reference not finite (Granite-SWA's sinks)
        pruned = "where the pruned one is finite, so pruning cannot be checked there"
    else:  # NaN in both, and not finite with the mask floored either: nothing there was compared
        pruned = ("as has the pruned one, also with the mask floored at float32's lowest value, so those values could "
                  "not be compared")
    raise HeadlabError(
        f"{model_type}: cannot check pruning: the model itself gives NaN or inf on headlab's padded probe, before any "
        f"head is removed: it {own}; the masked model, the reference, has NaN or inf in {_name(mismatch.what)} "
        f"({mismatch.call}) at {where}, {pruned} (every finite value agrees). "
        f"{('Cause: ' + cause) if cause else 'Check its weights and dtype'}; nothing was pruned")


def check_block_sliceable(block: AttentionBlock) -> None:
    """Refuse, before anything changes, a block whose projections the slicing here does not know.
    Fused projections are sliced in every layout of adapters.families.QKV_LAYOUTS (the adapter
    refuses a width that does not fit its layout)."""
    # a module shared by several depths (ALBERT) prunes when the plan removes the same heads at each
    # (check_shared_plan), which masking those heads at every depth equals
    if block.family.prune_refused and block.n_heads:  # a layout read and refused by its model type (Inkling2's)
        raise HeadlabError(f"{block.name} ({block.family.name}): physical pruning is refused: "
                           f"{block.family.prune_refused}; mask the heads instead (mask_heads, or headlab prune train's "
                           "gates)")
    latent = unpruned_latent_reason(block.family, block.core) if block.n_heads else None
    if latent:  # the real reason, not the unknown layout below
        raise HeadlabError(f"{block.name} ({block.family.name}): physical pruning is refused: {latent}; mask the heads "
                           "instead (mask_heads, or headlab prune train's gates)")
    untied = block.qkv is None and block.q is None
    # a layout read and not sliced (Zaya's; Zamba 2's adapters laid out otherwise; ConvBERT's query heads feeding its
    # convolution heads, whatever its projections)
    refused = block.family.refused or (FUSED_REFUSED.get(type(block.core).__name__) if untied else None)
    if refused and block.n_heads:
        raise HeadlabError(f"{block.name} ({block.family.name}): physical pruning is refused: {refused}; mask the heads "
                           "instead (mask_heads, or headlab prune train's gates)")
    if block.qkv is None and block.q is None and block.n_heads and not block.family.head_rows:  # projections not tied
        raise HeadlabError(
            f"{block.name} ({block.family.name}): physical pruning is refused: this family's projection layout is "
            "unknown (no family table, and discovery did not find one query, one key and one value projection of "
            "the heads' widths feeding the attention function); mask the heads instead (mask_heads, or headlab "
            "prune train's gates)")
    quantized = [(name, type(m).__name__) for name, m in
                 (("q", block.q), ("k", block.k), ("v", block.v), ("o", block.o), ("qkv", block.qkv))
                 if m is not None and type(m).__name__ in BITNET_LINEARS]
    if quantized and block.n_heads:
        raise HeadlabError(
            f"{block.name} ({block.family.name}): physical pruning is refused: its projections are BitNet-quantized "
            f"({', '.join(f'{name}: {cls}' for name, cls in quantized)}, transformers.integrations.bitnet): "
            f"{BITNET_LINEARS[quantized[0][1]]}; mask the heads instead (mask_heads, or headlab prune train's gates)")
    # the attention module's own weights, and its projections held elsewhere (an output projection outside it)
    stored = stored_elsewhere_modules(block.module, block.name)
    stored += [(f"its {name} projection", type(m).__name__, found) for name, m in (("q", block.q), ("k", block.k),
                                                                                 ("v", block.v), ("o", block.o))
               if m is not None and not _inside(m, block.module) and (found := stored_elsewhere(m))]
    if stored and block.n_heads:
        raise HeadlabError(
            f"{block.name} ({block.family.name}): physical pruning is refused: its weights are stored quantized or "
            f"offloaded ({describe(stored)}): packed rows and block scales are not one head's weights, and an "
            "offloaded module's copy would stay whole, where headlab's slicing cuts the module's own tensors; mask the "
            f"heads instead (mask_heads, or headlab prune train's gates), or {HINT}")
    problem = _sub_norm_problem(block) if block.n_heads else None
    if problem:
        raise HeadlabError(f"{block.name} ({block.family.name}): physical pruning is refused: {problem}; mask the heads "
                           "instead (mask_heads, or headlab prune train's gates)")
    if block.qkv is not None and block.family.qkv_layout not in QKV_LAYOUTS:
        raise HeadlabError(
            f"{block.name} ({block.family.name}): physical pruning of its fused q/k/v projection "
            f"({block.family.qkv_layout}, {block.n_heads} query and {block.n_kv_heads} key/value heads) is not "
            "supported; mask the heads instead (mask_heads, or headlab prune train's gates)")
    # Parameters the attention module holds itself, one value per head, other than those the family slices with
    # the heads (attention sinks: adapters.families.ATTENTION_SINKS): left whole, the pruned forward failed its
    # check with a shape error naming none of them (the session-26 sweep)
    biases = [(owner, name) for owner, name, _ in head_biases(block)]
    sliced = {id(getattr(owner, name)) for owner, name in (*head_vectors(block), *biases)}
    sliced |= {id(getattr(block.core, name)) for name, _ in block.family.head_parameters}  # XLNet's
    dynamic = kv_dynamic_mask(block)
    if dynamic is not None and block.n_heads:  # Doge's A and dt_proj, sliced with the key/value heads
        projection, owner, name = dynamic
        vector = getattr(owner, name)
        if (vector.dim(), projection.out_features, projection.in_features) != \
                (1, block.n_kv_heads, block.n_kv_heads * block.d_head) or vector.shape[0] != block.n_kv_heads:
            raise HeadlabError(
                f"{block.name} ({block.family.name}): physical pruning is refused: its dynamic mask's "
                f"{block.family.kv_dynamic_mask[0]} ({projection.in_features} -> {projection.out_features}) and "
                f"{name} {list(vector.shape)} are not one per key/value head over the values of all "
                f"{block.n_kv_heads} (of {block.d_head}), as headlab read them; mask the heads instead (mask_heads)")
        sliced.add(id(vector))
    per_head = [f"{name} {list(p.shape)}" for name, p in block.core.named_parameters(recurse=False)
                if block.n_heads and id(p) not in sliced and any(size in (block.n_heads, block.n_kv_heads) for size in p.shape)]
    if per_head:
        why = HEAD_PARAMETERS_REFUSED.get(type(block.core).__name__)
        raise HeadlabError(
            f"{block.name} ({block.family.name}): physical pruning is refused: its attention holds per-head "
            f"parameters of its own ({', '.join(per_head)}" + (f"): {why}; " if why else
            ": one value per query or key/value head, which physical pruning does not slice; ")
            + "mask the heads instead (mask_heads, or headlab prune train's gates)")
    problem = (_kv_conv_problem(block) or _head_parts_problem(block)) if block.n_heads else None
    if problem:  # Inkling's k_sconv / v_sconv, sliced only where depthwise over the heads' channels
        raise HeadlabError(f"{block.name} ({block.family.name}): physical pruning is refused: {problem}; mask the heads "
                           "instead (mask_heads, or headlab prune train's gates)")
    # DeBERTa-v2 without share_att_key projects its relative positions per head with projections of its own (named
    # as such, before the general rule below would name them as modules spanning the heads' channels)
    unsliced = [name for name in ("pos_key_proj", "pos_query_proj") if isinstance(getattr(block.core, name, None), nn.Module)]
    if unsliced:
        raise HeadlabError(
            f"{block.name} ({block.family.name}): physical pruning does not slice its position projections "
            f"({', '.join(unsliced)}); mask the heads instead (mask_heads, or headlab prune train's gates)")
    # Other modules of the attention whose weights span a projection's heads (Inkling's k_sconv/v_sconv: depthwise
    # convolutions over the key/value channels, their conv states in the cache): the slicing below leaves them
    # whole, and the pruned forward failed its check with a bare Conv1d error (the session-26 sweep).
    # Latent attention (head_rows, no q) is left to its own table: its indexers hold heads of their own.
    mla = bool(block.family.head_rows) and block.q is None
    unsliced_modules = _unsliced_head_modules(block) if block.n_heads and not mla else []
    if unsliced_modules:
        raise HeadlabError(
            f"{block.name} ({block.family.name}): physical pruning is refused: besides its q, k, v and output "
            f"projections, its attention holds modules whose weights span the heads' channels "
            f"({', '.join(unsliced_modules)}), which physical pruning does not slice; mask the heads instead "
            "(mask_heads, or headlab prune train's gates)")


def _inside(module: nn.Module, owner: nn.Module) -> bool:
    return any(module is m for m in owner.modules())


BITNET_LINEARS = {
    "AutoBitLinear": "with online quantization its weight is rounded to -1, 0, 1 times a scale of the whole matrix "
                     "(WeightQuant: 1 / mean(|W|)), so removing a head's rows or columns changes every other head's "
                     "weights; without, it multiplies by a stored weight_scale, and a layer left with no head would "
                     "add o_proj's bias times it, which headlab has not checked",
    "BitLinear": "its weight is packed, four ternary values per byte along the output rows, with a scale of the whole "
                 "matrix (weight_scale), which headlab does not unpack or slice",
}
"""transformers' BitNet-quantized linear layers (``transformers.integrations.bitnet``, a ``quantization_config`` with
``quant_method`` "bitnet"; transformers 5.24), with why physical pruning is refused on them. BitNet built from its
config alone has ``nn.Linear`` projections, which are pruned."""


def _sub_norm_problem(block: AttentionBlock) -> str | None:
    """Why the norm between the heads and the output projection (``Family.sub_norm``) is not the one
    :data:`~headlab.adapters.families.SUB_NORMS` describes (an RMS norm with one weight entry per heads' feature and a
    float ``variance_epsilon``; an L2 norm with no parameter), or None (and None without one)."""
    found = sub_norm(block)
    if found is None:
        return None
    norm, formula = found
    width = block.n_heads * block.d_head
    name = f"its norm over the heads' outputs, {block.family.sub_norm} ({type(norm).__name__})"
    if formula == "rms":
        weight = getattr(norm, "weight", None)
        eps = getattr(norm, "variance_epsilon", None)
        if not isinstance(weight, torch.Tensor) or list(weight.shape) != [width] or \
                not isinstance(eps, (int, float)) or isinstance(eps, bool):
            return (f"{name}, has no weight of {width} entries ({block.n_heads} heads x {block.d_head}) and float "
                    "variance_epsilon, as the RMS norm whose pruning headlab derived")
        return None
    if next(norm.parameters(), None) is not None:
        return f"{name}, holds parameters, where the L2 norm whose pruning headlab derived has none"
    return None


def _unsliced_head_modules(block: AttentionBlock) -> list[str]:
    """Children of ``block.core`` other than the projections pruning slices whose parameters (matrices, kernels:
    not a norm's vector) have a dimension of the query or key/value width (heads x head size), or linear maps
    whose output is heads x some width of their own (Inkling's ``r_proj``: ``num_heads * d_rel``, viewed per head),
    as ``"name (Class weight [shape])"``."""
    dynamic = kv_dynamic_mask(block)
    sliced = [m for m in (block.q, block.k, block.v, block.o, block.qkv, *head_column_modules(block),
                          *head_row_modules(block), dynamic[0] if dynamic else None,
                          *(conv for conv, _ in kv_conv_modules(block)),
                          *(conv for conv, _ in kv_dynamic_convs(block))) if m is not None]
    known = {id(p) for m in sliced for p in m.parameters()}  # Moshi's MoshiLinear holds the projection as .linear
    known |= {id(getattr(owner, name)) for owner, name in head_tables(block)}  # Inkling2's norms' scales
    # a head-rows projection at the end of an nn.Sequential (Zamba 2's attention adapters, QKV_ADAPTERS): the maps
    # before it read the layer's input into a latent all heads share (the rank), which stays whole
    known |= {id(p) for path, _ in block.family.head_rows if "." in path
              and isinstance(parent := block.module.get_submodule(path.rpartition(".")[0]), nn.Sequential)
              and parent[-1] is block.module.get_submodule(path) for p in parent.parameters()}
    widths = {block.n_heads * block.d_head, block.n_kv_heads * block.d_head,
              block.n_heads * block.d_qk, block.n_kv_heads * block.d_qk}
    found = []
    for name, child in block.core.named_children():
        if name in (*block.family.output_norms, *block.family.input_readers, *block.family.kept_whole):
            continue
        for pname, parameter in child.named_parameters():
            if id(parameter) in known:
                continue
            # an embedding's rows are a table's entries (T5's position buckets), only its width can be the heads'
            sizes = parameter.shape[1:] if isinstance(child, nn.Embedding) else parameter.shape
            if parameter.dim() >= 2 and any(size in widths for size in sizes):
                found.append(f"{name} ({type(child).__name__} {pname} {list(parameter.shape)})")
                break
        else:
            if isinstance(child, nn.Linear) and id(child.weight) not in known:
                # its output a width per head of its own (Inkling's r_proj, viewed [..., heads, -1]), left whole
                heads = next((n for n in (block.n_heads, block.n_kv_heads) if n > 1 and child.out_features % n == 0),
                             None)
                if heads is not None:
                    which = "query" if heads == block.n_heads else "key/value"
                    found.append(f"{name} ({type(child).__name__} weight {list(child.weight.shape)}: {heads} {which} "
                                 f"heads x {child.out_features // heads})")
    return found


# Attributes of an attention module that hold a head count or a width derived from one.
_WIDTH_ATTRS = ("all_head_size", "inner_dim", "split_size")


def _core_path(block: AttentionBlock) -> str:
    return block.name + (f".{block.family.core}" if block.family.core else "")


def _projection(module: nn.Module) -> tuple:
    if grouped(module):  # DeepSeek-V4's o_a_proj: (kind, in per group, out, groups), rebuilt as its own class
        return "grouped_linear", int(cast(Any, module).in_features), int(cast(Any, module).out_features), \
            int(cast(Any, module).n_groups)
    if isinstance(module, nn.Linear):
        return "linear", module.in_features, module.out_features
    if is_linear(module):  # I-BERT's QuantLinear, rebuilt as one (its forward returns (output, None))
        return "quant_linear", int(cast(Any, module).in_features), int(cast(Any, module).out_features)
    if isinstance(module, nn.Conv1d):  # SqueezeBERT's 1x1 convolutions: their groups too (plan: kind, in, out, groups)
        return "conv1d_k1", module.in_channels, module.out_channels, module.groups
    return "conv1d", int(cast(Any, module).weight.shape[0]), int(cast(Any, module).nf)  # Conv1D: weight [in, out]


def _plan_sub_norm(block: AttentionBlock, names: dict[int, str], plan: dict) -> None:
    """A pruned block's norm over its heads' outputs (BitNet's ``attn_sub_norm``) in ``plan``: its kept entries and its
    epsilon (one per layer once pruned, :func:`_slice_sub_norm`); a layer emptied keeps the norm with no entry."""
    found = sub_norm(block)
    if found is not None and found[1] == "rms":
        path = names[id(found[0])]
        plan.setdefault("vectors", {})[f"{path}.weight"] = int(cast(torch.Tensor, found[0].weight).shape[0])
        plan["attributes"][path] = {"variance_epsilon": float(cast(Any, found[0]).variance_epsilon)}
    elif isinstance(block.core, ZeroHeadAttention):
        # emptied: its stand-in (calling no attention function) is listed under a generic family without sub_norm;
        # the norm is among the children it adopted, told by class (stands_for_block's family names it relative to
        # the block's module, not to the stand-in)
        for child in block.core.children():
            if SUB_NORMS.get(type(child).__name__) == "rms":
                plan.setdefault("vectors", {})[f"{names[id(child)]}.weight"] = int(cast(torch.Tensor, child.weight).shape[0])


def _plan_neomme(block: AttentionBlock, names: dict[int, str], plan: dict) -> None:
    """The plan's entries of a pruned NeoMME layer: its exclusive map's ``num_key_value_groups`` (``attributes``,
    ``Family.group_holders``) and the kept key/value heads whose value-embedding columns it reads (``value_embeds``:
    :class:`ValueEmbedsHook`); none for a layer with no head."""
    core = block.core
    if isinstance(core, ZeroHeadAttention):
        return
    hooked = getattr(core, "_headlab_value_embeds_hooked", None)
    if hooked is not None:
        plan.setdefault("value_embeds", {})[_core_path(block)] = [list(getattr(core, VALUE_EMBEDS_ATTR)), hooked]
    for holder in group_holders(block):
        plan["attributes"][names[id(holder)]] = {_GROUP_ATTRS[0]: int(getattr(holder, _GROUP_ATTRS[0]))}


def _plan_head_parts(block: AttentionBlock, names: dict[int, str], plan: dict) -> None:
    """A pruned block's parts per head that its tables name, in ``plan``: Inkling's depthwise key/value convolutions
    (``depthwise``: their channels kept), Inkling2's norms' scales (``parameters``: their shapes), dynamic convolutions
    (``weight_proj`` in ``projections``, ``static_weight`` in ``parameters``) and sub-modules' ``num_heads``
    (``attributes``)."""
    for conv, _ in kv_conv_modules(block):
        plan.setdefault("depthwise", {})[names[id(conv)]] = int(conv.out_channels)
    for owner, pname in head_tables(block):
        plan.setdefault("parameters", {})[f"{names[id(owner)]}.{pname}"] = list(getattr(owner, pname).shape)
    for dynamic_conv, _ in kv_dynamic_convs(block):
        path = names[id(dynamic_conv)]
        plan["projections"][f"{path}.weight_proj"] = list(_projection(cast(nn.Module, dynamic_conv.weight_proj)))
        plan.setdefault("parameters", {})[f"{path}.static_weight"] = list(cast(torch.Tensor,
                                                                               dynamic_conv.static_weight).shape)
    for holder, _ in count_holders(block):  # each sub-module's own head count (set at init from the config)
        plan["attributes"].setdefault(names[id(holder)], {})["num_heads"] = cast(int, holder.num_heads)


def pruning_plan(model: nn.Module) -> dict:
    """What :mod:`headlab.portable_code` needs to rebuild ``model``'s pruned shapes from the
    original config: ``projections`` (path -> (kind, in, out)), ``attributes`` (attention
    module path -> head counts and widths), ``no_head`` (layers left with no head) and, where a
    layer has per-head norms (StableLM), ``per_head`` (module path -> heads kept); ``vectors``
    (parameter path -> entries kept) for parameters of one entry per head (``Family.head_vectors``) or of one head
    size per head (``Family.head_biases``); ``parameters`` (parameter path -> its pruned shape) for the bare per-head
    parameters a family's forward applies itself (``Family.head_parameters``: XLNet's); ``selected``
    (norm path -> its projection's name, the heads kept, the head size) where a query/key norm spans the whole
    projection, kept whole (:func:`headlab.portable_code.selection_hook`); ``shared_bias`` (layer path -> [kept
    heads, the path of its stack's first layer, whose table gives the bias, ``Family.shared_bias``]) for the layers of
    a pruned T5 stack (:func:`headlab.portable_code.t5_bias_hook`, ``local_bias_hook``); ``value_embeds`` (layer path ->
    [the key/value heads whose columns of the model's value embeddings it reads, original numbering; their original
    count]) for a pruned NeoMME layer that adds them (:class:`headlab.portable_code.ValueEmbedsHook`); ``score_heads``
    (layer path -> its kept heads, original numbering) for a layer whose pruned forward computes scores for every head
    of the config (``Family.score_heads``: ProphetNet's decoder self-attention); ``kept``
    (block path -> [kept heads, kept key/value heads, original count], the original numbering, which
    pruned_heads.py does not need but a directory re-saved through it keeps in config.json:
    :func:`headlab.checkpoint.record_from_weights` reads it)."""
    names = {id(module): name for name, module in model.named_modules()}
    plan: dict = {"projections": {}, "attributes": {}, "no_head": {}}
    for block in attention_blocks(model):
        core = block.core
        if getattr(core, KEPT_ATTR, None) is None:
            continue
        dynamic = kv_dynamic_mask(block)
        # a layer emptied keeps its sliced dt_proj (Doge), no A: its stand-in, of another family, adopts children only
        emptied = KV_DYNAMIC_MASKS.get(_model_type(model), ("",))[0] if isinstance(core, ZeroHeadAttention) else ""
        emptied_projection = getattr(core, emptied, None) if emptied else None
        for module in (block.q, block.k, block.v, block.qkv, block.o, *head_row_modules(block),
                       dynamic[0] if dynamic else None,
                       emptied_projection if isinstance(emptied_projection, nn.Linear) else None):
            if module is not None and not block.family.head_parameters:  # XLNet's points: no weight, nothing to save
                plan["projections"][names[id(module)]] = list(_projection(module))
        for pname, _ in block.family.head_parameters:  # XLNet's bare per-head parameters: their pruned shapes
            plan.setdefault("parameters", {})[f"{_core_path(block)}.{pname}"] = list(getattr(core, pname).shape)
        for module, _ in _per_head_tables(block):  # Chameleon's per-head norms: a row per kept head
            for pname, parameter in module.named_parameters(recurse=False):
                plan.setdefault("parameters", {})[f"{names[id(module)]}.{pname}"] = list(parameter.shape)
        biases = [(owner, name) for owner, name, _ in head_biases(block)]
        for owner, vector in (*head_vectors(block), *biases, *([dynamic[1:]] if dynamic else [])):
            plan.setdefault("vectors", {})[f"{names[id(owner)]}.{vector}"] = int(getattr(owner, vector).shape[0])
        for embedding in head_column_modules(block):
            plan.setdefault("columns", {})[names[id(embedding)]] = list(embedding.weight.shape)
        _plan_head_parts(block, names, plan)
        _plan_sub_norm(block, names, plan)
        attrs = {}
        family = block.family
        attr_names = (*family.head_count_attrs, *_WIDTH_ATTRS, family.kv_groups_attr, *_HEAD_ATTRS,
                      *_KV_HEAD_ATTRS, *_GROUP_ATTRS, *family.width_attrs, *family.kv_head_count_attrs,
                      *family.kv_width_attrs, family.qkv_groups_attr)
        for name in dict.fromkeys(attr_names):
            if name and isinstance(getattr(core, name, None), int) and not isinstance(core, ZeroHeadAttention):
                attrs[name] = int(getattr(core, name))
        if attrs:
            plan["attributes"][_core_path(block)] = attrs
        _plan_neomme(block, names, plan)
        # pruned_heads.py does not read it: a directory re-saved through it keeps the original numbering in config.json
        plan.setdefault("kept", {})[block.name] = [list(getattr(core, KEPT_ATTR)),
                                                    list(getattr(core, KV_KEPT_ATTR)), int(getattr(core, ORIGINAL_ATTR))]
        # a layer emptied too: its stand-in adopts the emptied lists, which pruned_heads.py's would build whole (StableLM
        # with every head of a layer removed: plain loading failed on the norms missing from the checkpoint)
        for path, module, _ in _per_head_lists(block):
            plan.setdefault("per_head", {})[f"{_core_path(block)}.{path}"] = len(cast(nn.ModuleList, module.norms))
        if isinstance(core, ZeroHeadAttention):
            entry = [core.o_name, core.n_outputs, core.d_head]
            if core.residual or core.norm or core.selection:
                entry.append(list(core.residual) if core.residual else None)
            if core.norm or core.selection:
                entry.append(core.norm)
            if core.selection:
                entry.append(core.selection)
            plan["no_head"][_core_path(block)] = entry
        else:
            if isinstance(getattr(core, "config", None), LayerConfig):
                plan.setdefault("config", {})[_core_path(block)] = dict(cast(LayerConfig, core.config).overrides)
            pruned_forward = getattr(type(core), "_headlab_pruned_forward", None)
            if pruned_forward:  # the forward pruned_heads.py gives the layer (Family.pruned_forward)
                plan.setdefault("classes", {})[_core_path(block)] = pruned_forward
            if getattr(core, SCORE_HEADS_ATTR, None) is not None:  # its kept heads' scores, of the config's (ProphetNet)
                plan.setdefault("score_heads", {})[_core_path(block)] = list(getattr(core, SCORE_HEADS_ATTR))
            if getattr(core, "_headlab_t5_hooked", False):  # T5's stack bias: [kept, the table's layer, kind]
                source, kind = getattr(core, T5_SOURCE_ATTR)
                plan.setdefault("shared_bias", {})[_core_path(block)] = [list(getattr(core, KEPT_ATTR)), source, kind]
            if getattr(core, "_headlab_alibi_hooked", False):
                entry = [list(getattr(core, KEPT_ATTR)), getattr(core, ORIGINAL_ATTR)]
                argument = block.family.alibi_argument  # Bloom's and Falcon's alibi, written as before
                plan.setdefault("alibi", {})[_core_path(block)] = entry if argument == "alibi" else [*entry, argument]
            for name, child in core.named_children():  # a norm over a whole q/k projection: its heads selected after it
                selected = getattr(child, SELECTED_ATTR, None)
                if selected:
                    plan.setdefault("selected", {})[f"{_core_path(block)}.{name}"] = copy.deepcopy(selected)
    return plan


@checked_keywords()
def save_pruned(model: nn.Module, path: str | os.PathLike) -> Path:
    """Write standard safetensors weights, the config and ``headlab_pruning.json``.

    Only a model whose pruning was checked (by :func:`prune_heads` or :func:`load_pruned`) is
    written; anything else raises before a file is touched.

    The directory also loads with plain transformers (:func:`headlab.portable.make_portable`):
    a standard config where one can state the pruned heads, else ``trust_remote_code=True``
    with a small module saved beside the weights. How is recorded under ``portable``.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise HeadlabError(f"{path}: exists and is not a directory")
    _refuse_peft(model)
    check_pruned_numbering(model, attention_blocks(model), to_prune=True)  # its record would name other heads
    record = pruning_record(model)
    if record["blocks"] and model.__dict__.get(VERIFIED_ATTR) != record["blocks"]:
        raise PruningNotExact(
            f"{_model_type(model)}: its pruning was not checked against masking (headlab.prune_heads and "
            "headlab.load_pruned check it); nothing written", model_type=_model_type(model))
    cast(Any, model).save_pretrained(path, safe_serialization=True)
    record["portable"] = make_portable(model, path, pruning_plan(model))
    write_json(path / PRUNING_FILE, record)
    readable_as_umask_allows(path)
    return path


def _refuse_peft(model: nn.Module) -> None:
    """save_pruned writes a model that transformers and load_pruned rebuild from its config: a PEFT
    adapter attached to it would be written as weights of no such model (``base_layer``, ``lora_A``...:
    refused at every load), and a ``PeftModel`` saves the adapter alone."""
    wrapped = [name for name, module in model.named_modules() if peft_layer(module)]
    if not wrapped and not type(model).__module__.startswith("peft."):
        return
    where = f" ({counted(len(wrapped), 'adapter layer')}: {', '.join(wrapped[:3])}{', ...' if len(wrapped) > 3 else ''})"
    raise HeadlabError(
        f"{type(model).__name__}: carries a PEFT adapter{where if wrapped else ''}; save_pruned writes the model "
        "alone, nothing written. Merge the adapter into the weights to save the adapted model (peft's "
        "merge_and_unload()), or save the adapter with its own save_pretrained and the model after unload()")


def _record_name(path: str | os.PathLike) -> str:
    """Where the pruning record of the directory ``path`` comes from, as a refusal names it."""
    if (Path(path) / PRUNING_FILE).is_file():
        return PRUNING_FILE
    return f"the heads its config.json's {PLAN_KEY} or the weights' shapes name (no {PRUNING_FILE})"


def _holds_plan(path: Path) -> bool:
    """Whether ``path``'s config.json holds the plan save_pruned writes for pruned_heads.py (``headlab_pruned``)."""
    try:
        return isinstance(json.loads((path / "config.json").read_text(encoding="utf-8")).get(PLAN_KEY), dict)
    except (OSError, ValueError, AttributeError):
        return False


def load_pruned(path: str | os.PathLike, model_class: type | None = None, *, trust_remote_code: bool = False,
                record: Mapping | None = None, dtype: torch.dtype | None = None, **config_overrides) -> nn.Module:
    """Rebuild a model written by :func:`save_pruned`: build from config, prune, load weights.

    There is no unpruned model with these weights to compare with, so the check is in two parts:
    the pruning is applied to the freshly built (randomly initialised) model and checked against
    that model with the same heads masked, as :func:`prune_heads` does (so the structure computes
    what masking computes, whatever the weights); then the loaded model must run the padded probe
    and its generation steps with finite outputs. Weights are read with safetensors only; no code
    from the directory is run (the config is read with ``trust_remote_code`` as given, False by
    default). ``dtype``: the dtype the model is built and checked in (default torch's default, float32): weights
    stored wider than it are rounded to it, so :func:`headlab.load_model` passes ``float64`` when asked for it (session
    46: a float64 directory was rounded to float32 and widened back, experiments/fuzz_heads.py), and narrower ones
    widen exactly. ``record`` stands in for a missing headlab_pruning.json
    (:func:`headlab.checkpoint.record_from_weights`). The record is checked against the weights'
    shapes, and every tensor must load: none missing, none left over.
    """
    from headlab import checkpoint  # reads and checks the directory (complete or refused)

    path = Path(path)
    record_path = path / PRUNING_FILE
    source = str(record_path)
    if record is not None:
        source = f"{path} (heads read from the weights' shapes or config.json's {PLAN_KEY})"
    elif not record_path.is_file():
        raise HeadlabError(f"{path}: no {PRUNING_FILE}; " + (
            f"its config.json holds a pruned model's plan ({PLAN_KEY}): a directory headlab saved, re-saved by "
            "transformers (save_pretrained writes no record): load it with headlab.load_model, which reads the "
            "kept heads back from the plan and the weights, as headlab's commands do" if _holds_plan(path)
            else "is this a directory written by save_pruned?"))
    else:
        try:
            record = json.loads(record_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            raise HeadlabError(f"{record_path}: line {error.lineno}: invalid JSON ({error.msg})") from error
    checkpoint.validate_record(record, source)
    shapes = checkpoint.tensor_shapes(path)  # a truncated or corrupt file: one line naming it, before any work
    config = checkpoint.read_config(path, trust_remote_code, **config_overrides)
    restore_original_config(dict(record), config)  # the record applies to the unpruned model
    if model_class is None:
        model_class = checkpoint.named_model_class(config, f"{path}/config.json")
    with local_torch_dtype(dtype or torch.get_default_dtype()):  # transformers' own context: cls(config) builds in it
        model = checkpoint.build_model(model_class, config, path)
    apply_pruning_record(model, record, source)
    reconstructed = (record.get("numbering") or {}).get("reconstructed") if isinstance(record, Mapping) else None
    _refuse_computed_by_index(model, reconstructed or [], path)
    checkpoint.check_fits_weights(model, shapes, source)

    state = checkpoint.read_weights(path)
    model_keys = set(model.state_dict())
    unexpected: list[str] = []
    if any(name not in model_keys for name in state) and _converted_on_save(model):
        missing = _load_converted(model, state, path)  # e.g. Mixtral: experts saved one by one, held fused
    else:
        try:
            missing, unexpected = model.load_state_dict(state, strict=False)
        except RuntimeError as error:
            raise HeadlabError(f"{path}: weights do not match {_record_name(path)}: {error}") from error
    cast(Any, model).tie_weights()
    # what loaded is every tensor of the model not missing: under transformers' conversion the file's names are not the
    # model's (T5Gemma 2's encoder embedding, saved as model.encoder.embed_tokens), and the tied ones share its memory
    loaded = {p.data_ptr() for name, p in model.state_dict().items() if name not in set(missing)}
    # Missing is fine for tied weights and for what the class itself rebuilds (sinusoidal tables).
    rebuilt = getattr(model, "_keys_to_ignore_on_load_missing", None) or []
    untied = [
        name for name in missing
        if model.state_dict()[name].data_ptr() not in loaded and not any(re.search(p, name) for p in rebuilt)
    ]
    checkpoint.check_complete(path, untied, unexpected)
    _check_loaded(model, path)
    if reconstructed:
        model.__dict__[NUMBERING_ATTR] = {"reconstructed": list(reconstructed)}
        logging.getLogger(__name__).warning(
            "%s: the original numbering of the kept heads of %s is not in the weights; they are numbered as pruning "
            "groups them (query heads over their key/value heads), not as in the model they were pruned from",
            path, ", ".join(map(str, reconstructed)))
    return model.eval()


def _refuse_computed_by_index(model: nn.Module, reconstructed: list[str], path: Path) -> None:
    """A reconstructed numbering only names heads, unless a head's original index enters what it
    computes beyond its own weights: ALiBi's slope (Press et al. 2022: fixed by the head's index,
    built by the model for all the config's heads), T5's relative position bias (the stack's
    one table, a column per original head), where a norm spans the whole query or key projection
    (OLMo 2), the rows of that projection, kept whole, that the head reads, and ProphetNet's decoder
    self-attention's relative-position scores (computed for the config's heads, the kept heads' taken:
    ``Family.score_heads``). There the numbering picks them: a wrong one would compute another model than
    the one saved, so it is refused."""
    keys = set(reconstructed)
    biased: dict[str, str] = {}
    for block in attention_blocks(model):
        if f"{block.kind}:{block.layer}" not in keys:
            continue
        if getattr(block.core, "_headlab_alibi_hooked", False):
            biased[f"{block.kind}:{block.layer}"] = "its ALiBi slope"
        elif getattr(block.core, "_headlab_t5_hooked", False) and block.kind != "dec_cross":  # cross: no bias
            biased[f"{block.kind}:{block.layer}"] = "its column of the relative position bias"
        elif any(getattr(child, SELECTED_ATTR, None) for child in block.core.children()):
            # a query/key projection kept whole under a norm over all its heads (OLMo 2): the index picks its rows
            biased[f"{block.kind}:{block.layer}"] = ("its rows of the query and key projections, which stay whole "
                                                     "under a norm over all heads")
        elif getattr(block.core, SCORE_HEADS_ATTR, None) is not None:  # ProphetNet's decoder self-attention
            biased[f"{block.kind}:{block.layer}"] = ("its relative-position scores, computed for every head of the "
                                                     "config from relative_pos_embeddings, kept whole")
    if biased:
        raise HeadlabError(
            f"{path}: the original numbering of the kept heads of {', '.join(biased)} is in neither the weights nor "
            f"the config, and in {_model_type(model)} a head's original index picks {next(iter(biased.values()))}: "
            f"any other numbering computes another model than the one saved. Put back the {PRUNING_FILE} saved "
            "with the pruned model (or pass it: headlab.load_pruned(path, record=...))")


def _converted_on_save(model: nn.Module) -> bool:
    """Whether transformers renames or regroups this model's weights when it saves them (its
    "original format": Mixtral's experts one tensor per expert, held fused in the model)."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    return bool(get_model_conversion_mapping(cast(Any, model), add_legacy=False))


def _load_converted(model: nn.Module, state: dict, path: Path) -> list[str]:
    """Load weights saved in transformers' original format through transformers' own conversion
    (what ``from_pretrained`` does); the keys still missing."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        info, _ = convert_and_load_state_dict_in_model(
            cast(Any, model), state,
            LoadStateDictConfig(weight_mapping=cast(Any, get_model_conversion_mapping(cast(Any, model)))))
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    if info.mismatched_keys or info.conversion_errors or info.error_msgs:
        found = [*sorted(info.mismatched_keys)[:3], *list(info.conversion_errors.items())[:3], *info.error_msgs[:3]]
        raise HeadlabError(f"{path}: weights do not match {_record_name(path)}: {found}")
    if info.unexpected_keys:
        raise HeadlabError(f"{path}: weights hold tensors the model does not have: {sorted(info.unexpected_keys)[:3]}")
    return sorted(info.missing_keys)


def _check_loaded(model: nn.Module, path: Path) -> None:
    """The loaded weights in the checked structure: a forward on the padded probe (and cached
    generation steps) must run and give finite values where the inputs are not padding."""
    from headlab.prune_check import first_probe, not_finite, own_nan_cause

    probe, trace = first_probe(model)  # as in _prune_checked
    problem = not_finite(trace)
    if problem is not None:
        # NaN from the model's own padded attention is not a damaged file: say which it is
        cause = own_nan_cause(model, probe) if trace.error is None else None
        known = f"; its own eager attention makes it on padded rows, not its weights: {cause}" if cause else ""
        raise HeadlabError(f"{path}: the loaded {_model_type(model)} model {problem}{known}")


@checked_keywords()
def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (tied weights counted once)."""
    seen, total = set(), 0
    for parameter in model.parameters():
        if parameter.data_ptr() not in seen:
            seen.add(parameter.data_ptr())
            total += parameter.numel()
    return total


__all__ = [
    "prune_heads", "check_prunable", "save_pruned", "load_pruned", "pruning_record", "pruning_plan", "apply_pruning_record",
    "ZeroHeadAttention", "count_parameters", "PRUNING_FILE", "KINDS", "removal_by_scores", "in_original_numbering",
    "to_current_numbering", "original_heads", "declared_numbering", "save_adapter", "load_adapter", "kept_blocks",
]
