"""Pruning heads with Hard Concrete gates and a relaxed L0 penalty (Voita et al. 2019, Sec. 6).

* :class:`HardConcreteGates` - one stochastic gate per head (Louizos et al. 2018);
* :func:`prune_train` - gated fine-tuning (L_xent + lambda L_C, or a head budget) and export of
  the physically pruned model;
* :func:`run_sweep` - a list of lambda (or budget) points, resumable, with its table;
* :mod:`headlab.pruning.baselines` - random, Michel et al. 2019, score-ranked and from-scratch
  baselines at equal head counts.
"""

from headlab._lazy import lazy_exports

_EXPORTS = {
    "LagrangianBudget": "headlab.pruning.budget",
    "HardConcreteGates": "headlab.pruning.hard_concrete",
    "PruneConfig": "headlab.pruning.config",
    "PruneResult": "headlab.pruning.train",
    "prune_train": "headlab.pruning.train",
    "read_trajectory": "headlab.pruning.train",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
