"""Bad-input catalogue, scores and labels that do not fit the model they are read for: pruning by a
HeadScores table (`headlab.prune(model, scores, keep=N)`, `headlab prune baseline --method scores`)
keeps the N best-scored heads, so a head the table does not score would stay beside them,
uncounted; a classifier's labels that read both as class indices and as its label names."""

import json

import numpy as np
import pytest

import headlab
from headlab.cli import main
from headlab.errors import HeadlabError
from headlab.surgery import pruning_record
from support.bad_input import SENTENCES, save_tiny_marian
from support.models import tiny_model

# The tiny Marian has 2 layers x 4 heads of each kind. Each row: the enc_self table, and what the
# refusal must name.
UNFIT = {
    "fewer-layers": (np.arange(4.0).reshape(1, 4), "enc_self layer 1 heads 0,1,2,3"),
    "fewer-heads": (np.arange(4.0).reshape(2, 2), "enc_self layer 0 heads 2,3"),
    "unscored-head": (np.array([[0.0, 1.0, 2.0, np.nan], [4.0, 5.0, 6.0, 7.0]]), "enc_self layer 0 head 3"),
}


@pytest.mark.parametrize("row", sorted(UNFIT))
def test_prune_by_scores_that_miss_heads_of_the_model_is_refused(row):
    """Regression: a table of 1 layer (another model's, or a cut one) pruned 2 heads of layer 0 and
    left layer 1 whole: keep=2 kept 6 heads, said nowhere."""
    values, named = UNFIT[row]
    model = tiny_model("marian")
    with pytest.raises(HeadlabError, match=named) as error:
        headlab.prune(model, headlab.HeadScores({"enc_self": values}, "confidence", "m"), keep=2, kinds=["enc_self"])
    assert "confidence scores" in str(error.value)
    assert pruning_record(model)["blocks"] == {}  # nothing was removed


def test_baseline_by_scores_that_miss_heads_of_the_model_writes_no_row(tmp_path, capsys):
    """Regression: the row said "keep 2" with its BLEU, of a model that kept 6 encoder heads."""
    model_dir = save_tiny_marian(tmp_path / "m")
    (tmp_path / "v.src").write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    headlab.HeadScores({"enc_self": np.arange(4.0).reshape(1, 4)}, "lrp", "m").save(tmp_path / "lrp.json")
    out = tmp_path / "b"
    code = main(["prune", "baseline", str(model_dir), "--method", "scores", "--scores", str(tmp_path / "lrp.json"),
                 "--keeps", "2", "--valid-src", str(tmp_path / "v.src"), "--valid-tgt", str(tmp_path / "v.src"),
                 "--eval-beam", "1", "--out", str(out), "--no-progress"])
    assert code == 2
    assert "lrp scores (enc_self 1x4, layers x heads) have no score for enc_self layer 1" in capsys.readouterr().err
    assert not (out / "baselines.json").exists()


def test_baseline_by_scores_of_another_models_weights_says_so(tmp_path, capsys):
    """Regression (audit31): `prune baseline m1 --method scores --scores` of a table measured on m2 (the same
    architecture, other weights) pruned m1 by m2's ranking, said nowhere (exit 0). Now a note names both; a table
    of m1 itself (or of a copy of it) says nothing."""
    import shutil

    from support.models import tiny_model as build

    mine = save_tiny_marian(tmp_path / "m1")
    other = tmp_path / "m2"
    shutil.copytree(mine, other)
    build("marian", seed=5).save_pretrained(other)
    (tmp_path / "v.src").write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    said = {}
    for name, measured in (("other", other), ("mine", mine), ("copy", shutil.copytree(mine, tmp_path / "copy"))):
        table = tmp_path / f"{name}.json"
        headlab.HeadScores({"enc_self": np.arange(8.0).reshape(2, 4)}, "lrp", str(measured)).save(table)
        code = main(["prune", "baseline", str(mine), "--method", "scores", "--scores", str(table), "--keeps", "2",
                     "--valid-src", str(tmp_path / "v.src"), "--valid-tgt", str(tmp_path / "v.src"), "--eval-beam", "1",
                     "--out", str(tmp_path / f"b-{name}"), "--no-progress"])
        assert code == 0
        said[name] = capsys.readouterr().err
    assert (f"note: --scores {tmp_path / 'other.json'} were measured on {other} (the table's model), whose weights "
            f"differ from {mine}'s") in said["other"]
    assert "note: --scores" not in said["mine"] and "note: --scores" not in said["copy"]


def _two_models(tmp_path):
    """m1 (the tiny Marian), m2 (its architecture, other weights) and a copy of m1, as model directories."""
    import shutil

    from support.models import tiny_model as build

    mine = save_tiny_marian(tmp_path / "m1")
    other = tmp_path / "m2"
    shutil.copytree(mine, other)
    build("marian", seed=5).save_pretrained(other)
    return mine, other, shutil.copytree(mine, tmp_path / "copy")


def test_prune_by_scores_of_another_model_warns(tmp_path):
    """Regression: headlab.prune(m1, scores measured on m2, keep=N) pruned m1 by m2's ranking without a word, where
    `prune baseline --method scores` notes it (audit31). Now a warning in the CLI's words names both; a table of m1
    or of a copy of it says nothing; names whose weights cannot be read (a hub name) are named, hedged."""
    import warnings

    import transformers as tf

    mine, other, copy = _two_models(tmp_path)

    def pruned_by(measured_on) -> list[str]:
        model = tf.MarianMTModel.from_pretrained(mine)  # config._name_or_path: m1's directory
        table = headlab.HeadScores({"enc_self": np.arange(8.0).reshape(2, 4)}, "lrp", str(measured_on))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            headlab.prune(model, table, keep=6, kinds=["enc_self"])
        return [str(w.message) for w in caught if str(w.message).startswith("prune: the scores")]

    assert pruned_by(other) == [f"prune: the scores were measured on {other} (the table's model), whose weights differ "
                                f"from {mine}'s: keep=6 prunes this model by that model's ranking of its heads"]
    assert pruned_by(mine) == [] and pruned_by(copy) == []
    assert pruned_by("org/model") == [f"prune: the scores were measured on org/model (the table's model), not {mine} "
                                      "(weights not compared: no model directory at org/model): if they are other "
                                      "weights, keep=6 prunes this model by that model's ranking of its heads"]


def test_agreement_between_tables_of_other_models_is_refused(tmp_path):
    """Regression: compute_agreement correlated a table of m2 with one of m1 (the same grid, other weights): head h
    of layer l is another head in each, and the table said "agreement". Now refused naming both models; a table of
    a copy of m1 agrees as before; names whose weights cannot be read warn; other grids are refused naming both."""
    import warnings

    from headlab.importance import compute_agreement

    mine, other, copy = _two_models(tmp_path)
    values = np.array([[0.1, 0.4, 0.2, 0.9], [0.3, 0.8, 0.5, 0.7]])

    def table(measured_on, method, grid=values):
        return headlab.HeadScores({"enc_self": grid}, method, str(measured_on), {"n_sentences": 4})

    with pytest.raises(HeadlabError) as error:
        compute_agreement({"lrp": table(other, "lrp")}, table(mine, "ablation"))
    assert str(error.value) == (f"agreement: lrp was measured on {other} and ablation on {mine}, models whose weights "
                                "differ: their heads are not the same heads; compute the measures on the same model")
    assert compute_agreement({"lrp": table(copy, "lrp")}, table(mine, "ablation")).rho["lrp"]["all"] == 1.0
    with pytest.warns(UserWarning, match=rf"agreement: lrp was measured on org/model and ablation on {mine} "
                                         r"\(weights not compared: no model directory at org/model\): if they are other"):
        compute_agreement({"lrp": table("org/model", "lrp")}, table(mine, "ablation"))
    with pytest.raises(HeadlabError, match=r"agreement: lrp was measured on org/model and ablation on org/other, "
                                           r"tables of other head grids: lrp scores enc_self as \(2, 3\), ablation "
                                           r"as \(2, 4\)"):
        compute_agreement({"lrp": table("org/model", "lrp", values[:, :3])}, table("org/other", "ablation"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same model: nothing said
        compute_agreement({"lrp": table(mine, "lrp")}, table(mine, "ablation"))


def test_scores_that_fit_still_prune_to_keep_heads():
    """The check leaves well-formed tables alone: a full one, and one of a pruned model in its
    original numbering (NaN for the heads it lost) or in its current one."""
    model = tiny_model("marian")
    kept = headlab.prune(model, headlab.HeadScores({"enc_self": np.arange(8.0).reshape(2, 4)}, "c", "m"), keep=3,
                         kinds=["enc_self"])
    assert sum(len(kept.get(("enc_self", layer), range(4))) for layer in range(2)) == 3
    for values in (np.array([[0.9, np.nan, np.nan, 0.8], [np.nan, 0.1, 0.7, 0.6]]),  # original numbering
                   np.array([[0.9, 0.8, np.nan], [0.1, 0.7, 0.6]])):  # current numbering
        model = tiny_model("marian")
        headlab.prune(model, "enc_self:0:1,2 enc_self:1:0")
        headlab.prune(model, headlab.HeadScores({"enc_self": values}, "c", "m"), keep=2, kinds=["enc_self"])
        blocks = pruning_record(model)["blocks"]["enc_self"]
        assert sum(len(blocks[str(layer)]["kept_heads"]) for layer in range(2)) == 2, json.dumps(blocks)


# -- a classifier's labels ---------------------------------------------------------------------
def _star_info():
    """A 5-class classifier whose labels are named by numbers that are not their indices (star ratings)."""
    from headlab.model_description import ModelInfo

    return ModelInfo("classifier", 0, frozenset(), frozenset({0, 2, 3}), None, 32, True, n_labels=5,
                     label_names=("1", "2", "3", "4", "5"))


@pytest.mark.parametrize("labels, classes", [(["0", "1", "4"], [0, 1, 4]),  # "0" is no name: indices
                                             (["1", "2", "5"], [0, 1, 4]),  # "5" is no index: names
                                             (["2", "3"], [1, 2])])  # either reading: names, as documented
def test_labels_of_a_file_are_read_one_way(labels, classes):
    """Regression: with labels named "1".."5", a TSV of class indices 0..4 had "0" read as index 0
    and "1" as the name "1", class 0 too: two classes merged, every label after shifted, exit 0."""
    from headlab.data.inputs import labelled_lines_data
    from support.treebank import word_tokenizer

    lines = [f"a cat\t{label}" for label in labels]
    data = labelled_lines_data(lines, word_tokenizer(["a", "cat"], style="bert"), _star_info(), name="d.tsv")
    assert data.classes == classes


def test_labels_that_are_indices_on_one_line_and_names_on_another_are_refused():
    from headlab.data.inputs import labelled_lines_data
    from support.treebank import word_tokenizer

    with pytest.raises(HeadlabError, match=r"d.tsv:1: label '0' is a class index.*d.tsv:3: label '5' is one of the "
                                           r"model's label names"):
        labelled_lines_data(["a cat\t0", "a cat\t1", "a cat\t5"], word_tokenizer(["a", "cat"], style="bert"),
                            _star_info(), name="d.tsv")


def test_labels_given_in_python_as_integers_are_class_indices():
    """Regression: headlab.analyze(..., labels=[1, 2]) wrote the integers as text and read them as the
    label names "1" and "2": classes 0 and 1."""
    from headlab.data.inputs import texts_data
    from support.treebank import word_tokenizer

    tokenizer = word_tokenizer(["a", "cat"], style="bert")
    for labels, classes in (([1, 2], [1, 2]), ([np.int64(3), 0], [3, 0]), (["1", "2"], [0, 1])):
        assert texts_data(["a cat", "cat"], tokenizer, _star_info(), labels=labels).classes == classes


def test_agreement_between_measures_of_other_sentences_is_refused():
    """Regression (audit31): compute_agreement correlated LRP on four sentences with ablation on two of them (exit 0,
    rho -0.23, a table that said "agreement") though the two measured other data."""
    from headlab.importance import compute_agreement
    from support.bad_input import WORDS
    from support.treebank import word_tokenizer

    tokenizer, model = word_tokenizer(WORDS + ["do", "n't"]), tiny_model("marian")
    lrp = headlab.importance(model, tokenizer, SENTENCES, targets=SENTENCES, measures=["lrp"]).scores["lrp"]
    ablation = headlab.importance(model, tokenizer, SENTENCES[:2], targets=SENTENCES[:2],
                                  measures=["ablation"]).scores["ablation"]
    with pytest.raises(HeadlabError, match=r"agreement: lrp and ablation were measured on other data \(sentences 4 "
                                           r"\(the reference's: 2\); source tokens"):
        compute_agreement({"lrp": lrp}, ablation)
    same = headlab.importance(model, tokenizer, SENTENCES, targets=SENTENCES, measures=["ablation"]).scores["ablation"]
    assert set(compute_agreement({"lrp": lrp}, same).rho) == {"lrp"}  # the same sentences: as before


def test_score_tables_record_the_weights_dtype():
    """Regression (audit31): `--dtype bfloat16` (or a bfloat16 model in Python) gave confidence, gradient and ablation
    tables whose signature read like a float32 run's (only LRP's said its precision), though the numbers differ."""
    import torch

    from support.bad_input import WORDS
    from support.treebank import word_tokenizer

    tokenizer = word_tokenizer(WORDS + ["do", "n't"])
    for dtype, said in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
        model = tiny_model("marian").to(dtype)
        result = headlab.importance(model, tokenizer, SENTENCES[:2], targets=SENTENCES[:2],
                                    measures=["confidence", "gradient"])
        assert {name: table.signature["options"]["dtype"] for name, table in result.scores.items()} == \
            dict.fromkeys(result.scores, said)
