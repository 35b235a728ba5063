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

import logging
import warnings
from contextlib import ExitStack

import torch

from ..linalg.eig import RANKS
from ..models import Adapter, get_adapter, layer_index
from ..spectra.compute import VARIANTS
from . import fingerprint as FP
from . import stats as M
from .lens import MonitorLens, lens_string_mask
from .logs import MonitorLogs
from .reduce import Grid
from .sinks import check_tags
from .state import MonitorState, continues

log = logging.getLogger(__name__)
DEFAULT_TARGETS = (("ov", "modulus"), ("ov", "residual"))
NULL_DRAWS = 128
FNULL_DRAWS = 64
EIG_TOP = 16
NULL_STRIDE = (
    5  # the nulls are measured on every 5th valid token of each sequence: odd, so not in step with power-of-two lengths
)


class MeasurementWarning(UserWarning):
    """Something the monitor should have measured was not: hooks removed, bypassed or never reached."""


def check_nulls(null_draws, fnull_draws, eig_top, null_stride) -> None:
    """Raise ValueError, naming the setting, unless the monitor's null settings are usable."""
    for name, v in (("null_draws", null_draws), ("fnull_draws", fnull_draws), ("eig_top", eig_top)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (1 if name == "null_draws" else 0):
            raise ValueError(
                f"{name} must be a {'positive' if name == 'null_draws' else 'non-negative'} int, got {v!r}"
            )
    if null_stride is not None and (
        isinstance(null_stride, bool) or not isinstance(null_stride, int) or null_stride < 1
    ):
        raise ValueError(f"null_stride must be a positive int or None (every token), got {null_stride!r}")


def _is_builtin(t) -> bool:
    return len(t) == 2 and isinstance(t[1], str)


def _target_list(targets) -> list:
    """``targets`` as a list, refusing what is no list of targets (one line, naming the argument)."""
    if isinstance(targets, str):
        raise ValueError(f"targets must be a list of targets, got the string {targets!r}; e.g. [('ov', 'modulus')]")
    if isinstance(targets, tuple) and len(targets) == 2 and isinstance(targets[0], str):
        raise ValueError(f"targets is one target: wrap it in a list, targets=[{targets!r}]")
    if not isinstance(targets, list | tuple):
        raise ValueError(f"targets must be a list of targets, e.g. [('ov', 'modulus')], got {targets!r}")
    if not targets:
        raise ValueError("targets is empty: at least one target is needed, e.g. [('ov', 'modulus')]")
    return list(targets)


class Monitor(MonitorState, MonitorLens, MonitorLogs):
    """Streaming alignment statistics for every attention layer of a model.

    Use through ``eigenhooks.monitor(...)``. After (or during) the block: ``summary()``,
    ``save(path)``, ``state_dict()`` / ``load_state_dict()`` / ``merge_state_dict()``,
    ``all_reduce()`` under torch.distributed; with a sink, ``log()``, ``log_summary()`` and ``step``.
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
        null_stride: int | None = NULL_STRIDE,
        log_every: int | None = 1,
    ):
        bad = set(reading_points) - set(M.POINTS)
        if bad or "pre" not in reading_points:
            raise ValueError(f"reading_points must include 'pre' and be among pre/mid/post, got {reading_points}")
        check_nulls(null_draws, fnull_draws, eig_top, null_stride)
        self.null_stride = null_stride or 1
        self.adapter: Adapter = get_adapter(model)
        self.model = self.adapter.model
        self._fingerprint: dict | None = None  # what the sums mean (fingerprint.py), set once prepared
        self._target_vectors: dict[str, dict[int, str]] = {}  # custom target -> {layer: digest of its vector}
        self.target_defs = [self._parse_target(t) for t in _target_list(targets)]
        names = [d[0] for d in self.target_defs]
        if len(set(names)) != len(names):
            raise ValueError(f"target names must be unique, got {names}")
        check_tags(names)  # unique per (layer, target) in every sink too
        self.points = tuple(p for p in M.POINTS if p in reading_points)
        self.keep_tokens = tokens
        self.explicit_mask = attention_mask
        self.null_seed, self.K, self.Kf, self.m = int(null_seed), null_draws, fnull_draws, eig_top
        self._init_logs(sink, log_every)  # sets sink_path, log_every, step
        self.attach = attach
        self.token_records: list[dict] = []
        self.n_forwards = 0
        self._layers: dict[int, dict] = {}  # layer -> {"targets": [...], "reducer", "rp"}
        self._arenas: list = []  # reducer.Arena per layout kind, set by _prepare
        self._state: dict[int, dict[str, torch.Tensor]] = {}
        self._rows: dict[int, torch.Tensor] = {}  # open sequences' counters (b, 5, T)
        self._buf: dict[int, list] = {}
        self._seen: dict = {}  # stack -> (b, 1) valid tokens the open sequences had before this forward
        self._zero: set[int] = set()  # layers whose state is still prepare's zeros
        self._all_valid: torch.Tensor | None = None  # the all-True (b, n) mask of the latest shape
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
        """(name, variant, rank, None) for a built-in target, (name, None, None, {layer: U}) for a custom one."""
        shape = "a target is (variant, rank), e.g. ('ov', 'modulus'), or (name, tensor | {layer: tensor})"
        if isinstance(t, str):
            raise ValueError(f"{shape}, got the string {t!r}")
        if not isinstance(t, tuple | list) or len(t) != 2:
            raise ValueError(f"{shape}, got {tuple(t) if isinstance(t, list) else t!r}")
        t = tuple(t)
        if _is_builtin(t):
            variant, rank = t
            if variant not in VARIANTS:
                raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r} in target {t!r}")
            if rank not in RANKS:
                raise ValueError(f"rank must be one of {RANKS}, got {rank!r} in target {t!r}")
            return (f"{variant}/{rank}", variant, rank, None)
        name, U = t
        if not isinstance(name, str) or not name:
            raise ValueError(f"a custom target's name must be a non-empty string, got {name!r}")
        ad = self.adapter
        if isinstance(U, dict):
            if not U:
                raise M.TargetError(f"target {name!r}: an empty dict measures no layer; give {{layer: tensor}}")
            per, given = {}, {}
            for key, u in U.items():
                try:
                    layer = layer_index(key, ad.n_layers, f"target {name!r}: layer key")
                except (TypeError, IndexError) as e:
                    raise M.TargetError(str(e)) from None
                if layer in per:
                    raise M.TargetError(
                        f"target {name!r}: layer keys {given[layer]!r} and {key!r} are both layer {layer}"
                    )
                given[layer] = key
                per[layer] = M.check_target(name, u, ad.width(layer))
                self._target_vectors.setdefault(name, {})[layer] = FP.vector_digest(u)
            return (name, None, None, dict(sorted(per.items())))
        checked = {d: M.check_target(name, U, d) for d in sorted({ad.width(i) for i in range(ad.n_layers)})}
        self._target_vectors[name] = dict.fromkeys(range(ad.n_layers), FP.vector_digest(U))
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
            self._end_logs(_raised)
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
        self._end_logs(raised=True)

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
        self._index_slots()
        for key, (module, where, _) in self._slots.items():
            if where == "input":
                self._hook(module, self._input_tap(key), "pre", with_kwargs=True)
            else:
                self._hook(module, self._output_tap(key), "fwd")

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
        on_tap = self._on_tap

        def fn(module, args, kwargs):
            x = kwargs.get("hidden_states", args[0] if args else None)
            on_tap(key, x[0] if isinstance(x, tuple | list) else x)

        return fn

    def _output_tap(self, key):
        on_tap = self._on_tap

        def fn(module, args, output):
            on_tap(key, output[0] if isinstance(output, tuple | list) else output)

        return fn

    # ---- per forward ----
    def _reset_forward(self, open_: bool) -> None:
        self._open = open_
        for arena in self._arenas:  # rows a forward that raised left taken
            arena.release()
        self._counts: dict = {}
        self._cap: dict[int, dict] = {}
        self._pending: dict[int, tuple] = {}
        self._pending_raw: dict[int, tuple] = {}
        self._masks: dict[tuple, Grid] = {}  # the valid tokens of this forward, per stack and shape
        self._reading_memo: dict = {}  # norms and consensus sums of this forward's readings (reduce._Memo)
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
        cont = continues(args, kwargs)
        if not cont:
            self._end_sequences()
        self._reset_forward(open_=True)
        mask = self.explicit_mask if self.explicit_mask is not None else kwargs.get("attention_mask")
        if mask is None and self.adapter.backend == "lens":
            mask = lens_string_mask(self.model, args, kwargs)
        self._mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None

    def _on_model_end(self, module, args, output):
        if not self._open:
            return
        if output is None:  # the forward raised: nothing of it counts
            self._reset_forward(open_=False)
        else:
            self._check_forward()
            self._commit_logged()  # a sink that fails takes the forward back and raises
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
        roles = self._roles[key].get(c)  # (layer, point) pairs this call of the module reads
        if not roles:
            return
        if x.requires_grad:
            x = x.detach()
        for layer, point in roles:
            cap = self._cap.get(layer)
            if cap is None:
                cap = self._cap[layer] = {}
            elif point in cap:
                continue
            cap[point] = x
            if point == self._last[layer]:
                self._reduce(layer, cap)
                for p in cap:  # reduced: keep which points were seen, not their activations, so the
                    cap[p] = None  # allocator reuses them (memory flat in layers, no fresh pages per layer)

    def _index_slots(self) -> None:
        """Per-call lookups the taps make, once: each slot's roles, each layer's last point, and each
        layer's facts for ``_reduce`` and ``_check_forward`` (its mid is a sum, its post-norm, masked,
        its stack, whether a mid reading is needed)."""
        self._roles = {key: entry[2]["roles"] for key, entry in self._slots.items()}
        self._last = {layer: self._last_point(layer) for layer in self._layers}
        self._read_mid = "mid" in self.points
        self._facts = {}
        for layer, info in self._layers.items():
            rp, ly = info["rp"], self.adapter.layers[layer]
            need_mid = self._read_mid and rp.mid is not None
            self._facts[layer] = (rp.mid is None, rp.post_norm, getattr(ly, "masked", True), ly.stack, need_mid)

    def _last_point(self, layer: int) -> str:
        if "post" in self.points:
            return "post"
        rp = self._layers[layer]["rp"]
        return "mid" if "mid" in self.points and rp.mid is not None else "attn"

    def _check_forward(self) -> None:
        stacks, facts = self.adapter.stacks, self._facts
        expected = [i for i, f in facts.items() if f[3] not in stacks or f[3] in self._ran]
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
        cap = self._cap.get(layer, {})
        return "attn" not in cap or (self._facts[layer][4] and "mid" not in cap)

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
    null_stride: int | None = NULL_STRIDE,
    sink=None,
    log_every: int | None = 1,
    attach: bool = True,
) -> Monitor:
    """Measure alignment with each layer's principal subspace while the model runs.

    Args:
        model: HF or TransformerLens model (or an Adapter).
        targets: a non-empty list of built-in (variant, rank) pairs — default ('ov', 'modulus')
            and ('ov', 'residual') — and custom (name, tensor): a unit vector (d,), an orthonormal
            basis (d, k), in any float dtype (orthonormal to its precision), or a complex one (the
            real subspace span(Re v, Im v), e.g. ``spec.v_1``), or a dict {layer: tensor} (int keys,
            negative from the end). Rows are labelled 'ov/modulus', 'ov/residual' or the name.
        reading_points: which of 'pre', 'mid', 'post' to read ('pre' is required).
        tokens: also keep per-token alignments (``mon.token_records``), for plots.
        attention_mask: (batch, seq) mask overriding the one passed to the model call. Encoder-decoders:
            each stack's layers use the mask passed to that stack (the encoder's ``attention_mask``, the
            decoder's ``decoder_attention_mask``; none: every position counts), not this one.
        null_seed: seed of all null draws (recorded in the summary).
        null_draws: K, Haar-random subspaces per layer (p_null resolution 1/(K+1)).
        fnull_draws: directions orth(F g) per layer (0: none).
        eig_top: m, F's own top eigen-subspaces the target is ranked among (0: none).
        null_stride: the nulls (Haar, F-null, eigen-subspaces) are measured on every s-th
            valid token of each sequence, by its index in that sequence (counted across a KV
            cache's steps), so batching, padding, sharding and generation do not move them (a
            fixed rate: each forward weighs by its size); p_null, the percentiles, eig_rank and
            lift compare the target on the same tokens (``rho_null_tokens``), so the test stays
            exact. 1 or None: every token.
        sink: where the numbers go while the model runs (docs/api.md, "Sinks"); one or a list of:
            a .jsonl path (one line per forward: that forward's own target sums; ``log_every``
            does not apply); a ``SummaryWriter`` or ``"tensorboard:DIR"``; a wandb run or
            ``"wandb"`` (the active one); ``"mlflow"`` (the active run); a callable
            ``(step, scalars)``. They get the running gamma_pre/mid/post, rho and n_tokens per
            (layer, target), tagged ``eigenhooks/rho/L07/ov-modulus``, and on exit the summary
            table. A forward whose sink write fails is not counted and raises ``SinkError``.
        log_every: forwards between log points (default 1; 0 or None: only on exit and
            ``mon.log()``). The step is ``mon.step`` if set (your own global step), else the
            forward count. On a GPU a log point's values are read at the next one (no sync).
        attach: register hooks on enter (TransformerLens users may set False and pass
            ``mon.fwd_hooks()`` to ``run_with_hooks``).

    Raises:
        ValueError: no targets, a malformed target list, an unknown variant or rank, names not unique.
        TargetError: a custom target of the wrong shape, not orthonormal, or with a bad layer key.

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
        null_stride,
        log_every,
    )
