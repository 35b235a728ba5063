"""``Builtin``: what one built-in measure holds, and what the reduction engine asks of it.

This is the engine's own protocol, private: a researcher's measure is ``own.Measure`` (plain
per-layer tensors in, sums out), run beside the reduction by the ``own.Own`` adapter. The engine (``reduce/stacked.py``) knows no measure by name: it lays out each null measure's
columns in the layer's null matrix (``columns``), hands each its slice of the projections
(``align``), and asks each for its sums (``sums``, ``up``, ``no_mid``, ``finish``), its per-sequence
counters (``rows``) and its group constants (``constants``). A measure's state fields start at
``zero`` (one layer's ``Sizes``); its fingerprint keys are ``settings``; its running values at the
sinks' log points are ``scalars``.
"""

from __future__ import annotations

from dataclasses import dataclass

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
        T: its targets. n_k: their distinct dimensions k. K: Haar draws. m: eig slots. Kf: F-null draws.
        d: its width.
    """

    layer: int | None
    T: int
    n_k: int
    K: int
    m: int
    Kf: int
    d: int | None = None  # the layer's width (a researcher's measure makes its zero sums from it)


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
        row_fields: its per-sequence open counters (the rows' order follows ``measures.MEASURES``).
        per_k: its state fields kept per distinct k (a padded group reads its own k back).
        own: a researcher's measure run beside the reduction (``own.Own``), not in it.
    """

    name = ""
    fields: tuple[str, ...] = ()
    settings: tuple[str, ...] = ()
    null = False
    row_fields: tuple[str, ...] = ()
    per_k: tuple[str, ...] = ()
    own = False

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

    # ---- the layer's bases ----
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

    def reference(self, ls, X: dict, Xb, Y: dict, Yr, sub: torch.Tensor, row: torch.Tensor) -> None:
        """Plain float64: add one sequence's counted tokens X[p] (n, d) (Xb: LN_t(pre), post-norm), their
        subsample Y[p] and its baseline Yr to the layer's state ``ls.state``; its counters into row
        (``measures.ROW``, T)."""
