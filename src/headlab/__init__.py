"""headlab: which attention heads of a Transformer matter, what they do, and how to prune the rest.

The foundation every analysis plugs into:

* :func:`attention_blocks` - the canonical view of a model's attention layers;
* :func:`capture_attention` - attention probabilities ``[batch, n_heads, q_len, k_len]``;
* :func:`mask_heads`, :func:`attach_gates` - switch heads off or gate them (Voita et al. 2019, Sec. 6.1);
  :class:`HardConcreteGates` - the stochastic gates of the paper's pruning (Louizos et al. 2018);
* :func:`prune_heads`, :func:`save_pruned`, :func:`load_pruned` - physical removal;
* :class:`HeadScores` - one ``[n_layers, n_heads]`` table per attention kind.
"""

from headlab._lazy import lazy_exports
from headlab._version import __version__

_EXPORTS = {
    "AttentionBlock": "headlab.adapters",
    "attention_blocks": "headlab.adapters",
    "capture_attention": "headlab.capture",
    "eager_attention": "headlab.capture",
    "head_output_hooks": "headlab.capture",
    "HeadlabError": "headlab.errors",
    "ConstantGates": "headlab.gates",
    "HeadGates": "headlab.gates",
    "ScalarGates": "headlab.gates",
    "attach_gates": "headlab.gates",
    "detach_gates": "headlab.gates",
    "gates_attached": "headlab.gates",
    "mask_heads": "headlab.gates",
    "KINDS": "headlab.heads",
    "HeadScores": "headlab.heads",
    "HardConcreteGates": "headlab.pruning.hard_concrete",
    "count_parameters": "headlab.surgery",
    "load_pruned": "headlab.surgery",
    "prune_heads": "headlab.surgery",
    "pruning_record": "headlab.surgery",
    "save_pruned": "headlab.surgery",
}

__all__ = [*sorted(_EXPORTS), "__version__"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
