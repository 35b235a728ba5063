"""A monitor's plan for a vLLM engine, made from the checkpoint the engine loaded.

The engine's own weights cannot be read as they stand (the CPU backend repacks them; tensor parallel
shards them), so the plan (spectra, bases, nulls) comes from the same checkpoint loaded in transformers,
in the engine's dtype, through the HF adapter: the very plan the HF monitor makes of that checkpoint,
so the two tables mean the same (their fingerprints are compared when the state is read back).
"""

from __future__ import annotations

import dataclasses
import functools
import threading

import torch

from ...models import Adapter
from ...models.attach import Attachment
from .capture import STORE


@functools.lru_cache(maxsize=2)
def checkpoint_model(path: str, dtype: str):
    """The engine's checkpoint in transformers (weights only matter: spectra and the fingerprint)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    return model.eval()


def settings_from_wire(settings: dict) -> dict:
    """``eh.monitor``'s settings as they came through msgpack (tuples arrive as lists)."""
    out = dict(settings)
    if "targets" in out and out["targets"] is not None:
        out["targets"] = [tuple(t) if isinstance(t, list) else t for t in out["targets"]]
    if "reading_points" in out and isinstance(out["reading_points"], list):
        out["reading_points"] = tuple(out["reading_points"])
    return out


def engine_dtype(vllm_config) -> str:
    return str(vllm_config.model_config.dtype).removeprefix("torch.")


def make_monitor(vllm_config, settings: dict, sink=None):
    """An unattached ``eh.Monitor`` over the engine's checkpoint, with ``settings`` (and ``sink``)."""
    from ...monitor import Monitor

    model = checkpoint_model(vllm_config.model_config.model, engine_dtype(vllm_config))
    return Monitor(model, attach=False, sink=sink, **settings_from_wire(settings))


class Session:
    """One entered monitor in this worker: the record its forwards are told to, and the served sink, if any."""

    def __init__(self, engine, n_layers: int, att, sink=None):
        self.engine, self.n_layers, self.att, self.sink = engine, n_layers, att, sink
        self.lock = threading.Lock()
        self.dropped = 0  # forwards whose readings were not all written (counted nowhere)

    def close(self) -> None:
        self.att.detach()
        if self.sink is not None:
            self.sink.close()


class TapAttachment(Attachment):
    """The attachment of an engine whose taps sit in its compiled graph (``capture``): attaching turns the
    taps' copies on, detaching off. The engine's glue tells the record each forward (``EngineRecord``)."""

    def attach(self) -> None:
        STORE.active = True

    def detach(self) -> None:
        STORE.active = False


@dataclasses.dataclass
class CheckpointAdapter(Adapter):
    """The checkpoint's HF adapter (its layers give the plan), attached through the engine's taps."""

    def attachment(self, layers, points, record, warn, read_mask=True, layout=None):
        return TapAttachment()


def make_session(runner, settings: dict, sink=None, log_every: int = 0) -> Session:
    """The record of a monitor with ``settings`` in this worker, attached to the engine's taps (``log_every``:
    engine forwards between the log points kept for the user's sinks, 0: none)."""
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
    return Session(EngineRecord(record, log_every=log_every, n_layers=layers), layers, att, sink)


__all__ = [
    "CheckpointAdapter",
    "Session",
    "TapAttachment",
    "checkpoint_model",
    "engine_dtype",
    "make_monitor",
    "make_session",
    "settings_from_wire",
]
