"""The language model: a transformers GPT-2 or Llama-style decoder built from a small config.

``gpt2`` is Vig & Belinkov's architecture (learned absolute positions, post-attention MLP with
GELU, LayerNorm). ``llama`` uses rotary positions, RMSNorm and a SwiGLU MLP; at the same width
and data it forms relative-position heads sooner (measured on this project's machine: a
previous-token head at 67% after 4.4M tokens against 43% after 7.4M for GPT-2), which is why
the bundled English LM uses it. Both share tied input/output embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from headlab.errors import HeadlabError
from headlab.options import option
from headlab.training.config import TrainConfig

__all__ = ["LMConfig", "LMRecipe", "lm_training", "ARCHITECTURES", "build_lm_config", "create_lm"]

ARCHITECTURES = ("llama", "gpt2")


@dataclass
class LMConfig:
    """Decoder size. Maps one to one onto ``headlab lm train`` flags."""

    arch: str = option("llama", "llama: rotary positions, RMSNorm, SwiGLU; gpt2: learned positions "
                       "(Vig & Belinkov's)", choices=ARCHITECTURES)
    d_model: int = option(256, "model width", range="[1, inf)")
    # SwiGLU for llama: three matrices of this width
    ffn_dim: int = option(1024, "MLP inner width", flag="ffn", range="[1, inf)")
    layers: int = option(6, "decoder layers", range="[1, inf)")
    n_heads: int = option(8, "attention heads per layer", flag="heads", range="[1, inf)")
    dropout: float = option(0.1, "residual and embedding dropout (gpt2; Llama has none)", range="[0, 1)")
    attention_dropout: float = option(0.1, "dropout of the attention weights", range="[0, 1)")
    max_positions: int = option(256, "longest input; longer sentences are cut (and counted in the log)", range="[2, inf)")


@dataclass
class LMRecipe:
    """``headlab lm train``: the text, the tokenizer, the model and the loop."""

    train_files: list[str] = option(help="training text: one sentence a line (plain or .gz), or CoNLL-U treebanks "
                                    "(.conllu[.gz])", flag="train", nargs="+", metavar="FILE")
    valid_files: list[str] = field(default_factory=list, metadata={
        "help": "validation text (perplexity after each epoch)", "flag": "valid", "nargs": "+", "metavar": "FILE"})
    tokenizer: str | None = option(None, "use this saved tokenizer (with a BOS token) instead of training one")
    vocab_size: int = option(8000, "BPE vocabulary size")
    model: LMConfig = field(default_factory=LMConfig)
    train: TrainConfig = field(default_factory=lambda: lm_training())


def lm_training() -> TrainConfig:
    """The loop's options for a language model: no label smoothing, early stopping on the loss."""
    return TrainConfig(label_smoothing=0.0, patience=2, min_improvement=0.01, max_epochs=100)


def build_lm_config(model: LMConfig, tokenizer):
    """A ``LlamaConfig`` or ``GPT2Config`` for ``tokenizer``'s vocabulary, embeddings tied."""
    from transformers import GPT2Config, LlamaConfig

    if model.arch not in ARCHITECTURES:
        raise HeadlabError(f"--arch must be one of {', '.join(ARCHITECTURES)}, got {model.arch!r}")
    if model.d_model % model.n_heads:
        raise HeadlabError(f"--d-model {model.d_model} is not divisible by --heads {model.n_heads}")
    pad_id, bos_id, eos_id = tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id
    if pad_id is None or bos_id is None or eos_id is None:
        raise HeadlabError("a language model's tokenizer needs pad, bos and eos tokens")
    common = dict(vocab_size=len(tokenizer), pad_token_id=pad_id, bos_token_id=bos_id, eos_token_id=eos_id,
                  tie_word_embeddings=True)
    if model.arch == "llama":
        return LlamaConfig(
            hidden_size=model.d_model, intermediate_size=model.ffn_dim, num_hidden_layers=model.layers,
            num_attention_heads=model.n_heads, num_key_value_heads=model.n_heads,
            max_position_embeddings=model.max_positions, attention_dropout=model.attention_dropout,
            **common,
        )
    return GPT2Config(
        n_embd=model.d_model, n_inner=model.ffn_dim, n_layer=model.layers, n_head=model.n_heads,
        n_positions=model.max_positions, resid_pdrop=model.dropout, embd_pdrop=model.dropout,
        attn_pdrop=model.attention_dropout, **common,
    )


def create_lm(config, *, seed: int | None = None, attn_implementation: str = "sdpa"):
    """A freshly initialised causal LM (seeded, so every rank builds the same weights)."""
    import torch  # here, not at the top: the command line reads ARCHITECTURES at start-up
    from transformers import AutoModelForCausalLM

    if seed is not None:
        torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    return model
