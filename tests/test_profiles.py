"""Model profiles (headlab.pipeline.profiles) and the block of docs/functions.md built from them."""

import json
from pathlib import Path

import numpy as np
import pytest

from headlab.cli import main
from headlab.errors import HeadlabError
from headlab.pipeline.profiles import collect_profile, read_block, render_profiles, replace_block
from support.treebank import tiny_lm_on_sample

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def analysis(tmp_path_factory):
    root = tmp_path_factory.mktemp("profile")
    tiny_lm_on_sample(root)
    out = root / "out"
    assert main(["analyze", str(root / "lm"), "--source", str(root / "text.txt"), "--conllu", str(root / "tb.conllu"),
                 "--out", str(out), "--skip", "importance,attention,figures,report", "--no-progress"]) == 0
    return out


def test_profile_holds_the_numbers_of_the_result_files(analysis):
    profile = collect_profile(analysis, "tiny", "a tiny LM")
    body = profile["kinds"]["dec_self"]
    share = np.asarray(json.loads((analysis / "functions/positional/share.json").read_text())["scores"]["dec_self"])
    assert body["positional"]["word"]["share"] == pytest.approx(np.nanmax(share))
    layer, head = body["positional"]["word"]["head"]
    assert share[layer, head] == np.nanmax(share)
    offsets = json.loads((analysis / "functions/positional/offsets.json").read_text())
    column = offsets["offsets"].index(-1)
    previous = max(row[column] / sum(row) for layer in range(2) for row in offsets["counts"][f"dec_self:{layer}"]
                   if sum(row))
    assert body["positional"]["previous_word"]["share"] == pytest.approx(previous)
    distance = np.asarray(json.loads((analysis / "aggregate/mean_distance.json").read_text())["scores"]["dec_self"])
    assert body["layers"]["mean_distance"] == pytest.approx(distance.mean(axis=1).tolist())
    table1 = json.loads((analysis / "functions/syntactic/table1.json").read_text())["table"]
    assert [row["label"] for row in body["syntactic"]] == [row["label"] for row in table1]
    text = render_profiles([profile])
    assert "#### tiny" in text and text.count("| dec_self | ") == 2 + len(table1) + 1  # layers + table 1 + overview


def test_a_missing_analysis_names_the_file(tmp_path):
    with pytest.raises(HeadlabError, match="summary.json"):
        collect_profile(tmp_path, "none")


def test_a_killed_run_s_files_make_no_profile(analysis, tmp_path):
    """Regression: the profile parts read their files by path without asking manifest.json, so a run
    killed in the functions stage (its files written, the manifest last rewritten before it) gave a
    profile of its partial files, and an earlier run's aggregate statistics (a stage the killed run
    never reached) joined it. Now the directory is refused, naming the stage; so is one whose manifest
    records aggregate as skipped beside an earlier run's files, and one killed before any stage."""
    import shutil

    out = tmp_path / "out"
    shutil.copytree(analysis, out)
    manifest = json.loads((out / "manifest.json").read_text())
    names = [row["name"] for row in manifest["stages"]]
    killed = {**manifest, "stages": manifest["stages"][:names.index("functions")]}
    (out / "manifest.json").write_text(json.dumps(killed))
    said = "left out, from a run that did not finish the stage (manifest.json does not list it"
    from headlab.functions.registry import STATISTICS
    from headlab.plugins import ProfilePart, Statistic

    read: list[Path] = []  # a plug-in's part, which reads by path as the built-in ones do: never asked
    part = ProfilePart(lambda directory, kind: read.append(directory) or {})
    with STATISTICS.registered("probe", Statistic(lambda config, frequencies: None, profile=part)), \
            pytest.raises(HeadlabError, match="no profile from this directory: stage ") as refused:
        collect_profile(out, "tiny")
    assert not read
    assert "stage functions: " in str(refused.value) and "stage aggregate: " in str(refused.value)
    assert str(refused.value).count(said) == 2
    skipped = [row if row["name"] != "aggregate" else {**row, "status": "skipped", "reason": "--skip", "outputs": []}
               for row in manifest["stages"]]
    (out / "manifest.json").write_text(json.dumps({**manifest, "stages": skipped}))
    with pytest.raises(HeadlabError, match=r"stage aggregate: .* not results of this run \(manifest.json records "
                                           r"the stage as skipped\)") as refused:
        collect_profile(out, "tiny")
    assert "stage functions" not in str(refused.value)
    (out / "manifest.json").write_text(json.dumps({**manifest, "stages": []}))  # killed before any stage
    with pytest.raises(HeadlabError, match="stage functions: "):
        collect_profile(out, "tiny")
    (out / "manifest.json").write_text(json.dumps(manifest))  # the run finished: read as before
    assert collect_profile(out, "tiny") == collect_profile(analysis, "tiny")
    (out / "manifest.json").unlink()  # no manifest (headlab functions + aggregate --out): read whole
    assert collect_profile(out, "tiny") == collect_profile(analysis, "tiny")


def test_blocks_are_replaced_between_their_markers():
    document = "a\n<!-- BEGIN generated:x -->\nold\n<!-- END generated:x -->\nb\n"
    updated = replace_block(document, "x", "new\n")
    assert updated == "a\n<!-- BEGIN generated:x -->\nnew\n<!-- END generated:x -->\nb\n"
    assert read_block(updated, "x") == "new\n"
    with pytest.raises(HeadlabError, match="no block"):
        replace_block(document, "y", "")


def test_docs_functions_md_matches_the_committed_profiles():
    models = json.loads((REPO / "experiments" / "profiles.json").read_text())["models"]
    results = REPO / "docs" / "results" / "profiles"
    profiles = [json.loads((results / f"{m['name']}.json").read_text()) for m in models
                if (results / f"{m['name']}.json").is_file()]
    document = (REPO / "docs" / "functions.md").read_text(encoding="utf-8")
    assert read_block(document, "model-profiles") == render_profiles(profiles), (
        "docs/functions.md differs from docs/results/profiles/; run experiments/model_profiles.py --docs-only")


def test_a_statistics_profile_part_reaches_the_profile_and_its_tables(analysis):
    """The profile names no statistic: a registered statistic's ProfilePart adds its entries (read
    from where its pass wrote), its overview columns after the others' and its own table."""
    from headlab.functions.registry import STATISTICS
    from headlab.plugins import ProfilePart, Statistic, read_result

    def collect(directory: Path, kind: str) -> dict:
        share = read_result(directory / "positional" / "share.json")["scores"][kind]
        return {"probe": len(share)}

    part = ProfilePart(collect, ("probe layers",), lambda kind, entries: [str(entries["probe"])],
                       lambda kinds: ["| probe |", "|---|"] + [f"| {kind} |" for kind in kinds])
    before = render_profiles([collect_profile(analysis, "tiny")])
    with STATISTICS.registered("probe", Statistic(lambda config, frequencies: None, profile=part)):
        profile = collect_profile(analysis, "tiny")
        text = render_profiles([profile])
    assert profile["kinds"]["dec_self"]["probe"] == 2 and list(profile["kinds"]["dec_self"])[-1] == "probe"
    header, _, row = text.splitlines()[:3]
    assert header == before.splitlines()[0] + " probe layers |" and row.endswith(" | 2 |")
    assert text.endswith("\n\n| probe |\n|---|\n| dec_self |\n")
    columns = [c for s in STATISTICS.values() if s.profile is not None for c in s.profile.columns]
    assert before.splitlines()[0] == "| " + " | ".join(["model", "kind", *columns]) + " |"  # the registry's, in order
    with pytest.raises(ValueError, match="together"):
        ProfilePart(collect, ("no cells",))
