"""--device, --dtype and --device-map (issue 15, item 7): on the CPU here; the CUDA tests at the
end run where a GPU is present and skip with the reason otherwise."""

from __future__ import annotations

import json

import pytest
import torch

from headlab import HeadScores, prune_heads, save_pruned
from headlab.cli import main
from headlab.errors import HeadlabError
from headlab.loading import load_model
from support.models import tiny_inputs, tiny_model
from support.treebank import SAMPLE_CONLLU, word_tokenizer

TEXTS = [line[len("# text = "):] for line in SAMPLE_CONLLU.splitlines() if line.startswith("# text = ")]
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("devices")
    words = [w for text in TEXTS for w in text.split()]
    for family, style in (("gpt2", "gpt2"), ("marian", "marian")):
        model = tiny_model(family)
        model.save_pretrained(root / family)
        word_tokenizer(words, style=style).save_pretrained(root / family)
    pruned = tiny_model("marian")
    prune_heads(pruned, {("enc_self", 0): [1, 2], ("dec_cross", 1): [0, 1, 2, 3]})
    save_pruned(pruned, root / "pruned")
    (root / "text.txt").write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    (root / "tb.conllu").write_text(SAMPLE_CONLLU, encoding="utf-8")
    return root


def test_dtype_device_and_device_map_place_the_weights(saved):
    inputs = tiny_inputs("marian")
    reference = load_model(str(saved / "marian"))
    with torch.no_grad():
        expected = reference(**inputs).logits
    for path in (saved / "marian", saved / "pruned"):
        model = load_model(str(path), dtype="bfloat16", device="cpu")
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and not model.training
        mapped = load_model(str(path), device_map="auto")  # Accelerate's choice: the GPU where there is one
        assert {p.device.type for p in mapped.parameters()} == {"cuda" if torch.cuda.is_available() else "cpu"}
    mapped = load_model(str(saved / "marian"), device_map="auto")
    with torch.no_grad():
        logits = mapped(**{k: v.to(mapped.device) for k, v in inputs.items()}).logits
    torch.testing.assert_close(logits.cpu(), expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(HeadlabError, match="--device or --device-map, not both"):
        load_model(str(saved / "marian"), device="cpu", device_map="auto")
    with pytest.raises(HeadlabError, match="--dtype float8: expected one of float32, bfloat16, float16"):
        load_model(str(saved / "marian"), dtype="float8")
    with pytest.raises(HeadlabError, match="--device gpu7: not a device"):
        load_model(str(saved / "marian"), device="gpu7")


def test_every_analysis_command_takes_the_options(saved, tmp_path, capsys):
    out = tmp_path / "imp"
    assert main(["importance", str(saved / "gpt2"), "--data", str(saved / "text.txt"), "--out", str(out),
                 "--method", "confidence,gradient", "--device", "cpu", "--dtype", "bfloat16", "--no-progress"]) == 0
    assert HeadScores.load(out / "confidence.json")["dec_self"].shape == (2, 4)
    assert main(["functions", str(saved / "gpt2"), "--conllu", str(saved / "tb.conllu"), "--out", str(tmp_path / "f"),
                 "--device", "cpu", "--no-figures", "--no-progress"]) == 0
    assert main(["analyze", str(saved / "marian"), "--source", str(saved / "text.txt"), "--out", str(tmp_path / "a"),
                 "--skip", "importance", "attention", "figures", "--device-map", "auto", "--no-progress"]) == 0
    assert main(["prune", "apply", str(saved / "marian"), "--heads", "enc_self:0:1", "--out", str(tmp_path / "p"),
                 "--dtype", "float16"]) == 0
    config = json.loads((tmp_path / "p" / "config.json").read_text())
    assert config["dtype"] == "float16"
    capsys.readouterr()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_asking_for_a_missing_gpu_is_a_clear_error_before_any_work(saved, tmp_path, capsys):
    for argv in (["importance", str(saved / "gpt2"), "--data", str(saved / "text.txt"), "--out", str(tmp_path / "i")],
                 ["analyze", str(saved / "gpt2"), "--source", str(saved / "text.txt"), "--out", str(tmp_path / "a")],
                 ["functions", str(saved / "gpt2"), "--conllu", str(saved / "tb.conllu"), "--out", str(tmp_path / "f")],
                 ["prune", "apply", str(saved / "gpt2"), "--heads", "dec_self:0:1", "--out", str(tmp_path / "p")],
                 ["nmt", "translate", "--model", str(saved / "marian"), "--input", str(saved / "text.txt")],
                 ["nmt", "evaluate", "--model", str(saved / "marian"), "--src", str(saved / "text.txt"), "--ref",
                  str(saved / "text.txt")],
                 ["lm", "evaluate", "--model", str(saved / "gpt2"), "--text", str(saved / "text.txt")]):
        assert main([*argv, "--device", "cuda:1"]) == 2
        assert "--device cuda:1: no CUDA device is available here" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
    assert main(["importance", str(saved / "gpt2"), "--data", str(saved / "text.txt"), "--out", str(tmp_path / "i"),
                 "--device", "cpu", "--device-map", "auto"]) == 2
    assert "--device or --device-map, not both" in capsys.readouterr().err


@CUDA
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_analyze_on_cuda_matches_the_cpu(saved, tmp_path, dtype):
    runs = {}
    for device in ("cpu", "cuda"):
        out = tmp_path / f"{device}-{dtype}"
        assert main(["analyze", str(saved / "gpt2"), "--source", str(saved / "text.txt"), "--conllu",
                     str(saved / "tb.conllu"), "--out", str(out), "--device", device, "--dtype", dtype,
                     "--skip", "figures", "--no-progress"]) == 0
        runs[device] = out
    tol = 1e-4 if dtype == "float32" else 5e-2
    for name in ("importance/confidence.json", "importance/lrp.json", "aggregate/mean_entropy.json"):
        cpu, gpu = (HeadScores.load(runs[d] / name)["dec_self"] for d in ("cpu", "cuda"))
        torch.testing.assert_close(torch.tensor(gpu), torch.tensor(cpu), atol=tol, rtol=tol)


@CUDA
def test_device_map_auto_puts_the_model_on_the_gpu(saved):
    for path in (saved / "marian", saved / "pruned"):
        model = load_model(str(path), device_map="auto")
        assert {p.device.type for p in model.parameters()} == {"cuda"}
        inputs = {k: v.to("cuda") for k, v in tiny_inputs("marian").items()}
        with torch.no_grad():
            assert torch.isfinite(model(**inputs).logits).all()


def test_prune_apply_writes_the_weights_in_the_dtype_it_says(saved, tmp_path, capsys):
    """--dtype of prune apply is the dtype of the written weights: applied, in config.json, and said
    (as is the float32 default that widens a float16 checkpoint)."""
    from safetensors import safe_open

    half = tmp_path / "half"
    load_model(str(saved / "gpt2"), dtype="float16").save_pretrained(half)
    cases = {(): ("float32", "in float32 (the default without --dtype; the checkpoint stores float16: --dtype "
                             "float16 keeps it)"),
             ("--dtype", "bfloat16"): ("bfloat16", "in bfloat16 (--dtype bfloat16; the checkpoint stores float16)"),
             ("--dtype", "float16"): ("float16", "in float16, as the checkpoint stores it")}
    for extra, (dtype, said) in cases.items():
        out = tmp_path / f"p-{dtype}"
        assert main(["prune", "apply", str(half), "--heads", "dec_self:0:1", "--out", str(out), *extra]) == 0
        assert f"saved to {out} {said}\n" in capsys.readouterr().out
        assert json.loads((out / "config.json").read_text())["dtype"] == dtype
        with safe_open(str(out / "model.safetensors"), framework="pt") as weights:
            stored = {weights.get_slice(name).get_dtype() for name in weights.keys()}
        assert stored == {{"float32": "F32", "bfloat16": "BF16", "float16": "F16"}[dtype]}
