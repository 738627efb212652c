"""`headlab analyze` end to end on a tiny saved Marian: stages, manifest, resume, skips, errors."""

import json
import re
import shutil

import pytest
import transformers as tf

from headlab import HeadScores
from headlab.cli import main
from headlab.errors import HeadlabError
from headlab.importance.registry import MEASURES, REFERENCE
from headlab.pipeline import STAGES, AnalyzeConfig, run_analysis
from headlab.pipeline.labels import function_groups
from headlab.pipeline.pipeline import check_conllu_matches_source
from support.models import tiny_model
from support.treebank import SAMPLE_CONLLU, TREEBANK_TEXTS, save_marian_for_treebank, word_tokenizer

SENTENCES = [
    "a man is riding a bike", "two dogs play in the snow", "a woman reads a book",
    "children are playing football", "a cat sleeps on the sofa", "the man is cooking dinner",
]
GERMAN = [
    "ein mann fährt fahrrad", "zwei hunde spielen im schnee", "eine frau liest ein buch",
    "kinder spielen fußball", "eine katze schläft auf dem sofa", "der mann kocht abendessen",
]
FAST = ["--no-progress", "--prune-steps", "2", "--prune-max-tokens", "200", "--prune-keeps", "4,2"]




@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("analyze-inputs")
    save_marian_for_treebank(root / "model", SENTENCES + GERMAN)
    (root / "src.en").write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    (root / "ref.de").write_text("\n".join(GERMAN) + "\n", encoding="utf-8")
    (root / "tb.conllu").write_text(SAMPLE_CONLLU, encoding="utf-8")
    return root


def _args(inputs, out, *extra):
    return ["analyze", str(inputs / "model"), "--source", str(inputs / "src.en"), "--out", str(out), *FAST, *extra]


@pytest.fixture(scope="module")
def full_run(inputs, tmp_path_factory):
    """One complete run with every stage on (module-scoped: the tests below only read it)."""
    out = tmp_path_factory.mktemp("analyze-full") / "out"
    code = main(_args(inputs, out, "--target", str(inputs / "ref.de"), "--conllu", str(inputs / "tb.conllu"),
                      "--prune", "--ablation"))
    assert code == 0
    return out


def test_every_stage_runs_and_the_manifest_follows_the_contract(full_run):
    manifest = json.loads((full_run / "manifest.json").read_text())
    assert set(manifest) == {"headlab_version", "model", "source", "target", "conllu", "created", "written_by", "stages",
                             "figures"}
    assert manifest["written_by"] == "headlab analyze"  # the readers: a stage not listed has not finished
    assert [s["name"] for s in manifest["stages"]] == list(STAGES)
    for stage in manifest["stages"]:
        assert set(stage) == {"name", "status", "reason", "seconds", "outputs"}
        assert stage["status"] == "done", stage
        assert stage["outputs"] and all((full_run / rel).exists() for rel in stage["outputs"])
        assert isinstance(stage["seconds"], float)
    for figure in manifest["figures"]:
        assert set(figure) == {"name", "title", "caption", "png", "svg"}
        assert (full_run / figure["png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (full_run / figure["svg"]).read_text().lstrip().startswith("<?xml")
    names = {f["name"] for f in manifest["figures"]}
    assert {"figure1_enc_self", "aggregate_mean_entropy", "pruning_curve", "pruning_heads_per_kind",
            "gate_trajectories", "importance_lrp"} <= names
    assert (full_run / "index.html").is_file()


def test_the_gate_sweep_records_the_weights_it_pruned(full_run, inputs):
    from headlab.resume import weights_fingerprint

    results = sorted((full_run / "prune").glob("*/result.json"))
    assert results and all(json.loads(r.read_text())["model_sha256"] == weights_fingerprint(inputs / "model")
                           for r in results)


def test_outputs_layout(full_run):
    for measure in MEASURES:  # --ablation: every registered measure ran
        scores = HeadScores.load(full_run / "importance" / f"{measure}.json")
        assert scores["enc_self"].shape == (2, 4)
    agreement = json.loads((full_run / "importance" / "agreement.json").read_text())
    assert agreement["measures"] == list(MEASURES)
    assert agreement["columns"][-1] == "all" and agreement["reference"] == REFERENCE
    n = len(MEASURES)
    for column in agreement["columns"]:
        matrix = agreement["matrix"][column]
        assert len(matrix) == n and all(len(row) == n for row in matrix)
        assert all(matrix[i][i] in (1.0, None) for i in range(n))
        assert matrix[0][1] == matrix[1][0]
    assert set(agreement["spearman"]) == set(MEASURES) - {REFERENCE}
    labels = json.loads((full_run / "functions" / "labels.json").read_text())
    assert set(labels) == {f"enc_self:{layer}:{head}" for layer in range(2) for head in range(4)}
    assert all(isinstance(v, list) for v in labels.values())
    for statistic in ("mean_distance", "mean_entropy", "variability", "dependency_alignment"):
        assert HeadScores.load(full_run / "aggregate" / f"{statistic}.json")["enc_self"].shape == (2, 4)
    rows = json.loads((full_run / "prune" / "sweep.json").read_text())
    assert [r["point"] for r in rows] == ["full", "keep-4", "keep-2"]
    assert [r["enc_self"] for r in rows] == [8, 4, 2]
    assert (full_run / "prune" / "keep-2" / "trajectory.jsonl").is_file()
    assert not (full_run / "prune" / "keep-2" / "train").exists()  # resume checkpoints removed


def _mtimes(directory):
    return {p: p.stat().st_mtime_ns for p in directory.rglob("*") if p.is_file() and p.name != "manifest.json"}


def test_resume_reuses_every_stage_and_force_runs_them_again(full_run, inputs, tmp_path, monkeypatch):
    out = tmp_path / "copy"
    shutil.copytree(full_run, out)
    before = _mtimes(out)
    calls = []
    from headlab.pipeline import pipeline

    for name, runner in list(pipeline.RUNNERS.items()):
        monkeypatch.setitem(pipeline.RUNNERS, name, lambda ctx, name=name, runner=runner: (calls.append(name), runner(ctx))[1])
    args = _args(inputs, out, "--target", str(inputs / "ref.de"), "--conllu", str(inputs / "tb.conllu"),
                 "--prune", "--ablation")
    assert main(args) == 0
    assert calls == []
    assert _mtimes(out) == before
    manifest = json.loads((out / "manifest.json").read_text())
    assert all(s["status"] == "done" for s in manifest["stages"])
    # A changed input reruns what depends on it (and what is drawn from it), nothing else.
    (out / "tb2.conllu").write_text(SAMPLE_CONLLU.replace("quickly", "slowly"), encoding="utf-8")
    args[args.index(str(inputs / "tb.conllu"))] = str(out / "tb2.conllu")
    assert main(args) == 0
    # (the viewer shows the treebank's sentences, with their gold arcs: attention too)
    assert calls == ["functions", "aggregate", "table", "attention", "figures", "report"]
    calls.clear()
    assert main(args + ["--force", "--skip", "prune", "figures"]) == 0
    assert calls == [*MEASURES, "agreement", "functions", "aggregate", "table", "attention", "report"]
    assert (out / "importance" / "lrp.json").stat().st_mtime_ns > before[out / "importance" / "lrp.json"]
    # A sample of LRP targets reruns LRP and what reads it, no other measure.
    calls.clear()
    assert main(args + ["--skip", "prune", "--lrp-targets", "2", "--lrp-seed", "1"]) == 0
    assert calls[0] == "lrp" and not {"confidence", "gradient", "ablation", "functions"} & set(calls)
    signature = HeadScores.load(out / "importance" / "lrp.json").signature
    assert signature["targets_per_sentence"] == 2 and signature["target_sample"]["seed"] == 1


def test_a_skipped_stage_leaves_no_results_of_other_inputs(inputs, tmp_path, capsys):
    """Regression: with --skip, a measure's results of an earlier run on other sentences (another
    --limit) stayed and joined heads.csv beside this run's: confidence on 2 sentences, gradient on 6."""
    out = tmp_path / "out"
    skip = ["--skip", "lrp", "ablation", "prune", "figures", "attention", "report"]
    assert main(_args(inputs, out, *skip)) == 0
    earlier = (out / "importance" / "gradient.json").read_bytes()
    capsys.readouterr()
    assert main(_args(inputs, out, "--limit", "2", *skip, "gradient")) == 0
    err = capsys.readouterr().err
    assert "gradient: skipped (--skip); its results of an earlier run" in err
    assert not (out / "importance" / "gradient.json").exists()
    # Regression: they were deleted (an LRP or a sweep of hours with them); now set aside, as prune sweep does
    assert "were moved aside to stale/gradient.json" in err
    assert (out / "stale" / "gradient.json").read_bytes() == earlier
    assert "gradient" not in (out / "heads.csv").read_text().splitlines()[0]
    assert HeadScores.load(out / "importance" / "confidence.json").signature["n_sentences"] == 2
    # the same inputs: the skipped stage's results are still valid, and kept
    assert main(_args(inputs, out, "--limit", "2", *skip)) == 0
    assert main(_args(inputs, out, "--limit", "2", *skip, "gradient")) == 0
    assert (out / "importance" / "gradient.json").exists()
    assert "gradient" in (out / "heads.csv").read_text().splitlines()[0]


def test_functions_counted_on_source_by_another_rule_run_again(full_run, inputs, tmp_path, monkeypatch):
    """Regression: a classifier's rare-token counts on --source changed (its TSV's text columns
    only) but the functions key did not, so an older run kept its stale counts until --force."""
    from headlab.pipeline import pipeline

    out = tmp_path / "copy"
    shutil.copytree(full_run, out)
    calls = []
    for name, runner in list(pipeline.RUNNERS.items()):
        monkeypatch.setitem(pipeline.RUNNERS, name, lambda ctx, name=name, runner=runner: (calls.append(name), runner(ctx))[1])
    monkeypatch.setattr(pipeline, "SOURCE_COUNTING", pipeline.SOURCE_COUNTING - 1)  # the rule of the older run
    args = _args(inputs, out, "--target", str(inputs / "ref.de"), "--conllu", str(inputs / "tb.conllu"),
                 "--prune", "--ablation", "--skip", "figures", "report")
    assert main(args) == 0
    assert calls == ["functions", "table"]
    # Counted on --train-text, the rule of --source does not matter.
    assert main([*args, "--train-text", str(inputs / "src.en")]) == 0
    calls.clear()
    monkeypatch.setattr(pipeline, "SOURCE_COUNTING", pipeline.SOURCE_COUNTING + 1)
    assert main([*args, "--train-text", str(inputs / "src.en")]) == 0
    assert calls == []

def test_stages_that_cannot_run_are_skipped_with_a_reason(inputs, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(_args(inputs, out, "--prune", "--skip", "gradient", "figures")) == 0
    stages = {s["name"]: s for s in json.loads((out / "manifest.json").read_text())["stages"]}
    assert stages["confidence"]["status"] == stages["lrp"]["status"] == "done"  # the model's own translations
    assert stages["gradient"] == {"name": "gradient", "status": "skipped", "reason": "skipped with --skip",
                                  "seconds": None, "outputs": []}
    assert stages["ablation"]["reason"] == "not requested (pass --ablation)"
    assert stages["functions"]["status"] == stages["aggregate"]["status"] == "skipped"
    assert "no --conllu" in stages["functions"]["reason"]
    assert "no --target" in stages["prune"]["reason"]
    assert stages["agreement"]["status"] == "done"  # confidence and LRP
    assert not (out / "functions").exists() and not (out / "prune").exists()
    printed = capsys.readouterr().out
    assert "functions   skipped" in printed and "no --conllu" in printed


def test_a_model_without_a_language_model_head(tmp_path):
    bare = tf.BertModel(tiny_model("bert").config)
    bare.save_pretrained(tmp_path / "bert")
    words = "a man is riding a bike two dogs play in the snow".split()
    word_tokenizer(words, style="bert").save_pretrained(tmp_path / "bert")
    (tmp_path / "text.txt").write_text("\n".join(SENTENCES[:2]) + "\n")
    config = AnalyzeConfig(model=str(tmp_path / "bert"), source=str(tmp_path / "text.txt"), out=str(tmp_path / "out"),
                           skip=("figures", "report", "attention"), progress=False)
    run = run_analysis(config, log=lambda message: None)
    status = {r.name: r for r in run.records}
    assert status["confidence"].status == "done"
    for name in ("lrp", "gradient"):
        assert status[name].status == "skipped" and "no language-model head" in status[name].reason
    assert not run.failed


def test_bad_input_gets_a_clear_error(inputs, tmp_path, capsys):
    file = tmp_path / "a-file"
    file.write_text("x")
    assert main(_args(inputs, file)) == 2
    assert f"--out {file}: exists and is not a directory" in capsys.readouterr().err
    assert main(["analyze", str(inputs / "model"), "--source", str(tmp_path / "none.txt"), "--out", str(tmp_path / "o")]) == 2
    assert f"--source {tmp_path / 'none.txt'}: no such file" in capsys.readouterr().err
    assert main(["analyze", str(tmp_path / "no-model"), "--source", str(inputs / "src.en"), "--out", str(tmp_path / "o")]) == 2
    assert "no-model: no such directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["analyze", str(tmp_path / "empty"), "--source", str(inputs / "src.en"), "--out", str(tmp_path / "o")]) == 2
    assert f"{tmp_path / 'empty'}: a directory without config.json" in capsys.readouterr().err
    assert main(_args(inputs, tmp_path / "o", "--skip", "lrpp")) == 2
    assert "--skip lrpp: unknown stage" in capsys.readouterr().err
    # --conllu-is-source: sentence i of the treebank must be line i of --source.
    assert main(_args(inputs, tmp_path / "o", "--conllu", str(inputs / "tb.conllu"), "--conllu-is-source")) == 2
    err = capsys.readouterr().err
    assert "does not match --source" in err and "sentence 1" in err and "line 1 of the source" in err
    assert not (tmp_path / "o").exists()


def test_conllu_matching_its_source(inputs, tmp_path):
    source = tmp_path / "treebank.txt"
    source.write_text("\n".join(TREEBANK_TEXTS) + "\n", encoding="utf-8")
    assert check_conllu_matches_source(inputs / "tb.conllu", source) == 4
    # "ball." in the text and "ball ." as words: spacing does not matter, words do.
    source.write_text("\n".join(TREEBANK_TEXTS[:3]) + "\n", encoding="utf-8")
    with pytest.raises(HeadlabError, match="more sentences than --source"):
        check_conllu_matches_source(inputs / "tb.conllu", source)
    assert check_conllu_matches_source(inputs / "tb.conllu", source, limit=3) == 3
    source.write_text("\n".join(TREEBANK_TEXTS + ["one more line"]) + "\n", encoding="utf-8")
    with pytest.raises(HeadlabError, match="has 4 sentences but"):
        check_conllu_matches_source(inputs / "tb.conllu", source)


def test_a_failing_stage_is_recorded_and_the_others_still_run(inputs, tmp_path, monkeypatch, capsys):
    from headlab.pipeline import pipeline

    def boom(ctx):
        raise RuntimeError("boom")

    monkeypatch.setitem(pipeline.RUNNERS, "functions", boom)
    out = tmp_path / "out"
    code = main(_args(inputs, out, "--conllu", str(inputs / "tb.conllu"), "--skip", "importance,attention",
                      "figures", "report"))
    assert code == 1
    stages = {s["name"]: s for s in json.loads((out / "manifest.json").read_text())["stages"]}
    assert stages["functions"]["status"] == "failed" and stages["functions"]["reason"] == "RuntimeError: boom"
    assert stages["aggregate"]["status"] == "done"
    assert stages["lrp"]["reason"] == "skipped with --skip"
    assert "RuntimeError: boom" in capsys.readouterr().err  # the traceback
    assert not (out / ".headlab" / "stages" / "functions.json").exists()


def test_heads_csv_has_one_row_per_head_with_every_measure_and_label(full_run):
    import csv
    import math

    with open(full_run / "heads.csv", newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    heads = [(r["kind"], int(r["layer"]), int(r["head"])) for r in rows]
    assert heads == [(kind, layer, head) for kind in ("enc_self", "dec_self", "dec_cross")
                     for layer in range(2) for head in range(4)]
    columns = list(rows[0])
    assert columns[:5] == ["model", "run", "kind", "layer", "head"]
    groups = function_groups()  # the statistics' label groups: positional, syntactic, rare
    assert columns[-1 - len(groups):] == ["functions", *groups]
    for name in ("confidence", "lrp", "lrp_stderr", "gradient", "gradient_raw", "ablation", "positional_share",
                 "syntactic_margin",
                 "rare_tokens_rarest", "mean_distance", "variability", "pos_NOUN"):
        assert name in columns, name
    # Every cell is the value of its HeadScores file; heads a measure did not score are empty.
    for column, path in (("lrp", "importance/lrp.json"), ("positional_share", "functions/positional/share.json"),
                         ("mean_entropy", "aggregate/mean_entropy.json")):
        scores = dict(HeadScores.load(full_run / path).items())
        for row, key in zip(rows, heads):
            expected = scores.get(key, math.nan)
            if math.isnan(expected):
                assert row[column] == ""
            else:
                assert float(row[column]) == expected
    manifest = json.loads((full_run / "manifest.json").read_text())
    assert {(r["model"], r["run"]) for r in rows} == {(manifest["model"], full_run.name)}
    assert all(name.isidentifier() for name in columns), columns  # syntactic_advmod_dep_gov, not ...advmod.dep-gov
    labels = json.loads((full_run / "functions" / "labels.json").read_text())
    for row, (kind, layer, head) in zip(rows, heads):
        assert row["functions"] == "; ".join(labels.get(f"{kind}:{layer}:{head}", []))
    assert [r for r in rows if r["kind"] == "dec_self"][0]["positional_share"] == ""  # source-side treebank only
    try:
        import pyarrow.parquet as pq
    except ImportError:
        assert not (full_run / "heads.parquet").exists()
    else:
        table = pq.read_table(full_run / "heads.parquet")
        assert table.column_names == columns and table.num_rows == len(rows)


def test_heads_table_of_a_directory_written_before(tmp_path):
    """A directory written before heads.csv had model and run columns and identifier-safe names
    (score files named by relation and tag, `_` for words without a tag) still gives a table: the
    model from its manifest, the run from its name, `advmod.dep-gov` as `advmod_dep_gov`, the tag
    `_` as `pos_none`; without a manifest the model comes from the score files."""
    import csv

    from headlab.pipeline.table import heads_table, write_heads_table

    run = tmp_path / "old-run"
    files = {"importance/lrp.json": "lrp", "functions/syntactic/advmod.dep-gov.json": "syntactic",
             "aggregate/pos/_.json": "pos", "aggregate/pos/NOUN.json": "pos"}
    for i, (relative, method) in enumerate(files.items()):
        HeadScores({"enc_self": [[0.1 * i, 0.2], [0.3, 0.4]]}, method, "models/tiny").save(run / relative)
    (run / "heads.csv").write_text("kind,layer,head,lrp\nenc_self,0,0,0.0\n", encoding="utf-8")  # the old table
    (run / "manifest.json").write_text(json.dumps({"headlab_version": "0.1.0", "model": "models/x", "stages": []}))
    write_heads_table(run)
    with open(run / "heads.csv", newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    assert list(rows[0]) == ["model", "run", "kind", "layer", "head", "lrp", "syntactic_advmod_dep_gov",
                             "pos_NOUN", "pos_none"]
    assert [(r["model"], r["run"], r["kind"], r["layer"], r["head"]) for r in rows] == [
        ("models/x", "old-run", "enc_self", str(layer), str(head)) for layer in range(2) for head in range(2)]
    assert float(rows[0]["pos_none"]) == 0.2 and float(rows[0]["syntactic_advmod_dep_gov"]) == 0.1
    (run / "manifest.json").unlink()
    columns, rows = heads_table(run)
    assert rows[0][:2] == ["models/tiny", "old-run"]
    assert heads_table(run, model="given")[1][0][0] == "given"


def test_default_engine_agrees_with_the_eager_reference(full_run, inputs, tmp_path):
    """Issue 34: confidence, functions and aggregate run fused (headlab's attention function in query
    chunks) by default; ``--engine eager`` (the reference: whole maps) writes the same decisions,
    counts and positions, and floats equal to float32 rounding (the tiny model runs in float32)."""
    from test_functions_cli import _assert_json_close

    out = tmp_path / "eager"
    assert main(_args(inputs, out, "--target", str(inputs / "ref.de"), "--conllu", str(inputs / "tb.conllu"),
                      "--engine", "eager", "--skip", "lrp", "gradient", "prune", "figures", "attention")) == 0
    files = sorted(p.relative_to(out) for p in out.rglob("*.json") if ".headlab" not in p.parts and (
        p.parts[len(out.parts)] in ("functions", "aggregate") or p.name == "confidence.json"))
    assert len(files) > 20 and all((full_run / path).exists() for path in files)
    for path in files:
        if path.name != "summary.json":  # the run's time and configuration
            _assert_json_close(json.loads((full_run / path).read_text()), json.loads((out / path).read_text()),
                               str(path))


def test_beam_reaches_the_measures_and_their_stage_keys(inputs, tmp_path, capsys):
    """Regression: `analyze --beam 4` was ignored (the measures scored the model's greedy
    translations, signature beam 1, as `headlab importance --beam 4` does not), and a resumed run
    with another --beam reused the measures of the earlier beam."""
    out = tmp_path / "out"
    skip = ["--skip", "gradient", "ablation", "functions", "aggregate", "prune", "figures", "attention", "report"]
    assert main(_args(inputs, out, *skip)) == 0
    assert HeadScores.load(out / "importance" / "confidence.json").signature["options"]["beam"] == 1
    capsys.readouterr()
    assert main(_args(inputs, out, *skip, "--beam", "3")) == 0
    assert "confidence: reused" not in capsys.readouterr().err
    for measure in ("confidence", "lrp"):
        assert HeadScores.load(out / "importance" / f"{measure}.json").signature["options"]["beam"] == 3
    reference = tmp_path / "importance"
    assert main(["importance", str(inputs / "model"), "--source", str(inputs / "src.en"), "--out", str(reference),
                 "--method", "confidence", "--beam", "3", "--no-progress"]) == 0
    assert HeadScores.load(out / "importance" / "confidence.json").scores.keys() == \
        HeadScores.load(reference / "confidence.json").scores.keys()
    for kind, values in HeadScores.load(reference / "confidence.json").scores.items():
        assert (HeadScores.load(out / "importance" / "confidence.json").scores[kind] == values).all()


def test_a_stage_not_asked_for_keeps_its_earlier_results(inputs, tmp_path, capsys):
    """Regression: `analyze --prune` then `analyze` (without --prune, here with --force or another
    --limit) deleted the earlier sweep; a stage not asked for now keeps results still valid for this
    run's inputs and sets aside the others in DIR/stale/, as --skip does."""
    out = tmp_path / "out"
    skip = ["--skip", "importance", "attention", "figures", "report"]
    target = ["--target", str(inputs / "ref.de")]
    assert main(_args(inputs, out, *target, *skip, "--prune", "--prune-keeps", "2")) == 0
    sweep = (out / "prune" / "sweep.json").read_bytes()
    capsys.readouterr()
    # the same inputs, --force: the sweep was not asked for, so it is not run again, and kept
    assert main(_args(inputs, out, *target, *skip, "--prune-keeps", "2", "--force")) == 0
    err = capsys.readouterr().err
    assert (out / "prune" / "sweep.json").read_bytes() == sweep
    assert "prune: kept (done earlier; not requested (pass --prune))" in err
    stages = {s["name"]: s for s in json.loads((out / "manifest.json").read_text())["stages"]}
    assert stages["prune"]["status"] == "done"
    # other inputs (--limit 3): set aside, not deleted
    assert main(_args(inputs, out, *target, *skip, "--prune-keeps", "2", "--limit", "3")) == 0
    err = capsys.readouterr().err
    assert not (out / "prune").exists()
    assert "prune: not requested (pass --prune); its results of an earlier run with other inputs or options " \
           "were moved aside to stale/prune" in err
    assert (out / "stale" / "prune" / "sweep.json").read_bytes() == sweep
    stages = {s["name"]: s for s in json.loads((out / "manifest.json").read_text())["stages"]}
    assert stages["prune"]["status"] == "skipped"


def _columns(out):
    return (out / "heads.csv").read_text(encoding="utf-8").splitlines()[0].split(",")


def test_a_killed_stage_s_results_are_not_read_when_it_is_skipped(inputs, tmp_path, capsys):
    """Regression: a run killed in a stage (its outputs written, its marker not: here removed) left
    them in place, and a run that then --skip'ped the stage read them as its own: the functions
    statistics and labels in heads.csv and the report's maps, the gradient column beside this run's
    confidence, while the manifest said both stages were skipped. Now they are set aside in stale/."""
    out = tmp_path / "out"
    run = _args(inputs, out, "--conllu", str(inputs / "tb.conllu"), "--skip", "lrp,ablation,attention,figures")
    assert main(run) == 0
    assert {"gradient", "positional_share", "functions"} <= set(_columns(out))
    for stage in ("functions", "gradient"):  # killed before the marker
        (out / ".headlab" / "stages" / f"{stage}.json").unlink()
    share = (out / "functions" / "positional" / "share.json").read_bytes()
    gradient = (out / "importance" / "gradient.json").read_bytes()
    capsys.readouterr()
    assert main([*run, "functions", "gradient"]) == 0
    err = capsys.readouterr().err
    for stage, where in (("functions", "stale/functions"), ("gradient", "stale/gradient.json, stale/gradient_raw.json")):
        assert f"{stage}: skipped (--skip); its unfinished results (of a run killed or failed in this stage: no " \
               f"done marker) were moved aside to {where}, not read as this run's" in err
    assert not (out / "functions").exists() and not (out / "importance" / "gradient.json").exists()
    assert (out / "stale" / "functions" / "positional" / "share.json").read_bytes() == share  # nothing lost
    assert (out / "stale" / "gradient.json").read_bytes() == gradient
    columns = _columns(out)
    assert "confidence" in columns and "mean_distance" in columns  # this run's
    assert not {"gradient", "gradient_raw", "positional_share", "functions"} & set(columns)
    html = (out / "index.html").read_text(encoding="utf-8")
    assert '"group":"functions"' not in html and '"importance/gradient"' not in html
    assert '"group":"aggregate"' in html
    # the stage run again resumes nothing from stale/ and leaves it alone
    assert main(run) == 0
    assert "positional_share" in _columns(out) and (out / "stale" / "functions").is_dir()


def test_a_failed_stage_s_outputs_are_not_read_as_results(inputs, tmp_path, monkeypatch, capsys):
    """Regression: a stage that failed after writing part of its outputs left them in its folder,
    and the table and the report read them while the manifest said the stage failed; one that ran
    with other inputs than an earlier run's and failed deleted those of this run's files that the
    earlier run's marker named. Now they are set aside in stale/, all of them."""
    from headlab.pipeline import pipeline

    def half_done(ctx):
        written, _ = pipeline._functions(ctx)
        raise RuntimeError(f"boom after {len(written)} files")

    out = tmp_path / "out"
    run = _args(inputs, out, "--conllu", str(inputs / "tb.conllu"), "--skip", "importance,attention,figures")
    said = ("functions: its unfinished results (of a run killed or failed in this stage: no done marker) were "
            "moved aside to {}, not read as this run's")
    with monkeypatch.context() as patch:
        patch.setitem(pipeline.RUNNERS, "functions", half_done)
        assert main(run) == 1
    err = capsys.readouterr().err
    assert "functions: failed: RuntimeError: boom after" in err and said.format("stale/functions") in err
    stages = {s["name"]: s["status"] for s in json.loads((out / "manifest.json").read_text())["stages"]}
    assert stages["functions"] == "failed" and stages["aggregate"] == stages["table"] == stages["report"] == "done"
    assert not (out / "functions").exists() and (out / "stale" / "functions" / "labels.json").is_file()
    assert "mean_distance" in _columns(out) and not {"positional_share", "functions"} & set(_columns(out))
    html = (out / "index.html").read_text(encoding="utf-8")
    assert '"group":"functions"' not in html and '"group":"aggregate"' in html
    # an earlier run of other inputs, done; this run's stage replaces it and fails
    assert main([*run, "--conllu-limit", "2"]) == 0
    with monkeypatch.context() as patch:
        patch.setitem(pipeline.RUNNERS, "functions", half_done)
        assert main(run) == 1
    assert said.format("stale/functions.old2") in capsys.readouterr().err
    assert not (out / "functions").exists()
    aside = out / "stale" / "functions.old2"
    assert (aside / "positional" / "share.json").is_file() and (aside / "labels.json").is_file()  # all of them
    assert json.loads((aside / "summary.json").read_text())["report"]["n_sentences"] > 2  # this run's


def _kill_in(out, stage):
    """The directory as a run killed in ``stage`` leaves it: the stage's files written, its done
    marker not, and manifest.json last rewritten after the stage before it."""
    (out / ".headlab" / "stages" / f"{stage}.json").unlink()
    manifest = json.loads((out / "manifest.json").read_text())
    names = [s["name"] for s in manifest["stages"]]
    manifest["stages"] = manifest["stages"][:names.index(stage)]
    (out / "manifest.json").write_text(json.dumps(manifest))


def test_a_killed_run_s_outputs_are_not_read_before_a_later_run(inputs, tmp_path):
    """Regression: a run killed in a stage left its files for the readers until a later analyze run
    set them aside: build_report, Analysis.load, the heads table and the figures showed the killed
    functions stage's maps, labels and columns as results (and an earlier run's aggregate statistics,
    a stage the killed run never reached), while manifest.json listed neither stage. Now the
    readers leave out the files of a stage that manifest.json does not list as done, and say so."""
    import warnings

    import headlab
    from headlab.pipeline.figures import figure_specs
    from headlab.pipeline.table import write_heads_table
    from headlab.report import build_report

    out = tmp_path / "out"
    run = _args(inputs, out, "--conllu", str(inputs / "tb.conllu"), "--skip", "lrp,ablation,attention,figures")
    assert main(run) == 0
    _kill_in(out, "functions")
    said = "left out, from a run that did not finish the stage (manifest.json does not list it: the run was killed"
    html = build_report(out).read_text(encoding="utf-8")
    assert '"group":"functions"' not in html and '"group":"aggregate"' not in html and '"exemplars":null' in html
    assert '"importance/confidence"' in html and '"importance/gradient"' in html  # the stages that finished
    assert "stage functions: " in html and "stage aggregate: " in html and said in html
    with pytest.warns(UserWarning) as caught:
        analysis = headlab.Analysis.load(out)
    texts = [str(w.message) for w in caught]
    assert any(t.startswith(f"Analysis.load({out}): stage functions: ") and said in t for t in texts)
    assert any("stage aggregate: " in t for t in texts) and caught[0].filename == __file__
    assert set(analysis.tables) == {"confidence", "gradient", "gradient_raw"} and not analysis.labels
    assert said in analysis.skipped["functions"] and "skipped functions: stage functions:" in repr(analysis)
    assert not any(name.startswith(("functions/", "aggregate/")) for name in analysis.files)
    with pytest.warns(UserWarning) as caught:
        write_heads_table(out)
    assert any("heads table: stage functions: " in str(w.message) for w in caught) and caught[0].filename == __file__
    assert not {"positional_share", "mean_distance", "functions"} & set(_columns(out))
    assert {"confidence", "gradient"} <= set(_columns(out))
    with pytest.warns(UserWarning) as caught:
        specs = figure_specs(out)
    assert any("figures: stage functions: " in str(w.message) for w in caught)
    assert all("function analysis did not run" in caption for name, _, caption, _ in specs if name.startswith("figure1"))
    # a stage recorded as failed (a run before stale/ existed left its files) is left out too
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["stages"].append({"name": "functions", "status": "failed", "reason": "boom", "seconds": 1.0, "outputs": []})
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.warns(UserWarning) as caught:
        assert "positional_share" not in headlab.Analysis.load(out).tables
    assert any(re.fullmatch(r".*stage functions: .* left out, not results of this run \(manifest.json records the "
                            r"stage as failed\)", str(w.message)) for w in caught)
    # the same command run again finishes the stages: everything read, nothing said
    assert main(run) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        analysis = headlab.Analysis.load(out)
        html = build_report(out).read_text(encoding="utf-8")
    assert {"positional_share", "mean_distance"} <= set(analysis.tables) and "stage functions: " not in html
    assert {"positional_share", "mean_distance"} <= set(_columns(out))


def test_a_stage_run_again_within_one_second_runs_the_stages_after_it_again(inputs, tmp_path, monkeypatch, capsys):
    """Regression (a flaky test_a_killed_run_s_outputs_are_not_read_before_a_later_run): the stages
    after a stage keyed on its key and finishing time in seconds, so a stage run again within the
    same second (a killed stage finished by the next run on a fast machine) left the table and the
    report of before reused. Now every marker has its own run id, and the later stages key on it."""
    import headlab.pipeline.records as records

    monkeypatch.setattr(records, "now_iso", lambda: "2026-11-27T00:00:00+00:00")  # one second, all of it
    out = tmp_path / "out"
    run = _args(inputs, out, "--conllu", str(inputs / "tb.conllu"), "--skip", "lrp,ablation,attention,figures")
    assert main(run) == 0
    (out / ".headlab" / "stages" / "functions.json").unlink()  # killed after its files, before its marker
    capsys.readouterr()
    assert main(run) == 0
    said = capsys.readouterr()
    log = said.out + said.err
    assert "functions: reused" not in log and "aggregate: reused" in log
    assert "table: reused" not in log and "report: reused" not in log


def test_a_saved_analysis_of_an_analyze_directory_is_read_by_its_rows(inputs, tmp_path):
    """Regression: Analysis.save copied ``"written_by": "headlab analyze"`` from a loaded analyze
    directory into the one it wrote, which headlab analyze did not write. Now its manifest names
    Analysis.save and keeps the rows of the stages whose files it wrote: the readers read it by
    them, as the directory it came from; one saved with no row is read whole, as before."""
    import warnings

    import headlab
    from headlab.api import SAVED_BY

    out = tmp_path / "out"
    assert main(_args(inputs, out, "--conllu", str(inputs / "tb.conllu"), "--skip", "lrp,ablation,attention,figures")) == 0
    _kill_in(out, "functions")
    with pytest.warns(UserWarning) as caught:
        analysis = headlab.Analysis.load(out)
    assert any("stage functions: " in str(w.message) for w in caught)
    analysis.save(tmp_path / "saved")
    manifest = json.loads((tmp_path / "saved" / "manifest.json").read_text())
    assert manifest["written_by"] == SAVED_BY
    rows = json.loads((out / "manifest.json").read_text())["stages"]
    assert [(s["name"], s["status"]) for s in manifest["stages"]] == [(s["name"], s["status"]) for s in rows]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert set(headlab.Analysis.load(tmp_path / "saved").tables) == set(analysis.tables) == {
            "confidence", "gradient", "gradient_raw"}
    # read by its rows: the killed stage's files put there are left out, as where they came from
    shutil.copytree(out / "functions", tmp_path / "saved" / "functions")
    with pytest.warns(UserWarning) as caught:
        assert "positional_share" not in headlab.Analysis.load(tmp_path / "saved").tables
    assert [str(w.message).split(": ")[1] for w in caught] == ["stage functions"]
    assert "left out, from a run that did not finish the stage" in str(caught[0].message)
    # a run killed before its first stage: nothing read, nothing saved but a manifest with no row, read whole
    (out / "manifest.json").write_text(json.dumps({**json.loads((out / "manifest.json").read_text()), "stages": []}))
    with pytest.warns(UserWarning) as caught:
        empty = headlab.Analysis.load(out)
    assert {"stage confidence", "stage functions"} <= {str(w.message).split(": ")[1] for w in caught}
    assert not empty.tables and not empty.labels
    empty.save(tmp_path / "empty")
    manifest = json.loads((tmp_path / "empty" / "manifest.json").read_text())
    assert manifest["stages"] == [] and manifest["written_by"] == SAVED_BY
    assert not (tmp_path / "empty" / "functions").exists()
    shutil.copytree(out / "functions", tmp_path / "empty" / "functions")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "positional_share" in headlab.Analysis.load(tmp_path / "empty").tables


def test_a_standalone_command_s_directory_is_read_whole(inputs, tmp_path):
    """`headlab functions --out` and `headlab importance --out` write no manifest.json: the readers
    read every file there, as before, and say nothing; so do they in a directory an Analysis of such
    files was saved to (its manifest records no stage)."""
    import warnings

    import headlab
    from headlab.pipeline.table import heads_table
    from headlab.report import build_report

    run = tmp_path / "run"  # the layout of analyze's: each command's --out one of its folders
    assert main(["functions", str(inputs / "model"), "--conllu", str(inputs / "tb.conllu"), "--out",
                 str(run / "functions"), "--no-progress", "--no-figures"]) == 0
    assert main(["importance", str(inputs / "model"), "--source", str(inputs / "src.en"), "--out",
                 str(run / "importance"), "--method", "confidence", "--no-progress"]) == 0
    assert not (run / "manifest.json").exists()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert {"confidence", "positional_share"} <= set(headlab.Analysis.load(run).tables)
        assert {"confidence", "positional_share"} <= set(heads_table(run)[0])
        html = build_report(run).read_text(encoding="utf-8")
        assert '"group":"functions"' in html and '"importance/confidence"' in html
        headlab.Analysis.load(run).save(tmp_path / "saved")
        saved = json.loads((tmp_path / "saved" / "manifest.json").read_text())
        assert saved["stages"] == [] and saved["written_by"] == "headlab.Analysis.save (Python API)"
        assert {"confidence", "positional_share"} <= set(headlab.Analysis.load(tmp_path / "saved").tables)


class _Killed(BaseException):
    """A kill of the process (nothing in headlab catches a BaseException that is not Ctrl-C)."""


def _killed_before_the_marker(monkeypatch, stage):
    """write_marker raises for ``stage``: the run dies with the stage's files written, its marker not."""
    from headlab.pipeline import pipeline

    write_marker = pipeline.write_marker

    def dies(out_dir, name, *args, **kwargs):
        if name == stage:
            raise _Killed(name)
        return write_marker(out_dir, name, *args, **kwargs)

    monkeypatch.setattr(pipeline, "write_marker", dies)


@pytest.mark.parametrize("again", [["--limit", "4"], ["--force"]], ids=["other-options", "force"])
def test_a_rerun_killed_in_its_first_stage_is_not_vouched_for(again, inputs, tmp_path, monkeypatch, capsys):
    """Regression: a rerun killed in its first stage after writing its file but before its marker
    left the earlier run's manifest.json and marker in place, so the earlier run's done row vouched
    for the new, unfinished file to the readers (and with --force, whose key is the same, the next
    run reused it as done). Now the stage's row and marker go before it writes again."""
    import headlab
    from headlab.pipeline import pipeline
    from headlab.report.vouched import read_manifest, vouched

    out = tmp_path / "out"
    first = pipeline.STAGES[0]
    run = _args(inputs, out, "--skip", "functions,aggregate,attention,figures")
    assert main(run) == 0
    with monkeypatch.context() as patch:
        _killed_before_the_marker(patch, first)
        with pytest.raises(_Killed):
            main([*run, *again])
    manifest = read_manifest(out)
    assert first not in {s["name"] for s in manifest["stages"]}
    assert "lrp" in {s["name"] for s in manifest["stages"]}  # the earlier run's other stages still vouched for
    assert not (out / ".headlab" / "stages" / f"{first}.json").exists()
    assert not vouched(out, manifest).reads(f"importance/{next(iter(MEASURES[first].tables))}.json")
    with pytest.warns(UserWarning, match=f"stage {first}: "):
        assert first not in headlab.Analysis.load(out).tables
    capsys.readouterr()
    assert main([*run, *again[:-1]] if again == ["--force"] else [*run, *again]) == 0
    assert f"{first}: running" in capsys.readouterr().err  # not reused
    assert first in {s["name"] for s in read_manifest(out)["stages"] if s["status"] == "done"}


def test_a_first_run_killed_in_its_first_stage_vouches_for_nothing(inputs, tmp_path, monkeypatch):
    """Regression: a first run killed before its first manifest write left no manifest.json, and the
    readers read the directory whole (as a standalone command's): the killed stage's file was read
    as a result. Now analyze writes a manifest that lists no stage when the run starts."""
    import headlab
    from headlab.pipeline import pipeline
    from headlab.report.vouched import read_manifest

    out = tmp_path / "out"
    first = pipeline.STAGES[0]
    table = f"importance/{next(iter(MEASURES[first].tables))}.json"
    _killed_before_the_marker(monkeypatch, first)
    with pytest.raises(_Killed):
        main(_args(inputs, out, "--skip", "functions,aggregate,attention,figures"))
    assert (out / table).is_file()
    manifest = read_manifest(out)
    assert manifest["stages"] == [] and manifest["written_by"] == "headlab analyze"
    with pytest.warns(UserWarning, match=f"stage {first}: .* from a run that did not finish the stage"):
        analysis = headlab.Analysis.load(out)
    assert first not in analysis.tables and first in analysis.skipped


def test_a_run_killed_in_a_stage_it_replaced_loses_no_earlier_results(inputs, tmp_path, monkeypatch, capsys):
    """Regression: a run that must run a stage again (other options, --force) moves the stage's
    folder to .headlab/replaced-<stage> and deletes it once the stage is done; killed in the stage,
    it left it there, and the next run deleted it (an LRP or a sweep may have cost hours). Now the
    next run sets it aside in stale/ and says so."""
    from headlab.pipeline import pipeline

    out = tmp_path / "out"
    run = _args(inputs, out, "--conllu", str(inputs / "tb.conllu"), "--skip", "importance,attention,figures")
    assert main(run) == 0
    share = (out / "functions" / "positional" / "share.json").read_bytes()

    def killed_after_writing(ctx):
        pipeline._functions(ctx)
        raise _Killed("functions")

    with monkeypatch.context() as patch:
        patch.setitem(pipeline.RUNNERS, "functions", killed_after_writing)
        with pytest.raises(_Killed):
            main([*run, "--conllu-limit", "2"])
    assert (out / ".headlab" / "replaced-functions" / "positional" / "share.json").read_bytes() == share
    capsys.readouterr()
    assert main(run) == 0
    err = capsys.readouterr().err
    assert "functions: the results a killed run had replaced (.headlab/replaced-functions) were moved aside to " \
           "stale/functions" in err
    assert (out / "stale" / "functions" / "positional" / "share.json").read_bytes() == share  # nothing lost
    assert not (out / ".headlab" / "replaced-functions").exists()
    assert "positional_share" in _columns(out)


def test_a_force_run_killed_before_its_sweep_wrote_puts_the_sweep_back(inputs, tmp_path, monkeypatch, capsys):
    """Regression: analyze --prune --force killed as its sweep began left the earlier sweep in
    .headlab/replaced-prune and an empty prune/; the same command without --force then ran the
    whole sweep again beside it (and a later --force deleted it). Now a killed run's replaced
    folder whose key is this run's goes back in place when the killed run left nothing there,
    and the sweep resumes from its finished points."""
    from headlab.pipeline import pipeline

    out = tmp_path / "out"
    run = _args(inputs, out, "--target", str(inputs / "ref.de"), "--skip", "importance", "attention", "figures",
                "report", "--prune", "--prune-keeps", "2")
    assert main(run) == 0
    result = (out / "prune" / "keep-2" / "result.json").read_bytes()

    def killed(ctx):
        raise _Killed("prune")

    with monkeypatch.context() as patch:
        patch.setitem(pipeline.RUNNERS, "prune", killed)
        with pytest.raises(_Killed):
            main([*run, "--force"])
    assert {p.name for p in (out / "prune").iterdir()} == {".headlab-key"}
    capsys.readouterr()
    assert main(run) == 0
    err = capsys.readouterr().err
    assert "prune: the results a killed run had replaced (.headlab/replaced-prune) were put back in prune/" in err
    assert "keep-2: finished earlier, skipped" in err and "keep-2: starting" not in err
    assert (out / "prune" / "keep-2" / "result.json").read_bytes() == result
    assert not (out / ".headlab" / "replaced-prune").exists() and not (out / "stale").exists()


def test_a_run_killed_after_a_stage_failed_loses_no_earlier_results(inputs, tmp_path, monkeypatch, capsys):
    """Regression: a stage that failed holds an earlier run's results in .headlab/held/ until the
    run's end; a run killed after it left them there and the next run deleted them. Now the next
    run sets them aside in stale/ and says so."""
    from headlab.pipeline import pipeline

    out = tmp_path / "out"
    run = _args(inputs, out, "--skip", "lrp,functions,aggregate,attention,figures")
    assert main(run) == 0
    gradient = (out / "importance" / "gradient.json").read_bytes()

    def fails(ctx):
        raise RuntimeError("boom")

    def killed(ctx):
        raise _Killed("table")

    with monkeypatch.context() as patch:
        patch.setitem(pipeline.RUNNERS, "gradient", fails)
        patch.setitem(pipeline.RUNNERS, "table", killed)
        with pytest.raises(_Killed):
            main([*run, "--limit", "4"])
    assert any(p.name.endswith("-gradient.json") for p in (out / ".headlab" / "held").iterdir())
    capsys.readouterr()
    assert main(run) == 0
    err = capsys.readouterr().err
    assert "results a killed run had held (.headlab/held/) were moved aside to stale/gradient.json" in err
    assert (out / "stale" / "gradient.json").read_bytes() == gradient  # nothing lost
    assert not (out / ".headlab" / "held").exists()


def test_a_stage_that_replaced_an_earlier_folder_and_failed_sets_it_aside(inputs, tmp_path, monkeypatch, capsys):
    """Regression: with --force (or other options) a stage's earlier folder waited in
    .headlab/replaced-<stage> while it ran and was deleted at the run's end even when the stage
    failed: neither the earlier results nor new ones were left. Now they are set aside in stale/."""
    from headlab.pipeline import pipeline

    out = tmp_path / "out"
    run = _args(inputs, out, "--conllu", str(inputs / "tb.conllu"), "--skip", "importance,attention,figures")
    assert main(run) == 0
    share = (out / "functions" / "positional" / "share.json").read_bytes()

    def fails(ctx):
        raise RuntimeError("boom")

    capsys.readouterr()
    with monkeypatch.context() as patch:
        patch.setitem(pipeline.RUNNERS, "functions", fails)
        assert main([*run, "--force"]) == 1
    err = capsys.readouterr().err
    assert "functions: its results of before, replaced for this run, were moved aside to stale/functions" in err
    assert (out / "stale" / "functions" / "positional" / "share.json").read_bytes() == share
    assert not (out / "functions").exists() and not (out / ".headlab" / "replaced-functions").exists()


@pytest.mark.parametrize("stop", ["killed", "failed"])
def test_a_sweep_stopped_in_a_point_resumes_with_the_same_command(stop, inputs, tmp_path, monkeypatch, capsys):
    """Regression: a prune stage that failed in its second point had its folder set aside in stale/,
    while the log said it was moved back for the same command to resume it: the sweep started over.
    Now a failed sweep stays in prune/ (the manifest, which records the stage as failed, keeps the
    readers out of it) and the same command resumes it point by point, as after a kill."""
    import headlab.pruning.sweep as sweep

    out = tmp_path / "out"
    run = _args(inputs, out, "--target", str(inputs / "ref.de"), "--skip", "importance", "attention", "figures",
                "report", "--prune")  # --prune-keeps 4,2 (FAST)
    prune_train = sweep.prune_train

    def second_stops(model, tokenizer, train_data, eval_data, config, **kwargs):
        if config.keep == 2:
            raise (_Killed if stop == "killed" else RuntimeError)("stopped in keep-2")
        return prune_train(model, tokenizer, train_data, eval_data, config, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(sweep, "prune_train", second_stops)
        if stop == "killed":
            with pytest.raises(_Killed):
                main(run)
        else:
            assert main(run) == 1
    err = capsys.readouterr().err
    if stop == "failed":
        assert "prune: failed: RuntimeError: stopped in keep-2" in err
        assert "prune: its unfinished sweep (no done marker) stays in prune/, not read as this run's; the same " \
               "command resumes it point by point" in err
    first = (out / "prune" / "keep-4" / "result.json").read_bytes()
    assert main(run) == 0
    err = capsys.readouterr().err
    assert "keep-4: finished earlier, skipped" in err and "keep-2: starting" in err
    assert (out / "prune" / "keep-4" / "result.json").read_bytes() == first
    rows = json.loads((out / "prune" / "sweep.json").read_text())
    assert [row["point"] for row in rows] == ["full", "keep-4", "keep-2"]
    stages = {s["name"]: s["status"] for s in json.loads((out / "manifest.json").read_text())["stages"]}
    assert stages["prune"] == "done" and not (out / "stale").exists()
