"""UAS, LAS and UPOS accuracy of a spaCy UD pipeline on a CoNLL-U treebank, the way `headlab parse`
runs it: one sentence at a time, each a single tree (the parser is told the sentence's bounds),
on the treebank's own words (gold tokenization: the CoNLL 2018 "gold tokens" setting).

Counted over every syntactic word, punctuation included (CoNLL 2018), and also without words
whose gold UPOS is PUNCT (spaCy's own scorer leaves out punct arcs). LAS compares full labels
(``nsubj:pass``), and ``las_universal`` only the part before ``:``.

    python experiments/parser/evaluate.py models/ewt-parser data/ud-english-ewt/en_ewt-ud-test.conllu \
        --out models/ewt-parser/eval_results.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from headlab.data.treebank import read_conllu
from headlab.heads import write_json
from headlab.parse import load_pipeline


def evaluate(model: str, treebank: str, batch_size: int = 64) -> dict:
    from spacy.tokens import Doc

    nlp = load_pipeline(model)
    sentences = [s for s in read_conllu(treebank) if s is not None]  # None only with keep_place
    docs = []
    for sentence in sentences:
        doc = Doc(nlp.vocab, words=list(sentence.words), spaces=list(sentence.space_after))
        for token in doc[1:]:
            token.is_sent_start = False
        docs.append(doc)
    totals = {key: 0 for key in ("words", "uas", "las", "las_universal", "upos", "words_no_punct", "uas_no_punct",
                                 "las_no_punct")}
    started = time.perf_counter()
    for sentence, doc in zip(sentences, nlp.pipe(docs, batch_size=batch_size)):
        for token, head, deprel, upos in zip(doc, sentence.heads, sentence.deprels, sentence.upos):
            predicted_head = -1 if token.head.i == token.i else token.head.i
            predicted_label = "root" if predicted_head == -1 else token.dep_
            head_ok = predicted_head == head
            label_ok = head_ok and predicted_label == deprel
            totals["words"] += 1
            totals["uas"] += head_ok
            totals["las"] += label_ok
            totals["las_universal"] += head_ok and predicted_label.split(":")[0] == deprel.split(":")[0]
            totals["upos"] += token.pos_ == upos
            if upos != "PUNCT":
                totals["words_no_punct"] += 1
                totals["uas_no_punct"] += head_ok
                totals["las_no_punct"] += label_ok
    seconds = time.perf_counter() - started
    n, m = totals["words"], totals["words_no_punct"]
    return {
        "treebank": treebank,
        "sentences": len(sentences),
        "words": n,
        "uas": totals["uas"] / n,
        "las": totals["las"] / n,
        "las_universal": totals["las_universal"] / n,
        "upos": totals["upos"] / n,
        "words_no_punct": m,
        "uas_no_punct": totals["uas_no_punct"] / m,
        "las_no_punct": totals["las_no_punct"] / m,
        "tokenization": "gold (the treebank's words), one sentence per parse",
        "seconds": round(seconds, 1),
        "pipeline": nlp.pipe_names,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="spaCy pipeline directory")
    parser.add_argument("treebank", help="CoNLL-U file with gold trees")
    parser.add_argument("--out", help="JSON file for the scores (default: print only)")
    args = parser.parse_args(argv)
    scores = evaluate(args.model, args.treebank)
    scores["command"] = "python experiments/parser/evaluate.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    if args.out:
        write_json(Path(args.out), scores)
    print(json.dumps(scores, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
