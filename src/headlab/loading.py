"""Loading a model and its tokenizer for analysis: local directory or hub id, safely.

Weights load from safetensors only (``use_safetensors=True``), ``trust_remote_code`` stays off
unless the caller asks, and a directory written by :func:`headlab.save_pruned` is rebuilt
with its pruning applied.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from headlab.errors import HeadlabError
from headlab.surgery import PRUNING_FILE, load_pruned

# Model classes to try, most specific head first: analyses need an LM head when there is one.
_AUTO_CLASSES = ("AutoModelForSeq2SeqLM", "AutoModelForCausalLM", "AutoModelForMaskedLM", "AutoModel")


def model_class_for(config) -> type:
    """The transformers class with a language-model head for ``config`` (or the bare model)."""
    import transformers

    for name in _AUTO_CLASSES:
        auto = getattr(transformers, name)
        if type(config) in auto._model_mapping:
            return auto._model_mapping[type(config)]
    raise HeadlabError(f"transformers has no model class for model_type {config.model_type!r}")


def load_config(name_or_path: str, trust_remote_code: bool = False):
    import transformers

    path = Path(name_or_path)
    if path.is_dir() and not (path / "config.json").is_file():
        raise HeadlabError(f"{name_or_path}: a directory without config.json, not a model directory")
    try:
        return transformers.AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        if not path.exists():  # neither a local directory nor a model the hub (or its cache) knows
            raise HeadlabError(f"{name_or_path}: no such model directory, and not a model id found on the "
                               "Hugging Face hub or in its cache") from error
        raise HeadlabError(f"{name_or_path}: cannot read a model config ({error})") from error


def load_model(
    name_or_path: str,
    *,
    dtype: torch.dtype | str | None = None,
    device_map: str | dict | None = None,
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
) -> nn.Module:
    """Load ``name_or_path`` in eval mode with its language-model head when it has one.

    Weights are widened to fp32 unless ``dtype`` says otherwise: checkpoints stored in fp16
    (headlab's bundled models) are analysed at full precision, as LRP's conservation and the
    statistics' 1e-8 agreement need, and CPUs have few fast fp16 kernels.
    """
    if dtype is None:
        dtype = torch.float32
    path = Path(name_or_path)
    if path.is_dir() and (path / PRUNING_FILE).is_file():
        model = load_pruned(path)
        if (path / "generation_config.json").is_file():  # beam, lengths, forced tokens of the saved model
            import transformers

            model.generation_config = transformers.GenerationConfig.from_pretrained(path)
        return model.to(dtype) if isinstance(dtype, torch.dtype) else model
    config = load_config(name_or_path, trust_remote_code)
    cls = model_class_for(config)
    kwargs = {"use_safetensors": True, "trust_remote_code": trust_remote_code}
    if dtype is not None:
        kwargs["dtype"] = dtype
    if device_map is not None:
        kwargs["device_map"] = device_map
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    try:
        model = cls.from_pretrained(name_or_path, **kwargs)
    except OSError as error:
        raise HeadlabError(f"{name_or_path}: cannot load safetensors weights ({error})") from error
    return model.eval()


def build_from_config(name_or_path: str, trust_remote_code: bool = False) -> nn.Module:
    """The model's structure without its weights (on the meta device): enough to list heads."""
    config = load_config(name_or_path, trust_remote_code)
    cls = model_class_for(config)
    with torch.device("meta"):
        return cls(config)


# What a tokenizer directory holds (fast, slow, SentencePiece and BPE formats).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.*", "*.model", "merges.txt", "*.spm")


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False):
    import transformers

    path = Path(name_or_path)
    if path.is_dir() and not any(next(path.glob(pattern), None) for pattern in _TOKENIZER_FILES):
        raise HeadlabError(f"{name_or_path}: cannot load a tokenizer: the directory has none "
                           f"(no {', '.join(_TOKENIZER_FILES[:3])}, ...)")
    try:
        return transformers.AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        raise HeadlabError(f"{name_or_path}: cannot load a tokenizer ({error})") from error
