"""Run-time discovery of a model's attention: which modules compute it, with how many heads, and
where their heads' outputs meet the output projection, read from one probe forward pass.

transformers v5 attention modules hand their queries, keys and values to a function picked from
``ALL_ATTENTION_FUNCTIONS`` (``attention_interface(self, query, key, value, mask, ...)``) and feed
what it returns, ``[batch, q_len, n_heads, d_head]``, to their output projection. The probe
registers a function of its own under :data:`PROBE`, switches every config to it and runs the
model once on a few tokens (on the meta device too: nothing is computed, the function returns
zeros of the right shape; a forward that reads values runs again on zeros, :func:`_given_values`).
Each call names its module and the query/key/value shapes: the head counts and head size, from the
tensors themselves. Every ``nn.Linear`` output of the model is
traced (a tensor subclass that carries the modules it came from through any torch operation), so
the probe also sees

* which projections of the module the query, key and value came from (their provenance): one
  projection each, of widths ``n_heads * d``, ``n_kv * d``, ``n_kv * d`` is the standard unfused
  layout that physical pruning slices and LRP detaches (prune_check verifies every prune anyway);
  anything else (fused, shared, mixed) is left to the family tables, and pruning and LRP are
  refused;
* the output projection: the first leaf module to receive the function's output, which must
  arrive through reshapes and casts only (view, reshape, contiguous, to), of width ``n_heads * d``,
  and be its only reader (an adapter reading it beside the projection is refused); a gate, norm or
  transpose on the way means that masking a slice of that input is not masking a head, and the
  module is refused. One exception is recorded rather than refused here: an elementwise product
  with a tensor made from projections of the model only (not from any attention function's output:
  Bailing-hybrid's ``sigmoid(g_proj(x))`` per head, A.X-K2's gate half of ``q_gate_proj``), whose
  projections ``Discovered.gates`` names and whose ``problem`` says so; the adapter accepts it for
  the model types whose forwards headlab checked (``adapters.families.OUTPUT_GATES``). Such a
  product keeps each head's slice apart (``0 * g = 0``), so masking a slice is masking a head. The
  block is the calling module, or the closest ancestor that also holds the
  output projection (BERT's ``attention`` around ``attention.self``). The heads' outputs may also pass,
  before the projection, through a norm or map of each head's output alone, whose output is traced on as
  theirs (``adapters.families.HEAD_NORMS``: Muse Spark's ``o_norm``; ``HEAD_MAPS``: NeoMME's
  ``exclusive_self_attention``, which ``Discovered.head_maps`` names) or a norm over all of them
  (``SUB_NORMS``: BitNet's);
* where the calling module's output tuple holds the weights the function returned, which capture
  reads in eager mode (a module that drops them is refused).

Mixture-of-experts blocks are run with an experts function that returns zeros (their routing
needs values the meta device does not have). A model whose attention does not call the
interface shows no call: :func:`discover` returns an empty list and the caller decides.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from headlab.adapters.families import HEAD_MAPS, HEAD_NORMS, SUB_NORMS
from headlab.errors import HeadlabError
from headlab.portable_code import SELECTED_ATTR  # on a norm pruning keeps whole: the heads its output is narrowed to

__all__ = ["PROBE", "SELECTED_ATTR", "Discovered", "ModelChanged", "discover", "maps", "ran", "selected_widths"]

PROBE = "headlab_probe"
"""The name under which the probe's attention (and experts) function is registered."""

_VIEWS = frozenset({
    torch.Tensor.view, torch.Tensor.reshape, torch.Tensor.contiguous, torch.reshape, torch.Tensor.flatten,
    torch.flatten, torch.Tensor.view_as, torch.Tensor.reshape_as,
    torch.Tensor.to, torch.Tensor.type_as, torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16,
})
"""Operations that only regroup elements in memory order (a head's slice stays that head's slice),
or cast or move each element on its own."""

@dataclass(frozen=True)
class Discovered:
    """One attention layer as the probe saw it: the module whose forward called the attention
    interface (``core``), the block around it that holds its output projection, and the heads."""

    name: str
    """Path of the block: the calling module, or its closest ancestor that holds the output
    projection (BERT's ``attention`` around ``attention.self``)."""
    core: str
    """Path of the calling module relative to the block ("" when it is the block)."""
    n_heads: int
    n_kv_heads: int
    d_head: int
    """Size of a head's output (its value vectors): the output projection reads ``n_heads * d_head``."""
    d_qk: int
    """Size of a head's queries and keys."""
    o: str | None
    """Path of the output projection, relative to the block (None: see ``problem``)."""
    q: str | None
    k: str | None
    v: str | None
    """Paths (relative to the block) of the projections the query, key and value came from, where
    each came from exactly one projection of the standard width (None otherwise)."""
    problem: str | None = None
    """Why masking at the output projection's input would not mask this module's heads."""
    probs_index: int = 1
    """Where the calling module's output tuple holds the attention probabilities (eager mode)."""
    kv_from: str | None = None
    """With ``q`` alone tied (``k`` and ``v`` None): the path (from the model) of the key projection, in another
    layer, whose keys this layer attends with, and whose value projection gave its values (Gemma 4's and Gemma 3n's
    key/value-shared layers, ``num_kv_shared_layers``: their attention has no key or value projection of its own)."""
    gates: tuple[str, ...] = ()
    """Paths (relative to the block) of the projections the heads' outputs were multiplied by a
    function of, elementwise, on their way to the output projection (an output gate), where that is the
    only problem (empty otherwise): ``problem`` then says so, for the adapter to lift where a table knows
    the gate (the q/k/v projections are tied as without a gate)."""
    sub_norm: str | None = None
    """Path (relative to the block) of the norm the heads' outputs passed through, whole, on their way to the output
    projection (:data:`headlab.adapters.families.SUB_NORMS`: BitNet's ``attn_sub_norm``); None without one."""
    sources: tuple[tuple[str, ...], ...] = ()
    """Where ``q``, ``k`` and ``v`` are None: for the queries, keys and values, the paths (relative to the block,
    sorted) of the projections each came from, where all of them lie inside the block (empty where one does not):
    what a table of layouts discovery does not tie checks against (Zamba 2's shared attention adapters,
    :data:`headlab.adapters.families.QKV_ADAPTERS`)."""
    head_maps: tuple[str, ...] = ()
    """Paths (relative to the block) of the modules of :data:`headlab.adapters.families.HEAD_MAPS` the heads' outputs
    passed through, each head's output mapped alone, on their way to the output projection (NeoMME's
    ``exclusive_self_attention``); empty without one."""
    calls: int = 1
    """How many times the module called the attention function in the probe pass."""
    once: tuple[str | None, tuple[str, ...]] | None = None
    """With ``calls`` > 1 (then ``problem`` says so): the problem and gates that one call shows, for a model whose
    forward runs the module at several depths by design (:data:`headlab.adapters.families.LOOPED_LAYERS`:
    Inkling2-Loop's loop layers), where the adapter numbers each run as a depth; None otherwise."""


class _Traced(torch.Tensor):
    """A tensor that remembers the modules its values came from (``_sources``) and whether it is
    the attention function's output regrouped by views only (``_pure``)."""

    _sources: frozenset = frozenset()
    _pure: bool = False
    _gates: frozenset = frozenset()
    """With ``_pure``: the modules of the gates the output was multiplied by on the way."""
    _broken_by: tuple[str, ...] = ()
    """The operations, from the first that took an attention function's output regrouped by views (``_pure``)
    to something else (``transpose``, ``mul``, ...), each once, in order: what a refusal names."""

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        # x.view_as(y): y lends its shape only (Beam's gate_proj(x).view_as(attn_output) is no attention output)
        operands = args[:1] if func in _SHAPE_OF_OTHER else (args, kwargs)
        traced = [a for a in _tensors(operands) if isinstance(a, _Traced)]
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if not traced:
            return out
        sources = frozenset().union(*(t._sources for t in traced))
        pure = len(traced) == 1 and traced[0]._pure and (func in _VIEWS or _is_identity_dropout(func, args, kwargs))
        gates = traced[0]._gates if pure else frozenset()
        broken_by = tuple(dict.fromkeys(name for t in traced for name in t._broken_by))[:_NAMED]
        if not pure and (broken_by or any(t._pure for t in traced)) and func not in _VIEWS:
            name = _operation_name(func)  # the operations after the output stopped being heads' slices, in order
            broken_by = broken_by if name in broken_by or len(broken_by) >= _NAMED else (*broken_by, name)
        if _in_place(func, kwargs) and args and isinstance(args[0], _Traced):
            # the tensor written to keeps being used under its old name: it carries what was written
            args[0]._sources, args[0]._pure, args[0]._gates = sources, False, frozenset()
            args[0]._broken_by = args[0]._broken_by or broken_by
        elif gate := _gate_product(func, args, kwargs):
            output, factor = gate  # an output gate: the heads' outputs with their gates named
            sources, pure, gates, broken_by = output._sources, True, output._gates | factor._sources, ()
        return _wrap(out, sources, pure, gates, broken_by)


_NAMED = 6  # operations a refusal names at most



def selected_widths(module: nn.Module) -> dict[int, int]:
    """id(projection) -> the width of what the attention reads of it, for the projections inside ``module`` whose
    output a norm spanning all their heads narrows to the heads pruning kept (OLMo 2's q_proj and q_norm, kept
    whole: :func:`headlab.portable_code.selection_hook`); the others read their whole output."""
    widths = {}
    for name, norm in module.named_modules():
        selected = getattr(norm, SELECTED_ATTR, None)
        if not selected:
            continue
        parent = module.get_submodule(name.rpartition(".")[0]) if "." in name else module
        projection = getattr(parent, selected["of"], None)
        if isinstance(projection, nn.Module):
            widths[id(projection)] = len(selected["heads"]) * selected["size"]
    return widths

_SHAPE_OF_OTHER = frozenset({torch.Tensor.view_as, torch.Tensor.reshape_as, torch.Tensor.expand_as, torch.Tensor.type_as})
"""Operations whose second tensor gives a shape or a dtype only, none of its values."""


def _operation_name(func: Callable[..., Any]) -> str:
    """``transpose``, ``mul``, ``getitem``: the name of a torch operation as a refusal shows it."""
    name = getattr(func, "__name__", None) or type(func).__name__
    return name.strip("_").removeprefix("r") if name.startswith("__r") else name.strip("_")


_PRODUCTS = frozenset({torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__})


def _gate_product(func: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[_Traced, _Traced] | None:
    """``(output, gate)`` where ``func`` multiplies, elementwise and not in place, the attention function's
    output regrouped by views (``_pure``) by a tensor made from projections only: no attention function's
    output among its sources, so it cannot carry one head's output into another's slice, and a head's slice
    of zeros stays zeros (``0 * g = 0``). None for anything else."""
    if func not in _PRODUCTS or kwargs or len(args) != 2 or \
            not all(isinstance(a, _Traced) for a in args):
        return None
    for output, factor in (args, args[::-1]):
        calls = [c for c in output._sources if isinstance(c, _Call)]
        if output._pure and len(calls) == 1 and output._sources == {calls[0]} and factor._sources and \
                not any(isinstance(c, _Call) for c in factor._sources) and factor.dim() <= output.dim():
            return output, factor
    return None


def _in_place(func: Callable[..., Any], kwargs: dict) -> bool:
    """``x.mul_(...)``, ``x[...] = ...`` or ``out=``: an operation that writes into an existing tensor."""
    name = getattr(func, "__name__", "")
    return "out" in kwargs or name == "__setitem__" or name.endswith("_") and not name.endswith("__")


def _is_identity_dropout(func: Callable[..., Any], args: tuple, kwargs: dict) -> bool:
    """``F.dropout`` outside training returns its input."""
    if func is not nn.functional.dropout:
        return False
    training = kwargs.get("training", args[2] if len(args) > 2 else True)
    return training is False


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _wrap(value: Any, sources: frozenset, pure: bool, gates: frozenset = frozenset(),
          broken_by: tuple[str, ...] = ()) -> Any:
    if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
        traced = value.as_subclass(_Traced)
        traced._sources, traced._pure, traced._gates, traced._broken_by = sources, pure, gates, broken_by
        return traced
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_wrap(item, sources, pure, gates, broken_by) for item in value)
    return value


def _plain(value: Any) -> Any:
    if isinstance(value, _Traced):
        return value.as_subclass(torch.Tensor)
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_plain(item) for item in value)
    return value


@dataclass(eq=False)
class _Call:
    module: nn.Module
    query: tuple[int, ...]
    key: tuple[int, ...]
    value: tuple[int, ...]
    sources: tuple[frozenset, frozenset, frozenset]
    o: nn.Module | None = None
    o_input: tuple[int, ...] | None = None
    o_pure: bool = False
    o_gates: frozenset = frozenset()
    """The modules of the output gates on the way to the output projection (see :func:`_gate_product`)."""
    o_broken_by: tuple[str, ...] = ()
    """Where not ``o_pure``: the operations on the way from the first that was not a reshape or cast."""
    weights: torch.Tensor | None = None
    probs_index: int | None = None
    """Where the calling module's output tuple holds the attention weights (-1: nowhere)."""
    readers: list[nn.Module] = field(default_factory=list)
    """Every module that received this call's output, or a tensor made from it, in call order."""
    sub_norm: nn.Module | None = None
    """A norm of :data:`headlab.adapters.families.SUB_NORMS` that received the output regrouped by views (and output
    gates) only, before any other leaf module: its output is traced on as the heads' outputs (:meth:`_Probe.normed`)."""
    head_norms: list[nn.Module] = field(default_factory=list)
    """Norms of :data:`headlab.adapters.families.HEAD_NORMS` that received the output regrouped by views (and output
    gates) only, at one head's width: each head's output normalised alone, traced on as the heads' outputs; and the
    modules of :data:`headlab.adapters.families.HEAD_MAPS` (each head's output mapped alone) likewise."""


class _Probe:
    def __init__(self) -> None:
        self.calls: list[_Call] = []
        self.ran: set[int] = set()  # ids of the modules whose forward ran
        self.maps: dict[int, tuple[tuple[int, ...], ...]] = {}  # id -> shapes of the 4-D tensors a module returned
        self.pending: set[_Call] = set()  # calls whose output has not reached a projection yet
        self.masks = False  # build masks that hide nothing instead of none (the second try: _discover)
        self.norming: dict[int, tuple[_Call, frozenset]] = {}  # id(sub-norm) -> the call whose output it is running on

    def normed(self, module: nn.Module, output: Any) -> Any:
        """A sub-norm's output (:attr:`_Call.sub_norm`), traced as the heads' outputs regrouped by views: a norm of
        :data:`~headlab.adapters.families.SUB_NORMS` computes each position from that position's heads' outputs only,
        and a head's zeros stay its own slice's zeros (what the family's pruning relies on); None elsewhere."""
        entry = self.norming.pop(id(module), None)
        if entry is None or not isinstance(output, torch.Tensor):
            return None
        call, gates = entry
        return _wrap(_plain(output), frozenset({call}), True, gates)

    def attention(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        q_sources, k_sources, v_sources = (t._sources if isinstance(t, _Traced) else frozenset()
                                           for t in (query, key, value))
        sources = (q_sources, k_sources, v_sources)
        call = _Call(module, tuple(query.shape), tuple(key.shape), tuple(value.shape), sources)
        self.calls.append(call)
        self.pending.add(call)
        batch, n_heads, q_len, _ = query.shape
        with torch._C.DisableTorchFunctionSubclass():
            out = torch.zeros(batch, q_len, n_heads, value.shape[-1], dtype=value.dtype, device=value.device)
            call.weights = torch.zeros(batch, n_heads, q_len, key.shape[2], dtype=value.dtype, device=value.device)
        return _wrap(out, frozenset({call}), True), call.weights

    def returned(self, module: nn.Module, output: Any) -> None:
        """Where ``module``'s output tuple holds the weights its attention function returned (capture
        reads them there, in eager mode)."""
        items = output if isinstance(output, tuple) else (output,)
        self.maps[id(module)] = tuple(tuple(item.shape) for item in items
                                      if isinstance(item, torch.Tensor) and item.dim() == 4)
        for call in self.calls:
            if call.module is module and call.probs_index is None:
                call.probs_index = next((i for i, item in enumerate(items) if item is call.weights), -1)

    def seen(self, module: nn.Module, x: Any) -> None:
        """``module`` is about to run on ``x``: a reader of every call whose output ``x`` carries; the
        first leaf reader (a dropout outside training aside) of a pending call is its output projection."""
        if not isinstance(x, _Traced):
            return
        leaf = next(module.children(), None) is None and not isinstance(module, nn.Dropout)
        for call in [c for c in x._sources if isinstance(c, _Call)]:
            call.readers.append(module)
            if leaf and call in self.pending and call.sub_norm is None and _sub_norm(module) \
                    and x._pure and x._sources == {call}:
                call.sub_norm = module  # over all heads' outputs, per position: what reaches o_proj is its output
                self.norming[id(module)] = (call, x._gates)
                continue
            if leaf and call in self.pending and _head_norm(module, x, call) and x._pure and x._sources == {call}:
                call.head_norms.append(module)  # over one head's features: each head's output its own
                self.norming[id(module)] = (call, x._gates)
                continue
            if leaf and call in self.pending:
                self.pending.remove(call)
                call.o, call.o_input, call.o_pure = module, tuple(x.shape), x._pure and x._sources == {call}
                call.o_gates = x._gates if call.o_pure else frozenset()
                call.o_broken_by = () if call.o_pure else x._broken_by


def _sub_norm(module: nn.Module) -> bool:
    """One of transformers' own norms of :data:`~headlab.adapters.families.SUB_NORMS` (its class and module)."""
    return type(module).__name__ in SUB_NORMS and type(module).__module__.startswith("transformers.models.")


def _head_norm(module: nn.Module, x: torch.Tensor, call: _Call) -> bool:
    """One of transformers' own norms of :data:`~headlab.adapters.families.HEAD_NORMS` (its class and module) about to
    run on ``[..., heads, head_dim]`` (one head's features in its last dimension), with no weight or one of that size;
    or one of its per-head maps of :data:`~headlab.adapters.families.HEAD_MAPS`, its parameter one entry per query
    head."""
    if not (type(module).__module__.startswith("transformers.models.") and x.dim() >= 3
            and tuple(x.shape[-2:]) == (call.query[1], call.value[-1])):
        return False
    if type(module).__name__ in HEAD_MAPS:
        vector = getattr(module, HEAD_MAPS[type(module).__name__][0], None)
        return isinstance(vector, torch.Tensor) and tuple(vector.shape) == (call.query[1],)
    weight = getattr(module, "weight", None)
    return type(module).__name__ in HEAD_NORMS and (weight is None or tuple(weight.shape) == (call.value[-1],))


def _no_mask(*args: Any, batch_size: int = 1, q_length: int = 1, kv_length: int = 1, allow_is_causal_skip: bool = True,
             device: Any = None, **kwargs: Any) -> torch.Tensor | None:
    """The probe's attention ignores masks: none is built (building one reads values), except where
    the model asks for one to exist (``allow_is_causal_skip=False``: DeepSeek Sparse Attention's
    indexer reads it before attention, or MPT, whose own attention takes ``create_causal_mask(...).to(torch.bool)``
    and fails on none: the probe's second try), which then hides nothing."""
    if allow_is_causal_skip and not (_ACTIVE and _ACTIVE[-1].masks):
        return None
    return torch.ones(batch_size, 1, q_length, kv_length, dtype=torch.bool, device=device)


def _experts(module: nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        return torch.zeros_like(hidden_states)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PROBE, _probe_attention)
    AttentionMaskInterface.register(PROBE, _no_mask)
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:  # pragma: no cover - a transformers without the experts interface
        return
    ALL_EXPERTS_FUNCTIONS.register(PROBE, _experts)


_ACTIVE: list[_Probe] = []


def _probe_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: Any, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return _ACTIVE[-1].attention(module, query, key, value, attention_mask, *args, **kwargs)


SUB_CONFIGS = ("text_config", "encoder", "decoder")
"""The sub-configs of a composite config (a multimodal model's text model, an encoder-decoder's halves)."""


def attention_configs(model: nn.Module) -> list:
    """Every distinct config object that an attention module of ``model`` may read: those its
    modules hold and their sub-configs, each once, in module order (a parent before its parts)."""
    found: dict[int, object] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            found.setdefault(id(config), config)
            for name in SUB_CONFIGS:
                sub = getattr(config, name, None)
                if sub is not None and hasattr(sub, "_attn_implementation"):
                    found.setdefault(id(sub), sub)
    return list(found.values())


def _probe_inputs(model: nn.Module, device: torch.device) -> dict:
    ids = torch.zeros(1, 4, dtype=torch.long, device=device)
    config = getattr(model, "config", None)
    parameters = inspect.signature(model.forward).parameters
    takes = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    inputs: dict[str, torch.Tensor | bool] = {"input_ids": ids}
    if "attention_mask" in parameters or takes:  # a mask given: transformers does not look for packed sequences
        inputs["attention_mask"] = torch.ones_like(ids)
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in parameters:
        inputs["decoder_input_ids"] = ids[:, :3]
    if "use_cache" in parameters or takes:
        inputs["use_cache"] = False
    return inputs


def _run(model: nn.Module, masks: bool = False) -> _Probe:
    _register()
    probe = _Probe()
    probe.masks = masks
    parameter = next(model.parameters(), None)
    device = parameter.device if parameter is not None else torch.device("cpu")
    handles = []
    configs = attention_configs(model)
    saved = [(config, config.__dict__.get("_attn_implementation_internal", None),
              getattr(config, "_attn_implementation", None), getattr(config, "_experts_implementation", None))
             for config in configs]

    def mark(module: nn.Module, args: tuple, output: Any) -> Any:  # a projection's output: traced to it
        return _wrap(_plain(output), frozenset({module}), False)

    def seen(module: nn.Module, args: tuple) -> None:
        probe.ran.add(id(module))
        if args:
            probe.seen(module, args[0])

    def returned(module: nn.Module, args: tuple, output: Any) -> Any:
        probe.returned(module, output)
        return probe.normed(module, output)

    try:
        for module in model.modules():
            if isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D":
                handles.append(module.register_forward_hook(mark))
        # Who reads the function's output, and what each module returns: these hooks run first, before
        # any gate a user attached.
        for module in model.modules():
            handles.append(module.register_forward_pre_hook(seen, prepend=True))
            handles.append(module.register_forward_hook(returned, prepend=True))
        for config in configs:
            config._attn_implementation = PROBE
            if hasattr(config, "_experts_implementation"):
                config._experts_implementation = PROBE
        _ACTIVE.append(probe)
        with torch.no_grad():
            model(**_probe_inputs(model, device))
    finally:
        if _ACTIVE and _ACTIVE[-1] is probe:
            _ACTIVE.pop()
        for handle in handles:
            handle.remove()
        for config, _, attn, experts in saved:
            config._attn_implementation = attn
            if hasattr(config, "_experts_implementation"):
                config._experts_implementation = experts
    return probe


_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def discover(model: nn.Module) -> list[Discovered]:
    """Every module of ``model`` whose forward calls transformers' attention interface, in call
    order, from one probe forward (cached per model while the modules found stay in place; head
    counts are read from the weights by the caller). Empty when none calls it. Raises
    :class:`HeadlabError` when the probe forward cannot run."""
    cached = _CACHE.get(model)
    if cached is not None and cached[1] == _identity(model, cached[4]):
        return cached[0]
    found, ran, returned = _discover(model)
    paths = _paths(model, found)
    _CACHE[model] = (found, _identity(model, paths), ran, returned, paths)
    return found


def ran(model: nn.Module) -> frozenset[str]:
    """The paths of the modules whose forward ran in ``model``'s probe pass (:func:`discover` first)."""
    discover(model)
    return _CACHE[model][2]


def maps(model: nn.Module) -> dict[str, tuple[tuple[int, ...], ...]]:
    """Path -> shapes of the 4-D tensors each module that ran returned in the probe pass (a module that
    does not call the attention interface and returns per-head weights returns them here)."""
    discover(model)
    return _CACHE[model][3]


def _paths(model: nn.Module, found: list[Discovered]) -> tuple[str, ...]:
    """The discovered modules' paths, and those of layers pruned to no head (their stand-in calls no
    attention function: pruning undone puts back a module this probe did not see)."""
    out = [name for name, module in model.named_modules()
           if type(module).__name__ in ("ZeroHeadAttention", "NoHeadAttention")]
    for item in found:
        out += [item.name, _join(item.name, item.core),
                *(_join(item.name, p) for p in (item.o, item.q, item.k, item.v) if p is not None)]
    return tuple(out)


def _identity(model: nn.Module, paths: tuple[str, ...]) -> tuple:
    """The modules the paths lead to now: a module replaced since (a pruned layer's stand-in, an adapter
    around a projection, the original put back) makes the probe run again."""
    modules = dict(model.named_modules())
    return tuple(id(modules.get(path)) for path in paths)


def _join(block: str, path: str) -> str:
    return ".".join(part for part in (block, path) if part)


def _discover(model: nn.Module) -> tuple[list[Discovered], frozenset[str], dict[str, tuple[tuple[int, ...], ...]]]:
    modes = [(module, module.training) for module in model.modules()]
    saved = _plain_attributes(model)
    tree = dict(model.named_modules())
    parameter = next(model.parameters(), None)
    devices = [parameter.device] if parameter is not None and parameter.device.type == "cuda" else []
    model.eval()
    try:
        with torch.random.fork_rng(devices=devices):  # the probe draws nothing from the user's generators
            try:
                probe = _probe(model)
            except HeadlabError:
                raise
            except Exception:  # noqa: BLE001 - on the meta device: a forward that reads values, given some
                if not _on_meta(model):
                    raise
                with _given_values(model):
                    probe = _probe(model)
    except HeadlabError:
        raise
    except Exception as error:  # noqa: BLE001 - any model's forward: reported, with what failed
        raise HeadlabError(f"the probe forward pass that finds its attention modules failed "
                           f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})") from error
    finally:
        for module, training in modes:
            module.training = training
        for owner, values in saved:  # what a forward set on the way (BigBird's attention_type for short inputs)
            for name, value in values.items():
                if owner.__dict__.get(name, value) is not value:
                    setattr(owner, name, value)
    _check_tree(model, tree)
    modules = dict(model.named_modules())
    names = {id(module): name for name, module in modules.items()}
    calls = probe.calls
    counts: dict[int, int] = {}
    for call in calls:
        counts[id(call.module)] = counts.get(id(call.module), 0) + 1
    firsts = [call for i, call in enumerate(calls) if all(c.module is not call.module for c in calls[:i])]
    found = [_describe(call, modules, names, counts[id(call.module)]) for call in firsts]
    return (found, frozenset(name for name, module in modules.items() if id(module) in probe.ran),
            {name: probe.maps[id(module)] for name, module in modules.items() if id(module) in probe.maps})


def _probe(model: nn.Module) -> _Probe:
    try:
        return _run(model)
    except HeadlabError:
        raise
    except Exception:  # noqa: BLE001 - a model that needs a mask tensor (MPT): masks hiding nothing
        return _run(model, masks=True)


def _on_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


@contextmanager
def _given_values(model: nn.Module) -> Iterator[None]:
    """``model``'s meta tensors swapped, for the probe, for zeros on the CPU, then put back: a structure built
    without its weights whose forward reads values (GLM-5-Next's text model tests ``torch.all(mask == 1)`` and
    its indexer keeps pooled keys by a boolean mask, which the meta device cannot compute) is probed as it is,
    not refused. A parameter's zeros are one element expanded to its shape (no memory per parameter: the probe's
    experts function never reads the experts' weights); a buffer's are its own (a forward may write into one).
    A projection (``nn.Linear``, GPT-2's ``Conv1D``) whose weight was swapped returns its bias, or zeros, of its
    output's shape without reading the weight (:func:`_weightless`): torch's product with an expanded weight
    copies it whole first, an LM head of 151552 x 4096 held 2.4 GiB for the probe. A parameter the forward
    multiplies itself (GLM-5-Next's hyper-connection and router weights, by ``F.linear``) is still copied for its
    product, one at a time and freed after it: a few rows each. Zeros change values only,
    and the probe reads shapes and where tensors go; only the control flow that values decide may differ from
    the loaded model's, which is probed again on its weights when loaded."""
    swapped: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    forwards: list[tuple[nn.Module, Any]] = []
    try:
        for module in model.modules():
            weight = module._parameters.get("weight")
            weightless = isinstance(weight, torch.Tensor) and weight.is_meta and _projection_width(module) is not None
            stores: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
            for store in stores:
                for name, tensor in store.items():
                    if tensor is None or not tensor.is_meta:
                        continue
                    swapped.append((store, name, tensor))
                    if isinstance(tensor, nn.Parameter):
                        zeros = torch.zeros((), dtype=tensor.dtype).expand(tensor.shape)
                        store[name] = nn.Parameter(zeros, requires_grad=False)
                    else:
                        store[name] = torch.zeros(tensor.shape, dtype=tensor.dtype)
            if weightless:
                forwards.append((module, module.__dict__.get("forward")))
                module.forward = _weightless(module)  # type: ignore[method-assign]
        yield
    finally:
        for module, own in forwards:
            if own is None:
                del module.forward
            else:
                module.forward = own  # type: ignore[method-assign]
        for store, name, tensor in swapped:
            store[name] = tensor


def _projection_width(module: nn.Module) -> int | None:
    """The output width of a linear projection: ``nn.Linear``'s ``out_features``, GPT-2's ``Conv1D``'s ``nf``."""
    if isinstance(module, nn.Linear):
        return module.out_features
    width = getattr(module, "nf", None)
    return width if type(module).__name__ == "Conv1D" and isinstance(width, int) else None


def _weightless(module: nn.Module) -> Callable[..., torch.Tensor]:
    """``module``'s forward with an all-zero weight, computed without it: ``x @ 0 + b`` is ``b`` (zeros without a
    bias) at every position. An input of another width than the weight's runs the module's own forward, which
    says so as the loaded model would."""
    width = int(_projection_width(module) or 0)
    weight, bias = module._parameters["weight"], module._parameters.get("bias")  # both swapped already
    assert weight is not None  # the caller swapped it
    width_in = weight.shape[-1] if isinstance(module, nn.Linear) else weight.shape[0]
    own = type(module).forward.__get__(module)

    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args or kwargs or not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] != width_in:
            return own(x, *args, **kwargs)
        out = torch.zeros((*x.shape[:-1], width), dtype=x.dtype, device=x.device)
        return out if bias is None else out + bias
    return forward


class ModelChanged(HeadlabError):
    """The probe's forward replaced modules of the model: refused, never left to name-based discovery."""


def _check_tree(model: nn.Module, tree: dict[str, nn.Module]) -> None:
    """A forward that replaced modules of the model (BigBird's block-sparse attention swaps itself for
    full attention on short inputs) is refused: headlab's hooks would sit on modules that no longer
    run (capture then recorded nothing). The modules are put back first, so the model is as it was."""
    now = dict(model.named_modules())
    changed = sorted((path for path in tree.keys() | now.keys() if tree.get(path) is not now.get(path)),
                     key=lambda path: (path.count("."), path))
    if not changed:
        return
    done: list[str] = []
    for path in changed:
        if any(path.startswith(top + ".") for top in done):
            continue
        parent, _, name = path.rpartition(".")
        owner = tree.get(parent)
        if owner is None:
            continue
        if path in tree:
            owner._modules[name] = tree[path]
        else:
            owner._modules.pop(name, None)
        done.append(path)
    first = changed[0]
    was, became = tree.get(first), now.get(first)
    raise ModelChanged(
        f"its forward replaced modules of the model during the probe pass ({first}: "
        f"{type(was).__name__ if was is not None else 'nothing'} -> {type(became).__name__ if became is not None else 'nothing'}"
        f"{f', and {len(done) - 1} more' if len(done) > 1 else ''}): headlab's hooks would sit on modules that no "
        "longer run; the modules are put back")


_PLAIN = (bool, int, float, str, type(None))


def _plain_attributes(model: nn.Module) -> list[tuple[object, dict]]:
    """Every module's and config's plain attributes (numbers, strings, flags), to put back after the probe."""
    owners: dict[int, object] = {}
    for module in model.modules():
        owners.setdefault(id(module), module)
        config = getattr(module, "config", None)
        if hasattr(config, "__dict__"):  # a float under that name (IDEFICS' dropout: self.config = config.dropout)
            owners.setdefault(id(config), config)
    return [(owner, {k: v for k, v in vars(owner).items() if isinstance(v, _PLAIN)}) for owner in owners.values()]


def _width(module: nn.Module, which: str) -> int | None:
    if isinstance(module, nn.Linear):
        return module.in_features if which == "in" else module.out_features
    if type(module).__name__ == "Conv1D":  # transformers' Conv1D: weight [in, out]
        weight = module.weight
        assert isinstance(weight, torch.Tensor)
        return int(weight.shape[0 if which == "in" else 1])
    return None


def _describe(call: _Call, modules: dict[str, nn.Module], names: dict[int, str], n_calls: int) -> Discovered:
    calling = names.get(id(call.module), type(call.module).__name__)
    _, n_heads, _, d_qk = call.query
    _, n_kv, _, d_v = call.value
    o_name = names.get(id(call.o)) if call.o is not None else None
    block = calling if o_name is None else _common_ancestor(calling, o_name)
    problem, gated = None, False
    # a module run several times: refused as such, what one run shows kept for a model whose loop headlab numbers
    repeated = (f"its forward ran the attention function {n_calls} times in one pass (a module shared by several "
                "layers, or one that attends twice): a head is not one layer's head") if n_calls > 1 else None
    if call.key[1] != n_kv or call.key[-1] != d_qk:
        problem = f"keys {list(call.key)} do not match queries {list(call.query)} and values {list(call.value)}"
    elif n_kv == 0 or n_heads % n_kv:
        problem = f"{n_heads} query heads do not group over {n_kv} key/value heads"
    elif call.o is None or o_name is None:
        problem = "no module received the attention function's output (no output projection)"
    elif not call.o_pure:
        first = f" ({', '.join(call.o_broken_by)}{', ...' if len(call.o_broken_by) >= _NAMED else ''})" \
            if call.o_broken_by else ""
        problem = (f"the attention function's output reaches {o_name} through operations other than reshapes and casts"
                   f"{first}: a slice of that input is not one head's output")
    elif _width(call.o, "in") is None:
        problem = f"the first module to read the attention function's output, {o_name}, is a " \
                  f"{type(call.o).__name__}, not a linear map"
    elif call.o_input is None or call.o_input[-1] != n_heads * d_v or _width(call.o, "in") != n_heads * d_v:
        problem = (f"its output projection {o_name} reads {call.o_input[-1] if call.o_input else '?'} features, not "
                   f"{n_heads} heads x {d_v}")
    elif call.probs_index is None or call.probs_index < 0:
        problem = ("its forward does not return the attention function's weights, where capture reads the attention "
                   "probabilities")
    elif others := [m for m in call.readers if not _nested(m, call.o) and m is not call.sub_norm
                    and not any(m is norm for norm in call.head_norms)]:
        problem = (f"besides its output projection {o_name}, {names.get(id(others[0]), type(others[0]).__name__)} reads "
                   "the heads' outputs (an adapter around the projection?): masking the projection's input would "
                   "not switch a head off")
    elif not block or block != calling and not calling.startswith(block + "."):
        problem = f"its output projection {o_name} lies outside the attention layer"
    # last, so that the adapter, lifting it for a gate it knows (OUTPUT_GATES), lifts no other problem
    elif gated := bool(call.o_gates):
        problem = (f"the attention function's output reaches {o_name} multiplied, elementwise, by a gate computed from "
                   f"{', '.join(sorted(_gate_names(block, call.o_gates, names)))} (an output gate, from the layer's "
                   "input, not from the heads): masking stays exact, but physical pruning must remove each head's rows "
                   "of that projection, a layout known only for the model types of "
                   "headlab.adapters.families.OUTPUT_GATES, whose forwards headlab checked")
    owner = modules.get(block)
    # an output gate alone: its q/k/v projections tied too (Beam's), for when the adapter knows the gate
    inside = {id(m) for m in owner.modules()} if owner is not None and (problem is None or gated) else set()
    paths, elsewhere = [], []
    narrowed = selected_widths(owner) if owner is not None else {}  # a pruned OLMo 2's q_proj, whole, its heads kept
    for sources, width in zip(call.sources, (n_heads * d_qk, n_kv * d_qk, n_kv * d_v)):
        projections = [m for m in sources if isinstance(m, nn.Module)]
        single = projections[0] if len(projections) == 1 and len(sources) == 1 \
            and narrowed.get(id(projections[0]), _width(projections[0], "out")) == width else None
        paths.append(_relative(block, names.get(id(single))) if single is not None and id(single) in inside else None)
        elsewhere.append(names.get(id(single)) if single is not None and id(single) not in inside else None)
    q, k, v = paths
    kv_from = None
    # keys and values from one key and one value projection of another layer, the queries from this one's (Gemma 4's
    # key/value-shared layers; one projection for both where that layer's values are its keys', attention_k_eq_v): the
    # query projection tied alone, the keys' projection named (pruning keeps its heads while this layer reads them; LRP
    # holds the keys constant there)
    if q is not None and k is None and v is None and None not in elsewhere[1:] \
            and (owner is None or not (elsewhere[1] or "").startswith(block + ".")):
        kv_from = elsewhere[1]
    # query/key heads may be wider than value heads (MiMo-V2-Flash): each projection was checked at its own width.
    # The values may come from the key projection alone (Gemma 4's attention_k_eq_v: value_states = key_states, taken
    # before k_norm and rotary): k and v tied to that one module, whose rows a key/value head owns once
    elif None in (q, k, v) or q in (k, v):
        q = k = v = None
    traced = _source_paths(block, call.sources, names) if None in (q, k, v) else ()
    sub_norm = _relative(block, names.get(id(call.sub_norm))) if call.sub_norm is not None else None
    if call.sub_norm is not None and sub_norm is None and problem is None:
        problem = (f"the norm its heads' outputs pass through, {names.get(id(call.sub_norm))}, lies outside the "
                   "attention layer")
    head_maps = tuple(_relative(block, names.get(id(m))) for m in call.head_norms if type(m).__name__ in HEAD_MAPS)
    if None in head_maps and problem is None:
        problem = (f"the per-head map its heads' outputs pass through, {type(call.head_norms[0]).__name__}, lies "
                   "outside the attention layer")
    gates = tuple(sorted(_gate_names(block, call.o_gates, names))) if gated else ()
    return Discovered(block, _relative(block, calling) or "", n_heads, n_kv, d_v, d_qk,
                      _relative(block, o_name), q, k, v, repeated or problem, call.probs_index or 0, kv_from,
                      () if repeated else gates, sub_norm, traced, tuple(p for p in head_maps if p is not None),
                      calls=n_calls, once=(problem, gates) if repeated else None)


def _source_paths(block: str, sources: tuple[frozenset, ...], names: dict[int, str]) -> tuple[tuple[str, ...], ...]:
    """:attr:`Discovered.sources`: the projections the queries, keys and values came from, relative to ``block``;
    empty where one of them is no module of the block."""
    found = []
    for each in sources:
        paths = [_relative(block, names.get(id(m))) if isinstance(m, nn.Module) else None for m in each]
        if not paths or None in paths:
            return ()
        found.append(tuple(sorted(p for p in paths if p is not None)))
    return tuple(found)


def _gate_names(block: str, gates: frozenset, names: dict[int, str]) -> list[str]:
    """The gate projections' paths, relative to ``block`` where inside it."""
    return [_relative(block, names.get(id(m))) or names.get(id(m), type(m).__name__) for m in gates]


def _nested(a: nn.Module, b: nn.Module) -> bool:
    """``a`` is ``b``, holds it or is held by it."""
    return any(m is b for m in a.modules()) or any(m is a for m in b.modules())


def _common_ancestor(a: str, b: str) -> str:
    common = []
    for x, y in zip(a.split("."), b.split(".")):
        if x != y:
            break
        common.append(x)
    return ".".join(common)


def _relative(block: str, name: str | None) -> str | None:
    """``name`` relative to ``block`` ("" for the block itself; None outside it)."""
    if name is None:
        return None
    if name == block:
        return ""
    if not block:
        return name
    return name[len(block) + 1:] if name.startswith(block + ".") else None
