"""How headlab finds the attention of every text model type transformers registers.

For each ``model_type`` with a causal-LM or masked-LM class, a tiny random model is built from its
config (hidden 32, 2 layers, 4 query heads over 2 key/value heads of 8, vocab 99; types whose
config ignores these sizes, over 3M parameters, are skipped) and :func:`headlab.attention_blocks`
says how it is found: ``table`` (adapters/families.py), ``discovered`` (run time,
adapters/discovery.py), ``generic`` (name-based, transformers' own code outside the attention
interface) or ``refused`` (with the reason). Where found, capture is compared with transformers'
own ``output_attentions`` (eager) on a padded batch, bit for bit. One line per type, then counts.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 .venv/bin/python benchmarks/survey_families.py
"""

from __future__ import annotations

import argparse
import logging
import warnings
from collections import Counter

import torch
import transformers as tf
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from headlab import HeadlabError, attention_blocks, capture_attention

SIZES = dict(vocab_size=99, hidden_size=32, intermediate_size=40, num_hidden_layers=2, max_position_embeddings=64,
             bos_token_id=0, eos_token_id=1, pad_token_id=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def model_class(config_class):
    for auto in (tf.AutoModelForCausalLM, tf.AutoModelForMaskedLM):
        if config_class in auto._model_mapping:
            return auto._model_mapping[config_class]
    return None


def survey(model_type: str, config_class) -> tuple[str, str]:
    cls = model_class(config_class)
    if cls is None:
        return "", ""
    try:
        config = config_class(**SIZES)
        config._attn_implementation = "eager"
        with torch.device("meta"):
            if sum(p.numel() for p in cls(config).parameters()) > 3_000_000:
                return "skipped", "its config ignores the tiny sizes"
        torch.manual_seed(0)
        model = cls(config).eval()
    except Exception as error:  # noqa: BLE001 - any config: reported
        return "skipped", f"does not build ({type(error).__name__})"
    try:
        blocks = attention_blocks(model)
    except HeadlabError as error:
        return "refused", str(error).splitlines()[0]
    family = blocks[0].family.name
    how = family.split(":")[0] if family.startswith(("discovered:", "generic:")) else "table"
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", help="these model types only")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    counts: Counter = Counter()
    for model_type, config_class in sorted(CONFIG_MAPPING.items()):
        if args.only and model_type not in args.only:
            continue
        how, what = survey(model_type, config_class)
        if how:
            counts[how, "equals" in what] += 1
            print(f"{model_type:28s} {how:10s} {what}", flush=True)
    for (how, equal), n in sorted(counts.items()):
        print(f"{how:10s} {'capture equals output_attentions' if equal else '':34s} {n}")


if __name__ == "__main__":
    main()
