"""The family matrix for analysis and masking beyond tests/support/models.py: GPT-NeoX (Pythia),
Phi-3, Phi-2, Falcon (grouped, multi-query, per-head with ALiBi), GPT-BigCode (StarCoder's
multi-query and the per-head layout), Bloom, ModernBERT and DeBERTa-v2; and the families headlab
refuses, refused before any work, once.

On each supported family: the blocks have the config's head counts, capture equals
transformers' own ``output_attentions`` (eager), the streamed chunks equal it too, masking the
query heads of a key/value head equals zeroing that head's value weights by hand (the layouts of
tests/support/family_matrix.py, read off the modeling code, not headlab's tables), gates at one
change nothing, the fused layouts' value columns are the ones the reference zeroes, and the LRP
rules conserve relevance on a bias-free copy. Physical pruning equals masking on every layout;
a block surgery cannot slice (DeBERTa-v2's own position projections) is refused before any change.
"""

from __future__ import annotations

import json

import pytest
import torch

from headlab import HeadlabError, ScalarGates, attention_blocks, capture_attention, gates_attached, mask_heads
from headlab.capture import stream_attention
from headlab.cli import main
from support.family_matrix import ANALYSED as CONFIGS
from support.family_matrix import ANALYSIS_FAMILIES as FAMILIES
from support.family_matrix import ENCODERS, REFUSED, VALUES, tiny_inputs, tiny_model


def _kind(family: str) -> str:
    return "enc_self" if family in ENCODERS else "dec_self"


def _logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_blocks_have_the_configs_head_counts(family):
    model = tiny_model(family)
    blocks = attention_blocks(model)
    n_kv = VALUES[family][2]
    assert [(b.kind, b.layer, b.n_heads, b.n_kv_heads, b.d_head) for b in blocks] == \
        [(_kind(family), 0, 4, n_kv, 8), (_kind(family), 1, 4, n_kv, 8)]


@pytest.mark.parametrize("family", FAMILIES)
def test_capture_equals_output_attentions(family):
    eager = tiny_model(family, attn_implementation="eager")
    inputs = tiny_inputs()  # the second sequence is padded
    with torch.no_grad():
        reference = eager(**inputs, output_attentions=True).attentions
    model = tiny_model(family)  # sdpa where the family has it
    with capture_attention(model) as record:
        _logits(model, inputs)
    assert set(record) == {(_kind(family), 0), (_kind(family), 1)}
    for (_, layer), probs in record.items():
        assert torch.equal(probs, reference[layer]), layer
    assert torch.all(record[(_kind(family), 0)][1, :, :5, 5:] == 0)  # padded keys get no attention
    assert model.config._attn_implementation == tiny_model(family).config._attn_implementation  # restored


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_chunks_equal_eager_capture(family):
    model = tiny_model(family, attn_implementation="eager")
    inputs = tiny_inputs(length=8)
    reference = _logits(model, inputs)
    with capture_attention(model) as record:
        _logits(model, inputs)
    chunks: dict = {}
    with stream_attention(model, lambda block, chunk: chunks.setdefault(block.key, []).append(chunk), query_chunk=3):
        out = _logits(model, inputs)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=0)
    for key, probs in record.items():
        torch.testing.assert_close(torch.cat([c.full() for c in chunks[key]], 2), probs.float(), atol=1e-6, rtol=0)


def _zero_values(model, family: str, layer: int, kv_head: int) -> None:
    """Zero key/value head ``kv_head``'s value weights and biases in place: its heads then output 0."""
    module_of, rows, _ = VALUES[family]
    module = module_of(model, layer)
    index = torch.tensor(list(rows(kv_head)))
    with torch.no_grad():
        module.weight[index] = 0
        if module.bias is not None:
            module.bias[index] = 0


@pytest.mark.parametrize("family", FAMILIES)
def test_masking_equals_zeroed_values(family):
    """Masking every query head that reads key/value head j equals zeroing j's values."""
    inputs = tiny_inputs()
    n_kv = VALUES[family][2]
    group = 4 // n_kv
    for kv_head in range(n_kv):
        model = tiny_model(family)
        before = _logits(model, inputs)
        heads = list(range(kv_head * group, (kv_head + 1) * group))
        with mask_heads(model, {(_kind(family), 1): heads}):
            masked = _logits(model, inputs)
        assert torch.equal(_logits(model, inputs), before)  # the mask came off
        _zero_values(model, family, 1, kv_head)
        reference = _logits(model, inputs)
        assert not torch.allclose(reference, before)
        torch.testing.assert_close(masked, reference, atol=1e-6, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_value_columns_of_the_fused_layout(family):
    """headlab's idea of the fused layout is the modeling code's: the value columns the
    reference zeroes, head by head."""
    model = tiny_model(family)
    block = attention_blocks(model)[1]
    if block.qkv is None:
        pytest.skip("separate projections")
    _, rows, n_kv = VALUES[family]
    q, k, v = block.qkv_columns()
    assert v.tolist() == [r for j in range(n_kv) for r in rows(j)]
    assert sorted(torch.cat([q, k, v]).tolist()) == list(range(block.qkv.weight.shape[0]))


@pytest.mark.parametrize("family", FAMILIES)
def test_gates_at_one_change_nothing(family):
    model, inputs = tiny_model(family), tiny_inputs()
    before = _logits(model, inputs)
    with gates_attached(model, ScalarGates.for_model(model)):
        assert torch.equal(_logits(model, inputs), before)
    assert all(not b.o._forward_pre_hooks for b in attention_blocks(model))


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_refused_families_say_what_is_missing(family):
    with pytest.raises(HeadlabError, match="is not supported: .{40,}"):
        attention_blocks(tiny_model(family, attn_implementation="eager"))


def test_bloom_slow_but_exact_is_refused():
    cls, config = CONFIGS["bloom"]()
    config.pretraining_tp, config.slow_but_exact = 2, True
    with pytest.raises(HeadlabError, match="slow_but_exact"):
        attention_blocks(cls(config))


def _save(model, path, words=("the", "a", "cat", "dog", "sat", "on", "mat", "ran"), style="gpt2"):
    from support.treebank import word_tokenizer

    tokenizer = word_tokenizer(list(words), style=style)
    for name in ("pad", "bos", "eos", "cls", "sep"):  # the config's special ids are the tokenizer's
        if getattr(model.config, f"{name}_token_id", None) is not None:
            setattr(model.config, f"{name}_token_id", getattr(tokenizer, f"{name}_token_id", None) or 0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def test_analyze_refuses_an_unsupported_model_once_before_any_work(tmp_path, capsys):
    """One error naming what is missing, exit 2, no stage run and no --out written."""
    _save(tiny_model("deberta", attn_implementation="eager"), tmp_path / "deberta")
    (tmp_path / "text.txt").write_text("the cat sat\n", encoding="utf-8")
    code = main(["analyze", str(tmp_path / "deberta"), "--source", str(tmp_path / "text.txt"),
                 "--out", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("is not supported") == 1 and "talking-head" in err
    assert "running" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", [["importance", "--data", "{text}", "--out", "{out}"],
                                     ["functions", "--conllu", "{conllu}", "--out", "{out}"],
                                     ["heads"]])
def test_other_commands_refuse_before_work(command, tmp_path, capsys):
    from support.treebank import SAMPLE_CONLLU

    _save(tiny_model("whisper", attn_implementation="eager"), tmp_path / "whisper")
    (tmp_path / "text.txt").write_text("the cat sat\n", encoding="utf-8")
    (tmp_path / "tb.conllu").write_text(SAMPLE_CONLLU, encoding="utf-8")
    args = [a.format(text=tmp_path / "text.txt", out=tmp_path / "out", conllu=tmp_path / "tb.conllu")
            for a in command]
    code = main([args[0], str(tmp_path / "whisper"), *args[1:]])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("is not supported") == 1 and "audio" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family", ["gpt_neox", "falcon", "modernbert", "deberta-v2"])
def test_analyze_end_to_end(family, tmp_path, capsys):
    """Every stage on a decoder (GPT-NeoX), one without the attention interface (Falcon), an
    encoder with local layers (ModernBERT, whose forward reads its layers' attention_type: the
    ablation's stand-in layers must answer) and one whose core returns probabilities only when
    asked (DeBERTa-v2)."""
    from support.treebank import SAMPLE_CONLLU

    texts = [line[len("# text = "):] for line in SAMPLE_CONLLU.splitlines() if line.startswith("# text = ")]
    words = [w for text in texts for w in text.split()]
    words += [line.split("\t")[1] for line in SAMPLE_CONLLU.splitlines() if line and line[0].isdigit()]
    _save(tiny_model(family), tmp_path / family, words, "bert" if family in ENCODERS else "gpt2")
    (tmp_path / "text.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
    (tmp_path / "tb.conllu").write_text(SAMPLE_CONLLU, encoding="utf-8")
    out = tmp_path / "out"
    code = main(["analyze", str(tmp_path / family), "--source", str(tmp_path / "text.txt"), "--conllu",
                 str(tmp_path / "tb.conllu"), "--out", str(out), "--skip", "figures", "--no-progress",
                 "--attention-sentences", "2", "--ablation"])
    stages = {s["name"]: s for s in json.loads((out / "manifest.json").read_text())["stages"]}
    assert code == 0, capsys.readouterr().err
    for name in ("confidence", "gradient", "ablation", "agreement", "functions", "aggregate", "table", "attention",
                 "report"):
        assert stages[name]["status"] == "done", stages[name]


def _deberta_v2_with_position_projections():
    """DeBERTa-v2 without share_att_key: pos_key_proj/pos_query_proj, which pruning does not slice."""
    cls, config = CONFIGS["deberta-v2"]()
    config.share_att_key, config._attn_implementation = False, "eager"
    torch.manual_seed(0)
    return cls(config).eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_lrp_conserves_relevance_on_a_bias_free_model(family):
    """On a model without biases the LRP rules conserve relevance exactly (rules.py): what reaches
    the first layer's input sums to the explained logit. Catches a fused layout whose query/key
    columns are not the ones detached, an activation without its rule (Bloom's BloomGelu) and
    Phi-3's fused [gate | up] product."""
    from headlab.capture import eager_attention
    from headlab.importance.rules import lrp_rules

    model = tiny_model(family)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.zero_()
        for module in model.modules():  # weights of unit gain, so that no branch is too small to count
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0, module.in_features ** -0.5)
    first = attention_blocks(model)[0].name.rsplit(".", 1)[0]  # the first layer
    seen = []

    def keep(module, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        seen.append(x)

    handle = model.get_submodule(first).register_forward_pre_hook(keep, with_kwargs=True)
    try:
        with torch.enable_grad(), eager_attention(model), lrp_rules(model):
            out = model(**tiny_inputs(batch=1)).logits
            target = out[0, -1].argmax()
            grad, = torch.autograd.grad(out[0, -1, target], seen[0])
    finally:
        handle.remove()
    total = (seen[0].detach() * grad).sum()
    torch.testing.assert_close(total, out[0, -1, target].detach(), rtol=1e-4, atol=1e-5)


def test_prune_refuses_an_unsliceable_block_before_loading(tmp_path, capsys, monkeypatch):
    """`headlab prune` on a DeBERTa-v2 with its own position projections: one error, exit 2, before
    the weights load; nothing written. (GPT-NeoX, refused here before its fused layout was sliced,
    is pruned in tests/test_prune_fused.py.)"""
    import headlab.loading

    _save(_deberta_v2_with_position_projections(), tmp_path / "deberta", style="bert")
    monkeypatch.setattr(headlab.loading, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    code = main(["prune", str(tmp_path / "deberta"), "--heads", "enc_self:0:1", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("physical pruning does not slice its position projections") == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family", FAMILIES)
def test_physical_pruning_equals_masking(family):
    """Every layout is sliced (separate q/k/v; fused [q | k | v] of equal or grouped widths, per
    head, grouped): the pruned model's logits equal the masked model's on a padded batch.
    Generation, reloading and plain transformers: tests/test_prune_fused.py."""
    from headlab import prune_heads

    model, inputs = tiny_model(family), tiny_inputs()
    spec = {(_kind(family), 0): [1], (_kind(family), 1): [0, 2]}
    with mask_heads(model, spec):
        masked = _logits(model, inputs)
    prune_heads(model, spec)
    assert [b.n_heads for b in attention_blocks(model)] == [3, 2]
    torch.testing.assert_close(_logits(model, inputs), masked, atol=1e-6, rtol=0)


def test_deberta_v2_with_its_own_position_projections_is_not_pruned():
    """Without share_att_key, DeBERTa-v2 projects relative positions per head with pos_key_proj and
    pos_query_proj, which pruning does not slice (the pruned forward crashed): refused, unchanged."""
    from headlab import prune_heads

    model, inputs = _deberta_v2_with_position_projections(), tiny_inputs()
    before = _logits(model, inputs)
    with pytest.raises(HeadlabError, match="pos_key_proj, pos_query_proj"):
        prune_heads(model, {("enc_self", 0): [1]})
    assert torch.equal(_logits(model, inputs), before)


def test_analyze_with_prune_refuses_an_unsliceable_block_before_any_work(tmp_path, capsys):
    """analyze --prune ends in a physical prune: refused at the start, not after the sweep trained."""
    _save(_deberta_v2_with_position_projections(), tmp_path / "deberta", style="bert")
    (tmp_path / "text.txt").write_text("the cat sat\n", encoding="utf-8")
    code = main(["analyze", str(tmp_path / "deberta"), "--source", str(tmp_path / "text.txt"), "--target",
                 str(tmp_path / "text.txt"), "--prune", "--out", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("physical pruning does not slice its position projections") == 1
    assert not (tmp_path / "out").exists()
