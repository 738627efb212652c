"""experiments/rare_ties.py: its count of qualifying rare-token sentences is the one `headlab functions`
writes (rare_tokens/summary.json's n_eligible), and it names the sentences audit33's tie rule took out."""

from __future__ import annotations

import json

from headlab.cli import main
from support.experiments import load_experiment
from support.models import tiny_model
from support.treebank import SAMPLE_CONLLU, word_tokenizer

rt = load_experiment("rare_ties")


def _sentence(sent_id: str, words: list[str]) -> str:
    lines = [f"# sent_id = {sent_id}"]
    for i, word in enumerate(words, start=1):
        lines.append(f"{i}\t{word}\t{word}\tX\t_\t_\t{int(i > 1)}\t{'dep' if i > 1 else 'root'}\t_\t_")
    return "\n".join(lines) + "\n"


def test_the_count_matches_headlab_functions_and_names_the_tied_sentences(tmp_path, capsys):
    # a one-token sentence, two tokens seen equally often, and two tokens never seen: all tied at one count
    extra = [("one", ["zebra"]), ("pair", ["dog", "ball"]), ("unseen", ["grass", "slowly"])]
    conllu = tmp_path / "tb.conllu"
    conllu.write_text(SAMPLE_CONLLU + "\n" + "\n".join(_sentence(i, w) for i, w in extra), encoding="utf-8")
    words = [line.split("\t")[1] for line in conllu.read_text().splitlines() if line and not line.startswith("#")]
    model = tmp_path / "tiny-marian"
    tiny_model("marian").save_pretrained(model)
    word_tokenizer(words).save_pretrained(model)
    train = tmp_path / "train.txt"
    train.write_text("the the the . . . a a dog ball zebra old\nthe sleep here .\n", encoding="utf-8")

    counted = rt.count_ties(model, conllu, [str(train)], top_frequent=3)
    assert counted["sentences"] == 4 + len(extra)
    assert [(row["sentence"], row["tokens"]) for row in counted["taken_out"]] == [(i, w) for i, w in extra]
    assert counted["eligible_before"] - counted["eligible_after"] == len(extra)

    out = tmp_path / "out"
    assert main(["functions", str(model), "--conllu", str(conllu), "--out", str(out), "--no-progress", "--no-figures",
                 "--train-text", str(train), "--top-frequent", "3"]) == 0
    summary = json.loads((out / "rare_tokens" / "summary.json").read_text())
    assert summary["n_eligible"] == {"enc_self": counted["eligible_after"]}
    capsys.readouterr()
    assert rt.main([str(model), "--conllu", str(conllu), "--train-text", str(train), "--top-frequent", "3"]) == 0
    assert json.loads(capsys.readouterr().out)["eligible_after"] == counted["eligible_after"]
