"""Fuzz headlab's word/subword alignment over the tokenizer pipelines of real model families.

For every pipeline of tests/support/tokenizers_zoo.py and every seed, random CoNLL-U-like
sentences (tests/support/alignment_oracle.py) are aligned by headlab and by an independent
oracle; a sentence headlab aligns must be aligned exactly as the oracle does (owners, truncation,
pooled word attention), or refused. Each failure is printed with its seed and sentence, so that
``--pipelines NAME --seeds S --sentences N`` replays it (each sentence draws from its own
``random.Random(f"{pipeline}/{seed}/{index}")``).

    PYTHONPATH=src:tests OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 \\
        python experiments/fuzz_alignment.py --seeds 0-9 --sentences 200
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import Counter

from headlab.data.alignment import align_sentences
from support.alignment_oracle import Failure, check_sentence, describe, random_sentence
from support.tokenizers_zoo import PIPELINES, zoo_tokenizer


def seed_range(text: str) -> list[int]:
    if "-" in text:
        low, high = text.split("-")
        return list(range(int(low), int(high) + 1))
    return [int(s) for s in text.split(",")]


def refusal_reason(name, words, space_after, max_length) -> str:
    result = align_sentences(zoo_tokenizer(name), [list(words)], max_length=max_length,
                             space_after=None if space_after is None else [space_after])[0]
    return str(result)


REFUSAL_KINDS = {"spans the words": "a subword over two words", "gets no subword": "a word with no subword",
                 "without a space": "a glued combining mark", "offsets": "offsets miss the subword's text",
                 "maximum length": "no word fits max_length"}


def refusal_kind(message: str) -> str:
    return next((kind for key, kind in REFUSAL_KINDS.items() if key in message), "other")


reasons: Counter = Counter()


def run(pipelines, seeds, sentences: int) -> Counter:
    counts: Counter = Counter()
    for name in pipelines:
        for seed in seeds:
            for index in range(sentences):
                rng = random.Random(f"{name}/{seed}/{index}")  # each sentence replayable alone
                words, space_after = random_sentence(rng)
                max_length = rng.choice((None, None, rng.randint(1, 40)))
                try:
                    outcome = check_sentence(name, words, space_after, max_length, rng)
                except Failure as failure:
                    outcome = "FAILED"
                    print(f"FAIL {name} seed={seed} sentence={index} max_length={max_length}: {failure}\n"
                          f"     {describe(words, space_after)}", flush=True)
                if outcome == "over-refused":  # safe, but worth reading: printed with headlab's reason
                    print(f"OVER-REFUSED {name} seed={seed} sentence={index} max_length={max_length}: "
                          f"{refusal_reason(name, words, space_after, max_length)}\n"
                          f"     {describe(words, space_after)}", flush=True)
                if outcome == "refused":
                    reasons[refusal_kind(refusal_reason(name, words, space_after, max_length))] += 1
                counts[(name, outcome)] += 1
    return counts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipelines", nargs="*", default=list(PIPELINES), choices=PIPELINES)
    parser.add_argument("--seeds", default="0-4", help="a range 0-9 or a list 1,5,7")
    parser.add_argument("--sentences", type=int, default=200, help="sentences per pipeline and seed")
    args = parser.parse_args(argv)
    start = time.time()
    counts = run(args.pipelines, seed_range(args.seeds), args.sentences)
    outcomes = ("aligned", "truncated", "refused", "over-refused", "FAILED")
    print(f"{'pipeline':20s}" + "".join(f"{o:>14s}" for o in outcomes))
    for name in args.pipelines:
        print(f"{name:20s}" + "".join(f"{counts[(name, o)]:14d}" for o in outcomes))
    print("headlab's refusals: " + ", ".join(f"{kind} {n}" for kind, n in reasons.most_common()))
    print(f"{sum(counts.values())} sentences in {time.time() - start:.0f} s")
    return 1 if any(o == "FAILED" for _, o in counts) else 0


if __name__ == "__main__":
    sys.exit(main())
