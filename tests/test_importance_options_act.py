"""A measure's own option given to ``headlab importance`` / ``headlab.importance`` without the
measure it acts on (``--engine`` with ``--method lrp``): refused before any work, naming the
option and the measure, where the run went on as if it had not been given."""

import pytest

from headlab.cli import main
from headlab.errors import HeadlabError
from support.bad_input import SENTENCES, forbid_model_loading, save_tiny_marian


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("options-act")
    save_tiny_marian(root / "model")
    (root / "src.txt").write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    return root


def _importance(inputs, out, *extra):
    return ["importance", str(inputs / "model"), "--data", str(inputs / "src.txt"), "--out", str(out),
            "--no-progress", "--n-sentences", "2", *extra]


@pytest.mark.parametrize("method", ["lrp", "gradient", "ablation", "lrp,gradient,ablation"])
def test_engine_without_confidence_is_refused(method, inputs, tmp_path, capsys, monkeypatch):
    """Regression: `importance --method lrp --engine eager` ran LRP and ignored --engine, silently."""
    forbid_model_loading(monkeypatch)
    out = tmp_path / "out"
    assert main(_importance(inputs, out, "--method", method, "--engine", "eager")) == 2
    err = capsys.readouterr().err
    assert (f"headlab importance: error: --engine: this option acts on confidence alone, and --method {method} "
            "does not run it: add confidence to the measures, or leave --engine out") in err
    assert "Traceback" not in err and not out.exists()


def test_several_idle_options_are_named_together(inputs, tmp_path, capsys, monkeypatch):
    forbid_model_loading(monkeypatch)
    out = tmp_path / "out"
    assert main(_importance(inputs, out, "--method", "gradient", "--query-chunk", "4", "--lrp-targets", "2",
                            "--metric", "bleu")) == 2
    err = capsys.readouterr().err
    assert ("--query-chunk (confidence), --lrp-targets (lrp), --metric (ablation): these options act on the "
            "measures in brackets alone, and --method gradient runs none of them") in err
    assert not out.exists()


def test_options_of_a_chosen_measure_still_run(inputs, tmp_path, capsys):
    """The check leaves alone an option whose measure runs, and a default given again."""
    out = tmp_path / "out"
    assert main(_importance(inputs, out, "--method", "confidence,gradient", "--engine", "eager",
                            "--lrp-seed", "0")) == 0
    assert (out / "confidence.json").exists() and (out / "gradient.json").exists()


def test_python_api_refuses_an_idle_keyword(inputs):
    import headlab
    from headlab.loading import load_model, load_tokenizer

    model, tokenizer = load_model(str(inputs / "model")), load_tokenizer(str(inputs / "model"))
    with pytest.raises(HeadlabError, match=r"^engine: this option acts on confidence alone, and "
                                           r"measures=\['lrp'\] does not run it"):
        headlab.importance(model, tokenizer, SENTENCES, measures="lrp", engine="eager")
    with pytest.raises(HeadlabError, match=r"lrp_targets: this option acts on lrp alone"):
        headlab.importance(model, tokenizer, SENTENCES, measures=["confidence"], lrp_targets=2)
