"""Capture a model's readings with hooks of our own, for the float64 reference (``eigenhooks.monitor.reference``).

``Recorder`` registers its OWN forward hooks (not the monitor's taps) at the reading points
the adapter names, and turns each forward of the model into a ``reference.Recorded``: every
layer's pre, mid and post (and, post-norm, base = LN_t(pre) in float64), the valid-token mask,
each token's index among its sequence's valid tokens, and whether the forward continues the
previous one (a KV-cache step). Plainly:

- a module's calls in one forward are recorded in order; a module that several layers use
  (ALBERT's one shared layer) is called once per layer, so layer j's reading is its call
  number (how many of the layers using that module come before j);
- post(t) is read where the next layer's pre is read, so it is that layer's call;
- a parallel block (no mid tap) has mid = pre + the attention's output.
"""

from __future__ import annotations

import torch

from eigenhooks.models import get_adapter
from eigenhooks.monitor.reference import LayerReading, Recorded

_LAYER_MODULES = ("block", "attn_in", "attn_out", "norm", "mid_in", "pre_in", "mid_out")


class Recorder:
    """``with Recorder(model) as rec: model(...)``; then ``rec.forwards`` (list of ``reference.Recorded``)."""

    def __init__(self, model, points=("pre", "mid", "post")):
        self.adapter = get_adapter(model)
        self.model = self.adapter.model
        self.points = points
        self.forwards: list[Recorded] = []
        self._handles: list = []
        self._calls: dict[tuple, list[torch.Tensor]] = {}
        self._kwargs: dict | None = None
        self._seen: torch.Tensor | None = None  # (b,) valid tokens each open sequence had so far
        L = self.adapter.n_layers
        self._uses = {}  # module id -> the layers that call it, in order
        for j, ly in enumerate(self.adapter.layers):
            for name in _LAYER_MODULES:
                m = getattr(ly, name)
                if m is not None and j not in self._uses.setdefault(id(m), []):
                    self._uses[id(m)].append(j)
        self._taps = {i: self.adapter.reading_points(i) for i in range(L)}

    def _key(self, tap):
        if tap.hook_name is not None:
            return self.model.hook_dict[tap.hook_name], "output"
        return tap.module, tap.where

    def __enter__(self) -> Recorder:
        try:
            self._handles.append(self.model.register_forward_pre_hook(self._start, with_kwargs=True))
            self._handles.append(self.model.register_forward_hook(self._end))
            seen = set()
            for rp in self._taps.values():
                for tap in (rp.pre, rp.attn, rp.mid, rp.post):
                    if tap is None:
                        continue
                    module, where = self._key(tap)
                    if (id(module), where) in seen:
                        continue
                    seen.add((id(module), where))
                    self._handles.append(self._register(module, where))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _register(self, module, where):
        key = (id(module), where)
        if where == "input":

            def pre(mod, args, kwargs):
                x = kwargs.get("hidden_states", args[0] if args else None)
                self._record(key, x)

            return module.register_forward_pre_hook(pre, with_kwargs=True)

        def post(mod, args, output):
            self._record(key, output)

        return module.register_forward_hook(post)

    def _record(self, key, x) -> None:
        if self._kwargs is None:
            return
        x = x[0] if isinstance(x, tuple | list) else x
        self._calls.setdefault(key, []).append(x.detach().clone())

    def _start(self, module, args, kwargs) -> None:
        self._kwargs = dict(kwargs)
        self._calls = {}
        past = kwargs.get("past_key_values", kwargs.get("cache"))  # transformers 5 passes `cache`
        self._continues = past is not None and past.get_seq_length() > 0  # read before this forward adds to it

    def _end(self, module, args, output) -> None:
        kw, self._kwargs = self._kwargs, None
        readings = {i: self._layer(i) for i in range(self.adapter.n_layers)}
        b, n = readings[0].pre.shape[:2]
        mask = kw.get("attention_mask")
        mask = torch.ones(b, n, dtype=torch.bool) if mask is None else mask[:, -n:].bool()
        continues = self._continues
        start = self._seen if continues and self._seen is not None and self._seen.shape[0] == b else None
        index = mask.long().cumsum(1) - 1 + (0 if start is None else start[:, None])
        self._seen = index[:, -1] + 1
        self.forwards.append(Recorded(readings, mask, index, continues))

    def _call(self, tap, owner: int) -> torch.Tensor:
        """The tensor of the call of ``tap``'s module that belongs to layer ``owner``."""
        module, where = self._key(tap)
        uses = self._uses.get(id(module), [])
        return self._calls[(id(module), where)][uses.index(owner) if owner in uses else 0]

    def _layer(self, i: int) -> LayerReading:
        rp, ad = self._taps[i], self.adapter
        pre = self._call(rp.pre, i)
        mid = post = base = None
        if "mid" in self.points:
            mid = self._call(rp.mid, i) if rp.mid is not None else pre + self._call(rp.attn, i)
            mid = mid.reshape(pre.shape)
        if "post" in self.points:
            module, _ = self._key(rp.post)
            nxt = i + 1 < ad.n_layers and i + 1 in self._uses.get(id(module), [])
            post = self._call(rp.post, i + 1 if nxt else i).reshape(pre.shape)
        if rp.post_norm is not None:
            base = _layer_norm64(rp.post_norm, pre)
        return LayerReading(pre, mid, post, base)


def _layer_norm64(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """LN_t(x) in float64 with the norm's own parameters (nn.LayerNorm)."""
    if not isinstance(norm, torch.nn.LayerNorm):
        raise TypeError(f"the reference knows post-norm LayerNorm only, got {type(norm).__name__}")
    w = None if norm.weight is None else norm.weight.double()
    b = None if norm.bias is None else norm.bias.double()
    return torch.nn.functional.layer_norm(x.double(), norm.normalized_shape, w, b, norm.eps)
