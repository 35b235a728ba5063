"""An engine's flat batches as sequences: each token's request and position, each (request, position) once.

A serving engine runs flat ``(tokens, hidden)`` batches, its requests concatenated (continuous batching,
chunked prefill); a request spans many forwards and ends when the engine's scheduler finishes it, not at
a forward's end. This module is the engine-neutral contract between an engine's glue and the monitor:

- ``TokenMap``: one forward's requests in batch order, with each one's token count and the position of
  its first token (its tokens are consecutive positions);
- ``Ledger``: which tokens count. A position already counted for a request (a preempted request recomputed
  from position 0) does not count again; a prefix served from the engine's prefix cache is never computed,
  so never counted (the request's first computed position says how long it was);
- ``RequestSums``: the monitor's sums over requests (the request is the cluster), and each request's own
  counts and gamma/rho (``rows``), fed one forward at a time and told when requests end.

It imports no engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..monitor.forward import Call, Forward, LayerSums
from ..monitor.measures.target import close_rows


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


def padded(tm: TokenMap, skips: list[int], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """How a forward's flat tokens lay out as (requests, longest) rows: each cell's flat row, the valid mask,
    and each row's first valid position.

    A row's tokens sit at its left; its first ``skip`` tokens (counted before) and its padding are not
    valid (padding cells repeat a real row, masked out). ``first`` is the position of the row's first
    valid token, so a valid token's index in its sequence (``seen + cumsum(mask) - 1``,
    ``forward.Forward``) is its position.
    """
    n = max(tm.counts)
    counts = torch.tensor(tm.counts, device=device)
    col = torch.arange(n, device=device)
    offset = torch.cumsum(counts, 0) - counts  # (R,) each request's first row in the flat batch
    skip = torch.tensor(skips, device=device)
    mask = (col[None, :] < counts[:, None]) & (col[None, :] >= skip[:, None])  # (R, n)
    src = (offset[:, None] + col[None, :]).clamp(max=tm.tokens - 1)  # (R, n)
    first = (torch.tensor(tm.starts, device=device) + skip)[:, None]  # (R, 1)
    return src, mask, first


class RequestSums:
    """The monitor's running sums over an engine's requests.

    Args:
        monitor: an ``eh.Monitor`` created with ``attach=False`` over a model with the engine's weights
            (its plan, its accumulator's state and its summary are used; nothing is hooked).
    """

    def __init__(self, monitor):
        self.mon = monitor
        self.acc = monitor._prepare()
        self.plan = monitor._plan
        self.layers = sorted(self.plan.layers)
        self.ledger = Ledger()
        self.open: dict[str, torch.Tensor] = {}  # request -> its counters (L, 5, T), open until it ends
        self.own: dict[str, torch.Tensor] = {}  # request -> its own (L, T, 5): n, pre, mid, post, up
        self.done: list[tuple[str, RequestInfo, torch.Tensor]] = []  # ended requests and their own sums
        self.n_forwards = 0
        self._U = None

    def add(self, readings: dict[str, list[torch.Tensor]], tm: TokenMap) -> None:
        """Count one forward: ``readings`` {'pre', 'attn', 'post': [per layer (tokens, d)]} of the tokens
        ``tm`` describes (the first ``tm.tokens`` rows)."""
        skips = self.ledger.admit(tm)
        if sum(skips) == tm.tokens:
            return
        keys = tm.keys
        src, mask, first = padded(tm, skips, readings["pre"][0].device)
        stack = self.plan.layers[self.layers[0]].stack
        fwd = Forward(self.plan, self.mon.points, mask, {stack: first}, False, False, self.n_forwards, [],
                      Call(fresh=False))  # fmt: skip
        per_layer = []
        for i in self.layers:
            P, A, Q = (readings[p][i][src] for p in ("pre", "attn", "post"))  # (R, n, d) each
            M = P + A  # mid: the add post_attention_layernorm fuses (models/vllm.py)
            fwd.read(i, "pre", P)
            fwd.read(i, "attn", A)
            fwd.read(i, "mid", M)
            fwd.read(i, "post", Q)
            per_layer.append(self._own(i, P, M, Q, mask))
        fs = fwd.finish()
        self.acc._add_layers([(i, LayerSums(ls.sums, None)) for i, ls in fs.layers.items()])
        rows = torch.stack([fs.layers[i].rows for i in self.layers], 1)  # (R, L, 5, T)
        own = torch.stack(per_layer, 1)  # (R, L, T, 5)
        for j, key in enumerate(keys):
            if key in self.open:
                self.open[key] = self.open[key] + rows[j]
                self.own[key] = self.own[key] + own[j]
            else:
                self.open[key], self.own[key] = rows[j], own[j]
        self.acc.n_forwards += 1
        self.n_forwards += 1

    def _own(self, i: int, P, M, Q, mask) -> torch.Tensor:
        """Per row (request) and target: valid tokens, sums of a(pre), a(mid), a(post), tokens with a(mid) > a(pre)."""
        lp = self.plan.layers[i]
        cols = []
        for t in lp.targets:
            U = t.U.to(P.device, torch.float32)  # (d, k)
            a = [(x.float() @ U).norm(dim=-1) / x.float().norm(dim=-1) for x in (P, M, Q)]  # (R, n) each
            m = mask.float()
            cols.append(torch.stack([m.sum(1), (a[0] * m).sum(1), (a[1] * m).sum(1), (a[2] * m).sum(1),
                                     ((a[1] > a[0]).float() * m).sum(1)], -1))  # fmt: skip
        return torch.stack(cols, 1).double()  # (R, T, 5)

    def end(self, keys) -> None:
        """These requests ended (the scheduler finished them): their counters close into the cluster sums."""
        ended = [k for k in keys if k in self.open]
        for k in keys:
            info = self.ledger.end(k)
            if k in self.open:
                self.done.append((k, info, self.own.pop(k)))
        if not ended:
            return
        rows = torch.stack([self.open.pop(k) for k in ended], 1)  # (L, b, 5, T)
        for li, i in enumerate(self.layers):
            st = self.acc.state[i]
            self.acc.state[i] = {**st, "tgt": close_rows(st["tgt"].to(rows.device), rows[li])}

    def current(self, layer: int) -> dict[str, torch.Tensor]:
        """The layer's state with the open requests folded in (float64, CPU), as ``Accumulator.current``."""
        st = dict(self.acc.state[layer])
        if self.open:
            li = self.layers.index(layer)
            rows = torch.stack([r[li] for r in self.open.values()])
            st["tgt"] = close_rows(st["tgt"].to(rows.device), rows)
        return {k: v.detach().to("cpu", torch.float64) for k, v in st.items()}

    def state_dict(self) -> dict:
        """As ``Monitor.state_dict``: the fingerprint and every layer's sums, open requests folded in."""
        layers = {str(i): {k: v.tolist() for k, v in self.current(i).items()} for i in self.layers}
        return {"fingerprint": self.mon._layout(), "layers": layers}

    def rows(self) -> list[dict]:
        """One dict per (request, layer, target): the request's counts and gamma/rho, ended ones first."""
        out = []
        items = [(k, info, own, True) for k, info, own in self.done]
        items += [(k, self.ledger.info.get(k), own, False) for k, own in self.own.items()]
        for key, info, own, ended in items:
            for li, i in enumerate(self.layers):
                for ti, meta in enumerate(self.plan.layers[i].meta):
                    n, s_pre, s_mid, s_post, up = own[li, ti].tolist()
                    nan = float("nan")
                    out.append({
                        "request_id": key, "layer": i, "target": meta.name, "n_tokens": int(n),
                        "gamma_pre": s_pre / n if n else nan, "gamma_mid": s_mid / n if n else nan,
                        "gamma_post": s_post / n if n else nan, "rho": up / n if n else nan,
                        "cached_prefix": max(info.first, 0) if info else 0,
                        "recomputed": info.recomputed if info else 0, "finished": ended,
                    })  # fmt: skip
        return out


__all__ = ["Ledger", "RequestInfo", "RequestSums", "TokenMap", "padded"]
