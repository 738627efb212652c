"""Pruned directories that plain transformers loads, with no headlab installed.

:func:`headlab.save_pruned` calls :func:`make_portable` after writing the weights:

* **standard config**: when the family's config can state the head size apart from the model
  width (Llama, Qwen2, Mistral, Qwen3: ``head_dim``) and every layer keeps the same number of
  query and key/value heads, config.json gets the pruned counts, and
  ``AutoModelFor...from_pretrained(path)`` builds the pruned model as a standard one;
* **remote code**: otherwise (layers that differ; BERT, GPT-2, BART, Marian..., whose head size
  is the width divided by the head count) :mod:`headlab.portable_code` is copied beside the
  weights as ``pruned_heads.py`` and config.json's ``auto_map`` points at it, so that
  ``from_pretrained(path, trust_remote_code=True)`` rebuilds the model from the plan in
  config.json (``headlab_pruned``): the pruned projections' shapes and the attention modules'
  head counts. The module imports only torch and transformers.

T5 (mT5, Switch Transformers, LongT5) shares one relative position bias table across a stack: the
plan's ``shared_bias`` names each pruned stack's layers, the heads they kept and the first layer that
holds the table, and the copied module hands each layer its heads' columns of the bias, as headlab's
own hooks do (the same functions). StableLM's per-head query/key norms (``qk_layernorm``) are lists
the copied module does not resize; such a pruned model stays loadable by :func:`headlab.load_pruned`
only (the reason is recorded).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import cast

from torch import nn
from transformers import PreTrainedModel

from headlab.adapters import attention_blocks
from headlab.heads import atomic_write_text

__all__ = ["make_portable", "module_code", "restore_original_config", "standard_config_values", "CODE_FILE",
           "CLASS_NAME"]

CODE_FILE = "pruned_heads.py"
CLASS_NAME = "PrunedModel"
PLAN_KEY = "headlab_pruned"
PRUNING_FILE = "headlab_pruning.json"  # beside the weights: the heads removed (headlab.surgery writes it)

# Families whose config states the head size (head_dim) apart from the width: config fields of
# (query heads, key/value heads, head size).
_STANDARD_FIELDS = {"llama-like": ("num_attention_heads", "num_key_value_heads", "head_dim")}
_AUTO_CLASSES = ("AutoModelForSeq2SeqLM", "AutoModelForCausalLM", "AutoModelForMaskedLM",
                 "AutoModelForSequenceClassification", "AutoModel")


def standard_config_values(model: nn.Module) -> dict | None:
    """Config fields that state the pruned head counts, when a standard config can (else None)."""
    blocks = attention_blocks(model)
    fields = _STANDARD_FIELDS.get(blocks[0].family.name) if blocks else None
    shapes = {(b.n_heads, b.n_kv_heads, b.d_head) for b in blocks}
    # head_dim is one size: a model whose query/key heads are wider than its values (d_qk) needs the plan
    if fields is None or len(shapes) != 1 or any(b.d_qk != b.d_head for b in blocks):
        return None
    n_heads, n_kv_heads, d_head = shapes.pop()
    if n_heads == 0:
        return None
    return dict(zip(fields, (n_heads, n_kv_heads, d_head)))


def _transformers_accepts(model: PreTrainedModel, config: dict) -> bool:
    """Whether transformers builds its config class from ``config``: its validation can refuse
    pruned counts although ``head_dim`` states the head size (LlamaConfig wants the width to be a
    multiple of the query heads: 256 wide with 7 heads is refused), and then remote code it is."""
    try:
        type(model.config).from_dict(config)
    except Exception:  # noqa: BLE001 - huggingface_hub's StrictDataclassError is not a ValueError
        return False
    return True


def _auto_classes_of(model: nn.Module, names) -> list[str]:
    """Those of transformers' auto classes ``names`` that build ``model``'s class from its config."""
    import transformers

    found = []
    for name in names:
        mapping = getattr(getattr(transformers, name, None), "_model_mapping", None)
        try:
            if mapping is not None and type(model.config) in mapping and mapping[type(model.config)] is type(model):
                found.append(name)
        except (ImportError, KeyError):  # a mapping entry whose module needs a package not installed
            continue
    return found


def _auto_map(model: nn.Module) -> dict[str, str]:
    """config.json's auto_map: every auto class that builds ``model``'s class (AutoModelForImageTextToText for a
    multimodal wrapper too), so that each of them loads the pruned class; AutoModel as well when no auto class
    of :data:`_AUTO_CLASSES` does (it loads whatever class auto_map names). The first entry stays what it was
    when auto_map named :data:`_AUTO_CLASSES` only."""
    import transformers

    first = _auto_classes_of(model, _AUTO_CLASSES) or ["AutoModel"]
    others = [name for name in dir(transformers) if name.startswith("AutoModelFor") and name not in _AUTO_CLASSES]
    return dict.fromkeys(first + _auto_classes_of(model, others), f"{Path(CODE_FILE).stem}.{CLASS_NAME}")


def module_code(base_class: str) -> str:
    """The text of :data:`CODE_FILE` for a pruned model of transformers' class ``base_class``:
    :mod:`headlab.portable_code` with its ``BASE_CLASS`` line naming that class."""
    code = Path(__file__).with_name("portable_code.py").read_text(encoding="utf-8")
    line = 'BASE_CLASS = "PreTrainedModel"'
    if line not in code:  # pragma: no cover - guards an edit of portable_code.py
        raise RuntimeError(f"portable_code.py lost its line {line!r}")
    return code.replace(line, f"BASE_CLASS = {base_class!r}", 1)


def make_portable(model: nn.Module, path: str | Path, plan: dict) -> dict:
    """Make the pruned directory ``path`` (written by save_pruned) load without headlab;
    ``plan`` is :func:`headlab.surgery.pruning_plan` of ``model``.

    Returns how: ``{"how": "standard config" | "remote code" | None, "original_config": {...},
    "reason": ...}``, which save_pruned keeps in headlab_pruning.json so that headlab rebuilds
    the original config before applying its record.
    """
    path = Path(path)
    config_path = path / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config.pop(PLAN_KEY, None)  # a model pruned twice: the last plan only
    ours = f"{Path(CODE_FILE).stem}.{CLASS_NAME}"
    config["auto_map"] = {k: v for k, v in (config.get("auto_map") or {}).items() if v != ours}
    if not config["auto_map"]:
        del config["auto_map"]
    (path / CODE_FILE).unlink(missing_ok=True)
    if plan.get("per_head"):  # the copied module (shipped with earlier pruned models) does not resize these
        atomic_write_text(config_path, json.dumps(config, indent=2, sort_keys=True) + "\n")
        return {"how": None, "reason": "per-head query/key norms (StableLM's qk_layernorm) lose heads; "
                                       "load with headlab.load_pruned"}
    # a projection kept whole under a norm over all its heads (OLMo 2's q_proj): wider than a standard config's heads
    values = standard_config_values(model) if not plan.get("selected") else None
    if values is not None and _transformers_accepts(cast(PreTrainedModel, model), {**config, **values}):
        original = {name: config.get(name) for name in values}
        config.update(values)
        atomic_write_text(config_path, json.dumps(config, indent=2, sort_keys=True) + "\n")
        return {"how": "standard config", "original_config": original}
    atomic_write_text(path / CODE_FILE, module_code(type(model).__name__))
    config["auto_map"] = {**config.get("auto_map", {}), **_auto_map(model)}
    config[PLAN_KEY] = plan
    atomic_write_text(config_path, json.dumps(config, indent=2, sort_keys=True) + "\n")
    return {"how": "remote code", "original_config": {}}


def restore_original_config(record: dict, config) -> None:
    """The unpruned config that headlab's record applies to: undo :func:`make_portable`'s
    standard-config counts and drop its remote-code entries (in place)."""
    for name, value in ((record.get("portable") or {}).get("original_config") or {}).items():
        if value is None:
            if hasattr(config, name):
                delattr(config, name)
        else:
            setattr(config, name, value)
    if hasattr(config, PLAN_KEY):
        delattr(config, PLAN_KEY)
    ours = f"{Path(CODE_FILE).stem}.{CLASS_NAME}"
    auto_map = {k: v for k, v in (getattr(config, "auto_map", None) or {}).items() if v != ours}
    if auto_map:
        config.auto_map = auto_map
    elif hasattr(config, "auto_map"):
        delattr(config, "auto_map")


def how_to_load(model: nn.Module, portable: dict, path: str = "path") -> str:
    """One line for a model card or the command line: how the directory loads, with and
    without headlab."""
    classes = list(_auto_map(model))
    auto = next((name for name in classes if name != "AutoModel"), classes[0])  # the task's class where one is named
    if portable.get("how") == "standard config":
        plain = f"`transformers.{auto}.from_pretrained({path!r})`"
    elif portable.get("how") == "remote code":
        plain = f"`transformers.{auto}.from_pretrained({path!r}, trust_remote_code=True)` (runs {CODE_FILE})"
    else:
        return f"Load with `headlab.load_pruned({path!r})` ({portable.get('reason', 'headlab only')})."
    return f"Load with `headlab.load_pruned({path!r})`, or without headlab with {plain}."


def check_pruned_numbering(model: nn.Module, blocks: list, *, to_prune: bool = False) -> None:
    """A directory pruned by headlab, loaded by transformers alone (``from_pretrained``, its
    pruned_heads.py): its layers do not know which original heads they kept, so every result would
    name the kept heads 0, 1, ... (enc_self L0 H1 for the original head 3) without a word.

    ``to_prune``: for pruning or saving, which also need every layer's kept key/value heads and write them in the
    record. A directory loaded through pruned_heads.py (its config keeps the plan; headlab's loaders drop it) is
    refused then even where its ALiBi layers carry their kept query heads (the hook's, which analysis may read):
    they do not carry their key/value heads (re-pruning failed with an AttributeError), and the layers of other
    families carry none (re-pruning named the kept heads 0, 1, ... and saved that numbering, without a word)."""
    from headlab.errors import HeadlabError
    from headlab.portable_code import KEPT_ATTR

    config = getattr(model, "config", None)
    source = str(getattr(config, "name_or_path", "") or "")
    plain = getattr(config, PLAN_KEY, None) is not None
    known = any(getattr(b.core, KEPT_ATTR, None) is not None for b in blocks)
    if to_prune:
        # told by what the load left on the model, not by the record beside name_or_path alone: a model built afresh
        # from the config headlab.load_pruned restored is the original model, pruned as such
        standard = bool(source) and not known and _standard_config_in_use(config, Path(source))
        if plain or standard:
            how = f"its {CODE_FILE}" if plain else "a standard config"
            raise HeadlabError(f"model: {source or 'the model'} was pruned by headlab and loaded without it ({how}): "
                               "it does not know the original numbering of every layer's heads and key/value heads, "
                               "which pruning names heads in and records; load it with headlab.load_pruned(path) to "
                               "prune or save it")
        return
    if known:
        return  # pruned by headlab in this process, or loaded by headlab.load_pruned: numbering known
    if plain or (source and (Path(source) / PRUNING_FILE).is_file()):
        raise HeadlabError(f"model: {source or 'the model'} was pruned by headlab and loaded without it: its heads "
                           "have lost their original numbering, in which headlab reports them; load it with "
                           "headlab.load_pruned(path)")


def _standard_config_in_use(config, directory: Path) -> bool:
    """``config`` is the standard config :func:`make_portable` wrote in ``directory`` (the pruned head counts), not
    the original one that headlab's loader restores (a model built afresh from a restored config is not refused)."""
    try:
        record = json.loads((directory / PRUNING_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    portable = record.get("portable") if isinstance(record, dict) else None
    original = portable.get("original_config") if isinstance(portable, dict) else None
    return isinstance(original, dict) and cast(dict, portable).get("how") == "standard config" and \
        any(getattr(config, name, None) != value for name, value in original.items())
