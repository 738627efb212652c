"""The one place that registers hooks on a model.

Two seams, both taken without copying any modeling code:

* the input of each block's output projection, viewed as ``[batch, pos, n_heads, d_head]``:
  per-head outputs, where gates and masks act (Voita et al. 2019, Sec. 6.1:
  MultiHead = Concat_i(g_i * head_i) W^O);
* the output of each block's attention core in eager mode, which holds the attention
  probabilities ``[batch, n_heads, q_len, k_len]``;
* or, with :func:`stream_attention`, headlab's own attention function
  (:mod:`headlab.attention`, registered with transformers' ``AttentionInterface``), which hands
  the probabilities over a few query rows at a time and never holds a block's whole map.

Every context manager here removes its hooks and restores the model's attention
implementation (or training mode, :func:`eval_mode`) in ``finally``, so an exception inside
leaves the model as it was.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from headlab.adapters import (
    AttentionBlock,
    attention_blocks,
    attention_configs,
    check_sink_eager,
    grouped,
    head_input,
    refuse_broken_flex,
    refuse_mask_skip,
)
from headlab.adapters.eager_alibi import SWITCHED, alibi_once, refuse_alibi_twice
from headlab.adapters.families import ATTENTION_SINKS, SINKS_SCALE_OUTPUT
from headlab.attention import SINK_ATTRIBUTE, AttentionCall, AttentionChunk, ChunkSink, dispatches, register
from headlab.compiled import recompiling
from headlab.errors import HeadlabError
from headlab.options import checked_keywords

logger = logging.getLogger(__name__)

ProbsCallback = Callable[[AttentionBlock, torch.Tensor], None]
HeadOutputFn = Callable[[AttentionBlock, torch.Tensor], torch.Tensor]


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """``model.eval()`` inside (no dropout: the model as it is); each submodule's own mode back on
    exit, also on error (a model partly in training mode gets exactly that mix back)."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for module, training in modes:
            module.training = training


@checked_keywords()
@recompiling("switched the model to eager attention (eager_attention)")
@contextmanager
def eager_attention(model: nn.Module) -> Iterator[nn.Module]:
    """Run ``model`` with eager attention inside, the only path that returns probabilities.

    The implementation each config had (SDPA, flash, ...) is restored on exit, also on error.
    A Falcon with ALiBi computes inside what it computes outside (its SDPA's bias once, where transformers' eager adds
    it twice: :mod:`headlab.adapters.eager_alibi`); one loaded in eager mode is refused before any work.
    """
    if model.__dict__.get(SWITCHED):  # nested: the outer block's ALiBi hooks hold (SDPA ignores them: its mask only)
        with _attention_implementation(model, "eager"):
            yield model
        return
    refuse_alibi_twice(model, "reading attention probabilities")
    refuse_mask_skip(model, "reading attention probabilities")
    refuse_broken_flex(model, "reading attention probabilities")
    with _attention_implementation(model, "eager"), alibi_once(model):
        model.__dict__[SWITCHED] = True
        try:
            yield model
        finally:
            del model.__dict__[SWITCHED]


@contextmanager
def _attention_implementation(model: nn.Module, name: str) -> Iterator[None]:
    configs = attention_configs(model)
    previous = [config._attn_implementation for config in configs]
    try:
        _switch(model, configs, [name] * len(configs))
        yield
    finally:
        _switch(model, configs, previous)


def _switch(model: nn.Module, configs: list, names: list[str]) -> None:
    """Give each config its implementation: through transformers' ``set_attn_implementation``
    (it checks the name and reaches sub-models) where the model has it and all get the same one,
    and by setting the config attribute for whatever it did not reach (a model that cannot
    switch, a loose module, a config with its own implementation)."""
    setter = getattr(model, "set_attn_implementation", None)
    can_set = getattr(model, "_can_set_attn_implementation", None)
    if setter is not None and can_set is not None and len(set(names)) == 1 and can_set():
        setter(names[0])
    for config, name in zip(configs, names):
        if config._attn_implementation != name:
            config._attn_implementation = name


def _find_probs(block: AttentionBlock, output: Any) -> torch.Tensor:
    """The attention probabilities in a core module's output tuple, shape-checked."""
    items = output if isinstance(output, (tuple, list)) else (output,)  # GPT-1's attention returns a list
    index = block.family.probs_index
    candidates = [items[index]] if 0 <= index < len(items) else list(items)
    for item in candidates:
        if isinstance(item, torch.Tensor) and item.dim() == 4 and item.shape[1] == block.n_heads:
            return item
    raise RuntimeError(
        f"{block.name}: its forward returned no attention probabilities [batch, {block.n_heads}, q, k]; "
        "is it running in eager mode?"
    )


def _record_lengths(model: nn.Module, blocks: list[AttentionBlock], lengths: dict[str, int]) -> HookHandles:
    """Pre-hooks on the modules that pad the tokens before a block's core runs (``Family.padded_by``: Longformer's
    model, to a multiple of its window), recording into ``lengths[class name]`` the length each was called with."""
    handles = HookHandles()
    padders = {block.family.padded_by for block in blocks if block.family.padded_by}

    def record(module: nn.Module, args: tuple, kwargs: dict) -> None:
        tokens = kwargs.get("input_ids", args[0] if args else None)
        if tokens is None:
            tokens = kwargs.get("inputs_embeds")
        if tokens is None:
            raise HeadlabError(f"{type(module).__name__} was called with neither input_ids nor inputs_embeds: "
                               "headlab cannot tell the length its attention maps are padded from")
        lengths[type(module).__name__] = int(tokens.shape[1])

    for module in model.modules():
        if type(module).__name__ in padders:
            handles.append(module.register_forward_pre_hook(record, with_kwargs=True))
    return handles


def _cut(block: AttentionBlock, probs: torch.Tensor, lengths: dict[str, int]) -> torch.Tensor:
    """``probs`` cut back to the length before ``block.family.padded_by`` padded it (its padding is masked: what
    is cut holds no probability of a query of the input)."""
    if not block.family.padded_by:
        return probs
    if block.family.padded_by not in lengths:
        raise HeadlabError(f"{block.name}: its attention ran without {block.family.padded_by}'s forward, whose input "
                           "length headlab cuts its padded attention map back to")
    length = lengths[block.family.padded_by]
    return probs[:, :, :length, :length]


class Applications:
    """Which call of each shared attention module runs now (ALBERT runs one module at every depth:
    block ``(kind, layer)`` is its ``block.application``-th call in a pass, and a hook of that
    block acts on that call only). A pre-hook on each block's ``scope`` starts a pass, one on each
    shared core counts its calls (first among the core's pre-hooks). Nothing is registered for
    blocks of their own module."""

    def __init__(self, blocks: list[AttentionBlock]) -> None:
        self.running: dict[int, int] = {}
        self.handles = HookHandles()
        shared = [block for block in blocks if block.shared]
        try:
            for scope in {id(b.scope): b.scope for b in shared if b.scope is not None}.values():
                self.handles.append(scope.register_forward_pre_hook(self._start))
            for core in {id(b.core): b.core for b in shared}.values():
                self.handles.append(core.register_forward_pre_hook(self._count, prepend=True))
        except BaseException:
            self.handles.remove()
            raise

    def _start(self, module: nn.Module, args: tuple) -> None:
        self.running.clear()

    def _count(self, module: nn.Module, args: tuple) -> None:
        self.running[id(module)] = self.running.get(id(module), -1) + 1

    def runs(self, block: AttentionBlock) -> bool:
        """Whether the call of ``block.core`` under way is ``block``'s (always, for an unshared block)."""
        if not block.shared:
            return True
        call = self.running.get(id(block.core), -1)
        if not 0 <= call < block.applications:
            raise HeadlabError(f"{block.name}: a shared attention module ran {call + 1} times in one pass of "
                               f"{type(block.scope).__name__}, expected {block.applications}")
        return call == block.application


GATE_STACK = "_headlab_gate_stack"
"""Key in a model's ``__dict__`` of the gate sets attached to it (:mod:`headlab.gates`; read here, which it imports)."""


class AttentionRecord(dict):
    """``{(kind, layer): probs [batch, n_heads, q_len, k_len]}`` of the latest forward call.

    ``calls[(kind, layer)]`` counts the calls seen (several during generation). ``gates``: the gate sets attached to
    the model when the capture began (``headlab_gates``, ...: :func:`headlab.mask_heads`, ``attach_gates``), whose
    heads' outputs are scaled, so that every later layer's attention is the gated model's; ``masked``: the heads their
    constant gates switch off (``{(kind, layer): [head, ...]}``, as ``mask_heads`` took them). Both empty: the model's
    own attention.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[tuple[str, int], int] = {}
        self.gates: tuple[str, ...] = ()
        self.masked: dict[tuple[str, int], list[int]] = {}

    def note_gates(self, model: nn.Module) -> None:
        """Record the gate sets attached to ``model`` and the heads their constant gates hold at 0 (learnable or
        stochastic gates, and per-example ones, switch off no fixed head: named in ``gates`` only). Read from the
        gates' buffers, without calling them (a gate set may draw or need a batch)."""
        stack = model.__dict__.get(GATE_STACK)
        sets = dict(stack.sets) if stack is not None else {}
        self.gates = tuple(sets)
        self.masked = {}
        for gates in sets.values():
            buffers = dict(gates.named_buffers(recurse=False))  # ConstantGates keep one [n_heads] buffer per block
            for key in gates.n_heads:
                values = buffers.get(f"{key[0]}_{key[1]}")  # headlab.gates.block_name
                if values is not None and values.dim() == 1 and not any(True for _ in gates.parameters()):
                    off = sorted({*self.masked.get(key, []), *(values == 0).nonzero().flatten().tolist()})
                    if off:
                        self.masked[key] = off


def check_every_layer_runs(model: nn.Module, blocks: list[AttentionBlock], record: AttentionRecord) -> HookHandles:
    """Hooks on ``model`` that refuse a forward pass in which some blocks of a kind reported and
    others of that kind (with heads) did not: a layer the forward skips (Llama-style models run
    ``layers[:config.num_hidden_layers]``, so a config lowered after loading leaves the last layers
    out) would be missing from every statistic without a word. A kind none of whose blocks runs (a
    causal LM's unused cross-attention, an encoder run alone) is no such case."""
    # an idle block (a tower token ids never run, numbered after the text's blocks of its kind) is expected not to
    expected = [block for block in blocks if block.n_heads and not block.idle]
    before: dict[tuple[str, int], int] = {}

    def start(module: nn.Module, args: tuple) -> None:
        before.clear()
        before.update(record.calls)

    def check(module: nn.Module, args: tuple, output: Any) -> None:
        ran = {block.key for block in expected if record.calls.get(block.key, 0) > before.get(block.key, 0)}
        kinds = {kind for kind, _ in ran}
        skipped = [block for block in expected if block.kind in kinds and block.key not in ran]
        if not skipped:
            return
        config = getattr(model, "config", None)
        layers = getattr(config, "num_hidden_layers", None)
        of_kind = sum(block.kind == skipped[0].kind for block in expected)
        hint = (f" (its config says num_hidden_layers={layers}, and it holds {of_kind} {skipped[0].kind} layers: "
                "a forward that runs only that many)" if isinstance(layers, int) and layers < of_kind else "")
        raise HeadlabError(
            f"{type(model).__name__}: {len(skipped)} of its {len(expected)} attention blocks never ran in a forward "
            f"pass in which other blocks of their kind did: {', '.join(f'{b.kind} layer {b.layer}' for b in skipped[:4])}"
            f"{' ...' if len(skipped) > 4 else ''} ({skipped[0].name}){hint}; their heads would be left out of "
            "every statistic. Restore the layer count the model was built with, or remove the layers it skips")

    handles = HookHandles()
    if expected:
        handles.append(model.register_forward_pre_hook(start))
        handles.append(model.register_forward_hook(check))
    return handles


@checked_keywords()
@recompiling("hooked attention to read its probabilities (capture_attention)")
@contextmanager
def capture_attention(
    model: nn.Module,
    callback: ProbsCallback | None = None,
    *,
    blocks: list[AttentionBlock] | None = None,
    detach: bool = True,
) -> Iterator[AttentionRecord]:
    """Record the attention probabilities of every block during forward passes.

    Without ``callback`` the record maps ``(kind, layer)`` to the probabilities of the latest
    call. With ``callback(block, probs)`` nothing is kept: each block's probabilities go to the
    callback as soon as they exist, so corpus statistics can stream in constant memory.
    Inside :func:`headlab.mask_heads` (or with gates attached) the maps are the gated model's: the record names the
    gate sets and the heads switched off (:class:`AttentionRecord`'s ``gates`` and ``masked``).
    The model runs in eager mode inside and gets its own implementation back on exit. It also
    runs in evaluation mode inside (``model.eval()``, each module's own mode back on exit): in
    training mode the probabilities would be those after attention dropout (rows that do not sum
    to 1, zeros), not the model's attention.

    With learned attention sinks (``adapters.families.ATTENTION_SINKS``) the probabilities are the
    weights each head applies to its values, the sink's share left out (a row sums to less than 1):
    what GPT-OSS's eager returns, and, unlike ``output_attentions``, Granite-SWA's too
    (:data:`~headlab.adapters.families.SINKS_SCALE_OUTPUT`: its softmax times the scale it applies after).
    Where a layer appends keys of its own after the tokens' (``Family.appended_keys``: DeepSeek-V4's compressed
    key-value entries) the map is over the tokens' keys only, and their share is left out as a sink's is: a row
    sums to one less the mass on the appended keys and the sink (:func:`headlab.adapters.families.deepseek_v4_probs`).
    """
    from headlab.portable import check_pruned_numbering

    blocks = attention_blocks(model) if blocks is None else blocks
    check_pruned_numbering(model, blocks)  # a pruned directory loaded without headlab: its heads renumbered
    record = AttentionRecord()
    record.note_gates(model)  # maps of a model with heads switched off say so
    handles = HookHandles()
    applications: Applications | None = None

    def make_hook(block: AttentionBlock) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if block.n_heads == 0 or applications is not None and not applications.runs(block):
                return
            if block.family.probs_reader is not None:  # Longformer's band: the dense map built from it
                probs = _cut(block, block.family.probs_reader(module, args, kwargs, output), lengths)
            else:
                probs = _find_probs(block, output)
            if detach:
                probs = probs.detach()
            if not bool(torch.isfinite(probs).all()):
                # A NaN weight poisons every sum it enters (0 * NaN): refused, never a statistic of NaN,
                # and the hook runs in forward order, so this is the block where the NaN starts.
                raise HeadlabError(f"{block.kind} layer {block.layer}: " + nonfinite_probs_cause(
                    probs, _attention_mask(module, args, kwargs), SELF_FILLED_MASKS.get(type(module).__name__)))
            record.calls[block.key] = record.calls.get(block.key, 0) + 1
            if callback is not None:
                callback(block, probs)
            else:
                record[block.key] = probs

        return hook

    def ask_for_probs(argument: tuple[str, int]) -> Callable[..., tuple[tuple, dict]]:
        name, position = argument

        def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if name in kwargs or len(args) <= position:
                return args, {**kwargs, name: True}
            return (*args[:position], True, *args[position + 1:]), kwargs

        return pre_hook

    lengths: dict[str, int] = {}
    with eval_mode(model), eager_attention(model), _sink_weights_returned(blocks):
        try:
            applications = Applications(blocks)
            handles.extend(applications.handles)
            handles.extend(check_every_layer_runs(model, blocks, record))
            handles.extend(_record_lengths(model, blocks, lengths))
            for block in blocks:
                if block.family.probs_argument is not None:  # a core that returns probabilities when asked
                    handles.append(block.core.register_forward_pre_hook(
                        ask_for_probs(block.family.probs_argument), with_kwargs=True))
                handles.append(block.core.register_forward_hook(make_hook(block), with_kwargs=True))
            yield record
        finally:
            handles.remove()


ChunkCallback = Callable[[AttentionBlock, AttentionChunk], None]


def unregistrable(blocks: list[AttentionBlock]) -> list[AttentionBlock]:
    """The blocks whose attention cannot go through :mod:`headlab.attention` (empty: all can): those whose module
    does not dispatch through transformers' registry, those that append keys of their own to the tokens'
    (``Family.appended_keys``: DeepSeek-V4's compressed entries, which the function would count as keys), and those
    that hand it sinks of their own (:func:`own_sinks`: Inkling2's, which it does not implement)."""
    return [block for block in blocks if block.n_heads and (block.family.appended_keys or not dispatches(block.core)
                                                            or own_sinks(block))]


def own_sinks(block: AttentionBlock) -> bool:
    """Whether the block's attention hands the attention function sinks as ``sinks=`` (Inkling2's: one logit per head
    and query, from the layer's input), which headlab's function does not implement (its sinks are ``s_aux``)."""
    try:
        source = inspect.getsource(type(block.core).forward)
    except (OSError, TypeError):
        return False
    return "sinks=sinks" in source


def _unregistrable_reason(block: AttentionBlock) -> str:
    if block.family.appended_keys:
        return f"its attention appends {block.family.appended_keys} to the tokens' keys"
    if own_sinks(block):
        return "its attention has sinks (sinks=), which headlab's attention function does not implement"
    return "attention does not dispatch through transformers' AttentionInterface"


def not_streamable(model: nn.Module) -> str | None:
    """Why ``model``'s attention cannot run through headlab's attention function, or None where it
    can: a block that does not dispatch through transformers' registry (:func:`unregistrable`;
    :func:`stream_attention` would cut the whole map), or one that hands the function attention
    sinks (``s_aux``, GPT-OSS; ``sinks=``, Inkling2), which it refuses mid-forward. The engines that default to the
    function (the fused statistics, confidence) run the eager path instead."""
    blocks = attention_blocks(model)
    unable = unregistrable(blocks)
    if unable and unable[0].family.appended_keys:
        return (f"its attention appends {unable[0].family.appended_keys} to the tokens' keys ({unable[0].name}), "
                "which headlab's attention function would count as keys")
    if unable:
        return f"{_unregistrable_reason(unable[0])} ({unable[0].name})"
    for block in blocks:
        if _model_type(block) in ATTENTION_SINKS:  # sinks read: one logit per query head, as headlab's function takes them
            continue
        try:
            source = inspect.getsource(type(block.core).forward)
        except (OSError, TypeError):
            continue
        if "s_aux" in source:
            return f"its attention has sinks (s_aux, {block.name}), which headlab's attention function does not implement"
    return None


def _attention_mask(module: nn.Module, args: tuple, kwargs: dict) -> Any:
    """The ``attention_mask`` an attention module was called with (None where it took none)."""
    if "attention_mask" in kwargs:
        return kwargs["attention_mask"]
    try:
        return inspect.signature(module.forward).bind_partial(*args).arguments.get("attention_mask")
    except (TypeError, ValueError):
        return None


def spans(positions: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2, 5"``."""
    out: list[list[int]] = []
    for p in positions:
        if out and p == out[-1][1] + 1:
            out[-1][1] = p
        else:
            out.append([p, p])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in out)


def _where(bad: torch.Tensor) -> str:
    """``bad`` [batch, query] as "batch row 2, queries 0-1; ..." (three rows at most)."""
    rows = [int(r) for r in bad.any(-1).nonzero().flatten()]
    text = "; ".join(f"batch row {r}, queries {spans(bad[r].nonzero().flatten().tolist())}" for r in rows[:3])
    return text + (f"; {len(rows) - 3} more rows" if len(rows) > 3 else "")


def nonfinite_probs_cause(probs: torch.Tensor, mask: Any, self_filled: str | None = None) -> str:
    """Why an attention block's weights ``probs`` [batch, heads, q, k] hold NaN or inf, read from the
    additive ``mask`` it was given: queries that may attend to no key (every mask entry -inf once in
    float32, the precision transformers' eager softmax takes) and nothing else, or something else.
    ``self_filled``: the block's entry in :data:`SELF_FILLED_MASKS` (its ``mask`` boolean, True masked)."""
    bad = (~probs.isfinite()).any(-1).any(1)
    where = _where(bad)
    masked = None  # [batch, heads or 1, queries, keys]: the keys each query may not attend to
    if self_filled and isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.dim() == 4:
        masked = mask[:, :, -probs.shape[-2]:, :probs.shape[-1]]
    elif isinstance(mask, torch.Tensor) and mask.is_floating_point() and mask.dim() == 4:
        # the float32 softmax sees the mask in float32: float64's lowest value is -inf there
        masked = mask[:, :, -probs.shape[-2]:, :probs.shape[-1]].to(torch.float32) == -torch.inf
    blind = None
    if masked is not None:
        try:
            blind = torch.broadcast_to(masked.all(-1).any(1), bad.shape)
        except RuntimeError:
            blind = None
    if self_filled and blind is not None and mask.dtype == torch.bool and not bool((bad & ~blind).any()) \
            and probs.dtype == torch.float64:
        return (f"transformers' own attention gives this model NaN weights for queries that may attend to no key "
                f"({where}: padding), with no head changed: {self_filled}, and a row of -inf is NaN, which a later "
                "layer's real rows read wherever they may attend to it (left padding). Load the model in float32, "
                "where it is finite, or use one sentence per batch (batch size 1)")
    if blind is None or bool((bad & ~blind).any()):
        return (f"the model's eager attention returned non-finite weights (NaN or inf) at {where}, queries that see "
                "keys: the model computes them itself (NaN or overflow in its input to this block, or in its "
                f"weights, in {probs.dtype}); nothing was recorded")
    own = (f"transformers' own eager attention (the path that returns weights) gives this model NaN weights for "
           f"queries that may attend to no key ({where}: padding), with no head changed: ")
    if mask.dtype == torch.float64:
        return own + ("its float64 attention mask holds float64's lowest value, which becomes -inf in the float32 "
                      "softmax of transformers' eager attention, and a row of -inf is NaN, which a later layer's real "
                      "rows read wherever they may attend to it (bidirectional attention, left padding). Load the model "
                      "in float32 (the mask stays finite there), or use the default "
                      "engine (fused), or one sentence per batch (batch size 1)")
    return own + ("its attention mask is -inf on every key of those rows, and a row of -inf is NaN in its eager "
                  "softmax, which a later layer's real rows read wherever they may attend to it (bidirectional "
                  "attention, left padding). Use the default engine (fused), or one "
                  "sentence per batch (batch size 1)")


@contextmanager
def float32_mask_floor(model: nn.Module) -> Iterator[None]:
    """Additive float64 attention masks raised to float32's lowest number, so that a row whose
    keys are all masked stays finite in a float64 model.

    transformers fills a mask with the lowest number of the model's precision, and its eager
    attention takes the softmax in float32: float64's lowest number becomes -inf there, and a
    query that may attend to no key at all (a padding position: left padding, or a sliding window)
    gets NaN probabilities, which reach every later value of its batch row (0 * NaN). In the model's
    own float32 such a row is finite (uniform over masked keys, never read). Every other row is
    unchanged to the bit: its masked scores are far below float32's range either way, and ``exp``
    of them is exactly zero."""
    lowest = torch.finfo(torch.float32).min

    def raise_floor(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dtype == torch.float64:
            return args, {**kwargs, "attention_mask": mask.clamp(min=lowest)}
        return None

    handles = HookHandles()
    try:
        for module in model.modules():
            handles.append(module.register_forward_pre_hook(raise_floor, with_kwargs=True))
        yield
    finally:
        handles.remove()


SELF_FILLED_MASKS = {
    # transformers 5.24, models/mpt/modeling_mpt.py: attention_scores.masked_fill(attention_mask,
    # torch.finfo(query_states.dtype).min), then softmax(attention_scores.float()); its mask is boolean, True masked
    "MptAttention": "MPT's attention (MptAttention) fills its masked scores with float64's lowest value itself, from a "
                    "boolean mask, and takes its softmax in float32, where that value is -inf",
}
"""Attention classes that fill masked scores themselves, from a boolean mask (True: masked), with the lowest value of the
model's precision and take their softmax in float32: in float64 a query that may attend to no key gets NaN, and
:func:`float32_mask_floor`, which floors the additive masks handed to attention, does not reach it."""


def _model_type(block: AttentionBlock) -> str | None:
    return getattr(getattr(block.core, "config", None), "model_type", None)


SINK_EAGER = "headlab_sink_eager"
"""The name under which :func:`sink_scaled_eager` (and transformers' eager mask builder) is registered."""


def sink_scaled_eager(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                      **kwargs: Any) -> tuple:
    """The eager attention of ``module``'s own modeling module (the default its forward hands
    ``ALL_ATTENTION_FUNCTIONS.get_interface``), and, for a core of
    :data:`~headlab.adapters.families.SINKS_SCALE_OUTPUT` (Granite-SWA: the softmax without the sink, the output
    scaled by ``sigmoid(lse - sink)`` after), the weights its values get in place of its weights: that softmax
    times the scale, computed as it computes it (transformers 5.24, granite_swa ``eager_attention_forward``).
    The output is eager's, untouched."""
    import sys

    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if not callable(eager):  # refused by check_sink_eager before any work; a module sharing the config here
        raise HeadlabError(f"{type(module).__name__}: its modeling module {type(module).__module__} has no "
                           "eager_attention_forward, the function headlab's sink-scaled eager runs")
    output, probs = eager(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    sinks = getattr(module, "sinks", None)
    if probs is None or sinks is None or getattr(getattr(module, "config", None), "model_type", None) \
            not in SINKS_SCALE_OUTPUT:
        return output, probs
    keys = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)  # repeat_kv
    logits = torch.matmul(query, keys.transpose(2, 3)) * scaling
    if attention_mask is not None:
        logits = logits + attention_mask
    scale = (torch.logsumexp(logits, dim=-1) - sinks.view(1, -1, 1)).to(torch.float32).sigmoid()
    return output, probs * scale.unsqueeze(-1).to(probs.dtype)


_registered_functions: set[str] = set()


@contextmanager
def running_attention_function(configs: list[Any], name: str, function: Callable[..., Any]) -> Iterator[None]:
    """Inside, ``configs`` (a model's, each once) name ``name`` as their attention implementation, ``function``
    registered under it with transformers' ``AttentionInterface`` (once; its masks eager's, built as for "eager"),
    and back to what they named on exit. Only these configs change: a modeling module's ``eager_attention_forward``,
    which every model of the type reads, is left alone (another model's forward, in another thread, sees none of
    this). Used for the eager variants that return what eager does not (:func:`sink_scaled_eager`) or hold what LRP
    holds (``importance.shared_kv_rule``)."""
    if not configs:
        yield
        return
    if name not in _registered_functions:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, eager_mask

        AttentionInterface.register(name, function)
        AttentionMaskInterface.register(name, eager_mask)
        _registered_functions.add(name)
    previous = [config._attn_implementation for config in configs]
    try:
        for config in configs:
            config._attn_implementation = name
        yield
    finally:
        for config, before in zip(configs, previous):
            config._attn_implementation = before


@contextmanager
def _sink_weights_returned(blocks: list[AttentionBlock]) -> Iterator[None]:
    """Inside, the eager attention of every block of :data:`~headlab.adapters.families.SINKS_SCALE_OUTPUT`
    returns the weights its values get (:func:`sink_scaled_eager`), as GPT-OSS's eager does: their configs'
    attention implementation is :data:`SINK_EAGER`, registered with transformers' ``AttentionInterface``, and back
    to what it was on exit. Only this model's configs change: its modeling module's ``eager_attention_forward``,
    which every model of the type reads, is left alone (:func:`running_attention_function`)."""
    scaled = [b for b in blocks if _model_type(b) in SINKS_SCALE_OUTPUT and b.n_heads]
    for block in scaled:  # blocks read under another transformers module: refused before any switch
        check_sink_eager(_model_type(block), block.core)
        if not dispatches(block.core):
            raise HeadlabError(f"{block.name}: its attention ({type(block.core).__name__}) does not pick its "
                               "function from transformers' AttentionInterface, where headlab reads the weights "
                               "its values get after the sinks' scaling")
    configs: list[Any] = list({id(b.core.config): b.core.config for b in scaled}.values())
    with running_attention_function(configs, SINK_EAGER, sink_scaled_eager):
        yield


@recompiling("ran attention through headlab's function (stream_attention)")
@contextmanager
def stream_attention(
    model: nn.Module,
    callback: ChunkCallback,
    *,
    query_chunk: int,
    blocks: list[AttentionBlock] | None = None,
    scores: bool = False,
    reuse: bool = False,
    chunk_elements: int = 0,
    kernel: Callable[[AttentionBlock, AttentionCall], torch.Tensor | None] | None = None,
) -> Iterator[AttentionRecord]:
    """Hand every block's attention probabilities to ``callback(block, chunk)``, ``query_chunk``
    query rows at a time (an :class:`~headlab.attention.AttentionChunk`, rows in order, the last
    one with ``chunk.last``), while the model computes its own output from the same chunks.

    Inside, the model runs headlab's registered attention function; every attention module of
    the model computes in chunks, and only ``blocks`` (default: all) report. A model whose
    attention does not dispatch through transformers' ``AttentionInterface`` (or appends keys of its own,
    ``Family.appended_keys``: DeepSeek-V4) falls back to
    :func:`capture_attention` (logged): its blocks hand over the whole map as one chunk, cut
    into ``query_chunk`` rows afterwards, so the callback sees the same sequence of chunks.
    ``record.calls`` counts each block's forward calls; a block that was expected to report and
    did not (its module bypassed the registry) raises rather than leave a statistic silently short.
    The model runs in evaluation mode inside, as in :func:`capture_attention`.
    With ``scores`` the chunks carry the scores too (:attr:`AttentionChunk.scores`; not from the
    eager fallback).
    With ``reuse`` the callback promises to keep nothing of a chunk past its return (it copies
    what it keeps): the chunks of a call are then written into the same memory
    (:attr:`~headlab.attention.ChunkSink.reuse`), which saves a fresh allocation per chunk.
    With ``chunk_elements`` the chunks may have fewer rows than ``query_chunk`` on the CPU (as many
    as keep a chunk's weights within it: :attr:`~headlab.attention.ChunkSink.chunk_elements`); the
    callback must then take the rows each chunk has.
    With ``kernel`` a reporting block's attention calls go first to ``kernel(block, call)``
    (:attr:`~headlab.attention.ChunkSink.kernel`), which computes a call whole (it reports to no
    ``callback`` then) or returns None to leave it to the chunks.
    """
    if query_chunk < 1:
        raise HeadlabError(f"query chunk must be at least 1 row, got {query_chunk}")
    every = attention_blocks(model)
    blocks = every if blocks is None else blocks
    unable = unregistrable(every)
    if unable:
        why = _unregistrable_reason(unable[0])
        logger.warning("%s: %s (%s); falling back to eager capture (the whole [batch, heads, q, k] map per block)",
                       type(model).__name__, why, unable[0].name)

        def whole(block: AttentionBlock, probs: torch.Tensor) -> None:
            q_len = probs.shape[2]
            for start in range(0, q_len, query_chunk):
                stop = min(start + query_chunk, q_len)
                callback(block, AttentionChunk(probs[:, :, start:stop].float(), start, stop, q_len))

        with capture_attention(model, whole, blocks=blocks) as record:
            yield record
        return
    record = AttentionRecord()
    record.note_gates(model)
    sinks: list[tuple[AttentionBlock, ChunkSink]] = []
    reporting = {block.key for block in blocks}

    def make_callback(block: AttentionBlock) -> Callable[[AttentionChunk], None]:
        def on_chunk(chunk: AttentionChunk) -> None:
            if chunk.last:
                record.calls[block.key] = record.calls.get(block.key, 0) + 1
            callback(block, chunk)

        return on_chunk

    def make_kernel(block: AttentionBlock) -> Callable[[AttentionCall], torch.Tensor | None] | None:
        if kernel is None:
            return None

        def on_call(call: AttentionCall) -> torch.Tensor | None:
            output = kernel(block, call)
            if output is not None:
                record.calls[block.key] = record.calls.get(block.key, 0) + 1
            return output

        return on_call

    def make_check(block: AttentionBlock, sink: ChunkSink) -> Callable[..., None]:
        seen = [0]

        def check(module: nn.Module, args: tuple, output: Any) -> None:
            if not applications.runs(block):
                return
            seen[0] += 1
            if sink.calls != seen[0]:
                raise HeadlabError(f"{block.name}: its forward did not call the registered attention function; "
                                   "run without --query-chunk (eager capture)")

        return check

    def make_switch(block: AttentionBlock, sink: ChunkSink) -> Callable[..., None]:
        def switch(module: nn.Module, args: tuple) -> None:  # a shared core gets the sink of the depth it runs at
            if applications.runs(block):
                setattr(module, SINK_ATTRIBUTE, sink)

        return switch

    handles = HookHandles()
    applications = Applications([])
    # no dropout: as capture_attention; a model without an SDPA path gets the masks its eager code reads
    with eval_mode(model), _attention_implementation(model, register(not getattr(model, "_supports_sdpa", True))):
        try:
            applications = Applications(every)
            handles.extend(applications.handles)
            handles.extend(check_every_layer_runs(model, [b for b in every if b.key in reporting], record))
            for block in every:
                report = block.key in reporting and block.n_heads > 0
                sink = ChunkSink(query_chunk, make_callback(block) if report else None, scores=scores,
                                 reuse=reuse, chunk_elements=chunk_elements,
                                 kernel=make_kernel(block) if report else None, causal=block.kind == "dec_self")
                setattr(block.core, SINK_ATTRIBUTE, sink)
                if block.shared:
                    handles.append(block.core.register_forward_pre_hook(make_switch(block, sink)))
                sinks.append((block, sink))
                if report:
                    handles.append(block.core.register_forward_hook(make_check(block, sink)))
            yield record
        finally:
            handles.remove()
            for block, _ in sinks:
                if hasattr(block.core, SINK_ATTRIBUTE):
                    delattr(block.core, SINK_ATTRIBUTE)


class HookHandles(list):
    """Handles of hooks registered together; ``remove()`` takes them all off."""

    def remove(self) -> None:  # type: ignore[override]  # like a torch hook handle's remove()
        while self:
            self.pop().remove()


def register_head_output_hooks(blocks: list[AttentionBlock], fn: HeadOutputFn) -> HookHandles:
    """Let ``fn(block, heads)`` rewrite each block's per-head outputs before ``W^O``.

    ``heads`` is the input of the output projection viewed as ``[batch, pos, n_heads, d_head]`` (a time-first
    family's, ``[pos, batch, ...]``, transposed to it and back: ``Family.time_first``; a channels-first family's,
    ``[batch, heads x d, seq]``, likewise: ``Family.channels_first``);
    ``fn`` returns a tensor of the same shape. Works whatever attention implementation runs,
    since the concatenated head outputs always enter the output projection. Columns after the
    heads' (``AttentionBlock.columns_after``: ConvBERT's convolution heads) are passed through
    untouched, never shown to ``fn``. Blocks pruned to zero heads are left alone. A block of a
    shared module (ALBERT) acts at its own depth only.
    Call ``remove()`` on the result to take the hooks off.
    """
    handles = HookHandles()
    applications = Applications([])

    def rewrite(block: AttentionBlock, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``x``, the heads' outputs as the output projection reads them, rewritten by ``fn``."""
        if block.family.channels_first:  # SqueezeBERT's [batch, heads x d, seq]: fn sees (and returns) [b, s, h, d]
            heads = x.transpose(1, 2).reshape(x.shape[0], x.shape[2], block.n_heads, block.d_head)
            return fn(block, heads).reshape(x.shape[0], x.shape[2], x.shape[1]).transpose(1, 2)
        if grouped(module):  # DeepSeek-V4's o_a_proj: [batch, pos, groups, heads / groups x d], heads in order
            heads = x.reshape(*x.shape[:-2], block.n_heads, block.d_head)
            return fn(block, heads).reshape(x.shape)
        if x.dim() > 3 and not block.family.time_first:
            # streams stacked before the positions (ProphetNet's decoder: [batch, streams, pos, width]): fn sees every
            # stream's positions as positions of the row, [batch, streams x pos, n_heads, d_head]
            return fn(block, x.reshape(x.shape[0], -1, block.n_heads, block.d_head)).reshape(x.shape)
        heads = x.view(*x.shape[:-1], block.n_heads, block.d_head)  # [batch, pos, n_heads, d_head]
        if block.family.time_first:  # FSMT's [pos, batch, ...]: fn sees (and returns) it batch-first
            return fn(block, heads.transpose(0, 1)).transpose(0, 1).reshape(x.shape)
        return fn(block, heads).reshape(x.shape)

    def make_hook(block: AttentionBlock) -> Callable[..., tuple | None]:
        def pre_hook(module: nn.Module, args: tuple) -> tuple | None:
            if block.n_heads == 0 or not applications.runs(block):  # a shared module at another depth
                return None
            x = args[0]
            if block.columns_after:  # ConvBERT's [attention heads | convolution heads]: only the former are heads
                width = block.n_heads * block.d_head
                if x.shape[-1] != width + block.columns_after:
                    raise HeadlabError(f"{block.name}: its output projection reads {x.shape[-1]} columns, not the "
                                       f"{width} of its {block.n_heads} heads and the {block.columns_after} after them")
                rewritten = rewrite(block, module, x[..., :width].contiguous())
                return (torch.cat([rewritten, x[..., width:]], dim=-1), *args[1:])
            return (rewrite(block, module, x), *args[1:])

        return pre_hook

    try:
        applications = Applications(blocks)
        handles.extend(applications.handles)
        for block in blocks:
            # the heads' outputs enter a norm over them first where the family has one (BitNet's attn_sub_norm)
            handles.append(head_input(block).register_forward_pre_hook(make_hook(block)))
    except BaseException:
        handles.remove()
        raise
    return handles


@checked_keywords()
@recompiling("hooked heads' outputs (head_output_hooks)")
@contextmanager
def head_output_hooks(blocks: list[AttentionBlock], fn: HeadOutputFn) -> Iterator[None]:
    """:func:`register_head_output_hooks` as a context manager."""
    handles = register_head_output_hooks(blocks, fn)
    try:
        yield
    finally:
        handles.remove()
