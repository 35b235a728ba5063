"""The monitor's sinks at run time: when they are written, and what a failed write undoes.

A mixin of ``Monitor`` (sinks.py holds the sinks themselves). Every ``log_every`` forwards is a
log point: the running sums of every layer are copied to the host and logged with the step
``mon.step`` (your own global step, if you set it) or else the forward count. On a GPU the copy
is enqueued with ``non_blocking`` into pinned memory and read at the *next* log point, when it
has long arrived, so no forward waits for the device; on exit (or ``mon.log()``) the last values
are read at once. The summary table goes to the sinks on exit and on ``mon.log_summary()``.

A forward counts whole or not at all (DESIGN.md §1), sinks included: a forward during which a
sink write fails is not counted. Its sums are taken back, ``n_forwards`` stays, its .jsonl line
is truncated away, and the model call raises ``SinkError``, as a forward that raises adds
nothing. What a sink wrote at that log point was an earlier log point's values (those counted);
a sink that did not take them gets them again at the next log point or on exit.
"""

from __future__ import annotations

import warnings

import torch

from . import stats as M
from .sinks import METRICS, SinkError, make_sinks, scalar_values


class MonitorLogs:
    """The sinks half of ``Monitor`` (hooks.py calls ``_init_logs``, ``_commit_logged`` and ``_end_logs``)."""

    def _init_logs(self, sink, log_every) -> None:
        if log_every is not None and (isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 0):
            raise ValueError(
                f"log_every must be a non-negative int (0 or None: only on exit and mon.log()), got {log_every!r}"
            )
        self._sinks = make_sinks(sink)
        jsonl = [s for s in self._sinks if s.per_forward]
        self.sink_path = jsonl[0].path if jsonl else None  # per-forward sums: no buffering of 1-token forwards
        self.log_every = log_every or 0
        self.step: int | None = None  # the step of the next log point; None: the forward count
        self._log_pending: dict | None = None  # a log point's values on their way to the host
        self._log_host: torch.Tensor | None = None  # pinned, reused
        self._logged_at = 0  # n_forwards at the last log point
        self._summary_at: int | None = None  # n_forwards when the summary was last logged

    # ---- public ----
    def scalars(self) -> dict[str, float]:
        """The running values now, ``{tag: value}``: gamma_pre/mid/post, rho and n_tokens per
        (layer, target), tagged ``eigenhooks/rho/L07/ov-modulus``. Reads the device (a sync)."""
        self._prepare()
        self._flush()
        rows = torch.cat([self._state[i]["tgt"].detach().to("cpu", torch.float64) for i in sorted(self._layers)])
        return self._values(rows.tolist())

    def log(self, step: int | None = None) -> dict[str, float]:
        """Log the running values to the sinks now, at ``step`` (default ``mon.step``, else the
        forward count), after any earlier log point still on its way. Returns them.

        Raises:
            SinkError: a sink could not be written (the monitor's sums are untouched).
        """
        self._emit_pending()
        values = self.scalars()
        step = self._step_now(step)
        for s in self._sinks:
            if not s.per_forward:
                _call(s, "scalars", step, values)
        self._logged_at = self.n_forwards
        return values

    def log_summary(self, step: int | None = None):
        """Log ``mon.summary()`` to the sinks in each one's own form (TensorBoard text, a wandb
        Table, the MLflow artifact ``eigenhooks/summary.csv``); done on exit too. Returns the table.

        Raises:
            SinkError: a sink could not be written.
        """
        df = self.summary()
        step = self._step_now(step)
        for s in self._sinks:
            if not s.per_forward:
                _call(s, "table", step, df)
        self._summary_at = self.n_forwards
        return df

    # ---- in a forward ----
    def _commit_logged(self) -> None:
        """``_commit``, then the sinks; if a sink fails, the forward is taken back whole."""
        if not self._sinks:
            self._commit()
            return
        saved = self._save_commit()
        written = []
        try:
            self._commit()
            if self._pending and any(s.per_forward for s in self._sinks):
                stats = self._forward_stats()
                for s in self._sinks:
                    if s.per_forward:
                        written.append(s)
                        _call(s, "forward", self.n_forwards, stats)
            if self.log_every and self.n_forwards % self.log_every == 0 and self._scalar_sinks():
                self._emit_pending()
                self._enqueue(self._step_now(None))
        except BaseException as e:
            for s in written:
                s.undo()
            self._restore_commit(saved)
            self._reset_forward(open_=False)
            if self._closing:
                self._finish_deferred_close(raised=True)
            if isinstance(e, SinkError):
                raise SinkError(f"{e}. This forward was not counted (its sums were taken back)") from e.__cause__
            raise

    def _forward_stats(self) -> list[dict]:
        """This forward's own target sums (``_pending`` after ``_commit``), one dict per (layer, target)."""
        out = []
        for layer, (sums, _) in sorted(self._pending.items()):
            for ti, meta in enumerate(self._layers[layer]["meta"]):
                row = dict(zip(M.TGT_FIELDS, sums["tgt"][ti].tolist()))
                out.append({"layer": layer, "target": meta["target"], **row})
        return out

    def _save_commit(self) -> tuple:
        # _commit replaces the state's tensors (``st[k] = st[k] + v``), never writes into them, so
        # copies of the dicts that hold them are the whole state before this forward.
        return (
            self.n_forwards,
            {i: dict(st) for i, st in self._state.items()},
            dict(self._rows),
            {i: list(b) for i, b in self._buf.items()},
            self._log_pending,
            self._logged_at,
        )

    def _restore_commit(self, saved: tuple) -> None:
        n, state, rows, buf, pending, logged_at = saved
        self.n_forwards, self._state, self._rows, self._buf = n, state, rows, buf
        self._log_pending, self._logged_at = pending, logged_at
        self.token_records[:] = [r for r in self.token_records if r["forward"] != n]

    # ---- log points ----
    def _scalar_sinks(self) -> bool:
        return any(not s.per_forward for s in self._sinks)

    def _step_now(self, step: int | None) -> int:
        return int(step if step is not None else self.step if self.step is not None else self.n_forwards)

    def _values(self, rows: list) -> dict[str, float]:
        labels = [(i, meta["target"]) for i in sorted(self._layers) for meta in self._layers[i]["meta"]]
        metrics = [m for m in METRICS if m != "gamma_post" or "post" in self.points]
        metrics = [m for m in metrics if m not in ("gamma_mid", "rho") or "mid" in self.points]
        return scalar_values(rows, labels, metrics, self.adapter.n_layers)

    def _enqueue(self, step: int) -> None:
        """Start copying the running sums to the host; ``_emit_pending`` reads them later."""
        self._flush()
        tgt = [self._state[i]["tgt"].detach() for i in sorted(self._layers)]
        dev = next((t.device for t in tgt if t.device.type == "cuda"), None)
        event = None
        if dev is None:
            host = torch.cat([t.to(torch.float64) for t in tgt])  # a new tensor: later forwards do not touch it
        else:
            flat = torch.cat([t.to(dev, torch.float64, non_blocking=True) for t in tgt])  # (rows, len(TGT_FIELDS))
            if self._log_host is None or self._log_host.shape != flat.shape:
                self._log_host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            self._log_host.copy_(flat, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(dev))
            host = self._log_host
        self._log_pending = {"step": step, "forward": self.n_forwards, "host": host, "event": event, "done": set()}
        self._logged_at = self.n_forwards

    def _emit_pending(self) -> None:
        """Log the values of the last log point, once they are on the host (they are, by the next one)."""
        p = self._log_pending
        if p is None:
            return
        if p["event"] is not None and not p["event"].query():
            p["event"].synchronize()
        values = self._values(p["host"].tolist())
        for i, s in enumerate(self._sinks):
            if s.per_forward or i in p["done"]:
                continue
            _call(s, "scalars", p["step"], values)
            p["done"].add(i)  # taken: not sent again if another sink fails
        self._log_pending = None

    # ---- on exit ----
    def _end_logs(self, raised: bool) -> None:
        """The with-block ended: the last values and the summary to the sinks, then flush them.

        After an exception in the block a sink's own error is a warning, so the block's error is
        the one that propagates."""
        if not self._sinks:
            return
        try:
            try:
                if self._scalar_sinks() and self.n_forwards:
                    if self._logged_at != self.n_forwards:
                        self._emit_pending()
                        self._enqueue(self._step_now(None))
                    self._emit_pending()
                    if self._summary_at != self.n_forwards:
                        self.log_summary()
            finally:
                for s in self._sinks:
                    _call(s, "close")
        except Exception as e:
            if not raised:
                raise
            warnings.warn(f"eigenhooks: {e}", RuntimeWarning, stacklevel=3)


def _call(sink, method: str, *args) -> None:
    """Call a sink, turning its error into a SinkError that names it."""
    try:
        getattr(sink, method)(*args)
    except Exception as e:
        what = {"forward": "this forward's line", "scalars": "the running values", "table": "the summary"}
        raise SinkError(
            f"sink {sink.name} could not be written ({what.get(method, method)}): {type(e).__name__}: {e}"
        ) from e
