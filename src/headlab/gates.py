"""Gates on heads: fixed masks and learnable per-head gates, one mechanism for both.

A gate multiplies a head's output at the input of the output projection, where Voita et al.
2019 (Sec. 6.1) put it: MultiHead(Q, K, V) = Concat_i(g_i * head_i) W^O. A gate module is a
registered sub-module of the model while attached, so learnable gates appear in
``model.parameters()`` and ``model.state_dict()``; detaching removes module and hooks. Gate
sets stack (a mask inside gated fine-tuning, per-example gates under a mask): each has its own
handle and all multiply, through one pre-hook per block.
The Hard Concrete gates of the pruning package subclass :class:`HeadGates`.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar, cast

import torch
from torch import nn

from headlab.adapters import AttentionBlock, attention_blocks, find_block, refuse_broken_flex, refuse_mask_skip
from headlab.adapters.eager_alibi import refuse_alibi_twice
from headlab.capture import GATE_STACK, HookHandles, register_head_output_hooks
from headlab.compiled import discard_compiled_code, running_eagerly, uncompiled
from headlab.errors import HeadlabError, counted
from headlab.heads import BlockKey, HeadSpec
from headlab.options import checked_keywords

GATES_ATTRIBUTE = "headlab_gates"
_GATING = "attached or removed gates on heads' outputs (mask_heads, attach_gates, detach_gates)"
_STACK = GATE_STACK  # in model.__dict__, not a sub-module: the attached gate sets and their hooks
_Gates = TypeVar("_Gates", bound="HeadGates")
_Function = TypeVar("_Function", bound=Callable[..., Any])


def block_name(key: BlockKey) -> str:
    """A parameter-name-safe key: ("enc_self", 3) -> "enc_self_3"."""
    return f"{key[0]}_{key[1]}"


def _integer(value: Any, what: str) -> int:
    """``value`` as an index: an int (numpy's and 0-d torch integers too), never a bool, float or
    string, which int() would turn into another head (1.7 -> 1, True -> 1)."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise HeadlabError(f"{what} {value!r} is not an integer")


def validate_heads(blocks: list[AttentionBlock], heads: HeadSpec) -> dict[BlockKey, list[int]]:
    """Check a head spec against the model; return it sorted and deduplicated.

    Raises :class:`HeadlabError` for an unknown kind, layer or head index.
    """
    clean: dict[BlockKey, list[int]] = {}
    for key, indices in heads.items():
        if not (isinstance(key, tuple) and len(key) == 2):
            raise HeadlabError(f"head spec keys must be (kind, layer), got {key!r}")
        block = find_block(blocks, key[0], _integer(key[1], f"{key[0]}: layer"))
        chosen = sorted({_integer(h, f"{block.kind} layer {block.layer}: head") for h in indices})
        bad = [h for h in chosen if not 0 <= h < block.n_heads]
        if bad:
            has = f"heads 0..{block.n_heads - 1}" if block.n_heads else "no heads left (pruned)"  # not "0..-1"
            raise HeadlabError(f"{block.kind} layer {block.layer} has {has}; no head {bad[0]}")
        if chosen:
            clean[block.key] = chosen
    return clean


class HeadGates(nn.Module):
    """Base class: one gate per head for a set of blocks.

    ``n_heads`` maps ``(kind, layer)`` to the number of heads. Subclasses implement
    :meth:`gate`, returning ``[n_heads]`` (one value per head for the whole batch) or
    ``[batch, n_heads]``. It is called once per forward call of each block, so a stochastic
    gate draws a fresh sample for every batch.
    """

    def __init__(self, n_heads: Mapping[BlockKey, int]):
        super().__init__()
        self.n_heads = dict(n_heads)

    @classmethod
    def for_model(cls: type[_Gates], model: nn.Module, kinds: tuple[str, ...] | None = None, **kwargs: Any) -> _Gates:
        # no gate on an idle block (a tower token ids never run): it would learn the penalty alone, and count in it
        blocks = [b for b in attention_blocks(model) if not b.idle]
        return cls({b.key: b.n_heads for b in blocks if kinds is None or b.kind in kinds}, **kwargs)

    def gate(self, key: BlockKey) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    keeps_pass = False
    """Whether the gates keep something for one pass (Hard Concrete draws): :func:`attach_gates` then calls
    :meth:`new_pass` at the start of each forward of the model and :meth:`end_pass` with its output."""

    def new_pass(self) -> None:
        """Start a new pass: forget what was kept for the last one (see :attr:`keeps_pass`)."""

    def end_pass(self, output: Any) -> None:
        """The model's forward returned ``output`` (see :attr:`keeps_pass`)."""

    def gate_heads(self, block: AttentionBlock, heads: torch.Tensor) -> torch.Tensor:
        """``heads`` [batch, pos, n_heads, d_head] times the gates of ``block``."""
        if block.key not in self.n_heads:
            return heads
        return self.scaled(heads, self.gate(block.key))

    @staticmethod
    def scaled(heads: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """``heads`` [batch, pos, n_heads, d_head] times ``gate`` ([n_heads] or [batch, n_heads])."""
        g = gate.to(device=heads.device, dtype=heads.dtype)
        if g.dim() == 1:
            return heads * g[:, None]  # [n_heads, 1] broadcasts over batch, pos, d_head
        return heads * g[:, None, :, None]  # [batch, 1, n_heads, 1]


class ConstantGates(HeadGates):
    """Fixed gate values (a mask when they are 0 and 1). Buffers, not parameters."""

    def __init__(self, values: Mapping[BlockKey, torch.Tensor]):
        super().__init__({key: int(v.shape[-1]) for key, v in values.items()})
        for key, value in values.items():
            self.register_buffer(block_name(key), torch.as_tensor(value, dtype=torch.float32).clone())

    @classmethod
    def from_mask(cls, blocks: list[AttentionBlock], heads: HeadSpec, value: float = 0.0) -> "ConstantGates":
        """Gates at 1, except ``value`` for the heads named in ``heads``."""
        heads = validate_heads(blocks, heads)
        values = {}
        for key, indices in heads.items():
            gate = torch.ones(find_block(blocks, *key).n_heads)
            gate[indices] = value
            values[key] = gate
        return cls(values)

    def gate(self, key: BlockKey) -> torch.Tensor:
        return getattr(self, block_name(key))


class ScalarGates(HeadGates):
    """One learnable scalar per head, initialised to ``init`` (1.0 changes nothing).

    Used for gradient importance (Michel et al. 2019, Eq. 4: I_h = |dL/dg_h| at g = 1).
    """

    def __init__(self, n_heads: Mapping[BlockKey, int], init: float = 1.0):
        super().__init__(n_heads)
        self.values = nn.ParameterDict(
            {block_name(key): nn.Parameter(torch.full((n,), float(init))) for key, n in self.n_heads.items()}
        )

    def gate(self, key: BlockKey) -> torch.Tensor:
        return self.values[block_name(key)]


def _check_gates_fit(blocks: list[AttentionBlock], gates: HeadGates) -> list[AttentionBlock]:
    chosen = []
    for key, n in gates.n_heads.items():
        block = find_block(blocks, *key)
        if block.n_heads != n:
            raise HeadlabError(
                f"gates for {block.kind} layer {block.layer} have {counted(n, 'head')}; the model has {block.n_heads}"
            )
        chosen.append(block)
    return chosen


class _GateStack:
    """The gate sets attached to one model, in attachment order, and one pre-hook per gated block
    that multiplies the heads by every active set's gates."""

    def __init__(self) -> None:
        self.sets: dict[str, HeadGates] = {}  # attribute name on the model -> gate module
        self.hooks: dict[BlockKey, HookHandles] = {}
        self.pass_hooks: list[Any] = []  # the model's forward pre-hook and hook: new_pass and end_pass of every set
        # the gates drawn in the call under way of an attention that runs its output projection more than once per call
        # (Family.output_calls: PEGASUS-X's encoder, its global tokens' heads and its tokens'), by block and set
        self.drawn: dict[BlockKey, dict[str, torch.Tensor]] = {}

    def new_pass(self, module: nn.Module, args: tuple) -> None:
        for gates in self.sets.values():
            gates.new_pass()

    def end_pass(self, module: nn.Module, args: tuple, output: Any) -> None:
        for gates in self.sets.values():
            gates.end_pass(output)

    def gate_heads(self, block: AttentionBlock, heads: torch.Tensor) -> torch.Tensor:
        drawn = self.drawn.get(block.key)
        for name, gates in self.sets.items():
            if drawn is not None and gates.keeps_pass and block.key in gates.n_heads:
                # a stochastic gate draws once per call of the attention: its outputs for every stream take one sample
                if name not in drawn:
                    drawn[name] = gates.gate(block.key)
                heads = gates.scaled(heads, drawn[name])
            else:
                heads = gates.gate_heads(block, heads)
        return heads

    def _new_call(self, key: BlockKey) -> Any:
        def pre_hook(module: nn.Module, args: tuple) -> None:
            self.drawn[key] = {}

        return pre_hook

    def hook(self, blocks: list[AttentionBlock]) -> None:
        for block in blocks:
            if block.key not in self.hooks:
                self.hooks[block.key] = register_head_output_hooks([block], self.gate_heads)
                if block.family.output_calls > 1 and block.n_heads:
                    self.hooks[block.key].append(block.core.register_forward_pre_hook(self._new_call(block.key)))

    def unhook(self) -> None:
        for handles in self.hooks.values():
            handles.remove()
        self.hooks.clear()
        self.drawn.clear()
        for hook in self.pass_hooks:
            hook.remove()
        self.pass_hooks.clear()


class GateHandle:
    """One attached gate set; :meth:`remove` takes it off and leaves the others in place."""

    def __init__(self, model: nn.Module, name: str) -> None:
        self.model, self.name = model, name

    def remove(self) -> HeadGates | None:
        stack = self.model.__dict__.get(_STACK)
        gates = stack.sets.pop(self.name, None) if stack is not None else None
        if gates is not None:
            delattr(self.model, self.name)
        if stack is not None and not stack.sets:
            stack.unhook()
            del self.model.__dict__[_STACK]
        discard_compiled_code(_GATING)  # compiled with the gates: it would keep them
        return gates


@checked_keywords()
def attach_gates(model: nn.Module, gates: HeadGates) -> GateHandle:
    """Register ``gates`` as a sub-module of ``model`` and gate every block it names.

    Gate sets stack: each one attached multiplies the heads' outputs, in the order attached,
    through one pre-hook per gated block. The first set is ``model.headlab_gates``, the next
    ``model.headlab_gates_1`` and so on, so learnable gates are in ``parameters()`` and
    ``state_dict()``. The returned handle's ``remove()`` detaches this set only.
    """
    blocks = _check_gates_fit(attention_blocks(model), gates)
    parameter = next(model.parameters(), None)
    if parameter is not None:
        gates.to(parameter.device)
    gates.train(model.training)  # a stochastic gate follows the model's mode: sampled in training only
    stack = model.__dict__.setdefault(_STACK, _GateStack())
    name, i = GATES_ATTRIBUTE, 0
    while hasattr(model, name):
        i += 1
        name = f"{GATES_ATTRIBUTE}_{i}"
    model.add_module(name, gates)
    stack.sets[name] = gates
    handle = GateHandle(model, name)
    try:
        stack.hook(blocks)
        if not stack.pass_hooks and gates.keeps_pass:
            stack.pass_hooks = [model.register_forward_pre_hook(stack.new_pass), model.register_forward_hook(stack.end_pass)]
    except BaseException:
        handle.remove()
        raise
    discard_compiled_code(_GATING)  # compiled without the gates: it would not see them
    return handle


@checked_keywords()
def detach_gates(model: nn.Module, gates: HeadGates | None = None) -> HeadGates | None:
    """Remove ``gates`` (default: every attached set) with its hooks; return the last removed
    module (or None)."""
    stack = model.__dict__.get(_STACK)
    removed = None
    for name, attached in list(stack.sets.items()) if stack is not None else []:
        if gates is None or attached is gates:
            removed = GateHandle(model, name).remove()
    return removed


def attached_gates(model: nn.Module) -> list[str]:
    """The names of the gate sets attached to ``model`` (``headlab_gates``, ``headlab_gates_1``, ...), in the order
    attached: :func:`mask_heads` and :func:`attach_gates` put them there; [] when none is."""
    stack = model.__dict__.get(_STACK)
    return list(stack.sets) if stack is not None else []


_MEASURING = "_headlab_measuring"  # in model.__dict__: how many of headlab's measurements are running on it


def refuse_gated(model: nn.Module, what: str, instead: str = "") -> None:
    """Refuse to measure ``what`` on a model with gates attached: they scale heads' outputs, so every later layer
    computes on the gated model, and a table would not say which heads were switched off or by how much. ``instead``:
    the caller's own way to measure with heads masked, said first. Inside :func:`measuring` nothing is refused: the
    gates there are the measurement's own (its ``mask=``, ablation's masks, gradient importance's gates at 1), the
    caller's were refused on the way in. A Falcon with ALiBi loaded with eager attention, which adds the bias twice, is
    refused here too, inside :func:`measuring` as well (:func:`headlab.adapters.eager_alibi.refuse_alibi_twice`), and a
    PaliGemma whose SDPA skips its causal mask (:func:`headlab.adapters.refuse_mask_skip`), and a model that
    transformers runs wrongly under flex attention (:func:`headlab.adapters.refuse_broken_flex`: Doge, T5)."""
    refuse_alibi_twice(model, what)
    refuse_mask_skip(model, what)
    refuse_broken_flex(model, what)
    names = attached_gates(model)
    if names and not model.__dict__.get(_MEASURING):
        way = f"{instead}, or " if instead else ""
        raise HeadlabError(f"{what}: the model has gates attached ({', '.join(names)}: headlab.mask_heads or "
                           "attach_gates), which scale heads' outputs; its tables would be the gated model's without "
                           f"saying so: {way}run it outside the mask_heads block (or after detach_gates), or prune the "
                           "heads (headlab.prune_heads) and analyse the pruned model")


@contextmanager
def measuring(model: nn.Module, what: str, instead: str = "") -> Iterator[None]:
    """A public entry point that measures heads (an importance measure's ``run``, ``compute_confidence``, ...):
    gates the caller attached before the call are refused (:func:`refuse_gated`), and those the measurement attaches
    itself inside the block are its own, also for the entry points it calls (``run(mask=)`` calls the measure's
    function inside ``mask_heads``; ablation masks each head in turn). Nested blocks check nothing more."""
    refuse_gated(model, what, instead)
    model.__dict__[_MEASURING] = model.__dict__.get(_MEASURING, 0) + 1
    try:
        with running_eagerly():  # its hooks come and go: compiled code would not see them (headlab.compiled)
            yield
    finally:
        left = model.__dict__.pop(_MEASURING) - 1
        if left:
            model.__dict__[_MEASURING] = left


def measures_heads(what: str, instead: str = "") -> Callable[[_Function], _Function]:
    """:func:`measuring` around a function whose first argument is the model (``compute_confidence``, ...)."""
    def wrap(function: _Function) -> _Function:
        @functools.wraps(function)
        def measured(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
            model = uncompiled(model)  # torch.compile's wrapper: its model (headlab.compiled)
            with measuring(model, what, instead):
                return function(model, *args, **kwargs)
        return cast(_Function, measured)
    return wrap


@checked_keywords()
@contextmanager
def gates_attached(model: nn.Module, gates: HeadGates) -> Iterator[HeadGates]:
    """Attach ``gates`` for the duration of the block; always detach them (only them) on exit."""
    handle = attach_gates(model, gates)
    try:
        yield gates
    finally:
        handle.remove()


@checked_keywords()
@contextmanager
def mask_heads(model: nn.Module, heads: HeadSpec) -> Iterator[None]:
    """Switch off the heads in ``heads`` (``{(kind, layer): [head, ...]}``) inside the block.

    Each named head's output is multiplied by 0 at the input of the output projection.
    Bad specs raise :class:`HeadlabError` before anything is attached.
    """
    from headlab.portable import check_pruned_numbering

    check_pruned_numbering(model, attention_blocks(model))  # a pruned directory loaded without headlab: renumbered
    with masked_heads(model, heads):
        yield


@contextmanager
def masked_heads(model: nn.Module, heads: HeadSpec) -> Iterator[None]:
    """:func:`mask_heads` for headlab's own calls on a model whose numbering it knows (load_pruned
    masks the full model it rebuilds, before the pruning record is applied)."""
    gates = ConstantGates.from_mask(attention_blocks(model), heads)
    with gates_attached(model, gates):
        yield
