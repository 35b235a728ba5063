"""What a call of the model is, as its adapter reads it: its mask, its rows, whether it continues a
KV cache, and how its start and end are seen. The monitor reads no call keyword itself: the
attachment (``hooks.HookAttachment``) asks these.

``Calls`` reads HF calls (``attention_mask``, ``input_ids`` / ``inputs_embeds``, ``past_key_values``
or transformers 5's ``cache``, ``cache_position``). ``LensCalls`` reads TransformerLens ones: a batch
of strings is padded by the model without telling any hook, ``run_with_hooks`` passes no mask to
hooks, and the model's ``forward`` is called directly (module hooks on the model never fire).
"""

from __future__ import annotations

import torch


class Calls:
    """An HF model's calls.

    Attributes:
        hook_points: the model has its own named hook points, one per layer and reading (TransformerLens):
            its ``forward`` is wrapped (module hooks on the model never fire), it takes hook lists
            (``run_with_hooks``; ``Monitor.fwd_hooks``), and its taps are found by name. Else reading
            points are modules matched to their layers by identity, and the forward's start and end
            are seen by hooks on the model's module.
    """

    hook_points = False

    def mask(self, model, args, kwargs) -> torch.Tensor | None:
        """The padding mask this call was given (None: every position counts)."""
        return kwargs.get("attention_mask")

    def running_mask(self, model) -> torch.Tensor | None:
        """The mask of the forward now running, for hooks that see only activations (hook lists)."""
        return None

    def rows(self, args, kwargs) -> tuple[int, int] | None:
        """(rows, positions) of this call's input, or None when it has no (b, n, ...) tensor input."""
        x = kwargs.get("input_ids", kwargs.get("inputs_embeds", args[0] if args else None))
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            return None
        return x.shape[0], x.shape[1]

    def input_rows(self, args, kwargs) -> int | None:
        """The rows of the batch a ``generate`` call was given (before beams or returned sequences copy them)."""
        for x in (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), args[0] if args else None):
            if isinstance(x, torch.Tensor) and x.dim() >= 2:
                return x.shape[0]
        return None

    @staticmethod
    def hidden(args, kwargs):
        """The residual a module's pre-hook sees: its ``hidden_states`` (by keyword or first)."""
        x = kwargs.get("hidden_states", args[0] if args else None)
        return x[0] if isinstance(x, tuple | list) else x

    def tap_module(self, model, tap):
        """(module, "input" | "output") a ``Tap`` reads."""
        return tap.module, tap.where

    def hook_name(self, model, module) -> str:
        raise TypeError("fwd_hooks() is for TransformerLens models; HF models are hooked by the with-block")

    def continues(self, args, kwargs) -> bool:
        """True when this forward extends the previous one's sequences (a KV-cache step).

        Read without waiting for the device where possible: a mask wider than the positions computed,
        a cache whose length is a host int, a ``cache_position`` on the CPU. Only a cache that keeps its
        length on the device, with no such mask, costs one read.
        """
        past = kwargs.get("past_key_values", kwargs.get("cache"))  # transformers 5 passes `cache`
        cp = kwargs.get("cache_position")
        if past is None and not isinstance(cp, torch.Tensor):
            return False
        mask = kwargs.get("attention_mask")
        x = kwargs.get("input_ids", kwargs.get("inputs_embeds", args[0] if args else None))
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and isinstance(x, torch.Tensor) and x.dim() >= 2:
            return mask.shape[1] > x.shape[1]
        if isinstance(cp, torch.Tensor) and cp.numel() and cp.device.type == "cpu":
            return bool(cp.reshape(-1)[0] > 0)
        if past is not None:
            try:
                length = past.get_seq_length()
            except (AttributeError, TypeError):
                return bool(past)
            if isinstance(length, int):
                return length > 0
            if not isinstance(cp, torch.Tensor):
                return int(length) > 0
        return bool(cp.numel() and cp.reshape(-1)[0] > 0)


class LensCalls(Calls):
    """A TransformerLens model's calls: its forward wrapped, its hook lists, its own hook points; the
    mask of a padded batch of strings read back (``lens_string_mask``)."""

    hook_points = True

    def mask(self, model, args, kwargs):
        m = kwargs.get("attention_mask")
        return m if m is not None else lens_string_mask(model, args, kwargs)

    def running_mask(self, model):
        return lens_call_mask(model)

    def tap_module(self, model, tap):
        return model.hook_dict[tap.hook_name], "output"

    def hook_name(self, model, module) -> str:
        return next(n for n, hp in model.hook_dict.items() if hp is module)


def lens_call_mask(model):
    """The padding mask of the TransformerLens forward now running (for ``fwd_hooks``, whose
    hooks see only activations): the ``attention_mask`` run_with_hooks passed on, else the
    mask of a batch of strings. Read from the bridge's forward frame; None if not found."""
    import sys

    f = sys._getframe(3)  # past Calls.running_mask
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
