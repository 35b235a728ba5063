"""TransformerLens: the monitor's hooks as ``run_with_hooks`` pairs, and the masks TransformerLens hides.

A mixin of ``Monitor``. TransformerLens 4 bridges hook through HookPoints; the monitor either
wraps the bridge's forward (``with eh.monitor(bridge)``) or hands out ``fwd_hooks()``.
"""

from __future__ import annotations

import torch


class MonitorLens:
    """The TransformerLens half of ``Monitor``."""

    def _wrap_lens_forward(self) -> None:
        """TransformerLens calls ``self.forward`` directly from run_with_hooks, bypassing module
        hooks, so the forward's start and end (and its input, for the mask) are caught here."""
        model, prev = self.model, self.model.__dict__.get("forward")
        inner = model.forward

        def forward(*args, **kwargs):
            self._on_model_start(model, args, kwargs)
            ok = False
            try:
                out = inner(*args, **kwargs)
                ok = True
                return out
            finally:
                self._on_model_end(model, args, True if ok else None)

        model.forward = forward

        def restore():
            if model.__dict__.get("forward") is forward:
                if prev is None:
                    del model.forward
                else:
                    model.forward = prev

        self._stack.callback(restore)

    def fwd_hooks(self) -> list[tuple[str, object]]:
        """[(hook_name, fn)] for TransformerLens ``run_with_hooks`` (create the monitor with attach=False).

        run_with_hooks hides the call's ``attention_mask`` and string input from hooks, so the
        first hook reads them from the bridge's running forward; ``eh.monitor(..., attention_mask=)``
        overrides that.
        """
        if self.adapter.backend != "lens":
            raise TypeError("fwd_hooks() is for TransformerLens models; HF models are hooked by the with-block")
        if self._stack is not None:
            raise RuntimeError(
                "this monitor is already attached to the model; create it with attach=False to use fwd_hooks()"
            )
        self._prepare()
        self._slots = self._build_slots()
        self._index_slots()
        first = self.adapter.reading_points(0).pre.hook_name
        last_layer = max(self._layers)
        last = self._layers[last_layer]["rp"]
        last_name = (
            getattr(last, self._last_point(last_layer)).hook_name
            if self._last_point(last_layer) != "attn"
            else last.attn.hook_name
        )
        hooks = []
        for key, (module, _, _) in self._slots.items():
            name = next(n for n, hp in self.model.hook_dict.items() if hp is module)

            def fn(act, hook, key=key, name=name):
                if name == first:
                    self._end_sequences()
                    self._reset_forward(open_=True)
                    self._mask = self.explicit_mask if self.explicit_mask is not None else lens_call_mask(self.model)
                self._on_tap(key, act)
                if name == last_name and self._open:
                    self._check_forward()
                    self._commit_logged()
                    self._reset_forward(open_=False)

            hooks.append((name, fn))
        return hooks


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
