"""From a monitor's sums to the table a user reads: one row per (layer, target).

Pure: it takes each layer's current state (``Accumulator.current``) and the plan, asks each measure for its
columns of every row (``measures.summarize``), then each null family for its columns over the whole table
(``Builtin.table``, then ``Builtin.power``), handing it Benjamini-Hochberg over the table's hypotheses
(``q_values``). Columns: docs/concepts.md, "Statistics".
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from . import stats
from .config import MonitorConfig
from .measures import TARGET, Table, summarize
from .plan import Plan, seed


def target_stats(plan: Plan, current: Callable[[int], dict]) -> dict[tuple[int, str], dict[str, float]]:
    """(layer, target) -> the raw per-target sums and counts (``measures.TGT_FIELDS``)."""
    out = {}
    for layer, lp in sorted(plan.layers.items()):
        st = current(layer)
        for ti, meta in enumerate(lp.meta):
            out[(layer, meta.name)] = TARGET.sums_of(st, ti)
    return out


def summary_table(
    plan: Plan, current: Callable[[int], dict[str, torch.Tensor]], config: MonitorConfig, post_norm: bool,
    verdict: Callable[[MonitorConfig], dict] | None = None,
):  # fmt: skip
    """pandas DataFrame, one row per (layer, target). A researcher's measures' columns are per layer (the
    same on each of the layer's rows); ``df.attrs["per_layer"]`` names them.

    Args:
        plan: what was measured. current: layer -> its state, open sequences folded in (float64, CPU).
        config: the settings (the null seed is recorded). post_norm: the model normalises after the residual.
        verdict: config -> {layer: each target's verdict columns} (``Accumulator.verdict``); None: none kept.
    """
    import pandas as pd

    rows, bases = [], []
    heads = any(meta.head is not None for lp in plan.layers.values() for meta in lp.meta)
    for layer, lp in sorted(plan.layers.items()):
        st = current(layer)
        for ti, (t, meta) in enumerate(zip(lp.targets, lp.meta)):
            bases.append(t.U)
            s = meta.spec
            row = {"layer": layer, "target": meta.name, **({"head": meta.head} if heads else {})}
            row.update(variant=meta.variant, rank=meta.rank, k=t.k)
            row.update(
                kind=s.kind if s else "custom",
                lambda_1_re=s.lambda_1.real if s else float("nan"),
                lambda_1_im=s.lambda_1.imag if s else float("nan"),
                abs_lambda_1=abs(s.lambda_1) if s else float("nan"),
                gap_ratio=s.gap_ratio if s else float("nan"),
            )
            tie = seed(config, layer, 1000)
            row.update(summarize(st, ti, lp.bases.k_index[ti], t.k, post_norm, tie, lp.bases.measures, layer))
            row["null_seed"] = config.null_seed
            rows.append(row)
    df = pd.DataFrame(rows)
    if heads:  # head targets' query head; <NA> on the layer targets' rows (an empty cell in CSV)
        df["head"] = df["head"].astype("Int64")
    if len(df):
        families = [family(r) for r in rows]
        layers = df["layer"].tolist()
        # one subspace, one p: rows of one hypothesis (equal subspaces at a layer, e.g. a target given back with
        # its sign flipped) take its first row's p, which the float sums of Δγ only match to rounding
        first = hypotheses(layers, bases, families)
        at = Table(
            plan, config, verdict, "mid" in config.reading_points,
            shared=lambda col: [col[j] for j in first],
            q=lambda p: q_values(layers, bases, families, p, first),
            families=families, first=first, scratch={},
        )  # fmt: skip
        for m in plan.measures:  # each null family's columns over the table, then its power
            m.table(df, at)
        for m in plan.measures:
            m.power(df, at)
        lead = ("layer", "target", "head") + tuple(c for m in plan.measures for c in m.first)
        tail = [c for m in plan.measures for c in m.last if c in df.columns]
        rest = [c for c in df.columns if c not in lead and c not in tail]
        df = df[[c for c in lead if c in df.columns] + rest + tail]
    df.attrs["per_layer"] = [c for m in config.measures for c in df.columns if c.startswith(m.name + ".")]
    return df


LAYERS, HEADS = "layers", "heads"


def family(row: dict) -> str:
    """The Benjamini-Hochberg family of a summary row: a head target's rows (a ``head`` column) are
    their own, every layer target's one."""
    head = row.get("head")
    return HEADS if head is not None and head == head else LAYERS  # head == head: not NaN


def hypotheses(layers: list, bases: list[torch.Tensor], families: list[str]) -> list[int]:
    """For each row, the index of the first row of its hypothesis: one per distinct (family, layer,
    subspace), rows with equal subspaces (``stats.same_subspace``) sharing one, ov/modulus and
    ov/residual at a layer where they pick the same eigenpair for instance."""
    first: list[int] = []
    seen: dict[tuple, list[int]] = {}
    for i, key in enumerate(zip(families, layers)):
        reps = seen.setdefault(key, [])
        j = next((r for r in reps if stats.same_subspace(bases[r], bases[i])), None)
        if j is None:
            reps.append(i)
        first.append(i if j is None else j)
    return first


def q_values(
    layers: list, bases: list[torch.Tensor], families: list[str], p: list[float], first: list[int] | None = None
) -> list[float]:
    """BH q_null over the table a reader sees: within each family, one p per distinct (layer, subspace)
    (NaN p, too few tokens, left out), the p of its first row; every row of a hypothesis gets its q.
    ``first``: ``hypotheses(layers, bases, families)`` where the caller has it already."""
    if first is None:
        first = hypotheses(layers, bases, families)
    p = [p[j] for j in first]
    q = [float("nan")] * len(p)
    for fam in dict.fromkeys(families):
        reps = [i for i, (j, f) in enumerate(zip(first, families)) if i == j and f == fam]
        for i, qi in zip(reps, stats.bh([p[i] for i in reps])):
            q[i] = qi
    return [q[j] for j in first]


def save_table(summary: Callable, path) -> Path:
    """Write ``summary()`` as Parquet, CSV or JSON, by the file's suffix (checked before the table is made)."""
    path = Path(path)
    if path.suffix not in (".parquet", ".csv", ".json"):
        raise ValueError(f"unknown format {path.suffix!r}: use .parquet, .csv or .json")
    df = summary()
    if path.suffix == ".parquet":
        df.to_parquet(path)
    elif path.suffix == ".csv":
        df.to_csv(path, index=False)
    else:
        df.to_json(path, orient="records", indent=2)
    return path


def layer_rows(summary):
    """The layer targets' rows of a summary (all of them when it has no head targets)."""
    return summary[summary["head"].isna()] if "head" in summary.columns else summary


def head_rows(summary):
    """The head targets' rows of a summary (none when it has no ``head`` column)."""
    return summary[summary["head"].notna()] if "head" in summary.columns else summary.iloc[:0]
