"""The committed rare-token results follow the tie rule of headlab.functions.rare_tokens.

Since audit33 a sentence whose tokens all share one training count (a one-token sentence among
them) does not qualify. Under encoder self-attention every query of a qualifying sentence (two
tokens at least) reaches two tokens and is counted, so each head counts a query in every
qualifying sentence: ``rare_summary.json``'s ``n_eligible`` equals every head's sentence count in
``rare_per_sentence.json``. Files written under the old rule counted the one-token sentences as
qualifying (no query of theirs counted): 1,998 against 1,995 sentences for EN-DE. Recount with
``experiments/rare_ties.py``; rerun a stage's rare-token part with its own ``headlab functions`` command.
"""

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RESULTS = sorted((REPO / "docs" / "results").glob("**/functions/rare_summary.json"))


def test_the_committed_rare_token_results_are_found():
    names = {path.relative_to(REPO / "docs" / "results").parts[0] for path in RESULTS}
    assert {"reproduction", "news-en-de"} <= names, names


@pytest.mark.parametrize("summary", RESULTS, ids=lambda path: str(path.relative_to(REPO / "docs" / "results").parent))
def test_every_qualifying_sentence_counts_a_query_of_every_encoder_head(summary):
    per_sentence = summary.with_name("rare_per_sentence.json")
    if not per_sentence.is_file():
        pytest.skip(f"{summary.parent}: no per-sentence counts (run without --sensitivity)")
    eligible = json.loads(summary.read_text(encoding="utf-8"))["n_eligible"]
    heads = json.loads(per_sentence.read_text(encoding="utf-8"))
    checked = 0
    for block, entry in heads.items():
        kind = block.split(":")[0]
        if kind != "enc_self":  # causal attention: a sentence's first token counts no query, a 2-token one none
            continue
        assert set(entry["sentences"]) == {eligible[kind]}, (
            f"{summary}: {eligible[kind]} qualifying sentences, but {block}'s heads counted queries in "
            f"{sorted(set(entry['sentences']))}: written before the tie rule? (recount: experiments/rare_ties.py)")
        checked += 1
    assert checked, f"{per_sentence}: no encoder self-attention block"
