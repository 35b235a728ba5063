"""The served sink: one JSON line per finished request, written by the worker that counts.

An engine served with ``--additional-config '{"eigenhooks": {"out": "DIR"}}'`` measures from its start (no
with-block: ``"settings"`` beside ``"out"`` are ``eh.monitor``'s settings). When the scheduler finishes a
request, the worker appends one line to ``DIR/eigenhooks-<host>-<pid>.jsonl`` (one file per writing
process, so processes never share a file):

    {"request_id": ..., "sample": ..., "engine_id": ..., "cached_prefix": ..., "recomputed": ...,
     "layers": [{"layer", "target", "n_tokens", "gamma_pre", "gamma_mid", "gamma_post", "rho"}, ...]}

``request_id`` is the id the API returned (a completion's ``cmpl-...``; a prompt of a batched completion
gets ``prompt_index``; ``sample`` is the choice's index, 0 unless ``n > 1``; ``engine_id`` the engine's own
id of the request, which tells apart requests that shared an id: ``ids``). Each line is one
``os.write`` to a file opened for appending, after which the request's sums are dropped (memory stays
bounded however long the server runs); a reader keeps the lines that end in a newline, so a killed
server leaves whole lines only.
"""

from __future__ import annotations

import json
import math
import os
import socket
from pathlib import Path


def _num(x: float):
    return None if isinstance(x, float) and math.isnan(x) else x


class JsonlSink:
    """Appends one line per ended request to this process's file in ``folder``."""

    def __init__(self, folder):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = self.folder / f"eigenhooks-{socket.gethostname()}-{os.getpid()}.jsonl"
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.written = 0

    def write_ended(self, engine) -> None:
        """Write every request ``engine`` (an ``EngineRecord``) ended since the last call; it then forgets them."""
        for key, info, rs in engine.take_ended():
            line = {
                **engine.own.label(key),
                "cached_prefix": info.first if info else 0,
                "recomputed": info.recomputed if info else 0,
                "layers": [
                    {
                        "layer": r["layer"],
                        "target": r["target"],
                        "n_tokens": r["n_tokens"],
                        **{c: _num(r[c]) for c in ("gamma_pre", "gamma_mid", "gamma_post", "rho")},
                    }
                    for r in rs
                ],  # fmt: skip
            }
            data = (json.dumps(line, separators=(",", ":")) + "\n").encode()
            os.write(self.fd, data)  # one write per line, appended
            self.written += 1

    def close(self) -> None:
        os.close(self.fd)


def read_lines(folder) -> list[dict]:
    """Every whole line of every ``*.jsonl`` in ``folder`` (a line cut by a kill is left out)."""
    out = []
    for p in sorted(Path(folder).glob("*.jsonl")):
        text = p.read_text()
        for line in text.split("\n")[:-1]:  # the part after the last newline is not a whole line
            out.append(json.loads(line))
    return out


__all__ = ["JsonlSink", "read_lines"]
