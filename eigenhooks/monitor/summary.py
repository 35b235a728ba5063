"""From a monitor's sums to the table a user reads: one row per (layer, target).

Pure: it takes each layer's current state (``Accumulator.current``) and the plan, and calls the
formulas of ``stats`` (alignment means, the Haar null band, Monte-Carlo p-values, cluster-robust
intervals, the verdict) and runs Benjamini-Hochberg over the table's hypotheses (``q_values``). Columns: docs/concepts.md, "Statistics".
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from . import stats
from . import verdict as V
from .config import MonitorConfig
from .measures import TARGET, summarize
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
        fam = [family(r) for r in rows]
        # one subspace, one p: rows of one hypothesis (equal subspaces at a layer, e.g. a target given back with
        # its sign flipped) take its first row's p, which the float sums of Δγ only match to rounding
        first = hypotheses(df["layer"].tolist(), bases, fam)
        df["p_null"] = [df["p_null"].iat[j] for j in first]
        df["q_null"] = q_values(df["layer"].tolist(), bases, fam, df["p_null"].tolist(), first)
        read_mid = "mid" in config.reading_points
        df["verdict_haar"] = [
            stats.verdict(q, lift, null_tokens=n, read_mid=read_mid)
            for q, lift, n in zip(df["q_null"], df["dgamma_lift"], df["null_tokens"])
        ]
        nulls = verdict_columns(df, plan, config, verdict, first, bases, fam)
        df["static_lift"] = df["static"] - df["static_null_median"]
        for name, q, lift in (("verdict", "q_tilt", "tilt_lift"), ("verdict_static", "q_static", "static_lift")):
            df[name] = [V.verdict(qv, lv, n, read_mid) for qv, lv, n in zip(df[q], df[lift], df["verdict_sequences"])]
        detectable_columns(df, first, fam)
        detectable_tilt(df, first, fam, nulls)
        rest = [c for c in df.columns if c not in FIRST and c != "verdict_haar"]
        df = df[[c for c in FIRST if c in df.columns] + rest + ["verdict_haar"]]  # last: a text every row fills
    df.attrs["per_layer"] = [c for m in config.measures for c in df.columns if c.startswith(m.name + ".")]
    return df


def verdict_columns(df, plan: Plan, config: MonitorConfig, verdict, first, bases, fam) -> list:
    """The verdict's columns (``verdict.COLUMNS``, q_tilt and q_static) into df; each row's tilt draws (for
    ``detectable_tilt``). BH runs per question (docs/concepts.md). A layer where a call hangs on the draws (a q
    within Monte-Carlo error of 0.05, ``verdict.unsure``) is scored again on ``EXTEND`` times the draws, and q
    computed again."""
    blocks: dict[int, int] = {}
    for _ in range(2):
        vcols = verdict(config, blocks) if verdict is not None else {}
        got, nulls = [], []
        for layer, lp in sorted(plan.layers.items()):
            for ti in range(len(lp.targets)):
                v = dict(vcols[layer][ti]) if vcols.get(layer) else V.nan_columns(K=config.verdict_draws)
                nulls.append(v.pop("_null", None))
                got.append(v)
        for c in V.COLUMNS:
            df[c] = [v[c] for v in got]
        for p, q in (("p_tilt", "q_tilt"), ("p_static", "q_static")):
            df[p] = [df[p].iat[j] for j in first]
            df[q] = q_values(df["layer"].tolist(), bases, fam, df[p].tolist(), first)
        more = {
            int(r.layer): V.EXTEND
            for r in df[["layer", "p_tilt", "q_tilt", "p_static", "q_static", "verdict_draws"]].itertuples()
            if V.unsure(r.p_tilt, r.q_tilt, r.verdict_draws) or V.unsure(r.p_static, r.q_static, r.verdict_draws)
        }
        if not more.keys() - blocks.keys():
            break
        blocks.update(more)
    return nulls


# the columns a reader needs first: which row, what was decided, the tested effect and its interval, q
FIRST = (
    "layer", "target", "head", "verdict", "tilt", "tilt_ci_lo", "tilt_ci_hi", "q_tilt", "tilt_null_lo",
    "tilt_null_hi", "verdict_static", "static", "static_ci_lo", "static_ci_hi", "q_static", "static_null_lo",
    "static_null_hi", "p_tilt", "p_static", "tilt_lift", "static_lift", "eig_tilt_percentile", "detectable_tilt",
    "verdict_sequences", "verdict_tokens",
)  # fmt: skip


def detectable_tilt(df, first: list[int], families: list[str], nulls: list) -> None:
    """``detectable_tilt``: the smallest lift of the tilt above its null's median each row would have been called
    at with 80% power, alone among its family's m hypotheses (those with a p_tilt), its own error across sequences
    included (``verdict.detectable``)."""
    import numpy as np

    ok = df["p_tilt"].notna().to_numpy()
    m = {f: sum(1 for i, j in enumerate(first) if i == j and families[i] == f and ok[i]) for f in set(families)}
    df["detectable_tilt"] = [
        V.detectable(nl, se, m[f]) if o and nl is not None else np.nan
        for nl, se, f, o in zip(nulls, df["tilt_se"], families, ok)
    ]


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


def detectable_columns(df, first: list[int], families: list[str]) -> None:
    """``detectable_dgamma`` and ``detectable_rho``: the smallest planted Δγ (the verdict's test) and Δρ (rho's
    fitted tail, ``p_rho_tail``) each row would have been called at with 80% power, alone among its family's m
    hypotheses (those with a p), from the run's own sums (``stats.detectable``). Δρ's includes rho's
    cluster-robust error on the null's tokens; Δγ's has no error term (the run keeps no per-sequence Δγ), so
    its power there is about a half; docs/findings.md measures both on planted effects. Δρ's is inf where
    even rho = 1 would not be called."""
    import numpy as np

    ok = df["p_null"].notna().to_numpy()
    m = {f: sum(1 for i, j in enumerate(first) if i == j and families[i] == f and ok[i]) for f in set(families)}
    K = df["null_draws"].to_numpy()
    mf = [m[f] for f in families]
    dg, rho = [], []
    for r, K_, m_ in zip(df.to_dict("records"), K, mf):
        dg.append(
            stats.detectable(r["dgamma"], r["null_dgamma_mean"], r["null_dgamma_sd"], K_, m_, stats.DGAMMA_TAIL_DF)
        )
        se = (r["lift_ci_hi"] - r["lift_ci_lo"]) / (2 * stats.Z95)
        x = stats.detectable(r["rho_null_tokens"], r["null_rho_mean"], r["null_rho_sd"], K_, m_, None, se)
        rho.append(np.inf if x == x and r["rho_null_tokens"] + x > 1 else x)
    df["detectable_dgamma"] = np.where(ok, dg, np.nan)
    df["detectable_rho"] = np.where(ok, rho, np.nan)


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
