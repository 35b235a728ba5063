"""Serving engines: the one registration ``eh.monitor``, ``eh.Monitor``, ``eh.spectra`` and ``eh.verify`` consult.

A serving engine (a ``vllm.LLM``) runs the model itself, in processes of its own, so none of those calls
can treat it as a model: each asks ``engine_of(obj)`` first. An ``Engine`` says how to recognise one
(without importing it), the adapter over the checkpoint it loaded (what ``spectra`` reads), the monitor
that drives it, and the one-line error ``verify`` raises (the identical-token probe cannot run inside it).

The engines are registered by the wing that holds their glue (``eigenhooks.engines``, above the monitor),
one ``register`` line each; this module names none of them. It finds that wing by name on the first
question, as plugins are found (the wing sits above every caller, so no import statement may point to
it); an engine of your own is one more ``register`` call.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from dataclasses import dataclass

WING = "eigenhooks.engines"  # registers the engines eigenhooks ships, when imported


@dataclass(frozen=True)
class Engine:
    """One serving engine, as the public calls need it.

    Attributes:
        name: a short name (messages; registering a name again replaces it).
        recognises: obj -> whether it is this engine (must not import the engine).
        monitor: ``(engine, *settings, **settings) -> monitor``: what ``eh.monitor`` and ``eh.Monitor`` return.
        adapter: engine -> the ``Adapter`` over the checkpoint it loaded (``eh.spectra``).
        verify_error: engine -> the exception ``eh.verify`` raises (one line naming the check that can run).
    """

    name: str
    recognises: Callable[[object], bool]
    monitor: Callable[..., object]
    adapter: Callable[[object], object]
    verify_error: Callable[[object], Exception]


class EngineVerifyError(TypeError):
    """``verify`` on an engine: the probe cannot run there; the message names the check that can."""


_ENGINES: list[Engine] = []
_loaded = False
_lock = threading.Lock()


def register(engine: Engine) -> None:
    """Make the public calls treat what ``engine.recognises`` as that engine (idempotent by name)."""
    with _lock:
        _ENGINES[:] = [e for e in _ENGINES if e.name != engine.name] + [engine]


def unregister(name: str) -> None:
    with _lock:
        _ENGINES[:] = [e for e in _ENGINES if e.name != name]


def engine_of(obj) -> Engine | None:
    """The registered engine ``obj`` is, or None (a model, an adapter, anything else)."""
    global _loaded
    if not _loaded:
        _loaded = True
        importlib.import_module(WING)  # its __init__ registers the engines it holds
    for e in list(_ENGINES):
        if e.recognises(obj):
            return e
    return None


def engines() -> list[str]:
    engine_of(None)
    return [e.name for e in _ENGINES]


__all__ = ["WING", "Engine", "EngineVerifyError", "engine_of", "engines", "register", "unregister"]
