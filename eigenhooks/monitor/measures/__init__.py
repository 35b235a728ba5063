"""What the monitor measures, one file a measure (docs/design.md, "Mathematics").

- ``target``: target projection, a(x) = ||U^T x|| / ||x|| of every token, its deltas and up-counts;
- ``haar``: the Haar null, K random k-subspaces per layer;
- ``eig``: eig rank, each target among F's own top eigen-subspaces;
- ``fnull``: the F-null, directions orth(F g);
- ``verdict``: the verdict's settings only (its numbers come from the kept tokens at ``summary()``: ``monitor/verdict``).

Each holds its state fields, its columns and slice of the fast reduction (``base.Builtin``, the
engine's private protocol); the reduction engine (``reduce/``) hands each its columns and knows none
by name. ``own``: a researcher's ``Measure``, plain per-layer tensors in and sums out, and the
adapter that runs it beside the engine.
"""

import torch

from .base import Builtin, Row, Sizes
from .eig import EIG
from .fnull import FNULL
from .haar import HAAR
from .own import Measure, Readings
from .target import TARGET, TGT_FIELDS, close_rows
from .verdict import VERDICT

MEASURES: tuple[Builtin, ...] = (TARGET, HAAR, EIG, FNULL, VERDICT)  # the state's fields and the rows' order
NULL_COLUMNS: tuple[Builtin, ...] = (EIG, HAAR, FNULL)  # the order of their columns in ``Bn64``
NULL_SETTINGS = tuple(k for m in MEASURES for k in m.settings)  # the settings the numbers depend on
ROW = tuple(f for m in MEASURES for f in m.row_fields)  # a sequence's open counters, per target


def zero_state(size: Sizes, measures=MEASURES) -> dict:
    """The empty state of one layer of these sizes (T targets, n_k distinct k, K Haar draws, m eig, Kf F-null)."""
    out: dict = {}
    for measure in measures:
        out.update(measure.zero(size))
    return out


def fold_rows(states: list[dict], rows: torch.Tensor) -> list[dict]:
    """Layers' states with their ended sequences' per-row counters (L, b, len(ROW), T) (``ROW``)
    folded into the cluster sums, in one op for all of them: new dicts, on the counters' device (the
    tensors replaced, never written). The accumulator calls it, knowing no field by name."""
    tgt = torch.stack([st["tgt"].to(rows.device) for st in states])
    return [{**st, "tgt": t} for st, t in zip(states, close_rows(tgt, rows))]


def running_fields() -> tuple[str, ...]:
    """The state fields a sink's running values are made of (``running_values``): the target measure's."""
    return TARGET.fields


def target_sums(state: dict, ti: int) -> dict[str, float]:
    """One target's sums and counts by name (``TGT_FIELDS``), from its layer's state (on the host)."""
    return TARGET.sums_of(state, ti)


def running_values(state: dict, ti: int) -> dict[str, float]:
    """One target's running statistics (gamma at each point, rho, tokens) from its layer's state, as the
    target measure defines them (``Target.running``); ``state`` needs only ``running_fields``."""
    return TARGET.running(TARGET.sums_of(state, ti))


def target_row(state: dict, ti: int, k_index: int, k: int, post_norm=False, tie_seed=None, layer=None) -> Row:
    """What a measure's summary and scalars read of one (layer, target) (``Row``)."""
    return Row(state, ti, k_index, k, TARGET.sums_of(state, ti), post_norm, tie_seed, layer)


def summarize(
    state: dict, ti: int, k_index: int, k: int, post_norm: bool = False, tie_seed: int | None = None,
    measures=MEASURES, layer: int | None = None,
) -> dict:  # fmt: skip
    """Every measure's summary columns of one (layer, target) from its state (q_null and the verdict
    come later, over the table). ``tie_seed`` breaks p_null's ties with the draws at random."""
    row = target_row(state, ti, k_index, k, post_norm, tie_seed, layer)
    out: dict = {}
    for m in measures:
        out.update(m.summary(row, out))
    return out


def owner(key: str, measures=MEASURES) -> Builtin | None:
    """The measure whose state field ``key`` is (None: no built-in one's, nor one of ``measures``)."""
    for m in measures:
        if key in m.fields or (m.own and key.startswith(m.name + ".")):
            return m
    return None


__all__ = [
    "Builtin",
    "EIG",
    "FNULL",
    "HAAR",
    "MEASURES",
    "Measure",
    "NULL_COLUMNS",
    "ROW",
    "Readings",
    "Row",
    "Sizes",
    "TARGET",
    "TGT_FIELDS",
    "close_rows",
    "fold_rows",
    "owner",
    "running_fields",
    "running_values",
    "summarize",
    "target_row",
    "target_sums",
    "zero_state",
]
