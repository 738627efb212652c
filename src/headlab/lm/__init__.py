"""Decoder-only language models trained by headlab (Vig & Belinkov 2019's setting)."""
