"""The scripts of examples/ run on tiny models, so that they never rot (issue 15, item 10)."""

from __future__ import annotations

import ast
import runpy
import sys
from pathlib import Path

import pytest
import torch
import transformers as tf

from support.models import tiny_model
from support.treebank import SAMPLE_CONLLU, word_tokenizer

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TEXTS = [line[len("# text = "):] for line in SAMPLE_CONLLU.splitlines() if line.startswith("# text = ")]
WORDS = [w for text in TEXTS for w in text.split()]




def _run(name: str, argv: list[str], monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", [str(EXAMPLES / name), *argv])
    runpy.run_path(str(EXAMPLES / name), run_name="__main__")


def test_causal_lm_example(tmp_path, monkeypatch, capsys):
    tiny_model("gpt2").save_pretrained(tmp_path / "gpt2")
    word_tokenizer(WORDS, style="gpt2").save_pretrained(tmp_path / "gpt2")
    (tmp_path / "text.txt").write_text("\n".join(TEXTS) + "\n")
    (tmp_path / "tb.conllu").write_text(SAMPLE_CONLLU)
    _run("causal_lm.py", [str(tmp_path / "gpt2"), "--text", str(tmp_path / "text.txt"), "--conllu",
                          str(tmp_path / "tb.conllu"), "--out", str(tmp_path / "out"), "--skip", "figures"], monkeypatch)
    out = capsys.readouterr().out
    assert "most important heads by LRP:" in out and out.count("layer ") == 5 and "index.html" in out


def test_classifier_example(tmp_path, monkeypatch, capsys):
    torch.manual_seed(0)
    config = tf.BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=37, max_position_embeddings=32, num_labels=2)
    tf.BertForSequenceClassification(config).save_pretrained(tmp_path / "clf")
    word_tokenizer(WORDS, style="bert", max_vocab=40).save_pretrained(tmp_path / "clf")
    (tmp_path / "dev.tsv").write_text("".join(f"{text}\t{i % 2}\n" for i, text in enumerate(TEXTS * 2)))
    _run("classifier.py", [str(tmp_path / "clf"), "--data", str(tmp_path / "dev.tsv"), "--out", str(tmp_path / "o")],
         monkeypatch)
    out = capsys.readouterr().out
    assert "accuracy of the full model" in out and "gradient importance vs ablation (Spearman)" in out
    assert (tmp_path / "o" / "ablation_accuracy.json").is_file()
    assert "--" not in out and ("accuracy +" in out or "accuracy -" in out)  # a drop of -0.0 printed "--0.0%"


def test_translation_example(tmp_path, monkeypatch, capsys):
    import transformers.dynamic_module_utils as dynamic

    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))  # not the user's cache
    tiny_model("marian").save_pretrained(tmp_path / "mt")
    word_tokenizer(WORDS).save_pretrained(tmp_path / "mt")
    (tmp_path / "src.txt").write_text("\n".join(TEXTS) + "\n")
    _run("translation.py", [str(tmp_path / "mt"), "--source", str(tmp_path / "src.txt"), "--out",
                            str(tmp_path / "pruned"), "--remove", "3"], monkeypatch)
    out = capsys.readouterr().out
    assert "removing 3 encoder heads" in out and out.count("  ->  ") == 3
    assert (tmp_path / "pruned" / "pruned_heads.py").is_file()


def test_readme_quick_tour_runs_as_written(tmp_path, monkeypatch):
    """README's Python snippet, verbatim, on the bundled EN-DE model (it once used an undefined `batch`)."""
    import re

    root = EXAMPLES.parent
    snippet = re.search(r"## A quick tour\n\n```python\n(.*?)```", (root / "README.md").read_text(encoding="utf-8"), re.S)
    assert snippet is not None
    (tmp_path / "models").symlink_to(root / "models")
    monkeypatch.chdir(tmp_path)
    exec(compile(snippet.group(1), "README.md", "exec"), {"__name__": "readme"})
    assert (tmp_path / "pruned" / "headlab_pruning.json").is_file()


def _doc_snippet(path: str, pattern: str) -> str:
    import re

    found = re.search(pattern + r".*?```python\n(.*?)```", (EXAMPLES.parent / path).read_text(encoding="utf-8"), re.S)
    assert found is not None, f"{path}: no Python snippet after {pattern!r}"
    return found.group(1)


def test_doc_snippets_of_foundation_and_nmt_run_as_written(tmp_path, monkeypatch, capsys):
    """docs/foundation.md's snippet (its `model` and `batch`: the README quick tour's) and docs/nmt.md's
    plain-transformers snippet, verbatim, on the bundled EN-DE model, so that they cannot rot."""
    root = EXAMPLES.parent
    (tmp_path / "models").symlink_to(root / "models")
    monkeypatch.chdir(tmp_path)
    tour = _doc_snippet("README.md", r"## A quick tour\n\n")
    setup = tour[:tour.index("for block in")]  # the quick tour's model, tokenizer and batch
    namespace = {"__name__": "docs"}
    exec(compile(setup + _doc_snippet("docs/foundation.md", r"^# "), "docs/foundation.md", "exec"), namespace)
    assert type(namespace["model"]).__name__ == "MarianMTModel" and (tmp_path / "pruned" / "model.safetensors").is_file()
    exec(compile(_doc_snippet("docs/nmt.md", r"The loaded directory \(unpruned\)"), "docs/nmt.md", "exec"),
         {"__name__": "docs"})
    translation = capsys.readouterr().out
    assert translation.startswith("['") and "Hund" in translation


def _execute_notebook(path: Path, cwd: Path):
    """Run the notebook top to bottom in a fresh Jupyter kernel (nbclient, ipykernel), with this
    checkout's headlab importable, offline and on one thread; return it with its outputs."""
    import os

    import headlab

    nbclient = pytest.importorskip("nbclient", reason="the notebook tests need nbclient and ipykernel "
                                                      "(pip install -e '.[test]')")
    pytest.importorskip("ipykernel", reason="the notebook tests need ipykernel (pip install -e '.[test]')")
    import nbformat

    notebook = nbformat.read(path, as_version=4)
    src = str(Path(headlab.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(cwd)}})
    client.execute(env=env)
    return notebook


def _outputs(cell, kind: str) -> str:
    """All of a cell's output of one MIME type (``text/plain``, ``text/html``) or its stdout."""
    found = []
    for output in cell.get("outputs", []):
        if kind == "stdout" and output.get("name") == "stdout":
            found.append(output["text"])
        elif kind in output.get("data", {}):
            found.append(output["data"][kind])
    return "\n".join(found)


def _cell(notebook, source_start: str):
    return next(c for c in notebook.cells if c.cell_type == "code" and c.source.startswith(source_start))


def test_quickstart_notebook_runs_with_its_outputs(tmp_path):
    """examples/quickstart.ipynb executed in a Jupyter kernel (nbclient): the analysis displays
    as text and as HTML, the tables come out in pandas, pruning keeps the 6 heads asked for, and
    the analysis reads back from its directory."""
    notebook = _execute_notebook(EXAMPLES / "quickstart.ipynb", tmp_path)
    assert not [o for c in notebook.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    shown = _cell(notebook, "CONLLU = ")
    text = _outputs(shown, "text/plain")
    assert text.startswith("Analysis of GPT2LMHeadModel") and "top by lrp: dec_self L" in text
    # As HTML: the report in a frame, with the measures' heatmaps and the treebank's sentences in its viewer.
    import base64
    import json
    import re

    frame = re.search(r'<iframe src="data:text/html;base64,([A-Za-z0-9+/=]+)"', _outputs(shown, "text/html"))
    assert frame is not None
    page = base64.b64decode(frame.group(1)).decode("utf-8")
    data = json.loads(re.search(r'<script type="application/json" id="headlab-data">(.*?)</script>', page, re.S)[1])
    assert {"importance/lrp", "functions/positional/share", "aggregate/mean_distance"} <= {h["id"] for h in data["heatmaps"]}
    # the viewer shows the treebank's sentences, with their gold arcs
    assert [e["source"] for e in data["attention"]["sentences"]] == ["the old dog quickly chased a red ball",
                                                                     "birds sing and fish swim"]
    assert [e["treebank"] for e in data["attention"]["sentences"]] == ["<conllu text>:1", "<conllu text>:11"]
    assert '"gold":{"side":"source"' in page
    means = _outputs(_cell(notebook, "frame = analysis.to_pandas()"), "text/html")
    assert "<table" in means and all(f"<th>{m}</th>" in means for m in ("confidence", "gradient", "lrp"))
    assert "syntactic" in _outputs(_cell(notebook, "analysis.heads()"), "text/html")  # a label column of heads.csv
    pruned = _cell(notebook, "lrp = headlab.importance(")
    assert _outputs(pruned, "text/plain").startswith("HeadScores(lrp of GPT2LMHeadModel: dec_self 2x4")
    printed = _outputs(pruned, "stdout")
    kept = ast.literal_eval(printed.split("heads kept in the pruned layers: ")[1].splitlines()[0])  # {(kind, layer): [head, ...]}
    assert 8 - sum(4 - len(heads) for heads in kept.values()) == 6  # layers left out keep all 4 heads
    before, after = map(int, printed.split("parameters: ")[1].split()[::2])
    assert after < before
    assert "read back the same tables and labels: True" in _outputs(_cell(notebook, "with tempfile"), "stdout")


def test_readme_python_api_runs_as_written(tmp_path, monkeypatch):
    """README's "In Python" snippet, verbatim, on the bundled EN-DE model and the bundled EWT treebank."""
    import re

    root = EXAMPLES.parent
    snippet = re.search(r"## In Python\n\n.*?```python\n(.*?)```", (root / "README.md").read_text(encoding="utf-8"), re.S)
    assert snippet is not None
    (tmp_path / "models").symlink_to(root / "models")
    (tmp_path / "data").symlink_to(root / "data")
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "readme"}
    exec(compile(snippet.group(1), "README.md", "exec"), namespace)
    assert (tmp_path / "runs" / "api" / "heads.csv").is_file()
    assert {"confidence", "lrp", "gradient", "positional_share"} <= set(namespace["analysis"].tables)
    from headlab import attention_blocks

    assert sum(b.n_heads for b in attention_blocks(namespace["model"]) if b.kind == "enc_self") == 24
