"""What a notebook reaches for after a monitored pass: ``mon.plot()`` and ``mon.tokens()``.

A mixin of ``Monitor``: both read only what the monitor already holds (its summary, its per-token
records), so they live apart from the forward's machinery.
"""

from __future__ import annotations

# the per-token frame's columns, in order
TOKEN_COLUMNS = ("forward", "layer", "target", "sequence", "position", "a_pre", "a_mid", "a_post", "delta", "up")


class NotebookViews:
    """``plot`` and ``tokens`` for ``Monitor`` (which provides ``summary()`` and ``token_records``)."""

    def plot(self, target: str | None = None):
        """rho by layer with its Haar null band (top) and gamma against its null (below), one column per
        target, as one matplotlib Figure; a notebook shows it inline as the cell's value.

        Args:
            target: one target ('modulus', 'residual', 'ov/modulus', a custom name, a head's
                'ov_head/modulus/h3'); None: every target but the heads'
                (a column per head is no plot) when there are others.

        Example:
            >>> with eh.monitor(model) as mon:
            ...     model(**batch)
            >>> fig = mon.plot("modulus")          # in Jupyter: the figure, inline
        """
        from ..plots import by_layer
        from .summary import layer_rows

        df = self.summary()
        if target is None and len(layer_rows(df)):
            df = layer_rows(df)
        return by_layer(df, target)

    def tokens(self):
        """The per-token records of ``eigenhooks.monitor(..., tokens=True)`` as a pandas DataFrame: one
        row per (forward, layer, sequence, position) of a valid token (padding left out), with its
        alignment a(x) at each reading point, ``delta`` = a_mid - a_pre and ``up`` = delta > 0 (what rho
        counts). ``position`` is the column in that forward's input (under a KV cache, in the step).

        Raises:
            ValueError: the monitor was made without ``tokens=True``, so it kept no records.
        """
        import numpy as np
        import pandas as pd

        if not getattr(self.config, "tokens", False):
            raise ValueError("no per-token records: make the monitor with eh.monitor(model, tokens=True)")
        frames = []
        for rec in self.token_records:
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
