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

    Made once per grid (``pick``), then filled layer by layer (``take``): (c, 2, d) float32 unit vectors of the
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
        """Keep layer's readings (b, n, d) at the candidates, (c, 2, d) as they are (made float32 unit vectors once
        for every layer, when the sample takes them: ``Sample.add``)."""
        with torch.no_grad():
            d = base.shape[-1]
            self.X[layer] = torch.stack([base.reshape(-1, d)[self.flat], mid.reshape(-1, d)[self.flat]], 1)


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


class Group:
    """The kept tokens of layers of one width and device, stacked: keys, seq, pos (L, R), X (L, R, 2, d) float32,
    so that a forward's merge is a dozen ops whatever the number of layers."""

    def __init__(self, layers: list[int], R: int, d: int, device):
        self.layers, self.row = list(layers), {i: r for r, i in enumerate(layers)}
        L = len(layers)
        self.t = {
            "keys": torch.full((L, R), float("inf"), dtype=torch.float64, device=device),
            "seq": torch.zeros(L, R, dtype=torch.int64, device=device),
            "pos": torch.zeros(L, R, dtype=torch.int64, device=device),
            "X": torch.full((L, R, 2, d), float("nan"), dtype=torch.float32, device=device),
        }

    def view(self, layer: int) -> dict[str, torch.Tensor]:
        return {k: v[self.row[layer]] for k, v in self.t.items()}


class Sample:
    """The kept tokens of every layer: per layer, keys (R,), seq (R,), pos (R,) and X (R, 2, d) float32 (views into
    ``Group``s that stack the layers of one width).

    ``add`` merges one forward's candidates in place and returns what undoes it; ``merge`` takes another sample's
    union; ``to_dict`` / ``from_dict`` carry it in a state dict (base64 of its bytes: JSON-able)."""

    def __init__(self, R: int):
        self.R = R
        self.groups: list[Group] = []
        self.of: dict[int, Group] = {}  # layer -> its group

    @property
    def layers(self) -> dict[int, dict[str, torch.Tensor]]:
        return {i: g.view(i) for i, g in sorted(self.of.items())}

    def ensure(self, layers: list[int], d: int, device) -> None:
        """Buffers for these layers (one group for those not held yet), empty."""
        new = [i for i in layers if i not in self.of]
        if new:
            g = Group(new, self.R, d, device)
            self.groups.append(g)
            self.of.update({i: g for i in new})

    def add(self, cands: list[Candidates] | None, undoable: bool = True) -> list | None:
        """Merge a forward's candidates (one set a grid) into every layer they read, in place: for each layer, the
        union's R smallest keys.

        A layer's c candidates, sorted up by key, are paired with its c largest kept keys, sorted down: candidate j
        takes its partner's slot when its key is smaller (the pairs that swap are a prefix, and what is kept is
        then exactly the R smallest of both). Every layer of a group in one op each. Returns what undoes it."""
        got = {i: c for c in cands or () for i in c.X}  # layer -> its candidates
        if not got:
            return None
        for i, c in got.items():
            if i not in self.of:
                self.ensure([j for j in got if got[j].X[j].shape[-1] == c.X[i].shape[-1]], c.X[i].shape[-1],
                            c.X[i].device)  # fmt: skip
        undo = [] if undoable else None
        for g in self.groups:
            here = [i for i in g.layers if i in got]
            if here:
                self._add_group(g, here, got, undo)
        return undo

    def _add_group(self, g: Group, here: list[int], got: dict, undo: list | None) -> None:
        sets = {id(got[i]) for i in here}
        c = max(got[i].keys.numel() for i in here)
        if len(sets) == 1 and len(here) == len(g.layers):  # one grid, every layer: the candidates' keys broadcast
            one = got[here[0]]
            keys, seq, pos = (one.keys.expand(len(here), c), one.seq.expand(len(here), c), one.pos.expand(len(here), c))
            X = torch.stack([got[i].X[i] for i in g.layers])
        else:  # layers of several grids, or some not read: each row its own, padded with empty candidates
            keys, seq, pos, X = _padded(g, got, c)
        if c > self.R:  # more than it can keep (``Candidates.pick`` already holds a forward to R): the R smallest
            keys, at = torch.topk(keys, self.R, dim=1, largest=False)
            seq, pos, X, c = seq.gather(1, at), pos.gather(1, at), _rows(X, at), self.R
        X = X.float()
        X = X / X.norm(dim=-1, keepdim=True)  # (L, c, 2, d) unit readings
        ck, order = torch.sort(keys, dim=1)
        top, slots = torch.topk(g.t["keys"], c, dim=1, largest=True)  # (L, c): the kept keys, sorted down
        enter = ck < top
        if undo is not None:
            undo.append((g, slots, {k: _rows(v, slots).clone() for k, v in g.t.items()}))
        for k, new in (
            ("keys", ck),
            ("seq", seq.gather(1, order)),
            ("pos", pos.gather(1, order)),
            ("X", _rows(X, order)),
        ):
            e = enter.view(*enter.shape, *([1] * (new.dim() - 2)))
            _put(g.t[k], slots, torch.where(e, new, _rows(g.t[k], slots)))

    def undo(self, undo: list | None) -> None:
        for g, slots, old in reversed(undo or []):
            for k, v in old.items():
                _put(g.t[k], slots, v)

    def merge(self, other: Sample) -> None:
        """Take another sample's tokens: every layer keeps the union's R smallest keys."""
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
        in; the key order does not), empty slots and non-finite readings left out."""
        g = self.of.get(layer)
        if g is None:
            return None
        cpu = {k: v.detach().cpu() for k, v in g.view(layer).items()}
        ok = torch.isfinite(cpu["keys"]) & torch.isfinite(cpu["X"]).all(-1).all(-1)
        order = torch.argsort(cpu["keys"][ok], stable=True)
        return {k: v[ok][order] for k, v in cpu.items()}

    def to_dict(self) -> dict:
        """JSON-able: per layer, each tensor as {dtype, shape, base64 of its bytes}."""
        return {
            "R": self.R,
            "layers": {str(i): {k: _pack(v) for k, v in buf.items()} for i, buf in self.layers.items()},
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


def _rows(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """t (L, R, ...) at idx (L, c) along dim 1: (L, c, ...)."""
    return t.gather(1, idx.view(*idx.shape, *([1] * (t.dim() - 2))).expand(*idx.shape, *t.shape[2:]))


def _put(t: torch.Tensor, idx: torch.Tensor, v: torch.Tensor) -> None:
    """t (L, R, ...) at idx (L, c) along dim 1 becomes v (L, c, ...), in place."""
    t.scatter_(1, idx.view(*idx.shape, *([1] * (t.dim() - 2))).expand(*idx.shape, *t.shape[2:]), v)


def _padded(g: Group, got: dict, c: int):
    """A group's candidates row by row, each padded to c with empty ones (key +inf, never taken)."""
    L, d = len(g.layers), g.t["X"].shape[-1]
    dev = g.t["keys"].device
    keys = torch.full((L, c), float("inf"), dtype=torch.float64, device=dev)
    seq = torch.zeros(L, c, dtype=torch.int64, device=dev)
    pos = torch.zeros(L, c, dtype=torch.int64, device=dev)
    X = torch.zeros(L, c, 2, d, dtype=torch.float32, device=dev)
    for r, i in enumerate(g.layers):
        if i in got:
            one, n = got[i], got[i].keys.numel()
            keys[r, :n], seq[r, :n], pos[r, :n], X[r, :n] = one.keys, one.seq, one.pos, one.X[i]
    return keys, seq, pos, X


def _pack(t: torch.Tensor) -> dict:
    t = t.detach().cpu().contiguous()
    return {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape),
            "data": base64.b64encode(t.numpy().tobytes()).decode("ascii")}  # fmt: skip


def _unpack(d: dict, device=None) -> torch.Tensor:
    import numpy as np

    try:
        dtype = {"float64": np.float64, "float32": np.float32, "int64": np.int64}[d["dtype"]]
        a = np.frombuffer(base64.b64decode(d["data"]), dtype=dtype).reshape(d["shape"]).copy()
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"the state's verdict sample is damaged ({e})") from None
    return torch.from_numpy(a).to(device) if device is not None else torch.from_numpy(a)
