"""The plain float64 twin of the monitor's reduction: every state sum, token by token.

The monitor's fast path (reduce/) stacks layers into arenas, pads layer groups to one
layout, splits bases into half-precision pairs and memoises norms. This module computes the
same sums the obvious way, one layer and one sequence at a time, in float64, with no
arena, grouping, padding, memo or stacking, so that the fast path can be tested against it
(docs/design.md, "Fast paths keep a plain twin").

Two steps, both from public pieces only:

1. ``build_bases`` re-derives each layer's bases: the built-in targets' principal subspaces
   and F's own eigen-subspaces from ``spectra_by_rank``, custom targets through
   ``stats.check_target``, the Haar frames (``measures.haar.haar_frames``) and the F-null frames
   (``measures.fnull.power_step_frames`` on ``layer_stacked``), with the monitor's seeds. It
   assembles them here (which frames, their seeds, their order, their widening), not through the
   null families' ``draw``, on purpose: the twin is the independent check the tests compare the
   monitor against, so it re-derives from the definitions what the plan builds.
2. ``reference_states`` runs over the forwards' readings (``Recorded``: each layer's pre,
   mid, post and, post-norm, base = LN_t(pre); the valid-token mask; each token's index among
   its sequence's valid tokens; whether the forward continues the previous one's sequences)
   and returns one state per layer in the ``measures.zero_state`` layout (float64).

Definitions (docs/design.md, "Mathematics"; stats.py):

- a token counts (``n``) when it is valid and finite at every reading point of the layer
  (base included); a valid token that is not is counted in ``n_nonfinite`` and nowhere else;
- a(x) = ||U^T x|| / ||x||; delta = a(mid) - a(ref), ref = base (post-norm) or pre; a token
  is "up" when delta > ``GROWTH_EPS``; ``n_norm_up``: a(base) - a(pre) > ``GROWTH_EPS``;
- the null subsample is the counted tokens whose index in their sequence is a multiple of
  ``null_stride``; every null (Haar, eigen-subspaces, F-null) and the ``*_sub`` sums are taken
  on it; ``null_pre`` needs no mid reading, every up-count does;
- consensus, per forward and sequence with >= 2 valid tokens, none non-finite at any of the
  layer's points: (||sum_i x_i/||x_i|| ||^2 - n) / (n (n - 1)) at each of pre, mid, post;
- per sequence (spanning a KV cache's forwards) the counters n, u, n_sub, u_sub, ubar_sub
  (the order of ``measures.ROW``) are kept open and folded into the cluster sums (``n_clu``,
  ``clu_*``) when it ends; the states returned have the still-open sequences folded in.

Not modelled: a token whose reading is exactly zero (the fast path counts a(0) = 0; here it is
NaN) and a finite reading whose float32 norm overflows (the fast path calls it non-finite).

Example (tests/monitor/readings.py records the forwards with hooks of its own):
    >>> bases = build_bases(get_adapter(model), [("ov", "modulus")], 128, 64, 16, 0)  # doctest: +SKIP
    >>> states = reference_states(recorder.forwards, bases, null_stride=5)  # doctest: +SKIP
    >>> mon.load_state_dict({"fingerprint": mon.state_dict()["fingerprint"],  # doctest: +SKIP
    ...                      "layers": to_state_dict_layers(states)})
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..spectra.compute import layer_stacked, spectra_by_rank
from . import head_targets as H
from . import stats
from .measures import FNULL, HAAR, TARGET, Sizes, registered, zero_state
from .measures.fnull import power_step_frames
from .measures.haar import haar_frames
from .measures.own import check, own_sums, readings
from .measures.plain import align, align_frames, up  # noqa: F401  (the plain helpers, re-exported)


@dataclass
class LayerReading:
    """One layer's readings in one forward, (b, n, d) each; None where not read."""

    pre: torch.Tensor
    mid: torch.Tensor | None = None  # None: no attention step ran (no delta)
    post: torch.Tensor | None = None
    base: torch.Tensor | None = None  # post-norm only: LN_t(pre)


@dataclass
class Recorded:
    """One forward of the model, as the monitor sees it.

    Attributes:
        layers: layer index -> its readings.
        mask: (b, n) bool, the valid (non-padding) tokens.
        index: (b, n) int64, each token's index among its sequence's valid tokens, counted
            from the sequence's start (across a KV cache's forwards).
        continues: this forward extends the previous forward's sequences (a KV-cache step).
    """

    layers: dict[int, LayerReading]
    mask: torch.Tensor
    index: torch.Tensor
    continues: bool = False


@dataclass
class TargetBases:
    """One (layer, target): U (d, k), its eigen-subspaces and its F-null frames (Kf, d, k_max)."""

    name: str
    U: torch.Tensor
    eig: list[torch.Tensor]
    fnull: torch.Tensor | None

    @property
    def k(self) -> int:
        return self.U.shape[1]


@dataclass
class PlainBases:
    """One layer's targets and Haar frames (K, d, k_max); ``ks`` the distinct k, ``m`` the eig width."""

    targets: list[TargetBases]
    haar: torch.Tensor
    ks: list[int] = field(default_factory=list)
    m: int = 0
    Kf: int = 0


def build_bases(
    adapter, targets, null_draws: int, fnull_draws: int, eig_top: int, null_seed: int
) -> dict[int, PlainBases]:
    """Every layer's bases, re-derived from the spectra, the target list and the seeds.

    Args:
        adapter: ``eigenhooks.models.get_adapter(model)``.
        targets: as ``eh.monitor`` takes them: (variant, rank) pairs, ('ov_head', rank) head targets
            (one per head with a subspace), or (name, tensor) / (name, {layer: tensor}) custom targets
            (int layer keys, negative from the end).
        null_draws, fnull_draws, eig_top, null_seed: the monitor's null settings.

    Returns:
        layer -> PlainBases, for the layers with at least one target.
    """
    top = max(4, 2 * eig_top)
    defs = []  # (name, variant, rank, {layer: U} or None, heads)
    for t in targets:
        if H.is_head_target(t):
            defs.append((f"{t[0]}/{t[1]}", H.HEAD_KINDS[t[0]], t[1], None, True))
        elif isinstance(t[1], str):
            defs.append((f"{t[0]}/{t[1]}", t[0], t[1], None, False))
        else:
            name, U = t
            L = adapter.n_layers
            given = {k % L: u for k, u in U.items()} if isinstance(U, dict) else dict.fromkeys(range(L), U)
            per = {i: stats.check_target(name, u, adapter.width(i)) for i, u in given.items()}
            defs.append((name, "ov", "modulus", per, False))
    specs = {}
    for _, variant, rank, _, heads in defs:
        for h in {False, heads}:  # a head target's layer F too: its eigen-subspaces rank the heads
            if (variant, rank, h) not in specs:
                specs[(variant, rank, h)] = spectra_by_rank(adapter, variant, (rank,), top=top, heads=h)[rank]
    out = {}
    for i in range(adapter.n_layers):
        chosen = [d for d in defs if d[3] is None or i in d[3]]
        if chosen:
            out[i] = _layer_bases(adapter, i, chosen, specs, null_draws, fnull_draws, eig_top, null_seed)
    return out


def _layer_bases(adapter, i, chosen, specs, K, Kf, m, null_seed) -> PlainBases:
    d = adapter.width(i)
    rows = []  # (name, variant, U, eig, head target)
    for name, variant, rank, per, heads in chosen:
        s = specs[(variant, rank, False)][i]
        if heads:  # each head's subspace, ranked among the layer's F's top m
            eig = stats.eig_subspaces(s.eigenvalues, s.eigenvectors, m)
            for p in H.heads_of(specs[(variant, rank, True)][i]):
                hname = H.row_name(name, p.head)
                rows.append((hname, variant, stats.check_target(hname, p.basis, d), eig, True))
        elif per is None:  # F's own top subspace, ranked among the next m
            U, eig = s.basis.double(), stats.eig_subspaces(s.eigenvalues, s.eigenvectors, m + 1)[1:]
            rows.append((name, variant, U, eig, False))
        else:  # a custom target is ranked among F's (ov, modulus) top m
            rows.append((name, variant, per[i], stats.eig_subspaces(s.eigenvalues, s.eigenvectors, m), False))
    k_draw, k_max = H.frame_widths([r[2].shape[1] for r in rows], [r[4] for r in rows])
    haar = H.widen(
        haar_frames(d, k_draw, K, stats.draw_seed(null_seed, i, 0)),
        k_max,
        stats.draw_seed(null_seed, i, H.WIDEN_SEED),
    )
    frames = {}
    if Kf:
        first = sorted({r[1] for r in rows if not r[4]})  # the layer targets' variants draw first
        for j, variant in enumerate(first + sorted({r[1] for r in rows} - set(first))):
            O, V = layer_stacked(adapter, i, variant)
            F = lambda G, O=O, V=V: O @ (V @ G)  # noqa: E731
            f = power_step_frames(F, d, k_draw, Kf, stats.draw_seed(null_seed, i, 1 + j))
            frames[variant] = H.widen(f, k_max, stats.draw_seed(null_seed, i, H.WIDEN_SEED + 1 + j), F)
    tgts = [TargetBases(name, U, eig, frames.get(variant)) for name, variant, U, eig, _ in rows]
    width = max([len(t.eig) for t in tgts] + [m if any(t.eig for t in tgts) else 0])
    return PlainBases(tgts, haar, sorted({t.k for t in tgts}), width, Kf if frames else 0)


class _LayerSums:
    """One layer's running state and its open sequences' counters (b, len(measures.ROW), T)."""

    def __init__(self, bases: PlainBases, K: int, measures: tuple, layer: int | None = None):
        self.bases, self.measures, self.layer = bases, measures, layer
        T = len(bases.targets)
        d = bases.haar.shape[1]
        draws = {HAAR.name: K, FNULL.name: bases.Kf}  # the frames drawn here (``build_bases``)
        self.state = zero_state(Sizes(layer, T, len(bases.ks), bases.m, d, draws), measures)
        self.rows: torch.Tensor | None = None

    def close(self) -> None:
        """Fold the open sequences' counters into the cluster sums (they ended)."""
        if self.rows is not None:
            TARGET.reference_close(self.state, self.rows)
            self.rows = None

    def folded(self) -> dict[str, torch.Tensor]:
        """The state with the open sequences folded in, the sequences left open."""
        st = {k: v.clone() for k, v in self.state.items()}
        if self.rows is not None:
            TARGET.reference_close(st, self.rows)
        return st


def reference_states(
    forwards: list[Recorded], bases: dict[int, PlainBases], null_stride: int, measures=()
) -> dict[int, dict[str, torch.Tensor]]:
    """The monitor's state of every layer after these forwards, in float64, the plain way.

    Args:
        forwards: the forwards in order (``Recorded``).
        bases: ``build_bases``'s result.
        null_stride: the subsample takes the tokens whose index in their sequence is a multiple
            of it (1: every token; ``MonitorConfig.null_stride``).
        measures: a researcher's own measures (``eh.Measure``), measured after the built-in ones, as a
            monitor's ``measures=``.

    Returns:
        layer -> {name: tensor} in the ``measures.zero_state`` layout, open sequences folded in.
    """
    K = next(iter(bases.values())).haar.shape[0] if bases else 0
    measures = registered() + check(measures)
    sums = {i: _LayerSums(b, K, measures, i) for i, b in bases.items()}
    for fw in forwards:
        if not fw.continues:
            for ls in sums.values():
                ls.close()
        for i, rd in fw.layers.items():
            if i in sums:
                _add_forward(sums[i], rd, fw.mask.bool(), fw.index, null_stride)
    return {i: ls.folded() for i, ls in sums.items()}


def _add_forward(ls: _LayerSums, rd: LayerReading, mask: torch.Tensor, index: torch.Tensor, null_stride: int) -> None:
    """Add one forward's readings of one layer to its sums, one sequence at a time."""
    b = mask.shape[0]
    T = len(ls.bases.targets)
    rows = torch.zeros(b, sum(len(m.row_fields) for m in ls.measures), T, dtype=torch.float64)
    for row in range(b):
        valid = mask[row]
        pts = {
            p: x[row][valid].double() for p, x in (("pre", rd.pre), ("mid", rd.mid), ("post", rd.post)) if x is not None
        }
        base = rd.base[row][valid].double() if rd.base is not None else None
        finite = torch.ones(int(valid.sum()), dtype=torch.bool)
        for X in [*pts.values(), *([base] if base is not None else [])]:
            finite &= torch.isfinite(X).all(-1)
        sub = finite & (index[row][valid] % null_stride == 0)
        X = {p: x[finite] for p, x in pts.items()}
        Xb = base[finite] if base is not None else None
        TARGET.reference_skipped(ls.state, float((~finite).sum()))
        if finite.all() and finite.numel() >= 2:
            TARGET.reference_consensus(ls.state, pts)
        sub = sub[finite]
        Y = {p: x[sub] for p, x in X.items() if p != "post"}  # the null's tokens
        Yr = Xb[sub] if Xb is not None else Y["pre"]
        for m in ls.measures:
            m.reference(ls, X, Xb, Y, Yr, sub, rows[row])
    own = tuple(m for m in ls.measures if m.own)
    if own:  # a researcher's measure is plain already: its sums of the readings, in float64
        pts = {p: None if x is None else x.double() for p, x in (("pre", rd.pre), ("mid", rd.mid), ("post", rd.post))}
        base = None if rd.base is None else rd.base.double()
        for k, v in own_sums(own, readings(ls.layer, pts, base, mask, index, null_stride)).items():
            ls.state[k] += v
    if ls.rows is not None and ls.rows.shape[0] != b:
        ls.close()
    ls.rows = rows if ls.rows is None else ls.rows + rows


def to_state_dict_layers(states: dict[int, dict[str, torch.Tensor]]) -> dict[str, dict[str, list]]:
    """``reference_states``'s result as ``Monitor.state_dict()["layers"]`` (plain nested lists)."""
    return {str(i): {k: v.tolist() for k, v in st.items()} for i, st in states.items()}


# ---- the verdict's kept tokens, the plain way (``verdict.sample``) ----
_M64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser on a Python int (mod 2**64): the twin of ``verdict.sample.mix``."""
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def reference_sample(
    forwards: list[Recorded], R: int, seed: int, null_stride: int
) -> dict[int, dict[str, torch.Tensor]]:
    """The verdict's kept tokens after these forwards, the plain way: every layer's (keys, seq, pos, X).

    A sequence's id hashes the bits of its first forward's valid readings at the first recorded layer's ``pre``
    and their indices; a token's key hashes (id, index); every valid token of the null subsample of every layer
    with a mid reading is a candidate, and the R smallest keys are kept (``verdict.sample`` says why). X holds
    float64 unit (baseline, mid) readings, in key order; empty slots are not returned."""
    gold = 0x9E3779B97F4A7C15
    cands: dict[int, list] = {}
    open_ids: list[int] = []
    for fw in forwards:
        mask, index = fw.mask.bool(), fw.index
        first = fw.layers[min(fw.layers)].pre
        if not fw.continues:
            open_ids = []
            for row in range(mask.shape[0]):
                h = 0
                bits = first[row].float().contiguous().view(torch.int32).to(torch.int64).tolist()
                for j in range(mask.shape[1]):
                    if not mask[row, j]:
                        continue
                    d = len(bits[j])
                    for c, bv in enumerate(bits[j]):
                        where = int(index[row, j]) * d + c
                        h = (h + _mix(_mix((bv + where * gold) & _M64))) & _M64
                open_ids.append(_mix((h + 1) & _M64))
        for i, rd in fw.layers.items():
            if rd.mid is None:
                continue
            base = rd.base if rd.base is not None else rd.pre
            for row in range(mask.shape[0]):
                sid = open_ids[row]
                for j in range(mask.shape[1]):
                    pos = int(index[row, j])
                    if not mask[row, j] or pos % null_stride:
                        continue
                    h = _mix((_mix((sid * gold + seed) & _M64) + pos) & _M64)
                    key = (h >> 11) * 2.0**-53
                    x = torch.stack([base[row, j].double(), rd.mid[row, j].double()])
                    cands.setdefault(i, []).append((key, _signed(sid), pos, x / x.norm(dim=-1, keepdim=True)))
    out = {}
    for i, cs in cands.items():
        kept = sorted(cs, key=lambda c: c[0])[:R]
        kept = [c for c in kept if torch.isfinite(c[3]).all()]
        out[i] = {
            "keys": torch.tensor([c[0] for c in kept], dtype=torch.float64),
            "seq": torch.tensor([c[1] for c in kept], dtype=torch.int64),
            "pos": torch.tensor([c[2] for c in kept], dtype=torch.int64),
            "X": torch.stack([c[3] for c in kept]) if kept else torch.zeros(0, 2, 0, dtype=torch.float64),
        }
    return out


def to_sample_dict(sample: dict[int, dict[str, torch.Tensor]], R: int) -> dict:
    """``reference_sample``'s result as ``Monitor.state_dict()["sample"]`` (R slots a layer, the rest empty)."""
    from .verdict.sample import Sample

    s = Sample(R)
    for i, h in sample.items():
        n, d = len(h["keys"]), h["X"].shape[-1]
        s.ensure([i], d, "cpu")
        buf = s.of[i].view(i)
        buf["keys"][:n], buf["seq"][:n], buf["pos"][:n] = h["keys"], h["seq"], h["pos"]
        buf["X"][:n] = h["X"].float()
    return s.to_dict()
