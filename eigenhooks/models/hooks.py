"""The attachment of HF and TransformerLens models: hooks on their modules, telling the record one way.

``HookAttachment`` registers hooks (HF module hooks, or TransformerLens's wrapped forward and
HookPoints) and turns what the model runs into the record's events (``attach.Record``): a forward
starts (``CallFacts``: its rows, mask, whether it continues a KV cache, which untapped attentions
are in place), each reading of (layer, point), a stack of an encoder-decoder starts (with its
mask), the forward ends (whole or raised; hooks intact or not). It hears nothing back.

Where the taps go is laid out once (``TapLayout``): which call of a tapped module reads which
(layer, point). Registration is all-or-nothing, and every handle comes off in ``detach``; only the
handles registered here are ever removed. The monitor calls ``attach``, ``detach`` and
``detach_after_forward`` on entry and close, never during a forward.
"""

from __future__ import annotations

import sys
import threading
from contextlib import ExitStack
from typing import NamedTuple

import torch

from .attach import Attachment, CallFacts, Record, Warner

_compiling, _ident = torch.compiler.is_compiling, threading.get_ident  # looked up once: every tap calls them
_SEQ = (tuple, list)  # made once (``tuple | list`` makes a new union at every call)


def thread_key() -> int:
    """The running thread's key (threads sharing one model run forwards side by side); 0 while
    torch.compile traces a forward, which sees no threads (and could not trace the lookup)."""
    return 0 if _compiling() else _ident()


class TapLayout(NamedTuple):
    """Where the taps go and what each call reads, made once per set of layers."""

    attn_paths: dict  # layer -> (root, names, module): attentions with no tap (``attn_paths``)
    slots: dict  # (id(module), where) -> (module, where, {"uses", "roles"}) (``build_slots``)
    roles: dict  # (id(module), where) -> {call index: [(layer, point)]}
    once: dict  # (id(module), where) -> [(layer, point)] of a module called once a forward: no counting

    @classmethod
    def build(cls, adapter, layers: dict, points) -> TapLayout:
        """layers: {index: what is read there} with ``reading`` (``ReadingPoints``), ``mid_is_sum``,
        ``need_mid`` and ``last_point`` (the monitor's ``LayerPlan``)."""
        paths = attn_paths(adapter, layers, points)
        slots = build_slots(adapter, layers, points, set(paths))
        roles = {key: entry[2]["roles"] for key, entry in slots.items()}
        once = {k: r[0] for k, r in roles.items() if list(r) == [0] and len(slots[k][2]["uses"]) == 1}
        return cls(paths, slots, roles, once)


def attn_paths(adapter, layers: dict, points: tuple[str, ...]) -> dict:
    """layer -> (root, names, module) for the layers whose attention output needs no tap: mid has its
    own tap (a sequential block; in a parallel one mid = pre + attn) and completes the layer, so the
    attention tap would only tell that the attention ran. That is told instead by finding its module
    at its path (``HookAttachment.swapped``): HF, from the layer's block; TransformerLens, from the
    model by hook name (its ``hook_dict`` is built once and would not see a swapped HookPoint)."""
    out = {}
    calls = adapter.calls
    for i, lp in layers.items():
        if lp.mid_is_sum or not lp.need_mid or "mid" not in points or lp.last_point == "attn":
            continue
        tap = lp.reading.attn
        module, _ = calls.tap_module(adapter.model, tap)
        if calls.hook_points:
            root, names = adapter.model, tuple(tap.hook_name.split("."))
        else:
            root = adapter.layers[i].block
            names = next((tuple(n.split(".")) for n, m in root.named_modules() if m is module and n), None)
        if names is None:
            continue
        if _walk(root, names) is module:  # found where it is walked to
            out[i] = (root, names, module)
    return out


def _walk(root, names):
    m = root
    for n in names:
        m = m._modules.get(n) if isinstance(m, torch.nn.Module) else None
    return m


def build_slots(adapter, layers: dict, points: tuple[str, ...], untapped: set = frozenset()) -> dict:
    """(id(module), where) -> (module, where, {"uses", "roles"}): the roles of each of its calls in one
    forward, in order.

    A module shared by several layers (ALBERT) is called once per use, so its calls are matched to
    layers by order; post(t) is read at layer t+1's pre tap, one reading for both. The layers in
    ``untapped`` get no attention tap (``attn_paths``).
    """
    ad = adapter
    own_points = ad.calls.hook_points  # the model's own hook points, one per layer (TransformerLens)
    mods = [
        {id(m) for m in (ly.block, ly.attn_in, ly.attn_out, ly.norm, ly.mid_in, ly.pre_in, ly.mid_out) if m is not None}
        for ly in ad.layers
    ]
    slots: dict = {}

    def add(tap, owner: int | None, role):
        module, where = ad.calls.tap_module(ad.model, tap)
        key = (id(module), where)
        if key not in slots:
            uses = [i for i, s in enumerate(mods) if id(module) in s] if not own_points else []
            if len({ad.layers[j].group for j in uses}) > 1:
                # layers with different attention weights meet at this module (a decoder layer's block, or
                # the norm between its self- and cross-attention): it runs once for all of them
                uses = uses[:1]
            slots[key] = (module, where, {"uses": uses or [owner], "roles": {}})
        entry = slots[key][2]
        idx = entry["uses"].index(owner) if owner in entry["uses"] else 0
        entry["roles"].setdefault(idx, []).append(role)

    for i, lp in sorted(layers.items()):
        rp = lp.reading
        add(rp.pre, i, (i, "pre"))
        if i not in untapped:
            add(rp.attn, i, (i, "attn"))
        if "mid" in points and rp.mid is not None:
            add(rp.mid, i, (i, "mid"))
        if "post" in points:
            module, _ = ad.calls.tap_module(ad.model, rp.post)
            nxt = i + 1 < ad.n_layers and not own_points and id(module) in mods[i + 1]
            owner = i + 1 if nxt else (i if not own_points and id(module) in mods[i] else None)
            add(rp.post, owner, (i, "post"))
    return slots


class _PerThread:
    """A thread's own forward bookkeeping."""

    def __init__(self):
        self.open = False  # a forward of the model is running in this thread (started and not ended)
        self.counts: dict = {}  # calls of each slot in this forward
        self.root = None  # the stack root that opened this forward, when it ran outside the model's


class HookAttachment(Attachment):
    """Hooks on one HF or TransformerLens model, and the per-forward bookkeeping of which call reads what.

    Args:
        adapter: the model's adapter. layers, points: what is read (``TapLayout.build``). record:
            gets the events. warn: a ``Warner``. read_mask: read each call's padding mask (False: the
            monitor was given one). layout: a ``TapLayout`` made earlier for the same layers (a
            monitor entered again does not walk the model again).
    """

    def __init__(self, adapter, layers: dict, points, record: Record, warn: Warner, read_mask=True, layout=None):
        self.adapter, self.model, self.calls = adapter, adapter.model, adapter.calls
        self.record, self.warn, self.read_mask, self._layers = record, warn, read_mask, layers
        self.layout = layout if layout is not None else TapLayout.build(adapter, layers, points)
        self.attn_paths, self.slots = self.layout.attn_paths, self.layout.slots
        self.roles, self.once = self.layout.roles, self.layout.once
        self.n_slots, self.untapped = len(self.slots), frozenset(self.attn_paths)
        self._ran = None  # untapped attentions found in place at the last forward that started sequences
        self._threads: dict[int, _PerThread] = {}
        self._solo: _PerThread | None = None  # the bookkeeping of the only thread that ever ran a forward
        self._multi = False  # a second thread ran one: every tap looks its thread up
        self._stack: ExitStack | None = None
        self._handles: list = []  # (hook dict attribute's owner, attribute, id) of every hook
        self._raw: list = []  # (module, handle) of every hook registered
        self._inert: list = []  # model-level handles left to remove at the model's next call
        self._detach_after = False  # detach when the running forward ends (``detach_after_forward``)

    @property
    def attached(self) -> bool:
        return self._stack is not None

    @property
    def _here(self) -> _PerThread:
        key = thread_key()
        here = self._threads.get(key)
        if here is None:
            here = self._threads[key] = _PerThread()
            if len(self._threads) > 1:  # from now on taps look their thread up (set before this
                self._multi, self._solo = True, None  # thread's first tap; see _start for the order)
        return here

    def swapped(self) -> frozenset[int]:
        """Layers whose untapped attention module is no longer the one in place (another tool swapped it)."""
        return frozenset(i for i, (root, names, module) in self.attn_paths.items() if _walk(root, names) is not module)

    # ---- registration (the monitor's entry and close) ----
    def attach(self) -> None:
        """Register every hook, or none: if one fails, those already registered come off first."""
        self._stack = ExitStack()
        try:
            self._register()
        except BaseException:
            self.detach()
            raise

    def _hook(self, module, fn, kind: str, **kw) -> None:
        reg = {"pre": module.register_forward_pre_hook, "fwd": module.register_forward_hook}[kind]
        handle = reg(fn, **kw)
        self._stack.callback(handle.remove)
        self._raw.append((module, handle))
        self._handles.append((module, "_forward_pre_hooks" if kind == "pre" else "_forward_hooks", handle.id))

    def _register(self) -> None:
        ad = self.adapter
        if self.calls.hook_points:  # the model's forward is called directly: it is wrapped
            self._wrap_forward()
        else:
            self._hook(self.model, self._start, "pre", with_kwargs=True)
            self._hook(self.model, self._end, "fwd", always_call=True)
            for name, (root, mask_kw) in ad.stacks.items():
                self._hook(root, self._stack_start(name, mask_kw), "pre", with_kwargs=True)
                self._hook(root, self._stack_end, "fwd", always_call=True)
            self._wrap_generate()
        for key, (module, where, _) in self.slots.items():
            if where == "input":
                self._hook(module, self._tap_fn(key, True), "pre", with_kwargs=True)
            else:
                self._hook(module, self._tap_fn(key, False), "fwd")

    def _wrap_forward(self) -> None:
        """TransformerLens calls ``self.forward`` directly from run_with_hooks, bypassing module
        hooks, so the forward's start and end (and its input, for the mask) are caught here."""
        model, inner = self.model, self.model.forward

        def forward(*args, **kwargs):
            self._start(model, args, kwargs)
            ok = False
            try:
                out = inner(*args, **kwargs)
                ok = True
                return out
            finally:
                self._end(model, args, True if ok else None)

        self._patch("forward", forward)

    def _wrap_generate(self) -> None:
        """A decoder's ``generate`` is wrapped, so that its forwards are known as one call's steps: the
        input rows it was given (beams and returned sequences copy them), and steps that recompute the
        whole sequence (no KV cache). Encoder-decoders keep their stacks' own account."""
        gen = getattr(self.model, "generate", None)
        if gen is None or not callable(gen) or self.adapter.stacks:
            return
        record, calls = self.record, self.calls

        def generate(*args, **kwargs):
            record.generate_start(calls.input_rows(args, kwargs))
            try:
                return gen(*args, **kwargs)
            finally:
                record.generate_end()

        self._patch("generate", generate)

    def _patch(self, name: str, fn) -> None:
        """Set the model's own attribute ``name`` to fn until detached; then put back what was there (an
        instance attribute, or none), unless something else has replaced fn since."""
        model, prev = self.model, self.model.__dict__.get(name)
        setattr(model, name, fn)

        def restore():
            if model.__dict__.get(name) is fn:
                if prev is None:
                    delattr(model, name)
                else:
                    setattr(model, name, prev)

        self._stack.callback(restore)

    def detach(self) -> None:
        """Take every hook off (only our own)."""
        if self._stack is not None:
            self._stack.close()
        self._stack, self._handles, self._raw = None, [], []

    def detach_after_forward(self) -> None:
        self._detach_after = True

    def _detach_in_raising_forward(self) -> None:
        """Take the hooks off while torch iterates the model's forward hooks to call the always_call
        hooks of a raising forward: removing one of those now would break its loop, so the two
        model-level hooks come off at the model's next call (inert until then); the others now."""
        self._stack.pop_all()
        for module, handle in self._raw:
            if module is self.model:
                self._inert.append(handle)
            else:
                handle.remove()
        self._stack, self._handles, self._raw = None, [], []

    # ---- liveness ----
    def gone(self) -> list:
        """Modules from which one of our hooks was removed by something else."""
        return [m for m, attr, hid in self._handles if hid not in getattr(m, attr, {})]

    def check(self) -> bool:
        """Warn (once) and say True if another tool removed some of our hooks."""
        gone = self.gone()
        if gone:
            self.warn(
                "handles",
                f"{len(gone)} of the monitor's {len(self._handles)} hooks were removed by something else "
                f"(e.g. on {type(gone[0]).__name__}); another tool cleared the model's hooks (pyvene does). "
                "What ran after that was not measured: enter eh.monitor inside the other tool's context.",
            )
        return bool(gone)

    def in_forward(self) -> bool:
        """Whether the model's forward is running below us (not merely opened by a forward that
        was interrupted, e.g. by a KeyboardInterrupt caught since). nnsight runs a trace's body
        in a greenlet whose parent is suspended inside the forward: its stack counts too."""
        if not self._here.open or self.gone():
            return False
        frames = [sys._getframe(1)]
        gl = sys.modules.get("greenlet")
        g = gl.getcurrent().parent if gl is not None else None
        while g is not None:
            frames.append(g.gr_frame)
            g = g.parent
        for f in frames:
            while f is not None:
                if f.f_code.co_name == "_call_impl" and f.f_locals.get("self") is self.model:
                    return True
                f = f.f_back
        return False

    # ---- events ----
    def _start(self, module, args, kwargs, fresh: bool = False, mask=None) -> None:
        if self._inert:  # left by a close that waited for a forward which raised
            for handle in self._inert:
                handle.remove()
            self._inert = []
            return
        self.started += 1
        here = self._here
        here.open, here.counts, here.root = True, {}, None
        calls = self.calls
        continues = not fresh and calls.continues(args, kwargs)
        if not fresh and self.read_mask:  # fresh: hook lists, whose mask was read from the running forward
            mask = calls.mask(self.model, args, kwargs)
        if self._ran is None or not continues:  # walked per forward that starts sequences, not per step
            self._ran = self.untapped - self.swapped()
        rows = calls.rows(args, kwargs)
        mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
        self.record.forward_start(CallFacts(rows, mask, continues, self._ran))
        if not self._multi:
            # one thread so far: its taps skip the thread lookup. Written before the check, so a second
            # thread that set _multi in between is seen here, or wrote None after this.
            self._solo = here
            if self._multi:
                self._solo = None

    def _end(self, module, args, output) -> None:
        here = self._solo if self._solo is not None else self._here
        if not here.open:
            return
        here.open = False
        try:
            self.record.forward_end(output is not None, not self.check())  # None: the forward raised
        finally:
            if self._detach_after and self._stack is not None:
                self._detach_after = False
                if output is not None or self.calls.hook_points:  # returned, or a wrapped forward
                    self.detach()
                else:
                    self._detach_in_raising_forward()

    def _stack_start(self, name: str, mask_kw: str | None):
        """A stack's root starts: it runs in this forward, with its own mask (or opens a forward of its own,
        as ``generate`` runs an encoder-decoder's encoder once, outside the model's forward)."""

        def fn(module, args, kwargs):
            if not self._here.open:
                self._start(module, args, kwargs)
                self._here.root = module
            m = kwargs.get(mask_kw) if mask_kw else None
            self.record.stack_start(name, m if isinstance(m, torch.Tensor) and m.dim() == 2 else None)

        return fn

    def _stack_end(self, module, args, output):
        if self._here.root is module:
            self._end(module, args, output)

    def _tap_fn(self, key, input_: bool):
        """The hook of one tapped module: a pre-hook (module, args, kwargs) reading its input, or a forward
        hook (module, args, output) reading its output."""
        tap, roles, hidden, read_once = self.tap, self.once.get(key), self.calls.hidden, self.record.read_once

        def fn(module, args, third):
            x = hidden(args, third) if input_ else third[0] if isinstance(third, _SEQ) else third
            here = self._solo
            if roles is None or here is None or not here.open or not isinstance(x, torch.Tensor) or x.requires_grad:
                tap(key, x)
            else:  # the one thread's open forward, a module called once: no thread lookup, no count of calls
                read_once(roles, x)

        return fn

    def tap(self, key, x) -> None:
        """One call of a tapped module: its reading goes to each (layer, point) this call is for."""
        if not isinstance(x, torch.Tensor):
            return
        here = self._threads.get(thread_key())
        if here is None or not here.open:
            self.orphans += 1
            self.warn(
                "orphan",
                "the monitor's layer hooks ran outside a forward of the model it was given (a submodule "
                "called directly?); nothing was counted. Call the model passed to eh.monitor.",
            )
            return
        c = here.counts.get(key, 0)
        here.counts[key] = c + 1
        roles = self.roles[key].get(c)  # (layer, point) pairs this call of the module reads
        if not roles:
            return
        if x.requires_grad:
            x = x.detach()
        read = self.record.read
        for layer, point in roles:
            read(layer, point, x)

    # ---- TransformerLens run_with_hooks ----
    def fwd_hooks(self, running_mask) -> list[tuple[str, object]]:
        """[(hook_name, fn)] for ``run_with_hooks``: the first opens a forward (with the mask
        ``running_mask()`` finds), the one that completes the last layer ends it."""
        if not self.calls.hook_points:
            return super().fwd_hooks(running_mask)
        calls, model = self.calls, self.model
        first = self.adapter.reading_points(0).pre.hook_name
        last = self._layers[max(self._layers)]
        last_name = getattr(last.reading, last.last_point).hook_name
        hooks = []
        for key, (module, _, _) in self.slots.items():
            name = calls.hook_name(model, module)

            def fn(act, hook, key=key, name=name):
                if name == first:
                    self._start(model, (), {}, fresh=True, mask=running_mask())
                self.tap(key, act)
                if name == last_name and self._here.open:
                    self._end(model, (), True)

            hooks.append((name, fn))
        return hooks
