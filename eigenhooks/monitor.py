"""Hooks at run time: attach, capture (pre, mid, post), reduce to statistics, detach.

``with eh.monitor(model) as mon: model(**batch)`` measures every forward pass inside the
block, including ``generate`` with a KV cache (only newly computed positions are seen, so
each position counts once, and a sequence stays one cluster across its forwards). For
encoder-decoders (``Adapter.stacks``) a forward expects only the stacks that ran in it: ``generate``
runs the encoder once, on its own (it counts as a forward), then the decoder once per step.

Values are read where the model consumes them (the reading-point contract, DESIGN.md §1):
``pre`` at the input of the attention's norm, ``mid`` at the input of the MLP's norm (the
post-attention norm's output in post-norm models), ``post`` at the next block's input. An
edit by any other tool or hook upstream of those points, registered before or after the
monitor, is therefore measured as the model computed it. The limit: a hook registered
after the monitor on the very module a value is read from is not seen. A with-block that
ends while the model's forward is still running (entered inside nnsight's ``model.trace``)
keeps its hooks until that forward returns, so the forward counts whole.

A forward counts whole or not at all: a layer's sums are held until the model's forward
returns, so a forward that raises or is interrupted adds nothing. Where hooks vanish or
are bypassed, ``MeasurementWarning`` says so and the statistics stay NaN.
"""

from __future__ import annotations

import json
import logging
import warnings
from contextlib import ExitStack
from pathlib import Path

import torch

from . import metrics as M
from .api import layer_stacked, spectra
from .models import Adapter, get_adapter
from .models.base import as_tokens
from .reducer import LayerReducer, pad_to_stack, reduce_many
from .spectrum import RANKS

log = logging.getLogger(__name__)
DEFAULT_TARGETS = (("ov", "modulus"), ("ov", "residual"))
BUFFER_TOKENS = 256  # single-position forwards reduced together; bounds the buffer's memory
NULL_DRAWS = 128
FNULL_DRAWS = 64
EIG_TOP = 16
NULL_TOKENS = 128  # tokens per forward (or buffered batch) the nulls are measured on


class MeasurementWarning(UserWarning):
    """Something the monitor should have measured was not: hooks removed, bypassed or never reached."""


def _first(x):
    return x[0] if isinstance(x, tuple | list) else x


def _is_builtin(t) -> bool:
    return len(t) == 2 and isinstance(t[1], str)


class Monitor:
    """Streaming alignment statistics for every attention layer of a model.

    Use through ``eigenhooks.monitor(...)``. After (or during) the block: ``summary()``,
    ``save(path)``, ``state_dict()`` / ``load_state_dict()`` / ``merge_state_dict()``,
    ``all_reduce()`` under torch.distributed.
    """

    def __init__(
        self,
        model,
        targets=DEFAULT_TARGETS,
        reading_points=M.POINTS,
        tokens=False,
        attention_mask=None,
        null_seed: int = 0,
        sink=None,
        attach: bool = True,
        null_draws: int = NULL_DRAWS,
        fnull_draws: int = FNULL_DRAWS,
        eig_top: int = EIG_TOP,
        null_tokens: int | None = NULL_TOKENS,
    ):
        bad = set(reading_points) - set(M.POINTS)
        if bad or "pre" not in reading_points:
            raise ValueError(f"reading_points must include 'pre' and be among pre/mid/post, got {reading_points}")
        for name, v in (("null_draws", null_draws), ("fnull_draws", fnull_draws), ("eig_top", eig_top)):
            if not isinstance(v, int) or v < (1 if name == "null_draws" else 0):
                raise ValueError(
                    f"{name} must be a {'positive' if name == 'null_draws' else 'non-negative'} int, got {v!r}"
                )
        if null_tokens is not None and (not isinstance(null_tokens, int) or null_tokens < 1):
            raise ValueError(f"null_tokens must be a positive int or None (every token), got {null_tokens!r}")
        self.null_tokens = null_tokens
        self.adapter: Adapter = get_adapter(model)
        self.model = self.adapter.model
        self.target_defs = [self._parse_target(t) for t in targets]
        names = [d[0] for d in self.target_defs]
        if len(set(names)) != len(names):
            raise ValueError(f"target names must be unique, got {names}")
        self.points = tuple(p for p in M.POINTS if p in reading_points)
        self.keep_tokens = tokens
        self.explicit_mask = attention_mask
        self.null_seed, self.K, self.Kf, self.m = int(null_seed), null_draws, fnull_draws, eig_top
        self.sink_path = Path(sink) if sink is not None else None
        self.attach = attach
        self.token_records: list[dict] = []
        self.n_forwards = 0
        self._layers: dict[int, dict] = {}  # layer -> {"targets": [...], "reducer", "rp"}
        self._state: dict[int, dict[str, torch.Tensor]] = {}
        self._rows: dict[int, torch.Tensor] = {}  # open sequences' counters (b, 3, T)
        self._buf: dict[int, list] = {}
        self._stack: ExitStack | None = None
        self._handles: list = []
        self._raw: list = []  # (module, handle) of every hook registered
        self._inert: list = []  # model-level handles left to remove at the model's next call
        self._started = 0  # forwards whose start the monitor saw (whole or not)
        self._closing = False  # closed while a forward was running: detach when it returns
        self._warned: set[str] = set()
        self._active = False
        self._orphans = 0  # tap calls that came outside any forward of the model
        self._reset_forward(open_=False)

    # ---- targets ----
    def _parse_target(self, t):
        t = tuple(t)
        if len(t) != 2:
            raise ValueError(f"a target is (variant, rank) or (name, tensor | {{layer: tensor}}), got {t!r}")
        if _is_builtin(t):
            variant, rank = t
            if rank not in RANKS:
                raise ValueError(f"rank must be one of {RANKS}, got {rank!r}")
            return (f"{variant}/{rank}", variant, rank, None)
        name, U = t
        if not isinstance(name, str) or not name:
            raise ValueError(f"a custom target's name must be a non-empty string, got {name!r}")
        ad = self.adapter
        if isinstance(U, dict):
            per = {}
            for layer, u in U.items():
                if not isinstance(layer, int) or not 0 <= layer < ad.n_layers:
                    raise M.TargetError(f"target {name!r}: layer key {layer!r} is not in 0..{ad.n_layers - 1}")
                per[layer] = M.check_target(name, u, ad.width(layer))
            return (name, None, None, per)
        checked = {d: M.check_target(name, U, d) for d in sorted({ad.width(i) for i in range(ad.n_layers)})}
        return (name, None, None, {i: checked[ad.width(i)] for i in range(ad.n_layers)})

    # ---- lifecycle ----
    def __enter__(self) -> Monitor:
        if self._active:
            raise RuntimeError("this monitor is already active; leave its with-block before entering it again")
        self._prepare()
        if self.attach:
            self._stack = ExitStack()
            try:
                self._register()
            except BaseException:
                self._stack.close()  # all-or-nothing: drop what was registered
                self._stack, self._handles, self._raw = None, [], []
                raise
        self._active = True
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(_raised=exc_type is not None)

    def close(self, _raised: bool = False) -> None:
        """Remove the monitor's own hooks (only those), after checking they were still there.

        Closed while a forward of the model is still running (the with-block was entered inside
        nnsight's ``model.trace(...)``, whose body runs within the model's forward), the hooks
        stay until that forward returns, so it counts whole; then they come off.
        """
        if not self._active or self._closing:
            return
        if self._open and self._stack is not None and not _raised and not self._gone() and self._in_forward():
            self._closing = True  # _on_model_end finishes the close
            return
        self._active = False
        try:
            if self._stack is not None:
                gone = self._check_handles()
                if not self._started and not self._orphans and not _raised and not gone:
                    self._warn(
                        "no-forward",
                        "no forward pass reached the monitor's hooks inside its with-block. If the model was "
                        "compiled (torch.compile) before the monitor, hooks added later are ignored: enter "
                        "eh.monitor before compiling, or call torch._dynamo.reset() first.",
                    )
            self._flush()
        finally:
            if self._stack is not None:
                self._stack.close()
                self._stack, self._handles, self._raw = None, [], []

    def _in_forward(self) -> bool:
        """Whether the model's forward is running below us (not merely opened by a forward that
        was interrupted, e.g. by a KeyboardInterrupt caught since). nnsight runs a trace's body
        in a greenlet whose parent is suspended inside the forward: its stack counts too."""
        import sys

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

    def _finish_deferred_close(self, raised: bool) -> None:
        """The forward a close waited for ended: detach now (see ``close``)."""
        self._closing = False
        if not raised or self.adapter.backend == "lens":
            self.close()
            return
        # torch is iterating the model's forward hooks to call the always_call hooks of a raising
        # forward: removing one of those now would break its loop, so the two model-level hooks
        # come off at the model's next call (inert until then); all the others come off now.
        self._stack.pop_all()
        for module, handle in self._raw:
            if module is self.model:
                self._inert.append(handle)
            else:
                handle.remove()
        self._stack, self._handles, self._raw, self._active = None, [], [], False
        self._flush()

    def _prepare(self) -> None:
        """Spectra (cached), bases, nulls and reducers for every layer."""
        if self._layers:
            return
        ad = self.adapter
        top = max(4, 2 * self.m)
        specs = {}
        for _name, variant, rank, _per in self.target_defs:
            key = (variant or "ov", rank or "modulus")
            if key not in specs:
                specs[key] = spectra(ad, variant=key[0], rank=key[1], top=top)
        for i in range(ad.n_layers):
            tgts, meta = [], []
            for name, variant, rank, per in self.target_defs:
                if per is not None and i not in per:
                    continue
                s = specs[(variant or "ov", rank or "modulus")][i]
                eig = M.eig_subspaces(s.eigenvalues, s.eigenvectors, self.m + (1 if per is None else 0))
                if per is None:
                    U, eig = s.basis, eig[1:]  # the target is F's own top subspace: rank it among the others
                else:
                    U = per[i]
                v1 = U[:, 0] if U.shape[1] == 1 else None
                fkey = variant or "ov"
                tgts.append(M.TargetSpec(name, U, v1, eig, fkey if self.Kf else None))
                meta.append({"target": name, "variant": variant, "rank": rank, "spec": s if per is None else None})
            if not tgts:
                continue
            k_max = max(t.k for t in tgts)
            haar = M.haar_frames(ad.width(i), k_max, self.K, self._seed(i, 0))
            fnull = {}
            for fkey in sorted({t.fnull for t in tgts if t.fnull}):
                O, V = layer_stacked(ad, i, fkey)
                fnull[fkey] = M.power_step_frames(
                    lambda G, O=O, V=V: O @ (V @ G), ad.width(i), k_max, self.Kf, self._seed(i, 1 + len(fnull))
                )
            red = LayerReducer(tgts, haar, fnull, self.null_tokens)
            self._layers[i] = {"targets": tgts, "meta": meta, "reducer": red, "rp": ad.reading_points(i)}
            self._state[i] = M.zero_state(len(tgts), len(red.ks), self.K, max(red.m, 0), red.Kf)
        pad_to_stack([info["reducer"] for info in self._layers.values()])  # layers of one kind reduce together

    def _seed(self, layer: int, which: int) -> int:
        return (self.null_seed * 1_000_003 + layer * 101 + which) % (2**63)

    # ---- registration ----
    def _hook(self, module, fn, kind: str, **kw):
        reg = {"pre": module.register_forward_pre_hook, "fwd": module.register_forward_hook}[kind]
        handle = reg(fn, **kw)
        self._stack.callback(handle.remove)
        self._raw.append((module, handle))
        self._handles.append((module, "_forward_pre_hooks" if kind == "pre" else "_forward_hooks", handle.id))

    def _register(self) -> None:
        ad = self.adapter
        if ad.backend == "lens":
            self._wrap_lens_forward()
        else:
            self._hook(self.model, self._on_model_start, "pre", with_kwargs=True)
            self._hook(self.model, self._on_model_end, "fwd", always_call=True)
            for name, (root, mask_kw) in ad.stacks.items():
                self._hook(root, self._stack_start(name, mask_kw), "pre", with_kwargs=True)
                self._hook(root, self._stack_end, "fwd", always_call=True)
        self._slots = self._build_slots()
        for key, (module, where, _) in self._slots.items():
            if where == "input":
                self._hook(module, self._input_tap(key), "pre", with_kwargs=True)
            else:
                self._hook(module, self._output_tap(key), "fwd")

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

    def _tap_module(self, tap):
        if tap.hook_name is not None:
            return self.model.hook_dict[tap.hook_name], "output"
        return tap.module, tap.where

    def _build_slots(self) -> dict:
        """(module, where) -> the roles of each of its calls in one forward, in order.

        A module shared by several layers (ALBERT) is called once per use, so its calls are
        matched to layers by order; post(t) is read at layer t+1's pre tap, one reading for both.
        """
        ad = self.adapter
        mods = [
            {
                id(m)
                for m in (ly.block, ly.attn_in, ly.attn_out, ly.norm, ly.mid_in, ly.pre_in, ly.mid_out)
                if m is not None
            }
            for ly in ad.layers
        ]
        slots: dict = {}

        def add(tap, owner: int | None, role):
            module, where = self._tap_module(tap)
            key = (id(module), where)
            if key not in slots:
                uses = [i for i, s in enumerate(mods) if id(module) in s] if ad.backend != "lens" else []
                if len({ad.layers[j].group for j in uses}) > 1:
                    # layers with different attention weights meet at this module (a decoder layer's block, or
                    # the norm between its self- and cross-attention): it runs once for all of them
                    uses = uses[:1]
                slots[key] = (module, where, {"uses": uses or [owner], "roles": {}})
            entry = slots[key][2]
            idx = entry["uses"].index(owner) if owner in entry["uses"] else 0
            entry["roles"].setdefault(idx, []).append(role)

        for i, info in sorted(self._layers.items()):
            rp = info["rp"]
            add(rp.pre, i, (i, "pre"))
            add(rp.attn, i, (i, "attn"))
            if "mid" in self.points and rp.mid is not None:
                add(rp.mid, i, (i, "mid"))
            if "post" in self.points:
                module, _ = self._tap_module(rp.post)
                nxt = i + 1 < ad.n_layers and ad.backend != "lens" and id(module) in mods[i + 1]
                owner = i + 1 if nxt else (i if ad.backend != "lens" and id(module) in mods[i] else None)
                add(rp.post, owner, (i, "post"))
        return slots

    def _input_tap(self, key):
        def fn(module, args, kwargs):
            x = kwargs.get("hidden_states", args[0] if args else None)
            self._on_tap(key, _first(x))

        return fn

    def _output_tap(self, key):
        def fn(module, args, output):
            self._on_tap(key, _first(output))

        return fn

    # ---- per forward ----
    def _reset_forward(self, open_: bool) -> None:
        self._open = open_
        self._counts: dict = {}
        self._cap: dict[int, dict] = {}
        self._pending: dict[int, tuple] = {}
        self._pending_raw: dict[int, tuple] = {}
        self._mask: torch.Tensor | None = None
        self._ran: set[str] = set()  # stacks (Adapter.stacks) whose root ran in this forward
        self._stack_masks: dict[str, torch.Tensor | None] = {}
        self._root = None  # the stack root that opened this forward, when it ran outside the model's

    def _stack_start(self, name: str, mask_kw: str | None):
        """A stack's root starts: it runs in this forward, with its own mask (or opens a forward of its own,
        as ``generate`` runs an encoder-decoder's encoder once, outside the model's forward)."""

        def fn(module, args, kwargs):
            if not self._open:
                self._on_model_start(module, args, kwargs)
                self._root = module
            self._ran.add(name)
            m = kwargs.get(mask_kw) if mask_kw else None
            self._stack_masks[name] = m if isinstance(m, torch.Tensor) and m.dim() == 2 else None

        return fn

    def _stack_end(self, module, args, output):
        if self._root is module:
            self._on_model_end(module, args, output)

    def _on_model_start(self, module, args, kwargs):
        if self._inert:  # left by a close that waited for a forward which raised
            for handle in self._inert:
                handle.remove()
            self._inert = []
            return
        self._started += 1
        cont = _continues(kwargs)
        if not cont:
            self._end_sequences()
        self._reset_forward(open_=True)
        mask = self.explicit_mask if self.explicit_mask is not None else kwargs.get("attention_mask")
        if mask is None and self.adapter.backend == "lens":
            mask = _lens_string_mask(self.model, args, kwargs)
        self._mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None

    def _on_model_end(self, module, args, output):
        if not self._open:
            return
        if output is None:  # the forward raised: nothing of it counts
            self._reset_forward(open_=False)
        else:
            self._check_forward()
            self._commit()
            self._reset_forward(open_=False)
        if self._closing:
            self._finish_deferred_close(raised=output is None)

    def _on_tap(self, key, x) -> None:
        if not isinstance(x, torch.Tensor):
            return
        if not self._open:
            self._orphans += 1
            self._warn(
                "orphan",
                "the monitor's layer hooks ran outside a forward of the model it was given (a submodule "
                "called directly?); nothing was counted. Call the model passed to eh.monitor.",
            )
            return
        c = self._counts.get(key, 0)
        self._counts[key] = c + 1
        for layer, point in self._slots[key][2]["roles"].get(c, ()):
            cap = self._cap.setdefault(layer, {})
            if point in cap:
                continue
            cap[point] = x.detach()
            if point == self._last_point(layer):
                self._reduce(layer, cap)

    def _last_point(self, layer: int) -> str:
        if "post" in self.points:
            return "post"
        rp = self._layers[layer]["rp"]
        return "mid" if "mid" in self.points and rp.mid is not None else "attn"

    def _check_forward(self) -> None:
        stacks = self.adapter.stacks
        expected = [
            i
            for i in self._layers
            if self.adapter.layers[i].stack not in stacks or self.adapter.layers[i].stack in self._ran
        ]
        missing = [i for i in expected if i not in self._pending and i not in self._pending_raw]
        partial = [i for i in expected if i not in missing and self._unread(i)]
        if not (missing or partial) or self._check_handles():
            return
        if partial:
            self._warn(
                "partial-layers",
                f"in layers {partial} the attention or the next sublayer was not seen (its module skipped, "
                "replaced or swapped by another tool, e.g. a swapped HookPoint): gamma_mid and rho stay NaN there",
            )
        if not missing:
            return
        self._warn(
            "missing-layers",
            f"layers {missing} were not measured in a forward (their hooks did not fire: a block skipped, "
            "a module replaced or swapped by another tool, or hooks bypassed); their statistics stay NaN. "
            "A model compiled (torch.compile) before the monitor ignores hooks added later: enter eh.monitor "
            "before compiling, or call torch._dynamo.reset() after entering it.",
        )

    def _unread(self, layer: int) -> bool:
        """Whether a measured layer lacks its attention output or its mid reading this forward."""
        cap, rp = self._cap.get(layer, {}), self._layers[layer]["rp"]
        need_mid = "mid" in self.points and rp.mid is not None
        return "attn" not in cap or (need_mid and "mid" not in cap)

    def _gone(self) -> list:
        """Modules from which one of the monitor's hooks was removed by something else."""
        return [m for m, attr, hid in self._handles if hid not in getattr(m, attr, {})]

    def _check_handles(self) -> bool:
        gone = self._gone()
        if gone:
            self._warn(
                "handles",
                f"{len(gone)} of the monitor's {len(self._handles)} hooks were removed by something else "
                f"(e.g. on {type(gone[0]).__name__}); another tool cleared the model's hooks (pyvene does). "
                "What ran after that was not measured: enter eh.monitor inside the other tool's context.",
            )
        return bool(gone)

    def _warn(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(msg, MeasurementWarning, stacklevel=3)

    # ---- reduction ----
    def _valid_mask(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        b, n = x.shape[:2]
        stack = self.adapter.layers[layer].stack
        m = self._stack_masks[stack] if stack in self._stack_masks else self._mask
        if m is None:
            return torch.ones(b, n, dtype=torch.bool, device=x.device)
        if m.shape[0] != b or m.shape[1] < n:
            raise ValueError(
                f"attention mask of shape {tuple(m.shape)} does not fit activations of shape {tuple(x.shape)}"
            )
        return m[:, -n:].to(x.device).bool()  # with a KV cache only the newest positions are computed

    def _reduce(self, layer: int, cap: dict) -> None:
        info = self._layers[layer]
        pre = cap.get("pre")
        if pre is None or pre.dim() != 3 or pre.shape[1] == 0:
            return
        rp = info["rp"]
        mid = None
        if "mid" in self.points and "attn" in cap:  # no attention step ran: no delta
            if rp.mid is None:
                mid = pre + cap["attn"]  # parallel block: pre + attention output (not a model state)
            else:
                mid = cap.get("mid")
        points = {"pre": pre, "mid": as_tokens(mid, pre), "post": as_tokens(cap.get("post"), pre)}
        base = None
        if rp.post_norm is not None and mid is not None:
            with torch.no_grad():
                base = rp.post_norm.forward(pre)  # LN_t(pre), without running anyone's hooks
        if getattr(self.adapter.layers[layer], "masked", True):
            mask = self._valid_mask(pre, layer)
        else:  # a tower the forward's attention_mask does not describe: all its tokens count
            mask = torch.ones(pre.shape[:2], dtype=torch.bool, device=pre.device)
        if pre.shape[1] == 1 and self.sink_path is None and not self.keep_tokens:
            self._pending_raw[layer] = (points, mask, base)  # reduced in batches once the forward ends
            return
        self._pending[layer] = info["reducer"].project(points, mask, base)  # reduced when the forward ends
        if self.keep_tokens:
            self._record_tokens(layer, points, mask)

    def _commit(self) -> None:
        """The forward ended: its layers are reduced together, and their sums count, all at once."""
        layers = list(self._pending)
        self._pending = dict(zip(layers, reduce_many([(self._layers[i]["reducer"], self._pending[i]) for i in layers])))
        for layer, (sums, rows) in self._pending.items():
            self._add(layer, sums, rows)
        for layer, item in self._pending_raw.items():
            buf = self._buf.setdefault(layer, [])
            if buf and buf[0][1].shape[0] != item[1].shape[0]:
                self._flush(layer)
                buf = self._buf.setdefault(layer, [])
            buf.append(item)
            if sum(mk.shape[0] for _, mk, _ in buf) >= BUFFER_TOKENS:
                self._flush(layer)
        if self.sink_path is not None and self._pending:
            line = {"forward": self.n_forwards + 1, "stats": []}
            for layer, (sums, _) in sorted(self._pending.items()):
                for ti, meta in enumerate(self._layers[layer]["meta"]):
                    row = dict(zip(M.TGT_FIELDS, sums["tgt"][ti].tolist()))
                    line["stats"].append({"layer": layer, "target": meta["target"], **row})
            with open(self.sink_path, "a") as fh:
                fh.write(json.dumps(line) + "\n")
                fh.flush()
        self.n_forwards += 1

    def _add(self, layer: int, sums: dict, rows: torch.Tensor) -> None:
        st = self._state[layer]
        for k, v in sums.items():
            st[k] = st[k].to(v.device) + v
        if rows is None:
            return
        open_rows = self._rows.get(layer)
        if open_rows is not None and open_rows.shape[0] != rows.shape[0]:
            self._close_rows(layer)
            open_rows = None
        self._rows[layer] = rows if open_rows is None else open_rows + rows

    def _close_rows(self, layer: int) -> None:
        rows = self._rows.pop(layer, None)
        if rows is not None:
            st = self._state[layer]
            st["tgt"] = M.close_rows(st["tgt"].to(rows.device), rows)

    def _end_sequences(self) -> None:
        """The open sequences ended: fold their per-row counters into the cluster sums."""
        self._flush()
        for layer in list(self._rows):
            self._close_rows(layer)

    def _flush(self, layer: int | None = None) -> None:
        """Reduce buffered single-position forwards (all layers when layer is None)."""
        cat = lambda xs: None if any(x is None for x in xs) else torch.cat(xs, 1)  # noqa: E731 (rows stay rows)
        items = []
        for i in [layer] if layer is not None else list(self._buf):
            buf = self._buf.pop(i, [])
            if buf:
                points = {p: cat([b[0][p] for b in buf]) for p in buf[0][0]}
                red = self._layers[i]["reducer"]
                items.append(
                    (i, red, red.project(points, torch.cat([b[1] for b in buf], 1), cat([b[2] for b in buf]), False))
                )
        for (i, _, _), (sums, rows) in zip(items, reduce_many([(r, pr) for _, r, pr in items])):
            self._add(i, sums, rows)

    def _record_tokens(self, layer: int, points: dict, mask: torch.Tensor) -> None:
        tgt, meta = self._layers[layer]["targets"][0], self._layers[layer]["meta"][0]
        U = tgt.U.to(points["pre"].device, torch.float32)
        rec = {"layer": layer, "target": meta["target"], "forward": self.n_forwards, "mask": mask.cpu()}
        for p in M.POINTS:
            if points.get(p) is not None:
                rec[f"a_{p}"] = M.alignment(points[p].float(), U).cpu()
        self.token_records.append(rec)

    # ---- TransformerLens ----
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
                    self._mask = self.explicit_mask if self.explicit_mask is not None else _lens_call_mask(self.model)
                self._on_tap(key, act)
                if name == last_name and self._open:
                    self._check_forward()
                    self._commit()
                    self._reset_forward(open_=False)

            hooks.append((name, fn))
        return hooks

    # ---- results ----
    def _current_state(self, layer: int) -> dict:
        """This layer's state with the still-open sequences folded in (call ``_flush`` first)."""
        st = dict(self._state[layer])
        rows = self._rows.get(layer)
        if rows is not None:
            st["tgt"] = M.close_rows(st["tgt"].to(rows.device), rows)
        return {k: v.detach().to("cpu", torch.float64) for k, v in st.items()}

    @property
    def stats(self) -> dict[tuple[int, str], dict[str, float]]:
        """(layer, target) -> the raw per-target sums and counts (``metrics.TGT_FIELDS``)."""
        out = {}
        self._flush()
        for layer, info in sorted(self._layers.items()):
            tg = self._current_state(layer)["tgt"]
            for ti, meta in enumerate(info["meta"]):
                out[(layer, meta["target"])] = dict(zip(M.TGT_FIELDS, tg[ti].tolist()))
        return out

    def summary(self):
        """pandas DataFrame, one row per (layer, target); see docs/concepts.md, 'Statistics'."""
        import pandas as pd

        post_norm = self.adapter.norm_position == "post"
        rows = []
        self._flush()
        for layer, info in sorted(self._layers.items()):
            st = self._current_state(layer)
            red = info["reducer"]
            for ti, (t, meta) in enumerate(zip(info["targets"], info["meta"])):
                s = meta["spec"]
                row = {
                    "layer": layer,
                    "target": meta["target"],
                    "variant": meta["variant"],
                    "rank": meta["rank"],
                    "k": t.k,
                }
                row.update(
                    kind=s.kind if s else "custom",
                    lambda_1_re=s.lambda_1.real if s else float("nan"),
                    lambda_1_im=s.lambda_1.imag if s else float("nan"),
                    abs_lambda_1=abs(s.lambda_1) if s else float("nan"),
                    gap_ratio=s.gap_ratio if s else float("nan"),
                )
                row.update(
                    M.summarize(st, ti, red.k_index[ti], t.k, post_norm=post_norm, tie_seed=self._seed(layer, 1000))
                )
                row["null_seed"] = self.null_seed
                rows.append(row)
        df = pd.DataFrame(rows)
        if len(df):
            df["q_null"] = float("nan")
            for _, idx in df.groupby("target").groups.items():
                df.loc[idx, "q_null"] = M.bh(df.loc[idx, "p_null"].to_numpy())
            df["verdict"] = [M.verdict(q, lift) for q, lift in zip(df["q_null"], df["lift"])]
        return df

    def save(self, path) -> Path:
        """Write the summary as Parquet, CSV or JSON (by the file's suffix)."""
        path = Path(path)
        df = self.summary()
        if path.suffix == ".parquet":
            df.to_parquet(path)
        elif path.suffix == ".csv":
            df.to_csv(path, index=False)
        elif path.suffix == ".json":
            df.to_json(path, orient="records", indent=2)
        else:
            raise ValueError(f"unknown format {path.suffix!r}: use .parquet, .csv or .json")
        return path

    def _layout(self) -> dict:
        return {
            "null_seed": self.null_seed,
            "null_draws": self.K,
            "fnull_draws": self.Kf,
            "eig_top": self.m,
            "null_tokens": self.null_tokens,
            "targets": [d[0] for d in self.target_defs],
        }

    def state_dict(self) -> dict:
        """The whole streaming state (open sequences folded in) as plain lists: JSON-able, mergeable."""
        self._prepare()
        self._flush()
        layers = {str(i): {k: v.tolist() for k, v in self._current_state(i).items()} for i in self._layers}
        return {"layout": self._layout(), "layers": layers}

    def load_state_dict(self, state: dict) -> None:
        """Replace the statistics with a saved state (``state_dict`` of a monitor of the same layout)."""
        self._prepare()
        self._check_layout(state)
        self._rows, self._buf = {}, {}
        for i in self._layers:
            self._state[i] = {k: torch.tensor(v, dtype=torch.float64) for k, v in state["layers"][str(i)].items()}

    def merge_state_dict(self, state: dict) -> None:
        """Add a saved state (another batch, process or run with the same layout) to this one."""
        self._prepare()
        self._check_layout(state)
        for i in self._layers:
            other = {k: torch.tensor(v, dtype=torch.float64) for k, v in state["layers"][str(i)].items()}
            self._state[i] = M.merge_states(self._state[i], other)

    def _check_layout(self, state: dict) -> None:
        if state.get("layout") != self._layout():
            raise ValueError(
                f"state layout {state.get('layout')} does not match this monitor's {self._layout()}: "
                "use the same targets, null_seed, null_draws, fnull_draws and eig_top"
            )

    def all_reduce(self, group=None) -> None:
        """Sum the whole state across the ranks of ``group`` with torch.distributed (gloo or NCCL).

        Every rank must call it with a monitor of the same layout (same targets and seeds, so
        the null draws agree). Open sequences end here. Afterwards every rank holds the total.
        """
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("all_reduce needs torch.distributed initialised (torchrun, or dist.init_process_group)")
        self._prepare()
        self._end_sequences()
        backend = dist.get_backend(group)
        dev = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        parts = [(i, k, v) for i in sorted(self._state) for k, v in sorted(self._state[i].items())]
        flat = torch.cat([v.detach().reshape(-1).to(dev, torch.float64) for _, _, v in parts])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        at = 0
        for i, k, v in parts:
            n = v.numel()
            self._state[i][k] = flat[at : at + n].reshape(v.shape).to(v.device)
            at += n


def _continues(kwargs) -> bool:
    """True when this forward extends the previous one's sequences (a KV-cache step)."""
    cp = kwargs.get("cache_position")
    if isinstance(cp, torch.Tensor) and cp.numel():
        return bool(cp.reshape(-1)[0] > 0)
    past = kwargs.get("past_key_values", kwargs.get("cache"))  # transformers 5 passes `cache`
    if past is None:
        return False
    try:
        return int(past.get_seq_length()) > 0
    except (AttributeError, TypeError):
        return bool(past)


def _lens_call_mask(model):
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
            return _lens_string_mask(model, (loc["input"],), kw)
        f = f.f_back
    return None


def _lens_string_mask(model, args, kwargs):
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


def monitor(
    model,
    targets=DEFAULT_TARGETS,
    reading_points=M.POINTS,
    tokens=False,
    *,
    attention_mask=None,
    null_seed: int = 0,
    null_draws: int = NULL_DRAWS,
    fnull_draws: int = FNULL_DRAWS,
    eig_top: int = EIG_TOP,
    null_tokens: int | None = NULL_TOKENS,
    sink=None,
    attach: bool = True,
) -> Monitor:
    """Measure alignment with each layer's principal subspace while the model runs.

    Args:
        model: HF or TransformerLens model (or an Adapter).
        targets: built-in (variant, rank) pairs — default ('ov', 'modulus') and ('ov', 'residual')
            — and custom (name, tensor): a unit vector (d,), an orthonormal basis (d, k), or a
            dict {layer: tensor}. Rows are labelled 'ov/modulus', 'ov/residual' or the name.
        reading_points: which of 'pre', 'mid', 'post' to read ('pre' is required).
        tokens: also keep per-token alignments (``mon.token_records``), for plots.
        attention_mask: (batch, seq) mask overriding the one passed to the model call. Encoder-decoders:
            each stack's layers use the mask passed to that stack (the encoder's ``attention_mask``, the
            decoder's ``decoder_attention_mask``; none: every position counts), not this one.
        null_seed: seed of all null draws (recorded in the summary).
        null_draws: K, Haar-random subspaces per layer (p_null resolution 1/(K+1)).
        fnull_draws: directions orth(F g) per layer (0: none).
        eig_top: m, F's own top eigen-subspaces the target is ranked among (0: none).
        null_tokens: the nulls (Haar, F-null, eigen-subspaces) are measured on at most this
            many tokens per forward, a fixed stride over the token grid; p_null, the
            percentiles, eig_rank and lift compare the target on the same tokens
            (``rho_null_tokens``), so the test stays exact. None: every token.
        sink: a .jsonl path; one line (the forward's target sums) is appended per forward.
        attach: register hooks on enter (TransformerLens users may set False and pass
            ``mon.fwd_hooks()`` to ``run_with_hooks``).

    Example:
        >>> model, tok = eh.zoo.load("gpt2-tiny")          # doctest: +SKIP
        >>> with eh.monitor(model) as mon:                   # doctest: +SKIP
        ...     model(**tok(["def f(x):"], return_tensors="pt"))
        >>> mon.summary()[["layer", "target", "rho", "null_rho_lo", "null_rho_hi", "verdict"]]  # doctest: +SKIP
    """
    return Monitor(
        model,
        targets,
        reading_points,
        tokens,
        attention_mask,
        null_seed,
        sink,
        attach,
        null_draws,
        fnull_draws,
        eig_top,
        null_tokens,
    )
