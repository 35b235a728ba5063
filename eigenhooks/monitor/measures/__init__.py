"""What the monitor measures, one file a measure (docs/design.md, "Mathematics").

- ``target``: target projection, a(x) = ||U^T x|| / ||x|| of every token, its deltas and up-counts;
- ``haar``: the Haar null, K random k-subspaces per layer;
- ``eig``: eig rank, each target among F's own top eigen-subspaces;
- ``fnull``: the F-null, directions orth(F g).

Each holds its state fields, its columns and slice of the fast reduction (``base.Measure``); the
reduction engine (``reduce/``) hands each its columns and knows none by name.
"""

from .base import Measure
from .eig import EIG
from .fnull import FNULL
from .haar import HAAR
from .target import TARGET

MEASURES: tuple[Measure, ...] = (TARGET, HAAR, EIG, FNULL)  # the state's fields and the rows' order
NULL_COLUMNS: tuple[Measure, ...] = (EIG, HAAR, FNULL)  # the order of their columns in ``Bn64``
ROW = tuple(f for m in MEASURES for f in m.row_fields)  # a sequence's open counters, per target


def zero_state(T: int, n_k: int, K: int, m: int, Kf: int, measures=MEASURES) -> dict:
    """The empty state of one layer: T targets, n_k distinct k, K Haar draws, m eig, Kf F-null."""
    out: dict = {}
    for ms in measures:
        out.update(ms.zero(T, n_k, K, m, Kf))
    return out


__all__ = ["EIG", "FNULL", "HAAR", "MEASURES", "Measure", "NULL_COLUMNS", "ROW", "TARGET", "zero_state"]
