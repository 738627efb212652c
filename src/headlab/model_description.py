"""What kind of model this is: :func:`describe_model` reads the architecture, the special tokens,
the longest input and whether it has a language-model head, from the model (and tokenizer).

Every feature that runs a model on text reads it here (importance, the pruning baselines, the
report's examples, the one-call API), not from a module of another feature.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from typing import Any, Callable, cast

import torch
from torch import nn

from headlab.adapters import attention_blocks, config_value, text_config
from headlab.compiled import model_entry
from headlab.portable import CLASS_NAME

__all__ = [
    "ModelInfo",
    "checkpoint_has_lm_head",
    "config_value",
    "describe_model",
    "is_classifier",
    "model_max_length",
    "position_limit",
    "output_layer",
]

_NO_LIMIT = 1_000_000  # tokenizers report model_max_length = 1e30 when they know none

# Architectures whose checkpoints carry a language-model head; a checkpoint saved from a bare
# encoder (e.g. "BertModel") would get a randomly initialised head, so it counts as having none.
_LM_HEAD_SUFFIXES = (
    "LMHeadModel", "ForCausalLM", "ForMaskedLM", "ForConditionalGeneration", "MTModel", "ForPreTraining",
    "ForSeq2SeqLM", "ForSequenceClassification",
)


@dataclass(frozen=True)
class ModelInfo:
    """What the importance measures need to know about a model.

    ``arch`` is ``"seq2seq"`` (encoder-decoder), ``"causal"`` (decoder-only), ``"masked"``
    (encoder-only) or ``"classifier"`` (a sequence classifier: one prediction per text, its
    ``n_labels`` classes named ``label_names``). ``special_ids`` are the ids that confidence leaves out as queries and keys
    and that are never LRP targets of a masked LM (padding, EOS, BOS, CLS, SEP, ...).
    """

    arch: str
    pad_id: int
    eos_ids: frozenset[int]
    special_ids: frozenset[int]
    decoder_start_id: int | None
    max_length: int
    has_lm_head: bool
    mask_id: int | None = None
    name: str = ""
    n_labels: int = 0
    label_names: tuple[str, ...] = ()

    @property
    def is_seq2seq(self) -> bool:
        return self.arch == "seq2seq"


def _ids(value) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, (list, tuple, set, frozenset)):
        return {int(v) for v in value if v is not None}
    return {int(value)}


def _max_positions(model: nn.Module) -> int | None:
    """The longest input the model's position table takes, or None where it has none. A wrapper's limit is
    its text model's (its ``text_config``); where the top level sets one too, the smaller wins: tokens go
    through the text model's table, and an input neither limit refuses is the only safe one."""
    configs = [model.config, text_config(model.config)]
    for attr in ("max_position_embeddings", "n_positions", "max_target_positions", "max_sequence_length"):
        values = [v for v in (getattr(c, attr, None) for c in configs) if isinstance(v, int) and v > 0]
        if values:
            return min(values) - _reserved_positions(model) if attr == "max_position_embeddings" else min(values)
    return None


def _reserved_positions(model: nn.Module) -> int:
    """Rows of the position table no token can use: RoBERTa-style embeddings number positions
    from ``padding_idx + 1`` (transformers' ``create_position_ids_from_input_ids``), so a table of
    514 rows takes 512 tokens (ESM's is a function of its module, not a method). Only a learned
    table of that many rows: M2M100's sinusoidal one (the same numbering) has ``padding_idx + 1``
    rows more and grows on demand."""
    for module in model.modules():
        padding = getattr(module, "padding_idx", None)
        numbers = hasattr(module, "create_position_ids_from_input_ids") or \
            hasattr(sys.modules.get(type(module).__module__), "create_position_ids_from_input_ids")
        if numbers and isinstance(padding, int) \
                and isinstance(getattr(getattr(module, "position_embeddings", None), "num_embeddings", None), int):
            return padding + 1
    return 0


def model_info(model: nn.Module, tokenizer=None, max_length: int | None = None,
               log: Callable[[str], None] | None = None) -> ModelInfo:
    """:func:`describe_model`, with a language-model head the checkpoint does not carry counted as
    absent (transformers initialises it at random on loading); ``log`` says so. What ``headlab
    analyze``, ``headlab importance`` and the Python API describe."""
    info = describe_model(model, tokenizer, max_length=max_length)
    if log is not None and (lowered := length_lowered(model, tokenizer, max_length)):
        log(lowered)
    if info.has_lm_head and not checkpoint_has_lm_head(model.config, type(model)):
        if log is not None:
            architectures = getattr(model.config, "architectures", None) or []
            log(f"the checkpoint was saved as {', '.join(architectures)}, without a language-model head")
        info = replace(info, has_lm_head=False)
    return info


def checkpoint_has_lm_head(config, model_class: type | None = None) -> bool:
    """Whether the checkpoint's saved architecture has a language-model head (True when unknown).
    headlab's ``PrunedModel`` (a pruned directory re-saved by transformers) is the class it was
    loaded as, ``model_class`` (or the original class its remote code subclasses)."""
    architectures = getattr(config, "architectures", None) or []
    if model_class is not None and CLASS_NAME in architectures:
        architectures = [c.__name__ for c in model_class.__mro__]
    return not architectures or any(a.endswith(_LM_HEAD_SUFFIXES) for a in architectures)


@model_entry  # torch.compile's wrapper: its model, run eagerly (headlab.compiled)
def describe_model(model: nn.Module, tokenizer=None, max_length: int | None = None) -> ModelInfo:
    """Read architecture, special tokens and length limit from ``model`` (and ``tokenizer``)."""
    from headlab.loading import check_tokenizer_fits

    check_tokenizer_fits(tokenizer, model, getattr(model.config, "_name_or_path", "") or type(model).__name__)
    config = model.config
    blocks = attention_blocks(model)
    # what text runs: a multimodal wrapper's vision tower (enc_self) made Llava a masked LM, its loss unshifted
    kinds = {b.kind for b in blocks if not b.idle}
    if is_classifier(model):
        arch = "classifier"
    elif getattr(config, "is_encoder_decoder", False):
        arch = "seq2seq"
    elif "dec_self" in kinds and "enc_self" not in kinds:
        arch = "causal"
    else:
        arch = "masked"
    generation = getattr(model, "generation_config", None)
    # token ids from the top level, else the text config (a wrapper's, config_value says which wins)
    eos = _ids(config_value(config, "eos_token_id")) or _ids(getattr(generation, "eos_token_id", None))
    pad = config_value(config, "pad_token_id")
    if arch == "classifier":
        pad = pooled_pad_id(config)
    if pad is None and tokenizer is not None:
        pad = tokenizer.pad_token_id
    if pad is None:
        pad = min(eos) if eos else 0
    start = config_value(config, "decoder_start_token_id")
    if start is None and generation is not None:
        start = getattr(generation, "decoder_start_token_id", None)
    special = {int(pad)} | eos | _ids(config_value(config, "bos_token_id")) | _ids(start)
    for attr in ("sep_token_id", "cls_token_id"):
        special |= _ids(config_value(config, attr))
    mask_id = None
    if tokenizer is not None:
        # UNK stands for a real word, so it stays a token like any other.
        special |= set(getattr(tokenizer, "all_special_ids", []) or []) - _ids(getattr(tokenizer, "unk_token_id", None))
        eos |= _ids(getattr(tokenizer, "eos_token_id", None)) if not eos else set()
        mask_id = getattr(tokenizer, "mask_token_id", None)
    output = output_layer(model)
    has_lm_head = isinstance(getattr(output, "weight", None), torch.Tensor)
    n_labels = int(getattr(config, "num_labels", 0) or 0) if arch == "classifier" else 0
    id2label = getattr(config, "id2label", None) or {}
    label_names = tuple(str(id2label.get(i, id2label.get(str(i), i))) for i in range(n_labels))
    name = getattr(config, "_name_or_path", "") or type(model).__name__
    return ModelInfo(
        arch=arch,
        pad_id=int(pad),
        eos_ids=frozenset(eos),
        special_ids=frozenset(special),
        decoder_start_id=None if start is None else int(start),
        max_length=_length_limit(model, tokenizer, max_length),
        has_lm_head=has_lm_head,
        mask_id=None if mask_id is None else int(mask_id),
        name=str(name),
        n_labels=n_labels,
        label_names=label_names,
    )


def generation_cache_problem(model: nn.Module) -> str | None:
    """Why transformers cannot generate with ``model``'s cache, else None: an encoder-decoder whose decoder has more
    layers than its config's decoder text config says (T5Config maps ``num_hidden_layers`` to the encoder's
    ``num_layers`` whatever ``num_decoder_layers`` is: google/t5-efficient-*-dl*), for which transformers 5.24's
    ``generate`` builds a cache of too few layers and fails on the first layer past them with an IndexError."""
    config: Any = getattr(model, "config", None)
    if not getattr(config, "is_encoder_decoder", False) or not hasattr(model, "get_decoder"):
        return None
    decoder = cast(Any, model).get_decoder()
    layers = max((len(m) for m in decoder.children() if isinstance(m, nn.ModuleList)), default=0)
    cached = getattr(config.get_text_config(decoder=True), "num_hidden_layers", None)
    if not isinstance(cached, int) or layers <= cached:
        return None
    return (f"{config.model_type}: its decoder has {layers} layers, but transformers builds the generation cache from "
            f"the config's num_hidden_layers ({cached}, the encoder's), so its generate() fails on decoder layer "
            f"{cached} (IndexError in cache_utils): translating with this model is not possible with transformers "
            "5.24; score on references (teacher forcing) instead of the model's own translations")


def pooled_pad_id(config: Any) -> Any:
    """The padding id a sequence classifier pools by (its last token not this id): transformers'
    ``GenericForSequenceClassification`` reads ``config.get_text_config().pad_token_id``, so a wrapper's text
    config wins over its top level here; a flat config is its own text config."""
    pad = getattr(text_config(config), "pad_token_id", None)
    return getattr(config, "pad_token_id", None) if pad is None else pad


def is_classifier(model: nn.Module) -> bool:
    """A sequence classifier (``...ForSequenceClassification``): one set of class logits per text."""
    return type(model).__name__.endswith("ForSequenceClassification")


OUTPUT_LAYERS = {"fsmt": "model.decoder.output_projection"}
"""Model types whose ``get_output_embeddings`` is not the map to the logits, with where that is: FSMT's returns the
decoder's input embeddings (transformers 5.24), its logits are ``decoder.output_projection``'s."""


def output_layer(model: nn.Module) -> nn.Module | None:
    """The last linear map to the logits: the language-model head, or a classifier's last layer
    onto its classes (BERT's ``classifier``, RoBERTa's ``classifier.out_proj``, GPT-2's ``score``)."""
    if is_classifier(model):
        n_labels = getattr(model.config, "num_labels", None)
        onto_classes = [m for m in model.modules() if isinstance(m, nn.Linear) and m.out_features == n_labels]
        return onto_classes[-1] if onto_classes else None
    path = OUTPUT_LAYERS.get(getattr(getattr(model, "config", None), "model_type", ""))
    if path is not None:
        try:
            return model.get_submodule(path)
        except AttributeError:  # another class of the type (FSMTModel has no LM head)
            return None
    return cast(Any, model).get_output_embeddings() if hasattr(model, "get_output_embeddings") else None


def _length_limit(model: nn.Module, tokenizer=None, max_length: int | None = None) -> int:
    limits = [v for v in (_max_positions(model), max_length) if v]
    if tokenizer is not None and 0 < getattr(tokenizer, "model_max_length", _NO_LIMIT) < _NO_LIMIT:
        limits.append(int(tokenizer.model_max_length))
    return min(limits) if limits else 512


def length_lowered(model: nn.Module, tokenizer=None, max_length: int | None = None) -> str | None:
    """What a ``max_length`` above the model's longest input was lowered to (every input is cut
    to that limit, never to more), said in words; None when it was not lowered."""
    limit = _length_limit(model, tokenizer, max_length)
    if not max_length or max_length <= limit:
        return None
    where = "its position table" if _max_positions(model) == limit else "the tokenizer's model_max_length"
    return f"--max-length {max_length} is above the model's longest input ({limit} tokens, {where}): lowered to {limit}"


def position_limit(model: nn.Module, default: int = 1024) -> int:
    """The longest sequence the model's position table takes (RoBERTa's reserved rows left out, a wrapper's
    text model's limit: :func:`_max_positions`), or ``default`` where it has none: what training cuts to."""
    return _max_positions(model) or default


def model_max_length(model, tokenizer, max_length: int | None = None) -> int:
    """The longest input the model takes: its position table, or the tokenizer's limit (and
    ``max_length``, when it is lower)."""
    return _length_limit(model, tokenizer, max_length)
