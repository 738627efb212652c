"""What a model directory holds, read and checked before a weight is used: complete or refused.

* **Config**: ``AutoConfig`` always with ``trust_remote_code`` passed explicitly (False unless
  the user asks), so that no path prompts or runs a directory's Python.
* **Weights**: safetensors headers are read first (:func:`tensor_shapes`), so a truncated or
  corrupt file is a one-line error naming it. Every tensor of the file must have the shape the
  model gives it, and after loading no tensor may be missing or left over
  (:func:`check_complete`): another model's weights, a missing layer or a config with more layers
  than the weights are refused, naming the tensors, instead of loading as random values. The
  allow-list is transformers' own (tied weights, non-persistent buffers, each class's
  ``_keys_to_ignore_on_load_missing`` / ``_keys_to_ignore_on_load_unexpected``, old
  ``position_ids`` and ``rotary_emb.inv_freq`` buffers) plus :data:`ALLOWED_UNEXPECTED`.
* **Pruning records** (``headlab_pruning.json``) are strictly typed like mask files
  (:func:`validate_record`) and checked against the weights' shapes (:func:`check_fits_weights`);
  a pruned directory re-saved by transformers' ``save_pretrained`` without its record gets one
  read from the weights' shapes (:func:`record_from_weights`).
* **Classes**: ``architectures`` in config.json resolves to a transformers ``PreTrainedModel``
  subclass or an auto class only (:func:`named_model_class`), never to another attribute. A
  directory loads as the class it was saved from (:func:`model_class_for`: a multimodal
  ``Glm5NextForConditionalGeneration`` as itself, not its bare model), but for a multimodal
  checkpoint whose language model transformers builds alone (Qwen3.5's: that causal LM) and a
  pre-training class (its masked LM); a class of a kind headlab does not analyse (a token
  classifier) is refused naming it.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

import torch
from torch import nn

from headlab.adapters import attention_blocks, is_linear, sharing_groups
from headlab.errors import HeadlabError, UnknownOption, counted
from headlab.heads import KINDS, kv_heads_kept
from headlab.portable import CLASS_NAME

__all__ = ["ALLOWED_UNEXPECTED", "build_model", "check_complete", "config_for", "check_fits_weights", "model_class_for",
           "named_model_class", "one_line", "read_config", "read_weights", "record_from_plan", "record_from_weights",
           "stored_dtypes", "tensor_shapes", "validate_record"]

# Model classes to try, most specific head first: analyses need an LM head when there is one.
_AUTO_CLASSES = ("AutoModelForSeq2SeqLM", "AutoModelForCausalLM", "AutoModelForMaskedLM", "AutoModel",
                 "AutoModelForSequenceClassification")
# The last is never a default (AutoModel has every config): only a checkpoint naming it gets it.

# The kinds of model headlab analyses, as transformers' auto tables sort classes: the language models of
# _AUTO_CLASSES (with the bare model and the sequence classifier), the multimodal ones (a language model beside
# towers that token ids never run: Glm5NextForConditionalGeneration, Mistral4ForCausalLM, Llava) and the speech
# sequence-to-sequence ones (Whisper: refused by the adapters, naming why). A checkpoint's class listed in these
# for its config is the class it loads as.
_ANALYSED = (*_AUTO_CLASSES, "AutoModelForImageTextToText", "AutoModelForMultimodalLM", "AutoModelForSpeechSeq2Seq")
MULTIMODAL_TABLES = ("AutoModelForImageTextToText", "AutoModelForMultimodalLM")

# Tensors a checkpoint may hold that the class headlab builds leaves out on purpose: BERT-style
# pre-training checkpoints carry a pooler and a next-sentence head that the masked-LM class lacks.
# GPT-Neo checkpoints saved before its causal-mask buffers became non-persistent (EleutherAI's, 2021) hold each
# layer's ``bias`` (the causal or windowed mask, which transformers 5.24 rebuilds from the config) and the unused
# ``masked_bias`` (-1e9): transformers lists both as unexpected and loads without them. GPT-1's (openai-gpt, saved in
# 2019 when its causal mask ``h.N.attn.bias`` was a persistent buffer; OpenAIGPTModel, unlike GPT-2's classes, does not
# list it in ``_keys_to_ignore_on_load_unexpected``) the same.
ALLOWED_UNEXPECTED = (r"(^|\.)pooler\.dense\.(weight|bias)$", r"^cls\.seq_relationship\.(weight|bias)$",
                      r"^(transformer\.)?h\.\d+\.attn\.attention\.(bias|masked_bias)$",
                      r"^(transformer\.)?h\.\d+\.attn\.bias$")
_ALLOWED_UNEXPECTED = re.compile("|".join(ALLOWED_UNEXPECTED))


def one_line(error: BaseException) -> str:
    """An exception's message on one line (transformers' messages span several)."""
    return " ".join(str(error).split()) or type(error).__name__


# -- classes and configs ----------------------------------------------------------------------
def listed_classes(table: str, config) -> tuple[type, ...]:
    """The classes transformers' auto class ``table`` has for ``config``'s type (an entry may be a tuple:
    AutoModel's FunnelModel, FunnelBaseModel); none where its entry cannot be imported."""
    import transformers

    mapping = getattr(getattr(transformers, table, None), "_model_mapping", None)
    try:
        entry = mapping[type(config)] if mapping is not None and type(config) in mapping else ()
    except (ImportError, ValueError, AttributeError):  # a table entry naming a class this install lacks
        return ()
    return entry if isinstance(entry, tuple) else (entry,)


def _saved_class(config) -> type | None:
    """The class ``architectures`` names (its first name that resolves), when transformers has it as a model
    class for ``config``: listed for its type in one of the auto tables, or built from it (its ``config_class``,
    :func:`config_for`). None for a name transformers lacks (a remote-code class) or another model type's."""
    import transformers

    for name in getattr(config, "architectures", None) or ():
        if not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
            continue
        try:
            found = getattr(transformers, name, None)
        except (ImportError, AttributeError, RuntimeError):  # a lazy module that fails to import: not this class
            continue
        if not (isinstance(found, type) and issubclass(found, transformers.PreTrainedModel)
                and found.__module__.startswith("transformers.models.")):
            continue
        wanted = getattr(found, "config_class", None)
        if (isinstance(wanted, type) and isinstance(config_for(found, config), wanted)) or \
                any(found in listed_classes(table, config) for table in _ANALYSED):
            return found
    return None


def model_class_for(config, source: str | Path = "config.json") -> type:
    """The class a checkpoint loads as: the class its ``architectures`` names, when transformers has it
    for ``config`` and lists it as a kind headlab analyses (:data:`_ANALYSED`: a ``BertForMaskedLM`` stays
    one, a ``Glm5NextForConditionalGeneration`` stays one instead of the bare ``Glm5NextModel``), with two
    exceptions:

    * a multimodal checkpoint whose language model transformers' ``AutoModelForCausalLM`` builds alone, on
      its text config (Qwen3.5's ``qwen3_5``, dots3-note's, Mllama's), loads as that causal LM, as
      ``AutoModelForCausalLM.from_pretrained`` loads it (the towers' tensors that its class does not
      declare ignorable are refused by :func:`check_text_of_multimodal`, naming how to save the text model);
    * a pre-training class (``BertForPreTraining``) loads as the masked LM (its pooler and next-sentence
      head: :data:`ALLOWED_UNEXPECTED`).

    A named class of another kind (``BertForTokenClassification``, ``LlamaForQuestionAnswering``) is refused
    before any work. A config naming no class transformers has for it (none, or a remote-code class) gets the
    first of :data:`_AUTO_CLASSES` that has its type: a language-model head when there is one, else the bare
    model."""
    import transformers

    if CLASS_NAME in (getattr(config, "architectures", None) or ()):
        # headlab's PrunedModel re-saved by transformers: the auto class auto_map names for it (a
        # pruned bare BertModel is a BertModel, not a BertLMHeadModel whose weights it lacks)
        for auto, target in (getattr(config, "auto_map", None) or {}).items():
            mapping = getattr(getattr(transformers, str(auto), None), "_model_mapping", {})
            if str(target).endswith(f".{CLASS_NAME}") and type(config) in mapping:
                return mapping[type(config)]
    classes = [cls for table in _AUTO_CLASSES for cls in listed_classes(table, config)]
    saved = _saved_class(config)
    if saved is not None:
        causal = listed_classes("AutoModelForCausalLM", config)
        if causal and causal[0] is not saved and config_for(causal[0], config) is not config \
                and any(saved in listed_classes(table, config) for table in MULTIMODAL_TABLES):
            return causal[0]  # the language model of a multimodal checkpoint, as AutoModelForCausalLM loads it
        if any(saved in listed_classes(table, config) for table in _ANALYSED):
            return saved
        if saved in listed_classes("AutoModelForPreTraining", config) and classes:
            return (listed_classes("AutoModelForMaskedLM", config) or classes)[0]
        from transformers.models.auto import modeling_auto  # every auto class (dir(transformers) takes a second)

        kinds = [table[len("AutoModelFor"):] for table, value in vars(modeling_auto).items()
                 if table.startswith("AutoModelFor") and isinstance(value, type) and table not in _ANALYSED
                 and saved in listed_classes(table, config)]
        if kinds:
            raise HeadlabError(
                f"{source}: architectures names {saved.__name__}, a {_kind(kinds[0])} model (transformers' "
                f"AutoModelFor{kinds[0]}); headlab analyses language models (causal, masked, sequence-to-sequence, "
                "multimodal), sequence classifiers and bare models, and loading this checkpoint as one of those "
                f"would leave out its head or make one up. To analyse its attention, save its base model: "
                f"transformers.{saved.__name__}.from_pretrained(path).base_model.save_pretrained(base_dir)")
        if saved.__name__ in ENTITY_CLASSES:
            raise HeadlabError(
                f"{source}: architectures names {saved.__name__}, which classifies entities: its forward reads "
                "entity_ids (its head reads the entities' last hidden states), which headlab's text inputs do not give "
                "(token ids and their attention mask only). To analyse its attention, save its base model, which runs "
                f"on words alone: transformers.{saved.__name__}.from_pretrained(path).base_model.save_pretrained("
                "base_dir)")
        return saved  # a class transformers lists under no auto class: the class the checkpoint was saved from
    if classes:
        return classes[0]
    raise HeadlabError(f"transformers has no model class for model_type {config.model_type!r}")


ENTITY_CLASSES = frozenset({"LukeForEntityClassification", "LukeForEntityPairClassification",
                            "LukeForEntitySpanClassification"})
"""Classes (transformers 5.24, listed under no auto class) whose forward needs entity inputs: LUKE's entity
classifiers read ``entity_last_hidden_state``, None without ``entity_ids`` (a TypeError on headlab's inputs)."""


def _kind(table: str) -> str:
    """``TokenClassification`` -> ``token classification``."""
    return re.sub(r"(?<=[a-z])(?=[A-Z])", " ", table).lower()


def named_model_class(config, source: str) -> type:
    """The class ``architectures[0]`` names: a transformers ``PreTrainedModel`` subclass, or an
    auto class (its class for ``config``'s type). headlab's own remote-code class (a directory
    re-saved by transformers names it) and a config naming none get :func:`model_class_for`.
    Any other name (``"pipeline"``, a function) is refused: it is never called."""
    import transformers

    architectures = getattr(config, "architectures", None) or []
    if not isinstance(architectures, list) or not all(isinstance(name, str) for name in architectures):
        raise HeadlabError(f"{source}: architectures must be a list of class names, found {architectures!r}")
    if not architectures or architectures[0] == CLASS_NAME:
        return model_class_for(config)
    name = architectures[0]
    found = getattr(transformers, name, None) if name.isidentifier() and not name.startswith("_") else None
    if isinstance(found, type) and issubclass(found, transformers.PreTrainedModel) \
            and found.__module__.startswith("transformers.models."):  # a model, not a base class
        return found
    mapping = getattr(found, "_model_mapping", None) if isinstance(found, type) and name.startswith("Auto") else None
    if mapping is not None and type(config) in mapping:
        return mapping[type(config)]
    raise HeadlabError(f"{source}: architectures names {name!r}, which is not a transformers model class "
                       "(a PreTrainedModel subclass or an auto class with this model_type); pass model_class")


def read_config(path: str | Path, trust_remote_code: bool = False, **overrides):
    """``AutoConfig`` of ``path`` with ``trust_remote_code`` passed explicitly: transformers then
    never prompts, and a config that needs the directory's code is a one-line error."""
    import json

    import transformers
    from huggingface_hub.errors import StrictDataclassError

    try:
        config, unused = transformers.AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code,
                                                                 return_unused_kwargs=True, **overrides)
    except StrictDataclassError as error:  # a field of the wrong type ("num_attention_heads": 2.0 or null): a traceback
        raise HeadlabError(f"{path}/config.json: {one_line(error)}") from error
    except (OSError, ValueError) as error:
        auto_map = None
        try:
            auto_map = json.loads((Path(path) / "config.json").read_text(encoding="utf-8")).get("auto_map")
        except (OSError, ValueError, AttributeError):
            pass
        if auto_map and not trust_remote_code and "trust_remote_code" in str(error):
            raise HeadlabError(
                f"{path}/config.json: its model_type is unknown to transformers and its auto_map names code in "
                f"the directory ({', '.join(sorted(map(str, auto_map)))}); headlab runs no code from a model "
                "directory unless --trust-remote-code (trust_remote_code=True) is given") from error
        raise HeadlabError(f"{path}: cannot read a model config ({one_line(error)})") from error
    # transformers drops an override the config has no field for: load_pruned(path, trust_remote_cod=True) loaded
    # without a word, as if it had been applied.
    dropped = [key for key in overrides if key in unused]
    if dropped:
        close = difflib.get_close_matches(dropped[0], ["trust_remote_code", *config.to_dict()], n=3)
        raise UnknownOption(f"{path}/config.json: unknown option {dropped[0]!r}: the config has no such field to "
                            "override" + (f"; did you mean {' or '.join(map(repr, close))}?" if close else ""))
    return config


def config_for(cls: type, config):
    """The config ``cls`` is built from: ``config``, or the sub-config of a composite config that
    ``cls`` takes (its ``config_class.base_config_key``), as transformers' ``from_pretrained`` reads it:
    a Qwen3.5 checkpoint (``qwen3_5``, a vision model around a text model) loads as Qwen3_5ForCausalLM
    on its ``text_config`` (``qwen3_5_text``)."""
    wanted = getattr(cls, "config_class", None)
    key = getattr(wanted, "base_config_key", "")
    if not isinstance(wanted, type) or isinstance(config, wanted) or not key:
        return config
    sub = getattr(config, key, None)
    return sub if isinstance(sub, wanted) else config


def build_model(cls: type, config, source: str | Path, meta: bool = False) -> nn.Module:
    """``cls(config)`` (on the meta device when ``meta``: the structure only; a composite config's
    sub-config where ``cls`` takes that, :func:`config_for`); a config transformers cannot build
    (heads that do not divide the width) is the user's error."""
    config = config_for(cls, config)
    try:
        if meta:
            with torch.device("meta"):
                return cls(config)
        return cls(config)
    except (ValueError, AttributeError, TypeError, ZeroDivisionError, RuntimeError) as error:
        if not is_config_error(error):
            raise
        raise HeadlabError(f"{source}: its config.json does not describe a {cls.__name__} transformers can "
                           f"build ({one_line(error)})") from error


def is_config_error(error: BaseException) -> bool:
    """Whether building a model failed on its config's numbers: heads that do not divide the width (a ValueError),
    no head at all (``width // 0``), a negative size (torch: "Trying to create tensor with negative dimension").
    The last two were internal errors with a traceback."""
    if isinstance(error, RuntimeError):
        return "negative dimension" in str(error)
    return isinstance(error, (ValueError, AttributeError, TypeError, ZeroDivisionError))


# -- weights ---------------------------------------------------------------------------------
def _weight_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in path.glob("*.bin"))
        found = f" ({', '.join(pickles[:3])}: pickle checkpoints, which headlab never loads; convert them to " \
                "safetensors)" if pickles else ""
        raise HeadlabError(f"{path}: no .safetensors weights{found}")
    return files


def _check_readable(file: Path) -> None:
    """safetensors reports a file it may not open as "No such file or directory": open it here
    first, so that the error says what is wrong (permission denied, say)."""
    try:
        with open(file, "rb"):
            pass
    except OSError as error:
        raise HeadlabError(f"{file}: cannot read the weights ({error.strerror or error})") from error


def tensor_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of the directory's safetensors files, from their headers
    (nothing is loaded). A truncated or corrupt file is a one-line error naming it."""
    from safetensors import SafetensorError, safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in _weight_files(Path(path)):
        _check_readable(file)
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    shapes[name] = tuple(handle.get_slice(name).get_shape())
        except (SafetensorError, OSError) as error:
            raise HeadlabError(f"{file}: not a readable safetensors file, truncated or corrupt "
                               f"({one_line(error)})") from error
    return shapes


_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def stored_dtypes(path: str | Path) -> set[str]:
    """The dtypes (torch names: float32, float16, ...) the directory's safetensors files store its
    floating-point tensors in, from their headers (nothing is loaded)."""
    from safetensors import SafetensorError, safe_open

    found: set[str] = set()
    for file in _weight_files(Path(path)):
        _check_readable(file)
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    stored = handle.get_slice(name).get_dtype()
                    if stored in _SAFETENSORS_DTYPES or stored.startswith("F8"):
                        found.add(_SAFETENSORS_DTYPES.get(stored, stored))
        except (SafetensorError, OSError) as error:
            raise HeadlabError(f"{file}: not a readable safetensors file, truncated or corrupt "
                               f"({one_line(error)})") from error
    return found


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's safetensors files (never a pickle)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in _weight_files(Path(path)):
        _check_readable(file)
        try:
            state.update(load_file(file))
        except (SafetensorError, OSError) as error:
            raise HeadlabError(f"{file}: not a readable safetensors file, truncated or corrupt "
                               f"({one_line(error)})") from error
    return state


def _names(keys) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:4])
    return shown + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")


def check_complete(source: str | Path, missing, unexpected, mismatched=()) -> None:
    """Refuse a load that left a tensor at its random initialisation or ignored one of the
    file's (after transformers' allow-list; :data:`ALLOWED_UNEXPECTED` besides)."""
    unexpected = [key for key in unexpected if not _ALLOWED_UNEXPECTED.search(key)]
    mismatched = [key if isinstance(key, str) else key[0] for key in mismatched]
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensor(s) the model needs are not in the weights ({_names(missing)})")
    if unexpected:
        problems.append(f"{len(unexpected)} tensor(s) of the weights are not in the model ({_names(unexpected)})")
    if mismatched:
        problems.append(f"{len(mismatched)} tensor(s) have another shape than the model's ({_names(mismatched)})")
    if problems:
        raise HeadlabError(f"{source}: the weights do not fit the model's config, refused rather than run with "
                           f"random values: " + "; ".join(problems))


def check_text_of_multimodal(source: str, config, cls: type, info: dict) -> None:
    """A multimodal checkpoint (dots3-note's: text, vision, audio) loaded as the LM of its text config, all of whose
    tensors it holds, with tensors of its other parts that the class does not declare ignorable (Qwen3.5's does its
    vision tower's): refused as :func:`check_complete` refuses them, but naming the language model and how to save it
    alone (before: only "N tensor(s) of the weights are not in the model")."""
    text = config_for(cls, config)
    unexpected = [key for key in info["unexpected_keys"] if not _ALLOWED_UNEXPECTED.search(key)]
    if text is config or not unexpected or info["missing_keys"] or info["mismatched_keys"]:
        return
    parts = sorted({key.split(".", 1)[0] for key in unexpected})
    raise HeadlabError(
        f"{source} is a multimodal {config.model_type!r} checkpoint: headlab analyses its language model, "
        f"{cls.__name__} (model_type {text.model_type!r}), and loaded every tensor of it, but {len(unexpected)} "
        f"tensor(s) of the checkpoint are not in it ({', '.join(p + '.*' for p in parts[:4])}"
        f"{' and more' if len(parts) > 4 else ''}), which headlab does not ignore. Save the language model alone "
        f"and pass that directory: transformers.{cls.__name__}.from_pretrained(path).save_pretrained(text_dir)")


def _tensor_block(model: nn.Module) -> dict[str, str]:
    """Parameter name -> ``"KIND layer N"`` for the attention projections of ``model``."""
    found = attention_blocks(model)  # first: XLNet's points are installed by it
    names = {id(module): name for name, module in model.named_modules()}
    out = {}
    for block in found:
        for pname, _ in block.family.head_parameters:  # XLNet's bare per-head parameters
            out[f"{names[id(block.core)]}.{pname}"] = f"{block.kind} layer {block.layer} ({counted(block.n_heads, 'head')})"
        rows = [block.module.get_submodule(path) for path, _ in block.family.head_rows]  # latent attention's, a gate's
        for module in (block.q, block.k, block.v, block.qkv, block.o, *rows):
            if module is not None and id(module) in names:
                for pname, _ in module.named_parameters(recurse=False):
                    out[f"{names[id(module)]}.{pname}"] = f"{block.kind} layer {block.layer} ({counted(block.n_heads, 'head')})"
    return out


def check_fits_weights(model: nn.Module, shapes: dict[str, tuple[int, ...]], source: str | Path) -> None:
    """Every tensor of the weights has the shape ``model`` gives it: a pruning record or a config
    that does not match the weights is named with the block and both shapes."""
    blocks = _tensor_block(model)
    wrong = []
    for name, tensor in model.state_dict().items():
        if name in shapes and tuple(tensor.shape) != shapes[name]:
            where = f" ({blocks[name]})" if name in blocks else ""
            wrong.append(f"{name}{where}: weights {list(shapes[name])}, model {list(tensor.shape)}")
    if wrong:
        more = f" and {len(wrong) - 3} more" if len(wrong) > 3 else ""
        raise HeadlabError(f"{source}: the weights do not match it: {'; '.join(wrong[:3])}{more}")


# -- pruning records -------------------------------------------------------------------------
def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate_record(record, source: str | Path) -> None:
    """A pruning record's types, strictly as mask files are read: head numbers are integers
    (no bool, no float), kept heads strictly increasing (no duplicate). Whether the numbers fit the
    model (its head counts) and its weights is checked when the record is applied."""
    if not isinstance(record, dict) or not isinstance(record.get("blocks"), dict):
        raise HeadlabError(f"{source}: malformed pruning record (expected an object with \"blocks\")")
    numbering = record.get("numbering", {})
    if not (isinstance(numbering, dict) and set(numbering) <= {"original", "reconstructed"}
            and all(isinstance(keys, list) and all(isinstance(k, str) for k in keys) for keys in numbering.values())):
        raise HeadlabError(f"{source}: numbering must map \"original\" or \"reconstructed\" to lists of blocks "
                           f"(\"dec_self:0\"), found {numbering!r}")
    for kind, layers in record["blocks"].items():
        if kind not in KINDS or not isinstance(layers, dict):
            raise HeadlabError(f"{source}: blocks: {kind!r} is not an attention kind ({', '.join(KINDS)}) "
                               "mapping layers to entries")
        for layer, entry in layers.items():
            where = f"{source}: {kind} layer {layer!r}"
            if not (isinstance(layer, str) and layer.isdigit() and layer.isascii()):
                raise HeadlabError(f"{where}: a layer key is a layer number")
            if not isinstance(entry, dict) or not {"n_heads", "kept_heads", "kept_kv_heads"} <= set(entry):
                raise HeadlabError(f"{where}: expected n_heads, kept_heads and kept_kv_heads")
            n_heads, kept, kv_kept = entry["n_heads"], entry["kept_heads"], entry["kept_kv_heads"]
            if not _int(n_heads) or n_heads < 0:
                raise HeadlabError(f"{where}: n_heads must be a non-negative integer, found {n_heads!r}")
            for name, heads in (("kept_heads", kept), ("kept_kv_heads", kv_kept)):
                if not isinstance(heads, list) or not all(_int(h) and h >= 0 for h in heads):
                    raise HeadlabError(f"{where}: {name} must be a list of head numbers (non-negative integers), "
                                       f"found {heads!r}")
            if any(a >= b for a, b in zip(kept, kept[1:])):
                raise HeadlabError(f"{where}: kept_heads must be strictly increasing (each head once), found {kept}")
            if bool(kept) != bool(kv_kept) or (kv_kept and len(kept) % len(kv_kept)):
                raise HeadlabError(f"{where}: {len(kept)} kept heads do not group over {len(kv_kept)} kept key/value "
                                   "heads")
            if any(a > b for a, b in zip(kv_kept, kv_kept[1:])):
                raise HeadlabError(f"{where}: kept_kv_heads must be in increasing order, found {kv_kept}")


def _width(shape: tuple[int, ...], module: nn.Module, out: bool) -> int:
    """Output (or input) width of a Linear's (I-BERT's QuantLinear's too: [out, in]) or a Conv1D's ([in, out]) weight
    shape."""
    linear = is_linear(module)
    return int(shape[0 if linear == out else 1])


def _kept_reconstructed(n_heads: int, n_kv_heads: int, n_q: int, n_kv: int) -> tuple[list[int], list[int]] | None:
    """Kept query heads and key/value heads of a model of ``n_heads`` over ``n_kv_heads`` that
    pruning turns into ``n_q`` query heads over ``n_kv`` key/value heads, grouped as the weights
    are; not the original numbering, which the weights do not hold. Equal groups: the first
    ``n_q / n_kv`` query heads of each of the first ``n_kv`` groups (heads 0 and 1 share key/value
    head 0 in a model of 4 over 2, so 2 over 2 is [0, 2], never [0, 1], which pruning would leave
    over 1 key/value head); unequal groups (a key/value head per query head): the fewest heads of
    group 0 that make the groups unequal, then the next groups filled in order. Each candidate is
    checked with the rule pruning applies (:func:`headlab.heads.kv_heads_kept`). None when no
    pruning gives these counts."""
    if n_heads == n_kv_heads or n_q == 0:
        return (list(range(n_q)), list(range(n_q))) if n_q == n_kv else None
    group = n_heads // n_kv_heads
    candidates = []
    if n_kv and n_q % n_kv == 0 and n_q // n_kv <= group and n_kv <= n_kv_heads:
        # equal groups: the first n_q / n_kv query heads of each of the first n_kv groups
        candidates.append([j * group + i for j in range(n_kv) for i in range(n_q // n_kv)])
    if n_kv == n_q:  # unequal groups (a copy of a key/value head per query head)
        for first in range(1, group + 1):
            rest = n_q - first
            kept = list(range(first)) + [group + i for i in range(rest)]
            if rest <= (n_kv_heads - 1) * group:
                candidates.append(kept)
    for kept in candidates:
        kv_kept, _ = kv_heads_kept(kept, n_heads, n_kv_heads)
        if len(kv_kept) == n_kv:
            return kept, kv_kept
    return None


def _kept_from_plan(plan, block, n_q: int, n_kv: int) -> tuple[list[int], list[int]] | None:
    """The original numbering that ``config.headlab_pruned`` (the plan save_pruned writes for
    pruned_heads.py, which a re-save by transformers keeps in config.json) holds for ``block``,
    if it holds one that fits the weights' counts: its ``kept`` entry, or, in a plan written before
    ``kept`` was (session 26), an ALiBi layer's ``alibi`` entry (kept heads, original count), whose
    key/value heads are those pruning keeps with them."""
    if not isinstance(plan, dict):
        return None
    entry = (plan.get("kept") or {}).get(block.name)
    alibi = (plan.get("alibi") or {}).get(block.name + (f".{block.family.core}" if block.family.core else ""))
    if entry is None and isinstance(alibi, list) and len(alibi) == 2 and isinstance(alibi[0], list) \
            and all(map(_int, alibi[0])) and _int(alibi[1]) and alibi[1] == block.n_heads:
        entry = [alibi[0], kv_heads_kept(alibi[0], block.n_heads, block.n_kv_heads)[0], alibi[1]]
    if not (isinstance(entry, list) and len(entry) == 3):
        return None
    kept, kv_kept, n_heads = entry
    if not (isinstance(kept, list) and isinstance(kv_kept, list) and all(map(_int, [*kept, *kv_kept]))
            and n_heads == block.n_heads and all(0 <= h < block.n_heads for h in kept) and kept == sorted(set(kept))):
        return None
    # pruning leaves one of two layouts: each kept group's key/value head once, or a copy per kept query head
    # (uneven groups; also a layer pruned twice, whose first pruning made the copies: [2, 3] over [1, 1])
    group = block.n_heads // max(block.n_kv_heads, 1)
    layouts = (kv_heads_kept(kept, block.n_heads, block.n_kv_heads)[0], [h // group for h in kept])
    if len(kept) != n_q or len(kv_kept) != n_kv or kv_kept not in layouts:
        return None
    return list(kept), list(kv_kept)


def _record_block(block, plan: dict | None, n_q: int, n_kv: int, numbering: dict, blocks: dict) -> None:
    """``block``'s entry of :func:`record_from_weights`' record, where a pruning gives ``n_q`` and ``n_kv`` heads."""
    found = _kept_from_plan(plan, block, n_q, n_kv)
    how = "original" if found or n_q == 0 else "reconstructed"  # a layer left with no head has nothing to number
    found = found or _kept_reconstructed(block.n_heads, block.n_kv_heads, n_q, n_kv)
    if found is None:
        return  # no pruning gives these counts: check_fits_weights names the tensor
    numbering[how].append(f"{block.kind}:{block.layer}")
    blocks.setdefault(block.kind, {})[str(block.layer)] = {
        "n_heads": block.n_heads, "kept_heads": found[0], "kept_kv_heads": found[1]}


def record_from_plan(model: nn.Module, shapes: dict[str, tuple[int, ...]], plan: dict | None) -> dict | None:
    """A pruning record for an unpruned ``model`` (its config) from ``plan`` alone (the config's ``headlab_pruned``),
    where the weights are stored under the original checkpoint's tensor names (transformers converts them on saving:
    Inkling2's ``model.llm.layers.N.attn.wq_du``), none of the attention's output projections under the model's, so
    that :func:`record_from_weights` cannot read the heads off them: a pruned directory re-saved by transformers
    through pruned_heads.py. None when the weights are named as the model's modules or the plan names no block's
    kept heads. Loading checks the record against the weights (a tensor of another shape is refused), so the model
    built is the saved one or none."""
    if not isinstance(plan, dict) or not isinstance(plan.get("kept"), dict):
        return None
    found_blocks = attention_blocks(model)
    names = {id(module): name for name, module in model.named_modules()}
    if any(f"{names[id(b.o)]}.weight" in shapes for b in found_blocks if b.o is not None):
        return None  # named as the model's modules: record_from_weights reads the shapes
    blocks: dict[str, dict] = {}
    for block in found_blocks:
        entry = plan["kept"].get(block.name)
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], list)
                and isinstance(entry[1], list)):
            continue
        found = _kept_from_plan(plan, block, len(entry[0]), len(entry[1]))
        if found is not None:
            blocks.setdefault(block.kind, {})[str(block.layer)] = {
                "n_heads": block.n_heads, "kept_heads": found[0], "kept_kv_heads": found[1]}
    if not blocks:
        return None
    return {"blocks": blocks, "numbering": {"original": [f"{kind}:{layer}" for kind, layers in blocks.items()
                                                         for layer in layers]}}


def record_from_weights(model: nn.Module, shapes: dict[str, tuple[int, ...]], plan: dict | None = None) -> dict | None:
    """A pruning record for an unpruned ``model`` (its config) whose heads the weights' shapes
    say were removed: a pruned directory re-saved by transformers (``save_pretrained`` after
    fine-tuning) without headlab_pruning.json. None when every block has the config's heads.

    The original numbering of the kept heads is not in the weights. Where ``plan`` (the config's
    ``headlab_pruned``, kept by a re-save through pruned_heads.py) names the kept heads, they are
    taken from it; otherwise each layer gets the lowest numbering whose key/value groups are the
    weights' (:func:`_kept_reconstructed`), and the record says so under ``"numbering"``:
    ``{"reconstructed": ["dec_self:0", ...]}`` (``"original"``: the layers numbered from the plan).
    """
    found_blocks = attention_blocks(model)  # first: XLNet's points are installed by it, and named below
    names = {id(module): name for name, module in model.named_modules()}
    blocks: dict[str, dict] = {}
    numbering: dict[str, list[str]] = {"original": [], "reconstructed": []}
    for block in found_blocks:
        if block.family.head_parameters:  # XLNet's bare parameters: the heads are dim 1 of o and v
            o_weight, kv_weight = (f"{names[id(block.core)]}.{name}" for name in ("o", "v"))
            if o_weight not in shapes or kv_weight not in shapes or len(shapes[o_weight]) != 3 \
                    or len(shapes[kv_weight]) != 3:
                continue  # check_complete / check_fits_weights name it
            n_q, n_kv, rest_q = int(shapes[o_weight][1]), int(shapes[kv_weight][1]), 0
            if n_q != n_kv or n_q > block.n_heads or (n_q, n_kv) == (block.n_heads, block.n_kv_heads):
                continue
            _record_block(block, plan, n_q, n_kv, numbering, blocks)
            continue
        o_weight = f"{names[id(block.o)]}.weight"
        # the value projection's rows: the key projection stays whole under a norm over all its heads (OLMo 2)
        kv_module = block.v if block.v is not None else block.qkv
        if block.family.head_rows and block.q is None:  # latent attention: a key and a value per query head; o_proj reads them
            kv_module = block.o
        if kv_module is None or block.d_head <= 0:
            continue
        kv_weight = f"{names[id(kv_module)]}.weight"
        if o_weight not in shapes or kv_weight not in shapes:
            continue  # named otherwise in the file: check_complete says what is missing
        if isinstance(block.o, nn.Conv1d):
            # SqueezeBERT's 1x1 convolutions (weight [out, in / groups, 1]), whose groups pruning may have changed (made
            # dense): the heads read off the values' output channels (shape[0]), as many as the queries' (no grouping)
            kv_width = int(shapes[kv_weight][0])
            n_q, rest_q = divmod(kv_width, block.d_head)
        else:
            n_q, rest_q = divmod(_width(shapes[o_weight], block.o, out=False), block.d_head)
            kv_width = _width(shapes[kv_weight], kv_module, out=True)
        if block.k is None and block.qkv is not None:  # fused [q | k | v]
            kv_width = (kv_width - n_q * block.d_head) // 2
        if block.family.head_rows and block.q is None:  # the other projections' widths: check_fits_weights
            kv_width = n_q * block.d_head
        n_kv, rest_kv = divmod(kv_width, block.d_head)  # value heads (MiMo-V2-Flash's query/key heads are wider)
        if rest_q or rest_kv or n_q > block.n_heads or not 0 <= n_kv <= max(n_q, block.n_kv_heads):
            continue  # not a pruned shape: check_fits_weights names the tensor
        if (n_q, n_kv) == (block.n_heads, block.n_kv_heads):
            continue
        _record_block(block, plan, n_q, n_kv, numbering, blocks)
    for group in sharing_groups(found_blocks):
        # weights tied across depths (Zamba's shared transformer) are saved once, under the first depth's names, and
        # transformers ties the others to them: those depths were pruned alike (surgery.check_shared_plan)
        source = next((b for b in group if str(b.layer) in blocks.get(b.kind, {})), None)
        if source is None:
            continue
        how = next(how for how, keys in numbering.items() if f"{source.kind}:{source.layer}" in keys)
        for block in group:
            if str(block.layer) not in blocks[block.kind] and f"{names[id(block.o)]}.weight" not in shapes:
                blocks[block.kind][str(block.layer)] = dict(blocks[source.kind][str(source.layer)])
                numbering[how].append(f"{block.kind}:{block.layer}")
    if not blocks:
        return None
    return {"blocks": blocks, "numbering": {how: keys for how, keys in numbering.items() if keys}}
