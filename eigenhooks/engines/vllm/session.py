"""A monitor's plan for a vLLM engine, made from the checkpoint the engine loaded.

The engine's own weights cannot be read as they stand (the CPU backend repacks them; tensor parallel
shards them), so the plan (spectra, bases, nulls) comes from the checkpoint's tensors: each layer's V, O
and attention norm read from its safetensors in the engine's dtype (``engines.checkpoint.folder_adapter``, what
``eh.spectra(llm)`` reads), never a transformers model of it. The plan is the one the HF monitor makes of
that checkpoint (same F, same fingerprint), so the tables mean the same (their fingerprints are compared
when the state is read back).
"""

from __future__ import annotations

import dataclasses
import functools
import threading

import torch

from ...models import Adapter
from ...models.attach import Attachment
from .capture import STORE
from .plugin import settings_from_wire


@functools.lru_cache(maxsize=2)
def _checkpoint_adapter(model: str, revision, download_dir, dtype: str, architecture: str) -> Adapter:
    from ...zoo import checkpoint
    from ..checkpoint import folder_adapter

    folder = checkpoint.checkpoint_folder(model, revision, download_dir)
    return folder_adapter(folder, getattr(torch, dtype), architecture)


def checkpoint_adapter(vllm_config) -> Adapter:
    """The adapter over the attention weights of the checkpoint an engine loaded (V, O and the attention
    norms, read from its safetensors in the engine's dtype, as ``eh.spectra(llm)`` reads them): the plan
    needs F and the norms, so no transformers model (the whole checkpoint again) is built."""
    mc = vllm_config.model_config
    load = getattr(vllm_config, "load_config", None)
    model = getattr(mc, "model_weights", "") or mc.model
    return _checkpoint_adapter(
        model,
        getattr(mc, "revision", None),
        getattr(load, "download_dir", None),
        engine_dtype(vllm_config),
        mc.architecture,
    )


def engine_dtype(vllm_config) -> str:
    return str(vllm_config.model_config.dtype).removeprefix("torch.")


def make_monitor(vllm_config, settings: dict, sink=None, llm=None):
    """An unattached ``eh.Monitor`` over the engine's checkpoint (``checkpoint_adapter``; in the user's process,
    ``llm`` given, the one ``eh.spectra(llm)`` reads, shared, and a monitor that only reads states back:
    ``Monitor.states_only``), with ``settings`` (and ``sink``). Its fingerprint is the HF monitor's of the same
    checkpoint: the weights it digests are the same tensors."""
    from ...monitor import Monitor
    from .checkpoint import engine_adapter

    adapter = engine_adapter(llm) if llm is not None else checkpoint_adapter(vllm_config)
    mon = Monitor(adapter, attach=False, sink=sink, **settings_from_wire(settings))
    return mon.states_only() if llm is not None else mon  # the worker projects: yours keeps no null frames


def verdict_to_wire(columns: dict[int, list[dict]]) -> dict[str, list[dict]]:
    """``Accumulator.verdict``'s columns as plain data for an rpc: layers as strings, each row's tilt draws
    (``_null``, float64) as raw bytes."""
    out = {}
    for i, rows in columns.items():
        out[str(i)] = [
            {k: (v.detach().to("cpu", torch.float64).numpy().tobytes() if k == "_null" else v) for k, v in r.items()}
            for r in rows
        ]
    return out


def verdict_from_wire(wire: dict[str, list[dict]]) -> dict[int, list[dict]]:
    """``verdict_to_wire``'s inverse."""
    return {
        int(i): [
            {k: (torch.frombuffer(bytearray(v), dtype=torch.float64) if k == "_null" else v) for k, v in r.items()}
            for r in rows
        ]
        for i, rows in wire.items()
    }


class Session:
    """One entered monitor in this worker: the record its forwards are told to, and the served sink, if any."""

    def __init__(self, engine, n_layers: int, att, sink=None):
        self.engine, self.n_layers, self.att, self.sink = engine, n_layers, att, sink
        self.lock = threading.Lock()
        self.dropped = 0  # forwards whose readings were not all written, seen on the host (counted nowhere)
        self.missed_before = STORE.n_missed()  # forwards the taps did not write before this session (device)

    def missed(self) -> int:
        """Forwards of this session the taps did not write, by the device's count (``TapStore.check``)."""
        return STORE.n_missed() - self.missed_before

    def close(self) -> None:
        self.att.detach()
        if self.sink is not None:
            self.sink.close()


class TapAttachment(Attachment):
    """The attachment of an engine whose taps sit in its compiled graph (``capture``): the taps copy while
    any session is attached (monitors nested on one engine share them). The engine's glue tells the record
    each forward (``EngineRecord``)."""

    attached = False

    def attach(self) -> None:
        if not self.attached:
            self.attached = True
            STORE.attach()

    def detach(self) -> None:
        if self.attached:
            self.attached = False
            STORE.detach()


@dataclasses.dataclass
class CheckpointAdapter(Adapter):
    """The checkpoint's HF adapter (its layers give the plan), attached through the engine's taps."""

    def attachment(self, layers, points, record, warn, read_mask=True, layout=None):
        return TapAttachment()


def make_session(runner, settings: dict, sink=None, log_every: int = 0, label=None) -> Session:
    """The record of a monitor with ``settings`` in this worker, attached to the engine's taps (``log_every``:
    engine forwards between the log points kept for the user's sinks, 0: none; ``label``: a request's
    internal id -> the columns naming it, ``ids``)."""
    from ..checkpoint import drop_resident
    from ..requests import EngineRecord

    layers = getattr(runner, "_eigenhooks_layers", None)
    if layers is None:
        raise RuntimeError(
            "this vLLM engine was not built with eigenhooks' taps; build it with additional_config={'eigenhooks': {}}"
        )
    mon = make_monitor(runner.vllm_config, settings)
    base = mon.adapter
    adapter = CheckpointAdapter(**{f.name: getattr(base, f.name) for f in dataclasses.fields(Adapter)})
    record, att = mon.record_spec().attach(adapter)
    drop_resident(base)  # the plan is built: the checkpoint's pages are not needed (they stay readable)
    return Session(EngineRecord(record, log_every=log_every, n_layers=layers, label=label), layers, att, sink)


__all__ = [
    "CheckpointAdapter",
    "Session",
    "TapAttachment",
    "checkpoint_adapter",
    "engine_dtype",
    "make_monitor",
    "make_session",
    "settings_from_wire",
    "verdict_from_wire",
    "verdict_to_wire",
]
