"""An engine's flat batches as sequences: each token's request and position, each (request, position) once.

A serving engine runs flat ``(tokens, hidden)`` batches, its requests concatenated (continuous batching,
chunked prefill); a request spans many forwards and ends when the engine's scheduler finishes it, not at
a forward's end. This module is the engine-neutral contract between an engine's glue and the monitor:

- ``TokenMap``: one forward's requests in batch order, with each one's token count and the position of
  its first token (its tokens are consecutive positions);
- ``Ledger``: which tokens count. A position already counted for a request (a preempted request recomputed
  from position 0) does not count again; a prefix served from the engine's prefix cache is never computed,
  so never counted (the request's first computed position says how long it was);
- ``EngineRecord``: the forwards told to the monitor's record as flat batches (``models.attach.FlatRows``:
  the request is the cluster, its counters open until the scheduler ends it), and each request's own
  counts and gamma/rho (``RequestRows``), read from the record's counters of that request
  (``Record.request_counters``).

It imports no engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..models.attach import CallFacts, FlatRows
from ..monitor.accumulate import BUFFER_TOKENS


class TokenMap(NamedTuple):
    """One forward's requests, in batch order: key, token count, position of the first token."""

    keys: list[str]
    counts: list[int]
    starts: list[int]

    @property
    def tokens(self) -> int:
        return sum(self.counts)


@dataclass
class RequestInfo:
    """What the ledger knows of one request."""

    first: int = -1  # its first computed position (> 0: a prefix served from the prefix cache)
    upto: int = 0  # positions below this are counted
    counted: int = 0
    recomputed: int = 0  # tokens computed again after a preemption, not counted twice


class Ledger:
    """Which tokens of each forward count: each (request, position) once."""

    def __init__(self):
        self.info: dict[str, RequestInfo] = {}

    def admit(self, tm: TokenMap) -> list[int]:
        """Per request of the forward, how many of its leading tokens were counted before (skip them)."""
        skips = []
        for key, c, s in zip(tm.keys, tm.counts, tm.starts):
            r = self.info.get(key)
            if r is None:
                r = self.info[key] = RequestInfo(first=s, upto=s)
            skip = min(max(r.upto - s, 0), c)
            skips.append(skip)
            r.recomputed += skip
            r.counted += c - skip
            r.upto = max(r.upto, s + c)
        return skips

    def end(self, key: str) -> RequestInfo | None:
        return self.info.pop(key, None)


def flat_rows(tm: TokenMap, skips: list[int], device) -> tuple[FlatRows, torch.Tensor | None]:
    """The record's ``FlatRows`` of one forward's counted tokens, and which flat rows they are (None: all).

    Row r is request ``tm.keys[r]``; each counted token's position is its request's (a chunk continues its
    request's positions); a request's leading ``skip`` tokens (counted before) are left out.
    """
    counts = torch.tensor(tm.counts, device=device)
    R = len(tm.counts)
    row = torch.repeat_interleave(torch.arange(R, device=device), counts)  # (tokens,)
    offset = torch.cumsum(counts, 0) - counts
    rank = torch.arange(tm.tokens, device=device) - offset[row]  # each token's index in its chunk
    position = torch.tensor(tm.starts, device=device)[row] + rank
    keep = None
    if any(skips):
        keep = (rank >= torch.tensor(skips, device=device)[row]).nonzero().squeeze(1)
        row, position = row[keep], position[keep]
    width = max(c - k for c, k in zip(tm.counts, skips))
    full = keep is None and all(c == width for c in tm.counts)  # each request's chunk whole, all one length
    return FlatRows(tuple(tm.keys), row, position, width, layout="rows" if full else ""), keep


class RequestRows:
    """Each request's own counts and gamma/rho per (layer, target): ``requests()``'s rows.

    They are the record's own per-request counters (``Record.request_counters``: the tokens
    it counted, those up, and their sums of a(pre), a(mid), a(post), ``measures.ROW``), read when a request
    ends or when the rows are asked for; nothing is measured twice. A request's rows sum to the table's.

    A request is known by its key, the engine's own id of it (unique among the requests the engine runs at
    once, however the user chose the ids); ``label(key)`` gives the columns that name it to the user
    (default ``{"request_id": key}``), ahead of the measured ones.
    """

    def __init__(self, plan, label=None):
        self.plan, self.layers = plan, sorted(plan.layers)
        self.label = label or (lambda key: {"request_id": key})
        self.done: list[tuple[str, RequestInfo | None, torch.Tensor]] = []  # ended: key, ledger, counters

    def end(self, key: str, info: RequestInfo | None, counters: torch.Tensor | None) -> None:
        if counters is not None:
            self.done.append((key, info, counters))

    def rows(self, ledger: Ledger, open_counters: dict[str, torch.Tensor]) -> list[dict]:
        """One dict per (request, layer, target), ended requests first."""
        out = []
        for key, info, own in self.done:
            out += self.request(key, info, own, True)
        for key, own in open_counters.items():
            out += self.request(key, ledger.info.get(key), own, False)
        return out

    def take_done(self) -> list[tuple[str, RequestInfo | None, list[dict]]]:
        """The requests ended since the last call, each with its rows; then forgotten (a served engine's
        memory stays bounded)."""
        done, self.done = self.done, []
        return [(key, info, self.request(key, info, own, True)) for key, info, own in done]

    def request(self, key: str, info: RequestInfo | None, own: torch.Tensor, ended: bool) -> list[dict]:
        """One request's rows, from its counters (layers, ``measures.ROW``, T)."""
        from ..monitor.measures import ROW

        at = [ROW.index(f) for f in ("n", "s_pre", "s_mid", "s_post", "u")]
        sums = own[:, at].tolist()  # (layers, 5, T) as lists: one copy out, not one per entry
        out, nan = [], float("nan")
        names = self.label(key)
        for li, i in enumerate(self.layers):
            for ti, meta in enumerate(self.plan.layers[i].meta):
                n, s_pre, s_mid, s_post, up = (v[ti] for v in sums[li])
                out.append({
                    **names, "layer": i, "target": meta.name, "n_tokens": int(n),
                    "gamma_pre": s_pre / n if n else nan, "gamma_mid": s_mid / n if n else nan,
                    "gamma_post": s_post / n if n else nan, "rho": up / n if n else nan,
                    "cached_prefix": max(info.first, 0) if info else 0,
                    "recomputed": info.recomputed if info else 0, "finished": ended,
                })  # fmt: skip
        return out


STEP_TOKENS = BUFFER_TOKENS  # decoding steps staged until they hold this many tokens, as the HF monitor's


class Steps:
    """Decoding forwards staged: one token for each of the same requests, in the same order, copied out
    of the engine's buffers (which the next forward overwrites) into one (steps, requests, d) tensor a
    reading, so the record measures them together, a request's steps its tokens (``FlatRows.steps``):
    its matmuls then stream the bases once for up to ``STEP_TOKENS`` tokens, not once a step. A reading
    that is two points (layer t's post is layer t+1's pre) is staged once."""

    def __init__(self):
        self.keys: tuple = ()
        self.starts: list[int] = []
        self.n = self.room = 0
        self.bufs: list[torch.Tensor] = []  # one staging tensor per distinct reading
        self.where: dict[str, list[int]] = {}  # point -> per layer, its staging tensor
        self.written: list = []  # each step's device flag (``EngineRecord.forward``), if any was given

    def fits(self, tm: TokenMap) -> bool:
        return self.n == 0 or (tuple(tm.keys) == self.keys and self.n < self.room)

    def add(self, readings: dict[str, list[torch.Tensor]], tm: TokenMap, written=None) -> None:
        if self.n == 0:
            self._lay_out(readings, len(tm.keys))
            self.keys, self.starts, self.written = tuple(tm.keys), list(tm.starts), []
        if written is not None:
            self.written += [torch.ones((), dtype=torch.bool, device=written.device)] * (self.n - len(self.written))
            self.written.append(written)
        done = set()
        for p, xs in readings.items():
            for j, x in zip(self.where[p], xs):
                if j not in done:
                    done.add(j)
                    self.bufs[j][self.n].copy_(x)
        self.n += 1

    def _lay_out(self, readings: dict[str, list[torch.Tensor]], R: int) -> None:
        """Which staging tensor each reading goes to; the tensors are kept while their shape holds."""
        self.room = max(STEP_TOKENS // R, 1)
        x = readings["pre"][0]
        shape, ids, self.where = (self.room, R, x.shape[-1]), {}, {}
        for p, xs in readings.items():
            self.where[p] = [ids.setdefault(id(t), len(ids)) for t in xs]
        old = self.bufs
        if len(old) != len(ids) or old[0].shape != shape or old[0].dtype != x.dtype or old[0].device != x.device:
            self.bufs = [x.new_empty(shape) for _ in ids]

    def take(self) -> tuple[dict[str, list[torch.Tensor]], FlatRows]:
        """The staged steps as one flat batch (step-major: step s of request r is token s * R + r), and empty."""
        S, R = self.n, len(self.keys)
        device = self.bufs[0].device
        row = torch.arange(R, device=device).repeat(S)
        step = torch.arange(S, device=device).repeat_interleave(R)
        position = torch.tensor(self.starts, device=device).repeat(S) + step
        views = [b[:S].view(S * R, -1) for b in self.bufs]  # one object a reading: shared points stay shared
        readings = {p: [views[j] for j in js] for p, js in self.where.items()}
        valid = None
        if self.written:  # each step's flag for its R tokens (step-major), padded for the steps that had none
            flags = self.written + [torch.ones_like(self.written[0])] * (S - len(self.written))
            valid = torch.stack(flags).repeat_interleave(R)
        self.n, self.written = 0, []
        return readings, FlatRows(self.keys, row, position, S, S, layout="steps", valid=valid)


class EngineRecord:
    """An engine's forwards told to the monitor's record (``monitor.record.Record``) as flat batches.

    Decoding forwards (one token a request, the same requests) are staged (``Steps``) and told together;
    everything that reads or ends requests tells the staged ones first.

    Args:
        record: the record (``RecordSpec.attach`` made it, in the engine's worker).
        requests: keep each request's own rows (``RequestRows``).
        log_every: engine forwards between log points (0: none). At each, the running values the sinks
            get (``monitor.logs.Labels``) are kept with the step, the engine forwards so far, until
            ``take_log_points``: the user's process hands them to its sinks. A log point tells the staged
            steps first, so a small ``log_every`` costs what staging saves.
        n_layers: the model's layers (the sinks' tags are as wide as its last layer's number).
        label: a request's key (the engine's own id of it, unique) -> the columns naming it to the user
            (``RequestRows``).
    """

    def __init__(self, record, requests: bool = True, log_every: int = 0, n_layers: int | None = None, label=None):
        self.record = record
        self.ledger = Ledger()
        self.own = RequestRows(record.plan, label) if requests else None
        self.layers = sorted(record.plan.layers)
        self.n_forwards = 0
        self.steps = Steps()
        self.log_every = log_every
        self.log_points: list[tuple[int, dict[str, float]]] = []
        self.n_layers = n_layers or max(self.layers) + 1

    def forward(self, readings: dict[str, list[torch.Tensor]], tm: TokenMap, written=None) -> None:
        """One forward: ``readings`` {'pre', 'attn', 'post': [per layer (tokens, d)]} of the tokens ``tm``
        describes; mid is pre + attn (the add the MLP's norm fuses). ``written``: a device bool, whether the
        readings were written by this forward (``FlatRows.valid``: if not, none of its tokens count), or None."""
        skips = self.ledger.admit(tm)
        if sum(skips) == tm.tokens:  # every token counted before (a preempted request's recomputation)
            return
        self.n_forwards += 1
        if not any(skips) and all(c == 1 for c in tm.counts):  # a decoding step: staged
            if not self.steps.fits(tm):
                self.flush()
            self.steps.add(readings, tm, written)
            if self.steps.n == self.steps.room:
                self.flush()
        else:
            self.flush()
            flat, keep = flat_rows(tm, skips, readings["pre"][0].device)
            if written is not None:
                flat = flat._replace(valid=written)
            self._tell(readings, flat, keep)
        if self.log_every and self.n_forwards % self.log_every == 0:
            self.flush()
            self.log_points.append((self.n_forwards, self.record.log_values(self.n_layers)))

    def flush(self) -> None:
        """Tell the record the staged decoding steps, if any."""
        if self.steps.n:
            self._tell(*self.steps.take(), None)

    def take_log_points(self) -> list[tuple[int, dict[str, float]]]:
        """The log points kept since the last call, oldest first."""
        out, self.log_points = self.log_points, []
        return out

    def _tell(self, readings: dict[str, list[torch.Tensor]], flat: FlatRows, keep) -> None:
        rec = self.record
        rec.forward_start(CallFacts(flat=flat))
        ok = False
        try:
            for i in self.layers:
                P, A, Q = (readings[p][i] for p in ("pre", "attn", "post"))
                if keep is not None:
                    P, A, Q = P[keep], A[keep], Q[keep]
                M = P + A
                rec.read(i, "pre", P)
                rec.read(i, "attn", A)
                rec.read(i, "mid", M)
                rec.read(i, "post", Q)
            ok = True
        finally:
            rec.forward_end(ok)

    def end(self, keys) -> None:
        """The engine's scheduler finished these requests."""
        self.flush()
        keys = list(keys)
        own = self.record.request_counters(keys) if self.own is not None else {}
        self.record.requests_end(keys)
        for k in keys:
            info = self.ledger.end(k)
            if self.own is not None:
                self.own.end(k, info, own.get(k))

    def state_dict(self, sample: bool = True) -> dict:
        """The record's state (``Record.state_dict``), the staged steps told first."""
        self.flush()
        return self.record.state_dict(sample)

    def verdict(self, blocks: dict[int, int] | None = None) -> dict[int, list[dict]]:
        """The verdict's columns of the state now (``Accumulator.verdict``), the staged steps told first."""
        self.flush()
        return self.record.verdict(blocks)

    def kept_verdict(self):
        """What the verdict's columns are computed from, kept once the session stops (``Record.kept_verdict``)."""
        self.flush()
        return self.record.kept_verdict()

    def sample(self) -> dict | None:
        """The verdict's kept tokens as raw bytes (``Sample.to_dict(raw=True)``), or None where none are kept."""
        self.flush()
        return self.record.sample_dict(raw=True)

    def take_ended(self) -> list[tuple[str, RequestInfo | None, list[dict]]]:
        """The requests ended since the last call, each with its rows (``RequestRows.take_done``)."""
        return self.own.take_done() if self.own is not None else []

    def rows(self) -> list[dict]:
        self.flush()
        return self.own.rows(self.ledger, self.record.request_counters()) if self.own is not None else []


__all__ = ["STEP_TOKENS", "EngineRecord", "Ledger", "RequestInfo", "RequestRows", "Steps", "TokenMap", "flat_rows"]
