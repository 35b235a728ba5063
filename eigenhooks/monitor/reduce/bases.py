"""One layer's bases: its targets, F's eigen-subspaces, each null family's frames, as projection matrices.

``LayerBases`` lays a layer's bases out as two matrices, ``Bt64`` (d, target columns) and
``Bn64`` (d, null columns: each null measure's in turn, ``measures.NULL_COLUMNS``), and keeps them on
the activations' device (``on``). Layers of one kind are padded to one layout (``pad_group``)
so that their reductions stack; a zero column changes no norm, so no number moves.
"""

from __future__ import annotations

import torch

from ..measures import EIG, NULL_COLUMNS, registered
from ..measures.eig import eig_columns
from ..stats import TargetSpec
from .kernels import has_out_dtype, split


class LayerBases:
    """One layer's bases (targets, F's eigen-subspaces, the null families' frames).

    The targets are projected on every token. The nulls are projected on a subsample: the valid
    tokens whose index in their own sequence is a multiple of ``null_stride`` (``Grid.sub``), a
    fixed rate that does not depend on how sequences are batched. The targets' own alignments on
    the same tokens are kept beside them, so p_null, the percentiles and eig_rank compare like with like.

    The dimension k, by name: ``t.k`` a target's; ``ks`` the layer's distinct k (``n_k`` of them, a state's
    per-k rows), ``k_index`` each target's among them; ``group_ks`` the distinct k of its padded group, whose
    rows a group's reduction takes (``arena.picks``: the same indices among those, one-hot as 'k_hot');
    ``k_max`` the widest k, the columns its frames are drawn with; ``frame_width`` the columns a frame takes
    in ``Bn64`` (k_max, or its group's when widened).

    Args:
        targets: the layer's targets.
        frames: each null family's frames by its name (``Builtin.draw``: tensors (draws, d, k_max), alone or
            in a dict); a family with none at this layer is left out.
        null_stride: the subsample takes every null_stride-th token (1: every token; ``MonitorConfig.null_stride``).
        eig_slots: eigen-subspaces per target (at least the longest ``eig``): layers whose spectra give
            fewer (a complex pair cut at the last slot) keep the rest NaN and stack with the others.
        measures: what is measured here (default: the registered measures).
    """

    def __init__(
        self,
        targets: list[TargetSpec],
        frames: dict[str, object],
        null_stride: int = 1,
        eig_slots: int = 0,
        measures: tuple | None = None,
        layer: int | None = None,
    ):
        self.measures, self.layer = registered() if measures is None else tuple(measures), layer
        self.targets = targets
        self.T = len(targets)
        self.d, self.k_max = targets[0].U.shape[0], max(t.k for t in targets)
        self.frame_width = self.k_max
        self.null_stride = null_stride
        self.ks = sorted({t.k for t in targets})  # every k <= k_max: the frames are k_max wide
        self.k_index = [self.ks.index(t.k) for t in targets]
        self.eig_slots = max([len(t.eig) for t in targets] + [eig_slots if any(t.eig for t in targets) else 0])
        self.t_slices, at = [], 0
        for t in targets:
            self.t_slices.append(slice(at, at + t.k))
            at += t.k
        self.Bt64 = torch.cat([t.U for t in targets], 1)  # (d, target columns)
        # the layout of the group this layer is reduced with (``pad_group``); its own until then
        self.g_slices, self.group_ks = list(self.t_slices), list(self.ks)
        self.frames = dict(frames)
        self._eig_cols, self._seg = eig_columns(self)
        self._build_null(sum(E.shape[1] for E in self._eig_cols))
        self.eig_valid = torch.zeros(self.T, max(self.eig_slots, 1), dtype=torch.bool)
        for ti, t in enumerate(targets):
            self.eig_valid[ti, : len(t.eig)] = True
        self.cos_targets = [ti for ti, t in enumerate(targets) if t.v1 is not None]
        self.arena = None  # set by arena.pad_to_stack: the group's buffers, this layer's row in them
        self.row = 0
        self._group_consts: dict = {}  # arena.group_constants' cache, when this layer is its group's first

    def _build_null(self, width: int) -> None:
        """Bn64 (d, null columns): each null measure's columns in turn (``measures.NULL_COLUMNS``),
        the eigen-columns zero-padded to ``width``; ``cols``: each measure's (start, stop) there."""
        blocks, self.cols, at = [], {}, 0
        order = [m.name for m in NULL_COLUMNS]  # the built-in ones in their order, then a user's
        nulls = sorted(
            (m for m in self.measures if m.null), key=lambda m: order.index(m.name) if m.name in order else 9
        )
        for m in nulls:
            mine = m.columns(self, width)
            w = sum(c.shape[1] for c in mine)
            self.cols[m.name] = (at, at + w)
            blocks += mine
            at += w
        self.Bn64 = torch.cat(blocks, 1)
        self._dev: dict = {}

    def pad_group(self, widths: list[int], k_max: int, eig_width: int, ks: list[int]) -> None:
        """Lay this layer out like the rest of its group, so that they stack: each target's columns
        zero-padded to ``widths``, every null family's frames to ``k_max`` columns, the eigen-columns
        to ``eig_width``; the prefix norms taken at the group's ``ks``. A zero column changes no norm,
        so every number of this layer stays what it was; the stacked reduction reads each layer's own
        k and cosines back out (``stacked``)."""
        pad = lambda t, w: torch.nn.functional.pad(t, (0, w - t.shape[-1]))  # noqa: E731  zero columns on the right
        self.Bt64 = torch.cat([pad(t.U, w) for t, w in zip(self.targets, widths)], 1)
        self.g_slices, at = [], 0
        for w in widths:
            self.g_slices.append(slice(at, at + w))
            at += w
        self.group_ks = list(ks)
        widen = lambda f: {k: widen(v) for k, v in f.items()} if isinstance(f, dict) else pad(f, k_max)  # noqa: E731
        self.frames = {name: widen(f) for name, f in self.frames.items()}
        self.frame_width = k_max
        width = max(eig_width, self.eig_width) if self.eig_slots else self.eig_width
        self._build_null(width)
        if self.arena is not None:  # its group's device constants were made for the old layout
            self.arena.constants.clear()

    def drop_frames(self) -> None:
        """Forget what only projecting readings needs: the null families' frames (kept as shapes alone, on the
        meta device: the state's sizes are read from them), the null columns ``Bn64`` and their device copies
        (``Plan.drop_frames``), and the eigen-subspaces' distinct columns they were built from (shapes alone).
        The targets and their eigen-subspaces stay (the verdict of a sample brought here ranks among them)."""
        shape = lambda f: {k: shape(v) for k, v in f.items()} if isinstance(f, dict) else f.to("meta")  # noqa: E731
        self.frames = {name: shape(f) for name, f in self.frames.items()}
        self._eig_cols = [E.to("meta") for E in self._eig_cols]
        self.Bn64, self._dev, self.arena = None, {}, None

    @property
    def eig_width(self) -> int:
        """Columns of the eigen-subspaces (zero-padded) in ``Bn64``: where the other nulls start."""
        return self.cols[EIG.name][1]

    @property
    def kind(self) -> tuple:
        """What layers must share to be padded into one group (``arena.pad_to_stack``)."""
        return (
            self.T,
            self.d,
            self.eig_slots,
            tuple(m.name for m in self.measures),
            tuple(m.kind(self.frames[m.name], self) for m in self.measures if m.name in self.frames),
        )

    @property
    def layout(self) -> tuple:
        """Everything the stacked reduction needs to be the same across layers."""
        return (
            self.kind, tuple((g.start, g.stop) for g in self.g_slices), self.frame_width, tuple(self.group_ks),
            tuple(self.cols.items()), self.Bn64.shape[1],
        )  # fmt: skip

    def on(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(Bt, Bn) for activations of this device and dtype, made once: float32 (d, C), or
        [B_hi | B_lo] (d, 2C) in the activations' half dtype on CUDA."""
        key = self._key(device, dtype)
        if key not in self._dev:
            f = lambda t: t.to(device, torch.float32)  # noqa: E731
            # (C, d) row-major, used as B.T: X @ B with a skinny row-major B is slow in MKL (docs/scale.md)
            Bt, Bn = f(self.Bt64.T).contiguous().T, f(self.Bn64.T).contiguous().T  # (d, C) views
            if key[1] != torch.float32:
                Bt, Bn = split(Bt, key[1]), split(Bn, key[1])
            self._dev[key] = (Bt, Bn)
        return self._dev[key]

    def share(self, device: torch.device, dtype: torch.dtype, Bt: torch.Tensor, Bn: torch.Tensor) -> None:
        """Hold ``on``'s (Bt, Bn) as these views of the same values (a stack over layers, ``reduce.batched``)."""
        key = self._key(device, dtype)
        Bt0, Bn0 = self._dev[key]
        assert (Bt.shape, Bn.shape, Bt.dtype) == (Bt0.shape, Bn0.shape, Bt0.dtype)
        self._dev[key] = (Bt, Bn)

    @staticmethod
    def _key(device: torch.device, dtype: torch.dtype) -> tuple:
        return (device, dtype if has_out_dtype(device, dtype) else torch.float32)
