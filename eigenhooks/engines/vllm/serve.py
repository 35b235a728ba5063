"""The served sink: one JSON line per finished request, written by the worker that counts.

An engine served with ``--additional-config '{"eigenhooks": {"out": "DIR"}}'`` measures from its start (no
with-block: ``"settings"`` beside ``"out"`` are ``eh.monitor``'s settings). When the scheduler finishes a
request, the worker appends one line to ``DIR/eigenhooks-<host>-<pid>.jsonl`` (one file per writing
process, so processes never share a file):

    {"request_id": ..., "sample": ..., "cached_prefix": ..., "recomputed": ...,
     "layers": [{"layer", "target", "n_tokens", "gamma_pre", "gamma_mid", "gamma_post", "rho"}, ...]}

``request_id`` is the id the API returned (a completion's ``cmpl-...``; a prompt of a batched completion
gets ``prompt_index``; ``sample`` is the choice's index, 0 unless ``n > 1``). Each line is one
``os.write`` to a file opened for appending, after which the request's sums are dropped (memory stays
bounded however long the server runs); a reader keeps the lines that end in a newline, so a killed
server leaves whole lines only.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
from pathlib import Path

_COMPLETION = re.compile(r"^(cmpl-.+)-(\d+)$")  # the completions API's engine id: f"{response id}-{prompt index}"
_SAMPLE = re.compile(r"^(\d+)_(.+)$")  # a sample of n > 1: vLLM's child id f"{index}_{parent id}"


def split_sample(key: str) -> tuple[str, int]:
    """(the request's id, the sample's index) of an engine request key: vLLM runs each sample of ``n > 1`` as
    its own request ``f"{index}_{request id}"`` (``CompletionOutput.index``); any other key is sample 0.

    A request id of your own of the form ``<digits>_<rest>`` reads as a sample of ``<rest>`` too: vLLM's own
    ids (offline counters, the API's ``cmpl-``/``chatcmpl-``) never have that form."""
    m = _SAMPLE.match(key)
    return (m.group(2), int(m.group(1))) if m else (key, 0)


def api_id(key: str) -> dict:
    """The id the OpenAI-compatible API returned for an engine request key, the prompt's index (a batched
    completion) and the sample's (``n > 1``: the choice's ``index``)."""
    rid, sample = split_sample(key)
    out = {"request_id": rid, "sample": sample}
    m = _COMPLETION.match(rid)
    if m:
        out.update(request_id=m.group(1), prompt_index=int(m.group(2)))
    return out


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
                **api_id(key),
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


__all__ = ["JsonlSink", "api_id", "read_lines", "split_sample"]
