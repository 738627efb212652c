"""Prune a translation model's least confident encoder heads and use the result without headlab.

    python examples/translation.py Helsinki-NLP/opus-mt-en-de --source newstest.en --out runs/pruned --remove 16

Scores every head by confidence (Voita et al. 2019, Sec. 4: the mean of its largest attention
weight on the model's own translations), removes the REMOVE least confident encoder heads
physically, saves the smaller model, and translates with it through plain transformers.
"""

import argparse

import torch
import transformers

import headlab
from headlab.importance import ImportanceConfig, describe_model, read_data, run_importance
from headlab.loading import load_model, load_tokenizer


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--source", required=True, help="source sentences, one per line")
    parser.add_argument("--out", required=True, help="directory for the pruned model")
    parser.add_argument("--remove", type=int, default=4, help="encoder heads to remove")
    args = parser.parse_args(argv)

    model, tokenizer = load_model(args.model), load_tokenizer(args.model)
    info = describe_model(model, tokenizer)
    data = read_data(args.source, tokenizer, info)
    confidence = run_importance(model, data, info, ImportanceConfig(methods=("confidence",), progress=False))
    scores = confidence.scores["confidence"]
    weakest = sorted((v, layer, head) for (kind, layer, head), v in scores.items() if kind == "enc_self")
    spec = {}
    for _, layer, head in weakest[: args.remove]:
        spec.setdefault(("enc_self", layer), []).append(head)
    print(f"removing {args.remove} encoder heads: {spec}")
    headlab.prune_heads(model, spec)
    headlab.save_pruned(model, args.out)
    tokenizer.save_pretrained(args.out)

    # The pruned directory needs no headlab: transformers loads it (with the module saved beside it).
    pruned = transformers.AutoModelForSeq2SeqLM.from_pretrained(args.out, trust_remote_code=True)
    batch = tokenizer(data.source_texts[:3], return_tensors="pt", padding=True)
    with torch.no_grad():
        output = pruned.generate(**batch, num_beams=1, max_new_tokens=40, do_sample=False)
    for source, text in zip(data.source_texts, tokenizer.batch_decode(output, skip_special_tokens=True)):
        print(f"{source}  ->  {text}")


if __name__ == "__main__":
    main()
