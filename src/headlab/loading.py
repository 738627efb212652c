"""Loading a model and its tokenizer for analysis: local directory or hub id, safely.

Weights load from safetensors only (``use_safetensors=True``), ``trust_remote_code`` is passed
explicitly to every transformers loader and stays off unless the caller asks, and a directory
written by :func:`headlab.save_pruned` is rebuilt with its pruning applied (also once re-saved by
transformers: head counts from the weights' shapes). A load is complete or refused
(:mod:`headlab.checkpoint`): no tensor missing, none left over, none of another shape.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any, cast

import torch
from safetensors import SafetensorError
from torch import nn

from headlab.adapters import text_config
from headlab.adapters.families import causal_on_token_ids
from headlab.checkpoint import (
    MULTIMODAL_TABLES,
    build_model,
    check_complete,
    check_fits_weights,
    check_text_of_multimodal,
    config_for,
    is_config_error,
    listed_classes,
    model_class_for,
    one_line,
    read_config,
    record_from_plan,
    record_from_weights,
    tensor_shapes,
)
from headlab.errors import HeadlabError
from headlab.heads import shown_model_name
from headlab.portable import PLAN_KEY
from headlab.surgery import FORMAT_VERSION, PRUNING_FILE, check_block_sliceable, load_pruned

__all__ = ["load_config", "load_model", "build_from_config", "check_supported", "load_tokenizer", "model_class_for",
           "vocab_size_of", "check_tokenizer_fits", "resolve_dtype", "check_device", "DTYPES",
           "check_hub_reachable", "hub_unreachable"]

def load_config(name_or_path: str, trust_remote_code: bool = False):
    import transformers

    if not str(name_or_path).strip():  # Path("") is the current directory
        raise HeadlabError("the model path is empty: give a model directory or a hub id")
    path = Path(name_or_path)
    if path.is_dir() and not (path / "config.json").is_file():
        raise HeadlabError(f"{name_or_path}: a directory without config.json, not a model directory")
    if not path.exists():
        check_hub_reachable(name_or_path)
        try:
            return transformers.AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as error:  # neither a local directory nor a model the hub (or its cache) knows
            raise HeadlabError(f"{name_or_path}: no such model directory, and not a model id found on the "
                               "Hugging Face hub or in its cache") from error
    return read_config(name_or_path, trust_remote_code)


_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


@lru_cache(maxsize=1)
def _no_network(host: str, port: int) -> bool:
    """True when a TCP connection to the hub cannot be opened within 3 s (no DNS, no route): the
    hub client would retry for about half a minute and then say the model does not exist. Behind
    a proxy a direct connection proves nothing, so the client is left to try."""
    if any(os.environ.get(name) for name in _PROXY_VARIABLES):
        return False
    try:
        socket.create_connection((host, port), timeout=3).close()
    except OSError:
        return True
    return False


def hub_unreachable() -> str | None:
    """Why the Hugging Face hub cannot be reached (``"HF_HUB_OFFLINE=1"``, ``"no network"``), or None."""
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    if constants.is_offline_mode() or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE"):
        return "HF_HUB_OFFLINE=1"
    url = urlsplit(constants.ENDPOINT)
    if url.hostname and _no_network(url.hostname, url.port or (443 if url.scheme == "https" else 80)):
        return "no network"
    return None


def check_hub_reachable(name: str, files: tuple[str, ...] = ("config.json",)) -> None:
    """Refuse at once a hub id that is neither a local directory nor in the local cache while the
    hub cannot be reached, instead of the hub client's retries and then "not found". A name that
    cannot be a hub id, or one with any of ``files`` cached, is left to the loader."""
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
        cached = any(isinstance(try_to_load_from_cache(name, file), str) for file in files)
    except HFValidationError:
        return
    if cached:
        return
    why = hub_unreachable()
    if why is not None:
        raise HeadlabError(f"{name}: no such model directory, and not a model id that can be loaded: the Hugging Face "
                           f"hub cannot be reached ({why}) and "
                           f"{name} is not in the local cache (download it where there is network, or pass a "
                           "local model directory)")


def load_model(
    name_or_path: str,
    *,
    dtype: torch.dtype | str | None = None,
    device_map: str | dict | None = None,
    device: str | torch.device | None = None,
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
) -> nn.Module:
    """Load ``name_or_path`` in eval mode with its language-model head when it has one.

    Weights are widened to fp32 unless ``dtype`` says otherwise: checkpoints stored in fp16
    (headlab's bundled models) are analysed at full precision, as LRP's conservation and the
    statistics' 1e-8 agreement need, and CPUs have few fast fp16 kernels. ``dtype`` (a torch
    dtype or one of :data:`DTYPES`), ``device`` (``cpu``, ``cuda``, ``cuda:N``) and
    ``device_map`` (``"auto"``: spread over the available devices with accelerate) place the
    weights; ``device`` and ``device_map`` exclude each other.
    """
    dtype = torch.float32 if dtype is None else resolve_dtype(dtype)
    device = check_device(device)
    if device is not None and device_map is not None:
        raise HeadlabError("give --device or --device-map, not both")
    path = Path(name_or_path)
    if path.is_dir() and (path / PRUNING_FILE).is_file():
        return _place(load_pruned(path, trust_remote_code=trust_remote_code, dtype=_built_in(dtype)), path, dtype,
                      device, device_map)
    config = load_config(name_or_path, trust_remote_code)
    cls = model_class_for(config, f"{name_or_path}/config.json")
    # Read the weights' headers before transformers does: complete or refused. (Quantized weights
    # are packed in other shapes; transformers' own report below still covers them.)
    if path.is_dir() and getattr(config, "quantization_config", None) is None:
        shapes = tensor_shapes(path)
        structure = build_model(cls, config, path, meta=True)
        try:
            structure, shapes, wrapped = _analysed_structure(structure, shapes)
            record = _record_from_weights(structure, shapes)
        except HeadlabError as error:  # its blocks unfound: UDOP's and PI0's name-based view ("two modules claim")
            problem = token_ids_problem(structure)  # where the reason is the image its forward needs, say that
            if problem:
                raise HeadlabError(f"{name_or_path} (model_type {config.model_type!r}): {problem}") from error
            raise
        if record is not None and wrapped:
            raise HeadlabError(f"{name_or_path}: the weights of the language model of this multimodal "
                               f"{config.model_type!r} checkpoint have fewer heads than its config says, a layout "
                               "headlab never saves (it saves a pruned language model alone)")
        if record is not None:  # a pruned directory re-saved by transformers: heads from the weights' shapes
            model = load_pruned(path, cls, trust_remote_code=trust_remote_code, record=record, dtype=_built_in(dtype))
            return _place(model, path, dtype, device, device_map)
        check_fits_weights(structure, shapes, f"{path}/config.json")
    kwargs: dict[str, Any] = {"use_safetensors": True, "trust_remote_code": trust_remote_code, "dtype": dtype,
              "output_loading_info": True}
    if device_map is not None:
        kwargs["device_map"] = device_map
    if attn_implementation is None and causal_on_token_ids(config):
        attn_implementation = "eager"  # its SDPA attends bidirectionally over a batch without padding
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    try:
        with _quiet_load_report() as reports:
            model, info = cast(Any, cls).from_pretrained(name_or_path, **kwargs)
    except RuntimeError as error:
        if "ignore_mismatched_sizes" not in str(error):
            raise
        # transformers' own check of the shapes, after headlab's (which reads the weights' tensors under the model's
        # names): tensors it renames when it loads (DeepSeek-V4's attn.wo_a, saved by transformers under those names)
        raise HeadlabError(f"{name_or_path}: the weights do not match its config.json: "
                           f"{'; '.join(_mismatches(reports)) or one_line(error)} (if it is a pruned model re-saved by "
                           "transformers under the original checkpoint's tensor names without the plan headlab keeps in "
                           f"config.json, {PLAN_KEY}, headlab cannot read its heads back from them: load the directory "
                           "headlab saved, headlab.save_pruned's)") from None
    except (OSError, SafetensorError) as error:  # a hub model's cached file too
        raise HeadlabError(f"{name_or_path}: cannot load safetensors weights ({one_line(error)})") from error
    except ImportError as error:  # a quantizer's package (bitsandbytes, gptqmodel ...) or a kernel not installed
        quantized = getattr(config, "quantization_config", None)
        method = quantized.get("quant_method") if isinstance(quantized, dict) else \
            getattr(quantized, "quant_method", None)
        why = f"its quantization_config ({getattr(method, 'value', method)}) needs" if quantized is not None else \
            "transformers needs"
        raise HeadlabError(f"{name_or_path}: cannot load it here: {why} what is not installed ({one_line(error)})"
                           ) from None
    except (ValueError, ZeroDivisionError) as error:  # a config transformers cannot build (is_config_error)
        raise HeadlabError(f"{name_or_path}: its config.json does not describe a {cls.__name__} transformers can "
                           f"build ({one_line(error)})") from error
    check_text_of_multimodal(name_or_path, config, cls, info)
    check_complete(name_or_path, info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"])
    if device is not None:
        model = model.to(device)
    if any(cls in listed_classes(table, config) for table in MULTIMODAL_TABLES):
        model = _language_model_if_refused(model.eval(), name_or_path)
    return model.eval()


def _analysed_structure(structure: nn.Module, shapes: dict) -> tuple[nn.Module, dict, bool]:
    """The structure headlab analyses (:func:`headlab.language_model.analysed_model`: a refused multimodal wrapper's
    language model), with the weights' shapes under its own tensors' names, and whether it is the language model."""
    from headlab.language_model import analysed_model

    if not any(type(structure) in listed_classes(table, structure.config) for table in MULTIMODAL_TABLES):
        return structure, shapes, False
    analysed, wrapped = analysed_model(structure)
    if not wrapped:
        return structure, shapes, False
    return analysed, _shapes_as_named_in(analysed, structure, shapes), True


def _shapes_as_named_in(part: nn.Module, whole: nn.Module, shapes: dict) -> dict:
    """``shapes`` (of ``whole``'s tensors, by name) for the tensors ``part`` shares with ``whole``, under their names
    in ``part`` (a tied tensor: whichever of its names the weights store)."""
    names: dict[int, list[str]] = {}
    for name, tensor in (*whole.named_parameters(remove_duplicate=False),
                         *whole.named_buffers(remove_duplicate=False)):
        names.setdefault(id(tensor), []).append(name)
    renamed = {}
    for name, tensor in (*part.named_parameters(remove_duplicate=False), *part.named_buffers(remove_duplicate=False)):
        stored = next((n for n in names.get(id(tensor), ()) if n in shapes), None)
        if stored is not None:
            renamed[name] = shapes[stored]
    return renamed


def _language_model_if_refused(model: nn.Module, source: str) -> nn.Module:
    """A loaded multimodal wrapper that headlab refuses as a whole, around a language model it supports: that
    language model (:func:`headlab.language_model.language_model_of`), checked to give the wrapper's logits."""
    from headlab.language_model import analysed_model, check_same_logits

    analysed, wrapped = analysed_model(model)
    if wrapped:
        check_same_logits(model, analysed, source)
    return analysed


@contextmanager
def _quiet_load_report():
    """transformers' table of missing and unexpected tensors stays off stderr: check_complete
    refuses such a load in one line naming them (the allowed ones are not worth a table). A
    filter, not a level: transformers reads its logger's level to decide other warnings. The
    tables are kept in the list it yields (:func:`_mismatches` reads them)."""
    logger = logging.getLogger("transformers.modeling_utils")
    reports: list[str] = []

    def no_report(record: logging.LogRecord) -> bool:
        if "LOAD REPORT" not in str(record.msg):
            return True
        reports.append(record.getMessage())
        return False

    logger.addFilter(no_report)
    try:
        yield reports
    finally:
        logger.removeFilter(no_report)


def _mismatches(reports: list[str]) -> list[str]:
    """The MISMATCH rows of transformers' load reports, each ``name: checkpoint [..] vs model [..]``."""
    rows = []
    for line in "\n".join(reports).splitlines():
        cells = [cell.strip() for cell in re.sub(r"\x1b\[[0-9;]*m", "", line).split("|")]
        if len(cells) == 3 and cells[1] == "MISMATCH":
            shapes = re.findall(r"torch\.Size\(\[([^]]*)\]\)", cells[2])
            rows.append(f"{cells[0]}: weights [{shapes[0]}], model [{shapes[1]}]" if len(shapes) == 2 else cells[0])
    return rows


def _record_from_weights(structure: nn.Module, shapes: dict) -> dict | None:
    # a re-save through pruned_heads.py keeps the plan, which names the kept heads in their original numbering
    plan = getattr(getattr(structure, "config", None), PLAN_KEY, None)
    plan = plan if isinstance(plan, dict) else None
    # weights under the checkpoint's own tensor names (Inkling2's, converted by transformers): the plan alone
    record = record_from_weights(structure, shapes, plan) or record_from_plan(structure, shapes, plan)
    return None if record is None else {"format": FORMAT_VERSION, **record}


def _built_in(dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype to build a pruned model in before its weights load (:func:`headlab.surgery.load_pruned`): float64
    when asked for it, so float64 weights are not rounded to float32 on the way; else torch's default (float32), into
    which narrower weights widen exactly and which :func:`_place` then narrows as asked."""
    return dtype if dtype == torch.float64 else None


def _place(model: nn.Module, path: Path, dtype, device, device_map) -> nn.Module:
    """A model headlab built (pruned) in eval mode, with its generation settings, dtype and placement."""
    if (path / "generation_config.json").is_file():  # beam, lengths, forced tokens of the saved model
        import transformers

        cast(Any, model).generation_config = transformers.GenerationConfig.from_pretrained(path)
    model = model.to(dtype)
    if device_map is not None:
        model = _dispatch(model, device_map)
    elif device is not None:
        model = model.to(device)
    return model.eval()


def config_structure(name_or_path: str, trust_remote_code: bool = False) -> nn.Module:
    """The structure its config.json describes, on the meta device, as load_model would analyse it (a refused
    multimodal wrapper's language model); no weights read, a pruned directory's heads all there."""
    config = load_config(name_or_path, trust_remote_code)
    model = build_model(model_class_for(config, f"{name_or_path}/config.json"), config, name_or_path, meta=True)
    return _analysed_structure(model, {})[0]


def build_from_config(name_or_path: str, trust_remote_code: bool = False) -> nn.Module:
    """The model's structure without its weights (on the meta device): enough to list heads.
    A local directory's weights' headers must fit it; where they say that layers kept fewer heads
    (a pruned directory re-saved by transformers), the model is loaded with those heads."""
    config = load_config(name_or_path, trust_remote_code)
    model = build_model(model_class_for(config, f"{name_or_path}/config.json"), config, name_or_path, meta=True)
    path = Path(name_or_path)
    if path.is_dir() and any(path.glob("*.safetensors")):  # a config alone lists the config's heads
        model, shapes, wrapped = _analysed_structure(model, tensor_shapes(path))
        record = None if wrapped else _record_from_weights(model, shapes)
        if record is not None:  # re-saved by transformers: the loaded model (load_pruned checks the pruning)
            return load_pruned(path, type(model), trust_remote_code=trust_remote_code, record=record)
        check_fits_weights(model, shapes, f"{path}/config.json")
        return model
    return _analysed_structure(model, {})[0]


def check_supported(name_or_path: str, trust_remote_code: bool = False, flag: str = "model", *,
                    prune: bool = False) -> None:
    """Refuse, before any work, a model whose attention headlab cannot analyse exactly: its
    structure is built from the config on the meta device (no weights read) and must give
    attention blocks (:func:`headlab.adapters.attention_blocks`), or the one error says what is
    missing; with ``prune``, blocks that physical pruning can slice
    (:func:`headlab.surgery.check_block_sliceable`). A hub id that is not in the cache is left to the loader."""
    from headlab.adapters import attention_blocks, unsupported_reason

    path = Path(name_or_path)
    if not path.is_dir():
        try:
            config = load_config(name_or_path, trust_remote_code)
        except HeadlabError:
            return  # not found here: the loader says so in its own words
    else:
        config = load_config(name_or_path, trust_remote_code)
    reason = unsupported_reason(config)
    if reason:
        raise HeadlabError(f"{flag} {name_or_path} (model_type {config.model_type!r}) is not supported: {reason}")
    cls = model_class_for(config, f"{flag} {name_or_path}")
    try:
        with torch.device("meta"):
            model = cls(config_for(cls, config))
    except (ValueError, TypeError, ImportError, NotImplementedError, ZeroDivisionError, RuntimeError) as error:
        if isinstance(error, RuntimeError) and not is_config_error(error):
            raise
        raise HeadlabError(f"{flag} {name_or_path}: cannot build the model from its config ({error})") from None
    problem = token_ids_problem(model)
    if problem:
        raise HeadlabError(f"{flag} {name_or_path} (model_type {config.model_type!r}): {problem}")
    wrapper = model
    try:
        model, _, wrapped = _analysed_structure(model, {})  # a refused wrapper's language model: what load_model gives
        for block in attention_blocks(model):
            if prune and not block.idle:  # an idle block's heads are refused if named (surgery.check_checkable)
                check_block_sliceable(block)
    except HeadlabError as error:
        raise HeadlabError(f"{flag} {name_or_path}: {error}") from None
    if path.is_dir() and getattr(config, "quantization_config", None) is None:
        # The weights' headers (no tensor read), as load_model reads them: none (a pickle .bin only),
        # a corrupt file or shapes that do not fit the config are refused here, not when a stage
        # loads the model (analyze failed every stage and wrote an empty report).
        shapes = tensor_shapes(path)
        if wrapped:
            shapes = _shapes_as_named_in(model, wrapper, shapes)
        if not (path / PRUNING_FILE).is_file() and _record_from_weights(model, shapes) is None:
            check_fits_weights(model, shapes, f"{path}/config.json")


_TEXT_INPUTS = frozenset({"input_ids", "attention_mask", "decoder_input_ids", "inputs_embeds"})
"""What headlab's commands give a model: token ids (and their masks; an encoder-decoder's target ids)."""


def required_inputs(cls: type[nn.Module]) -> list[str]:
    """The arguments ``cls.forward`` requires besides token ids and their masks (BLIP-2's ``pixel_values``)."""
    import inspect

    try:
        parameters = inspect.signature(cls.forward).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in parameters if p.default is p.empty and p.name not in {"self", *_TEXT_INPUTS}
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def token_ids_problem(model: nn.Module) -> str | None:
    """Why ``model``'s forward cannot run on token ids alone, where every command runs it (None: it can): an argument
    its forward requires besides them (BLIP-2's ``pixel_values``), or the probe forward of
    :mod:`headlab.adapters.discovery` failing on token ids with a TypeError or ValueError (Kosmos-2 raises without
    ``pixel_values`` or ``image_embeds``, UDOP without ``bbox``). Before, such a model was analysed by its layers'
    names (the probe's fallback for older modeling code) and the first stage failed with "internal error" after the
    model loaded."""
    from headlab.adapters.discovery import discover

    runs = "headlab runs models on token ids (their text) only"
    if required := required_inputs(type(model)):
        return f"{type(model).__name__}.forward requires {', '.join(required)}: {runs}"
    try:
        discover(model)
    except HeadlabError as error:
        cause = error.__cause__
        if isinstance(cause, (TypeError, ValueError)):
            return f"{type(model).__name__}'s forward fails on token ids alone ({type(cause).__name__}: " \
                   f"{one_line(cause)}): {runs}"
    return None


# What a tokenizer directory holds (fast, slow, SentencePiece and BPE formats).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.*", "*.model", "merges.txt", "*.spm")


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False):
    import transformers

    path = Path(name_or_path)
    if path.is_dir() and not any(next(path.glob(pattern), None) for pattern in _TOKENIZER_FILES):
        raise HeadlabError(f"{name_or_path}: cannot load a tokenizer: the directory has none "
                           f"(no {', '.join(_TOKENIZER_FILES[:3])}, ...)")
    if not path.exists():
        check_hub_reachable(name_or_path, ("tokenizer_config.json", "tokenizer.json", "config.json"))
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, ImportError) as error:
        # ImportError: a tokenizer class whose package is missing (XLM's and FlauBERT's need sacremoses)
        raise HeadlabError(f"{name_or_path}: cannot load a tokenizer ({error})") from error
    return _as_written(tokenizer, path, trust_remote_code)


def _as_written(tokenizer, path: Path, trust_remote_code: bool):
    """The tokenizer that ``path/tokenizer.json`` describes. transformers v5 builds the model type's
    own tokenizer class (Qwen2's: BPE) even where tokenizer_config.json names the generic backend and
    the file holds another model (a WordLevel one): every word then encodes to nothing or junk, with
    no error. Where the built tokenizer's model differs from the file's, the file is loaded as it is."""
    import json

    import transformers

    file = path / "tokenizer.json"
    backend = getattr(tokenizer, "backend_tokenizer", None)
    generic = type(tokenizer) is transformers.PreTrainedTokenizerFast  # (v5's TokenizersBackend is this class)
    if generic or not path.is_dir() or not file.is_file() or backend is None:  # a generic class reads the file as is
        return tokenizer
    try:
        written = json.loads(file.read_text(encoding="utf-8")).get("model", {}).get("type")
    except (OSError, ValueError, AttributeError):
        return tokenizer
    built = type(backend.model).__name__
    if not written or written == built:
        return tokenizer
    logging.getLogger(__name__).warning("%s: transformers built a %s tokenizer (%s) from a tokenizer.json holding a %s model; "
                   "using tokenizer.json as written", path, built, type(tokenizer).__name__, written)
    return transformers.PreTrainedTokenizerFast.from_pretrained(str(path), trust_remote_code=trust_remote_code)


def vocab_size_of(model_or_config) -> int | None:
    """Rows of the model's input embedding table, read from the model or its config."""
    try:
        embeddings = getattr(model_or_config, "get_input_embeddings", lambda: None)()
    except NotImplementedError:  # transformers' default finds no embedding table (PeAudioModel): read the config
        embeddings = None
    if embeddings is not None and hasattr(embeddings, "num_embeddings"):
        return int(embeddings.num_embeddings)
    config = getattr(model_or_config, "config", model_or_config)
    size = getattr(text_config(config), "vocab_size", None)  # the text model's embeddings
    return int(size) if isinstance(size, int) else None


_SPECIAL_TOKENS = ("pad", "bos", "eos", "unk", "sep", "cls", "mask")


def _tokenizer_named(tokenizer, name: str) -> str:
    """How an error names the tokenizer: where it was read from when that is not the model's directory (a
    --tokenizer of another model; "tokenizer of MODEL" blamed the model's own)."""
    source = getattr(tokenizer, "name_or_path", None)
    if isinstance(source, str) and source and os.path.realpath(source) != os.path.realpath(name) \
            and shown_model_name(source) != name:  # a results' name ("model" of /x/model) is the directory's own
        return f"tokenizer {source} (given for {name})"
    return f"tokenizer of {name}"


def check_tokenizer_fits(tokenizer, model_or_config, name: str = "the model") -> None:
    """Every special token the tokenizer inserts (padding above all) has an embedding row:
    a pad id beyond the vocabulary would otherwise fail deep inside the model as an IndexError. A tokenizer of
    tables (TAPAS's) is refused."""
    whose = _tokenizer_named(tokenizer, name)
    if type(tokenizer).__name__ == "TapasTokenizer":
        # its __call__ takes (table, queries): tokenizer(text=...) raised a TypeError, and a long query a ValueError
        raise HeadlabError(
            f"{whose}: TapasTokenizer encodes questions about a table (tokenizer(table, queries)), not "
            "plain text: it takes no text= argument and cannot cut a query longer than its maximum length, and "
            "headlab's inputs are plain text; give TAPAS a BERT tokenizer of its vocabulary instead "
            "(transformers.BertTokenizer(vocab='path/to/vocab.txt'): [CLS] text [SEP], what TapasTokenizer gives a query with "
            "an empty table)")
    size = vocab_size_of(model_or_config)
    if size is None or tokenizer is None:
        return
    # Its ordinary vocabulary (added tokens aside) larger than the embeddings: another model's
    # tokenizer, whose ids beyond them would fail deep inside the model as an IndexError.
    base = getattr(tokenizer, "vocab_size", None)
    if isinstance(base, int) and base > size:
        raise HeadlabError(
            f"{whose}: its vocabulary has {base} tokens, more than the model's {size} embeddings "
            f"(ids 0..{size - 1}); use the tokenizer the model was trained with")
    for special in _SPECIAL_TOKENS:
        token_id = getattr(tokenizer, f"{special}_token_id", None)
        if isinstance(token_id, int) and not 0 <= token_id < size:
            token = getattr(tokenizer, f"{special}_token", None)
            raise HeadlabError(
                f"{whose}: the {special} token {token!r} has id {token_id}, outside the model's "
                f"vocabulary of {size} embeddings (ids 0..{size - 1}); use the tokenizer the model was trained "
                "with, or give it a token the model knows (tokenizer.pad_token = tokenizer.eos_token) or "
                "resize the model's embeddings (model.resize_token_embeddings)")


def check_given_tokenizer(tokenizer, tokenizer_path: str | None, model_path: str, name: str,
                          trust_remote_code: bool = False) -> None:
    """The checks of a command's tokenizer (``--tokenizer``, or the model directory's own when None), before the
    weights load: :func:`check_tokenizer_fits` against the config's vocabulary, then :func:`check_same_vocabulary`.
    ``name``: the model as the refusals name it."""
    check_tokenizer_fits(tokenizer, load_config(model_path, trust_remote_code), name)
    check_same_vocabulary(tokenizer, tokenizer_path, model_path, trust_remote_code)


def _base_vocabulary(tokenizer) -> dict[str, int]:
    """Token -> id of the tokenizer's ordinary vocabulary, its added tokens aside (they differ between copies of one
    vocabulary: a pad token added by a user)."""
    added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
    return {token: index for token, index in tokenizer.get_vocab().items() if token not in added}


def _first_disagreement(given: dict[str, int], own: dict[str, int]) -> tuple[str, int | None, int | None] | None:
    """``(token, its id in given, its id in own)`` for the first token, in the model's own ids' order (then the given
    one's), whose id the two vocabularies do not agree on (None where a vocabulary lacks it); None if they agree."""
    for token, index in sorted(own.items(), key=lambda item: item[1]):
        if given.get(token) != index:
            return token, given.get(token), index
    return next(((token, index, None) for token, index in sorted(given.items(), key=lambda item: item[1])
                 if token not in own), None)


def check_same_vocabulary(tokenizer, tokenizer_path: str | None, model_path: str,
                          trust_remote_code: bool = False) -> None:
    """Refuse ``--tokenizer`` (``tokenizer``, read from ``tokenizer_path``) when the model's directory has a tokenizer
    of its own whose ordinary vocabulary (token -> id, added tokens aside) is not the same: every id would mean
    another token to the model, with no error (:func:`check_tokenizer_fits` refuses a larger vocabulary only). A copy
    of the model's own (its files elsewhere) passes; a model directory without a tokenizer, or whose tokenizer does
    not load, for which --tokenizer is the only one, is not checked. There is no override: a model reads ids as the
    tokenizer it was trained with gives them."""
    model_dir = Path(model_path)
    if tokenizer_path is None or not model_dir.is_dir() \
            or os.path.realpath(tokenizer_path) == os.path.realpath(model_dir) \
            or not any(next(model_dir.glob(pattern), None) for pattern in _TOKENIZER_FILES):
        return
    try:
        own = load_tokenizer(model_path, trust_remote_code)
    except HeadlabError:  # the directory's own tokenizer does not load (why --tokenizer is given): nothing to compare
        return
    found = _first_disagreement(_base_vocabulary(tokenizer), _base_vocabulary(own))
    if found is None:
        return
    token, given, theirs = found

    def where(index: int | None) -> str:
        return "absent" if index is None else f"id {index}"

    raise HeadlabError(
        f"--tokenizer {tokenizer_path}: its vocabulary is not that of the model's own tokenizer ({model_path}): "
        f"{token!r} is {where(given)} in it and {where(theirs)} in the model's, so the model would read its ids as "
        "other tokens, with no error; leave out --tokenizer to use the model's own (a copy of it, the same tokens "
        "and ids, is accepted)")


# -- where the weights go: --device, --dtype, --device-map ----------------------------------
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise HeadlabError(f"--dtype {dtype}: expected one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def check_device(device: str | torch.device | None) -> torch.device | None:
    """``device`` as a torch device, or a clear error when it does not exist here."""
    if device is None:
        return None
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise HeadlabError(f"--device {device}: not a device (cpu, cuda or cuda:N)") from error
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise HeadlabError(f"--device {device}: no CUDA device is available here (torch.cuda.is_available() "
                               "is False)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise HeadlabError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) (cuda:0.."
                               f"cuda:{torch.cuda.device_count() - 1})")
    elif device.type == "mps":
        backend = getattr(torch.backends, "mps", None)
        if backend is None or not backend.is_available():
            raise HeadlabError(f"--device {device}: no MPS device is available here (Apple silicon with a torch "
                               "built for it only); use cpu or cuda")
    elif device.type != "cpu":
        raise HeadlabError(f"--device {device}: expected cpu, cuda or cuda:N")
    return device


def _dispatch(model: nn.Module, device_map: str | dict) -> nn.Module:
    """A model built by headlab (a pruned one) spread over the devices like from_pretrained's
    ``device_map``."""
    from accelerate import dispatch_model, infer_auto_device_map

    if device_map == "auto":
        no_split = getattr(model, "_no_split_modules", None) or []
        device_map = infer_auto_device_map(model, no_split_module_classes=no_split)
    elif not isinstance(device_map, dict):
        raise HeadlabError(f"--device-map {device_map}: expected auto")
    if set(cast(dict, device_map).values()) <= {"cpu"}:
        return model  # nothing to move (accelerate refuses a map that is all CPU)
    return dispatch_model(model, device_map=device_map)
