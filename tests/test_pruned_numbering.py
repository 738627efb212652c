"""Acceptance on a physically pruned model whose kept heads are not its first ones: every table
names a head by its original index (docs/foundation.md), so that heads.csv joins the importance
scores and the head functions of the same head."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

import headlab
from headlab import prune_heads
from support.family_matrix import treebank_files
from support.models import tiny_model
from support.treebank import word_tokenizer

ALL = [0, 1, 2, 3]


@pytest.fixture(scope="module")
def pruned_bert():
    """BERT whose layer 0 keeps no head and layer 1 only its original head 1 (now at index 0)."""
    model = tiny_model("bert")
    prune_heads(model, {("enc_self", 0): ALL, ("enc_self", 1): [0, 2, 3]})
    return model


def test_importance_names_the_kept_head_by_its_original_index(pruned_bert, tmp_path):
    words = treebank_files(tmp_path)
    tokenizer = word_tokenizer(words, style="bert")
    texts = (tmp_path / "text.txt").read_text(encoding="utf-8").splitlines()
    confidence = headlab.importance(pruned_bert, tokenizer, texts, measures=["confidence"]).scores["confidence"]
    assert confidence["enc_self"].shape == (2, 4)
    assert math.isfinite(confidence["enc_self"][1, 1])
    assert all(math.isnan(confidence["enc_self"][1, h]) for h in (0, 2, 3))


def test_functions_name_the_kept_head_by_its_original_index(pruned_bert, tmp_path):
    words = treebank_files(tmp_path)
    tokenizer = word_tokenizer(words, style="bert")
    analysis = headlab.functions(pruned_bert, tokenizer, tmp_path / "tb.conllu")
    share = analysis.results["positional"].share["enc_self"]
    assert share.shape == (2, 4)  # it was (2, 1): the kept head named 0
    assert math.isfinite(share[1, 1]) and math.isnan(share[1, 0])


def _tables(analysis) -> dict:
    """Every per-head table of a functions and an aggregate pass, by name."""
    tables = {}
    for name, result in analysis.results.items():
        if name == "aggregate":
            for statistic in result.scores:
                tables[statistic] = result[statistic]
            tables.update({f"pos_{tag}": scores for tag, scores in result.pos.items()})
        elif name == "syntactic":
            tables["syntactic_margin"] = result.margin_over_baseline()
            for relation in result.relations:
                for direction in ("gov->dep", "dep->gov"):
                    tables[f"syntactic_{relation}_{direction}"] = result.accuracy(relation, direction)
        elif name == "rare":
            tables["rare"], tables["two_rare"] = result.rarest, result.two_rarest
            tables["rare_per_sentence"] = result.rarest_per_sentence
        else:
            tables[name], tables[f"{name}_offset"] = result.share, result.offset
    return tables


def _analysis(model, tokenizer, tmp_path):
    """Functions (rare-token heads and the sensitivity readings too) and aggregate statistics in one pass."""
    from headlab.data.frequencies import TokenFrequencies
    from headlab.functions.analysis import AnalysisConfig, analyze_heads

    frequencies = TokenFrequencies.from_texts(tokenizer, (tmp_path / "text.txt").read_text().splitlines(), "text")
    config = AnalysisConfig(functions=True, aggregate=True, sensitivity=True, min_weight=0.0)
    return analyze_heads(model, tokenizer, tmp_path / "tb.conllu", frequencies=frequencies, config=config)


def _named_heads(analysis) -> set[tuple[str, int, int]]:
    """The heads that the printed lines, labels and exemplars name."""
    from headlab.pipeline.labels import head_labels

    named = {tuple(key.split(":")) for key in head_labels(analysis)}
    lines = "\n".join(line for result in analysis.results.values() for line in result.describe_heads())
    named |= {(kind, layer, head) for kind, layer, head in re.findall(r"(\w+_\w+) L(\d+) H(\d+)", lines)}
    for (kind, layer), heaps in analysis.results["aggregate"].exemplars.items():
        named |= {(kind, str(layer), str(head)) for head, heap in enumerate(heaps) if heap}
    return {(kind, int(layer), int(head)) for kind, layer, head in named}


def test_every_statistic_names_an_encoder_s_kept_head_by_its_original_index(pruned_bert, tmp_path):
    """BERT, layer 0 without heads, layer 1 keeping its original head 1: every table of the functions
    and aggregate passes is [2 layers, 4 heads], with values only at (1, 1) where the unpruned model
    has them; labels, printed names and exemplars name no removed head."""
    words = treebank_files(tmp_path)
    tokenizer = word_tokenizer(words, style="bert")
    analysis = _analysis(pruned_bert, tokenizer, tmp_path)
    pruned = _tables(analysis)
    unpruned = _tables(_analysis(tiny_model("bert"), tokenizer, tmp_path))
    assert set(pruned) == set(unpruned) and len(pruned) > 20
    for name, scores in pruned.items():
        table, whole = scores["enc_self"], unpruned[name]["enc_self"]
        assert table.shape == whole.shape == (2, 4), name
        removed = np.ones((2, 4), dtype=bool)
        removed[1, 1] = False
        assert np.isnan(table[removed]).all(), name
        assert np.isfinite(table[1, 1]) == np.isfinite(whole[1, 1]), name
    assert np.isfinite(pruned["positional"]["enc_self"][1, 1]) and np.isfinite(pruned["mean_entropy"]["enc_self"][1, 1])
    assert _named_heads(analysis) <= {("enc_self", 1, 1)}
    exemplars = analysis.results["aggregate"].exemplars_json()
    assert [len(heap) > 0 for heap in exemplars["enc_self:1"]] == [False, True, False, False]
    assert not any(exemplars.get("enc_self:0", []))


def test_every_statistic_names_a_decoder_s_kept_heads_by_their_original_index(tmp_path):
    """GPT-2 keeping head 2 of layer 0 and heads 0, 1, 3 of layer 1. Layer 0 sees the embeddings as
    the unpruned model's layer 0 does, so its head 2 has the unpruned head 2's values (the pruned
    layer 0 changes what layer 1 sees: there only where values are)."""
    words = treebank_files(tmp_path)
    tokenizer = word_tokenizer(words, style="gpt2")
    model = tiny_model("gpt2")
    prune_heads(model, {("dec_self", 0): [0, 1, 3], ("dec_self", 1): [2]})
    analysis = _analysis(model, tokenizer, tmp_path)
    pruned = _tables(analysis)
    whole_analysis = _analysis(tiny_model("gpt2"), tokenizer, tmp_path)
    unpruned = _tables(whole_analysis)
    kept = np.zeros((2, 4), dtype=bool)
    kept[0, 2] = kept[1, [0, 1, 3]] = True
    for name, scores in pruned.items():
        table, whole = scores["dec_self"], unpruned[name]["dec_self"]
        assert table.shape == whole.shape == (2, 4), name
        assert np.isnan(table[~kept]).all(), name
        assert (np.isfinite(table[kept]) == np.isfinite(whole[kept])).all(), name
        assert np.allclose(table[0, 2], whole[0, 2], equal_nan=True, atol=1e-6), name
    assert np.isfinite(pruned["mean_distance"]["dec_self"][kept]).all()
    assert _named_heads(analysis) <= {("dec_self", 0, 2), ("dec_self", 1, 0), ("dec_self", 1, 1), ("dec_self", 1, 3)}
    exemplars = analysis.results["aggregate"].exemplars
    whole_exemplars = whole_analysis.results["aggregate"].exemplars
    assert [bool(heap) for heap in exemplars[("dec_self", 0)]] == [False, False, True, False]
    assert [bool(heap) for heap in exemplars[("dec_self", 1)]] == [True, True, False, True]
    assert [(e.sentence, e.query, e.key) for e in exemplars[("dec_self", 0)][2]] == \
        [(e.sentence, e.query, e.key) for e in whole_exemplars[("dec_self", 0)][2]]


def test_heads_csv_joins_a_pruned_head_s_function_and_importance(pruned_bert, tmp_path):
    """`headlab analyze` on a saved pruned BERT: heads.csv's row of the kept head (enc_self L1 H1)
    holds its importance and its function values; no removed head has a row (nothing scores it). The report's
    attention viewer names the heads alike (the removed ones' rows are 0, listed as removed)."""
    import csv
    import json

    from support.family_matrix import analyze

    words = treebank_files(tmp_path)
    headlab.save_pruned(pruned_bert, tmp_path / "model")
    word_tokenizer(words, style="bert").save_pretrained(tmp_path / "model")
    code, stages = analyze(tmp_path / "model", tmp_path)
    assert code == 0, stages
    out = tmp_path / "out"
    rows = {(r["kind"], int(r["layer"]), int(r["head"])): r for r in csv.DictReader((out / "heads.csv").open())}
    share = json.loads((out / "functions" / "positional" / "share.json").read_text())["scores"]["enc_self"]
    confidence = json.loads((out / "importance" / "confidence.json").read_text())["scores"]["enc_self"]
    kept = rows[("enc_self", 1, 1)]
    assert float(kept["positional_share"]) == share[1][1] and float(kept["confidence"]) == confidence[1][1]
    assert kept["mean_entropy"] != ""
    assert [key for key in rows if key[0] == "enc_self"] == [("enc_self", 1, 1)]  # no removed head scored or labelled
    block = json.loads((out / "attention" / "sentence-000.json").read_text())["blocks"]["enc_self:1"]
    assert block["shape"][0] == 4 and block["removed"] == [0, 2, 3]


def test_a_statistic_without_the_original_numbering_is_refused_before_any_work(pruned_bert, tmp_path):
    """A plug-in statistic that cannot name a pruned model's heads by their original index is refused
    on such a model before the pass (its table would name other heads than heads.csv)."""
    from headlab.errors import HeadlabError
    from support import plugins

    words = treebank_files(tmp_path)
    tokenizer = word_tokenizer(words, style="bert")
    with plugins.registered():
        with pytest.raises(HeadlabError, match="first_token cannot name a pruned model's heads by their original"):
            headlab.functions(pruned_bert, tokenizer, tmp_path / "tb.conllu")
        model = tiny_model("bert")
        prune_heads(model, {("enc_self", 0): [2, 3]})  # kept heads 0, 1: the numbering is the original one
        assert "first_token" in headlab.functions(model, tokenizer, tmp_path / "tb.conllu").results


def test_gates_json_names_a_pruned_model_s_heads_by_their_original_index():
    """`prune train` on a model pruned before: gates.json (P(open) per head) is a score table like
    the others, in the original numbering (it put the kept heads at 0..n-1)."""
    from headlab import attach_gates
    from headlab.pruning import HardConcreteGates

    model = tiny_model("marian")
    prune_heads(model, {("enc_self", 0): [1, 2], ("dec_cross", 1): ALL, ("dec_self", 0): [0, 1, 3]})
    gates = HardConcreteGates({("enc_self", 0): 2, ("enc_self", 1): 4, ("dec_self", 0): 1, ("dec_self", 1): 4,
                               ("dec_cross", 0): 4, ("dec_cross", 1): 0})
    attach_gates(model, gates)
    with torch.no_grad():
        gates.log_alpha["enc_self_0"].copy_(torch.tensor([5.0, -10.0]))  # original heads 0 and 3
        gates.log_alpha["dec_self_0"].copy_(torch.tensor([-10.0]))  # original head 2
    scores = gates.p_open_scores("tiny", model)
    assert {kind: scores[kind].shape for kind in scores.kinds} == {"enc_self": (2, 4), "dec_self": (2, 4),
                                                                   "dec_cross": (2, 4)}
    enc, dec = scores["enc_self"], scores["dec_self"]
    assert enc[0, 0] > 0.99 and enc[0, 3] < 0.01 and np.isnan(enc[0, [1, 2]]).all()
    assert dec[0, 2] < 0.01 and np.isnan(dec[0, [0, 1, 3]]).all()
    assert np.isnan(scores["dec_cross"][1]).all() and not np.isnan(scores["dec_cross"][0]).any()
    # an unpruned model's table is what it was without the model
    plain = HardConcreteGates({("enc_self", 0): 4, ("enc_self", 1): 4})
    unpruned = tiny_model("marian")
    attach_gates(unpruned, plain)
    assert np.array_equal(plain.p_open_scores("tiny", unpruned)["enc_self"], plain.p_open_scores("tiny")["enc_self"])


def test_importance_with_one_head_left_says_rho_is_undefined(pruned_bert, tmp_path, capsys):
    """With one head left no correlation with ablation exists: the command said "no correlation above 0"."""
    from headlab.cli import main

    words = treebank_files(tmp_path)
    pruned_bert.save_pretrained(tmp_path / "model")
    word_tokenizer(words, style="bert").save_pretrained(tmp_path / "model")
    code = main(["importance", str(tmp_path / "model"), "--source", str(tmp_path / "text.txt"), "--method",
                 "confidence,ablation", "--out", str(tmp_path / "out"), "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0
    assert "| confidence | n/a | n/a |" in out
    assert ("no measure can be compared with ablation over all heads: Spearman's rho is undefined over 1 head "
            "(or scores that do not vary)") in out
    assert "no correlation above 0" not in out


def _ids_data():
    from headlab.importance import ImportanceData

    g = torch.Generator().manual_seed(3)
    return ImportanceData.from_ids([torch.randint(3, 99, (k,), generator=g).tolist() + [1] for k in (5, 3)])


@pytest.mark.parametrize("family, pruned, mask, original", [
    ("gpt2", {("dec_self", 0): [0, 1, 3], ("dec_self", 1): [2]}, {("dec_self", 1): [2]}, {("dec_self", 1): [3]}),
    ("bert", {("enc_self", 0): [0, 1], ("enc_self", 1): [0, 2, 3]}, {("enc_self", 0): [0], ("enc_self", 1): [0]},
     {("enc_self", 0): [2], ("enc_self", 1): [1]}),
])
def test_importance_under_a_mask_on_a_renumbered_model_blanks_the_masked_heads(family, pruned, mask, original):
    """``run_importance(mask=...)`` takes the mask in the current numbering (as ``mask_heads``) and its
    tables name heads by their original index (``original``): the masked heads are the ones blanked, and
    the scores equal those of the model with them removed (it blanked the original heads at the masked
    heads' current indices, removed already, and kept a score for each switched-off head)."""
    import copy

    from headlab.importance import ImportanceConfig, describe_model, run_importance
    from headlab.importance.registry import MEASURES

    torch.set_num_threads(1)
    model = tiny_model(family)
    prune_heads(model, pruned)
    removed = copy.deepcopy(model)
    prune_heads(removed, mask)  # prune_heads, as mask_heads, takes the current numbering
    data, config = _ids_data(), ImportanceConfig(methods=("all",), batch_size=2)
    ours = run_importance(model, data, describe_model(model), config, mask=mask).scores
    theirs = run_importance(removed, data, describe_model(removed), config).scores
    assert set(ours) == set(theirs) and len(ours) >= len(MEASURES) - 1
    for method, table in ours.items():
        for kind in table.kinds:
            np.testing.assert_allclose(table[kind], theirs[method][kind], rtol=1e-4, atol=1e-6, err_msg=method)
        # the signature names the masked heads as the table does
        assert table.signature["options"]["mask"] == {f"{k}:{layer}": heads for (k, layer), heads in original.items()}
    # compute_gradient's own mask (its gates at 0) blanks the same heads and gives the same scores
    from headlab.importance.gradient import compute_gradient

    direct = compute_gradient(model, data, describe_model(model), batch_size=2, mask=mask)
    for kind in direct.kinds:
        np.testing.assert_allclose(direct[kind], theirs["gradient"][kind], rtol=1e-4, atol=1e-6)


def test_reconstructed_head_numbers_are_declared_in_every_table_and_report(tmp_path, capsys):
    """Regression: a pruned directory re-saved without its record (load_pruned, then save_pretrained) loads with its
    kept heads numbered by reconstruction (original head 1 of enc_self L1 is head 0), which only a log line said;
    importance, functions, aggregate, heads.csv, the report and `headlab heads` showed head 0 as if it were the
    original model's. Each now declares it: the tables' signatures, a numbering column, a note."""
    import csv
    import json

    from headlab.cli import main
    from support.family_matrix import analyze

    model = tiny_model("bert")
    prune_heads(model, {("enc_self", 1): [0, 2, 3]})
    headlab.save_pruned(model, tmp_path / "pruned")
    headlab.load_pruned(tmp_path / "pruned").save_pretrained(tmp_path / "model")  # no record, no plan
    words = treebank_files(tmp_path)
    word_tokenizer(words, style="bert").save_pretrained(tmp_path / "model")
    code, stages = analyze(tmp_path / "model", tmp_path)
    assert code == 0, stages
    out = tmp_path / "out"
    declared = {"reconstructed": ["enc_self:1"]}
    for table in ("importance/confidence.json", "importance/ablation.json", "functions/positional/share.json",
                  "aggregate/mean_entropy.json"):
        assert json.loads((out / table).read_text())["signature"]["numbering"] == declared, table
    with (out / "heads.csv").open() as handle:
        reader = csv.DictReader(handle)
        assert reader.fieldnames[:6] == ["model", "run", "kind", "layer", "head", "numbering"]
        rows = {(r["kind"], int(r["layer"]), int(r["head"])): r["numbering"] for r in reader}
    assert rows[("enc_self", 1, 0)] == "reconstructed" and rows[("enc_self", 0, 0)] == "original"
    assert ("enc_self", 1, 1) not in rows  # the reconstructed numbering names the kept head 0
    assert "head numbers of enc_self:1 are reconstructed" in (out / "functions" / "README.md").read_text()
    summary = json.loads((out / "functions" / "summary.json").read_text())
    assert summary["report"]["reconstructed_numbering"] == ["enc_self:1"]
    report = (out / "index.html").read_text(encoding="utf-8")
    assert "head numbers of enc_self:1 are reconstructed, not the original model&#x27;s" in report
    capsys.readouterr()
    assert main(["heads", str(tmp_path / "model"), "--json"]) == 0
    blocks = {(r["kind"], r["layer"]): r for r in json.loads(capsys.readouterr().out)}
    assert (blocks[("enc_self", 1)]["numbering"], blocks[("enc_self", 1)]["head_numbers"]) == ("reconstructed", [0])
    assert (blocks[("enc_self", 0)]["numbering"], blocks[("enc_self", 0)]["head_numbers"]) == ("original", ALL)
    assert main(["heads", str(tmp_path / "model")]) == 0
    assert "head numbers of enc_self:1 are reconstructed" in capsys.readouterr().out
    # gates trained on it (prune train's gates.json) say so too
    from headlab import attach_gates
    from headlab.loading import load_model
    from headlab.pruning import HardConcreteGates

    loaded = load_model(str(tmp_path / "model"))
    gates = HardConcreteGates({("enc_self", 0): 4, ("enc_self", 1): 1})
    attach_gates(loaded, gates)
    assert gates.p_open_scores("tiny", loaded).signature["numbering"] == declared
    assert "numbering" not in gates.p_open_scores("tiny", tiny_model("bert")).signature
