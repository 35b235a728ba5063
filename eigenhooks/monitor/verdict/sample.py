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
        """Keep layer's readings (b, n, d) at the candidates, as float32 unit vectors (non-finite rows stay NaN)."""
        with torch.no_grad():
            x = torch.stack([base.reshape(-1, base.shape[-1])[self.flat], mid.reshape(-1, mid.shape[-1])[self.flat]], 1)
            x = x.float()
            self.X[layer] = x / x.norm(dim=-1, keepdim=True)


class Sample:
    """The kept tokens of every layer: per layer, keys (R,), seq (R,), pos (R,) and X (R, 2, d) float32.

    ``add`` merges one forward's candidates in place and returns what undoes it; ``merge`` takes another sample's
    union; ``to_dict`` / ``from_dict`` carry it in a state dict (base64 of its bytes: JSON-able)."""

    def __init__(self, R: int):
        self.R = R
        self.layers: dict[int, dict[str, torch.Tensor]] = {}

    def _buffer(self, layer: int, like: torch.Tensor) -> dict[str, torch.Tensor]:
        buf = self.layers.get(layer)
        if buf is None:
            dev, d = like.device, like.shape[-1]
            buf = self.layers[layer] = {
                "keys": torch.full((self.R,), float("inf"), dtype=torch.float64, device=dev),
                "seq": torch.zeros(self.R, dtype=torch.int64, device=dev),
                "pos": torch.zeros(self.R, dtype=torch.int64, device=dev),
                "X": torch.full((self.R, 2, d), float("nan"), dtype=torch.float32, device=dev),
            }
        return buf

    def add(self, cands: Candidates | None, undoable: bool = True) -> list | None:
        """Merge a forward's candidates into every layer it read, in place: the union's R smallest keys.

        The candidates' c keys, sorted up, are paired with the c largest kept keys, sorted down: candidate j takes
        its partner's slot when its key is smaller (the pairs that swap are a prefix, and what is kept is then
        exactly the R smallest of both). Returns [(layer, slots, old rows)] to undo it, or None."""
        if cands is None or not cands.X:
            return None
        undo = [] if undoable else None
        c = cands.keys.numel()
        ck, order = torch.sort(cands.keys)
        for layer, X in cands.X.items():
            buf = self._buffer(layer, X)
            top, slots = torch.topk(buf["keys"], c, largest=True)  # (c,) kept keys, sorted down
            enter = ck < top
            if undo is not None:
                undo.append((layer, slots, {k: v[slots].clone() for k, v in buf.items()}))
            for k, new in (("keys", ck), ("seq", cands.seq[order]), ("pos", cands.pos[order]), ("X", X[order])):
                e = enter.view(-1, *([1] * (new.dim() - 1)))
                buf[k].index_copy_(0, slots, torch.where(e, new.to(buf[k].device), buf[k][slots]))
        return undo

    def undo(self, undo: list | None) -> None:
        for layer, slots, old in reversed(undo or []):
            for k, v in old.items():
                self.layers[layer][k].index_copy_(0, slots, v)

    def merge(self, other: Sample) -> None:
        """Take another sample's tokens: every layer keeps the union's R smallest keys."""
        for layer, theirs in other.layers.items():
            ours = self.layers.get(layer)
            if ours is None:
                self.layers[layer] = {k: v.clone() for k, v in theirs.items()}
                continue
            both = {k: torch.cat([ours[k], theirs[k].to(ours[k].device)]) for k in ours}
            at = torch.sort(both["keys"], stable=True).indices[: self.R]
            self.layers[layer] = {k: v[at].contiguous() for k, v in both.items()}

    def host(self, layer: int) -> dict[str, torch.Tensor] | None:
        """Layer's kept tokens on the CPU in key order (which slot a token took depends on the order tokens came
        in; the key order does not), empty slots and non-finite readings left out."""
        buf = self.layers.get(layer)
        if buf is None:
            return None
        cpu = {k: v.detach().cpu() for k, v in buf.items()}
        ok = torch.isfinite(cpu["keys"]) & torch.isfinite(cpu["X"]).all(-1).all(-1)
        order = torch.argsort(cpu["keys"][ok], stable=True)
        return {k: v[ok][order] for k, v in cpu.items()}

    def to_dict(self) -> dict:
        """JSON-able: per layer, each tensor as {dtype, shape, base64 of its bytes}."""
        out = {}
        for layer, buf in self.layers.items():
            out[str(layer)] = {k: _pack(v) for k, v in buf.items()}
        return {"R": self.R, "layers": out}

    @staticmethod
    def from_dict(d: dict, R: int, device=None) -> Sample:
        """A sample from ``to_dict``; a ValueError names what is wrong."""
        if not isinstance(d, dict) or d.get("R") != R or not isinstance(d.get("layers"), dict):
            got = d.get("R") if isinstance(d, dict) else type(d).__name__
            raise ValueError(f"the state's verdict sample holds R={got!r} tokens, this monitor keeps {R}")
        s = Sample(R)
        for key, buf in d["layers"].items():
            s.layers[int(key)] = {k: _unpack(v, device) for k, v in buf.items()}
        return s

    def all_gather(self, dist, group, device) -> None:
        """Every rank ends with the union's R smallest keys of every rank's sample (ranks' layers must agree)."""
        for layer in sorted(self.layers):
            buf = self.layers[layer]
            parts = {}
            for k, v in buf.items():
                got = [torch.empty_like(v, device=device) for _ in range(dist.get_world_size(group))]
                dist.all_gather(got, v.to(device), group=group)
                parts[k] = got
            other = Sample(self.R)
            self.layers[layer] = {k: parts[k][0].to(v.device) for k, v in buf.items()}
            for r in range(1, len(parts["keys"])):
                other.layers = {layer: {k: parts[k][r] for k in buf}}
                self.merge(other)


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
