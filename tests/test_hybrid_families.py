"""Hybrid models (issue 31): attention layers beside other token mixers. LFM2 (transformers'
``lfm2``) alternates gated short convolutions with grouped-query attention; headlab finds its
attention layers at run time, numbered by the model's layer index (1 and 3 here), and skips the
convolution layers (no heads: their rows of a score table are NaN). On a tiny LFM2 from its config:
capture equals ``output_attentions``, masking equals zeroing a key/value head's value weights,
physical pruning equals masking and reloads (``load_pruned``) to the same logits, ``analyze`` runs
end to end; LRP runs and conserves relevance through the convolutions (their B and C gates held constant: session 35,
tests/test_lrp_gated_short_conv.py; refused before any work until then).
"""

from __future__ import annotations

import json

import torch

from headlab import attention_blocks, capture_attention, load_pruned, mask_heads, prune_heads, save_pruned
from headlab.cli import main
from support.family_matrix import tiny_inputs, tiny_model

ATTENTION_LAYERS = (1, 3)


def _logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits


def test_attention_layers_only():
    model = tiny_model("lfm2")
    assert [(b.kind, b.layer, b.n_heads, b.n_kv_heads, b.d_head) for b in attention_blocks(model)] == \
        [("dec_self", layer, 4, 2, 8) for layer in ATTENTION_LAYERS]
    assert [b.name for b in attention_blocks(model)] == [f"model.layers.{i}.self_attn" for i in ATTENTION_LAYERS]


def test_capture_equals_output_attentions():
    inputs = tiny_inputs()  # the second sequence padded
    eager = tiny_model("lfm2", attn_implementation="eager")
    with torch.no_grad():
        reference = eager(**inputs, output_attentions=True).attentions
    assert len(reference) == len(ATTENTION_LAYERS)
    model = tiny_model("lfm2")  # sdpa
    with capture_attention(model) as record:
        _logits(model, inputs)
    assert sorted(record) == [("dec_self", layer) for layer in ATTENTION_LAYERS]
    for i, layer in enumerate(ATTENTION_LAYERS):
        assert torch.equal(record[("dec_self", layer)], reference[i]), layer


def test_masking_equals_zeroed_values():
    """Query heads 2 and 3 read key/value head 1 (groups of 2): masking them equals zeroing its values."""
    inputs = tiny_inputs()
    model = tiny_model("lfm2")
    before = _logits(model, inputs)
    with mask_heads(model, {("dec_self", 3): [2, 3]}):
        masked = _logits(model, inputs)
    assert torch.equal(_logits(model, inputs), before)
    with torch.no_grad():
        model.model.layers[3].self_attn.v_proj.weight[8:16] = 0
    reference = _logits(model, inputs)
    assert not torch.allclose(reference, before)
    torch.testing.assert_close(masked, reference, atol=1e-6, rtol=0)


def test_pruning_equals_masking_and_reloads(tmp_path):
    inputs = tiny_inputs()
    model = tiny_model("lfm2")
    spec = {("dec_self", 1): [0], ("dec_self", 3): [2, 3]}  # one query head of a group; a whole group
    with mask_heads(model, spec):
        masked = _logits(model, inputs)
    prune_heads(model, spec)  # checks itself against masking (padded probe, cached generation)
    assert [(b.layer, b.n_heads) for b in attention_blocks(model)] == [(1, 3), (3, 2)]
    pruned = _logits(model, inputs)
    keep = inputs["attention_mask"].bool()
    torch.testing.assert_close(pruned[keep], masked[keep], atol=1e-6, rtol=0)
    save_pruned(model, tmp_path / "lfm2")
    reloaded = load_pruned(tmp_path / "lfm2")
    assert torch.equal(_logits(reloaded, inputs), pruned)


def test_lrp_runs_through_the_convolutions_and_conserves():
    """Refused before any work until session 35 ("no rule for the gated short convolution Lfm2ShortConv")."""
    from headlab.importance import ImportanceData, compute_lrp, describe_model

    model = tiny_model("lfm2")
    record = compute_lrp(model, ImportanceData.from_ids([[5, 6, 7, 1], [9, 61, 4, 27, 1]]), describe_model(model),
                         bootstrap=0).signature["conservation"]
    assert record["n_outside"] == 0 and abs(record["with_biases"]["min"] - 1) < 1e-6
    assert abs(record["with_biases"]["max"] - 1) < 1e-6


def test_analyze_end_to_end(tmp_path, capsys):
    from support.treebank import SAMPLE_CONLLU, word_tokenizer

    texts = [line[len("# text = "):] for line in SAMPLE_CONLLU.splitlines() if line.startswith("# text = ")]
    words = [w for text in texts for w in text.split()]
    words += [line.split("\t")[1] for line in SAMPLE_CONLLU.splitlines() if line and line[0].isdigit()]
    tokenizer = word_tokenizer(words, style="gpt2")
    model = tiny_model("lfm2")
    model.config.pad_token_id = model.config.bos_token_id = model.config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(tmp_path / "lfm2")
    tokenizer.save_pretrained(tmp_path / "lfm2")
    (tmp_path / "text.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
    (tmp_path / "tb.conllu").write_text(SAMPLE_CONLLU, encoding="utf-8")
    out = tmp_path / "out"
    code = main(["analyze", str(tmp_path / "lfm2"), "--source", str(tmp_path / "text.txt"), "--conllu",
                 str(tmp_path / "tb.conllu"), "--out", str(out), "--skip", "figures", "--no-progress",
                 "--attention-sentences", "2", "--ablation"])
    err = capsys.readouterr().err
    stages = {s["name"]: s for s in json.loads((out / "manifest.json").read_text())["stages"]}
    for name in ("confidence", "gradient", "lrp", "ablation", "agreement", "functions", "aggregate", "table",
                 "attention", "report"):
        assert stages[name]["status"] == "done", (stages[name], err)
    assert code == 0  # LRP failed here until session 35 (no rule for the gated short convolutions)
    for measure in ("confidence", "gradient", "lrp", "ablation"):
        rows = json.loads((out / "importance" / f"{measure}.json").read_text())["scores"]["dec_self"]
        assert [all(v is None for v in row) for row in rows] == [True, False, True, False], measure  # conv: no heads
    # The model's profile (docs/functions.md's table) reads the analysis; its convolution layers have
    # no offset counts (a KeyError before).
    from headlab.pipeline.profiles import collect_profile, render_profiles

    profile = collect_profile(out, "lfm2")
    assert profile["kinds"]["dec_self"]["positional"]["previous_word"]["head"][0] in (1, 3)  # an attention layer
    assert "lfm2" in render_profiles([profile])
