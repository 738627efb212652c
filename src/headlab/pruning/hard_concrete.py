"""Hard Concrete gates on heads and their relaxed L0 penalty.

Louizos, Welling & Kingma 2018 ("Learning Sparse Neural Networks through L0 Regularization"),
as used by Voita et al. 2019, Sec. 6.1. Each head h has one parameter ``log_alpha_h``; with
temperature beta and stretch interval (gamma, zeta) = (-0.1, 1.1):

    u ~ U(0, 1)
    s = sigmoid((log u - log(1 - u) + log_alpha) / beta)        Louizos et al. 2018, Eq. (10)
    g = min(1, max(0, s * (zeta - gamma) + gamma))               Eq. (11) (stretch, then clamp)

so g has point masses at 0 and 1 and a density on (0, 1). The expected number of non-zero
gates has a closed form (Eq. (12)):

    L_C = sum_h (1 - P(g_h = 0)) = sum_h sigmoid(log_alpha_h - beta * log(-gamma / zeta))

Attention weights shared by several depths (ALBERT's shared layers, Zamba's tied transformer:
:func:`headlab.adapters.sharing_groups`) have one gate per head of the weights, used at every depth
that runs them (``tied``): removing the head removes it at each depth, so the gated model is the one
the export prunes, and the plan always agrees across those depths. One draw per pass (the first depth's
call draws, the others reuse it; each top-level forward of the model the gates are attached to, and
train()/eval(), start a new pass), and one log_alpha, counted once in the penalty, in ``n_gates``, the
budget and the summaries: a tied head is one gate, one set of parameters.

Gradient checkpointing runs each layer again in the backward, after every forward made before it (two
passes, then one backward of the sum of their losses). Each call of a gate in training records its noise
under torch's RNG state at the call, which torch.utils.checkpoint restores before recomputing a layer
(``preserve_rng_state=True``, its default): the recomputation finds the noise of its own call, of its own
pass. Every call draws once, recomputation too, so the RNG runs as in the forward (dropout after the gate
draws the same) and no two calls share a state. Without that replay (``preserve_rng_state=False``) the
recomputation reads the one pass whose graph is alive, and is refused when several are. A pass's record
lives as long as its graph (it is kept in the ``grad_fn`` metadata of the model's outputs).

At test time each gate is 0 or 1, whichever of P(g = 0) and P(g = 1) is larger (Voita et al.
2019, footnote 7), with

    P(g = 0) = sigmoid(beta * log(-gamma / zeta) - log_alpha)
    P(g = 1) = sigmoid(log_alpha - beta * log((1 - gamma) / (zeta - 1)))

In training mode a fresh gate vector is drawn for every forward call of a block, i.e. for every
batch (reparameterisation trick: the noise u carries no gradient, log_alpha does). In eval mode
(``model.eval()``) the gates are the deterministic 0/1 values above, or, with a head budget
(``keep``), 1 for the ``keep`` heads of highest log_alpha: the heads the budget mode exports,
so that what is evaluated during fine-tuning is the model that would be exported.
"""

from __future__ import annotations

import hashlib
import math
import weakref
from collections.abc import Mapping
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from headlab.errors import HeadlabError, counted
from headlab.gates import BlockKey, HeadGates, block_name
from headlab.heads import KINDS, HeadScores, cut_tie
from headlab.pruning.config import DEFAULT_BETA, DEFAULT_GAMMA, DEFAULT_ZETA

__all__ = ["HardConcreteGates", "gate_count", "DEFAULT_BETA", "DEFAULT_GAMMA", "DEFAULT_ZETA"]

_EPS = 1e-6

_PASSES = "headlab_hard_concrete_passes"  # the key in a model output's grad_fn.metadata: the passes it holds


def _in_backward() -> bool:
    """Inside a backward pass (gradient checkpointing recomputing a forward): torch's own test, as
    torch.utils.checkpoint makes it."""
    return torch._C._current_graph_task_id() != -1


def _rng_digest(device: torch.device) -> bytes:
    """The state of the generator that draws on ``device`` (the one torch.utils.checkpoint stashes and
    restores), hashed: it names one call of one pass in the forward and in its recomputation."""
    if device.type == "cpu":
        state = torch.get_rng_state()
    else:
        state = getattr(torch, device.type).get_rng_state(device)
    return hashlib.blake2b(state.numpy().tobytes(), digest_size=16).digest()


def _output_tensors(output: Any) -> list[torch.Tensor]:
    """The tensors of a model's output (a ModelOutput, a tuple, nested)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, Mapping):
        output = list(output.values())
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _output_tensors(item)]
    return []


_Call = tuple[BlockKey, bytes]  # a gate's block and the RNG state when it was called


class _Pass:
    """The noise of one forward pass: ``noise`` per gate of its own (what later depths of tied gates reuse),
    ``calls`` per call (what gradient checkpointing's recomputation of that call reads)."""

    __slots__ = ("noise", "calls", "__weakref__")

    def __init__(self) -> None:
        self.noise: dict[BlockKey, torch.Tensor] = {}
        self.calls: dict[_Call, torch.Tensor] = {}


class _Replay:
    """The live passes (held weakly: a pass is forgotten with its graph, see :meth:`HardConcreteGates.end_pass`) and
    the current one; a call is found by its block and RNG state among them. Not copied or pickled: a copy of the
    gates starts without passes."""

    def __init__(self) -> None:
        self.passes: weakref.WeakSet[_Pass] = weakref.WeakSet()
        self.new_pass()

    def new_pass(self) -> None:
        self.current = _Pass()  # the last one stays alive with its graph, if it has one
        self.passes.add(self.current)

    def __deepcopy__(self, memo: dict) -> "_Replay":
        return _Replay()

    def __reduce__(self) -> tuple:
        return (_Replay, ())

    def record(self, call: _Call, u: torch.Tensor) -> None:
        """``call`` of the current pass used the noise ``u``."""
        self.current.calls[call] = u

    def find(self, call: _Call) -> torch.Tensor:
        """The noise of ``call`` for its recomputation, or a HeadlabError: never another call's."""
        key = call[0]
        live = [p for p in self.passes if p.calls]
        found = [p.calls[call] for p in live if call in p.calls]
        if found and all(torch.equal(u, found[0]) for u in found[1:]):  # two passes at one state: the same draw
            return found[0]
        # Not found (the RNG state not replayed: preserve_rng_state=False): sure only of one live pass's one call of
        # the block. Found with other noises: the RNG seeded again inside a pass.
        candidates = [u for p in live for (k, _), u in p.calls.items() if k == key]
        if not found and len(live) == 1 and len(candidates) == 1:
            return candidates[0]
        raise HeadlabError(
            f"gradient checkpointing recomputed the Hard Concrete gates of {key[0]} layer {key[1]} and their noise "
            f"cannot be told apart from another's ({counted(len(live), 'pass', 'passes')} alive): torch's RNG is not replayed "
            "in the recomputation (torch.utils.checkpoint's preserve_rng_state=False) or was seeded again inside a "
            "pass; leave preserve_rng_state at its default (True), or call backward after each forward")


class HardConcreteGates(HeadGates):
    """One Hard Concrete gate per head (Louizos et al. 2018; Voita et al. 2019, Sec. 6.1).

    ``init_log_alpha`` sets every log_alpha at the start; the default 3.0 gives
    P(g = 0) ~ 0.02 with beta = 0.33, so fine-tuning starts from (almost) the full model.
    """

    def __init__(
        self,
        n_heads: Mapping[BlockKey, int],
        beta: float = DEFAULT_BETA,
        gamma: float = DEFAULT_GAMMA,
        zeta: float = DEFAULT_ZETA,
        init_log_alpha: float = 3.0,
        keep: int | None = None,
        tied: Mapping[BlockKey, BlockKey] | None = None,
    ):
        super().__init__(n_heads)
        # a depth of shared weights -> the depth whose gate it uses (the first of them): one gate per shared head
        self.tied = dict(tied or {})
        bad = [(key, to) for key, to in self.tied.items()
               if key not in self.n_heads or to not in self.n_heads or to in self.tied or self.n_heads[key] != self.n_heads[to]]
        if bad:
            raise HeadlabError(f"tied gates {bad[0][0]} -> {bad[0][1]}: both must be gated, with as many heads, "
                               "and the gate tied to must be a gate of its own")
        # The noise of the pass (see gate()): a new pass at each top-level forward of the model the gates are
        # attached to (attach_gates' pre-hook: new_pass) and at train()/eval(); the calls of live passes.
        self._replay = _Replay()
        if not beta > 0:
            raise HeadlabError(f"Hard Concrete temperature beta must be > 0, got {beta}")
        if not (gamma < 0 and zeta > 1):
            raise HeadlabError(f"the stretch interval needs gamma < 0 < 1 < zeta, got ({gamma}, {zeta})")
        self.beta, self.gamma, self.zeta = float(beta), float(gamma), float(zeta)
        self.log_alpha = nn.ParameterDict(
            {block_name(key): nn.Parameter(torch.full((n,), float(init_log_alpha)))
             for key, n in self.n_heads.items() if key not in self.tied}
        )
        self.keep = keep  # the budget: eval mode opens the `keep` heads of highest log_alpha
        self._budget_cache: tuple[tuple[int, ...], dict[BlockKey, torch.Tensor]] | None = None

    # -- the distribution ----------------------------------------------------------------------
    @property
    def _shift_zero(self) -> float:
        return self.beta * math.log(-self.gamma / self.zeta)  # beta log(-gamma/zeta), Eq. (12)

    @property
    def _shift_one(self) -> float:
        return self.beta * math.log((1 - self.gamma) / (self.zeta - 1))

    def sample(self, log_alpha: torch.Tensor) -> torch.Tensor:
        """A reparameterised sample of the gates for ``log_alpha`` (Louizos et al. 2018, Eq. (10)-(11))."""
        return self._stretched(self._uniform(log_alpha), log_alpha)

    @staticmethod
    def _uniform(log_alpha: torch.Tensor) -> torch.Tensor:
        return torch.rand_like(log_alpha).clamp(_EPS, 1 - _EPS)  # u ~ U(0, 1), away from log(0)

    def _stretched(self, u: torch.Tensor, log_alpha: torch.Tensor) -> torch.Tensor:
        """The gate for noise ``u``: Eq. (10), then Eq. (11)."""
        s = torch.sigmoid((torch.log(u) - torch.log1p(-u) + log_alpha) / self.beta)
        return (s * (self.zeta - self.gamma) + self.gamma).clamp(0.0, 1.0)

    def p_zero(self, log_alpha: torch.Tensor) -> torch.Tensor:
        """P(g = 0), closed form."""
        return torch.sigmoid(self._shift_zero - log_alpha)

    def p_one(self, log_alpha: torch.Tensor) -> torch.Tensor:
        """P(g = 1), closed form."""
        return torch.sigmoid(log_alpha - self._shift_one)

    def deterministic(self, log_alpha: torch.Tensor) -> torch.Tensor:
        """The test-time gate: 1 where P(g=1) > P(g=0), else 0 (Voita et al. 2019, footnote 7)."""
        return (self.p_one(log_alpha) > self.p_zero(log_alpha)).to(log_alpha.dtype)

    @classmethod
    def for_model(cls, model: nn.Module, kinds: tuple[str, ...] | None = None, **kwargs) -> "HardConcreteGates":
        """Gates on every head of ``kinds``; where depths share attention weights (:func:`sharing_groups`), one gate
        per shared head, the first depth's, tied at the others."""
        from headlab.adapters import attention_blocks, sharing_groups

        gated = [b for b in attention_blocks(model) if not b.idle and (kinds is None or b.kind in kinds)]
        keys = {b.key for b in gated}
        tied = {b.key: group[0].key for group in sharing_groups(gated) for b in group[1:] if group[0].key in keys}
        return cls({b.key: b.n_heads for b in gated}, tied=tied, **kwargs)

    def _alpha(self, key: BlockKey) -> torch.Tensor:
        return self.log_alpha[block_name(self.tied.get(key, key))]

    def gate(self, key: BlockKey) -> torch.Tensor:
        log_alpha = self._alpha(key)
        if self.training:
            return self._stretched(self._pass_noise(key, log_alpha), log_alpha)  # [n_heads], per forward call
        if self.keep is not None:
            return self._budget_mask()[key].to(log_alpha.device, log_alpha.dtype)
        return self.deterministic(log_alpha.detach())

    @property
    def _noise(self) -> dict[BlockKey, torch.Tensor]:
        """The current pass's noise per gate of its own."""
        return self._replay.current.noise

    def _pass_noise(self, key: BlockKey, log_alpha: torch.Tensor) -> torch.Tensor:
        """The noise u of this call. A gate of its own draws at each forward call (each batch). Shared weights:
        one draw per pass for all their depths, the first depth's (the gate's own key); the later depths reuse
        it. The noise is kept, not the gate: a gate recomputed from it carries the gradient of log_alpha even
        when the pass ran under no_grad (reentrant checkpointing). In the backward (gradient checkpointing
        recomputing the layer) the call's own noise, found by the RNG state at the call (see the module's
        docstring)."""
        call = (key, _rng_digest(log_alpha.device))
        drawn = self._uniform(log_alpha)  # every call draws, recomputation too: the RNG runs as in the forward
        if _in_backward():
            return self._replay.find(call)
        own, noise = self.tied.get(key, key), self._replay.current.noise
        if own == key or own not in noise:  # a later depth whose first did not run in this pass draws its own
            noise[own] = drawn
        self._replay.record(call, noise[own])
        return noise[own]

    keeps_pass = True
    """A new pass per forward of the model (the noise of tied depths), and the pass's calls kept with its graph
    (:meth:`end_pass`) for gradient checkpointing's recomputation."""

    def new_pass(self) -> None:
        """Start a new pass: the next depth of shared weights to run draws afresh, and none reads a draw of
        another pass (one that failed mid-way, one before train()/eval(), one whose first depth did not run).
        The passes before stay recorded as long as their graphs (for their recomputation). A model forward
        recomputed in a backward (the whole model checkpointed) is the same pass, not a new one."""
        if not _in_backward():
            self._replay.new_pass()

    def end_pass(self, output: Any) -> None:
        """Keep the pass's record with the graph of the model's ``output``: gradient checkpointing recomputes
        its layers whenever that graph is backpropagated, after any number of later passes."""
        for tensor in _output_tensors(output):
            if tensor.grad_fn is not None:
                metadata = cast(dict, tensor.grad_fn.metadata)  # a dict on autograd's nodes (torch types it a method)
                metadata.setdefault(_PASSES, []).append(self._replay.current)

    def train(self, mode: bool = True) -> "HardConcreteGates":
        self.new_pass()
        return super().train(mode)

    def _budget_mask(self) -> dict[BlockKey, torch.Tensor]:
        """:meth:`open_mask` under a budget, ranked once per change of log_alpha (not once per
        block and decoding step)."""
        versions = tuple(p._version for p in self.log_alpha.values())  # bumped by every in-place update
        if self._budget_cache is None or self._budget_cache[0] != versions:
            self._budget_cache = (versions, self.open_mask())
        return self._budget_cache[1]

    # -- penalty and summaries -----------------------------------------------------------------
    def l0_penalty(self) -> torch.Tensor:
        """L_C = sum_h (1 - P(g_h = 0)), the expected number of open gates (Louizos Eq. (12))."""
        terms = [torch.sigmoid(a - self._shift_zero).sum() for a in self.log_alpha.values()]
        return torch.stack(terms).sum()

    def n_gates(self) -> int:
        """Gates of their own: a head of weights shared by several depths counts once."""
        return sum(self.n_heads[key] for key in self.keys())

    def keys(self) -> list[BlockKey]:
        """Gated blocks with gates of their own in canonical order (kind as in KINDS, then layer): a depth whose
        gate is tied to another's (``tied``) is left out, see :meth:`all_keys`."""
        return [key for key in self.all_keys() if key not in self.tied]

    def all_keys(self) -> list[BlockKey]:
        """Every gated block in canonical order, tied ones too."""
        return sorted(self.n_heads, key=lambda key: (KINDS.index(key[0]), key[1]))

    @torch.no_grad()
    def p_open(self) -> dict[BlockKey, torch.Tensor]:
        """1 - P(g = 0) per block (the quantity the penalty counts, once per gate of its own: :meth:`keys`); a tied
        block has its gate's. In float64, from the penalty's own form sigmoid(log_alpha - shift): in float32 it rounds
        gates a few ulps of log_alpha apart to one value (near P = 0.98 one ulp of P is ten of log_alpha's), and a
        ranking by P(open) (the from-scratch run of a point, ``--method scores``) then broke their tie by position
        where :meth:`keep_top` and footnote 7's rule, reading log_alpha, had not."""
        return {key: torch.sigmoid(self._alpha(key).detach().double().cpu() - self._shift_zero)
                for key in self.all_keys()}

    @torch.no_grad()
    def open_mask(self) -> dict[BlockKey, torch.Tensor]:
        """Test-time gates per block (tied ones too), as bool [n_heads]: footnote 7's rule, or the budget's top
        ``keep``."""
        if self.keep is not None:
            closed = self.keep_top(self.keep)
            return {key: torch.tensor([h not in closed.get(key, ()) for h in range(self.n_heads[key])])
                    for key in self.all_keys()}
        return {key: self.deterministic(self._alpha(key).detach().float()).bool().cpu()
                for key in self.all_keys()}

    def closed_heads(self) -> dict[BlockKey, list[int]]:
        """Heads whose test-time gate is 0: a head spec for :func:`headlab.prune_heads` (with a
        budget, :meth:`keep_top`); the same heads at every depth of tied gates."""
        spec = {}
        for key, mask in self.open_mask().items():
            closed = [h for h in range(len(mask)) if not mask[h]]
            if closed:
                spec[key] = closed
        return spec

    def _ranked(self) -> list[tuple[float, BlockKey, int]]:
        """(log_alpha, block, head) of every gate of its own, highest first, ties by position (:meth:`keep_top`)."""
        ranked: list[tuple[float, BlockKey, int]] = []
        for key in self.keys():
            values = self.log_alpha[block_name(key)].detach().float().cpu().tolist()
            ranked.extend((value, key, head) for head, value in enumerate(values))
        ranked.sort(key=lambda item: (-item[0], KINDS.index(item[1][0]), item[1][1], item[2]))
        return ranked

    def budget_tie(self) -> dict[str, int] | None:
        """Where the budget's cut (:meth:`keep_top` at ``keep``) falls among gates of equal log_alpha, so that
        position, not the gates, chose which of them stay: ``{"tied": n, "kept": m}`` (m of the n kept); None
        without a budget or a tie at the cut. Every gate is tied at initialisation: a budget run's step-0 point."""
        if self.keep is None:
            return None
        tie = cut_tie([value for value, _, _ in self._ranked()], self.keep)
        return None if tie is None else {"tied": tie["tied"], "kept": tie["kept"]}

    def keep_top(self, keep: int) -> dict[BlockKey, list[int]]:
        """The heads to remove so that exactly ``keep`` heads remain: those with the highest
        log_alpha (equivalently the highest P(open)) stay. Used by the budget mode. ``keep`` counts
        gates of their own (:meth:`n_gates`); a tied depth loses its gate's heads."""
        total = self.n_gates()
        if not 0 <= keep <= total:
            raise HeadlabError(f"cannot keep {counted(keep, 'head')}: the gates cover {counted(total, 'head')}")
        # Highest first; ties broken by position so the result is deterministic (budget_tie says where it decided).
        spec: dict[BlockKey, list[int]] = {}
        for _, key, head in self._ranked()[keep:]:
            spec.setdefault(key, []).append(head)
        for key, owner in self.tied.items():
            if owner in spec:
                spec[key] = list(spec[owner])
        return {key: sorted(heads) for key, heads in sorted(spec.items(), key=lambda kv: (KINDS.index(kv[0][0]), kv[0][1]))}

    def open_per_kind(self) -> dict[str, int]:
        """Open gates per kind, a tied head once (as :meth:`n_gates` counts it)."""
        counts: dict[str, int] = {}
        for key, mask in self.open_mask().items():
            if key not in self.tied:
                counts[key[0]] = counts.get(key[0], 0) + int(mask.sum())
        return counts

    def p_open_scores(self, model_name: str = "", model: nn.Module | None = None) -> HeadScores:
        """P(open) as a HeadScores table (NaN for blocks without gates). With the gated ``model``, a
        pruned model's heads are at their original indices, as in its other score tables."""
        numbering: dict[BlockKey, tuple[list[int], int]] = {}
        declared: dict = {}
        if model is not None:
            from headlab.adapters import attention_blocks
            from headlab.surgery import KEPT_ATTR, ORIGINAL_ATTR, declared_numbering  # what pruning kept, in original numbering

            declared = declared_numbering(model)  # a re-saved model's reconstructed head numbers, said

            for block in attention_blocks(model):
                kept = getattr(block.core, KEPT_ATTR, None)
                if kept is not None and block.key in self.n_heads:
                    numbering[block.key] = (list(kept), int(getattr(block.core, ORIGINAL_ATTR)))
        by_kind: dict[str, dict[int, torch.Tensor]] = {}
        for key, values in self.p_open().items():
            by_kind.setdefault(key[0], {})[key[1]] = values
        scores = {}
        for kind, layers in by_kind.items():
            n_layers = max(layers) + 1
            width = max(numbering[(kind, layer)][1] if (kind, layer) in numbering else len(values)
                        for layer, values in layers.items())
            array = np.full((n_layers, width), np.nan)
            for layer, values in layers.items():
                heads = numbering[(kind, layer)][0] if (kind, layer) in numbering else list(range(len(values)))
                array[layer, heads] = values.numpy()
            scores[kind] = array
        signature = {"beta": self.beta, "gamma": self.gamma, "zeta": self.zeta, **declared}
        return HeadScores(scores, "hard_concrete_p_open", model_name, signature)

    def extra_repr(self) -> str:
        budget = "" if self.keep is None else f", keep={self.keep}"
        tied = f", tied={len(self.tied)} blocks" if self.tied else ""
        return f"beta={self.beta}, gamma={self.gamma}, zeta={self.zeta}, gates={self.n_gates()}{budget}{tied}"


def gate_count(model: nn.Module, kinds: tuple[str, ...] | None = None) -> int:
    """How many gates :meth:`HardConcreteGates.for_model` puts on ``model``'s heads of ``kinds`` (what a budget
    counts): every head the text runs, a head of attention weights shared by several depths once."""
    from headlab.adapters import attention_blocks, sharing_groups

    gated = [b for b in attention_blocks(model) if not b.idle and (kinds is None or b.kind in kinds)]
    tied = {b.key for group in sharing_groups(gated) for b in group[1:]}
    return sum(b.n_heads for b in gated if b.key not in tied)
