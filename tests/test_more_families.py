"""The family matrix for analysis and masking beyond tests/support/models.py: GPT-NeoX (Pythia),
Phi-3, Phi-2, Falcon (grouped, multi-query, per-head with ALiBi), GPT-BigCode (StarCoder's
multi-query and the per-head layout), Bloom, MPT, ModernBERT, DeBERTa-v2, GPT-Neo, Megatron-BERT, GIT, RemBERT,
RoFormer, XGLM, MPNet, OpenAI GPT (GPT-1), TrOCR's text decoder, I-BERT (quant_mode=False), LUKE (on words: headlab
gives no entity) and GPT-NeoX-Japanese; and the families headlab refuses, refused before any work, once.

On each supported family: the blocks have the config's head counts, capture equals
transformers' own ``output_attentions`` (eager), the streamed chunks equal it too, masking the
query heads of a key/value head equals zeroing that head's value weights by hand (the layouts of
tests/support/family_matrix.py, read off the modeling code, not headlab's tables), gates at one
change nothing, the fused layouts' value columns are the ones the reference zeroes, and the LRP
rules conserve relevance on a bias-free copy. Physical pruning equals masking on every layout;
a block surgery cannot slice (DeBERTa-v2's own position projections) is refused before any change.
"""

from __future__ import annotations

import re

import pytest
import torch
from transformers.pytorch_utils import Conv1D

from headlab import HeadlabError, attention_blocks, capture_attention
from headlab.cli import main
from support.family_matrix import ANALYSED as CONFIGS
from support.family_matrix import ANALYSIS_FAMILIES as FAMILIES
from support.family_matrix import (
    ANALYZE_STAGES,
    ENCODERS,
    REFUSED,
    VALUES,
    analyze,
    check_capture_equals_output_attentions,
    check_gates_at_one_change_nothing,
    check_head_counts,
    check_lrp_conserves,
    check_masking_equals_zeroed_values,
    check_pruning_equals_masking,
    check_streamed_chunks_equal_capture,
    save_tiny,
    tiny_inputs,
    tiny_model,
    treebank_files,
)
from support.family_matrix import logits as _logits

EAGER_ADDS_ALIBI_TWICE = {"falcon_alibi"}  # refused when loaded eager (headlab.adapters.eager_alibi)


def _kind(family: str) -> str:
    return "enc_self" if family in ENCODERS else "dec_self"


def _build(family: str):
    return lambda **kwargs: tiny_model(family, **kwargs)


@pytest.mark.parametrize("family", FAMILIES)
def test_blocks_have_the_configs_head_counts(family):
    check_head_counts(tiny_model(family), _kind(family), VALUES[family][2])


@pytest.mark.parametrize("family", FAMILIES)
def test_capture_equals_output_attentions(family):
    # the second sequence is padded; sdpa where the family has it
    if family in EAGER_ADDS_ALIBI_TWICE:
        pytest.skip("transformers' eager output_attentions add ALiBi twice: tests/test_falcon_alibi_eager.py")
    model, record = check_capture_equals_output_attentions(_build(family), _kind(family), tiny_inputs())
    assert torch.all(record[(_kind(family), 0)][1, :, :5, 5:] == 0)  # padded keys get no attention
    assert model.config._attn_implementation == tiny_model(family).config._attn_implementation  # restored


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_chunks_equal_eager_capture(family):
    model = tiny_model(family, attn_implementation="sdpa" if family in EAGER_ADDS_ALIBI_TWICE else "eager")
    inputs = tiny_inputs(length=8)
    reference = _logits(model, inputs)
    with capture_attention(model) as record:
        _logits(model, inputs)
    out = check_streamed_chunks_equal_capture(model, inputs, record)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_masking_equals_zeroed_values(family):
    """Masking every query head that reads key/value head j equals zeroing j's values."""
    check_masking_equals_zeroed_values(_build(family), _kind(family), VALUES[family], tiny_inputs())


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
    width = block.qkv.nf if isinstance(block.qkv, Conv1D) else block.qkv.weight.shape[0]  # Conv1D: [in, out]
    assert sorted(torch.cat([q, k, v]).tolist()) == list(range(width))


@pytest.mark.parametrize("family", FAMILIES)
def test_gates_at_one_change_nothing(family):
    check_gates_at_one_change_nothing(tiny_model(family), tiny_inputs())


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
    save_tiny(model, path, words, style)


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


@pytest.mark.parametrize("family", ["gpt_neox", "falcon", "mpt", "modernbert", "deberta-v2", "gpt_neo", "megatron-bert", "git",
                                    "rembert", "roformer", "xglm", "mpnet", "openai-gpt", "trocr", "ibert", "luke",
                                    "gpt_neox_japanese"])
def test_analyze_end_to_end(family, tmp_path, capsys):
    """Every stage on a decoder (GPT-NeoX), two without the attention interface (Falcon; MPT, whose model
    hands its attention create_causal_mask(...).to(torch.bool), which capture must leave a mask), an
    encoder with local layers (ModernBERT, whose forward reads its layers' attention_type: the
    ablation's stand-in layers must answer) and one whose core returns probabilities only when
    asked (DeBERTa-v2); GPT-Neo (nested attention, local layers), Megatron-BERT and GIT (an idle image encoder);
    RemBERT, RoFormer (rotary positions inside its attention) and XGLM; MPNet (a position bias shared by its layers,
    probabilities only when asked) and GPT-1 (a list for an output); I-BERT (quant_mode=False: (value, scaling
    factor) pairs everywhere); LUKE (an entity stream beside the words, which headlab's inputs leave out);
    GPT-NeoX-Japanese (a bias its last layer's attention returns for the layer to add)."""
    _save(tiny_model(family), tmp_path / family, treebank_files(tmp_path), "bert" if family in ENCODERS else "gpt2")
    code, stages = analyze(tmp_path / family, tmp_path)
    assert code == 0, capsys.readouterr().err
    for name in ANALYZE_STAGES:
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
    model = tiny_model(family)
    # the first layer token ids run (GIT's image encoder comes first, idle): the path up to the layer's number
    # (GPT-Neo's attention nests one deeper, transformer.h.0.attn.attention)
    block = next(b for b in attention_blocks(model) if not b.idle)
    first = re.match(r"(.*?\.\d+)(?:\.|$)", block.name).group(1)
    check_lrp_conserves(model, model.get_submodule(first))


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
    check_pruning_equals_masking(tiny_model(family), _kind(family), tiny_inputs())


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
