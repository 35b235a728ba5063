"""``MonitorConfig``: every setting of a monitor and its default, in one frozen place.

``eh.monitor``, ``Monitor``, the main job (``run/job.py``), the CLI's help, the Trainer callback and
the state fingerprint all read their defaults and names from here. A config is validated once,
when it is made; what is wrong is named with the value that came and what to give instead.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, fields

from .measures.base import POINTS
from .measures.own import check as check_measures

DEFAULT_TARGETS = (("ov", "modulus"), ("ov", "residual"))


@dataclass(frozen=True, eq=False)  # targets may hold tensors: compared by identity
class MonitorConfig:
    """The monitor's settings (docs/api.md, "Monitor settings").

    Attributes:
        targets: built-in (variant, rank) pairs and custom (name, tensor | {layer: tensor}) targets.
        reading_points: which of 'pre', 'mid', 'post' to read ('pre' is required), in that order.
        tokens: also keep per-token alignments (``mon.token_records``).
        null_seed: seed of every null draw.
        null_draws: Haar-random subspaces per layer (p_null's resolution is 1/(null_draws + 1)).
        fnull_draws: directions orth(F g) per layer (0: none).
        eig_top: F's own top eigen-subspaces each target is ranked among (0: none).
        null_stride: the nulls are measured on every null_stride-th valid token of each sequence (by
            its index there; odd, so not in step with power-of-two lengths); 1: every token (None is
            taken as 1, here, once: every part reads this int).
        log_every: forwards between the sinks' log points (0 or None: only on exit and ``mon.log()``).
        verdict_tokens: the verdict's kept tokens per layer (R: the null's tokens with the smallest seeded hash of
            (sequence, position); memory R * 2 * d * 4 bytes a layer); 0 keeps none, and no verdict is given.
        verdict_draws: the verdict null's directions per layer (p's resolution is 2 / (verdict_draws + 1)).
        sample_seed: seed of which tokens the verdict keeps and of their split into halves (not of the draws:
            ``null_seed``).
        attach: register the hooks on enter (False: TransformerLens ``fwd_hooks()``).
        measures: a researcher's own measures (``eh.Measure`` instances, docs/api.md "Your own
            measure"), measured after the built-in ones; each name unique and none a built-in
            measure's, field's or summary column's. Held as the engine runs them (``own.Own``: the
            researcher's measure is its ``measure``).
    """

    targets: tuple = DEFAULT_TARGETS
    reading_points: tuple[str, ...] = POINTS
    tokens: bool = False
    null_seed: int = 0
    null_draws: int = 128
    fnull_draws: int = 64
    eig_top: int = 16
    null_stride: int = 5
    verdict_tokens: int = 1024
    verdict_draws: int = 4999
    sample_seed: int = 0
    log_every: int | None = 1
    attach: bool = True
    measures: tuple = ()

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731  (frozen: normalised once, here)
        set_("targets", tuple(target_list(self.targets)))
        bad = set(self.reading_points) - set(POINTS)
        if bad or "pre" not in self.reading_points:
            raise ValueError(f"reading_points must include 'pre' and be among pre/mid/post, got {self.reading_points}")
        set_("reading_points", tuple(p for p in POINTS if p in self.reading_points))
        check_nulls(self.null_draws, self.fnull_draws, self.eig_top, self.null_stride)
        for name in ("null_seed", "sample_seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise ValueError(f"{name} must be an int, got {v!r}")
        for name, low in (("verdict_tokens", 0), ("verdict_draws", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
        if self.null_stride is None:
            set_("null_stride", 1)
        set_("null_seed", int(self.null_seed))
        set_("measures", check_measures(self.measures))  # each as the engine holds it (``own.Own``), names checked
        le = self.log_every
        if le is not None and (isinstance(le, bool) or not isinstance(le, int) or le < 0):
            raise ValueError(
                f"log_every must be a non-negative int (0 or None: only on exit and mon.log()), got {le!r}"
            )

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


def check_nulls(null_draws, fnull_draws, eig_top, null_stride) -> None:
    """Raise ValueError, naming the setting, unless the monitor's null settings are usable."""
    for name, v in (("null_draws", null_draws), ("fnull_draws", fnull_draws), ("eig_top", eig_top)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (1 if name == "null_draws" else 0):
            raise ValueError(
                f"{name} must be a {'positive' if name == 'null_draws' else 'non-negative'} int, got {v!r}"
            )
    if null_stride is not None and (
        isinstance(null_stride, bool) or not isinstance(null_stride, int) or null_stride < 1
    ):
        raise ValueError(f"null_stride must be a positive int (1: every token), got {null_stride!r}")


def target_list(targets) -> list:
    """``targets`` as a list, refusing what is no list of targets (one line, naming the argument)."""
    if isinstance(targets, str):
        raise ValueError(f"targets must be a list of targets, got the string {targets!r}; e.g. [('ov', 'modulus')]")
    if isinstance(targets, tuple) and len(targets) == 2 and isinstance(targets[0], str):
        raise ValueError(f"targets is one target: wrap it in a list, targets=[{targets!r}]")
    if not isinstance(targets, list | tuple):
        raise ValueError(f"targets must be a list of targets, e.g. [('ov', 'modulus')], got {targets!r}")
    if not targets:
        raise ValueError("targets is empty: at least one target is needed, e.g. [('ov', 'modulus')]")
    return list(targets)


DEFAULTS = MonitorConfig()  # every default, read by eh.monitor, the main job, the CLI and the Trainer callback
