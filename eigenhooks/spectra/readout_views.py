"""How a token readout prints: a line or two (``repr``), a table (``to_frame``), a notebook view.

The repr gives what a reader checks first: the statistic against its null band, the p-value, and the
first tokens at each end; ``to_frame`` lists every token with its score, one row per (end, rank).
"""

from __future__ import annotations

import html
import math

SHOWN = 5  # tokens at each end in the repr


def _p(p: float) -> str:
    if p is None or not math.isfinite(p):
        return "nan"
    return f"{p:.2g}" if p >= 1e-3 else f"{p:.1e}"


def _tokens(pairs, n: int = SHOWN) -> str:
    more = f" … ({len(pairs) - n} more)" if len(pairs) > n else ""
    return " ".join(repr(t) for t, _ in pairs[:n]) + more


def headline(r) -> str:
    """TokenReadout(direction, out, k=10: score 0.408, null 0.118-0.168 (100 draws), p 1.8e-09)."""
    band = f"null {r.null_lo:.3f}-{r.null_hi:.3f} ({r.null_draws} draws)" if r.null_draws else "no null"
    return f"TokenReadout({r.kind}, {r.side}, k={r.k}: score {r.score:.3f}, {band}, p {_p(r.p)})"


def readout_repr(r) -> str:
    lines = [headline(r), f"  top: {_tokens(r.top)}"]
    if r.bottom:
        lines.append(f"  bottom: {_tokens(r.bottom)}")
    return "\n".join(lines)


def to_frame(r):
    """One row per listed token: end ('top' or 'bottom'), rank (1 = the extreme), token, score."""
    import pandas as pd

    rows = [("top", i + 1, t, v) for i, (t, v) in enumerate(r.top)]
    rows += [("bottom", i + 1, t, v) for i, (t, v) in enumerate(r.bottom)]
    df = pd.DataFrame(rows, columns=["end", "rank", "token", "score"])
    df.attrs.update(score=r.score, null_lo=r.null_lo, null_hi=r.null_hi, null_draws=r.null_draws, p=r.p)
    return df


def repr_html(r) -> str:
    table = to_frame(r).assign(token=lambda d: d["token"].map(repr))
    body = table.to_html(index=False, float_format=lambda x: f"{x:.4f}")
    return f"<div><code>{html.escape(headline(r))}</code>{body}</div>"
