"""How headlab finds the attention of every text model type transformers registers.

For each ``model_type`` with a causal-LM or masked-LM class, a tiny random model is built from its
config (from the sub-config the class takes, as transformers' auto classes build Qwen3.5's text
model; hidden 32, 2 layers, 4 query heads over 2 key/value heads of 8, vocab 99; types whose
config ignores these sizes, over 3M parameters, are skipped) and :func:`headlab.attention_blocks`
says how it is found: ``table`` (adapters/families.py), ``discovered`` (run time,
adapters/discovery.py), ``generic`` (name-based, transformers' own code outside the attention
interface) or ``refused`` (with the reason). Where found, capture is compared with transformers'
own ``output_attentions`` (eager) on a padded batch, bit for bit. One line per type, then counts.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 .venv/bin/python benchmarks/survey_families.py

experiments/family_sweep.py imports this script's sizes, tiny builder and walk over the model types.
"""

from __future__ import annotations

import argparse
import logging
import warnings
from collections import Counter
from collections.abc import Iterator

import torch
import transformers as tf
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from headlab import HeadlabError, attention_blocks, capture_attention

SIZES = dict(vocab_size=99, hidden_size=32, intermediate_size=40, num_hidden_layers=2, max_position_embeddings=64,
             bos_token_id=0, eos_token_id=1, pad_token_id=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
CAUSAL_OR_MASKED = (tf.AutoModelForCausalLM, tf.AutoModelForMaskedLM)  # the survey's classes, the first that has one
MAX_PARAMETERS = 3_000_000  # more: the config ignores some of the tiny sizes
TOO_LARGE = "its config ignores the tiny sizes"


def model_class(config_class, autos: tuple = CAUSAL_OR_MASKED):
    """The class of the first auto table of ``autos`` that has ``config_class``; None where none has."""
    for auto in autos:
        if config_class in auto._model_mapping:
            return auto._model_mapping[config_class]
    return None


def tiny(config_class, cls, sizes: dict, implementation: str = "eager"):
    """``cls`` built from ``config_class(**sizes)`` from seed 0, in eval mode; None where the config
    ignores the tiny sizes (over ``MAX_PARAMETERS``, counted on the meta device before any memory is
    spent). What the config or the class raises, raised."""
    config = config_class(**sizes)
    # the sub-config the class takes: the auto classes' for a text model of a composite config (Qwen3.5's
    # text_config), and MusicGen's decoder (MusicgenForCausalLM, mapped to MusicgenConfig)
    key = next((k for k, c in config.sub_configs.items() if c is getattr(cls, "config_class", None)), None)
    if key is not None:
        config = config.get_text_config() if key == "text_config" else getattr(config, key)
    config._attn_implementation = implementation
    with torch.device("meta"):
        if sum(p.numel() for p in cls(config).parameters()) > MAX_PARAMETERS:
            return None
    torch.manual_seed(0)
    return cls(config).eval()


def found_by(blocks) -> str:
    """How headlab found the blocks: ``table``, ``discovered`` or ``generic`` (the family's name prefix)."""
    family = blocks[0].family.name
    return family.split(":")[0] if family.startswith(("discovered:", "generic:")) else "table"


def arguments(description: str) -> argparse.ArgumentParser:
    """The options both scripts take (``--only``)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--only", nargs="*", help="these model types only")
    return parser


def model_types(only: list[str] | None) -> Iterator[tuple[str, type]]:
    """(model type, config class) of every type transformers registers, in order; ``only`` these where given."""
    for model_type, config_class in sorted(CONFIG_MAPPING.items()):
        if not only or model_type in only:
            yield model_type, config_class


def survey(model_type: str, config_class) -> tuple[str, str]:
    cls = model_class(config_class)
    if cls is None:
        return "", ""
    try:
        model = tiny(config_class, cls, SIZES)
    except Exception as error:  # noqa: BLE001 - any config: reported
        return "skipped", f"does not build ({type(error).__name__})"
    if model is None:
        return "skipped", TOO_LARGE
    try:
        blocks = attention_blocks(model)
    except HeadlabError as error:
        return "refused", str(error).splitlines()[0]
    how = found_by(blocks)
    ids = torch.randint(3, 99, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    try:
        with torch.no_grad():
            reference = model(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    except Exception as error:  # noqa: BLE001 - any model: reported
        return how, f"{len(blocks)} blocks; the model's own forward fails at these sizes ({type(error).__name__})"
    try:
        with torch.no_grad(), capture_attention(model) as record:
            model(input_ids=ids, attention_mask=mask)
    except Exception as error:  # noqa: BLE001 - any model: reported
        return how, f"{len(blocks)} blocks; capture failed ({type(error).__name__}: {str(error).splitlines()[0][:80]})"
    if reference is None or len(reference) != len(blocks):
        return how, f"{len(blocks)} blocks; output_attentions gives {0 if reference is None else len(reference)} maps"
    equal = all(torch.equal(record[b.key], reference[i]) for i, b in enumerate(blocks))
    return how, f"{len(blocks)} blocks; capture {'equals' if equal else 'DIFFERS FROM'} output_attentions"


def main() -> None:
    args = arguments(__doc__.split("\n\n")[0]).parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    counts: Counter = Counter()
    for model_type, config_class in model_types(args.only):
        how, what = survey(model_type, config_class)
        if how:
            counts[how, "equals" in what] += 1
            print(f"{model_type:28s} {how:10s} {what}", flush=True)
    for (how, equal), n in sorted(counts.items()):
        print(f"{how:10s} {'capture equals output_attentions' if equal else '':34s} {n}")


if __name__ == "__main__":
    main()
