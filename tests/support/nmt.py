"""A tiny Marian translation model on Multi30k pairs, shared by the NMT, pruning and demo tests.

The setup these tests repeated: the first N pairs of the bundled Multi30k training data (at most
20 tokens a side), a BPE tokenizer trained on them, and a Marian model of d_model 32, 2+2 layers
x 4 heads built from that tokenizer. Nothing is downloaded. Importable from a test module and
from a worker script started by torchrun (its folder is on ``sys.path`` there too).
"""

from __future__ import annotations

from pathlib import Path

from headlab.data import read_parallel
from headlab.nmt.model import ModelConfig, build_marian_config, create_model
from headlab.nmt.tokenizer import train_tokenizer

DATA = Path(__file__).resolve().parents[2] / "data" / "multi30k"
TINY = ModelConfig(d_model=32, ffn_dim=64, encoder_layers=2, decoder_layers=2, n_heads=4, max_positions=64)


def tiny_corpus(n_pairs: int = 300):
    """The first ``n_pairs`` Multi30k training pairs of at most 20 tokens a side."""
    return read_parallel(DATA / "train.en.gz", DATA / "train.de.gz", max_tokens=20).subset(n_pairs)


def tiny_tokenizer(corpus, vocab_size: int = 400):
    """A BPE tokenizer trained on both sides of ``corpus``."""
    return train_tokenizer(corpus.sources + corpus.targets, vocab_size=vocab_size)


def tiny_marian(tokenizer, seed: int = 0):
    """A randomly initialised tiny Marian model (:data:`TINY`) for ``tokenizer``."""
    return create_model(build_marian_config(TINY, tokenizer), seed=seed)
