"""The worker side: taps placed when the model loads, each forward mapped to requests, the sums read back.

vLLM imports this module in its worker processes because the opt-in names ``EigenhooksWorker`` as the
engine's worker extension (``plugin.py``); a plain engine never imports it. On import it wraps the model
runners' ``load_model`` (only an engine whose ``additional_config`` holds ``"eigenhooks"`` is touched):
once the model is loaded, before vLLM compiles it, the taps go in (``capture.place_taps``) and the
runner's ``execute_model`` learns to hand each forward's readings and token map to the running session.

``EigenhooksWorker``'s methods are called by name (``collective_rpc("eigenhooks_start", ...)``), so nothing
is pickled and ``VLLM_ALLOW_INSECURE_SERIALIZATION`` stays off. Under tensor parallelism every rank holds
the whole residual stream (the row-parallel projections all-reduce it): rank 0 alone counts.
"""

from __future__ import annotations

import logging
import sys

from ...models.vllm import vllm_layout
from .capture import STORE, place_taps

log = logging.getLogger(__name__)

KEY = "eigenhooks"


def opted_in(vllm_config) -> dict | None:
    extra = getattr(vllm_config, "additional_config", None) or {}
    opts = extra.get(KEY) if isinstance(extra, dict) else None
    return None if opts is None else dict(opts)


def user_key(internal: str, randomized: bool) -> str:
    """The request id the user sees, from the engine's internal one (``{id}-{8 hex}`` unless vLLM's
    request id randomisation is off). Samples of ``n > 1`` keep their ``{index}_`` prefix."""
    if randomized:
        head, sep, tail = internal.rpartition("-")
        if sep and len(tail) == 8:
            return head
    return internal


SESSION = None  # the entered monitor's session.Session in this process, if any


def _token_map(runner, sched, randomized: bool):
    from ..requests import TokenMap

    n = runner.input_batch.num_reqs
    ids = list(runner.input_batch.req_ids[:n])
    counts = [int(sched.num_scheduled_tokens[r]) for r in ids]
    total = sum(counts)
    pos = runner.positions[:total].to("cpu")
    starts, at = [], 0
    for c in counts:
        starts.append(int(pos[at]))
        at += c
    return TokenMap([user_key(r, randomized) for r in ids], counts, starts)


def _wrap_execute(runner) -> None:
    inner = runner.execute_model
    import vllm.envs as envs

    randomized = not envs.VLLM_DISABLE_REQUEST_ID_RANDOMIZATION

    def execute_model(scheduler_output, *args, **kwargs):
        s = SESSION
        if s is None:
            return inner(scheduler_output, *args, **kwargs)
        with s.lock:
            finished = [user_key(r, randomized) for r in scheduler_output.finished_req_ids]
            if finished:
                s.engine.end(finished)
                if s.sink is not None:
                    s.sink.write_ended(s.engine)
            STORE.start_forward()
            out = inner(scheduler_output, *args, **kwargs)
            total = scheduler_output.total_num_scheduled_tokens
            if total:
                readings = STORE.readings(s.n_layers, total)
                if readings is None:
                    s.dropped += 1
                    log.warning("eigenhooks: a forward's readings were not all written; it was not counted")
                else:
                    s.engine.forward(readings, _token_map(runner, scheduler_output, randomized))
            return out

    runner.execute_model = execute_model


def _instrument(runner) -> None:
    """Taps into the freshly loaded model (before its first forward compiles it), and the forward wrap."""
    cfg = runner.vllm_config
    model = runner.model
    capacity = max(int(cfg.scheduler_config.max_num_batched_tokens), 1)
    place_taps(model, capacity)
    _wrap_execute(runner)
    runner._eigenhooks_layers = len(vllm_layout(model).layers)
    opts = opted_in(cfg)
    if opts.get("out") and _rank0(runner):  # served: measured from the start, one line per finished request
        _serve(runner, opts)


def _serve(runner, opts: dict) -> None:
    global SESSION
    from .serve import JsonlSink
    from .session import make_session

    SESSION = make_session(runner, opts.get("settings") or {}, sink=JsonlSink(opts["out"]))


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

    Each returns plain data (lists, dicts, strings), so ``collective_rpc`` carries it without pickling.
    """

    def eigenhooks_start(self, settings: dict, log_every: int = 0) -> bool:
        """Enter a monitor with ``settings`` (``eh.monitor``'s), keeping a log point every ``log_every`` engine
        forwards for the user's sinks (0: none); False on ranks that do not count."""
        global SESSION
        from .session import make_session

        if not _rank0(self):
            return False
        if SESSION is not None and SESSION.sink is not None:
            raise RuntimeError(
                "this engine is served with eigenhooks' 'out': it measures from its start, "
                "one line per finished request; a with-block cannot start another session"
            )
        if SESSION is not None:
            SESSION.close()
        SESSION = make_session(self.model_runner, settings, log_every=log_every)
        return True

    def eigenhooks_read(self) -> dict | None:
        """The entered monitor's state (open requests folded in) and its per-request rows."""
        s = SESSION
        if s is None:
            return None
        with s.lock:
            return {"state": s.engine.state_dict(), "requests": s.engine.rows(), "dropped": s.dropped,
                    "n_forwards": s.engine.n_forwards, "log_points": s.engine.take_log_points()}  # fmt: skip

    def eigenhooks_stop(self) -> dict | None:
        """Leave the monitor: its final read, then nothing is copied any more."""
        global SESSION
        out = self.eigenhooks_read()
        if SESSION is not None:
            SESSION.close()
        SESSION = None
        return out


if "vllm" in sys.modules:  # imported by vLLM resolving the worker extension (not by a walk of the package)
    install()

__all__ = ["EigenhooksWorker", "install", "opted_in", "user_key"]
