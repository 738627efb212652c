"""The precision a statistic was measured in travels with it (session 34, sig34).

The head-pass tables (``functions``, ``aggregate``) record the weights' dtype in their signature where it is not
float32 (a float32 run writes the files it always wrote; a table without the key reads as float32); what reads tables
side by side refuses two dtypes (the profile, the heads table, the agreement); the head pass and importance refuse a
model with gates attached (its tables would be the masked model's without saying so); the processes of a sharded
pass must hold the model in one dtype; ``analyze`` resumed with another ``--dtype`` computes the passes again.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from headlab.cli import main
from headlab.errors import HeadlabError
from headlab.heads import HeadScores
from headlab.pipeline.profiles import collect_profile, render_profiles
from headlab.pipeline.table import heads_table
from support.treebank import tiny_lm_on_sample

QUIET = ["--no-progress"]


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    root = tmp_path_factory.mktemp("dtype")
    tiny_lm_on_sample(root)
    return root


def _functions(lm, out, *extra):
    assert main(["functions", str(lm / "lm"), "--conllu", str(lm / "tb.conllu"), "--train-text", str(lm / "text.txt"),
                 "--out", str(out), "--no-figures", *extra, *QUIET]) == 0


def _aggregate(lm, out, *extra):
    assert main(["aggregate", str(lm / "lm"), "--conllu", str(lm / "tb.conllu"), "--out", str(out), "--no-figures",
                 *extra, *QUIET]) == 0


def _signature(path):
    return json.loads(path.read_text(encoding="utf-8"))["signature"]


def test_a_head_pass_table_records_a_dtype_other_than_float32(lm, tmp_path):
    """Failed before: a bfloat16 run's tables and summary.json said nothing of it. A float32 run (no --dtype, or
    --dtype float32) writes the keys it always wrote: the committed results read as they are."""
    _functions(lm, tmp_path / "bf16", "--dtype", "bfloat16")
    _functions(lm, tmp_path / "fp32")
    assert _signature(tmp_path / "bf16/positional/share.json")["dtype"] == "bfloat16"
    assert json.loads((tmp_path / "bf16/summary.json").read_text())["dtype"] == "bfloat16"
    plain = _signature(tmp_path / "fp32/positional/share.json")
    assert "dtype" not in plain
    assert "dtype" not in json.loads((tmp_path / "fp32/summary.json").read_text())
    assert set(_signature(tmp_path / "bf16/positional/share.json")) - set(plain) == {"dtype"}


def test_passes_of_two_dtypes_in_one_directory_are_refused_by_the_profile_and_the_table(lm, tmp_path):
    """Failed before: aggregate in float32 and functions in bfloat16 run apart into one directory made one
    profile and one heads table of the two precisions without a word."""
    out = tmp_path / "mixed"
    _aggregate(lm, out)
    _functions(lm, out / "functions", "--dtype", "bfloat16")
    with pytest.raises(HeadlabError, match=r"no profile from this directory: .* bfloat16, .* float32 \(--dtype\): .*"
                                           r"one dtype \(aggregate/.*json records none: float32, or a file from before"):
        collect_profile(out, "mixed")
    with pytest.raises(HeadlabError, match=r"column .* in (bfloat16|float32), column .* in (bfloat16|float32)"):
        heads_table(out)
    from headlab.report.collect import collect

    report = collect(out)  # the report notes what it cannot refuse (it shows what it can), and each map says its dtype
    assert any(note["section"] == "summary" and "the maps: " in note["text"] and "bfloat16" in note["text"]
               for note in report.notes)
    captions = {Path(m["file"]).parts[0]: m["caption"] for m in report.heatmaps}
    assert "weights in bfloat16" in captions["functions"] and "weights in" not in captions["aggregate"]
    _functions(lm, out / "functions", "--overwrite")  # both in float32 now: read as before
    assert not any("the maps: " in note["text"] for note in collect(out).notes)
    assert "dtype" not in collect_profile(out, "same")
    assert heads_table(out)[1]


def test_analyze_resumed_with_another_dtype_computes_the_passes_again_and_says_so(lm, tmp_path, monkeypatch):
    """The stage key holds --dtype (the passes are computed again, never reused from another precision); the tables,
    heads.csv, the profile and its rendering say bfloat16 (failed before: they said nothing). A pass's key under
    another dtype than float32 says that its tables record it: an earlier run's tables, which did not, are computed
    again rather than read as float32 beside importance tables that say bfloat16."""
    from headlab.pipeline import pipeline

    payloads = []
    real = pipeline.stage_key  # the keys as they are, their payloads kept
    monkeypatch.setattr(pipeline, "stage_key", lambda payload: payloads.append(payload) or real(payload))
    out = tmp_path / "run"
    argv = ["analyze", str(lm / "lm"), "--source", str(lm / "text.txt"), "--conllu", str(lm / "tb.conllu"),
            "--out", str(out), "--skip", "lrp,gradient,attention,figures,report", *QUIET]
    assert main(argv) == 0
    assert "dtype" not in _signature(out / "functions/positional/share.json")
    assert not any("dtype" in p or "dtype_recorded" in p for p in payloads)  # float32 dirs keep their keys
    assert main([*argv, "--dtype", "bfloat16"]) == 0
    assert {p["stage"] for p in payloads if p.get("dtype_recorded")} == {"functions", "aggregate"}
    for table in ("functions/positional/share.json", "aggregate/mean_distance.json"):
        assert _signature(out / table)["dtype"] == "bfloat16"
    assert _signature(out / "importance/confidence.json")["options"]["dtype"] == "bfloat16"
    header, first = (out / "heads.csv").read_text().splitlines()[:2]
    assert header.startswith("model,run,kind,layer,head,dtype,confidence,") and ",bfloat16," in first
    profile = collect_profile(out, "tiny")
    assert profile["dtype"] == "bfloat16"
    text = render_profiles([profile])
    assert "#### tiny (bfloat16)" in text and "| tiny (bfloat16) | dec_self |" in text
    assert main(argv) == 0  # back to float32: computed again, the files as a float32 run always wrote them
    assert "dtype" not in _signature(out / "aggregate/mean_distance.json")
    assert (out / "heads.csv").read_text().startswith("model,run,kind,layer,head,confidence,")
    assert "dtype" not in collect_profile(out, "tiny")


def _table(method: str, signature: dict) -> HeadScores:
    return HeadScores({"dec_self": np.arange(4.0).reshape(2, 2)}, method, "lm", signature)


def test_agreement_refuses_a_head_pass_table_of_another_dtype_or_a_masked_reference():
    """Failed before: the dtype was compared only between importance tables (options.dtype)."""
    from headlab.importance.agreement import compute_agreement

    data = {"n_sentences": 4, "max_length": 64}
    confidence = _table("confidence", {**data, "options": {"dtype": "float32"}})
    share = _table("positional_share", {"data": "tb", "spacing": "words"})  # a head-pass table: float32
    half = _table("positional_share", {"data": "tb", "spacing": "words", "dtype": "bfloat16"})
    compute_agreement({"share": share}, confidence)
    with pytest.raises(HeadlabError, match=r"weights' dtype bfloat16 \(the reference's: float32\)"):
        compute_agreement({"share": half}, confidence)
    masked = _table("ablation", {**data, "options": {"dtype": "float32", "mask": {"dec_self:0": [1]}}})
    with pytest.raises(HeadlabError, match="heads masked none"):
        compute_agreement({"share": share}, masked)
    older = _table("lrp", {**data, "options": {}})  # an importance table from before options.dtype: not known
    compute_agreement({"share": half}, older)


def test_agreement_says_which_side_records_no_dtype():
    """Failed before: against a head-pass table without the key (float32 by default: an older file, or one from a
    run in another --dtype before the key existed) the refusal said float32 as if the table had said it, where
    one_dtype's says that the table records none (sigfollow34)."""
    from headlab.importance.agreement import compute_agreement

    data = {"n_sentences": 4, "max_length": 64}
    half = _table("confidence", {**data, "options": {"dtype": "bfloat16"}})
    share = _table("positional_share", {"data": "tb", "spacing": "words"})  # no dtype: read as float32
    with pytest.raises(HeadlabError, match=r"weights' dtype float32 \(the reference's: bfloat16; share records none: "
                                           r"float32, or a file from before the tables recorded it\)"):
        compute_agreement({"share": share}, half)
    with pytest.raises(HeadlabError, match=r"\(the reference's: float32; positional_share records none: float32"):
        compute_agreement({"half": half}, share)  # the reference's side, by its method
    said = _table("positional_share", {"data": "tb", "spacing": "words", "dtype": "float64"})
    with pytest.raises(HeadlabError, match=r"weights' dtype float64 \(the reference's: bfloat16\)\): compute"):
        compute_agreement({"share": said}, half)  # both say theirs: nothing more
    plain = _table("ablation", {**data, "options": {"dtype": "float32"}})
    with pytest.raises(HeadlabError, match=r"weights' dtype bfloat16 \(the reference's: float32\)\): compute"):
        compute_agreement({"half": half}, plain)  # importance tables say theirs (options.dtype)


def test_records_and_to_pandas_have_the_dtype_column_of_the_heads_table():
    """Failed before: Analysis.heads (and heads.csv) had a dtype column where the tables were measured in another
    dtype than float32, while records() and to_pandas() had none, and took tables of two dtypes side by side
    (sigfollow34)."""
    import headlab

    def analysis(**signatures):
        return headlab.Analysis(model="lm", tables={name: _table(name, signature)
                                                    for name, signature in signatures.items()})

    half = analysis(confidence={"options": {"dtype": "bfloat16"}},
                    positional_share={"spacing": "words", "dtype": "bfloat16"})
    columns, rows = half.heads_table()
    assert columns[:6] == ["model", "run", "kind", "layer", "head", "dtype"] and {row[5] for row in rows} == {"bfloat16"}
    records = half.records()
    assert len(records) == 2 * 4
    assert all(list(r) == ["model", "kind", "layer", "head", "dtype", "measure", "value"] for r in records)
    assert {r["dtype"] for r in records} == {"bfloat16"}
    pandas = pytest.importorskip("pandas")
    frame = half.to_pandas()
    assert list(frame.columns) == ["model", "kind", "layer", "head", "dtype", "measure", "value"]
    assert set(frame["dtype"]) == set(half.heads()["dtype"]) == {"bfloat16"}
    # float32 (said, or a head-pass table without the key): no column, as in heads.csv
    plain = analysis(confidence={"options": {"dtype": "float32"}}, positional_share={"spacing": "words"})
    assert "dtype" not in plain.heads_table()[0] and "dtype" not in plain.records()[0]
    assert list(plain.to_pandas().columns) == ["model", "kind", "layer", "head", "measure", "value"]
    assert isinstance(frame, pandas.DataFrame)
    mixed = analysis(confidence={"options": {"dtype": "bfloat16"}}, positional_share={"spacing": "words"})
    refusal = r"heads table: column .* in (bfloat16|float32), column .* in (bfloat16|float32) .*records none"
    for call in (mixed.heads_table, mixed.records, mixed.to_pandas):
        with pytest.raises(HeadlabError, match=refusal):
            call()


def test_a_table_without_the_key_reads_as_float32_and_two_dtypes_are_refused():
    from headlab.heads import measured_dtype, one_dtype

    assert measured_dtype({"spacing": "words"}) == "float32"
    assert measured_dtype({"options": {"dtype": "float16"}}) == "float16"
    assert measured_dtype({"options": {}}) is None and measured_dtype({}) is None
    assert one_dtype([("a", {"spacing": "words"}), ("b", {"options": {"dtype": "float32"}})], "x") == "float32"
    with pytest.raises(HeadlabError, match="x: b was measured with the weights in float64, a in float32"):
        one_dtype([("b", {"spacing": "words", "dtype": "float64"}), ("a", {"spacing": "words"})], "x")


@pytest.fixture(scope="module")
def loaded(lm):
    from headlab.loading import load_model, load_tokenizer

    return load_model(str(lm / "lm")), load_tokenizer(str(lm / "lm"))


def test_the_head_pass_and_importance_refuse_a_model_with_gates_attached(lm, loaded):
    """Failed before: inside mask_heads the statistics were the masked model's (every layer after a masked head
    computes on other inputs) and the tables did not say so."""
    import headlab

    model, tokenizer = loaded
    treebank = str(lm / "tb.conllu")
    with headlab.mask_heads(model, {("dec_self", 0): [0]}):
        with pytest.raises(HeadlabError, match=r"gates attached \(headlab_gates: headlab.mask_heads"):
            headlab.functions(model, tokenizer, treebank)
        with pytest.raises(HeadlabError, match="gates attached"):
            headlab.aggregate(model, tokenizer, treebank)
        with pytest.raises(HeadlabError, match="importance: the model has gates attached .* give mask="):
            headlab.importance(model, tokenizer, ["a sentence"], measures=["confidence"])
    assert headlab.aggregate(model, tokenizer, treebank).signature.get("dtype") is None  # detached: it runs


def test_analyze_refuses_a_model_with_gates_attached_before_any_work(lm, loaded, tmp_path, monkeypatch):
    """Failed before: with only the attention viewer asked for (no measure, no statistic) headlab.analyze kept the
    masked model's attention without a word; with measures it refused only once importance began (sigfollow34)."""
    import headlab

    model, tokenizer = loaded
    with headlab.mask_heads(model, {("dec_self", 0): [0]}), monkeypatch.context() as patched:
        patched.setattr(torch.nn.Module, "__call__", lambda *args, **kwargs: pytest.fail("no forward pass"))
        with pytest.raises(HeadlabError, match=r"^analyze: the model has gates attached \(headlab_gates"):
            headlab.analyze(model, tokenizer, ["a sentence"], measures=(), attention_sentences=1)
        with pytest.raises(HeadlabError, match=r"^analyze: the model has gates attached"):
            headlab.analyze(model, tokenizer, ["a sentence"], out=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_processes_holding_the_model_in_other_dtypes_are_refused_before_any_work(lm, loaded, monkeypatch):
    from headlab.functions.analysis import AnalysisConfig, analyze_heads
    from headlab.shard import Shard, sharding

    model, tokenizer = loaded
    gathered = []
    monkeypatch.setattr(Shard, "gather", lambda self, value: gathered.append(value) or [value, "bfloat16"])
    monkeypatch.setattr(torch.nn.Module, "__call__", lambda *args, **kwargs: pytest.fail("no forward pass"))
    with sharding(Shard(0, 2)), pytest.raises(HeadlabError, match="rank 1 holds the model in bfloat16, rank 0 in float32"):
        analyze_heads(model, tokenizer, str(lm / "tb.conllu"), config=AnalysisConfig())
    assert gathered == ["float32"]
