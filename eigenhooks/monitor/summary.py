"""From a monitor's sums to the table a user reads: one row per (layer, target).

Pure: it takes each layer's current state (``Accumulator.current``) and the plan, and calls the
formulas of ``stats`` (alignment means, the Haar null band, Monte-Carlo p-values, BH across
layers, cluster-robust intervals, the verdict). Columns: docs/concepts.md, "Statistics".
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from . import stats as M
from .config import MonitorConfig
from .plan import Plan, seed


def target_stats(plan: Plan, current: Callable[[int], dict]) -> dict[tuple[int, str], dict[str, float]]:
    """(layer, target) -> the raw per-target sums and counts (``stats.TGT_FIELDS``)."""
    out = {}
    for layer, lp in sorted(plan.layers.items()):
        tg = current(layer)["tgt"]
        for ti, meta in enumerate(lp.meta):
            out[(layer, meta.name)] = dict(zip(M.TGT_FIELDS, tg[ti].tolist()))
    return out


def summary_table(
    plan: Plan, current: Callable[[int], dict[str, torch.Tensor]], config: MonitorConfig, post_norm: bool
):
    """pandas DataFrame, one row per (layer, target).

    Args:
        plan: what was measured. current: layer -> its state, open sequences folded in (float64, CPU).
        config: the settings (the null seed is recorded). post_norm: the model normalises after the residual.
    """
    import pandas as pd

    rows = []
    for layer, lp in sorted(plan.layers.items()):
        st = current(layer)
        for ti, (t, meta) in enumerate(zip(lp.targets, lp.meta)):
            s = meta.spec
            row = {"layer": layer, "target": meta.name, "variant": meta.variant, "rank": meta.rank, "k": t.k}
            row.update(
                kind=s.kind if s else "custom",
                lambda_1_re=s.lambda_1.real if s else float("nan"),
                lambda_1_im=s.lambda_1.imag if s else float("nan"),
                abs_lambda_1=abs(s.lambda_1) if s else float("nan"),
                gap_ratio=s.gap_ratio if s else float("nan"),
            )
            tie = seed(config, layer, 1000)
            row.update(M.summarize(st, ti, lp.bases.k_index[ti], t.k, post_norm=post_norm, tie_seed=tie))
            row["null_seed"] = config.null_seed
            rows.append(row)
    df = pd.DataFrame(rows)
    if len(df):
        df["q_null"] = float("nan")
        for _, idx in df.groupby("target").groups.items():
            df.loc[idx, "q_null"] = M.bh(df.loc[idx, "p_null"].to_numpy())
        df["verdict"] = [M.verdict(q, lift) for q, lift in zip(df["q_null"], df["lift"])]
    return df


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
