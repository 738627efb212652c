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
call draws, the others and a gradient checkpoint's recomputation reuse it; each top-level forward of the
model the gates are attached to, and train()/eval(), forget it), and one log_alpha, counted once in the
penalty, in ``n_gates``, the budget and the summaries: a tied head is one gate, one set of parameters.

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

import math
from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from headlab.errors import HeadlabError, counted
from headlab.gates import BlockKey, HeadGates, block_name
from headlab.heads import KINDS, HeadScores
from headlab.pruning.config import DEFAULT_BETA, DEFAULT_GAMMA, DEFAULT_ZETA

__all__ = ["HardConcreteGates", "gate_count", "DEFAULT_BETA", "DEFAULT_GAMMA", "DEFAULT_ZETA"]

_EPS = 1e-6


def _in_backward() -> bool:
    """Inside a backward pass (gradient checkpointing recomputing a forward): torch's own test, as
    torch.utils.checkpoint makes it."""
    return torch._C._current_graph_task_id() != -1


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
        # The noise u of the pass, per gate of its own (see gate()): emptied at each top-level forward of
        # the model the gates are attached to (attach_gates' pre-hook: new_pass) and by train()/eval().
        self._noise: dict[BlockKey, torch.Tensor] = {}
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
            if not self.tied:
                return self.sample(log_alpha)  # [n_heads], one draw per forward call, i.e. per batch
            # Shared weights: one draw per pass for all their depths. The first depth (the gate's own
            # key) draws when it runs forward; the later depths, and every depth recomputed in the
            # backward (gradient checkpointing, after the whole pass), reuse that noise. The noise is
            # kept, not the gate: a gate recomputed from it carries the gradient of log_alpha even
            # when the pass ran under no_grad (reentrant checkpointing).
            own = self.tied.get(key, key)
            u = self._noise.get(own)
            if u is None or (own == key and not _in_backward()):
                u = self._noise[own] = self._uniform(log_alpha)
            return self._stretched(u, log_alpha)
        if self.keep is not None:
            return self._budget_mask()[key].to(log_alpha.device, log_alpha.dtype)
        return self.deterministic(log_alpha.detach())

    @property
    def keeps_pass(self) -> bool:  # type: ignore[override]  # the draw of shared weights, for one pass
        return bool(self.tied)

    def new_pass(self) -> None:
        """Forget the pass's noise: the next depth of shared weights to run draws afresh, and none reads a
        draw of another pass (one that failed mid-way, one before train()/eval(), one whose first depth
        did not run)."""
        self._noise.clear()

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
        block has its gate's."""
        return {key: 1 - self.p_zero(self._alpha(key).detach().float()).cpu() for key in self.all_keys()}

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

    def keep_top(self, keep: int) -> dict[BlockKey, list[int]]:
        """The heads to remove so that exactly ``keep`` heads remain: those with the highest
        log_alpha (equivalently the highest P(open)) stay. Used by the budget mode. ``keep`` counts
        gates of their own (:meth:`n_gates`); a tied depth loses its gate's heads."""
        total = self.n_gates()
        if not 0 <= keep <= total:
            raise HeadlabError(f"cannot keep {counted(keep, 'head')}: the gates cover {counted(total, 'head')}")
        ranked: list[tuple[float, BlockKey, int]] = []
        for key in self.keys():
            values = self.log_alpha[block_name(key)].detach().float().cpu().tolist()
            ranked.extend((value, key, head) for head, value in enumerate(values))
        # Highest first; ties broken by position so the result is deterministic.
        ranked.sort(key=lambda item: (-item[0], KINDS.index(item[1][0]), item[1][1], item[2]))
        spec: dict[BlockKey, list[int]] = {}
        for _, key, head in ranked[keep:]:
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
