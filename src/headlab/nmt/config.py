"""The options of translation training: model size and recipe (the loop's are
:class:`headlab.training.config.TrainConfig`). Plain values; importing this module costs no torch
(``headlab nmt train`` generates its flags from them, :mod:`headlab.options`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from headlab.options import option
from headlab.training.config import TrainConfig

__all__ = ["ModelConfig", "TrainRecipe"]


@dataclass
class ModelConfig:
    """Transformer size. Maps one to one onto ``headlab nmt train`` flags."""

    d_model: int = option(256, "model width (paper's base: 512)", range="[1, inf)")
    ffn_dim: int = option(1024, "feed-forward inner width (paper's base: 2048)", flag="ffn", range="[1, inf)")
    encoder_layers: int = 6
    decoder_layers: int = 6
    n_heads: int = option(8, "attention heads per block (enc_self, dec_self, dec_cross)", flag="heads", range="[1, inf)")
    dropout: float = option(0.1, "dropout of the residual connections and embeddings", range="[0, 1)")
    attention_dropout: float = option(0.1, "dropout of the attention weights", range="[0, 1)")
    activation_function: str = "relu"  # Vaswani et al. 2017, Sec. 3.3
    max_positions: int = option(256, "longest input in tokens", range="[2, inf)")


@dataclass
class TrainRecipe:
    """``headlab nmt train``: the data, the tokenizer, the model and the loop."""

    train_src: str = option(help="training source file (plain or .gz)")
    train_tgt: str = option(help="training target file")
    valid_src: str | None = option(None, "validation source file (BLEU after each epoch)")
    valid_tgt: str | None = option(None, "validation target file")
    tokenizer: str | None = option(None, "use this saved tokenizer instead of training one")
    vocab_size: int = option(8000, "joint BPE vocabulary size")
    max_sentence_tokens: int | None = option(100, "cut longer training sentences to this many whitespace tokens")
    limit: int | None = option(None, "use only the first N training pairs")
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
