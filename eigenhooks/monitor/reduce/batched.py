"""Stage 1 for a flush of buffered decoding steps: every layer's projections at once, ``project_steps``.

A flush holds each reading slot's steps as one (b, n, d) tensor, the slots of the layers that share a
grid and a shape side by side in one (S, b, n, d) tensor (a block: most models have one). Layer by layer, ``projection.project`` spends about ten ops on each layer:
its norms, its null subsample's gathers and five matmuls, each written into a buffer of its own
that the reduction then stacks. Here the norms of every slot are one op, the subsample of every
slot one gather, and the matmuls write straight into the stacked buffers.

On CUDA each reading point's matmuls are one bmm over the layers of a layout: about ten launches
a flush instead of ten a layer. On the CPU they stay one mm a layer and point: a CPU bmm's bits
are not its matrices' mms (a small bmm takes a plain loop of its own, and two threads split a bmm
by matrices but an mm inside it), and the CPU states are pinned bit for bit
(``benchmarks/reference_states.py``). So the CPU path gives ``project``'s numbers bit for bit
(``tests/monitor/test_lean_steps.py``), and the bmm path the same to float32 rounding
(``tests/monitor/test_batched_projection.py``, which forces it on the CPU).
"""

from __future__ import annotations

from operator import attrgetter

import torch

from . import kernels
from .bases import LayerBases
from .grid import Grid
from .projection import Projection

BMM_DEVICES = {"cuda"}  # where a point's matmuls are one bmm over the layers (tests add "cpu")


class Stacks:
    """Each layout's bases stacked over its layers, made once per (layers, device, dtype). Each layer's
    own bases then become views into the stack (``LayerBases.on``), so they are held once."""

    def __init__(self):
        self._made: dict[tuple, tuple] = {}  # key -> (Bt stack, Bn stack, the layers' float64 bases made from)
        self.layouts: dict[tuple, tuple] = {}  # (a step order, its readings' shapes, ...) -> ``_layout``

    def get(self, group: list[LayerBases], device: torch.device, dtype: torch.dtype):
        key = (tuple(map(id, group)), device, dtype)
        made = self._made.get(key)
        if made is None or not all([b.Bt64 is t and b.Bn64 is n for b, (t, n) in zip(group, made[2])]):
            pairs = [b.on(device, dtype) for b in group]  # (a layer laid out again has new bases)
            made = self._made[key] = (_stack(pairs, 0), _stack(pairs, 1), [(b.Bt64, b.Bn64) for b in group])
            for b, Bt, Bn in zip(group, made[0], made[1]):
                b.share(device, dtype, Bt, Bn)
        return made[0], made[1]


def _stack(pairs, k: int) -> torch.Tensor:
    """(L, d, C) of the layers' (d, C) bases in their own layout: a float32 basis is the transposed view
    of a row-major (C, d), and its stack keeps that, (L, C, d) transposed (the bits of the mm)."""
    Bs = [p[k] for p in pairs]
    if Bs[0].stride(0) == 1:
        return torch.stack([B.T for B in Bs]).transpose(1, 2)
    return torch.stack(Bs)


POINTS = ("pre", "mid", "post", "base")  # a projection's reading points, in order (``projection._readings``)


def project_steps(steps: list, bases: dict, stacks: Stacks) -> list[tuple[int, Projection]]:
    """``project(bases, points, grid, base, consensus=False)`` of every layer of buffered one-token steps.

    Args:
        steps: ``forward.Step`` s of one shape, in the order they ran.
        bases: layer -> its ``LayerBases``.
        stacks: the bases stacked over the layers, and the steps' layouts (made once).
    Returns (layer, projection) for each layer, in the order they completed. A layer's readings are its
    steps' readings concatenated along the positions (rows stay rows), each reading once (post(t) is
    pre(t+1)); the layers whose steps share their grids and shape are one block, projected at once
    (``project_layers``). A layer missing in some steps counts the steps that have it, with the points
    every one of them read.
    """
    first = steps[0].order
    if all([s.order is first or s.order == first for s in steps]):  # read alike: an index is one reading
        xs = steps[0].xs
        key = (first, tuple(map(_shape, xs)), tuple(map(_dtype, xs)), tuple(map(_device, xs)))
        layout = stacks.layouts.get(key)
        if layout is None:
            if len(stacks.layouts) > 64:
                stacks.layouts.clear()
            layout = stacks.layouts[key] = _layout([[(steps[0], sl)] for sl in first], True)
    else:  # layers missing in some steps: a reading is known by its tensors
        maps = [{sl.layer: sl for sl in s.order} for s in steps]
        seen = dict.fromkeys([sl.layer for s in steps for sl in s.order])
        layout = _layout([[(s, m[i]) for s, m in zip(steps, maps) if i in m] for i in seen], False)
    out = {}
    for grid, ls, cols in layout[0]:
        alike = isinstance(grid, int)  # indices into each step's grids and readings
        grids = [s.grids[grid] for s in steps] if alike else grid
        x0 = steps[0].xs[cols[0]] if alike else cols[0][0]
        X = torch.empty(len(cols), x0.shape[0], len(grids) * x0.shape[1], x0.shape[2], dtype=x0.dtype, device=x0.device)
        for j, c in enumerate(cols):
            torch.cat([s.xs[c] for s in steps] if alike else c, 1, out=X[j])  # rows stay rows
        prs = project_layers([(bases[i], sl) for i, sl in ls], X, Grid.cat(grids), stacks)
        out.update(zip([i for i, _ in ls], prs))
    return [(i, out[i]) for i in layout[1]]


_shape, _dtype, _device = attrgetter("shape"), attrgetter("dtype"), attrgetter("device")


def _layout(layers: list, alike: bool) -> tuple[list, list]:
    """How a flush lays its steps out: ([(grid, [(layer, {point: column})], columns)] a block, the layers in
    order). Each layer is [(step, its Slots)] for the steps that have it; ``alike``: the steps share one
    order, so a block's grid and columns are indices into every step's grids and readings (the layout is
    kept for the next flush), else the grids and readings themselves (a column: its steps' readings)."""
    blocks: dict = {}  # (grid key, shape, dtype, device) -> (grid, [(layer, slots)], {column key: index}, columns)
    for have in layers:
        s0, sl0 = have[0]
        x0 = s0.xs[sl0.pre]
        gkey = sl0.grid if alike else tuple([id(s.grids[sl.grid]) for s, sl in have])
        block = blocks.get((gkey, x0.shape, x0.dtype, x0.device))
        if block is None:
            grid = sl0.grid if alike else [s.grids[sl.grid] for s, sl in have]
            block = blocks[gkey, x0.shape, x0.dtype, x0.device] = (grid, [], {}, [])
        slots, at, cols = {}, block[2], block[3]
        for p in POINTS:
            j0 = getattr(sl0, p)
            if j0 is None or not (alike or all([getattr(sl, p) is not None for _, sl in have])):
                continue
            js = []
            for h in (0, 1) if isinstance(j0, tuple) else (None,):  # a parallel block's mid: (pre, attn)
                if alike:
                    c = col = j0 if h is None else j0[h]
                else:
                    col = [s.xs[getattr(sl, p) if h is None else getattr(sl, p)[h]] for s, sl in have]
                    c = tuple(map(id, col))
                if c not in at:
                    at[c] = len(cols)
                    cols.append(col)
                js.append(at[c])
            slots[p] = js[0] if len(js) == 1 else tuple(js)
        block[1].append((sl0.layer, slots))
    return [(grid, ls, cols) for grid, ls, _, cols in blocks.values()], [have[0][1].layer for have in layers]


def project_layers(
    layers: list[tuple[LayerBases, dict[str, int | None]]], X: torch.Tensor, grid: Grid, stacks: Stacks
) -> list[Projection]:
    """``project(bases, points, grid, base, consensus=False)`` of every layer, from one tensor of readings.

    Args:
        layers: (bases, {'pre': slot, 'mid': slot or None, 'post': slot or None, 'base': slot or None}) a
            layer, each slot a row of X; a parallel block's mid is (pre slot, attention slot), their sum;
            base: LN_t(pre) of a post-norm layer.
        X: (S, b, n, d) every reading slot's buffered steps.
        grid: the steps' grid, one for every layer.
        stacks: the bases stacked over the layers (made once).
    Returns the projections in the order of ``layers``; a layout's share one stack of each field, which
    ``reduce_many`` reduces without stacking them again.
    """
    S, b, n, d = X.shape
    rows = X.view(S, b * n, d)
    out: list = [None] * len(layers)
    norms = X.new_empty(S, b * n, dtype=torch.float32)
    kernels.norms(rows, norms)  # every slot's norms, each once (layer t's post is layer t+1's pre)
    groups: dict[tuple, list[int]] = {}
    for i, (bases, slots) in enumerate(layers):
        names = tuple(p for p in POINTS if slots.get(p) is not None)
        Bt, Bn = bases.on(X.device, X.dtype)
        summed = isinstance(slots.get("mid"), tuple)  # a parallel block's mid
        key = (bases.layout, names, bases.null_stride, Bt.shape, Bn.shape, Bt.dtype, summed)
        groups.setdefault(key, []).append(i)
    subs: dict[int, torch.Tensor] = {}
    for (_, names, null_stride, Btshape, Bnshape, Btdtype, _), idx in groups.items():
        flat, _ = grid.sub(null_stride)
        if null_stride not in subs:
            subs[null_stride] = (
                rows if flat is None else rows.index_select(1, flat)
            )  # every slot's subsample, one gather
        bmm = X.device.type in BMM_DEVICES and Btshape[1] > 1  # (one column: a gemv, another kernel)
        src = {
            p: _source(rows, subs[null_stride], norms, [layers[i][1][p] for i in idx], flat, p != "post", bmm)
            for p in names
        }
        G, nulls = len(idx), [p for p in names if p != "post"]
        whole = {"norms": torch.stack([src[p][2] for p in names], 1)}  # (L, P, b*n)
        if bmm:
            Bt, Bn = stacks.get([layers[i][0] for i in idx], X.device, X.dtype)
            whole["Pt"] = torch.stack([kernels.bmm_layers(src[p][0], Bt) for p in names], 1)  # (L, P, b*n, C)
            Pn = torch.stack([kernels.bmm_layers(src[p][1], Bn) for p in nulls], 1)  # (L, P_null, N, Cn)
        else:  # one mm a layer and point, each written into its place in the stack
            whole["Pt"] = X.new_empty(G, len(names), b * n, Btshape[1], dtype=torch.float32)
            Pn = X.new_empty(G, len(nulls), subs[null_stride].shape[1], Bnshape[1], dtype=torch.float32)
            for g, i in enumerate(idx):
                Bt, Bn = layers[i][0].on(X.device, X.dtype)
                for j, p in enumerate(names):
                    kernels.mm(src[p][0][g], Bt, whole["Pt"][g, j])
                for j, p in enumerate(nulls):
                    kernels.mm(src[p][1][g], Bn, Pn[g, j])
        whole["Pn"] = Pn.view(G, -1, Bnshape[1])  # (L, P_null * N, Cn)
        h = 1 if Btdtype == torch.float32 else 2
        for g, i in enumerate(idx):
            out[i] = Projection(
                grid, names, (b, n, null_stride), False, h, whole["norms"][g], whole["Pt"][g], whole["Pn"][g],
                batch=(whole, g, G),
            )  # fmt: skip
    return out


def _source(rows: torch.Tensor, sub: torch.Tensor, norms: torch.Tensor, js: list, flat, null: bool, stacked: bool):
    """One point's readings for a layout's layers: (rows (L, b*n, d), their null subsample (L, N, d), or None
    when the point has no null, their norms (L, b*n)); not ``stacked`` (one mm a layer), the rows and
    subsamples as a list of each layer's views, no copy. A parallel block's mid, js of (pre, attention)
    slots, is the sum pre + attn made once for all of them (elementwise: the bits of each layer's own
    sum), its norms and subsample its own."""
    if not isinstance(js[0], tuple):
        pick = _pick if stacked else lambda t, js: [t[j] for j in js]  # noqa: E731
        return pick(rows, js), pick(sub, js) if null else None, _pick(norms, js)
    M = _pick(rows, [j[0] for j in js]) + _pick(rows, [j[1] for j in js])
    own = M.new_empty(M.shape[:2], dtype=torch.float32)
    kernels.norms(M, own)
    return M, (M if flat is None else M.index_select(1, flat)) if null else None, own


def _pick(t: torch.Tensor, js: list[int]) -> torch.Tensor:
    """t's rows js along its first dimension: a view when they are evenly spaced (a layer's pre, mid
    and post slots usually are), else one copy."""
    if len(js) == 1:
        return t[js[0] : js[0] + 1]
    step = js[1] - js[0]
    if step > 0 and js == list(range(js[0], js[0] + step * len(js), step)):
        return t[js[0] : js[-1] + 1 : step]
    return torch.stack([t[j] for j in js])
