"""The worker side: taps placed when the model loads, each forward mapped to requests, the sums read back.

vLLM imports this module in its worker processes because the opt-in names ``EigenhooksWorker`` as the
engine's worker extension (``plugin.py``); a plain engine never imports it. On import it wraps the model
runners' ``load_model`` (only an engine whose ``additional_config`` holds ``"eigenhooks"`` is touched):
once the model is loaded, before vLLM compiles it, the taps go in (``capture.place_taps``) and the
runner's ``execute_model`` learns to hand each forward's readings and token map to every entered session
(``SESSIONS``: monitors nested on one engine are a session each).

``EigenhooksWorker``'s methods are called by name (``collective_rpc("eigenhooks_start", ...)``), so nothing
is pickled and ``VLLM_ALLOW_INSECURE_SERIALIZATION`` stays off. Under tensor parallelism every rank holds
the whole residual stream (the row-parallel projections all-reduce it): rank 0 alone counts.
"""

from __future__ import annotations

import itertools
import logging
import sys

from ...models.vllm import vllm_layout
from .capture import STORE, place_taps
from .plugin import KEY

log = logging.getLogger(__name__)


def opted_in(vllm_config) -> dict | None:
    extra = getattr(vllm_config, "additional_config", None) or {}
    opts = extra.get(KEY) if isinstance(extra, dict) else None
    return None if opts is None else dict(opts)


# The entered monitors' sessions (session.Session) in this process, by id: each forward is told to every one,
# so monitors nested on one engine each count exactly the forwards of their own block.
SESSIONS: dict[int, object] = {}
# Stopped sessions' verdicts (``KeptVerdict``: the sample and the targets, no sums), by id: their monitors ask for
# the table's verdict columns here, where the sample is, until they let go (``eigenhooks_release``).
KEPT: dict[int, object] = {}
_IDS = itertools.count(1)


def _randomized() -> bool:
    """vLLM appends 8 random characters to each request id (so ids the user chose twice stay apart)."""
    import vllm.envs as envs

    return not envs.VLLM_DISABLE_REQUEST_ID_RANDOMIZATION


def _token_map(runner, sched):
    """The forward's requests by the engine's internal id (unique: the key they are counted by), each one's
    token count and first position, from the host-side batch metadata the runner built the forward from
    (``num_computed_tokens_cpu``: each request's positions are that and on): nothing is read back from the
    device, so nothing waits for the forward."""
    from ..requests import TokenMap

    batch = runner.input_batch
    n = batch.num_reqs
    ids = list(batch.req_ids[:n])
    counts = [int(sched.num_scheduled_tokens[r]) for r in ids]
    return TokenMap(ids, counts, [int(x) for x in batch.num_computed_tokens_cpu[:n]])


def _wrap_execute(runner) -> None:
    inner = runner.execute_model

    def execute_model(scheduler_output, *args, **kwargs):
        if not SESSIONS:
            return inner(scheduler_output, *args, **kwargs)
        sessions = list(SESSIONS.values())
        finished = list(scheduler_output.finished_req_ids)
        if finished:
            for s in sessions:
                with s.lock:
                    s.engine.end(finished)
                    if s.sink is not None:
                        s.sink.write_ended(s.engine)
        out = inner(scheduler_output, *args, **kwargs)
        total = scheduler_output.total_num_scheduled_tokens
        if total:
            drain(sessions, total, lambda: _token_map(runner, scheduler_output))
        return out

    runner.execute_model = execute_model
    dummy = getattr(runner, "_dummy_run", None)
    if dummy is None:
        return

    def _dummy_run(*args, **kwargs):
        """A forward of no request (vLLM's warm-ups, graph captures, data parallel's idle ranks, and
        ``execute_model`` with nothing scheduled under DP): the taps write it while a monitor is entered, and
        nothing drains it, so its writes are forgotten, lest the next forward count as one they missed."""
        try:
            return dummy(*args, **kwargs)
        finally:
            if SESSIONS:
                STORE.forget()

    runner._dummy_run = _dummy_run


def drain(sessions, total: int, token_map, store=STORE) -> None:
    """After a forward of ``total`` tokens: its readings (``store``'s) told to every session, with the
    device's word on whether the taps wrote them (``TapStore.check``: a forward they did not write counts
    none of its tokens; nothing is read back here). ``token_map``: the forward's ``TokenMap``, made from
    the host's batch metadata."""
    written = store.check()
    readings = None if written is None else store.readings(sessions[0].n_layers, total)
    tm = None if readings is None else token_map()
    for s in sessions:
        with s.lock:
            if readings is None:
                s.dropped += 1
            else:
                s.engine.forward(readings, tm, written)
    if readings is None:
        log.warning("eigenhooks: a forward's readings were not all written; it was not counted")


def _instrument(runner) -> None:
    """Taps into the freshly loaded model (before its first forward compiles it), and the forward wrap."""
    cfg = runner.vllm_config
    model = runner.model
    capacity = max(int(cfg.scheduler_config.max_num_batched_tokens), 1)
    device = next(model.parameters()).device
    # the slab holds what a CUDA graph replays (its largest batch); with no graphs (the CPU build), small steps
    fixed = (
        (getattr(cfg.compilation_config, "max_cudagraph_capture_size", None) or 512) if device.type == "cuda" else 64
    )
    arch = cfg.model_config.architecture
    place_taps(model, capacity, fixed, cfg.model_config.get_hidden_size(), cfg.model_config.dtype, device, arch)
    _wrap_execute(runner)
    runner._eigenhooks_layers = len(vllm_layout(model, arch).layers)
    opts = opted_in(cfg)
    if opts.get("out") and _rank0(runner):  # served: measured from the start, one line per finished request
        _serve(runner, opts)


def _serve(runner, opts: dict) -> None:
    from .ids import api_label
    from .serve import JsonlSink
    from .session import make_session

    randomized = _randomized()
    label = lambda key: api_label(key, randomized)  # noqa: E731
    SESSIONS[next(_IDS)] = make_session(runner, opts.get("settings") or {}, sink=JsonlSink(opts["out"]), label=label)


def _wrap_load(cls) -> None:
    inner = cls.__dict__.get("load_model")
    if inner is None or getattr(inner, "_eigenhooks", False):
        return

    def load_model(self, *args, **kwargs):
        out = inner(self, *args, **kwargs)
        if opted_in(self.vllm_config) is not None:
            _instrument(self)
        return out

    load_model._eigenhooks = True
    cls.load_model = load_model


def install() -> None:
    """Wrap the model runners' ``load_model`` (idempotent). Called when vLLM imports this module."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _wrap_load(GPUModelRunner)
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    except ImportError:  # a GPU build
        return
    _wrap_load(CPUModelRunner)


def _rank0(worker) -> bool:
    from vllm.distributed import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank() == 0


class EigenhooksWorker:
    """vLLM worker extension (``worker_extension_cls``): the monitor's calls by name.

    Each returns plain data (lists, dicts, strings, ints), so ``collective_rpc`` carries it without
    pickling. A monitor's session is named by the id ``eigenhooks_start`` returned.
    """

    def eigenhooks_start(self, settings: dict, log_every: int = 0) -> int | None:
        """Enter a monitor with ``settings`` (``eh.monitor``'s), keeping a log point every ``log_every`` engine
        forwards for the user's sinks (0: none). Returns its session's id; None on ranks that do not count.
        Sessions already entered go on: each counts every forward while it is entered."""
        from .ids import request_label
        from .session import make_session

        if not _rank0(self):
            return None
        if any(s.sink is not None for s in SESSIONS.values()):
            raise RuntimeError(
                "this engine is served with eigenhooks' 'out': it measures from its start, "
                "one line per finished request; a with-block cannot start another session"
            )
        randomized = _randomized()
        label = lambda key: request_label(key, randomized)  # noqa: E731
        session = make_session(self.model_runner, settings, log_every=log_every, label=label)
        sid = next(_IDS)
        SESSIONS[sid] = session
        return sid

    def eigenhooks_read(self, sid: int) -> dict | None:
        """Session ``sid``'s state (open requests folded in) without the verdict's sample, which stays here
        (``eigenhooks_verdict`` computes its columns, ``eigenhooks_sample`` sends it), and its per-request rows."""
        s = SESSIONS.get(sid)
        if s is None:
            return None
        with s.lock:
            return {"state": s.engine.state_dict(sample=False), "requests": s.engine.rows(),
                    "dropped": s.dropped + s.missed(), "n_forwards": s.engine.n_forwards,
                    "log_points": s.engine.take_log_points()}  # fmt: skip

    def eigenhooks_verdict(self, sid: int, blocks: list) -> dict | None:
        """Session ``sid``'s verdict columns now (``Accumulator.verdict``, ``blocks`` as [layer, blocks] pairs),
        as ``session.verdict_to_wire`` gives them; a stopped session's from what it kept. None: unknown here."""
        from .session import verdict_to_wire

        want = {int(i): int(b) for i, b in blocks}
        s = SESSIONS.get(sid)
        if s is not None:
            with s.lock:
                return verdict_to_wire(s.engine.verdict(want))
        kept = KEPT.get(sid)
        return None if kept is None else verdict_to_wire(kept.verdict(want))

    def eigenhooks_sample(self, sid: int) -> dict | None:
        """Session ``sid``'s verdict sample as raw bytes (``Sample.to_dict(raw=True)``): only for a whole state."""
        s = SESSIONS.get(sid)
        if s is not None:
            with s.lock:
                return s.engine.sample()
        kept = KEPT.get(sid)
        return None if kept is None or kept.sample is None else kept.sample.to_dict(raw=True)

    def eigenhooks_stop(self, sid: int) -> dict | None:
        """Leave session ``sid``: its final read, then it is told nothing more (the others go on); its verdict's
        sample is kept until its monitor lets go (``eigenhooks_release``)."""
        out = self.eigenhooks_read(sid)
        s = SESSIONS.pop(sid, None)
        if s is not None:
            s.close()
            with s.lock:
                KEPT[sid] = s.engine.kept_verdict()
        return out

    def eigenhooks_release(self, sids: list) -> int:
        """Forget stopped sessions' verdicts (their monitors are gone or entered again). Returns how many were
        kept."""
        return sum(KEPT.pop(int(sid), None) is not None for sid in sids)


if "vllm" in sys.modules:  # imported by vLLM resolving the worker extension (not by a walk of the package)
    install()

__all__ = ["KEPT", "SESSIONS", "EigenhooksWorker", "install", "opted_in"]
