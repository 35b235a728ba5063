"""``Builtin``: what one built-in measure holds, and what the reduction engine asks of it.

This is the engine's own protocol, private: a researcher's measure is ``own.Measure`` (plain
per-layer tensors in, sums out), run beside the reduction by the ``own.Own`` adapter. The engine (``reduce/stacked.py``) knows no measure by name: it lays out each null measure's
columns in the layer's null matrix (``columns``), hands each its slice of the projections
(``align``), and asks each for its sums (``sums``, ``up``, ``no_mid``, ``finish``), its per-sequence
counters (``rows``) and its group constants (``constants``). A measure's state fields start at
``zero`` (one layer's ``Sizes``); its fingerprint keys are ``settings``; its running values at the
sinks' log points are ``scalars``.

A null family is such a measure, with the rest of what it needs named here too: its frames, drawn
per layer when the plan is built (``draw``, given a ``Draw``), what layers must share to be reduced
together (``kind``), its draws' count (``draws``, into ``Sizes.draws``), and its columns over the
whole table (``table``, then ``power``, given a ``Table``), with where they stand (``first``,
``last``). The plan, the reduction and the table iterate over the registry (``measures.register``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

POINTS = ("pre", "mid", "post")  # the reading points, in order (``config.POINTS``)


def row_at(field: str) -> int:
    """The index of a per-sequence counter in ``measures.ROW`` (every measure's ``row_fields``, in order)."""
    from . import ROW  # the package, loaded by the time a measure runs

    return ROW.index(field)


@dataclass(frozen=True)
class Sizes:
    """The sizes of one layer's state, as ``Measure.zero`` gets them.

    Attributes:
        layer: the layer's index (None where a state is made for no particular layer).
        T: its targets. n_k: their distinct dimensions k. m: eig slots.
        d: its width. draws: each null family's draws at the layer, by its name (``Builtin.draws``).
    """

    layer: int | None
    T: int
    n_k: int
    m: int
    d: int | None = None  # the layer's width (a researcher's measure makes its zero sums from it)
    draws: dict[str, int] = field(default_factory=dict)


class Draw(NamedTuple):
    """What a null family draws one layer's frames from, when the plan is built (``Builtin.draw``).

    Attributes:
        adapter: the model's adapter. config: the ``MonitorConfig``. layer: the layer's index.
        targets: its ``stats.TargetSpec``s. heads: which of them are head targets.
        k_draw: the width frames are drawn at (the layer targets' widest k). k_max: every target's widest.
        seed: ``which`` -> the seed of the layer's draws of that kind (``stats.draw_seed``).
    """

    adapter: object
    config: object
    layer: int
    targets: list
    heads: list[bool]
    k_draw: int
    k_max: int
    seed: Callable[[int], int]


class Table(NamedTuple):
    """What a null family's columns over the whole table read (``Builtin.table`` and ``Builtin.power``).

    Attributes:
        plan: what was measured. config: the ``MonitorConfig``. verdict: the kept tokens' columns
            (``summary.summary_table``'s ``verdict``), or None. read_mid: 'mid' is a reading point.
        shared: a column's values with every row of a hypothesis given its first row's (one subspace, one p).
        q: BH's q of a column of p-values over the table's hypotheses, per family of rows.
        families: each row's BH family. first: each row's hypothesis's first row.
        scratch: what a family's ``table`` leaves for its ``power``.
    """

    plan: object
    config: object
    verdict: Callable | None
    read_mid: bool
    shared: Callable[[list], list]
    q: Callable[[list], list[float]]
    families: list[str]
    first: list[int]
    scratch: dict


@dataclass
class Row:
    """What a measure's summary columns read: one (layer, target)'s state and where it sits.

    Attributes:
        state: the layer's state (float64, CPU), open sequences folded in. ti: the target's index.
        k_index: the index of its k among the layer's distinct k. k: its dimension.
        t: its ``tgt`` fields by name. post_norm: the model normalises after the residual.
        tie_seed: breaks p_null's ties with the draws at random (``stats.mc_p_value``).
        layer: the layer's index.
    """

    state: dict
    ti: int
    k_index: int
    k: int
    t: dict
    post_norm: bool = False
    tie_seed: int | None = None
    layer: int | None = None


class Builtin:
    """One built-in measure: its state fields, its slice of the fast reduction, its settings.

    Attributes:
        name: its name; a null measure's columns in ``LayerBases.cols`` are under it.
        fields: the names of its state fields (reserved: no researcher's measure may take them).
        settings: the ``MonitorConfig`` fields its numbers depend on (recorded in the fingerprint).
        null: whether it is projected on the null subsample (has columns in ``Bn64``).
        row_fields: its per-sequence open counters (the rows' order follows the registry, ``measures.ROW``).
        per_k: its state fields kept per distinct k (a padded group reads its own k back).
        own: a researcher's measure run beside the reduction (``own.Own``), not in it.
        table_columns: the columns its ``table`` and ``power`` add (reserved as its summary columns are).
        first: its columns that lead the table, after the row's keys. last: its columns that end it.
    """

    name = ""
    fields: tuple[str, ...] = ()
    settings: tuple[str, ...] = ()
    null = False
    row_fields: tuple[str, ...] = ()
    per_k: tuple[str, ...] = ()
    own = False
    table_columns: tuple[str, ...] = ()
    first: tuple[str, ...] = ()
    last: tuple[str, ...] = ()

    def fingerprint(self, config) -> dict:
        """Its settings as the fingerprint records them."""
        return {k: getattr(config, k) for k in self.settings}

    def zero(self, size: Sizes) -> dict[str, torch.Tensor]:
        """Its fields of an empty layer state (float64), for the layer ``size.layer``."""
        return {}

    def damaged(self, key: str, t: torch.Tensor) -> torch.Tensor:
        """Which entries of its field ``key`` in a loaded state no forward could have written (bool, t's
        shape): by default the non-finite and the negative ones (counts and sums of non-negative terms)."""
        return ~torch.isfinite(t) | (t < 0)

    def entry(self, key: str, at: tuple[int, ...], targets: list[str]) -> str:
        """An entry ``at`` of its field ``key`` as an error names it (``targets``: the layer's, in order)."""
        return f"entry {list(at)}"

    # ---- the layer's bases (``plan.build_plan``, ``reduce.LayerBases``) ----
    def draw(self, at: Draw):
        """Its frames at one layer, each tensor (draws, d, k_max) float64, alone or in a dict (None: none there).
        Padding a group adds zero columns on the right of each (``LayerBases.pad_group``)."""
        return None

    def draws(self, frames) -> int:
        """How many draws its ``frames`` hold (``Sizes.draws``): by default, frames as one (draws, d, k) tensor."""
        return frames.shape[0]

    def kind(self, frames, lb) -> tuple:
        """What layers' frames must share for their reductions to stack (``LayerBases.kind``): by default, their
        number of draws."""
        return (self.draws(frames),)

    def columns(self, lb, width: int) -> list[torch.Tensor]:
        """Its (d, c) blocks of the layer's null matrix ``Bn64``, in order (null measures)."""
        return []

    def constants(self, bases: list, picks: dict, dev: torch.device) -> dict[str, torch.Tensor]:
        """Its device constants of a stacked group (``arena.group_constants``)."""
        return {}

    # ---- the fast reduction (``reduce.stacked.Stacked``: every tensor has a leading L) ----
    def tokens(self, stk, aligned: dict) -> None:
        """Per-token alignments of every reading point into aligned[point]."""

    def align(self, stk, P: torch.Tensor, inv: torch.Tensor) -> dict[str, torch.Tensor]:
        """Null alignments from its slice P (L, N, c) of the subsample's projections, 1/||x|| (L, N)."""
        return {}

    def point_sums(self, stk, null_all: dict, n_points: int, N: int) -> dict[str, torch.Tensor]:
        """Per null point sums (L, n_points, ...) of its alignments."""
        return {}

    def null_tokens(self, stk, on_null: dict, nulls: list[int]) -> None:
        """Its per-token alignments on the null's tokens into on_null[point]."""

    def sums(self, stk, aligned: dict, on_null: dict, cols: dict, st: dict) -> None:
        """Sums that need no mid reading."""

    def up(self, stk, aligned: dict, on_null: dict, cols: dict, st: dict, scratch: dict) -> None:
        """Up-counts of mid against its baseline (there is a mid reading)."""

    def no_mid(self, stk, st: dict) -> None:
        """Its up-count fields when there is no mid reading."""

    def rows(self, stk, scratch: dict) -> list[torch.Tensor]:
        """Its per-sequence counters, one (L, b, T) (or broadcastable) tensor per ``row_fields``."""
        return []

    def finish(self, stk, cols: dict, st: dict) -> None:
        """Last sums, once every measure has run."""

    # ---- the sinks ----
    def scalars(self, row: Row) -> dict[str, float]:
        """Its running values of one (layer, target) at a log point, ``{metric: value}``; each is logged
        as ``eigenhooks/<metric>/L<layer>/<target>`` beside the built-in ones (docs/api.md, "Sinks").
        ``row.state`` holds its own fields and ``tgt``, read to the host; ``row.t`` the target's sums.
        Return nothing (the default) to log nothing: its fields are then never copied."""
        return {}

    # ---- the summary and the plain twin ----
    def summary(self, row: Row, out: dict) -> dict:
        """Its summary columns of one (layer, target); ``out`` holds the columns of the measures before it."""
        return {}

    def table(self, df, at: Table) -> None:
        """Its columns over the whole table into df (a q over the table's hypotheses, a verdict), in registry
        order, once every row's summary columns are in."""

    def power(self, df, at: Table) -> None:
        """Its power columns into df (the effect it would call), once every measure's ``table`` ran."""

    def reference(self, ls, X: dict, Xb, Y: dict, Yr, sub: torch.Tensor, row: torch.Tensor) -> None:
        """Plain float64: add one sequence's counted tokens X[p] (n, d) (Xb: LN_t(pre), post-norm), their
        subsample Y[p] and its baseline Yr to the layer's state ``ls.state``; its counters into row
        (``measures.ROW``, T)."""
