"""Vision and multimodal towers: ViT, CLIP (text, vision, both)."""

from __future__ import annotations

FAMILIES: dict = {}
