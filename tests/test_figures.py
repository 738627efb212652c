"""The analysis figures: the data behind each figure (not its pixels), determinism, PNG + SVG."""

import json
import math

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from headlab.heads import HeadScores  # noqa: E402
from headlab.pipeline.figures import (  # noqa: E402
    figure1_data,
    plot_figure1,
    plot_gate_trajectories,
    plot_heads_kept,
    plot_pruning_curve,
    plot_scores_heatmap,
    save_figure,
    write_figures,
)

RELEVANCE = np.array([[0.1, 0.5, np.nan, 0.4], [-0.2, 0.3, 0.6, 0.3]])
CONFIDENCE = np.array([[0.2, 0.3, 0.4, 0.5], [0.6, 0.7, 0.8, 0.9]])
LABELS = {"enc_self:0:1": ["positional -1"], "enc_self:1:2": ["s->v", "rare"], "enc_self:1:0": []}
ROWS = [
    {"point": "full", "enc_self": 8, "dec_self": 8, "dec_cross": 8, "heads": 24, "bleu": 30.0},
    {"point": "keep-4", "enc_self": 4, "dec_self": 8, "dec_cross": 8, "heads": 20, "bleu": 29.0},
    {"point": "keep-2", "enc_self": 2, "dec_self": 8, "dec_cross": 8, "heads": 18, "bleu": 25.5},
]
TRAJECTORY = [{"step": s, "p_open": {"enc_self": [[1 - 0.1 * s, 0.9], [0.5, 0.5 + 0.1 * s]]}} for s in (1, 2, 3)]


def _scores(array, method):
    return HeadScores({"enc_self": array}, method)


def test_figure1_sorts_heads_by_relevance_within_each_layer():
    data = figure1_data(_scores(RELEVANCE, "lrp"), _scores(CONFIDENCE, "confidence"), LABELS)
    assert data["sorted_by"] == "lrp"
    first, second = data["layers"]
    assert first["heads"] == [1, 3, 0, 2]  # NaN last
    assert first["relevance"] == [0.5, 0.4, 0.1, None]
    assert first["confidence"] == [0.3, 0.5, 0.2, 0.4]
    assert first["labels"] == [["positional -1"], [], [], []]
    assert second["heads"] == [2, 1, 3, 0]  # ties keep head order
    assert second["labels"][0] == ["s->v", "rare"]
    without_lrp = figure1_data(None, _scores(CONFIDENCE, "confidence"), LABELS)
    assert without_lrp["sorted_by"] == "confidence" and without_lrp["layers"][0]["heads"] == [3, 2, 1, 0]
    assert without_lrp["layers"][0]["relevance"] is None
    with pytest.raises(ValueError):
        figure1_data(None, None, LABELS)


def test_figures_draw_on_given_axes_and_return_their_data():
    fig, axes = plt.subplots(3, 2, squeeze=False)
    drawn, data = plot_figure1(_scores(RELEVANCE, "lrp"), _scores(CONFIDENCE, "confidence"), LABELS, axes=axes)
    assert drawn is fig
    texts = [t.get_text() for t in axes[2, 1].texts]
    assert "s->v" in texts and "rare" in texts and data["kind"] == "enc_self"
    assert [t.get_text() for t in axes[2, 0].texts] == ["-1"]
    plt.close(fig)

    fig, ax = plt.subplots()
    drawn, data = plot_pruning_curve(ROWS, ax=ax)
    assert drawn is fig and data == {"kind": "enc_self", "points": [[2, 25.5], [4, 29.0]], "full": [8, 30.0]}
    plt.close(fig)
    _, data = plot_heads_kept(ROWS)
    assert [p["heads"] for p in data["points"]] == [24, 20, 18]
    _, data = plot_gate_trajectories({"keep-4": TRAJECTORY, "keep-2": []})
    assert list(data) == ["keep-4"] and data["keep-4"]["steps"] == [1, 2, 3]
    assert data["keep-4"]["p_open"]["enc_self:0:0"] == pytest.approx([0.9, 0.8, 0.7])
    _, data = plot_scores_heatmap(_scores(RELEVANCE, "lrp"))
    assert data["scores"]["enc_self"][0][2] is None and data["scores"]["enc_self"][1][2] == 0.6
    plt.close("all")


def test_figures_are_deterministic(tmp_path):
    outputs = []
    for run in range(2):
        fig, data = plot_figure1(_scores(RELEVANCE, "lrp"), _scores(CONFIDENCE, "confidence"), LABELS)
        png, svg = save_figure(fig, tmp_path / str(run), "figure1")
        outputs.append((json.dumps(data), svg.read_bytes(), png.read_bytes()))
    assert outputs[0] == outputs[1]
    assert b"<dc:date>" not in outputs[0][1]


def _analysis_dir(root):
    (root / "importance").mkdir(parents=True)
    _scores(RELEVANCE, "lrp").save(root / "importance" / "lrp.json")
    _scores(CONFIDENCE, "confidence").save(root / "importance" / "confidence.json")
    (root / "functions").mkdir()
    (root / "functions" / "labels.json").write_text(json.dumps(LABELS))
    _scores(CONFIDENCE, "mean_entropy").save(root / "aggregate" / "mean_entropy.json")
    (root / "prune" / "keep-4").mkdir(parents=True)
    (root / "prune" / "sweep.json").write_text(json.dumps(ROWS))
    (root / "prune" / "keep-4" / "trajectory.jsonl").write_text("\n".join(json.dumps(r) for r in TRAJECTORY) + "\n")
    return root


def test_write_figures_from_an_analysis_directory(tmp_path):
    root = _analysis_dir(tmp_path / "a")
    entries = write_figures(root)
    names = [e["name"] for e in entries]
    assert names == ["figure1_enc_self", "importance_confidence", "importance_lrp", "aggregate_mean_entropy",
                     "pruning_curve", "pruning_heads_per_kind", "gate_trajectories"]
    for entry in entries:
        assert (root / entry["png"]).is_file() and (root / entry["svg"]).is_file()
        assert entry["png"] == f"figures/{entry['name']}.png" and entry["title"] and entry["caption"]
    data = json.loads((root / "figures" / "figure1_enc_self.json").read_text())
    assert data["layers"][1]["heads"] == [2, 1, 3, 0]
    # The same files give the same figures, byte for byte.
    again = write_figures(_analysis_dir(tmp_path / "b"))
    assert again == entries
    for entry in entries:
        assert (tmp_path / "a" / entry["svg"]).read_bytes() == (tmp_path / "b" / entry["svg"]).read_bytes()
    assert math.isclose(data["layers"][0]["relevance"][0], 0.5)


def test_figure1_of_many_layers_wraps_into_bands_of_at_most_eight():
    """24 layers in one row were 24 unreadable panels (issue 36): they wrap into 3 bands of 8."""
    rng = np.random.default_rng(0)
    relevance, confidence = rng.uniform(size=(24, 16)), rng.uniform(size=(24, 16))
    fig, data = plot_figure1(_scores(relevance, "lrp"), _scores(confidence, "confidence"), {})
    visible = [ax for ax in fig.axes if ax.axison]
    assert len(visible) == 3 * 24 and len(data["layers"]) == 24
    width, height = fig.get_size_inches()
    assert width == pytest.approx(2.1 * 8) and height == pytest.approx(3 * 5.2)
    titled = {ax.get_title(): ax for ax in visible if ax.get_title()}
    assert len(titled) == 24  # every layer once, layer 8 starts the second band under layer 0
    first, ninth = titled["layer 0"].get_position(), titled["layer 8"].get_position()
    assert ninth.y0 < first.y0 and abs(ninth.x0 - first.x0) < 1e-6
    assert titled["layer 8"].get_ylabel() == "LRP relevance" and titled["layer 9"].get_ylabel() == ""
    fig, _ = plot_figure1(_scores(relevance[:11], "lrp"), _scores(confidence[:11], "confidence"), {})
    assert len([ax for ax in fig.axes if ax.axison]) == 33 and len(fig.axes) == 36  # 2 bands of 6, one place empty
    plt.close("all")


def test_figure1_and_the_statistics_figures_come_from_their_declarations(tmp_path):
    """Figure 1's grid rows, cells and caption and the statistics' own figures are what the
    registered statistics declare: a new one's labels get a row, its words and its cells, and a
    file it declares with a Figure is drawn, with no change to this module."""
    from headlab.functions.registry import STATISTICS
    from headlab.pipeline.figures import figure_specs
    from headlab.plugins import Figure, Output, Statistic

    probe = Statistic(lambda config, frequencies: None, label_group="probe", label_pattern=r"probe:\w+",
                      label_caption="probe (its word)", label_cell=lambda label: label.split(":")[1],
                      outputs=(Output("probe/*.json", "Probe {stem}", figure=Figure("probe_{stem}", "Probe: {label}",
                                                                                  "{stem} caption", "drawn {label}")),))
    root = _analysis_dir(tmp_path)
    (root / "functions" / "labels.json").write_text(json.dumps({**LABELS, "enc_self:0:0": ["probe:zz"]}))
    (root / "functions" / "probe").mkdir()
    _scores(CONFIDENCE, "probe").save(root / "functions" / "probe" / "some_share.json")
    words = [s.label_caption for s in STATISTICS.values() if s.label_caption]
    specs = {name: (title, caption, draw) for name, title, caption, draw in figure_specs(root)}
    assert "probe_some_share" not in specs and "probe" not in specs["figure1_enc_self"][1]
    assert specs["figure1_enc_self"][1].endswith(f"function: {', '.join(words[:-1])} and {words[-1]}.")
    with STATISTICS.registered("probe", probe):
        specs = {name: (title, caption, draw) for name, title, caption, draw in figure_specs(root)}
        assert specs["figure1_enc_self"][1].endswith(f"{words[-1]} and probe (its word).")
        fig, data = specs["figure1_enc_self"][2]()
        assert data["groups"][-1] == "probe"
        cells = [t.get_text() for ax in fig.axes for t in ax.texts]
        assert "zz" in cells and "-1" in cells  # probe:zz and positional -1, as their statistics write them
        plt.close(fig)
        title, caption, draw = specs["probe_some_share"]
        assert (title, caption) == ("Probe: some share", "some_share caption")
        fig, data = draw()
        assert fig.get_suptitle() == "drawn some share"
        plt.close(fig)
    assert list(specs).index("probe_some_share") > list(specs).index("aggregate_mean_entropy")


def test_gate_trajectories_name_a_pruned_model_s_heads_by_layer_and_original_index():
    """null: no gate (a head or layer removed before the gates were attached); the others keep
    their real layer and original head (``trajectory.jsonl`` as gates.json numbers them)."""
    records = [{"step": s, "p_open": {"dec_self": [[None] * 4, [None, 0.9 - 0.1 * s, None, None]]}} for s in (1, 2)]
    _, data = plot_gate_trajectories({"run": records})
    assert data["run"]["p_open"] == {"dec_self:1:1": pytest.approx([0.8, 0.7])}
    plt.close("all")
