"""``Monitor`` and ``monitor()``: alignment measured while the model runs, as a small facade.

``with eh.monitor(model) as mon: model(**batch)`` measures every forward pass inside the block, in
any thread, and ``generate`` (each position once, a sequence one cluster across its forwards, with
or without a KV cache; beams and returned sequences clustered by input row).

Values are read where the model consumes them (docs/design.md, "Reading points"). A forward counts
whole or not at all. Its life, with the part that owns each step (docs/api.md, "A forward's life"):
``taps.Taps`` sees it start -> a ``forward.Forward`` collects its readings and projects each layer
-> at its end ``Forward.finish`` reduces every layer at once -> ``accumulate.Accumulator.add``
counts it and returns its ``Undo`` -> ``logs.LogPoints`` writes the sinks; if a write fails, the
Undo takes the forward back, here in ``forward_end``. A forward that raised is dropped whole.
Where hooks vanish or are bypassed, ``MeasurementWarning`` says so and the statistics stay NaN.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import warnings
from dataclasses import fields
from pathlib import Path

import torch

from ..models import Adapter, get_adapter
from . import fingerprint
from .accumulate import Accumulator
from .config import MonitorConfig
from .forward import Call, Forward, Generation
from .logs import Labels, LogPoints
from .notebook import NotebookViews
from .plan import Plan, build_plan, parse_targets
from .sinks import SinkError
from .summary import save_table, summary_table, target_stats
from .taps import MeasurementWarning, Taps, Warner, thread_key

_ALIASES = {"K": "null_draws", "Kf": "fnull_draws", "m": "eig_top"}  # names before 0.2, one release more


class Monitor(NotebookViews):
    """Streaming alignment statistics for every attention layer of a model.

    Use through ``eigenhooks.monitor(...)`` (its docstring lists the arguments; ``config`` holds them, frozen).
    After (or during) the block: ``summary()``, ``plot()``, ``tokens()``, ``save(path)``, ``state_dict()`` /
    ``load_state_dict()`` / ``merge_state_dict()``, ``all_reduce()``; with a sink, ``log()``, ``log_summary()``, ``step``.
    """

    def __init__(self, model, *args, attention_mask=None, sink=None, **settings):
        self.config = make_config(args, settings)
        self.adapter: Adapter = get_adapter(model)
        self.model = self.adapter.model
        self.target_defs, self._vectors = parse_targets(self.adapter, self.config.targets)
        self.explicit_mask = attention_mask
        self._logs = LogPoints(sink, self.config.log_every)
        self._warn = Warner()
        self._plan: Plan | None = None
        self._tags = None  # logs.Labels of the plan, once it is built
        self._acc: Accumulator | None = None
        self._taps: Taps | None = None
        self._fwds: dict[int, Forward] = {}  # thread -> the forward running there (threads share a model)
        self._gens: dict[int, Generation] = {}  # thread -> the generate call running there
        self._lock = threading.Lock()  # one forward counts at a time
        self._fingerprint: dict | None = None
        self._all_valid: list = []  # Forward's reused all-True mask
        self._attn_ran = (None, frozenset())  # (taps, untapped attentions found in place: layout.attn_paths)
        self._active = False
        self._closing = False  # closed while a forward was running: detach when it returns
        self._entered_at = 0  # forwards counted before the with-block

    # ---- settings, read-only: ``config``'s (``mon.null_draws`` is ``mon.config.null_draws``) ----
    points = property(lambda self: self.config.reading_points)
    null_stride = property(lambda self: self.config.stride)
    keep_tokens = property(lambda self: self.config.tokens)
    sink_path = property(lambda self: self._logs.sink_path)
    log_every = property(lambda self: self._logs.log_every)

    def __getattr__(self, name):
        if name in _ALIASES:
            warnings.warn(
                f"Monitor.{name} is deprecated: use Monitor.{_ALIASES[name]}", DeprecationWarning, stacklevel=2
            )
            name = _ALIASES[name]
        if name in MonitorConfig.names() and "config" in self.__dict__:
            return getattr(self.__dict__["config"], name)
        raise AttributeError(f"'Monitor' object has no attribute {name!r}")

    @property
    def step(self) -> int | None:
        """The step of the next log point (your own global step); None: the forward count."""
        return self._logs.step

    @step.setter
    def step(self, value: int | None) -> None:
        self._logs.step = value

    @property
    def n_forwards(self) -> int:
        return self._acc.n_forwards if self._acc is not None else 0

    @property
    def token_records(self) -> list[dict]:
        return self._acc.token_records if self._acc is not None else []

    # ---- lifecycle ----
    def _prepare(self) -> Accumulator:
        """The plan (spectra, bases, nulls) and an empty accumulator, made once."""
        if self._plan is None:
            self._plan = build_plan(self.adapter, self.config, self.target_defs, self._vectors)
            self._acc = Accumulator(self._plan)
        return self._acc

    def __enter__(self) -> Monitor:
        if self._active:
            raise RuntimeError("this monitor is already active; leave its with-block before entering it again")
        self._prepare()
        if self.config.attach:
            layout = self._taps.layout if self._taps is not None else None  # the model walked once
            self._taps = Taps(self.adapter, self._plan, self.points, self, self._warn, layout)
            self._taps.attach()
        self._entered_at = self.n_forwards
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
        taps = self._taps if self._taps is not None and self._taps.attached else None
        if self._fwds and taps is not None and not _raised and not taps.gone() and taps.in_forward():
            self._closing = True  # _after_end finishes the close
            return
        self._active = False
        try:
            if taps is not None:
                gone = taps.check_handles()
                # none started, or one started and never ended (its end compiled away): none counted
                bypassed = not taps.started or bool(self._fwds)
                if self.n_forwards == self._entered_at and bypassed and not taps.orphans and not _raised and not gone:
                    self._warn(
                        "no-forward",
                        "no forward pass reached the monitor's hooks inside its with-block: no forward ran in it, "
                        "or the model was compiled (torch.compile) before the monitor, whose hooks it then ignores: "
                        "enter eh.monitor before compiling, or call torch._dynamo.reset() first.",
                    )
            self._acc.flush()
            self._end_logs(_raised)
        finally:
            for fwd in self._fwds.values():  # forwards that never ended count for nothing
                fwd.drop()
            self._fwds.clear()
            if taps is not None:
                taps.remove()

    def _after_end(self, raised: bool) -> None:
        """A forward ended: if a close waited for it, detach now (see ``close``)."""
        if not self._closing:
            return
        self._closing = False
        if not raised or not self.adapter.calls.module_hooks:  # a wrapped forward has returned
            self.close()
            return
        self._taps.remove_in_raising_forward()
        self._active = False
        self._acc.flush()
        self._end_logs(raised=True)

    # ---- a forward's events (from the taps) ----
    def forward_start(self, args, kwargs, fresh: bool = False, mask=None):
        """The model's forward starts (in this thread): a new ``Forward``, told what the call is; the
        taps hand it the readings."""
        tid = thread_key()
        old = self._fwds.pop(tid, None)
        if old is not None:  # its end never came (interrupted): nothing of it counts
            old.drop()
        calls = self.adapter.calls
        call = self._call(args, kwargs, fresh or not calls.continues(args, kwargs))
        if self.explicit_mask is not None:
            mask = self.explicit_mask
        elif not fresh:  # fresh: hook lists, whose mask the adapter read from the running forward
            mask = calls.mask(self.model, args, kwargs)
        mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
        buffer = self._logs.sink_path is None and not self.config.tokens
        acc, keep = self._acc, self.config.tokens
        seen = {} if call.fresh else acc.seen
        taps = self._taps
        if taps is not None and (call.fresh or self._attn_ran[0] is not taps):  # per generate, not per step
            self._attn_ran = (taps, frozenset(taps.attn_paths) - taps.swapped())
        ran = self._attn_ran[1]
        fwd = Forward(self._plan, self.points, mask, seen, buffer, keep, acc.n_forwards, self._all_valid, call, ran)
        self._fwds[tid] = fwd
        return fwd

    def _call(self, args, kwargs, fresh: bool) -> Call:
        """What this forward is (``forward.Generation`` when it is a step of a ``generate``)."""
        gen = self._gens.get(thread_key())
        rows = self.adapter.calls.rows(args, kwargs) if gen is not None else None
        if rows is None:
            return Call(fresh)
        call = gen.next_call(rows[0], rows[1], fresh)
        if call.copies > 1 and call.first_copy_only:
            self._warn(
                "copies",
                f"generate ran {call.copies} copies of each input row (num_beams or num_return_sequences): "
                "each input row is one cluster; its prompt positions were counted once, and the generated "
                f"positions of every copy ({call.copies} per step and input row) were counted",
            )
        return call

    def generate_start(self, rows: int | None) -> None:
        self._gens[thread_key()] = Generation(rows)

    def generate_end(self) -> None:
        self._gens.pop(thread_key(), None)

    def stack_start(self, name: str, mask) -> None:
        fwd = self._fwds.get(thread_key())
        if fwd is not None:
            fwd.stack_started(name, mask)

    def forward_end(self, ok: bool) -> None:
        """The forward ended: dropped if it raised; else reduced, counted, and logged, or taken back whole;
        then a close that waited for it detaches (``_after_end``). The taps hear nothing back."""
        try:
            self._count(ok)
        except BaseException:
            self._after_end(True)
            raise
        self._after_end(not ok)

    def _count(self, ok: bool) -> None:
        fwd = self._fwds.pop(thread_key(), None)
        if fwd is None:
            return
        if not ok:
            self._drop(fwd)
            return
        self._check(fwd)
        undo = mark = None
        try:
            fs = fwd.finish()
            # threads sharing the model: one forward counts, and is logged, at a time (compiled: one thread)
            with contextlib.nullcontext() if torch.compiler.is_compiling() else self._lock:
                undo = self._acc.add(fs, undoable=bool(self._logs.sinks))
                mark = self._logs.mark()
                self._logs.after_forward(mark, self._acc, self._plan, fs, self._labels())
        except BaseException as e:
            self._drop(fwd)
            if mark is not None:
                self._logs.undo(mark)
            if undo is not None:
                self._acc.undo(undo)
            if isinstance(e, SinkError):
                raise SinkError(f"{e}. This forward was not counted (its sums were taken back)") from e.__cause__
            raise

    def _drop(self, fwd: Forward) -> None:
        """A forward that does not count gives its arena rows back (all of them when no other runs: a
        projection that raised half-way leaves its row taken)."""
        fwd.drop()
        if not self._fwds:
            for arena in self._plan.arenas:
                arena.release()

    def _check(self, fwd: Forward) -> None:
        """Warn (once each) about layers a forward should have measured and did not."""
        missing, partial = fwd.unmeasured(self.adapter.stacks)
        if (missing or partial) and not (self._taps is not None and self._taps.check_handles()):
            self._warn.unmeasured(missing, partial)

    # ---- TransformerLens ----
    def fwd_hooks(self) -> list[tuple[str, object]]:
        """[(hook_name, fn)] for TransformerLens ``run_with_hooks`` (create the monitor with attach=False).

        run_with_hooks hides the call's ``attention_mask`` and string input from hooks, so the
        first hook reads them from the bridge's running forward; ``eh.monitor(..., attention_mask=)``
        overrides that.
        """
        if not self.adapter.calls.hook_lists:
            raise TypeError("fwd_hooks() is for TransformerLens models; HF models are hooked by the with-block")
        if self._taps is not None and self._taps.attached:
            raise RuntimeError(
                "this monitor is already attached to the model; create it with attach=False to use fwd_hooks()"
            )
        self._prepare()
        self._taps = Taps(self.adapter, self._plan, self.points, self, self._warn)
        return self._taps.fwd_hooks(self._plan, lambda: self.adapter.calls.running_mask(self.model))

    # ---- results ----
    @property
    def stats(self) -> dict[tuple[int, str], dict[str, float]]:
        """(layer, target) -> the raw per-target sums and counts (``measures.TGT_FIELDS``)."""
        return target_stats(self._plan, self._prepare().current)

    def summary(self):
        """pandas DataFrame, one row per (layer, target); see docs/concepts.md, 'Statistics'."""
        return summary_table(self._plan, self._prepare().current, self.config, self.adapter.norm_position == "post")

    def save(self, path) -> Path:
        """Write the summary as Parquet, CSV or JSON (by the file's suffix)."""
        return save_table(self.summary, path)

    # ---- the state ----
    def _layout(self) -> dict:
        """The fingerprint of what the sums mean, computed once the monitor is prepared and kept from
        its first call (the bases were fixed then: later edits of the weights do not change it)."""
        self._prepare()
        if self._fingerprint is None:
            self._fingerprint = fingerprint.fingerprint(self.adapter, self.config, self._plan, self.target_defs)
        return self._fingerprint

    def state_dict(self) -> dict:
        """The whole streaming state (open sequences folded in) as plain lists: JSON-able, mergeable.

        Returns:
            {"fingerprint": what the sums mean (weights, targets, reading points, null settings),
            "layers": {"i": {name: nested lists}}}.
        """
        acc = self._prepare()
        layers = {str(i): {k: v.tolist() for k, v in acc.current(i).items()} for i in self._plan.layers}
        return {"fingerprint": self._layout(), "layers": layers}

    def load_state_dict(self, state: dict) -> None:
        """Replace the statistics with a saved state (``state_dict`` of a monitor that means the same).

        Raises:
            ValueError: the state comes from other weights, targets, reading points or null
                settings, predates the fingerprint, or is malformed; the message names what differs.
        """
        self._prepare()
        self._acc.replace(fingerprint.check_state(self._layout(), state, self._acc.state))

    def merge_state_dict(self, state: dict) -> None:
        """Add a saved state (another batch, process or run of a monitor that means the same) to this one.

        Raises:
            ValueError: as ``load_state_dict``; a refused state adds nothing.
        """
        self._prepare()
        self._acc.merge(fingerprint.check_state(self._layout(), state, self._acc.state))

    def all_reduce(self, group=None) -> None:
        """Sum the whole state across the ranks of ``group`` with torch.distributed (gloo or NCCL).

        Every rank must call it with a monitor that means the same (same weights, targets,
        reading points and null settings, so the null draws agree): the ranks' fingerprints are
        compared first, and any difference raises on every rank with the same message. Open
        sequences end here. Afterwards every rank holds the total.

        Raises:
            RuntimeError: torch.distributed is not initialised.
            ValueError: the ranks' monitors differ; the message names the first rank that differs
                from rank 0 and how.
        """
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("all_reduce needs torch.distributed initialised (torchrun, or dist.init_process_group)")
        fingerprint.check_ranks(self._layout(), dist, group)
        self._acc.all_reduce(dist, group)

    # ---- sinks ----
    def _labels(self) -> Labels:
        """The sinks' tags of the state's rows, made once per plan (not per forward)."""
        if self._tags is None:
            self._tags = Labels(self._plan, self.points, self.adapter.n_layers)
        return self._tags

    def scalars(self) -> dict[str, float]:
        """The running values now, ``{tag: value}``: gamma_pre/mid/post, rho, n_tokens and each own
        measure's ``scalars`` per (layer, target), tagged ``eigenhooks/rho/L07/ov-modulus``. A device sync."""
        acc = self._prepare()
        labels = self._labels()
        return labels(torch.cat([t.to("cpu", torch.float64).flatten() for t in labels.tensors(acc)]))

    def log(self, step: int | None = None) -> dict[str, float]:
        """Log the running values to the sinks now, at ``step`` (default ``mon.step``, else the
        forward count), after any earlier log point still on its way. Returns them.

        Raises:
            SinkError: a sink could not be written (the monitor's sums are untouched).
        """
        self._logs.emit_pending(self._labels())
        values = self.scalars()
        self._logs.scalars(self._logs.step_now(step, self.n_forwards), values)
        self._logs.logged_at = self.n_forwards
        return values

    def log_summary(self, step: int | None = None):
        """Log ``mon.summary()`` to the sinks in each one's own form (TensorBoard text, a wandb
        Table, the MLflow artifact ``eigenhooks/summary.csv``); done on exit too. Returns the table.

        Raises:
            SinkError: a sink could not be written.
        """
        df = self.summary()
        self._logs.table(self._logs.step_now(step, self.n_forwards), df, self.n_forwards)
        return df

    def _end_logs(self, raised: bool) -> None:
        self._logs.end(raised, self._acc, self._labels(), self.log_summary)


def make_config(args: tuple, settings: dict) -> MonitorConfig:
    """The ``MonitorConfig`` of ``monitor()``'s arguments: its first fields (targets, reading_points,
    tokens) by position, any by keyword; ``K``, ``Kf``, ``m`` (the names before 0.2, one release more)
    with a DeprecationWarning."""
    names = MonitorConfig.names()
    if len(args) > len(_POSITIONAL):
        raise TypeError(f"monitor() takes the model and at most {len(_POSITIONAL)} settings by position {_POSITIONAL}")
    for old, new in _ALIASES.items():
        if old in settings:
            warnings.warn(f"{old}= is deprecated: use {new}=", DeprecationWarning, stacklevel=4)
            settings[new] = settings.pop(old)
    given = dict(zip(names, args))
    unknown = sorted(set(settings) - set(names)) + sorted(set(settings) & set(given))
    if unknown:
        raise TypeError(f"monitor() got unexpected or repeated settings {unknown}; its settings: {', '.join(names)}")
    return MonitorConfig(**given, **settings)


_POSITIONAL = MonitorConfig.names()[:3]  # targets, reading_points, tokens


def _signature() -> inspect.Signature:
    """``monitor``'s and ``Monitor``'s signature as help() shows it, from ``MonitorConfig``'s fields."""
    P = inspect.Parameter
    fs = fields(MonitorConfig)
    head = [P(f.name, P.POSITIONAL_OR_KEYWORD, default=f.default) for f in fs[:3]]  # by position too
    tail = [P(n, P.KEYWORD_ONLY, default=None) for n in ("attention_mask", "sink")]
    tail += [P(f.name, P.KEYWORD_ONLY, default=f.default) for f in fs[3:]]
    return inspect.Signature([P("model", P.POSITIONAL_OR_KEYWORD), *head, *tail], return_annotation="Monitor")


def monitor(model, *args, **kw) -> Monitor:
    """Measure alignment with each layer's principal subspace while the model runs.

    Args:
        model: HF or TransformerLens model (or an Adapter).
        targets: a non-empty list of built-in (variant, rank) pairs — default ('ov', 'modulus')
            and ('ov', 'residual') — and custom (name, tensor): a unit vector (d,), an orthonormal
            basis (d, k), in any float dtype (orthonormal to its precision), or a complex one (the
            real subspace span(Re v, Im v), e.g. ``spec.v_1``), or a dict {layer: tensor} (int keys,
            negative from the end); ('ov_head', rank): each head's subspace, rows 'ov_head/modulus/h3'.
        reading_points: which of 'pre', 'mid', 'post' to read ('pre' is required).
        tokens: also keep per-token alignments (``mon.token_records``), for plots.
        attention_mask: (batch, seq) mask overriding the one passed to the model call. Encoder-decoders:
            each stack's layers use the mask passed to that stack (the encoder's ``attention_mask``, the
            decoder's ``decoder_attention_mask``; none: every position counts), not this one.
        null_seed: seed of all null draws (recorded in the summary).
        null_draws: Haar-random subspaces per layer (p_null resolution 1/(null_draws + 1)).
        fnull_draws: directions orth(F g) per layer (0: none).
        eig_top: F's own top eigen-subspaces the target is ranked among (0: none).
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
        measures: your own measures (``eh.Measure``; docs/api.md, "Your own measure"), measured
            after the built-in ones; their columns join the summary, their sums the state.

    Defaults live in ``MonitorConfig``. Raises:
        ValueError: no targets, a malformed target list, an unknown variant or rank, names not unique.
        TargetError: a custom target of the wrong shape, not orthonormal, or with a bad layer key.

    Example:
        >>> model, tok = eh.zoo.load("gpt2-tiny")          # doctest: +SKIP
        >>> with eh.monitor(model) as mon:                   # doctest: +SKIP
        ...     model(**tok(["def f(x):"], return_tensors="pt"))
        >>> mon.summary()[["layer", "target", "rho", "null_rho_lo", "null_rho_hi", "verdict"]]  # doctest: +SKIP
    """
    return Monitor(model, *args, **kw)


monitor.__signature__ = Monitor.__signature__ = _signature()


__all__ = ["MeasurementWarning", "Monitor", "monitor"]
