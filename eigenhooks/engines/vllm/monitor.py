"""``eh.monitor(llm)`` on a ``vllm.LLM``: the with-block in the user's process, the sums in the worker.

The engine runs in its own process (and its workers in theirs); the sums live where the readings are,
in the worker that counts (tensor-parallel rank 0). Entering the block starts a session there by method
name (``collective_rpc("eigenhooks_start", args=(settings,))``), leaving it reads the state back
(``eigenhooks_stop``); ``read()`` reads it during the block. The state lands in an ``eh.Monitor`` over the
checkpoint's attention tensors (``session.checkpoint_adapter``; ``load_state_dict``, its fingerprint
checked), so ``summary()``,
``plot()``, ``save()``, ``state_dict()`` and the sinks are the HF monitor's own. ``requests()`` is one row
per (request, layer, target).

The verdict's kept tokens stay in the worker: a read carries the sums without them, the table's verdict
columns are computed there (``eigenhooks_verdict``, through ``accumulate.RemoteSample``), and the tokens
cross only for ``state_dict()`` (``eigenhooks_sample``, raw bytes). A stopped session's are kept there until
this monitor is entered again or let go (``eigenhooks_release``, sent at the next call into the engine after
``weakref.finalize`` noted it).
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
import weakref

from ...models.vllm import check_architecture
from ...monitor import MeasurementWarning, views
from ...monitor.accumulate import RemoteSample
from ...monitor.facade import make_config
from ..checkpoint import drop_resident
from .plugin import KEY
from .session import make_monitor, verdict_from_wire

log = logging.getLogger(__name__)


class NotOptedInError(RuntimeError):
    """The engine was built without eigenhooks' taps (no ``additional_config={"eigenhooks": ...}``)."""


def engine_config(llm):
    return llm.llm_engine.vllm_config


def _architectures(mc) -> list[str]:
    return list(getattr(mc, "architectures", None) or getattr(mc.hf_config, "architectures", None) or [])


class EngineMonitor:
    """The monitor of a ``vllm.LLM`` built with ``additional_config={"eigenhooks": {}}``.

    Args and settings: ``eh.monitor``'s (custom targets must be plain tensors, sent to the worker by value).
    ``sink``: a log point every ``log_every`` engine forwards, its step the engine forwards counted, and the
    summary at the block's end. The worker keeps each log point's values as the forwards run; they reach
    the sinks when the state is read back (``read()``, ``summary()``, the block's end), in order.

    Raises:
        NotOptedInError: the engine was built without the opt-in (a one-line message says how).
    """

    def __init__(self, llm, *args, sink=None, **settings):
        cfg = engine_config(llm)
        check_architecture(_architectures(cfg.model_config))  # one line naming it: opting in would not help
        extra = cfg.additional_config if isinstance(cfg.additional_config, dict) else {}
        if KEY not in extra:
            raise NotOptedInError(
                "this vLLM engine was built without eigenhooks, so nothing in it can be measured: build it with "
                "vllm.LLM(..., additional_config={'eigenhooks': {}}) (server: --additional-config "
                "'{\"eigenhooks\": {}}')"
            )
        self.config = make_config(args, dict(settings))  # checked here, as on an HF model
        self.llm, self.sink = llm, sink
        names = type(self.config).names()
        self._wire = {**dict(zip(names, args)), **settings}
        self._sid = None  # the worker's id of this monitor's session, while entered
        self._mon = None  # the eh.Monitor holding the state read back
        self._rows: list[dict] = []
        self.n_forwards = 0
        self._logged_at = -1  # the step of the last log point sent to the sinks
        self.dropped = 0
        self._active = False
        self._reading = False
        self._release = None  # lets go of the last session's verdict sample in the worker (weakref.finalize)

    def __repr__(self) -> str:  # one line from what was read back last: no call into the engine
        return views.facts_repr(self._facts())

    def _repr_html_(self) -> str:
        return views.facts_html(self._facts())

    def _facts(self) -> views.Facts:
        mc = engine_config(self.llm).model_config
        model = f"vLLM {(_architectures(mc) or ['?'])[0]}"
        state = "active" if self._active else ("closed" if self._mon is not None else "not entered")
        if self._mon is not None:  # the state read back: the HF monitor's facts, the engine's forwards
            if self._active:
                state = "active, counts of the last read()"
            f = views.monitor_facts(self._mon)
            return dataclasses.replace(f, owner="EngineMonitor", model=model, forwards=self.n_forwards, state=state)
        hf = mc.hf_config
        names, n = views.config_target_names(self.config.targets, hf.num_attention_heads)
        tokens = None if self._active else 0
        return views.Facts("EngineMonitor", model, hf.num_hidden_layers, tuple(names), n, self.n_forwards, tokens,
                           "in the engine (read() reads them)", 0, state)  # fmt: skip

    # ---- the block ----
    def __enter__(self) -> EngineMonitor:
        if self._active:
            raise RuntimeError("this monitor is already active; leave its with-block before entering it again")
        log_every = (self.config.log_every or 0) if self.sink is not None else 0
        started = [s for s in self.llm.collective_rpc("eigenhooks_start", args=(self._wire, log_every)) if s]
        if not started:
            raise RuntimeError("no vLLM worker took the eigenhooks session (expected tensor-parallel rank 0 to)")
        if self._release is not None:  # the last block's sample: this block's state will replace its table
            self._release()
        self._sid, self._active = started[0], True
        # when this monitor goes, its session's id joins the engine's list to let go of: a finalizer may run
        # inside any code (a garbage collection), so it only appends; the next call into the engine sends it
        self._release = weakref.finalize(self, _to_let_go(self.llm).append, self._sid)
        self._release.atexit = False  # at exit the engine's processes go, and their memory with them
        _let_go(self.llm)
        _before_shutdown(self.llm).add(self)
        return self

    def _bring_sample_here(self) -> None:
        """The engine is shutting down: its worker's copy of the verdict's sample comes here (raw bytes), so the
        table is still whole afterwards (computed here then, from the same tokens and targets)."""
        if self._mon is not None and not self._active:
            self._mon.hold_sample()

    def __exit__(self, *exc) -> None:
        self._active = False
        self._absorb(self.llm.collective_rpc("eigenhooks_stop", args=(self._sid,)))
        if self.sink is not None:
            if self._logged_at != self.n_forwards:
                self._monitor().log(self.n_forwards)
            self._monitor().log_summary(self.n_forwards)

    def read(self) -> EngineMonitor:
        """Read the worker's state now (during the block; the summary then includes open requests)."""
        if self._sid is None:
            raise RuntimeError("this monitor was never entered: read() reads an entered monitor's state")
        _let_go(self.llm)
        self._absorb(self.llm.collective_rpc("eigenhooks_read", args=(self._sid,)))
        return self

    def _absorb(self, results: list) -> None:
        got = [r for r in results if r is not None]
        if not got:
            return
        res = got[0]
        mon = self._monitor()
        # the verdict's sample stays in the worker, which computes the table's verdict columns where it is
        remote = RemoteSample(mon.config.verdict_tokens, _Columns(self.llm, self._sid), _Fetch(self.llm, self._sid))
        mon.load_state_dict(res["state"], sample=remote)
        drop_resident(mon.adapter)  # the plan is built by now: the checkpoint's pages are not needed
        self._rows = res["requests"]
        self.n_forwards, self.dropped = res["n_forwards"], res["dropped"]
        for step, values in res.get("log_points") or ():  # the worker's log points, in order
            mon._logs.scalars(step, values)
            self._logged_at = step
        if self.dropped:
            warnings.warn(
                f"{self.dropped} engine forwards were not measured (a tap did not write all their tokens); "
                "their tokens are not in the table",
                MeasurementWarning,
                stacklevel=3,
            )

    def _monitor(self):
        if self._active and not self._reading:  # inside the block: the worker's state now, open requests in
            self._reading = True
            try:
                self.read()
            finally:
                self._reading = False
        if self._mon is None:
            self._mon = make_monitor(engine_config(self.llm), self._wire, self.sink, llm=self.llm)
        return self._mon

    # ---- results: the HF monitor's own ----
    def summary(self):
        """pandas DataFrame, one row per (layer, target), as ``Monitor.summary`` (the request is the cluster)."""
        return self._monitor().summary()

    def requests(self):
        """pandas DataFrame, one row per (request_id, sample, layer, target): the sequence's n_tokens,
        gamma_pre, gamma_mid, gamma_post, rho; ``cached_prefix`` (positions served from the prefix cache, not
        computed, not counted), ``recomputed`` (tokens computed again after a preemption, not counted twice)
        and ``finished`` (the scheduler ended it). ``request_id`` is ``RequestOutput.request_id``; ``sample``
        is ``CompletionOutput.index`` (with ``n > 1`` each sample is its own sequence; else 0); ``engine_id`` is
        the engine's own id of the request, unique: requests that shared an id (vLLM accepts duplicates) are
        rows of their own, told apart by it (``ids``)."""
        import pandas as pd

        return pd.DataFrame(self._rows)

    def state_dict(self) -> dict:
        return self._monitor().state_dict()

    def save(self, path):
        return self._monitor().save(path)

    def plot(self, *args, **kwargs):
        return self._monitor().plot(*args, **kwargs)

    def scalars(self) -> dict:
        return self._monitor().scalars()


def _one(llm, method: str, *args):
    """The answer of the worker that counts (tensor-parallel rank 0) to ``method``; None from the others."""
    got = [r for r in llm.collective_rpc(method, args=args) if r is not None]
    if not got:
        raise RuntimeError(
            "the vLLM engine no longer holds this monitor's verdict sample (its engine was shut down or reset): "
            "read summary() or state_dict() while the engine runs"
        )
    return got[0]


@dataclasses.dataclass
class _Columns:
    """``RemoteSample.columns``: the verdict's columns computed in the worker, where the sample is."""

    llm: object
    sid: int

    def __call__(self, blocks: dict[int, int]) -> dict[int, list[dict]]:
        return verdict_from_wire(_one(self.llm, "eigenhooks_verdict", self.sid, [[i, b] for i, b in blocks.items()]))


@dataclasses.dataclass
class _Fetch:
    """``RemoteSample.fetch``: the sample itself, sent as raw bytes (``Sample.to_dict(raw=True)``)."""

    llm: object
    sid: int

    def __call__(self) -> dict:
        return _one(self.llm, "eigenhooks_sample", self.sid)


def _before_shutdown(llm) -> weakref.WeakSet:
    """The monitors whose verdict sample the engine's worker keeps; its client's ``shutdown`` (what
    ``llm.llm_engine.engine_core.shutdown()`` calls) first brings each one's sample into this process."""
    engine = llm.llm_engine
    mons = getattr(engine, "_eigenhooks_monitors", None)
    if mons is None:
        mons = engine._eigenhooks_monitors = weakref.WeakSet()
        core = getattr(engine, "engine_core", None)
        inner = getattr(core, "shutdown", None)
        if inner is None:  # a client without a shutdown of its own: nothing to hook
            return mons

        def shutdown(*args, **kwargs):
            for mon in list(mons):
                try:
                    mon._bring_sample_here()
                except Exception as e:  # the engine is already gone: its table cannot be whole, say so when read
                    log.warning("eigenhooks: the verdict's sample could not be read before shutdown: %s", e)
            mons.clear()
            _to_let_go(llm).clear()  # the worker, and every sample it kept, go with the engine
            engine._eigenhooks_shut = True
            return inner(*args, **kwargs)

        core.shutdown = shutdown
    return mons


def _to_let_go(llm) -> list[int]:
    """The engine's stopped sessions whose monitors are gone: their samples are let go of at the next call."""
    engine = llm.llm_engine
    ids = getattr(engine, "_eigenhooks_let_go", None)
    if ids is None:
        ids = engine._eigenhooks_let_go = []
    return ids


def _let_go(llm) -> None:
    """Let go, in the worker, of the samples of the stopped sessions whose monitors are gone (``_to_let_go``)."""
    ids = _to_let_go(llm)
    if ids and not getattr(llm.llm_engine, "_eigenhooks_shut", False):
        sids, ids[:] = list(ids), []
        llm.collective_rpc("eigenhooks_release", args=(sids,))


__all__ = ["EngineMonitor", "NotOptedInError"]
