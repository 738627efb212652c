"""The canonical view of a model's attention heads, whatever its family.

:func:`attention_blocks` returns one :class:`AttentionBlock` per attention layer, in forward
order, with its kind, layer, head counts and projection modules. Known ``model_type`` values
use the declarative tables of :mod:`headlab.adapters.families`; any other model is found at run
time from one probe forward pass through transformers' attention interface
(:mod:`headlab.adapters.discovery`). Either way every block is checked against its weight shapes, so
a model gets the right answer or a :class:`~headlab.errors.HeadlabError` naming what could not
be found, never a silent wrong one.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from headlab._version import require_transformers
from headlab.adapters.discovery import (
    SUB_CONFIGS,
    Discovered,
    ModelChanged,
    attention_configs,
    discover,
    maps,
    ran,
    selected_widths,
)
from headlab.adapters.families import (
    ATTENTION_SINKS,
    ATTENTION_SUBLAYERS,
    CAUSAL_ON_TOKEN_IDS,
    CONFIG_FAMILIES,
    CORE_CLASSES_REFUSED,
    DEPTH_MIXERS,
    FAMILIES,
    FLEX_REFUSED,
    FUSED_ATTENTION_CLASSES,
    HEAD_COUNT_HOLDERS,
    HEAD_MAPS,
    HEAD_TABLES,
    HEAD_VECTORS,
    KV_CHANNEL_CONVS,
    KV_DYNAMIC_CONVS,
    KV_DYNAMIC_MASKS,
    LATENT_ATTENTION,
    LINEAR_MIXERS,
    LOOPED_LAYERS,
    LRP_REFUSED,
    MERGED_ATTENTION,
    OUTPUT_GATES,
    OUTPUT_GATES_REFUSED,
    PROBE_FAILURES,
    PRUNING_REFUSED,
    QKV_ADAPTERS,
    QKV_APART,
    QKV_HEAD_ROWS,
    QKV_LAYOUTS,
    QKV_OUTPUT_GATES,
    SCORE_BIAS_ROWS,
    SINKS_SCALE_OUTPUT,
    SUB_NORMS,
    UNSUPPORTED,
    UNSUPPORTED_CONFIGS,
    Family,
    causal_on_token_ids,
    merged_attention_probs,
    rows_per_head,
)
from headlab.adapters.upstream import warn_upstream_bugs
from headlab.compiled import uncompiled
from headlab.errors import HeadlabError
from headlab.heads import KINDS
from headlab.portable_code import install_tie_rule

require_transformers()  # before any model is read: a transformers out of headlab's range, refused naming both versions

__all__ = ["AttentionBlock", "attention_blocks", "attention_configs", "find_block", "idle_blocks", "n_layers_per_kind",
           "sharing_groups", "Family", "FAMILIES", "family_for", "qkv_columns", "qkv_groups", "unsupported_reason",
           "config_value", "text_config", "head_input", "sub_norm", "refuse_mask_skip",
           "refuse_broken_flex", "flex_without_backward", "flex_attention_dropout"]


@dataclass(frozen=True)
class AttentionBlock:
    """One attention layer: what it is and where its projections live.

    ``q``, ``k`` and ``v`` are ``None`` when the family fuses them into ``qkv`` (GPT-2, GPT-NeoX, ...),
    whose column order is ``family.qkv_layout`` (:meth:`qkv_columns`).
    ``core`` is the module whose forward computes the attention probabilities.
    """

    kind: str
    layer: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    """Size of a head's output, its value vectors: the output projection reads ``n_heads * d_head`` (masking,
    capture of per-head outputs and the value rows and output columns pruning slices)."""
    name: str
    module: nn.Module
    core: nn.Module
    q: nn.Module | None
    k: nn.Module | None
    v: nn.Module | None
    o: nn.Module
    qkv: nn.Module | None
    family: Family
    application: int = 0
    """Which call of ``core`` in one pass this block is (shared layers: ALBERT runs one module at
    every depth; 0 otherwise)."""
    applications: int = 1
    """How many times ``core`` runs in one pass (1: a module of its own)."""
    scope: nn.Module | None = None
    """With shared layers: the module whose forward is one pass over every depth."""
    idle: bool = False
    """Its module did not run in the probe forward on token ids (:func:`headlab.adapters.discovery.ran`): a
    multimodal wrapper's vision or audio tower (Llava's, Mistral Large 4's Pixtral), a cross-attention given no
    encoder states. Nothing headlab computes from text reaches it: the measures leave it out, pruning refuses
    it (:func:`idle_blocks`)."""
    d_qk: int = 0
    """Size of a head's queries and keys, the query and key rows pruning slices: ``d_head`` unless the model's
    query/key heads are wider than its value heads (MiMo-V2-Flash: 192 and 128). 0 given: ``d_head``."""
    columns_after: int = 0
    """Columns of the output projection's input after the heads' ``n_heads * d_head`` (``Family.columns_after_heads``:
    ConvBERT's convolution heads' outputs), which the per-head hooks pass through untouched; 0 elsewhere."""

    def __post_init__(self) -> None:
        if not self.d_qk:
            object.__setattr__(self, "d_qk", self.d_head)

    @property
    def key(self) -> tuple[str, int]:
        return (self.kind, self.layer)

    @property
    def shared(self) -> bool:
        """One module computes this block and others (a head here is this depth's head only)."""
        return self.applications > 1

    def qkv_columns(self, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Columns of the fused projection holding the queries, keys and values, head by head."""
        if self.qkv is None:
            raise HeadlabError(f"{self.name}: no fused q/k/v projection")
        return qkv_columns(self.family.qkv_layout, self.n_heads, self.n_kv_heads, self.d_head, device,
                           qkv_groups(self.core, self.family))

    def __repr__(self) -> str:
        shared = f", application={self.application}/{self.applications}" if self.shared else ""
        qk = f", d_qk={self.d_qk}" if self.d_qk != self.d_head else ""
        return (
            f"AttentionBlock({self.kind}, layer={self.layer}, n_heads={self.n_heads}, "
            f"n_kv_heads={self.n_kv_heads}, d_head={self.d_head}{qk}, name={self.name!r}{shared})"
        )


PEFT_REFUSED = ("headlab reads, masks and prunes the plain projections, and the adapter's own weights "
                "(lora_A/lora_B...) would be left out or cut to the wrong heads. Merge the adapter into the "
                "weights first (peft's merge_and_unload()), or attach it after pruning")


def head_input(block: AttentionBlock) -> nn.Module:
    """The module whose input is the block's heads' outputs, concatenated: its norm over them where the family has one
    between the heads and the output projection (``Family.sub_norm``, BitNet's ``attn_sub_norm``: a head zeroed there
    is a head whose value rows are zero), else the output projection."""
    if block.family.sub_norm:
        return block.module.get_submodule(block.family.sub_norm)
    return block.o


def sub_norm(block: AttentionBlock) -> tuple[nn.Module, str] | None:
    """The block's norm between its heads and its output projection (``Family.sub_norm``) and its formula
    (:data:`~headlab.adapters.families.SUB_NORMS`), or None."""
    if not block.family.sub_norm:
        return None
    module = block.module.get_submodule(block.family.sub_norm)
    return module, SUB_NORMS[type(module).__name__]


def peft_layer(module: nn.Module) -> bool:
    """A PEFT tuner layer (LoRA, IA³...: peft's ``BaseTunerLayer``) wrapping ``module.base_layer``, told
    without importing peft (an optional package)."""
    return type(module).__module__.startswith("peft.") and isinstance(getattr(module, "base_layer", None), nn.Module)


def _unreadable(module: nn.Module, what: str) -> HeadlabError:
    if peft_layer(module):
        return HeadlabError(f"a PEFT adapter layer ({type(module).__module__}.{type(module).__name__}) wraps an "
                            f"attention projection: {PEFT_REFUSED}")
    return HeadlabError(f"cannot read the {what} width of {type(module).__name__}")


def is_linear(module: object) -> bool:
    """An ``nn.Linear``, or I-BERT's ``QuantLinear`` with quant_mode=False (transformers 5.24, ibert/quant_modules.py:
    weight ``[out, in]``, ``in_features``/``out_features``, its forward ``(F.linear(x, weight, bias), None)``);
    one with quant_mode=True is refused before any work (``families.UNSUPPORTED_CONFIGS``)."""
    return isinstance(module, nn.Linear) or (type(module).__name__ == "QuantLinear" and isinstance(module, nn.Module)
                                             and getattr(module, "quant_mode", None) is False
                                             and isinstance(getattr(module, "weight", None), torch.Tensor))


def out_features(module: nn.Module) -> int:
    """Output width of a Linear (or I-BERT's QuantLinear) or of transformers' Conv1D (whose weight is [in, out])."""
    if is_linear(module):
        return int(getattr(module, "out_features"))  # noqa: B009 (typed as Tensor | Module for mypy)
    if isinstance(module, nn.Conv1d) and module.kernel_size == (1,):  # SqueezeBERT's, over [batch, channels, seq]
        return module.out_channels
    if hasattr(module, "nf"):
        return int(getattr(module, "nf"))  # noqa: B009 (module.nf types as Tensor | Module for mypy)
    if type(module).__name__ == "HeadPoint":  # XLNet's identity points (headlab.adapters.xlnet): the heads' width
        return int(getattr(module, "out_features"))  # noqa: B009
    raise _unreadable(module, "output")


GROUPED_LINEARS = frozenset({"DeepseekV4GroupedLinear"})
"""Classes of transformers' grouped linear maps (their names) that an attention's heads meet as its output projection:
``weight`` ``[groups x out, in]`` applied to an input ``[.., groups, in]``, group g by its own ``out`` rows
(transformers 5.24, DeepSeek-V4's ``o_a_proj``: ``n_groups`` groups of ``in_features`` each). Their input, the heads'
outputs in head order, is ``groups x in`` wide: :func:`in_features` says so, and headlab's per-head hooks read it
with the group axis flattened (:func:`headlab.capture.register_head_output_hooks`)."""


def grouped(module: nn.Module) -> bool:
    """A grouped linear map of :data:`GROUPED_LINEARS` (its input ``[.., groups, in]``)."""
    return type(module).__name__ in GROUPED_LINEARS and isinstance(getattr(module, "n_groups", None), int)


def in_features(module: nn.Module) -> int:
    if grouped(module):  # DeepSeek-V4's o_a_proj: every group's input, the heads' outputs side by side
        return int(getattr(module, "in_features")) * int(getattr(module, "n_groups"))  # noqa: B009
    if is_linear(module):
        return int(getattr(module, "in_features"))  # noqa: B009 (typed as Tensor | Module for mypy)
    if isinstance(module, nn.Conv1d) and module.kernel_size == (1,):
        return module.in_channels
    if hasattr(module, "nf"):  # Conv1D: weight [in, out]
        return int(getattr(module, "weight").shape[0])  # noqa: B009 (module.weight types as Tensor | Module)
    if type(module).__name__ == "HeadPoint":
        return int(getattr(module, "in_features"))  # noqa: B009
    raise _unreadable(module, "input")


def _check_no_peft_layer(name: str, module: nn.Module) -> None:
    """An attention module holds no PEFT tuner layer: its q/k/v/output projections (and gates) are what
    headlab slices per head, masks at the output projection's input and reads for LRP and the norms."""
    for path, child in module.named_modules():
        if peft_layer(child):
            raise HeadlabError(f"{name}.{path}: a PEFT adapter layer ({type(child).__module__}."
                               f"{type(child).__name__}) wraps it: {PEFT_REFUSED}")


def qkv_groups(core: nn.Module, family: Family) -> int:
    """The groups of ``family``'s "mp-groups" layout in ``core`` (CodeGen's ``mp_num``); 1 for any other layout, and
    0 where the attribute is not a positive int (:func:`_make_block` refuses it)."""
    if family.qkv_layout != "mp-groups":
        return 1
    groups = getattr(core, family.qkv_groups_attr or "", None)
    return groups if isinstance(groups, int) and not isinstance(groups, bool) and groups > 0 else 0


def qkv_columns(layout: str, n_heads: int, n_kv_heads: int, d_head: int,
                device: torch.device | None = None, groups: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, k, v)`` column indices of a fused projection in ``layout`` (:data:`QKV_LAYOUTS`):
    ``q`` holds ``n_heads * d_head`` columns in head order, ``k`` and ``v`` ``n_kv_heads * d_head``.
    ``groups``: the "mp-groups" layout's (it needs as many key/value heads as query heads, and groups dividing them)."""
    within = torch.arange(d_head, device=device)
    heads = torch.arange(n_heads, device=device)[:, None]
    kv_heads = torch.arange(n_kv_heads, device=device)[:, None]
    if layout == "q|k|v":
        q = heads * d_head + within
        k = n_heads * d_head + kv_heads * d_head + within
        v = k + n_kv_heads * d_head
    elif layout == "per-head":  # [q_h | k_h | v_h] for each head
        q = heads * 3 * d_head + within
        k, v = q + d_head, q + 2 * d_head
    elif layout == "grouped":  # [q of the group | k | v] for each key/value head
        group = n_heads // n_kv_heads if n_kv_heads else 0
        stride = (group + 2) * d_head
        q = (heads // group) * stride + (heads % group) * d_head + within if group else heads * 0 + within
        k = kv_heads * stride + group * d_head + within
        v = k + d_head
    elif layout == "mp-groups":  # CodeGen: for each group of `per` heads, [q of its heads | their v | their k]
        if n_kv_heads != n_heads or groups <= 0 or n_heads % groups:
            raise HeadlabError(f"an mp-groups fused projection needs as many key/value heads as query heads, in "
                               f"groups dividing them: {n_heads} query, {n_kv_heads} key/value heads, {groups} groups")
        per = n_heads // groups
        q = (heads // per) * 3 * per * d_head + (heads % per) * d_head + within if per else heads * 0 + within
        v, k = q + per * d_head, q + 2 * per * d_head
    else:
        raise HeadlabError(f"unknown fused projection layout {layout!r}; expected one of {', '.join(QKV_LAYOUTS)}")
    return q.reshape(-1), k.reshape(-1), v.reshape(-1)


def _get(module: nn.Module, path: str | None) -> nn.Module | None:
    found: nn.Module | None = module
    for part in path.split(".") if path else ():
        found = getattr(found, part, None)
        if found is None:
            return None
    return found


# -- generic discovery ---------------------------------------------------------------------
# Projection naming schemes seen across transformers: (q, k, v, o, core).
_GENERIC_SCHEMES = (
    ("q_proj", "k_proj", "v_proj", "out_proj", ""),
    ("q_proj", "k_proj", "v_proj", "o_proj", ""),
    ("q", "k", "v", "o", ""),
    ("q_lin", "k_lin", "v_lin", "out_lin", ""),
    ("q_proj", "k_proj", "v_proj", "dense", ""),
    ("self.query", "self.key", "self.value", "output.dense", "self"),
)
_D_HEAD_ATTRS = ("head_dim", "attention_head_size", "key_value_proj_dim", "head_size", "d_head")
_CROSS_WORDS = ("encoder_attn", "cross", "encdec")


def _generic_candidates(model: nn.Module) -> Iterator[tuple[str, int, str, nn.Module, Family]]:
    """Yield ``(kind, layer, name, module, family)`` for modules that look like attention."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", type(model).__name__)
    for name, module in model.named_modules():
        for q, k, v, o, core in _GENERIC_SCHEMES:
            if not all(_get(module, path) is not None for path in (q, k, v, o)):
                continue
            core_module = _get(module, core) if core else module
            # a layer pruned to no head: its d_head (the value heads' size) before the original's head_dim, which
            # it keeps and which is the query/key heads' where they are wider (MiMo-V2-Flash)
            d_attr = next((a for a in (("d_head",) if _stand_in(core_module) else ()) + _D_HEAD_ATTRS
                           if isinstance(getattr(core_module, a, None), int)), None)
            layer = re.findall(r"(?:^|\.)(\d+)(?=\.|$)", name)
            if d_attr is None or not layer:
                continue
            family = Family(
                name=f"generic:{model_type}", patterns=(), q=q, k=k, v=v, o=o,
                d_head_attr=d_attr, core=core, probs_index=-1,
            )
            yield _guess_kind(name, module, config, model), int(layer[-1]), name, module, family
            break


def _discovered_candidates(model: nn.Module, idle: set[str] | None = None) -> list:
    """``(kind, layer, name, module, family)`` of every module that the probe forward
    (:func:`headlab.adapters.discovery.discover`) saw calling transformers' attention interface.

    A module that looks like attention by its projections' names but did not call the interface
    is refused, as is one whose heads' outputs do not reach the output projection as they are.
    Where no module calls the interface (transformers' own older modeling code without a table
    entry: Nystromformer, TrOCR...) or the probe cannot run (even with values in a meta-device model's place), a model
    class that transformers ships keeps the name-based discovery of :data:`_GENERIC_SCHEMES`;
    any other model is refused. ``idle`` receives the names of the blocks the probe forward did not run.
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None) or type(model).__name__
    # KDA layers (LINEAR_MIXERS): a hybrid's other mixer, named like attention but with no attention map
    named = [c for c in _generic_candidates(model) if type(c[3]).__name__ not in LINEAR_MIXERS]
    where = f"{type(model).__name__} (model_type {model_type!r})"
    try:
        # Inkling2's block attention residuals (DEPTH_MIXERS) attend over depth, not over tokens: no heads
        found = [item for item in discover(model) if type(_item_core(model, item)).__name__ not in DEPTH_MIXERS]
    except ModelChanged as error:
        raise HeadlabError(f"{where}: {error}") from None
    except HeadlabError as error:
        if model_type in OUTPUT_GATES_REFUSED:  # refused whatever the probe finds (its forward may fail in float64)
            raise HeadlabError(f"{where}: {OUTPUT_GATES_REFUSED[model_type]}") from None
        if model_type in PROBE_FAILURES:  # Inkling2 converted to float64 whole: why, not a guess by names
            raise HeadlabError(f"{where}: {error}: {PROBE_FAILURES[model_type]}") from None
        if named and _ships_with_transformers(model):
            return named
        raise HeadlabError(f"{where}: {'' if named else 'found no attention block: '}{error}") from None
    if not found and any(_stand_in(module) for module in model.modules()) and \
            not any(c[2] in ran(model) for c in named if not _stand_in(_core_of(c))):
        pass  # every layer that called the interface pruned to no head: their stand-ins listed below, as beside others
    elif not found:
        if named and _ships_with_transformers(model):
            for candidate in named:
                _check_returns_weights(model, where, candidate)
            if idle is not None:  # GIT's vision tower: token ids never run it, as a discovered model's (below)
                idle.update(candidate[2] for candidate in named if candidate[2] not in ran(model))
            return named
        if named:
            raise HeadlabError(f"{where}: {_outside(named[0])}")
        raise HeadlabError(
            f"{where}: found no attention block: no module of it called transformers' attention interface "
            "(ALL_ATTENTION_FUNCTIONS) in a probe forward pass, and no family table describes it: headlab finds the "
            "heads of a model it has no table for through that interface only")
    candidates = []
    for item in found:
        item_type = _table_type(model, model_type, item)
        item = _one_run(model, item_type, item)  # Inkling2-Loop's loop layers: each run a depth of its own
        if item.problem and item.gates and _known_gates(item_type, item):
            item = dataclasses.replace(item, problem=None)
        elif item.problem and item.gates and model_type in OUTPUT_GATES_REFUSED:
            item = dataclasses.replace(item, problem=f"an output gate from {', '.join(item.gates)}: "
                                                     f"{OUTPUT_GATES_REFUSED[model_type]}")
        item = _merged(model, item)
        if item.problem:
            raise HeadlabError(f"{where}: {item.name}{'.' + item.core if item.core else ''}: {item.problem}")
        candidates.append(_discovered(model, config, item_type, item))
    seen = {item.name for item in found} | {f"{item.name}.{item.core}" for item in found if item.core}
    candidates += _without_heads(model, config, model_type, seen | {c[2] for c in named})
    for candidate in named:
        name = candidate[2]
        if name in seen or any(s.startswith(name + ".") or name.startswith(s + ".") for s in seen):
            continue
        if _stand_in(_core_of(candidate)):  # pruned to no head: attends to nothing
            candidates.append(_emptied_gate_rows(model_type, candidate))
            continue
        if name not in ran(model):  # not run by this forward (a causal LM's unused cross-attention, a vision tower)
            candidates.append(_inner_linears(candidate))
            if idle is not None:
                idle.add(name)
            continue
        raise HeadlabError(f"{where}: {_outside(candidate)}")
    return candidates


def _inner_linears(candidate: tuple) -> tuple:
    """An idle block whose projections wrap a Linear as ``.linear`` (Gemma 4's vision tower: Gemma4ClippableLinear,
    a clamp around it) read through to it: its head counts are all headlab needs of a block nothing reaches."""
    module, family = candidate[3], candidate[4]
    paths = {field: getattr(family, field) for field in ("q", "k", "v", "o")}
    if any(path is None or _is_projection(_get(module, path)) for path in paths.values()):
        return candidate
    if not all(isinstance(_get(module, f"{path}.linear"), nn.Linear) for path in paths.values()):
        return candidate
    return (*candidate[:4], dataclasses.replace(family, **{f: f"{p}.linear" for f, p in paths.items()}))


def _is_projection(module: nn.Module | None) -> bool:
    return is_linear(module) or hasattr(module, "nf") or isinstance(module, nn.Conv1d) and module.kernel_size == (1,)


def _emptied_gate_rows(model_type: str, candidate: tuple) -> tuple:
    """A layer of a :data:`QKV_OUTPUT_GATES` or :data:`QKV_HEAD_ROWS` type pruned to no head: its stand-in keeps the
    gate's (or its own rows') projection, sliced to no row, which ``head_rows`` names, and its
    :data:`KV_CHANNEL_CONVS` sliced to no channel, which ``kv_convs`` names, so that a saved pruned model records their
    widths (as its q/k/v's); one of a :data:`QKV_ADAPTERS` type keeps its adapters' rows as pruning found them (the
    stand-in's ``stands_for_block``)."""
    module, family = candidate[3], candidate[4]
    recorded = getattr(_core_of(candidate), "stands_for_block", None)
    if model_type in QKV_ADAPTERS and isinstance(recorded, tuple) and len(recorded) == 2 \
            and isinstance(recorded[1], Family) and recorded[1].head_rows:  # Zamba 2's adapters, sliced to no row
        return (*candidate[:4], dataclasses.replace(family, head_rows=recorded[1].head_rows,
                                                    head_row_values=recorded[1].head_row_values))
    if isinstance(recorded, tuple) and len(recorded) == 2 and isinstance(recorded[1], Family) and family.q \
            and not _is_projection(_get(module, family.q)):
        # a name the scheme reads as a projection is a module around one (Inkling2's q_proj, an
        # Inkling2QueryProjection holding .linear): the family pruning found, which names the projections themselves
        return (*candidate[:4], recorded[1])
    gate = QKV_OUTPUT_GATES.get(model_type)
    rows = tuple((path, attrs) for path, attrs in (gate(module)[0] if gate else ())
                 if isinstance(getattr(module, path, None), nn.Module) and rows_per_head(module, attrs) is not None)
    # Inkling's and Inkling2's other parts per head, sliced to none: recorded, so that a saved model keeps their widths
    parts = _with_head_parts(dataclasses.replace(family, head_rows=rows), model_type, module, "")
    if parts == dataclasses.replace(family, head_rows=()):
        return candidate
    return (*candidate[:4], parts)


def _with_head_parts(family: Family, model_type: str, core: nn.Module, prefix: str) -> Family:
    """``family`` with the parts per head that the tables give ``core`` beside its q/k/v and gate (paths with
    ``prefix``): rows (:data:`QKV_HEAD_ROWS`, after ``family``'s; those of :data:`SCORE_BIAS_ROWS` as ``bias_rows``),
    tables (:data:`HEAD_TABLES`), count holders (:data:`HEAD_COUNT_HOLDERS`), depthwise and dynamic key/value
    convolutions (:data:`KV_CHANNEL_CONVS`, :data:`KV_DYNAMIC_CONVS`); each only where ``core`` has it."""
    own = QKV_HEAD_ROWS.get(model_type)
    rows = tuple((path, attrs) for path, attrs in (own(core) if own else ())
                 if isinstance(_get(core, path), nn.Linear) and rows_per_head(core, attrs) is not None)
    tables = tuple(path for path in HEAD_TABLES.get(model_type, ()) if _parameter(core, path) is not None)
    holders = tuple((path, role) for path, role in HEAD_COUNT_HOLDERS.get(model_type, ())
                    if isinstance(getattr(_get(core, path), "num_heads", None), int))
    convs = tuple((path, role) for path, role in KV_CHANNEL_CONVS.get(model_type, ())
                  if isinstance(_get(core, path), nn.Conv1d))
    dynamic = tuple((path, role) for path, role in KV_DYNAMIC_CONVS.get(model_type, ())
                    if isinstance(getattr(_get(core, path), "static_weight", None), torch.Tensor)
                    and isinstance(getattr(_get(core, path), "weight_proj", None), nn.Linear))
    return dataclasses.replace(
        family, head_rows=(*family.head_rows, *((prefix + path, attrs) for path, attrs in rows)),
        bias_rows=tuple(prefix + path for path, _ in rows if path in SCORE_BIAS_ROWS.get(model_type, ())),
        head_tables=tuple(prefix + path for path in tables),
        count_holders=tuple((prefix + path, role) for path, role in holders),
        kv_convs=tuple((prefix + path, role) for path, role in convs),
        kv_dynamic_convs=tuple((prefix + path, role) for path, role in dynamic))


# The tables discovery reads by model type (adapters.families): a wrapper's language model is listed under its own type
_TYPE_TABLES = (OUTPUT_GATES, LATENT_ATTENTION, QKV_OUTPUT_GATES, QKV_ADAPTERS, ATTENTION_SINKS, KV_DYNAMIC_MASKS,
                HEAD_VECTORS, ATTENTION_SUBLAYERS, QKV_HEAD_ROWS, KV_CHANNEL_CONVS)


def _table_type(model: nn.Module, model_type: str, item: Discovered) -> str:
    """The model type whose entries in discovery's tables (:data:`_TYPE_TABLES`) describe ``item``: the model's, or, for
    a wrapper whose own type none lists, that of the attention module's own config (its language model's: LFM3-VL's
    ``lfm3`` gate, Kimi-K2.5's ``deepseek_v3`` latent attention)."""
    if any(model_type in table for table in _TYPE_TABLES):
        return model_type
    module = model.get_submodule(item.name)
    core = module.get_submodule(item.core) if item.core else module
    own = getattr(getattr(core, "config", None), "model_type", None) or getattr(
        getattr(module, "config", None), "model_type", None)
    return own if isinstance(own, str) and any(own in table for table in _TYPE_TABLES) else model_type


def _merged(model: nn.Module, item: Discovered) -> Discovered:
    """A merged attention (:data:`MERGED_ATTENTION`) as discovery found it: its only problem that its forward returns
    the function's weights split in two (the decoder's columns, then the encoder's), which ``probs_index`` 1 and
    :func:`merged_attention_probs` read; its q/k/v the single projections the probe traced (the keys and values of
    both parts from the same two). Anything else discovery found wrong stays refused."""
    module = model.get_submodule(item.name)
    core = module.get_submodule(item.core) if item.core else module
    if type(core).__name__ not in MERGED_ATTENTION or item.problem is None or item.probs_index >= 0 or item.gates \
            or item.kv_from or len(item.sources) != 3 or any(len(paths) != 1 for paths in item.sources):
        return item
    if not item.problem.startswith("its forward does not return the attention function's weights"):
        return item
    q, k, v = (paths[0] for paths in item.sources)
    return dataclasses.replace(item, problem=None, q=q, k=k, v=v, probs_index=1)


def _one_run(model: nn.Module, model_type: str, item: Discovered) -> Discovered:
    """A module of a :data:`LOOPED_LAYERS` type that ran as many times as its config runs its decoder layer (a loop
    layer: once per pass) as one run shows it (:attr:`Discovered.once`), each run to be a block of its own depth
    (:func:`_looped`); any other item as it is (a module run more times than that stays refused)."""
    depths_of = LOOPED_LAYERS.get(model_type)
    if depths_of is None or item.once is None:
        return item
    order = depths_of(getattr(model, "config", None))
    numbers = [int(n) for n in re.findall(r"(?:^|\.)layers\.(\d+)(?=\.|$)", item.name)]
    if order is None or not numbers or order.count(numbers[-1]) != item.calls:
        return item
    problem, gates = item.once
    return dataclasses.replace(item, problem=problem, gates=gates, once=None)


def _item_core(model: nn.Module, item: Discovered) -> nn.Module:
    module = model.get_submodule(item.name)
    return module.get_submodule(item.core) if item.core else module


def _known_gates(model_type: str, item: Discovered) -> bool:
    """The output gate discovery saw comes from the projections :data:`OUTPUT_GATES` lists for this model
    type (relative to the attention module), the ones whose rows its ``head_rows`` slice per head."""
    prefix = f"{item.core}." if item.core else ""
    return model_type in OUTPUT_GATES and set(item.gates) == {prefix + path for path in OUTPUT_GATES[model_type]}


def _layer_number(model_type: str, name: str, module: nn.Module) -> int:
    """The layer of a discovered attention module: the last number in its path, or, for a type whose decoder
    layers hold several attentions (:data:`~headlab.adapters.families.ATTENTION_SUBLAYERS`), layer x count +
    the attention's place in it, checked against the module's own ``layer_idx`` where it has one."""
    numbers = [int(n) for n in re.findall(r"(?:^|\.)(\d+)(?=\.|$)", name)]
    if not numbers:
        raise HeadlabError(f"model_type {model_type!r}: attention module {name!r} has no layer index in its path")
    count = ATTENTION_SUBLAYERS.get(model_type)
    if count is None:
        return numbers[-1]
    where = f"{name} (model_type {model_type!r}, {count} attention modules per decoder layer)"
    if len(numbers) < 2 or numbers[-1] >= count:
        raise HeadlabError(f"{where}: its path does not hold its decoder layer and its place among that layer's "
                           "attentions (layers.N.self_attn.i)")
    layer = numbers[-2] * count + numbers[-1]
    own = getattr(module, "layer_idx", None)
    if isinstance(own, int) and own != layer:
        raise HeadlabError(f"{where}: its layer_idx is {own}, not {layer} (decoder layer {numbers[-2]} x {count} + "
                           f"{numbers[-1]}): headlab cannot tell which attention of the model it is")
    return layer


def _check_returns_weights(model: nn.Module, where: str, candidate: tuple) -> None:
    """A name-based block whose core ran in the probe pass returned per-head weights ``[batch, heads, q, k]``
    (heads x head size = the output projection's input), where capture reads them; else refused."""
    name, module, family = candidate[2], candidate[3], candidate[4]
    core = f"{name}.{family.core}" if family.core else name
    core_module, o = _core_of(candidate), _get(module, family.o)
    if _stand_in(core_module):  # pruned to no head: no weights to return
        return
    d_head = getattr(core_module, family.d_head_attr, None)
    returned = maps(model).get(core)
    if returned is None or o is None or not isinstance(d_head, int):  # did not run (unused cross-attention): as before
        return
    if not any(shape[1] * d_head == in_features(o) for shape in returned):
        raise HeadlabError(f"{where}: {core} ({type(core_module).__name__}) does not call transformers' attention "
                           "interface and returned no per-head attention weights [batch, heads, q, k] in a probe "
                           "forward pass, where headlab reads them: headlab cannot read its heads' attention")


def _outside(candidate: tuple) -> str:
    name, module = candidate[2], candidate[3]
    return (f"{name} ({type(module).__name__}) has query/key/value/output projections but did not call transformers' "
            "attention interface (ALL_ATTENTION_FUNCTIONS) in a probe forward pass, and no family table describes it: "
            "headlab cannot tell what its heads are")


def _tied_apart(core: nn.Module, item: Discovered) -> Discovered:
    """An attention of :data:`QKV_APART` (Inkling2's full-attention layers, whose queries, keys and values read three
    inputs): its q/k/v projections, which the probe did not tie, from the table (their widths checked as any
    block's: :func:`_make_block`); any other item as it is."""
    paths = QKV_APART.get(type(core).__name__)
    if paths is None or item.q is not None or not all(isinstance(_get(core, path), nn.Linear) for path in paths):
        return item
    prefix = f"{item.core}." if item.core else ""
    q, k, v = (prefix + path for path in paths)
    return dataclasses.replace(item, q=q, k=k, v=v)


def _discovered(model: nn.Module, config: Any, model_type: str, item: Discovered) -> tuple:
    module = model.get_submodule(item.name)
    if not re.search(r"(?:^|\.)\d+(?=\.|$)", item.name):
        raise HeadlabError(f"{type(model).__name__} (model_type {model_type!r}): attention module {item.name!r} has no "
                           "layer index in its path")
    layer = _layer_number(model_type, item.name, module.get_submodule(item.core) if item.core else module)
    item = _tied_apart(module.get_submodule(item.core) if item.core else module, item)
    family = Family(
        name=f"discovered:{model_type}", patterns=(), q=item.q, k=item.k, v=item.v, o=item.o or "",
        d_head_attr="", core=item.core, probs_index=item.probs_index, d_head=item.d_head, kv_heads=item.n_kv_heads,
        d_qk=item.d_qk if item.d_qk != item.d_head else 0, kv_from=item.kv_from or "",
        sub_norm=item.sub_norm or "",  # BitNet's attn_sub_norm (families.SUB_NORMS): heads read at its input
    )
    core = module.get_submodule(item.core) if item.core else module
    prefix = f"{item.core}." if item.core else ""
    if type(core).__name__ in MERGED_ATTENTION:  # T5Gemma 2's decoder: a map over its tokens, the encoder's share out
        family = dataclasses.replace(family, appended_keys=MERGED_ATTENTION[type(core).__name__],
                                     probs_reader=merged_attention_probs, extra_outputs=1)
    tabled = _tabled_fused(item, module, core)
    if tabled is not None:  # a tabled family's fused projection (ModernVBERT's ModernBERT): its layout, as the table's
        family = dataclasses.replace(tabled, name=family.name, patterns=(), probs_index=item.probs_index)
    if item.q is None and model_type in QKV_ADAPTERS:  # projections plus adapters (Zamba 2's): tied by the table
        family = _adapted(model_type, core, item, family)
    if item.q is None and model_type in LATENT_ATTENTION:
        rows = tuple((prefix + path, attrs) for path, attrs in LATENT_ATTENTION[model_type](core))
        vectors = tuple(prefix + path for path in HEAD_VECTORS.get(model_type, ())) if rows else ()
        family = dataclasses.replace(family, head_rows=rows, head_vectors=vectors,
                                     selection_argument=_selection_argument(core))
    if item.q is not None and model_type in QKV_OUTPUT_GATES:
        # an output gate over q/k/v heads (Beam, AFMoE...): its rows and entries per head, sliced with the heads
        rows, vectors = QKV_OUTPUT_GATES[model_type](core)
        if item.gates and not rows:  # a gate the table's reading of the forward does not place: pruning would miss it
            raise HeadlabError(f"{type(model).__name__} (model_type {model_type!r}): {item.name}: an output gate from "
                               f"{', '.join(item.gates)} that headlab.adapters.families.QKV_OUTPUT_GATES gives no "
                               "rows per head for (its forward differs from the one headlab read)")
        family = dataclasses.replace(family, head_rows=tuple((prefix + path, attrs) for path, attrs in rows),
                                     head_vectors=(*family.head_vectors, *(prefix + path for path in vectors)))
    if item.q is not None:  # Inkling's r_proj and convolutions, Inkling2's sinks, bias, norms: sliced with the heads
        family = _with_head_parts(family, model_type, core, prefix)
    for path in item.head_maps:  # NeoMME's exclusive_self_attention (HEAD_MAPS): one entry per head, its own groups
        holder = path[len(prefix):] if path.startswith(prefix) else path
        vector = HEAD_MAPS[type(module.get_submodule(path)).__name__][0]
        family = dataclasses.replace(family, head_vectors=(*family.head_vectors, f"{path}.{vector}"),
                                     group_holders=(*family.group_holders, holder))
    if model_type in LRP_REFUSED:  # parts that no LRP rule covers (none listed since session 42)
        family = dataclasses.replace(family, lrp_refused=LRP_REFUSED[model_type])
    if model_type in PRUNING_REFUSED:  # per-head parts that pruning does not slice (none listed since session 41)
        family = dataclasses.replace(family, prune_refused=PRUNING_REFUSED[model_type])
    # learned sinks, one per query head (MiMo-V2-Flash's full-attention layers have none: sinks is None there)
    sinks = tuple(prefix + path for path in ATTENTION_SINKS.get(model_type, ()) if _parameter(core, path) is not None)
    if sinks:
        family = dataclasses.replace(family, head_vectors=(*family.head_vectors, *sinks))
    # a dynamic mask per key/value head from all heads' values (Doge): sliced with the key/value heads
    dynamic = KV_DYNAMIC_MASKS.get(model_type)
    if dynamic and item.q is not None and isinstance(_get(core, dynamic[0]), nn.Linear) and \
            _parameter(core, dynamic[1]) is not None:
        family = dataclasses.replace(family, kv_dynamic_mask=tuple(prefix + path for path in dynamic))
    return _guess_kind(item.name, module, config, model), layer, item.name, module, family


def _adapted(model_type: str, core: nn.Module, item: Discovered, family: Family) -> Family:
    """A block whose queries, keys and values are projections plus adapters (:data:`QKV_ADAPTERS`): its projections
    and the adapters' rows per head tied, or the table's reason why not (``Family.refused``)."""
    prefix = f"{item.core}." if item.core else ""
    sources = tuple(tuple(p[len(prefix):] for p in paths if p.startswith(prefix)) for paths in item.sources)
    tied = QKV_ADAPTERS[model_type](core, sources)
    if isinstance(tied, str):
        return dataclasses.replace(family, refused=(
            "its queries, keys and values do not come from one projection each, and the layout of attention adapters "
            f"headlab reads for model_type {model_type!r} (headlab.adapters.families.QKV_ADAPTERS) does not fit: {tied}"))
    return dataclasses.replace(
        family, q=prefix + tied["q"], k=prefix + tied["k"], v=prefix + tied["v"],
        head_rows=tuple((prefix + path, attrs) for path, attrs in tied["head_rows"]),
        head_row_values=tuple(prefix + path for path in tied["head_row_values"]))


def _query_only(where: str, module: nn.Module, family: Family, d_head: int) -> tuple[nn.Module, int]:
    """A key/value-sharing layer's query projection (``family.kv_from``) and the width of its heads' outputs."""
    q = _get(module, family.q)
    if q is None:
        raise HeadlabError(f"{where}: missing its query projection {family.q}")
    d_qk = family.d_qk or d_head
    if out_features(q) % d_qk:
        raise HeadlabError(f"{where}: query projection width {out_features(q)} is not heads of size {d_qk}")
    return q, out_features(q) // d_qk * d_head


def _tabled_fused(item: Discovered, module: nn.Module, core: nn.Module) -> Family | None:
    """The :data:`FAMILIES` entry whose fused layout a discovered block has (:data:`FUSED_ATTENTION_CLASSES`: its
    attention class, transformers' own), where discovery tied no projection to the queries, keys and values, saw no
    output gate, and found the output projection where the entry has it, beside the entry's fused projection; else
    None (the block stays as discovery found it: pruning and LRP refused, as for any untied projection)."""
    family = FUSED_ATTENTION_CLASSES.get(type(core).__name__)
    if family is None or item.q is not None or item.gates or not type(core).__module__.startswith("transformers.models."):
        return None
    if item.core != family.core or item.o != family.o or not isinstance(_get(module, family.qkv), nn.Linear):
        return None
    return family


def _stand_in(module: nn.Module | None) -> bool:
    """A layer pruned to no head (:class:`headlab.surgery.ZeroHeadAttention`, or the portable module's
    ``NoHeadAttention``): it calls no attention function, so the probe forward cannot find it."""
    return type(module).__name__ in ("ZeroHeadAttention", "NoHeadAttention")


def _core_of(candidate: tuple) -> nn.Module | None:
    module, family = candidate[3], candidate[4]
    return _get(module, family.core) if family.core else module


def _without_heads(model: nn.Module, config: Any, model_type: str, seen: set[str]) -> list:
    """Layers pruned to no head that nothing else claimed. Their stand-in calls no attention function, so the probe
    forward cannot find them, and its projections may have names no scheme of :data:`_GENERIC_SCHEMES` knows (latent
    attention, a fused projection left with no row, CTRL's Wq/Wk/Wv/dense, ModernBERT-decoder's Wo); left out, the
    layers after one took its number, a table lost its row and the saved record its entry.
    :class:`headlab.surgery.ZeroHeadAttention` records the block's kind and family as pruning found them
    (``stands_for_block``), whose projections it adopted under the same names: listed by them. A stand-in loaded by
    plain transformers (the portable module's ``NoHeadAttention``) records nothing: listed with no head size, which
    :func:`_make_block` refuses, naming headlab's loader."""
    found = []
    for path, module in model.named_modules():
        if not _stand_in(module) or path in seen:
            continue
        recorded = getattr(module, "stands_for_block", None)
        if isinstance(recorded, tuple) and len(recorded) == 2:
            kind, family = recorded
            suffix = f".{family.core}" if family.core else ""  # BERT-style: the stand-in at attention.self
            if suffix and not path.endswith(suffix):
                continue
            name = path[:-len(suffix)] if suffix else path
            if name not in seen:
                found.append((kind, _layer_number(model_type, name, module), name, model.get_submodule(name), family))
        elif re.search(r"(?:^|\.)\d+(?=\.|$)", path):
            family = Family(name=f"discovered:{model_type}", patterns=(), q=None, k=None, v=None,
                            o=getattr(module, "o_name", None) or "", d_head_attr="")
            found.append((_guess_kind(path, module, config, model), _layer_number(model_type, path, module), path,
                          module, family))
    return found


def check_sink_eager(model_type: str | None, core: nn.Module) -> None:
    """A core of :data:`SINKS_SCALE_OUTPUT` has the module-level ``eager_attention_forward`` in its modeling module,
    which capture runs, through its own registered attention function, to return the weights its values get
    (:func:`headlab.capture.sink_scaled_eager`);
    a transformers version without it is refused here, before any work, not with an AttributeError mid-capture."""
    if model_type not in SINKS_SCALE_OUTPUT:
        return
    name = type(core).__module__
    if not callable(getattr(sys.modules.get(name), "eager_attention_forward", None)):
        raise HeadlabError(f"model_type {model_type!r}: its modeling module {name} has no eager_attention_forward, "
                           "the function whose softmax headlab rescales by the sinks' factor to read the weights "
                           "its values get: this transformers version is not supported for it")


def _ships_with_transformers(model: nn.Module) -> bool:
    """The model's class is transformers' own modeling code (not a hub repository's)."""
    return type(model).__module__.startswith("transformers.models.")


def _guess_kind(name: str, module: nn.Module, config: Any, model: nn.Module | None = None) -> str:
    lowered = name.lower()
    if "decoder" in lowered:
        last = lowered.rsplit(".", 1)[-1]
        return "dec_cross" if any(word in last for word in _CROSS_WORDS) else "dec_self"
    if "encoder" in lowered and getattr(config, "is_encoder_decoder", False):
        return "enc_self"
    if any(word in lowered.rsplit(".", 1)[-1] for word in _CROSS_WORDS):
        # BERT-style decoders (is_decoder, add_cross_attention): bert.encoder.layer.N.crossattention was
        # another dec_self of layer N (refused: "two modules claim"), found by the session-22 sweep; Mllama's
        # text model (no is_decoder) has cross_attn layers over the vision tower's states, which token ids never
        # run: taken for a dec_self, its layer's absence from capture was refused as a skipped layer (skip27B)
        return "dec_cross"
    causal = getattr(module, "is_causal", None)
    if _causal_on_token_ids(module, model):
        causal = True  # PaliGemma's language model: bidirectional over a token_type_ids prefix, which ids never give
    if causal is None and isinstance(getattr(module, "is_decoder", None), bool):
        causal = module.is_decoder  # XGLM's attention: is_decoder=True in its (causal) decoder layers
    if causal is None:
        causal = bool(getattr(config, "is_decoder", False)) or _causal_lm_without_flag(module, model)
    return "dec_self" if causal else "enc_self"


def _causal_on_token_ids(module: nn.Module, model: nn.Module | None) -> bool:
    """An attention of :data:`~headlab.adapters.families.CAUSAL_ON_TOKEN_IDS`' language models: its config says
    ``use_bidirectional_attention`` (the vision tower's attention says nothing of it)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return model_type in CAUSAL_ON_TOKEN_IDS and \
        getattr(getattr(module, "config", None), "use_bidirectional_attention", None) is True


MASK_ALWAYS_BUILT = (None, "eager", "flex_attention")
"""Attention implementations whose mask transformers always builds (5.24, masking_utils: ``eager_mask``, and
``flex_attention_mask``'s block mask from the causal mask function); SDPA's (``allow_is_causal_skip``) and flash's
leave a batch without padding to ``is_causal`` (:func:`refuse_mask_skip`)."""


def refuse_mask_skip(model: nn.Module, what: str) -> None:
    """Refuse to measure ``what``, before any work, on a model of :data:`~headlab.adapters.families.CAUSAL_ON_TOKEN_IDS`
    whose language model runs an attention implementation that may skip its mask (not :data:`MASK_ALWAYS_BUILT`):
    transformers skips the causal mask of a batch without padding and leaves causality to the attention's
    ``is_causal``, False there, so its SDPA forward attends bidirectionally over such a batch and causally over a
    padded one (transformers 5.24). Eager and flex attention (session 46: refused before, needlessly) build it. Called where
    measurements start (:func:`headlab.capture.eager_attention`, :func:`headlab.gates.refuse_gated`), beside
    :func:`headlab.adapters.eager_alibi.refuse_alibi_twice`."""
    config: Any = getattr(model, "config", None)
    if not causal_on_token_ids(config):
        return
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    implementation = getattr(text, "_attn_implementation", None)
    if implementation not in MASK_ALWAYS_BUILT:
        raise HeadlabError(
            f"{what}: {type(model).__name__} (model_type {config.model_type!r}) with attn_implementation="
            f"{implementation!r}: "
            "its language model's attention is not causal by its flag (use_bidirectional_attention, in PaliGemma "
            "for the image and prompt prefix that token_type_ids marks) but its mask is causal on token ids; "
            f"{implementation} skips that mask on a batch without padding, so the model would attend bidirectionally "
            "over such a batch and causally over a padded one, two models in one run: load it with "
            "attn_implementation='eager' (headlab's load_model does for this model type)")


def _broken_flex(config: Any) -> str | None:
    """What goes wrong with ``config``'s attention under flex attention (:data:`FLEX_REFUSED`), or None: not such a
    model type, not flex, or a transformers whose code no longer does it."""
    found = FLEX_REFUSED.get(getattr(config, "model_type", None) or "")
    if found is None or getattr(config, "_attn_implementation", None) != "flex_attention":
        return None
    what, marker = found
    modules = (f"transformers.models.{config.model_type}.modeling_{config.model_type}", _FLEX_MODULE)
    return what if any(marker in _source(name) for name in modules) else None


_FLEX_MODULE = "transformers.integrations.flex_attention"
"""transformers' flex attention function, whose source says what it refuses."""


def _loaded_with_flex(model: nn.Module) -> bool:
    """Whether any attention config of ``model`` runs ``attn_implementation="flex_attention"``."""
    return any(getattr(config, "_attn_implementation", None) == "flex_attention" for config in attention_configs(model))


def refuse_broken_flex(model: nn.Module, what: str) -> None:
    """Refuse to measure ``what``, before any work, on a model loaded with ``attn_implementation="flex_attention"``
    that transformers runs wrongly there (:data:`~headlab.adapters.families.FLEX_REFUSED`: Doge's is not causal, T5's
    fails on batches), or whose forward cannot run where it is (:func:`_flex_sinks_on_cpu`). Called where
    measurements start, beside :func:`refuse_mask_skip`."""
    for config in attention_configs(model):
        if (wrong := _broken_flex(config)) is not None:
            raise HeadlabError(
                f"{what}: {type(model).__name__} (model_type {config.model_type!r}) loaded with "
                f"attn_implementation='flex_attention': in this transformers version {wrong}; headlab reads its "
                "attention in eager mode, which would not be this model's: load it with attn_implementation='sdpa' "
                "(the default)")
    if _flex_sinks_on_cpu(model):
        raise HeadlabError(
            f"{what}: {type(model).__name__} has learned attention sinks and was loaded with attn_implementation="
            "'flex_attention', whose forward transformers runs only off a CPU (flex_attention_forward: 'Attention "
            "sinks cannot be run on CPU with flex attention'): every measure that runs the model's own forward would "
            "fail part-way; load it with attn_implementation='eager', or run it on a GPU")


def _flex_sinks_on_cpu(model: nn.Module) -> bool:
    """A model with learned attention sinks (:data:`~headlab.adapters.families.ATTENTION_SINKS`' ``sinks``), loaded
    with flex attention and on a CPU, where transformers' ``flex_attention_forward`` raises a ValueError (5.24: it
    asks flex for the log-sum-exp the sinks need only off a CPU; its source's test)."""
    if not _loaded_with_flex(model):
        return False
    parameter = next(model.parameters(), None)
    if parameter is None or parameter.device.type != "cpu":
        return False
    if not any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in model.modules()):
        return False
    return "Attention sinks cannot be run on CPU" in _source(_FLEX_MODULE)


def flex_without_backward(model: nn.Module, device: torch.device | None = None) -> str | None:
    """Why ``model``'s attention has no backward pass on ``device`` (default: where its parameters are), or None:
    loaded with ``attn_implementation="flex_attention"`` and on a CPU, where torch's FlexAttention raises
    NotImplementedError for a backward pass (torch 2.13, ``flex_attention._validate_device``: its source's test, so a
    torch that adds one is not refused). For the callers that differentiate the model's own forward (gradient
    importance, gated training), before any work."""
    if not _loaded_with_flex(model):
        return None
    parameter = next(model.parameters(), None)
    device = device if device is not None else parameter.device if parameter is not None else None
    if device is None or torch.device(device).type != "cpu" or not _flex_refuses_cpu_backward():
        return None
    return (f"{type(model).__name__} was loaded with attn_implementation='flex_attention', and torch's FlexAttention "
            "has no backward pass on a CPU (NotImplementedError in flex_attention's device check): load it with "
            "attn_implementation='sdpa' (the default), or run it on a GPU")


def flex_attention_dropout(model: nn.Module) -> str | None:
    """Why ``model`` cannot be trained under flex attention, or None: loaded with ``attn_implementation=
    "flex_attention"`` with attention dropout above 0, which its attention hands the attention function in training
    mode (``dropout=self.attention_dropout``, BERT's ``self.dropout.p``, BART's float ``self.dropout``), and which
    transformers' ``flex_attention_forward`` refuses with a ValueError (5.24: "does not support `dropout`") at the
    first training step. Read off the attention modules' own attributes, the ones those calls pass; for gated training,
    before any work."""
    if not _loaded_with_flex(model) or "does not support `dropout`" not in _source(_FLEX_MODULE):
        return None
    for block in attention_blocks(model):
        for name in ("attention_dropout", "dropout"):
            value = getattr(block.core, name, None)
            rate = value.p if isinstance(value, nn.Dropout) else value
            if isinstance(rate, (int, float)) and not isinstance(rate, bool) and rate > 0:
                return (f"{type(model).__name__} was loaded with attn_implementation='flex_attention' and its attention "
                        f"drops out weights in training ({block.name}.{name} = {rate:g}), which transformers' "
                        "flex_attention_forward refuses ('does not support `dropout`'): set the config's attention "
                        "dropout to 0, or load it with attn_implementation='sdpa' (the default)")
    return None


def _flex_refuses_cpu_backward() -> bool:
    """Whether this torch's FlexAttention refuses a backward pass on a CPU (read off its device check)."""
    try:
        from torch.nn.attention import flex_attention

        return "backward on CPU" in inspect.getsource(flex_attention._validate_device)
    except (ImportError, AttributeError, OSError, TypeError):
        return False


def _causal_lm_without_flag(module: nn.Module, model: nn.Module | None) -> bool:
    """A causal LM class (``...ForCausalLM``, not an encoder-decoder's) whose attention says nowhere
    whether it is causal (Doge's: no ``is_causal`` on the block or in it) and whose modeling code never
    reads ``is_decoder`` (BERT-style causal LMs are causal only with it): its self-attention is causal.
    Without this it was taken for an encoder's, and the model for a masked LM (its importance
    measures' objective the wrong one: the session-22 sweep)."""
    if model is None or getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return False
    if not type(model).__name__.endswith("ForCausalLM") or not _ships_with_transformers(model):
        return False
    if any(isinstance(getattr(m, "is_causal", None), bool) for m in module.modules()):
        return False  # BERT-style: the core's is_causal (False unless is_decoder) says it
    text = _source(type(model).__module__)
    return bool(text) and "is_decoder" not in text


def _source(module_name: str) -> str:
    """The source text of a loaded module ("" when it cannot be read)."""
    try:
        return inspect.getsource(sys.modules[module_name])
    except (KeyError, OSError, TypeError):
        return ""


def _table_candidates(model: nn.Module, family: Family) -> Iterator[tuple[str, int, str, nn.Module, Family]]:
    compiled = [(kind, re.compile(pattern), family) for kind, pattern in family.patterns]
    # another layout's kinds (LED's decoder): yielded with their own entry, as the model's own (entry is family)
    parts = [(kind, re.compile(pattern), part) for part in family.parts for kind, pattern in part.patterns]
    if family.never_fed:  # projections not tied: each head its own key and value, as many as the output's input
        untied = dataclasses.replace(family, name=f"{family.name} cross-attention", patterns=(), never_fed=(),
                                     towers=(), q=None, k=None, v=None, qkv=None)
        compiled += [(kind, re.compile(pattern), untied) for kind, pattern in family.never_fed]
    for tower_kind, tower_pattern, tower_o in family.towers:  # another class: its own output projection, head size
        tower = dataclasses.replace(family, name=f"{family.name} tower", patterns=(), never_fed=(), towers=(),
                                    q=None, k=None, v=None, qkv=None, o=tower_o, core="", head_count_attrs=())
        compiled.append((tower_kind, re.compile(tower_pattern), tower))
    for name, module in model.named_modules():
        for kind, pattern, part in parts:
            match = pattern.search(name)
            if match:
                yield kind, int(match.group(1)), name, module, part
        for kind, pattern, entry in compiled:
            match = pattern.search(name)
            if match and entry is not family:
                attrs = (family.d_head_attr,) if entry.name.endswith("cross-attention") else _D_HEAD_ATTRS
                d_head = next((getattr(module, a) for a in attrs if isinstance(getattr(module, a, None), int)), 0)
                output = _get(module, entry.o)
                heads = in_features(output) // d_head if d_head > 0 and output is not None else 0
                yield kind, int(match.group(1)), name, module, dataclasses.replace(entry, kv_heads=heads, d_head=d_head)
            elif match:
                yield kind, int(match.group(1)), name, module, family


def _fused_widths(where: str, module: nn.Module, core: nn.Module, family: Family, o: nn.Module,
                  d_head: int) -> tuple[nn.Module, int, int]:
    """A fused q/k/v projection and the widths of its query heads' and key/value heads' outputs (``o`` reads
    the query heads')."""
    qkv = _get(module, family.qkv)
    if qkv is None:
        raise HeadlabError(f"{where}: no fused projection {family.qkv!r}")
    # The output projection reads every query head: width n_heads * d_head; the fused projection
    # adds a key and a value per key/value head, whatever its layout.
    width, q_width = out_features(qkv), in_features(o)
    kv_width = (width - q_width) // 2
    if width - q_width != 2 * kv_width or kv_width < 0:
        raise HeadlabError(f"{where}: fused projection width {width} is not q ({q_width}) + 2 x key/value")
    if family.qkv_layout == "per-head" and kv_width != q_width:
        raise HeadlabError(f"{where}: a per-head [q|k|v] projection of width {width} needs as many key/value "
                           f"heads as query heads (output projection input {q_width})")
    if family.qkv_layout == "mp-groups":  # CodeGen's view(..., -1, 3 * embed_dim // mp_num)
        mp_groups = qkv_groups(core, family)
        if kv_width != q_width or not mp_groups or q_width % (mp_groups * d_head):
            raise HeadlabError(f"{where}: an mp-groups [q|v|k] projection of width {width} needs as many "
                               f"key/value heads as query heads (output projection input {q_width}), in "
                               f"{family.qkv_groups_attr}={getattr(core, family.qkv_groups_attr or '', None)!r} "
                               f"groups of whole heads of {d_head}")
    return qkv, q_width, kv_width


def _make_block(kind: str, layer: int, name: str, module: nn.Module, family: Family) -> AttentionBlock:
    where = f"{name} ({family.name})"
    core = _get(module, family.core) if family.core else module
    o = _get(module, family.o)
    if core is None or o is None:
        raise HeadlabError(f"{where}: no {'core ' + family.core if core is None else family.o!r} module")
    if type(core).__name__ in CORE_CLASSES_REFUSED:
        raise HeadlabError(f"{where}: {type(core).__name__}: {CORE_CLASSES_REFUSED[type(core).__name__]}")
    d_head = family.d_head or getattr(core, family.d_head_attr, None)
    # (read off the core, not the entry: GPT-1's entry gives a head size from the config, its stand-in none)
    if type(core).__name__ == "NoHeadAttention" and getattr(core, family.d_head_attr, None) is None:
        # A layer pruned to no head, loaded by transformers alone (the directory's pruned_heads.py): the
        # model does not know the heads' original numbering, which headlab's results are given in.
        raise HeadlabError(f"{where}: a layer pruned by headlab, loaded without headlab; load the pruned "
                           "directory with headlab.load_pruned(path) (or headlab.loading.load_model) to analyse it")
    if isinstance(d_head, int) and d_head <= 0:  # a config's negative head count: "no head size attribute" hid it
        raise HeadlabError(f"{where}: its head size ({family.d_head_attr}) is {d_head}, not a positive number; "
                           "check the head counts and widths in the model's config.json")
    if not isinstance(d_head, int):
        raise HeadlabError(f"{where}: no head size attribute {family.d_head_attr!r}")
    after = _columns_after(where, core, family)
    qkv: nn.Module | None
    if family.qkv:
        qkv, q_width, kv_width = _fused_widths(where, module, core, family, o, d_head)
        q = k = v = None
        if family.head_rows and q_width % d_head == 0:  # DeBERTa v1's position projections, viewed per head
            _check_head_rows(where, module, core, family, q_width // d_head)
    elif family.q is None:  # discovered, no projection tied to the queries/keys/values: the output's width
        qkv = q = k = v = None
        q_width, kv_width = in_features(o) - after, family.kv_heads * d_head
        if family.head_rows and not family.shared_kv:  # latent attention: each head its own key and value (the
            kv_width = q_width  # probe's count may be stale)
        elif family.shared_kv and not q_width:  # a layer pruned to no head (its stand-in): no key/value head read
            kv_width = 0
        if q_width % d_head == 0:
            _check_head_rows(where, module, core, family, q_width // d_head)
    elif family.kv_from:  # keys and values from another layer (Gemma 4's key/value sharing): the query's width
        qkv = k = v = None
        q, q_width = _query_only(where, module, family, d_head)
        kv_width = family.kv_heads * d_head
    else:
        qkv = None
        q, k, v = (_get(module, path) for path in (family.q, family.k, family.v))
        if q is None or k is None or v is None:
            raise HeadlabError(f"{where}: missing one of {family.q}, {family.k}, {family.v}")
        # a projection kept whole under a norm over all its heads, its heads selected after the norm (a pruned
        # OLMo 2): the width the attention reads
        narrowed = selected_widths(module)
        q_width = _attended_width(family, narrowed.get(id(q), out_features(q)), in_features(o) - after)
        kv_width = narrowed.get(id(k), out_features(k))
        if family.query_gate:  # [query | gate] per head: the heads' width is half of it
            if q_width % (2 * d_head):
                raise HeadlabError(f"{where}: query projection width {q_width} is not heads x [query | gate] of "
                                   f"size {d_head} each")
            q_width //= 2
        d_qk = family.d_qk or d_head
        if d_qk != d_head:  # query/key heads of d_qk, value heads of d_head: both counted in value widths below
            if family.query_gate or q_width % d_qk or kv_width % d_qk:
                raise HeadlabError(f"{where}: query width {q_width} and key width {kv_width} do not split into "
                                   f"query/key heads of size {d_qk} (value heads of size {d_head})")
            q_width, kv_width = q_width // d_qk * d_head, kv_width // d_qk * d_head
        if out_features(v) != kv_width:
            raise HeadlabError(f"{where}: key width {out_features(k)} (heads of {d_qk}) differs from value width "
                               f"{out_features(v)} (heads of {d_head})" if d_qk != d_head else
                               f"{where}: key width {kv_width} differs from value width {out_features(v)}")
        if family.head_rows and q_width % d_head == 0:  # an output gate's rows (QKV_OUTPUT_GATES)
            _check_head_rows(where, module, core, family, q_width // d_head)
    o_width = in_features(o) - after
    if q_width % d_head or kv_width % d_head or o_width != q_width:
        beyond = f" + {after} columns after the heads ({family.columns_after_heads})" if after else ""
        raise HeadlabError(
            f"{where}: projection widths do not split into heads of size {d_head} "
            f"(q {q_width}, k/v {kv_width}, output input {o_width}{beyond})"
        )
    n_heads, n_kv_heads = q_width // d_head, kv_width // d_head
    _check_head_vectors(where, module, family, n_heads)
    _check_head_biases(where, module, family, n_heads * d_head)
    if getattr(core, "pretraining_tp", 1) > 1 and getattr(core, "slow_but_exact", False):
        raise HeadlabError(f"{where}: slow_but_exact with pretraining_tp > 1 multiplies the output projection's "
                           "weight slice by slice, past the module headlab masks heads at; load the model with "
                           "slow_but_exact=False")
    if n_kv_heads and n_heads % n_kv_heads:
        raise HeadlabError(f"{where}: {n_heads} query heads do not group over {n_kv_heads} key/value heads")
    if family.kv_groups_attr and n_kv_heads:
        groups = getattr(core, family.kv_groups_attr, None)
        if groups is not None and groups != n_heads // n_kv_heads:
            raise HeadlabError(f"{where}: {family.kv_groups_attr}={groups} but weights give {n_heads}/{n_kv_heads}")
    return AttentionBlock(kind, layer, n_heads, n_kv_heads, d_head, name, module, core, q, k, v, o, qkv, family,
                          d_qk=family.d_qk or d_head, columns_after=after)


def _attended_width(family: Family, q_width: int, heads_width: int) -> int:
    """The query rows the attention reads: ``q_width``, or, of a query that pruning keeps whole (``Family.query_channels``:
    ConvBERT's, the kept heads' rows first), the first ``heads_width`` (the output projection's heads' columns)."""
    return min(q_width, heads_width) if family.query_channels else q_width


def _columns_after(where: str, core: nn.Module, family: Family) -> int:
    """How many columns of the output projection's input follow the heads' (``Family.columns_after_heads``), read
    off ``core``; 0 where the family has none."""
    if not family.columns_after_heads:
        return 0
    value: Any = core
    for name in family.columns_after_heads.split("."):  # a dotted path (ConvBERT's conv_out_layer.out_features)
        value = getattr(value, name, None)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise HeadlabError(f"{where}: no width {family.columns_after_heads!r} of the output projection's columns "
                           "after the heads' (the family's columns_after_heads)")
    return value


def _selection_argument(core: nn.Module) -> str | None:
    """GLM-MoE-DSA's attention takes the previous layer's top-k selection and returns its own (or that one)."""
    return "prev_topk_indices" if "prev_topk_indices" in inspect.signature(type(core).forward).parameters else None


def _check_head_rows(where: str, module: nn.Module, core: nn.Module, family: Family, n_heads: int) -> None:
    """Each of ``family.head_rows`` emits ``n_heads`` (the output projection's) heads' rows."""
    for path, attrs in family.head_rows:
        projection = _get(module, path)
        per_head = rows_per_head(core, attrs)
        names = [str(attr) for attr in attrs]
        if projection is None or per_head is None:
            raise HeadlabError(f"{where}: no projection {path!r} with per-head sizes {', '.join(names)}")
        if out_features(projection) != n_heads * per_head:
            raise HeadlabError(f"{where}: {path} emits {out_features(projection)} features, not the output "
                               f"projection's {n_heads} heads x {per_head} ({' + '.join(names)})")


def _check_head_vectors(where: str, module: nn.Module, family: Family, n_heads: int) -> None:
    """Each of ``family.head_vectors`` holds one entry per query head (``n_heads``, the output projection's)."""
    for path in family.head_vectors:  # Mistral Large 4's softmax_scaling, attention sinks
        vector = _parameter(module, path)
        if vector is None and not n_heads:  # a layer left with no head: its stand-in holds none (HY-V4's sinks)
            continue
        if vector is None or vector.dim() != 1 or vector.shape[0] != n_heads:
            shape = "none" if vector is None else f"shape {list(vector.shape)}"
            raise HeadlabError(f"{where}: {path} ({shape}) is not one entry per head of the output projection's "
                               f"{n_heads}, which pruning would slice with the heads")


def _check_head_biases(where: str, module: nn.Module, family: Family, width: int) -> None:
    """Each of ``family.head_biases`` holds one head size per query head (``width``: the output projection's input)."""
    for path, _ in family.head_biases:  # DeBERTa v1's q_bias, v_bias
        vector = _parameter(module, path)
        if vector is None and not width:  # a layer left with no head: its stand-in holds none
            continue
        if vector is None or vector.dim() != 1 or vector.shape[0] != width:
            shape = "none" if vector is None else f"shape {list(vector.shape)}"
            raise HeadlabError(f"{where}: {path} ({shape}) is not a bias of the output projection's width {width} "
                               "(its heads' features), which pruning would slice with the heads")


def _parameter(module: nn.Module, path: str) -> torch.Tensor | None:
    owner_path, _, name = path.rpartition(".")
    owner = _get(module, owner_path)
    value = getattr(owner, name, None) if owner is not None else None
    return value if isinstance(value, torch.Tensor) else None


_KIND_ORDER = {"enc_self": (0, 0), "dec_self": (1, 0), "dec_cross": (1, 1)}


def attention_blocks(model: nn.Module) -> list[AttentionBlock]:
    """One block per attention layer of ``model``, in forward order.

    Encoder layers come first; in the decoder each layer's self-attention precedes its
    cross-attention. Raises :class:`HeadlabError` when the model has no attention this
    adapter understands, or when what it found does not add up. A ``torch.compile`` wrapper's blocks are its
    model's (:func:`headlab.compiled.uncompiled`), named without ``_orig_mod.``.
    """
    model = uncompiled(model)
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    reason = unsupported_reason(model)
    if reason:
        raise HeadlabError(f"{type(model).__name__} (model_type {model_type!r}) is not supported: {reason}")
    warn_upstream_bugs(model)  # transformers' own forward computing another model (NLLB-MoE's experts, 5.24)
    family = family_for(config)
    try:
        install_tie_rule(model)  # a sparse attention's key selection the same for a sentence in any batch
    except ValueError as error:  # a model's own indexer that selects otherwise than by topk
        raise HeadlabError(f"{type(model).__name__} (model_type {model_type!r}) is not supported: {error}") from None
    if family is not None and family.install is not None:  # XLNet's points: modules where its forward had none
        family.install(model)
    if family is not None and family.applications is not None:
        return _shared_blocks(model, family)
    idle: set[str] = set()
    try:
        candidates = list(_table_candidates(model, family) if family else _discovered_candidates(model, idle))
    except HeadlabError as error:
        hint = None if family else _language_model_hint(model)
        if hint:
            raise HeadlabError(f"{error}. {hint}") from error
        raise
    if not candidates:
        layer_types = getattr(config, "layer_types", None)
        no_attention = isinstance(layer_types, list) and not any(
            "attention" in str(t) and "linear" not in str(t) for t in layer_types)  # Qwen3.5: Gated DeltaNets only
        table = "matching its table entry" + (
            f" (its config's layer_types, {sorted(set(map(str, layer_types or ())))}, hold no attention layer)."
            if no_attention else ".")
        raise HeadlabError(
            f"{type(model).__name__} (model_type {model_type!r}): found no attention block "
            + (table if family else
               "with q/k/v/output projections (looked for q_proj/k_proj/v_proj/out_proj|o_proj|dense, "
               "q/k/v/o, q_lin/k_lin/v_lin/out_lin and self.query/key/value with output.dense). "
               "Add an entry for it to headlab.adapters.families.FAMILIES.")
        )
    for candidate in candidates:
        _check_no_peft_layer(candidate[2], candidate[3])
    blocks = [_make_block(*candidate) for candidate in candidates]
    for block in blocks:
        if block.n_heads:
            check_sink_eager(model_type, block.core)
    if family is not None:  # tables run no probe: what they know never runs
        # a never_fed cross-attention is idle beside self-attention called enc_self too (TAPAS's crossattention:
        # TapasModel's layers attend bidirectionally whatever is_decoder says, and nothing feeds encoder states)
        idle |= _unfed_cross_attention(blocks) | {b.name for b in blocks if b.family.name in (
            f"{family.name} tower", f"{family.name} cross-attention")}
    blocks = [dataclasses.replace(b, idle=True) if b.name in idle and b.n_heads else b for b in blocks]
    blocks = _looped(model, model_type, blocks)  # Inkling2-Loop: a loop layer's module is a block at each depth
    blocks = _towers_numbered_after(model, blocks)
    blocks.sort(key=lambda b: (_KIND_ORDER[b.kind][0], b.layer, _KIND_ORDER[b.kind][1]))
    seen: dict[tuple[str, int], AttentionBlock] = {}
    for block in blocks:
        if block.key in seen:
            raise HeadlabError(f"two modules claim {block.kind} layer {block.layer}: {seen[block.key].name} and "
                               f"{block.name}")
        seen[block.key] = block
    return blocks


def _looped(model: nn.Module, model_type: Any, blocks: list[AttentionBlock]) -> list[AttentionBlock]:
    """A model whose forward runs some decoder layers several times (:data:`LOOPED_LAYERS`: Inkling2-Loop): its
    language model's blocks, one per decoder layer as discovery found them (numbered by their place in ``layers``),
    made one block per depth each runs at, in forward order, numbered by depth (transformers' ``output_attentions``
    lists one map per call, in that order); a module run at several depths is ALBERT's shared module there
    (``application``: its call in one pass of the text model, ``scope``). Other models' blocks as they are."""
    depths_of = LOOPED_LAYERS.get(model_type)
    if depths_of is None:
        return blocks
    where = f"{type(model).__name__} (model_type {model_type!r})"
    order = depths_of(getattr(model, "config", None))
    running = [b for b in blocks if not b.idle and b.kind == "dec_self"]
    by_layer = {b.layer: b for b in running}
    if order is None or len(by_layer) != len(running) or sorted(by_layer) != sorted(set(order)):
        raise HeadlabError(f"{where}: its attention modules (decoder layers {sorted(by_layer)}) are not the layers its "
                           f"config runs at each depth ({order}): headlab cannot number its loop's depths")
    counts = {index: order.count(index) for index in by_layer}
    calls: dict[int, int] = {}
    out = [b for b in blocks if all(b is not r for r in running)]
    for depth, index in enumerate(order):
        block = by_layer[index]
        if ".layers." not in block.name:
            raise HeadlabError(f"{where}: {block.name} is not in a list of decoder layers (layers.N)")
        scope = model.get_submodule(block.name[:block.name.rindex(".layers.")]) if counts[index] > 1 else None
        out.append(dataclasses.replace(block, layer=depth, application=calls.get(index, 0),
                                       applications=counts[index], scope=scope))
        calls[index] = calls.get(index, 0) + 1
    return out


def _towers_numbered_after(model: nn.Module, blocks: list[AttentionBlock]) -> list[AttentionBlock]:
    """Idle blocks (towers token ids never run) renumbered after the blocks text runs, where they would claim a
    layer number of their kind that another block claims: ModernVBERT's SigLIP tower beside its ModernBERT encoder
    (both ``enc_self`` layer 0...), Mllama's two vision stacks, Nemotron-3.5's two audio towers (before: refused,
    "two modules claim enc_self layer 0"). The blocks text runs keep their numbers, those every table, measure and
    head spec reads, as the text model alone has them; the kind's idle blocks follow them in module order, so that
    a table of the kind ends at the text's last layer (:func:`headlab.importance.common.block_scores` leaves idle
    blocks out). Where nothing clashes (Llava's tower: ``enc_self`` beside a ``dec_self`` LM) nothing changes; two
    blocks that both run and claim one number stay refused (by the caller)."""
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    out = [b for b in blocks if not b.idle]
    for kind in dict.fromkeys(b.kind for b in blocks):
        idle = [b for b in blocks if b.idle and b.kind == kind]
        running = {b.layer for b in out if b.kind == kind}
        layers = [b.layer for b in idle]
        if len(set(layers)) == len(layers) and not running & set(layers):
            out += idle
            continue
        start = max(running, default=-1) + 1
        idle.sort(key=lambda b: (order.get(b.name, len(order)), b.layer))
        out += [dataclasses.replace(b, layer=start + i) for i, b in enumerate(idle)]
    return out


def _unfed_cross_attention(blocks: list[AttentionBlock]) -> set[str]:
    """The cross-attention blocks of a table family's model that has no encoder (BartForCausalLM's
    ``encoder_attn``, a BERT-style decoder's ``crossattention`` with ``add_cross_attention``): they
    attend to encoder states, which the model's forward takes as an argument (``encoder_hidden_states``)
    and skips them without; headlab passes token ids only, and no block of the model computes
    such states. An encoder-decoder (an ``enc_self`` block) feeds its own cross-attention."""
    if any(b.kind == "enc_self" for b in blocks):
        return set()
    return {b.name for b in blocks if b.kind == "dec_cross"}


def _shared_blocks(model: nn.Module, family: Family) -> list[AttentionBlock]:
    """Shared layers (ALBERT): one block per application of a module, numbered by depth in forward
    order, as transformers' ``output_attentions`` lists them; ``block.application`` is the module's
    call within a pass that it is."""
    assert family.applications is not None
    pattern = re.compile(family.patterns[0][1])
    kind = family.patterns[0][0]
    found: dict[tuple[int, ...], tuple[str, nn.Module]] = {}
    for name, module in model.named_modules():
        match = pattern.search(name)
        if match:
            found[tuple(int(g) for g in match.groups())] = (name, module)
    order = family.applications(model.config)
    where = f"{type(model).__name__} ({family.name})"
    missing = sorted(set(order) - set(found))
    if not order or missing:
        raise HeadlabError(f"{where}: found no attention module {missing[0] if missing else ''} of its shared "
                           "layers that its config runs")
    counts = {position: order.count(position) for position in found}
    calls: dict[tuple[int, ...], int] = {}
    blocks = []
    for layer, position in enumerate(order):
        name, module = found[position]
        _check_no_peft_layer(name, module)
        scope_name = name[:name.index(family.scope)].rstrip(".") if family.scope in name else ""
        block = _make_block(kind, layer, name, module, family)
        blocks.append(dataclasses.replace(block, application=calls.get(position, 0), applications=counts[position],
                                          scope=model.get_submodule(scope_name)))
        calls[position] = calls.get(position, 0) + 1
    return blocks


def sharing_groups(blocks: list[AttentionBlock]) -> list[list[AttentionBlock]]:
    """The blocks one set of attention weights computes, in depth order, two or more to a group: the depths of
    one shared module (ALBERT, ``block.shared``: one core run at each) and layers whose own attention modules hold
    the same parameter tensors (Zamba's shared transformer, tied). Removing a head of such weights removes it at
    every depth of the group."""
    groups: list[list[AttentionBlock]] = []
    owner: dict[int, int] = {}
    for block in blocks:
        ids = {id(block.core), *(id(p) for p in block.module.parameters())}
        found = next((owner[i] for i in ids if i in owner), None)
        if found is None:
            found = len(groups)
            groups.append([])
        groups[found].append(block)
        owner.update(dict.fromkeys(ids, found))
    return [group for group in groups if len(group) > 1]


def _language_model_hint(model: nn.Module) -> str | None:
    """What to pass instead of a multimodal model (Qwen3_5ForConditionalGeneration) whose language
    model has a table entry that the generic discovery, looking at the whole model, cannot replace."""
    text = getattr(getattr(model, "config", None), "text_config", None)
    model_type = getattr(text, "model_type", None)
    # a table entry, or a type whose discovered layout a table vouches for (dots3-note's text model: its gate's and
    # latents' rows); before, only the first: Dots3NoteForConditionalGeneration was refused for its output gate as
    # if dots3_note_text were not supported
    if text is None or (family_for(text) is None and model_type not in OUTPUT_GATES and
                        model_type not in LATENT_ATTENTION):
        return None
    return (f"{type(model).__name__} is a multimodal model around a {model_type!r} language model, which "
            "headlab supports on its own: pass that causal LM (headlab.language_model_of(model) gives it, sharing the "
            "model's weights; headlab.loading.load_model(path) loads it from the checkpoint)")


def family_for(config: Any) -> Family | None:
    """The table entry for ``config``'s model type (None: generic discovery)."""
    model_type = getattr(config, "model_type", None) or ""
    if model_type in CONFIG_FAMILIES:
        return CONFIG_FAMILIES[model_type](config)
    return FAMILIES.get(model_type)


def text_config(config: Any) -> Any:
    """The config of the model text runs through: a composite wrapper's ``text_config`` (ModernVBERT, Llava,
    Mllama, Gemma 3, ...; transformers' ``get_text_config()``), or the config itself. Where it names several
    (e.g. a text encoder and a decoder) it cannot say which, and only the top level is read."""
    get = getattr(config, "get_text_config", None)
    if not callable(get):
        return config
    try:
        return get()
    except ValueError:
        return config


def config_value(config: Any, attr: str) -> Any:
    """``attr`` of ``config``, or of its text config where the top level has none: a wrapper such as
    ModernVBERT or Mllama keeps its special token ids only in ``text_config``. Where both have one the top
    level wins, as in transformers' ``GenerationConfig.from_model_config`` (the outer attributes first, the
    text config's where they are unset): it is what the wrapper's own generation pads and stops with."""
    value = getattr(config, attr, None)
    if value is None:
        text = text_config(config)
        if text is not config:
            value = getattr(text, attr, None)
    return value


def unsupported_reason(model_or_config: Any) -> str | None:
    """Why headlab refuses this model (its model type, or any sub-config's), or None."""
    config = getattr(model_or_config, "config", model_or_config)
    seen = [config] + [getattr(config, name, None) for name in SUB_CONFIGS]
    for sub in seen:
        model_type = getattr(sub, "model_type", None) or ""
        reason = UNSUPPORTED.get(model_type)
        if not reason and model_type in UNSUPPORTED_CONFIGS:
            reason = UNSUPPORTED_CONFIGS[model_type](sub)
        if reason:
            return reason
    return None


def idle_blocks(blocks: list[AttentionBlock], keys: Any = None) -> str | None:
    """The blocks (of ``keys``, a head spec's, when given) that token ids do not run (:attr:`AttentionBlock.idle`),
    described for a message ("enc_self layers 0, 1 (model.vision_tower...layers.0.attention, ...)"), or None."""
    idle = [b for b in blocks if b.idle and (keys is None or b.key in keys)]
    if not idle:
        return None
    by_kind: dict[str, list[int]] = {}
    for block in idle:
        by_kind.setdefault(block.kind, []).append(block.layer)
    names = ", ".join(b.name for b in idle[:2]) + (f" and {len(idle) - 2} more" if len(idle) > 2 else "")
    layers = "; ".join(f"{kind} {'layer' if len(ls) == 1 else 'layers'} {', '.join(map(str, ls))}"
                       for kind, ls in by_kind.items())
    return f"{layers} ({names})"


def find_block(blocks: list[AttentionBlock], kind: str, layer: int) -> AttentionBlock:
    """The block for ``(kind, layer)``, or an error that lists what exists."""
    for block in blocks:
        if block.kind == kind and block.layer == layer:
            return block
    if kind not in KINDS:
        raise HeadlabError(f"unknown attention kind {kind!r}; expected one of {', '.join(KINDS)}")
    layers = sorted(b.layer for b in blocks if b.kind == kind)
    if not layers:
        have = sorted({b.kind for b in blocks}, key=KINDS.index)
        raise HeadlabError(f"the model has no {kind} attention (it has {', '.join(have)})")
    raise HeadlabError(f"{kind} has no layer {layer} (layers {layers[0]}..{layers[-1]})")


def n_layers_per_kind(blocks: list[AttentionBlock]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for block in blocks:
        counts[block.kind] = max(counts.get(block.kind, 0), block.layer + 1)
    return counts
