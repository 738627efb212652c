"""headlab: which attention heads of a Transformer matter, what they do, and how to prune the rest.

The foundation every analysis plugs into:

* :func:`attention_blocks` - the canonical view of a model's attention layers;
* :func:`capture_attention` - attention probabilities ``[batch, n_heads, q_len, k_len]``;
* :func:`mask_heads`, :func:`attach_gates` - switch heads off or gate them (Voita et al. 2019, Sec. 6.1);
  :class:`HardConcreteGates` - the stochastic gates of the paper's pruning (Louizos et al. 2018);
* :func:`prune_heads`, :func:`save_pruned`, :func:`load_pruned` - physical removal;
* :class:`HeadScores` - one ``[n_layers, n_heads]`` table per attention kind.
"""

from headlab.adapters import AttentionBlock, attention_blocks
from headlab.capture import capture_attention, eager_attention, head_output_hooks
from headlab.errors import HeadlabError
from headlab.gates import (
    ConstantGates,
    HeadGates,
    ScalarGates,
    attach_gates,
    detach_gates,
    gates_attached,
    mask_heads,
)
from headlab.heads import KINDS, HeadScores
from headlab.pruning.hard_concrete import HardConcreteGates
from headlab.surgery import count_parameters, load_pruned, prune_heads, pruning_record, save_pruned

__version__ = "0.1.0"

__all__ = [
    "AttentionBlock",
    "ConstantGates",
    "HardConcreteGates",
    "HeadGates",
    "HeadScores",
    "HeadlabError",
    "KINDS",
    "ScalarGates",
    "attach_gates",
    "attention_blocks",
    "capture_attention",
    "count_parameters",
    "detach_gates",
    "eager_attention",
    "gates_attached",
    "head_output_hooks",
    "load_pruned",
    "mask_heads",
    "prune_heads",
    "pruning_record",
    "save_pruned",
]
