"""The monitor's taps on the model: where they go, and the forward events they raise.

Taps are registered on the model (HF module hooks, or TransformerLens's forward and HookPoints)
and know nothing of sums. They turn what the model runs into a few events for their listener
(the ``Monitor``): a forward starts (the listener hands back what takes its readings: the taps
give each reading of (layer, point) straight to it), a stack of an encoder-decoder starts (with
its mask), the forward ends (whole or raised). They also answer whether
their hooks are still in place (another tool may have cleared them) and whether the model's
forward is running below the caller (a with-block closed inside nnsight's trace).

Registration is all-or-nothing and every handle comes off in ``remove``; only the handles the
taps registered are ever removed.
"""

from __future__ import annotations

import sys
import threading
import warnings
from contextlib import ExitStack
from typing import Protocol

import torch

from ..models import Adapter
from .layout import TapLayout
from .plan import Plan


class MeasurementWarning(UserWarning):
    """Something the monitor should have measured was not: hooks removed, bypassed or never reached."""


class Warner:
    """Each kind of ``MeasurementWarning`` once per monitor."""

    def __init__(self):
        self.said: set[str] = set()

    def __call__(self, key: str, msg: str) -> None:
        if key not in self.said:
            self.said.add(key)
            warnings.warn(msg, MeasurementWarning, stacklevel=4)

    def unmeasured(self, missing: list[int], partial: list[int]) -> None:
        """Layers a forward should have measured: not at all (missing), or without their delta (partial)."""
        if partial:
            self(
                "partial-layers",
                f"in layers {partial} the attention or the next sublayer was not seen (its module skipped, "
                "replaced or swapped by another tool, e.g. a swapped HookPoint): gamma_mid and rho stay NaN there",
            )
        if missing:
            self(
                "missing-layers",
                f"layers {missing} were not measured in a forward (their hooks did not fire: a block skipped, "
                "a module replaced or swapped by another tool, or hooks bypassed); their statistics stay NaN. "
                "A model compiled (torch.compile) before the monitor ignores hooks added later: enter eh.monitor "
                "before compiling, or call torch._dynamo.reset() after entering it.",
            )


class Reader(Protocol):
    """What takes one forward's readings (a ``forward.Forward``)."""

    lean: tuple | None  # ([role lists], [readings]) of a one-token step kept as it comes, else None

    def read(self, layer: int, point: str, x: torch.Tensor) -> None: ...
    def lean_start(self, untapped: int, once_ids: frozenset, known: list) -> None: ...


class Listener(Protocol):
    """What taps tell (the ``Monitor``)."""

    def forward_start(self, args, kwargs, fresh: bool = False, mask=None) -> Reader:
        """A forward starts in this thread; returns what takes its readings."""

    def stack_start(self, name: str, mask: torch.Tensor | None) -> None: ...
    def forward_end(self, ok: bool) -> None: ...
    def generate_start(self, rows: int | None) -> None: ...
    def generate_end(self) -> None: ...


_compiling, _ident = torch.compiler.is_compiling, threading.get_ident  # looked up once: every tap calls them
_SEQ = (tuple, list)  # made once (``tuple | list`` makes a new union at every call)


def thread_key() -> int:
    """The running thread's key (threads sharing one model run forwards side by side); 0 while
    torch.compile traces a forward, which sees no threads (and could not trace the lookup)."""
    return 0 if _compiling() else _ident()


class _PerThread:
    """A thread's own forward bookkeeping."""

    def __init__(self):
        self.open = False  # a forward of the model is running in this thread (started and not ended)
        self.counts: dict = {}  # calls of each slot in this forward
        self.root = None  # the stack root that opened this forward, when it ran outside the model's
        self.reader = None  # takes this forward's readings (the listener's, from forward_start)


class Taps:
    """The monitor's hooks on one model, and the per-forward bookkeeping of which call reads what.

    Args:
        adapter: the model's adapter. plan: what is measured. points: the reading points.
        listener: gets the forward's events. warn: a ``Warner``. layout: a ``TapLayout`` of the same
            plan, made by earlier taps (a monitor entered again does not walk the model again).
    """

    def __init__(self, adapter: Adapter, plan: Plan, points, listener: Listener, warn: Warner, layout=None):
        self.adapter, self.model = adapter, adapter.model
        self.listener, self.warn = listener, warn
        self.layout = layout if layout is not None else TapLayout.build(adapter, plan, points)
        self.attn_paths, self.slots = self.layout.attn_paths, self.layout.slots
        self.roles, self.once = self.layout.roles, self.layout.once
        self._lean = lean_layout(plan, self.layout)  # a one-token step may keep its readings as they come
        self._once_ids = frozenset(map(id, self.once.values()))
        self._lean_known: list = [None, None]  # the last step's order of readings and its layout (Forward)
        self._threads: dict[int, _PerThread] = {}
        self._solo: _PerThread | None = None  # the bookkeeping of the only thread that ever ran a forward
        self._multi = False  # a second thread ran one: every tap looks its thread up
        self.started = 0  # forwards whose start the taps saw (whole or not)
        self.orphans = 0  # tap calls that came outside any forward of the model
        self._stack: ExitStack | None = None
        self._handles: list = []  # (module, dict attribute, id) of every hook, to see if it is still there
        self._raw: list = []  # (module, handle) of every hook registered
        self._inert: list = []  # model-level handles left to remove at the model's next call

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
        """Layers whose untapped attention module is no longer the one in place (another tool swapped it):
        walked once per forward that starts sequences, not per decoding step."""
        out = []
        for layer, (root, names, module) in self.attn_paths.items():
            m = root
            for n in names:
                m = m._modules.get(n) if isinstance(m, torch.nn.Module) else None
            if m is not module:
                out.append(layer)
        return frozenset(out)

    @property
    def open(self) -> bool:
        """Whether a forward of the model is running in this thread."""
        return self._here.open

    # ---- registration ----
    def attach(self) -> None:
        """Register every hook, or none: if one fails, those already registered come off first."""
        self._stack = ExitStack()
        try:
            self._register()
        except BaseException:
            self.remove()
            raise

    def _hook(self, module, fn, kind: str, **kw) -> None:
        reg = {"pre": module.register_forward_pre_hook, "fwd": module.register_forward_hook}[kind]
        handle = reg(fn, **kw)
        self._stack.callback(handle.remove)
        self._raw.append((module, handle))
        self._handles.append((module, "_forward_pre_hooks" if kind == "pre" else "_forward_hooks", handle.id))

    def _register(self) -> None:
        ad = self.adapter
        if not ad.calls.module_hooks:  # the adapter says its model's forward is called directly
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

        def generate(*args, **kwargs):
            self.listener.generate_start(_input_rows(args, kwargs))
            try:
                return gen(*args, **kwargs)
            finally:
                self.listener.generate_end()

        self._patch("generate", generate)

    def _patch(self, name: str, fn) -> None:
        """Set the model's own attribute ``name`` to fn until the taps come off; then put back what was
        there (an instance attribute, or none), unless something else has replaced fn since."""
        model, prev = self.model, self.model.__dict__.get(name)
        setattr(model, name, fn)

        def restore():
            if model.__dict__.get(name) is fn:
                if prev is None:
                    delattr(model, name)
                else:
                    setattr(model, name, prev)

        self._stack.callback(restore)

    def remove(self) -> None:
        """Take every hook off (only the taps' own)."""
        if self._stack is not None:
            self._stack.close()
        self._stack, self._handles, self._raw = None, [], []

    def remove_in_raising_forward(self) -> None:
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
        """Modules from which one of the taps' hooks was removed by something else."""
        return [m for m, attr, hid in self._handles if hid not in getattr(m, attr, {})]

    def check_handles(self) -> bool:
        """Warn (once) and say True if another tool removed some of the taps' hooks."""
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
        here.reader = self.listener.forward_start(args, kwargs, fresh, mask)
        if self._lean and not self._multi:
            rows = self.adapter.calls.rows(args, kwargs)
            if rows is not None and rows[1] == 1:
                here.reader.lean_start(len(self.attn_paths), self._once_ids, self._lean_known)
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
        self.listener.forward_end(output is not None)  # None: the forward raised

    def _stack_start(self, name: str, mask_kw: str | None):
        """A stack's root starts: it runs in this forward, with its own mask (or opens a forward of its own,
        as ``generate`` runs an encoder-decoder's encoder once, outside the model's forward)."""

        def fn(module, args, kwargs):
            if not self._here.open:
                self._start(module, args, kwargs)
                self._here.root = module
            m = kwargs.get(mask_kw) if mask_kw else None
            self.listener.stack_start(name, m if isinstance(m, torch.Tensor) and m.dim() == 2 else None)

        return fn

    def _stack_end(self, module, args, output):
        if self._here.root is module:
            self._end(module, args, output)

    def _tap_fn(self, key, input_: bool):
        """The hook of one tapped module: a pre-hook (module, args, kwargs) reading its input, or a forward
        hook (module, args, output) reading its output."""
        tap, roles = self.tap, self.once.get(key)

        def fn(module, args, third):
            if input_:
                x = third.get("hidden_states", args[0] if args else None)
                if isinstance(x, _SEQ):
                    x = x[0]
            else:
                x = third[0] if isinstance(third, _SEQ) else third
            here = self._solo
            if roles is None or here is None or not here.open or not isinstance(x, torch.Tensor) or x.requires_grad:
                tap(key, x)
                return
            lean = here.reader.lean  # the one thread's open forward: no thread lookup, no count of calls
            if lean is not None:  # a one-token step: the reading kept as it came
                lean[0].append(roles)
                lean[1].append(x)
            else:
                for layer, point in roles:
                    here.reader.read(layer, point, x)

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
        reader = here.reader
        for layer, point in roles:
            reader.read(layer, point, x)

    # ---- TransformerLens run_with_hooks ----
    def fwd_hooks(self, plan: Plan, call_mask) -> list[tuple[str, object]]:
        """[(hook_name, fn)] for ``run_with_hooks``: the first opens a forward (with the mask
        ``call_mask()`` finds), the one that completes the last layer ends it."""
        first = self.adapter.reading_points(0).pre.hook_name
        last = plan.layers[max(plan.layers)]
        last_name = getattr(last.reading, last.last_point).hook_name
        hooks = []
        for key, (module, _, _) in self.slots.items():
            name = next(n for n, hp in self.model.hook_dict.items() if hp is module)

            def fn(act, hook, key=key, name=name):
                if name == first:
                    self._start(self.model, (), {}, fresh=True, mask=call_mask())
                self.tap(key, act)
                if name == last_name and self.open:
                    self._end(self.model, (), True)

            hooks.append((name, fn))
        return hooks


LEAN_POINTS = ("pre", "attn", "mid", "post")  # what ``forward.lean_order`` lays out


def lean_layout(plan: Plan, layout: TapLayout) -> bool:
    """Whether a one-token step may keep its readings as they come (``Forward.lean_start``): every tapped
    module is called once a forward, every layer is read alike (pre-norm, masked, one stack), and a step
    whose taps all fired has each layer's pre, last point, mid if needed and attention (tap or path)."""
    if len(layout.once) != len(layout.slots) or len({lp.stack for lp in plan.layers.values()}) > 1:
        return False
    read = {role for roles in layout.once.values() for role in roles}
    if any(point not in LEAN_POINTS for _, point in read):  # a reading the flush would not lay out
        return False
    return all(
        lp.post_norm is None and lp.masked and (i, "pre") in read and (i, lp.last_point) in read
        and (not lp.need_mid or (i, "mid") in read) and ((i, "attn") in read or i in layout.attn_paths)
        for i, lp in plan.layers.items()
    )  # fmt: skip


def _input_rows(args, kwargs) -> int | None:
    """The rows of the batch a ``generate`` call was given (before beams or returned sequences copy them)."""
    for x in (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), args[0] if args else None):
        if isinstance(x, torch.Tensor) and x.dim() >= 2:
            return x.shape[0]
    return None
