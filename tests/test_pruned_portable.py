"""Pruned directories load with plain transformers, in a process that cannot import headlab
(issue 15, item 8): a standard config where every layer keeps the same heads and the family's
config can say so (Llama-like), else ``trust_remote_code=True`` with the module saved beside
the weights. Outputs must equal the pruned model's in memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from headlab import attention_blocks, load_pruned, mask_heads, prune_heads, save_pruned
from headlab.loading import load_model
from headlab.portable import CODE_FILE, module_code
from support import family_matrix as matrix
from support.models import tiny_inputs, tiny_model
from support.seq2seq_families import cached_generation, heads_left, seq2seq_inputs

ROOT = Path(__file__).resolve().parents[1]
_T5 = dict(vocab_size=99, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
           relative_attention_max_distance=16, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)

# (family, heads to remove, Auto class, how the directory loads without headlab)
CASES = {
    "marian": ({("enc_self", 0): [1, 2], ("dec_self", 1): [3], ("dec_cross", 1): [0, 1, 2, 3]},
               "AutoModelForSeq2SeqLM", "remote code"),  # a cross-attention layer with no head left
    "bart": ({("enc_self", 1): [0], ("dec_cross", 0): [2, 3]}, "AutoModelForSeq2SeqLM", "remote code"),
    "bert": ({("enc_self", 0): [0], ("enc_self", 1): [1, 2]}, "AutoModelForMaskedLM", "remote code"),
    "roberta": ({("enc_self", 0): [0, 1]}, "AutoModelForMaskedLM", "remote code"),
    "distilbert": ({("enc_self", 1): [3]}, "AutoModelForMaskedLM", "remote code"),
    "gpt2": ({("dec_self", 0): [0, 3], ("dec_self", 1): [1]}, "AutoModelForCausalLM", "remote code"),
    "llama": ({("dec_self", 0): [0, 1], ("dec_self", 1): [2, 3]}, "AutoModelForCausalLM", "standard config"),
    "llama-mixed": ({("dec_self", 0): [0], ("dec_self", 1): [1, 2, 3]}, "AutoModelForCausalLM", "remote code"),
    # the same count everywhere, but 3 heads do not divide the width: LlamaConfig refuses that standard config
    "llama-indivisible": ({("dec_self", 0): [0], ("dec_self", 1): [2]}, "AutoModelForCausalLM", "remote code"),
    "qwen2": ({("dec_self", 0): [0, 1], ("dec_self", 1): [0, 1]}, "AutoModelForCausalLM", "standard config"),
    # fused q/k/v layouts (tests/support/family_matrix.py): GPT-NeoX's weight renaming (embed_out), Phi-3's
    # per-layer config view, Bloom's and Falcon's ALiBi hook, Bloom's residual in a layer with no head left
    "gpt_neox": ({("dec_self", 0): [1], ("dec_self", 1): [0, 2]}, "AutoModelForCausalLM", "remote code"),
    "phi3": ({("dec_self", 0): [1], ("dec_self", 1): [0, 1]}, "AutoModelForCausalLM", "remote code"),
    "bloom": ({("dec_self", 0): [0, 1, 2, 3], ("dec_self", 1): [2]}, "AutoModelForCausalLM", "remote code"),
    "falcon_alibi": ({("dec_self", 0): [3], ("dec_self", 1): [0, 1]}, "AutoModelForCausalLM", "remote code"),
    "gpt_bigcode": ({("dec_self", 1): [1, 2]}, "AutoModelForCausalLM", "remote code"),
    # q_norm/k_norm over the whole projections: q and k kept whole, the heads selected after the norms; a layer
    # left with no head beside it
    "olmo2": ({("dec_self", 0): [1], ("dec_self", 1): [0, 1, 2, 3]}, "AutoModelForCausalLM", "remote code"),
    # one position bias table per stack, in its first layer: sliced per layer by pruned_heads.py's hooks, the
    # decoder's first layer with no head left
    "t5": ({("enc_self", 0): [0], ("enc_self", 1): [1, 3], ("dec_self", 0): [0, 1, 2, 3], ("dec_cross", 1): [2]},
           "AutoModelForSeq2SeqLM", "remote code"),
}
MATRIX = {"gpt_neox", "phi3", "bloom", "falcon_alibi", "gpt_bigcode", "olmo2"}
GENERATE = {"marian", "t5", "gpt2", "llama", "gpt_neox", "bloom", "olmo2"}

PLAIN = r"""
import json, os, sys
sys.modules["headlab"] = None  # this process cannot import headlab
import torch, transformers
results = {}
for name, (directory, auto) in json.loads(sys.argv[1]).items():
    check = torch.load(f"{directory}/check.pt")
    remote = os.path.exists(f"{directory}/pruned_heads.py")
    model = getattr(transformers, auto).from_pretrained(
        directory, trust_remote_code=remote, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(**check["inputs"]).logits
        row = {"class": type(model).__name__, "diff": (logits - check["logits"]).abs().max().item()}
        if "generated" in check:
            generated = model.generate(input_ids=check["inputs"]["input_ids"][:1], max_new_tokens=6, do_sample=False,
                                       num_beams=1)
            row["generated"] = generated.tolist() == check["generated"].tolist()
    results[name] = row
assert "headlab" not in {m.split(".")[0] for m in sys.modules if sys.modules[m] is not None}
print("RESULTS " + json.dumps(results))
"""


@pytest.fixture(scope="module")
def pruned_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("portable")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dirs = {}
    for name, (spec, auto, _) in CASES.items():
        family = name.split("-")[0]
        build = matrix.tiny_model if family in MATRIX else tiny_model
        model = build(family, attn_implementation="eager")
        prune_heads(model, spec)
        directory = root / name
        save_pruned(model, directory)
        inputs = dict(matrix.tiny_inputs() if family in MATRIX else tiny_inputs(family))
        check = {"inputs": inputs}
        with torch.no_grad():
            check["logits"] = model(**inputs).logits
            if family in GENERATE:
                check["generated"] = model.generate(input_ids=inputs["input_ids"][:1], max_new_tokens=6,
                                                    do_sample=False, num_beams=1)
        torch.save(check, directory / "check.pt")
        dirs[name] = (str(directory), auto)
    torch.set_num_threads(threads)
    return dirs


def test_plain_transformers_loads_every_pruned_family_without_headlab(pruned_dirs, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", PLAIN, json.dumps(pruned_dirs)], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.split("RESULTS ", 1)[1])
    for name, (_, _, how) in CASES.items():
        row = results[name]
        assert row["diff"] <= 1e-6, (name, row)
        assert row.get("generated", True), (name, row)
        assert (row["class"] == "PrunedModel") == (how == "remote code"), (name, row)


def test_how_each_directory_loads_is_recorded_and_headlab_still_loads_it(pruned_dirs):
    for name, (directory, _) in pruned_dirs.items():
        record = json.loads(Path(directory, "headlab_pruning.json").read_text())
        assert record["portable"]["how"] == CASES[name][2], name
        config = json.loads(Path(directory, "config.json").read_text())
        code = os.path.join(directory, CODE_FILE)
        if CASES[name][2] == "standard config":
            assert not os.path.exists(code) and "auto_map" not in config and "headlab_pruned" not in config
            assert config["num_attention_heads"] == 2 and config["head_dim"] == 8
        else:
            text = Path(code).read_text()
            assert not [line for line in text.splitlines() if line.startswith(("import headlab", "from headlab"))]
            assert "auto_map" in config and config["headlab_pruned"]["projections"]
        check = torch.load(f"{directory}/check.pt")
        model = load_pruned(directory)  # headlab itself never runs the directory's code
        model.set_attn_implementation("eager")
        model.config._attn_implementation = "eager"  # Falcon cannot switch through set_attn_implementation
        with torch.no_grad():
            assert torch.allclose(model(**check["inputs"]).logits, check["logits"], atol=1e-6), name


T5_STACKS = {  # T5's layout: one relative position bias table per stack, in its first layer
    "t5": lambda: (transformers.T5ForConditionalGeneration, transformers.T5Config(**_T5)),
    "mt5": lambda: (transformers.MT5ForConditionalGeneration, transformers.MT5Config(**_T5)),
    "switch_transformers": lambda: (transformers.SwitchTransformersForConditionalGeneration,
                                    transformers.SwitchTransformersConfig(
                                        **_T5, num_decoder_layers=2, num_sparse_encoder_layers=1,
                                        num_sparse_decoder_layers=1, num_experts=2)),
    # the local encoder's table in LocalSelfAttention, its bias blocked (blocks of 3: the 7 source tokens in 3 blocks)
    "longt5": lambda: (transformers.LongT5ForConditionalGeneration, transformers.LongT5Config(
        **_T5, num_decoder_layers=2, local_radius=2, encoder_attention_type="local")),
}
T5_SPECS = {  # the first layers (the tables') lose heads; layers with no head left in each kind
    "first layers pruned": {("enc_self", 0): [1, 2], ("enc_self", 1): [0, 1, 2, 3], ("dec_self", 0): [3],
                            ("dec_self", 1): [0, 1, 2, 3], ("dec_cross", 0): [0, 1, 2, 3], ("dec_cross", 1): [2]},
    "first layers emptied": {("enc_self", 0): [0, 1, 2, 3], ("enc_self", 1): [2], ("dec_self", 0): [0, 1, 2, 3],
                             ("dec_self", 1): [0, 2], ("dec_cross", 1): [0, 1, 2, 3]},
}


@pytest.mark.parametrize("spec_name", T5_SPECS)
@pytest.mark.parametrize("family", T5_STACKS)
def test_a_pruned_t5_loads_with_plain_transformers(family, spec_name, tmp_path):
    """T5, mT5, Switch Transformers and local LongT5 (one position bias table per stack, in its first layer, the other
    layers handed its bias of every head; LongT5's encoder's blocked): pruned_heads.py hands each pruned layer its kept
    heads' columns of the bias computed from the first layer's table, as headlab's hooks do, and a first layer with no
    head left keeps the table.
    Plain transformers' load (trust_remote_code, every weight loaded) equals the pruned model, and headlab's load, in
    float64 to 1e-12: the logits of a padded batch and generate()'s cached greedy steps (tokens and scores); so do
    both loads of the directory transformers re-saves. Until session 33 such a directory was headlab's only (the
    record said why)."""
    cls, config = T5_STACKS[family]()
    model = matrix.perturbed_model(cls, config, attn_implementation="eager").double()
    inputs, spec = seq2seq_inputs(pad=0), T5_SPECS[spec_name]
    with mask_heads(model, spec):
        expected = matrix.logits(model, inputs)
        tokens, scores = cached_generation(model, inputs)
    prune_heads(model, spec)
    counts = {b.key: b.n_heads for b in attention_blocks(model)}
    assert counts == heads_left(spec)
    torch.testing.assert_close(matrix.logits(model, inputs), expected, atol=1e-12, rtol=0)
    save_pruned(model, tmp_path / "pruned")
    record = json.loads((tmp_path / "pruned" / "headlab_pruning.json").read_text())
    assert record["portable"]["how"] == "remote code"
    plan = json.loads((tmp_path / "pruned" / "config.json").read_text())["headlab_pruned"]
    encoder_core = "LocalSelfAttention" if family == "longt5" else "SelfAttention"
    table = {"encoder": f"encoder.block.0.layer.0.{encoder_core}", "decoder": "decoder.block.0.layer.0.SelfAttention"}
    assert {path: source for path, (_, source, _) in plan["shared_bias"].items()} == {
        path: table[path.split(".")[0]] for path in plan["shared_bias"]}
    plain, info = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "pruned", trust_remote_code=True,
                                                                     output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert type(plain).__name__ == "PrunedModel"
    # re-saved by transformers (fine-tuning's save_pretrained): config.json keeps the plan, for both loaders
    plain.save_pretrained(tmp_path / "resaved")
    resaved = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "resaved", trust_remote_code=True)
    for loaded in (plain.eval().double(), load_pruned(tmp_path / "pruned").double(), resaved.eval().double(),
                   load_model(str(tmp_path / "resaved"), dtype=torch.float64)):
        torch.testing.assert_close(matrix.logits(loaded, inputs), expected, atol=1e-12, rtol=0)
        loaded_tokens, loaded_scores = cached_generation(loaded, inputs)
        assert torch.equal(loaded_tokens, tokens)
        torch.testing.assert_close(loaded_scores, scores, atol=1e-12, rtol=0)


@pytest.mark.parametrize("directory", sorted(ROOT.glob(f"models/*/{CODE_FILE}")), ids=lambda path: path.parent.name)
def test_bundled_pruned_models_ship_the_current_module(directory):
    """A bundled pruned model's copy of the module is headlab's current one (with its class): an old
    copy would keep a bug fixed since, e.g. the key/value cache read under transformers' old name."""
    base = json.loads((directory.parent / "config.json").read_text())["architectures"][0]
    assert directory.read_text(encoding="utf-8") == module_code(base)


def test_the_module_needs_no_package_beyond_torch_and_transformers(tmp_path):
    """transformers' check_imports refuses to load remote code that imports, outside a try, a package that is not
    installed: pruned_heads.py imported peft (for peft_from_pretrained) and accelerate (for an offloaded T5 table)
    so, and a pruned model did not load with plain transformers without them ("This modeling file requires ...:
    peft"; found in session 43 on a venv without peft). Now only torch, transformers and the standard library."""
    from transformers.dynamic_module_utils import get_imports

    code = tmp_path / CODE_FILE
    code.write_text(module_code("LlamaForCausalLM"), encoding="utf-8")
    assert set(get_imports(code)) - set(sys.stdlib_module_names) == {"torch", "transformers"}


def test_a_pruned_stablelm_with_per_head_norms_says_it_needs_headlab(tmp_path):
    """StableLM with ``qk_layernorm`` keeps one LayerNorm per head in a list that the shipped module does
    not resize (a query head of a key/value group removed also gives the kept heads their own key/value
    copies: 3 key norms where the config builds 2). The directory says so (record, how_to_load, README),
    headlab's loader gives the pruned model's logits exactly, and plain transformers refuses the
    weights' shapes instead of loading a wrong model."""
    import transformers

    from headlab.portable import how_to_load

    model = matrix.tiny_model("stablelm-qk-norm", attn_implementation="eager")
    prune_heads(model, {("dec_self", 0): [1], ("dec_self", 1): [0, 1]})
    save_pruned(model, tmp_path / "stablelm")
    record = json.loads((tmp_path / "stablelm" / "headlab_pruning.json").read_text())
    assert record["portable"]["how"] is None and "qk_layernorm" in record["portable"]["reason"]
    assert not (tmp_path / "stablelm" / CODE_FILE).exists()
    assert "auto_map" not in json.loads((tmp_path / "stablelm" / "config.json").read_text())
    assert how_to_load(model, record["portable"]).startswith("Load with `headlab.load_pruned('path')` (per-head")
    inputs = matrix.tiny_inputs()
    with torch.no_grad():
        expected = model(**inputs).logits
        loaded = load_pruned(tmp_path / "stablelm")
        loaded.config._attn_implementation = "eager"
        assert torch.equal(loaded(**inputs).logits, expected)
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "stablelm")
