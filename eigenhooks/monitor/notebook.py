"""What a notebook reaches for after a monitored pass: ``Monitor.plot`` and ``Monitor.tokens``, drawn here.

Both read only what the monitor already holds (its summary, its per-token records), so they live
apart from the forward's machinery, as functions the monitor's two methods call.
"""

from __future__ import annotations

# the per-token frame's columns, in order
TOKEN_COLUMNS = ("forward", "layer", "target", "sequence", "position", "a_pre", "a_mid", "a_post", "delta", "up")


def plot(df, target: str | None = None):
    """rho by layer with its Haar null band (top) and gamma against its null (below), one column per
    target, from a monitor's summary ``df`` (``Monitor.plot``)."""
    from ..plots import by_layer
    from .summary import layer_rows

    if target is None and len(layer_rows(df)):
        df = layer_rows(df)
    return by_layer(df, target)


def token_frame(token_records: list[dict]):
    """The per-token records as a pandas DataFrame (``Monitor.tokens``)."""
    import numpy as np
    import pandas as pd

    frames = []
    for rec in token_records:
        mask = rec["mask"].bool().numpy()  # (batch, pos): the valid tokens
        seq, pos = np.nonzero(mask)
        cols = {"forward": rec["forward"], "layer": rec["layer"], "target": rec["target"]}
        cols.update(sequence=seq, position=pos)
        for p in ("pre", "mid", "post"):
            a = rec.get(f"a_{p}")
            cols[f"a_{p}"] = a.float().numpy()[mask] if a is not None else np.full(len(seq), np.nan)
        frames.append(pd.DataFrame(cols))
    if not frames:
        return pd.DataFrame({c: [] for c in TOKEN_COLUMNS})
    df = pd.concat(frames, ignore_index=True)
    df["delta"] = df["a_mid"] - df["a_pre"]
    df["up"] = df["delta"] > 0
    return df[list(TOKEN_COLUMNS)].sort_values(["forward", "layer", "sequence", "position"], ignore_index=True)
