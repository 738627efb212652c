"""Hard Concrete gates (Louizos et al. 2018) checked against their closed forms."""

import math

import pytest
import torch

from headlab import attach_gates, detach_gates
from headlab.errors import HeadlabError
from headlab.pruning import HardConcreteGates, LagrangianBudget
from support.models import logits, tiny_inputs, tiny_model


def gates_for(log_alpha, beta=0.33):
    gates = HardConcreteGates({("enc_self", 0): len(log_alpha)}, beta=beta)
    with torch.no_grad():
        gates.log_alpha["enc_self_0"].copy_(torch.tensor(log_alpha))
    return gates


@pytest.mark.parametrize("beta", [0.33, 2 / 3])
def test_samples_lie_in_unit_interval_with_the_closed_form_point_masses(beta):
    torch.manual_seed(0)
    log_alpha = torch.tensor([-2.0, -0.5, 0.0, 0.7, 2.5])
    gates = gates_for(log_alpha.tolist(), beta)
    n = 200_000
    samples = gates.sample(log_alpha.expand(n, -1))  # [n, 5]
    assert samples.min() >= 0 and samples.max() <= 1
    # Monte Carlo against the closed forms; 4 standard errors of a proportion.
    for name, observed, expected in [
        ("P(g=0)", (samples == 0).float().mean(0), gates.p_zero(log_alpha)),
        ("P(g=1)", (samples == 1).float().mean(0), gates.p_one(log_alpha)),
    ]:
        tolerance = 4 * torch.sqrt(expected * (1 - expected) / n) + 1e-4
        assert torch.all((observed - expected).abs() < tolerance), (name, observed, expected)
    # The closed forms by an independent route: P(g=0) = P(s < -gamma/(zeta-gamma)) with
    # s = sigmoid((L + log_alpha)/beta), L logistic, i.e. P(L < beta*logit(t0) - log_alpha).
    t0 = 0.1 / 1.2
    t1 = 1.1 / 1.2
    expected_zero = torch.sigmoid(beta * math.log(t0 / (1 - t0)) - log_alpha)
    expected_one = 1 - torch.sigmoid(beta * math.log(t1 / (1 - t1)) - log_alpha)
    torch.testing.assert_close(gates.p_zero(log_alpha), expected_zero)
    torch.testing.assert_close(gates.p_one(log_alpha), expected_one)
    # The expectation of the penalty term is the Monte Carlo rate of non-zero gates.
    nonzero = (samples > 0).float().mean(0).sum()
    assert abs(nonzero.item() - gates.l0_penalty().item()) < 0.01


def test_penalty_gradient_matches_finite_differences_and_closed_form():
    gates = gates_for([-1.0, 0.3, 2.0])
    gates.double()
    penalty = gates.l0_penalty()
    penalty.backward()
    analytic = gates.log_alpha["enc_self_0"].grad
    shift = 0.33 * math.log(0.1 / 1.1)
    a = torch.tensor([-1.0, 0.3, 2.0], dtype=torch.float64)
    sig = torch.sigmoid(a - shift)
    torch.testing.assert_close(analytic, sig * (1 - sig))
    assert torch.autograd.gradcheck(
        lambda x: torch.sigmoid(x - shift).sum(), (a.clone().requires_grad_(),))
    # Reparameterisation: the sampled gate carries a gradient to log_alpha.
    sample = gates.sample(gates.log_alpha["enc_self_0"])
    sample.sum().backward()
    assert gates.log_alpha["enc_self_0"].grad is not None


def test_test_time_gates_are_zero_or_one_by_the_larger_point_mass():
    log_alpha = torch.linspace(-4, 4, 41)
    gates = gates_for(log_alpha.tolist())
    gates.eval()
    g = gates.gate(("enc_self", 0))
    assert set(g.unique().tolist()) <= {0.0, 1.0}
    expected = (gates.p_one(log_alpha) > gates.p_zero(log_alpha)).float()
    assert torch.equal(g, expected)
    gates.train()
    assert not torch.equal(gates.gate(("enc_self", 0)), gates.gate(("enc_self", 0)))  # fresh draw each call


def test_gates_plug_into_the_foundation_and_are_parameters():
    model = tiny_model("marian")
    inputs = tiny_inputs("marian")
    full = logits(model, inputs)
    gates = HardConcreteGates.for_model(model, ("enc_self",), init_log_alpha=10.0)
    attach_gates(model, gates)
    names = [name for name, _ in model.named_parameters() if "headlab_gates" in name]
    assert names == ["headlab_gates.log_alpha.enc_self_0", "headlab_gates.log_alpha.enc_self_1"]
    assert "headlab_gates.log_alpha.enc_self_0" in model.state_dict()
    torch.testing.assert_close(logits(model, inputs), full)  # all gates open at test time: no change
    detach_gates(model)


def test_keep_top_and_closed_heads():
    gates = HardConcreteGates({("enc_self", 0): 3, ("dec_self", 0): 2})
    with torch.no_grad():
        gates.log_alpha["enc_self_0"].copy_(torch.tensor([5.0, -5.0, 1.0]))
        gates.log_alpha["dec_self_0"].copy_(torch.tensor([-3.0, 4.0]))
    assert gates.closed_heads() == {("enc_self", 0): [1], ("dec_self", 0): [0]}
    assert gates.keep_top(2) == {("enc_self", 0): [1, 2], ("dec_self", 0): [0]}
    assert gates.keep_top(5) == {}
    with pytest.raises(HeadlabError, match="cannot keep 6 heads"):
        gates.keep_top(6)
    # one is one head, not "1 heads" (regression)
    with pytest.raises(HeadlabError, match="^cannot keep 2 heads: the gates cover 1 head$"):
        HardConcreteGates({("enc_self", 0): 1}).keep_top(2)
    scores = gates.p_open_scores()
    assert scores["enc_self"].shape == (1, 3) and scores["enc_self"][0, 0] > 0.99


def test_a_budget_opens_its_top_heads_at_test_time():
    # Footnote 7 would open 2 heads (log_alpha > 0); a budget of 3 opens the 3 of highest log_alpha,
    # the heads its export keeps, so that an evaluation during fine-tuning sees the exported model.
    gates = HardConcreteGates({("enc_self", 0): 3, ("dec_self", 0): 2}, keep=3)
    with torch.no_grad():
        gates.log_alpha["enc_self_0"].copy_(torch.tensor([5.0, -5.0, -1.0]))
        gates.log_alpha["dec_self_0"].copy_(torch.tensor([-3.0, 4.0]))
    gates.eval()
    assert gates.closed_heads() == gates.keep_top(3) == {("enc_self", 0): [1], ("dec_self", 0): [0]}
    assert gates.open_per_kind() == {"enc_self": 2, "dec_self": 1}
    assert gates.gate(("enc_self", 0)).tolist() == [1.0, 0.0, 1.0]
    assert gates.gate(("dec_self", 0)).tolist() == [0.0, 1.0]
    gates.keep = None  # footnote 7's rule
    assert gates.gate(("enc_self", 0)).tolist() == [1.0, 0.0, 0.0]
    gates.train()
    assert gates.gate(("enc_self", 0)).shape == (3,)  # training: a sample, whatever the budget


def test_a_budget_says_when_its_cut_falls_among_tied_gates():
    """Every gate starts at the same log alpha, so a budget's heads before the first update are the first by position:
    budget_tie says so (the step-0 development point and an export record it), and is None once the gates decide."""
    gates = HardConcreteGates({("enc_self", 0): 3, ("dec_self", 0): 2}, keep=3)
    assert gates.budget_tie() == {"tied": 5, "kept": 3}  # at initialisation
    with torch.no_grad():
        gates.log_alpha["enc_self_0"].copy_(torch.tensor([5.0, 1.0, 1.0]))
        gates.log_alpha["dec_self_0"].copy_(torch.tensor([1.0, 4.0]))
    assert gates.budget_tie() == {"tied": 3, "kept": 1}  # the third place: one of three heads at 1.0
    gates.log_alpha["dec_self_0"].data[0] = 0.5
    assert gates.budget_tie() == {"tied": 2, "kept": 1}
    gates.log_alpha["enc_self_0"].data[2] = 0.9
    assert gates.budget_tie() is None  # the gates decide every place
    assert gates.keep_top(3) == {("enc_self", 0): [2], ("dec_self", 0): [0]}
    gates.log_alpha["enc_self_0"].data[2] = 1.0
    gates.keep = 5  # every head kept, or (below) none: no cut to fall anywhere
    assert gates.budget_tie() is None
    gates.keep = None  # footnote 7's rule: no budget
    assert gates.budget_tie() is None


def test_bad_parameters_are_refused():
    with pytest.raises(HeadlabError, match="beta"):
        HardConcreteGates({("enc_self", 0): 2}, beta=0)
    with pytest.raises(HeadlabError, match="larger than the 4 gated heads"):
        LagrangianBudget(4, 5)
    with pytest.raises(HeadlabError, match="larger than the 1 gated head$"):  # not "1 gated heads"
        LagrangianBudget(1, 2)


def test_budget_multipliers_ascend():
    budget = LagrangianBudget(10, 4, warmup_steps=10)
    assert budget.target(0) == 10 and budget.target(5) == 7 and budget.target(20) == 4
    expected = torch.tensor(8.0, requires_grad=True)
    budget.penalty(expected, 20).backward()
    # Minimising with these gradients raises lambda_1 while the gap (8 - 4) is positive.
    assert budget.lambda_1.grad.item() == -4.0 and budget.lambda_2.grad.item() == -16.0


def test_counts_of_one_are_singular_in_messages():
    """Regression: "cannot keep 2 heads: the model has 1 heads", "converged: 1 epochs without ...";
    every count in a message goes through errors.counted."""
    from pathlib import Path

    from headlab.pruning.baselines import _check_keep
    from headlab.training.config import TrainConfig
    from headlab.training.loop import _stop_message

    with pytest.raises(HeadlabError, match="^cannot keep 2 heads: the model has 1 head of enc_self$"):
        _check_keep(2, 1, ("enc_self",))
    state = {"history": [], "best_score": 30.0, "best_epoch": 1, "epoch": 1}
    message, _ = _stop_message("converged", state, TrainConfig(patience=1), Path("out"))
    assert message.startswith("converged: 1 epoch without a validation gain") and message.endswith(", 1 epoch)")


def _log_alpha_grad(passes: int, checkpointing: dict | None, dropout: float = 0.1) -> torch.Tensor:
    """The gradient of log_alpha after ``passes`` forwards of a tiny float64 BERT in training mode and one
    backward of their losses' weighted sum, with ``checkpointing`` (transformers' keywords) or without."""
    import transformers as tf

    torch.manual_seed(0)
    model = tf.BertForMaskedLM(tf.BertConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
        max_position_embeddings=64, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)).double()
    inputs = tiny_inputs("bert")
    gates = HardConcreteGates.for_model(model, init_log_alpha=0.0).double()
    attach_gates(model, gates)
    model.train()
    if checkpointing is not None:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpointing)
    torch.manual_seed(5)
    losses = [model(**inputs, labels=inputs["input_ids"]).loss for _ in range(passes)]
    torch.manual_seed(6)  # what a recomputation without the RNG replayed would draw
    sum((i + 1) * loss for i, loss in enumerate(losses)).backward()
    return torch.cat([p.grad.flatten() for p in gates.log_alpha.values()])


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_recomputes_every_pass_with_its_own_draws(reentrant):
    """Two forwards, one backward of the sum (dropout on): each checkpointed layer is recomputed with the draw
    of its own pass and call, and dropout after the gates draws as in the forward."""
    reference = _log_alpha_grad(2, None)
    assert reference.abs().sum() > 0
    torch.testing.assert_close(_log_alpha_grad(2, {"use_reentrant": reentrant}), reference, atol=1e-12, rtol=0)


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_without_the_rng_replayed(reentrant):
    """Regression: with preserve_rng_state=False the recomputation drew new noise, and log_alpha's gradient was
    another draw's, silently. One pass alive: its draws are read (exact); two: refused, naming the option."""
    keywords = {"use_reentrant": reentrant, "preserve_rng_state": False}
    reference = _log_alpha_grad(1, None, dropout=0.0)
    torch.testing.assert_close(_log_alpha_grad(1, keywords, dropout=0.0), reference, atol=1e-12, rtol=0)
    with pytest.raises(HeadlabError, match="preserve_rng_state"):
        _log_alpha_grad(2, keywords, dropout=0.0)


def test_a_recomputed_call_whose_state_two_passes_share_is_refused():
    """Two passes that reached one block at the same RNG state with other noise (the RNG seeded again inside a pass):
    the recomputation cannot tell which is its own, and says so rather than read either."""
    gates = gates_for([0.0, 0.0])
    replay, call = gates._replay, (("enc_self", 0), b"state")
    first = torch.tensor([0.2, 0.3])
    replay.record(call, first)
    assert torch.equal(replay.find(call), first)
    alive = replay.current  # as its graph holds it (the outputs' grad_fn metadata)
    replay.new_pass()
    replay.record(call, torch.tensor([0.7, 0.1]))
    with pytest.raises(HeadlabError, match=r"cannot be told apart from another.s \(2 passes alive\)"):
        replay.find(call)
    del alive  # the first pass's graph gone: the call is the second pass's alone
    torch.testing.assert_close(replay.find(call), torch.tensor([0.7, 0.1]))


def test_p_open_ranks_heads_as_log_alpha_does():
    """A point's from-scratch run keeps the top N of its gates.json by P(open); the point kept its top N by
    log_alpha (a budget) or log_alpha's sign (footnote 7). Adam's first updates move every gate by almost exactly
    its learning rate, leaving log_alpha values a few float32 ulps apart: P(open) computed in float32 merged them,
    and the tie, broken by position, kept other heads than the point (the tiny reproduction: 8/2/2 for 8/1/3)."""
    base = torch.tensor(3.1, dtype=torch.float32)
    ulp = torch.nextafter(base, torch.tensor(4.0)) - base
    # later heads a few ulps higher: a tie broken by position would keep the first ones
    values = [base, base + ulp, base + 2 * ulp, base + 5 * ulp]
    gates = gates_for([float(v) for v in values])
    for keep in range(1, 4):
        assert gates.p_open_scores().top_mask(keep, ("enc_self",)) == gates.keep_top(keep)
    p = gates.p_open()[("enc_self", 0)]
    assert p.dtype == torch.float64 and bool((p.diff() > 0).all())
    torch.testing.assert_close(p, 1 - gates.p_zero(torch.tensor(values, dtype=torch.float64)))
