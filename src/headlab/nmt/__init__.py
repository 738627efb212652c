"""Transformer translation models: tokenizer, config, training, translation, BLEU."""
