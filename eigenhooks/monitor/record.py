"""The record: what an attachment tells of the model's forwards, counted (``models.attach.Record``).

A forward's life, one way (docs/adapters.md): the attachment says a forward starts (its
``CallFacts``) -> the record makes a ``forward.Forward`` for it and hands it each reading ->
the forward ends: its sums are reduced (``Forward.finish``), counted (``Accumulator.add``) and
logged (``logs.LogPoints``), or taken back whole if a sink write fails; a forward that raised is
dropped whole. Nothing goes back to the attachment. A flat batch's requests stay open across
forwards until the engine ends them (``requests_end``); what they counted so far is asked for apart
(``request_counters``), so that every event returns nothing.

A record needs only the ``Plan`` and the ``MonitorConfig``: it can live in another process (an
engine's worker, ``RecordSpec``) and be read back there (``state_dict``).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, replace

import torch

from ..models.attach import Attachment, CallFacts, Warner
from ..models.hooks import thread_key
from .accumulate import Accumulator
from .config import MonitorConfig
from .forward import Call, Forward, Generation, lean_layout
from .logs import Labels
from .plan import Plan
from .sinks import SinkError


@dataclass
class RecordSpec:
    """What a record in another process is made from (picklable): the plan without its model's modules
    (``LayerPlan.reading``: the attachment there finds its own), the settings, and the fingerprint its
    ``state_dict`` carries back, so that ``Monitor.merge_state_dict`` takes it."""

    plan: Plan
    config: MonitorConfig
    fingerprint: dict

    def attach(self, adapter) -> tuple[Record, Attachment]:
        """A record made from this spec, and ``adapter``'s attachment (this process's model) telling it, attached."""
        record = Record(self.plan, self.config, fingerprint=self.fingerprint)
        layers = {i: replace(lp, reading=adapter.reading_points(i)) for i, lp in self.plan.layers.items()}
        att = adapter.attachment(layers, self.config.reading_points, record, record.warn)
        record.attached(att)
        att.attach()
        return record, att


def worker_plan(plan: Plan) -> Plan:
    """``plan`` without the model's reading points (modules), for a ``RecordSpec``."""
    return replace(plan, layers={i: replace(lp, reading=None) for i, lp in plan.layers.items()})


class Record:
    """The forwards of one model as an attachment tells them, counted into an ``Accumulator``.

    Args:
        plan: what is measured. config: the settings. acc: the accumulator (default: a new one).
        logs: the sinks' log points (``logs.LogPoints``) and labels (a callable giving ``logs.Labels``),
            or None. warn: a ``Warner``. mask: a padding mask given to the monitor, overriding the
            calls'. stacks: the model's stacks (``Adapter.stacks``). fingerprint: what ``state_dict``
            says its sums mean.
    """

    def __init__(self, plan: Plan, config: MonitorConfig, acc=None, logs=None, warn=None, mask=None, stacks=(),
                 fingerprint=None):  # fmt: skip
        self.plan, self.config, self.points = plan, config, config.reading_points
        self.acc = acc if acc is not None else Accumulator(plan, config)
        self.logs, self.warn, self.mask, self.stacks = logs, warn or Warner(), mask, stacks
        self.fingerprint = fingerprint
        self.buffer = (logs is None or logs[0].sink_path is None) and not config.tokens
        self.ended = None  # called with raised after each forward's end (the monitor's deferred close)
        self._fwds: dict[int, Forward] = {}  # thread -> the forward running there (threads share a model)
        self._gens: dict[int, Generation] = {}  # thread -> the generate call running there
        self._tids: set[int] = set()  # threads that ran a forward
        self._solo: Forward | None = None  # the running forward, while one thread only ever ran them
        self._lock = threading.Lock()  # one forward counts at a time
        self._all_valid: list = []  # Forward's reused all-True mask
        self._lean = None  # (untapped count, once ids) where one-token steps may keep readings as they come
        self._lean_known: list = [None, None]  # the last step's order of readings and its layout (Forward)
        self._labels = None  # (n_layers, logs.Labels) of ``log_values``

    def attached(self, att: Attachment) -> None:
        """An attachment will talk to this record: whether its one-token steps may be kept as they come."""
        ok = att.once is not None and lean_layout(self.plan, att.once, att.n_slots, att.untapped)
        self._lean = (len(att.untapped), frozenset(map(id, att.once.values()))) if ok else None

    @property
    def running(self) -> bool:
        """A forward has started and not ended (in any thread)."""
        return bool(self._fwds)

    def drop_running(self) -> None:
        """Forwards that never ended count for nothing."""
        for fwd in self._fwds.values():
            fwd.drop()
        self._fwds.clear()
        self._solo = None

    # ---- the events ----
    def forward_start(self, facts: CallFacts) -> None:
        tid = thread_key()
        old = self._fwds.pop(tid, None)
        if old is not None:  # its end never came (interrupted): nothing of it counts
            old.drop()
        flat = facts.flat
        call = Call(False) if flat is not None else self._call(facts.rows, not facts.continues)
        mask = self.mask if self.mask is not None else facts.mask
        acc = self.acc
        seen = {} if call.fresh else acc.seen
        buffer = self.buffer and flat is None
        fwd = Forward(self.plan, self.points, mask, seen, buffer, self.config.tokens, acc.n_forwards,
                      self._all_valid, call, facts.attn_ran, flat, acc.sequences(call.fresh, flat, call.copies))  # fmt: skip
        self._fwds[tid] = fwd
        self._tids.add(tid)
        # one thread so far: readings skip the thread lookup. Written before the check, so a second
        # thread that added itself in between is seen here, or wrote None after this.
        self._solo = fwd
        if len(self._tids) > 1:
            self._solo = None
        rows = facts.rows
        if self._lean is not None and self._solo is not None and rows is not None and rows[1] == 1:
            fwd.lean_start(*self._lean, self._lean_known)

    def _call(self, rows, fresh: bool) -> Call:
        """What this forward is (``forward.Generation`` when it is a step of a ``generate``)."""
        gen = self._gens.get(thread_key())
        if gen is None or rows is None:
            return Call(fresh)
        call = gen.next_call(rows[0], rows[1], fresh)
        if call.copies > 1 and call.first_copy_only:
            self.warn(
                "copies",
                f"generate ran {call.copies} copies of each input row (num_beams or num_return_sequences): "
                "each input row is one cluster; its prompt positions were counted once, and the generated "
                f"positions of every copy ({call.copies} per step and input row) were counted",
            )
        return call

    def read(self, layer: int, point: str, x: torch.Tensor) -> None:
        fwd = self._solo if self._solo is not None else self._fwds.get(thread_key())
        if fwd is not None:
            fwd.read(layer, point, x)

    def read_once(self, roles: list, x: torch.Tensor) -> None:
        fwd = self._solo if self._solo is not None else self._fwds.get(thread_key())
        if fwd is None:
            return
        lean = fwd.lean
        if lean is not None:  # a one-token step: the reading kept as it came
            lean[0].append(roles)
            lean[1].append(x)
        else:
            for layer, point in roles:
                fwd.read(layer, point, x)

    def generate_start(self, rows: int | None) -> None:
        self._gens[thread_key()] = Generation(rows)

    def generate_end(self) -> None:
        self._gens.pop(thread_key(), None)

    def stack_start(self, name: str, mask) -> None:
        fwd = self._fwds.get(thread_key())
        if fwd is not None:
            fwd.stack_started(name, mask)

    def forward_end(self, ok: bool, intact: bool = True) -> None:
        """The forward ended: dropped if it raised; else reduced, counted and logged, or taken back whole."""
        try:
            self._count(ok, intact)
        except BaseException:
            if self.ended is not None:
                self.ended(True)
            raise
        if self.ended is not None:
            self.ended(not ok)

    def requests_end(self, keys) -> None:
        """The engine finished these requests: their sequences end (their counters fold into the sums)."""
        with self._lock:
            self.acc.end_requests(keys)

    # ---- queries ----
    def request_counters(self, keys=None) -> dict[str, torch.Tensor]:
        """The open requests' own counters so far, by key: those of ``keys`` still open (None: all of them).
        Each is (layers, len(measures.ROW), T) float64 on the host (``Accumulator.request_counters``: its
        tokens, up-counts and alignment sums per layer and target). Ask before ``requests_end``: an ended
        request's counters are folded into the sums and forgotten."""
        with self._lock:
            return self.acc.open_requests(keys)

    def log_values(self, n_layers: int) -> dict[str, float]:
        """The sinks' running values now, {tag: value} (``logs.Labels.now``; tags as wide as layer
        ``n_layers - 1``'s number)."""
        with self._lock:
            if self._labels is None or self._labels[0] != n_layers:
                self._labels = (n_layers, Labels(self.plan, self.points, n_layers))
            return self._labels[1].now(self.acc)

    # ---- counting ----
    def _count(self, ok: bool, intact: bool) -> None:
        tid = thread_key()
        fwd = self._fwds.pop(tid, None)
        if self._solo is fwd:
            self._solo = None
        if fwd is None:
            return
        if not ok:
            self._drop(fwd)
            return
        missing, partial = fwd.unmeasured(self.stacks)
        if (missing or partial) and intact:
            self._unmeasured(missing, partial)
        undo = mark = None
        logs = self.logs
        try:
            fs = fwd.finish()
            # threads sharing the model: one forward counts, and is logged, at a time (compiled: one thread)
            with contextlib.nullcontext() if torch.compiler.is_compiling() else self._lock:
                undo = self.acc.add(fs, undoable=logs is not None and bool(logs[0].sinks))
                if logs is not None:
                    mark = logs[0].mark()
                    logs[0].after_forward(mark, self.acc, self.plan, fs, logs[1]())
        except BaseException as e:
            self._drop(fwd)
            if mark is not None:
                logs[0].undo(mark)
            if undo is not None:
                self.acc.undo(undo)
            if isinstance(e, SinkError):
                raise SinkError(f"{e}. This forward was not counted (its sums were taken back)") from e.__cause__
            raise

    def _drop(self, fwd: Forward) -> None:
        """A forward that does not count gives its arena rows back (all of them when no other runs: a
        projection that raised half-way leaves its row taken)."""
        fwd.drop()
        if not self._fwds:
            for arena in self.plan.arenas:
                arena.release()

    def _unmeasured(self, missing: list[int], partial: list[int]) -> None:
        """Warn (once each) about layers a forward should have measured and did not."""
        if partial:
            self.warn(
                "partial-layers",
                f"in layers {partial} the attention or the next sublayer was not seen (its module skipped, "
                "replaced or swapped by another tool, e.g. a swapped HookPoint): gamma_mid and rho stay NaN there",
            )
        if missing:
            self.warn(
                "missing-layers",
                f"layers {missing} were not measured in a forward (their hooks did not fire: a block skipped, "
                "a module replaced or swapped by another tool, or hooks bypassed); their statistics stay NaN. "
                "A model compiled (torch.compile) before the monitor ignores hooks added later: enter eh.monitor "
                "before compiling, or call torch._dynamo.reset() after entering it.",
            )

    # ---- reading back (here, or from another process) ----
    def verdict(self, blocks: dict[int, int] | None = None) -> dict[int, list[dict]]:
        """The verdict's columns of the state now (``Accumulator.verdict``, with this record's settings)."""
        return self.acc.verdict(self.config, blocks)

    def sample_dict(self, raw: bool = False) -> dict | None:
        """The verdict's kept tokens (``Sample.to_dict``), or None where none are kept."""
        return self.acc.sample.to_dict(raw) if self.acc.sample is not None else None

    def kept_verdict(self):
        """What the verdict's columns are computed from, kept apart from the sums (``Accumulator.kept``)."""
        return self.acc.kept(self.config)

    def state_dict(self, sample: bool = True) -> dict:
        """The whole state (open sequences folded in) as plain lists, with the fingerprint it was made with;
        without the verdict's sample if not ``sample`` (its columns are then asked of this process:
        ``Accumulator.verdict``)."""
        acc = self.acc
        layers = {str(i): {k: v.tolist() for k, v in acc.current(i).items()} for i in self.plan.layers}
        out = {"fingerprint": self.fingerprint, "layers": layers}
        if sample and acc.sample is not None:
            out["sample"] = acc.sample.to_dict()
        return out
