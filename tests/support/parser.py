"""A tiny spaCy UD pipeline (morphologizer + parser), trained in about a second on four sentences."""

from __future__ import annotations

from pathlib import Path

# (text, UPOS, 1-based heads, deprels): enough for the morphologizer and the parser to learn them.
PARSER_TRAIN = [
    ("A dog runs .", ["DET", "NOUN", "VERB", "PUNCT"], [2, 3, 0, 3], ["det", "nsubj", "root", "punct"]),
    ("The man eats an apple .", ["DET", "NOUN", "VERB", "DET", "NOUN", "PUNCT"], [2, 3, 0, 5, 3, 3],
     ["det", "nsubj", "root", "det", "obj", "punct"]),
    ("A girl sees the red ball .", ["DET", "NOUN", "VERB", "DET", "ADJ", "NOUN", "PUNCT"], [2, 3, 0, 6, 6, 3, 3],
     ["det", "nsubj", "root", "det", "amod", "obj", "punct"]),
    ("Two boys play quickly .", ["NUM", "NOUN", "VERB", "ADV", "PUNCT"], [2, 3, 0, 3, 3],
     ["nummod", "nsubj", "root", "advmod", "punct"]),
]


def tiny_parser(path: Path) -> Path:
    """Train the pipeline on PARSER_TRAIN and save it (``nlp.to_disk``) at ``path``."""
    import spacy
    from spacy.training import Example

    spacy.util.fix_random_seed(0)
    nlp = spacy.blank("en")
    nlp.add_pipe("morphologizer")
    nlp.add_pipe("parser", config={"min_action_freq": 1})  # keep every label of the few examples
    examples = []
    for text, upos, heads, deps in PARSER_TRAIN:
        annotations = {"words": text.split(), "pos": upos, "heads": [h - 1 if h else i for i, h in enumerate(heads)],
                       "deps": ["ROOT" if d == "root" else d for d in deps]}
        examples.append(Example.from_dict(nlp.make_doc(text), annotations))
    optimizer = nlp.initialize(lambda: examples)
    for _ in range(40):
        nlp.update(examples, sgd=optimizer, drop=0.0)
    nlp.to_disk(path)
    return path
