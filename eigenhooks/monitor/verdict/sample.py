"""The verdict's tokens: a bounded sample of unit readings (baseline, mid), kept by a seeded hash of (sequence, position).

The verdict's null is drawn from the residual stream's own covariance, estimated on one half of the sequences and
scored on the other (``covariance.py``). Both halves need the readings themselves, so the monitor keeps a bounded
sample of them: among the null's tokens (a sequence's valid tokens whose index there is a multiple of
``null_stride``), the ``verdict_tokens`` with the smallest key, the key a seeded 53-bit hash of (sequence, position).
The set kept is the R smallest keys of everything seen, whatever the order the tokens came in, so forwards, batches,
padding sides, KV-cache steps and processes give the same sample, and two samples merge exactly: their union's R
smallest (``Sample.merge``).

A sequence is known by its content: its id is a hash of the bits of its first forward's valid readings at the first
measured layer's ``pre`` (the embeddings, for layer 0) and their positions (``content_ids``), so the same sequence
has the same id in any batch, on any rank, in any process; later forwards of it (a KV cache's steps, an engine's
decoding steps of a request) carry the id it was given. Two identical first forwards are one sequence; a
``generate``'s first forward is its prompt, so its sequences are known by their prompts.

Device side only (``candidates`` in the forward, ``Sample.add`` in the accumulator): fixed shapes, no host sync. The
keys are float64 in [0, 1); an empty slot's key is +inf.
"""

from __future__ import annotations

import base64

import torch

_C1 = 0xBF58476D1CE4E5B9 - (1 << 64)  # splitmix64's constants, as int64
_C2 = 0x94D049BB133111EB - (1 << 64)
_GOLD = 0x9E3779B97F4A7C15 - (1 << 64)


def _lsr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (multiplication wraps, as two's complement)."""
    x = x ^ _lsr(x, 30)
    x = x * _C1
    x = x ^ _lsr(x, 27)
    x = x * _C2
    return x ^ _lsr(x, 31)


def token_keys(seed: int, seq: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """float64 keys in [0, 1) of tokens (seq, pos) (broadcast, int64), for the sample ``seed``."""
    h = mix(mix(seq * _GOLD + seed) + pos)
    return _lsr(h, 11).to(torch.float64) * 2.0**-53


def content_ids(x: torch.Tensor, mask: torch.Tensor, vi: torch.Tensor) -> torch.Tensor:
    """(b,) int64: each row's id, a hash of the bits of its valid readings x (b, n, d) and their indices vi (b, n)
    in the sequence (a wrapping sum of per-entry hashes: no order, no sync)."""
    with torch.no_grad():
        d = x.shape[-1]
        x = x.reshape(*mask.shape, d)
        bits = x.float().contiguous().view(torch.int32).to(torch.int64)  # (b, n, d): the readings' exact bits
        where = vi.to(torch.int64)[..., None] * d + torch.arange(d, device=x.device)  # (b, n, d)
        h = mix(mix(bits + where * _GOLD)) * mask[..., None]
        return mix(h.sum((1, 2)) + 1)


def halves(seed: int, seq: torch.Tensor) -> torch.Tensor:
    """(n,) bool: True for the tokens of the estimation half. The distinct sequences are ordered by a seeded hash
    of the sequence alone and the first floor(S/2) of them estimate (balanced, and independent of the tokens'
    order, so a sample and its merge split alike)."""
    uniq, inv = torch.unique(seq, return_inverse=True)
    h = _lsr(mix(uniq * _C2 + torch.tensor(seed + 1, dtype=torch.int64) * _GOLD), 11)  # wraps, as int64 does
    est = torch.zeros(len(uniq), dtype=torch.bool)
    est[torch.argsort(h)[: len(uniq) // 2]] = True
    return est[inv]


class Candidates:
    """One forward's candidates: which slots of its null subsample, their keys, and each layer's readings there.

    Made once per grid (``pick``), then filled layer by layer (``take``): a pair of (c, d) float32 readings, the
    baseline (pre, or LN_t(pre) on a post-norm layer) and mid. c <= R: the forward's R smallest keys."""

    def __init__(self, flat: torch.Tensor, keys: torch.Tensor, seq: torch.Tensor, pos: torch.Tensor):
        self.flat, self.keys, self.seq, self.pos = flat, keys, seq, pos
        self.X: dict[int, torch.Tensor] = {}

    @staticmethod
    def pick(grid, stride: int, ordinals: torch.Tensor, seed: int, R: int) -> Candidates:
        """The forward's candidates among ``grid``'s null subsample: the (at most) R with the smallest keys.

        Args:
            grid: the forward's ``Grid`` (its valid tokens and their indices in their sequences).
            stride: the null subsample's stride. ordinals: (b,) int64, each row's sequence id.
            seed: the sample's seed. R: the sample's size.
        """
        b, n = grid.mask.shape
        flat, ok = grid.sub(stride)
        if flat is None:  # every token
            flat = torch.arange(b * n, device=grid.mask.device)
        vi = grid.vi.reshape(-1)[flat]  # (b*M,)
        M = flat.numel() // b
        seq = ordinals.to(vi.device).repeat_interleave(M)
        keys = token_keys(seed, seq, vi).masked_fill(~ok.reshape(-1), float("inf"))
        if keys.numel() > R:
            keys, at = torch.topk(keys, R, largest=False, sorted=False)
            flat, seq, vi = flat[at], seq[at], vi[at]
        return Candidates(flat, keys, seq, vi)

    def take(self, layer: int, base: torch.Tensor, mid: torch.Tensor) -> None:
        """Keep layer's readings (b, n, d) at the candidates: (c, d) float32 baseline and mid, as they are (made
        unit vectors only when read: ``Sample.host``)."""
        with torch.no_grad():
            d = base.shape[-1]
            self.X[layer] = (base.reshape(-1, d).index_select(0, self.flat).float(),
                             mid.reshape(-1, d).index_select(0, self.flat).float())  # fmt: skip


class ForwardCandidates:
    """One forward's verdict candidates: one ``Candidates`` a grid, picked at the grid's first layer (its readings
    give new sequences their ids: ``Sequences.ids``), then taken from each layer while its readings are hot."""

    def __init__(self, sequences):
        self.sequences = sequences
        self.by_grid: list[tuple] = []  # (grid, Candidates): looked up by identity (no id(): torch.compile)

    def of(self, grid, lp, pre: torch.Tensor) -> Candidates:
        for g, got in self.by_grid:
            if g is grid:
                return got
        ids = self.sequences.ids(pre, grid)
        got = Candidates.pick(grid, lp.bases.null_stride, ids, self.sequences.seed, self.sequences.R)
        self.by_grid.append((grid, got))
        return got

    def take(self, grid, lp, pre: torch.Tensor, base: torch.Tensor, mid: torch.Tensor) -> None:
        self.of(grid, lp, pre).take(lp.index, base, mid)

    def take_step(self, step, plan) -> None:
        """A one-token step kept as its readings came (``forward.Step``; pre-norm layers: the baseline is pre)."""
        grid = step.grids[0]
        for sl in step.order:
            if sl.mid is not None:
                pre = step.xs[sl.pre]
                mid = step.xs[sl.mid[0]] + step.xs[sl.mid[1]] if isinstance(sl.mid, tuple) else step.xs[sl.mid]
                self.take(grid, plan.layers[sl.layer], pre, pre, mid)

    def sets(self) -> list[Candidates] | None:
        return [c for _, c in self.by_grid] or None


FIELDS = ("keys", "seq", "pos", "X")
PENDING = 4  # forwards' candidates wait, as they came, until R / PENDING tokens a layer do; then they merge at once


class Group:
    """The kept tokens of layers of one width and device, stacked: keys, seq, pos (L, R + 1), X (L, R + 1, 2, d)
    float32 readings as they came (unit vectors only when read), so that a merge is a few ops a layer whatever the
    number of layers. Slot R is a sink that candidates which do not enter are written to (fixed shapes, no host
    sync); it is never read."""

    def __init__(self, layers: list[int], R: int, d: int, device):
        self.layers, self.row, self.R = list(layers), {i: r for r, i in enumerate(layers)}, R
        L = len(layers)
        self.t = {
            "keys": torch.full((L, R + 1), float("inf"), dtype=torch.float64, device=device),
            "seq": torch.zeros(L, R + 1, dtype=torch.int64, device=device),
            "pos": torch.zeros(L, R + 1, dtype=torch.int64, device=device),
            "X": torch.full((L, R + 1, 2, d), float("nan"), dtype=torch.float32, device=device),
        }

    def view(self, layer: int) -> dict[str, torch.Tensor]:
        return {k: v[self.row[layer], : self.R] for k, v in self.t.items()}


class Sample:
    """The kept tokens of every layer: per layer, keys (R,), seq (R,), pos (R,) and X (R, 2, d) float32 (views into
    ``Group``s that stack the layers of one width).

    ``add`` keeps one forward's candidates as they came (an append: what a forward pays) and merges the waiting
    ones into the buffers when R / PENDING tokens a layer wait (``flush``); what is read (``layers``, ``host``,
    ``to_dict``) is the union's R smallest, waiting candidates included, and reading changes nothing. ``merge``
    takes another sample's union; ``to_dict`` / ``from_dict`` carry it in a state dict (base64 of its bytes)."""

    def __init__(self, R: int):
        self.R = R
        self.groups: list[Group] = []
        self.of: dict[int, Group] = {}  # layer -> its group
        self.pending: list[dict[int, Candidates]] = []  # forwards' candidates not merged yet: layer -> Candidates

    @property
    def layers(self) -> dict[int, dict[str, torch.Tensor]]:
        return {i: self._layer(i) for i in sorted(self.of)}

    def ensure(self, layers: list[int], d: int, device) -> None:
        """Buffers for these layers (one group for those not held yet), empty."""
        new = [i for i in layers if i not in self.of]
        if new:
            with torch.inference_mode(False):  # normal tensors: a merge outside a forward run in inference mode
                g = Group(new, self.R, d, device)  # updates them in place
            self.groups.append(g)
            self.of.update({i: g for i in new})

    def add(self, cands: list[Candidates] | None, undoable: bool = True) -> dict | None:
        """Keep a forward's candidates (one set a grid) for every layer they read: appended as they are, the
        waiting ones merged first if these would take them past R / PENDING tokens. Returns what undoes it."""
        got = {i: c for c in cands or () for i in c.X}  # layer -> its candidates
        if not got:
            return None
        for i, c in got.items():
            if i not in self.of:
                d = c.X[i][0].shape[-1]
                self.ensure([j for j in got if got[j].X[j][0].shape[-1] == d], d, c.X[i][0].device)
        waiting = sum(_tokens(e) for e in self.pending)
        if self.pending and waiting + _tokens(got) > max(self.R // PENDING, 1):
            self.flush()
        self.pending.append(got)
        return got if undoable else None

    def undo(self, undo: dict | None) -> None:
        """Take back the ``add`` that returned ``undo`` (the last one: its candidates are still waiting)."""
        if undo is None:
            return
        at = next((k for k, e in enumerate(self.pending) if e is undo), None)
        if at is None:
            raise RuntimeError("eigenhooks: the verdict sample merged a forward it was asked to take back")
        del self.pending[at]

    def flush(self) -> None:
        """Merge the waiting candidates into every layer's buffers, in place: each layer keeps the union's R
        smallest keys.

        A layer's P waiting candidates, sorted up by key (the first min(P, R)), are paired with its largest kept
        keys, sorted down: candidate j takes its partner's slot when its key is smaller (the pairs that swap are
        a prefix, and what is kept is then exactly the R smallest of both); the others are written to the sink
        slot. Keys of every layer of a group in one op each, readings in one op a layer and forward."""
        for g in self.groups:
            if any(i in e for e in self.pending for i in g.layers):
                self._flush_group(g)
        self.pending = []

    def _flush_group(self, g: Group) -> None:
        R, L = self.R, len(g.layers)
        sizes = [max((e[i].keys.numel() for i in g.layers if i in e), default=0) for e in self.pending]
        keys, seq, pos = _waiting(g, self.pending, sizes)
        n = min(keys.shape[1], R)
        ck, order = torch.sort(keys, dim=1)
        top, slots = torch.topk(g.t["keys"][:, :R], n, dim=1, largest=True)  # the kept keys, sorted down
        dest = torch.full_like(order, R)  # each waiting candidate's slot, R (the sink) where it does not enter
        dest.scatter_(1, order[:, :n], torch.where(ck[:, :n] < top, slots, R))
        flat = (dest + torch.arange(L, device=dest.device)[:, None] * (R + 1)).reshape(-1)
        for k, v in (("keys", keys), ("seq", seq), ("pos", pos)):
            g.t[k].view(-1).index_copy_(0, flat, v.reshape(-1))
        for r, i in enumerate(g.layers):
            at = 0
            for e, m in zip(self.pending, sizes):
                if i in e:
                    base, mid = e[i].X[i]
                    to = dest[r, at : at + base.shape[0]]
                    g.t["X"][r, :, 0].index_copy_(0, to, base)
                    g.t["X"][r, :, 1].index_copy_(0, to, mid)
                at += m

    def _layer(self, layer: int) -> dict[str, torch.Tensor]:
        """Layer's R smallest of what is kept and what waits (views of the buffers when nothing waits)."""
        ours = self.of[layer].view(layer)
        waiting = [e[layer] for e in self.pending if layer in e]
        if not waiting:
            return ours
        both = {
            "keys": torch.cat([ours["keys"], *(c.keys for c in waiting)]),
            "seq": torch.cat([ours["seq"], *(c.seq for c in waiting)]),
            "pos": torch.cat([ours["pos"], *(c.pos for c in waiting)]),
            "X": torch.cat([ours["X"], *(torch.stack(c.X[layer], 1) for c in waiting)]),
        }
        at = torch.sort(both["keys"], stable=True).indices[: self.R]
        return {k: v[at] for k, v in both.items()}

    def merge(self, other: Sample) -> None:
        """Take another sample's tokens: every layer keeps the union's R smallest keys."""
        self.flush()
        for layer, theirs in other.layers.items():
            if layer not in self.of:
                self.ensure([layer], theirs["X"].shape[-1], theirs["X"].device)
            ours = self.of[layer].view(layer)
            both = {k: torch.cat([ours[k], theirs[k].to(ours[k].device)]) for k in FIELDS}
            at = torch.sort(both["keys"], stable=True).indices[: self.R]
            for k in FIELDS:
                ours[k].copy_(both[k][at])

    def host(self, layer: int) -> dict[str, torch.Tensor] | None:
        """Layer's kept tokens on the CPU in key order (which slot a token took depends on the order tokens came
        in; the key order does not), X as float32 unit vectors, empty slots and non-finite readings left out."""
        if layer not in self.of:
            return None
        cpu = {k: v.detach().cpu() for k, v in self._layer(layer).items()}
        cpu["X"] = cpu["X"] / cpu["X"].norm(dim=-1, keepdim=True)
        ok = torch.isfinite(cpu["keys"]) & torch.isfinite(cpu["X"]).all(-1).all(-1)
        order = torch.argsort(cpu["keys"][ok], stable=True)
        return {k: v[ok][order] for k, v in cpu.items()}

    def to_dict(self, raw: bool = False) -> dict:
        """JSON-able: per layer, each tensor as {dtype, shape, base64 of its bytes}. ``raw``: the bytes themselves,
        for a channel that carries bytes (an engine's rpc), where base64's text would be a third larger
        (``as_text`` makes it JSON-able)."""
        return {
            "R": self.R,
            "layers": {str(i): {k: _pack(v, raw) for k, v in buf.items()} for i, buf in self.layers.items()},
        }

    @staticmethod
    def from_dict(d: dict, R: int, device=None) -> Sample:
        """A sample from ``to_dict``; a ValueError names what is wrong."""
        if not isinstance(d, dict) or d.get("R") != R or not isinstance(d.get("layers"), dict):
            got = d.get("R") if isinstance(d, dict) else type(d).__name__
            raise ValueError(f"the state's verdict sample holds R={got!r} tokens, this monitor keeps {R}")
        s = Sample(R)
        for key, buf in d["layers"].items():
            t = {k: _unpack(v, device) for k, v in buf.items()}
            if set(t) != set(FIELDS) or t["keys"].shape != (R,):
                raise ValueError(f"the state's verdict sample is damaged at layer {key}")
            s.ensure([int(key)], t["X"].shape[-1], t["X"].device)
            for k, v in s.of[int(key)].view(int(key)).items():
                v.copy_(t[k])
        return s

    def all_gather(self, dist, group, device) -> None:
        """Every rank ends with the union's R smallest keys of every rank's sample (ranks' layers must agree)."""
        self.flush()
        for layer, buf in self.layers.items():
            parts = {}
            for k, v in buf.items():
                got = [torch.empty_like(v, device=device) for _ in range(dist.get_world_size(group))]
                dist.all_gather(got, v.contiguous().to(device), group=group)
                parts[k] = got
            for r in range(len(parts["keys"])):
                other = Sample(self.R)
                other.ensure([layer], buf["X"].shape[-1], buf["X"].device)
                for k, v in other.of[layer].view(layer).items():
                    v.copy_(parts[k][r])
                self.merge(other)


def _tokens(entry: dict) -> int:
    """A forward's waiting candidates: the most any layer has."""
    return max(c.keys.numel() for c in entry.values())


def _waiting(g: Group, pending: list[dict], sizes: list[int]):
    """The waiting candidates' keys, seq, pos (L, P) of a group's layers, forward after forward, each forward's
    block padded to its size with empty ones (key +inf: never taken); one row for all when every layer of the group
    read the same candidates."""
    dev, L = g.t["keys"].device, len(g.layers)
    if all(all(i in e for i in g.layers) and len({id(e[i]) for i in g.layers}) == 1 for e in pending):
        ones = [e[g.layers[0]] for e in pending]
        return tuple(torch.cat([getattr(c, k) for c in ones])[None].expand(L, -1) for k in ("keys", "seq", "pos"))
    P = sum(sizes)
    keys = torch.full((L, P), float("inf"), dtype=torch.float64, device=dev)
    seq = torch.zeros(L, P, dtype=torch.int64, device=dev)
    pos = torch.zeros(L, P, dtype=torch.int64, device=dev)
    for r, i in enumerate(g.layers):
        at = 0
        for e, m in zip(pending, sizes):
            c = e.get(i)
            if c is not None:
                n = c.keys.numel()
                keys[r, at : at + n], seq[r, at : at + n], pos[r, at : at + n] = c.keys, c.seq, c.pos
            at += m
    return keys, seq, pos


def as_text(d: dict) -> dict:
    """``Sample.to_dict(raw=True)``'s form made JSON-able (each tensor's bytes as base64), as ``to_dict()`` gives it,
    without building the tensors."""
    return {**d, "layers": {i: {k: {**v, "data": _text(v["data"])} for k, v in buf.items()}
                            for i, buf in d["layers"].items()}}  # fmt: skip


def _text(data) -> str:
    return data if isinstance(data, str) else base64.b64encode(data).decode("ascii")


def _pack(t: torch.Tensor, raw: bool = False) -> dict:
    t = t.detach().cpu().contiguous()
    data = t.numpy().tobytes()
    return {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape),
            "data": data if raw else base64.b64encode(data).decode("ascii")}  # fmt: skip


def _unpack(d: dict, device=None) -> torch.Tensor:
    """A tensor from ``_pack``'s dict, its data base64 text or the raw bytes."""
    import numpy as np

    try:
        dtype = {"float64": np.float64, "float32": np.float32, "int64": np.int64}[d["dtype"]]
        data = d["data"]
        data = data if isinstance(data, (bytes, bytearray, memoryview)) else base64.b64decode(data)
        a = np.frombuffer(data, dtype=dtype).reshape(d["shape"]).copy()
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"the state's verdict sample is damaged ({e})") from None
    return torch.from_numpy(a).to(device) if device is not None else torch.from_numpy(a)
