"""A researcher's own measure: plain per-layer tensors in, a dict of sums out, and a summary.

``Measure`` is the public shape (docs/api.md, "Your own measure"), the plain one the reference
(``monitor/reference.py``) is written in: a layer's readings as they are, (b, n, d) each, with the
tokens that count and the null's tokens as masks. It never sees the engine's stacks, arenas or
column slices. ``Own`` adapts it to the engine (``base.Builtin``): its sums are taken in the
forward, on the device, when the layer's readings are all in (``forward.Forward``), added to the
state under its own name (``"<name>.<field>"``), and its summary columns (``"<name>.<column>"``)
join ``mon.summary()``, one value per layer. Names that are the built-in measures', fields' or
columns' are refused when the monitor is made (``check``).
"""

from __future__ import annotations

import functools
import hashlib
import weakref
from typing import NamedTuple

import torch

from .base import Builtin, Row, Sizes


class Readings(NamedTuple):
    """One layer's readings in one forward, as a measure's ``sums`` gets them.

    Attributes:
        layer: the layer's index.
        pre: (b, n, d) the residual stream before the layer, in the model's dtype.
        mid: (b, n, d) after its attention step, or None where none ran (or 'mid' is not read).
        post: (b, n, d) after the layer, or None where not read.
        baseline: (b, n, d) what mid's change is measured from: pre, or LN_t(pre) on a post-norm model.
        valid: (b, n) bool, the tokens that count: not padding, finite at every reading. Rows off it
            may hold anything, NaN included: weigh by it (``torch.where``), never index by it (a sync).
        null: (b, n) bool, the null's tokens: the valid ones whose index in their sequence is a multiple
            of ``null_stride`` (all valid ones at stride 1), the tokens the built-in nulls are taken on.
    """

    layer: int
    pre: torch.Tensor
    mid: torch.Tensor | None
    post: torch.Tensor | None
    baseline: torch.Tensor
    valid: torch.Tensor
    null: torch.Tensor


class Measure:
    """A measure of your own: its sums of one layer's readings, and its summary of them.

    Subclass it, give it a ``name`` (letters, digits, ``_``; not a built-in measure's, field's or
    column's), define ``sums`` and ``summary``, and pass it as ``eh.monitor(model, measures=[...])``.

    ``sums(readings)`` gets one layer's ``Readings`` of one forward and returns ``{field: tensor}``:
    sums over tokens, added up over the forwards (so a state merges by addition). It runs in the
    forward, on the readings' device: keep it to tensor ops (no ``.item()``, no boolean indexing), so
    no forward waits for the device. ``summary(sums, layer)`` gets the float64 totals on the CPU and
    returns its columns of that layer: ``{column: value}``. ``zero(layer, d)`` makes the empty sums,
    by default ``sums`` of no tokens (zeros of the shapes it returns).

    Its fields are kept as ``"<name>.<field>"`` in each layer's state (``mon.state_dict()``), its
    columns as ``"<name>.<column>"`` in ``mon.summary()``: one value per layer, the same on each of
    the layer's target rows (``df.attrs["per_layer"]`` names them). With ``logged = True`` its columns
    are also logged at the sinks' log points, once a layer (a copy of its sums to the host there).

    ``fingerprint()`` says what its sums mean; two states merge only if it is equal. By default it is
    a digest of its class, its name and every tensor, number and string it holds (``vars(self)``).
    """

    name: str = ""
    logged: bool = False

    def sums(self, r: Readings) -> dict[str, torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__}.sums(readings) must return {{field: tensor}}")

    def summary(self, sums: dict[str, torch.Tensor], layer: int) -> dict[str, float]:
        return {}

    def zero(self, layer: int, d: int) -> dict[str, torch.Tensor]:
        z = torch.zeros(1, 0, d, dtype=torch.float64)
        none = torch.zeros(1, 0, dtype=torch.bool)
        got = self.sums(Readings(layer, z, z, z, z, none, none))
        return {k: torch.zeros_like(torch.as_tensor(v), dtype=torch.float64) for k, v in got.items()}

    def fingerprint(self) -> dict:
        h = hashlib.sha256(f"{type(self).__module__}.{type(self).__qualname__}:{self.name}".encode())
        for key, v in sorted(vars(self).items()):
            if isinstance(v, torch.Tensor):
                t = v.detach().to("cpu").contiguous()
                h.update(f"{key}:{t.dtype}:{tuple(t.shape)}".encode())
                h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
            elif isinstance(v, bool | int | float | str | tuple) and not callable(v):
                h.update(f"{key}={v!r}".encode())
        return {"class": type(self).__qualname__, "digest": h.hexdigest()[:16]}


def reserved() -> tuple[frozenset, frozenset]:
    """The built-in measures' names and fields, and the summary's built-in columns: no own measure's name."""
    from . import registered

    names = {m.name for m in registered()} | {f for m in registered() for f in m.fields} | {"tgt"}
    return frozenset(names), builtin_columns()


# The columns ``summary.summary_table`` writes itself around the measures' (row keys, the spectrum's). Only these
# are named here: it imports this package, so it cannot be run from here. tests/monitor/test_own_measure.py checks
# every column of real summaries against builtin_columns().
TABLE_COLUMNS = "layer target head variant rank k kind lambda_1_re lambda_1_im abs_lambda_1 gap_ratio null_seed".split()


@functools.cache
def builtin_columns() -> frozenset:
    """Every column ``mon.summary()`` can make itself: the registered measures' summary columns, read off their
    summaries of an empty layer state (pre-norm and post-norm), their columns over the table (``table_columns``),
    and ``TABLE_COLUMNS``. A column a built-in measure adds is reserved with no list to update."""
    import warnings

    from . import registered, summarize, zero_state

    measures = registered()
    state = zero_state(Sizes(layer=0, T=1, n_k=1, m=2, d=2, draws={m.name: 2 for m in measures}), measures)
    columns = set(TABLE_COLUMNS) | {c for m in measures for c in m.table_columns}
    with warnings.catch_warnings():  # the empty state's means are 0/0: NaN, which is all they can be
        warnings.simplefilter("ignore")
        for post_norm in (False, True):
            columns |= set(summarize(state, 0, 0, 1, post_norm, tie_seed=0, measures=measures, layer=0))
    return frozenset(columns)


def check(measures) -> tuple[Own, ...]:
    """The researcher's measures checked and adapted to the engine, once, when the monitor is made.

    Raises:
        ValueError: not a ``Measure``, a name that is no identifier, taken by a built-in measure, field or
            summary column, or given twice; the message names it and says what to do.
    """
    measures = tuple(measures)
    if not measures:  # the defaults: no summary run to read the reserved columns off (nor scipy imported)
        return ()
    names, columns = reserved()
    out, seen = [], set()
    for m in measures:
        if isinstance(m, Own):
            m = m.measure
        if not isinstance(m, Measure):
            raise ValueError(
                f"measures takes eh.Measure instances (docs/api.md, 'Your own measure'), got {type(m).__name__}"
            )
        name = m.name
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"{type(m).__name__}: a measure's name is a Python identifier, got {name!r}")
        if name in names or name in columns:
            what = "a built-in measure or state field" if name in names else "a built-in summary column"
            raise ValueError(f"{type(m).__name__}: the name {name!r} is {what}'s; give the measure another name")
        if name in seen:
            raise ValueError(f"two measures are named {name!r}: each needs a name of its own")
        seen.add(name)
        out.append(LoggedOwn(m) if m.logged else Own(m))
    return tuple(out)


class Own(Builtin):
    """A researcher's ``Measure`` as the engine holds it: its zero sums, fingerprint and summary under its name.

    Its sums are taken in the forward (``take``), not in the stacked reduction, whose hooks it leaves empty."""

    own = True

    def __init__(self, measure: Measure):
        self.measure, self.name = measure, measure.name
        self.prefix = measure.name + "."
        self.keys: dict = {}  # layer -> its fields there, as its zero sums name them

    def fingerprint(self, config) -> dict:
        return {f"measure:{self.name}": self.measure.fingerprint()}

    def zero(self, size: Sizes) -> dict[str, torch.Tensor]:
        z = self.measure.zero(size.layer, size.d)
        if not isinstance(z, dict) or not all(isinstance(v, torch.Tensor) for v in z.values()):
            raise ValueError(f"measure {self.name!r}: its sums must be a dict of tensors, got {z!r}")
        self.keys[size.layer] = tuple(sorted(z))
        return {self.prefix + k: v.to(torch.float64) for k, v in z.items()}

    def damaged(self, key, t):
        return torch.zeros_like(t, dtype=torch.bool)  # its sums mean what it says: none refused

    def take(self, r: Readings) -> dict[str, torch.Tensor]:
        """Its sums of one layer's readings, under its name, float64 on their device (no sync)."""
        got = self.measure.sums(r)
        want = self.keys.get(r.layer)
        if not isinstance(got, dict) or (want is not None and tuple(sorted(got)) != want):
            keys = sorted(got) if isinstance(got, dict) else type(got).__name__
            raise ValueError(
                f"measure {self.name!r}: sums returned {keys} at layer {r.layer}, its zero sums there {list(want or ())}"
            )
        return {self.prefix + k: torch.as_tensor(v).detach().to(torch.float64) for k, v in got.items()}

    def mine(self, state: dict) -> dict[str, torch.Tensor]:
        """Its own fields of a layer's state, by their own names."""
        n = len(self.prefix)
        return {k[n:]: v for k, v in state.items() if k.startswith(self.prefix)}

    def columns_of(self, state: dict, layer: int | None) -> dict[str, float]:
        got = self.measure.summary(self.mine(state), layer)
        return {self.prefix + c: v for c, v in got.items()}

    def summary(self, row: Row, out: dict) -> dict:
        return self.columns_of(row.state, row.layer)


class LoggedOwn(Own):
    """An ``Own`` whose columns are logged at the sinks' log points (``Measure.logged``)."""

    def scalars(self, row: Row) -> dict[str, float]:
        return self.columns_of(row.state, row.layer)


_OF_PLAN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def of_plan(plan) -> tuple[Own, ...]:
    """A plan's own measures (the same at every layer), looked up once per plan."""
    got = _OF_PLAN.get(plan)
    if got is None:
        first = next(iter(plan.layers.values()), None)
        got = _OF_PLAN[plan] = tuple(m for m in first.bases.measures if m.own) if first else ()
    return got


def readings(layer: int, points: dict, base, mask: torch.Tensor, index, stride: int) -> Readings:
    """One layer's ``Readings`` from the forward's points (pre, mid, post), LN_t(pre) or None, the (b, n)
    valid mask and each token's index in its sequence: device ops only."""
    pre = points["pre"]
    valid = mask.bool()
    for x in (pre, points.get("mid"), points.get("post"), base):
        if x is not None:
            valid = valid & torch.isfinite(x).all(-1)
    null = valid if stride == 1 else valid & (index % stride == 0)
    return Readings(layer, pre, points.get("mid"), points.get("post"), pre if base is None else base, valid, null)


def own_sums(measures: tuple[Own, ...], r: Readings) -> dict[str, torch.Tensor]:
    """Every own measure's sums of one layer's readings, under their names."""
    out: dict = {}
    with torch.no_grad():
        for m in measures:
            out.update(m.take(r))
    return out
