"""What the monitor measures, one file a measure (docs/design.md, "Mathematics").

- ``target``: target projection, a(x) = ||U^T x|| / ||x|| of every token, its deltas and up-counts;
- ``haar``: the Haar null, K random k-subspaces per layer;
- ``eig``: eig rank, each target among F's own top eigen-subspaces;
- ``fnull``: the F-null, directions orth(F g);
- ``verdict``: the verdict's null, drawn from the stream's own covariance (its numbers come from the kept tokens at
  ``summary()``: ``monitor/verdict``).

Each holds its state fields, its columns and slice of the fast reduction (``base.Builtin``, the
engine's private protocol); a null family also its frames and its columns over the table. The plan,
the reduction engine (``reduce/``) and the table iterate over the registry (``registered``) and know
none by name: adding one is its file and one ``register`` line. ``own``: a researcher's ``Measure``,
plain per-layer tensors in and sums out, and the adapter that runs it beside the engine.
"""

import torch

from .base import Builtin, Draw, Row, Sizes, Table
from .eig import EIG
from .fnull import FNULL
from .haar import HAAR
from .own import Measure, Readings
from .target import TARGET, TGT_FIELDS, close_rows
from .verdict import VERDICT

_REGISTRY: list[Builtin] = [TARGET, HAAR, EIG, FNULL, VERDICT]  # the state's fields and the rows' order
NULL_COLUMNS: tuple[Builtin, ...] = (EIG, HAAR, FNULL)  # the order of their columns in ``Bn64``; then the others'


def registered() -> tuple[Builtin, ...]:
    """What a monitor made now measures besides a researcher's own, in order (a monitor keeps what it was made
    with)."""
    return tuple(_REGISTRY)


class register:
    """Register a built-in measure (a null family, say) for every monitor made from now on, after the others.

    ``with register(m): ...`` takes it out again on leaving. Its name and fields must be new.

    Raises:
        ValueError: its name or a field is a registered measure's.
    """

    def __init__(self, measure: Builtin):
        taken = {m.name for m in _REGISTRY} | {f for m in _REGISTRY for f in m.fields}
        clash = sorted(({measure.name} | set(measure.fields)) & taken)
        if clash:
            raise ValueError(f"measure {measure.name!r}: {clash} already registered; give it names of its own")
        self.measure = measure
        _REGISTRY.append(measure)
        _changed()

    def __enter__(self) -> Builtin:
        return self.measure

    def __exit__(self, *exc) -> None:
        _REGISTRY.remove(self.measure)
        _changed()


def _changed() -> None:
    """Forget the reserved columns, read off the registry (a registered measure's counters go after the built-in
    ones', so theirs keep their places)."""
    from .own import builtin_columns

    builtin_columns.cache_clear()


def __getattr__(name: str):
    """``NULL_SETTINGS`` (the settings the numbers depend on) and ``ROW`` (a sequence's open counters, per
    target), read off the registry when asked."""
    if name == "NULL_SETTINGS":
        return tuple(k for m in _REGISTRY for k in m.settings)
    if name == "ROW":
        return tuple(f for m in _REGISTRY for f in m.row_fields)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def zero_state(size: Sizes, measures=None) -> dict:
    """The empty state of one layer of these sizes (T targets, n_k distinct k, K Haar draws, m eig, Kf F-null)."""
    out: dict = {}
    for measure in registered() if measures is None else measures:
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
    measures=None, layer: int | None = None,
) -> dict:  # fmt: skip
    """Every measure's summary columns of one (layer, target) from its state (q_null and the verdict
    come later, over the table). ``tie_seed`` breaks p_null's ties with the draws at random."""
    row = target_row(state, ti, k_index, k, post_norm, tie_seed, layer)
    out: dict = {}
    for m in registered() if measures is None else measures:
        out.update(m.summary(row, out))
    return out


def owner(key: str, measures=None) -> Builtin | None:
    """The measure whose state field ``key`` is (None: no registered one's, nor one of ``measures``)."""
    for m in registered() if measures is None else measures:
        if key in m.fields or (m.own and key.startswith(m.name + ".")):
            return m
    return None


__all__ = [
    "Builtin",
    "Draw",
    "EIG",
    "FNULL",
    "HAAR",
    "Measure",
    "NULL_COLUMNS",
    "ROW",
    "Readings",
    "Row",
    "Sizes",
    "TARGET",
    "Table",
    "TGT_FIELDS",
    "close_rows",
    "fold_rows",
    "owner",
    "register",
    "registered",
    "running_fields",
    "running_values",
    "summarize",
    "target_row",
    "target_sums",
    "zero_state",
]
