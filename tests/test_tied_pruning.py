"""Pruning attention weights shared by several depths (issue tied30): ALBERT's shared layers (one module
run at several depths) and Zamba's shared transformer (one module per hybrid layer, their parameters
tied). Removing a head of such weights removes it at every depth that runs them, so physical pruning
is exact exactly when the plan removes the same heads at each of those depths, and then it equals
masking those heads at all of them. Before, every such prune was refused ("shared by 3 depths",
"is tied to"), and so were ``prune train`` and its gates.

References: the model with the same heads masked at every sharing depth (mask_heads, a padded batch),
in float64; the reloads (load_pruned, plain transformers through the shipped pruned_heads.py) against
the pruned model. Tiny models from configs (tests/support/family_matrix.py's ``SHARED``), no download.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf

from headlab import HeadlabError, attention_blocks, gates_attached, load_pruned, mask_heads, prune_heads, save_pruned
from headlab.adapters import sharing_groups
from support.family_matrix import logits, tiny_inputs, tiny_model

ALBERTS = ("albert", "albert-groups")  # one module at depths 0-2; two groups of two layers over 4 depths


def _zamba() -> torch.nn.Module:
    """A Mamba layer, then three hybrid layers whose shared transformer's weights are tied."""
    config = tf.ZambaConfig(
        vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=1, pad_token_id=2,
        mamba_d_state=8, layers_block_type=["mamba", "hybrid", "hybrid", "hybrid"])
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tf.ZambaForCausalLM(config).eval()
    with torch.no_grad():  # norms off their initial ones, so that a wrong slice shows
        for name, parameter in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                parameter.uniform_(0.5, 1.5)
    return model.double()


def _model(family: str) -> torch.nn.Module:
    return _zamba() if family == "zamba" else tiny_model(family).double()


def _auto(family: str):
    return tf.AutoModelForCausalLM if family == "zamba" else tf.AutoModelForMaskedLM


def _close(a: torch.Tensor, b: torch.Tensor, inputs: dict, atol: float = 1e-10) -> None:
    keep = inputs["attention_mask"].bool()  # padded positions: whatever the model computes there
    torch.testing.assert_close(a[keep], b[keep], atol=atol, rtol=0)


def test_sharing_groups():
    assert [[b.layer for b in g] for g in sharing_groups(attention_blocks(_model("albert")))] == [[0, 1, 2]]
    assert [[b.layer for b in g] for g in sharing_groups(attention_blocks(_model("albert-groups")))] == \
        [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert [[b.layer for b in g] for g in sharing_groups(attention_blocks(_zamba()))] == [[1, 2, 3]]
    assert sharing_groups(attention_blocks(tiny_model("gpt_neox"))) == []


@pytest.mark.parametrize("family", [*ALBERTS, "zamba"])
def test_a_plan_that_differs_between_sharing_depths_is_refused_before_any_change(family):
    from headlab.surgery import check_prunable

    model = _model(family)
    group = sharing_groups(attention_blocks(model))[0]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    calls: list = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    depths = ",".join(str(b.layer) for b in group)
    first, *others = group
    with pytest.raises(HeadlabError, match=rf"{first.kind} layers {depths}: their attention weights are shared by "
                                           rf"{len(group)} depths .* this plan removes head 1 at layer {first.layer}; "
                                           rf"no head at layers? {','.join(str(b.layer) for b in others)}\. .*nothing "
                                           "was pruned"):
        prune_heads(model, {first.key: [1]})
    spec = {b.key: [1] for b in group}
    spec[others[-1].key] = [1, 2]
    with pytest.raises(HeadlabError, match=rf"heads 1,2 at layer {others[-1].layer}"):
        prune_heads(model, spec)
    assert not calls
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    check_prunable(model)  # the sample plan agrees across the sharing depths; undone
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("family", [*ALBERTS, "zamba"])
@pytest.mark.parametrize("heads", [[0, 3], [0, 1, 2, 3]], ids=["two-heads", "every-head"])
def test_pruned_equals_masked_at_every_sharing_depth_and_reloads(family, heads, tmp_path):
    """The same heads removed at each depth of the first shared weights: the model computes what those
    heads masked at all those depths computes (padded batch), the weights are sliced once (ALBERT's one
    module; Zamba's modules tied again), and the directory reloads with load_pruned and with plain
    transformers (pruned_heads.py) to the same logits."""
    model = _model(family)
    inputs = tiny_inputs()
    group = sharing_groups(attention_blocks(model))[0]
    spec = {b.key: list(heads) for b in group}
    with mask_heads(model, spec):
        masked = logits(model, inputs)
    before = logits(model, inputs)
    kept = prune_heads(model, spec)
    assert kept == {b.key: [h for h in range(4) if h not in heads] for b in group}
    counts = {b.key: b.n_heads for b in attention_blocks(model)}
    assert counts == {b.key: 4 - (len(heads) if b.key in spec else 0) for b in attention_blocks(_model(family))}
    pruned = logits(model, inputs)
    _close(pruned, masked, inputs)
    assert not torch.allclose(pruned, before)  # the heads did something
    if family == "zamba" and len(heads) < 4:  # one set of weights again, held by every hybrid layer
        layers = model.model.layers
        assert layers[1].shared_transf.self_attn.q_proj.weight is layers[3].shared_transf.self_attn.q_proj.weight
        assert layers[2].shared_transf.self_attn.o_proj.weight.shape == (32, 16 * (4 - len(heads)))
    save_pruned(model, tmp_path / family)
    record = json.loads((tmp_path / family / "headlab_pruning.json").read_text())
    assert sorted(int(layer) for layer in record["blocks"][group[0].kind]) == [b.layer for b in group]
    _close(logits(load_pruned(tmp_path / family).double(), inputs), pruned, inputs, atol=1e-5)  # loaded in float32
    plain = _auto(family).from_pretrained(tmp_path / family, trust_remote_code=True).eval()
    _close(logits(plain, inputs), pruned, inputs)
    assert [b.n_heads for b in attention_blocks(load_pruned(tmp_path / family))] == list(counts.values())
    if len(heads) < 4:
        # re-saved by transformers (no headlab_pruning.json; Zamba's tied weights written once, under layer 1's
        # names): the record read off the weights and the plan gives every depth its heads (before, Zamba's
        # other depths were taken as unpruned and the plan refused as differing)
        from headlab.loading import load_model

        plain.save_pretrained(tmp_path / "resaved")
        resaved = load_model(str(tmp_path / "resaved")).double()
        assert {b.key: list(b.core._headlab_kept_heads) for b in attention_blocks(resaved)
                if getattr(b.core, "_headlab_kept_heads", None) is not None} == kept
        _close(logits(resaved, inputs), pruned, inputs)


def test_a_record_that_differs_between_sharing_depths_is_refused(tmp_path):
    model = _model("albert")
    prune_heads(model, {("enc_self", d): [1] for d in range(3)})
    save_pruned(model, tmp_path / "m")
    path = tmp_path / "m" / "headlab_pruning.json"
    record = json.loads(path.read_text())
    record["blocks"]["enc_self"]["2"]["kept_heads"] = [0, 1, 2]
    record["blocks"]["enc_self"]["2"]["kept_kv_heads"] = [0, 1, 2]
    path.write_text(json.dumps(record))
    with pytest.raises(HeadlabError, match=r"headlab_pruning.json: enc_self layers 0,1,2: their attention weights are "
                                           r"shared by 3 depths"):
        load_pruned(tmp_path / "m")


def test_scores_ranked_per_depth_are_refused_on_shared_weights():
    from headlab import prune
    from headlab.heads import HeadScores

    model = _model("albert")
    scores = HeadScores({"enc_self": torch.rand(3, 4).numpy()}, "test")
    with pytest.raises(HeadlabError, match="shared by 3 depths, and a plan ranked by scores per depth"):
        prune(model, scores, keep=6)
    assert [b.n_heads for b in attention_blocks(model)] == [4, 4, 4]


@pytest.mark.parametrize("family", [*ALBERTS, "zamba"])
def test_tied_gates_one_per_shared_head(family):
    """Hard Concrete gates on shared weights: one gate (one log_alpha, one draw per pass) per head of the
    weights, used at every depth; the penalty and the budget count it once. Gates at 1 change nothing,
    every plan they give removes the same heads at each sharing depth, and prune_heads takes it."""
    from headlab.pruning import HardConcreteGates
    from headlab.pruning.hard_concrete import gate_count

    model = _model(family)
    inputs = tiny_inputs()
    blocks = attention_blocks(model)
    groups = sharing_groups(blocks)
    gates = HardConcreteGates.for_model(model).double()
    assert gates.tied == {b.key: g[0].key for g in groups for b in g[1:]}
    owners = [b.key for b in blocks if b.key not in gates.tied]
    assert gates.keys() == owners and sorted(gates.log_alpha) == sorted(f"{k}_{n}" for k, n in owners)
    assert gates.n_gates() == gate_count(model) == 4 * len(owners)
    torch.testing.assert_close(gates.l0_penalty(),
                               sum(torch.sigmoid(gates.log_alpha[f"{k}_{n}"] - gates._shift_zero).sum() for k, n in owners))
    before = logits(model, inputs)
    with torch.no_grad():
        for parameter in gates.log_alpha.values():
            parameter.fill_(20.0)  # P(g = 1) ~ 1
    with gates_attached(model, gates):
        model.eval()
        assert torch.equal(logits(model, inputs), before)  # gates at 1 change nothing
        model.train()  # one draw per pass, the same at every depth of the shared weights
        drawn: dict = {}
        handles = [block.o.register_forward_pre_hook(lambda m, args, key=block.key: drawn.setdefault(key, []).append(
            gates._noise[gates.tied.get(key, key)].clone())) for block in attention_blocks(model)]
        with torch.no_grad():
            for parameter in gates.log_alpha.values():
                parameter.fill_(0.0)
            model(**inputs)
        for handle in handles:
            handle.remove()
        for group in groups:
            assert all(torch.equal(drawn[b.key][-1], drawn[group[0].key][-1]) for b in group)
        model.eval()
    with torch.no_grad():  # head 1 closed, head 2 nearly closed, at the shared weights only
        for key in owners:
            gates.log_alpha[f"{key[0]}_{key[1]}"].copy_(torch.tensor([5.0, -5.0, 0.5, 5.0]))
    spec = gates.closed_heads()
    assert spec == {b.key: [1] for b in blocks}
    gates.keep = 2 * len(owners)  # a budget in gates: heads 0 and 3 of each
    assert gates.keep_top(gates.keep) == {b.key: [1, 2] for b in blocks}
    assert gates.open_per_kind() == {blocks[0].kind: 2 * len(owners)}
    table = gates.p_open_scores(model=model).scores[blocks[0].kind]
    assert all((table[b.layer] == table[g[0].layer]).all() for g in groups for b in g)
    with mask_heads(model, spec):
        masked = logits(model, inputs)
    prune_heads(model, spec)
    _close(logits(model, inputs), masked, inputs)


def test_a_tied_draw_never_outlives_its_pass():
    """Regression: the draw of shared weights (kept for the later depths of a pass) was cleared by
    nothing: after a forward that failed mid-way, a train()/eval() switch, or at the start of the next
    pass before its first depth ran, a depth read the draw of another pass."""
    from headlab.pruning import HardConcreteGates

    model, inputs = _model("albert"), tiny_inputs()
    gates = HardConcreteGates.for_model(model).double()
    [owner, later, *_] = [b.key for b in attention_blocks(model)]
    seen: list = []
    with gates_attached(model, gates):
        model.train()
        first = gates.gate(owner)  # a pass begun outside the model (a depth run alone)
        model.register_forward_pre_hook(lambda m, args: seen.append(dict(gates._noise)))
        with torch.no_grad():
            model(**inputs)
        assert seen[-1] == {}  # a top-level forward starts with no draw of another pass
        blocks = attention_blocks(model)

        def fail(module, args):
            raise RuntimeError("mid-forward")

        handle = blocks[1].o.register_forward_pre_hook(fail)
        with pytest.raises(RuntimeError, match="mid-forward"), torch.no_grad():
            model(**inputs)  # the first depth drew, the second failed
        handle.remove()
        assert seen[-1] == {} and owner in gates._noise
        with torch.no_grad():
            model(**inputs)
        assert seen[-1] == {}
        gates.gate(owner)
        model.eval()
        model.train()
        assert gates._noise == {}
        assert not torch.equal(gates.gate(later), first)  # a draw of its own, not one from before the switch
        model.eval()


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_recomputes_with_the_pass_s_tied_draw(reentrant):
    """Regression: gradient checkpointing recomputes each layer in the backward; the first depth of
    shared weights drew a new sample there (with torch's RNG not replayed: preserve_rng_state=False)
    and, reentrant, the later depths read the draw made under no_grad, so log_alpha's gradient
    differed from the run without checkpointing. The recomputation reuses the pass's noise."""
    from headlab.pruning import HardConcreteGates

    inputs = tiny_inputs()
    grads = []
    for checkpointing in (False, True):
        model = _model("zamba")
        gates = HardConcreteGates.for_model(model, init_log_alpha=0.0).double()
        assert gates.tied  # three depths of one shared transformer
        with gates_attached(model, gates):
            model.train()
            if checkpointing:
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={
                    "use_reentrant": reentrant, "preserve_rng_state": False})
            torch.manual_seed(5)
            loss = model(**inputs, labels=inputs["input_ids"], use_cache=False).loss
            torch.manual_seed(6)  # what the recomputation would draw afresh
            loss.backward()
            grads.append(torch.cat([p.grad.flatten() for p in gates.log_alpha.values()]))
            model.eval()
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[1], grads[0])


def test_prune_train_ties_the_gates_and_exports_an_agreeing_plan(corpus, tokenizer, tmp_path):
    """``prune train`` on an ALBERT (one module over three depths; refused before any work until now): four
    gates, one per head of the module, a budget of two of them; the export removes the same two heads at
    every depth and reloads."""
    import copy

    from headlab.pruning.train import PruneConfig, encode_monolingual_corpus, prune_train, read_trajectory
    from headlab.training.config import TrainConfig

    tok = copy.deepcopy(tokenizer)
    tok.add_special_tokens({"mask_token": "<mask>"})
    torch.manual_seed(0)
    albert = tf.AlbertForMaskedLM(tf.AlbertConfig(
        vocab_size=len(tok), embedding_size=16, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
        intermediate_size=37, max_position_embeddings=64, pad_token_id=tok.pad_token_id))
    data = encode_monolingual_corpus(tok, corpus.sources[:40], 64)
    train = TrainConfig(out_dir=str(tmp_path / "r"), max_tokens=400, lr=1e-3, warmup_steps=0, schedule="constant",
                        max_epochs=1, validate=False, keep_epoch_checkpoints=False, progress=False, seed=3)
    result = prune_train(albert, tok, data, None, PruneConfig(gates="all", lam=0.0, log_every=1, gate_lr=0.1,
                                                              keep=2, train=train))
    assert result.heads_total == {"enc_self": 12} and result.heads_kept == {"enc_self": 6}
    trajectory = read_trajectory(tmp_path / "r")
    assert trajectory[-1]["n_gates"] == 4 and trajectory[-1]["heads_open"] == {"enc_self": 2}
    p_open = trajectory[-1]["p_open"]["enc_self"]
    assert p_open[0] == p_open[1] == p_open[2]  # one gate per head of the module, at every depth
    pruned = load_pruned(tmp_path / "r" / "pruned")
    kept = [b.core._headlab_kept_heads for b in attention_blocks(pruned)]
    assert len(kept[0]) == 2 and kept == [kept[0]] * 3


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_recomputes_each_pass_with_its_own_tied_draw(reentrant):
    """Regression: two forwards, then one backward of the sum (two losses accumulated, a trainer's two
    passes): the recomputation of the first pass read the second pass's draw, so log_alpha's gradient
    differed from the run without checkpointing. Each recomputation reads its own pass's draw."""
    from headlab.pruning import HardConcreteGates

    inputs = tiny_inputs()
    grads = []
    for checkpointing in (False, True):
        model = _model("zamba")
        gates = HardConcreteGates.for_model(model, init_log_alpha=0.0).double()
        assert gates.tied
        with gates_attached(model, gates):
            model.train()
            if checkpointing:
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
            torch.manual_seed(5)
            first = model(**inputs, labels=inputs["input_ids"], use_cache=False).loss
            second = model(**inputs, labels=inputs["input_ids"], use_cache=False).loss
            (first + 2 * second).backward()
            grads.append(torch.cat([p.grad.flatten() for p in gates.log_alpha.values()]))
            model.eval()
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[1], grads[0], atol=1e-12, rtol=0)
