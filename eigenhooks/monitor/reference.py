"""The plain float64 twin of the monitor's reduction: every state sum, token by token.

The monitor's fast path (reduce/) stacks layers into arenas, pads layer groups to one
layout, splits bases into half-precision pairs and memoises norms. This module computes the
same sums the obvious way, one layer and one sequence at a time, in float64, with no
arena, grouping, padding, memo or stacking, so that the fast path can be tested against it
(DESIGN.md, "Fast paths keep a plain twin").

Two steps, both from public pieces only:

1. ``build_bases`` re-derives each layer's bases: the built-in targets' principal subspaces
   and F's own eigen-subspaces from ``spectra_by_rank``, custom targets through
   ``stats.check_target``, the Haar frames (``stats.haar_frames``) and the F-null frames
   (``stats.power_step_frames`` on ``layer_stacked``), with the monitor's seeds.
2. ``reference_states`` runs over the forwards' readings (``Forward``: each layer's pre,
   mid, post and, post-norm, base = LN_t(pre); the valid-token mask; each token's index among
   its sequence's valid tokens; whether the forward continues the previous one's sequences)
   and returns one state per layer in the ``measures.zero_state`` layout (float64).

Definitions (DESIGN.md §1, stats.py):

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
from .measures import MEASURES, ROW, TARGET, TGT_FIELDS, Sizes, zero_state
from .measures.plain import align, align_frames, up  # noqa: F401  (the plain helpers, re-exported)
from .measures.target import reference_close

_F = {name: i for i, name in enumerate(TGT_FIELDS)}


@dataclass
class LayerReading:
    """One layer's readings in one forward, (b, n, d) each; None where not read."""

    pre: torch.Tensor
    mid: torch.Tensor | None = None  # None: no attention step ran (no delta)
    post: torch.Tensor | None = None
    base: torch.Tensor | None = None  # post-norm only: LN_t(pre)


@dataclass
class Forward:
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
class LayerBases:
    """One layer's targets and Haar frames (K, d, k_max); ``ks`` the distinct k, ``m`` the eig width."""

    targets: list[TargetBases]
    haar: torch.Tensor
    ks: list[int] = field(default_factory=list)
    m: int = 0
    Kf: int = 0


def seed(null_seed: int, layer: int, which: int) -> int:
    """The monitor's seed of one layer's draws: which = 0 Haar, 1 + j the j-th F-null variant."""
    return (null_seed * 1_000_003 + layer * 101 + which) % (2**63)


def build_bases(
    adapter, targets, null_draws: int, fnull_draws: int, eig_top: int, null_seed: int
) -> dict[int, LayerBases]:
    """Every layer's bases, re-derived from the spectra, the target list and the seeds.

    Args:
        adapter: ``eigenhooks.models.get_adapter(model)``.
        targets: as ``eh.monitor`` takes them: (variant, rank) pairs, ('ov_head', rank) head targets
            (one per head with a subspace), or (name, tensor) / (name, {layer: tensor}) custom targets
            (int layer keys, negative from the end).
        null_draws, fnull_draws, eig_top, null_seed: the monitor's null settings.

    Returns:
        layer -> LayerBases, for the layers with at least one target.
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


def _layer_bases(adapter, i, chosen, specs, K, Kf, m, null_seed) -> LayerBases:
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
    haar = H.widen(stats.haar_frames(d, k_draw, K, seed(null_seed, i, 0)), k_max, seed(null_seed, i, H.WIDEN_SEED))
    frames = {}
    if Kf:
        first = sorted({r[1] for r in rows if not r[4]})  # the layer targets' variants draw first
        for j, variant in enumerate(first + sorted({r[1] for r in rows} - set(first))):
            O, V = layer_stacked(adapter, i, variant)
            F = lambda G, O=O, V=V: O @ (V @ G)  # noqa: E731
            f = stats.power_step_frames(F, d, k_draw, Kf, seed(null_seed, i, 1 + j))
            frames[variant] = H.widen(f, k_max, seed(null_seed, i, H.WIDEN_SEED + 1 + j), F)
    tgts = [TargetBases(name, U, eig, frames.get(variant)) for name, variant, U, eig, _ in rows]
    width = max([len(t.eig) for t in tgts] + [m if any(t.eig for t in tgts) else 0])
    return LayerBases(tgts, haar, sorted({t.k for t in tgts}), width, Kf if frames else 0)


class _LayerSums:
    """One layer's running state and its open sequences' counters (b, 5, T)."""

    def __init__(self, bases: LayerBases, K: int, measures: tuple = MEASURES, layer: int | None = None):
        self.bases, self.measures, self.layer = bases, measures, layer
        T = len(bases.targets)
        self.state = zero_state(Sizes(layer, T, len(bases.ks), K, bases.m, bases.Kf), measures)
        self.rows: torch.Tensor | None = None

    def close(self) -> None:
        """Fold the open sequences' counters into the cluster sums (they ended)."""
        if self.rows is not None:
            reference_close(self.state["tgt"], self.rows)
            self.rows = None

    def folded(self) -> dict[str, torch.Tensor]:
        """The state with the open sequences folded in, the sequences left open."""
        st = {k: v.clone() for k, v in self.state.items()}
        if self.rows is not None:
            reference_close(st["tgt"], self.rows)
        return st


def reference_states(
    forwards: list[Forward], bases: dict[int, LayerBases], null_stride: int, measures=MEASURES
) -> dict[int, dict[str, torch.Tensor]]:
    """The monitor's state of every layer after these forwards, in float64, the plain way.

    Args:
        forwards: the forwards in order (``Forward``).
        bases: ``build_bases``'s result.
        null_stride: the subsample takes the tokens whose index in their sequence is a multiple
            of it (1: every token; ``MonitorConfig.null_stride``).
        measures: what is measured (a monitor's built-in ones and then its own ``measures=``).

    Returns:
        layer -> {name: tensor} in the ``measures.zero_state`` layout, open sequences folded in.
    """
    K = next(iter(bases.values())).haar.shape[0] if bases else 0
    sums = {i: _LayerSums(b, K, tuple(measures), i) for i, b in bases.items()}
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
    rows = torch.zeros(b, len(ROW), T, dtype=torch.float64)
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
        tgt = ls.state["tgt"]
        tgt[:, _F["n_nonfinite"]] += float((~finite).sum())
        if finite.all() and finite.numel() >= 2:
            TARGET.reference_consensus(tgt, pts)
        sub = sub[finite]
        Y = {p: x[sub] for p, x in X.items() if p != "post"}  # the null's tokens
        Yr = Xb[sub] if Xb is not None else Y["pre"]
        for m in ls.measures:
            m.reference(ls, X, Xb, Y, Yr, sub, rows[row])
    if ls.rows is not None and ls.rows.shape[0] != b:
        ls.close()
    ls.rows = rows if ls.rows is None else ls.rows + rows


def to_state_dict_layers(states: dict[int, dict[str, torch.Tensor]]) -> dict[str, dict[str, list]]:
    """``reference_states``'s result as ``Monitor.state_dict()["layers"]`` (plain nested lists)."""
    return {str(i): {k: v.tolist() for k, v in st.items()} for i, st in states.items()}
