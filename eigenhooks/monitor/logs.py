"""The sinks' log points: when the running values go to the sinks, and what a failed write undoes.

Every ``log_every`` forwards is a log point: the running sums of every layer are copied to the
host and logged with the step ``mon.step`` (your own global step, if you set it) or else the
forward count. On a GPU the copy is enqueued with ``non_blocking`` into pinned memory and read at
the *next* log point, when it has long arrived, so no forward waits for the device; on exit (or
``mon.log()``) the last values are read at once. The summary table goes to the sinks on exit and
on ``mon.log_summary()``.

A forward counts whole or not at all, sinks included: a forward during which a sink write fails
is not counted (the ``Monitor`` takes its sums back with the accumulator's ``Undo`` and this
module's ``LogMark``), its .jsonl line is truncated away, and the model call raises ``SinkError``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from .accumulate import Accumulator, layer_sizes
from .forward import ForwardSums
from .measures import Builtin, owner, running_fields, running_values, target_row, target_sums
from .plan import Plan
from .sinks import METRICS, SinkError, make_sinks, tag


@dataclass
class LogMark:
    """What a forward's log point may change, as it was before (restored when the forward is taken back)."""

    pending: dict | None
    logged_at: int
    written: list  # per-forward sinks that took this forward's line


class LogPoints:
    """The monitor's sinks and their log points.

    Args:
        sink: one sink or a list (``sinks.make_sinks``). log_every: forwards between log points
            (0 or None: only on exit and ``mon.log()``).
    """

    def __init__(self, sink, log_every: int | None):
        self.sinks = make_sinks(sink)
        jsonl = [s for s in self.sinks if s.per_forward]
        self.sink_path = jsonl[0].path if jsonl else None  # per-forward sums: no buffering of 1-token forwards
        self.log_every = log_every or 0
        self.step: int | None = None  # the step of the next log point; None: the forward count
        self.pending: dict | None = None  # a log point's values on their way to the host
        self._host: torch.Tensor | None = None  # pinned, reused
        self.logged_at = 0  # n_forwards at the last log point
        self.summary_at: int | None = None  # n_forwards when the summary was last logged

    @property
    def scalar_sinks(self) -> bool:
        return any(not s.per_forward for s in self.sinks)

    def step_now(self, step: int | None, n_forwards: int) -> int:
        return int(step if step is not None else self.step if self.step is not None else n_forwards)

    # ---- after each counted forward ----
    def mark(self) -> LogMark:
        return LogMark(self.pending, self.logged_at, [])

    def after_forward(self, mark: LogMark, acc: Accumulator, plan: Plan, fs: ForwardSums, labels) -> None:
        """The forward's own line to the per-forward sinks, and a log point if one is due.

        Raises:
            SinkError: a sink could not be written (the caller takes the forward back).
        """
        if fs.layers and any(s.per_forward for s in self.sinks):
            stats = forward_stats(plan, fs)
            for s in self.sinks:
                if s.per_forward:
                    mark.written.append(s)
                    call(s, "forward", acc.n_forwards, stats)
        if self.log_every and acc.n_forwards % self.log_every == 0 and self.scalar_sinks:
            self.emit_pending(labels)
            self.enqueue(acc, self.step_now(None, acc.n_forwards), labels)

    def undo(self, mark: LogMark) -> None:
        for s in mark.written:
            s.undo()
        self.pending, self.logged_at = mark.pending, mark.logged_at

    # ---- log points ----
    def enqueue(self, acc: Accumulator, step: int, labels: Labels) -> None:
        """Start copying the running sums to the host; ``emit_pending`` reads them later."""
        sums = labels.tensors(acc)
        dev = next((t.device for t in sums if t.device.type == "cuda"), None)
        event = None
        if dev is None:
            host = torch.cat([t.to(torch.float64).flatten() for t in sums])  # new: later forwards do not touch it
        else:
            flat = torch.cat([t.to(dev, torch.float64, non_blocking=True).flatten() for t in sums])
            if self._host is None or self._host.shape != flat.shape:
                self._host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            self._host.copy_(flat, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(dev))
            host = self._host
        self.pending = {"step": step, "forward": acc.n_forwards, "host": host, "event": event, "done": set()}
        self.logged_at = acc.n_forwards

    def emit_pending(self, labels) -> None:
        """Log the values of the last log point, once they are on the host (they are, by the next one)."""
        p = self.pending
        if p is None:
            return
        if p["event"] is not None and not p["event"].query():
            p["event"].synchronize()
        values = labels(p["host"])
        for i, s in enumerate(self.sinks):
            if s.per_forward or i in p["done"]:
                continue
            call(s, "scalars", p["step"], values)
            p["done"].add(i)  # taken: not sent again if another sink fails
        self.pending = None

    def scalars(self, step: int, values: dict) -> None:
        for s in self.sinks:
            if not s.per_forward:
                call(s, "scalars", step, values)

    def table(self, step: int, df, n_forwards: int) -> None:
        for s in self.sinks:
            if not s.per_forward:
                call(s, "table", step, df)
        self.summary_at = n_forwards

    # ---- on exit ----
    def end(self, raised: bool, acc: Accumulator, labels, log_summary) -> None:
        """The with-block ended: the last values and the summary to the sinks, then close them.

        After an exception in the block a sink's own error is a warning, so the block's error is
        the one that propagates."""
        if not self.sinks:
            return
        first = None  # the first error: the values' or the table's before any sink's close
        try:
            if self.scalar_sinks and acc.n_forwards:
                if self.logged_at != acc.n_forwards:
                    self.emit_pending(labels)
                    self.enqueue(acc, self.step_now(None, acc.n_forwards), labels)
                self.emit_pending(labels)
                if self.summary_at != acc.n_forwards:
                    log_summary()
        except Exception as e:
            first = e
        for s in self.sinks:  # every sink is closed, whichever failed
            try:
                call(s, "close")
            except Exception as e:
                first = first or e
        if first is not None and not raised:
            raise first
        if first is not None:
            warnings.warn(f"eigenhooks: {first}", RuntimeWarning, stacklevel=4)


def forward_stats(plan: Plan, fs: ForwardSums) -> list[dict]:
    """One forward's own target sums, one dict per (layer, target)."""
    out = []
    for layer, ls in sorted(fs.layers.items()):
        for ti, meta in enumerate(plan.layers[layer].meta):
            out.append({"layer": layer, "target": meta.name, **target_sums(ls.sums, ti)})
    return out


class Labels:
    """The sinks' tags of a plan's running values, made once per plan: which sums a log point copies to
    the host (``tensors``) and what they are called there (``__call__``).

    Every (layer, target) logs the built-in metrics (``sinks.running``) and each measure's own
    ``scalars``; a measure's fields are copied only if it defines ``scalars``."""

    def __init__(self, plan: Plan, points: tuple[str, ...], n_layers: int):
        self.rows = [(i, ti, meta.name) for i in sorted(plan.layers) for ti, meta in enumerate(plan.layers[i].meta)]
        metrics = [m for m in METRICS if m != "gamma_post" or "post" in points]
        self.metrics = [m for m in metrics if m not in ("gamma_mid", "rho") or "mid" in points]
        self.width = max(2, len(str(max(n_layers - 1, 0))))
        self.bases = {i: plan.layers[i].bases for i in sorted(plan.layers)}
        self.own = {i: [m for m in b.measures if type(m).scalars is not Builtin.scalars] for i, b in self.bases.items()}
        self.shapes = {  # layer -> (name, shape) of the fields its own measures log, as ``zero`` makes them
            i: [(k, v.shape) for m in self.own[i] for k, v in m.zero(layer_sizes(i, b)).items()]
            for i, b in self.bases.items()
        }
        self.running = {  # layer -> (name, shape) of the fields the running values read (``measures.running_fields``)
            i: [(k, owner(k, b.measures).zero(layer_sizes(i, b))[k].shape) for k in running_fields()]
            for i, b in self.bases.items()
        }

    def tensors(self, acc: Accumulator) -> list[torch.Tensor]:
        """The sums a log point reads, on their devices: each layer's running fields, then its measures'."""
        out = []
        for i, running in zip(sorted(self.bases), acc.running()):
            out += running + [acc.state[i][k].detach() for k, _ in self.shapes[i]]
        return out

    def now(self, acc: Accumulator) -> dict[str, float]:
        """The running values of ``acc`` at once, {tag: value} (a device sync: ``enqueue`` is the lazy way)."""
        return self(torch.cat([t.to("cpu", torch.float64).flatten() for t in self.tensors(acc)]))

    def __call__(self, host: torch.Tensor) -> dict[str, float]:
        """``tensors``' values, flattened and concatenated on the host -> {tag: value}."""
        fields = {i: self.running[i] + self.shapes[i] for i in self.bases}
        parts = iter(host.to(torch.float64).flatten().split([s.numel() for f in fields.values() for _, s in f]))
        read = {i: {k: next(parts).reshape(s) for k, s in f} for i, f in fields.items()}
        out = {}
        for layer, ti, target in self.rows:
            vals = running_values(read[layer], ti)
            for m in self.metrics:
                out[tag(m, layer, target, self.width)] = vals[m]
            if self.own[layer] and ti == 0:  # a researcher's measure: one value a layer, logged once
                b = self.bases[layer]
                r = target_row(read[layer], ti, b.k_index[ti], b.targets[ti].k, layer=layer)
                for m in self.own[layer]:
                    for metric, v in m.scalars(r).items():
                        out[tag(metric, layer, None, self.width)] = float(v)
        return out


def call(sink, method: str, *args) -> None:
    """Call a sink, turning its error into a SinkError that names it."""
    try:
        getattr(sink, method)(*args)
    except Exception as e:
        what = {"forward": "this forward's line", "scalars": "the running values", "table": "the summary"}
        raise SinkError(
            f"sink {sink.name} could not be written ({what.get(method, method)}): {type(e).__name__}: {e}"
        ) from e
