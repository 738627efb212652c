"""Tiny random models built from configs (hidden 32, 2 layers, 4 heads, vocab 99): no downloads."""

from __future__ import annotations

import torch
import transformers as tf

VOCAB = 99

CONFIGS = {
    "marian": lambda: (tf.MarianMTModel, tf.MarianConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=37, decoder_ffn_dim=37, pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0, max_position_embeddings=64)),
    "bart": lambda: (tf.BartForConditionalGeneration, tf.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=37, decoder_ffn_dim=37, pad_token_id=1, bos_token_id=0,
        eos_token_id=2, decoder_start_token_id=2, max_position_embeddings=64)),
    "bert": lambda: (tf.BertForMaskedLM, tf.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
        max_position_embeddings=64)),
    "roberta": lambda: (tf.RobertaForMaskedLM, tf.RobertaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
        max_position_embeddings=70, pad_token_id=1)),
    "distilbert": lambda: (tf.DistilBertForMaskedLM, tf.DistilBertConfig(
        vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=37, max_position_embeddings=64)),
    "gpt2": lambda: (tf.GPT2LMHeadModel, tf.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)),
    "t5": lambda: (tf.T5ForConditionalGeneration, tf.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4, pad_token_id=0,
        eos_token_id=1, decoder_start_token_id=0)),
    "llama": lambda: (tf.LlamaForCausalLM, tf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=1, pad_token_id=2)),
    "qwen2": lambda: (tf.Qwen2ForCausalLM, tf.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=1, pad_token_id=2)),
}
FAMILIES = tuple(CONFIGS)
SEQ2SEQ = {"marian", "bart", "t5"}


def tiny_model(family: str, seed: int = 0, attn_implementation: str = "sdpa") -> torch.nn.Module:
    cls, config = CONFIGS[family]()
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = cls(config).eval()
    # Non-zero biases everywhere, so that bias handling is exercised by the invariants.
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 0.1)
    return model


def tiny_inputs(family: str, batch: int = 2, src_len: int = 7, tgt_len: int = 5, seed: int = 1, pad: bool = True):
    """Random token ids with padding at the end of the second sequence."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, src_len), generator=g)
    mask = torch.ones(batch, src_len, dtype=torch.long)
    if pad and batch > 1:
        mask[1, -2:] = 0
    inputs = {"input_ids": ids, "attention_mask": mask}
    if family in SEQ2SEQ:
        inputs["decoder_input_ids"] = torch.randint(3, VOCAB, (batch, tgt_len), generator=g)
    return inputs


def logits(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


# -- encoder-decoders outside transformers' attention interface (their checks: tests/support/seq2seq_families.py) ------
# 2 + 2 layers, 4 heads of 8, d_model 32, float64; biases and norm weights moved off their initial values (zeros and
# ones would hide a bias or norm that pruning or masking mishandles).

LED_WINDOWS = [4, 8]
"""LED's per-layer attention windows: a query sees 2 and 4 keys each side (each divides the largest: the encoder pads
to 8's multiple)."""


def _moved_off(model: torch.nn.Module) -> torch.nn.Module:
    """Biases drawn from N(0, 0.1), layer-norm weights from N(1, 0.1), in parameter order; ``model`` in float64."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 0.1)
            elif "layer_norm" in name or "layernorm" in name:
                parameter.normal_(1, 0.1)
    return model.double()


def tiny_fsmt(seed: int = 0, pad: int = 2, eos: int = 1, src_vocab: int = VOCAB) -> torch.nn.Module:
    """A tiny FSMTForConditionalGeneration (fairseq's WMT19 Transformers). Its position tables' size depends on the
    padding id: a tokenizer's ids are given here, not set after."""
    config = tf.FSMTConfig(
        langs=["en", "de"], src_vocab_size=src_vocab, tgt_vocab_size=VOCAB, d_model=32, encoder_layers=2,
        decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=37, decoder_ffn_dim=37,
        max_position_embeddings=64, pad_token_id=pad, bos_token_id=0 if eos else 1, eos_token_id=eos,
        decoder_start_token_id=eos, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return _moved_off(tf.FSMTForConditionalGeneration(config).eval())


def mvp_config(**extra) -> tf.MvpConfig:
    """A tiny MVP's config (BART's layout, pad 2, bos 0, eos 1); ``extra``: MvpConfig's fields that differ."""
    return tf.MvpConfig(**{**dict(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=37, decoder_ffn_dim=37, max_position_embeddings=64, pad_token_id=2,
        bos_token_id=0, eos_token_id=1, decoder_start_token_id=1), **extra})


def tiny_mvp(cls=tf.MvpForConditionalGeneration, seed: int = 0, **extra) -> torch.nn.Module:
    """A tiny MVP (RUCAIBox/mvp) of class ``cls`` (MvpForCausalLM: its decoder alone); ``extra``: :func:`mvp_config`'s."""
    torch.manual_seed(seed)
    return _moved_off(cls(mvp_config(**extra)).eval())


def tiny_led(**extra) -> torch.nn.Module:
    """A tiny LEDForConditionalGeneration (Longformer's attention in the encoder, windows :data:`LED_WINDOWS`; BART's
    old attention in the decoder; pad 1, bos 0, eos 2), eager; ``extra``: LEDConfig's fields that differ."""
    from support.family_matrix import perturbed_model  # (family_matrix imports this module)

    config = tf.LEDConfig(**{**dict(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=37, decoder_ffn_dim=37, max_encoder_position_embeddings=64,
        max_decoder_position_embeddings=64, attention_window=LED_WINDOWS, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        decoder_start_token_id=2), **extra})
    return perturbed_model(tf.LEDForConditionalGeneration, config, attn_implementation="eager").double()
