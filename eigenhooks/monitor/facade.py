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

import copy
import inspect
from dataclasses import fields
from pathlib import Path

from ..models import Adapter, get_adapter
from ..models.attach import Attachment, MeasurementWarning, Warner
from ..models.engines import engine_of
from . import fingerprint, notebook, views
from .accumulate import Accumulator
from .config import MonitorConfig
from .logs import Labels, LogPoints
from .plan import Plan, build_plan, parse_targets
from .record import Record, RecordSpec, worker_plan
from .summary import save_table, summary_table, target_stats
from .verdict import Sample


class Monitor:
    """Streaming alignment statistics for every attention layer of a model.

    Use through ``eigenhooks.monitor(...)`` (its docstring lists the arguments; ``config`` holds them, frozen).
    After (or during) the block: ``summary()``, ``plot()``, ``tokens()``, ``save(path)``, ``state_dict()`` /
    ``load_state_dict()`` / ``merge_state_dict()``, ``all_reduce()``; with a sink, ``log()``, ``log_summary()``, ``step``.
    Every setting reads as the config's (``mon.null_stride`` is ``mon.config.null_stride``).
    """

    def __new__(cls, model=None, *args, **settings):
        engine = engine_of(model)  # a serving engine (models.engines): its own monitor, as eh.monitor gives
        if engine is not None:
            return engine.monitor(model, *args, **settings)
        return super().__new__(cls)

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
        self._record: Record | None = None  # what the attachment tells, counted into _acc
        self._att: Attachment | None = None  # the adapter's attachment, attached or not (fwd_hooks)
        self._attached = False
        self._fingerprint: dict | None = None
        self._active = False
        self._closing = False  # closed while a forward was running: detach when it returns
        self._entered_at = 0  # forwards counted before the with-block
        self._states_only = False  # reads states back only: its plan keeps no null frames (``states_only``)

    def __repr__(self) -> str:  # one line from what it holds: nothing reduced, no device read
        return views.facts_repr(views.monitor_facts(self))

    def _repr_html_(self) -> str:
        return views.facts_html(views.monitor_facts(self))

    # ---- settings, read-only: ``config``'s (``mon.null_draws`` is ``mon.config.null_draws``) ----
    sink_path = property(lambda self: self._logs.sink_path)

    def __getattr__(self, name):
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
        """The per-token records (``tokens=True``): a list and dicts of the caller's own (the tensors are the monitor's)."""
        return [dict(r) for r in self._acc.token_records] if self._acc is not None else []

    # ---- lifecycle ----
    def _prepare(self) -> Accumulator:
        """The plan (spectra, bases, nulls), an empty accumulator and the record counting into it, made once."""
        if self._plan is None:
            self._plan = build_plan(self.adapter, self.config, self.target_defs, self._vectors)
            self._acc = Accumulator(self._plan, self.config)
            self._record = Record(self._plan, self.config, self._acc, (self._logs, self._labels), self._warn,
                                  self.explicit_mask, self.adapter.stacks)  # fmt: skip
            self._record.ended = self._after_end
        return self._acc

    def states_only(self) -> Monitor:
        """Make this monitor one that only reads states back (another process measures: an engine's worker),
        for ``load_state_dict``, ``summary``, ``plot``, ``state_dict``: its plan keeps none of what projecting
        readings needs (the null frames and their stacks, ``Plan.drop_frames``), and it never attaches.
        Returns itself."""
        self._prepare()
        self._plan.drop_frames()
        self._layout()  # the fingerprint every state read back is checked against: read from the weights now,
        self._states_only = True  # while they are in memory (an engine's adapter gives their pages back next)
        return self

    def _measuring(self) -> None:
        if self._states_only:
            raise RuntimeError(
                "this monitor only reads states back (states_only(): another process measures, its plan keeps no "
                "null frames); make another eh.monitor to measure here"
            )

    def _attachment(self) -> Attachment:
        """The adapter's attachment telling the record (the model walked once: a layout made earlier is reused)."""
        layout = getattr(self._att, "layout", None)
        att = self.adapter.attachment(self._plan.layers, self.config.reading_points, self._record, self._warn,
                                      self.explicit_mask is None, layout)  # fmt: skip
        self._record.attached(att)
        return att

    def __enter__(self) -> Monitor:
        if self._active:
            raise RuntimeError("this monitor is already active; leave its with-block before entering it again")
        self._measuring()
        self._prepare()
        if self.config.attach:
            self._att = self._attachment()
            self._att.attach()
            self._attached = True
        self._entered_at = self.n_forwards
        self._active = True
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(_raised=exc_type is not None)

    def close(self, _raised: bool = False) -> None:
        """Detach the monitor (only its own hooks come off), after checking they were still there.

        Closed while a forward of the model is still running (the with-block was entered inside
        nnsight's ``model.trace(...)``, whose body runs within the model's forward), the hooks
        stay until that forward returns, so it counts whole; then they come off.
        """
        if not self._active or self._closing:
            return
        att = self._att if self._attached else None
        if self._record.running and att is not None and not _raised and att.in_forward():
            self._closing = True  # the record's end of that forward finishes the close (_after_end)
            att.detach_after_forward()
            return
        self._active = False
        try:
            if att is not None:
                gone = att.check()
                # none started, or one started and never ended (its end compiled away): none counted
                bypassed = not att.started or self._record.running
                if self.n_forwards == self._entered_at and bypassed and not att.orphans and not _raised and not gone:
                    self._warn(
                        "no-forward",
                        "no forward pass reached the monitor's hooks inside its with-block: no forward ran in it, "
                        "or the model was compiled (torch.compile) before the monitor, whose hooks it then ignores: "
                        "enter eh.monitor before compiling, or call torch._dynamo.reset() first.",
                    )
            self._acc.flush()
            self._end_logs(_raised)
        finally:
            self._record.drop_running()
            if att is not None:
                att.detach()
                self._attached = False

    def _after_end(self, raised: bool) -> None:
        """A forward ended: if a close waited for it, finish it (the attachment detaches itself after)."""
        if not self._closing:
            return
        self._closing = self._active = self._attached = False
        self._acc.flush()
        self._end_logs(raised)

    # ---- TransformerLens ----
    def fwd_hooks(self) -> list[tuple[str, object]]:
        """[(hook_name, fn)] for TransformerLens ``run_with_hooks`` (create the monitor with attach=False).

        run_with_hooks hides the call's ``attention_mask`` and string input from hooks, so the
        first hook reads them from the bridge's running forward; ``eh.monitor(..., attention_mask=)``
        overrides that.
        """
        if self._attached:
            raise RuntimeError(
                "this monitor is already attached to the model; create it with attach=False to use fwd_hooks()"
            )
        self._measuring()
        self._prepare()
        self._att = self._attachment()
        return self._att.fwd_hooks(lambda: self.adapter.calls.running_mask(self.model))

    # ---- results ----
    @property
    def stats(self) -> dict[tuple[int, str], dict[str, float]]:
        """(layer, target) -> the raw per-target sums and counts (``measures.TGT_FIELDS``)."""
        return target_stats(self._plan, self._prepare().current)

    def summary(self):
        """pandas DataFrame, one row per (layer, target); see docs/concepts.md, 'Statistics'."""
        acc = self._prepare()
        return summary_table(self._plan, acc.current, self.config, self.adapter.norm_position == "post", acc.verdict)

    def requests(self):
        """Per-request rows are a serving engine's (``eh.monitor`` on an engine, ``models.engines``); here, one
        line saying so.

        Raises:
            TypeError: always: this monitor keeps no per-sequence rows.
        """
        raise TypeError(
            "requests() gives one row per request of a serving engine (eh.monitor on an engine eigenhooks knows, "
            "models.engines); this monitor keeps no per-sequence rows (the table's cluster "
            "is the sequence): for one sequence's own numbers, run it alone under a monitor"
        )

    def save(self, path) -> Path:
        """Write the summary as Parquet, CSV or JSON (by the file's suffix)."""
        return save_table(self.summary, path)

    def plot(self, target: str | None = None):
        """rho by layer with its Haar null band (top) and gamma against its null (below), one column per
        target, as one matplotlib Figure; a notebook shows it inline as the cell's value.

        Args:
            target: one target ('modulus', 'residual', 'ov/modulus', a custom name, a head's
                'ov_head/modulus/h3'); None: every target but the heads'
                (a column per head is no plot) when there are others.

        Example:
            >>> with eh.monitor(model) as mon:     # doctest: +SKIP
            ...     model(**batch)
            >>> fig = mon.plot("modulus")          # doctest: +SKIP
        """
        return notebook.plot(self.summary(), target)

    def tokens(self):
        """The per-token records of ``eigenhooks.monitor(..., tokens=True)`` as a pandas DataFrame: one
        row per (forward, layer, target, sequence, position) of a valid token (padding left out), for
        every target, with its alignment a(x) at each reading point (``a_base``: a(LN_t(pre)), post-norm
        layers only), ``delta`` = a_mid - a_pre (post-norm: a_mid - a_base) and ``up`` = delta > 1e-6:
        what rho counts, so each (layer, target)'s mean of ``up`` is its rho. ``position`` is the column
        in that forward's input (under a KV cache, in the step).

        Raises:
            ValueError: the monitor was made without ``tokens=True``, so it kept no records.
        """
        if not self.config.tokens:
            raise ValueError("no per-token records: make the monitor with eh.monitor(model, tokens=True)")
        return notebook.token_frame(self.token_records)

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
        out = {"fingerprint": copy.deepcopy(self._layout()), "layers": layers}  # the caller's own: edits stay there
        if acc.sample is not None:
            out["sample"] = acc.sample.to_dict()  # the verdict's kept tokens (base64 of their bytes)
        return out

    def record_spec(self) -> RecordSpec:
        """What a record in another process (an engine's worker) is made from: picklable; its
        ``state_dict`` comes back to ``merge_state_dict`` / ``load_state_dict`` here."""
        self._measuring()
        self._prepare()
        return RecordSpec(worker_plan(self._plan), self.config, self._layout())

    def hold_sample(self) -> None:
        """Bring the verdict's kept tokens into this process if another holds them (``load_state_dict``'s
        ``sample``: an engine's worker, about to stop), so the table is still whole once that process is gone."""
        self._prepare().local_sample()

    def load_state_dict(self, state: dict, sample=None) -> None:
        """Replace the statistics with a saved state (``state_dict`` of a monitor that means the same).

        Args:
            state: the state. sample: where its verdict sample is held when the state does not carry it
                (``accumulate.RemoteSample``: another process keeps it and computes its columns); None: the
                state's own.

        Raises:
            ValueError: the state comes from other weights, targets, reading points or null
                settings, predates the fingerprint, or is malformed; the message names what differs.
        """
        self._prepare()
        layers = fingerprint.check_state(self._layout(), state, self._acc.state)
        sample = self._state_sample(state) if sample is None else sample
        self._acc.replace(layers)
        self._acc.replace_sample(sample)

    def merge_state_dict(self, state: dict) -> None:
        """Add a saved state (another batch, process or run of a monitor that means the same) to this one.

        Raises:
            ValueError: as ``load_state_dict``; a refused state adds nothing.
        """
        self._prepare()
        layers = fingerprint.check_state(self._layout(), state, self._acc.state)
        self._acc.merge(layers, self._state_sample(state))

    def _state_sample(self, state: dict):
        """A state's verdict sample (``verdict.Sample``), checked; None where this monitor keeps none.

        Raises:
            ValueError: this monitor keeps one and the state has none, or it is damaged."""
        if self._acc.sample is None:
            return None
        if "sample" not in state:
            raise ValueError(
                "the state has no 'sample' (the verdict's kept tokens): it was saved by a monitor that kept none "
                "(verdict_tokens=0) or by an older eigenhooks; recompute it, or make this monitor with verdict_tokens=0"
            )
        return Sample.from_dict(state["sample"], self._acc.sample.R)

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
            self._tags = Labels(self._plan, self.config.reading_points, self.adapter.n_layers)
        return self._tags

    def scalars(self) -> dict[str, float]:
        """The running values now, ``{tag: value}``: gamma_pre/mid/post, rho, n_tokens and each own
        measure's ``scalars`` per (layer, target), tagged ``eigenhooks/rho/L07/ov-modulus``. A device sync."""
        return self._labels().now(self._prepare())

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
    tokens) by position, any by keyword."""
    names = MonitorConfig.names()
    if len(args) > len(_POSITIONAL):
        raise TypeError(f"monitor() takes the model and at most {len(_POSITIONAL)} settings by position {_POSITIONAL}")
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
