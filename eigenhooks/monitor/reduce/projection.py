"""Stage 1 of the reduction, in a layer's hook while its activations are hot: ``project``.

Per reading point the norms, one matmul onto the targets (every token) and one onto the nulls (a
subsample, ``Grid.sub``), and each sequence's sum of unit vectors. What it keeps is small,
(b, n, targets) and (N, null columns) per point and a few (b, n) vectors, written into the
layer's row of its group's ``Arena``. No host synchronisation, no data-dependent shapes, no
constant made on the host per forward (docs/design.md, "On a GPU").
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from . import kernels
from .arena import ArenaRow, parts
from .bases import LayerBases
from .grid import Grid


@dataclass
class Projection:
    """One layer's projections of one forward (or of buffered decoding steps), for ``reduce_many``.

    norms (P, b*n): each point's ||x||; Pt (P, b*n, target columns); Pn (P_null * N, null columns:
    the null points' subsamples, N = b * M tokens each, in order); sv (P_c, b, 1, d) or None: each
    sequence's sum of unit vectors over its valid tokens (NaN if one is non-finite there), float32
    path; sv_parts: the half path's (b, 2, d) hi/lo sums, one per consensus point, stacked later.
    """

    grid: Grid
    names: tuple[str, ...]  # the reading points, in order ('base': LN_t(pre) of a post-norm layer)
    shape: tuple[int, int, int]  # (b, n, null_stride)
    consensus: bool
    halves: int  # 1: float32 products; 2: hi and lo halves, added by the reduction
    norms: torch.Tensor
    Pt: torch.Tensor
    Pn: torch.Tensor
    sv: torch.Tensor | None = None
    sv_parts: list[torch.Tensor] | None = None
    slot: ArenaRow | None = None  # the arena row written into, given back by reduce_many
    batch: tuple | None = None  # (fields stacked over a layout's layers, this layer's index, L): ``project_layers``


class Memo:
    """A forward's norms and consensus sums by reading, for one Grid: layer t's 'post' is layer t+1's
    'pre', the very same tensor on the same tokens, so its norms and sums are computed once.

    Keyed by the reading tensor's id, checked against a weak reference to it (so a freed tensor's
    id, reused by a new one, never hits, and the memo keeps no activation alive) and by the grid's
    mask (the same tokens counted)."""

    def __init__(self, store: dict | None, grid: Grid):
        self.store, self.mask = store, grid.mask

    def get(self, X: torch.Tensor, what: str) -> torch.Tensor | None:
        if self.store is None:
            return None
        hit = self.store.get((id(X), what))
        return hit[2] if hit is not None and hit[0]() is X and hit[1] is self.mask else None

    def put(self, X: torch.Tensor, what: str, value: torch.Tensor) -> None:
        if self.store is not None:
            self.store[(id(X), what)] = (weakref.ref(X), self.mask, value)


def project(
    bases: LayerBases,
    points: dict,
    mask: torch.Tensor | Grid,
    base: torch.Tensor | None = None,
    consensus: bool = True,
    memo: dict | None = None,
) -> Projection:
    """Per reading point the projections, norms and consensus sums of one layer.

    Args:
        bases: the layer's bases.
        points: {'pre': (b, n, d), 'mid': (b, n, d) or None, 'post': ... or None}.
        mask: (b, n) bool, the valid (non-padding) tokens, or a ``Grid`` (the mask and each
            token's index in its sequence, which chooses the null subsample).
        base: post-norm only: LN_t(pre) (b, n, d), the baseline delta is measured from.
        consensus: sum the within-sequence consensus (off for buffered single steps).
        memo: one forward's store of the norms and consensus sums already taken (``Memo``).
    """
    grid = mask if isinstance(mask, Grid) else Grid(mask)
    pre = points["pre"]
    Bt, Bn = bases.on(pre.device, pre.dtype)
    b, n = pre.shape[:2]
    names, X3 = _readings(points, base)
    Xs = [X.reshape(b * n, -1) for X in X3]
    null_stride = bases.null_stride
    flat, ok = grid.sub(null_stride)
    N = ok.numel()
    nulls = [X for p, X in zip(names, Xs) if p != "post"]
    cons = [X for p, X in zip(names, X3) if consensus and p != "base"]
    h = 1 if Bt.dtype == torch.float32 else 2  # halves (hi, lo) of each product, added in reduce_many
    shapes = {"norms": (len(Xs), b * n), "Pt": (len(Xs), b * n, Bt.shape[-1]), "Pn": (len(nulls) * N, Bn.shape[-1])}
    if cons and h == 1:  # float32: the bmm writes into the arena (halves: see below)
        shapes["sv"] = (len(cons), b, h, bases.d)
    key = (b, n, tuple(names), consensus, Bt.dtype, pre.device)  # the device last: ArenaRow reads it
    slot = bases.arena.take(bases.row, key) if bases.arena is not None else None
    if slot:
        out, views = slot.buffers(shapes, N)
    else:
        out = {k: pre.new_empty(v, dtype=torch.float32) for k, v in shapes.items()}
        views = parts(out, N)
    memo = Memo(memo, grid)
    for X, X0, o in zip(Xs, X3, views["norms"]):
        got = memo.get(X0, "norms")
        if got is None:
            kernels.norms(X, o)
            memo.put(X0, "norms", o)
        else:  # a small copy instead of reading X again
            o.copy_(got)
    for X, o in zip(nulls, views["Pn"]):  # the subsample's rows, gathered (all rows when null_stride == 1)
        kernels.mm(X if flat is None else X.index_select(0, flat), Bn, o)
    for X, o in zip(Xs, views["Pt"]):
        kernels.mm(X, Bt, o)
    sv_parts = _consensus_sums(cons, grid, out, views, memo, pre, h, b, n) if cons else None
    return Projection(
        grid,
        tuple(names),
        (b, n, null_stride),
        consensus,
        h,
        out["norms"],
        out["Pt"],
        out["Pn"],
        out.get("sv"),
        sv_parts,
        slot,
    )


def _readings(points: dict, base) -> tuple[list[str], list[torch.Tensor]]:
    """The reading points present, in order, and their (b, n, d) tensors in the model's dtype; a
    post-norm layer's baseline LN_t(pre) last, as 'base'."""
    names = [p for p in ("pre", "mid", "post") if points.get(p) is not None]
    X3 = [points[p] for p in names]
    if base is not None:
        names.append("base")
        X3.append(base)
    return names, X3


def _consensus_sums(cons, grid: Grid, out: dict, views: dict, memo: Memo, pre, h: int, b: int, n: int):
    """Each sequence's sum of unit vectors at each consensus point: weights 1/||x|| on the valid tokens.
    A non-finite reading makes its sequence's sum NaN, and the reduction leaves out every sequence
    with a non-finite valid token. Returns the half path's hi/lo parts (None on the float32 path,
    which writes into ``views['sv']``)."""
    w = grid.mask.reshape(1, b * n) / out["norms"][: len(cons)].clamp_min(1e-30)
    w = w.view(len(cons), b, 1, n)
    if h == 1:
        for wj, X, o in zip(w.unbind(0), cons, views["sv"]):
            got = memo.get(X, "sv")
            if got is None:
                kernels.bmm(wj, X, o)
                memo.put(X, "sv", o)
            else:
                o.copy_(got)
        return None
    # [w_hi; w_lo] in the activations' dtype, for all points at once (P_c, b, 2, n): two ops,
    wh = pre.new_empty(len(cons), b, 2, n)  # the low half w - w_hi rounded once, as (w - hi).to()
    wh[:, :, :1].copy_(w)
    torch.sub(w, wh[:, :, :1], out=wh[:, :, 1:])
    # kept as they come (no copy into the arena): the stacked reduction stacks them in one op
    sv_parts = []
    for wj, X in zip(wh.unbind(0), cons):
        got = memo.get(X, "sv")
        if got is None:
            got = kernels.bmm_half(wj, X)
            memo.put(X, "sv", got)
        sv_parts.append(got)  # the same tensor, stacked twice: no op at all
    return sv_parts
