"""The streaming reduction: one forward's readings to sums, in two stages.

1. ``LayerReducer.project`` runs in a layer's hook, while its activations are hot: the
   norms, one matmul per reading point onto the targets (every token) and one per null
   point onto the nulls (a subsample, ``Grid.sub``), and each sequence's sum of unit vectors.
   What it keeps is small: (b, n, targets) and (N, null columns) per point, a few (b, n)
   vectors, written into the layer's row of its group's ``Arena``.
2. ``reduce_many`` runs once the forward ends, on every layer at once: layers of the same
   layout and shapes are reduced together (alignments, up-counts, null draws, per-row
   counters) straight from the arena's buffers, so the many small element-wise steps cost
   one op per forward instead of one per layer, and no copy stacks the layers. Its output is
   per layer, the state ``stats.zero_state`` describes.

The null subsample is chosen by each token's place in its own sequence (``Grid``): its index
among that sequence's valid tokens (counted across a KV cache's forwards), so the same sequences
give the same numbers however they are batched, padded, sharded or generated.

No host synchronisation, no data-dependent shapes or branches, no constant made on the host per
forward: a hook only enqueues work on the activations' device (DESIGN.md §2), and it adds no
graph breaks under torch.compile. Half-precision activations on CUDA are read as they are: the
norms accumulate in float32, and each float32 basis B is split as B_hi + B_lo (two bfloat16 or
float16 matrices, |B - B_hi - B_lo| <= 2^-16 |B|) whose products are accumulated in float32 by
the matmuls (``torch.mm(..., out_dtype=float32)``), so no float32 copy of the activations is made
and the projections keep ~16 bits of the basis. Definitions are in ``stats`` (DESIGN.md §1).
"""

from __future__ import annotations

import weakref

import torch

from .stats import _ROW, GROWTH_EPS, TGT_FIELDS, TargetSpec


class Grid:
    """Which tokens of one call count, and where each sits in its own sequence.

    Args:
        mask: (b, n) bool, the valid (non-padding) tokens.
        vi: (b, n) int64, each token's index among its sequence's valid tokens, counted from the
            sequence's start (under a KV cache, across forwards). Default: from this call alone.
        after: (b, 1) valid tokens of each sequence once this call is counted, when the caller has it.
    """

    def __init__(self, mask: torch.Tensor, vi: torch.Tensor | None = None, after: torch.Tensor | None = None):
        self.mask = mask
        self.vi = mask.cumsum(1) - 1 if vi is None else vi
        self._after = after
        self._subs: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}

    @property
    def after(self) -> torch.Tensor:
        """(b, 1): the valid tokens each sequence has counted once this call is (the next call's start)."""
        if self._after is None:
            self._after = self.vi[:, -1:] + 1
        return self._after

    def sub(self, s: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The null subsample: valid tokens whose index in their sequence is a multiple of s.

        Returns (flat, ok): flat (b*M,) int64, the flat (b*n) position of each row's j-th chosen
        token (M = ceil(n/s) slots a row: a row of n tokens holds at most that many), or None when
        s == 1 (every token: no gather); ok (b, M) bool, which slots hold a chosen token. Fixed
        shapes, made on the device without reading anything back.
        """
        if s not in self._subs:
            b, n = self.mask.shape
            if s == 1:
                self._subs[s] = (None, self.mask)
            else:
                M = -(-n // s)
                chosen = self.mask & (self.vi % s == 0)
                count = chosen.cumsum(1)  # (b, n): chosen tokens up to each position
                j = torch.arange(1, M + 1, device=count.device).expand(b, M).contiguous()
                col = torch.searchsorted(count, j)  # (b, M): the j-th chosen token's column, n if none
                ok = col < n
                flat = col.clamp_max(n - 1) + torch.arange(0, b * n, n, device=count.device)[:, None]
                self._subs[s] = (flat.reshape(-1), ok)
        return self._subs[s]

    @staticmethod
    def cat(grids: list[Grid]) -> Grid:
        """Calls side by side along the positions (buffered single-position forwards)."""
        return Grid(torch.cat([g.mask for g in grids], 1), torch.cat([g.vi for g in grids], 1))


def _split(B: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(d, 2C) [B_hi | B_lo] in ``dtype`` with B_hi + B_lo = B to ~16 bits (B (d, C) float32)."""
    hi = B.to(dtype)
    return torch.cat([hi, (B - hi.float()).to(dtype)], 1)


_OUT_DTYPE: dict[tuple, bool] = {}  # (device type, dtype) -> torch.mm(..., out_dtype=float32) works


def _has_out_dtype(device: torch.device, dtype: torch.dtype) -> bool:
    key = (device.type, dtype)
    if key not in _OUT_DTYPE:
        ok = device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
        if ok:
            try:  # the very calls _mm and _bmm make
                a = torch.zeros(2, 2, device=device, dtype=dtype)
                o = torch.empty(2, 2, device=device, dtype=torch.float32)
                torch.mm(a, a, out_dtype=torch.float32, out=o)
                ok = o.dtype == torch.float32 and torch.bmm(a[None], a[None], out_dtype=torch.float32).dtype == o.dtype
            except (RuntimeError, TypeError, NotImplementedError):
                ok = False
        _OUT_DTYPE[key] = ok
    return _OUT_DTYPE[key]


def _mm(X: torch.Tensor, B: torch.Tensor, out: torch.Tensor) -> None:
    """out (float32) = X @ B: B is (d, C) float32, or (d, 2C) [B_hi | B_lo] in X's half dtype, whose two
    halves of out the stacked reduction adds (one op for every layer, not one per matmul)."""
    if B.dtype == torch.float32:
        torch.mm(X if X.dtype == torch.float32 else X.float(), B, out=out)
        return
    try:
        torch.mm(X, B, out_dtype=torch.float32, out=out)
    except (RuntimeError, TypeError):  # a layout the half path refuses: float32, the same numbers to ~2^-16
        torch.mm(X.float(), B.float(), out=out)


def _norms(X: torch.Tensor, out: torch.Tensor) -> None:
    """out = ||x|| for each row of X, accumulated in float32 (no float32 copy of a half X)."""
    if X.dtype in (torch.float16, torch.bfloat16, torch.float32):
        torch.linalg.vector_norm(X, dim=-1, dtype=torch.float32, out=out)
    else:  # float64 and others: their float32 values, as every other statistic sees them
        torch.linalg.vector_norm(X.float(), dim=-1, out=out)


class LayerReducer:
    """One layer's bases (targets, F's eigen-subspaces, Haar and F-null frames) and its projection.

    The targets are projected on every token. The nulls are projected on a subsample: the valid
    tokens whose index in their own sequence is a multiple of ``null_stride`` (``Grid.sub``), a
    fixed rate (so every forward weighs by its size, and the nulls cost a fixed share of the
    model's work) that does not depend on how sequences are batched. The targets' own
    alignments on the same tokens are kept beside them, so p_null, the percentiles and eig_rank
    compare like with like (a target and a draw are exchangeable under the null). Float32 sums
    on the activations' device.

    Args:
        targets: the layer's targets.
        haar: (K, d, k_max) Haar frames. fnull: {key: (Kf, d, k_max)} F-null frames.
        null_stride: the subsample takes every s-th token (1 or None: every token).
        m: eigen-slots per target (at least the longest ``eig``): layers whose spectra give fewer
            subspaces (a complex pair cut at the m-th) keep the rest NaN and stack with the others.
    """

    def __init__(
        self,
        targets: list[TargetSpec],
        haar: torch.Tensor,
        fnull: dict[str, torch.Tensor],
        null_stride: int | None = None,
        m: int = 0,
    ):
        self.targets = targets
        self.T = len(targets)
        self.K, self.d, self.k_max = haar.shape
        self.null_stride = null_stride or 1
        self.ks = sorted({t.k for t in targets})  # every k <= k_max: the frames are k_max wide
        self.k_index = [self.ks.index(t.k) for t in targets]
        self.m = max([len(t.eig) for t in targets] + [m if any(t.eig for t in targets) else 0])
        self.fkeys = sorted(fnull)
        self.Kf = next(iter(fnull.values())).shape[0] if fnull else 0
        self.t_slices, at = [], 0
        for t in targets:
            self.t_slices.append(slice(at, at + t.k))
            at += t.k
        self.Bt64 = torch.cat([t.U for t in targets], 1)  # (d, target columns)
        # the layout of the group this layer is reduced with (``pad_group``); its own until then
        self.g_slices, self.g_ks = list(self.t_slices), list(self.ks)
        self.g_fks = sorted({t.k for t in targets if t.fnull is not None})
        eig_cols, seg = self._eig_columns(targets)
        self._haar, self._fnull = haar, fnull
        self._build_null(eig_cols, seg, sum(E.shape[1] for E in eig_cols))
        self.eig_valid = torch.zeros(self.T, max(self.m, 1), dtype=torch.bool)
        for ti, t in enumerate(targets):
            self.eig_valid[ti, : len(t.eig)] = True
        self.cos_targets = [ti for ti, t in enumerate(targets) if t.v1 is not None]
        self.fnull_targets = [(ti, t.fnull, t.k) for ti, t in enumerate(targets) if t.fnull is not None]
        self.arena: Arena | None = None  # set by pad_to_stack: the group's buffers, this layer's row in them
        self.row = 0
        self._group_consts: dict = {}  # _group_constants' cache, when this reducer is its group's first

    def _eig_columns(self, targets) -> tuple[list[torch.Tensor], list[list[int]]]:
        """F's eigen-subspaces over all targets, each projected once; seg: the (target, j) slots it fills."""
        cols: list[torch.Tensor] = []
        seg: list[list[int]] = []
        for ti, t in enumerate(targets):
            for j, E in enumerate(t.eig):
                hit = next((c for c, C in enumerate(cols) if C.shape == E.shape and torch.equal(C, E)), None)
                if hit is None:
                    cols.append(E)
                    seg.append([])
                    hit = len(cols) - 1
                seg[hit].append(ti * self.m + j)
        return cols, seg

    def _build_null(self, eig_cols, seg, width: int) -> None:
        """Bn64 (d, null columns) = [eig columns, zero padding to ``width`` | Haar | F-null]; S_eig."""
        S = torch.zeros(width, max(self.T * self.m, 1), dtype=torch.float64)
        at = 0
        for E, owners in zip(eig_cols, seg):
            S[at : at + E.shape[1], owners] = 1.0
            at += E.shape[1]
        self.S_eig = S
        cols = list(eig_cols) + [torch.zeros(self.d, width - at, dtype=torch.float64)]
        self.haar_start = width
        kw = self.frame_width
        cols.append(self._haar.permute(1, 0, 2).reshape(self.d, self.K * kw))  # column j*kw + i
        self.f_start = {}
        for key in self.fkeys:
            self.f_start[key] = sum(c.shape[1] for c in cols)
            cols.append(self._fnull[key].permute(1, 0, 2).reshape(self.d, self.Kf * kw))
        self.Bn64 = torch.cat(cols, 1)
        self._eig_cols, self._seg = eig_cols, seg
        self._dev: dict = {}

    def pad_group(self, widths: list[int], k_max: int, eig_width: int, ks: list[int], fks: list[int]) -> None:
        """Lay this layer out like the rest of its group, so that they stack: each target's columns
        zero-padded to ``widths``, the Haar and F-null frames to ``k_max`` columns, the eigen-columns
        to ``eig_width``; the prefix norms taken at the group's ``ks`` (``fks`` for the F-null frames).
        A zero column changes no norm, so every number of this layer stays what it was; the stacked
        reduction reads each layer's own k, cosines and F-null k back out (``_Stacked``)."""
        pad = lambda t, w: torch.nn.functional.pad(t, (0, w - t.shape[-1]))  # noqa: E731  zero columns on the right
        self.Bt64 = torch.cat([pad(t.U, w) for t, w in zip(self.targets, widths)], 1)
        self.g_slices, at = [], 0
        for w in widths:
            self.g_slices.append(slice(at, at + w))
            at += w
        self.g_ks, self.g_fks = list(ks), list(fks)
        self._haar = pad(self._haar, k_max)
        self._fnull = {key: pad(f, k_max) for key, f in self._fnull.items()}
        self._build_null(self._eig_cols, self._seg, max(eig_width, self.haar_start) if self.m else self.haar_start)

    @property
    def frame_width(self) -> int:
        """Columns per Haar and F-null frame in ``Bn64``: k_max, or its group's when padded (``pad_group``)."""
        return self._haar.shape[2]

    @property
    def kind(self) -> tuple:
        """What layers must share to be padded into one group (``pad_to_stack``)."""
        return (
            self.T,
            self.d,
            self.K,
            self.Kf,
            tuple(self.fkeys),
            self.m,
            tuple((ti, f) for ti, f, _ in self.fnull_targets),
        )

    @property
    def layout(self) -> tuple:
        """Everything the stacked reduction needs to be the same across layers."""
        return (
            self.kind, tuple((g.start, g.stop) for g in self.g_slices), self.frame_width, tuple(self.g_ks),
            tuple(self.g_fks), self.haar_start, self.Bn64.shape[1],
        )  # fmt: skip

    def _on(self, device: torch.device, dtype: torch.dtype):
        """(Bt, Bn) for activations of this device and dtype, made once: float32 (d, C), or
        [B_hi | B_lo] (d, 2C) in the activations' half dtype on CUDA."""
        key = (device, dtype if _has_out_dtype(device, dtype) else torch.float32)
        if key not in self._dev:
            f = lambda t: t.to(device, torch.float32)  # noqa: E731
            # (C, d) row-major, used as B.T: X @ B with a skinny row-major B is ~6x slower in MKL's GEMM
            Bt, Bn = f(self.Bt64.T).contiguous().T, f(self.Bn64.T).contiguous().T  # (d, C) views
            if key[1] != torch.float32:
                Bt, Bn = _split(Bt, key[1]), _split(Bn, key[1])
            self._dev[key] = (Bt, Bn)
        return self._dev[key]

    def project(
        self,
        points: dict,
        mask: torch.Tensor | Grid,
        base: torch.Tensor | None = None,
        consensus: bool = True,
        memo: dict | None = None,
    ):
        """Stage 1, in the hook: per reading point the projections, norms and consensus sums.

        Args:
            points: {'pre': (b, n, d), 'mid': (b, n, d) or None, 'post': ... or None}.
            mask: (b, n) bool, the valid (non-padding) tokens, or a ``Grid`` (the mask and each
                token's index in its sequence, which chooses the null subsample).
            base: post-norm only: LN_t(pre) (b, n, d), the baseline delta is measured from.
            consensus: sum the within-sequence consensus (off for buffered single steps).
            memo: one forward's record of the norms and consensus sums already taken, by reading:
                layer t's 'post' is layer t+1's 'pre', the very same tensor on the same tokens, so
                its norms and its sum of unit vectors are computed once (``_Memo``).

        Returns:
            a dict for ``reduce_many``: 'grid', 'norms' (P, b, n) the points' ||x||, 'Pt'
            (P, b, n, target columns), 'Pn' (P_null * N, null columns: the null points'
            subsamples, N = b * M tokens each, in order) and, with consensus, 'sv' (P_c, b, d):
            each sequence's sum of unit vectors over its valid tokens (NaN if one is non-finite
            there). The big ones are written into this layer's row of its group's ``Arena``.
        """
        grid = mask if isinstance(mask, Grid) else Grid(mask)
        pre = points["pre"]
        Bt, Bn = self._on(pre.device, pre.dtype)
        b, n = pre.shape[:2]
        names = [p for p in ("pre", "mid", "post") if points.get(p) is not None]
        X3 = [points[p] for p in names]  # (b, n, d) each, in the model's dtype
        if base is not None:
            names.append("base")
            X3.append(base)
        Xs = [X.reshape(b * n, -1) for X in X3]
        s = self.null_stride
        flat, ok = grid.sub(s)
        N = ok.numel()
        nulls = [X for p, X in zip(names, Xs) if p != "post"]
        cons = [X for p, X in zip(names, X3) if consensus and p != "base"]
        h = 1 if Bt.dtype == torch.float32 else 2  # halves (hi, lo) of each product, added in reduce_many
        shapes = {"norms": (len(Xs), b * n), "Pt": (len(Xs), b * n, Bt.shape[-1]), "Pn": (len(nulls) * N, Bn.shape[-1])}
        if cons and h == 1:  # float32: the bmm writes into the arena (halves: see below)
            shapes["sv"] = (len(cons), b, h, self.d)
        key = (b, n, tuple(names), consensus, Bt.dtype, pre.device)  # the device last: _Row reads it
        slot = self.arena.take(self.row, key) if self.arena is not None else None
        if slot:
            out, parts = slot.buffers(shapes, N)
        else:
            out = {k: pre.new_empty(v, dtype=torch.float32) for k, v in shapes.items()}
            parts = _parts(out, N)
        memo = _Memo(memo, grid)
        for X, X0, o in zip(Xs, X3, parts["norms"]):
            got = memo.get(X0, "norms")
            if got is None:
                _norms(X, o)
                memo.put(X0, "norms", o)
            else:  # a small copy instead of reading X again
                o.copy_(got)
        for X, o in zip(nulls, parts["Pn"]):  # the subsample's rows, gathered (all rows when s == 1)
            _mm(X if flat is None else X.index_select(0, flat), Bn, o)
        for X, o in zip(Xs, parts["Pt"]):
            _mm(X, Bt, o)
        sv_parts = None
        if cons:  # weights 1/||x|| on the valid tokens; a non-finite reading makes its sequence's sum NaN,
            # and reduce_many leaves out every sequence with a non-finite valid token
            w = grid.mask.reshape(1, b * n) / out["norms"][: len(cons)].clamp_min(1e-30)
            w = w.view(len(cons), b, 1, n)
            if h == 1:
                for wj, X, o in zip(w.unbind(0), cons, parts["sv"]):
                    got = memo.get(X, "sv")
                    if got is None:
                        _bmm(wj, X, o)
                        memo.put(X, "sv", o)
                    else:
                        o.copy_(got)
            else:  # [w_hi; w_lo] in the activations' dtype, for all points at once (P_c, b, 2, n): two ops,
                wh = pre.new_empty(len(cons), b, 2, n)  # the low half w - w_hi rounded once, as (w - hi).to()
                wh[:, :, :1].copy_(w)
                torch.sub(w, wh[:, :, :1], out=wh[:, :, 1:])
                # kept as they come (no copy into the arena): the stacked reduction stacks them in one op
                sv_parts = []
                for wj, X in zip(wh.unbind(0), cons):
                    got = memo.get(X, "sv")
                    if got is None:
                        got = _bmm_half(wj, X)
                        memo.put(X, "sv", got)
                    sv_parts.append(got)  # the same tensor, stacked twice: no op at all
        return dict(
            out, grid=grid, names=tuple(names), shape=(b, n, s), consensus=consensus, slot=slot, halves=h,
            sv_parts=sv_parts,
        )  # fmt: skip

    def __call__(self, points, mask, base=None, consensus: bool = True):
        """Both stages for this layer alone: (state sums like ``zero_state``, rows (b, 5, T))."""
        return reduce_many([(self, self.project(points, mask, base, consensus))])[0]


class _Memo:
    """A forward's norms and consensus sums by reading (``project``'s ``memo``), for one Grid.

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


def _bmm(w: torch.Tensor, X: torch.Tensor, out: torch.Tensor) -> None:
    """out (b, 1, d) float32 = w (b, 1, n) float32 @ X (b, n, d)."""
    torch.bmm(w, X if X.dtype == torch.float32 else X.float(), out=out)


def _bmm_half(w: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """(b, 2, d) float32 = [w_hi; w_lo] (b, 2, n) @ X (b, n, d), both in X's half dtype."""
    try:  # no out=: bmm with both out= and out_dtype fell back to the float32 copy on an H200
        return torch.bmm(w, X, out_dtype=torch.float32)
    except (RuntimeError, TypeError):
        return torch.bmm(w.float(), X.float())


def pad_to_stack(reducers: list[LayerReducer], widen_frames: bool = False) -> list[Arena]:
    """Pad reducers of one kind to one layout (``LayerReducer.pad_group``: layers whose targets are
    1- or 2-dimensional, real or complex top eigenvectors, stack together); give each kind one
    ``Arena``, in which the i-th reducer (in the order given) projects into row i.

    widen_frames: also pad the Haar and F-null frames of layers whose widest target is 1-dimensional
    to the group's 2 columns, so that every layer stacks in one group. That doubles those layers'
    null projections and halves the stacked reductions: worth it on CUDA, where a monitored forward
    is bound by the ops the host launches (one group's reduction is ~100 of them) and a null matmul
    is microseconds; not on the CPU, where the matmuls are the cost (SmolLM2 4x128: the monitor's
    own time 46 ms with frames kept, 57 ms widened).

    Returns the arenas (one per kind)."""
    kinds: dict[tuple, list[LayerReducer]] = {}
    for r in reducers:
        kinds.setdefault(r.kind if widen_frames else (*r.kind, r.k_max), []).append(r)
    arenas = []
    for rs in kinds.values():
        widths = [max(r.targets[ti].k for r in rs) for ti in range(rs[0].T)]
        k_max = max(r.k_max for r in rs)
        ks = sorted({k for r in rs for k in r.ks})
        fks = sorted({k for r in rs for k in r.g_fks})
        eig_width = max(r.haar_start for r in rs)
        arena = Arena(len(rs))
        arena.reds = rs
        for i, r in enumerate(rs):
            if len(rs) > 1:
                r.pad_group(widths, k_max, eig_width, ks, fks)
            r.arena, r.row = arena, i
        arenas.append(arena)
    return arenas


class Arena:
    """Buffers (G, ...) that the G layers of one layout group project a forward into, one row each.

    The stacked reduction reads them in place instead of copying the layers' projections
    together (for SmolLM2 that copy was a third of it). A row is taken by ``project`` and
    given back by ``reduce_many``; one taken twice before that (a layer run twice in one
    forward) is not shared: the second projection gets tensors of its own. Buffers are kept
    for the next forward of the same shapes; those of other shapes are dropped once no row
    of theirs is taken, so memory follows the latest forward.
    """

    def __init__(self, size: int):
        self.size = size
        self.reds: list[LayerReducer] = []  # its reducers, in row order
        self.bufs: dict[tuple, dict[str, torch.Tensor]] = {}
        self.views: dict[tuple, dict[int, tuple]] = {}  # key -> row -> (its row of bufs, per-point views)
        self.taken: set[tuple] = set()

    def take(self, row: int, key: tuple) -> _Row | None:
        if (row, key) in self.taken:
            return None
        if key not in self.bufs:
            busy = {k for _, k in self.taken}
            self.bufs = {k: v for k, v in self.bufs.items() if k in busy}
            self.views = {k: v for k, v in self.views.items() if k in busy}
        self.taken.add((row, key))
        return _Row(self, row, key)

    def release(self) -> None:
        """Every row is free again (a forward that raised leaves rows taken)."""
        self.taken.clear()


def _parts(out: dict[str, torch.Tensor], N: int) -> dict[str, tuple]:
    """Per point, the views of one layer's outputs that ``project`` writes into."""
    parts = {k: out[k].unbind(0) for k in ("norms", "Pt")}
    parts["Pn"] = out["Pn"].split(N)
    parts["sv"] = out["sv"].unbind(0) if "sv" in out else ()
    return parts


class _Row:
    """One layer's row of an Arena, for one key (shapes, points, device)."""

    def __init__(self, arena: Arena, row: int, key: tuple):
        self.arena, self.row, self.key = arena, row, key

    def buffers(self, shapes: dict[str, tuple], N: int) -> tuple[dict[str, torch.Tensor], dict[str, tuple]]:
        """This row of the buffers, and its per-point views (made once per key: the next forward of
        the same shapes writes into the same views)."""
        bufs = self.arena.bufs.setdefault(self.key, {})
        views = self.arena.views.setdefault(self.key, {})
        for name, shape in shapes.items():
            if name not in bufs or bufs[name].shape[1:] != shape:
                bufs[name] = torch.empty((self.arena.size, *shape), dtype=torch.float32, device=self.key[-1])
                views.clear()
        if self.row not in views:
            out = {name: bufs[name][self.row] for name in shapes}
            views[self.row] = (out, _parts(out, N))
        return views[self.row]

    def give_back(self) -> None:
        self.arena.taken.discard((self.row, self.key))


def reduce_many(items: list[tuple[LayerReducer, dict]]) -> list[tuple[dict, torch.Tensor]]:
    """Stage 2: ``(reducer, projection)`` pairs to ``(sums, rows)``, in the same order.

    Pairs of the same layout, shapes, points and device are stacked and reduced together;
    the rows of an Arena they were projected into are given back.
    """
    groups: dict[tuple, list[int]] = {}
    for i, (red, pr) in enumerate(items):
        key = (red.layout, pr["shape"], pr["names"], pr["consensus"], pr["halves"], pr["grid"].mask.device)
        groups.setdefault(key, []).append(i)
    out: list = [None] * len(items)
    for idx in groups.values():
        if all(items[i][1]["slot"] for i in idx):  # in row order: the stack may be the arena's own buffers
            idx = sorted(idx, key=lambda i: items[i][1]["slot"].row)
        for i, res in zip(idx, _Stacked([items[i] for i in idx]).run()):
            out[i] = res
    for _, pr in items:
        if pr["slot"] is not None:
            pr["slot"].give_back()
    return out


def warm(arenas: list[Arena], where: dict[int, tuple[torch.device, torch.dtype]]) -> None:
    """Make the device constants before the first forward: each reducer's bases on its layer's device
    in its activations' dtype, and each arena's stacked eigen-slot constants. {id(reducer): (device,
    dtype)}, as the model's weights suggest; a forward on another device or dtype makes its own."""
    for arena in arenas:
        for r in arena.reds:
            if id(r) in where:
                r._on(*where[id(r)])
        devs = {where[id(r)][0] for r in arena.reds if id(r) in where}
        if arena.reds and len(devs) == 1 and len(where) and all(id(r) in where for r in arena.reds):
            _group_constants(arena.reds, devs.pop())


def _picks(reds: list[LayerReducer]) -> dict[str, list]:
    """What each layer of a padded group reads back as its own, per layer: the index of each target's
    k among the group's ks ('k'), of each F-null target's k among its fks ('f'), which targets have
    a cosine with v_1 ('cos', 0/1 per target), and the rows of the group's ks that are its own ('own')."""
    return {
        "k": [[r.g_ks.index(t.k) for t in r.targets] for r in reds],
        "f": [[r.g_fks.index(k) for _, _, k in r.fnull_targets] for r in reds],
        "cos": [[float(ti in r.cos_targets) for ti in range(r.T)] for r in reds],
        "own": [[r.g_ks.index(k) for k in r.ks] for r in reds],
    }


def _group_key(reds: list[LayerReducer], dev: torch.device) -> tuple:
    return (tuple(id(r) for r in reds), tuple(id(r.S_eig) for r in reds), tuple(id(r.eig_valid) for r in reds), dev)


def _group_constants(reds: list[LayerReducer], dev: torch.device) -> dict[str, torch.Tensor]:
    """The device constants of a stacked group on dev, made once and kept by its first reducer (so
    they go with the monitor): 'S' (L, eig columns, T*m) float32 and 'valid' (L, T, m) when there are
    eigen-slots; and, where the layers' own k differ, one-hot pickers 'k_hot' (L, n_k, T) float64 and
    'f_hot' (L, n_fk, F-null targets) float32, and 'cos' (L, 1, T), 1 where a target has a cosine with v_1.
    Keyed by the very S_eig and eig_valid tensors, which the entry holds (their ids stay theirs): a
    pad_group rebuilds S_eig, and so misses."""
    cache = reds[0]._group_consts
    key = _group_key(reds, dev)
    if key not in cache:
        c: dict[str, torch.Tensor] = {}
        if reds[0].m:
            c["S"] = torch.stack([r.S_eig for r in reds]).to(dev, torch.float32)
            c["valid"] = torch.stack([r.eig_valid for r in reds]).to(dev)
        picks = _picks(reds)
        hot = lambda idx, n, dt: torch.nn.functional.one_hot(torch.tensor(idx), n).transpose(1, 2).to(dev, dt)  # noqa: E731
        if len({tuple(k) for k in picks["k"]}) > 1:  # picks the float64 per-row means
            c["k_hot"] = hot(picks["k"], len(reds[0].g_ks), torch.float64)
        if picks["f"][0] and len({tuple(f) for f in picks["f"]}) > 1:  # picks float32 counts
            c["f_hot"] = hot(picks["f"], len(reds[0].g_fks), torch.float32)
        if len({tuple(x) for x in picks["cos"]}) > 1:
            c["cos"] = torch.tensor(picks["cos"], dtype=torch.float32)[:, None].to(dev)
        cache[key] = (c, [(r.S_eig, r.eig_valid) for r in reds], picks)
    return cache[key][0]


def _group_picks(reds: list[LayerReducer], dev: torch.device) -> dict[str, list]:
    """``_picks`` of a group, made with its constants (once, not per forward)."""
    _group_constants(reds, dev)
    key = _group_key(reds, dev)
    return reds[0]._group_consts[key][2]


def _prefix_norms(H: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """(..., len(ks)): the norm of each frame's first k columns for k in ks, H (..., k_max).

    Running sums of squares, one add per column: a cumsum over a last axis this short ran
    at a few GB/s on CUDA (half of a monitored forward's GPU time, measured on an H200).
    """
    if ks == [1]:
        return H[..., :1].abs()
    sq = H * H
    acc, outs = sq[..., 0], []
    for j in range(max(ks)):
        if j:
            acc = acc + sq[..., j]
        if j + 1 in ks:
            outs.append(acc)
    return torch.stack(outs, -1).sqrt()


class _Stacked:
    """The stacked reduction of L layers of one layout: every tensor has a leading L."""

    def __init__(self, items: list[tuple[LayerReducer, dict]]):
        self.red = items[0][0]  # the layout's representative (shared fields only)
        self.reds = [r for r, _ in items]
        prs = [p for _, p in items]
        self.L = len(items)
        self.b, self.n, self.s = prs[0]["shape"]
        self.consensus = prs[0]["consensus"]
        self.pts = list(prs[0]["names"])
        whole = self._whole(prs)
        stack = lambda k: whole[k] if whole else torch.stack([pr[k] for pr in prs])  # noqa: E731
        g0 = prs[0]["grid"]
        same = all(pr["grid"] is g0 for pr in prs)  # the layers of a forward share one grid
        m0 = g0.mask.bool()
        self.mask = m0.expand(self.L, *m0.shape) if same else torch.stack([pr["grid"].mask for pr in prs]).bool()
        # the null subsample: flat (b*M,) positions and ok (b, M); the same for every layer stacked here
        # (it depends only on the mask and the tokens' indices in their sequences)
        if same:
            self.flat, self.ok = g0.sub(self.s)
        else:  # layers with grids of their own (buffered steps flushed per layer): (L, b*M), (L, b, M)
            subs = [pr["grid"].sub(self.s) for pr in prs]
            self.flat = None if subs[0][0] is None else torch.stack([f for f, _ in subs])
            self.ok = torch.stack([o for _, o in subs])
        self.M = self.ok.shape[-1]
        self.okf = self.ok.reshape(1 if same else self.L, self.b * self.M)  # (1 or L, N)
        norms = stack("norms").view(self.L, len(self.pts), self.b, self.n)
        self.finite = (norms < float("inf")).all(1)  # a norm is >= 0, inf or NaN: finite iff < inf
        self.m = self.mask & self.finite
        self.bad = self.mask & ~self.finite  # valid tokens with a non-finite reading at some point
        self.dev = self.m.device
        self.inv = torch.where(self.m[:, None], norms.clamp_min(1e-30), float("inf")).reciprocal()  # (L, P, b, n)
        h = prs[0]["halves"]
        fold = (lambda t: t) if h == 1 else (lambda t: torch.add(*t.chunk(2, -1)))  # noqa: E731  hi + lo products
        self.Pn = fold(stack("Pn"))  # (L, P_null * N, C)
        self.Pt = fold(stack("Pt")).view(self.L, len(self.pts), self.b, self.n, -1)  # (L, P, b, n, target columns)
        self.sv = None  # (L, P_c, b, d): the sums of unit vectors at the points other than 'base', in order
        if prs[0]["sv_parts"] is not None:  # half path: (L * P_c) results of (b, 2, d), stacked in one op
            sv = torch.stack([t for pr in prs for t in pr["sv_parts"]]).view(self.L, -1, self.b, 2, self.red.d)
            self.sv = sv.sum(-2)  # hi + lo
        elif "sv" in prs[0]:
            self.sv = stack("sv")[..., 0, :]
        # (L, eig columns, T*m): which eigen-columns make each (target, j); (L, T, m) valid; the pickers
        self.consts = _group_constants(self.reds, self.dev)
        self.S, self.eig_valid = self.consts.get("S"), self.consts.get("valid")
        self.picks = _group_picks(self.reds, self.dev)

    def _whole(self, prs) -> dict | None:
        """The arena's buffers, when these projections are its rows 0..G-1 in order (no copy needed)."""
        rows = [pr["slot"] for pr in prs]
        if not all(rows) or [r.row for r in rows] != list(range(rows[0].arena.size)):
            return None
        if len({(id(r.arena), r.key) for r in rows}) != 1:
            return None
        return rows[0].arena.bufs[rows[0].key]

    def sub(self, t: torch.Tensor) -> torch.Tensor:
        """(L, b, n, ...) -> (L, N, ...): the null's tokens (N = b*M), zero (False) in empty slots."""
        t = t.reshape(self.L, self.b * self.n, *t.shape[3:])
        if self.flat is not None and self.flat.dim() == 1:
            t = t.index_select(1, self.flat)
        elif self.flat is not None:  # layers whose grids are not one object: each its own positions
            t = t.gather(1, self.flat.view(self.L, -1, *([1] * (t.dim() - 2))).expand(-1, -1, *t.shape[2:]))
        ok = self.okf.view(*self.okf.shape, *([1] * (t.dim() - 2)))
        return t & ok if t.dtype == torch.bool else torch.where(ok, t, 0.0)

    def sub_points(self, t: torch.Tensor) -> torch.Tensor:
        """``sub`` for every reading point at once: (L, P, b, n, ...) -> (L, P, N, ...)."""
        if self.flat is not None and self.flat.dim() != 1:  # layers with grids of their own
            return torch.stack([self.sub(t[:, j]) for j in range(t.shape[1])], 1)
        t = t.reshape(self.L, t.shape[1], self.b * self.n, *t.shape[4:])
        if self.flat is not None:
            t = t.index_select(2, self.flat)
        ok = self.okf.view(self.okf.shape[0], 1, self.okf.shape[1], *([1] * (t.dim() - 3)))
        return t & ok if t.dtype == torch.bool else torch.where(ok, t, 0.0)

    def run(self) -> list[tuple[dict, torch.Tensor]]:
        A, Z = self._align()
        ms = self._ms
        L, T = self.L, self.red.T
        f32 = torch.float32  # sums of 0/1 straight in float32: exact below 2**24, as int64 then float was
        cols = {"n": self.m.sum((1, 2), dtype=f32)[:, None].expand(L, T)}
        cols["n_nonfinite"] = self.bad.sum((1, 2), dtype=f32)[:, None].expand(L, T)
        cols["n_pre_sub"] = ms.sum(1, dtype=f32)[:, None].expand(L, T)
        cols["sum_pre_sub"] = Z["pre"]["tgt"].sum(1)
        # every reading point at once: (L, P, T) sums of alignments and of cosines with v_1
        sums = self._tgt.sum((2, 3))
        zero = torch.zeros(L, len(self.pts), device=self.dev)
        cos = [zero] * T
        for ti in sorted({ti for r in self.reds for ti in r.cos_targets}):  # a unit target's cosine: its one
            cos[ti] = (self._Pt[..., self.red.g_slices[ti].start] * self.inv).sum((2, 3))  # column over ||x||
        cos = torch.stack(cos, -1)
        if "cos" in self.consts:  # layers where that target is 2-dimensional have no cosine: 0 there
            cos = cos * self.consts["cos"]
        for j, p in enumerate(self.pts):
            if p == "base":
                continue
            cols[f"sum_{p}"] = sums[:, j]
            if p != "pre":
                cols[f"n_{p}"] = cols["n"]
            cols[f"cos_sum_{p}"] = cos[:, j]
        st = {"null_pre": Z["pre"]["haar_sum"]}
        if "mid" in A:
            rows = self._mid_sums(A, Z, ms, cols, st)
        else:
            red = self.red
            rows = torch.zeros(L, self.b, len(_ROW), T, dtype=torch.float64, device=self.dev)
            st["null_up"] = st["null_mid"] = torch.zeros(L, len(red.g_ks), red.K, device=self.dev)
            st["eig_up"] = torch.zeros(L, T, red.m, device=self.dev)
            st["fnull_up"] = torch.zeros(L, T, red.Kf, device=self.dev)
        if self.consensus:
            self._consensus(A, cols)
        zero = torch.zeros(L, T, device=self.dev)
        st["tgt"] = torch.stack([cols.get(f, zero) for f in TGT_FIELDS], -1)  # (L, T, F)
        per = {k: v.double().unbind(0) for k, v in st.items()}  # one op per field, not one per layer
        return [({k: self._own(k, i, v[i]) for k, v in per.items()}, r) for i, r in enumerate(rows.unbind(0))]

    def _own(self, field: str, i: int, v: torch.Tensor) -> torch.Tensor:
        """Layer i's own rows of a per-k field (the group's ks may hold more than its own)."""
        own = self.picks["own"][i]
        if not field.startswith("null_") or own == list(range(v.shape[0])):
            return v
        if own == list(range(own[0], own[0] + len(own))):
            return v[own[0] : own[0] + len(own)]
        return torch.stack([v[j] for j in own])

    def _align(self):
        """Alignments: targets on every token (L, b, n, T); nulls on the subsample (L, N, ...)."""
        red, L = self.red, self.L
        m = self.m
        ms = self._ms = self.sub(m)  # (L, N): the null's tokens
        Pt = torch.where(m[:, None, ..., None], self.Pt, 0.0)  # (L, P, b, n, C); where() drops NaN rows
        tgt = torch.stack([torch.linalg.vector_norm(Pt[..., s], dim=-1) for s in red.g_slices], -1)
        tgt = tgt * self.inv[..., None]  # (L, P, b, n, T)
        self._tgt, self._Pt = tgt, Pt
        A = {p: {"tgt": tgt[:, j], "inv": self.inv[:, j], "P": Pt[:, j]} for j, p in enumerate(self.pts)}
        nulls = [j for j, p in enumerate(self.pts) if p != "post"]
        N = ms.shape[1]
        # The null alignments are 0 off m (inv is 0) except on non-finite tokens, where they are NaN:
        # no token off m is ever "up", and the sums are nansums, so no where() over the big tensor is needed.
        inv_all = self.sub_points(self.inv)  # (L, P, N), 0 in empty slots
        inv_s = inv_all if len(nulls) == len(self.pts) else torch.stack([inv_all[:, j] for j in nulls], 1)
        tgt_s = self.sub_points(tgt)  # (L, P, N, T): the targets on the null's tokens
        Zall = self._null_align(self.Pn, inv_s.reshape(L, -1))  # every null point at once
        haar_sum = Zall["haar"].reshape(L, len(nulls), N, *Zall["haar"].shape[2:]).nansum(2)  # (L, P_null, n_k, K)
        Z = {}
        for i, j in enumerate(nulls):
            p = self.pts[j]
            Z[p] = {k: v[:, i * N : (i + 1) * N] for k, v in Zall.items()}
            Z[p]["tgt"] = tgt_s[:, j]
            Z[p]["haar_sum"] = haar_sum[:, i]
        return A, Z

    def _null_align(self, P: torch.Tensor, inv: torch.Tensor) -> dict[str, torch.Tensor]:
        """Null alignments from the subsample's projections P (L, N, C) and 1/||x|| (L, N)."""
        red = self.red
        L, N = P.shape[:2]
        out = {}
        if red.m:
            E = P[..., : red.haar_start]
            out["eig"] = torch.sqrt(torch.bmm(E * E, self.S)) * inv[..., None]  # (L, N, T*m)
        kw = red.frame_width
        H = P[..., red.haar_start : red.haar_start + red.K * kw].reshape(L, N, red.K, kw)
        cum = _prefix_norms(H, red.g_ks).transpose(2, 3)  # (L, N, n_k, K) at the group's ks
        out["haar"] = cum * inv[..., None, None]  # (L, N, n_k, K)
        for key in red.fkeys:
            s = red.f_start[key]
            Fp = P[..., s : s + red.Kf * kw].reshape(L, N, red.Kf, kw)
            out["f:" + key] = _prefix_norms(Fp, red.g_fks) * inv[..., None, None]  # (L, N, Kf, len(fks))
        return out

    def _mid_sums(self, A, Z, ms, cols, st) -> torch.Tensor:
        """Up-counts of mid against its baseline: targets on every token, nulls on the subsample; rows."""
        red, L, dev = self.red, self.L, self.dev
        # off m both alignments are 0 (inv is 0), or NaN on a non-finite token: never "up", no mask needed
        up = lambda a, b: (a - b) > GROWTH_EPS  # noqa: E731
        ref, zref = (A["base"], Z["base"]) if "base" in A else (A["pre"], Z["pre"])
        mid, zmid = A["mid"], Z["mid"]
        u_t = up(mid["tgt"], ref["tgt"])  # (L, b, n, T)
        f32 = torch.float32
        cols["n_up"] = u_t.sum((1, 2), dtype=f32)
        cols["sum_delta"] = (mid["tgt"] - ref["tgt"]).sum((1, 2))
        if "base" in A:
            cols["n_norm_up"] = up(A["base"]["tgt"], A["pre"]["tgt"]).sum((1, 2), dtype=f32)
        msf = ms.float()
        u_s = up(zmid["tgt"], zref["tgt"])  # (L, N, T): the targets on the null's tokens
        cols["n_sub"] = msf.sum(1)[:, None].expand(L, red.T)
        cols["n_up_sub"] = u_s.sum(1, dtype=f32)
        cols["sum_mid_sub"] = zmid["tgt"].sum(1)
        u_h = up(zmid["haar"], zref["haar"])  # (L, N, n_k, K)
        st["null_up"] = u_h.sum(1, dtype=f32)
        st["null_mid"] = zmid["haar_sum"]
        if red.m:
            e = up(zmid["eig"], zref["eig"]).sum(1, dtype=f32).reshape(L, red.T, red.m)
            st["eig_up"] = torch.where(self.eig_valid, e, float("nan"))
        else:
            st["eig_up"] = torch.zeros(L, red.T, 0, device=dev)
        st["fnull_up"] = torch.zeros(L, red.T, red.Kf, device=dev)
        f_hot, f0 = self.consts.get("f_hot"), self.picks["f"][0]
        for i, (ti, fkey, _) in enumerate(red.fnull_targets):
            key = "f:" + fkey
            if f_hot is None:  # every layer reads the same k: that column alone
                j = f0[i]
                st["fnull_up"][:, ti] = up(zmid[key][..., j], zref[key][..., j]).sum(1, dtype=f32)
            else:  # each layer its own k: up-counts at every k, each layer's picked by its one-hot
                ups = up(zmid[key], zref[key]).sum(1, dtype=f32)  # (L, Kf, n_fk)
                st["fnull_up"][:, ti] = (ups * f_hot[:, None, :, i]).sum(-1)
        # per-row counters for the cluster-robust intervals
        f64 = torch.float64
        per_row = lambda v: v.reshape(L, self.b, self.M, *v.shape[2:]).sum(2, dtype=f64)  # noqa: E731  (L, b, ...)
        rows = torch.zeros(L, self.b, len(_ROW), red.T, dtype=f64, device=dev)
        rows[:, :, 0, :] = self.m.sum(2, dtype=f64)[..., None]
        rows[:, :, 1, :] = u_t.sum(2, dtype=f64)
        rows[:, :, 2, :] = per_row(msf)[..., None]
        rows[:, :, 3, :] = per_row(u_s)
        ubar = per_row(u_h.sum(-1)) / red.K  # (L, b, n_k): mean over draws, per k
        k0 = self.picks["k"][0]
        if "k_hot" in self.consts:  # each layer its targets' own k
            rows[:, :, 4, :] = torch.bmm(ubar, self.consts["k_hot"])
        else:
            whole = k0 == list(range(ubar.shape[-1]))  # target ti reads the ti-th k, and there are T of them
            rows[:, :, 4, :] = ubar if whole else torch.stack([ubar[..., j] for j in k0], -1)
        return rows

    def _consensus(self, A, cols) -> None:
        """Within-sequence consensus: mean pairwise cosine of valid tokens, per reading point.

        A sequence with a valid token that is non-finite at any of the layer's reading points is
        left out at all of them (where that reading is non-finite its sum of unit vectors is NaN;
        elsewhere ``bad`` says so); so is one with fewer than 2 valid tokens.
        """
        n_s = self.m.sum(2, dtype=torch.float32)[:, None]  # (L, 1, b)
        clean = ~self.bad.any(2)[:, None]  # (L, 1, b)
        q = (self.sv * self.sv).sum(-1)  # (L, P_c, b): every point at once
        defined = (n_s >= 2) & torch.isfinite(q) & clean
        c = torch.where(defined, (q - n_s) / (n_s * (n_s - 1)).clamp_min(1), 0.0).sum(2)  # (L, P_c)
        T = self.red.T
        for j, p in enumerate(name for name in self.pts if name != "base"):
            cols[f"cons_sum_{p}"] = c[:, j, None].expand(self.L, T)
            if p == "pre":
                cols["n_seq"] = defined[:, j].sum(1, dtype=torch.float32)[:, None].expand(self.L, T)
