"""The family sweep over config variants: the flags that change a model's attention, one at a time (session 39).

experiments/family_sweep.py builds one tiny model per model type from its config's defaults. Checkpoints set flags
those defaults leave off (attention biases, q/k norms, sliding windows, soft-capping, partial rotary, parallel
attention, untied embeddings, ...): each turns on a code path of its own. For each model type this script finds, from
its config class's ``__init__`` signature (a composite config's: its text config's), the booleans whose names relate
to attention (``WORDS``) and flips each one; and sets the known non-boolean ones (``KNOWN``) the config has to a value
other than its default. Each variant is one row, ``type  flag=value  outcome  check  time  message``, with
family_sweep's checks (capture, masking, gates, pruning, LRP) run on the tiny model built with it
(``family_sweep.VARIANT``, set in every build). A variant the config or the model rejects, or that the config drops
(the model's config does not hold the value), is ``skipped`` with the reason, never counted as a pass.

    cd <checkout> && PYTHONPATH=src:tests OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 \\
        .venv/bin/python experiments/variant_sweep.py [--all] [--only TYPE ...] [--timeout 30] [--flags NAME ...]
        [--attn-implementation {sdpa,eager,flex_attention}]
"""

from __future__ import annotations

import inspect
import logging
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import family_sweep as fs  # noqa: E402

WORDS = ("attn", "attention", "qk", "bias", "norm", "gate", "window", "rope", "rotary", "sink", "scale", "parallel",
         "cap", "clip", "tie", "stagger")  # stagger: PEGASUS-X's local blocks shifted by half a block every other layer
# booleans that name what a forward returns or caches, not what it computes
NOT_ATTENTION = {"output_attentions", "output_hidden_states", "return_dict", "use_return_dict", "use_cache",
                 "torchscript", "is_encoder_decoder"}
# non-boolean attributes set where the config has them: the first value that is not the default
KNOWN: dict[str, tuple] = {
    "partial_rotary_factor": (0.5, 0.25), "rotary_pct": (0.5, 0.25), "attn_logit_softcapping": (50.0, 20.0),
    "final_logit_softcapping": (30.0, 10.0), "query_pre_attn_scalar": (16, 32), "clip_qkv": (1.0, 2.0),
    "attention_multiplier": (0.5, 0.25), "sliding_window": (4, 3),
    "use_bidirectional_attention": ("all",),  # Gemma 4's (None, "all" or "vision"; a boolean elsewhere)
    "encoder_attention_type": ("transient-global",),  # LongT5's ("local" by default; google/long-t5-tglobal-*)
}
# set with a sliding window where the config has them (without, Qwen2's window is off, or no layer uses it)
WITH_WINDOW = {"use_sliding_window": True, "layer_types": fs.LOCAL_GLOBAL}
VARIANTS: dict[tuple[str, str], dict] = {}  # (model type, label) -> the attributes set


def text_config_class(config_class):
    """The config class whose attributes a variant sets: a composite config's text config's, or its own."""
    if "text_config" not in getattr(config_class, "sub_configs", {}):
        return config_class
    try:
        return type(config_class().get_text_config())
    except Exception:  # noqa: BLE001 - a composite config without defaults: its declared sub-config class
        return config_class.sub_configs["text_config"]


def defaults(config_class) -> dict:
    """The config's parameters and their defaults; a flag that defaults to None (``bool | None``: Gemma 2's
    use_bidirectional_attention) as False, so that it is flipped too."""
    try:
        parameters = inspect.signature(config_class.__init__).parameters
    except (TypeError, ValueError):
        return {}
    return {name: False if p.default is None and str(p.annotation).replace(" ", "") == "bool|None" else p.default
            for name, p in parameters.items() if p.default is not inspect.Parameter.empty}


def variants(model_type: str, config_class) -> list[dict]:
    """The attributes each variant sets, in the order of the config's signature."""
    own = defaults(text_config_class(config_class))
    overridden = fs.OVERRIDES.get(model_type, {})
    found: list[dict] = []
    for name, default in own.items():
        if isinstance(default, bool) and name not in NOT_ATTENTION and any(w in name.lower() for w in WORDS):
            found.append({name: not default})
        elif name in KNOWN:
            value = next((v for v in KNOWN[name] if v != default), None)
            variant = {name: value}
            if name == "sliding_window":
                variant.update({k: v for k, v in WITH_WINDOW.items() if k in own and k not in overridden})
            found.append(variant)
    return found


def label(variant: dict) -> str:
    first, *rest = variant.items()
    return f"{first[0]}={first[1]}" + "".join(f"+{k}" for k, _ in rest)


def labels(model_type: str, config_class, flags: list[str] | None) -> list[str]:
    found = []
    for variant in variants(model_type, config_class):
        if flags and next(iter(variant)) not in flags:
            continue
        VARIANTS[model_type, label(variant)] = variant
        found.append(label(variant))
    return found


def check(model_type: str, config_class, name: str, timeout: int) -> tuple[str, str, str]:
    fs.VARIANT.clear()
    fs.VARIANT.update(VARIANTS[model_type, name])
    try:
        outcome, step, message = fs.sweep(model_type, config_class, timeout)
    finally:
        fs.VARIANT.clear()
    if outcome == "skipped" and step == "build":  # the config or the model rejects the variant, or drops it
        message = f"rejected: {message}"
    return outcome, step, message


def main() -> None:
    parser = fs.arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--all", action="store_true", help="also the types of the test matrix (as family_sweep)")
    parser.add_argument("--timeout", type=int, default=30, help="seconds per variant")
    parser.add_argument("--flags", nargs="*", help="these config attributes only")
    fs.implementation_argument(parser)
    args = parser.parse_args()
    fs.ATTN_IMPLEMENTATION = args.attn_implementation
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    in_matrix = fs.matrix_types()
    fs.run_types(lambda model_type, config_class, name: check(model_type, config_class, name, args.timeout),
                 only=args.only, timeout=args.timeout, columns=2,
                 skip=lambda model_type: "matrix" if model_type in in_matrix and not args.all and not args.only else "",
                 variants=lambda model_type, config_class: labels(model_type, config_class, args.flags))


if __name__ == "__main__":
    main()
