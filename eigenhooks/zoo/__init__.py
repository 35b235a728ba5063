"""Tiny models trained by eigenhooks and shipped in the wheel, loadable offline.

``load(name)`` returns (model, tokenizer) in eval mode. Rebuild them with
``python -m eigenhooks.zoo.train`` (see each model's README.md for its card).
"""

from __future__ import annotations

import json
from pathlib import Path

ZOO_DIR = Path(__file__).resolve().parent
NAMES = ("gpt2-tiny", "albert-tiny")
DEFAULT = "gpt2-tiny"


def path(name: str) -> Path:
    """Folder of a zoo model. Raises KeyError for an unknown name."""
    if name not in NAMES:
        raise KeyError(f"no zoo model named {name!r}; available: {', '.join(NAMES)}")
    p = ZOO_DIR / name
    if not (p / "config.json").exists():
        raise FileNotFoundError(
            f"zoo model {name!r} is missing from {p}; rebuild it with `python -m eigenhooks.zoo.train {name}`"
        )
    return p


def card(name: str) -> dict:
    """The model card (data, steps, losses) as a dict."""
    return json.loads((path(name) / "card.json").read_text())


def load(name: str = DEFAULT, dtype=None, device=None):
    """Load a zoo model and its tokenizer from the package, offline.

    Args:
        name: 'gpt2-tiny' (GPT2LMHeadModel, 4 layers) or 'albert-tiny' (AlbertForMaskedLM,
            one layer shared 4 times).
        dtype: optional torch dtype to load in (e.g. torch.float64 for exact checks).
        device: optional device.

    Returns:
        (model, tokenizer), the model in eval mode.

    Example:
        >>> model, tok = load("gpt2-tiny")
        >>> model.config.n_layer
        4
    """
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer

    p = path(name)
    cls = AutoModelForCausalLM if name.startswith("gpt2") else AutoModelForMaskedLM
    kwargs = {"local_files_only": True}
    if dtype is not None:
        kwargs["dtype"] = dtype
    model = cls.from_pretrained(p, **kwargs)
    if device is not None:
        model = model.to(device)
    tok = AutoTokenizer.from_pretrained(p, local_files_only=True)
    return model.eval(), tok


__all__ = ["DEFAULT", "NAMES", "card", "load", "path"]
