"""TransformerLens: the masks TransformerLens hides from hooks.

``run_with_hooks`` passes no ``attention_mask`` to hooks, and a batch of strings is padded
without telling any hook. These read them back, for the monitor's forward (``taps.Taps`` drives
TransformerLens forwards through the same events as HF ones).
"""

from __future__ import annotations

import torch


def lens_call_mask(model):
    """The padding mask of the TransformerLens forward now running (for ``fwd_hooks``, whose
    hooks see only activations): the ``attention_mask`` run_with_hooks passed on, else the
    mask of a batch of strings. Read from the bridge's forward frame; None if not found."""
    import sys

    f = sys._getframe(2)
    while f is not None:
        loc = f.f_locals
        if f.f_code.co_name == "forward" and loc.get("self") is model and "input" in loc:
            mask = loc.get("attention_mask")
            if isinstance(mask, torch.Tensor):
                return mask
            kw = {"prepend_bos": loc.get("prepend_bos"), "padding_side": loc.get("padding_side")}
            return lens_string_mask(model, (loc["input"],), kw)
        f = f.f_back
    return None


def lens_string_mask(model, args, kwargs):
    """The padding mask TransformerLens builds for a batch of strings (it pads, and tells no hook)."""
    inp = kwargs.get("input", args[0] if args else None)
    if not (isinstance(inp, list) and len(inp) > 1 and all(isinstance(s, str) for s in inp)):
        return None
    tok = getattr(model, "tokenizer", None)
    if tok is None or tok.pad_token_id is None:
        return None
    try:  # TransformerLens 4 moved utils to utilities (same names)
        from transformer_lens.utilities import get_attention_mask
    except ImportError:
        from transformer_lens.utils import get_attention_mask

    side = kwargs.get("padding_side") or getattr(tok, "padding_side", "right")
    prepend = kwargs.get("prepend_bos")
    ids = model.to_tokens(inp, prepend_bos=prepend, padding_side=side)
    bos = getattr(model.cfg, "default_prepend_bos", True) if prepend is None else prepend
    return get_attention_mask(tok, ids, prepend_bos=bos, padding_side=side)
