"""Training a model whose own eager forward gives NaN on padded rows (session 28, trainnan28).

A float64 model in transformers' eager attention gives NaN at a padding query that may attend to no key (a sliding
window past the end of a right-padded row: headlab pads on the right), and that NaN reaches the real rows (0 * NaN
in the weighted sum of values) and every gradient (the softmax's backward). Before: the training loop stopped at step
1 as "diverged (loss or gradient not finite)" without saying why, and with ``clip_norm=0`` a NaN gradient behind a
finite loss went into the weights and the next ``last/``. Now every training forward runs under the float32 mask
floor (:func:`headlab.capture.float32_mask_floor`, as the importance measures do): a padded batch trains as its
sentences one at a time, and float32 and bfloat16 runs are unchanged to the bit; a non-finite loss, gradient or
updated weight stops the run naming the step and the cause, and never reaches a checkpoint.
"""

from __future__ import annotations

import contextlib
import copy
import json

import pytest
import torch

from headlab.training import loop
from headlab.training.config import TrainConfig
from headlab.training.corpus import EncodedCorpus, collate
from headlab.training.loop import load_weights, train
from headlab.training.losses import token_loss
from test_own_nan_importance import MODELS, mistral

PAD = 2  # the models' pad_token_id


def _corpus() -> EncodedCorpus:
    g = torch.Generator().manual_seed(5)
    ids = [torch.randint(3, 99, (k,), generator=g).tolist() for k in (12, 3, 11, 2, 7)]
    return EncodedCorpus(ids, [list(x) for x in ids])


def _collate(corpus: EncodedCorpus, indices) -> dict:
    return collate(corpus, indices, PAD, PAD)


def _own_tokens_loss(model, batch: dict, config: TrainConfig) -> tuple[torch.Tensor, int]:
    """Each real position predicts its own token: deterministic (no masking draw), one loss for every family."""
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return token_loss(logits, labels)


def _config(out_dir, **overrides) -> TrainConfig:
    options = dict(out_dir=str(out_dir), max_tokens=1000, lr=0.5, warmup_steps=0, schedule="constant", max_epochs=1,
                   validate=False, keep_epoch_checkpoints=False, progress=False, seed=3, clip_norm=0.0)
    options.update(overrides)
    return TrainConfig(**options)


def _sgd(params, config: TrainConfig) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=config.lr)


def _train(model, tokenizer, out_dir, corpus=None, **overrides):
    return train(model, tokenizer, corpus or _corpus(), None, _config(out_dir, **overrides), compute_loss=_own_tokens_loss,
                 collate_fn=_collate, optimizer_factory=_sgd, log=lambda line: None)


@pytest.mark.parametrize("family", MODELS)
def test_a_padded_float64_batch_trains_as_its_sentences_one_at_a_time(family, tokenizer, tmp_path):
    """One SGD step on the whole (right-padded) corpus: the weights equal w - lr * (sum of each sentence's gradient,
    alone and unpadded, which transformers computes finite) / tokens. Before: diverged at step 1, nothing trained."""
    model = MODELS[family]()
    reference = copy.deepcopy(model).train()
    corpus = _corpus()
    total = sum(len(ids) for ids in corpus.sources)
    for ids in corpus.sources:
        loss, _ = _own_tokens_loss(reference, {"input_ids": torch.tensor([ids]),
                                               "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}, _config("x"))
        loss.backward()
    result = _train(model, tokenizer, tmp_path / "run", corpus, max_steps=1)
    assert result.stopped == "max_steps" and result.step == 1, result.message
    saved = copy.deepcopy(model)
    load_weights(saved, tmp_path / "run" / "last")
    before = dict(reference.named_parameters())
    for name, param in saved.named_parameters():
        assert bool(param.isfinite().all()), name
        if before[name].grad is not None:  # the loop divides the loss by the tokens in float32: 1e-7 of the update
            update = param.detach() - before[name].detach()
            expected = -0.5 * before[name].grad / total
            assert (update - expected).abs().max() <= 1e-6 * expected.abs().max(), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_floor_changes_no_bit_of_a_float32_or_bfloat16_run(dtype, tokenizer, tmp_path, monkeypatch):
    """Their masks are finite in the softmax already: trained with and without the floor, every weight is equal."""
    runs = []
    for floored in (True, False):
        if not floored:
            monkeypatch.setattr(loop, "float32_mask_floor", lambda model: contextlib.nullcontext())
        model = mistral().to(dtype)
        result = _train(model, tokenizer, tmp_path / f"run-{floored}", max_tokens=30, max_epochs=2, clip_norm=1.0)
        assert result.stopped == "finished" and result.step >= 4, result.message
        runs.append({name: p.detach().clone() for name, p in model.named_parameters()})
    assert runs[0].keys() == runs[1].keys()
    for name in runs[0]:
        assert torch.equal(runs[0][name], runs[1][name]), name
    assert any(not torch.equal(runs[0][name], p.detach()) for name, p in mistral().to(dtype).named_parameters())


def _last_step(out_dir) -> int:
    return json.loads((out_dir / "last" / "trainer_state.json").read_text())["step"]


@pytest.mark.parametrize("clip_norm", [0.0, 1.0])
def test_a_nan_gradient_behind_a_finite_loss_stops_the_run_unclipped_too(clip_norm, tokenizer, tmp_path):
    """clip_norm 0: the gradient was read only to clip it, so a NaN gradient went into the weights and the next
    last/. Now the run stops at that step, naming the gradient and the parameter; last/ is the step before.
    (float32: no padding NaN here, the poisoned gradient the only one.)"""
    model = mistral().float()
    weight = model.model.layers[0].mlp.up_proj.weight
    calls = {"n": 0}

    def poison(grad):
        calls["n"] += 1
        return grad * float("nan") if calls["n"] == 3 else grad

    weight.register_hook(poison)
    result = _train(model, tokenizer, tmp_path / "run", max_tokens=30, max_epochs=3, save_every_steps=1,
                    clip_norm=clip_norm)
    assert result.stopped == "diverged" and result.step == 2
    where = "(parameter model.layers.0.mlp.up_proj.weight)" if clip_norm == 0 else \
        "(in every parameter: clipping scaled them by it; with clip_norm 0 the first one is named)"
    assert result.message.startswith(f"training diverged at step 3: the gradient's norm is nan {where}"), result.message
    assert "the weights were not updated" in result.message and "Last good checkpoint" in result.message
    assert _last_step(tmp_path / "run") == 2
    assert all(bool(p.isfinite().all()) for p in model.parameters())


class _Overflowing(torch.optim.SGD):
    """SGD whose second update leaves an inf in the weights, from finite gradients (as float16 Adam's eps can)."""

    def step(self, closure=None):
        loss = super().step(closure)
        self.steps = getattr(self, "steps", 0) + 1
        if self.steps == 2:
            with torch.no_grad():
                self.param_groups[0]["params"][0].view(-1)[0] = float("inf")
        return loss


def test_an_update_that_makes_a_weight_infinite_is_never_saved(tokenizer, tmp_path):
    """Before: with max_steps at that update, last/ was written with the inf weight and the run 'stopped at
    max_steps'. Now it stops as diverged at that step, naming the weights, and last/ stays the step before."""
    model = mistral().float()
    result = train(model, tokenizer, _corpus(), None, _config(tmp_path / "run", max_tokens=30, max_epochs=3,
                                                              save_every_steps=1, max_steps=2),
                   compute_loss=_own_tokens_loss, collate_fn=_collate,
                   optimizer_factory=lambda params, config: _Overflowing(params, lr=config.lr), log=lambda line: None)
    assert result.stopped == "diverged" and result.step == 1
    assert result.message.startswith("training diverged at step 2: the optimizer's update made weights not finite "
                                     "(parameter model.embed_tokens.weight)"), result.message
    assert _last_step(tmp_path / "run") == 1
    saved = mistral().float()
    load_weights(saved, tmp_path / "run" / "last")
    assert all(bool(p.isfinite().all()) for p in saved.parameters())


def test_a_nan_loss_names_itself(tokenizer, tmp_path):
    """A NaN the floor does not explain (here in the weights): stopped at step 1, the loss named."""
    model = mistral().float()
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    result = _train(model, tokenizer, tmp_path / "run", max_tokens=30)
    assert result.stopped == "diverged" and result.step == 0
    assert result.message.startswith("training diverged at step 1: the loss of its batch is nan (the weights were not "
                                     "updated). Last good checkpoint: none written yet"), result.message


class _PadOnly:
    """evaluate_loss's tokenizer: only its padding id is read (the corpus comes encoded)."""

    pad_token_id = PAD


def test_evaluation_losses_of_padded_batches_are_those_of_one_sentence_at_a_time():
    """evaluate_loss (validation, prune train's and the baselines' final loss) and headlab lm's perplexity run under
    the floor too: before, NaN on the padded batch of a float64 eager model."""
    from headlab.lm.train import perplexity
    from headlab.pruning.train import _next_token_loss
    from headlab.training.losses import evaluate_loss

    model, corpus = mistral(), _corpus()
    padded = evaluate_loss(model, _PadOnly(), corpus, batch_tokens=1000, compute_loss=_next_token_loss)
    alone = evaluate_loss(model, _PadOnly(), corpus, batch_tokens=1, compute_loss=_next_token_loss)  # one a batch
    assert padded == pytest.approx(alone, rel=1e-6)  # token_loss sums in float32
    padded, alone = perplexity(model, corpus, PAD, max_tokens=1000), perplexity(model, corpus, PAD, max_tokens=1)
    assert padded["loss"] == pytest.approx(alone["loss"], rel=1e-6) and padded["tokens"] == alone["tokens"]


def test_translating_a_padded_batch_gives_each_sentence_s_translation_alone(corpus, tokenizer):
    """headlab.nmt.translate (BLEU validation, prune train's and the baselines' evaluation) under the floor: a
    float64 eager T5Gemma's padded batch gave other translations before (NaN encoder states)."""
    from headlab.nmt.translate import translate
    from test_own_nan_importance import t5gemma

    model = t5gemma(len(tokenizer))  # its pad (0) and EOS (1) are the tokenizer's
    sentences = [corpus.sources[i] for i in range(6)]
    width = max(len(ids) for ids in tokenizer(sentences)["input_ids"])
    batched = translate(model, tokenizer, sentences, beam=2, batch_size=6)
    # one at a time, with the length limit the padded batch gets (a = 0: the limit is b)
    alone = [translate(model, tokenizer, [s], beam=2, batch_size=1, max_length_a=0, max_length_b=int(1.5 * width + 10))[0]
             for s in sentences]
    assert batched == alone
    assert len({len(ids) for ids in tokenizer(sentences)["input_ids"]}) > 1  # padded


def test_prune_train_of_a_padded_float64_model_trains_and_exports(tokenizer, tmp_path):
    """Gated fine-tuning (Hard Concrete gates) of a float64 eager ModernBERT whose local layers give NaN on a padded
    batch: before, 'training diverged at step 1' and nothing exported; now it trains, exports and scores finite.
    (A causal float64 eager model is refused before this by the prune check, its left-padded probe row NaN.)"""
    import math

    from headlab.pruning.train import PruneConfig, prune_train

    train_config = _config(tmp_path / "run", lr=1e-3, max_tokens=30, max_epochs=2, clip_norm=1.0)
    config = PruneConfig(gates="all", lam=0.5, log_every=2, loss="causal_lm", train=train_config)  # any loss will do
    result = prune_train(MODELS["modernbert"](), tokenizer, _corpus(), _corpus(), config, log=lambda line: None)
    assert result.stopped == "finished", result.message
    assert (tmp_path / "run" / "pruned").is_dir() and math.isfinite(result.metrics["loss"])
