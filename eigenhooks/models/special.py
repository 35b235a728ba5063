"""Decoders with unusual attention: MoE/MLA/sinks (gpt_oss, deepseek_v3, llama4) and the attention layers of hybrids."""

from __future__ import annotations

FAMILIES: dict = {}
