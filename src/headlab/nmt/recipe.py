"""The translation recipe end to end: read data, train a tokenizer, build the model, train."""

from __future__ import annotations

from headlab.data import read_parallel
from headlab.errors import counted
from headlab.nmt.config import TrainRecipe
from headlab.nmt.model import build_marian_config, create_model
from headlab.nmt.tokenizer import run_tokenizer, train_tokenizer
from headlab.nmt.train import train
from headlab.shard import new_accelerator
from headlab.training.loop import TrainResult, refuse_occupied_output

__all__ = ["TrainRecipe", "run_recipe"]


def run_recipe(recipe: TrainRecipe, accelerator=None, **hooks) -> TrainResult:
    """Train a translation model as ``headlab nmt train`` does; ``hooks`` go to :func:`train`."""
    accelerator = accelerator or new_accelerator()
    log = accelerator.print
    config = recipe.train
    refuse_occupied_output(config)
    corpus = read_parallel(recipe.train_src, recipe.train_tgt, max_tokens=recipe.max_sentence_tokens)
    if recipe.limit:
        corpus = corpus.subset(recipe.limit)
    log(f"training data: {corpus.summary()}")
    valid = None
    if recipe.valid_src:
        assert recipe.valid_tgt is not None  # the CLI refuses one without the other
        valid = read_parallel(recipe.valid_src, recipe.valid_tgt)
        log(f"validation data: {valid.summary()}")

    # Every rank trains the same (deterministic) vocabulary; no file race between ranks.
    tokenizer, trained = run_tokenizer(config.out_dir, recipe.tokenizer, config.resume,
                                       lambda: train_tokenizer(corpus.sources + corpus.targets, recipe.vocab_size))
    if trained:
        log(f"trained a joint BPE vocabulary of {len(tokenizer)} subwords")
    marian_config = build_marian_config(recipe.model, tokenizer)
    model = create_model(marian_config, seed=config.seed)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: MarianMTModel, d_model {recipe.model.d_model}, FFN {recipe.model.ffn_dim}, "
        f"{recipe.model.encoder_layers}+{recipe.model.decoder_layers} layers x {counted(recipe.model.n_heads, 'head')}, "
        f"{n_params / 1e6:.1f}M parameters")
    return train(model, tokenizer, corpus, valid, config, accelerator=accelerator, **hooks)
