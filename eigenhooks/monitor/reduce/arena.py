"""Where a forward's projections are written: one ``Arena`` of buffers per group of layers that stack.

Layers of one kind are padded to one layout (``pad_to_stack``) and project into their own row of
their group's buffers, which the stacked reduction then reads in place, with no copy to stack
them. The group's device constants (eigen-slot sums, the one-hot pickers of each layer's own k)
are made once per device and kept by the arena (``group_constants``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .bases import LayerBases


class GroupConstants(NamedTuple):
    """A stacked group's constants on one device (``group_constants``)."""

    tensors: dict[str, torch.Tensor]  # 'S', 'valid', 'k_hot', 'fk_hot', 'cos' (where needed)
    picks: dict[str, list]  # ``picks``: what each layer reads back as its own


class Arena:
    """Buffers (G, ...) that the G layers of one layout group project a forward into, one row each.

    A row is taken by ``project`` and given back by ``reduce_many``; one taken twice before that
    (a layer run twice in one forward) is not shared: the second projection gets tensors of its
    own. Buffers are kept for the next forward of the same shapes; those of other shapes are
    dropped once no row of theirs is taken, so memory follows the latest forward.
    """

    def __init__(self, bases: list[LayerBases]):
        self.bases = bases  # in row order
        self.size = len(bases)
        self.bufs: dict[tuple, dict[str, torch.Tensor]] = {}
        self.views: dict[tuple, dict[int, tuple]] = {}  # key -> row -> (its row of bufs, per-point views)
        self.taken: set[tuple] = set()
        self.constants: dict[tuple, GroupConstants] = {}  # (rows, device) -> the group's constants there

    def take(self, row: int, key: tuple) -> ArenaRow | None:
        if (row, key) in self.taken:
            return None
        if key not in self.bufs:
            busy = {k for _, k in self.taken}
            self.bufs = {k: v for k, v in self.bufs.items() if k in busy}
            self.views = {k: v for k, v in self.views.items() if k in busy}
        self.taken.add((row, key))
        return ArenaRow(self, row, key)

    def release(self) -> None:
        """Every row is free again (a forward that raised leaves rows taken)."""
        self.taken.clear()


def parts(out: dict[str, torch.Tensor], N: int) -> dict[str, tuple]:
    """Per point, the views of one layer's outputs that ``project`` writes into."""
    views = {k: out[k].unbind(0) for k in ("norms", "Pt")}
    views["Pn"] = out["Pn"].split(N)
    views["sv"] = out["sv"].unbind(0) if "sv" in out else ()
    return views


class ArenaRow:
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
            views[self.row] = (out, parts(out, N))
        return views[self.row]

    def give_back(self) -> None:
        self.arena.taken.discard((self.row, self.key))


def pad_to_stack(bases: list[LayerBases], widen_frames: bool = False) -> list[Arena]:
    """Pad layers of one kind to one layout (``LayerBases.pad_group``: layers whose targets are 1- or
    2-dimensional, real or complex top eigenvectors, stack together); give each kind one ``Arena``, in
    which the i-th layer (in the order given) projects into row i.

    widen_frames: also pad the null families' frames of layers whose widest target is 1-dimensional
    to the group's 2 columns, so that every layer stacks in one group. That doubles those layers'
    null projections and halves the stacked reductions: worth it on CUDA, where a group's reduction
    is ~100 launches and a null matmul is microseconds; not on the CPU, where the matmuls are the
    cost (docs/scale.md, "Fewer ops").

    Returns the arenas (one per kind)."""
    kinds: dict[tuple, list[LayerBases]] = {}
    for r in bases:
        kinds.setdefault(r.kind if widen_frames else (*r.kind, r.k_max), []).append(r)
    arenas = []
    for rs in kinds.values():
        widths = [max(r.targets[ti].k for r in rs) for ti in range(rs[0].T)]
        k_max = max(r.k_max for r in rs)
        ks = sorted({k for r in rs for k in r.ks})
        eig_width = max(r.eig_width for r in rs)
        for r in rs:
            if len(rs) > 1:
                r.pad_group(widths, k_max, eig_width, ks)
        arena = Arena(rs)
        for i, r in enumerate(rs):
            r.arena, r.row = arena, i
        arenas.append(arena)
    return arenas


def warm(arenas: list[Arena], where: dict[LayerBases, tuple[torch.device, torch.dtype]]) -> None:
    """Make the device constants before the first forward: each layer's bases on its device in its
    activations' dtype (``where``, as the model's weights suggest), and each arena's stacked constants.
    A forward on another device or dtype makes its own."""
    for arena in arenas:
        places = [where.get(r) for r in arena.bases]
        for r, w in zip(arena.bases, places):
            if w is not None:
                r.on(*w)
        devs = {w[0] for w in places if w is not None}
        if len(devs) == 1 and all(w is not None for w in places):
            group_constants(arena.bases, devs.pop())


def picks(bases: list[LayerBases]) -> dict[str, list]:
    """What each layer of a padded group reads back as its own, per layer: the index of each target's
    k among the group's ks ('k_index', as ``LayerBases.k_index`` among its own), which targets have a cosine
    with v_1 ('cos', 0/1 per target), and the index of each of its own ks among the group's ('ks_index')."""
    return {
        "k_index": [[r.group_ks.index(t.k) for t in r.targets] for r in bases],
        "cos": [[float(ti in r.cos_targets) for ti in range(r.T)] for r in bases],
        "ks_index": [[r.group_ks.index(k) for k in r.ks] for r in bases],
    }


def group_constants(bases: list[LayerBases], dev: torch.device) -> GroupConstants:
    """The device constants of a stacked group on dev, made once and kept by its arena: each
    measure's (``Measure.constants``), e.g. 'S' (L, eig columns, T*eig_slots) float32 and 'valid'
    (L, T, eig_slots) when there are eigen-slots; and, where the layers' own k differ, one-hot
    pickers of each target's k, e.g. 'k_hot' (L, n_k, T) float64, and 'cos' (L, 1, T), 1 where a target has
    a cosine with v_1."""
    arena = bases[0].arena
    key = (tuple(r.row for r in bases), dev)
    if arena is not None and all(r.arena is arena for r in bases) and key in arena.constants:
        return arena.constants[key]
    own = picks(bases)
    c: dict[str, torch.Tensor] = {}
    for m in bases[0].measures:
        c.update(m.constants(bases, own, dev))
    out = GroupConstants(c, own)
    if arena is not None and all(r.arena is arena for r in bases):
        arena.constants[key] = out
    return out
