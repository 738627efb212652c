"""A plug-in of each kind (tests/support/plugins.py), registered here, runs through `headlab
analyze`, `heads.csv` and the report with no other change to headlab; CONTRIBUTING.md shows that
code as it is, and every step it lists is one this test takes."""

import csv
import json
import re
from pathlib import Path

import pytest
import torch

from headlab.adapters import attention_blocks
from headlab.cli import build_parser, main
from headlab.functions.registry import STATISTICS
from headlab.heads import HeadScores
from headlab.importance.registry import MEASURES
from headlab.loading import load_model
from headlab.pipeline.labels import function_groups
from headlab.pipeline.pipeline import STAGES  # imported before any plug-in is registered
from headlab.report.sections import SECTIONS
from support import plugins
from support.treebank import SAMPLE_CONLLU, save_marian_for_treebank

ROOT = Path(__file__).resolve().parents[1]
SENTENCES = ["a man is riding a bike", "two dogs play in the snow", "a woman reads a book"]
FAST = ["--no-progress", "--skip", "prune", "attention", "figures"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("plugin-inputs")
    save_marian_for_treebank(root / "model", SENTENCES)
    (root / "src.en").write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    (root / "tb.conllu").write_text(SAMPLE_CONLLU, encoding="utf-8")
    return root


def _analyze(inputs, out, *extra) -> int:
    return main(["analyze", str(inputs / "model"), "--source", str(inputs / "src.en"), "--conllu",
                 str(inputs / "tb.conllu"), "--out", str(out), *FAST, *extra])


def _stages(out: Path) -> dict:
    return {s["name"]: s for s in json.loads((out / "manifest.json").read_text())["stages"]}


def test_registered_is_undone_after_the_block():
    before = (list(MEASURES), list(STATISTICS), list(SECTIONS))
    with plugins.registered():
        assert "out_norm" in MEASURES and "first_token" in STATISTICS and "first_token" in SECTIONS
        assert STAGES[: STAGES.index("agreement")] == tuple(MEASURES) and STAGES.index("out_norm") == len(MEASURES) - 1
        with pytest.raises(KeyError, match="registered already"):
            with MEASURES.registered("out_norm", plugins.OutNorm):
                pass
    assert (list(MEASURES), list(STATISTICS), list(SECTIONS)) == before
    assert "out_norm" not in STAGES


def test_registered_is_undone_after_an_error_too():
    with pytest.raises(RuntimeError, match="inside"):
        with MEASURES.registered("out_norm", plugins.OutNorm):
            raise RuntimeError("inside")
    assert "out_norm" not in MEASURES


def test_the_apis_default_measures_are_those_analyze_runs_unasked():
    """headlab.analyze and headlab.importance default to the measures that `headlab analyze` runs
    without a flag: a registered measure is among them, one declared ``on_request`` is not."""
    import headlab.api
    from headlab.pipeline.pipeline import AnalyzeConfig, not_requested

    def unasked() -> tuple:
        config = AnalyzeConfig("model", "src", "out")
        return tuple(name for name in MEASURES if not_requested(name, config) is None)

    before = tuple(headlab.api.DEFAULT_MEASURES)  # a live view of the registry
    assert before == unasked() and {"confidence", "lrp", "gradient"} <= set(before) and "ablation" not in before
    with plugins.registered():
        assert headlab.api.DEFAULT_MEASURES == unasked() == (*before, "out_norm")
    slow = type("SlowOutNorm", (plugins.OutNorm,), {"name": "slow_out_norm", "on_request": True})
    with MEASURES.registered("slow_out_norm", slow):
        assert "slow_out_norm" not in headlab.api.DEFAULT_MEASURES and "slow_out_norm" not in unasked()
    assert headlab.api.DEFAULT_MEASURES == before


def test_a_measure_option_is_a_flag_of_importance_and_analyze():
    with plugins.registered():
        parser = build_parser()
        for command in ("importance", "analyze"):
            sub = parser._subparsers._group_actions[0].choices[command]
            assert "--out-norm-power" in sub.format_help(), command
        for command in ("functions", "aggregate", "analyze"):
            sub = parser._subparsers._group_actions[0].choices[command]
            assert ("--first-token-per-layer" in sub.format_help()) == (command != "aggregate"), command
    assert "--out-norm-power" not in build_parser()._subparsers._group_actions[0].choices["analyze"].format_help()


def test_a_statistics_table_and_warnings_reach_headlab_functions(inputs, tmp_path, capsys, monkeypatch):
    """`headlab functions` prints each result's summary_markdown() after the heads' lines and its
    warnings() on stderr: the command names no statistic, a registered one is heard too."""
    torch.set_num_threads(1)
    monkeypatch.setattr(plugins.FirstTokenResult, "summary_markdown", lambda self: "| first-token table |",
                        raising=False)
    monkeypatch.setattr(plugins.FirstTokenResult, "warnings", lambda self: ["--first-token-per-layer: a warning"],
                        raising=False)
    with plugins.registered():
        assert main(["functions", str(inputs / "model"), "--conllu", str(inputs / "tb.conllu"), "--out",
                     str(tmp_path / "out"), "--no-progress", "--no-figures", "--relations", "nsubj,iobj"]) == 0
    out, err = capsys.readouterr()
    assert "--first-token-per-layer: a warning" in err and "--relations iobj: no arc of it in the data" in err
    assert "first-token" not in out.split("| first-token table |")[1]  # after every head's line
    assert out.index("| kind | relation | direction |") < out.index("| first-token table |")  # registry order


def test_a_plugin_of_each_kind_runs_through_analyze_heads_csv_and_the_report(inputs, tmp_path, capsys, monkeypatch):
    torch.set_num_threads(1)
    # Both runs finish within one second of the markers' clock: the table after a re-run stage
    # must still be rebuilt (its key followed the upstream stages' finishing times only).
    monkeypatch.setattr("headlab.pipeline.records.now_iso", lambda: "2026-01-01T00:00:00+00:00")
    out = tmp_path / "out"
    with plugins.registered():
        assert _analyze(inputs, out, "--out-norm-power", "1") == 0
        stages = _stages(out)
        # The measure: its own stage, its option in the scores' signature and in their values.
        assert stages["out_norm"]["status"] == "done"
        scores = HeadScores.load(out / "importance" / "out_norm.json")
        assert scores.signature["options"]["out_norm_power"] == 1.0
        block = next(b for b in attention_blocks(load_model(str(inputs / "model"))) if b.key == ("enc_self", 1))
        columns = block.o.weight.detach().reshape(block.o.weight.shape[0], block.n_heads, block.d_head)
        assert scores["enc_self"][1] == pytest.approx(columns.abs().sum(dim=(0, 2)).numpy(), rel=1e-6)  # L1
        # The statistic: written by the functions stage, its labels in a column of their own.
        assert stages["functions"]["status"] == "done"
        assert (out / "functions" / "first_token" / "share.json").is_file()
        with open(out / "heads.csv", newline="", encoding="utf-8") as handle:
            rows = list(csv.DictReader(handle))
        assert "out_norm" in rows[0] and "first_token_share" in rows[0]
        assert list(rows[0])[-len(function_groups()) - 1:] == ["functions", *function_groups()]
        assert function_groups()[-1] == "first_token"
        labelled = [r for r in rows if r["first_token"]]
        assert {r["first_token"] for r in labelled} == {"first-token"}
        assert len(labelled) == 2  # one head per analysed layer (enc_self, 2 layers)
        assert all("first-token" not in r["syntactic"] for r in rows)
        # The report: the measure's and the statistic's maps, and the section with its own data.
        html = (out / "index.html").read_text(encoding="utf-8")
        assert '<section id="first_token"><h2>First-token heads</h2>' in html
        assert "first_token_share: 2 heads attend most to the first token" in html
        assert '<a href="#first_token">First token</a>' in html
        assert "Output-projection norm" in html and "First-token share" in html
        # Each option is part of its stage's key: another value runs that stage again, no other.
        capsys.readouterr()
        assert _analyze(inputs, out, "--out-norm-power", "2", "--first-token-per-layer", "2") == 0
        err = capsys.readouterr().err
        assert re.search(r"out_norm: running", err) and re.search(r"confidence: reused", err)
        assert re.search(r"functions: running", err) and re.search(r"aggregate: reused", err)
        assert HeadScores.load(out / "importance" / "out_norm.json").signature["options"]["out_norm_power"] == 2.0
        summary = json.loads((out / "functions" / "summary.json").read_text())
        assert summary["config"]["first_token_per_layer"] == 2
        with open(out / "heads.csv", newline="", encoding="utf-8") as handle:
            assert sum(1 for r in csv.DictReader(handle) if r["first_token"]) == 4  # two per layer
    assert "out_norm" not in MEASURES and "first_token" not in STATISTICS


def test_a_statistic_of_the_aggregate_pass_is_written_by_its_stage(inputs, tmp_path):
    """A statistic declared for the aggregate pass is computed by the aggregate stage and saved in
    its own folder, drawn by the report and a column of heads.csv (it was computed and never saved
    when analyze wrote the aggregate statistics by name)."""
    from headlab.functions.statistic import Statistic
    from headlab.plugins import Output

    late = Statistic(lambda config, frequencies: plugins.FirstTokenStats(plugins.FirstTokenOptions()),
                     stage="aggregate", outputs=(Output("first_token/share.json", "Late first-token share"),))
    out = tmp_path / "out"
    with STATISTICS.registered("late_first_token", late):
        assert _analyze(inputs, out, "--skip", "importance") == 0
    assert "first_token/share.json" in _stages(out)["aggregate"]["outputs"]
    assert not (out / "functions" / "first_token").exists()
    with open(out / "heads.csv", newline="", encoding="utf-8") as handle:
        assert "share" in next(csv.reader(handle))
    assert "Late first-token share" in (out / "index.html").read_text(encoding="utf-8")


def test_a_plugin_option_out_of_its_range_is_refused_before_any_work(inputs, tmp_path, capsys):
    with plugins.registered():
        assert _analyze(inputs, tmp_path / "out", "--out-norm-power", "0") == 2
    assert "--out-norm-power must be > 0, got 0.0" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def _snippets(text: str) -> dict[str, str]:
    """``--8<-- [start:NAME]`` ... ``[end:NAME]`` blocks."""
    return {name: body.strip("\n") for name, body in
            re.findall(r"# --8<-- \[start:(\w+)\]\n(.*?)# --8<-- \[end:\1\]", text, re.S)}


REGISTRY_LINE = re.compile(r'# (src/headlab/\S+\.py), in (\w+):\n\s*"(\w+)": "([\w.]+)",\n')


def test_contributing_shows_the_worked_example_as_it_is():
    """CONTRIBUTING.md's code blocks are tests/support/plugins.py's blocks, verbatim, in order, and
    each registry line it shows registers what `plugins.registered` registers, by the same name."""
    contributing = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
    text = (ROOT / "tests" / "support" / "plugins.py").read_text(encoding="utf-8")
    source = _snippets(text)
    assert list(source) == ["measure", "statistic", "section"]
    blocks = re.findall(r"```python\n(.*?)```", contributing, re.S)
    code = [b.strip("\n") for b in blocks if not REGISTRY_LINE.match(b)]
    assert code == list(source.values())
    lines = [REGISTRY_LINE.match(b).groups() for b in blocks if REGISTRY_LINE.match(b)]
    assert [(registry, name) for _, registry, name, _ in lines] == [
        ("MEASURES", "out_norm"), ("STATISTICS", "first_token"), ("SECTIONS", "first_token")]
    for _, registry, name, path in lines:
        attribute = path.rpartition(".")[2]
        assert hasattr(plugins, attribute), path
        assert f'{registry}.registered("{name}", {attribute})' in text


def test_configs_take_the_declared_options_as_keywords():
    """A plug-in's option is a keyword of the configs, read back as an attribute (its declared
    default when not given), range-checked with its flag's name; an undeclared one is refused."""
    from headlab.errors import HeadlabError
    from headlab.functions.config import AnalysisConfig
    from headlab.importance.config import ImportanceConfig
    from headlab.pipeline.pipeline import AnalyzeConfig

    with plugins.registered():
        config = ImportanceConfig(methods=("out_norm",), out_norm_power=3.0)
        assert config.out_norm_power == 3.0 and ImportanceConfig().out_norm_power == 2.0
        assert config.signature_options()["out_norm_power"] == 3.0
        assert plugins.OutNorm.options_from(config) == plugins.OutNormOptions(power=3.0)
        with pytest.raises(HeadlabError, match=r"--out-norm-power must be > 0, got -1"):
            ImportanceConfig(out_norm_power=-1.0).resolved_methods()
        assert AnalyzeConfig("m", "s", "o", first_token_per_layer=3).first_token_per_layer == 3
        assert AnalysisConfig(first_token_per_layer=2).options == {"first_token_per_layer": 2}
        with pytest.raises(HeadlabError, match=r"--first-token-per-layer must be at least 1, got 0"):
            AnalysisConfig(first_token_per_layer=0)
    with pytest.raises(TypeError, match="out_norm_power"):
        ImportanceConfig(out_norm_power=3.0)  # not registered any more


def test_a_statistics_report_parts_reach_their_section_and_the_pages_script(tmp_path):
    """A statistic's own report parts (as Table 1 and the exemplars are): what one reads is collected
    (its notes in its section) and handed to report.js under its embed key; each is drawn above or
    below its section's heatmaps; one naming a section that draws no parts is refused, not dropped."""
    from headlab.plugins import ReportPart, Statistic
    from headlab.report import build_report

    (tmp_path / "functions" / "probe").mkdir(parents=True)
    (tmp_path / "functions" / "probe" / "count.json").write_text('{"n": 7}', encoding="utf-8")

    def read(directory: Path, note) -> dict:
        note("probe: read")
        return json.loads((directory / "functions" / "probe" / "count.json").read_text(encoding="utf-8"))

    parts = (ReportPart("probe_top", "functions", lambda c: '<p id="probe-top"></p>', before=True),
             ReportPart("probe", "functions", lambda c: f'<p id="probe">{c.sections["probe"]["n"]}</p>',
                        collect=read, embed="probe"))
    with STATISTICS.registered("probe", Statistic(lambda config, frequencies: None, report=parts)):
        html = build_report(tmp_path).read_text(encoding="utf-8")
    section = html[html.index('<section id="functions">'):]
    section = section[:section.index("</section>")]
    assert section.index('id="probe-top"') < section.index('data-group="functions"') < section.index('<p id="probe">7</p>')
    assert '<p class="note">probe: read</p>' in section
    data = json.loads(re.search(r'id="headlab-data">(.*?)</script>', html).group(1))
    assert data["probe"] == {"n": 7}

    stray = Statistic(lambda config, frequencies: None, report=(ReportPart("stray", "summary", lambda c: "x"),))
    with STATISTICS.registered("stray", stray), pytest.raises(ValueError, match="no section that draws parts"):
        build_report(tmp_path)


def test_the_builtin_statistics_options_reach_analyze_through_their_declarations(inputs, tmp_path, capsys):
    """--relations and --window are the syntactic and aggregate statistics' own options: analyze
    takes them with no flag of its own; given at their defaults they leave every stage's key as it
    was (a directory written before resumes), another value runs only its stage again, and an
    unknown relation is refused before any work."""
    out = tmp_path / "out"

    def analyze(*extra: str) -> tuple[int, str]:
        code = main(["analyze", str(inputs / "model"), "--source", str(inputs / "src.en"), "--conllu",
                     str(inputs / "tb.conllu"), "--out", str(out), "--no-progress", "--skip", "importance", "prune",
                     "attention", "figures", "report", *extra])
        return code, capsys.readouterr().err

    assert analyze()[0] == 0
    code, err = analyze("--relations", "nsubj,dobj,amod,advmod", "--window", "10")
    assert code == 0 and re.search(r"functions: reused", err) and re.search(r"aggregate: reused", err)
    code, err = analyze("--window", "3")
    assert code == 0 and re.search(r"functions: reused", err) and re.search(r"aggregate: running", err)
    assert HeadScores.load(out / "aggregate" / "variability.json").signature["window"] == 3
    code, err = analyze("--relations", "nsubj,iobj", "--window", "3")
    assert code == 0 and re.search(r"functions: running", err) and re.search(r"aggregate: reused", err)
    assert json.loads((out / "functions" / "summary.json").read_text())["config"]["relations"] == ["nsubj", "iobj"]
    marker = (out / ".headlab" / "stages" / "functions.json").read_text()
    code, err = analyze("--relations", "nsubj,objj")
    assert code == 2 and "--relations: 'objj' is not a Universal Dependencies relation" in err
    assert (out / ".headlab" / "stages" / "functions.json").read_text() == marker
    # --sensitivity, declared by the positional and the rare-token statistics: the functions stage only
    code, err = analyze("--relations", "nsubj,iobj", "--window", "3", "--sensitivity")
    assert code == 0 and re.search(r"functions: running", err) and re.search(r"aggregate: reused", err)
    assert json.loads((out / "functions" / "summary.json").read_text())["config"]["sensitivity"] is True
    assert (out / "functions" / "positional" / "interior_share.json").is_file()
    assert (out / "functions" / "rare_tokens" / "rarest_per_sentence.json").is_file()


def test_a_flag_that_several_statistics_declare_is_one_option(capsys):
    """--sensitivity is declared by the positional statistics and by the rare-token one (each reads
    it from its own options): functions shows it once, one value reaches both, summary.json leaves
    it out at its default; a plug-in that declares the flag otherwise is refused, not merged."""
    from dataclasses import dataclass

    from headlab.functions.config import AnalysisConfig
    from headlab.functions.positional import POSITIONAL_INTERIOR
    from headlab.functions.registry import option_specs
    from headlab.functions.statistic import Statistic, sensitivity_option
    from headlab.options import option
    from headlab.plugins import option_table

    owners = {s.owner for s in option_specs() if s.dest == "sensitivity"}
    assert owners == {"positional", "positional_tokens", "positional_interior", "rare"}
    with pytest.raises(SystemExit):
        main(["functions", "--help"])
    assert capsys.readouterr().out.count("--sensitivity ") == 1
    config = AnalysisConfig(sensitivity=True)
    assert "sensitivity" not in {f for f in AnalysisConfig.__dataclass_fields__}  # not the pass's own field
    assert STATISTICS["positional"].options_from(config.option_values()).sensitivity is True
    assert STATISTICS["rare"].options_from(config.option_values()).sensitivity is True
    assert POSITIONAL_INTERIOR(config).level == "interior" and POSITIONAL_INTERIOR(AnalysisConfig()) is None

    @dataclass(frozen=True)
    class Alike:
        sensitivity: bool = sensitivity_option()

    @dataclass(frozen=True)
    class Otherwise:
        sensitivity: bool = option(True, "on unless asked", flag="sensitivity")

    with STATISTICS.registered("alike", Statistic(lambda config, frequencies, options: None, Options=Alike)):
        assert [f.name for f in option_table(option_specs()).__dataclass_fields__.values()].count("sensitivity") == 1
    with STATISTICS.registered("otherwise", Statistic(lambda config, frequencies, options: None, Options=Otherwise)):
        with pytest.raises(ValueError, match="--sensitivity is declared differently by positional and otherwise"):
            AnalysisConfig(sensitivity=True)


def test_an_option_for_configs_only_is_no_flag(capsys):
    """The positional statistics' max_offset (declared with command_line=False): a keyword of the
    configs that reaches the statistic and summary.json, yet no flag of any command."""
    from headlab.functions.config import AnalysisConfig
    from headlab.pipeline.pipeline import AnalyzeConfig

    assert "max_offset" not in AnalysisConfig.__dataclass_fields__
    assert STATISTICS["positional"](AnalysisConfig(max_offset=4)).max_offset == 4
    assert STATISTICS["positional_tokens"](AnalysisConfig()).max_offset == 32
    assert AnalysisConfig(max_offset=4).option_values()["max_offset"] == 4
    assert AnalyzeConfig("m", "s", "o").max_offset == 32
    for command in ("functions", "aggregate", "analyze"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "--max-offset" not in capsys.readouterr().out, command


@pytest.mark.parametrize("family", ["marian", "gpt2"])
def test_the_worked_example_measure_keeps_the_registrys_contracts(family):
    """CONTRIBUTING's measure, registered, passes what tests/test_registries.py asks of every measure:
    under a mask and on the pruned model its removed heads are NaN and the others in their places
    (it put a pruned layer's vectors at indices 0..n-1 before it used block_scores)."""
    from test_registries import (
        test_a_failing_forward_leaves_the_model_as_it_was,
        test_scoring_under_a_mask_equals_scoring_the_masked_and_the_pruned_model,
    )

    with plugins.registered():
        test_scoring_under_a_mask_equals_scoring_the_masked_and_the_pruned_model(family, "out_norm")
        test_a_failing_forward_leaves_the_model_as_it_was("out_norm")
