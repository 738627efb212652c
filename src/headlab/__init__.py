"""headlab: which attention heads of a Transformer matter, what they do, and how to prune the rest.

The foundation every analysis plugs into:

* :func:`attention_blocks` - the canonical view of a model's attention layers;
* :func:`capture_attention` - attention probabilities ``[batch, n_heads, q_len, k_len]``;
* :func:`mask_heads`, :func:`attach_gates` - switch heads off or gate them (Voita et al. 2019, Sec. 6.1);
  :class:`HardConcreteGates` - the stochastic gates of the paper's pruning (Louizos et al. 2018);
* :func:`prune_heads`, :func:`save_pruned`, :func:`load_pruned` - physical removal; :func:`save_adapter`,
  :func:`load_adapter` - a PEFT adapter of a pruned model, with the heads it was trained on;
* :class:`HeadScores` - one ``[n_layers, n_heads]`` table per attention kind;
* :func:`language_model_of` - the language model inside a multimodal wrapper headlab refuses as a whole.

The one-call API (:mod:`headlab.api`), on a model already loaded and data in memory:
:func:`analyze` -> :class:`Analysis`, and the single steps :func:`importance`, :func:`functions`,
:func:`aggregate` (callable packages: ``headlab.importance.run_importance`` is still there) and
:func:`prune`.
"""

from importlib import import_module

from headlab._lazy import lazy_exports
from headlab._version import __version__ as __version__  # re-exported
from headlab._version import require_python

require_python()  # Python 3.10: refused here, naming both versions, before any module that needs 3.11 is read

_EXPORTS = {  # module -> the names it exports
    "headlab.api": ("Analysis", "analyze", "prune"),
    "headlab.adapters": ("AttentionBlock", "attention_blocks"),
    "headlab.capture": ("capture_attention", "eager_attention", "head_output_hooks"),
    "headlab.errors": ("HeadlabError",),
    "headlab.gates": ("ConstantGates", "HeadGates", "ScalarGates", "attach_gates", "detach_gates", "gates_attached",
                      "mask_heads"),
    "headlab.heads": ("KINDS", "HeadScores"),
    "headlab.language_model": ("language_model_of",),
    "headlab.pruning.hard_concrete": ("HardConcreteGates",),
    "headlab.surgery": ("count_parameters", "load_adapter", "load_pruned", "prune_heads", "pruning_record", "save_adapter",
                        "save_pruned"),
}

_CALLABLE_PACKAGES = ("aggregate", "functions", "importance")
"""Subpackages (and a module) that are also the API's functions (:func:`headlab._lazy.callable_module`)."""

_getattr, _dir, __all__ = lazy_exports(__name__, _EXPORTS, also=("__version__", *_CALLABLE_PACKAGES))


def __dir__():
    return sorted({*_dir(), *_CALLABLE_PACKAGES})


def __getattr__(name: str):
    if name in _CALLABLE_PACKAGES:
        return import_module(f"{__name__}.{name}")
    return _getattr(name)
