"""Encoder-decoders: T5, BART, mBART, Whisper (encoder self-attention, decoder self- and cross-attention)."""

from __future__ import annotations

FAMILIES: dict = {}
