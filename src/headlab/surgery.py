"""Physical head removal, and saving/loading pruned models.

transformers v5 dropped ``prune_heads``; this module puts it back for every family the
adapter knows. Removing head h of a block slices rows h*d_head:(h+1)*d_head out of q (and of
k and v when the head owns its key/value head) and the same columns out of the output
projection. The attention forwards of transformers v5 infer the head count from tensor
shapes, so layers may keep different numbers of heads. A layer left with no head is replaced
by :class:`ZeroHeadAttention`, which keeps only the output projection's bias and the residual
path (Voita et al. 2019, footnote 9).
"""

from __future__ import annotations

import json
import os
import re
import types
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from headlab.adapters import AttentionBlock, attention_blocks, find_block
from headlab.errors import HeadlabError
from headlab.gates import validate_heads
from headlab.heads import KINDS, HeadSpec, atomic_write_text, readable_as_umask_allows
from headlab.portable import make_portable, restore_original_config
from headlab.portable_code import NoHeadAttention, cache_argument

PRUNING_FILE = "headlab_pruning.json"
FORMAT_VERSION = 1

# Attributes on an attention core that record what pruning kept, in original numbering.
KEPT_ATTR = "_headlab_kept_heads"
KV_KEPT_ATTR = "_headlab_kept_kv_heads"
ORIGINAL_ATTR = "_headlab_original"


# -- slicing -------------------------------------------------------------------------------
def _head_index(heads: list[int], d_head: int, device) -> torch.Tensor:
    """Feature indices of ``heads``: h*d_head .. (h+1)*d_head-1 for each h, in order."""
    index = [h * d_head + i for h in heads for i in range(d_head)]
    return torch.tensor(index, dtype=torch.long, device=device)


def _replace(module: nn.Module, name: str, value: torch.Tensor) -> None:
    old = getattr(module, name)
    setattr(module, name, nn.Parameter(value.contiguous(), requires_grad=old.requires_grad))


def _slice_outputs(module: nn.Module, index: torch.Tensor) -> None:
    """Keep output features ``index`` of a Linear or a Conv1D (weight [in, out])."""
    index = index.to(module.weight.device)
    if isinstance(module, nn.Linear):
        _replace(module, "weight", module.weight.index_select(0, index))
        module.out_features = len(index)
    else:
        _replace(module, "weight", module.weight.index_select(1, index))
        module.nf = len(index)
    if module.bias is not None:
        _replace(module, "bias", module.bias.index_select(0, index.to(module.bias.device)))


def _slice_inputs(module: nn.Module, index: torch.Tensor) -> None:
    index = index.to(module.weight.device)
    if isinstance(module, nn.Linear):
        _replace(module, "weight", module.weight.index_select(1, index))
        module.in_features = len(index)
    else:
        _replace(module, "weight", module.weight.index_select(0, index))
        if hasattr(module, "nx"):
            module.nx = len(index)


# -- the plan for one block ----------------------------------------------------------------
def _kv_plan(block: AttentionBlock, keep: list[int]) -> tuple[list[int], int]:
    """Which key/value heads to keep (current numbering, repeats allowed) and the new group size.

    Under grouped-query attention a key/value head goes only when all its query heads are
    gone. If the surviving groups have unequal sizes, the forward's ``repeat_kv`` cannot map
    them, so each kept query head gets its own copy of its key/value head (group size 1).
    """
    if block.n_kv_heads == block.n_heads:
        return list(keep), 1
    group = block.n_heads // block.n_kv_heads
    counts = Counter(h // group for h in keep)  # kept query heads per key/value head
    sizes = set(counts.values())
    if len(sizes) <= 1:
        return sorted(counts), (sizes.pop() if sizes else group)
    return [h // group for h in keep], 1


def _original(block: AttentionBlock) -> tuple[list[int], list[int], int]:
    """Kept query heads and key/value heads in the model's original numbering, and the original count."""
    core = block.core
    kept = getattr(core, KEPT_ATTR, None)
    if kept is None:
        return list(range(block.n_heads)), list(range(block.n_kv_heads)), block.n_heads
    return list(kept), list(getattr(core, KV_KEPT_ATTR)), getattr(core, ORIGINAL_ATTR)


def _prune_block(model: nn.Module, block: AttentionBlock, keep: list[int], kv_keep: list[int], groups: int) -> None:
    family, core, d = block.family, block.core, block.d_head
    device = block.o.weight.device
    q_index = _head_index(keep, d, device)
    kv_index = _head_index(kv_keep, d, device)
    if block.qkv is not None:  # fused [q | k | v] columns (GPT-2's c_attn)
        width = block.n_heads * d
        _slice_outputs(block.qkv, torch.cat([q_index, width + kv_index, 2 * width + kv_index]))
        if hasattr(core, "split_size"):
            core.split_size = len(keep) * d
    else:
        _slice_outputs(block.q, q_index)
        _slice_outputs(block.k, kv_index)
        _slice_outputs(block.v, kv_index)
    _slice_inputs(block.o, q_index)
    for attr in family.head_count_attrs:
        if hasattr(core, attr):
            setattr(core, attr, len(keep))
    for attr in ("all_head_size", "inner_dim"):
        if hasattr(core, attr):
            setattr(core, attr, len(keep) * d)
    if family.kv_groups_attr and hasattr(core, family.kv_groups_attr):
        setattr(core, family.kv_groups_attr, groups)

    kept, kv_kept, original = _original(block)
    setattr(core, KEPT_ATTR, [kept[h] for h in keep])
    setattr(core, KV_KEPT_ATTR, [kv_kept[j] for j in kv_keep])
    setattr(core, ORIGINAL_ATTR, original)
    if not keep:
        _replace_with_zero_heads(model, block)


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

    def __init__(self, original: nn.Module, o_name: str | None, n_outputs: int, d_head: int):
        super().__init__(original, o_name, n_outputs, d_head)
        for name, value in vars(original).items():
            if not name.startswith("_") and name not in vars(self) and isinstance(value, (int, float, bool, str)):
                setattr(self, name, value)
        for name in (KEPT_ATTR, KV_KEPT_ATTR, ORIGINAL_ATTR):
            setattr(self, name, getattr(original, name))
        self.config = getattr(original, "config", None)
        if hasattr(original, "compute_bias"):  # T5's first layer: the position table the others read
            self._relative_position_bucket = type(original)._relative_position_bucket
            self.compute_bias = types.MethodType(type(original).compute_bias, self)


def _replace_with_zero_heads(model: nn.Module, block: AttentionBlock) -> None:
    parent_path, _, attr = _core_path(block).rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    o_name = next((name for name, child in block.core.named_children() if child is block.o), None)
    n_outputs = block.family.probs_index + 1 if block.family.probs_index >= 0 else 2
    setattr(parent, attr, ZeroHeadAttention(block.core, o_name, n_outputs, block.d_head))


# -- T5: one relative position bias shared by the layers of a stack --------------------------
def _install_t5_bias_hooks(model: nn.Module, blocks: list[AttentionBlock]) -> None:
    """T5 computes its position bias [1, n_heads, q, k] in the first layer of a stack and
    hands it to the others, which breaks once layers keep different heads. In a pruned stack
    each layer instead gets the full bias recomputed from the first layer's table, sliced to
    the heads it kept (cross-attention has no position bias: zeros)."""
    stacks = {"enc_self": "encoder", "dec_self": "decoder", "dec_cross": "decoder"}
    pruned_stacks = {stacks[b.kind] for b in blocks if getattr(b.core, KEPT_ATTR, None) is not None}
    for stack in pruned_stacks:
        members = [b for b in blocks if stacks[b.kind] == stack]
        source = next(b.core for b in members if b.kind != "dec_cross" and b.layer == 0)
        for block in members:
            core = block.core
            if getattr(core, "_headlab_t5_hooked", False) or isinstance(core, ZeroHeadAttention):
                continue
            if getattr(core, KEPT_ATTR, None) is None:
                setattr(core, KEPT_ATTR, list(range(block.n_heads)))
                setattr(core, KV_KEPT_ATTR, list(range(block.n_kv_heads)))
                setattr(core, ORIGINAL_ATTR, block.n_heads)
            core.register_forward_pre_hook(_t5_bias_hook(source), with_kwargs=True)
            core._headlab_t5_hooked = True


def _t5_bias_hook(source: nn.Module):
    def hook(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        kept = getattr(module, KEPT_ATTR)
        q_len = hidden.shape[1]
        memory = kwargs.get("key_value_states")
        if memory is not None:
            bias = hidden.new_zeros(1, len(kept), q_len, memory.shape[1])
        else:
            cache = cache_argument(kwargs)
            past = cache.get_seq_length(module.layer_idx) if cache is not None else 0
            full = source.compute_bias(q_len, past + q_len, device=hidden.device, past_seen_tokens=past)
            bias = full[:, kept]  # [1, kept heads, q_len, k_len]
        kwargs["position_bias"] = bias
        return args, kwargs

    return hook


# -- public API ----------------------------------------------------------------------------
def prune_heads(model: nn.Module, heads: HeadSpec) -> dict[tuple[str, int], list[int]]:
    """Remove ``heads`` (``{(kind, layer): [head, ...]}``, current numbering) in place.

    Validates everything before changing anything. Returns the heads each pruned block now
    keeps, in the model's original numbering.
    """
    blocks = attention_blocks(model)
    spec = validate_heads(blocks, heads)
    plans = []
    for key, removed in spec.items():
        block = find_block(blocks, *key)
        keep = [h for h in range(block.n_heads) if h not in set(removed)]
        plans.append((block, keep, *_kv_plan(block, keep)))
    blocks = _prune_blocks(model, plans)
    return {b.key: list(getattr(b.core, KEPT_ATTR)) for b in blocks if getattr(b.core, KEPT_ATTR, None) is not None}


def pruning_record(model: nn.Module) -> dict:
    """What was pruned, in original numbering: the content of ``headlab_pruning.json``."""
    blocks = {}
    for block in attention_blocks(model):
        kept = getattr(block.core, KEPT_ATTR, None)
        if kept is None:
            continue
        blocks.setdefault(block.kind, {})[str(block.layer)] = {
            "n_heads": getattr(block.core, ORIGINAL_ATTR),
            "kept_heads": list(kept),
            "kept_kv_heads": list(getattr(block.core, KV_KEPT_ATTR)),
        }
    return {"format": FORMAT_VERSION, "blocks": blocks}


def apply_pruning_record(model: nn.Module, record: Mapping, source: str = PRUNING_FILE) -> None:
    """Prune a freshly built (unpruned) model exactly as ``record`` says."""
    if record.get("format") != FORMAT_VERSION:
        raise HeadlabError(f"{source}: unsupported format {record.get('format')!r} (expected {FORMAT_VERSION})")
    blocks = attention_blocks(model)
    plans = []
    try:
        for kind, layers in record["blocks"].items():
            for layer, entry in layers.items():
                block = find_block(blocks, kind, int(layer))
                keep, kv_keep = [int(h) for h in entry["kept_heads"]], [int(h) for h in entry["kept_kv_heads"]]
                if entry["n_heads"] != block.n_heads or any(not 0 <= h < block.n_heads for h in keep) \
                        or any(not 0 <= h < block.n_kv_heads for h in kv_keep):
                    raise HeadlabError(
                        f"{source}: {kind} layer {layer} does not fit the model "
                        f"({block.n_heads} heads, {block.n_kv_heads} key/value heads)"
                    )
                groups = len(keep) // len(kv_keep) if kv_keep and len(keep) % len(kv_keep) == 0 else 1
                plans.append((block, keep, kv_keep, groups))
    except (KeyError, TypeError, ValueError) as error:
        raise HeadlabError(f"{source}: malformed pruning record ({error!r})") from error
    _prune_blocks(model, plans)


def _prune_blocks(model: nn.Module, plans: list[tuple]) -> list[AttentionBlock]:
    """Prune each ``(block, keep, kv_keep, groups)``; the model's attention blocks afterwards."""
    for block, keep, kv_keep, groups in plans:
        _prune_block(model, block, keep, kv_keep, groups)
    blocks = attention_blocks(model)
    if blocks and blocks[0].family.name == "t5":
        _install_t5_bias_hooks(model, blocks)
    return blocks


# Attributes of an attention module that hold a head count or a width derived from one.
_WIDTH_ATTRS = ("all_head_size", "inner_dim", "split_size")


def _core_path(block: AttentionBlock) -> str:
    return block.name + (f".{block.family.core}" if block.family.core else "")


def _projection(module: nn.Module) -> tuple[str, int, int]:
    if isinstance(module, nn.Linear):
        return "linear", module.in_features, module.out_features
    return "conv1d", int(module.weight.shape[0]), int(module.nf)  # Conv1D: weight [in, out]


def pruning_plan(model: nn.Module) -> dict:
    """What :mod:`headlab.portable_code` needs to rebuild ``model``'s pruned shapes from the
    original config: ``projections`` (path -> (kind, in, out)), ``attributes`` (attention
    module path -> head counts and widths) and ``no_head`` (layers left with no head)."""
    names = {id(module): name for name, module in model.named_modules()}
    plan: dict = {"projections": {}, "attributes": {}, "no_head": {}}
    for block in attention_blocks(model):
        core = block.core
        if getattr(core, KEPT_ATTR, None) is None:
            continue
        for module in (block.q, block.k, block.v, block.qkv, block.o):
            if module is not None:
                plan["projections"][names[id(module)]] = list(_projection(module))
        attrs = {}
        for name in (*block.family.head_count_attrs, *_WIDTH_ATTRS, block.family.kv_groups_attr):
            if name and isinstance(getattr(core, name, None), int) and not isinstance(core, ZeroHeadAttention):
                attrs[name] = int(getattr(core, name))
        if attrs:
            plan["attributes"][_core_path(block)] = attrs
        if isinstance(core, ZeroHeadAttention):
            plan["no_head"][_core_path(block)] = [core.o_name, core.n_outputs, core.d_head]
    return plan


def save_pruned(model: nn.Module, path: str | os.PathLike) -> Path:
    """Write standard safetensors weights, the config and ``headlab_pruning.json``.

    The directory also loads with plain transformers (:func:`headlab.portable.make_portable`):
    a standard config where one can state the pruned heads, else ``trust_remote_code=True``
    with a small module saved beside the weights. How is recorded under ``portable``.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise HeadlabError(f"{path}: exists and is not a directory")
    model.save_pretrained(path, safe_serialization=True)
    record = pruning_record(model)
    record["portable"] = make_portable(model, path, pruning_plan(model))
    atomic_write_text(path / PRUNING_FILE, json.dumps(record, indent=1) + "\n")
    readable_as_umask_allows(path)
    return path


def load_pruned(path: str | os.PathLike, model_class: type | None = None, *, trust_remote_code: bool = False,
                record: Mapping | None = None, **config_overrides) -> nn.Module:
    """Rebuild a model written by :func:`save_pruned`: build from config, prune, load weights.

    Weights are read with safetensors only; no code from the directory is run (the config is
    read with ``trust_remote_code`` as given, False by default). ``record`` stands in for a
    missing headlab_pruning.json (:func:`headlab.checkpoint.record_from_weights`). The record is
    checked against the weights' shapes, and every tensor must load: none missing, none left over.
    """
    from headlab import checkpoint  # reads and checks the directory (complete or refused)

    path = Path(path)
    record_path = path / PRUNING_FILE
    source = str(record_path)
    if record is not None:
        source = f"{path} (heads read from the weights' shapes)"
    elif not record_path.is_file():
        raise HeadlabError(f"{path}: no {PRUNING_FILE}; is this a directory written by save_pruned?")
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
    model = checkpoint.build_model(model_class, config, path)
    apply_pruning_record(model, record, source)
    checkpoint.check_fits_weights(model, shapes, source)

    state = checkpoint.read_weights(path)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as error:
        raise HeadlabError(f"{path}: weights do not match {PRUNING_FILE}: {error}") from error
    model.tie_weights()
    loaded = {p.data_ptr() for name, p in model.state_dict().items() if name in state}
    # Missing is fine for tied weights and for what the class itself rebuilds (sinusoidal tables).
    rebuilt = getattr(model, "_keys_to_ignore_on_load_missing", None) or []
    untied = [
        name for name in missing
        if model.state_dict()[name].data_ptr() not in loaded and not any(re.search(p, name) for p in rebuilt)
    ]
    checkpoint.check_complete(path, untied, unexpected)
    return model.eval()


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (tied weights counted once)."""
    seen, total = set(), 0
    for parameter in model.parameters():
        if parameter.data_ptr() not in seen:
            seen.add(parameter.data_ptr())
            total += parameter.numel()
    return total


__all__ = [
    "prune_heads", "save_pruned", "load_pruned", "pruning_record", "pruning_plan", "apply_pruning_record",
    "ZeroHeadAttention", "count_parameters", "PRUNING_FILE", "KINDS",
]
