"""The translation model: a transformers ``MarianMTModel`` built from a ``MarianConfig``.

Marian is the post-layer-norm Transformer of Vaswani et al. 2017 (sinusoidal positions,
scaled embeddings), which is also the model Voita et al. 2019 analyse. The default size is
CPU-friendly (d_model 256, FFN 1024); ``d_model=512, ffn_dim=2048`` is the paper's base size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, MarianConfig, MarianMTModel

from headlab.errors import HeadlabError
from headlab.nmt.config import ModelConfig

__all__ = ["ModelConfig", "build_marian_config", "create_model", "load_translation_model"]


def build_marian_config(model: ModelConfig, tokenizer) -> MarianConfig:
    """A MarianConfig for a joint vocabulary: shared, tied embeddings; ``<pad>`` starts decoding."""
    if model.d_model % model.n_heads:
        raise HeadlabError(f"d_model {model.d_model} is not divisible by n_heads {model.n_heads}")
    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    if pad_id is None or eos_id is None:
        raise HeadlabError("the tokenizer needs a pad and an eos token")
    vocab_size = len(tokenizer)
    return MarianConfig(
        vocab_size=vocab_size,
        decoder_vocab_size=vocab_size,
        d_model=model.d_model,
        encoder_layers=model.encoder_layers,
        decoder_layers=model.decoder_layers,
        encoder_attention_heads=model.n_heads,
        decoder_attention_heads=model.n_heads,
        encoder_ffn_dim=model.ffn_dim,
        decoder_ffn_dim=model.ffn_dim,
        dropout=model.dropout,
        attention_dropout=model.attention_dropout,
        activation_dropout=0.0,
        activation_function=model.activation_function,
        max_position_embeddings=model.max_positions,
        scale_embedding=True,  # embeddings times sqrt(d_model), Vaswani et al. 2017, Sec. 3.4
        share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        forced_eos_token_id=eos_id,
        decoder_start_token_id=pad_id,
        bos_token_id=None,
    )


def default_generation_config(config: MarianConfig, num_beams: int = 4) -> GenerationConfig:
    return GenerationConfig(
        num_beams=num_beams,
        max_length=config.max_position_embeddings,
        pad_token_id=config.pad_token_id,
        eos_token_id=config.eos_token_id,
        forced_eos_token_id=config.eos_token_id,
        decoder_start_token_id=config.decoder_start_token_id,
    )


def create_model(config: MarianConfig, *, seed: int | None = None, attn_implementation: str = "sdpa") -> MarianMTModel:
    """A freshly initialised model (seeded, so every rank builds the same weights)."""
    if seed is not None:
        torch.manual_seed(seed)
    model = MarianMTModel._from_config(config, attn_implementation=attn_implementation)
    model.generation_config = default_generation_config(config)
    return model


def load_translation_model(path: str | Path, *, attn_implementation: str = "sdpa", dtype=torch.float32, device=None,
                           device_map=None) -> MarianMTModel:
    """Load a translation model with headlab's one loader (:func:`headlab.loading.load_model`):
    safetensors only, never pickles, and a pruned directory rebuilt with its heads removed."""
    from headlab.loading import load_model

    path = Path(path)
    if not (path / "config.json").is_file():
        raise HeadlabError(f"no model in {path} (expected config.json and model.safetensors)")
    model: Any = load_model(str(path), dtype=torch.float32 if dtype is None else dtype, device=device,
                            device_map=device_map, attn_implementation=attn_implementation)
    if not model.config.is_encoder_decoder:
        raise HeadlabError(f"{path}: a {model.config.model_type} model, not a translation (encoder-decoder) model")
    return model
