"""Pruning heads with Hard Concrete gates and a relaxed L0 penalty (Voita et al. 2019, Sec. 6).

* :class:`HardConcreteGates` - one stochastic gate per head (Louizos et al. 2018);
* :func:`prune_train` - gated fine-tuning (L_xent + lambda L_C, or a head budget) and export of
  the physically pruned model;
* :func:`run_sweep` - a list of lambda (or budget) points, resumable, with its table;
* :mod:`headlab.pruning.baselines` - random, Michel et al. 2019, score-ranked and from-scratch
  baselines at equal head counts.
"""

from headlab._lazy import lazy_exports

_EXPORTS = {  # module -> the names it exports
    "headlab.pruning.budget": ("LagrangianBudget",),
    "headlab.pruning.hard_concrete": ("HardConcreteGates",),
    "headlab.pruning.config": ("PruneConfig",),
    "headlab.pruning.train": ("PruneResult", "prune_train", "read_trajectory"),
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
