"""Bad-input catalogue, model directories: loading is safe (no code from the directory runs, no
prompt) and complete or refused (no tensor left at random, none ignored), pruning records are
strictly typed and checked against the weights, a pruned directory re-saved by transformers
keeps working, and corrupt or contradictory directories are one-line errors with exit 2."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import headlab
from headlab.adapters import attention_blocks
from headlab.cli import main
from headlab.errors import HeadlabError
from headlab.loading import load_model
from headlab.surgery import PRUNING_FILE, load_pruned
from support.bad_input import save_tiny_marian, save_tiny_pruned, world_readable_dir
from support.models import tiny_inputs, tiny_model

SRC = Path(headlab.__file__).resolve().parents[1]  # the headlab under test, for the subprocesses


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("loading")
    save_tiny_marian(root / "plain")
    save_tiny_pruned(root / "pruned")
    tiny_model("bert").save_pretrained(root / "bert")
    return root


def _copy(dirs: Path, name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(dirs / name, tmp_path / name))


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    data.update(changes)
    path.write_text(json.dumps(data), encoding="utf-8")


def _one_line_error(capsys, code: int) -> str:
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip() and "it/s]" not in line and "it [" not in line]
    assert len(lines) == 1 and lines[0].startswith("headlab ") and "Traceback" not in err, err
    return lines[0]


# -- no code from a model directory, no prompt ----------------------------------------------
_EVIL = """import pathlib
pathlib.Path({marker!r}).write_text("ran")
from transformers import PretrainedConfig, PreTrainedModel
class EvilConfig(PretrainedConfig):
    model_type = "evil-heads"
class EvilModel(PreTrainedModel):
    config_class = EvilConfig
"""


def _plant_code(directory: Path, model_type: str | None) -> Path:
    """``directory``'s config.json (and tokenizer_config.json) point auto_map at evil.py, which
    writes a marker file when imported."""
    marker = directory.parent / f"{directory.name}-MARKER"
    (directory / "evil.py").write_text(_EVIL.format(marker=str(marker)), encoding="utf-8")
    changes: dict = {"auto_map": {"AutoConfig": "evil.EvilConfig", "AutoModelForSeq2SeqLM": "evil.EvilModel",
                                  "AutoModel": "evil.EvilModel"}}
    if model_type is not None:
        changes["model_type"] = model_type
    _edit_json(directory / "config.json", **changes)
    if (directory / "tokenizer_config.json").is_file():
        _edit_json(directory / "tokenizer_config.json", auto_map={"AutoTokenizer": ["evil.EvilTokenizer", None]})
    return marker


def _headlab(*args: str, stdin: str = "y\ny\n") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(SRC), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "headlab", *args], input=stdin, capture_output=True, text=True,
                          env=env, timeout=300)


@pytest.mark.parametrize("source", ["plain", "pruned"])
def test_auto_map_with_an_unknown_model_type_runs_no_code_and_never_prompts(source, dirs, tmp_path, capsys,
                                                                            monkeypatch):
    """Regression: load_pruned called AutoConfig without trust_remote_code, so transformers asked
    "run the custom code? [y/N]" on stdin, and "y" ran the directory's Python."""
    import io

    directory = _copy(dirs, source, tmp_path)
    marker = _plant_code(directory, "evil-heads")
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\ny\n"))
    for command in (["heads", str(directory)], ["prune", str(directory), "--heads", "enc_self:0:1", "--out",
                                                str(tmp_path / "out")]):
        line = _one_line_error(capsys, main(command))
        assert not marker.exists(), "the model directory's code ran"
        assert "auto_map" in line and "--trust-remote-code" in line
    assert sys.stdin.read() == "y\ny\n"  # nothing was asked


def test_auto_map_answered_y_on_a_real_stdin_runs_no_code(dirs, tmp_path):
    """The same through a pipe, as a user's shell gives it (the pruned directory of the report)."""
    directory = _copy(dirs, "pruned", tmp_path)
    marker = _plant_code(directory, "evil-heads")
    run = _headlab("heads", str(directory))
    assert not marker.exists(), "the model directory's code ran"
    assert run.returncode == 2, run.stderr
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "auto_map" in lines[0] and "--trust-remote-code" in lines[0], run.stderr
    assert "[y/N]" not in run.stdout + run.stderr


@pytest.mark.parametrize("source", ["plain", "pruned"])
def test_auto_map_with_a_known_model_type_loads_transformers_class_and_runs_no_code(source, dirs, tmp_path, capsys,
                                                                                    monkeypatch):
    """A known model_type with an auto_map: transformers' own class, completely loaded; the
    directory's code is never imported (the tokenizer's auto_map included)."""
    import io

    directory = _copy(dirs, source, tmp_path)
    marker = _plant_code(directory, None)
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\ny\n"))
    assert main(["heads", str(directory)]) == 0
    assert "total:" in capsys.readouterr().out
    from headlab.nmt.tokenizer import load_tokenizer

    load_tokenizer(directory)
    model = load_model(str(directory))
    assert not marker.exists(), "the model directory's code ran"
    assert type(model).__module__.startswith("transformers.models.marian")


# -- complete or refused ------------------------------------------------------------------
def _drop_tensors(directory: Path, prefix: str) -> None:
    file = directory / "model.safetensors"
    state = load_file(file)
    save_file({k: v for k, v in state.items() if not k.startswith(prefix)}, file, metadata={"format": "pt"})


def _another_models_weights(directory: Path, dirs: Path) -> None:
    shutil.copy(dirs / "bert" / "model.safetensors", directory / "model.safetensors")


INCOMPLETE = {
    # what it feeds in: (make the directory, what the message must name)
    "another-models-weights": (_another_models_weights, "model.encoder.layers.0.fc1.bias"),
    "missing-encoder-layer": (lambda d, _: _drop_tensors(d, "model.encoder.layers.1."),
                              "model.encoder.layers.1.fc1.bias"),
    "config-with-more-layers-than-weights": (lambda d, _: _edit_json(d / "config.json", encoder_layers=3),
                                             "model.encoder.layers.2.fc1.bias"),
    "weights-with-more-layers-than-config": (lambda d, _: _edit_json(d / "config.json", encoder_layers=1),
                                             "model.encoder.layers.1.fc1.bias"),
}


@pytest.mark.parametrize("row", sorted(INCOMPLETE))
def test_incomplete_or_foreign_weights_are_refused_naming_the_tensors(row, dirs, tmp_path, capsys):
    """Regression: the plain loader filled missing tensors with random values (exit 0, only
    transformers' MISSING table on stderr) and ignored tensors the model did not have."""
    make, tensor = INCOMPLETE[row]
    directory = _copy(dirs, "plain", tmp_path)
    make(directory, dirs)
    with pytest.raises(HeadlabError, match="refused rather than run with random values") as error:
        load_model(str(directory))
    assert tensor in str(error.value) or "and " in str(error.value)
    assert str(directory) in str(error.value)
    line = _one_line_error(capsys, main(["prune", str(directory), "--heads", "enc_self:0:1", "--out",
                                         str(tmp_path / "out")]))
    assert "do not fit the model's config" in line
    assert not (tmp_path / "out").exists()


def _pickle_only(directory: Path) -> None:
    state = load_file(directory / "model.safetensors")
    (directory / "model.safetensors").unlink()
    torch.save(state, directory / "pytorch_model.bin")


BAD_WEIGHTS = {
    # what analyze is given: (make the directory, what the one line must say)
    "pickle-only": (_pickle_only, "no .safetensors weights (pytorch_model.bin: pickle checkpoints"),
    "no-weights": (lambda d: (d / "model.safetensors").unlink(), "no .safetensors weights"),
    "corrupt-safetensors": (lambda d: os.truncate(d / "model.safetensors", 100), "not a readable safetensors file"),
    "missing-encoder-layer": (lambda d: _drop_tensors(d, "model.encoder.layers.1."), "do not fit the model's config"),
}


@pytest.mark.parametrize("row", sorted(BAD_WEIGHTS))
def test_analyze_refuses_weights_it_cannot_load_before_any_stage(row, dirs, tmp_path, capsys):
    """Regression: analyze ran every stage, each failing to load the model, then wrote an empty
    report (exit 1) where the other commands refuse the model with one line (exit 2)."""
    make, said = BAD_WEIGHTS[row]
    directory = _copy(dirs, "plain", tmp_path)
    make(directory)
    (tmp_path / "src.txt").write_text("The old dog chased a red ball .\nCats sleep here .\n", encoding="utf-8")
    out = tmp_path / "out"
    code = main(["analyze", str(directory), "--source", str(tmp_path / "src.txt"), "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and "failed" not in err, err
    assert err.strip().splitlines()[-1].startswith("headlab analyze: error: ") and said in err.strip().splitlines()[-1]
    assert not [p for p in out.rglob("*") if p.is_file()]


def test_missing_tensor_names_it(dirs, tmp_path):
    directory = _copy(dirs, "plain", tmp_path)
    _drop_tensors(directory, "model.encoder.layers.1.fc1.bias")
    with pytest.raises(HeadlabError, match=r"1 tensor\(s\) the model needs are not in the weights "
                                           r"\(model.encoder.layers.1.fc1.bias\)"):
        load_model(str(directory))


def test_pruned_directory_missing_a_tensor_is_refused(dirs, tmp_path):
    directory = _copy(dirs, "pruned", tmp_path)
    _drop_tensors(directory, "model.encoder.layers.1.fc1.bias")
    with pytest.raises(HeadlabError, match=r"model.encoder.layers.1.fc1.bias"):
        load_model(str(directory))


def test_allowed_unexpected_pooler_and_next_sentence_head(tmp_path):
    """The documented allow-list: a BERT pre-training checkpoint loads as a masked LM (its pooler
    and next-sentence head are unused); tied weights are never reported missing."""
    from support.models import CONFIGS

    _, config = CONFIGS["bert"]()
    torch.manual_seed(0)
    pretraining = transformers.BertForPreTraining(config)
    pretraining.config.architectures = ["BertForMaskedLM"]
    pretraining.save_pretrained(tmp_path / "bert-pretraining")  # as bert-base-uncased: names the masked LM
    _edit_json(tmp_path / "bert-pretraining" / "config.json", architectures=["BertForMaskedLM"])
    model = load_model(str(tmp_path / "bert-pretraining"))
    assert type(model).__name__ == "BertForMaskedLM"
    assert torch.equal(model.bert.encoder.layer[0].attention.self.query.weight,
                       pretraining.bert.encoder.layer[0].attention.self.query.weight)


@pytest.mark.parametrize("source", ["plain", "pruned"])
@pytest.mark.parametrize("damage", ["truncated-safetensors", "corrupt-safetensors"])
def test_truncated_or_corrupt_safetensors_is_one_line_naming_the_file(damage, source, dirs, tmp_path, capsys):
    """Regression: a SafetensorError traceback ("internal error ... bug in headlab")."""
    directory = _copy(dirs, source, tmp_path)
    file = directory / "model.safetensors"
    if damage == "truncated-safetensors":
        os.truncate(file, file.stat().st_size // 2)
    else:
        file.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}" + b"\x00" * 64)
    with pytest.raises(HeadlabError, match="truncated or corrupt"):
        load_model(str(directory))
    line = _one_line_error(capsys, main(["heads", str(directory)]))
    assert f"{file}: not a readable safetensors file" in line


@pytest.mark.parametrize("command", ["heads", "importance"])
def test_empty_model_path_says_so(command, tmp_path, capsys):
    """Regression: "" was ": a directory without config.json" (Path("") is the current directory)."""
    args = [command, ""] + (["--source", __file__, "--out", str(tmp_path / "out")] if command == "importance" else [])
    assert "the model path is empty" in _one_line_error(capsys, main(args))


def test_unreadable_weights_say_so(dirs, capsys):
    """Regression: a weights file without read permission was "No such file or directory"
    (safetensors' text). Root reads any file, so a root process reads it as user nobody."""
    with world_readable_dir() as root:
        directory = Path(shutil.copytree(dirs / "plain", root / "plain"))
        file = directory / "model.safetensors"
        file.chmod(0o000)
        as_root = os.geteuid() == 0
        if as_root:
            os.setegid(65534)
            os.seteuid(65534)
        try:
            with pytest.raises(HeadlabError, match="cannot read the weights"):
                load_model(str(directory))
            line = _one_line_error(capsys, main(["heads", str(directory)]))
        finally:
            if as_root:
                os.seteuid(0)
                os.setegid(0)
        assert f"{file}: cannot read the weights (Permission denied)" in line


def test_config_whose_heads_do_not_divide_the_width(dirs, tmp_path, capsys):
    """Regression: a ValueError traceback from inside transformers."""
    directory = _copy(dirs, "plain", tmp_path)
    _edit_json(directory / "config.json", encoder_attention_heads=5)
    with pytest.raises(HeadlabError, match="does not describe a MarianMTModel"):
        load_model(str(directory))
    line = _one_line_error(capsys, main(["heads", str(directory)]))
    assert "divisible" in line and str(directory) in line


# A config.json field that transformers cannot build a model from: each was an internal error with a traceback.
BAD_CONFIG_FIELDS = {
    "no-head": ({"encoder_attention_heads": 0}, "cannot build the model from its config (integer division"),
    "negative-width": ({"d_model": -8}, "cannot build the model from its config (Trying to create tensor with "
                                        "negative dimension"),
    "negative-vocabulary": ({"vocab_size": -1}, "negative dimension -1"),
    "heads-a-float": ({"encoder_attention_heads": 2.0}, "config.json: Validation error for field "
                                                        "'encoder_attention_heads'"),
    "heads-null": ({"encoder_attention_heads": None}, "expected int, got NoneType"),
    "layers-a-string": ({"encoder_layers": "2"}, "Field 'encoder_layers' expected int, got str"),
    # built (-8 x -4 = 32 passes transformers' check), refused as "no head size attribute 'head_dim'"
    "negative-heads": ({"encoder_attention_heads": -4}, "its head size (head_dim) is -8, not a positive number"),
}


@pytest.mark.parametrize("row", sorted(BAD_CONFIG_FIELDS))
def test_config_field_transformers_cannot_build_from_is_one_line(row, dirs, tmp_path, capsys):
    """Regression: 0 heads (ZeroDivisionError), a negative size (RuntimeError from torch) and a field of the wrong
    type (huggingface_hub's StrictDataclassFieldValidationError) were internal errors, traceback and exit 1, from
    `heads`, `functions` and `prune`."""
    directory = _copy(dirs, "plain", tmp_path)
    changes, said = BAD_CONFIG_FIELDS[row]
    _edit_json(directory / "config.json", **changes)
    line = _one_line_error(capsys, main(["heads", str(directory)]))
    assert said.split("(")[-1] in line and (str(directory) in line or row == "negative-heads")  # there: the module
    line = _one_line_error(capsys, main(["prune", str(directory), "--heads", "enc_self:0:1", "--out",
                                         str(tmp_path / "o")]))
    assert str(directory) in line and said in line and not (tmp_path / "o").exists()
    with pytest.raises(HeadlabError, match=re.escape(said.split("(")[-1])):
        load_model(str(directory))


# -- pruning records --------------------------------------------------------------------------
# save_tiny_pruned removed enc_self layer 0's heads 1 and 2: the record keeps [0, 3].
LYING_RECORDS = {
    "duplicate-kept-heads": ([0, 0], "strictly increasing"),
    "unordered-kept-heads": ([3, 0], "strictly increasing"),
    "float-kept-head": ([0, 2.9], "must be a list of head numbers"),
    "bool-kept-head": ([True, 3], "must be a list of head numbers"),
    "string-kept-head": (["0", 3], "must be a list of head numbers"),
    "kept-heads-not-grouping-over-kv-heads": ([0, 1, 3], "3 kept heads do not group over 2"),
    "fewer-kept-heads-than-the-weights": ([0], "enc_self layer 0 (1 head)"),
    "more-kept-heads-than-the-weights": ([0, 1, 3], "enc_self layer 0 (3 heads)"),
}


@pytest.mark.parametrize("row", sorted(LYING_RECORDS))
def test_lying_pruning_record_is_refused(row, dirs, tmp_path, capsys):
    """Regression: kept heads [3, 3] instead of [3, 6] filed one head's scores under another;
    [1.9] and [true] were truncated to head 1."""
    kept, message = LYING_RECORDS[row]
    directory = _copy(dirs, "pruned", tmp_path)
    record = json.loads((directory / PRUNING_FILE).read_text(encoding="utf-8"))
    assert record["blocks"]["enc_self"]["0"]["kept_heads"] == [0, 3]
    record["blocks"]["enc_self"]["0"]["kept_heads"] = kept
    if "than-the-weights" in row:  # a consistent lie: as many key/value heads (multi-head attention)
        record["blocks"]["enc_self"]["0"]["kept_kv_heads"] = kept
    (directory / PRUNING_FILE).write_text(json.dumps(record), encoding="utf-8")
    with pytest.raises(HeadlabError, match=re.escape(message)) as error:
        load_pruned(directory)
    assert str(directory / PRUNING_FILE) in str(error.value)
    line = _one_line_error(capsys, main(["heads", str(directory)]))
    assert message in line


def test_record_of_a_bool_head_count_is_refused(dirs, tmp_path):
    directory = _copy(dirs, "pruned", tmp_path)
    record = json.loads((directory / PRUNING_FILE).read_text(encoding="utf-8"))
    record["blocks"]["enc_self"]["0"]["n_heads"] = 4.0
    (directory / PRUNING_FILE).write_text(json.dumps(record), encoding="utf-8")
    with pytest.raises(HeadlabError, match="n_heads must be a non-negative integer"):
        load_pruned(directory)


@pytest.mark.parametrize("numbering", ["reconstructed", {"guessed": ["enc_self:0"]}, {"reconstructed": "enc_self:0"}])
def test_record_of_a_malformed_numbering_is_refused(numbering, dirs, tmp_path):
    directory = _copy(dirs, "pruned", tmp_path)
    record = json.loads((directory / PRUNING_FILE).read_text(encoding="utf-8"))
    record["numbering"] = numbering
    (directory / PRUNING_FILE).write_text(json.dumps(record), encoding="utf-8")
    with pytest.raises(HeadlabError, match="numbering must map"):
        load_pruned(directory)


@pytest.mark.parametrize("name", ["pipeline", "AutoConfig", "PreTrainedModel", "no such class", "__class__"])
def test_architectures_naming_no_model_class_is_refused_and_never_called(name, dirs, tmp_path, capsys,
                                                                         monkeypatch):
    """Regression: load_pruned called getattr(transformers, architectures[0])(config):
    ``["pipeline"]`` called transformers.pipeline."""
    called = []
    monkeypatch.setattr(transformers, "pipeline", lambda *a, **k: called.append(a), raising=False)
    directory = _copy(dirs, "pruned", tmp_path)
    _edit_json(directory / "config.json", architectures=[name])
    with pytest.raises(HeadlabError, match="not a transformers model class"):
        load_pruned(directory)
    line = _one_line_error(capsys, main(["heads", str(directory)]))
    assert f"architectures names {name!r}" in line
    assert not called


def test_architectures_naming_an_auto_class_is_accepted(dirs, tmp_path):
    directory = _copy(dirs, "pruned", tmp_path)
    _edit_json(directory / "config.json", architectures=["AutoModelForSeq2SeqLM"])
    assert type(load_pruned(directory)).__name__ == "MarianMTModel"


# -- pruned directories re-saved by transformers ----------------------------------------------
def _heads_per_kind(capsys, directory: Path) -> str:
    assert main(["heads", str(directory)]) == 0
    return next(line for line in capsys.readouterr().out.splitlines() if line.startswith("total: "))


@pytest.mark.parametrize("where", ["new-directory-without-record", "same-directory-with-record",
                                   "saved-from-load_pruned"])
def test_pruned_directory_resaved_by_transformers_keeps_working(where, dirs, tmp_path, capsys):
    """Regression: after save_pretrained (fine-tuning with Trainer), `heads` reported 8 encoder
    heads where there are 6 (the config's counts) and the weights did not load; the head counts
    now come from the weights' shapes."""
    pruned = load_pruned(dirs / "pruned")
    if where == "saved-from-load_pruned":
        resaved_model = pruned  # config restored to the original: head counts only in the shapes
    else:  # the portable directory, loaded with plain transformers (headlab's own pruned_heads.py)
        resaved_model = transformers.AutoModelForSeq2SeqLM.from_pretrained(dirs / "pruned", trust_remote_code=True)
    target = tmp_path / "resaved"
    if where == "same-directory-with-record":
        target = _copy(dirs, "pruned", tmp_path)
    resaved_model.save_pretrained(target)
    assert (target / PRUNING_FILE).is_file() == (where == "same-directory-with-record")
    expected = _heads_per_kind(capsys, dirs / "pruned")
    assert expected == "total: enc_self 6, dec_self 7, dec_cross 4; 17 heads"
    assert _heads_per_kind(capsys, target) == expected
    model = load_model(str(target))
    assert [(b.key, b.n_heads, b.n_kv_heads) for b in attention_blocks(model)] == \
        [(b.key, b.n_heads, b.n_kv_heads) for b in attention_blocks(pruned)]
    inputs = tiny_inputs("marian")
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, pruned(**inputs).logits, rtol=0, atol=1e-6)


def test_every_from_pretrained_in_headlab_passes_trust_remote_code():
    """Regression: load_pruned's AutoConfig and nmt's AutoTokenizer left it out (transformers then
    prompts, and runs the directory's code on "y"). GenerationConfig and a PEFT adapter have no code to trust."""
    import ast

    missing = []
    for path in sorted((SRC / "headlab").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr == "from_pretrained"):
                    continue
                receiver = ast.unparse(node.func.value)
                if receiver.endswith(("GenerationConfig", "PeftModel")):  # an adapter's config and weights: no code either
                    continue
                if path.name == "portable_code.py" and receiver == "super()":
                    continue  # PrunedModel.from_pretrained: the user's own call (trust_remote_code=True), passed on
                names = {k.arg for k in node.keywords}
                spread = any(k.arg is None for k in node.keywords)  # **kwargs: built in the same function
                if "trust_remote_code" not in names and not (spread and "trust_remote_code" in ast.unparse(function)):
                    missing.append(f"{path.relative_to(SRC)}:{node.lineno}: {receiver}.from_pretrained")
    assert not missing, missing


@pytest.mark.parametrize("family,spec", [
    ("llama", {("dec_self", 0): [0]}),  # 3 query heads over per-head copies of their key/value heads
    # regression: 2 query heads of different groups over 2 key/value heads; numbered 0 and 1, head 1 read key/value
    # head 0 in the freshly built model, and the check before loading refused the directory (PruningNotExact)
    ("llama", {("dec_self", 0): [0, 3]}),
    ("gpt2", {("dec_self", 0): [1, 2], ("dec_self", 1): [0, 1, 2, 3]}),  # fused [q | k | v] Conv1D, a layer emptied
])
def test_resaved_without_record_reads_grouped_and_fused_layouts(family, spec, tmp_path):
    from headlab import prune_heads, save_pruned

    model = tiny_model(family)
    prune_heads(model, spec)
    save_pruned(model, tmp_path / "pruned")
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "pruned", trust_remote_code=True).save_pretrained(
        tmp_path / "resaved")
    loaded = load_model(str(tmp_path / "resaved"))
    assert [(b.key, b.n_heads, b.n_kv_heads) for b in attention_blocks(loaded)] == \
        [(b.key, b.n_heads, b.n_kv_heads) for b in attention_blocks(model)]
    inputs = tiny_inputs(family)
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs).logits, model(**inputs).logits, rtol=0, atol=1e-6)


@pytest.mark.parametrize("through", ["transformers", "load_pruned", "transformers-plan-not-grouping"])
def test_resaved_grouped_heads_keep_or_say_their_numbering(through, tmp_path, caplog):
    """Regression (llama, 4 query heads over 2 key/value heads, heads 0 and 3 pruned): re-saved without
    headlab_pruning.json, the kept heads were numbered [0, 1] over key/value heads [0, 1], which on the freshly built
    model pairs head 1 with key/value head 1 (it reads 0): PruningNotExact, the directory did not load. Through
    pruned_heads.py the config keeps the plan, which names the original heads [1, 2]; from a model loaded by
    load_pruned (config restored, no plan) the numbering is rebuilt as the weights group it, [0, 2], and said so."""
    from headlab import prune_heads, save_pruned
    from headlab.surgery import original_heads, pruning_record

    model = tiny_model("llama")
    prune_heads(model, {("dec_self", 0): [0, 3]})
    save_pruned(model, tmp_path / "pruned")
    if through.startswith("transformers"):
        resaved = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "pruned", trust_remote_code=True)
    else:
        resaved = load_pruned(tmp_path / "pruned")
    resaved.save_pretrained(tmp_path / "resaved")
    assert not (tmp_path / "resaved" / PRUNING_FILE).exists()
    config = json.loads((tmp_path / "resaved" / "config.json").read_text(encoding="utf-8"))
    if through == "transformers":
        assert config["headlab_pruned"]["kept"] == {"model.layers.0.self_attn": [[1, 2], [0, 1], 4]}
    elif through == "transformers-plan-not-grouping":  # an edited plan pruning would not give: not used
        config["headlab_pruned"]["kept"]["model.layers.0.self_attn"] = [[0, 1], [0, 1], 4]
        (tmp_path / "resaved" / "config.json").write_text(json.dumps(config), encoding="utf-8")
    with caplog.at_level("WARNING", logger="headlab.surgery"):
        loaded = load_model(str(tmp_path / "resaved"))
    inputs = tiny_inputs("llama")
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs).logits, model(**inputs).logits, rtol=0, atol=1e-6)
    block = attention_blocks(loaded)[0]
    reconstructed = through != "transformers"
    assert original_heads(block) == (([0, 2] if reconstructed else [1, 2]), 4)
    assert ("numbering of the kept heads of dec_self:0 is not in the weights" in caplog.text) == reconstructed
    # saved again by headlab, the record still says the numbering is not the original one
    assert pruning_record(loaded).get("numbering") == ({"reconstructed": ["dec_self:0"]} if reconstructed else None)
    save_pruned(loaded, tmp_path / "again")
    caplog.clear()
    with caplog.at_level("WARNING", logger="headlab.surgery"):
        load_pruned(tmp_path / "again")
    assert ("numbering of the kept heads of dec_self:0 is not in the weights" in caplog.text) == reconstructed


def _pre_session_26(directory: Path) -> None:
    """A pruned directory as save_pruned wrote it before session 26, re-saved by transformers: a plan without
    ``kept``, no headlab_pruning.json."""
    (directory / PRUNING_FILE).unlink()
    config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    del config["headlab_pruned"]["kept"]
    (directory / "config.json").write_text(json.dumps(config), encoding="utf-8")


@pytest.mark.parametrize("family,spec,kept", [
    ("llama", {("dec_self", 0): [0, 3]}, [0, 2]),  # grouped: reconstructed as the weights group them
    ("marian", {("enc_self", 0): [0, 2]}, [0, 1]),  # one key/value head per head: 0..n-1
    ("bloom", {("dec_self", 0): [0, 2]}, [1, 3]),  # ALiBi: the plan's alibi entry names the original heads
])
def test_pruned_directory_saved_before_kept_loads_original_or_declared(family, spec, kept, tmp_path, caplog):
    """Regression: a directory saved before the plan named the kept heads (no ``kept``, no headlab_pruning.json)
    loaded Bloom with its heads renumbered 0, 1: their ALiBi slopes were another head's, logits moved without a
    word. The plan's ``alibi`` entry names the original heads; elsewhere the numbering is reconstructed, and said."""
    from headlab import prune_heads, save_pruned
    from headlab.surgery import original_heads, pruning_record
    from support import family_matrix

    model = family_matrix.tiny_model(family) if family == "bloom" else tiny_model(family)
    prune_heads(model, spec)
    save_pruned(model, tmp_path / "pruned")
    _pre_session_26(tmp_path / "pruned")
    with caplog.at_level("WARNING", logger="headlab.surgery"):
        loaded = load_model(str(tmp_path / "pruned"))
    inputs = family_matrix.tiny_inputs() if family == "bloom" else tiny_inputs(family)
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs).logits, model(**inputs).logits, rtol=0, atol=1e-6)
    (key, _), = spec.items()
    assert original_heads(next(b for b in attention_blocks(loaded) if b.key == key)) == (kept, 4)
    declared = family != "bloom"
    assert pruning_record(loaded).get("numbering") == ({"reconstructed": [f"{key[0]}:0"]} if declared else None)
    assert ("is not in the weights" in caplog.text) == declared


@pytest.mark.parametrize("family,spec", [("bloom", {("dec_self", 0): [0, 2]}), ("t5", {("enc_self", 0): [0, 2]})])
def test_reconstructed_numbering_that_would_change_the_model_is_refused(family, spec, tmp_path):
    """Regression: re-saved without record or plan (load_pruned, then save_pretrained), Bloom's and T5's kept heads got
    a reconstructed numbering, and with it another head's ALiBi slope or relative position bias: the model loaded,
    computing something else than the one saved (T5: logits 0.09 apart), with a warning about names only."""
    from headlab import prune_heads, save_pruned
    from support import family_matrix

    model = family_matrix.tiny_model(family) if family == "bloom" else tiny_model(family)
    prune_heads(model, spec)
    save_pruned(model, tmp_path / "pruned")
    load_pruned(tmp_path / "pruned").save_pretrained(tmp_path / "resaved")
    (key, _), = spec.items()
    with pytest.raises(HeadlabError, match=f"numbering of the kept heads of {key[0]}:0 is in neither the weights nor "
                                           f"the config.*original index picks its .*{PRUNING_FILE}"):
        load_model(str(tmp_path / "resaved"))


def test_a_layer_left_with_no_head_is_not_declared_reconstructed(tmp_path):
    """Regression: re-saved without record or plan, a layer that kept no head was listed among those whose head
    numbers are reconstructed (the bundled multi30k-en-de-pruned-enc's enc_self:0): it has none to number."""
    from headlab import prune_heads, save_pruned
    from headlab.surgery import pruning_record

    model = tiny_model("llama")
    prune_heads(model, {("dec_self", 0): [0, 1, 2, 3], ("dec_self", 1): [0, 3]})
    save_pruned(model, tmp_path / "pruned")
    load_pruned(tmp_path / "pruned").save_pretrained(tmp_path / "resaved")
    loaded = load_model(str(tmp_path / "resaved"))
    assert pruning_record(loaded)["numbering"] == {"reconstructed": ["dec_self:1"]}
    inputs = tiny_inputs("llama")
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs).logits, model(**inputs).logits, rtol=0, atol=1e-6)


def test_layer_pruned_twice_keeps_the_plans_numbering(tmp_path, caplog):
    """Regression: pruned twice, a grouped layer keeps a copy of its key/value head per query head ([2, 3] over
    [1, 1]), which the plan names; the plan was used only for the layout one pruning gives ([1]), so the re-saved
    directory loaded with the reconstructed numbering [0, 2] though the original one was in config.json."""
    from headlab import prune_heads, save_pruned
    from headlab.surgery import original_heads, pruning_record

    model = tiny_model("llama")
    prune_heads(model, {("dec_self", 0): [1]})
    prune_heads(model, {("dec_self", 0): [0]})
    assert pruning_record(model)["blocks"]["dec_self"]["0"]["kept_kv_heads"] == [1, 1]
    save_pruned(model, tmp_path / "pruned")
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "pruned", trust_remote_code=True).save_pretrained(
        tmp_path / "resaved")
    with caplog.at_level("WARNING", logger="headlab.surgery"):
        loaded = load_model(str(tmp_path / "resaved"))
    assert original_heads(attention_blocks(loaded)[0]) == ([2, 3], 4)
    assert "numbering" not in pruning_record(loaded) and "is not in the weights" not in caplog.text
    inputs = tiny_inputs("llama")
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs).logits, model(**inputs).logits, rtol=0, atol=1e-6)


@pytest.mark.parametrize("n_heads,n_kv_heads", [(4, 4), (4, 2), (6, 2), (8, 2), (8, 4), (9, 3), (4, 1)])
def test_reconstructed_numbering_groups_as_every_pruning_does(n_heads, n_kv_heads):
    """Whatever heads a layer kept, a numbering is read off the weights' counts, and it prunes a fresh layer into the
    same counts (pruning's own rule, heads.kv_heads_kept), so the check before loading compares like with like. Before,
    2 of 8 over 2 (group size 1) was [0, 1] over [0, 1], and 3 of 8 over 2 (a copy per head) [0, 1, 2] over [0, 0, 1]."""
    from itertools import combinations

    from headlab.checkpoint import _kept_reconstructed
    from headlab.heads import kv_heads_kept

    for n in range(n_heads):
        for kept in combinations(range(n_heads), n):
            kv_kept, _ = kv_heads_kept(list(kept), n_heads, n_kv_heads)
            found = _kept_reconstructed(n_heads, n_kv_heads, n, len(kv_kept))
            assert found is not None, kept
            assert kv_heads_kept(found[0], n_heads, n_kv_heads)[0] == found[1] and len(found[1]) == len(kv_kept), \
                (kept, found)
    assert _kept_reconstructed(4, 2, 2, 2) == ([0, 2], [0, 1])
    assert _kept_reconstructed(4, 2, 4, 4) is None  # every query head kept: key/value heads are never copied


def test_the_grouping_rule_is_what_pruning_does():
    """heads.kv_heads_kept, which checkpoint reads re-saved weights with, against the key/value projection that
    prune_heads actually leaves (llama, 4 query heads over 2 key/value heads): written out by hand, not by the rule."""
    from headlab import prune_heads
    from headlab.heads import kv_heads_kept

    # removed heads -> (kept key/value heads, query heads per key/value head)
    expected = {(0, 1): ([1], 2), (0, 2): ([0, 1], 1), (0,): ([0, 1, 1], 1), (): ([0, 1], 2), (3,): ([0, 0, 1], 1)}
    for removed, (kv_kept, groups) in expected.items():
        keep = [h for h in range(4) if h not in removed]
        assert kv_heads_kept(keep, 4, 2) == (kv_kept, groups), removed
        model = tiny_model("llama")
        block = attention_blocks(model)[0]
        k_rows = block.k.weight.detach().reshape(2, -1, block.k.weight.shape[1])
        if removed:
            prune_heads(model, {("dec_self", 0): list(removed)})
        block = attention_blocks(model)[0]
        assert (block.n_heads, block.n_kv_heads) == (len(keep), len(kv_kept)), removed
        torch.testing.assert_close(block.k.weight.detach().reshape(len(kv_kept), -1, k_rows.shape[2]),
                                   k_rows[kv_kept], rtol=0, atol=0)


@pytest.mark.parametrize("auto,cls,head", [("AutoModelForMaskedLM", "BertForMaskedLM", True),
                                           ("AutoModel", "BertModel", False)])
def test_resaved_pruned_model_is_the_class_it_was_saved_as(auto, cls, head, tmp_path, capsys):
    """Regression: a re-saved directory names headlab's PrunedModel, which transformers maps to
    ``auto``; headlab built the first auto class with a head instead (BertLMHeadModel): a pruned bare
    BertModel's weights then matched nothing, `heads` said 4 heads where 3 are left and the
    measures crashed; a pruned BertForMaskedLM counted as having no language-model head, so
    importance skipped lrp, gradient and ablation."""
    from headlab import prune_heads, save_pruned
    from headlab.model_description import model_info

    model = tiny_model("bert") if head else transformers.BertModel(tiny_model("bert").config).eval()
    prune_heads(model, {("enc_self", 0): [1]})
    save_pruned(model, tmp_path / "pruned")
    getattr(transformers, auto).from_pretrained(tmp_path / "pruned", trust_remote_code=True).save_pretrained(
        tmp_path / "resaved")
    assert _heads_per_kind(capsys, tmp_path / "resaved") == "total: enc_self 7; 7 heads"
    loaded = load_model(str(tmp_path / "resaved"))
    assert type(loaded).__name__ == cls
    assert [(b.key, b.n_heads) for b in attention_blocks(loaded)] == [(b.key, b.n_heads) for b in attention_blocks(model)]
    notes: list[str] = []
    assert model_info(loaded, log=notes.append).has_lm_head == head and not notes
    inputs = tiny_inputs("bert")
    with torch.no_grad():
        expected, got = model(**inputs), loaded(**inputs)
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=1e-6)


def _forbid_hub(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the hub client was asked although the hub cannot be reached")
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)


def test_hub_id_offline_is_said_at_once(tmp_path, monkeypatch, capsys):
    """Regression: with HF_HUB_OFFLINE=1 (or no network) a hub id not in the cache cost ~30 s of
    retries and then "not a model id found on the Hugging Face hub": the hub was never asked."""
    from headlab import loading

    original = transformers.AutoConfig.from_pretrained
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _forbid_hub(monkeypatch)
    data = tmp_path / "data.txt"
    data.write_text("a sentence\n", encoding="utf-8")
    assert main(["importance", "someorg/not-cached-model", "--data", str(data), "--out", str(tmp_path / "o"),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert ("the Hugging Face hub cannot be reached (HF_HUB_OFFLINE=1) and someorg/not-cached-model is not in the "
            "local cache") in err
    with pytest.raises(HeadlabError, match=r"cannot be reached \(HF_HUB_OFFLINE=1\)"):
        loading.load_tokenizer("someorg/not-cached-model")
    # No network (no DNS, no route): the same, found by one short connection attempt.
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.is_offline_mode", lambda: False)
    for name in loading._PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    loading._no_network.cache_clear()

    def unreachable(address, timeout=None):
        assert timeout is not None and timeout <= 3
        raise OSError("Name or service not known")
    monkeypatch.setattr(loading.socket, "create_connection", unreachable)
    with pytest.raises(HeadlabError, match=r"hub cannot be reached \(no network\) and someorg/x is not in the local"):
        loading.load_config("someorg/x")
    loading._no_network.cache_clear()
    # A name that cannot be a hub id keeps its own message, with no connection attempted.
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", original)
    assert main(["heads", str(tmp_path / "missing")]) == 2
    assert "no such model directory, and not a model id" in capsys.readouterr().err
