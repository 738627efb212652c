"""`headlab demo`: the foundation at work on the bundled Multi30k EN-DE model.

Until the full report of ``headlab analyze`` exists, the demo shows the path a researcher takes
by hand: list the heads, score them by confidence (Voita et al. 2019, Sec. 4), physically remove
the least confident encoder heads, and compare size, speed and BLEU of the two models on
bundled test sentences.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from headlab.adapters import attention_blocks
from headlab.commands import heads_table
from headlab.errors import HeadlabError
from headlab.loading import load_model, load_tokenizer
from headlab.surgery import count_parameters, load_pruned, prune_heads, save_pruned

BUNDLED_MODEL = Path("models/multi30k-en-de")
TEST_SOURCE = Path("data/multi30k/test_2016_flickr.en.gz")
TEST_REFERENCE = Path("data/multi30k/test_2016_flickr.de.gz")


def register(subparsers) -> None:
    demo = subparsers.add_parser("demo", help="the pipeline on the bundled translation model")
    demo.add_argument("--model", default=str(BUNDLED_MODEL), help="translation model directory")
    demo.add_argument("--source", default=str(TEST_SOURCE), help="source sentences")
    demo.add_argument("--reference", default=str(TEST_REFERENCE), help="reference translations")
    demo.add_argument("--n-sentences", type=int, default=200, help="sentences to score and translate")
    demo.add_argument("--keep", type=int, default=12, help="encoder heads to keep (the bundled model has 48)")
    demo.add_argument("--out", default="runs/demo", help="where the scores and the pruned model go")
    demo.set_defaults(func=run_demo)


def run_demo(args) -> int:
    from headlab.data.parallel import read_lines
    from headlab.importance.confidence import compute_confidence
    from headlab.importance.data import describe_model, read_data, translate_data
    from headlab.nmt.bleu import compute_scores
    from headlab.nmt.translate import translate

    model_dir, out = Path(args.model), Path(args.out)
    if not (model_dir / "config.json").is_file():
        raise HeadlabError(
            f"{model_dir}: no model there. Train it with the command in docs/nmt.md "
            "(headlab nmt train ...), or pass --model DIR."
        )
    if out.exists() and not out.is_dir():
        raise HeadlabError(f"--out {out}: exists and is not a directory")
    torch.manual_seed(0)
    model, tokenizer = load_model(str(model_dir)), load_tokenizer(str(model_dir))
    print(f"== {model_dir}: {count_parameters(model):,} parameters")
    print(heads_table(attention_blocks(model)))

    info = describe_model(model, tokenizer)
    data = read_data(args.source, tokenizer, info, n_sentences=args.n_sentences)
    data = translate_data(model, data, info, beam=1)
    confidence = compute_confidence(model, data, info, kinds=("enc_self",))
    confidence.save(out / "confidence.json")
    print(f"\n== confidence of the encoder heads over {len(data)} sentences (layer x head), saved to {out}/confidence.json")
    for layer, row in enumerate(confidence["enc_self"]):
        print(f"layer {layer}: " + " ".join(f"{v:.2f}" for v in row))

    removed = confidence.top_mask(keep=args.keep, kinds=("enc_self",))
    pruned = load_model(str(model_dir))
    prune_heads(pruned, removed)
    save_pruned(pruned, out / "pruned")
    tokenizer.save_pretrained(out / "pruned")
    pruned = load_pruned(out / "pruned")
    n_encoder = sum(b.n_heads for b in attention_blocks(model) if b.kind == "enc_self")
    print(f"\n== kept the {args.keep} most confident of {n_encoder} encoder heads; "
          f"parameters {count_parameters(model):,} -> {count_parameters(pruned):,}; saved to {out}/pruned")

    sources = read_lines(args.source)[: args.n_sentences]
    references = read_lines(args.reference)[: args.n_sentences]
    print(f"\n== greedy translation of {len(sources)} test sentences (no fine-tuning after pruning)")
    for name, candidate in (("full", model), ("pruned", pruned)):
        start = time.perf_counter()
        hypotheses = translate(candidate, tokenizer, sources, beam=1)
        seconds = time.perf_counter() - start
        scores = compute_scores(hypotheses, references)
        print(f"{name:>7}: BLEU {scores.bleu:.1f}, chrF {scores.chrf:.1f}, {seconds:.1f} s")
    print(f"\nexample: {sources[0]}\n   full: {translate(model, tokenizer, sources[:1], beam=1)[0]}"
          f"\n pruned: {translate(pruned, tokenizer, sources[:1], beam=1)[0]}")
    return 0
