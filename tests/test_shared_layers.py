"""Shared layers (ALBERT, issue 31): one attention module run at several depths. A block is one
depth (one application of the module, numbered in forward order as transformers'
``output_attentions`` lists them), and everything headlab does to a head acts at that depth only.

Tiny ALBERTs from tests/support/family_matrix.py (``SHARED``): one module at three depths, and two
groups of two layers over four depths (eight maps). References of their own: transformers'
``output_attentions``; masking checked against zeroing the head's values at that one call of the
value projection (a hand-written hook counting its calls); the gradient against a hand-written
gate at that call; ablation against one masked pass per head; LRP's conservation (relevance at the
first depth's input, with and without biases). Physical pruning (slicing shared weights removes a
head at every depth) takes a plan that removes the same heads at every depth of the module and refuses
any other before any work (tests/test_tied_pruning.py); ``prune train`` ties the gates of those depths.
"""

from __future__ import annotations

import json

import pytest
import torch

from headlab import HeadlabError, attention_blocks, capture_attention, mask_heads
from headlab.cli import main
from support.family_matrix import (
    ANALYZE_STAGES,
    SHARED,
    analyze,
    check_capture_equals_output_attentions,
    check_gates_at_one_change_nothing,
    check_head_counts,
    check_lrp_conserves,
    check_streamed_chunks_equal_capture,
    tiny_inputs,
    tiny_model,
    treebank_files,
)
from support.family_matrix import logits as _logits

FAMILIES = tuple(SHARED)
DEPTHS = {"albert": 3, "albert-groups": 8}
MODULE_OF_DEPTH = {  # (group, layer in group) run at each depth, read off AlbertTransformer.forward by hand
    "albert": [(0, 0)] * 3,
    "albert-groups": [(0, 0), (0, 1), (0, 0), (0, 1), (1, 0), (1, 1), (1, 0), (1, 1)],
}


def _attention(model, group: int, layer: int):
    return model.albert.encoder.albert_layer_groups[group].albert_layers[layer].attention


def test_blocks_are_depths():
    for family in FAMILIES:
        model = tiny_model(family)
        blocks = check_head_counts(model, "enc_self", 4, DEPTHS[family])
        for block, (group, layer) in zip(blocks, MODULE_OF_DEPTH[family]):
            assert block.core is _attention(model, group, layer)
            assert block.shared and block.scope is model.albert.encoder
        # the i-th application of its module, in forward order
        modules = [(g, j) for g, j in MODULE_OF_DEPTH[family]]
        assert [b.application for b in blocks] == [modules[:i].count(m) for i, m in enumerate(modules)]


@pytest.mark.parametrize("family", FAMILIES)
def test_capture_equals_output_attentions(family):
    inputs = tiny_inputs()  # the second sequence padded
    model, record = check_capture_equals_output_attentions(  # sdpa
        lambda **kwargs: tiny_model(family, **kwargs), "enc_self", inputs, DEPTHS[family])
    assert all(n == 1 for n in record.calls.values())
    assert not torch.equal(record[("enc_self", 0)], record[("enc_self", 1)])  # not one map for all depths
    check_streamed_chunks_equal_capture(model, inputs, record)


def _zero_value_head_at(model, family: str, depth: int, head: int):
    """A hook on the value projection of the module run at ``depth`` that zeroes ``head``'s value
    columns at that depth's call only (its calls counted by hand, reset by a hook on the encoder)."""
    group, layer = MODULE_OF_DEPTH[family][depth]
    call = MODULE_OF_DEPTH[family][:depth].count((group, layer))
    seen = [0]

    def start(module, args):
        seen[0] = 0

    def zero(module, args, output):
        seen[0] += 1
        if seen[0] - 1 == call:
            output = output.clone()
            output[..., head * 8:(head + 1) * 8] = 0
            return output
        return None

    return [model.albert.encoder.register_forward_pre_hook(start),
            _attention(model, group, layer).value.register_forward_hook(zero)]


@pytest.mark.parametrize("family", FAMILIES)
def test_masking_one_depth_equals_zeroed_values_at_that_depth(family):
    inputs = tiny_inputs()
    model = tiny_model(family)
    before = _logits(model, inputs)
    for depth in (0, 1, DEPTHS[family] - 1):
        head = depth % 4
        with mask_heads(model, {("enc_self", depth): [head]}):
            masked = _logits(model, inputs)
            with capture_attention(model) as record:
                _logits(model, inputs)
        assert torch.equal(_logits(model, inputs), before)  # the mask came off
        handles = _zero_value_head_at(model, family, depth, head)
        try:
            reference = _logits(model, inputs)
            with capture_attention(model) as zeroed:
                _logits(model, inputs)
        finally:
            for handle in handles:
                handle.remove()
        assert not torch.allclose(reference, before)
        torch.testing.assert_close(masked, reference, atol=1e-6, rtol=0)
        for key in record:  # masking at `depth` leaves the depths up to it as they are
            if key[1] <= depth:
                assert torch.equal(record[key], zeroed[key]), key
    # masking the head at every depth is not masking it at one
    with mask_heads(model, {("enc_self", d): [0] for d in range(DEPTHS[family])}):
        everywhere = _logits(model, inputs)
    with mask_heads(model, {("enc_self", 0): [0]}):
        once = _logits(model, inputs)
    assert not torch.allclose(everywhere, once)


@pytest.mark.parametrize("family", FAMILIES)
def test_gates_at_one_change_nothing_and_hooks_come_off(family):
    check_gates_at_one_change_nothing(tiny_model(family), tiny_inputs())


def test_gradient_per_depth_equals_a_hand_written_gate():
    """gate_gradients' |dL/dg| at each depth equals the gradient of a gate multiplied into the dense
    projection's input at that call only (hand-counted)."""
    from headlab.importance import describe_model
    from headlab.importance.gradient import gate_gradients

    family = "albert-groups"
    model = tiny_model(family)
    inputs = tiny_inputs(batch=1, pad=False)
    labels = inputs["input_ids"].clone()
    scores, _, _ = gate_gradients(model, [(inputs, labels)], describe_model(model))
    gates = torch.ones(DEPTHS[family], 4, requires_grad=True)
    counts: dict = {}
    handles = [model.albert.encoder.register_forward_pre_hook(lambda m, a: counts.clear())]

    def gate(position):
        depths = [d for d, p in enumerate(MODULE_OF_DEPTH[family]) if p == position]

        def hook(module, args):
            call = counts.get(position, 0)
            counts[position] = call + 1
            x = args[0]
            g = gates[depths[call]]
            return (x.view(*x.shape[:-1], 4, 8).mul(g[:, None]).view(x.shape),)

        return hook

    for position in set(MODULE_OF_DEPTH[family]):
        handles.append(_attention(model, *position).dense.register_forward_pre_hook(gate(position)))
    try:
        logits = model(**inputs).logits
        loss = torch.nn.functional.cross_entropy(logits[0], labels[0])
        grad, = torch.autograd.grad(loss, gates)
    finally:
        for handle in handles:
            handle.remove()
    torch.testing.assert_close(torch.as_tensor(scores["enc_self"], dtype=torch.float32), grad.abs(),
                               atol=1e-6, rtol=1e-5)
    assert len({round(float(v), 6) for v in grad.abs().sum(1)}) == DEPTHS[family]  # every depth its own


def test_ablation_equals_one_masked_pass_per_head():
    """Ablation runs a shared module's depths in full (no recorded layer outputs stand in for a list
    of layers that is not a list of depths): each score is the masked model's loss change."""
    from headlab.importance import ImportanceData, compute_ablation, describe_model
    from headlab.importance.common import forward_logits, sequence_nll

    model = tiny_model("albert-groups")
    info = describe_model(model)
    g = torch.Generator().manual_seed(7)
    sources = [torch.randint(3, 99, (k,), generator=g).tolist() for k in (5, 3, 6, 4)]
    data = ImportanceData.from_ids(sources)
    scores = compute_ablation(model, data, info, batch_size=2, max_rows=6)

    def loss():
        total, count = 0.0, 0
        with torch.no_grad():
            for ids in sources:
                x = torch.tensor([ids])
                nll, n = sequence_nll(forward_logits(model, {"input_ids": x}, info), x)
                total, count = total + float(nll.sum()), count + int(n.sum())
        return total / count

    base = loss()
    assert scores.signature["base_loss"] == pytest.approx(base, rel=1e-5)
    for depth in (1, 2, 5):
        for head in range(4):
            with mask_heads(model, {("enc_self", depth): [head]}):
                masked = loss()
            assert scores["enc_self"][depth, head] == pytest.approx(masked - base, abs=2e-6), (depth, head)


def test_pruning_one_depth_is_refused_before_any_change():
    """One depth's head of the shared module: no slicing removes it there only (a plan removing the same
    heads at every depth prunes: tests/test_tied_pruning.py)."""
    from headlab import prune_heads

    model = tiny_model("albert")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(HeadlabError, match="enc_self layers 0,1,2: their attention weights are shared by 3 depths"):
        prune_heads(model, {("enc_self", 1): [0]})
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert not model._forward_hooks


def test_unshared_albert_prunes_like_masking(tmp_path):
    """One group per depth (num_hidden_groups == num_hidden_layers): every module is one depth's,
    so physical pruning is allowed, and checked against masking like any other family."""
    import transformers as tf

    from headlab import load_pruned, prune_heads, save_pruned

    config = tf.AlbertConfig(vocab_size=99, embedding_size=16, hidden_size=32, num_attention_heads=4,
                             intermediate_size=37, max_position_embeddings=64, num_hidden_layers=2,
                             num_hidden_groups=2)
    torch.manual_seed(0)
    model = tf.AlbertForMaskedLM(config).eval()
    assert not any(b.shared for b in attention_blocks(model))
    inputs = tiny_inputs()
    with mask_heads(model, {("enc_self", 1): [0, 2]}):
        masked = _logits(model, inputs)
    prune_heads(model, {("enc_self", 1): [0, 2]})
    assert [b.n_heads for b in attention_blocks(model)] == [4, 2]
    pruned = _logits(model, inputs)
    keep = inputs["attention_mask"].bool()
    torch.testing.assert_close(pruned[keep], masked[keep], atol=1e-6, rtol=0)
    save_pruned(model, tmp_path / "albert")
    assert torch.equal(_logits(load_pruned(tmp_path / "albert"), inputs), pruned)


def test_unshared_albert_loses_a_whole_depth(tmp_path):
    """Every head of a depth pruned: ALBERT's attention module ends in LayerNorm(input + dense(heads)),
    so a depth with no head computes LayerNorm(input + dense bias), as masking all its heads does
    (not the bias alone); two groups of two layers over two depths (num_hidden_layers ==
    num_hidden_groups, inner_group_num 2): four modules, nothing shared. Reloaded by load_pruned
    and by plain transformers (the portable pruned_heads.py) to the same logits."""
    import transformers as tf

    from headlab import load_pruned, prune_heads, save_pruned

    config = tf.AlbertConfig(vocab_size=99, embedding_size=16, hidden_size=32, num_attention_heads=4,
                             intermediate_size=37, max_position_embeddings=64, num_hidden_layers=2,
                             num_hidden_groups=2, inner_group_num=2)
    torch.manual_seed(0)
    model = tf.AlbertForMaskedLM(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 0.1)
    assert len(attention_blocks(model)) == 4 and not any(b.shared for b in attention_blocks(model))
    inputs = tiny_inputs()
    spec = {("enc_self", 1): [0, 1, 2, 3], ("enc_self", 2): [1]}
    with mask_heads(model, spec):
        masked = _logits(model, inputs)
    prune_heads(model, spec)  # checks itself against masking
    assert [b.n_heads for b in attention_blocks(model)] == [4, 0, 3, 4]
    pruned = _logits(model, inputs)
    keep = inputs["attention_mask"].bool()
    torch.testing.assert_close(pruned[keep], masked[keep], atol=1e-6, rtol=0)
    save_pruned(model, tmp_path / "albert")
    assert torch.equal(_logits(load_pruned(tmp_path / "albert"), inputs), pruned)
    plain = tf.AutoModelForMaskedLM.from_pretrained(tmp_path / "albert", trust_remote_code=True).eval()
    torch.testing.assert_close(_logits(plain, inputs), pruned, atol=1e-6, rtol=0)


def test_partly_shared_albert_prunes_its_unshared_depth():
    """Three depths over two groups (groups 0, 0, 1): group 1's module runs once, so its heads can be
    pruned alone; group 0's only at both its depths. Regression: pruning's check compared the shared module's first call
    with its last one, and refused every such prune ("differs ... in enc_self layer 0")."""
    import transformers as tf

    from headlab import prune_heads

    config = tf.AlbertConfig(vocab_size=99, embedding_size=16, hidden_size=32, num_attention_heads=4,
                             intermediate_size=37, max_position_embeddings=64, num_hidden_layers=3,
                             num_hidden_groups=2)
    torch.manual_seed(0)
    model = tf.AlbertForMaskedLM(config).eval()
    assert [b.shared for b in attention_blocks(model)] == [True, True, False]
    inputs = tiny_inputs()
    with mask_heads(model, {("enc_self", 2): [1]}):
        masked = _logits(model, inputs)
    with pytest.raises(HeadlabError, match="enc_self layers 0,1: their attention weights are shared by 2 depths"):
        prune_heads(model, {("enc_self", 0): [1]})
    prune_heads(model, {("enc_self", 2): [1]})
    assert [b.n_heads for b in attention_blocks(model)] == [4, 4, 3]
    keep = inputs["attention_mask"].bool()
    torch.testing.assert_close(_logits(model, inputs)[keep], masked[keep], atol=1e-6, rtol=0)


def _save(tmp_path, family="albert"):
    from support.treebank import word_tokenizer

    tokenizer = word_tokenizer(treebank_files(tmp_path), style="bert")
    model = tiny_model(family)
    model.config.pad_token_id, model.config.bos_token_id, model.config.eos_token_id = \
        tokenizer.pad_token_id, tokenizer.cls_token_id, tokenizer.sep_token_id
    model.save_pretrained(tmp_path / family)
    tokenizer.save_pretrained(tmp_path / family)
    return tmp_path / family


def test_analyze_end_to_end(tmp_path, capsys):
    """Every stage, LRP with its conservation check, one row of scores per depth."""
    code, stages = analyze(_save(tmp_path), tmp_path)
    err = capsys.readouterr().err
    out = tmp_path / "out"
    for name in ("lrp", *ANALYZE_STAGES):
        assert stages[name]["status"] == "done", (stages[name], err)
    assert code == 0
    for measure in ("confidence", "lrp", "gradient", "ablation"):  # one row per depth
        scores = json.loads((out / "importance" / f"{measure}.json").read_text())["scores"]["enc_self"]
        assert [len(row) for row in scores] == [4, 4, 4], measure


def test_prune_refuses_one_depth_before_any_work(tmp_path, capsys):
    path = _save(tmp_path)
    code = main(["prune", str(path), "--heads", "enc_self:1:0", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("shared by 3 depths") == 1 and "running" not in err
    assert not (tmp_path / "out").exists()


def test_prune_removes_a_head_at_every_depth(tmp_path, capsys):
    path = _save(tmp_path)
    assert main(["prune", str(path), "--heads", "enc_self:0:1;enc_self:1:1;enc_self:2:1", "--out",
                 str(tmp_path / "out")]) == 0, capsys.readouterr().err
    from headlab import load_pruned

    assert [b.n_heads for b in attention_blocks(load_pruned(tmp_path / "out"))] == [3, 3, 3]


def test_heads_lists_each_depth_with_its_call(tmp_path, capsys):
    path = _save(tmp_path)
    assert main(["heads", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines[1:4]] == ["0", "1", "2"]
    assert lines[2].endswith("albert.encoder.albert_layer_groups.0.albert_layers.0.attention (shared: its call 2 of 3)")


@pytest.mark.parametrize("family", FAMILIES)
def test_lrp_conserves_relevance(family):
    """Relevance is measured at the stack's input as the first depth receives it (not at every depth's
    input of the shared layer): embeddings plus biases equal the explained logit, per sentence."""
    from headlab.importance import ImportanceData, compute_lrp, describe_model

    model = tiny_model(family)
    g = torch.Generator().manual_seed(0)
    data = ImportanceData.from_ids([torch.randint(3, 99, (k,), generator=g).tolist() + [1] for k in (4, 6, 3, 8)])
    scores = compute_lrp(model, data, describe_model(model), bootstrap=0)
    record = scores.signature["conservation"]
    assert record["n_sentences"] == 4 and record["n_outside"] == 0
    assert abs(record["with_biases"]["min"] - 1) < 1e-6 and abs(record["with_biases"]["max"] - 1) < 1e-6
    assert scores["enc_self"].shape == (DEPTHS[family], 4)


def test_lrp_rules_conserve_on_a_bias_free_model():
    """Bias-free, the relevance reaching the first depth's input (the encoder's first call of the
    shared layer) is the explained logit."""
    model = tiny_model("albert-groups")
    layer = model.albert.encoder.albert_layer_groups[0].albert_layers[0]
    assert check_lrp_conserves(model, layer, unit_gain=False) == 2  # called at depths 0 and 2
