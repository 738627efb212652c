"""Training a language model end to end: read text, train a vocabulary, build, train.

The loop is headlab's training engine (:func:`headlab.training.loop.train`: Accelerate, bf16
autocast, token-based batches, atomic checkpoints, resume, time limit, early stopping); this
module supplies what differs for a decoder-only model: the batches (next-token inputs and
labels), the loss (:func:`headlab.training.losses.causal_lm_loss`), and validation by
perplexity. The validation score is the negated mean loss (higher is better), so the trainer's
best checkpoint and patience rule work unchanged.
"""

from __future__ import annotations

import math

import torch

from headlab.capture import eval_mode, float32_mask_floor
from headlab.data.batching import token_budget_batches
from headlab.errors import HeadlabError, counted
from headlab.lm.data import collate_lm, encode_lm_corpus, read_text_corpus
from headlab.lm.model import LMRecipe, build_lm_config, create_lm
from headlab.nmt.tokenizer import run_tokenizer, train_tokenizer
from headlab.shard import new_accelerator
from headlab.training.config import TrainConfig
from headlab.training.corpus import EncodedCorpus
from headlab.training.loop import TrainResult, refuse_occupied_output, train
from headlab.training.losses import causal_lm_loss

__all__ = ["LMRecipe", "run_lm_recipe", "perplexity"]


@torch.no_grad()
def perplexity(model, corpus: EncodedCorpus, pad_id: int, max_tokens: int = 4096) -> dict:
    """Mean next-token loss (nats per subword, ``</s>`` included, ``<s>`` never predicted) and
    its exponential, over every sentence of ``corpus``; the model's mode is restored."""
    loss_sum, n_tokens = 0.0, 0
    device = next(model.parameters()).device
    plain = TrainConfig(label_smoothing=0.0)
    with eval_mode(model), float32_mask_floor(model):  # a float64 eager model's padding rows: as in training
        for indices in token_budget_batches(corpus, max_tokens, seed=0, epoch=0):
            batch = {k: v.to(device) for k, v in collate_lm(corpus, indices, pad_id).items()}
            batch_loss, batch_tokens = causal_lm_loss(model, batch, plain)
            loss_sum += batch_loss.item()
            n_tokens += batch_tokens
    loss = loss_sum / max(n_tokens, 1)
    return {"loss": loss, "perplexity": exp_or_inf(loss), "tokens": n_tokens}


def exp_or_inf(loss: float) -> float:
    """``exp(loss)``; infinity where it overflows a float (a loss above ~709.78 nats: math.exp raised
    OverflowError and a diverged model's validation crashed instead of being reported)."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def json_perplexity(result: dict) -> dict:
    """``result`` with an infinite perplexity as None (JSON null), which the JSON writers take: they refuse
    infinity (heads.json_text); the loss beside it is finite and says how large it was."""
    ppl = result.get("perplexity")
    return {**result, "perplexity": None} if isinstance(ppl, float) and math.isinf(ppl) else result


def run_lm_recipe(recipe: LMRecipe, accelerator=None, **hooks) -> TrainResult:
    """Train a language model as ``headlab lm train`` does; ``hooks`` go to the trainer."""
    accelerator = accelerator or new_accelerator()
    log = accelerator.print
    config = recipe.train
    refuse_occupied_output(config)
    text = read_text_corpus(recipe.train_files)
    log(f"training text: {text.summary()}")
    valid_text = read_text_corpus(recipe.valid_files) if recipe.valid_files else None
    if valid_text is not None:
        log(f"validation text: {valid_text.summary()}")

    tokenizer, trained = run_tokenizer(
        config.out_dir, recipe.tokenizer, config.resume,
        lambda: train_tokenizer(text.sentences, recipe.vocab_size, bos=True, model_max_length=recipe.model.max_positions))
    if trained:
        log(f"trained a BPE vocabulary of {len(tokenizer)} subwords")
    if tokenizer.bos_token_id is None:
        raise HeadlabError("the tokenizer has no BOS token; a language model's tokenizer must open each "
                           "sentence with one (train one with headlab lm train, without --tokenizer)")
    model = create_lm(build_lm_config(recipe.model, tokenizer), seed=config.seed)
    n_params = sum(p.numel() for p in model.parameters())
    train_data = encode_lm_corpus(tokenizer, text.sentences, recipe.model.max_positions)
    n_tokens = sum(len(ids) - 1 for ids in train_data.targets)
    log(f"model: {type(model).__name__}, d_model {recipe.model.d_model}, FFN {recipe.model.ffn_dim}, "
        f"{counted(recipe.model.layers, 'layer')} x {counted(recipe.model.n_heads, 'head')}, {n_params / 1e6:.1f}M parameters; "
        f"{n_tokens:,} training tokens per epoch"
        + (f" ({counted(train_data.n_truncated, 'sentence')} cut to {recipe.model.max_positions} tokens)"
           if train_data.n_truncated else ""))
    valid_data = None
    if valid_text is not None:
        valid_data = encode_lm_corpus(tokenizer, valid_text.sentences, recipe.model.max_positions)
    pad_id = tokenizer.pad_token_id

    def validate(raw_model, _tokenizer, valid, train_config) -> dict:
        result = perplexity(raw_model, valid, pad_id, max_tokens=train_config.max_tokens)
        return {"score": -result["loss"], **json_perplexity(result)}

    return train(model, tokenizer, train_data, valid_data, config, accelerator=accelerator,
                 compute_loss=causal_lm_loss, collate_fn=lambda corpus, indices: collate_lm(corpus, indices, pad_id),
                 validate_fn=validate, **hooks)
